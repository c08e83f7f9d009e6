"""The `hf-powernorm` command. `hf-powernorm compare ...` answers "does PN help my model?" on the
user's model and data (`hf_powernorm.compare`); `hf-powernorm studies <study> ...` runs one of the
studies (`hf_powernorm.studies`, the same as `python -m hf_powernorm.studies`). A bad input stops
with its message in one line (exit status 2); any other error keeps its traceback. A help text needs
no library: this module, the command's parsers and the package's import on the way to them import no
torch (`hf_powernorm.__init__`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from . import asks_for_help, load_library
from .training.options import BadInput

# Each subcommand is a module with `main(argv)`, imported only when it runs.
COMMANDS = {"compare": "hf_powernorm.compare", "studies": "hf_powernorm.studies.__main__"}
SUMMARIES = {"compare": "does Power Normalization help my model? Each norm fine-tuned on my data over seeds, "
                        "with a paired verdict",
             "studies": "run one of the studies of the paper's claims (`hf-powernorm studies --help` lists them)"}


def run_command(name: str, entry: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None) -> None:
    """`entry(argv)` (default: this process's arguments), a bad input (`BadInput`) shown as one line and
    exit status 2, Ctrl-C as one line (what the command saved, from the interrupt's message) and exit
    status 130; any other error is a bug and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        entry(argv)
    except BadInput as error:
        one_line = " ".join(str(error).split())  # a library's message may span lines
        print(f"hf-powernorm {name}: error: {one_line}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt as interrupt:
        print(f"hf-powernorm {name}: interrupted" + (f": {interrupt}" if str(interrupt) else ""), file=sys.stderr)
        raise SystemExit(130) from None


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        commands = ", ".join(COMMANDS)
        usage = f"usage: hf-powernorm {{{commands}}} [options]   (hf-powernorm {{{commands}}} --help)"
        if argv and argv[0] in ("-h", "--help"):
            print("\n".join([usage, "", "commands:", *(f"  {name:<9} {line}" for name, line in SUMMARIES.items())]))
            raise SystemExit(0)
        print(usage, file=sys.stderr)
        if argv:
            print(f"hf-powernorm: error: unknown command {argv[0]!r}: expected one of {commands}", file=sys.stderr)
        raise SystemExit(2)
    if not asks_for_help(argv[1:]):
        load_library()  # the command runs: the family registered with the Auto classes, as on `import hf_powernorm`
    module = importlib.import_module(COMMANDS[argv[0]])
    run_command(argv[0], module.main, argv[1:])


if __name__ == "__main__":
    main()
