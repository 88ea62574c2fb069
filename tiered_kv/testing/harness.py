"""The fault-injection harness's core, shared by the fault suite (``tests/faults``) and
``tools/fault_report.py``.

Runs in the calling (test or tool) process; its I/O is the cache directory it is
given: the hierarchy's own reads and writes, the damage functions' writes into slab
and index files, read-only verification. Builds the whole hierarchy (``HierarchySpec``
+ ``EngineDriver``, CPU tensors standing in for the GPU) on small layouts, verifies a
cache directory block by block, and runs kill -9 trials of ``storm_child`` (forked from
a fork server that has torch imported, so a trial costs milliseconds, not an import).

Every offloaded block's bytes are ``tiered_kv.sim.driver.block_content(hash)``, so a block
read back from any tier can be checked against what it must be.
"""

from __future__ import annotations

import errno
import importlib.util
import multiprocessing
import os
import random
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tiered_kv.abstract import Closing
from tiered_kv.disk.format.index import IndexSnapshot
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.store.io_backends import PosixBackend
from tiered_kv.disk.format.namespace import MANIFEST
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.sim.driver import DeviceKVCache, EngineDriver, block_content
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.sim.workloads import prefix_hashes

GPU_BLOCK_SIZE = 16


# ---------------------------------------------------------------- the hierarchy


def device(num_gpu_blocks: int = 8, dtype: torch.dtype = torch.float16) -> DeviceKVCache:
    """A small "GPU" KV cache on CPU tensors: 2 layers, 16 KiB per block (at 2 bytes)."""
    return DeviceKVCache(
        num_layers=2,
        num_gpu_blocks=num_gpu_blocks,
        gpu_block_size=GPU_BLOCK_SIZE,
        num_kv_heads=4,
        head_dim=32,
        dtype=dtype,
        device="cpu",
    )


def config(
    cache_dir: str | os.PathLike, bytes_per_block: int, cpu_blocks: int = 8, disk_blocks: int = 40, **extra
) -> dict:
    """A config dict for the hierarchy sized in blocks (``extra`` keys override)."""
    out = {
        "cpu_bytes": f"{cpu_blocks * bytes_per_block}B",
        "disk_path": str(cache_dir),
        "disk_bytes": f"{disk_blocks * bytes_per_block}B",
        "io_backend": "posix",
        "io_threads": 2,
        "model_id": "fault-suite",
        "cover_weights": False,  # synthetic KV: no weights
        "max_pending_disk_writes": 16,
        # Every block found is loaded: the fault suite checks what is served, and this
        # machine's measured loads would otherwise decide which blocks are asked for.
        "cost_aware": False,
    }
    out.update(extra)
    return out


class Hierarchy(Closing):
    """One engine's hierarchy in this process: ``spec`` and ``driver`` (manager + worker).
    ``extra`` are config keys; ``tp_size`` > 1 makes this process rank 0 of a TP group,
    or, with ``all_ranks``, every rank of it (``ranks.RanksDriver``; ``spec`` is rank 0's).
    A context manager: ``with Hierarchy(...) as h:`` closes it."""

    def __init__(
        self,
        cache_dir,
        cpu_blocks: int = 8,
        disk_blocks: int = 40,
        engine_id: str | None = None,
        dtype: torch.dtype = torch.float16,
        tp_size: int = 1,
        all_ranks: bool = False,
        **extra,
    ):
        self.device = device(dtype=dtype)
        layout = self.device.layout
        cfg = config(cache_dir, layout.bytes_per_block, cpu_blocks, disk_blocks, **extra)
        self.spec = HierarchySpec(cfg, GPU_BLOCK_SIZE, layout, engine_id=engine_id, tp_size=tp_size)
        self.specs = [self.spec]
        if all_ranks and tp_size > 1:
            from tiered_kv.testing.ranks import RanksDriver, RankWorkers

            devices = [self.device] + [device(dtype=dtype) for _ in range(1, tp_size)]
            self.specs += [
                HierarchySpec(cfg, GPU_BLOCK_SIZE, layout, engine_id=self.spec.engine_id, rank=r, tp_size=tp_size)
                for r in range(1, tp_size)
            ]
            workers = [s.build_worker(d.kv_caches, d.kv_before_num_blocks) for s, d in zip(self.specs, devices)]
            self.driver: EngineDriver = RanksDriver(self.spec.get_manager(), RankWorkers(workers), devices)
        else:
            self.driver = EngineDriver.from_spec(self.spec, self.device)
        self.closed = False

    @property
    def manager(self) -> TieredOffloadingManager:
        manager = self.driver.manager
        assert isinstance(manager, TieredOffloadingManager)  # what HierarchySpec builds
        return manager

    @property
    def disk(self) -> DiskOffloadingManager:
        disk = self.manager.tier("disk")
        assert isinstance(disk, DiskOffloadingManager)  # the hierarchy built here has a disk tier
        return disk

    @property
    def stager(self):
        """The disk tier's stager in this worker."""
        return self.spec.lower_tiers[0].stager

    def run(self, requests):
        return self.driver.run(requests)

    def settle(self) -> int:
        """Finish jobs and let queued disk writes land; returns blocks still pending on disk."""
        self.driver.drain()
        for tier in self.spec.lower_tiers:
            tier.stager.drain()
        return self.manager.pending_writes()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.driver.worker.shutdown()
        self.driver.manager.shutdown()
        for spec in self.specs:
            if spec.store is not None:
                spec.store.close()


