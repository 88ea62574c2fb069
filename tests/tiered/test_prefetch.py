"""``tiered_kv.tiered.prefetch.Prefetcher`` over the real composite (the LRU CPU tier over
a real disk tier's manager, its index in pytest's tmp_path): what a prefetch pins and
reserves, how it ends (loadable, failed, abandoned by a reset), what it holds in CPU for
a waiting owner and when that ends, the order and bounds of ``issue``, a request loading
the same block meanwhile, and its counters. Bookkeeping only:
no worker runs, a test plays the worker by ending jobs."""

from __future__ import annotations

import pytest
from support.disk_fixtures import disk_bytes_for, fingerprint, small_layout

from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.prefetch import Prefetcher
from tiered_kv.tiered.transfer_specs import TieredLoadSpec

BPB = 1000  # bytes per block, for the byte bounds


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


@pytest.fixture
def composite(tmp_path):
    layout = small_layout()
    disk = DiskOffloadingManager(
        tmp_path, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, 32), engine_id="p", poll_interval=None
    )
    m = TieredOffloadingManager(CPUOffloadingManager(4, 16), disk, max_pending_writes=64)
    yield m
    m.shutdown()


def in_cpu(m: TieredOffloadingManager, *ids: int) -> None:
    """Store blocks ``ids`` into CPU (written through to disk)."""
    for i in ids:
        out = m.prepare_store([h(i)])
        assert out is not None
        m.complete_store(out.block_hashes_to_store)
        disk = m.tier("disk")
        disk.complete_store(list(disk.pending_blocks()))


def on_disk_only(m: TieredOffloadingManager, *ids: int) -> None:
    """Store blocks ``ids`` (written through to disk), then push them out of CPU."""
    for i in ids:
        in_cpu(m, i)
        m.cpu.remove(h(i))
    assert all(m.hit_tier(h(i)) == 0 for i in ids)


def test_a_prefetch_pins_the_disk_block_reserves_a_cpu_slot_and_makes_it_loadable_when_it_ends(composite):
    m = composite
    on_disk_only(m, 1, 2)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r1", [h(1), h(2)])
    (job,) = p.issue()
    assert isinstance(job.spec, TieredLoadSpec) and job.spec.block_hashes == [h(1), h(2)]
    assert job.spec.cpu_slots.tolist() == [-1, -1] and (job.spec.promote_slots >= 0).all()
    assert job.nbytes == 2 * BPB and p.bytes_in_flight == 2 * BPB
    disk = m.tier("disk")
    assert disk.is_pinned(h(1)) and h(1) in m.cpu and not m.cpu.is_loadable(h(1))
    assert m.stats.tiers["cpu"]["promotions"] == 2 and m.stats.tiers["disk"]["hits"] == 0
    assert p.complete(job.job_id) == []
    assert m.cpu.is_loadable(h(1)) and m.cpu.is_loadable(h(2)) and not disk.is_pinned(h(1))
    assert m.hit_tier(h(1)) == -1 and p.bytes_in_flight == 0
    # A load from CPU afterwards uses the prefetch; the unused block, no longer held once
    # its request ended, is wasted once evicted.
    m.prepare_load([h(1)])
    p.loaded([h(1)])
    m.complete_load([h(1)])
    p.cancel("r1")
    m.cpu.remove(h(2))
    counts = {event: n for tier, event, n in p.counters()}
    assert counts == {
        "prefetches": 2,
        "prefetch_used": 1,
        "prefetch_wasted": 1,
        "prefetch_cancelled": 0,
        "prefetch_failed": 0,
    }


def test_a_failed_block_is_not_kept_and_the_others_are(composite):
    m = composite
    on_disk_only(m, 1, 2)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r1", [h(1), h(2)])
    (job,) = p.issue()
    p.complete(job.job_id, failed=[h(2)])
    assert m.cpu.is_loadable(h(1)) and h(2) not in m.cpu
    assert m.hit_tier(h(2)) == 0  # still on disk, unpinned
    assert m.stats.tiers["disk"]["failed_loads"] == 1
    assert ("disk", "prefetch_failed", 1) in p.counters()


