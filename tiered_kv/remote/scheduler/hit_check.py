"""``RemoteHitCheck``: a block only the bucket holds is promised as a hit only once every
rank's object of it was downloaded and verified.

Scheduler process. ``RemoteVerifier`` downloads every rank's object of a block into
scratch memory on the scheduler-side store's threads and checks its header
(fingerprint, block hash, rank, size) and checksum; ``RemoteHitCheck`` keeps the
blocks verified (one verification, one load) on the caller's thread. A block that fails
is a miss for ``absent_ttl`` (a damaged object is deleted by the store). While the
tier is still probing whether it holds a block (HEAD requests), the block is
*locating*: the engine asks again, never waiting and never a premature miss; a probe
the server does not answer counts as absent, so a server that is down costs misses.

The price is a second download of each shared-tier hit (the workers then read their
own rank's object into the CPU tier or the KV cache, verifying it again); what is left
is an object lost between the two reads, which the worker logs as an error naming the
job. Where the engine recomputes the blocks of a failed load (vLLM with
``integrations.vllm.connector``), there is no verifier: a block known present on every
rank is a hit, read once by each worker and verified there. Scratch memory is bounded (``VERIFY_BYTES``): past it a block waits its turn.
Each verification's seconds (from sending the downloads to the last rank's verified
bytes) go to the verifier's ``latencies``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future

import numpy as np

from tiered_kv.abstract import BlockHash, Closing
from tiered_kv.metrics import TIER_VERIFICATIONS, VERIFICATION_SECONDS, CounterValue, Latencies, Observation
from tiered_kv.metrics import remote_counter_values
from tiered_kv.remote.scheduler.manager import RemoteOffloadingManager
from tiered_kv.remote.store.store import RemoteStore
from tiered_kv.tiers import HitState

logger = logging.getLogger(__name__)

#: Scratch memory of the blocks being verified at once (every rank's object of each).
VERIFY_BYTES = 256 << 20
#: Verified-but-not-yet-loaded blocks remembered at most (oldest forgotten first).
MAX_VERIFIED = 65536
#: How long a verification stands for a hit (seconds): the object may go after it (an
#: eviction, a lifecycle rule, a restarted Mooncake master), and where the engine cannot
#: recompute a failed load, a hit promised on an old verification would leave a request
#: with incomplete KV. A request that waits longer is verified again.
VERIFIED_FOR_S = 5.0


class RemoteHitCheck(Closing):
    """The shared tier's ``HitCheck`` (``tiered_kv.tiers``) over ``remote``, downloading
    with ``verifier`` (shut down by ``shutdown``). Without a verifier (an engine that
    recomputes a failed load) a block known present on every rank is a hit at once:
    the workers' reads verify it, and one that fails there is recomputed. A verification
    stands for ``VERIFIED_FOR_S`` seconds of ``clock``."""

    def __init__(
        self,
        remote: RemoteOffloadingManager,
        verifier: "RemoteVerifier | None",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.remote = remote
        self.verifier = verifier
        self.clock = clock
        self._verified: OrderedDict[BlockHash, float] = OrderedDict()  # block -> when verified
        self._outcomes: Counter[str] = Counter()

    def lookup(self, block_hash: BlockHash) -> HitState:
        if self.verifier is None:
            return HitState.HIT
        at = self._verified.get(block_hash)
        if at is not None and self.clock() - at <= VERIFIED_FOR_S:
            return HitState.HIT
        self._verified.pop(block_hash, None)
        self.verifier.submit(block_hash)
        return HitState.PENDING

    def locating(self, block_hash: BlockHash) -> bool:
        return self.remote.is_probing(block_hash)

    def loading(self, block_hash: BlockHash) -> None:
        self._verified.pop(block_hash, None)

    def collect(self) -> bool:
        if self.verifier is None:
            return False
        folded = False
        for key, ok in self.verifier.results():
            folded = True
            self._outcomes["ok" if ok else "failed"] += 1
            if ok:
                self._verified[key] = self.clock()
                self._verified.move_to_end(key)
                while len(self._verified) > MAX_VERIFIED:
                    self._verified.popitem(last=False)
            else:
                # Missing, foreign, damaged or unreachable on some rank: a miss until the
                # bucket is asked again (absent_ttl), never a load that could fail.
                self._verified.pop(key, None)
                self.remote.remove(key)
                self.remote.cache.mark_absent([key])
        return folded

    def step(self) -> None:
        self.collect()
        self.remote.refresh()  # never waits: folds answers in, sends the probes due

    def busy(self) -> bool:
        return (self.verifier is not None and self.verifier.busy()) or self.remote.num_probing() > 0

    def reset(self) -> None:
        self._verified.clear()

    def outcomes(self) -> Mapping[str, int]:
        return dict(self._outcomes)

    def counters(self) -> list[CounterValue]:
        """Verification outcomes, and the scheduler-side store's request counters."""
        out = [(TIER_VERIFICATIONS, (self.remote.name, o), n) for o, n in self._outcomes.items()]
        return out + remote_counter_values(self.remote.store.stats())

    def timings(self) -> list[Observation]:
        verified = self.verifier.latencies.drain() if self.verifier is not None else []
        return verified + self.remote.store.latencies.drain()

    def shutdown(self) -> None:
        if self.verifier is not None:
            self.verifier.shutdown()


