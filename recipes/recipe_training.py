"""Training with Accelerate: the task-independent side of `train_wmt.py`, `train_lm.py` and
`train_classification.py` (Shen et al., ICML 2020, Section 5 and Appendix A).

`recipe_utils.py` holds what does not depend on Accelerate (data, tokenization, batching,
optimizer, schedule, losses, metrics, checkpoint listing). This module holds:

- the command line every script shares: data, tokenizer and model, the options of Power
  Normalization (Algorithm 2: `alpha_fwd`, `alpha_bkw`, warmup, group scaling, backward
  denominator, statistics synchronised across processes or not), training, evaluation interval
  and patience; `check_args` fails on bad values before any data is read,
- the model config from those arguments, the `Accelerator`, the start of a run (Hub repository,
  trackers) and its log,
- the loaders: token-budget training batches with their own seeded generator, so that dropout
  continues exactly after a resume, and sequential evaluation batches,
- `train`: the update loop with gradient accumulation, a tqdm bar, tracking, validation every
  `--eval_steps`, the best model in `output_dir/best_model`, early stopping after `--patience`
  validations without improvement, and `save_state` checkpoints that resume exactly
  (`load_state` + `skip_first_batches`),
- `average_buffers_across_processes`: PN's running statistics made identical on every rank before
  the model is evaluated or saved, so a saved model never depends on which process wrote it,
- `save_outputs`: `save_pretrained`, tokenizer, `all_results.json` and the model card with the
  command as given; the final scores to the trackers and the export to the Hub.
"""

from __future__ import annotations

import argparse
import glob
import logging
import math
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import torch.distributed as dist
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.logging import get_logger
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType, set_seed
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_utils as ru  # noqa: E402

from hf_powernorm import NORM_CLASSES, PRESETS, PowerNormTransformerConfig, normalize_norm_name  # noqa: E402
from hf_powernorm.hub import render_model_card, upload_saved_model  # noqa: E402

logger = get_logger(__name__)
BEST_MODEL_DIR = "best_model"
PN_OPTIONS = ("powernorm_alpha_fwd", "powernorm_alpha_bkw", "powernorm_warmup_steps", "powernorm_group_num",
              "powernorm_backward_denominator")


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------

def _group_num(value: str) -> int | str:
    if value.lower() == "none":
        return "none"  # resolved to None (no group scaling) by `powernorm_overrides`
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {value!r}")
    return int(value)


