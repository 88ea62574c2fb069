"""The workers' log records belong to one store attempt: a record of an earlier store (or
load) of the same block in the same slot, settled by its job before the manager read it,
never settles, frees or drops a later store of that block. Real manager, real store, real
LMDB; the only fault is a worker logging its write failed (``DiskStore.log_failed``, what
a worker calls when its write will not happen) or a corrupt read (``drop_corrupt``)."""

from __future__ import annotations

import contextlib
import time

import lmdb
import pytest

from support.disk_fixtures import block_hash, content_rows, disk_bytes_for, fingerprint, small_layout
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.store.store import DiskStore

A, B, C = (block_hash(name) for name in "ABC")


@contextlib.contextmanager
def engine(tmp_path, tp_size: int, capacity: int, poll_interval: float | None = None):
    """A manager (scheduler) and a store (every rank's worker) on one cache directory."""
    layout = small_layout()
    fp = fingerprint(layout, tp_size=tp_size)
    nbytes = disk_bytes_for(layout, capacity)
    with (
        DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e", poll_interval=poll_interval) as m,
        DiskStore.open(tmp_path, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e") as s,
    ):
        yield m, s, layout


def write(s, layout, rank: int, hashes: list[bytes], slots: list[int]) -> None:
    assert all(s.write_blocks(rank, hashes, slots, content_rows(hashes, rank, layout, s.slot_size)))


def slots_of(out) -> list[int]:
    return out.store_spec.block_ids.tolist()


@pytest.mark.parametrize("poll_interval", [None, 0.002])
def test_a_failed_attempts_records_do_not_free_the_next_store_of_its_block(tmp_path, poll_interval):
    with engine(tmp_path, tp_size=2, capacity=3, poll_interval=poll_interval) as (m, s, layout):
        out = m.prepare_store([B])
        for rank in (0, 1):
            write(s, layout, rank, [B], slots_of(out))
        m.complete_store([B])
        first = m.prepare_store([A])
        write(s, layout, 0, [A], slots_of(first))
        s.log_failed(1, [A], slots_of(first))
        m.complete_store([A], success=False)  # the job reports the failure before the log is read

        # The failed attempt's slot holds rank 0's bytes and index bit: it is not handed
        # out again until its records are read and that entry is gone.
        again = m.prepare_store([A])
        assert slots_of(again) != slots_of(first)
        m.refresh()
        assert m.is_pending(A), "the old failure must not settle the new store"
        m.flush()
        assert s.entry(A) is None, "the failed attempt's partial entry was kept"
        other = m.prepare_store([C])
        assert other is not None and slots_of(other) == slots_of(first), "the slot came back once free"

        for rank in (0, 1):
            write(s, layout, rank, [A], slots_of(again))
        m.complete_store([A])
        m.refresh()
        assert m.lookup([A]) == 1 and m.stats.store_failures == 1
        assert s.entry(A) is not None and s.entry(A).slot == slots_of(again)[0] and s.entry(A).ranks == 3


def test_a_store_given_up_while_a_rank_still_writes_keeps_its_slot_until_every_rank_reported(tmp_path):
    """A store job failed on one rank (or a reset abandoned it) while another rank's write
    of it is still queued: neither its slot nor its block is stored again until every
    rank logged its outcome, so a write landing late never counts toward, mixes with or
    takes the index entry of a later store."""
    with engine(tmp_path, tp_size=2, capacity=2) as (m, s, layout):
        first = m.prepare_store([A])
        m.abandon_store([A])  # nothing logged yet: both ranks may still write
        assert m.num_free_slots() == 1
        assert slots_of(m.prepare_store([A])) == [], "stored again while a rank may still write it"
        write(s, layout, 0, [A], slots_of(first))  # the abandoned writes land late
        write(s, layout, 1, [A], slots_of(first))
        m.refresh()
        assert not m.is_loadable(A), "a late write of the given-up store made it loadable"
        m.flush()
        assert m.num_free_slots() == 2 and s.entry(A) is None, "every rank reported: slot and entry are free"
        again = m.prepare_store([A])
        for rank in (0, 1):
            write(s, layout, rank, [A], slots_of(again))
        m.refresh()
        assert m.is_loadable(A) and s.entry(A).slot == slots_of(again)[0] and s.entry(A).ranks == 3


def test_an_old_ok_record_does_not_make_a_new_store_loadable_before_it_is_written(tmp_path):
    with engine(tmp_path, tp_size=1, capacity=2) as (m, s, layout):
        first = m.prepare_store([A])
        write(s, layout, 0, [A], slots_of(first))
        m.complete_store([A])  # settled by its job: the ok record is not read yet
        assert m.remove(A)
        m.flush()
        again = m.prepare_store([A])
        assert slots_of(again) == slots_of(first)
        m.refresh()
        assert m.lookup([A]) == 0 and m.is_pending(A), "loadable before a byte of this store was written"
        write(s, layout, 0, [A], slots_of(again))
        m.complete_store([A])
        assert m.lookup([A]) == 1 and m.stats.stores == 2


def test_a_rank_failure_read_before_the_job_failed_does_not_fail_the_next_store(tmp_path):
    with engine(tmp_path, tp_size=2, capacity=2) as (m, s, layout):
        first = m.prepare_store([A])
        s.log_failed(1, [A], slots_of(first))
        assert m.refresh().failed == [A]  # read while rank 0 still writes: A waits for it
        m.complete_store([A], success=False)
        again = m.prepare_store([A])
        for rank in (0, 1):
            write(s, layout, rank, [A], slots_of(again))
        assert m.refresh().durable == [A], "the first attempt's failure carried over to the second"
        assert m.lookup([A]) == 1 and m.stats.store_failures == 1


def test_a_failed_loads_corrupt_record_does_not_drop_the_block_stored_again(tmp_path):
    with engine(tmp_path, tp_size=1, capacity=2) as (m, s, layout):
        first = m.prepare_store([A])
        write(s, layout, 0, [A], slots_of(first))
        m.complete_store([A])
        load = m.prepare_load([A])
        s.index.drop_corrupt(0, [(A, int(load.block_ids[0]))])  # the worker found it corrupt
        m.complete_load([A], success=False)
        assert m.remove(A)  # e.g. evicted before the log was read
        m.flush()
        again = m.prepare_store([A])
        assert slots_of(again) == slots_of(first)
        write(s, layout, 0, [A], slots_of(again))
        m.complete_store([A])
        r = m.refresh()
        assert r.corrupt == [] and m.lookup([A]) == 1, "the old read's corrupt record dropped the new copy"


def test_what_is_kept_of_settled_jobs_stays_bounded_where_nothing_polls_the_log(tmp_path):
    """With no flusher polling (``poll_interval=None``, as the replays run) and nothing
    pending, only ``prepare_store`` reads the log: it does once the settled jobs
    outnumber the tier's slots, so their record stays bounded."""
    from support.disk_fixtures import block_hash

    with engine(tmp_path, tp_size=1, capacity=4) as (m, s, layout):
        for i in range(40):
            out = m.prepare_store([block_hash(f"b{i}")])
            write(s, layout, 0, out.block_hashes_to_store, slots_of(out))
            m.complete_store(out.block_hashes_to_store)
            assert len(m._unread) <= 4 + 1
        assert m.lookup([block_hash("b39")]) == 1


def test_a_failed_index_write_delays_a_failed_stores_slot_but_never_keeps_it(tmp_path, caplog):
    """The slot of a failed store waits for the index write that deletes its partial
    entry; a write that fails (an LMDB error) is tried again on its own, backing off,
    with nothing else to wake the flusher."""
    with engine(tmp_path, tp_size=1, capacity=1, poll_interval=0.002) as (m, s, layout):
        m.prepare_store([A])
        flusher = m._index_flusher
        apply_batch, calls = flusher._index.apply_batch, []

        def failing_once(*args, **kwargs):  # fault injection: the index write fails once
            calls.append(1)
            if len(calls) == 1:
                raise lmdb.Error("injected: the index write fails")
            return apply_batch(*args, **kwargs)

        flusher._index.apply_batch = failing_once
        m.complete_store([A], success=False)
        deadline = time.monotonic() + 5
        while m.num_free_slots() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m.num_free_slots() == 1 and len(calls) >= 2 and m.stats.index_flush_errors == 1
        assert "1 failed stores' slots wait for a retry" in caplog.text
        assert m.prepare_store([B]) is not None
