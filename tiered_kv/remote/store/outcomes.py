"""What the shared tier's store takes and reports: the blocks handed to it, each
upload's outcome and the store's counters.

Plain values, no I/O; made by ``store.RemoteStore`` in whichever process opened it (each
worker, the scheduler, the inspector) and read by the metrics (``tiered_kv.metrics``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.abstract import BlockHash
from tiered_kv.remote.format.object_format import REJECT_REASONS
from tiered_kv.remote.store.client import Buffer

#: A block's bytes: one contiguous buffer, or its pieces in order (e.g. a CPU slot's
#: ``SlotViews.pieces``), which are sent and filled where they lie.
BlockBytes = Buffer | Sequence[Buffer]
#: ``(block hash, TP rank, bytes)`` for ``put_blocks``.
PutItem = tuple[BlockHash, int, BlockBytes]
#: ``(block hash, TP rank, writable bytes of exactly the block's size)`` for ``get_blocks``.
GetItem = tuple[BlockHash, int, BlockBytes]


def byte_views(data: Any, what: str, writable: bool) -> list[memoryview]:
    """Flat byte views of a buffer, or of each buffer of a list or tuple of pieces."""
    pieces = data if isinstance(data, (list, tuple)) else [data]
    views = []
    for buf in pieces:
        try:
            view = memoryview(buf)
        except TypeError:
            raise TypeError(
                f"{what}: expected a bytes-like object (bytes, bytearray, memoryview, numpy "
                f"array) or a list of them, got {type(buf).__name__}"
            ) from None
        if not view.c_contiguous:
            raise ValueError(f"{what}: the buffer must be C-contiguous")
        if writable and view.readonly:
            raise ValueError(f"{what}: the buffer is read-only; get_blocks writes into it")
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    if not views:
        raise ValueError(f"{what}: no bytes (an empty list of pieces)")
    return views


class PutOutcome(str, enum.Enum):
    """What became of one block handed to ``put_blocks``."""

    STORED = "stored"  # this PUT wrote the object
    PRESENT = "present"  # the object was there already (write-once: left as it was)
    DROPPED = "dropped"  # not sent: the pending-upload bound was reached, or the server is unavailable
    FAILED = "failed"  # sent, and the request failed (timeout, 5xx, refused)

    @property
    def durable(self) -> bool:
        return self in (PutOutcome.STORED, PutOutcome.PRESENT)


@dataclass
class RemoteStats:
    """Counters of one store since it opened."""

    puts_stored: int = 0
    puts_present: int = 0
    puts_dropped: int = 0
    puts_failed: int = 0
    put_bytes: int = 0
    gets_hit: int = 0
    gets_absent: int = 0
    gets_failed: int = 0
    gets_skipped: int = 0
    get_bytes: int = 0
    #: Objects refused by a check, by reason (``object_format.REJECT_REASONS``).
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    #: Objects deleted on reading them, proven bad (``object_format.Rejected.provable``).
    damaged_deleted: int = 0
    #: Writes that found the key taken by an object proven bad, replaced it, and read the
    #: replacement back verified.
    forgeries_replaced: int = 0
    #: Objects that failed a check this node cannot make evidence (sealed under a key id
    #: it does not hold, sealed where it has no key, a newer format, another size than the
    #: reader's buffer): left in place for the members who can judge them.
    kept_unproven: int = 0
    probes: int = 0
    probes_failed: int = 0
    #: Times the store stopped sending after consecutive failures.
    unavailable_periods: int = 0
    #: Conditional PUTs the server refused as unsupported (``conditional_put``).
    conditional_put_refused: int = 0
    #: Writes sent as a plain PUT after a HEAD found no object (the manifest included).
    puts_unconditional: int = 0

    @property
    def gets_rejected(self) -> int:
        return sum(self.rejected.values())


__all__ = ["PutOutcome", "RemoteStats"]
