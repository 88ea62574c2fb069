"""What the benchmark tools in ``tools/`` share: the header line that dates a run and
names its machine, option parsing, interleaving, ratios and tables, CPU accounting, a
busy Python thread, and the raw O_DIRECT loop every disk benchmark measures against.

Runs in the tool's own process (``spin`` also in a child a tool spawns). Its only I/O:
``RawLoop`` preallocates, writes and reads one file of its own with O_DIRECT;
``cpu_seconds`` reads ``/proc/PID/stat`` of a helper process; ``scratch_dir`` makes a
temporary directory and removes it with everything in it.

A tool imports it as ``from benchlib import ...``: Python puts the running script's
folder first on ``sys.path``, and the tests that import tools put ``tools/`` there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

# The tools import ``tiered_kv`` from this checkout even where it is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_kv.memory.device import empty_pageable  # noqa: E402
from tiered_kv.disk.store.io_backends import host_view  # noqa: E402

MiB = 1 << 20

T = TypeVar("T")


# ---------------------------------------------------------------- run header and options


def machine() -> str:
    """This machine in a few words: host name, CPU count, architecture."""
    return f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}"


def header(tool: str, *details: str) -> str:
    """A run's first line: ``# TOOL  DATE TIME  HOST  N cpus  DETAILS...``, so a pasted
    result always says when and where it was measured."""
    return "  ".join(
        [f"# {tool}", time.strftime("%Y-%m-%d %H:%M"), platform.node(), f"{os.cpu_count()} cpus", *details]
    )


def float_list(text: str) -> list[float]:
    """An option's comma-separated positive numbers (block sizes in MiB: ``0.5,2,8``),
    as an ``argparse`` type: a bad item is a usage error that names it."""
    out = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} in {text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} in {text!r}: expected a number above 0")
        out.append(value)
    return out


@contextlib.contextmanager
def scratch_dir(prefix: str, parent: Path | None = None) -> Iterator[Path]:
    """A fresh directory under ``parent`` (default: the current directory, which is on
    the disk a benchmark is usually run from, unlike /tmp), removed with its contents
    when the block ends."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent or Path.cwd()))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- interleaving and ratios


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` started at position ``r`` (mod its length): round ``r``'s order, so that no
    path always runs right after another while the machine drifts."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


def total_rate(rates: Sequence[float]) -> float:
    """The rate over all measurements of equal size: total bytes / total time (the harmonic
    mean), not the mean of the rates."""
    return len(rates) / sum(1 / x for x in rates)


def median_range(values: Sequence[float]) -> str:
    """``median [min-max]`` with two decimals."""
    ordered = sorted(values)
    return f"{statistics.median(ordered):.2f} [{ordered[0]:.2f}-{ordered[-1]:.2f}]"


def per_round(tier: Sequence[float], raw: Sequence[float]) -> str:
    """Median and range of the per-round ratios ``tier[i] / raw[i]``."""
    return median_range([t / r for t, r in zip(tier, raw)])


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]], left: int = 0) -> str:
    """A Markdown table, every column padded to its widest cell: the first ``left``
    columns (names) left-aligned, the rest (numbers) right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            + " |"
        )

    sep = "|" + "|".join("-" * (w + 2) if i < left else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep, *map(line, cells)])


# ---------------------------------------------------------------- CPU and a busy thread


def cpu_seconds(helper_pid: int | None = None) -> float:
    """User + system CPU time of this process so far (all threads), plus that of the
    helper process ``helper_pid`` (a disk I/O process)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    total = r.ru_utime + r.ru_stime
    if helper_pid is not None:
        fields = Path(f"/proc/{helper_pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def spin(stop, progress: list[int] | None = None) -> None:
    """Plain Python until ``stop`` (a threading or multiprocessing ``Event``) is set;
    ``progress[0]`` counts its loops of 1000 additions."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i
        if progress is not None:
            progress[0] += 1


@contextlib.contextmanager
def busy_thread(on: bool) -> Iterator[list[int]]:
    """While the block runs, a thread of this process runs plain Python (when ``on``), as
    an engine worker's own Python would. Yields its progress counter (``spin``)."""
    stop = threading.Event()
    progress = [0]
    thread = threading.Thread(target=spin, args=(stop, progress), daemon=True) if on else None
    if thread is not None:
        thread.start()
    try:
        yield progress
    finally:
        stop.set()
        if thread is not None:
            thread.join()


# ---------------------------------------------------------------- the raw device


def windows_iovec(view: memoryview, bs: int, windows: int) -> Callable[[int], list[memoryview]]:
    """Block ``i``'s buffer: window ``i % windows`` of ``bs`` bytes in ``view``."""
    return lambda i: [view[i % windows * bs : (i % windows + 1) * bs]]


class RawLoop:
    """O_DIRECT pwrite/pread of ``bs``-byte blocks at sequential offsets on ``threads``,
    block ``i`` from/into window ``i % windows`` of one buffer of ``windows`` blocks
    (by default ``threads``: each thread's few reused megabytes, as fio's). The buffer is
    the tier's long-lived kind (``empty_pageable``); writes end with one ``fdatasync``,
    the least syncing any durable write can do."""

    def __init__(self, path: Path, total: int, bs: int, threads: int, windows: int | None = None):
        windows = windows or threads
        self.path, self.total, self.bs, self.threads = path, total, bs, threads
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.posix_fallocate(fd, 0, total)
        os.close(fd)
        self.buf = empty_pageable(windows * bs)
        self.buf.copy_(torch.randint(0, 256, (windows * bs,), dtype=torch.uint8))
        self.windows = windows

    def run(self, write: bool) -> float:
        """Bytes per second, every block from/into its window."""
        return self.run_iovecs(windows_iovec(host_view(self.buf), self.bs, self.windows), write)

    def run_iovecs(self, iovec: Callable[[int], list[memoryview]], write: bool) -> float:
        """Bytes per second, block ``i`` from/into the buffers ``iovec(i)``."""
        fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
        call = os.pwritev if write else os.preadv
        n = self.total // self.bs

        def one(i: int) -> None:
            call(fd, iovec(i), i * self.bs)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as ex:
            list(ex.map(one, range(n)))
        if write:
            os.fdatasync(fd)
        dt = time.perf_counter() - t0
        os.close(fd)
        return n * self.bs / dt
