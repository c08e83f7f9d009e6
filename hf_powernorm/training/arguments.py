"""The command line every recipe shares, with the names of Transformers' `*_no_trainer.py` examples
where they mean the same thing, and the checks that run before any data is read.

Groups: data (`--train_file`, `--max_train_samples`, `--preprocessing_num_workers`,
`--overwrite_cache`, ...), tokenizer and model (`--model_name_or_path` to fine-tune or score an
exported model or checkpoint, `--config_name`, `--tokenizer_name`, `--preset`, the norms), the
options of Power Normalization (Algorithm 2: `alpha_fwd`, `alpha_bkw`, warmup, group scaling,
backward denominator, synchronised statistics), those of DyT and Derf (initial alpha per site, the
learnable embedding scale), training (`--max_tokens` or
`--per_device_train_batch_size`, `--lr_scheduler_type`, `--num_warmup_steps`, ...), evaluation and
the Hub. `check_args` fails on bad values, naming them, before any data is read.
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
from ..normalization import BACKWARD_DENOMINATORS, NORM_CLASSES, WARMUP_STATISTICS, PowerNorm, normalize_norm_name
from .checks import check_dropout, check_learning_rate, check_weight_decay
from .optimization import SCHEDULER_TYPES

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
    """A recipe's command line: a malformed option is a ValueError, which the script reports in one
    line with exit status 2 (`tasks.run_script`), as every other bad input."""

    def error(self, message: str):
        raise ValueError(message)


def _group_num(value: str) -> int | str:
    if value.lower() == "none":
        return "none"  # resolved to None (no group scaling) by `powernorm_overrides`
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {value!r}")
    return int(value)


def add_recipe_args(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """The arguments every recipe shares; `defaults` are the script's own defaults."""
    _add_data_args(parser)
    _add_model_args(parser)
    _add_powernorm_args(parser)
    _add_elementwise_norm_args(parser)
    _add_training_args(parser)
    _add_evaluation_and_hub_args(parser)
    parser.set_defaults(**defaults)
    return parser


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", help="Hub dataset (needs network, or the datasets cache)")
    data.add_argument("--dataset_config_name", "--dataset_config", dest="dataset_config",
                      help="Hub dataset configuration")
    data.add_argument("--train_file")
    data.add_argument("--validation_file")
    data.add_argument("--test_file")
    data.add_argument("--max_train_samples", type=int, help="train on the first N examples")
    data.add_argument("--max_eval_samples", type=int, help="evaluate on the first N examples of each split")
    data.add_argument("--preprocessing_num_workers", type=int, help="processes for tokenization")
    data.add_argument("--overwrite_cache", action="store_true", help="tokenize again instead of reading the cache")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("tokenizer and model")
    model.add_argument("--model_name_or_path",
                       help="start from this exported model or checkpoint folder (or Hub id in the cache): "
                            "fine-tune it, or only score it with --no-do_train")
    model.add_argument("--config_name", help="a config.json or folder to build a new model from")
    model.add_argument("--tokenizer_name", help="a saved tokenizer folder; default: --model_name_or_path's, "
                                                "else a BPE trained on the training split")
    model.add_argument("--vocab_size", type=int, default=500, help="BPE size (paper: 10k IWSLT, 37k WMT)")
    model.add_argument("--trust_remote_code", action="store_true",
                       help="allow a --model_name_or_path whose code lives in its folder or Hub repository to run "
                            "it (as Transformers' examples); only for repositories you trust and have read")
    model.add_argument("--preset", help="a PowerNormTransformerConfig preset; default: a small model sized "
                                        "for the embedded corpus")
    model.add_argument("--config_overrides", help="config fields, e.g. 'hidden_size=64,encoder_layers=3'")
    model.add_argument("--norm_type", help="the norm of the script's model (any registry spelling, e.g. "
                                           "PowerNorm, layernorm): the encoder's for translation and "
                                           "classification, every norm for language modelling")
    model.add_argument("--encoder_norm_type", help="override the encoder norm (e.g. powernorm)")
    model.add_argument("--decoder_norm_type", help="override the decoder norm (e.g. layernorm)")
    model.add_argument("--dropout", type=float, help="residual dropout; default: the preset's")
    model.add_argument("--convert_norms", metavar="NORM",
                       help="with --model_name_or_path a Transformers model folder (BERT, GPT-2, Llama, ...): "
                            "replace its LayerNorm/RMSNorm layers by this norm of the registry (e.g. powernorm; "
                            "PN options from the --powernorm_* flags) and fine-tune it")
    model.add_argument("--convert_modules", metavar="REGEX",
                       help="the norms --convert_norms replaces: a regular expression searched in each norm's "
                            "module path (e.g. '^model\\.encoder\\.' for the encoder only, 'norm$' for QK-norms "
                            "too); default: the norms over the residual stream (QK-norms kept)")
    model.add_argument("--preserve_function", action=argparse.BooleanOptionalAction, default=False,
                       help="--convert_norms starts from the model's function (convert_norms(preserve_function="
                            "True): PN with one group scaling group, no warmup, a running statistic calibrated on "
                            "--calibration_batches training batches and a weight that cancels it)")
    model.add_argument("--calibration_batches", type=int, default=8, metavar="N",
                       help="training batches that calibrate PN's running statistic under --preserve_function "
                            "(0: none, the statistic starts at 1)")


