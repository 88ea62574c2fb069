"""vLLM 0.33's ``OffloadingManager`` over our composite manager. Scheduler process.

vLLM asks per key (``lookup(key, req_context) -> LookupResult``) and passes
``OffloadKey``s everywhere; we use the key bytes as our ``BlockHash`` and delegate the
bookkeeping to ``TieredOffloadingManager`` (the CPU tier over the lower tiers), built
by ``HierarchySpec``, the same builder every other deployment and the tests use. What
this adapter adds is what vLLM's contract demands and ours did not:

- **A HIT must not fail.** vLLM's worker connector asserts that every load succeeded,
  so a chunk is a HIT only when every byte of it is known good: a chunk loadable in the
  CPU tier, or a lower tier's chunk whose tier's ``HitCheck`` (``tiered_kv.tiers``)
  says so. ``lookup`` has one branch for every lower tier: the tier that would serve the
  chunk answers HIT, HIT_PENDING (a check in flight: the disk tier reads the chunk back
  on every rank and checks its checksums; the shared tier downloads and verifies every
  rank's object; the request waits a step, ``has_pending_work`` keeps an idle engine
  stepping), MISS (the check failed: the chunk is dropped there and recomputed) or
  RETRY (the tier is still finding out whether it holds the chunk, e.g. the shared
  tier's HEAD probes: vLLM asks again next step, and unlike HIT_PENDING it never counts
  as a hit). A check passed counts for one load (``prepare_load`` consumes it); a
  chunk another request's load is reading from a lower tier is HIT_PENDING until that
  load ends, so requests sharing a prefix wait for its one load (no convoy, no reread).
- **A failed worker job must not make garbage loadable.** vLLM always calls
  ``complete_store``/``complete_load`` with success. Our worker reports every job done
  and marks the CPU slots of a job that failed in the shared ``SlotHealth`` map before
  reporting; here the marks of the slots a job wrote or read are taken, and those chunks
  completed as failed (freed, lower-tier writes abandoned, a promotion not kept, a chunk
  whose copy to the GPU failed never served again: ``health.LoadSlots``).
- **Loads chosen by cost, asked per key.** The composite decides per request how many
  leading chunks to load (``tiered_kv.cost``), weighing the queues this scheduler sees
  (``Queues``: requests arrived and not yet scheduled, less those a tier holds; each
  lower tier's loads and writes in flight), refreshed every step. vLLM asks chunk by
  chunk, in order, having placed every full chunk of the request first: at the first
  chunk past the leading CPU ones (which are only counted, ``CostScan``: a CPU hit costs
  about what it costs vLLM's own manager) the whole run is read ahead (``_ahead``) and
  decided at once; the scan then answers from the plan, MISS past it. Where the order is
  not at hand (a sliding-window group, asked last chunk first), a chunk is answered as
  found while loading every chunk so far beats every shorter prefix (``PrefixScan``),
  RETRY past that, and the run is decided at the step's end (``on_schedule_end``): the
  request waits one step; that plan stands until the request is preempted. Each
  tier's estimate is fed with the workers' transfer times (``health.LoadTimings``).
- ``touch`` is never called by vLLM 0.33, so a use is recorded in ``prepare_load``;
  ``prepare_store`` leaves recency to the composite, which never evicts the chunks a
  call offers and ranks the request most recent, head first (a store is not a reuse:
  under ARC it keeps a chunk in T1).
- ``reset_cache`` empties every tier this node owns, the disk included (a reset may
  mean new weights); a shared tier is the fleet's and is not emptied (only its checks
  are forgotten). vLLM then discards the jobs in flight (no ``complete_*`` follows):
  their chunks are released in ``on_reset_flushed``, once workers no longer write
  them; lower-tier writes queued before the reset are dropped as they land and never
  served.
- **Sessions**: a request's loads and stores name its session where the client sent one
  (``common.RequestSession``, which the connector keeps in its ``ReqContext``), for
  ``cpu_retention`` and a disk tier's ``retention``; otherwise the prefix chain names it.
- **Hints and prefetch** (``hints.KvHints``): each request's ``kv_hints`` (a lease on
  its prefix, a prefetch, a release), and its lower-tier chunks read into CPU while it
  waits; the jobs reach the workers through ``prefetch_jobs``'s connector.
- Stats: ``get_stats`` turns our ``TieredStats`` counters (deltas since the last call),
  each check's outcomes and tier occupancy into vLLM's ``OffloadingConnectorStats``;
  the metric names are declared by the spec's ``build_metric_definitions``. Neither it
  nor ``on_schedule_end`` reads the disk index: the disk manager's flusher thread folds
  in the writes workers committed, within a poll (2 ms) while some are pending.

``lock`` stays vLLM's no-op default: every call runs on the caller's thread; the checks'
threads only read and hand results over through queues, and the disk manager's index
flusher has its own internal lock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import islice
from typing import cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiered_kv.abstract import Closing, LowerTier
from tiered_kv.cost import Queues
from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.integrations.vllm.common import (
    CounterIncreases,
    CpuOnly,
    WORKER_JOB_FAILURES,
    RequestSession,
    TieredJobSpec,
)
from tiered_kv.integrations.vllm.cost_scan import CostScan, positions_of
from tiered_kv.integrations.vllm.health import LoadSlots, LoadTimings, SlotHealth
from tiered_kv.integrations.vllm.hints import HintSettings, KvHints
from tiered_kv.mediums import CPU
from tiered_kv.metrics import (
    cost_gauges,
    hierarchy_occupancy,
    index_error_values,
    occupancy_gauges,
    tier_counter_values,
    written_per_read_gauges,
)
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.retention import retention_metric_values
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.tiers import HitCheck, HitState

logger = logging.getLogger(__name__)

# The answers, read once: reading an Enum member from its class costs a descriptor call
# (about 150 ns on Python 3.11), and hashing one a Python-level call; vLLM asks per key.
_HIT, _HIT_PENDING, _MISS, _RETRY = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS, LookupResult.RETRY
_CHECK_HIT = HitState.HIT
_RESULTS = {HitState.HIT: _HIT, HitState.PENDING: _HIT_PENDING, HitState.MISS: _MISS, HitState.RETRY: _RETRY}


def build_manager(spec: HierarchySpec, *, info: Sequence[ConfigInfoMapping] = ()) -> "TieredVllmManager":
    """The scheduler side of ``TieredOffloadingSpec`` from the hierarchy's one builder:
    the composite (CPU tier and every lower tier's manager: the disk namespace opened,
    its writer lock taken, its index loaded; the shared tier's bucket opened and
    checked), each tier's hit check, and the slot-health map. ``info``: the spec's
    config-info facts."""
    composite = spec.get_manager()
    try:
        checks = spec.get_hit_checks(composite)
    except BaseException:
        composite.shutdown()
        raise
    health = SlotHealth.for_engine(spec.engine_id, spec.num_cpu_slots)
    health.clear()  # no job can be in flight before the scheduler exists (a reused engine id)
    timings = LoadTimings.for_engine(spec.engine_id, [t.name for t in spec.lower_tiers], spec.tp_size)
    timings.clear()
    shared = [t.shared for t in spec.lower_tiers]
    hints = HintSettings.from_config(spec.config)
    return TieredVllmManager(composite, checks, shared=shared, health=health, timings=timings, info=info, hints=hints)


def _offload_keys(block_hashes: list[bytes]) -> list[OffloadKey]:
    """Our block hashes as vLLM's keys (the same bytes), in a new list."""
    return cast("list[OffloadKey]", list(block_hashes))


