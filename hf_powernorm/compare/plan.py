"""The plan of a comparison in its output folder: `compare.json` (the options and the inputs'
fingerprint), the cells of the resumable grid (`training/grid.py`: one per norm, learning rate and
seed), each cell's run options, and the checks that keep a folder to one comparison.

A finished run is reused only while its inputs are those it ran on: `fingerprint` hashes the
model's files (config and tokenizer by content, weight files by size and modification time), the
data files' and a local dataset folder's contents, and the settings; a run whose fingerprint
differs is run again, and the log says which input changed (`redo_changed_runs`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..training.options import BadInput, MissingInput, is_main_process
from .options import BASELINES, CompareOptions, library_args, task_class

SETTINGS_NAME = "compare.json"
# What a run of `--checkpoint_runs` records when it starts: the comparison's fingerprint, so that a
# checkpoint is only gone on from with the inputs it was trained on.
STARTED_NAME = "started.json"
MODEL_FILES_BY_CONTENT = 1 << 20  # model files up to 1 MiB (config, tokenizer) are hashed; larger by size and time
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")
# Files of an output folder that are not a comparison's: its lock (`training.locking.LOCK_NAME`).
HOLDER_FILES = (".lock",)


# The comparison a job of `--executor submitit` or `ray` was given with its cell, by output folder:
# read in its place of `compare.json`, which could have been edited while the job waited in a queue.
_GIVEN: dict[Path, dict[str, Any]] = {}


def saved_comparison(output_dir: str | Path) -> dict[str, Any]:
    """The `compare.json` of `output_dir`: `settings`, `args` (the options), `fingerprint`, `model`; in a
    job, the one it was given (`given_comparison`)."""
    given = _GIVEN.get(Path(output_dir).absolute())
    if given is not None:
        return given
    return json.loads((Path(output_dir) / SETTINGS_NAME).read_text(encoding="utf-8"))


@contextlib.contextmanager
def given_comparison(output_dir: str | Path, saved: dict[str, Any]) -> Iterator[None]:
    """`saved` read as `output_dir`'s comparison while the block runs (a job's cell, with its options)."""
    key = Path(output_dir).absolute()
    _GIVEN[key] = saved
    try:
        yield
    finally:
        del _GIVEN[key]


def save_comparison(options: CompareOptions, facts: dict[str, Any]) -> None:
    """Write `compare.json`: the options, the settings they measure, the inputs' fingerprint, the model's facts."""
    from ..training.atomic_files import write_text_atomically

    saved = {"settings": options.settings(), "args": options.to_json(), "fingerprint": fingerprint(options),
             "model": facts}
    write_text_atomically(Path(options.output_dir) / SETTINGS_NAME, json.dumps(saved, indent=1))


def fingerprint(options: CompareOptions) -> dict[str, str]:
    """What a run's result depends on beyond its options, hashed per input: the model's files, the
    tokenizer's files, the data (files and a local dataset folder, by content) and the settings."""
    model = Path(options.model_name_or_path)
    files = sorted(p for p in model.iterdir() if p.is_file() and not p.name.startswith("."))
    data = [Path(getattr(options, k)) for k in task_class(options).input_path_options if getattr(options, k, None)]
    if options.dataset_name and Path(options.dataset_name).is_dir():
        data += sorted(p for p in Path(options.dataset_name).rglob("*") if p.is_file())
    settings = json.dumps({k: v for k, v in options.settings().items() if k != "model_name_or_path"}, sort_keys=True)
    named = f":{options.dataset_name}:{options.dataset_config}" if options.dataset_name else ""
    return {"model": _digest([p for p in files if p.name not in TOKENIZER_FILES], MODEL_FILES_BY_CONTENT),
            "tokenizer": _digest([p for p in files if p.name in TOKENIZER_FILES], MODEL_FILES_BY_CONTENT),
            "data": _digest(data) + named, "settings": hashlib.sha256(settings.encode()).hexdigest()[:16]}


