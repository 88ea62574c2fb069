"""Finding a disk cache's namespaces and reading their indexes, read-only.

Runs in the operator's process (``tiered-kv inspect``). Takes no lock and writes
nothing: namespaces are opened from their manifests and each index is read from one
LMDB MVCC snapshot after a walk over its pages, so this works on a cache an engine has
open, on one left by a crash, and on an empty directory. Anything that is not a cache is
reported as an ``InspectError`` with a one-line reason; so is a damaged index, with the
command that repairs it. An entry that is not the cache's own (a symbolic link, a FIFO,
another user's file: ``safe_open``) stops every command with a ``CacheEntryError``
naming it: nothing is read or written through it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np

from tiered_kv.disk.format.index import DiskIndex, IndexCorruptError
from tiered_kv.disk.format.index_records import IndexSnapshot, entry_dtype
from tiered_kv.fingerprint import NAMESPACE_ID_LEN
from tiered_kv.disk.format.namespace import MANIFEST, CacheEntryError, Namespace, NamespaceError
from tiered_kv.disk.format.safe_open import describe


#: Hidden directories that interrupted operations leave in a cache directory: a namespace
#: creation (``.tmp-``), a ``clear`` (``.trash-``) and a ``bench`` (``.tiered-kv-bench-``).
#: ``.tiered-kv-canary-``: a worker's start-up canary stopped before removing its scratch store
#: (``integrations/vllm/canary_disk.SCRATCH_PREFIX``).
LEFTOVER_PREFIXES = (".tmp-", ".trash-", ".tiered-kv-bench-", ".tiered-kv-canary-")
_NAMESPACE_NAME = re.compile(f"[0-9a-f]{{{NAMESPACE_ID_LEN}}}")


class InspectError(RuntimeError):
    """An inspector operation cannot proceed (one-line, operator-facing reason)."""


@dataclass
class CacheDir:
    """A cache directory: its readable namespaces, the namespace-like directories that
    cannot be read (with why), and leftovers of interrupted operations
    (``LEFTOVER_PREFIXES``)."""

    path: Path
    namespaces: list[Namespace] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    leftovers: list[Path] = field(default_factory=list)


def open_cache(path: str | os.PathLike, namespace: str | None = None) -> CacheDir:
    """Open ``path``, a cache directory or one namespace directory inside one.

    ``namespace`` keeps only namespaces whose id starts with it. Raises
    ``InspectError`` when ``path`` is missing, is a file, holds other things but no
    namespace, or no namespace matches. An empty directory is an empty cache.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise InspectError(f"{root} does not exist")
    if not root.is_dir():
        raise InspectError(f"{root} is a file, not a disk cache directory")
    cache = CacheDir(root)
    if os.path.lexists(root / MANIFEST):
        cache.namespaces.append(_open_namespace(root))
    else:
        try:
            children = sorted(root.iterdir())
        except OSError as e:
            raise InspectError(f"cannot list {root}: {e.strerror}") from None
        others = 0
        for child in children:
            if child.name.startswith(LEFTOVER_PREFIXES) and child.is_dir():
                cache.leftovers.append(child)
            elif child.is_dir() and os.path.lexists(child / MANIFEST):
                try:
                    cache.namespaces.append(_open_namespace(child))
                except InspectError as e:
                    cache.unreadable.append((child, str(e)))
            elif _NAMESPACE_NAME.fullmatch(child.name) and (child.is_symlink() or not child.is_dir()):
                # Named like a namespace but not a directory: planted, never read through.
                raise CacheEntryError(child, describe(child), "a directory")
            elif not child.name.startswith("."):
                others += 1
        if others and not cache.namespaces and not cache.unreadable:
            raise InspectError(
                f"{root} is not a tiered-kv disk cache: it holds {others} entries but "
                f"no namespace directory (a subdirectory with {MANIFEST})"
            )
    if namespace:
        matching = [ns for ns in cache.namespaces if ns.path.name.startswith(namespace)]
        if not matching:
            known = ", ".join(ns.path.name for ns in cache.namespaces) or "none"
            raise InspectError(f"no namespace matching {namespace!r} in {root} (namespaces: {known})")
        cache.namespaces = matching
        cache.unreadable = [(p, why) for p, why in cache.unreadable if p.name.startswith(namespace)]
    return cache


def _open_namespace(ns_dir: Path) -> Namespace:
    """``ns_dir`` opened read-only (its manifest checked field by field). Raises
    ``InspectError``, or ``CacheEntryError`` for an entry that is not the cache's own."""
    try:
        return Namespace.open_path(ns_dir)
    except CacheEntryError:
        raise
    except NamespaceError as e:
        raise InspectError(str(e)) from None