def test_blocks_in_cpu_are_held_not_read_and_a_block_held_nowhere_ends_the_queue(composite):
    m = composite
    on_disk_only(m, 2, 4)
    out = m.prepare_store([h(1)])
    m.complete_store(out.block_hashes_to_store)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r1", [h(1), h(2), h(3), h(4)])  # 1 in CPU, 3 nowhere: 4 is never loaded by a prefix lookup
    (job,) = p.issue()
    assert job.spec.block_hashes == [h(2)] and p.held_blocks == 1
    with pytest.raises(ValueError, match="pinned"):
        m.cpu.remove(h(1))
    assert not p.queued("r1") and p.issue() == []


def test_issue_is_bounded_in_bytes_oldest_first_and_a_hint_goes_first(composite):
    m = composite
    on_disk_only(m, 1, 2, 3, 4)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=2 * BPB + BPB // 2, max_held=4)
    p.want("old", [h(1), h(2)])
    p.want("new", [h(3)])
    p.want("hinted", [h(4)], first=True)
    jobs = p.issue()
    assert [j.spec.block_hashes for j in jobs] == [[h(4)], [h(1)]]  # two blocks fit in 2.5 blocks of bytes
    assert p.issue() == []
    p.complete(jobs[0].job_id)
    (job,) = p.issue()
    assert job.spec.block_hashes == [h(2)]


def test_prefetched_blocks_nobody_used_yet_are_bounded(composite):
    m = composite
    on_disk_only(m, 1, 2)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB, max_held=1)
    p.want("r1", [h(1), h(2)])
    (job,) = p.issue()
    assert job.spec.block_hashes == [h(1)]
    p.complete(job.job_id)
    assert p.held_blocks == 1 and p.issue() == []  # h(1) waits unused in CPU, held for r1
    p.loaded([h(1)])
    assert [j.spec.block_hashes for j in p.issue()] == [[h(2)]]


def test_unused_prefetched_blocks_count_against_the_bound_only_past_the_free_slots(composite):
    """A hint's prefetch that no request loads (or an aborted request's) leaves its blocks
    unused in CPU: while the tier has free slots for them, a waiting request's prefetch
    still goes (it evicts none of them); once it has none, they count again."""
    m = composite
    on_disk_only(m, 1, 2, 3, 4, 5)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)  # max_held: 2 of the 4 slots
    p.want("hint:r1", [h(1), h(2)], first=True)
    (job,) = p.issue()
    p.complete(job.job_id)
    assert p.held_blocks == 0 and m.cpu.num_free_slots() == 2
    p.want("r2", [h(3), h(4)])
    (job,) = p.issue()
    assert job.spec.block_hashes == [h(3), h(4)]
    p.complete(job.job_id)
    assert p.held_blocks == 2 and m.cpu.num_free_slots() == 0
    p.cancel("r2")  # it ended: four prefetched blocks unused, no free slot
    p.want("r3", [h(5)])
    assert p.issue() == [] and p.queued("r3")
    assert all(m.cpu.is_loadable(h(i)) for i in (1, 2, 3, 4))
    m.cpu.remove(h(1))  # gone unused (wasted): two unused blocks past one free slot
    assert p.issue() == []
    m.cpu.remove(h(2))  # two unused blocks, two free slots
    (job,) = p.issue()
    assert job.spec.block_hashes == [h(5)]
    counts = {event: n for _, event, n in p.counters()}
    assert counts["prefetches"] == 5 and counts["prefetch_wasted"] == 2 and counts["prefetch_used"] == 0


def test_a_waiting_owners_blocks_in_cpu_outlast_a_store_storm_until_it_loads_them(composite):
    """A CPU tier smaller than the queue turns over while a request waits: the blocks it
    had in CPU are held for it through a storm of stores, and its load ends the hold."""
    m = composite
    in_cpu(m, 1, 2)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r1", [h(1), h(2)])
    assert p.issue() == [] and p.held_blocks == 2  # nothing to read: held where they are
    in_cpu(m, 10, 11, 12, 13, 14, 15)  # four CPU slots: each store evicts the least recent
    assert m.cpu.is_loadable(h(1)) and m.cpu.is_loadable(h(2))
    m.prepare_load([h(1), h(2)])
    p.loaded([h(1), h(2)])
    m.complete_load([h(1), h(2)])
    assert p.held_blocks == 0
    in_cpu(m, 16, 17, 18, 19)
    assert h(1) not in m.cpu and h(2) not in m.cpu  # ordinary LRU blocks again
    counts = {event: n for _, event, n in p.counters()}
    assert counts["prefetches"] == counts["prefetch_used"] == 0  # held, never read


