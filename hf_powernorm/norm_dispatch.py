"""How the norms of `normalization.py` run: the path a step takes, the autograd functions, the
`torch.library` operators and the eval maps, apart from what each norm computes.

Each module's `forward` is one call into this file (`forward_power_norm`, `forward_batch_norm`,
...), which picks the path for the input at hand once per step: the C kernels of `kernels_cpu.py`
(eager CPU float32), the `hf_powernorm::pn_step_*` and `bn_step_*` operators (compiled graphs; the
Triton kernels of `kernels_triton.py` on CUDA), DyT's and Derf's C++ operator, or the torch ops
over the pure functions of `norm_functional.py`. A running-statistics norm keeps the path its step
took in `last_step` (a `StepRecord`), which a checkpointing recomputation follows. The one switch
is `kernel_backend(name)`.

This is the only file that imports the kernel files, and it imports nothing of
`normalization.py`: it reads a module's options, its tensors (`norm.tensors(...)`) and calls its
public statistics methods. `docs/norm_internals.md` has the paths, the precedence of the compile
setting, and why no training step waits for the device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .kernels_cpu import (
    SQUASH,
    bn_step_backward,
    bn_step_forward,
    counter_usable,
    elementwise_backward,
    elementwise_forward,
    kernels_usable,
    load_operator,
    mabn_step_backward,
    mabn_step_forward,
    norm_eval,
    pn_backward,
    pn_gradient_statistics,
    pn_rows,
    pn_statistics,
    pn_step_backward,
    pn_step_forward,
    pnv_step_backward,
    pnv_step_forward,
)
from .kernels_cpu import load as kernels_cpu_load
from .kernels_triton import AVAILABLE as TRITON_AVAILABLE
from .kernels_triton import elementwise_backward as triton_elementwise_backward
from .kernels_triton import elementwise_forward as triton_elementwise_forward
from .kernels_triton import elementwise_usable as triton_elementwise_usable
from .kernels_triton import pn_step_backward as triton_step_backward
from .kernels_triton import pn_step_forward as triton_step_forward
from .kernels_triton import usable as triton_usable
from .norm_functional import (
    GROUP_SCALE_EPS,
    TWO_OVER_SQRT_PI,
    bn_affine,
    bn_train_forward,
    cast,
    elementwise_formula,
    eval_map_formula,
    lerp_,
    mask_weights,
    pn_denominators,
    pn_group_scaled,
    pn_input_gradient,
    pn_output,
    pn_sums,
    pn_train_backward,
    pn_train_forward,
    stat_dtype,
    token_count,
    token_sum,
)


# ----------------------------------------------------------------------------------------------
# Helpers: shapes, masks, masked sums, process-group reduction


def _flatten(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, hidden_size: int,
             weights: bool = True):
    """Return hidden states as `(tokens, hidden)` and float32 token weights `(tokens,)` or None
    (always None without `weights`: an eval map or a per-token norm, which checks the mask's shape
    and ignores it)."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() not in (2, 3) or hidden_states.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden_states must have shape (batch, seq, {hidden_size}) or (tokens, {hidden_size}), "
            f"got {tuple(hidden_states.shape)}"
        )
    flat = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, hidden_size)
    if attention_mask is None:
        return flat, None
    if attention_mask.shape != hidden_states.shape[:-1]:
        raise ValueError(
            f"attention_mask must have shape {tuple(hidden_states.shape[:-1])} to match hidden_states "
            f"{tuple(hidden_states.shape)}, got {tuple(attention_mask.shape)}"
        )
    if not weights:
        return flat, None
    # Always the weights, even when every token is real: asking would synchronise with the device.
    real = attention_mask.reshape(-1).to(flat.device) != 0
    return flat, real.to(stat_dtype(flat))


def sync_enabled(sync_stats: bool, process_group) -> bool:
    return (
        sync_stats
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(process_group) > 1
    )


def all_reduce_(tensor: torch.Tensor, process_group) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)
    return tensor


class StepRecord(NamedTuple):
    """How a running-statistics norm's training step ran (`path`) and what a checkpointing
    recomputation of it reuses; the module keeps the last one (`record_step`, `last_step`).

    `path`: `"c"` (the direct C calls), `"operator"` (the `hf_powernorm` operators) or `"torch"` (an
    autograd function over the torch ops). `stats`: PN's `(v, 1/s, 1/s_backward)`, as a (3, C) tensor
    or a triple; BN's `(mean, 1/sigma, r, d)` (4, C) and BRN's torch-ops `(r, d)`; MABN's C `out` or
    torch-ops `(1/chi, r, t, usable)`. `count` and `usable`: the real-token count and whether the
    step took a statistic (floats and bools where taken on the host); `step`: MABN's t in C; `info`:
    the operators' `(count, usable, non-finite)`."""

    path: str
    stats: torch.Tensor | tuple = ()
    count: torch.Tensor | float | None = None
    usable: torch.Tensor | bool | None = None
    step: int | None = None
    info: torch.Tensor | None = None


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def in_recomputation() -> bool:
    """True while autograd runs a backward pass: activation checkpointing recomputes forwards there.

    False while `torch.compile` traces: the query would break the graph, and a compiled graph
    recomputes checkpointed regions inside its own backward, without running this forward again."""
    if torch.compiler.is_compiling():
        return False
    return _GRAPH_TASK_ID() != -1


def host_readable(flag: torch.Tensor) -> bool:
    """Whether reading `flag` costs no synchronisation and no graph break: eager, on the CPU."""
    return not torch.compiler.is_compiling() and flag.device.type == "cpu"


