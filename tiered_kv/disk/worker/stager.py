"""``DiskStager``: the disk tier's writes from CPU slots, in a worker process.

Runs in each worker process (one per TP rank), on its own threads: a packer thread
copies CPU slots into staging buffers (memcpy), and one writer thread writes whatever
is staged when it wakes as one write batch to this rank's slab (``BlockStore``: the
worker's ``DiskStore``, or its disk I/O process), so many store jobs share one
``fdatasync`` and one index commit. A disk write never reads a CPU slot after staging,
so the manager may reuse the slot as soon as the store job that carried the write is
reported; the block becomes loadable from disk when this rank's index commit (after
the data is durable) is seen by the scheduler's disk manager. Staging memory is bounded;
a write that finds none is dropped, recorded as failed in the index log and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from tiered_kv.abstract import Closing
from tiered_kv.disk.store.block_store import BlockStore
from tiered_kv.memory.host_memory import HostKVCache, pack_blocks
from tiered_kv.metrics import TieredStats
from tiered_kv.mediums import TierWrites

logger = logging.getLogger(__name__)


class _Staged(NamedTuple):
    """Packed blocks waiting for the disk writer."""

    hashes: list
    tier_slots: list
    rows: torch.Tensor
    buf: torch.Tensor


class DiskStager(Closing):
    """Stage CPU slots into aligned buffers and write them to disk for one rank.

    ``store`` is this process's ``DiskStore``; ``capacity_blocks`` bounds staging memory
    (blocks waiting for their disk write on this rank). One writer thread writes
    whatever is staged when it wakes as one write batch, so many store jobs share one
    ``fdatasync`` and one index commit, and goes on with the next while it commits.
    ``synchronous=True`` stages and writes on the caller's thread instead (a replay that
    must behave the same every time, as a property test needs).
    """

    def __init__(
        self,
        host: HostKVCache,
        store: BlockStore,
        rank: int,
        capacity_blocks: int,
        stats: TieredStats,
        synchronous: bool = False,
        tier_name: str = "disk",
    ):
        self.host = host
        #: The lower tier this stager writes: names its stats and transfer type.
        self.tier_name = tier_name
        self.store = store
        self.rank = rank
        self.stats = stats
        self.slot_size = store.slot_size
        self.synchronous = synchronous
        self._budget = capacity_blocks
        self._cached: list[torch.Tensor] = []  # free staging buffers, reused by size
        self._allocated_rows = 0
        self._lock = threading.Lock()
        self._queue: deque[_Staged] = deque()
        self._wake = threading.Condition(self._lock)
        self._writing = False
        self._committing = 0  # write batches whose commit is still in flight
        self._closed = False
        self._packer = None if synchronous else ThreadPoolExecutor(1, thread_name_prefix="tiered-kv-stage")
        self._writer = None
        if not synchronous:
            self._writer = threading.Thread(target=self._write_loop, name="tiered-kv-diskwrite", daemon=True)
            self._writer.start()

    def _take_buffer(self, rows: int) -> torch.Tensor | None:
        with self._lock:
            fitting = [i for i, b in enumerate(self._cached) if b.shape[0] >= rows]
            if fitting:
                # Tensors compare element-wise, so pick by position, never by value.
                return self._cached.pop(min(fitting, key=lambda i: self._cached[i].shape[0]))
            while self._cached and self._allocated_rows + rows > self._budget:
                self._allocated_rows -= self._cached.pop().shape[0]
            if self._allocated_rows + rows > self._budget:
                return None
            self._allocated_rows += rows
        try:
            return self.store.host_buffer(rows * self.slot_size).view(rows, self.slot_size)
        except BaseException:  # not allocated after all: the budget gets its rows back
            with self._lock:
                self._allocated_rows -= rows
            raise

    def stage(self, writes: TierWrites) -> Future[None]:
        """Start copying ``writes``' CPU slots out; the returned future is done once the
        slots may be overwritten (copied, or dropped for lack of staging memory). The
        disk write itself continues in the background."""
        if self._packer is None:
            self._stage(writes)
            future: Future[None] = Future()
            future.set_result(None)
            return future
        return self._packer.submit(self._stage, writes)

    def abandon(self, writes: TierWrites) -> None:
        """``writes`` will never be staged: log them failed, so the manager frees their
        slots (it waits for every rank's outcome before reusing one)."""
        self.stats.count(self.tier_name, "drops", len(writes))
        self._record_failed(writes.block_hashes, writes.tier_slots.tolist())

    def _stage(self, writes: TierWrites) -> None:
        hashes = writes.block_hashes
        tier_slots = writes.tier_slots.tolist()
        try:
            buf = self._take_buffer(len(writes))
        except Exception:  # memfd, mmap or pinning refused: as for a full staging area
            logger.exception("%s staging memory could not be had on rank %d", self.tier_name, self.rank)
            buf = None
        if buf is None:
            logger.warning("%s staging full: dropping %d writes on rank %d", self.tier_name, len(writes), self.rank)
            self.stats.count(self.tier_name, "drops", len(writes))
            self._record_failed(hashes, tier_slots)
            return
        rows = buf[: len(writes)]
        try:
            kernel_ids = self.host.kernel_ids(writes.cpu_slots)
            pack_blocks(self.host.tensors, self.host.layout, kernel_ids, rows)
        except Exception:
            logger.exception("staging %d disk writes failed on rank %d; dropping them", len(writes), self.rank)
            with self._lock:
                self._cached.append(buf)
            self.stats.count(self.tier_name, "drops", len(writes))
            self._record_failed(hashes, tier_slots)
            return
        staged = _Staged(hashes, tier_slots, rows, buf)
        if self.synchronous:
            self._write([staged])
            return
        with self._wake:
            self._queue.append(staged)
            self._wake.notify()

    def _record_failed(self, hashes: list, tier_slots: list) -> None:
        """Tell the manager (through the index log) that these writes will not happen."""
        try:
            self.store.log_failed(self.rank, hashes, tier_slots)
        except Exception:
            logger.exception("could not record %d dropped disk writes in the index", len(hashes))

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
                self._writing = True
            try:
                self._write(batch)
            finally:
                with self._wake:
                    self._writing = False
                    self._wake.notify_all()

    def _write(self, staged: list[_Staged]) -> None:
        """One write batch for every staged job. The writer moves on once the writes are
        done (the buffers are free again); the batch's ``fdatasync`` and index commit
        then overlap the next batch's writes, and settle its outcome."""
        hashes = [h for s in staged for h in s.hashes]
        tier_slots = [d for s in staged for d in s.tier_slots]
        start = time.perf_counter()
        try:
            batch = self.store.begin_write(self.rank, hashes, tier_slots)
        except Exception:  # the store reports faults itself; this is a last resort
            logger.exception("disk write of %d blocks failed on rank %d", len(hashes), self.rank)
            self._record_failed(hashes, tier_slots)
            self._release(staged)
            self._committed(hashes, tier_slots, start, None)
            return
        try:
            first = 0
            for s in staged:
                batch.submit(first, s.rows)
                first += len(s.hashes)
        except Exception as e:
            logger.exception("disk write of %d blocks failed on rank %d", len(hashes), self.rank)
            batch.abandon(e)
        finally:
            batch.wait_idle()
            self._release(staged)
        with self._lock:
            self._committing += 1
        done = batch.finish_async()
        done.add_done_callback(lambda f: self._committed(hashes, tier_slots, start, f))
        if self.synchronous:
            done.result()

    def _release(self, staged: list[_Staged]) -> None:
        with self._lock:
            self._cached.extend(s.buf for s in staged)

    def _committed(self, hashes: list, tier_slots: list, start: float, done: Future | None) -> None:
        n = len(hashes)
        if done is not None and done.exception() is not None:  # the store could not say: log them failed
            logger.error("committing %d disk writes failed on rank %d: %s", n, self.rank, done.exception())
            self._record_failed(hashes, tier_slots)
        ok = done is not None and done.exception() is None and all(done.result())
        self.stats.record_transfer(
            f"cpu_to_{self.tier_name}", n * self.host.layout.bytes_per_block, time.perf_counter() - start, success=ok
        )
        if not ok:
            self.stats.count(self.tier_name, "failed_stores", n)
        if done is not None:
            with self._wake:
                self._committing -= 1
                self._wake.notify_all()

    def drain(self) -> None:
        """Block until every staged write has reached the disk (or failed)."""
        if self._packer is not None:
            self._packer.submit(lambda: None).result()
        with self._wake:
            while self._queue or self._writing or self._committing:
                self._wake.wait()

    def shutdown(self) -> None:
        self.drain()
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._packer is not None:
            self._packer.shutdown(wait=True)
        if self._writer is not None:
            self._writer.join()


__all__ = ["DiskStager"]
