"""The disk manager's counters (``DiskOffloadingManager.stats``) and its slots held back.

Scheduler process; no I/O. Read by the metrics export and the tools.
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass, fields

__all__ = ["HELD_BACK_REASONS", "DiskManagerStats", "held_back"]

#: Why a slot that holds no loadable block is not free either (``held_back``): ``settling``,
#: a store given up while some rank may still write it, until every rank logged an outcome
#: there; ``releasing``, a failed store's, until its partial index entry is deleted.
HELD_BACK_REASONS = ("settling", "releasing")


@dataclass
class DiskManagerStats:
    """Counters of the disk manager (monotonic)."""

    stores: int = 0
    store_failures: int = 0
    store_rejections: int = 0  # prepare_store returned None: no room
    loads: int = 0
    checksum_failures: int = 0  # blocks workers found corrupt or missing
    evictions: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    reclaimed_at_open: int = 0  # partial or invalid entries dropped at startup
    index_flushes: int = 0
    index_flush_errors: int = 0
    index_read_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def index_errors(self) -> dict[str, int]:
        """Failed reads of the index log and failed index flushes, per op (the exported
        ``tiered_kv_tier_index_errors``)."""
        return {"read": self.index_read_errors, "flush": self.index_flush_errors}


def held_back(settling: Sized, releasing: Sized) -> dict[str, int]:
    """Slots held back per ``HELD_BACK_REASONS``, every reason named (0 included): a
    gauge's series exists before the first slot is held."""
    return dict(zip(HELD_BACK_REASONS, (len(settling), len(releasing))))
