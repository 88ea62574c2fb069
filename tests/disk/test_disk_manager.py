"""DiskOffloadingManager: seed semantics, LRU with pins, refresh from workers' log,
index persistence of evictions, restart."""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
import time

import numpy as np
import pytest

from support.disk_fixtures import block_hash, content_rows, disk_bytes_for, fingerprint, small_layout
from tiered_kv.disk.scheduler.block_table import _BUCKETS_PER_KEY, BlockTable, _bucket_bits, _in_buckets
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.mediums import DISK, DiskLoadStoreSpec

CAP = 6
H = [block_hash(i) for i in range(20)]


@pytest.fixture
def layout():
    return small_layout()


@pytest.fixture
def tier(tmp_path, layout):
    """A manager and a store on one cache directory (as a scheduler and a worker)."""
    fp = fingerprint(layout)
    # No background refresh: these tests call refresh() themselves and check what it returns.
    with (
        DiskOffloadingManager(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP), engine_id="e", poll_interval=None
        ) as m,
        DiskStore.open(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP), io_backend="posix", engine_id="e"
        ) as s,
    ):
        yield m, s


def store_blocks(m, s, hashes, layout, ok=True):
    out = m.prepare_store(hashes)
    assert out is not None
    spec = out.store_spec
    if out.block_hashes_to_store:
        res = s.write_blocks(
            0, spec.block_hashes, spec.block_ids.tolist(), content_rows(spec.block_hashes, 0, layout, s.slot_size)
        )
        assert all(res)
    m.complete_store(out.block_hashes_to_store, success=ok)
    return out


def open_engine(opened, d, fp, layout, nbytes):
    """A manager and a store on ``d`` (a scheduler and a worker of engine ``e``, no
    background refresh), closed when the ``ExitStack`` ``opened`` closes."""
    m = opened.enter_context(DiskOffloadingManager(d, fp, layout, disk_bytes=nbytes, engine_id="e", poll_interval=None))
    s = opened.enter_context(DiskStore.open(d, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e"))
    return m, s


def test_store_lookup_load_cycle(tier, layout):
    m, s = tier
    assert m.lookup(H[:3]) == 0
    out = m.prepare_store(H[:3])
    assert out.block_hashes_to_store == H[:3] and out.block_hashes_evicted == []
    assert isinstance(out.store_spec, DiskLoadStoreSpec) and out.store_spec.block_hashes == H[:3]
    assert len(set(out.store_spec.block_ids.tolist())) == 3
    assert m.lookup(H[:3]) == 0 and m.is_pending(H[0]), "a block being stored is not loadable"
    m.complete_store(H[:3])
    assert m.lookup(H[:3] + [H[9]] + H[3:4]) == 3
    spec = m.prepare_load(H[1:3])
    assert spec.block_hashes == H[1:3] and spec.block_ids.tolist() == out.store_spec.block_ids.tolist()[1:3]
    with pytest.raises(KeyError, match=H[9].hex()):
        m.prepare_load([H[9]])
    m.complete_load(H[1:3])
    again = m.prepare_store(H[:4])
    assert again.block_hashes_to_store == [H[3]], "already offloaded blocks are not stored again"
    ev = list(m.take_events())
    assert [(e.medium, e.removed, e.block_hashes) for e in ev] == [(DISK, False, H[:3])]
    assert ev[0].block_size == layout.offloaded_block_size


def test_lru_eviction_skips_pinned_and_requested_blocks(tier, layout):
    m, s = tier
    store_blocks(m, s, H[:CAP], layout)
    m.touch([H[0]])  # H0 becomes most recent: H1 is now the LRU
    m.prepare_load([H[1]])  # pinned: cannot be evicted
    out = m.prepare_store([H[2], H[10], H[11]])  # H2 is requested: protected
    assert out.block_hashes_to_store == [H[10], H[11]]
    assert out.block_hashes_evicted == [H[3], H[4]]
    assert not m.is_loadable(H[3]) and m.is_loadable(H[1]) and m.is_loadable(H[2])
    assert m.stats.evictions == 2
    assert [e.removed for e in m.take_events()][-1] is True


def test_prepare_store_returns_none_and_changes_nothing_when_full(tier, layout):
    m, s = tier
    store_blocks(m, s, H[:CAP], layout)
    m.prepare_load(H[: CAP - 1])
    before = list(m.iter_evictable())
    assert before == [H[CAP - 1]]
    assert m.prepare_store(H[10:12]) is None
    assert list(m.iter_evictable()) == before and m.stats.store_rejections == 1
    m.complete_load(H[: CAP - 1])
    assert m.prepare_store(H[10:12]) is not None


def test_failed_store_frees_its_slots(tier, layout):
    m, s = tier
    out = m.prepare_store(H[:CAP])
    m.complete_store(H[:CAP], success=False)
    m.flush()  # a failed store's slot comes back once its (partial) entry is deleted
    assert m.num_free_slots() == CAP and m.lookup(H[:1]) == 0 and m.stats.store_failures == CAP
    assert m.prepare_store(H[10 : 10 + CAP]) is not None and out is not None


def test_refresh_makes_blocks_durable_from_the_workers_log(tmp_path, layout):
    fp = fingerprint(layout, tp_size=2)
    with (
        DiskOffloadingManager(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP), engine_id="e", poll_interval=None
        ) as m,
        DiskStore.open(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP), io_backend="posix", engine_id="e"
        ) as s,
    ):
        out = m.prepare_store(H[:2])
        slots = out.store_spec.block_ids.tolist()
        s.write_blocks(0, H[:2], slots, content_rows(H[:2], 0, layout, s.slot_size))
        assert not m.refresh() and m.lookup(H[:2]) == 0, "one rank of two is not enough"
        s.write_blocks(1, H[:1], slots[:1], content_rows(H[:1], 1, layout, s.slot_size))
        r = m.refresh()
        assert r.durable == [H[0]] and m.lookup(H[:2]) == 1
        assert m.refresh().durable == [], "refresh is idempotent"
        m.complete_store(H[:2])  # the job completion arrives later: same outcome, once
        assert m.stats.stores == 2 and m.lookup(H[:2]) == 2


