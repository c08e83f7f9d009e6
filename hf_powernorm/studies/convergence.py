"""PN against LayerNorm on PTB trained until validation stops improving (protocol 3,
`docs/protocol_convergence.md`): LayerNorm, PN at its picks and PN at the authors' alphas, each at the
tuned comparison's PTB picks for 4,500 updates, seeds 1-5; validation on the whole split every 500
updates; a run stops when its best validation perplexity has not improved for 2,000 updates, or at
12,000; test perplexity scored once, on the best validated model. Verdicts: each PN arm against
LayerNorm, paired by seed, Holm over the 2.

Outputs in `--output_dir`: `results.csv` (one row per run: its stop, best update, scores and
CPU-hours), `curves.csv` (validation perplexity per evaluation), `summary.md` (the verdicts, then each
run) and `curves.png` (the three arms' validation curves, mean and per seed).

    python -m hf_powernorm.studies convergence --data_dir DIR --jobs 1 --export_dir results/convergence
    python -m hf_powernorm.studies convergence --smoke --output_dir /tmp/cv   # embedded corpus, seconds

Resumable: a finished run is never redone, a killed one goes on from its newest checkpoint.
`--report_only` writes the outputs of the runs finished so far; `--export_dir DIR` copies them with
each finished run's result and validation records into DIR (`results/convergence/`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ..training.executors import add_executor_args, executor_settings
from ..training.grid import Cell, finished_results, run_grid
from ..training.options import BadInput
from ..training.reports import paired_cell, save_figure, write_rows
from . import tuned_comparison as tuned
from .documents import CONVERGENCE_ARMS, SIGNIFICANCE, convergence_family, detectable_difference
from .norm_comparison import validation_curve
from .runs import study_output_dir

TASK = "ptb"
ARM_NAMES = {"layernorm": "LayerNorm", **CONVERGENCE_ARMS}
ARMS = tuple(ARM_NAMES)
# The tuned comparison's PTB picks at 4,500 updates (`results/tuned_comparison/picks.json`, "@4500"),
# fixed here before any run of this study.
PICKS = {
    "layernorm": tuned.setting("layernorm", 0.008, 150),
    "powernorm": tuned.setting("powernorm", 0.008, 150, alpha_fwd=0.99, alpha_bkw=1.0, denominator="running"),
    tuned.AUTHORS: tuned.setting(tuned.AUTHORS, 0.008, 150, alpha_fwd=0.9, alpha_bkw=0.9, denominator="running"),
}
SEEDS = (1, 2, 3, 4, 5)
# The tuning seed's runs draw their dropout afresh, in every arm (protocol 3, "Seeds").
FRESH_SEEDS = (1,)
# Protocol 2's PTB finals' settings, with this protocol's validation cadence, patience (validations
# without a new best) and cap.
SIZES = {
    "real": {"vocab_size": 4000, "block_size": 128, "max_tokens": 2048, "eval_steps": 500, "patience": 4,
             "cap": 12000, "dropout": 0.3, "label_smoothing": 0.1},
    "smoke": {"vocab_size": 120, "block_size": 16, "max_tokens": 128, "eval_steps": 2, "patience": 2, "cap": 12,
              "dropout": 0.3, "label_smoothing": 0.1},
}
COLUMNS = ("arm", "seed", "stopped_at", "stopped_by", "best_update", "best_validation_perplexity",
           "test_perplexity", "test_word_perplexity", "cpu_hours")
CURVE_COLUMNS = ("arm", "seed", "update", "validation_perplexity")
TUNED_BUDGET = 4500  # the tuned comparison's budget whose picks the arms take, marked on the figure
ZOOM_FROM = 4000  # the figure's right panel starts here
RESULTS_CSV, CURVES_CSV, SUMMARY_MD, FIGURE = "results.csv", "curves.csv", "summary.md", "curves.png"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", help="a folder holding ptb/ptb.{train,valid,test}.txt (required unless --smoke)")
    p.add_argument("--output_dir", default="outputs/studies/convergence")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    add_executor_args(p)
    p.add_argument("--smoke", action="store_true", help="the embedded corpus at tiny sizes (seconds)")
    p.add_argument("--report_only", action="store_true", help="write the outputs of the runs finished so far")
    p.add_argument("--export_dir", help="also copy the outputs and each finished run's result and validation "
                                        "records into this folder")
    args = p.parse_args(argv)
    if args.data_dir is None and not args.smoke:
        raise BadInput("pass --data_dir (a folder with ptb/ptb.{train,valid,test}.txt), or --smoke for the "
                       "embedded corpus")
    if args.export_dir and Path(args.export_dir).resolve() == Path(args.output_dir).resolve():
        raise BadInput(f"--export_dir must differ from --output_dir; both are {args.export_dir}")
    # What `tuned_comparison._inputs` reads: the task's sizes, the data and the smoke switch.
    args.sizes = {TASK: SIZES["smoke" if args.smoke else "real"]}
    return args


def cells(args: argparse.Namespace, inputs: dict[str, Any]) -> list[Cell]:
    """The study's runs, seed by seed (every arm of a seed before the next seed), so that an unfinished
    study has complete pairs."""
    sizes = args.sizes[TASK]
    return [tuned._cell(TASK, inputs, sizes, PICKS[arm], sizes["cap"], seed, final=True,
                        dropout_seed=seed + tuned.FRESH_DRAW if seed in FRESH_SEEDS else None)
            for seed in args.seeds for arm in ARMS]


def stopped_by(result: dict[str, Any], sizes: dict[str, Any]) -> str:
    """"rule" where the run stopped before the cap, or at it with its best 2,000 updates behind; else "cap"."""
    patience_updates = sizes["patience"] * sizes["eval_steps"]
    stopped = result["train_steps"]
    return "rule" if stopped < sizes["cap"] or stopped - result["best_step"] >= patience_updates else "cap"


def rows(results: list[dict[str, Any]], sizes: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"arm": r["norm"], "seed": r["seed"], "stopped_at": r["train_steps"], "stopped_by": stopped_by(r, sizes),
             "best_update": r["best_step"], "best_validation_perplexity": round(r["best_validation"], 4),
             "test_perplexity": round(r["test_perplexity"], 4),
             "test_word_perplexity": round(r["test_word_perplexity"], 4),
             "cpu_hours": round(r["cpu_seconds"] / 3600, 3)}
            for r in sorted(results, key=lambda r: (ARMS.index(r["norm"]), r["seed"]))]


def verdicts(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each PN arm against LayerNorm on test perplexity, paired by seed, Holm over the family of 2,
    with the detectable difference at its Holm step (protocol 3, "The verdict"); an arm with fewer
    than 3 paired seeds has no verdict and no detectable difference. Before both arms have 3, the one
    judged is adjusted over the family of 2 all the same, the other counted at p = 1."""
    by_arm = {arm: {row["seed"]: row["test_perplexity"] for row in table if row["arm"] == arm} for arm in ARMS}
    found = convergence_family(by_arm)
    tested = sorted((v.interval.p_value for v in found if v.interval is not None))
    out = []
    for arm, verdict in zip(ARMS[1:], found):
        detectable = None
        if verdict.interval is not None:
            step = tested.index(verdict.interval.p_value) + 1
            detectable = detectable_difference(list(verdict.differences.values()),
                                               SIGNIFICANCE / (len(found) - step + 1))
        out.append({"arm": arm, "verdict": verdict, "detectable": detectable,
                    "baseline": by_arm["layernorm"], "other": by_arm[arm]})
    return out


