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
   threads hash each run of blocks beside its write (``RunChecksums``, ``checksums.py``);
3. checksums (xxh3-64 or crc32c of each block's bytes) and R's presence bit are set in
   a synced transaction that also appends an ``ok`` log record per block. A block is
   loadable only once every rank's bit is set, i.e. every rank's bytes are durable.

Steps 1 and 3 go through a group commit (``GroupCommitter``, ``group_commit.py``): jobs of this process
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

The batches are ``WriteBatch`` (``write_batch.py``) and ``ReadBatch``
(``read_batch.py``), over what ``batch.py`` shares; they use the store only through
``BatchStore``'s methods (slab files, pack buffers, checksum threads, group commit).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch

from tiered_kv.abstract import Closing
from tiered_kv.config_values import DEFAULT_CHECKSUM, DEFAULT_IO_THREADS
from tiered_kv.memory.device import empty_pageable, empty_pinned
from tiered_kv.disk.store.block_store import BlockBatch, WriteBlockBatch
from tiered_kv.disk.store.batch import PACK_CHUNK_BYTES
from tiered_kv.checksums import checksum_function
from tiered_kv.disk.store.checksums import RunChecksums
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.store.group_commit import GroupCommitter, IndexWrite
from tiered_kv.disk.format.index_records import Entry, IndexSnapshot
from tiered_kv.disk.store.io_backends import (
    BackendFile,
    IOBackend,
    PosixBackend,
    aligned_empty,
    host_view,
    is_aligned,
    select_backend,
)
from tiered_kv.disk.format.namespace import Namespace, check_worker_access
from tiered_kv.disk.store.read_batch import ReadBatch
from tiered_kv.disk.store.write_batch import WriteBatch
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.memory.slot_views import SlotViews

logger = logging.getLogger(__name__)

__all__ = ["BlockIO", "DiskStore", "DiskStoreStats"]

#: The most pack buffers (``PACK_CHUNK_BYTES`` each, ``batch.py``) one store lends its
#: batches at a time.
PACK_BUFFERS = 8


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


class BlockIO(Closing, ABC):
    """The synchronous block API, over a store's ``begin_write``/``begin_read``; a context
    manager that ends with the store's ``close()``. With ``DiskStore`` and
    ``DiskIOProcess`` it makes a ``BlockStore`` (``tiered_kv.disk.store.block_store``)."""

    @abstractmethod
    def begin_write(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> WriteBlockBatch:
        """A batch that stores ``hashes`` into ``slots``."""

    @abstractmethod
    def begin_read(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> BlockBatch:
        """A batch that loads and verifies ``hashes`` from ``slots``."""

    def write_blocks(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int], data: torch.Tensor) -> list[bool]:
        """Store ``data[i, :block_bytes]`` as block ``hashes[i]`` in slot ``slots[i]`` of
        rank ``rank``; returns per-block success. ``data`` is uint8 ``(N, >= block_bytes)``;
        it is copied to an aligned buffer first unless it already is one
        (``(N, slot_size)``, 4 KiB-aligned)."""
        batch = self.begin_write(rank, hashes, slots)
        batch.submit(0, data)
        return batch.finish()

    def read_blocks(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int], out: torch.Tensor) -> list[bool]:
        """Load blocks into ``out[i, :block_bytes]`` (uint8 ``(N, >= block_bytes)``),
        verifying each; returns per-block success (False: missing or corrupt)."""
        batch = self.begin_read(rank, hashes, slots)
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
        self._committer = GroupCommitter(self.sync_slab, self.index, self.block_bytes)
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
        checksum: str = DEFAULT_CHECKSUM,
        io_backend: str | IOBackend = "auto",
        io_threads: int = DEFAULT_IO_THREADS,
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
        """Close files and the index handle (and the backend if this store made it). Idempotent."""
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

    def begin_write(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> WriteBatch:
        """Start storing one job's blocks (runs step 1 on the calling thread)."""
        return WriteBatch(self, rank, list(hashes), [int(s) for s in slots])

    def begin_read(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> ReadBatch:
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

    # ------------------------------------------------------------ what batches use (``BatchStore``)

    def take_pack_buffer(self) -> torch.Tensor:
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

    def give_pack_buffer(self, buf: torch.Tensor) -> None:
        with self._pack_free:
            self._pack_buffers.append(buf)
            self._pack_free.notify()

    def checksum_async(self, fn: Callable[..., None], *args: object) -> Future:
        """Run ``fn(*args)`` on this store's checksum threads (``RuntimeError`` once closed)."""
        return self._hash_pool.submit(fn, *args)

    def queue_clear(self, rank: int, hashes: list[bytes], slots: list[int]) -> IndexWrite:
        """Queue step 1 of a store with the group commit (see the module docstring)."""
        return self._committer.clear(rank, hashes, slots)

    def queue_commit(
        self, rank: int, file: BackendFile | None, hashes: list[bytes], slots: list[int], checksums: list[int | None]
    ) -> IndexWrite:
        """Queue step 3 of a store with the group commit (see the module docstring)."""
        return self._committer.commit(rank, file, hashes, slots, checksums)

    def sync_slab(self, f: BackendFile) -> None:
        """``fdatasync`` one of this store's slabs, through the backend it has now."""
        self.backend.sync(f)

    def count(self, **deltas: int) -> None:
        """Add ``deltas`` to ``stats``."""
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def slab(self, rank: int, max_slot: int) -> BackendFile:
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

    def io_rows(self, f: BackendFile, rows: torch.Tensor) -> torch.Tensor | None:
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