def add_recipe_args(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """The arguments every recipe shares; `defaults` are the script's own defaults."""
    _add_data_and_model_args(parser)
    _add_powernorm_args(parser)
    _add_training_args(parser)
    parser.set_defaults(**defaults)
    return parser


def _add_data_and_model_args(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", help="Hub dataset (needs network)")
    data.add_argument("--dataset_config", help="Hub dataset configuration")
    data.add_argument("--train_file")
    data.add_argument("--validation_file")
    data.add_argument("--test_file")
    data.add_argument("--max_eval_samples", type=int, help="evaluate on the first N examples of each split")
    model = parser.add_argument_group("tokenizer and model")
    model.add_argument("--tokenizer_name", help="a saved tokenizer directory; default: train a BPE")
    model.add_argument("--vocab_size", type=int, default=500, help="BPE size (paper: 10k IWSLT, 37k WMT)")
    model.add_argument("--preset", help="a PowerNormTransformerConfig preset; default: a small model sized "
                                        "for the embedded corpus")
    model.add_argument("--config_overrides", help="config fields, e.g. 'hidden_size=64,encoder_layers=3'")
    model.add_argument("--norm_type", help="the norm of the script's model (any registry spelling, e.g. "
                                           "PowerNorm, layernorm): the encoder's for translation and "
                                           "classification, every norm for language modelling")
    model.add_argument("--encoder_norm_type", help="override the encoder norm (e.g. powernorm)")
    model.add_argument("--decoder_norm_type", help="override the decoder norm (e.g. layernorm)")
    model.add_argument("--dropout", type=float, help="residual dropout; default: the preset's")


def _add_powernorm_args(parser: argparse.ArgumentParser) -> None:
    norms = parser.add_argument_group("power normalization (default: the preset's values)")
    norms.add_argument("--powernorm_alpha_fwd", type=float, help="EMA factor of the forward statistic")
    norms.add_argument("--powernorm_alpha_bkw", type=float, help="EMA factor of the gradient statistic")
    norms.add_argument("--powernorm_warmup_steps", type=int,
                       help="updates using batch statistics (the config stores them as forward passes: "
                            "x --gradient_accumulation_steps); default: the preset's, else --warmup_steps")
    norms.add_argument("--powernorm_group_num", type=_group_num,
                       help="group scaling groups, or 'none'; default: one per attention head")
    norms.add_argument("--powernorm_backward_denominator", choices=("running", "batch"),
                       help="'running' (paper, eq. 12) or 'batch' (the reference code)")
    norms.add_argument("--sync_stats", action=argparse.BooleanOptionalAction, default=None,
                       help="sum PN/BN statistics over processes; default: on with several processes. "
                            "With --no-sync_stats each process keeps its own. Either way they are "
                            "averaged over the processes before the model is evaluated or saved")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    train = parser.add_argument_group("training")
    train.add_argument("--max_tokens", type=int, default=1024, help="padded tokens per batch and process")
    train.add_argument("--learning_rate", type=float, default=3e-3)
    train.add_argument("--warmup_steps", type=int, default=200)
    train.add_argument("--warmup_init_lr", type=float, default=1e-7)
    train.add_argument("--weight_decay", type=float, default=1e-4)
    train.add_argument("--clip_norm", type=float, default=0.0, help="max gradient norm; 0 disables")
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--num_train_epochs", type=int, default=20)
    train.add_argument("--max_train_steps", type=int, help="optimizer updates; overrides the epochs")
    train.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), help="default: accelerate config")
    train.add_argument("--cpu", action="store_true", help="train on CPU even if an accelerator is present")
    train.add_argument("--seed", type=int, default=1)
    train.add_argument("--checkpointing_steps", help="save the training state every N updates, or 'epoch'")
    train.add_argument("--resume_from_checkpoint", help="a step_<N> folder, or 'latest' in --output_dir")
    train.add_argument("--output_dir", default="outputs/run")
    train.add_argument("--with_tracking", action="store_true",
                       help="log loss, learning rate, tokens/s, validation and final scores to --report_to")
    train.add_argument("--report_to", default="tensorboard",
                       help="with --with_tracking: 'all' or comma-separated Accelerate trackers (tensorboard, "
                            "wandb, mlflow, ...); TensorBoard writes under --output_dir")
    hub = parser.add_argument_group("hub")
    hub.add_argument("--push_to_hub", action="store_true",
                     help="upload the export (weights with statistics, config, code, tokenizer, card, results); "
                          "the repository is created before training")
    hub.add_argument("--hub_model_id", help="ORG/NAME on the Hub, also the card's name; default: the output "
                                            "folder's name")
    hub.add_argument("--hub_private_repo", action="store_true", help="create the repository private")
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval_steps", type=int, help="validate every N updates; default: each epoch")
    evaluation.add_argument("--patience", type=int, help="stop after N validations without improvement")
    evaluation.add_argument("--eval_batch_size", type=int, default=32)


def check_args(args: argparse.Namespace,
               norm_options: Iterable[str] = ("norm_type", "encoder_norm_type", "decoder_norm_type")) -> None:
    """Fail before any data is read: unknown preset or norm, missing or empty file, bad counts."""
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset!r} is unknown; valid presets: {sorted(PRESETS)}")
    for option in norm_options:
        value = getattr(args, option)
        if value is not None:
            try:
                setattr(args, option, normalize_norm_name(value))
            except ValueError as error:
                raise ValueError(f"--{option}: {error}") from None
    for option in ("train_file", "validation_file", "test_file", "tokenizer_name", "phrasebank_file"):
        path = getattr(args, option, None)
        if path and not _data_path_exists(Path(path)):
            raise FileNotFoundError(f"--{option} {path}: not found")
        # `datasets` fails on an empty file with a generic generation error: name the split here.
        if path and Path(path).is_file() and not _has_rows(Path(path)):
            split = "train" if option == "phrasebank_file" else option.removesuffix("_file")
            raise ValueError(f"split {split!r} is empty: --{option} {path} has no data")
    if args.checkpointing_steps not in (None, "epoch") and not (
            args.checkpointing_steps.isdigit() and int(args.checkpointing_steps) > 0):
        raise ValueError(f"--checkpointing_steps must be a positive integer or 'epoch'; "
                         f"got {args.checkpointing_steps!r}")
    for option in ("gradient_accumulation_steps", "max_tokens", "eval_batch_size", "eval_steps", "patience",
                   "max_eval_samples", "max_train_steps", "num_train_epochs", "warmup_steps"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option} must be at least 1; got {value}")
    if args.with_tracking:
        args.report_to = _check_trackers(args.report_to)
    if args.push_to_hub:
        _check_hub_access()


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
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    return len(lines) > (1 if path.suffix == ".csv" else 0)


