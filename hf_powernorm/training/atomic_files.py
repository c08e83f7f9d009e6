"""Files and folders written whole or not at all, for checkpoints, exports and study grids.

A file or folder is written under a temporary name beside its final one, flushed to the disk, and
renamed into place (a rename within a folder is atomic on POSIX): after a crash the old version or
the new one is there, never part of one. Leftover temporary names are for their writer to clear.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def fsync(path: Path) -> None:
    """Flush a file or folder to the disk (a folder: its entries, after a rename)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON to a temporary file beside `path`, flush it, and rename it into place."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    fsync(temporary)
    os.replace(temporary, path)


def replace_folder(temporary: Path, final: Path) -> None:
    """Rename the complete `temporary` folder to `final`; an older `final` (the same update
    written again) is moved aside first and removed after."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.is_symlink():
        final.unlink()
    elif final.exists():
        os.rename(final, old)
    os.rename(temporary, final)
    fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


def remove_path(path: Path) -> None:
    """Delete a file, a link or a folder with its contents; nothing where there is nothing."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def clear_folder(folder: str | Path) -> None:
    """Remove everything inside `folder` (kept itself)."""
    for path in Path(folder).iterdir():
        remove_path(path)


__all__ = ["clear_folder", "fsync", "remove_path", "replace_folder", "write_json_atomically"]