def _median_range(values: list[int]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,}-{max(values):,})" if values else "-"


def summary(table: list[dict[str, Any]], planned: int) -> list[str]:
    """The verdicts over the family of 2, each arm's stops and cost, then every run."""
    lines = ["# PN against LayerNorm on PTB, trained until validation stops improving (protocol 3)", "",
             f"{len(table)} of {planned} runs finished. Test perplexity per BPE token of the best validated model; "
             "arm minus LayerNorm, paired by seed, 95% t interval, Holm over the 2 comparisons.", "",
             "| arm | LayerNorm | arm | paired seeds | arm minus LayerNorm, mean [95% CI] | Holm p "
             "| detectable at 80% power | verdict |", "|---|---|---|---:|---|---:|---:|---|"]
    for found in verdicts(table):
        verdict, arm = found["verdict"], found["arm"]
        words = {None: "no verdict (fewer than 3 paired seeds)", "neither": "no difference shown",
                 "other": f"{ARM_NAMES[arm]} better", "baseline": "LayerNorm better"}[verdict.better]
        p_value = "-" if verdict.adjusted_p is None else f"{verdict.adjusted_p:.3f}"
        detectable = "-" if found["detectable"] is None else f"{found['detectable']:.2f}"
        lines.append(f"| {ARM_NAMES[arm]} | {tuned._mean_std(list(found['baseline'].values()))} | "
                     f"{tuned._mean_std(list(found['other'].values()))} | {len(verdict.differences)} | "
                     f"{paired_cell(verdict)} | {p_value} | {detectable} | {words} |")
    lines += ["", "| arm | runs | stopped by the rule | updates to the best, median (range) "
              "| stopped at, median (range) | CPU-hours per run, mean | CPU-hours |", "|---|---:|---:|---|---|---:|---:|"]
    for arm in ARMS:
        runs = [row for row in table if row["arm"] == arm]
        hours = [row["cpu_hours"] for row in runs]
        lines.append(f"| {ARM_NAMES[arm]} | {len(runs)} | {sum(row['stopped_by'] == 'rule' for row in runs)} | "
                     f"{_median_range([row['best_update'] for row in runs])} | "
                     f"{_median_range([row['stopped_at'] for row in runs])} | "
                     f"{statistics.mean(hours) if hours else 0:.2f} | {sum(hours):.2f} |")
    lines += ["", f"All runs: {sum(row['cpu_hours'] for row in table):.2f} CPU-hours (one thread each).", "",
              "| arm | seed | stopped at | by | best update | best validation perplexity | test perplexity "
              "| test perplexity per word | CPU-hours |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {ARM_NAMES[row['arm']]} | {row['seed']} | {row['stopped_at']:,} | {row['stopped_by']} | "
              f"{row['best_update']:,} | {row['best_validation_perplexity']:.2f} | {row['test_perplexity']:.2f} | "
              f"{row['test_word_perplexity']:.2f} | {row['cpu_hours']:.2f} |" for row in table]
    return lines


