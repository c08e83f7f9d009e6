"""Does Power Normalization help my model? One command that answers it on the user's model and data.

For each norm of `--norms` and each seed of `--seeds`, the model of `--model_name_or_path` (a Hub id
or a folder) has its norms converted by `convert_norms` (`layernorm`: the model's own norms,
unchanged, named by their class in the report; a model loaded from weights is converted keeping its
function unless `--no_preserve_function`; `--convert_modules` selects the norms), is fine-tuned by
the training library's `fit` at equal settings (with `--tune_lr`, each norm's learning rate is
chosen on validation from `--lr_grid`, with the first seed), and is scored on validation before
and after fine-tuning and on test. The runs form a resumable grid (`training/grid.py`): a finished
run is not redone unless its fingerprint (model, tokenizer and data files, settings) changed,
`--jobs N` runs N at once on CPU, and under `accelerate launch` every run uses all the processes.
Writes into `--output_dir`:

- `results.csv`: one row per run and evaluated split, with its time;
- `report.md`: mean ± standard deviation over the seeds per norm, the checks that withhold a
  verdict (degenerate or identical scores, a best model at the last update, no better than before
  fine-tuning), the verdict of each norm against the first from the paired test differences over
  the seeds (a 95% t interval, Holm over the comparisons), seq2seq sample outputs, the settings;
- `validation_curves.png`: training loss and validation score against updates (log axis for
  losses and perplexity), the mean over seeds with markers and the seeds' range as a band;
- with `--save_models`, `models/<norm>`: each norm's best model (and `--push_to_hub` uploads it).

Bad input stops with one line before any work; Ctrl-C writes the report of the runs finished so
far, and the same command resumes (with `--checkpoint_runs`, a run cut short goes on from its last
validation instead of starting again). Data comes as the recipes take it: `--dataset_name` (a Hub id, a
local folder of files or of `save_to_disk`) or `--train_file/--validation_file/--test_file`, with
`--text_column` etc. naming other columns, tokenized by cached `Dataset.map` passes. Without a
model and data, a tiny GPT-2 trains on the embedded English corpus (under two minutes on 2 CPU
cores).

    hf-powernorm compare --model_name_or_path gpt2 --task causal-lm --dataset_name wikitext \\
        --dataset_config_name wikitext-2-raw-v1 --norms layernorm powernorm --seeds 1 2 3 \\
        --max_train_steps 1000 --output_dir outputs/compare-gpt2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .normalization import NORM_CLASSES, normalize_norm_name
from .training.arguments import add_recipe_args, check_args, check_batch_budget
from .training.grid import RESULT_NAME, Cell, cell_result, finished_results, run_grid
from .training.readers import split_train
from .training.reports import mean_std, save_figure, write_rows
from .training.tasks import Task, get_task, task_names

SPLITS = ("validation", "test")
SETTINGS_NAME = "compare.json"
BASELINE = "layernorm"  # the model's own norms, unchanged
SHORT_NAMES = {"powernorm": "PN", "rmsnorm": "RMSNorm", "batchnorm": "BN"}
# Options that change where or how fast a comparison runs, or what it keeps, not what it measures.
RUNTIME_OPTIONS = ("output_dir", "overwrite_output_dir", "jobs", "seeds", "norms", "report_only",
                   "preprocessing_num_workers", "overwrite_cache", "eval_batch_size", "cpu", "with_tracking",
                   "report_to", "seed", "save_models", "push_to_hub", "hub_model_id", "hub_private_repo",
                   "checkpoint_runs")
# Recipe options that `compare` does not take: it sets them itself (the norms, one run per seed, the
# checkpoints of `--checkpoint_runs`), or they build a new model, which a comparison of the user's
# model never does.
NOT_TAKEN = ("convert_norms", "norm_type", "encoder_norm_type", "decoder_norm_type", "preset", "config_name",
             "config_overrides", "tokenizer_name", "vocab_size", "dropout", "resume_from_checkpoint",
             "checkpointing_steps", "checkpoints_total_limit", "do_train", "seed", "push_to_hub")
# Help for the recipe options that carry none.
HELP = {"train_file": "training data: .txt (causal-lm), .csv/.json/.jsonl (any task), .txt 'sentence@label' "
                      "(classification); validation and test are carved out of it (10%% each) when not given",
        "validation_file": "validation data, the format of --train_file (picks each run's best model)",
        "test_file": "test data, the format of --train_file (the verdict's scores)",
        "learning_rate": "peak learning rate of every norm (with --tune_lr: the middle of the default grid)",
        "max_tokens": "padded tokens per batch",
        "weight_decay": "AdamW weight decay (not on biases and norm weights)",
        "gradient_accumulation_steps": "batches per update",
        "num_train_epochs": "passes over the training data, unless --max_train_steps is given",
        "model_name_or_path": "the model to compare norms on: a folder or a Hub id (offline: from the cache); "
                              "default: a tiny GPT-2 on the embedded corpus",
        "eval_batch_size": "examples per evaluation batch",
        "eval_steps": "validate every N updates; default: --max_train_steps / 8 when it is given, else each epoch",
        "hub_model_id": "with --push_to_hub: ORG/NAME, each norm's kept model going to ORG/NAME-<norm>",
        "dataset_name": "a Hub dataset (needs network, or the datasets cache), a local folder of data files, "
                        "or a folder of Dataset.save_to_disk / DatasetDict.save_to_disk"}
# The tiny GPT-2 of the embedded default, and its budget when none is given.
EMBEDDED_MODEL = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 80}
EMBEDDED_BUDGET = {"max_train_steps": 60, "block_size": 64, "max_tokens": 256, "learning_rate": 2e-3}
MAX_SEED = 2**32 - 1
CONFIDENCE = 0.95  # of the paired interval a verdict is read from
EMBEDDED_TASK = "causal-lm"  # the task of the embedded default


def task_of(args: argparse.Namespace) -> Task:
    """The registry's task of `--task` over this comparison's options."""
    task = get_task(args.task)(args)
    task.write_predictions = False  # a comparison keeps scores, not outputs
    return task


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """A bad option is a ValueError: one line on stderr and exit status 2 (`cli.run_command`)."""

    def error(self, message: str):
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    """The recipes' options that a comparison takes (each with its help and default), and its own."""
    p = _Parser(prog="hf-powernorm compare", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_recipe_args(p, learning_rate=5e-4, num_warmup_steps=20, lr_scheduler_type="linear", num_train_epochs=3,
                    output_dir="outputs/compare", eval_batch_size=16)
    p.set_defaults(**_drop_options(p, (*NOT_TAKEN, "convert_modules", "preserve_function")))
    for action in p._actions:
        if action.dest in HELP:
            action.help = HELP[action.dest]
    _add_comparison_args(p.add_argument_group("comparison"))
    _add_data_column_args(p.add_argument_group("data columns (default: the names each task reads)"))
    _add_kept_model_args(p.add_argument_group("the models a comparison keeps"))
    return p


def _drop_options(parser: argparse.ArgumentParser, dests: Sequence[str]) -> dict[str, Any]:
    """Remove the options of `dests` from `parser` (absent ones are skipped); returns their defaults,
    which the runs' options still carry."""
    defaults = {}
    for action in [a for a in parser._actions if a.dest in dests]:
        defaults[action.dest] = action.default
        parser._remove_action(action)
        for option in action.option_strings:
            parser._option_string_actions.pop(option, None)
        for group in parser._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)
    return defaults


