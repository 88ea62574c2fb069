"""The ``vllm`` block layout: warm-up blocks as ``TieredOffloadingSpec`` under vLLM 0.33
stores them, in the namespace that spec computes for the same model, dtype, TP size,
GPU block size, attention backend and config.

Runs in the operator's process (``tiered-kv warmup``). Imports vLLM (config classes
only; no engine, no GPU) and reads the model directory's ``config.json`` and a bounded
sample of its weights (the digest, ``tiered_kv.model_identity``); writes nothing.

What vLLM does, and what is reproduced here:

- the namespace: ``integrations.vllm.geometry.offline_geometry`` runs vLLM's own
  ``build_offloading_config`` and the spec's own geometry code on the ``VllmConfig``
  a server would have (``server_vllm_config``) and the KV-cache config vLLM's planner
  gives a standard decoder (``decoder_kv_cache_config``: one full-attention group over
  every layer, each layer's pages in its own region), so every fingerprint field
  (worker-block and ``kv_group`` geometry, ``kv_cache_layout``, TP, model identity
  with the weights digest of the model directory and ``model_settings``, the
  attention backend) is the server's.
- the page order: the server's attention backend (``--attention-backend``, else vLLM's
  choice for the model on this host, else ``FLASH_ATTN``: ``server_page_order``, as
  ``tiered-kv config`` computes it) and the KV-cache layout vLLM's engine core resolves
  for it (``geometry.backend_kv_cache_layout``: ``VLLM_KV_CACHE_LAYOUT`` where the
  backend reads it, else the backend's first choice). Both are in the namespace.
- a chunk's bytes on one rank: for each layer in order (vLLM's canonical tensors, one
  per layer, ``(num_gpu_blocks, page_size_bytes)`` int8), its ``blocks_per_chunk``
  pages back to back. A page is one GPU block of one layer: vLLM's logical
  ``[kv_heads, block_size, 2 * head_dim]`` with each token's key then value in the last
  axis (FlashAttention and Triton attention split it so: ``PAGE_READERS``), stored in
  the order the resolved ``kv_cache_layout`` gives (``LBNHC``, vLLM's default where the
  backend declares none, as FlashAttention does: tokens outer, heads inner; ``LBHNC``:
  heads outer).
- TP: rank ``r`` holds KV heads ``r*H/tp .. (r+1)*H/tp - 1``; with more ranks than
  heads, head ``r*H//tp`` (vLLM's replication).
- keys: vLLM's ``OffloadKey`` of a chunk, its last GPU block's prefix hash plus the
  KV-group index 0.

Refused, with the reason: architectures whose vLLM attention layer names are not
known here, sliding-window attention, quantized weights, LongRoPE position encoding
(vLLM fixes its factors by ``--max-model-len``, transformers by each prompt's length),
block-outermost layouts
(``BL*``), and pages for an attention backend outside ``PAGE_READERS``
(``check_page_order``). vLLM's CPU attention backend, for one, reads an ``LBHNC`` page as
each head's ``block_size`` keys then its ``block_size`` values and writes it with its
own per-ISA kernel; its server names ``CPU_ATTN`` in its namespace, so its namespace
can be computed here (``server_fingerprint``) but its pages are not written.
"""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Mapping, Sequence
from functools import cached_property

import numpy as np
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_offload.base import make_offload_key

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.integrations.vllm.common import (
    attention_backend_name,
    configured_attention_backend,
    longrope_factors,
    rope_parameter_sets,
)
from tiered_kv.integrations.vllm.geometry import (
    VllmGeometry,
    backend_kv_cache_layout,
    offline_attention_backend,
    offline_geometry,
)
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.memory.host_memory import pack_blocks
from tiered_kv.ops.hashing import chunk_keys
from tiered_kv.ops.warmup.errors import WarmupError
from tiered_kv.ops.warmup.layouts import BlockLayout, LayoutRequest, VllmServe

#: vLLM's attention layer names per architecture: ``{i}`` is the layer index.
ATTENTION_LAYER_NAMES = {
    arch: "model.layers.{i}.self_attn.attn"
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
}

