"""Speed and memory of the norms, and of whole models, against LayerNorm and BART, in one run.

    python -m hf_powernorm.benchmarks [--quick] [--device cpu|cuda] [--threads 1 2] [--repeats 11]
                                      [--write BENCHMARKS.md]

Tables (markdown, printed; `--write` also replaces the measured section of that file):
- first, the answer: each norm's training step and eval forward / `F.layer_norm`'s, median ratios only;
- layer training step (forward + backward) and eval forward (no_grad), each norm / `F.layer_norm`;
- saved-for-backward memory of each norm's training forward / `F.layer_norm`'s;
- model train step (forward, backward, AdamW step): PN encoder / LN encoder, and our LN model /
  `BartForConditionalGeneration` of the same dimensions;
- `generate` tokens per second, greedy and beam 5: our PN and LN models / BART; greedy, a causal LM
  with PN in every layer / the same with LayerNorm;
- `fold_norms()`: the PN model's eval forward after folding / before;
- first-call costs: building the C kernels, and `torch.compile` of PN's training step.

Protocol (`timing.py`). Every figure is a ratio of two workloads measured in the same process, interleaved
(A B A B ...), after warm-up repeats, each repeat with fresh gradients (set to None); the table
gives the median ratio over the repeats and its spread (25th-75th percentile), and the candidate's
median time for scale. Glibc's allocator returns freed memory to the system between repeats
(large blocks are mmap-ed and unmapped), so each repeat would page-fault its tensors afresh and a
baseline's time would depend on what ran before it: the run first measures that effect on
`F.layer_norm` (allocator table), then fixes it with `mallopt` (no trimming, no mmap below 1 GiB)
for everything else. CUDA timings synchronise before reading the clock.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..norm_dispatch import elementwise_backward, elementwise_forward, pn_step_backward, pn_step_forward
from ..normalization import NORM_CLASSES, available_kernel_backends, build_norm, kernel_backend
from .timing import cell, clock, control_allocator, interleaved, machine_line, markdown, num_threads, progress

LAYER_SHAPES = [(1024, 512), (4096, 512), (16384, 1024)]
QUICK_SHAPES = [(256, 64)]
PADDING = 0.1
GROUP_NUM = 4
# label -> (registry name, options, C kernels on)
LAYER_CASES = {
    "powernorm G=4": ("powernorm", {"group_num": GROUP_NUM}, True),
    "powernorm G=4, torch ops": ("powernorm", {"group_num": GROUP_NUM}, False),
    "powernorm G=4, in warmup (batch statistic)": ("powernorm", {"group_num": GROUP_NUM, "warmup_steps": 10**9}, True),
    "powernorm no GS": ("powernorm", {"group_num": None}, True),
    "powernorm_v": ("powernorm_v", {}, True),
    "batchnorm (masked)": ("batchnorm", {}, True),
    "batchnorm (masked), torch ops": ("batchnorm", {}, False),
    "batchrenorm": ("batchrenorm", {}, True),
    "mabn": ("mabn", {}, True),
    "rmsnorm": ("rmsnorm", {}, True),
    "layernorm (registry)": ("layernorm", {}, True),
    "dyt": ("dyt", {}, True),
    "derf": ("derf", {}, True),
    "powernorm G=4, its two C calls alone (no module, no autograd)": ("pn_calls", {"group_num": GROUP_NUM}, True),
    "dyt, its two C calls alone (no module, no autograd)": ("dyt_calls", {}, True),
    "derf, its two C calls alone (no module, no autograd)": ("derf_calls", {}, True),
    "autograd.Function doing no arithmetic (module call, output and gradient allocation, autograd)": ("autograd", {}, True),
}
# The eval table's cases: the layer table's that have an eval forward, and the folded PN and a copy.
EVAL_CASES = {
    **{label: LAYER_CASES[label] for label in ("powernorm G=4", "powernorm no GS")},
    "powernorm G=4, folded (group scaling only)": ("groupscale", {"group_num": GROUP_NUM}, True),
    **{label: LAYER_CASES[label] for label in ("powernorm G=4, torch ops", "powernorm_v", "batchnorm (masked)",
                                                "batchrenorm", "mabn", "rmsnorm", "layernorm (registry)", "dyt",
                                                "derf")},
    "x.clone() (no norm: one read and one write)": ("copy", {}, True),
}
# The first table's rows: every norm of the registry that has a layer row, each as a module would train and evaluate.
ANSWER_ROWS = ["powernorm G=4", "powernorm no GS", "powernorm_v", "batchnorm (masked)", "batchrenorm", "mabn",
               "rmsnorm", "dyt", "derf", "layernorm (registry)"]
ANSWER_TITLE = ("Each norm's CPU cost against LayerNorm (`F.layer_norm`): training step (forward + backward) / "
                "eval forward, median time ratio (below 1: cheaper)")
# Every norm of the registry but the identity, in the registry's order.
MEMORY_CASES = [name for name in NORM_CLASSES if name != "none"]
MEMORY_OPTIONS = {"powernorm": {"group_num": GROUP_NUM}, "groupnorm": {"group_num": GROUP_NUM}}
MARK_BEGIN = "<!-- benchmarks:begin (written by python -m hf_powernorm.benchmarks --write) -->"
MARK_END = "<!-- benchmarks:end -->"


# ----------------------------------------------------------------------------------------------
# Backends


@contextlib.contextmanager
def c_kernels(enabled: bool | str):
    """Switch the C kernels off for a block (`normalization.kernel_backend`): the torch ops (`False`,
    the path without a C compiler) or PN's `torch.compile`d pure functions (`"compile"`)."""
    if enabled is True:  # nothing to switch: no cost charged to the candidate's time
        yield
        return
    with kernel_backend("compile" if enabled == "compile" else "torch"):
        yield


