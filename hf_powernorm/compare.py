"""Does Power Normalization help my model? One command that answers it on the user's model and data.

For each norm of `--norms` and each seed of `--seeds`, the model of `--model_name_or_path` (a Hub id
or a folder) has its norms converted by `convert_norms` (`layernorm`: the model's own norms,
unchanged), is fine-tuned by the training library's `fit` at equal settings (with `--tune_lr`, each
norm's learning rate is chosen on validation from `--lr_grid`, with the first seed), and is scored
on validation and test. The runs form a resumable grid (`studies/grid.py`): a finished run is
never redone, `--jobs N` runs N at once on CPU, and under `accelerate launch` every run uses all
the processes. Writes into `--output_dir`:

- `results.csv`: one row per run and evaluated split;
- `report.md`: mean ± standard deviation over the seeds per norm, the verdict of each norm against
  the first (PN better / LN better only when the difference of the test means exceeds the sum of
  the two seed standard deviations, else tie; one seed gives no verdict), and the settings;
- `validation_curves.png`: validation score against updates, the mean over seeds with the range
  of the seeds as a band.

Data comes as the recipes take it: `--dataset_name` (a Hub id, or a local folder / files through
`datasets.load_dataset`) or `--train_file/--validation_file/--test_file`, tokenized by cached
`Dataset.map` passes. Without a model and data, a tiny GPT-2 trains on the embedded English corpus
(about a minute on 2 CPU cores).

    hf-powernorm compare --model_name_or_path gpt2 --task causal-lm --dataset_name wikitext \\
        --dataset_config_name wikitext-2-raw-v1 --norms layernorm powernorm --seeds 1 2 3 \\
        --max_train_steps 1000 --output_dir outputs/compare-gpt2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .normalization import NORM_CLASSES, normalize_norm_name
from .training.arguments import add_recipe_args, check_args, check_batch_budget
from .training.corpora import SENTIMENT_LABELS
from .studies.grid import RESULT_NAME, Cell, cell_result, finished_results, run_grid
from .studies.reports import better_of, mean_std, write_rows

SPLITS = ("validation", "test")
SETTINGS_NAME = "compare.json"
BASELINE = "layernorm"  # the model's own norms, unchanged
SHORT_NAMES = {"layernorm": "LN", "powernorm": "PN", "rmsnorm": "RMSNorm", "batchnorm": "BN"}
# Options that change where or how fast a comparison runs, not what it measures.
RUNTIME_OPTIONS = ("output_dir", "overwrite_output_dir", "jobs", "seeds", "norms", "report_only",
                   "preprocessing_num_workers", "overwrite_cache", "eval_batch_size", "cpu", "with_tracking",
                   "report_to", "seed")
# Recipe options that `compare` sets itself, or that make no sense for a grid of runs.
SET_BY_COMPARE = ("convert_norms", "norm_type", "encoder_norm_type", "decoder_norm_type", "preset", "config_name",
                  "config_overrides", "tokenizer_name", "resume_from_checkpoint", "checkpointing_steps",
                  "push_to_hub")
# The tiny GPT-2 of the embedded default, and its budget when none is given.
EMBEDDED_MODEL = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 80}
EMBEDDED_BUDGET = {"max_train_steps": 60, "block_size": 64, "max_tokens": 256, "learning_rate": 2e-3}


@dataclass(frozen=True)
class TaskSpec:
    """A task of `--task`: the Auto class of its model, the metric the verdict uses and its direction."""

    auto_class: str
    metric: str
    mode: str  # "min" or "max"
    needed_columns: str


TASKS = {
    "causal-lm": TaskSpec("AutoModelForCausalLM", "perplexity", "min", "'text' (or 'sentence')"),
    "classification": TaskSpec("AutoModelForSequenceClassification", "accuracy", "max",
                           "'text' (or 'sentence') and 'label'"),
    "seq2seq": TaskSpec("AutoModelForSeq2SeqLM", "bleu", "max", "'translation' ({lang: text})"),
}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-powernorm compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_recipe_args(p, learning_rate=5e-4, num_warmup_steps=20, lr_scheduler_type="linear", num_train_epochs=3,
                    output_dir="outputs/compare", eval_batch_size=16)
    compare = p.add_argument_group("comparison")
    compare.add_argument("--task", choices=sorted(TASKS), default="causal-lm")
    compare.add_argument("--norms", nargs="*", default=[BASELINE, "powernorm"],
                         help=f"norms to compare, the first the baseline of the verdict; '{BASELINE}' is the "
                              f"model's own norms, unchanged; valid: {sorted(NORM_CLASSES)}")
    compare.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3])
    compare.add_argument("--tune_lr", action="store_true",
                         help="choose each norm's learning rate from --lr_grid on validation (first seed)")
    compare.add_argument("--lr_grid", type=float, nargs="+",
                         help="learning rates tried with --tune_lr; default: --learning_rate x 1/3, 1, 3")
    compare.add_argument("--jobs", type=int, default=1, help="runs at once on CPU, each in its own process")
    compare.add_argument("--report_only", action="store_true",
                         help="write the outputs from the runs finished so far, and run nothing")
    compare.add_argument("--block_size", type=int, default=128, help="causal-lm: tokens per block")
    compare.add_argument("--max_length", type=int, default=128,
                         help="classification and seq2seq: truncate sequences to this many tokens")
    compare.add_argument("--source_lang", default="de", help="seq2seq: the source language of 'translation'")
    compare.add_argument("--target_lang", default="en", help="seq2seq: the target language of 'translation'")
    compare.add_argument("--label_names", default=",".join(SENTIMENT_LABELS),
                         help="classification: comma-separated class names of local files' string labels")
    compare.add_argument("--num_beams", type=int, default=1, help="seq2seq: beams when scoring BLEU")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked before any model or data is read."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_runs(args)
    args.embedded_default = args.model_name_or_path is None
    args.model_id = args.model_name_or_path  # as given: a Hub id is resolved to its local snapshot later
    if args.embedded_default and args.task != "causal-lm":
        raise ValueError(f"--task {args.task} needs --model_name_or_path (a Hub id or a folder); only the embedded "
                         f"default (a tiny GPT-2, --task causal-lm) builds its own model")
    _fill_defaults(args, parser)
    check_args(args, norm_options=())
    check_batch_budget(args)
    return args


def _check_runs(args: argparse.Namespace) -> None:
    """The options that say which runs to make: norms, seeds, processes."""
    given = [f"--{name}" for name in SET_BY_COMPARE if getattr(args, name, None) not in (None, False)]
    if given:
        raise ValueError(f"compare sets the model's norms and runs itself; leave out {', '.join(given)} "
                         f"(the norms come from --norms)")
    if not args.do_train:
        raise ValueError("compare fine-tunes every norm: leave out --no-do_train")
    args.norms = check_norms(args.norms)
    if not args.seeds:
        raise ValueError("--seeds is empty: give at least one seed, e.g. --seeds 1 2 3")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds repeats a seed: {args.seeds}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1; got {args.jobs}")
    if args.jobs > 1 and _world_size() > 1:
        raise ValueError("--jobs runs several CPU processes; under `accelerate launch` each run already uses "
                         "every process: leave --jobs at 1")


def _fill_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The embedded default's budget, the other tasks' options left out (neither shown in the
    settings nor checked), PN's warmup, the validation interval and the learning-rate grid."""
    if args.embedded_default:
        for name, value in EMBEDDED_BUDGET.items():
            if getattr(args, name) in (None, parser.get_default(name)):
                setattr(args, name, value)
    unused = {"causal-lm": ("max_length", "source_lang", "target_lang", "num_beams", "label_names"),
              "classification": ("block_size", "source_lang", "target_lang", "num_beams"),
              "seq2seq": ("block_size", "label_names")}[args.task]
    for name in unused:
        setattr(args, name, None)
    if args.task != "classification" and args.powernorm_warmup_steps is None:
        # Batch statistics mix the positions of a causal (decoder) batch: no warmup on them by default.
        args.powernorm_warmup_steps = 0
    if args.eval_steps is None and args.max_train_steps is not None:
        args.eval_steps = max(1, args.max_train_steps // 8)  # else after each epoch
    if args.tune_lr and not args.lr_grid:
        args.lr_grid = [args.learning_rate / 3, args.learning_rate, args.learning_rate * 3]


def check_norms(names: Sequence[str]) -> list[str]:
    """The registry names of `--norms`: at least one, each known (ValueError listing the valid ones)."""
    if not names:
        raise ValueError(f"--norms is empty: give the norms to compare, e.g. --norms layernorm powernorm; "
                         f"valid: {sorted(NORM_CLASSES)}")
    norms = []
    for name in names:
        try:
            norms.append(normalize_norm_name(name))
        except ValueError as error:
            raise ValueError(f"--norms: {error}") from None
    if len(set(norms)) != len(norms):
        raise ValueError(f"--norms names a norm twice: {names}")
    return norms


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a comparison measures: every option but those of `RUNTIME_OPTIONS`."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in RUNTIME_OPTIONS}


# ---------------------------------------------------------------------------------------------
# Checks before any training: output folder, model, task, data
# ---------------------------------------------------------------------------------------------

def check_output_folder(args: argparse.Namespace) -> None:
    """A new or empty folder, or one holding a comparison of the same settings (resumed; more norms
    or seeds may be added); another comparison's results or other files are refused unless
    `--overwrite_output_dir` clears them."""
    folder = Path(args.output_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output_dir {folder} is a file, not a folder")
    contents = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if not contents:
        return
    saved_path = folder / SETTINGS_NAME
    if saved_path.is_file():
        saved = json.loads(saved_path.read_text(encoding="utf-8"))["settings"]
        asked = json.loads(json.dumps(settings_of(args)))
        if args.model_name_or_path is None:  # the embedded default's model folder is made later
            saved = {k: v for k, v in saved.items() if k != "model_name_or_path"}
            asked.pop("model_name_or_path", None)
        differ = sorted(k for k in set(saved) | set(asked) if saved.get(k) != asked.get(k))
        if not differ or args.report_only:
            return
        what = "; ".join(f"--{k}: {saved.get(k)!r} there, {asked.get(k)!r} now" for k in differ)
        reason = f"holds another comparison's results ({what})"
    elif args.report_only:
        raise FileNotFoundError(f"--report_only: {folder} holds no comparison ({SETTINGS_NAME} is missing)")
    else:
        reason = f"holds other files ({', '.join(contents[:6])}{', ...' if len(contents) > 6 else ''})"
    if not args.overwrite_output_dir:
        raise ValueError(f"--output_dir {folder} {reason}: pass --overwrite_output_dir to clear it, or choose "
                         f"another --output_dir")
    inputs = [getattr(args, name) for name in ("model_name_or_path", "train_file", "validation_file", "test_file",
                                               "dataset_name")]
    inside = [path for path in inputs if path and Path(path).exists()
              and Path(path).resolve().is_relative_to(folder.resolve())]
    if inside:
        raise ValueError(f"--overwrite_output_dir would delete {inside}, inputs of this comparison inside "
                         f"--output_dir {folder}")
    if _world_size() == 1 or int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(folder)


def check_model(args: argparse.Namespace) -> dict[str, int]:
    """The model fits `--task` and has norms that `convert_norms` knows; returns its norm classes
    and counts (for the report). Builds the model from its config only (random weights)."""
    import torch
    import transformers
    from transformers import AutoConfig

    from .converter import find_norms

    config = AutoConfig.from_pretrained(args.model_name_or_path)
    auto_class = getattr(transformers, TASKS[args.task].auto_class)
    if type(config) not in auto_class._model_mapping:
        fitting = [name for name, task in TASKS.items()
                   if type(config) in getattr(transformers, task.auto_class)._model_mapping]
        raise ValueError(f"--task {args.task} does not fit --model_name_or_path {args.model_name_or_path} "
                         f"(model_type {config.model_type!r} has no {auto_class.__name__}); tasks that fit it: "
                         f"{fitting or 'none'}")
    with torch.device("cpu"):
        model = auto_class.from_config(config)
    norms = find_norms(model, config.get_text_config().hidden_size)
    if not norms:
        raise ValueError(f"--model_name_or_path {args.model_name_or_path} ({type(model).__name__}) has no norm that "
                         f"convert_norms knows (LayerNorm or RMSNorm layers): nothing to compare")
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    length = args.block_size if args.task == "causal-lm" else args.max_length
    if positions is not None and length > positions:
        option = "--block_size" if args.task == "causal-lm" else "--max_length"
        raise ValueError(f"{option} {length} exceeds the {positions} positions of --model_name_or_path "
                         f"{args.model_name_or_path}; lower {option}")
    counts: dict[str, int] = {}
    for name in norms:
        cls = type(model.get_submodule(name)).__name__
        counts[cls] = counts.get(cls, 0) + 1
    return counts


def embedded_model(folder: Path) -> str:
    """The embedded default's model: a tiny GPT-2 (seed 0) with a BPE of the embedded English
    corpus, saved once into `folder`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from .training.corpora import synthetic_lm_corpus
    from .training.tokenization import column_texts, train_bpe_tokenizer

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        tokenizer = train_bpe_tokenizer(column_texts(synthetic_lm_corpus()["train"]), vocab_size=500)
        config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **EMBEDDED_MODEL)
        GPT2LMHeadModel(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def load_model_tokenizer(path: str):
    """The model's own tokenizer; one without a padding token pads with its end (else unknown)
    token, which the masks and the -100 labels leave out of every loss and statistic."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ValueError(f"the tokenizer of {path} has no padding, end or unknown token to pad with")
        tokenizer.pad_token = fallback
    return tokenizer


def load_raw_data(args: argparse.Namespace):
    """The task's splits from `--dataset_name` or the data files (the embedded corpus without
    either), validation and test carved out of train when missing (seed 0: the same for every
    run), checked to hold the task's columns."""
    from .training.readers import (
        data_files_from_args,
        limit_splits,
        load_classification_dataset,
        load_lm_dataset,
        load_translation_dataset,
        split_train,
    )

    source = {"dataset_name": args.dataset_name, "dataset_config": args.dataset_config,
              "data_files": data_files_from_args(args.train_file, args.validation_file, args.test_file)}
    if args.task == "causal-lm":
        raw = load_lm_dataset(**source)
    elif args.task == "classification":
        raw = load_classification_dataset(**source, label_names=args.label_names.split(","))
        for split, part in raw.items():
            if "label" not in part.column_names:
                raise ValueError(f"--task classification needs {TASKS[args.task].needed_columns} columns; split "
                                 f"{split!r} has {part.column_names}")
    else:
        raw = load_translation_dataset(args.source_lang, args.target_lang, **source)
    raw = split_train(raw, seed=0)
    if "train" not in raw:
        raise ValueError(f"no train split; found {list(raw)} (pass --train_file, or a --dataset_name with one)")
    return limit_splits(raw, args.max_train_samples, args.max_eval_samples)


def tokenize_data(args: argparse.Namespace, raw, tokenizer):
    """The cached `Dataset.map` passes of the task: a second run over the same data reads them."""
    from .training.tokenization import lm_blocks, tokenize_classification, tokenize_lines, tokenize_translation

    options = {"num_proc": args.preprocessing_num_workers, "overwrite_cache": args.overwrite_cache}
    if args.task == "causal-lm":
        return lm_blocks(tokenize_lines(raw, tokenizer, **options), args.block_size, **options)
    if args.task == "classification":
        return tokenize_classification(raw, tokenizer, args.max_length, **options)
    return tokenize_translation(raw, tokenizer, args.source_lang, args.target_lang, args.max_length,
                                args.max_length, **options)


def load_model(args: argparse.Namespace, tokenizer, fields: dict[str, Any], num_processes: int):
    """The model of `--model_name_or_path`, its norms converted to `args.convert_norms` (with the
    `--powernorm_*` options), or as it is when that is None (the baseline)."""
    import transformers

    from .training.models import load_and_convert

    auto_class = getattr(transformers, TASKS[args.task].auto_class)
    if args.convert_norms is None:
        return auto_class.from_pretrained(args.model_name_or_path, **fields).train()
    return load_and_convert(args, auto_class, tokenizer, num_processes, **fields)


def _scorer(args: argparse.Namespace, accelerator, tokenizer, num_labels: int):
    """`score(model, loader) -> dict` of the task's evaluation."""
    from .training.evaluation import evaluate_accuracy, evaluate_bleu, evaluate_perplexity

    if args.task == "causal-lm":
        return lambda model, loader: evaluate_perplexity(accelerator, model, loader)
    if args.task == "classification":
        return lambda model, loader: evaluate_accuracy(accelerator, model, loader, num_labels)
    return lambda model, loader: evaluate_bleu(accelerator, model, loader, tokenizer, num_beams=args.num_beams,
                                               max_new_tokens=args.max_length)


def run_args(cell: Cell, folder: Path) -> argparse.Namespace:
    """One run's options: the comparison's (saved in its `compare.json`) with the cell's norm,
    seed and learning rate, training in `folder/run`."""
    saved = json.loads((folder.parents[1] / SETTINGS_NAME).read_text(encoding="utf-8"))["args"]
    norm = cell.options["norm"]
    return argparse.Namespace(**{**saved, "seed": cell.options["seed"], "learning_rate": cell.options["learning_rate"],
                                 "convert_norms": None if norm == BASELINE else norm,
                                 "output_dir": str(folder / "run"), "overwrite_output_dir": False})


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    """Fine-tune and score one (norm, seed, learning rate) of the comparison in `folder`."""
    from .training.batching import PaddingCollator
    from .training.evaluation import score_splits
    from .training.loop import fit, make_accelerator, prepare_eval_loaders
    from .training.losses import model_loss
    from .training.readers import label_names_of

    args = run_args(cell, folder)
    task = TASKS[args.task]
    if args.embedded_default:
        import torch

        torch.set_num_threads(1)  # a tiny model: several threads cost more than they bring
    accelerator = make_accelerator(args)
    tokenizer = load_model_tokenizer(args.model_name_or_path)
    with accelerator.main_process_first():
        raw = load_raw_data(args)
        data = tokenize_data(args, raw, tokenizer)
    fields = {}
    if args.task == "classification":
        labels = label_names_of(raw)
        fields = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
                  "label2id": {name: i for i, name in enumerate(labels)}}
    model = load_model(args, tokenizer, fields, accelerator.num_processes)
    collate = PaddingCollator(tokenizer.pad_token_id, decoder_attention_mask=args.task == "seq2seq")
    evals = prepare_eval_loaders(accelerator, data, collate, args.eval_batch_size)
    score = _scorer(args, accelerator, tokenizer, fields.get("num_labels", 0))
    columns = ("input_ids", "labels") if args.task == "seq2seq" else ("input_ids",)
    model, summary = fit(args, accelerator, model, data["train"], collate, model_loss, tokenizer=tokenizer,
                         mode=task.mode, validate=lambda m: score(m, evals["validation"])[task.metric],
                         length_columns=columns)
    scores = score_splits(lambda split, loader: score(model, loader), evals)
    for tracker in accelerator.trackers:  # not `end_training`: the next run needs the process group
        tracker.finish()
    if accelerator.is_main_process:  # the weights are not what a comparison keeps
        shutil.rmtree(Path(args.output_dir) / "best_model", ignore_errors=True)
    accelerator.wait_for_everyone()
    return {**summary, "scores": {k: v for k, v in scores.items() if isinstance(v, (int, float))}}


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------

def make_cells(args: argparse.Namespace, learning_rates: dict[str, list[float]], seeds: Sequence[int]) -> list[Cell]:
    """One cell per norm, learning rate of that norm and seed; the comparison's settings ride along
    so that a finished run of other settings is refused."""
    settings = settings_of(args)
    return [Cell(f"{norm}-lr{lr:g}-seed{seed}", {**settings, "norm": norm, "seed": seed, "learning_rate": lr},
                 paths=tuple(k for k in ("model_name_or_path", "train_file", "validation_file", "test_file")
                             if k in settings))
            for norm in args.norms for lr in learning_rates.get(norm, []) for seed in seeds]


def run_cells(cells: list[Cell], args: argparse.Namespace) -> list[dict[str, Any]]:
    """`run_grid` in one process (or `--jobs` processes); under `accelerate launch` every process
    runs every cell together, the main process clearing its folder and writing its result."""
    if _world_size() == 1:
        return run_grid(cells, run_cell, args.output_dir, jobs=args.jobs, desc="Comparison",
                        report_only=args.report_only)
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from tqdm.auto import tqdm

    from .training.checkpoints import write_json_atomically

    state = PartialState()
    todo = [] if args.report_only else [cell for cell in cells if cell_result(args.output_dir, cell) is None]
    state.wait_for_everyone()  # every process has read which cells are finished
    for cell in tqdm(todo, desc="Comparison", disable=not state.is_main_process):
        folder = Path(args.output_dir) / "cells" / cell.name
        if state.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)  # what a killed attempt left behind
            folder.mkdir(parents=True)
        state.wait_for_everyone()
        result = {"cell": cell.name, **cell.options, **run_cell(cell, folder)}
        if state.is_main_process:
            write_json_atomically(folder / RESULT_NAME, result)
        state.wait_for_everyone()
        AcceleratorState._reset_state()  # the next run builds its own Accelerator
    return [r for r in (cell_result(args.output_dir, cell) for cell in cells) if r is not None]