#: Page layouts written (vLLM's ``KVCacheLayout`` names): the physical order of one
#: page's logical ``[heads, tokens, K|V]``; legacy aliases as vLLM reads them.
PAGE_ORDERS = {"LBNHC": "tokens, heads", "LBHNC": "heads, tokens"}
LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
#: Attention backends whose kernels read a page as the warm-up writes it: per token and
#: KV head the key then the value along the last axis, ``split(head_size, dim=-1)``
#: (vLLM 0.33's ``flash_attn.py`` and ``triton_attn.py``).
PAGE_READERS = ("FLASH_ATTN", "TRITON_ATTN")


def server_kv_cache_layout(name: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The KV-cache layout asked of a vLLM server: ``name``, else its
    ``VLLM_KV_CACHE_LAYOUT``, else None (the attention backend's choice:
    ``server_page_order``). Raises ``WarmupError`` for a layout the warm-up cannot
    write."""
    env = os.environ if env is None else env
    raw = name or env.get("VLLM_KV_CACHE_LAYOUT")
    if not raw:
        return None
    layout = LAYOUT_ALIASES.get(raw.strip().upper(), raw.strip().upper())
    if layout not in PAGE_ORDERS:
        raise WarmupError(
            f"--kv-cache-layout: expected one of {', '.join(PAGE_ORDERS)} (or NHD/HND), got {raw!r}; "
            "block-outermost layouts interleave layers inside a block, which the warm-up does not write"
        )
    return layout


def _rotated_otherwise(mc: Any, arch: str) -> str | None:
    """Why transformers would rotate this model's keys otherwise than vLLM does, or None:
    LongRoPE (vLLM picks its factors by ``--max-model-len``, transformers by each
    prompt's length), dynamic NTK (transformers rescales by a forward pass's length past
    the trained context, vLLM never) and partial rotation (transformers' default rotary
    embedding turns the whole head)."""
    if (rope := longrope_factors(mc)) is not None:
        return (
            f"longrope: vLLM rotates every key of this LongRoPE model with its {rope} factors (by "
            "--max-model-len), transformers with the ones each prompt's length picks"
        )
    text = mc.hf_text_config
    for p in rope_parameter_sets(text) or [{}]:
        if (p.get("rope_type") or p.get("type")) == "dynamic":
            return (
                "rope_type dynamic: transformers rescales every key's rotation by the length of a forward "
                "pass past the trained context, vLLM never"
            )
        partial = p.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None))
        if (partial is not None and float(partial) != 1.0) or p.get("rope_dim"):
            return (
                f"partial_rotary_factor {partial}: vLLM rotates part of each key, transformers' {arch} the whole head"
            )
    return None


def server_page_order(
    vllm_config: VllmConfig | None,
    attention_backend: str | None = None,
    kv_cache_layout: str | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """The attention backend and KV-cache layout of a vLLM server with ``vllm_config``,
    as ``tiered-kv config`` computes them: ``attention_backend``, else vLLM's choice for
    the model on this host, else ``FLASH_ATTN`` (``geometry.offline_attention_backend``);
    the layout vLLM's engine core resolves for that backend, given ``kv_cache_layout``
    (else ``VLLM_KV_CACHE_LAYOUT`` of ``env``; ``geometry.backend_kv_cache_layout``).
    Raises ``WarmupError`` for a backend vLLM does not know, a layout the warm-up cannot
    write, or a layout the backend does not read (vLLM would not start)."""
    requested = server_kv_cache_layout(kv_cache_layout, env)
    try:
        given = None if attention_backend is None else attention_backend_name(attention_backend, "--attention-backend")
        backend = offline_attention_backend(vllm_config, given)
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    try:
        layout = backend_kv_cache_layout(backend, requested)
    except ConfigError as e:
        raise WarmupError(
            f"--kv-cache-layout: {str(e).removeprefix('kv_cache_layout: ')}; vLLM would not start a {backend} "
            "server over it"
        ) from None
    if layout not in PAGE_ORDERS:
        raise WarmupError(
            f"--attention-backend {backend}: vLLM resolves the {layout} KV-cache layout for it, which the warm-up "
            f"does not write (it writes {', '.join(PAGE_ORDERS)}); give --kv-cache-layout where the backend reads one"
        )
    return backend, layout


def server_vllm_config(serve: VllmServe, *, hash_algorithm: str | None = None) -> VllmConfig:
    """The ``VllmConfig`` of ``serve`` with ``--enable-prefix-caching
    --prefix-caching-hash-algo hash_algorithm`` as far as the offloading spec reads it
    (rank 0), with the KV-cache layout its engine core resolves recorded; the hash
    algorithm defaults to the extra config's ``hash_algorithm``, else vLLM's ``sha256``;
    the attention backend and the layout are ``server_page_order``'s, the backend
    recorded as ``--attention-backend`` is (``recorded_page_order`` reads both back).
    Raises ``WarmupError`` where vLLM rejects a value, or for settings whose KV the hf
    engine cannot compute as vLLM would."""
    extra_config = serve.extra_config
    algo = hash_algorithm or str(extra_config.get("hash_algorithm", "sha256"))
    try:
        vc = VllmConfig(
            # vLLM checks the dtype and hash names itself (its ValueError is caught below).
            model_config=ModelConfig(model=str(serve.model_dir), dtype=serve.dtype, skip_tokenizer_init=True, seed=0),  # type: ignore[arg-type]
            cache_config=CacheConfig(
                block_size=serve.gpu_block_size,
                cache_dtype="auto",
                enable_prefix_caching=True,
                prefix_caching_hash_algo=algo,  # type: ignore[arg-type]
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=serve.tp_size),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=dict(extra_config),
            ),
            device_config=DeviceConfig(device="cpu"),
        )
    except Exception as e:  # vLLM raises pydantic and plain errors alike
        raise WarmupError(f"vLLM rejects these server settings: {one_line(e)}") from None
    backend, layout = server_page_order(vc, serve.attention_backend, serve.kv_cache_layout)
    # Named as --attention-backend would name it, so every later step (the spec's
    # geometry, the tier's fingerprint) reads the same backend without selecting again.
    vc.attention_config.backend = AttentionBackendEnum[backend]
    # What the engine core records once its attention backends agree on a layout.
    record_kv_cache_layout(vc.cache_config, layout)
    mc = vc.model_config
    if mc.quantization:
        raise WarmupError(
            f"quantization: the model is quantized ({mc.quantization}); vLLM's quantized kernels compute "
            "other K/V than transformers, so the warm-up refuses it"
        )
    hf = mc.hf_config
    arch = (getattr(hf, "architectures", None) or ["?"])[0]
    if (rope := _rotated_otherwise(mc, arch)) is not None:
        raise WarmupError(f"{rope}, so the warm-up refuses it")
    if arch not in ATTENTION_LAYER_NAMES:
        raise WarmupError(
            f"architecture {arch}: vLLM's attention layer names for it are not known here "
            f"(known: {', '.join(sorted(ATTENTION_LAYER_NAMES))}), so its namespace cannot be computed"
        )
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
        raise WarmupError(
            f"sliding_window: {hf.sliding_window} in the model's config; vLLM keeps such layers in "
            "their own KV group, which the warm-up does not write"
        )
    return vc


def recorded_page_order(vllm_config: VllmConfig) -> tuple[str, str]:
    """The attention backend and page layout ``server_vllm_config`` recorded for the
    engine, checked to be an order the warm-up writes (``check_page_order``)."""
    backend = configured_attention_backend(vllm_config) or offline_attention_backend(vllm_config)
    layout = str(vllm_config.cache_config.kv_cache_layout)
    check_page_order(backend, layout)
    return backend, layout


def check_page_order(attention_backend: str, kv_cache_layout: str) -> None:
    """Refuse, in one line, pages the warm-up cannot prove a server on
    ``attention_backend`` over ``kv_cache_layout`` reads as the model's K/V: a layout
    outside ``PAGE_ORDERS``, or a backend outside ``PAGE_READERS``."""
    if kv_cache_layout not in PAGE_ORDERS:
        raise WarmupError(
            f"--kv-cache-layout: vLLM's KV-cache layout is {kv_cache_layout!r}; the warm-up writes "
            f"{', '.join(PAGE_ORDERS)} pages"
        )
    if attention_backend not in PAGE_READERS:
        raise WarmupError(
            f"--attention-backend {attention_backend}: the warm-up writes pages as {' and '.join(PAGE_READERS)} read "
            f"them (per token and KV head the key, then the value); it cannot prove {attention_backend} reads "
            f"{kv_cache_layout} pages in that order, so it writes none (warm that server up by sending it the prompts)"
        )


def one_line(e: Exception) -> str:
    """An exception's message on one line (pydantic's spans several; its link is dropped)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
    return "; ".join(lines) or type(e).__name__


