"""PowerNorm's switch from the batch statistic to the running one, on Penn Treebank language modelling.

PN divides by the batch quadratic mean during its warmup and by the running statistic `phi`
afterwards (Algorithm 2). If `phi` lags the batch statistics when warmup ends, the first update
that divides by it changes the scale of every normalized activation at once, and the training loss
jumps. This study trains the same small causal LM on PTB with:

- `layernorm`: the baseline;
- `pn-cumulative`: PN with `phi` the cumulative mean of the warmup's batch statistics;
- `pn-reference`: the authors' code (cumulative then EMA step at each warmup update);
- `pn-cumulative-ramp`, `pn-reference-ramp`: the same, with the denominator blended from the batch
  statistic to `phi` over `--ramp_steps` updates after warmup (`warmup_ramp_steps`);

each for every seed, the same budget and hyper-parameters, and reports the loss jump at the switch
(mean training loss of the 10 updates after warmup minus that of the 10 before, and the largest
excess over the pre-switch mean in the 50 after), validation and test perplexity (per BPE token and
per word), as `results.csv`, `summary.md` and `loss_at_switch.png` in `--output_dir`.

    python recipes/studies/warmup_switch.py --data_dir DIR --jobs 2       # DIR holds ptb/
    python recipes/studies/warmup_switch.py --smoke --output_dir /tmp/s   # embedded corpus, seconds

Runs resume: a finished run is never redone (`hf_powernorm.training.grid`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ..training.grid import Cell
from ..training.reports import mean_std, save_figure, seeds_of, write_rows
from .measures import PEAK_WINDOW, WINDOW, loss_jump, training_losses
from .runs import parse_setting_args, run_lm_study, runs_by_setting, setting_cells, train_setting, write_summary

SETTINGS = {
    "layernorm": {"norm_type": "layernorm"},
    "pn-cumulative": {"norm_type": "powernorm", "powernorm_warmup_statistic": "cumulative"},
    "pn-reference": {"norm_type": "powernorm", "powernorm_warmup_statistic": "reference"},
    "pn-cumulative-ramp": {"norm_type": "powernorm", "powernorm_warmup_statistic": "cumulative", "ramp": True},
    "pn-reference-ramp": {"norm_type": "powernorm", "powernorm_warmup_statistic": "reference", "ramp": True},
}
SIZES = {"real": {"vocab_size": 4000, "block_size": 128, "max_tokens": 1024, "max_train_steps": 600,
                  "warmup_steps": 150, "ramp_steps": 75, "eval_steps": 150, "learning_rate": 1e-3},
         "smoke": {"vocab_size": 120, "block_size": 16, "max_tokens": 128, "max_train_steps": 14,
                   "warmup_steps": 4, "ramp_steps": 2, "eval_steps": 7, "learning_rate": 5e-3}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_setting_args(argv, __doc__, SIZES, SETTINGS, "outputs/studies/warmup_switch", seeds=[1, 2, 3])


def _run_flags(options: dict[str, Any]) -> list[str]:
    """The training options of one run after the shared ones, as on the recipes' command line."""
    flags = ["--eval_batch_size", "32", "--norm_type", options["norm_type"]]
    if options["norm_type"] == "powernorm":
        flags += ["--powernorm_warmup_statistic", options["powernorm_warmup_statistic"],
                  "--powernorm_warmup_ramp_steps", str(options["ramp_steps"] if options["ramp"] else 0)]
    return flags


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    """Train one setting with one seed; its scores and its loss around the switch."""
    scores = train_setting(cell, folder, _run_flags(cell.options))
    return {**scores, **loss_jump(training_losses(folder), cell.options["warmup_steps"])}


def cells(args: argparse.Namespace, files: dict[str, str], tokenizer: str) -> list[Cell]:
    runs = ((f"{name}-seed{seed}", {"setting": name, "seed": seed, "ramp": False, **SETTINGS[name]})
            for name in args.settings for seed in args.seeds)
    return setting_cells(args, files, tokenizer, SIZES, runs)


COLUMNS = ("loss_jump", "loss_peak_excess", "validation_perplexity", "test_perplexity", "test_word_perplexity")


def write_results(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    """`results.csv` (one row per run), `summary.md` (mean ± std over seeds), `loss_at_switch.png`."""
    write_rows(results, output_dir / "results.csv",
               columns=["setting", "seed", *COLUMNS, "best_step", "best_validation", "train_steps"])
    rows = ((setting, *(mean_std([r[c] for r in runs], 3) for c in COLUMNS))
            for setting, runs in runs_by_setting(results, args.settings))
    write_summary(output_dir, args, "PowerNorm's warmup switch",
                  f"{args.max_train_steps} updates of {args.max_tokens} tokens, warmup {args.warmup_steps} updates "
                  f"(learning rate and PN), ramp {args.ramp_steps} updates, seeds {seeds_of(results)}; "
                  "mean ± std over seeds.", ("setting", *COLUMNS), "l" + "r" * len(COLUMNS), rows)
    _plot(results, args, output_dir / "loss_at_switch.png")


def _plot(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """Mean training loss over seeds around the switch, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first, last = max(1, args.warmup_steps - 3 * WINDOW), args.warmup_steps + PEAK_WINDOW + 3 * WINDOW
    figure, axis = plt.subplots(figsize=(7, 4))
    for setting in args.settings:
        logs = [training_losses(Path(args.output_dir) / "cells" / row["cell"])
                for row in results if row["setting"] == setting]
        if not logs:
            continue
        steps = [s for s in range(first, last + 1) if all(s in log for log in logs)]
        axis.plot(steps, [statistics.fmean(log[s] for log in logs) for s in steps], label=setting, linewidth=1)
    axis.axvline(args.warmup_steps + 0.5, color="grey", linestyle="--", linewidth=0.8)
    axis.set_xlabel("update")
    axis.set_ylabel("training loss (mean over seeds)")
    axis.legend(fontsize=8)
    save_figure(figure, path, dpi=110)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run_lm_study(parse_args(argv), cells, run_cell, write_results, "Warmup switch")


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
