"""Several processes from a test: a free port for their rendezvous, and `accelerate launch` run so
that a hang ends with every process's Python stack in the report instead of a bare timeout; a
grid's driver killed once its first run has finished."""

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The launcher's options for two processes on the CPU (gloo); the port comes per launch.
TWO_PROCESSES = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                 "--dynamo_backend", "no"]


def free_port() -> str:
    """A TCP port nothing listens on now, for one rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, children first (from /proc: the launcher starts each rank in a
    session of its own, so no process-group signal reaches them)."""
    children = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():  # no /proc (macOS): the launcher alone
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(0), [])
        found += below
        queue += below
    return found


def _signal(pids: list[int], signum: int, pause: float = 0.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
        time.sleep(pause)  # one stack written at a time


def _run_once(command: list[str], timeout: float) -> tuple[int | None, str]:
    """`(returncode, stdout + stderr)`; `None` when `command` outlived `timeout`: then every process it
    started gets SIGABRT, which `PYTHONFAULTHANDLER` turns into each one's Python stack."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        tree = _descendants(process.pid)
        _signal(tree[::-1] + [process.pid], signal.SIGABRT, pause=0.5)  # the ranks' stacks, then the launcher's
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _signal(tree + _descendants(process.pid) + [process.pid], signal.SIGKILL)
            output, _ = process.communicate()
        return None, output


def accelerate_launch(arguments: list[str], launcher: list[str] = TWO_PROCESSES, timeout: float = 300) -> str:
    """`accelerate launch <launcher> --main_process_port <free> <arguments>` from the repository root
    with one thread per process; returns its stdout and stderr together, and fails the test (with
    the output's end) when it exits with an error.

    These launches take seconds to a minute. Once in many full-suite runs on a loaded 2-core machine
    one rank was seen waiting for the other after it had gone; a launch that outlives `timeout` is
    therefore reported as a warning with every process's stack and run once more on a new port, and
    a second hang fails the test."""
    hangs = []
    for _ in range(2):
        command = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--main_process_port",
                   free_port(), *arguments]
        returncode, output = _run_once(command, timeout)
        if returncode is not None:
            assert returncode == 0, output[-6000:]
            for stacks in hangs:
                warnings.warn(f"a launch of {arguments[0]} hung for {timeout} s, then ran through; "
                              f"its processes' stacks:\n{stacks[-6000:]}", stacklevel=2)
            return output
        hangs.append(output)
    raise AssertionError(f"{arguments[0]} hung twice ({timeout} s each); the processes' stacks:\n"
                         + "\n---\n".join(stacks[-6000:] for stacks in hangs))


def kill_driver_after_first_result(command: list[str], output_dir: Path, timeout: float = 120) -> Path:
    """Start `command` (a grid's driver) in a process group of its own, as a terminal runs it; once
    a first run's `result.json` is in `output_dir/cells`, kill the group (the driver and its running
    jobs, as a lost terminal would) and return that file."""
    driver = subprocess.Popen(command, cwd=ROOT, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not list((output_dir / "cells").glob("*/result.json")):
        assert driver.poll() is None, driver.stderr.read()
        assert time.monotonic() < deadline, f"no run finished within {timeout:g} seconds"
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    (first,) = list((output_dir / "cells").glob("*/result.json"))
    return first

