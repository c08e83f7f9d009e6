"""Checkpoints: the training state (`save_state` / `load_state`), the best model, and the average
of the last checkpoints (the paper's translation recipe, Section 5.1).

A checkpoint is `<output_dir>/step_<N>`: Accelerate's training state (weights with the running
statistics, optimizer, schedule, RNG) plus the model config and the tokenizer, so that it also
loads with `from_pretrained` and averages with `average_checkpoints`. Statistics are averaged over
the processes first, so a checkpoint never depends on the process that wrote it. Averaging takes
floating-point tensors in float64 and keeps integer tensors (PN's `num_batches_tracked`) from the
newest checkpoint, since the mean of step counters is not a step.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

BEST_MODEL_DIR = "best_model"
WEIGHTS_NAME = "model.safetensors"
_TRAINING_STATE = ("optimizer", "scheduler", "random_states", "scaler", "sampler", "custom_checkpoint")
_CHECKPOINT_NAME = re.compile(r"^(?P<prefix>.*?)[_-]?(?P<number>\d+)$")


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
# Listing
# ---------------------------------------------------------------------------------------------

def list_checkpoints(directory: str | Path, prefix: str | None = None,
                     required_file: str | None = None) -> list[Path]:
    """Checkpoint folders `<prefix>_<N>` (or `<prefix>-<N>`) in `directory`, oldest to newest by N.

    With `prefix=None` the folders must share one prefix (`step_10`, `step_200`); mixing e.g.
    `epoch_*` and `step_*` is an error because their numbers are not comparable.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in directory.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if path.is_dir() and match and (required_file is None or (path / required_file).is_file()):
            found.setdefault(match["prefix"], []).append((int(match["number"]), path))
    if prefix is not None:
        found = {prefix: found.get(prefix, [])}
    elif len(found) > 1:
        raise ValueError(f"checkpoints in {directory} have several prefixes {sorted(found)}; choose one")
    return [path for _, path in sorted(next(iter(found.values()), []))]


def latest_checkpoint(directory: str | Path, prefix: str | None = None) -> Path | None:
    """The newest checkpoint folder in `directory` (for `--resume_from_checkpoint latest`)."""
    checkpoints = list_checkpoints(directory, prefix)
    return checkpoints[-1] if checkpoints else None


# ---------------------------------------------------------------------------------------------
# Training state
# ---------------------------------------------------------------------------------------------

def save_checkpoint(accelerator: Accelerator, output_dir: str | Path, model: torch.nn.Module, tokenizer: Any,
                    completed_steps: int) -> Path:
    """`save_state` to `<output_dir>/step_<N>` with process-averaged statistics, plus config and
    tokenizer so that the folder loads with `from_pretrained` and averages."""
    average_buffers_across_processes(accelerator, model)
    folder = Path(output_dir) / f"step_{completed_steps}"
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def resolve_resume_path(resume_from_checkpoint: str, output_dir: str | Path) -> Path:
    """`--resume_from_checkpoint`: a `step_<N>` folder, or `latest` (the newest in `output_dir`)."""
    path = resume_from_checkpoint
    if path == "latest":
        path = latest_checkpoint(output_dir, prefix="step") if Path(output_dir).is_dir() else None
        if path is None:
            raise ValueError(f"--resume_from_checkpoint latest: no step_* checkpoint in {output_dir}")
    name = Path(path).name
    if not name.startswith("step_") or not name.removeprefix("step_").isdigit():
        raise ValueError(f"--resume_from_checkpoint {path}: expected a step_<N> folder written by a recipe")
    return Path(path)


def resume(accelerator: Accelerator, path: Path, gradient_accumulation_steps: int,
           batches_per_epoch: int) -> tuple[int, int, int]:
    """Load the training state of checkpoint `path`; return (completed updates, epoch, batches to
    skip in it)."""
    accelerator.print(f"Resuming from {path}")
    accelerator.load_state(str(path))
    completed = int(path.name.removeprefix("step_"))
    batches = completed * gradient_accumulation_steps
    return completed, batches // batches_per_epoch, batches % batches_per_epoch


# ---------------------------------------------------------------------------------------------
# Best model
# ---------------------------------------------------------------------------------------------

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
    state = load_file(str(Path(output_dir) / BEST_MODEL_DIR / WEIGHTS_NAME))
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
# Averaging
# ---------------------------------------------------------------------------------------------

def select_checkpoints(checkpoint_dir: str | Path, num_checkpoints: int, prefix: str | None = None) -> list[Path]:
    """The newest `num_checkpoints` folders with a `model.safetensors` in `checkpoint_dir`."""
    if num_checkpoints < 1:
        raise ValueError(f"num_checkpoints must be at least 1; got {num_checkpoints}")
    found = list_checkpoints(checkpoint_dir, prefix, required_file=WEIGHTS_NAME)
    if len(found) < num_checkpoints:
        raise ValueError(f"asked to average the last {num_checkpoints} checkpoints but {checkpoint_dir} "
                         f"holds {len(found)} with a {WEIGHTS_NAME}: {[p.name for p in found]}")
    return found[-num_checkpoints:]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        contents = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "no such folder"
        raise FileNotFoundError(f"{path} not found (contents: {contents})")
    return load_file(str(path))


def average_state_dicts(folders: list[Path]) -> dict[str, torch.Tensor]:
    """The averaged state dict of `folders`, ordered oldest to newest."""
    if not folders:
        raise ValueError("no checkpoint to average")
    newest = _weights(folders[-1])
    sums = {k: v.double() for k, v in newest.items() if v.is_floating_point()}
    for folder in tqdm(folders[:-1], desc="Averaging checkpoints"):
        state = _weights(folder)
        if state.keys() != newest.keys():
            diff = sorted(state.keys() ^ newest.keys())
            raise ValueError(f"{folder} and {folders[-1]} hold different tensors: {diff[:10]}")
        for key, total in sums.items():
            if state[key].shape != total.shape:
                raise ValueError(f"tensor {key!r} has shape {tuple(state[key].shape)} in {folder} "
                                 f"but {tuple(total.shape)} in {folders[-1]}")
            total += state[key].double()
    return {k: (sums[k] / len(folders)).to(v.dtype) if k in sums else v.clone() for k, v in newest.items()}


def write_average(folders: list[Path], output_dir: str | Path) -> Path:
    """Average `folders` into `output_dir`, copying the newest checkpoint's other files (config,
    code, tokenizer) but not its optimizer, schedule and RNG states."""
    output_dir = Path(output_dir)
    if output_dir.resolve() in {f.resolve() for f in folders}:
        raise ValueError(f"output_dir {output_dir} is one of the averaged checkpoints")
    averaged = average_state_dicts(folders)
    output_dir.mkdir(parents=True, exist_ok=True)
    for item in folders[-1].iterdir():
        if item.is_file() and item.name != WEIGHTS_NAME and not item.name.startswith(_TRAINING_STATE):
            shutil.copy2(item, output_dir / item.name)
    save_file(averaged, str(output_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    return output_dir