class InjectingBackend(PosixBackend):
    """POSIX I/O that fails on demand: set ``fail_write`` / ``fail_read`` / ``fail_sync``
    to an errno (e.g. ``errno.ENOSPC``, ``errno.EIO``) and every such call raises it, or
    ``None`` to let calls through. ``injected`` counts the faults raised, by call."""

    def __init__(self, threads: int = 2):
        super().__init__(threads)
        self.fail_write: int | None = None
        self.fail_read: int | None = None
        self.fail_sync: int | None = None
        self.injected = {"write": 0, "read": 0, "sync": 0}
        self._lock = threading.Lock()

    def _maybe_fail(self, call: str, err: int | None) -> None:
        if err is not None:
            with self._lock:
                self.injected[call] += 1
            raise OSError(err, os.strerror(err))

    # Every read and write, from rows or from views, ends in preadv/pwritev.
    def pwritev(self, f, views, offset):
        self._maybe_fail("write", self.fail_write)
        return super().pwritev(f, views, offset)

    def preadv(self, f, views, offset):
        self._maybe_fail("read", self.fail_read)
        return super().preadv(f, views, offset)

    def sync(self, f):
        self._maybe_fail("sync", self.fail_sync)
        return super().sync(f)


def inject_backend(h: "Hierarchy", backend: InjectingBackend) -> None:
    """Put ``backend`` under the worker's disk store (before its first block I/O: slab
    files are opened lazily, through whichever backend the store has then)."""
    store = h.spec.store
    assert not store._files, "inject the backend before the store opened any slab"
    original, store.backend = store.backend, backend
    original.shutdown()


class TmpfsMount:
    """A small tmpfs mounted for one test (root only): a real filesystem that fills up.
    ``mount()`` returns False where mounting is not allowed."""

    def __init__(self, path: Path, size_bytes: int):
        self.path, self.size = Path(path), size_bytes
        self.mounted = False

    def mount(self) -> bool:
        self.path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", str(self.path)], capture_output=True
        )
        self.mounted = r.returncode == 0
        return self.mounted

    def fill(self, leave: int = 0) -> Path:
        """Write a filler file until at most ``leave`` bytes are free; returns it."""
        filler = self.path / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for chunk in (b"\0" * (64 << 10), b"\0" * 4096):
                while True:
                    st = os.statvfs(self.path)
                    if st.f_bavail * st.f_frsize < leave + len(chunk):
                        break
                    try:
                        os.write(fd, chunk)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        return filler

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)
            self.mounted = False


def open_engine_elsewhere(cache_dir, timeout: float = 60.0) -> str:
    """Start an engine on ``cache_dir`` in another process and close it again; returns
    ``"ok"`` or ``"<ExceptionType>: <message>"`` (what that engine's startup raised)."""
    ctx = fork_context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_open_and_report, args=(str(cache_dir), child))
    proc.start()
    child.close()
    if not parent.poll(timeout):
        proc.kill()
        raise AssertionError("the other engine neither started nor failed")
    out = parent.recv()
    proc.join(timeout)
    return out


