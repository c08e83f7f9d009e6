"""Paired statistics for comparing a norm with a baseline: a t interval over seeds, Holm's
adjustment for several comparisons, and a paired bootstrap over sentences for corpus BLEU.

The t distribution is computed here (the regularized incomplete beta by its continued fraction,
Numerical Recipes 6.4, and the quantile by bisection on it), so that scipy is not a dependency.
The bootstrap resamples sentences with a fixed seed and scores each resample from sacreBLEU's own
sufficient statistics (`BLEU.compute_bleu`), so a resample's BLEU is the corpus BLEU sacreBLEU
would report for those sentences; the test is the paired bootstrap of Koehn (2004).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sacrebleu.metrics import BLEU

_BETA_ITERATIONS = 300
_BETA_TOLERANCE = 1e-15
_BISECTION_STEPS = 200


@dataclass(frozen=True)
class PairedInterval:
    """A paired difference (system minus baseline): its estimate `mean`, the interval
    [`low`, `high`] at the confidence asked, the number `n` of pairs (seeds or sentences) and the
    two-sided p-value of "no difference"."""

    mean: float
    low: float
    high: float
    n: int
    p_value: float

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of zero."""
        return self.low > 0 or self.high < 0


def _check_confidence(confidence: float) -> None:
    if not isinstance(confidence, (int, float)) or isinstance(confidence, bool) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be a number strictly between 0 and 1, got {confidence!r}")


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, _BETA_ITERATIONS + 1):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < _BETA_TOLERANCE:
            break
    return fraction


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if a <= 0 or b <= 0:
        raise ValueError(f"the incomplete beta needs a > 0 and b > 0, got a={a!r}, b={b!r}")
    if not 0 <= x <= 1:
        raise ValueError(f"the incomplete beta needs 0 <= x <= 1, got x={x!r}")
    if x in (0, 1):
        return float(x)
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    # The fraction converges fast only below the mean of the beta; above it use the symmetry.
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df!r}")
    if math.isinf(t):
        return 0.0
    return regularized_incomplete_beta(df / 2, 0.5, df / (df + t * t))


def t_quantile(probability: float, df: float) -> float:
    """The `probability` quantile of Student's t with `df` degrees of freedom, by bisection."""
    _check_confidence(probability)
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df!r}")
    if probability == 0.5:
        return 0.0
    tail = 2 * min(probability, 1 - probability)  # two-sided tail mass beyond the quantile
    low, high = 0.0, 1.0
    while t_two_sided_p(high, df) > tail:
        high *= 2
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        if t_two_sided_p(middle, df) > tail:
            low = middle
        else:
            high = middle
        if high - low <= 1e-13 * high:
            break
    quantile = (low + high) / 2
    return quantile if probability > 0.5 else -quantile


def _finite_values(values: Sequence[float], name: str) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    numbers = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must hold numbers, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must hold finite numbers, got {value!r}")
        numbers.append(float(value))
    return numbers


def paired_t_interval(differences: Sequence[float], confidence: float = 0.95) -> PairedInterval:
    """The mean of paired differences (one per seed) with its t interval and two-sided p-value.

    With every difference equal the interval is that one value (p-value 0, or 1 when it is 0).
    """
    values = _finite_values(differences, "differences")
    _check_confidence(confidence)
    n = len(values)
    if n < 2:
        raise ValueError(f"a t interval needs at least 2 paired differences, got {n}")
    mean = math.fsum(values) / n
    deviation = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    if deviation == 0:
        return PairedInterval(mean, mean, mean, n, 1.0 if mean == 0 else 0.0)
    error = deviation / math.sqrt(n)
    half_width = t_quantile(0.5 + confidence / 2, n - 1) * error
    p_value = t_two_sided_p(mean / error, n - 1)
    return PairedInterval(mean, mean - half_width, mean + half_width, n, p_value)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest of m is
    multiplied by m - i + 1, kept at least its predecessor's and at most 1."""
    values = _finite_values(p_values, "p_values")
    if any(not 0 <= p <= 1 for p in values):
        raise ValueError(f"p-values must lie in [0, 1], got {values}")
    order = sorted(range(len(values)), key=values.__getitem__)
    adjusted = [0.0] * len(values)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(values) - rank) * values[index]))
        adjusted[index] = running
    return adjusted


