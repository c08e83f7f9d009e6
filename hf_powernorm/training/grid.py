"""Grids of runs for the studies and `hf-powernorm compare`: each cell runs once, a killed grid
resumes, cells run in parallel.

A study (or a comparison) is a list of `Cell`s (a name and JSON options) and a module-level function
`run_cell(cell, folder) -> dict` that trains and measures one of them in `folder`. `run_grid`
skips the cells whose `result.json` exists, clears and reruns the others (a cell killed midway left
no result; with `resume_cells`, its folder is kept instead, for a `run_cell` that continues from the
checkpoints it finds there), runs them in `jobs` fresh processes at once (or in this process with
`jobs=1`), and writes each result atomically, so that a grid stopped at any moment (a session ends, a machine goes
away) starts again where it stopped without redoing a finished cell; a worker whose grid was killed
ends itself within a second, so that no orphan goes on writing a cell the resumed grid runs again.
With `executor` settings of submitit or Ray (`executors`), each unfinished cell is a job instead,
running the same body and writing its result the same way; a failed job stops the grid with
`RunsFailed`, which names each failed cell with its log.
A finished cell whose saved options differ from the cell asked for (another budget in the same
output folder) is an error, not a result: a grid never mixes runs of different settings.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .checkpoints import write_json_atomically
from .executors import ExecutorSettings, RunsFailed, output_to, submit_jobs
from .options import BadInput, MissingInput

RESULT_NAME = "result.json"
JOB_NAME = "hf-powernorm-grid"  # the Slurm jobs' name (`scancel --name hf-powernorm-grid`)


@dataclass(frozen=True)
class Cell:
    """One run of a study: `name` is its folder (unique in the grid), `options` what it varies."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    # Options that say where the cell reads its inputs (corpus files, a tokenizer folder): they may
    # move between attempts, so a finished cell is not compared on them.
    paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"a cell name must be a plain folder name; got {self.name!r}")
        unknown = [key for key in self.paths if key not in self.options]
        if unknown:
            raise ValueError(f"cell {self.name!r}: paths {unknown} are not among its options {sorted(self.options)}")


def cell_result(output_dir: str | Path, cell: Cell) -> dict[str, Any] | None:
    """The saved result of `cell`, or None if it has not finished. Raises ValueError if the cell
    finished with other options than `cell`'s, or if the result names another cell (reports build
    paths from that name); its `paths` and options that the finished run did not record (added to
    the study since) are not compared."""
    path = Path(output_dir) / "cells" / cell.name / RESULT_NAME
    if not path.is_file():
        return None
    result = json.loads(path.read_text(encoding="utf-8"))
    if result.get("cell") != cell.name:
        raise BadInput(f"{path} names the cell {result.get('cell')!r}, not its folder's {cell.name!r}: it is no "
                       f"result of this grid; remove it, or give another output folder")
    asked = json.loads(json.dumps(cell.options))  # as saved: tuples become lists
    differ = [key for key, value in asked.items() if key not in cell.paths and key in result and result[key] != value]
    if differ:
        shown = "; ".join(f"{key}: ran with {result[key]!r}, asked {asked[key]!r}" for key in differ)
        raise BadInput(f"{path.parent} finished with other options than this grid asks ({shown}); give another "
                       f"output folder, or the options it ran with")
    return result


def finished_results(cells: Sequence[Cell], output_dir: str | Path) -> list[dict[str, Any]]:
    """The saved results of the cells that have finished, in cell order; nothing runs."""
    return [r for r in (cell_result(output_dir, cell) for cell in cells) if r is not None]


def _run_one(run_cell: Callable[[Cell, Path], dict], cell: Cell, folder: Path,
             resume_cells: bool = False) -> dict[str, Any]:
    if folder.exists() and not resume_cells:
        shutil.rmtree(folder)  # what a killed attempt left behind
    folder.mkdir(parents=True, exist_ok=resume_cells)
    result = {"cell": cell.name, **cell.options, **run_cell(cell, folder)}
    write_json_atomically(folder / RESULT_NAME, result)
    return result