def _add_comparison_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--task", choices=task_names(), default=EMBEDDED_TASK,
                       help="what the model is fine-tuned and scored on; each task's columns: "
                            + "; ".join(f"{name}: {get_task(name).needed_columns}" for name in task_names()))
    group.add_argument("--norms", nargs="*", default=[BASELINE, "powernorm"],
                       help=f"norms to compare, the first the baseline of the verdict; '{BASELINE}' is the "
                            f"model's own norms, unchanged (named by their class in the report); valid: "
                            f"{sorted(NORM_CLASSES)}")
    group.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3],
                       help=f"one run per norm and seed (0 to {MAX_SEED}); the verdict needs at least two")
    group.add_argument("--tune_lr", action="store_true",
                       help="choose each norm's learning rate from --lr_grid on validation (first seed)")
    group.add_argument("--lr_grid", type=float, nargs="+",
                       help="learning rates tried with --tune_lr; default: --learning_rate x 1/3, 1, 3")
    group.add_argument("--jobs", type=int, default=1, help="runs at once on CPU, each in its own process")
    group.add_argument("--report_only", action="store_true",
                       help="write the outputs from the runs finished so far, and run nothing")
    group.add_argument("--block_size", type=int,
                       help="causal-lm: tokens per block; default: what the model's positions and tokenizer "
                            "allow, at most 1024 and --max_tokens")
    group.add_argument("--max_length", type=int,
                       help="classification and seq2seq: truncate sequences to this many tokens; default: 128, "
                            "or fewer if the model's positions or --max_tokens allow fewer")
    group.add_argument("--source_lang", default="de", help="seq2seq: the source language of 'translation'")
    group.add_argument("--target_lang", default="en", help="seq2seq: the target language of 'translation'")
    group.add_argument("--label_names",
                       help="classification: comma-separated class names, in the order of the model's label "
                            "ids; default: the model's id2label when the data's labels are among its names, "
                            "else the data's labels (sorted); the embedded corpus: its three classes")
    group.add_argument("--num_beams", type=int, default=1, help="seq2seq: beams when scoring BLEU")
    group.add_argument("--convert_modules", metavar="REGEX",
                       help="convert only the norms whose module name matches this regular expression "
                            "(re.search), e.g. 'encoder' or 'layers\\.([4-9]|1[0-9])\\.'; default: every norm "
                            "over the hidden size")
    group.add_argument("--no_preserve_function", action="store_true",
                       help="convert without keeping the pretrained model's function; by default a model "
                            "loaded from weights is converted with preserve_function, so that every norm "
                            "starts fine-tuning where the pretrained model is")


def _add_data_column_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--text_column", help="causal-lm and classification: the text column "
                                             "(default: 'text', else 'sentence')")
    group.add_argument("--label_column", help="classification: the label column (default: 'label')")
    group.add_argument("--source_column", help="seq2seq: a column of source texts (e.g. 'document'), with "
                                               "--target_column, instead of 'translation'")
    group.add_argument("--target_column", help="seq2seq: a column of target texts (e.g. 'summary')")


def _add_kept_model_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--checkpoint_runs", action="store_true",
                       help="checkpoint each run at each validation (see --eval_steps): a "
                            "comparison stopped mid-run then goes on from the run's last checkpoint, with the "
                            "scores of an unbroken run, instead of starting the run again; a run's checkpoint "
                            "(its optimizer state too) is removed when the run has finished")
    group.add_argument("--save_models", action="store_true",
                       help="keep each norm's best model (its best run over the seeds, by validation) in "
                            "output_dir/models/<norm>, loadable with load_converted; default: keep none")
    group.add_argument("--push_to_hub", action="store_true",
                       help="with --save_models: upload each kept model to <--hub_model_id>-<norm>")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked before any model or data is read."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_runs(args)
    args.embedded_default = args.model_name_or_path is None
    args.model_id = args.model_name_or_path  # as given: a Hub id is resolved to its local snapshot later
    task = task_of(args)
    if args.embedded_default and task.name != EMBEDDED_TASK:
        raise ValueError(f"--task {task.name} needs --model_name_or_path (a Hub id or a folder); only the embedded "
                         f"default (a tiny GPT-2, --task {EMBEDDED_TASK}) builds its own model")
    _check_columns(args, task)
    _fill_defaults(args, parser, task)
    # The recipes' checks hold --convert_modules to a --convert_norms, which compare sets per run.
    modules, args.convert_modules = args.convert_modules, None
    check_args(args, norm_options=())
    args.convert_modules = modules
    # A model loaded from weights starts where its pretraining left it: so should every norm.
    args.preserve_function = not (args.embedded_default or args.no_preserve_function)
    args.not_preserved = {}  # the norms it cannot keep the function with, and why (`check_preserving`)
    _check_text_files(args, task)
    check_batch_budget(args)
    return args


