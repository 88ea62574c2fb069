"""The LMDB index: commit protocol steps, conditional deletes, the log, map growth,
and a 1M-block reopen in under a second."""

from __future__ import annotations

import multiprocessing
import os

import lmdb
import pytest

from support.disk_fixtures import block_hash, disk_bytes_for, fill_index, fingerprint, small_layout
from tiered_kv.disk.format import index as index_mod
from tiered_kv.disk.format.index import DiskIndex
from tiered_kv.disk.format.index_records import LOG_CORRUPT, LOG_FAILED, LOG_OK
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import Namespace

A, B, C = block_hash("a"), block_hash("b"), block_hash("c")


@pytest.fixture
def idx(tmp_path):
    with DiskIndex(tmp_path / "index.lmdb", tp_size=2) as index:
        yield index


def test_a_second_close_of_the_environment_leaves_a_reused_descriptor_alone(tmp_path):
    """The last handle's close closes the environment and its directory descriptor; a
    later close of the environment must not close whatever now has that number."""
    with open(tmp_path / "other", "wb") as other:  # opened first: it does not get that number
        with DiskIndex(tmp_path / "index.lmdb", tp_size=1) as index:
            shared, number = index._shared, index._shared._index_fd
        index.close()  # a second close of the handle is harmless too
        os.dup2(other.fileno(), number)  # the number is free again: something else takes it
        with open(number, "wb") as taken:  # and closes it at the end
            shared.close()
            assert os.path.samestat(os.fstat(taken.fileno()), os.fstat(other.fileno()))


def test_commit_sets_rank_bits_and_checksums_per_rank(idx):
    idx.commit_stored(0, [A, B], [3, 4], [100, 100], [11, 12])
    e = idx.get(A)
    assert (e.slot, e.size, e.ranks, e.checksums) == (3, 100, 0b01, (11, 0))
    idx.commit_stored(1, [A], [3], [100], [21])
    e = idx.get(A)
    assert e.ranks == 0b11 and e.checksums == (11, 21)
    # A failed block is logged, never recorded.
    idx.commit_stored(1, [B, C], [4, 5], [100, 100], [22, None])
    assert idx.get(C) is None and idx.get(B).ranks == 0b11
    recs = idx.read_log(0)
    assert [(r.status, r.rank, r.slot, r.block_hash) for r in recs] == [
        (LOG_OK, 0, 3, A),
        (LOG_OK, 0, 4, B),
        (LOG_OK, 1, 3, A),
        (LOG_OK, 1, 4, B),
        (LOG_FAILED, 1, 5, C),
    ]
    assert [r.seq for r in recs] == [1, 2, 3, 4, 5] and idx.log_seq() == 5
    assert [r.seq for r in idx.read_log(3)] == [4, 5]


def test_log_reads_resume_inside_a_transaction_s_records_and_honour_limits(idx):
    hashes = [block_hash(f"h{i}") for i in range(10)]
    idx.commit_stored(0, hashes[:6], list(range(6)), [100] * 6, list(range(1, 7)))  # seqs 1-6, one value
    idx.commit_stored(0, hashes[6:], list(range(6, 10)), [100] * 4, list(range(7, 11)))  # seqs 7-10
    short = b"short"  # another hash length: its own value in the same transaction
    idx.log_failed(1, [hashes[0], short, hashes[1]], [20, 21, 22])  # seqs 11-13
    every = idx.read_log(0)
    assert [r.seq for r in every] == list(range(1, 14))
    assert [r.block_hash for r in every] == hashes + [hashes[0], short, hashes[1]]
    assert [r.slot for r in every] == list(range(10)) + [20, 21, 22]
    # Resuming inside a value skips what was read; a limit cuts inside a value.
    for after, limit in [(3, 2), (3, 5), (5, 100), (9, 3), (10, 2), (11, 2), (13, 5)]:
        assert idx.read_log_columns(after, limit).records() == every[after : after + limit], (after, limit)


def test_clear_for_overwrite_rules(idx):
    idx.commit_stored(0, [A], [1], [100], [11])
    idx.commit_stored(1, [A], [1], [100], [21])
    idx.commit_stored(0, [B], [2], [100], [12])
    # Nothing to clear for a fresh slot and an unknown block.
    assert not idx.needs_clearing(0, [C], [7])
    # Another block's slot: its entry goes (it would be torn by the overwrite).
    assert idx.needs_clearing(0, [C], [1])
    idx.clear_for_overwrite(0, [C], [1])
    assert idx.get(A) is None
    # The same block rewritten in its own slot: only this rank's bit is cleared.
    idx.commit_stored(0, [A], [1], [100], [11])
    idx.commit_stored(1, [A], [1], [100], [21])
    idx.clear_for_overwrite(1, [A], [1])
    e = idx.get(A)
    assert e.ranks == 0b01 and e.checksums == (11, 0)
    # A stale entry of the block in another slot is dropped.
    idx.clear_for_overwrite(0, [B], [9])
    assert idx.get(B) is None


def test_commit_replaces_an_entry_from_another_slot(idx):
    idx.commit_stored(0, [A], [1], [100], [11])
    idx.commit_stored(1, [A], [1], [100], [21])
    idx.commit_stored(0, [A], [5], [100], [31])
    e = idx.get(A)
    assert e.slot == 5 and e.ranks == 0b01 and e.checksums == (31, 0)


