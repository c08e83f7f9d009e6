"""The runs of a comparison handed to a cluster's engine, one job per run (a cell of the grid):
submitit (a Slurm job each; where no `sbatch` is on PATH, submitit's local executor runs the jobs
as subprocesses of this machine) or Ray (a task each, with its CPU and GPU request).

`submit_cells` is the driver: it submits the cells that have not finished (no `result.json`, as
`training.grid` decides, after `plan.redo_changed_runs` set aside those of changed inputs), waits
for them, and returns the runs that failed with the path of each one's log. A job writes its
cell's result as the local grid does, so that a driver killed midway, run again with the same
command, finds the finished cells done and submits the rest. submitit and Ray are the extras
`hf_powernorm[submitit]` and `hf_powernorm[ray]`: they are imported here only, inside the
functions that use them (`options.check_executor` refuses an executor whose package is missing).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..training.grid import Cell, cell_result
from .options import CompareOptions, slurm_settings

JOBS_FOLDER = "jobs"  # under --output_dir: each job's log (submitit's folders, Ray's files)
POLL_SECONDS = 1.0  # how often the driver looks at submitit's jobs
JOB_NAME = "hf-powernorm-compare"


@dataclass(frozen=True)
class FailedRun:
    """A run whose job failed: its cell, the log that tells why, and the error's last line."""

    cell: str
    log: str
    error: str


class RunsFailed(RuntimeError):
    """Jobs of the grid failed: the comparison's report lists them as missing, with no verdict."""

    def __init__(self, failed: Sequence[FailedRun]):
        self.failed = list(failed)
        shown = "; ".join(f"{run.cell} (log: {run.log})" for run in self.failed)
        super().__init__(f"{len(self.failed)} run(s) failed, so the report holds no verdict: {shown}; fix the cause "
                         f"and rerun the same command to run them again")


def submit_cells(cells: Sequence[Cell], job: Callable[..., None], options: CompareOptions) -> list[FailedRun]:
    """Run each unfinished cell of `cells` as a job of `--executor` (`job(cell, output_dir,
    gpus_per_run, log)` in the job's process), wait for all, and return those that failed."""
    todo = [cell for cell in cells if cell_result(options.output_dir, cell) is None]
    if not todo:
        return []
    (Path(options.output_dir) / JOBS_FOLDER).mkdir(parents=True, exist_ok=True)
    engine = {"submitit": _submitit_runs, "ray": _ray_runs}[options.executor]
    return engine(todo, job, options)


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def slurm_available() -> bool:
    """Whether this machine submits to Slurm (`sbatch` on PATH); else submitit runs jobs locally."""
    return shutil.which("sbatch") is not None


def submitit_executor(options: CompareOptions):
    """submitit's executor of `--executor submitit`: Slurm's with the job's resources, partition and
    `--slurm_extra` settings, or the local executor without Slurm (the resources it ignores)."""
    import submitit

    slurm = slurm_available()
    executor = submitit.AutoExecutor(folder=Path(options.output_dir) / JOBS_FOLDER / "%j",
                                     cluster=None if slurm else "local")
    parameters: dict[str, Any] = {"name": JOB_NAME, "timeout_min": options.timeout_min, "nodes": 1,
                                  "tasks_per_node": 1, "cpus_per_task": options.cpus_per_run}
    if options.gpus_per_run:
        parameters["gpus_per_node"] = options.gpus_per_run
    if slurm:
        parameters["slurm_additional_parameters"] = slurm_settings(options.slurm_extra)
        if options.slurm_partition:
            parameters["slurm_partition"] = options.slurm_partition
    executor.update_parameters(**parameters)
    return executor


def _submitit_runs(todo: Sequence[Cell], job: Callable[..., None], options: CompareOptions) -> list[FailedRun]:
    """The cells as submitit jobs: all submitted at once to Slurm; without it, at most `--jobs`
    local subprocesses at a time (each next one submitted as one ends)."""
    executor = submitit_executor(options)
    at_once = len(todo) if slurm_available() else options.jobs
    queue, running, failed = list(todo), {}, []
    while queue or running:
        while queue and len(running) < at_once:
            cell = queue.pop(0)
            submitted = executor.submit(job, cell, str(options.output_dir), options.gpus_per_run, None)
            running[submitted] = cell
            print(f"{cell.name}: job {submitted.job_id}, log {submitted.paths.stderr}", file=sys.stderr)
        ended = [submitted for submitted in running if submitted.done()]
        if not ended:
            time.sleep(POLL_SECONDS)
        for submitted in ended:
            cell = running.pop(submitted)
            error = submitted.exception()
            if error is not None:
                failed.append(FailedRun(cell.name, str(submitted.paths.stderr), _last_line(error)))
                print(f"{cell.name}: failed, see {submitted.paths.stderr}", file=sys.stderr)
    return failed


def ray_log(options: CompareOptions, cell: Cell) -> Path:
    """Where a Ray task writes its run's output."""
    return Path(options.output_dir) / JOBS_FOLDER / f"{cell.name}.log"


def _ray_runs(todo: Sequence[Cell], job: Callable[..., None], options: CompareOptions) -> list[FailedRun]:
    """The cells as Ray tasks of `--cpus_per_run` and `--gpus_per_run`, on the cluster of
    `--ray_address` or a local instance started (and stopped) for them."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=options.cpus_per_run, num_gpus=options.gpus_per_run, max_retries=0)(job)
        tasks = [(cell, remote.remote(cell, str(options.output_dir), options.gpus_per_run, str(ray_log(options, cell))))
                 for cell in todo]
        failed = []
        for cell, task in tasks:
            try:
                ray.get(task)
            except ray.exceptions.RayError as error:
                failed.append(FailedRun(cell.name, str(ray_log(options, cell)), _last_line(error)))
                print(f"{cell.name}: failed, see {ray_log(options, cell)}", file=sys.stderr)
        return failed
    finally:
        if started:
            ray.shutdown()