def _check_runs(args: argparse.Namespace) -> None:
    """The options that say which runs to make: norms, seeds, processes, kept models."""
    args.norms = check_norms(args.norms)
    if not args.seeds:
        raise ValueError("--seeds is empty: give at least one seed, e.g. --seeds 1 2 3")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds repeats a seed: {args.seeds}")
    outside = [seed for seed in args.seeds if not 0 <= seed <= MAX_SEED]
    if outside:
        raise ValueError(f"--seeds {outside[0]}: a seed must be between 0 and {MAX_SEED}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1; got {args.jobs}")
    if args.jobs > 1 and _world_size() > 1:
        raise ValueError("--jobs runs several CPU processes; under `accelerate launch` each run already uses "
                         "every process: leave --jobs at 1")
    if args.push_to_hub and not args.save_models:
        raise ValueError("--push_to_hub uploads the models that --save_models keeps: add --save_models")
    if args.push_to_hub and not args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id ORG/NAME (each norm's model goes to ORG/NAME-<norm>)")
    if args.convert_modules is not None:
        try:
            re.compile(args.convert_modules)
        except re.error as error:
            raise ValueError(f"--convert_modules {args.convert_modules!r} is not a regular expression ({error})") \
                from None


def _check_columns(args: argparse.Namespace, task: Task) -> None:
    """The column options fit the task: each for the tasks that read it, source and target together."""
    fitting: dict[str, list[str]] = {}
    for name in task_names():
        for option in get_task(name).column_options:
            fitting.setdefault(option, []).append(name)
    for name, tasks in fitting.items():
        if getattr(args, name) is not None and name not in task.column_options:
            raise ValueError(f"--{name} is for --task {' or '.join(tasks)}, not {task.name}")
    if (args.source_column is None) != (args.target_column is None):
        raise ValueError("--source_column and --target_column go together: give both, or neither to read the "
                         "'translation' column")
    named = [getattr(args, name) for name in fitting if getattr(args, name) is not None]
    if named and args.embedded_default:
        raise ValueError("the column options name columns of your data: give it with --train_file or "
                         "--dataset_name")
    if named and args.train_file is None and args.dataset_name is None:
        raise ValueError("the column options need data: give --train_file or --dataset_name")


def _check_text_files(args: argparse.Namespace, task: Task) -> None:
    """A data file that is not text (a NUL byte in its first 8 KiB) is refused here, not deep in `datasets`."""
    for option in task.input_path_options:
        path = getattr(args, option, None)
        if path and Path(path).is_file():
            with open(path, "rb") as handle:
                if b"\0" in handle.read(8192):
                    raise ValueError(f"--{option} {path} is not a text file (it holds NUL bytes); give a .txt, "
                                     f".csv, .json or .jsonl file")


def _fill_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser, task: Task) -> None:
    """The embedded default's budget, the other tasks' options left out (neither shown in the
    settings nor checked), PN's warmup, the validation interval and the learning-rate grid."""
    if args.embedded_default:
        for name, value in EMBEDDED_BUDGET.items():
            if getattr(args, name) in (None, parser.get_default(name)):
                setattr(args, name, value)
    for name in {option for other in task_names() for option in get_task(other).own_options}:
        if name not in task.own_options:
            setattr(args, name, None)
    if task.decoder_batches and args.powernorm_warmup_steps is None:
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
    """What a comparison measures: every option but those of `RUNTIME_OPTIONS` and those it does not take."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in RUNTIME_OPTIONS and k not in NOT_TAKEN}


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
    inputs = [getattr(args, name, None) for name in ("model_name_or_path", *task_of(args).input_path_options,
                                                     "dataset_name")]
    inside = [path for path in inputs if path and Path(path).exists()
              and Path(path).resolve().is_relative_to(folder.resolve())]
    if inside:
        raise ValueError(f"--overwrite_output_dir would delete {inside}, inputs of this comparison inside "
                         f"--output_dir {folder}")
    if _world_size() == 1 or int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(folder)


def check_model(args: argparse.Namespace) -> dict[str, int]:
    """The model fits `--task` (a causal LM for `causal-lm`) and has norms that `convert_norms`
    knows; returns its norm classes and counts (for the report). Builds the model from its config
    only (random weights)."""
    from transformers import AutoConfig

    from .converter import find_norms

    task = task_of(args)
    config = AutoConfig.from_pretrained(args.model_name_or_path)
    auto_class = task.auto_model_class()
    if type(config) not in auto_class._model_mapping:
        fitting = [name for name in task_names() if type(config) in get_task(name).auto_model_class()._model_mapping]
        raise ValueError(f"--task {task.name} does not fit --model_name_or_path {args.model_name_or_path} "
                         f"(model_type {config.model_type!r} has no {auto_class.__name__}); tasks that fit it: "
                         f"{fitting or 'none'}")
    model = _model_from_config(args)
    task.check_pretrained(model, config)
    norms = find_norms(model, config.get_text_config().hidden_size)
    if not norms:
        raise ValueError(f"--model_name_or_path {args.model_name_or_path} ({type(model).__name__}) has no norm that "
                         f"convert_norms knows (LayerNorm or RMSNorm layers): nothing to compare")
    positions = _positions(config)
    option = f"--{task.length_option}"
    length = getattr(args, task.length_option)
    if positions is not None and length is not None and length > positions:
        raise ValueError(f"{option} {length} exceeds the {positions} positions of --model_name_or_path "
                         f"{args.model_name_or_path}; lower {option}")
    counts: dict[str, int] = {}
    for name in norms:
        cls = type(model.get_submodule(name)).__name__
        counts[cls] = counts.get(cls, 0) + 1
    return counts


def _model_from_config(args: argparse.Namespace):
    """The model of `--model_name_or_path` for `--task` with random weights, on CPU."""
    import torch
    from transformers import AutoConfig

    with torch.device("cpu"):
        return task_of(args).auto_model_class().from_config(AutoConfig.from_pretrained(args.model_name_or_path))


def check_preserving(args: argparse.Namespace) -> dict[str, str]:
    """With `preserve_function`, each converted norm of `--norms` tried on the model built from its
    config, with its runs' conversion options: returns the norms it cannot keep the function with
    and why (their runs convert without it, and the report says so). Nothing is tried without."""
    from .converter import convert_norms
    from .training.models import converter_options

    if not args.preserve_function:
        return {}
    refused = {}
    for norm in args.norms:
        if norm == BASELINE:
            continue
        trial = argparse.Namespace(**{**vars(args), "convert_norms": norm})
        try:
            convert_norms(_model_from_config(args), norm, modules=args.convert_modules, preserve_function=True,
                          **converter_options(trial, 1))
        except (ValueError, TypeError) as error:  # a target, source or option it cannot keep the function with
            refused[norm] = " ".join(str(error).split())
    return refused


def _positions(config) -> int | None:
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def fit_lengths(args: argparse.Namespace, tokenizer) -> None:
    """The task's length option (`--block_size` for causal-lm, else `--max_length`) when not given:
    what the model's positions and the tokenizer allow (as Transformers' `run_clm` does), at most the
    task's cap (1024 tokens a block, 128 a sequence), and `--max_tokens`."""
    from transformers import AutoConfig

    limits = [_positions(AutoConfig.from_pretrained(args.model_name_or_path)),
              tokenizer.model_max_length if tokenizer.model_max_length < 1e6 else None]
    allowed = min((limit for limit in limits if limit), default=None)
    task = task_of(args)
    if getattr(args, task.length_option) is None:
        setattr(args, task.length_option, min(allowed or task.length_cap, task.length_cap, args.max_tokens))


def baseline_name(norm_counts: dict[str, int]) -> str:
    """The baseline as the report names it: the model's own norm classes."""
    return f"{' + '.join(norm_counts) or BASELINE} (the model's own)"


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

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"the tokenizer of --model_name_or_path {path} cannot be loaded: "
                         f"{str(error).strip().splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ValueError(f"the tokenizer of {path} has no padding, end or unknown token to pad with")
        tokenizer.pad_token = fallback
    return tokenizer


