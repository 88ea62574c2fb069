"""A page walk of an LMDB data file (``data.mdb``), to find damage before LMDB meets it.

Run by the writers that open a disk index (``index_env``: scheduler, workers, disk I/O
processes) and by ``tiered-kv inspect verify``; reads the file through a read-only
``mmap``, writes nothing. LMDB trusts its pages: a flipped bit in a branch page's child
pointer is "Located page was wrong type" in the middle of serving, and one in the free
list hands out pages still in use, failing every later commit. Its own compacting copy
walks the trees without checking what it finds. This walk checks, for the newest meta
page, every database reachable from it (the main one, each named one, the free list):

- every page it reaches is inside the file, reached once, with its own number in its
  header and the type its parent says (branch or leaf at the right depth, overflow runs
  where a leaf node points), and bounds (``lower``/``upper``, node offsets and sizes)
  that stay inside the page;
- each database's page counts, depth and entry count equal what its record says;
- every page number in the free list is inside the file, listed once, and not a page
  some database still uses.

It is numpy over whole levels of the trees at once (no Python per entry): for an index
of a million blocks it costs a fraction of LMDB's own copy.

Layout (LMDB 0.9, 64-bit; ``mdb.c``): a page starts with ``pgno`` (u64), ``pad``,
``flags``, ``lower``, ``upper`` (u16 each; an overflow page has ``pages`` (u32) in
place of the last two), then ``lower - 16`` bytes of u16 node offsets. A node is
``lo``, ``hi``, ``flags``, ``ksize`` (u16) then the key and the data: in a branch the
child page number is ``lo | hi << 16 | flags << 32``; in a leaf the data size is
``lo | hi << 16``. A database record (``MDB_db``, 48 bytes) is ``pad`` (u32), ``flags``,
``depth`` (u16), then ``branch``, ``leaf``, ``overflow`` page counts, ``entries`` and
``root`` (u64). A meta page holds magic, version, address, map size, the free list's
and the main database's records, the last page number and the transaction id.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
HEADER = 16
NODE = 8
P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
_TYPE_BITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40  # branch, leaf, overflow, meta, leaf2, subpage
F_BIGDATA, F_SUBDATA = 0x01, 0x02
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
_META = struct.Struct("<II8xQ")  # magic, version, (address), map size
_TAIL = struct.Struct("<QQ")  # last page number, transaction id
_FREE_AT, _MAIN_AT = HEADER + _META.size, HEADER + _META.size + _DB.size
_TAIL_AT = HEADER + _META.size + 2 * _DB.size


class LmdbDamage(Exception):
    """The data file is damaged; the message says where and how."""


class _Db:
    def __init__(self, name: str, raw: bytes):
        (_, self.flags, self.depth, self.branch, self.leaf, self.overflow, self.entries, self.root) = _DB.unpack(raw)
        self.name = name


def read_meta(head: bytes, psize: int | None = None, txnid: int | None = None) -> tuple[int, int, _Db, _Db] | None:
    """(page size, last page number, free list record, main database record) of the
    newest valid meta page in the file's first two pages, or of the one of transaction
    ``txnid`` (None when neither is: writers have moved on since)."""
    best = None
    size = psize or 4096
    for i in (0, 1):
        if psize is None and i == 1:
            size = _DB.unpack_from(head, _FREE_AT)[0]  # meta 0 keeps the page size in the free record's pad
            if size < 512 or size > 65536 or size & (size - 1):
                raise LmdbDamage(f"meta page 0 names a page size of {size}")
        page = head[i * size : (i + 1) * size]
        if len(page) < _TAIL_AT + _TAIL.size:
            raise LmdbDamage("the file is shorter than its two meta pages")
        magic, version, _ = _META.unpack_from(page, HEADER)
        if magic != MAGIC or version != DATA_VERSION:
            continue
        last, tid = _TAIL.unpack_from(page, _TAIL_AT)
        if (best is None or tid > best[0]) and (txnid is None or tid == txnid):
            best = (tid, last, page)
    if best is None:
        if txnid is not None:
            return None
        raise LmdbDamage("neither meta page is valid")
    psize = psize or _DB.unpack_from(head, _FREE_AT)[0]
    _, last, page = best
    return (
        psize,
        last,
        _Db("free list", page[_FREE_AT : _FREE_AT + _DB.size]),
        _Db("main", page[_MAIN_AT : _MAIN_AT + _DB.size]),
    )


def check_data_file(fd: int, txnid: int | None = None) -> bool:
    """Walk the LMDB data file open as ``fd`` (module docstring); raise ``LmdbDamage``
    naming the first problem found. An empty file (LMDB starts it afresh) passes.

    While other processes may write, the caller holds a read transaction and passes
    its ``txnid``: LMDB then reuses no page of that snapshot, and the walk is of its
    meta page. Returns False, having checked nothing, when that meta page has been
    overwritten meanwhile (two commits since the transaction began)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return True
    head = os.pread(fd, 2 * 65536, 0)
    meta = read_meta(head, txnid=txnid)
    if meta is None:
        return False
    psize, last, free, main = meta
    npages = last + 1
    if npages * psize > size:
        raise LmdbDamage(f"the meta page names {npages} pages but the file holds {size // psize}")
    if npages < 2:
        raise LmdbDamage(f"the meta page names {npages} pages, fewer than the two meta pages")
    # Unmapped when the last array over it goes (an exception's traceback may hold one).
    m = mmap.mmap(fd, npages * psize, prot=mmap.PROT_READ)
    _Walk(np.frombuffer(m, dtype=np.uint8).reshape(npages, psize), psize, npages, free, main).run()
    return True