def _follow_parent(parent: int, every: float = 0.5) -> None:
    """Pool initializer: the worker ends itself once the grid's process is gone. A grid killed by a
    signal never closes its pool, and a worker left running would go on writing its cell's folder
    beside the resumed grid's worker for the same cell (and take a core the queue counts as free)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)  # as if killed with the grid: what a killed cell leaves, the resumed grid handles

    threading.Thread(target=watch, name="follow-grid-process", daemon=True).start()


def reset_accelerate() -> None:
    """Accelerate keeps one state per process; the next in-process cell starts afresh."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def grid_job(run_cell: Callable[[Cell, Path], dict], resume_cells: bool, cell: Cell, output_dir: str,
             gpus_per_run: int = 0, log: str | None = None) -> None:
    """One cell of `run_grid` in its job's process (submitit's or Ray's, which may be reused): the
    body a local grid's process runs, its output appended to `log` where given."""
    with output_to(log):
        _run_one(run_cell, cell, Path(output_dir) / "cells" / cell.name, resume_cells)
    reset_accelerate()


def _check_executor(jobs: int, executor: ExecutorSettings | None) -> int:
    """The processes of a local grid: `jobs`, or the executor's (not both)."""
    if executor is None:
        return jobs
    if jobs not in (1, executor.jobs):
        raise ValueError(f"jobs={jobs} and executor jobs={executor.jobs}: give the executor's only")
    if executor.executor != "local" and executor.gpus_per_run > 1:
        raise ValueError(f"--gpus_per_run {executor.gpus_per_run}: a grid's run is one process, on one GPU at most; "
                         f"expected 0 or 1")
    return executor.jobs


def run_grid(cells: Sequence[Cell], run_cell: Callable[[Cell, Path], dict], output_dir: str | Path, *,
             jobs: int = 1, desc: str = "Runs", report_only: bool = False,
             resume_cells: bool = False, executor: ExecutorSettings | None = None) -> list[dict[str, Any]]:
    """Run every unfinished cell of `cells` (in `jobs` processes); return all results in order.
    With `report_only`, run nothing and return the results of the cells finished so far
    (FileNotFoundError if none has). With `resume_cells`, `run_cell` is handed the folder a killed
    attempt left (else a cleared one) and continues the run it holds. `executor`: where the cells
    run (default: here, as `jobs` says); with submitit or Ray one job each (`RunsFailed` if any fails)."""
    names = [cell.name for cell in cells]
    if len(set(names)) != len(names):
        raise ValueError(f"cell names must be unique; repeated: {sorted({n for n in names if names.count(n) > 1})}")
    jobs = _check_executor(jobs, executor)
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1; got {jobs}")
    root = Path(output_dir) / "cells"
    if not root.is_dir():
        misplaced = [name for name in names if (Path(output_dir) / name / RESULT_NAME).is_file()]
        if misplaced:  # a record copied in without its `cells/` folder would silently run again
            raise BadInput(f"{output_dir} holds {len(misplaced)} finished run(s) of this grid at its top level "
                           f"(e.g. {Path(output_dir) / misplaced[0]}); a grid keeps them in {root}: move them "
                           f"there to resume")
    if report_only:
        results = finished_results(cells, output_dir)
        if not results:
            raise MissingInput(f"--report_only: no finished run under {root}")
        return results
    root.mkdir(parents=True, exist_ok=True)
    todo = [cell for cell in cells if cell_result(output_dir, cell) is None]
    if executor is not None and executor.executor != "local":
        print(f"{desc}: {len(cells) - len(todo)} of {len(cells)} runs finished, {len(todo)} to run", file=sys.stderr)
        failed = submit_jobs(todo, partial(grid_job, run_cell, resume_cells), output_dir, executor, name=JOB_NAME)
        if failed:
            raise RunsFailed(failed)
        return [cell_result(output_dir, cell) for cell in cells]
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=desc)
    if jobs == 1:
        for cell in todo:
            _run_one(run_cell, cell, root / cell.name, resume_cells)
            reset_accelerate()
            bar.update(1)
    else:
        # Fresh processes, one cell each: no state (threads, Accelerate, caches) crosses cells.
        context = multiprocessing.get_context("spawn")
        with context.Pool(jobs, maxtasksperchild=1, initializer=_follow_parent, initargs=(os.getpid(),)) as pool:
            pending = [pool.apply_async(_run_one, (run_cell, cell, root / cell.name, resume_cells)) for cell in todo]
            for result in pending:
                result.get()
                bar.update(1)
    bar.close()
    return [cell_result(output_dir, cell) for cell in cells]
