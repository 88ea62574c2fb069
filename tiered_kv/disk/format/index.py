"""The disk tier's LMDB index: which block is in which slot, durable on which ranks.

One LMDB environment per namespace (``<namespace>/index.lmdb``), shared by every process
of an engine and by the read-only inspector. LMDB allows one open environment per
path per process, so ``DiskIndex`` objects share environments through a per-process
registry. Sub-databases:

- ``blocks``: block hash -> ``slot, size, hits, store_time, last_access, ranks bitmask,
  checksum per rank, hash`` (little-endian; see ``entry_dtype``). The hash is repeated in
  the value so a restart decodes every entry from one pass over the values with numpy.
- ``slots``: slot (big-endian u64) -> the hash last committed there, so a writer can
  clear the slot's previous owner before overwriting it.
- ``log``: what workers did (stored ok / store failed / found corrupt), read by the
  scheduler's manager. Each record has a sequence number; one value holds the records
  one transaction appended, keyed by the big-endian u64 sequence of its last record:
  a u16 hash length, then ``status, rank, slot, hash`` per record (so the manager reads
  a few hundred records with one cursor step and one numpy decode).
- ``meta``: the log sequence counter.

Who writes what: workers commit ``blocks``/``slots``/``log`` in synced transactions (one
per group of jobs that finish together, ``commit_group``), and only after the block bytes
are durable (``store.py``); the manager's
background flusher commits evictions, access times and log trimming in batches. Readers
never block writers (MVCC). ``MDB_MAP_RESIZED`` in a reader is handled by adopting the
new map size and retrying; a writer grows the map on ``MapFullError``.

Opening the environment (``index_env``): its files are checked and opened through the
namespace directory's descriptor, and a damaged index is found at open (a page walk for
writers) and moved aside by the engine's writers, which start an empty one; no block is
ever served from an index that cannot be read.

The values' byte layout and the record types (``Entry``, ``LogColumns``,
``IndexSnapshot``...) are ``index_records.py``'s.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from tiered_kv.abstract import Closing
from tiered_kv.disk.format.index_env import (
    DAMAGE_SEEN,
    QUARANTINE_SUFFIX,
    IndexCorruptError,
    acquire_env,
    release_env,
)
from tiered_kv.disk.format.index_records import (
    ENTRY_HEADER,
    LOG_CORRUPT,
    LOG_FAILED,
    LOG_HEADER,
    LOG_OK,
    LOG_RECORD,
    Entry,
    IndexSnapshot,
    LogColumns,
    LogRecord,
    StoredBlocks,
    entry_dtype,
    log_rows,
    sane_time,
    sane_times,
)

logger = logging.getLogger(__name__)

__all__ = ["DiskIndex", "IndexCorruptError", "QUARANTINE_SUFFIX"]

_SEQ = struct.Struct(">Q")
_SLOT = struct.Struct(">Q")
_LOG_SEQ_KEY = b"log_seq"
_MIN_MAP_SIZE = 256 << 20
#: Seconds between tries to write ``failed`` records a transaction could not take
#: (doubling up to the second value).
UNLOGGED_RETRY_S = (0.5, 10.0)


class _OddLength(Exception):
    """A ``blocks`` value whose length differs from the first one's (``load_all``)."""


