"""The options the recipes and `hf-powernorm compare` share, each declared once as a dataclass field
(as fairseq's dataclass configs): its flags, type, group and help, from which a command line is built
(`add_options`). A command that says an option differently (its own default or help) takes the one
declaration with those changes (`shared`). Also the user's errors (`BadInput`, from `checks`) and
the one test of the main process (`is_main_process`). Imports no torch, so a command's `--help`
answers at once; the checks that need the library are `arguments.py`'s. See docs/options.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from .checks import BadInput, MissingInput

__all__ = ["BadInput", "MissingInput", "RecipeOptions", "TaskOptions", "add_options", "add_task_option", "flag",
           "group_num", "is_main_process", "option", "shared", "world_size"]


def world_size() -> int:
    """The processes of an `accelerate launch` (1 without)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Whether this process is the main one of an `accelerate launch` (or the only one), before any
    Accelerate state is built."""
    return world_size() == 1 or int(os.environ.get("RANK", "0")) == 0


def option(default: Any = None, help: str = "", group: str = "", *, runtime: bool = False,
           **argparse_settings: Any) -> Any:
    """A field that is a command-line option. `runtime`: it changes where or how fast a command runs,
    or what it keeps, not what it measures. `argparse_settings` go to `add_argument`, but `flags`
    (the spellings, default `--<field>`) and `negative` (a hidden `store_false` spelling)."""
    metadata = {"help": help, "group": group, "runtime": runtime, "argparse": argparse_settings}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def flag(help: str, group: str = "", *, runtime: bool = False) -> Any:
    return option(False, help, group, runtime=runtime, action="store_true")


def group_num(value: str) -> int | str:
    """`--powernorm_group_num`: a positive count, or 'none' (no group scaling, resolved to None by
    `models.powernorm_overrides`)."""
    if value.lower() == "none":
        return "none"
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {value!r}")
    return int(value)


# The library's choices, here without importing it (tests hold them equal): `SCHEDULER_TYPES` of
# `optimization`, `BACKWARD_DENOMINATORS` and `WARMUP_STATISTICS` of `normalization`, `NORM_SITES`
# of `configuration_powernorm`.
SCHEDULES = ("inverse_sqrt", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
             "constant_with_warmup")
BACKWARD_DENOMINATORS = ("running", "batch")
WARMUP_STATISTICS = ("cumulative", "reference")
NORM_SITES = ("attention", "ffn", "final")


@dataclass
class RecipeOptions:
    """The options every recipe takes (`arguments.add_recipe_args`), in the order `--help` lists them."""

    # data
    dataset_name: str | None = option(help="Hub dataset (needs network, or the datasets cache)", group="data")
    dataset_config: str | None = option(help="Hub dataset configuration", group="data",
                                        flags=("--dataset_config_name", "--dataset_config"))
    train_file: str | None = option(group="data")
    validation_file: str | None = option(group="data")
    test_file: str | None = option(group="data")
    max_train_samples: int | None = option(help="train on the first N examples", group="data", type=int)
    max_eval_samples: int | None = option(help="evaluate on the first N examples of each split", group="data",
                                          type=int)
    preprocessing_num_workers: int | None = option(help="processes for tokenization", group="data", type=int)
    overwrite_cache: bool = flag("tokenize again instead of reading the cache", "data")
    # tokenizer and model
    model_name_or_path: str | None = option(
        help="start from this exported model or checkpoint folder (or Hub id in the cache): fine-tune it, or only "
             "score it with --no-do_train", group="model")
    config_name: str | None = option(help="a config.json or folder to build a new model from", group="model")
    tokenizer_name: str | None = option(help="a saved tokenizer folder; default: --model_name_or_path's, else a BPE "
                                             "trained on the training split", group="model")
    vocab_size: int = option(500, "BPE size (paper: 10k IWSLT, 37k WMT)", "model", type=int)
    trust_remote_code: bool = flag("allow a --model_name_or_path whose code lives in its folder or Hub repository to "
                                   "run it (as Transformers' examples); only for repositories you trust and have "
                                   "read", "model")
    preset: str | None = option(help="a PowerNormTransformerConfig preset; default: a small model sized for the "
                                     "embedded corpus", group="model")
    config_overrides: str | None = option(help="config fields, e.g. 'hidden_size=64,encoder_layers=3'", group="model")
    norm_type: str | None = option(help="the norm of the script's model (any registry spelling, e.g. PowerNorm, "
                                        "layernorm): the encoder's for translation and classification, every norm "
                                        "for language modelling", group="model")
    encoder_norm_type: str | None = option(help="override the encoder norm (e.g. powernorm)", group="model")
    decoder_norm_type: str | None = option(help="override the decoder norm (e.g. layernorm)", group="model")
    dropout: float | None = option(help="residual dropout; default: the preset's", group="model", type=float)
    convert_norms: str | None = option(
        help="with --model_name_or_path a Transformers model folder (BERT, GPT-2, Llama, ...): replace its "
             "LayerNorm/RMSNorm layers by this norm of the registry (e.g. powernorm; PN options from the "
             "--powernorm_* flags) and fine-tune it", group="model", metavar="NORM")
    convert_modules: str | None = option(
        help="the norms --convert_norms replaces: a regular expression searched in each norm's module path (e.g. "
             "'^model\\.encoder\\.' for the encoder only, 'norm$' for QK-norms too); default: the norms over the "
             "residual stream (QK-norms kept)", group="model", metavar="REGEX")
    preserve_function: bool = option(
        False, "--convert_norms starts from the model's function (convert_norms(preserve_function=True): PN with one "
               "group scaling group, no warmup, a running statistic calibrated on --calibration_batches training "
               "batches and a weight that cancels it)", "model", action=argparse.BooleanOptionalAction)
    calibration_batches: int = option(8, "training batches that calibrate PN's running statistic under "
                                         "--preserve_function (0: none, the statistic starts at 1)", "model",
                                      type=int, metavar="N")
    # power normalization: the options of `PowerNorm.config_options`, `--<its config field>`
    powernorm_alpha_fwd: float | None = option(help="EMA factor of the forward statistic", group="powernorm",
                                               type=float)
    powernorm_alpha_bkw: float | None = option(help="EMA factor of the gradient statistic", group="powernorm",
                                               type=float)
    powernorm_warmup_steps: int | None = option(
        help="updates using batch statistics (the config stores them as forward passes: x "
             "--gradient_accumulation_steps); default: the preset's, else --num_warmup_steps", group="powernorm",
        type=int)
    powernorm_group_num: int | str | None = option(help="group scaling groups, or 'none'; default: one per "
                                                        "attention head", group="powernorm", type=group_num)
    powernorm_backward_denominator: str | None = option(
        help="'running' (paper, eq. 12) or 'batch' (the reference code)", group="powernorm",
        choices=BACKWARD_DENOMINATORS)
    powernorm_warmup_statistic: str | None = option(
        help="running statistic during warmup: 'cumulative' mean of the batch statistics, or 'reference' (the "
             "authors' code: cumulative then EMA step)", group="powernorm", choices=WARMUP_STATISTICS)
    powernorm_warmup_ramp_steps: int | None = option(
        help="updates after warmup over which the denominator blends from the batch statistic to the running one "
             "(0: the paper's switch)", group="powernorm", type=int)
    sync_stats: bool | None = option(help="sum PN/BN statistics over processes; default: on with several processes. "
                                          "With --no-sync_stats each process keeps its own. Either way they are "
                                          "averaged over the processes before the model is evaluated or saved",
                                     group="powernorm", action=argparse.BooleanOptionalAction)
    # DyT and Derf
    norm_alpha_init_attention: float | None = option(help="initial alpha of DyT/Derf before self- and "
                                                          "cross-attention", group="elementwise", type=float,
                                                     metavar="ALPHA")
    norm_alpha_init_ffn: float | None = option(help="initial alpha of DyT/Derf before the feed-forward block",
                                               group="elementwise", type=float, metavar="ALPHA")
    norm_alpha_init_final: float | None = option(help="initial alpha of DyT/Derf in the final norm of each stack",
                                                 group="elementwise", type=float, metavar="ALPHA")
    embed_scale_learnable: bool | None = option(
        help="a learnable scalar scales the token embeddings, starting at sqrt(hidden); default: on in a stack of "
             "DyT or Derf norms, off otherwise", group="elementwise", action=argparse.BooleanOptionalAction)
    # training
    do_train: bool = option(True, "train (default); --no-do_train only scores --model_name_or_path and exports it",
                            "training", action=argparse.BooleanOptionalAction)
    max_tokens: int = option(1024, "padded tokens per batch and process", "training", type=int)
    per_device_train_batch_size: int | None = option(help="examples per batch and process, instead of the "
                                                          "--max_tokens budget", group="training", type=int)
    learning_rate: float = option(3e-3, "", "training", type=float)
    lr_scheduler_type: str = option("inverse_sqrt", "fairseq's inverse_sqrt (the paper's), or a schedule of "
                                                    "transformers.get_scheduler", "training", choices=SCHEDULES)
    num_warmup_steps: int = option(200, "learning-rate warmup in updates", "training", type=int,
                                   flags=("--num_warmup_steps", "--warmup_steps"))
    warmup_init_lr: float = option(1e-7, "inverse_sqrt: the first update's lr", "training", type=float)
    weight_decay: float = option(1e-4, "", "training", type=float)
    clip_norm: float = option(0.0, "max gradient norm; 0 disables", "training", type=float)
    gradient_accumulation_steps: int = option(1, "", "training", type=int)
    num_train_epochs: int = option(20, "", "training", type=int)
    max_train_steps: int | None = option(help="optimizer updates; overrides the epochs", group="training", type=int)
    mixed_precision: str | None = option(help="default: accelerate config", group="training",
                                         choices=("no", "fp16", "bf16"))
    cpu: bool = flag("train on CPU even if an accelerator is present", "training")
    seed: int = option(1, "", "training", type=int)
    dropout_seed: int | None = option(
        help="reseed the random draws of training (dropout) with this once the model is built: the same --seed's "
             "initialisation and batch order, other dropout masks (default: --seed's stream goes on)",
        group="training", type=int)
    checkpointing_steps: str | None = option(help="save the training state every N updates, or 'epoch'",
                                             group="training")
    checkpoints_total_limit: int | None = option(help="keep only the newest N complete checkpoints (the best model "
                                                      "and the checkpoint resumed from are kept too)",
                                                 group="training", type=int)
    resume_from_checkpoint: str | None = option(help="a complete step_<N> folder, or 'latest': the newest complete "
                                                     "one in --output_dir", group="training")
    output_dir: str = option("outputs/run", "a new or empty folder, the folder of the run to resume, or another run's "
                                            "with --overwrite_output_dir", "training")
    overwrite_output_dir: bool = flag("clear --output_dir first if it holds another run (its training_log.jsonl or "
                                      "all_results.json)", "training")
    record_norm_stats: int = option(0, "write what every norm layer sees (batch and running statistics, gradient "
                                       "contributions, Lemma 2) every N updates to output_dir/norm_stats.jsonl",
                                    "training", type=int, nargs="?", const=1, metavar="EVERY_N")
    with_tracking: bool = flag("log loss, learning rate, tokens/s, validation and final scores to --report_to",
                               "training")
    report_to: str = option("tensorboard", "with --with_tracking: 'all' or comma-separated Accelerate trackers "
                                           "(tensorboard, wandb, mlflow, ...); TensorBoard writes under --output_dir",
                            "training")
    # evaluation
    eval_steps: int | None = option(help="validate every N updates; default: each epoch", group="evaluation",
                                    type=int)
    patience: int | None = option(help="stop after N validations without improvement", group="evaluation", type=int)
    eval_batch_size: int = option(32, "", "evaluation", type=int,
                                  flags=("--per_device_eval_batch_size", "--eval_batch_size"))
    # hub
    push_to_hub: bool = flag("upload the export (weights with statistics, config, code, tokenizer, card, results); "
                             "the repository is created before training", "hub")
    hub_model_id: str | None = option(help="ORG/NAME on the Hub, also the card's name; default: the output folder's "
                                           "name", group="hub")
    hub_private_repo: bool = flag("create the repository private", "hub")


@dataclass
class TaskOptions:
    """The options that one task reads (`Task.own_options`), declared once: a task's recipe adds its own
    (`add_task_option`), `compare` takes them with its own defaults and help (`shared`)."""

    block_size: int | None = option(64, "tokens per training/evaluation block", "data", type=int)
    keep_linebreaks: bool = option(True, "keep the line breaks of text files in the token stream: the text '\\n' "
                                         "where the tokenizer writes it, else its end-of-sequence token; "
                                         "--no_keep_linebreaks (or --no-keep_linebreaks) joins the lines without "
                                         "them", "data", action=argparse.BooleanOptionalAction,
                                   negative="--no_keep_linebreaks")
    max_length: int | None = option(128, "truncate sequences to this many tokens", "data", type=int)
    source_lang: str = option("de", group="data")
    target_lang: str = option("en", group="data")
    label_names: str | None = option(help="comma-separated class names of local files (Hub datasets bring their own)",
                                     group="data")
    num_beams: int = option(5, group="evaluation", type=int)
    # the columns of the user's table files or dataset (`Task.column_options`)
    text_column: str | None = option(help="the text column of CSV / JSON lines files or a dataset; default: 'text', "
                                          "else 'sentence'", group="data")
    label_column: str | None = option(help="the label column; default: 'label'", group="data")
    source_column: str | None = option(help="a column of source texts (e.g. 'document'), with --target_column, "
                                            "instead of 'translation'", group="data")
    target_column: str | None = option(help="a column of target texts (e.g. 'summary')", group="data")


def add_task_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, **changes: Any) -> None:
    """`TaskOptions.<name>` on a task recipe's parser, with `changes` (its `default`, `help`) over the declaration."""
    spec = _field(TaskOptions, name)
    _add_field(parser, spec, changes.get("default", _field_default(spec)),
               changes.get("help", spec.metadata["help"]) or None)


