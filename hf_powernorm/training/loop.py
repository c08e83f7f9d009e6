"""The Accelerate training loop of the recipes and studies (the paper's Section 5 setting).

- `build_accelerator` / `prepare_output_dir` (`check_run_start`) / `start_run` / `log_run_start`:
  the `Accelerator`, the checks that need no data (output folder, checkpoint to resume and its
  configuration, batch budget) and the output folder, the Hub repository and trackers of a run, and
  its start-of-run log (`make_accelerator`: the first two);
- `train`: the update loop with gradient accumulation, clipping, a tqdm bar, the JSON-lines log
  (`run_log.py`), tracking, validation every `--eval_steps` (else every epoch) and after the last
  update, the best model in `output_dir/best_model`, early stopping after `--patience`
  validations without improvement, and atomic checkpoints that resume exactly (`load_state` +
  `skip_first_batches`, batches shuffled by (seed, epoch) alone; schedule, early stopping and
  sampler as JSON), the newest `--checkpoints_total_limit` of them kept, and with
  `--record_norm_stats N` what every norm layer sees every N updates (`instrumentation.py`);
- `finish_training`: statistics averaged over the processes and the best model put back.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..instrumentation import NormStatisticsRecorder
from .arguments import DATA_FILE_OPTIONS, MODEL_PATH_OPTIONS, check_batch_budget
from .atomic_files import clear_folder
from .checkpoints import (
    BEST_MODEL_DIR,
    average_buffers_across_processes,
    best_model_step,
    check_output_dir,
    corrupt_checkpoints,
    load_best_model,
    prune_checkpoints,
    resume_options,
    save_best_model,
    save_checkpoint,
    scheduler_state,
)
from .batching import PaddingCollator, eval_loader, train_loader
from .locking import LOCK_NAME
from .models import norm_types
from .optimization import build_optimizer, build_scheduler
from .options import BadInput
from .resuming import check_resume_model, check_resume_options, resolve_resume_path, resume
from .run_log import RunLog, drop_records_after

logger = get_logger(__name__)

LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]
EvalFn = Callable[[], float]
UpdateHook = Callable[[int, float], None]
NORM_STATS_NAME = "norm_stats.jsonl"


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------

def make_accelerator(args: argparse.Namespace, input_options: Sequence[str] = DATA_FILE_OPTIONS) -> Accelerator:
    """`build_accelerator`, then `prepare_output_dir`: what a run needs before reading any data."""
    accelerator = build_accelerator(args)
    prepare_output_dir(accelerator, args, input_options)
    return accelerator


def build_accelerator(args: argparse.Namespace) -> Accelerator:
    """The Accelerator of the run, logging and the seed. Without synchronised statistics DDP must not
    overwrite the other ranks' buffers with rank 0's at every forward: each process keeps its own,
    and `average_buffers_across_processes` merges them before evaluating or saving."""
    handlers = [DistributedDataParallelKwargs(broadcast_buffers=False)] if args.sync_stats is False else []
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with=args.report_to if args.with_tracking else None, project_dir=args.output_dir,
                              kwargs_handlers=handlers)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    quiet_other_processes(accelerator)
    set_seed(args.seed)
    return accelerator


def quiet_other_processes(accelerator: Accelerator) -> None:
    """Transformers' and Datasets' warnings and progress bars (a tokenizer's map, `convert_norms`'
    calibration) on one process per machine, not once per rank, as Transformers' example scripts do."""
    if accelerator.is_local_main_process:
        return
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def prepare_output_dir(accelerator: Accelerator, args: argparse.Namespace,
                       input_options: Sequence[str] = DATA_FILE_OPTIONS) -> bool:
    """`check_run_start`, then the output folder: cleared first with `--overwrite_output_dir`, or
    when it was to be resumed but every checkpoint failed its hash (but for those set aside); created.
    Returns whether the run starts it empty (not resuming the run it holds)."""
    asked_to_resume = bool(args.resume_from_checkpoint)
    check_run_start(accelerator, args, input_options)
    output_dir = Path(args.output_dir)
    fresh = not args.resume_from_checkpoint
    if accelerator.is_main_process:
        if args.overwrite_output_dir and output_dir.is_dir():
            clear_folder(output_dir, keep=(LOCK_NAME,))  # the lock of this run, held by `hold_output_folder`
        elif asked_to_resume and fresh:  # every checkpoint set aside: start over, keeping them to look into
            clear_folder(output_dir, keep=(LOCK_NAME, *(path.name for path in corrupt_checkpoints(output_dir))))
        output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    return fresh


