"""GPU <-> pinned-CPU handlers: the core copy path of the hierarchy.

Worker process. Each direction has its own handler and its own CUDA stream; loads
(CPU->GPU) run on a higher-priority stream than stores (GPU->CPU) because a load
stalls a request while a store only frees GPU memory later. Jobs of one handler run
on its one stream, so they execute and complete in submission order; each job ends
with a CUDA event that ``get_finished`` polls (never blocking) and ``wait``
synchronizes on. Both streams first wait for the compute stream, so a store reads KV
only after the kernels that wrote it, and a load does not overwrite blocks that
earlier kernels still read.

Every layer is one plane of whole kernel-block rows, or two (K and V) when the KV
dimension comes first. Each side's planes can be seen as rows of one tensor
(``tiered_kv.memory.zero_copy.PlaneRows``), so moving a job's blocks of every plane is
one copy of rows (``copy_blocks``), however many layers and wherever they lie.

Kernels (on CUDA, with a pinned CPU tier the device maps): the copy reads and writes
the host memory in place, one kernel per job (two for small jobs: see ``copy_blocks``).

DMA: a store gathers the job's blocks on the device into a staging tensor laid out as
the host tier's rows (``HostKVCache`` is block-major: each kernel block's row holds
every plane), in one copy of rows where the device's layers allow it (``staging_rows``),
else an ``index_select`` per plane, and copies it to the host slots one *contiguous
run* of slots at a time (``non_blocking`` into pinned memory); a load copies host runs
into staging and scatters them the same way. The copy engines run a load and a store at
once; each copy costs CPU time to issue, so short runs go by kernels where they can
(``gpu_copy: auto``, ``DMA_RUN_BYTES``). Host tensors laid out per layer (``row_groups``
finds no shared rows) are copied a plane at a time (docs/benchmarks.md, "GPU <-> CPU").

Without CUDA the same code runs, synchronously inside ``transfer_async``, with CPU
tensors standing in for the device cache (the side named by the ``GPULoadStoreSpec``)
and completion is immediate. Planes are viewed as 8-byte words: CPU ``index_copy_``
is element-wise, several times slower on bytes. No file I/O.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tiered_kv.memory.device import COMPLETED, TransferStream
from tiered_kv.memory.host_memory import HostKVCache, as_words, expand_block_ids, kv_planes
from tiered_kv.mediums import GPULoadStoreSpec, ids_spec
from tiered_kv.worker.worker import OffloadingHandler, TransferResult, TransferSpec
from tiered_kv.memory.zero_copy import MAX_STAGING_BYTES, PlaneRows, copy_blocks

logger = logging.getLogger(__name__)

#: CUDA stream priorities (lower is more urgent): loads ahead of stores.
LOAD_PRIORITY = -1
STORE_PRIORITY = 1


def contiguous_runs(sorted_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, end, first_id)`` for each run of consecutive ids in ``sorted_ids``:
    positions ``start:end`` hold ids ``first_id .. first_id + end - start - 1``."""
    if len(sorted_ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(sorted_ids)]))
    return list(zip(starts.tolist(), ends.tolist(), sorted_ids[starts].tolist()))


#: With ``gpu_copy: auto``, a job whose host slots come in runs of at least this many bytes
#: on average goes by DMA (where its blocks stage as rows in one copy): issuing a copy
#: costs some 10-20 us of CPU, which a run this long hides behind its transfer, and the
#: copy engines run a load and a store at once. Shorter runs go by kernels, one per job.
DMA_RUN_BYTES = 2 << 20


def in_long_runs(host_ids: np.ndarray, block_bytes: int) -> bool:
    """Whether ``host_ids`` (kernel blocks of ``block_bytes``, any order) come in
    consecutive runs of ``DMA_RUN_BYTES`` or more on average."""
    if len(host_ids) * block_bytes < DMA_RUN_BYTES:
        return False
    ordered = np.sort(host_ids)
    runs = 1 + int(np.count_nonzero(np.diff(ordered) != 1))
    return len(host_ids) * block_bytes >= runs * DMA_RUN_BYTES


