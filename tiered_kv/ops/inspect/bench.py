"""``bench``: the disk tier's store and load GB/s on a cache's device, beside raw O_DIRECT.

Operator's process. Works in a scratch directory created inside the cache directory
(so on the same device) and removed afterwards; the cache's namespaces are not
touched. Each round measures, interleaved because the device drifts:

- raw write / raw read: one preallocated file, O_DIRECT (buffered only where the file
  system refuses O_DIRECT), ``io_bytes`` requests on ``threads`` threads, one
  ``fdatasync`` after the writes;
- tier write / tier read: ``DiskStore.write_blocks`` / ``read_blocks`` of ``block_bytes``
  blocks in jobs of about ``job_bytes``, i.e. the tier's own path: coalesced I/O on the
  backend's pool, checksums, ``fdatasync`` and a synced index commit per job on writes,
  checksum verification on reads.

Between rounds the scratch index is emptied (untimed), so every timed store writes
fresh slots as an engine's stores do.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiered_kv.abstract import Closing
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.store.io_backends import ALIGN, aligned_empty, host_view
from tiered_kv.disk.store.io_backends import MAX_IO_BYTES
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.ops.inspect.cache import InspectError
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout

KINDS = ("raw_write", "tier_write", "raw_read", "tier_read")


@dataclass
class BenchResult:
    """GB/s per round for each of ``KINDS``, and the setup they were measured with.
    ``backend``: the tier's I/O backend as ``backend_fields`` describes it; ``raw_direct``:
    whether the raw baseline (and so the tier's POSIX descriptors, on the same file
    system) got O_DIRECT."""

    path: str
    backend: dict[str, Any]
    raw_direct: bool
    total_bytes: int
    block_bytes: int
    threads: int
    gbps: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})

    @property
    def raw_mode(self) -> str:
        return "O_DIRECT" if self.raw_direct else "buffered (the file system refuses O_DIRECT)"

    def median(self, kind: str) -> float:
        return statistics.median(self.gbps[kind]) if self.gbps[kind] else 0.0

    def ratio(self, op: str) -> float:
        """Tier over raw for ``op`` (``write`` or ``read``), from the medians."""
        raw = self.median(f"raw_{op}")
        return self.median(f"tier_{op}") / raw if raw else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "backend": self.backend,
            "raw": {"o_direct": self.raw_direct},
            "total_bytes": self.total_bytes,
            "block_bytes": self.block_bytes,
            "threads": self.threads,
            "gbps": self.gbps,
            "median_gbps": {k: self.median(k) for k in KINDS},
            "write_ratio": self.ratio("write"),
            "read_ratio": self.ratio("read"),
        }


def backend_fields(backend: Any, o_direct: bool) -> dict[str, Any]:
    """An I/O backend as JSON fields: ``name`` (posix or kvikio), ``threads``, ``gds``
    (device buffers go straight to the disk), ``o_direct`` (host I/O bypasses the page
    cache) and a one-line ``description``."""
    return {
        "name": backend.name,
        "threads": backend.threads,
        "gds": bool(backend.gds),
        "o_direct": bool(o_direct and getattr(backend, "want_direct", True)),
        "description": backend.describe(),
    }


def _bench_layout(block_bytes: int) -> KVCacheLayout:
    return KVCacheLayout((LayerLayout("bench", (1, block_bytes), False),), torch.uint8, 1)


class _RawFile(Closing):
    """A preallocated scratch file read and written in ``MAX_IO_BYTES`` requests, cycling
    through a buffer of ``buffer_bytes`` (as large as a tier job's, so both touch as much
    memory; its contents do not matter to the timing)."""

    def __init__(self, path: Path, size: int, threads: int, buffer_bytes: int):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.pieces = max(1, buffer_bytes // MAX_IO_BYTES)
        self.buf = aligned_empty(self.pieces * MAX_IO_BYTES)
        self.buf.copy_(torch.randint(0, 256, self.buf.shape, dtype=torch.uint8))
        self.direct = True
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        except (OSError, AttributeError):
            self.fd = os.open(path, os.O_RDWR)
            self.direct = False
        self.size = size
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tkv-bench-raw")

    def run(self, write: bool) -> None:
        view = host_view(self.buf)

        def one(i: int) -> None:
            off = i * MAX_IO_BYTES
            lo = (i % self.pieces) * MAX_IO_BYTES
            chunk = view[lo : lo + min(MAX_IO_BYTES, self.size - off)]
            n = os.pwritev(self.fd, [chunk], off) if write else os.preadv(self.fd, [chunk], off)
            if n != len(chunk):
                raise OSError(f"short {'write' if write else 'read'} at offset {off}")

        list(self._pool.map(one, range(-(-self.size // MAX_IO_BYTES))))
        if write:
            os.fdatasync(self.fd)

    def close(self) -> None:
        self._pool.shutdown()
        os.close(self.fd)


def run_bench(
    path: str | os.PathLike,
    *,
    total_bytes: int = 1 << 30,
    block_bytes: int = 2 << 20,
    job_bytes: int = 64 << 20,
    rounds: int = 3,
    threads: int = 4,
    backend: str = "auto",
    progress: Callable[[int], None] | None = None,
) -> BenchResult:
    """Measure ``rounds`` interleaved rounds in a scratch directory under ``path``.
    ``progress(n)`` gets the bytes of each finished piece of work (4 x ``total_bytes``
    per round). Raises ``InspectError`` for a bad path, bad sizes or too little space."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise InspectError(
            f"{root} is not a directory (bench needs the cache directory, or any directory on the device to measure)"
        )
    if block_bytes < ALIGN or block_bytes % ALIGN:
        raise InspectError(f"--block-bytes must be a positive multiple of {ALIGN} bytes, got {block_bytes}")
    if total_bytes < block_bytes:
        raise InspectError(f"--size ({total_bytes} bytes) must hold at least one block ({block_bytes})")
    if rounds < 1 or threads < 1:
        raise InspectError(f"--rounds and --threads must be >= 1, got {rounds} and {threads}")
    n_blocks = total_bytes // block_bytes
    total = n_blocks * block_bytes
    free = shutil.disk_usage(root).free
    if free < 2 * total + (64 << 20):
        raise InspectError(
            f"{root} has {free} bytes free; bench needs twice --size ({2 * total}) plus 64 MiB; use a smaller --size"
        )
    scratch = root / f".tiered-kv-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        scratch.mkdir()
    except OSError as e:
        raise InspectError(f"cannot create a scratch directory in {root}: {e.strerror}") from None
    store = raw = None
    try:
        layout = _bench_layout(block_bytes)
        fp = Fingerprint.from_layout(layout, model_id="tiered-kv-bench")
        store = DiskStore.open(
            scratch, fp, layout, disk_bytes=total, io_backend=backend, io_threads=threads, engine_id="tiered-kv-bench"
        )
        store.namespace.allocate_slab(0)
        per_job = max(1, min(n_blocks, job_bytes // store.slot_size))
        raw = _RawFile(scratch / "raw.bin", total, threads, per_job * store.slot_size)
        data = aligned_empty(per_job * store.slot_size).view(per_job, store.slot_size)
        data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8))
        back = aligned_empty(per_job * store.slot_size).view(per_job, store.slot_size)
        result = BenchResult(
            str(root), backend_fields(store.backend, raw.direct), raw.direct, total, block_bytes, threads
        )

        def timed(kind: str, fn: Callable[[], None]) -> None:
            t0 = time.perf_counter()
            fn()
            result.gbps[kind].append(total / (time.perf_counter() - t0) / 1e9)

        def tier(write: bool, tag: str) -> Callable[[], None]:
            def go() -> None:
                for first in range(0, n_blocks, per_job):
                    n = min(per_job, n_blocks - first)
                    hashes = [f"{tag}:{first + i}".encode() for i in range(n)]
                    slots = list(range(first, first + n))
                    ok = (
                        store.write_blocks(0, hashes, slots, data[:n])
                        if write
                        else store.read_blocks(0, hashes, slots, back[:n])
                    )
                    if not all(ok):
                        raise InspectError(
                            f"the tier's {'write' if write else 'read'} failed on "
                            f"{ok.count(False)} of {n} blocks (see the log)"
                        )
                    if progress is not None:
                        progress(n * block_bytes)

            return go

        def raw_pass(write: bool) -> Callable[[], None]:
            def go() -> None:
                raw.run(write)
                if progress is not None:
                    progress(total)

            return go

        for r in range(rounds):
            timed("raw_write", raw_pass(True))
            timed("tier_write", tier(True, f"round{r}"))
            timed("raw_read", raw_pass(False))
            timed("tier_read", tier(False, f"round{r}"))
            store.index.apply_batch([(f"round{r}:{i}".encode(), i) for i in range(n_blocks)], {}, 0)
        return result
    finally:
        if raw is not None:
            raw.close()
        if store is not None:
            store.close()
        shutil.rmtree(scratch, ignore_errors=True)
