"""Disk handlers: every (src, dst) pair round-trips through the disk; failures are
reported as failed jobs, never raised; staging memory stays bounded."""

from __future__ import annotations

import contextlib

import errno
import threading
import time

import numpy as np
import pytest
import torch

from conftest import make_layout, random_tensors
from support.disk_fixtures import FaultyBackend, block_hash, disk_bytes_for, fingerprint, flip_byte, small_layout
from tiered_kv.disk.format.namespace import slot_size_for
import tiered_kv.disk.store.batch as batch_module
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.memory.host_memory import HostKVCache, expand_block_ids
from tiered_kv.mediums import CPULoadStoreSpec, DiskLoadStoreSpec, GPULoadStoreSpec
from tiered_kv.disk.worker.handlers import CpuDiskHandler, GpuDiskHandler
from tiered_kv.worker.worker import OffloadingWorker

SLOTS = 32


def kv_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def kernel_blocks(tensors, layout, kernel_ids):
    """Per layer, the bytes of the given kernel blocks (to compare two caches)."""
    out = []
    for t, layer in zip(tensors, layout.layers):
        dim = 1 if layer.kv_before_num_blocks else 0
        index = torch.as_tensor(np.asarray(kernel_ids), dtype=torch.long, device=t.device)
        out.append(kv_bytes(t.index_select(dim, index)))
    return out


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def finish(handler, job_ids):
    handler.wait(set(job_ids))
    return {r.job_id: r.success for r in handler.get_finished()}


def open_store(tmp_path, layout, backend="posix"):
    return DiskStore.open(
        tmp_path, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, SLOTS), io_backend=backend
    )


def host_cache(layout, slots, seed):
    host = HostKVCache(layout, slots, pin=False)
    for t, r in zip(host.tensors, random_tensors(layout, num_blocks=slots * layout.block_size_factor, seed=seed)):
        t.copy_(r)
    return host


def disk_spec(slots, prefix="b"):
    return DiskLoadStoreSpec(slots, [block_hash(f"{prefix}{s}") for s in slots])


def test_cpu_disk_cpu_round_trip(tmp_path, kv_first, factor):
    layout = small_layout(kv_first, factor=factor)
    src, dst = host_cache(layout, 8, seed=1), host_cache(layout, 8, seed=2)
    with (
        open_store(tmp_path, layout) as store,
        CpuDiskHandler(store, 0, src, layout, staging_bytes=3 * store.slot_size) as h,  # forces several chunks
        CpuDiskHandler(store, 0, dst, layout) as h2,
    ):
        disk = disk_spec([5, 6, 7, 0, 11, 12, 13])
        assert h.transfer_async(1, (CPULoadStoreSpec([0, 1, 2, 3, 4, 5, 6]), disk))
        assert finish(h, [1]) == {1: True}
        assert h2.transfer_async(2, (disk, CPULoadStoreSpec([7, 6, 5, 4, 3, 2, 1])))
        assert finish(h2, [2]) == {2: True}
        f = layout.block_size_factor
        assert_same(
            kernel_blocks(src.tensors, layout, expand_block_ids(range(7), f)),
            kernel_blocks(dst.tensors, layout, expand_block_ids([7, 6, 5, 4, 3, 2, 1], f)),
        )
        stats = {"cpu_to_disk": h.stats.transfers["cpu_to_disk"], "disk_to_cpu": h2.stats.transfers["disk_to_cpu"]}
        assert stats["cpu_to_disk"].bytes == 7 * layout.bytes_per_block and stats["cpu_to_disk"].seconds > 0
        assert stats["disk_to_cpu"].blocks == 7 and stats["disk_to_cpu"].failed_jobs == 0


def test_a_disk_job_reports_its_own_time_not_the_time_until_it_was_polled(tmp_path):
    poll_delay = 1.0  # well above a job's own time even with a slow fdatasync
    layout = small_layout(False)
    with (
        open_store(tmp_path, layout) as store,
        CpuDiskHandler(store, 0, host_cache(layout, 4, seed=1), layout) as h,
    ):
        disk = disk_spec([0, 1, 2])
        for job_id, spec, kind in (
            (1, (CPULoadStoreSpec([0, 1, 2]), disk), "cpu_to_disk"),
            (2, (disk, CPULoadStoreSpec([3, 2, 1])), "disk_to_cpu"),
        ):
            assert h.transfer_async(job_id, spec)
            h.wait({job_id})
            time.sleep(poll_delay)
            (result,) = h.get_finished()
            assert result.success and 0 < result.seconds < poll_delay
            assert result.seconds == h.stats.transfers[kind].seconds  # the one job of its kind