def choose_learning_rates(args: argparse.Namespace) -> dict[str, float]:
    """Each norm's learning rate: `--learning_rate`, or with `--tune_lr` the rate of `--lr_grid`
    whose run with the first seed scored best on validation."""
    if not args.tune_lr:
        return {norm: args.learning_rate for norm in args.norms}
    grid = {norm: list(args.lr_grid) for norm in args.norms}
    results = run_cells(make_cells(args, grid, args.seeds[:1]), args)
    task = TASKS[args.task]
    chosen = {}
    for norm in args.norms:
        scored = [(r["scores"][f"validation_{task.metric}"], r["learning_rate"]) for r in results if r["norm"] == norm]
        if not scored:  # --report_only before the grid finished
            continue
        pick = min if task.mode == "min" else max
        chosen[norm] = pick(scored, key=lambda pair: _finite(pair[0], task.mode))[1]
    return chosen


def _finite(value: float, mode: str) -> float:
    """A diverged run's score (NaN) ranks last."""
    return value if not math.isnan(value) else (math.inf if mode == "min" else -math.inf)


# ---------------------------------------------------------------------------------------------
# Outputs: results.csv, report.md, validation_curves.png
# ---------------------------------------------------------------------------------------------

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
                             "run": result["cell"]})
    return rows


