"""Fused CPU kernels for PowerNorm training (float32, contiguous `(tokens, C)` inputs).

The eager implementation in `normalization.py` takes about ten passes over memory per step; on a
CPU, where each elementwise pass costs about as much as a whole `layer_norm`, that is several times
LayerNorm. These kernels do the same arithmetic in four passes (statistics, output; backward sums,
input gradient), parallel over tokens with OpenMP, and recompute `z0 = x * r` instead of storing it.

The C source below is compiled on first use with the system C compiler into a cache directory
(`$HF_POWERNORM_CACHE`, else `$XDG_CACHE_HOME/hf_powernorm`, else `~/.cache/hf_powernorm`) and loaded
with `ctypes`: no build step at install time and no torch headers, so it builds in about a second.
The directory is private (mode 0700, owned by the user; another owner's is refused), and a library
is loaded only when the record written next to it names the hash of this source and these flags
and the library's own hash; any other file of that name is rebuilt, never loaded.
Without a compiler, or with `HF_POWERNORM_KERNELS=0`, `load()` returns None and PowerNorm runs
eagerly; the results agree to float32 rounding (tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define GS_EPS 1e-5f
#define FLUSH 64  /* rows summed in float before adding to the double accumulators */

static void add_to(double *dst, float *src, long n) {
    for (long i = 0; i < n; i++) { dst[i] += src[i]; src[i] = 0.0f; }
}

/* r[t, g] = 1 / sqrt(mean_group(x^2) + eps), or 1 when groups == 0 (no group scaling). */
static void group_scales(const float *x, long C, long groups, float *r) {
    if (groups == 0) { r[0] = 1.0f; return; }
    long k = C / groups;
    for (long g = 0; g < groups; g++) {
        float s = 0.0f;
        #pragma omp simd reduction(+:s)
        for (long j = 0; j < k; j++) s += x[g * k + j] * x[g * k + j];
        r[g] = 1.0f / sqrtf(s / (float)k + GS_EPS);
    }
}

/* Forward statistics: r (tokens x max(groups,1)) and sum_sq[c] = sum_t w_t (x[t,c] r[t,g(c)])^2. */
void pn_forward_stats(const float *x, const float *w, long T, long C, long groups, int threads,
                      float *r, double *sum_sq) {
    long G = groups ? groups : 1, k = C / G;
    memset(sum_sq, 0, sizeof(double) * C);
    #pragma omp parallel num_threads(threads)
    {
        float *acc = calloc(C, sizeof(float));
        double *dacc = calloc(C, sizeof(double));
        long rows = 0;
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            const float *xt = x + t * C;
            float *rt = r + t * G;
            group_scales(xt, C, groups, rt);
            float wt = w ? w[t] : 1.0f;
            if (wt == 0.0f) continue;
            for (long g = 0; g < G; g++) {
                float c = wt * rt[g] * rt[g];
                for (long j = 0; j < k; j++) acc[g * k + j] += c * xt[g * k + j] * xt[g * k + j];
            }
            if (++rows % FLUSH == 0) add_to(dacc, acc, C);
        }
        add_to(dacc, acc, C);
        #pragma omp critical
        for (long c = 0; c < C; c++) sum_sq[c] += dacc[c];
        free(acc);
        free(dacc);
    }
}

/* y[t,c] = x[t,c] r[t,g(c)] scale[c] + shift[c] */
void pn_forward_output(const float *x, const float *r, long T, long C, long groups, int threads,
                       const float *scale, const float *shift, float *y) {
    long G = groups ? groups : 1, k = C / G;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *xt = x + t * C;
        float *yt = y + t * C;
        for (long g = 0; g < G; g++) {
            float rg = r[t * G + g];
            for (long j = 0; j < k; j++) {
                long c = g * k + j;
                yt[c] = xt[c] * rg * scale[c] + shift[c];
            }
        }
    }
}

/* Backward sums: s_all[c] = sum_t dy z0, s_real[c] = sum_t w_t dy z0, s_dy[c] = sum_t dy. */
void pn_backward_sums(const float *dy, const float *x, const float *r, const float *w, long T, long C,
                      long groups, int threads, double *s_all, double *s_real, double *s_dy) {
    long G = groups ? groups : 1, k = C / G;
    memset(s_all, 0, sizeof(double) * C);
    memset(s_real, 0, sizeof(double) * C);
    memset(s_dy, 0, sizeof(double) * C);
    #pragma omp parallel num_threads(threads)
    {
        float *acc = calloc(3 * C, sizeof(float));
        double *dacc = calloc(3 * C, sizeof(double));
        float *a_all = acc, *a_real = acc + C, *a_dy = acc + 2 * C;
        long rows = 0;
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            const float *dyt = dy + t * C, *xt = x + t * C;
            float wt = w ? w[t] : 1.0f;
            for (long g = 0; g < G; g++) {
                float rg = r[t * G + g];
                for (long j = 0; j < k; j++) {
                    long c = g * k + j;
                    float p = dyt[c] * xt[c] * rg;
                    a_all[c] += p;
                    a_real[c] += wt * p;
                    a_dy[c] += dyt[c];
                }
            }
            if (++rows % FLUSH == 0) add_to(dacc, acc, 3 * C);
        }
        add_to(dacc, acc, 3 * C);
        #pragma omp critical
        for (long c = 0; c < C; c++) {
            s_all[c] += dacc[c];
            s_real[c] += dacc[C + c];
            s_dy[c] += dacc[2 * C + c];
        }
        free(acc);
        free(dacc);
    }
}

/* dz0 = dy a - w_t c z0 ; dx = r (dz0 - z0 mean_group(dz0 z0)), or dx = dz0 without group scaling. */
void pn_backward_input(const float *dy, const float *x, const float *r, const float *w, long T, long C,
                       long groups, int threads, const float *a, const float *cc, float *dx) {
    long G = groups ? groups : 1, k = C / G;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *dyt = dy + t * C, *xt = x + t * C;
        float *dxt = dx + t * C;
        float wt = w ? w[t] : 1.0f;
        for (long g = 0; g < G; g++) {
            float rg = r[t * G + g];
            float proj = 0.0f;
            #pragma omp simd reduction(+:proj)
            for (long j = 0; j < k; j++) {
                long c = g * k + j;
                float z0 = xt[c] * rg;
                float dz0 = dyt[c] * a[c] - wt * cc[c] * z0;
                dxt[c] = dz0;
                proj += dz0 * z0;
            }
            if (groups == 0) continue;
            proj /= (float)k;
            for (long j = 0; j < k; j++) {
                long c = g * k + j;
                dxt[c] = rg * (dxt[c] - xt[c] * rg * proj);
            }
        }
    }
}
"""