def test_refresh_reads_at_most_max_records_and_says_when_more_are_left(tier, layout):
    m, s = tier
    out = m.prepare_store(H[:5])
    s.write_blocks(0, H[:5], out.store_spec.block_ids.tolist(), content_rows(H[:5], 0, layout, s.slot_size))
    first, second, third = m.refresh(2), m.refresh(2), m.refresh(2)
    assert (first.durable, first.more) == (H[:2], True)
    assert (second.durable, second.more) == (H[2:4], True)
    assert (third.durable, third.more) == (H[4:5], False)
    assert m.lookup(H[:5]) == 5 and m.num_pending() == 0


@pytest.mark.parametrize("seed", range(4))
def test_single_rank_good_writes_fold_like_the_general_log_loop(tier, seed):
    """``refresh``'s shortcut for one rank and only ``ok`` records against the general
    loop, on the same records: good, stale slot, not pending, repeated."""
    from tiered_kv.disk.format.index_records import LOG_OK
    from tiered_kv.disk.scheduler.log_fold import RefreshResult, fold_good_writes, fold_log

    m, _ = tier
    rnd = random.Random(seed)
    out = m.prepare_store(H[:CAP])
    waiting = dict(zip(out.block_hashes_to_store, out.store_spec.block_ids.tolist()))
    records = []
    for _ in range(12):
        h = rnd.choice(H[: CAP + 3])
        slot = waiting.get(h, rnd.randrange(CAP))
        records.append((h, slot if rnd.random() < 0.7 else (slot + 1) % CAP))
    hashes, slots = [h for h, _ in records], [slot for _, slot in records]
    with m._lock:
        before = dict(m._pending)
        fast = fold_good_writes(m._pending, hashes, slots)
        after_fast, m._pending = dict(m._pending), dict(before)
        general = fold_log(
            m._pending,
            m._progress,
            1,
            (hashes, [LOG_OK] * len(records), [0] * len(records), slots),
            RefreshResult([], [], []),
            drop_corrupt=m._drop_corrupt,
            free_failed=m._free_failed,
        )
        assert not m._progress
    assert fast == general and after_fast == m._pending
    expected = []
    for h, slot in records:
        if before.get(h) == slot and (h, slot) not in expected:
            expected.append((h, slot))
    assert fast == expected, "each waiting block becomes durable once, at its first good record"