def _open_and_report(cache_dir: str, conn) -> None:
    try:
        Hierarchy(cache_dir, engine_id=f"elsewhere-{os.getpid()}").close()
        conn.send("ok")
    except Exception as e:
        conn.send(f"{type(e).__name__}: {e}")


def documents(num_docs: int, blocks_per_doc: int, seed: int = 0) -> list[list[bytes]]:
    """Independent prefix chains (each one request)."""
    rng = np.random.default_rng(seed)
    return [prefix_hashes(rng.integers(0, 50_000, size=(blocks_per_doc, GPU_BLOCK_SIZE))) for _ in range(num_docs)]


def expected_bytes(block_hash: bytes, nbytes: int) -> bytes:
    return block_content([block_hash], nbytes)[0].numpy().tobytes()


def namespace_dirs(cache_dir: str | os.PathLike) -> list[Path]:
    root = Path(cache_dir)
    return sorted(p.parent for p in root.glob(f"*/{MANIFEST}")) if root.is_dir() else []


# ---------------------------------------------------------------- damage


def geometry(cache_dir) -> tuple[int, int]:
    """(slot size, block bytes) of the cache's (first) namespace."""
    store = DiskStore.open_readonly(namespace_dirs(cache_dir)[0])
    store.close()
    return store.slot_size, store.block_bytes


def slots_of(cache_dir) -> dict[bytes, int]:
    """block hash -> slot of every entry of the cache's (first) namespace."""
    store = DiskStore.open_readonly(namespace_dirs(cache_dir)[0])
    try:
        entries = {h: store.entry(h) for h, _ in snapshot_hashes(store.snapshot())}
        return {h: e.slot for h, e in entries.items() if e is not None}
    finally:
        store.close()


def flip_slab_bits(cache_dir, rng: random.Random, blocks: int = 6) -> set[bytes]:
    """Invert one random bit inside each of ``blocks`` random stored blocks."""
    where = slots_of(cache_dir)
    slot_size, block_bytes = geometry(cache_dir)
    victims = set(rng.sample(sorted(where), min(blocks, len(where))))
    with open(namespace_dirs(cache_dir)[0] / "rank0.slab", "r+b") as f:
        for h in sorted(victims):
            off = where[h] * slot_size + rng.randrange(block_bytes)
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
        os.fsync(f.fileno())
    return victims


def truncate_slab(cache_dir, rng: random.Random, keep_slots: int | None = None) -> set[bytes]:
    """Cut rank 0's slab after ``keep_slots`` slots (random when None)."""
    where = slots_of(cache_dir)
    slot_size, _ = geometry(cache_dir)
    if keep_slots is None:
        keep_slots = rng.randrange(max(where.values()) + 1)
    os.truncate(namespace_dirs(cache_dir)[0] / "rank0.slab", keep_slots * slot_size)
    return {h for h, s in where.items() if s >= keep_slots}


def delete_slab(cache_dir, rng: random.Random) -> set[bytes]:
    where = slots_of(cache_dir)
    (namespace_dirs(cache_dir)[0] / "rank0.slab").unlink()
    return set(where)


def _index_data(cache_dir) -> Path:
    return namespace_dirs(cache_dir)[0] / "index.lmdb" / "data.mdb"


def garbage_index(cache_dir, rng: random.Random) -> set[bytes]:
    """Overwrite the whole index file with random bytes."""
    where = slots_of(cache_dir)
    path = _index_data(cache_dir)
    path.write_bytes(rng.randbytes(path.stat().st_size))
    return set(where)


def garbage_index_pages(cache_dir, rng: random.Random) -> set[bytes]:
    """Keep the two meta pages (LMDB opens the file) and fill the tree with junk."""
    where = slots_of(cache_dir)
    path = _index_data(cache_dir)
    with open(path, "r+b") as f:
        f.seek(2 * 4096)
        f.write(rng.randbytes(path.stat().st_size - 2 * 4096))
    return set(where)


