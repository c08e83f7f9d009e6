"""`hf-powernorm compare --executor`: the runs of a tiny GPT-2 grid as submitit jobs (submitit's
local executor: no Slurm here) and Ray tasks (a local instance) give the results and verdicts of
the local runs; a driver killed after its first finished run, run again, runs nothing twice; a
failing job is reported with its log and no verdict; a missing extra is refused in one line."""

import csv
import re
import sys
from pathlib import Path

import pytest

from hf_powernorm import cli, compare
from hf_powernorm.compare import runs as compare_runs

from launching import kill_driver_after_first_result

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")

# Two updates, validated after each, on a few examples: seconds per run.
TINY = ["--max_train_steps", "2", "--eval_steps", "1", "--num_warmup_steps", "1", "--max_eval_samples", "24"]
GRID = ["--norms", "layernorm", "powernorm", "--seeds", "1", "2"]
TIME_COLUMNS = ("seconds",)


@pytest.fixture(scope="module")
def gpt2_options(gpt2_case) -> list[str]:
    """The options of a comparison on the tiny GPT-2 and its text files, at the smallest budget."""
    model, task, data = gpt2_case
    return ["--model_name_or_path", model, "--task", task, *data, *TINY]


@pytest.fixture(scope="module")
def local_outputs(gpt2_options, tmp_path_factory) -> Path:
    """The grid run by the local executor, in this process."""
    from accelerate.state import AcceleratorState

    folder = tmp_path_factory.mktemp("local")
    compare.main([*gpt2_options, *GRID, "--output_dir", str(folder)])
    AcceleratorState._reset_state(reset_partial_state=True)
    return folder


def _results(folder: Path) -> list[dict[str, str]]:
    with open(folder / "results.csv", newline="", encoding="utf-8") as handle:
        return [{k: v for k, v in row.items() if k not in TIME_COLUMNS} for row in csv.DictReader(handle)]


def _verdicts(folder: Path) -> str:
    """report.md from its verdicts on, the settings (which name the executor) left out."""
    text = (folder / "report.md").read_text(encoding="utf-8")
    return text[text.index("| verdict |"):text.index("## Settings")]


def _assert_same_outputs(folder: Path, local: Path) -> None:
    assert _results(folder) == _results(local)
    assert len(_results(local)) == 8  # 2 norms x 2 seeds x validation, test
    assert _verdicts(folder) == _verdicts(local)



def test_submitit_driver_killed_after_a_run_resumes_and_matches_local(gpt2_options, local_outputs, job_environment,
                                                                     tmp_path, capsys):
    """The first seed's two runs (a job each: the driver killed after the first, the second run on
    rerun) score as the local grid's first seed; the Ray test below compares the verdicts too."""
    argv = [*gpt2_options, *GRID[:-1], "--executor", "submitit", "--jobs", "1", "--output_dir", str(tmp_path)]
    first = kill_driver_after_first_result([sys.executable, "-m", "hf_powernorm.cli", "compare", *argv],
                                           tmp_path)
    finished_at = first.stat().st_mtime_ns
    compare.main(argv)
    err = capsys.readouterr().err
    assert "1 of 2 runs finished, 1 to run" in err
    assert err.count(", log ") == 1  # a job submitted for the unfinished run, none for the finished one
    assert first.stat().st_mtime_ns == finished_at  # not run again
    assert _results(tmp_path) == [row for row in _results(local_outputs) if row["seed"] == "1"]


def test_ray_tasks_match_local(gpt2_options, local_outputs, job_environment, tmp_path):
    compare.main([*gpt2_options, *GRID, "--executor", "ray", "--output_dir", str(tmp_path)])
    _assert_same_outputs(tmp_path, local_outputs)
    assert sorted(p.name for p in (tmp_path / "jobs").glob("*.log")) == sorted(
        f"{p.name}.log" for p in (tmp_path / "cells").iterdir() if p.is_dir())


def failing_second_seed(cell, output_dir, gpus_per_run=0, log=None, **given):
    """A job that fails for the runs of seed 2 (an error in the run), and runs the others."""
    if cell.options["seed"] == 2:
        raise RuntimeError(f"{cell.name} ran out of memory")
    compare_runs.run_job(cell, output_dir, gpus_per_run, log, **given)