def verdict(baseline: Sequence[float], other: Sequence[float], mode: str, names: tuple[str, str]) -> str:
    """`"<other> better"` / `"<baseline> better"` when the difference of the means exceeds the sum
    of the two sample standard deviations over the seeds, else `"tie"`; under two seeds a side,
    `"one seed: no verdict"`."""
    better = better_of(baseline, other, lower_is_better=mode == "min", min_seeds=2)
    if better is None:
        return "one seed: no verdict"
    if better == "tie":
        return "tie"
    return f"{names[1] if better == 'other' else names[0]} better"


def _short(norm: str) -> str:
    return SHORT_NAMES.get(norm, norm)


def _final(results: Sequence[dict[str, Any]], norm: str, chosen: dict[str, float]) -> list[dict[str, Any]]:
    return [r for r in results if r["norm"] == norm and r["learning_rate"] == chosen.get(norm)]


def report_text(results: Sequence[dict[str, Any]], chosen: dict[str, float], args: argparse.Namespace,
                norm_counts: dict[str, int]) -> str:
    """report.md: the table over seeds, the verdicts against the first norm, the rule and the settings."""
    task = TASKS[args.task]
    metric, better = task.metric, "lower" if task.mode == "min" else "higher"
    lines = [f"# Does PN help {_model_description(args)}?", "",
             f"Task `{args.task}`, {_data_description(args)}; the model's norms: "
             + ", ".join(f"{count} {name}" for name, count in norm_counts.items())
             + f" (`{BASELINE}`: unchanged). Each norm fine-tuned for {args.max_train_steps or 'all'} updates at "
               f"equal settings, scored by the model of its best validation; {metric}, {better} is better, "
               f"mean ± standard deviation over the seeds.", "",
             f"| norm | learning rate | seeds | validation {metric} | test {metric} | test per seed |",
             "|---|---:|---|---:|---:|---|"]
    for norm in args.norms:
        runs = _final(results, norm, chosen)
        if not runs:
            lines.append(f"| {norm} | - | - | - | - | - |")
            continue
        validated = [r["scores"].get(f"validation_{metric}") for r in runs]
        tested = [r["scores"].get(f"test_{metric}") for r in runs]
        lines.append(f"| {norm} | {chosen[norm]:g} | {', '.join(str(r['seed']) for r in runs)} | "
                     f"{mean_std(validated, 3)} | {mean_std(tested, 3)} | "
                     + ", ".join(f"{v:.3f}" for v in tested if v is not None) + " |")
    lines += ["", "## Verdict", "", f"| against {args.norms[0]} | difference of test means | seed spread | verdict |",
              "|---|---:|---:|---|"]
    base = _test_scores(results, args.norms[0], chosen, metric)
    for norm in args.norms[1:]:
        other = _test_scores(results, norm, chosen, metric)
        spread = (statistics.stdev(base) + statistics.stdev(other)) if min(len(base), len(other)) > 1 else math.nan
        difference = statistics.fmean(other) - statistics.fmean(base) if base and other else math.nan
        lines.append(f"| {norm} | {difference:+.3f} | {spread:.3f} | "
                     f"{verdict(base, other, task.mode, (_short(args.norms[0]), _short(norm)))} |")
    lines += ["", f"Rule: a norm is better than {args.norms[0]} only when the difference of the test means "
                  f"exceeds the seed spread, the sum of the two standard deviations over the seeds; otherwise "
                  f"it is a tie. With one seed there is no spread and no verdict.",
              "", "![validation curves](validation_curves.png)", "", "## Settings", "", "```json",
              json.dumps({k: v for k, v in settings_of(args).items() if v not in (None, False)}, indent=1), "```", ""]
    return "\n".join(lines)


