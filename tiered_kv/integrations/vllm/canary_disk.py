"""The start-up canary's round trips through each disk tier (``canary.py`` runs them after
the CPU tier's). Worker process, once per rank, inside ``TieredVllmWorker``'s
constructor, before the first request.

A block reaches a disk tier one way and leaves it two ways, each through code of the
tier's own that orders its bytes: it is written from its CPU slot (``DiskStager`` packs
the slot into a staging buffer, ``pack_blocks``, which the store writes), and read either
straight into GPU blocks (``GpuDiskHandler``: into its staging buffer, device memory
under GPUDirect Storage, then unpacked into the KV tensors; the composite sends a block
there when no CPU slot takes it, e.g. ``promote_on_hit: false``) or into a CPU slot
(``CpuDiskHandler``: the store reads into the slot where it lies or into a pack buffer
that ``SlotViews`` unpacks), then to the GPU through the CPU tier's load handler. The
checksum is taken of what was written, so a page-order bug in any of them would be
served byte-exact and wrong. For each disk tier, the canary takes the chunk that the
CPU round trip left in CPU slot 0 through both:

1. it makes a scratch directory (``0700``, ``.tiered-kv-canary-<random>``) inside the
   tier's directory, so on the tier's filesystem, and has the tier's own class build
   its worker side there (``DiskTier.get_worker``) with the tier's settings but one
   disk slot: the same stager, handlers, store (run in a disk I/O process with
   ``disk_io: process``), I/O backend (O_DIRECT; KvikIO and GDS where the tier gets
   them) and checksum as every block of the tier;
2. writes CPU slot 0 to disk slot 0 through that stager and waits for its index commit;
3. reads it through the ``GpuDiskHandler`` into the canary's GPU blocks, zeroed
   first, which the caller checks; then through the ``CpuDiskHandler`` into CPU slot 0,
   zeroed first, and on to the GPU blocks, zeroed again, through the worker's own load
   handler, and the caller checks them again;
4. shuts that worker side down, closes its store and removes the scratch directory,
   whatever happened.

The scheduler's namespace is not opened here: its slots, index and eviction belong to
its manager, and a block a worker committed there would become loadable. The scratch
namespace has its own index and lock, and nothing else knows of it. Nothing is written
from the GPU to disk: the worker never does that (a store lands in a CPU slot, which
the stager writes), so ``GpuDiskHandler``'s packing for writes is on no block's path.

I/O: one directory, a namespace in it (manifest, lock, an index, one slot's slab), one
chunk written (``fdatasync``, index commits) and read twice; with ``disk_io: process``
a disk I/O process is started for it and stopped. Faults: a tier whose scratch store
cannot be opened, or whose write or reads fail (a read-only or full filesystem, an I/O
error), is skipped with a warning saying why; the engine starts, and the tier reports
its own I/O problems where it serves. Only values in the wrong place stop the engine
(the caller's ``CanaryError``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from tiered_kv.disk.format.manifest import slot_size_for
from tiered_kv.disk.tier import DiskTier
from tiered_kv.memory.host_memory import HostKVCache
from tiered_kv.mediums import CPULoadStoreSpec, GPURowsSpec, TierSlotsSpec, TierWrites
from tiered_kv.metrics import TieredStats
from tiered_kv.tiers import TierSpec
from tiered_kv.worker.worker import LowerTierWorker, OffloadingHandler, Stager, TransferSpec

logger = logging.getLogger(__name__)

#: The scratch directories' prefix: hidden, so tools listing the tier's namespaces pass them by.
SCRATCH_PREFIX = ".tiered-kv-canary-"
#: The canary chunk's key in the scratch namespace (no engine's key has this origin).
CANARY_HASH = hashlib.sha256(b"tiered-kv start-up canary").digest()
#: Job ids of the canary's disk transfers: negative, never one of vLLM's (nor the CPU round trip's).
_TO_GPU_JOB, _TO_CPU_JOB, _CPU_TO_GPU_JOB = -103, -104, -105
_JOB_SECONDS = 60.0


class DiskCanaryWorker(Protocol):
    """What the disk round trips use of ``worker.TieredVllmWorker``: its rank, its CPU
    tier and its load handler."""

    @property
    def rank(self) -> int: ...
    @property
    def host(self) -> HostKVCache: ...
    @property
    def load_handler(self) -> OffloadingHandler: ...


class _Skip(Exception):
    """A disk tier the canary could not exercise (an I/O problem, never a wrong value)."""


def check_disk_tiers(
    worker: DiskCanaryWorker,
    lower_tiers: Sequence[TierSpec],
    gpu: Sequence[torch.Tensor],
    rows: np.ndarray,
    check: Callable[[str], None],
    skipped: list[str],
) -> list[str]:
    """Take the chunk in CPU slot 0 through each disk tier among ``lower_tiers`` (module
    docstring) into GPU blocks ``rows`` (a ``(1, blocks_per_chunk)`` row of GPU block
    ids) of the engine's ``gpu`` tensors; ``check(what)`` compares those blocks with the
    pattern and raises, ``what`` naming the tier and the path. Returns what was checked
    (one line per tier); a tier that could not be exercised is logged, left out, and named
    in ``skipped`` (which the caller passes in to be filled)."""
    checked = []
    for tier in lower_tiers:
        if not isinstance(tier, DiskTier):
            continue
        try:
            backend = _round_trips(worker, tier, gpu, rows, check)
        except _Skip as e:
            logger.warning(
                "rank %d: start-up canary: the %s tier was not checked: %s. The engine starts; the tier's "
                "blocks are still verified against their checksums on every read, and its I/O problems "
                "are reported where it serves",
                worker.rank,
                tier.name,
                e,
            )
            skipped.append(tier.name)
            continue
        checked.append(
            f"{tier.name}: cpu -> {tier.name} -> GPU, and -> cpu -> GPU, through the tier's own stager, "
            f"handlers and I/O backend, {backend}, in a scratch store"
        )
    return checked


def _round_trips(
    worker: DiskCanaryWorker,
    tier: DiskTier,
    gpu: Sequence[torch.Tensor],
    rows: np.ndarray,
    check: Callable[[str], None],
) -> str:
    """Both round trips through ``tier`` in a scratch directory of its own directory,
    removed afterwards; returns the I/O backend's description."""
    try:
        scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=tier.settings.path))
    except OSError as e:
        raise _Skip(f"cannot make a scratch directory in {tier.settings.path}: {e.strerror or e}") from e
    try:
        return _through(worker, tier, scratch, gpu, rows, check)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if scratch.exists():
            logger.warning("rank %d: start-up canary: could not remove its scratch directory %s", worker.rank, scratch)


