"""The studies' report helpers: `mean ± std` cells for the summary tables, the seeds a table
covers, and CSV tables of result rows."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def mean_std(values: Sequence[float | None], digits: int = 2, significant: bool = False) -> str:
    """`mean ± std` (sample standard deviation) of the values that are not missing (None or NaN),
    the value alone for one, `-` for none; an infinite value (a diverged run) stays in and shows.
    `digits` decimals, or with `significant` that many significant digits (the std with two)."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    if not present:
        return "-"
    spec, std_spec = (f".{digits}g", ".2g") if significant else (f".{digits}f", f".{digits}f")
    if len(present) == 1:
        return f"{present[0]:{spec}}"
    spread = statistics.stdev(present) if all(math.isfinite(v) for v in present) else math.nan
    return f"{statistics.fmean(present):{spec}} ± {spread:{std_spec}}"


def better_of(baseline: Sequence[float], other: Sequence[float], lower_is_better: bool) -> str | None:
    """Which side's mean over seeds is better beyond the seed spread: `"baseline"` or `"other"` when
    the means differ by more than the two sample standard deviations added together, `"tie"`
    otherwise (a non-finite difference included); None with fewer than two seeds on a side."""
    if min(len(baseline), len(other)) < 2:
        return None
    difference = statistics.fmean(other) - statistics.fmean(baseline)
    if not math.isfinite(difference) or abs(difference) <= statistics.stdev(baseline) + statistics.stdev(other):
        return "tie"
    return "other" if (difference < 0) == lower_is_better else "baseline"


def seeds_of(results: Sequence[dict[str, Any]]) -> list[int]:
    """The seeds that have a run among `results`, in order (for a summary's heading)."""
    return sorted({r["seed"] for r in results})


def write_rows(rows: Sequence[dict[str, Any]], path: str | Path, leave_out: Sequence[str] = (),
               columns: Sequence[str] | None = None) -> None:
    """`rows` as a CSV table: `columns` in that order if given (a row without one leaves its cell
    empty), else every column in first-seen order; `leave_out` columns dropped either way."""
    columns = [c for c in (columns if columns is not None else dict.fromkeys(k for row in rows for k in row))
               if c not in leave_out]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