def test_flusher_learns_worker_commits_in_the_background(tmp_path, layout):
    """With polling on, blocks a worker committed become loadable with no call from the
    scheduler at all, in chunks (more records than one chunk), and the log is trimmed."""
    fp = fingerprint(layout)
    n = 150  # more than two of the flusher's 64-record chunks
    with (
        DiskOffloadingManager(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, n), engine_id="e", poll_interval=0.001
        ) as m,
        DiskStore.open(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, n), io_backend="posix", engine_id="e"
        ) as s,
    ):
        hashes = [block_hash(100 + i) for i in range(n)]
        out = m.prepare_store(hashes)
        assert m.num_pending() == n
        s.write_blocks(0, hashes, out.store_spec.block_ids.tolist(), content_rows(hashes, 0, layout, s.slot_size))
        deadline = time.monotonic() + 30
        while m.num_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m.num_pending() == 0 and all(m.is_loadable(h) for h in hashes)
        assert m.stats.stores == n and not m.refresh(), "nothing left for the scheduler to read"
        assert m.flush() and s.index.read_log(0) == [], "the flusher trimmed what it applied"


def test_the_flusher_keeps_polling_while_index_updates_wait_for_their_write(tmp_path, layout):
    """Stores keep waking the flusher, and each wake-up starts ``flush_interval`` of
    updates accumulating; the log must still be read every ``poll_interval`` meanwhile,
    or a burst of stores fills the composite's bound on pending writes and the
    scheduler's own call reads the log."""
    fp = fingerprint(layout)
    with (
        DiskOffloadingManager(
            tmp_path,
            fp,
            layout,
            disk_bytes=disk_bytes_for(layout, CAP),
            engine_id="e",
            poll_interval=0.001,
            flush_interval=60.0,
        ) as m,
        DiskStore.open(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP), io_backend="posix", engine_id="e"
        ) as s,
    ):
        assert m.flush()
        flushes = m.stats.index_flushes
        first = m.prepare_store(H[:1])
        s.write_blocks(0, H[:1], first.store_spec.block_ids.tolist(), content_rows(H[:1], 0, layout, s.slot_size))
        m.complete_store(H[:1])  # a wake-up: the updates it queued are due in a minute
        out = m.prepare_store(H[1:3])
        s.write_blocks(0, H[1:3], out.store_spec.block_ids.tolist(), content_rows(H[1:3], 0, layout, s.slot_size))
        deadline = time.monotonic() + 30
        while m.num_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m.num_pending() == 0 and m.is_loadable(H[1]) and m.is_loadable(H[2])
        assert m.stats.index_flushes == flushes, "the updates still wait for their interval"
        assert m.flush() and m.stats.index_flushes == flushes + 1, "a flush writes them at once"


def test_take_events_leaves_the_log_to_the_polling_flusher(tmp_path, layout):
    """vLLM asks for events every step: with polling on, that reads no index on the
    caller's thread, and the stored events still come, from the flusher's refresh."""
    fp = fingerprint(layout)
    with (
        DiskOffloadingManager(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP), engine_id="e", poll_interval=0.001
        ) as m,
        DiskStore.open(
            tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP), io_backend="posix", engine_id="e"
        ) as s,
    ):
        readers = []
        read_log = m.index.read_log_columns
        m.index.read_log_columns = lambda *a: (readers.append(threading.current_thread()), read_log(*a))[1]
        assert m.flush()  # the flusher has nothing pending: it sleeps until woken
        out = m.prepare_store(H[:2])
        s.write_blocks(0, H[:2], out.store_spec.block_ids.tolist(), content_rows(H[:2], 0, layout, s.slot_size))
        stored, deadline = [], time.monotonic() + 30
        while not stored and time.monotonic() < deadline:
            stored = [e for e in m.take_events() if not e.removed]
            time.sleep(0.001)
        assert [(e.medium, e.block_hashes) for e in stored] == [(DISK, H[:2])]
        assert readers and threading.current_thread() not in readers


