"""The report helpers of the studies and `hf-powernorm compare`: `mean ± std` cells for tables,
paired verdicts against a baseline (per-seed differences, their t interval, Holm's adjustment over
the comparisons a report makes; `hf_powernorm.training.statistics`), the seeds a table covers, the
numeric scores of a metrics dict, and CSV tables of result rows."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .statistics import PairedInterval, holm, paired_t_interval


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


def better_of(baseline: Sequence[float], other: Sequence[float], lower_is_better: bool,
              min_seeds: int = 3) -> str | None:
    """Which side's mean over seeds is better beyond the seed spread: `"baseline"` or `"other"` when
    the means differ by more than the two sample standard deviations added together, `"tie"`
    otherwise (a non-finite difference included); None with fewer than `min_seeds` seeds on a side."""
    if min_seeds < 2:
        raise ValueError(f"min_seeds must be at least 2 (a spread needs two seeds), got {min_seeds}")
    if min(len(baseline), len(other)) < min_seeds:
        return None
    difference = statistics.fmean(other) - statistics.fmean(baseline)
    if not math.isfinite(difference) or abs(difference) <= statistics.stdev(baseline) + statistics.stdev(other):
        return "tie"
    return "other" if (difference < 0) == lower_is_better else "baseline"


# The paired rule's defaults: pairs needed for a verdict, and the family-wise error rate.
MIN_PAIRS, SIGNIFICANCE = 3, 0.05


@dataclass(frozen=True)
class PairedVerdict:
    """One comparison against the baseline: `differences` (seed -> other minus baseline, over the
    seeds both have), their t `interval` (None under the pairs needed), the Holm-adjusted p-value
    and `better`: `"other"`, `"baseline"`, `"neither"` (no difference shown), or None (too few pairs)."""

    differences: dict[int, float]
    interval: PairedInterval | None
    adjusted_p: float | None
    better: str | None


def paired_verdicts(comparisons: Sequence[tuple[Mapping[int, float], Mapping[int, float], bool]], *,
                    min_pairs: int = MIN_PAIRS, confidence: float = 1 - SIGNIFICANCE,
                    whole_family: bool = False) -> list[PairedVerdict]:
    """Each `(baseline by seed, other by seed, lower_is_better)`: the differences at the seeds both
    have; with at least `min_pairs`, their mean's t interval at `confidence`; Holm's adjustment over
    every comparison that has one, or with `whole_family` over every comparison given, one without an
    interval yet counted at p = 1 (a pre-registered family judged before all its runs are in: no
    verdict is stronger than the whole family's could be); a side is better when the adjusted p-value
    is below 1 - `confidence` (so its interval excludes zero), else `"neither"`. The verdicts come back
    in the order given."""
    if min_pairs < 2:
        raise ValueError(f"min_pairs must be at least 2 (a t interval needs two pairs), got {min_pairs}")
    differences = [{seed: other[seed] - baseline[seed] for seed in sorted(baseline) if seed in other}
                   for baseline, other, _ in comparisons]
    intervals = [paired_t_interval(list(d.values()), confidence) if len(d) >= min_pairs else None
                 for d in differences]
    tested = [interval.p_value for interval in intervals if interval is not None]
    untested = len(intervals) - len(tested) if whole_family else 0
    adjusted = iter(holm([*tested, *[1.0] * untested])[:len(tested)])
    verdicts = []
    for (_, _, lower_is_better), diffs, interval in zip(comparisons, differences, intervals):
        if interval is None:
            verdicts.append(PairedVerdict(diffs, None, None, None))
            continue
        p_value = next(adjusted)
        better = "neither"
        if p_value < 1 - confidence:
            better = "other" if (interval.mean < 0) == lower_is_better else "baseline"
        verdicts.append(PairedVerdict(diffs, interval, p_value, better))
    return verdicts


def paired_cell(verdict: PairedVerdict, digits: int = 2) -> str:
    """`mean [low, high]` of a comparison's paired differences, signed; `-` without an interval."""
    if verdict.interval is None:
        return "-"
    interval = verdict.interval
    return f"{interval.mean:+.{digits}f} [{interval.low:+.{digits}f}, {interval.high:+.{digits}f}]"


def seeds_of(results: Sequence[dict[str, Any]]) -> list[int]:
    """The seeds that have a run among `results`, in order (for a summary's heading)."""
    return sorted({r["seed"] for r in results})


def numeric_scores(scores: Mapping[str, Any]) -> dict[str, float]:
    """The entries of `scores` that are numbers (booleans and strings left out)."""
    return {k: v for k, v in scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


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


def save_figure(figure: Any, path: str | Path, dpi: int = 100) -> None:
    """Lay `figure` out, write it to `path` at `dpi` and close it (pyplot keeps every open figure)."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
