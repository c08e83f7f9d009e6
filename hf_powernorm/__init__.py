"""Power Normalization for the Hugging Face ecosystem: norm layers, models and recipes.

Importing the package loads the library (`_library.py`: the norms, the models, the converter) and
registers the family with the Auto classes. One process is spared it: a command of the package
asked for a help text (`hf-powernorm ... --help`, `python -m hf_powernorm.<module> ... --help`),
whose parsers import no torch (`cli.py`); there the library loads when a name of it is first used,
or when the command goes on to run (`load_library`).
"""

import sys
from pathlib import Path

__version__ = "0.1.0"
COMMAND_NAME = "hf-powernorm"  # the console script


def _command_asks_for_help() -> bool:
    """Whether this process is a command of the package asking for a help text: the `hf-powernorm`
    console script, or `python -m` of a module of the package, whose `sys.argv[0]` is `-m` while the
    package imports (Python sets it so until it has found the module)."""
    if not (sys.argv[:1] == ["-m"] or Path(sys.argv[0]).name == COMMAND_NAME):
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
