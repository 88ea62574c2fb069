"""vLLM 0.33's ``OffloadingManager`` over our composite manager. Scheduler process.

vLLM asks per key (``lookup(key, req_context) -> LookupResult``) and passes
``OffloadKey``s everywhere; we use the key bytes as our ``BlockHash`` and delegate the
bookkeeping to ``TieredOffloadingManager`` (CPU tier over the disk tier). What this
adapter adds is what vLLM's contract demands and ours did not:

- **A HIT must not fail.** vLLM's worker connector asserts that every load succeeded,
  so a chunk is a HIT only when every byte of it is known good: a chunk loadable in the
  CPU tier, or a disk chunk whose bytes on every rank were just read back and checked
  against their recorded checksums (``DiskVerifier``, on its own threads). Until then
  ``lookup`` answers HIT_PENDING (the request waits a step; ``has_pending_work`` keeps
  an idle engine stepping). A chunk that fails verification is dropped from the disk
  tier and is a MISS: vLLM recomputes it. A verification counts for one load
  (``prepare_load`` consumes it), and only for the slot it read.
- **A failed worker job must not make garbage loadable.** vLLM always calls
  ``complete_store``/``complete_load`` with success. Our worker reports every job done
  and marks the CPU slots of a job that failed in the shared ``SlotHealth`` map before
  reporting; here the marks of the slots a job wrote are read, and those chunks are
  completed as failed (freed, their disk writes abandoned, a promotion not kept).
- **The shared tier** (``remote``, below the disk tier or directly below CPU) follows
  the same rule (``remote.RemoteVerifier``): a chunk only the bucket holds is a HIT
  once every rank's object of it was downloaded and verified here; until then
  HIT_PENDING. A chunk this node knows nothing of is probed (HEAD requests, on the
  store's threads): while that probe is in flight ``lookup`` answers RETRY (vLLM asks
  again next step; its contract's answer for "location not known yet", which unlike
  HIT_PENDING never counts as a hit), never waiting and never a premature MISS. A
  probe the server does not answer counts as absent: a server that is down costs
  misses. ``on_schedule_end`` folds in probe answers and sends the probes that confirm
  this node's own uploads.
- ``touch`` is never called by vLLM 0.33, so a use is recorded in ``prepare_load``;
  ``prepare_store`` leaves recency to the composite, which never evicts the chunks a
  call offers and ranks the request most recent, head first (a store is not a reuse:
  under ARC it keeps a chunk in T1).
- ``reset_cache`` empties every tier, the disk included (a reset may mean new weights);
  the shared tier is the fleet's and is not emptied: its chunks of this namespace stay
  loadable (only its verifications are forgotten).
  vLLM then discards the jobs in flight (no ``complete_*`` follows): their chunks are
  released in ``on_reset_flushed``, once workers no longer write them; disk writes
  queued before the reset are dropped as they land and never served.
- Stats: ``get_stats`` turns our ``TieredStats`` counters (deltas since the last call)
  and tier occupancy into vLLM's ``OffloadingConnectorStats``; the metric names are
  declared by the spec's ``build_metric_definitions``. Neither it nor
  ``on_schedule_end`` reads the disk index: the disk manager's flusher thread folds in
  the writes workers committed, within a poll (2 ms) while some are pending.

``lock`` stays vLLM's no-op default: every call runs on the caller's thread; the
verifier threads only read the disk and hand results over through a queue, and the
disk manager's index flusher has its own internal lock.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Sequence
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

from tiered_kv.abstract import Closing
from tiered_kv.config import TieredConfig
from tiered_kv.cpu import cpu_tier_manager
from tiered_kv.disk.worker.io_backends import PosixBackend
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.worker.store import DiskStore
from tiered_kv.integrations.vllm.common import (
    DISK_VERIFICATIONS,
    PENDING_DISK_WRITES,
    REMOTE_VERIFICATIONS,
    TIER_BLOCKS,
    TIER_CAPACITY_BLOCKS,
    TIER_USED_BLOCKS,
    WORKER_JOB_FAILURES,
    TieredJobSpec,
    TieredOffloadingInfo,
)
from tiered_kv.integrations.vllm.geometry import VllmGeometry
from tiered_kv.integrations.vllm.health import SlotHealth
from tiered_kv.integrations.vllm.remote import RemoteVerifier, build_remote, remote_write_policy
from tiered_kv.integrations.vllm.verify import DiskVerifier
from tiered_kv.metrics import TieredStats
from tiered_kv.mediums import CPU, DISK
from tiered_kv.remote.tier import REMOTE, RemoteOffloadingManager
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.transfer_specs import TieredLoadSpec

logger = logging.getLogger(__name__)

#: Verified-but-not-yet-loaded chunks remembered at most (oldest forgotten first).
MAX_VERIFIED = 65536

_MEDIUMS = {CPU: Medium.CPU, DISK: Medium.STORAGE, REMOTE: Medium.STORAGE}
#: Keyed by ``hit_medium``'s answer (None: not offloaded, served as a disk hit would be).
_SOURCES: dict[str | None, CacheHitSource] = {
    CPU: CacheHitSource.HOST,
    DISK: CacheHitSource.DISK,
    REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,
}


def _offload_keys(block_hashes: list[bytes]) -> list[OffloadKey]:
    """Our block hashes as vLLM's keys (the same bytes), in a new list."""
    return cast("list[OffloadKey]", list(block_hashes))


