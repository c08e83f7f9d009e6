"""Fused CPU kernels for PowerNorm, its relatives, DyT and Derf (float32, contiguous `(tokens, C)` inputs).

The loader of the C kernels (their source: `kernels_cpu_source.py`) and of DyT's and Derf's torch
operator (its C++ source: `kernels_cpu_operator_source.py`), and the Python functions that call
them: `pn_step_forward`/`pn_step_backward` (a whole PN training step in one call each way),
`pnv_step_*` (PN-V), `bn_step_*` (masked BN and BRN), `mabn_step_*` (MABN), `norm_eval` (every
eval-mode norm in one pass), `elementwise_forward`/`elementwise_backward` (DyT and Derf), and PN's
parts `pn_rows`, `pn_backward`, `pn_statistics` and `pn_gradient_statistics`.

`load()` compiles the C source on first use with the system C compiler into a private cache
(`$HF_POWERNORM_CACHE`, else `$XDG_CACHE_HOME/hf_powernorm`, else `~/.cache/hf_powernorm`), loads
the library with `ctypes` only when the record next to it names this source, these flags and the
library's own hash, and binds each function from `_SIGNATURES`. Without a compiler, or with
`HF_POWERNORM_KERNELS=0`, it returns None and the norms run their torch ops (the same results to
float32 rounding, tested). `load_operator()` builds the operator with the C++ compiler and torch's
headers into the same cache (about 15 s, once per torch build; without it, or with
`HF_POWERNORM_OPERATOR=0`, None). Why the kernels are written as they are: docs/cpu_kernels.md;
what the cache checks: docs/trust.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import tempfile
from ctypes import c_float, c_int, c_long, c_longlong, c_void_p

import torch

from .kernels_cpu_operator_source import OPERATOR_SOURCE
from .kernels_cpu_source import C_SOURCE

logger = logging.getLogger(__name__)

# -march=native: the vector width of this CPU (AVX2/AVX-512), as torch's own kernels dispatch to it.
# The library is then specific to the CPU, whose identity is part of the digest that names it.
# -fno-math-errno: nothing here reads errno, and with it sqrtf vectorises (the same correctly
# rounded results); a small eval call's per-channel scale took 0.6 us of its 3.1 without it.
# -fno-trapping-math: nothing here reads the floating-point exception flags either, and with it
# floorf and the selects of DyT's and Derf's functions vectorise (the same results).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=c99"]
_library = None
_tried = False
from .norm_functional import GROUP_SCALE_EPS  # noqa: E402 - the constant lives with the maths


def _cache_dir() -> pathlib.Path:
    if os.environ.get("HF_POWERNORM_CACHE"):
        return pathlib.Path(os.environ["HF_POWERNORM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "hf_powernorm"


def _check_parents(path: pathlib.Path) -> None:
    """Refuse `path` when a folder above it (as written or resolved) can be written by others and is not
    sticky: another user could rename the cache away and put their own in its place."""
    path = path.absolute()
    for parent in {*path.parents, *path.resolve().parents}:
        mode = parent.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
            raise RuntimeError(f"kernel cache {path} lies in {parent}, which others can write "
                               f"(mode {stat.S_IMODE(mode):o}, not sticky); set HF_POWERNORM_CACHE to a private folder")


def _private_dir(path: pathlib.Path) -> pathlib.Path:
    """`path`, created with mode 0700, or made 0700 when it is ours; another user's is refused, as is a
    folder under one others can write. Tightened, it loses the files named as the cache names its own
    (`powernorm_*`), which others could have planted; other files are left alone."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_parents(path)
    info = path.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise RuntimeError(f"kernel cache {path} belongs to another user (uid {info.st_uid})")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
        for planted in path.glob("powernorm_*"):
            if planted.is_dir() and not planted.is_symlink():
                shutil.rmtree(planted)
            else:
                planted.unlink()
    return path


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags (what `-march=native` compiles for)."""
    try:
        with open("/proc/cpuinfo") as handle:
            lines = [line for line in handle if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _source_digest() -> str:
    return hashlib.sha256("\0".join([C_SOURCE, *_FLAGS, _cpu_identity()]).encode()).hexdigest()


def _file_digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record_path(target: pathlib.Path) -> pathlib.Path:
    return target.with_suffix(".json")


def _open_own_file(path: pathlib.Path) -> int:
    """A read-only descriptor of `path` after `lstat` found a regular file (not a link) this user owns,
    opened without following a link and checked by `fstat` to be that same file."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        raise OSError(f"{path} is not a regular file of this user's")
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    opened = os.fstat(descriptor)
    if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
        os.close(descriptor)
        raise OSError(f"{path} changed while it was opened")
    return descriptor


