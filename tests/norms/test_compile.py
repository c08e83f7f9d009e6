"""No host synchronisation in a norm's training step: graphs without breaks, compiled = eager.

Every guard of a batch-statistic norm (no real token, non-finite statistics, the warmup switch,
the step counter) is decided on the device, so `torch._dynamo` traces a training forward in one
graph, a compiled training step (forward, backward, buffer updates) matches eager, and on CUDA no
step waits for the device.
"""

import warnings

import pytest
import torch
from tiny_models import inputs_for, make_model

from hf_powernorm import (
    NORM_CLASSES,
    available_kernel_backends,
    build_norm,
    current_kernel_backend,
    kernel_backend,
)

HIDDEN = 12
# Every norm whose training forward takes a batch statistic, with options that reach its phases in a
# few steps (PN: warmup, ramp, running statistic; MABN: batch phase, moving averages, renormalization).
BATCH_NORM_OPTIONS = {
    "powernorm": {"warmup_steps": 2, "warmup_ramp_steps": 1, "group_num": 4},
    "powernorm_v": {"group_num": 4},
    "batchnorm": {},
    "batchrenorm": {"rmax": 1.5, "dmax": 0.5},
    "mabn": {"window": 2, "warmup_steps": 0, "renorm_warmup_steps": 2},
}

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_batch_norms_are_all_here():
    assert set(BATCH_NORM_OPTIONS) == {
        name for name, cls in NORM_CLASSES.items() if "num_batches_tracked" in cls(HIDDEN).state_dict()
    }