def check_run_start(accelerator: Accelerator, args: argparse.Namespace,
                    input_options: Sequence[str] = DATA_FILE_OPTIONS) -> None:
    """The checks that need no data, before any is read or anything written: the batch budget
    against the maximum lengths, the output folder (`check_output_dir`), and the checkpoint to
    resume: complete, and of this run's command-line configuration and tokenizer.
    `args.resume_from_checkpoint` becomes the checkpoint's path (`latest` resolved), or None where
    every checkpoint was set aside (`resolve_resume_path`): the run starts over."""
    check_batch_budget(args)
    resume_from = args.resume_from_checkpoint
    if resume_from and not args.do_train:
        raise BadInput("--resume_from_checkpoint continues training; it does not go with --no-do_train")
    check_output_dir(args.output_dir, overwrite=args.overwrite_output_dir, resume=resume_from,
                     inputs=[vars(args)[name] for name in (*input_options, *MODEL_PATH_OPTIONS, "model_name_or_path")])
    if resume_from:
        with accelerator.main_process_first():  # the main process sets aside what fails its hash
            path = resolve_resume_path(resume_from, args.output_dir, report=accelerator.print,
                                       set_aside_corrupt=accelerator.is_main_process)
        if path is not None:
            check_resume_options(path, args)
        args.resume_from_checkpoint = None if path is None else str(path)


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


def log_run_start(accelerator: Accelerator, args: argparse.Namespace, model: torch.nn.Module,
                  data_summary: str) -> None:
    """The arguments, the model config, the data, the parameter count, the norms and the number of
    processes."""
    options = {k: v for k, v in sorted(vars(args).items()) if v is not None}
    logger.info(f"arguments: {options}", main_process_only=True)
    logger.info(f"model config: {model.config.to_diff_dict()}", main_process_only=True)
    logger.info(f"{data_summary}, {model.num_parameters():,} parameters, norms {norm_types(model)}, "
                f"{accelerator.num_processes} process(es)", main_process_only=True)


def max_update_steps(args: argparse.Namespace, batches_per_epoch: int) -> int:
    """Optimizer updates of the run: `--max_train_steps`, else `--num_train_epochs` epochs of
    `batches_per_epoch` batches (this process's share of them)."""
    if args.max_train_steps is not None:
        return args.max_train_steps
    return args.num_train_epochs * math.ceil(batches_per_epoch / args.gradient_accumulation_steps)


# ---------------------------------------------------------------------------------------------
# Best model and early stopping
# ---------------------------------------------------------------------------------------------

@dataclass
class EarlyStopping:
    """Best validation score and evaluations since it improved; saved as JSON in each checkpoint's
    `training_state.json`, so a resumed run stops where an unbroken one would."""

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


@dataclass
class DataSeen:
    """The training data a run has taken: its real tokens (this process's) and a SHA-256 chained over
    the token ids of its first `FIRST_BATCHES` micro-batches (the data order: two runs of one seed
    agree). Kept in each checkpoint's `training_state.json`, so a resumed run reports an unbroken one's."""

    FIRST_BATCHES = 8
    tokens: int = 0
    batches: int = 0
    first_batches_sha256: str = ""

    def add(self, batch: dict[str, torch.Tensor], tokens: int) -> None:
        """Count one micro-batch of `tokens` real tokens (its mask's sum, taken once by the loop)."""
        self.tokens += tokens
        if self.batches < self.FIRST_BATCHES:
            ids = batch["input_ids"].detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
            self.first_batches_sha256 = hashlib.sha256(self.first_batches_sha256.encode() + ids).hexdigest()
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "batches": self.batches, "first_batches_sha256": self.first_batches_sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens, self.batches = state["tokens"], state["batches"]
        self.first_batches_sha256 = state["first_batches_sha256"]


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

