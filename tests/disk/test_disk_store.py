"""DiskStore: the crash-safe write protocol, verified reads, corruption, full disks,
backends."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import pytest
import torch

from support.disk_fixtures import (
    FaultyBackend,
    block_content,
    block_hash,
    content_rows,
    disk_bytes_for,
    fingerprint,
    flip_byte,
    small_layout,
)
from tiered_kv.disk.format.index_records import LOG_CORRUPT, LOG_FAILED, LOG_OK
from tiered_kv.disk.store.io_backends import (
    BackendUnavailableError,
    KvikIOBackend,
    PosixBackend,
    aligned_empty,
    select_backend,
)
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.store.checksums import RunChecksums, checksum_function
from tiered_kv.disk.store.store import DiskStore

SLOTS = 16


def open_store(path, layout, tp_size=1, **kw):
    kw.setdefault("io_backend", "posix")
    return DiskStore.open(
        path, fingerprint(layout, tp_size=tp_size), layout, disk_bytes=disk_bytes_for(layout, SLOTS), **kw
    )


def read_back(store, rank, hashes, slots):
    out = aligned_empty(len(hashes) * store.slot_size).view(len(hashes), store.slot_size)
    ok = store.read_blocks(rank, hashes, slots, out)
    return ok, [bytes(out[i, : store.block_bytes].numpy()) for i in range(len(hashes))]


@pytest.fixture
def layout():
    return small_layout(factor=2, head_dim=48)  # 9 KiB blocks in 12 KiB slots: padded, several pages


def test_round_trip_and_direct_io(tmp_path, layout):
    with open_store(tmp_path, layout) as store:
        assert store.slot_size % 4096 == 0 and store.slot_size >= layout.bytes_per_block
        hashes = [block_hash(i) for i in range(6)]
        slots = [0, 1, 2, 7, 9, 10]  # two coalesced runs and a single
        assert store.write_blocks(0, hashes, slots, content_rows(hashes, 0, layout, store.slot_size)) == [True] * 6
        ok, data = read_back(store, 0, hashes, slots)
        assert ok == [True] * 6
        assert data == [block_content(h, 0, layout.bytes_per_block) for h in hashes]
        assert store._files[0].direct, "ext4 takes O_DIRECT; the store must use it"
        s = store.stats
        assert (s.stores, s.loads, s.bytes_written) == (6, 6, 6 * layout.bytes_per_block)
        # Unaligned / unpadded input (e.g. from a tool) is bounced, not refused.
        plain = torch.frombuffer(
            bytearray(block_content(hashes[0], 0, layout.bytes_per_block)), dtype=torch.uint8
        ).view(1, -1)
        assert store.write_blocks(0, [hashes[0]], [3], plain) == [True]
        assert store.read_block(0, hashes[0]) == block_content(hashes[0], 0, layout.bytes_per_block)


def test_rows_that_need_a_bounce_or_come_with_host_rows_round_trip(tmp_path, layout):
    """Unpadded rows are read through a bounce buffer and copied out after the check;
    with ``host_rows`` the checksums are of those rows (as for device rows, whose
    host mirror the handlers fill), and a mismatch there fails the block."""
    with open_store(tmp_path, layout) as store:
        bb = layout.bytes_per_block
        hashes = [block_hash(f"b{i}") for i in range(3)]
        rows = content_rows(hashes, 0, layout, store.slot_size)
        mirror = rows.clone()
        mirror[2, :bb] ^= 1  # the mirror must be what is checksummed: block 2's sum is wrong
        batch = store.begin_write(0, hashes, [4, 5, 6])
        batch.submit(0, rows, mirror)
        assert batch.finish() == [True] * 3

        unpadded = torch.zeros(2, bb, dtype=torch.uint8)  # no room for the slot: bounced
        assert store.read_blocks(0, hashes[:2], [4, 5], unpadded) == [True, True]
        assert [bytes(r.numpy()) for r in unpadded] == [block_content(h, 0, bb) for h in hashes[:2]]

        out = aligned_empty(3 * store.slot_size).view(3, store.slot_size)
        host = torch.zeros(3, store.slot_size, dtype=torch.uint8)
        batch = store.begin_read(0, hashes, [4, 5, 6])
        batch.submit(0, out, host)
        assert batch.finish() == [True, True, False]
        assert bytes(host[1, :bb].numpy()) == block_content(hashes[1], 0, bb)
        assert store.stats.checksum_failures == 1 and store.entry(hashes[2]) is None


def test_wrong_slot_or_missing_block_is_not_served(tmp_path, layout):
    with open_store(tmp_path, layout) as store:
        h = [block_hash("x")]
        store.write_blocks(0, h, [4], content_rows(h, 0, layout, store.slot_size))
        ok, _ = read_back(store, 0, h, [5])  # the index says slot 4
        assert ok == [False]
        ok, _ = read_back(store, 0, [block_hash("never")], [6])
        assert ok == [False] and store.stats.missing_entries == 2


@pytest.mark.faults
def test_flipped_byte_is_detected_dropped_and_counted(tmp_path, layout):
    with open_store(tmp_path, layout) as store:
        hashes = [block_hash(i) for i in range(3)]
        store.write_blocks(0, hashes, [0, 1, 2], content_rows(hashes, 0, layout, store.slot_size))
        flip_byte(store.namespace.slab_path(0), 1 * store.slot_size + layout.bytes_per_block - 1)
        ok, data = read_back(store, 0, hashes, [0, 1, 2])
        assert ok == [True, False, True]
        assert data[0] == block_content(hashes[0], 0, layout.bytes_per_block)
        assert store.stats.checksum_failures == 1
        assert store.entry(hashes[1]) is None, "a corrupt block must leave the index"
        assert [(r.status, r.block_hash) for r in store.index.read_log(0)][-1] == (LOG_CORRUPT, hashes[1])
        assert store.read_block(0, hashes[1]) is None  # never returned, not even later


@pytest.mark.faults
def test_flipped_byte_in_padding_is_harmless(tmp_path, layout):
    with open_store(tmp_path, layout) as store:
        h = [block_hash(0)]
        store.write_blocks(0, h, [0], content_rows(h, 0, layout, store.slot_size))
        assert store.slot_size > layout.bytes_per_block
        flip_byte(store.namespace.slab_path(0), store.slot_size - 1)
        assert read_back(store, 0, h, [0])[0] == [True]


def test_block_is_loadable_only_when_every_rank_committed(tmp_path, layout):
    fp = fingerprint(layout, tp_size=2)
    store = open_store(tmp_path, layout, tp_size=2)
    hashes = [block_hash(i) for i in range(4)]
    store.write_blocks(0, hashes, [0, 1, 2, 3], content_rows(hashes, 0, layout, store.slot_size))
    store.write_blocks(1, hashes[:2], [0, 1], content_rows(hashes[:2], 1, layout, store.slot_size))
    store.close()
    with DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, SLOTS)) as m:
        assert [m.is_loadable(h) for h in hashes] == [True, True, False, False]
        assert m.stats.reclaimed_at_open == 2 and m.num_free_slots() == SLOTS - 2
        assert m.flush()
        assert m.index.get(hashes[2]) is None, "partial entries are reclaimed on open"


@pytest.mark.faults
def test_enospc_on_write_fails_the_store_counted_without_raising(tmp_path, layout):
    fp = fingerprint(layout)
    with (
        FaultyBackend(write_budget=3 * 12288 + 1) as backend,  # room for the first job only
        DiskStore.open(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, SLOTS), io_backend=backend) as store,
    ):
        first = [block_hash(i) for i in range(3)]
        assert store.write_blocks(0, first, [0, 1, 2], content_rows(first, 0, layout, store.slot_size)) == [True] * 3
        more = [block_hash(i) for i in range(3, 6)]
        assert store.write_blocks(0, more, [3, 4, 5], content_rows(more, 0, layout, store.slot_size)) == [False] * 3
        assert store.stats.store_failures == 3 and store.stats.enospc == 1
        assert [r.status for r in store.index.read_log(0)][-3:] == [LOG_FAILED] * 3
        assert all(store.entry(h) is None for h in more)
        # Nothing durable was lost.
        assert read_back(store, 0, first, [0, 1, 2])[0] == [True] * 3


@pytest.mark.faults
def test_failed_fsync_or_read_fails_the_job(tmp_path, layout):
    with (
        FaultyBackend() as backend,
        DiskStore.open(
            tmp_path, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, SLOTS), io_backend=backend
        ) as store,
    ):
        h = [block_hash(1)]
        backend.fail_sync = errno.EIO
        assert store.write_blocks(0, h, [0], content_rows(h, 0, layout, store.slot_size)) == [False]
        assert store.entry(h[0]) is None
        backend.fail_sync = None
        assert store.write_blocks(0, h, [0], content_rows(h, 0, layout, store.slot_size)) == [True]
        backend.fail_read = errno.EIO
        assert read_back(store, 0, h, [0])[0] == [False]
        # Kept, the block would be offered again and fail every load that meets it.
        assert store.entry(h[0]) is None and store.stats.checksum_failures == 0


@pytest.mark.faults
def test_full_filesystem_turns_into_failed_counted_stores(tmp_path, layout):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        fp = fingerprint(layout)
        nbytes = disk_bytes_for(layout, 8)  # 8 x 12 KiB slots preallocated
        m = DiskOffloadingManager(mnt, fp, layout, disk_bytes=nbytes)
        store = DiskStore.open(mnt, fp, layout, disk_bytes=nbytes, io_backend="posix")
        first = [block_hash(i) for i in range(2)]
        assert store.write_blocks(0, first, [0, 1], content_rows(first, 0, layout, store.slot_size)) == [True] * 2
        # The manager reserved room for the index to grow into; give it back (truncating
        # to the same size frees preallocated blocks past the end) to reach the case
        # where an index commit itself hits ENOSPC.
        data = m.namespace.index_path / "data.mdb"
        os.truncate(data, data.stat().st_size)
        # Something else fills the filesystem; the index cannot grow any more.
        with open(mnt / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        failures = 0
        for k in range(40):  # enough new entries to need new index pages
            hs = [block_hash(f"more-{k}-{i}") for i in range(6)]
            ok = store.write_blocks(0, hs, list(range(2, 8)), content_rows(hs, 0, layout, store.slot_size))
            failures += ok.count(False)
        assert failures > 0 and store.stats.store_failures == failures
        assert read_back(store, 0, first, [0, 1])[0] == [True, True]
        (mnt / "filler").unlink()
        hs = [block_hash("after")]
        assert store.write_blocks(0, hs, [2], content_rows(hs, 0, layout, store.slot_size)) == [True]
        store.close()
        m.shutdown()
    finally:
        subprocess.run(["umount", str(mnt)])


def test_crc32c_checksum(tmp_path, layout):
    pytest.importorskip("crc32c")
    with open_store(tmp_path, layout, checksum="crc32c") as store:
        assert store.checksum_name == "crc32c"
        h = [block_hash(0)]
        store.write_blocks(0, h, [0], content_rows(h, 0, layout, store.slot_size))
        want = checksum_function("crc32c")(block_content(h[0], 0, layout.bytes_per_block))
        assert store.entry(h[0]).checksums == (want,)
        assert store.read_block(0, h[0]) is not None
    with pytest.raises(ValueError, match="xxh3_64 or crc32c"):
        checksum_function("md5")


@pytest.mark.parametrize("name", ["xxh3_64", "crc32c"])
def test_a_block_hashed_piece_by_piece_gets_the_checksum_of_its_bytes(name):
    """The vectored paths hash a block's pieces where they lie; the packed paths hash
    the same bytes in one buffer. Both must record the same checksum, whichever way
    ``RunChecksums`` hashes a block (holding the GIL, or in one call above 2 MiB)."""
    if name == "crc32c":
        pytest.importorskip("crc32c")
    data = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8)
    view = memoryview(data)
    cuts = [0, 1, 4096, 40_000, 1 << 20, (1 << 20) + 3, 3 << 20]
    pieces = [view[a:b] for a, b in zip(cuts, cuts[1:])]
    small = [view[: 1 << 20]], [view[1 << 20 : (1 << 20) + 3]]
    want = checksum_function(name)
    run_checksums = RunChecksums(name)
    assert run_checksums([pieces, [view], *small, pieces[:-1]]) == [
        want(view),
        want(view),
        want(small[0][0]),
        want(small[1][0]),
        want(view[: cuts[-2]]),
    ]
    assert want(view[: cuts[-2]]) != want(view)
    assert run_checksums([]) == []


def test_auto_backend_chooses_posix_and_says_why(tmp_path, caplog, monkeypatch):
    reason = KvikIOBackend.probe(tmp_path)
    if reason is None:
        pytest.skip("KvikIO really works here")
    with caplog.at_level(logging.INFO, logger="tiered_kv.disk.store.io_backends"):
        backend = select_backend("auto", tmp_path)
    with backend:
        assert isinstance(backend, PosixBackend)
        assert any("posix" in r.message and "KvikIO not usable" in r.message for r in caplog.records)
    with pytest.raises(BackendUnavailableError, match="io_backend=kvikio cannot run here"):
        select_backend("kvikio", tmp_path)
    with pytest.raises(ValueError, match="auto, kvikio, posix"):
        select_backend("spdk", tmp_path)


def test_buffered_fallback_where_o_direct_is_refused(tmp_path, layout, monkeypatch):
    import tiered_kv.disk.store.io_backends as iob

    monkeypatch.setattr(iob, "_set_direct", lambda fd: "Invalid argument")
    with open_store(tmp_path, layout) as store:
        h = [block_hash(0)]
        assert store.write_blocks(0, h, [0], content_rows(h, 0, layout, store.slot_size)) == [True]
        assert not store._files[0].direct
        assert store.read_block(0, h[0]) == block_content(h[0], 0, layout.bytes_per_block)


@pytest.mark.gpu
def test_kvikio_gds_round_trip_from_device_memory(tmp_path, layout):
    if KvikIOBackend.probe(tmp_path) is not None:
        pytest.skip(f"KvikIO unusable: {KvikIOBackend.probe(tmp_path)}")
    with open_store(tmp_path, layout, io_backend="kvikio") as store:
        hashes = [block_hash(i) for i in range(4)]
        host = content_rows(hashes, 0, layout, store.slot_size)
        dev = host.cuda()
        batch = store.begin_write(0, hashes, [0, 1, 2, 3])
        batch.submit(0, dev, host)
        assert batch.finish() == [True] * 4
        out = torch.zeros_like(dev)
        mirror = torch.zeros_like(host)
        rb = store.begin_read(0, hashes, [0, 1, 2, 3])
        rb.submit(0, out, mirror)
        assert rb.finish() == [True] * 4
        assert torch.equal(out.cpu()[:, : layout.bytes_per_block], host[:, : layout.bytes_per_block])


def test_store_rejects_bad_input_clearly(tmp_path, layout):
    with open_store(tmp_path, layout) as store:
        with pytest.raises(ValueError, match="one slot per hash"):
            store.begin_write(0, [block_hash(0)], [0, 1])
        with pytest.raises(ValueError, match=r"uint8 tensor of shape \(N, >= "):
            store.write_blocks(0, [block_hash(0)], [0], torch.zeros(1, 10, dtype=torch.uint8))
        bad = store.write_blocks(
            0, [block_hash(0)], [SLOTS + 5], content_rows([block_hash(0)], 0, layout, store.slot_size)
        )
        assert bad == [False], "a slot past the namespace fails the block, it does not raise"


# ---------------------------------------------------------------- group commit


class OrderCheckingBackend(PosixBackend):
    """A real POSIX backend that checks the store's ordering at each step: when a
    block's bytes are written its slot is not loadable from the index, and when the
    slab is synced no block of the jobs being synced is committed yet. ``gate``, when
    set, holds the next ``fdatasync`` until it is released, so jobs queue up behind it."""

    def __init__(self, threads: int = 2):
        super().__init__(threads)
        self.store: DiskStore | None = None
        self.slot_of: dict[int, bytes] = {}  # slot -> hash being written there
        self.pending: set[bytes] = set()  # written, not yet synced
        self.violations: list[str] = []
        self.syncs = 0
        self.gate: threading.Event | None = None
        self.waiting = threading.Event()
        self.fail_offsets: set[int] = set()

    def watch(self, jobs) -> None:
        """Check the ordering for ``jobs``' blocks: ``[(hashes, slots), ...]``."""
        for hashes, slots in jobs:
            self.slot_of.update(zip(slots, hashes))

    def pwritev(self, f, views, offset):  # every host write ends here
        if offset in self.fail_offsets:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        size = self.store.slot_size
        written = [self.slot_of.get(slot) for slot in range(offset // size, (offset + sum(map(len, views))) // size)]
        for slot, h in enumerate(written, offset // size):
            e = None if h is None else self.store.index.get(h)
            if e is not None and e.slot == slot and e.has_rank(0):
                self.violations.append(f"slot {slot} overwritten while its block was loadable")
        super().pwritev(f, views, offset)
        self.pending.update(h for h in written if h is not None)

    def sync(self, f):
        gate, self.gate = self.gate, None
        if gate is not None:
            self.waiting.set()
            gate.wait(30)
        for h in list(self.pending):
            if self.store.index.get(h) is not None and self.store.index.get(h).has_rank(0):
                self.violations.append(f"block {h.hex()[:8]} committed before its bytes were synced")
        self.pending.clear()
        self.syncs += 1
        super().sync(f)


@pytest.fixture
def ordered(tmp_path, layout):
    """``(store, backend)``: a store over an ``OrderCheckingBackend``, both closed after the test."""
    with (
        OrderCheckingBackend() as backend,
        DiskStore.open(
            tmp_path, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, SLOTS), io_backend=backend
        ) as store,
    ):
        backend.store = store
        yield store, backend


def _jobs(n_jobs, per_job, tag="j"):
    return [
        ([block_hash(f"{tag}{j}-{i}") for i in range(per_job)], list(range(j * per_job, (j + 1) * per_job)))
        for j in range(n_jobs)
    ]


def _queue_behind_held_sync(store, backend, layout, jobs, submit_rows=None):
    """Run ``jobs[0]`` with its fdatasync held, write the other jobs meanwhile, let
    them all queue their commits, then release; returns every job's result."""
    backend.watch(jobs)
    rows = [content_rows(h, 0, layout, store.slot_size) for h, _ in jobs]
    gate = threading.Event()
    backend.gate = gate
    with ThreadPoolExecutor(len(jobs)) as ex:
        first = ex.submit(store.write_blocks, 0, jobs[0][0], jobs[0][1], rows[0])
        assert backend.waiting.wait(30), "the first job never reached its fdatasync"
        batches = [store.begin_write(0, h, s) for h, s in jobs[1:]]
        for b, r in zip(batches, rows[1:]):
            b.submit(0, r)
            b.wait_idle()
        rest = [ex.submit(b.finish) for b in batches]
        while len(store._committer._queue) < len(batches):  # every commit queued behind the held one
            time.sleep(0.01)
        gate.set()
        return [first.result()] + [f.result() for f in rest]


def test_concurrent_jobs_share_one_sync_and_commit_every_block(layout, ordered):
    store, backend = ordered
    jobs = _jobs(5, 3)
    results = _queue_behind_held_sync(store, backend, layout, jobs)
    assert results == [[True] * 3] * 5
    assert backend.syncs == 2, f"the four queued jobs must share one fdatasync; saw {backend.syncs} syncs"
    assert backend.violations == []
    every = [h for hs, _ in jobs for h in hs]
    ok, data = read_back(store, 0, every, [s for _, ss in jobs for s in ss])
    assert ok == [True] * 15
    assert data == [block_content(h, 0, layout.bytes_per_block) for h in every]
    assert sorted(r.block_hash for r in store.index.read_log(0) if r.status == LOG_OK) == sorted(every)
    assert store.stats.stores == 15 and store.stats.store_failures == 0


def test_finish_async_frees_the_caller_while_its_commit_waits(layout, ordered):
    store, backend = ordered
    jobs = _jobs(2, 3)
    backend.watch(jobs)
    rows = [content_rows(h, 0, layout, store.slot_size) for h, _ in jobs]
    backend.gate = gate = threading.Event()
    batches, done = [], []
    for (hashes, slots), r in zip(jobs, rows):
        batch = store.begin_write(0, hashes, slots)
        batch.submit(0, r)
        batch.wait_idle()
        batches.append(batch)
        done.append(batch.finish_async())  # returns at once
        if len(done) == 1:
            assert backend.waiting.wait(30), "the first job never reached its fdatasync"
    # The second job wrote while the first one's commit was held; neither is settled.
    assert not done[0].done() and not done[1].done()
    assert store.entry(jobs[0][0][0]) is None
    gate.set()
    assert [d.result(30) for d in done] == [[True] * 3, [True] * 3]
    assert backend.violations == []
    every = [h for hs, _ in jobs for h in hs]
    ok, data = read_back(store, 0, every, [s for _, ss in jobs for s in ss])
    assert ok == [True] * 6
    assert data == [block_content(h, 0, layout.bytes_per_block) for h in every]


@pytest.mark.faults
def test_a_failed_job_in_a_group_fails_alone(layout, ordered):
    store, backend = ordered
    jobs = _jobs(3, 3)
    backend.fail_offsets = {jobs[1][1][0] * store.slot_size}  # job 1's (coalesced) write: EIO
    results = _queue_behind_held_sync(store, backend, layout, jobs)
    assert results == [[True] * 3, [False] * 3, [True] * 3]
    assert backend.violations == []
    assert all(store.entry(h) is None for h in jobs[1][0]), "no block of the failed job is loadable"
    assert read_back(store, 0, jobs[2][0], jobs[2][1])[0] == [True] * 3
    log = store.index.read_log(0)
    assert sorted(r.block_hash for r in log if r.status == LOG_FAILED) == sorted(jobs[1][0])
    assert store.stats.store_failures == 3 and store.stats.stores == 6


@pytest.mark.faults
def test_an_index_commit_that_fails_for_one_job_is_retried_alone(layout, monkeypatch, ordered):
    store, backend = ordered
    jobs = _jobs(3, 2)
    poison = jobs[2][0][0]
    commit_group = store.index.commit_group

    def refuse_poison(stored, clears):  # fault injection: this job's transaction cannot commit
        if any(poison in job.hashes for job in stored):
            raise lmdb.BadValsizeError("injected")
        return commit_group(stored, clears)

    monkeypatch.setattr(store.index, "commit_group", refuse_poison)
    results = _queue_behind_held_sync(store, backend, layout, jobs)
    assert results == [[True] * 2, [True] * 2, [False] * 2]
    assert read_back(store, 0, jobs[1][0], jobs[1][1])[0] == [True] * 2
    assert all(store.entry(h) is None for h in jobs[2][0])
    assert [r.status for r in store.index.read_log(0) if r.block_hash in jobs[2][0]] == [LOG_FAILED] * 2
    assert store.stats.store_failures == 2


@pytest.mark.faults
def test_a_failed_group_sync_fails_every_job_synced_in_it(tmp_path, layout):
    with (
        FaultyBackend() as backend,
        DiskStore.open(
            tmp_path, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, SLOTS), io_backend=backend
        ) as store,
    ):
        jobs = _jobs(3, 2)
        backend.fail_sync = errno.EIO
        with ThreadPoolExecutor(3) as ex:
            results = list(
                ex.map(
                    lambda j: store.write_blocks(0, j[0], j[1], content_rows(j[0], 0, layout, store.slot_size)), jobs
                )
            )
        assert results == [[False] * 2] * 3
        assert all(store.entry(h) is None for hs, _ in jobs for h in hs)
        assert store.stats.store_failures == 6
        backend.fail_sync = None
        assert (
            store.write_blocks(0, jobs[0][0], jobs[0][1], content_rows(jobs[0][0], 0, layout, store.slot_size))
            == [True] * 2
        )


def test_restoring_a_loadable_block_clears_it_before_overwriting(layout, ordered):
    store, backend = ordered
    jobs = _jobs(2, 3)
    backend.watch(jobs)
    for hashes, slots in jobs * 2:  # the second pass overwrites loadable blocks in place
        assert store.write_blocks(0, hashes, slots, content_rows(hashes, 0, layout, store.slot_size)) == [True] * 3
    # Another block into a slot that holds a loadable one: the old owner goes first.
    new = [block_hash("newcomer")]
    backend.slot_of[jobs[0][1][0]] = jobs[0][0][0]
    assert store.write_blocks(0, new, [jobs[0][1][0]], content_rows(new, 0, layout, store.slot_size)) == [True]
    assert backend.violations == []
    assert store.entry(jobs[0][0][0]) is None
    assert read_back(store, 0, new + jobs[1][0], [jobs[0][1][0]] + jobs[1][1])[0] == [True] * 4


@pytest.mark.faults
def test_vectored_io_carries_on_after_short_transfers(tmp_path):
    """A short preadv/pwritev (which O_DIRECT on a real disk does not produce on demand)
    is continued from where it stopped, across and inside buffers."""
    from tiered_kv.disk.store.io_backends import BackendFile, _move_all

    target = bytearray(64)

    def at_most_5(fd, views, offset):  # moves at most 5 bytes per call
        moved = 0
        for v in views:
            n = min(len(v), 5 - moved)
            target[offset + moved : offset + moved + n] = v[:n]
            moved += n
            if moved == 5:
                break
        return moved

    views = [memoryview(bytes(range(i * 7, i * 7 + 7))) for i in range(3)]
    _move_all(at_most_5, BackendFile(tmp_path / "x", -1, False), views, 10, "short at {at}")
    assert bytes(target[10:31]) == bytes(range(21))
    with pytest.raises(OSError, match="short at 12"):
        _move_all(
            lambda fd, v, off: 2 if off == 10 else 0, BackendFile(tmp_path / "x", -1, False), views, 10, "short at {at}"
        )