def _descriptor_digest(descriptor: int) -> str:
    with os.fdopen(os.dup(descriptor), "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _trusted_descriptor(target: pathlib.Path, digest: str | None = None) -> int | None:
    """An open descriptor of `target` when the record next to it names this source and flags (`digest`,
    the C library's by default) and the hash of the bytes read through that descriptor; else None."""
    try:
        with os.fdopen(_open_own_file(_record_path(target)), "rb") as handle:
            record = json.loads(handle.read())
        if record.get("source_and_flags") != (_source_digest() if digest is None else digest):
            return None
        descriptor = _open_own_file(target)
    except (OSError, ValueError, AttributeError):
        return None
    try:
        if _descriptor_digest(descriptor) == record.get("library"):
            return descriptor
    except OSError:
        pass
    os.close(descriptor)
    return None


def _trusted(target: pathlib.Path, digest: str | None = None) -> bool:
    """Whether a record of `digest` (the C library's by default) trusts `target` (`_trusted_descriptor`)."""
    descriptor = _trusted_descriptor(target, digest)
    if descriptor is not None:
        os.close(descriptor)
    return descriptor is not None


def _descriptor_path(descriptor: int) -> str | None:
    path = f"/proc/self/fd/{descriptor}"
    return path if os.path.exists(path) else None


def _load_opened(descriptor: int, target: pathlib.Path, loader):
    """`loader(path)` on the file open as `descriptor`, whose bytes were hashed: through `/proc/self/fd/N`
    where that exists; elsewhere by `target`, refused when it names another file before or after loading.
    The descriptor stays open: the dynamic loader knows a library by its path, and a number reused by a
    later file would name the library already loaded."""
    opened = os.fstat(descriptor)

    def unchanged() -> bool:
        info = os.lstat(target)
        return (info.st_dev, info.st_ino) == (opened.st_dev, opened.st_ino)

    try:
        by_descriptor = _descriptor_path(descriptor)
        if by_descriptor is not None:
            return loader(by_descriptor)
        if not unchanged():
            raise RuntimeError(f"{target} was replaced after its hash was checked")
        loaded = loader(str(target))
        if not unchanged():
            raise RuntimeError(f"{target} was replaced while it was loaded")
        return loaded
    except BaseException:
        os.close(descriptor)
        raise


def _write_atomically(target: pathlib.Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as handle:
        handle.write(data)
    os.replace(handle.name, target)


def _compiler(variable: str, names: tuple[str, ...], what: str) -> str:
    """The compiler `$variable` names, else the first of `names` on PATH."""
    compiler = os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)
    if compiler is None:
        raise RuntimeError(f"no {what} ({'/'.join(names)}) on PATH")
    return compiler


def _compile_source(target: pathlib.Path, compiler: str, text: str, source_name: str, flags: list[str],
                    libraries: list[str], record: dict) -> None:
    """`compiler flags <source> -o <library> libraries` in a temporary folder beside `target` (`text`
    written there as `source_name`); the library renamed to `target`, then its record (`record` with
    the library's hash) written next to it."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = pathlib.Path(tmp) / source_name
        source.write_text(text)
        built = pathlib.Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built), *libraries], check=True, capture_output=True)
        record = {**record, "library": _file_digest(built)}
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file
        _write_atomically(_record_path(target), json.dumps(record).encode())


def _compile(target: pathlib.Path) -> None:
    _compile_source(target, _compiler("CC", ("cc", "gcc"), "C compiler"), C_SOURCE, "powernorm_cpu.c", _FLAGS,
                    ["-lm"], {"source_and_flags": _source_digest(), "flags": _FLAGS})


@contextlib.contextmanager
def _build_lock(target: pathlib.Path):
    """One build at a time of `target` across processes (two test workers, two ranks): the second
    waits and then finds the first's library. Without `fcntl` (not POSIX), no lock: the atomic
    replace still keeps a half-written file from being loaded."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock = target.with_suffix(".lock")
    try:  # never through a link: a planted one would have the lock created or opened at its target
        descriptor = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        if os.path.islink(lock):
            raise RuntimeError(f"kernel cache lock {lock} is a symbolic link; remove it") from err
        raise
    with os.fdopen(descriptor, "r+b") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise RuntimeError(f"kernel cache lock {lock} is not a regular file")
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _built(target: pathlib.Path, digest: str, build, announce: str | None = None) -> int:
    """An open descriptor of `target` once a record of `digest` trusts it: built by `build(target)` where
    none does, one process at a time (another's build waited for, then used); `announce` logged before a
    build."""
    descriptor = _trusted_descriptor(target, digest)
    if descriptor is None:
        with _build_lock(target):
            descriptor = _trusted_descriptor(target, digest)
            if descriptor is None:  # else built by another process while this one waited
                if announce:
                    logger.warning(announce)
                build(target)
                descriptor = _trusted_descriptor(target, digest)
                if descriptor is None:
                    raise RuntimeError(f"{target} changed while it was being built")
    return descriptor


def _warn_unavailable(what: str, err: BaseException, instead: str) -> None:
    detail = getattr(err, "stderr", b"") or b""
    logger.warning("%s unavailable (%s %s); %s", what, err, detail.decode(errors="replace")[-500:], instead)


# Each C function's (return type, argument types), in the order of its parameters in the C source:
# a pointer (`c_void_p`) is a tensor's data, NULL or a `ctypes.byref` output; a bool passes as an int.
_SIGNATURES = {
    "pn_rows": (None, [c_void_p, c_void_p, c_long, c_long, c_long, c_float, c_int, c_void_p, c_void_p, c_void_p,
                       c_void_p]),
    "pn_backward": (None, [c_void_p, c_void_p, c_void_p, c_int, c_long, c_long, c_long, c_float, c_int, c_void_p,
                           c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p]),
    "pn_statistics": (c_int, [c_void_p, c_float, c_long, c_void_p, c_void_p, c_float, c_long, c_long, c_float,
                              c_int, c_int, c_void_p, c_void_p, c_void_p]),
    "pn_gradient_statistics": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_float, c_long, c_int,
                                       c_float, c_void_p, c_void_p]),
    "pn_step_forward": (c_int, [c_void_p, c_void_p, c_int, c_long, c_long, c_long, c_float, c_int, c_void_p,
                                c_void_p, c_void_p, c_void_p, c_float, c_long, c_long, c_float, c_int, c_int, c_int,
                                c_void_p, c_void_p, c_void_p]),
    "pn_step_backward": (c_int, [c_void_p, c_void_p, c_void_p, c_int, c_long, c_long, c_long, c_float, c_int,
                                 c_void_p, c_void_p, c_void_p, c_float, c_int, c_float, c_int, c_void_p, c_void_p]),
    "pnv_step_forward": (c_int, [c_void_p, c_void_p, c_int, c_long, c_long, c_long, c_float, c_int, c_void_p,
                                 c_void_p, c_void_p, c_void_p, c_float, c_float, c_int, c_int, c_void_p, c_void_p,
                                 c_void_p]),
    "pnv_step_backward": (None, [c_void_p, c_void_p, c_void_p, c_int, c_long, c_long, c_long, c_float, c_int,
                                 c_void_p, c_void_p, c_float, c_int, c_int, c_void_p, c_void_p]),
    "bn_step_forward": (c_int, [c_void_p, c_void_p, c_int, c_long, c_long, c_int, c_void_p, c_void_p, c_void_p,
                                c_void_p, c_void_p, c_float, c_float, c_int, c_float, c_float, c_int, c_int,
                                c_void_p, c_void_p, c_void_p]),
    "bn_step_backward": (None, [c_void_p, c_void_p, c_void_p, c_int, c_long, c_long, c_int, c_void_p, c_void_p,
                                c_float, c_int, c_int, c_void_p, c_void_p]),
    "mabn_step_forward": (c_int, [c_void_p, c_void_p, c_int, c_long, c_long, c_int, c_void_p, c_void_p, c_void_p,
                                  c_void_p, c_long, c_void_p, c_float, c_float, c_long, c_float, c_long, c_int,
                                  c_int, c_void_p, c_void_p, c_void_p]),
    "mabn_step_backward": (c_int, [c_void_p, c_void_p, c_void_p, c_int, c_long, c_long, c_int, c_void_p, c_void_p,
                                   c_void_p, c_long, c_longlong, c_long, c_float, c_int, c_int, c_void_p, c_void_p]),
    "norm_eval": (None, [c_void_p, c_long, c_long, c_long, c_float, c_int, c_void_p, c_void_p, c_void_p, c_void_p,
                         c_float, c_int, c_void_p]),
    "elementwise_forward": (None, [c_void_p, c_long, c_long, c_int, c_float, c_float, c_void_p, c_void_p, c_int,
                                   c_void_p]),
    "elementwise_backward": (None, [c_void_p, c_void_p, c_long, c_long, c_int, c_float, c_float, c_void_p, c_int,
                                    c_void_p, c_void_p]),
}


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when disabled or unavailable."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    if os.environ.get("HF_POWERNORM_KERNELS", "1") == "0":
        return None
    try:
        digest = _source_digest()
        target = _private_dir(_cache_dir()) / f"powernorm_cpu_{digest[:16]}.so"
        _library = _bind(_load_opened(_built(target, digest, _compile), target, ctypes.CDLL))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        _warn_unavailable("PowerNorm CPU kernels", err, "using the eager implementation")
        _library = None
    return _library


