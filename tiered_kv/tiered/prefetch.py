"""Prefetch: lower-tier blocks promoted into the CPU tier before a load asks for them.

Scheduler process; bookkeeping only, no I/O, one thread (the scheduler's). A prefetch
is ``promote_on_hit``'s promotion (``TieredOffloadingManager``) without a GPU side: the
block is pinned in the lower tier that serves it and counted among that tier's loads
(``_lower_loads``), a CPU slot is reserved for it the way a promotion reserves one
(free slots, or victims a lower tier holds: never a spill, never a pinned block), ranked
most recent even where ``cpu_admission`` ranks a block it does not admit yet first to
evict (the use the prefetch serves is not counted yet: first to evict, the block would
go before its request loads it, for the lower tier to serve again), and
the job a worker runs is a ``TieredLoadSpec`` whose chunks all come from lower tiers
with a promote slot each, read tier -> CPU and verified there (the GPU side has no
rows). ``complete`` ends it as a load ends: the composite's ``complete_load`` makes the
slot loadable once every load of the block has ended well, or frees it. Reusing the
composite's own load bookkeeping is what keeps a request that loads the same block
meanwhile, and the promotion, in agreement: the slot becomes loadable only after the
last read of the block ends (a slot is never served before its bytes land). It reads
and updates that bookkeeping (``_lower_loads``, ``_start_promotions``) as the composite's
own ``prepare_load`` does, from this module of the same package, so the two cannot drift.

Who asks: ``want(owner, blocks)`` queues an owner's blocks, a prefix in order; ``issue``
starts jobs from the queues, oldest owner first (``first=True`` jumps the queue, and is
not held: a hint's prefetch has no request that is sure to load it). A waiting owner's
blocks are **held** for it: those already in CPU as ``issue`` reaches them, and those
its prefetches bring, are pinned there until a load uses them or the owner is cancelled
(it started, ended or was aborted). A CPU tier much smaller than the queue otherwise
turns over while a request waits: what it had in CPU on arrival, or had prefetched, is
evicted by the stores and promotions of the requests ahead of it, and its load reads it
from below after all, holding its device memory meanwhile. Oldest first and bounded
(``max_held``), the holds stage the head of the queue. Reads are issued behind the
loads: a tier is given prefetch reads only while no load of a request reads from it and
its queue of writes is at most half its bound (``max_pending_writes``: past that the
tier is congested, and a read would only add to the wait of everything queued there),
and at most ``max_bytes_in_flight`` bytes are being read (so a load that comes later
waits behind at most that much on a tier that serves its jobs in order); and at most
``max_held`` blocks are held, being read, or prefetched and unused in CPU past the
tier's free slots (so holds never take more than that share of the tier, and
prefetches do not evict each other before anyone loads them, while a tier with room
goes on prefetching whatever an aborted request or a hint left unused). A block already in CPU is held where loadable and skipped
while on its way; a block no tier holds ends its owner's queue, since a prefix lookup
stops there and nothing past it is ever loaded. ``cancel(owner)`` drops what is still
queued and releases its holds (jobs already issued run to their end: a worker cannot be
asked to stop one; what they bring is no longer held).

Counted per source tier (``counters``): blocks prefetched (``prefetches``), loaded from
CPU afterwards (``prefetch_used``), gone from CPU before any load (``prefetch_wasted``),
queued (a lower tier held them, CPU did not) and dropped by ``cancel`` before a job took
them (``prefetch_cancelled``), and read in a job that failed (``prefetch_failed``).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from tiered_kv.abstract import BlockHash
from tiered_kv.mediums import ids_spec
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.transfer_specs import TieredLoadSpec

#: Owners with blocks queued at most (a queue per waiting request, and per hint).
MAX_OWNERS = 4096
#: The tier a queued block already in CPU is marked with (held, not read).
IN_CPU = -1
#: The events ``counters`` reports per source tier.
PREFETCH_EVENTS = ("prefetches", "prefetch_used", "prefetch_wasted", "prefetch_cancelled", "prefetch_failed")


@dataclass(frozen=True)
class PrefetchJob:
    """One job for the workers: ``spec``'s chunks read from lower tiers into their
    promote slots (``cpu_slots`` all -1), ``nbytes`` in all."""

    job_id: int
    spec: TieredLoadSpec
    nbytes: int


@dataclass
class _Flight:
    spec: TieredLoadSpec
    tiers: list[str]  # the source tier's name per chunk
    owner: str
    abandoned: bool = False


class Prefetcher:
    """Prefetches over ``composite`` (module docstring). ``bytes_per_block``: bytes of
    one block; ``max_bytes_in_flight``: the most bytes being read for prefetches at once
    (at least one block); ``max_held``: the most CPU blocks held for waiting owners,
    being read, or prefetched and not loaded since past the CPU tier's free slots
    (default: half the CPU tier's slots)."""

    def __init__(
        self,
        composite: TieredOffloadingManager,
        *,
        bytes_per_block: int,
        max_bytes_in_flight: int,
        max_held: int | None = None,
    ):
        if bytes_per_block < 1:
            raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
        if max_bytes_in_flight < bytes_per_block:
            raise ValueError(
                f"max_bytes_in_flight must hold at least one block ({bytes_per_block} B), got {max_bytes_in_flight}"
            )
        if max_held is not None and max_held < 1:
            raise ValueError(f"max_held must be >= 1 block, got {max_held}")
        self.composite = composite
        self.bytes_per_block = bytes_per_block
        self.max_blocks_in_flight = max_bytes_in_flight // bytes_per_block
        self.max_held = max_held if max_held is not None else max(1, composite.cpu.num_slots // 2)
        self._names = [t.name for t in composite.lower]
        self._wanted: OrderedDict[str, deque[tuple[BlockHash, int]]] = OrderedDict()  # owner -> (block, tier)
        self._flights: dict[int, _Flight] = {}
        self._blocks_in_flight = 0
        self._tier_in_flight = [0] * len(self._names)
        # Prefetched into CPU, not held, not loaded since: block -> the tier it came from.
        self._fresh: OrderedDict[BlockHash, str] = OrderedDict()
        # Pinned in CPU for a waiting owner: block -> (owner, the tier it was prefetched
        # from, or None where it was in CPU already); and each owner's blocks.
        self._holder: dict[BlockHash, tuple[str, str | None]] = {}
        self._held: dict[str, set[BlockHash]] = {}
        self._holding: set[str] = set()  # owners whose blocks are held
        self._ids = itertools.count(1)
        self._counts: Counter[tuple[str, str]] = Counter()

    # ------------------------------------------------------------------ queues

    def want(self, owner: str, block_hashes: Iterable[BlockHash], *, first: bool = False) -> None:
        """Queue ``owner``'s blocks of ``block_hashes`` (a prefix, in order) that a lower
        tier holds and CPU lacks, and unless ``first`` those CPU holds (to hold them), up
        to the first block no tier holds, replacing what it had queued (its holds stay);
        ``first``: ahead of every other owner, nothing held. The oldest owner's queue goes
        (counted cancelled, its holds released) past ``MAX_OWNERS`` owners."""
        cpu, hit_tier = self.composite.cpu, self.composite.hit_tier
        queue: deque[tuple[BlockHash, int]] = deque()
        for block_hash in block_hashes:
            if block_hash in cpu:
                if not first:
                    queue.append((block_hash, IN_CPU))
                continue
            tier = hit_tier(block_hash)
            if tier is None:
                break  # a prefix lookup stops here: nothing past it is ever loaded
            queue.append((block_hash, tier))
        self._drop_queue(owner)
        if not queue:
            return
        if not first:
            self._holding.add(owner)
        self._wanted[owner] = queue
        if first:
            self._wanted.move_to_end(owner, last=False)
        while len(self._wanted) > MAX_OWNERS:
            self.cancel(next(reversed(self._wanted)) if first else next(iter(self._wanted)))

    def cancel(self, owner: str) -> int:
        """Drop ``owner``'s queued blocks and release what is held for it (its prefetched
        blocks stay in CPU, unused until a load uses them); how many lower-tier blocks
        were queued."""
        self._holding.discard(owner)
        for block_hash in self._held.pop(owner, ()):
            _, came_from = self._holder.pop(block_hash)
            self.composite.cpu.unpin([block_hash])
            if came_from is not None:
                self._fresh[block_hash] = came_from
        return self._drop_queue(owner)

    def _drop_queue(self, owner: str) -> int:
        queue = self._wanted.pop(owner, None)
        if not queue:
            return 0
        below = [self._names[tier] for _, tier in queue if tier != IN_CPU]
        for name in below:
            self._counts[(name, "prefetch_cancelled")] += 1
        return len(below)

    def _hold(self, owner: str, block_hash: BlockHash, came_from: str | None) -> None:
        self.composite.cpu.pin([block_hash])
        self._holder[block_hash] = (owner, came_from)
        self._held.setdefault(owner, set()).add(block_hash)

    def queued(self, owner: str) -> bool:
        return owner in self._wanted

    @property
    def bytes_in_flight(self) -> int:
        return self._blocks_in_flight * self.bytes_per_block

    @property
    def queued_blocks(self) -> int:
        return sum(len(q) for q in self._wanted.values())

    @property
    def held_blocks(self) -> int:
        """CPU blocks pinned for waiting owners now."""
        return len(self._holder)

    # ------------------------------------------------------------------ jobs

    def issue(self) -> list[PrefetchJob]:
        """Hold and start what the bounds allow (module docstring), oldest owner first."""
        jobs: list[PrefetchJob] = []
        if not self._wanted:
            return jobs
        if self._budget() <= 0:
            self.sweep()
        budget = self._budget()  # blocks that may still be held or read
        room = min(budget, self.max_blocks_in_flight - self._blocks_in_flight)  # blocks that may be read
        cpu, hit_tier = self.composite.cpu, self.composite.hit_tier
        # Behind the loads: a tier serving a request's load, or past half its bound of
        # queued writes (``max_pending_writes``: congested), gets no prefetch read now.
        limit = self.composite.max_pending_writes // 2
        idle = [
            sum(loads.values()) <= mine and tier.num_pending() <= limit
            for tier, loads, mine in zip(self.composite.lower, self.composite._lower_loads, self._tier_in_flight)
        ]
        for owner in list(self._wanted):
            if budget <= 0:
                break
            queue = self._wanted[owner]
            held = owner in self._holding
            picked: list[BlockHash] = []
            tiers: list[int] = []
            while queue and budget > 0:
                block_hash, _ = queue[0]
                if block_hash in cpu:  # loadable there since, or on its way (a store, a promotion)
                    queue.popleft()
                    if held and block_hash not in self._holder and cpu.is_loadable(block_hash):
                        self._hold(owner, block_hash, self._fresh.pop(block_hash, None))
                        budget -= 1
                    continue
                if len(picked) >= room:
                    break
                tier = hit_tier(block_hash)
                if tier is None:
                    queue.clear()  # gone from every tier: the prefix ends here for every lookup
                    break
                if not idle[tier]:
                    break  # this owner waits until that tier has room
                queue.popleft()
                picked.append(block_hash)
                tiers.append(tier)
                budget -= 1
            if not queue:
                del self._wanted[owner]
            if not picked:
                continue
            job, dropped = self._start(picked, tiers, owner)
            if job is not None:
                jobs.append(job)
                room -= len(job.spec)
            if dropped:  # CPU has no more slots without a spill: the rest waits for the next step
                left = set(dropped)
                back = self._wanted.setdefault(owner, deque())
                back.extendleft(reversed([(h, t) for h, t in zip(picked, tiers) if h in left]))
                self._wanted.move_to_end(owner, last=False)
                break
        return jobs

    def _budget(self) -> int:
        """Blocks that may still be held or read: prefetched, unused ones count only past
        the CPU tier's free slots (while it has room, a prefetch evicts none of them)."""
        unused = max(0, len(self._fresh) - self.composite.cpu.num_free_slots())
        return self.max_held - len(self._holder) - unused - self._blocks_in_flight

    def _start(
        self, picked: list[BlockHash], tiers: list[int], owner: str
    ) -> tuple[PrefetchJob | None, list[BlockHash]]:
        """Pin ``picked`` where they are and reserve their CPU slots: the job of those
        that got one (None: not one did), and the others, left as they were."""
        composite = self.composite
        slot_of: dict[BlockHash, int] = {}
        for i in sorted(set(tiers)):
            hashes = [h for h, t in zip(picked, tiers) if t == i]
            slot_of.update(zip(hashes, ids_spec(composite.lower[i].prepare_load(hashes)).id_list()))
            composite._lower_loads[i].update(hashes)
        promote = composite._start_promotions(picked, prefetch=True)
        dropped = [h for h in picked if h not in promote]
        if dropped:
            composite.complete_load(dropped)  # unpin: no slot for them now
        if not promote:
            return None, dropped
        keep = [(h, t) for h, t in zip(picked, tiers) if h in promote]
        hashes = [h for h, _ in keep]
        spec = TieredLoadSpec(
            cpu_slots=[-1] * len(keep),
            tier_slots=[slot_of[h] for h in hashes],
            promote_slots=[promote[h] for h in hashes],
            block_hashes=hashes,
            lower_tiers=[t for _, t in keep],
        )
        job_id = next(self._ids)
        names = [self._names[t] for _, t in keep]
        self._flights[job_id] = _Flight(spec, names, owner)
        self._blocks_in_flight += len(keep)
        for _, t in keep:
            self._tier_in_flight[t] += 1
        for name in names:
            self._counts[(name, "prefetches")] += 1
        return PrefetchJob(job_id, spec, len(keep) * self.bytes_per_block), dropped

    def job_blocks(self, job_id: int) -> tuple[list[BlockHash], list[int]]:
        """Job ``job_id``'s blocks and the CPU slots it writes them to (empty when unknown)."""
        flight = self._flights.get(job_id)
        if flight is None:
            return [], []
        return list(flight.spec.block_hashes), flight.spec.promote_slots.tolist()

    def complete(self, job_id: int, failed: Collection[BlockHash] = ()) -> list[BlockHash]:
        """Job ``job_id`` ended; ``failed``: its blocks whose bytes did not all land.
        Returns the job's blocks when it was abandoned (``abandon``): they were read
        from before a reset and are the caller's to drop. An unknown job changes nothing."""
        flight = self._flights.pop(job_id, None)
        if flight is None:
            return []
        hashes = flight.spec.block_hashes
        self._blocks_in_flight -= len(hashes)
        for t in flight.spec.lower_tiers.tolist():
            self._tier_in_flight[t] -= 1
        if flight.abandoned:
            self.composite.complete_load(hashes, success=False)
            return list(hashes)
        failed = set(failed)
        bad = [h for h in hashes if h in failed]
        if bad:
            self.composite.complete_load(bad, success=False)
        good = [(h, name) for h, name in zip(hashes, flight.tiers) if h not in failed]
        if good:
            self.composite.complete_load([h for h, _ in good])
        for h, name in zip(hashes, flight.tiers):
            if h in failed:
                self._counts[(name, "prefetch_failed")] += 1
        held = flight.owner in self._holding
        for h, name in good:
            if held and h not in self._holder and self.composite.cpu.is_loadable(h):
                self._hold(flight.owner, h, name)
            else:
                self._fresh[h] = name
        return []

    def loaded(self, block_hashes: Sequence[BlockHash]) -> None:
        """A request loads ``block_hashes`` (before its ``prepare_load``): holds on them
        end (the load pins what it reads), the prefetched ones among them still in CPU
        were used, the others wasted."""
        if self._holder:
            for block_hash in block_hashes:
                entry = self._holder.pop(block_hash, None)
                if entry is not None:
                    owner, came_from = entry
                    self._held[owner].discard(block_hash)
                    self.composite.cpu.unpin([block_hash])
                    if came_from is not None:
                        self._counts[(came_from, "prefetch_used")] += 1
        if self._fresh:
            loadable = self.composite.cpu.is_loadable
            for block_hash in block_hashes:
                name = self._fresh.pop(block_hash, None)
                if name is not None:
                    self._counts[(name, "prefetch_used" if loadable(block_hash) else "prefetch_wasted")] += 1

    def sweep(self) -> None:
        """Count the prefetched blocks that left CPU unused as wasted."""
        if self._fresh:
            for block_hash in self.composite.cpu.missing_among(list(self._fresh)):
                self._counts[(self._fresh.pop(block_hash), "prefetch_wasted")] += 1

    def abandon(self) -> None:
        """A cache reset: release every hold, forget every queue and unused block (counted
        wasted); the jobs in flight end as failed, their blocks handed back by ``complete``."""
        for owner in list(self._held):
            self.cancel(owner)
        self._holding.clear()
        self._wanted.clear()
        for name in self._fresh.values():
            self._counts[(name, "prefetch_wasted")] += 1
        self._fresh.clear()
        for flight in self._flights.values():
            flight.abandoned = True

    def counters(self) -> list[tuple[str, str, int]]:
        """``(source tier, event, total)`` for every tier and ``PREFETCH_EVENTS`` event."""
        self.sweep()
        return [(name, event, self._counts[(name, event)]) for name in self._names for event in PREFETCH_EVENTS]
