"""What a disk manager adopts at startup from the index it found (``manager.py``).

Scheduler process, once, while the manager opens (on the caller's thread); no I/O of
its own: it works on the ``IndexSnapshot`` that one LMDB read pass loaded
(``DiskIndex.load_all``) with numpy, fills the manager's ``BlockTable`` with the
loadable blocks, and returns the entries to delete and the free slots.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from tiered_kv.disk.scheduler.block_table import BlockTable
from tiered_kv.disk.format.index_records import IndexSnapshot

logger = logging.getLogger(__name__)

__all__ = ["Adopted", "adopt_snapshot"]


class Adopted(NamedTuple):
    """The outcome of ``adopt_snapshot``."""

    deletions: list[tuple[bytes, int]]  # (hash, slot) entries that must not come back
    free: list[int]  # free slots, highest first (``pop()`` hands out low slots first)


def adopt_snapshot(
    snap: IndexSnapshot,
    table: BlockTable,
    *,
    capacity: int,
    intact_slots: int,
    full_mask: int,
    block_bytes: int,
    path: object,
) -> Adopted:
    """Adopt the index found at startup into ``table``: complete entries (every rank of
    ``full_mask`` committed, ``block_bytes`` long) in range become loadable, the rest is
    reclaimed. Slots at or past ``intact_slots`` lie beyond the end of some rank's
    slab as found at startup: their entries are dropped, with a warning (``path``
    names the namespace in it)."""
    e = snap.entries
    deletions: list[tuple[bytes, int]] = []
    limit = min(capacity, intact_slots)
    # Each field of the record array is a strided view: read the slots once.
    slot = np.ascontiguousarray(e["slot"])
    complete = ((e["ranks"] & np.uint64(full_mask)) == np.uint64(full_mask)) & (e["size"] == block_bytes) & (slot >= 0)
    lost = 0
    if limit < capacity:
        lost = int((complete & (slot >= limit) & (slot < capacity)).sum())
    lost += sum(1 for _, entry in snap.odd if limit <= entry.slot < capacity)
    if lost:
        logger.warning(
            "disk tier %s: a slab is missing or truncated (only %d of %d slots on every "
            "rank); dropping the %d blocks stored past its end",
            path,
            limit,
            capacity,
            lost,
        )
    ok = complete & (slot < limit)
    good = np.flatnonzero(ok)
    used = np.zeros(capacity, dtype=bool)
    used[slot[good]] = True
    if np.count_nonzero(used) < len(good):
        # Two entries in one slot cannot both be valid; keep the newest (defensive).
        # The set of used slots stays the same.
        order = good[np.lexsort((-e["store_time"][good], slot[good]))]
        first = np.ones(len(order), dtype=bool)
        first[1:] = slot[order][1:] != slot[order][:-1]
        ok[:] = False
        ok[order[first]] = True
    drop = np.flatnonzero(~ok)
    for i in drop:
        deletions.append((snap.hash_at(int(i)), int(slot[i])))
    if len(good):
        # Usually every entry is kept: take whole columns rather than gathering them.
        kept, slots = (e, slot) if not len(drop) else (e[ok], slot[ok])
        # load_all returns entries in LMDB key order, i.e. ascending bytes.
        keys = np.ascontiguousarray(kept["hash"]).view(np.uint8).reshape(len(kept), -1)
        table.load_cold(keys, slots, kept["last_access"])
    for h, entry in sorted(snap.odd, key=lambda he: he[1].last_access):
        if (
            entry.ranks & full_mask == full_mask
            and entry.size == block_bytes
            and 0 <= entry.slot < limit
            and not used[entry.slot]
        ):
            table.add_many([(h, entry.slot)])
            used[entry.slot] = True
        else:
            deletions.append((h, entry.slot))
    if deletions:
        logger.info("disk tier: reclaiming %d partial or invalid index entries", len(deletions))
    return Adopted(deletions, np.flatnonzero(~used)[::-1].tolist())
