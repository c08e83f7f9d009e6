"""Every normalization layer of the project behind one interface, and their registry.

`PowerNorm` is Power Normalization (Shen et al., ICML 2020): Section 4, Algorithm 2 and
eqs. (11)-(13), with the group scaling of the authors' reference code and the choices written down
in `docs/norms.md` (forward with the previous running quadratic mean after warmup, the warmup
statistic `"cumulative"` or that of the reference code, an optional ramp from the batch to the running
denominator, approximate backward with the running gradient statistic `nu`). Its relatives are the
paper's baselines (Table 1, Appendix B.3): `PowerNormV`, `MaskedBatchNorm`, `BatchRenorm` (Ioffe,
2017), `MovingAverageBatchNorm` (Yan et al., 2020), `LayerNorm`, `RMSNorm`, `GroupNorm` and
`Identity` ("none"). `DyT` (Zhu et al., CVPR 2025) and `Derf` are the element-wise replacements
published since: a learnable squashing function per element, no statistic.

Interface shared by all: `Norm(hidden_size, eps=..., **options)` and
`forward(hidden_states, attention_mask=None)` with hidden states `(batch, seq, hidden)` or
`(tokens, hidden)` and `attention_mask` `(batch, seq)` (1 = real token). Norms that use batch
statistics compute them over real tokens only and in float32 whatever the input dtype; padding
never changes a statistic (as long as its values are finite), nor the output or gradient of a real
token. The output has the input's dtype.

This file holds what each norm computes: its options and their checks, its traits, its parameters
and running statistics and how a step updates them. How a step runs (the C kernels, the Triton
kernels, the `torch.library` operators, compiled or plain torch ops, chosen by `kernel_backend`) is
`norm_dispatch.py`'s: each module's `forward` is one call into it. The arithmetic the backends share
is in `norm_functional.py` (`docs/norm_internals.md`).
"""

from __future__ import annotations

import inspect
import math
import re

import torch
from torch import nn

from .norm_dispatch import (  # noqa: F401 - re-exported: the backend switch and `group_scale`
    KERNEL_BACKENDS,
    StepRecord,
    all_reduce_,
    available_kernel_backends,
    current_kernel_backend,
    forward_batch_norm,
    forward_elementwise,
    forward_group_norm,
    forward_identity,
    forward_layer_norm,
    forward_moving_average_batch_norm,
    forward_power_norm,
    forward_power_norm_v,
    forward_rms_norm,
    group_scale,
    host_readable,
    in_recomputation,
    kernel_backend,
    sync_enabled,
    warn_if_ddp_overwrites_statistics,
    warn_non_finite,
)
from .norm_functional import (
    GROUP_SCALE_EPS,
    all_finite,
    batch_moments,
    lerp_,
    mask_weights,
    token_count,
    token_sum,
    write_row_,
)

BACKWARD_DENOMINATORS = ("running", "batch")
WARMUP_STATISTICS = ("cumulative", "reference")


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


