"""CPUOffloadingSpec: the two-tier hierarchy GPU <-> pinned CPU from one config.

Built in every process from the same config. ``get_manager`` (scheduler) sizes the
LRU manager from ``config.cpu_bytes`` and the KV layout, which the scheduler cannot
see from tensors, so it is given to the constructor. ``get_handlers`` (worker)
allocates the ``HostKVCache`` (pinned when CUDA is present) for the worker's device
KV cache and yields the two CUDA-stream handlers. No file I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tiered_kv.abstract import LoadStoreSpec, OffloadingManager
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.cpu import cpu_tier_for_rules
from tiered_kv.memory.host_memory import HostKVCache
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from tiered_kv.spec import OffloadingSpec
from tiered_kv.cpu.handlers import CpuGpuOffloadingHandlers
from tiered_kv.worker.worker import OffloadingHandler


class CPUOffloadingSpec(OffloadingSpec):
    """GPU -> CPU (LRU) offloading.

    ``layout`` describes one rank's KV cache (needed by ``get_manager`` to turn
    ``cpu_bytes`` into slots; its ``block_size_factor`` must match the config's). When
    omitted, ``get_handlers`` derives it from the KV tensors, and ``get_manager`` works
    only after that. ``enable_events`` is passed to the manager.
    """

    def __init__(
        self,
        config: TieredConfig | Mapping[str, Any],
        gpu_block_size: int,
        layout: KVCacheLayout | None = None,
        enable_events: bool = True,
    ):
        super().__init__(config, gpu_block_size)
        self.enable_events = enable_events
        self.layout: KVCacheLayout | None = None
        self.host: HostKVCache | None = None
        if layout is not None:
            self._set_layout(layout)

    @property
    def known_layout(self) -> KVCacheLayout:
        """``layout``; a ``ConfigError`` while it is not known yet."""
        if self.layout is None:
            raise ConfigError(
                "CPUOffloadingSpec needs the KV layout to size the CPU tier; pass layout=... or call get_handlers first"
            )
        return self.layout

    @property
    def num_cpu_slots(self) -> int:
        """Offloaded blocks that fit in ``config.cpu_bytes``."""
        try:
            return HostKVCache.slots_for_bytes(self.known_layout, self.config.cpu_bytes)
        except ValueError as exc:
            raise ConfigError(f"cpu_bytes: {exc}") from None

    def get_manager(self) -> OffloadingManager:
        # The rank rules only: ``cpu_retention`` is applied by ``HierarchySpec``, the spec
        # vLLM runs, which overrides this.
        return cpu_tier_for_rules(
            self.config.eviction_policy,
            self.num_cpu_slots,
            self.offloaded_block_size,
            self.config.cpu_admission,
            "none",
            enable_events=self.enable_events,
        )

    def get_handlers(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        kv_before_num_blocks: bool | Mapping[str, bool] = False,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        handlers = self._cpu_gpu_handlers(kv_caches, kv_before_num_blocks)
        yield GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler

    def _cpu_gpu_handlers(
        self, kv_caches: Mapping[str, torch.Tensor], kv_before_num_blocks: bool | Mapping[str, bool]
    ) -> CpuGpuOffloadingHandlers:
        """Learn the layout from the device tensors, allocate the host tier, and build
        the two CUDA-stream handlers between them (worker process)."""
        layout = KVCacheLayout.from_tensors(
            kv_caches, self.gpu_block_size, self.block_size_factor, kv_before_num_blocks
        )
        self._set_layout(layout)
        self.host = HostKVCache(layout, self.num_cpu_slots, shared=self._host_shared())
        return CpuGpuOffloadingHandlers(kv_caches, self.host, copy_kernels=self.config.copy_kernels)

    def _host_shared(self) -> bool:
        """Whether the CPU tier must be shared memory (another process reaches it)."""
        return False

    def _set_layout(self, layout: KVCacheLayout) -> None:
        if layout.block_size_factor != self.block_size_factor:
            raise ConfigError(
                f"layout block_size_factor {layout.block_size_factor} does not match "
                f"the config's {self.block_size_factor} (block_size "
                f"{self.offloaded_block_size} / gpu_block_size {self.gpu_block_size})"
            )
        # describe() leaves out num_blocks: the scheduler's layout may carry another count.
        if self.layout is not None and self.layout.describe() != layout.describe():
            raise ConfigError(
                f"KV tensors {layout.describe()} do not match the layout this spec was given {self.layout.describe()}"
            )
        self.layout = layout
