"""The average of the last checkpoints of a run (the paper's translation recipe, Section 5.1), as
`recipes/average_checkpoints.py` writes it.

Only complete checkpoints are averaged (each file against its manifest's SHA-256), given oldest
first. Averaging takes floating-point tensors in float64 and keeps integer tensors (PN's
`num_batches_tracked`) from the newest checkpoint, since the mean of step counters is not a step.
The export is written in a temporary folder and renamed into place: it is complete or absent.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .atomic_files import remove_path, replace_folder, write_json_atomically
from .checkpoints import (
    MANIFEST_NAME,
    TRAINING_STATE_NAME,
    WEIGHTS_NAME,
    IncompleteCheckpointError,
    incomplete_checkpoints,
    list_checkpoints,
    read_manifest,
)
from .export import complete_average_export
from .options import BadInput, MissingInput

# What an export copies from a checkpoint besides the weights: config, code, tokenizer.
_EXPORT_SUFFIXES = (".json", ".py", ".txt", ".model")


def select_checkpoints(checkpoint_dir: str | Path, num_checkpoints: int, prefix: str | None = None) -> list[Path]:
    """The newest `num_checkpoints` complete checkpoints in `checkpoint_dir`, oldest first."""
    if num_checkpoints < 1:
        raise BadInput(f"num_checkpoints must be at least 1; got {num_checkpoints}")
    found = list_checkpoints(checkpoint_dir, prefix)
    if len(found) < num_checkpoints:
        incomplete = [p.name for p, _ in incomplete_checkpoints(checkpoint_dir, prefix or "step")]
        raise BadInput(f"asked to average the last {num_checkpoints} checkpoints but {checkpoint_dir} "
                       f"holds {len(found)} complete ones: {[p.name for p in found]}"
                       + (f" (incomplete: {incomplete})" if incomplete else ""))
    return found[-num_checkpoints:]


def check_average_inputs(folders: list[Path]) -> list[int]:
    """Before averaging: every folder a complete checkpoint (each file against its SHA-256), given
    oldest first without repeats; return their steps."""
    if not folders:
        raise BadInput("no checkpoint to average")
    steps = []
    for folder in folders:
        try:
            steps.append(read_manifest(folder)["step"])
        except IncompleteCheckpointError as error:
            raise BadInput(f"{folder} is not a complete checkpoint: {error}") from None
    for (earlier, a), (later, b) in zip(zip(folders, steps), zip(folders[1:], steps[1:])):
        if b <= a:
            raise BadInput(f"checkpoints must be given oldest first, each once: {later} (update {b}) comes "
                           f"after {earlier} (update {a})")
    return steps


def _tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        contents = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "no such folder"
        raise MissingInput(f"{path} not found (contents: {contents})")
    with safe_open(str(path), framework="pt") as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}


def _check_same_tensors(folder: Path, shapes: dict[str, tuple[int, ...]], newest: Path,
                        reference: dict[str, tuple[int, ...]]) -> None:
    if shapes.keys() != reference.keys():
        diff = sorted(shapes.keys() ^ reference.keys())
        raise BadInput(f"{folder} and {newest} hold different tensors: {diff[:10]}")
    for key, shape in shapes.items():
        if shape != reference[key]:
            raise BadInput(f"tensor {key!r} has shape {shape} in {folder} but {reference[key]} in {newest}")


def average_state_dicts(folders: list[Path]) -> dict[str, torch.Tensor]:
    """The averaged state dict of `folders`, ordered oldest to newest; tensors of other names or
    shapes are refused (from the files' headers) before any is read."""
    if not folders:
        raise BadInput("no checkpoint to average")
    reference = _tensor_shapes(folders[-1])
    for folder in folders[:-1]:
        _check_same_tensors(folder, _tensor_shapes(folder), folders[-1], reference)
    newest = load_file(str(folders[-1] / WEIGHTS_NAME))
    sums = {k: v.double() for k, v in newest.items() if v.is_floating_point()}
    for folder in tqdm(folders[:-1], desc="Averaging checkpoints"):
        state = load_file(str(folder / WEIGHTS_NAME))
        for key, total in sums.items():
            total += state[key].double()
    return {k: (sums[k] / len(folders)).to(v.dtype) if k in sums else v.clone() for k, v in newest.items()}


def write_average(folders: list[Path], output_dir: str | Path, *, overwrite: bool = False,
                  command: str | None = None) -> Path:
    """Average the complete checkpoints `folders` (oldest first) into the export `output_dir`:
    the averaged `model.safetensors`, the newest checkpoint's config, code and tokenizer (none of
    its training state), `all_results.json`, and the model card (with `command`, how it was made).
    The export is written in a temporary folder and renamed into place: it is complete or absent.
    An existing `output_dir` is replaced only with `overwrite`."""
    output_dir = Path(output_dir)
    if output_dir.absolute() in {f.absolute() for f in folders}:
        raise BadInput(f"output_dir {output_dir} is one of the averaged checkpoints")
    if output_dir.exists() and not overwrite:
        raise BadInput(f"output_dir {output_dir} already exists; pass --overwrite to replace it")
    steps = check_average_inputs(folders)
    averaged = average_state_dicts(folders)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = output_dir.with_name(f".{output_dir.name}.tmp-{os.getpid()}")
    remove_path(temporary)
    temporary.mkdir()
    try:
        _write_export(folders, steps, averaged, temporary)
        complete_average_export(temporary, output_dir.resolve().name, steps, command)
    except BaseException:
        remove_path(temporary)
        raise
    replace_folder(temporary, output_dir)
    return output_dir


def _write_export(folders: list[Path], steps: list[int], averaged: dict[str, torch.Tensor], folder: Path) -> None:
    newest = folders[-1]
    for name in read_manifest(newest, verify_hashes=False)["files"]:
        if "/" not in name and name.endswith(_EXPORT_SUFFIXES) and name not in (MANIFEST_NAME, TRAINING_STATE_NAME):
            shutil.copy2(newest / name, folder / name)
    save_file(averaged, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    results = {"averaged_checkpoints": [f.name for f in folders], "averaged_steps": steps, "train_steps": steps[-1]}
    write_json_atomically(folder / "all_results.json", results)


__all__ = ["average_state_dicts", "check_average_inputs", "select_checkpoints", "write_average"]
