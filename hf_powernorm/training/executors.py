"""Where a grid's runs go: this machine (`local`: in the process, or `jobs` fresh processes at
once), one Slurm job each through submitit (where no `sbatch` is on PATH, submitit's local executor
runs the jobs as subprocesses of this machine), or one Ray task each (a local instance unless an
address is given). `hf-powernorm compare --executor` and the studies' `--executor` are this module.

`ExecutorSettings` holds the options (`add_executor_args` puts them on a command line, with the
help of `compare`'s; `executor_settings` reads and checks them: an engine whose package is missing
is refused in one line naming the extra that installs it). `submit_jobs` is the driver: it submits
the runs it is given as jobs, waits for all, and returns those that failed with the path of each
one's log (`FailedRun`; `RunsFailed` names them). A job writes its run's result as the local grid
does (`grid.run_grid` decides which runs are unfinished and what a job runs), so that a driver
killed midway, run again with the same command, submits only the rest. submitit and Ray are the
extras `hf_powernorm[submitit]` and `hf_powernorm[ray]`: they are imported only inside the
functions that use them. This module imports neither torch nor the rest of the library.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .options import BadInput

EXECUTORS = ("local", "submitit", "ray")
# The optional dependency each executor needs: its module, and the extra of setup.cfg that installs it.
EXECUTOR_EXTRAS = {"submitit": "submitit", "ray": "ray"}
# The executors that take each executor option.
EXECUTOR_OPTIONS = {"slurm_partition": ("submitit",), "timeout_min": ("submitit",), "slurm_extra": ("submitit",),
                    "gpus_per_run": ("submitit", "ray"), "cpus_per_run": ("submitit", "ray"), "ray_address": ("ray",)}
JOBS_FOLDER = "jobs"  # under the output folder, private (0700): each job's log (submitit's folders, Ray's files)
POLL_SECONDS = 1.0  # how often the driver looks at submitit's jobs
GROUP_TITLE = "where the runs go (one job per run; see docs/compare_executors.md)"
# The help of each option, as `hf-powernorm compare --help` gives it (a test holds them equal), but
# `--gpus_per_run`: a grid's run is one process, where a comparison's may span a job's GPUs.
HELP = {
    "executor": "local: the runs in this process, or --jobs processes at once; submitit: one Slurm job per run "
                "(with no sbatch on PATH, submitit's local executor runs the jobs as subprocesses of this machine, "
                "at most --jobs at once); ray: one Ray task per run. Either way a killed command, run again, "
                "submits only the unfinished runs",
    "jobs": "runs at once on CPU, each in its own process",
    "slurm_partition": "submitit: the Slurm partition of the jobs",
    "gpus_per_run": "submitit, ray: GPUs of each run (0 or 1: a run is one process)",
    "cpus_per_run": "submitit, ray: CPU cores of each run",
    "timeout_min": "submitit: the time limit of each job in minutes",
    "slurm_extra": "submitit: a further sbatch setting of each job as KEY=VALUE (e.g. account=my_lab, qos=high, "
                   "constraint=a100); repeatable",
    "ray_address": "ray: the address of a running Ray cluster (e.g. auto, or ray://head:10001); default: a local "
                   "instance started for the command",
}


@dataclass(frozen=True)
class ExecutorSettings:
    """Where a grid's runs go, and what each one asks for (the options of `add_executor_args`)."""

    executor: str = "local"
    jobs: int = 1  # local: processes at once; submitit without Slurm: jobs at once
    cpus_per_run: int = 1
    gpus_per_run: int = 0
    timeout_min: int = 240
    slurm_partition: str | None = None
    slurm_extra: tuple[str, ...] = ()
    ray_address: str | None = None

    def check(self) -> None:
        """The executor's package installed (else one line naming the extra), each option for an
        executor that takes it, the counts in range, `slurm_extra` as KEY=VALUE (ValueError)."""
        if self.executor not in EXECUTORS:
            raise BadInput(f"--executor {self.executor!r}: expected one of {list(EXECUTORS)}")
        if self.executor in EXECUTOR_EXTRAS:
            check_installed(self.executor)
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise BadInput(f"--executor {self.executor} starts each run in its own job (through Accelerate "
                               f"where --gpus_per_run is over 1): run the command itself without `accelerate "
                               f"launch`")
        defaults = ExecutorSettings()
        for name, executors in EXECUTOR_OPTIONS.items():
            if getattr(self, name) != getattr(defaults, name) and self.executor not in executors:
                raise BadInput(f"--{name} is for --executor {' or '.join(executors)}, not {self.executor}")
        for name, least in (("gpus_per_run", 0), ("cpus_per_run", 1), ("timeout_min", 1)):
            if getattr(self, name) < least:
                raise BadInput(f"--{name} {getattr(self, name)}: expected an integer of at least {least}")
        slurm_settings(self.slurm_extra)