def test_holds_go_oldest_owner_first_within_max_held_and_a_cancel_passes_them_on(composite):
    m = composite
    in_cpu(m, 1, 2, 3)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB, max_held=2)
    p.want("old", [h(1), h(2)])
    p.want("new", [h(3)])
    assert p.issue() == []
    assert p.held_blocks == 2 and p.queued("new")  # the budget went to the oldest
    p.want("old", [h(1), h(2)])  # its keys placed again: what it holds stays held
    p.issue()
    assert p.held_blocks == 2
    with pytest.raises(ValueError, match="pinned"):
        m.cpu.remove(h(2))
    assert p.cancel("old") == 0  # started or ended; nothing was queued below CPU
    m.cpu.remove(h(2))  # evictable again
    p.issue()
    assert p.held_blocks == 1 and not p.queued("new")
    with pytest.raises(ValueError, match="pinned"):
        m.cpu.remove(h(3))


def test_a_hints_prefetch_holds_nothing(composite):
    m = composite
    in_cpu(m, 1)
    on_disk_only(m, 2)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("hint:r1", [h(1), h(2)], first=True)
    (job,) = p.issue()
    assert job.spec.block_hashes == [h(2)]
    p.complete(job.job_id)
    assert p.held_blocks == 0 and m.cpu.is_loadable(h(2))
    m.cpu.remove(h(1))
    m.cpu.remove(h(2))


def test_a_prefetch_lands_held_unless_its_owner_was_cancelled_and_a_reset_releases_every_hold(composite):
    m = composite
    on_disk_only(m, 1, 3)
    in_cpu(m, 2)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB, max_held=4)
    p.want("r1", [h(2), h(1)])  # a prefix: 2 in CPU, then 1 on disk
    p.want("r2", [h(3)])
    jobs = p.issue()
    assert [j.spec.block_hashes for j in jobs] == [[h(1)], [h(3)]] and p.held_blocks == 1
    p.cancel("r2")  # ended while its read ran: what the read brings is not held
    for job in jobs:
        p.complete(job.job_id)
    assert p.held_blocks == 2 and m.cpu.is_loadable(h(1))
    m.cpu.remove(h(3))
    p.abandon()
    assert p.held_blocks == 0
    m.cpu.remove(h(1))
    m.cpu.remove(h(2))
    counts = {event: n for _, event, n in p.counters()}
    assert counts["prefetches"] == counts["prefetch_wasted"] == 2


def test_no_prefetch_while_a_request_loads_from_the_tier(composite):
    m = composite
    on_disk_only(m, 1, 2)
    m.prepare_load([h(1)])  # a request's load from disk
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r2", [h(2)])
    assert p.issue() == []
    m.complete_load([h(1)])
    assert [j.spec.block_hashes for j in p.issue()] == [[h(2)]]


def test_cpu_slots_come_only_from_free_slots_and_blocks_held_below_never_a_spill(composite):
    m = composite
    on_disk_only(m, 1, 2, 3)
    # Fill CPU: two blocks only in CPU (write-back would spill them), two pinned by a load.
    m.write_policies = ("write_back",)
    for i in (11, 12):
        out = m.prepare_store([h(i)])
        m.complete_store(out.block_hashes_to_store)
    m.write_policies = ("write_through",)
    for i in (13, 14):
        out = m.prepare_store([h(i)])
        m.complete_store(out.block_hashes_to_store)
    m.prepare_load([h(13), h(14)])
    assert m.cpu.num_free_slots() == 0
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r1", [h(1), h(2)])
    assert p.issue() == []  # no slot without a spill: the queue stays
    assert p.queued("r1") and not m.tier("disk").is_pinned(h(1))
    m.complete_load([h(13), h(14)])  # now evictable, and on disk
    m.cpu.touch([h(11), h(12)])  # the CPU-only blocks rank most recent: 13 and 14 go first
    (job,) = p.issue()
    assert job.spec.block_hashes == [h(1), h(2)]
    assert m.cpu.is_loadable(h(11)) and m.cpu.is_loadable(h(12))


