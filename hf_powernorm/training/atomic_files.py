"""Files and folders written whole or not at all, for checkpoints, exports and study grids.

A file or folder is written under a temporary name beside its final one, flushed to the disk, and
renamed into place (a rename within a folder is atomic on POSIX): after a crash the old version or
the new one is there, never part of one. Leftover temporary names are for their writer to clear. A
temporary file is created anew (`O_EXCL`) and never through a link (`O_NOFOLLOW`): its name is
predictable, and a link planted under it would have the write land in the link's target.
A write that fails (`removed_on_failure`) removes its partial temporary file or folder at once; on
a full disk it raises `DiskFullError`, one line naming the folder that is full.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from .options import BadInput

# What a full disk or quota looks like: an OSError's errno, or the text of PyTorch's writer, which
# turns the stream's failure into a RuntimeError without one.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_TORCH_WRITE_FAILURES = ("iostream error", "PytorchStreamWriter failed writing", "file write failed")


class DiskFullError(OSError):
    """A write stopped because the disk (or the quota) holding its folder is full."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _is_full_disk(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            return True
        if isinstance(error, RuntimeError) and any(text in str(error) for text in _TORCH_WRITE_FAILURES):
            return True
        error = error.__cause__ or error.__context__
    return False


def _free_space(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2 ** 20:.1f} MiB free"
    except OSError:
        return "free space unknown"


def full_disk_error(error: BaseException, folder: Path, message: str | Callable[[], str]) -> DiskFullError | None:
    """`error` as one line, `the disk holding <folder> is full (<free space>): <message>`, when it is a
    full disk (or quota) and not yet said so; else None (the caller re-raises `error`). `message` may
    be a function, called only for a full disk."""
    if isinstance(error, DiskFullError) or not _is_full_disk(error):
        return None
    text = message() if callable(message) else message
    return DiskFullError(errno.ENOSPC, f"the disk holding {folder} is full ({_free_space(folder)}): {text}")


@contextlib.contextmanager
def removed_on_failure(temporary: Path, what: str, remove: bool = True) -> Iterator[None]:
    """The body writes `temporary` (a file or folder written under a temporary name); when it fails,
    `temporary` is removed (by this process if `remove`) and a full disk becomes a `DiskFullError`
    naming `what` and the folder."""
    try:
        yield
    except BaseException as error:
        if remove:
            with contextlib.suppress(OSError):
                remove_path(temporary)
        full = full_disk_error(error, temporary.parent, f"writing {what} failed and its partial copy was "
                                                        f"removed; free some space and run again")
        if full is None:
            raise
        raise full from error


def fsync(path: Path) -> None:
    """Flush a file or folder to the disk (a folder: its entries, after a rename)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON to a temporary file beside `path`, flush it, and rename it into place."""
    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to a new temporary file beside `path`, flush it, and rename it into place."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    descriptor = _create_new(temporary)
    with removed_on_failure(temporary, str(path)):
        with open(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)


def _create_new(path: Path) -> int:
    """A descriptor of a file created at `path` for writing; a regular file there (left by a killed
    writer whose process id this one has) is replaced, anything else is a ValueError naming it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        return os.open(path, flags, 0o666)
    except FileExistsError:
        if path.is_symlink() or not path.is_file():
            kind = "a symbolic link" if path.is_symlink() else "not a regular file"
            raise BadInput(f"{path} is {kind} where a temporary file is written: remove it") from None
    path.unlink()
    return os.open(path, flags, 0o666)


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


def clear_folder(folder: str | Path, keep: Iterable[str] = ()) -> None:
    """Remove everything inside `folder` (kept itself) but the entries named in `keep`."""
    kept = set(keep)
    for path in Path(folder).iterdir():
        if path.name not in kept:
            remove_path(path)


__all__ = ["DiskFullError", "clear_folder", "fsync", "full_disk_error", "remove_path", "removed_on_failure",
           "replace_folder", "write_json_atomically", "write_text_atomically"]