def plot(curves: list[dict[str, Any]], path: Path) -> None:
    """Validation perplexity over updates: each run thin, each arm's mean over the seeds it has at an
    update thick; the whole run on the left, from `ZOOM_FROM` updates on the right (where the arms part by
    about one perplexity), the tuned comparison's budget of 4,500 updates marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    figure, axes = plt.subplots(1, 2, figsize=(12, 5))
    for axis, start in zip(axes, (0, ZOOM_FROM)):
        for index, arm in enumerate(ARMS):
            color = f"C{index}"
            points = [c for c in curves if c["arm"] == arm and c["update"] >= start]
            for seed in sorted({c["seed"] for c in points}):
                run = [c for c in points if c["seed"] == seed]
                axis.plot([c["update"] for c in run], [c["validation_perplexity"] for c in run], color=color,
                          alpha=0.3, linewidth=0.8)
            updates = sorted({c["update"] for c in points})
            means = [statistics.mean(c["validation_perplexity"] for c in points if c["update"] == u)
                     for u in updates]
            if updates:
                axis.plot(updates, means, color=color, linewidth=2, label=ARM_NAMES[arm])
        axis.axvline(TUNED_BUDGET, color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel("update (dotted: the tuned comparison's budget, 4,500)")
        if not start:  # the whole run's fall spans a decade; the right panel's a few perplexities
            axis.set_yscale("log")
            axis.yaxis.set_major_formatter(ScalarFormatter())
            axis.yaxis.set_minor_formatter(ScalarFormatter())
    axes[0].set_ylabel("validation perplexity (per BPE token)")
    axes[0].set_title("the whole run")
    axes[1].set_title(f"from update {ZOOM_FROM:,} (linear scale)")
    axes[0].legend()
    figure.suptitle("PTB until validation stops improving: each seed (thin), mean over seeds (thick)")
    save_figure(figure, path)


def write_outputs(results: list[dict[str, Any]], output_dir: Path, sizes: dict[str, Any], planned: int) -> None:
    table = rows(results, sizes)
    curves = [{"arm": r["norm"], "seed": r["seed"], "update": step, "validation_perplexity": round(value, 4)}
              for r in sorted(results, key=lambda r: (ARMS.index(r["norm"]), r["seed"]))
              for step, value in validation_curve(output_dir, r)]
    write_rows(table, output_dir / RESULTS_CSV, columns=COLUMNS)
    write_rows(curves, output_dir / CURVES_CSV, columns=CURVE_COLUMNS)
    (output_dir / SUMMARY_MD).write_text("\n".join(summary(table, planned)) + "\n", encoding="utf-8")
    plot(curves, output_dir / FIGURE)


def export(results: list[dict[str, Any]], output_dir: Path, export_dir: Path) -> None:
    """The outputs, and each finished run's result and validation records, copied into `export_dir`
    (as `tuned_comparison.export` does; its `cells/` copied into an output folder resumes the study)."""
    tuned.export_runs(results, output_dir, export_dir, [RESULTS_CSV, CURVES_CSV, SUMMARY_MD, FIGURE])


run_cell = tuned.run_cell  # one run: the tuned comparison's, with the CPU seconds it cost


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    output_dir = study_output_dir(args)
    inputs = tuned._inputs(TASK, args, output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    grid = cells(args, inputs)
    if args.report_only:
        results = finished_results(grid, output_dir)
    else:
        results = run_grid(grid, run_cell, output_dir, desc="convergence", resume_cells=True,
                           executor=executor_settings(args))
    write_outputs(results, output_dir, args.sizes[TASK], len(grid))
    print((output_dir / SUMMARY_MD).read_text(encoding="utf-8"))
    if args.export_dir:
        export(results, output_dir, Path(args.export_dir))
        print(f"Exported the outputs and {len(results)} finished runs to {args.export_dir}")
    return results


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
