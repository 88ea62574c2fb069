"""``cpu_admission: reuse(N)``: a block ranks first to evict in the CPU tier until its Nth
use, and is still stored, reported and written below as without admission; and
``adaptive(N)``: the tier follows ``reuse(N)`` while a miniature cache running it hits
more than one running ``all``, and ``all`` otherwise."""

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
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.admission import MINIATURE_SLOTS, AdaptiveAdmission, MiniatureCache
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


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_a_store_held_in_cpu_reaches_no_lower_tier_and_leaves_from_cpu(tmp_path, write_policy):
    """``cpu_only`` (a LoRA request's store): no write-through copy, and evicted it is
    dropped, not spilled; a plain block evicted next is spilled (write_back) as ever."""
    m = composite("lru", 2, admit_after=1, lower=_disk(tmp_path), write_policy=write_policy)
    try:
        out = m.prepare_store([h(1)], cpu_only=True)
        assert out is not None and out.block_hashes_to_store == [h(1)]
        assert out.store_spec.write_through.block_hashes == []
        m.complete_store([h(1)])
        m.touch([h(1)])
        stored(m, [h(2)])
        out = m.prepare_store([h(3)])  # evicts h(1), the least recent
        assert out is not None
        assert h(1) not in out.store_spec.spills.block_hashes
        assert out.block_hashes_evicted == [h(1)]  # left the hierarchy
        assert not m.admission.cpu_only(h(1))
        m.complete_store([h(3)])
        out = m.prepare_store([h(4)])  # evicts h(2): a plain block
        assert out is not None
        if write_policy == "write_back":
            assert out.store_spec.spills.block_hashes == [h(2)]
        else:
            assert out.store_spec.write_through.block_hashes == [h(4)]
    finally:
        m.shutdown()


def test_a_block_held_in_cpu_is_a_victim_a_promotion_may_drop(tmp_path):
    m = composite("lru", 2, admit_after=1, lower=_disk(tmp_path), write_policy="write_back")
    disk = m.lower[0]
    try:
        stored(m, [h(5)])
        stored(m, [h(6)])
        out = stored(m, [h(7)])  # h(5) spills to disk
        disk.complete_store(out.store_spec.spills.block_hashes)
        out = m.prepare_store([h(1)], cpu_only=True)  # h(6) spills
        assert out is not None
        disk.complete_store(out.store_spec.spills.block_hashes)
        m.complete_store([h(1)])
        m.touch([h(7)])  # h(1), held in CPU, is the next victim
        assert m.lookup([h(5)]) == 1
        spec = m.prepare_load([h(5)])
        assert spec.promote_slots.tolist()[0] >= 0, "the promotion was refused a slot h(1) could give"
        m.complete_load([h(5)])
        assert m.cpu.is_loadable(h(5)) and not m.cpu.is_loadable(h(1)) and not disk.is_loadable(h(1))
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


# ---------------------------------------------------------------- adaptive(N)


def use(manager, block_hash):
    """What the engine does for one block: load it if the tiers hold it, else store it."""
    if manager.lookup([block_hash]) == 1:
        manager.prepare_load([block_hash])
        manager.complete_load([block_hash])
        manager.touch([block_hash])
        return True
    stored(manager, [block_hash])
    return False


def scan_over_hot_set(hot: int, rounds: int, scan: int):
    """A hot set used every round, between scans of blocks used once: LRU loses the hot
    set to each scan; a rule that ranks first uses first to evict keeps it."""
    fresh = 10**6
    for _ in range(rounds):
        yield from range(hot)
        yield from range(fresh, fresh + scan)
        fresh += scan


def used_twice_nearby(blocks: int, distance: int):
    """Each block used twice, ``distance`` uses apart, never again: ``all`` hits every
    second use; ``reuse(2)`` fills the tier with blocks that will not come back."""
    for i in range(blocks + distance):
        if i < blocks:
            yield i
        if i >= distance:
            yield i - distance


def test_a_miniature_cache_without_admission_is_lru():
    mini = MiniatureCache(2)
    assert [mini.use(h(i)) for i in (1, 2, 1, 3, 2, 1)] == [False, False, True, False, False, False]
    assert len(mini) == 2


def test_a_miniature_cache_with_admission_evicts_first_uses_first():
    mini = MiniatureCache(2)
    uses = [(1, False), (1, True), (2, False), (3, False), (1, True)]  # admitted by a second use
    assert [mini.use(h(i), admitted) for i, admitted in uses] == [False, True, False, False, True]
    # h(1) was admitted by its second use; h(2), used once, went before it.
    assert not mini.use(h(2), False)


