"""A norm layer's eager training step: what the device spends on it against what the host does.

    python -m hf_powernorm.benchmarks.host_cost [--device cuda] [--quick] [--profile STEPS]

On a GPU a layer's step is bounded by whichever is slower: the device running its kernels, or the
host issuing them (Python, autograd, dispatch, `torch.compile`'s guards and wrappers, launches).
For each norm and shape this prints one markdown table:
- `step`: the step (forward + backward, fresh gradients) with the device synchronised after each
  batch of steps, and its ratio to `F.layer_norm`'s, interleaved batch by batch (median, 25-75%);
- `host`: the host's time to issue one step, timed without waiting for the device (the batch is
  synchronised only before and after), median over the batches: where it is close to `step`, the
  step is host-bound and a faster kernel would not show;
- `device ops`: kernels and copies the device runs per step (`torch.profiler`, CUDA only).
Norms: `F.layer_norm`, the registry's LayerNorm module, PN on its path for the device (CUDA: its
`hf_powernorm::pn_step_*` operators on the Triton kernels; eager CPU: direct calls of the C
kernels), PN in torch ops (`kernel_backend("torch")`), masked BatchNorm, DyT and Derf on their path
for the device (the Triton kernels on CUDA, the C kernels on the CPU) and DyT in torch ops.
`--profile STEPS` then runs that many of PN's steps (G=4, its path for the device, the first shape)
under `cProfile` and prints the functions the host spends them in, by their own time: where the
host's time per step goes, function by function (the profiler's own cost inflates every row).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ..normalization import build_norm
from .suite import c_kernels, layer_inputs
from .timing import machine_line, markdown, progress

CASES = {
    "powernorm G=4": ("powernorm", {"group_num": 4}, True),
    "powernorm G=4, torch ops": ("powernorm", {"group_num": 4}, False),
    "layernorm (registry)": ("layernorm", {}, True),
    "batchnorm (masked)": ("batchnorm", {}, True),
    "dyt": ("dyt", {}, True),
    "dyt, torch ops": ("dyt", {}, False),
    "derf": ("derf", {}, True),
}
SHAPES = ((4096, 512), (16384, 1024))
QUICK_SHAPES = ((64, 32),)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(module, x, dy, mask, parameters, kernels):
    def step():
        with c_kernels(kernels):
            for tensor in (x, *parameters):
                tensor.grad = None
            (module(x, mask) if module is not None else F.layer_norm(x, x.shape[-1:], *parameters)).backward(dy)
    return step


def _timed(step, steps: int, device: str) -> tuple[float, float]:
    """(seconds per step synchronised, seconds per step the host took to issue them)."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    issued = time.perf_counter()
    _synchronize(device)
    return (time.perf_counter() - start) / steps, (issued - start) / steps


def device_ops(step, device: str, steps: int = 5) -> float | None:
    """Kernels and copies the device runs per step (None off CUDA)."""
    if device != "cuda":
        return None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        _synchronize(device)
    return sum(event.count for event in profiler.key_averages()
               if event.device_type == torch.autograd.DeviceType.CUDA) / steps


def _case_step(label: str, x: torch.Tensor, dy: torch.Tensor, mask: torch.Tensor | None):
    """The training step of `CASES[label]`'s norm, built fresh on `x`'s device, on these inputs."""
    name, options, kernels = CASES[label]
    module = build_norm(name, x.shape[-1], **options).to(x.device).train()
    return _step(module, x, dy, mask, list(module.parameters()), kernels)


def run(shapes, device: str, repeats: int, steps: int, warmup: int) -> tuple[list[str], list[list[str]]]:
    header = ["norm", "shape", "step, ms", "step / F.layer_norm's", "host issue, ms", "device ops per step"]
    rows = []
    for tokens, hidden in shapes:
        x, dy, mask = layer_inputs(tokens, hidden, device)  # the suite's layer inputs
        x.requires_grad_()
        weight = torch.ones(hidden, device=device, requires_grad=True)
        bias = torch.zeros(hidden, device=device, requires_grad=True)
        baseline = _step(None, x, dy, mask, [weight, bias], True)
        candidates = {"F.layer_norm": baseline}
        for label in CASES:
            candidates[label] = _case_step(label, x, dy, mask)
        for label, step in candidates.items():
            progress(f"host cost, {device}, ({tokens}, {hidden}), {label}")
            for _ in range(warmup):  # compiles PN's functions on CUDA
                step()
            times, hosts, ratios = [], [], []
            for _ in range(repeats):
                seconds, host = _timed(step, steps, device)
                base, _ = _timed(baseline, steps, device)
                times.append(seconds)
                hosts.append(host)
                ratios.append(seconds / base)
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            ops = device_ops(step, device)
            rows.append([label, f"({tokens}, {hidden})", f"{statistics.median(times) * 1e3:.3f}",
                         f"{statistics.median(ratios):.2f} ({quartiles[0]:.2f}-{quartiles[2]:.2f})",
                         f"{statistics.median(hosts) * 1e3:.3f}", "-" if ops is None else f"{ops:.0f}"])
    return header, rows


def profile(shape: tuple[int, int], device: str, steps: int, warmup: int, top: int = 30) -> str:
    """`cProfile` of `steps` eager training steps of PN (G=4, its path for the device): the `top`
    functions by their own time, with their calls over all `steps`, as `pstats` prints them."""
    tokens, hidden = shape
    x, dy, mask = layer_inputs(tokens, hidden, device)
    step = _case_step("powernorm G=4", x.requires_grad_(), dy, mask)
    for _ in range(warmup):
        step()
    _synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    _synchronize(device)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return (f"Host profile of {steps} steps of powernorm G=4 at ({tokens}, {hidden}) on {device}, "
            f"by own time (divide by {steps} for a step):\n\n```\n{out.getvalue().strip()}\n```\n")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=11, help="batches of steps per norm and shape")
    parser.add_argument("--steps", type=int, default=20, help="steps per batch")
    parser.add_argument("--warmup", type=int, default=20, help="steps before timing (compiling included)")
    parser.add_argument("--quick", action="store_true", help="one tiny shape, 3 batches of 2 steps: checks that it runs")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile this many of PN's steps on the host (cProfile; default: none)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    for option in ("repeats", "steps"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1; got {getattr(args, option)}")
    if args.profile < 0:
        parser.error(f"--profile must be a number of steps (0: none); got {args.profile}")
    shapes, repeats, steps, warmup = ((QUICK_SHAPES, 3, 2, 1) if args.quick
                                      else (SHAPES, args.repeats, args.steps, args.warmup))
    command = "python -m hf_powernorm.benchmarks.host_cost " + " ".join(argv if argv is not None else sys.argv[1:])
    start_load = os.getloadavg()[0]
    header, rows = run(shapes, args.device, repeats, steps, warmup)
    text = machine_line(args.device, command.strip(), (start_load, os.getloadavg()[0])) + "\n\n"
    text += markdown("Eager layer training step: device and host, median (25-75%)", header, rows)
    if args.profile:
        text += "\n" + profile(shapes[0], args.device, args.profile, warmup)
    print(text)
    return text


if __name__ == "__main__":
    main()
