"""Resuming a run from a checkpoint (`--resume_from_checkpoint PATH|latest`): which checkpoint
(`latest`: the newest complete one whose files pass their SHA-256; one that fails it is set
aside, and without any left the run starts over), whether it belongs to this run (the command-line options of
`RESUME_OPTIONS`, the tokenizer, the model class and config), and loading its training state.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from .checkpoints import (
    RESUME_OPTIONS,
    IncompleteCheckpointError,
    checkpoint_step,
    config_hash,
    corrupt_checkpoints,
    incomplete_checkpoints,
    list_checkpoints,
    load_scheduler_state,
    read_manifest,
    read_training_state,
    run_identity,
    set_aside,
    tokenizer_hash,
)
from .options import BadInput
from .tokenization import has_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


def resolve_resume_path(resume_from_checkpoint: str, output_dir: str | Path,
                        report: Callable[[str], None] = print, set_aside_corrupt: bool = True) -> Path | None:
    """`--resume_from_checkpoint`: a complete `step_<N>` folder, or `latest`, the newest complete
    one in `output_dir` (`report` names the incomplete ones passed over). Every file is checked
    against the manifest's SHA-256: for `latest`, a checkpoint that fails it is set aside as
    `step_<N>.corrupt` with a warning naming it (`set_aside_corrupt`: on the main process, the others
    waiting), and the next one down is tried; None where every checkpoint was set aside, now or by
    an earlier attempt: the run starts over."""
    if resume_from_checkpoint != "latest":
        path = Path(resume_from_checkpoint)
        checkpoint_step(path)
        try:
            read_manifest(path)
        except IncompleteCheckpointError as error:
            raise BadInput(f"--resume_from_checkpoint {path} is not a complete checkpoint: {error}") from None
        return path
    output_dir = Path(output_dir)
    skipped = incomplete_checkpoints(output_dir) if output_dir.is_dir() else []
    candidates = list_checkpoints(output_dir, prefix="step") if output_dir.is_dir() else []
    chosen = None
    for path in reversed(candidates):
        try:
            read_manifest(path)
        except IncompleteCheckpointError as error:
            if set_aside_corrupt:
                logger.warning(f"{error}: set aside as {set_aside(path)}, resuming from the newest valid "
                               f"checkpoint instead")
            continue
        chosen = path
        break
    reasons = ", ".join(f"{path.name} ({reason})" for path, reason in skipped)
    if skipped:
        report(f"Passing over incomplete checkpoints in {output_dir}: {reasons}")
    if chosen is None and output_dir.is_dir() and corrupt_checkpoints(output_dir):
        logger.warning(f"no valid checkpoint left in {output_dir}: the run starts over")
        return None
    if chosen is None:
        raise BadInput(f"--resume_from_checkpoint latest: no complete step_* checkpoint in {output_dir}"
                       + (f"; incomplete: {reasons}" if skipped else "") + ". Nothing to resume: run the "
                       "command without --resume_from_checkpoint in a new --output_dir")
    return chosen


def check_resume_options(path: str | Path, args: argparse.Namespace) -> None:
    """Before any data is read: the command-line options of `RESUME_OPTIONS` and the tokenizer of
    this run against those of the run that wrote checkpoint `path`. Without a tokenizer of its own the run
    takes the checkpoint's (`args.tokenizer_name` is set to it). Raises a `ValueError` naming every
    difference."""
    manifest = read_manifest(path, verify_hashes=False)
    saved, identity = manifest["options"], manifest["identity"]
    given = vars(args)  # the options by name
    differences = [f"--{name} is {given[name]!r} here, {saved[name]!r} there"
                   for name in RESUME_OPTIONS if name in saved and given[name] != saved[name]]
    source = args.tokenizer_name or (args.model_name_or_path if has_tokenizer(args.model_name_or_path) else None)
    if source is not None:
        tokenizer = load_tokenizer(source)
        if tokenizer_hash(tokenizer) != identity["tokenizer"]:
            differences.append(f"the tokenizer of {source} ({len(tokenizer)} tokens) is not the checkpoint's "
                               f"({identity['vocabulary_size']} tokens)")
    else:
        if saved.get("vocab_size") is not None and args.vocab_size != saved["vocab_size"]:
            differences.append(f"--vocab_size is {args.vocab_size} here, {saved['vocab_size']} there")
        args.tokenizer_name = str(path)
    if differences:
        raise BadInput(f"--resume_from_checkpoint {path}: the checkpoint belongs to a run of another "
                       f"configuration: {'; '.join(differences)}. Resume with that run's options, or start "
                       f"a new run in another --output_dir")


def check_resume_model(path: str | Path, model: torch.nn.Module, tokenizer: Any) -> None:
    """Before loading checkpoint `path`: its model class, config (but for
    `RESUMABLE_CONFIG_FIELDS`) and tokenizer must be this run's; raises a `ValueError` naming the
    differences."""
    manifest = read_manifest(path, verify_hashes=False)
    identity = run_identity(model, tokenizer)
    if config_hash(identity) == manifest["config_hash"]:
        return
    saved = manifest["identity"]
    differences = [f"the model is {identity['model_class']} here, {saved['model_class']} there"] \
        if identity["model_class"] != saved["model_class"] else []
    ours, theirs = identity["config"], saved["config"]
    differences += [f"{key} is {ours.get(key)!r} here, {theirs.get(key)!r} there"
                    for key in sorted(ours.keys() | theirs.keys()) if ours.get(key) != theirs.get(key)]
    if identity["tokenizer"] != saved["tokenizer"]:
        differences.append(f"the tokenizer differs ({identity['vocabulary_size']} tokens here, "
                           f"{saved['vocabulary_size']} there)")
    raise BadInput(f"--resume_from_checkpoint {path}: the checkpoint belongs to a run of another configuration: "
                   f"{'; '.join(differences)}")


def resume(accelerator: Accelerator, path: Path, gradient_accumulation_steps: int, batches_per_epoch: int,
           scheduler: Any | None = None, stopper: Any | None = None) -> tuple[int, int, int, dict[str, Any]]:
    """Load the training state of checkpoint `path` (Accelerate's files, then the schedule and
    early stopping from `training_state.json`); return (completed updates, epoch, batches to skip
    in it, the saved state)."""
    accelerator.print(f"Resuming from {path}")
    state = read_training_state(path)
    accelerator.load_state(str(path))
    if scheduler is not None and "scheduler" in state:
        load_scheduler_state(scheduler, state["scheduler"])
    if stopper is not None and state.get("early_stopping") is not None:
        stopper.load_state_dict(state["early_stopping"])
    completed = int(state["step"])
    batches = completed * gradient_accumulation_steps
    return completed, batches // batches_per_epoch, batches % batches_per_epoch, state


__all__ = ["check_resume_model", "check_resume_options", "resolve_resume_path", "resume"]
