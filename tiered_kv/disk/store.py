"""One process's access to a disk-cache namespace: slab files, index and I/O backend.

Used in worker processes by the disk handlers (one ``DiskStore`` per process, any
number of TP ranks), in a worker's disk I/O process instead (``io_process.py``, with
``disk_io: process``), and read-only by the inspector. Every call here blocks on disk
I/O, so it never runs on a scheduler thread.

A store of one job's blocks on rank R (``begin_write`` ... ``finish``, or
``write_blocks``):

1. a synced index transaction clears any entry that would let R's copy of a target
   slot be loaded while it is overwritten (skipped when a cheap read shows none);
2. the bytes are written (coalesced runs of consecutive slots, in parallel on the
   backend's pool) and made durable with ``fdatasync``. They come as packed rows
   (``submit``) or, from the CPU tier, as views of each block's pieces where they lie
   (``submit_views``: vectored I/O, no copy). Either way the store's checksum
   threads hash each run of blocks beside its write (``RunChecksums``);
3. checksums (xxh3-64 or crc32c of each block's bytes) and R's presence bit are set in
   a synced transaction that also appends an ``ok`` log record per block. A block is
   loadable only once every rank's bit is set, i.e. every rank's bytes are durable.

Steps 1 and 3 go through a group commit (``_GroupCommitter``): jobs of this process
that reach them while another group is being committed queue up, and the first to find
the committer idle commits everything queued at once: one ``fdatasync`` per slab that a
queued step 3 wrote to (every queued job's writes completed before it queued, so that
one call covers them all), then one synced LMDB transaction with every queued step 3
and step 1. A job leaves step 1 only once its clear is durable, and its step 3 is
committed only after the ``fdatasync`` of its own slab succeeded, so the ordering above
holds per job exactly as without grouping; the grouping only shares the syncs.

Any failure (ENOSPC, EIO, an index error) turns the affected blocks into ``failed`` log
records and a False result, counted in ``stats``; nothing raises out of a batch. A load
(``begin_read`` ... ``finish``, or ``read_blocks``) verifies every block against the
checksum recorded for its rank; a mismatch or a missing entry fails that block,
deletes its entry and appends a ``corrupt`` record, so it is never served again.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import partial

import lmdb
import torch

from tiered_kv.device import empty_pageable, empty_pinned
from tiered_kv.disk.fingerprint import Fingerprint
from tiered_kv.disk.index import Entry, IndexSnapshot, StoredBlocks
from tiered_kv.disk.io_backends import (
    ALIGN,
    BackendFile,
    IOBackend,
    PosixBackend,
    aligned_empty,
    host_view,
    is_aligned,
    select_backend,
)
from tiered_kv.disk.namespace import Namespace, check_worker_access, list_namespaces
from tiered_kv.host_memory import SlotViews
from tiered_kv.kv_layout import KVCacheLayout

logger = logging.getLogger(__name__)

__all__ = [
    "DiskStore",
    "DiskStoreStats",
    "WriteBatch",
    "ReadBatch",
    "RunChecksums",
    "checksum_function",
    "list_namespaces",
]

#: Runs of consecutive slots are coalesced into reads/writes of up to this many bytes
#: (a larger block is one call of its own).
MAX_IO_BYTES = 2 << 20
#: Most buffers one vectored call takes (Linux's ``UIO_MAXIOV``).
IOV_MAX = os.sysconf("SC_IOV_MAX")
#: Slots whose pieces are too small to move in place are packed this many bytes at a
#: time, into at most ``PACK_BUFFERS`` buffers per store.
PACK_CHUNK_BYTES = 8 << 20
PACK_BUFFERS = 8
#: Smallest piece worth a vectored transfer: with 8 KiB pieces (64 per 0.5 MiB block)
#: the device moved less than through one staging copy.
MIN_VIEW_PIECE = 32 << 10


def checksum_function(name: str) -> Callable[[memoryview], int]:
    """The 64-bit checksum ``name`` (``xxh3_64`` or ``crc32c``) over a byte view."""
    if name == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64_intdigest
    if name == "crc32c":
        try:
            import crc32c
        except ImportError:
            raise RuntimeError(
                "checksum crc32c needs the 'crc32c' package (pip install crc32c), or use checksum xxh3_64"
            ) from None
        return crc32c.crc32c
    raise ValueError(f"checksum: expected xxh3_64 or crc32c, got {name!r}")


class RunChecksums:
    """The checksums (``checksum_function(name)``) of runs of blocks, each block given as
    byte views hashed where they lie (``SlotViews.pieces``, or one view of a packed row).
    Called on the store's checksum threads, for the blocks a write has just sent or a
    read has just filled, beside the I/O threads and any Python thread of the engine.

    It lets go of the GIL about once per ``_HOLD_GIL_FOR`` bytes hashed: a one-piece
    block of at least that in the hashing call itself (xxhash and crc32c let go of it
    there), everything else holding the GIL, letting go once (``time.sleep(0)``) when
    that much was hashed and at the end of each run. Each letting go has its price:
    taking the GIL back waits behind a busy Python thread for up to the interpreter's
    switch interval, so hashing 0.5 MiB blocks one call each, or a block piece by piece
    each piece letting go, starved the checksums beside one (docs/benchmarks.md,
    "Disk tier"). Never letting go costs the other way: an I/O
    thread back from its call waits for the GIL until the holder lets go, so a checksum
    thread that held it from one queued block to the next kept the I/O threads from
    their next calls for up to the switch interval."""

    def __init__(self, name: str):
        self.one_call = checksum_function(name)
        if name == "xxh3_64":
            import xxhash

            def held(pieces: Sequence[memoryview]) -> int:
                h = xxhash.xxh3_64()
                for piece in pieces:
                    for at in range(0, len(piece), _HELD_UPDATE):
                        h.update(piece[at : at + _HELD_UPDATE])
                return h.intdigest()
        else:  # crc32c continues from a previous value

            def held(pieces: Sequence[memoryview]) -> int:
                value = 0
                for piece in pieces:
                    value = self.one_call(piece, value, _KEEP_GIL)
                return value

        self.held = held

    def __call__(self, run: Sequence[Sequence[memoryview]]) -> list[int]:
        out = []
        held_bytes = 0  # hashed holding the GIL since it last let go
        for pieces in run:
            if len(pieces) == 1 and len(pieces[0]) >= _HOLD_GIL_FOR:
                out.append(self.one_call(pieces[0]))
                continue
            out.append(self.held(pieces))
            held_bytes += sum(map(len, pieces))
            if held_bytes >= _HOLD_GIL_FOR:
                time.sleep(0)  # lets go of the GIL (and takes it back)
                held_bytes = 0
        if held_bytes:
            time.sleep(0)
        return out


#: crc32c's ``gil_release_mode`` that hashes holding the GIL (its default lets go of it
#: for every buffer from 32 KiB).
_KEEP_GIL = 0
#: Held hashing gives xxhash at most this much at a time: it lets go of the GIL for an
#: update over 64 KiB.
_HELD_UPDATE = 32 << 10
#: ``RunChecksums`` lets go of the GIL about once per this many bytes hashed: the most
#: one I/O call moves, so about once per call.
_HOLD_GIL_FOR = MAX_IO_BYTES


@dataclass
class DiskStoreStats:
    """Counters of one process's store (monotonic; read them, do not reset)."""

    stores: int = 0
    store_failures: int = 0
    enospc: int = 0
    loads: int = 0
    load_failures: int = 0
    checksum_failures: int = 0
    missing_entries: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class BlockIO:
    """The synchronous block API, over a store's ``begin_write``/``begin_read``."""

    def write_blocks(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int], data: torch.Tensor) -> list[bool]:
        """Store ``data[i, :block_bytes]`` as block ``hashes[i]`` in slot ``slots[i]`` of
        rank ``rank``; returns per-block success. ``data`` is uint8 ``(N, >= block_bytes)``;
        it is copied to an aligned buffer first unless it already is one
        (``(N, slot_size)``, 4 KiB-aligned)."""
        batch = self.begin_write(rank, hashes, slots)  # type: ignore[attr-defined]
        batch.submit(0, data)
        return batch.finish()

    def read_blocks(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int], out: torch.Tensor) -> list[bool]:
        """Load blocks into ``out[i, :block_bytes]`` (uint8 ``(N, >= block_bytes)``),
        verifying each; returns per-block success (False: missing or corrupt)."""
        batch = self.begin_read(rank, hashes, slots)  # type: ignore[attr-defined]
        batch.submit(0, out)
        return batch.finish()


