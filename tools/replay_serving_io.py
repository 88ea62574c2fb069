"""The serving simulator's clock and I/O channels (``replay_serving_sim``): simulated
seconds with the callbacks due at later times, first-in first-out channels, and the
disk tier's, which runs queued reads before queued writes as its I/O pool does
(``tiered_kv.disk.store.io_pool``). A channel may slow down in episodes (``Slowdown``: a
shared tier's noisy neighbours, a disk's garbage collection) that the decision learns of
only from the transfers it times.

Runs in the replay's one process, single-threaded; no I/O of its own: a channel only
counts the bytes its jobs would move and says when they would end.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


class Events:
    """Simulated time and the callbacks due at later times (ties in scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run_until(self, t: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t:
            self.now, _, fn = heapq.heappop(heap)
            fn()
        self.now = max(self.now, t)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf


@dataclass(frozen=True)
class Slowdown:
    """Episodes of a slow channel: every ``every_s`` seconds, its last ``for_s`` seconds
    (the first episode after a clean ``every_s - for_s``), a job started then takes
    ``factor`` times as long, its latency and bandwidth alike."""

    factor: float
    every_s: float
    for_s: float

    def __post_init__(self) -> None:
        finite = all(math.isfinite(x) for x in (self.factor, self.every_s, self.for_s))
        if not (finite and self.factor >= 1 and self.every_s > 0 and 0 < self.for_s <= self.every_s):
            raise ValueError(
                f"slowdown {self.factor:g},{self.every_s:g},{self.for_s:g}: expected finite FACTOR >= 1, "
                "EVERY_S > 0 and 0 < FOR_S <= EVERY_S"
            )

    @classmethod
    def parse(cls, text: str) -> "Slowdown":
        """``FACTOR,EVERY_S,FOR_S``, e.g. ``10,600,60``: ten times slower for a minute in ten."""
        try:
            factor, every_s, for_s = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"slowdown {text!r}: expected FACTOR,EVERY_S,FOR_S (e.g. 10,600,60)") from None
        return cls(factor, every_s, for_s)

    def at(self, t: float) -> float:
        """The factor on a job started at ``t``."""
        return self.factor if t % self.every_s >= self.every_s - self.for_s else 1.0


class Channel:
    """A first-in first-out I/O channel: one job at a time, each taking ``latency + bytes /
    bandwidth`` (times ``slow``'s factor when it starts) from when the jobs ahead of it are
    done; bytes counted per kind."""

    def __init__(self, events: Events, gbps: float, latency_s: float = 0.0, slow: Slowdown | None = None):
        self.events, self.gbps, self.latency_s, self.slow = events, gbps, latency_s, slow
        self.free_at = 0.0
        self.bytes: Counter[str] = Counter()

    def seconds(self, start: float, nbytes: float, latency_share: float = 1.0) -> float:
        """How long ``nbytes`` started at ``start`` take (``latency_share`` of the job's latency)."""
        factor = self.slow.at(start) if self.slow is not None else 1.0
        return factor * (self.latency_s * latency_share + nbytes / (self.gbps * 1e9))

    def submit(self, nbytes: int, kind: str, done: Callable[[float, float], None]) -> None:
        """Queue a job now; ``done(start, end)`` runs at its end."""
        start = max(self.events.now, self.free_at)
        end = self.free_at = start + self.seconds(start, nbytes)
        self.bytes[kind] += nbytes
        self.events.at(end, lambda: done(start, end))


class ReadsFirstChannel(Channel):
    """A channel that, whenever it is free, starts the oldest queued read (any kind but
    ``"write"``), else the next piece of the oldest write: a write runs in pieces of at
    most ``write_piece`` bytes (the I/O pool's jobs are a chunk's runs, not a whole
    store), the job's latency paid once, and a read waits at most for the piece running."""

    def __init__(
        self, events: Events, gbps: float, latency_s: float = 0.0, slow: Slowdown | None = None, *, write_piece: int
    ):
        super().__init__(events, gbps, latency_s, slow)
        self.write_piece = write_piece
        self._queue: list[tuple[bool, int, list[float], Callable[[float, float], None]]] = []
        self._order = itertools.count()
        self._busy = False

    def submit(self, nbytes: int, kind: str, done: Callable[[float, float], None]) -> None:
        self.bytes[kind] += nbytes
        # [bytes left, latency left, the job's start (set when its first piece starts)]
        heapq.heappush(self._queue, (kind == "write", next(self._order), [float(nbytes), 1.0, -1.0], done))
        if not self._busy:
            self._start()

    def _start(self) -> None:
        if not self._queue:
            self._busy = False
            return
        self._busy = True
        is_write, _, left, done = self._queue[0]
        piece = min(left[0], self.write_piece) if is_write else left[0]
        start = self.events.now
        if left[2] < 0:
            left[2] = start
        end = self.free_at = start + self.seconds(start, piece, left[1])
        left[0] -= piece
        left[1] = 0.0

        def finished() -> None:
            if left[0] <= 0:
                if self._queue[0][3] is done:
                    heapq.heappop(self._queue)
                else:  # a read came first meanwhile
                    self._remove(done)
                done(left[2], end)
            self._start()

        self.events.at(end, finished)

    def _remove(self, done: Callable[[float, float], None]) -> None:
        self._queue = [e for e in self._queue if e[3] is not done]
        heapq.heapify(self._queue)
