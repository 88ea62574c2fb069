"""One job's store of blocks on one rank: ``WriteBatch`` (steps 1-3 of ``store.py``).

Runs wherever a ``DiskStore`` runs: a worker process, or its disk I/O process
(``disk_io: process``). Its I/O: step 1 and step 3 go through the store's group commit
(``group_commit.py``: ``fdatasync`` and synced LMDB transactions on the committer
thread); the block writes run on the backend's I/O threads (``pwritev`` of host views,
``pwrite`` of device rows), their checksums on the store's checksum threads. The
thread that submits only packs rows and waits for step 1 before its first write.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from functools import partial

import lmdb
import torch

from tiered_kv.disk.store.batch import Batch, BatchStore, all_of, view_io, view_runs
from tiered_kv.disk.store.group_commit import IndexWrite
from tiered_kv.disk.store.io_backends import BackendFile, aligned_empty
from tiered_kv.disk.store.io_pool import WRITE

logger = logging.getLogger(__name__)

__all__ = ["WriteBatch"]


class WriteBatch(Batch):
    """One job's store on one rank. ``submit`` chunks of packed rows (any order, each
    block once), then ``finish`` once. Thread-safe for one producer."""

    _writes = True

    def __init__(self, store: BatchStore, rank: int, hashes: list[bytes], slots: list[int]):
        if len(hashes) != len(slots):
            raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots; expected one slot per hash")
        if store.readonly:
            raise RuntimeError("the disk store was opened read-only")
        self.store, self.rank, self.hashes, self.slots = store, rank, hashes, slots
        self.checksums: list[int | None] = [None] * len(hashes)
        self._futures: list[Future] = []
        self._error: str | None = None
        self._enospc = False
        self._t0 = time.perf_counter()
        self._file: BackendFile | None = None
        self._clearing: IndexWrite | None = None  # step 1, committed before the first write
        try:
            self._file = store.slab(rank, max(slots)) if slots else None
            if slots and store.index.needs_clearing(rank, hashes, slots):
                self._clearing = store.queue_clear(rank, hashes, slots)
        except (OSError, lmdb.Error, ValueError, RuntimeError) as e:
            self._fail(e)
        self._cleared = self._clearing is None

    def _fail(self, e: BaseException) -> None:
        if self._error is None:
            self._error = f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            self._enospc = True

    def submit(self, start: int, rows: torch.Tensor, host_rows: torch.Tensor | None = None) -> Future | None:
        """Write blocks ``start .. start+len(rows)-1`` from ``rows`` (uint8
        ``(n, >= block_bytes)``). ``host_rows``: a host copy of device ``rows`` for the
        checksum. Returns a future that completes when ``rows`` may be reused (None if
        the batch already failed)."""
        if not self._may_write(len(rows)):
            return None
        store = self.store
        buf = store.io_rows(self._slab(), rows)
        if buf is None:  # wrong stride, misaligned or device memory: bounce through host
            buf = aligned_empty(len(rows) * store.slot_size).view(len(rows), store.slot_size)
            buf[:, : store.block_bytes].copy_(rows[:, : store.block_bytes])
            host_rows = None
        sums = buf if host_rows is None else host_rows
        runs = self._row_runs(start, buf, sums, store.backend.pwrite, store.backend.pwritev)
        return self._write_runs((first, write, blocks) for first, _, _, write, blocks in runs)

    def submit_views(self, start: int, blocks: Sequence[Sequence[memoryview]]) -> Future | None:
        """Write blocks ``start .. start+len(blocks)-1``, each given as host byte views
        of ``block_bytes`` in all (``SlotViews.pieces``), straight from that memory
        (only where ``views_fit``). Returns a future that completes when the
        views may change again (None if the batch already failed)."""
        if not self._may_write(len(blocks)):
            return None
        store, slab = self.store, self._slab()

        def runs() -> Iterator[tuple[int, Callable[[], None], Sequence[Sequence[memoryview]]]]:
            for first, n in view_runs(store, self.slots, start, blocks):
                run = blocks[first - start : first - start + n]
                yield (
                    first,
                    partial(view_io, store.backend.pwritev, slab, run, self.slots[first] * store.slot_size),
                    run,
                )

        return self._write_runs(runs())

    def _write_runs(self, runs: Iterable[tuple[int, Callable[[], None], Sequence[Sequence[memoryview]]]]) -> Future:
        """For each ``(first block, write, its blocks' views)``: the write on the
        backend's pool and the run's checksums on the store's checksum threads, so the
        device keeps the whole queue depth while the checksums run beside it. Returns
        a future done once both are, for every run."""
        store = self.store
        futs = []
        for first, write, run in runs:
            futs.append(store.backend.submit(self._write, write, priority=WRITE))
            futs.append(store.checksum_async(self._checksum_run, first, run))
        self._futures.extend(futs)
        return all_of(futs)

    def _may_write(self, n: int) -> bool:
        """Before a chunk of ``n`` blocks: wait for step 1 (the first time); whether to go on."""
        if not self._cleared and self._clearing is not None:
            self._settle_clearing(self._clearing.wait())
        return self._error is None and n > 0

    def _write(self, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception as e:  # an I/O thread must not lose an error: finish() reports it
            self._fail(e)

    def _checksum_run(self, first: int, run: Sequence[Sequence[memoryview]]) -> None:
        """Record the checksums of blocks ``first ..`` (``run``: each block's views)."""
        try:
            self.checksums[first : first + len(run)] = self.store.run_checksums(run)
        except Exception as e:
            self._fail(e)

    def abandon(self, e: BaseException) -> None:
        """Fail the batch (its producer hit ``e``); ``finish`` then logs every block failed."""
        self._fail(e)

    _record_error = _fail

    def finish(self) -> list[bool]:
        """Wait for the writes, make them durable, commit the index (both shared with
        concurrent jobs, see ``store.py``'s docstring); per-block success."""
        return self.finish_async().result()

    def finish_async(self) -> "Future[list[bool]]":
        """``finish`` without waiting: the returned future gets the per-block success
        once the writes are durable and committed (or failed). The caller's thread is
        free for its next job meanwhile; call it once every chunk was submitted."""
        out: Future = Future()
        waits = list(self._futures)
        if self._clearing is not None:
            waits.append(self._clearing.done)
        all_of(waits).add_done_callback(lambda _: self._commit(out))
        return out

    def _settle_clearing(self, clearing: "IndexWrite") -> None:
        self._cleared = True
        if clearing.error is not None:
            self._fail(clearing.error)  # its slots must be neither written nor committed

    def _commit(self, out: Future) -> None:
        """Queue step 3 (all writes are done); ``out`` gets the outcome from the committer."""
        try:
            if not self._cleared and self._clearing is not None:
                self._settle_clearing(self._clearing)
            if self._error is not None or self._file is None:
                self.checksums = [None] * len(self.hashes)
            if not self.hashes:
                out.set_result(self._settle([]))
                return
            req = self.store.queue_commit(self.rank, self._file, self.hashes, self.slots, self.checksums)
            req.done.add_done_callback(lambda _: self._resolve(out, req))
        except BaseException as e:  # the caller must always get an outcome
            out.set_exception(e)

    def _resolve(self, out: Future, req: "IndexWrite") -> None:
        try:
            if req.error is not None:
                self._fail(req.error)
            self.checksums = list(req.checksums)
            out.set_result(self._settle([req.committed and c is not None for c in self.checksums]))
        except BaseException as e:
            out.set_exception(e)

    def _settle(self, ok: list[bool]) -> list[bool]:
        """Log and count the outcome."""
        store = self.store
        n_ok = sum(ok)
        if n_ok < len(ok):
            logger.warning(
                "disk store of %d blocks on rank %d: %d failed (%s)",
                len(ok),
                self.rank,
                len(ok) - n_ok,
                self._error or "unknown error",
            )
        store.count(
            stores=n_ok, store_failures=len(ok) - n_ok, enospc=int(self._enospc), bytes_written=n_ok * store.block_bytes
        )
        self.seconds = time.perf_counter() - self._t0
        return ok