def decoder_kv_cache_config(vllm_config: VllmConfig, num_gpu_blocks: int = 1) -> KVCacheConfig:
    """The KV-cache config vLLM 0.33's planner gives a standard decoder on one rank:
    one full-attention group over every layer, one backing allocation with each
    layer's pages in its own region (``KVCacheTensor.size`` is the whole allocation,
    so ``worker_kv_bytes_per_block`` is every layer's page)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        dtype=_resolved(mc.dtype),
    )
    pattern = ATTENTION_LAYER_NAMES[(mc.hf_config.architectures or [""])[0]]
    names = [pattern.format(i=i) for i in range(mc.get_num_layers(pc))]
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_gpu_blocks * len(names), layers=names, layer_stride=page * num_gpu_blocks, block_stride=page
    )
    return KVCacheConfig(
        num_blocks=num_gpu_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def server_fingerprint(serve: VllmServe) -> Fingerprint:
    """The disk namespace ``TieredOffloadingSpec`` computes in ``serve``
    (``server_vllm_config``: the attention backend and the KV-cache layout resolved for
    it included) serving a standard decoder. Computed for any backend vLLM knows; only
    the pages are limited to ``PAGE_READERS``. Raises ``WarmupError`` naming a setting
    it cannot reproduce, or what the spec refuses."""
    vc = server_vllm_config(serve)
    try:
        backend = configured_attention_backend(vc)
        return offline_geometry(vc, decoder_kv_cache_config(vc), attention_backend=backend).fingerprint
    except ConfigError as e:
        raise WarmupError(str(e)) from None


def vllm_model_dtype(model_dir: str, dtype: str = "auto") -> torch.dtype:
    """The dtype vLLM runs ``model_dir`` in for ``--dtype dtype`` (``auto``: vLLM's
    choice on this machine's platform, e.g. bfloat16 for a float32 checkpoint)."""
    try:
        # vLLM checks the dtype name itself (its error is caught below).
        config = ModelConfig(model=str(model_dir), dtype=dtype, skip_tokenizer_init=True)  # type: ignore[arg-type]
        return _resolved(config.dtype)
    except Exception as e:
        raise WarmupError(f"vLLM cannot read the model at {model_dir!r}: {one_line(e)}") from None


class VllmPagesLayout(BlockLayout):
    """Blocks as ``TieredOffloadingSpec`` stores them for a vLLM server with the
    request's settings (module docstring). Raises ``WarmupError`` naming the setting it
    cannot match."""

    def __init__(self, request: LayoutRequest):
        super().__init__(request)
        r = request
        if r.model_dir is None:
            raise WarmupError(
                "--model: the vllm layout needs the model as a local directory (vLLM's namespace "
                "covers its weights digest and reads its config.json)"
            )
        self.vllm_config = server_vllm_config(r.vllm_serve())
        self.attention_backend, self.page_order = recorded_page_order(self.vllm_config)
        mc = self.vllm_config.model_config
        if mc.get_head_size() != r.geometry.head_dim or mc.get_total_num_kv_heads() != r.geometry.num_kv_heads:
            raise WarmupError(
                f"the model vLLM reads at {r.model_dir} has {mc.get_total_num_kv_heads()} KV heads of "
                f"{mc.get_head_size()}, the engine's {r.geometry.num_kv_heads} of {r.geometry.head_dim}"
            )
        try:
            self.geometry: VllmGeometry = offline_geometry(
                self.vllm_config, decoder_kv_cache_config(self.vllm_config), attention_backend=self.attention_backend
            )
        except ConfigError as e:
            raise WarmupError(str(e)) from None
        if self.geometry.blocks_per_chunk != r.block_size_factor:
            raise WarmupError(
                f"block_size: vLLM's chunk is {self.geometry.blocks_per_chunk} GPU blocks, "
                f"the warm-up's {r.block_size_factor}"
            )
        self.heads_per_rank = r.geometry.kv_heads_per_rank(r.tp_size)
        self.page_bytes = 2 * self.heads_per_rank * r.gpu_block_size * r.geometry.head_dim * r.dtype.itemsize

    @cached_property
    def kv_layout(self) -> KVCacheLayout:
        """The scheduler's layout (one int8 pseudo-layer, the same bytes per chunk as the
        workers' canonical tensors), as the spec's manager opens the namespace."""
        return self.geometry.scheduler_layout()

    def fingerprint(self, config: TieredConfig) -> Fingerprint:
        return self.geometry.fingerprint

    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        return [bytes(make_offload_key(k, 0)) for k in chunk_keys(block_hashes, self.request.block_size_factor)]

    def pages(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], rank: int, num_blocks: int) -> list[torch.Tensor]:
        """Rank ``rank``'s pages of the prompt's first ``num_blocks`` GPU blocks
        (``rank_pages``)."""
        return rank_pages(self.request, self.page_order, kv, rank, num_blocks)

    def pack(self, kv, rank, chunks, out) -> None:
        pack_rank_chunks(self.request, self.page_order, kv, rank, chunks, out)