RECIPE_GROUPS = {"data": "data", "model": "tokenizer and model",
                 "powernorm": "power normalization (default: the preset's values)",
                 "elementwise": "DyT and Derf (default: the preset's values)", "training": "training",
                 "evaluation": "evaluation", "hub": "hub"}
# What the training library reads for an option that a command does not take (a recipe the column
# options of other tasks, `compare` no PhraseBank file or generation lengths): every parsed command
# line holds each of them (`arguments.add_recipe_args`).
NOT_GIVEN = {"text_column": None, "label_column": None, "source_column": None, "target_column": None,
             "phrasebank_file": None, "keep_linebreaks": True, "block_size": None, "max_length": None,
             "max_source_length": None, "max_target_length": None, "length_penalty": None, "max_new_tokens": None}


def shared(name: str, *, default: Any = dataclasses.MISSING, help: str | None = None, group: str | None = None,
           runtime: bool = False, **argparse_changes: Any) -> Any:
    """The declaration of `RecipeOptions.<name>` (or `TaskOptions.<name>`) for another command: its flags
    and type, with the command's own `default`, `help`, `group`, `runtime` and argparse settings where given."""
    spec = _field(RecipeOptions if name in RecipeOptions.__dataclass_fields__ else TaskOptions, name)
    metadata = spec.metadata
    if default is dataclasses.MISSING:
        default = _field_default(spec)
    settings = {k: v for k, v in {**metadata["argparse"], **argparse_changes}.items() if v is not None}
    return option(default, metadata["help"] if help is None else help,
                  metadata["group"] if group is None else group, runtime=runtime, **settings)


