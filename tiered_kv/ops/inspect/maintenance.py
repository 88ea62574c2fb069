"""Changing a disk cache from the operator's side: ``evict``, ``clear`` and the index
edits of ``verify --repair``.

Operator's process. Each operation first takes the writer lock of every namespace it
touches (the lock an engine's scheduler holds for its whole life), then the namespace
directory's lock exclusively (every engine process holds it shared while it has the
namespace open, workers included: ``namespace``), so it runs only while no engine
process has the cache open, even one still starting, and an engine that starts
meanwhile is refused until it is done. Index edits are ordinary LMDB write
transactions (synced); an evicted entry's slot is free for the next engine, but the
slab files keep their preallocated size: ``clear`` is what returns disk space, by
deleting whole namespaces.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered_kv.disk.format.index import DiskIndex, IndexCorruptError
from tiered_kv.disk.format.namespace import CacheLockedError, Namespace, WriterLock
from tiered_kv.ops.inspect.cache import CacheDir, EntryTable, InspectError, read_entries

#: Index deletions per write transaction (bounds one transaction's size and duration).
DELETE_BATCH = 100_000


def _holder_text(holder: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"])) if "started" in holder else "?"
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
        f"(engine {holder.get('engine_id', '?')}, since {since})"
    )


@contextlib.contextmanager
def exclusive(namespaces: Sequence[Namespace], action: str) -> Iterator[None]:
    """Hold the writer lock and the directory lock of every namespace in
    ``namespaces`` (all or none). Raises ``InspectError`` naming the holder when an
    engine has one open, or saying that an engine process is starting on it."""
    locks: list[WriterLock] = []
    held: list[Namespace] = []
    try:
        for ns in namespaces:
            try:
                locks.append(WriterLock.acquire(ns, f"tiered-kv inspect {action} ({os.getpid()})"))
            except CacheLockedError as e:
                raise InspectError(
                    f"refusing to {action}: namespace {ns.path.name} is open by an engine, "
                    f"{_holder_text(e.holder)}; stop it first (read-only commands work "
                    f"while it runs)"
                ) from None
            if not ns.lock_exclusive():
                raise InspectError(
                    f"refusing to {action}: namespace {ns.path.name} is open by an engine process "
                    f"that holds no writer lock (a worker, or an engine starting up); stop it "
                    f"first (read-only commands work while it runs)"
                )
            held.append(ns)
        yield
    finally:
        for ns in held:
            fcntl.flock(ns.fd, fcntl.LOCK_UN)
        for lock in locks:
            lock.release()


def open_index_for_writing(ns: Namespace, repair: bool = False) -> DiskIndex | None:
    """``ns``'s index opened for writing (its pages walked), or None when it was never
    created. Call only while holding ``ns``'s locks (``exclusive``). A damaged index is
    an ``InspectError`` naming the repair command, or with ``repair`` is moved aside to
    ``index.lmdb.corrupt`` and replaced by an empty one (as an engine's start does)."""
    if not (ns.index_path / "data.mdb").exists():
        return None
    try:
        return ns.open_index(expected_entries=ns.manifest.num_slots, repair=repair)
    except IndexCorruptError as e:
        raise InspectError(
            f"{e}; `tiered-kv inspect verify --repair {ns.path}` moves it aside and starts the namespace empty"
        ) from None


def delete_entries(
    index: DiskIndex, items: Sequence[tuple[bytes, int]], progress: Callable[[int], None] | None = None
) -> int:
    """Delete ``(hash, slot)`` entries (each only if it still points at that slot), in
    batches; returns how many were deleted."""
    deleted = 0
    for start in range(0, len(items), DELETE_BATCH):
        batch = items[start : start + DELETE_BATCH]
        deleted += index.apply_batch(batch, {}, 0)
        if progress is not None:
            progress(len(batch))
    return deleted


# ---------------------------------------------------------------- evict


@dataclass
class EvictResult:
    """What ``evict`` removed, per namespace id: ``{"evicted": n, "freed_bytes": b,
    "used_before": b0, "used_after": b1}``."""

    namespaces: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def evicted(self) -> int:
        return sum(v["evicted"] for v in self.namespaces.values())

    @property
    def freed_bytes(self) -> int:
        return sum(v["freed_bytes"] for v in self.namespaces.values())

    def to_dict(self) -> dict[str, Any]:
        return {"evicted": self.evicted, "freed_bytes": self.freed_bytes, "namespaces": self.namespaces}


def evict(
    cache: CacheDir,
    *,
    to_size: int | None = None,
    older_than: float | None = None,
    now: float | None = None,
    progress: Callable[[int], None] | None = None,
    dry_run: bool = False,
) -> EvictResult:
    """Drop blocks from ``cache``'s namespaces: every entry last accessed more than
    ``older_than`` seconds ago, then least recently used complete blocks across all the
    namespaces until their used bytes (slot bytes x TP ranks per block) are at most
    ``to_size``. Raises ``InspectError`` if an engine holds any of them, or if neither
    bound is given. ``dry_run`` reports what would go from a read-only snapshot, taking
    no lock and changing nothing."""
    if to_size is None and older_than is None:
        raise InspectError("evict needs --to-size SIZE or --older-than AGE")
    if to_size is not None and to_size < 0:
        raise InspectError(f"--to-size must be >= 0, got {to_size}")
    if older_than is not None and older_than < 0:
        raise InspectError(f"--older-than must be >= 0, got {older_than}")
    now = time.time() if now is None else now
    result = EvictResult()
    with contextlib.nullcontext() if dry_run else exclusive(cache.namespaces, "evict"):
        indexes: list[DiskIndex | None] = []
        try:
            tables: list[EntryTable] = []
            for ns in cache.namespaces:
                index = None if dry_run else open_index_for_writing(ns)
                indexes.append(index)
                tables.append(read_entries(ns, index) if index is not None or dry_run else EntryTable.empty(ns.tp_size))
            victims = _choose_victims(cache.namespaces, tables, to_size, older_than, now)
            for ns, table, index, rows in zip(cache.namespaces, tables, indexes, victims):
                per_block = ns.manifest.slot_size * ns.tp_size
                used = int(table.complete.sum()) * per_block
                deleted = len(rows) if dry_run else 0
                if index is not None and len(rows):
                    deleted = delete_entries(
                        index, [(table.hash(i), int(table.slot[i])) for i in rows.tolist()], progress
                    )
                freed = int(table.complete[rows].sum()) * per_block
                result.namespaces[ns.path.name] = {
                    "evicted": deleted,
                    "freed_bytes": freed,
                    "used_before": used,
                    "used_after": used - freed,
                }
        finally:
            for index in indexes:
                if index is not None:
                    index.close()
    return result


def _choose_victims(
    namespaces: Sequence[Namespace],
    tables: Sequence[EntryTable],
    to_size: int | None,
    older_than: float | None,
    now: float,
) -> list[np.ndarray]:
    """Per namespace, the rows to delete."""
    chosen = [np.zeros(len(t), dtype=bool) for t in tables]
    if older_than is not None:
        for c, t in zip(chosen, tables):
            c |= t.last_access < now - older_than
    if to_size is not None:
        # One global LRU order over the remaining complete blocks of every namespace.
        which = [np.full(len(t), k) for k, t in enumerate(tables)]
        rows = [np.arange(len(t)) for t in tables]
        keep = [t.complete & ~c for t, c in zip(tables, chosen)]
        ns_of = np.concatenate(which + [np.zeros(0, dtype=np.int64)])
        row_of = np.concatenate(rows + [np.zeros(0, dtype=np.int64)])
        alive = np.concatenate(keep + [np.zeros(0, dtype=bool)])
        access = np.concatenate([t.last_access for t in tables] + [np.zeros(0)])
        sizes = np.array([ns.manifest.slot_size * ns.tp_size for ns in namespaces] + [0], dtype=np.int64)
        cand = np.flatnonzero(alive)
        cand = cand[np.argsort(access[cand], kind="stable")]
        per_block = sizes[ns_of[cand]]
        excess = int(per_block.sum()) - to_size
        if excess > 0:
            n = int(np.searchsorted(np.cumsum(per_block), excess)) + 1
            for i in cand[:n]:
                chosen[int(ns_of[i])][int(row_of[i])] = True
    return [np.flatnonzero(c) for c in chosen]


# ---------------------------------------------------------------- clear


def clear(cache: CacheDir, dry_run: bool = False) -> dict[str, Any]:
    """Delete ``cache``'s namespaces (manifest, index and slabs) under their writer
    locks; returns ``{"removed": [ids], "freed_bytes": n}``. Each namespace directory is
    first renamed out of the way, so an engine starting meanwhile creates a fresh one
    instead of opening a half-deleted one. Raises ``InspectError`` if an engine holds
    any of them (then nothing is deleted). ``dry_run`` only counts, without the locks."""
    removed, freed = [], 0
    with contextlib.nullcontext() if dry_run else exclusive(cache.namespaces, "clear"):
        for ns in cache.namespaces:
            freed += sum(st.st_blocks * 512 for st in map(os.lstat, ns.path.rglob("*")) if stat.S_ISREG(st.st_mode))
            if dry_run:
                removed.append(ns.path.name)
                continue
            trash = ns.path.parent / f".trash-{ns.path.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            try:
                os.rename(ns.path, trash)
            except OSError as e:
                raise InspectError(f"cannot remove {ns.path}: {e.strerror}") from None
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(ns.path.name)
    return {"removed": removed, "freed_bytes": freed}