def load_raw_data(args: argparse.Namespace):
    """The task's splits from `--dataset_name` or the data files (the embedded corpus without
    either), validation and test carved out of train when missing (seed 0: the same for every
    run), checked to hold the task's columns. Data that cannot be read is a ValueError naming it."""
    with reading_data(args):
        raw = split_train(task_of(args).read_splits(seed=0), seed=0)
    if "train" not in raw:
        raise ValueError(f"no train split; found {list(raw)} (pass --train_file, or a --dataset_name with one)")
    from .training.readers import limit_splits

    return limit_splits(raw, args.max_train_samples, args.max_eval_samples)


@contextlib.contextmanager
def reading_data(args: argparse.Namespace) -> Iterator[None]:
    """Data that cannot be read (not text, an offline Hub id) as a ValueError naming it and why."""
    import datasets

    try:
        yield
    except (UnicodeDecodeError, datasets.exceptions.DatasetGenerationError, RuntimeError) as error:
        cause = error
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        # The readers' own message (e.g. an offline Hub id), else the error deep inside `datasets`.
        reason = str(error) if isinstance(error, RuntimeError) else f"{type(cause).__name__}: {cause}"
        raise ValueError(f"could not read the data {args.dataset_name or args.train_file}: {reason}") from None


def resolve_label_names(args: argparse.Namespace) -> None:
    """The options the task settles from the data before tokenizing (classification: the class
    names, matched to the model's `id2label`)."""
    with reading_data(args):
        task_of(args).resolve_labels()


def tokenize_data(args: argparse.Namespace, raw, tokenizer):
    """The cached `Dataset.map` passes of the task: a second run over the same data reads them."""
    return task_of(args).tokenize(raw, tokenizer)


def load_model(args: argparse.Namespace, tokenizer, fields: dict[str, Any], num_processes: int, calibration=None):
    """The model of `--model_name_or_path`, its norms converted to `args.convert_norms` (with the
    `--powernorm_*` options, `--convert_modules`, and `preserve_function` calibrated on
    `calibration`: the training split and its collator), or as it is when that is None (the baseline)."""
    from .training.models import load_and_convert

    auto_class = task_of(args).auto_model_class()
    if args.convert_norms is None:
        return auto_class.from_pretrained(args.model_name_or_path, **fields).train()
    return load_and_convert(args, auto_class, tokenizer, num_processes, calibration=calibration, **fields)


def run_args(cell: Cell, folder: Path) -> argparse.Namespace:
    """One run's options: the comparison's (saved in its `compare.json`) with the cell's norm,
    seed and learning rate, training in `folder/run`; with `--checkpoint_runs`, a checkpoint at
    each validation (the processes' statistics are averaged there anyway, so it changes no score),
    and the run goes on from the last one a stopped attempt left (`continue_or_clear`)."""
    saved = json.loads((folder.parents[1] / SETTINGS_NAME).read_text(encoding="utf-8"))["args"]
    norm = cell.options["norm"]
    checkpoints = {}
    if saved.get("checkpoint_runs"):
        checkpoints = {"checkpointing_steps": str(saved["eval_steps"]) if saved["eval_steps"] else "epoch",
                       "checkpoints_total_limit": 1,
                       "resume_from_checkpoint": "latest" if _resumable(folder) else None}
    return argparse.Namespace(**{**saved, "seed": cell.options["seed"], "learning_rate": cell.options["learning_rate"],
                                 "convert_norms": None if norm == BASELINE else norm,
                                 "preserve_function": saved["preserve_function"]
                                 and norm not in saved.get("not_preserved", {}),
                                 "output_dir": str(folder / "run"), "overwrite_output_dir": False,
                                 "push_to_hub": False, **checkpoints})


# What a run of `--checkpoint_runs` records when it starts: the comparison's fingerprint, so that a
# checkpoint is only gone on from with the inputs it was trained on.
STARTED_NAME = "started.json"


def _resumable(folder: Path) -> bool:
    """Whether `folder` holds a stopped attempt of its run that can go on: a complete checkpoint in
    `folder/run`, made with the comparison's current inputs."""
    from .training.checkpoints import latest_checkpoint

    started, run = folder / STARTED_NAME, folder / "run"
    if not started.is_file() or not run.is_dir() or latest_checkpoint(run, "step") is None:
        return False
    return json.loads(started.read_text(encoding="utf-8")) == _saved(folder)["fingerprint"]


def continue_or_clear(folder: Path, checkpoint_runs: bool) -> None:
    """Before a run in `folder` (on the main process): keep what a stopped attempt left where the
    run can go on from it (`--checkpoint_runs`), else clear it; then record the inputs it starts on."""
    from .training.checkpoints import write_json_atomically

    if not (checkpoint_runs and _resumable(folder)):
        shutil.rmtree(folder, ignore_errors=True)  # what a killed attempt left behind
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomically(folder / STARTED_NAME, _saved(folder)["fingerprint"])


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """One progress bar per run: no bars of Transformers' shard writing or of `datasets`' passes
    while the comparison runs; the caller's settings come back after it."""
    import datasets
    import transformers

    shown = transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown[0]:
            transformers.utils.logging.enable_progress_bar()
        if shown[1]:
            datasets.enable_progress_bars()


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    """Fine-tune and score one (norm, seed, learning rate) of the comparison in `folder`: the
    validation score right after conversion, the training, the scores of the best validated model,
    the time it took and, for seq2seq, three sample outputs. The libraries' progress bars are off
    while it runs, in `main`'s process or in a fresh one of `--jobs`."""
    with _quiet_libraries():
        return _run_cell(cell, folder)


def _run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    from .training.checkpoints import remove_checkpoints
    from .training.evaluation import score_splits
    from .training.loop import fit, make_accelerator, prepare_eval_loaders
    from .training.losses import model_loss

    started = time.perf_counter()
    if _world_size() == 1:  # under `accelerate launch`, `run_cells` has readied the folder
        continue_or_clear(folder, _saved(folder)["args"].get("checkpoint_runs", False))
    args = run_args(cell, folder)
    task = task_of(args)
    if args.embedded_default:
        import torch

        torch.set_num_threads(1)  # a tiny model: several threads cost more than they bring
    accelerator = make_accelerator(args, task.input_path_options)
    task.tokenizer = tokenizer = load_model_tokenizer(args.model_name_or_path)
    task.resolve_labels()
    with accelerator.main_process_first():
        raw = load_raw_data(args)
        data = task.tokenize(raw, tokenizer)
    collate = task.train_collate()
    model = load_model(args, tokenizer, task.pretrained_fields(), accelerator.num_processes,
                       calibration=(data["train"], collate))
    evals = prepare_eval_loaders(accelerator, data, collate, args.eval_batch_size)
    score = lambda m, split: task.evaluate(accelerator, m, evals[split], split)  # noqa: E731
    model.to(accelerator.device)
    start = score(model, "validation")  # right after conversion: the starting handicap
    start.setdefault("loss", validation_loss(accelerator, model, evals["validation"]))
    model, summary = fit(args, accelerator, model, data["train"], collate, model_loss, tokenizer=tokenizer,
                         mode=task.mode, validate=lambda m: score(m, "validation")[task.metric],
                         length_columns=task.length_columns)
    scores = score_splits(lambda split, loader: task.evaluate(accelerator, model, loader, split), evals)
    samples = task.samples(accelerator, model, raw, data, collate)
    for tracker in accelerator.trackers:  # not `end_training`: the next run needs the process group
        tracker.finish()
    if accelerator.is_main_process:
        if not args.save_models:  # the weights are not what a comparison keeps
            shutil.rmtree(Path(args.output_dir) / "best_model", ignore_errors=True)
        remove_checkpoints(args.output_dir)  # they served their end
    accelerator.wait_for_everyone()
    return {**summary, "scores": _numbers(scores), "start": _numbers(start), "samples": samples,
            "seconds": round(time.perf_counter() - started, 1), "fingerprint": _saved(folder)["fingerprint"]}


