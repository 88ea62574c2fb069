"""The disk tier's I/O thread pool: reads before writes.

Worker processes only (the disk I/O process where ``disk_io: process``); runs the I/O
callables it is given and does none of its own. A load waits on its reads while the
engine's first token waits on the load, whereas a write only fills the cache for later;
under load the tier's queue is mostly writes (spills and write-through copies), so a
first-in first-out pool would put every read behind them. ``IOPool`` runs queued reads
first and writes in the order they came once no read waits. A job already running is
never interrupted, so a read waits at most for the jobs on the pool's threads. Writes
cannot grow without bound behind reads: the scheduler stops issuing them past
``max_pending_disk_writes`` (counted as drops), and reads are bounded by the loads the
engine has asked for.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

#: Priorities of ``IOPool.submit``: lower runs first.
READ = 0
WRITE = 1


class IOPool:
    """``threads`` threads running submitted callables, reads (``READ``) before writes
    (``WRITE``), each class in submission order; a future per job, as
    ``concurrent.futures.ThreadPoolExecutor.submit`` returns."""

    def __init__(self, threads: int, name: str):
        if threads < 1:
            raise ValueError(f"io threads must be >= 1, got {threads}")
        self._queue: list[tuple[int, int, Future, Callable[..., Any], tuple]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = READ) -> Future:
        """Queue ``fn(*args)``; raises ``RuntimeError`` once the pool is shut down."""
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot submit I/O after the pool was shut down")
            heapq.heappush(self._queue, (priority, next(self._order), future, fn, args))
            self._ready.notify()
        return future

    def queued(self) -> int:
        """Jobs waiting for a thread."""
        with self._ready:
            return len(self._queue)

    def shutdown(self, wait: bool = True) -> None:
        """Run the jobs queued so far, then stop the threads (joined where ``wait``).
        Idempotent."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                job = heapq.heappop(self._queue)
            _run_job(*job[2:])
            # Dropped before waiting again: a job's arguments (buffers mapped from the
            # worker) must not outlive it.
            del job


def _run_job(future: Future, fn: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as e:  # handed to whoever waits on the future
        future.set_exception(e)
    else:
        future.set_result(result)
