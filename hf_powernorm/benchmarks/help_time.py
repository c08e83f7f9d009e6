"""How long the `hf-powernorm` command takes to print its help, against importing the library.

    python -m hf_powernorm.benchmarks.help_time [--repeats 5]

Each command runs in a fresh process as the console script does (a script named `hf-powernorm`
that calls `hf_powernorm.cli.main`); the figure is the process's CPU time (user + system, from
`getrusage` of the finished child), median over the repeats, beside its wall time and whether the
process had imported torch. The last row, `import hf_powernorm`, is what every command that runs
pays first: the norms, the models and Transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .timing import machine_line, markdown

COMMANDS = (["--help"], ["compare", "--help"], ["studies", "--help"])
CONSOLE_SCRIPT = """import json, sys
from hf_powernorm.cli import main
try:
    main()
except SystemExit:
    pass
print(json.dumps("torch" in sys.modules), file=sys.stderr)
"""
LIBRARY = "import sys, json, hf_powernorm; print(json.dumps('torch' in sys.modules), file=sys.stderr)"


def _timed(argv: list[str]) -> tuple[float, float, bool]:
    """CPU seconds, wall seconds, and whether torch was imported, of one fresh process running `argv`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, json.loads(done.stderr.strip().splitlines()[-1])


def measure(repeats: int) -> list[dict[str, object]]:
    """One row per command (and the library's import): median CPU and wall seconds over `repeats`."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "hf-powernorm"
        script.write_text(CONSOLE_SCRIPT, encoding="utf-8")
        cases = {f"hf-powernorm {' '.join(words)}": [sys.executable, str(script), *words] for words in COMMANDS}
        cases["import hf_powernorm"] = [sys.executable, "-c", LIBRARY]
        for name, argv in cases.items():
            runs = [_timed(argv) for _ in range(repeats)]
            rows.append({"command": f"`{name}`", "CPU s": f"{statistics.median(r[0] for r in runs):.2f}",
                         "wall s": f"{statistics.median(r[1] for r in runs):.2f}",
                         "imports torch": "yes" if any(r[2] for r in runs) else "no"})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(prog="python -m hf_powernorm.benchmarks.help_time", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per command (default: 5)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = os.getloadavg()[0]
    rows = measure(args.repeats)
    command = f"python -m hf_powernorm.benchmarks.help_time --repeats {args.repeats}"
    print(machine_line("cpu", command, (start, os.getloadavg()[0])))
    print()
    print(markdown(f"Help against the library's import, median of {args.repeats} fresh processes", list(rows[0]),
                   [list(map(str, row.values())) for row in rows]))
    return rows


if __name__ == "__main__":
    main()
