"""The disk store in a helper process (``disk_io: process``): the handlers move the same
bytes as in-process, checksums and the index behave the same, buffers it cannot reach
are refused, and the death of either process fails only what was in flight."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import make_layout, random_tensors
from support.disk_fixtures import block_hash, disk_bytes_for, fingerprint, flip_byte, small_layout
from tiered_kv.disk.format.index_records import LOG_FAILED
from tiered_kv.disk.worker.io_process import DiskIOProcess
from tiered_kv.disk.format.namespace import slot_size_for
from tiered_kv.disk.store.batch import views_fit
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.memory.host_memory import HostKVCache, expand_block_ids
from tiered_kv.mediums import CPULoadStoreSpec, DiskLoadStoreSpec
from tiered_kv.memory.shared_memory import empty_shared, locate
from tiered_kv.disk.worker.handlers import CpuDiskHandler
from tiered_kv.worker.worker import TransferResult

SLOTS = 32


def view_layout():
    """Pieces of 32 KiB (4 GPU blocks of 8 KiB per plane): the handlers move them in place."""
    return make_layout(
        True, num_gpu_blocks=64, block_size_factor=4, num_layers=2, gpu_block_size=4, heads=8, head_dim=128
    )


def open_process(tmp_path, layout, **kwargs):
    return DiskIOProcess.open(
        tmp_path, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, SLOTS), io_backend="posix", **kwargs
    )


def host_cache(layout, slots, seed, shared=True):
    host = HostKVCache(layout, slots, pin=False, shared=shared)
    for t, r in zip(host.tensors, random_tensors(layout, num_blocks=slots * layout.block_size_factor, seed=seed)):
        t.copy_(r)
    return host


@contextlib.contextmanager
def handlers(tmp_path, layout, slots, shared=True, **kwargs):
    """An I/O process, two host caches of ``slots`` (random, different) and a handler on
    each: ``h`` (built with ``kwargs``) stores from ``src``, ``h2`` loads into ``dst``;
    the handlers, then the process, are closed when the block ends."""
    with open_process(tmp_path, layout) as proc:
        src, dst = host_cache(layout, slots, seed=1, shared=shared), host_cache(layout, slots, seed=2, shared=shared)
        with CpuDiskHandler(proc, 0, src, layout, **kwargs) as h, CpuDiskHandler(proc, 0, dst, layout) as h2:
            yield proc, src, dst, h, h2


def slot_bytes(host, layout, slots):
    f = layout.block_size_factor
    ids = torch.as_tensor(expand_block_ids(slots, f))
    return [
        t.index_select(1 if l.kv_before_num_blocks else 0, ids).contiguous().view(torch.uint8)
        for t, l in zip(host.tensors, layout.layers)
    ]


def run(handler, job_id, spec):
    assert handler.transfer_async(job_id, spec)
    handler.wait({job_id})
    return {r.job_id: r.success for r in handler.get_finished()}[job_id]


def disk_spec(slots, prefix="b"):
    return DiskLoadStoreSpec(slots, [block_hash(f"{prefix}{s}") for s in slots])


def test_shared_memory_is_located_and_private_memory_is_not():
    t = empty_shared(1 << 20)
    region, offset = locate(t[4096:].data_ptr(), 4096)
    assert offset == 4096 and region.nbytes == 1 << 20
    assert locate(t.data_ptr() + (1 << 20) - 10, 20) is None, "bytes past the region's end"
    assert locate(torch.empty(4096, dtype=torch.uint8).data_ptr(), 1) is None


def test_a_shared_region_is_forgotten_unmapped_and_closed_with_its_last_view():
    from tiered_kv.memory import shared_memory

    class Listener:
        def freed(self, region_id):
            self.freed_ids.append((region_id, locate(address, 1), mapped(address)))

    def mapped(address):
        with open("/proc/self/maps") as f:
            spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f]
        return any(lo <= address < hi for lo, hi in spans)

    listener = Listener()
    listener.freed_ids = []
    shared_memory.on_free(listener.freed)
    t = empty_shared(3 << 20)
    address = t.data_ptr()
    region = locate(address, 1)[0]
    assert os.fstat(region.fd).st_size == 3 << 20
    piece = t[1 << 20 :]
    del t
    gc.collect()
    assert locate(address, 1) == (region, 0) and not listener.freed_ids, "freed with a view left"
    del piece
    assert listener.freed_ids == [(region.id, None, False)], "told before being forgotten and unmapped"
    with pytest.raises(OSError):
        os.fstat(region.fd)


_FREED_INSIDE_A_LOCKED_SECTION = """
import gc
import weakref
from tiered_kv.memory import shared_memory

