"""The outputs of a comparison: `results.csv` (a row per run and evaluated split), `report.md` (the
table over seeds, the verdicts, the checks, samples, settings) and `validation_curves.png`.

A norm's verdict against the first comes from `training.reports.paired_verdicts`: the paired test
differences over the seeds, their 95% t interval, Holm's adjustment over the comparisons made. A
norm whose test scores, and each update's training loss, equal the baseline's within a relative
`SAME_FUNCTION_TOLERANCE` in every seed computes the same function (RMSNorm in place of a Llama's
own `LlamaRMSNorm`, differing by rounding): it gets no verdict row and is left out of Holm's family.
A comparison whose runs fail a check (`run_flags`), or whose arms differ in anything but their norms
at the same seed (`invariant_flags`: trainable parameters outside the norms, head tying, updates,
training and evaluation tokens, the data order, the schedule), is shown with no verdict.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .options import BASELINE, BASELINE_AGAIN, CompareOptions, task_class

SPLITS = ("validation", "test")
SHORT_NAMES = {"powernorm": "PN", "rmsnorm": "RMSNorm", "batchnorm": "BN"}
CONFIDENCE = 0.95  # of the paired interval a verdict is read from
MIN_PAIRS = 2  # seeds run by both norms for a verdict
SAME_FUNCTION_TOLERANCE = 1e-6  # relative difference of test scores under which two norms compute the same function


def result_rows(results: Sequence[dict[str, Any]], chosen: dict[str, float]) -> list[dict[str, Any]]:
    """One row per run and evaluated split; `chosen` marks the runs at each norm's chosen rate
    (the others are the `--tune_lr` grid's)."""
    rows = []
    for result in results:
        for split in SPLITS:
            scores = {k[len(split) + 1:]: v for k, v in result["scores"].items() if k.startswith(f"{split}_")}
            if scores:
                rows.append({"norm": result["norm"], "seed": result["seed"], "learning_rate": result["learning_rate"],
                             "chosen": chosen.get(result["norm"]) == result["learning_rate"], "split": split,
                             **scores, "train_steps": result.get("train_steps"), "best_step": result.get("best_step"),
                             "seconds": result.get("seconds"), "run": result["cell"]})
    return rows


def verdict_words(judged, names: tuple[str, str]) -> str:
    """A `PairedVerdict` in the report's words: `"<norm> better"`, `"tie"`, or no verdict under two pairs."""
    if judged.better is None:
        return "one seed: no verdict"
    return {"other": f"{names[1]} better", "baseline": f"{names[0]} better"}.get(judged.better, "tie")


def verdict(differences: Sequence[float], mode: str, names: tuple[str, str], adjusted_p: float | None = None) -> str:
    """The verdict of one comparison from its paired differences (other - baseline, one per seed),
    by `paired_verdicts`; `adjusted_p`: its p-value adjusted over a family of comparisons."""
    from dataclasses import replace

    from ..training.reports import paired_verdicts

    baseline, other = dict.fromkeys(range(len(differences)), 0.0), dict(enumerate(differences))
    judged = paired_verdicts([(baseline, other, mode == "min")], min_pairs=MIN_PAIRS, confidence=CONFIDENCE)[0]
    if adjusted_p is not None and judged.better not in (None, "neither") and adjusted_p >= 1 - CONFIDENCE:
        judged = replace(judged, adjusted_p=adjusted_p, better="neither")
    return verdict_words(judged, names)


def same_function(base_runs: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]], metric: str,
                  cells: Path) -> bool:
    """Whether two norms' runs compute the same function: at every seed both have, the test score
    and each update's training loss (from the run's log under `cells`, where there is one) agree
    within a relative `SAME_FUNCTION_TOLERANCE`. The losses are what tells two runs apart whose
    score is discrete (accuracy, BLEU) and happens to be equal."""
    base, other = {r["seed"]: r for r in base_runs}, {r["seed"]: r for r in runs}
    seeds = sorted(set(base) & set(other))
    if not seeds:
        return False
    for seed in seeds:
        first, second = _function_evidence(base[seed], metric, cells), _function_evidence(other[seed], metric, cells)
        if len(first) != len(second) or not all(
                a is not None and b is not None and math.isclose(a, b, rel_tol=SAME_FUNCTION_TOLERANCE, abs_tol=0.0)
                for a, b in zip(first, second)):
            return False
    return True


