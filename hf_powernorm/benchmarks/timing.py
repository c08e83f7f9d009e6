"""How the benchmarks measure: allocator control, clocks, thread counts, interleaved repeats, and how
a measurement is written (a table cell, a markdown table, the machine line).

Every figure is a ratio of two workloads measured in the same process, interleaved (A B A B ...),
after warm-up repeats: `interleaved` gives the median ratio over the repeats, its spread (25th-75th
percentile) and the candidate's median time for scale. Glibc's allocator returns freed memory to the
system between repeats (large blocks are mmap-ed and unmapped), so each repeat would page-fault its
tensors afresh and a baseline's time would depend on what ran before it; `control_allocator` fixes
that with `mallopt`. CUDA clocks synchronise before reading the time.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch


def control_allocator() -> bool:
    """glibc: never trim the heap, never mmap blocks below 1 GiB (so freed tensors are reused)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_trim_threshold, -1)) and bool(libc.mallopt(m_mmap_threshold, 1 << 30))


def clock(device: str, cpu_time: bool = False) -> Callable[[], float]:
    """A clock in seconds for work on `device`: on CUDA it waits for the device before reading the time;
    with `cpu_time`, this thread's CPU time (one-thread CPU work on a machine that other jobs share:
    the time the work ran, not the time it waited for a core)."""
    if cpu_time:
        if device != "cpu":
            raise ValueError(f"cpu_time measures CPU work only, got device {device!r}")
        return time.thread_time
    if device == "cuda":
        def synchronized() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()
        return synchronized
    return time.perf_counter


def interleaved(candidate: Callable, baseline: Callable, repeats: int, warmup: int, device: str,
                cpu_time: bool = False) -> dict:
    """A B A B ... after `warmup` pairs; the candidate's median time and the ratio's median and spread
    (`cpu_time`: by this thread's CPU time, see `clock`)."""
    now = clock(device, cpu_time)
    for _ in range(warmup):
        candidate()
        baseline()
    ratios, times = [], []
    for _ in range(repeats):
        start = now()
        candidate()
        middle = now()
        baseline()
        end = now()
        times.append(middle - start)
        ratios.append((middle - start) / (end - middle))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"ms": statistics.median(times) * 1e3, "ratio": statistics.median(ratios),
            "low": quartiles[0], "high": quartiles[2]}


@contextlib.contextmanager
def num_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count within the block."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cell(result: dict) -> str:
    """An `interleaved` result as a table cell: `ratio (25%-75%), candidate ms`."""
    return f"{result['ratio']:.2f} ({result['low']:.2f}-{result['high']:.2f}), {result['ms']:.2f} ms"


def markdown(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [f"#### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def machine_line(device: str, command: str, loads: tuple) -> str:
    import transformers

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as info:
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    gpu = f", {torch.cuda.get_device_name()}" if device == "cuda" else ""
    return (f"Machine: {cpu}, {os.cpu_count()} cores{gpu}; Python {platform.python_version()}, torch "
            f"{torch.__version__}, transformers {transformers.__version__}; "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; load average "
            f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end (other jobs on the machine). "
            f"Command: `{command}`.")


__all__ = ["cell", "clock", "control_allocator", "interleaved", "machine_line", "markdown", "num_threads", "progress"]
