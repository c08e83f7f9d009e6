"""Tests of the norm family against independent float64 references of the formulas.

The PowerNorm reference below restates `powernorm-notes.md` step by step with gathered real tokens
and autograd for group scaling; it shares no code with `hf_powernorm.normalization`.
"""

import contextlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from launching import free_port
from hf_powernorm import (
    NORM_CLASSES,
    BatchRenorm,
    LayerNorm,
    MovingAverageBatchNorm,
    PowerNorm,
    build_norm,
    group_scale,
    kernel_backend,
    norm_spellings,
    normalize_norm_name,
)

HIDDEN = 12
GROUPS = 4
# Every norm of the registry that keeps running statistics (and a step counter).
BATCH_NORMS = tuple(sorted(
    name for name, cls in NORM_CLASSES.items() if "num_batches_tracked" in cls(HIDDEN).state_dict()
))
# MABN leaves its batch phase after two steps here, so that the edge cases reach its moving averages.
_NORM_OPTIONS = {"groupnorm": dict(group_num=GROUPS), "mabn": dict(window=2, warmup_steps=0, renorm_warmup_steps=1)}


def _options(name: str) -> dict:
    return dict(_NORM_OPTIONS.get(name, {}))


@pytest.fixture
def use_torch_ops():
    """Call it to run the rest of the test on the torch ops (`kernel_backend("torch")`)."""
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(kernel_backend("torch"))


def test_batch_norms_cover_the_registry():
    assert set(BATCH_NORMS) == {"powernorm", "powernorm_v", "batchnorm", "batchrenorm", "mabn"}


def _batch(seed: int, batch: int = 3, seq: int = 5, hidden: int = HIDDEN, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=gen, dtype=dtype) * 2 + 0.5
    dy = torch.randn(batch, seq, hidden, generator=gen, dtype=dtype)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 2 :] = 0
    mask[-1, 1:] = 0
    return x, mask, dy


# ----------------------------------------------------------------------------------------------
# Independent float64 reference of PN (powernorm-notes.md, "PN, training step t")


def _reference_group_scale(x: torch.Tensor, groups: int | None, eps: float = 1e-5) -> torch.Tensor:
    if groups is None:
        return x
    parts = x.reshape(x.shape[0], groups, -1)
    rms = torch.sqrt((parts**2).mean(dim=2, keepdim=True) + eps)
    return (parts / rms).reshape(x.shape)


class ReferencePN:
    """`statistic="reference"` restates the authors' MaskPowerNorm: cumulative then EMA step while t < W,
    EMA alone after. `ramp=K` blends the second moments over the K steps after warmup."""

    def __init__(self, hidden, eps=1e-5, alpha_fwd=0.9, alpha_bkw=0.9, warmup=0, groups=1, denominator="running",
                 statistic="cumulative", ramp=0, group_eps=1e-5):
        self.eps, self.a_f, self.a_b, self.warmup = eps, alpha_fwd, alpha_bkw, warmup
        self.group_eps = group_eps
        self.groups, self.denominator, self.statistic, self.ramp = groups, denominator, statistic, ramp
        self.phi = torch.ones(hidden, dtype=torch.float64)
        self.nu = torch.zeros(hidden, dtype=torch.float64)
        self.t = 0

    def step(self, x, real, dy, gamma, beta):
        """One training step on tokens `x` (N, C); `real` (N,) bool. Returns y, dx, dgamma, dbeta."""
        x = x.detach().clone().requires_grad_(True)
        z0 = _reference_group_scale(x, self.groups, self.group_eps)
        v = (z0.detach()[real] ** 2).mean(dim=0)
        self.t += 1
        t, W, K = self.t, self.warmup, self.ramp
        if t <= W:
            s = torch.sqrt(v + self.eps)
        elif t <= W + K:
            r = (t - W) / (K + 1)
            s = torch.sqrt((1 - r) * (v + self.eps) + r * (self.phi + self.eps))
        else:
            s = torch.sqrt(self.phi + self.eps)
        z = z0.detach() / s
        y = gamma * z + beta
        if self.statistic == "cumulative":
            if t <= W:
                self.phi = self.phi + (v - self.phi) / t
            else:
                self.phi = self.a_f * self.phi + (1 - self.a_f) * v
        else:
            if t < W:
                self.phi = self.phi * (t - 1) / t + v / t
            self.phi = self.a_f * self.phi + (1 - self.a_f) * v
        g = gamma * dy
        g_tilde = g.clone()
        g_tilde[real] = g[real] - self.nu * z[real]
        s_b = s if self.denominator == "running" else torch.sqrt(v + self.eps)
        dz0 = g_tilde / s_b
        big_gamma = (z[real] ** 2).mean(dim=0)
        big_lambda = (g[real] * z[real]).mean(dim=0)
        self.nu = self.nu * (1 - (1 - self.a_b) * big_gamma) + (1 - self.a_b) * big_lambda
        (dx,) = torch.autograd.grad(z0, x, dz0)
        return y, dx, (dy * z).sum(0), dy.sum(0)


WARMUP_VARIANTS = [("cumulative", 0), ("reference", 0), ("cumulative", 2), ("reference", 2)]


def _training_step(norm, x, mask, dy):
    """One forward and backward of `norm` with `x` as a leaf, the non-finite warning silenced; the output."""
    x.requires_grad_(True)
    norm.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        y = norm(x, mask)
        y.backward(dy)
    return y


def _operator_step(norm, x, mask, dy):
    """One step of `norm` through the `hf_powernorm::pn_step_*` operators called directly (the C
    kernels for float32, the torch ops for float64): `(y, dx, dweight, dbias)`."""
    flat, flat_dy, mask = x.reshape(-1, HIDDEN), dy.reshape(-1, HIDDEN), mask.reshape(-1)
    weight, bias = norm.weight.detach(), norm.bias.detach()
    y, stats, info = torch.ops.hf_powernorm.pn_step_forward(
        flat, mask, weight, bias, norm.running_phi, norm.num_batches_tracked, norm.group_num or 0, norm.eps,
        norm.warmup_steps, norm.warmup_ramp_steps, norm.alpha_fwd, norm.warmup_statistic == "reference",
        norm.backward_denominator == "batch", norm.group_eps)
    dx, grads = torch.ops.hf_powernorm.pn_step_backward(flat_dy, flat, mask, weight, norm.running_nu, stats, info,
                                                        norm.group_num or 0, norm.alpha_bkw, norm.group_eps)
    return y, dx, grads[0], grads[1]


def _module_step(norm, x, mask, dy):
    y = _training_step(norm, x, mask, dy)
    return y.reshape(-1, HIDDEN), x.grad.reshape(-1, HIDDEN), norm.weight.grad, norm.bias.grad


@pytest.mark.parametrize("path, dtype", [("operators", torch.float32), ("operators", torch.float64),
                                         ("module", torch.float32), ("module, torch ops", torch.float32)])
@pytest.mark.parametrize("groups", [1, GROUPS])
def test_powernorm_group_eps_reaches_every_path_of_the_step(path, dtype, groups):
    """A PN with `group_eps=1e-6` (a converted RMSNorm's) takes the same training step as the float64
    reference at that epsilon: outputs, input and parameter gradients, running buffers, through the
    operators (C kernels, torch ops) and the module (its direct C calls, the operators' torch ops).
    Inputs small enough that group scaling's epsilon moves every figure past the tolerance."""
    from hf_powernorm.normalization import kernel_backend

    norm = PowerNorm(HIDDEN, warmup_steps=1, group_num=groups, group_eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
        norm.bias.copy_(torch.linspace(-0.2, 0.3, HIDDEN))
    ref, default_ref = (ReferencePN(HIDDEN, warmup=1, groups=groups, statistic="reference", group_eps=e)
                        for e in (1e-6, 1e-5))
    step = _operator_step if path == "operators" else _module_step
    for t in range(3):  # warmup (the batch statistic), then the running statistic
        x, mask, dy = _batch(t)
        x = x * 3e-3
        with kernel_backend("torch" if path.endswith("torch ops") else "auto"):
            got = step(norm, x.to(dtype), mask, dy.to(dtype))
        real, gamma, beta = mask.reshape(-1).bool(), norm.weight.detach().double(), norm.bias.detach().double()
        flat, flat_dy = x.reshape(-1, HIDDEN), dy.reshape(-1, HIDDEN)
        want = ref.step(flat, real, flat_dy, gamma, beta)
        default = default_ref.step(flat, real, flat_dy, gamma, beta)
        tol = dict(rtol=1e-4, atol=1e-5)
        for name, g, w in zip(("y", "dx", "dweight", "dbias"), got, want):  # float32 rounding, to each's scale
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-6 * max(1.0, float(w.abs().max())),
                                       msg=lambda m, n=name: f"step {t}, {n}: {m}")
        torch.testing.assert_close(norm.running_phi.double(), ref.phi, **tol)
        torch.testing.assert_close(norm.running_nu.double(), ref.nu, **tol)
        assert int(norm.num_batches_tracked) == t + 1
        # the epsilon matters here: the default's step is out of tolerance
        assert not torch.allclose(got[1].double(), default[1], rtol=1e-2)
        assert not torch.allclose(norm.running_nu.double(), default_ref.nu, **tol) or t == 0