def _through(
    worker: DiskCanaryWorker,
    tier: DiskTier,
    scratch: Path,
    gpu: Sequence[torch.Tensor],
    rows: np.ndarray,
    check: Callable[[str], None],
) -> str:
    one_slot = slot_size_for(tier.ctx.layout.bytes_per_block)
    settings = dataclasses.replace(tier.settings, path=str(scratch), bytes=one_slot)
    private = type(tier)(settings, tier.ctx, name=tier.name, medium=tier.medium)
    parts: LowerTierWorker | None = None
    stats = TieredStats()
    try:
        try:
            # The tier's own builder, so the handlers and the store are those of its blocks.
            parts = private.get_worker(worker.host, list(gpu), stats)
        except Exception as e:  # what opening a store raises: OSError, NamespaceError, BackendUnavailableError ...
            raise _Skip(f"cannot open a scratch store in {scratch}: {e}") from e
        stager, to_gpu, to_cpu = parts.stager, parts.to_gpu, parts.to_cpu
        assert stager is not None and to_gpu is not None and to_cpu is not None  # a disk tier has all three
        _write(stager, stats, tier.name)
        backend = _describe_backend(private.store)
        disk = TierSlotsSpec([0], [CANARY_HASH])

        _zero_gpu(gpu, rows)
        _job(to_gpu, _TO_GPU_JOB, (disk, GPURowsSpec(rows)), f"read into the GPU ({type(to_gpu).__name__})")
        check(f"{tier.name} tier (written from a CPU slot, read straight into GPU blocks by {type(to_gpu).__name__})")

        worker.host.slot_rows[0] = 0
        _zero_gpu(gpu, rows)
        _job(to_cpu, _TO_CPU_JOB, (disk, CPULoadStoreSpec([0])), f"read into a CPU slot ({type(to_cpu).__name__})")
        _job(worker.load_handler, _CPU_TO_GPU_JOB, (CPULoadStoreSpec([0]), GPURowsSpec(rows)), "cpu -> GPU load")
        check(
            f"{tier.name} tier (written from a CPU slot, read into a CPU slot by {type(to_cpu).__name__}, then to GPU)"
        )
        return backend
    finally:
        _close(worker.rank, parts, private)