def test_apply_batch_deletes_only_matching_unheld_entries_and_trims_log(idx):
    idx.commit_stored(0, [A, B, C], [1, 2, 3], [100] * 3, [1, 2, 3])
    seq = idx.log_seq()
    deleted = idx.apply_batch([(A, 1), (B, 9), (C, 3)], {}, seq, still_held=lambda items: {(C, 3)})
    assert deleted == 1
    assert idx.get(A) is None  # evicted
    assert idx.get(B).slot == 2  # the delete named another slot: B was re-stored elsewhere
    assert idx.get(C) is not None  # the manager holds it again
    assert idx.read_log(0) == []
    # Sequence numbers keep growing after the log was trimmed.
    idx.drop_corrupt(0, [(B, 2)])
    assert idx.get(B) is None
    assert [(r.seq, r.status) for r in idx.read_log(0)] == [(seq + 1, LOG_CORRUPT)]


def test_touch_updates_access_time_and_hits(idx):
    idx.commit_stored(0, [A], [1], [100], [1])
    t0 = idx.get(A).last_access
    idx.apply_batch([], {A: (t0 + 50, 3), C: (t0, 1)}, 0)
    e = idx.get(A)
    assert e.last_access == t0 + 50 and e.hits == 3 and idx.get(C) is None


def test_writer_grows_a_full_map(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "_MIN_MAP_SIZE", 64 << 10)
    with DiskIndex(tmp_path / "i", tp_size=1) as idx:
        hashes = [block_hash(i) for i in range(3000)]
        idx.commit_stored(0, hashes, list(range(3000)), [100] * 3000, list(range(3000)))
        assert idx.count() == 3000
        assert idx._shared.env.info()["map_size"] > 64 << 10


def _grow_in_child(path: str) -> None:
    index_mod._MIN_MAP_SIZE = 64 << 10
    idx = DiskIndex(path, tp_size=1)
    hashes = [block_hash(i) for i in range(3000)]
    idx.commit_stored(0, hashes, list(range(3000)), [100] * 3000, list(range(3000)))
    idx.close()


def test_reader_survives_map_resized_by_another_process(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "_MIN_MAP_SIZE", 64 << 10)
    path = tmp_path / "i"
    with DiskIndex(path, tp_size=1) as reader:
        assert reader.count() == 0
        p = multiprocessing.get_context("spawn").Process(target=_grow_in_child, args=(str(path),))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        # The other process grew the map past ours: MDB_MAP_RESIZED is absorbed.
        assert reader.count() == 3000
        assert reader.get(block_hash(2999)).slot == 2999
        assert len(reader.load_all()) == 3000


def test_readonly_index_open(tmp_path):
    path = tmp_path / "i"
    with pytest.raises(FileNotFoundError):
        DiskIndex(path, tp_size=1, readonly=True)
    w = DiskIndex(path, tp_size=1)
    w.commit_stored(0, [A], [1], [100], [5])
    w.close()
    with DiskIndex(path, tp_size=1, readonly=True) as r:
        assert r.get(A).checksums == (5,)
        with pytest.raises(lmdb.Error):
            r.commit_stored(0, [B], [2], [100], [5])


def test_reopen_of_a_large_index_serves_every_block_without_reading_slabs(tmp_path):
    """Restart adopts the index alone: every entry is loadable after reopen even though
    the slab holds no block data at all (so none was read or checked). The time this
    takes at 1M blocks is measured by tools/bench_reopen.py, not asserted here."""
    layout = small_layout()
    fp = fingerprint(layout)
    n = 200_000
    ns = Namespace.open(tmp_path, fp, layout, num_slots=n)
    ns.allocate_slab(0)  # preallocated, never written: reopening must not look inside
    idx = DiskIndex(ns.index_path, 1, expected_entries=n)
    hashes = fill_index(idx, n, layout.bytes_per_block)
    idx.close()
    with DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, n)) as m:
        assert len(m) == len(hashes) and m.num_free_slots() == n - len(hashes)
        assert m.lookup(hashes[::10_000]) == len(hashes[::10_000])


@pytest.mark.parametrize("odd_first", [True, False])
def test_load_all_decodes_every_entry_of_mixed_lengths_and_skips_damaged_ones(idx, odd_first):
    """One value length is streamed straight into an array; another length anywhere
    (first or later in key order) must neither be padded/cut into that array nor lost."""
    long_hashes = [block_hash(i) for i in range(50)]  # 32 bytes
    short = (b"\x00" if odd_first else b"\xff") + b"short-hash-16B!"  # sorts first / last
    idx.commit_stored(0, long_hashes, list(range(50)), [100] * 50, list(range(1, 51)))
    idx.commit_stored(0, [short], [60], [100], [7])
    damaged = b"\x80damaged"
    idx._shared.run(lambda txn: txn.put(damaged, b"\x01\x02\x03", db=idx._db("blocks")), write=True)
    snap = idx.load_all()
    assert len(snap) == 51
    assert sorted(snap.hash_at(i) for i in range(len(snap.entries))) == sorted(long_hashes)
    assert snap.entries["slot"].tolist() == [long_hashes.index(snap.hash_at(i)) for i in range(50)]
    assert snap.entries["checksums"][:, 0].tolist() == [long_hashes.index(snap.hash_at(i)) + 1 for i in range(50)]
    assert [(h, e.slot, e.checksums[0]) for h, e in snap.odd] == [(short, 60, 7)]
    assert snap.log_seq == 51
