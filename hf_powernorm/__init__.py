"""Power Normalization for the Hugging Face ecosystem: norm layers, models and recipes.

Importing the package loads the library (`_library.py`: the norms, the models, the converter) and
registers the family with the Auto classes. One process is spared it: the `hf-powernorm` command
(or `python -m hf_powernorm.studies`) asked for a help text, whose parsers import no torch
(`cli.py`); there the library loads when a name of it is first used, or when the command goes on
to run (`load_library`).
"""

import sys
from pathlib import Path

__version__ = "0.1.0"
# How the `hf-powernorm` command starts: its console script, or `python -m` of one of these modules.
COMMAND_NAME, COMMAND_MODULES = "hf-powernorm", ("hf_powernorm.cli", "hf_powernorm.compare", "hf_powernorm.studies")


def _command_asks_for_help() -> bool:
    """Whether this process is the `hf-powernorm` command asking for a help text."""
    started = getattr(sys, "orig_argv", [])
    pairs = set(zip(started, started[1:]))
    by_module = sys.argv[:1] == ["-m"] and any(("-m", module) in pairs for module in COMMAND_MODULES)
    if not (by_module or Path(sys.argv[0]).name == COMMAND_NAME):
        return False
    return asks_for_help(sys.argv[1:])


def asks_for_help(words: list[str]) -> bool:
    """Whether the words of a command line ask for a help text: argparse prints it and stops before
    the command runs."""
    return "-h" in words or "--help" in words


def load_library() -> None:
    """Import the library into the package (once), registering the family with the Auto classes."""
    from . import _library

    globals().update({name: getattr(_library, name) for name in _library.__all__}, __all__=_library.__all__)


def __getattr__(name: str):
    """A name of the library asked for before it loaded: load it now."""
    folder = Path(__file__).parent
    if name.startswith("__") or (folder / name).is_dir() or (folder / f"{name}.py").exists():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # a submodule not imported yet
    load_library()
    if name not in globals():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return globals()[name]


if not _command_asks_for_help():
    load_library()
