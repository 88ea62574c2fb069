"""One job's load of blocks on one rank: ``ReadBatch``, every block verified.

Runs wherever a ``DiskStore`` runs: a worker process, or its disk I/O process
(``disk_io: process``). Its I/O: one index read for the blocks' entries, the reads on
the backend's I/O threads (``preadv`` into host views, ``pread`` into device rows),
the checksums on the store's checksum threads, and at ``finish`` one synced index
transaction that drops the blocks found corrupt, missing or unreadable (an I/O error)
and logs them ``corrupt``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial

import lmdb
import torch

from tiered_kv.disk.store.batch import Batch, BatchStore, all_of, view_io, view_runs
from tiered_kv.disk.store.io_backends import aligned_empty

logger = logging.getLogger(__name__)

__all__ = ["ReadBatch"]


class ReadBatch(Batch):
    """One job's load on one rank. ``submit`` chunks of destination rows, then
    ``finish`` once. Each block is verified against the checksum recorded for this
    rank; blocks without a usable entry are not read at all."""

    _writes = False

    def __init__(self, store: BatchStore, rank: int, hashes: list[bytes], slots: list[int]):
        if len(hashes) != len(slots):
            raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots; expected one slot per hash")
        self.store, self.rank, self.hashes, self.slots = store, rank, hashes, slots
        self.ok = [False] * len(hashes)
        self._corrupt: list[int] = []
        self._unreadable: list[int] = []  # blocks of runs the device failed to read
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.expected: list[int | None] = [None] * len(hashes)
        self._error: str | None = None
        try:
            self._file = store.slab(rank, max(slots)) if slots else None
            for i, e in enumerate(store.index.get_many(hashes)):
                if e is not None and e.slot == slots[i] and e.has_rank(rank) and e.size == store.block_bytes:
                    self.expected[i] = e.checksums[rank]
        except (OSError, lmdb.Error, ValueError, RuntimeError) as e:
            self._error = f"{type(e).__name__}: {e}"
        self._missing = [i for i, c in enumerate(self.expected) if c is None] if self._error is None else []

    def submit(self, start: int, rows: torch.Tensor, host_rows: torch.Tensor | None = None) -> Future | None:
        """Read blocks ``start .. start+len(rows)-1`` into ``rows``. For device ``rows``,
        ``host_rows`` receives a host copy to verify. The future's result is True when
        every block of the chunk was read and verified."""
        if self._error is not None or len(rows) == 0:
            return None
        store = self.store
        direct = store.io_rows(self._slab(), rows)
        bounce = direct is None
        buf = aligned_empty(len(rows) * store.slot_size).view(len(rows), store.slot_size) if direct is None else direct
        if bounce:
            host_rows = None
        futs = []
        sums = buf if host_rows is None else host_rows
        for first, lo, n, read, blocks in self._row_runs(start, buf, sums, store.backend.pread, store.backend.preadv):
            # Only read runs of blocks that have an entry to verify against.
            if all(self.expected[first + i] is None for i in range(n)):
                continue
            mirror = None if host_rows is None else partial(host_rows[lo : lo + n].copy_, buf[lo : lo + n])
            unbounce = (
                partial(rows[lo : lo + n, : store.block_bytes].copy_, buf[lo : lo + n, : store.block_bytes])
                if bounce
                else None
            )
            done: Future = Future()
            verify = partial(self._verify, first, blocks, mirror, unbounce)
            store.backend.submit(self._read_then_verify, read, verify, done, range(first, first + n))
            futs.append(done)
        self._futures.extend(futs)
        end = start + len(rows)  # not ``rows``: the callback cycle would keep the caller's memory alive
        return all_of(futs, lambda: all(self.ok[start:end]))

    def submit_views(self, start: int, blocks: Sequence[Sequence[memoryview]]) -> Future | None:
        """Read blocks ``start .. start+len(blocks)-1`` straight into host byte views,
        each block's of ``block_bytes`` in all (``SlotViews.pieces``; only where
        ``views_fit``). The future's result is True when every block of the
        chunk was read and verified; a block that fails leaves its views overwritten."""
        if self._error is not None or not blocks:
            return None
        store = self.store
        futs = []
        for first, n in view_runs(store, self.slots, start, blocks):
            if all(self.expected[first + i] is None for i in range(n)):
                continue
            run = blocks[first - start : first - start + n]
            done: Future = Future()
            read = partial(view_io, store.backend.preadv, self._slab(), run, self.slots[first] * store.slot_size)
            verify = partial(self._verify, first, run)
            store.backend.submit(self._read_then_verify, read, verify, done, range(first, first + n))
            futs.append(done)
        self._futures.extend(futs)
        end = start + len(blocks)
        return all_of(futs, lambda: all(self.ok[start:end]))

    def _all_done(self, futs: list[Future], start: int, end: int) -> Future:
        return all_of(futs, lambda: all(self.ok[start:end]))

    def _read_then_verify(
        self, read: Callable[[], None], verify: Callable[[], None], done: Future, blocks: range
    ) -> None:
        """``read()`` of ``blocks`` on an I/O thread, then hand ``verify()`` to the
        checksum threads, so the I/O thread goes straight back to the device. ``done``
        gets None after. Blocks the device fails to read are dropped at ``finish`` as
        corrupt ones are: served again, they would fail every load that meets them."""
        try:
            read()
        except Exception as e:  # an I/O thread must not lose an error: finish() reports it
            self._record_error(e)
            if isinstance(e, OSError):
                with self._lock:
                    self._unreadable.extend(blocks)
            done.set_result(None)
            return
        try:
            self.store.checksum_async(self._verified, verify, done)
        except RuntimeError as e:  # the store was closed meanwhile
            self._record_error(e)
            done.set_result(None)

    def _verified(self, verify: Callable[[], None], done: Future) -> None:
        try:
            verify()
        except Exception as e:
            self._record_error(e)
        finally:
            done.set_result(None)

    def _verify(
        self,
        first: int,
        run: Sequence[Sequence[memoryview]],
        before: Callable[[], object] | None = None,
        after: Callable[[], object] | None = None,
    ) -> None:
        """Check blocks ``first ..`` (``run``: each block's views), after ``before`` (the
        copy of device rows into the host rows those views show) and then ``after``
        (the copy out of a bounce buffer)."""
        if before is not None:
            before()
        # A block is good if its bytes match the checksum recorded for it; blocks with no
        # usable entry were not read (``_missing``).
        wanted = [first + i for i in range(len(run)) if self.expected[first + i] is not None]
        got = self.store.run_checksums([run[i - first] for i in wanted])
        for i, checksum in zip(wanted, got):
            if checksum == self.expected[i]:
                self.ok[i] = True
            else:
                with self._lock:
                    self._corrupt.append(i)
        if after is not None:
            after()

    def _record_error(self, e: BaseException) -> None:
        with self._lock:
            self._error = self._error or f"{type(e).__name__}: {e}"

    def finish(self) -> list[bool]:
        """Wait for the reads; drop and log blocks that were corrupt or missing."""
        store = self.store
        for f in self._futures:
            f.result()
        bad = sorted(set(self._corrupt) | set(self._missing) | set(self._unreadable))
        if bad:
            for i in self._corrupt:
                logger.error(
                    "disk block %s (rank %d, slot %d) failed its checksum; dropping it",
                    self.hashes[i].hex()[:16],
                    self.rank,
                    self.slots[i],
                )
            if self._unreadable:
                logger.error(
                    "%d disk blocks on rank %d could not be read (%s); dropping them",
                    len(self._unreadable),
                    self.rank,
                    self._error,
                )
            try:
                store.index.drop_corrupt(self.rank, [(self.hashes[i], self.slots[i]) for i in bad])
            except lmdb.Error as e:
                logger.error("could not drop %d corrupt blocks from the index: %s", len(bad), e)
        if self._error is not None:
            logger.warning("disk load of %d blocks on rank %d failed: %s", len(self.ok), self.rank, self._error)
            self.ok = [False] * len(self.ok)
        n_ok = sum(self.ok)
        store.count(
            loads=n_ok,
            load_failures=len(self.ok) - n_ok,
            checksum_failures=len(self._corrupt),
            missing_entries=len(self._missing),
            bytes_read=n_ok * store.block_bytes,
        )
        self.seconds = time.perf_counter() - self._t0
        return list(self.ok)
