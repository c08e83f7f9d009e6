"""The studies as a package: `python -m hf_powernorm.studies --help` lists every study module, each
study runs as `python -m hf_powernorm.studies <study>`, and neither the package nor the recipes
reach the code by editing `sys.path`."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_powernorm.studies import STUDIES

ROOT = Path(__file__).resolve().parents[2]
STUDY_FILES = sorted(p.stem for p in (ROOT / "hf_powernorm" / "studies").glob("*.py"))
LIBRARY = {"__init__", "__main__", "documents", "grid", "measures", "reports", "runs"}


def test_every_study_module_is_listed_and_has_a_main():
    assert sorted(STUDIES) == [name for name in STUDY_FILES if name not in LIBRARY]
    for name in STUDIES:
        assert callable(importlib.import_module(f"hf_powernorm.studies.{name}").main)


def test_help_lists_every_study_with_its_line():
    completed = subprocess.run([sys.executable, "-m", "hf_powernorm.studies", "--help"], capture_output=True,
                               text=True, check=True)
    for name, line in STUDIES.items():
        assert re.search(rf"^  {name} +{re.escape(line)}$", completed.stdout, re.M), name


def test_a_study_runs_by_name_and_an_unknown_name_is_refused(capsys):
    from hf_powernorm.studies.__main__ import main

    with pytest.raises(SystemExit):
        main(["warmup_switch", "--help"])
    assert "--ramp_steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["no_such_study"])
    assert "invalid choice: 'no_such_study'" in capsys.readouterr().err


def test_a_bad_input_to_python_m_is_one_line_with_exit_status_2(tmp_path):
    """`python -m hf_powernorm.studies <study>` and `python -m hf_powernorm.studies.<study>` stop on a
    bad input as `hf-powernorm studies` does: one line, exit status 2 (a traceback before)."""
    missing = tmp_path / "no_data"
    for module in (["hf_powernorm.studies", "convergence"], ["hf_powernorm.studies.convergence"]):
        done = subprocess.run([sys.executable, "-m", *module, "--data_dir", str(missing), "--output_dir",
                               str(tmp_path / "out")], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr == (
            f"hf-powernorm studies: error: --data_dir {missing}: no ptb/ptb.train.txt there (or pass --train_file/"
            f"--validation_file/--test_file or --dataset_name; --smoke runs on the embedded corpus)\n"), done.stderr


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_a_refused_input_leaves_no_output_folder_and_a_file_is_not_one(name, tmp_path, capsys):
    """Every study checks its inputs before it creates --output_dir (a missing --data_dir left an
    empty folder behind), and refuses a file as --output_dir in one line (a traceback before)."""
    from hf_powernorm import cli

    if name != "converted_models":  # it trains on no corpus of the user's
        output_dir = tmp_path / "out"
        with pytest.raises(SystemExit) as stopped:
            cli.main(["studies", name, "--data_dir", str(tmp_path / "no_data"), "--output_dir", str(output_dir)])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-powernorm studies: error: ") and err.count("\n") == 1, err
        assert not output_dir.exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["studies", name, "--smoke", "--output_dir", str(a_file)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"hf-powernorm studies: error: --output_dir {a_file} is a file, not a folder\n"
    assert a_file.read_text() == "mine\n"


@pytest.mark.parametrize("folder", ["hf_powernorm", "recipes"])
def test_no_module_edits_sys_path(folder):
    touching = [str(path.relative_to(ROOT)) for path in sorted((ROOT / folder).rglob("*.py"))
                if "sys.path" in path.read_text(encoding="utf-8")]
    assert touching == []


def test_recipe_study_scripts_only_point_to_the_package():
    for name in STUDIES:
        text = (ROOT / "recipes" / "studies" / f"{name}.py").read_text(encoding="utf-8")
        assert f"from hf_powernorm.studies.{name} import main" in text and len(text.splitlines()) <= 8


def test_studies_train_in_process_through_the_tasks_not_recipe_scripts():
    for path in sorted((ROOT / "hf_powernorm" / "studies").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^import (subprocess|runpy)|__file__", text, re.M), path.name


def test_the_console_script_runs_the_studies_too(capsys):
    from hf_powernorm import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["studies", "--help"])
    shown = capsys.readouterr().out
    assert stopped.value.code == 0 and all(name in shown for name in STUDIES)


def test_the_console_script_names_itself_in_a_studys_argparse_errors(monkeypatch, capsys):
    """Run as `hf-powernorm studies`, a study's own parser says so (it said `python -m hf_powernorm.studies`)."""
    from hf_powernorm import cli

    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/hf-powernorm", "studies", "batch_size", "--nope"])
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("hf-powernorm studies batch_size: error: unrecognized "
                                                        "arguments: --nope")
    assert sys.argv[0] == "/somewhere/bin/hf-powernorm"  # given back


def test_the_list_of_studies_answers_before_torch_is_imported():
    """`python -m hf_powernorm.studies --help` lists the studies without loading the library."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_powernorm.studies", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and all(name in done.stdout for name in STUDIES)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "hf_powernorm.studies" in imported and not {"torch", "transformers"} & imported