class Listener:
    def freed(self, region_id):
        self.region_id = region_id

class CollectingWeakMethod(weakref.WeakMethod):
    # The collector may run at any allocation; here it surely runs at this one, which
    # on_free makes while holding the module's lock.
    def __new__(cls, method, callback=None):
        gc.collect()
        return super().__new__(cls, method, callback)

first, second = Listener(), Listener()
shared_memory.on_free(first.freed)
cycle = [shared_memory.empty_shared(1 << 16)]
cycle.append(cycle)  # freed only by the collector
region = shared_memory.locate(cycle[0].data_ptr(), 1)[0]
del cycle
weakref.WeakMethod = CollectingWeakMethod
shared_memory.on_free(second.freed)
assert shared_memory.locate(region.address, 1) is None
assert first.region_id == region.id
print("ok")
"""


def test_a_region_freed_by_the_collector_inside_the_modules_own_lock_is_forgotten():
    """The collector may free a shared region (run its finalizer) at any allocation,
    also while this thread holds the module's lock: that must neither deadlock nor lose
    the region's bookkeeping. In a child process, so a deadlock fails the test."""
    out = subprocess.run(
        [sys.executable, "-c", _FREED_INSIDE_A_LOCKED_SECTION], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("path", ["vectored", "packed", "staged-private-host"])
def test_cpu_disk_round_trip_through_the_io_process(tmp_path, path):
    """Large pieces move as they lie, small ones are packed by the I/O process, and a CPU
    tier it cannot reach (private memory) goes through the worker's staging buffers."""
    layout = view_layout() if path == "vectored" else small_layout(factor=2)
    shared = path != "staged-private-host"
    staging = 3 * slot_size_for(layout.bytes_per_block)  # several chunks
    with handlers(tmp_path, layout, 8, shared=shared, staging_bytes=staging) as (proc, src, dst, h, h2):
        assert (h._views is not None) == shared
        assert shared is False or views_fit(h._views, proc.slot_size) == (path == "vectored")
        disk = disk_spec([5, 6, 7, 0, 11, 12, 13])
        assert run(h, 1, (CPULoadStoreSpec([0, 1, 2, 3, 4, 5, 6]), disk))
        assert run(h2, 2, (disk, CPULoadStoreSpec([7, 6, 5, 4, 3, 2, 1])))
        for a, b in zip(slot_bytes(src, layout, range(7)), slot_bytes(dst, layout, [7, 6, 5, 4, 3, 2, 1])):
            assert torch.equal(a, b)
        assert proc.stats.stores == 7 and proc.stats.loads == 7
    # What the I/O process committed is what an in-process store reads back, verified.
    with DiskStore.open_readonly(proc.namespace_path) as store:
        packed = store.read_block(0, disk.block_hashes[0])
        assert packed is not None and len(packed) == layout.bytes_per_block


def test_a_flipped_byte_fails_the_load_in_the_io_process(tmp_path):
    layout = small_layout()
    with handlers(tmp_path, layout, 4) as (proc, _, _, h, h2):
        d = disk_spec([0, 1, 2])
        assert run(h, 1, (CPULoadStoreSpec([0, 1, 2]), d))
        flip_byte(_slab(proc), 2 * proc.slot_size + 17)
        assert not run(h2, 2, (d, CPULoadStoreSpec([0, 1, 2])))
        assert proc.stats.checksum_failures == 1
        assert run(h2, 3, (DiskLoadStoreSpec([0, 1], d.block_hashes[:2]), CPULoadStoreSpec([0, 1])))


def _slab(proc) -> Path:
    with DiskStore.open_readonly(proc.namespace_path) as store:
        return store.namespace.slab_path(0)


def test_private_buffers_are_refused_and_fail_only_their_batch(tmp_path):
    layout = small_layout()
    with open_process(tmp_path, layout) as proc:
        hashes = [block_hash(i) for i in range(2)]
        private = torch.zeros(2, proc.slot_size, dtype=torch.uint8)
        batch = proc.begin_write(0, hashes, [0, 1])
        with pytest.raises(ValueError, match="not in shared memory"):
            batch.submit(0, private)
        assert batch.finish() == [False, False]
        rows = proc.host_buffer(2 * proc.slot_size).view(2, proc.slot_size)
        rows.fill_(7)
        assert proc.write_blocks(0, hashes, [0, 1], rows) == [True, True]
        back = proc.host_buffer(2 * proc.slot_size).view(2, proc.slot_size)
        assert proc.read_blocks(0, hashes, [0, 1], back) == [True, True] and torch.equal(back, rows)


def test_an_error_opening_the_store_is_raised_in_the_worker(tmp_path):
    layout = small_layout()
    with pytest.raises(ValueError, match="checksum"):
        open_process(tmp_path, layout, checksum="md5")


def test_a_killed_io_process_fails_its_jobs_and_the_next_job_starts_a_new_one(tmp_path):
    layout = view_layout()
    with handlers(tmp_path, layout, 16) as (proc, src, dst, h, h2):
        first = proc._child
        d = disk_spec(list(range(16)))
        os.kill(first.proc.pid, signal.SIGSTOP)  # job 1 is surely in flight when it dies
        assert h.transfer_async(1, (CPULoadStoreSpec(list(range(16))), d))
        time.sleep(0.2)
        os.kill(first.proc.pid, signal.SIGKILL)
        h.wait({1})  # settles instead of hanging
        assert h.get_finished() == [TransferResult(1, False)]
        deadline = time.monotonic() + 30
        while first.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not first.alive
        # A new process serves the next jobs.
        assert run(h2, 2, (disk_spec([20], "x"), CPULoadStoreSpec([0]))) is False  # never stored
        assert proc.restarts == 1 and proc._child is not first
        assert proc.process_failures >= 1
        assert not run(h2, 3, (d, CPULoadStoreSpec(list(range(16))))), "job 1 never reached the disk"
        # The lost writes are logged failed through the new process, so a manager frees their slots.
        with DiskStore.open_readonly(proc.namespace_path) as store:
            failed = {r.block_hash for r in store.index.read_log(0) if r.status == LOG_FAILED}
        assert set(d.block_hashes) <= failed
        assert run(h, 4, (CPULoadStoreSpec([0, 1]), disk_spec([30, 31], "y")))


def _open_and_die(cache_dir: str) -> None:
    """Run in a child: start an I/O process, print its pid, exit without closing it."""
    layout = small_layout()
    proc = DiskIOProcess.open(
        cache_dir, fingerprint(layout), layout, disk_bytes=disk_bytes_for(layout, 8), io_backend="posix"
    )
    print(proc.pid, flush=True)
    os._exit(0)


def test_the_io_process_exits_when_its_worker_dies(tmp_path):
    here = str(Path(__file__).resolve().parents[1])
    code = (
        f"import sys; sys.path[:0] = {[here, *sys.path]!r}; "
        f"import test_disk_io_process as t; t._open_and_die({str(tmp_path)!r})"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 60
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid), "the I/O process outlived its worker"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_buffers_freed_in_the_worker_are_unmapped_in_the_io_process(tmp_path):
    layout = small_layout()

    def mapped() -> int:
        return sum("memfd:tiered-kv" in line for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines())

    with open_process(tmp_path, layout) as proc:
        hashes = [block_hash(i) for i in range(2)]
        for value in range(6):  # a staging buffer per round, as a stager's come and go
            rows = proc.host_buffer(2 * proc.slot_size).view(2, proc.slot_size)
            rows.fill_(value)
            assert proc.write_blocks(0, hashes, [0, 1], rows) == [True, True]
            del rows
            gc.collect()
        proc.stats  # a round trip: the forgets sent before it have been handled
        assert mapped() <= 2, "regions the worker freed are still mapped in the I/O process"


def test_writes_lost_while_no_io_process_can_start_are_logged_failed_by_the_next(tmp_path, monkeypatch):
    """The I/O process dies and its restart fails once (the fault: a start that raises,
    as a failed spawn would): the writes staged meanwhile fail, and their ``failed``
    records wait for the next process, so the disk tier frees their slots rather than
    keep them pending for good."""
    from tiered_kv.disk.worker import io_process
    from tiered_kv.testing.harness import Hierarchy

    monkeypatch.setattr(io_process, "RESTART_BACKOFF", 0.5)
    with Hierarchy(str(tmp_path / "c"), cpu_blocks=8, disk_blocks=40, disk_io="process") as h:
        proc = h.spec.store
        h.run([[f"warm{i}".encode() for i in range(2)]])
        h.settle()
        start, starts = proc._start, []

        def start_failing_once():
            starts.append(time.monotonic())
            if len(starts) == 1:
                raise RuntimeError("the disk I/O process did not open the store")
            return start()

        monkeypatch.setattr(proc, "_start", start_failing_once)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while proc.pid is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        h.run([[f"lost{i}".encode() for i in range(3)]])  # written through while no process runs
        h.settle()
        time.sleep(0.6)  # past the back-off
        h.run([[f"after{i}".encode() for i in range(2)]])
        while h.manager.pending_writes() and time.monotonic() < deadline:
            h.settle()
            h.disk.refresh()
            time.sleep(0.05)
        assert len(starts) == 2 and h.manager.pending_writes() == 0