def validation_loss(accelerator, model, loader) -> float:
    """The model's own loss over `loader`, averaged over examples (every process's batches)."""
    import torch

    from .training.losses import model_loss

    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in loader:
            count = batch["input_ids"].shape[0]
            pair = torch.stack([model_loss(model, batch).double() * count,
                                torch.tensor(count, dtype=torch.float64, device=batch["input_ids"].device)])
            total += accelerator.gather_for_metrics(pair[None]).sum(0).cpu()
    model.train()
    return float(total[0] / total[1])


def _numbers(scores: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in scores.items() if isinstance(v, (int, float))}


def _saved(folder: Path) -> dict[str, Any]:
    return json.loads((folder.parents[1] / SETTINGS_NAME).read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------

def make_cells(args: argparse.Namespace, learning_rates: dict[str, list[float]], seeds: Sequence[int]) -> list[Cell]:
    """One cell per norm, learning rate of that norm and seed; the comparison's settings ride along
    so that a finished run of other settings is refused."""
    settings = settings_of(args)
    return [Cell(f"{norm}-lr{lr:g}-seed{seed}", {**settings, "norm": norm, "seed": seed, "learning_rate": lr},
                 paths=tuple(k for k in ("model_name_or_path", *task_of(args).input_path_options) if k in settings))
            for norm in args.norms for lr in learning_rates.get(norm, []) for seed in seeds]


def run_cells(cells: list[Cell], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The unfinished runs of `cells`, one after the other in this process (under `accelerate
    launch` every process runs every cell together, the main process clearing its folder and
    writing its result), or with `--jobs N` by `run_grid` in N processes at once. A finished run
    whose inputs changed since is run again, and what is left to run is said first; each run
    shows one progress bar, announced by a line."""
    if not args.report_only and (_world_size() == 1 or int(os.environ.get("RANK", "0")) == 0):
        redo_changed_runs(cells, args)
        finished = sum(cell_result(args.output_dir, cell) is not None for cell in cells)
        print(f"{finished} of {len(cells)} runs finished, {len(cells) - finished} to run", file=sys.stderr)
    if args.jobs > 1 or args.report_only:
        return run_grid(cells, run_cell, args.output_dir, jobs=args.jobs, desc="Comparison",
                        report_only=args.report_only, resume_cells=True)
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    from .training.checkpoints import write_json_atomically

    state = PartialState(cpu=args.cpu)
    state.wait_for_everyone()  # the main process has set aside the runs to redo
    todo = [cell for cell in cells if cell_result(args.output_dir, cell) is None]
    state.wait_for_everyone()  # every process has read which cells are finished
    for number, cell in enumerate(todo, start=1):
        folder = Path(args.output_dir) / "cells" / cell.name
        if state.is_main_process:
            print(f"run {number} of {len(todo)}: {cell.name}", file=sys.stderr)
            if _world_size() > 1:
                continue_or_clear(folder, args.checkpoint_runs)
        state.wait_for_everyone()
        result = {"cell": cell.name, **cell.options, **run_cell(cell, folder)}
        if state.is_main_process:
            write_json_atomically(folder / RESULT_NAME, result)
        state.wait_for_everyone()
        AcceleratorState._reset_state()  # the next run builds its own Accelerator
    return [r for r in (cell_result(args.output_dir, cell) for cell in cells) if r is not None]


def redo_changed_runs(cells: Sequence[Cell], args: argparse.Namespace) -> list[str]:
    """Set aside (as `result.changed.json`) the result of each finished run whose fingerprint differs
    from the inputs' now, saying which input changed; returns the names of those runs."""
    current = json.loads((Path(args.output_dir) / SETTINGS_NAME).read_text(encoding="utf-8"))["fingerprint"]
    redone = []
    for cell in cells:
        result = cell_result(args.output_dir, cell)
        if result is None:
            continue
        ran = result.get("fingerprint", {})
        changed = [part for part in current if ran.get(part) != current[part]]
        if changed:
            path = Path(args.output_dir) / "cells" / cell.name / RESULT_NAME
            path.replace(path.with_suffix(".changed.json"))
            print(f"{cell.name}: the {' and '.join(changed)} changed since it ran; running it again", file=sys.stderr)
            redone.append(cell.name)
    return redone


def choose_learning_rates(args: argparse.Namespace) -> dict[str, float]:
    """Each norm's learning rate: `--learning_rate`, or with `--tune_lr` the rate of `--lr_grid`
    whose run with the first seed scored best on validation."""
    if not args.tune_lr:
        return {norm: args.learning_rate for norm in args.norms}
    grid = {norm: list(args.lr_grid) for norm in args.norms}
    results = run_cells(make_cells(args, grid, args.seeds[:1]), args)
    task = task_of(args)
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
                             "seconds": result.get("seconds"), "run": result["cell"]})
    return rows


def paired_differences(base_runs: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]],
                       metric: str) -> list[float]:
    """Test score of each seed run by both minus the baseline's (other - baseline), in seed order."""
    base = {r["seed"]: r["scores"].get(f"test_{metric}") for r in base_runs}
    other = {r["seed"]: r["scores"].get(f"test_{metric}") for r in runs}
    return [other[seed] - base[seed] for seed in sorted(set(base) & set(other))
            if base[seed] is not None and other[seed] is not None]


