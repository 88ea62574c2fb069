"""The disk index's records and their byte layout: entries, log records, snapshots.

Pure data (all processes: scheduler, workers, their disk I/O processes, the inspector);
no I/O. ``index.py`` reads and writes these in the LMDB environment; its docstring
describes the sub-databases whose values are laid out here.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "Entry",
    "IndexSnapshot",
    "LogColumns",
    "LogRecord",
    "StoredBlocks",
    "ENTRY_HEADER",
    "LOG_HEADER",
    "LOG_RECORD",
    "entry_dtype",
    "log_dtype",
    "log_rows",
    "sane_time",
    "sane_times",
    "LOG_OK",
    "LOG_FAILED",
    "LOG_CORRUPT",
    "LOG_STATUS_NAMES",
]

#: Log record statuses.
LOG_OK, LOG_FAILED, LOG_CORRUPT = 0, 1, 2
LOG_STATUS_NAMES = {LOG_OK: "ok", LOG_FAILED: "failed", LOG_CORRUPT: "corrupt"}

#: A ``blocks`` value's fixed part (then a checksum per rank, then the hash).
ENTRY_HEADER = struct.Struct("<qIIddQ")  # slot, size, hits, store_time, last_access, ranks
LOG_RECORD = struct.Struct("<BIq")  # one log record: status, rank, slot (+ hash bytes)
LOG_HEADER = struct.Struct("<H")  # a log value: the hash length of its records, then the records
_MAX_TIME = 1e11


def entry_dtype(tp_size: int, hash_len: int) -> np.dtype:
    """numpy layout of a ``blocks`` value for ``tp_size`` ranks and ``hash_len``-byte
    hashes (packed, little-endian). ``hash`` compares like the bytes (fixed length)."""
    return np.dtype(
        [
            ("slot", "<i8"),
            ("size", "<u4"),
            ("hits", "<u4"),
            ("store_time", "<f8"),
            ("last_access", "<f8"),
            ("ranks", "<u8"),
            ("checksums", "<u8", (tp_size,)),
            ("hash", f"S{hash_len}"),
        ]
    )


class Entry(NamedTuple):
    """One block's index record. ``ranks`` has bit r set once rank r's bytes are durable
    and ``checksums[r]`` recorded."""

    slot: int
    size: int
    hits: int
    store_time: float
    last_access: float
    ranks: int
    checksums: tuple[int, ...]

    def has_rank(self, rank: int) -> bool:
        return bool(self.ranks >> rank & 1)


class StoredBlocks(NamedTuple):
    """One job's outcome on one rank for ``commit_group``: a checksum per block, None
    for a block whose store failed (logged ``failed``, not made loadable)."""

    rank: int
    hashes: Sequence[bytes]
    slots: Sequence[int]
    sizes: Sequence[int]
    checksums: Sequence[int | None]


def log_dtype(hash_len: int) -> np.dtype:
    """A log record (``LOG_RECORD`` then the hash) as a packed numpy record."""
    return np.dtype([("status", "u1"), ("rank", "<u4"), ("slot", "<i8"), ("hash", f"V{hash_len}")])


def log_rows(value: bytes, tp_size: int | None = None) -> np.ndarray | None:
    """The records of a log value, as ``_log_dtype`` rows; None for a value that is not
    one (damage), and without records of statuses or ranks (below ``tp_size``) that
    cannot be."""
    if len(value) < LOG_HEADER.size:
        return None
    (hash_len,) = LOG_HEADER.unpack_from(value)
    dtype = log_dtype(hash_len)
    if not hash_len or (len(value) - LOG_HEADER.size) % dtype.itemsize or len(value) == LOG_HEADER.size:
        return None
    rows = np.frombuffer(value, dtype=dtype, offset=LOG_HEADER.size)
    if tp_size is not None:
        sane = (rows["status"] <= LOG_CORRUPT) & (rows["rank"] < tp_size) & (rows["slot"] >= 0)
        if not sane.all():
            return None
    return rows


def sane_time(t: float) -> float:
    """A stored or access time as read from the index: 0 where damage left no time at
    all (not finite, negative, or past the year 5000)."""
    return t if math.isfinite(t) and 0.0 <= t < _MAX_TIME else 0.0


def sane_times(arr: np.ndarray) -> np.ndarray:
    """``sane_time`` over the entries of ``arr`` (writable), in place."""
    for name in ("store_time", "last_access"):
        col = arr[name]
        bad = ~((col >= 0.0) & (col < _MAX_TIME))  # NaN compares false
        if bad.any():
            col[bad] = 0.0
    return arr


class LogRecord(NamedTuple):
    seq: int
    status: int
    rank: int
    slot: int
    block_hash: bytes


class LogColumns(NamedTuple):
    """Log records as parallel lists (``seq`` ascending)."""

    seq: list[int]
    status: list[int]
    rank: list[int]
    slot: list[int]
    block_hash: list[bytes]

    @classmethod
    def empty(cls) -> "LogColumns":
        return cls([], [], [], [], [])

    def records(self) -> list[LogRecord]:
        return [LogRecord(*r) for r in zip(*self)]


@dataclass
class IndexSnapshot:
    """All ``blocks`` entries at one instant (see ``DiskIndex.load_all``).

    ``entries`` is a structured array (``entry_dtype``) of the entries whose hash has the
    most common length, sorted by hash; ``odd`` holds the rest as ``(hash, Entry)``.
    ``log_seq`` is the last log record the snapshot reflects.
    """

    entries: np.ndarray
    odd: list[tuple[bytes, Entry]]
    log_seq: int

    def __len__(self) -> int:
        return len(self.entries) + len(self.odd)

    def hash_at(self, i: int) -> bytes:
        """The exact bytes of ``entries[i]``'s hash (numpy's ``S`` drops trailing NULs)."""
        return self.entries[i : i + 1]["hash"].view(np.uint8).tobytes()
