"""The rules of `hf_powernorm.training.checks`: each valid value comes back, each invalid one gives
one line naming the option, the value and what was expected; no torch import."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from hf_powernorm.training.checks import (
    check_columns,
    check_dropout,
    check_grid,
    check_learning_rate,
    check_positive_int,
    check_weight_decay,
)


@pytest.mark.parametrize("check, valid, invalid, option, expected", [
    (check_learning_rate, [1e-3, 2, "5e-4"], [0, -0.001, math.inf, math.nan, "x", None], "--learning_rate", "> 0"),
    (check_weight_decay, [0, 1e-4, 0.1], [-1, -1e-9, math.inf, math.nan], "--weight_decay", ">= 0"),
    (check_dropout, [0, 0.1, 0.999], [1, 2, -0.1, math.nan], "--dropout", "[0, 1)"),
])
def test_number_rules(check, valid, invalid, option, expected):
    for value in valid:
        assert check(value) == float(value)
    for value in invalid:
        with pytest.raises(ValueError) as error:
            check(value)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{option} ") and str(value) in message
        assert expected in message
    with pytest.raises(ValueError, match="^--lr_grid "):
        check(-5, "--lr_grid")


def test_positive_int():
    assert check_positive_int(3, "--seeds") == 3
    assert check_positive_int(4.0, "--seeds") == 4
    for value in (0, -2, 1.5, True, "3", None):
        with pytest.raises(ValueError, match=r"^--seeds .*expected an integer > 0$"):
            check_positive_int(value, "--seeds")


def test_grid():
    assert check_grid([1e-3, "3e-3"], check_learning_rate, "--lr_grid") == [1e-3, 3e-3]
    with pytest.raises(ValueError, match="^--lr_grid: expected at least one value"):
        check_grid([], check_learning_rate, "--lr_grid")
    with pytest.raises(ValueError, match="^--lr_grid: expected at least one value"):
        check_grid(None, check_learning_rate, "--lr_grid")
    # A bad value fails before any run of the grid, named with the grid's option.
    with pytest.raises(ValueError, match=r"^--lr_grid -0.001: expected a learning rate"):
        check_grid([0.001, -0.001], check_learning_rate, "--lr_grid")
    with pytest.raises(ValueError, match=r"^--lr_grid 0.001 0.002 0.001: expected distinct values; 0.001 given twice"):
        check_grid([0.001, 0.002, 0.001], check_learning_rate, "--lr_grid")
    # Duplicates are found after parsing: "1e-3" and 0.001 are one learning rate.
    with pytest.raises(ValueError, match="given twice"):
        check_grid(["1e-3", 0.001], check_learning_rate, "--lr_grid")


def test_columns():
    check_columns(["text", "label"], {"--text_column": "text", "--label_column": None}, "train.csv")
    with pytest.raises(ValueError) as error:
        check_columns(["sentence", "label"], {"--text_column": "text"}, "data/train.csv")
    message = str(error.value)
    assert message == "--text_column 'text': no such column in data/train.csv; expected one of ['sentence', 'label']"


def test_no_torch_import():
    # The package's __init__ imports torch; load the module file alone, as a command parsing its options would.
    path = Path(__file__).resolve().parents[2] / "hf_powernorm" / "training" / "checks.py"
    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('checks', {str(path)!r}); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