def verdict(differences: Sequence[float], mode: str, names: tuple[str, str], adjusted_p: float | None = None,
            confidence: float = CONFIDENCE) -> str:
    """From the paired differences (other - baseline, one per seed): `"<other> better"` /
    `"<baseline> better"` when their t interval excludes zero and the Holm-adjusted p-value
    (`adjusted_p`, over every comparison made; the interval's own when None) is below
    1 - `confidence`; else `"tie"`; under two paired seeds `"one seed: no verdict"`."""
    from .training.statistics import paired_t_interval

    if len(differences) < 2:
        return "one seed: no verdict"
    interval = paired_t_interval(differences, confidence)
    p_value = interval.p_value if adjusted_p is None else adjusted_p
    if not interval.excludes_zero or p_value >= 1 - confidence:
        return "tie"
    other_lower = interval.high < 0
    return f"{names[1] if other_lower == (mode == 'min') else names[0]} better"


def run_flags(runs: Sequence[dict[str, Any]], metric: str, mode: str, vocab_size: int | None) -> list[str]:
    """What makes the runs of one norm unfit for a verdict: a degenerate score (BLEU 0, perplexity
    near the vocabulary size: nothing learned), a best model at the last update (still improving),
    a model no better than before fine-tuning."""
    flags = []
    tested = [r["scores"].get(f"test_{metric}") for r in runs]
    if metric == "bleu" and all(v == 0 for v in tested):
        flags.append("BLEU 0 in every run (check the tokenizer's decoding)")
    if metric == "perplexity" and vocab_size and any(v is not None and v > vocab_size / 2 for v in tested):
        flags.append(f"perplexity above half the vocabulary ({vocab_size}): barely trained")
    last = [r["seed"] for r in runs if r.get("best_step") is not None and r["best_step"] == r.get("train_steps")]
    if last:
        flags.append(f"best model at the last update (seed {', '.join(map(str, last))}): still improving, "
                     f"train longer")
    worse = [r["seed"] for r in runs if _no_better(r, metric, mode)]
    if worse:
        flags.append(f"no better than before fine-tuning (seed {', '.join(map(str, worse))})")
    return flags


def _no_better(run: dict[str, Any], metric: str, mode: str) -> bool:
    before, after = run.get("start", {}).get(metric), run["scores"].get(f"validation_{metric}")
    if before is None or after is None:
        return False
    return after >= before if mode == "min" else after <= before


def pair_flags(base: Sequence[float], other: Sequence[float]) -> list[str]:
    """What makes a comparison void whatever the runs: scores identical to the baseline's."""
    if base and sorted(base) == sorted(other):
        return ["test scores identical to the baseline's in every seed: the conversion changed nothing measurable"]
    return []


def _short(norm: str, baseline: str) -> str:
    return baseline.removesuffix(" (the model's own)") if norm == BASELINE else SHORT_NAMES.get(norm, norm)


def _final(results: Sequence[dict[str, Any]], norm: str, chosen: dict[str, float]) -> list[dict[str, Any]]:
    return [r for r in results if r["norm"] == norm and r["learning_rate"] == chosen.get(norm)]


def report_text(results: Sequence[dict[str, Any]], chosen: dict[str, float], args: argparse.Namespace,
                facts: dict[str, Any]) -> str:
    """report.md: the table over seeds, the checks, the verdicts against the first norm, the rule,
    seq2seq samples and the settings."""
    task = task_of(args)
    metric, better = task.metric, "lower" if task.mode == "min" else "higher"
    baseline = baseline_name(facts["norm_counts"])
    lines = [f"# Does PN help {_model_description(args)}?", "",
             f"Task `{task.name}`, {_data_description(args)}; the model's norms: "
             + ", ".join(f"{count} {name}" for name, count in facts["norm_counts"].items())
             + f" (`{BASELINE}` in `--norms`: these, unchanged). Each norm fine-tuned for "
               f"{args.max_train_steps or 'all'} updates at equal settings, scored by the model of its best "
               f"validation; {metric}, {better} is better, mean ± standard deviation over the seeds. "
             + _conversion_sentence(args), "",
             f"| norm | learning rate | seeds | validation loss before fine-tuning | validation {metric} before "
             f"fine-tuning | validation {metric} | test {metric} | test per seed | minutes per run |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for norm in args.norms:
        lines.append(_norm_row(norm, _final(results, norm, chosen), chosen, metric, baseline))
    lines += _verdict_lines(results, chosen, args, facts, baseline)
    lines += ["", "![training loss and validation curves](validation_curves.png)"]
    lines += _sample_lines(results, chosen, args, baseline)
    lines += ["", "## Settings", "", "```json",
              json.dumps({k: v for k, v in settings_of(args).items() if v not in (None, False)}, indent=1), "```", ""]
    return "\n".join(lines)


def _conversion_sentence(args: argparse.Namespace) -> str:
    if not args.preserve_function:
        return "Converted without preserve_function (a randomly initialised model, or --no_preserve_function)."
    refused = getattr(args, "not_preserved", {})
    return "Converted keeping the pretrained function (preserve_function)" + (
        "; without it for " + "; ".join(f"{norm} ({why})" for norm, why in refused.items()) if refused else "") + "."


def _norm_row(norm: str, runs: list[dict[str, Any]], chosen: dict[str, float], metric: str, baseline: str) -> str:
    name = baseline if norm == BASELINE else norm
    if not runs:
        return f"| {name} | - | - | - | - | - | - | - | - |"
    loss = [r.get("start", {}).get("loss") for r in runs]
    start = [r.get("start", {}).get(metric) for r in runs]
    validated = [r["scores"].get(f"validation_{metric}") for r in runs]
    tested = [r["scores"].get(f"test_{metric}") for r in runs]
    minutes = [r["seconds"] / 60 for r in runs if r.get("seconds") is not None]
    per_seed = ", ".join(f"{v:.3f}" for v in tested if v is not None)
    return (f"| {name} | {chosen[norm]:g} | {', '.join(str(r['seed']) for r in runs)} | {mean_std(loss, 3)} | "
            f"{mean_std(start, 3)} | "
            f"{mean_std(validated, 3)} | {mean_std(tested, 3)} | {per_seed} | "
            f"{f'{statistics.fmean(minutes):.1f}' if minutes else '-'} |")


def _verdict_lines(results, chosen, args: argparse.Namespace, facts: dict[str, Any], baseline: str) -> list[str]:
    """The verdict of each norm against the first from the paired test differences over the seeds
    (a 95% t interval, Holm over the comparisons made), none where a check fails; then the checks."""
    from .training.statistics import holm, paired_t_interval

    task, first = task_of(args), _short(args.norms[0], baseline)
    base_runs = _final(results, args.norms[0], chosen)
    pairs = {norm: paired_differences(base_runs, _final(results, norm, chosen), task.metric) for norm in args.norms[1:]}
    intervals = {norm: paired_t_interval(d, CONFIDENCE) for norm, d in pairs.items() if len(d) > 1}
    adjusted = dict(zip(intervals, holm([i.p_value for i in intervals.values()]))) if intervals else {}
    lines = ["", "## Verdict", "", f"| against {first} | seeds paired | mean difference (norm - {first}) | "
             f"95% interval | Holm p | verdict |", "|---|---:|---:|---|---:|---|"]
    checks = []
    for norm, differences in pairs.items():
        names = (first, _short(norm, baseline))
        flags = _comparison_flags(base_runs, _final(results, norm, chosen), args, facts, names)
        said = verdict(differences, task.mode, names, adjusted.get(norm))
        if flags and "no verdict" not in said:
            said = "flagged: no verdict"
        interval = intervals.get(norm)
        shown = (f"{interval.mean:+.3f} | [{interval.low:+.3f}, {interval.high:+.3f}] | {adjusted[norm]:.3f}"
                 if interval else f"{statistics.fmean(differences) if differences else math.nan:+.3f} | - | -")
        lines.append(f"| {norm} | {len(differences)} | {shown} | {said} |")
        checks += [f"- {norm}: {flag}" for flag in flags]
    lines += ["", f"Rule: each seed's test {task.metric} of a norm minus {first}'s at the same seed; a norm is "
                  f"better or worse than {first} only when the 95% t interval of these differences excludes zero "
                  f"and the p-value, Holm-adjusted over the {len(intervals)} comparison(s) with an interval, is below "
                  f"0.05; otherwise it is a tie. Under two paired seeds there is no interval and no verdict, and a comparison whose "
                  f"runs fail a check below gets none."]
    return lines + ["", "## Checks", ""] + (checks or ["Every check passed: no degenerate or identical scores, "
                                                       "every best model before the last update, every model "
                                                       "better than before fine-tuning."])


def _comparison_flags(base_runs, runs, args: argparse.Namespace, facts: dict[str, Any],
                      names: tuple[str, str]) -> list[str]:
    task, vocab_size = task_of(args), facts.get("vocab_size")
    return [*(f"{names[0]}: {f}" for f in run_flags(base_runs, task.metric, task.mode, vocab_size)),
            *(f"{names[1]}: {f}" for f in run_flags(runs, task.metric, task.mode, vocab_size)),
            *pair_flags(_test_scores(base_runs, task.metric), _test_scores(runs, task.metric))]


def _sample_lines(results, chosen, args: argparse.Namespace, baseline: str) -> list[str]:
    if not any(r.get("samples") for r in results):
        return []
    lines = ["", "## Sample outputs (first seed, first three validation examples)"]
    for norm in args.norms:
        runs = _final(results, norm, chosen)
        if runs and runs[0].get("samples"):
            lines += ["", f"### {baseline if norm == BASELINE else norm}", ""]
            lines += [f"- source: {s['source']!r}\n  reference: {s['reference']!r}\n  output: {s['output']!r}"
                      for s in runs[0]["samples"]]
    return lines


def _test_scores(runs: Sequence[dict[str, Any]], metric: str) -> list[float]:
    return [r["scores"][f"test_{metric}"] for r in runs if f"test_{metric}" in r["scores"]]


def _model_description(args: argparse.Namespace) -> str:
    return "a tiny GPT-2 (the embedded default)" if args.embedded_default else args.model_id


def _data_description(args: argparse.Namespace) -> str:
    if args.dataset_name:
        return f"data `{args.dataset_name}`" + (f" ({args.dataset_config})" if args.dataset_config else "")
    if args.train_file:
        return f"data `{args.train_file}`"
    return "the embedded toy corpus (no download)"


def run_curves(folder: Path) -> tuple[dict[int, float], dict[int, float]]:
    """A run's training loss and validation score per update, from its `training_log.jsonl`."""
    from .training.run_log import read_run_log

    records = read_run_log(folder)
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["validation"] for r in records if "validation" in r})


