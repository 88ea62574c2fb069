"""What ``tools/bench_disk.py`` records beside throughput: the cyclic garbage collector's
pauses per path (``GcPauses``, in a heap frozen as a vLLM worker's is: ``worker_heap``)
and, with ``--trace``, every ``preadv``/``pwritev`` call timed (``IOTrace``).

Runs in the benchmark's process; does no I/O itself (``IOTrace`` wraps ``os.preadv`` and
``os.pwritev`` while a path runs).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable


class GcPauses:
    """Milliseconds the cyclic garbage collector ran (holding the GIL, so no I/O thread
    can start its next call meanwhile), per path (``key``)."""

    def __init__(self) -> None:
        self.key = ""
        self.ms: dict[str, float] = defaultdict(float)
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms[self.key] += (time.perf_counter() - self._t0) * 1e3


class IOTrace:
    """``--trace``: every ``os.preadv``/``os.pwritev`` call of this process timed while a
    path runs (the raw loops' threads and the tier's I/O threads alike), to tell the two
    ways a path can lose against raw apart: fewer calls in flight on average (the time
    between a thread's calls: checksums and waits for the GIL) or slower calls (what the
    device makes of the buffers: how scattered, where in memory)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # busy s, wall s, calls
        #: Per path: seconds before its first call began and after its last call ended,
        #: summed over measurements, and how many measurements.
        self.edges: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        self._busy = [0.0, 0]
        self._span = [math.inf, 0.0]  # first call's start, last call's end
        self._lock = threading.Lock()

    def _timed(self, call: Callable) -> Callable:
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return call(*args)
            finally:
                t1 = time.perf_counter()
                with self._lock:
                    self._busy[0] += t1 - t0
                    self._busy[1] += 1
                    self._span[0] = min(self._span[0], t0)
                    self._span[1] = max(self._span[1], t1)

        return timed

    @contextlib.contextmanager
    def measuring(self, key: str):
        """Time the calls made until the block ends, as path ``key``'s."""
        real = os.preadv, os.pwritev
        self._busy, self._span = [0.0, 0], [math.inf, 0.0]
        os.preadv, os.pwritev = (self._timed(c) for c in real)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            os.preadv, os.pwritev = real
            cell = self.calls[key]
            cell[0] += self._busy[0]
            cell[1] += t1 - t0
            cell[2] += self._busy[1]
            if self._busy[1]:
                edges = self.edges[key]
                edges[0] += self._span[0] - t0
                edges[1] += t1 - self._span[1]
                edges[2] += 1

    def cell(self, key: str) -> str:
        """Mean calls in flight x mean milliseconds per call."""
        busy, wall, n = self.calls[key]
        return f"{busy / wall:.2f} x {busy / max(1, n) * 1e3:5.2f}"

    def edges_cell(self, key: str) -> str:
        """Mean milliseconds before the first call and after the last, per measurement."""
        before, after, n = self.edges[key]
        return f"{before / max(1, n) * 1e3:5.1f} + {after / max(1, n) * 1e3:5.1f}"


@contextlib.contextmanager
def worker_heap(frozen: bool):
    """Run the measurements in a worker process's heap: frozen after setup (``gc.freeze``),
    as vLLM's GPU worker freezes it after warm-up (``freeze_gc_heap``), so a full
    collection does not walk torch's and the model's objects; ``frozen=False`` leaves
    it live. Yields the ``GcPauses`` it records."""
    pauses = GcPauses()
    if frozen:
        gc.collect()
        gc.freeze()
    gc.callbacks.append(pauses)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses)
        if frozen:
            gc.unfreeze()