# The flag of each option of `PowerNorm.config_options` the recipes set, `--<its config field>`, in the
# order --help lists them.
_POWERNORM_FLAGS = {
    "alpha_fwd": dict(type=float, help="EMA factor of the forward statistic"),
    "alpha_bkw": dict(type=float, help="EMA factor of the gradient statistic"),
    "warmup_steps": dict(type=int, help="updates using batch statistics (the config stores them as forward passes: "
                                        "x --gradient_accumulation_steps); default: the preset's, else "
                                        "--num_warmup_steps"),
    "group_num": dict(type=_group_num, help="group scaling groups, or 'none'; default: one per attention head"),
    "backward_denominator": dict(choices=BACKWARD_DENOMINATORS,
                                 help="'running' (paper, eq. 12) or 'batch' (the reference code)"),
    "warmup_statistic": dict(choices=WARMUP_STATISTICS,
                             help="running statistic during warmup: 'cumulative' mean of the batch statistics, or "
                                  "'reference' (the authors' code: cumulative then EMA step)"),
    "warmup_ramp_steps": dict(type=int, help="updates after warmup over which the denominator blends from the batch "
                                             "statistic to the running one (0: the paper's switch)"),
}


def _add_powernorm_args(parser: argparse.ArgumentParser) -> None:
    norms = parser.add_argument_group("power normalization (default: the preset's values)")
    for option, flag in _POWERNORM_FLAGS.items():
        norms.add_argument(f"--{PowerNorm.config_options[option]}", **flag)
    norms.add_argument("--sync_stats", action=argparse.BooleanOptionalAction, default=None,
                       help="sum PN/BN statistics over processes; default: on with several processes. "
                            "With --no-sync_stats each process keeps its own. Either way they are "
                            "averaged over the processes before the model is evaluated or saved")