def _refuse_double_backward(name: str) -> None:
    """Autograd runs a backward with grad mode on only under `create_graph=True`: an approximate
    backward has no derivative of its own, so refuse instead of returning a constant gradient."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}'s approximate backward is not twice differentiable: create_graph=True (a gradient "
            "penalty, double backward) is not supported through it"
        )


_BROADCAST_WARNED = []  # one warning per process


def warn_if_ddp_overwrites_statistics(module: nn.Module) -> None:
    """Called where a norm takes a statistic: DDP syncing buffers (`broadcast_buffers`, the default,
    Trainer's too) overwrites every rank's running statistics with rank 0's at each forward."""
    if torch.compiler.is_compiling():
        return
    ddp = getattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or not module.training or _BROADCAST_WARNED or getattr(module, "sync_stats", False):
        return
    if not getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", False)):
        return
    _BROADCAST_WARNED.append(True)
    warnings.warn(
        f"{type(module).__name__} trains under DistributedDataParallel with broadcast_buffers=True: at every "
        "forward DDP overwrites each rank's running statistics with rank 0's, so the other ranks' batches "
        "never reach them. Wrap with broadcast_buffers=False (Trainer: ddp_broadcast_buffers=False), and "
        "sync_stats=True (powernorm_sync_stats) for statistics over the whole global batch.",
        UserWarning,
        stacklevel=2,
    )


def _float32(device: torch.device):
    """Statistics stay float32 under autocast: matrix products would otherwise run in half precision.
    Outside autocast nothing to undo (entering `torch.autocast` costs more than a small norm's work)."""
    if device.type in ("cpu", "cuda", "xpu", "mps", "hpu") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def warn_non_finite(name: str, what: str, skipped: torch.Tensor | bool) -> None:
    """Warn when the device flag `skipped` says a finite-statistics guard held back an update.

    Only where the flag can be read for free (eager, CPU): elsewhere the update is still skipped on
    the device, silently, because reading the flag would wait for the device or break the graph."""
    if skipped if isinstance(skipped, bool) else host_readable(skipped) and bool(skipped):
        warnings.warn(
            f"{name}: non-finite {what} (NaN or inf in the input or gradient); the running statistics "
            "were not updated for this batch",
            RuntimeWarning,
            stacklevel=3,
        )


def group_scale(hidden_states: torch.Tensor, group_num: int | None,
                group_eps: float = GROUP_SCALE_EPS) -> torch.Tensor:
    """Per token, divide each of `group_num` channel groups by its root mean square (+`group_eps`, 1e-5).

    The parameter-free "layer-scale" step of the reference PN code; ordinary autograd, computed in
    float32, applied to padding too. `group_num=None` returns the input unchanged.
    """
    if group_num is None:
        return hidden_states
    channels = hidden_states.shape[-1]
    if channels % group_num != 0:
        raise ValueError(f"group_num={group_num} must divide the hidden size {channels}")
    if not torch.is_grad_enabled() and _fused_kernels_usable(hidden_states):  # inference: one pass in C
        return norm_eval(hidden_states.contiguous(), group_num, group_eps=group_eps)
    # RMSNorm without a weight over each group: torch's fused kernel where it has one (CUDA)
    grouped = hidden_states.to(stat_dtype(hidden_states)).unflatten(-1, (group_num, channels // group_num))
    return F.rms_norm(grouped, (channels // group_num,), None, group_eps).flatten(-2)


KERNEL_BACKENDS = ("auto", "c", "triton", "compile", "torch")
_KERNEL_BACKEND = ["auto"]


def available_kernel_backends() -> tuple[str, ...]:
    """The backends of `KERNEL_BACKENDS` this machine has: `"c"` where the C kernels build, `"triton"`
    where Triton is installed; `"auto"`, `"compile"` and `"torch"` everywhere."""
    have = {"c": kernels_cpu_load() is not None, "triton": TRITON_AVAILABLE}
    return tuple(name for name in KERNEL_BACKENDS if have.get(name, True))


def current_kernel_backend() -> str:
    """The backend the norms run on now (`"auto"` outside any `kernel_backend` block)."""
    return _KERNEL_BACKEND[0]


@contextlib.contextmanager
def kernel_backend(name: str):
    """Run the norms on one backend within the block, the public switch of their fast paths:

    - `"auto"` (the default): the C kernels for CPU float32 inputs, PN's step and DyT and Derf in the
      Triton kernels on CUDA, the torch ops elsewhere (PN's compiled where `HF_POWERNORM_COMPILE`
      says: `"auto"`, the default, on CUDA with Triton installed, `"1"` on any device, `"0"` never);
    - `"c"`: the C kernels where they apply (CPU float32), the torch ops elsewhere;
    - `"triton"`: PN's step and DyT and Derf in the Triton kernels where they apply (CUDA), the torch
      ops elsewhere;
    - `"compile"`: the torch ops, PN's step as `torch.compile`d pure tensor functions on any device,
      also under `HF_POWERNORM_COMPILE=0` (an explicit backend wins over the environment variable);
    - `"torch"`: the torch ops everywhere, eager (what runs without a C compiler or Triton), also
      under `HF_POWERNORM_COMPILE=1`.

    `"c"` and `"triton"` need what they name (`available_kernel_backends()`); a name outside
    `KERNEL_BACKENDS`, or a backend this machine lacks, raises ValueError. Blocks nest; the previous
    backend comes back on leaving one.

    ```python
    >>> with kernel_backend("torch"):
    ...     loss = model(**batch).loss
    ```
    """
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {name!r}")
    if name in ("c", "triton") and name not in available_kernel_backends():
        what = "the C kernels did not build (no C compiler?)" if name == "c" else "Triton is not installed"
        raise ValueError(f"kernel backend {name!r} is not available here: {what}; "
                         f"available: {available_kernel_backends()}")
    previous, _KERNEL_BACKEND[0] = _KERNEL_BACKEND[0], name
    try:
        yield
    finally:
        _KERNEL_BACKEND[0] = previous


def _eager_tensors() -> bool:
    """Kernels read a tensor's memory: not in a graph being compiled, nor under `torch.func`
    transforms (`grad`, `vmap`), whose tensors they cannot read; those take the torch ops."""
    return not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()


def _fused_kernels_usable(x: torch.Tensor) -> bool:
    """The C kernels run on eager tensors only (`_eager_tensors`)."""
    return _KERNEL_BACKEND[0] in ("auto", "c") and _eager_tensors() and kernels_usable(x)


# PN's training step as two pure tensor functions compiled by `torch.compile` (inductor: Triton
# kernels on CUDA, C++ on CPU), the way PN runs where the C kernels do not (accelerators).
# Compiled lazily, on the first training step that needs it; a function that fails to compile is
# run eagerly from then on (with a warning), as it is wherever compilation is off.
_COMPILED: dict = {}
COMPILE_SETTINGS = ("auto", "0", "1")


def _compile_wanted(x: torch.Tensor) -> bool:
    """Whether PN's pure tensor functions run compiled for `x`: never in a graph being compiled or in
    float64 (gradcheck's dtype); else an explicit `kernel_backend` decides, and under `"auto"` the
    environment variable `HF_POWERNORM_COMPILE` (the module docstring's precedence)."""
    if torch.compiler.is_compiling() or x.dtype == torch.float64:
        return False
    backend = _KERNEL_BACKEND[0]
    if backend != "auto":
        return backend == "compile"
    setting = os.environ.get("HF_POWERNORM_COMPILE", "auto")
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"HF_POWERNORM_COMPILE must be one of {COMPILE_SETTINGS}, got {setting!r}")
    if setting != "auto":
        return setting == "1"
    return x.device.type == "cuda" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _compiled(fn):
    """`fn` through `torch.compile` (built on first use, dynamic shapes), or `fn` itself if that failed."""
    if fn not in _COMPILED:
        _COMPILED[fn] = _CompiledOrEager(fn)
    return _COMPILED[fn]


class _CompiledOrEager:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as err:  # noqa: BLE001 - no compiler, a backend error: fall back, say so once
                warnings.warn(f"torch.compile of {self.fn.__name__} failed ({type(err).__name__}: {err}); "
                              "PowerNorm runs its torch ops eagerly", RuntimeWarning, stacklevel=2)
                self.compiled = None
        return self.fn(*args)


# ----------------------------------------------------------------------------------------------
# Paths shared by the running-statistics norms


def _eval_in_c(norm, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The eval forward of `hidden_states` in one C pass (`_eval_map`), or None where the C kernels
    do not apply (or the module trains)."""
    if norm.training:
        return None
    weight, bias = norm.tensors("weight", "bias")
    mean, var, group_num, group_eps = norm.eval_statistics()
    if not _eval_map_usable(hidden_states, weight, bias, mean, var):
        return None
    return _eval_map(hidden_states, group_num, weight, bias, mean, var, norm.eps, group_eps)


def _c_step(norm, function, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
            *options) -> torch.Tensor:
    """A training step in the C kernels through `function` (an autograd function taking `x`, the
    weight, the bias, the mask as the kernels read it, the module and `options`): no view node where
    the input is already `(tokens, hidden)`."""
    flat, _ = _flatten(hidden_states, attention_mask, norm.hidden_size, weights=False)
    weight, bias = norm.tensors("weight", "bias")
    y = function.apply(flat, weight, bias, _kernel_mask(attention_mask), norm, *options)
    return y if flat is hidden_states else y.view_as(hidden_states)


def _operator_step(norm, function, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                   *options) -> torch.Tensor:
    """A training step through `function`, an autograd function around the module's `hf_powernorm`
    operators, the mask as `(tokens,)` on the input's device: no view node where the input is
    already `(tokens, hidden)`."""
    flat, _ = _flatten(hidden_states, attention_mask, norm.hidden_size, weights=False)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(flat.device)
    weight, bias = norm.tensors("weight", "bias")
    y = function.apply(flat.contiguous(), weight, bias, mask, norm, *options)
    return y if flat is hidden_states else y.view_as(hidden_states)


def _recorded_path(norm) -> str | None:
    """The path of the norm's last training step (`StepRecord.path`), None before its first."""
    last = norm.last_step
    return None if last is None else last.path


def _step_in_c(norm, x, names: tuple[str, ...], refuse: bool = False) -> bool:
    """Whether a running-statistics norm's training step runs in the direct C calls: `_c_step_usable`
    for `x`, the norm's tensors called `names` and its step counter, unless `refuse`;
    a checkpointing recomputation only where its step ran there (it reuses that step's statistics)."""
    if not isinstance(x, torch.Tensor):
        return False
    if in_recomputation():
        return _fused_kernels_usable(x) and _recorded_path(norm) == "c"
    if refuse:
        return False
    *vectors, steps = norm.tensors(*names, "num_batches_tracked")
    return _c_step_usable(x, vectors, steps)


def _in_operators(norm, x, names: tuple[str, ...], refuse: bool = False) -> bool:
    """Whether a training step runs in the norm's `hf_powernorm` operators: a tensor input, float32
    buffers `names`, an int64 counter, unless `refuse`; a recomputation only where its step did."""
    if not isinstance(x, torch.Tensor) or refuse:
        return False
    if in_recomputation():
        return _recorded_path(norm) == "operator"
    *buffers, steps = norm.tensors(*names, "num_batches_tracked")
    return all(buffer.dtype == torch.float32 for buffer in buffers) and steps.dtype == torch.int64


def _statistics_norm(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, c_step,
                     torch_ops) -> torch.Tensor:
    """A running-statistics norm's forward: a training step through `c_step` (an autograd function
    of the C kernels, None where they do not apply), the eval map in one C pass where it applies,
    else `torch_ops(norm, x, token_weights)` on `(tokens, hidden)`, in the statistics' dtype."""
    if c_step is not None:
        return _c_step(norm, c_step, hidden_states, attention_mask)
    flat, token_weights = _flatten(hidden_states, attention_mask, norm.hidden_size, norm.training)
    out = _eval_in_c(norm, hidden_states)
    if out is not None:
        return out
    with _float32(flat.device):
        out = torch_ops(norm, flat, token_weights)
    return out.to(flat.dtype).view_as(hidden_states)


# ----------------------------------------------------------------------------------------------
# PowerNorm


class _PowerNormFunction(torch.autograd.Function):
    """Group scaling, PN forward and the approximate backward of eqs. (11)-(13).

    PN's step where the operators below do not serve: statistics summed over a process group
    (`sync_stats`), running buffers cast away from float32. Saves the input `x` only: `z0 = GS(x)`
    is recomputed in the backward, which needs one batch reduction, `sum(dY * z0)` (`Gamma =
    mean_V(Z^2) = v / s^2` is known from the forward). On CPU float32 inputs the work runs in the
    fused kernels of `kernels_cpu.py`; elsewhere, and in a graph being compiled, in the pure tensor
    functions of `norm_functional.py`.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, token_weights, norm):
        ctx.fused = _fused_kernels_usable(x)
        with _float32(x.device):
            if ctx.fused:
                x = x.contiguous()
                y, stats = _pn_fused_forward(x, weight, bias, token_weights, norm)
            else:
                z0, sum_sq, count = pn_sums(x, token_weights, norm.group_num, norm.group_eps)
                stats = _pn_step_denominators(norm, sum_sq, count)
                y = pn_output(z0, weight * stats[1], bias)
        ctx.save_for_backward(x, token_weights, weight)
        ctx.stats = stats
        ctx.norm = norm
        ctx.input_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        _refuse_double_backward("PowerNorm")
        x, token_weights, weight = ctx.saved_tensors
        v, inv_s, inv_s_b, count, usable = ctx.stats
        norm = ctx.norm
        nu = norm.running_nu  # nu of the previous step (eq. 11): read before `update_nu` writes it
        with _float32(grad_output.device):
            if ctx.fused:
                grad_x, sums = pn_backward(grad_output.float().contiguous(), x, token_weights, norm.group_num,
                                           weight, nu, inv_s, inv_s_b, eps=norm.group_eps)
                if not isinstance(count, torch.Tensor):  # the step's statistics were taken on the host
                    grad_weight, grad_bias = _pn_host_gradient_statistics(norm, sums, weight, v, inv_s, count,
                                                                          usable)
                    return (grad_x.to(ctx.input_dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype),
                            None, None)
                sum_dy_z0, real_dy_z0, sum_dy = sums.float()
            else:
                grad_x, sum_dy_z0, real_dy_z0, sum_dy = pn_input_gradient(
                    grad_output, x, token_weights, weight, nu, inv_s, inv_s_b, norm.group_num, norm.group_eps)
            # Gamma = mean_V(Z^2) = v / s^2 and Lambda = mean_V(g * Z), g = gamma * dY, Z = z0 / s.
            w = weight.to(inv_s.dtype)
            norm.update_nu(v * inv_s.square(), w * inv_s * real_dy_z0, count, usable)
        grad_weight = (inv_s * sum_dy_z0).to(weight.dtype)
        grad_bias = sum_dy.to(weight.dtype)
        return grad_x.to(ctx.input_dtype), grad_weight, grad_bias, None, None


def _pn_options(eps, warmup_steps, ramp_steps, alpha_fwd, reference, batch_backward) -> tuple:
    """The operator's scalar arguments as `pn_denominators`' options."""
    return (eps, warmup_steps, ramp_steps, alpha_fwd, "reference" if reference else "cumulative",
            "batch" if batch_backward else "running")


def _c_step_usable(x: torch.Tensor, vectors: tuple[torch.Tensor, ...], counter: torch.Tensor | None = None) -> bool:
    """The C step: CPU float32 `x` with the kernels, contiguous float32 vectors, an int64 counter."""
    return (_fused_kernels_usable(x) and all(t.dtype == torch.float32 and t.is_contiguous() for t in vectors)
            and (counter is None or counter_usable(counter)))


def _pn_step_forward_torch(x, mask, weight, bias, running_phi, counter, group_num, eps, warmup_steps, ramp_steps,
                           alpha_fwd, reference, batch_backward, group_eps):
    """The forward operator in the pure tensor functions (compiled where `_compile_wanted`)."""
    options = _pn_options(eps, warmup_steps, ramp_steps, alpha_fwd, reference, batch_backward)
    forward = _compiled(pn_train_forward) if _compile_wanted(x) else pn_train_forward
    with _float32(x.device):
        y, inv_s, inv_s_b, v, count, usable, non_finite, next_phi = forward(
            x, mask_weights(mask, stat_dtype(x)), weight, bias, running_phi, counter + 1, group_num or None, options,
            group_eps)
    warn_non_finite("PowerNorm", "batch statistic", non_finite)
    running_phi.copy_(next_phi)
    counter.add_(usable.to(counter.dtype))
    return y, torch.stack([v, inv_s, inv_s_b]), torch.stack([count, usable, non_finite]).to(v.dtype)


def _pn_step_forward_cpu(x, mask, weight, bias, running_phi, counter, group_num, eps, warmup_steps, ramp_steps,
                         alpha_fwd, reference, batch_backward, group_eps):
    """The forward operator on the CPU: one C call (`kernels_cpu.pn_step_forward`) where it applies."""
    if not _c_step_usable(x, (weight, bias, running_phi), counter):
        return _pn_step_forward_torch(x, mask, weight, bias, running_phi, counter, group_num, eps, warmup_steps,
                                      ramp_steps, alpha_fwd, reference, batch_backward, group_eps)
    status, y, stats, count = pn_step_forward(
        x.contiguous(), _kernel_mask(mask), group_num, weight, bias, running_phi, counter, eps, warmup_steps,
        ramp_steps, 1.0 - alpha_fwd, reference, batch_backward, group_eps)
    warn_non_finite("PowerNorm", "batch statistic", status < 0)
    return y, stats, torch.tensor([count, float(status == 1), float(status < 0)])


def _pn_step_forward_cuda(x, mask, weight, bias, running_phi, counter, group_num, eps, warmup_steps, ramp_steps,
                          alpha_fwd, reference, batch_backward, group_eps):
    """The forward operator on CUDA: the Triton kernels where they apply."""
    if not (_triton_step_usable(x, weight, bias, running_phi) and counter.dtype == torch.int64):
        return _pn_step_forward_torch(x, mask, weight, bias, running_phi, counter, group_num, eps, warmup_steps,
                                      ramp_steps, alpha_fwd, reference, batch_backward, group_eps)
    return triton_step_forward(x.contiguous(), mask, weight, bias, running_phi, counter, group_num, eps, warmup_steps,
                               ramp_steps, alpha_fwd, reference, batch_backward, group_eps)


def _pn_step_forward_fake(x, mask, weight, bias, running_phi, counter, group_num, eps, warmup_steps, ramp_steps,
                          alpha_fwd, reference, batch_backward, group_eps):
    dtype = stat_dtype(x)
    return x.new_empty(x.shape), x.new_empty((3, x.shape[1]), dtype=dtype), x.new_empty((3,), dtype=dtype)


def _pn_step_backward_torch(dy, x, mask, weight, running_nu, stats, info, group_num, alpha_bkw, group_eps):
    """The backward operator in the pure tensor functions (compiled where `_compile_wanted`): `(dx,
    grads)`, `grads` (2, C) = `(dweight, dbias)` in the weight's dtype."""
    v, inv_s, inv_s_b = stats.unbind(0)
    count, usable = info[0], info[1] != 0
    backward = _compiled(pn_train_backward) if _compile_wanted(x) else pn_train_backward
    with _float32(x.device):
        grad_x, grad_weight, grad_bias, next_nu, non_finite = backward(
            dy, x, mask_weights(mask, stat_dtype(x)), weight, running_nu, inv_s, inv_s_b, v, count, usable,
            group_num or None, 1.0 - alpha_bkw, group_eps)
    warn_non_finite("PowerNorm", "gradient statistic", non_finite)
    running_nu.copy_(next_nu)
    return grad_x.to(x.dtype), torch.stack([grad_weight, grad_bias.to(grad_weight.dtype)])


def _pn_step_backward_cpu(dy, x, mask, weight, running_nu, stats, info, group_num, alpha_bkw, group_eps):
    """The backward operator on the CPU: one C call (`kernels_cpu.pn_step_backward`) where it applies."""
    if not _c_step_usable(x, (weight, running_nu, stats)):
        return _pn_step_backward_torch(dy, x, mask, weight, running_nu, stats, info, group_num, alpha_bkw,
                                       group_eps)
    count, usable, _ = info.tolist()
    status, grad_x, grads = pn_step_backward(dy.float().contiguous(), x.contiguous(), _kernel_mask(mask), group_num,
                                             weight, running_nu, stats, count, usable == 1.0, 1.0 - alpha_bkw,
                                             group_eps)
    warn_non_finite("PowerNorm", "gradient statistic", status < 0)
    return grad_x, grads


def _pn_step_backward_cuda(dy, x, mask, weight, running_nu, stats, info, group_num, alpha_bkw, group_eps):
    """The backward operator on CUDA: the Triton kernels where they apply."""
    if not _triton_step_usable(x, weight, weight, running_nu, stats):
        return _pn_step_backward_torch(dy, x, mask, weight, running_nu, stats, info, group_num, alpha_bkw,
                                       group_eps)
    return triton_step_backward(dy, x.contiguous(), mask, weight, running_nu, stats, info, group_num, alpha_bkw,
                                group_eps)


def _pn_step_backward_fake(dy, x, mask, weight, running_nu, stats, info, group_num, alpha_bkw, group_eps):
    return x.new_empty(x.shape), weight.new_empty((2, weight.shape[0]))


def _triton_step_usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *buffers: torch.Tensor) -> bool:
    return _KERNEL_BACKEND[0] in ("auto", "triton") and triton_usable(x, weight, bias, *buffers)


def _register_step_operators(schemas: dict[str, str]) -> torch.library.Library | None:
    """Define the `hf_powernorm` operators of `schemas` with their kernels, the functions of this file
    named `_<name>_torch` (any device), `_<name>_cpu`, `_<name>_fake` and, where Triton is installed and
    one exists, `_<name>_cuda`; None when they are defined already (this file imported twice: the
    package and a checkpoint's copy of it)."""
    if hasattr(torch.ops.hf_powernorm, next(iter(schemas))):
        return None
    library = torch.library.Library("hf_powernorm", "FRAGMENT")
    kernels = globals()
    for name, schema in schemas.items():
        library.define(schema)
        library.impl(name, kernels[f"_{name}_torch"], "CompositeExplicitAutograd")
        library.impl(name, kernels[f"_{name}_cpu"], "CPU")
        if TRITON_AVAILABLE and f"_{name}_cuda" in kernels:
            library.impl(name, kernels[f"_{name}_cuda"], "CUDA")
        torch.library.register_fake(f"hf_powernorm::{name}", kernels[f"_{name}_fake"], lib=library)
    return library


class _PowerNormStepFunction(torch.autograd.Function):
    """PN's training step, which takes the statistics and updates the buffers, along `path`:

    - `"c"`, eager CPU float32 (`_pn_step_in_c`): two direct C calls, `kernels_cpu.pn_step_forward`
      and `pn_step_backward`, without the operators' dispatch and wrapping, which cost more than a
      small step (about 0.1 ms, 1.3x the whole step at (64, 32));
    - `"operator"` (`_pn_in_operators`): its two operators (`STEP_SCHEMAS`), for compiled graphs,
      CUDA, and eager steps the C kernels do not take.

    A checkpointing recomputation reuses its step's statistics and updates nothing (the output pass
    alone, the same bits). Saves `x`."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, norm, path):
        if path == "c":
            x = x.contiguous()
        if in_recomputation():
            record = norm.last_step
            y = _pn_output_pass(x, weight, bias, record.stats[1], norm.group_num, norm.group_eps)
        else:
            warn_if_ddp_overwrites_statistics(norm)
            phi, counter = norm.tensors("running_phi", "num_batches_tracked")
            reference, batch_backward = norm.warmup_statistic == "reference", norm.backward_denominator == "batch"
            if path == "c":
                status, y, stats, count = pn_step_forward(
                    x, mask, norm.group_num, weight, bias, phi, counter, norm.eps, norm.warmup_steps,
                    norm.warmup_ramp_steps, 1.0 - norm.alpha_fwd, reference, batch_backward, norm.group_eps)
                warn_non_finite("PowerNorm", "batch statistic", status < 0)
                record = StepRecord("c", stats, count, status == 1)
            else:
                y, stats, info = torch.ops.hf_powernorm.pn_step_forward(
                    x, mask, weight, bias, phi, counter, norm.group_num or 0, norm.eps, norm.warmup_steps,
                    norm.warmup_ramp_steps, norm.alpha_fwd, reference, batch_backward, norm.group_eps)
                record = StepRecord("operator", stats, info=info)
            if not torch.compiler.is_compiling():  # kept for a recomputation
                norm.record_step(record)
        ctx.save_for_backward(x, mask, weight, record.stats, record.info)
        ctx.step = (norm, path, record.count, record.usable)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        _refuse_double_backward("PowerNorm")
        x, mask, weight, stats, info = ctx.saved_tensors
        norm, path, count, usable = ctx.step
        (nu,) = norm.tensors("running_nu")
        if path == "c":
            status, grad_x, grads = pn_step_backward(grad_output.float().contiguous(), x, mask, norm.group_num, weight,
                                                     nu, stats, count, usable, 1.0 - norm.alpha_bkw, norm.group_eps)
            warn_non_finite("PowerNorm", "gradient statistic", status < 0)
            return grad_x, grads[0], grads[1], None, None, None
        grad_x, grads = torch.ops.hf_powernorm.pn_step_backward(
            grad_output, x, mask, weight, nu, stats, info, norm.group_num or 0, norm.alpha_bkw, norm.group_eps)
        return grad_x, grads[0], cast(grads[1], norm.bias.dtype), None, None, None


def _pn_output_pass(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, inv_s: torch.Tensor,
                    group_num: int | None, group_eps: float) -> torch.Tensor:
    """`y = weight * GS(x) / s + bias` with a known `1/s` (one C pass where the kernels apply)."""
    scale = weight.detach().to(inv_s.dtype) * inv_s
    if _fused_kernels_usable(x) and inv_s.dtype == torch.float32:
        y, _, _ = pn_rows(x.contiguous(), None, group_num, scale, bias, statistics=False, eps=group_eps)
        return y
    with _float32(x.device):
        z0, _ = pn_group_scaled(x.to(stat_dtype(x)), group_num, group_eps)
        return pn_output(z0, scale, bias.detach()).to(x.dtype)


def _kernel_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The attention mask as `(tokens,)` for the C kernels: as it is when int64, bool or uint8 (read
    as nonzero = real), else converted to float 0/1 weights."""
    if attention_mask is None:
        return None
    mask = attention_mask if attention_mask.dim() == 1 else attention_mask.reshape(-1)
    mask = mask if mask.device.type == "cpu" else mask.cpu()
    if mask.dtype in (torch.int64, torch.bool, torch.uint8):
        return mask.contiguous()
    return (mask != 0).float()


def _eval_map_usable(x: torch.Tensor, *vectors: torch.Tensor | None) -> bool:
    """Whether an eval map runs in `kernels_cpu.norm_eval`: C kernels for `x`, contiguous float32
    vectors. (Inference calls this once per norm and token batch: written for a few microseconds.)"""
    if not _fused_kernels_usable(x):
        return False
    for vector in vectors:
        if vector is not None and (vector.dtype != torch.float32 or not vector.is_contiguous()):
            return False
    return True


def _eval_map(x: torch.Tensor, group_num: int | None, weight, bias, mean, var, eps: float,
              group_eps: float = GROUP_SCALE_EPS) -> torch.Tensor:
    """An eval-mode norm `y = GS(x) * scale + shift` of float32 `(..., C)` in one C pass, shaped as
    `x`, with `scale = weight / sqrt(var + eps)`, `shift = bias - mean * scale` computed in C from the
    parameters and running statistics as they are now (nothing cached, so nothing goes stale).
    Called directly when no gradient is wanted; through `_EvalMapFunction`, with the same bits,
    otherwise."""
    x = x.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        flat = x if x.dim() == 2 else x.view(-1, x.shape[-1])
        out = _EvalMapFunction.apply(flat, group_num, weight, bias, mean, var, eps, group_eps)
        return out if flat is x else out.view_as(x)
    return norm_eval(x, group_num, weight, bias, mean, var, eps, group_eps)  # reads the data, no autograd


class _EvalMapFunction(torch.autograd.Function):
    """`_eval_map` with its gradient: `dx` is the group-scaling backward of `dY * scale`
    (`pn_backward` with a = scale, c = 0); `dweight = (sum(dY * GS(x)) - mean * sum(dY)) / sqrt(var + eps)`,
    `dbias = sum(dY)`. Saves `x`."""

    @staticmethod
    def forward(ctx, x, group_num, weight, bias, mean, var, eps, group_eps):
        vectors = [None if t is None else t.detach().contiguous() for t in (weight, bias, mean, var)]
        ctx.save_for_backward(x, *(t if t is not None else torch.empty(0) for t in (weight, bias, mean, var)))
        ctx.present = [t is not None for t in (weight, bias, mean, var)]
        ctx.options = (group_num, eps, group_eps)
        return norm_eval(x, group_num, *vectors, eps=eps, group_eps=group_eps)

    @staticmethod
    def backward(ctx, grad_output):
        x, *vectors = ctx.saved_tensors
        weight, bias, mean, var = (t if present else None for t, present in zip(vectors, ctx.present))
        group_num, eps, group_eps = ctx.options
        if torch.is_grad_enabled():  # create_graph=True
            with torch.enable_grad():
                inputs = [t for t in (x, weight, bias) if t is not None and t.requires_grad]
                y = eval_map_formula(x, group_num, weight, bias, mean, var, eps, group_eps)
                grads = iter(torch.autograd.grad(y, inputs, grad_output, create_graph=True))
            result = [next(grads) if t is not None and t.requires_grad else None for t in (x, weight, bias)]
            return result[0], None, result[1], result[2], None, None, None, None
        channels = x.shape[1]
        inv = torch.ones(channels) if var is None else torch.rsqrt(var.detach().float() + eps)
        scale = inv if weight is None else weight.detach().float() * inv
        ones, zeros = torch.ones_like(scale), torch.zeros_like(scale)
        grad_x, sums = pn_backward(grad_output.float().contiguous(), x, None, group_num, scale, zeros, ones, ones,
                                   eps=group_eps)
        sum_dy_z0, sum_dy = sums[0].float(), sums[2].float()
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[2]:
            centred = sum_dy_z0 if mean is None else sum_dy_z0 - mean.float() * sum_dy
            grad_weight = (centred * inv).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[3]:
            grad_bias = sum_dy.to(bias.dtype)
        return grad_x, None, grad_weight, grad_bias, None, None, None, None


def _pn_fused_forward(x, weight, bias, token_weights, norm):
    """PN's training forward in the C kernels: one pass when the step divides by the running
    statistic (known before the batch statistic: CPU, so the step counter is read for free), else a
    statistics pass and an output pass."""
    weight = weight.detach().float()
    if norm.divides_by_running_statistic():
        scale = weight * torch.rsqrt(norm.running_phi + norm.eps)  # phi before this step's update
        y, sum_sq, count = pn_rows(x, token_weights, norm.group_num, scale, bias, eps=norm.group_eps)
        return y, _pn_step_denominators(norm, sum_sq, count)
    _, sum_sq, count = pn_rows(x, token_weights, norm.group_num, eps=norm.group_eps)
    stats = _pn_step_denominators(norm, sum_sq, count)
    y, _, _ = pn_rows(x, None, norm.group_num, weight * stats[1], bias, statistics=False, eps=norm.group_eps)
    return y, stats


def _pn_step_denominators(norm, sum_sq: torch.Tensor, count: torch.Tensor | float):
    """Forward statistics of one PN training step; updates `running_phi` and the step counter.

    Returns `(v, 1/s, 1/s_backward, real-token count, usable)`, all tensors on the device;
    `usable` is false when the step takes no statistic (no real token or non-finite values):
    then both denominators are the running one and no buffer changes. Nothing is read on the
    host, so no step waits for the device or breaks a compiled graph. A checkpointing
    recomputation reuses the step's statistics and updates nothing.
    """
    last = norm.last_step
    if in_recomputation() and last is not None:
        return (*last.stats, last.count, last.usable)  # same step: reuse its statistics, update nothing
    if _pn_statistics_on_host(norm, sum_sq):
        statistics = _pn_host_denominators(norm, sum_sq, float(count))
        norm.record_step(StepRecord("torch", statistics[:3], *statistics[3:]))
        return statistics
    if not isinstance(count, torch.Tensor):
        count = torch.full((), count, dtype=sum_sq.dtype, device=sum_sq.device)
    sums = torch.cat([sum_sq, count.to(sum_sq.dtype).view(1)])
    if sync_enabled(norm.sync_stats, norm.process_group):
        all_reduce_(sums, norm.process_group)
    count = sums[-1].clone()  # not a view: the step keeps it (a compiled graph refuses kept views)
    warn_if_ddp_overwrites_statistics(norm)
    v, inv_s, inv_s_b, usable, non_finite, next_phi = pn_denominators(
        sums[:-1], count, norm.running_phi, norm.next_step(),
        _pn_options(norm.eps, norm.warmup_steps, norm.warmup_ramp_steps, norm.alpha_fwd,
                    norm.warmup_statistic == "reference", norm.backward_denominator == "batch"))
    warn_non_finite(type(norm).__name__, "batch statistic", non_finite)
    norm.take_step(next_phi, usable)
    norm.record_step(StepRecord("torch", (v, inv_s, inv_s_b), count, usable))
    return v, inv_s, inv_s_b, count, usable


def _pn_step_in_c(norm, x: torch.Tensor) -> bool:
    """Whether PN's training step takes the path `"c"` of `_PowerNormStepFunction` (`_step_in_c`):
    float32 contiguous parameters and buffers, an int64 counter, no process group to sum over."""
    return _step_in_c(norm, x, ("weight", "bias", "running_phi", "running_nu"),
                      refuse=sync_enabled(norm.sync_stats, norm.process_group))


def _pn_in_operators(norm, x: torch.Tensor) -> bool:
    """Whether PN's training step takes the path `"operator"` of `_PowerNormStepFunction`
    (`_in_operators`): float32 running statistics, an int64 counter, no process group to sum over."""
    return _in_operators(norm, x, ("running_phi", "running_nu"), refuse=sync_enabled(norm.sync_stats,
                                                                                     norm.process_group))


def _pn_statistics_on_host(norm, sum_sq: torch.Tensor) -> bool:
    """Whether the step's statistics go through `kernels_cpu.pn_statistics`: eager, CPU, float32
    sums and buffers, a counter the C kernels take (`counter_usable`), no process group to sum over. A few dozen torch
    ops on C-vectors cost more there than the passes over the batch; the C function does the same
    arithmetic in one call."""
    return (host_readable(sum_sq) and sum_sq.dtype == torch.float32 and _fused_kernels_usable(sum_sq)
            and not sync_enabled(norm.sync_stats, norm.process_group)
            and all(buffer.dtype == torch.float32 and buffer.is_contiguous()
                    for buffer in (norm.running_phi, norm.running_nu))
            and counter_usable(norm.num_batches_tracked))


def _pn_host_denominators(norm, sum_sq: torch.Tensor, count: float):
    """`_pn_step_denominators` in C on the CPU: the same tuple, with the count a float and `usable` a bool."""
    warn_if_ddp_overwrites_statistics(norm)
    status, v, inv_s, inv_s_b = pn_statistics(
        sum_sq, count, norm.running_phi, norm.num_batches_tracked, norm.eps, norm.warmup_steps,
        norm.warmup_ramp_steps, 1.0 - norm.alpha_fwd, norm.warmup_statistic == "reference",
        norm.backward_denominator == "batch")
    warn_non_finite(type(norm).__name__, "batch statistic", status < 0)
    return v, inv_s, inv_s_b, count, status == 1


def _pn_host_gradient_statistics(norm, sums, weight, v, inv_s, count: float, usable: bool):
    """The module's `update_nu` in C after `_pn_host_denominators`; returns the weight and bias gradients."""
    status, grad_weight = pn_gradient_statistics(sums, weight, v, inv_s, count, usable, 1.0 - norm.alpha_bkw,
                                                 norm.running_nu)
    warn_non_finite(type(norm).__name__, "gradient statistic", status < 0)
    return grad_weight, sums[2].float()


def forward_power_norm(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`PowerNorm.forward`: the C step, the operators, the autograd function over the torch ops
    (process groups, cast buffers) in training; the C eval map or the torch ops in eval."""
    if norm.training and _pn_step_in_c(norm, hidden_states):
        return _c_step(norm, _PowerNormStepFunction, hidden_states, attention_mask, "c")
    if norm.training and _pn_in_operators(norm, hidden_states):
        return _operator_step(norm, _PowerNormStepFunction, hidden_states, attention_mask, "operator")
    flat, token_weights = _flatten(hidden_states, attention_mask, norm.hidden_size, norm.training)
    if norm.training:
        return _PowerNormFunction.apply(flat, norm.weight, norm.bias, token_weights, norm).view_as(hidden_states)
    out = _eval_in_c(norm, hidden_states)  # one pass in C
    if out is not None:
        return out
    scale, shift = norm.affine_after_group_scale()
    dtype = stat_dtype(flat)
    with _float32(flat.device):
        z0 = group_scale(flat, norm.group_num, norm.group_eps).to(dtype)
        out = torch.addcmul(shift.to(dtype), z0, scale.to(dtype)).to(flat.dtype)
    return out.view_as(hidden_states)


# ----------------------------------------------------------------------------------------------
# Batch-statistic relatives: PN-V and masked batch normalization


class _PowerNormVFunction(torch.autograd.Function):
    """PN-V's training step in PN's C kernels, with its exact gradient: the forward is a statistics
    pass and an output pass (`y = z0 * weight / s + bias`, `s = sqrt(v + eps)`); the backward a
    sums pass and an input-gradient pass. Through `v = mean_V(z0^2)` the gradient of a real token's
    `z0` gains `-weight * z0 * S / (N s^3)`, `S = sum_all(dY * z0)`: PN's `dz0 = dY * a - (real) * c * z0`
    with `a = weight / s`, `c = weight * S / (N s^3)` (0 for an unusable batch, whose denominator is the
    running statistic), then the exact group-scaling backward. Saves `x`."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, norm):
        x = x.contiguous()
        warn_if_ddp_overwrites_statistics(norm)
        phi, counter = norm.tensors("running_phi", "num_batches_tracked")
        status, y, inv_s, count = pnv_step_forward(  # statistics, running update and output in one C call
            x, mask, norm.group_num, weight, bias, phi, counter, norm.eps, 1.0 - norm.alpha_fwd,
            not in_recomputation())
        warn_non_finite("PowerNormV", "batch statistic", status < 0)
        ctx.save_for_backward(x, mask, weight, bias, inv_s)
        ctx.step = (norm, count, status == 1)  # host values: nothing to read back in the backward
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, mask, weight, bias, inv_s = ctx.saved_tensors
        norm, count, usable = ctx.step
        if torch.is_grad_enabled():  # create_graph=True: the gradient must be differentiable in turn
            token_weights = mask_weights(mask, x.dtype)
            return (*_PowerNormVFunction.differentiable_backward(norm, x, token_weights, weight, bias,
                                                                  torch.tensor(count), torch.tensor(usable),
                                                                  grad_output), None, None)
        grad_x, grads = pnv_step_backward(grad_output.float().contiguous(), x, mask, norm.group_num, weight, inv_s,
                                          count, usable)
        return grad_x, grads[0], grads[1], None, None

    @staticmethod
    def differentiable_backward(norm, x, token_weights, weight, bias, count, usable, grad_output):
        """The same gradient through torch ops (the statistic as the forward took it: `running_phi`
        is unchanged when the batch was unusable)."""
        with torch.enable_grad():
            z0 = group_scale(x, norm.group_num)
            v = token_sum(z0.square(), token_weights) / count.clamp_min(1.0)
            y = torch.addcmul(bias, z0 * torch.rsqrt(torch.where(usable, v, norm.running_phi) + norm.eps), weight)
            return torch.autograd.grad(y, (x, weight, bias), grad_output, create_graph=True)


def _pnv_step_in_c(norm, x: torch.Tensor) -> bool:
    """PN-V's step in the C kernels: CPU float32 input, contiguous float32 parameters and statistic,
    an int64 counter (a recomputation takes the step again: the kernel then updates nothing)."""
    *vectors, counter = norm.tensors("weight", "bias", "running_phi", "num_batches_tracked")
    return isinstance(x, torch.Tensor) and _c_step_usable(x, vectors, counter)


def _pnv_torch_ops(norm, flat: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    """PN-V in torch ops (training: the batch statistic where usable, `running_phi` otherwise, and
    its EMA update)."""
    dtype = stat_dtype(flat)
    z0 = group_scale(flat, norm.group_num).to(dtype)
    phi = norm.running_phi.to(dtype)
    if norm.training:
        count = token_count(z0, token_weights)
        v = token_sum(z0.square(), token_weights) / count.clamp_min(1.0)
        usable = norm.usable_batch(count, v)
        phi = torch.where(usable, v, phi)  # the running statistic for an unusable batch
        norm.update_running(v, usable)
    return torch.addcmul(norm.bias.to(dtype), z0 * torch.rsqrt(phi + norm.eps), norm.weight.to(dtype))


def forward_power_norm_v(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`PowerNormV.forward`: the C step or the C eval map where they apply, else the torch ops."""
    in_c = norm.training and _pnv_step_in_c(norm, hidden_states)
    return _statistics_norm(norm, hidden_states, attention_mask, _PowerNormVFunction if in_c else None,
                            _pnv_torch_ops)


class _BatchNormFunction(torch.autograd.Function):
    """Masked BN's and BRN's training step in two C calls (`kernels_cpu.bn_step_forward`,
    `bn_step_backward`), with the gradient through the batch mean and variance: a moments pass (sums
    of `x - K` and its square over real tokens about the running mean K), the step's statistics and
    running updates, an output pass `y = x * a + b`; the backward a sums pass (`S1 = sum_all dY`,
    `S2 = sum_all dY (x - mean)`) and an input-gradient pass
    `dx = a dY - (real) * (a S1 / N + a S2 (x - mean) / (N sigma^2))`, the batch-statistic terms only for
    a usable batch. `a = weight * r / sigma`, `b = bias + weight * d - mean * a` (BN: r = 1, d = 0).
    A checkpointing recomputation reuses its step's statistics. Saves `x` and the mask: LayerNorm's
    memory, where the torch ops also keep `x - mean`."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, norm):
        x = x.contiguous()
        if in_recomputation():
            record = norm.last_step
            out, count, usable = record.stats, record.count, record.usable
            _, y, _, _ = bn_step_forward(x, None, weight, bias, norm.running_mean, norm.running_var,
                                         norm.num_batches_tracked, norm.eps, norm.momentum, False, 1.0, 0.0, out)
        else:
            warn_if_ddp_overwrites_statistics(norm)
            renorm = norm.renorm
            status, y, out, count = bn_step_forward(
                x, mask, weight, bias, norm.running_mean, norm.running_var, norm.num_batches_tracked, norm.eps,
                norm.momentum, renorm, norm.rmax if renorm else 1.0, norm.dmax if renorm else 0.0)
            warn_non_finite(type(norm).__name__, "batch statistic", status < 0)
            usable = status == 1
            norm.record_step(StepRecord("c", out, count, usable))
        ctx.save_for_backward(x, mask, weight, out)
        ctx.step = (norm, count, usable)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, mask, weight, out = ctx.saved_tensors
        norm, count, usable = ctx.step
        if torch.is_grad_enabled():  # create_graph=True: the gradient must be differentiable in turn
            mean, inv_std, r, d = out
            usable = torch.tensor(usable)
            return (*norm.differentiable_backward(x, mask, weight, mean, inv_std, r, d, usable, grad_output),
                    None, None)
        grad_x, grads = bn_step_backward(grad_output.float().contiguous(), x, mask, weight, out, count, usable)
        return grad_x, grads[0], grads[1], None, None


def _bn_step_forward_torch(x, mask, weight, bias, running_mean, running_var, counter, eps, momentum, renorm, rmax,
                           dmax):
    """The forward operator in torch ops (any device and dtype)."""
    dtype = stat_dtype(x)
    with _float32(x.device):
        y, out, count, usable, non_finite, batch_mean, batch_var = bn_train_forward(
            x.to(dtype), mask_weights(mask, dtype), weight, bias, running_mean, running_var, eps, renorm, rmax, dmax)
        # in float32, as the C kernel and `MaskedBatchNorm._update`: the unbiased variance into the EMA
        n = count.float()
        lerp_(running_mean, batch_mean.float(), momentum, keep=usable)
        lerp_(running_var, batch_var.float() * (n / (n - 1.0).clamp_min(1.0)), momentum, keep=usable)
    counter.add_(usable.to(counter.dtype))
    return y.to(x.dtype), out, torch.stack([count, usable, non_finite]).to(out.dtype)


def _bn_step_forward_cpu(x, mask, weight, bias, running_mean, running_var, counter, eps, momentum, renorm, rmax, dmax):
    """The forward operator on the CPU: one C call (`kernels_cpu.bn_step_forward`) where it applies."""
    if not _c_step_usable(x, (weight, bias, running_mean, running_var), counter):
        return _bn_step_forward_torch(x, mask, weight, bias, running_mean, running_var, counter, eps, momentum, renorm,
                                      rmax, dmax)
    status, y, out, count = bn_step_forward(x.contiguous(), _kernel_mask(mask), weight, bias, running_mean,
                                            running_var, counter, eps, momentum, renorm, rmax, dmax)
    return y, out, torch.tensor([count, float(status == 1), float(status < 0)])


def _bn_step_forward_fake(x, mask, weight, bias, running_mean, running_var, counter, eps, momentum, renorm, rmax,
                          dmax):
    dtype = stat_dtype(x)
    return x.new_empty(x.shape), x.new_empty((4, x.shape[1]), dtype=dtype), x.new_empty((3,), dtype=dtype)


def _bn_step_backward_torch(dy, x, mask, weight, out, info):
    """The backward operator in torch ops: `(dx, grads)`, `grads` (2, C) = `(dweight, dbias)` in the
    weight's dtype. With `S1 = sum_all dY`, `S2 = sum_all dY (x - mean)` and `a = weight r / sigma`:
    `dx = a dY - real * (a S1 / N + a S2 (x - mean) / (N sigma^2))` (the batch terms for a usable
    batch only), `dweight = r S2 / sigma + d S1`, `dbias = S1`."""
    dtype = out.dtype
    with _float32(x.device):
        mean, inv_std, r, d = out.unbind(0)
        xf, g = x.to(dtype), dy.to(dtype)
        s1, s2 = g.sum(0), (g * (xf - mean)).sum(0)
        a = weight.to(dtype) * r * inv_std
        n, usable = info[0].clamp_min(1.0), info[1] != 0
        # dx = a dY - real (c x + e), as the C kernel writes it
        c = torch.where(usable, a * inv_std.square() * s2 / n, 0.0)
        correction = c * xf + (torch.where(usable, a * s1 / n, 0.0) - c * mean)
        if mask is not None:
            correction = correction * mask_weights(mask, dtype)[:, None]
        grad_x = a * g - correction
        grads = torch.stack([r * inv_std * s2 + d * s1, s1])
    return grad_x.to(x.dtype), grads.to(weight.dtype)


def _bn_step_backward_cpu(dy, x, mask, weight, out, info):
    """The backward operator on the CPU: one C call (`kernels_cpu.bn_step_backward`) where it applies."""
    if not _c_step_usable(x, (weight, out)):
        return _bn_step_backward_torch(dy, x, mask, weight, out, info)
    count, usable, _ = info.tolist()
    return bn_step_backward(dy.float().contiguous(), x.contiguous(), _kernel_mask(mask), weight, out, count,
                            usable == 1.0)


def _bn_step_backward_fake(dy, x, mask, weight, out, info):
    return x.new_empty(x.shape), weight.new_empty((2, weight.shape[0]))


# The training steps of PN and of masked BN (and BRN) as operators of the `hf_powernorm` namespace
# (`torch.library`), two each, one per direction, so that `torch.compile` sees one node each (no
# guard of ours inside) and eager code one dispatched call each (eager CPU float32 steps call the
# same C kernels directly instead: `_PowerNormStepFunction`'s path `"c"`, `_BatchNormFunction`). The buffer
# updates happen inside them, declared as mutated arguments in the schemas: `pn_step_forward` writes
# `running_phi` and the step counter, `pn_step_backward` `running_nu`, `bn_step_forward`
# `running_mean`, `running_var` and the step counter. Kernels: the C kernels for CPU float32
# (`kernels_cpu`), the Triton kernels for PN on CUDA (`kernels_triton`, where Triton is installed),
# the pure tensor functions elsewhere (PN's `torch.compile`d where `_compile_wanted` says); fake
# kernels for tracing. Registered with `Library.impl` rather than `custom_op`, whose Python wrappers
# cost more than a small step (about 0.4 ms a call), and which refuses an autograd formula on an
# operator that mutates its arguments: `_PowerNormStepFunction` and `_BatchNormStepFunction` link
# each pair. Returned statistics, in the statistics' dtype: PN's `stats` (3, C) = `(v, 1/s,
# 1/s_backward)`, BN's `out` (4, C) = `(mean, 1/sigma, r, d)` of the step (an unusable batch: the
# running mean and 1/sigma, r = 1, d = 0), and both `info` (3,) = `(real-token count, usable,
# non-finite)`. PN's `group_num` 0 is no group scaling; BN's `renorm` false is masked BN (r = 1, d = 0).
STEP_SCHEMAS = {
    "pn_step_forward": "pn_step_forward(Tensor x, Tensor? mask, Tensor weight, Tensor bias, Tensor(a!) running_phi, "
                       "Tensor(b!) counter, int group_num, float eps, int warmup_steps, int ramp_steps, "
                       "float alpha_fwd, bool reference, bool batch_backward, float group_eps) -> (Tensor, Tensor, Tensor)",
    "pn_step_backward": "pn_step_backward(Tensor dy, Tensor x, Tensor? mask, Tensor weight, Tensor(a!) running_nu, "
                        "Tensor stats, Tensor info, int group_num, float alpha_bkw, float group_eps) -> (Tensor, Tensor)",
    "bn_step_forward": "bn_step_forward(Tensor x, Tensor? mask, Tensor weight, Tensor bias, Tensor(a!) running_mean, "
                       "Tensor(b!) running_var, Tensor(c!) counter, float eps, float momentum, bool renorm, "
                       "float rmax, float dmax) -> (Tensor, Tensor, Tensor)",
    "bn_step_backward": "bn_step_backward(Tensor dy, Tensor x, Tensor? mask, Tensor weight, Tensor out, "
                        "Tensor info) -> (Tensor, Tensor)",
}
_STEP_LIBRARY = _register_step_operators(STEP_SCHEMAS)  # kept: the registrations live as long as it does


class _BatchNormStepFunction(torch.autograd.Function):
    """Masked BN's and BRN's training step through their two operators (`STEP_SCHEMAS`)
    (`_bn_in_operators` says when). A checkpointing recomputation reuses its step's
    statistics and updates nothing (the output pass alone, the same bits). Saves `x`; create_graph=True
    takes the torch ops' differentiable gradient, as `_BatchNormFunction` does."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, norm):
        if in_recomputation():
            record = norm.last_step
            out, info = record.stats, record.info
            y = _bn_output_pass(norm, x, weight, bias, out)
        else:
            warn_if_ddp_overwrites_statistics(norm)
            renorm = norm.renorm
            y, out, info = torch.ops.hf_powernorm.bn_step_forward(
                x, mask, weight, bias, *norm.tensors("running_mean", "running_var", "num_batches_tracked"),
                norm.eps, norm.momentum, renorm, norm.rmax if renorm else 1.0, norm.dmax if renorm else 0.0)
            if not torch.compiler.is_compiling():  # kept for a recomputation
                warn_non_finite(type(norm).__name__, "batch statistic", info[2] != 0)
                norm.record_step(StepRecord("operator", out, info=info))
        ctx.save_for_backward(x, mask, weight, out, info)
        ctx.norm = norm
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, mask, weight, out, info = ctx.saved_tensors
        norm = ctx.norm
        if torch.is_grad_enabled():  # create_graph=True: the gradient must be differentiable in turn
            mean, inv_std, r, d = out
            return (*norm.differentiable_backward(x, mask, weight, mean, inv_std, r, d, info[1] != 0, grad_output),
                    None, None)
        grad_x, grads = torch.ops.hf_powernorm.bn_step_backward(grad_output, x, mask, weight, out, info)
        return grad_x, grads[0], cast(grads[1], norm.bias.dtype), None, None


def _bn_output_pass(norm, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A recomputed step's output from its statistics `out`, on the path its operator took."""
    mean, var, counter = norm.tensors("running_mean", "running_var", "num_batches_tracked")
    if _c_step_usable(x, (weight, bias, mean, var), counter):
        _, y, _, _ = bn_step_forward(x.contiguous(), None, weight, bias, mean, var, counter, norm.eps, norm.momentum,
                                     False, 1.0, 0.0, out)
        return y
    dtype = stat_dtype(x)
    with _float32(x.device):
        return bn_affine(x.to(dtype), weight.detach(), bias.detach(), out).to(x.dtype)


def _bn_step_in_c(norm, x: torch.Tensor) -> bool:
    """Whether BN's (BRN's) training step runs in `_BatchNormFunction` (`_step_in_c`): float32
    contiguous parameters and running statistics, an int64 counter."""
    return _step_in_c(norm, x, ("weight", "bias", "running_mean", "running_var"))


def _bn_in_operators(norm, x: torch.Tensor) -> bool:
    """Whether BN's (BRN's) training step runs in the `hf_powernorm::bn_step_*` operators
    (`_BatchNormStepFunction`, `_in_operators`): float32 running statistics, an int64 counter."""
    return _in_operators(norm, x, ("running_mean", "running_var"))


def forward_batch_norm(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`MaskedBatchNorm.forward` (and BRN's): the C step, the operators, or the module's torch ops
    (`affine_in_torch_ops`); in eval the C eval map where it applies."""
    in_c = norm.training and _bn_step_in_c(norm, hidden_states)
    if norm.training and not in_c and _bn_in_operators(norm, hidden_states):
        return _operator_step(norm, _BatchNormStepFunction, hidden_states, attention_mask)
    if norm.training and not in_c and not in_recomputation():
        norm.record_step(None)  # the torch ops' step (BRN's records its corrections)
    return _statistics_norm(norm, hidden_states, attention_mask, _BatchNormFunction if in_c else None,
                            _bn_torch_ops)


def _bn_torch_ops(norm, flat: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    return norm.affine_in_torch_ops(flat.to(stat_dtype(flat)), token_weights)


class _MovingAverageBatchNormStepFunction(torch.autograd.Function):
    """MABN's training step in two C calls, `kernels_cpu.mabn_step_forward` and `mabn_step_backward`:
    the arithmetic of `forward_statistics` and `backward_statistic` with the passes (a moments pass
    and an output pass `y = x * weight * r / chi + bias`; a sums pass and an input-gradient pass
    `dx = dY * weight * r / chi - (real) * Psi * x / chi^2`), the buffer updates and the parameter
    gradients in C, so that a step costs its passes and little else. A checkpointing recomputation
    reuses its step's statistics and updates nothing. Saves `x`, as the torch ops save `z`."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, norm):
        x = x.contiguous()
        phi, window_phi, counter = norm.tensors("running_phi", "window_phi", "num_batches_tracked")
        reused = norm.last_step if in_recomputation() else None
        if reused is not None:
            out, count, usable, step = reused.stats, reused.count, reused.usable, reused.step
            _, y, _, _ = mabn_step_forward(x, None, weight, bias, phi, window_phi, counter, norm.eps, norm.momentum,
                                           norm.warmup_steps, norm.rmax, norm.renorm_warmup_steps, reused=out)
        else:
            warn_if_ddp_overwrites_statistics(norm)
            step = int(counter) + 1
            status, y, out, count = mabn_step_forward(
                x, mask, weight, bias, phi, window_phi, counter, norm.eps, norm.momentum, norm.warmup_steps, norm.rmax,
                norm.renorm_warmup_steps)
            warn_non_finite("MovingAverageBatchNorm", "batch statistic", status < 0)
            usable = status == 1
            norm.record_step(StepRecord("c", out, count, usable, step))
        ctx.save_for_backward(x, mask, weight)
        ctx.step = (norm, out, count, usable, step)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        _refuse_double_backward("MovingAverageBatchNorm")
        x, mask, weight = ctx.saved_tensors
        norm, out, count, usable, step = ctx.step
        status, grad_x, grads = mabn_step_backward(grad_output.float().contiguous(), x, mask, weight, out,
                                                   norm.tensors("window_gz")[0], step, norm.warmup_steps, count,
                                                   usable)
        warn_non_finite("MovingAverageBatchNorm", "gradient statistic", status < 0)
        return grad_x, grads[0].to(weight.dtype), grads[1].to(weight.dtype), None, None


class _MovingAverageBatchNormFunction(torch.autograd.Function):
    """MABN's forward `y = weight * r * z + bias`, `z = x / chi`, and its backward with the moving
    average `Psi` of `mean_V(g * z)`: `dx = (g - z * Psi) / chi` on real tokens, `g / chi` on padding."""

    @staticmethod
    def forward(ctx, x, weight, bias, token_weights, norm, inv_chi, r, step, usable):
        z = x * inv_chi
        ctx.save_for_backward(z, token_weights, weight, inv_chi, r, step, usable)
        ctx.norm = norm
        return torch.addcmul(bias, z, weight * r)

    @staticmethod
    def backward(ctx, grad_output):
        _refuse_double_backward("MovingAverageBatchNorm")
        z, token_weights, weight, inv_chi, r, step, usable = ctx.saved_tensors
        with _float32(grad_output.device):
            dy = grad_output.to(z.dtype)
            g = dy * (weight * r)
            count = token_count(z, token_weights)
            psi_batch = token_sum(g * z, token_weights) / count.clamp_min(1.0)
            psi = ctx.norm.backward_statistic(psi_batch, step, usable)
            correction = z * psi if token_weights is None else z * psi * token_weights[:, None]
            grad_x = (g - correction) * inv_chi
            grad_weight = (dy * z).sum(0) * r if ctx.needs_input_grad[1] else None
            grad_bias = dy.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


def _mabn_step_in_c(norm, x: torch.Tensor) -> bool:
    """Whether MABN's training step runs in `_MovingAverageBatchNormStepFunction` (`_step_in_c`):
    float32 contiguous parameters, running statistic and windows, an int64 counter."""
    return _step_in_c(norm, x, ("weight", "bias", *norm.float32_buffers()))


def forward_moving_average_batch_norm(norm, hidden_states: torch.Tensor,
                                      attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`MovingAverageBatchNorm.forward`: the C step or the C eval map where they apply, else the
    torch ops with the module's moving-average statistics (`forward_statistics`)."""
    in_c = norm.training and _mabn_step_in_c(norm, hidden_states)
    return _statistics_norm(norm, hidden_states, attention_mask,
                            _MovingAverageBatchNormStepFunction if in_c else None, _mabn_torch_ops)


def _mabn_torch_ops(norm, flat: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    """MABN in torch ops: its autograd function in training, the running statistic's map in eval."""
    dtype = stat_dtype(flat)
    xf = flat.to(dtype)
    weight, bias = norm.weight.to(dtype), norm.bias.to(dtype)
    if norm.training:
        statistics = norm.forward_statistics(xf, token_weights)
        return _MovingAverageBatchNormFunction.apply(xf, weight, bias, token_weights, norm, *statistics)
    return torch.addcmul(bias, xf, weight * torch.rsqrt(norm.running_phi.to(dtype) + norm.eps))


# ----------------------------------------------------------------------------------------------
# Per-token norms


def forward_layer_norm(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`LayerNorm.forward`: `F.layer_norm` in float32 (float64 for float64 inputs)."""
    _flatten(hidden_states, attention_mask, norm.hidden_size, weights=False)
    dtype = stat_dtype(hidden_states)
    with _float32(hidden_states.device):
        out = F.layer_norm(cast(hidden_states, dtype), (norm.hidden_size,), cast(norm.weight, dtype),
                           cast(norm.bias, dtype), norm.eps)
    return cast(out, hidden_states.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm in PN's C kernels: it is group scaling with one group and eps, times the weight, so
    the forward is one pass and the exact backward, `dx = r * (g - x_hat * mean(g * x_hat))` with
    `g = weight * dY`, is the group-scaling backward of `pn_backward` (a = weight, c = 0). Saves `x`."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x = x.contiguous()
        y, _, _ = pn_rows(x, None, 1, weight, statistics=False, eps=eps)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the gradient must be differentiable in turn
            with torch.enable_grad():
                y = F.rms_norm(x, (x.shape[-1],), weight, ctx.eps)
                grad_x, grad_weight = torch.autograd.grad(y, (x, weight), grad_output, create_graph=True,
                                                          allow_unused=True)
            return grad_x, grad_weight, None
        ones, zeros = torch.ones_like(weight, dtype=torch.float32), torch.zeros_like(weight, dtype=torch.float32)
        grad_x, sums = pn_backward(grad_output.float().contiguous(), x, None, 1, weight, zeros, ones, ones,
                                   eps=ctx.eps)
        return grad_x, sums[0].to(weight.dtype), None


def forward_rms_norm(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`RMSNorm.forward`: the scaled input, plus the bias where the norm has one (a converted LayerNorm's)."""
    out = _rms_scaled(norm, hidden_states, attention_mask)
    (bias,) = norm.tensors("bias")
    return out if bias is None else out + bias.to(out.dtype)


def _rms_scaled(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight`: one C pass each way on the CPU in float32, else `F.rms_norm`
    in float32."""
    _flatten(hidden_states, attention_mask, norm.hidden_size, weights=False)
    (weight,) = norm.tensors("weight")
    if _c_step_usable(hidden_states, (weight,)):
        if not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad)):
            # inference: one C pass, x * weight / sqrt(mean(x^2) + eps) as RMSNorm's group scaling
            # (torch's own F.rms_norm took 1.7-2.7x F.layer_norm's time on the CPU: BENCHMARKS.md)
            return norm_eval(hidden_states.contiguous(), 1, weight, group_eps=norm.eps)
        flat = hidden_states.reshape(-1, norm.hidden_size)
        y = _RMSNormFunction.apply(flat, weight, norm.eps)
        return y if flat is hidden_states else y.view_as(hidden_states)  # no view node for a no-op
    dtype = stat_dtype(hidden_states)
    with _float32(hidden_states.device):
        out = F.rms_norm(cast(hidden_states, dtype), (norm.hidden_size,), cast(weight, dtype), norm.eps)
    return cast(out, hidden_states.dtype)


def forward_group_norm(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`GroupNorm.forward`: `F.group_norm` over each token's channel groups, in float32."""
    flat, _ = _flatten(hidden_states, attention_mask, norm.hidden_size, weights=False)
    dtype = stat_dtype(flat)
    with _float32(flat.device):
        out = F.group_norm(cast(flat, dtype), norm.group_num, cast(norm.weight, dtype), cast(norm.bias, dtype),
                           norm.eps)
    return cast(out, flat.dtype).view_as(hidden_states)


def forward_identity(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`Identity.forward`: the input itself, once its shape and the mask's are checked."""
    _flatten(hidden_states, attention_mask, norm.hidden_size, weights=False)
    return hidden_states


# ----------------------------------------------------------------------------------------------
# Element-wise replacements: DyT and Derf


def _triton_elementwise_usable(x: torch.Tensor, *parameters: torch.Tensor | None) -> bool:
    """DyT's and Derf's Triton kernels run on CUDA's eager tensors only (`_eager_tensors`)."""
    return (x.device.type == "cuda" and _KERNEL_BACKEND[0] in ("auto", "triton") and _eager_tensors()
            and triton_elementwise_usable(x, *parameters))


def _elementwise_c_pass(x: torch.Tensor, function: str, alpha: float, shift: float, weight: torch.Tensor,
                        bias: torch.Tensor) -> torch.Tensor:
    """`weight * f(alpha * x + shift) + bias` in the C kernel's one forward pass (float32 on the CPU)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return elementwise_forward(flat, function, alpha, shift, weight.contiguous(), bias.contiguous()).view(x.shape)


class _ElementwiseNormFunction(torch.autograd.Function):
    """`y = weight * f(z) + bias`, `z = alpha * x (+ shift)`, f = tanh or erf, with the backward
    written out in a few passes over the tokens. With `g = dy * f'(z)`: `dx = g * weight * alpha`,
    `dalpha = sum(g * weight * x)`, `dshift = sum(g * weight)`, `dweight = sum_tokens(dy * f(z))`,
    `dbias = sum_tokens(dy)`. tanh is computed as `2 * sigmoid(2z) - 1`, the same function, because
    torch's CPU tanh takes about three times its sigmoid's time; from the saved `p = sigmoid(2z)`,
    `tanh'(z) = 4 * p * (1 - p)`. erf saves `erf(z)` and recomputes `z` from `x` for
    `erf'(z) = 2 / sqrt(pi) * exp(-z^2)`. On the CPU in float32 the C kernels take each way in one
    pass (`kernels_cpu.elementwise_forward`, `elementwise_backward`: `f(z)` recomputed from `x`, so
    only `x` is saved, as LayerNorm saves it); their tanh is a rational approximation within 2.8e-7 of
    float64 tanh and their erf within 6.4e-8 of float64 erf (torch's float32 erf: 3.2e-8; the C source
    says how). On CUDA the Triton kernels (`kernels_triton.elementwise_forward`, `elementwise_backward`)
    take the step in one launch forward and two backward, `x` alone saved, `alpha` and `shift` read on the device (no step waits
    for the host); the module hands them float32, bfloat16 or float16 tensors as they are (each value
    read as float32, the output and `dx` written in the input's dtype: no cast launched). Their tanh
    is `2 * sigmoid(2z) - 1` as here, their erf Triton's. `kernels`: `"c"` or `"triton"` where the
    caller found them usable (`_fused_kernels_usable`, `_triton_elementwise_usable`), else None."""

    @staticmethod
    def forward(ctx, x, alpha, shift, weight, bias, function, kernels):
        ctx.function, ctx.kernels = function, kernels
        if kernels == "c":
            ctx.alpha, ctx.shift = alpha.item(), 0.0 if shift is None else shift.item()
            ctx.save_for_backward(x, None, alpha, shift, weight, bias)
            return _elementwise_c_pass(x, function, ctx.alpha, ctx.shift, weight, bias)
        if kernels == "triton":
            ctx.save_for_backward(x, None, alpha, shift, weight, bias)
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return triton_elementwise_forward(flat, function, alpha, shift, weight, bias).view(x.shape)
        if function == "tanh":
            saved = torch.sigmoid_(x * (2.0 * alpha))
            out = torch.addcmul(bias - weight, saved, 2.0 * weight)  # weight * (2p - 1) + bias
        else:
            saved = torch.erf_(x * alpha if shift is None else torch.addcmul(shift, x, alpha))
            out = torch.addcmul(bias, saved, weight)
        ctx.save_for_backward(x, saved, alpha, shift, weight, bias)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, saved, alpha, shift, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the gradient must be differentiable in turn
            inputs = [t for t in (x, alpha, shift, weight, bias) if t is not None]
            with torch.enable_grad():
                y = elementwise_formula(x, alpha, shift, weight, bias, ctx.function)
                grads = iter(torch.autograd.grad(y, inputs, grad_output, create_graph=True, allow_unused=True))
            return (*(None if t is None else next(grads) for t in (x, alpha, shift, weight, bias)), None, None)
        channels = x.shape[-1]
        dy, flat = grad_output.reshape(-1, channels).contiguous(), x.reshape(-1, channels).contiguous()
        if ctx.kernels:  # one pass (C) or two launches (Triton); float32 sums: dweight, dbias, dalpha, dshift
            if ctx.kernels == "c":
                grad_x, grads = elementwise_backward(dy, flat, ctx.function, ctx.alpha, ctx.shift,
                                                     weight.contiguous(), ctx.needs_input_grad[0])
            else:
                grad_x, grads = triton_elementwise_backward(dy, flat, ctx.function, alpha, shift, weight,
                                                            ctx.needs_input_grad[0])
            grad_shift = None if shift is None else grads[2 * channels + 1:].to(shift.dtype).view(shift.shape)
            return (None if grad_x is None else grad_x.view(grad_output.shape),
                    grads[2 * channels:2 * channels + 1].to(alpha.dtype).view(alpha.shape), grad_shift,
                    grads[:channels].to(weight.dtype), grads[channels:2 * channels].to(bias.dtype), None, None)
        s, xf = saved.reshape(-1, channels), flat  # (tokens, hidden)
        dy_s = dy * s
        grad_bias = dy.sum(0)
        if ctx.function == "tanh":
            grad_weight = 2.0 * dy_s.sum(0) - grad_bias  # sum(dy * (2p - 1))
            v, scale = torch.addcmul(dy_s, dy_s, s, value=-1.0), 4.0 * weight  # dy * p * (1 - p)
        else:
            grad_weight = dy_s.sum(0)
            z = xf * alpha if shift is None else torch.addcmul(shift, xf, alpha)
            v, scale = dy * torch.exp_(z.square_().neg_()), weight * TWO_OVER_SQRT_PI
        grad_alpha = torch.dot((v * xf).sum(0), scale).reshape(alpha.shape)
        grad_shift = None if shift is None else torch.dot(v.sum(0), scale).reshape(shift.shape)
        grad_x = (v * (scale * alpha)).view_as(x) if ctx.needs_input_grad[0] else None
        return grad_x, grad_alpha, grad_shift, grad_weight, grad_bias, None, None


def _elementwise_operator(norm, x: torch.Tensor, attention_mask: torch.Tensor | None, parameters: tuple):
    """The C++ operator (`kernels_cpu.load_operator`) where it takes the step: an eager CPU training
    step in float32 (input and parameters), the shapes valid; else None (the general path, which
    raises for bad shapes)."""
    if not torch.is_grad_enabled() or not _fused_kernels_usable(x):
        return None
    if x.dim() not in (2, 3) or x.shape[-1] != norm.hidden_size:
        return None
    if attention_mask is not None and attention_mask.shape != x.shape[:-1]:
        return None
    if any(parameter is not None and parameter.dtype != torch.float32 for parameter in parameters):
        return None
    return load_operator()


def forward_elementwise(norm, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`DyT.forward` and `Derf.forward`: on the CPU in float32 a training step is one C++ operator
    around the C kernels (`_elementwise_operator`); under `torch.func` transforms the formula in torch
    ops (neither the operator nor an autograd function can be transformed); else the Triton kernels
    on CUDA; else in float32 (float64 for float64 inputs) the C kernels for the CPU (their forward
    alone under `no_grad`, a decoding step: no autograd; a training step without the operator in
    `_ElementwiseNormFunction`), the torch ops elsewhere, in `_ElementwiseNormFunction`."""
    parameters = norm.tensors("alpha", "shift", "weight", "bias")  # without `Module.__getattr__`'s detour
    operator = _elementwise_operator(norm, hidden_states, attention_mask, parameters)
    if operator is not None:  # as little Python as it can: a small step's Python costs as much as its arithmetic
        return operator(hidden_states, *parameters, SQUASH[norm.squash])
    _flatten(hidden_states, attention_mask, norm.hidden_size, weights=False)
    alpha, shift, weight, bias = parameters
    if _triton_elementwise_usable(hidden_states, alpha, shift, weight, bias):
        # CUDA: the kernels read every dtype as float32 and write the input's: no cast launched
        return _ElementwiseNormFunction.apply(hidden_states, alpha, shift, weight, bias, norm.squash, "triton")
    dtype = stat_dtype(hidden_states)
    x, alpha, weight, bias = cast(hidden_states, dtype), cast(alpha, dtype), cast(weight, dtype), cast(bias, dtype)
    shift = None if shift is None else cast(shift, dtype)
    if not _fused_kernels_usable(x):  # the parameters were cast to x's dtype: float32 where x is
        with _float32(x.device):
            if torch._C._are_functorch_transforms_active():  # torch.func.grad, vmap: the formula, which they transform
                out = elementwise_formula(x, alpha, shift, weight, bias, norm.squash)
            else:
                out = _ElementwiseNormFunction.apply(x, alpha, shift, weight, bias, norm.squash, None)
    elif torch.is_grad_enabled():  # the operator unavailable: the same kernels in a Python autograd function
        out = _ElementwiseNormFunction.apply(x, alpha, shift, weight, bias, norm.squash, "c")
    else:
        out = _elementwise_c_pass(x, norm.squash, alpha.item(), 0.0 if shift is None else shift.item(), weight, bias)
    return cast(out, hidden_states.dtype)