def _function_evidence(run: dict[str, Any], metric: str, cells: Path) -> list[float | None]:
    """A run's test score, then its training loss at each logged update."""
    try:
        losses = run_curves(cells / run["cell"] / "run")[0]
    except FileNotFoundError:  # a run without its log (a results table read back): its score alone
        losses = {}
    return [run["scores"].get(f"test_{metric}"), *(losses[step] for step in sorted(losses))]


def run_flags(runs: Sequence[dict[str, Any]], metric: str, mode: str, vocab_size: int | None) -> list[str]:
    """What makes the runs of one norm unfit for a verdict: a degenerate score (`degenerate_flags`),
    a best model at the last update (still improving), a model no better than before fine-tuning."""
    flags = degenerate_flags(runs, metric, vocab_size)
    last = [r["seed"] for r in runs if r.get("best_step") is not None and r["best_step"] == r.get("train_steps")]
    if last:
        flags.append(f"best model at the last update (seed {', '.join(map(str, last))}): still improving, "
                     f"train longer")
    worse = [r["seed"] for r in runs if _no_better(r, metric, mode)]
    if worse:
        flags.append(f"no better than before fine-tuning (seed {', '.join(map(str, worse))})")
    return flags


def degenerate_flags(runs: Sequence[dict[str, Any]], metric: str, vocab_size: int | None) -> list[str]:
    """Scores that say nothing was learned or measured: BLEU 0, a perplexity near the vocabulary
    size, a perplexity of 1 (no token left to predict: a tokenizer that encodes the text to nothing)."""
    tested = [r["scores"].get(f"test_{metric}") for r in runs]
    flags = []
    if metric == "bleu" and all(v == 0 for v in tested):
        flags.append("BLEU 0 in every run (check the tokenizer's decoding)")
    if metric == "perplexity" and vocab_size and any(v is not None and v > vocab_size / 2 for v in tested):
        flags.append(f"perplexity above half the vocabulary ({vocab_size}): barely trained")
    if metric == "perplexity" and not measured(runs, metric):
        flags.append("perplexity 1 in every run: no token to predict (check that the tokenizer encodes the text)")
    return flags


def measured(runs: Sequence[dict[str, Any]], metric: str) -> bool:
    """Whether the runs' test scores measured anything: not a perplexity of 1 (no token to predict)
    or a BLEU of 0 (nothing decoded) in every run. Equal scores that measured nothing show no function."""
    tested = [r["scores"].get(f"test_{metric}") for r in runs]
    if metric == "perplexity":
        return not tested or any(v is None or v > 1 for v in tested)
    return metric != "bleu" or not tested or any(v != 0 for v in tested)


def _no_better(run: dict[str, Any], metric: str, mode: str) -> bool:
    before, after = run.get("start", {}).get(metric), run["scores"].get(f"validation_{metric}")
    if before is None or after is None:
        return False
    return after >= before if mode == "min" else after <= before


def baseline_name(norm_counts: dict[str, int]) -> str:
    """The baseline as the report names it: the model's own norm classes."""
    return f"{' + '.join(norm_counts) or BASELINE} (the model's own)"


def _short(norm: str, baseline: str) -> str:
    own = baseline.removesuffix(" (the model's own)")
    return {BASELINE: own, BASELINE_AGAIN: f"{own} again"}.get(norm, SHORT_NAMES.get(norm, norm))


def arm_name(norm: str, baseline: str) -> str:
    """An arm as the report's tables name it: the baseline by its classes (its A/A twin so marked)."""
    return {BASELINE: baseline, BASELINE_AGAIN: f"{baseline}, again (A/A)"}.get(norm, norm)


