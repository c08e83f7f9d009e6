"""PowerNorm over thousands of updates: with and without group scaling, in float32 and bfloat16.

Users of the paper's reference implementation report PN going to NaN after some thousands of
updates when group scaling is off. This study trains the same small causal LM on Penn Treebank as
the other studies for `--max_train_steps` updates (3,000 by default, about 3 epochs) with PN at
every norm position - group scaling per attention head or none, float32 or bfloat16 autocast
(`--mixed_precision bf16`; by default only with a GPU) - and LayerNorm beside it, for every seed, and
reports whether and when the training loss first stopped being finite, the largest training loss
after warmup, the last logged loss and validation and test perplexity, as `results.csv`,
`summary.md` and `long_run.png` (training loss over updates) in `--output_dir`.

    python recipes/studies/long_run.py --data_dir DIR --jobs 2        # DIR holds ptb/
    python recipes/studies/long_run.py --smoke --output_dir /tmp/lr   # embedded corpus, seconds

Runs resume: a finished run is never redone (`hf_powernorm.training.grid`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ..training.grid import Cell
from ..training.reports import save_figure, write_rows
from .measures import first_nonfinite_update, training_losses
from .runs import CELL_INPUTS, parse_setting_args, run_lm_study, setting_cells, train_setting, write_summary

SIZES = {"real": {"vocab_size": 4000, "block_size": 128, "max_tokens": 1024, "max_train_steps": 3000,
                  "warmup_steps": 150, "eval_steps": 500, "learning_rate": 1e-3},
         "smoke": {"vocab_size": 120, "block_size": 16, "max_tokens": 128, "max_train_steps": 10,
                   "warmup_steps": 3, "eval_steps": 5, "learning_rate": 5e-3}}
SETTINGS = {
    "pn-group-scaling": ["--norm_type", "powernorm"],
    "pn-no-group-scaling": ["--norm_type", "powernorm", "--powernorm_group_num", "none"],
    "layernorm": ["--norm_type", "layernorm"],
}
PRECISIONS = ("fp32", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = parse_setting_args(argv, __doc__, SIZES, SETTINGS, "outputs/studies/long_run", seeds=[1, 2],
                              add_args=_add_precisions)
    if args.precisions is None:
        import torch

        args.precisions = list(PRECISIONS) if torch.cuda.is_available() else ["fp32"]
    return args


def _add_precisions(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS,
                        help="default: fp32 and bf16 with a GPU, fp32 alone on a CPU (bf16 autocast on a CPU without "
                             "bf16 instructions is about 11x slower)")


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    options = cell.options
    precision = "no" if options["precision"] == "fp32" else "bf16"
    scores = train_setting(cell, folder, ["--mixed_precision", precision, *SETTINGS[options["setting"]]])
    return {**scores, **stability(training_losses(folder), options["warmup_steps"])}


def stability(losses: dict[int, float | None], warmup_steps: int) -> dict[str, Any]:
    """The first update with a non-finite training loss (None if none), the largest finite loss
    after warmup, and the mean loss of the last 50 logged updates."""
    finite = {step: loss for step, loss in losses.items() if loss is not None}
    after = [loss for step, loss in finite.items() if step > warmup_steps]
    last = [finite[step] for step in sorted(finite)[-50:]]
    return {"first_nonfinite_update": first_nonfinite_update(losses),
            "max_loss_after_warmup": max(after) if after else float("nan"),
            "final_train_loss": statistics.fmean(last) if last else float("nan")}


def cells(args: argparse.Namespace, files: dict[str, str], tokenizer: str) -> list[Cell]:
    runs = ((f"{setting}-{precision}-seed{seed}", {"setting": setting, "precision": precision, "seed": seed})
            for seed in args.seeds for precision in args.precisions for setting in args.settings)
    return setting_cells(args, files, tokenizer, SIZES, runs)


def write_results(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    write_rows(results, output_dir / "results.csv", leave_out=CELL_INPUTS)
    header = ("setting", "precision", "seed", "first non-finite loss (update)", "largest loss after warmup",
              "final training loss", "validation perplexity", "test perplexity")
    rows = ((r["setting"], r["precision"], str(r["seed"]), str(r["first_nonfinite_update"] or "none"),
             f"{r['max_loss_after_warmup']:.3f}", f"{r['final_train_loss']:.3f}",
             f"{r['validation_perplexity']:.2f}", f"{r['test_perplexity']:.2f}") for r in results)
    write_summary(output_dir, args, f"PowerNorm over {args.max_train_steps} updates", "One row per run.", header,
                  "llrrrrrr", rows)
    _plot(results, output_dir)


def _plot(results: list[dict[str, Any]], output_dir: Path) -> None:
    """Training loss over updates (a moving mean of 25), one line per run of the first seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    first_seed = min(r["seed"] for r in results)
    for r in (r for r in results if r["seed"] == first_seed):
        losses = training_losses(output_dir / "cells" / r["cell"])
        steps = sorted(s for s, loss in losses.items() if loss is not None)
        smooth = [statistics.fmean(losses[t] for t in steps[max(0, i - 24):i + 1]) for i in range(len(steps))]
        axis.plot(steps, smooth, label=f"{r['setting']} {r['precision']}", linewidth=0.9)
    axis.set_xlabel("update")
    axis.set_ylabel("training loss (moving mean of 25)")
    axis.legend(fontsize=7)
    save_figure(figure, output_dir / "long_run.png")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run_lm_study(parse_args(argv), cells, run_cell, write_results, "Long runs")


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
