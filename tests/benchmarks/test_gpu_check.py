"""The GPU check script: its plan is runnable as written, and without a GPU it stops at once."""

import importlib.util
from pathlib import Path

import pytest
import torch

from hf_powernorm.benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_plan_names_every_check_and_each_command_exists(tmp_path):
    plan = gpu_check.steps(tmp_path, repeats=3, quick=True)
    assert tuple(name for name, _, _ in plan) == gpu_check.STEPS
    for name, command, limit in plan:
        assert limit > 0
        if "-m" in command:
            module = command[command.index("-m") + 1]
            assert importlib.util.find_spec(module) is not None, (name, module)
        for word in command:
            if word.startswith(("tests/", "recipes/")):
                assert (ROOT / word).is_file(), (name, word)


def test_recipe_step_arguments_parse_as_the_recipe_reads_them(tmp_path):
    from hf_powernorm.training.translation import parse_args

    (name, command, _), = [step for step in gpu_check.steps(tmp_path, 3, quick=False) if step[0] == "recipe"]
    args = parse_args(command[command.index("recipes/train_wmt.py") + 1:])
    assert args.mixed_precision == "bf16" and args.max_train_steps == 300 and args.eval_steps == 300
    assert Path(args.output_dir) == tmp_path / "train_wmt"


def test_dry_run_prints_the_selected_commands(tmp_path, capsys):
    assert gpu_check.main(["--dry_run", "--only", "suite", "recipe", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["suite", "recipe"]
    assert "--device cuda" in lines[0] and "--mixed_precision bf16" in lines[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_stops_at_once_and_says_why(tmp_path, capsys):
    out = tmp_path / "report"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not out.exists()  # nothing ran


def test_budget_caps_the_run_and_reports_the_steps_it_left_out(tmp_path, monkeypatch, capsys):
    sleep = [gpu_check.sys.executable, "-c", "import time; time.sleep(30)"]
    quick = [gpu_check.sys.executable, "-c", "print('done')"]
    monkeypatch.setattr(gpu_check, "refuse_without_gpu", lambda: None)
    monkeypatch.setattr(gpu_check, "_machine", lambda: "no device (test)")
    monkeypatch.setattr(gpu_check, "steps", lambda *args: [("tests", quick, 600), ("host_cost", sleep, 600),
                                                            ("suite", quick, 600)])
    assert gpu_check.main(["--out", str(tmp_path), "--budget", "13"]) == 1
    report = (tmp_path / "gpu_check.md").read_text()
    assert "## tests: exit status 0" in report and "done" in report
    assert "## host_cost: exit status timed out" in report  # stopped at what was left, not its own 600 s
    assert "## suite: not run, the budget of 13 s was spent" in report
    assert "failed: host_cost, suite" in capsys.readouterr().out


def test_budget_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--budget", "0"])
    assert "--budget must be a positive number of seconds, got 0.0" in capsys.readouterr().err
