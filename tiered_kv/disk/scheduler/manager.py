"""The disk tier's manager: which blocks are on disk, in which slot, and what to evict.

Scheduler process. It never reads or writes block data, never fsyncs and never runs
a write transaction on the caller's thread:

- At startup it opens (or creates) the namespace, takes the writer lock, preallocates
  the slab files and disk space for the index to grow into (so a disk that fills up
  later fails neither block writes nor the index commits that record them), and loads
  the LMDB index in one read pass (numpy, no per-entry objects: 1M blocks open in
  under a second; the LRU order of what it found is sorted on a short-lived thread
  meanwhile, and the first eviction from it waits for that; then another thread moves
  those blocks into the table's ordinary dict, a chunk per lock hold). A block is
  loadable when every TP rank has committed it; partial entries left by a crash, and
  entries past the end of a slab found truncated or missing, are dropped and their
  slots reused (``adoption.py``). A damaged index is moved aside and replaced by an
  empty one (``index.py``), never served.
- ``prepare_store`` reserves slots (evicting LRU blocks that are neither pinned by a
  load nor being stored, those ``retention: session`` holds last) and hands workers a
  ``DiskLoadStoreSpec``. Workers write the bytes, make them durable, and only then
  commit the index entry (``store.py``).
- A block becomes loadable on ``complete_store(success=True)`` (every rank's job
  finished) or earlier, when ``refresh()`` finds every rank's ``ok`` record in the
  index's log. ``refresh()`` drops blocks that a worker found corrupt. A failed store
  (a ``failed`` record, or ``complete_store(success=False)``) frees its slot, and may
  store its block again, only once every rank has logged its outcome there and its
  partial entry is deleted (``log_fold.py``): a late write never mixes with a later one.
  Until then its slot is held back (``held_back_slots``; ``num_free_slots`` counts it used).
- An evicted block's index entry stays until a worker reuses its slot: workers clear a
  slot's old entry (synced) before overwriting it, so until then the entry describes
  intact, checksummed bytes, and after a restart such a block is simply loadable again.
  Deleting entries at eviction would cost the scheduler process several LMDB calls
  per evicted block for nothing the workers do not already do.
- A background flusher thread (``index_flusher.py``) runs ``refresh()`` every ``poll_interval`` while
  blocks are pending or records are unread (64 records per lock hold), so the scheduler's calls rarely
  read the log. It writes access times, log trimming and the deletion of entries that must not come back
  (removed or corrupt blocks, failed stores, partial entries found at startup) in one transaction every
  few milliseconds; a delete applies only if the entry still points at that slot and the block was not
  stored there again (checked in the transaction). Losing queued updates in a crash never makes a torn
  block loadable: whoever overwrites a slot clears its entry first.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Container, Iterable, Iterator
from itertools import filterfalse
from typing import TYPE_CHECKING

import lmdb

from tiered_kv.abstract import BlockHash, LowerTier, OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiered_kv.config_values import DEFAULT_CHECKSUM
from tiered_kv.disk.scheduler.adoption import adopt_snapshot
from tiered_kv.disk.scheduler.block_table import BlockTable
from tiered_kv.disk.scheduler.stats import DiskManagerStats, held_back
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.scheduler.index_flusher import IndexFlusher
from tiered_kv.disk.format.index_records import LOG_OK, IndexSnapshot, LogColumns
from tiered_kv.disk.scheduler.log_fold import (
    NO_PROGRESS,
    Progress,
    RefreshResult,
    UnreadSettles,
    fold_good_writes,
    fold_log,
)
from tiered_kv.disk.format.namespace import (
    DiskSizeError,
    Namespace,
    WriterLock,
    explain_other_namespaces,
    slot_size_for,
)
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import DISK, DiskLoadStoreSpec
from tiered_kv.tiered.retention import SessionRetention

logger = logging.getLogger(__name__)

#: Blocks moved from the startup ("cold") generation of the table per lock hold.
_WARM_UP_CHUNK = 256


class DiskOffloadingManager(OffloadingManager):
    """LRU manager of the disk tier's slots (scheduler process; see module docstring).

    ``disk_bytes`` bounds the tier: ``disk_bytes // slot_size`` slots per rank.
    ``retention_share``: ``retention: session``'s budget share of them (None: none),
    timing sessions on ``clock``.
    ``engine_id`` names the engine in the writer lock; its workers pass the same id.
    ``on_corrupt``, if set, is called with the blocks each ``refresh()`` dropped because a
    worker found them corrupt (each block once, counted in ``stats.checksum_failures``
    too), on whichever thread ran the refresh: the flusher or the caller's.
    """

    #: The workers' I/O pool runs reads before writes (``disk.store.io_pool``).
    reads_first = True

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        fingerprint: Fingerprint,
        layout: KVCacheLayout,
        *,
        disk_bytes: int,
        checksum: str = DEFAULT_CHECKSUM,
        engine_id: str | None = None,
        enable_events: bool = True,
        flush_interval: float = 0.005,
        poll_interval: float | None = 0.002,
        name: str = "disk",
        medium: str = DISK,
        retention_share: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        #: How the composite names this tier: in stats and transfer types (``name``), and
        #: in events and ``hit_medium`` (``medium``); a second disk tier needs its own.
        self.name, self.medium = name, medium
        self.block_bytes = layout.bytes_per_block
        self.slot_size = slot_size_for(self.block_bytes)
        capacity = disk_bytes // self.slot_size
        if capacity < 1:
            raise DiskSizeError(f"disk_bytes={disk_bytes} holds no block; one disk slot is {self.slot_size} bytes")
        #: ``retention: session``'s rule over this tier's slots, told of uses by the composite.
        self.retention = SessionRetention(capacity, retention_share, clock=clock) if retention_share else None
        self.engine_id = engine_id or uuid.uuid4().hex
        self.block_size = layout.offloaded_block_size
        self.tp_size = fingerprint.tp_size
        self._full_mask = (1 << self.tp_size) - 1
        self.stats = DiskManagerStats()
        self.on_corrupt: Callable[[list[BlockHash]], None] | None = None
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._flush_interval = flush_interval
        #: Seconds between the flusher's reads of the workers' log while blocks are
        #: pending; None leaves every refresh to the caller (deterministic replays).
        self.poll_interval = poll_interval

        self.namespace = Namespace.open(cache_dir, fingerprint, layout, num_slots=capacity, checksum=checksum)
        if self.namespace.manifest.checksum != checksum:
            logger.warning(
                "disk cache %s uses checksum %s (set when it was created); ignoring checksum=%s",
                self.namespace.path,
                self.namespace.manifest.checksum,
                checksum,
            )
        with self.namespace.starting():  # a refused start closes what it took, removes what it made
            self._lock_file = WriterLock.acquire(self.namespace, self.engine_id)
            self._open(cache_dir, fingerprint, capacity)
        self._index_flusher.start()  # reclaim and log trimming from the startup snapshot
        self._flusher = self._index_flusher.thread  # tools measure its CPU time
        self._closed = False
        self._warmer = threading.Thread(target=self._warm_table, name="tkv-disk-table-warmup", daemon=True)
        self._warmer.start()

    def _open(self, cache_dir: str | os.PathLike, fingerprint: Fingerprint, capacity: int) -> None:
        """Preallocate the slabs and adopt the index (with the writer lock held)."""
        self.namespace.grow(capacity)
        self.capacity = capacity
        # Measured before preallocation restores the length: an entry past the end of
        # its slab (truncated or deleted) has lost its bytes.
        intact = min(self._slab_slots(rank) for rank in range(self.tp_size))
        for rank in range(self.tp_size):
            self.namespace.allocate_slab(rank)
        open_index = functools.partial(self.namespace.open_index, expected_entries=capacity, repair=True)
        self.index, snapshot = open_index().load_or_repair(open_index)
        self.namespace.reserve_index()
        self._lock = threading.Lock()
        self._table = BlockTable()
        self._pending: dict[bytes, int] = {}  # being stored: hash -> slot
        self._progress: dict[bytes, Progress] = {}  # pending blocks some rank has logged
        self._pins: dict[bytes, int] = {}
        self._doomed: dict[bytes, int] = {}  # corrupt but still pinned by a load: hash -> slot
        self._unread = UnreadSettles(capacity)  # jobs settled before refresh() read their records
        # Stores given up while ranks may still write: slot -> (hash, ranks reported there);
        # then (``_releasing``) until their entries are deleted.
        self._settling: dict[int, tuple[bytes, int]] = {}
        self._releasing: set[int] = set()
        self._free: list[int] = []
        # Index updates wait for the flusher (queued with the lock held).
        self._index_flusher = IndexFlusher(
            self.index,
            self._lock,
            self.stats,
            flush_interval=self._flush_interval,
            poll_interval=self._poll_now,
            refresh=self.refresh,
            still_held=self._still_held,
            released=self._released,
        )
        self._log_seen = 0
        t0 = time.perf_counter()
        self._load(snapshot, intact)
        opened = "disk tier %s: %d loadable blocks, %d free of %d slots (%d B each), opened in %.3f s"
        seconds = time.perf_counter() - t0
        logger.info(opened, self.namespace.path, len(self._table), len(self._free), capacity, self.slot_size, seconds)
        if not len(self._table):
            for line in explain_other_namespaces(cache_dir, fingerprint):
                logger.warning("not serving disk cache namespace %s", line)

    # ------------------------------------------------------------ startup

    def _slab_slots(self, rank: int) -> int:
        """Whole slots rank ``rank``'s slab file holds now (0 if it is missing)."""
        try:
            return os.stat(self.namespace.slab_path(rank)).st_size // self.slot_size
        except FileNotFoundError:
            return 0

    def _load(self, snap: IndexSnapshot, intact_slots: int) -> None:
        """Adopt the index (``adoption.adopt_snapshot``) and queue its deletions."""
        adopted = adopt_snapshot(
            snap,
            self._table,
            capacity=self.capacity,
            intact_slots=intact_slots,
            full_mask=self._full_mask,
            block_bytes=self.block_bytes,
            path=self.namespace.path,
        )
        for h, slot in adopted.deletions:
            self._index_flusher.delete(h, slot)
        self.stats.reclaimed_at_open = len(adopted.deletions)
        self._free = adopted.free
        self._log_seen = snap.log_seq
        self._index_flusher.trim_to(snap.log_seq)

    # ------------------------------------------------------------ seed API

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        n = 0
        with self._lock:
            for h in block_hashes:
                if self._table.get(h) is None:
                    break
                n += 1
        return n

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> DiskLoadStoreSpec:
        hashes = list(block_hashes)
        now = time.time()
        with self._lock:
            slots = []
            for h in hashes:
                slot = self._table.get(h)
                if slot is None:
                    raise KeyError(f"block {h.hex()} is not loadable from the disk tier")
                slots.append(slot)
            for h in hashes:
                self._pins[h] = self._pins.get(h, 0) + 1
                self._index_flusher.touch(h, now, 1)
            self.stats.loads += len(hashes)
            self.stats.bytes_loaded += len(hashes) * self.block_bytes
        self._index_flusher.wake()
        return DiskLoadStoreSpec(slots, hashes)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        now = time.time()
        with self._lock:
            for h in reversed(list(block_hashes)):  # the first ends most recent
                if self._table.touch(h):
                    self._index_flusher.touch(h, now, 0)

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Unpin the blocks (``success`` changes nothing: a read that found one corrupt logged
        it, and that record is read soon, before the block is stored again: ``_unread``)."""
        with self._lock:
            for h in self._unread.settle(block_hashes):
                n = self._pins.get(h, 0)
                if n <= 1:
                    self._pins.pop(h, None)
                    slot = self._doomed.pop(h, None)
                    if slot is not None:
                        self._release_slot(h, slot)
                else:
                    self._pins[h] = n - 1

    def prepare_store(
        self, block_hashes: Iterable[BlockHash], *, fresh: bool = False, protected: Container[BlockHash] = ()
    ) -> PrepareStoreOutput | None:
        """The seed's ``prepare_store``: none of ``block_hashes``, nor of ``protected``,
        is evicted to make room (None, changing nothing, when room cannot be made
        otherwise). ``fresh=True`` is the caller's word that the hashes are distinct
        and none is loadable or pending here (it just asked ``absent_among``; only this
        thread makes blocks pending), which skips re-checking them; ``protected`` then
        names the rest of its request (the composite's offered blocks)."""
        seen: Collection[BlockHash]
        if self._unread and self._unread.must_read(block_hashes := list(block_hashes)):
            self.refresh()  # an earlier store's records, read before they could settle this one
        with self._lock:
            if fresh:
                to_store = seen = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
            else:  # distinct, neither loadable nor being stored
                seen = dict.fromkeys(block_hashes)
                to_store = self._table.absent_among(seen, self._pending)
            if self._doomed:  # corrupt and still read: the slot is not free yet
                to_store = list(filterfalse(self._doomed.__contains__, to_store))
            if self._settling:  # a late write of the given-up store would take the entry back
                to_store = list(filterfalse({h for h, _ in self._settling.values()}.__contains__, to_store))
            free = self._free
            need = len(to_store) - len(free)
            evicted: list[bytes] = []
            if need > 0:
                # A fresh block is not in the table, so it cannot be a victim.
                held = self.retention.holding() if self.retention is not None else None
                victims = self._table.evict_lru_past(need, held, self._pins, protected, *(() if fresh else (seen,)))
                if victims is None:
                    self.stats.store_rejections += 1
                    return None
                evicted, freed = victims
                free.extend(freed)  # their entries stay in the index (module docstring)
            self.stats.evictions += len(evicted)
            keep = len(free) - len(to_store)
            slots = free[keep:][::-1]  # the order pop() would give: low slots first
            del free[keep:]
            idle = not self._pending  # then the flusher is not polling the log
            self._pending.update(zip(to_store, slots))
            if evicted:
                self._event(evicted, removed=True)
        if idle and to_store:
            self._index_flusher.wake()
        return PrepareStoreOutput(to_store, DiskLoadStoreSpec(slots, to_store), evicted)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True, in_flight: bool = False) -> None:
        stored = []
        with self._lock:
            for h in self._unread.settle(block_hashes):
                slot = self._pending.pop(h, None)
                if slot is None:
                    continue
                progress = self._progress.pop(h, NO_PROGRESS)
                if success and not progress.failed:
                    stored.append((h, slot))
                else:
                    self.stats.store_failures += 1
                    if in_flight and progress.reported & self._full_mask != self._full_mask:
                        self._settling[slot] = (h, progress.reported)
                    else:  # no rank writes the slot any more (the caller's word, or their records)
                        self._release_failed(h, slot)
            self._make_loadable(stored)
            if stored:
                self._event([h for h, _ in stored], removed=False)
        self._index_flusher.wake()

    def abandon_store(self, block_hashes: Iterable[BlockHash]) -> None:
        """Give up pending stores whose writes ranks may still make (a write-through copy
        of a job that failed on one rank, or that a reset abandoned): never loadable, and
        neither the slot nor the block is stored again until every rank has logged its
        outcome there (``log_fold``)."""
        self.complete_store(block_hashes, success=False, in_flight=True)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call. Runs ``refresh()`` first unless the flusher thread
        polls the log (``poll_interval``): then the events of blocks that became durable
        are at most a poll old, and the caller (vLLM asks every step) reads no index."""
        if self.poll_interval is None:
            self.refresh()
        with self._lock:
            if not self._events:
                return []
            events, self._events = self._events, []
            return events

    def shutdown(self) -> None:
        """Flush pending index updates, stop the flusher, close the index, drop the lock."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._index_flusher.stop()
        self._warmer.join(timeout=30)
        self._table.wait_sorted()
        self.index.close()
        self._lock_file.release()
        self.namespace.close()

    # ------------------------------------------------------------ extras

    def refresh(self, max_records: int = 1 << 30, records_per_hold: int | None = None) -> RefreshResult:
        """Apply what workers logged since the last call (at most ``max_records`` records;
        ``result.more``: some are left): blocks durable on every rank become loadable, failed
        stores are freed once every rank has logged, corrupt blocks are dropped. Idempotent, an
        MVCC read that never waits for writers; the flusher runs it while blocks are pending,
        ``records_per_hold`` records per hold of the manager's lock (None: all in one)."""
        result = RefreshResult([], [], [])
        settled = self._unread.settled  # their records are in the log: this read sees them
        try:
            log = self.index.read_log_columns(self._log_seen, max_records)
        except lmdb.Error as e:  # a damaged index must not reach the engine; stores stay pending
            self.stats.index_read_errors += 1
            logger.error("reading the disk index log failed: %s", e)
            return result
        step = max(1, records_per_hold or len(log.seq))
        applied = False
        for start in range(0, len(log.seq), step):
            if start:
                time.sleep(0)  # let the scheduler thread in between lock holds
            with self._lock:
                applied |= self._apply_records(log, start, start + step, result)
        if applied:
            result.more = len(log.seq) == max_records
            self._index_flusher.wake()
        if self._unread and not result.more:
            with self._lock:
                self._unread.read_up_to(settled)
        if result.corrupt and self.on_corrupt is not None:
            self.on_corrupt(result.corrupt)
        return result

    def is_loadable(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return self._table.get(block_hash) is not None

    def loadable_among(self, block_hashes: Iterable[BlockHash]) -> set[BlockHash]:
        """The subset of ``block_hashes`` that is loadable now (one lock round trip)."""
        with self._lock:
            return self._table.among(block_hashes)

    def is_pinned(self, block_hash: BlockHash) -> bool:
        """Whether a load holds ``block_hash`` (it cannot be evicted until complete_load)."""
        with self._lock:
            return self._pins.get(block_hash, 0) > 0

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot of a loadable block, else None."""
        with self._lock:
            return self._table.get(block_hash)

    def is_pending(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._pending

    def num_pending(self) -> int:
        """Blocks being stored: slots reserved, not yet durable on every rank nor failed."""
        return len(self._pending)

    def pending_blocks(self) -> set[BlockHash]:
        """The blocks counted by ``num_pending`` (a copy)."""
        with self._lock:
            return set(self._pending)

    def absent_among(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """The members of ``block_hashes``, in order, that are neither loadable nor being
        stored (one lock round trip): the blocks a disk write would add."""
        with self._lock:
            return self._table.absent_among(block_hashes, self._pending)

    def num_free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def held_back_slots(self) -> dict[str, int]:
        """Slots neither free nor holding a block, per reason (``stats.HELD_BACK_REASONS``)."""
        with self._lock:
            return held_back(self._settling, self._releasing)

    def __len__(self) -> int:
        """Loadable blocks."""
        with self._lock:
            return len(self._table)

    def iter_evictable(self) -> Iterator[BlockHash]:
        """Loadable, unpinned blocks from least to most recently used (a snapshot)."""
        with self._lock:
            out = [h for h, _ in self._table.iter_lru() if h not in self._pins]
        return iter(out)

    def remove(self, block_hash: BlockHash) -> bool:
        """Drop a loadable, unpinned block (freeing its slot). False if it is unknown,
        pinned by a load, or still being stored."""
        with self._lock:
            if block_hash in self._pins:
                return False
            slot = self._table.remove(block_hash)
            if slot is None:
                return False
            self._release_slot(block_hash, slot)
            self._event([block_hash], removed=True)
        self._index_flusher.wake()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Block until the index reflects every update queued so far (tests, tools,
        shutdown). True if it did within ``timeout``."""
        return self._index_flusher.flush(timeout)

    # ------------------------------------------------------------ internals (lock held)

    def _apply_records(self, log: LogColumns, start: int, end: int, result: RefreshResult) -> bool:
        """Fold records ``start:end`` of ``log`` that no call applied yet into the state
        and ``result``; whether there were any."""
        end = min(end, len(log.seq))
        first = start + bisect.bisect_right(log.seq[start:end], self._log_seen)  # another thread may have read some
        if first == end:
            return False
        hashes, statuses, slots = log.block_hash[first:end], log.status[first:end], log.slot[first:end]
        corrupt_before = len(result.corrupt)
        if self._full_mask == 1 and not (self._progress or self._settling) and statuses.count(LOG_OK) == len(statuses):
            durable = fold_good_writes(self._pending, hashes, slots)
        else:
            durable = fold_log(
                self._pending,
                self._progress,
                self._full_mask,
                (hashes, statuses, log.rank[first:end], slots),
                result,
                drop_corrupt=self._drop_corrupt,
                free_failed=self._free_failed,
                settling=self._settling,
                free_settled=self._release_failed,
            )
        self._log_seen = log.seq[end - 1]
        self._index_flusher.trim_to(self._log_seen)
        self._make_loadable(durable)
        became_loadable = [h for h, _ in durable]
        result.durable.extend(became_loadable)
        if became_loadable:
            self._event(became_loadable, removed=False)
        if len(result.corrupt) > corrupt_before:
            self._event(result.corrupt[corrupt_before:], removed=True)
        return True

    def _drop_corrupt(self, h: bytes, slot: int) -> bool:
        """A worker found loadable block ``h`` corrupt in ``slot``: drop it (freeing the
        slot once no load holds it). False if ``h`` is not loadable from that slot."""
        if self._table.get(h) != slot:
            return False
        self._table.remove(h)
        self.stats.checksum_failures += 1
        if h in self._pins:
            self._doomed[h] = slot
        else:
            self._release_slot(h, slot)
        return True

    def _free_failed(self, h: bytes, slot: int) -> None:
        """Pending block ``h``'s store failed and no rank still writes ``slot``."""
        self.stats.store_failures += 1
        self._release_failed(h, slot)

    def _release_failed(self, h: bytes, slot: int) -> None:
        """Free the slot of ``h``'s failed store once its entry is deleted: a rank whose
        write succeeded left its bit there, which a later store of ``h`` to the same slot
        would complete with another computation's shards (and a restart adopt)."""
        self._releasing.add(slot)
        self._index_flusher.delete(h, slot, release=True)

    def _released(self, slots: list[int]) -> None:
        self._releasing.difference_update(slots)
        self._free.extend(slots)

    def _make_loadable(self, blocks: list[tuple[bytes, int]]) -> None:
        """``(hash, slot)`` pairs become loadable, most recent last."""
        self._table.add_many(blocks)
        self.stats.stores += len(blocks)
        self.stats.bytes_stored += len(blocks) * self.block_bytes

    def _release_slot(self, h: bytes, slot: int) -> None:
        self._free.append(slot)
        self._index_flusher.delete(h, slot)

    def _event(self, hashes: list[bytes], removed: bool) -> None:
        if self._events is not None:
            self._events.append(OffloadingEvent(list(hashes), self.block_size, self.medium, removed))

    def _held(self, h: bytes, slot: int) -> bool:
        return self._table.get(h) == slot or self._doomed.get(h) == slot or self._pending.get(h) == slot

    # ------------------------------------------------------------ for the flusher and warm-up threads

    def _poll_now(self) -> float | None:
        """How long the flusher waits between polls of the log: ``poll_interval`` while
        blocks are pending, else None (it does not poll)."""
        with self._lock:
            polling = self.poll_interval is not None and bool(self._pending or self._unread or self._settling)
        return self.poll_interval if polling else None

    def _still_held(self, items: Iterable[tuple[bytes, int]]) -> set[tuple[bytes, int]]:
        with self._lock:
            return {(h, s) for h, s in items if self._held(h, s)}

    def _warm_table(self) -> None:
        """Empty the table's cold generation (``BlockTable.warm_up``) a chunk per hold
        of the lock, so the scheduler's calls wait at most one chunk."""
        self._table.sorted_soon()  # not under the lock: the first chunk would wait for it
        while not self._closed:
            with self._lock:
                if not self._table.warm_up(_WARM_UP_CHUNK):
                    return
            time.sleep(0)  # let the scheduler thread in between lock holds


if TYPE_CHECKING:  # for the type checker only: the composite takes this tier as a ``LowerTier``

    def _as_lower_tier(tier: DiskOffloadingManager) -> LowerTier:
        return tier