class TieredVllmManager(OffloadingManager, Closing):
    """vLLM's manager interface over ``TieredOffloadingManager`` (module docstring).
    ``checks``: each lower tier's ``HitCheck``, in tier order; ``shared``: which lower
    tiers hold a fleet's blocks rather than this node's."""

    def __init__(
        self,
        composite: TieredOffloadingManager,
        checks: Sequence[HitCheck],
        *,
        shared: Sequence[bool] | None = None,
        health: SlotHealth,
        timings: LoadTimings | None = None,
        info: Sequence[ConfigInfoMapping] = (),
        hints: HintSettings | None = None,
    ):
        if len(checks) != len(composite.lower):
            raise ValueError(f"{len(checks)} hit checks for {len(composite.lower)} lower tiers: expected one per tier")
        self.composite = composite
        self.checks = list(checks)
        self.shared = list(shared) if shared is not None else [False] * len(checks)
        self.health = health
        self.timings = timings
        self.stats = composite.stats
        self.costs = composite.costs
        # Requests whose load is being decided: every lookup of theirs this step recorded
        # in their ``CostScan``; decided at the end of the step (``on_schedule_end``).
        self._undecided: dict[str, CostScan] = {}
        self._late: dict[str, CostScan] = {}  # plans made at a step's end, until preempted or finished
        self._deferred = [False, False]  # a lookup deferred for a decision: this step, the last
        # The last request asked this step, its scan and its key -> position lookup.
        self._scan_of: tuple[ReqContext, CostScan, Callable[[OffloadKey], int | None]] | None = None
        self._names = ["cpu", *(t.name for t in composite.lower)]  # by tier index + 1
        self._cpu_loadable = composite.cpu.is_loadable  # bound once: asked per key
        self._lookups = [0] * len(self._names)
        self._info = info
        self._shared_media = {t.medium for t, s in zip(composite.lower, self.shared) if s}
        # Per (request, key) of a load in flight: where it comes from (its CPU slot: ``loads``).
        self._sources: dict[tuple[str, bytes], CacheHitSource] = {}
        # Jobs in flight, so a cache reset can release them (vLLM drops their completions).
        self._open_loads: Counter[bytes] = Counter()
        self._open_stores: Counter[bytes] = Counter()
        self._abandoned_loads: Counter[bytes] = Counter()
        self._abandoned_stores: Counter[bytes] = Counter()
        self._abandoned_slots: set[int] = set()  # CPU slots those jobs write: their failure marks
        self._failure_counts: Counter[str] = Counter()
        self.loads = LoadSlots(health, composite.cpu, self._failure_counts)
        self._suspect = self.loads.suspect  # bound once: asked per key
        self._increases = CounterIncreases()
        self._waiting: set[str] = set()  # requests neither scheduled nor loading yet
        self._held: set[str] = set()  # those a tier held this step (a check, another's load)
        #: KV hints and prefetch while waiting (``hints``); ``prefetch_jobs`` carries its jobs.
        self.hints = KvHints.for_manager(self, hints)

    def tier(self, name: str) -> LowerTier | None:
        """The lower tier named ``name`` (``disk``, ``remote``), where configured."""
        return next((t for t in self.composite.lower if t.name == name), None)

    def check(self, name: str) -> HitCheck | None:
        """The hit check of the lower tier named ``name``, where configured."""
        return next((c for t, c in zip(self.composite.lower, self.checks) if t.name == name), None)

    def _source(self, tier: int | None) -> CacheHitSource:
        if tier is not None and tier < 0:
            return CacheHitSource.HOST
        if tier is not None and self.shared[tier]:
            return CacheHitSource.EXTERNAL_UNSPECIFIED
        return CacheHitSource.DISK

    # ------------------------------------------------------------------ lookups

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._waiting.add(req_context.req_id)
        self.hints.on_new_request(req_context)
        if self.costs is not None:
            self.costs.note_arrival()
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._waiting.discard(req_context.req_id)
        self._late.pop(req_context.req_id, None)
        self.hints.on_request_finished(req_context)

    def _queues(self) -> Queues:
        """This step's ``Queues``: requests held by a tier wait for it, not for the GPU."""
        held = len(self._held.intersection(self._waiting)) if self._held else 0
        self._held.clear()
        return Queues(len(self._waiting) - held, self.composite.queued_blocks(), self.composite.queued_loads())

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        last = self._scan_of
        if last is not None and last[0] is req_context:
            scan = last[1]
            # The next CPU chunk of a request whose chunks so far all are (the usual case):
            # counted, and answered as found (``CostScan``). With no load of the chunk in
            # flight no lower tier has to serve it (``hit_tier``), so CPU does.
            if scan.leading and self._cpu_loadable(key) and key not in self._open_loads and not self._abandoned_loads:
                position = last[2](key)
                if position is not None and position > scan.last and key not in self._suspect:
                    self._lookups[0] += 1
                    scan.last = scan.lead_end = position  # ``lead_with``, inlined: per key
                    scan.lead += 1
                    return _HIT
        # A request served by CPU alone (``CpuOnly``) asks no lower tier, not even whether
        # it holds the chunk (a shared tier would probe its bucket).
        cpu_only = req_context.get_state(CpuOnly) is not None
        tier = (-1 if self._cpu_loadable(key) else None) if cpu_only else self.composite.hit_tier(key)
        # A CPU chunk's answer asks no check; any other folds in the checks that
        # finished first, and looks again where one dropped blocks.
        if tier != -1 and not cpu_only:
            folded = False
            for check in self.checks:
                folded |= check.collect()
            if folded:
                tier = self.composite.hit_tier(key)
        asked = self._lookups  # per tier, CPU first: counted into stats each step
        asked[0] += 1
        if tier == -1 and key in self._suspect:  # a load of it failed: recomputed, stored afresh
            return _MISS
        if tier is not None and self.costs is not None and self.costs.enabled:
            decided = self._cost_answer(key, tier, req_context)
            if decided is not None:
                return decided
        if tier is not None and tier < 0:
            return _HIT
        for i in range(len(self.checks) if tier is None else tier + 1):
            asked[i + 1] += 1
        if tier is not None:
            if tier >= 0 and key in self._open_loads:
                # Being loaded from this tier for another request, and that load consumed
                # the check: asking it again would start a second verifying read of a
                # chunk on its way. vLLM 0.33 defers a request whose chunks are being
                # loaded anyway and then serves it from its GPU prefix cache (without
                # prefix caching, from the CPU copy the load promotes): it waits for the
                # one load, never reads the chunk again.
                self._held.add(req_context.req_id)
                return _HIT_PENDING
            state = self.checks[tier].lookup(key)
            if state is _CHECK_HIT:
                return _HIT
            self._held.add(req_context.req_id)  # waits for a tier, not for the GPU
            return _RESULTS[state]
        if key in self.composite.cpu:  # being stored or promoted: loadable once that job ends
            return _HIT_PENDING
        if not cpu_only and any(check.locating(key) for check in self.checks):
            return _RETRY  # a tier is finding out whether it holds the chunk
        return _MISS

    def _count_lookups(self) -> None:
        for i, n in enumerate(self._lookups):
            self.stats.count(self._names[i], "lookups", n)
            self._lookups[i] = 0

    def _cost_answer(self, key: OffloadKey, tier: int, req_context: ReqContext) -> LookupResult | None:
        """The load-versus-recompute decision, per key (module docstring): MISS for a
        chunk past the request's decided prefix, RETRY while its prefix is undecided,
        None where the chunk is answered as found."""
        position = req_context.get_offload_key_position(key)
        if position is None:  # a key vLLM did not place in the request: as found
            return None
        costs = self.costs
        assert costs is not None
        last = self._scan_of
        if last is not None and last[0] is req_context:  # vLLM asks a request's chunks in a row
            scan = last[1]
        else:
            found = req_context.get_state(CostScan)
            if found is None:
                found = CostScan.start(costs)
                req_context.set_state(found)
            scan = found
            self._scan_of = (req_context, scan, positions_of(req_context))
        if position <= scan.last:  # vLLM scans again from the start: decided anew (a load failed, ...)
            scan.restart(costs)
        if scan.boundary is not None:
            scan.last = position
            return _MISS if position > scan.boundary else None
        if scan.leading and tier == -1:
            scan.lead_with(position)
            return None
        scan.last = position
        tpb = costs.tokens_per_block
        unplannable = scan.keys or scan.lead_end not in (-1, position - tpb)  # scanning, or a gap
        if not unplannable and (ahead := self._ahead(key, position, req_context)) is not None:  # decided now
            keys, runs = ahead
            if scan.lead:
                runs.insert(0, ["cpu", scan.lead])
            start = position - (scan.lead + 1) * tpb
            k = self.composite.decide([b""] * scan.lead + keys, runs, start)
            scan.boundary, scan.leading = start + k * tpb if k else -1, False
            return _MISS if position > scan.boundary else None
        if scan.leading:
            scan.leading = False
            for i in range(scan.lead, 0, -1):
                scan.prefix.add("cpu", scan.lead_end - (i - 1) * tpb)  # each pays: checked when the lead began
        scan.keys.append(key)
        scan.positions.append(position)
        if scan.prefix.add(self._names[tier + 1], position):
            return None
        self._undecided[req_context.req_id] = scan
        self._deferred[0] = True
        return _RETRY

    def _ahead(self, key: OffloadKey, position: int, req_context: ReqContext) -> tuple[list, list[list]] | None:
        """The request's chunks of ``key``'s KV-cache group from ``key`` (ending at
        ``position``) on while a tier holds each, without a gap: keys and ``[tier name,
        chunks]`` runs; None where vLLM's order of the request's chunks is not at hand
        (another vLLM, a group placed before the first). vLLM places a request's chunks
        group by group, again as it grows: other groups' keys lie between a group's."""
        positions = getattr(req_context, "_offload_key_positions", None)
        tpb = self.costs.tokens_per_block if self.costs is not None else 0
        if not isinstance(positions, dict) or not tpb or position % tpb:
            return None
        order = list(positions)
        i = position // tpb - 1
        if not 0 <= i < len(order) or order[i] != key:
            return None
        keys: list = []
        runs: list[list] = []
        expected, hit_tier, names = position, self.composite.hit_tier, self._names
        group = key[-4:]  # ``get_offload_group_idx``'s bytes
        for later in islice(order, i, None):
            if later[-4:] != group:
                continue
            tier = hit_tier(later) if positions[later] == expected else None
            if tier is None:
                break
            if runs and runs[-1][0] == names[tier + 1]:
                runs[-1][1] += 1
            else:
                runs.append([names[tier + 1], 1])
            keys.append(later)
            expected += tpb
        return keys, runs

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.composite.touch(list(keys))

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        source = self._sources.get((req_context.req_id, key))
        if source is not None:
            return source
        return self._source(self.composite.hit_tier(key))

    # ------------------------------------------------------------------ loads

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TieredJobSpec:
        keys = list(keys)
        req_id = req_context.req_id
        self._waiting.discard(req_id)
        for key in keys:
            tier = self.composite.hit_tier(key)
            self._sources[(req_id, key)] = self._source(tier)
            if tier is not None and tier >= 0:
                self.checks[tier].loading(key)  # one check passed, one load
        self.composite.touch(keys)
        self.hints.on_load(req_id, keys)
        spec = self.composite.prepare_load(
            keys, session=req_context.get_state(RequestSession), request=req_context.req_id
        )
        self.loads.started(req_id, keys, spec)
        self._open_loads.update(keys)
        return TieredJobSpec(spec)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        req_id = req_context.req_id
        failed = self.loads.ended(req_id, keys)  # logged and counted there
        if failed:
            self.composite.complete_load(list(failed), success=False)
        self.composite.complete_load([key for key in keys if key not in failed])
        if self._suspect:
            self.loads.drop()  # those no other load pins
        for key in keys:
            self._sources.pop((req_id, key), None)
        self._open_loads.subtract(keys)
        self._open_loads += Counter()  # drop zero counts

    # ------------------------------------------------------------------ stores

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        out = self.composite.prepare_store(
            keys,
            session=req_context.get_state(RequestSession),
            request=req_context.req_id,
            cpu_only=req_context.get_state(CpuOnly) is not None,
        )
        if out is None:
            return None
        self._open_stores.update(out.block_hashes_to_store)
        return PrepareStoreOutput(
            keys_to_store=_offload_keys(out.block_hashes_to_store),
            store_spec=TieredJobSpec(out.store_spec),
            evicted_keys=_offload_keys(out.block_hashes_evicted),
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        keys = list(keys)
        slots = {key: self.composite.cpu.slot_of(key) for key in keys}
        bad_slots = self.health.take_bad(s for s in slots.values() if s is not None)
        failed = {key for key in keys if slots[key] in bad_slots}
        if failed:
            logger.error(
                "request %s: a worker failed to store %d chunks; they are dropped", req_context.req_id, len(failed)
            )
            self._failure_counts["store"] += 1
            self.composite.complete_store(list(failed), success=False)
        self.composite.complete_store(stored := [key for key in keys if key not in failed], success)
        if success:
            self.hints.on_stored(stored)
        self._open_stores.subtract(keys)
        self._open_stores += Counter()

    # ------------------------------------------------------------------ steps, events, stats

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # Never waits: each check folds in what finished and does its housekeeping (the
        # disk's drops of stale writes, the shared tier's probes due).
        for check in self.checks:
            check.step()
        self._count_lookups()
        if self.costs is not None and self.timings is not None:
            for transfer_type, nbytes, seconds, success in self.timings.take():
                self.costs.observe(transfer_type, round(nbytes), seconds, success)
        self._waiting.difference_update(context.new_req_ids)
        self._waiting.update(context.preempted_req_ids)
        for req_id in context.preempted_req_ids:  # its KV freed, its chunks stored since: decided anew
            if (preempted := self._late.pop(req_id, None)) is not None:
                preempted.late = False
        if self.costs is not None:
            self.costs.queues = self._queues()  # the decisions below and next step's scans
        for req_id, scan in self._undecided.items():
            # The lead's keys are never read: every plan loads the whole lead.
            k = self.composite.decide([b""] * scan.lead + scan.keys, scan.prefix.runs, scan.prefix.start or 0)
            scan.boundary, scan.late = scan.boundary_for(k), True  # the next scans answer from it
            self._late[req_id] = scan
        self._undecided.clear()
        self._scan_of = None
        if self._suspect:  # a lease that pinned one may have ended
            self.loads.drop()
        self.hints.step(context.new_req_ids)
        self._deferred = [False, self._deferred[0]]

    def has_pending_work(self) -> bool:
        # Requests deferred on a check, a probe or a decision are asked again only while
        # the engine steps.
        return any(self._deferred) or any(check.busy() for check in self.checks) or self.hints.busy()

    def take_events(self) -> Iterable[OffloadingEvent]:
        out = []
        for event in self.composite.take_events():
            shared = event.medium in self._shared_media
            local = event.medium != CPU and not shared
            out.append(
                OffloadingEvent(
                    keys=_offload_keys(event.block_hashes),
                    medium=Medium.CPU if event.medium == CPU else Medium.STORAGE,
                    removed=event.removed,
                    # A fleet's tier removes blocks unannounced (the bucket's lifecycle rule).
                    locality=Locality.REMOTE if shared else None,
                    ownership=None if event.medium == CPU else f"tiered_kv.{event.medium.lower()}",
                    removal_expected=local and not event.removed,
                )
            )
        return out

    def get_stats(self) -> OffloadingConnectorStats:
        """This scheduler's metrics (``common.metric_definitions`` says which): tier
        counters in chunks and tokens, what each lower tier's check exports (its
        verifications, a shared tier's scheduler-side store), failures, occupancy, the
        load estimates, chunks written per chunk read per tier, session retention's
        counts and holds, and the timings drained since the last call."""
        stats = OffloadingConnectorStats()
        self._count_lookups()
        counters = tier_counter_values(self.stats.as_dict()["tiers"], self.composite.cpu.block_size)
        timings = self.stats.latencies.drain()
        for check in self.checks:
            counters += check.counters()
            timings += check.timings()
        counters += [(WORKER_JOB_FAILURES, (kind,), n) for kind, n in self._failure_counts.items()]
        counters += self.hints.counters()
        kept_counters, kept_gauges = retention_metric_values(
            zip(self._names, [self.composite.cpu, *self.composite.lower])
        )
        counters += kept_counters + index_error_values(self.composite.lower)
        self._increases.report(stats, counters)
        for name, labels, seconds in timings:
            stats.observe_histogram(name, seconds, labels)
        gauges = cost_gauges(self.costs.snapshot() if self.costs is not None else None)
        gauges += written_per_read_gauges(self.stats) + occupancy_gauges(hierarchy_occupancy(self.composite))
        gauges += self.hints.gauges() + kept_gauges
        for name, labels, value in gauges:
            stats.set_gauge(name, value, labels)
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return list(self._info) or [{}]

    # ------------------------------------------------------------------ reset, shutdown

    def reset_cache(self) -> None:
        """Drop every chunk of every tier of this node (the disk tier too: a reset means
        the cached KV may no longer be valid, e.g. new weights); a shared tier's chunks
        are the fleet's and stay (only its checks are forgotten). Chunks of jobs in
        flight are released in ``on_reset_flushed``."""
        self._abandoned_loads += self._open_loads
        self._abandoned_stores += self._open_stores
        # Only these slots' marks are forgotten once the jobs end: a job submitted after the
        # reset may fail meanwhile, and its mark must keep its chunks from being served.
        cpu = self.composite.cpu
        self._abandoned_slots.update(s for key in self._open_stores if (s := cpu.slot_of(key)) is not None)
        self._abandoned_slots.update(self.loads.abandon())
        self._open_loads.clear()
        self._open_stores.clear()
        self._sources.clear()
        for check in self.checks:
            check.reset()
        self.hints.reset()  # leases unpinned first, so the eviction below reaches their chunks
        self._evict_all()

    def on_reset_flushed(self) -> None:
        loads, self._abandoned_loads = self._abandoned_loads, Counter()
        stores, self._abandoned_stores = self._abandoned_stores, Counter()
        if loads:
            self.composite.complete_load(list(loads.elements()), success=False)
        if stores:
            self.composite.complete_store(list(stores), success=False)
        slots, self._abandoned_slots = self._abandoned_slots, set()
        self.health.take_bad(slots)
        self.loads.flushed()
        self._evict_all()

    def _evict_all(self) -> None:
        """Every unpinned chunk of every tier this node owns (a shared tier evicts none)."""
        tiers: list[CPUOffloadingManager | LowerTier] = [self.composite.cpu, *self.composite.lower]
        self.composite.admission.forget(list(self.composite.cpu.iter_evictable()))  # ``CpuOnly``'s
        for tier in tiers:
            for key in list(tier.iter_evictable()):
                tier.remove(key)

    def shutdown(self) -> None:
        for check in self.checks:
            check.shutdown()
        self.composite.shutdown()
        self.health.close(unlink=True)
        if self.timings is not None:
            self.timings.close(unlink=True)