def validation_curve(folder: Path) -> dict[int, float]:
    """A run's validation score per update, from its `training_log.jsonl`."""
    return run_curves(folder)[1]


def plot_curves(results: Sequence[dict[str, Any]], chosen: dict[str, float], args: argparse.Namespace,
                path: Path, baseline: str) -> None:
    """Training loss and validation score against updates per norm, side by side: the mean over
    seeds with markers, the seeds' range as a band; perplexity and loss on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4.0))
    for norm in args.norms:
        folders = [Path(args.output_dir) / "cells" / r["cell"] / "run" for r in _final(results, norm, chosen)]
        curves = [run_curves(folder) for folder in folders]
        label = baseline if norm == BASELINE else norm
        for axis, index in zip(axes, (0, 1)):
            _plot_mean_and_band(axis, [c[index] for c in curves], f"{label} ({len(curves)} seeds)")
    task = task_of(args)
    metric = task.metric
    for axis, name in zip(axes, ("training loss", f"validation {metric}")):
        axis.set_xlabel("update")
        axis.set_ylabel(name)
        if name == "training loss" or metric == "perplexity":
            axis.set_yscale("log")
        if axis.has_data():
            axis.legend(fontsize="small")
    figure.suptitle(f"{_model_description(args)}, {task.name}")
    save_figure(figure, path, dpi=120)


def _plot_mean_and_band(axis, curves: list[dict[int, float]], label: str) -> None:
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if not steps:
        return
    values = [[c[s] for c in curves] for s in steps]
    line, = axis.plot(steps, [statistics.fmean(v) for v in values], marker="o", markersize=3, label=label)
    axis.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.2)


def write_outputs(results: Sequence[dict[str, Any]], chosen: dict[str, float], args: argparse.Namespace,
                  facts: dict[str, Any]) -> str:
    """results.csv, report.md and validation_curves.png in `--output_dir`; returns the report."""
    output_dir = Path(args.output_dir)
    write_rows(result_rows(results, chosen), output_dir / "results.csv")
    text = report_text(results, chosen, args, facts)
    (output_dir / "report.md").write_text(text, encoding="utf-8")
    plot_curves(results, chosen, args, output_dir / "validation_curves.png", baseline_name(facts["norm_counts"]))
    return text


# ---------------------------------------------------------------------------------------------
# The models a comparison keeps
# ---------------------------------------------------------------------------------------------

def keep_best_models(results: Sequence[dict[str, Any]], chosen: dict[str, float],
                     args: argparse.Namespace) -> dict[str, Path]:
    """`--save_models`: each norm's best run over the seeds (by its best validation score) copied
    with the tokenizer into `output_dir/models/<norm>`; returns the folders."""
    mode = task_of(args).mode
    kept = {}
    for norm in args.norms:
        runs = [r for r in _final(results, norm, chosen) if r.get("best_validation") is not None]
        folders = {r["cell"]: Path(args.output_dir) / "cells" / r["cell"] / "run" / "best_model" for r in runs}
        runs = [r for r in runs if folders[r["cell"]].is_dir()]
        if not runs:
            continue
        pick = min if mode == "min" else max
        best = pick(runs, key=lambda r: _finite(r["best_validation"], mode))
        target = Path(args.output_dir) / "models" / norm
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folders[best["cell"]], target)
        load_model_tokenizer(args.model_name_or_path).save_pretrained(target)
        (target / "comparison_run.json").write_text(json.dumps({k: best[k] for k in (
            "cell", "norm", "seed", "learning_rate", "best_step", "best_validation", "scores")}, indent=1))
        kept[norm] = target
    return kept


def push_models(kept: dict[str, Path], args: argparse.Namespace) -> list[str]:
    """`--push_to_hub`: each kept model uploaded to `<--hub_model_id>-<norm>`; returns the repositories."""
    from huggingface_hub import HfApi

    api, repos = HfApi(), []
    for norm, folder in kept.items():
        repo = api.create_repo(f"{args.hub_model_id}-{norm}", private=args.hub_private_repo, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo, folder_path=str(folder),
                          commit_message=f"hf-powernorm compare: the best {norm} model")
        repos.append(repo)
    return repos


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

MODEL_FILES_BY_CONTENT = 1 << 20  # files up to 1 MiB (config, tokenizer) are hashed; larger by size and time
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")


def fingerprint(args: argparse.Namespace) -> dict[str, str]:
    """What a run's result depends on beyond its options, hashed per input: the model's files
    (config contents, weight files' sizes and modification times), the tokenizer's files, the data
    files (a local dataset folder's too) and the settings. A run whose fingerprint differs from the
    inputs' now is run again."""
    import hashlib

    model = Path(args.model_name_or_path)
    files = sorted(p for p in model.iterdir() if p.is_file() and not p.name.startswith("."))
    data = [Path(getattr(args, k)) for k in task_of(args).input_path_options if getattr(args, k, None)]
    if args.dataset_name and Path(args.dataset_name).is_dir():
        data += sorted(p for p in Path(args.dataset_name).rglob("*") if p.is_file())
    settings = json.dumps({k: v for k, v in settings_of(args).items() if k != "model_name_or_path"}, sort_keys=True)
    return {"model": _digest([p for p in files if p.name not in TOKENIZER_FILES]),
            "tokenizer": _digest([p for p in files if p.name in TOKENIZER_FILES]),
            "data": _digest(data) + (f":{args.dataset_name}:{args.dataset_config}" if args.dataset_name else ""),
            "settings": hashlib.sha256(settings.encode()).hexdigest()[:16]}


def _digest(paths: Sequence[Path]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0".encode())
        if stat.st_size <= MODEL_FILES_BY_CONTENT:
            digest.update(path.read_bytes())
        else:
            digest.update(str(stat.st_mtime_ns).encode())
    return digest.hexdigest()[:16]


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Every check before training, on the main process first: the model (the embedded default's
    built once) and the lengths it allows, the class names, the output folder, the data read and
    tokenized into the cache; `compare.json` written with the inputs' fingerprint. Returns the
    model's norm classes and counts, and its vocabulary size."""
    from .training.models import resolve_model_path

    if args.model_name_or_path is not None:
        args.model_name_or_path = resolve_model_path(args.model_name_or_path)
        facts = model_facts(args)
        args.not_preserved = check_preserving(args)
        fit_lengths(args, load_model_tokenizer(args.model_name_or_path))
        check_batch_budget(args)
        resolve_label_names(args)
    check_output_folder(args)
    if args.model_name_or_path is None:
        args.model_name_or_path = embedded_model(Path(args.output_dir) / "model")
        facts = model_facts(args)
        resolve_label_names(args)
    if not args.report_only:
        tokenize_data(args, load_raw_data(args), load_model_tokenizer(args.model_name_or_path))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        saved = {"settings": settings_of(args), "args": vars(args), "fingerprint": fingerprint(args), "model": facts}
        (Path(args.output_dir) / SETTINGS_NAME).write_text(json.dumps(saved, indent=1), encoding="utf-8")
    return facts


def model_facts(args: argparse.Namespace) -> dict[str, Any]:
    """What the report says of the model: its norm classes and counts, its vocabulary size."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model_name_or_path).get_text_config()
    return {"norm_counts": check_model(args), "vocab_size": getattr(config, "vocab_size", None)}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run (or resume) the comparison and write its outputs; returns the rows of results.csv.
    Interrupted (Ctrl-C), it writes the report of the runs finished so far and raises
    KeyboardInterrupt with a line that says so; the same command resumes."""
    args = parse_args(argv)
    with _quiet_libraries():
        return _main(args)


def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`main` once the arguments are read, with the libraries' progress bars off."""
    if _world_size() > 1:
        from accelerate import PartialState

        state = PartialState(cpu=args.cpu)
        with state.main_process_first():
            facts = prepare(args) if state.is_main_process else None
        if not state.is_main_process:  # the folder and model the main process made
            saved = json.loads((Path(args.output_dir) / SETTINGS_NAME).read_text())
            vars(args).update(saved["args"])
            facts = saved["model"]
        is_main = state.is_main_process
    else:
        facts, is_main = prepare(args), True
    try:
        chosen, results = _run(args)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupted(args, facts) if is_main else "") from None
    if is_main:
        print(write_outputs(results, chosen, args, facts))
        if args.save_models:
            kept = keep_best_models(results, chosen, args)
            print(f"kept models: {', '.join(str(folder) for folder in kept.values())}", file=sys.stderr)
            if args.push_to_hub:
                print(f"pushed to the Hub: {', '.join(push_models(kept, args))}", file=sys.stderr)
    return result_rows(results, chosen)


def _run(args: argparse.Namespace) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Each norm's learning rate, then its runs over the seeds (the tuning grid's results too)."""
    chosen = choose_learning_rates(args)
    results = run_cells(make_cells(args, {n: [lr] for n, lr in chosen.items()}, args.seeds), args)
    if args.tune_lr:  # the grid's other rates too, for results.csv
        grid = finished_results(make_cells(args, {n: list(args.lr_grid) for n in args.norms}, args.seeds[:1]),
                                args.output_dir)
        results = list({r["cell"]: r for r in [*grid, *results]}.values())
    if not results:
        raise FileNotFoundError(f"--report_only: no finished run under {args.output_dir}/cells")
    return chosen, results


def _interrupted(args: argparse.Namespace, facts: dict[str, Any]) -> str:
    """The report of the runs finished so far, and the line that says where it is (on a line of its
    own: the interrupted progress bars are closed first)."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    args.report_only = True
    try:
        chosen, results = _run(args)
    except FileNotFoundError:
        return "no run had finished; rerun the same command to start again"
    write_outputs(results, chosen, args, facts)
    return (f"{len(results)} runs had finished: their report is in {Path(args.output_dir) / 'report.md'}; "
            f"rerun the same command to resume")


if __name__ == "__main__":
    from .cli import run_command

    run_command("compare", main, sys.argv[1:])