@pytest.mark.parametrize("statistic, ramp", WARMUP_VARIANTS)
@pytest.mark.parametrize("denominator", ["running", "batch"])
@pytest.mark.parametrize("groups", [None, 1, GROUPS])
@pytest.mark.parametrize("padded", [False, True])
def test_powernorm_matches_reference_across_warmup(denominator, groups, padded, statistic, ramp):
    warmup = 3
    norm = PowerNorm(HIDDEN, alpha_fwd=0.8, alpha_bkw=0.7, warmup_steps=warmup, group_num=groups,
                     backward_denominator=denominator, warmup_statistic=statistic, warmup_ramp_steps=ramp).double()
    ref = ReferencePN(HIDDEN, alpha_fwd=0.8, alpha_bkw=0.7, warmup=warmup, groups=groups, denominator=denominator,
                      statistic=statistic, ramp=ramp)
    # steps 1-3 in warmup, 4-5 in the ramp (if any), 6-7 on the running statistic
    _run_against_reference(norm, ref, steps=7, padded=padded, seed=0, drift=False,
                           buffers={"running_phi": "phi", "running_nu": "nu"})


def test_warmup_statistics_differ_only_where_the_notes_say():
    norms = {name: PowerNorm(HIDDEN, warmup_steps=3, warmup_statistic=name) for name in ("cumulative", "reference")}
    phis = {name: [] for name in norms}
    for step in range(4):
        x, mask, _ = _batch(40 + step, dtype=torch.float32)
        for name, norm in norms.items():
            norm(x, mask)
            phis[name].append(norm.running_phi.clone())
    torch.testing.assert_close(phis["cumulative"][0], phis["reference"][0])  # t=1: both are v
    assert not torch.allclose(phis["cumulative"][1], phis["reference"][1])


