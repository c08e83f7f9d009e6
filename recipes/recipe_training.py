"""Training with validation: the task-independent loop of `train_lm.py` and `train_classification.py`.

It builds on the Accelerate helpers of `recipe_utils.py` (common arguments, tokenizer and config
set-up, `save_state` checkpoints and `resume`) and adds what a recipe with a validation score needs
(Shen et al., ICML 2020, Section 5 and Appendix A):

- the command-line options of Power Normalization (Algorithm 2: `alpha_fwd`, `alpha_bkw`, warmup,
  group scaling, backward denominator, statistics synchronised across processes or not), dropout,
  evaluation interval and patience,
- `train`: an Accelerate loop around a loss callback, with gradient accumulation, a tqdm bar,
  tracking, periodic evaluation, best-model tracking and early stopping, and checkpoints that
  resume exactly (`save_state`/`load_state` + `skip_first_batches`),
- `average_buffers_across_processes`: PN's running statistics made identical on every rank before
  they are saved, so a saved model never depends on which process wrote it,
- `save_outputs`: `save_pretrained`, tokenizer, `all_results.json` and the model card with the
  command as given (`main(argv)` in-process too),
- `train_loader`: token-budget batches whose loader has its own seeded generator, so that dropout
  continues exactly after a resume.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_utils as ru  # noqa: E402

from hf_powernorm import PRESETS, PowerNormTransformerConfig, normalize_norm_name  # noqa: E402
from hf_powernorm.hub import render_model_card  # noqa: E402

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
    """`recipe_utils.add_common_args` plus `--norm_type`, every PowerNorm option (default: the
    preset's value), dropout, evaluation and early stopping; `defaults` are the script's defaults."""
    ru.add_common_args(parser)
    model = parser.add_argument_group("norms")
    model.add_argument("--norm_type", help="the model's norm (any registry spelling, e.g. PowerNorm, layernorm)")
    model.add_argument("--dropout", type=float, help="residual dropout; default: the preset's")
    model.add_argument("--powernorm_alpha_fwd", type=float, help="EMA factor of the forward statistic")
    model.add_argument("--powernorm_alpha_bkw", type=float, help="EMA factor of the gradient statistic")
    model.add_argument("--powernorm_warmup_steps", type=int,
                       help="updates using batch statistics; default: the preset's, else --warmup_steps")
    model.add_argument("--powernorm_group_num", type=_group_num,
                       help="group scaling groups, or 'none'; default: one per attention head")
    model.add_argument("--powernorm_backward_denominator", choices=("running", "batch"),
                       help="'running' (paper, eq. 12) or 'batch' (the reference code)")
    model.add_argument("--sync_stats", action=argparse.BooleanOptionalAction, default=None,
                       help="sum PN/BN statistics over processes; default: on with several processes. "
                            "With --no-sync_stats each process keeps its own and they are averaged "
                            "before saving")
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval_steps", type=int, help="validate every N updates; default: each epoch")
    evaluation.add_argument("--patience", type=int, help="stop after N validations without improvement")
    evaluation.add_argument("--eval_batch_size", type=int, default=32)
    parser.set_defaults(**defaults)
    return parser


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
        if path and not Path(path).exists():
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
                   "max_eval_samples"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option} must be at least 1; got {value}")


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
    """`recipe_utils.build_config` with the PN options and dropout of the command line, and
    `--sync_stats`/`--no-sync_stats` (default: synchronised with several processes, as there)."""
    config = ru.build_config(args, tokenizer, num_processes, default_size, max_length,
                             **{**fields, **powernorm_overrides(args)})
    config.powernorm_sync_stats = num_processes > 1 if args.sync_stats is None else args.sync_stats
    config.validate_powernorm_transformer()
    return config


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------

def make_accelerator(args: argparse.Namespace) -> Accelerator:
    """The Accelerator, logging and seed. Without synchronised statistics DDP must not overwrite
    the other ranks' buffers with rank 0's at every forward: each process keeps its own, and
    `average_buffers_across_processes` merges them before saving."""
    handlers = [DistributedDataParallelKwargs(broadcast_buffers=False)] if args.sync_stats is False else []
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="all" if args.with_tracking else None, project_dir=args.output_dir,
                              kwargs_handlers=handlers)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    set_seed(args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    return accelerator


def norm_types(model: torch.nn.Module) -> dict[str, int]:
    """How many norm layers of each class the model holds (for the start-of-run log)."""
    from hf_powernorm import NORM_CLASSES

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
# Best model and early stopping
# ---------------------------------------------------------------------------------------------

@dataclass
class EarlyStopping:
    """Best validation score and evaluations since it improved; saved with the training state
    (`accelerator.register_for_checkpointing`) so a resumed run stops where an unbroken one would."""

    mode: str = "min"  # "min" for perplexity, "max" for accuracy
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

def averaged_buffers(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's floating-point buffers (running statistics) averaged over the processes.

    Integer buffers (step counters) are the same on every rank and are left out.
    """
    unwrapped = accelerator.unwrap_model(model)
    buffers = {name: b for name, b in unwrapped.named_buffers() if b.is_floating_point()}
    if accelerator.num_processes == 1 or not dist.is_initialized():
        return {name: b.detach().clone() for name, b in buffers.items()}
    out = {}
    for name, buffer in buffers.items():
        total = buffer.detach().double().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        out[name] = (total / accelerator.num_processes).to(buffer.dtype)
    return out


def average_buffers_across_processes(accelerator: Accelerator, model: torch.nn.Module) -> int:
    """Replace every rank's running statistics by their mean over the ranks; return how many
    buffers were averaged. With synchronised statistics this changes nothing."""
    averaged = averaged_buffers(accelerator, model)
    unwrapped = dict(accelerator.unwrap_model(model).named_buffers())
    with torch.no_grad():
        for name, value in averaged.items():
            unwrapped[name].copy_(value)
    return len(averaged)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def save_best_model(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | Path) -> None:
    """The current weights with process-averaged statistics in `output_dir/best_model`."""
    state = accelerator.unwrap_model(model).state_dict()
    state.update(averaged_buffers(accelerator, model))
    accelerator.unwrap_model(model).save_pretrained(
        Path(output_dir) / BEST_MODEL_DIR, state_dict=state, is_main_process=accelerator.is_main_process,
        save_function=accelerator.save)
    accelerator.wait_for_everyone()


def load_best_model(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | Path) -> None:
    """Put the weights of `output_dir/best_model` back into `model` (every process)."""
    accelerator.wait_for_everyone()
    state = load_file(str(Path(output_dir) / BEST_MODEL_DIR / "model.safetensors"))
    unwrapped = accelerator.unwrap_model(model)
    result = unwrapped.load_state_dict(state, strict=False)
    tied = getattr(unwrapped, "_tied_weights_keys", None) or {}  # tied copies are not written
    missing = [k for k in result.missing_keys if k not in tied]
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


def train(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer, scheduler: Any, loader: DataLoader, loss_fn: LossFn, *,
          sampler: Any | None = None, evaluate: EvalFn | None = None, stopper: EarlyStopping | None = None,
          tokenizer: Any) -> int:
    """Train until `args.max_train_steps` updates (else `args.num_train_epochs`) or early stopping.

    `loss_fn(model, batch)` returns the loss of one micro-batch. `evaluate()` returns the
    validation score that `stopper` tracks; it runs every `args.eval_steps` updates (else at the
    end of each epoch) and after the last update, and each new best is written to
    `output_dir/best_model`. The scheduler and `stopper` must be registered for checkpointing
    (`accelerator.register_for_checkpointing`). Returns the number of updates done.
    """
    updates_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    max_steps = args.num_train_epochs * updates_per_epoch if args.max_train_steps is None else args.max_train_steps
    completed, start_epoch, skip = 0, 0, 0
    if args.resume_from_checkpoint:
        completed, start_epoch, skip = ru.resume(accelerator, args, len(loader))
    progress = tqdm(total=max_steps, initial=completed, disable=not accelerator.is_local_main_process)
    tokens, started = 0, time.perf_counter()

    def validate() -> bool:
        """Evaluate, keep the best model; True when training should stop."""
        if evaluate is None or stopper is None:
            return False
        score = evaluate()
        if stopper.update(score, completed):
            save_best_model(accelerator, model, args.output_dir)
        accelerator.print(f"step {completed}: validation {score:.4f} (best {stopper.best:.4f} "
                          f"at step {stopper.best_step})")
        if args.with_tracking:
            accelerator.log({"validation": score}, step=completed)
        return stopper.should_stop

    for epoch in range(start_epoch, math.ceil(max_steps / max(updates_per_epoch, 1))):
        if sampler is not None:
            sampler.set_epoch(epoch)
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.clip_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip_norm)
                optimizer.step()
                optimizer.zero_grad()
            tokens += int(batch["attention_mask"].sum())
            if not accelerator.sync_gradients:
                continue
            scheduler.step()  # one schedule step per update, whatever the number of processes
            completed += 1
            progress.update(1)
            lr = scheduler.get_last_lr()[0]
            progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}",
                                 tok_s=f"{tokens / (time.perf_counter() - started):.0f}")
            if args.with_tracking:
                accelerator.log({"train_loss": loss.item(), "lr": lr}, step=completed)
            # The last update is always validated, so the best model is chosen over the whole run.
            stop = (_due(args.eval_steps, completed) or completed >= max_steps) and validate()
            if _due(args.checkpointing_steps, completed):
                ru.save_checkpoint(accelerator, args, model, tokenizer, completed)
            if stop or completed >= max_steps:
                progress.close()
                return completed
        stop = args.eval_steps is None and validate()
        if args.checkpointing_steps == "epoch":
            ru.save_checkpoint(accelerator, args, model, tokenizer, completed)
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
        if (Path(output_dir) / BEST_MODEL_DIR / "model.safetensors").is_file() and stopper.best_step != completed:
            load_best_model(accelerator, model, output_dir)
    return summary


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def training_command(script: str, argv: list[str] | None) -> str:
    """The command line of this run, as it would be typed."""
    import shlex

    args = sys.argv[1:] if argv is None else argv
    return " ".join(["accelerate launch", script, *map(shlex.quote, args)])


