"""The disk manager's counters (``DiskOffloadingManager.stats``).

Scheduler process; no I/O. Read by the metrics export and the tools.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["DiskManagerStats"]


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