def kernels_usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels apply to this input (CPU float32, kernels built)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _float_vector(values: torch.Tensor) -> torch.Tensor:
    return values.detach().float().contiguous()


def pn_rows(x: torch.Tensor, token_weights: torch.Tensor | None, group_num: int | None,
            scale: torch.Tensor | None = None, shift: torch.Tensor | None = None, statistics: bool = True,
            eps: float = GROUP_SCALE_EPS):
    """One pass over contiguous float32 `x` (tokens, C) with `z0 = GS(x)`: `(y, sum_V z0^2)`, where
    `y = z0 * scale + shift` when `scale` is given (else None); when `statistics`, the float32 sums
    (C,) and the real-token count as a float (else None, None): `(y, sum_sq, count)`."""
    tokens, channels = x.shape
    y = None if scale is None else torch.empty_like(x)
    sums = torch.empty(channels + 1, dtype=torch.float64) if statistics else None
    scale, shift = (None if vector is None else _float_vector(vector) for vector in (scale, shift))
    _library.pn_rows(_ptr(x), _ptr(token_weights), tokens, channels, group_num or 0, eps, torch.get_num_threads(),
                     _ptr(scale), _ptr(shift), _ptr(y), _ptr(sums))
    if sums is None:
        return y, None, None
    sums = sums.float()
    return y, sums[:-1], float(sums[-1])


