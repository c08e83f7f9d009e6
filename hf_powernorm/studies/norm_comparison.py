"""Every norm at the same budget: the paper's Tables 1 and 2 and Appendix B.3, on PTB and Multi30k.

Shen et al. (2020) compare LayerNorm, BatchNorm, PN-V and PN on IWSLT14/WMT14 (BLEU, Table 1) and
PTB/WikiText-103 (perplexity, Table 2), and Batch Renormalization and MABN in Appendix B.3. This
study trains each norm of the registry - LayerNorm, BatchNorm, PN-V, PN with either backward
denominator (`running`, the paper's eqs. 11-13 and Algorithm 2, the forward's denominator; `batch`,
the authors' reference code, `sqrt(v + eps)` of the batch even after warmup), RMSNorm, GroupNorm,
BatchRenorm, MABN - with the same model, budget and hyper-parameters, for every seed:

- `ptb`: a causal LM (`lm-small`'s pre-norm layout at width 128, 2 layers, the norm at every
  position) on Penn Treebank, scored by validation and test perplexity (per BPE token and per word);
- `multi30k`: `recipes/train_wmt.py`'s default model (width 64, 2+2 layers, the norm in the encoder,
  LayerNorm in the decoder as in the paper's translation models) on Multi30k de->en, scored by
  validation and test BLEU (beam 4, the first 500 sentences of `val` and `test_2016_flickr`).

It writes `results.csv` (one row per run), `curves.csv` (validation score per evaluation),
`summary.md` (mean ± std over seeds, and the difference to LayerNorm seed by seed) and
`curves_<task>.png` into `--output_dir`. Cells run seed-major, so that a grid stopped early has
every norm at its first seeds.

    python recipes/studies/norm_comparison.py --data_dir DIR --jobs 2          # DIR holds ptb/, multi30k/raw/
    python recipes/studies/norm_comparison.py --tasks ptb --train_file ptb.train.txt \
        --validation_file ptb.valid.txt --test_file ptb.test.txt              # or --dataset_name ptb_text_only
    python recipes/studies/norm_comparison.py --smoke --output_dir /tmp/nc      # embedded corpora, seconds

Runs resume: a finished run is never redone (`hf_powernorm.training.grid`); `--report_only`
writes the outputs of the runs finished so far while the others still run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from ..training import read_run_log, translation
from ..training.executors import add_executor_args
from ..training.grid import Cell
from ..training.options import BadInput, MissingInput
from ..training.reports import mean_std, save_figure, seeds_of, write_rows
from .runs import (
    DATA_OPTIONS,
    add_lm_size_args,
    add_study_data_args,
    budget_argv,
    lm_size,
    prepare_lm_data,
    run_study,
    study_data_files,
    train_study_lm,
)

SETTINGS = {
    "layernorm": ["--norm_type", "layernorm"],
    "batchnorm": ["--norm_type", "batchnorm"],
    "powernorm_v": ["--norm_type", "powernorm_v"],
    "powernorm": ["--norm_type", "powernorm", "--powernorm_backward_denominator", "running"],
    "powernorm-batch-denominator": ["--norm_type", "powernorm", "--powernorm_backward_denominator", "batch"],
    "rmsnorm": ["--norm_type", "rmsnorm"],
    "groupnorm": ["--norm_type", "groupnorm"],
    "batchrenorm": ["--norm_type", "batchrenorm"],
    "mabn": ["--norm_type", "mabn"],
}
TASKS = ("ptb", "multi30k")
SIZES = {
    "real": {"ptb": {"vocab_size": 4000, "block_size": 128, "max_tokens": 1024, "max_train_steps": 1500,
                     "warmup_steps": 150, "eval_steps": 150, "learning_rate": 1e-3},
             "multi30k": {"vocab_size": 8000, "max_tokens": 2048, "max_train_steps": 2000, "warmup_steps": 400,
                          "eval_steps": 250, "learning_rate": 3e-3, "max_eval_samples": 500}},
    "smoke": {"ptb": {"vocab_size": 120, "block_size": 16, "max_tokens": 128, "max_train_steps": 8,
                      "warmup_steps": 2, "eval_steps": 4, "learning_rate": 5e-3},
              "multi30k": {"vocab_size": 150, "max_tokens": 256, "max_train_steps": 4, "warmup_steps": 2,
                           "eval_steps": 2, "learning_rate": 3e-3, "max_eval_samples": 8}},
}
SCORES = {"ptb": ("validation_perplexity", "test_perplexity", "test_word_perplexity"),
          "multi30k": ("validation_bleu", "test_bleu")}
LOWER_IS_BETTER = {"ptb": True, "multi30k": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_data_args(p, "ptb/ptb.{train,valid,test}.txt and multi30k/raw/ (Multi30k needs it; PTB may come "
                           "from the other options)")
    p.add_argument("--output_dir", default="outputs/studies/norm_comparison")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    add_lm_size_args(p)
    add_executor_args(p)
    p.add_argument("--smoke", action="store_true", help="the embedded corpora at tiny sizes (seconds)")
    p.add_argument("--report_only", action="store_true",
                   help="write the outputs from the runs finished so far, and run nothing")
    p.add_argument("--ptb_steps", type=int, help="PTB updates (default 1500; 8 with --smoke)")
    p.add_argument("--multi30k_steps", type=int, help="Multi30k updates (default 2000; 4 with --smoke)")
    args = p.parse_args(argv)
    args.sizes = {task: dict(values) for task, values in SIZES["smoke" if args.smoke else "real"].items()}
    for task in TASKS:
        steps = getattr(args, f"{task}_steps")
        if steps is not None:
            if steps < 1:
                raise BadInput(f"--{task}_steps must be at least 1; got {steps}")
            args.sizes[task]["max_train_steps"] = steps
    if "multi30k" in args.tasks and not args.smoke:
        multi30k_files(args.data_dir)  # fails now, not after the PTB runs
    if "ptb" in args.tasks and not args.smoke and not (args.data_dir or args.train_file or args.dataset_name):
        raise BadInput(f"no PTB data: pass {DATA_OPTIONS}; or --smoke for the embedded corpora")
    return args


def multi30k_files(data_dir: str | None) -> dict[str, str]:
    if data_dir is None:
        raise BadInput("--tasks multi30k needs --data_dir (a folder holding multi30k/raw/), or --smoke for the "
                       "embedded corpus")
    folder = Path(data_dir).resolve() / "multi30k" / "raw"
    files = {"train": folder / "train", "validation": folder / "val", "test": folder / "test_2016_flickr"}
    missing = [str(prefix) + ".de" for prefix in files.values() if not Path(str(prefix) + ".de").is_file()]
    if missing:
        raise MissingInput(f"--data_dir {data_dir}: no Multi30k files {missing} (--smoke runs on the embedded "
                           f"corpus)")
    return {split: str(prefix) for split, prefix in files.items()}


def train_ptb(options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One causal LM on PTB with the setting's norm at every position."""
    sizes = options["sizes"]
    argv = [*budget_argv(options["seed"], sizes), "--clip_norm", "0.25", "--weight_decay", "0.01",
            *SETTINGS[options["setting"]]]
    _, scores = train_study_lm(folder, options["tokenizer"], argv, options["files"], sizes["block_size"],
                               options["model_size"])
    return scores