def powernorm_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config fields from the PN options that were given (the preset's values otherwise)."""
    overrides = {name: getattr(args, name) for name in PN_OPTIONS if getattr(args, name) is not None}
    if overrides.get("powernorm_group_num") == "none":
        overrides["powernorm_group_num"] = None
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    return overrides


def build_config(args: argparse.Namespace, tokenizer: Any, num_processes: int, default_size: dict[str, Any],
                 max_length: int, **fields: Any) -> PowerNormTransformerConfig:
    """The model config: `--preset` (else "tiny" resized by `default_size`), the tokenizer's ids,
    `fields`, the PN options and dropout, `--encoder/decoder_norm_type`, then `--config_overrides`.

    PN's warmup follows the learning-rate warmup unless given, and is stored in the config as
    training forward passes (updates x `--gradient_accumulation_steps`); statistics are
    synchronised across processes with `--sync_stats` (default: when there are several processes).
    """
    norms = {k: getattr(args, k) for k in ("encoder_norm_type", "decoder_norm_type") if getattr(args, k)}
    base = default_size if args.preset is None else {}
    config = PowerNormTransformerConfig.from_preset(
        args.preset or "tiny", **{**base, **fields, **powernorm_overrides(args), **norms},
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id)
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    # The options count updates; PN counts training forward passes, one per micro-batch.
    if args.powernorm_warmup_steps is not None:
        config.powernorm_warmup_steps = args.powernorm_warmup_steps * args.gradient_accumulation_steps
    elif config.powernorm_warmup_steps == 0:
        config.powernorm_warmup_steps = args.warmup_steps * args.gradient_accumulation_steps
    config.powernorm_sync_stats = (config.powernorm_sync_stats or num_processes > 1) if args.sync_stats is None \
        else args.sync_stats
    config.max_position_embeddings = max(config.max_position_embeddings, max_length + 2)
    config.validate_powernorm_transformer()
    return config


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------

def make_accelerator(args: argparse.Namespace) -> Accelerator:
    """The Accelerator, logging, seed and output folder. Without synchronised statistics DDP must
    not overwrite the other ranks' buffers with rank 0's at every forward: each process keeps its
    own, and `average_buffers_across_processes` merges them before evaluating or saving."""
    handlers = [DistributedDataParallelKwargs(broadcast_buffers=False)] if args.sync_stats is False else []
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with=args.report_to if args.with_tracking else None, project_dir=args.output_dir,
                              kwargs_handlers=handlers)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    set_seed(args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    return accelerator


def start_run(accelerator: Accelerator, args: argparse.Namespace, name: str) -> None:
    """Before training: create the Hub repository (`--push_to_hub`), so that a bad token or name
    fails now, and start the trackers (`--with_tracking`) with the run's arguments."""
    if args.push_to_hub and accelerator.is_main_process:
        repo = huggingface_hub.HfApi().create_repo(args.hub_model_id or Path(args.output_dir).resolve().name,
                                                   private=args.hub_private_repo or None, exist_ok=True)
        args.hub_model_id = repo.repo_id
        logger.info(f"pushing the export to {repo}", main_process_only=True)
    if args.with_tracking:
        config = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()
                  if v is not None}
        accelerator.init_trackers(name, config)


def norm_types(model: torch.nn.Module) -> dict[str, int]:
    """How many norm layers of each class the model holds (for the start-of-run log)."""
    classes = tuple(NORM_CLASSES.values())
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, classes):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts


def log_run_start(accelerator: Accelerator, args: argparse.Namespace, model: torch.nn.Module,
                  data_summary: str) -> None:
    """The arguments, the model config, the data, the parameter count, the norms and the number of
    processes."""
    options = {k: v for k, v in sorted(vars(args).items()) if v is not None}
    logger.info(f"arguments: {options}", main_process_only=True)
    logger.info(f"model config: {model.config.to_diff_dict()}", main_process_only=True)
    logger.info(f"{data_summary}, {model.num_parameters():,} parameters, norms {norm_types(model)}, "
                f"{accelerator.num_processes} process(es)", main_process_only=True)


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------

