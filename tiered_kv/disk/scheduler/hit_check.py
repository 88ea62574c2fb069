"""``DiskHitCheck``: a disk block is promised as a hit only once its bytes on every rank
were read back and matched their checksums, or, where the engine recomputes the blocks
of a failed load, at once.

Why two modes: vLLM's own connector treats a failed load as fatal, so each hit is read
back here first and then read again by every worker (two reads). With our connector and
``kv_load_failure_policy: recompute`` (``TierContext.failed_loads_recomputed``) there is
no verifier: a block the index holds on every rank is a hit, each worker's read verifies
its checksum before a byte is used, and a block that fails there is reported and
recomputed (one read per rank per hit).

Scheduler process. The reads run on the ``DiskVerifier``'s threads (``verify.py``, its
own ``DiskStore`` over the namespace); this class only does bookkeeping on the caller's
thread, so it needs no lock. What it keeps:

- blocks being verified and blocks verified, each with the slot that was read (a
  verification counts only for that slot, and for one load: ``loading`` consumes it);
- blocks that failed verification but could not be dropped yet (a load in flight pins
  them): a miss until they can be;
- after ``reset``, the writes queued before it: dropped as they land, never served.

A checksum failure found by a read is recorded in the index by the store (a
``corrupt`` log record), which the disk manager's ``refresh`` turns into an eviction;
anything else (an I/O error) is removed here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping

from tiered_kv.abstract import BlockHash, Closing
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.scheduler.verify import DiskVerifier
from tiered_kv.metrics import TIER_VERIFICATIONS, CounterValue, Observation
from tiered_kv.tiers import HitState

#: Verified-but-not-yet-loaded blocks remembered at most (oldest forgotten first).
MAX_VERIFIED = 65536


class DiskHitCheck(Closing):
    """The disk tier's ``HitCheck`` (``tiered_kv.tiers``) over ``disk``, reading with
    ``verifier`` (closed by ``shutdown``); None: no read here, the workers' reads verify
    (module docstring)."""

    def __init__(self, disk: DiskOffloadingManager, verifier: DiskVerifier | None):
        self.disk = disk
        self.name = disk.name
        self.verifier = verifier
        self._verifying: dict[BlockHash, int] = {}
        self._verified: OrderedDict[BlockHash, int] = OrderedDict()
        self._unservable: dict[BlockHash, int] = {}
        self._stale_writes: set[BlockHash] = set()
        self._outcomes: Counter[str] = Counter()

    def lookup(self, block_hash: BlockHash) -> HitState:
        disk = self.disk
        slot = disk.slot_of(block_hash)
        if slot is None or block_hash in self._stale_writes:
            return HitState.MISS
        if block_hash in self._unservable:
            if self._unservable[block_hash] == slot and not disk.remove(block_hash):
                return HitState.MISS  # still pinned by the load that was in flight
            del self._unservable[block_hash]
            if disk.slot_of(block_hash) is None:
                return HitState.MISS
        if self.verifier is None or self._verified.get(block_hash) == slot:
            return HitState.HIT
        if self._verifying.get(block_hash) != slot:
            self._verifying[block_hash] = slot
            self.verifier.submit(block_hash, slot)
        return HitState.PENDING

    def locating(self, block_hash: BlockHash) -> bool:
        return False  # the index says where every block is

    def loading(self, block_hash: BlockHash) -> None:
        self._verified.pop(block_hash, None)

    def collect(self) -> bool:
        if self.verifier is None:
            return False
        results = self.verifier.results()
        for key, slot, ok in results:
            if self._verifying.get(key) == slot:
                del self._verifying[key]
            self._outcomes["ok" if ok else "failed"] += 1
            if ok:
                self._verified[key] = slot
                self._verified.move_to_end(key)
                while len(self._verified) > MAX_VERIFIED:
                    self._verified.popitem(last=False)
            else:
                self._verified.pop(key, None)
                self._drop(key, slot)
        return bool(results)

    def _drop(self, key: BlockHash, slot: int) -> None:
        """Make a block that failed verification a miss (see the module docstring)."""
        disk = self.disk
        disk.refresh()
        if disk.slot_of(key) == slot and not disk.remove(key):
            self._unservable[key] = slot

    def step(self) -> None:
        # Writes the workers committed are folded in by the disk manager's flusher
        # thread, not here: reading the log on the scheduler thread would lengthen
        # every step that has some.
        self.collect()
        if self._stale_writes:
            self._drop_stale_writes()

    def _drop_stale_writes(self) -> None:
        """Drop the writes of before a reset as they land (removing one pinned by a load
        is retried next step)."""
        disk = self.disk
        if disk.num_pending():
            disk.refresh()
        pending = disk.pending_blocks()
        for key in list(self._stale_writes):
            if key in pending:
                continue
            if disk.slot_of(key) is None or disk.remove(key):
                self._stale_writes.discard(key)

    def busy(self) -> bool:
        return self.verifier is not None and self.verifier.busy()

    def reset(self) -> None:
        self._verified.clear()
        if self.disk.num_pending():
            self.disk.refresh()
        self._stale_writes |= self.disk.pending_blocks()

    def outcomes(self) -> Mapping[str, int]:
        return dict(self._outcomes)

    def counters(self) -> list[CounterValue]:
        return [(TIER_VERIFICATIONS, (self.name, outcome), n) for outcome, n in self._outcomes.items()]

    def timings(self) -> list[Observation]:
        return self.verifier.latencies.drain() if self.verifier is not None else []

    def shutdown(self) -> None:
        if self.verifier is not None:
            self.verifier.shutdown()


__all__ = ["DiskHitCheck", "MAX_VERIFIED"]
