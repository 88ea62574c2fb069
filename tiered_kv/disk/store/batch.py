"""What a disk store's write and read batches share (``write_batch.py``, ``read_batch.py``).

Runs wherever a ``DiskStore`` runs: a worker process, or its disk I/O process
(``disk_io: process``), never a scheduler thread. Nothing here does I/O on the calling
thread: it plans runs of consecutive slots, makes byte views of rows, and hands the
vectored calls to the store's backend, whose I/O threads read and write the slab files;
CPU-tier slots that cannot move in place go through the store's pack buffers.
``BatchStore`` names what a batch needs of its store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Protocol

import torch

from tiered_kv.disk.store.checksums import RunChecksums
from tiered_kv.disk.store.group_commit import IndexWrite
from tiered_kv.disk.format.index import DiskIndex
from tiered_kv.disk.store.io_backends import ALIGN, IOV_MAX, MAX_IO_BYTES, BackendFile, IOBackend, host_view
from tiered_kv.memory.slot_views import SlotViews

__all__ = ["Batch", "BatchStore", "all_of", "block_views", "runs", "view_io", "view_runs", "views_fit"]

#: Slots whose pieces are too small to move in place are packed this many bytes at a
#: time (the store lends at most ``PACK_BUFFERS`` such buffers, ``store.py``).
PACK_CHUNK_BYTES = 8 << 20
#: Smallest piece worth a vectored transfer: with 8 KiB pieces (64 per 0.5 MiB block)
#: the device moved less than through one staging copy.
MIN_VIEW_PIECE = 32 << 10


class BatchStore(Protocol):
    """What a batch needs of its store (``DiskStore``): the namespace's geometry, its
    index, backend and checksums, and what the store lends its batches."""

    block_bytes: int
    slot_size: int
    readonly: bool
    index: DiskIndex
    backend: IOBackend
    run_checksums: RunChecksums

    def slab(self, rank: int, max_slot: int) -> BackendFile:
        """Rank ``rank``'s slab, opened (and preallocated) up to ``max_slot``."""
        ...

    def io_rows(self, f: BackendFile, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` itself when it can go to the backend as is, else None (bounce it)."""
        ...

    def take_pack_buffer(self) -> torch.Tensor:
        """A free ``(chunk, slot_size)`` pack buffer (waits while every one is in use)."""
        ...

    def give_pack_buffer(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``take_pack_buffer``."""
        ...

    def checksum_async(self, fn: Callable[..., None], *args: object) -> Future:
        """Run ``fn(*args)`` on the store's checksum threads."""
        ...

    def queue_clear(self, rank: int, hashes: list[bytes], slots: list[int]) -> IndexWrite:
        """Queue step 1 of a store (``GroupCommitter.clear``)."""
        ...

    def queue_commit(
        self, rank: int, file: BackendFile | None, hashes: list[bytes], slots: list[int], checksums: list[int | None]
    ) -> IndexWrite:
        """Queue step 3 of a store (``GroupCommitter.commit``)."""
        ...

    def count(self, **deltas: int) -> None:
        """Add ``deltas`` to the store's ``DiskStoreStats``."""
        ...


def views_fit(views: SlotViews, slot_size: int) -> bool:
    """Whether ``views``' slots move straight to and from ``slot_size``-byte disk slots
    (vectored I/O, any backend): pieces aligned for O_DIRECT (so a block fills its slot
    exactly: there is no padding to write) and of at least ``MIN_VIEW_PIECE`` each (so a
    block's call has few buffers: 64 at 2 MiB; smaller pieces moved slower than packed
    runs)."""
    return views.aligned(ALIGN) and views.slot_bytes == slot_size and views.smallest_piece >= MIN_VIEW_PIECE


def runs(slots: Sequence[int], start: int, count: int, per_run: int) -> list[tuple[int, int]]:
    """``(first, n)`` runs of blocks ``start .. start+count-1`` whose slots are
    consecutive, each at most ``per_run`` blocks."""
    out = []
    i, end = start, start + count
    while i < end:
        j = i + 1
        while j < end and j - i < per_run and slots[j] == slots[j - 1] + 1:
            j += 1
        out.append((i, j - i))
        i = j
    return out


def block_views(rows: torch.Tensor, block_bytes: int) -> list[list[memoryview]]:
    """The first ``block_bytes`` of each row of ``rows`` (a contiguous host uint8
    ``(n, stride)`` tensor), as one-piece blocks for the batches' checksums.

    The batches hand their worker threads byte views made on the submitting thread, never
    tensors: every torch call releases the GIL and takes it back, and taking it back
    waits behind any thread running Python, up to the interpreter's 5 ms switch interval
    (a 3 us ``reshape`` took 1.4 ms beside one busy thread: tools/bench_gil_handoff.py).
    """
    view, stride = host_view(rows), rows.shape[1]
    return [[view[i : i + block_bytes]] for i in range(0, len(rows) * stride, stride)]


def view_runs(
    store: "BatchStore", slots: Sequence[int], start: int, blocks: Sequence[Sequence[memoryview]]
) -> list[tuple[int, int]]:
    """``runs`` for blocks given as views, after checking each block's size."""
    for pieces in blocks:
        if sum(map(len, pieces)) != store.block_bytes:
            raise ValueError(f"a block's views hold {sum(map(len, pieces))} bytes; expected {store.block_bytes}")
    return runs(slots, start, len(blocks), max(1, MAX_IO_BYTES // store.slot_size))


def view_io(
    call: Callable[[BackendFile, list[memoryview], int], None],
    f: BackendFile,
    run: Sequence[Sequence[memoryview]],
    offset: int,
) -> None:
    """``call`` (the backend's ``preadv``/``pwritev``) over the views of ``run`` (blocks
    in consecutive slots from ``offset``): one call, as on the row path, unless it
    has more than ``IOV_MAX`` views. A block larger than ``MAX_IO_BYTES`` is not split
    either: four 2 MiB calls one after another on one I/O thread keep a quarter of
    the bytes in flight that one call does."""
    iovecs = [v for pieces in run for v in pieces]
    for first in range(0, len(iovecs), IOV_MAX):
        views = iovecs[first : first + IOV_MAX]
        call(f, views, offset)
        offset += sum(map(len, views))


def all_of(futs: list[Future], result: Callable[[], object] | None = None) -> Future:
    """A future done when all of ``futs`` are (with ``result()`` as its value)."""
    out: Future = Future()
    remaining = [len(futs)]
    lock = threading.Lock()

    def done(_f: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            out.set_result(result() if result else None)

    if not futs:
        out.set_result(result() if result else None)
    for f in futs:
        f.add_done_callback(done)
    return out


class Batch(ABC):
    """What write and read batches share: their store, rank file and slots, and the
    I/O futures submitted so far. A ``BlockBatch`` (``tiered_kv.disk.store.block_store``)."""

    @abstractmethod
    def submit(self, start: int, rows: torch.Tensor, host_rows: torch.Tensor | None = None) -> Future | None:
        """Write (or read into) blocks ``start ..`` from ``rows``."""

    @abstractmethod
    def submit_views(self, start: int, blocks: Sequence[Sequence[memoryview]]) -> Future | None:
        """Write (or read into) blocks ``start ..`` straight from/to their byte views."""

    store: BatchStore
    slots: list[int]
    _file: BackendFile | None
    _futures: list[Future]
    _error: str | None

    def wait_idle(self) -> None:
        """Wait until no submitted I/O still uses its rows (errors are kept for ``finish``)."""
        for f in self._futures:
            f.exception()

    def submit_slots(self, start: int, views: SlotViews, slots: Sequence[int]) -> Future | None:
        """Move CPU-tier slots ``slots`` (blocks ``start ..``, the host cache's
        ``views``): straight from/to their pieces (``submit_views``) where those fit
        vectored O_DIRECT I/O (``views_fit``), else through the store's pack buffers,
        ``PACK_CHUNK_BYTES`` at a time: packed on this thread while the chunk before is
        written (or read, verified, then unpacked). Returns what ``submit_views`` does."""
        if views_fit(views, self.store.slot_size):
            return self.submit_views(start, [views.pieces(s) for s in slots])
        slots = [int(s) for s in slots]
        per_chunk = max(1, PACK_CHUNK_BYTES // self.store.slot_size)
        futs = []
        for a in range(0, len(slots), per_chunk):
            fut = self._submit_packed(start + a, views, slots[a : a + per_chunk])
            if fut is None:
                break
            futs.append(fut)
        return self._all_done(futs, start, start + len(slots))

    def _slab(self) -> BackendFile:
        """The slab file the batch moves its blocks through (a batch of no blocks has none)."""
        if self._file is None:
            raise ValueError(f"no slab file to move blocks through ({self._error or 'the batch has no blocks'})")
        return self._file

    def _row_runs(
        self,
        start: int,
        buf: torch.Tensor,
        sums: torch.Tensor,
        tensor_io: Callable[[BackendFile, torch.Tensor, int], None],
        view_io: Callable[[BackendFile, list[memoryview], int], None],
    ) -> Iterator[tuple[int, int, int, Callable[[], None], list[list[memoryview]]]]:
        """The runs of consecutive slots among blocks ``start ..`` held in the rows of
        ``buf``, as ``(first block, first row, n, io, blocks)``: ``io()`` moves the run
        (``view_io`` on a byte view of host rows, ``tensor_io`` on device rows) and
        ``blocks`` are its blocks' views in ``sums`` (host rows holding the same bytes)."""
        if sums.device.type != "cpu":
            raise ValueError("device rows need host rows for their checksums")
        slot, f = self.store.slot_size, self._slab()
        blocks = block_views(sums, self.store.block_bytes)
        data = host_view(buf) if buf.device.type == "cpu" else None
        for first, n in runs(self.slots, start, len(buf), max(1, MAX_IO_BYTES // slot)):
            lo, offset = first - start, self.slots[first] * slot
            io = (
                partial(tensor_io, f, buf[lo : lo + n].reshape(-1), offset)
                if data is None
                else partial(view_io, f, [data[lo * slot : (lo + n) * slot]], offset)
            )
            yield first, lo, n, io, blocks[lo : lo + n]

    #: True for writes (pack, then write), False for reads (read, then unpack).
    _writes: bool

    def _submit_packed(self, first: int, views: SlotViews, cpu_slots: list[int]) -> Future | None:
        """One chunk of ``submit_slots`` through a pack buffer, which goes back to the
        store's pool once the chunk is written (or read and unpacked)."""
        store = self.store
        buf = store.take_pack_buffer()
        rows = buf[: len(cpu_slots)]
        try:
            if self._writes:
                views.pack(cpu_slots, rows)
            io = self.submit(first, rows)
        except BaseException:
            store.give_pack_buffer(buf)
            raise
        if io is None:
            store.give_pack_buffer(buf)
            return None
        out: Future = Future()

        def settle(_io: Future) -> None:
            try:  # every block, good or not: a failed block fails its job anyway
                if not self._writes:
                    views.unpack(rows, cpu_slots)
            except Exception as e:
                self._record_error(e)
            finally:
                store.give_pack_buffer(buf)
                out.set_result(None)

        io.add_done_callback(settle)
        self._futures.append(out)  # ``finish`` returns only once the slots hold the bytes
        return out

    def _record_error(self, e: BaseException) -> None:
        raise NotImplementedError

    def _all_done(self, futs: list[Future], start: int, end: int) -> Future:
        return all_of(futs)