def _digest(paths: Sequence[Path], by_content_up_to: float = float("inf")) -> str:
    """A hash of the files' names and contents (of a file over `by_content_up_to` bytes: its size and time)."""
    digest = hashlib.sha256()
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0".encode())
        if stat.st_size > by_content_up_to:
            digest.update(str(stat.st_mtime_ns).encode())
            continue
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def check_output_folder(options: CompareOptions) -> None:
    """A new or empty folder, or one holding a comparison of the same settings (resumed; more norms
    or seeds may be added), compared field by field; another comparison's results are refused unless
    `--overwrite_output_dir` clears them, and other files always (`check_clearable`)."""
    folder = Path(options.output_dir)
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"--output_dir {folder} is a file, not a folder")
    contents = sorted(p.name for p in folder.iterdir() if p.name not in HOLDER_FILES) if folder.is_dir() else []
    if not contents:
        return
    if (folder / SETTINGS_NAME).is_file():
        differ = _differing_settings(saved_comparison(folder)["settings"], options)
        if not differ or options.report_only:
            return
        reason = f"holds another comparison's results ({differ})"
    elif options.report_only:
        raise MissingInput(f"--report_only: {folder} holds no comparison ({SETTINGS_NAME} is missing)")
    else:
        reason = f"holds other files ({', '.join(contents[:6])}{', ...' if len(contents) > 6 else ''})"
    if not options.overwrite_output_dir:
        raise BadInput(f"--output_dir {folder} {reason}: pass --overwrite_output_dir to clear it, or choose "
                       f"another --output_dir")
    from ..training.atomic_files import clear_folder
    from ..training.checkpoints import check_clearable

    inputs = [getattr(options, name, None) for name in ("model_name_or_path", *task_class(options).input_path_options,
                                                        "dataset_name")]
    check_clearable(folder, (SETTINGS_NAME,), [path for path in inputs if path and Path(path).exists()],
                    keep=HOLDER_FILES)
    if is_main_process():
        clear_folder(folder, keep=HOLDER_FILES)  # the lock stays: this process holds the folder


def _differing_settings(saved: dict[str, Any], options: CompareOptions) -> str:
    """The settings a saved comparison ran with that differ from `options`', as `--name: there, now`."""
    asked = json.loads(json.dumps(options.settings()))  # as saved: tuples become lists
    if options.model_name_or_path is None:  # the embedded default's model folder is made later
        saved = {k: v for k, v in saved.items() if k != "model_name_or_path"}
        asked.pop("model_name_or_path", None)
    differ = sorted(k for k in set(saved) | set(asked) if saved.get(k) != asked.get(k))
    return "; ".join(f"--{k}: {saved.get(k)!r} there, {asked.get(k)!r} now" for k in differ)


def make_cells(options: CompareOptions, learning_rates: dict[str, list[float]], seeds: Sequence[int]) -> list:
    """One cell per norm, learning rate of that norm and seed; the comparison's settings ride along
    so that a finished run of other settings is refused."""
    from ..training.grid import Cell

    settings = options.settings()
    paths = tuple(k for k in ("model_name_or_path", *task_class(options).input_path_options) if k in settings)
    return [Cell(f"{norm}-lr{lr:g}-seed{seed}", {**settings, "norm": norm, "seed": seed, "learning_rate": lr},
                 paths=paths)
            for norm in options.norms for lr in learning_rates.get(norm, []) for seed in seeds]