# Outputs (y, dx) from this size on are written with streaming stores, past the core's caches: an
# ordinary store first reads each output line it misses, a third of the traffic. Measured on the
# benchmark machine (2 MiB of L2 per core; study stopped, interleaved against ordinary stores):
# PN's, masked BN's and MABN's training steps took 0.75-0.83x at 4-8 MiB, PN's eval map 0.74-0.85x
# at 6-8 MiB and 0.95-1.02x at 4 MiB, but 1.22x on two threads at 2 MiB; a whole model's train
# step and eval forward with 8 MiB norm tensors did not change (1.00x: its norms are 1-2% of it).
STREAM_BYTES = 4 << 20


def norm_eval(x: torch.Tensor, group_num: int | None, weight: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, mean: torch.Tensor | None = None, var: torch.Tensor | None = None,
              eps: float = 0.0, group_eps: float = GROUP_SCALE_EPS) -> torch.Tensor:
    """An eval-mode norm of contiguous float32 `x` (..., C) in one pass (no autograd), shaped as `x`:
    `GS(x) * scale + shift`, `scale = weight / sqrt(var + eps)`, `shift = bias - mean * scale`, each
    vector float32 and contiguous or None (weight 1, bias and mean 0, no var: scale = weight)."""
    channels = x.shape[-1]
    tokens = x.numel() // channels if channels else 0
    y = torch.empty_like(x)
    _library.norm_eval(x.data_ptr(), tokens, channels, group_num or 0, group_eps, torch.get_num_threads(),
                       weight if weight is None else weight.data_ptr(), bias if bias is None else bias.data_ptr(),
                       mean if mean is None else mean.data_ptr(), var if var is None else var.data_ptr(), eps,
                       tokens * channels * 4 >= STREAM_BYTES, y.data_ptr())
    return y


def group_scale(x: torch.Tensor, group_num: int) -> torch.Tensor:
    """`GS(x)` of contiguous float32 `x` (..., C) in one pass (no autograd)."""
    return norm_eval(x, group_num)