# ----------------------------------------------------------------------------------------------
# Layers


def layer_inputs(tokens: int, hidden: int, device: str):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator).to(device)
    dy = torch.randn(tokens, hidden, generator=generator).to(device)
    mask = (torch.rand(tokens, generator=generator) >= PADDING).long().to(device)
    return x, dy, mask


def _layer_norm_step(x, dy, weight, bias):
    x.grad = weight.grad = bias.grad = None
    F.layer_norm(x, (x.shape[-1],), weight, bias).backward(dy)


class _Copy(torch.nn.Module):
    """The least any eval map that returns a new tensor does: read `x` once, write the output once."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return hidden_states.clone()


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.saved_tensors
        return torch.empty_like(grad_output)


class _AutogradCost(torch.nn.Module):
    """What a norm's step written as a Python autograd function costs before any arithmetic: the module
    call, the function's forward and backward calls, saving `x`, allocating the output and the input
    gradient (most of it allocation and the autograd engine, which a C++ node pays as well)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return _Empty.apply(hidden_states)


class _PowerNormCalls(torch.nn.Module):
    """PN's training step as its two C calls (`pn_step_forward`, `pn_step_backward`) and nothing
    around them: the kernels' share of the module's step. Its `training_step` is what the layer table
    times in place of forward + backward (a case may define one)."""

    def __init__(self, hidden: int, group_num: int) -> None:
        super().__init__()
        self.norm = build_norm("powernorm", hidden, group_num=group_num)

    def training_step(self, x: torch.Tensor, dy: torch.Tensor, mask: torch.Tensor) -> None:
        norm = self.norm
        weight, bias, x = norm.weight.detach(), norm.bias.detach(), x.detach()
        status, _, stats, count = pn_step_forward(
            x, mask, norm.group_num, weight, bias, norm.running_phi, norm.num_batches_tracked, norm.eps,
            norm.warmup_steps, norm.warmup_ramp_steps, 1.0 - norm.alpha_fwd, norm.warmup_statistic == "reference",
            norm.backward_denominator == "batch", norm.group_eps)
        pn_step_backward(dy, x, mask, norm.group_num, weight, norm.running_nu, stats, count, status == 1,
                         1.0 - norm.alpha_bkw, norm.group_eps)


