"""The runs of a comparison handed to a cluster's engine, one job per run (a cell of the grid):
submitit (a Slurm job each; where no `sbatch` is on PATH, submitit's local executor runs the jobs
as subprocesses of this machine) or Ray (a task each, with its CPU and GPU request), through the
training library's engines (`training.executors`, which the studies' grids use too).

`submit_cells` is the driver: it submits the cells that have not finished (no `result.json`, as
`training.grid` decides, after `plan.redo_changed_runs` set aside those of changed inputs), waits
for them, and returns the runs that failed with the path of each one's log. A job writes its
cell's result as the local grid does, so that a driver killed midway, run again with the same
command, finds the finished cells done and submits the rest. submitit and Ray are the extras
`hf_powernorm[submitit]` and `hf_powernorm[ray]`, imported only inside the engines
(`options.check_executor` refuses an executor whose package is missing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..training.executors import FailedRun, RunsFailed, executor_settings, submit_jobs
from ..training.grid import Cell, cell_result
from .options import CompareOptions

JOB_NAME = "hf-powernorm-compare"
# What a comparison cannot write while runs are missing (`RunsFailed`'s message).
NO_VERDICT = "so the report holds no verdict"


def submit_cells(cells: Sequence[Cell], job: Callable[..., None], options: CompareOptions) -> list[FailedRun]:
    """Run each unfinished cell of `cells` as a job of `--executor` (`job(cell, output_dir,
    gpus_per_run, log)` in the job's process), wait for all, and return those that failed."""
    todo = [cell for cell in cells if cell_result(options.output_dir, cell) is None]
    return submit_jobs(todo, job, options.output_dir, executor_settings(options), name=JOB_NAME)


__all__ = ["FailedRun", "JOB_NAME", "NO_VERDICT", "RunsFailed", "submit_cells"]
