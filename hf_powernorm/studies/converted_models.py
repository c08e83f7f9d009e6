"""LayerNorm against PowerNorm in Transformers' own models, converted with `convert_norms`.

A tiny BERT sentence classifier and a tiny GPT-2 language model, randomly initialised from small
configs with a BPE of the embedded corpora, are trained from scratch by the recipes' tasks in
this process (`--model_name_or_path` the saved folder, `--convert_norms layernorm|powernorm`): the same
initial weights, data, budget and hyper-parameters for both norms, seeds 1-3. LayerNorm runs go
through the same conversion (the registry's LayerNorm computes what `nn.LayerNorm` does), so the
two differ only in the norm. Writes `results.csv` and `summary.md` into `--output_dir`.

    python recipes/studies/converted_models.py --jobs 2
    python recipes/studies/converted_models.py --smoke --output_dir /tmp/converted
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path
from typing import Any

from ..training import (
    classification,
    language_modeling,
    synthetic_classification_corpus,
    synthetic_lm_corpus,
    train_bpe_tokenizer,
)
from ..training.executors import add_executor_args, executor_settings
from ..training.grid import Cell, run_grid
from .runs import study_output_dir

TASKS = {"bert-classification": (classification, "test_accuracy"),
         "gpt2-lm": (language_modeling, "test_perplexity")}
SIZES = {"real": {"updates": {"bert-classification": 300, "gpt2-lm": 400}, "width": 64, "warmup": 100},
         "smoke": {"updates": {"bert-classification": 3, "gpt2-lm": 3}, "width": 32, "warmup": 1}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="outputs/studies/converted_models")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    add_executor_args(p)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    return p.parse_args(argv)


def _model_folder(output_dir: Path, task: str, width: int) -> Path:
    """The task's randomly initialised Transformers model (seed 0) and BPE, saved once."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    folder = output_dir / "models" / task
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    if task == "bert-classification":
        texts = synthetic_classification_corpus()["train"]["text"]
        tokenizer = train_bpe_tokenizer(texts, vocab_size=1000)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=width, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=2 * width, max_position_embeddings=160, num_labels=3,
                            pad_token_id=tokenizer.pad_token_id)
        model = BertForSequenceClassification(config)
    else:
        texts = synthetic_lm_corpus()["train"]["text"]
        tokenizer = train_bpe_tokenizer(texts, vocab_size=500)
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=width, n_layer=2, n_head=4, n_positions=80,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    """One run of the task, as its recipe's documented command line, in this process."""
    import torch

    torch.set_num_threads(1)  # runs share the machine's cores (--jobs)
    options = cell.options
    task, score = TASKS[options["task"]]
    argv = ["--model_name_or_path", options["model"],
            "--convert_norms", options["norm"], "--seed", str(options["seed"]), "--max_train_steps",
            str(options["updates"]), "--num_warmup_steps", str(options["warmup"]), "--eval_steps",
            str(max(1, options["updates"] // 4)), "--output_dir", str(folder / "run")]
    if options["task"] == "gpt2-lm":
        argv += ["--block_size", "64"]
    task.main(argv)
    results = json.loads((folder / "run" / "all_results.json").read_text())
    return {"score": results[score], "validation": results["best_validation"], "train_steps": results["train_steps"]}


def write_summary(results: list[dict[str, Any]], output_dir: Path) -> str:
    keys = ["task", "norm", "seed", "score", "validation", "train_steps"]
    with open(output_dir / "results.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    lines = ["| model, task | norm | test score (mean ± std) | per seed |", "|---|---|---:|---|"]
    for task, (_, score) in TASKS.items():
        for norm in ("layernorm", "powernorm"):
            values = [r["score"] for r in results if r["task"] == task and r["norm"] == norm]
            spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
            lines.append(f"| {task} ({score}) | {norm} | {statistics.fmean(values):.3f}{spread} | "
                         + ", ".join(f"{v:.3f}" for v in values) + " |")
    text = "\n".join(lines) + "\n"
    (output_dir / "summary.md").write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    executor = executor_settings(args)  # checked before anything is written
    output_dir = study_output_dir(args)
    sizes = SIZES["smoke" if args.smoke else "real"]
    cells = [Cell(f"{task}-{norm}-seed{seed}", {"task": task, "norm": norm, "seed": seed,
                                                 "model": str(_model_folder(output_dir, task, sizes["width"])),
                                                 "updates": sizes["updates"][task], "warmup": sizes["warmup"]},
                  paths=("model",))
             for task in TASKS for norm in ("layernorm", "powernorm") for seed in args.seeds]
    results = run_grid(cells, run_cell, output_dir, desc="Converted models", executor=executor)
    print(write_summary(results, output_dir))
    return results


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