def check_installed(executor: str) -> None:
    """The package of `--executor` importable, else a ValueError naming the extra that installs it."""
    module = EXECUTOR_EXTRAS[executor]
    try:
        importlib.import_module(module)
    except ImportError:
        raise BadInput(f"--executor {executor} needs the {module} package: pip install "
                       f"hf_powernorm[{module}]") from None


def slurm_settings(pairs: Sequence[str]) -> dict[str, str]:
    """`--slurm_extra KEY=VALUE ...` as sbatch's settings by name."""
    settings = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise BadInput(f"--slurm_extra {pair!r}: expected KEY=VALUE, e.g. account=my_lab")
        settings[key.strip()] = value
    return settings


def executor_settings(args: Any) -> ExecutorSettings:
    """The settings of the options in `args` (a parsed command line with `add_executor_args`'
    options, or an object with the same fields; one it lacks takes its default), checked."""
    values = {spec.name: getattr(args, spec.name, spec.default) for spec in dataclasses.fields(ExecutorSettings)}
    settings = ExecutorSettings(**{**values, "slurm_extra": tuple(values["slurm_extra"])})
    settings.check()
    return settings


class _Executor(argparse.Action):
    """`--executor`: an engine whose package is missing is refused as the option is read, before
    the command writes anything (a ValueError's one line, as the commands show bad input)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values in EXECUTOR_EXTRAS:
            check_installed(values)
        setattr(namespace, self.dest, values)


def add_executor_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--executor`, `--jobs`, `--slurm_partition`, `--gpus_per_run`, `--cpus_per_run`,
    `--timeout_min`, `--slurm_extra KEY=VALUE` (repeatable) and `--ray_address`, in one group, with
    `ExecutorSettings`' defaults (`executor_settings` reads them back)."""
    group, defaults = parser.add_argument_group(GROUP_TITLE), ExecutorSettings()

    def add(name: str, **settings: Any) -> None:
        default = getattr(defaults, name)
        default = list(default) if isinstance(default, tuple) else default  # `append` adds to a copy
        # The default said as `compare --help` says it: unless the help says it, or there is none.
        shown = "" if "default:" in HELP[name] or default in (None, False) else f" (default: {default})"
        group.add_argument(f"--{name}", default=default, help=HELP[name] + shown, **settings)

    add("executor", choices=EXECUTORS, action=_Executor)
    add("jobs", type=int)
    add("slurm_partition")
    add("gpus_per_run", type=int, metavar="N")
    add("cpus_per_run", type=int, metavar="N")
    add("timeout_min", type=int, metavar="N")
    add("slurm_extra", action="append", metavar="KEY=VALUE")
    add("ray_address")
    return parser


# ---------------------------------------------------------------------------------------------
# The engines
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FailedRun:
    """A run whose job failed: its cell, the log that tells why, and the error's last line."""

    cell: str
    log: str
    error: str


class RunsFailed(RuntimeError):
    """Jobs of a grid failed: each named with its log. `consequence` says what the command could
    not write without them (e.g. "so the report holds no verdict")."""

    def __init__(self, failed: Sequence[FailedRun], consequence: str = "so no outputs are written from this grid"):
        self.failed = list(failed)
        shown = "; ".join(f"{run.cell} (log: {run.log})" for run in self.failed)
        super().__init__(f"{len(self.failed)} run(s) failed, {consequence}: {shown}; fix the cause and rerun the "
                         f"same command to run them again")


# `job(cell, output_dir, gpus_per_run, log)`: one run in its job's process, writing its result;
# `log` is the file for its output (Ray's tasks; submitit keeps its own), or None.
Job = Callable[[Any, str, int, "str | None"], None]


def check_private_output(output_dir: str | Path) -> None:
    """Refuse (ValueError, with the reason) an output folder for jobs that others could write: the folder
    itself writable by group or others, or a folder above it writable by them and not sticky (they could
    put another in its place). The driver and the jobs unpickle what its `jobs/` holds."""
    folder = Path(output_dir).absolute()
    for above in (folder, *folder.parents):
        try:
            mode = above.stat().st_mode
        except FileNotFoundError:
            continue  # to be created by the command, private
        if mode & (stat.S_IWGRP | stat.S_IWOTH) and (above == folder or not mode & stat.S_ISVTX):
            where = "the output folder" if above == folder else f"{above}, a folder above it,"
            raise BadInput(f"--output_dir {output_dir}: {where} can be written by other users (mode "
                           f"{stat.S_IMODE(mode):o}); the jobs' files there are unpickled and run, so --executor "
                           f"submitit and ray need a folder only you can write")


