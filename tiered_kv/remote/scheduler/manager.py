"""The shared tier's scheduler side: ``RemoteOffloadingManager``, the composite's lower tier.

``RemoteOffloadingManager`` runs in the scheduler process and is the composite's
``LowerTier`` for S3-compatible object storage. It never waits on the network: every
answer comes from memory, and what it does not know it asks the bucket about on the
store's threads (``RemoteStore.exists``, HEAD requests), folding the answers in on a
later call.

- **Loadable** means known present on every TP rank (``MembershipCache``): learned
  from probes, whoever uploaded the block, this node or another. A block it knows
  nothing of is probed when it is asked about (``is_loadable``; ``expect`` probes a
  whole request's blocks in one batch) and counts as a miss until the answer is in.
  Answers are folded in on the caller's thread, in order with the manager's own
  actions, so a late "absent" never overrides a block this manager saw land.
- **Pending** are the blocks this manager reserved in ``prepare_store`` (spills and
  write-through copies from CPU slots). Workers upload them (``RemoteStager``) and
  report nothing back: the only channel from a worker is job completion, and a store
  job completes before its uploads. So ``refresh`` learns the outcome from the bucket:
  it probes pending blocks in batches (first soon after the reservation, then backing
  off), a present one becomes loadable (a ``stored`` event), and one still absent
  ``settle_after`` seconds after its reservation (dropped, failed, server down) is
  released. A released block whose upload lands later is found by a later probe. No
  new channel between processes is needed, at the price of a HEAD per block and rank.
- **Loads**: a block whose load is known to have failed (``complete_load`` with
  ``success=False``) is forgotten at once (a ``removed`` event; asked about again when
  next looked up), so the engine's recomputed copy is offered for upload and replaces
  an object the reader deleted as damaged (a write finding an honest object leaves it).
  ``refresh`` re-probes the other blocks loaded since the last refresh (vLLM reports
  loads as done either way): one found gone (the bucket's lifecycle rule expired it,
  its reader deleted it as damaged) stops being loadable.
- **Capacity** is the bucket's, bounded by the operator's lifecycle rule; the tier
  reports ``membership_entries`` blocks, never evicts, and ``remove`` only forgets.

What the tier contributes in each process is ``tiered_kv.remote.tier.RemoteTier``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tiered_kv.abstract import BlockHash, Closing, LowerTier, OffloadingEvent, PrepareStoreOutput
from tiered_kv.mediums import TierSlotsSpec
from tiered_kv.remote.scheduler.membership import Membership, MembershipCache
from tiered_kv.remote.store.store import RemoteStore

logger = logging.getLogger(__name__)

REMOTE = "REMOTE"
#: First probe of a pending block this long after its reservation; each later one
#: waits twice as long, up to ``_PROBE_MAX``.
_PROBE_FIRST = 0.05
_PROBE_MAX = 1.0
#: Unknown blocks probed at once, at most; past it a lookup is a plain miss.
_MAX_ASKING = 4096


class RemoteLoadStoreSpec(TierSlotsSpec):
    """Blocks of the shared tier: addressed by hash (the slot ids are placeholders)."""

    @staticmethod
    def medium() -> str:
        return REMOTE


class _Pending:
    __slots__ = ("since", "next_probe", "delay")

    def __init__(self, now: float):
        self.since = now
        self.delay = _PROBE_FIRST
        self.next_probe = now + _PROBE_FIRST


class RemoteOffloadingManager(Closing):
    """The shared tier's ``LowerTier`` (see module docstring) over a scheduler-side
    ``store`` (this manager closes it). ``block_size``: tokens per offloaded block, for
    events. ``settle_after``: seconds after which a pending block the bucket still lacks
    is released (default: twice the longest an upload may take, plus a second)."""

    #: Uploads and downloads share the store's connections in the order they come.
    reads_first = False

    def __init__(
        self,
        store: RemoteStore,
        *,
        block_size: int,
        name: str = "remote",
        medium: str = REMOTE,
        enable_events: bool = True,
        settle_after: float | None = None,
        max_batch: int = 256,
    ):
        cfg = store.config
        self.store = store
        self.name, self.medium = name, medium
        self.block_size = block_size
        self.enable_events = enable_events
        self.on_corrupt: Callable[[list[BlockHash]], None] | None = None
        self.settle_after = (
            2.0 * (cfg.retries + 1) * cfg.request_timeout + 1.0 if settle_after is None else float(settle_after)
        )
        self.max_batch = int(max_batch)
        self.cache = MembershipCache(cfg.membership_entries, cfg.absent_ttl)
        self._capacity = cfg.membership_entries
        self._pending: dict[BlockHash, _Pending] = {}
        self._probing: set[BlockHash] = set()  # pending blocks with a probe in flight
        self._asking: set[BlockHash] = set()  # unknown blocks with a probe in flight
        self._answers: deque[tuple[str, list[BlockHash], list[bool | None]]] = deque()
        self._in_flight = 0  # own probes (pending, recheck) not answered yet
        self._idle = threading.Condition()
        self._pins: Counter[BlockHash] = Counter()
        self._loaded: set[BlockHash] = set()  # loaded since the last refresh
        self._events: list[OffloadingEvent] = []
        self._closed = False
        #: Uploads seen landing / released unseen / blocks found gone after a load.
        self.counters = Counter(confirmed=0, released=0, gone=0)

    # ------------------------------------------------------------------ queries

    @property
    def capacity(self) -> int:
        return self._capacity

    def num_free_slots(self) -> int:
        return max(self._capacity - self.cache.counts()[0] - len(self._pending), 0)

    def is_loadable(self, block_hash: BlockHash) -> bool:
        if self._answers:
            self._fold(time.monotonic())
        state = self.cache.state(block_hash)
        if state is Membership.PRESENT:
            return True
        if state is Membership.UNKNOWN:
            self._probe_unknown([block_hash])
        return False

    def expect(self, block_hashes: Sequence[BlockHash]) -> bool:
        """Probe, in one batch, the blocks of ``block_hashes`` this tier knows nothing of
        (a request's blocks, before the engine looks them up). True when some are being
        probed: a lookup made once the answers are in (``wait_probes``) may hit more."""
        if self._answers:
            self._fold(time.monotonic())
        block_hashes = list(block_hashes)
        unknown = [h for h, s in zip(block_hashes, self.cache.states(block_hashes)) if s is Membership.UNKNOWN]
        return self._probe_unknown(unknown) > 0

    def _probe_unknown(self, block_hashes: list[BlockHash]) -> int:
        """Probe those not pending here nor being probed, within the in-flight bound."""
        room = _MAX_ASKING - len(self._asking)
        new = [h for h in dict.fromkeys(block_hashes) if h not in self._pending and h not in self._asking]
        new = new[: min(room, self.max_batch)]
        if new and not self._closed:
            self._asking.update(new)
            self._send("lookup", new)
        return len(new)

    def is_pending(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pending

    def is_probing(self, block_hash: BlockHash) -> bool:
        """Whether an existence probe of this unknown block is in flight (its answer is
        folded in by a later call): a lookup should ask again rather than miss."""
        return block_hash in self._asking

    def num_probing(self) -> int:
        """Unknown blocks whose probe is in flight or whose answer is not folded in yet."""
        return len(self._asking)

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return 0 if self.cache.state(block_hash) is Membership.PRESENT else None

    def absent_among(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        block_hashes = list(block_hashes)
        states = self.cache.states(block_hashes)
        return [h for h, s in zip(block_hashes, states) if s is not Membership.PRESENT and h not in self._pending]

    def num_pending(self) -> int:
        return len(self._pending)

    def pending_blocks(self) -> set[BlockHash]:
        return set(self._pending)

    # ------------------------------------------------------------------ stores

    def prepare_store(
        self, block_hashes: Iterable[BlockHash], *, fresh: bool = False, protected: Container[BlockHash] = ()
    ) -> PrepareStoreOutput | None:
        """Reserve the absent ones; never evicts (the bucket's lifecycle bounds it)."""
        to_store = list(block_hashes) if fresh else self.absent_among(dict.fromkeys(block_hashes))
        now = time.monotonic()
        for block_hash in to_store:
            self._pending[block_hash] = _Pending(now)
        return PrepareStoreOutput(to_store, RemoteLoadStoreSpec([0] * len(to_store), to_store), [])

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        settled = [h for h in block_hashes if self._pending.pop(h, None) is not None]
        self._probing.difference_update(settled)
        landed = settled if success else []
        if landed:
            self.cache.mark_present(landed)
            self._event(landed, removed=False)

    # ------------------------------------------------------------------ loads

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> RemoteLoadStoreSpec:
        block_hashes = list(block_hashes)
        for h in block_hashes:
            if self.cache.state(h) is not Membership.PRESENT:
                raise KeyError(f"block {h.hex()[:16]} is not known to be in the shared tier")
        self._pins.update(block_hashes)
        return RemoteLoadStoreSpec([0] * len(block_hashes), block_hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        failed = []
        for h in block_hashes:
            if self._pins[h] > 0:
                self._pins[h] -= 1
                if not self._pins[h]:
                    del self._pins[h]
                if not success:
                    failed.append(h)
                elif len(self._loaded) < _MAX_ASKING:  # rechecked at the next refresh
                    self._loaded.add(h)
        failed = [h for h in failed if self.cache.state(h) is Membership.PRESENT]
        if failed:
            self.cache.forget(failed)
            self._event(failed, removed=True)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        self.cache.states(list(block_hashes)[::-1])  # refreshes the cache's LRU order

    def remove(self, block_hash: BlockHash) -> bool:
        """Forget a block (the object stays: the bucket's lifecycle rule owns it)."""
        if self._pins[block_hash] > 0:
            return False
        self._pins.pop(block_hash, None)
        if self.cache.state(block_hash) is Membership.PRESENT:
            self.cache.forget([block_hash])
            self._event([block_hash], removed=True)
        return True

    def iter_evictable(self) -> Iterator[BlockHash]:
        return iter(())

    # ------------------------------------------------------------------ refresh

    def refresh(self) -> int:
        """Fold in probe answers; send the probes now due (pending blocks, and blocks
        loaded since the last refresh). Never waits. Returns blocks that became loadable."""
        now = time.monotonic()
        became = self._fold(now)
        if self._closed:
            return became
        if self._loaded:
            recheck = [h for h in self._loaded if self.cache.state(h) is Membership.PRESENT]
            self._loaded.clear()
            if recheck:
                self._send("recheck", recheck[: self.max_batch * 4])
        due = [h for h, p in self._pending.items() if p.next_probe <= now and h not in self._probing]
        if due:
            due = due[: self.max_batch * 4]
            self._probing.update(due)
            self._send("pending", due)
        return became

    def _fold(self, now: float) -> int:
        became: list[BlockHash] = []
        gone: list[BlockHash] = []
        while self._answers:
            kind, hashes, answers = self._answers.popleft()
            for h, answer in zip(hashes, answers):
                if kind == "lookup":
                    self._asking.discard(h)
                    if answer is True:
                        self.cache.mark_present([h])
                    elif h not in self._pending and self.cache.state(h) is not Membership.PRESENT:
                        # Unanswered counts as absent for absent_ttl: a dead server costs misses.
                        self.cache.mark_absent([h])
                    continue
                if kind == "recheck":
                    if answer is False and self.cache.state(h) is Membership.PRESENT:
                        gone.append(h)
                    continue
                self._probing.discard(h)
                pending = self._pending.get(h)
                if pending is None:
                    continue
                if answer is True:
                    del self._pending[h]
                    became.append(h)
                elif now - pending.since >= self.settle_after:
                    del self._pending[h]
                    self.counters["released"] += 1
                else:
                    pending.delay = min(pending.delay * 2, _PROBE_MAX)
                    pending.next_probe = now + pending.delay
        if became:
            self.cache.mark_present(became)
            self.counters["confirmed"] += len(became)
            self._event(became, removed=False)
        if gone:
            self.cache.mark_absent(gone)
            self.counters["gone"] += len(gone)
            self._event(gone, removed=True)
        return len(became)

    def _send(self, kind: str, hashes: list[BlockHash]) -> None:
        try:
            future = self.store.exists(hashes)
        except Exception:
            logger.debug("shared tier: probe not sent", exc_info=True)
            self._answers.append((kind, hashes, [None] * len(hashes)))
            return
        with self._idle:
            self._in_flight += 1

        def done(f: Future, kind: str = kind, hashes: list[BlockHash] = hashes) -> None:
            try:
                answers = list(f.result())
            except Exception:
                answers = [None] * len(hashes)
            self._answers.append((kind, hashes, answers))  # deque appends are thread-safe
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

        future.add_done_callback(done)

    def wait_probes(self, timeout: float | None = None) -> bool:
        """Wait until no probe of this manager is in flight (tests, tools, engines that
        defer a request while its lookup is pending); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def settle(self, timeout: float = 60.0) -> bool:
        """Refresh until no block is pending (each one landed or was released); for
        tools and tests, never the engine's path. False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            if not self._pending:
                return True
            if time.monotonic() >= deadline:
                return False
            self.wait_probes(max(deadline - time.monotonic(), 0.0))
            time.sleep(0.02)

    # ------------------------------------------------------------------ misc

    def _event(self, block_hashes: list[BlockHash], removed: bool) -> None:
        if self.enable_events and block_hashes:
            self._events.append(OffloadingEvent(list(block_hashes), self.block_size, self.medium, removed))

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.store.close()


__all__ = ["REMOTE", "RemoteLoadStoreSpec", "RemoteOffloadingManager"]


if TYPE_CHECKING:  # for the type checker only: the composite takes this tier as a ``LowerTier``

    def _as_lower_tier(tier: RemoteOffloadingManager) -> LowerTier:
        return tier