def _add_elementwise_norm_args(parser: argparse.ArgumentParser) -> None:
    norms = parser.add_argument_group("DyT and Derf (default: the preset's values)")
    for site, where in zip(NORM_SITES, ("before self- and cross-attention", "before the feed-forward block",
                                        "in the final norm of each stack")):
        norms.add_argument(f"--norm_alpha_init_{site}", type=float, metavar="ALPHA",
                           help=f"initial alpha of DyT/Derf {where}")
    norms.add_argument("--embed_scale_learnable", action=argparse.BooleanOptionalAction, default=None,
                       help="a learnable scalar scales the token embeddings, starting at sqrt(hidden); default: "
                            "on in a stack of DyT or Derf norms, off otherwise")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    train = parser.add_argument_group("training")
    train.add_argument("--do_train", action=argparse.BooleanOptionalAction, default=True,
                       help="train (default); --no-do_train only scores --model_name_or_path and exports it")
    train.add_argument("--max_tokens", type=int, default=1024, help="padded tokens per batch and process")
    train.add_argument("--per_device_train_batch_size", type=int,
                       help="examples per batch and process, instead of the --max_tokens budget")
    train.add_argument("--learning_rate", type=float, default=3e-3)
    train.add_argument("--lr_scheduler_type", default="inverse_sqrt", choices=SCHEDULER_TYPES,
                       help="fairseq's inverse_sqrt (the paper's), or a schedule of transformers.get_scheduler")
    train.add_argument("--num_warmup_steps", "--warmup_steps", dest="num_warmup_steps", type=int, default=200,
                       help="learning-rate warmup in updates")
    train.add_argument("--warmup_init_lr", type=float, default=1e-7, help="inverse_sqrt: the first update's lr")
    train.add_argument("--weight_decay", type=float, default=1e-4)
    train.add_argument("--clip_norm", type=float, default=0.0, help="max gradient norm; 0 disables")
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--num_train_epochs", type=int, default=20)
    train.add_argument("--max_train_steps", type=int, help="optimizer updates; overrides the epochs")
    train.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), help="default: accelerate config")
    train.add_argument("--cpu", action="store_true", help="train on CPU even if an accelerator is present")
    train.add_argument("--seed", type=int, default=1)
    train.add_argument("--dropout_seed", type=int,
                       help="reseed the random draws of training (dropout) with this once the model is built: the "
                            "same --seed's initialisation and batch order, other dropout masks (default: --seed's "
                            "stream goes on)")
    train.add_argument("--checkpointing_steps", help="save the training state every N updates, or 'epoch'")
    train.add_argument("--checkpoints_total_limit", type=int,
                       help="keep only the newest N complete checkpoints (the best model and the checkpoint "
                            "resumed from are kept too)")
    train.add_argument("--resume_from_checkpoint",
                       help="a complete step_<N> folder, or 'latest': the newest complete one in --output_dir")
    train.add_argument("--output_dir", default="outputs/run",
                       help="a new or empty folder, the folder of the run to resume, or another run's with "
                            "--overwrite_output_dir")
    train.add_argument("--overwrite_output_dir", action="store_true",
                       help="clear --output_dir first if it holds another run (its training_log.jsonl or "
                            "all_results.json)")
    train.add_argument("--record_norm_stats", type=int, nargs="?", const=1, default=0, metavar="EVERY_N",
                       help="write what every norm layer sees (batch and running statistics, gradient "
                            "contributions, Lemma 2) every N updates to output_dir/norm_stats.jsonl")
    train.add_argument("--with_tracking", action="store_true",
                       help="log loss, learning rate, tokens/s, validation and final scores to --report_to")
    train.add_argument("--report_to", default="tensorboard",
                       help="with --with_tracking: 'all' or comma-separated Accelerate trackers (tensorboard, "
                            "wandb, mlflow, ...); TensorBoard writes under --output_dir")


def _add_evaluation_and_hub_args(parser: argparse.ArgumentParser) -> None:
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval_steps", type=int, help="validate every N updates; default: each epoch")
    evaluation.add_argument("--patience", type=int, help="stop after N validations without improvement")
    evaluation.add_argument("--per_device_eval_batch_size", "--eval_batch_size", dest="eval_batch_size",
                            type=int, default=32)
    hub = parser.add_argument_group("hub")
    hub.add_argument("--push_to_hub", action="store_true",
                     help="upload the export (weights with statistics, config, code, tokenizer, card, results); "
                          "the repository is created before training")
    hub.add_argument("--hub_model_id", help="ORG/NAME on the Hub, also the card's name; default: the output "
                                            "folder's name")
    hub.add_argument("--hub_private_repo", action="store_true", help="create the repository private")