class DiskStore(BlockIO):
    """A namespace opened by one process for block I/O (or read-only for inspection).

    Thread-safe. ``write_blocks``/``read_blocks`` are the synchronous API; handlers use
    ``begin_write``/``begin_read`` to overlap packing with I/O.
    """

    def __init__(
        self,
        namespace: Namespace,
        backend: IOBackend,
        *,
        readonly: bool = False,
        engine_id: str | None = None,
        owns_backend: bool = True,
    ):
        self.namespace = namespace.retain()  # closed by ``close``
        self.backend = backend
        self.readonly = readonly
        self._owns_backend = owns_backend
        m = namespace.manifest
        self.block_bytes = m.block_bytes
        self.slot_size = m.slot_size
        self.tp_size = namespace.tp_size
        self.checksum_name = m.checksum
        self.run_checksums = RunChecksums(m.checksum)
        if not readonly:
            check_worker_access(namespace, engine_id)
        self.index = namespace.open_index(readonly=readonly, expected_entries=m.num_slots, repair=not readonly)
        self.stats = DiskStoreStats()
        self._stats_lock = threading.Lock()
        self._files: dict[int, BackendFile] = {}
        self._allocated: dict[int, int] = {}  # rank -> slots preallocated in its slab
        self._files_lock = threading.Lock()
        self._committer = _GroupCommitter(self)
        # Checksums run on their own threads: on the backend's pool each one would hold
        # an I/O thread and cut the queue depth the device sees (threads start lazily).
        self._hash_pool = ThreadPoolExecutor(
            max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="tkv-disk-checksum"
        )
        self._pack_buffers: list[torch.Tensor] = []  # free pack buffers (``submit_slots``)
        self._pack_made = 0
        self._pack_free = threading.Condition()
        self._closed = False

    # ------------------------------------------------------------ construction

    @classmethod
    def open(
        cls,
        cache_dir: str | os.PathLike,
        fingerprint: Fingerprint,
        layout: KVCacheLayout,
        *,
        disk_bytes: int,
        checksum: str = "xxh3_64",
        io_backend: str | IOBackend = "auto",
        io_threads: int = 4,
        engine_id: str | None = None,
    ) -> "DiskStore":
        """Open (creating if absent) ``fingerprint``'s namespace for writing; ``disk_bytes``
        sizes a new one. Raises ``FingerprintMismatchError``, ``NamespaceError``,
        ``CacheLockedError`` (another engine writes there) or ``BackendUnavailableError``."""
        checksum_function(checksum)  # fail early on a bad name or missing package
        with Namespace.open(cache_dir, fingerprint, layout, disk_bytes=disk_bytes, checksum=checksum).handover() as ns:
            backend = (
                io_backend if isinstance(io_backend, IOBackend) else select_backend(io_backend, ns.path, io_threads)
            )
            return cls(ns, backend, engine_id=engine_id, owns_backend=not isinstance(io_backend, IOBackend))

    @classmethod
    def open_readonly(cls, namespace_dir: str | os.PathLike, io_threads: int = 2) -> "DiskStore":
        """Open an existing namespace directory without taking any lock (inspector).
        Works while an engine writes; uses POSIX I/O."""
        with Namespace.open_path(namespace_dir).handover() as ns:
            return cls(ns, PosixBackend(io_threads), readonly=True)

    def close(self) -> None:
        """Close files and the index handle (and the backend if this store made it)."""
        if self._closed:
            return
        self._closed = True
        self._committer.close()  # commits what is queued, with the slabs still open
        self._hash_pool.shutdown(wait=True)
        with self._files_lock:
            for f in self._files.values():
                try:
                    self.backend.close_file(f)
                except OSError:
                    logger.exception("closing %s", f.path)
            self._files.clear()
        if self._owns_backend:
            self.backend.shutdown()
        self.index.close()
        self.namespace.close()

    # ------------------------------------------------------------ inspection

    def snapshot(self) -> IndexSnapshot:
        """Every index entry (see ``DiskIndex.load_all``)."""
        return self.index.load_all()

    def entry(self, block_hash: bytes) -> Entry | None:
        return self.index.get(block_hash)

    def read_block(self, rank: int, block_hash: bytes) -> bytes | None:
        """The verified bytes of one block on ``rank``, or None (missing or corrupt)."""
        e = self.index.get(block_hash)
        if e is None:
            return None
        buf = aligned_empty(self.slot_size).view(1, self.slot_size)
        ok = self.read_blocks(rank, [block_hash], [e.slot], buf)
        return bytes(host_view(buf[0, : self.block_bytes])) if ok[0] else None

    # ------------------------------------------------------------ block I/O

    def begin_write(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> "WriteBatch":
        """Start storing one job's blocks (runs step 1 on the calling thread)."""
        return WriteBatch(self, rank, list(hashes), [int(s) for s in slots])

    def begin_read(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> "ReadBatch":
        """Start loading one job's blocks (reads their index entries)."""
        return ReadBatch(self, rank, list(hashes), [int(s) for s in slots])

    def takes_slots(self, views: SlotViews) -> bool:
        """Whether batches' ``submit_slots`` move ``views``' slots: host views of one
        of this store's blocks per slot."""
        return views.slot_bytes == self.block_bytes

    def host_buffer(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        """A long-lived host buffer of ``nbytes`` (uint8, page-aligned; page-locked when
        ``pin``) that this store's batches take as rows: staging for the handlers."""
        return empty_pinned(nbytes) if pin else empty_pageable(nbytes)

    def log_failed(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """Record in the index log that these writes on ``rank`` will not happen (so the
        manager frees their slots)."""
        self.index.log_failed(rank, hashes, slots)

    # ------------------------------------------------------------ internals

    def _take_pack_buffer(self) -> torch.Tensor:
        """A free ``(chunk, slot_size)`` pack buffer; waits while ``PACK_BUFFERS`` are in use."""
        with self._pack_free:
            while not self._pack_buffers and self._pack_made >= PACK_BUFFERS:
                self._pack_free.wait()
            if self._pack_buffers:
                return self._pack_buffers.pop()
            self._pack_made += 1
        per_chunk = max(1, PACK_CHUNK_BYTES // self.slot_size)
        try:
            return self.host_buffer(per_chunk * self.slot_size).view(per_chunk, self.slot_size)
        except BaseException:
            with self._pack_free:
                self._pack_made -= 1
                self._pack_free.notify()
            raise

    def _give_pack_buffer(self, buf: torch.Tensor) -> None:
        with self._pack_free:
            self._pack_buffers.append(buf)
            self._pack_free.notify()

    def _view_runs(
        self, slots: Sequence[int], start: int, blocks: Sequence[Sequence[memoryview]]
    ) -> list[tuple[int, int]]:
        """``_runs`` for blocks given as views, after checking each block's size."""
        for pieces in blocks:
            if sum(map(len, pieces)) != self.block_bytes:
                raise ValueError(f"a block's views hold {sum(map(len, pieces))} bytes; expected {self.block_bytes}")
        return _runs(slots, start, len(blocks), max(1, MAX_IO_BYTES // self.slot_size))

    def _view_io(
        self,
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

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _file(self, rank: int, max_slot: int) -> BackendFile:
        """Rank ``rank``'s slab, opened (and preallocated) up to ``max_slot``."""
        with self._files_lock:
            if self._closed:
                raise RuntimeError("disk store is closed")
            if not self.readonly and self._allocated.get(rank, 0) <= max_slot:
                if self.namespace.manifest.num_slots <= max_slot:
                    self.namespace.reload()
                if self.namespace.manifest.num_slots <= max_slot:
                    raise ValueError(
                        f"slot {max_slot} is out of range: the namespace has {self.namespace.manifest.num_slots} slots"
                    )
                self.namespace.allocate_slab(rank)
                self._allocated[rank] = self.namespace.manifest.num_slots
            f = self._files.get(rank)
            if f is None:
                ns = self.namespace
                f = self.backend.open(ns.slab_path(rank), self.readonly, ns.fd, ns.owner)
                self._files[rank] = f
            return f

    def _io_buffer(self, f: BackendFile, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` itself when it can go to the backend as is, else None (bounce it)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] < self.block_bytes:
            raise ValueError(
                f"block data must be a uint8 tensor of shape (N, >= {self.block_bytes}); "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        if rows.device.type != "cpu" and not self.backend.device_buffers:
            return None
        if rows.shape[1] != self.slot_size or not rows.is_contiguous():
            return None
        if f.direct and not is_aligned(rows):
            return None
        return rows


def views_fit(views: SlotViews, slot_size: int) -> bool:
    """Whether ``views``' slots move straight to and from ``slot_size``-byte disk slots
    (vectored I/O, any backend): pieces aligned for O_DIRECT (so a block fills its slot
    exactly: there is no padding to write) and of at least ``MIN_VIEW_PIECE`` each (so a
    block's call has few buffers: 64 at 2 MiB; smaller pieces moved slower than packed
    runs)."""
    return views.aligned(ALIGN) and views.slot_bytes == slot_size and views.smallest_piece >= MIN_VIEW_PIECE


def _runs(slots: Sequence[int], start: int, count: int, per_run: int) -> list[tuple[int, int]]:
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


def _block_views(rows: torch.Tensor, block_bytes: int) -> list[list[memoryview]]:
    """The first ``block_bytes`` of each row of ``rows`` (a contiguous host uint8
    ``(n, stride)`` tensor), as one-piece blocks for ``_checksum_run``/``_verify``.

    The batches hand their worker threads byte views made on the submitting thread, never
    tensors: every torch call releases the GIL and takes it back, and taking it back
    waits behind any thread running Python, up to the interpreter's 5 ms switch interval
    (a 3 us ``reshape`` took 1.4 ms beside one busy thread: tools/bench_gil_handoff.py).
    """
    view, stride = host_view(rows), rows.shape[1]
    return [[view[i : i + block_bytes]] for i in range(0, len(rows) * stride, stride)]


class _Batch:
    """What write and read batches share: their store, rank file and slots, and the
    I/O futures submitted so far."""

    store: DiskStore
    slots: list[int]
    _file: BackendFile | None
    _futures: list[Future]

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
            return self.submit_views(start, [views.pieces(s) for s in slots])  # type: ignore[attr-defined]
        slots = [int(s) for s in slots]
        per_chunk = max(1, PACK_CHUNK_BYTES // self.store.slot_size)
        futs = []
        for a in range(0, len(slots), per_chunk):
            fut = self._submit_packed(start + a, views, slots[a : a + per_chunk])
            if fut is None:
                break
            futs.append(fut)
        return self._all_done(futs, start, start + len(slots))

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
        slot, f = self.store.slot_size, self._file
        blocks = _block_views(sums, self.store.block_bytes)
        data = host_view(buf) if buf.device.type == "cpu" else None
        for first, n in _runs(self.slots, start, len(buf), max(1, MAX_IO_BYTES // slot)):
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
        buf = store._take_pack_buffer()
        rows = buf[: len(cpu_slots)]
        try:
            if self._writes:
                views.pack(cpu_slots, rows)
            io = self.submit(first, rows)  # type: ignore[attr-defined]
        except BaseException:
            store._give_pack_buffer(buf)
            raise
        if io is None:
            store._give_pack_buffer(buf)
            return None
        out: Future = Future()

        def settle(_io: Future) -> None:
            try:  # every block, good or not: a failed block fails its job anyway
                if not self._writes:
                    views.unpack(rows, cpu_slots)
            except Exception as e:
                self._record_error(e)
            finally:
                store._give_pack_buffer(buf)
                out.set_result(None)

        io.add_done_callback(settle)
        self._futures.append(out)  # ``finish`` returns only once the slots hold the bytes
        return out

    def _record_error(self, e: BaseException) -> None:
        raise NotImplementedError

    def _all_done(self, futs: list[Future], start: int, end: int) -> Future:
        return _all_of(futs)


class WriteBatch(_Batch):
    """One job's store on one rank. ``submit`` chunks of packed rows (any order, each
    block once), then ``finish`` once. Thread-safe for one producer."""

    _writes = True

    def __init__(self, store: DiskStore, rank: int, hashes: list[bytes], slots: list[int]):
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
        self._clearing: _IndexWrite | None = None  # step 1, committed before the first write
        try:
            self._file = store._file(rank, max(slots)) if slots else None
            if slots and store.index.needs_clearing(rank, hashes, slots):
                self._clearing = store._committer.clear(rank, hashes, slots)
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
        buf = store._io_buffer(self._file, rows)
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
        store = self.store

        def runs():
            for first, n in store._view_runs(self.slots, start, blocks):
                run = blocks[first - start : first - start + n]
                yield (
                    first,
                    partial(
                        store._view_io, store.backend.pwritev, self._file, run, self.slots[first] * store.slot_size
                    ),
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
            futs.append(store.backend.submit(self._write, write))
            futs.append(store._hash_pool.submit(self._checksum_run, first, run))
        self._futures.extend(futs)
        return _all_of(futs)

    def _may_write(self, n: int) -> bool:
        """Before a chunk of ``n`` blocks: wait for step 1 (the first time); whether to go on."""
        if not self._cleared:
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
        concurrent jobs, see the module docstring); per-block success."""
        return self.finish_async().result()

    def finish_async(self) -> "Future[list[bool]]":
        """``finish`` without waiting: the returned future gets the per-block success
        once the writes are durable and committed (or failed). The caller's thread is
        free for its next job meanwhile; call it once every chunk was submitted."""
        out: Future = Future()
        waits = list(self._futures)
        if self._clearing is not None:
            waits.append(self._clearing.done)
        _all_of(waits).add_done_callback(lambda _: self._commit(out))
        return out

    def _settle_clearing(self, clearing: "_IndexWrite") -> None:
        self._cleared = True
        if clearing.error is not None:
            self._fail(clearing.error)  # its slots must be neither written nor committed

    def _commit(self, out: Future) -> None:
        """Queue step 3 (all writes are done); ``out`` gets the outcome from the committer."""
        try:
            if not self._cleared:
                self._settle_clearing(self._clearing)
            if self._error is not None or self._file is None:
                self.checksums = [None] * len(self.hashes)
            if not self.hashes:
                out.set_result(self._settle([]))
                return
            req = self.store._committer.commit(self.rank, self._file, self.hashes, self.slots, self.checksums)
            req.done.add_done_callback(lambda _: self._resolve(out, req))
        except BaseException as e:  # the caller must always get an outcome
            out.set_exception(e)

    def _resolve(self, out: Future, req: "_IndexWrite") -> None:
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
        store._count(
            stores=n_ok, store_failures=len(ok) - n_ok, enospc=int(self._enospc), bytes_written=n_ok * store.block_bytes
        )
        self.seconds = time.perf_counter() - self._t0
        return ok


class _IndexWrite:
    """One job's queued index write: its step 1 (``clear``) or its step 3. The committer
    sets ``checksums`` entries to None for blocks that did not become durable,
    ``committed`` once the transaction holding it committed, and ``error``; ``wait``
    returns once all of that is settled."""

    __slots__ = ("clear", "rank", "file", "hashes", "slots", "checksums", "committed", "error", "done")

    def __init__(
        self,
        clear: bool,
        rank: int,
        file: BackendFile | None,
        hashes: list[bytes],
        slots: list[int],
        checksums: list[int | None] | None = None,
    ):
        self.clear, self.rank, self.file, self.hashes, self.slots = clear, rank, file, hashes, slots
        self.checksums = list(checksums) if checksums is not None else []
        self.committed = False
        self.error: BaseException | None = None
        self.done: Future = Future()  # result: this write, once settled

    def wait(self) -> "_IndexWrite":
        return self.done.result()

    def stored(self, size: int) -> StoredBlocks:
        return StoredBlocks(self.rank, self.hashes, self.slots, [size] * len(self.hashes), self.checksums)

    def durable_writes(self) -> bool:
        return not self.clear and any(c is not None for c in self.checksums)


class _GroupCommitter:
    """Group commit of one store's index writes, all ranks (see the module docstring).

    ``clear`` and ``commit`` queue a write and return it at once; its owner ``wait``s
    before relying on it. One committer thread (started on first use) takes everything
    queued while it was busy as the next group: it syncs and commits the group and
    wakes the owners. A clear therefore runs while its job packs its first rows, and
    jobs that finish together share one ``fdatasync`` and one transaction. Failures stay
    per job: a failed ``fdatasync`` fails the commits of that slab only, and a
    transaction that fails is retried job by job, so one job's bad write can neither
    fail nor commit another's.
    """

    def __init__(self, store: DiskStore):
        self._store = store
        self._cond = threading.Condition()
        self._queue: list[_IndexWrite] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def clear(self, rank: int, hashes: list[bytes], slots: list[int]) -> _IndexWrite:
        """Queue step 1 for one job. Its slots may be overwritten only once ``wait()``
        returned with no ``error``."""
        return self._enqueue(_IndexWrite(True, rank, None, hashes, slots))

    def commit(
        self, rank: int, file: BackendFile | None, hashes: list[bytes], slots: list[int], checksums: list[int | None]
    ) -> _IndexWrite:
        """Queue step 3 for one job (blocks with a None checksum are logged failed)."""
        return self._enqueue(_IndexWrite(False, rank, file, hashes, slots, checksums))

    def close(self) -> None:
        """Commit what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _enqueue(self, req: _IndexWrite) -> _IndexWrite:
        with self._cond:
            if self._closed:
                req.error = RuntimeError("disk store is closed")
                req.checksums = [None] * len(req.checksums)
                req.done.set_result(req)
                return req
            self._queue.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tkv-disk-commit", daemon=True)
                self._thread.start()
            self._cond.notify()
        return req

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                group, self._queue = self._queue, []
            try:
                self._lead(group)
            finally:
                for r in group:
                    r.done.set_result(r)

    def _lead(self, group: list[_IndexWrite]) -> None:
        store = self._store
        try:
            # Durability first: one fdatasync per slab covers every queued job's writes.
            files: dict[int, list[_IndexWrite]] = {}
            for r in group:
                if r.durable_writes():
                    files.setdefault(id(r.file), []).append(r)
            for reqs in files.values():
                try:
                    store.backend.sync(reqs[0].file)
                except OSError as e:
                    for r in reqs:
                        r.error = e
                        r.checksums = [None] * len(r.hashes)
            self._transact(group)
        except Exception as e:  # never leave a waiting job without an outcome
            logger.exception("disk index group commit failed")
            for r in group:
                if not r.committed:
                    r.error = r.error or e
                    r.checksums = [None] * len(r.checksums)

    def _transact(self, group: list[_IndexWrite]) -> None:
        store = self._store
        try:
            store.index.commit_group(
                [r.stored(store.block_bytes) for r in group if not r.clear],
                [(r.rank, r.hashes, r.slots) for r in group if r.clear],
            )
        except lmdb.Error as e:
            if len(group) > 1:  # find the job(s) that cannot commit; the others still do
                for r in group:
                    self._transact([r])
                return
            r = group[0]
            r.error = r.error or (
                OSError(errno.ENOSPC, f"index commit failed: {e}")
                if "No space" in str(e)
                else RuntimeError(f"index commit failed: {e}")
            )
            if not r.clear:
                r.checksums = [None] * len(r.hashes)
                store.index.log_failed(r.rank, r.hashes, r.slots)
            return
        for r in group:
            r.committed = True


class ReadBatch(_Batch):
    """One job's load on one rank. ``submit`` chunks of destination rows, then
    ``finish`` once. Each block is verified against the checksum recorded for this
    rank; blocks without a usable entry are not read at all."""

    _writes = False

    def __init__(self, store: DiskStore, rank: int, hashes: list[bytes], slots: list[int]):
        if len(hashes) != len(slots):
            raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots; expected one slot per hash")
        self.store, self.rank, self.hashes, self.slots = store, rank, hashes, slots
        self.ok = [False] * len(hashes)
        self._corrupt: list[int] = []
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.expected: list[int | None] = [None] * len(hashes)
        self._error: str | None = None
        try:
            self._file = store._file(rank, max(slots)) if slots else None
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
        buf = store._io_buffer(self._file, rows)
        bounce = buf is None
        if bounce:
            buf = aligned_empty(len(rows) * store.slot_size).view(len(rows), store.slot_size)
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
            store.backend.submit(self._read_then_verify, read, verify, done)
            futs.append(done)
        self._futures.extend(futs)
        end = start + len(rows)  # not ``rows``: the callback cycle would keep the caller's memory alive
        return _all_of(futs, lambda: all(self.ok[start:end]))

    def submit_views(self, start: int, blocks: Sequence[Sequence[memoryview]]) -> Future | None:
        """Read blocks ``start .. start+len(blocks)-1`` straight into host byte views,
        each block's of ``block_bytes`` in all (``SlotViews.pieces``; only where
        ``views_fit``). The future's result is True when every block of the
        chunk was read and verified; a block that fails leaves its views overwritten."""
        if self._error is not None or not blocks:
            return None
        store = self.store
        futs = []
        for first, n in store._view_runs(self.slots, start, blocks):
            if all(self.expected[first + i] is None for i in range(n)):
                continue
            run = blocks[first - start : first - start + n]
            done: Future = Future()
            read = partial(store._view_io, store.backend.preadv, self._file, run, self.slots[first] * store.slot_size)
            store.backend.submit(self._read_then_verify, read, partial(self._verify, first, run), done)
            futs.append(done)
        self._futures.extend(futs)
        end = start + len(blocks)
        return _all_of(futs, lambda: all(self.ok[start:end]))

    def _all_done(self, futs: list[Future], start: int, end: int) -> Future:
        return _all_of(futs, lambda: all(self.ok[start:end]))

    def _read_then_verify(self, read: Callable[[], None], verify: Callable[[], None], done: Future) -> None:
        """``read()`` on an I/O thread, then hand ``verify()`` to the checksum threads,
        so the I/O thread goes straight back to the device. ``done`` gets None after."""
        try:
            read()
        except Exception as e:  # an I/O thread must not lose an error: finish() reports it
            self._record_error(e)
            done.set_result(None)
            return
        try:
            self.store._hash_pool.submit(self._verified, verify, done)
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
        bad = sorted(set(self._corrupt) | set(self._missing))
        if bad:
            for i in self._corrupt:
                logger.error(
                    "disk block %s (rank %d, slot %d) failed its checksum; dropping it",
                    self.hashes[i].hex()[:16],
                    self.rank,
                    self.slots[i],
                )
            try:
                store.index.drop_corrupt(self.rank, [(self.hashes[i], self.slots[i]) for i in bad])
            except lmdb.Error as e:
                logger.error("could not drop %d corrupt blocks from the index: %s", len(bad), e)
        if self._error is not None:
            logger.warning("disk load of %d blocks on rank %d failed: %s", len(self.ok), self.rank, self._error)
            self.ok = [False] * len(self.ok)
        n_ok = sum(self.ok)
        store._count(
            loads=n_ok,
            load_failures=len(self.ok) - n_ok,
            checksum_failures=len(self._corrupt),
            missing_entries=len(self._missing),
            bytes_read=n_ok * store.block_bytes,
        )
        self.seconds = time.perf_counter() - self._t0
        return list(self.ok)


def _all_of(futs: list[Future], result: Callable[[], object] | None = None) -> Future:
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