def test_gpu_pairs_via_the_cpu_fallback_and_cross_pairs(tmp_path, kv_first, factor):
    """GPU->DISK, DISK->GPU (with CPU tensors standing in for the device), and the mixed
    CPU->DISK->GPU / GPU->DISK->CPU routes through one OffloadingWorker."""
    layout = small_layout(kv_first, factor=factor)
    f = layout.block_size_factor
    gpu = random_tensors(layout, seed=3)  # 32 kernel blocks
    host = host_cache(layout, 8, seed=4)
    with open_store(tmp_path, layout) as store, OffloadingWorker() as worker:
        cpu_h = CpuDiskHandler(store, 0, host, layout)
        gpu_h = GpuDiskHandler(store, 0, gpu, layout)
        worker.register_handler(CPULoadStoreSpec, DiskLoadStoreSpec, cpu_h)
        worker.register_handler(DiskLoadStoreSpec, CPULoadStoreSpec, cpu_h)
        worker.register_handler(GPULoadStoreSpec, DiskLoadStoreSpec, gpu_h)
        worker.register_handler(DiskLoadStoreSpec, GPULoadStoreSpec, gpu_h)
        n = 3
        src_gpu = expand_block_ids([1, 4, 6], f) if f > 1 else np.array([3, 17, 9])
        d1 = disk_spec([0, 1, 2], "g")
        assert worker.transfer_async(1, (GPULoadStoreSpec(src_gpu), d1))
        # GPU -> DISK -> CPU
        worker.wait({1})
        assert worker.transfer_async(2, (d1, CPULoadStoreSpec([5, 6, 7])))
        worker.wait({2})
        # CPU -> DISK -> GPU
        d2 = disk_spec([10, 11, 12], "c")
        assert worker.transfer_async(3, (CPULoadStoreSpec([0, 1, 2]), d2))
        worker.wait({3})
        dst_gpu = np.arange(32 - n * f, 32)
        assert worker.transfer_async(4, (d2, GPULoadStoreSpec(dst_gpu)))
        worker.wait({4})
        # DISK -> GPU again, of the GPU-stored blocks, into other GPU blocks.
        dst2 = np.array([0, 1, 2, 6, 7, 8, 9, 10, 11])[: n * f]  # clear of src_gpu and dst_gpu
        assert worker.transfer_async(5, (d1, GPULoadStoreSpec(dst2)))
        worker.wait({5})
        results = {r.job_id: r.success for r in worker.get_finished()}
        assert results == {1: True, 2: True, 3: True, 4: True, 5: True}
        assert_same(
            kernel_blocks(gpu, layout, src_gpu), kernel_blocks(host.tensors, layout, expand_block_ids([5, 6, 7], f))
        )
        assert_same(
            kernel_blocks(host.tensors, layout, expand_block_ids([0, 1, 2], f)), kernel_blocks(gpu, layout, dst_gpu)
        )
        assert_same(kernel_blocks(gpu, layout, src_gpu), kernel_blocks(gpu, layout, dst2))
        assert {k for k, t in gpu_h.stats.transfers.items() if t.jobs} == {"gpu_to_disk", "disk_to_gpu"}
        assert gpu_h.stats.transfers["disk_to_gpu"].jobs == 2


def test_gpu_load_honours_skip_count(tmp_path):
    layout = small_layout(True, factor=3)
    gpu = random_tensors(layout, seed=5)
    before = [t.clone() for t in gpu]
    with open_store(tmp_path, layout) as store, GpuDiskHandler(store, 0, gpu, layout) as h:
        d = disk_spec([0, 1], "s")
        assert h.transfer_async(1, (GPULoadStoreSpec(np.arange(0, 6)), d))
        assert finish(h, [1]) == {1: True}
        # Load the two blocks minus the first 2 kernel blocks into kernel blocks 20..23.
        assert h.transfer_async(2, (d, GPULoadStoreSpec(np.arange(20, 24), skip_count=2)))
        assert finish(h, [2]) == {2: True}
        assert_same(kernel_blocks(gpu, layout, [2, 3, 4, 5]), kernel_blocks(gpu, layout, [20, 21, 22, 23]))
        assert_same(kernel_blocks(gpu, layout, [18, 19]), kernel_blocks(before, layout, [18, 19]))
        # A store cannot start mid-block, and lengths must add up: rejected, not raised.
        assert not h.transfer_async(3, (GPULoadStoreSpec(np.arange(4), skip_count=2), d))
        assert not h.transfer_async(4, (d, GPULoadStoreSpec(np.arange(5))))


