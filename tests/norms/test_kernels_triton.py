"""PN's Triton kernels (`kernels_triton.py`, the CUDA implementation of the `hf_powernorm::pn_step_*`
operators) and DyT's and Derf's run through Triton's interpreter (`TRITON_INTERPRET=1`) on CPU
tensors, against float64 references and the torch ops, at small odd shapes; skipped where Triton is
not installed. The tests named `cuda` run on a CUDA device only, without the interpreter; without a
GPU, every kernel is also compiled for one (sm_90) through Triton's compiler, which catches what
the interpreter lets through (types that change in a loop, say).

Triton reads `TRITON_INTERPRET` when it is imported (its own library functions are built then), and
the package imports it with `norm_dispatch.py`: so, unless this process was started with it, one
test runs this file in a fresh process that is.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

HIDDEN, GROUPS = 12, 4
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.skipif(INTERPRETED, reason="this process runs the kernel tests itself")
def test_kernels_through_the_interpreter_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider",
               "-k", "not fresh_process and not cuda", __file__]
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout and " skipped" not in run.stdout, run.stdout


# Each kernel with constexprs of a real launch (hidden 512, G = 4): compiled for an H100 (sm_90)
# without a GPU, through Triton's own compiler down to the cubin, which the interpreter never runs.
AOT_KERNELS = [
    ("_forward_sums", {"G": 4, "GROUPED": True, "HAS_MASK": True, "BLOCK_T": 8, "GP": 4, "KP": 128}),
    ("_forward_statistics", {"REFERENCE": True, "BATCH_BACKWARD": False, "BLOCK_C": 512, "BLOCK_P": 16}),
    ("_forward_output", {"G": 4, "GROUPED": True, "BLOCK_T": 8, "GP": 4, "KP": 128}),
    ("_backward_sums", {"G": 4, "GROUPED": False, "HAS_MASK": False, "BLOCK_T": 8, "GP": 1, "KP": 512}),
    ("_backward_statistics", {"BLOCK_C": 512, "BLOCK_P": 16}),
    ("_elementwise_forward", {"ERF": False, "HAS_SHIFT": False, "BLOCK_T": 8, "BLOCK_C": 512}),
    ("_elementwise_forward", {"ERF": True, "HAS_SHIFT": True, "BLOCK_T": 8, "BLOCK_C": 512}),
    ("_elementwise_backward_sums", {"ERF": False, "HAS_SHIFT": False, "NEED_DX": True, "BLOCK_T": 8, "BLOCK_C": 512}),
    ("_elementwise_backward_sums", {"ERF": True, "HAS_SHIFT": True, "NEED_DX": False, "BLOCK_T": 8, "BLOCK_C": 512}),
    ("_elementwise_backward_statistics", {"BLOCK_C": 512, "BLOCK_P": 16}),
]
# a bfloat16 model's DyT / Derf: its tensors as they are
BF16 = {"x_ptr": "*bf16", "y_ptr": "*bf16", "dy_ptr": "*bf16", "dx_ptr": "*bf16", "alpha_ptr": "*bf16",
        "shift_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16"}
AOT_KERNELS = [(name, constants, {}) for name, constants in AOT_KERNELS] + [
    ("_elementwise_forward", {"ERF": True, "HAS_SHIFT": True, "BLOCK_T": 8, "BLOCK_C": 512}, BF16),
    ("_elementwise_backward_sums", {"ERF": False, "HAS_SHIFT": False, "NEED_DX": True, "BLOCK_T": 8, "BLOCK_C": 512},
     BF16),
    ("_elementwise_backward_statistics", {"BLOCK_C": 512, "BLOCK_P": 16}, BF16),
]
FLOAT_ARGUMENTS = {"group_eps", "eps", "warmup", "ramp", "ema_rate", "rate"}
INTEGER_POINTERS = {"mask_ptr", "counter_ptr"}


@pytest.mark.skipif(INTERPRETED, reason="the interpreter replaces the compiler")
@pytest.mark.parametrize("name, constants, pointers", AOT_KERNELS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(AOT_KERNELS)])
def test_triton_kernels_compile_to_a_cuda_binary_without_a_gpu(monkeypatch, tmp_path, name, constants, pointers):
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    import hf_powernorm.kernels_triton as module

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = getattr(module, name)

    def kind(name: str) -> str:
        if name in pointers:
            return pointers[name]
        if name.endswith("_ptr"):
            return "*i64" if name in INTEGER_POINTERS else "*fp32"
        return "fp32" if name in FLOAT_ARGUMENTS else "i32"

    signature = {p.name: "constexpr" if p.is_constexpr else kind(p.name) for p in kernel.params}
    assert {n for n, kind in signature.items() if kind == "constexpr"} == set(constants)
    built = compiler.compile(compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants),
                             target=GPUTarget("cuda", 90, 32), options=module.LAUNCH)
    assert f".entry {name}" in built.asm["ptx"] and len(built.asm["cubin"]) > 1000


@pytest.fixture(scope="module")
def kernels():
    if not INTERPRETED:
        pytest.skip("run through the interpreter by test_kernels_through_the_interpreter_in_a_fresh_process")
    import hf_powernorm.kernels_triton as module

    return module


def _batch(seed: int, tokens: int = 13, hidden: int = HIDDEN, dtype=torch.float32, padded: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen, dtype=torch.float64) * 2 + 0.5)
    dy = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    mask = torch.ones(tokens, dtype=torch.long)
    if padded:
        mask[tokens - 4:] = 0
    return x.to(dtype), mask if padded else None, dy.to(dtype)


class _Buffers:
    def __init__(self, hidden: int):
        self.phi, self.nu = torch.ones(hidden), torch.zeros(hidden)
        self.counter = torch.zeros((), dtype=torch.long)
        self.weight = torch.linspace(0.5, 1.5, hidden)
        self.bias = torch.linspace(-0.2, 0.3, hidden)


def _triton_step(kernels, buffers, x, mask, dy, groups, warmup, ramp, statistic, denominator, group_eps=1e-5):
    y, stats, info = kernels.pn_step_forward(x, mask, buffers.weight.to(x.dtype), buffers.bias.to(x.dtype),
                                             buffers.phi, buffers.counter, groups or 0, 1e-5, warmup, ramp, 0.9,
                                             statistic == "reference", denominator == "batch", group_eps)
    dx, grads = kernels.pn_step_backward(dy, x, mask, buffers.weight.to(x.dtype), buffers.nu, stats, info,
                                         groups or 0, 0.9, group_eps)
    return y, dx, grads.float(), stats, info


@pytest.mark.parametrize("statistic, ramp, denominator, groups, padded", [
    ("cumulative", 0, "running", None, True), ("reference", 2, "batch", GROUPS, True),
    ("reference", 0, "running", GROUPS, False), ("cumulative", 2, "batch", None, False)])
def test_triton_step_matches_the_float64_reference_across_warmup(kernels, statistic, ramp, denominator, groups,
                                                                 padded):
    from test_normalization import ReferencePN

    buffers = _Buffers(HIDDEN)
    reference = ReferencePN(HIDDEN, warmup=2, groups=groups, denominator=denominator, statistic=statistic, ramp=ramp)
    gamma, beta = buffers.weight.double(), buffers.bias.double()
    for step in range(6):  # warmup, ramp (if any), running statistic
        x, mask, dy = _batch(step, padded=padded)
        y, dx, grads, _, info = _triton_step(kernels, buffers, x, mask, dy, groups, 2, ramp, statistic, denominator)
        real = torch.ones(x.shape[0], dtype=torch.bool) if mask is None else mask.bool()
        want_y, want_dx, want_dgamma, want_dbeta = reference.step(x.double(), real, dy.double(), gamma, beta)
        close = dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(y.double(), want_y, **close, msg=f"step {step}: y")
        torch.testing.assert_close(dx.double(), want_dx, **close, msg=f"step {step}: dx")
        torch.testing.assert_close(grads[0].double(), want_dgamma, **close)
        torch.testing.assert_close(grads[1].double(), want_dbeta, **close)
        torch.testing.assert_close(buffers.phi.double(), reference.phi, **close)
        torch.testing.assert_close(buffers.nu.double(), reference.nu, **close)
        assert int(buffers.counter) == step + 1 and info.tolist() == [float(real.sum()), 1.0, 0.0]


@pytest.mark.parametrize("groups", [1, GROUPS])
def test_triton_step_honours_group_eps(kernels, groups):
    """Group scaling's epsilon of a converted RMSNorm (1e-6) on inputs small enough that it matters:
    the float64 reference at that epsilon, not at the default."""
    from test_normalization import ReferencePN

    buffers = _Buffers(HIDDEN)
    reference, default = (ReferencePN(HIDDEN, warmup=1, groups=groups, statistic="reference", group_eps=eps)
                          for eps in (1e-6, 1e-5))
    for step in range(3):
        x, mask, dy = _batch(90 + step)
        x = x * 3e-3
        y, dx, grads, _, _ = _triton_step(kernels, buffers, x, mask, dy, groups, 1, 0, "reference", "running", 1e-6)
        args = (x.double(), mask.bool(), dy.double(), buffers.weight.double(), buffers.bias.double())
        want, at_default = reference.step(*args), default.step(*args)
        for got, expected in zip((y, dx, grads[0], grads[1]), want):
            atol = 1e-6 * max(1.0, float(expected.abs().max()))  # float32 rounding, to each figure's scale
            torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=atol)
        torch.testing.assert_close(buffers.phi.double(), reference.phi, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(buffers.nu.double(), reference.nu, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(dx.double(), at_default[1], rtol=1e-2)  # the epsilon moves the step


@pytest.mark.parametrize("tokens, hidden, groups", [(1, 12, 4), (37, 32, 4), (300, 20, None), (7, 96, 3)])
def test_triton_step_matches_the_operators_torch_ops_at_odd_shapes(kernels, tokens, hidden, groups):
    """Several tiles and programs (300 tokens), one token, group widths that are not powers of two."""
    from hf_powernorm import norm_dispatch

    options = (1e-5, 1, 0, 0.9, True, False, 1e-5)  # eps, warmup, ramp, alpha_fwd, reference, batch backward,
    # group_eps
    ours, theirs = _Buffers(hidden), _Buffers(hidden)
    for step in range(3):
        x, mask, dy = _batch(40 + step, tokens, hidden, padded=tokens > 4)
        y, dx, grads, stats, info = _triton_step(kernels, ours, x, mask, dy, groups, 1, 0, "reference", "running")
        want = norm_dispatch._pn_step_forward_torch(x, mask, theirs.weight, theirs.bias, theirs.phi, theirs.counter,
                                                    groups or 0, *options)
        want_dx, want_grads = norm_dispatch._pn_step_backward_torch(dy, x, mask, theirs.weight, theirs.nu, want[1],
                                                                    want[2], groups or 0, 0.9, 1e-5)
        for got, expected in ((y, want[0]), (stats, want[1]), (info, want[2]), (dx, want_dx), (grads, want_grads),
                              (ours.phi, theirs.phi), (ours.nu, theirs.nu), (ours.counter, theirs.counter)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_step_keeps_float32_statistics_under_half_precision(kernels, dtype):
    """Half-precision `x`, `dy` and parameters: output and gradients in that dtype, statistics and
    buffers float32 and equal (to the rounding of the input) to a float32 step on the same values."""
    low, full = _Buffers(HIDDEN), _Buffers(HIDDEN)
    for step in range(3):
        x, mask, dy = _batch(60 + step, dtype=dtype)
        y, dx, grads, stats, _ = _triton_step(kernels, low, x, mask, dy, GROUPS, 1, 0, "reference", "running")
        want_y, want_dx, _, want_stats, _ = _triton_step(kernels, full, x.float(), mask, dy.float(), GROUPS, 1, 0,
                                                         "reference", "running")
        assert y.dtype == dx.dtype == dtype and stats.dtype == low.phi.dtype == low.nu.dtype == torch.float32
        torch.testing.assert_close(stats, want_stats, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y.float(), want_y.to(dtype).float(), rtol=0.02, atol=0.02)
        torch.testing.assert_close(dx.float(), want_dx.to(dtype).float(), rtol=0.02, atol=0.02)
        torch.testing.assert_close(low.nu, full.nu, rtol=1e-2, atol=1e-3)  # the weight is rounded to dtype


def test_triton_step_guards_a_batch_without_real_tokens_and_a_non_finite_one(kernels):
    buffers = _Buffers(HIDDEN)
    x, mask, dy = _batch(80)
    _triton_step(kernels, buffers, x, mask, dy, GROUPS, 0, 0, "reference", "running")
    before = (buffers.phi.clone(), buffers.nu.clone(), int(buffers.counter))
    nan_x = x.clone()
    nan_x[0, 1] = float("nan")
    for bad_x, bad_mask, flags in ((x, torch.zeros_like(mask), [0.0, 0.0, 0.0]), (nan_x, mask, [9.0, 0.0, 1.0])):
        y, _, _, stats, info = _triton_step(kernels, buffers, bad_x, bad_mask, dy, GROUPS, 0, 0, "reference",
                                            "running")
        assert info.tolist() == flags
        assert torch.equal(buffers.phi, before[0]) and torch.equal(buffers.nu, before[1])
        assert int(buffers.counter) == before[2]
        torch.testing.assert_close(stats[1], torch.rsqrt(before[0] + 1e-5))  # the running denominator
        assert torch.isfinite(y[1:]).all()


def test_kernels_are_only_offered_what_they_take(kernels):
    x, weight = torch.randn(5, HIDDEN), torch.ones(HIDDEN)
    phi = torch.ones(HIDDEN)
    assert kernels.usable(x, weight, weight, phi)
    assert kernels.usable(x.bfloat16(), weight.bfloat16(), weight, phi)
    assert not kernels.usable(x.double(), weight, weight, phi)  # float64: the torch ops (gradcheck)
    assert not kernels.usable(x, weight, weight, phi.bfloat16())  # buffers cast away from float32
    assert not kernels.usable(x.reshape(1, 5, HIDDEN), weight, weight, phi)
    assert kernels.AVAILABLE


# ----------------------------------------------------------------------------------------------
# DyT's and Derf's kernels (what `_ElementwiseNormFunction` runs on CUDA)

def _elementwise_reference(function, x, alpha, shift, weight, bias, dy):
    """Output and gradients of `weight * f(alpha x + shift) + bias` in float64 autograd."""
    leaves = [t.double().requires_grad_(True) if t is not None else None for t in (x, alpha, shift, weight, bias)]
    x64, alpha64, shift64, weight64, bias64 = leaves
    z = alpha64 * x64 + (0.0 if shift64 is None else shift64)
    y = weight64 * (torch.tanh(z) if function == "tanh" else torch.erf(z)) + bias64
    y.backward(dy.double())
    return y.detach(), {name: t.grad for name, t in zip(("x", "alpha", "shift", "weight", "bias"), leaves)
                        if t is not None}


@pytest.mark.parametrize("function", ["tanh", "erf"])
@pytest.mark.parametrize("tokens, hidden, shifted, programs", [
    (13, 12, False, None), (13, 12, True, None), (600, 40, True, None), (600, 40, False, 3), (1, 5, True, None)])
def test_triton_dyt_derf_match_the_float64_formula(kernels, monkeypatch, function, tokens, hidden, shifted, programs):
    if programs:  # fewer programs than tiles: each adds up several tiles
        monkeypatch.setattr(kernels, "MAX_PROGRAMS", programs)
    gen = torch.Generator().manual_seed(tokens + hidden)
    x, dy = torch.randn(tokens, hidden, generator=gen) * 2, torch.randn(tokens, hidden, generator=gen)
    alpha, shift = torch.tensor([0.7]), torch.tensor([-0.3]) if shifted else None
    weight, bias = torch.linspace(0.5, 1.5, hidden), torch.linspace(-0.2, 0.3, hidden)
    want, grads = _elementwise_reference(function, x, alpha, shift, weight, bias, dy)

    y = kernels.elementwise_forward(x, function, alpha, shift, weight, bias)
    dx, sums = kernels.elementwise_backward(dy, x, function, alpha, shift, weight, True)
    assert y.dtype == dx.dtype == sums.dtype == torch.float32 and sums.shape == (2 * hidden + 2,)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), grads["x"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums[:hidden].double(), grads["weight"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums[hidden:2 * hidden].double(), grads["bias"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums[2 * hidden:2 * hidden + 1].double(), grads["alpha"], rtol=1e-5, atol=1e-3)
    if shifted:
        torch.testing.assert_close(sums[2 * hidden + 1:].double(), grads["shift"], rtol=1e-5, atol=1e-3)
    no_dx, same = kernels.elementwise_backward(dy, x, function, alpha, shift, weight, False)
    assert no_dx is None and torch.equal(same, sums)


@pytest.mark.parametrize("name", ["dyt", "derf"])
def test_dyt_derf_modules_train_through_the_triton_kernels_as_through_the_torch_ops(kernels, monkeypatch, name):
    """The module's autograd function on the Triton kernels (offered CPU tensors here, where only CUDA
    takes them) against its torch ops: output and every gradient, a bfloat16 model included (its
    tensors handed to the kernels as they are)."""
    from hf_powernorm import norm_dispatch, normalization

    taken, forward = [], norm_dispatch.triton_elementwise_forward
    monkeypatch.setattr(norm_dispatch, "triton_elementwise_forward",
                        lambda x, *args: taken.append(x.dtype) or forward(x, *args))
    for dtype in (torch.float32, torch.bfloat16):
        runs = []
        for backend in ("triton", "torch"):
            torch.manual_seed(0)
            norm = normalization.build_norm(name, HIDDEN).to(dtype)
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)
            x = (torch.randn(3, 5, HIDDEN) * 2).to(dtype).requires_grad_(True)
            with monkeypatch.context() as patch, normalization.kernel_backend(backend):
                if backend == "triton":
                    patch.setattr(norm_dispatch, "_triton_elementwise_usable", kernels.elementwise_usable)
                y = norm(x)
                y.backward(torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype))
            runs.append([y, x.grad] + [p.grad for p in norm.parameters()])
        # the triton run's step alone, a bfloat16 model's tensors as they are (no cast to float32 and back)
        assert taken == [torch.float32] if dtype == torch.float32 else taken == [torch.float32, torch.bfloat16]
        for got, want in zip(*runs):
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                       atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_dyt_derf_kernels_are_only_offered_what_they_take(kernels):
    x, weight = torch.randn(5, HIDDEN), torch.ones(HIDDEN)
    assert kernels.elementwise_usable(x, weight, None, torch.ones(1))
    assert kernels.elementwise_usable(x.reshape(1, 5, HIDDEN), weight)
    assert kernels.elementwise_usable(x.bfloat16(), weight.bfloat16(), None, torch.ones(1, dtype=torch.float16))
    assert not kernels.elementwise_usable(x.double(), weight)  # float64: the torch ops
    assert not kernels.elementwise_usable(x, weight.double())
    assert not kernels.elementwise_usable(torch.randn(2, 20000), torch.ones(20000))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["dyt", "derf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_dyt_derf_take_the_triton_kernels_and_match_cpu(monkeypatch, name, dtype):
    """The CUDA step (on the kernels, a bfloat16 model's tensors as they are) against the CPU's in float32."""
    from hf_powernorm import norm_dispatch, normalization

    calls = []
    forward = norm_dispatch.triton_elementwise_forward
    monkeypatch.setattr(norm_dispatch, "triton_elementwise_forward",
                        lambda x, *args: calls.append(x.dtype) or forward(x, *args))
    runs = []
    for device, model_dtype in (("cpu", torch.float32), ("cuda", dtype)):
        torch.manual_seed(0)
        norm = normalization.build_norm(name, 96)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
        norm.to(device, model_dtype)
        gen = torch.Generator().manual_seed(1)
        x = (torch.randn(4, 33, 96, generator=gen) * 2).to(device, model_dtype).requires_grad_(True)
        y = norm(x)
        y.backward(torch.randn(4, 33, 96, generator=gen).to(device, model_dtype))
        runs.append([t.detach().cpu().float() for t in [y, x.grad] + [p.grad for p in norm.parameters()]])
    assert calls == [dtype]
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_triton_dyt_derf_without_tokens(kernels):
    x, weight = torch.empty(0, HIDDEN), torch.linspace(0.5, 1.5, HIDDEN)
    assert kernels.elementwise_forward(x, "erf", torch.ones(1), torch.zeros(1), weight, weight).shape == (0, HIDDEN)
    dx, sums = kernels.elementwise_backward(x, x, "erf", torch.ones(1), torch.zeros(1), weight, True)
    assert dx.shape == (0, HIDDEN) and torch.equal(sums, torch.zeros(2 * HIDDEN + 2))
