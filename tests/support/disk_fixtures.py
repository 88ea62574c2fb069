"""Shared helpers for the disk-tier tests: layouts, fingerprints, deterministic block
content, a bulk index filler, fault-injecting backends and stores, and the crash-test child."""

from __future__ import annotations

import errno
import hashlib
import os
import time
from pathlib import Path

import numpy as np
import torch

from conftest import make_layout
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.format.index import DiskIndex
from tiered_kv.disk.format.index_records import entry_dtype
from tiered_kv.disk.store.io_backends import PosixBackend, aligned_empty
from tiered_kv.disk.format.namespace import slot_size_for
from tiered_kv.kv_layout import KVCacheLayout


def small_layout(
    kv_first: bool = True, factor: int = 1, num_gpu_blocks: int = 32, head_dim: int = 8, num_layers: int = 3
) -> KVCacheLayout:
    return make_layout(
        kv_first, num_gpu_blocks=num_gpu_blocks, block_size_factor=factor, head_dim=head_dim, num_layers=num_layers
    )


def fingerprint(layout: KVCacheLayout, tp_size: int = 1, **overrides) -> Fingerprint:
    fields = dict(model_id="test/model", model_revision="r1", tp_size=tp_size, hash_algorithm="sha256", hash_seed="0")
    fields.update(overrides)
    return Fingerprint.from_layout(layout, **fields)


def block_hash(i: int | str) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def disk_bytes_for(layout: KVCacheLayout, blocks: int) -> int:
    return blocks * slot_size_for(layout.bytes_per_block)