@dataclass
class EntryTable:
    """Every index entry of one namespace as numpy columns, one row per block.

    Built from one bulk snapshot (no per-entry Python objects for the common case), so
    filtering and sorting a million entries takes a fraction of a second.
    """

    slot: np.ndarray  # int64
    size: np.ndarray  # int64
    hits: np.ndarray  # int64
    store_time: np.ndarray  # float64, seconds since the epoch
    last_access: np.ndarray  # float64
    ranks: np.ndarray  # uint64 bitmask
    checksums: np.ndarray  # uint64 (n, tp_size)
    tp_size: int
    _snapshot: IndexSnapshot

    @classmethod
    def from_snapshot(cls, snap: IndexSnapshot, tp_size: int) -> "EntryTable":
        e, odd = snap.entries, [entry for _, entry in snap.odd]

        def col(name: str, dtype) -> np.ndarray:
            extra = np.array([getattr(x, name) for x in odd], dtype=dtype)
            return np.concatenate([e[name].astype(dtype), extra])

        sums = np.concatenate(
            [
                e["checksums"].reshape(len(e), tp_size).astype(np.uint64),
                np.array([x.checksums for x in odd], dtype=np.uint64).reshape(-1, tp_size),
            ]
        )
        return cls(
            col("slot", np.int64),
            col("size", np.int64),
            col("hits", np.int64),
            col("store_time", np.float64),
            col("last_access", np.float64),
            col("ranks", np.uint64),
            sums,
            tp_size,
            snap,
        )

    @classmethod
    def empty(cls, tp_size: int) -> "EntryTable":
        return cls.from_snapshot(IndexSnapshot(np.zeros(0, entry_dtype(tp_size, 1)), [], 0), tp_size)

    def __len__(self) -> int:
        return len(self.slot)

    @property
    def in_hash_order(self) -> bool:
        """Whether rows are sorted by hash (the index's key order; true unless the index
        holds hashes of several lengths)."""
        return not self._snapshot.odd

    def hash(self, i: int) -> bytes:
        """The block hash of row ``i``."""
        n = len(self._snapshot.entries)
        return self._snapshot.hash_at(i) if i < n else self._snapshot.odd[i - n][0]

    @property
    def complete(self) -> np.ndarray:
        """Rows whose every TP rank has committed its bytes (the loadable ones, if valid)."""
        full = np.uint64((1 << self.tp_size) - 1)
        return (self.ranks & full) == full

    def rank_counts(self) -> np.ndarray:
        """Ranks present per row."""
        counts = np.zeros(len(self), dtype=np.int64)
        for r in range(self.tp_size):
            counts += ((self.ranks >> np.uint64(r)) & np.uint64(1)).astype(np.int64)
        return counts

    def hash_prefix_mask(self, hex_prefix: str) -> np.ndarray:
        """Rows whose hash, in hex, starts with ``hex_prefix``. Raises ``InspectError``
        for a prefix that is not hexadecimal."""
        try:
            int(hex_prefix, 16)
        except ValueError:
            raise InspectError(f"--hash: expected a hexadecimal prefix, got {hex_prefix!r}") from None
        prefix = hex_prefix.lower()
        whole = bytes.fromhex(prefix[: len(prefix) // 2 * 2])
        nibble = int(prefix[-1], 16) if len(prefix) % 2 else None
        mask = np.zeros(len(self), dtype=bool)
        main = self._snapshot.entries
        if len(main):
            raw = np.ascontiguousarray(main["hash"]).view(np.uint8).reshape(len(main), -1)
            width = raw.shape[1]
            if len(whole) + (nibble is not None) <= width:
                m = np.all(raw[:, : len(whole)] == np.frombuffer(whole, dtype=np.uint8), axis=1)
                if nibble is not None:
                    m &= (raw[:, len(whole)] >> 4) == nibble
                mask[: len(main)] = m
        for j, (h, _) in enumerate(self._snapshot.odd):
            mask[len(main) + j] = h.hex().startswith(prefix)
        return mask


def read_entries(ns: Namespace, index: DiskIndex | None = None) -> EntryTable:
    """All of ``ns``'s index entries. Uses ``index`` if given, else opens the index
    read-only for the duration of the read. A namespace whose index was never written
    has no entries. Raises ``InspectError`` when the index cannot be read."""
    own = index is None
    try:
        if index is None:
            try:
                index = ns.open_index(readonly=True)
            except FileNotFoundError:
                return EntryTable.empty(ns.tp_size)
        try:
            index.check_pages()
            return EntryTable.from_snapshot(index.load_all(), ns.tp_size)
        finally:
            if own:
                index.close()
    except IndexCorruptError as e:
        raise InspectError(
            f"{e}; `tiered-kv inspect verify --repair {ns.path}` (with the engine stopped) "
            f"moves it aside and starts the namespace empty"
        ) from None
    except lmdb.Error as e:
        raise InspectError(f"cannot read the index of {ns.path}: {e}") from None
