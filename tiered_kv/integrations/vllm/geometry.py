"""``TieredOffloadingSpec``'s config and geometry: ``kv_connector_extra_config`` parsed
and checked, and vLLM's offloading geometry in our units (``VllmGeometry``, with the disk
namespace fingerprint).

Built in every process of an engine (the scheduler, each worker, the API server) from
the same ``OffloadingConfig``, so they agree without talking (``spec.py`` says how
vLLM's units map onto ours). Arithmetic and validation; its one I/O is reading the
weights digest of the model directory vLLM loads (``common.vllm_model_identity``).
The attention backend the namespace names is vLLM's selection for the model on this
host in every process (the scheduler has no attention layers to ask), checked against
the layers where they are loaded (``common.vllm_attention_backend``); computed without
an engine (``offline_geometry``), it is the operator's to give. The scheduler side
(``manager.py``) and the worker side (``worker.py``) take what is built here; nothing
here imports either.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, compute_layout_strides
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmKVCacheLayout
from vllm.v1.kv_offload.config import OffloadingConfig

from tiered_kv.config import ConfigError, TieredConfig, format_size
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.format.namespace import slot_size_for
from tiered_kv.integrations.vllm.common import (
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_MLA_ATTENTION_BACKEND,
    attention_backend_name,
    check_hash_algorithm,
    configured_attention_backend,
    find_vllm_config,
    selected_attention_backend,
    vllm_attention_backend,
    vllm_model_identity,
)
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.vllm_extra import parse_extra_config
from tiered_kv.memory.device import host_memory_limit

logger = logging.getLogger(__name__)


def check_extra_hash_algorithm(cfg: TieredConfig) -> None:
    """``hash_algorithm`` of ``TieredOffloadingSpec`` against vLLM's (``common.check_hash_algorithm``)."""
    check_hash_algorithm(
        cfg,
        fix="so the disk cache is keyed by the hashes vLLM computes",
        unseeded="chunks on the disk tier will never hit after a restart, nor the shared tier's on another node",
    )