def train_loader(dataset: Any, collate: ru.PaddingCollator, max_tokens: int, seed: int,
                 length_columns: tuple[str, ...] = ("input_ids",)) -> tuple[DataLoader, ru.TokenBudgetBatchSampler]:
    """Token-budget batches (the longest of `length_columns` counts); Accelerate deals them out to
    the processes, so the sampler has one replica here. Returns the loader and its sampler (for
    `set_epoch`)."""
    sampler = ru.TokenBudgetBatchSampler(ru.sequence_lengths(dataset, length_columns), max_tokens, seed=seed)
    # Its own generator: a DataLoader draws a seed at each `iter()`, which from the global RNG would
    # shift dropout after a resume (the resumed run starts an iterator where the unbroken one did not).
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, generator=generator), sampler


def eval_loader(dataset: Any, collate: ru.PaddingCollator, batch_size: int,
                max_samples: int | None = None) -> DataLoader:
    """Sequential batches of an evaluation split, cut to its first `max_samples` examples."""
    if max_samples:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate)


# ---------------------------------------------------------------------------------------------
# Best model and early stopping
# ---------------------------------------------------------------------------------------------

@dataclass
class EarlyStopping:
    """Best validation score and evaluations since it improved; saved with the training state
    (`accelerator.register_for_checkpointing`) so a resumed run stops where an unbroken one would."""

    mode: str = "min"  # "min" for perplexity, "max" for accuracy and BLEU
    patience: int | None = None
    best: float | None = None
    best_step: int | None = None
    bad_evaluations: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {self.mode!r}")

    def update(self, value: float, step: int) -> bool:
        """Record one evaluation; True if it is the best so far."""
        better = self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        if better:
            self.best, self.best_step, self.bad_evaluations = value, step, 0
        else:
            self.bad_evaluations += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.bad_evaluations >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.bad_evaluations = state["best"], state["best_step"], state["bad_evaluations"]


# ---------------------------------------------------------------------------------------------
# Statistics across processes
# ---------------------------------------------------------------------------------------------

def average_buffers_across_processes(accelerator: Accelerator, model: torch.nn.Module) -> int:
    """Replace every rank's floating-point buffers (running statistics) by their mean over the
    ranks; return how many buffers that is. Integer buffers (step counters) are the same on every
    rank and are left alone. With synchronised statistics this changes nothing."""
    buffers = [b for b in accelerator.unwrap_model(model).buffers() if b.is_floating_point()]
    if accelerator.num_processes > 1 and dist.is_initialized():
        with torch.no_grad():
            for buffer in buffers:
                total = buffer.to(torch.float64, copy=True)
                dist.all_reduce(total, op=dist.ReduceOp.SUM)
                buffer.copy_(total / accelerator.num_processes)
    return len(buffers)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def save_checkpoint(accelerator: Accelerator, args: argparse.Namespace, model: torch.nn.Module, tokenizer: Any,
                    completed_steps: int) -> Path:
    """`save_state` to `<output_dir>/step_<N>` with process-averaged statistics, plus config and
    tokenizer so that averaged checkpoints load with `from_pretrained` (`average_checkpoints.py`)."""
    average_buffers_across_processes(accelerator, model)
    folder = Path(args.output_dir) / f"step_{completed_steps}"
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def resume(accelerator: Accelerator, args: argparse.Namespace, batches_per_epoch: int) -> tuple[int, int, int]:
    """Load `--resume_from_checkpoint`; return (completed updates, epoch, batches to skip in it)."""
    path = args.resume_from_checkpoint
    if path == "latest":
        path = ru.latest_checkpoint(args.output_dir, prefix="step")
        if path is None:
            raise ValueError(f"--resume_from_checkpoint latest: no step_* checkpoint in {args.output_dir}")
    name = Path(path).name
    if not name.startswith("step_") or not name.removeprefix("step_").isdigit():
        raise ValueError(f"--resume_from_checkpoint {path}: expected a step_<N> folder written by a recipe")
    accelerator.print(f"Resuming from {path}")
    accelerator.load_state(str(path))
    completed = int(name.removeprefix("step_"))
    batches = completed * args.gradient_accumulation_steps
    return completed, batches // batches_per_epoch, batches % batches_per_epoch


