"""The model a recipe trains: built from `--preset` / `--config_name` and the command line, or
loaded from `--model_name_or_path` (an export or a checkpoint folder) to fine-tune or score.

PN's warmup follows the learning-rate warmup unless given, and is stored in the config as training
forward passes (updates x `--gradient_accumulation_steps`), since PN counts forward passes;
statistics are synchronised across processes with `--sync_stats` (default: with several processes).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from accelerate.logging import get_logger

from ..configuration_powernorm import PowerNormTransformerConfig
from ..normalization import NORM_CLASSES, normalize_norm_name
from .arguments import PN_OPTIONS, PN_UPDATE_COUNTS
from .options import BadInput

logger = get_logger(__name__)


def powernorm_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config fields from the PN options and `--dropout` that were given (the preset's otherwise)."""
    overrides = {name: vars(args)[name] for name in PN_OPTIONS if vars(args)[name] is not None}
    if overrides.get("powernorm_group_num") == "none":
        overrides["powernorm_group_num"] = None
    for name in PN_UPDATE_COUNTS:  # updates on the command line, forward passes in the config
        if name in overrides:
            overrides[name] *= args.gradient_accumulation_steps
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    return overrides


def _sync_stats(args: argparse.Namespace, config: PowerNormTransformerConfig, num_processes: int) -> bool:
    return (config.powernorm_sync_stats or num_processes > 1) if args.sync_stats is None else args.sync_stats


def build_config(args: argparse.Namespace, tokenizer: Any, num_processes: int, default_size: dict[str, Any],
                 max_length: int, **fields: Any) -> PowerNormTransformerConfig:
    """The model config: `--config_name`, else `--preset`, else "tiny" resized by `default_size`;
    then the tokenizer's ids, `fields`, the PN options and dropout, `--encoder/decoder_norm_type`,
    and `--config_overrides` last."""
    token_ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                 "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                 "decoder_start_token_id": tokenizer.eos_token_id}
    return _config_of(args, token_ids, num_processes, default_size, max_length, **fields)


def check_config_options(args: argparse.Namespace, default_size: dict[str, Any], max_length: int,
                         **fields: Any) -> None:
    """Build the config a new model would get (`build_config`) with a stand-in vocabulary, before any
    data is read: a PN option, a norm option or a `--config_overrides` field it refuses fails now,
    one line naming it, not after the tokenizer is written. A loaded model brings its own config."""
    if args.model_name_or_path is not None:
        return
    token_ids = {"vocab_size": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}
    try:
        _config_of(args, token_ids, 1, default_size, max_length, **fields)
    except (TypeError, ValueError) as error:
        source = (f"--config_name {args.config_name}" if args.config_name else
                  f"--preset {args.preset}" if args.preset else "the script's default size")
        message = " ".join(str(error).split())
        raise BadInput(f"the model config ({source} with the command line's options): {message}") from None


def _config_of(args: argparse.Namespace, token_ids: dict[str, Any], num_processes: int,
               default_size: dict[str, Any], max_length: int, **fields: Any) -> PowerNormTransformerConfig:
    """`build_config` with the vocabulary's size and special ids given as `token_ids`."""
    norms = {k: vars(args)[k] for k in ("encoder_norm_type", "decoder_norm_type") if vars(args)[k]}
    overrides = {**fields, **powernorm_overrides(args), **norms, **token_ids}
    if args.config_name:
        config = PowerNormTransformerConfig.from_pretrained(args.config_name, **overrides)
    else:
        base = default_size if args.preset is None else {}
        config = PowerNormTransformerConfig.from_preset(args.preset or "tiny", **{**base, **overrides})
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    if args.powernorm_warmup_steps is None and config.powernorm_warmup_steps == 0:
        config.powernorm_warmup_steps = args.num_warmup_steps * args.gradient_accumulation_steps
    config.powernorm_sync_stats = _sync_stats(args, config, num_processes)
    config.max_position_embeddings = max(config.max_position_embeddings, max_length + 2)
    config.validate_powernorm_transformer()
    return config


def load_pretrained_model(args: argparse.Namespace, model_class: type, tokenizer: Any, num_processes: int,
                          max_length: int, **fields: Any) -> torch.nn.Module:
    """`--model_name_or_path` with its weights and running statistics, for fine-tuning or scoring;
    the PN options and `--dropout` given on the command line replace the saved ones. Fails, naming
    the values, when the model does not fit the tokenizer, the task's `fields` or `max_length`."""
    path = args.model_name_or_path
    config = PowerNormTransformerConfig.from_pretrained(path)
    if len(tokenizer) > config.vocab_size or tokenizer.pad_token_id != config.pad_token_id:
        raise BadInput(f"--model_name_or_path {path} has vocab_size {config.vocab_size} and pad id "
                       f"{config.pad_token_id}; the tokenizer has {len(tokenizer)} tokens and pad id "
                       f"{tokenizer.pad_token_id}: pass the model's tokenizer (--tokenizer_name)")
    differing = {k: (getattr(config, k, None), v) for k, v in fields.items() if getattr(config, k, None) != v}
    if differing:
        raise BadInput(f"--model_name_or_path {path} does not fit this task's data: "
                       + "; ".join(f"{k} is {saved!r} in the model, {wanted!r} here"
                                     for k, (saved, wanted) in differing.items()))
    if config.max_position_embeddings < max_length + 2:
        raise BadInput(f"--model_name_or_path {path} has max_position_embeddings "
                       f"{config.max_position_embeddings}; sequences of {max_length} tokens need {max_length + 2}")
    overrides = powernorm_overrides(args)
    overrides["powernorm_sync_stats"] = _sync_stats(args, config, num_processes)
    return model_class.from_pretrained(path, **overrides)