class DiskIndex(Closing):
    """Typed access to one namespace's index. Thread-safe; cheap to create per user.

    ``tp_size`` fixes the entry length. Every write method commits one transaction
    (synced: the environment is opened with LMDB's default durable commits). A damaged
    index raises ``IndexCorruptError``, or with ``repair`` (writers only) is replaced by
    an empty one (see the module docstring).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        tp_size: int,
        *,
        readonly: bool = False,
        expected_entries: int = 0,
        repair: bool = False,
        dir_fd: int | None = None,
        owner: int | None = None,
    ):
        self.path = Path(path)
        self.tp_size = tp_size
        self._entry = struct.Struct(ENTRY_HEADER.format + f"{tp_size}Q")
        # Map size is virtual address space, not disk: reserve plenty so growth is rare.
        map_size = max(_MIN_MAP_SIZE, expected_entries * 1024)
        self._shared = acquire_env(self.path, readonly, map_size, repair, dir_fd, owner)
        self._closed = False
        # ``failed`` records no transaction could take (the index's file could not grow, an
        # I/O error): the manager frees a failed store's slot only on reading its record, so
        # they go with the next write of the log, or a timer's, never dropped. Bounded by
        # the slots: a slot is stored again only once its failure is read.
        self._unlogged: list[tuple[int, int, int, bytes]] = []
        self._unlogged_lock = threading.Lock()
        self._retry: threading.Timer | None = None
        self._retry_s = UNLOGGED_RETRY_S[0]

    @property
    def readonly(self) -> bool:
        return self._shared.readonly

    def close(self) -> None:
        """Release this handle (the environment closes with its last handle). Idempotent."""
        if not self._closed:
            self._closed = True
            with self._unlogged_lock:
                if self._retry is not None:
                    self._retry.cancel()
                if self._unlogged:  # their slots' stores never committed: not loadable at the next start
                    logger.error("index %s: closed with %d failed stores unlogged", self.path, len(self._unlogged))
            release_env(self._shared)

    def _db(self, name: str) -> Any:  # an lmdb database handle, None in an unwritten read-only index
        return self._shared.dbs[name]

    def check_pages(self) -> None:
        """Walk every page of the index (``index_env``; writers do at open). Raises
        ``IndexCorruptError`` naming the damage."""
        self._shared.check_pages()

    # ------------------------------------------------------------ codec

    def encode(self, block_hash: bytes, e: Entry) -> bytes:
        return self._entry.pack(e.slot, e.size, e.hits, e.store_time, e.last_access, e.ranks, *e.checksums) + block_hash

    def decode(self, block_hash: bytes, raw: bytes | memoryview) -> Entry | None:
        """None for a value that does not fit (another tp_size, or damage)."""
        if len(raw) != self._entry.size + len(block_hash) or raw[self._entry.size :] != block_hash:
            return None
        v = self._entry.unpack_from(raw)
        return Entry(v[0], v[1], v[2], sane_time(v[3]), sane_time(v[4]), v[5], tuple(v[6:]))

    def _slot_of(self, raw: bytes | memoryview | None) -> int | None:
        if raw is None or len(raw) < self._entry.size:
            return None
        return ENTRY_HEADER.unpack_from(raw)[0]

    # ------------------------------------------------------------ reads

    def get(self, block_hash: bytes) -> Entry | None:
        if self._db("blocks") is None:
            return None
        raw = self._shared.run(lambda txn: txn.get(block_hash, db=self._db("blocks")))
        return None if raw is None else self.decode(block_hash, raw)

    def get_many(self, hashes: Sequence[bytes]) -> list[Entry | None]:
        """Entries of ``hashes`` from one consistent snapshot."""
        if self._db("blocks") is None:
            return [None] * len(hashes)

        def read(txn):
            db = self._db("blocks")
            return [txn.get(h, db=db) for h in hashes]

        return [None if r is None else self.decode(h, r) for h, r in zip(hashes, self._shared.run(read))]

    def load_or_repair(self, reopen: Callable[[], "DiskIndex"]) -> tuple["DiskIndex", IndexSnapshot]:
        """``load_all``, for a writer that opened the index with ``repair``: damage the page
        walk at open did not see, met by LMDB while reading (which leaves the damage mark),
        closes this handle and takes ``reopen()``'s, whose open moves the index aside and
        starts empty. Where another handle of this process keeps the damaged environment
        open, nothing of it is adopted (an empty snapshot): the engine runs as on damage
        met while running, and the mark sets the index aside at the next start. Returns
        the index to use and its snapshot."""
        try:
            return self, self.load_all()
        except DAMAGE_SEEN:
            self.close()
        index = reopen()
        try:
            return index, index.load_all()
        except DAMAGE_SEEN:
            return index, IndexSnapshot(np.zeros(0, entry_dtype(self.tp_size, 1)), [], 0)

    def load_all(self) -> IndexSnapshot:
        """Every entry plus the log position, from one snapshot: one pass over the values
        decoded with numpy, no per-entry Python objects in the common case (all hashes
        of one length). Entries that do not decode are logged and left out."""
        if self._db("blocks") is None:
            return IndexSnapshot(np.zeros(0, entry_dtype(self.tp_size, 1)), [], 0)

        base = self._entry.size

        def read(txn):
            # Common case: every value has the first one's length. Stream them straight
            # into one array (no list of a million bytes objects, no join); the length
            # check matters because numpy would silently pad or cut a value of another
            # length. Any other length falls back to the general path below.
            db = self._db("blocks")
            cur = txn.cursor(db=db)
            if cur.first() and len(cur.value()) > base:
                size = len(cur.value())

                def exact(values):
                    for v in values:
                        if len(v) != size:
                            raise _OddLength
                        yield v

                try:
                    arr = np.fromiter(
                        exact(cur.iternext(keys=False, values=True)), dtype=f"V{size}", count=txn.stat(db)["entries"]
                    )
                    return arr.view(entry_dtype(self.tp_size, size - base)), None, self._log_seq(txn)
                except _OddLength:
                    pass
            vals = list(txn.cursor(db=db).iternext(keys=False, values=True))
            return None, vals, self._log_seq(txn)

        arr, vals, seq = self._shared.run(read)
        if arr is not None:
            return IndexSnapshot(sane_times(arr), [], seq)
        if not vals:
            return IndexSnapshot(np.zeros(0, entry_dtype(self.tp_size, 1)), [], seq)
        # Mixed hash lengths: bulk-decode the most common length, the rest one by one.
        lengths = np.fromiter((len(v) for v in vals), dtype=np.int64, count=len(vals))
        common = int(np.bincount(lengths).argmax())
        main = [v for v, n in zip(vals, lengths) if n == common]
        odd = []
        for v, n in zip(vals, lengths):
            if n != common:
                h = bytes(v[base:])
                e = self.decode(h, v) if n > base else None
                if e is None:
                    logger.warning(
                        "index %s: ignoring an entry of %d bytes that does not decode for tp_size %d",
                        self.path,
                        n,
                        self.tp_size,
                    )
                else:
                    odd.append((h, e))
        if common <= base:
            return IndexSnapshot(np.zeros(0, entry_dtype(self.tp_size, 1)), odd, seq)
        arr = np.frombuffer(bytearray(b"".join(main)), dtype=entry_dtype(self.tp_size, common - base))
        return IndexSnapshot(sane_times(arr), odd, seq)

    def read_log(self, after_seq: int, limit: int = 100_000) -> list[LogRecord]:
        """Log records with sequence > ``after_seq``, oldest first."""
        return self.read_log_columns(after_seq, limit).records()

    def read_log_columns(self, after_seq: int, limit: int = 100_000) -> "LogColumns":
        """``read_log`` as columns (what the scheduler's manager reads every step:
        decoded with numpy, not one record at a time)."""
        if self._db("log") is None:
            return LogColumns.empty()

        def read(txn):
            cur = txn.cursor(db=self._db("log"))
            if not cur.set_range(_SEQ.pack(after_seq + 1)):
                return []
            values, fresh = [], 0
            for key, value in cur.iternext(keys=True, values=True):
                rows = log_rows(value, self.tp_size) if len(key) == _SEQ.size else None
                if rows is None:
                    logger.error(
                        "index %s: a damaged log value (key %s, %d bytes) is skipped", self.path, key.hex(), len(value)
                    )
                    continue
                last = _SEQ.unpack(key)[0]
                values.append((last, rows))
                fresh += min(len(rows), last - after_seq)
                if fresh >= limit:
                    break
            return values

        values = self._shared.run(read)
        if not values:
            return LogColumns.empty()
        seqs = list(itertools.chain.from_iterable(range(last - len(rows) + 1, last + 1) for last, rows in values))
        skip = bisect.bisect_right(seqs, after_seq)  # the first value may hold records already read
        seqs = seqs[skip : skip + limit]
        if len({rows.dtype for _, rows in values}) == 1:
            rows = np.concatenate([rows for _, rows in values])[skip : skip + len(seqs)]
            return LogColumns(
                seqs, rows["status"].tolist(), rows["rank"].tolist(), rows["slot"].tolist(), rows["hash"].tolist()
            )
        # hashes of different lengths (never within one engine's namespace)
        columns = [
            list(itertools.chain.from_iterable(rows[name].tolist() for _, rows in values))[skip : skip + len(seqs)]
            for name in ("status", "rank", "slot", "hash")
        ]
        return LogColumns(seqs, *columns)

    def log_seq(self) -> int:
        if self._db("meta") is None:
            return 0
        return self._shared.run(self._log_seq)

    def _log_seq(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_LOG_SEQ_KEY, db=self._db("meta")) if self._db("meta") is not None else None
        if raw is not None and len(raw) != _SEQ.size:  # damaged: the log's last key says it too
            cur = txn.cursor(db=self._db("log"))
            raw = cur.key() if cur.last() and len(cur.key()) == _SEQ.size else None
        return _SEQ.unpack(raw)[0] if raw else 0

    def count(self) -> int:
        if self._db("blocks") is None:
            return 0
        return self._shared.run(lambda txn: txn.stat(self._db("blocks"))["entries"])

    # ------------------------------------------------------------ worker writes

    def needs_clearing(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> bool:
        """Whether ``clear_for_overwrite`` would change anything (a cheap read, so the
        common case of freshly freed slots costs no synced transaction)."""

        def read(txn):
            blocks, slot_db = self._db("blocks"), self._db("slots")
            for h, s in zip(hashes, slots):
                owner = txn.get(_SLOT.pack(s), db=slot_db)
                if owner is not None and owner != h and self._slot_of(txn.get(owner, db=blocks)) == s:
                    return True
                raw = txn.get(h, db=blocks)
                if raw is not None:
                    e = self.decode(h, raw)
                    if e is None or e.slot != s or e.has_rank(rank):
                        return True
            return False

        return self._shared.run(read)

    def clear_for_overwrite(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """Step 1 of a store: make sure no entry lets rank ``rank``'s copy of a target slot
        be loaded while it is overwritten. Deletes entries of other blocks in the target
        slots and stale entries of the target blocks in other slots, and clears
        ``rank``'s bit of target blocks already recorded in their target slot (deleting
        the entry when no rank's bit is left). One synced transaction."""
        self.commit_group([], [(rank, hashes, slots)])

    def commit_stored(
        self,
        rank: int,
        hashes: Sequence[bytes],
        slots: Sequence[int],
        sizes: Sequence[int],
        checksums: Sequence[int | None],
    ) -> None:
        """Step 3 of a store, after the bytes are durable: for each block whose checksum
        is not None set rank ``rank``'s bit and checksum (creating the entry) and the slot
        owner, and log ``ok``; log ``failed`` for the others. One synced transaction."""
        self.commit_group([StoredBlocks(rank, hashes, slots, sizes, checksums)], [])

    def commit_group(
        self, stored: Sequence["StoredBlocks"], clears: Sequence[tuple[int, Sequence[bytes], Sequence[int]]]
    ) -> None:
        """Several jobs' index writes in one synced transaction (group commit): first
        ``commit_stored`` for each of ``stored`` (their bytes must already be durable),
        then ``clear_for_overwrite`` for each ``(rank, hashes, slots)`` of ``clears``
        (the caller overwrites those slots only after this returns). Clearing last
        means a slot that is both committed and cleared here ends up not loadable, the
        safe side. Log records keep the order of ``stored``."""
        now = time.time()

        def write(txn):
            records: list[tuple[int, int, int, bytes]] = []
            order = 0  # a job's blocks keep their order in the LRU after a restart
            for job in stored:
                order = self._put_stored(txn, job, now, order, records)
            for rank, hashes, slots in clears:
                self._clear(txn, rank, hashes, slots)
            self._append_log(txn, records)

        self._write_log(write)

    def _put_stored(
        self,
        txn: lmdb.Transaction,
        job: "StoredBlocks",
        now: float,
        order: int,
        records: list[tuple[int, int, int, bytes]],
    ) -> int:
        blocks, slot_db = self._db("blocks"), self._db("slots")
        rank = job.rank
        for h, s, size, csum in zip(job.hashes, job.slots, job.sizes, job.checksums):
            if csum is None:
                records.append((LOG_FAILED, rank, s, h))
                continue
            sk = _SLOT.pack(s)
            owner = txn.get(sk, db=slot_db)
            if owner is not None and owner != h:
                self._delete_if_slot(txn, owner, s)
            raw = txn.get(h, db=blocks)
            e = None if raw is None else self.decode(h, raw)
            if e is None or e.slot != s or e.size != size:
                t = now + order * 1e-6
                order += 1
                e = Entry(s, size, 0, t, t, 0, (0,) * self.tp_size)
            sums = list(e.checksums)
            sums[rank] = csum
            txn.put(h, self.encode(h, e._replace(ranks=e.ranks | 1 << rank, checksums=tuple(sums))), db=blocks)
            txn.put(sk, h, db=slot_db)
            records.append((LOG_OK, rank, s, h))
        return order

    def _clear(self, txn: lmdb.Transaction, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        blocks, slot_db = self._db("blocks"), self._db("slots")
        for h, s in zip(hashes, slots):
            sk = _SLOT.pack(s)
            owner = txn.get(sk, db=slot_db)
            if owner is not None and owner != h:
                self._delete_if_slot(txn, owner, s)
                txn.delete(sk, db=slot_db)
            raw = txn.get(h, db=blocks)
            if raw is None:
                continue
            e = self.decode(h, raw)
            if e is None or e.slot != s:
                txn.delete(h, db=blocks)
            elif e.has_rank(rank):
                ranks = e.ranks & ~(1 << rank) & ((1 << self.tp_size) - 1)
                if not ranks:
                    # No rank's copy left: an entry no one committed would be a partial
                    # entry at TP 1, where a block commits in one transaction.
                    self._delete_if_slot(txn, h, s)
                    continue
                sums = list(e.checksums)
                sums[rank] = 0
                txn.put(h, self.encode(h, e._replace(ranks=ranks, checksums=tuple(sums))), db=blocks)

    def log_failed(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """Record failed stores. Never raises: records the index cannot take now are
        written with its next log write, or retried on a timer until one succeeds."""
        records = [(LOG_FAILED, rank, s, h) for h, s in zip(hashes, slots)]
        try:
            self._write_log(lambda txn: self._append_log(txn, records))
        except lmdb.Error as e:
            logger.error("index %s: cannot log %d failed stores yet (retried): %s", self.path, len(hashes), e)
            with self._unlogged_lock:
                self._unlogged += records
                self._retry_later()

    def _write_log(self, write: Callable[[lmdb.Transaction], None]) -> None:
        """Run ``write`` in one write transaction, the unlogged ``failed`` records appended
        after its own; they stay unlogged if it fails (its error raised)."""
        with self._unlogged_lock:
            pending, self._unlogged = self._unlogged, []

        def with_pending(txn: lmdb.Transaction) -> None:
            write(txn)
            self._append_log(txn, pending)

        try:
            self._shared.run(with_pending, write=True)
        except BaseException:
            with self._unlogged_lock:
                self._unlogged[:0] = pending
                if pending:
                    self._retry_later()
            raise
        if pending:
            logger.info("index %s: logged %d failed stores held back by an index error", self.path, len(pending))

    def _retry_later(self) -> None:
        """Under ``_unlogged_lock``: write the unlogged records on a timer unless one is set."""
        if self._closed or (self._retry is not None and self._retry.is_alive()):
            return
        self._retry = threading.Timer(self._retry_s, self._flush_unlogged)
        self._retry.daemon = True
        self._retry.start()

    def _flush_unlogged(self) -> None:
        with self._unlogged_lock:
            self._retry = None
            if self._closed or not self._unlogged:
                return
        try:
            self._write_log(lambda txn: None)
            self._retry_s = UNLOGGED_RETRY_S[0]
        except lmdb.Error as e:
            self._retry_s = min(self._retry_s * 2, UNLOGGED_RETRY_S[1])
            logger.debug("index %s: failed stores still unlogged: %s", self.path, e)

    def drop_corrupt(self, rank: int, items: Sequence[tuple[bytes, int]]) -> None:
        """Delete the entries of blocks found corrupt (only if still in that slot) and log
        ``corrupt`` records, so they are never served again."""

        def write(txn):
            for h, s in items:
                self._delete_if_slot(txn, h, s)
            self._append_log(txn, [(LOG_CORRUPT, rank, s, h) for h, s in items])

        self._write_log(write)

    # ------------------------------------------------------------ manager writes

    def apply_batch(
        self,
        deletions: Sequence[tuple[bytes, int]],
        touches: dict[bytes, tuple[float, int]],
        trim_log_upto: int,
        still_held: Callable[[Iterable[tuple[bytes, int]]], set[tuple[bytes, int]]] | None = None,
    ) -> int:
        """The manager's batched update, one transaction: delete ``(hash, slot)`` entries
        that still point at that slot (except those ``still_held`` reports, evaluated
        inside the transaction so a block re-stored meanwhile survives), update
        ``hash -> (last_access, extra hits)``, and drop log records up to
        ``trim_log_upto``. Returns the number of entries deleted."""

        def write(txn):
            held = still_held(deletions) if still_held is not None and deletions else set()
            deleted = 0
            for h, s in deletions:
                if (h, s) not in held and self._delete_if_slot(txn, h, s):
                    deleted += 1
            blocks = self._db("blocks")
            for h, (t, hits) in touches.items():
                raw = txn.get(h, db=blocks)
                e = None if raw is None else self.decode(h, raw)
                if e is not None:
                    txn.put(
                        h,
                        self.encode(
                            h, e._replace(last_access=max(e.last_access, t), hits=min(e.hits + hits, 0xFFFFFFFF))
                        ),
                        db=blocks,
                    )
            if trim_log_upto > 0:
                cur = txn.cursor(db=self._db("log"))
                if cur.first():
                    while cur.key() and _SEQ.unpack(cur.key())[0] <= trim_log_upto:
                        if not cur.delete():
                            break
            return deleted

        return self._shared.run(write, write=True)

    # ------------------------------------------------------------ helpers

    def _delete_if_slot(self, txn: lmdb.Transaction, h: bytes | memoryview, slot: int) -> bool:
        blocks = self._db("blocks")
        if self._slot_of(txn.get(h, db=blocks)) != slot:
            return False
        txn.delete(h, db=blocks)
        sk = _SLOT.pack(slot)
        if txn.get(sk, db=self._db("slots")) == h:
            txn.delete(sk, db=self._db("slots"))
        return True

    def _append_log(self, txn: lmdb.Transaction, records: Sequence[tuple[int, int, int, bytes]]) -> None:
        """Append ``records`` as one log value (one per run of equal hash lengths)."""
        if not records:
            return
        seq = self._log_seq(txn)
        log = self._db("log")
        for hash_len, run in itertools.groupby(records, key=lambda r: len(r[3])):
            parts = [LOG_HEADER.pack(hash_len)]
            for status, rank, slot, h in run:
                parts += (LOG_RECORD.pack(status, rank, slot), h)
            seq += (len(parts) - 1) // 2
            txn.put(_SEQ.pack(seq), b"".join(parts), db=log, append=True)
        txn.put(_LOG_SEQ_KEY, _SEQ.pack(seq), db=self._db("meta"))
