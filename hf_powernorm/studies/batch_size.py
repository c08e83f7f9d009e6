"""The statistics' mini-batch at a fixed update size: the paper's Figure 5, on Penn Treebank.

Shen et al. (2020, Figure 5) keep 4K tokens per update and vary the mini-batch over which the norms
take their statistics from 512 to 4K tokens, with gradient accumulation (8 accumulations of 512
tokens, ...): BN is poor and erratic at every size, PN-V matches LN only at 4K, and PN is ahead of
LN at every size. This study does the same at a CPU's scale: 1,024 tokens per update, mini-batches
of 128, 256, 512 and 1,024 tokens (8, 4, 2, 1 accumulations; one to eight 128-token sequences),
the same small causal LM on PTB as the other studies, LayerNorm, BatchNorm, PN-V and PN at every
norm position, for every seed, scored by validation and test perplexity. PN's warmup counts
forward passes, so it spans the same updates at every mini-batch size. Writes `results.csv`,
`summary.md` and `batch_size.png` into `--output_dir`.

    python recipes/studies/batch_size.py --data_dir DIR --jobs 2        # DIR holds ptb/
    python recipes/studies/batch_size.py --smoke --output_dir /tmp/bs   # embedded corpus, seconds

Runs resume: a finished run is never redone (`hf_powernorm.training.grid`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ..training.grid import Cell
from ..training.options import BadInput
from ..training.reports import mean_std, save_figure, seeds_of, write_rows
from .runs import add_study_args, budget_argv, fill_sizes, lm_size, run_lm_study, train_study_lm

NORMS = ("layernorm", "batchnorm", "powernorm_v", "powernorm")
SIZES = {"real": {"vocab_size": 4000, "block_size": 128, "update_tokens": 1024, "max_train_steps": 600,
                  "warmup_steps": 150, "eval_steps": 150, "learning_rate": 1e-3},
         "smoke": {"vocab_size": 120, "block_size": 16, "update_tokens": 128, "max_train_steps": 8,
                   "warmup_steps": 2, "eval_steps": 4, "learning_rate": 5e-3}}
ACCUMULATIONS = (8, 4, 2, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_args(p, SIZES, "outputs/studies/batch_size", seeds=[1, 2, 3])
    p.add_argument("--norms", nargs="+", default=list(NORMS), choices=NORMS)
    p.add_argument("--accumulations", type=int, nargs="+", default=list(ACCUMULATIONS),
                   help="gradient accumulations per update; the mini-batch is update_tokens / this")
    args = p.parse_args(argv)
    fill_sizes(args, SIZES)
    for accumulation in args.accumulations:
        mini_batch, rest = divmod(args.update_tokens, accumulation) if accumulation > 0 else (0, 1)
        if rest or mini_batch < args.block_size or mini_batch % args.block_size:
            raise BadInput(f"--accumulations {accumulation}: update_tokens {args.update_tokens} / {accumulation} "
                           f"must be a whole number of {args.block_size}-token blocks")
    return args


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # runs share the machine's cores (--jobs)
    options = cell.options
    sizes = {**options, "max_tokens": options["mini_batch"], "gradient_accumulation_steps": options["accumulation"]}
    argv = [*budget_argv(options["seed"], sizes), "--clip_norm", "0.25", "--weight_decay", "0.01",
            "--norm_type", options["norm"]]
    _, scores = train_study_lm(folder, options["tokenizer"], argv, options["files"], options["block_size"],
                               options["model_size"])
    return scores


def cells(args: argparse.Namespace, files: dict[str, str], tokenizer: str) -> list[Cell]:
    sizes = {name: getattr(args, name) for name in SIZES["real"]}
    return [Cell(f"{norm}-mb{args.update_tokens // k}-seed{seed}",
                 {"norm": norm, "mini_batch": args.update_tokens // k, "accumulation": k, "seed": seed,
                  "files": files, "tokenizer": tokenizer, "model_size": lm_size(args), **sizes},
                 paths=("files", "tokenizer"))
            for seed in args.seeds for k in args.accumulations for norm in args.norms]


def write_results(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    write_rows(results, output_dir / "results.csv", leave_out=("files", "tokenizer", "model_size"))
    mini_batches = sorted({r["mini_batch"] for r in results})
    lines = [f"# The statistics' mini-batch at {args.update_tokens} tokens per update "
             f"({'embedded corpus, smoke sizes' if args.smoke else 'PTB'})", "",
             f"{args.max_train_steps} updates, seeds {seeds_of(results)}; test perplexity, "
             "mean ± std over the runs finished.", "",
             "| norm | " + " | ".join(f"mini-batch {m}" for m in mini_batches) + " |",
             "|---|" + "---:|" * len(mini_batches)]
    for norm in args.norms:
        cells_ = [mean_std([r["test_perplexity"] for r in results if r["norm"] == norm and r["mini_batch"] == m])
                  for m in mini_batches]
        lines.append(f"| {norm} | " + " | ".join(cells_) + " |")
    (output_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot(results, args, mini_batches, output_dir / "batch_size.png")


def _plot(results: list[dict[str, Any]], args: argparse.Namespace, mini_batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.5, 4))
    for norm in args.norms:
        points = [(m, [r["test_perplexity"] for r in results if r["norm"] == norm and r["mini_batch"] == m])
                  for m in mini_batches]
        points = [(m, statistics.fmean(values)) for m, values in points if values]
        if points:
            axis.plot(*zip(*points), marker="o", label=norm, linewidth=1)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens per mini-batch (statistics)")
    axis.set_ylabel("test perplexity (mean over seeds)")
    axis.legend(fontsize=7)
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run_lm_study(parse_args(argv), cells, run_cell, write_results, "Batch size")


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