def test_refresh_drops_corrupt_blocks_and_marks_failed_stores(tier, layout):
    m, s = tier
    store_blocks(m, s, H[:2], layout)
    spec = m.prepare_load([H[0]])
    # The worker finds H0 corrupt while it is pinned by this load.
    s.index.drop_corrupt(0, [(H[0], int(spec.block_ids[0]))])
    r = m.refresh()
    assert r.corrupt == [H[0]] and not m.is_loadable(H[0]) and m.stats.checksum_failures == 1
    free = m.num_free_slots()
    m.complete_load([H[0]])
    assert m.num_free_slots() == free + 1, "its slot is freed once the load lets go"
    # A worker logs a failed store: the block never becomes loadable, even on success.
    out = m.prepare_store([H[5]])
    s.index.log_failed(0, [H[5]], out.store_spec.block_ids.tolist())
    assert m.refresh().failed == [H[5]]
    m.complete_store([H[5]], success=True)
    assert not m.is_loadable(H[5]) and m.stats.store_failures == 1


def test_remove_and_iter_evictable(tier, layout):
    m, s = tier
    store_blocks(m, s, H[:3], layout)
    assert list(m.iter_evictable()) == H[:3]
    m.prepare_load([H[0]])
    assert not m.remove(H[0]), "a pinned block stays"
    assert m.remove(H[1]) and not m.is_loadable(H[1]) and not m.remove(H[1])
    assert list(m.iter_evictable()) == [H[2]]


def test_an_evicted_entry_stays_until_its_slot_is_rewritten_and_a_restore_survives(tier, layout):
    m, s = tier
    store_blocks(m, s, H[:CAP], layout)
    out = m.prepare_store([H[10]])
    victim = out.block_hashes_evicted[0]
    assert victim == H[0]
    m.complete_store([H[10]], success=False)
    # H0 comes back at once, possibly into its old slot, before the flusher ran.
    again = store_blocks(m, s, [H[0]], layout)
    assert again.block_hashes_to_store == [H[0]]
    assert m.flush()
    e = s.entry(H[0])
    assert e is not None and e.slot == int(again.store_spec.block_ids[0])
    # A plain eviction leaves the entry of the intact block in the index (a restart
    # could serve it) until the worker that reuses the slot clears it.
    store_blocks(m, s, [H[11]], layout)  # the failed store's slot, back since the flush
    out = m.prepare_store([H[12]])
    gone, slot = out.block_hashes_evicted[0], int(out.store_spec.block_ids[0])
    assert m.flush() and s.entry(gone).slot == slot and not m.is_loadable(gone)
    assert all(s.write_blocks(0, [H[12]], [slot], content_rows([H[12]], 0, layout, s.slot_size)))
    assert s.entry(gone) is None and s.entry(H[12]).slot == slot
    m.complete_store([H[12]])
    assert m.is_loadable(H[12])