def block_content(h: bytes, rank: int, nbytes: int) -> bytes:
    """Deterministic bytes of block ``h`` on ``rank``."""
    seed = int.from_bytes(hashlib.sha256(h + bytes([rank])).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def content_rows(hashes, rank: int, layout: KVCacheLayout, slot_size: int) -> torch.Tensor:
    """An aligned ``(N, slot_size)`` buffer holding each block's deterministic bytes."""
    rows = aligned_empty(len(hashes) * slot_size).view(len(hashes), slot_size)
    rows.zero_()
    for i, h in enumerate(hashes):
        rows[i, : layout.bytes_per_block] = torch.frombuffer(
            bytearray(block_content(h, rank, layout.bytes_per_block)), dtype=torch.uint8
        )
    return rows


def fill_index(index: DiskIndex, n: int, block_bytes: int, tp_size: int = 1, seed: int = 0) -> list[bytes]:
    """Write ``n`` complete entries (random 32-byte hashes, slots 0..n-1) in one
    transaction, fast; returns their hashes in key order."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 256, size=(n, 32), dtype=np.uint8).view("V32").ravel())
    keys = keys.view(np.uint8).reshape(-1, 32)
    m = len(keys)
    arr = np.zeros(m, dtype=entry_dtype(tp_size, 32))
    arr["slot"] = rng.permutation(m)
    arr["size"] = block_bytes
    arr["store_time"] = time.time()
    arr["last_access"] = rng.random(m)
    arr["ranks"] = (1 << tp_size) - 1
    arr["hash"] = keys.view("S32").ravel()
    blob, kb, sz = arr.tobytes(), keys.tobytes(), arr.dtype.itemsize
    hashes = [kb[i * 32 : (i + 1) * 32] for i in range(m)]
    items = [(hashes[i], blob[i * sz : (i + 1) * sz]) for i in range(m)]
    index._shared.run(lambda txn: txn.cursor(db=index._db("blocks")).putmulti(items, append=True), write=True)
    return hashes


class FaultyBackend(PosixBackend):
    """A POSIX backend whose slab behaves as if capped at ``capacity_bytes`` of writes
    (then ENOSPC), or that fails every write/read/sync with ``errno`` once armed."""

    def __init__(self, threads: int = 2, write_budget: int | None = None):
        super().__init__(threads)
        self.write_budget = write_budget
        self.fail_sync: int | None = None
        self.fail_read: int | None = None
        self._used = 0

    # Every read and write, from rows or from views, ends in preadv/pwritev.
    def pwritev(self, f, views, offset):
        if self.write_budget is not None:
            self._used += sum(len(v) for v in views)
            if self._used > self.write_budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(f, views, offset)

    def preadv(self, f, views, offset):
        if self.fail_read is not None:
            raise OSError(self.fail_read, os.strerror(self.fail_read))
        return super().preadv(f, views, offset)

    def sync(self, f):
        if self.fail_sync is not None:
            raise OSError(self.fail_sync, os.strerror(self.fail_sync))
        return super().sync(f)


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of a file in place (through the page cache, then synced)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- crash-test child

CRASH_TP = 2
CRASH_SLOTS = 24
CRASH_UNIVERSE = 64


def crash_layout() -> KVCacheLayout:
    # 4 layers x (2, 16 tokens, 8 heads, 128 dims) fp16 = 256 KiB per block: writes take long
    # enough for kills to land mid-I/O.
    return make_layout(True, num_gpu_blocks=8, gpu_block_size=16, heads=8, head_dim=128, num_layers=4)


def crash_workload(cache_dir: str, journal: str, seed: int) -> None:
    """Store, evict, touch and load blocks forever (until SIGKILLed), journaling to
    ``journal``: ``R`` ready, ``B`` before each prepare_store, ``E <hex>`` evicted and
    ``P`` after it, ``S <hex>`` stored (after complete_store). Every block's bytes are
    ``block_content(hash, rank)``."""
    import random

    from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
    from tiered_kv.disk.store.store import DiskStore
    from tiered_kv.memory.host_memory import HostKVCache, unpack_blocks
    from tiered_kv.mediums import CPULoadStoreSpec
    from tiered_kv.disk.worker.handlers import CpuDiskHandler

    torch.set_num_threads(1)
    layout = crash_layout()
    fp = fingerprint(layout, tp_size=CRASH_TP)
    nbytes = disk_bytes_for(layout, CRASH_SLOTS)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    mgr = DiskOffloadingManager(cache_dir, fp, layout, disk_bytes=nbytes, engine_id="crash", flush_interval=0.001)
    store = DiskStore.open(
        cache_dir, fp, layout, disk_bytes=nbytes, io_backend="posix", io_threads=2, engine_id="crash"
    )
    hosts = [HostKVCache(layout, 8, pin=False) for _ in range(CRASH_TP)]
    handlers = [
        CpuDiskHandler(store, r, hosts[r], layout, staging_bytes=4 * store.slot_size, job_threads=1)
        for r in range(CRASH_TP)
    ]
    rng = random.Random(seed)
    universe = [block_hash(f"crash-{i}") for i in range(CRASH_UNIVERSE)]
    # Precomputed so the loop's time goes to I/O and index commits, where kills should land.
    content = {
        r: dict(zip(universe, content_rows(universe, r, layout, layout.bytes_per_block))) for r in range(CRASH_TP)
    }
    note("R")
    job = 0
    while True:
        hashes = rng.sample(universe, rng.randint(1, 6))
        note("B")
        out = mgr.prepare_store(hashes)
        for h in out.block_hashes_evicted if out is not None else ():
            note("E " + h.hex())
        note("P")
        if out is None:
            continue
        todo = out.block_hashes_to_store
        if todo:
            for r in range(CRASH_TP):
                rows = torch.stack([content[r][h] for h in todo])
                unpack_blocks(rows, hosts[r].tensors, layout, hosts[r].kernel_ids(range(len(todo))))
            job += 1
            for r in range(CRASH_TP):
                handlers[r].transfer_async(job * 10 + r, (CPULoadStoreSpec(range(len(todo))), out.store_spec))
            ok = True
            for r in range(CRASH_TP):
                handlers[r].wait({job * 10 + r})
                ok &= all(res.success for res in handlers[r].get_finished())
            mgr.complete_store(todo, success=ok)
            if ok:
                for h in todo:
                    note("S " + h.hex())
        if rng.random() < 0.3:
            mgr.touch(rng.sample(universe, 3))
        mgr.take_events()


def forkserver_context():
    """A fork-server context that has imported torch and the disk tier once, so each crash
    trial forks a ready child quickly."""
    import multiprocessing

    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(
        [
            "torch",
            "disk_fixtures",
            "tiered_kv.disk.scheduler.manager",
            "tiered_kv.disk.store.store",
            "tiered_kv.disk.worker.handlers",
        ]
    )
    return c


class SlowReads:
    """A disk store seen by a disk handler, with ``delay`` seconds before each read batch:
    a disk that got slower (the handler measures the delay as part of its job). Injects
    a slowdown the real disk cannot produce on demand."""

    def __init__(self, store):
        self._store = store
        self.delay = 0.0

    def begin_read(self, *args, **kwargs):
        if self.delay:
            time.sleep(self.delay)
        return self._store.begin_read(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._store, name)


def slow_disk_reads(handlers) -> list[SlowReads]:
    """Wrap the disk store of every lower-tier handler of composite load ``handlers``."""
    slow = []
    for handler in handlers:
        for inner in (*getattr(handler, "to_gpu", ()), *getattr(handler, "to_cpu", ())):
            if inner is not None:
                inner.store = SlowReads(inner.store)
                slow.append(inner.store)
    return slow
