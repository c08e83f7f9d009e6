"""What PowerNorm's options do at the same budget, on Penn Treebank language modelling.

The paper tunes PN's moving-average factors `alpha_fwd` and `alpha_bkw` and fixes a warmup; its
reference code adds group scaling and its own warmup statistic. This study changes one option at a
time from PN's defaults (alpha_fwd = alpha_bkw = 0.9, warmup the learning rate's 150 updates, group
scaling per attention head, the running backward denominator of eqs. 11-13, the `reference` warmup
statistic, no ramp) and trains the same small causal LM on PTB as the other studies, LayerNorm
beside it:

- `alpha_fwd`, `alpha_bkw` over 0.95 and 0.99 (0.9 is the default);
- warmup of 0, 75 and 300 updates, and half the run;
- group scaling off; the batch backward denominator; the `cumulative` warmup statistic, alone and
  with the switch ramped over 75 updates;

for every seed, and reports validation and test perplexity, the loss jump at the switch (the mean
training loss of the 10 updates after warmup minus that of the 10 before; see `loss_jump`), the
setting under which PN does best with its spread, as `results.csv`, `summary.md` and
`ablation.png` in `--output_dir`. Two settings that are the same run at the chosen budget (warmup
double and half the run, at 600 updates) run once and report the same runs.

    python recipes/studies/pn_ablation.py --data_dir DIR --jobs 2        # DIR holds ptb/
    python recipes/studies/pn_ablation.py --smoke --output_dir /tmp/ab   # embedded corpus, seconds

Runs resume: a finished run is never redone (`hf_powernorm.training.grid`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ..training.grid import Cell
from ..training.reports import mean_std, save_figure, seeds_of, write_rows
from .measures import loss_jump, training_losses
from .runs import (
    CELL_INPUTS, parse_setting_args, run_lm_study, runs_by_setting, setting_cells, size_values, train_setting,
    write_summary,
)

SIZES = {"real": {"vocab_size": 4000, "block_size": 128, "max_tokens": 1024, "max_train_steps": 600,
                  "warmup_steps": 150, "eval_steps": 150, "learning_rate": 1e-3},
         "smoke": {"vocab_size": 120, "block_size": 16, "max_tokens": 128, "max_train_steps": 12,
                   "warmup_steps": 4, "eval_steps": 6, "learning_rate": 5e-3}}
PN = ["--norm_type", "powernorm"]
# name -> (flags, PN's warmup in updates as a function of the sizes, for the loss jump)
SETTINGS: dict[str, tuple[list[str], Any]] = {
    "layernorm": (["--norm_type", "layernorm"], lambda s: s["warmup_steps"]),
    "pn-default": (PN, lambda s: s["warmup_steps"]),
    "alpha_fwd=0.95": ([*PN, "--powernorm_alpha_fwd", "0.95"], lambda s: s["warmup_steps"]),
    "alpha_fwd=0.99": ([*PN, "--powernorm_alpha_fwd", "0.99"], lambda s: s["warmup_steps"]),
    "alpha_bkw=0.95": ([*PN, "--powernorm_alpha_bkw", "0.95"], lambda s: s["warmup_steps"]),
    "alpha_bkw=0.99": ([*PN, "--powernorm_alpha_bkw", "0.99"], lambda s: s["warmup_steps"]),
    "warmup=0": (PN, lambda s: 0),
    "warmup=half": (PN, lambda s: s["warmup_steps"] // 2),
    "warmup=double": (PN, lambda s: 2 * s["warmup_steps"]),
    "warmup=half-run": (PN, lambda s: s["max_train_steps"] // 2),
    "no-group-scaling": ([*PN, "--powernorm_group_num", "none"], lambda s: s["warmup_steps"]),
    "batch-denominator": ([*PN, "--powernorm_backward_denominator", "batch"], lambda s: s["warmup_steps"]),
    "cumulative-statistic": ([*PN, "--powernorm_warmup_statistic", "cumulative"], lambda s: s["warmup_steps"]),
    "cumulative-ramp": ([*PN, "--powernorm_warmup_statistic", "cumulative", "--powernorm_warmup_ramp_steps", "RAMP"],
                        lambda s: s["warmup_steps"]),
}
COLUMNS = ("validation_perplexity", "test_perplexity", "loss_jump", "loss_peak_excess")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_setting_args(argv, __doc__, SIZES, SETTINGS, "outputs/studies/pn_ablation", seeds=[1, 2, 3])


def setting_argv(name: str, sizes: dict[str, Any]) -> tuple[list[str], int]:
    """The flags of setting `name` and PN's warmup in updates under `sizes`."""
    flags, warmup = SETTINGS[name]
    pn_warmup = warmup(sizes)
    flags = [str(sizes["warmup_steps"] // 2) if flag == "RAMP" else flag for flag in flags]
    if flags[:2] == PN:
        flags = [*flags, "--powernorm_warmup_steps", str(pn_warmup)]
    return flags, pn_warmup


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    flags, pn_warmup = setting_argv(cell.options["setting"], cell.options)
    scores = train_setting(cell, folder, flags)
    return {**scores, "pn_warmup_steps": pn_warmup, **loss_jump(training_losses(folder), pn_warmup)}


def same_runs(args: argparse.Namespace) -> dict[str, str]:
    """Settings that are the same run as an earlier one at this budget (at 600 updates, warmup=double
    and warmup=half-run are both 300 updates), each mapped to that earlier setting: run once."""
    sizes = size_values(args, SIZES)
    first: dict[tuple[str, ...], str] = {}
    aliases = {}
    for setting in args.settings:
        flags = tuple(setting_argv(setting, sizes)[0])
        aliases[setting] = first.setdefault(flags, setting)
    return {alias: setting for alias, setting in aliases.items() if alias != setting}


def cells(args: argparse.Namespace, files: dict[str, str], tokenizer: str) -> list[Cell]:
    aliases = same_runs(args)
    runs = ((f"{setting}-seed{seed}", {"setting": setting, "seed": seed})
            for seed in args.seeds for setting in args.settings if setting not in aliases)
    return setting_cells(args, files, tokenizer, SIZES, runs)


def best_setting(results: list[dict[str, Any]]) -> str | None:
    """The PN setting with the lowest mean test perplexity over its seeds."""
    means = {s: statistics.fmean(r["test_perplexity"] for r in results if r["setting"] == s)
             for s in dict.fromkeys(r["setting"] for r in results) if s != "layernorm"}
    return min(means, key=means.get) if means else None


def write_results(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    aliases = same_runs(args)
    results = [*results, *({**r, "setting": alias, "same_runs_as": setting}
                           for alias, setting in aliases.items() for r in results if r["setting"] == setting)]
    results.sort(key=lambda r: (r["seed"], args.settings.index(r["setting"])))
    write_rows(results, output_dir / "results.csv", leave_out=CELL_INPUTS)
    layernorm = {r["seed"]: r["test_perplexity"] for r in results if r["setting"] == "layernorm"}
    rows = []
    for setting, runs in runs_by_setting(results, args.settings):
        diffs = ", ".join(f"{r['test_perplexity'] - layernorm[r['seed']]:+.2f}" for r in runs if r["seed"] in layernorm)
        name = f"{setting} (the runs of {aliases[setting]})" if setting in aliases else setting
        rows.append((name, str(len(runs)), *(mean_std([r[c] for r in runs], 3 if "loss" in c else 2) for c in COLUMNS),
                     diffs or "-"))
    best = best_setting(results)
    write_summary(output_dir, args, "PowerNorm's options",
                  f"{args.max_train_steps} updates of {args.max_tokens} tokens, learning-rate warmup "
                  f"{args.warmup_steps} updates, seeds {seeds_of(results)}; mean ± std over each setting's runs.",
                  ("setting", "runs", *COLUMNS, "test minus LayerNorm's, per seed"), "lr" + "r" * len(COLUMNS) + "l",
                  rows, after=["", f"Best PN setting by mean test perplexity: `{best}`."] if best else ())
    _plot(results, args, output_dir / "ablation.png")


def _plot(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """Test perplexity per setting (each seed a dot, the mean a bar), LayerNorm's mean as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    groups = runs_by_setting(results, args.settings)
    for i, (setting, runs) in enumerate(groups):
        values = [r["test_perplexity"] for r in runs]
        axis.bar(i, statistics.fmean(values), color="tab:grey" if setting == "layernorm" else "tab:blue", alpha=0.5)
        axis.plot([i] * len(values), values, "k.", markersize=4)
    layernorm = [r["test_perplexity"] for r in results if r["setting"] == "layernorm"]
    if layernorm:
        axis.axhline(statistics.fmean(layernorm), color="tab:grey", linestyle="--", linewidth=0.8)
    values = [r["test_perplexity"] for r in results]
    axis.set_ylim(min(values) * 0.97, max(values) * 1.02)
    axis.set_xticks(range(len(groups)), [setting for setting, _ in groups], rotation=45, ha="right", fontsize=7)
    axis.set_ylabel("test perplexity")
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run_lm_study(parse_args(argv), cells, run_cell, write_results, "PN ablation")


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
