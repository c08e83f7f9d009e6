"""The command line every recipe shares (its options declared in `options.RecipeOptions`, with the
names of Transformers' `*_no_trainer.py` examples where they mean the same thing) and the checks that
run before any data is read: `check_args` fails on bad values, naming them, with a `BadInput`.
"""

from __future__ import annotations

import argparse
import glob
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import huggingface_hub
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType

from ..configuration_powernorm import NORM_SITES, PRESETS
from ..normalization import NORM_CLASSES, normalize_norm_name
from .checks import check_dropout, check_learning_rate, check_weight_decay
from .options import NOT_GIVEN, RECIPE_GROUPS, BadInput, MissingInput, RecipeOptions, add_options

# The config fields the registry's norms take their options from: each class's `config_options`, its
# per-site `site_options` at every site of `NORM_SITES`, and the embedding scale of the norms with
# `learnable_embed_scale`. A flag of the same name sets each, but `powernorm_sync_stats`: `--sync_stats`
# decides it with the number of processes.
_SITE_FIELD_PREFIXES = tuple(dict.fromkeys(prefix for cls in NORM_CLASSES.values()
                                           for prefix in cls.site_options.values()))
ELEMENTWISE_NORM_OPTIONS = tuple(f"{prefix}_{site}" for prefix in _SITE_FIELD_PREFIXES for site in NORM_SITES) + (
    ("embed_scale_learnable",) if any(cls.learnable_embed_scale for cls in NORM_CLASSES.values()) else ())
# The norm options a recipe passes to the config when given (the preset's otherwise).
PN_OPTIONS = tuple(field for field in dict.fromkeys(field for cls in NORM_CLASSES.values()
                                                    for field in cls.config_options.values())
                   if field != "powernorm_sync_stats") + ELEMENTWISE_NORM_OPTIONS
# Options that count updates on the command line and training forward passes in the config.
PN_UPDATE_COUNTS = ("powernorm_warmup_steps", "powernorm_warmup_ramp_steps")
NORM_OPTIONS = ("norm_type", "encoder_norm_type", "decoder_norm_type")
# The options naming data files that every task reads; a task adds its own (`Task.input_path_options`).
DATA_FILE_OPTIONS = ("train_file", "validation_file", "test_file")
# The options naming the local files of a model, whatever the task.
MODEL_PATH_OPTIONS = ("tokenizer_name", "config_name")


class RecipeParser(argparse.ArgumentParser):
    """A recipe's command line: a malformed option is a `BadInput`, which the script reports in one
    line with exit status 2 (`tasks.run_script`), as every other bad input."""

    def error(self, message: str):
        raise BadInput(message)


