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
A hierarchy may hold several, each on its own directory with its own name and its own
settings (``DiskTierSettings``); the config's disk shorthands (``io_backend``,
``checksum``, ...) are folded into every disk entry that does not set its own
(``tiered_kv.config.fold_shorthands``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from tiered_kv.config_values import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    DEFAULT_IO_THREADS,
    DISK_IO,
    IO_BACKENDS,
    MAX_IO_THREADS,
    ConfigError,
    parse_choice,
    parse_disk_path,
    parse_positive_int,
    parse_retention,
    parse_size,
    retention_share,
)
from tiered_kv.cost import PRIOR_GBPS
from tiered_kv.mediums import DISK
from tiered_kv.tier_ops import Check, ToolContext
from tiered_kv.tier_registry import TierEntry
from tiered_kv.tiers import HitCheck, TierSpec

if TYPE_CHECKING:
    import torch

    from tiered_kv.abstract import LowerTier
    from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
    from tiered_kv.disk.store.io_backends import IOBackend
    from tiered_kv.disk.worker.io_process import DiskIOProcess
    from tiered_kv.disk.store.store import DiskStore
    from tiered_kv.memory.host_memory import HostKVCache
    from tiered_kv.metrics import TieredStats
    from tiered_kv.worker.worker import LowerTierWorker

#: Default capacity of a disk tier (bytes per rank).
DEFAULT_DISK_BYTES = 64 * 1024**3
_WRITE_POLICIES = ("write_through", "write_back")


def _parse_eviction_policy(value: Any, key: str) -> str:
    if value == "arc":
        raise ConfigError(
            f"{key}: the disk tier evicts in LRU order only (its index keeps each "
            f"block's last access), got 'arc'; ARC is for the CPU tier: "
            f"set eviction_policy: arc"
        )
    return parse_choice(value, key, ("lru",))


@dataclass(frozen=True)
class DiskTierSettings:
    """A disk tier's own settings.

    | key | meaning | default |
    |---|---|---|
    | ``path`` | its directory (local NVMe) | required |
    | ``bytes`` | its capacity, bytes per rank | 64 GiB |
    | ``write_policy`` | ``write_through`` or ``write_back`` | the config's |
    | ``io_backend`` | ``auto``, ``kvikio`` or ``posix`` | ``auto`` |
    | ``checksum`` | ``xxh3_64`` or ``crc32c``, kept per block in the index | ``xxh3_64`` |
    | ``io_threads`` | I/O threads of each store | 4 |
    | ``disk_io`` | ``thread`` (in the worker) or ``process`` (a helper per worker) | ``thread`` |
    | ``eviction_policy`` | ``lru`` (the index keeps each block's last access) | ``lru`` |
    | ``retention`` | ``none`` or ``session(S)``: holds on sessions' tails (``tiered.retention``) | ``none`` |
    """

    path: str
    bytes: int = DEFAULT_DISK_BYTES
    write_policy: str | None = None
    io_backend: str = "auto"
    checksum: str = DEFAULT_CHECKSUM
    io_threads: int = DEFAULT_IO_THREADS
    disk_io: str = "thread"
    eviction_policy: str = "lru"
    retention: str = "none"

    def to_dict(self) -> dict[str, Any]:
        """As config keys (``bytes`` with its unit: a bare number is refused below 1 MiB)."""
        out = {k: v for k in self.__dataclass_fields__ if (v := getattr(self, k)) is not None}
        out["bytes"] = f"{self.bytes}B"
        return out