def test_adaptive_admission_takes_reuse_where_a_scan_would_flush_the_hot_set():
    admission = AdaptiveAdmission(2, 64, 256, TieredStats())
    assert admission.rate == 1  # below MINIATURE_SLOTS slots every block is sampled
    for i in scan_over_hot_set(hot=32, rounds=20, scan=64):
        admission.note([h(i)])
    assert admission.in_force(0) and admission.hits[1] > admission.hits[0]
    assert not admission.admits(0, h(10**9))  # a block never seen is turned away
    assert admission.admits(0, h(3))  # a hot block is admitted
    assert admission.stats.tiers["cpu"]["admission_switches"] == 1


def test_adaptive_admission_keeps_all_where_blocks_come_back_once_nearby():
    admission = AdaptiveAdmission(2, 64, 256, TieredStats())
    for i in used_twice_nearby(blocks=2000, distance=40):
        admission.note([h(i)])
    assert not admission.in_force(0) and admission.hits[1] < admission.hits[0]
    assert admission.admits(0, h(10**9))
    assert admission.admitted(0, [h(1), h(2)]) == [h(1), h(2)]


def test_a_large_tier_samples_its_blocks():
    admission = AdaptiveAdmission(2, 64 * MINIATURE_SLOTS, 1000, TieredStats())
    assert admission.rate == 64
    assert len(admission._miniatures[0]) == 0
    admission.note([h(i) for i in range(64 * 100)])
    # About one block in 64 reaches the miniatures.
    assert 40 < len(admission._miniatures[0]) < 180


@pytest.mark.parametrize("policy", POLICIES)
def test_the_cpu_tier_follows_the_rule_that_hits_more(policy):
    def hits(admission_rule: int, adaptive: bool, uses) -> int:
        cpu = cpu_tier_manager(policy, 64, 16, admit_after=admission_rule, adaptive=adaptive)
        m = TieredOffloadingManager(cpu, None, costs=None)
        return sum(use(m, h(i)) for i in uses)

    scan = list(scan_over_hot_set(hot=32, rounds=40, scan=64))
    nearby = list(used_twice_nearby(blocks=3000, distance=40))
    lru_scan, reuse_scan, adaptive_scan = hits(1, False, scan), hits(2, False, scan), hits(2, True, scan)
    lru_near, reuse_near, adaptive_near = hits(1, False, nearby), hits(2, False, nearby), hits(2, True, nearby)
    assert reuse_scan > lru_scan and lru_near > reuse_near  # each fixed rule loses one trace
    # The adaptive rule learns which before it follows it: near the better one on both.
    assert adaptive_scan >= reuse_scan - 3 * 32 and adaptive_scan > lru_scan
    assert adaptive_near == lru_near


@pytest.mark.parametrize("policy", POLICIES)
def test_turning_reuse_on_ranks_the_blocks_used_once_first_to_evict(policy):
    cpu = cpu_tier_manager(policy, 8, 16, admit_after=2, adaptive=True)
    m = TieredOffloadingManager(cpu, None, costs=None)
    stored(m, [h(1)])
    stored(m, [h(1)])  # used twice
    for i in range(2, 8):
        stored(m, [h(i)])  # used once, the newer blocks
    assert not cpu.admission.in_force(0)
    cpu.admission.hits = [0.0, 1.0]  # the miniatures found reuse(2) hits more
    m.lookup([h(1)])
    cpu.note_uses([h(50)])  # the next use turns it on
    assert cpu.admission.in_force(0)
    # Those used once go before h(1), least recent first, though h(1) is the least recent.
    evicted = stored(m, [h(8), h(9), h(10)]).block_hashes_evicted  # one slot was free
    assert evicted == [h(2), h(3)]
    assert m.lookup([h(1)]) == 1


@pytest.mark.parametrize(
    "value, expected", [("adaptive", "adaptive(2)"), ("adaptive(3)", "adaptive(3)"), ("adaptive( 4 )", "adaptive(4)")]
)
def test_config_values(value, expected):
    assert TieredConfig.from_dict({"cpu_admission": value}).cpu_admission == expected


@pytest.mark.parametrize("bad", ["adaptive(1)", "adaptive(0)", "adaptive()", "adaptive(x)", "adaptively"])
def test_bad_values_name_the_key_the_value_and_the_forms(bad):
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_dict({"cpu_admission": bad})
    message = str(exc.value)
    assert "cpu_admission" in message and "adaptive(N)" in message and bad in message


def test_a_rule_of_one_use_cannot_adapt():
    with pytest.raises(ValueError, match="admit_after >= 2"):
        AdaptiveAdmission(1, 64, 256, TieredStats())


@pytest.mark.parametrize("policy", POLICIES)
def test_the_spec_builds_the_adaptive_rule(policy):
    config = TieredConfig.from_dict({"cpu_bytes": "1MiB", "eviction_policy": policy, "cpu_admission": "adaptive(3)"})
    manager = CPUOffloadingSpec(config, 16, layout=LAYOUT).get_manager()
    assert isinstance(manager.admission, AdaptiveAdmission)  # type: ignore[attr-defined]
    assert manager.admission.admit_after == (3,)  # type: ignore[attr-defined]
