"""`training.executors` under `run_grid`: the settings read back from their command line, the local
executor as `jobs` processes, and the grid's refusals before it writes anything. (The engines run
a study's grid in tests/studies/test_studies_executors.py, and a comparison's in
tests/compare/test_compare_executors.py.)"""

import argparse
import os

import pytest

from hf_powernorm.training import executors
from hf_powernorm.training.executors import ExecutorSettings, add_executor_args, executor_settings
from hf_powernorm.training.grid import Cell, run_grid
from test_training_grid import square


def test_settings_are_read_back_from_the_command_line():
    parser = add_executor_args(argparse.ArgumentParser())
    assert executor_settings(parser.parse_args([])) == ExecutorSettings()
    args = parser.parse_args(["--executor", "submitit", "--jobs", "3", "--cpus_per_run", "4", "--slurm_extra",
                              "account=lab", "--slurm_extra", "qos=high", "--slurm_partition", "gpu"])
    assert executor_settings(args) == ExecutorSettings("submitit", jobs=3, cpus_per_run=4, slurm_partition="gpu",
                                                       slurm_extra=("account=lab", "qos=high"))


def test_the_local_executor_runs_jobs_fresh_processes(tmp_path):
    cells = [Cell(f"x{x}", {"x": x}) for x in (2, 3)]
    results = run_grid(cells, square, tmp_path, executor=ExecutorSettings(jobs=2))
    assert [r["square"] for r in results] == [4, 9]
    assert os.getpid() not in {r["pid"] for r in results} and len({r["pid"] for r in results}) == 2


def test_a_grid_refuses_before_writing(tmp_path):
    cell = Cell("a", {"x": 1})
    with pytest.raises(ValueError, match=r"--gpus_per_run 2: a grid's run is one process, on one GPU at most"):
        run_grid([cell], square, tmp_path, executor=ExecutorSettings("ray", gpus_per_run=2))
    with pytest.raises(ValueError, match=r"jobs=2 and executor jobs=3: give the executor's only"):
        run_grid([cell], square, tmp_path, jobs=2, executor=ExecutorSettings(jobs=3))
    assert not any(tmp_path.iterdir())


def test_the_jobs_folder_is_private_to_this_user(tmp_path, monkeypatch):
    """The driver and the jobs unpickle what `jobs/` holds: no other user may write there."""
    monkeypatch.setattr(executors, "_submitit_runs", lambda *args: [])
    (tmp_path / "old" / executors.JOBS_FOLDER).mkdir(parents=True, mode=0o777)
    os.chmod(tmp_path / "old" / executors.JOBS_FOLDER, 0o777)  # one made group- and world-writable before
    for output_dir in (tmp_path / "new", tmp_path / "old"):
        executors.submit_jobs([Cell("a", {"x": 1})], square, output_dir, ExecutorSettings("submitit"), name="test")
        assert (output_dir / executors.JOBS_FOLDER).stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode, where", [
    (None, "the output folder"), (0o777, "a folder above it"), (0o1777, None), (0o755, None),
])
def test_an_output_folder_others_can_write_is_refused(tmp_path, monkeypatch, mode, where):
    """Others could swap the jobs' pickles in a folder they can write, or rename one above it away (unless
    it is sticky, as /tmp is): refused, naming which folder and its mode."""
    monkeypatch.setattr(executors, "_submitit_runs", lambda *args: [])
    output_dir = tmp_path / "parent" / "out"
    output_dir.mkdir(parents=True)
    output_dir.chmod(0o770 if mode is None else 0o700)
    if mode is not None:
        (tmp_path / "parent").chmod(mode)
    submit = lambda: executors.submit_jobs([Cell("a", {"x": 1})], square, output_dir, ExecutorSettings("submitit"),
                                           name="test")
    if where is None:
        submit()
        assert (output_dir / executors.JOBS_FOLDER).is_dir()
        return
    with pytest.raises(ValueError, match=f"{where},? can be written by other users"):
        submit()
    assert not (output_dir / executors.JOBS_FOLDER).exists()
