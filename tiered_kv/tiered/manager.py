"""TieredOffloadingManager: the CPU tier over the disk tier, as one OffloadingManager.

Runs in the scheduler process. Never does block I/O, fsync or a synced index write on
the caller's thread: it only decides, and hands the worker specs that say what to copy.

How data moves, and who learns what when:

- **Store**: blocks land in CPU slots (GPU -> CPU job). The job completes when its GPU
  copy does (GPU blocks are never held on disk I/O); ``complete_store`` makes them
  loadable from CPU.
- **Cascade**: when CPU is full, LRU victims make room. A victim that is already durable
  on disk, or already on its way there, is just dropped from CPU. Any other victim is
  *spilled*: the store spec that reuses its slot lists it in ``spills``, and the worker
  copies the slot into a staging buffer before the GPU copy overwrites it (a slot is
  never overwritten while something still reads it). With ``write_through`` every stored
  block is also queued for disk once it is in CPU.
- **Disk durability** is learned from the shared disk index, not from jobs: workers
  commit a block's index entry only after its bytes are durable on their rank, and the
  disk manager's ``refresh()`` reads those commits: its flusher thread does so in the
  background while writes are pending, and a lookup that meets a pending block, or a
  store whose back-pressure bound would bite, does so at once. Until then a block is
  *pending* on disk: not loadable from there, but as good as durable for the cascade.
- **Back-pressure**: at most ``max_pending_disk_writes`` blocks may be waiting for a disk
  write. Past that, write-through copies are skipped and spill victims leave the
  hierarchy; both are counted as drops. The engine never waits for the disk.
- **Load**: blocks come from CPU where they are, else from disk (a ``TieredLoadSpec``).
  With ``promote_on_hit`` a disk block is also brought into a CPU slot that can be had
  without a spill and without touching blocks pinned by loads; the slot becomes loadable
  when the last load of that block completes successfully.
- ``block_hashes_evicted`` lists only blocks that left the whole hierarchy.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from itertools import islice

from tiered_kv.abstract import (BlockHash, LoadStoreSpec, OffloadingEvent, OffloadingManager,
                                PrepareStoreOutput)
from tiered_kv.config import WRITE_POLICIES
from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.mediums import CPULoadStoreSpec
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.specs import DiskWrites, TieredLoadSpec, TieredStoreSpec

logger = logging.getLogger(__name__)


class TieredOffloadingManager(OffloadingManager):
    """Composite of a ``CPUOffloadingManager`` and (optionally) a disk tier manager.

    ``disk`` must offer the seed API plus ``is_loadable``, ``is_pending``,
    ``absent_among``, ``num_pending``, ``pending_blocks``, ``refresh`` and
    ``on_corrupt`` (see ``tiered_kv.disk.manager.DiskOffloadingManager``). Without it
    this is the CPU tier with the same cascade bookkeeping (victims simply leave).

    ``stats`` counts blocks per tier: ``lookups`` the blocks ``lookup`` asked each tier
    about (the disk tier is asked about those CPU does not hold), ``hits`` the blocks
    ``prepare_load`` took from it, ``stores`` the blocks placed in it (for the disk
    tier: write-through copies and spills), ``failed_loads`` its blocks in load jobs that
    failed (a job fails as a whole), ``checksum_failures`` the disk blocks workers found
    corrupt (learned from the disk tier's index), and the rest as named.
    """

    def __init__(self, cpu: CPUOffloadingManager, disk=None, *, write_policy: str = "write_through",
                 promote_on_hit: bool = True, max_pending_disk_writes: int = 256,
                 stats: TieredStats | None = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy: expected one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        if max_pending_disk_writes < 1:
            raise ValueError(f"max_pending_disk_writes must be >= 1, got {max_pending_disk_writes}")
        self.cpu = cpu
        self.disk = disk
        self._write_policy = write_policy
        self.promote_on_hit = promote_on_hit
        self.max_pending_disk_writes = max_pending_disk_writes
        self.stats = stats if stats is not None else TieredStats()
        # Blocks of an in-flight store that carry a write-through disk slot.
        self._write_through: set[BlockHash] = set()
        # Outstanding loads per block, by tier. For one block they are all CPU or all disk:
        # a CPU-resident block is pinned there, and a promotion completes only once no disk
        # load of the block is outstanding.
        self._cpu_loads: Counter[BlockHash] = Counter()
        self._disk_loads: Counter[BlockHash] = Counter()
        # Promotions in flight: block -> whether every load of it has succeeded so far.
        self._promoting: dict[BlockHash, bool] = {}
        # With write_back, the CPU blocks that may also be on disk: the promoted ones. Only
        # a spill writes a block to disk then, and a spilled block leaves CPU; so any other
        # CPU block is known to be absent there, and evicting it needs no disk lookup.
        self._from_disk: set[BlockHash] = set()
        if disk is not None:
            disk.on_corrupt = self._count_corrupt

    @property
    def write_policy(self) -> str:
        """``write_through`` or ``write_back``, fixed at construction."""
        return self._write_policy

    # ------------------------------------------------------------------ queries

    def _on_disk(self, block_hash: BlockHash) -> bool:
        return self.disk is not None and self.disk.is_loadable(block_hash)

    def _refresh_disk(self) -> None:
        """Fold in disk-write outcomes the workers have committed to the index."""
        if self.disk is not None and self.disk.num_pending():
            self.disk.refresh()

    def _disk_budget(self, wanted: int) -> int:
        """How many of ``wanted`` more blocks may wait for a disk write now. Reads the
        workers' outcomes first when the bound would bite, so no block is dropped for
        news not yet read."""
        if self.disk.num_pending() + wanted > self.max_pending_disk_writes:
            self._refresh_disk()
        return min(wanted, max(self.max_pending_disk_writes - self.disk.num_pending(), 0))

    def _count_corrupt(self, block_hashes: list[BlockHash]) -> None:
        self.stats.count("disk", "checksum_failures", len(block_hashes))

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        hits = asked_disk = 0
        missed = refreshed = False
        for block_hash in block_hashes:
            if self.cpu.is_loadable(block_hash):
                hits += 1
                continue
            if self.disk is not None:
                asked_disk += 1
                if self.disk.is_loadable(block_hash):
                    hits += 1
                    continue
                if not refreshed and self.disk.is_pending(block_hash):
                    refreshed = True
                    self._refresh_disk()
                    if self.disk.is_loadable(block_hash):
                        hits += 1
                        continue
            missed = True
            break
        self.stats.count("cpu", "lookups", hits + missed)
        self.stats.count("disk", "lookups", asked_disk)
        return hits

    def hit_medium(self, block_hash: BlockHash) -> str | None:
        """Which tier would serve ``block_hash`` now: ``"CPU"``, ``"DISK"`` or None."""
        if self.cpu.is_loadable(block_hash):
            return "CPU"
        if self._on_disk(block_hash):
            return "DISK"
        return None

    # ------------------------------------------------------------------ loads

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        block_hashes = list(block_hashes)
        sources = [self.hit_medium(h) for h in block_hashes]
        for block_hash, source in zip(block_hashes, sources):
            if source is None:
                raise KeyError(f"block {block_hash.hex()[:16]} is not offloaded; "
                               f"prepare_load needs blocks that lookup() reported")
        cpu_hashes = [h for h, s in zip(block_hashes, sources) if s == "CPU"]
        self.cpu.pin(cpu_hashes)
        self._cpu_loads.update(cpu_hashes)
        self.stats.count("cpu", "hits", len(cpu_hashes))
        if len(cpu_hashes) == len(block_hashes):
            return CPULoadStoreSpec([self.cpu.slot_of(h) for h in block_hashes])

        disk_hashes = [h for h, s in zip(block_hashes, sources) if s == "DISK"]
        disk_spec = self.disk.prepare_load(disk_hashes)
        disk_slot = dict(zip(disk_hashes, disk_spec.id_list()))
        self._disk_loads.update(disk_hashes)
        self.stats.count("disk", "hits", len(disk_hashes))
        promote_slot = self._start_promotions(disk_hashes) if self.promote_on_hit else {}
        return TieredLoadSpec(
            cpu_slots=[self.cpu.slot_of(h) if s == "CPU" else -1 for h, s in zip(block_hashes, sources)],
            disk_slots=[disk_slot.get(h, -1) for h in block_hashes],
            promote_slots=[promote_slot.get(h, -1) for h in block_hashes],
            block_hashes=block_hashes,
        )

    def _start_promotions(self, disk_hashes: list[BlockHash]) -> dict[BlockHash, int]:
        """Reserve CPU slots for disk blocks being loaded, using only free slots and
        victims that are durable on disk (no spill, no pinned block)."""
        wanted = list(dict.fromkeys(h for h in disk_hashes
                                    if h not in self.cpu and h not in self._promoting))
        if not wanted:
            return {}
        wanted = wanted[: self.cpu.num_free_slots() + self._droppable_count(len(wanted))]
        self._make_room(len(wanted), allow_spill=False)
        slots = self.cpu.allocate(wanted)
        if slots is None:  # the CPU tier is busy with pinned blocks: load without promotion
            return {}
        for block_hash in wanted:
            self._promoting[block_hash] = True
        if self.write_policy == "write_back":
            self._from_disk.update(wanted)
        self.stats.count("cpu", "promotions", len(wanted))
        return dict(zip(wanted, slots))

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Unpin blocks of a finished load. ``success=False`` (an extension of the seed
        API) says the load job failed, so promotions it carried are abandoned."""
        cpu_done, disk_done = [], []
        for block_hash in block_hashes:
            if self._cpu_loads[block_hash] > 0:
                self._cpu_loads[block_hash] -= 1
                if not self._cpu_loads[block_hash]:
                    del self._cpu_loads[block_hash]
                cpu_done.append(block_hash)
            elif self._disk_loads[block_hash] > 0:
                self._disk_loads[block_hash] -= 1
                disk_done.append(block_hash)
                if block_hash in self._promoting:
                    self._promoting[block_hash] &= success
                if not self._disk_loads[block_hash]:
                    del self._disk_loads[block_hash]
                    if block_hash in self._promoting:
                        promoted = self._promoting.pop(block_hash)
                        self.cpu.complete_store([block_hash], success=promoted)
                        if not promoted:
                            self._from_disk.discard(block_hash)
        if cpu_done:
            self.cpu.complete_load(cpu_done)
        if disk_done:
            self.disk.complete_load(disk_done)
        if not success:
            self.stats.count("cpu", "failed_loads", len(cpu_done))
            self.stats.count("disk", "failed_loads", len(disk_done))
            # A failed disk read may mean a corrupt block that the worker dropped from the index.
            if self.disk is not None:
                self.disk.refresh()

    # ------------------------------------------------------------------ stores

    def _droppable_count(self, limit: int) -> int:
        """How many of the next LRU CPU victims could go without a spill (durable on
        disk or already queued there), up to ``limit``."""
        victims = list(islice(self.cpu.iter_evictable(), limit))
        unsafe = set(self._absent_from_disk(victims))
        return next((i for i, victim in enumerate(victims) if victim in unsafe), len(victims))

    def _make_room(self, needed: int, allow_spill: bool) -> tuple[DiskWrites, list[BlockHash]] | None:
        """Free ``needed`` CPU slots by cascading LRU victims. Returns the spills to carry
        and the blocks that left the hierarchy, or None (changing nothing) if there are
        not enough unpinned victims."""
        shortfall = needed - self.cpu.num_free_slots()
        if shortfall <= 0:
            return DiskWrites(), []
        evicted_from_cpu = self.cpu.evict(shortfall)
        if evicted_from_cpu is None:
            return None
        victims, cpu_slots = evicted_from_cpu
        self.stats.count("cpu", "evictions", len(victims))
        spills = DiskWrites()
        if self.disk is None:
            self.stats.count("cpu", "drops", len(victims))
            return spills, victims
        # Victims already durable on disk, or on their way there, are simply gone from CPU.
        unsafe = self._absent_from_disk(victims)
        if self._from_disk:
            self._from_disk.difference_update(victims)
        if not unsafe:
            return spills, []
        budget = self._disk_budget(len(unsafe)) if allow_spill else 0
        out = self.disk.prepare_store(unsafe[:budget], fresh=True) if budget else None
        evicted = unsafe
        if out is not None:
            spilled = out.block_hashes_to_store
            if spilled == victims:  # write_back's usual case: every victim spills
                spill_slots = cpu_slots
            else:
                cpu_slot = dict(zip(victims, cpu_slots))
                spill_slots = list(map(cpu_slot.__getitem__, spilled))
            spills = DiskWrites(spill_slots, out.store_spec.id_list(), spilled)
            if len(spilled) < len(unsafe):
                spilled_set = set(spilled)
                evicted = [h for h in unsafe if h not in spilled_set]
            else:
                evicted = []
            evicted.extend(self._gone_from_cpu(out.block_hashes_evicted))
            self.stats.count("disk", "evictions", len(out.block_hashes_evicted))
        self.stats.count("cpu", "spills", len(spills))
        self.stats.count("disk", "stores", len(spills))
        self.stats.count("cpu", "drops", len(evicted))
        return spills, evicted

    def _gone_from_cpu(self, disk_evicted: list[BlockHash]) -> list[BlockHash]:
        """The members of ``disk_evicted`` that are not in CPU either: they left the
        hierarchy. With write_back only promoted blocks can be in both tiers, so the
        others need no CPU lookup."""
        if self.write_policy != "write_back":
            return self.cpu.missing_among(disk_evicted)
        both = self._from_disk
        if not both:
            return list(disk_evicted)
        return [h for h in disk_evicted if h not in both or h not in self.cpu]

    def _absent_from_disk(self, cpu_blocks: list[BlockHash]) -> list[BlockHash]:
        """The members of ``cpu_blocks`` (in CPU now) that are neither loadable nor
        pending on disk, in order: the ones an eviction must spill."""
        if self.write_policy != "write_back":
            return self.disk.absent_among(cpu_blocks)
        maybe = self._from_disk.intersection(cpu_blocks) if self._from_disk else ()
        if not maybe:
            return list(cpu_blocks)
        absent = set(self.disk.absent_among(maybe))
        return [h for h in cpu_blocks if h not in maybe or h in absent]

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        to_store = self.cpu.missing_among(dict.fromkeys(block_hashes))
        if self.disk is not None and to_store:
            to_store = self.disk.absent_among(to_store)
        if not to_store:
            return PrepareStoreOutput([], TieredStoreSpec([]), [])
        room = self._make_room(len(to_store), allow_spill=True)
        if room is None:
            return None
        spills, evicted = room
        slots = self.cpu.allocate(to_store, checked=False)  # distinct, and missing from CPU
        if slots is None:  # cannot happen after _make_room; keep the contract anyway
            raise RuntimeError("CPU tier refused an allocation it had room for")
        write_through = self._plan_write_through(to_store, slots, evicted)
        self.stats.count("cpu", "stores", len(to_store))
        return PrepareStoreOutput(
            block_hashes_to_store=to_store,
            store_spec=TieredStoreSpec(slots, spills=spills, write_through=write_through),
            block_hashes_evicted=evicted,
        )

    def _plan_write_through(self, to_store: list[BlockHash], cpu_slots: list[int],
                            evicted: list[BlockHash]) -> DiskWrites:
        if self.write_policy != "write_through" or self.disk is None:
            return DiskWrites()
        candidates = to_store[:self._disk_budget(len(to_store))]
        skipped = len(to_store) - len(candidates)
        out = self.disk.prepare_store(candidates, fresh=True) if candidates else None
        if out is None:
            skipped = len(to_store)
            writes = DiskWrites()
        else:
            cpu_slot = dict(zip(to_store, cpu_slots))
            writes = DiskWrites(list(map(cpu_slot.__getitem__, out.block_hashes_to_store)),
                                out.store_spec.id_list(), out.block_hashes_to_store)
            # Disk evictions here only remove blocks that are no longer in CPU either.
            evicted.extend(self._gone_from_cpu(out.block_hashes_evicted))
            self.stats.count("disk", "evictions", len(out.block_hashes_evicted))
        if skipped:
            self.stats.count("disk", "drops", skipped)
        self._write_through.update(writes.block_hashes)
        self.stats.count("disk", "stores", len(writes))
        return writes

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        block_hashes = list(block_hashes)
        self.cpu.complete_store(block_hashes, success)
        if not success:
            self.stats.count("cpu", "failed_stores", len(block_hashes))
        abandoned = [h for h in block_hashes if h in self._write_through]
        self._write_through.difference_update(abandoned)
        if not success and abandoned:
            # The worker never had the bytes to write: release the reserved disk slots.
            self.disk.complete_store(abandoned, success=False)

    # ------------------------------------------------------------------ misc

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        block_hashes = list(block_hashes)
        self.cpu.touch(block_hashes)
        if self.disk is not None:
            self.disk.touch(block_hashes)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = list(self.cpu.take_events())
        if self.disk is not None:
            events.extend(self.disk.take_events())
        return events

    def pending_disk_writes(self) -> int:
        """Blocks queued for a disk write whose outcome the index has not shown yet."""
        self._refresh_disk()
        return self.disk.num_pending() if self.disk is not None else 0

    def pending_disk_blocks(self) -> set[BlockHash]:
        """The blocks counted by ``pending_disk_writes`` (a copy)."""
        self._refresh_disk()
        return self.disk.pending_blocks() if self.disk is not None else set()

    def used_blocks(self) -> dict[str, int]:
        used = {"cpu": self.cpu.num_slots - self.cpu.num_free_slots()}
        if self.disk is not None:
            used["disk"] = self.disk.capacity - self.disk.num_free_slots()
        return used

    def shutdown(self) -> None:
        if self.disk is not None:
            self.disk.shutdown()
        self.cpu.shutdown()
