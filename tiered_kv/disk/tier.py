"""``DiskTier``: what a disk tier contributes to the hierarchy, in each process.

Built in every process from the same ``TierEntry`` (``tiers: [{"type": "disk", "path":
..., "bytes": ...}]``, or the config's ``disk_path``/``disk_bytes``). In the scheduler
process, ``get_manager`` opens the namespace, takes its writer lock and loads its index
(a ``DiskOffloadingManager``, the composite's ``LowerTier``), and ``get_hit_check``
opens a read-only-in-practice store for read-back verification (``DiskHitCheck``). In
each worker process, ``get_worker`` opens the same namespace for this rank's block I/O
(in the worker, or in a helper process with ``disk_io: process``) and returns the parts
the composite's handlers drive (``LowerTierWorker``): the stager that writes CPU slots
to the slab, and the handlers that read blocks into CPU slots and straight to the GPU.
A hierarchy may hold several, each on its own directory with its own name. The other
disk settings (``checksum``, ``io_backend``, ``io_threads``, ``disk_io``) are the
config's, shared by every disk tier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from tiered_kv.config_values import ConfigError, parse_choice, parse_disk_path, parse_size
from tiered_kv.cost import PRIOR_GBPS
from tiered_kv.mediums import DISK
from tiered_kv.tiers import HitCheck, TierSpec

if TYPE_CHECKING:
    import torch

    from tiered_kv.abstract import LowerTier
    from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
    from tiered_kv.disk.worker.io_backends import IOBackend
    from tiered_kv.disk.worker.io_process import DiskIOProcess
    from tiered_kv.disk.worker.store import DiskStore
    from tiered_kv.memory.host_memory import HostKVCache
    from tiered_kv.metrics import TieredStats
    from tiered_kv.worker.worker import LowerTierWorker

#: Default capacity of a disk tier (bytes per rank), as ``TieredConfig.disk_bytes``.
DEFAULT_DISK_BYTES = 64 * 1024**3
_WRITE_POLICIES = ("write_through", "write_back")


@dataclass(frozen=True)
class DiskTierSettings:
    """A disk tier's own settings: its directory, its capacity in bytes per rank, and
    its write policy (None: the config's ``write_policy``)."""

    path: str
    bytes: int = DEFAULT_DISK_BYTES
    write_policy: str | None = None


class DiskTier(TierSpec):
    """One disk tier (module docstring). ``settings`` is a ``DiskTierSettings``."""

    default_name = "disk"
    medium = DISK
    prior_gbps = PRIOR_GBPS[DISK]  # a second disk tier's too, though its medium is its own
    settings: DiskTierSettings

    @classmethod
    def parse_settings(cls, raw: Mapping[str, Any], key_prefix: str) -> DiskTierSettings:
        known = ("path", "bytes", "write_policy")
        for key in raw:
            if key not in known:
                raise ConfigError(f"{key_prefix}{key}: not a disk tier setting; expected {', '.join(known)}")
        if "path" not in raw:
            raise ConfigError(f"{key_prefix}path: a disk tier needs its directory, e.g. '/mnt/nvme/tiered-kv'")
        path = parse_disk_path(raw["path"], f"{key_prefix}path")
        if path is None:
            raise ConfigError(f"{key_prefix}path: a disk tier needs its directory, got {raw['path']!r}")
        return DiskTierSettings(
            path=path,
            bytes=parse_size(raw["bytes"], f"{key_prefix}bytes") if "bytes" in raw else DEFAULT_DISK_BYTES,
            write_policy=(
                parse_choice(raw["write_policy"], f"{key_prefix}write_policy", _WRITE_POLICIES)
                if "write_policy" in raw
                else None
            ),
        )

    @property
    def write_policy(self) -> str:
        return self.settings.write_policy or self.ctx.config.write_policy

    @property
    def shares_host_memory(self) -> bool:
        return self.ctx.config.disk_io == "process"

    # ------------------------------------------------------------ scheduler process

    def get_manager(self) -> "DiskOffloadingManager":
        from tiered_kv.disk.scheduler.manager import DiskOffloadingManager

        ctx = self.ctx
        return DiskOffloadingManager(
            self.settings.path,
            ctx.fingerprint,
            ctx.layout,
            disk_bytes=self.settings.bytes,
            checksum=ctx.config.checksum,
            engine_id=ctx.engine_id,
            enable_events=ctx.enable_events,
            name=self.name,
            medium=self.medium,
        )

    def get_hit_check(self, manager: "LowerTier") -> HitCheck:
        """Read-back verification on every rank before a hit (``DiskHitCheck``), on its
        own threads over its own store of the namespace ``manager`` opened; none where
        the engine recomputes a failed load (each hit read once, by the workers)."""
        from tiered_kv.disk.scheduler.hit_check import DiskHitCheck
        from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
        from tiered_kv.disk.scheduler.verify import DiskVerifier
        from tiered_kv.disk.worker.io_backends import PosixBackend
        from tiered_kv.disk.worker.store import DiskStore

        assert isinstance(manager, DiskOffloadingManager), manager
        if self.ctx.failed_loads_recomputed:
            return DiskHitCheck(manager, None)
        threads = self.ctx.config.io_threads
        store = DiskStore(manager.namespace, PosixBackend(threads), engine_id=self.ctx.engine_id)
        return DiskHitCheck(manager, DiskVerifier(store, self.ctx.world_size, threads=threads))

    # ------------------------------------------------------------ worker process

    @overload
    def open_store(self, *, io_backend: str | IOBackend | None = None, in_process: Literal[True]) -> DiskStore: ...
    @overload
    def open_store(
        self, *, io_backend: str | IOBackend | None = None, in_process: bool | None = None
    ) -> DiskStore | DiskIOProcess: ...
    def open_store(
        self, *, io_backend: "str | IOBackend | None" = None, in_process: bool | None = None
    ) -> "DiskStore | DiskIOProcess":
        """This process's store of the tier's namespace: a ``DiskStore`` here, or a
        ``DiskIOProcess`` (``disk_io: process``, unless ``in_process``). ``io_backend``
        overrides the config's."""
        from tiered_kv.disk.worker.io_process import DiskIOProcess
        from tiered_kv.disk.worker.store import DiskStore

        cfg = self.ctx.config
        here = in_process if in_process is not None else cfg.disk_io != "process"
        backend = io_backend if io_backend is not None else cfg.io_backend
        path, fp, layout, size = self.settings.path, self.ctx.fingerprint, self.ctx.layout, self.settings.bytes
        if here:
            return DiskStore.open(
                path,
                fp,
                layout,
                disk_bytes=size,
                checksum=cfg.checksum,
                io_backend=backend,
                io_threads=cfg.io_threads,
                engine_id=self.ctx.engine_id,
            )
        if not isinstance(backend, str):
            raise ValueError(f"io_backend {backend!r}: a backend object serves a store in this process only")
        return DiskIOProcess.open(
            path,
            fp,
            layout,
            disk_bytes=size,
            checksum=cfg.checksum,
            io_backend=backend,
            io_threads=cfg.io_threads,
            engine_id=self.ctx.engine_id,
        )

    def get_worker(
        self, host: "HostKVCache", gpu_tensors: Sequence["torch.Tensor"], stats: "TieredStats"
    ) -> "LowerTierWorker":
        from tiered_kv.disk.worker.handlers import CpuDiskHandler, GpuDiskHandler
        from tiered_kv.disk.worker.stager import DiskStager
        from tiered_kv.worker.worker import LowerTierWorker

        ctx = self.ctx
        self.store = store = self.open_store()
        # Twice the manager's bound: a buffer returns a moment after the manager may
        # already have seen its block's index commit and queued the next write.
        stager = DiskStager(host, store, ctx.rank, 2 * ctx.config.max_pending_disk_writes, stats, tier_name=self.name)
        self.stager = stager
        return LowerTierWorker(
            stager=stager,
            to_gpu=GpuDiskHandler(store, ctx.rank, list(gpu_tensors), ctx.layout),
            to_cpu=CpuDiskHandler(store, ctx.rank, host, ctx.layout),
        )

    def close(self) -> None:
        """Close this worker's store (the handlers using it must be shut down first). Idempotent."""
        if self.store is not None:
            self.store.close()
            self.store = None


__all__ = ["DEFAULT_DISK_BYTES", "DiskTier", "DiskTierSettings"]
