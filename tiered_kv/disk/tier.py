"""``DiskTier``: what the disk tier contributes to the hierarchy, in each process.

Built in every process from the same settings. In the scheduler process,
``get_manager`` opens the namespace, takes its writer lock and loads its index (a
``DiskOffloadingManager``, the composite's ``LowerTier``). In each worker process,
``get_worker`` opens the same namespace for this rank's block I/O and returns the
parts the composite's handlers drive (``LowerTierWorker``): a stager that writes CPU
slots to the slabs, and the handlers that read blocks into CPU slots and straight to
the GPU. A hierarchy may hold several, each on its own directory with its own name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tiered_kv.abstract import Closing
from tiered_kv.worker.worker import LowerTierWorker
from tiered_kv.config import TieredConfig
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import DISK

if TYPE_CHECKING:
    from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
    from tiered_kv.disk.worker.block_store import BlockStore
    from tiered_kv.memory.host_memory import HostKVCache
    from tiered_kv.metrics import TieredStats


@dataclass
class DiskTier(Closing):
    """One disk tier: ``config``'s disk settings (``disk_path``, ``disk_bytes``,
    ``checksum``, ``io_backend``, ``io_threads``, ``disk_io``, ``max_pending_disk_writes``)
    for ``layout`` under ``fingerprint``. ``name`` and ``medium`` tell it apart from
    other lower tiers (``disk`` / ``DISK`` for the usual one)."""

    config: TieredConfig
    fingerprint: Fingerprint
    layout: KVCacheLayout
    engine_id: str
    rank: int = 0
    enable_events: bool = True
    name: str = "disk"
    medium: str = DISK

    def __post_init__(self) -> None:
        self.store: BlockStore | None = None  # this worker's store, once get_worker ran

    def get_manager(self) -> "DiskOffloadingManager":
        from tiered_kv.disk.scheduler.manager import DiskOffloadingManager

        if not self.config.disk_path:
            raise ValueError("disk_path is not set; the disk tier is disabled")
        return DiskOffloadingManager(
            self.config.disk_path,
            self.fingerprint,
            self.layout,
            disk_bytes=self.config.disk_bytes,
            checksum=self.config.checksum,
            engine_id=self.engine_id,
            enable_events=self.enable_events,
            name=self.name,
            medium=self.medium,
        )

    def get_worker(
        self, host: "HostKVCache", kv_caches: Mapping[str, torch.Tensor], stats: "TieredStats"
    ) -> LowerTierWorker:
        from tiered_kv.disk.worker.io_process import open_worker_store
        from tiered_kv.tiered.handlers import DiskStager
        from tiered_kv.disk.worker.handlers import CpuDiskHandler, GpuDiskHandler

        self.store = store = open_worker_store(self.config, self.fingerprint, self.layout, self.engine_id)
        gpu_tensors = [kv_caches[layer.name] for layer in self.layout.layers]
        # Twice the manager's bound: a buffer returns a moment after the manager may
        # already have seen its block's index commit and queued the next write.
        stager = DiskStager(host, store, self.rank, 2 * self.config.max_pending_disk_writes, stats, tier_name=self.name)
        return LowerTierWorker(
            stager=stager,
            to_gpu=GpuDiskHandler(store, self.rank, gpu_tensors, self.layout),
            to_cpu=CpuDiskHandler(store, self.rank, host, self.layout),
        )

    def close(self) -> None:
        """Close this worker's store (the handlers using it must be shut down first). Idempotent."""
        if self.store is not None:
            self.store.close()
            self.store = None
