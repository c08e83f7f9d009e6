"""One rule for each quantity a command line gives, shared by the recipes and `hf-powernorm compare`.

Each check takes a value and the option that gave it, returns the value (as its type) when it is
valid and raises a `BadInput` (a ValueError) with one line naming the option, the value and what was
expected otherwise. They need no data and import no torch, so a command runs them all before it
writes anything: a refused start leaves nothing behind.

    check_learning_rate(args.learning_rate)                 # finite and > 0
    check_grid(args.lr_grid, check_learning_rate, "--lr_grid")
    check_columns(dataset.column_names, {"--text_column": "text"}, "train.csv")
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


class BadInput(ValueError):
    """An error in what the user gave (an option, a file, a model, data), raised where it is received:
    the commands print it as one line with exit status 2. Any other exception is a bug and keeps its
    traceback. Defined here, the module that imports nothing, so that it loads alone."""


class MissingInput(BadInput, FileNotFoundError):
    """A file or folder the user named that is not there."""


def _number(value: Any, option: str, expected: str) -> float:
    """`value` as a float; a ValueError naming `option` when it is not a real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise BadInput(f"{option} {value!r}: expected {expected}") from None
    return float(value)


def check_learning_rate(value: Any, option: str = "--learning_rate") -> float:
    """A learning rate: a finite number above 0."""
    number = _number(value, option, "a learning rate, a finite number > 0")
    if not (math.isfinite(number) and number > 0):
        raise BadInput(f"{option} {value}: expected a learning rate, a finite number > 0")
    return number


def check_weight_decay(value: Any, option: str = "--weight_decay") -> float:
    """A weight decay: a finite number at least 0 (0: none)."""
    number = _number(value, option, "a weight decay, a finite number >= 0")
    if not (math.isfinite(number) and number >= 0):
        raise BadInput(f"{option} {value}: expected a weight decay, a finite number >= 0")
    return number


def check_dropout(value: Any, option: str = "--dropout") -> float:
    """A dropout probability: at least 0 and below 1."""
    number = _number(value, option, "a dropout probability in [0, 1)")
    if not 0 <= number < 1:  # NaN fails both comparisons
        raise BadInput(f"{option} {value}: expected a dropout probability in [0, 1)")
    return number


def check_positive_int(value: Any, option: str) -> int:
    """A count: an integer above 0 (a float with an integer value is accepted, a bool is not)."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value <= 0:
        raise BadInput(f"{option} {value!r}: expected an integer > 0")
    return int(value)


def check_grid(values: Iterable[T] | None, check: Callable[[T, str], T], option: str) -> list[T]:
    """The values of a grid option: at least one, each passing `check(value, option)`, none twice."""
    values = list(values or [])
    if not values:
        raise BadInput(f"{option}: expected at least one value, got none")
    checked = [check(value, option) for value in values]
    repeated = sorted({value for value in checked if checked.count(value) > 1}, key=checked.index)
    if repeated:
        raise BadInput(f"{option} {' '.join(map(str, values))}: expected distinct values; "
                       f"{', '.join(map(str, repeated))} given twice")
    return checked


def check_columns(column_names: Iterable[str], wanted: dict[str, str | None], origin: str) -> None:
    """Each column named in `wanted` (option -> column name; None: not asked for) is among
    `column_names` of the data from `origin` (a file, a folder, a dataset id)."""
    available = list(column_names)
    for option, column in wanted.items():
        if column is not None and column not in available:
            raise BadInput(f"{option} {column!r}: no such column in {origin}; expected one of {available}")


__all__ = ["check_columns", "check_dropout", "check_grid", "check_learning_rate", "check_positive_int",
           "check_weight_decay"]