# What an arm must hold as the baseline does at the same seed (`runs.arm_invariants`), in the report's
# words; the norm modules' own parameters may differ.
INVARIANTS = {"trainable_outside_norms": "trainable parameters outside the norms", "head_tied": "head tied",
              "updates": "updates", "train_tokens": "training tokens",
              "first_batches": "first training batches (the data order)", "eval_tokens": "evaluation tokens",
              "schedule": "learning-rate schedule"}


def invariant_flags(base_runs: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]]) -> list[str]:
    """Where an arm's run differs from the baseline's at the same seed in anything but its norms
    (`runs.arm_invariants`), each difference named with both values; a run without the record (made
    before it was kept) is named too, since nothing shows its arms equal."""
    base = {r["seed"]: r for r in base_runs}
    flags = []
    for run in runs:
        first = base.get(run["seed"])
        if first is None:
            continue
        if "invariants" not in first or "invariants" not in run:
            flags.append(f"seed {run['seed']}: no record of what the arms hold beside their norms (rerun the "
                         f"comparison): nothing shows the arms equal")
            continue
        for key, words in INVARIANTS.items():
            value = first["invariants"].get(key)
            if run["invariants"].get(key) != value:
                flags.append(f"seed {run['seed']}: {words} differs from the baseline's "
                             f"({run['invariants'].get(key)} against {value}): the arms differ in more than "
                             f"their norms")
    return flags


def final_runs(results: Sequence[dict[str, Any]], norm: str, chosen: dict[str, float]) -> list[dict[str, Any]]:
    """The runs of `norm` at its chosen learning rate."""
    return [r for r in results if r["norm"] == norm and r["learning_rate"] == chosen.get(norm)]