class _ElementwiseCalls(torch.nn.Module):
    """DyT's or Derf's training step as its two C calls (`elementwise_forward`, `elementwise_backward`)
    and nothing around them: the kernels' share of the module's step."""

    def __init__(self, name: str, hidden: int) -> None:
        super().__init__()
        self.norm = build_norm(name, hidden)

    def training_step(self, x: torch.Tensor, dy: torch.Tensor, mask: torch.Tensor) -> None:
        norm = self.norm
        alpha, shift = norm.alpha.item(), norm.shift.item() if hasattr(norm, "shift") else 0.0
        weight, bias = norm.weight.detach(), norm.bias.detach()
        elementwise_forward(x, norm.squash, alpha, shift, weight, bias)
        elementwise_backward(dy, x, norm.squash, alpha, shift, weight)


def _build(name: str, hidden: int, options: dict, device: str):
    if name == "copy":
        return _Copy()
    if name == "autograd":
        return _AutogradCost()
    if name.endswith("_calls"):  # a norm's C calls alone, on a device without them: no row
        if device != "cpu" or "c" not in available_kernel_backends():
            return None
        if name == "pn_calls":
            return _PowerNormCalls(hidden, options["group_num"])
        return _ElementwiseCalls(name.removesuffix("_calls"), hidden)
    if name == "groupscale":
        from ..modeling_powernorm import GroupScale

        return GroupScale(options["group_num"]).to(device)
    return build_norm(name, hidden, **options).to(device)


def layer_results(shapes, threads, repeats, warmup, device, train: bool, compiled: bool = False,
                  norms: list[str] | None = None, cpu_time: bool = False) -> tuple[list[str], dict[str, list]]:
    """The layer rows against `F.layer_norm`, each cell an `interleaved` result (None where the device has
    no such kernels); with `norms`, only the rows of those registry names (and of their C calls alone);
    with `cpu_time`, timed by this thread's CPU time (one thread)."""
    cases = {label: case for label, case in (LAYER_CASES if train else EVAL_CASES).items()
             if norms is None or case[0] in norms or case[0].removesuffix("_calls") in norms}
    if train and compiled:  # PN's compiled pure functions on this device (CUDA's path); minutes to build on a CPU
        cases["powernorm G=4, torch.compile"] = ("powernorm", {"group_num": GROUP_NUM}, "compile")
    header = ["norm"] + [f"{t} thr, ({n}, {c})" for t in threads for n, c in shapes]
    results = {label: [] for label in cases}
    for count in threads:
        with num_threads(count):
            for tokens, hidden in shapes:
                progress(f"layers, {'train' if train else 'eval'}, {count} threads, ({tokens}, {hidden})")
                x, dy, mask = layer_inputs(tokens, hidden, device)
                weight = torch.ones(hidden, device=device, requires_grad=train)
                bias = torch.zeros(hidden, device=device, requires_grad=train)
                xl = x.clone().requires_grad_(train)
                if train:
                    def baseline(xl=xl, dy=dy, weight=weight, bias=bias):
                        _layer_norm_step(xl, dy, weight, bias)
                else:
                    def baseline(x=x, hidden=hidden, weight=weight, bias=bias):
                        F.layer_norm(x, (hidden,), weight, bias)
                for label, (name, options, kernels) in cases.items():
                    norm = _build(name, hidden, options, device)
                    if norm is None:  # the C calls on a device without them
                        results[label].append(None)
                        continue
                    norm.train(train)
                    xn = x.clone().requires_grad_(train)

                    def step(norm=norm, x=x, xn=xn, dy=dy, mask=mask, kernels=kernels, params=list(norm.parameters()),
                             own_step=getattr(norm, "training_step", None) if train else None):
                        with c_kernels(kernels):
                            if own_step is not None:
                                own_step(x, dy, mask)
                            elif train:
                                for tensor in (xn, *params):  # fresh gradients, as the baseline's
                                    tensor.grad = None
                                norm(xn, mask).backward(dy)
                            else:
                                norm(x)

                    with torch.set_grad_enabled(train):
                        results[label].append(interleaved(step, baseline, repeats, warmup, device, cpu_time))
    return header, results


def layer_rows(results: dict[str, list]) -> list[list[str]]:
    """`layer_results`' cells as table text."""
    return [[label, *("n/a" if result is None else cell(result) for result in cells)]
            for label, cells in results.items()]


