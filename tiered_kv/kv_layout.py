"""The shape of an engine's KV cache, as the offloading tiers see it.

Pure description, no I/O; built in every process from the device KV-cache tensors
(worker) or from the engine's config (scheduler). Host memory, disk slots and the
disk namespace fingerprint are all derived from it.

Two per-layer layouts exist: the KV dimension before ``num_blocks`` (``(2, num_blocks,
...)``, e.g. flash-attention) or after it (``(num_blocks, ...)`` with K and V inside
the block). An offloaded block is ``block_size_factor`` consecutive GPU blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class LayerLayout:
    """One layer's KV-cache tensor: its shape and whether KV comes before num_blocks."""

    name: str
    shape: tuple[int, ...]
    kv_before_num_blocks: bool

    @property
    def num_blocks(self) -> int:
        return self.shape[1] if self.kv_before_num_blocks else self.shape[0]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one GPU block of this layer, without the KV dim when it comes first."""
        return self.shape[2:] if self.kv_before_num_blocks else self.shape[1:]

    @property
    def elements_per_gpu_block(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * (self.shape[0] if self.kv_before_num_blocks else 1)


@dataclass(frozen=True)
class KVCacheLayout:
    """All layers of one rank's KV cache plus how GPU blocks group into offloaded blocks."""

    layers: tuple[LayerLayout, ...]
    dtype: torch.dtype
    gpu_block_size: int  # tokens per GPU block
    block_size_factor: int = 1  # GPU blocks per offloaded block

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("KVCacheLayout needs at least one layer; got none")
        if self.block_size_factor < 1:
            raise ValueError(f"block_size_factor must be >= 1, got {self.block_size_factor}")
        if self.gpu_block_size < 1:
            raise ValueError(f"gpu_block_size must be >= 1 token, got {self.gpu_block_size}")
        counts = {layer.num_blocks for layer in self.layers}
        if len(counts) != 1:
            raise ValueError(f"all layers must have the same num_blocks; got {sorted(counts)}")

    @classmethod
    def from_tensors(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        gpu_block_size: int,
        block_size_factor: int = 1,
        kv_before_num_blocks: bool | Mapping[str, bool] = False,
    ) -> "KVCacheLayout":
        """Describe ``kv_caches`` (layer name -> tensor). ``kv_before_num_blocks`` is one
        flag for all layers or one per layer name."""
        if not kv_caches:
            raise ValueError("kv_caches is empty; expected layer name -> KV-cache tensor")
        dtypes = {t.dtype for t in kv_caches.values()}
        if len(dtypes) != 1:
            raise ValueError(f"all KV-cache layers must share one dtype; got {sorted(map(str, dtypes))}")
        layers = []
        for name, tensor in kv_caches.items():
            flag = (
                kv_before_num_blocks[name] if isinstance(kv_before_num_blocks, Mapping) else bool(kv_before_num_blocks)
            )
            if flag and tensor.shape[0] != 2:
                raise ValueError(
                    f"layer {name!r} has shape {tuple(tensor.shape)}; with the KV dimension "
                    f"before num_blocks its first dimension must be 2"
                )
            layers.append(LayerLayout(name, tuple(tensor.shape), flag))
        return cls(tuple(layers), dtypes.pop(), gpu_block_size, block_size_factor)

    @property
    def num_gpu_blocks(self) -> int:
        return self.layers[0].num_blocks

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def offloaded_block_size(self) -> int:
        """Tokens per offloaded block."""
        return self.gpu_block_size * self.block_size_factor

    def layer_bytes_per_block(self, layer: LayerLayout) -> int:
        """Bytes of one offloaded block in one layer."""
        return layer.elements_per_gpu_block * self.block_size_factor * self.element_size

    @cached_property  # read per job on the workers' hot paths
    def bytes_per_block(self) -> int:
        """Bytes of one offloaded block across all layers (this rank only, unpadded)."""
        return sum(self.layer_bytes_per_block(layer) for layer in self.layers)

    def describe(self) -> dict:
        """A JSON-able description, used in fingerprints and manifests."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "gpu_block_size": self.gpu_block_size,
            "block_size_factor": self.block_size_factor,
            "layers": [
                {"name": l.name, "block_shape": list(l.block_shape), "kv_before_num_blocks": l.kv_before_num_blocks}
                for l in self.layers
            ],
        }