def pn_backward(dy: torch.Tensor, x: torch.Tensor, token_weights: torch.Tensor | None, group_num: int | None,
                weight: torch.Tensor, nu: torch.Tensor, inv_s: torch.Tensor, inv_s_b: torch.Tensor,
                eps: float = GROUP_SCALE_EPS, input_gradient: bool = True):
    """One pass over contiguous float32 `dy` and `x`: `dx` from `dz0 = dy * a - (real) * c * z0`,
    `a = weight * inv_s_b`, `c = nu * inv_s * inv_s_b`, through the group-scaling backward, and the
    float64 sums `(sum_all dy*z0, sum_V dy*z0, sum_all dy)` (3, C); `dx` is None without
    `input_gradient` (the sums only). `token_weights`: float 0/1 weights or a mask of `MASK_KINDS`."""
    tokens, channels = x.shape
    dx = torch.empty_like(x) if input_gradient else None
    sums = torch.empty(3, channels, dtype=torch.float64)
    vectors = [_float_vector(t) for t in (weight, nu, inv_s, inv_s_b)]  # kept alive across the call
    _library.pn_backward(_ptr(dy), _ptr(x), *_mask_args(token_weights, tokens), tokens, channels, group_num or 0,
                         eps, torch.get_num_threads(), *map(_ptr, vectors), _ptr(dx), _ptr(sums[0]), _ptr(sums[1]),
                         _ptr(sums[2]))
    return dx, sums


SQUASH = {"tanh": 0, "erf": 1}  # DyT's and Derf's functions, as `elementwise_*` name them


def elementwise_forward(x: torch.Tensor, function: str, alpha: float, shift: float, weight: torch.Tensor,
                        bias: torch.Tensor) -> torch.Tensor:
    """DyT (`function="tanh"`) or Derf (`"erf"`) of contiguous float32 `x` (tokens, C) in one pass:
    `weight * f(alpha * x + shift) + bias`, `weight` and `bias` float32 and contiguous."""
    tokens, channels = x.shape
    y = torch.empty_like(x)
    _library.elementwise_forward(x.data_ptr(), tokens, channels, SQUASH[function], alpha, shift, weight.data_ptr(),
                                 bias.data_ptr(), torch.get_num_threads(), y.data_ptr())
    return y


def elementwise_backward(dy: torch.Tensor, x: torch.Tensor, function: str, alpha: float, shift: float,
                         weight: torch.Tensor, input_gradient: bool = True):
    """Their backward in one pass over contiguous float32 `dy` and `x` (tokens, C): `(dx, grads)`, `dx`
    None without `input_gradient`; `grads` float32 (2C + 2, summed in float64): dweight, dbias,
    dalpha, dshift."""
    tokens, channels = x.shape
    dx = torch.empty_like(x) if input_gradient else None
    grads = torch.empty(2 * channels + 2)
    _library.elementwise_backward(dy.data_ptr(), x.data_ptr(), tokens, channels, SQUASH[function], alpha, shift,
                                  weight.data_ptr(), torch.get_num_threads(), _ptr(dx), grads.data_ptr())
    return dx, grads


MASK_KINDS = {torch.float32: 1, torch.int64: 2, torch.bool: 3, torch.uint8: 3}


def pn_step_forward(x: torch.Tensor, mask: torch.Tensor | None, group_num: int | None, weight: torch.Tensor,
                    bias: torch.Tensor, running_phi: torch.Tensor, counter: torch.Tensor, eps: float,
                    warmup_steps: int, ramp_steps: int, ema_rate: float, reference: bool, batch_backward: bool,
                    group_eps: float = GROUP_SCALE_EPS):
    """PowerNorm's training forward in one C call (`pn_rows` and `pn_statistics` together):
    `(status, y, stats, count)` with `stats` (3, C) = `(v, 1/s, 1/s_backward)`, updating
    `running_phi` and `counter` in place; `mask` is a contiguous `(tokens,)` tensor of a
    `MASK_KINDS` dtype, read as it is; every vector float32 and contiguous."""
    tokens, channels = x.shape
    y, stats, count = torch.empty_like(x), torch.empty(3, channels), ctypes.c_float()
    status = _library.pn_step_forward(
        x.data_ptr(), *_mask_args(mask, tokens), tokens, channels, group_num or 0, group_eps,
        torch.get_num_threads(), weight.data_ptr(), bias.data_ptr(), running_phi.data_ptr(), _counter_ptr(counter),
        eps, warmup_steps, ramp_steps, ema_rate, reference, batch_backward, tokens * channels * 4 >= STREAM_BYTES,
        y.data_ptr(), stats.data_ptr(), ctypes.byref(count))
    return status, y, stats, count.value


