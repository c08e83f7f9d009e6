"""An output folder used by one process at a time: a lock file inside it, held for the whole run.

`hold_output_folder(folder)` creates the folder if needed, private to this user (mode 0700: the
runs' jobs read back what it holds), and takes `folder/.lock`: the file is created with `O_EXCL`
and never reached through a link (`O_NOFOLLOW`: a `.lock` planted as a link to another file would
have the lock's line written into that file); an existing lock file is taken only if it is a
regular file of this user's, else a ValueError names it. The file holds one JSON line (the
holder's pid, host name and start time), and the holder keeps an exclusive `fcntl.flock` on it,
which the kernel drops when the process ends however it ends. A second start on a live folder
raises `FolderInUse` naming the first process; a lock file left by a killed process (its flock
free; where the file system has no flock, its pid gone from this host) is taken over. On exit, also
on an exception, the lock file is removed, and the folder too when the holder created it and left it
empty, so a refused or failed start blocks nothing.

    with hold_output_folder(args.output_dir, enabled=accelerator.is_main_process):
        ...  # the run

Under Accelerate with several processes only the main process takes the lock (`enabled=False`
elsewhere makes it a no-op): the other ranks write only after a barrier that the main process
reaches once it holds the lock, and a refused main process ends the launch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LOCK_NAME = ".lock"
# Errors of a file system without flock (some network mounts): fall back to the holder's pid.
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


class FolderInUse(RuntimeError):
    """Another live process holds the output folder."""


class NotAFolder(ValueError):
    """The output folder's path (`--output_dir`, as every caller names it) is a file."""


def read_lock(folder: str | Path) -> dict[str, Any]:
    """What `folder`'s lock file says of its holder (`pid`, `host`, `started`); {} when none or unreadable."""
    try:
        with open(os.open(Path(folder) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW), encoding="utf-8") as handle:
            holder = json.loads(handle.read())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _flock(descriptor: int, holder: dict[str, Any]) -> bool:
    """Take the flock without waiting; False when a live process holds it."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno not in _NO_FLOCK:
            raise
        # No flock here: the holder is live if it runs on another host or its pid is alive here.
        return not (holder and (holder.get("host") != socket.gethostname() or _pid_alive(holder.get("pid"))))
    return True


def _open_lock(path: Path) -> tuple[int, bool]:
    """A descriptor of the lock file, and whether this call created it. An existing one is opened
    only if it is a regular file of this user's, not through a link: another user's file could be
    swapped under its holder, and a link would have the lock written into its target."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), True
    except FileExistsError:
        pass
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO does not block
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _not_a_lock(path, "is a symbolic link") from None
        if error.errno == errno.EISDIR:
            raise _not_a_lock(path, "is not a regular file") from None
        raise
    status = os.fstat(descriptor)
    if stat.S_ISREG(status.st_mode) and status.st_uid == os.getuid():
        return descriptor, False
    os.close(descriptor)
    if not stat.S_ISREG(status.st_mode):
        raise _not_a_lock(path, "is not a regular file")
    raise _not_a_lock(path, f"belongs to another user (uid {status.st_uid})")


class NotALock(ValueError):
    """The output folder's lock is not a regular file of this user's: the folder is refused."""


def _not_a_lock(path: Path, why: str) -> NotALock:
    return NotALock(f"{path} {why}; an output folder's lock must be a regular file of this user's: remove it, "
                    f"or choose another output folder")


def _same_file(descriptor: int, path: Path) -> bool:
    """Whether `path` is still the file open as `descriptor` (a releasing holder unlinks it)."""
    try:
        return os.path.samestat(os.fstat(descriptor), os.lstat(path))
    except FileNotFoundError:
        return False


def _acquire(folder: Path) -> int:
    """The descriptor of `folder`'s lock file, flocked and holding this process's description."""
    path = folder / LOCK_NAME
    while True:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            descriptor, created = _open_lock(path)
        except FileNotFoundError:  # the lock or the folder went between two calls: try again
            continue
        holder = {} if created else read_lock(folder)
        if not _flock(descriptor, holder):
            os.close(descriptor)
            holder = read_lock(folder) or holder
            raise FolderInUse(f"{folder} is in use by process {holder.get('pid', '?')} on "
                              f"{holder.get('host', '?')} (started {holder.get('started', '?')}); wait for it "
                              f"to end or choose another output folder")
        if _same_file(descriptor, path):
            break
        os.close(descriptor)  # locked a file its holder had just removed
    os.ftruncate(descriptor, 0)
    description = {"pid": os.getpid(), "host": socket.gethostname(),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.pwrite(descriptor, (json.dumps(description) + "\n").encode(), 0)
    os.fsync(descriptor)
    return descriptor


def _release(folder: Path, descriptor: int, created_folder: bool) -> None:
    """Remove the lock file (still holding the flock), then the folder if this run made it and left it empty."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / LOCK_NAME)
    os.close(descriptor)
    if created_folder:
        with contextlib.suppress(OSError):  # not empty: the run's outputs, or the next holder's lock
            folder.rmdir()


@contextlib.contextmanager
def hold_output_folder(folder: str | Path, enabled: bool = True) -> Iterator[Path]:
    """Hold `folder` (created if needed) for the body of the `with`; `FolderInUse` when a live
    process holds it. `enabled=False` (the other processes of a launch) takes nothing."""
    folder = Path(folder)
    if not enabled:
        yield folder
        return
    if folder.exists() and not folder.is_dir():
        raise NotAFolder(f"--output_dir {folder} is a file, not a folder")
    created_folder = not folder.exists()
    descriptor = _acquire(folder)
    try:
        yield folder
    finally:
        _release(folder, descriptor, created_folder)


__all__ = ["LOCK_NAME", "FolderInUse", "hold_output_folder", "read_lock"]