def test_a_request_loading_a_block_being_prefetched_reads_it_below_and_the_slot_waits_for_both(composite):
    m = composite
    on_disk_only(m, 1)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r1", [h(1)])
    (job,) = p.issue()
    assert m.hit_tier(h(1)) == 0
    spec = m.prepare_load([h(1)])
    assert isinstance(spec, TieredLoadSpec) and spec.promote_slots.tolist() == [-1]
    p.complete(job.job_id)
    assert not m.cpu.is_loadable(h(1))  # the request still reads the disk slot
    m.complete_load([h(1)])
    assert m.cpu.is_loadable(h(1))


def test_cancel_drops_the_queue_and_counts_what_a_lower_tier_held(composite):
    m = composite
    on_disk_only(m, 1, 2)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r1", [h(1), h(2), h(3)])
    assert p.cancel("r1") == 2 and p.cancel("r1") == 0
    assert p.issue() == []
    assert ("disk", "prefetch_cancelled", 2) in p.counters()


def test_an_abandoned_job_ends_failed_and_hands_its_blocks_back(composite):
    m = composite
    on_disk_only(m, 1, 2)
    p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
    p.want("r1", [h(1)])
    p.want("r2", [h(2)])
    (job,) = p.issue()[:1]
    p.abandon()
    assert not p.queued("r1") and not p.queued("r2")
    assert p.complete(job.job_id) == [h(1)]
    assert h(1) not in m.cpu and not m.tier("disk").is_pinned(h(1))
    assert p.complete(job.job_id) == []  # once


def test_bad_bounds_are_named(composite):
    with pytest.raises(ValueError, match="max_bytes_in_flight must hold at least one block"):
        Prefetcher(composite, bytes_per_block=BPB, max_bytes_in_flight=BPB - 1)
    with pytest.raises(ValueError, match="bytes_per_block must be >= 1, got 0"):
        Prefetcher(composite, bytes_per_block=0, max_bytes_in_flight=BPB)
    with pytest.raises(ValueError, match="max_held must be >= 1 block, got 0"):
        Prefetcher(composite, bytes_per_block=BPB, max_bytes_in_flight=BPB, max_held=0)


def test_a_prefetched_block_ranks_most_recent_where_cpu_admission_ranks_new_stores_first_to_evict(tmp_path):
    """Under ``cpu_admission: reuse(2)`` a block stored once ranks first to evict; one
    promoted from the disk has returned, so a prefetch of it (which notes no use: the
    request has not looked it up yet) must not land there, or the next stores would
    evict it before its request loads it."""
    layout = small_layout()
    disk = DiskOffloadingManager(
        tmp_path, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, 32), engine_id="p", poll_interval=None
    )
    m = TieredOffloadingManager(CPUOffloadingManager(4, 16, admit_after=2), disk, max_pending_writes=64)
    try:

        def store(*ids: int) -> None:
            for i in ids:
                out = m.prepare_store([h(i)])
                assert out is not None
                m.complete_store(out.block_hashes_to_store)
                disk.complete_store(list(disk.pending_blocks()))

        store(1)
        m.cpu.remove(h(1))
        store(10, 11, 12)
        p = Prefetcher(m, bytes_per_block=BPB, max_bytes_in_flight=8 * BPB)
        p.want("r1", [h(1)])
        (job,) = p.issue()
        p.complete(job.job_id)
        assert m.cpu.is_loadable(h(1))
        store(13, 14, 15, 16)  # four stores, each evicting one block first to evict
        assert m.cpu.is_loadable(h(1)), "the prefetched block was evicted before its load"
        assert not any(h(i) in m.cpu for i in (10, 11, 12, 13))
        # Used only if it is still in CPU when its request loads it.
        p.want("r2", [h(13)])
        (job,) = p.issue()
        p.complete(job.job_id)
        p.cancel("r2")  # r2 ended without loading it: no longer held
        m.cpu.remove(h(13))
        p.loaded([h(1), h(13)])
        counts = {event: n for _, event, n in p.counters()}
        assert counts["prefetch_used"] == 1 and counts["prefetch_wasted"] == 1
    finally:
        m.shutdown()