def pn_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, group_num: int | None,
                     weight: torch.Tensor, running_nu: torch.Tensor, stats: torch.Tensor, count: float, usable: bool,
                     rate: float, group_eps: float = GROUP_SCALE_EPS):
    """PowerNorm's backward in one C call (`pn_backward` and `pn_gradient_statistics` together):
    `(status, dx, grads)` with `grads` (2, C) = `(dweight, dbias)`, updating `running_nu` in place."""
    tokens, channels = x.shape
    dx, grads = torch.empty_like(x), torch.empty(2, channels)
    status = _library.pn_step_backward(
        dy.data_ptr(), x.data_ptr(), *_mask_args(mask, tokens), tokens, channels, group_num or 0, group_eps,
        torch.get_num_threads(), weight.data_ptr(), running_nu.data_ptr(), stats.data_ptr(), count, usable, rate,
        tokens * channels * 4 >= STREAM_BYTES, dx.data_ptr(), grads.data_ptr())
    return status, dx, grads


def counter_usable(counter: torch.Tensor) -> bool:
    """Whether the C kernels may take `counter` as a step counter, which they read and write as one
    `long long`: a contiguous one-element int64 CPU tensor (an int32 one would be read and written
    past its end)."""
    return (counter.dtype == torch.int64 and counter.is_contiguous() and counter.numel() == 1
            and counter.device.type == "cpu")


def _counter_ptr(counter: torch.Tensor) -> int:
    """The data pointer of a step counter; one `counter_usable` refuses is a TypeError naming it."""
    if not counter_usable(counter):
        raise TypeError(f"counter must be a contiguous one-element torch.int64 CPU tensor (the C kernels read and "
                        f"write it as a long long), got dtype {counter.dtype}, shape {tuple(counter.shape)}, "
                        f"contiguous {counter.is_contiguous()}, device {counter.device}")
    return counter.data_ptr()


def _mask_args(mask: torch.Tensor | None, tokens: int) -> tuple:
    """`(pointer, kind)` of a `(tokens,)` mask as the C kernels read it (NULL, 0 without one): a
    contiguous CPU tensor of a `MASK_KINDS` dtype with one element per token, else a TypeError naming
    it (an int64 mask is read as `long long`, a strided or short one past its end)."""
    if mask is None:
        return None, 0
    if (mask.dtype not in MASK_KINDS or not mask.is_contiguous() or mask.numel() != tokens
            or mask.device.type != "cpu"):
        raise TypeError(f"mask must be a contiguous CPU tensor of {tokens} elements of a dtype of "
                        f"{sorted(map(str, MASK_KINDS))}, got dtype {mask.dtype}, shape {tuple(mask.shape)}, "
                        f"contiguous {mask.is_contiguous()}, device {mask.device}")
    return mask.data_ptr(), MASK_KINDS[mask.dtype]


def bn_step_forward(x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                    running_mean: torch.Tensor, running_var: torch.Tensor, counter: torch.Tensor, eps: float,
                    momentum: float, renorm: bool, rmax: float, dmax: float, reused: torch.Tensor | None = None):
    """Masked BN's or BRN's training forward in one C call: `(status, y, out, count)`, `out` (4, C) =
    `(mean, 1/sigma, r, d)` of the step, updating the running statistics and `counter` in place;
    with `reused` (a recomputation: the step's `out`) the output pass alone. Contiguous float32 vectors."""
    tokens, channels = x.shape
    y, count = torch.empty_like(x), ctypes.c_float(0.0)
    out = torch.empty(4, channels) if reused is None else reused
    status = _library.bn_step_forward(
        x.data_ptr(), *_mask_args(mask, tokens), tokens, channels, torch.get_num_threads(), weight.data_ptr(),
        bias.data_ptr(), running_mean.data_ptr(), running_var.data_ptr(), _counter_ptr(counter), eps, momentum,
        renorm, rmax, dmax, reused is not None, tokens * channels * 4 >= STREAM_BYTES, y.data_ptr(), out.data_ptr(),
        ctypes.byref(count))
    return status, y, out, count.value