@dataclass(frozen=True)
class VllmGeometry:
    """Our view of vLLM's offloading geometry, identical in every process of an engine."""

    tokens_per_block: int
    blocks_per_chunk: int
    #: KV bytes of one GPU block on one worker (all offloaded layers).
    worker_bytes_per_block: int
    rank: int
    world_size: int
    num_cpu_slots: int
    fingerprint: Fingerprint

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def bytes_per_chunk(self) -> int:
        """One chunk on one rank: a CPU slot, and a disk block before 4 KiB padding."""
        return self.worker_bytes_per_block * self.blocks_per_chunk

    def scheduler_layout(self) -> KVCacheLayout:
        """The chunk as the scheduler sees it: one int8 pseudo-layer of the per-rank bytes
        of a GPU block (the worker's real layout has the same bytes per chunk)."""
        layer = LayerLayout("vllm_worker_block", (1, self.worker_bytes_per_block), False)
        return KVCacheLayout((layer,), torch.int8, self.tokens_per_block, self.blocks_per_chunk)

    @classmethod
    def from_config(
        cls,
        config: OffloadingConfig,
        cfg: TieredConfig,
        extra: Mapping[str, Any],
        *,
        attention_backend: str | None = None,
    ) -> "VllmGeometry":
        """Derive the geometry; raises ``ConfigError`` when it cannot hold a chunk.
        ``attention_backend``: the backend the namespace names (``offline_geometry``);
        None: the engine's (``common.vllm_attention_backend``)."""
        if not config.groups:
            raise ConfigError("vLLM offers no KV-cache group to offload")
        if config.worker_kv_bytes_per_block <= 0:
            raise ConfigError(
                "vLLM reports no KV bytes per GPU block (worker_kv_bytes_per_block=0) "
                "for this KV-cache configuration; TieredOffloadingSpec cannot size "
                "its tiers for it"
            )
        p = config.parallel
        if not 0 <= p.rank < p.world_size:
            raise ConfigError(f"vLLM rank {p.rank} is outside its world size {p.world_size}")
        tokens_per_block = config.groups[0].tokens_per_block
        bpc = config.cache.blocks_per_chunk
        if cfg.block_size is not None and any(cfg.block_size != g.tokens_per_block * bpc for g in config.groups):
            raise ConfigError(
                f"block_size: {cfg.block_size} tokens does not match vLLM's chunk of "
                f"{bpc} GPU blocks of {tokens_per_block} tokens"
            )
        if p.pp_size > 1 and len(set(stages := pipeline_stage_layers(p.pp_size) or ())) > 1:
            raise ConfigError(
                f"pipeline_parallel_size {p.pp_size} splits the model's layers into stages of "
                f"{', '.join(map(str, stages))} layers: TieredOffloadingSpec sizes every rank's tiers by one "
                f"chunk's bytes, so its stages must hold equally many layers (a pipeline size that divides "
                f"the layers, or VLLM_PP_LAYER_PARTITION)"
            )
        bytes_per_chunk = config.worker_kv_bytes_per_block * bpc
        num_cpu_slots = cfg.cpu_bytes // bytes_per_chunk
        if num_cpu_slots < 1:
            raise ConfigError(
                f"cpu_bytes: {format_size(cfg.cpu_bytes)} per rank holds no chunk; one "
                f"chunk is {format_size(bytes_per_chunk)} per rank ({bpc} GPU blocks of "
                f"{config.worker_kv_bytes_per_block} bytes); expected at least that"
            )
        if num_cpu_slots * bytes_per_chunk > (limit := host_memory_limit()):
            raise ConfigError(
                f"cpu_bytes: {format_size(cfg.cpu_bytes)} per rank is more than this process may use "
                f"({format_size(limit)} of memory here); expected at most that"
            )
        for entry in cfg.tiers_of_type("disk"):
            if p.world_size > 64:
                raise ConfigError(
                    f"{entry.setting_key('path')}: the disk tier keeps one shard per rank and supports at "
                    f"most 64 ranks; this engine has {p.world_size}"
                )
            if entry.settings.bytes < slot_size_for(bytes_per_chunk):
                raise ConfigError(
                    f"{entry.setting_key('bytes')}: {format_size(entry.settings.bytes)} per rank holds no chunk; "
                    f"one disk slot is {format_size(slot_size_for(bytes_per_chunk))}"
                )
        return cls(
            tokens_per_block,
            bpc,
            config.worker_kv_bytes_per_block,
            p.rank,
            p.world_size,
            num_cpu_slots,
            _fingerprint(config, cfg, extra, attention_backend),
        )


def pipeline_stage_layers(pp_size: int) -> tuple[int, ...] | None:
    """The layers of each pipeline stage as vLLM splits the engine's model
    (``get_pp_indices``: ``VLLM_PP_LAYER_PARTITION``, else as even as it goes), or None
    without an engine config (a spec built by hand)."""
    from vllm.distributed.utils import get_pp_indices

    vc = find_vllm_config()
    if vc is None or vc.model_config is None:
        return None
    total = vc.model_config.get_total_num_hidden_layers()
    return tuple(end - start for start, end in (get_pp_indices(total, r, pp_size) for r in range(pp_size)))


def attention_page_view(
    pages: torch.Tensor, layer: int, num_layers: int, shape: tuple[int, int, int], dtype: torch.dtype, layout: str
) -> torch.Tensor:
    """The worker's page geometry: layer ``layer`` of ``num_layers`` held in a canonical
    ``(num_blocks, page)`` int8 tensor, viewed as vLLM's logical ``(B, H, N, C)`` attention
    cache (``shape``: ``(H, N, C)`` in elements of ``dtype``), assuming pages in vLLM's
    KV-cache layout ``layout`` (a ``KVCacheLayout`` name: the one vLLM reports and the disk
    namespace records). Strides come from vLLM's own ``compute_layout_strides``; the
    block stride is the tensor's (padding and packed layers included). Several layers in
    one tensor are vLLM's block-outermost (packed) layouts."""
    heads, tokens, content = shape
    itemsize = torch.empty(0, dtype=dtype).element_size()
    spec = FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=content, head_size_v=0, dtype=dtype)
    num_blocks = pages.shape[0]
    strides = compute_layout_strides(
        spec, num_blocks, num_layers, VllmKVCacheLayout[layout], fixed_strides=(None, pages.stride(0), None, None, None)
    )
    view = torch.as_strided(
        pages,
        (num_layers, num_blocks, heads, tokens, content * itemsize),
        strides,
        storage_offset=pages.storage_offset(),
    )
    return view[layer].view(dtype)