def converter_options(args: argparse.Namespace, num_processes: int) -> dict[str, Any]:
    """PowerNorm's options for `convert_norms` from the `--powernorm_*` flags: warmup counted in
    forward passes like the family's config (default: the learning-rate warmup, or none under
    `--preserve_function`, which starts on the running statistic), statistics synchronised with
    several processes unless `--no-sync_stats`."""
    if args.convert_norms != "powernorm":
        return {}
    overrides = powernorm_overrides(args)
    fields = NORM_CLASSES["powernorm"].config_options
    options = {option: overrides[field] for option, field in fields.items() if field in overrides}
    if not args.preserve_function:
        options["warmup_steps"] = overrides.get("powernorm_warmup_steps",
                                                args.num_warmup_steps * args.gradient_accumulation_steps)
    options["sync_stats"] = num_processes > 1 if args.sync_stats is None else args.sync_stats
    return options


def calibration_batches(args: argparse.Namespace, calibration: tuple[Any, Any] | None, *,
                        always: bool = False) -> list[dict] | None:
    """The first `--calibration_batches` training batches for `--preserve_function` (with `always`,
    without it too), collated as in training (`--per_device_train_batch_size` examples, 8 under a
    token budget); None where there are none to take."""
    wanted = always or args.preserve_function
    if not wanted or calibration is None or not args.calibration_batches:
        return None
    dataset, collate = calibration
    size = args.per_device_train_batch_size or 8
    rows = [dataset[i] for i in range(min(len(dataset), size * args.calibration_batches))]
    return [collate(rows[i:i + size]) for i in range(0, len(rows), size)] or None


def load_and_convert(args: argparse.Namespace, auto_class: type, tokenizer: Any, num_processes: int,
                     calibration: tuple[Any, Any] | None = None, **fields: Any) -> torch.nn.Module:
    """A Transformers model (`--model_name_or_path`, an `auto_class` checkpoint such as BERT or
    GPT-2) with the norms `--convert_modules` selects replaced by `--convert_norms`, keeping its
    function under `--preserve_function` (calibrated on `calibration`: the training split and its
    collator); a folder that was converted before is loaded with its running statistics and
    fine-tuned on."""
    from ..converted_norms import CONVERSION_CONFIG_KEY
    from ..converter import load_converted, load_converted_config

    path = args.model_name_or_path
    # Never None: Transformers would ask on the terminal whether to run a folder's own code.
    trust_remote_code = bool(args.trust_remote_code)
    config = load_converted_config(path, trust_remote_code=trust_remote_code)
    conversion = getattr(config, CONVERSION_CONFIG_KEY, None)
    if conversion:
        if conversion["norm_type"] != args.convert_norms:
            raise BadInput(f"--model_name_or_path {path} was converted to {conversion['norm_type']!r}, "
                           f"not --convert_norms {args.convert_norms!r}")
        model = load_converted(path, auto_class)
    else:
        model = load_pretrained(args, auto_class, **fields)
        convert_loaded(model, args, num_processes, calibration_batches(args, calibration))
    check_embeddings(model, tokenizer, path)
    return model.train()


def load_pretrained(args: argparse.Namespace, auto_class: type, **fields: Any) -> torch.nn.Module:
    """`--model_name_or_path` as `auto_class` loads it; of `fields`, the task's classes (a
    classification head of another size than the data's classes is rebuilt)."""
    task = {k: v for k, v in fields.items() if k in ("num_labels", "id2label", "label2id", "ignore_mismatched_sizes")}
    return auto_class.from_pretrained(args.model_name_or_path,
                                      trust_remote_code=bool(args.trust_remote_code), **task)


def convert_loaded(model: torch.nn.Module, args: argparse.Namespace, num_processes: int,
                   batches: list[dict] | None = None, *, centre_stream: bool = True):
    """`model`'s norms converted to `--convert_norms` (`--convert_modules`, `--preserve_function`
    calibrated on `batches`, collated by `calibration_batches`, the `--powernorm_*` options), in place;
    returns the conversion's report. `centre_stream=False` where the stream was centred before
    (`converter.centre_stream`)."""
    from ..converter import convert_norms

    report = convert_norms(model, args.convert_norms, modules=args.convert_modules,
                           preserve_function=args.preserve_function, calibration_batches=batches,
                           centre_stream=centre_stream, **converter_options(args, num_processes))
    logger.info(f"converted the norms of {args.model_name_or_path}: {report}")
    return report


