"""The composite manager's bookkeeping with the CPU tier alone (no disk tier)."""

from __future__ import annotations

import pytest

from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.mediums import CPULoadStoreSpec
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.transfer_specs import TierWrite, TierWrites, TieredStoreSpec


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def stored(manager, hashes):
    out = manager.prepare_store(hashes)
    assert out is not None
    manager.complete_store(out.block_hashes_to_store)
    return out


def test_store_then_lookup_and_load_from_cpu():
    m = TieredOffloadingManager(CPUOffloadingManager(4, block_size=16))
    out = stored(m, [h(1), h(2)])
    assert isinstance(out.store_spec, TieredStoreSpec)
    assert len(out.store_spec.spills) == 0 and len(out.store_spec.write_through) == 0
    assert m.lookup([h(1), h(2), h(3)]) == 2
    spec = m.prepare_load([h(1), h(2)])
    assert isinstance(spec, CPULoadStoreSpec) and len(spec.block_ids) == 2
    m.complete_load([h(1), h(2)])
    assert m.stats.tiers["cpu"]["hits"] == 2


def test_without_disk_lru_victims_leave_the_hierarchy():
    m = TieredOffloadingManager(CPUOffloadingManager(2, block_size=16))
    stored(m, [h(1), h(2)])
    m.touch([h(1)])  # h(2) is now least recent
    out = stored(m, [h(3)])
    assert out.block_hashes_evicted == [h(2)]
    assert m.lookup([h(1)]) == 1 and m.lookup([h(2)]) == 0
    assert m.stats.tiers["cpu"]["drops"] == 1


def test_pinned_blocks_are_never_victims_and_full_pinned_tier_refuses():
    m = TieredOffloadingManager(CPUOffloadingManager(2, block_size=16))
    stored(m, [h(1), h(2)])
    m.prepare_load([h(1), h(2)])
    assert m.prepare_store([h(3)]) is None
    assert m.lookup([h(1), h(2)]) == 2  # nothing changed
    m.complete_load([h(1)])
    out = stored(m, [h(3)])
    assert out.block_hashes_evicted == [h(1)]


def test_failed_store_frees_slots_and_blocks_are_not_loadable():
    m = TieredOffloadingManager(CPUOffloadingManager(2, block_size=16))
    out = m.prepare_store([h(1), h(2)])
    assert m.lookup([h(1)]) == 0  # pending is not loadable
    m.complete_store(out.block_hashes_to_store, success=False)
    assert m.lookup([h(1)]) == 0
    assert m.cpu.num_free_slots() == 2


def test_a_block_no_tier_holds_at_prepare_load_gets_no_slot_and_a_warning(caplog):
    """It left its tier since lookup (tests/tiered/test_tiered_hierarchy.py): the spec
    gives it no slot, which the worker's load handler refuses, failing that one load."""
    m = TieredOffloadingManager(CPUOffloadingManager(2, block_size=16))
    stored(m, [h(1)])
    with caplog.at_level("WARNING", logger="tiered_kv.tiered.manager"):
        spec = m.prepare_load([h(1), h(7)])
    assert (spec.cpu_slots.tolist()[1], spec.tier_slots.tolist()[1]) == (-1, -1) and spec.cpu_slots.tolist()[0] >= 0
    assert "1 block(s) of a load left their tier" in caplog.text
    m.complete_load([h(1), h(7)], success=False)
    assert m.lookup([h(1)]) == 1 and not m.cpu._readers, "the load let go of its CPU block"


def test_already_offloaded_blocks_are_not_stored_again():
    m = TieredOffloadingManager(CPUOffloadingManager(4, block_size=16))
    stored(m, [h(1)])
    out = m.prepare_store([h(1), h(2), h(2)])
    assert out.block_hashes_to_store == [h(2)]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="write_policy"):
        TieredOffloadingManager(CPUOffloadingManager(2, block_size=16), write_policy="sometimes")


def test_disk_writes_are_columns_that_iterate_as_tuples_and_pickle():
    import pickle

    writes = TierWrites([3, 4], [10, 11], [h(1), h(2)])
    assert list(writes) == [TierWrite(3, 10, h(1)), TierWrite(4, 11, h(2))] and len(writes) == 2
    assert TierWrites.of(writes) is writes
    again = TierWrites.of(list(writes))
    assert again.cpu_slots.tolist() == [3, 4] and again.tier_slots.tolist() == [10, 11]
    spec = pickle.loads(pickle.dumps(TieredStoreSpec([0, 1], spills=writes)))  # scheduler -> worker
    assert list(spec.spills) == list(writes) and len(spec.write_through) == 0
    with pytest.raises(ValueError, match="2 cpu_slots, 1 tier_slots and 2 block_hashes"):
        TierWrites([3, 4], [10], [h(1), h(2)])