def test_a_failed_job_is_reported_with_its_log_and_no_verdict(gpt2_options, job_environment, tmp_path,
                                                              monkeypatch, capsys):
    monkeypatch.setattr(compare_runs, "run_job", failing_second_seed)
    with pytest.raises(SystemExit) as stopped:
        compare.main([*gpt2_options, "--norms", "layernorm", "--seeds", "1", "2", "--executor", "submitit",
                      "--jobs", "2", "--output_dir", str(tmp_path)])
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert re.match(r"hf-powernorm compare: 1 run\(s\) failed, so the report holds no verdict: "
                    r"layernorm-lr[0-9.e-]+-seed2 \(log: ", line), line
    log = Path(line.split("(log: ")[1].split(")")[0])
    assert log.is_file() and "layernorm-lr" in log.read_text() and "ran out of memory" in log.read_text()
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## Missing runs" in report and f"(log: `{log}`)" in report and "| verdict |" not in report
    assert [row["seed"] for row in _results(tmp_path)] == ["1", "1"]  # the finished run, validation and test


@pytest.mark.parametrize("executor", ["submitit", "ray"])
def test_a_missing_extra_is_refused_in_one_line_before_any_work(executor, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, executor, None)  # `import <executor>` raises ImportError
    output_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["compare", "--executor", executor, "--output_dir", str(output_dir)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"hf-powernorm compare: error: --executor {executor} needs the {executor} "
                                       f"package: pip install hf_powernorm[{executor}]\n")
    assert not output_dir.exists()


def test_executor_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"--slurm_extra 'account': expected KEY=VALUE"):
        compare.main(["--executor", "submitit", "--slurm_extra", "account", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--cpus_per_run 0: expected an integer of at least 1"):
        compare.main(["--executor", "ray", "--cpus_per_run", "0", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--slurm_partition is for --executor submitit, not ray"):
        compare.main(["--executor", "ray", "--slurm_partition", "gpu", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--gpus_per_run is for --executor submitit or ray, not local"):
        compare.main(["--gpus_per_run", "1", "--output_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_help_lists_the_executor_options():
    from hf_powernorm.compare.options import build_parser

    text = " ".join(build_parser().format_help().split())
    for option in ("--executor {local,submitit,ray}", "--slurm_partition", "--gpus_per_run", "--cpus_per_run",
                   "--timeout_min", "--slurm_extra KEY=VALUE", "--ray_address"):
        assert option in text, option
    assert "with no sbatch on PATH, submitit's local executor runs the jobs as subprocesses" in text


def test_a_job_runs_on_the_options_submitted_with_its_cell(tmp_path, monkeypatch):
    """The driver gives each job the comparison with its cell: a `compare.json` edited while the job
    waits in the queue (another model, remote code trusted) is not what the job runs."""
    import json

    from hf_powernorm.compare.options import CompareOptions
    from hf_powernorm.training.grid import Cell

    options = CompareOptions(output_dir=str(tmp_path), executor="submitit", model_name_or_path="mine")
    saved = {"args": options.to_json(), "fingerprint": {"model": "0"}}
    (tmp_path / "compare.json").write_text(json.dumps(saved))
    cell = Cell("layernorm-lr0.001-seed1", {"norm": "layernorm", "seed": 1, "learning_rate": 1e-3})
    submitted = []
    monkeypatch.setattr(compare_runs, "submit_cells", lambda cells, job, options: submitted.append(job) or [])
    monkeypatch.setattr(compare_runs, "cell_result", lambda output_dir, cell: None)
    compare_runs.run_cells([cell], options)
    edited = {"args": {**saved["args"], "model_name_or_path": "theirs", "trust_remote_code": True},
              "fingerprint": saved["fingerprint"]}
    (tmp_path / "compare.json").write_text(json.dumps(edited))
    ran = []

    def read_options(cell, folder):  # what the run would train on, in place of training
        folder.mkdir(parents=True)
        ran.append(compare_runs.run_args(cell, folder))
        return {}

    monkeypatch.setattr(compare_runs, "run_cell", read_options)
    (job,) = submitted
    job(cell, str(tmp_path), 0, None)
    (args,) = ran
    assert args.model_name_or_path == "mine" and not args.trust_remote_code
    assert compare_runs.saved_comparison(tmp_path) == edited  # outside the job, the folder's own


def test_an_output_folder_others_can_write_is_refused_for_jobs(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"a folder above it, can be written by other users \(mode 777\)"):
        compare.main(["--executor", "submitit", "--output_dir", str(shared / "out")])
    assert not (shared / "out").exists()