@dataclass
class _Progress:
    """What the loop reports: the bar, the run's log, the trackers, tokens/s."""

    args: argparse.Namespace
    accelerator: Accelerator
    bar: tqdm
    run_log: RunLog
    on_update: UpdateHook | None
    tokens: int = 0
    started: float = 0.0

    def update(self, step: int, epoch: int, loss: float, lr: float) -> None:
        tokens_per_second = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:.0f}")
        self.run_log.write(step=step, epoch=epoch, loss=loss, learning_rate=lr, tokens_per_second=tokens_per_second)
        if self.args.with_tracking:
            self.accelerator.log({"train_loss": loss, "lr": lr, "tokens_per_second": tokens_per_second}, step=step)
        if self.on_update is not None:
            self.on_update(step, loss)


@dataclass
class _Checkpoints:
    """Writes the checkpoints of a run: the training state with the loop's own state as JSON
    (schedule, early stopping, sampler), then the oldest complete ones beyond
    `--checkpoints_total_limit` removed, never the one the run resumed from."""

    args: argparse.Namespace
    accelerator: Accelerator
    model: torch.nn.Module
    tokenizer: Any
    scheduler: Any
    stopper: EarlyStopping | None
    sampler: Any | None
    batches_per_epoch: int
    seen: DataSeen | None = None
    resumed_from: Path | None = None

    def save(self, step: int, epoch: int) -> None:
        state = {"epoch": epoch, "scheduler": scheduler_state(self.scheduler),
                 "early_stopping": self.stopper.state_dict() if self.stopper is not None else None,
                 "data_seen": self.seen.state_dict() if self.seen is not None else None,
                 "sampler": {"seed": getattr(self.sampler, "seed", self.args.seed), "epoch": epoch,
                             "batches_per_epoch": self.batches_per_epoch}}
        save_checkpoint(self.accelerator, self.args.output_dir, self.model, self.tokenizer, step,
                        training_state=state, options=resume_options(self.args))
        limit = getattr(self.args, "checkpoints_total_limit", None)
        if limit is not None and self.accelerator.is_main_process:
            protect = [self.resumed_from] if self.resumed_from is not None else []
            prune_checkpoints(self.args.output_dir, limit, protect=protect)
        self.accelerator.wait_for_everyone()

    def resume(self, resume_from: str, gradient_accumulation_steps: int) -> tuple[int, int, int]:
        """Check and load the checkpoint folder `resume_from` (`check_run_start` resolved `latest`);
        return (completed updates, epoch, batches to skip in it)."""
        path = Path(resume_from)
        check_resume_model(path, self.accelerator.unwrap_model(self.model), self.tokenizer)
        completed, epoch, skip, state = resume(self.accelerator, path, gradient_accumulation_steps,
                                               self.batches_per_epoch, self.scheduler, self.stopper)
        saved = state.get("sampler", {}).get("batches_per_epoch", self.batches_per_epoch)
        if saved != self.batches_per_epoch:
            logger.warning(f"{path} was written with {saved} batches an epoch, the data gives {self.batches_per_epoch} "
                           f"now: the resumed run does not see the batches an unbroken one would",
                           main_process_only=True)
        self.resumed_from = path
        if self.seen is not None and state.get("data_seen") is not None:
            self.seen.load_state_dict(state["data_seen"])
        if self.accelerator.is_main_process:
            drop_records_after(self.args.output_dir, completed)
        return completed, epoch, skip


def _due(every: str | int | None, completed: int) -> bool:
    return every is not None and str(every).isdigit() and completed % int(every) == 0


