"""Checkpoints: the training state (`save_state`), its manifest, listing and pruning, the loop's
state as JSON, the output folder's checks, and the best model.

A checkpoint is `<output_dir>/step_<N>`: Accelerate's training state (weights with the running
statistics, optimizer, RNG), the loop's own state as JSON (`training_state.json`: schedule, early
stopping, sampler), the model config and the tokenizer, so that it also loads with
`from_pretrained` and averages with `average_checkpoints` (`averaging.py`). Statistics are averaged
over the processes first, so a checkpoint never depends on the process that wrote it.

A checkpoint is written under a temporary name (`.step_<N>.tmp-<pid>`) and renamed into place when
complete (`atomic_files.py`); its manifest `checkpoint.json` is written last: every file with its
size and SHA-256, the step, the command-line options a resumed run must share (`RESUME_OPTIONS`),
and the hash of what must not change when the run resumes (the model class, its config but for the
fields of `RESUMABLE_CONFIG_FIELDS`, the tokenizer). A folder without a manifest that matches its
files is incomplete: resuming (`resuming.py`) and averaging pass it over; one whose files fail
their SHA-256 is set aside as `step_<N>.corrupt` when a run resumes (`set_aside`). Nothing the project writes
is unpickled; Accelerate's optimizer and RNG files are pickles, so checkpoint folders are trusted
local files and never part of an export.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from safetensors.torch import load_file
from torch.optim.lr_scheduler import LambdaLR

from .arguments import PN_OPTIONS
from .locking import LOCK_NAME
from .options import BadInput, MissingInput
from .run_log import LOG_NAME
from .atomic_files import fsync, remove_path, removed_on_failure, replace_folder, write_json_atomically

BEST_MODEL_DIR = "best_model"
WEIGHTS_NAME = "model.safetensors"
MANIFEST_NAME = "checkpoint.json"
TRAINING_STATE_NAME = "training_state.json"
BEST_MODEL_STATE_NAME = "best_model.json"
MANIFEST_FORMAT = 1
# What every run of the recipes leaves in its folder, that `--overwrite_output_dir` recognises it by:
# the run log (from the first update) and the export's results (a run that only scores writes those).
RESULTS_NAME = "all_results.json"
RUN_RECORDS = (LOG_NAME, RESULTS_NAME)
# Test hook: "K" or "K@STEP" makes the checkpoint writer SIGKILL its own process once K files of
# the checkpoint (of update STEP) are written, the rename into place counting as one more.
CRASH_AFTER_FILES_ENV = "HF_POWERNORM_CRASH_CHECKPOINT_AFTER"
# Config fields that may change between the parts of one run: bookkeeping, what the first forward
# pass sets (`problem_type`), dropout, the number of processes; everything else (sizes, vocabulary,
# norms and their options) must match.
RESUMABLE_CONFIG_FIELDS = ("transformers_version", "_name_or_path", "architectures", "auto_map", "dtype",
                           "torch_dtype", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
                           "chunk_size_feed_forward", "problem_type", "dropout", "attention_dropout",
                           "activation_dropout", "classifier_dropout", "powernorm_sync_stats")
# Command-line options a resumed run must share with the checkpoint's: those that decide the model
# before the tokenizer exists, and those of the schedule that is built again around the saved
# position (updates to train may change: `--max_train_steps`, `--num_train_epochs`).
RESUME_OPTIONS = ("preset", "config_name", "config_overrides", "norm_type", "encoder_norm_type",
                  "decoder_norm_type", *PN_OPTIONS, "gradient_accumulation_steps", "lr_scheduler_type",
                  "num_warmup_steps", "warmup_init_lr")
# A checkpoint whose files fail their SHA-256 is set aside as `step_<N>.corrupt`: out of every
# listing (not a `<prefix>_<N>` name), kept to be looked into.
CORRUPT_SUFFIX = ".corrupt"
_CHECKPOINT_NAME = re.compile(r"^(?P<prefix>.*?)[_-]?(?P<number>\d+)$")
_LEFTOVER_NAME = re.compile(r"^\.(?P<name>step_\d+|best_model)\.(?:tmp|old)-\d+$")


class IncompleteCheckpointError(ValueError):
    """A checkpoint folder whose manifest is missing or does not match its files."""


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
# Manifest: the files, the step and what the run is
# ---------------------------------------------------------------------------------------------

def tokenizer_hash(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary, merges, normalisation and special tokens, leaving out
    the truncation and padding state that tokenizing leaves in a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    else:
        content = tokenizer.get_vocab()
    text = json.dumps([content, tokenizer.special_tokens_map, len(tokenizer)], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def run_identity(model: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
    """What must not change when a run resumes: the model class, its config without
    `RESUMABLE_CONFIG_FIELDS`, and the tokenizer (as JSON would hold them)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in RESUMABLE_CONFIG_FIELDS}
    identity = {"model_class": type(model).__name__, "config": config, "tokenizer": tokenizer_hash(tokenizer),
                "vocabulary_size": len(tokenizer)}
    return json.loads(json.dumps(identity, sort_keys=True, default=str))