def test_an_evicted_block_whose_slot_was_not_rewritten_is_served_after_a_restart(tmp_path, layout):
    fp, nbytes = fingerprint(layout), disk_bytes_for(layout, CAP)
    m = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e")
    s = DiskStore.open(tmp_path, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e")
    store_blocks(m, s, H[:CAP], layout)
    out = m.prepare_store([H[10]])  # evicts H0; its store never runs
    assert out.block_hashes_evicted == [H[0]]
    m.complete_store([H[10]], success=False)
    s.close()
    m.shutdown()
    with (
        DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e2") as m,
        DiskStore.open_readonly(m.namespace.path) as s,
    ):
        assert m.lookup(H[:CAP]) == CAP and not m.is_loadable(H[10])
        want = content_rows([H[0]], 0, layout, s.slot_size)[0, : s.block_bytes]
        assert s.read_block(0, H[0]) == bytes(want.numpy())


def test_two_entries_in_one_slot_keep_only_the_newer_after_a_restart(tmp_path, layout):
    """A damaged index can hold two complete entries naming one slot (the index's own
    writes never leave that): the reopen serves only the newer one and reclaims the
    other's entry, which never comes back."""
    fp, nbytes = fingerprint(layout), disk_bytes_for(layout, CAP)
    m = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e")
    s = DiskStore.open(tmp_path, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e")
    store_blocks(m, s, H[:3], layout)
    m.shutdown()
    newer = s.entry(H[1])
    older = newer._replace(store_time=newer.store_time - 60)
    # H[0]'s entry now names H[1]'s slot too, stored earlier.
    s.index._shared.run(lambda txn: txn.put(H[0], s.index.encode(H[0], older), db=s.index._db("blocks")), write=True)
    s.close()
    for engine in ("e2", "e3"):
        with DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id=engine) as m:
            assert [m.is_loadable(h) for h in H[:3]] == [False, True, True]
            assert m.slot_of(H[1]) == newer.slot and m.num_free_slots() == CAP - 2
            assert m.flush()
    with DiskStore.open_readonly(m.namespace.path) as s:
        assert s.entry(H[0]) is None and s.entry(H[1]) == newer


def test_touch_and_hits_reach_the_index(tier, layout):
    m, s = tier
    store_blocks(m, s, H[:2], layout)
    t0 = s.entry(H[0]).last_access
    time.sleep(0.01)
    m.touch([H[0]])
    m.prepare_load([H[0]])
    m.complete_load([H[0]])
    assert m.flush()
    e = s.entry(H[0])
    assert e.last_access > t0 and e.hits == 1


def test_restart_keeps_durable_blocks_in_lru_order(tmp_path, layout):
    fp = fingerprint(layout)
    nbytes = disk_bytes_for(layout, CAP)
    m = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e")
    s = DiskStore.open(tmp_path, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e")
    store_blocks(m, s, H[:4], layout)
    time.sleep(0.01)
    m.touch([H[0]])  # recency now: H1 H2 H3 H0
    pending = m.prepare_store([H[7]])  # never completed: not durable
    assert pending is not None
    s.close()
    m.shutdown()
    with DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e2") as m:
        assert [m.is_loadable(h) for h in H[:4]] == [True] * 4 and not m.is_loadable(H[7])
        assert list(m.iter_evictable()) == [H[1], H[2], H[3], H[0]]
        m.touch([H[2]])  # a cold block touched after restart becomes the most recent
        out = m.prepare_store(H[10:13])
        assert out.block_hashes_evicted == [H[1]]
        assert list(m.iter_evictable())[-1] == H[12] or m.is_pending(H[12])


def test_after_a_restart_the_startup_blocks_warm_up_in_the_background_in_lru_order(tmp_path, layout):
    """The blocks a restart found leave the table's cold generation on a thread of
    their own, a chunk per lock hold; the LRU order and every lookup stay the same."""
    fp = fingerprint(layout)
    n = 700  # more than two chunks
    nbytes = disk_bytes_for(layout, n)
    hashes = [block_hash(1000 + i) for i in range(n)]
    m = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e")
    s = DiskStore.open(tmp_path, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e")
    for a in range(0, n, 100):
        store_blocks(m, s, hashes[a : a + 100], layout)
    for h in hashes[:5]:  # one at a time: a restart orders blocks by their last access
        time.sleep(0.002)
        m.touch([h])
    order = list(m.iter_evictable())
    s.close()
    m.shutdown()
    with DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e2") as m:
        m._warmer.join(timeout=30)
        assert not m._warmer.is_alive() and m._table._cold_count == 0
        assert list(m.iter_evictable()) == order
        assert m.absent_among(hashes[::7] + [block_hash(5)]) == [block_hash(5)]
        out = m.prepare_store([block_hash(i) for i in range(3)])
        assert out.block_hashes_evicted == order[:3]


def test_manager_rejects_a_capacity_below_one_block(tmp_path, layout):
    with pytest.raises(ValueError, match="holds no block"):
        DiskOffloadingManager(tmp_path, fingerprint(layout), layout, disk_bytes=100)


def test_shutdown_is_idempotent_and_releases_the_lock(tmp_path, layout):
    fp = fingerprint(layout)
    m = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP))
    m.shutdown()
    m.shutdown()
    DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, CAP)).shutdown()