def _check_sentences(name: str, sentences: Sequence[str], length: int | None) -> None:
    if isinstance(sentences, str) or not isinstance(sentences, Sequence):
        raise TypeError(f"{name} must be a sequence of strings, got {type(sentences).__name__}")
    if not all(isinstance(s, str) for s in sentences):
        raise TypeError(f"{name} must hold strings only")
    if length is not None and len(sentences) != length:
        raise ValueError(f"{name} has {len(sentences)} sentences, the references {length}")


def sentence_bleu_statistics(metric: BLEU, hypotheses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """sacreBLEU's sufficient statistics of each sentence under `metric`, one row each:
    (sys_len, ref_len, correct 1..n-grams, total 1..n-grams)."""
    rows = []
    for hypothesis, reference in zip(hypotheses, references):
        score = metric.corpus_score([hypothesis], [[reference]])
        rows.append([score.sys_len, score.ref_len, *score.counts, *score.totals])
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), 2 + 2 * metric.max_ngram_order)


def corpus_bleu_from_statistics(metric: BLEU, statistics: np.ndarray) -> float:
    """Corpus BLEU of summed sentence statistics, by sacreBLEU's own formula and `metric`'s options."""
    order = metric.max_ngram_order
    sums = [int(round(v)) for v in statistics.sum(axis=0)]
    return BLEU.compute_bleu(sums[2:2 + order], sums[2 + order:], sums[0], sums[1],
                             smooth_method=metric.smooth_method, smooth_value=metric.smooth_value,
                             effective_order=metric.effective_order, max_ngram_order=order).score


def paired_bootstrap_bleu(baseline: Sequence[str], system: Sequence[str], references: Sequence[str],
                          samples: int = 1000, seed: int = 12345, confidence: float = 0.95,
                          **bleu_options: Any) -> PairedInterval:
    """Paired bootstrap over sentences of corpus BLEU, system minus baseline (one reference each).

    `mean` is the observed difference, [`low`, `high`] the percentile interval of the resampled
    differences, `n` the number of sentences, and `p_value` the share of resampled differences,
    shifted to a mean of zero, at least as far from zero as the observed one (plus one, over
    `samples` plus one). `bleu_options` go to `sacrebleu.metrics.BLEU` (e.g. `lowercase=True`).
    """
    _check_sentences("references", references, None)
    _check_sentences("baseline", baseline, len(references))
    _check_sentences("system", system, len(references))
    _check_confidence(confidence)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    if not references:
        raise ValueError("a bootstrap needs at least one sentence, got none")
    metric = BLEU(**bleu_options)
    baseline_stats = sentence_bleu_statistics(metric, baseline, references)
    system_stats = sentence_bleu_statistics(metric, system, references)

    def difference(rows: Any) -> float:
        return (corpus_bleu_from_statistics(metric, system_stats[rows])
                - corpus_bleu_from_statistics(metric, baseline_stats[rows]))

    observed = difference(slice(None))
    indices = np.random.default_rng(seed).integers(0, len(references), size=(samples, len(references)))
    differences = np.array([difference(rows) for rows in indices])
    tail = (1 - confidence) / 2
    low, high = np.quantile(differences, [tail, 1 - tail])
    extreme = np.abs(differences - differences.mean()) >= abs(observed) - 1e-12
    p_value = (int(extreme.sum()) + 1) / (samples + 1)
    return PairedInterval(float(observed), float(low), float(high), len(references), float(p_value))


__all__ = [
    "PairedInterval",
    "corpus_bleu_from_statistics",
    "holm",
    "paired_bootstrap_bleu",
    "paired_t_interval",
    "regularized_incomplete_beta",
    "sentence_bleu_statistics",
    "t_quantile",
    "t_two_sided_p",
]