class DiskTier(TierSpec):
    """One disk tier (module docstring). ``settings`` is a ``DiskTierSettings``."""

    default_name = "disk"
    medium = DISK
    prior_gbps = PRIOR_GBPS[DISK]  # a second disk tier's too, though its medium is its own
    settings: DiskTierSettings

    @classmethod
    def parse_settings(cls, raw: Mapping[str, Any], key_prefix: str) -> DiskTierSettings:
        known = tuple(DiskTierSettings.__dataclass_fields__)
        for key in raw:
            if key not in known:
                raise ConfigError(f"{key_prefix}{key}: not a disk tier setting; expected {', '.join(known)}")
        if "path" not in raw:
            raise ConfigError(f"{key_prefix}path: a disk tier needs its directory, e.g. '/mnt/nvme/tiered-kv'")
        path = parse_disk_path(raw["path"], f"{key_prefix}path")
        if path is None:
            raise ConfigError(f"{key_prefix}path: a disk tier needs its directory, got {raw['path']!r}")
        parsers: dict[str, Callable[[Any, str], Any]] = {
            "bytes": parse_size,
            "write_policy": lambda v, k: parse_choice(v, k, _WRITE_POLICIES),
            "io_backend": lambda v, k: parse_choice(v, k, IO_BACKENDS),
            "checksum": lambda v, k: parse_choice(v, k, CHECKSUMS),
            "io_threads": lambda v, k: parse_positive_int(v, k, MAX_IO_THREADS),
            "disk_io": lambda v, k: parse_choice(v, k, DISK_IO),
            "eviction_policy": _parse_eviction_policy,
            "retention": lambda v, k: parse_retention(v, k, "the disk tier"),
        }
        return DiskTierSettings(
            path=path, **{key: parse(raw[key], f"{key_prefix}{key}") for key, parse in parsers.items() if key in raw}
        )

    @property
    def write_policy(self) -> str:
        return self.settings.write_policy or self.ctx.config.write_policy

    # ------------------------------------------------------------ operator hooks

    config_info_keys = ("tier_type", "disk_path", "disk_bytes_per_rank", "disk_checksum", "disk_io_backend")

    def config_info(self) -> dict[str, Any]:
        s = self.settings
        return dict(zip(self.config_info_keys, ("disk", s.path, s.bytes, s.checksum, s.io_backend)))

    @classmethod
    def doctor_checks(cls, entry: TierEntry, ctx: ToolContext) -> list[Check]:
        """Its directory (creatable, writable, local, O_DIRECT) and the free space its
        capacity needs at the server's TP (``tiered_kv.ops.doctor.disk``)."""
        import dataclasses

        from tiered_kv.ops.doctor.disk import check_disk_path, check_free_space

        alone = dataclasses.replace(ctx.config, tiers=(entry,))
        return [check_disk_path(alone, ctx.mountinfo), check_free_space(alone, ctx.tp, per_node=ctx.per_node)]

    @property
    def shares_host_memory(self) -> bool:
        return self.settings.disk_io == "process"

    # ------------------------------------------------------------ scheduler process

    def get_manager(self) -> "DiskOffloadingManager":
        from tiered_kv.disk.scheduler.manager import DiskOffloadingManager

        ctx = self.ctx
        return DiskOffloadingManager(
            self.settings.path,
            ctx.fingerprint,
            ctx.layout,
            disk_bytes=self.settings.bytes,
            checksum=self.settings.checksum,
            engine_id=ctx.engine_id,
            enable_events=ctx.enable_events,
            name=self.name,
            medium=self.medium,
            retention_share=retention_share(self.settings.retention),
            clock=ctx.clock,
        )

    def get_hit_check(self, manager: "LowerTier") -> HitCheck:
        """Read-back verification on every rank before a hit (``DiskHitCheck``), on its
        own threads over its own store of the namespace ``manager`` opened; none where
        the engine recomputes a failed load (each hit read once, by the workers)."""
        from tiered_kv.disk.scheduler.hit_check import DiskHitCheck
        from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
        from tiered_kv.disk.scheduler.verify import DiskVerifier
        from tiered_kv.disk.store.io_backends import PosixBackend
        from tiered_kv.disk.store.store import DiskStore

        assert isinstance(manager, DiskOffloadingManager), manager
        if self.ctx.failed_loads_recomputed:
            return DiskHitCheck(manager, None)
        threads = self.settings.io_threads
        store = DiskStore(manager.namespace, PosixBackend(threads), engine_id=self.ctx.engine_id)
        return DiskHitCheck(manager, DiskVerifier(store, self.ctx.world_size, threads=threads))

    def warm_writer(self) -> "DiskStore":
        """The warm-up writes a store of the namespace in its own process, every rank's
        shard of a block (``BlockWriter``)."""
        return self.open_store(in_process=True)

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
        from tiered_kv.disk.store.store import DiskStore

        cfg = self.settings
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
