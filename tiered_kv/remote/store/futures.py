"""Futures of batches: the store's requests run one per thread and a caller gets one
future per batch, and each request answers by a deadline (``Deadlines``: a watchdog
thread). Combinators, no I/O; used by ``store.RemoteStore``."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def gather(futures: list[Future], combine: Callable[[list[Any]], object] = list) -> Future:
    """One future for a batch: ``combine`` of the results, in order, once all are done."""
    out: Future = Future()
    if not futures:
        out.set_result(combine([]))
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            try:
                out.set_result(combine([f.result() for f in futures]))
            except BaseException as exc:  # a bug in a task: surfaces on the batch future
                out.set_exception(exc)

    for f in futures:
        f.add_done_callback(done)
    return out


def chain(source: Future, target: Future) -> None:
    """Settle ``target`` as ``source`` settles."""

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            target.set_exception(exc)
        else:
            target.set_result(f.result())

    source.add_done_callback(done)


def split_batches(items: list[T], sizes: list[int], count: int, limit: int) -> list[list[T]]:
    """``items`` in order, in runs of at most ``count`` items and ``limit`` bytes (``sizes``:
    each item's); an item larger than ``limit`` is a run of its own."""
    batches: list[list[T]] = []
    total = 0
    for item, size in zip(items, sizes):
        if not batches or len(batches[-1]) == count or total + size > limit:
            batches.append([])
            total = 0
        batches[-1].append(item)
        total += size
    return batches


def done_future(value: T) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def all_present(answers: list[bool | None]) -> bool | None:
    """Every rank's object there: False if one is missing, None if one is unknown."""
    if any(a is False for a in answers):
        return False
    return None if any(a is None for a in answers) else True


def present_per_block(batches: list[list[bool | None]], ranks: int) -> list[bool | None]:
    """``all_present`` of each block's ``ranks`` answers, from batches of answers in
    block-then-rank order."""
    answers = [a for batch in batches for a in batch]
    return [all_present(answers[i : i + ranks]) for i in range(0, len(answers), ranks)]


class Claim:
    """Who settles one request: the request itself (``take``, before it writes into the
    caller's buffer or counts its outcome) or its deadline (``expire``), whichever comes
    first, once. ``started``: the request left the pool's queue."""

    __slots__ = ("_lock", "_state", "started")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = 0  # 0: open, 1: the request's, 2: expired
        self.started = False

    def take(self) -> bool:
        """True where the request settles its outcome (again: it may ask more than once)."""
        with self._lock:
            if self._state == 0:
                self._state = 1
            return self._state == 1

    @property
    def expired(self) -> bool:
        return self._state == 2

    def expire(self) -> bool:
        """True where the deadline settles it: the request's answer, if it comes, is dropped."""
        with self._lock:
            if self._state == 0:
                self._state = 2
            return self._state == 2


class Deadlines:
    """Requests on a pool that answer by a deadline: a request still out ``seconds``
    after its submission is settled by ``on_expiry`` (from a watchdog thread, started on
    first use), whatever the backend's own timeouts. A request that answers late finds
    its ``Claim`` expired and must leave the caller's buffers and the counters alone.
    """

    def __init__(self, seconds: float, name: str = "tkv-deadline"):
        self.seconds = seconds
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, pool: Executor, fn: Callable[..., T], *args: Any, on_expiry: Callable[[Claim], T]) -> Future:
        """``fn(claim, *args)`` on ``pool``; its future settles with its result, or with
        ``on_expiry(claim)`` at the deadline."""
        claim = Claim()
        out: Future = Future()

        def run() -> T | None:
            if claim.expired:  # settled while queued: not sent at all
                return None
            claim.started = True
            return fn(claim, *args)

        def done(inner: Future) -> None:
            if not claim.take():
                return
            exc = inner.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(inner.result())

        def expire() -> None:
            if claim.expire():
                out.set_result(on_expiry(claim))

        pool.submit(run).add_done_callback(done)
        self._at(time.monotonic() + self.seconds, expire)
        return out

    def _at(self, when: float, callback: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                return
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name=self._name, daemon=True)
                self._thread.start()
            elif self._heap[0][1] == self._seq:
                self._cond.notify()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, callback = heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # a bug in an expiry: never stops the watchdog
                logger.exception("shared tier: settling a request past its deadline failed")

    def close(self) -> None:
        """Stop the watchdog; requests still out settle by their own answers."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