def test_scheduler_calls_never_write_the_index_themselves(tier, layout, monkeypatch):
    """Property 6: evictions, touches and trims reach LMDB from the flusher thread only."""
    import threading

    m, s = tier
    writes_on = []
    run = m.index._shared.run

    def spy(fn, write=False):
        if write:
            writes_on.append(threading.current_thread().name)
        return run(fn, write)

    monkeypatch.setattr(m.index._shared, "run", spy)
    store_blocks(m, s, H[:CAP], layout)  # the worker-side writes here go through `s`
    writes_on.clear()
    caller = threading.current_thread().name
    m.touch(H[:2])
    m.prepare_load(H[:2])
    m.complete_load(H[:2])
    m.prepare_store(H[10:13])  # evicts three
    m.complete_store(H[10:13], success=False)
    m.remove(H[5])
    m.take_events()
    assert caller not in writes_on
    assert m.flush()
    assert writes_on and set(writes_on) == {"tkv-disk-index-flusher"}


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("restart", [False, True])
def test_a_fresh_prepare_store_plans_exactly_like_a_checked_one(tmp_path, layout, pin, restart):
    """``fresh=True`` (the composite's spills) skips re-checking the hashes, and evicts
    from the LRU end in one pass when it can; the plan must be the same as without it."""
    fp, nbytes = fingerprint(layout), disk_bytes_for(layout, CAP)
    plans = []
    for fresh in (False, True):
        d = tmp_path / str(fresh)
        with contextlib.ExitStack() as opened:  # closes each pair opened in it (a second close is harmless)
            m, s = open_engine(opened, d, fp, layout, nbytes)
            store_blocks(m, s, H[:CAP], layout)
            m.touch([H[0]])  # H1 becomes the LRU
            if restart:  # blocks come back cold, from the index
                s.close()
                m.shutdown()
                m, s = open_engine(opened, d, fp, layout, nbytes)
            if pin:
                m.prepare_load([H[1]])
            out = m.prepare_store(H[10:12], fresh=fresh)
            before = list(m.iter_evictable())
            too_many = m.prepare_store([block_hash(100 + i) for i in range(CAP)], fresh=fresh)
            assert too_many is None and list(m.iter_evictable()) == before, "a refused store changes nothing"
            plans.append(
                (
                    out.block_hashes_to_store,
                    out.block_hashes_evicted,
                    out.store_spec.block_ids.tolist(),
                    before,
                    [m.is_pending(h) for h in H[10:12]],
                    m.stats.evictions,
                )
            )
    assert plans[0] == plans[1]
    assert plans[1][1] == ([H[2], H[3]] if pin else [H[1], H[2]])


@pytest.mark.parametrize("restart", [False, True])
def test_absent_among_keeps_order_and_skips_loadable_and_pending_blocks(tmp_path, layout, restart):
    """What the composite asks before planning disk writes: in the order given, the
    blocks that are neither loadable (hot or, after a restart, cold) nor pending."""
    fp, nbytes = fingerprint(layout), disk_bytes_for(layout, CAP)
    with contextlib.ExitStack() as opened:  # closes each pair opened in it (a second close is harmless)
        m, s = open_engine(opened, tmp_path, fp, layout, nbytes)
        store_blocks(m, s, H[:3], layout)
        if restart:
            s.close()
            m.shutdown()
            m, s = open_engine(opened, tmp_path, fp, layout, nbytes)
        assert m.prepare_store([H[5]]) is not None  # pending, never completed
        asked = [H[6], H[0], H[5], H[4], H[2], H[6], H[1]]
        assert m.absent_among(asked) == [H[6], H[4], H[6]]
        assert m.absent_among(iter([H[4], H[1]])) == [H[4]], "any iterable"
        m.remove(H[1])
        assert m.absent_among([H[1], H[0]]) == [H[1]]