def train_multi30k(options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The translation task of `recipes/train_wmt.py` on Multi30k (or the embedded corpus at smoke
    size) with the setting's norm in the encoder, in this process."""
    sizes = options["sizes"]
    argv = ["--output_dir", str(folder / "run"),
            *budget_argv(options["seed"], sizes), "--vocab_size", str(sizes["vocab_size"]),
            "--max_eval_samples", str(sizes["max_eval_samples"]), "--num_beams", "4", "--max_new_tokens", "50",
            *SETTINGS[options["setting"]]]
    if options["files"]:
        argv += ["--train_file", options["files"]["train"], "--validation_file", options["files"]["validation"],
                 "--test_file", options["files"]["test"]]
    translation.main(argv)
    results = json.loads((folder / "run" / "all_results.json").read_text(encoding="utf-8"))
    return {k: v for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # runs share the machine's cores (--jobs)
    train = train_ptb if cell.options["task"] == "ptb" else train_multi30k
    return train(cell.options, folder)


def cells(args: argparse.Namespace, inputs: dict[str, dict[str, Any]]) -> list[Cell]:
    """Seed-major: every setting's first seed before any second seed."""
    return [Cell(f"{task}-{setting}-seed{seed}", {"task": task, "setting": setting, "seed": seed,
                                                   "sizes": args.sizes[task], **inputs[task]},
                 paths=("files", "tokenizer") if task == "ptb" else ("files",))
            for seed in args.seeds for task in args.tasks for setting in args.settings]


def _inputs(args: argparse.Namespace, output_dir: Path) -> dict[str, dict[str, Any]]:
    """Per task, what its runs read: PTB's files and the BPE prepared once; Multi30k's file prefixes."""
    inputs: dict[str, dict[str, Any]] = {}
    if "ptb" in args.tasks:
        sizes = args.sizes["ptb"]
        files = study_data_files(args, output_dir)
        inputs["ptb"] = {"files": files, "model_size": lm_size(args),
                         "tokenizer": prepare_lm_data(files, output_dir, sizes["vocab_size"], sizes["block_size"])}
    if "multi30k" in args.tasks:
        inputs["multi30k"] = {"files": None if args.smoke else multi30k_files(args.data_dir)}
    return inputs


# -- outputs ------------------------------------------------------------------------------------


def log_folder(output_dir: Path, result: dict[str, Any]) -> Path:
    """The folder of a run's `training_log.jsonl` (a translation run logs in its `run/` subfolder)."""
    folder = Path(output_dir) / "cells" / result["cell"]
    return folder / "run" if result["task"] == "multi30k" else folder


def validation_curve(output_dir: Path, result: dict[str, Any]) -> list[tuple[int, float]]:
    """The `(update, validation score)` pairs of a run's `training_log.jsonl`, in logged order."""
    return [(r["step"], r["validation"]) for r in read_run_log(log_folder(output_dir, result)) if "validation" in r]


def last_quarter_change(curve: list[tuple[int, float]]) -> float:
    """Relative change of the validation score over the last quarter of a run, in percent: from the
    validation nearest three quarters of the last update (the later of two as near) to the last
    validation. Near zero, the curve has flattened; NaN with fewer than two validations."""
    if len(curve) < 2:
        return math.nan
    last_step, last = curve[-1]
    _, value = min(curve[:-1], key=lambda point: (abs(point[0] - 0.75 * last_step), -point[0]))
    return 100 * (last - value) / value if value else math.nan


def summary_lines(results: list[dict[str, Any]], task: str, settings: list[str],
                  curves: dict[str, list[tuple[int, float]]]) -> list[str]:
    """Mean ± std over seeds per setting, the validation curve's change over the last quarter of the
    run, and each seed's difference to LayerNorm's run of that seed (negative is better for
    perplexity, positive for BLEU). `curves`: each run's validation curve, by cell name."""
    scores = SCORES[task]
    lines = [f"| {task} | runs | " + " | ".join(scores)
             + " | validation change, last quarter (%) | test minus LayerNorm's, per seed |",
             "|---|---:|" + "---:|" * (len(scores) + 1) + "---|"]
    key = "test_bleu" if task == "multi30k" else "test_perplexity"
    baseline = {r["seed"]: r[key] for r in results if r["task"] == task and r["setting"] == "layernorm"}
    for setting in settings:
        rows = [r for r in results if r["task"] == task and r["setting"] == setting]
        if not rows:
            continue
        diffs = ", ".join(f"{r[key] - baseline[r['seed']]:+.2f}" for r in rows if r["seed"] in baseline)
        change = mean_std([last_quarter_change(curves[r["cell"]]) for r in rows], 1)
        lines.append(f"| {setting} | {len(rows)} | " + " | ".join(mean_std([r[s] for r in rows]) for s in scores)
                     + f" | {change} | {diffs or '-'} |")
    return lines


def write_results(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    write_rows(results, output_dir / "results.csv", leave_out=("files", "tokenizer", "sizes", "model_size"))
    curves = {result["cell"]: validation_curve(output_dir, result) for result in results}  # each log read once
    with open(output_dir / "curves.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "setting", "seed", "step", "validation"])
        for result in results:
            for step, score in curves[result["cell"]]:
                writer.writerow([result["task"], result["setting"], result["seed"], step, score])
    corpora = " and ".join({"ptb": "PTB", "multi30k": "Multi30k"}[task] for task in args.tasks)
    lines = [f"# Every norm at the same budget ({'smoke sizes' if args.smoke else corpora})", ""]
    for task in args.tasks:
        sizes = args.sizes[task]
        lines += [f"{task}: {sizes['max_train_steps']} updates of {sizes['max_tokens']} tokens, learning rate "
                  f"{sizes['learning_rate']}, {sizes['warmup_steps']} warmup updates; seeds with runs "
                  f"{seeds_of([r for r in results if r['task'] == task])}; "
                  "mean ± std over seeds.", "", *summary_lines(results, task, args.settings, curves), ""]
        _plot(results, task, args.settings, curves, output_dir)
    (output_dir / "summary.md").write_text("\n".join(lines), encoding="utf-8")


def _plot(results: list[dict[str, Any]], task: str, settings: list[str],
          curves: dict[str, list[tuple[int, float]]], output_dir: Path) -> None:
    """Validation score over updates, mean over seeds, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for setting in settings:
        runs = [r for r in results if r["task"] == task and r["setting"] == setting]
        if not runs:
            continue  # a setting with no finished run has no line, and no legend entry
        run_curves = [dict(curves[r["cell"]]) for r in runs]
        steps = sorted(set.intersection(*(set(c) for c in run_curves)))
        axis.plot(steps, [statistics.fmean(c[s] for c in run_curves) for s in steps], label=setting, linewidth=1,
                  marker=".")
    if LOWER_IS_BETTER[task]:
        axis.set_yscale("log")
    axis.set_xlabel("update")
    axis.set_ylabel("validation perplexity" if task == "ptb" else "validation BLEU")
    axis.legend(fontsize=7, ncol=2)
    save_figure(figure, output_dir / f"curves_{task}.png")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run_study(parse_args(argv), _inputs, cells, run_cell, write_results, "Norm comparison")


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