def build_manager(
    cfg: TieredConfig,
    geometry: VllmGeometry,
    *,
    engine_id: str,
    enable_events: bool,
    info: TieredOffloadingInfo | None = None,
) -> "TieredVllmManager":
    """The scheduler side of ``TieredOffloadingSpec``: CPU tier, disk tier (namespace
    opened, writer lock taken, index loaded), shared tier (store opened and checked),
    verifiers and slot-health map. ``info``: the spec's config-info facts."""
    events = enable_events
    stats = TieredStats()
    cpu = cpu_tier_manager(cfg.eviction_policy, geometry.num_cpu_slots, geometry.tokens_per_chunk, enable_events=events)
    disk = verifier = None
    if cfg.disk_path:
        disk = DiskOffloadingManager(
            cfg.disk_path,
            geometry.fingerprint,
            geometry.scheduler_layout(),
            disk_bytes=cfg.disk_bytes,
            checksum=cfg.checksum,
            engine_id=engine_id,
            enable_events=events,
        )
        try:
            store = DiskStore(disk.namespace, PosixBackend(cfg.io_threads), engine_id=engine_id)
        except BaseException:
            disk.shutdown()
            raise
        verifier = DiskVerifier(store, geometry.world_size, threads=cfg.io_threads)
    remote = remote_verifier = None
    policies = [cfg.write_policy] if disk is not None else []
    if cfg.remote is not None:
        try:
            remote, remote_verifier = build_remote(cfg.remote, geometry, events)
        except BaseException:
            if verifier is not None:
                verifier.shutdown()
            if disk is not None:
                disk.shutdown()
            raise
        policies.append(remote_write_policy(cfg.remote))
    composite = TieredOffloadingManager(
        cpu,
        [t for t in (disk, remote) if t is not None],
        write_policy=policies,
        promote_on_hit=cfg.promote_on_hit,
        max_pending_disk_writes=cfg.max_pending_disk_writes,
        stats=stats,
    )
    health = SlotHealth.for_engine(engine_id, geometry.num_cpu_slots)
    health.clear()  # no job can be in flight before the scheduler exists (a reused engine id)
    return TieredVllmManager(composite, health=health, verifier=verifier, remote_verifier=remote_verifier, info=info)