def test_unsupported_pairs_and_bad_specs_are_rejected(tmp_path):
    layout = small_layout()
    with (
        open_store(tmp_path, layout) as store,
        CpuDiskHandler(store, 0, host_cache(layout, 4, seed=0), layout) as h,
    ):
        assert not h.transfer_async(1, (CPULoadStoreSpec([0]), CPULoadStoreSpec([1])))
        assert not h.transfer_async(2, (CPULoadStoreSpec([0, 1]), disk_spec([3])))
        assert h.get_finished() == []
        with pytest.raises(ValueError, match="bytes"):
            CpuDiskHandler(store, 0, host_cache(small_layout(factor=2), 4, 0), small_layout(factor=2))
        with pytest.raises(ValueError, match="rank 1"):
            CpuDiskHandler(store, 1, host_cache(layout, 4, 0), layout)


@contextlib.contextmanager
def _three_blocks_on_disk(tmp_path):
    """A store holding three blocks (stored from CPU slots 0-2 by job 1), the handler
    that stored them, another one to load them, and their disk spec."""
    layout = small_layout()
    src, dst = host_cache(layout, 4, seed=6), host_cache(layout, 4, seed=7)
    with (
        open_store(tmp_path, layout) as store,
        CpuDiskHandler(store, 0, src, layout) as h,
        CpuDiskHandler(store, 0, dst, layout) as h2,
    ):
        d = disk_spec([0, 1, 2])
        h.transfer_async(1, (CPULoadStoreSpec([0, 1, 2]), d))
        assert finish(h, [1]) == {1: True}
        yield store, h, h2, d


@pytest.mark.faults
def test_corrupt_block_fails_the_load_job(tmp_path):
    with _three_blocks_on_disk(tmp_path) as (store, h, h2, d):
        flip_byte(store.namespace.slab_path(0), 2 * store.slot_size + 17)
        h2.transfer_async(2, (d, CPULoadStoreSpec([0, 1, 2])))
        assert finish(h2, [2]) == {2: False}
        assert store.stats.checksum_failures == 1 and h2.stats.transfers["disk_to_cpu"].failed_jobs == 1
        assert store.entry(d.block_hashes[2]) is None
        h2.transfer_async(3, (DiskLoadStoreSpec([0, 1], d.block_hashes[:2]), CPULoadStoreSpec([0, 1])))
        assert finish(h2, [3]) == {3: True}, "the intact blocks still load"


