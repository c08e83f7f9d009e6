"""Paired statistics: the t distribution against published values, the t interval and Holm's
adjustment on inputs whose answers are known in closed form, and the BLEU bootstrap against
sacreBLEU's own corpus score."""

import math
import random

import pytest
from sacrebleu.metrics import BLEU

from hf_powernorm.training.statistics import (
    corpus_bleu_from_statistics,
    holm,
    paired_bootstrap_bleu,
    paired_t_interval,
    regularized_incomplete_beta,
    sentence_bleu_statistics,
    t_quantile,
    t_two_sided_p,
)

# Student's t 0.975 quantiles (any statistics table, e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2).
T_975 = {1: 12.706204736, 2: 4.302652730, 4: 2.776445105, 10: 2.228138852, 30: 2.042272456}


@pytest.mark.parametrize("df, expected", sorted(T_975.items()))
def test_t_quantile_matches_the_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-8)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-8)


def test_t_quantile_other_levels():
    assert t_quantile(0.95, 4) == pytest.approx(2.131846786, abs=1e-8)
    assert t_quantile(0.995, 3) == pytest.approx(5.840909309, abs=1e-8)
    assert t_quantile(0.5, 7) == 0.0


def test_t_p_value_closed_forms():
    # df 1 is Cauchy: P(|T| >= t) = 1 - 2 atan(t) / pi; df 2: 1 - t / sqrt(2 + t^2).
    for t in (0.3, 1.0, 2.5, 9.0):
        assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, abs=1e-12)
        assert t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)
    assert t_two_sided_p(2.0, 5) == pytest.approx(0.1019394788, abs=1e-9)
    assert t_two_sided_p(0.0, 5) == pytest.approx(1.0)


def test_incomplete_beta_closed_forms():
    # I_x(a, 1) = x^a and I_x(1, b) = 1 - (1 - x)^b.
    for x in (0.05, 0.4, 0.93):
        assert regularized_incomplete_beta(2.5, 1, x) == pytest.approx(x ** 2.5, abs=1e-12)
        assert regularized_incomplete_beta(1, 3.5, x) == pytest.approx(1 - (1 - x) ** 3.5, abs=1e-12)
    with pytest.raises(ValueError, match="0 <= x <= 1"):
        regularized_incomplete_beta(1, 1, 1.5)


def test_paired_t_interval_known_interval():
    # mean 2, sd 1, n 3: half-width t(0.975, 2) / sqrt(3); t = 2 sqrt(3), p = 1 - sqrt(12 / 14).
    interval = paired_t_interval([1.0, 2.0, 3.0])
    half = T_975[2] / math.sqrt(3)
    assert (interval.mean, interval.n) == (2.0, 3)
    assert interval.low == pytest.approx(2 - half, abs=1e-8)
    assert interval.high == pytest.approx(2 + half, abs=1e-8)
    assert interval.p_value == pytest.approx(1 - math.sqrt(12 / 14), abs=1e-12)
    assert not interval.excludes_zero


def test_paired_t_interval_five_seeds_excludes_zero():
    differences = [-0.4, -0.7, -0.2, -0.5, -0.6]
    interval = paired_t_interval(differences, confidence=0.90)
    mean = sum(differences) / 5
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / 4)
    half = 2.131846786 * sd / math.sqrt(5)
    assert interval.low == pytest.approx(mean - half, abs=1e-8)
    assert interval.high == pytest.approx(mean + half, abs=1e-8)
    assert interval.excludes_zero and interval.high < 0
    assert interval.p_value == pytest.approx(t_two_sided_p(mean / (sd / math.sqrt(5)), 4), abs=1e-15)
    assert interval.p_value < 0.10


def test_paired_t_interval_equal_differences():
    same = paired_t_interval([0.5, 0.5, 0.5])
    assert (same.low, same.high, same.p_value) == (0.5, 0.5, 0.0)
    assert paired_t_interval([0.0, 0.0]).p_value == 1.0


@pytest.mark.parametrize("bad, error, message", [
    ([1.0], ValueError, "at least 2"),
    ([1.0, float("nan")], ValueError, "finite"),
    ([1.0, "2"], TypeError, "numbers"),
    ("12", TypeError, "sequence"),
])
def test_paired_t_interval_rejects_bad_input(bad, error, message):
    with pytest.raises(error, match=message):
        paired_t_interval(bad)


def test_paired_t_interval_rejects_bad_confidence():
    with pytest.raises(ValueError, match="between 0 and 1"):
        paired_t_interval([1.0, 2.0], confidence=95)


def test_holm_known_adjustment():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> monotone 0.06.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])
    assert holm([0.02]) == pytest.approx([0.02])
    assert holm([]) == []
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm([0.2, 1.5])


WORDS = "the a cat dog sat on mat ran fast slow big red".split()


def _corpus(seed=0, sentences=120):
    rng = random.Random(seed)
    references = [" ".join(rng.choices(WORDS, k=rng.randint(3, 11))) for _ in range(sentences)]

    def noisy(rate):
        return [" ".join(w if rng.random() > rate else rng.choice(WORDS) for w in r.split())
                for r in references]

    return references, noisy(0.45), noisy(0.25)


@pytest.mark.parametrize("options", [{}, {"lowercase": True}])
def test_sentence_statistics_give_sacrebleus_corpus_score(options):
    references, worse, _ = _corpus()
    worse = [s.upper() if i % 3 == 0 else s for i, s in enumerate(worse)]
    metric = BLEU(**options)
    stats = sentence_bleu_statistics(metric, worse, references)
    assert stats.shape == (len(references), 10)
    assert corpus_bleu_from_statistics(metric, stats) == pytest.approx(
        BLEU(**options).corpus_score(worse, [references]).score, abs=1e-9)


def test_paired_bootstrap_finds_the_better_system():
    references, worse, better = _corpus()
    result = paired_bootstrap_bleu(worse, better, references, samples=300, seed=7)
    observed = BLEU().corpus_score(better, [references]).score - BLEU().corpus_score(worse, [references]).score
    assert result.mean == pytest.approx(observed, abs=1e-9)
    assert result.n == len(references)
    assert 0 < result.low < result.mean < result.high
    assert result.p_value == pytest.approx(1 / 301)
    reverse = paired_bootstrap_bleu(better, worse, references, samples=300, seed=7)
    assert reverse.mean == pytest.approx(-result.mean) and reverse.high < 0
    assert paired_bootstrap_bleu(worse, better, references, samples=300, seed=7) == result


def test_paired_bootstrap_of_a_system_against_itself():
    references, worse, _ = _corpus(seed=3, sentences=40)
    same = paired_bootstrap_bleu(worse, worse, references, samples=50)
    assert (same.mean, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)


def test_paired_bootstrap_rejects_bad_input():
    references, worse, better = _corpus(sentences=10)
    with pytest.raises(ValueError, match="9 sentences, the references 10"):
        paired_bootstrap_bleu(worse[:9], better, references)
    with pytest.raises(ValueError, match="samples"):
        paired_bootstrap_bleu(worse, better, references, samples=0)
    with pytest.raises(TypeError, match="strings"):
        paired_bootstrap_bleu(worse, [1] * 10, references)