class TieredVllmManager(OffloadingManager, Closing):
    """vLLM's manager interface over ``TieredOffloadingManager`` (module docstring)."""

    def __init__(
        self,
        composite: TieredOffloadingManager,
        *,
        health: SlotHealth,
        verifier: DiskVerifier | None = None,
        remote_verifier: RemoteVerifier | None = None,
        info: TieredOffloadingInfo | None = None,
    ):
        self.composite = composite
        self.health = health
        self.verifier = verifier
        self.remote_verifier = remote_verifier
        by_medium = {t.medium: t for t in composite.lower}
        #: The disk tier and the shared tier, where configured.
        disk, remote = by_medium.get(DISK), by_medium.get(REMOTE)
        self.disk = disk if isinstance(disk, DiskOffloadingManager) else None
        self.remote = remote if isinstance(remote, RemoteOffloadingManager) else None
        # Shared-tier chunks verified on every rank, not yet loaded.
        self._remote_verified: OrderedDict[bytes, None] = OrderedDict()
        self._remote_verifications: Counter[str] = Counter()
        self.stats = composite.stats
        self._info = info
        # Disk chunks: being verified, and verified (key -> the slot that was read).
        self._verifying: dict[bytes, int] = {}
        self._verified: OrderedDict[bytes, int] = OrderedDict()
        # Disk chunks that failed verification but could not be dropped yet (pinned).
        self._unservable: dict[bytes, int] = {}
        self._verification_counts: Counter[str] = Counter()
        # Per (request, key) of a load in flight: where it comes from, and the CPU slot a
        # promotion writes.
        self._sources: dict[tuple[str, bytes], CacheHitSource] = {}
        self._promote_slots: dict[tuple[str, bytes], int] = {}
        # Jobs in flight, so a cache reset can release them (vLLM drops their completions).
        self._open_loads: Counter[bytes] = Counter()
        self._open_stores: Counter[bytes] = Counter()
        self._abandoned_loads: Counter[bytes] = Counter()
        self._abandoned_stores: Counter[bytes] = Counter()
        self._failure_counts: Counter[str] = Counter()
        self._reported: dict[tuple[str, str], int] = {}
        # Disk writes queued before a cache reset: dropped when they land, never served.
        self._stale_writes: set[bytes] = set()

    # ------------------------------------------------------------------ lookups

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._collect_verifications()
        self.stats.count("cpu", "lookups")
        medium = self.composite.hit_medium(key)
        if medium == CPU:
            return LookupResult.HIT
        if medium == DISK:
            self.stats.count("disk", "lookups")
            return self._disk_lookup(key)
        if medium == REMOTE:
            self.stats.count("remote", "lookups")
            return self._remote_lookup(key)
        if key in self.composite.cpu:  # being stored or promoted: loadable once that job ends
            return LookupResult.HIT_PENDING
        if self.disk is not None:
            self.stats.count("disk", "lookups")  # asked, and it does not have it either
        if self.remote is not None:
            self.stats.count("remote", "lookups")
            if self.remote.is_probing(key):
                return LookupResult.RETRY  # hit_medium sent (or found) a probe of the bucket
        return LookupResult.MISS

    def _remote_lookup(self, key: bytes) -> LookupResult:
        if key in self._remote_verified:
            return LookupResult.HIT
        assert self.remote_verifier is not None  # built with the shared tier
        self.remote_verifier.submit(key)
        return LookupResult.HIT_PENDING

    def _collect_remote_verifications(self) -> None:
        if self.remote_verifier is None:
            return
        for key, ok in self.remote_verifier.results():
            self._remote_verifications["ok" if ok else "failed"] += 1
            if ok:
                self._remote_verified[key] = None
                self._remote_verified.move_to_end(key)
                while len(self._remote_verified) > MAX_VERIFIED:
                    self._remote_verified.popitem(last=False)
            else:
                # Missing, foreign, damaged or unreachable on some rank: a miss until the
                # bucket is asked again (absent_ttl), never a load that could fail.
                self._remote_verified.pop(key, None)
                if self.remote is not None:
                    self.remote.remove(key)
                    self.remote.cache.mark_absent([key])

    def _disk_lookup(self, key: bytes) -> LookupResult:
        disk = self.disk
        assert disk is not None and self.verifier is not None  # hit_medium named the disk tier
        slot = disk.slot_of(key)
        if slot is None or key in self._stale_writes:
            return LookupResult.MISS
        if key in self._unservable:
            if self._unservable[key] == slot and not disk.remove(key):
                return LookupResult.MISS  # still pinned by the load that was in flight
            del self._unservable[key]
            if disk.slot_of(key) is None:
                return LookupResult.MISS
        if self._verified.get(key) == slot:
            return LookupResult.HIT
        if self._verifying.get(key) != slot:
            self._verifying[key] = slot
            self.verifier.submit(key, slot)
        return LookupResult.HIT_PENDING

    def _collect_verifications(self) -> None:
        self._collect_remote_verifications()
        if self.verifier is None:
            return
        for key, slot, ok in self.verifier.results():
            if self._verifying.get(key) == slot:
                del self._verifying[key]
            self._verification_counts["ok" if ok else "failed"] += 1
            if ok:
                self._verified[key] = slot
                self._verified.move_to_end(key)
                while len(self._verified) > MAX_VERIFIED:
                    self._verified.popitem(last=False)
            else:
                # A checksum failure is counted by the composite when the refresh in
                # _drop_from_disk applies the verifier's "corrupt" log record.
                self._verified.pop(key, None)
                self._drop_from_disk(key, slot)

    def _drop_from_disk(self, key: bytes, slot: int) -> None:
        """Make a chunk that failed verification a miss: the read path already dropped a
        corrupt one from the index (``refresh`` applies that); anything else (an I/O
        error) is removed here. A chunk pinned by a load in flight stays unservable."""
        disk = self.disk
        assert disk is not None  # it verified the chunk
        disk.refresh()
        if disk.slot_of(key) == slot and not disk.remove(key):
            self._unservable[key] = slot

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.composite.touch(list(keys))

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        source = self._sources.get((req_context.req_id, key))
        if source is not None:
            return source
        return _SOURCES.get(self.composite.hit_medium(key), CacheHitSource.DISK)

    # ------------------------------------------------------------------ loads

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TieredJobSpec:
        keys = list(keys)
        req_id = req_context.req_id
        for key in keys:
            medium = self.composite.hit_medium(key)
            self._sources[(req_id, key)] = _SOURCES.get(medium, CacheHitSource.DISK)
            if medium != CPU:
                self._verified.pop(key, None)  # one verification, one load
                self._remote_verified.pop(key, None)
        self.composite.touch(keys)
        spec = self.composite.prepare_load(keys)
        if isinstance(spec, TieredLoadSpec):
            for block_hash, slot in zip(spec.block_hashes, spec.promote_slots.tolist()):
                if slot >= 0:
                    self._promote_slots[(req_id, block_hash)] = slot
        self._open_loads.update(keys)
        return TieredJobSpec(spec)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        req_id = req_context.req_id
        promoted = {key: self._promote_slots.pop((req_id, key)) for key in keys if (req_id, key) in self._promote_slots}
        bad_slots = self.health.take_bad(promoted.values())
        failed = {key for key, slot in promoted.items() if slot in bad_slots}
        if failed:
            logger.error(
                "request %s: the promotion of %d disk chunks into the CPU tier failed in a "
                "worker; the chunks are not kept in CPU",
                req_id,
                len(failed),
            )
            self._failure_counts["promotion"] += 1
            self.composite.complete_load(list(failed), success=False)
        self.composite.complete_load([key for key in keys if key not in failed])
        for key in keys:
            self._sources.pop((req_id, key), None)
        self._open_loads.subtract(keys)
        self._open_loads += Counter()  # drop zero counts

    # ------------------------------------------------------------------ stores

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        out = self.composite.prepare_store(keys)
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
        self.composite.complete_store([key for key in keys if key not in failed], success)
        self._open_stores.subtract(keys)
        self._open_stores += Counter()

    # ------------------------------------------------------------------ steps, events, stats

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # Disk writes the workers committed are folded in by the disk manager's flusher
        # thread (it polls the index log while writes are pending), not here: reading
        # the log on the scheduler thread would lengthen every step that has some.
        self._collect_verifications()
        if self.remote is not None:
            self.remote.refresh()  # never waits: folds answers in, sends the probes due
        if self._stale_writes:
            self._drop_stale_writes()

    def _drop_stale_writes(self) -> None:
        """Drop the disk writes of before a reset as they land (removing one pinned by a
        load is retried next step)."""
        disk = self.disk
        if disk is None:
            return
        if disk.num_pending():
            disk.refresh()
        pending = disk.pending_blocks()
        for key in list(self._stale_writes):
            if key in pending:
                continue
            if disk.slot_of(key) is None or disk.remove(key):
                self._stale_writes.discard(key)

    def has_pending_work(self) -> bool:
        # Requests deferred on a verification or a membership probe are asked again
        # only while the engine steps.
        return (
            (self.verifier is not None and self.verifier.busy())
            or (self.remote_verifier is not None and self.remote_verifier.busy())
            or (self.remote is not None and self.remote.num_probing() > 0)
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        out = []
        for event in self.composite.take_events():
            on_disk = event.medium == DISK
            remote = event.medium == REMOTE
            out.append(
                OffloadingEvent(
                    keys=_offload_keys(event.block_hashes),
                    medium=_MEDIUMS[event.medium],
                    removed=event.removed,
                    # The bucket's lifecycle rule removes objects unannounced.
                    locality=Locality.REMOTE if remote else None,
                    ownership="tiered_kv.disk" if on_disk else "tiered_kv.remote" if remote else None,
                    removal_expected=on_disk and not event.removed,
                )
            )
        return out

    def get_stats(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        for tier, counters in self.stats.as_dict()["tiers"].items():
            for event, value in counters.items():
                self._increase(stats, TIER_BLOCKS, (tier, event), value)
        for outcome, value in self._verification_counts.items():
            self._increase(stats, DISK_VERIFICATIONS, (outcome,), value)
        for outcome, value in self._remote_verifications.items():
            self._increase(stats, REMOTE_VERIFICATIONS, (outcome,), value)
        for kind, value in self._failure_counts.items():
            self._increase(stats, WORKER_JOB_FAILURES, (kind,), value)
        for tier, used in self.composite.used_blocks().items():
            stats.set_gauge(TIER_USED_BLOCKS, used, (tier,))
        stats.set_gauge(TIER_CAPACITY_BLOCKS, self.composite.cpu.num_slots, ("cpu",))
        disk = self.disk
        if disk is not None:
            stats.set_gauge(TIER_CAPACITY_BLOCKS, disk.capacity, ("disk",))
        # Read, not refreshed: at most a flusher poll old.
        stats.set_gauge(PENDING_DISK_WRITES, disk.num_pending() if disk is not None else 0)
        return stats

    def _increase(self, stats: OffloadingConnectorStats, name: str, labels: tuple[str, ...], total: int) -> None:
        """Report the increase of a monotonic ``total`` since the last report."""
        key = (name, ",".join(labels))
        delta = total - self._reported.get(key, 0)
        if delta > 0:
            stats.increase_counter(name, delta, labels)
            self._reported[key] = total

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._info.as_config_info() if self._info is not None else {}]

    # ------------------------------------------------------------------ reset, shutdown

    def reset_cache(self) -> None:
        """Drop every chunk of every tier (the disk tier too: a reset means the cached KV
        may no longer be valid, e.g. new weights). Chunks of jobs in flight are released
        in ``on_reset_flushed``."""
        self._abandoned_loads += self._open_loads
        self._abandoned_stores += self._open_stores
        self._open_loads.clear()
        self._open_stores.clear()
        self._promote_slots.clear()
        self._sources.clear()
        self._verified.clear()
        self._remote_verified.clear()
        if self.disk is not None:
            if self.disk.num_pending():
                self.disk.refresh()
            self._stale_writes |= self.disk.pending_blocks()
        self._evict_all()

    def on_reset_flushed(self) -> None:
        loads, self._abandoned_loads = self._abandoned_loads, Counter()
        stores, self._abandoned_stores = self._abandoned_stores, Counter()
        if loads:
            self.composite.complete_load(list(loads.elements()), success=False)
        if stores:
            self.composite.complete_store(list(stores), success=False)
        self.health.clear()
        self._evict_all()

    def _evict_all(self) -> None:
        cpu, disk = self.composite.cpu, self.disk
        for key in list(cpu.iter_evictable()):
            cpu.remove(key)
        if disk is not None:
            for key in list(disk.iter_evictable()):
                disk.remove(key)

    def shutdown(self) -> None:
        if self.verifier is not None:
            self.verifier.shutdown()
        if self.remote_verifier is not None:
            self.remote_verifier.shutdown()
        self.composite.shutdown()
        self.health.close(unlink=True)