def report_text(results: Sequence[dict[str, Any]], chosen: dict[str, float], options: CompareOptions,
                facts: dict[str, Any], missing: Sequence[Any] = ()) -> str:
    """report.md: the table over seeds, the checks, the verdicts against the first norm, the rule,
    seq2seq samples and the settings; with `missing` runs (failed jobs), those and their logs
    in place of the verdicts."""
    task = task_class(options)
    metric, better = task.metric, "lower" if task.mode == "min" else "higher"
    baseline = baseline_name(facts["norm_counts"])
    lines = [f"# Does PN help {_model_description(options)}?", "",
             f"Task `{task.name}`, {_data_description(options)}; the model's norms: "
             + ", ".join(f"{count} {name}" for name, count in facts["norm_counts"].items())
             + f" (`{BASELINE}` in `--norms`: these, unchanged). Each norm fine-tuned for "
               f"{options.max_train_steps or 'all'} updates at equal settings, scored by the model of its best "
               f"validation; {metric}, {better} is better, mean ± standard deviation over the seeds. "
             + conversion_sentence(options), "",
             f"| norm | learning rate | seeds | validation loss before fine-tuning | validation {metric} before "
             f"fine-tuning | validation {metric} | test {metric} | test per seed | minutes per run |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for norm in options.norms:
        lines.append(_norm_row(norm, final_runs(results, norm, chosen), chosen, metric, baseline))
    lines += _arm_lines(results, chosen, options, baseline)
    lines += _missing_lines(missing) if missing else _verdict_lines(results, chosen, options, facts, baseline)
    lines += ["", "![training loss and validation curves](validation_curves.png)"]
    lines += _sample_lines(results, chosen, options, baseline)
    lines += ["", "## Settings", "", "```json",
              json.dumps({k: v for k, v in options.settings().items() if v not in (None, False, {})}, indent=1),
              "```", ""]
    return "\n".join(lines)


def _arm_lines(results, chosen, options: CompareOptions, baseline: str) -> list[str]:
    """What the pipeline did to each arm (its first seed's run) and what the arms hold beside their
    norms, which a verdict needs equal (`invariant_flags`)."""
    firsts = {norm: runs[0] for norm in options.norms if (runs := final_runs(results, norm, chosen))}
    recorded = {norm: run for norm, run in firsts.items() if "conversion" in run and "invariants" in run}
    if not recorded:
        return []
    shown = ", ".join(f"seed {seed}" for seed in sorted({run["seed"] for run in recorded.values()}))
    lines = ["", "## The arms", "",
             "Every arm goes through the same steps: the model loaded, its residual stream centred where "
             "preserve_function needs it (in every arm, the baseline's too; a head tied to a centred embedding is "
             "untied in each), then its norms converted or kept. The arms of one seed must hold the same "
             "parameters outside their norms, the same head, updates, tokens, data order and schedule; a "
             "difference withholds the verdict (see Checks). Every seed is checked; the table shows each arm's run "
             f"at its first seed ({shown}).", "",
             "| arm | writers centred | head | norms converted | conversion | calibration batches | trainable "
             "parameters outside the norms | norm parameters | updates | training tokens | evaluation tokens | "
             "schedule | first batches (SHA-256) |", "|---|---:|---|---:|---|---:|---:|---:|---|---:|---|---|---|"]
    for norm, run in recorded.items():
        done, held = run["conversion"], run["invariants"]
        if done["to"] is None:
            how = "kept (the model's own)"
        elif done["exact"]:
            how = f"to {done['to']}, exact"
        elif done["approximate"]:
            ratios = [ratio for _, ratio in done["approximate"] if ratio is not None]
            worst = f"; mean / RMS up to {max(ratios):.3g}" if ratios else ""
            how = f"to {done['to']}, approximate ({len(done['approximate'])} norms{worst})"
        else:
            how = f"to {done['to']}, not keeping the function"
        evaluated = ", ".join(f"{split} {count:,}" for split, count in held["eval_tokens"].items())
        tokens = "-" if held["train_tokens"] is None else f"{held['train_tokens']:,}"
        lines.append(f"| {arm_name(norm, baseline)} | {done['centred_writers']} | {done['head']} | "
                     f"{done['converted_norms']} | {how} | {done['calibration_batches']} | "
                     f"{held['trainable_outside_norms']:,} | {held['norm_parameters']:,} | {held['updates']} | "
                     f"{tokens} | {evaluated} | {held['schedule']} | {(held['first_batches'] or '-')[:12]} |")
    return lines


def _missing_lines(missing: Sequence[Any]) -> list[str]:
    """The runs whose jobs failed, each with its log and error: no verdict is drawn without them."""
    return ["", "## Missing runs", "",
            f"{len(missing)} run(s) failed, so this report draws no verdict; rerun the same command to run them "
            f"again (the finished runs are kept):", "",
            *(f"- `{run.cell}`: {run.error} (log: `{run.log}`)" for run in missing)]


def conversion_sentence(options: CompareOptions) -> str:
    if not options.preserve_function:
        return "Converted without preserve_function (a randomly initialised model, or --no_preserve_function)."
    refused = options.not_preserved
    structure = ("; the head kept tied in every arm (--keep_tied_head), so the residual stream is centred in none"
                 if options.keep_tied_head else "; every arm, the baseline's too, through the same steps (the "
                                                "residual stream centred where a norm needs it)")
    return "Converted keeping the pretrained function (preserve_function)" + structure + (
        "; without it for " + "; ".join(f"{norm} ({why})" for norm, why in refused.items()) if refused else "") + "."


def _norm_row(norm: str, runs: list[dict[str, Any]], chosen: dict[str, float], metric: str, baseline: str) -> str:
    from ..training.reports import mean_std

    name = arm_name(norm, baseline)
    if not runs:
        return f"| {name} | - | - | - | - | - | - | - | - |"
    loss = [r.get("start", {}).get("loss") for r in runs]
    start = [r.get("start", {}).get(metric) for r in runs]
    validated = [r["scores"].get(f"validation_{metric}") for r in runs]
    tested = [r["scores"].get(f"test_{metric}") for r in runs]
    minutes = [r["seconds"] / 60 for r in runs if r.get("seconds") is not None]
    per_seed = ", ".join(f"{v:.3f}" for v in tested if v is not None)
    return (f"| {name} | {chosen[norm]:g} | {', '.join(str(r['seed']) for r in runs)} | {mean_std(loss, 3)} | "
            f"{mean_std(start, 3)} | {mean_std(validated, 3)} | {mean_std(tested, 3)} | {per_seed} | "
            f"{f'{statistics.fmean(minutes):.1f}' if minutes else '-'} |")


def _test_by_seed(runs: Sequence[dict[str, Any]], metric: str) -> dict[int, float]:
    return {r["seed"]: r["scores"][f"test_{metric}"] for r in runs if r["scores"].get(f"test_{metric}") is not None}


def _verdict_lines(results, chosen, options: CompareOptions, facts: dict[str, Any], baseline: str) -> list[str]:
    """The verdict of each norm against the first (`paired_verdicts` over the norms that are not the
    same function as the first), none where a check fails; then the checks."""
    from ..training.reports import paired_verdicts

    task, first = task_class(options), _short(options.norms[0], baseline)
    base_runs = final_runs(results, options.norms[0], chosen)
    base = _test_by_seed(base_runs, task.metric)
    tested = {norm: _test_by_seed(final_runs(results, norm, chosen), task.metric) for norm in options.norms[1:]}
    cells = Path(options.output_dir) / "cells"
    same = [norm for norm in tested if same_function(base_runs, final_runs(results, norm, chosen), task.metric, cells)
            and measured(base_runs, task.metric)]
    compared = [norm for norm in tested if norm not in same]
    judged = dict(zip(compared, paired_verdicts([(base, tested[norm], task.mode == "min") for norm in compared],
                                                min_pairs=MIN_PAIRS, confidence=CONFIDENCE)))
    lines = ["", "## Verdict", "", f"| against {first} | seeds paired | mean difference (norm - {first}) | "
             f"95% interval | Holm p | verdict |", "|---|---:|---:|---|---:|---|"]
    checks = []
    for norm, verdict_of in judged.items():
        flags = _comparison_flags(base_runs, final_runs(results, norm, chosen), options, facts,
                                  (first, _short(norm, baseline)))
        said = verdict_words(verdict_of, (first, _short(norm, baseline)))
        if flags and "no verdict" not in said:
            said = "flagged: no verdict"
        lines.append(f"| {norm} | {len(verdict_of.differences)} | {_difference_cells(verdict_of)} | {said} |")
        checks += [f"- {norm}: {flag}" for flag in flags]
    intervals = sum(v.interval is not None for v in judged.values())
    lines += [f"- {norm}: the same function as {first}: every seed's test {task.metric} and training losses within "
              f"a relative {SAME_FUNCTION_TOLERANCE:g} of {first}'s (rounding), so no verdict" for norm in same]
    lines += ["", f"Rule: each seed's test {task.metric} of a norm minus {first}'s at the same seed; a norm is "
                  f"better or worse than {first} only when the 95% t interval of these differences excludes zero "
                  f"and the p-value, Holm-adjusted over the {intervals} comparison(s) with an interval, is below "
                  f"0.05; otherwise it is a tie. Under two paired seeds there is no interval and no verdict, and a "
                  f"comparison whose runs fail a check below gets none. A norm whose test scores and training losses "
                  f"equal {first}'s within a relative {SAME_FUNCTION_TOLERANCE:g} in every seed computes the same "
                  f"function: no verdict, and no comparison of Holm's family."]
    return lines + ["", "## Checks", ""] + (checks or ["Every check passed: no degenerate scores, every best model "
                                                       "before the last update, every model better than before "
                                                       "fine-tuning."])


def _difference_cells(judged) -> str:
    """The mean difference, its interval and the Holm p-value (`-` without an interval)."""
    interval = judged.interval
    if interval is None:
        differences = list(judged.differences.values())
        return f"{statistics.fmean(differences) if differences else math.nan:+.3f} | - | -"
    return f"{interval.mean:+.3f} | [{interval.low:+.3f}, {interval.high:+.3f}] | {judged.adjusted_p:.3f}"


def _comparison_flags(base_runs, runs, options: CompareOptions, facts: dict[str, Any],
                      names: tuple[str, str]) -> list[str]:
    task, vocab_size = task_class(options), facts.get("vocab_size")
    return [*(f"{names[0]}: {f}" for f in run_flags(base_runs, task.metric, task.mode, vocab_size)),
            *(f"{names[1]}: {f}" for f in run_flags(runs, task.metric, task.mode, vocab_size)),
            *(f"{names[1]}: {f}" for f in invariant_flags(base_runs, runs))]


def _sample_lines(results, chosen, options: CompareOptions, baseline: str) -> list[str]:
    if not any(r.get("samples") for r in results):
        return []
    lines = ["", "## Sample outputs (first seed, first three validation examples)"]
    for norm in options.norms:
        runs = final_runs(results, norm, chosen)
        if runs and runs[0].get("samples"):
            lines += ["", f"### {arm_name(norm, baseline)}", ""]
            lines += [f"- source: {s['source']!r}\n  reference: {s['reference']!r}\n  output: {s['output']!r}"
                      for s in runs[0]["samples"]]
    return lines


def _model_description(options: CompareOptions) -> str:
    return "a tiny GPT-2 (the embedded default)" if options.embedded_default else options.model_id


def _data_description(options: CompareOptions) -> str:
    if options.dataset_name:
        return f"data `{options.dataset_name}`" + (f" ({options.dataset_config})" if options.dataset_config else "")
    if options.train_file:
        return f"data `{options.train_file}`"
    return "the embedded toy corpus (no download)"


def run_curves(folder: Path) -> tuple[dict[int, float], dict[int, float]]:
    """A run's training loss and validation score per update, from its `training_log.jsonl`."""
    from ..training.run_log import read_run_log

    records = read_run_log(folder)
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["validation"] for r in records if "validation" in r})


