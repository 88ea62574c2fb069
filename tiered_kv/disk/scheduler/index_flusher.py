"""The disk manager's index flusher: the background thread of a ``DiskOffloadingManager``.

Scheduler process, on a thread of its own (never the scheduler's): while blocks are
pending it polls the workers' log every ``poll_interval`` (``refresh``: LMDB read
transactions, applied a chunk per hold of the manager's lock), and it writes what the
manager queued for the index (access times, deletions of entries that must not come
back, log trimming) in one LMDB write transaction ``flush_interval`` after a wake-up
(``DiskIndex.apply_batch``), at once for ``flush`` and ``stop``. Why losing those
updates in a crash is safe: ``manager.py``'s docstring.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from tiered_kv.disk.format.index import DiskIndex

logger = logging.getLogger(__name__)

__all__ = ["FlushCounters", "IndexFlusher"]

#: Log records the flusher reads at a time, and applies per lock hold.
_REFRESH_READ = 4096
_REFRESH_CHUNK = 64
#: The longest wait before a failed write of slot releases is tried again.
_RETRY_MAX = 1.0


class FlushCounters(Protocol):
    """The counters the flusher keeps (``DiskManagerStats``)."""

    index_flushes: int
    index_flush_errors: int


class _Refreshed(Protocol):
    more: bool


class IndexFlusher:
    """Queues a manager's index updates and writes them from its thread.

    ``lock`` is the manager's lock: ``delete``, ``touch`` and ``trim_to`` are called
    with it held, and the thread takes it to collect the queue. ``poll_interval()``
    says how long to wait between polls of the log (None: no blocks are pending, do not
    poll); ``refresh(max_records, records_per_hold)`` polls it; ``still_held`` names
    the ``(hash, slot)`` deletions the manager stored again meanwhile (checked inside
    the write transaction, so a re-store survives). ``released(slots)`` is called
    (lock held) with the slots of deletions queued with ``release=True`` once the write
    that applied them has committed. ``stats`` counts the writes.
    """

    def __init__(
        self,
        index: DiskIndex,
        lock: threading.Lock,
        stats: FlushCounters,
        *,
        flush_interval: float,
        poll_interval: Callable[[], float | None],
        refresh: Callable[[int, int], _Refreshed],
        still_held: Callable[[Iterable[tuple[bytes, int]]], set[tuple[bytes, int]]],
        released: Callable[[list[int]], None] = lambda slots: None,
    ):
        self._index, self._lock, self._stats = index, lock, stats
        self._flush_interval = flush_interval
        self._poll_interval, self._refresh, self._still_held = poll_interval, refresh, still_held
        self._deletions: list[tuple[bytes, int]] = []
        self._released = released
        self._releases: list[tuple[bytes, int]] = []  # deletions whose slots wait for them
        self._retry = flush_interval  # until a failed write of releases is tried again
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._trim_upto = 0
        self._wake = threading.Event()
        self._stop = False
        self._flush_cond = threading.Condition()
        self._flush_requested = 0
        self._flush_done = 0
        self.thread = threading.Thread(target=self._loop, name="tkv-disk-index-flusher", daemon=True)

    # ------------------------------------------------------------ the manager's side

    def start(self) -> None:
        """Start the thread and write what was queued before it (the startup reclaim)."""
        self.thread.start()
        self._wake.set()

    def wake(self) -> None:
        """Something changed: poll now if polling, and write the queue soon."""
        self._wake.set()

    def delete(self, h: bytes, slot: int, release: bool = False) -> None:
        """Queue the deletion of ``h``'s entry if it still points at ``slot`` (lock held);
        ``release``: hand ``slot`` to ``released`` once the deletion is written (a failed
        write is retried with the next)."""
        (self._releases if release else self._deletions).append((h, slot))

    def touch(self, h: bytes, now: float, hits: int) -> None:
        """Queue an access of ``h`` at ``now`` adding ``hits`` hits (lock held)."""
        _, before = self._touches.get(h, (now, 0))
        self._touches[h] = (now, before + hits)

    def trim_to(self, seq: int) -> None:
        """Queue the trimming of the log up to record ``seq`` (lock held)."""
        self._trim_upto = seq

    def flush(self, timeout: float) -> bool:
        """Block until the index reflects every update queued so far; True if it did
        within ``timeout``."""
        with self._flush_cond:
            self._flush_requested += 1
            target = self._flush_requested
        self._wake.set()
        with self._flush_cond:
            return self._flush_cond.wait_for(lambda: self._flush_done >= target or self._stop, timeout)

    def stop(self, timeout: float = 30) -> None:
        """Write what is queued and stop the thread."""
        with self._flush_cond:
            self._stop = True
        self._wake.set()
        if self.thread.ident is not None:
            self.thread.join(timeout=timeout)

    # ------------------------------------------------------------ the thread

    def _loop(self) -> None:
        """Poll the log every ``poll_interval`` while blocks are pending, and write the
        updates queued since a wake-up (or a poll) ``flush_interval`` after it, in one
        transaction (at once for ``flush`` and ``stop``). The two clocks are separate: when the
        poll waited for the write interval, a burst of stores filled the composite's
        bound on pending disk writes between polls, and the scheduler's own call then
        read the log itself, which made its cascading calls slow (docs/benchmarks.md,
        "Scheduler cost")."""
        write_at: float | None = None  # when the queued updates are due
        while True:
            poll = self._poll_interval()
            polling = poll is not None
            timeout = poll
            if write_at is not None:
                due = max(0.0, write_at - time.monotonic())
                timeout = due if timeout is None else min(timeout, due)
            woke = self._wake.wait(timeout)
            self._wake.clear()  # before reading the requests, so a later one wakes us again
            with self._flush_cond:
                stop = self._stop
                requested = self._flush_requested
            if polling:
                self._refresh_in_chunks()
            if write_at is None and (woke or polling):  # touches queue without waking us
                write_at = time.monotonic() + self._flush_interval  # let updates accumulate
            if not (stop or requested > self._flush_done or (write_at is not None and time.monotonic() >= write_at)):
                continue
            write_at = None
            if not self._write_updates() and self._releases:  # slots wait for it: retry, backing off
                write_at = time.monotonic() + self._retry
                self._retry = min(_RETRY_MAX, 2 * self._retry)
            else:
                self._retry = self._flush_interval
            with self._flush_cond:
                self._flush_done = max(self._flush_done, requested)
                self._flush_cond.notify_all()
                if stop:
                    return

    def _write_updates(self) -> bool:
        """Write the queued access times, deletions and log trimming to the index; False
        if the write failed (the releases stay queued)."""
        with self._lock:
            deletions, self._deletions = self._deletions, []
            releases, self._releases = self._releases, []
            touches, self._touches = self._touches, {}
            trim = self._trim_upto
        if not (deletions or releases or touches or trim):
            return True
        try:
            self._index.apply_batch(deletions + releases, touches, trim, self._still_held)
            self._stats.index_flushes += 1
            with self._lock:
                if self._trim_upto == trim:
                    self._trim_upto = 0
                if releases:
                    self._released([slot for _, slot in releases])
            return True
        except Exception:
            with self._lock:  # until its entry is gone the slot must not take the block again
                self._releases[:0] = releases
            self._stats.index_flush_errors += 1
            logger.exception(
                "disk index flush of %d deletions, %d touches failed; they are "
                "dropped (the index stays safe: workers clear stale entries "
                "before overwriting a slot); %d failed stores' slots wait for a retry",
                len(deletions),
                len(touches),
                len(releases),
            )
            return False

    def _refresh_in_chunks(self) -> None:
        """Learn the workers' outcomes off the scheduler thread, in short lock holds:
        the scheduler's own calls then find them applied instead of reading the log."""
        try:
            while self._refresh(_REFRESH_READ, _REFRESH_CHUNK).more:
                time.sleep(0)
        except Exception:  # the flusher must survive; the scheduler's own refresh still works
            logger.exception("background refresh of the disk index log failed")
