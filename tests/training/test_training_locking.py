"""`hold_output_folder`: one live process per output folder, a killed holder's lock taken over, the
lock released on exit and on an exception."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hf_powernorm.training.locking import LOCK_NAME, FolderInUse, NotAFolder, hold_output_folder, read_lock

# A second process that holds `folder` until its stdin closes, saying "held" once it does. It loads
# `locking.py` alone (no torch import: it starts in a fraction of a second), as a run would hold it.
LOCKING = Path(__file__).resolve().parents[2] / "hf_powernorm" / "training" / "locking.py"
HOLDER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("locking", {str(LOCKING)!r})
locking = importlib.util.module_from_spec(spec)
spec.loader.exec_module(locking)
with locking.hold_output_folder(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def _start_holder(folder: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_second_start_on_a_live_folder(tmp_path):
    folder = tmp_path / "run"
    holder = _start_holder(folder)
    try:
        assert read_lock(folder)["pid"] == holder.pid
        with pytest.raises(FolderInUse) as error:
            with hold_output_folder(folder):
                pass
        message = str(error.value)
        assert isinstance(error.value, RuntimeError) and "\n" not in message
        assert str(folder) in message and f"process {holder.pid}" in message
        assert read_lock(folder)["pid"] == holder.pid  # the refused start left the holder's lock alone
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    # Released by its holder: the folder (which it created, left empty) is gone, and free again.
    assert not folder.exists()
    with hold_output_folder(folder):
        assert read_lock(folder)["pid"] == os.getpid()


def test_killed_holder_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    holder = _start_holder(folder)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert read_lock(folder)["pid"] == holder.pid  # the killed process left its lock file
    with hold_output_folder(folder):
        assert read_lock(folder)["pid"] == os.getpid()
    assert not (folder / LOCK_NAME).exists()


def test_stale_lock_file_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 2 ** 22 + 1, "host": "elsewhere", "started": "x"}))
    with hold_output_folder(tmp_path):
        assert read_lock(tmp_path)["pid"] == os.getpid()
    assert tmp_path.is_dir() and not (tmp_path / LOCK_NAME).exists()  # a folder it did not create stays


@pytest.mark.parametrize("holder", ["live", "killed", "another host"])
def test_without_flock_the_holders_pid_decides(holder, tmp_path, monkeypatch):
    """On a file system without flock (some network mounts) a lock whose holder runs here, alive,
    or on another host is refused; one whose process is gone is taken over."""
    import errno
    import socket

    from hf_powernorm.training import locking

    def no_flock(descriptor, operation):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(locking.fcntl, "flock", no_flock)
    if holder == "killed":
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait(timeout=30)
        pid = gone.pid
    else:
        pid = os.getpid() if holder == "live" else 2 ** 22 + 1
    host = "elsewhere" if holder == "another host" else socket.gethostname()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host, "started": "x"}))
    if holder == "killed":
        with hold_output_folder(tmp_path):
            assert read_lock(tmp_path)["pid"] == os.getpid()
        return
    with pytest.raises(FolderInUse, match=f"in use by process {pid} on {host}"):
        with hold_output_folder(tmp_path):
            pass
    assert read_lock(tmp_path) == {"pid": pid, "host": host, "started": "x"}


def test_released_on_exception_and_outputs_kept(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(KeyError):
        with hold_output_folder(folder):
            raise KeyError("boom")
    assert not folder.exists()  # created by the failed start, empty: nothing blocks the next one
    with hold_output_folder(folder):
        (folder / "results.json").write_text("{}")
        with pytest.raises(FolderInUse, match=f"process {os.getpid()}"):  # one holder even within a process
            with hold_output_folder(folder):
                pass
    assert sorted(p.name for p in folder.iterdir()) == ["results.json"]


def test_a_file_is_no_output_folder(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(NotAFolder, match=f"^--output_dir {tmp_path / 'run'} is a file, not a folder$"):
        with hold_output_folder(tmp_path / "run"):
            pass


def test_disabled_takes_nothing(tmp_path):
    with hold_output_folder(tmp_path / "run", enabled=False) as folder:
        assert not folder.exists()


def test_a_linked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / LOCK_NAME).symlink_to(target)
    with pytest.raises(ValueError, match=f"^{folder / LOCK_NAME} is a symbolic link; "):
        with hold_output_folder(folder):
            pass
    assert target.read_text() == "mine" and (folder / LOCK_NAME).is_symlink()
    assert read_lock(folder) == {}  # nor read through the link
    (folder / LOCK_NAME).unlink()
    (folder / LOCK_NAME).mkdir()
    with pytest.raises(ValueError, match=f"^{folder / LOCK_NAME} is not a regular file; "):
        with hold_output_folder(folder):
            pass


def test_a_lock_file_of_another_user_is_refused(tmp_path, monkeypatch):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 2 ** 22 + 1, "host": "elsewhere", "started": "x"}))
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path / LOCK_NAME).st_uid + 1)
    with pytest.raises(ValueError, match=f"^{tmp_path / LOCK_NAME} belongs to another user"):
        with hold_output_folder(tmp_path):
            pass
    assert read_lock(tmp_path)["host"] == "elsewhere"


def test_a_folder_it_creates_is_private_and_one_it_finds_keeps_its_mode(tmp_path):
    with hold_output_folder(tmp_path / "run") as folder:
        assert folder.stat().st_mode & 0o777 == 0o700
    os.chmod(tmp_path, 0o755)
    with hold_output_folder(tmp_path):
        assert tmp_path.stat().st_mode & 0o777 == 0o755