def _steps(device="cpu"):
    """Training batches: padded, unpadded, all padding, a non-finite one, then padded again."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for kind in ("padded", "full", "padded", "no_real_token", "non_finite", "padded", "padded"):
        x = torch.randn(3, 5, HIDDEN, generator=generator) * 2 + 0.5
        dy = torch.randn(3, 5, HIDDEN, generator=generator)
        mask = torch.ones(3, 5, dtype=torch.long)
        mask[0, 3:] = 0
        if kind == "full":
            mask = None
        elif kind == "no_real_token":
            mask = torch.zeros_like(mask)
        elif kind == "non_finite":
            x[1, 1, 2] = float("nan")
        batches.append(tuple(t if t is None else t.to(device) for t in (x, mask, dy)))
    return batches


def _norm(name: str, device="cpu"):
    norm = build_norm(name, HIDDEN, **BATCH_NORM_OPTIONS.get(name, {})).to(device).train()
    with torch.no_grad():
        for parameter, start, end in (("weight", 0.5, 1.5), ("bias", -0.2, 0.3)):
            if getattr(norm, parameter, None) is not None:
                getattr(norm, parameter).copy_(torch.linspace(start, end, HIDDEN))
    return norm


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("name", sorted(NORM_CLASSES))
def test_training_forward_of_every_norm_is_one_graph(name, masked):
    norm = _norm(name)
    x, mask, _ = _steps()[0]
    explanation = torch._dynamo.explain(norm)(x, mask if masked else None)
    assert explanation.graph_break_count == 0, [str(reason.reason)[:300] for reason in explanation.break_reasons]
    assert explanation.graph_count == 1


# Each tiny model with PN everywhere, and every other batch-statistic norm in a model (the same
# norms in the other heads are slow-marked: tracing a model takes seconds).
MODEL_NORMS = [("seq2seq", "powernorm", "powernorm"), ("causal", "powernorm", "powernorm"),
               ("classifier", "powernorm", "powernorm"), ("seq2seq", "powernorm_v", "batchnorm"),
               ("causal", "batchrenorm", "mabn"),
               *[pytest.param(head, norm, norm, marks=pytest.mark.slow)
                 for head in ("seq2seq", "causal", "classifier")
                 for norm in sorted(n for n, cls in NORM_CLASSES.items()
                                    if cls.mixes_positions and not cls.mixing_options)]]


@pytest.mark.parametrize("head, encoder_norm, decoder_norm", MODEL_NORMS)
def test_training_forward_of_every_tiny_model_is_one_graph(head, encoder_norm, decoder_norm):
    model = make_model(head, encoder_norm, decoder_norm_type=decoder_norm, encoder_layers=1, decoder_layers=1).train()
    input_ids = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 5:] = 0
    explanation = torch._dynamo.explain(model)(**inputs_for(head, input_ids, attention_mask, with_labels=True))
    assert explanation.graph_break_count == 0, [str(reason.reason)[:300] for reason in explanation.break_reasons]


def _train(norm, step_fn, batches):
    """Forward and backward of every batch; outputs, gradients and every buffer after each step."""
    trace = []
    for x, mask, dy in batches:
        x = x.clone().requires_grad_(True)
        norm.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the non-finite batch warns in eager only
            y = step_fn(x, mask)
            y.backward(dy)
        trace.append({"y": y.detach(), "x.grad": x.grad, **{f"{k}.grad": p.grad for k, p in norm.named_parameters()},
                      **{k: b.clone() for k, b in norm.named_buffers()}})
    return trace


def _assert_same_traces(compiled, eager):
    """Equal traces, except that a gradient of the non-finite batch may be NaN in more places in the
    compiled graph (the torch ops: 0 * NaN through the unused batch statistic) than in eager code on
    the C kernels (NaN only where the input is), never in fewer."""
    for step, (got, want) in enumerate(zip(compiled, eager)):
        assert got.keys() == want.keys()
        for key in want:
            a, b = got[key], want[key]
            if key.endswith("grad") and a is not None and b is not None:
                assert (torch.isfinite(a) <= torch.isfinite(b)).all(), f"step {step}, {key}: NaN where eager has none"
                a, b = a[torch.isfinite(a)], b[torch.isfinite(a)]
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True,
                                       msg=lambda m, key=key, step=step: f"step {step}, {key}: {m}")


@pytest.mark.parametrize("name", sorted(BATCH_NORM_OPTIONS))
def test_fullgraph_compiled_training_step_matches_eager_buffers_included(name):
    """`aot_eager` runs dynamo and AOTAutograd (the joint forward/backward graph, the buffer updates
    of the backward) without generating code, which keeps the test fast; the inductor code is
    checked against eager in `test_fast_path_*`."""
    eager_norm, compiled_norm = _norm(name), _norm(name)
    batches = _steps()
    eager = _train(eager_norm, eager_norm, batches)
    torch._dynamo.reset()
    compiled = _train(compiled_norm, torch.compile(compiled_norm, backend="aot_eager", fullgraph=True), batches)
    _assert_same_traces(compiled, eager)
    assert int(compiled_norm.num_batches_tracked) == len(batches) - 2  # the two unusable batches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(NORM_CLASSES))
def test_cuda_training_step_never_synchronises(name):
    norm = _norm(name, "cuda")
    batches = _steps("cuda")

    def steps():
        for x, mask, dy in batches:
            norm(x.detach().requires_grad_(True), mask).backward(dy)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the non-finite batch
        steps()  # first calls: lazy initialisations, and compiling (which may synchronise) every signature
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            steps()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(BATCH_NORM_OPTIONS))
def test_cuda_training_steps_match_cpu(name):
    cuda_norm, cpu_norm = _norm(name, "cuda"), _norm(name)
    cuda = _train(cuda_norm, cuda_norm, _steps("cuda"))
    cpu = _train(cpu_norm, cpu_norm, _steps())
    _assert_same_traces([{k: v.cpu() for k, v in step.items()} for step in cuda], cpu)


# ----------------------------------------------------------------------------------------------
# PN's compiled pure functions (what runs on CUDA) against its torch ops run eagerly


@pytest.mark.slow  # inductor builds two C++ kernels families here: about a minute on 2 cores
def test_compiled_training_step_matches_eager_on_cpu(monkeypatch):
    from hf_powernorm import norm_dispatch

    with kernel_backend("torch"):
        eager_norm = _norm("powernorm")
        eager = _train(eager_norm, eager_norm, _steps())
    monkeypatch.setattr(norm_dispatch, "_COMPILED", {})
    with kernel_backend("compile"):
        compiled_norm = _norm("powernorm")
        compiled = _train(compiled_norm, compiled_norm, _steps())
    assert all(entry.compiled is not None for entry in norm_dispatch._COMPILED.values())
    assert len(norm_dispatch._COMPILED) == 2
    _assert_same_traces(compiled, eager)


def test_a_failed_compilation_falls_back_to_the_torch_ops(monkeypatch):
    from hf_powernorm import norm_dispatch

    with kernel_backend("torch"):
        eager_norm = _norm("powernorm")
        eager = _train(eager_norm, eager_norm, _steps()[:3])
    monkeypatch.setattr(norm_dispatch, "_COMPILED", {})

    def no_compiler(fn, **options):
        def fail(*args):
            raise RuntimeError("no C++ compiler")
        return fail

    monkeypatch.setattr(torch, "compile", no_compiler)
    norm = _norm("powernorm")
    with kernel_backend("compile"), pytest.warns(RuntimeWarning, match="torch.compile of pn_train_forward failed"):
        fallback = _train_warning_visible(norm, _steps()[:3])
    assert all(entry.compiled is None for entry in norm_dispatch._COMPILED.values())
    _assert_same_traces(fallback, eager)


@pytest.mark.parametrize("setting", ["0", "1", "auto"])
def test_an_explicit_kernel_backend_wins_over_the_compile_variable(monkeypatch, setting):
    """`kernel_backend("compile")` compiles PN's pure functions under `HF_POWERNORM_COMPILE=0`, and
    `"torch"` or `"c"` never compiles under `=1`; without a block the variable decides (`"auto"`:
    CUDA only). bfloat16 steps, which the C kernels leave to the operators' torch ops."""
    from hf_powernorm import norm_dispatch

    compiled = []
    monkeypatch.setattr(norm_dispatch, "_compiled", lambda fn: compiled.append(fn.__name__) or fn)
    monkeypatch.setenv("HF_POWERNORM_COMPILE", setting)
    batches = [tuple(t if t is None or not t.is_floating_point() else t.bfloat16() for t in batch)
               for batch in _steps()[:2]]
    backends = [("compile", True), ("torch", False), ("auto", setting == "1")]
    backends += [("c", False)] if "c" in available_kernel_backends() else []
    for backend, compiles in backends:
        compiled.clear()
        norm = _norm("powernorm").to(torch.bfloat16)
        with kernel_backend(backend):
            _train(norm, norm, batches)
        assert compiled == (["pn_train_forward", "pn_train_backward"] * 2 if compiles else []), backend