def check_args(args: argparse.Namespace, norm_options: Iterable[str] = NORM_OPTIONS,
               path_options: Iterable[str] = DATA_FILE_OPTIONS) -> None:
    """Fail before any data is read: unknown preset or norm, missing or empty file (of
    `path_options`, the task's data files, and the model's), bad counts, options that contradict
    `--model_name_or_path`."""
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset!r} is unknown; valid presets: {sorted(PRESETS)}")
    for option in norm_options:
        value = getattr(args, option)
        if value is not None:
            try:
                setattr(args, option, normalize_norm_name(value))
            except ValueError as error:
                raise ValueError(f"--{option}: {error}") from None
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
        path = getattr(args, option, None)
        if path and not _data_path_exists(Path(path)):
            raise FileNotFoundError(f"--{option} {path}: not found")
        # `datasets` fails on an empty file with a generic generation error: name the split here.
        if path and option != "config_name" and Path(path).is_file() and not _has_rows(Path(path)):
            split = option.removesuffix("_file") if option in DATA_FILE_OPTIONS else "train"
            raise ValueError(f"split {split!r} is empty: --{option} {path} has no data")


def _check_counts(args: argparse.Namespace) -> None:
    if args.checkpointing_steps not in (None, "epoch") and not (
            args.checkpointing_steps.isdigit() and int(args.checkpointing_steps) > 0):
        raise ValueError(f"--checkpointing_steps must be a positive integer or 'epoch'; "
                         f"got {args.checkpointing_steps!r}")
    for option in ("gradient_accumulation_steps", "max_tokens", "eval_batch_size", "eval_steps", "patience",
                   "max_eval_samples", "max_train_samples", "max_train_steps", "num_train_epochs",
                   "num_warmup_steps", "per_device_train_batch_size", "preprocessing_num_workers",
                   "checkpoints_total_limit"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option} must be at least 1; got {value}")
    for option in ("record_norm_stats", "powernorm_warmup_ramp_steps"):
        value = getattr(args, option)
        if value is not None and value < 0:
            raise ValueError(f"--{option} must be at least 0; got {value}")
    for option in ELEMENTWISE_NORM_OPTIONS[:-1]:
        value = getattr(args, option)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{option} must be a finite positive number; got {value}")


def _check_rates(args: argparse.Namespace) -> None:
    """The optimizer's and the model's rates, by the rules of `checks.py` (the recipe's value when
    the option was not given: a default is checked too)."""
    check_learning_rate(args.learning_rate)
    check_weight_decay(args.weight_decay)
    if args.dropout is not None:
        check_dropout(args.dropout)
    for option in ("warmup_init_lr", "clip_norm"):
        value = getattr(args, option)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{option} {value}: expected a finite number >= 0")


def check_batch_budget(args: argparse.Namespace) -> None:
    """Token-budget batches must hold the longest example the maximum lengths allow: `--max_tokens`
    at least `--max_source_length` / `--max_target_length` (else `--max_length`) and `--block_size`,
    checked before any data is read."""
    if not getattr(args, "do_train", True) or getattr(args, "per_device_train_batch_size", None) is not None:
        return
    names = ("max_source_length", "max_target_length") if getattr(args, "max_source_length", None) is not None \
        else ("max_length",)
    for name in (*names, "block_size"):
        value = getattr(args, name, None)
        if value is not None and value > args.max_tokens:
            raise ValueError(f"--max_tokens {args.max_tokens} is less than --{name} {value}: a batch must hold "
                             f"the longest example; raise --max_tokens or lower --{name}")


def _check_conversion_options(args: argparse.Namespace) -> None:
    """`--convert_modules`, `--preserve_function` and `--calibration_batches` shape `--convert_norms`."""
    given = [f"--{name}" for name, unset in (("convert_modules", None), ("preserve_function", False))
             if getattr(args, name, unset) != unset]
    if given and getattr(args, "convert_norms", None) is None:
        raise ValueError(f"{', '.join(given)} shape --convert_norms: give --convert_norms too")
    if getattr(args, "convert_modules", None) is not None:
        try:
            re.compile(args.convert_modules)
        except re.error as error:
            raise ValueError(f"--convert_modules {args.convert_modules!r} is not a regular expression: {error}") \
                from None
    batches = getattr(args, "calibration_batches", 0)
    if not isinstance(batches, int) or batches < 0:
        raise ValueError(f"--calibration_batches must be a count >= 0, got {batches!r}")