def layer_table(*args, **kwargs) -> tuple[list[str], list[list[str]]]:
    """`layer_results` as a table: header and text rows."""
    header, results = layer_results(*args, **kwargs)
    return header, layer_rows(results)


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for the backward of `fn()`."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = fn()
    del output
    return sum(storages.values())


_PEAK_CODE = """
import ctypes, gc, sys, torch, torch.nn.functional as F
from hf_powernorm.benchmarks.suite import layer_inputs, MEMORY_OPTIONS
from hf_powernorm.normalization import build_norm
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD fixed at 128 KiB: large blocks unmapped when freed
libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
torch.set_num_threads(1)
tokens, hidden = int(sys.argv[1]), int(sys.argv[2])
x, dy, mask = layer_inputs(tokens, hidden, "cpu")
def status(key):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(key))
for name in sys.argv[3:]:
    if name == "F.layer_norm":
        weight, bias = torch.ones(hidden, requires_grad=True), torch.zeros(hidden, requires_grad=True)
        step = lambda xn: F.layer_norm(xn, (hidden,), weight, bias).backward(dy)
    else:
        norm = build_norm(name, hidden, **MEMORY_OPTIONS.get(name, {})).train()
        step = lambda xn: norm(xn, mask).backward(dy)
    for _ in range(2):  # the second round is the measurement (kernels loaded, buffers in place)
        xn = x.clone().requires_grad_(True)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # the peak resident set starts again from the current one
        base = status("VmRSS:")
        step(xn)
        peak = status("VmHWM:") - base
        del xn
    print(name, peak * 1024, flush=True)
"""


def peak_bytes(names: list[str], shape: tuple[int, int]) -> dict[str, int]:
    """Peak resident memory that a training step (forward + backward, the input's gradient included)
    adds, for each of `names` in turn (after a first step of its own), in one fresh process with glibc
    returning large blocks when freed; a name missing from the result was not measurable."""
    out = subprocess.run([sys.executable, "-c", _PEAK_CODE, *map(str, shape), *names], capture_output=True,
                         text=True, check=False)
    measured = (line.rsplit(" ", 1) for line in out.stdout.splitlines() if line.rsplit(" ", 1)[0] in names)
    return {name: int(value) for name, value in measured}


def memory_table(shape, device) -> tuple[list[str], list[list[str]]]:
    tokens, hidden = shape
    x, _, mask = layer_inputs(tokens, hidden, device)
    weight = torch.ones(hidden, device=device, requires_grad=True)
    bias = torch.zeros(hidden, device=device, requires_grad=True)
    base = saved_bytes(lambda: F.layer_norm(x.clone().requires_grad_(True), (hidden,), weight, bias))
    progress("memory, peaks")
    peaks = peak_bytes(["F.layer_norm", *MEMORY_CASES], shape) if device == "cpu" else {}
    peak_base = peaks.get("F.layer_norm")
    header = ["norm", f"saved for backward, ({tokens}, {hidden}) float32", "x F.layer_norm's",
              "peak of a training step (forward + backward)", "x F.layer_norm's"]

    def peak_cells(name):
        peak = peaks.get(name) if peak_base is not None else None
        if peak is None:
            return ["not measured"] * 2
        return [f"{peak / 2**20:.1f} MiB", f"{peak / peak_base:.2f}" if peak_base else "-"]

    rows = [["F.layer_norm", f"{base / 2**20:.2f} MiB", "1.00", *peak_cells("F.layer_norm")]]
    for name in MEMORY_CASES:
        progress(f"memory, {name}")
        norm = build_norm(name, hidden, **MEMORY_OPTIONS.get(name, {})).to(device).train()
        saved = saved_bytes(lambda norm=norm: norm(x.clone().requires_grad_(True), mask))
        rows.append([name, f"{saved / 2**20:.2f} MiB", f"{saved / base:.2f}", *peak_cells(name)])
    return header, rows


# ----------------------------------------------------------------------------------------------
# Models


