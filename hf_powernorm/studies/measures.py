"""What the studies measure in a run's training log: the loss per update, the first update whose
loss was not finite, and the loss jump at PN's switch from batch to running statistics (the end of
its warmup, Algorithm 2)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..training.run_log import read_run_log

# The loss jump at PN's switch: means over WINDOW updates either side, the peak over PEAK_WINDOW after.
WINDOW, PEAK_WINDOW = 10, 50


def training_losses(folder: str | Path) -> dict[int, float | None]:
    """The run's training loss per update from its log (None where it was not finite)."""
    return {r["step"]: r["loss"] for r in read_run_log(folder) if "loss" in r}


def first_nonfinite_update(losses: dict[int, float | None]) -> int | None:
    """The first update whose training loss was not finite (NaN or infinite), or None."""
    return next((step for step in sorted(losses) if losses[step] is None or not math.isfinite(losses[step])), None)


def loss_jump(losses: dict[int, float | None], warmup_steps: int) -> dict[str, float]:
    """The training loss around the first update after warmup (`warmup_steps + 1`): the mean of the
    `WINDOW` updates after it minus that of the `WINDOW` before, and the largest excess over the
    pre-switch mean within `PEAK_WINDOW` updates. NaN without updates on both sides."""
    def window(first: int, last: int) -> list[float]:
        return [losses[s] for s in range(first, last + 1) if losses.get(s) is not None]

    before = window(warmup_steps - WINDOW + 1, warmup_steps)
    after = window(warmup_steps + 1, warmup_steps + WINDOW)
    if warmup_steps < 1 or not before or not after:
        return {"loss_jump": float("nan"), "loss_peak_excess": float("nan")}
    reference = statistics.fmean(before)
    later = window(warmup_steps + 1, warmup_steps + PEAK_WINDOW)
    return {"loss_jump": statistics.fmean(after) - reference, "loss_peak_excess": max(later) - reference}