def _validate(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module, evaluate: EvalFn | None,
              stopper: EarlyStopping | None, run_log: RunLog, step: int) -> bool:
    """Evaluate, keep the best model; True when training should stop."""
    if evaluate is None or stopper is None:
        return False
    average_buffers_across_processes(accelerator, model)  # every rank evaluates the model that is saved
    score = evaluate()
    if stopper.update(score, step):
        save_best_model(accelerator, model, args.output_dir, step, score)
    accelerator.print(f"step {step}: validation {score:.4f} (best {stopper.best:.4f} at step {stopper.best_step})")
    run_log.write(step=step, validation=score, best_validation=stopper.best, best_step=stopper.best_step)
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
                optimizer: torch.optim.Optimizer, loss_fn: LossFn, batch: dict[str, torch.Tensor],
                recorder: NormStatisticsRecorder, step: int) -> torch.Tensor:
    """Forward and backward of one micro-batch of update `step`, recorded when the recorder asks;
    at the end of an accumulation, clipping and the optimizer step (Accelerate skips them in between)."""
    with accelerator.accumulate(model):
        recorder.before_forward(step)
        loss = loss_fn(model, batch)
        accelerator.backward(loss)
        recorder.after_backward(step)
        if accelerator.sync_gradients and args.clip_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), args.clip_norm)
        optimizer.step()
        optimizer.zero_grad()
    return loss.detach()


# Over 50 lines: one loop in the order of an update, as Accelerate's examples write it.
def train(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer, scheduler: Any, loader: DataLoader, loss_fn: LossFn, *,
          sampler: Any | None = None, evaluate: EvalFn | None = None, stopper: EarlyStopping | None = None,
          tokenizer: Any, on_update: UpdateHook | None = None, seen: DataSeen | None = None) -> int:
    """Train until `max_update_steps(args, len(loader))` updates or early stopping; return the updates done.

    `loss_fn(model, batch)` returns the loss of one micro-batch. `evaluate()` returns the
    validation score that `stopper` tracks; it runs every `args.eval_steps` updates (else at the
    end of each epoch) and after the last update, on statistics averaged over the processes, and
    each new best is written to `output_dir/best_model`. Checkpoints hold the state of the
    scheduler and `stopper` as JSON (`_Checkpoints`). `on_update(step, loss)` is called after every
    update with the update's mean micro-batch loss; `seen` counts the data taken (`DataSeen`).
    """
    updates_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    max_steps = max_update_steps(args, len(loader))
    completed, start_epoch, skip = 0, 0, 0
    seen = seen if seen is not None else DataSeen()
    saver = _Checkpoints(args, accelerator, model, tokenizer, scheduler, stopper, sampler, len(loader), seen)
    if args.resume_from_checkpoint:
        completed, start_epoch, skip = saver.resume(args.resume_from_checkpoint, args.gradient_accumulation_steps)
    bar = tqdm(total=max_steps, initial=completed, disable=not accelerator.is_local_main_process)
    run_log = RunLog(args.output_dir, enabled=accelerator.is_main_process)
    progress = _Progress(args, accelerator, bar, run_log, on_update, started=time.perf_counter())
    validate = lambda step: _validate(args, accelerator, model, evaluate, stopper, run_log, step)  # noqa: E731

    epochs = math.ceil(max_steps / max(updates_per_epoch, 1))
    losses: list[torch.Tensor] = []
    model.train()  # `from_pretrained` returns a model in eval mode: no dropout, no statistics updates
    every = args.record_norm_stats if accelerator.is_main_process else 0
    recorder = NormStatisticsRecorder(accelerator.unwrap_model(model), every_n_steps=every,
                                      output_file=Path(args.output_dir) / NORM_STATS_NAME)
    # A run resumed from its last checkpoint has nothing left to do.
    for epoch in range(start_epoch if completed < max_steps else epochs, epochs):
        for batch in _epoch_batches(accelerator, loader, sampler, epoch, skip):
            losses.append(_micro_step(args, accelerator, model, optimizer, loss_fn, batch, recorder, completed + 1))
            tokens = int(batch["attention_mask"].sum())
            progress.tokens += tokens
            seen.add(batch, tokens)
            if not accelerator.sync_gradients:
                continue
            scheduler.step()  # one schedule step per update, whatever the number of processes
            completed += 1
            progress.update(completed, epoch, torch.stack(losses).mean().item(), scheduler.get_last_lr()[0])
            losses = []
            # The last update is always validated, so the best model is chosen over the whole run.
            stop = (_due(args.eval_steps, completed) or completed >= max_steps) and validate(completed)
            if _due(args.checkpointing_steps, completed):
                saver.save(completed, epoch)
            if stop or completed >= max_steps:
                bar.close()
                recorder.close()
                return completed
        skip = 0  # only the first epoch of a resumed run starts inside
        stop = args.eval_steps is None and validate(completed)
        if args.checkpointing_steps == "epoch":
            saver.save(completed, epoch)
        if stop:
            break
    bar.close()
    recorder.close()
    return completed