def test_warmup_ramp_weights_go_linearly_from_batch_to_running():
    norm = PowerNorm(HIDDEN, warmup_steps=2, warmup_ramp_steps=3)
    assert [norm.running_weight(t) for t in range(1, 8)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert [PowerNorm(HIDDEN, warmup_steps=2).running_weight(t) for t in (2, 3)] == [0.0, 1.0]


def test_powernorm_after_warmup_output_of_a_token_ignores_its_batch():
    x, mask, _ = _batch(0, dtype=torch.float32)
    x_other = x.clone()
    x_other[1:] = x_other[1:] * 7 + 3  # the other sequences of the batch change
    outputs = []
    for batch in (x, x_other):
        norm = PowerNorm(HIDDEN, warmup_steps=1)
        norm(x, mask)  # the same warmup step for both
        outputs.append(norm(batch, mask)[0])  # first step after warmup: divides by phi of step 1
    torch.testing.assert_close(outputs[0], outputs[1])
    warm = PowerNorm(HIDDEN, warmup_steps=1)
    assert not torch.allclose(warm(x, mask)[0], PowerNorm(HIDDEN, warmup_steps=1)(x_other, mask)[0])


# ----------------------------------------------------------------------------------------------
# Independent float64 references of the Appendix B.3 baselines


class ReferenceBRN:
    """Batch Renormalization (Ioffe, 2017, Algorithm 1) on real tokens, r and d held constant."""

    def __init__(self, hidden, eps=1e-5, momentum=0.1, rmax=3.0, dmax=5.0):
        self.eps, self.momentum, self.rmax, self.dmax = eps, momentum, rmax, dmax
        self.mean = torch.zeros(hidden, dtype=torch.float64)
        self.var = torch.ones(hidden, dtype=torch.float64)

    def step(self, x, real, dy, gamma, beta):
        x = x.detach().clone().requires_grad_(True)
        mu = x[real].mean(0)
        sigma_b = torch.sqrt(((x[real] - mu) ** 2).mean(0) + self.eps)
        sigma = torch.sqrt(self.var + self.eps)
        r = torch.clamp(sigma_b.detach() / sigma, 1 / self.rmax, self.rmax)
        d = torch.clamp((mu.detach() - self.mean) / sigma, -self.dmax, self.dmax)
        gamma, beta = gamma.detach().clone().requires_grad_(True), beta.detach().clone().requires_grad_(True)
        y = gamma * ((x - mu) / sigma_b * r + d) + beta
        dx, dgamma, dbeta = torch.autograd.grad(y, (x, gamma, beta), dy)
        n = int(real.sum())
        self.mean = self.mean + self.momentum * (mu.detach() - self.mean)
        self.var = self.var + self.momentum * ((sigma_b.detach() ** 2 - self.eps) * n / (n - 1) - self.var)
        return y.detach(), dx, dgamma, dbeta


class ReferenceMABN:
    """MABN (Yan et al., 2020) as the authors' layer computes it, with lists for the moving windows."""

    def __init__(self, hidden, eps=1e-5, momentum=0.02, window=16, warmup=100, rmax=5.0, renorm_warmup=1000):
        self.eps, self.momentum, self.m, self.warmup = eps, momentum, window, warmup
        self.rmax, self.renorm_warmup = rmax, renorm_warmup
        self.running = torch.ones(hidden, dtype=torch.float64)
        self.chi2_history, self.psi_history = [], []
        self.t = 0

    def step(self, x, real, dy, gamma, beta):
        self.t += 1
        batch_phase = self.t <= self.m or self.t < self.warmup
        self.chi2_history.append((x[real] ** 2).mean(0))
        chi2 = self.chi2_history[-1] if batch_phase else torch.stack(self.chi2_history[-self.m:]).mean(0)
        r = torch.sqrt((chi2 + self.eps) / (self.running + self.eps))
        r = torch.ones_like(r) if self.t <= max(self.renorm_warmup, self.warmup) else r.clamp(1 / self.rmax, self.rmax)
        self.running = (1 - self.momentum) * self.running + self.momentum * chi2
        chi = torch.sqrt(chi2 + self.eps)
        z = x / chi
        y = gamma * r * z + beta
        g = gamma * r * dy
        self.psi_history.append((g[real] * z[real]).mean(0))
        psi = self.psi_history[-1] if batch_phase else torch.stack(self.psi_history[-self.m:]).mean(0)
        dx = g.clone()
        dx[real] = g[real] - z[real] * psi
        return y, dx / chi, (dy * r * z).sum(0), dy.sum(0)


def _run_against_reference(norm, ref, steps, padded, seed, drift=True, buffers=None):
    """`steps` training steps of `norm` (float64) and `ref` on the same batches: outputs, input and
    parameter gradients, and after each step the buffers `buffers` names (norm's -> ref's), alike."""
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
        norm.bias.copy_(torch.linspace(-0.2, 0.3, HIDDEN))
    for step in range(steps):
        x, mask, dy = _batch(seed + step)
        if drift:
            x = x * (1 + 0.3 * step) + 0.4 * step  # statistics that drift, so the running ones lag behind
        if not padded:
            mask = torch.ones_like(mask)
        x.requires_grad_(True)
        norm.zero_grad()
        y = norm(x, mask)
        y.backward(dy)
        expected = ref.step(x.detach().reshape(-1, HIDDEN), mask.reshape(-1).bool(), dy.reshape(-1, HIDDEN),
                            norm.weight.detach(), norm.bias.detach())
        tol = dict(rtol=1e-5, atol=1e-6)  # buffers are float32; the references keep float64
        for got, want in zip((y, x.grad, norm.weight.grad, norm.bias.grad), expected):
            torch.testing.assert_close(got.reshape(want.shape), want, **tol)
        for name, ref_name in (buffers or {}).items():
            torch.testing.assert_close(getattr(norm, name).double(), getattr(ref, ref_name), **tol)
        assert int(norm.num_batches_tracked) == step + 1
    return norm


@pytest.mark.parametrize("padded", [False, True])
def test_batch_renorm_matches_reference(padded):
    options = dict(momentum=0.3, rmax=1.3, dmax=0.4)  # tight bounds: some channels clip, others do not
    ref = ReferenceBRN(HIDDEN, **options)
    norm = _run_against_reference(BatchRenorm(HIDDEN, **options).double(), ref, steps=5, padded=padded, seed=60)
    torch.testing.assert_close(norm.running_mean.double(), ref.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.running_var.double(), ref.var, rtol=1e-5, atol=1e-6)


def _bn_operator_step(norm, x, mask, dy):
    """One step of masked BN or BRN through the `hf_powernorm::bn_step_*` operators called directly
    (the C kernels for float32, the torch ops for float64): `(y, dx, dweight, dbias)`."""
    flat, flat_dy, mask = x.reshape(-1, HIDDEN), dy.reshape(-1, HIDDEN), mask.reshape(-1)
    renorm = isinstance(norm, BatchRenorm)
    weight = norm.weight.detach()
    y, out, info = torch.ops.hf_powernorm.bn_step_forward(
        flat, mask, weight, norm.bias.detach(), norm.running_mean, norm.running_var, norm.num_batches_tracked,
        norm.eps, norm.momentum, renorm, norm.rmax if renorm else 1.0, norm.dmax if renorm else 0.0)
    assert out.shape == (4, HIDDEN) and info.tolist()[:2] == [float(mask.sum()), 1.0]
    dx, grads = torch.ops.hf_powernorm.bn_step_backward(flat_dy, flat, mask, weight, out, info)
    return y, dx, grads[0], grads[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("renorm", [False, True])
def test_batch_norm_operators_match_the_reference(dtype, renorm):
    """Masked BN (BRN with rmax = 1, dmax = 0) and BRN through their two operators, on the C kernels
    and on the torch ops: outputs, gradients and running statistics of the float64 reference."""
    options = dict(momentum=0.3, rmax=1.3, dmax=0.4) if renorm else dict(momentum=0.3)
    ref = ReferenceBRN(HIDDEN, **(options if renorm else dict(options, rmax=1.0, dmax=0.0)))
    norm = (BatchRenorm if renorm else NORM_CLASSES["batchnorm"])(HIDDEN, **options).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
        norm.bias.copy_(torch.linspace(-0.2, 0.3, HIDDEN))
    for step in range(4):
        x, mask, dy = _batch(70 + step)
        x = x * (1 + 0.3 * step) + 0.4 * step  # drifting statistics: some of BRN's channels clip
        got = _bn_operator_step(norm, x.to(dtype), mask, dy.to(dtype))
        want = ref.step(x.reshape(-1, HIDDEN), mask.reshape(-1).bool(), dy.reshape(-1, HIDDEN),
                        norm.weight.detach().double(), norm.bias.detach().double())
        for name, g, w in zip(("y", "dx", "dweight", "dbias"), got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{step} {n}: {m}")
        torch.testing.assert_close(norm.running_mean.double(), ref.mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm.running_var.double(), ref.var, rtol=1e-5, atol=1e-6)
        assert int(norm.num_batches_tracked) == step + 1


@pytest.mark.parametrize("name", ["batchnorm", "batchrenorm"])
def test_batch_norm_operator_step_matches_the_autograd_of_its_torch_ops(name):
    """The module's step through the operators (float64: their torch ops, closed-form gradient)
    against autograd through the layer's own torch-ops forward (`affine_in_torch_ops`), with a batch
    without real tokens and a non-finite one: outputs, gradients, buffers."""
    options = dict(rmax=1.2, dmax=0.3) if name == "batchrenorm" else {}
    norms = [build_norm(name, HIDDEN, **options).double() for _ in range(2)]
    for norm in norms:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    for step in range(5):
        x, mask, dy = _batch(80 + step)
        mask = torch.zeros_like(mask) if step == 2 else mask
        if step == 3:
            x[0, 0, 1] = float("nan")
        traces = []
        for index, norm in enumerate(norms):
            xi = x.clone().requires_grad_(True)
            norm.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                if index == 0:
                    y = norm(xi, mask)
                else:  # the pre-operator path: autograd through the torch ops
                    y = norm.affine_in_torch_ops(xi.reshape(-1, HIDDEN), mask.reshape(-1).double()).view_as(xi)
            y.backward(dy)
            traces.append((y.detach(), xi.grad, norm.weight.grad, norm.bias.grad, *norm.buffers()))
        for a, b in zip(*traces):
            if step == 3:  # NaN where the input is; autograd through the unused statistic adds more, never fewer
                assert (torch.isfinite(b) <= torch.isfinite(a)).all()
                a, b = a[torch.isfinite(b)], b[torch.isfinite(b)]
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"step {step}: {m}")
    assert int(norms[0].num_batches_tracked) == 3


@pytest.mark.parametrize("name", ["batchnorm", "batchrenorm"])
def test_batch_norm_operator_step_under_checkpointing_updates_once(name):
    """A checkpointed step through the operators (float64) recomputes its output from the step's
    statistics: the same buffers and gradients as the plain step."""
    x, mask, dy = _batch(9)
    plain, ckpt = build_norm(name, HIDDEN).double(), build_norm(name, HIDDEN).double()
    grads = []
    for norm, wrap in ((plain, False), (ckpt, True)):
        for step in range(3):
            xi = (x + step).requires_grad_(True)
            inp = xi * 1.0
            y = checkpoint(norm, inp, mask, use_reentrant=False) if wrap else norm(inp, mask)
            y.backward(dy)
        grads.append(xi.grad)
    assert int(ckpt.num_batches_tracked) == 3 and ckpt.last_step.path == "operator"
    for (key, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        torch.testing.assert_close(a, b, msg=key)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("padded", [False, True])
def test_mabn_matches_reference_across_its_phases(padded):
    # batch statistics for t <= 3 (t < warmup), moving averages of 2 batches after; r = 1 up to t = 5, clipped after.
    options = dict(momentum=0.3, window=2, rmax=1.2)
    norm = MovingAverageBatchNorm(HIDDEN, warmup_steps=4, renorm_warmup_steps=5, **options).double()
    ref = ReferenceMABN(HIDDEN, warmup=4, renorm_warmup=5, **options)
    _run_against_reference(norm, ref, steps=8, padded=padded, seed=70)
    torch.testing.assert_close(norm.running_phi.double(), ref.running, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# gradcheck where the gradient is exact


@pytest.mark.parametrize("name", ["powernorm_v", "batchnorm", "layernorm", "rmsnorm", "groupnorm"])
def test_gradcheck_exact_norms(name):
    norm = build_norm(name, HIDDEN, **_options(name)).double()
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x, mask, _ = _batch(1, batch=2, seq=4)
    x.requires_grad_(True)
    params = tuple(norm.parameters())
    assert torch.autograd.gradcheck(lambda inp, *ps: norm(inp, mask), (x, *params))


@pytest.mark.parametrize("options", [dict(rmax=1.0, dmax=0.0), dict(rmax=2.0, dmax=0.5)])
def test_gradcheck_batch_renorm_where_exact(options):
    # r and d are constants of the backward: exact where they are (rmax=1, dmax=0 is batch norm) or where
    # the clipping holds them (running statistics far from the batch's); momentum=0 freezes the running ones.
    norm = BatchRenorm(HIDDEN, momentum=0.0, **options).double()
    with torch.no_grad():
        norm.running_var.fill_(100.0)
        norm.running_mean.fill_(-50.0)
        norm.weight.uniform_(0.5, 1.5)
    x, mask, _ = _batch(1, batch=2, seq=4)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda inp, w, b: norm(inp, mask) * mask[..., None], (x, norm.weight, norm.bias))


def test_gradcheck_mabn_in_its_batch_phase():
    # While t <= window or t < warmup_steps (and r = 1), MABN's backward is the exact gradient on real tokens.
    norm = MovingAverageBatchNorm(HIDDEN, warmup_steps=10**6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, mask, _ = _batch(1, batch=2, seq=4)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda inp, w, b: norm(inp, mask) * mask[..., None], (x, norm.weight, norm.bias))


def test_gradcheck_group_scale():
    x = torch.randn(6, HIDDEN, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: group_scale(t, GROUPS), (x,))


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_group_scale_matches_the_reference_on_every_path(backend, dtype):
    """The C pass (float32 inference) and torch's `rms_norm` per group (the rest), in float32."""
    from hf_powernorm.normalization import kernel_backend

    x = torch.randn(2, 7, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 3
    want = _reference_group_scale(x.reshape(-1, HIDDEN), GROUPS).reshape(x.shape)
    with kernel_backend(backend), torch.no_grad():
        got = group_scale(x.to(dtype), GROUPS)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6  # the input's rounding only
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("groups", [1, GROUPS])
def test_gradcheck_powernorm_where_exact(groups):
    # With a frozen running statistic (alpha_fwd=1, no warmup) and nu frozen at 0 (alpha_bkw=1),
    # the approximate backward is the exact gradient of weight * GS(x) / sqrt(phi + eps) + bias.
    norm = PowerNorm(HIDDEN, alpha_fwd=1.0, alpha_bkw=1.0, group_num=groups).double()
    with torch.no_grad():
        norm.running_phi.uniform_(0.5, 2.0)
        norm.weight.uniform_(0.5, 1.5)
    x, mask, _ = _batch(2, batch=2, seq=4)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda inp, w, b: norm(inp, mask), (x, norm.weight, norm.bias))
    assert float(norm.running_nu.abs().max()) == 0.0


# ----------------------------------------------------------------------------------------------
# Padding


@pytest.mark.parametrize("name", sorted(NORM_CLASSES))
def test_padding_never_changes_real_tokens_or_statistics(name):
    x, mask, dy = _batch(3, dtype=torch.float32)
    results = []
    for pad_value in (0.0, 1e3):
        torch.manual_seed(0)
        norm = build_norm(name, HIDDEN, **_options(name))
        xi = x.clone()
        xi[mask == 0] = pad_value + torch.randn_like(xi[mask == 0])
        xi.requires_grad_(True)
        y = norm(xi, mask)
        (y * dy * mask[..., None]).sum().backward()
        real = mask.bool()
        results.append((y[real].detach(), xi.grad[real], [b.clone() for b in norm.buffers()],
                        [p.grad.clone() for p in norm.parameters()]))
    (y0, g0, b0, p0), (y1, g1, b1, p1) = results
    torch.testing.assert_close(y0, y1)
    torch.testing.assert_close(g0, g1)
    for a, b in zip(b0 + p0, b1 + p1):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", BATCH_NORMS)
def test_statistics_exclude_padding(name):
    x, mask, _ = _batch(4, dtype=torch.float32)
    norm = build_norm(name, HIDDEN, **_options(name))
    norm(x, mask)
    real_only = build_norm(name, HIDDEN, **_options(name))
    real_only(x[mask.bool()])  # (N_real, C): the same tokens, no padding at all
    for a, b in zip(norm.buffers(), real_only.buffers()):
        torch.testing.assert_close(a, b)


def test_powernorm_padding_gets_no_nu_correction():
    norm = PowerNorm(HIDDEN, group_num=None)
    norm.running_nu.fill_(0.5)
    x, mask, dy = _batch(5, dtype=torch.float32)
    x.requires_grad_(True)
    norm(x, mask).backward(dy)
    pad = mask == 0
    s = torch.sqrt(torch.ones(HIDDEN) + norm.eps)  # running statistic before the step (phi = 1)
    torch.testing.assert_close(x.grad[pad], (norm.weight.detach() * dy[pad]) / s)


# ----------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(NORM_CLASSES))
def test_low_precision_inputs_keep_float32_statistics(name, dtype):
    x, mask, dy = _batch(6, dtype=torch.float32)
    x_low = x.to(dtype)
    norm = build_norm(name, HIDDEN, **_options(name))
    twin = build_norm(name, HIDDEN, **_options(name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x_low, mask)
    y_twin = twin(x_low.float(), mask)  # the same values, computed in float32
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), y_twin.to(dtype).float())
    for name_, buf in norm.named_buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float32, name_
            torch.testing.assert_close(buf, dict(twin.named_buffers())[name_], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", BATCH_NORMS)
def test_cast_to_bfloat16_keeps_running_buffers_float32(name):
    norm = build_norm(name, HIDDEN, **_options(name))
    x, mask, _ = _batch(7, dtype=torch.float32)
    norm(x, mask)
    before = {k: v.clone() for k, v in norm.named_buffers()}
    norm.to(torch.bfloat16)
    assert norm.weight.dtype == torch.bfloat16
    for key, buf in norm.named_buffers():
        assert torch.equal(buf, before[key]), key
        assert buf.dtype == before[key].dtype


# ----------------------------------------------------------------------------------------------
# When running statistics update


@pytest.mark.parametrize("name", BATCH_NORMS)
def test_running_statistics_update_once_per_training_forward_and_never_in_eval(name):
    norm = build_norm(name, HIDDEN, **_options(name))
    x, mask, dy = _batch(8, dtype=torch.float32)
    norm(x, mask).backward(dy)
    norm(x, mask).backward(dy)
    assert int(norm.num_batches_tracked) == 2
    state = {k: v.clone() for k, v in norm.state_dict().items()}
    norm.eval()
    x.requires_grad_(True)
    norm(x, mask).backward(dy)
    for key, value in norm.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("name", BATCH_NORMS)
def test_activation_checkpointing_updates_statistics_once(name, use_reentrant):
    x, mask, dy = _batch(9, dtype=torch.float32)
    plain, ckpt = build_norm(name, HIDDEN, **_options(name)), build_norm(name, HIDDEN, **_options(name))
    grads = []
    for norm, wrap in ((plain, False), (ckpt, True)):
        for step in range(3):
            xi = (x + step).requires_grad_(True)
            inp = xi * 1.0  # a non-leaf so that reentrant checkpointing has a graph to follow
            y = checkpoint(norm, inp, mask, use_reentrant=use_reentrant) if wrap else norm(inp, mask)
            y.backward(dy)
        grads.append(xi.grad)
    assert int(ckpt.num_batches_tracked) == 3
    for (key, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        torch.testing.assert_close(a, b, msg=key)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("name", BATCH_NORMS)
def test_batch_without_real_tokens_changes_nothing(name):
    norm = build_norm(name, HIDDEN, **_options(name))
    x, mask, dy = _batch(10, dtype=torch.float32)
    norm(x, mask).backward(dy)
    state = {k: v.clone() for k, v in norm.state_dict().items()}
    x.requires_grad_(True)
    y = norm(x, torch.zeros_like(mask))
    y.backward(dy)
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    for key, value in norm.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", BATCH_NORMS)
def test_non_finite_input_never_poisons_buffers(name, bad):
    norm = build_norm(name, HIDDEN, **_options(name))
    x, mask, dy = _batch(11, dtype=torch.float32)
    norm(x, mask).backward(dy)
    state = {k: v.clone() for k, v in norm.state_dict().items()}
    x_bad = x.clone()
    x_bad[0, 0, 0] = bad
    with pytest.warns(RuntimeWarning, match="non-finite"):
        norm(x_bad, mask).backward(dy)
    for key, value in norm.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("name, gradient_statistic", [("powernorm", "running_nu"), ("mabn", "window_gz")])
def test_non_finite_gradient_never_poisons_the_gradient_statistic(name, gradient_statistic):
    norm = build_norm(name, HIDDEN, **_options(name))
    x, mask, dy = _batch(12, dtype=torch.float32)
    norm(x, mask).backward(dy)
    before = getattr(norm, gradient_statistic).clone()
    dy[0, 0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="gradient statistic"):
        norm(x, mask).backward(dy)
    assert torch.equal(getattr(norm, gradient_statistic), before)


# ----------------------------------------------------------------------------------------------
# Eval and state dicts


def test_eval_uses_only_the_running_statistic():
    norm = PowerNorm(HIDDEN, group_num=GROUPS)
    with torch.no_grad():
        norm.running_phi.uniform_(0.5, 2.0)
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    norm.eval()
    x, mask, _ = _batch(13, dtype=torch.float64)
    y = norm(x.float(), mask).double()
    z0 = _reference_group_scale(x.reshape(-1, HIDDEN), GROUPS).reshape(x.shape)
    expected = norm.weight.double() * z0 / torch.sqrt(norm.running_phi.double() + 1e-5) + norm.bias.double()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm(x[:1].float())[0], norm(x.float())[0])  # no batch dependence


@pytest.mark.parametrize("name", sorted(NORM_CLASSES))
def test_state_dict_round_trips_exactly(name):
    norm = build_norm(name, HIDDEN, **_options(name))
    x, mask, dy = _batch(14, dtype=torch.float32)
    x.requires_grad_(True)
    for _ in range(2):
        norm(x, mask).backward(dy)
    clone = build_norm(name, HIDDEN, **_options(name))
    clone.load_state_dict(norm.state_dict())
    for (key, a), b in zip(norm.state_dict().items(), clone.state_dict().values()):
        assert torch.equal(a, b) and a.dtype == b.dtype, key
    norm.eval(), clone.eval()
    assert torch.equal(norm(x, mask), clone(x, mask))


def test_powernorm_buffers_have_the_documented_layout():
    norm = PowerNorm(HIDDEN)
    state = norm.state_dict()
    assert set(state) == {"weight", "bias", "running_phi", "running_nu", "num_batches_tracked"}
    assert state["running_phi"].dtype == torch.float32 and torch.equal(state["running_phi"], torch.ones(HIDDEN))
    assert state["running_nu"].dtype == torch.float32 and torch.equal(state["running_nu"], torch.zeros(HIDDEN))
    assert state["num_batches_tracked"].dtype == torch.int64 and state["num_batches_tracked"].dim() == 0


# ----------------------------------------------------------------------------------------------
# Registry and input checks


@pytest.mark.parametrize("spelling", ["PowerNorm", "power_norm", "powernorm", "POWER-NORM", "pn"])
def test_norm_names_are_normalised(spelling):
    assert normalize_norm_name(spelling) == "powernorm"
    assert isinstance(build_norm(spelling, HIDDEN), PowerNorm)


@pytest.mark.parametrize("spelling, cls", [("brn", BatchRenorm), ("BatchRenorm", BatchRenorm),
                                           ("batch_renorm", BatchRenorm), ("MABN", MovingAverageBatchNorm),
                                           ("moving_average_batch_norm", MovingAverageBatchNorm)])
def test_baseline_names_are_normalised(spelling, cls):
    assert isinstance(build_norm(spelling, HIDDEN), cls)


# Every spelling the registry accepted when its spellings were a table of their own: each must stay
# accepted (in any case, with `_`, `-` or spaces) and mean the same norm.
ACCEPTED_SPELLINGS = {
    "powernorm": ["powernorm", "PowerNorm", "pn"],
    "powernorm_v": ["powernorm_v", "PowerNormV", "pnv"],
    "batchnorm": ["batchnorm", "MaskedBatchNorm", "bn"],
    "batchrenorm": ["batchrenorm", "BatchRenorm", "brn", "batch renormalization"],
    "mabn": ["mabn", "MovingAverageBatchNorm"],
    "layernorm": ["layernorm", "LayerNorm", "ln"],
    "rmsnorm": ["rmsnorm", "RMSNorm"],
    "groupnorm": ["groupnorm", "GroupNorm", "gn"],
    "none": ["none", "Identity"],
    "dyt": ["dyt", "DyT", "dynamic_tanh"],
    "derf": ["derf", "Derf", "Dynamic-Erf"],
}


@pytest.mark.parametrize("key", sorted(NORM_CLASSES))
def test_every_spelling_accepted_before_still_names_its_norm(key):
    for spelling in ACCEPTED_SPELLINGS[key]:
        for variant in (spelling, spelling.upper(), spelling.replace("_", "-"), f" {spelling}_"):
            assert normalize_norm_name(variant) == key, variant
    assert normalize_norm_name(NORM_CLASSES[key].__name__) == key


def test_spellings_are_derived_from_keys_class_names_and_short_names_only():
    squashed = {spelling.lower().replace("_", "").replace("-", "").replace(" ", ""): key
                for key, spellings in ACCEPTED_SPELLINGS.items() for spelling in spellings}
    assert norm_spellings() == squashed
    for spelling in ("p", "power", "norm", "batch", "renorm", "layer_norm_v", "bnorm"):
        with pytest.raises(ValueError, match=f"unknown norm {spelling!r}; valid names: .*'powernorm'"):
            normalize_norm_name(spelling)
    with pytest.raises(ValueError, match="norm name must be a string, got 3"):
        normalize_norm_name(3)


def test_a_registered_norm_is_accepted_by_key_class_name_and_short_names(monkeypatch):
    class MyOwnNorm(LayerNorm):
        short_names = ("mon",)

    monkeypatch.setitem(NORM_CLASSES, "my_own", MyOwnNorm)
    assert {normalize_norm_name(name) for name in ("my_own", "MyOwn", "MyOwnNorm", "my-own-norm", "MON")} == {"my_own"}
    assert normalize_norm_name("ln") == "layernorm"  # short names are not inherited
    assert isinstance(build_norm("MyOwnNorm", HIDDEN), MyOwnNorm)


def test_every_registry_name_builds_and_keeps_shape():
    x, mask, _ = _batch(15, dtype=torch.float32)
    for name in NORM_CLASSES:
        assert build_norm(name, HIDDEN, **_options(name))(x, mask).shape == x.shape
        assert build_norm(name, HIDDEN, **_options(name))(x.reshape(-1, HIDDEN)).shape == (15, HIDDEN)


def test_unknown_norm_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown norm 'switch_norm'.*layernorm"):
        build_norm("switch_norm", HIDDEN)


def test_unknown_option_is_rejected_by_name():
    with pytest.raises(TypeError, match="alpha_fwd"):
        build_norm("layernorm", HIDDEN, alpha_fwd=0.9)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(group_num=5), "group_num=5 must divide hidden_size=12"),
        (dict(alpha_fwd=1.5), "alpha_fwd must be a number in \\[0, 1\\], got 1.5"),
        (dict(warmup_steps=-1), "warmup_steps must be a non-negative integer, got -1"),
        (dict(backward_denominator="exact"), "backward_denominator must be one of"),
        (dict(eps=0.0), "eps must be a positive number, got 0.0"),
        (dict(warmup_statistic="ema"), r"warmup_statistic must be one of \('cumulative', 'reference'\), got 'ema'"),
        (dict(warmup_ramp_steps=-2), "warmup_ramp_steps must be a non-negative integer, got -2"),
        (dict(warmup_ramp_steps=1.5), "warmup_ramp_steps must be a non-negative integer, got 1.5"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PowerNorm(HIDDEN, **kwargs)


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("batchrenorm", dict(rmax=0.5), "rmax must be a number >= 1.0, got 0.5"),
        ("batchrenorm", dict(dmax=-1.0), "dmax must be a number >= 0.0, got -1.0"),
        ("batchrenorm", dict(momentum=2.0), r"momentum must be a number in \[0, 1\], got 2.0"),
        ("mabn", dict(window=0), "window must be an integer >= 1, got 0"),
        ("mabn", dict(warmup_steps=-1), "warmup_steps must be a non-negative integer, got -1"),
        ("mabn", dict(rmax="big"), "rmax must be a number >= 1.0, got 'big'"),
        ("mabn", dict(renorm_warmup_steps=None), "renorm_warmup_steps must be a non-negative integer, got None"),
    ],
)
def test_baseline_bad_options_raise_clear_errors(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_norm(name, HIDDEN, **kwargs)


def test_bad_shapes_raise_clear_errors():
    norm = PowerNorm(HIDDEN)
    with pytest.raises(ValueError, match=r"hidden_states must have shape .* got \(2, 3, 5\)"):
        norm(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(2, 3\).*got \(2, 4\)"):
        norm(torch.randn(2, 3, HIDDEN), torch.ones(2, 4))


# ----------------------------------------------------------------------------------------------
# sync_stats across two processes


_SYNC_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from hf_powernorm import PowerNorm
    rank, world, port, data, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    norm = PowerNorm(12, warmup_steps=2, group_num=4, sync_stats=True)
    for x, mask, dy in torch.load(data):
        rows = slice(2 * rank, 2 * rank + 2)  # this rank's half of the batch
        norm(x[rows], mask[rows]).backward(dy[rows])
    torch.save(norm.state_dict(), out)
    dist.destroy_process_group()
    """
)


def test_sync_stats_two_processes_equal_one_process_on_the_whole_batch(tmp_path):
    steps = []
    for step in range(4):  # across the end of warmup
        x, _, dy = _batch(30 + step, batch=4, seq=6, dtype=torch.float32)
        mask = torch.ones(4, 6, dtype=torch.long)
        mask[1, 2:] = 0
        mask[3, 4:] = 0
        steps.append((x, mask, dy))
    torch.save(steps, tmp_path / "steps.pt")
    script = tmp_path / "worker.py"
    script.write_text(_SYNC_WORKER)
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), "2", port, str(tmp_path / "steps.pt"),
                          str(tmp_path / f"rank{rank}.pt")])
        for rank in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    single = PowerNorm(12, warmup_steps=2, group_num=4)
    for x, mask, dy in steps:
        single(x, mask).backward(dy)
    for key in ("running_phi", "running_nu", "num_batches_tracked"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        torch.testing.assert_close(ranks[0][key], single.state_dict()[key], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ranks[0]["running_nu"], torch.zeros(12))


# ----------------------------------------------------------------------------------------------
# Fused CPU kernels agree with the eager implementation


def test_fused_cpu_kernels_are_built_here():
    from hf_powernorm import kernels_cpu

    assert kernels_cpu.load() is not None, "a C compiler is expected on this machine"


@pytest.mark.parametrize("statistic, ramp", WARMUP_VARIANTS)
@pytest.mark.parametrize("denominator", ["running", "batch"])
@pytest.mark.parametrize("groups", [None, 1, GROUPS])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_kernels_match_eager(denominator, groups, padded, statistic, ramp, use_torch_ops):
    """The C kernels (training steps, their statistics and updates taken in C, the eval map) against
    the torch ops, across warmup, ramp and running statistic, with a batch without real tokens and a
    non-finite one among them."""
    results = []
    for fused in (True, False):
        if not fused:
            use_torch_ops()
        norm = PowerNorm(HIDDEN, warmup_steps=2, group_num=groups, backward_denominator=denominator,
                         warmup_statistic=statistic, warmup_ramp_steps=ramp)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
            norm.bias.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(1))
        trace = []
        for step in range(8):  # warmup, ramp (if any), running statistic; step 3 has no real token, 5 a NaN
            x, mask, dy = _batch(20 + step, dtype=torch.float32)
            mask = torch.zeros_like(mask) if step == 3 else mask if padded else None
            if step == 5:
                x[0, 0, 1] = float("nan")
            y = _training_step(norm, x, mask, dy)
            trace.append((y.detach(), x.grad, norm.weight.grad.clone(), norm.bias.grad.clone(),
                          norm.running_phi.clone(), norm.running_nu.clone(), norm.num_batches_tracked.clone()))
        with torch.no_grad():
            trace.append((norm.eval()(x.detach().nan_to_num(), mask),))
        results.append(trace)
    for fused_step, eager_step in zip(*results):
        for a, b in zip(fused_step, eager_step):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("name, options", [("powernorm_v", {}), ("powernorm_v", {"group_num": GROUPS}),
                                           ("rmsnorm", {}), ("rmsnorm", {"eps": 0.5}), ("batchnorm", {}),
                                           ("batchrenorm", {"rmax": 1.2, "dmax": 0.3}), ("mabn", _options("mabn"))])
def test_other_norms_in_c_kernels_match_their_torch_ops(name, options, use_torch_ops):
    """PN-V, BN and BRN (exact gradients through the batch statistics), MABN and RMSNorm in the C
    kernels against their torch ops: outputs, gradients and buffers, with a batch without real tokens
    and a non-finite one."""
    results = []
    for fused in (True, False):
        if not fused:
            use_torch_ops()
        norm = build_norm(name, HIDDEN, **options)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
        trace = []
        for step in range(5):
            x, mask, dy = _batch(50 + step, dtype=torch.float32)
            mask = torch.zeros_like(mask) if step == 2 else mask
            if step == 3:
                x[0, 0, 1] = float("nan")
            y = _training_step(norm, x, mask, dy)
            trace.append((y.detach(), x.grad, *(p.grad.clone() for p in norm.parameters()),
                          *(b.clone() for b in norm.buffers())))
        results.append(trace)
    for step, (fused_step, eager_step) in enumerate(zip(*results)):
        for a, b in zip(fused_step, eager_step):
            if step == 3:  # the NaN input: the torch ops' gradient is NaN in more places (0 * NaN through
                # the unused batch statistic), never in fewer; elsewhere the two agree
                assert (torch.isfinite(b) <= torch.isfinite(a)).all()
                a, b = a[torch.isfinite(b)], b[torch.isfinite(b)]
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("groups", [None, GROUPS])
def test_powernorm_step_with_streaming_stores_matches_eager(monkeypatch, groups, use_torch_ops):
    """PN's C step with every output and input gradient written by streaming stores (what tensors of
    `kernels_cpu.STREAM_BYTES` and more get) against the torch ops, warmup and running statistic."""
    import hf_powernorm.kernels_cpu as kernels_cpu
    monkeypatch.setattr(kernels_cpu, "STREAM_BYTES", 0)
    results = []
    for fused in (True, False):
        if not fused:
            use_torch_ops()
        norm = PowerNorm(64, warmup_steps=1, group_num=groups)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
        trace = []
        for step in range(3):
            x, mask, dy = _batch(60 + step, hidden=64, dtype=torch.float32)
            y = _training_step(norm, x, mask, dy)
            trace.append((y.detach(), x.grad, norm.weight.grad.clone(), norm.running_phi.clone(),
                          norm.running_nu.clone()))
        results.append(trace)
    for fused_step, eager_step in zip(*results):
        for a, b in zip(fused_step, eager_step):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _c_and_torch_traces(make_norm, batches, evaluate: bool = False) -> list[tuple]:
    """`make_norm()` trained on `batches` in the C kernels, then a fresh one in the torch ops: per
    step the output, input gradient, parameter gradients and buffers, and with `evaluate` the eval
    output of the last batch; the two traces, step by step."""
    results = []
    for backend in ("c", "torch"):
        with kernel_backend(backend):
            norm = make_norm()
            trace = []
            for x, mask, dy in batches:
                x = x.clone()  # a leaf of this pass's own
                y = _training_step(norm, x, mask, dy)
                trace.append((y.detach(), x.grad, *(p.grad.clone() for p in norm.parameters()),
                              *(b.clone() for b in norm.buffers())))
            if evaluate:
                norm.eval()
                with torch.no_grad():
                    trace.append((norm(x, mask),))
        results.append(trace)
    return list(zip(*results))


@pytest.mark.parametrize("name", ["powernorm", "powernorm_v", "batchnorm", "batchrenorm", "mabn", "rmsnorm"])
def test_c_steps_on_several_threads_match_eager(name):
    """The C kernels start one thread per `TEAM_FLOATS` floats at most (a decoding step's few tokens
    run on one): a batch large enough for three threads, trained and evaluated, against the torch ops
    (the per-thread sums merged, padding and warmup included)."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        batches = [_batch(120 + step, batch=8, seq=64, hidden=256, dtype=torch.float32) for step in range(3)]
        steps = _c_and_torch_traces(lambda: build_norm(name, 256), batches, evaluate=True)
    finally:
        torch.set_num_threads(previous)
    for fused_step, eager_step in steps:
        for a, b in zip(fused_step, eager_step):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["batchnorm", "batchrenorm", "powernorm_v"])
def test_batch_statistic_steps_with_streaming_stores_match_eager(monkeypatch, name):
    """BN's, BRN's and PN-V's C steps with streamed outputs and input gradients against the torch ops."""
    import hf_powernorm.kernels_cpu as kernels_cpu

    monkeypatch.setattr(kernels_cpu, "STREAM_BYTES", 0)
    batches = [_batch(65 + step, hidden=64, dtype=torch.float32) for step in range(2)]
    for fused_step, eager_step in _c_and_torch_traces(lambda: build_norm(name, 64), batches):
        for a, b in zip(fused_step, eager_step):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_powernorm_step_in_c_reads_every_mask_dtype_alike():
    """The C step reads an int64, bool or uint8 mask as it is and converts others: the same step."""
    results = []
    for dtype in (torch.long, torch.bool, torch.uint8, torch.int32, torch.float32):
        norm = PowerNorm(HIDDEN, warmup_steps=1, group_num=GROUPS)
        trace = []
        for step in range(3):  # warmup, then the running statistic
            x, mask, dy = _batch(90 + step, dtype=torch.float32)
            y = _training_step(norm, x, (mask * (step + 2)).to(dtype), dy)  # nonzero = real, whatever value
            trace.append((y.detach(), x.grad, norm.weight.grad.clone(), norm.running_phi.clone(),
                          norm.running_nu.clone()))
        results.append(trace)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            for u, v in zip(a, b):
                assert torch.equal(u, v)


def _int32_counter_trace(name: str, dtype, backend: str, junk: int = 0) -> list[tuple]:
    """`name` in `dtype` with its step counter assigned as int32 (a view of the first of two int32s,
    the second a sentinel that a read or write past the counter would take in or change), trained on
    `backend` through warmup, an all-padding batch and a non-finite one, then evaluated: per step the
    output, input and parameter gradients, buffers (the counter with its dtype) and the sentinel.
    `junk` allocations before it vary what lies around the buffers."""
    keep = [torch.full((1000 + 77 * junk,), 123456789 + junk, dtype=torch.int32) for _ in range(20)]
    with kernel_backend(backend):
        norm = build_norm(name, HIDDEN, **(dict(warmup_steps=2) if name == "powernorm" else _options(name)))
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
        norm = norm.to(dtype)
        storage = torch.tensor([0, -1], dtype=torch.int32)
        norm.num_batches_tracked = storage[0]
        trace = []
        for step in range(5):
            x, mask, dy = _batch(140 + step, dtype=dtype)
            mask = torch.zeros_like(mask) if step == 2 else mask
            if step == 3:
                x[0, 0, 1] = float("nan")
            y = _training_step(norm, x, mask, dy)
            trace.append((y.detach(), x.grad, *(p.grad.clone() for p in norm.parameters()),
                          *(b.clone() for b in norm.buffers()), norm.num_batches_tracked.clone(), storage.clone()))
        norm.eval()
        with torch.no_grad():
            trace.append((norm(x.detach().nan_to_num(), mask),))
    del keep
    return trace


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", BATCH_NORMS)
def test_int32_step_counter_trains_as_the_torch_ops(name, dtype):
    """A step counter assigned as int32 (a state dict loaded by assignment) is never handed to the C
    kernels, which read and write it as int64: the step runs in the torch ops, the same outputs,
    gradients and buffers (the counter int32, counting the usable batches) as the torch ops, the
    same bits on every run whatever lies around it."""
    runs = [_int32_counter_trace(name, dtype, "auto", junk) for junk in range(2)]
    eager = _int32_counter_trace(name, dtype, "torch")
    for step, (first, second, torch_ops) in enumerate(zip(*runs, eager)):
        for a, b, c in zip(first, second, torch_ops):
            assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
            if step == 3:  # the NaN input: the torch ops' gradient is NaN in more places, never in fewer
                assert (torch.isfinite(c) <= torch.isfinite(a)).all()
                a, c = a[torch.isfinite(c)], c[torch.isfinite(c)]
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, equal_nan=True)
    counter, sentinel = runs[0][-2][-2], runs[0][-2][-1]
    assert counter.dtype == torch.int32 and int(counter) == 3  # steps 2 (no real token) and 3 (NaN) not counted
    assert sentinel.tolist() == [3, -1]


