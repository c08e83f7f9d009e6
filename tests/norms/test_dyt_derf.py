"""DyT (Zhu et al., CVPR 2025) and Derf: each against a direct float64 implementation of its formula,
their dtype behaviour and traits, the model family's per-site alphas and learnable embedding scale,
the recipes' options, and `convert_norms` of a tiny Llama and GPT-2 to each, saved and reloaded."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from torch.func import functional_call
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_powernorm
from hf_powernorm import (
    NORM_CLASSES,
    PowerNormTransformerConfig,
    PowerNormTransformerForCausalLM,
    PowerNormTransformerForConditionalGeneration,
    build_norm,
    normalize_norm_name,
)
from hf_powernorm import kernels_cpu
from hf_powernorm.hub import render_model_card
from hf_powernorm.normalization import Derf, DyT, kernel_backend
from hf_powernorm.training import add_recipe_args, check_args
from hf_powernorm.training.models import powernorm_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, SEQ, HIDDEN, HEADS, VOCAB = 3, 7, 32, 4, 99
NAMES = ["dyt", "derf"]
SQUASH = {"dyt": torch.tanh, "derf": torch.erf}


def reference(name: str, x, alpha, weight, bias, shift=None):
    """The authors' formula written out: `weight * f(alpha * x + shift) + bias` (no shift for DyT)."""
    argument = alpha * x if shift is None else alpha * x + shift
    return weight * SQUASH[name](argument) + bias


def random_norm(name: str, hidden: int = HIDDEN, seed: int = 0) -> torch.nn.Module:
    """A norm whose every parameter is away from its initial value, so a swapped or ignored one shows."""
    norm = build_norm(name, hidden, alpha_init=0.7)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in norm.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return norm


def params_of(norm: torch.nn.Module, dtype=torch.float64) -> dict[str, torch.Tensor]:
    return {key: value.detach().to(dtype) for key, value in norm.named_parameters()}