class _Walk:
    def __init__(self, pages: np.ndarray, psize: int, npages: int, free: _Db, main: _Db):
        self.pages, self.psize, self.npages = pages, psize, npages
        self.words = pages.reshape(-1).view("<u2")
        self.free_db, self.main_db = free, main
        self.used = np.zeros(npages, dtype=bool)
        self.used[:2] = True  # meta pages

    def run(self) -> None:
        free_leaves = self.tree(self.free_db)
        subs = self.tree(self.main_db, want_subdbs=True)
        for name, raw in subs:
            self.tree(_Db(name, raw))
        self.free_list(free_leaves)

    # ---------------------------------------------------------------- trees

    def _u16(self, pg: np.ndarray, off: np.ndarray) -> np.ndarray:
        """The u16 at even byte ``off`` of each page ``pg`` (as int64)."""
        return self.words[(pg * self.psize + off) >> 1].astype(np.int64)

    def _u64(self, pg: np.ndarray, off: np.ndarray) -> np.ndarray:
        """The u64 at byte ``off`` (any alignment) of each page ``pg``."""
        out = np.zeros(len(pg), dtype=np.uint64)
        flat = self.pages.reshape(-1)
        at = pg * self.psize + off
        for k in range(8):
            out |= flat[at + k].astype(np.uint64) << np.uint64(8 * k)
        return out

    def _claim(self, pg: np.ndarray, what: str) -> None:
        """Mark pages ``pg`` used, raising if any is outside the file or used twice."""
        if len(pg) and (pg.min() < 2 or pg.max() >= self.npages):
            bad = pg[(pg < 2) | (pg >= self.npages)][0]
            raise LmdbDamage(f"{what} points at page {bad}, outside pages 2..{self.npages - 1}")
        if len(np.unique(pg)) != len(pg) or self.used[pg].any():
            raise LmdbDamage(f"{what} reaches a page that is already in use")
        self.used[pg] = True

    def _headers(self, pg: np.ndarray, kind: int, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Check the headers of pages ``pg`` (all of type ``kind``); their (lower, upper,
        node count)."""
        z = np.zeros(len(pg), dtype=np.int64)
        number = self.pages.reshape(-1).view("<u8")[pg * (self.psize // 8)]
        if (number != pg.astype(np.uint64)).any():
            raise LmdbDamage(f"{what}: page {pg[number != pg.astype(np.uint64)][0]} carries another page's number")
        flags = self._u16(pg, z + 10)
        if ((flags & _TYPE_BITS) != kind).any():
            bad = (flags & _TYPE_BITS) != kind
            raise LmdbDamage(f"{what}: page {pg[bad][0]} has type {int(flags[bad][0]):#x}, expected {kind:#x}")
        lower, upper = self._u16(pg, z + 12), self._u16(pg, z + 14)
        count = (lower - HEADER) // 2
        bad = (lower < HEADER) | ((lower - HEADER) % 2 != 0) | (upper < lower) | (upper > self.psize) | (count < 1)
        if bad.any():
            raise LmdbDamage(f"{what}: page {pg[bad][0]} has bounds {int(lower[bad][0])}..{int(upper[bad][0])}")
        return lower, upper, count

    def _nodes(
        self, pg: np.ndarray, upper: np.ndarray, count: np.ndarray, what: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every node of pages ``pg``: (page of each, offset, lo|hi<<16, flags, ksize)."""
        page_of = np.repeat(pg, count)
        first = np.repeat(np.cumsum(count) - count, count)
        slot = np.arange(int(count.sum()), dtype=np.int64) - first
        off = self._u16(page_of, HEADER + 2 * slot)
        outside = (off < np.repeat(upper, count)) | (off > self.psize - NODE)
        if outside.any():
            raise LmdbDamage(f"{what}: a node of page {page_of[outside][0]} lies outside its page's node area")
        # The four u16 of each node header in one gather (they are adjacent).
        head = self.words[((page_of * self.psize + off) >> 1)[:, None] + np.arange(4)].astype(np.int64)
        return page_of, off, head[:, 0] | (head[:, 1] << 16), head[:, 2], head[:, 3]

    def _tiled(self, pg: np.ndarray, upper: np.ndarray, count: np.ndarray, node_bytes: np.ndarray, what: str) -> None:
        """Raise unless each page's nodes (``node_bytes`` each, in page order) exactly fill
        its node area ``upper``..end: a changed size would make LMDB move the wrong bytes."""
        used = np.add.reduceat((node_bytes + 1) & ~1, np.cumsum(count) - count) if len(pg) else node_bytes
        if (used != self.psize - upper).any():
            bad = used != self.psize - upper
            raise LmdbDamage(
                f"{what}: the nodes of page {pg[bad][0]} take {int(used[bad][0])} bytes of its "
                f"{int((self.psize - upper)[bad][0])}-byte node area"
            )

    def tree(self, db: _Db, want_subdbs: bool = False) -> Any:  # arrays, or a list (want_subdbs)
        """Walk ``db``'s tree; returns the leaf nodes of the free list as (page, offset,
        size, flags, ksize) arrays, or, with ``want_subdbs``, the (name, record) of each
        named database."""
        what = f"the {db.name} database"
        if db.root == P_INVALID:
            if db.depth or db.entries or db.branch or db.leaf or db.overflow:
                raise LmdbDamage(f"{what} is empty but its record counts pages or entries")
            return [] if want_subdbs else None
        level = np.array([db.root], dtype=np.int64)
        branches = 0
        for depth in range(1, 64):
            self._claim(level, what)
            is_leaf = depth == db.depth
            _, upper, count = self._headers(level, P_LEAF if is_leaf else P_BRANCH, what)
            nodes = self._nodes(level, upper, count, what)
            if is_leaf:
                leaf_upper, leaf_count = upper, count
                break
            self._tiled(level, upper, count, NODE + nodes[4], what)
            if depth > db.depth:
                raise LmdbDamage(f"{what} is deeper than its record's depth {db.depth}")
            branches += len(level)
            page_of, off, lo_hi, hi32, _ = nodes
            level = (lo_hi | (hi32 << 32)).astype(np.int64)
        else:
            raise LmdbDamage(f"{what} has no leaves")
        if db.depth == 0:
            raise LmdbDamage(f"{what} has a root but its record's depth is 0")
        page_of, off, size, flags, ksize = nodes
        if branches != db.branch or len(level) != db.leaf or len(page_of) != db.entries:
            raise LmdbDamage(
                f"{what}: {branches} branch and {len(level)} leaf pages with {len(page_of)} entries "
                f"found, its record says {db.branch}, {db.leaf} and {db.entries}"
            )
        if (flags & ~(F_BIGDATA | F_SUBDATA)).any():
            raise LmdbDamage(
                f"{what}: a node of page {page_of[(flags & ~(F_BIGDATA | F_SUBDATA)) != 0][0]} has unknown flags"
            )
        big = (flags & F_BIGDATA) != 0
        inline = np.where(big, 8, size)
        if (off + NODE + ksize + inline > self.psize).any():
            raise LmdbDamage(
                f"{what}: a node of page {page_of[off + NODE + ksize + inline > self.psize][0]} runs past its page"
            )
        self._tiled(level, leaf_upper, leaf_count, NODE + ksize + inline, what)
        self._overflow(page_of[big], off[big] + NODE + ksize[big], size[big], db, what)
        if want_subdbs:
            sub = (flags & F_SUBDATA) != 0
            if (sub & big).any() or ((size != _DB.size) & sub).any():
                raise LmdbDamage(f"{what}: a named database's record is malformed")
            out = []
            for p, o, k in zip(page_of[sub].tolist(), off[sub].tolist(), ksize[sub].tolist()):
                row = self.pages[p]
                name = bytes(row[o + NODE : o + NODE + k]).decode("utf-8", "replace")
                out.append((repr(name), bytes(row[o + NODE + k : o + NODE + k + _DB.size])))
            return out
        return page_of, off, size, flags, ksize

    def _overflow(self, page_of: np.ndarray, at: np.ndarray, size: np.ndarray, db: _Db, what: str) -> None:
        """Check the overflow runs the big nodes point at (their page number at ``at``)."""
        first = self._u64(page_of, at).astype(np.int64) if len(page_of) else np.zeros(0, np.int64)
        if len(first) and (first.min() < 2 or first.max() >= self.npages):
            raise LmdbDamage(f"{what}: a value points at overflow page outside the file")
        z = np.zeros(len(first), dtype=np.int64)
        if len(first):
            number = self.pages.reshape(-1).view("<u8")[first * (self.psize // 8)]
            flags = self._u16(first, z + 10)
            if (number != first.astype(np.uint64)).any() or ((flags & _TYPE_BITS) != P_OVERFLOW).any():
                raise LmdbDamage(f"{what}: a value points at a page that is not an overflow page")
        runs = (self._u16(first, z + 12) | (self._u16(first, z + 14) << 16)) if len(first) else z
        if len(first) and ((runs < 1) | (runs * self.psize - HEADER < size) | (first + runs > self.npages)).any():
            raise LmdbDamage(f"{what}: an overflow run is too short for its value or runs past the file")
        if int(runs.sum()) != db.overflow:
            raise LmdbDamage(f"{what}: {int(runs.sum())} overflow pages found, its record says {db.overflow}")
        self._claim(
            np.repeat(first, runs) + (np.arange(int(runs.sum())) - np.repeat(np.cumsum(runs) - runs, runs)), what
        )

    # ---------------------------------------------------------------- free list

    def free_list(self, leaves: tuple[np.ndarray, ...] | None) -> None:
        if leaves is None:
            return
        page_of, off, size, flags, ksize = leaves
        listed = []
        for p, o, n, f, k in zip(page_of.tolist(), off.tolist(), size.tolist(), flags.tolist(), ksize.tolist()):
            if k != 8 or n % 8 or n < 8:
                raise LmdbDamage(f"the free list: an entry of page {p} is malformed")
            if f & F_BIGDATA:
                at = int(self._u64(np.array([p]), np.array([o + NODE + k]))[0])
                raw = self.pages[at : at + (HEADER + n + self.psize - 1) // self.psize].reshape(-1)[HEADER : HEADER + n]
            else:
                raw = self.pages[p, o + NODE + k : o + NODE + k + n]
            ids = np.frombuffer(np.ascontiguousarray(raw).tobytes(), dtype="<u8").astype(np.int64)
            if ids[0] != len(ids) - 1:
                raise LmdbDamage(f"the free list: an entry of page {p} counts {ids[0]} pages but holds {len(ids) - 1}")
            listed.append(ids[1:])
        free = np.concatenate(listed) if listed else np.zeros(0, dtype=np.int64)
        if len(free) and (free.min() < 2 or free.max() >= self.npages):
            raise LmdbDamage("the free list names a page outside the file")
        if len(np.unique(free)) != len(free):
            raise LmdbDamage("the free list names a page twice")
        if self.used[free].any():
            raise LmdbDamage(f"the free list names page {free[self.used[free]][0]}, which a database uses")