@pytest.mark.parametrize("name", ["batchnorm", "batchrenorm"])
def test_batch_norm_in_c_kernels_is_differentiable_twice_like_the_torch_ops(name, use_torch_ops):
    """create_graph=True through BN's and BRN's C step takes the torch ops' gradient: the same
    second derivative."""
    results = []
    for fused in (True, False):
        if not fused:
            use_torch_ops()
        norm = build_norm(name, HIDDEN)
        x, mask, dy = _batch(95, dtype=torch.float32)
        x.requires_grad_(True)
        (grad,) = torch.autograd.grad((norm(x, mask) * dy).sum(), x, create_graph=True)
        grad.square().sum().backward()
        results.append((grad.detach(), x.grad, norm.weight.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


EVAL_MAP_CASES = [("powernorm", {"group_num": GROUPS}), ("powernorm", {"group_num": None}),
                  ("powernorm_v", {"group_num": GROUPS}), ("batchnorm", {}), ("batchrenorm", {}), ("mabn", {}),
                  ("rmsnorm", {}), ("rmsnorm", {"eps": 0.5})]


def _trained_for_eval(name: str, options: dict, hidden: int = HIDDEN):
    """A norm with random parameters and running statistics moved by three training steps, in eval."""
    norm = build_norm(name, hidden, **options)
    with torch.no_grad():
        for parameter in norm.parameters():
            parameter.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    for step in range(3 if "num_batches_tracked" in norm.state_dict() else 0):
        x, mask, dy = _batch(70 + step, hidden=hidden, dtype=torch.float32)
        _training_step(norm, x, mask, dy)
    return norm.eval()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name, options", EVAL_MAP_CASES)
def test_eval_map_in_c_matches_the_torch_ops(monkeypatch, name, options, stream, use_torch_ops):
    """The eval forward in one C pass (`norm_eval`: scale and shift from the parameters and running
    statistics as they are, streaming stores for large outputs) against the torch ops: the output
    without and with grad (the same bits both ways), and the gradients of input and parameters."""
    import hf_powernorm.kernels_cpu as kernels_cpu
    if stream:  # every output streamed; 64 channels in 4 groups suit every vector width
        monkeypatch.setattr(kernels_cpu, "STREAM_BYTES", 0)
    hidden = 64 if stream else HIDDEN
    x, mask, dy = _batch(80, hidden=hidden, dtype=torch.float32)
    results = []
    for fused in (True, False):
        if not fused:
            use_torch_ops()
        norm = _trained_for_eval(name, options, hidden)
        with torch.no_grad():
            no_grad = norm(x, mask)
        leaf = x.clone().requires_grad_(True)
        y = norm(leaf, mask)
        y.backward(dy)
        results.append((no_grad, y.detach(), leaf.grad, *(p.grad for p in norm.parameters())))
        if fused:
            assert torch.equal(no_grad, y.detach())  # with and without grad: the same C pass
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["powernorm", "batchnorm", "rmsnorm"])
def test_eval_map_reads_the_parameters_as_they_are_now(name):
    """Nothing is cached: a parameter or statistic changed in place (by an optimizer, a load, `.data`)
    changes the next eval output."""
    norm = _trained_for_eval(name, {})
    x = _batch(81, dtype=torch.float32)[0]
    with torch.no_grad():
        before = norm(x)
        norm.weight.data.mul_(2.0)
        after = norm(x)
        bias = getattr(norm, "bias", None)
        expected = 2.0 * (before - bias) + bias if bias is not None else 2.0 * before
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


def test_eval_map_gradient_is_differentiable_in_turn():
    norm = _trained_for_eval("powernorm", {"group_num": GROUPS}).double()
    x = _batch(82)[0].requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda x: norm(x), (x,))
    norm = _trained_for_eval("powernorm", {"group_num": GROUPS})
    x = _batch(82, dtype=torch.float32)[0].requires_grad_(True)
    (grad,) = torch.autograd.grad(norm(x).square().sum(), x, create_graph=True)
    grad.sum().backward()
    assert torch.isfinite(x.grad).all()


