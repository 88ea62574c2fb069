"""A disk tier's ``retention: session``: its eviction passes over the blocks a returning
session's hold covers, within the hold's learned time and the tier's budget, and takes
them last when nothing else can go; the config key reaches the tier through the one
builder, and the composite tells the tier's rule of every use with its session."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from support.disk_fixtures import block_hash, disk_bytes_for, fingerprint, small_layout
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.disk.scheduler.block_table import BlockTable
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.tiered.retention import SessionRetention

CAP = 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hs(start: int, n: int) -> list[bytes]:
    return [block_hash(i) for i in range(start, start + n)]


@contextmanager
def disk_tier(path, share: float | None) -> Iterator[tuple[DiskOffloadingManager, Clock]]:
    """A disk manager of ``CAP`` slots whose retention (if ``share``) may hold that share
    of them, on a test clock."""
    layout = small_layout()
    with DiskOffloadingManager(
        path,
        fingerprint(layout),
        layout,
        disk_bytes=disk_bytes_for(layout, CAP),
        engine_id="e",
        poll_interval=None,
        retention_share=share,
    ) as m:
        clock = Clock()
        if m.retention is not None:
            m.retention.clock = clock
        yield m, clock


@pytest.fixture
def tier(tmp_path):
    with disk_tier(tmp_path, 0.5) as (m, clock):
        assert isinstance(m.retention, SessionRetention) and m.retention.budget == CAP // 2
        yield m, clock


def store(m: DiskOffloadingManager, hashes: list[bytes]) -> list[bytes]:
    """Store ``hashes`` (loadable at once, as when every rank's job finished); the evicted."""
    out = m.prepare_store(hashes)
    assert out is not None, "a store never fails for want of room while blocks are evictable"
    m.complete_store(out.block_hashes_to_store)
    return out.block_hashes_evicted


def turns(m: DiskOffloadingManager, clock: Clock, chain: list[bytes], *at: float, session: str = "chat") -> None:
    """A session's turns at the times ``at``, each using ``chain`` (as the composite tells
    the tier's rule), its blocks stored on disk."""
    for t in at:
        clock.now = t
        m.retention.observe(chain, session)
        store(m, chain)


def test_a_sessions_tail_survives_a_storm_within_its_ttl_and_goes_after_it(tier):
    m, clock = tier
    tail = hs(0, 4)
    turns(m, clock, tail, 0.0, 10.0)  # a gap of 10 s: held until 20 s
    assert m.retention.ttl_s == 10 and all(h in m.retention for h in tail)
    clock.now = 12.0
    storm = hs(100, 3 * CAP)
    for i in range(0, len(storm), 4):  # one-time blocks, more than the tier holds
        assert not set(store(m, storm[i : i + 4])) & set(tail)
    assert all(m.is_loadable(h) for h in tail)
    assert m.stats.evictions == 3 * CAP - (CAP - len(tail))
    clock.now = 21.0  # the hold has ended: the tail is the least recent and goes first
    evicted = store(m, hs(200, 4))
    assert evicted == tail and not any(m.is_loadable(h) for h in tail)


def test_the_budget_bounds_what_the_tier_holds(tier):
    m, clock = tier
    for t in (0.0, 10.0):  # six sessions of four blocks return: more than the budget of ten
        for s in range(6):
            turns(m, clock, hs(10 * s, 4), t + s, session=f"s{s}")
            assert m.retention.num_held() <= m.retention.budget
    assert m.retention.num_held() == m.retention.budget == CAP // 2
    assert m.retention.counts["dropped"] > 0


def test_held_blocks_go_last_and_never_keep_a_store_out(tmp_path):
    with disk_tier(tmp_path, 0.9) as (m, clock):
        held = hs(0, 16)
        turns(m, clock, held, 0.0, 10.0)
        others = hs(50, 4)
        store(m, others)
        assert m.num_free_slots() == 0 and m.retention.num_held() == 16
        # Six slots wanted: the four unheld blocks first, then the two least recent held ones.
        evicted = store(m, hs(100, 6))
        assert evicted == others + held[:2]
        # A store of the whole tier still lands: every held block gives way.
        assert sorted(store(m, hs(200, CAP))) == sorted(held[2:] + hs(100, 6))


def test_evict_lru_past_takes_held_blocks_last_in_lru_order():
    table = BlockTable()
    table.add_many([(h, i) for i, h in enumerate(hs(0, 6))])
    held = set(hs(0, 3))
    assert table.evict_lru_past(2, held) == (hs(3, 2), [3, 4])
    assert table.evict_lru_past(3, held, {block_hash(1)}) == ([block_hash(5), block_hash(0), block_hash(2)], [5, 0, 2])
    assert table.evict_lru_past(2, held) is None and len(table) == 1
    assert table.evict_lru_past(1, None) == ([block_hash(1)], [1])


def test_without_retention_the_tier_is_plain_lru(tmp_path):
    with disk_tier(tmp_path, None) as (m, _):
        assert m.retention is None
        store(m, hs(0, CAP))
        assert store(m, hs(100, 4)) == hs(0, 4)


def test_the_config_builds_the_rule_into_each_disk_tier_and_the_composite_tells_it_each_use(tmp_path):
    from tiered_kv.sim.driver import DeviceKVCache
    from tiered_kv.tiered.spec import HierarchySpec

    device = DeviceKVCache(num_layers=1, num_gpu_blocks=4, gpu_block_size=16, num_kv_heads=1, head_dim=8, device="cpu")
    bpb = device.layout.bytes_per_block
    config = {
        "cpu_bytes": f"{8 * bpb}B",
        "cover_weights": False,
        "disk_path": str(tmp_path / "fast"),
        "disk_bytes": "4MiB",
        "disk_retention": "session(0.5)",
        "cpu_retention": "none",  # disk_retention alone: the CPU tier's stays as set
        "tiers": [
            {"type": "disk", "name": "slow", "path": str(tmp_path / "slow"), "bytes": "4MiB", "retention": "none"}
        ],
    }
    clock = Clock()
    with HierarchySpec(config, 16, device.layout, clock=clock) as spec, spec.get_manager() as manager:
        fast, slow = manager.lower
        assert isinstance(fast, DiskOffloadingManager) and isinstance(slow, DiskOffloadingManager)
        assert fast.retention is not None and fast.retention.budget == fast.capacity // 2
        assert slow.retention is None and manager.cpu.retention is None
        assert fast.retention.clock is clock, "the spec's clock reaches the tier's rule"
        chain = hs(0, 3)
        manager.prepare_store(chain, session="agent-1")
        manager.complete_store(chain)
        clock.now = 30.0
        # The next turn rewrote its context: one session all the same, by its name.
        other = hs(10, 3)
        manager.prepare_store(other, session="agent-1")
        assert fast.retention.counts["returns"] == 1 and fast.retention.ttl_s == 30
        assert all(h in fast.retention for h in other)
        manager.complete_store(other)
        clock.now = 40.0
        spec_load = manager.prepare_load(other[:1], session="agent-1")
        assert spec_load is not None and fast.retention.counts["returns"] == 2
        manager.complete_load(other[:1])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"disk_path": "/tmp/x", "disk_retention": "forever"}, "disk_retention: expected 'none', 'session' or "),
        ({"disk_path": "/tmp/x", "disk_retention": "session(0.95)"}, r"within S x the disk tier's slots\), got"),
        (
            {"tiers": [{"type": "disk", "path": "/tmp/x", "retention": "session(0)"}]},
            r"tiers\[0\]\.retention: expected",
        ),
        ({"tiers": [{"type": "disk", "path": "/tmp/x", "retention": 0.5}]}, r"tiers\[0\]\.retention: .*got 0\.5"),
    ],
)
def test_bad_retention_values_are_refused_naming_the_key_and_value(config, message):
    with pytest.raises(ConfigError, match=message):
        TieredConfig.from_dict(config)


def test_the_shorthand_is_every_disk_tiers_default_and_a_tier_may_set_its_own():
    config = TieredConfig.from_dict(
        {
            "disk_path": "/tmp/a",
            "disk_retention": "session",
            "tiers": [
                {"type": "disk", "name": "b", "path": "/tmp/b"},
                {"type": "disk", "name": "c", "path": "/tmp/c", "retention": "none"},
            ],
        }
    )
    assert [t.settings.retention for t in config.tiers] == ["session", "session", "none"]