def truncate_index(cache_dir, rng: random.Random) -> set[bytes]:
    """Cut the index file at a random page boundary short of its end (never to zero)."""
    where = slots_of(cache_dir)
    path = _index_data(cache_dir)
    pages = path.stat().st_size // 4096
    os.truncate(path, 4096 * rng.randrange(1, pages))
    return set(where)


#: Damage to a closed cache: name -> function(cache_dir, rng) -> blocks it destroyed.
DAMAGE = {
    "slab bit flips": flip_slab_bits,
    "truncated slab": truncate_slab,
    "deleted slab": delete_slab,
    "garbage index": garbage_index,
    "garbage index pages": garbage_index_pages,
    "truncated index": truncate_index,
}


# ---------------------------------------------------------------- verification


@dataclass
class CacheCheck:
    """What a block-by-block check of a cache directory found. ``corrupt``: complete
    entries whose bytes fail their checksum (or cannot be read); ``wrong``: entries
    whose bytes pass the checksum but are not the block's bytes (a stale or
    misdirected block: the worst case); ``incomplete``: entries missing a rank."""

    namespaces: int = 0
    entries: int = 0
    verified: int = 0
    incomplete: int = 0
    corrupt: list[bytes] = field(default_factory=list)
    wrong: list[bytes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.wrong or self.errors)


def snapshot_hashes(snap: IndexSnapshot) -> list[tuple[bytes, int]]:
    """``(hash, ranks bitmask)`` of every entry of a snapshot."""
    out = [(snap.hash_at(i), int(snap.entries["ranks"][i])) for i in range(len(snap.entries))]
    out += [(h, e.ranks) for h, e in snap.odd]
    return out


def verify_cache(cache_dir: str | os.PathLike, check_content: bool = True) -> CacheCheck:
    """Read every complete block of every namespace read-only (no lock, nothing
    written) and check it against its checksum and, with ``check_content``, against
    ``block_content``. An index that cannot be opened is an error, not an exception."""
    res = CacheCheck()
    for ns_dir in namespace_dirs(cache_dir):
        res.namespaces += 1
        try:
            store = DiskStore.open_readonly(ns_dir)
        except Exception as e:  # the point is to report, whatever is wrong
            res.errors.append(f"{ns_dir.name}: {type(e).__name__}: {e}")
            continue
        try:
            full = (1 << store.tp_size) - 1
            for h, ranks in snapshot_hashes(store.snapshot()):
                res.entries += 1
                if ranks & full != full:
                    res.incomplete += 1
                    continue
                want = expected_bytes(h, store.block_bytes) if check_content else None
                for rank in range(store.tp_size):
                    data = store.read_block(rank, h)
                    if data is None:
                        res.corrupt.append(h)
                        break
                    if want is not None and data != want:
                        res.wrong.append(h)
                        break
                else:
                    res.verified += 1
        except Exception as e:
            res.errors.append(f"{ns_dir.name}: {type(e).__name__}: {e}")
        finally:
            store.close()
    return res


def inspect_cli_available() -> bool:
    return importlib.util.find_spec("tiered_kv.cli.inspect") is not None


def inspect_verify(cache_dir: str | os.PathLike) -> tuple[int, str] | None:
    """``tiered-kv inspect verify CACHE_DIR`` in process: (exit code, output), or None
    while the inspector has no ``verify`` command."""
    if not inspect_cli_available():
        return None
    from typer.testing import CliRunner

    from tiered_kv.cli import _load_commands, app

    _load_commands()
    result = CliRunner().invoke(app, ["inspect", "verify", str(cache_dir)])
    if result.exit_code == 2 and "No such command" in result.output:
        return None
    return result.exit_code, result.output


# ---------------------------------------------------------------- processes


_CTX = None


def fork_context():
    """A fork server with torch and the hierarchy imported once; each child forks from it."""
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(
            [
                "torch",
                "tiered_kv.tiered.spec",
                "tiered_kv.sim.driver",
                "tiered_kv.disk.scheduler.manager",
                "tiered_kv.testing.storm_child",
            ]
        )
    return _CTX