def config_hash(identity: dict[str, Any]) -> str:
    """The SHA-256 of a `run_identity`."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()


def resume_options(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line options of `RESUME_OPTIONS` and `--vocab_size` as given, for the manifest."""
    return {name: vars(args)[name] for name in (*RESUME_OPTIONS, "vocab_size")}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str | Path, step: int, identity: dict[str, Any],
                   options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Flush every file of `folder` and write its manifest last (files, sizes, SHA-256, step, the
    run's `identity` and its hash, its command-line `options`); return the manifest."""
    folder = Path(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        fsync(path)
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "config_hash": config_hash(identity), "identity": identity,
                "options": options or {}, "files": files}
    write_json_atomically(folder / MANIFEST_NAME, manifest)
    return manifest


def read_manifest(folder: str | Path, verify_hashes: bool = True) -> dict[str, Any]:
    """The manifest of checkpoint `folder`, checked against its files (sizes, and SHA-256 with
    `verify_hashes`); raises `IncompleteCheckpointError` saying what is wrong."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise IncompleteCheckpointError(f"{folder}: no {MANIFEST_NAME} (its write did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise IncompleteCheckpointError(f"{folder}: {MANIFEST_NAME} cannot be read ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise IncompleteCheckpointError(f"{folder}: {MANIFEST_NAME} is not a manifest of format {MANIFEST_FORMAT}")
    # A manifest names files inside its folder only: it is read back, and may have been edited.
    outside = [name for name in manifest["files"] if Path(name).is_absolute() or ".." in Path(name).parts]
    if outside:
        raise IncompleteCheckpointError(f"{folder}: {MANIFEST_NAME} names {outside[0]!r}, a path outside the "
                                        f"checkpoint")
    for name, expected in manifest["files"].items():
        _check_file(folder, name, expected, verify_hashes)
    return manifest


def _check_file(folder: Path, name: str, expected: dict[str, Any], verify_hashes: bool) -> None:
    path = folder / name
    if not path.is_file():
        raise IncompleteCheckpointError(f"{folder}: {name} is missing")
    size = path.stat().st_size
    if size != expected["size"]:
        raise IncompleteCheckpointError(f"{folder}: {name} has {size} bytes, the manifest says {expected['size']}")
    if verify_hashes and _sha256(path) != expected["sha256"]:
        raise IncompleteCheckpointError(f"{folder}: {name} does not match its SHA-256 in the manifest")


def set_aside(folder: str | Path) -> Path:
    """Rename checkpoint `folder` (one whose files fail their SHA-256) to `<name>.corrupt`, replacing
    an older one of that name, so that no run resumes from it; return the new path."""
    folder = Path(folder)
    target = folder.with_name(folder.name + CORRUPT_SUFFIX)
    remove_path(target)
    folder.rename(target)
    return target


def corrupt_checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoints of `directory` set aside by `set_aside`."""
    return sorted(path for path in Path(directory).glob(f"*{CORRUPT_SUFFIX}") if path.is_dir())


def is_step_name(name: str) -> bool:
    """Whether `name` is a checkpoint's, `step_<N>` (not a `step_<N>.corrupt` set aside)."""
    return name.startswith("step_") and name.removeprefix("step_").isdigit()


def checkpoint_step(folder: str | Path) -> int:
    """N of a `step_<N>` folder name."""
    name = Path(folder).name
    if not is_step_name(name):
        raise BadInput(f"{folder}: expected a step_<N> checkpoint folder written by a recipe")
    return int(name.removeprefix("step_"))


# ---------------------------------------------------------------------------------------------
# Listing
# ---------------------------------------------------------------------------------------------

def _numbered_folders(directory: Path, prefix: str | None) -> list[Path]:
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in directory.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if path.is_dir() and match and not path.name.startswith("."):
            found.setdefault(match["prefix"], []).append((int(match["number"]), path))
    if prefix is not None:
        found = {prefix: found.get(prefix, [])}
    elif len(found) > 1:
        raise BadInput(f"checkpoints in {directory} have several prefixes {sorted(found)}; choose one")
    return [path for _, path in sorted(next(iter(found.values()), []))]


def list_checkpoints(directory: str | Path, prefix: str | None = None) -> list[Path]:
    """Complete checkpoint folders `<prefix>_<N>` (or `<prefix>-<N>`) in `directory`, oldest to
    newest by N: each has a manifest whose files are all there with their sizes.

    With `prefix=None` the folders must share one prefix (`step_10`, `step_200`); mixing e.g.
    `epoch_*` and `step_*` is an error because their numbers are not comparable.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise MissingInput(f"checkpoint directory not found: {directory}")
    return [path for path in _numbered_folders(directory, prefix) if _is_complete(path)]


def _is_complete(folder: Path, verify_hashes: bool = False) -> bool:
    try:
        read_manifest(folder, verify_hashes)
    except IncompleteCheckpointError:
        return False
    return True


def incomplete_checkpoints(directory: str | Path, prefix: str = "step") -> list[tuple[Path, str]]:
    """The checkpoint folders of `directory` that are not complete, with the reason: interrupted
    writes (`.step_<N>.tmp-<pid>`) and `step_<N>` folders whose manifest is missing or wrong."""
    directory = Path(directory)
    found = [(path, "an interrupted write") for path in sorted(directory.glob(f".{prefix}_*"))
             if path.is_dir() and _LEFTOVER_NAME.match(path.name)]
    for path in _numbered_folders(directory, prefix):
        try:
            read_manifest(path, verify_hashes=False)
        except IncompleteCheckpointError as error:
            found.append((path, str(error).removeprefix(f"{path}: ")))
    return found


def latest_checkpoint(directory: str | Path, prefix: str | None = None) -> Path | None:
    """The newest complete checkpoint folder in `directory` (for `--resume_from_checkpoint latest`)."""
    checkpoints = list_checkpoints(directory, prefix)
    return checkpoints[-1] if checkpoints else None


# ---------------------------------------------------------------------------------------------
# Writing the training state
# ---------------------------------------------------------------------------------------------

def _crash_point(files_written: int, step: int) -> None:
    """The test hook of `CRASH_AFTER_FILES_ENV`: die here as a killed process would."""
    spec = os.environ.get(CRASH_AFTER_FILES_ENV)
    if not spec:
        return
    after, _, at_step = spec.partition("@")
    if files_written >= int(after) and (not at_step or int(at_step) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def _count_files(folder: Path) -> int:
    return sum(1 for path in folder.rglob("*") if path.is_file())


def save_checkpoint(accelerator: Accelerator, output_dir: str | Path, model: torch.nn.Module, tokenizer: Any,
                    completed_steps: int, *, training_state: dict[str, Any] | None = None,
                    options: dict[str, Any] | None = None) -> Path:
    """`save_state` to `<output_dir>/step_<N>` with process-averaged statistics, plus config,
    tokenizer, `training_state` (JSON) and the manifest, written under a temporary name and renamed
    into place when complete; then the leftovers of interrupted writes are removed."""
    average_buffers_across_processes(accelerator, model)
    output_dir = Path(output_dir)
    final = output_dir / f"step_{completed_steps}"
    # One temporary name for every process: the main process's id.
    [pid] = broadcast_object_list([os.getpid()]) if accelerator.num_processes > 1 else [os.getpid()]
    temporary = output_dir / f".{final.name}.tmp-{pid}"
    if accelerator.is_main_process and temporary.exists():
        shutil.rmtree(temporary)
    accelerator.wait_for_everyone()
    with removed_on_failure(temporary, f"checkpoint {final.name}", remove=accelerator.is_main_process):
        accelerator.save_state(str(temporary))
        accelerator.wait_for_everyone()  # every process's RNG state is written
        if accelerator.is_main_process:
            _complete_checkpoint(temporary, accelerator.unwrap_model(model), tokenizer, completed_steps,
                                 training_state or {}, options)
    if accelerator.is_main_process:
        replace_folder(temporary, final)
        _crash_point(_count_files(final) + 1, completed_steps)
        remove_leftovers(output_dir)
    accelerator.wait_for_everyone()
    return final


def _complete_checkpoint(folder: Path, model: torch.nn.Module, tokenizer: Any, step: int,
                         training_state: dict[str, Any], options: dict[str, Any] | None) -> None:
    """What the main process adds to Accelerate's files: config, tokenizer, the loop's state and
    the manifest, in that order (the manifest last)."""
    _crash_point(_count_files(folder), step)
    model.config.architectures = [type(model).__name__]  # as `save_pretrained` records it
    model.config.save_pretrained(folder)
    _crash_point(_count_files(folder), step)
    tokenizer.save_pretrained(folder)
    _crash_point(_count_files(folder), step)
    write_json_atomically(folder / TRAINING_STATE_NAME, {"step": step, **training_state})
    _crash_point(_count_files(folder), step)
    write_manifest(folder, step, run_identity(model, tokenizer), options)
    _crash_point(_count_files(folder), step)


def remove_leftovers(output_dir: str | Path) -> list[Path]:
    """Remove the temporary folders that interrupted checkpoint writes left in `output_dir`;
    return them."""
    leftovers = [p for p in Path(output_dir).iterdir() if p.is_dir() and _LEFTOVER_NAME.match(p.name)]
    for path in leftovers:
        remove_path(path)
    return leftovers


def prune_checkpoints(output_dir: str | Path, keep: int, protect: Iterable[str | Path] = ()) -> list[Path]:
    """Delete all but the newest `keep` complete `step_<N>` checkpoints of `output_dir`, never one
    of `protect` (the checkpoint a run resumed from); return the deleted folders. The best model
    is a folder of its own and is not touched."""
    if keep < 1:
        raise BadInput(f"keep must be at least 1; got {keep}")
    protected = {Path(p).absolute() for p in protect}
    old = list_checkpoints(output_dir, prefix="step")[:-keep]
    deleted = [path for path in old if path.absolute() not in protected]
    for path in deleted:
        remove_path(path)
    return deleted


def remove_checkpoints(output_dir: str | Path) -> list[Path]:
    """Delete every `step_<N>` checkpoint of a finished run in `output_dir`, complete or not;
    return the deleted folders. The best model, the export and a checkpoint set aside as corrupt
    (`set_aside`, kept for whoever looks into it) are not touched."""
    checkpoints = sorted(path for path in Path(output_dir).glob("step_*") if is_step_name(path.name))
    for path in checkpoints:
        remove_path(path)
    return checkpoints


# ---------------------------------------------------------------------------------------------
# The loop's state as JSON
# ---------------------------------------------------------------------------------------------

def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """The schedule's position (`last_epoch`, `_step_count`, `base_lrs`, the last rates) as JSON
    values. A `LambdaLR`'s functions are left out: the recipe builds them again from the command
    line, and `load_scheduler_state` puts the position back into them."""
    state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    try:
        return json.loads(json.dumps(state))
    except TypeError as error:
        raise TypeError(f"the state of {type(scheduler).__name__} is not JSON ({error}): "
                        f"only schedules driven by the update count are checkpointed") from None


def load_scheduler_state(scheduler: Any, state: dict[str, Any]) -> None:
    """Put a `scheduler_state` back into a schedule built as the saved one was."""
    state = dict(state)
    if isinstance(scheduler, LambdaLR):
        state["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)
    scheduler.load_state_dict(state)


def read_training_state(folder: str | Path) -> dict[str, Any]:
    """The loop's state of checkpoint `folder` (`training_state.json`)."""
    path = Path(folder) / TRAINING_STATE_NAME
    if not path.is_file():
        raise IncompleteCheckpointError(f"{folder}: no {TRAINING_STATE_NAME}")
    return json.loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# Output folders
# ---------------------------------------------------------------------------------------------

def _inside(path: str | Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def check_clearable(folder: str | Path, records: Iterable[str], inputs: Iterable[str | None] = (),
                    keep: Iterable[str] = (LOCK_NAME,)) -> None:
    """What `--overwrite_output_dir` may clear, for the recipes, the studies' runs and `hf-powernorm
    compare` alike: a folder holding one of `records` (the tool's own record of what it wrote there,
    a regular file), never one holding the current directory, the home folder or an input of the
    run (`inputs`). Otherwise a ValueError names what clearing it would delete (all but `keep`)."""
    folder = Path(folder)
    if _inside(Path.cwd(), folder):
        raise BadInput(f"--overwrite_output_dir: --output_dir {folder} holds the current directory")
    if _inside(Path.home(), folder):
        raise BadInput(f"--overwrite_output_dir: --output_dir {folder} holds the home folder {Path.home()}")
    for path in inputs:
        if path and _inside(path, folder):
            raise BadInput(f"--overwrite_output_dir would delete {path}, an input of this run inside "
                           f"--output_dir {folder}")
    if not any((folder / name).is_file() and not (folder / name).is_symlink() for name in records):
        kept = set(keep)
        contents = sorted(p.name for p in folder.iterdir() if p.name not in kept)
        shown = ", ".join(contents[:6]) + (", ..." if len(contents) > 6 else "")
        raise BadInput(f"--overwrite_output_dir clears only a folder this tool wrote: --output_dir {folder} holds "
                       f"no {' or '.join(records)}, and clearing it would delete {shown}; remove those yourself "
                       f"or choose another --output_dir")


def check_output_dir(output_dir: str | Path, *, overwrite: bool, resume: str | None,
                     inputs: Iterable[str | None] = ()) -> None:
    """A run starts in an empty or new `output_dir`, or continues the run it holds (`resume`), or
    clears it (`overwrite`) when it holds a run of the recipes (`RUN_RECORDS`, `check_clearable`);
    never in another run's files."""
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"--output_dir {folder} is a file, not a folder")
    if overwrite and resume is not None and (resume == "latest" or _inside(resume, folder)):
        raise BadInput(f"--overwrite_output_dir would delete the checkpoint of --resume_from_checkpoint "
                       f"{resume}: give one of the two")
    # The lock of the run starting here (`locking.py`) is not another run's file.
    contents = sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME) if folder.is_dir() else []
    if not contents or resume is not None:
        return
    if not overwrite:
        shown = ", ".join(contents[:6]) + (", ..." if len(contents) > 6 else "")
        raise BadInput(f"--output_dir {folder} already holds another run's files ({shown}): pass "
                       f"--overwrite_output_dir to clear it, --resume_from_checkpoint latest to continue "
                       f"the run it holds, or choose another --output_dir")
    check_clearable(folder, RUN_RECORDS, inputs)


