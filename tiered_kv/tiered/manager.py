"""TieredOffloadingManager: an ordered list of tiers, fastest first, as one OffloadingManager.

Runs in the scheduler process. Never does block I/O, fsync or a synced index write on the caller's thread: it only
decides, and hands the worker specs that say what to copy.

The first tier is the CPU tier (``CPUOffloadingManager``): every block enters the hierarchy there, from the GPU, and
every lower tier (``LowerTier``: the disk tier, a second disk tier, the shared tier, a tier of the operator's own) is
written from CPU slots. CPU only, CPU + disk and CPU + disk + more are the same code. How data moves, and who learns
what when:

- **Store**: blocks land in CPU slots (GPU -> CPU job). The job completes when its GPU copy does (GPU blocks are never
  held on lower-tier I/O); ``complete_store`` makes them loadable from CPU. A block offered was just computed: lacking
  in CPU it enters, though a lower tier holds it (as in a CPU tier alone; that tier is not written again). A
  ``write_through`` lower tier also gets every stored block, copied from its CPU slot once it is there.
- **Cascade**: when CPU is full, its victims make room. A victim that some lower tier holds (durable, or on its way)
  is just dropped from CPU. A victim is *spilled* into every lower tier that lacks it (the policy of a
  ``write_back`` tier, and for a ``write_through`` one the write it missed): the store spec that reuses its slot
  lists it, and the worker copies the slot into a staging buffer before the GPU copy overwrites it (a slot is never
  overwritten while something still reads it). A lower tier's own victims leave the hierarchy unless CPU or another
  lower tier holds them.
- **Durability** of a lower tier's blocks is learned from that tier (the disk tier: its shared index, which workers
  commit to only after a block's bytes are durable on their rank), not from jobs. Until then a block is *pending*
  there: not loadable from it, but as good as present for the cascade.
- **Back-pressure**: at most ``max_pending_writes`` blocks (``max_pending_disk_writes``) may wait for a write into each
  lower tier; past that, write-through copies are skipped and spill victims leave (counted as drops). The engine never
  waits for a tier.
- **Load**: each block comes from the fastest tier that holds it (a ``TieredLoadSpec`` when any is below CPU). With
  ``promote_on_hit`` a lower-tier block is also brought into a CPU slot that can be had without a spill and without
  touching blocks pinned by loads; the slot becomes loadable when the last load of that block completes well. A block
  that left its lower tier between ``lookup`` and ``prepare_load`` (found corrupt, gone from the bucket) gets no slot:
  the worker fails its load, and vLLM recomputes the request, as for any failed load.
- **Cost**: ``lookup`` answers the number of leading blocks whose load makes the time to first token shortest
  (``tiered_kv.cost``: measured load cost per tier against the prefill of the same tokens; zero is always a
  candidate). Blocks passed over are counted per tier (``skipped_slower_than_recompute``): not loaded, not promoted,
  not a hit; once recomputed, the engine's store puts them into CPU again. ``costs=None`` (no block size known)
  loads every block found.
- **Write admission**: a lower tier with ``admit_after`` N > 1 (``write_admission: reuse(N)``) is written a block only
  once the block has been stored or hit N times (counted over a bounded history of recent blocks); a CPU victim not
  yet admitted anywhere leaves the hierarchy (``not_admitted``). ``cpu_admission: reuse(N)`` ranks a block first to
  evict in CPU until its Nth use (it still lands there: lower tiers are written from CPU slots). A store
  ``cpu_only`` (a LoRA request's) is admitted to no lower tier: its blocks live in CPU and leave from there.
- ``block_hashes_evicted`` lists only blocks that left the whole hierarchy.
- **A store never evicts its own request** (vLLM's contract): the blocks offered to one ``prepare_store`` are no
  victim in any tier, neither of the CPU cascade nor of the lower-tier slots its spills and write-through copies
  take; where room cannot be made otherwise the call returns None and changes nothing. Promotions likewise never
  evict the blocks their load pins. Afterwards the request's CPU blocks rank most recent, its head most recent of
  all.
- **Retention**: each use (``prepare_load``, ``prepare_store``, with its ``session`` and ``request`` where the engine
  names them) is told to the CPU tier's and each lower tier's ``retention``, whose holds their evictions pass over.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import islice

from tiered_kv.abstract import (
    AbandonsStores,
    BlockHash,
    LoadStoreSpec,
    LowerTier,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from tiered_kv.config import TieredConfig, write_policy_per_tier
from tiered_kv.cost import LoadCosts
from tiered_kv.prefill import DEFAULT_PREFILL_TOKENS_PER_S
from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.mediums import CPU, CPULoadStoreSpec, ids_spec
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.admission import WriteAdmission
from tiered_kv.tiered.retention import SessionRetention
from tiered_kv.tiered.transfer_specs import TierWrites, TieredLoadSpec, TieredStoreSpec

logger = logging.getLogger(__name__)


class TieredOffloadingManager(OffloadingManager):
    """Composite of a ``CPUOffloadingManager`` and the lower tiers below it, in order.

    ``lower``: one ``LowerTier``, a sequence of them (fastest first), or None for the CPU tier alone with the
    same cascade bookkeeping (victims simply leave). ``write_policy``: one policy for every lower tier, or one per tier.

    ``stats`` counts blocks per tier (by tier name: ``cpu``, ``disk``, ...): ``lookups`` the blocks ``lookup`` asked
    each tier about (a lower tier is asked about those the tiers above do not hold), ``hits`` the blocks
    ``prepare_load`` took from it, ``stores`` the blocks placed in it (for a lower tier: write-through copies and
    spills), ``failed_loads`` its blocks in load jobs that failed (a job fails as a whole), ``checksum_failures`` the
    blocks workers found corrupt (learned from the tier), and the rest as named.
    """

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        lower: LowerTier | Sequence[LowerTier] | None = None,
        *,
        write_policy: str | Sequence[str] = TieredConfig.write_policy,
        promote_on_hit: bool = TieredConfig.promote_on_hit,
        max_pending_writes: int = TieredConfig.max_pending_disk_writes,
        stats: TieredStats | None = None,
        costs: LoadCosts | None = None,
        cost_aware: bool = TieredConfig.cost_aware,
        prefill_tokens_per_s: float | None = None,
        prefill_configured: bool = False,
        bytes_per_block: int | None = None,
        admit_after: int | Sequence[int] = 1,
        priors: Mapping[str, float] | None = None,
    ):
        tiers = [] if lower is None else [lower] if not isinstance(lower, Sequence) else list(lower)
        policies = write_policy_per_tier(write_policy, len(tiers))
        if max_pending_writes < 1:
            raise ValueError(f"max_pending_writes must be >= 1, got {max_pending_writes}")
        names = [t.name for t in tiers]
        if len(set(names + [CPU.lower()])) != len(names) + 1:
            raise ValueError(f"every tier needs its own name; got cpu, {', '.join(names)}")
        self.cpu = cpu
        self.lower = tiers
        self.write_policies = policies
        self.promote_on_hit = promote_on_hit
        self.max_pending_writes = max_pending_writes
        self.stats = stats if stats is not None else TieredStats()
        # Per lower tier: blocks of an in-flight store that carry a write-through slot there.
        self._write_through: list[set[BlockHash]] = [set() for _ in tiers]
        # Outstanding loads per block: from CPU, and from each lower tier. For one block
        # they all come from one tier: a CPU-resident block is pinned there, and a
        # promotion completes only once no lower-tier load of the block is outstanding.
        self._cpu_loads: Counter[BlockHash] = Counter()
        self._lower_loads: list[Counter[BlockHash]] = [Counter() for _ in tiers]
        # Promotions in flight: block -> whether every load of it has succeeded so far.
        self._promoting: dict[BlockHash, bool] = {}
        # Where no lower tier is write-through, the CPU blocks that may also be in one: the
        # promoted ones. Only a spill writes a block down then, and a spilled block leaves
        # CPU; so any other CPU block is absent below: evicting it needs no lookup there.
        self._write_back_only = bool(tiers) and all(p == "write_back" for p in policies)
        self._from_lower: set[BlockHash] = set()
        for tier in tiers:
            tier.on_corrupt = lambda hashes, name=tier.name: self.stats.count(name, "checksum_failures", len(hashes))
        if costs is None:
            bpb = bytes_per_block or next((getattr(t, "block_bytes", None) for t in tiers), None)
            if bpb:
                costs = LoadCosts.for_tiers(
                    {"cpu": CPU, **{t.name: t.medium for t in tiers}},
                    bytes_per_block=bpb,
                    tokens_per_block=cpu.block_size,
                    prefill_tokens_per_s=prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S,
                    prefill_configured=prefill_configured,
                    priors=priors,
                )
        if costs is not None:
            costs.enabled = cost_aware
        self.costs = costs
        admit = [admit_after] * len(tiers) if isinstance(admit_after, int) else list(admit_after)
        self.admission = WriteAdmission(admit, names, 2 * (cpu.num_slots + sum(t.capacity for t in tiers)), self.stats)
        cpu.admission.stats = self.stats  # the CPU tier's not_admitted beside the other counters
        self._retentions = [r for t in tiers if isinstance(r := getattr(t, "retention", None), SessionRetention)]

    def tier(self, name: str) -> LowerTier | None:
        """The lower tier named ``name`` (``disk``, ``remote``, ...), or None."""
        return next((t for t in self.lower if t.name == name), None)

    # ------------------------------------------------------------------ queries

    def _budget(self, tier: LowerTier, wanted: int) -> int:
        """How many of ``wanted`` more blocks may wait for a write into ``tier`` now.
        Reads the workers' outcomes first when the bound would bite, so no block is
        dropped for news not yet read."""
        if tier.num_pending() + wanted > self.max_pending_writes:
            tier.refresh()
        return min(wanted, max(self.max_pending_writes - tier.num_pending(), 0))

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """The number of leading blocks to load: of the leading run found offloaded, the
        prefix whose load minimises the estimated time to first token (``costs``)."""
        block_hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        return self.decide(block_hashes, self.sources(block_hashes))

    def sources(self, block_hashes: Sequence[BlockHash]) -> list[list]:
        """The leading run of ``block_hashes`` found loadable, as ``[tier name, blocks]``
        per run of blocks one tier serves (the fastest holding them), in block order."""
        runs: list[list] = []
        missed = False
        asked = [0] * len(self.lower)
        refreshed = [False] * len(self.lower)
        for block_hash in block_hashes:
            source = "cpu" if self.cpu.is_loadable(block_hash) else None
            for i, tier in enumerate(self.lower if source is None else ()):
                asked[i] += 1
                loadable = tier.is_loadable(block_hash)
                if not loadable and not refreshed[i] and tier.is_pending(block_hash):
                    refreshed[i] = True
                    tier.refresh()
                    loadable = tier.is_loadable(block_hash)
                if loadable:
                    source = tier.name
                    break
            if source is None:
                missed = True
                break
            if runs and runs[-1][0] == source:
                runs[-1][1] += 1
            else:
                runs.append([source, 1])
        self.stats.count("cpu", "lookups", sum(m for _, m in runs) + missed)
        for tier, n in zip(self.lower, asked):
            self.stats.count(tier.name, "lookups", n)
        return runs

    def decide(self, block_hashes: Sequence[BlockHash], runs: Sequence[Sequence], start: int = 0) -> int:
        """How many of ``block_hashes`` (from token ``start``) to load, their leading run
        served as ``runs`` (``sources``' form): the cost plan; the blocks it passes over are
        counted per tier (once recomputed, the engine's store puts them into CPU again)."""
        if self.costs is None:
            return sum(m for _, m in runs)
        # The tiers' queues as they are now; the GPU's as the engine last reported it.
        self.costs.queues = replace(self.costs.queues, tier_blocks=self.queued_blocks(), tier_loads=self.queued_loads())
        plan = self.costs.plan_runs(runs, start)
        for name, n in plan.skipped.items():
            self.stats.count(name, "skipped_slower_than_recompute", n)
        if plan.probe is not None:
            self.stats.count(plan.probe, "probes", 1)
        return plan.blocks

    def hit_tier(self, block_hash: BlockHash) -> int | None:
        """Which tier a new load reads ``block_hash`` from: -1 for CPU, a lower tier's
        index in ``lower``, or None. A block that an unfinished load reads from a lower
        tier is read from there again, even if it has since landed in CPU:
        ``complete_load`` names blocks, not loads, so every load in flight of one block
        must hold its pin in the same tier (else the first to finish would release the
        other's pin, and its slot could be reused under the other's transfer)."""
        if any(self._lower_loads):
            for i, loads in enumerate(self._lower_loads):
                if loads.get(block_hash, 0) and self.lower[i].is_loadable(block_hash):
                    return i
        if self.cpu.is_loadable(block_hash):
            return -1
        for i, tier in enumerate(self.lower):
            if tier.is_loadable(block_hash):
                return i
        return None

    def hit_medium(self, block_hash: BlockHash) -> str | None:
        """Which tier would serve ``block_hash`` now: ``"CPU"``, a lower tier's medium, or None."""
        i = self.hit_tier(block_hash)
        return None if i is None else CPU if i < 0 else self.lower[i].medium

    # ------------------------------------------------------------------ loads

    def prepare_load(
        self, block_hashes: Iterable[BlockHash], *, session: Hashable | None = None, request: Hashable | None = None
    ) -> LoadStoreSpec:
        block_hashes = list(block_hashes)
        gone = len(self.lower)  # no tier: left its tier since lookup (module docstring)
        sources = [gone if (s := self.hit_tier(h)) is None else s for h in block_hashes]
        if gone in sources:
            logger.warning("%d block(s) of a load left their tier since lookup: their load fails", sources.count(gone))
        self._note_uses(block_hashes, session, request)
        cpu_hashes = [h for h, s in zip(block_hashes, sources) if s < 0]
        self.cpu.pin(cpu_hashes)
        self._cpu_loads.update(cpu_hashes)
        self.stats.count("cpu", "hits", len(cpu_hashes))
        if len(cpu_hashes) == len(block_hashes):
            return CPULoadStoreSpec(self.cpu.slots_of(block_hashes))
        lower_slot: dict[BlockHash, int] = {}
        lower_hashes: list[BlockHash] = []
        for i, tier in enumerate(self.lower):
            hashes = [h for h, s in zip(block_hashes, sources) if s == i]
            if not hashes:
                continue
            lower_slot.update(zip(hashes, ids_spec(tier.prepare_load(hashes)).id_list()))
            self._lower_loads[i].update(hashes)
            self.stats.count(tier.name, "hits", len(hashes))
            lower_hashes.extend(hashes)
        promote_slot = self._start_promotions(lower_hashes) if self.promote_on_hit else {}
        cpu_slot = dict(zip(cpu_hashes, self.cpu.slots_of(cpu_hashes)))
        return TieredLoadSpec(
            cpu_slots=[cpu_slot.get(h, -1) for h in block_hashes],
            tier_slots=[lower_slot.get(h, -1) for h in block_hashes],
            promote_slots=[promote_slot.get(h, -1) for h in block_hashes],
            block_hashes=block_hashes,
            lower_tiers=[s if 0 < s < gone else 0 for s in sources],
        )

    def _start_promotions(self, lower_hashes: list[BlockHash], prefetch: bool = False) -> dict[BlockHash, int]:
        """Reserve CPU slots for lower-tier blocks being loaded, using only free slots and
        victims that a lower tier holds (no spill, no pinned block); a ``prefetch`` ranks
        them most recent whatever ``cpu_admission`` says: the use it serves is to come."""
        wanted = list(dict.fromkeys(h for h in lower_hashes if h not in self.cpu and h not in self._promoting))
        if not wanted:
            return {}
        protected = set(lower_hashes)
        wanted = wanted[: self.cpu.num_free_slots() + self._droppable_count(len(wanted), protected)]
        self.cpu.note_store_misses(wanted)
        self._make_room(len(wanted), allow_spill=False, protected=protected)
        slots = self.cpu.allocate(wanted, protected=protected, admit=prefetch)
        if slots is None:  # the CPU tier is busy with pinned blocks: load without promotion
            return {}
        for block_hash in wanted:
            self._promoting[block_hash] = True
        if self._write_back_only:
            self._from_lower.update(wanted)
        self.stats.count("cpu", "promotions", len(wanted))
        return dict(zip(wanted, slots))

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Unpin blocks of a finished load. ``success=False`` (an extension of the seed
        API) says the load job failed, so promotions it carried are abandoned."""
        cpu_done: list[BlockHash] = []
        lower_done: list[list[BlockHash]] = [[] for _ in self.lower]
        for block_hash in block_hashes:
            if self._cpu_loads[block_hash] > 0:
                self._cpu_loads[block_hash] -= 1
                if not self._cpu_loads[block_hash]:
                    del self._cpu_loads[block_hash]
                cpu_done.append(block_hash)
                continue
            for loads, done in zip(self._lower_loads, lower_done):
                if loads[block_hash] > 0:
                    loads[block_hash] -= 1
                    done.append(block_hash)
                    if block_hash in self._promoting:
                        self._promoting[block_hash] &= success
                    if not loads[block_hash]:
                        del loads[block_hash]
                        if block_hash in self._promoting:
                            promoted = self._promoting.pop(block_hash)
                            self.cpu.complete_store([block_hash], success=promoted)
                            if not promoted:
                                self._from_lower.discard(block_hash)
                    break
        if cpu_done:
            self.cpu.complete_load(cpu_done)
        for tier, done in zip(self.lower, lower_done):
            if done:
                tier.complete_load(done, success)
        if not success:
            self.stats.count("cpu", "failed_loads", len(cpu_done))
            for tier, done in zip(self.lower, lower_done):
                self.stats.count(tier.name, "failed_loads", len(done))
                if done:
                    # A failed read may mean a corrupt block the worker dropped from the index.
                    tier.refresh()

    # ------------------------------------------------------------------ stores

    def _note_uses(self, block_hashes: list[BlockHash], session: Hashable | None, request: Hashable | None) -> None:
        """A use of the blocks (of ``session``, by ``request``, where named): write admission's, every tier's retention."""
        self.admission.note(block_hashes)
        self.cpu.note_uses(block_hashes, session, request)
        for retention in self._retentions:
            retention.observe(block_hashes, session, request)

    def _droppable_count(self, limit: int, protected: set[BlockHash]) -> int:
        """How many of the next CPU victims (none in ``protected``) could go without a
        spill (a lower tier holds them or is getting them), up to ``limit``."""
        victims = list(islice(self.cpu.iter_evictable(protected), limit))
        cpu_only = self.admission.cpu_only
        unsafe = {h for h in self._in_no_lower_tier(victims) if not cpu_only(h)}
        return next((i for i, victim in enumerate(victims) if victim in unsafe), len(victims))

    def _in_no_lower_tier(self, cpu_blocks: list[BlockHash]) -> list[BlockHash]:
        """The members of ``cpu_blocks`` that no lower tier holds or is getting."""
        absent = cpu_blocks
        for i in range(len(self.lower)):
            if not absent:
                break
            absent = self._absent_from(i, absent)
        return list(absent)

    def _absent_from(self, i: int, cpu_blocks: list[BlockHash]) -> list[BlockHash]:
        """The members of ``cpu_blocks`` (in CPU now) that are neither loadable nor
        pending in lower tier ``i``, in order."""
        if not self._write_back_only:
            return self.lower[i].absent_among(cpu_blocks)
        maybe = self._from_lower.intersection(cpu_blocks) if self._from_lower else ()
        if not maybe:
            return list(cpu_blocks)
        absent = set(self.lower[i].absent_among(maybe))
        return [h for h in cpu_blocks if h not in maybe or h in absent]

    def _left_hierarchy(self, evicted_from: int, hashes: list[BlockHash]) -> list[BlockHash]:
        """The members of ``hashes`` (just evicted from lower tier ``evicted_from``) that
        neither CPU nor another lower tier holds: they left the hierarchy."""
        if not hashes:
            return []
        if self._write_back_only and not self._from_lower:
            gone = list(hashes)  # no CPU block is also below: these are not in CPU
        else:
            gone = self.cpu.missing_among(hashes)
        for i, tier in enumerate(self.lower):
            if i != evicted_from and gone:
                gone = tier.absent_among(gone)
        return gone

    def _make_room(
        self, needed: int, allow_spill: bool, protected: set[BlockHash]
    ) -> tuple[list[TierWrites], list[BlockHash]] | None:
        """Free ``needed`` CPU slots by cascading victims, none of them in ``protected``
        (nor evicted from a lower tier to take a spill). Returns the spills to carry, per
        lower tier, and the blocks that left the hierarchy, or None (changing nothing)
        if there are not enough unpinned victims."""
        spills = [TierWrites() for _ in self.lower]
        shortfall = needed - self.cpu.num_free_slots()
        if shortfall <= 0:
            return spills, []
        evicted_from_cpu = self.cpu.evict(shortfall, protected)
        if evicted_from_cpu is None:
            return None
        victims, cpu_slots = evicted_from_cpu
        self.stats.count("cpu", "evictions", len(victims))
        if not self.lower:
            self.stats.count("cpu", "drops", len(victims))
            return spills, victims
        held: set[BlockHash] = set()  # victims some lower tier holds or now gets
        gone: list[BlockHash] = []
        cpu_slot = None
        for i, tier in enumerate(self.lower):
            unsafe = self._absent_from(i, victims)
            if len(unsafe) < len(victims):
                if len(held) < len(victims):
                    unsafe_set = set(unsafe)
                    held.update(h for h in victims if h not in unsafe_set)
            if not unsafe:
                continue
            if allow_spill:
                unsafe = self.admission.admitted(i, unsafe)
            budget = self._budget(tier, len(unsafe)) if allow_spill and unsafe else 0
            out = tier.prepare_store(unsafe[:budget], fresh=True, protected=protected) if budget else None
            if out is None:
                continue
            spilled = out.block_hashes_to_store
            if spilled == victims:  # write_back's usual case: every victim spills
                spill_slots = cpu_slots
            else:
                if cpu_slot is None:
                    cpu_slot = dict(zip(victims, cpu_slots))
                spill_slots = list(map(cpu_slot.__getitem__, spilled))
            spills[i] = TierWrites(spill_slots, ids_spec(out.store_spec).id_list(), spilled)
            held.update(spilled)
            gone.extend(self._left_hierarchy(i, out.block_hashes_evicted))
            self.stats.count(tier.name, "evictions", len(out.block_hashes_evicted))
            self.stats.count(tier.name, "stores", len(spilled))
            self.stats.count("cpu", "spills", len(spilled))
        if self._from_lower:
            self._from_lower.difference_update(victims)
        evicted = [h for h in victims if h not in held] if len(held) < len(victims) else []
        self.stats.count("cpu", "drops", len(evicted))
        evicted.extend(gone)
        self.admission.forget(victims)  # a victim held in CPU was admitted nowhere: dropped
        return spills, evicted

    def prepare_store(
        self,
        block_hashes: Iterable[BlockHash],
        *,
        session: Hashable | None = None,
        request: Hashable | None = None,
        cpu_only: bool = False,
    ) -> PrepareStoreOutput | None:
        """``cpu_only``: the blocks stored go into CPU alone, never into a lower tier
        (``WriteAdmission.hold_in_cpu``)."""
        offered = list(dict.fromkeys(block_hashes))
        self._note_uses(offered, session, request)  # every use of a block offers it again
        to_store = missing = self.cpu.missing_among(offered)
        for tier in self.lower:
            if not to_store:
                break
            to_store = tier.absent_among(to_store)
        # Offered blocks were computed: missing from CPU they enter it, as in a CPU tier
        # alone, though a lower tier holds them (that tier is not written again).
        held_below: set[BlockHash] = set()
        if len(to_store) < len(missing):
            absent = set(to_store)
            held_below = {h for h in missing if h not in absent}
            to_store = missing
            if self._write_back_only:
                self._from_lower.update(held_below)  # in CPU and below, as a promoted block
        if not to_store:
            self.cpu.rank_request(offered)
            return PrepareStoreOutput([], TieredStoreSpec([]), [])
        protected = set(offered)
        self.cpu.note_store_misses(to_store)
        room = self._make_room(len(to_store), allow_spill=True, protected=protected)
        if room is None:
            return None
        spills, evicted = room
        slots = self.cpu.allocate(to_store, checked=False)  # distinct, and missing from CPU
        if slots is None:  # cannot happen after _make_room; keep the contract anyway
            raise RuntimeError("CPU tier refused an allocation it had room for")
        if len(to_store) < len(offered):
            self.cpu.rank_request(offered)
        if cpu_only and self.lower:
            self.admission.hold_in_cpu(to_store)
        write_through = [
            self._plan_write_through(i, to_store, slots, evicted, protected, held_below) for i in range(len(self.lower))
        ]
        self.stats.count("cpu", "stores", len(to_store))
        return PrepareStoreOutput(
            block_hashes_to_store=to_store,
            store_spec=TieredStoreSpec(slots, spills=spills, write_through=write_through),
            block_hashes_evicted=evicted,
        )

    def _plan_write_through(
        self,
        i: int,
        to_store: list[BlockHash],
        cpu_slots: list[int],
        evicted: list[BlockHash],
        protected: set[BlockHash],
        held_below: set[BlockHash],
    ) -> TierWrites:
        if self.write_policies[i] != "write_through":
            return TierWrites()
        tier = self.lower[i]
        new = to_store
        if held_below:  # the recomputed blocks this tier lacks are new to it too
            lacking = set(tier.absent_among(held_below))
            new = [h for h in to_store if h not in held_below or h in lacking]
        admitted = self.admission.admitted(i, new)
        candidates = admitted[: self._budget(tier, len(admitted))]
        skipped = len(admitted) - len(candidates)
        out = tier.prepare_store(candidates, fresh=True, protected=protected) if candidates else None
        if out is None:
            skipped = len(candidates) + skipped
            writes = TierWrites()
        else:
            cpu_slot = dict(zip(to_store, cpu_slots))
            writes = TierWrites(
                list(map(cpu_slot.__getitem__, out.block_hashes_to_store)),
                ids_spec(out.store_spec).id_list(),
                out.block_hashes_to_store,
            )
            # Evictions here only remove blocks no other tier holds.
            evicted.extend(self._left_hierarchy(i, out.block_hashes_evicted))
            self.stats.count(tier.name, "evictions", len(out.block_hashes_evicted))
        if skipped:
            self.stats.count(tier.name, "drops", skipped)
        self._write_through[i].update(writes.block_hashes)
        self.stats.count(tier.name, "stores", len(writes))
        return writes

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        block_hashes = list(block_hashes)
        self.cpu.complete_store(block_hashes, success)
        if not success:
            self.admission.forget(block_hashes)
        self.stats.count("cpu", "failed_stores", 0 if success else len(block_hashes))
        for tier, pending in zip(self.lower, self._write_through):
            abandoned = [h for h in block_hashes if h in pending] if pending else []
            pending.difference_update(abandoned)
            if success or not abandoned:
                continue
            if isinstance(tier, AbandonsStores):  # a rank may still write them: it waits for each
                tier.abandon_store(abandoned)
            else:
                tier.complete_store(abandoned, success=False)

    # ------------------------------------------------------------------ misc

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        block_hashes = list(block_hashes)
        self.cpu.touch(block_hashes)
        for tier in self.lower:
            tier.touch(block_hashes)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = list(self.cpu.take_events())
        for tier in self.lower:
            events.extend(tier.take_events())
        return events

    def pending_writes(self) -> int:
        """Blocks queued for a lower-tier write whose outcome the tier has not shown yet
        (after folding in those the workers committed)."""
        for tier in self.lower:
            if tier.num_pending():
                tier.refresh()
        return sum(tier.num_pending() for tier in self.lower)

    def queued_blocks(self) -> dict[str, int]:
        """Per lower tier, the blocks a new load waits for (``cost.Queues``): loads, writes unless ``reads_first``."""
        lower = zip(self.lower, self._lower_loads)
        return {t.name: sum(loads.values()) + (0 if t.reads_first else t.num_pending()) for t, loads in lower}

    def queued_loads(self) -> dict[str, int]:
        """Per lower tier, the blocks of its loads in flight."""
        return {t.name: sum(loads.values()) for t, loads in zip(self.lower, self._lower_loads)}

    def used_blocks(self) -> dict[str, int]:
        lower = {tier.name: tier.capacity - tier.num_free_slots() for tier in self.lower}
        return {"cpu": self.cpu.num_slots - self.cpu.num_free_slots(), **lower}

    def shutdown(self) -> None:
        for tier in self.lower:
            tier.shutdown()
        self.cpu.shutdown()
