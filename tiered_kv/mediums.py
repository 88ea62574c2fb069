"""Load/store specs for each medium: what a worker needs to address blocks there.

Built by managers in the scheduler process, consumed by handlers in worker processes;
plain data, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, TypeVar, overload

import numpy as np

from tiered_kv.abstract import BlockHash, LoadStoreSpec

GPU = "GPU"
CPU = "CPU"
DISK = "DISK"


def int64_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as a flat int64 array."""
    return np.asarray(ids, dtype=np.int64).reshape(-1)


_Spec = TypeVar("_Spec", bound=LoadStoreSpec)


def spec_as(spec: LoadStoreSpec, kind: type[_Spec]) -> _Spec:
    """``spec`` as the ``kind`` its medium implies (a handler's or a tier's own), or a
    ``TypeError`` naming both."""
    if not isinstance(spec, kind):
        raise TypeError(f"expected a {kind.__name__} here, got {type(spec).__name__} ({spec.medium()})")
    return spec


def ids_spec(spec: LoadStoreSpec) -> BlockIDsLoadStoreSpec:
    """``spec`` as a spec of block ids (GPU blocks, CPU or disk slots), or a ``TypeError``."""
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"expected block ids here, got {type(spec).__name__} ({spec.medium()})")
    return spec


class Int64Column:
    """An attribute of ids that holds a given ``list`` (flat, of ints) as is and turns it
    into a flat int64 array when first read, usually in the worker. Managers build specs
    on the scheduler's hot path, where converting a few hundred ints costs as much as a
    tier's whole bookkeeping for them. Other values are converted when set."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_" + name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Int64Column: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> np.ndarray: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Int64Column | np.ndarray:
        if obj is None:
            return self
        ids = getattr(obj, self._slot)
        if isinstance(ids, list):
            ids = int64_ids(ids)
            setattr(obj, self._slot, ids)
        return ids

    def __set__(self, obj: object, ids: Sequence[int] | np.ndarray) -> None:
        setattr(obj, self._slot, list(ids) if isinstance(ids, list) else int64_ids(ids))


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Blocks addressed by integer ids: GPU block ids, CPU slot ids or disk slot ids
    (``block_ids``: an int64 array; see ``Int64Column`` for lists)."""

    block_ids = Int64Column()
    _block_ids: list[int] | np.ndarray  # block_ids' storage (see Int64Column)

    def __init__(self, block_ids: Sequence[int] | np.ndarray):
        self.block_ids = block_ids

    def id_list(self) -> list[int]:
        """``block_ids`` as a list of ints, without making the array (the spec's own
        list while it has one: read it, do not change it)."""
        ids = self._block_ids
        return ids if isinstance(ids, list) else ids.tolist()

    def __len__(self) -> int:
        return len(self._block_ids)

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


class GPURowsSpec(GPULoadStoreSpec):
    """GPU blocks given per offloaded block: ``rows`` of shape ``(N, block_size_factor)``,
    -1 where a GPU-block position is not transferred (an engine may skip positions
    anywhere, as vLLM 0.33 does at both ends of a load)."""

    def __init__(self, rows: np.ndarray):
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 2:
            raise ValueError(f"GPURowsSpec: expected rows of shape (blocks, block_size_factor), got {rows.shape}")
        super().__init__(rows[rows >= 0])
        self.rows = rows


def chunk_positions(slots: np.ndarray, block_size_factor: int) -> np.ndarray:
    """``(N, block_size_factor)`` CPU-tier positions, at GPU-block granularity, of the
    GPU blocks of the offloaded blocks in CPU ``slots`` (``slot * factor + j``)."""
    f = block_size_factor
    return np.asarray(slots, dtype=np.int64)[:, None] * f + np.arange(f, dtype=np.int64)


class TierSlotsSpec(BlockIDsLoadStoreSpec):
    """Slots of a lower tier, one per offloaded block, with the block hashes so the
    worker can record and check each block (a tier addressed by hash ignores the slot
    ids). The composite's load handler hands this to every lower tier's handlers."""

    def __init__(self, block_ids: Sequence[int] | np.ndarray, block_hashes: Sequence[BlockHash]):
        super().__init__(block_ids)
        self.block_hashes = list(block_hashes)
        if len(self.block_hashes) != len(self):
            raise ValueError(
                f"{type(self).__name__}: {len(self)} slots but "
                f"{len(self.block_hashes)} block hashes; expected one hash per slot"
            )

    @staticmethod
    def medium() -> str:
        return "TIER"


class DiskLoadStoreSpec(TierSlotsSpec):
    """Slots in the disk tier's slab files (a ``TierSlotsSpec`` of medium ``DISK``)."""

    @staticmethod
    def medium() -> str:
        return DISK


class TierWrite(NamedTuple):
    """Copy CPU slot ``cpu_slot`` (block ``block_hash``) to slot ``tier_slot`` of a lower tier."""

    cpu_slot: int
    tier_slot: int
    block_hash: BlockHash


class TierWrites:
    """Disk writes as parallel columns: block ``block_hashes[i]`` goes from CPU slot
    ``cpu_slots[i]`` to slot ``tier_slots[i]`` of a lower tier. Columns, not one object per block:
    a cascading store plans hundreds of them on the scheduler's thread (and slot lists
    become arrays only when first read: ``Int64Column``). Iterating yields ``TierWrite``
    tuples."""

    __slots__ = ("_cpu_slots", "_tier_slots", "block_hashes")
    cpu_slots = Int64Column()
    tier_slots = Int64Column()
    _cpu_slots: list[int] | np.ndarray  # the columns' storage (see Int64Column)
    _tier_slots: list[int] | np.ndarray

    def __init__(
        self,
        cpu_slots: Sequence[int] | np.ndarray = (),
        tier_slots: Sequence[int] | np.ndarray = (),
        block_hashes: Sequence[BlockHash] = (),
    ):
        self.cpu_slots = cpu_slots
        self.tier_slots = tier_slots
        self.block_hashes = list(block_hashes)
        if not len(self._cpu_slots) == len(self._tier_slots) == len(self.block_hashes):
            raise ValueError(
                f"TierWrites: {len(self._cpu_slots)} cpu_slots, {len(self._tier_slots)} "
                f"tier_slots and {len(self.block_hashes)} block_hashes; expected one of each per block"
            )

    @classmethod
    def of(cls, writes: "TierWrites | Sequence[TierWrite]") -> "TierWrites":
        """``writes`` as columns (a ``TierWrites`` is returned as is)."""
        if isinstance(writes, TierWrites):
            return writes
        writes = list(writes)
        return cls([w.cpu_slot for w in writes], [w.tier_slot for w in writes], [w.block_hash for w in writes])

    def __len__(self) -> int:
        return len(self.block_hashes)

    def __iter__(self) -> Iterator[TierWrite]:
        return map(TierWrite._make, zip(self.cpu_slots.tolist(), self.tier_slots.tolist(), self.block_hashes))

    def __repr__(self) -> str:
        return f"TierWrites({list(self)!r})"