def save_best_model(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | Path) -> None:
    """The current weights and statistics (averaged over processes by the caller) in
    `output_dir/best_model`."""
    accelerator.unwrap_model(model).save_pretrained(
        Path(output_dir) / BEST_MODEL_DIR, is_main_process=accelerator.is_main_process,
        save_function=accelerator.save)
    accelerator.wait_for_everyone()


def load_best_model(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | Path) -> None:
    """Put the weights of `output_dir/best_model` back into `model` (every process)."""
    accelerator.wait_for_everyone()
    state = load_file(str(Path(output_dir) / BEST_MODEL_DIR / "model.safetensors"))
    unwrapped = accelerator.unwrap_model(model)
    result = unwrapped.load_state_dict(state, strict=False)
    # Tied copies (embeddings, output projection) are not written: they share a loaded tensor.
    current = unwrapped.state_dict()
    loaded = {current[k].data_ptr() for k in state if k in current}
    missing = [k for k in result.missing_keys if current[k].data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        raise ValueError(f"{output_dir}/{BEST_MODEL_DIR} does not match the model: missing {missing}, "
                         f"unexpected {result.unexpected_keys}")


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]
EvalFn = Callable[[], float]


def _due(every: str | int | None, completed: int) -> bool:
    return every is not None and str(every).isdigit() and completed % int(every) == 0


def _log_update(args: argparse.Namespace, accelerator: Accelerator, progress: tqdm, step: int, loss: float,
                lr: float, tokens_per_second: float) -> None:
    progress.update(1)
    progress.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:.0f}")
    if args.with_tracking:
        accelerator.log({"train_loss": loss, "lr": lr, "tokens_per_second": tokens_per_second}, step=step)


def _validate(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module,
              evaluate: EvalFn | None, stopper: EarlyStopping | None, step: int) -> bool:
    """Evaluate, keep the best model; True when training should stop."""
    if evaluate is None or stopper is None:
        return False
    average_buffers_across_processes(accelerator, model)  # every rank evaluates the model that is saved
    score = evaluate()
    if stopper.update(score, step):
        save_best_model(accelerator, model, args.output_dir)
    accelerator.print(f"step {step}: validation {score:.4f} (best {stopper.best:.4f} at step {stopper.best_step})")
    if args.with_tracking:
        accelerator.log({"validation": score}, step=step)
    return stopper.should_stop


def _epoch_batches(accelerator: Accelerator, loader: DataLoader, sampler: Any | None, epoch: int,
                   skip: int) -> Iterable[dict[str, torch.Tensor]]:
    """The batches of `epoch` (its own shuffle), without the first `skip` ones (a resumed run)."""
    if sampler is not None:
        sampler.set_epoch(epoch)
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    return accelerator.skip_first_batches(loader, skip) if skip else loader


