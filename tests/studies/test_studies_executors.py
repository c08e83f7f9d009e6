"""The studies' `--executor`: a study's grid (the warmup switch at smoke size) run as submitit jobs
(submitit's local executor: no Slurm here) and as Ray tasks (a local instance) gives the local
grid's results.csv; a driver killed after its first finished run, run again, runs nothing twice; a
failing job stops the study naming the run and its log, with no summary; a missing extra is
refused in one line before anything is written; every study's --help lists the options, with
`hf-powernorm compare`'s help."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_powernorm import cli
from hf_powernorm.compare.options import EXECUTORS, build_parser
from hf_powernorm.studies import STUDIES, warmup_switch
from hf_powernorm.studies.__main__ import main as studies_main
from hf_powernorm.training.executors import EXECUTORS as TRAINING_EXECUTORS
from hf_powernorm.training.executors import add_executor_args

from launching import kill_driver_after_first_result

pytestmark = pytest.mark.usefixtures("reset_accelerate")

ROOT = Path(__file__).resolve().parents[2]
# Two runs of fourteen updates on the embedded corpus: seconds each.
ARGV = ["--smoke", "--seeds", "1", "--settings", "layernorm", "pn-cumulative"]
OPTIONS = ("--executor {local,submitit,ray}", "--jobs JOBS", "--slurm_partition", "--gpus_per_run N",
           "--cpus_per_run N", "--timeout_min N", "--slurm_extra KEY=VALUE", "--ray_address")


@pytest.fixture(scope="module")
def local_outputs(tmp_path_factory) -> Path:
    """The grid run by the local executor, in this process."""
    from accelerate.state import AcceleratorState

    folder = tmp_path_factory.mktemp("local")
    warmup_switch.main([*ARGV, "--output_dir", str(folder)])
    AcceleratorState._reset_state(reset_partial_state=True)
    return folder


def _results(folder: Path) -> str:
    """results.csv (the warmup switch's has no time column)."""
    return (folder / "results.csv").read_text(encoding="utf-8")



# A minute of fresh processes on 2 cores: the grid's resume under submitit (`training.grid`,
# `training.executors`, both shared) runs in compare's killed-driver test, and a study's jobs go through
# submitit in the failed-job test below.
@pytest.mark.slow
def test_submitit_driver_killed_after_a_run_resumes_and_matches_local(local_outputs, job_environment, tmp_path,
                                                                     capsys):
    argv = [*ARGV, "--executor", "submitit", "--jobs", "1", "--output_dir", str(tmp_path)]
    first = kill_driver_after_first_result([sys.executable, "-m", "hf_powernorm.studies", "warmup_switch", *argv],
                                           tmp_path)
    assert not (tmp_path / "results.csv").exists()
    finished_at = first.stat().st_mtime_ns
    warmup_switch.main(argv)
    err = capsys.readouterr().err
    assert "Warmup switch: 1 of 2 runs finished, 1 to run" in err
    assert err.count(", log ") == 1  # a job submitted for the unfinished run, none for the finished one
    assert first.stat().st_mtime_ns == finished_at  # not run again
    assert _results(tmp_path) == _results(local_outputs)


@pytest.mark.slow  # two minutes on 2 cores; the same Ray executor (`training.executors`) runs in compare's test
def test_ray_tasks_match_local(local_outputs, job_environment, tmp_path):
    warmup_switch.main([*ARGV, "--executor", "ray", "--output_dir", str(tmp_path)])
    assert _results(tmp_path) == _results(local_outputs)
    assert sorted(p.name for p in (tmp_path / "jobs").glob("*.log")) == sorted(
        f"{p.name}.log" for p in (tmp_path / "cells").iterdir() if p.is_dir())


def failing_pn_run(cell, folder):
    """A run that fails for PN (an error in the run), and trains the others."""
    if cell.options["setting"] == "pn-cumulative":
        raise RuntimeError(f"{cell.name} ran out of memory")
    return warmup_switch.run_cell(cell, folder)


def test_a_failed_job_stops_the_study_naming_its_log_and_no_summary(job_environment, tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr(warmup_switch, "run_cell", failing_pn_run)
    with pytest.raises(SystemExit) as stopped:
        studies_main(["warmup_switch", *ARGV, "--executor", "submitit", "--jobs", "2", "--output_dir",
                      str(tmp_path)])
    assert stopped.value.code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"python -m hf_powernorm.studies warmup_switch: 1 run\(s\) failed, so no outputs are written "
                    r"from this grid: pn-cumulative-seed1 \(log: ", line), line
    log = Path(line.split("(log: ")[1].split(")")[0])
    assert log.is_file() and "ran out of memory" in log.read_text()
    assert (tmp_path / "cells" / "layernorm-seed1" / "result.json").is_file()  # the other run finished
    assert not (tmp_path / "summary.md").exists() and not (tmp_path / "results.csv").exists()


@pytest.mark.parametrize("executor", ["submitit", "ray"])
@pytest.mark.parametrize("study", sorted(STUDIES))
def test_a_missing_extra_is_refused_in_one_line_before_any_work(study, executor, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, executor, None)  # `import <executor>` raises ImportError
    output_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["studies", study, "--smoke", "--executor", executor, "--output_dir", str(output_dir)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"hf-powernorm studies: error: --executor {executor} needs the {executor} "
                                       f"package: pip install hf_powernorm[{executor}]\n")
    assert not output_dir.exists()


def test_executor_options_are_checked_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"--slurm_partition is for --executor submitit, not ray"):
        warmup_switch.main([*ARGV, "--executor", "ray", "--slurm_partition", "gpu", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--slurm_extra 'account': expected KEY=VALUE"):
        warmup_switch.main([*ARGV, "--executor", "submitit", "--slurm_extra", "account", "--output_dir",
                            str(tmp_path)])
    assert not any(tmp_path.iterdir())


def _help(study: str, capsys) -> str:
    with pytest.raises(SystemExit):
        studies_main([study, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_every_study_lists_the_executor_options(study, capsys):
    text = _help(study, capsys)
    for option in OPTIONS:
        assert option in text, option
    assert "with no sbatch on PATH, submitit's local executor runs the jobs as subprocesses" in text


@pytest.mark.slow  # a fresh process; `python -m hf_powernorm.studies` runs fresh in tests/docs, the help here in-process
def test_help_by_python_m_lists_the_executor_options():
    done = subprocess.run([sys.executable, "-m", "hf_powernorm.studies", "tuned_comparison", "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    text = " ".join(done.stdout.split())
    assert done.returncode == 0 and all(option in text for option in OPTIONS), done.stderr


def test_the_options_have_compares_names_defaults_and_help():
    """Each option as `hf-powernorm compare` has it, but --gpus_per_run: a grid's run is one process."""
    ours = {a.dest: a for a in add_executor_args(argparse.ArgumentParser())._actions[1:]}
    compares = {a.dest: a for a in build_parser()._actions if a.dest in ours}
    assert EXECUTORS == TRAINING_EXECUTORS and set(compares) == set(ours)
    for name, action in ours.items():
        assert (action.option_strings, action.default, action.metavar, action.choices) == (
            compares[name].option_strings, compares[name].default, compares[name].metavar, compares[name].choices)
        assert action.help == compares[name].help or name == "gpus_per_run", name
    assert ours["gpus_per_run"].help.startswith("submitit, ray: GPUs of each run")