def _test_scores(results: Sequence[dict[str, Any]], norm: str, chosen: dict[str, float], metric: str) -> list[float]:
    return [r["scores"][f"test_{metric}"] for r in _final(results, norm, chosen) if f"test_{metric}" in r["scores"]]


def _model_description(args: argparse.Namespace) -> str:
    return "a tiny GPT-2 (the embedded default)" if args.embedded_default else args.model_id


def _data_description(args: argparse.Namespace) -> str:
    if args.dataset_name:
        return f"data `{args.dataset_name}`" + (f" ({args.dataset_config})" if args.dataset_config else "")
    if args.train_file:
        return f"data `{args.train_file}`"
    return "the embedded toy corpus (no download)"


def validation_curve(folder: Path) -> dict[int, float]:
    """A run's validation score per update, from its `training_log.jsonl`."""
    from .training.run_log import read_run_log

    return {r["step"]: r["validation"] for r in read_run_log(folder) if "validation" in r}


def plot_curves(results: Sequence[dict[str, Any]], chosen: dict[str, float], args: argparse.Namespace,
                path: Path) -> None:
    """Validation score against updates per norm: the mean over seeds, the seeds' range as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    for norm in args.norms:
        curves = [validation_curve(Path(args.output_dir) / "cells" / r["cell"] / "run")
                  for r in _final(results, norm, chosen)]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not steps:
            continue
        values = [[c[s] for c in curves] for s in steps]
        line, = axis.plot(steps, [statistics.fmean(v) for v in values], label=f"{norm} ({len(curves)} seeds)")
        axis.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                          alpha=0.2)
    axis.set_xlabel("update")
    axis.set_ylabel(f"validation {TASKS[args.task].metric}")
    axis.set_title(f"{_model_description(args)}, {args.task}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(results: Sequence[dict[str, Any]], chosen: dict[str, float], args: argparse.Namespace,
                  norm_counts: dict[str, int]) -> str:
    """results.csv, report.md and validation_curves.png in `--output_dir`; returns the report."""
    output_dir = Path(args.output_dir)
    write_rows(result_rows(results, chosen), output_dir / "results.csv")
    text = report_text(results, chosen, args, norm_counts)
    (output_dir / "report.md").write_text(text, encoding="utf-8")
    plot_curves(results, chosen, args, output_dir / "validation_curves.png")
    return text


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> dict[str, int]:
    """Every check before training, on the main process first: the output folder, the model (the
    embedded default's built once), the data read and tokenized into the cache; `compare.json`
    written. Returns the model's norm classes and counts."""
    from .training.models import resolve_model_path

    check_output_folder(args)
    if args.model_name_or_path is None:
        args.model_name_or_path = embedded_model(Path(args.output_dir) / "model")
    else:
        args.model_name_or_path = resolve_model_path(args.model_name_or_path)
    norm_counts = check_model(args)
    if not args.report_only:
        tokenize_data(args, load_raw_data(args), load_model_tokenizer(args.model_name_or_path))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        saved = {"settings": settings_of(args), "args": vars(args)}
        (Path(args.output_dir) / SETTINGS_NAME).write_text(json.dumps(saved, indent=1), encoding="utf-8")
    return norm_counts


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run (or resume) the comparison and write its outputs; returns the rows of results.csv."""
    args = parse_args(argv)
    if _world_size() > 1:
        from accelerate import PartialState

        state = PartialState(cpu=args.cpu)
        with state.main_process_first():
            norm_counts = prepare(args) if state.is_main_process else None
        if not state.is_main_process:  # the folder and model the main process made
            args.model_name_or_path = json.loads((Path(args.output_dir) / SETTINGS_NAME).read_text())["args"][
                "model_name_or_path"]
            norm_counts = check_model(args)
        is_main = state.is_main_process
    else:
        norm_counts, is_main = prepare(args), True
    chosen = choose_learning_rates(args)
    results = run_cells(make_cells(args, {n: [lr] for n, lr in chosen.items()}, args.seeds), args)
    if args.tune_lr:  # the grid's other rates too, for results.csv
        grid = finished_results(make_cells(args, {n: list(args.lr_grid) for n in args.norms}, args.seeds[:1]),
                                args.output_dir)
        results = list({r["cell"]: r for r in [*grid, *results]}.values())
    if not results:
        raise FileNotFoundError(f"--report_only: no finished run under {args.output_dir}/cells")
    if is_main:
        print(write_outputs(results, chosen, args, norm_counts))
    return result_rows(results, chosen)


if __name__ == "__main__":
    from .cli import run_command

    run_command("compare", main, sys.argv[1:])