@pytest.mark.parametrize("cap, most", [(12, 4), (3000, 400)], ids=["small", "large"])
@pytest.mark.parametrize("shared_prefixes", [False, True], ids=["digests", "counters"])
@pytest.mark.parametrize("seed", range(6))
def test_block_table_keeps_lru_order_under_random_churn(seed, shared_prefixes, cap, most):
    """The disk tier's table (cold generation from startup, hot one after) against a
    plain list in LRU order: inserts, touches, removals and evictions (of up to ``most``
    blocks) that skip kept blocks, many times over every slot. ``digests``: sha256 keys;
    ``counters``: 16-byte keys whose first 8 bytes repeat in runs of three, as keys that
    are not digests may. ``large``: the cold generation is read many windows at a time,
    with dead blocks (touched, removed) scattered through it. ``warm_up`` moves cold
    blocks to the hot generation now and then, which must change nothing a caller sees."""
    rnd = random.Random(seed)
    table = BlockTable()
    made = iter(range(1 << 30))

    def new_hash() -> bytes:
        i = next(made)
        if shared_prefixes:
            return (i // 3).to_bytes(8, "big") + i.to_bytes(8, "big")
        return hashlib.sha256(i.to_bytes(8, "big")).digest()

    cold = [(new_hash(), slot) for slot in rnd.sample(range(cap), rnd.randint(0, cap))]
    access = rnd.sample(range(10 * cap), len(cold))
    if cold:
        by_key = sorted(zip(cold, access))  # the index hands them over in key order
        rows = np.frombuffer(b"".join(h for (h, _), _ in by_key), dtype=np.uint8).reshape(len(cold), -1)
        table.load_cold(rows, np.array([slot for (_, slot), _ in by_key]), np.array([a for _, a in by_key]))
    ref = dict(hs for _, hs in sorted(zip(access, cold)))  # hash -> slot, least recent first
    free = sorted(set(range(cap)) - {slot for _, slot in cold})
    hot = set()  # blocks added or touched since startup
    for _ in range(300):
        op = rnd.random()
        if op < 0.35 and free:
            batch = [
                (new_hash(), free.pop(rnd.randrange(len(free)))) for _ in range(rnd.randint(1, min(most, len(free))))
            ]
            again = [(h, slot) for h, slot in ref.items() if h in hot]
            if again and rnd.random() < 0.3:  # a block already in the hot generation, again
                batch.insert(rnd.randrange(len(batch) + 1), rnd.choice(again))
            table.add_many(batch)
            for h, slot in batch:
                ref.pop(h, None)
                ref[h] = slot
                hot.add(h)
        elif op < 0.5:
            known = rnd.random() < 0.8 and ref
            h = rnd.choice(list(ref)) if known else new_hash()
            assert table.touch(h) == bool(known)
            if known:
                ref[h] = ref.pop(h)
                hot.add(h)
        elif op < 0.65 and ref:
            h = rnd.choice(list(ref))
            slot = ref.pop(h)
            assert table.remove(h) == slot and table.remove(h) is None
            free.append(slot)
        elif op < 0.72:  # blocks move out of the cold generation; nothing else may change
            left = table.warm_up(rnd.randint(1, most))
            hot.update(h for h in ref if table._cold_index(h) < 0)
            assert left == any(h not in hot for h in ref)
        else:
            keep = {h for h in ref if rnd.random() < 0.2} if rnd.random() < 0.7 else set()
            n = rnd.randint(1, most)
            want = [(h, slot) for h, slot in ref.items() if h not in keep][:n]
            got = table.evict_lru(n, keep)
            if len(want) < n:
                assert got is None
            else:
                assert got == ([h for h, _ in want], [slot for _, slot in want])
                for h, slot in want:
                    del ref[h]
                    free.append(slot)
        assert list(table.iter_lru()) == list(ref.items())
        assert len(table) == len(ref)
        assert all(table.get(h) == slot for h, slot in rnd.sample(list(ref.items()), min(50, len(ref))))
        probe = rnd.sample(list(ref), min(3, len(ref))) + [new_hash(), new_hash()]
        rnd.shuffle(probe)
        assert table.absent_among(probe, ()) == [h for h in probe if h not in ref]


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 70000])
def test_the_cold_prefix_buckets_pass_every_member_and_few_others(n):
    """``BlockTable``'s prefilter may let a new key through, never stop a cold one."""
    rng = np.random.default_rng(n)
    prefixes = np.sort(rng.integers(0, 1 << 63, n, dtype=np.uint64) << np.uint64(1) | np.uint64(n % 2))
    buckets, shift = _bucket_bits(prefixes)
    assert _in_buckets(buckets, shift, prefixes).all()
    others = rng.integers(0, 1 << 63, 20000, dtype=np.uint64) << np.uint64(1)
    assert _in_buckets(buckets, shift, others).mean() <= 2 / _BUCKETS_PER_KEY
