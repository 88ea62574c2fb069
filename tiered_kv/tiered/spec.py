"""HierarchySpec: the hierarchy GPU <-> CPU <-> lower tiers from one config.

Constructed in every process from the same config, ``engine_id``, rank and TP size.
The lower tiers are an ordered list of tier specs (``DiskTier``: the config's disk tier
where ``disk_path`` is set, then any given in ``lower_tiers``). ``get_manager``
(scheduler process) has each build its manager (the disk tier opens its namespace,
takes its writer lock and loads its index); ``get_handlers`` (worker process)
allocates the host tensors, has each open its worker side (this rank's block I/O) and
yields the composite's handlers. Without lower tiers it is the CPU tier alone with the
composite's bookkeeping.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from tiered_kv.abstract import Closing, LoadStoreSpec
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.cpu import cpu_tier_manager
from tiered_kv.cpu.spec import CPUOffloadingSpec
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.tier import DiskTier
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from tiered_kv.metrics import TieredStats
from tiered_kv.remote.tier import RemoteTier, remote_tier_from_config
from tiered_kv.tiered.handlers import TieredLoadHandler, TieredStoreHandler
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.transfer_specs import TieredLoadSpec
from tiered_kv.worker.worker import OffloadingHandler


class HierarchySpec(CPUOffloadingSpec, Closing):
    """GPU -> CPU (LRU) -> disk (LRU, persistent) offloading.

    ``rank``/``tp_size``: this process's tensor-parallel rank and the TP size (part of
    the disk fingerprint). ``engine_id``: shared by the scheduler and its workers so the
    workers may write while the scheduler holds the cache's writer lock.
    ``lower_tiers``: more tier specs below the config's disk tier, fastest first, each
    with its own name (e.g. a second ``DiskTier`` on another directory).
    ``stats`` is shared by the manager and the handlers built by this spec.
    """

    def __init__(
        self,
        config: TieredConfig | Mapping[str, Any],
        gpu_block_size: int,
        layout: KVCacheLayout | None = None,
        *,
        rank: int = 0,
        tp_size: int = 1,
        engine_id: str | None = None,
        enable_events: bool = True,
        lower_tiers: Sequence[DiskTier | RemoteTier] = (),
    ):
        super().__init__(config, gpu_block_size, layout, enable_events)
        if tp_size < 1 or not 0 <= rank < tp_size:
            raise ConfigError(f"rank {rank} / tp_size {tp_size}: expected 0 <= rank < tp_size")
        self.rank, self.tp_size = rank, tp_size
        self.engine_id = engine_id or uuid.uuid4().hex
        self.stats = TieredStats()
        self._extra_tiers = list(lower_tiers)
        self._lower: list[DiskTier | RemoteTier] | None = None

    def _fingerprint(self) -> Fingerprint:
        return Fingerprint.from_config(self.config, self.known_layout, self.tp_size)

    @property
    def lower_tiers(self) -> list[DiskTier | RemoteTier]:
        """The lower tiers' specs, fastest first (built once the KV layout is known)."""
        if self._lower is None:
            own: list[DiskTier | RemoteTier] = []
            if self.config.disk_path:
                own.append(
                    DiskTier(
                        self.config,
                        self._fingerprint(),
                        self.known_layout,
                        self.engine_id,
                        rank=self.rank,
                        enable_events=self.enable_events,
                    )
                )
            if self.config.remote is not None:
                own.append(
                    remote_tier_from_config(
                        self.config.remote,
                        self._fingerprint(),
                        self.known_layout,
                        self.engine_id,
                        self.rank,
                        enable_events=self.enable_events,
                    )
                )
            self._lower = own + self._extra_tiers
        return self._lower

    @property
    def store(self):
        """This worker's store of the first lower tier, once ``get_handlers`` ran."""
        return self.lower_tiers[0].store if self.lower_tiers else None

    def get_manager(self) -> TieredOffloadingManager:
        cpu = cpu_tier_manager(
            self.config.eviction_policy, self.num_cpu_slots, self.offloaded_block_size, enable_events=self.enable_events
        )
        lower = []
        try:
            for tier in self.lower_tiers:
                lower.append(tier.get_manager())
        except BaseException:
            for manager in lower:
                manager.shutdown()
            raise
        return TieredOffloadingManager(
            cpu,
            lower,
            write_policy=[getattr(t, "write_policy", self.config.write_policy) for t in self.lower_tiers],
            promote_on_hit=self.config.promote_on_hit,
            max_pending_disk_writes=self.config.max_pending_disk_writes,
            stats=self.stats,
        )

    def close(self) -> None:
        """Close the workers' lower-tier stores opened by ``get_handlers``."""
        for tier in self.lower_tiers:
            tier.close()

    def _host_shared(self) -> bool:
        return bool(self.config.disk_path) and self.config.disk_io == "process"

    def get_handlers(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        kv_before_num_blocks: bool | Mapping[str, bool] = False,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        cpu_gpu = self._cpu_gpu_handlers(kv_caches, kv_before_num_blocks)
        layout = cpu_gpu.host.layout
        workers = [tier.get_worker(cpu_gpu.host, kv_caches, self.stats) for tier in self.lower_tiers]
        store = TieredStoreHandler(
            cpu_gpu.gpu_to_cpu_handler, layout.bytes_per_block, [w.stager for w in workers] or None, self.stats
        )
        load = TieredLoadHandler(
            cpu_gpu.cpu_to_gpu_handler,
            layout.bytes_per_block,
            layout.block_size_factor,
            [w.to_gpu for w in workers] or None,
            [w.to_cpu for w in workers] or None,
            self.stats,
            tier_names=[t.name for t in self.lower_tiers] or ("disk",),
        )
        yield GPULoadStoreSpec, CPULoadStoreSpec, store
        yield CPULoadStoreSpec, GPULoadStoreSpec, load
        yield TieredLoadSpec, GPULoadStoreSpec, load