def add_recipe_args(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """The arguments every recipe shares (`options.RecipeOptions`); `defaults` are the script's own
    defaults. The parsed options also hold those the library reads that the command does not take
    (`options.NOT_GIVEN`, set before a task declares its own)."""
    add_options(parser, RecipeOptions, RECIPE_GROUPS)
    parser.set_defaults(**NOT_GIVEN, **defaults)
    return parser


def check_args(args: argparse.Namespace, norm_options: Iterable[str] = NORM_OPTIONS,
               path_options: Iterable[str] = DATA_FILE_OPTIONS) -> None:
    """Fail before any data is read: unknown preset or norm, missing or empty file (of
    `path_options`, the task's data files, and the model's), bad counts, options that contradict
    `--model_name_or_path`."""
    if args.preset is not None and args.preset not in PRESETS:
        raise BadInput(f"--preset {args.preset!r} is unknown; valid presets: {sorted(PRESETS)}")
    values = vars(args)  # the options by name
    for option in norm_options:
        if values[option] is not None:
            try:
                values[option] = normalize_norm_name(values[option])
            except ValueError as error:
                raise BadInput(f"--{option}: {error}") from None
    _check_paths(args, path_options)
    _check_counts(args)
    _check_rates(args)
    _check_model_source(args, norm_options)
    if args.with_tracking:
        args.report_to = _check_trackers(args.report_to)
    if args.push_to_hub:
        _check_hub_access()


def _check_paths(args: argparse.Namespace, path_options: Iterable[str]) -> None:
    for option in (*path_options, *MODEL_PATH_OPTIONS):
        path = vars(args)[option]
        if path and not _data_path_exists(Path(path)):
            raise MissingInput(f"--{option} {path}: not found")
        # `datasets` fails on an empty file with a generic generation error: name the split here.
        if path and option != "config_name" and Path(path).is_file() and not _has_rows(Path(path)):
            split = option.removesuffix("_file") if option in DATA_FILE_OPTIONS else "train"
            raise BadInput(f"split {split!r} is empty: --{option} {path} has no data")


def _check_counts(args: argparse.Namespace) -> None:
    values = vars(args)  # the options by name
    if args.checkpointing_steps not in (None, "epoch") and not (
            args.checkpointing_steps.isdigit() and int(args.checkpointing_steps) > 0):
        raise BadInput(f"--checkpointing_steps must be a positive integer or 'epoch'; "
                       f"got {args.checkpointing_steps!r}")
    for option in ("gradient_accumulation_steps", "max_tokens", "eval_batch_size", "eval_steps", "patience",
                   "max_eval_samples", "max_train_samples", "max_train_steps", "num_train_epochs",
                   "num_warmup_steps", "per_device_train_batch_size", "preprocessing_num_workers",
                   "checkpoints_total_limit"):
        value = values[option]
        if value is not None and value < 1:
            raise BadInput(f"--{option} must be at least 1; got {value}")
    for option in ("record_norm_stats", "powernorm_warmup_ramp_steps"):
        value = values[option]
        if value is not None and value < 0:
            raise BadInput(f"--{option} must be at least 0; got {value}")
    for option in ELEMENTWISE_NORM_OPTIONS[:-1]:
        value = values[option]
        if value is not None and not (math.isfinite(value) and value > 0):
            raise BadInput(f"--{option} must be a finite positive number; got {value}")


def _check_rates(args: argparse.Namespace) -> None:
    """The optimizer's and the model's rates, by the rules of `checks.py` (the recipe's value when
    the option was not given: a default is checked too)."""
    check_learning_rate(args.learning_rate)
    check_weight_decay(args.weight_decay)
    if args.dropout is not None:
        check_dropout(args.dropout)
    for option, value in (("warmup_init_lr", args.warmup_init_lr), ("clip_norm", args.clip_norm)):
        if not (math.isfinite(value) and value >= 0):
            raise BadInput(f"--{option} {value}: expected a finite number >= 0")


def check_batch_budget(args: argparse.Namespace) -> None:
    """Token-budget batches must hold the longest example the maximum lengths allow: `--max_tokens`
    at least `--max_source_length` / `--max_target_length` (else `--max_length`) and `--block_size`,
    checked before any data is read."""
    if not args.do_train or args.per_device_train_batch_size is not None:
        return
    names = ("max_source_length", "max_target_length") if args.max_source_length is not None else ("max_length",)
    for name in (*names, "block_size"):
        value = vars(args)[name]
        if value is not None and value > args.max_tokens:
            raise BadInput(f"--max_tokens {args.max_tokens} is less than --{name} {value}: a batch must hold "
                           f"the longest example; raise --max_tokens or lower --{name}")


def _check_conversion_options(args: argparse.Namespace) -> None:
    """`--convert_modules`, `--preserve_function` and `--calibration_batches` shape `--convert_norms`."""
    given = [f"--{name}" for name, value, unset in (("convert_modules", args.convert_modules, None),
                                                    ("preserve_function", args.preserve_function, False))
             if value != unset]
    if given and args.convert_norms is None:
        raise BadInput(f"{', '.join(given)} shape --convert_norms: give --convert_norms too")
    if args.convert_modules is not None:
        try:
            re.compile(args.convert_modules)
        except re.error as error:
            raise BadInput(f"--convert_modules {args.convert_modules!r} is not a regular expression: {error}") \
                from None
    batches = args.calibration_batches
    if not isinstance(batches, int) or batches < 0:
        raise BadInput(f"--calibration_batches must be a count >= 0, got {batches!r}")


def _check_preserved_options(args: argparse.Namespace) -> None:
    """`--preserve_function` fixes some of PN's options (`converter.PRESERVING`): one given against
    them is refused here, before any work, rather than by `convert_norms` once the model is loaded."""
    from ..converter import PRESERVING

    if not args.preserve_function or args.convert_norms not in PRESERVING:
        return
    for option, value in PRESERVING[args.convert_norms]["options"].items():
        flag = NORM_CLASSES[args.convert_norms].config_options.get(option)
        given = vars(args)[flag] if flag else None
        if given is not None and given != value:
            raise BadInput(f"--preserve_function converts to {args.convert_norms} with {option}={value!r} (the "
                           f"function kept from the first update); leave out --{flag} {given!r}")


def _check_model_source(args: argparse.Namespace, norm_options: Iterable[str]) -> None:
    """`--model_name_or_path` brings its own architecture; building options would contradict it."""
    if args.preset is not None and args.config_name is not None:
        raise BadInput(f"give --preset {args.preset!r} or --config_name {args.config_name}, not both")
    _check_conversion_options(args)
    if args.convert_norms is not None:
        try:
            args.convert_norms = normalize_norm_name(args.convert_norms)
        except ValueError as error:
            raise BadInput(f"--convert_norms: {error}") from None
        if args.model_name_or_path is None:
            raise BadInput(f"--convert_norms {args.convert_norms} converts an existing Transformers model: "
                           f"give --model_name_or_path")
        _check_preserved_options(args)
    if args.model_name_or_path is None:
        if not args.do_train:
            raise BadInput("--no-do_train scores an existing model: give --model_name_or_path")
        return
    conflicting = [f"--{name}" for name in ("preset", "config_name", "config_overrides", *norm_options)
                   if vars(args)[name] is not None]
    if conflicting:
        raise BadInput(f"--model_name_or_path {args.model_name_or_path} brings its own architecture; "
                       f"leave out {', '.join(conflicting)}")


def _check_trackers(report_to: str) -> list[str]:
    """The trackers of `--report_to`, each known to Accelerate and installed."""
    names = [name.strip().lower() for name in report_to.split(",") if name.strip()]
    known = [kind.value for kind in LoggerType]
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise BadInput(f"--report_to {report_to!r}: unknown tracker {unknown or report_to!r}; valid: {known}")
    available = [str(kind.value) for kind in get_available_trackers()]
    if names == ["all"] and not available:
        raise BadInput("--with_tracking --report_to all: no tracker is installed; "
                       "pip install tensorboard (or hf_powernorm[tracking])")
    missing = [name for name in names if name != "all" and name not in available]
    if missing:
        raise BadInput(f"--report_to {report_to!r}: {missing} not installed (installed trackers: "
                       f"{available or 'none'}); pip install {' '.join(missing)}")
    return names


def _check_hub_access() -> None:
    """`--push_to_hub` needs the Hub and a token: say so before training, not after it."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise BadInput("--push_to_hub needs the Hugging Face Hub, but HF_HUB_OFFLINE is set")
    if huggingface_hub.get_token() is None:
        raise BadInput("--push_to_hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN")


def _data_path_exists(path: Path) -> bool:
    """A file or folder, or the prefix of aligned text files (`data/train` for `data/train.de`)."""
    return path.exists() or (path.parent.is_dir() and any(path.parent.glob(glob.escape(path.name) + ".*")))


def _has_rows(path: Path) -> bool:
    """Whether a data file holds at least one example (a CSV needs a line after its header)."""
    with open(path, "rb") as handle:
        lines = (line for line in handle if line.strip())
        needed = 2 if path.suffix == ".csv" else 1
        return sum(1 for _, _ in zip(range(needed), lines)) >= needed