def save_outputs(accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, output_dir: str | Path,
                 results: dict[str, Any], card_kwargs: dict[str, Any]) -> None:
    """`save_pretrained` (weights, config, code files), tokenizer, `all_results.json` and the model
    card `README.md` with the run's float metrics and `card_kwargs` for `render_model_card`."""
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
        ru.save_json(Path(output_dir) / "all_results.json", results)
        scores = {k: round(v, 4) for k, v in results.items() if isinstance(v, float) and math.isfinite(v)}
        card = render_model_card(unwrapped, results=scores, **card_kwargs)
        card.save(Path(output_dir) / "README.md")
    accelerator.wait_for_everyone()


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------

def train_loader(dataset: Any, pad_token_id: int, max_tokens: int,
                 seed: int) -> tuple[DataLoader, ru.TokenBudgetBatchSampler]:
    """Token-budget batches; Accelerate deals them out to the processes (so one replica here).

    As `recipe_utils.make_train_loader`, with the loader's own seeded generator (see below).
    """
    sampler = ru.TokenBudgetBatchSampler(ru.sequence_lengths(dataset, ("input_ids",)), max_tokens, seed=seed)
    # Its own generator: a DataLoader draws a seed at each `iter()`, which from the global RNG would
    # shift dropout after a resume (the resumed run starts an iterator where the unbroken one did not).
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=ru.PaddingCollator(pad_token_id),
                        generator=generator)
    return loader, sampler