def model_sizes(quick: bool) -> dict:
    if quick:
        return dict(hidden=32, layers=1, heads=4, ffn=64, vocab=120, batch=2, source=8, target=8, new_tokens=4)
    return dict(hidden=256, layers=3, heads=4, ffn=1024, vocab=8000, batch=16, source=64, target=64, new_tokens=32)


def _our_config(sizes: dict, **fields):
    """The benchmark's `PowerNormTransformerConfig` at `sizes` (BART's dimensions), with `fields` set."""
    from ..configuration_powernorm import PowerNormTransformerConfig

    return PowerNormTransformerConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], num_attention_heads=sizes["heads"],
        intermediate_size=sizes["ffn"], max_position_embeddings=256, dropout=0.1, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **fields,
    )


def our_model(sizes: dict, encoder_norm: str, device: str):
    from ..modeling_powernorm import PowerNormTransformerForConditionalGeneration

    config = _our_config(sizes, encoder_layers=sizes["layers"], decoder_layers=sizes["layers"],
                         encoder_norm_type=encoder_norm, decoder_norm_type="layernorm", tie_word_embeddings=True)
    torch.manual_seed(0)
    return PowerNormTransformerForConditionalGeneration(config).to(device)


def our_causal_model(sizes: dict, norm: str, device: str):
    """A decoder-only LM of the same size with `norm` in every layer (a decoding step calls each
    norm on one token per sequence)."""
    from ..modeling_powernorm import PowerNormTransformerForCausalLM

    config = _our_config(sizes, encoder_layers=0, decoder_layers=sizes["layers"], encoder_norm_type=norm,
                         decoder_norm_type=norm, is_decoder=True, is_encoder_decoder=False)
    torch.manual_seed(0)
    return PowerNormTransformerForCausalLM(config).to(device)


def bart_model(sizes: dict, device: str):
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=sizes["vocab"], d_model=sizes["hidden"], encoder_layers=sizes["layers"],
        decoder_layers=sizes["layers"], encoder_attention_heads=sizes["heads"],
        decoder_attention_heads=sizes["heads"], encoder_ffn_dim=sizes["ffn"], decoder_ffn_dim=sizes["ffn"],
        max_position_embeddings=256, dropout=0.1, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    return BartForConditionalGeneration(config).to(device)


def model_batch(sizes: dict, device: str) -> dict:
    generator = torch.Generator().manual_seed(1)
    shape = (sizes["batch"], sizes["source"])
    input_ids = torch.randint(3, sizes["vocab"], shape, generator=generator)
    attention_mask = torch.ones_like(input_ids)
    lengths = torch.randint(sizes["source"] // 2, sizes["source"] + 1, (sizes["batch"],), generator=generator)
    attention_mask[torch.arange(sizes["source"])[None, :] >= lengths[:, None]] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 1)
    labels = torch.randint(3, sizes["vocab"], (sizes["batch"], sizes["target"]), generator=generator)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device), "labels": labels.to(device)}


def _train_step(model, batch):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()
    return step


def _generate_cell(candidate, baseline, base_label: str, count: int, repeats: int, device: str, tokens: int) -> str:
    """A generate cell: the candidate's tokens/s over the baseline's (the baseline's time over the
    candidate's, interleaved, no grad, `count` threads), then the baseline's tokens/s for scale."""
    with num_threads(count), torch.no_grad():
        result = interleaved(baseline, candidate, repeats, 1, device)
    tokens_per_s = tokens / (result["ms"] / 1e3)
    return f"{result['ratio']:.2f} ({result['low']:.2f}-{result['high']:.2f}), {base_label} {tokens_per_s:.0f} tok/s"