class SingleDirectionOffloadingHandler(OffloadingHandler):
    """Copies kernel blocks from ``src_tensors`` to ``dst_tensors`` (same layers, same
    order), one direction, jobs in submission order.

    A spec's block ids address blocks of ``*_block_size_factor`` kernel blocks on that
    side (GPU: 1, CPU: the offloaded block factor). A ``GPULoadStoreSpec.skip_count``
    drops that many leading kernel blocks from the first block on the side whose
    factor is larger. At most one side may live on a CUDA device; ``priority`` is
    that device's stream priority (lower is more urgent).

    A spec that does not fit (counts differ, ids out of range) raises ``ValueError``
    and nothing is copied. A copy that fails after acceptance is logged and the job
    is reported failed, in order, by ``get_finished``.

    ``copy_kernels``: move bytes with kernels over the mapped host memory (True; raises
    ``ValueError`` where that cannot be had), with DMA copies (False), or (None) each
    job the way that suits it: DMA copies where its host slots come in runs of at least
    ``DMA_RUN_BYTES`` and the device's blocks are staged as the host tier's rows in one
    copy (``staging_rows``: a block-major tier), else kernels where possible.
    ``self.copy_kernels``: whether kernels move some jobs.
    """

    def __init__(
        self,
        src_tensors: Sequence[torch.Tensor],
        dst_tensors: Sequence[torch.Tensor],
        kv_dim_before_num_blocks: Sequence[bool],
        src_block_size_factor: int,
        dst_block_size_factor: int,
        priority: int,
        copy_kernels: bool | None = None,
    ):
        if not (len(src_tensors) == len(dst_tensors) == len(kv_dim_before_num_blocks)) or not src_tensors:
            raise ValueError(
                f"need one src tensor, dst tensor and kv flag per layer; got "
                f"{len(src_tensors)}, {len(dst_tensors)}, {len(kv_dim_before_num_blocks)}"
            )
        # Every layer as 1 or 2 planes of whole kernel-block rows, viewed as wide words:
        # all copies below are row gathers/scatters along dim 0.
        self._src: list[torch.Tensor] = []
        self._dst: list[torch.Tensor] = []
        for i, (s, d, kv) in enumerate(zip(src_tensors, dst_tensors, kv_dim_before_num_blocks)):
            src_planes, dst_planes = kv_planes(s, bool(kv)), kv_planes(d, bool(kv))
            if src_planes[0].shape[1] != dst_planes[0].shape[1]:
                raise ValueError(
                    f"layer {i}: src kernel block is {src_planes[0].shape[1]} bytes but "
                    f"dst is {dst_planes[0].shape[1]}; the tensors must have the same "
                    f"block shape and dtype"
                )
            for sp, dp in zip(src_planes, dst_planes):
                sw, dw = as_words(sp), as_words(dp)
                if sw.dtype != dw.dtype:
                    sw, dw = sp, dp
                self._src.append(sw)
                self._dst.append(dw)
        self._src_groups, self._dst_groups = row_groups(self._src), row_groups(self._dst)
        self.src_block_size_factor = src_block_size_factor
        self.dst_block_size_factor = dst_block_size_factor
        self._src_kernel_blocks = self._src[0].shape[0]
        #: Bytes of one kernel block over every layer and plane.
        self._kernel_block_bytes = sum(t.shape[1] * t.element_size() for t in self._src)
        self._dst_kernel_blocks = self._dst[0].shape[0]
        src_cuda = self._src[0].device.type == "cuda"
        dst_cuda = self._dst[0].device.type == "cuda"
        if src_cuda and dst_cuda:
            raise ValueError("both sides are CUDA tensors; this handler copies between a device and host")
        self._device = self._src[0].device if src_cuda else self._dst[0].device if dst_cuda else None
        self._async = self._device is not None
        self._stream = TransferStream(self._device or torch.device("cpu"), priority)
        self._jobs: deque = deque()  # (job_id, started, event, success, bytes), submission order
        #: ``(device side, host side)`` when copying with kernels, else None (DMA copies).
        self.plane_rows = self._plane_rows(src_cuda) if copy_kernels is not False else None
        if copy_kernels and self.plane_rows is None:
            raise ValueError(
                "copy kernels (copy_kernels=True, config gpu_copy: kernels) need a CUDA device, "
                "a pinned CPU tier it can map and layers of one block size; use gpu_copy auto or dma"
            )
        self.copy_kernels = self.plane_rows is not None
        self._dma_too = copy_kernels is None  # auto: long runs of slots go by DMA
        self._staging_rows: dict[bool, tuple[PlaneRows, torch.Tensor, PlaneRows] | None] = {}

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src_spec, dst_spec = map(ids_spec, spec)
        skip = next((s.skip_count for s in spec if isinstance(s, GPULoadStoreSpec)), 0)
        if skip and self.src_block_size_factor == self.dst_block_size_factor:
            raise ValueError(f"job {job_id}: skip_count={skip} needs one side with a larger block_size_factor")
        src_larger = self.src_block_size_factor > self.dst_block_size_factor
        src_ids = self._kernel_ids(src_spec.block_ids, self.src_block_size_factor, skip if src_larger else 0)
        dst_ids = self._kernel_ids(dst_spec.block_ids, self.dst_block_size_factor, 0 if src_larger else skip)
        if len(src_ids) != len(dst_ids):
            raise ValueError(
                f"job {job_id}: source {type(src_spec).__name__} covers {len(src_ids)} "
                f"kernel blocks but destination {type(dst_spec).__name__} covers "
                f"{len(dst_ids)} (skip_count={skip})"
            )
        self._check_range(src_ids, self._src_kernel_blocks, "source", job_id)
        self._check_range(dst_ids, self._dst_kernel_blocks, "destination", job_id)
        success, started = True, None
        try:
            # Before entering the scope: inside it, "current stream" is our own stream.
            self._stream.wait_for_compute()
            # Once the compute it waits for is done: the copies' own time, as the device ran them.
            started = self._stream.record_event(timing=True)
            with self._stream.scope():
                self._copy(src_ids, dst_ids, device_is_src=not isinstance(dst_spec, GPULoadStoreSpec))
        except Exception:
            logger.exception("transfer job %d failed while copying; reporting it failed", job_id)
            success = False
        try:
            # Also after a failure: report it only once the stream is past what was queued.
            event = self._stream.record_event(timing=started is not None)
        except Exception:
            logger.exception("could not record completion of job %d", job_id)
            event, success = COMPLETED, False
        self._jobs.append((job_id, started, event, success, len(src_ids) * self._kernel_block_bytes))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished = []
        jobs = self._jobs
        while jobs:
            job_id, started, event, success, nbytes = jobs[0]
            try:
                if not event.query():
                    break
            except Exception:
                logger.exception("transfer job %d failed on the device", job_id)
                success = False
            jobs.popleft()
            seconds = None
            if success and started is not None:
                try:
                    seconds = started.elapsed_time(event) / 1e3
                except Exception:  # the copy is done; only its timing is lost
                    logger.warning("no transfer time for job %d", job_id, exc_info=True)
            finished.append(TransferResult(job_id, success, seconds, nbytes if success else None))
        return finished

    def wait(self, job_ids: set[int]) -> None:
        last = None
        for job_id, _, event, _, _ in self._jobs:
            if job_id in job_ids:
                last = event
        if last is not None:
            try:
                last.synchronize()  # one stream: earlier jobs are done too
            except Exception:
                logger.exception("waiting for transfer jobs failed; get_finished reports them")

    def shutdown(self) -> None:
        self._stream.synchronize()

    # ---- internals ----

    @staticmethod
    def _kernel_ids(block_ids: np.ndarray, factor: int, skip: int) -> np.ndarray:
        if factor == 1:
            return block_ids
        return expand_block_ids(block_ids, factor, skip)

    @staticmethod
    def _check_range(ids: np.ndarray, limit: int, side: str, job_id: int) -> None:
        # Checked on the host: an out-of-range index on CUDA poisons the whole context.
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise ValueError(
                f"job {job_id}: {side} kernel block ids span {int(ids.min())}.."
                f"{int(ids.max())}; expected 0..{limit - 1}"
            )

    def _plane_rows(self, device_is_src: bool) -> tuple[PlaneRows, PlaneRows] | None:
        if self._device is None:
            return None
        device_planes, host_planes = (self._src, self._dst) if device_is_src else (self._dst, self._src)
        device_rows = PlaneRows.of(device_planes, self._device)
        host_rows = PlaneRows.of(host_planes, self._device)
        return None if device_rows is None or host_rows is None else (device_rows, host_rows)

    def staging_rows(self, device_is_src: bool) -> tuple[PlaneRows, torch.Tensor, PlaneRows] | None:
        """For DMA copies of a block-major tier: the device side and a staging tensor laid
        out as the host tier's rows, each as ``PlaneRows``, so the gather into staging (or
        the scatter out of it) is one copy of rows rather than one per plane. None for a
        tier laid out per layer, or stand-in device layers in separate allocations. Made
        at the first job (on CPU only the job says which side stands in for the device)."""
        if device_is_src not in self._staging_rows:
            dma = self._dma_too or not self.copy_kernels
            self._staging_rows[device_is_src] = self._row_staging(device_is_src) if dma else None
        return self._staging_rows[device_is_src]

    def _row_staging(self, device_is_src: bool) -> tuple[PlaneRows, torch.Tensor, PlaneRows] | None:
        groups = self._dst_groups if device_is_src else self._src_groups
        if len(groups) != 1:
            return None
        host_rows, members = groups[0]
        device_rows = PlaneRows.of(self._src if device_is_src else self._dst, self._device or torch.device("cpu"))
        if device_rows is None:  # e.g. layers of several block sizes: a copy per plane
            return None
        rows = min(_rows_per_part(host_rows), host_rows.shape[0])  # a job spans at most every host row
        staging = torch.empty((rows, host_rows.shape[1]), dtype=host_rows.dtype, device=self._device)
        staging_rows = PlaneRows.of([staging[:, columns] for _, columns in members], staging.device)
        return None if staging_rows is None else (device_rows, staging, staging_rows)

    def _copy(self, src_ids: np.ndarray, dst_ids: np.ndarray, device_is_src: bool) -> None:
        if not len(src_ids):
            return
        if self.plane_rows is not None and not (
            self._dma_too  # auto: a job whose slots run long goes by DMA where it can stage as rows
            and in_long_runs(dst_ids if device_is_src else src_ids, self._kernel_block_bytes)
            and self.staging_rows(device_is_src) is not None
        ):
            device_rows, host_rows = self.plane_rows
            if device_is_src:
                copy_blocks(device_rows, host_rows, src_ids, dst_ids)
            else:
                copy_blocks(host_rows, device_rows, src_ids, dst_ids)
        elif device_is_src:
            self._gather_then_copy_runs(src_ids, dst_ids)
        else:
            self._copy_runs_then_scatter(src_ids, dst_ids)

    def _gather_then_copy_runs(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """Device -> host: per part of the job, one gather into staging laid out as the
        host rows (per plane where ``staging_rows`` has none), then one copy per run of
        host slots."""
        order = np.argsort(dst_ids, kind="stable")
        dst_sorted, src_sorted = dst_ids[order], src_ids[order]
        if (staged := self.staging_rows(True)) is not None:
            device_rows, staging, staging_rows = staged
            ((host_rows, _),) = self._dst_groups
            for part in _parts(len(order), host_rows):
                copy_blocks(device_rows, staging_rows, src_sorted[part], np.arange(part.stop - part.start))
                for start, end, first in contiguous_runs(dst_sorted[part]):
                    host_rows[first : first + end - start].copy_(staging[start:end], non_blocking=self._async)
            return
        src_idx = torch.from_numpy(src_sorted).to(self._src[0].device, non_blocking=True)
        for host_rows, members in self._dst_groups:
            for part in _parts(len(order), host_rows):
                staging = _staging(part, host_rows, self._device)
                for plane, columns in members:
                    torch.index_select(self._src[plane], 0, src_idx[part], out=staging[:, columns])
                for start, end, first in contiguous_runs(dst_sorted[part]):
                    host_rows[first : first + end - start].copy_(staging[start:end], non_blocking=self._async)

    def _copy_runs_then_scatter(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """Host -> device: per part of the job, one copy per run of host slots into
        staging, then one scatter out of it (per plane where ``staging_rows`` has none)."""
        order = np.argsort(src_ids, kind="stable")
        src_sorted = src_ids[order]
        if (staged := self.staging_rows(False)) is not None:
            device_rows, staging, staging_rows = staged
            ((host_rows, _),) = self._src_groups
            dst_sorted = dst_ids[order]
            for part in _parts(len(order), host_rows):
                for start, end, first in contiguous_runs(src_sorted[part]):
                    staging[start:end].copy_(host_rows[first : first + end - start], non_blocking=self._async)
                copy_blocks(staging_rows, device_rows, np.arange(part.stop - part.start), dst_sorted[part])
            return
        device = self._dst[0].device
        dst_idx = torch.from_numpy(dst_ids[order]).to(device, non_blocking=True)
        for host_rows, members in self._src_groups:
            for part in _parts(len(order), host_rows):
                staging = _staging(part, host_rows, device)
                for start, end, first in contiguous_runs(src_sorted[part]):
                    staging[start:end].copy_(host_rows[first : first + end - start], non_blocking=self._async)
                for plane, columns in members:
                    self._dst[plane].index_copy_(0, dst_idx[part], staging[:, columns])


def _parts(n: int, host_rows: torch.Tensor) -> list[slice]:
    """Positions ``0..n-1`` of a job in parts whose staging (rows like ``host_rows``)
    takes at most ``MAX_STAGING_BYTES`` of device memory."""
    per_part = _rows_per_part(host_rows)
    return [slice(a, min(n, a + per_part)) for a in range(0, n, per_part)]


def _rows_per_part(host_rows: torch.Tensor) -> int:
    return max(1, MAX_STAGING_BYTES // (host_rows.shape[1] * host_rows.element_size()))


def _staging(part: slice, host_rows: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """Uninitialised rows like ``host_rows``' on ``device``, one per position of ``part``."""
    return torch.empty((part.stop - part.start, host_rows.shape[1]), dtype=host_rows.dtype, device=device)


def row_groups(planes: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[tuple[int, slice]]]]:
    """``planes`` (2-D, contiguous rows, one dtype) as ``(rows, [(plane, columns),
    ...])``: where every plane's row ``k`` is a column range of row ``k`` of one matrix
    that they tile exactly (a block-major CPU tier: each kernel block's row holds every
    plane), that matrix and each plane's columns; else each plane alone. A DMA copy then
    moves a run of slots of every plane at once."""
    alone = [(plane, [(i, slice(0, plane.shape[1]))]) for i, plane in enumerate(planes)]
    if len(planes) < 2 or len({(p.dtype, p.shape[0], p.stride(0), p.stride(1)) for p in planes}) != 1:
        return alone
    order = sorted(range(len(planes)), key=lambda i: planes[i].data_ptr())
    first, size = planes[order[0]], planes[0].element_size()
    if first.stride(1) != 1:
        return alone
    offset, members = 0, []
    for i in order:
        if planes[i].data_ptr() - first.data_ptr() != offset * size:
            return alone
        members.append((i, slice(offset, offset + planes[i].shape[1])))
        offset += planes[i].shape[1]
    if offset != first.stride(0):
        return alone
    return [(first.as_strided((first.shape[0], offset), (offset, 1)), sorted(members))]


class CpuGpuOffloadingHandlers:
    """The two handlers between a device KV cache and a ``HostKVCache``.

    ``gpu_caches``: the device's per-layer KV tensors, as layer name -> tensor (looked up
    by ``host.layout``'s layer names) or a sequence in layout order; CPU tensors stand
    in for a device without CUDA. ``gpu_to_cpu_handler`` serves
    ``(GPULoadStoreSpec, CPULoadStoreSpec)`` jobs, ``cpu_to_gpu_handler`` the reverse.
    """

    def __init__(
        self,
        gpu_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        host: HostKVCache,
        copy_kernels: bool | None = None,
    ):
        layout = host.layout
        if isinstance(gpu_caches, Mapping):
            missing = [l.name for l in layout.layers if l.name not in gpu_caches]
            if missing:
                raise ValueError(f"gpu_caches lacks layers {missing}; it has {sorted(gpu_caches)}")
            gpu_tensors = [gpu_caches[l.name] for l in layout.layers]
        else:
            gpu_tensors = list(gpu_caches)
        kv_first = [l.kv_before_num_blocks for l in layout.layers]
        factor = layout.block_size_factor
        self.host = host
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            gpu_tensors, host.tensors, kv_first, 1, factor, priority=STORE_PRIORITY, copy_kernels=copy_kernels
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            host.tensors, gpu_tensors, kv_first, factor, 1, priority=LOAD_PRIORITY, copy_kernels=copy_kernels
        )