def pnv_step_forward(x: torch.Tensor, mask: torch.Tensor | None, group_num: int | None, weight: torch.Tensor,
                     bias: torch.Tensor, running_phi: torch.Tensor, counter: torch.Tensor, eps: float, ema_rate: float,
                     update: bool):
    """PN-V's training forward in one C call: `(status, y, inv_s, count)`, updating `running_phi` and
    `counter` in place for a usable batch when `update`. Contiguous float32 vectors."""
    tokens, channels = x.shape
    y, inv_s, count = torch.empty_like(x), torch.empty(channels), ctypes.c_float(0.0)
    status = _library.pnv_step_forward(
        x.data_ptr(), *_mask_args(mask, tokens), tokens, channels, group_num or 0, GROUP_SCALE_EPS,
        torch.get_num_threads(), weight.data_ptr(), bias.data_ptr(), running_phi.data_ptr(), _counter_ptr(counter),
        eps, ema_rate, update, tokens * channels * 4 >= STREAM_BYTES, y.data_ptr(), inv_s.data_ptr(),
        ctypes.byref(count))
    return status, y, inv_s, count.value


def pnv_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, group_num: int | None,
                      weight: torch.Tensor, inv_s: torch.Tensor, count: float, usable: bool):
    """The backward of `pnv_step_forward` in one C call (a sums pass, then the input gradient):
    `(dx, grads)`, `grads` (2, C) = `(dweight, dbias)`."""
    tokens, channels = x.shape
    dx, grads = torch.empty_like(x), torch.empty(2, channels)
    weight = _float_vector(weight)
    _library.pnv_step_backward(dy.data_ptr(), x.data_ptr(), *_mask_args(mask, tokens), tokens, channels,
                               group_num or 0, GROUP_SCALE_EPS, torch.get_num_threads(), weight.data_ptr(),
                               inv_s.data_ptr(), count, usable, tokens * channels * 4 >= STREAM_BYTES, dx.data_ptr(),
                               grads.data_ptr())
    return dx, grads


def mabn_step_forward(x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                      running_phi: torch.Tensor, window_phi: torch.Tensor, counter: torch.Tensor, eps: float,
                      momentum: float, warmup_steps: int, rmax: float, renorm_warmup_steps: int,
                      reused: torch.Tensor | None = None):
    """MABN's training forward in one C call: `(status, y, out, count)`, `out` (2, C) = `(1/chi, r)` of
    the step, updating `running_phi`, `window_phi` and `counter` in place; with `reused` (a
    recomputation: the step's `out`) the output pass alone. Contiguous float32 vectors."""
    tokens, channels = x.shape
    y, count = torch.empty_like(x), ctypes.c_float(0.0)
    out = torch.empty(2, channels) if reused is None else reused
    status = _library.mabn_step_forward(
        x.data_ptr(), *_mask_args(mask, tokens), tokens, channels, torch.get_num_threads(), weight.data_ptr(),
        bias.data_ptr(), running_phi.data_ptr(), window_phi.data_ptr(), window_phi.shape[0], _counter_ptr(counter),
        eps, momentum, warmup_steps, rmax, renorm_warmup_steps, reused is not None,
        tokens * channels * 4 >= STREAM_BYTES, y.data_ptr(), out.data_ptr(), ctypes.byref(count))
    return status, y, out, count.value


def mabn_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor,
                       out: torch.Tensor, window_gz: torch.Tensor, step: int, warmup_steps: int, count: float,
                       usable: bool):
    """The backward of `mabn_step_forward` in one C call: `(status, dx, grads)`, `grads` (2, C) =
    `(dweight, dbias)`, updating `window_gz` in place; status -1: a non-finite gradient statistic."""
    tokens, channels = x.shape
    dx, grads = torch.empty_like(x), torch.empty(2, channels)
    weight = _float_vector(weight)
    status = _library.mabn_step_backward(
        dy.data_ptr(), x.data_ptr(), *_mask_args(mask, tokens), tokens, channels, torch.get_num_threads(),
        weight.data_ptr(), out.data_ptr(), window_gz.data_ptr(), window_gz.shape[0], step, warmup_steps, count, usable,
        tokens * channels * 4 >= STREAM_BYTES, dx.data_ptr(), grads.data_ptr())
    return status, dx, grads


def bn_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, count: float, usable: bool):
    """The backward of `bn_step_forward` in one C call: `(dx, grads)`, `grads` (2, C) = `(dweight, dbias)`."""
    tokens, channels = x.shape
    dx, grads = torch.empty_like(x), torch.empty(2, channels)
    _library.bn_step_backward(dy.data_ptr(), x.data_ptr(), *_mask_args(mask, tokens), tokens, channels,
                              torch.get_num_threads(), weight.data_ptr(), out.data_ptr(), count, usable,
                              tokens * channels * 4 >= STREAM_BYTES, dx.data_ptr(), grads.data_ptr())
    return dx, grads


