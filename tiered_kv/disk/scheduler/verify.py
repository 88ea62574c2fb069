"""Read-back verification of disk chunks before vLLM is told they are hits.

Scheduler process, on this module's own threads (never the scheduler's): for each chunk
the manager asks about, read the chunk's bytes of **every rank** from the slab files with
``DiskStore.read_blocks``, which checks each against the checksum recorded for that rank
and, on a mismatch or a missing entry, drops the chunk from the index and logs a
``corrupt`` record (which the disk manager's ``refresh`` turns into an eviction). The
result, ok or not, is queued for the manager to collect on its own thread; nothing else
is shared, so the manager needs no lock. Each verification's seconds (every rank's read
and check) go to ``latencies`` for the manager's stats.

Cost: one extra read of the chunk per rank (the worker reads it again to load it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from tiered_kv.abstract import Closing
from tiered_kv.disk.store.io_backends import aligned_empty
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.metrics import VERIFICATION_SECONDS, Latencies

logger = logging.getLogger(__name__)


class Verification(NamedTuple):
    """The outcome for chunk ``key`` as found in disk slot ``slot``."""

    key: bytes
    slot: int
    ok: bool


class DiskVerifier(Closing):
    """Verifies disk chunks on ``threads`` threads. ``store`` is opened by the caller for
    writing (so a corrupt chunk can be dropped from the index) and closed here."""

    def __init__(self, store: DiskStore, num_ranks: int, threads: int = 2):
        self.store = store
        self.num_ranks = num_ranks
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tkv-verify")
        self._done: queue.SimpleQueue[Verification] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight = 0
        self.latencies = Latencies()

    def submit(self, key: bytes, slot: int) -> None:
        """Start verifying chunk ``key`` in ``slot``; the outcome comes from ``results``."""
        with self._lock:
            self._inflight += 1
        self._pool.submit(self._verify, key, slot)

    def busy(self) -> bool:
        """Whether an outcome is still to come (or not yet collected)."""
        with self._lock:
            return self._inflight > 0

    def results(self) -> list[Verification]:
        """Outcomes finished since the last call (never blocks; cheap when there are none:
        the scheduler asks on every lookup)."""
        out = []
        while not self._done.empty():  # one consumer: what it saw is there to take
            out.append(self._done.get_nowait())
        if out:
            with self._lock:
                self._inflight -= len(out)
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is in flight (tests, tools). True if so within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = self._inflight - self._done.qsize()
            if pending <= 0:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def _verify(self, key: bytes, slot: int) -> None:
        ok = False
        start = time.perf_counter()
        try:
            rows = aligned_empty(self.store.slot_size).view(1, self.store.slot_size)
            ok = all(self.store.read_blocks(rank, [key], [slot], rows)[0] for rank in range(self.num_ranks))
        except Exception:
            logger.exception("verifying disk chunk %s (slot %d) failed", key.hex()[:16], slot)
        self.latencies.observe(VERIFICATION_SECONDS, ("disk",), time.perf_counter() - start)
        if not ok:
            logger.warning("disk chunk %s (slot %d) failed verification; it will be recomputed", key.hex()[:16], slot)
        self._done.put(Verification(key, slot, ok))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()
