"""`python -m hf_powernorm.studies <study> [options]`: run one study (`--help` lists them; `<study>
--help` gives its options). The same as `python -m hf_powernorm.studies.<study> [options]`.
`python -m hf_powernorm.studies docs [--check]` writes the documents' results tables from the
studies' data files (`documents`). A study whose runs failed as jobs of `--executor submitit` or
`ray` stops with exit status 1 and one line naming each failed run with its log."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import STUDIES


def main(argv: list[str] | None = None) -> object:
    argv = sys.argv[1:] if argv is None else list(argv)
    listing = "\n".join(f"  {name:<18} {line}" for name, line in STUDIES.items())
    # Named as the user typed it: the console script's `hf-powernorm studies`, else `python -m`.
    console = os.path.basename(sys.argv[0]) == "hf-powernorm"
    prog = "hf-powernorm studies" if console else "python -m hf_powernorm.studies"
    parser = argparse.ArgumentParser(
        prog=prog, usage="%(prog)s [-h] study [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one study of PowerNorm; its outputs go to its --output_dir.",
        epilog=f"studies:\n{listing}\n\n`{prog} <study> --help` gives a study's options;\n"
               f"`{prog} docs [--check]` writes the documents' results tables from the data.")
    parser.add_argument("study", choices=list(STUDIES), metavar="study", help="one of the studies below")
    if argv[:1] == ["docs"]:
        from .documents import main as write_documents

        return write_documents(argv[1:])
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv)  # --help, or an error naming the missing study
    study = parser.parse_args(argv[:1]).study
    module = importlib.import_module(f"{__package__}.{study}")
    from ..training.executors import RunsFailed  # the library, imported by the study (not for `--help`)

    # The study's own parser names its program after argv[0]: the command as typed, not __main__.py.
    program, sys.argv[0] = sys.argv[0], f"{parser.prog} {study}"
    try:
        return module.main(argv[1:])
    except RunsFailed as failed:  # jobs of --executor submitit or ray: each named with its log
        print(f"{sys.argv[0]}: {failed}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        sys.argv[0] = program


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