def pn_statistics(sum_sq: torch.Tensor, count: float, running_phi: torch.Tensor, counter: torch.Tensor,
                  eps: float, warmup_steps: int, ramp_steps: int, ema_rate: float, reference: bool,
                  batch_backward: bool):
    """PowerNorm's step statistics on the CPU (what `norm_dispatch._pn_denominators` computes):
    `(status, v, 1/s, 1/s_backward)`, updating float32 `running_phi` and the int64 `counter` in
    place for a usable batch; status 1 usable, 0 no real token, -1 non-finite statistics."""
    channels = sum_sq.shape[0]
    sum_sq = _float_vector(sum_sq)
    v, inv_s, inv_s_b = torch.empty(3, channels).unbind(0)
    status = _library.pn_statistics(_ptr(sum_sq), count, channels, _ptr(running_phi), _counter_ptr(counter), eps,
                                    warmup_steps, ramp_steps, ema_rate, int(reference), int(batch_backward),
                                    _ptr(v), _ptr(inv_s), _ptr(inv_s_b))
    return status, v, inv_s, inv_s_b


def pn_gradient_statistics(sums: torch.Tensor, weight: torch.Tensor, v: torch.Tensor, inv_s: torch.Tensor,
                           count: float, usable: bool, rate: float, running_nu: torch.Tensor):
    """The backward's statistics on the CPU from `pn_backward`'s sums: updates float32 `running_nu`
    (eq. 13) where the step is usable and Lambda finite; `(status, grad_weight)`, status as in
    `pn_statistics`."""
    weight = _float_vector(weight)
    grad_weight = torch.empty(sums.shape[1])
    status = _library.pn_gradient_statistics(_ptr(sums[0]), _ptr(sums[1]), _ptr(weight), _ptr(v), _ptr(inv_s),
                                             count, sums.shape[1], int(usable), rate, _ptr(running_nu),
                                             _ptr(grad_weight))
    return status, grad_weight


# DyT's and Derf's training step as one torch operator with a C++ autograd node (docs/cpu_kernels.md)
_OPERATOR_FLAGS = ["-O2", "-std=c++20", "-fPIC", "-shared"]
_operator = None
_operator_tried = False


def _torch_build_arguments() -> list[str]:
    """Where torch's headers and libraries are, and its C++ ABI."""
    root = pathlib.Path(torch.__file__).parent
    return [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-L{root / 'lib'}", "-lc10",
            "-ltorch_cpu"]


def _operator_digest() -> str:
    """Names the operator's source and flags, torch's build, and the C library's (whose kernels it binds)."""
    parts = [OPERATOR_SOURCE, *_OPERATOR_FLAGS, *_torch_build_arguments(), torch.__version__, _source_digest()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _compile_operator(target: pathlib.Path, namespace: str) -> None:
    _compile_source(target, _compiler("CXX", ("c++", "g++"), "C++ compiler"),
                    OPERATOR_SOURCE.replace("NAMESPACE", namespace), "powernorm_operator.cpp", _OPERATOR_FLAGS,
                    _torch_build_arguments(), {"source_and_flags": _operator_digest()})


def load_operator():
    """`elementwise_norm(x, alpha, shift, weight, bias, function)` (the torch operator, `function` as
    `SQUASH` numbers it), building it on first use; None where the C kernels or the operator are
    unavailable (the caller then runs its Python autograd function)."""
    global _operator, _operator_tried
    if _operator_tried:
        return _operator
    _operator_tried = True
    library = load()
    if library is None or os.environ.get("HF_POWERNORM_OPERATOR", "1") == "0":
        return None
    digest = _operator_digest()
    namespace = f"hf_powernorm_{digest[:16]}"
    try:
        folder = _private_dir(_cache_dir())
        # a pause of seconds in a first training step: said, once per torch version and source
        announce = f"Building the C++ operator of DyT and Derf in {folder} (once per torch version, about 15 s)"
        target = folder / f"powernorm_operator_{digest[:16]}.so"
        descriptor = _built(target, digest, lambda target: _compile_operator(target, namespace), announce)
        _load_opened(descriptor, target, torch.ops.load_library)
        operators = getattr(torch.ops, namespace)
        operators.bind(ctypes.cast(library.elementwise_forward, ctypes.c_void_p).value,
                       ctypes.cast(library.elementwise_backward, ctypes.c_void_p).value)
        _operator = operators.elementwise_norm.default
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        _warn_unavailable("DyT/Derf C++ operator", err,
                          "their CPU step runs a Python autograd function around the same kernels")
        _operator = None
    return _operator