def submit_jobs(todo: Sequence[Any], job: Job, output_dir: str | Path, settings: ExecutorSettings, *,
                name: str) -> list[FailedRun]:
    """Run each cell of `todo` (objects with a `name`) as a job of `settings.executor` (Slurm's jobs
    named `name`), `job(cell, output_dir, gpus_per_run, log)` in the job's process; wait for all,
    and return those that failed."""
    if not todo:
        return []
    check_private_output(output_dir)
    jobs = Path(output_dir) / JOBS_FOLDER
    jobs.mkdir(mode=0o700, parents=True, exist_ok=True)
    jobs.chmod(0o700)  # also one made before: the jobs' pickles there are unpickled by the driver and the jobs
    if settings.executor == "submitit":
        return _submitit_runs(todo, job, str(output_dir), settings, name)
    return _ray_runs(todo, job, str(output_dir), settings)


@contextlib.contextmanager
def output_to(log: str | None) -> Iterator[None]:
    """The run's output (stdout and stderr) appended to `log`; left alone where `log` is None."""
    if log is None:
        yield
        return
    with open(log, "a", encoding="utf-8") as handle, contextlib.redirect_stdout(handle), \
            contextlib.redirect_stderr(handle):
        yield


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def slurm_available() -> bool:
    """Whether this machine submits to Slurm (`sbatch` on PATH); else submitit runs jobs locally."""
    return shutil.which("sbatch") is not None


def submitit_executor(output_dir: str | Path, settings: ExecutorSettings, name: str):
    """submitit's executor of `--executor submitit`: Slurm's with the job's resources, partition and
    `--slurm_extra` settings, or the local executor without Slurm (the resources it ignores)."""
    import submitit

    slurm = slurm_available()
    executor = submitit.AutoExecutor(folder=Path(output_dir) / JOBS_FOLDER / "%j", cluster=None if slurm else "local")
    parameters: dict[str, Any] = {"name": name, "timeout_min": settings.timeout_min, "nodes": 1,
                                  "tasks_per_node": 1, "cpus_per_task": settings.cpus_per_run}
    if settings.gpus_per_run:
        parameters["gpus_per_node"] = settings.gpus_per_run
    if slurm:
        parameters["slurm_additional_parameters"] = slurm_settings(settings.slurm_extra)
        if settings.slurm_partition:
            parameters["slurm_partition"] = settings.slurm_partition
    executor.update_parameters(**parameters)
    return executor


def _submitit_runs(todo: Sequence[Any], job: Job, output_dir: str, settings: ExecutorSettings,
                   name: str) -> list[FailedRun]:
    """The cells as submitit jobs: all submitted at once to Slurm; without it, at most `--jobs`
    local subprocesses at a time (each next one submitted as one ends)."""
    executor = submitit_executor(output_dir, settings, name)
    at_once = len(todo) if slurm_available() else settings.jobs
    queue, running, failed = list(todo), {}, []
    while queue or running:
        while queue and len(running) < at_once:
            cell = queue.pop(0)
            submitted = executor.submit(job, cell, output_dir, settings.gpus_per_run, None)
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


def ray_log(output_dir: str | Path, cell: Any) -> Path:
    """Where a Ray task writes its run's output."""
    return Path(output_dir) / JOBS_FOLDER / f"{cell.name}.log"


def _call(job: Job, *args: Any) -> None:
    """A Ray task's function: `job` may be any callable (a `functools.partial` too), which Ray's
    decorator does not take."""
    job(*args)


def _ray_runs(todo: Sequence[Any], job: Job, output_dir: str, settings: ExecutorSettings) -> list[FailedRun]:
    """The cells as Ray tasks of `--cpus_per_run` and `--gpus_per_run`, on the cluster of
    `--ray_address` or a local instance started (and stopped) for them."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=settings.ray_address, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=settings.cpus_per_run, num_gpus=settings.gpus_per_run, max_retries=0)(_call)
        tasks = [(cell, remote.remote(job, cell, output_dir, settings.gpus_per_run, str(ray_log(output_dir, cell))))
                 for cell in todo]
        failed = []
        for cell, task in tasks:
            try:
                ray.get(task)
            except ray.exceptions.RayError as error:
                failed.append(FailedRun(cell.name, str(ray_log(output_dir, cell)), _last_line(error)))
                print(f"{cell.name}: failed, see {ray_log(output_dir, cell)}", file=sys.stderr)
        return failed
    finally:
        if started:
            ray.shutdown()
