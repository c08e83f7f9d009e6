"""The run's own log: one JSON object per line in `<output_dir>/training_log.jsonl` for every
update (loss, learning rate, tokens/s, epoch) and every validation, written by the main process
whether or not a tracker is on, so that a run can be plotted and compared without TensorBoard. A
resumed run first drops the records after its checkpoint (`drop_records_after`), so each update is
logged once."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .atomic_files import write_text_atomically
from .options import MissingInput

LOG_NAME = "training_log.jsonl"


class RunLog:
    """Appends records to `<output_dir>/training_log.jsonl` (a resumed run appends after the
    records of its first part); `enabled=False` (other processes) writes nothing."""

    def __init__(self, output_dir: str | Path, enabled: bool = True) -> None:
        self.path = Path(output_dir) / LOG_NAME
        self.enabled = enabled

    def write(self, **record: Any) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(clean, sort_keys=True) + "\n")


def read_run_log(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's `training_log.jsonl`, oldest first."""
    path = Path(output_dir) / LOG_NAME
    if not path.is_file():
        raise MissingInput(f"{path} not found: no run has logged to {output_dir}")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _log_step(line: str) -> float:
    """The update of a log record; a line cut short by a kill counts as after every update."""
    try:
        return json.loads(line).get("step", 0) if line.endswith("\n") else math.inf
    except json.JSONDecodeError:
        return math.inf


def drop_records_after(output_dir: str | Path, step: int) -> None:
    """A run killed after its last checkpoint logged updates that the resumed run does again: keep
    the log's records up to `step` (and none cut short), so that each update is logged once."""
    path = Path(output_dir) / LOG_NAME
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if _log_step(line) <= step]
    if len(kept) < len(lines):
        write_text_atomically(path, "".join(kept))
