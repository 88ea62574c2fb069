"""Load/store specs for each medium: what a worker needs to address blocks there.

Built by managers in the scheduler process, consumed by handlers in worker processes;
plain data, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiered_kv.abstract import BlockHash, LoadStoreSpec

GPU = "GPU"
CPU = "CPU"
DISK = "DISK"


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Blocks addressed by integer ids: GPU block ids, CPU slot ids or disk slot ids."""

    def __init__(self, block_ids: Sequence[int] | np.ndarray):
        self.block_ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU (device) KV-cache block ids, in units of the engine's GPU block.

    One offloaded block spans ``block_size_factor`` GPU blocks, so a spec for N offloaded
    blocks holds ``N * block_size_factor`` ids, possibly minus a leading partial block:
    ``skip_count`` GPU blocks at the start of the first offloaded block are not transferred.
    """

    def __init__(self, block_ids: Sequence[int] | np.ndarray, skip_count: int = 0):
        super().__init__(block_ids)
        self.skip_count = int(skip_count)

    @staticmethod
    def medium() -> str:
        return GPU


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Slots of the pinned CPU tier, one per offloaded block."""

    @staticmethod
    def medium() -> str:
        return CPU


class DiskLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Slots in the disk tier's slab files, one per offloaded block, with the block
    hashes so the worker can record and check each block's index entry."""

    def __init__(self, block_ids: Sequence[int] | np.ndarray, block_hashes: Sequence[BlockHash]):
        super().__init__(block_ids)
        self.block_hashes = list(block_hashes)
        if len(self.block_hashes) != len(self.block_ids):
            raise ValueError(
                f"DiskLoadStoreSpec: {len(self.block_ids)} slots but "
                f"{len(self.block_hashes)} block hashes; expected one hash per slot"
            )

    @staticmethod
    def medium() -> str:
        return DISK
