"""The studies' language model's training step on the CPU: its median time, or where the time goes.

    python -m hf_powernorm.benchmarks.study_step [--norm powernorm] [--steps 15] [--profile | --against layernorm]

The model of the LM studies (`studies.runs.STUDY_LM`, PTB's vocabulary of 4,000) in the tuned
comparison's regime (dropout 0.3, label smoothing 0.1, 2,048 tokens a step as 16 blocks of 128), one
thread, random tokens; a step is forward, the studies' loss (`training.losses.causal_lm_loss`),
backward and AdamW. Without `--profile` it prints the median step time after warm-up steps; with it,
`torch.profiler`'s self time per step by category; with `--against NORM`, the ratio of the step's time
to the same model's with NORM, the two steps interleaved in one process (the suite's protocol: median
and 25-75% of the per-pair ratios), which the machine's load moves far less than two runs' times. To compare two versions of the code, run it from
each checkout in turn, alternating, since the machine's load moves: `PYTHONPATH=<checkout> python
hf_powernorm/benchmarks/study_step.py` times that checkout's library with this file.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

# The step's data: 2,048 tokens as 16 blocks of 128, PTB's vocabulary (the profile's categories read
# these shapes).
BATCH, LENGTH, VOCAB = 16, 128, 4000
CATEGORIES = (
    "linear layers and output projection (mm, addmm)",
    "loss (log-softmax, NLL, smoothing, their backward, copies of the logits)",
    "dropout masks",
    "attention (scores, softmax, weighted sum)",
    "norms",
    "optimizer (AdamW)",
    "other elementwise ops, dropout's multiplications, embedding",
)


def build_step(norm: str):
    # Absolute imports: run as a file with PYTHONPATH=<checkout>, this times that checkout's library.
    from hf_powernorm.configuration_powernorm import PowerNormTransformerConfig
    from hf_powernorm.modeling_powernorm import PowerNormTransformerForCausalLM
    from hf_powernorm.studies.runs import STUDY_LM
    from hf_powernorm.training.losses import causal_lm_loss

    config = PowerNormTransformerConfig(**{**STUDY_LM, "dropout": 0.3}, vocab_size=VOCAB, max_position_embeddings=256,
                                        decoder_norm_type=norm, encoder_norm_type=norm, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = PowerNormTransformerForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = causal_lm_loss(0.1)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(model, inputs).backward()
        optimizer.step()
    return step


@functools.cache
def _shapes() -> tuple[tuple[str, ...], str]:
    """The profiler's spelling of the logits' shapes (full and shifted, flat and not) and the attention
    probabilities' shape of this step."""
    from hf_powernorm.studies.runs import STUDY_LM

    tokens = BATCH * LENGTH
    rows = (f"[{tokens}", f"[{tokens - BATCH}", f"[{BATCH}, {LENGTH}", f"[{BATCH}, {LENGTH - 1}")
    return tuple(f"{row}, {VOCAB}]" for row in rows), f"[{BATCH}, {STUDY_LM['num_attention_heads']}, {LENGTH}, {LENGTH}]"


def category(name: str, shapes: str) -> str:
    logit_shapes, attention = _shapes()
    logits = any(shape in shapes for shape in logit_shapes)
    if name in ("aten::mm", "aten::addmm"):
        return CATEGORIES[0]
    if logits or "SmoothedCrossEntropy" in name or "nll" in name or "log_softmax" in name:
        return CATEGORIES[1]
    if name in ("aten::bernoulli_", "aten::uniform_", "aten::ge_", "aten::div_") or (
            name == "aten::mul_" and "[]" in shapes and str(VOCAB) not in shapes):
        return CATEGORIES[2]
    if name in ("aten::bmm", "aten::_softmax", "aten::_softmax_backward_data", "aten::all", "aten::where",
                "aten::_safe_softmax") or attention in shapes:
        return CATEGORIES[3]
    if "Norm" in name or "layer_norm" in name:  # the norms' autograd functions and torch's layer_norm
        return CATEGORIES[4]
    if "Optimizer" in name or "foreach" in name or name in ("aten::lerp_", "aten::addcdiv_", "aten::addcmul_", "aten::sqrt"):
        return CATEGORIES[5]
    return CATEGORIES[6]


def profile(step, steps: int) -> dict[str, float]:
    """Milliseconds of self time per step, by category, and the total under `"step"`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.key_averages(group_by_input_shape=True):
        totals[category(event.key, str(event.input_shapes))] += event.self_cpu_time_total / steps / 1e3
    totals["step"] = sum(totals.values())
    return totals


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--norm", default="powernorm", help="the LM's norm (a name of NORM_CLASSES)")
    parser.add_argument("--steps", type=int, default=15, help="timed (or profiled) steps, after 3 warm-up steps")
    parser.add_argument("--profile", action="store_true", help="self time by category instead of the median step")
    parser.add_argument("--against", default=None, metavar="NORM",
                        help="the step's time over the same model's with NORM, interleaved (e.g. layernorm)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1; got {args.steps}")
    if args.profile and args.against:
        parser.error("--profile and --against: one at a time")
    from hf_powernorm.normalization import normalize_norm_name

    for option in ("norm", "against"):
        if getattr(args, option) is not None:
            try:
                normalize_norm_name(getattr(args, option))
            except ValueError as error:
                parser.error(f"--{option}: {error}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace) -> dict[str, float]:
    step = build_step(args.norm)
    if args.against:
        from hf_powernorm.benchmarks.timing import cell, interleaved

        result = interleaved(step, build_step(args.against), args.steps, 3, "cpu")
        print(f"{args.norm} / {args.against}: {cell(result)} over {args.steps} pairs of steps")
        return result
    for _ in range(3):
        step()
    if args.profile:
        totals = profile(step, args.steps)
        for name in CATEGORIES:
            print(f"{name}: {totals[name]:.1f} ms ({100 * totals[name] / totals['step']:.1f}%)")
        print(f"step, profiled: {totals['step']:.1f} ms")
        return totals
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times) * 1e3
    print(f"{args.norm}: median step {median:.1f} ms over {args.steps} steps")
    return {"step": median}


if __name__ == "__main__":
    main()