# ----------------------------------------------------------------------------------------------
# Eval outputs where eps matters, and eval group scaling checked by its invariance


def _eval_group_scale_float64(x: torch.Tensor, groups: int | None) -> torch.Tensor:
    """Per token, each of `groups` channel groups divided by sqrt(its mean square + 1e-5)."""
    if groups is None:
        return x
    parts = x.unflatten(-1, (groups, -1))
    return (parts / (parts.square().mean(-1, keepdim=True) + 1e-5).sqrt()).flatten(-2)


def _eval_norm_with_statistic(name: str, groups: int | None, eps: float, low: float, high: float):
    """A norm in eval with random weight, bias and a running statistic drawn from [low, high]."""
    options = {} if name == "batchnorm" else {"group_num": groups}
    norm = build_norm(name, 12, eps=eps, **options)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(12, generator=gen) + 0.5)
        norm.bias.copy_(torch.rand(12, generator=gen) - 0.5)
        statistic = low + (high - low) * torch.rand(12, generator=gen)
        if name == "batchnorm":
            norm.running_var.copy_(statistic)
            norm.running_mean.copy_(torch.randn(12, generator=gen))
        else:
            norm.running_phi.copy_(statistic)
    return norm.eval()


@pytest.mark.parametrize("eps, low, high", [(1e-2, 0.5, 2.0), (1e-5, 1e-4, 4e-4)])
@pytest.mark.parametrize("name, groups", [
    ("powernorm", 4), ("powernorm", None), ("powernorm_v", 4), ("powernorm_v", None), ("batchnorm", None),
])
def test_eval_output_matches_the_formula_where_eps_is_not_negligible(name, groups, eps, low, high):
    """eps is 0.5-10% of the running statistic here: an eval forward that drops eps (or puts it
    elsewhere) is off by far more than the tolerance, unlike with eps 1e-5 and a statistic near 1."""
    norm = _eval_norm_with_statistic(name, groups, eps, low, high)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 12, generator=gen, dtype=torch.float64) * 2 + 0.5
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[0, 3:] = 0
    weight, bias = norm.weight.double(), norm.bias.double()
    if name == "batchnorm":
        centred, statistic = x - norm.running_mean.double(), norm.running_var.double()
    else:
        centred, statistic = _eval_group_scale_float64(x, groups), norm.running_phi.double()
    expected = weight * centred / (statistic + eps).sqrt() + bias
    without_eps = weight * centred / statistic.sqrt() + bias
    tolerance = dict(rtol=1e-5, atol=1e-5)
    assert (without_eps - expected).abs().max() > 100 * tolerance["atol"]  # the check has the power
    torch.testing.assert_close(norm(x.float(), mask).double(), expected, **tolerance)
    torch.testing.assert_close(norm(x[1:].float()).double(), expected[1:], **tolerance)  # no batch dependence