def rank_pages(
    request: LayoutRequest,
    page_order: str,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    num_blocks: int,
) -> list[torch.Tensor]:
    """TP rank ``rank``'s pages of the prompt's first ``num_blocks`` GPU blocks: per layer
    an int8 ``(num_blocks, page_size_bytes)`` tensor, as vLLM's canonical tensors hold
    them in ``page_order`` (module docstring). ``kv``: the prompt's per-layer ``(K, V)``,
    each ``(num_kv_heads, tokens, head_dim)``."""
    r = request
    heads = torch.tensor(r.rank_heads(rank))
    ntok = num_blocks * r.gpu_block_size
    page_bytes = 2 * len(heads) * r.gpu_block_size * r.geometry.head_dim * r.dtype.itemsize
    out = []
    for k, v in kv:
        both = torch.cat([k.index_select(0, heads)[:, :ntok], v.index_select(0, heads)[:, :ntok]], dim=-1)
        # (heads, tokens, 2D) -> (blocks, heads, block tokens, 2D): vLLM's logical page
        page = both.reshape(len(heads), num_blocks, r.gpu_block_size, -1).permute(1, 0, 2, 3)
        if page_order == "LBNHC":
            page = page.permute(0, 2, 1, 3)
        out.append(page.to(r.dtype).contiguous().view(torch.int8).reshape(num_blocks, page_bytes))
    return out


def pack_rank_chunks(
    request: LayoutRequest,
    page_order: str,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    chunks: Sequence[int],
    out: torch.Tensor,
) -> None:
    """Write TP rank ``rank``'s bytes of the prompt's chunks ``chunks`` into
    ``out[i, :rank bytes]``: per layer in order, the chunk's ``block_size_factor`` pages
    back to back (``rank_pages``), as vLLM's CPU worker copies a chunk out of its
    canonical tensors."""
    r = request
    f = r.block_size_factor
    tensors = rank_pages(r, page_order, kv, rank, (max(chunks) + 1) * f)
    layout = KVCacheLayout(
        tuple(LayerLayout(f"vllm_kv_tensor{i}", tuple(t.shape), False) for i, t in enumerate(tensors)),
        torch.int8,
        r.gpu_block_size,
        f,
    )
    ids = np.asarray(chunks, dtype=np.int64)[:, None] * f + np.arange(f, dtype=np.int64)
    pack_blocks(tensors, layout, ids, out)


def _resolved(dtype: object) -> torch.dtype:
    """A ``ModelConfig``'s dtype, which vLLM resolves from the name it was given."""
    if not isinstance(dtype, torch.dtype):
        raise WarmupError(f"vLLM left the model's dtype unresolved ({dtype!r})")
    return dtype