def test_a_compile_variable_outside_its_values_is_refused(monkeypatch):
    monkeypatch.setenv("HF_POWERNORM_COMPILE", "yes")
    x, mask, _ = _steps()[0]
    norm = _norm("powernorm").to(torch.bfloat16)
    with kernel_backend("torch"):  # an explicit backend never reads it
        norm(x.bfloat16(), mask)
    with pytest.raises(ValueError, match=r"HF_POWERNORM_COMPILE must be one of \('auto', '0', '1'\), got 'yes'"):
        norm(x.bfloat16(), mask)

def _train_warning_visible(norm, batches):
    trace = []
    for x, mask, dy in batches:
        x = x.clone().requires_grad_(True)
        norm.zero_grad()
        y = norm(x, mask)
        y.backward(dy)
        trace.append({"y": y.detach(), "x.grad": x.grad, **{f"{k}.grad": p.grad for k, p in norm.named_parameters()},
                      **{k: b.clone() for k, b in norm.named_buffers()}})
    return trace


# ----------------------------------------------------------------------------------------------
# PN's step as two operators: one node per direction in a graph, one dispatched call eagerly where
# the C kernels do not take the step (eager CPU float32 calls them directly)


def _pn_op_args(dtype=torch.float32, masked=True):
    """Arguments of `hf_powernorm::pn_step_forward` for a fresh PN with group scaling (warmup over)."""
    norm = _norm("powernorm").to(dtype)
    x, mask, dy = _steps()[0]
    x = x.reshape(-1, HIDDEN).to(dtype)
    mask = mask.reshape(-1) if masked else None
    buffers = (norm.running_phi, norm.num_batches_tracked)
    return norm, x, mask, dy.reshape(-1, HIDDEN).to(dtype), (x, mask, norm.weight.detach(), norm.bias.detach(),
                                                              *buffers, 4, norm.eps, 0, 0, 0.9, True, False,
                                                              norm.group_eps)


