"""The norms' arithmetic as pure tensor functions, which every backend calls.

Functions of tensors and plain options, no module and no global state: buffers come in as
arguments and the updated values go back as results (a few helpers ending in `_` write into the
buffer they are given, under a device flag). `norm_dispatch.py` calls them for the torch-ops paths,
compiles PN's two step functions with `torch.compile` (`pn_train_forward`, `pn_train_backward`),
and checks the C and Triton kernels against the same arithmetic; `normalization.py` calls them for
its statistics. Equations: Shen et al. (ICML 2020), Algorithm 2 and eqs. (11)-(13) for PN; Ioffe
(2017) for Batch Renormalization. `docs/norm_internals.md` says how the pieces fit.
"""

from __future__ import annotations

import math

import torch

GROUP_SCALE_EPS = 1e-5  # group scaling's epsilon, the reference code's (PN's `group_eps` default)


# ----------------------------------------------------------------------------------------------
# Helpers: dtypes, masked sums over real tokens, guarded buffer updates

def stat_dtype(tensor: torch.Tensor) -> torch.dtype:
    """Statistics are float32, or float64 for float64 inputs (so `gradcheck` can run)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32



def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)` without the call where it would return `tensor` (it costs a small norm's work)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)



def mask_weights(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A kernel mask (`_kernel_mask`) as the 0/1 token weights of the torch ops, in `dtype`."""
    return None if mask is None else (mask != 0).to(dtype)



def token_sum(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Sum `(tokens, C)` over real tokens with the 0/1 weights, no gather: eagerly a matrix-vector
    product; in a compiled graph a weighted sum, which the compiler fuses with what computes `values`."""
    if weights is None:
        return values.sum(0)
    if torch.compiler.is_compiling():
        return (values * weights[:, None]).sum(0)
    return weights @ values



def token_count(flat: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:  # a fill on the device, not a copy from the host
        return torch.full((), flat.shape[0], device=flat.device, dtype=stat_dtype(flat))
    return weights.sum()



def all_finite(*statistics: torch.Tensor) -> torch.Tensor:
    """One boolean 0-dim tensor on the device: every value of every statistic is finite."""
    finite = torch.isfinite(statistics[0]).all()
    for statistic in statistics[1:]:
        finite = finite & torch.isfinite(statistic).all()
    return finite



def lerp_(buffer: torch.Tensor, end: torch.Tensor, weight: float | torch.Tensor,
          keep: torch.Tensor | None = None) -> torch.Tensor:
    """`buffer += weight * (end - buffer)` in place, where the device flag `keep` holds (always
    without one), computed in `end`'s dtype also when someone else has cast the buffer (FSDP v1's
    `MixedPrecision(buffer_dtype=torch.bfloat16)`). `weight` may be a 0-dim tensor on the device."""
    start = buffer if buffer.dtype == end.dtype else buffer.to(end.dtype)
    if isinstance(weight, torch.Tensor):
        weight = weight.to(end.dtype)
    updated = torch.lerp(start, end, weight)
    if keep is not None:
        updated = torch.where(keep, updated, start)
    return buffer.copy_(updated)



def select_row(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[index]` for a 0-dim index tensor, without reading the index on the host."""
    return table.index_select(0, index.view(1))[0]



def write_row_(table: torch.Tensor, index: torch.Tensor, row: torch.Tensor, keep: torch.Tensor) -> None:
    """`table[index] = row` where `keep` holds, on the device (row left as it was otherwise); `index`
    of any integer dtype (a step counter assigned as int32: `index_copy_` takes int64 indices only)."""
    current = select_row(table, index)
    table.index_copy_(0, index.view(1).long(), torch.where(keep, row.to(table.dtype), current).unsqueeze(0))



# ----------------------------------------------------------------------------------------------
# PowerNorm (Algorithm 2, eqs. 11-13)

def channel_groups(values: torch.Tensor, group_num: int | None) -> torch.Tensor:
    """`(tokens, C)` as `(tokens, G, C/G)`; one group without group scaling."""
    return values.unflatten(-1, (group_num or 1, -1))



def pn_group_scaled(xf: torch.Tensor, group_num: int | None,
                    group_eps: float = GROUP_SCALE_EPS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`z0 = GS(x)` of float `(tokens, C)` and the per-token group scales `r` (tokens, G, 1)."""
    if group_num is None:
        return xf, None
    grouped = channel_groups(xf, group_num)
    r = torch.rsqrt(grouped.square().mean(-1, keepdim=True) + group_eps)
    return (grouped * r).flatten(-2), r



def pn_sums(x: torch.Tensor, token_weights: torch.Tensor | None, group_num: int | None,
            group_eps: float = GROUP_SCALE_EPS):
    """`z0 = GS(x)`, `sum_V z0^2` per channel and the real-token count (pure tensor code)."""
    z0, _ = pn_group_scaled(x.to(stat_dtype(x)), group_num, group_eps)
    return z0, token_sum(z0.square(), token_weights), token_count(z0, token_weights)



def pn_denominators(sum_sq: torch.Tensor, count: torch.Tensor, phi: torch.Tensor, step: torch.Tensor,
                    options: tuple) -> tuple[torch.Tensor, ...]:
    """The step's statistics from the (reduced) sums, decided on the device (pure tensor code).

    Returns `v`, `1/s`, `1/s_backward`, `usable`, `non_finite` (a batch with real tokens and
    non-finite statistics: worth a warning) and the next `running_phi`; an unusable batch (no real
    token, non-finite `v`) divides by the running statistic and leaves `running_phi` as it was.
    `options`: `(eps, warmup_steps, warmup_ramp_steps, alpha_fwd, warmup_statistic, backward_denominator)`.
    """
    eps, warmup, ramp, _, _, backward = options
    v = sum_sq / count.clamp_min(1.0)
    has_tokens, finite = count > 0, all_finite(v)
    usable = has_tokens & finite
    phi_v = phi.to(v.dtype)
    running, batch = torch.rsqrt(phi_v + eps), torch.rsqrt(v + eps)
    # s^2 = (1 - r) * (v + eps) + r * (phi + eps), r = clamp((t - W) / (K + 1), 0, 1): exactly the
    # batch (r = 0) or the running (r = 1) denominator at the ends.
    weight = ((step - warmup) / (ramp + 1)).clamp(0.0, 1.0).to(v.dtype)
    blended = torch.rsqrt((1.0 - weight) * v + weight * phi_v + eps)
    inv_s = torch.where(weight == 0.0, batch, torch.where(weight == 1.0, running, blended))
    inv_s_b = inv_s if backward == "running" else batch
    inv_s, inv_s_b = torch.where(usable, inv_s, running), torch.where(usable, inv_s_b, running)
    return v, inv_s, inv_s_b, usable, has_tokens & ~finite, pn_next_phi(phi, v.float(), step, usable, options)



def pn_next_phi(phi: torch.Tensor, v: torch.Tensor, step: torch.Tensor, usable: torch.Tensor,
                options: tuple) -> torch.Tensor:
    """`running_phi` after step t, per `warmup_statistic` (see `PowerNorm`), float32."""
    _, warmup, _, alpha_fwd, statistic, _ = options
    ema_rate, cumulative_rate = 1.0 - alpha_fwd, 1.0 / step.to(v.dtype)
    phi = phi.to(v.dtype)
    if statistic == "cumulative":
        updated = torch.lerp(phi, v, torch.where(step <= warmup, cumulative_rate, ema_rate))
    else:  # phi * (t - 1) / t + v / t while t < W, then the EMA step
        updated = torch.lerp(torch.where(step < warmup, torch.lerp(phi, v, cumulative_rate), phi), v, ema_rate)
    return torch.where(usable, updated, phi)



def pn_output(z0: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(shift.to(z0.dtype), z0, scale.to(z0.dtype))



def pn_input_gradient(dy: torch.Tensor, x: torch.Tensor, token_weights: torch.Tensor | None, weight: torch.Tensor,
                      nu: torch.Tensor, inv_s: torch.Tensor, inv_s_b: torch.Tensor, group_num: int | None,
                      group_eps: float = GROUP_SCALE_EPS):
    """Input gradient and batch sums of PN's approximate backward (pure tensor code).

    With `Z = z0 / s`, `g = weight * dY`: `dz0 = dY * a - (real) * c * z0`, `a = weight / s_b`,
    `c = nu / (s * s_b)` (eqs. 11-12), then the exact group-scaling backward
    `dx = r * (dz0 - z0 * mean_group(dz0 * z0))`; `z0` and `r` are recomputed from `x`. Returns
    `dx`, `sum_all(dY * z0)`, `sum_V(dY * z0)` and `sum_all(dY)`.
    """
    dtype = stat_dtype(x)
    z0, r = pn_group_scaled(x.to(dtype), group_num, group_eps)
    dy = dy.to(dtype)
    dy_z0 = dy * z0
    sums = dy_z0.sum(0), token_sum(dy_z0, token_weights), dy.sum(0)
    a, c = weight.to(dtype) * inv_s_b, nu.to(dtype) * inv_s * inv_s_b
    correction = z0 * c if token_weights is None else z0 * c * token_weights[:, None]
    grad_z0 = dy * a - correction
    if r is None:
        return grad_z0, *sums
    dz, z = channel_groups(grad_z0, group_num), channel_groups(z0, group_num)
    grad_x = r * (dz - z * (dz * z).mean(-1, keepdim=True))
    return grad_x.flatten(-2), *sums



def pn_train_forward(x, token_weights, weight, bias, phi, step, group_num, options, group_eps=GROUP_SCALE_EPS):
    """A whole training forward as one pure function (what the dispatch compiles): `(y, 1/s,
    1/s_backward, v, count, usable, non_finite, next_phi)`; the caller writes the buffers."""
    z0, sum_sq, count = pn_sums(x, token_weights, group_num, group_eps)
    v, inv_s, inv_s_b, usable, non_finite, next_phi = pn_denominators(sum_sq, count, phi, step, options)
    return pn_output(z0, weight * inv_s, bias).to(x.dtype), inv_s, inv_s_b, v, count, usable, non_finite, next_phi



def pn_train_backward(dy, x, token_weights, weight, nu, inv_s, inv_s_b, v, count, usable, group_num, rate,
                      group_eps=GROUP_SCALE_EPS):
    """A whole backward as one pure function: `(dx, dweight, dbias, next_nu, non_finite)`, with
    `nu <- nu * (1 - rate * Gamma) + rate * Lambda` (eq. 13) where the step is usable and Lambda finite."""
    grad_x, sum_dy_z0, real_dy_z0, sum_dy = pn_input_gradient(dy, x, token_weights, weight, nu, inv_s, inv_s_b,
                                                               group_num, group_eps)
    lam = weight.to(inv_s.dtype) * inv_s * real_dy_z0 / count.clamp_min(1.0)
    has_tokens, finite = count > 0, all_finite(lam)
    updated = nu * (1.0 - rate * (v * inv_s.square()).float()) + rate * lam.float()
    next_nu = torch.where(usable & has_tokens & finite, updated, nu)
    grad_weight, grad_bias = (inv_s * sum_dy_z0).to(weight.dtype), sum_dy.to(weight.dtype)
    return grad_x.to(dy.dtype), grad_weight, grad_bias, next_nu, usable & has_tokens & ~finite



# ----------------------------------------------------------------------------------------------
# Masked batch normalization and Batch Renormalization

def bn_affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`y = x * a + b`, `a = weight r / sigma`, `b = bias + weight d - mean a`, in `out`'s dtype."""
    mean, inv_std, r, d = out.unbind(0)
    weight = weight.to(out.dtype)
    a = weight * r * inv_std
    return torch.addcmul(bias.to(out.dtype) + weight * d - mean * a, x.to(out.dtype), a)



def bn_train_forward(x, token_weights, weight, bias, running_mean, running_var, eps, renorm, rmax, dmax):
    """Masked BN's (BRN's) training forward as a pure function of float `(tokens, C)` `x`: `(y, out,
    count, usable, non_finite, batch_mean, batch_var)` (`bn_step_forward`'s arithmetic)."""
    count = token_count(x, token_weights)
    n = count.clamp_min(1.0)
    batch_mean = token_sum(x, token_weights) / n
    batch_var = token_sum((x - batch_mean).square(), token_weights) / n
    has_tokens, finite = count > 0, all_finite(batch_mean, batch_var)
    usable = has_tokens & finite
    mean, var = running_mean.to(x.dtype), running_var.to(x.dtype)
    inv_run = torch.rsqrt(var + eps)
    one = torch.ones_like(batch_mean)
    if renorm:
        r = (torch.sqrt(batch_var + eps) * inv_run).clamp(1.0 / rmax, rmax)
        d = ((batch_mean - mean) * inv_run).clamp(-dmax, dmax)
    else:
        r, d = one, torch.zeros_like(batch_mean)
    inv_std = torch.where(usable, torch.rsqrt(batch_var + eps), inv_run)
    out = torch.stack([torch.where(usable, batch_mean, mean), inv_std, torch.where(usable, r, one),
                       torch.where(usable, d, 0.0)])
    return bn_affine(x, weight, bias, out), out, count, usable, has_tokens & ~finite, batch_mean, batch_var



def batch_moments(xf: torch.Tensor, token_weights: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Real-token count, mean and biased variance of the batch, per channel."""
    count = token_count(xf, token_weights)
    mean = token_sum(xf, token_weights) / count.clamp_min(1.0)
    return count, mean, token_sum((xf - mean).square(), token_weights) / count.clamp_min(1.0)


# ----------------------------------------------------------------------------------------------
# Eval maps and element-wise replacements

def eval_map_formula(x, group_num, weight, bias, mean, var, eps, group_eps):
    """`_eval_map` in torch ops (differentiable, for a gradient that must be differentiable in turn)."""
    if group_num is not None:
        grouped = x.unflatten(-1, (group_num, -1))
        x = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + group_eps)).flatten(-2)
    scale = weight if weight is not None else torch.ones_like(x[0])
    if var is not None:
        scale = scale * torch.rsqrt(var + eps)
    shift = bias if bias is not None else torch.zeros_like(scale)
    if mean is not None:
        shift = shift - mean * scale
    return torch.addcmul(shift, x, scale)



TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)  # erf'(z) = 2 / sqrt(pi) * exp(-z^2)



def elementwise_formula(x, alpha, shift, weight, bias, function: str) -> torch.Tensor:
    """`weight * f(alpha * x + shift) + bias` in plain torch ops (`shift` None: no shift)."""
    z = x * alpha if shift is None else torch.addcmul(shift, x, alpha)
    return torch.addcmul(bias, torch.tanh(z) if function == "tanh" else torch.erf(z), weight)

