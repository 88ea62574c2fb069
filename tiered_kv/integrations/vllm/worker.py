"""vLLM 0.33's ``OffloadingWorker`` over our tiered handlers. Worker process, one per rank.

What vLLM hands over: ``CanonicalKVCaches``, a list of int8 tensors of shape
``(num_gpu_blocks, page_size_bytes)`` (layers that alias the same memory share one).
Each becomes one "layer" of our ``KVCacheLayout`` (block shape ``(page_size_bytes,)``,
KV not before num_blocks), so the block codec, the host tier and the disk slots work
unchanged; a chunk holds every tensor's pages of its ``blocks_per_chunk`` GPU blocks
(with several KV groups, the pages of tensors a group does not use travel too: wasted
bytes, never wrong ones). The layout's bytes per chunk must equal what vLLM told the
scheduler (``worker_kv_bytes_per_block * blocks_per_chunk``), or the tiers would be
sized for another chunk: checked here, before anything is allocated.

Jobs: ``submit_store(job, GPU spec, TieredJobSpec(TieredStoreSpec))`` and
``submit_load(job, TieredJobSpec(CPU or TieredLoadSpec), GPU spec)``. vLLM's GPU spec
lists GPU block ids group by group; within a group the ids fill the chunks' GPU-block
positions in order, starting ``block_indices[g] % blocks_per_chunk`` positions into the
first chunk, and may stop short of the end of the last one. We turn that into one row
of ``blocks_per_chunk`` GPU block ids per chunk (-1 = position not transferred, a
``GPURowsSpec``) and run the composite's handlers, which ``HierarchySpec`` (the
hierarchy's one builder) composes over GPU <-> CPU copies at GPU-block granularity
(CPU position ``slot * blocks_per_chunk + j``) and each lower tier's worker side
(``TierSpec.get_worker``: this rank's disk slab, its own connection to the shared
tier's bucket, opened here after any fork). I/O: GPU <-> host copies (CUDA streams;
synchronous on CPU) here; each lower tier's reads and writes on that tier's threads,
each block verified (checksum, or the shared tier's object header and checksum) before
a byte of it is used.

Failures never reach vLLM, whose worker connector asserts that every job succeeded:
every job is reported done. A job that failed inside (logged, counted) marks the CPU
slots it was writing in the shared ``SlotHealth`` map *before* it is reported, and the
scheduler then completes those chunks as failed, so garbage never becomes loadable
(stores) or stays in the CPU tier (promotions). A load marks the CPU slots of the
chunks whose copy to the GPU failed as well: the scheduler never serves those again
(``health.LoadSlots``), so a copy that keeps failing cannot make vLLM recompute and
reload the same request without end. What cannot be undone is a *load* whose
bytes did not all arrive: the request runs with those GPU blocks unfilled. The manager
makes that as unlikely as we know how: only CPU-resident chunks and disk or shared-tier
chunks verified on every rank moments before are reported as hits, and the read is
checked again here, so it takes a read that fails after a successful one (a dying
disk, a server lost between the two reads) - which is logged as an error naming the job.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.base import GPULoadStoreSpec as VllmGPUSpec
from vllm.v1.kv_offload.base import LoadStoreSpec as VllmLoadStoreSpec
from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult

from tiered_kv.abstract import Closing
from tiered_kv.config import ConfigError
from tiered_kv.cost import PREFILL
from tiered_kv.cpu.handlers import LOAD_PRIORITY, STORE_PRIORITY, SingleDirectionOffloadingHandler
from tiered_kv.integrations.vllm.canary import CanaryPlan, engine_kv_tensors, run_canary
from tiered_kv.integrations.vllm.common import CounterIncreases, TieredJobSpec
from tiered_kv.integrations.vllm.geometry import VllmGeometry
from tiered_kv.integrations.vllm.health import LoadTimings, SlotHealth
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec, GPURowsSpec, chunk_positions
from tiered_kv.metrics import CANARY_CHECKS, TIER_BLOCKS, transfer_job_values
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.tiered.transfer_specs import TieredLoadSpec, TieredStoreSpec
from tiered_kv.worker.forward_timer import ForwardTimer
from tiered_kv.worker.worker import OffloadingHandler, TransferResult, TransferSpec

logger = logging.getLogger(__name__)


def gpu_rows(spec: VllmGPUSpec, blocks_per_chunk: int, num_chunks: int) -> np.ndarray:
    """vLLM's GPU spec as ``(num_chunks, blocks_per_chunk)`` GPU block ids, -1 where a
    chunk's GPU-block position is not transferred (see the module docstring). Raises
    ``ValueError`` when the spec does not cover exactly ``num_chunks`` chunks."""
    f = blocks_per_chunk
    ids = np.asarray(spec.block_ids, dtype=np.int64)
    parts, start = [], 0
    for size, first in zip(spec.group_sizes, spec.block_indices):
        size = int(size)
        if size == 0:
            continue
        skip = int(first) % f
        flat = np.full(-(-(skip + size) // f) * f, -1, dtype=np.int64)
        flat[skip : skip + size] = ids[start : start + size]
        parts.append(flat.reshape(-1, f))
        start += size
    rows = np.concatenate(parts) if parts else np.zeros((0, f), dtype=np.int64)
    if start != len(ids) or len(rows) != num_chunks:
        raise ValueError(
            f"GPU spec with {len(ids)} block ids in groups {list(spec.group_sizes)} "
            f"starting at {list(spec.block_indices)} covers {len(rows)} chunks of {f} "
            f"blocks; the offloading spec has {num_chunks}"
        )
    return rows


def canonical_layout(kv_caches: CanonicalKVCaches, tokens_per_block: int, blocks_per_chunk: int) -> KVCacheLayout:
    """Our layout of vLLM's canonical tensors (one layer each); raises ``ConfigError``
    for tensors our copies cannot address."""
    layers = []
    for i, t in enumerate(kv_caches.tensors):
        tensor = t.tensor
        if tensor.dtype != torch.int8 or tensor.dim() != 2 or not tensor.is_contiguous():
            raise ConfigError(
                f"vLLM KV tensor {i}: expected a contiguous int8 (num_blocks, page) view, "
                f"got {tensor.dtype} shape {tuple(tensor.shape)} stride {tensor.stride()}; "
                f"this KV-cache layout is not supported by TieredOffloadingSpec"
            )
        layers.append(LayerLayout(f"vllm_kv_tensor{i}", tuple(tensor.shape), False))
    return KVCacheLayout(tuple(layers), torch.int8, tokens_per_block, blocks_per_chunk)


@dataclass
class _Job:
    """What a job in flight needs when it ends: the CPU slots it writes, the GPU blocks
    it moves, and its size; a load's CPU slot per chunk (-1: not read from CPU) and
    GPU rows per chunk, where they are known."""

    slots: np.ndarray
    gpu_blocks: np.ndarray
    nbytes: int
    kind: str
    started: float
    reads: np.ndarray | None = None
    rows: np.ndarray | None = None

    def failed_reads(self, failed_gpu_blocks: tuple[int, ...] | None) -> np.ndarray:
        """The CPU slots of the chunks this load read from CPU whose GPU blocks are among
        ``failed_gpu_blocks`` (None: every chunk failed)."""
        if self.reads is None:
            return np.zeros(0, dtype=np.int64)
        reads = self.reads
        if failed_gpu_blocks is not None and self.rows is not None and len(self.rows) == len(reads):
            reads = reads[np.isin(self.rows, np.asarray(failed_gpu_blocks, dtype=np.int64)).any(axis=1)]
        return reads[reads >= 0]


class TieredVllmWorker(OffloadingWorker, Closing):
    """The worker side of ``TieredOffloadingSpec`` (module docstring): ``cfg`` and ``g``
    are the spec's parsed config and geometry, ``engine_id`` vLLM's."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        hierarchy_for: Callable[[KVCacheLayout], HierarchySpec],
        g: VllmGeometry,
        engine_id: str,
        *,
        recompute_failed_loads: bool = False,
        canary: CanaryPlan | None = None,
    ):
        self.factor = g.blocks_per_chunk
        self.layout = canonical_layout(kv_caches, g.tokens_per_block, g.blocks_per_chunk)
        if self.layout.bytes_per_block != g.bytes_per_chunk:
            raise ConfigError(
                f"vLLM's KV tensors hold {self.layout.bytes_per_block // self.factor} bytes per GPU block "
                f"on rank {g.rank}, but vLLM told the scheduler {g.worker_bytes_per_block} "
                f"(worker_kv_bytes_per_block); the tiers would be sized for another chunk, so this "
                f"KV-cache layout is not supported by TieredOffloadingSpec"
            )
        self.kernel_bytes = g.worker_bytes_per_block
        self.rank = g.rank
        #: The hierarchy's builder for this rank, the same one the scheduler and every
        #: other deployment use; it opens each lower tier's worker side.
        self.hierarchy = hierarchy_for(self.layout)
        self.stats = self.hierarchy.stats
        gpu = [t.tensor for t in kv_caches.tensors]
        self.host = self.hierarchy.allocate_host()
        flags = [False] * len(gpu)
        copy_kernels = self.hierarchy.config.copy_kernels
        gpu_to_cpu = SingleDirectionOffloadingHandler(
            gpu, self.host.tensors, flags, 1, 1, STORE_PRIORITY, copy_kernels=copy_kernels
        )
        cpu_to_gpu = SingleDirectionOffloadingHandler(
            self.host.tensors, gpu, flags, 1, 1, LOAD_PRIORITY, copy_kernels=copy_kernels
        )
        # vLLM transfers any GPU-block positions of a chunk: the GPU <-> CPU copies
        # address GPU blocks, and every GPU side is given per chunk (GPURowsSpec).
        self.store_handler, self.load_handler = self.hierarchy.build_handlers(
            gpu_to_cpu, cpu_to_gpu, gpu, gpu_block_granular=True, store_bytes_per_block=self.kernel_bytes
        )
        #: The start-up canary's outcome, counted once (``CANARY_CHECKS``).
        self.canary_outcome = "off"
        if canary is not None:
            # Before any observer or shared map sees a transfer, and uncounted: the
            # canary's two jobs are no load timing, no served transfer, and touch no
            # slot the scheduler tracks.
            counted = copy.deepcopy(self.stats.transfers)
            try:
                self.canary_outcome = run_canary(self, kv_caches, canary, engine_kv_tensors(), gpu_rows)
                self.stats.transfers.clear()
                self.stats.transfers.update(counted)
                self.stats.latencies.drain()
            except BaseException:
                self.store_handler.shutdown()
                self.load_handler.shutdown()
                self.hierarchy.close()
                raise
        self.health = SlotHealth.for_engine(engine_id, g.num_cpu_slots)
        #: Every finished transfer's time, for the scheduler's per-tier load costs.
        self.timings = LoadTimings.for_engine(
            engine_id, [t.name for t in self.hierarchy.lower_tiers], self.hierarchy.tp_size, self.hierarchy.rank
        )
        self.stats.observers.append(self.timings.record)
        #: Times the forward passes the scheduler marked as prefill (``connector``).
        self.forward_timer = ForwardTimer(
            lambda tokens, seconds: self.timings.record(PREFILL, tokens, seconds), cuda=any(t.is_cuda for t in gpu)
        )
        self._jobs: dict[int, _Job] = {}
        self._failed_on_submit: list[int] = []
        #: The connector reports these GPU blocks to vLLM, which recomputes them
        #: (``connector.TieredOffloadingConnector``); off: a failed load is only logged.
        self.recompute_failed_loads = recompute_failed_loads
        self._failed_gpu_blocks: set[int] = set()
        self._increases = CounterIncreases()

    # ------------------------------------------------------------------ submit

    def submit_store(self, job_id: int, src_spec: VllmGPUSpec, dst_spec: VllmLoadStoreSpec) -> bool:
        store = _inner(dst_spec, TieredStoreSpec)
        slots = store.block_ids

        def transfer() -> tuple[np.ndarray, TransferSpec]:
            rows = gpu_rows(src_spec, self.factor, len(slots))
            keep = rows >= 0
            dst = TieredStoreSpec(
                chunk_positions(slots, self.factor)[keep],
                spills=store.tier_spills,
                write_through=store.tier_write_through,
            )
            return rows[keep], (GPULoadStoreSpec(rows[keep]), dst)

        return self._submit(job_id, "store", slots, self.store_handler, transfer)

    def submit_load(
        self, job_id: int, src_spec: VllmLoadStoreSpec, dst_spec: VllmGPUSpec, expedited: bool = False
    ) -> bool:
        src = _inner(src_spec, (CPULoadStoreSpec, TieredLoadSpec))
        promoted = (
            src.promote_slots[src.promote_slots >= 0]
            if isinstance(src, TieredLoadSpec)
            else np.zeros(0, dtype=np.int64)
        )

        reads = np.asarray(src.cpu_slots if isinstance(src, TieredLoadSpec) else src.block_ids, dtype=np.int64)
        rows_of: list[np.ndarray] = []

        def transfer() -> tuple[np.ndarray, TransferSpec]:
            rows = gpu_rows(dst_spec, self.factor, len(reads))
            rows_of.append(rows)
            return rows[rows >= 0], (src, GPURowsSpec(rows))

        self._submit(job_id, "load", promoted, self.load_handler, transfer)
        job = self._jobs[job_id]
        job.reads, job.rows = reads, rows_of[0] if rows_of else None
        return True

    def submit_prefetch(self, job_id: int, src: TieredLoadSpec) -> None:
        """A promotion with no GPU side (prefetch while a request waits,
        ``prefetch_jobs``): the tier's blocks read into their CPU slots and verified there;
        a failure marks those slots, as a load's does."""
        rows = np.full((len(src), self.factor), -1, dtype=np.int64)
        no_gpu_blocks = np.zeros(0, dtype=np.int64)
        transfer = (no_gpu_blocks, (src, GPURowsSpec(rows)))
        self._submit(job_id, "prefetch", src.promote_slots, self.load_handler, lambda: transfer)

    def _submit(
        self,
        job_id: int,
        kind: str,
        slots: np.ndarray,
        handler: OffloadingHandler,
        transfer: Callable[[], tuple[np.ndarray, TransferSpec]],
    ) -> bool:
        """Hand job ``job_id`` to ``handler``; ``transfer()`` gives its GPU blocks and its
        spec. ``slots``: the CPU slots it writes. A job that cannot be submitted is
        reported failed by the next ``get_finished``: vLLM asserts acceptance, so this
        always returns True."""
        gpu_blocks = np.zeros(0, dtype=np.int64)
        try:
            gpu_blocks, spec = transfer()
            self._track(job_id, kind, slots, gpu_blocks)
            accepted = handler.transfer_async(job_id, spec)
        except Exception:
            logger.exception("rank %d: %s job %d could not be submitted", self.rank, kind, job_id)
            accepted = False
        if not accepted:
            self._track(job_id, kind, slots, gpu_blocks, moved=False)
            self._failed_on_submit.append(job_id)
        return True

    def _track(self, job_id: int, kind: str, slots: np.ndarray, gpu_blocks: np.ndarray, moved: bool = True) -> None:
        nbytes = len(gpu_blocks) * self.kernel_bytes if moved else 0
        self._jobs[job_id] = _Job(
            np.asarray(slots, dtype=np.int64), np.asarray(gpu_blocks), nbytes, kind, time.perf_counter()
        )

    def take_failed_gpu_blocks(self) -> set[int]:
        """The GPU blocks that load jobs reported done since the last call did not fill
        (the blocks of their failed parts, ``_fail``; for
        ``TieredOffloadingConnector.get_block_ids_with_load_errors``)."""
        out, self._failed_gpu_blocks = self._failed_gpu_blocks, set()
        return out

    # ------------------------------------------------------------------ completion

    def get_finished(self) -> list[VllmTransferResult]:
        results = [TransferResult(j, False) for j in self._failed_on_submit]
        self._failed_on_submit = []
        results += self.store_handler.get_finished() + self.load_handler.get_finished()
        out = []
        now = time.perf_counter()
        for result in results:
            job = self._jobs.pop(result.job_id, None)
            if job is None:  # refused at submission and reported then: report it once
                continue
            if not result.success:
                self._fail(result.job_id, job, result.failed_gpu_blocks)
            # The handlers' own measure: a copy's time, not the time until vLLM polled. A
            # failed job moved no bytes vLLM's load and store counters should show.
            seconds = result.seconds if result.seconds is not None else now - job.started
            nbytes = job.nbytes if result.success else None
            out.append(VllmTransferResult(result.job_id, True, nbytes, seconds if result.success else None))
        return out

    def _fail(self, job_id: int, job: _Job, failed_gpu_blocks: tuple[int, ...] | None = None) -> None:
        """Keep a failed job's CPU slots from being served (see the module docstring):
        those it writes, and those of a load's CPU-resident chunks whose copy failed.
        A load reports to vLLM the GPU blocks of its parts that failed
        (``failed_gpu_blocks``, where the handler names them; else all of the job's): vLLM
        recomputes a request from its first such block, so a CPU-resident lead that
        landed before a disk read that failed is kept (and served again)."""
        self.health.mark_bad(job.slots)
        self.health.mark_bad(job.failed_reads(failed_gpu_blocks))
        self.stats.count("cpu", "failed_stores" if job.kind == "store" else "failed_loads")
        if job.kind == "store":
            logger.error(
                "rank %d: store job %d failed; reported done to vLLM, its %d chunks are dropped by the scheduler",
                self.rank,
                job_id,
                len(job.slots),
            )
        elif job.kind == "prefetch":  # no GPU block waits on it: a miss when it is asked for
            logger.warning(
                "rank %d: prefetch job %d failed; its %d chunks are dropped by the scheduler",
                self.rank,
                job_id,
                len(job.slots),
            )
        elif self.recompute_failed_loads:
            failed = job.gpu_blocks.tolist() if failed_gpu_blocks is None else failed_gpu_blocks
            self._failed_gpu_blocks.update(failed)
            logger.warning(
                "rank %d: load job %d failed; %d of its %d GPU blocks are reported to vLLM, which recomputes "
                "each request from the first of them (the scheduler drops the CPU-tier chunks among them)",
                self.rank,
                job_id,
                len(failed),
                len(job.gpu_blocks),
            )
        else:
            logger.error(
                "rank %d: load job %d failed (its promoted chunks, and the CPU-tier chunks that did not "
                "reach the GPU, are dropped by the scheduler); vLLM cannot take a failure, so it is reported "
                "done and the request may run on incomplete KV for these chunks. Every chunk was "
                "CPU-resident or read and verified on every rank just before: a disk or "
                "device is failing",
                self.rank,
                job_id,
            )

    # ------------------------------------------------------------------ metrics

    def take_stats(self) -> OffloadingConnectorStats | None:
        """This rank's metrics since the last call, for ``TieredOffloadingConnector``
        to hand vLLM with the step's output: its transfer jobs per type and outcome,
        their timings, each lower tier's failed writes, and what its worker side counts (a shared tier's
        store: this rank's uploads and downloads). None when nothing changed."""
        stats = OffloadingConnectorStats()
        totals = self.stats.as_dict()
        counters = transfer_job_values(totals["transfers"])
        # A lower tier's writes that failed here: only the workers see them fail.
        counters += [
            (TIER_BLOCKS, (t, "failed_stores"), c["failed_stores"]) for t, c in totals["tiers"].items() if t != "cpu"
        ]
        counters.append((CANARY_CHECKS, (self.canary_outcome,), 1))
        timings = self.stats.latencies.drain()
        for tier in self.hierarchy.lower_tiers:
            counters += tier.worker_counters()
            timings += tier.worker_timings()
        self._increases.report(stats, counters)
        for name, labels, seconds in timings:
            stats.observe_histogram(name, seconds, labels)
        return None if stats.is_empty() else stats

    def wait(self, job_ids: set[int]) -> None:
        self.store_handler.wait(job_ids)
        self.load_handler.wait(job_ids)

    def shutdown(self) -> None:
        self.store_handler.shutdown()
        self.load_handler.shutdown()
        self.hierarchy.close()
        self.health.close()
        self.timings.close()


def _inner(spec: VllmLoadStoreSpec, expected):
    """Our spec inside vLLM's; a foreign spec is a wiring error (another manager's)."""
    if not isinstance(spec, TieredJobSpec) or not isinstance(spec.inner, expected):
        raise TypeError(f"TieredOffloadingSpec's worker got {spec!r}; expected a TieredJobSpec from its own manager")
    return spec.inner