# ---------------------------------------------------------------------------------------------
# Best model
# ---------------------------------------------------------------------------------------------

def save_best_model(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | Path,
                    step: int | None = None, score: float | None = None) -> None:
    """The current weights and statistics (averaged over processes by the caller) in
    `output_dir/best_model`, with `best_model.json` (the update and validation score), written
    under a temporary name and renamed into place: a kill leaves the previous best model whole."""
    if accelerator.is_main_process:
        final = Path(output_dir) / BEST_MODEL_DIR
        temporary = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        remove_path(temporary)
        with removed_on_failure(temporary, f"the best model of update {step}"):
            accelerator.unwrap_model(model).save_pretrained(temporary, save_function=accelerator.save)
            write_json_atomically(temporary / BEST_MODEL_STATE_NAME, {"step": step, "validation": score})
        replace_folder(temporary, final)
    accelerator.wait_for_everyone()


def best_model_step(output_dir: str | Path) -> int | None:
    """The update whose weights `output_dir/best_model` holds, or None if there is none."""
    path = Path(output_dir) / BEST_MODEL_DIR / BEST_MODEL_STATE_NAME
    if not path.is_file() or not (path.parent / WEIGHTS_NAME).is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))["step"]


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
        raise BadInput(f"{output_dir}/{BEST_MODEL_DIR} does not match the model: missing {missing}, "
                       f"unexpected {result.unexpected_keys}")


