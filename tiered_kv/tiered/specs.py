"""Load/store specs of the composite hierarchy. Plain data passed scheduler -> worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tiered_kv.abstract import BlockHash, LoadStoreSpec
from tiered_kv.mediums import CPULoadStoreSpec

TIERED = "TIERED"


class DiskWrite(NamedTuple):
    """Copy CPU slot ``cpu_slot`` (block ``block_hash``) to disk slot ``disk_slot``."""

    cpu_slot: int
    disk_slot: int
    block_hash: BlockHash


class TieredStoreSpec(CPULoadStoreSpec):
    """Where a GPU -> CPU store lands, plus the disk writes it carries.

    ``spills``: CPU slots whose previous block must be copied out (staged for its disk
    write) *before* this store overwrites them. ``write_through``: blocks of this store
    to write to disk once they are in CPU. The store job completes when its GPU copy and
    the staging copies are done; disk writes finish later and are learned through the
    disk index, never by holding the job.
    """

    def __init__(self, block_ids: Sequence[int] | np.ndarray,
                 spills: Sequence[DiskWrite] = (), write_through: Sequence[DiskWrite] = ()):
        super().__init__(block_ids)
        self.spills = list(spills)
        self.write_through = list(write_through)

    def __repr__(self) -> str:
        return (f"TieredStoreSpec({self.block_ids.tolist()}, spills={len(self.spills)}, "
                f"write_through={len(self.write_through)})")


class TieredLoadSpec(LoadStoreSpec):
    """A load whose blocks come from more than one tier, in block order.

    Per block i: ``cpu_slots[i] >= 0`` when it is read from CPU; otherwise it is read from
    ``disk_slots[i]`` (block ``block_hashes[i]``) and, when ``promote_slots[i] >= 0``,
    also lands in that CPU slot (read disk -> CPU, checksum verified, then CPU -> GPU).
    """

    def __init__(self, cpu_slots: Sequence[int], disk_slots: Sequence[int],
                 promote_slots: Sequence[int], block_hashes: Sequence[BlockHash]):
        self.cpu_slots = np.asarray(cpu_slots, dtype=np.int64)
        self.disk_slots = np.asarray(disk_slots, dtype=np.int64)
        self.promote_slots = np.asarray(promote_slots, dtype=np.int64)
        self.block_hashes = list(block_hashes)
        n = len(self.block_hashes)
        if not (len(self.cpu_slots) == len(self.disk_slots) == len(self.promote_slots) == n):
            raise ValueError("TieredLoadSpec: cpu_slots, disk_slots, promote_slots and "
                             "block_hashes must all have one entry per block")

    @staticmethod
    def medium() -> str:
        return TIERED

    def __len__(self) -> int:
        return len(self.block_hashes)

    def __repr__(self) -> str:
        return (f"TieredLoadSpec(cpu={self.cpu_slots.tolist()}, disk={self.disk_slots.tolist()}, "
                f"promote={self.promote_slots.tolist()})")