def plot_curves(results: Sequence[dict[str, Any]], chosen: dict[str, float], options: CompareOptions,
                path: Path, baseline: str) -> None:
    """Training loss and validation score against updates per norm, side by side: the mean over
    seeds with markers, the seeds' range as a band; perplexity and loss on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..training.reports import save_figure

    figure, axes = plt.subplots(1, 2, figsize=(10, 4.0))
    for norm in options.norms:
        folders = [Path(options.output_dir) / "cells" / r["cell"] / "run" for r in final_runs(results, norm, chosen)]
        curves = [run_curves(folder) for folder in folders]
        label = arm_name(norm, baseline)
        for axis, index in zip(axes, (0, 1)):
            _plot_mean_and_band(axis, [c[index] for c in curves], f"{label} ({len(curves)} seeds)")
    task = task_class(options)
    for axis, name in zip(axes, ("training loss", f"validation {task.metric}")):
        axis.set_xlabel("update")
        axis.set_ylabel(name)
        if name == "training loss" or task.metric == "perplexity":
            axis.set_yscale("log")
        if axis.has_data():
            axis.legend(fontsize="small")
    figure.suptitle(f"{_model_description(options)}, {task.name}")
    save_figure(figure, path, dpi=120)


def _plot_mean_and_band(axis, curves: list[dict[int, float]], label: str) -> None:
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if not steps:
        return
    values = [[c[s] for c in curves] for s in steps]
    line, = axis.plot(steps, [statistics.fmean(v) for v in values], marker="o", markersize=3, label=label)
    axis.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.2)


def write_outputs(results: Sequence[dict[str, Any]], chosen: dict[str, float], options: CompareOptions,
                  facts: dict[str, Any], missing: Sequence[Any] = ()) -> str:
    """results.csv, report.md and validation_curves.png in `--output_dir`; returns the report.
    `missing`: the runs whose jobs failed (`executors.FailedRun`), named in place of any verdict."""
    from ..training.reports import write_rows

    output_dir = Path(options.output_dir)
    write_rows(result_rows(results, chosen), output_dir / "results.csv")
    text = report_text(results, chosen, options, facts, missing)
    (output_dir / "report.md").write_text(text, encoding="utf-8")
    plot_curves(results, chosen, options, output_dir / "validation_curves.png", baseline_name(facts["norm_counts"]))
    return text
