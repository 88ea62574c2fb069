"""Disk transfer handlers: CPU <-> DISK and GPU <-> DISK. Worker process, one per TP rank.

Each handler owns a ``BlockStore`` view of rank ``rank``'s slab (``DiskStore``, or
``DiskIOProcess`` in a helper process) and moves whole offloaded blocks between KV tensors
and disk slots:

- ``CpuDiskHandler`` (``CPULoadStoreSpec`` <-> ``DiskLoadStoreSpec``): hands the store
  the CPU tier's slots as they lie (``SlotViews``, ``submit_slots``). Where each slot's
  pieces are page-aligned and at least 32 KiB (the usual case: the tier is block-major,
  a slot one piece), the store reads and writes each block straight from/into that
  memory and checksums it in place; otherwise the store packs them, 8 MiB at a time,
  into pack buffers of its own and writes those, or reads, verifies and unpacks. Either way this
  happens where the store runs: in a disk I/O process with ``disk_io: process``. (A CPU
  tier the store cannot reach, private memory beside a disk I/O process, goes through
  the staging path below instead.)
- ``GpuDiskHandler`` (``GPULoadStoreSpec`` <-> ``DiskLoadStoreSpec``): with KvikIO and
  GPUDirect Storage, blocks are packed/unpacked on the device in a device staging
  buffer that goes straight to/from the disk (a pinned mirror only feeds the
  checksum); otherwise they pass through a pinned host bounce buffer. Honours
  ``GPULoadStoreSpec.skip_count`` on loads.

Jobs run on the handler's job threads (``transfer_async`` only queues them and never
blocks); each job takes one staging buffer from a fixed pool (a job that finds none
waits in the queue, so memory stays bounded), splits it in two halves and packs one
half while the other is written (or unpacks one while the other is read). Durability,
checksums and the index commit are the store's (``tiered_kv.disk.store.store``); a store
job's thread moves on to the next job once its writes are done, and the job is
reported when the (group) commit settles it. A job succeeds only if every block of it
did. ``stats`` keeps bytes and seconds per transfer
type (``cpu_to_disk``, ``disk_to_cpu``, ``gpu_to_disk``, ``disk_to_gpu``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from tiered_kv.abstract import LoadStoreSpec
from tiered_kv.memory.device import TransferStream, can_pin_memory
from tiered_kv.disk.store.block_store import BlockStore
from tiered_kv.disk.store.io_backends import aligned_empty
from tiered_kv.memory.host_memory import HostKVCache, pack_blocks, unpack_blocks
from tiered_kv.memory.slot_views import SlotViews
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec, TierSlotsSpec, spec_as
from tiered_kv.metrics import TieredStats
from tiered_kv.worker.jobs import ThreadedHandler, cpu_kernel_rows, gpu_kernel_rows
from tiered_kv.worker.worker import TransferSpec

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20


class _Staging:
    """One staging buffer: ``rows`` (R, slot_size) where the I/O happens, and for device
    rows a pinned host ``mirror`` for checksums."""

    def __init__(self, rows: torch.Tensor, mirror: torch.Tensor | None):
        self.rows = rows
        self.mirror = mirror


class _StagingPool:
    """At most ``count`` staging buffers, allocated on first use; ``acquire`` blocks.

    Pinned host memory that cannot be had (locked-memory limits) is replaced by pageable
    memory, with a warning; an allocation that fails altogether raises in the job that
    asked and leaves the pool able to try again, so no job waits for a buffer that was
    never made."""

    def __init__(
        self,
        count: int,
        rows: int,
        slot_size: int,
        pin: bool,
        device: torch.device | None,
        host_buffer: Callable[[int, bool], torch.Tensor],
    ):
        self._host_buffer = host_buffer  # the store's kind of host memory
        self._free: queue.Queue[_Staging] = queue.Queue()
        self._made = 0
        self._count = count
        self._lock = threading.Lock()
        self._shape = (rows, slot_size)
        self._pin = pin
        self._device = device

    def acquire(self) -> _Staging:
        while True:
            with self._lock:
                make = self._free.empty() and self._made < self._count
                if make:
                    self._made += 1
            if make:
                try:
                    return self._make()
                except BaseException:
                    with self._lock:
                        self._made -= 1
                    raise
            try:  # a bounded wait: a peer's failed allocation frees a place to make one
                return self._free.get(timeout=0.05)
            except queue.Empty:
                continue

    def release(self, buf: _Staging) -> None:
        self._free.put(buf)

    def _make(self) -> _Staging:
        n = self._shape[0] * self._shape[1]
        if self._device is not None:
            rows = aligned_empty(n, device=self._device).view(self._shape)
            return _Staging(rows, self._host(n).view(self._shape))
        return _Staging(self._host(n).view(self._shape), None)

    def _host(self, n: int) -> torch.Tensor:
        if self._pin:
            try:
                return self._host_buffer(n, True)
            except RuntimeError as e:
                self._pin = False
                logger.warning(
                    "pinning a %d-byte disk staging buffer failed (%s); using pageable memory, "
                    "so device copies are slower. Raise the locked-memory limit (ulimit -l, "
                    "docker --ulimit memlock=-1) to get pinned staging back",
                    n,
                    e,
                )
        return self._host_buffer(n, False)


class _DiskHandler(ThreadedHandler):
    """Shared machinery of the disk handlers: staging, pipelined store/load (job
    bookkeeping: ``ThreadedHandler``)."""

    #: (store kind, load kind) names for stats.
    kinds: tuple[str, str] = ("", "")
    #: The spec of the side that is not the disk (set by each handler).
    other_spec: type[BlockIDsLoadStoreSpec]

    def __init__(
        self,
        store: BlockStore,
        rank: int,
        tensors: Sequence[torch.Tensor],
        layout: KVCacheLayout,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        job_threads: int = 2,
        staging_device: torch.device | None = None,
        owns_store: bool = False,
    ):
        if store.block_bytes != layout.bytes_per_block:
            raise ValueError(
                f"the disk namespace stores {store.block_bytes}-byte blocks but the layout's "
                f"blocks are {layout.bytes_per_block} bytes"
            )
        if not 0 <= rank < store.tp_size:
            raise ValueError(f"rank {rank} is out of range for the namespace's tp_size {store.tp_size}")
        self.store, self.rank, self.layout = store, rank, layout
        self.tensors = list(tensors)
        self.stats = TieredStats()  # this handler's transfers, by type (``kinds``)
        self._owns_store = owns_store
        rows = max(2, staging_bytes // store.slot_size)
        pin = can_pin_memory()
        self._staging = _StagingPool(job_threads, rows, store.slot_size, pin, staging_device, store.host_buffer)
        super().__init__(job_threads, f"tkv-{type(self).__name__}")

    # ------------------------------------------------------------ OffloadingHandler

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        try:
            if isinstance(src, self.other_spec) and isinstance(dst, TierSlotsSpec):
                kind, ids, disk = self.kinds[0], self._kernel_ids(src, len(dst), store=True), dst
            elif isinstance(src, TierSlotsSpec) and isinstance(dst, self.other_spec):
                kind, ids, disk = self.kinds[1], self._kernel_ids(dst, len(src), store=False), src
            else:
                raise ValueError(f"{type(self).__name__} cannot transfer {type(src).__name__} -> {type(dst).__name__}")
        except ValueError as e:
            logger.error("rejecting disk job %d: %s", job_id, e)
            return False
        return self._submit(job_id, self._run, job_id, kind, ids, list(disk.block_hashes), disk.block_ids.tolist())

    def _release(self) -> None:
        if self._owns_store:
            self.store.close()

    # ------------------------------------------------------------ jobs

    def _kernel_ids(self, spec: LoadStoreSpec, n: int, store: bool) -> np.ndarray:
        """``(n, block_size_factor)`` kernel ids of ``spec`` (-1 = skip)."""
        raise NotImplementedError

    def _run(self, job_id: int, kind: str, ids: np.ndarray, hashes: list[bytes], slots: list[int]) -> None:
        t0 = time.perf_counter()
        done: Future = Future()
        try:
            if kind == self.kinds[0]:
                # The thread is free once the writes are done; the outcome comes with the
                # (group) commit, so commits overlap the next jobs' writes.
                done = self._store_job(ids, hashes, slots)
            else:
                done.set_result([self._load_job(ids, hashes, slots)])
        except Exception as e:
            done.set_exception(e)
        done.add_done_callback(lambda f: self._report(job_id, kind, len(hashes), t0, f))

    def _report(self, job_id: int, kind: str, n: int, t0: float, done: Future) -> None:
        try:
            ok = all(done.result())
        except Exception:
            logger.exception("disk job %d (%s, %d blocks) failed", job_id, kind, n)
            ok = False
        seconds = time.perf_counter() - t0
        nbytes = n * self.layout.bytes_per_block
        self.stats.record_transfer(kind, nbytes, seconds, success=ok, blocks=n)
        self._finish(job_id, ok, seconds, nbytes)

    def _chunks(self, n: int, half: int) -> list[tuple[int, int]]:
        return [(a, min(n, a + half)) for a in range(0, n, half)]

    def _store_job(self, ids: np.ndarray, hashes: list[bytes], slots: list[int]) -> Future:
        """Pack and write on this thread; the per-block outcome comes in the returned future."""
        batch = self.store.begin_write(self.rank, hashes, slots)
        try:
            stg = self._staging.acquire()
            try:
                half = stg.rows.shape[0] // 2
                busy: list[Future | None] = [None, None]
                for k, (a, b) in enumerate(self._chunks(len(hashes), half)):
                    h = k % 2
                    if (in_flight := busy[h]) is not None:
                        in_flight.result()
                    rows = stg.rows[h * half : h * half + (b - a)]
                    mirror = None if stg.mirror is None else stg.mirror[h * half : h * half + (b - a)]
                    self._pack(ids[a:b], rows, mirror)
                    busy[h] = batch.submit(a, rows, mirror)
                    if busy[h] is None:  # the batch failed; stop producing
                        break
            finally:
                batch.wait_idle()  # no write may still read the staging buffer we hand back
                self._staging.release(stg)
        except Exception as e:  # the blocks are then logged failed by the commit
            logger.exception("staging a disk store of %d blocks failed", len(hashes))
            batch.abandon(e)
        return batch.finish_async()

    def _load_job(self, ids: np.ndarray, hashes: list[bytes], slots: list[int]) -> bool:
        batch = self.store.begin_read(self.rank, hashes, slots)
        stg = self._staging.acquire()
        try:
            half = stg.rows.shape[0] // 2
            chunks = self._chunks(len(hashes), half)
            busy: list[Future | None] = [None, None]

            def submit(k: int) -> None:
                a, b = chunks[k]
                h = k % 2
                mirror = None if stg.mirror is None else stg.mirror[h * half : h * half + (b - a)]
                busy[h] = batch.submit(a, stg.rows[h * half : h * half + (b - a)], mirror)

            for k in range(min(2, len(chunks))):
                submit(k)
            good = True
            for k, (a, b) in enumerate(chunks):
                fut = busy[k % 2]
                if fut is None or not fut.result():
                    good = False  # a block is missing or corrupt: the job fails, stop early
                    break
                self._unpack(stg.rows[(k % 2) * half : (k % 2) * half + (b - a)], ids[a:b])
                if k + 2 < len(chunks):
                    submit(k + 2)
            ok = batch.finish()  # waits for everything still in flight
            return good and all(ok)
        finally:
            batch.wait_idle()  # no read may still fill the staging buffer we hand back
            self._staging.release(stg)

    def _pack(self, ids: np.ndarray, rows: torch.Tensor, mirror: torch.Tensor | None) -> None:
        pack_blocks(self.tensors, self.layout, ids, rows)
        if mirror is not None:
            mirror.copy_(rows)

    def _unpack(self, rows: torch.Tensor, ids: np.ndarray) -> None:
        unpack_blocks(rows, self.tensors, self.layout, ids)


class CpuDiskHandler(_DiskHandler):
    """CPU-tier slots <-> disk slots (CPU->DISK and DISK->CPU). Register it for both
    pairs: ``worker.register_handler(CPULoadStoreSpec, DiskLoadStoreSpec, h)`` and
    ``worker.register_handler(DiskLoadStoreSpec, CPULoadStoreSpec, h)``.

    ``host`` is the CPU tier's ``HostKVCache`` (or its per-layer tensors)."""

    kinds = ("cpu_to_disk", "disk_to_cpu")
    other_spec = CPULoadStoreSpec

    def __init__(
        self,
        store: BlockStore,
        rank: int,
        host: HostKVCache | Sequence[torch.Tensor],
        layout: KVCacheLayout,
        **kwargs: Any,
    ):
        tensors = host.tensors if isinstance(host, HostKVCache) else host
        super().__init__(store, rank, tensors, layout, **kwargs)
        views = SlotViews(self.tensors, layout)
        self._views = views if store.takes_slots(views) else None  # else: staged

    def _store_job(self, ids: np.ndarray, hashes: list[bytes], slots: list[int]) -> Future:
        if self._views is None:
            return super()._store_job(ids, hashes, slots)
        batch = self.store.begin_write(self.rank, hashes, slots)
        try:
            batch.submit_slots(0, self._views, self._cpu_slots(ids))
        except Exception as e:  # the blocks are then logged failed by the commit
            logger.exception("writing a disk store of %d blocks failed", len(hashes))
            batch.abandon(e)
        # No staging to give back: the job thread is free at once, and the slots are not
        # reused before the job is reported.
        return batch.finish_async()

    def _load_job(self, ids: np.ndarray, hashes: list[bytes], slots: list[int]) -> bool:
        if self._views is None:
            return super()._load_job(ids, hashes, slots)
        batch = self.store.begin_read(self.rank, hashes, slots)
        batch.submit_slots(0, self._views, self._cpu_slots(ids))
        return all(batch.finish())

    def _cpu_slots(self, ids: np.ndarray) -> list[int]:
        return (ids[:, 0] // self.layout.block_size_factor).tolist()

    def _kernel_ids(self, spec: LoadStoreSpec, n: int, store: bool) -> np.ndarray:
        return cpu_kernel_rows(spec_as(spec, CPULoadStoreSpec), n, self.layout.block_size_factor, "disk slots")


class GpuDiskHandler(_DiskHandler):
    """Device KV cache <-> disk slots (GPU->DISK and DISK->GPU), through GDS when the
    store's backend has it for these tensors, else a pinned bounce buffer. With CPU
    tensors (no CUDA) it runs the same bounce path, which is how it is tested on CPU."""

    kinds = ("gpu_to_disk", "disk_to_gpu")
    other_spec = GPULoadStoreSpec

    def __init__(
        self, store: BlockStore, rank: int, gpu_tensors: Sequence[torch.Tensor], layout: KVCacheLayout, **kwargs: Any
    ):
        device = gpu_tensors[0].device if gpu_tensors else torch.device("cpu")
        self.gds = device.type == "cuda" and store.backend.gds
        super().__init__(store, rank, gpu_tensors, layout, staging_device=device if self.gds else None, **kwargs)
        self._stream = TransferStream(device) if device.type == "cuda" else None

    def _kernel_ids(self, spec: LoadStoreSpec, n: int, store: bool) -> np.ndarray:
        assert isinstance(spec, GPULoadStoreSpec)
        skip = spec.skip_count
        if store and skip:
            raise ValueError(
                f"a GPU->DISK store cannot start mid-block (skip_count={skip}); only whole blocks are stored"
            )
        return gpu_kernel_rows(spec, n, self.layout.block_size_factor, "disk blocks")

    def _pack(self, ids: np.ndarray, rows: torch.Tensor, mirror: torch.Tensor | None) -> None:
        if self._stream is None:
            return super()._pack(ids, rows, mirror)
        self._stream.wait_for_compute()  # the KV must be written before we copy it out
        with self._stream.scope():
            super()._pack(ids, rows, mirror)
        self._stream.synchronize()

    def _unpack(self, rows: torch.Tensor, ids: np.ndarray) -> None:
        if self._stream is None:
            return super()._unpack(rows, ids)
        with self._stream.scope():
            super()._unpack(rows, ids)
        self._stream.synchronize()  # the load is done only when the KV is in place


__all__ = ["CpuDiskHandler", "GpuDiskHandler"]