def run_args(cell, folder: Path) -> argparse.Namespace:
    """One run's options as the training library reads them: the comparison's (from its
    `compare.json`) with the cell's norm, seed and learning rate, training in `folder/run`; with
    `--checkpoint_runs`, a checkpoint at each validation (the processes' statistics are averaged
    there anyway, so it changes no score), going on from the last one a stopped attempt left."""
    options = CompareOptions.from_json(saved_comparison(folder.parents[1])["args"])
    norm = cell.options["norm"]
    checkpoints = {}
    if options.checkpoint_runs:
        checkpoints = {"checkpointing_steps": str(options.eval_steps) if options.eval_steps else "epoch",
                       "checkpoints_total_limit": 1,
                       "resume_from_checkpoint": "latest" if resumable(folder) else None}
    return library_args(options, seed=cell.options["seed"], learning_rate=cell.options["learning_rate"],
                        convert_norms=None if norm in BASELINES else norm,
                        preserve_function=options.preserve_function and norm not in options.not_preserved,
                        # One pipeline for every arm: the stream centred in each, the baseline's too.
                        centre_arms=options.preserve_function and not options.keep_tied_head,
                        output_dir=str(folder / "run"), overwrite_output_dir=False, push_to_hub=False,
                        **checkpoints)


def resumable(folder: Path) -> bool:
    """Whether `folder` holds a stopped attempt of its run that can go on: a complete checkpoint in
    `folder/run`, made with the comparison's current inputs."""
    from ..training.checkpoints import latest_checkpoint

    started, run = folder / STARTED_NAME, folder / "run"
    if not started.is_file() or not run.is_dir() or latest_checkpoint(run, "step") is None:
        return False
    return json.loads(started.read_text(encoding="utf-8")) == saved_comparison(folder.parents[1])["fingerprint"]


def continue_or_clear(folder: Path, checkpoint_runs: bool) -> None:
    """Before a run in `folder` (on the main process): keep what a stopped attempt left where the
    run can go on from it (`--checkpoint_runs`), else clear it; then record the inputs it starts on."""
    from ..training.checkpoints import write_json_atomically

    if not (checkpoint_runs and resumable(folder)):
        shutil.rmtree(folder, ignore_errors=True)  # what a killed attempt left behind
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomically(folder / STARTED_NAME, saved_comparison(folder.parents[1])["fingerprint"])


def redo_changed_runs(cells: Sequence, output_dir: str | Path) -> list[str]:
    """Set aside (as `result.changed.json`) the result of each finished run whose fingerprint differs
    from the inputs' now, saying which input changed; returns the names of those runs."""
    from ..training.grid import cell_result

    current = saved_comparison(output_dir)["fingerprint"]
    redone = []
    for cell in cells:
        result = cell_result(output_dir, cell)
        if result is None:
            continue
        ran = result.get("fingerprint", {})
        changed = [part for part in current if ran.get(part) != current[part]]
        if changed:
            _set_aside_result(output_dir, cell, "changed")
            print(f"{cell.name}: the {' and '.join(changed)} changed since it ran; running it again", file=sys.stderr)
            redone.append(cell.name)
    return redone


def redo_runs_without_models(cells: Sequence, output_dir: str | Path) -> list[str]:
    """With `--save_models`: set aside (as `result.without_model.json`) the result of each finished
    run that validated but kept no model (it ran without the option), so that it runs again, to the
    same scores, and keeps it; returns the names of those runs."""
    from ..training.checkpoints import BEST_MODEL_DIR
    from ..training.grid import cell_result

    redone = []
    for cell in cells:
        result = cell_result(output_dir, cell)
        run = Path(output_dir) / "cells" / cell.name / "run"
        if result is None or result.get("best_validation") is None or (run / BEST_MODEL_DIR).is_dir():
            continue
        _set_aside_result(output_dir, cell, "without_model")
        print(f"{cell.name}: finished without --save_models, so it kept no model; running it again to keep it",
              file=sys.stderr)
        redone.append(cell.name)
    return redone


def _set_aside_result(output_dir: str | Path, cell, why: str) -> None:
    """The result of a finished run renamed `result.<why>.json`: the run counts as not finished."""
    from ..training.grid import RESULT_NAME

    path = Path(output_dir) / "cells" / cell.name / RESULT_NAME
    path.replace(path.with_suffix(f".{why}.json"))
