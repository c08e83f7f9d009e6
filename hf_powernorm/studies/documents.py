"""The results tables of the documents (`DOCUMENTS`: STUDIES.md, BENCHMARKS.md, README.md and the
pages of docs/ that hold generated sections), written from the data files under `results/` (and the
example report under docs/).

A generated section of a document sits between `<!-- generated: NAME -->` and
`<!-- end generated -->`. NAME is `STUDY/summary.md#N`, the N-th table (from 1) of a study's
`summary.md` as the study wrote it; `docs/PATH.md#N`, a table of a report kept under docs/; `ANSWER`,
the answer in words (STUDIES.md, the README and docs/studies.md open with the same text): protocol 3's
verdicts once it has them, then the tuned comparison's; or one of `TABLES`, computed here from the
tuned comparison's `results.csv`: PN's rows against LayerNorm, the verdicts over
the binding family of 45 comparisons (with what each could detect), over protocol 2's 29, the
descriptive comparisons between PN's variants, and the paper's claims beside ours; or
`COST_TABLE`, the CPU-hours per run that the tuned comparison's exported cells record; or
`CONVERGENCE_TABLE`, protocol 3's paired differences beside protocol 2's at 4,500 updates, and
`CONVERGENCE_TEXT`, where protocol 3 stands in words.

    python -m hf_powernorm.studies docs            # rewrite every generated section
    python -m hf_powernorm.studies docs --check    # exit 1 naming the documents that differ

The smallest detectable difference of a paired comparison over n seeds, with s the standard
deviation of its per-seed differences and alpha_k = 0.05 / (m - k + 1) the level of its step k in
Holm's procedure over m comparisons (steps in the order of the unadjusted p-values): the mean
difference d at which a two-sided paired t test at level alpha_k rejects with probability 0.8,
d = delta * s / sqrt(n), where delta solves P(|T| > t_{1 - alpha_k / 2, n - 1}) = 0.8 for T
non-central t with n - 1 degrees of freedom and non-centrality delta (computed by integrating the
normal over the chi distribution, below).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from ..training.reports import PairedVerdict, mean_std, paired_cell, paired_verdicts
from ..training.statistics import paired_t_interval, t_quantile
from .runs import STUDY_LM

ROOT = Path(".")  # the repository: the command runs at its top, where the documents are
DOCUMENTS = ("STUDIES.md", "BENCHMARKS.md", "README.md", "docs/compare.md", "docs/compare_executors.md",
             "docs/studies.md", "docs/tuned_comparison.md", "docs/phrasebank_norms.md")
SECTION = re.compile(r"(<!-- generated: (?P<name>[^>]+?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)
SIGNIFICANCE, POWER = 0.05, 0.8

# The tuned comparison's headline scores and comparisons, as `tuned_comparison.summary.md` lists
# them (its constants, repeated here so that documents are written without its training imports).
TASKS = {"ptb": (1500, 4500), "multi30k": (2000, 4000), "tinyshakespeare": (1500, 4500)}
TASK_NAMES = {"ptb": "PTB", "multi30k": "Multi30k", "tinyshakespeare": "tinyshakespeare (PTB's picks)"}
SCORES = {"ptb": (("perplexity", "test perplexity per BPE token, best validated model (lower is better)"),),
          "multi30k": (("bleu_averaged", "test BLEU, average of the last 5 checkpoints (the paper's inference)"),
                       ("bleu", "test BLEU, best validated checkpoint")),
          "tinyshakespeare": (("perplexity", "test perplexity per BPE token, best validated model (lower is better)"),)}
LOWER_IS_BETTER = {"ptb": True, "multi30k": False, "tinyshakespeare": True}
ARMS = {"powernorm": "PN (its picks)", "powernorm-authors": "PN, authors' alphas 0.9/0.9 (own rate, warmup)",
        "powernorm-fwd0.9": "PN, alpha_fwd 0.9 / alpha_bkw 1.0", "powernorm-all": "PN in every layer",
        "rmsnorm": "RMSNorm", "dyt": "DyT", "derf": "Derf"}
BASELINES = {"layernorm": "LayerNorm", "powernorm": "PN (its picks)"}
ELEMENTWISE = ("dyt", "derf")
COMPARED = (*((arm, "layernorm") for arm in ARMS), *((arm, "powernorm") for arm in ELEMENTWISE))
# The models: the studies' LM for the language-model tasks, `recipes/train_wmt.py`'s default
# translation model (2 + 2 layers of width 64) for Multi30k.
LM_MODEL = f"decoder, {STUDY_LM['decoder_layers']} layers, width {STUDY_LM['hidden_size']}"
MODELS = {"ptb": LM_MODEL, "multi30k": "encoder-decoder, 2+2 layers, width 64", "tinyshakespeare": LM_MODEL}


def read_finals(path: Path) -> dict[tuple[str, str, int, str], dict[int, float]]:
    """The finals' test scores of the tuned comparison's `results.csv`: `(task, norm, updates, metric)`
    -> seed -> value."""
    finals: dict[tuple[str, str, int, str], dict[int, float]] = defaultdict(dict)
    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row["stage"] == "final" and row["split"] == "test":
                finals[(row["task"], row["norm"], int(row["updates"]), row["metric"])][int(row["seed"])] = \
                    float(row["value"])
    return dict(finals)


def comparisons(finals: dict, family: Sequence[tuple[str, str]] = COMPARED) -> list[dict]:
    """Every comparison of `family` that has finals on both sides, in the summary's order, with its
    paired verdict and Holm step over them all."""
    found = []
    for task, budgets in TASKS.items():
        for updates in budgets:
            for metric, score in SCORES[task]:
                for arm, against in family:
                    baseline, other = finals.get((task, against, updates, metric)), finals.get((task, arm, updates, metric))
                    if baseline and other:
                        found.append({"task": task, "updates": updates, "metric": metric, "score": score, "arm": arm,
                                      "against": against, "baseline": baseline, "other": other})
    verdicts = paired_verdicts([(c["baseline"], c["other"], LOWER_IS_BETTER[c["task"]]) for c in found])
    order = sorted(range(len(found)), key=lambda i: verdicts[i].interval.p_value)
    steps = {index: step for step, index in enumerate(order, start=1)}
    return [{**c, "verdict": v, "step": steps[i], "family": len(found)} for i, (c, v) in enumerate(zip(found, verdicts))]


def _power(delta: float, df: int, critical: float) -> float:
    """P(|T| > critical) for T non-central t with `df` degrees of freedom and non-centrality `delta`:
    the normal's tails integrated over the chi distribution of the standard deviation's ratio."""
    top = df + 40 * math.sqrt(2 * df) + 40
    x = torch.linspace(0, 1, 2_001, dtype=torch.float64)[1:]
    v = top * x * x  # the chi-square variable, on a grid finest near 0, where the critical value bites
    log_density = (df / 2 - 1) * torch.log(v) - v / 2 - (df / 2) * math.log(2) - math.lgamma(df / 2)
    scale = critical * torch.sqrt(v / df)
    tails = torch.special.ndtr(delta - scale) + torch.special.ndtr(-delta - scale)
    return float(torch.trapezoid(tails * torch.exp(log_density) * 2 * top * x, x))


def detectable_difference(differences: Sequence[float], alpha: float, power: float = POWER) -> float:
    """The smallest mean difference a two-sided paired t test over `differences`' seeds detects with
    probability `power` at level `alpha`, at their standard deviation (the module's formula)."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"a detectable difference needs at least 2 paired differences, got {n}")
    mean = sum(differences) / n
    spread = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    critical = t_quantile(1 - alpha / 2, n - 1)
    low, high = 0.0, 1.0
    while _power(high, n - 1, critical) < power:
        low, high = high, 2 * high
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if _power(middle, n - 1, critical) < power else (low, middle)
    return high * spread / math.sqrt(n)


def _seeds(verdict: PairedVerdict) -> str:
    seeds = sorted(verdict.differences)
    return f"{len(seeds)} ({seeds[0]}-{seeds[-1]})" if seeds == list(range(seeds[0], seeds[-1] + 1)) else \
        f"{len(seeds)} ({', '.join(map(str, seeds))})"


def _verdict_words(c: dict) -> str:
    better = c["verdict"].better
    return {"other": f"{ARMS[c['arm']]} better", "baseline": f"{BASELINES[c['against']]} better",
            "neither": "no difference shown"}[better]


def _spread(verdict: PairedVerdict) -> float:
    values = list(verdict.differences.values())
    mean = sum(values) / len(values)
    return math.sqrt(sum((d - mean) ** 2 for d in values) / (len(values) - 1))


def binding_table(finals: dict) -> list[str]:
    """The verdicts over the binding family (every comparison, 45 when the study is complete), each
    row with its seeds, budget, model, and the smallest difference it could detect at its Holm step."""
    lines = ["| task | updates | model | score | arm | baseline | paired seeds | arm minus baseline, mean "
             "[95% CI] | SD of the differences | p | Holm step | Holm p | detectable at 80% power | verdict |",
             "|---|---:|---|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    found = comparisons(finals)
    for c in found:
        v, alpha = c["verdict"], SIGNIFICANCE / (c["family"] - c["step"] + 1)
        detectable = detectable_difference(list(v.differences.values()), alpha)
        lines.append(f"| {TASK_NAMES[c['task']]} | {c['updates']:,} | {MODELS[c['task']]} | {c['score']} | "
                     f"{ARMS[c['arm']]} | {BASELINES[c['against']]} | {_seeds(v)} | {paired_cell(v)} | "
                     f"{_spread(v):.2f} | {v.interval.p_value:.4f} | {c['step']} of {c['family']} | "
                     f"{v.adjusted_p:.3f} | {detectable:.2f} | {_verdict_words(c)} |")
    unconfirmed = [c for c in found if c["verdict"].better == "neither" and c["verdict"].interval.excludes_zero]
    return [*lines, "", f"{len(unconfirmed)} of the {len(found)} rows show an unadjusted 95% interval that "
                        "excludes zero beside \"no difference shown\"."]


def protocol_table(finals: dict) -> list[str]:
    """Protocol 2's verdicts, adjusted over its own family (DyT and Derf left out: 29 comparisons)."""
    family = [(arm, against) for arm, against in COMPARED if arm not in ELEMENTWISE]
    lines = ["| task | updates | score | arm | LayerNorm | arm's score | arm minus LayerNorm, paired, 95% CI "
             "| paired seeds | Holm p | verdict |", "|---|---:|---|---|---|---|---|---:|---:|---|"]
    for c in comparisons(finals, family):
        v = c["verdict"]
        lines.append(f"| {TASK_NAMES[c['task']]} | {c['updates']:,} | {c['score']} | {ARMS[c['arm']]} | "
                     f"{_mean_std(c['baseline'])} | {_mean_std(c['other'])} | {paired_cell(v)} | "
                     f"{len(v.differences)} | {v.adjusted_p:.3f} | {_verdict_words(c)} |")
    return lines


def _mean_std(by_seed: dict[int, float]) -> str:
    return f"{mean_std(list(by_seed.values()))} ({len(by_seed)} seeds)"


# Descriptive comparisons between PN's variants (outside the verdicts' family): `(arm, against,
# what changes)`.
VARIANTS = (("powernorm-fwd0.9", "powernorm", "alpha_fwd 0.9 in place of PN's pick (same rate, warmup)"),
            ("powernorm-authors", "powernorm-fwd0.9", "alpha_bkw 0.9 in place of 1.0 (and the authors' arm's own rate, warmup)"),
            ("powernorm-authors", "powernorm", "the authors' alphas in place of PN's picks"),
            ("powernorm-all", "powernorm", "PN in every layer in place of PN in the encoder"))


def variants_table(finals: dict) -> list[str]:
    """Each of `VARIANTS` where both have finals: paired differences with their unadjusted 95% t interval."""
    lines = ["| task | updates | score | change | arm minus the other, mean [95% CI] | paired seeds | "
             "seeds where the arm is behind |", "|---|---:|---|---|---|---:|---:|"]
    for task, budgets in TASKS.items():
        for updates in budgets:
            for metric, score in SCORES[task]:
                for arm, against, change in VARIANTS:
                    other, base = finals.get((task, arm, updates, metric)), finals.get((task, against, updates, metric))
                    seeds = sorted(set(other or ()) & set(base or ()))
                    if len(seeds) < 3:
                        continue
                    differences = [other[s] - base[s] for s in seeds]
                    interval = paired_t_interval(differences)
                    behind = sum((d > 0) == LOWER_IS_BETTER[task] and d != 0 for d in differences)
                    lines.append(f"| {TASK_NAMES[task]} | {updates:,} | {score} | {change} | {interval.mean:+.2f} "
                                 f"[{interval.low:+.2f}, {interval.high:+.2f}] | {len(seeds)} | {behind} of {len(seeds)} |")
    return lines


# The paper's Tables 1 and 2 (LayerNorm, PN): BLEU on IWSLT14 and WMT14, per-word test perplexity on
# PTB and WikiText-103; and what here stands for each (None: not run).
PAPER = (("IWSLT14 de-en", "BLEU", 35.5, 35.9, ("multi30k", "bleu_averaged")),
         ("WMT14 en-de", "BLEU", 29.5, 30.1, None),
         ("PTB", "test perplexity per word", 53.2, 47.6, ("ptb", "word_perplexity")),
         ("WikiText-103", "test perplexity per word", 20.9, 17.9, None))


def paper_table(finals: dict) -> list[str]:
    """The paper's four claims beside what was run here, in the paper's units."""
    lines = ["| paper's claim | paper: LayerNorm, PN (PN minus LayerNorm) | run here | task, budget, model, seeds | "
             "ours in the paper's unit: LayerNorm, PN | PN minus LayerNorm, mean [95% CI] (relative) |",
             "|---|---|---|---|---|---|"]
    for name, unit, layernorm, powernorm, ours in PAPER:
        claim = f"{layernorm} and {powernorm} ({powernorm - layernorm:+.1f}, {100 * (powernorm / layernorm - 1):+.1f}%)"
        if ours is None:
            lines.append(f"| {name}, {unit} | {claim} | not run | - | - | - |")
            continue
        task, metric = ours
        for updates in TASKS[task]:
            base, other = finals[(task, "layernorm", updates, metric)], finals[(task, "powernorm", updates, metric)]
            seeds = sorted(set(base) & set(other))
            interval = paired_t_interval([other[s] - base[s] for s in seeds])
            mean_base = sum(base[s] for s in seeds) / len(seeds)
            stand_in = "yes (far smaller model and budget)" if task == "ptb" else \
                "no: Multi30k stands in (29,000 pairs; far smaller model and budget)"
            lines.append(f"| {name}, {unit} | {claim} | {stand_in} | {TASK_NAMES[task]}, {updates:,} updates, "
                         f"{MODELS[task]}, {len(seeds)} seeds | {_mean_std(base)}, {_mean_std(other)} | "
                         f"{interval.mean:+.2f} [{interval.low:+.2f}, {interval.high:+.2f}] "
                         f"({100 * interval.mean / mean_base:+.2f}%) |")
    return lines


# The answer's rows: PN (its picks, the authors' alphas) against LayerNorm, each score named by its unit.
ANSWER_ARMS = {"powernorm": "its picks", "powernorm-authors": "authors' alphas 0.9/0.9"}
UNITS = {"perplexity": "test perplexity per BPE token (lower is better)",
         "bleu_averaged": "test BLEU, average of the last 5 checkpoints",
         "bleu": "test BLEU, best validated checkpoint"}


def _behind(c: dict) -> int:
    """The seeds on which the arm is worse than its baseline."""
    return sum((d > 0) == LOWER_IS_BETTER[c["task"]] and d != 0 for d in c["verdict"].differences.values())


def answer_rows(finals: dict) -> list[dict]:
    """The binding family's rows of PN (`ANSWER_ARMS`) against LayerNorm, each with its detectable difference."""
    rows = [c for c in comparisons(finals) if c["against"] == "layernorm" and c["arm"] in ANSWER_ARMS]
    for c in rows:
        alpha = SIGNIFICANCE / (c["family"] - c["step"] + 1)
        c["detectable"] = detectable_difference(list(c["verdict"].differences.values()), alpha)
    return rows


def answer_table(finals: dict) -> list[str]:
    """PN against LayerNorm per task, budget and score: the binding family's rows, Holm over all of it."""
    rows = answer_rows(finals)
    family = rows[0]["family"] if rows else 0
    lines = [f"| task | updates | score | PN | PN minus LayerNorm, mean [95% CI] | seeds | PN behind on | "
             f"Holm p (of {family}) | verdict | detectable at 80% power |",
             "|---|---:|---|---|---|---|---:|---:|---|---:|"]
    for c in rows:
        v, n = c["verdict"], len(c["verdict"].differences)
        lines.append(f"| {TASK_NAMES[c['task']]} | {c['updates']:,} | {UNITS[c['metric']]} | {ANSWER_ARMS[c['arm']]} | "
                     f"{paired_cell(v)} | {_seeds(v)} | {_behind(c)} of {n} | {v.adjusted_p:.3f} | "
                     f"{_verdict_words(c)} | {c['detectable']:.2f} |")
    return lines


def _interval(c: dict) -> str:
    i = c["verdict"].interval
    return f"{i.mean:+.2f} [{i.low:+.2f}, {i.high:+.2f}]"


def _seed_words(c: dict) -> str:
    n, behind = len(c["verdict"].differences), _behind(c)
    return "behind on every seed" if behind == n else f"behind on {behind} of {n} seeds"


def _row(rows: list[dict], task: str, updates: int, metric: str, arm: str = "powernorm") -> dict:
    return next(c for c in rows if (c["task"], c["updates"], c["metric"], c["arm"]) == (task, updates, metric, arm))


def answer_text(finals: dict) -> list[str]:
    """The answer in words, every figure and verdict taken from the data (STUDIES.md's and the README's)."""
    rows = answer_rows(finals)
    wins = [c for c in rows if c["verdict"].better == "other"]
    losses = [c for c in rows if c["verdict"].better == "baseline"]
    ptb = [_row(rows, "ptb", updates, "perplexity") for updates in TASKS["ptb"]]
    short, long = (_row(rows, "multi30k", updates, "bleu_averaged") for updates in TASKS["multi30k"])
    shown = lambda c: _verdict_words(c) if c["verdict"].better != "neither" else "no difference shown"  # noqa: E731
    text = (
        f"PN against LayerNorm, both tuned alike on validation and scored once on whole test sets, Holm over the "
        f"{rows[0]['family']} comparisons of the tuned comparison: "
        + ("no comparison shows PN better than LayerNorm. " if not wins else
           f"PN better in {len(wins)} of its {len(rows)} rows. ")
        + f"PN at its tuned picks, against LayerNorm, is {_seed_words(ptb[0])} on PTB at {ptb[0]['updates']:,} updates "
        f"({_interval(ptb[0])} "
        f"test perplexity per BPE token, {shown(ptb[0])}) and {_seed_words(ptb[1])} at {ptb[1]['updates']:,} "
        f"({_interval(ptb[1])}, {shown(ptb[1])}); on Multi30k {_seed_words(short)} at {short['updates']:,} updates "
        f"({_interval(short)} BLEU on the paper's averaged checkpoints, {shown(short)}) and at {long['updates']:,} "
        f"{_interval(long)} BLEU, {shown(long)}. "
        + " ".join(f"PN at the authors' alphas: {_verdict_words(c)} on {TASK_NAMES[c['task']]} at {c['updates']:,} "
                   f"updates ({_interval(c)})." for c in losses if c["arm"] == "powernorm-authors")
        + " The scale is small: a 2-layer decoder of width 128 on PTB and tinyshakespeare, a 2+2-layer encoder-decoder "
        "of width 64 on Multi30k, 3 seeds at the short budgets and 5 at the long ones, on a CPU. The paper's PTB gain "
        "does not appear; its IWSLT14, WMT14 and WikiText-103 experiments were not run here.")
    return _wrap(text)


def _wrap(text: str, width: int = 118) -> list[str]:
    lines, current = [], ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > width:
            lines, current = [*lines, current], word
        else:
            current = f"{current} {word}" if current else word
    return [*lines, current]


ANSWER = "the answer"  # protocol 3's verdicts once it has them, then the tuned comparison's answer
TABLES: dict[str, Callable[[dict], list[str]]] = {
    "tuned_comparison: PN against LayerNorm": answer_table,
    "tuned_comparison: binding family": binding_table, "tuned_comparison: protocol 2": protocol_table,
    "tuned_comparison: PN's variants": variants_table, "tuned_comparison: the paper's claims": paper_table}
COST_TABLE = "tuned_comparison: CPU-hours per run"  # from the exported cells, not from results.csv


def cost_table(root: Path) -> list[str]:
    """The CPU-hours of the tuned comparison's runs that record them (`cpu_seconds` in each exported
    `cells/*/result.json`, killed attempts included), per task and budget: runs, median and range."""
    hours: dict[tuple[str, int], list[float]] = defaultdict(list)
    for path in sorted((root / "results" / "tuned_comparison" / "cells").glob("*/result.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        if result.get("cpu_seconds") is not None:
            hours[(result["task"], int(result["updates"]))].append(result["cpu_seconds"] / 3600)
    lines = ["| task | updates per run | runs measured | median CPU-hours per run | range |",
             "|---|---:|---:|---:|---|"]
    for (task, updates), values in sorted(hours.items()):
        lines.append(f"| {task} | {updates} | {len(values)} | {statistics.median(values):.2f} | "
                     f"{min(values):.2f} - {max(values):.2f} |")
    return lines


CONVERGENCE_TABLE = "convergence: beside 4,500 updates"  # protocol 3's pairs beside protocol 2's PTB finals
CONVERGENCE_TEXT = "convergence: where it stands"  # protocol 3's runs, stops and verdicts, in words
# Protocol 3's PN arms, runs (3 arms x seeds 1-5) and cap; `studies.convergence` takes its arms from here
# (documents are written without the study's training imports; a test holds the runs and cap equal).
CONVERGENCE_ARMS = {"powernorm": "PN (its picks)", "powernorm-authors": "PN, authors' alphas 0.9/0.9"}
CONVERGENCE_PLANNED, CONVERGENCE_CAP = 15, 12000


def _convergence_runs(root: Path) -> list[dict]:
    with (root / "results" / "convergence" / "results.csv").open(newline="", encoding="utf-8") as handle:
        return [{**row, "seed": int(row["seed"]), "stopped_at": int(row["stopped_at"]),
                 "best_update": int(row["best_update"]), "test_perplexity": float(row["test_perplexity"])}
                for row in csv.DictReader(handle)]


def convergence_text(root: Path) -> list[str]:
    """Protocol 3 in words, from `convergence/results.csv`: the runs finished, what stopped them, and
    the verdicts over its family of 2 (at least 3 paired seeds each, Holm over the 2)."""
    runs = _convergence_runs(root)
    seeds = {arm: sorted(r["seed"] for r in runs if r["arm"] == arm) for arm in ("layernorm", *CONVERGENCE_ARMS)}
    names = {"layernorm": "LayerNorm", **CONVERGENCE_ARMS}
    text = (f"{len(runs)} of {CONVERGENCE_PLANNED} runs finished ("
            + "; ".join(f"{names[arm]}: seed{'s' if len(found) != 1 else ''} {', '.join(map(str, found))}"
                        for arm, found in seeds.items() if found) + "). ")
    capped = [r for r in runs if r["stopped_by"] == "cap"]
    improving = [r for r in capped if r["best_update"] == r["stopped_at"]]
    if runs and len(improving) == len(runs):
        text += (f"Every one reached the {CONVERGENCE_CAP:,}-update cap with its best validation at its last: these "
                 "runs, too, end short of convergence. ")
    elif runs:
        text += (f"{len(runs) - len(capped)} stopped by the rule (no better validation for 2,000 updates), "
                 f"{len(capped)} by the {CONVERGENCE_CAP:,}-update cap, {len(improving)} of those with its best "
                 "validation at its last. ")
    judged = convergence_verdicts(runs)
    if not judged:
        return _wrap(text + "No verdict before 3 paired seeds of an arm and LayerNorm.")
    text += f"Test perplexity per BPE token, arm minus LayerNorm, paired by seed, Holm over {_family_words(judged)}: "
    text += "; ".join(f"{names[arm]} {paired_cell(v)} over {len(v.differences)} seeds, behind on "
                      f"{sum(d > 0 for d in v.differences.values())}, Holm p {v.adjusted_p:.3f}: "
                      f"{CONVERGED_WORDS[v.better]}" for arm, v in judged) + "."
    return _wrap(text)


CONVERGED_WORDS = {"neither": "no difference shown", "other": "PN better", "baseline": "LayerNorm better"}


def convergence_family(scores: Mapping[str, Mapping[int, float]]) -> list[PairedVerdict]:
    """Protocol 3's family, in the order of `CONVERGENCE_ARMS`: each PN arm's test perplexity against
    LayerNorm's, by seed (`scores[arm][seed]`), a verdict from 3 paired seeds on, Holm over the 2 (an arm
    not judged yet counted at p = 1). The study's summary and these documents both judge through it."""
    return paired_verdicts([(scores.get("layernorm", {}), scores.get(arm, {}), True) for arm in CONVERGENCE_ARMS],
                           min_pairs=3, whole_family=True)


def convergence_verdicts(runs: list[dict]) -> list[tuple[str, PairedVerdict]]:
    """The judged arms of protocol 3's family, from its runs' rows."""
    scores = {arm: {r["seed"]: r["test_perplexity"] for r in runs if r["arm"] == arm}
              for arm in ("layernorm", *CONVERGENCE_ARMS)}
    return [(arm, v) for arm, v in zip(CONVERGENCE_ARMS, convergence_family(scores)) if v.interval is not None]


def _family_words(judged: list) -> str:
    return "the 2" if len(judged) == 2 else "the 2 (the arm not judged yet counted at p = 1)"


def convergence_answer(root: Path, finals: dict) -> list[str]:
    """The answer where training ends, first in the answer once protocol 3 has a verdict (nothing before):
    each judged PN arm against LayerNorm, beside its row at 4,500 updates, and whether the ordering of
    the means held; an ordering that changed opens the paragraph."""
    runs = _convergence_runs(root)
    judged = convergence_verdicts(runs)
    if not judged:
        return []
    rows = answer_rows(finals)
    parts, changed = [], []
    for arm, v in judged:
        before = _row(rows, "ptb", 4500, "perplexity", arm)["verdict"]
        held = (v.interval.mean > 0) == (before.interval.mean > 0)
        changed += [] if held else [CONVERGENCE_ARMS[arm]]
        parts.append(f"{CONVERGENCE_ARMS[arm]} {paired_cell(v)} over {len(v.differences)} seeds, Holm p "
                     f"{v.adjusted_p:.3f}: {CONVERGED_WORDS[v.better]}, against {paired_cell(before)} at 4,500 updates "
                     f"({CONVERGED_WORDS[before.better]} over the {rows[0]['family']}): the ordering of the means "
                     + ("held" if held else f"reversed, PN now {'behind' if v.interval.mean > 0 else 'ahead'}"))
    capped = sum(r["stopped_by"] == "cap" for r in runs)
    capped = "all" if capped == len(runs) else capped
    opening = (f"The ordering changed where training ends, for {' and '.join(changed)}. " if changed else "")
    text = (opening + f"Protocol 3 (PTB trained until validation stops improving or for {CONVERGENCE_CAP:,} updates; "
            f"{len(runs)} of {CONVERGENCE_PLANNED} runs finished, {capped} of them stopped by the cap), "
            f"PN minus LayerNorm in test perplexity per BPE token, paired by seed, Holm over {_family_words(judged)}: "
            + "; ".join(parts) + ".")
    return _wrap(text)


def convergence_table(root: Path) -> list[str]:
    """Each PN arm minus LayerNorm in test perplexity on PTB, paired by seed: at protocol 2's 4,500
    updates (its finals, `tuned_comparison/results.csv`) and trained until validation stops improving
    (protocol 3, `convergence/results.csv`), each over the seeds it has; descriptive (the verdicts over
    protocol 3's family are its summary's first table)."""
    finals = read_finals(root / "results" / "tuned_comparison" / "results.csv")
    converged: dict[str, dict[int, float]] = defaultdict(dict)
    for run in _convergence_runs(root):
        converged[run["arm"]][run["seed"]] = run["test_perplexity"]
    lines = ["| arm | trained | seeds | arm minus LayerNorm, each seed | mean [95% CI] | behind LayerNorm on |",
             "|---|---|---|---|---|---:|"]
    for arm, arm_name in CONVERGENCE_ARMS.items():
        for trained, scores in (("4,500 updates (protocol 2's finals)",
                                 {norm: finals.get(("ptb", norm, 4500, "perplexity"), {}) for norm in ("layernorm", arm)}),
                                ("until validation stops improving (protocol 3)",
                                 {norm: converged.get(norm, {}) for norm in ("layernorm", arm)})):
            seeds = sorted(set(scores["layernorm"]) & set(scores[arm]))
            differences = [scores[arm][seed] - scores["layernorm"][seed] for seed in seeds]
            if not differences:
                lines.append(f"| {arm_name} | {trained} | none yet | - | - | - |")
                continue
            interval = paired_t_interval(differences) if len(differences) >= 2 else None
            mean = "- (one seed)" if interval is None else \
                f"{interval.mean:+.2f} [{interval.low:+.2f}, {interval.high:+.2f}]"
            lines.append(f"| {arm_name} | {trained} | {', '.join(map(str, seeds))} | "
                         f"{', '.join(f'{d:+.2f}' for d in differences)} | {mean} | "
                         f"{sum(d > 0 for d in differences)} of {len(differences)} |")
    return lines


def summary_table(root: Path, name: str) -> list[str]:
    """`STUDY/summary.md#N`: the N-th table of that summary, its lines as written (`docs/...md#N`:
    of that report under docs/, such as `compare`'s example)."""
    path, _, number = name.partition("#")
    tables, current = [], []
    source = root / path if path.startswith("docs/") else root / "results" / path
    for line in source.read_text(encoding="utf-8").splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables, current = [*tables, current], []
    tables += [current] if current else []
    if not number.isdigit() or not 1 <= int(number) <= len(tables):
        raise ValueError(f"{name!r}: {path} has {len(tables)} tables; expected #1 to #{len(tables)}")
    return tables[int(number) - 1]


def section(name: str, root: Path = ROOT, cache: dict | None = None) -> str:
    """The text of the generated section `name` (the lines between its markers)."""
    if name == COST_TABLE:
        return "\n".join(cost_table(root)) + "\n"
    if name == CONVERGENCE_TABLE:
        return "\n".join(convergence_table(root)) + "\n"
    if name == CONVERGENCE_TEXT:
        return "\n".join(convergence_text(root)) + "\n"
    if name in TABLES or name == ANSWER:
        cache = {} if cache is None else cache
        if "finals" not in cache:
            cache["finals"] = read_finals(root / "results" / "tuned_comparison" / "results.csv")
        if name == ANSWER:
            converged = convergence_answer(root, cache["finals"])
            return "\n".join([*converged, ""] * bool(converged) + answer_text(cache["finals"])) + "\n"
        return "\n".join(TABLES[name](cache["finals"])) + "\n"
    if "/summary.md#" in name or name.startswith("docs/") and ".md#" in name:
        return "\n".join(summary_table(root, name)) + "\n"
    raise ValueError(f"unknown generated section {name!r}: expected STUDY/summary.md#N or one of "
                     f"{sorted([ANSWER, *TABLES, COST_TABLE, CONVERGENCE_TABLE, CONVERGENCE_TEXT])}")


def render(text: str, root: Path = ROOT) -> str:
    """`text` with every generated section rewritten from the data."""
    cache: dict = {}
    return SECTION.sub(lambda m: m.group(1) + section(m.group("name"), root, cache) + m.group(4), text)


def sections(text: str) -> list[str]:
    """The names of the generated sections of `text`, in order."""
    return [m.group("name") for m in SECTION.finditer(text)]


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m hf_powernorm.studies docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a document differs from its data")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository holding the documents and results/")
    args = parser.parse_args(argv)
    differing = []
    for name in DOCUMENTS:
        path = args.root / name
        text = path.read_text(encoding="utf-8")
        written = render(text, args.root)
        if written != text:
            differing.append(name)
            if not args.check:
                path.write_text(written, encoding="utf-8")
    if not differing:
        print("every document equals its data")
    else:
        print(f"{'differ from their data' if args.check else 'rewritten from their data'}: {', '.join(differing)}")
    if args.check and differing:
        raise SystemExit(1)
    return differing


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