def _write(stager: Stager, stats: TieredStats, tier_name: str) -> None:
    """CPU slot 0 to disk slot 0 through ``stager`` (which counts into ``stats``), waited
    for until its index commit; ``_Skip`` when it failed (the stager logged why)."""
    try:
        stager.stage(TierWrites([0], [0], [CANARY_HASH])).result(_JOB_SECONDS)
        stager.drain()
    except Exception as e:  # staging raised or never ended: no value was seen
        raise _Skip(f"writing the canary's chunk to its scratch store failed: {e!r}") from e
    counted = stats.transfers.get(f"cpu_to_{tier_name}")
    if counted is None or counted.jobs != 1 or counted.failed_jobs:
        raise _Skip("writing the canary's chunk to its scratch store failed (logged above)")


def _job(handler: OffloadingHandler, job_id: int, spec: TransferSpec, what: str) -> None:
    """Run one job on ``handler`` to its end; ``_Skip`` unless it succeeded."""
    if not handler.transfer_async(job_id, spec):
        raise _Skip(f"its {what} refused the canary's job")
    handler.wait({job_id})
    deadline = time.monotonic() + _JOB_SECONDS
    while True:
        done = [r for r in handler.get_finished() if r.job_id == job_id]
        if done:
            break
        if time.monotonic() > deadline:
            raise _Skip(f"its {what} did not finish in {_JOB_SECONDS:.0f} s")
        time.sleep(0.001)
    if not done[0].success:
        raise _Skip(f"its {what} of the canary's chunk failed (logged above)")


def _zero_gpu(gpu: Sequence[torch.Tensor], rows: np.ndarray) -> None:
    """Zero the GPU blocks a load fills, so that one that moved nothing is seen."""
    idx = torch.as_tensor(rows[rows >= 0], device=gpu[0].device)
    for t in gpu:
        t[idx] = 0
    if gpu[0].is_cuda:  # the disk handlers copy on streams of their own
        torch.cuda.synchronize(gpu[0].device)


def _describe_backend(store: Any) -> str:
    try:
        return str(store.backend.describe())
    except Exception:  # a description only: never a reason to skip
        return "its I/O backend"


def _close(rank: int, parts: LowerTierWorker | None, private: TierSpec) -> None:
    """Shut the scratch worker side down and close its store; failures only logged (the
    checks are done, and a value found wrong must reach the caller)."""
    steps: list[Callable[[], None]] = []
    if parts is not None:
        steps += [h.shutdown for h in (parts.to_gpu, parts.to_cpu, parts.stager) if h is not None]
    steps.append(private.close)
    for step in steps:
        try:
            step()
        except Exception:
            logger.warning("rank %d: start-up canary: closing its scratch store failed", rank, exc_info=True)


__all__: Sequence[str] = ("CANARY_HASH", "SCRATCH_PREFIX", "DiskCanaryWorker", "check_disk_tiers")