def check_embeddings(model: torch.nn.Module, tokenizer: Any, path: str) -> None:
    """A ValueError where the tokenizer has more tokens than the model embeds."""
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise BadInput(f"--model_name_or_path {path} embeds {embeddings} tokens; the tokenizer has {len(tokenizer)}")


def build_model(args: argparse.Namespace, model_class: type, tokenizer: Any, num_processes: int,
                default_size: dict[str, Any], max_length: int, *, auto_class: type | None = None,
                calibration: tuple[Any, Any] | None = None, **fields: Any) -> torch.nn.Module:
    """`--model_name_or_path` converted (`--convert_norms`, with `auto_class`) or loaded, else a
    new `model_class` from `build_config`."""
    if args.convert_norms:
        if auto_class is None:
            raise BadInput("--convert_norms is not offered by this script")
        return load_and_convert(args, auto_class, tokenizer, num_processes, calibration, **fields)
    if args.model_name_or_path:
        return load_pretrained_model(args, model_class, tokenizer, num_processes, max_length, **fields)
    model = model_class(build_config(args, tokenizer, num_processes, default_size, max_length, **fields))
    warn_causal_leak(model, args.gradient_accumulation_steps)
    return model


def warn_causal_leak(model: torch.nn.Module, gradient_accumulation_steps: int = 1) -> None:
    """A new causal language model whose norms take batch statistics in training (PN during its
    warmup, BN always) says so once at the start, as its model card does: those statistics mix the
    positions of a batch, so later tokens leak into earlier ones' training outputs."""
    from ..converter import causal_norms, mixes_positions
    from ..modeling_powernorm import PowerNormTransformerForCausalLM

    config = model.config
    norm = normalize_norm_name(config.decoder_norm_type)
    if not (isinstance(model, PowerNormTransformerForCausalLM) and mixes_positions(norm, config.norm_kwargs(norm))):
        return
    cls = NORM_CLASSES[norm]
    fields = [cls.config_options[option] for option in cls.mixing_options]
    if fields:  # counted in forward passes in the config
        updates = sum(getattr(config, field) for field in fields) // gradient_accumulation_steps
        when = f"for its first {updates} updates (its warmup)"
        avoid = f"pass {' '.join(f'--{field} 0' for field in fields)} to use running statistics from the start, or "
    else:
        when, avoid = "at every update", "use "
    logger.warning(f"{type(model).__name__}: its {norm} norms train on batch statistics {when}: they mix the "
                   f"positions of a batch, so the statistics of later tokens leak into earlier positions' training "
                   f"outputs (eval mode is unaffected); {avoid}a norm that keeps the positions apart "
                   f"({causal_norms()}, with --norm_type)", main_process_only=True)


def resolve_model_path(name_or_path: str) -> str:
    """A local folder for `--model_name_or_path`: itself, or a Hub repository's snapshot (from the
    cache when offline)."""
    if Path(name_or_path).is_dir():
        return check_model_folder(name_or_path)
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(name_or_path)
    except Exception as error:
        raise BadInput(f"--model_name_or_path {name_or_path!r} is neither a folder nor a Hub repository that "
                       f"can be reached or is in the cache ({type(error).__name__}: {error})") from error
    return check_model_folder(folder, name_or_path)


def check_model_folder(folder: str, name: str | None = None) -> str:
    """`folder` (the local folder of `--model_name_or_path` `name`) when it holds a model's
    `config.json`; a ValueError saying that it does not otherwise."""
    if not (Path(folder) / "config.json").is_file():
        shown = folder if name is None or name == folder else f"{name!r} ({folder})"
        raise BadInput(f"--model_name_or_path {shown} holds no config.json: expected a model folder written "
                       f"by save_pretrained (an export or a step_<N> checkpoint of a recipe)")
    return folder


def model_tokenizer_path(args: argparse.Namespace) -> str | None:
    """The tokenizer folder to use: `--tokenizer_name`, else `--model_name_or_path`'s (a local folder:
    `resolve_model_path` first)."""
    if args.tokenizer_name:
        return args.tokenizer_name
    if args.model_name_or_path:
        if not (Path(args.model_name_or_path) / "tokenizer.json").is_file():
            raise BadInput(f"--model_name_or_path {args.model_name_or_path} holds no tokenizer.json; "
                           f"pass the tokenizer it was trained with as --tokenizer_name")
        return args.model_name_or_path
    return None


def norm_types(model: torch.nn.Module) -> dict[str, int]:
    """How many norm layers of each class the model holds (for the start-of-run log)."""
    classes = tuple(NORM_CLASSES.values())
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, classes):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts
