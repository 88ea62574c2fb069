"""Where warmed blocks go: a ``BlockLayout`` (the serving engine's KV-cache layout, how a
prompt's K/V become one block's bytes, and each chunk's key), chosen by name.

Runs in the operator's process (``tiered-kv warmup``, ``tiered-kv config``); no I/O:
packs tensors into host rows (``pack_blocks``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiered_kv.config import TieredConfig
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.ops.hashing import chunk_keys
from tiered_kv.memory.host_memory import pack_blocks
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.ops.sizing import ModelGeometry


@dataclass(frozen=True)
class VllmServe:
    """A vLLM server started as ``vllm serve model_dir --dtype dtype --block-size
    gpu_block_size --tensor-parallel-size tp_size --attention-backend attention_backend``
    with ``extra_config`` as its ``kv_connector_extra_config`` and KV-cache layout
    ``kv_cache_layout``: what the ``vllm`` layout computes that server's config and
    namespace from (``vllm_pages.server_vllm_config``). Defaults are the server's own:
    ``dtype`` ``auto`` (vLLM's choice, e.g. bfloat16 for a float32 checkpoint), 16-token
    GPU blocks, TP 1, ``attention_backend`` None (vLLM's choice on this host, else
    FLASH_ATTN) and ``kv_cache_layout`` None (``VLLM_KV_CACHE_LAYOUT``, else the one
    vLLM resolves for the backend, LBNHC for FLASH_ATTN)."""

    model_dir: str
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "auto"
    gpu_block_size: int = 16
    tp_size: int = 1
    kv_cache_layout: str | None = None
    attention_backend: str | None = None


@dataclass(frozen=True)
class LayoutRequest:
    """What a ``BlockLayout`` factory is given: the model's KV geometry and dtype, the
    serving engine's GPU block size, GPU blocks per offloaded block, and TP size; and
    what a layout that computes the serving engine's own namespace reads: the model
    directory (the server's ``--model``), the server's extra config (its
    ``kv_connector_extra_config``), KV-cache layout and attention backend (None: the
    engine's default)."""

    geometry: ModelGeometry
    dtype: torch.dtype
    gpu_block_size: int
    block_size_factor: int
    tp_size: int
    model_dir: str | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_cache_layout: str | None = None
    attention_backend: str | None = None

    @property
    def chunk_tokens(self) -> int:
        return self.gpu_block_size * self.block_size_factor

    def vllm_serve(self) -> VllmServe:
        """The vLLM server this request writes for, running the model in the request's
        dtype. Raises ``ValueError`` without a ``model_dir`` (each layout refuses that
        first, saying why it needs one)."""
        if self.model_dir is None:
            raise ValueError("model_dir: a vLLM server's settings name its model directory")
        return VllmServe(
            self.model_dir,
            self.extra_config,
            dtype=str(self.dtype).removeprefix("torch."),
            gpu_block_size=self.gpu_block_size,
            tp_size=self.tp_size,
            kv_cache_layout=self.kv_cache_layout,
            attention_backend=self.attention_backend,
        )

    def rank_heads(self, rank: int) -> list[int]:
        """KV heads TP rank ``rank`` holds (heads are replicated when TP exceeds them)."""
        h = self.geometry.num_kv_heads
        per = self.geometry.kv_heads_per_rank(self.tp_size)
        if self.tp_size <= h:
            return list(range(rank * per, (rank + 1) * per))
        return [rank * h // self.tp_size]


class BlockLayout(ABC):
    """How warm-up blocks are laid out, keyed and namespaced for one kind of serving
    engine: what its scheduler would open the disk tier with and its workers write."""

    def __init__(self, request: LayoutRequest):
        self.request = request

    @property
    @abstractmethod
    def kv_layout(self) -> KVCacheLayout:
        """One rank's layout of the serving engine's KV cache (the same on every rank);
        fixes the block bytes."""

    def fingerprint(self, config: TieredConfig) -> Fingerprint:
        """The namespace the serving engine computes for ``config`` (by default the one
        ``tiered_kv``'s own specs compute from the layout)."""
        return Fingerprint.from_config(config, self.kv_layout, self.request.tp_size)

    @property
    def disk_ranks(self) -> int:
        """Shards a block has on disk, one per writer: each TP rank writes its own by
        default; a layout whose one writer stores whole rows (every rank's shard in one
        block) has 1. ``pack`` is called for ranks ``0 .. disk_ranks - 1``."""
        return self.request.tp_size

    @abstractmethod
    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Disk keys of a prompt's full chunks from its per-GPU-block prefix hashes."""

    @abstractmethod
    def pack(
        self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], rank: int, chunks: Sequence[int], out: torch.Tensor
    ) -> None:
        """Write disk rank ``rank``'s bytes of the prompt's chunks ``chunks`` (indices)
        into ``out[i, :bytes_per_block]`` (uint8 ``(len(chunks), stride)``, zeroed); ``kv``
        is the prompt's per-layer ``(K, V)``, each ``(num_kv_heads, tokens, head_dim)``."""


class KvFirstLayout(BlockLayout):
    """``tiered_kv``'s engine-agnostic layout: per layer ``layer.<i>`` a tensor
    ``(2, num_blocks, gpu_block_size, kv_heads_per_rank, head_dim)`` in the model's
    dtype; a chunk's key is the prefix hash of its last GPU block."""

    @property
    def kv_layout(self) -> KVCacheLayout:
        r = self.request
        shape = (2, r.block_size_factor, r.gpu_block_size, r.geometry.kv_heads_per_rank(r.tp_size), r.geometry.head_dim)
        layers = tuple(LayerLayout(f"layer.{i}", shape, True) for i in range(r.geometry.num_layers))
        return KVCacheLayout(layers, r.dtype, r.gpu_block_size, r.block_size_factor)

    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        return chunk_keys(block_hashes, self.request.block_size_factor)

    def pack(self, kv, rank, chunks, out) -> None:
        r = self.request
        heads = torch.tensor(r.rank_heads(rank))
        ntok = (max(chunks) + 1) * r.chunk_tokens
        tensors = []
        for k, v in kv:
            both = torch.stack([k.index_select(0, heads)[:, :ntok], v.index_select(0, heads)[:, :ntok]])
            # (2, heads, tokens, dim) -> (2, kernel blocks, block tokens, heads, dim)
            both = both.permute(0, 2, 1, 3).reshape(2, ntok // r.gpu_block_size, r.gpu_block_size, len(heads), -1)
            tensors.append(both.to(r.dtype).contiguous())
        f = r.block_size_factor
        ids = np.asarray(chunks, dtype=np.int64)[:, None] * f + np.arange(f, dtype=np.int64)
        pack_blocks(tensors, self.kv_layout, ids, out)


#: Block layouts by name: ``name -> factory(LayoutRequest) -> BlockLayout``.
BLOCK_LAYOUTS: dict[str, Callable[[LayoutRequest], BlockLayout]] = {"kv-first": KvFirstLayout}


def register_block_layout(name: str, factory: Callable[[LayoutRequest], BlockLayout]) -> None:
    """Make ``factory`` selectable as ``--layout name``."""
    BLOCK_LAYOUTS[name] = factory