def _check_count(name: str, value: int, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        expected = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_at_least(name: str, value: float, minimum: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= minimum:
        raise ValueError(f"{name} must be a number >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------------------------
# Base class


class _Norm(nn.Module):
    """Shared constructor checks and the `(tokens, hidden)` view of the input."""

    # Traits: what the model, the converter, the model card and the recipes ask of a norm
    # (docs/adding_a_norm.md); every class of the registry sets each one.
    # The training output of a token depends on the other tokens of the batch (batch statistics).
    mixes_positions: bool = False
    # Non-empty: it mixes them only while one of these constructor options is positive.
    mixing_options: tuple[str, ...] = ()
    # It keeps running statistics in buffers that eval uses and a checkpoint must carry.
    has_running_stats: bool = False
    # In eval it is a per-channel affine map after group scaling (`affine_after_group_scale()`), which
    # `fold_norms()` moves into the linear layers that read it.
    foldable: bool = False
    # Constructor option -> the `PowerNormTransformerConfig` field that sets it (besides `eps`).
    config_options: dict[str, str] = {}
    # Constructor option -> the prefix of the config fields that set it per site of the model
    # (`<prefix>_attention`, `<prefix>_ffn`, `<prefix>_final`: before attention, before the FFN, last).
    site_options: dict[str, str] = {}
    # The model family makes its embedding scale a learnable scalar in a stack of these norms by default.
    learnable_embed_scale: bool = False
    # Short names the registry accepts besides the class's key and name (`norm_spellings()`); read off
    # the class itself, never inherited.
    short_names: tuple[str, ...] = ()

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

    def _add_affine_parameters(self, bias: bool = True) -> None:
        """A per-channel `weight` starting at 1 and, with `bias`, a per-channel `bias` starting at 0."""
        self.weight = nn.Parameter(torch.ones(self.hidden_size))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.hidden_size))

    def tensors(self, *names: str) -> tuple[torch.Tensor | None, ...]:
        """The parameters and buffers called `names` (None for one the norm lacks): what the dispatch
        hands its kernels, in one call rather than one `nn.Module.__getattr__` each."""
        parameters, buffers = self._parameters, self._buffers
        return tuple(parameters[name] if name in parameters else buffers.get(name) for name in names)

    def reset_parameters(self) -> None:
        """`weight` back to 1 and `bias` to 0, where the norm has them."""
        for name, value in (("weight", 1.0), ("bias", 0.0)):
            if name in self._parameters:
                nn.init.constant_(self._parameters[name], value)

    @classmethod
    def buffer_defaults(cls) -> dict[str, float]:
        """Each buffer the norm keeps for eval -> the value it starts at (none for a per-token norm)."""
        return {}

    @classmethod
    def float32_buffers(cls) -> tuple[str, ...]:
        """The buffers that stay float32 whatever dtype the module is cast or loaded in."""
        return ()


class _RunningStatsNorm(_Norm):
    """Affine norm with float32 running statistics (`_running_buffers`: name -> initial value) and a
    `num_batches_tracked` counter; the statistics (and any buffer a subclass lists in
    `_window_buffers`) stay float32 when the module is cast."""

    _running_buffers: dict[str, float] = {}
    _window_buffers: tuple[str, ...] = ()

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self._add_affine_parameters()
        for name, value in self._running_buffers.items():
            self.register_buffer(name, torch.full((hidden_size,), value, dtype=torch.float32))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self.last_step: StepRecord | None = None  # how the last training step ran (`record_step`)

    @classmethod
    def buffer_defaults(cls) -> dict[str, float]:
        """The running statistics' initial values, 0 for the windows and the step counter."""
        return {**cls._running_buffers, **dict.fromkeys(cls._window_buffers, 0.0), "num_batches_tracked": 0}

    @classmethod
    def float32_buffers(cls) -> tuple[str, ...]:
        return (*cls._running_buffers, *cls._window_buffers)

    def reset_running_stats(self) -> None:
        with torch.no_grad():
            for name, value in self.buffer_defaults().items():
                getattr(self, name).fill_(value)
        self.last_step = None

    def record_step(self, record: StepRecord | None) -> None:
        """Keep how this training step ran and its statistics: a checkpointing recomputation of the
        step takes the same path and reuses them, updating nothing."""
        self.__dict__["last_step"] = record  # plain: nn.Module.__setattr__ costs more than a small step

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        super().reset_parameters()

    def usable_batch(self, count: torch.Tensor, *statistics: torch.Tensor,
                     what: str = "batch statistic") -> torch.Tensor:
        """A boolean 0-dim tensor, decided on the device: false for a batch without real tokens, or
        (with a warning where one can be given for free) for non-finite statistics."""
        warn_if_ddp_overwrites_statistics(self)
        has_tokens, finite = count > 0, all_finite(*statistics)
        warn_non_finite(type(self).__name__, what, has_tokens & ~finite)
        return has_tokens & finite

    def _count_batch_(self, usable: torch.Tensor) -> None:
        """`num_batches_tracked += 1` for a usable batch, on the device."""
        self.num_batches_tracked.add_(usable.to(self.num_batches_tracked.dtype))

    def next_step(self) -> torch.Tensor:
        """This training step's t = num_batches_tracked + 1, a 0-dim tensor on the device."""
        return self.num_batches_tracked + 1

    def eval_statistics(self) -> tuple[torch.Tensor | None, torch.Tensor, int | None, float]:
        """`(mean, var, group_num, group_eps)` of the eval map `GS(x) * weight / sqrt(var + eps) + bias -
        mean * scale`."""
        return None, self._buffers["running_phi"], self.__dict__.get("group_num"), self.__dict__.get(
            "group_eps", GROUP_SCALE_EPS)

    def _apply(self, fn, recurse=True):
        before = {name: self._buffers[name] for name in self.float32_buffers()}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self


class PowerNorm(_RunningStatsNorm):
    """Power Normalization (Shen et al., 2020, Algorithm 2) with masked statistics.

    Training step t (t = num_batches_tracked + 1), with `W = warmup_steps`, `K = warmup_ramp_steps`
    and `phi = running_phi` as it was before the step: `z0 = GS(x)`, `v = mean_V(z0^2)`;
    denominator `s^2 = (1 - r) * (v + eps) + r * (phi + eps)` with the weight of the running statistic
    `r = clamp((t - W) / (K + 1), 0, 1)`: `s = sqrt(v + eps)` while `t <= W`, `s = sqrt(phi + eps)`
    from `t = W + K + 1` on, and over the K steps in between a linear blend of the two second moments
    (`K = 0`, the default, is the paper's switch; the blend removes its jump when the batch statistics
    have drifted from the running one). `y = weight * z0 / s + bias`.

    Running statistic (`warmup_statistic`): `"cumulative"` makes `phi` the cumulative mean of `v` while
    `t <= W` and an EMA with `alpha_fwd` after; `"reference"` (the authors' `MaskPowerNorm`) takes,
    while `t < W`, the cumulative step `phi <- phi * (t - 1) / t + v / t` followed by the EMA step
    `phi <- alpha_fwd * phi + (1 - alpha_fwd) * v`, and the EMA step alone from `t = W` on.
    `"reference"` is the default, the authors' statistic (STUDIES.md's warmup-switch study compares
    the two).

    Backward: the paper's approximation (eqs. 11-13) for whatever `s` the step used, ramp included:
    with `Z = z0 / s` and `g = weight * dY`, `dz0 = (g - nu * Z) / s_b` on real tokens and `g / s_b`
    on padding, where `s_b = s` (`backward_denominator="running"`, eq. 12) or `sqrt(v + eps)` always
    (`"batch"`, the reference code); no gradient flows through `v` or `phi`. The running gradient
    statistic `nu = running_nu` takes `Gamma = mean_V(Z^2) = v / s^2` and `Lambda = mean_V(g * Z)`:
    `nu <- nu * (1 - (1 - alpha_bkw) * Gamma) + (1 - alpha_bkw) * Lambda`.
    In eval: `y = weight * GS(x) / sqrt(running_phi + eps) + bias`.

    `sync_stats=True` sums the statistics over `process_group` (default: the world) under
    `torch.distributed`, so every rank holds the buffers of one process on the whole batch.
    `group_eps` is group scaling's epsilon (1e-5, the reference's); with one group, GS is an RMSNorm
    with that epsilon, which is how `convert_norms(..., preserve_function=True)` reproduces a source
    RMSNorm exactly.
    """

    mixes_positions = True  # it divides by the batch statistic during warmup and the ramp only
    mixing_options = ("warmup_steps", "warmup_ramp_steps")
    has_running_stats = True
    foldable = True
    short_names = ("pn",)
    config_options = {
        "alpha_fwd": "powernorm_alpha_fwd",
        "alpha_bkw": "powernorm_alpha_bkw",
        "warmup_steps": "powernorm_warmup_steps",
        "warmup_statistic": "powernorm_warmup_statistic",
        "warmup_ramp_steps": "powernorm_warmup_ramp_steps",
        "group_num": "powernorm_group_num",
        "backward_denominator": "powernorm_backward_denominator",
        "sync_stats": "powernorm_sync_stats",
    }

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
        warmup_statistic: str = "reference",
        warmup_ramp_steps: int = 0,
        group_eps: float = GROUP_SCALE_EPS,
    ) -> None:
        super().__init__(hidden_size, eps)
        if not isinstance(group_eps, (int, float)) or isinstance(group_eps, bool) or not group_eps > 0:
            raise ValueError(f"group_eps must be a positive number, got {group_eps!r}")
        _check_fraction("alpha_fwd", alpha_fwd)
        _check_fraction("alpha_bkw", alpha_bkw)
        _check_count("warmup_steps", warmup_steps)
        _check_count("warmup_ramp_steps", warmup_ramp_steps)
        _check_group_num(group_num, hidden_size)
        if backward_denominator not in BACKWARD_DENOMINATORS:
            raise ValueError(
                f"backward_denominator must be one of {BACKWARD_DENOMINATORS}, got {backward_denominator!r}"
            )
        if warmup_statistic not in WARMUP_STATISTICS:
            raise ValueError(f"warmup_statistic must be one of {WARMUP_STATISTICS}, got {warmup_statistic!r}")
        self.alpha_fwd = float(alpha_fwd)
        self.alpha_bkw = float(alpha_bkw)
        self.warmup_steps = warmup_steps
        self.warmup_statistic = warmup_statistic
        self.warmup_ramp_steps = warmup_ramp_steps
        self.group_num = group_num
        self.group_eps = float(group_eps)
        self.backward_denominator = backward_denominator
        self.sync_stats = bool(sync_stats)
        self.process_group = process_group

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_power_norm(self, hidden_states, attention_mask)

    def affine_after_group_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The eval-mode map `y = GS(x) * scale + shift` as float32 `(scale, shift)`."""
        scale = self.weight.float() * torch.rsqrt(self.running_phi + self.eps)
        return scale, self.bias.float()

    # -- statistics, called from `norm_dispatch`'s paths --

    def divides_by_running_statistic(self) -> bool:
        """Whether this step's forward denominator is the running one whatever the batch (`t > W + K`,
        not a recomputation, which reuses its step's denominator); for the C kernels' one-pass forward,
        on the CPU, where reading the step counter costs nothing."""
        if in_recomputation() or not host_readable(self.num_batches_tracked):
            return False
        return self.running_weight(int(self.num_batches_tracked) + 1) == 1.0

    def take_step(self, next_phi: torch.Tensor, usable: torch.Tensor) -> None:
        """Write the step's `running_phi` and count it (both unchanged for an unusable batch)."""
        with torch.no_grad():
            self.running_phi.copy_(next_phi)
            self._count_batch_(usable)

    def running_weight(self, step: int) -> float:
        """Weight `r` of the running statistic in the denominator at step t: 0 while `t <= W`,
        `(t - W) / (K + 1)` over the K ramp steps, 1 after (what `pn_denominators` computes on the
        device)."""
        return min(max(step - self.warmup_steps, 0) / (self.warmup_ramp_steps + 1), 1.0)

    def update_nu(self, gamma: torch.Tensor, lambda_sum: torch.Tensor, count: torch.Tensor,
                  usable: torch.Tensor) -> None:
        """`nu <- nu * (1 - (1 - a) * Gamma) + (1 - a) * Lambda` (eq. 13), Lambda summed over ranks;
        only where the forward step took a statistic and Lambda is finite (decided on the device)."""
        if sync_enabled(self.sync_stats, self.process_group):
            all_reduce_(lambda_sum, self.process_group)
        lam = lambda_sum / count.clamp_min(1.0)
        has_tokens, finite = count > 0, all_finite(lam)
        warn_non_finite(type(self).__name__, "gradient statistic", usable & has_tokens & ~finite)
        usable = usable & has_tokens & finite
        rate = 1.0 - self.alpha_bkw
        with torch.no_grad():
            updated = self.running_nu * (1.0 - rate * gamma.float()) + rate * lam.float()
            self.running_nu.copy_(torch.where(usable, updated, self.running_nu))

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}, "
            f"warmup_steps={self.warmup_steps}, warmup_statistic={self.warmup_statistic!r}, "
            f"warmup_ramp_steps={self.warmup_ramp_steps}, group_num={self.group_num}, "
            f"backward_denominator={self.backward_denominator!r}, sync_stats={self.sync_stats}"
        )


