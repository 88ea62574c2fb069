"""Load/store specs of the composite hierarchy. Plain data passed scheduler -> worker."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiered_kv.abstract import BlockHash, LoadStoreSpec
from tiered_kv.mediums import CPULoadStoreSpec, Int64Column, TierWrite, TierWrites  # noqa: F401 (re-exported)

TIERED = "TIERED"


def _per_tier(writes: TierWrites | Sequence[TierWrites] | Sequence[TierWrite]) -> tuple[TierWrites, ...]:
    """Writes per lower tier: one ``TierWrites`` (or a list of ``TierWrite``) is the first
    lower tier's; a tuple or list of ``TierWrites`` is one per tier, in tier order."""
    if isinstance(writes, TierWrites):
        return (writes,)
    per_tier = [w for w in writes if isinstance(w, TierWrites)]
    if per_tier and len(per_tier) == len(writes):
        return tuple(per_tier)
    return (TierWrites.of([w for w in writes if not isinstance(w, TierWrites)]),)


class TieredStoreSpec(CPULoadStoreSpec):
    """Where a GPU -> CPU store lands, plus the lower-tier writes it carries.

    ``spills[t]``: CPU slots whose previous block must be copied out (staged for its
    write into lower tier ``t``) *before* this store overwrites them.
    ``write_through[t]``: blocks of this store to write into lower tier ``t`` once they
    are in CPU. The store job completes when its GPU copy and the staging copies are
    done; the writes finish later and are learned through each tier's index, never by
    holding the job. ``spills`` and ``write_through`` alone are tier 0's writes.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        spills: TierWrites | Sequence[TierWrite] | Sequence[TierWrites] = (),
        write_through: TierWrites | Sequence[TierWrite] | Sequence[TierWrites] = (),
    ):
        super().__init__(block_ids)
        self.tier_spills = _per_tier(spills)
        self.tier_write_through = _per_tier(write_through)

    @property
    def spills(self) -> TierWrites:
        """The first lower tier's spills."""
        return self.tier_spills[0] if self.tier_spills else TierWrites()

    @property
    def write_through(self) -> TierWrites:
        """The first lower tier's write-through copies."""
        return self.tier_write_through[0] if self.tier_write_through else TierWrites()

    def __repr__(self) -> str:
        return (
            f"TieredStoreSpec({self.block_ids.tolist()}, spills={[len(w) for w in self.tier_spills]}, "
            f"write_through={[len(w) for w in self.tier_write_through]})"
        )


class TieredLoadSpec(LoadStoreSpec):
    """A load whose blocks come from more than one tier, in block order.

    Per block i: ``cpu_slots[i] >= 0`` when it is read from CPU; otherwise it is read from
    slot ``tier_slots[i]`` of lower tier ``lower_tiers[i]`` (0: the first tier below CPU;
    all 0 when not given) and, when ``promote_slots[i] >= 0``, also lands in that CPU
    slot (read tier -> CPU, checksum verified, then CPU -> GPU).
    """

    cpu_slots = Int64Column()
    tier_slots = Int64Column()
    promote_slots = Int64Column()
    lower_tiers = Int64Column()
    _cpu_slots: list[int] | np.ndarray  # the columns' storage (see Int64Column)
    _tier_slots: list[int] | np.ndarray
    _promote_slots: list[int] | np.ndarray
    _lower_tiers: list[int] | np.ndarray

    def __init__(
        self,
        cpu_slots: Sequence[int],
        tier_slots: Sequence[int],
        promote_slots: Sequence[int],
        block_hashes: Sequence[BlockHash],
        lower_tiers: Sequence[int] | None = None,
    ):
        self.cpu_slots = cpu_slots
        self.tier_slots = tier_slots
        self.promote_slots = promote_slots
        self.block_hashes = list(block_hashes)
        n = len(self.block_hashes)
        self.lower_tiers = [0] * n if lower_tiers is None else lower_tiers
        if not (
            len(self._cpu_slots) == len(self._tier_slots) == len(self._promote_slots) == len(self._lower_tiers) == n
        ):
            raise ValueError(
                "TieredLoadSpec: cpu_slots, tier_slots, promote_slots, lower_tiers "
                "and block_hashes must all have one entry per block"
            )

    @staticmethod
    def medium() -> str:
        return TIERED

    def __len__(self) -> int:
        return len(self.block_hashes)

    def __repr__(self) -> str:
        return (
            f"TieredLoadSpec(cpu={self.cpu_slots.tolist()}, disk={self.tier_slots.tolist()}, "
            f"promote={self.promote_slots.tolist()})"
        )
