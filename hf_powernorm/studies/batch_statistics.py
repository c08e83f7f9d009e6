"""Why batch normalization fails in transformers: the paper's Figures 2, 3, 4, 6 and 7 on real data.

Shen et al. (2020) show that in a transformer the batch statistics of BatchNorm stray far from its
running statistics, with large outliers, and so do the gradients routed through them (Figures 2-3),
while in a CNN on images both are small and settle; that the quadratic mean `psi2_B` of PN-V strays
less than the variance `sigma2_B` and routes a steadier gradient (Figure 4); that PN's word
embeddings have slower-decaying singular values than LayerNorm's (Figure 6); and that PN-V and PN
keep `|gamma_i| <= psi_B,i` (Lemma 2, Figure 7). This study trains:

- a causal LM on Penn Treebank (`lm-small`'s pre-norm layout at width 128, 2 layers) with
  LayerNorm, BatchNorm, PN-V and PN at every norm position, recording what every norm sees every
  `--record_every` updates (`hf_powernorm.NormStatisticsRecorder`);
- a small CNN on scikit-learn's 8x8 digits (1,797 images, offline) whose two convolutions are each
  followed by the same `MaskedBatchNorm` over images x pixels (BatchNorm2d's statistics), the first
  with 16 channels as in ResNet20, recorded the same way;

and writes `results.csv` (one row per run: fluctuation summaries of the first norm layer, Lemma 2's
fraction, singular-value summaries, scores), `statistics.csv` (the recorded rows of every run),
`summary.md` and `figure2_3.png`, `figure4.png`, `figure6.png`, `figure7.png` into `--output_dir`.

    python recipes/studies/batch_statistics.py --data_dir DIR --jobs 2       # DIR holds ptb/
    python recipes/studies/batch_statistics.py --smoke --output_dir /tmp/s   # embedded corpus, seconds

Runs resume: a finished run is never redone (`hf_powernorm.training.grid`).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import MaskedBatchNorm, NormStatisticsRecorder
from ..instrumentation import read_norm_statistics
from ..training.grid import Cell
from ..training.options import BadInput
from ..training.reports import mean_std, save_figure, seeds_of, write_rows
from .runs import add_study_args, budget_argv, fill_sizes, lm_size, run_lm_study, train_study_lm

LM_NORMS = ("layernorm", "batchnorm", "powernorm_v", "powernorm")
SIZES = {"real": {"vocab_size": 4000, "block_size": 128, "max_tokens": 1024, "max_train_steps": 600,
                  "warmup_steps": 150, "eval_steps": 150, "learning_rate": 1e-3, "record_every": 5,
                  "cnn_epochs": 30, "cnn_images": 0},
         "smoke": {"vocab_size": 120, "block_size": 16, "max_tokens": 128, "max_train_steps": 12,
                   "warmup_steps": 4, "eval_steps": 6, "learning_rate": 5e-3, "record_every": 2,
                   "cnn_epochs": 4, "cnn_images": 300}}
CNN = {"channels": (16, 32), "batch_size": 128, "learning_rate": 0.05, "momentum": 0.9, "weight_decay": 5e-4}
# Fluctuation summaries of the first norm layer: the recorder's columns, over the recorded steps.
FLUCTUATIONS = ("rel_dist_mean", "rel_dist_var", "rel_dist_psi2", "g_mu", "g_sigma2", "g_psi2")
SINGULAR_INDEXES = (8, 32, 64, 128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_args(p, SIZES, "outputs/studies/batch_statistics", seeds=[1, 2])
    p.add_argument("--norms", nargs="+", default=list(LM_NORMS), choices=LM_NORMS, help="the LM's norms")
    p.add_argument("--no_cnn", action="store_true", help="leave out the CNN runs")
    args = p.parse_args(argv)
    fill_sizes(args, SIZES)
    if args.record_every < 1:
        raise BadInput(f"--record_every must be at least 1; got {args.record_every}")
    return args


# -- the CNN on digits --------------------------------------------------------------------------


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, each followed by batch normalization over images x pixels and ReLU,
    global average pooling and a linear classifier."""

    def __init__(self, channels: tuple[int, int] = (16, 32), classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels[0], 3, padding=1)
        self.norm1 = MaskedBatchNorm(channels[0])
        self.conv2 = nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.norm2 = MaskedBatchNorm(channels[1])
        self.head = nn.Linear(channels[1], classes)

    @staticmethod
    def _normalize(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape  # the norm sees (images, pixels, channels)
        y = norm(x.permute(0, 2, 3, 1).reshape(batch, height * width, channels))
        return y.reshape(batch, height, width, channels).permute(0, 3, 1, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self._normalize(self.norm1, self.conv1(images)))
        hidden = F.relu(self._normalize(self.norm2, self.conv2(hidden)))
        return self.head(hidden.mean(dim=(2, 3)))


def digits(limit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits as `(images (N, 1, 8, 8) in [0, 1], labels)`; `limit` keeps the first."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError("the CNN runs read scikit-learn's digits: pip install 'hf_powernorm[studies]' "
                          "(or pass --no_cnn)") from error
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    return (images[:limit], labels[:limit]) if limit else (images, labels)


def train_cnn(options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """SGD with momentum on 80% of the digits in whole batches, recording the norms every
    `record_every` updates; the held-out 20%'s accuracy."""
    generator = torch.Generator().manual_seed(options["seed"])
    torch.manual_seed(options["seed"])
    images, labels = digits(options["cnn_images"])
    order = torch.randperm(len(labels), generator=generator)
    cut = int(0.8 * len(labels))
    train_idx, test_idx = order[:cut], order[cut:]
    model = DigitsCNN(CNN["channels"])
    optimizer = torch.optim.SGD(model.parameters(), lr=CNN["learning_rate"], momentum=CNN["momentum"],
                                weight_decay=CNN["weight_decay"])
    recorder = NormStatisticsRecorder(model, every_n_steps=options["record_every"],
                                      output_file=folder / "norm_stats.jsonl")
    step, losses = 0, []
    model.train()
    for _ in range(options["cnn_epochs"]):
        shuffled = train_idx[torch.randperm(len(train_idx), generator=generator)]
        # Whole batches only: a short last batch would give the statistics (and the gradients
        # routed through them) of fewer images at every epoch's end.
        for batch in shuffled[:len(shuffled) // CNN["batch_size"] * CNN["batch_size"]].split(CNN["batch_size"]):
            step += 1
            recorder.before_forward(step)
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            loss.backward()
            recorder.after_backward(step)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    recorder.close()
    model.eval()
    with torch.no_grad():
        accuracy = float((model(images[test_idx]).argmax(-1) == labels[test_idx]).float().mean())
    return {"train_steps": step, "final_train_loss": statistics.fmean(losses[-10:]), "test_accuracy": accuracy}


# -- the LM on PTB ------------------------------------------------------------------------------


def train_lm(options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One causal LM on PTB, recorded every `record_every` updates; its scores and the normalized
    singular values of its word embeddings (`singular_values.csv`)."""
    argv = [*budget_argv(options["seed"], options), "--clip_norm", "0.25", "--weight_decay", "0.01",
            "--norm_type", options["norm"], "--record_norm_stats", str(options["record_every"])]
    model, scores = train_study_lm(folder, options["tokenizer"], argv, options["files"], options["block_size"],
                                   options["model_size"])
    values = normalized_singular_values(model.get_input_embeddings().weight)
    with open(folder / "singular_values.csv", "w", encoding="utf-8") as handle:
        handle.write("index,normalized_singular_value\n")
        handle.writelines(f"{i},{v:.6g}\n" for i, v in enumerate(values, start=1))
    return {**scores, **singular_value_summary(values)}


def normalized_singular_values(matrix: torch.Tensor) -> list[float]:
    """Singular values of `matrix` divided by the largest (Figure 6), in decreasing order."""
    values = torch.linalg.svdvals(matrix.detach().double())
    return (values / values[0]).tolist()


def singular_value_summary(values: list[float]) -> dict[str, float]:
    """`sv_<k>`: the k-th normalized singular value; `effective_rank`: exp of the entropy of the
    singular values as a distribution (Roy and Vetterli, 2007); larger means slower decay."""
    total = sum(values)
    entropy = -sum(v / total * math.log(v / total) for v in values if v > 0)
    summary = {f"sv_{k}": values[k - 1] for k in SINGULAR_INDEXES if k <= len(values)}
    return {**summary, "effective_rank": math.exp(entropy)}


# -- the grid -----------------------------------------------------------------------------------


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    """Train one model with one seed; its scores and the fluctuation summaries of its first norm."""
    torch.set_num_threads(1)  # runs share the machine's cores (--jobs)
    options = cell.options
    result = train_cnn(options, folder) if options["model"] == "cnn" else train_lm(options, folder)
    rows = read_norm_statistics(folder / "norm_stats.jsonl")
    return {**result, **fluctuation_summary(rows, options["max_steps"])}


def first_layer_rows(rows: list[dict]) -> list[dict]:
    """The rows of the first norm layer the input passes through (the recorder writes layers in
    module order, the first one first)."""
    first = rows[0]["layer"] if rows else None
    return [row for row in rows if row["layer"] == first]


def fluctuation_summary(rows: list[dict], max_steps: int) -> dict[str, Any]:
    """Per quantity of `FLUCTUATIONS`, over the first layer's recorded steps of the last two thirds
    of training (the first third is the warm-up): the median and the largest value over the median
    (how far the outliers reach); and Lemma 2's fraction averaged over every layer and step."""
    first = [row for row in first_layer_rows(rows) if row["step"] > max_steps / 3]
    summary: dict[str, Any] = {"first_layer": rows[0]["layer"] if rows else None}
    for key in FLUCTUATIONS:
        values = [row[key] for row in first if row.get(key) is not None and math.isfinite(row[key])]
        median = statistics.median(values) if values else float("nan")
        summary[f"{key}_median"] = median
        summary[f"{key}_outlier"] = max(values) / median if values and median > 0 else float("nan")
    fractions = [row["lemma2_fraction"] for row in rows if row.get("lemma2_fraction") is not None]
    summary["lemma2_fraction"] = statistics.fmean(fractions) if fractions else float("nan")
    return summary


def cells(args: argparse.Namespace, files: dict[str, str] | None, tokenizer: str | None) -> list[Cell]:
    common = {"record_every": args.record_every}
    lm = {name: getattr(args, name) for name in ("max_tokens", "learning_rate", "warmup_steps", "max_train_steps",
                                                 "eval_steps", "block_size")}
    grid = [Cell(f"lm-{norm}-seed{seed}", {"model": "lm", "norm": norm, "seed": seed, "files": files,
                                            "tokenizer": tokenizer, "max_steps": args.max_train_steps,
                                            "model_size": lm_size(args), **lm, **common},
                 paths=("files", "tokenizer"))
            for norm in args.norms for seed in args.seeds]
    if not args.no_cnn:
        steps = args.cnn_epochs * (int(0.8 * (args.cnn_images or 1797)) // CNN["batch_size"])
        grid += [Cell(f"cnn-batchnorm-seed{seed}", {"model": "cnn", "norm": "batchnorm", "seed": seed,
                                                     "cnn_epochs": args.cnn_epochs, "cnn_images": args.cnn_images,
                                                     "max_steps": steps, **common})
                 for seed in args.seeds]
    return grid


# -- outputs ------------------------------------------------------------------------------------


def _label(result: dict[str, Any]) -> str:
    return f"{result['model']}-{result['norm']}"


def _summary(values: list[float | None], digits: int = 3) -> str:
    """Mean ± std in significant digits: the quantities span 1e-6 to 1e2."""
    return mean_std(values, digits, significant=True)


def write_results(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    write_rows(results, output_dir / "results.csv", leave_out=("files", "tokenizer", "model_size"))
    _write_statistics(results, output_dir)
    labels = list(dict.fromkeys(_label(r) for r in results))
    by_label = {label: [r for r in results if _label(r) == label] for label in labels}
    lines = [f"# Batch statistics in a transformer and a CNN ({'smoke sizes' if args.smoke else 'PTB and digits'})",
             "", f"LM: {args.max_train_steps} updates of {args.max_tokens} tokens; CNN: {args.cnn_epochs} epochs of "
             f"batches of {CNN['batch_size']} images; recorded every {args.record_every} updates; seeds {seeds_of(results)}; "
             "mean ± std over seeds. Fluctuations of the first norm layer over the last two thirds of training: "
             "median, and largest / median.", "",
             "| run | " + " | ".join(f"{k} median | {k} max/median" for k in FLUCTUATIONS) + " | Lemma 2 fraction |",
             "|---|" + "---:|" * (2 * len(FLUCTUATIONS) + 1)]
    for label, rows in by_label.items():
        cells_ = [_summary([r[f"{k}_{s}"] for r in rows]) for k in FLUCTUATIONS for s in ("median", "outlier")]
        lines.append(f"| {label} | " + " | ".join(cells_) + f" | {_summary([r['lemma2_fraction'] for r in rows])} |")
    scored = [label for label in labels if label.startswith("lm-")]
    sv_keys = [f"sv_{k}" for k in SINGULAR_INDEXES if any(f"sv_{k}" in r for r in results)]
    lines += ["", "| LM | validation perplexity | test perplexity | " + " | ".join(sv_keys) + " | effective rank |",
              "|---|" + "---:|" * (3 + len(sv_keys))]
    for label in scored:
        rows = by_label[label]
        values = [_summary([r.get(c) for r in rows], 4) for c in ("validation_perplexity", "test_perplexity")]
        values += [_summary([r.get(k) for r in rows]) for k in (*sv_keys, "effective_rank")]
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    if any(r["model"] == "cnn" for r in results):
        accuracy = _summary([r["test_accuracy"] for r in results if r["model"] == "cnn"])
        lines += ["", f"CNN held-out accuracy: {accuracy}."]
    (output_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot_all(results, args, output_dir)


def _write_statistics(results: list[dict[str, Any]], output_dir: Path) -> None:
    """Every recorded row of every run in one table, with the run's name and seed."""
    rows = [{"run": _label(r), "seed": r["seed"], **row}
            for r in results for row in read_norm_statistics(output_dir / "cells" / r["cell"] / "norm_stats.jsonl")]
    write_rows(rows, output_dir / "statistics.csv")


def _series(output_dir: Path, result: dict[str, Any], key: str, every_layer: bool = False) -> tuple[list, list]:
    """`(fraction of training, value)` of `key` for the run's first norm layer (or the mean over layers)."""
    rows = read_norm_statistics(output_dir / "cells" / result["cell"] / "norm_stats.jsonl")
    if not every_layer:
        rows = first_layer_rows(rows)
    by_step: dict[int, list[float]] = {}
    for row in rows:
        if row.get(key) is not None and math.isfinite(row[key]):
            by_step.setdefault(row["step"], []).append(row[key])
    steps = sorted(by_step)
    return [s / result["max_steps"] for s in steps], [statistics.fmean(by_step[s]) for s in steps]


def _panel(axis: Any, output_dir: Path, results: list[dict[str, Any]], curves: list[tuple[str, str, str]],
           title: str, every_layer: bool = False, log: bool = True) -> None:
    """One line per `(run label, column, legend)`, the first seed's run."""
    for label, key, legend in curves:
        runs = [r for r in results if _label(r) == label]
        if runs:
            x, y = _series(output_dir, runs[0], key, every_layer)
            axis.plot(x, y, label=legend, linewidth=0.9)
    if log and axis.lines:
        axis.set_yscale("log")
    axis.set_title(title, fontsize=9)
    axis.set_xlabel("fraction of training")
    axis.legend(fontsize=7)


def _plot_all(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bn = [("lm-batchnorm", None, "transformer (PTB)"), ("cnn-batchnorm", None, "CNN (digits)")]
    figure, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for axis, (key, title) in zip(axes.flat, (("rel_dist_mean", "||mu_B - mu|| / ||mu|| (Fig. 2)"),
                                              ("rel_dist_var", "||sigma2_B - sigma2|| / ||sigma2|| (Fig. 2)"),
                                              ("g_mu", "||g_mu|| (Fig. 3)"), ("g_sigma2", "||g_sigma2|| (Fig. 3)"))):
        _panel(axis, output_dir, results, [(label, key, legend) for label, _, legend in bn], title)
    save_figure(figure, output_dir / "figure2_3.png")

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    _panel(axes[0], output_dir, results, [("lm-batchnorm", "rel_dist_var", "sigma2_B (BN)"),
                                          ("lm-powernorm_v", "rel_dist_psi2", "psi2_B (PN-V)")],
           "distance to the running statistic, relative (Fig. 4 left)")
    _panel(axes[1], output_dir, results, [("lm-batchnorm", "g_sigma2", "g_sigma2 (BN)"),
                                          ("lm-powernorm_v", "g_psi2", "g_psi2 (PN-V)")],
           "gradient through the statistic (Fig. 4 right)")
    save_figure(figure, output_dir / "figure4.png")

    figure, axis = plt.subplots(figsize=(5.5, 3.8))
    for norm in LM_NORMS:
        runs = [r for r in results if _label(r) == f"lm-{norm}"]
        if runs:
            with open(output_dir / "cells" / runs[0]["cell"] / "singular_values.csv", encoding="utf-8") as handle:
                values = [float(row["normalized_singular_value"]) for row in csv.DictReader(handle)]
            axis.plot(range(1, len(values) + 1), values, label=norm, linewidth=1)
    axis.set_xlabel("singular value index")
    axis.set_ylabel("normalized singular value")
    axis.set_title("word embeddings (Fig. 6)", fontsize=9)
    axis.legend(fontsize=7)
    save_figure(figure, output_dir / "figure6.png")

    figure, axis = plt.subplots(figsize=(5.5, 3.8))
    _panel(axis, output_dir, results, [(f"lm-{n}", "lemma2_fraction", n) for n in LM_NORMS if n != "layernorm"],
           "fraction of channels with |gamma_i| <= psi_B,i, all layers (Fig. 7)", every_layer=True, log=False)
    save_figure(figure, output_dir / "figure7.png")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run_lm_study(parse_args(argv), cells, run_cell, write_results, "Batch statistics")


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