@pytest.mark.parametrize("name", ["powernorm", "powernorm_v"])
def test_eval_group_scaling_divides_out_each_groups_own_scale(name):
    """A second guard for eval group scaling, with no reference formula: scaling one channel group of
    one token by c leaves every output unchanged; scaling part of a group does not; without group
    scaling the same change of scale shows in the output."""
    x = torch.randn(2, 4, 12, generator=torch.Generator().manual_seed(2)) * 2 + 0.5
    grouped = _eval_norm_with_statistic(name, 4, 1e-5, 0.5, 2.0)
    ungrouped = _eval_norm_with_statistic(name, None, 1e-5, 0.5, 2.0)
    whole_group, part_of_group = x.clone(), x.clone()
    whole_group[1, 2, 3:6] *= 7.0  # channels 3-5: the second of four groups
    part_of_group[1, 2, 3:5] *= 7.0
    with torch.no_grad():
        torch.testing.assert_close(grouped(whole_group), grouped(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(grouped(part_of_group)[1, 2], grouped(x)[1, 2], rtol=1e-2, atol=1e-2)
        assert not torch.allclose(ungrouped(whole_group)[1, 2], ungrouped(x)[1, 2], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(ungrouped(whole_group)[0], ungrouped(x)[0])  # other tokens untouched


# ----------------------------------------------------------------------------------------------
# The kernel cache: private, and a library is loaded only with a matching record


def _fresh_kernels(monkeypatch, cache):
    from hf_powernorm import kernels_cpu

    monkeypatch.setenv("HF_POWERNORM_CACHE", str(cache))
    monkeypatch.delenv("HF_POWERNORM_KERNELS", raising=False)
    monkeypatch.setattr(kernels_cpu, "_tried", False)
    monkeypatch.setattr(kernels_cpu, "_library", None)
    return kernels_cpu


def test_kernel_cache_is_private_and_records_the_hash_of_source_and_flags(monkeypatch, tmp_path):
    import json
    import stat

    kernels_cpu = _fresh_kernels(monkeypatch, tmp_path / "new" / "kernels")
    assert kernels_cpu.load() is not None
    cache = tmp_path / "new" / "kernels"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (library,) = cache.glob("*.so")
    record = json.loads(library.with_suffix(".json").read_text())
    assert record["source_and_flags"] == kernels_cpu._source_digest()
    assert record["library"] == kernels_cpu._file_digest(library)
    # An existing cache folder of ours that others can read becomes private.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    kernels_cpu._private_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700


@pytest.mark.parametrize("tamper", ["library", "record_missing", "record_of_other_source"])
def test_a_library_without_a_matching_record_is_never_loaded(monkeypatch, tmp_path, tamper):
    import json

    kernels_cpu = _fresh_kernels(monkeypatch, tmp_path)
    assert kernels_cpu.load() is not None
    (library,) = tmp_path.glob("*.so")
    record = library.with_suffix(".json")
    if tamper == "library":
        # A new file in its place: writing into the loaded library's own pages would crash this process.
        tampered = library.with_suffix(".tampered")
        tampered.write_bytes(library.read_bytes() + b"\0")
        os.replace(tampered, library)
    elif tamper == "record_missing":
        record.unlink()
    else:
        record.write_text(json.dumps({**json.loads(record.read_text()), "source_and_flags": "0" * 64}))
    kernels_cpu = _fresh_kernels(monkeypatch, tmp_path)
    builds = []

    def refuse_to_build(target):
        builds.append(target)
        raise RuntimeError("no build in this test")

    monkeypatch.setattr(kernels_cpu, "_compile", refuse_to_build)
    loaded = []
    monkeypatch.setattr(kernels_cpu.ctypes, "CDLL", lambda path: loaded.append(path))
    assert kernels_cpu.load() is None  # the file of the expected name was rebuilt, not loaded
    assert builds == [library] and loaded == []


def _cache_with_library(monkeypatch, cache):
    """A fresh `kernels_cpu` on `cache`, which holds a copy of the built C library and its record (no compile)."""
    import shutil

    from hf_powernorm import kernels_cpu

    assert kernels_cpu.load() is not None
    name = f"powernorm_cpu_{kernels_cpu._source_digest()[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    for suffix in (".so", ".json"):
        shutil.copyfile(kernels_cpu._cache_dir() / (name + suffix), cache / (name + suffix))
    return _fresh_kernels(monkeypatch, cache), cache / f"{name}.so"


def _refuse_builds_and_record_loads(monkeypatch, kernels_cpu):
    builds, loaded = [], []

    def refuse_to_build(target):
        builds.append(target)
        raise RuntimeError("no build in this test")

    monkeypatch.setattr(kernels_cpu, "_compile", refuse_to_build)
    monkeypatch.setattr(kernels_cpu.ctypes, "CDLL", lambda path: loaded.append(path))
    return builds, loaded


def test_a_cache_folder_made_private_loses_the_files_planted_before(monkeypatch, tmp_path):
    """A library and a matching record written while the folder was group-writable are removed when it
    is made 0700, and so never loaded; a file the cache did not name is left alone."""
    import stat

    kernels_cpu, library = _cache_with_library(monkeypatch, tmp_path / "shared")
    (tmp_path / "shared" / "notes.txt").write_text("not the cache's")
    (tmp_path / "shared").chmod(0o770)
    builds, loaded = _refuse_builds_and_record_loads(monkeypatch, kernels_cpu)
    assert kernels_cpu.load() is None
    assert builds == [library] and loaded == []
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o700
    left = sorted(path.name for path in (tmp_path / "shared").iterdir())
    assert left == ["notes.txt", library.with_suffix(".lock").name]  # the lock of the refused build


@pytest.mark.parametrize("plant", ["library_link", "record_link", "another_owner"])
def test_only_regular_files_of_this_user_are_trusted(monkeypatch, tmp_path, plant):
    """A library or a record that is a link (to a file that would pass the hash check) or belongs to
    another user is not trusted."""
    kernels_cpu, library = _cache_with_library(monkeypatch, tmp_path / "elsewhere")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    for path in (library, library.with_suffix(".json")):
        linked = plant == "library_link" and path == library or plant == "record_link" and path != library
        if linked:
            (cache / path.name).symlink_to(path)
        else:
            os.replace(path, cache / path.name)
    library = cache / library.name
    if plant == "another_owner":
        monkeypatch.setattr(kernels_cpu.os, "getuid", lambda: os.stat(library).st_uid + 1)
        assert not kernels_cpu._trusted(library)
        return
    assert not kernels_cpu._trusted(library)
    kernels_cpu = _fresh_kernels(monkeypatch, cache)
    builds, loaded = _refuse_builds_and_record_loads(monkeypatch, kernels_cpu)
    assert kernels_cpu.load() is None and builds == [library] and loaded == []


def test_the_library_loaded_is_the_file_whose_hash_was_checked(monkeypatch, tmp_path):
    """A file swapped in after the hash check is not the one loaded: the loader reads the open file."""
    import ctypes
    import pathlib

    kernels_cpu, library = _cache_with_library(monkeypatch, tmp_path)
    checked, seen, real = library.read_bytes(), [], ctypes.CDLL

    def swap_then_load(path):
        planted = library.with_suffix(".planted")
        planted.write_bytes(b"planted")
        os.replace(planted, library)
        seen.append(pathlib.Path(path).read_bytes())
        return real(path)

    monkeypatch.setattr(kernels_cpu.ctypes, "CDLL", swap_then_load)
    assert kernels_cpu.load() is not None
    assert seen == [checked]


def test_without_proc_a_swap_while_loading_is_refused(monkeypatch, tmp_path, caplog):
    """Where no `/proc/self/fd` exists the library is loaded by path, and a path naming another file
    after loading is refused (the kernels then not used)."""
    kernels_cpu, library = _cache_with_library(monkeypatch, tmp_path)
    monkeypatch.setattr(kernels_cpu, "_descriptor_path", lambda descriptor: None)

    def load_then_swap(path):
        planted = library.with_suffix(".planted")
        planted.write_bytes(b"planted")
        os.replace(planted, library)

    monkeypatch.setattr(kernels_cpu.ctypes, "CDLL", load_then_swap)
    with caplog.at_level("WARNING", logger="hf_powernorm.kernels_cpu"):
        assert kernels_cpu.load() is None
    assert "was replaced while it was loaded" in caplog.text


def test_the_build_lock_is_never_opened_through_a_link(monkeypatch, tmp_path, caplog):
    """A `.lock` planted as a link is refused, naming it; its target is neither created nor opened."""
    kernels_cpu = _fresh_kernels(monkeypatch, tmp_path / "cache")
    (tmp_path / "cache").mkdir(mode=0o700)
    lock = tmp_path / "cache" / f"powernorm_cpu_{kernels_cpu._source_digest()[:16]}.lock"
    lock.symlink_to(tmp_path / "victim")
    builds, _ = _refuse_builds_and_record_loads(monkeypatch, kernels_cpu)
    with caplog.at_level("WARNING", logger="hf_powernorm.kernels_cpu"):
        assert kernels_cpu.load() is None
    assert builds == [] and not (tmp_path / "victim").exists()
    assert f"{lock} is a symbolic link" in caplog.text


def test_two_processes_on_an_empty_cache_build_the_library_once(tmp_path):
    """Two processes that start together on an empty cache: one compiles, the other waits on the build
    lock and loads what the first built (one library, both processes on the kernels). The lock and the
    wait are `_built`'s, which the C++ operator's build shares."""
    code = ("import hf_powernorm.kernels_cpu as k; compile_library = k._compile; "
            "k._compile = lambda target: (print('compiling', flush=True), compile_library(target))[1]; "
            "print('library', k.load() is not None)")
    environment = {**os.environ, "HF_POWERNORM_CACHE": str(tmp_path / "cache")}
    processes = [subprocess.Popen([sys.executable, "-c", code], env=environment, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert all("library True" in output for output in outputs), outputs
    assert sum(output.count("compiling") for output in outputs) == 1, outputs
    assert len(list((tmp_path / "cache").glob("powernorm_cpu_*.so"))) == 1


@pytest.mark.parametrize("mode, usable", [(0o777, False), (0o775, False), (0o1777, True), (0o755, True)])
def test_a_cache_under_a_folder_others_can_write_is_refused(monkeypatch, tmp_path, caplog, mode, usable):
    """Another user could rename the cache away from under a parent they can write (unless it is sticky,
    as /tmp is): the kernels are then not used, with a warning naming that parent."""
    parent = tmp_path / "parent"
    kernels_cpu, _ = _cache_with_library(monkeypatch, parent / "kernels")
    parent.chmod(mode)
    with caplog.at_level("WARNING", logger="hf_powernorm.kernels_cpu"):
        assert (kernels_cpu.load() is not None) == usable
    if not usable:
        assert f"lies in {parent}, which others can write" in caplog.text


def _kernel_importers() -> set[str]:
    """The package's files (by path below it) that import `kernels_cpu` or `kernels_triton`."""
    import ast
    from pathlib import Path

    import hf_powernorm

    root, kernels, found = Path(hf_powernorm.__file__).parent, {"kernels_cpu", "kernels_triton"}, set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {alias.name.rsplit(".", 1)[-1] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").rsplit(".", 1)[-1], *(alias.name for alias in node.names)}
            else:
                continue
            if names & kernels:
                found.add(path.relative_to(root).as_posix())
    return found


def test_only_the_dispatch_module_imports_the_kernels():
    """What a norm computes (`normalization.py`) apart from how it runs (`norm_dispatch.py`, the one
    file that imports the C and Triton kernels); the dispatch module imports nothing of the norms."""
    import ast
    from pathlib import Path

    import hf_powernorm

    assert _kernel_importers() == {"norm_dispatch.py"}
    source = (Path(hf_powernorm.__file__).parent / "norm_dispatch.py").read_text()
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)}
    assert "normalization" not in imported and imported >= {"kernels_cpu", "kernels_triton"}
