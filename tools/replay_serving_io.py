"""The serving simulator's clock and I/O channels (``replay_serving_sim``): simulated
seconds with the callbacks due at later times, and first-in first-out channels.

Runs in the replay's one process, single-threaded; no I/O of its own: a channel only
counts the bytes its jobs would move and says when they would end.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable


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


class Channel:
    """A first-in first-out I/O channel: one job at a time, each taking ``latency + bytes /
    bandwidth`` from when the jobs ahead of it are done; bytes counted per kind."""

    def __init__(self, events: Events, gbps: float, latency_s: float = 0.0):
        self.events, self.gbps, self.latency_s = events, gbps, latency_s
        self.free_at = 0.0
        self.bytes: Counter[str] = Counter()

    def submit(self, nbytes: int, kind: str, done: Callable[[float, float], None]) -> None:
        """Queue a job now; ``done(start, end)`` runs at its end."""
        start = max(self.events.now, self.free_at)
        end = self.free_at = start + self.latency_s + nbytes / (self.gbps * 1e9)
        self.bytes[kind] += nbytes
        self.events.at(end, lambda: done(start, end))
