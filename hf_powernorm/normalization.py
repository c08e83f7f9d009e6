"""Every normalization layer of the project behind one interface, and their registry.

`PowerNorm` is Power Normalization (Shen et al., ICML 2020): Section 4, Algorithm 2 and
eqs. (11)-(13), with the group scaling of the authors' reference code and the choices written down
in `powernorm-notes.md` (forward with the previous running quadratic mean after warmup, cumulative
mean during warmup, approximate backward with the running gradient statistic `nu`). Its relatives
are the paper's baselines (Table 1, Appendix B.3): `PowerNormV`, `MaskedBatchNorm`, `LayerNorm`,
`RMSNorm`, `GroupNorm` and `Identity` ("none").

Interface shared by all: `Norm(hidden_size, eps=..., **options)` and
`forward(hidden_states, attention_mask=None)` with hidden states `(batch, seq, hidden)` or
`(tokens, hidden)` and `attention_mask` `(batch, seq)` (1 = real token). Norms that use batch
statistics compute them over real tokens only and in float32 whatever the input dtype; padding
never changes a statistic (as long as its values are finite), nor the output or gradient of a real
token. The output has the input's dtype.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .kernels_cpu import (
    fused_backward_input,
    fused_backward_sums,
    fused_forward_output,
    fused_forward_stats,
    kernels_usable,
)

GROUP_SCALE_EPS = 1e-5
BACKWARD_DENOMINATORS = ("running", "batch")


# ----------------------------------------------------------------------------------------------
# Helpers: shapes, masks, masked sums, process-group reduction


def _flatten(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, hidden_size: int):
    """Return hidden states as `(tokens, hidden)` and float32 token weights `(tokens,)` or None."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() not in (2, 3) or hidden_states.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden_states must have shape (batch, seq, {hidden_size}) or (tokens, {hidden_size}), "
            f"got {tuple(hidden_states.shape)}"
        )
    flat = hidden_states.reshape(-1, hidden_size)
    if attention_mask is None:
        return flat, None
    if tuple(attention_mask.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(
            f"attention_mask must have shape {tuple(hidden_states.shape[:-1])} to match hidden_states "
            f"{tuple(hidden_states.shape)}, got {tuple(attention_mask.shape)}"
        )
    real = attention_mask.reshape(-1).to(flat.device) != 0
    if bool(real.all()):
        return flat, None
    return flat, real.to(_stat_dtype(flat))


def _token_sum(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Sum `(tokens, C)` over real tokens: a matrix-vector product with the 0/1 weights, no gather."""
    return values.sum(0) if weights is None else weights @ values


def _token_count(flat: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return torch.tensor(float(flat.shape[0]), device=flat.device, dtype=_stat_dtype(flat))
    return weights.sum()


def _sync_enabled(sync_stats: bool, process_group) -> bool:
    return (
        sync_stats
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(process_group) > 1
    )


def _all_reduce_(tensor: torch.Tensor, process_group) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)
    return tensor


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _in_recomputation() -> bool:
    """True while autograd runs a backward pass: activation checkpointing recomputes forwards there."""
    return _GRAPH_TASK_ID() != -1


def _stat_dtype(tensor: torch.Tensor) -> torch.dtype:
    """Statistics are float32, or float64 for float64 inputs (so `gradcheck` can run)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _float32(device: torch.device):
    """Statistics stay float32 under autocast: matrix products would otherwise run in half precision."""
    if device.type in ("cpu", "cuda", "xpu", "mps", "hpu"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _warn_non_finite(name: str, what: str) -> None:
    warnings.warn(
        f"{name}: non-finite {what} (NaN or inf in the input or gradient); the running statistics "
        "were not updated for this batch",
        RuntimeWarning,
        stacklevel=3,
    )


def group_scale(hidden_states: torch.Tensor, group_num: int | None) -> torch.Tensor:
    """Per token, divide each of `group_num` channel groups by its root mean square (+1e-5).

    The parameter-free "layer-scale" step of the reference PN code; ordinary autograd, computed in
    float32, applied to padding too. `group_num=None` returns the input unchanged.
    """
    if group_num is None:
        return hidden_states
    channels = hidden_states.shape[-1]
    if channels % group_num != 0:
        raise ValueError(f"group_num={group_num} must divide the hidden size {channels}")
    grouped = hidden_states.to(_stat_dtype(hidden_states)).unflatten(-1, (group_num, channels // group_num))
    scaled = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + GROUP_SCALE_EPS)
    return scaled.flatten(-2)


def _check_group_num(group_num: int | None, hidden_size: int, allow_none: bool = True) -> None:
    if group_num is None and allow_none:
        return
    if not isinstance(group_num, int) or isinstance(group_num, bool) or group_num < 1:
        raise ValueError(f"group_num must be a positive integer{' or None' * allow_none}, got {group_num!r}")
    if hidden_size % group_num != 0:
        raise ValueError(f"group_num={group_num} must divide hidden_size={hidden_size}")


def _check_fraction(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


# ----------------------------------------------------------------------------------------------
# Base class


class _Norm(nn.Module):
    """Shared constructor checks and the `(tokens, hidden)` view of the input."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive integer, got {hidden_size!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class _RunningStatsNorm(_Norm):
    """Affine norm with float32 running statistics (`_running_buffers`: name -> initial value) and a
    `num_batches_tracked` counter; the statistics stay float32 when the module is cast."""

    _running_buffers: dict[str, float] = {}

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        for name, value in self._running_buffers.items():
            self.register_buffer(name, torch.full((hidden_size,), value, dtype=torch.float32))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def reset_running_stats(self) -> None:
        with torch.no_grad():
            for name, value in self._running_buffers.items():
                getattr(self, name).fill_(value)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def _usable(self, count: torch.Tensor, *statistics: torch.Tensor, what: str = "batch statistic") -> bool:
        """False for a batch without real tokens, or (with a warning) for non-finite statistics."""
        if count.item() == 0:
            return False
        if not all(bool(torch.isfinite(stat).all()) for stat in statistics):
            _warn_non_finite(type(self).__name__, what)
            return False
        return True

    def _apply(self, fn, recurse=True):
        before = {name: self._buffers[name] for name in self._running_buffers}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self


# ----------------------------------------------------------------------------------------------
# PowerNorm


class _PowerNormFunction(torch.autograd.Function):
    """Group scaling, PN forward and the approximate backward of eqs. (11)-(13), fused.

    On CPU float32 inputs the work runs in the fused kernels of `kernels_cpu.py` (saving `x` and the
    per-token group scales `r`); elsewhere in torch ops (saving `z0 = GS(x)` and `r`). Either way the
    backward needs one batch reduction, `sum(dY * z0)`: `Gamma = mean_V(Z^2) = v / s^2` is known
    from the forward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, token_weights, norm):
        ctx.fused = kernels_usable(x)
        with _float32(x.device):
            if ctx.fused:
                x = x.contiguous()
                r, sum_sq = fused_forward_stats(x, token_weights, norm.group_num)
                inv_s, inv_s_b, v, count = norm._denominators(sum_sq, _token_count(x, token_weights))
                y = fused_forward_output(x, r, norm.group_num, weight.float() * inv_s, bias)
                ctx.save_for_backward(x, r, token_weights, weight)
            else:
                dtype = _stat_dtype(x)
                xf = x.to(dtype).contiguous()
                out = torch.empty_like(xf)  # holds x^2 for the statistics, then the output
                z0, r = _group_scale_forward(xf, norm.group_num, squares=out)
                sum_sq = _masked_square_sum(r, out, token_weights, norm.group_num)
                inv_s, inv_s_b, v, count = norm._denominators(sum_sq, _token_count(xf, token_weights))
                y = torch.addcmul(bias.to(dtype), z0, weight.to(dtype) * inv_s, out=out)
                ctx.save_for_backward(z0, r, token_weights, weight)
        ctx.stats = (inv_s, inv_s_b, v, count)
        ctx.norm = norm
        ctx.input_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        saved, r, token_weights, weight = ctx.saved_tensors
        inv_s, inv_s_b, v, count = ctx.stats
        norm = ctx.norm
        dtype = torch.float32 if ctx.fused else saved.dtype
        w = weight.to(dtype)
        nu = norm.running_nu.to(dtype, copy=True)  # nu of the previous step, eq. (11)
        with _float32(grad_output.device):
            dy = grad_output.to(dtype).contiguous()
            if ctx.fused:
                sum_dy_z0, real_dy_z0, sum_dy = fused_backward_sums(dy, saved, r, token_weights, norm.group_num)
            else:
                dy_z0 = dy * saved
                sum_dy_z0, real_dy_z0, sum_dy = dy_z0.sum(0), _token_sum(dy_z0, token_weights), dy.sum(0)
            if v is not None:
                # Gamma = mean_V(Z^2) = v / s^2 and Lambda = mean_V(g * Z), g = gamma * dY, Z = z0 / s.
                norm._update_nu(v * inv_s.square(), w * inv_s * real_dy_z0, count)
            # dZ0 = (g - nu * Z on real tokens) / s_b = dY * a - (real) * c * z0      (eqs. 11-12)
            a, c = w * inv_s_b, nu * inv_s * inv_s_b
            if ctx.fused:
                grad_x = fused_backward_input(dy, saved, r, token_weights, norm.group_num, a, c)
            else:
                grad_x = _eager_backward_input(dy, saved, r, token_weights, norm.group_num, a, c, scratch=dy_z0)
        grad_weight = (inv_s * sum_dy_z0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x.to(ctx.input_dtype), grad_weight, grad_bias, None, None


def _eager_backward_input(dy, z0, r, token_weights, group_num, a, c, scratch):
    grad_z0 = dy * a
    if token_weights is None:
        grad_z0.addcmul_(z0, c, value=-1.0)
    else:
        grad_z0.addcmul_(torch.mul(z0, token_weights[:, None], out=scratch), c, value=-1.0)
    return _group_scale_backward(grad_z0, z0, r, group_num, scratch)


def _group_scale_forward(xf: torch.Tensor, group_num: int | None, squares: torch.Tensor):
    """Return `z0 = GS(x)` and the per-token group scales `r` (tokens, G); fills `squares = x^2`."""
    torch.mul(xf, xf, out=squares)
    if group_num is None:
        return xf, None
    tokens, channels = xf.shape
    r = torch.rsqrt(squares.view(tokens, group_num, -1).mean(-1) + GROUP_SCALE_EPS)
    z0 = (xf.view(tokens, group_num, -1) * r.unsqueeze(-1)).view(tokens, channels)
    return z0, r


def _group_scale_backward(grad_z0, z0, r, group_num, scratch):
    """Exact backward of group scaling, in place: `dx = r * (dz0 - z0 * mean_group(dz0 * z0))`."""
    if group_num is None:
        return grad_z0
    tokens, channels = z0.shape
    dz = grad_z0.view(tokens, group_num, -1)
    z = z0.view(tokens, group_num, -1)
    projection = torch.mul(dz, z, out=scratch.view_as(dz)).mean(-1, keepdim=True)
    return dz.addcmul_(z, projection, value=-1.0).mul_(r.unsqueeze(-1)).view(tokens, channels)


class PowerNorm(_RunningStatsNorm):
    """Power Normalization (Shen et al., 2020, Algorithm 2) with masked statistics.

    Training step t (t = num_batches_tracked + 1): `z0 = GS(x)`, `v = mean_V(z0^2)`;
    denominator `s = sqrt(v + eps)` while `t <= warmup_steps`, else `sqrt(running_phi + eps)`
    (the statistic of the previous step); `y = weight * z0 / s + bias`; `running_phi` is the
    cumulative mean of `v` during warmup and an EMA with `alpha_fwd` after. The backward is the
    paper's approximation with the running gradient statistic `running_nu` (EMA with `alpha_bkw`),
    dividing by `s` (`backward_denominator="running"`, eq. 12) or always by the batch statistic
    (`"batch"`, the reference code). In eval: `y = weight * GS(x) / sqrt(running_phi + eps) + bias`.

    `sync_stats=True` sums the statistics over `process_group` (default: the world) under
    `torch.distributed`, so every rank holds the buffers of one process on the whole batch.
    """

    _running_buffers = {"running_phi": 1.0, "running_nu": 0.0}

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        alpha_fwd: float = 0.9,
        alpha_bkw: float = 0.9,
        warmup_steps: int = 0,
        group_num: int | None = 1,
        backward_denominator: str = "running",
        sync_stats: bool = False,
        process_group=None,
    ) -> None:
        super().__init__(hidden_size, eps)
        _check_fraction("alpha_fwd", alpha_fwd)
        _check_fraction("alpha_bkw", alpha_bkw)
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
        _check_group_num(group_num, hidden_size)
        if backward_denominator not in BACKWARD_DENOMINATORS:
            raise ValueError(
                f"backward_denominator must be one of {BACKWARD_DENOMINATORS}, got {backward_denominator!r}"
            )
        self.alpha_fwd = float(alpha_fwd)
        self.alpha_bkw = float(alpha_bkw)
        self.warmup_steps = warmup_steps
        self.group_num = group_num
        self.backward_denominator = backward_denominator
        self.sync_stats = bool(sync_stats)
        self.process_group = process_group
        self._last_denominators = None

    def reset_running_stats(self) -> None:
        super().reset_running_stats()
        self._last_denominators = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat, token_weights = _flatten(hidden_states, attention_mask, self.hidden_size)
        if self.training:
            out = _PowerNormFunction.apply(flat, self.weight, self.bias, token_weights, self)
        else:
            scale, shift = self.affine_after_group_scale()
            dtype = _stat_dtype(flat)
            with _float32(flat.device):
                z0 = group_scale(flat, self.group_num).to(dtype)
                out = torch.addcmul(shift.to(dtype), z0, scale.to(dtype)).to(flat.dtype)
        return out.view(hidden_states.shape)

    def affine_after_group_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The eval-mode map `y = GS(x) * scale + shift` as float32 `(scale, shift)`."""
        scale = self.weight.float() * torch.rsqrt(self.running_phi + self.eps)
        return scale, self.bias.float()

    # -- statistics, called from the autograd function --

    def _denominators(self, sum_sq: torch.Tensor, count: torch.Tensor):
        """Forward statistics of one training step; updates `running_phi` and the step counter.

        Returns `(1/s, 1/s_backward, v or None, real-token count)`; `v` is None when the step
        takes no statistic (no real token, non-finite values, or a checkpointing recomputation).
        """
        if _in_recomputation() and self._last_denominators is not None:
            return self._last_denominators  # same step: reuse its statistics, update nothing
        sums = torch.cat([sum_sq, count.to(sum_sq.dtype).view(1)])
        if _sync_enabled(self.sync_stats, self.process_group):
            _all_reduce_(sums, self.process_group)
        count = sums[-1]
        v = sums[:-1] / count.clamp_min(1.0)
        running = torch.rsqrt(self.running_phi.to(v.dtype) + self.eps)
        if not self._usable(count, v):
            self._last_denominators = (running, running, None, count)
            return self._last_denominators
        step = int(self.num_batches_tracked) + 1
        batch = torch.rsqrt(v + self.eps)
        inv_s = batch if step <= self.warmup_steps else running
        inv_s_b = inv_s if self.backward_denominator == "running" else batch
        with torch.no_grad():
            weight = 1.0 / step if step <= self.warmup_steps else 1.0 - self.alpha_fwd
            self.running_phi.lerp_(v.float(), weight)
            self.num_batches_tracked.add_(1)
        self._last_denominators = (inv_s, inv_s_b, v, count)
        return self._last_denominators

    def _update_nu(self, gamma: torch.Tensor, lambda_sum: torch.Tensor, count: torch.Tensor) -> None:
        """`nu <- nu * (1 - (1 - a) * Gamma) + (1 - a) * Lambda` (eq. 13), Lambda summed over ranks."""
        if _sync_enabled(self.sync_stats, self.process_group):
            _all_reduce_(lambda_sum, self.process_group)
        lam = lambda_sum / count.clamp_min(1.0)
        if not self._usable(count, lam, what="gradient statistic"):
            return
        rate = 1.0 - self.alpha_bkw
        with torch.no_grad():
            self.running_nu.mul_(1.0 - rate * gamma.float()).add_(rate * lam.float())

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}, "
            f"warmup_steps={self.warmup_steps}, group_num={self.group_num}, "
            f"backward_denominator={self.backward_denominator!r}, sync_stats={self.sync_stats}"
        )


def _masked_square_sum(r, squares, token_weights, group_num) -> torch.Tensor:
    """`sum_V z0^2` per channel from `squares = x^2`: `z0^2 = x^2 * r^2`, summed as one batched
    matrix product per group (no `z0^2` tensor, no gather of real tokens)."""
    if group_num is None:
        return _token_sum(squares, token_weights)
    coefficients = r.square()  # (tokens, G)
    if token_weights is not None:
        coefficients = coefficients * token_weights[:, None]
    tokens, channels = squares.shape
    grouped = squares.view(tokens, group_num, -1).transpose(0, 1)  # (G, tokens, C/G)
    return torch.bmm(coefficients.t().unsqueeze(1), grouped).reshape(channels)


# ----------------------------------------------------------------------------------------------
# Batch-statistic relatives: PN-V and masked batch normalization


class PowerNormV(_RunningStatsNorm):
    """PN-V (the paper's Table 1): divide by the batch quadratic mean with its exact gradient.

    Training: `y = weight * z0 / sqrt(v + eps) + bias` with `v = mean_V(z0^2)`, `z0 = GS(x)`
    (no group scaling by default); `running_phi` is an EMA of `v` (`alpha_fwd`) used in eval.
    """

    _running_buffers = {"running_phi": 1.0}

    def __init__(self, hidden_size: int, eps: float = 1e-5, alpha_fwd: float = 0.9, group_num: int | None = None):
        super().__init__(hidden_size, eps)
        _check_fraction("alpha_fwd", alpha_fwd)
        _check_group_num(group_num, hidden_size)
        self.alpha_fwd = float(alpha_fwd)
        self.group_num = group_num

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat, token_weights = _flatten(hidden_states, attention_mask, self.hidden_size)
        dtype = _stat_dtype(flat)
        with _float32(flat.device):
            z0 = group_scale(flat, self.group_num).to(dtype)
            phi = self.running_phi.to(dtype)
            if self.training:
                count = _token_count(z0, token_weights)
                v = _token_sum(z0.square(), token_weights) / count.clamp_min(1.0)
                if self._update(v, count):
                    phi = v
            out = torch.addcmul(self.bias.to(dtype), z0 * torch.rsqrt(phi + self.eps), self.weight.to(dtype))
        return out.to(flat.dtype).view(hidden_states.shape)

    def _update(self, v: torch.Tensor, count: torch.Tensor) -> bool:
        """EMA update of `running_phi`; False when the batch gives no usable statistic."""
        if not self._usable(count, v):
            return False
        if not _in_recomputation():
            with torch.no_grad():
                self.running_phi.lerp_(v.detach().float(), 1.0 - self.alpha_fwd)
                self.num_batches_tracked.add_(1)
        return True

    def affine_after_group_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.weight.float() * torch.rsqrt(self.running_phi + self.eps)
        return scale, self.bias.float()

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, alpha_fwd={self.alpha_fwd}, group_num={self.group_num}"


class MaskedBatchNorm(_RunningStatsNorm):
    """Batch normalization for sequences: mean and variance over real tokens only.

    Like `torch.nn.BatchNorm1d`: biased variance to normalize, unbiased variance in the running
    estimate, `momentum` as its update rate; eval uses the running estimates.
    """

    _running_buffers = {"running_mean": 0.0, "running_var": 1.0}

    def __init__(self, hidden_size: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__(hidden_size, eps)
        _check_fraction("momentum", momentum)
        self.momentum = float(momentum)
        self.group_num = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat, token_weights = _flatten(hidden_states, attention_mask, self.hidden_size)
        dtype = _stat_dtype(flat)
        with _float32(flat.device):
            xf = flat.to(dtype)
            mean, var = self.running_mean.to(dtype), self.running_var.to(dtype)
            if self.training:
                count = _token_count(xf, token_weights)
                batch_mean = _token_sum(xf, token_weights) / count.clamp_min(1.0)
                batch_var = _token_sum((xf - batch_mean).square(), token_weights) / count.clamp_min(1.0)
                if self._update(batch_mean, batch_var, count):
                    mean, var = batch_mean, batch_var
            scale = self.weight.to(dtype) * torch.rsqrt(var + self.eps)
            out = torch.addcmul(self.bias.to(dtype), xf - mean, scale)
        return out.to(flat.dtype).view(hidden_states.shape)

    def _update(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> bool:
        if not self._usable(count, mean, var):
            return False
        n = count.item()
        if not _in_recomputation():
            unbiased = var.detach().float() * (n / max(n - 1.0, 1.0))
            with torch.no_grad():
                self.running_mean.lerp_(mean.detach().float(), self.momentum)
                self.running_var.lerp_(unbiased, self.momentum)
                self.num_batches_tracked.add_(1)
        return True

    def affine_after_group_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.weight.float() * torch.rsqrt(self.running_var + self.eps)
        return scale, self.bias.float() - self.running_mean * scale

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, momentum={self.momentum}"


# ----------------------------------------------------------------------------------------------
# Per-token norms


class LayerNorm(_Norm):
    """Layer normalization over channels, per token, computed in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        _flatten(hidden_states, attention_mask, self.hidden_size)
        dtype = _stat_dtype(hidden_states)
        with _float32(hidden_states.device):
            out = F.layer_norm(
                hidden_states.to(dtype), (self.hidden_size,), self.weight.to(dtype), self.bias.to(dtype), self.eps
            )
        return out.to(hidden_states.dtype)


class RMSNorm(_Norm):
    """Root-mean-square normalization over channels, per token (no mean, no bias)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        _flatten(hidden_states, attention_mask, self.hidden_size)
        dtype = _stat_dtype(hidden_states)
        with _float32(hidden_states.device):
            xf = hidden_states.to(dtype)
            out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(dtype)
        return out.to(hidden_states.dtype)


class GroupNorm(_Norm):
    """Group normalization over `group_num` channel groups of each token (mean and variance)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_num: int = 1):
        super().__init__(hidden_size, eps)
        _check_group_num(group_num, hidden_size, allow_none=False)
        self.group_num = group_num
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat, _ = _flatten(hidden_states, attention_mask, self.hidden_size)
        dtype = _stat_dtype(flat)
        with _float32(flat.device):
            out = F.group_norm(flat.to(dtype), self.group_num, self.weight.to(dtype), self.bias.to(dtype), self.eps)
        return out.to(flat.dtype).view(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, group_num={self.group_num}"


class Identity(_Norm):
    """No normalization: the baseline of the sentiment study. Accepts and ignores `eps`."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        _flatten(hidden_states, attention_mask, self.hidden_size)
        return hidden_states


# ----------------------------------------------------------------------------------------------
# Registry

NORM_CLASSES: dict[str, type[nn.Module]] = {
    "powernorm": PowerNorm,
    "powernorm_v": PowerNormV,
    "batchnorm": MaskedBatchNorm,
    "layernorm": LayerNorm,
    "rmsnorm": RMSNorm,
    "groupnorm": GroupNorm,
    "none": Identity,
}

_ALIASES = {
    "powernorm": "powernorm",
    "pn": "powernorm",
    "powernormv": "powernorm_v",
    "pnv": "powernorm_v",
    "batchnorm": "batchnorm",
    "maskedbatchnorm": "batchnorm",
    "bn": "batchnorm",
    "layernorm": "layernorm",
    "ln": "layernorm",
    "rmsnorm": "rmsnorm",
    "groupnorm": "groupnorm",
    "gn": "groupnorm",
    "none": "none",
    "identity": "none",
}


def normalize_norm_name(name: str) -> str:
    """Map any spelling (`"PowerNorm"`, `"power_norm"`, `"PN-V"`) to its `NORM_CLASSES` key."""
    if not isinstance(name, str):
        raise ValueError(f"norm name must be a string, got {name!r}; valid names: {sorted(NORM_CLASSES)}")
    key = _ALIASES.get(re.sub(r"[\s_\-]", "", name.lower()))
    if key is None:
        raise ValueError(f"unknown norm {name!r}; valid names: {sorted(NORM_CLASSES)}")
    return key


def build_norm(name: str, hidden_size: int, **options) -> nn.Module:
    """Build the norm called `name` (any spelling) with its options; unknown options raise TypeError."""
    cls = NORM_CLASSES[normalize_norm_name(name)]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "hidden_size")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"{cls.__name__} does not take option(s) {unknown}; it takes {accepted}")
    return cls(hidden_size, **options)


__all__ = [
    "BACKWARD_DENOMINATORS",
    "NORM_CLASSES",
    "GroupNorm",
    "Identity",
    "LayerNorm",
    "MaskedBatchNorm",
    "PowerNorm",
    "PowerNormV",
    "RMSNorm",
    "build_norm",
    "group_scale",
    "normalize_norm_name",
]