_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c99"]
_library = None
_tried = False


def _cache_dir() -> pathlib.Path:
    if os.environ.get("HF_POWERNORM_CACHE"):
        return pathlib.Path(os.environ["HF_POWERNORM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "hf_powernorm"


def _private_dir(path: pathlib.Path) -> pathlib.Path:
    """`path`, created with mode 0700, or made 0700 when it is ours; another user's is refused."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise RuntimeError(f"kernel cache {path} belongs to another user (uid {info.st_uid})")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def _source_digest() -> str:
    return hashlib.sha256("\0".join([_SOURCE, *_FLAGS]).encode()).hexdigest()


def _file_digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record_path(target: pathlib.Path) -> pathlib.Path:
    return target.with_suffix(".json")


def _trusted(target: pathlib.Path) -> bool:
    """True when the record next to `target` names this source and flags and `target`'s hash."""
    try:
        record = json.loads(_record_path(target).read_text())
        return record.get("source_and_flags") == _source_digest() and record.get("library") == _file_digest(target)
    except (OSError, ValueError, AttributeError):
        return False


def _write_atomically(target: pathlib.Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as handle:
        handle.write(data)
    os.replace(handle.name, target)


def _compile(target: pathlib.Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = pathlib.Path(tmp) / "powernorm_cpu.c"
        source.write_text(_SOURCE)
        built = pathlib.Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built), "-lm"], check=True, capture_output=True)
        record = {"source_and_flags": _source_digest(), "library": _file_digest(built), "flags": _FLAGS}
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file
        _write_atomically(_record_path(target), json.dumps(record).encode())


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.pn_forward_stats.argtypes = [p, p, n, n, n, i, p, p]
    lib.pn_forward_output.argtypes = [p, p, n, n, n, i, p, p, p]
    lib.pn_backward_sums.argtypes = [p, p, p, p, n, n, n, i, p, p, p]
    lib.pn_backward_input.argtypes = [p, p, p, p, n, n, n, i, p, p, p]
    for fn in (lib.pn_forward_stats, lib.pn_forward_output, lib.pn_backward_sums, lib.pn_backward_input):
        fn.restype = None
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
        target = _private_dir(_cache_dir()) / f"powernorm_cpu_{_source_digest()[:16]}.so"
        if not _trusted(target):
            _compile(target)
            if not _trusted(target):
                raise RuntimeError(f"{target} changed while it was being built")
        _library = _bind(ctypes.CDLL(str(target)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        logger.warning("PowerNorm CPU kernels unavailable (%s %s); using the eager implementation",
                       err, detail.decode(errors="replace")[-500:])
        _library = None
    return _library


def kernels_usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels apply to this input (CPU float32, kernels built)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _args(x: torch.Tensor, r: torch.Tensor | None, token_weights: torch.Tensor | None, group_num: int | None):
    tokens, channels = x.shape
    return _ptr(r), _ptr(token_weights), tokens, channels, group_num or 0, torch.get_num_threads()


def fused_forward_stats(x: torch.Tensor, token_weights: torch.Tensor | None, group_num: int | None):
    """Return group scales `r` (tokens, G) and `sum_V z0^2` (C,) float32, for contiguous float32 `x`."""
    r = torch.empty(x.shape[0], group_num or 1, dtype=torch.float32)
    sum_sq = torch.empty(x.shape[1], dtype=torch.float64)
    _, w, tokens, channels, groups, threads = _args(x, r, token_weights, group_num)
    _library.pn_forward_stats(_ptr(x), w, tokens, channels, groups, threads, _ptr(r), _ptr(sum_sq))
    return r, sum_sq.float()


def fused_forward_output(x, r, group_num, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`y = x * r * scale + shift` (scale, shift: (C,) float32)."""
    y = torch.empty_like(x)
    scale, shift = scale.float().contiguous(), shift.float().contiguous()
    rp, _, tokens, channels, groups, threads = _args(x, r, None, group_num)
    _library.pn_forward_output(_ptr(x), rp, tokens, channels, groups, threads, _ptr(scale), _ptr(shift), _ptr(y))
    return y


def fused_backward_sums(dy, x, r, token_weights, group_num):
    """Return `(sum_all dy*z0, sum_V dy*z0, sum_all dy)`, each (C,) float32; `dy` contiguous."""
    sums = torch.empty(3, x.shape[1], dtype=torch.float64)
    rp, w, tokens, channels, groups, threads = _args(x, r, token_weights, group_num)
    _library.pn_backward_sums(_ptr(dy), _ptr(x), rp, w, tokens, channels, groups, threads,
                              _ptr(sums[0]), _ptr(sums[1]), _ptr(sums[2]))
    return tuple(sums.float())


def fused_backward_input(dy, x, r, token_weights, group_num, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """`dx` from `dz0 = dy * a - (real) * c * z0` through the group-scaling backward."""
    dx = torch.empty_like(x)
    a, c = a.float().contiguous(), c.float().contiguous()
    rp, w, tokens, channels, groups, threads = _args(x, r, token_weights, group_num)
    _library.pn_backward_input(_ptr(dy), _ptr(x), rp, w, tokens, channels, groups, threads, _ptr(a), _ptr(c), _ptr(dx))
    return dx