def finish_training(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | Path,
                    stopper: EarlyStopping | None, completed: int) -> dict[str, Any]:
    """Average the statistics over processes and put the best validated weights back in place;
    return the training summary for `train_results.json`."""
    average_buffers_across_processes(accelerator, model)
    summary: dict[str, Any] = {"train_steps": completed}
    if stopper is not None and stopper.best_step is not None:
        summary.update(best_step=stopper.best_step, best_validation=stopper.best)
        if stopper.best_step == completed:
            return summary
        saved_step = best_model_step(output_dir)
        if saved_step == stopper.best_step:
            load_best_model(accelerator, model, output_dir)
        else:
            found = f"the weights of update {saved_step}" if saved_step is not None else "none (resumed elsewhere?)"
            logger.warning(f"{output_dir}/{BEST_MODEL_DIR} holds {found}: exporting the last model, not the best "
                           f"one of update {stopper.best_step}", main_process_only=True)
    return summary


def fit(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module, train_dataset: Any,
        collate: PaddingCollator, loss_fn: LossFn, *, tokenizer: Any, mode: str,
        validate: Callable[[torch.nn.Module], float] | None = None, length_columns: tuple[str, ...] = ("input_ids",),
        on_update: UpdateHook | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Everything between a model and its export: AdamW with decay by `ndim`, the training batches
    (`--per_device_train_batch_size`, else the `--max_tokens` budget), `accelerator.prepare`, the
    `--lr_scheduler_type` schedule, early stopping on `validate(model)` (`mode` "min" or "max"),
    `train` and `finish_training`. Returns the prepared model and the training summary. With
    `--dropout_seed` the random draws of training start from that seed, the model's initialisation
    and the batch order (by `--seed`) unchanged; a resumed run's checkpoint restores its own."""
    if args.dropout_seed is not None:
        set_seed(args.dropout_seed)
    optimizer = build_optimizer(model, args.learning_rate, args.weight_decay)
    loader, sampler = train_loader(train_dataset, collate, seed=args.seed, max_tokens=args.max_tokens,
                                   batch_size=args.per_device_train_batch_size, length_columns=length_columns)
    # Accelerate deals the batches out to the processes, each its share (even_batches).
    updates = max_update_steps(args, math.ceil(len(loader) / accelerator.num_processes))
    scheduler = build_scheduler(args.lr_scheduler_type, optimizer, args.num_warmup_steps, updates, args.warmup_init_lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stopper = EarlyStopping(mode, args.patience)
    evaluate = (lambda: validate(model)) if validate is not None else None
    seen = DataSeen()
    steps = train(args, accelerator, model, optimizer, scheduler, loader, loss_fn, sampler=sampler, evaluate=evaluate,
                  stopper=stopper, tokenizer=tokenizer, on_update=on_update, seen=seen)
    summary = finish_training(accelerator, model, args.output_dir, stopper, steps)
    tokens = accelerator.reduce(torch.tensor(seen.tokens, device=accelerator.device), "sum")
    return model, {**summary, "train_tokens": int(tokens), "first_batches_sha256": seen.first_batches_sha256}


def prepare_eval_loaders(accelerator: Accelerator, data: dict[str, Any], collate: PaddingCollator, batch_size: int,
                         splits: tuple[str, ...] = ("validation", "test")) -> dict[str, DataLoader]:
    """Sequential loaders of the evaluation splits that `data` holds, prepared for the processes."""
    return {s: accelerator.prepare(eval_loader(data[s], collate, batch_size)) for s in splits if s in data}