def add_options(parser: argparse.ArgumentParser, options: type, titles: dict[str, str], *,
                say_defaults: bool = False) -> argparse.ArgumentParser:
    """A flag per option field of the dataclass `options`, in the argument groups of `titles` (group
    name -> title); with `say_defaults`, each help ends with its default unless it says it."""
    groups = {name: parser.add_argument_group(title) for name, title in titles.items()}
    for spec in dataclasses.fields(options):
        if "help" not in spec.metadata:
            continue  # a field settled by the command, not an option
        default = _field_default(spec)
        help = _with_default(spec.metadata["help"], default) if say_defaults else spec.metadata["help"] or None
        _add_field(groups[spec.metadata["group"]], spec, default, help)
    return parser


def _field(options: type, name: str) -> dataclasses.Field:
    return options.__dataclass_fields__[name]


def _field_default(spec: dataclasses.Field) -> Any:
    """An option field's default (a fresh list for a list's)."""
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def _add_field(parser: argparse.ArgumentParser | argparse._ArgumentGroup, spec: dataclasses.Field, default: Any,
               help: str | None) -> None:
    """The flags of the option field `spec` (its spellings, and a hidden `negative` one)."""
    settings = dict(spec.metadata["argparse"])
    flags, negative = settings.pop("flags", (f"--{spec.name}",)), settings.pop("negative", None)
    parser.add_argument(*flags, dest=spec.name, default=default, help=help, **settings)
    if negative:  # the spelling of Transformers' examples beside argparse's --no-<name>
        parser.add_argument(negative, dest=spec.name, action="store_false", help=argparse.SUPPRESS)


def _with_default(help: str, default: Any) -> str:
    """The help with its default, unless it says the default itself or there is none to say."""
    if "default:" in help or default in (None, False):
        return help
    return f"{help} (default: {default})"
