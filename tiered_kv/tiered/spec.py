"""TieredOffloadingSpec: the three-tier hierarchy GPU <-> CPU <-> disk from one config.

Constructed in every process from the same config, ``engine_id``, rank and TP size.
``get_manager`` (scheduler process) opens the disk namespace, takes its writer lock and
loads its index; ``get_handlers`` (worker process) allocates the host tensors, opens the
same namespace for this rank's block I/O and yields the handlers. Without ``disk_path``
it is the CPU tier alone with the composite's bookkeeping.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tiered_kv.abstract import LoadStoreSpec
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.cpu.spec import CPUOffloadingSpec
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.handlers import DiskStager, TieredLoadHandler, TieredStoreHandler
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.specs import TieredLoadSpec
from tiered_kv.worker.worker import OffloadingHandler


class TieredOffloadingSpec(CPUOffloadingSpec):
    """GPU -> CPU (LRU) -> disk (LRU, persistent) offloading.

    ``rank``/``tp_size``: this process's tensor-parallel rank and the TP size (part of
    the disk fingerprint). ``engine_id``: shared by the scheduler and its workers so the
    workers may write while the scheduler holds the cache's writer lock.
    ``stats`` is shared by the manager and the handlers built by this spec.
    """

    def __init__(self, config: TieredConfig | Mapping[str, Any], gpu_block_size: int,
                 layout: KVCacheLayout | None = None, *, rank: int = 0, tp_size: int = 1,
                 engine_id: str | None = None, enable_events: bool = True):
        super().__init__(config, gpu_block_size, layout, enable_events)
        if tp_size < 1 or not 0 <= rank < tp_size:
            raise ConfigError(f"rank {rank} / tp_size {tp_size}: expected 0 <= rank < tp_size")
        self.rank, self.tp_size = rank, tp_size
        self.engine_id = engine_id or uuid.uuid4().hex
        self.stats = TieredStats()
        self.store = None  # this worker's DiskStore, once get_handlers ran

    def _fingerprint(self):
        from tiered_kv.disk.fingerprint import Fingerprint
        return Fingerprint.from_config(self.config, self.layout, self.tp_size)

    def get_manager(self) -> TieredOffloadingManager:
        cpu = CPUOffloadingManager(self.num_cpu_slots, self.offloaded_block_size,
                                   enable_events=self.enable_events)
        disk = None
        if self.config.disk_path:
            from tiered_kv.disk.manager import DiskOffloadingManager
            disk = DiskOffloadingManager(
                self.config.disk_path, self._fingerprint(), self.layout,
                disk_bytes=self.config.disk_bytes, checksum=self.config.checksum,
                engine_id=self.engine_id, enable_events=self.enable_events)
        return TieredOffloadingManager(
            cpu, disk, write_policy=self.config.write_policy, promote_on_hit=self.config.promote_on_hit,
            max_pending_disk_writes=self.config.max_pending_disk_writes, stats=self.stats)

    def _host_shared(self) -> bool:
        return bool(self.config.disk_path) and self.config.disk_io == "process"

    def get_handlers(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        kv_before_num_blocks: bool | Mapping[str, bool] = False,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        cpu_gpu = self._cpu_gpu_handlers(kv_caches, kv_before_num_blocks)
        layout = self.layout
        stager = disk_to_gpu = disk_to_cpu = None
        if self.config.disk_path:
            from tiered_kv.disk.io_process import open_worker_store
            from tiered_kv.worker.disk import CpuDiskHandler, GpuDiskHandler
            self.store = open_worker_store(self.config, self._fingerprint(), layout, self.engine_id)
            gpu_tensors = [kv_caches[l.name] for l in layout.layers]
            disk_to_gpu = GpuDiskHandler(self.store, self.rank, gpu_tensors, layout)
            disk_to_cpu = CpuDiskHandler(self.store, self.rank, self.host, layout)
            # Twice the manager's bound: a buffer returns a moment after the manager may
            # already have seen its block's index commit and queued the next write.
            stager = DiskStager(self.host, self.store, self.rank, 2 * self.config.max_pending_disk_writes,
                                self.stats)
        store = TieredStoreHandler(cpu_gpu.gpu_to_cpu_handler, layout.bytes_per_block, stager, self.stats)
        load = TieredLoadHandler(cpu_gpu.cpu_to_gpu_handler, layout.bytes_per_block, layout.block_size_factor,
                                 disk_to_gpu, disk_to_cpu, self.stats)
        yield GPULoadStoreSpec, CPULoadStoreSpec, store
        yield CPULoadStoreSpec, GPULoadStoreSpec, load
        yield TieredLoadSpec, GPULoadStoreSpec, load