def kv_content(content: int, head_size: int) -> tuple[slice, slice]:
    """Where K and V sit in the content axis of an attention page cell (``content``
    elements): K's ``head_size`` elements, then V's, as vLLM's ``AttentionSpec`` sizes
    a cell (``head_size + head_size_v``)."""
    return slice(0, head_size), slice(head_size, content)


def offline_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, attention_backend: str | None = None
) -> VllmGeometry:
    """The geometry (and disk namespace fingerprint) ``TieredOffloadingSpec`` computes on
    rank ``vllm_config.parallel_config.rank`` of an engine with these configs, without
    the engine: vLLM's own ``build_offloading_config`` makes the ``OffloadingConfig``
    its connector would hand the spec, and the spec's own parsing, hash check and
    ``VllmGeometry.from_config`` run on it with ``vllm_config`` current (as in a
    worker). ``kv_cache_config``: what vLLM's planner would allocate (its
    ``worker_kv_bytes_per_block`` and groups are read, not its block count).

    The server's attention backend (``offline_attention_backend``): ``attention_backend``,
    else ``vllm_config``'s ``--attention-backend``, else vLLM's choice on this host,
    else ``DEFAULT_ATTENTION_BACKEND``; the KV-cache layout recorded in ``vllm_config``
    must be one that backend supports. Raises ``ConfigError`` as the spec would at
    start-up, or naming a backend and layout vLLM would not combine; reads the weights
    digest of the model directory (``common.vllm_model_identity``)."""
    if vllm_config.kv_transfer_config is None:
        raise ConfigError("the vLLM config has no kv_transfer_config: no offloading spec would be built")
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config)
    backend = offline_attention_backend(vllm_config, attention_backend)
    layout = vllm_config.cache_config.kv_cache_layout
    if layout is not None and (supported := backend_kv_cache_layouts(backend)) and layout not in supported:
        raise ConfigError(
            f"kv_cache_layout: {layout} is not a layout the {backend} attention backend reads (it reads "
            f"{', '.join(supported)}); vLLM would not run that backend over it"
        )
    with set_current_vllm_config(vllm_config):
        try:
            offloading = build_offloading_config(vllm_config, kv_cache_config)
        except (AssertionError, ValueError) as e:
            raise ConfigError(f"vLLM refuses this offloading config: {e}") from None
        cfg = parse_extra_config(extra)
        check_extra_hash_algorithm(cfg)
        return VllmGeometry.from_config(offloading, cfg, extra, attention_backend=backend)


def offline_attention_backend(vllm_config: VllmConfig | None = None, given: str | None = None) -> str:
    """The attention backend of a server computed without it (``offline_geometry``,
    ``tiered-kv config``): ``given`` (checked against vLLM's names), else
    ``vllm_config``'s ``--attention-backend``, else what vLLM selects for that model on
    this host, else ``DEFAULT_ATTENTION_BACKEND`` (``DEFAULT_MLA_ATTENTION_BACKEND`` for
    an MLA model). Raises ``ConfigError`` for a name vLLM does not know."""
    if given:
        return attention_backend_name(given)
    if vllm_config is not None:
        found = configured_attention_backend(vllm_config) or selected_attention_backend(vllm_config)
        if found:
            return found
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return DEFAULT_MLA_ATTENTION_BACKEND
    return DEFAULT_ATTENTION_BACKEND


def backend_kv_cache_layouts(attention_backend: str) -> tuple[str, ...]:
    """The KV-cache layouts (vLLM's ``KVCacheLayout`` names) the backend declares it
    reads, most preferred first; empty where it declares none (any layout; vLLM then
    prefers ``LBNHC``) or does not import here."""
    cls = _backend_class(attention_backend)
    layouts = cls.supported_kv_cache_layouts() if cls is not None else None
    return tuple(layout.name for layout in layouts or ())