class RemoteVerifier(Closing):
    """Downloads and verifies every rank's object of a chunk (see module docstring).

    ``submit`` never waits; ``results`` hands back ``(key, ok)`` pairs on the caller's
    thread; ``busy`` says whether some are still being read."""

    def __init__(self, store: RemoteStore, world_size: int, bytes_per_chunk: int, budget_bytes: int = VERIFY_BYTES):
        self.store = store
        self.world_size = world_size
        self.bytes_per_chunk = bytes_per_chunk
        self.max_in_flight = max(1, budget_bytes // max(1, world_size * bytes_per_chunk))
        self._lock = threading.Condition()
        self._in_flight: set[bytes] = set()
        self._done: deque[tuple[bytes, bool]] = deque()
        self._closed = False
        self.latencies = Latencies()

    def submit(self, key: bytes) -> bool:
        """Start verifying ``key``; False when the scratch bound is reached (ask again)."""
        with self._lock:
            if self._closed or key in self._in_flight:
                return key in self._in_flight
            if len(self._in_flight) >= self.max_in_flight:
                return False
            self._in_flight.add(key)
        scratch = np.empty((self.world_size, self.bytes_per_chunk), dtype=np.uint8)
        start = time.perf_counter()
        try:
            future = self.store.get_blocks([(key, r, scratch[r]) for r in range(self.world_size)])
        except Exception:
            logger.debug("shared tier: verification of a chunk not sent", exc_info=True)
            self._finish(key, False)
            return True

        def downloaded(f: Future, scratch: np.ndarray = scratch) -> None:  # holds the buffer until then
            self._downloaded(key, f, start)

        future.add_done_callback(downloaded)
        return True

    def _downloaded(self, key: bytes, future: Future, start: float) -> None:
        try:
            ok = all(future.result())
        except Exception:
            ok = False
        self.latencies.observe(VERIFICATION_SECONDS, ("remote",), time.perf_counter() - start)
        self._finish(key, ok)

    def _finish(self, key: bytes, ok: bool) -> None:
        with self._lock:
            self._in_flight.discard(key)
            self._done.append((key, ok))
            self._lock.notify_all()

    def results(self) -> Iterator[tuple[bytes, bool]]:
        while self._done:
            yield self._done.popleft()

    def busy(self) -> bool:
        return bool(self._in_flight or self._done)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no verification is in flight (tests, tools); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._in_flight, timeout)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True


__all__ = ["MAX_VERIFIED", "RemoteHitCheck", "RemoteVerifier", "VERIFY_BYTES"]
