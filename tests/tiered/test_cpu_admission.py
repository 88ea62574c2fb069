"""``cpu_admission: reuse(N)``: a block ranks first to evict in the CPU tier until its Nth
use, and is still stored, reported and written below as without admission."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.cpu import cpu_tier_manager
from tiered_kv.cpu.spec import CPUOffloadingSpec
from tiered_kv.disk.format.manifest import slot_size_for
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.tiered.manager import TieredOffloadingManager

LAYOUT = KVCacheLayout((LayerLayout("kv", (1, 64), False),), torch.uint8, 16)
POLICIES = ("lru", "arc")


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def stored(manager, hashes):
    out = manager.prepare_store(hashes)
    assert out is not None
    manager.complete_store(out.block_hashes_to_store)
    manager.touch(hashes)  # as the engine does after each store
    return out


def composite(policy: str, slots: int, admit_after: int = 2, lower=None, **kw) -> TieredOffloadingManager:
    cpu = cpu_tier_manager(policy, slots, 16, admit_after=admit_after)
    return TieredOffloadingManager(cpu, lower, costs=None, **kw)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_first_use_is_evicted_first_and_a_second_use_is_admitted(policy):
    m = composite(policy, 2)
    stored(m, [h(1)])
    stored(m, [h(1)])  # offered again while in CPU: its second use admits it
    stored(m, [h(2)])  # first use: first to evict, though most recent and touched
    assert m.stats.tiers["cpu"]["not_admitted"] == 2  # h(1) once, h(2) once
    assert stored(m, [h(3)]).block_hashes_evicted == [h(2)]
    assert m.lookup([h(1)]) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_without_admission_the_same_stores_evict_the_older_block(policy):
    m = composite(policy, 2, admit_after=1)
    stored(m, [h(1)])
    stored(m, [h(1)])
    stored(m, [h(2)])
    assert stored(m, [h(3)]).block_hashes_evicted == [h(1)]
    assert m.stats.tiers["cpu"]["not_admitted"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_load_is_a_second_use(policy):
    m = composite(policy, 2)
    stored(m, [h(1)])
    stored(m, [h(2)])  # both first to evict; h(1) is the older
    assert m.lookup([h(2)]) == 1
    m.prepare_load([h(2)])
    m.complete_load([h(2)])
    m.touch([h(2)])
    assert stored(m, [h(3)]).block_hashes_evicted == [h(1)]
    assert stored(m, [h(4)]).block_hashes_evicted == [h(3)]  # h(2) was admitted by its load
    assert m.lookup([h(2)]) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_stored_again_after_eviction_is_admitted(policy):
    m = composite(policy, 2)
    stored(m, [h(1)])
    stored(m, [h(2)])
    assert stored(m, [h(3)]).block_hashes_evicted == [h(1)]  # the oldest first-use block
    stored(m, [h(1)])  # remembered: its second use
    assert stored(m, [h(4)]).block_hashes_evicted == [h(3)]
    assert stored(m, [h(5)]).block_hashes_evicted == [h(4)]
    assert m.lookup([h(1)]) == 1


def test_the_deepest_block_of_a_request_goes_first():
    m = composite("lru", 3)
    stored(m, [h(1), h(2), h(3)])
    assert list(m.cpu.iter_evictable()) == [h(3), h(2), h(1)]
    assert stored(m, [h(4)]).block_hashes_evicted == [h(3)]


def test_the_seed_api_of_the_cpu_manager_admits_the_same_way():
    cpu = cpu_tier_manager("lru", 2, 16, admit_after=2)
    for hashes in ([h(1)], [h(1)], [h(2)]):
        out = cpu.prepare_store(hashes)
        assert out is not None
        cpu.complete_store(out.block_hashes_to_store)
        cpu.touch(hashes)
    out = cpu.prepare_store([h(3)])
    assert out is not None and out.block_hashes_evicted == [h(2)]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_not_admitted_is_stored_and_reported_as_without_admission(policy):
    m = TieredOffloadingManager(cpu_tier_manager(policy, 2, 16, admit_after=2), costs=None)
    out = m.prepare_store([h(1), h(2)])
    assert out is not None and out.block_hashes_to_store == [h(1), h(2)]
    assert len(out.store_spec.block_ids) == 2
    m.complete_store(out.block_hashes_to_store)
    events = list(m.take_events())
    assert [(e.block_hashes, e.removed) for e in events] == [([h(1), h(2)], False)]
    assert m.lookup([h(1), h(2)]) == 2  # loadable until evicted
    out = m.prepare_store([h(3)])
    assert out is not None and out.block_hashes_evicted == [h(2)]
    assert [(e.block_hashes, e.removed) for e in m.take_events()] == [([h(2)], True)]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_never_evicts_its_own_blocks_not_admitted(policy):
    m = composite(policy, 2)
    stored(m, [h(1)])
    stored(m, [h(1)])
    out = m.prepare_store([h(2), h(3)])  # both first-use; room only by evicting h(1)
    assert out is not None and out.block_hashes_evicted == [h(1)]
    assert m.prepare_store([h(4), h(5), h(6)]) is None


def _disk(tmp_path) -> DiskOffloadingManager:
    fp = Fingerprint.from_layout(LAYOUT, model_id="cpu-admission")
    return DiskOffloadingManager(
        tmp_path,
        fp,
        LAYOUT,
        disk_bytes=8 * slot_size_for(LAYOUT.bytes_per_block),
        enable_events=False,
        poll_interval=None,
    )


def test_write_through_copies_a_block_not_admitted_from_its_cpu_slot(tmp_path):
    m = composite("lru", 2, lower=_disk(tmp_path), write_policy="write_through")
    try:
        out = m.prepare_store([h(1)])
        assert out is not None and out.block_hashes_to_store == [h(1)]
        assert out.store_spec.write_through.block_hashes == [h(1)]
        assert m.stats.tiers["cpu"]["not_admitted"] == 1
    finally:
        m.shutdown()


def test_write_back_spills_a_block_not_admitted_when_it_is_evicted(tmp_path):
    m = composite("lru", 2, lower=_disk(tmp_path), write_policy="write_back")
    try:
        stored(m, [h(1)])
        stored(m, [h(1)])
        stored(m, [h(2)])
        out = m.prepare_store([h(3)])
        assert out is not None
        assert out.store_spec.spills.block_hashes == [h(2)]  # the block not admitted, not h(1)
        assert out.block_hashes_evicted == []  # it moved to the disk tier, not out of the hierarchy
    finally:
        m.shutdown()


@pytest.mark.parametrize("bad", ["reuse(0)", "sometimes", 2, {"cpu": "reuse(2)"}, "reuse(-1)"])
def test_bad_values_name_the_key_and_the_value(bad):
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_dict({"cpu_admission": bad})
    message = str(exc.value)
    assert "cpu_admission" in message and "reuse(N)" in message
    assert (str(bad) if not isinstance(bad, dict) else "cpu") in message


def test_good_values_and_the_default():
    assert TieredConfig.from_dict({}).cpu_admission == "adaptive(2)"
    assert TieredConfig.from_dict({"cpu_admission": "reuse( 2 )"}).cpu_admission == "reuse(2)"
    assert TieredConfig.from_dict({"cpu_admission": "all"}).cpu_admission == "all"


@pytest.mark.parametrize("policy", POLICIES)
def test_the_spec_builds_the_cpu_tier_with_the_rule(policy):
    config = TieredConfig.from_dict({"cpu_bytes": "1MiB", "eviction_policy": policy, "cpu_admission": "reuse(3)"})
    manager = CPUOffloadingSpec(config, 16, layout=LAYOUT).get_manager()
    assert manager.admission.admit_after == (3,)  # type: ignore[attr-defined]
    plain = CPUOffloadingSpec(
        TieredConfig.from_dict({"cpu_bytes": "1MiB", "cpu_admission": "all"}), 16, layout=LAYOUT
    ).get_manager()
    assert plain.admission.admit_after == (1,)  # type: ignore[attr-defined]