def model_tables(sizes, repeats, warmup, device, threads):
    batch = model_batch(sizes, device)
    models = {"pn": our_model(sizes, "powernorm", device), "ln": our_model(sizes, "layernorm", device),
              "bart": bart_model(sizes, device)}
    header = ["comparison", *[f"{t} thr" for t in threads]]
    train_rows = [["train step: PN encoder / LN encoder"], ["train step: our LN model / BART"]]
    steps = {name: _train_step(model, batch) for name, model in models.items()}
    progress("model train steps")
    for count in threads:
        with num_threads(count):
            train_rows[0].append(cell(interleaved(steps["pn"], steps["ln"], repeats, warmup, device)))
            train_rows[1].append(cell(interleaved(steps["ln"], steps["bart"], repeats, warmup, device)))
    generate_rows = []
    prompt = {key: batch[key] for key in ("input_ids", "attention_mask")}
    new = sizes["new_tokens"]
    for beams in (1, 5):
        progress(f"generate, {beams} beams")
        calls = {}
        for name, model in models.items():
            model.eval()
            calls[name] = (lambda model=model, beams=beams: model.generate(
                **prompt, num_beams=beams, do_sample=False, max_new_tokens=new, min_new_tokens=new))
        for name, base in (("pn", "ln"), ("pn", "bart"), ("ln", "bart")):
            row = [f"generate, {'greedy' if beams == 1 else 'beam 5'}: our {name.upper()} model / "
                   f"{'our LN model' if base == 'ln' else 'BART'} (tokens/s ratio)"]
            for count in threads:
                row.append(_generate_cell(calls[name], calls[base], "LN" if base == "ln" else "BART", count,
                                          repeats, device, sizes["batch"] * new))
            generate_rows.append(row)
    causal = {norm: our_causal_model(sizes, norm, device).eval() for norm in ("powernorm", "layernorm")}
    prompt = {key: batch[key][:, : sizes["source"] // 4] for key in ("input_ids", "attention_mask")}
    calls = {norm: (lambda model=model: model.generate(**prompt, do_sample=False, max_new_tokens=new,
                                                       min_new_tokens=new)) for norm, model in causal.items()}
    row = ["generate, greedy: causal LM, PN in every layer / LN in every layer (tokens/s ratio)"]
    for count in threads:
        row.append(_generate_cell(calls["powernorm"], calls["layernorm"], "LN", count, repeats, device,
                                  sizes["batch"] * new))
    generate_rows.append(row)
    fold_rows = [fold_row(sizes, batch, repeats, warmup, device, threads)]
    return header, train_rows + generate_rows + fold_rows


def fold_row(sizes, batch, repeats, warmup, device, threads) -> list[str]:
    """Eval forward of the PN model before / after `fold_norms()` (time ratio: below 1 pays)."""
    model = our_model(sizes, "powernorm", device)
    _train_step(model, batch)()  # running statistics away from their initial values
    model.eval()
    folded = our_model(sizes, "powernorm", device)
    folded.load_state_dict(model.state_dict())
    folded.eval()
    folded.fold_norms()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    inputs["decoder_input_ids"] = batch["labels"]
    row = ["eval forward: PN model after fold_norms() / before"]
    for count in threads:
        with num_threads(count), torch.no_grad():
            row.append(cell(interleaved(lambda: folded(**inputs), lambda: model(**inputs), repeats, warmup, device)))
    return row


# ----------------------------------------------------------------------------------------------
# First-call costs


def first_call_table(device: str, quick: bool, compiled: bool) -> tuple[list[str], list[list[str]]]:
    """What a first call costs: the C kernels' build (seconds), the C++ operator's (about a minute of
    c++, left out under `--quick`), and with `compiled` PN's torch.compile."""
    operator = "not measured (--quick)" if quick else _kernel_build_seconds("load_operator")
    rows = [["build the C kernels (cc, empty cache)", _kernel_build_seconds("load")],
            ["build the C kernels and DyT's and Derf's C++ operator (cc, c++, empty cache)", operator]]
    if quick or not compiled:
        why = "--quick" if quick else "without --compile"
        rows.append(["torch.compile of PN's training step (first forward + backward)", f"not measured ({why})"])
    else:
        rows.append(["torch.compile of PN's training step (first forward + backward)", _compile_seconds(device)])
    return ["what", "seconds"], rows


def _kernel_build_seconds(loader: str) -> str:
    """`kernels_cpu.<loader>()`'s time in a fresh process and an empty cache."""
    code = ("import time, hf_powernorm.kernels_cpu as k; s = time.perf_counter(); "
            f"lib = k.{loader}(); print(time.perf_counter() - s if lib else 'no compiler')")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_POWERNORM_CACHE": cache}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    value = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-200:]
    return f"{float(value):.2f}" if re.fullmatch(r"[0-9.e-]+", value) else value


def _compile_seconds(device: str) -> str:
    """PN's compiled pure functions (what CUDA runs), first call, in a fresh process and inductor cache."""
    code = (
        "import time, torch, hf_powernorm.normalization as n\n"
        f"x = torch.randn(4096, 512, device='{device}', requires_grad=True)\n"
        "mask = torch.ones(4096, dtype=torch.long, device=x.device); mask[::10] = 0\n"
        "norm = n.PowerNorm(512, group_num=4).to(x.device)\n"
        "with n.kernel_backend('compile'):\n"
        "    s = time.perf_counter(); norm(x, mask).sum().backward()\n"
        "torch.cuda.synchronize() if x.is_cuda else None\n"
        "print(time.perf_counter() - s)\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    return f"{float(lines[-1]):.1f}" if lines else f"failed: {out.stderr[-300:]}"


# ----------------------------------------------------------------------------------------------
# Allocator effect


def allocator_table(shapes, repeats, warmup, device) -> tuple[list[str], list[list[str]]]:
    """`F.layer_norm` forward+backward, 1 thread, with glibc's defaults and then with `mallopt`: the
    same work, the time moves with what the allocator does between repeats."""
    rows = []
    for label in ("glibc defaults", "mallopt: no trim, no mmap below 1 GiB"):
        if label.startswith("mallopt"):
            controlled = control_allocator()
            label += "" if controlled else " (mallopt unavailable)"
        row = [label]
        with num_threads(1):
            for tokens, hidden in shapes:
                x, dy, _ = layer_inputs(tokens, hidden, device)
                x.requires_grad_(True)
                weight = torch.ones(hidden, device=device, requires_grad=True)
                bias = torch.zeros(hidden, device=device, requires_grad=True)
                now = clock(device)
                for _ in range(warmup):
                    _layer_norm_step(x, dy, weight, bias)
                times = []
                for _ in range(repeats):
                    start = now()
                    _layer_norm_step(x, dy, weight, bias)
                    times.append(now() - start)
                row.append(f"{statistics.median(times) * 1e3:.2f} ms")
        rows.append(row)
    return ["allocator", *[f"({n}, {c})" for n, c in shapes]], rows


# ----------------------------------------------------------------------------------------------
# Report


def answer_table(header: list[str], train: dict[str, list], evaluation: dict[str, list]) -> list[list[str]]:
    """The two layer tables' median ratios side by side, `train / eval`, for the rows of `ANSWER_ROWS`
    (`train` and `evaluation` as `layer_results` gives them, over the columns of `header`)."""
    def median(result) -> str:
        return "n/a" if result is None else f"{result['ratio']:.2f}"

    for results in (train, evaluation):
        widths = {len(cells) for cells in results.values()}
        if widths - {len(header) - 1}:
            raise ValueError(f"the layer results have {sorted(widths)} cells a row; the header {len(header) - 1}")
    return [[label, *(f"{median(t)} / {median(e)}" for t, e in zip(train[label], evaluation[label]))]
            for label in ANSWER_ROWS if label in train and label in evaluation]


def run(args: argparse.Namespace) -> list[tuple[str, list[str], list[list[str]]]]:
    shapes = QUICK_SHAPES if args.quick else LAYER_SHAPES
    repeats, warmup = (3, 1) if args.quick else (args.repeats, args.warmup)
    if args.norms:  # the layer tables' rows of these norms, nothing else
        control_allocator()
        clock = ", by this thread's CPU time" if args.cpu_time else ""
        return [(f"Layer {what} / F.layer_norm's{clock}: median (25-75%), candidate ms",
                 *layer_table(shapes, args.threads, repeats, warmup, args.device, train=train, norms=args.norms,
                              cpu_time=args.cpu_time))
                for what, train in (("training step (forward + backward)", True), ("eval forward (no_grad)", False))]
    tables = [("Allocator effect: F.layer_norm forward + backward, 1 thread, median ms",
               *allocator_table(shapes, repeats, warmup, args.device))]
    control_allocator()
    header, train = layer_results(shapes, args.threads, repeats, warmup, args.device, train=True,
                                  compiled=args.compile and not args.quick)
    _, evaluation = layer_results(shapes, args.threads, repeats, warmup, args.device, train=False)
    tables.insert(0, (ANSWER_TITLE, header, answer_table(header, train, evaluation)))
    tables.append(("Layer training step (forward + backward) / F.layer_norm's: median (25-75%), candidate ms",
                   header, layer_rows(train)))
    tables.append(("Layer eval forward (no_grad) / F.layer_norm's: median (25-75%), candidate ms",
                   header, layer_rows(evaluation)))
    tables.append(("Memory: saved for backward, and the peak of a training step, / F.layer_norm's",
                   *memory_table(shapes[-1], args.device)))
    tables.append(("Models: time ratios (median, 25-75%), candidate ms; generate: BART's time / ours "
                   "(above 1: ours generates faster)",
                   *model_tables(model_sizes(args.quick), repeats, warmup, args.device,
                                 args.model_threads or args.threads[:1])))
    tables.append(("First-call costs", *first_call_table(args.device, args.quick, args.compile)))
    return tables


def write_section(path: Path, text: str) -> None:
    """Replace what lies between the benchmark markers of `path` (appended if it has none)."""
    content = path.read_text() if path.exists() else ""
    block = f"{MARK_BEGIN}\n{text}\n{MARK_END}"
    if MARK_BEGIN in content and MARK_END in content:
        start, end = content.index(MARK_BEGIN), content.index(MARK_END) + len(MARK_END)
        content = content[:start] + block + content[end:]
    else:
        content = content.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(content)


def main(argv: list[str] | None = None) -> list[tuple[str, list[str], list[list[str]]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads (CPU)")
    parser.add_argument("--model_threads", type=int, nargs="+", default=None,
                        help="torch threads of the model tables (default: the first of --threads; on a shared "
                             "2-core machine a two-thread generate call mostly waits for a core)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats: checks that the suite runs")
    parser.add_argument("--compile", action="store_true",
                        help="also time PN's torch.compile path (CUDA's; on a CPU it needs a C++ compiler and minutes)")
    parser.add_argument("--write", type=Path, default=None, help="rewrite the measured section of this file")
    parser.add_argument("--norms", nargs="+", default=None, metavar="NAME",
                        help="only the layer tables' rows of these registry names (e.g. dyt derf layernorm): "
                             "no allocator, memory or model table; not with --write")
    parser.add_argument("--cpu_time", action="store_true",
                        help="with --norms and --threads 1 on the CPU: time the layer rows by this thread's CPU "
                             "time (on a machine that other jobs share: the time the work ran, not the time it "
                             "waited for a core)")
    args = parser.parse_args(argv)
    if args.norms:
        known = sorted({case[0] for case in LAYER_CASES.values()} & set(NORM_CLASSES))
        unknown = [name for name in args.norms if name not in known]
        if unknown:
            parser.error(f"--norms {' '.join(unknown)}: not a norm of the layer tables; "
                         f"expected some of {', '.join(known)}")
        if args.write is not None:
            parser.error("--norms with --write: the section holds every table; print the rows instead")
    if args.cpu_time and not (args.norms and args.threads == [1] and args.device == "cpu"):
        parser.error("--cpu_time: only with --norms, --threads 1 and --device cpu (one thread's CPU time), got "
                     f"--norms {args.norms}, --threads {args.threads}, --device {args.device}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.device == "cuda":
        args.threads = args.model_threads = [torch.get_num_threads()]
    elif args.quick:
        args.threads = args.threads[:1]
    command = "python -m hf_powernorm.benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    start_load = os.getloadavg()[0]
    tables = run(args)
    text = machine_line(args.device, command.strip(), (start_load, os.getloadavg()[0])) + "\n\n"
    text += "\n".join(markdown(title, header, rows) for title, header, rows in tables)
    print(text)
    if args.write is not None:
        write_section(args.write, text)
    return tables


if __name__ == "__main__":
    main()
