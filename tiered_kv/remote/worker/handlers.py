"""Worker side of the shared tier: uploads from CPU slots, downloads into CPU slots or the GPU.

Runs in each worker process (one per TP rank), over that process's own ``RemoteStore``
(opened after any fork). All object-store I/O happens on the store's threads; the
pieces here only copy bytes between KV tensors and host buffers, on threads of their
own, so no call made by the composite's handlers waits on the network.

- ``RemoteStager`` (the shared tier's ``Stager``): copies the CPU slots of a store's
  spills and write-through copies into a host buffer (the future ``stage`` returns is
  done then, so the slots may be reused at once) and hands the buffer to
  ``RemoteStore.put_blocks``. At most ``budget_bytes`` of such buffers exist at once:
  a write that finds no room is dropped and counted (``drops``), never waited for.
  The scheduler learns what landed from the bucket itself (``RemoteOffloadingManager``
  probes its pending blocks); nothing is reported back from here.
- ``RemoteLoadHandler`` (remote -> CPU slots, or remote -> GPU): downloads a job's
  blocks into a host bounce buffer, a chunk at a time; the store verifies each object's
  header and checksum before writing any byte of it there, and a chunk is copied into
  the CPU slots or the device KV cache only when every block of it verified. A missing,
  foreign, damaged or unreachable object fails the job (a miss: the engine
  recomputes), never raises.

Transfer types are named after the tier (``cpu_to_remote``, ``remote_to_cpu``,
``remote_to_gpu``) in the shared ``TieredStats``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import numpy as np
import torch

from tiered_kv.abstract import Closing, LoadStoreSpec
from tiered_kv.memory.device import can_pin_memory
from tiered_kv.memory.host_memory import HostKVCache, pack_blocks, unpack_blocks
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec, spec_as
from tiered_kv.metrics import TieredStats
from tiered_kv.remote.store.outcomes import PutOutcome
from tiered_kv.remote.store.store import RemoteStore
from tiered_kv.mediums import TierWrites
from tiered_kv.worker.jobs import ThreadedHandler, cpu_kernel_rows, gpu_kernel_rows
from tiered_kv.worker.worker import TransferSpec

logger = logging.getLogger(__name__)

#: Host bounce memory per download chunk.
DEFAULT_CHUNK_BYTES = 64 << 20
#: A wait on a store future that cannot outlast the store's own request bounds; a guard
#: against a bug, never reached by a slow server.
_GUARD_SECONDS = 600.0


class RemoteStager(Closing):
    """Copies CPU slots out and uploads them for rank ``rank`` (see module docstring).

    ``host``: the CPU tier; ``store``: this process's ``RemoteStore``; ``budget_bytes``:
    host memory of writes staged and not yet uploaded."""

    def __init__(
        self,
        host: HostKVCache,
        store: RemoteStore,
        rank: int,
        budget_bytes: int,
        stats: TieredStats,
        tier_name: str = "remote",
    ):
        self.host = host
        self.store = store
        self.rank = rank
        self.budget_bytes = int(budget_bytes)
        self.stats = stats
        self.tier_name = tier_name
        self.bytes_per_block = host.layout.bytes_per_block
        self._lock = threading.Condition()
        self._staged_bytes = 0
        self._uploads = 0  # put_blocks batches not yet done
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="tkv-remote-stage")
        self._closed = False

    def stage(self, writes: TierWrites) -> Future[None]:
        """Start copying ``writes``' CPU slots out; the future is done
        once those slots may be overwritten (copied, or the writes dropped)."""
        return self._packer.submit(self._stage, writes)

    def abandon(self, writes: TierWrites) -> None:
        """``writes`` will never be staged: counted as dropped (the shared tier's
        manager learns outcomes from its jobs, and reserves no slot)."""
        self.stats.count(self.tier_name, "drops", len(writes))

    def _drop(self, n: int, why: str) -> None:
        logger.warning("%s tier: dropping %d uploads on rank %d (%s)", self.tier_name, n, self.rank, why)
        self.stats.count(self.tier_name, "drops", n)

    def _stage(self, writes: TierWrites) -> None:
        n = len(writes)
        if not n:
            return
        nbytes = n * self.bytes_per_block
        with self._lock:
            # A batch larger than the budget still goes when nothing else is staged.
            if self._staged_bytes and self._staged_bytes + nbytes > self.budget_bytes:
                self._drop(n, f"{self._staged_bytes} bytes already waiting to upload")
                return
            self._staged_bytes += nbytes
            self._uploads += 1
        start = time.perf_counter()
        try:
            rows = torch.empty((n, self.bytes_per_block), dtype=torch.uint8)
            pack_blocks(self.host.tensors, self.host.layout, self.host.kernel_ids(writes.cpu_slots), rows)
            array = rows.numpy()
            future = self.store.put_blocks([(h, self.rank, array[i]) for i, h in enumerate(writes.block_hashes)])
        except Exception:
            logger.exception("%s tier: staging %d uploads failed on rank %d", self.tier_name, n, self.rank)
            self.stats.count(self.tier_name, "drops", n)
            self._settled(nbytes)
            return
        # ``rows`` stays referenced by the callback until the upload is done.
        future.add_done_callback(partial(self._uploaded, n=n, nbytes=nbytes, start=start, _rows=rows))

    def _uploaded(self, future: Future, n: int, nbytes: int, start: float, _rows: torch.Tensor) -> None:
        try:
            outcomes = future.result()
        except Exception:
            logger.exception("%s tier: an upload batch of %d blocks raised", self.tier_name, n)
            outcomes = [PutOutcome.FAILED] * n
        durable = sum(o.durable for o in outcomes)
        dropped = sum(o is PutOutcome.DROPPED for o in outcomes)
        self.stats.count(self.tier_name, "drops", dropped)
        self.stats.count(self.tier_name, "failed_stores", n - durable - dropped)
        self.stats.record_transfer(
            f"cpu_to_{self.tier_name}",
            durable * self.bytes_per_block,
            time.perf_counter() - start,
            success=durable == n,
            blocks=durable,
        )
        self._settled(nbytes)

    def _settled(self, nbytes: int) -> None:
        with self._lock:
            self._staged_bytes -= nbytes
            self._uploads -= 1
            self._lock.notify_all()

    @property
    def staged_bytes(self) -> int:
        return self._staged_bytes

    def drain(self) -> None:
        """Block until every staged upload has landed or failed (each bounded by the
        store's request timeouts)."""
        if not self._closed:
            self._packer.submit(lambda: None).result()
        with self._lock:
            self._lock.wait_for(lambda: self._uploads == 0, timeout=_GUARD_SECONDS)

    def shutdown(self) -> None:
        if self._closed:
            return
        self.drain()
        self._closed = True
        self._packer.shutdown(wait=True)


class RemoteLoadHandler(ThreadedHandler):
    """Shared tier -> CPU slots (``to_gpu=False``) or -> device KV cache (``to_gpu=True``).

    Takes ``(spec with block_hashes, CPULoadStoreSpec | GPULoadStoreSpec)`` jobs (the
    composite hands a ``DiskLoadStoreSpec`` whose slot ids mean nothing here). ``tensors``
    are the CPU tier's tensors or the device's; ``layout`` is one rank's KV layout."""

    def __init__(
        self,
        store: RemoteStore,
        rank: int,
        tensors: Sequence[torch.Tensor],
        layout: KVCacheLayout,
        *,
        to_gpu: bool,
        tier_name: str = "remote",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        if not 0 <= rank < store.tp_size:
            raise ValueError(f"rank {rank} is out of range for the shared tier's tp_size {store.tp_size}")
        self.store, self.rank, self.layout = store, rank, layout
        self.tensors = list(tensors)
        self.to_gpu = to_gpu
        self.kind = f"{tier_name}_to_{'gpu' if to_gpu else 'cpu'}"
        self.stats = TieredStats()  # this handler's transfers
        self._dst_type = GPULoadStoreSpec if to_gpu else CPULoadStoreSpec
        self._rows = max(1, chunk_bytes // layout.bytes_per_block)
        self._device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self._bounce: torch.Tensor | None = None  # one job thread: one buffer
        super().__init__(1, f"tkv-{self.kind}")

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        try:
            hashes = getattr(src, "block_hashes", None)
            if hashes is None or not isinstance(dst, self._dst_type):
                raise ValueError(f"{self.kind} cannot transfer {type(src).__name__} -> {type(dst).__name__}")
            ids = self._kernel_ids(dst, len(hashes))
        except ValueError as e:
            logger.error("rejecting %s job %d: %s", self.kind, job_id, e)
            return False
        return self._submit(job_id, self._run, job_id, [bytes(h) for h in hashes], ids)

    def _kernel_ids(self, dst: LoadStoreSpec, n: int) -> np.ndarray:
        f = self.layout.block_size_factor
        if self.to_gpu:
            return gpu_kernel_rows(spec_as(dst, GPULoadStoreSpec), n, f)
        return cpu_kernel_rows(spec_as(dst, CPULoadStoreSpec), n, f)

    def _buffer(self) -> torch.Tensor:
        if self._bounce is None:
            shape = (self._rows, self.layout.bytes_per_block)
            pin = self._device.type == "cuda" and can_pin_memory()
            try:
                self._bounce = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
            except RuntimeError:
                self._bounce = torch.empty(shape, dtype=torch.uint8)
        return self._bounce

    def _run(self, job_id: int, hashes: list[bytes], ids: np.ndarray) -> None:
        start = time.perf_counter()
        ok = False
        try:
            ok = self._load(hashes, ids)
        except Exception:
            logger.exception("%s job %d (%d blocks) failed", self.kind, job_id, len(hashes))
        seconds = time.perf_counter() - start
        nbytes = len(hashes) * self.layout.bytes_per_block
        self.stats.record_transfer(self.kind, nbytes, seconds, success=ok, blocks=len(hashes))
        self._finish(job_id, ok, seconds, nbytes)

    def _load(self, hashes: list[bytes], ids: np.ndarray) -> bool:
        bounce = self._buffer()
        array = bounce.numpy()
        for a in range(0, len(hashes), self._rows):
            chunk = hashes[a : a + self._rows]
            got = self.store.get_blocks([(h, self.rank, array[i]) for i, h in enumerate(chunk)])
            if not all(got.result(_GUARD_SECONDS)):
                return False  # a miss: nothing of this chunk reaches the destination
            unpack_blocks(bounce[: len(chunk)], self.tensors, self.layout, ids[a : a + len(chunk)])
            if self._device.type == "cuda":
                torch.cuda.current_stream(self._device).synchronize()  # the KV is in place
        return True


__all__ = ["RemoteLoadHandler", "RemoteStager"]