def backend_kv_cache_layout(attention_backend: str, requested: str | None = None) -> str:
    """The KV-cache layout vLLM's engine core resolves for a model whose attention
    layers all use ``attention_backend``: ``requested`` (its ``VLLM_KV_CACHE_LAYOUT``;
    ``NHD``/``HND`` name ``LBNHC``/``LBHNC``) where the backend reads it, else the
    backend's first choice (vLLM's ``get_supported_kv_cache_layouts``). Raises
    ``ConfigError`` for a requested layout the backend does not read, as vLLM refuses to
    start with it."""
    from vllm.config.cache import _layout_from_name
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    cls = _backend_class(attention_backend)
    candidates = [m.name for m in get_supported_kv_cache_layouts([cls])] if cls is not None else []
    if requested is None:
        return candidates[0] if candidates else "LBNHC"
    try:
        layout = _layout_from_name(requested.strip().upper()).name
    except ValueError as e:
        raise ConfigError(f"kv_cache_layout: {e}") from None
    if candidates and layout not in candidates:
        raise ConfigError(
            f"kv_cache_layout: {requested} is not a layout the {attention_backend} attention backend reads "
            f"(it reads {', '.join(candidates)})"
        )
    return layout


def _backend_class(attention_backend: str) -> Any | None:
    """vLLM's class of the backend, or None where its module does not import here."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    # Without Triton, torch warns for every kernel a backend's module registers: noise on
    # an operator's terminal, and nothing the layouts read here depend on.
    triton_log = logging.getLogger("torch._library.triton")
    level = triton_log.level
    triton_log.setLevel(logging.ERROR)
    try:
        return AttentionBackendEnum[attention_backend].get_class()
    except Exception as e:  # a backend's module may need kernels or libraries this host lacks
        logger.debug("attention backend %s does not import here: %s", attention_backend, e)
        return None
    finally:
        triton_log.setLevel(level)


def _fingerprint(
    config: OffloadingConfig, cfg: TieredConfig, extra: Mapping[str, Any], attention_backend: str | None
) -> Fingerprint:
    p = config.parallel
    bpc = config.cache.blocks_per_chunk
    geometry: tuple[tuple[str, tuple[int, ...]], ...] = (
        ("vllm_worker_block", (int(config.worker_kv_bytes_per_block),)),
    )
    for g in config.groups:
        shape = (int(g.tokens_per_block), int(g.sliding_window_size_in_chunks or 0))
        if p.pp_size > 1:
            # Each pipeline stage's worker offers its own layers, the scheduler stage 0's
            # (vLLM's scheduler KV-cache config is one worker's): a stage's layer names
            # would give each stage a namespace of its own. The stages' layer counts
            # (``pp_layers``) and the model's identity say which layers each rank holds.
            geometry += ((f"kv_group{g.group_id}", shape),)
            continue
        names = hashlib.sha256("\n".join(g.layer_names).encode()).hexdigest()[:16]
        geometry += ((f"kv_group{g.group_id}:{len(g.layer_names)}_layers:{names}", shape),)
    layout: tuple[str, ...] = (
        f"kv_cache_layout={config.kv_cache_layout}",
        f"tp={p.tp_size}",
        f"pp={p.pp_size}",
        f"pcp={p.pcp_size}",
        f"dcp={p.dcp_size}",
        "pages=per_rank",
    )
    if p.pp_size > 1:
        layout += (f"pp_layers={','.join(map(str, pipeline_stage_layers(p.pp_size) or ('unknown',)))}",)
    if p.data_parallel_size > 1:
        # Each DP replica is its own engine and writer: give it its own namespace.
        layout += (f"dp_replica={p.data_parallel_index}/{p.data_parallel_size}",)
    ident = vllm_model_identity(config.model.name, cfg, extra)
    if attention_backend is None:
        layer_names = [name for g in config.groups for name in g.layer_names]
        attention_backend = vllm_attention_backend(find_vllm_config(), layer_names)
    seed = cfg.hash_seed if "hash_seed" in extra else os.environ.get("PYTHONHASHSEED", "")
    tokens_per_block = config.groups[0].tokens_per_block
    return Fingerprint(
        model_id=ident.model_id,
        model_revision=ident.model_revision,
        dtype=str(config.model.dtype),
        block_size=tokens_per_block * bpc,
        gpu_block_size=tokens_per_block,
        layer_geometry=geometry,
        kv_layout=layout,
        tp_size=p.world_size,
        hash_algorithm=cfg.hash_algorithm,
        hash_seed=seed,
        weights_digest=ident.weights_digest,
        model_settings=ident.model_settings,
        attention_backend=attention_backend,
    )
