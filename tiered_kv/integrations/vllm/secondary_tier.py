"""Our disk tier as a secondary tier under vLLM's own ``TieringOffloadingSpec``.

For users who already run vLLM 0.33's native CPU offloading: one more entry in
``kv_connector_extra_config`` puts a persistent, checksummed, capacity-bounded disk tier
below vLLM's CPU tier::

    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 68719476736,
    "secondary_tiers": [{"type": "TieredDiskTier",
                         "module_path": "tiered_kv.integrations.vllm.secondary_tier",
                         "disk_path": "/mnt/nvme/tiered-kv", "disk_bytes": "1TiB"}]

Process and I/O: everything here runs in vLLM's **scheduler process**. vLLM calls the
tier under its manager lock and expects every call to return at once, so the calls
only do bookkeeping in memory (``DiskOffloadingManager``: slots, LRU, pins) and queue
jobs; the block I/O (``DiskStore``: O_DIRECT writes, ``fdatasync``, the synced LMDB
commit, verified reads) runs on this tier's job threads and the store's I/O threads,
straight from and into vLLM's CPU tier through ``primary_kv_view`` (chunk ``c`` is row
``c``, bytes ``[c * stride, (c + 1) * stride)``). Store jobs that queue up while the
store threads are busy are written as one group: one ``fdatasync`` and one index commit
for all of them (vLLM submits one small cascade per request per step). Finished jobs
are handed back by ``get_finished_jobs``. Opening the tier (namespace, writer lock, slab
preallocation, one read pass over the index) happens once, at start-up.

What a chunk is on disk: one whole primary row, every TP rank's shard and the row's
padding included, stored as one disk block of ``stride`` bytes (``stride`` is a
multiple of 4 KiB, so a row goes to and from the slab with no copy). The disk tier's
``KVCacheLayout`` is therefore one pseudo-layer ``vllm_cpu_chunk`` of ``stride`` bytes,
dtype uint8, one offloaded block per chunk, and the namespace is written as TP size 1
(one writer). Because those bytes mean nothing without the engine geometry that
produced them, the ``Fingerprint`` is built here from vLLM's ``OffloadingConfig``: the
model name (or ``model_id``), vLLM's KV dtype, tokens per chunk and per GPU block, the
row stride, per-worker block bytes and chunk factor plus each KV group's geometry
(``layer_geometry``), vLLM's row format - TP/PP/PCP/DCP sizes, world size, replicated or
canonical layout, KV-cache layout - in ``kv_layout``, and the attention backend whose
kernels write the pages a row holds (``attention_backend``: two backends may order the
same page differently). ``secondary_config.tier_fingerprint`` computes it, here and in
the tools that compute it offline (``tiered-kv warmup``, ``inspect``). Any change to
these opens another namespace; a cache is never served to an engine that would read it
differently. The disk key of a chunk is vLLM's whole ``OffloadKey`` (block hash +
KV-group index).

Faults never reach vLLM: a chunk that fails its checksum or cannot be read fails its
promotion (vLLM frees the CPU slot and the request recomputes it) and is dropped from
the disk tier, so the next lookup is a miss; a write that fails (a full disk, EIO)
fails its store job and the chunk is not kept; a store that finds no free slot (all
pinned) or more than ``max_pending_disk_writes`` chunks already waiting is refused.
Each case is logged and counted (``stats``, and the ``tiered_kv_disk_tier_*`` metrics).

The entry's keys and the namespace are checked and built in ``secondary_config.py``;
the counters and config-info facts are ``secondary_stats.py``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiered_kv.abstract import Closing
from tiered_kv.config import format_size
from tiered_kv.disk.tier import DiskTier
from tiered_kv.tiers import TierContext, build_tiers
from tiered_kv.mediums import ids_spec
from tiered_kv.integrations.vllm.secondary_config import (
    check_tier_hash_algorithm,
    chunk_layout,
    parse_locality,
    tier_fingerprint,
)
from tiered_kv.vllm_extra import parse_tier_config
from tiered_kv.integrations.vllm.secondary_stats import DiskTierInfo, DiskTierStats, metric_definitions, stats_since
from tiered_kv.integrations.vllm.common import refuse_lora

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

__all__ = ["TieredDiskTier"]

#: Store threads: two, so one group's fdatasync and index commit overlap the next
#: group's writes. Load threads: their own (a promotion never queues behind stores), and
#: more of them, since a promotion job is often a single chunk and has no sync to wait on.
_STORE_THREADS = 2
_LOAD_THREADS = 4
#: Store jobs that queued up while the store threads were busy are written as one group,
#: up to this many bytes: one fdatasync and one index commit for all of them.
_GROUP_BYTES = 64 << 20


def _primary_rows(flat_view: memoryview, stride: int) -> torch.Tensor:
    """A flat byte view as a uint8 tensor of rows ``(num_chunks, stride)`` sharing its
    memory."""
    flat = np.frombuffer(flat_view, dtype=np.uint8)
    return torch.from_numpy(flat[: len(flat) // stride * stride].reshape(-1, stride))


def _row_runs(chunk_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(index in the job, first chunk id, count)`` for each run of consecutive ids."""
    if len(chunk_ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(chunk_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(chunk_ids)]))
    return [(int(s), int(chunk_ids[s]), int(e - s)) for s, e in zip(starts, ends)]