def inputs(dtype=torch.float32, seed: int = 1, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


C_STEPS = ["operator", "function"]  # a CPU training step's two ways around the C kernels


def built_operator():
    """The C++ operator, which must build wherever a C++ compiler is (skipped where none is: the step
    then runs the Python function, tested on every machine)."""
    import os
    import shutil

    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine: the operator cannot be built here")
    operator = kernels_cpu.load_operator()
    assert operator is not None, "a C++ compiler is on this machine, so the operator must build"
    return operator


@pytest.fixture
def c_step(request, monkeypatch):
    """`operator`: the C++ operator (`kernels_cpu.load_operator`), built here; `function`: the Python
    autograd function that runs where it cannot be built."""
    if request.param == "operator":
        built_operator()
    else:
        monkeypatch.setattr(hf_powernorm.norm_dispatch, "load_operator", lambda: None)
    return request.param


# ----------------------------------------------------------------------------------------------
# The classes against their formula


@pytest.mark.parametrize("c_step", C_STEPS, indirect=True)
@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_forward_and_gradients_match_the_formula(name, backend, c_step):
    """Both paths of float32 on the CPU: the C kernels' one pass each way (behind the C++ operator or
    the Python function), and the torch ops."""
    assert kernels_cpu.load() is not None, "a C compiler is expected on this machine"
    norm = random_norm(name)
    x = inputs().requires_grad_(True)
    with kernel_backend(backend):
        out = norm(x)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(dy)
    expected_params = {key: value.requires_grad_(True) for key, value in params_of(norm).items()}
    x64 = x.detach().double().requires_grad_(True)
    expected = reference(name, x64, **expected_params)
    expected.backward(dy.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)  # float32 against float64
    for key, parameter in norm.named_parameters():
        torch.testing.assert_close(parameter.grad.double(), expected_params[key].grad, atol=1e-4, rtol=1e-5)


def saved_bytes(norm: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors of more than a few elements that autograd saves for `norm(x)`'s backward."""
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel() * tensor.element_size() if tensor.numel() > HIDDEN else 0)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        norm(x)
    return sum(sizes)


@pytest.mark.parametrize("c_step", C_STEPS, indirect=True)
@pytest.mark.parametrize("name", NAMES)
def test_c_kernels_save_only_the_input_as_layer_norm_does(name, c_step):
    """The C path recomputes f(z) in its backward: it saves `x` alone, where the torch ops save `x`
    and f(z) (or sigmoid(2z)) too."""
    norm, x = random_norm(name), inputs().requires_grad_(True)
    with kernel_backend("c"):
        assert saved_bytes(norm, x) == x.numel() * 4
    with kernel_backend("torch"):
        assert saved_bytes(norm, x) == 2 * x.numel() * 4


@pytest.mark.parametrize("name", NAMES)
def test_c_squashing_function_is_within_float32_error_over_its_whole_range(name):
    """The C kernels' tanh (a rational approximation) and erf (an odd polynomial below |z| = 475/512,
    `1 - k P(|z|)` above, `k` the shared erf') against float64, on a dense grid and at the special values."""
    assert kernels_cpu.load() is not None, "a C compiler is expected on this machine"
    z = torch.linspace(-12.0, 12.0, 200_200).reshape(-1, 1001)
    ones, zeros = torch.ones(1001), torch.zeros(1001)
    function = "tanh" if name == "dyt" else "erf"
    got = kernels_cpu.elementwise_forward(z, function, 1.0, 0.0, ones, zeros).double()
    assert (got - SQUASH[name](z.double())).abs().max() < (3.5e-7 if name == "dyt" else 7e-8)  # erf: a table, 6.3e-8
    tiny = torch.logspace(-30, -0.5, 1001).reshape(1, -1)  # erf is exact to float32 in relative terms there
    if name == "derf":
        got = kernels_cpu.elementwise_forward(tiny, function, 1.0, 0.0, ones, zeros).double()
        assert ((got - torch.erf(tiny.double())) / torch.erf(tiny.double())).abs().max() < 3e-7
    special = torch.tensor([[math.inf, -math.inf, 0.0, -0.0, 100.0, -100.0, math.nan]])
    got = kernels_cpu.elementwise_forward(special, function, 1.0, 0.0, torch.ones(7), torch.zeros(7))
    assert got[0, :6].tolist() == [1.0, -1.0, 0.0, 0.0, 1.0, -1.0] and math.isnan(got[0, 6])


def test_erf_from_the_table_by_permutes_has_the_bits_of_the_indexed_table(monkeypatch, tmp_path):
    """Derf's kernels built as this machine allows (AVX-512: the table read by vector permutes) and
    without AVX-512 (the table indexed, the compiler's vectors): the same output and input gradient
    bit for bit, the same parameter sums to float32 rounding, over the table's 16 intervals, the
    clamp at 4, a row length that is not a multiple of 16, and the special values."""
    native = kernels_cpu.load()
    assert native is not None, "a C compiler is expected on this machine"
    for attribute, value in (("_tried", False), ("_library", None)):
        monkeypatch.setattr(kernels_cpu, attribute, value)
    monkeypatch.setenv("HF_POWERNORM_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels_cpu, "_FLAGS", [*kernels_cpu._FLAGS, "-mno-avx512f"])
    generic = kernels_cpu.load()
    assert generic is not None and generic is not native
    noise = torch.randn(37 * 300, generator=torch.Generator().manual_seed(6)) * 3
    x = torch.cat([torch.linspace(-5.0, 5.0, 37 * 300), noise]).reshape(-1, 37)
    x[0, :7] = torch.tensor([math.inf, -math.inf, 0.0, -0.0, 4.0, -4.0, 3.9999998])
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    weight, results = torch.rand(37) + 0.5, {}
    for build, library in (("native", native), ("generic", generic)):
        monkeypatch.setattr(kernels_cpu, "_library", library)
        y = kernels_cpu.elementwise_forward(x, "erf", 0.9, 0.1, weight, torch.zeros(37))
        dx, sums = kernels_cpu.elementwise_backward(dy, x, "erf", 0.9, 0.1, weight)
        results[build] = y, dx, sums
    assert torch.equal(results["native"][0], results["generic"][0])
    assert torch.equal(results["native"][1], results["generic"][1])
    torch.testing.assert_close(results["native"][2], results["generic"][2], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_inference_takes_the_c_pass_and_matches_the_formula(name):
    """Under `no_grad` (a decoding step) the module calls the C forward directly: the formula's
    output, and no autograd function on the way (the torch ops' path is patched to fail)."""
    norm, x = random_norm(name), inputs()
    expected = reference(name, x.double(), **params_of(norm))
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_powernorm.norm_dispatch._ElementwiseNormFunction, "apply", None)
        got = norm(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("c_step", C_STEPS, indirect=True)
@pytest.mark.parametrize("name", NAMES)
def test_c_backward_without_input_gradient_and_for_a_strided_input(name, c_step):
    """Frozen input (parameter gradients only: the kernel skips dx) and a transposed input give the
    torch ops' gradients."""
    norm = random_norm(name)
    x = inputs().transpose(0, 1)  # (SEQ, BATCH, HIDDEN), not contiguous
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    grads = {}
    for backend in ("c", "torch"):
        for requires_grad in (False, True):
            norm.zero_grad(set_to_none=True)
            xi = x.detach().clone().transpose(0, 1).transpose(0, 1).requires_grad_(requires_grad)
            assert not xi.is_contiguous()
            with kernel_backend(backend):
                out = norm(xi)
                out.backward(dy)
            grads[backend, requires_grad] = [out.detach(), xi.grad, *(p.grad for p in norm.parameters())]
    for requires_grad in (False, True):
        for got, expected in zip(grads["c", requires_grad], grads["torch", requires_grad]):
            if expected is None:
                assert got is None
            else:
                torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("c_step", C_STEPS, indirect=True)
@pytest.mark.parametrize("name", NAMES)
def test_c_forward_keeps_the_gradient_differentiable(name, c_step):
    """create_graph=True through the C forward: the second derivative is the torch ops' one."""
    norm, x = random_norm(name), inputs(scale=1.0)
    second = {}
    for backend in ("c", "torch"):
        xi = x.clone().requires_grad_(True)
        with kernel_backend(backend):
            (grad,) = torch.autograd.grad(norm(xi).square().sum(), xi, create_graph=True)
            (second[backend],) = torch.autograd.grad(grad.sum(), xi)
    torch.testing.assert_close(second["c"], second["torch"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_a_cpu_training_step_is_one_cpp_node_with_the_python_functions_bits(name, monkeypatch):
    """The C++ operator and the Python function run the same kernels: the same output and gradients,
    bit for bit, for a 3-d input with a padding mask and a 2-d one; the step is one C++ node."""
    built_operator()
    norm = random_norm(name)
    cases = [(inputs(), torch.ones(BATCH, SEQ, dtype=torch.long)), (inputs(seed=4).reshape(-1, HIDDEN), None)]
    for x, mask in cases:
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
        results = {}
        for step in C_STEPS:
            with pytest.MonkeyPatch.context() as patch:
                if step == "function":
                    patch.setattr(hf_powernorm.norm_dispatch, "load_operator", lambda: None)
                norm.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_(True)
                out = norm(xi, mask)
                grads = torch.autograd.grad(out, (xi, *norm.parameters()), dy)
                results[step] = (out.grad_fn.name(), out.detach(), *grads)
        assert results["operator"][0] == "torch::autograd::CppNode<ElementwiseNorm>"
        assert results["function"][0] == "_ElementwiseNormFunctionBackward"
        for got, expected in zip(results["operator"][1:], results["function"][1:]):
            assert torch.equal(got, expected)


def test_the_operator_refuses_what_its_kernels_cannot_read_by_name():
    operator = built_operator()
    norm, x = random_norm("derf"), inputs()
    with pytest.raises(RuntimeError, match="CPU float32 tensors expected, got cpu Double"):
        operator(x.double(), norm.alpha, norm.shift, norm.weight, norm.bias, 1)
    with pytest.raises(RuntimeError, match="function must be 0 \\(tanh\\) or 1 \\(erf\\), got 3"):
        operator(x, norm.alpha, norm.shift, norm.weight, norm.bias, 3)
    with pytest.raises(RuntimeError, match=f"got x \\[{BATCH}, {SEQ}, {HIDDEN + 1}\\], weight \\[{HIDDEN}\\]"):
        operator(torch.randn(BATCH, SEQ, HIDDEN + 1), norm.alpha, norm.shift, norm.weight, norm.bias, 1)
    # a mask of another shape goes to the general path, which names it
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        norm(x, torch.ones(BATCH, SEQ + 1))


def test_without_a_cpp_compiler_the_step_runs_the_python_function_and_says_so(monkeypatch, tmp_path, caplog):
    """A fresh cache, no C++ compiler: the build announced, one warning naming why it failed, the C
    kernels still used (through the Python function), and the formula's gradients."""
    monkeypatch.setenv("HF_POWERNORM_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    for attribute, value in (("_tried", False), ("_library", None), ("_operator_tried", False), ("_operator", None)):
        monkeypatch.setattr(kernels_cpu, attribute, value)
    norm, x = random_norm("dyt"), inputs().requires_grad_(True)
    with caplog.at_level("WARNING", logger="hf_powernorm.kernels_cpu"):
        out = norm(x)
    assert out.grad_fn.name() == "_ElementwiseNormFunctionBackward" and kernels_cpu._library is not None
    building, unavailable = [record.getMessage() for record in caplog.records]
    assert building.startswith("Building the C++ operator of DyT and Derf in ") and "once per torch version" in building
    assert "C++ operator unavailable" in unavailable and "no-such-compiler" in unavailable
    out.backward(torch.ones_like(out))
    x64 = x.detach().double().requires_grad_(True)
    reference("dyt", x64, **params_of(norm)).backward(torch.ones_like(x64))
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    assert [path.suffix for path in tmp_path.glob("powernorm_operator_*")] == [".lock"]  # nothing half-built


def test_the_operators_library_is_trusted_only_with_its_own_record():
    """The record next to the built operator names its digest (source, flags, torch's build, the C
    library's digest) and its hash; the C library's digest does not stand for it."""
    import json

    built_operator()
    (library,) = kernels_cpu._cache_dir().glob(f"powernorm_operator_{kernels_cpu._operator_digest()[:16]}.so")
    record = json.loads(library.with_suffix(".json").read_text())
    assert record == {"source_and_flags": kernels_cpu._operator_digest(), "library": kernels_cpu._file_digest(library)}
    assert kernels_cpu._trusted(library, kernels_cpu._operator_digest())
    assert not kernels_cpu._trusted(library)  # the C library's digest

@pytest.mark.slow
def test_two_processes_build_the_operator_once(tmp_path):
    """Two processes that start on an empty cache together: one builds, the other waits for it and
    loads its library (one record, one library, both processes on the operator). Slow: a second minute
    of C++ build; the lock and the wait are the C library's, raced in
    `test_normalization.py::test_two_processes_on_an_empty_cache_build_the_library_once`."""
    import os
    import shutil
    import subprocess
    import sys

    built_operator()
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
            "import hf_powernorm.kernels_cpu as k; print('operator', k.load_operator() is not None)")
    environment = {**os.environ, "HF_POWERNORM_CACHE": str(tmp_path)}
    shutil.copytree(kernels_cpu._cache_dir(), tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("powernorm_operator_*"))  # the C library, not the operator
    processes = [subprocess.Popen([sys.executable, "-c", code], env=environment, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert all("operator True" in output for output in outputs), outputs
    assert sum(output.count("Building the C++ operator") for output in outputs) == 1, outputs
    assert len(list(tmp_path.glob("powernorm_operator_*.so"))) == 1


def test_the_operator_is_rebuilt_for_another_c_library_or_torch(monkeypatch):
    """Its digest, which names the library file and its namespace, follows the C kernels it binds and
    torch's build."""
    digest = kernels_cpu._operator_digest()
    with monkeypatch.context() as patch:
        patch.setattr(kernels_cpu, "_source_digest", lambda: "0" * 64)
        assert kernels_cpu._operator_digest() != digest
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "0.0.0")
        assert kernels_cpu._operator_digest() != digest
    assert kernels_cpu._operator_digest() == digest


@pytest.mark.parametrize("name", NAMES)
def test_torch_func_grad_and_vmap_give_the_autograd_gradients(name):
    """`torch.func` transforms (per-sample gradients) run the formula in torch ops: `grad` equals the
    training step's gradients, `vmap` of it the per-sample ones (neither a C++ nor a Python autograd
    function can be transformed)."""
    from torch.func import grad, vmap

    norm, x = random_norm(name), inputs()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    params = {key: value.detach() for key, value in norm.named_parameters()}

    def loss(params, x, dy):
        return (functional_call(norm, params, (x,)) * dy).sum()

    got = grad(loss)(params, x, dy)
    norm.zero_grad(set_to_none=True)
    (norm(x) * dy).sum().backward()
    for key, parameter in norm.named_parameters():
        torch.testing.assert_close(got[key], parameter.grad, atol=1e-5, rtol=1e-5)
    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, dy)
    for key in params:
        assert per_sample[key].shape == (BATCH, *params[key].shape)
        torch.testing.assert_close(per_sample[key].sum(0), got[key], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_float64_gradcheck_of_input_and_parameters(name):
    norm = random_norm(name, hidden=5).double()
    keys = [key for key, _ in norm.named_parameters()]
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    values = [value.detach().clone().requires_grad_(True) for _, value in norm.named_parameters()]

    def fn(x, *values):
        return functional_call(norm, dict(zip(keys, values)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *values))
    assert torch.autograd.gradgradcheck(fn, (x, *values))


@pytest.mark.parametrize("name", NAMES)
def test_initial_values_are_the_authors(name):
    norm = build_norm(name, 64)
    assert norm.alpha.shape == (1,) and norm.alpha.item() == 0.5  # the authors' alpha_init_value
    assert torch.equal(norm.weight, torch.ones(64)) and torch.equal(norm.bias, torch.zeros(64))
    if name == "derf":
        assert norm.shift.shape == (1,) and norm.shift.item() == 0.0
    x = inputs()[..., :1].expand(BATCH, SEQ, 64)
    torch.testing.assert_close(norm(x), SQUASH[name](0.5 * x))
    assert sorted(key for key, _ in norm.named_parameters()) == sorted(
        ["alpha", "weight", "bias", *(["shift"] if name == "derf" else [])])
    assert not list(norm.buffers())


# ----------------------------------------------------------------------------------------------
# Dtypes: float32 arithmetic whatever comes in


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_input_is_computed_in_float32(name):
    norm = random_norm(name)
    x = inputs(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, norm(x.float()).to(torch.bfloat16))  # the float32 computation, rounded once
    in_float64 = reference(name, x.double(), **params_of(norm))
    torch.testing.assert_close(out.double(), in_float64, atol=1e-6, rtol=2**-8)  # half a bf16 ulp
    # bf16 parameters too (a model cast with .to(bfloat16)): still float32 arithmetic on their values
    norm_bf16 = random_norm(name).to(torch.bfloat16)
    norm_values = random_norm(name)
    with torch.no_grad():
        for parameter, value in zip(norm_values.parameters(), norm_bf16.parameters()):
            parameter.copy_(value.float())
    out = norm_bf16(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, norm_values(x.float()).to(torch.bfloat16))


@pytest.mark.parametrize("name", NAMES)
def test_autocast_keeps_float32_arithmetic(name):
    norm = random_norm(name)
    x = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, norm(x), atol=0, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_graph_breaks(name):
    norm = random_norm(name)
    x = inputs().requires_grad_(True)
    explanation = torch._dynamo.explain(norm)(x, torch.ones(BATCH, SEQ))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# ----------------------------------------------------------------------------------------------
# Registry and traits


def test_registry_names_and_build_norm():
    assert NORM_CLASSES["dyt"] is DyT and NORM_CLASSES["derf"] is Derf
    for spelling, name in (("DyT", "dyt"), ("dynamic_tanh", "dyt"), ("Dynamic-Tanh", "dyt"), ("Derf", "derf"),
                           ("dynamic_erf", "derf")):
        assert normalize_norm_name(spelling) == name
    for name, cls in (("dyt", DyT), ("derf", Derf)):
        norm = build_norm(name, 64, alpha_init=0.8)
        assert type(norm) is cls and norm.weight.shape == (64,) and norm.alpha.item() == pytest.approx(0.8)
    assert build_norm("derf", 64, shift_init=-0.25).shift.item() == -0.25
    with pytest.raises(TypeError, match="shift_init"):
        build_norm("dyt", 64, shift_init=0.1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("option, value", [("alpha_init", 0.0), ("alpha_init", -1.0), ("alpha_init", float("nan")),
                                           ("alpha_init", "0.5"), ("alpha_init", True)])
def test_bad_alpha_init_is_refused_by_name(name, option, value):
    with pytest.raises(ValueError, match=f"alpha_init must be a finite positive number, got {value!r}"):
        build_norm(name, 8, **{option: value})


def test_bad_shift_init_is_refused_by_name():
    with pytest.raises(ValueError, match="shift_init must be a finite number, got inf"):
        build_norm("derf", 8, shift_init=math.inf)


@pytest.mark.parametrize("name", NAMES)
def test_traits_say_what_the_norms_do(name):
    cls = NORM_CLASSES[name]
    assert (cls.mixes_positions, cls.mixing_options, cls.has_running_stats, cls.foldable) == (False, (), False, False)
    assert cls.site_options == {"alpha_init": "norm_alpha_init"}
    assert cls.learnable_embed_scale is True and cls.preserves_function is False
    assert not hasattr(build_norm(name, 8), "affine_after_group_scale")
    norm = random_norm(name).train()
    x = inputs()
    mask = torch.ones(BATCH, SEQ)
    mask[1, 3:] = 0
    batch_out = norm(x, mask)
    assert torch.equal(batch_out[:1], norm(x[:1]))  # alone or in a batch, masked or not: the same
    assert torch.equal(batch_out, norm(x))
    # element-wise: changing one channel of one token changes that element only
    changed = x.clone()
    changed[2, 4, 5] += 1.0
    differs = (norm(changed) != batch_out)
    assert differs.sum() == 1 and differs[2, 4, 5]


# ----------------------------------------------------------------------------------------------
# The model family


def tiny(**fields) -> PowerNormTransformerConfig:
    return PowerNormTransformerConfig.from_preset("tiny", **fields)


def causal(norm: str, **fields) -> PowerNormTransformerForCausalLM:
    torch.manual_seed(0)
    return PowerNormTransformerForCausalLM(tiny(decoder_norm_type=norm, is_encoder_decoder=False, **fields))


def token_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[2, 5:] = 0
    ids[2, 5:] = 1
    return ids, mask


@pytest.mark.parametrize("name", NAMES)
def test_per_site_alpha_reaches_each_norm(name):
    sites = dict(norm_alpha_init_attention=0.9, norm_alpha_init_ffn=0.35, norm_alpha_init_final=0.15)
    model = PowerNormTransformerForConditionalGeneration(tiny(encoder_norm_type=name, decoder_norm_type=name, **sites))
    alphas = {key: value.item() for key, value in model.named_parameters() if key.endswith(".alpha")}
    expected = {}
    for stack, attention in (("encoder", ["self_attn_norm"]), ("decoder", ["self_attn_norm", "cross_attn_norm"])):
        for layer in range(2):
            for norm in attention:
                expected[f"model.{stack}.layers.{layer}.{norm}.alpha"] = 0.9
            expected[f"model.{stack}.layers.{layer}.ffn_norm.alpha"] = 0.35
        expected[f"model.{stack}.final_norm.alpha"] = 0.15
    assert alphas == pytest.approx(expected)
    default = causal(name)
    assert {value.item() for key, value in default.named_parameters() if key.endswith(".alpha")} == {1.0}


def test_embedding_scale_is_learnable_in_dyt_and_derf_stacks_by_default():
    model = PowerNormTransformerForConditionalGeneration(tiny(encoder_norm_type="derf", decoder_norm_type="layernorm"))
    scale = model.model.encoder.embeddings.embed_scale
    assert isinstance(scale, torch.nn.Parameter) and scale.item() == pytest.approx(math.sqrt(HIDDEN))
    assert model.model.decoder.embeddings.embed_scale == math.sqrt(HIDDEN)  # a fixed float in the LN stack
    off = causal("dyt", embed_scale_learnable=False).model.decoder.embeddings.embed_scale
    assert off == math.sqrt(HIDDEN) and not isinstance(off, torch.Tensor)
    on = causal("layernorm", embed_scale_learnable=True, scale_embedding=False).model.decoder.embeddings.embed_scale
    assert isinstance(on, torch.nn.Parameter) and on.item() == 1.0


def test_embedding_scale_multiplies_the_token_embeddings():
    model = causal("dyt").eval()
    ids, mask = token_batch()
    embeddings = model.model.decoder.embeddings
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        before = embeddings(ids, None, positions)
        embeddings.embed_scale.fill_(2.0)
        after = embeddings(ids, None, positions)
    tokens = embeddings.embed_tokens(ids)
    torch.testing.assert_close(after - before, tokens * (2.0 - math.sqrt(HIDDEN)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field, value", [("norm_alpha_init_ffn", 0.0), ("norm_alpha_init_attention", float("inf")),
                                          ("norm_alpha_init_final", "1"), ("embed_scale_learnable", "yes")])
def test_config_refuses_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})


def test_norm_kwargs_per_site():
    config = tiny(norm_alpha_init_attention=0.8, norm_alpha_init_ffn=0.2, norm_alpha_init_final=0.1)
    assert config.norm_kwargs("dyt", "attention") == {"eps": config.norm_eps, "alpha_init": 0.8}
    assert config.norm_kwargs("Derf", "final") == {"eps": config.norm_eps, "alpha_init": 0.1}
    assert config.norm_kwargs("dyt") == {"eps": config.norm_eps}
    assert config.norm_kwargs("layernorm", "ffn") == {"eps": config.norm_eps}
    with pytest.raises(ValueError, match="site must be None or one of"):
        config.norm_kwargs("dyt", "embedding")


@pytest.mark.parametrize("name", NAMES)
def test_training_step_then_save_and_reload_is_equal(name, tmp_path):
    model = causal(name, norm_alpha_init_attention=0.8, norm_alpha_init_ffn=0.3, norm_alpha_init_final=0.3).train()
    ids, mask = token_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {key: value.detach().clone() for key, value in model.named_parameters()}
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    for key, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), key
    optimizer.step()
    moved = [key for key, value in model.named_parameters() if key.endswith((".alpha", ".shift", "embed_scale"))
             and not torch.equal(value, before[key])]
    assert "model.decoder.embeddings.embed_scale" in moved and "model.decoder.final_norm.alpha" in moved
    assert len(moved) == 1 + 5 * (2 if name == "derf" else 1)  # the scale, alpha (and shift) of 5 norms
    model.save_pretrained(tmp_path)
    loaded = PowerNormTransformerForCausalLM.from_pretrained(tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    model.eval()
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                               model(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)


def test_model_card_lists_the_per_site_alphas():
    card = str(render_model_card(causal("derf", norm_alpha_init_attention=0.6), repo_id="org/tiny"))
    assert "| `norm_alpha_init_attention` | `0.6` |" in card and "| `norm_alpha_init_final` | `1.0` |" in card
    assert "learnable in the derf stacks" in card and "zlab-princeton/Derf" in card
    assert "norm_alpha_init" not in str(render_model_card(causal("layernorm"), repo_id="org/tiny"))


# ----------------------------------------------------------------------------------------------
# Recipes


def test_recipe_options_reach_the_config(tmp_path):
    parser = add_recipe_args(argparse.ArgumentParser())
    args = parser.parse_args(["--norm_type", "DyT", "--norm_alpha_init_attention", "0.8", "--norm_alpha_init_ffn",
                              "0.2", "--no-embed_scale_learnable", "--output_dir", str(tmp_path)])
    check_args(args)
    overrides = powernorm_overrides(args)
    assert overrides == {"norm_alpha_init_attention": 0.8, "norm_alpha_init_ffn": 0.2, "embed_scale_learnable": False}
    config = tiny(decoder_norm_type=args.norm_type, is_encoder_decoder=False, **overrides)
    model = PowerNormTransformerForCausalLM(config)
    assert model.model.decoder.layers[1].self_attn_norm.alpha.item() == pytest.approx(0.8)
    assert model.model.decoder.final_norm.alpha.item() == 1.0
    assert not isinstance(model.model.decoder.embeddings.embed_scale, torch.Tensor)
    bad = parser.parse_args(["--norm_alpha_init_final", "-1", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--norm_alpha_init_final must be a finite positive number; got -1.0"):
        check_args(bad)


# ----------------------------------------------------------------------------------------------
# Converting a Transformers model


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0))


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=37,
                                        pad_token_id=0))


SOURCES = {"gpt2": (_gpt2, 5), "llama": (_llama, 5)}  # model, number of norms (2 per layer + final)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("source", list(SOURCES))
def test_convert_train_save_and_load_converted(source, name, tmp_path):
    build, count = SOURCES[source]
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():  # source weights and biases away from 1 and 0, so the copy shows
        for key, value in model.named_parameters():
            if "ln" in key or "norm" in key:
                value.add_(torch.randn_like(value) * 0.1)
    sources = {key: value.detach().clone() for key, value in model.named_parameters() if "ln" in key or "norm" in key}
    report = hf_powernorm.convert_norms(model, name, alpha_init=0.6)
    assert len(report.replaced) == count and {new for _, _, new in report.replaced} == {NORM_CLASSES[name].__name__}
    norms = {key: module.norm for key, module in model.named_modules() if type(module).__name__ == "MaskAwareNorm"}
    for key, norm in norms.items():
        assert norm.alpha.item() == pytest.approx(0.6)
        assert torch.equal(norm.weight, sources[f"{key}.weight"])
        assert torch.equal(norm.bias, sources[f"{key}.bias"]) if f"{key}.bias" in sources \
            else torch.equal(norm.bias, torch.zeros(HIDDEN))
    ids, mask = token_batch()
    ids[2, 5:] = 0
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert all(torch.isfinite(norm.alpha.grad).all() and norm.alpha.grad.abs().sum() > 0 for norm in norms.values())
    optimizer.step()
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, type(model))
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    model.eval()
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                               model(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)
