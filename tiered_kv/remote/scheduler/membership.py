"""Which blocks the shared tier holds, as the scheduler knows without waiting.

Runs in the scheduler process. ``MembershipCache`` is plain memory: blocks known to be
in the bucket (bounded, least recently used first out) and blocks known not to be (each
trusted for ``absent_ttl`` seconds, since another node may upload it any time). Nothing
here lists the bucket. ``MembershipProber`` fills the cache: ``lookup`` answers from
the cache at once, and where it meets blocks it knows nothing of, it queues one batched
existence probe (``RemoteStore.exists``: HEAD requests on the store's threads) and says
the answer is pending; the probe's results land in the cache from the store's threads,
and the next lookup of the same blocks answers from them. A probe the server did not
answer counts as absent for ``absent_ttl``, so a dead server costs misses, not a
lookup that stays pending.

The tier's manager keeps the cache true to its own actions: ``mark_present`` after its
uploads completed, ``forget`` (or ``mark_absent``) after a download missed.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import NamedTuple, Protocol

from tiered_kv.abstract import BlockHash


class Membership(enum.Enum):
    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"


class MembershipCache:
    """Known-present and known-absent blocks; thread-safe, O(1) per block."""

    def __init__(
        self, max_entries: int = 1 << 20, absent_ttl: float = 10.0, clock: Callable[[], float] = time.monotonic
    ):
        if max_entries < 1:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        if not absent_ttl > 0:
            raise ValueError(f"absent_ttl must be positive seconds, got {absent_ttl}")
        self.max_entries = int(max_entries)
        self.absent_ttl = float(absent_ttl)
        self._clock = clock
        self._lock = threading.Lock()
        self._present: OrderedDict[BlockHash, None] = OrderedDict()
        self._absent: OrderedDict[BlockHash, float] = OrderedDict()  # hash -> trusted until

    def state(self, block_hash: BlockHash) -> Membership:
        with self._lock:
            return self._state(block_hash, self._clock())

    def _state(self, block_hash: BlockHash, now: float) -> Membership:
        if block_hash in self._present:
            self._present.move_to_end(block_hash)
            return Membership.PRESENT
        until = self._absent.get(block_hash)
        if until is None:
            return Membership.UNKNOWN
        if now < until:
            return Membership.ABSENT
        del self._absent[block_hash]
        return Membership.UNKNOWN

    def states(self, block_hashes: Iterable[BlockHash]) -> list[Membership]:
        with self._lock:
            now = self._clock()
            return [self._state(h, now) for h in block_hashes]

    def mark_present(self, block_hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for h in block_hashes:
                self._absent.pop(h, None)
                self._present[h] = None
                self._present.move_to_end(h)
            while len(self._present) > self.max_entries:
                self._present.popitem(last=False)

    def mark_absent(self, block_hashes: Iterable[BlockHash], ttl: float | None = None) -> None:
        with self._lock:
            until = self._clock() + (self.absent_ttl if ttl is None else ttl)
            for h in block_hashes:
                self._present.pop(h, None)
                self._absent[h] = until
                self._absent.move_to_end(h)
            while len(self._absent) > self.max_entries:
                self._absent.popitem(last=False)

    def forget(self, block_hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for h in block_hashes:
                self._present.pop(h, None)
                self._absent.pop(h, None)

    def counts(self) -> tuple[int, int]:
        """``(known present, known absent)`` entries (absent ones may have expired)."""
        with self._lock:
            return len(self._present), len(self._absent)


class RemoteLookup(NamedTuple):
    """``hits``: length of the leading run of blocks known to be in the bucket.
    ``pending``: the run stopped at blocks being probed; ask again later."""

    hits: int
    pending: bool


class ExistenceProbe(Protocol):
    """What the prober needs of a store (``RemoteStore.exists``)."""

    def exists(self, block_hashes: Sequence[BlockHash]) -> Future[list[bool | None]]: ...


class MembershipProber:
    """Batched existence probes into ``cache``, off the calling thread.

    At most ``max_in_flight`` blocks are probed at once and ``max_batch`` per lookup;
    past the bound, ``lookup`` answers with what the cache knows (a miss) instead of
    queueing more.
    """

    def __init__(
        self, store: ExistenceProbe, cache: MembershipCache, *, max_in_flight: int = 4096, max_batch: int = 256
    ):
        self.store = store
        self.cache = cache
        self.max_in_flight = int(max_in_flight)
        self.max_batch = int(max_batch)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight: set[BlockHash] = set()
        self.probes_sent = 0

    def lookup(self, block_hashes: Sequence[BlockHash]) -> RemoteLookup:
        """The leading run known present; where it stops at unknown blocks, probes them
        (with the blocks after them, up to ``max_batch``) and says so. Never waits."""
        states = self.cache.states(block_hashes)
        hits = 0
        while hits < len(states) and states[hits] is Membership.PRESENT:
            hits += 1
        if hits == len(states) or states[hits] is Membership.ABSENT:
            return RemoteLookup(hits, False)
        wanted = [h for h, s in zip(block_hashes[hits:], states[hits:]) if s is Membership.UNKNOWN]
        pending = self.request(wanted[: self.max_batch], first=block_hashes[hits])
        return RemoteLookup(hits, pending)

    def request(self, block_hashes: Sequence[BlockHash], first: BlockHash | None = None) -> bool:
        """Probe the blocks not already being probed. True when ``first`` (default: the
        first block) is now being probed."""
        if not block_hashes:
            return False
        first = block_hashes[0] if first is None else first
        with self._lock:
            room = self.max_in_flight - len(self._in_flight)
            new = [h for h in dict.fromkeys(block_hashes) if h not in self._in_flight][: max(room, 0)]
            self._in_flight.update(new)
            probing = first in self._in_flight
        if new:
            self.probes_sent += 1
            try:
                future = self.store.exists(new)
            except Exception:
                self._settle(new, [None] * len(new))
                raise
            future.add_done_callback(partial(self._answered, new))
        return probing

    def _answered(self, block_hashes: list[BlockHash], future: Future) -> None:
        self._settle(block_hashes, _answers(future, len(block_hashes)))

    def _settle(self, block_hashes: list[BlockHash], answers: list[bool | None]) -> None:
        present = [h for h, a in zip(block_hashes, answers) if a is True]
        absent = [h for h, a in zip(block_hashes, answers) if a is not True]
        self.cache.mark_present(present)
        self.cache.mark_absent(absent)
        with self._lock:
            self._in_flight.difference_update(block_hashes)
            if not self._in_flight:
                self._idle.notify_all()

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no probe is in flight (tools and tests); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._in_flight, timeout)


def _answers(future: Future, n: int) -> list[bool | None]:
    try:
        answers = future.result()
    except Exception:
        return [None] * n
    return list(answers) if len(answers) == n else [None] * n