class PowerNormV(_RunningStatsNorm):
    """PN-V (the paper's Table 1): divide by the batch quadratic mean with its exact gradient.

    Training: `y = weight * z0 / sqrt(v + eps) + bias` with `v = mean_V(z0^2)`, `z0 = GS(x)`
    (no group scaling by default); `running_phi` is an EMA of `v` (`alpha_fwd`) used in eval.
    """

    mixes_positions = True
    has_running_stats = True
    foldable = True
    short_names = ("pnv",)
    config_options = {"alpha_fwd": "powernorm_alpha_fwd"}

    _running_buffers = {"running_phi": 1.0}

    def __init__(self, hidden_size: int, eps: float = 1e-5, alpha_fwd: float = 0.9, group_num: int | None = None):
        super().__init__(hidden_size, eps)
        _check_fraction("alpha_fwd", alpha_fwd)
        _check_group_num(group_num, hidden_size)
        self.alpha_fwd = float(alpha_fwd)
        self.group_num = group_num

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_power_norm_v(self, hidden_states, attention_mask)

    def update_running(self, v: torch.Tensor, usable: torch.Tensor) -> None:
        """EMA update of `running_phi` where the batch gives a usable statistic (on the device)."""
        if not in_recomputation():
            with torch.no_grad():
                lerp_(self.running_phi, v.detach().float(), 1.0 - self.alpha_fwd, keep=usable)
                self._count_batch_(usable)

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

    mixes_positions = True
    has_running_stats = True
    foldable = True
    short_names = ("bn",)

    _running_buffers = {"running_mean": 0.0, "running_var": 1.0}
    renorm = False  # Batch Renormalization's corrections r and d (`BatchRenorm`)

    def __init__(self, hidden_size: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__(hidden_size, eps)
        _check_fraction("momentum", momentum)
        self.momentum = float(momentum)
        self.group_num = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_batch_norm(self, hidden_states, attention_mask)

    def affine_in_torch_ops(self, xf: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
        """The forward in torch ops, in the statistics' dtype (training: the batch moments where usable)."""
        dtype = xf.dtype
        mean, var = self.running_mean.to(dtype), self.running_var.to(dtype)
        if self.training:
            count, batch_mean, batch_var = batch_moments(xf, token_weights)
            usable = self.usable_batch(count, batch_mean, batch_var)
            mean, var = torch.where(usable, batch_mean, mean), torch.where(usable, batch_var, var)
            self.update_running(batch_mean, batch_var, count, usable)
        scale = self.weight.to(dtype) * torch.rsqrt(var + self.eps)
        return torch.addcmul(self.bias.to(dtype), xf - mean, scale)

    def differentiable_backward(self, x, mask, weight, mean, inv_std, r, d, usable, grad_output):
        """`_BatchNormFunction`'s gradient through torch ops, the statistics recomputed from `x`."""
        with torch.enable_grad():
            token_weights = mask_weights(mask, x.dtype)
            _, batch_mean, batch_var = batch_moments(x, token_weights)
            mean = torch.where(usable, batch_mean, mean)
            inv_std = torch.where(usable, torch.rsqrt(batch_var + self.eps), inv_std)
            y = torch.addcmul(self.bias + weight * d, x - mean, weight * r * inv_std)
            return torch.autograd.grad(y, (x, weight, self.bias), grad_output, create_graph=True)

    def update_running(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor, usable: torch.Tensor) -> None:
        """EMA of the mean and of the unbiased variance where the batch is usable (on the device)."""
        if not in_recomputation():
            n = count.detach().float()
            unbiased = var.detach().float() * (n / (n - 1.0).clamp_min(1.0))
            with torch.no_grad():
                lerp_(self.running_mean, mean.detach().float(), self.momentum, keep=usable)
                lerp_(self.running_var, unbiased, self.momentum, keep=usable)
                self._count_batch_(usable)

    def affine_after_group_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.weight.float() * torch.rsqrt(self.running_var + self.eps)
        return scale, self.bias.float() - self.running_mean * scale

    def eval_statistics(self) -> tuple[torch.Tensor | None, torch.Tensor, int | None, float]:
        return self._buffers["running_mean"], self._buffers["running_var"], None, GROUP_SCALE_EPS

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, momentum={self.momentum}"


class BatchRenorm(MaskedBatchNorm):
    """Batch Renormalization (Ioffe, 2017, Algorithm 1) over real tokens: a paper baseline (App. B.3).

    Training: with the batch statistics `mu_B`, `sigma_B = sqrt(var_B + eps)` (biased variance) and
    the running ones `mu`, `sigma = sqrt(running_var + eps)` as they were before the step,
    `r = clip(sigma_B / sigma, 1/rmax, rmax)` and `d = clip((mu_B - mu) / sigma, -dmax, dmax)`, both
    constants in the backward; `y = weight * ((x - mu_B) / sigma_B * r + d) + bias`, the gradient
    flowing through `mu_B` and `sigma_B` as in batch norm. `r = 1, d = 0` (`rmax=1, dmax=0`) is batch
    norm. Eval and the running estimates are those of `MaskedBatchNorm` (EMA with `momentum` of the
    mean and of the unbiased variance; Ioffe averages `sigma` instead of the variance, which changes
    the estimate by second-order terms only). The paper relaxes `rmax` from 1 to 3 and `dmax` from 0
    to 5 over training; the attributes can be changed between steps to do the same.
    """

    mixes_positions = True
    has_running_stats = True
    foldable = True
    short_names = ("brn", "batch_renormalization")

    renorm = True

    def __init__(self, hidden_size: int, eps: float = 1e-5, momentum: float = 0.1, rmax: float = 3.0,
                 dmax: float = 5.0):
        super().__init__(hidden_size, eps, momentum)
        _check_at_least("rmax", rmax, 1.0)
        _check_at_least("dmax", dmax, 0.0)
        self.rmax = float(rmax)
        self.dmax = float(dmax)

    def affine_in_torch_ops(self, xf: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
        """The forward in torch ops: masked BN's with the corrections `r`, `d` in training."""
        dtype = xf.dtype
        weight, bias = self.weight.to(dtype), self.bias.to(dtype)
        mean, scale = self.running_mean.to(dtype), weight * torch.rsqrt(self.running_var.to(dtype) + self.eps)
        if self.training:
            count, batch_mean, batch_var = batch_moments(xf, token_weights)
            r, d = self._correction(batch_mean, batch_var)
            usable = self.usable_batch(count, batch_mean, batch_var)
            mean = torch.where(usable, batch_mean, mean)
            scale = torch.where(usable, weight * r * torch.rsqrt(batch_var + self.eps), scale)
            bias = torch.where(usable, bias + weight * d, bias)
            self.update_running(batch_mean, batch_var, count, usable)
        return torch.addcmul(bias, xf - mean, scale)

    def _correction(self, batch_mean: torch.Tensor, batch_var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(r, d)` from the running statistics before this step; a recomputation reuses the step's pair."""
        last = self.last_step
        if in_recomputation() and last is not None and last.path == "torch":
            return last.stats
        with torch.no_grad():
            dtype = batch_mean.dtype
            inv_sigma = torch.rsqrt(self.running_var.to(dtype) + self.eps)
            r = (torch.sqrt(batch_var + self.eps) * inv_sigma).clamp(1.0 / self.rmax, self.rmax)
            d = ((batch_mean - self.running_mean.to(dtype)) * inv_sigma).clamp(-self.dmax, self.dmax)
        self.record_step(StepRecord("torch", (r, d)))
        return r, d

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, momentum={self.momentum}, rmax={self.rmax}, dmax={self.dmax}"


class MovingAverageBatchNorm(_RunningStatsNorm):
    """Moving Average Batch Normalization (Yan et al., ICLR 2020) over real tokens: App. B.3 baseline.

    MABN replaces the batch statistics of both passes by moving averages. As in the authors' layer
    it normalizes by the quadratic mean (no mean subtraction) and renormalizes towards the running
    statistic. Training step t (t = num_batches_tracked + 1), `m = window`, `W = warmup_steps`:
    - forward statistic: `chi2_B = mean_V(x^2)` is stored in `window_phi[t % m]`;
      `chi2 = chi2_B` while `t <= m` or `t < W`, else the simple moving average of the last m
      batches `chi2 = mean(window_phi)`;
    - renormalization: `r = clip(sqrt(chi2 + eps) / sqrt(running_phi + eps), 1/rmax, rmax)`
      (running statistic before the step), `r = 1` while `t <= max(renorm_warmup_steps, W)`;
    - `z = x / sqrt(chi2 + eps)`, `y = weight * r * z + bias`;
      `running_phi <- (1 - momentum) * running_phi + momentum * chi2` (used in eval);
    - backward: `g = weight * r * dY`, `Psi_B = mean_V(g * z)` stored in `window_gz[t % m]`;
      `Psi = Psi_B` while `t <= m` or `t < W`, else `mean(window_gz)`;
      `dx = (g - z * Psi) / sqrt(chi2 + eps)` on real tokens and `g / sqrt(chi2 + eps)` on padding
      (no gradient through `chi2` otherwise), `dweight = sum(dY * r * z)`, `dbias = sum(dY)`.
    During the batch phase (and `r = 1`) this is the exact gradient of `weight * x / sqrt(chi2_B +
    eps) + bias` on the real tokens. Eval: `y = weight * x / sqrt(running_phi + eps) + bias`.

    Simplified against the paper: the preceding linear layers are not weight-centralized (the paper
    centralizes them so that the quadratic mean stands for the variance), and the moving averages
    are unweighted means over batches, as in the authors' code, whatever their token counts.
    `momentum=0.02` is the authors' `momentum=0.98` written as an update rate.
    """

    mixes_positions = True  # the current batch is always one of the averaged batches
    has_running_stats = True
    foldable = True

    _running_buffers = {"running_phi": 1.0}
    _window_buffers = ("window_phi", "window_gz")

    def __init__(self, hidden_size: int, eps: float = 1e-5, momentum: float = 0.02, window: int = 16,
                 warmup_steps: int = 100, rmax: float = 5.0, renorm_warmup_steps: int = 1000):
        super().__init__(hidden_size, eps)
        _check_fraction("momentum", momentum)
        _check_count("window", window, minimum=1)
        _check_count("warmup_steps", warmup_steps)
        _check_at_least("rmax", rmax, 1.0)
        _check_count("renorm_warmup_steps", renorm_warmup_steps)
        self.momentum, self.window, self.warmup_steps = float(momentum), window, warmup_steps
        self.rmax, self.renorm_warmup_steps = float(rmax), renorm_warmup_steps
        self.group_num = None
        for name in self._window_buffers:
            self.register_buffer(name, torch.zeros(window, hidden_size, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_moving_average_batch_norm(self, hidden_states, attention_mask)

    def _batch_phase(self, step: torch.Tensor) -> torch.Tensor:
        return (step <= self.window) | (step < self.warmup_steps)

    def forward_statistics(self, xf: torch.Tensor, token_weights: torch.Tensor | None):
        """`(1/sqrt(chi2 + eps), r, t, usable)` of this step, updating the buffers, all decided on the
        device. An unusable batch (no real token, non-finite values) divides by the running statistic
        with `r = 1`, stores nothing and takes no backward statistic: the eval map, with its gradient.
        (The torch ops' path; the C kernels' step does the same in `kernels_cpu.mabn_step_forward`.)"""
        last = self.last_step
        if in_recomputation() and last is not None and last.path == "torch":
            return last.stats  # same step: reuse its statistics, update nothing
        with torch.no_grad():  # no gradient flows through chi2 (see the backward)
            count = token_count(xf, token_weights)
            chi2_batch = token_sum(xf.square(), token_weights) / count.clamp_min(1.0)
            usable = self.usable_batch(count, chi2_batch)
            step = self.next_step()
            write_row_(self.window_phi, step % self.window, chi2_batch, keep=usable)
            chi2 = torch.where(self._batch_phase(step), chi2_batch, self.window_phi.mean(0).to(xf.dtype))
            running = self.running_phi.to(xf.dtype)
            r = torch.sqrt((chi2 + self.eps) / (running + self.eps)).clamp(1.0 / self.rmax, self.rmax)
            r = torch.where(usable & (step > max(self.renorm_warmup_steps, self.warmup_steps)), r, torch.ones_like(r))
            inv_chi = torch.where(usable, torch.rsqrt(chi2 + self.eps), torch.rsqrt(running + self.eps))
            lerp_(self.running_phi, chi2.float(), self.momentum, keep=usable)
            self._count_batch_(usable)
        self.record_step(StepRecord("torch", (inv_chi, r, step, usable)))
        return inv_chi, r, step, usable

    def backward_statistic(self, psi_batch: torch.Tensor, step: torch.Tensor, usable: torch.Tensor) -> torch.Tensor:
        """Store `Psi_B` of step t and return the `Psi` its backward uses: 0 after an unusable forward
        (nothing stored), `Psi_B` itself when it is not finite (nothing stored, a warning)."""
        finite = all_finite(psi_batch)
        warn_non_finite(type(self).__name__, "gradient statistic", usable & ~finite)
        with torch.no_grad():
            write_row_(self.window_gz, step % self.window, psi_batch, keep=usable & finite)
        psi = torch.where(self._batch_phase(step), psi_batch, self.window_gz.mean(0).to(psi_batch.dtype))
        psi = torch.where(finite, psi, psi_batch)
        return torch.where(usable, psi, torch.zeros_like(psi))

    def affine_after_group_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The eval-mode map `y = x * scale + shift` as float32 `(scale, shift)`."""
        return self.weight.float() * torch.rsqrt(self.running_phi + self.eps), self.bias.float()

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, momentum={self.momentum}, window={self.window}, "
            f"warmup_steps={self.warmup_steps}, rmax={self.rmax}, renorm_warmup_steps={self.renorm_warmup_steps}"
        )


# ----------------------------------------------------------------------------------------------
# Per-token norms


class LayerNorm(_Norm):
    """Layer normalization over channels, per token, computed in float32."""

    mixes_positions = False
    has_running_stats = False
    foldable = False
    short_names = ("ln",)

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps)
        self._add_affine_parameters()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_layer_norm(self, hidden_states, attention_mask)


class RMSNorm(_Norm):
    """Root-mean-square normalization over channels, per token (no mean); a per-channel bias with
    `bias=True` (a LayerNorm converted on a centred residual stream keeps its bias: `converter.py`)."""

    mixes_positions = False
    has_running_stats = False
    foldable = False

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = False):
        super().__init__(hidden_size, eps)
        self._add_affine_parameters(bias=bias)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_rms_norm(self, hidden_states, attention_mask)


class GroupNorm(_Norm):
    """Group normalization over `group_num` channel groups of each token (mean and variance)."""

    mixes_positions = False
    has_running_stats = False
    foldable = False
    short_names = ("gn",)
    config_options = {"group_num": "powernorm_group_num"}

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_num: int = 1):
        super().__init__(hidden_size, eps)
        _check_group_num(group_num, hidden_size, allow_none=False)
        self.group_num = group_num
        self._add_affine_parameters()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_group_norm(self, hidden_states, attention_mask)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, group_num={self.group_num}"


class Identity(_Norm):
    """No normalization: the baseline of the sentiment study. Accepts and ignores `eps`."""

    mixes_positions = False
    has_running_stats = False
    foldable = False

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_identity(self, hidden_states, attention_mask)


# ----------------------------------------------------------------------------------------------
# Element-wise replacements: no statistics at all


def _check_finite_number(name: str, value: float, positive: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or (
            positive and not value > 0):
        raise ValueError(f"{name} must be a finite {'positive ' * positive}number, got {value!r}")


class _ElementwiseNorm(_Norm):
    """`weight * f(alpha * x + shift) + bias` per element, with learnable scalars `alpha` (and `shift`):
    no statistic, nothing mixed across channels or positions. Arithmetic in float32 (float64 for
    float64 inputs) whatever the input or parameter dtype, autocast included; output in the input's dtype."""

    mixes_positions = False
    has_running_stats = False
    foldable = False
    site_options = {"alpha_init": "norm_alpha_init"}
    learnable_embed_scale = True
    # `convert_norms(..., preserve_function=True)` cannot apply: no weight makes a squashing function
    # compute what the LayerNorm / RMSNorm it replaces computed.
    preserves_function = False

    squash = ""  # the squashing function: "tanh" or "erf"

    def __init__(self, hidden_size: int, eps: float = 1e-5, alpha_init: float = 0.5) -> None:
        super().__init__(hidden_size, eps)  # `eps` is accepted for the shared interface and unused
        _check_finite_number("alpha_init", alpha_init, positive=True)
        self.alpha_init = float(alpha_init)
        self.alpha = nn.Parameter(torch.full((1,), self.alpha_init))
        self._add_affine_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.alpha_init)
        super().reset_parameters()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_elementwise(self, hidden_states, attention_mask)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, alpha_init={self.alpha_init}"


class DyT(_ElementwiseNorm):
    """Dynamic Tanh (Zhu, Chen, He, LeCun, Liu, "Transformers without Normalization", CVPR 2025):
    `y = weight * tanh(alpha * x) + bias`, `alpha` a learnable scalar (shape `(1,)`), `weight` and
    `bias` per channel.

    As the authors' `DynamicTanh` (`jiachenzhu/DyT`, `dynamic_tanh.py`; the same class in
    `zlab-princeton/Derf`, `ViT/dynamic_tanh.py`), with `alpha_init=0.5` their default there and in
    their LayerNorm converter. Initial `alpha` per site in the authors' language models: LLaMA 2
    (`jiachenzhu/DyT`, `other_tasks/LLaMA/`: its README's table, read by `fms_fsdp/models/llama.py`
    as `attn_alpha_init_value`, `ffn_alpha_init_value`, `dec_alpha_init_value`) takes 0.8 before
    attention and 0.2 before the FFN and for the final norm at 7B (width 4096), 0.6 / 0.15 at 13B,
    0.2 / 0.05 at 34B and 70B: larger before attention, smaller the wider the model. GPT-2 small
    (width 768, `zlab-princeton/Derf`, `language model/model_derf.patch` and `train_derf.patch`)
    defaults to 1.0 at every site (`attn_alpha_init_value`, `ffn_alpha_init_value`,
    `dec_alpha_init_value`; its README leaves the values to the command line): the model family's
    defaults (`norm_alpha_init_attention`, `_ffn`, `_final`), since our models (width 32-1024) are
    of GPT-2's size, not LLaMA's.

    Where ours differs: `eps` is accepted (the registry's one interface) and unused, and
    `alpha_init` must be positive; the padding mask is accepted and unused (nothing is shared
    between tokens); the arithmetic is float32 under autocast and for half-precision inputs and
    parameters, where the authors' code computes in the input's dtype, so that a bf16 model's
    `alpha * x` does not lose the precision LayerNorm's float32 statistics keep; `bias` always
    exists (the authors' GPT-2 patch also keeps it when the model has no other bias); the backward
    is written out (`_ElementwiseNormFunction`), the same gradient in fewer passes than autograd's.
    """

    short_names = ("dynamic_tanh",)

    squash = "tanh"


class Derf(_ElementwiseNorm):
    """Dynamic erf (`zlab-princeton/Derf`): `y = weight * erf(alpha * x + shift) + bias`, `alpha` and
    `shift` learnable scalars (shape `(1,)`), `weight` and `bias` per channel.

    As the authors' `Dynamic_erf` (`ViT/dynamic_erf.py`, and the GPT-2 one in `language
    model/model_derf.patch`), with their defaults `alpha_init=0.5`, `shift_init=0.0`. Initial `alpha`
    per site: the GPT-2 patches default to 1.0 before attention, before the FFN and for the final norm
    (`attn_alpha_init_value`, `ffn_alpha_init_value`, `dec_alpha_init_value`), with a learnable
    scale on the embeddings initialised at sqrt(width): the model family's defaults for DyT and
    Derf alike (`norm_alpha_init_attention`, `_ffn`, `_final`, `embed_scale_learnable`). `shift`
    starts at 0 at every site there.

    Where ours differs: `eps` and the padding mask are accepted (the registry's one interface) and
    unused; the arithmetic is float32 under autocast and for half-precision inputs and parameters
    (the authors' code computes in the input's dtype), and the backward is written out, as for `DyT`.
    """

    short_names = ("dynamic_erf",)

    squash = "erf"

    def __init__(self, hidden_size: int, eps: float = 1e-5, alpha_init: float = 0.5, shift_init: float = 0.0) -> None:
        super().__init__(hidden_size, eps, alpha_init)
        _check_finite_number("shift_init", shift_init)
        self.shift_init = float(shift_init)
        self.shift = nn.Parameter(torch.full((1,), self.shift_init))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.constant_(self.shift, self.shift_init)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shift_init={self.shift_init}"


# ----------------------------------------------------------------------------------------------
# Registry

NORM_CLASSES: dict[str, type[nn.Module]] = {
    "powernorm": PowerNorm,
    "powernorm_v": PowerNormV,
    "batchnorm": MaskedBatchNorm,
    "batchrenorm": BatchRenorm,
    "mabn": MovingAverageBatchNorm,
    "layernorm": LayerNorm,
    "rmsnorm": RMSNorm,
    "groupnorm": GroupNorm,
    "none": Identity,
    "dyt": DyT,
    "derf": Derf,
}

def running_buffers() -> dict[str, float]:
    """Each buffer a norm of the registry keeps for eval (what a checkpoint must carry) -> its initial
    value, read off the classes (`buffer_defaults`) as the registry holds them now."""
    return {name: value for cls in NORM_CLASSES.values() for name, value in cls.buffer_defaults().items()}


def float32_buffers() -> tuple[str, ...]:
    """The buffers of the registry's norms that stay float32 (`float32_buffers` of each class)."""
    return tuple(dict.fromkeys(name for cls in NORM_CLASSES.values() for name in cls.float32_buffers()))


def _squashed(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def norm_spellings() -> dict[str, str]:
    """Every spelling `normalize_norm_name` accepts, lower-case without `_`, `-` or spaces, -> its
    `NORM_CLASSES` key: the key, the class name and the class's own `short_names`."""
    spellings = {_squashed(key): key for key in NORM_CLASSES}
    for key, cls in NORM_CLASSES.items():
        for name in (cls.__name__, *vars(cls).get("short_names", ())):
            spellings.setdefault(_squashed(name), key)
    return spellings


def normalize_norm_name(name: str) -> str:
    """Map any spelling (`"PowerNorm"`, `"power_norm"`, `"PN-V"`) to its `NORM_CLASSES` key."""
    if not isinstance(name, str):
        raise ValueError(f"norm name must be a string, got {name!r}; valid names: {sorted(NORM_CLASSES)}")
    key = norm_spellings().get(_squashed(name))
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
    "KERNEL_BACKENDS",
    "NORM_CLASSES",
    "WARMUP_STATISTICS",
    "BatchRenorm",
    "Derf",
    "DyT",
    "GroupNorm",
    "Identity",
    "LayerNorm",
    "MaskedBatchNorm",
    "MovingAverageBatchNorm",
    "PowerNorm",
    "PowerNormV",
    "RMSNorm",
    "available_kernel_backends",
    "build_norm",
    "current_kernel_backend",
    "float32_buffers",
    "group_scale",
    "kernel_backend",
    "norm_spellings",
    "normalize_norm_name",
    "running_buffers",
]