def _check_preserved_options(args: argparse.Namespace) -> None:
    """`--preserve_function` fixes some of PN's options (`converter.PRESERVING`): one given against
    them is refused here, before any work, rather than by `convert_norms` once the model is loaded."""
    from ..converter import PRESERVING

    if not getattr(args, "preserve_function", False) or args.convert_norms not in PRESERVING:
        return
    for option, value in PRESERVING[args.convert_norms]["options"].items():
        flag = NORM_CLASSES[args.convert_norms].config_options.get(option)
        given = getattr(args, flag, None) if flag else None
        if given is not None and given != value:
            raise ValueError(f"--preserve_function converts to {args.convert_norms} with {option}={value!r} (the "
                             f"function kept from the first update); leave out --{flag} {given!r}")


def _check_model_source(args: argparse.Namespace, norm_options: Iterable[str]) -> None:
    """`--model_name_or_path` brings its own architecture; building options would contradict it."""
    if args.preset is not None and args.config_name is not None:
        raise ValueError(f"give --preset {args.preset!r} or --config_name {args.config_name}, not both")
    _check_conversion_options(args)
    if args.convert_norms is not None:
        try:
            args.convert_norms = normalize_norm_name(args.convert_norms)
        except ValueError as error:
            raise ValueError(f"--convert_norms: {error}") from None
        if args.model_name_or_path is None:
            raise ValueError(f"--convert_norms {args.convert_norms} converts an existing Transformers model: "
                             f"give --model_name_or_path")
        _check_preserved_options(args)
    if args.model_name_or_path is None:
        if not args.do_train:
            raise ValueError("--no-do_train scores an existing model: give --model_name_or_path")
        return
    conflicting = [f"--{name}" for name in ("preset", "config_name", "config_overrides", *norm_options)
                   if getattr(args, name, None) is not None]
    if conflicting:
        raise ValueError(f"--model_name_or_path {args.model_name_or_path} brings its own architecture; "
                         f"leave out {', '.join(conflicting)}")


def _check_trackers(report_to: str) -> list[str]:
    """The trackers of `--report_to`, each known to Accelerate and installed."""
    names = [name.strip().lower() for name in report_to.split(",") if name.strip()]
    known = [kind.value for kind in LoggerType]
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise ValueError(f"--report_to {report_to!r}: unknown tracker {unknown or report_to!r}; valid: {known}")
    available = [str(kind.value) for kind in get_available_trackers()]
    if names == ["all"] and not available:
        raise ValueError("--with_tracking --report_to all: no tracker is installed; "
                         "pip install tensorboard (or hf_powernorm[tracking])")
    missing = [name for name in names if name != "all" and name not in available]
    if missing:
        raise ValueError(f"--report_to {report_to!r}: {missing} not installed (installed trackers: "
                         f"{available or 'none'}); pip install {' '.join(missing)}")
    return names


def _check_hub_access() -> None:
    """`--push_to_hub` needs the Hub and a token: say so before training, not after it."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError("--push_to_hub needs the Hugging Face Hub, but HF_HUB_OFFLINE is set")
    if huggingface_hub.get_token() is None:
        raise ValueError("--push_to_hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN")


def _data_path_exists(path: Path) -> bool:
    """A file or folder, or the prefix of aligned text files (`data/train` for `data/train.de`)."""
    return path.exists() or (path.parent.is_dir() and any(path.parent.glob(glob.escape(path.name) + ".*")))


def _has_rows(path: Path) -> bool:
    """Whether a data file holds at least one example (a CSV needs a line after its header)."""
    with open(path, "rb") as handle:
        lines = (line for line in handle if line.strip())
        needed = 2 if path.suffix == ".csv" else 1
        return sum(1 for _, _ in zip(range(needed), lines)) >= needed