@dataclass
class _Job:
    """One store or promotion job. ``keys``/``slots``/``chunk_ids`` are the chunks that
    go to disk I/O; ``ok`` is filled by the job thread (one flag per key)."""

    job_id: int
    is_load: bool
    keys: list[bytes]
    slots: list[int] = field(default_factory=list)
    chunk_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    refused: list[bytes] = field(default_factory=list)  # never went to I/O: counted as failed
    ok: list[bool] = field(default_factory=list)
    seconds: float = 0.0


class TieredDiskTier(SecondaryTierManager, Closing):
    """A ``SecondaryTierManager`` backed by the tiered-kv disk tier (module docstring).

    Constructed by vLLM's ``SecondaryTierFactory`` from one ``secondary_tiers`` entry;
    ``tier_config`` holds the entry's remaining keys (see ``parse_tier_config``). Every
    method is non-blocking except ``drain_jobs`` and ``shutdown``, which wait for the
    jobs in flight as vLLM requires. ``disk_manager``, ``store`` and ``stats`` are
    public for tools and tests.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: "BackpressureDetector | None" = None,
        **tier_config: Any,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        refuse_lora("TieredDiskTier", "use TieredOffloadingSpec with kv_connector TieredOffloadingConnector")
        self.config = cfg = parse_tier_config(tier_config)
        check_tier_hash_algorithm(cfg)
        self.locality = parse_locality(tier_config.get("locality"))
        vconf = offloading_spec.config
        stride = self.block_size_bytes
        # The function the warm-up and inspect compute this namespace with, offline.
        self.fingerprint = tier_fingerprint(
            vconf,
            stride,
            cfg,
            tier_config,
            replicated_layout=getattr(offloading_spec, "replicated_layout", False),
        )
        layout = chunk_layout(self.fingerprint.block_size, stride)
        # The primary rows are host memory: GPUDirect Storage has nothing to offer here.
        (entry,) = cfg.tiers
        if entry.settings.io_backend == "auto":
            posix = dataclasses.replace(entry.settings, io_backend="posix")
            cfg = dataclasses.replace(cfg, tiers=(dataclasses.replace(entry, settings=posix),))
        # Built by type like every lower tier (tiered_kv.tiers): the disk tier of this
        # entry, keyed by vLLM's fingerprint, one writer (the scheduler) for all ranks.
        ctx = TierContext(
            config=cfg,
            fingerprint=self.fingerprint,
            layout=layout,
            engine_id=vconf.engine_id,
            enable_events=False,
        )
        (tier,) = build_tiers(cfg.tier_entries(), ctx)
        assert isinstance(tier, DiskTier)  # the one tier of a disk_path config
        self.tier = tier
        self.disk_manager = self.tier.get_manager()
        try:
            self.store = self.tier.open_store(in_process=True)
        except BaseException:
            self.disk_manager.shutdown()
            raise
        # Views of vLLM's region only once nothing can fail: a failed start-up must not
        # leave an export behind (vLLM could not unmap the region).
        self._primary_bytes = primary_kv_view.cast("B")
        self._primary: torch.Tensor | None = _primary_rows(self._primary_bytes, stride)
        self.stats = DiskTierStats()
        self._reported = DiskTierStats()
        self._store_pool = ThreadPoolExecutor(_STORE_THREADS, thread_name_prefix="tkv-vllm-disk-store")
        self._load_pool = ThreadPoolExecutor(_LOAD_THREADS, thread_name_prefix="tkv-vllm-disk-load")
        # Job threads append, the scheduler thread pops: deque ends are thread-safe.
        self._finished: deque[_Job] = deque()
        self._store_queue: deque[_Job] = deque()  # guarded by _idle
        self._idle = threading.Condition()
        self._in_flight = 0
        self._writes_waiting = 0  # chunks in store jobs not yet collected (scheduler thread)
        self._closed = False
        self._info = DiskTierInfo(
            disk_path=tier.settings.path,
            disk_namespace=self.fingerprint.namespace_id,
            disk_capacity_chunks=self.disk_manager.capacity,
            disk_chunk_bytes=stride,
            disk_io_backend=self.store.backend.describe(),
            disk_checksum=self.store.checksum_name,
        )
        logger.info(
            "vLLM secondary tier %s: %s, namespace %s (attention backend %s), %d of %d chunks of %s loadable, I/O %s",
            tier_type,
            tier.settings.path,
            self.fingerprint.namespace_id,
            self.fingerprint.attention_backend,
            len(self.disk_manager),
            self.disk_manager.capacity,
            format_size(stride),
            self.store.backend.describe(),
        )

    # ------------------------------------------------------------ lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the chunk is durable and indexed, else MISS (a chunk still being
        written is still pinned in vLLM's CPU tier, which answers first)."""
        return LookupResult.HIT if self.disk_manager.is_loadable(bytes(key)) else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # ------------------------------------------------------------ stores (cascades)

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a write of the job's primary rows. Chunks already on disk are skipped
        (and marked recently used); the rest get slots (evicting LRU chunks, never one of
        this job's) unless the tier is full of pinned chunks or too many writes already
        wait."""
        keys = [bytes(k) for k in job_metadata.keys]
        chunk_of = dict(zip(keys, np.asarray(job_metadata.chunk_ids, dtype=np.int64).tolist()))
        dm = self.disk_manager
        present = {k for k in keys if dm.is_loadable(k)}
        if present:
            dm.touch([k for k in keys if k in present])  # in request order: the head ends most recent
        new = [k for k in keys if k not in present and not dm.is_pending(k)]
        job = _Job(job_metadata.job_id, is_load=False, keys=[])
        if not new:
            self._finished.append(job)
            return
        if self._writes_waiting + len(new) > self.config.max_pending_disk_writes:
            logger.warning(
                "disk tier: %d chunks already wait for disk writes (max_pending_disk_writes=%d); not storing %d more",
                self._writes_waiting,
                self.config.max_pending_disk_writes,
                len(new),
            )
            job.refused = new
            self._finished.append(job)
            return
        out = dm.prepare_store(new, protected=present)  # never evict this job's own chunks
        if out is None:
            logger.warning(
                "disk tier: no free slot for %d chunks (every chunk is pinned by a promotion); not storing them",
                len(new),
            )
            job.refused = new
            self._finished.append(job)
            return
        self.stats.evicted += len(out.block_hashes_evicted)
        job.keys = list(out.block_hashes_to_store)
        job.slots = ids_spec(out.store_spec).id_list()
        job.chunk_ids = np.array([chunk_of[k] for k in job.keys], dtype=np.int64)
        self._writes_waiting += len(job.keys)
        with self._idle:
            self._in_flight += 1
            self._store_queue.append(job)
        self._store_pool.submit(self._write_queued)

    def _write_queued(self) -> None:
        """Store-thread task: write the queued store jobs as one group (none left: a
        task before this one took them)."""
        group: list[_Job] = []
        limit = max(1, _GROUP_BYTES // self.block_size_bytes)  # chunks
        with self._idle:
            while self._store_queue and (
                not group or sum(len(j.keys) for j in group) + len(self._store_queue[0].keys) <= limit
            ):
                group.append(self._store_queue.popleft())
        if not group:
            return
        t0 = time.perf_counter()
        try:
            ok = self._write(group)
        except Exception:  # a lost job would pin vLLM's CPU rows forever: fail it instead
            logger.exception("disk tier store of jobs %s failed", [j.job_id for j in group])
            ok = [False] * sum(len(j.keys) for j in group)
        seconds = time.perf_counter() - t0
        i = 0
        for job in group:
            job.ok, job.seconds = ok[i : i + len(job.keys)], seconds
            i += len(job.keys)
        self._done(group)

    def _write(self, group: list[_Job]) -> list[bool]:
        primary = self._live_primary()
        batch = self.store.begin_write(0, [k for j in group for k in j.keys], [s for j in group for s in j.slots])
        offset = 0
        for job in group:
            for start, first, n in _row_runs(job.chunk_ids):
                batch.submit(offset + start, primary[first : first + n])
            offset += len(job.keys)
        return batch.finish()

    # ------------------------------------------------------------ loads (promotions)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a verified read of the job's chunks into its primary rows. A chunk no
        longer on disk fails at once."""
        keys = [bytes(k) for k in job_metadata.keys]
        chunk_ids = np.asarray(job_metadata.chunk_ids, dtype=np.int64)
        dm = self.disk_manager
        found = np.array([dm.is_loadable(k) for k in keys], dtype=bool)
        job = _Job(
            job_metadata.job_id,
            is_load=True,
            keys=[k for k, f in zip(keys, found) if f],
            chunk_ids=chunk_ids[found],
            refused=[k for k, f in zip(keys, found) if not f],
        )
        if not job.keys:
            self._finished.append(job)
            return
        dm.touch(job.keys)
        job.slots = ids_spec(dm.prepare_load(job.keys)).id_list()  # pins them
        with self._idle:
            self._in_flight += 1
        self._load_pool.submit(self._read_job, job)

    def _read_job(self, job: _Job) -> None:
        """Load-thread task: read and verify one promotion's chunks into its rows."""
        t0 = time.perf_counter()
        try:
            primary = self._live_primary()
            batch = self.store.begin_read(0, job.keys, job.slots)
            for start, first, n in _row_runs(job.chunk_ids):
                batch.submit(start, primary[first : first + n])
            job.ok = batch.finish()
        except Exception:  # a lost job would leave vLLM's CPU slots reserved forever
            logger.exception("disk tier promotion job %d failed", job.job_id)
            job.ok = [False] * len(job.keys)
        job.seconds = time.perf_counter() - t0
        self._done([job])

    # ------------------------------------------------------------ results

    def _done(self, jobs: list[_Job]) -> None:
        self._finished.extend(jobs)
        with self._idle:
            self._in_flight -= len(jobs)
            self._idle.notify_all()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Results of the jobs finished since the last call; applies them to the disk
        manager first (stored chunks become loadable, failed ones are dropped)."""
        results = []
        while self._finished:
            job = self._finished.popleft()
            results.append(self._finish_load(job) if job.is_load else self._finish_store(job))
        if results:
            # Consume the index log the jobs appended to (it is trimmed behind us).
            self.disk_manager.refresh()
            self.stats.corrupt = self.store.stats.checksum_failures
        return results

    def _finish_store(self, job: _Job) -> JobResult:
        dm = self.disk_manager
        done = [k for k, ok in zip(job.keys, job.ok) if ok]
        failed = [k for k, ok in zip(job.keys, job.ok) if not ok]
        if done:
            dm.complete_store(done, success=True)
        if failed:
            dm.complete_store(failed, success=False)
        self._writes_waiting -= len(job.keys)
        s = self.stats
        s.stored += len(done)
        s.store_failed += len(failed)
        s.store_skipped += len(job.refused)
        success = not failed and not job.refused
        s.failed_store_jobs += not success
        return JobResult(
            job.job_id, success, transfer_time=job.seconds, transfer_bytes=len(done) * self.block_size_bytes
        )

    def _finish_load(self, job: _Job) -> JobResult:
        dm = self.disk_manager
        done = [k for k, ok in zip(job.keys, job.ok) if ok]
        failed = [k for k, ok in zip(job.keys, job.ok) if not ok]
        if done:
            dm.complete_load(done)
        if failed:
            dm.complete_load(failed, success=False)
        # A chunk that cannot be promoted (corrupt or unreadable) must turn into a miss,
        # or vLLM would retry its promotion forever.
        for k in failed:
            dm.remove(k)
        s = self.stats
        s.promoted += len(done)
        s.promotion_failed += len(failed) + len(job.refused)
        success = not failed and not job.refused
        s.failed_promotion_jobs += not success
        return JobResult(
            job.job_id,
            success,
            successful_keys=[OffloadKey(k) for k in done] if done and not success else None,
            transfer_time=job.seconds,
            transfer_bytes=len(done) * self.block_size_bytes,
        )

    def has_pending_work(self) -> bool:
        with self._idle:
            return self._in_flight > 0 or bool(self._finished)

    def drain_jobs(self) -> None:
        """Wait until no job touches the primary rows (results stay queued)."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)

    def _live_primary(self) -> torch.Tensor:
        """vLLM's CPU tier as rows (a ``RuntimeError`` once the tier is shut down)."""
        if self._primary is None:
            raise RuntimeError("the disk tier is shut down")
        return self._primary

    def shutdown(self) -> None:
        """Finish the jobs in flight, then close the store and the disk manager (index
        flushed, writer lock released). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.drain_jobs()
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        # Drop our exports of vLLM's shared region, or vLLM could not unmap it.
        self._primary = None
        try:
            self._primary_bytes.release()
        except BufferError:
            logger.warning("disk tier: a view of vLLM's CPU tier is still referenced")
        try:
            self.store.close()
        finally:
            self.disk_manager.shutdown()

    # ------------------------------------------------------------ metrics

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counter increments since the last call (the disk manager's index errors among
        them), the chunks held and the slots held back now."""
        errors = self.disk_manager.stats.index_errors()
        self.stats.index_read_errors, self.stats.index_flush_errors = errors["read"], errors["flush"]
        out = stats_since(self.stats, self._reported, len(self.disk_manager), self.disk_manager.held_back_slots())
        self._reported = DiskTierStats(**self.stats.as_dict())
        return out

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return DiskTierInfo.config_info_keys()

    def config_info(self) -> ConfigInfoMapping:
        return self._info.as_config_info()
