"""Layer benchmark: forward+backward time of every norm relative to `F.layer_norm`, in one run.

    python -m hf_powernorm.bench_norms [--tokens 4096] [--hidden 512] [--padding 0.1] [--repeats 30]

Each norm runs in training mode on the same float32 `(tokens, hidden)` input with the given fraction
of padding tokens; the figure is the median of `--repeats` timed forward+backward passes, after
warm-up, divided by the median of `torch.nn.functional.layer_norm` measured interleaved in the
same run (the machine may be shared and noisy, so only ratios are compared).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from . import normalization
from .normalization import NORM_CLASSES, build_norm


def _layer_norm_step(x, dy, weight, bias):
    F.layer_norm(x, (x.shape[-1],), weight, bias).backward(dy)


def _make_cases(group_num: int) -> dict[str, tuple[str, dict]]:
    """Label -> (registry name, options): every norm with defaults, plus PowerNorm variants."""
    cases = {name: (name, {}) for name in NORM_CLASSES}
    cases["groupnorm"] = ("groupnorm", {"group_num": group_num})
    cases[f"powernorm G={group_num}"] = ("powernorm", {"group_num": group_num})
    cases["powernorm no GS"] = ("powernorm", {"group_num": None})
    cases["powernorm batch den."] = ("powernorm", {"backward_denominator": "batch"})
    cases["powernorm torch ops"] = ("powernorm", {})  # the fused CPU kernels switched off
    return cases


@contextlib.contextmanager
def _kernels(enabled: bool):
    original = normalization.kernels_usable
    if not enabled:
        normalization.kernels_usable = lambda x: False
    try:
        yield
    finally:
        normalization.kernels_usable = original


def _with_kernels(enabled: bool, fn):
    with _kernels(enabled):
        fn()


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run(tokens: int, hidden: int, padding: float, repeats: int, group_num: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, requires_grad=True)
    dy = torch.randn(tokens, hidden)
    mask = (torch.rand(tokens) >= padding).long()
    weight = torch.ones(hidden, requires_grad=True)
    bias = torch.zeros(hidden, requires_grad=True)
    baseline = lambda: _layer_norm_step(x, dy, weight, bias)  # noqa: E731
    rows = []
    for label, (name, options) in _make_cases(group_num).items():
        norm = build_norm(name, hidden, **options)
        norm.train()
        eager = label.endswith("torch ops")
        step = lambda: _with_kernels(not eager, lambda: norm(x, mask).backward(dy))  # noqa: E731
        for _ in range(5):
            step(), baseline()
        ours, base = [], []
        for _ in range(repeats):  # interleaved, so drift in machine load hits both
            ours += _time(step, 1)
            base += _time(baseline, 1)
        ratio = statistics.median(o / b for o, b in zip(ours, base))
        rows.append((label, statistics.median(ours) * 1e3, ratio))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--padding", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--group_num", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads; input ({args.tokens}, {args.hidden}) float32, "
        f"{args.padding:.0%} padding; forward+backward, median of {args.repeats}"
    )
    print(f"{'norm':<22}{'ms':>9}{'x layer_norm':>15}")
    for label, ms, ratio in run(args.tokens, args.hidden, args.padding, args.repeats, args.group_num):
        print(f"{label:<22}{ms:>9.3f}{ratio:>15.2f}")


if __name__ == "__main__":
    main()