def _graph_ops(gm) -> list[str]:
    """The operators a graph calls, the mutating ones through their functionalized wrapper."""
    ops = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
            ops.append(str(getattr(target, "overloadpacket", target)))
    return ops


def _compiled_step_graphs(norm):
    """One training step of `norm` compiled with `fullgraph=True` through AOT autograd: the ops of
    its forward and backward graphs, and the input (its gradient set by the step)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def capture(direction):
        def compiler(gm, example_inputs):
            graphs[direction] = _graph_ops(gm)
            return make_boxed_func(gm.forward)
        return compiler

    x, mask, dy = _steps()[0]
    torch._dynamo.reset()
    compiled = torch.compile(norm, backend=aot_autograd(fw_compiler=capture("forward"),
                                                        bw_compiler=capture("backward")), fullgraph=True)
    compiled(x.requires_grad_(True), mask).backward(dy)
    return graphs, x


def test_powernorm_training_step_is_one_operator_node_per_direction_in_a_compiled_graph():
    norm = _norm("powernorm")
    graphs, _ = _compiled_step_graphs(norm)
    assert graphs["forward"].count("hf_powernorm.pn_step_forward") == 1, graphs["forward"]
    assert graphs["backward"].count("hf_powernorm.pn_step_backward") == 1, graphs["backward"]
    arithmetic = {"aten.mul", "aten.div", "aten.sum", "aten.rsqrt", "aten.addcmul", "aten.mm", "aten.mv", "aten.lerp"}
    assert not arithmetic & set(graphs["forward"] + graphs["backward"]), graphs
    assert int(norm.num_batches_tracked) == 1 and bool((norm.running_nu != 0).any())


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


# Per norm of the step operators: its `norm_dispatch` functions (the direct C calls) and the running
# buffer one step must change.
STEP_FUNCTIONS = {"powernorm": (("pn_step_forward", "pn_step_backward"), "running_nu"),
                  "batchnorm": (("bn_step_forward", "bn_step_backward"), "running_mean")}


def _eager_step_ops(dtype, monkeypatch, name="powernorm"):
    """The dispatched operators of one eager step of the norm `name` (forward, backward) and the
    direct C calls."""
    from hf_powernorm import norm_dispatch

    functions, running = STEP_FUNCTIONS[name]
    calls = []
    for function in functions:
        original = getattr(norm_dispatch, function)
        monkeypatch.setattr(norm_dispatch, function, lambda *a, _f=original, _n=function: calls.append(_n) or _f(*a))
    norm = _norm(name).to(dtype)
    x, mask, dy = (t.to(dtype) if t.is_floating_point() else t for t in _steps()[0])
    x.requires_grad_(True)
    with _OpLog() as forward:
        y = norm(x, mask)
    with _OpLog() as backward:
        y.backward(dy)
    assert int(norm.num_batches_tracked) == 1 and x.grad is not None and bool((getattr(norm, running) != 0).any())
    # nothing of the norm's arithmetic outside the operators or C calls: reshapes and autograd's accumulation
    arithmetic = {"aten.mul", "aten.div", "aten.sum", "aten.rsqrt", "aten.addcmul", "aten.mm", "aten.mv", "aten.lerp"}
    assert not arithmetic & set(forward.ops + backward.ops), (forward.ops, backward.ops)
    return forward.ops, backward.ops, calls


def test_powernorm_eager_cpu_float32_step_calls_the_c_kernels_directly(monkeypatch):
    """Eager CPU float32: one direct C call per direction, no operator (the operators' dispatch and
    wrapping cost more than a small step there); graphs and CUDA take the operators."""
    forward, backward, calls = _eager_step_ops(torch.float32, monkeypatch)
    assert calls == ["pn_step_forward", "pn_step_backward"]
    assert not any(op.startswith("hf_powernorm") for op in forward + backward), (forward, backward)


def test_powernorm_eager_step_the_c_kernels_do_not_take_is_one_operator_call_per_direction(monkeypatch):
    forward, backward, calls = _eager_step_ops(torch.float64, monkeypatch)
    assert forward.count("hf_powernorm.pn_step_forward") == 1 and backward.count("hf_powernorm.pn_step_backward") == 1
    assert not any(op.startswith("hf_powernorm") for op in forward if op != "hf_powernorm.pn_step_forward")
    assert calls == []


@pytest.mark.parametrize("dtype, masked", [(torch.float32, True), (torch.float32, False), (torch.float64, True),
                                           (torch.bfloat16, True)])
def test_powernorm_operators_pass_opcheck(dtype, masked):
    """Schema (mutated buffers declared), fake implementations and dispatch, on the C kernels
    (float32) and the torch ops (float64, bfloat16)."""
    norm, x, mask, dy, args = _pn_op_args(dtype, masked)
    torch.library.opcheck(torch.ops.hf_powernorm.pn_step_forward.default, args)
    y, stats, info = torch.ops.hf_powernorm.pn_step_forward(*args)
    assert y.dtype == dtype and stats.shape == (3, HIDDEN) and info.shape == (3,)
    backward_args = (dy, x, mask, norm.weight.detach(), norm.running_nu, stats, info, 4, 0.9, norm.group_eps)
    torch.library.opcheck(torch.ops.hf_powernorm.pn_step_backward.default, backward_args)


# ----------------------------------------------------------------------------------------------
# Masked BN's (and BRN's) step as two operators, as PN's


def _bn_op_args(name, dtype=torch.float32, masked=True):
    """`(norm, x, mask, dy, arguments of hf_powernorm::bn_step_forward)` for a fresh BN or BRN."""
    norm = _norm(name).to(dtype)
    x, mask, dy = _steps()[0]
    x = x.reshape(-1, HIDDEN).to(dtype)
    mask = mask.reshape(-1) if masked else None
    renorm = name == "batchrenorm"
    args = (x, mask, norm.weight.detach(), norm.bias.detach(), norm.running_mean, norm.running_var,
            norm.num_batches_tracked, norm.eps, norm.momentum, renorm, norm.rmax if renorm else 1.0,
            norm.dmax if renorm else 0.0)
    return norm, x, mask, dy.reshape(-1, HIDDEN).to(dtype), args


@pytest.mark.parametrize("name", ["batchnorm", "batchrenorm"])
@pytest.mark.parametrize("dtype, masked", [(torch.float32, True), (torch.float32, False), (torch.float64, True),
                                           (torch.bfloat16, True)])
def test_batch_norm_operators_pass_opcheck(name, dtype, masked):
    """Schema (mutated buffers declared), fake implementations and dispatch, on the C kernels
    (float32) and the torch ops (float64, bfloat16)."""
    norm, x, mask, dy, args = _bn_op_args(name, dtype, masked)
    torch.library.opcheck(torch.ops.hf_powernorm.bn_step_forward.default, args)
    y, out, info = torch.ops.hf_powernorm.bn_step_forward(*args)
    assert y.dtype == dtype and out.shape == (4, HIDDEN) and info.shape == (3,) and bool(info[1])
    torch.library.opcheck(torch.ops.hf_powernorm.bn_step_backward.default, (dy, x, mask, args[2], out, info))


@pytest.mark.parametrize("name", ["batchnorm", "batchrenorm"])
def test_batch_norm_training_step_is_one_operator_node_per_direction_in_a_compiled_graph(name):
    norm = _norm(name)
    graphs, x = _compiled_step_graphs(norm)
    assert graphs["forward"].count("hf_powernorm.bn_step_forward") == 1, graphs["forward"]
    assert graphs["backward"].count("hf_powernorm.bn_step_backward") == 1, graphs["backward"]
    arithmetic = {"aten.mul", "aten.div", "aten.sum", "aten.rsqrt", "aten.addcmul", "aten.mm", "aten.mv", "aten.lerp"}
    assert not arithmetic & set(graphs["forward"] + graphs["backward"]), graphs
    assert int(norm.num_batches_tracked) == 1 and x.grad is not None and bool((norm.running_mean != 0).any())


@pytest.mark.parametrize("dtype, calls_c", [(torch.float32, True), (torch.float64, False)])
def test_batch_norm_eager_step_is_one_c_call_or_one_operator_call_per_direction(monkeypatch, dtype, calls_c):
    """Eager CPU float32 calls the C kernels directly (as PN's step); other steps call the two
    operators once each; no BN arithmetic outside either."""
    forward, backward, calls = _eager_step_ops(dtype, monkeypatch, "batchnorm")
    ours = [op for op in forward + backward if op.startswith("hf_powernorm")]
    if calls_c:
        assert calls == ["bn_step_forward", "bn_step_backward"] and ours == []
    else:
        assert calls == [] and ours == ["hf_powernorm.bn_step_forward", "hf_powernorm.bn_step_backward"]


def test_kernel_backend_switches_the_c_kernels_off_within_its_block(monkeypatch):
    from hf_powernorm import norm_dispatch

    calls = []
    original = norm_dispatch.pn_step_forward
    monkeypatch.setattr(norm_dispatch, "pn_step_forward", lambda *a: calls.append(1) or original(*a))
    traces = []
    for backend, in_c in (("auto", True), ("c", True), ("torch", False)):
        before = len(calls)
        norm = _norm("powernorm")
        with kernel_backend(backend):
            assert current_kernel_backend() == backend
            traces.append(_train(norm, norm, _steps()))
        assert len(calls) - before == (len(_steps()) if in_c else 0)  # every step in C, or none
    assert current_kernel_backend() == "auto"
    _assert_same_traces(traces[1], traces[0])
    _assert_same_traces(traces[2], traces[0])
    with kernel_backend("torch"):
        with kernel_backend("c"):
            assert current_kernel_backend() == "c"
        assert current_kernel_backend() == "torch"
    with pytest.raises(ValueError, match="kernel backend must be one of .*'triton'.*got 'cuda'"):
        with kernel_backend("cuda"):
            pass
    assert current_kernel_backend() == "auto"


def test_kernel_backends_this_machine_lacks_are_refused_by_name(monkeypatch):
    from hf_powernorm import norm_dispatch

    assert set(available_kernel_backends()) >= {"auto", "compile", "torch"}
    assert ("c" in available_kernel_backends()) == (norm_dispatch.kernels_cpu_load() is not None)
    monkeypatch.setattr(norm_dispatch, "TRITON_AVAILABLE", False)
    assert "triton" not in available_kernel_backends()
    with pytest.raises(ValueError, match="kernel backend 'triton' is not available here: Triton is not installed"):
        with kernel_backend("triton"):
            pass
    monkeypatch.setattr(norm_dispatch, "kernels_cpu_load", lambda: None)
    with pytest.raises(ValueError, match="kernel backend 'c' is not available here: the C kernels did not build"):
        with kernel_backend("c"):
            pass
    assert available_kernel_backends() == ("auto", "compile", "torch")
    assert current_kernel_backend() == "auto"