@pytest.mark.faults
def test_blocks_the_device_fails_to_read_are_dropped_as_corrupt_ones_are(tmp_path, monkeypatch):
    """A read that fails with an I/O error (a bad sector: injected, no device fails on
    demand) fails its job and drops the blocks it was reading, so they are not offered
    again to fail every load that meets them; they can be stored again."""
    with _three_blocks_on_disk(tmp_path) as (store, h, h2, d):

        def bad_sector(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        for name in ("pread", "preadv"):
            monkeypatch.setattr(store.backend, name, bad_sector)
        h2.transfer_async(2, (d, CPULoadStoreSpec([0, 1, 2])))
        assert finish(h2, [2]) == {2: False}
        assert [store.entry(k) for k in d.block_hashes] == [None] * 3
        assert store.stats.checksum_failures == 0
        monkeypatch.undo()
        h.transfer_async(3, (CPULoadStoreSpec([0, 1, 2]), d))
        assert finish(h, [3]) == {3: True}
        h2.transfer_async(4, (d, CPULoadStoreSpec([0, 1, 2])))
        assert finish(h2, [4]) == {4: True}


@pytest.mark.parametrize("iov_max", [None, 5], ids=["one-call-per-run", "iov-max-5"])
@pytest.mark.parametrize("kv_first", [True, False], ids=["kv-first", "kv-after"])
def test_aligned_slots_move_without_a_copy_and_agree_with_the_staged_path(tmp_path, kv_first, iov_max, monkeypatch):
    # Every plane of a slot is 32 KiB: page-aligned pieces, large enough for vectored I/O.
    # With IOV_MAX at 5 a run's calls end mid-block, at any piece.
    if iov_max is not None:
        monkeypatch.setattr(batch_module, "IOV_MAX", iov_max)
    layout = make_layout(kv_first, block_size_factor=2, heads=16 if kv_first else 8, head_dim=128)
    src, dst = host_cache(layout, 8, seed=11), host_cache(layout, 8, seed=12)
    f = layout.block_size_factor
    with (
        open_store(tmp_path, layout) as store,
        CpuDiskHandler(store, 0, src, layout) as direct,
        CpuDiskHandler(store, 0, dst, layout) as staged,
    ):
        staged._views = None  # the pack/unpack path, to cross-check the byte order and checksums
        assert direct._views is not None, "page-aligned CPU-tier slots must take the vectored path"
        written = disk_spec([3, 4, 5, 9, 10, 11], "v")  # two runs of consecutive slots
        assert direct.transfer_async(1, (CPULoadStoreSpec(range(6)), written))
        assert finish(direct, [1]) == {1: True}
        assert staged.transfer_async(2, (written, CPULoadStoreSpec([7, 6, 5, 4, 3, 2])))
        assert finish(staged, [2]) == {2: True}
        assert_same(
            kernel_blocks(src.tensors, layout, expand_block_ids(range(6), f)),
            kernel_blocks(dst.tensors, layout, expand_block_ids([7, 6, 5, 4, 3, 2], f)),
        )
        packed = disk_spec([20, 21], "p")
        assert staged.transfer_async(3, (CPULoadStoreSpec([0, 1]), packed))
        assert finish(staged, [3]) == {3: True}
        assert direct.transfer_async(4, (packed, CPULoadStoreSpec([6, 7])))
        assert finish(direct, [4]) == {4: True}
        assert_same(
            kernel_blocks(dst.tensors, layout, expand_block_ids([0, 1], f)),
            kernel_blocks(src.tensors, layout, expand_block_ids([6, 7], f)),
        )
        # A flipped byte is caught on the vectored path too, and the block is dropped.
        flip_byte(store.namespace.slab_path(0), 10 * store.slot_size + 5000)
        assert direct.transfer_async(
            5, (DiskLoadStoreSpec([9, 10], written.block_hashes[3:5]), CPULoadStoreSpec([0, 1]))
        )
        assert finish(direct, [5]) == {5: False}
        assert store.stats.checksum_failures == 1 and store.entry(written.block_hashes[4]) is None
        assert store.entry(written.block_hashes[3]) is not None


@pytest.mark.faults
def test_vectored_jobs_fail_alone_on_a_full_disk_and_on_read_errors(tmp_path):
    layout = make_layout(True, block_size_factor=2, heads=16, head_dim=128)
    host = host_cache(layout, 8, seed=13)
    with (
        FaultyBackend(write_budget=3 * slot_size_for(layout.bytes_per_block)) as backend,
        open_store(tmp_path, layout, backend) as store,
        CpuDiskHandler(store, 0, host, layout) as h,
    ):
        assert h._views is not None
        fits, too_big = disk_spec([0, 1, 2], "fit"), disk_spec([4, 5, 6], "big")
        assert h.transfer_async(1, (CPULoadStoreSpec([0, 1, 2]), fits))
        assert finish(h, [1]) == {1: True}
        assert h.transfer_async(2, (CPULoadStoreSpec([3, 4, 5]), too_big))
        assert finish(h, [2]) == {2: False}, "ENOSPC fails the job, nothing raises"
        assert store.stats.enospc == 1 and all(store.entry(b) is None for b in too_big.block_hashes)
        backend.fail_read = errno.EIO
        assert h.transfer_async(3, (fits, CPULoadStoreSpec([5, 6, 7])))
        assert finish(h, [3]) == {3: False}
        backend.fail_read = None
        assert all(store.entry(b) is None for b in fits.block_hashes), "blocks a read failed on are dropped"
        reads = store.stats.missing_entries
        assert h.transfer_async(4, (fits, CPULoadStoreSpec([5, 6, 7])))
        assert finish(h, [4]) == {4: False} and store.stats.missing_entries == reads + 3, "not read again"


@pytest.mark.faults
def test_disk_full_fails_the_job_without_raising(tmp_path):
    layout = small_layout()
    with (
        FaultyBackend(write_budget=0) as backend,
        open_store(tmp_path, layout, backend) as store,
        CpuDiskHandler(store, 0, host_cache(layout, 4, seed=0), layout) as h,
    ):
        assert h.transfer_async(1, (CPULoadStoreSpec([0, 1]), disk_spec([0, 1])))
        assert finish(h, [1]) == {1: False}
        assert store.stats.enospc == 1 and h.stats.transfers["cpu_to_disk"].failed_jobs == 1


class SlowBackend(FaultyBackend):
    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def pwritev(self, f, views, offset):
        self.gate.wait(10)
        return super().pwritev(f, views, offset)


def test_transfer_async_never_blocks_and_staging_is_bounded(tmp_path):
    layout = small_layout()
    host = host_cache(layout, 16, seed=8)
    with (
        SlowBackend() as backend,
        open_store(tmp_path, layout, backend) as store,
        CpuDiskHandler(store, 0, host, layout, staging_bytes=2 * store.slot_size, job_threads=2) as h,
    ):
        try:
            t0 = time.perf_counter()
            for j in range(6):  # 6 jobs of 5 blocks each through 2 buffers of 2 rows
                assert h.transfer_async(
                    j, (CPULoadStoreSpec(range(j, j + 5)), disk_spec(range(j * 5, j * 5 + 5), f"j{j}-"))
                )
            assert time.perf_counter() - t0 < 0.5, "transfer_async must only queue"
            assert h.get_finished() == []
            backend.gate.set()
            assert finish(h, range(6)) == {j: True for j in range(6)}
            assert h._staging._made <= 2
        finally:
            backend.gate.set()  # before the handler waits for its jobs


class HeldSyncBackend(FaultyBackend):
    """Holds the first ``fdatasync`` until ``release`` is set; counts writes meanwhile."""

    def __init__(self):
        super().__init__()
        self.holding, self.release = threading.Event(), threading.Event()
        self.writes_while_held = 0

    def pwritev(self, f, views, offset):
        if self.holding.is_set() and not self.release.is_set():
            self.writes_while_held += 1
        return super().pwritev(f, views, offset)

    def sync(self, f):
        if not self.holding.is_set():
            self.holding.set()
            self.release.wait(10)
        return super().sync(f)


def test_a_store_job_thread_moves_on_while_its_commit_waits(tmp_path):
    layout = small_layout()
    host = host_cache(layout, 16, seed=9)
    with (
        HeldSyncBackend() as backend,
        open_store(tmp_path, layout, backend) as store,
        CpuDiskHandler(store, 0, host, layout, job_threads=1) as h,
    ):
        try:
            assert h.transfer_async(0, (CPULoadStoreSpec(range(0, 4)), disk_spec(range(0, 4), "a")))
            assert backend.holding.wait(10), "the first job's commit never synced"
            assert h.transfer_async(1, (CPULoadStoreSpec(range(4, 8)), disk_spec(range(4, 8), "b")))
            deadline = time.monotonic() + 10
            while backend.writes_while_held == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            # The only job thread wrote job 1 while job 0 still waited for its fdatasync.
            assert backend.writes_while_held > 0
            assert h.get_finished() == []
            backend.release.set()
            assert finish(h, [0, 1]) == {0: True, 1: True}
            back = host_cache(layout, 16, seed=10)
            both = DiskLoadStoreSpec(
                range(8), disk_spec(range(0, 4), "a").block_hashes + disk_spec(range(4, 8), "b").block_hashes
            )
            with CpuDiskHandler(store, 0, back, layout) as loader:
                assert loader.transfer_async(2, (both, CPULoadStoreSpec(range(8))))
                assert finish(loader, [2]) == {2: True}
            every = expand_block_ids(range(8), layout.block_size_factor)
            assert_same(kernel_blocks(host.tensors, layout, every), kernel_blocks(back.tensors, layout, every))
        finally:
            backend.release.set()  # before the handler waits for its jobs


@pytest.mark.gpu
@pytest.mark.parametrize("disk_io", ["thread", "process"])
def test_gpu_disk_round_trip_on_cuda(tmp_path, kv_first, disk_io):
    """Real device tensors: GDS where KvikIO has it, else the pinned bounce buffer (always
    with the I/O process, whose bounce buffer is pinned shared memory)."""
    layout = small_layout(kv_first, factor=2)
    gpu = random_tensors(layout, seed=9, device="cuda")
    if disk_io == "process":
        from tiered_kv.disk.worker.io_process import DiskIOProcess

        store = DiskIOProcess.open(
            tmp_path, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, SLOTS), io_backend="auto"
        )
    else:
        store = open_store(tmp_path, layout, backend="auto")
    with store, GpuDiskHandler(store, 0, gpu, layout) as h:
        d = disk_spec([3, 4, 9])
        src = expand_block_ids([1, 5, 7], 2)
        assert h.transfer_async(1, (GPULoadStoreSpec(src), d))
        assert finish(h, [1]) == {1: True}
        dst = expand_block_ids([10, 11, 12], 2)
        assert h.transfer_async(2, (d, GPULoadStoreSpec(dst)))
        assert finish(h, [2]) == {2: True}
        assert_same(kernel_blocks(gpu, layout, src), kernel_blocks(gpu, layout, dst))
