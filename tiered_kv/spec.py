"""OffloadingSpec: builds a manager (scheduler process) and handlers (worker processes)
from one validated config.

Constructed in every process from the same config; ``get_manager`` is called only in
the scheduler, ``get_handlers`` only in workers. No I/O at construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tiered_kv.abstract import LoadStoreSpec, OffloadingManager
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.worker.worker import OffloadingHandler, OffloadingWorker


class OffloadingSpec(ABC):
    """Spec for an offloading hierarchy.

    ``gpu_block_size`` is the engine's tokens per GPU block. ``config.block_size`` (tokens
    per offloaded block, optional) must be a multiple of it; their ratio is
    ``block_size_factor``.
    """

    def __init__(self, config: TieredConfig | Mapping[str, Any], gpu_block_size: int):
        self.config = config if isinstance(config, TieredConfig) else TieredConfig.from_dict(config)
        if gpu_block_size < 1:
            raise ConfigError(f"gpu_block_size: expected a positive number of tokens, got {gpu_block_size}")
        self.gpu_block_size = gpu_block_size
        offloaded = self.config.block_size or gpu_block_size
        if offloaded % gpu_block_size:
            raise ConfigError(
                f"block_size: {offloaded} tokens is not a multiple of the engine's GPU block "
                f"size ({gpu_block_size} tokens)"
            )
        self.block_size_factor = offloaded // gpu_block_size
        self.offloaded_block_size = offloaded

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager that tracks offloaded blocks and evicts."""

    @abstractmethod
    def get_handlers(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        kv_before_num_blocks: bool | Mapping[str, bool] = False,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """Yield ``(src_spec_cls, dst_spec_cls, handler)`` for every direction this spec
        moves data in, for the device KV cache ``kv_caches`` (layer name -> tensor)."""

    def build_worker(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        kv_before_num_blocks: bool | Mapping[str, bool] = False,
    ) -> OffloadingWorker:
        """An OffloadingWorker with every handler of ``get_handlers`` registered."""
        worker = OffloadingWorker()
        for src_cls, dst_cls, handler in self.get_handlers(kv_caches, kv_before_num_blocks):
            worker.register_handler(src_cls, dst_cls, handler)
        return worker