def _micro_step(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, loss_fn: LossFn, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward and backward of one micro-batch; at the end of an accumulation, clipping and the
    optimizer step (Accelerate skips them in between)."""
    with accelerator.accumulate(model):
        loss = loss_fn(model, batch)
        accelerator.backward(loss)
        if accelerator.sync_gradients and args.clip_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), args.clip_norm)
        optimizer.step()
        optimizer.zero_grad()
    return loss


def train(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer, scheduler: Any, loader: DataLoader, loss_fn: LossFn, *,
          sampler: Any | None = None, evaluate: EvalFn | None = None, stopper: EarlyStopping | None = None,
          tokenizer: Any) -> int:
    """Train until `args.max_train_steps` updates (else `args.num_train_epochs`) or early stopping.

    `loss_fn(model, batch)` returns the loss of one micro-batch. `evaluate()` returns the
    validation score that `stopper` tracks; it runs every `args.eval_steps` updates (else at the
    end of each epoch) and after the last update, on statistics averaged over the processes, and
    each new best is written to `output_dir/best_model`. The scheduler and `stopper` must be
    registered for checkpointing (`accelerator.register_for_checkpointing`). Returns the number of
    updates done.
    """
    updates_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    max_steps = args.num_train_epochs * updates_per_epoch if args.max_train_steps is None else args.max_train_steps
    completed, start_epoch, skip = 0, 0, 0
    if args.resume_from_checkpoint:
        completed, start_epoch, skip = resume(accelerator, args, len(loader))
    progress = tqdm(total=max_steps, initial=completed, disable=not accelerator.is_local_main_process)
    tokens, started = 0, time.perf_counter()

    validate = partial(_validate, args, accelerator, model, evaluate, stopper)

    epochs = math.ceil(max_steps / max(updates_per_epoch, 1))
    # A run resumed from its last checkpoint has nothing left to do.
    for epoch in range(start_epoch if completed < max_steps else epochs, epochs):
        for batch in _epoch_batches(accelerator, loader, sampler, epoch, skip):
            loss = _micro_step(args, accelerator, model, optimizer, loss_fn, batch)
            tokens += int(batch["attention_mask"].sum())
            if not accelerator.sync_gradients:
                continue
            scheduler.step()  # one schedule step per update, whatever the number of processes
            completed += 1
            _log_update(args, accelerator, progress, completed, loss.item(), scheduler.get_last_lr()[0],
                        tokens / (time.perf_counter() - started))
            # The last update is always validated, so the best model is chosen over the whole run.
            stop = (_due(args.eval_steps, completed) or completed >= max_steps) and validate(completed)
            if _due(args.checkpointing_steps, completed):
                save_checkpoint(accelerator, args, model, tokenizer, completed)
            if stop or completed >= max_steps:
                progress.close()
                return completed
        skip = 0  # only the first epoch of a resumed run starts inside
        stop = args.eval_steps is None and validate(completed)
        if args.checkpointing_steps == "epoch":
            save_checkpoint(accelerator, args, model, tokenizer, completed)
        if stop:
            break
    progress.close()
    return completed


def finish_training(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | Path,
                    stopper: EarlyStopping | None, completed: int) -> dict[str, Any]:
    """Average the statistics over processes and put the best validated weights back in place;
    return the training summary for `all_results.json`."""
    average_buffers_across_processes(accelerator, model)
    summary: dict[str, Any] = {"train_steps": completed}
    if stopper is not None and stopper.best_step is not None:
        summary.update(best_step=stopper.best_step, best_validation=stopper.best)
        if stopper.best_step == completed:
            return summary
        if (Path(output_dir) / BEST_MODEL_DIR / "model.safetensors").is_file():
            load_best_model(accelerator, model, output_dir)
        else:
            logger.warning(f"no {BEST_MODEL_DIR} in {output_dir} (resumed elsewhere?): exporting the last "
                           f"model, not the best one of step {stopper.best_step}", main_process_only=True)
    return summary


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def training_command(script: str, argv: list[str] | None) -> str:
    """The command line of this run, as it would be typed."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["accelerate launch", script, *map(shlex.quote, args)])


def save_outputs(accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace,
                 results: dict[str, Any], card_kwargs: dict[str, Any]) -> None:
    """`save_pretrained` (weights, config, code files), tokenizer, `all_results.json` and the model
    card `README.md` in `args.output_dir`, with the run's float metrics and `card_kwargs` for
    `render_model_card`; the metrics go to the trackers, the export to the Hub with `--push_to_hub`.
    Ends the run (`end_training`)."""
    output_dir = args.output_dir
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
        ru.save_json(Path(output_dir) / "all_results.json", results)
        scores = {k: round(v, 4) for k, v in results.items() if isinstance(v, float) and math.isfinite(v)}
        card = render_model_card(unwrapped, results=scores, with_tokenizer=True, **card_kwargs)
        card.save(Path(output_dir) / "README.md")
    if args.with_tracking:
        accelerator.log({k: v for k, v in results.items() if isinstance(v, (int, float))},
                        step=results.get("train_steps"))
    if args.push_to_hub and accelerator.is_main_process:
        try:
            commit = upload_saved_model(output_dir, args.hub_model_id, commit_message=f"Upload PowerNorm "
                                        f"Transformer ({results.get('train_steps')} updates)")
        except Exception as error:
            raise RuntimeError(f"uploading to {args.hub_model_id} failed ({error}); the export in {output_dir} "
                               f"is complete: upload it again with hf_powernorm.hub.upload_saved_model") from error
        logger.info(f"pushed {output_dir} to {commit.commit_url}", main_process_only=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()
