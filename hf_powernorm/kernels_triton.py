"""Fused Triton kernels of PowerNorm's training step (Shen et al., 2020, Algorithm 2, eqs. 11-13), and of
DyT's and Derf's.

The CUDA implementation of the `hf_powernorm::pn_step_forward` and `pn_step_backward` operators
(`norm_dispatch.py`), with the arithmetic of its pure tensor functions `_pn_train_forward` and
`_pn_train_backward` (Algorithm 2, eqs. 11-13; `docs/norms.md`):
- forward, three launches: per program, over its tiles of tokens, group scaling `z0 = GS(x)` and
  the masked sums of `z0^2` (`_forward_sums`); in one program, the step's statistics `v`, `1/s`,
  `1/s_backward`, the warmup switch or ramp, and the in-place updates of `running_phi` and the step
  counter (`_forward_statistics`); the output `y = z0 * weight / s + bias` (`_forward_output`);
- backward, two launches: per program, `dx` through the approximate gradient and the
  group-scaling backward, with the sums `sum(dY z0)`, `sum_V(dY z0)`, `sum(dY)` (`_backward_sums`);
  in one program, the parameter gradients and the in-place update of `running_nu`
  (`_backward_statistics`).
DyT and Derf on CUDA (`norm_dispatch._ElementwiseNormFunction`), `y = weight * f(alpha x + shift) +
bias`: one launch forward (`_elementwise_forward`), two backward (`_elementwise_backward_sums`, `dx`
and the per-program sums, `f(z)` recomputed from `x`; `_elementwise_backward_statistics`, the
parameter gradients), `alpha` and `shift` read on the device.
Statistics are float32 whatever the input dtype (float32, bfloat16, float16); every guard (no real
token, non-finite statistics) and the warmup switch are decided on the device, so no launch waits
for the host. The per-program partial sums are added in a fixed order: the same input gives the
same bits. `TRITON_INTERPRET=1` runs the kernels on CPU tensors (how the tests check them).

Without Triton `AVAILABLE` is False and nothing here is defined but it.
"""

from __future__ import annotations


import torch

# Optional: inside a `try` block, so that Transformers' remote-code check does not require Triton of
# whoever loads a saved model's copy of these files.
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

AVAILABLE = triton is not None

# Elements of a tile (tokens x padded channels) a program holds at once, and the most programs
# that write partial sums (their reduction is one program's loop).
TILE_ELEMENTS = 4096
MAX_PROGRAMS = 512
# Compile options of every launch: multiply-adds fused into FMAs, as the kernels were measured and
# checked (Triton 3.9 does so by default and warns that 3.10 will not).
LAUNCH = {"enable_fp_fusion": True}

if AVAILABLE:
    @triton.jit
    def _load_tile(x_ptr, tile, T, C, k, G: tl.constexpr, BLOCK_T: tl.constexpr, GP: tl.constexpr,
                   KP: tl.constexpr):
        """Rows `tile * BLOCK_T ...` of `x` (T, C) as float32 (BLOCK_T, GP, KP): channel `g * k + j`;
        their offsets and the validity mask."""
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        groups = tl.arange(0, GP)
        cols = tl.arange(0, KP)
        channel = groups[None, :, None] * k + cols[None, None, :]
        valid = (rows[:, None, None] < T) & (groups[None, :, None] < G) & (cols[None, None, :] < k)
        offsets = rows[:, None, None].to(tl.int64) * C + channel
        x = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        return x, rows, offsets, valid

    @triton.jit
    def _token_weights(mask_ptr, rows, T, HAS_MASK: tl.constexpr):
        """0/1 float32 weight of each row (1 without a mask); 0 past the last token."""
        if HAS_MASK:
            real = tl.load(mask_ptr + rows, mask=rows < T, other=0) != 0
        else:
            real = rows < T
        return real.to(tl.float32)

    @triton.jit
    def _group_scales(x, k, group_eps, GROUPED: tl.constexpr):
        """Per token and group, `1 / sqrt(mean_group(x^2) + eps)` (BLOCK_T, GP, 1); 1 without group scaling."""
        if GROUPED:
            return tl.rsqrt(tl.sum(x * x, axis=2) / k + group_eps)[:, :, None]
        return tl.full((x.shape[0], x.shape[1], 1), 1.0, tl.float32)

    @triton.jit
    def _forward_sums(x_ptr, mask_ptr, sums_ptr, counts_ptr, T, C, k, group_eps, num_tiles, programs,
                      G: tl.constexpr, GROUPED: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr,
                      GP: tl.constexpr, KP: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros((GP, KP), tl.float32)
        count = tl.zeros((BLOCK_T,), tl.float32)
        for tile in range(pid, num_tiles, programs):
            x, rows, _, _ = _load_tile(x_ptr, tile, T, C, k, G, BLOCK_T, GP, KP)
            z0 = x * _group_scales(x, k, group_eps, GROUPED)
            real = _token_weights(mask_ptr, rows, T, HAS_MASK)
            acc += tl.sum(z0 * z0 * real[:, None, None], axis=0)
            count += real
        groups, cols = tl.arange(0, GP), tl.arange(0, KP)
        channel = groups[:, None] * k + cols[None, :]
        valid = (groups[:, None] < G) & (cols[None, :] < k)
        tl.store(sums_ptr + pid * C + channel, acc, mask=valid)
        tl.store(counts_ptr + pid, tl.sum(count, axis=0))

    @triton.jit
    def _reduce_rows(ptr, rows, row_stride, C, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
        """Sum over `rows` rows of a (rows, row_stride) float32 array, channels `< C`, in a fixed order."""
        channels = tl.arange(0, BLOCK_C)
        total = tl.zeros((BLOCK_C,), tl.float32)
        for start in range(0, rows, BLOCK_P):
            index = start + tl.arange(0, BLOCK_P)
            block = tl.load(ptr + index[:, None] * row_stride + channels[None, :],
                            mask=(index[:, None] < rows) & (channels[None, :] < C), other=0.0)
            total += tl.sum(block, axis=0)
        return total

    @triton.jit
    def _all_finite(values, valid):
        return tl.sum(((values - values != 0.0) & valid).to(tl.int32), axis=0) == 0

    @triton.jit
    def _forward_statistics(sums_ptr, counts_ptr, programs, phi_ptr, counter_ptr, weight_ptr, stats_ptr, info_ptr,
                            scale_ptr, C, eps, warmup, ramp, ema_rate, REFERENCE: tl.constexpr,
                            BATCH_BACKWARD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
        channels = tl.arange(0, BLOCK_C)
        valid = channels < C
        sum_sq = _reduce_rows(sums_ptr, programs, C, C, BLOCK_C, BLOCK_P)
        index = tl.arange(0, BLOCK_P)
        count = tl.zeros((BLOCK_P,), tl.float32)
        for start in range(0, programs, BLOCK_P):
            count += tl.load(counts_ptr + start + index, mask=start + index < programs, other=0.0)
        count = tl.sum(count, axis=0)
        v = sum_sq / tl.maximum(count, 1.0)
        has_tokens = count > 0.0
        finite = _all_finite(v, valid)
        usable = has_tokens & finite
        phi = tl.load(phi_ptr + channels, mask=valid, other=1.0)
        counter = tl.load(counter_ptr)
        step = (counter + 1).to(tl.float32)
        # s^2 = (1 - r) (v + eps) + r (phi + eps), r = clamp((t - W) / (K + 1), 0, 1)
        r = tl.minimum(tl.maximum((step - warmup) / (ramp + 1.0), 0.0), 1.0)
        running, batch = tl.rsqrt(phi + eps), tl.rsqrt(v + eps)
        blended = tl.rsqrt((1.0 - r) * v + r * phi + eps)
        inv_s = tl.where(r == 0.0, batch, tl.where(r == 1.0, running, blended))
        inv_s_b = batch if BATCH_BACKWARD else inv_s
        inv_s = tl.where(usable, inv_s, running)
        inv_s_b = tl.where(usable, inv_s_b, running)
        if REFERENCE:  # phi (t - 1) / t + v / t while t < W, then the EMA step
            start_phi = tl.where(step < warmup, phi + (v - phi) / step, phi)
            updated = start_phi + ema_rate * (v - start_phi)
        else:  # the cumulative mean while t <= W, then the EMA
            updated = phi + tl.where(step <= warmup, 1.0 / step, ema_rate) * (v - phi)
        tl.store(phi_ptr + channels, tl.where(usable, updated, phi), mask=valid)
        tl.store(counter_ptr, counter + usable.to(counter.dtype))
        tl.store(stats_ptr + channels, v, mask=valid)
        tl.store(stats_ptr + C + channels, inv_s, mask=valid)
        tl.store(stats_ptr + 2 * C + channels, inv_s_b, mask=valid)
        weight = tl.load(weight_ptr + channels, mask=valid, other=0.0).to(tl.float32)
        tl.store(scale_ptr + channels, weight * inv_s, mask=valid)
        tl.store(info_ptr, count)
        tl.store(info_ptr + 1, usable.to(tl.float32))
        tl.store(info_ptr + 2, (has_tokens & ~finite).to(tl.float32))

    @triton.jit
    def _forward_output(x_ptr, y_ptr, scale_ptr, bias_ptr, T, C, k, group_eps, G: tl.constexpr,
                        GROUPED: tl.constexpr, BLOCK_T: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr):
        x, _, offsets, valid = _load_tile(x_ptr, tl.program_id(0), T, C, k, G, BLOCK_T, GP, KP)
        z0 = x * _group_scales(x, k, group_eps, GROUPED)
        groups, cols = tl.arange(0, GP), tl.arange(0, KP)
        channel = groups[:, None] * k + cols[None, :]
        vector = (groups[:, None] < G) & (cols[None, :] < k)
        scale = tl.load(scale_ptr + channel, mask=vector, other=0.0)
        shift = tl.load(bias_ptr + channel, mask=vector, other=0.0).to(tl.float32)
        y = z0 * scale[None, :, :] + shift[None, :, :]
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def _backward_sums(dy_ptr, x_ptr, mask_ptr, weight_ptr, nu_ptr, stats_ptr, dx_ptr, sums_ptr, T, C, k, group_eps,
                       num_tiles, programs, G: tl.constexpr, GROUPED: tl.constexpr, HAS_MASK: tl.constexpr,
                       BLOCK_T: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr):
        pid = tl.program_id(0)
        groups, cols = tl.arange(0, GP), tl.arange(0, KP)
        channel = groups[:, None] * k + cols[None, :]
        vector = (groups[:, None] < G) & (cols[None, :] < k)
        weight = tl.load(weight_ptr + channel, mask=vector, other=0.0).to(tl.float32)
        nu = tl.load(nu_ptr + channel, mask=vector, other=0.0)
        inv_s = tl.load(stats_ptr + C + channel, mask=vector, other=0.0)
        inv_s_b = tl.load(stats_ptr + 2 * C + channel, mask=vector, other=0.0)
        # dz0 = dY a - (real) c z0 (eqs. 11-12): a = weight / s_b, c = nu / (s s_b)
        a, c = (weight * inv_s_b)[None, :, :], (nu * inv_s * inv_s_b)[None, :, :]
        sum_dy_z0 = tl.zeros((GP, KP), tl.float32)
        real_dy_z0 = tl.zeros((GP, KP), tl.float32)
        sum_dy = tl.zeros((GP, KP), tl.float32)
        for tile in range(pid, num_tiles, programs):
            x, rows, offsets, valid = _load_tile(x_ptr, tile, T, C, k, G, BLOCK_T, GP, KP)
            dy = tl.load(dy_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
            r = _group_scales(x, k, group_eps, GROUPED)
            z0 = x * r
            real = _token_weights(mask_ptr, rows, T, HAS_MASK)[:, None, None]
            dz0 = dy * a - real * c * z0
            if GROUPED:  # the exact group-scaling backward: r (dz0 - z0 mean_group(dz0 z0))
                dx = r * (dz0 - z0 * (tl.sum(dz0 * z0, axis=2) / k)[:, :, None])
            else:
                dx = dz0
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=valid)
            dy_z0 = dy * z0
            sum_dy_z0 += tl.sum(dy_z0, axis=0)
            real_dy_z0 += tl.sum(dy_z0 * real, axis=0)
            sum_dy += tl.sum(dy, axis=0)
        base = sums_ptr + pid * 3 * C + channel
        tl.store(base, sum_dy_z0, mask=vector)
        tl.store(base + C, real_dy_z0, mask=vector)
        tl.store(base + 2 * C, sum_dy, mask=vector)

    @triton.jit
    def _backward_statistics(sums_ptr, programs, weight_ptr, stats_ptr, info_ptr, nu_ptr, grads_ptr, C, rate,
                             BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
        channels = tl.arange(0, BLOCK_C)
        valid = channels < C
        sum_dy_z0 = _reduce_rows(sums_ptr, programs, 3 * C, C, BLOCK_C, BLOCK_P)
        real_dy_z0 = _reduce_rows(sums_ptr + C, programs, 3 * C, C, BLOCK_C, BLOCK_P)
        sum_dy = _reduce_rows(sums_ptr + 2 * C, programs, 3 * C, C, BLOCK_C, BLOCK_P)
        weight = tl.load(weight_ptr + channels, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(stats_ptr + channels, mask=valid, other=0.0)
        inv_s = tl.load(stats_ptr + C + channels, mask=valid, other=0.0)
        count = tl.load(info_ptr)
        usable = tl.load(info_ptr + 1) != 0.0
        # Gamma = mean_V(Z^2) = v / s^2, Lambda = mean_V(weight dY Z) (eq. 13)
        lam = weight * inv_s * real_dy_z0 / tl.maximum(count, 1.0)
        keep = usable & (count > 0.0) & _all_finite(lam, valid)
        nu = tl.load(nu_ptr + channels, mask=valid, other=0.0)
        updated = nu * (1.0 - rate * (v * inv_s * inv_s)) + rate * lam
        tl.store(nu_ptr + channels, tl.where(keep, updated, nu), mask=valid)
        tl.store(grads_ptr + channels, inv_s * sum_dy_z0, mask=valid)
        tl.store(grads_ptr + C + channels, sum_dy, mask=valid)


    @triton.jit
    def _squash(z, ERF: tl.constexpr):
        """`f(z)` and `f'(z)`: erf, or tanh as `2 sigmoid(2z) - 1` (the torch path's formula)."""
        if ERF:
            return tl.math.erf(z), 1.1283791670955126 * tl.exp(-z * z)
        p = tl.sigmoid(2.0 * z)
        return 2.0 * p - 1.0, 4.0 * p * (1.0 - p)

    @triton.jit
    def _elementwise_tile(x_ptr, alpha_ptr, shift_ptr, tile, T, C, HAS_SHIFT: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        """Rows `tile * BLOCK_T ...` of `x` (T, C) as float32, `z = alpha x (+ shift)`, offsets, mask."""
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        channels = tl.arange(0, BLOCK_C)
        valid = (rows[:, None] < T) & (channels[None, :] < C)
        offsets = rows[:, None].to(tl.int64) * C + channels[None, :]
        x = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        z = tl.load(alpha_ptr).to(tl.float32) * x
        if HAS_SHIFT:
            z += tl.load(shift_ptr).to(tl.float32)
        return x, z, offsets, valid

    @triton.jit
    def _elementwise_forward(x_ptr, alpha_ptr, shift_ptr, weight_ptr, bias_ptr, y_ptr, T, C, ERF: tl.constexpr,
                             HAS_SHIFT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        _, z, offsets, valid = _elementwise_tile(x_ptr, alpha_ptr, shift_ptr, tl.program_id(0), T, C, HAS_SHIFT,
                                                 BLOCK_T, BLOCK_C)
        f, _ = _squash(z, ERF)
        channels = tl.arange(0, BLOCK_C)
        weight = tl.load(weight_ptr + channels, mask=channels < C, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + channels, mask=channels < C, other=0.0).to(tl.float32)
        tl.store(y_ptr + offsets, (weight[None, :] * f + bias[None, :]).to(y_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def _elementwise_backward_sums(dy_ptr, x_ptr, alpha_ptr, shift_ptr, weight_ptr, dx_ptr, sums_ptr, T, C, num_tiles,
                                   programs, ERF: tl.constexpr, HAS_SHIFT: tl.constexpr, NEED_DX: tl.constexpr,
                                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        pid = tl.program_id(0)
        channels = tl.arange(0, BLOCK_C)
        vector = channels < C
        # with g = dy f'(z): dx = g weight alpha; per channel sum(dy f), sum(dy), sum(g x), sum(g)
        scale = tl.load(weight_ptr + channels, mask=vector, other=0.0).to(tl.float32) * tl.load(alpha_ptr).to(
            tl.float32)
        sum_dy_f = tl.zeros((BLOCK_C,), tl.float32)
        sum_dy = tl.zeros((BLOCK_C,), tl.float32)
        sum_g_x = tl.zeros((BLOCK_C,), tl.float32)
        sum_g = tl.zeros((BLOCK_C,), tl.float32)
        for tile in range(pid, num_tiles, programs):
            x, z, offsets, valid = _elementwise_tile(x_ptr, alpha_ptr, shift_ptr, tile, T, C, HAS_SHIFT, BLOCK_T,
                                                     BLOCK_C)
            dy = tl.load(dy_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
            f, slope = _squash(z, ERF)
            g = dy * slope
            if NEED_DX:
                tl.store(dx_ptr + offsets, (g * scale[None, :]).to(dx_ptr.dtype.element_ty), mask=valid)
            sum_dy_f += tl.sum(dy * f, axis=0)
            sum_dy += tl.sum(dy, axis=0)
            sum_g_x += tl.sum(g * x, axis=0)
            sum_g += tl.sum(g, axis=0)
        base = sums_ptr + pid * 4 * C + channels
        tl.store(base, sum_dy_f, mask=vector)
        tl.store(base + C, sum_dy, mask=vector)
        tl.store(base + 2 * C, sum_g_x, mask=vector)
        tl.store(base + 3 * C, sum_g, mask=vector)

    @triton.jit
    def _elementwise_backward_statistics(sums_ptr, programs, weight_ptr, grads_ptr, C, BLOCK_C: tl.constexpr,
                                         BLOCK_P: tl.constexpr):
        """`grads` (2C + 2): dweight, dbias, then dalpha = sum(weight sum_t(g x)), dshift = sum(weight sum_t(g))."""
        channels = tl.arange(0, BLOCK_C)
        valid = channels < C
        weight = tl.load(weight_ptr + channels, mask=valid, other=0.0).to(tl.float32)
        tl.store(grads_ptr + channels, _reduce_rows(sums_ptr, programs, 4 * C, C, BLOCK_C, BLOCK_P), mask=valid)
        tl.store(grads_ptr + C + channels, _reduce_rows(sums_ptr + C, programs, 4 * C, C, BLOCK_C, BLOCK_P),
                 mask=valid)
        sum_g_x = _reduce_rows(sums_ptr + 2 * C, programs, 4 * C, C, BLOCK_C, BLOCK_P)
        sum_g = _reduce_rows(sums_ptr + 3 * C, programs, 4 * C, C, BLOCK_C, BLOCK_P)
        tl.store(grads_ptr + 2 * C, tl.sum(weight * sum_g_x, axis=0))
        tl.store(grads_ptr + 2 * C + 1, tl.sum(weight * sum_g, axis=0))


def usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *buffers: torch.Tensor) -> bool:
    """Whether the kernels take this step: float32/bfloat16/float16 `x` (tokens, C), parameters of
    a floating dtype, float32 running statistics, and a hidden size one program holds."""
    return (AVAILABLE and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and weight.is_floating_point() and bias.is_floating_point() and 0 < x.shape[1] <= 16384
            and all(buffer.dtype == torch.float32 for buffer in buffers))


def _layout(tokens: int, channels: int, group_num: int) -> dict:
    """Tile sizes: groups and group widths padded to powers of two, tokens per tile."""
    groups = group_num or 1
    width = channels // groups
    gp, kp = triton.next_power_of_2(groups), triton.next_power_of_2(width)
    block_t = max(1, min(TILE_ELEMENTS // (gp * kp), triton.next_power_of_2(max(tokens, 1))))
    num_tiles = triton.cdiv(tokens, block_t)
    return {"k": width, "G": groups, "GROUPED": bool(group_num), "BLOCK_T": block_t, "GP": gp, "KP": kp,
            "num_tiles": num_tiles, "programs": max(1, min(num_tiles, MAX_PROGRAMS))}


def _statistics_blocks(channels: int) -> dict:
    """Block sizes of a one-program statistics kernel: all channels, and rows of partial sums a loop step."""
    block_c = triton.next_power_of_2(channels)
    return {"BLOCK_C": block_c, "BLOCK_P": max(1, min(16, 16384 // block_c))}


def _mask_pointer(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The mask as a tensor the kernels read (`!= 0` = real), or `x` as a placeholder without one."""
    if mask is None:
        return x
    mask = mask.reshape(-1).to(x.device)
    return (mask.view(torch.uint8) if mask.dtype == torch.bool else mask).contiguous()


def pn_step_forward(x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                    running_phi: torch.Tensor, counter: torch.Tensor, group_num: int, eps: float, warmup_steps: int,
                    ramp_steps: int, alpha_fwd: float, reference: bool, batch_backward: bool, group_eps: float):
    """PN's training forward of contiguous `x` (tokens, C): `(y, stats, info)` as the operator returns
    them, `running_phi` and `counter` updated in place, no host synchronisation."""
    tokens, channels = x.shape
    layout = _layout(tokens, channels, group_num)
    programs, num_tiles = layout.pop("programs"), layout.pop("num_tiles")
    k = layout.pop("k")
    sums = torch.empty(programs, channels, device=x.device, dtype=torch.float32)
    counts = torch.empty(programs, device=x.device, dtype=torch.float32)
    stats = torch.empty(3, channels, device=x.device, dtype=torch.float32)
    info = torch.empty(3, device=x.device, dtype=torch.float32)
    scale = torch.empty(channels, device=x.device, dtype=torch.float32)
    y = torch.empty_like(x)
    _forward_sums[(programs,)](x, _mask_pointer(mask, x), sums, counts, tokens, channels, k, group_eps, num_tiles,
                               programs, HAS_MASK=mask is not None, **layout, **LAUNCH)
    _forward_statistics[(1,)](sums, counts, programs, running_phi, counter, weight.contiguous(), stats, info, scale,
                              channels, eps, float(warmup_steps), float(ramp_steps), 1.0 - alpha_fwd,
                              REFERENCE=reference, BATCH_BACKWARD=batch_backward, **_statistics_blocks(channels),
                              **LAUNCH)
    _forward_output[(num_tiles,)](x, y, scale, bias.contiguous(), tokens, channels, k, group_eps, **layout, **LAUNCH)
    return y, stats, info


def pn_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor,
                     running_nu: torch.Tensor, stats: torch.Tensor, info: torch.Tensor, group_num: int,
                     alpha_bkw: float, group_eps: float):
    """PN's approximate backward (eqs. 11-13) of contiguous `dy`, `x`: `(dx, grads)`, `grads` (2, C) =
    `(dweight, dbias)` in the weight's dtype, `running_nu` updated in place, no host synchronisation."""
    tokens, channels = x.shape
    layout = _layout(tokens, channels, group_num)
    programs, num_tiles = layout.pop("programs"), layout.pop("num_tiles")
    k = layout.pop("k")
    sums = torch.empty(programs, 3, channels, device=x.device, dtype=torch.float32)
    grads = torch.empty(2, channels, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    weight = weight.contiguous()
    _backward_sums[(programs,)](dy.contiguous(), x, _mask_pointer(mask, x), weight, running_nu, stats, dx, sums,
                                tokens, channels, k, group_eps, num_tiles, programs, HAS_MASK=mask is not None,
                                **layout, **LAUNCH)
    _backward_statistics[(1,)](sums, programs, weight, stats, info, running_nu, grads, channels, 1.0 - alpha_bkw,
                               **_statistics_blocks(channels), **LAUNCH)
    return dx, grads if weight.dtype == torch.float32 else grads.to(weight.dtype)


def elementwise_usable(x: torch.Tensor, *parameters: torch.Tensor | None) -> bool:
    """Whether DyT's and Derf's kernels take `x` (..., C): float32, bfloat16 or float16, parameters of
    any floating dtype (every value is read as float32, the output and `dx` written in `x`'s dtype),
    a hidden size one program holds."""
    return (AVAILABLE and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.dim() >= 1
            and 0 < x.shape[-1] <= 16384 and all(p is None or p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                                                  for p in parameters))


def _elementwise_layout(tokens: int, channels: int) -> tuple[dict, int, int]:
    """PN's tiles without groups (`_layout`): `({BLOCK_T, BLOCK_C}, tiles, programs)`."""
    layout = _layout(tokens, channels, 0)
    return {"BLOCK_T": layout["BLOCK_T"], "BLOCK_C": layout["KP"]}, layout["num_tiles"], layout["programs"]


def elementwise_forward(x: torch.Tensor, function: str, alpha: torch.Tensor, shift: torch.Tensor | None,
                        weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`weight * f(alpha * x + shift) + bias` of contiguous `x` (tokens, C), f = "tanh" or "erf"."""
    tokens, channels = x.shape
    y = torch.empty_like(x)
    if tokens:
        layout, num_tiles, _ = _elementwise_layout(tokens, channels)
        _elementwise_forward[(num_tiles,)](
            x, alpha, alpha if shift is None else shift, weight.contiguous(), bias.contiguous(), y, tokens, channels,
            ERF=function == "erf", HAS_SHIFT=shift is not None, **layout, **LAUNCH)
    return y


def elementwise_backward(dy: torch.Tensor, x: torch.Tensor, function: str, alpha: torch.Tensor,
                         shift: torch.Tensor | None, weight: torch.Tensor, need_dx: bool):
    """Their backward of contiguous `dy`, `x` (tokens, C), `f(z)` recomputed from `x`: `(dx or None,
    sums)`, `sums` (2C + 2, float32) = `(dweight, dbias, dalpha, dshift)`, as `kernels_cpu`'s."""
    tokens, channels = x.shape
    layout, num_tiles, programs = _elementwise_layout(tokens, channels)
    # every program writes its row; without tokens no program runs, and the sums are zero
    sums = (torch.empty if tokens else torch.zeros)(programs, 4, channels, device=x.device, dtype=torch.float32)
    grads = torch.empty(2 * channels + 2, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x) if need_dx else None
    weight = weight.contiguous()
    if tokens:
        _elementwise_backward_sums[(programs,)](
            dy, x, alpha, alpha if shift is None else shift, weight, x if dx is None else dx, sums, tokens, channels,
            num_tiles, programs, ERF=function == "erf", HAS_SHIFT=shift is not None, NEED_DX=need_dx, **layout,
            **LAUNCH)
    _elementwise_backward_statistics[(1,)](sums, programs, weight, grads, channels, **_statistics_blocks(channels),
                                           **LAUNCH)
    return dx, grads
