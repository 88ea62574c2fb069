"""A ``TieredDiskTier`` entry of vLLM's ``secondary_tiers``: its keys checked, and the
disk namespace of vLLM's CPU-tier rows (``chunk_layout``, ``chunk_fingerprint``,
``tier_fingerprint``).

Runs in vLLM's scheduler process, when the tier is built (``secondary_tier.py`` says
what a chunk is on disk and why each fingerprint field is there), and in the operator's
process, where ``tiered-kv warmup`` and ``inspect`` compute the same namespace without an
engine (``tiered_kv.ops.warmup.vllm_rows``): both call ``tier_fingerprint``, so the tier
and the tools cannot drift apart. Validation and arithmetic only; no I/O except
``tier_fingerprint``'s weights digest (``common.vllm_model_identity``); naming the
attention backend may ask vLLM's attention selector (``common.vllm_attention_backend``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.kv_offload.base import Locality
from vllm.v1.kv_offload.config import OffloadingConfig

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.integrations.vllm.common import (
    VllmModelIdentity,
    attention_backend_name,
    check_hash_algorithm,
    find_vllm_config,
    vllm_attention_backend,
    vllm_model_identity,
)
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout


def parse_locality(value: Any) -> Locality | None:
    if value is None:
        return None
    try:
        return Locality(str(value).upper())
    except ValueError:
        raise ConfigError(f"locality: expected LOCAL or REMOTE, got {value!r}") from None


def chunk_layout(tokens_per_chunk: int, stride: int) -> KVCacheLayout:
    """The disk tier's view of one vLLM chunk: a single uint8 pseudo-layer of ``stride``
    bytes, one offloaded block of ``tokens_per_chunk`` tokens."""
    return KVCacheLayout(
        (LayerLayout("vllm_cpu_chunk", (1, stride), False),),
        torch.uint8,
        gpu_block_size=tokens_per_chunk,
        block_size_factor=1,
    )


def chunk_fingerprint(
    config: OffloadingConfig,
    stride: int,
    cfg: TieredConfig,
    *,
    identity: VllmModelIdentity,
    hash_seed: str,
    attention_backend: str,
    replicated_layout: bool = False,
) -> Fingerprint:
    """The namespace key of vLLM CPU-tier rows of ``stride`` bytes (module docstring),
    every engine-dependent field resolved by the caller (``tier_fingerprint``): the
    model's ``identity``, the prefix-hash seed and the attention backend whose kernels
    write the pages the rows hold."""
    p = config.parallel
    groups = config.groups
    tokens_per_block = max((g.tokens_per_block for g in groups), default=config.cache.tokens_per_hash)
    geometry: tuple[tuple[str, tuple[int, ...]], ...] = (
        ("vllm_cpu_chunk", (int(stride), int(config.worker_kv_bytes_per_block), int(config.cache.blocks_per_chunk))),
    )
    geometry += tuple(
        (
            f"kv_group{g.group_id}",
            (int(g.tokens_per_block), len(g.layer_names), int(g.sliding_window_size_in_chunks or 0)),
        )
        for g in groups
    )
    row_format = (
        f"tp={p.tp_size}",
        f"pp={p.pp_size}",
        f"pcp={p.pcp_size}",
        f"dcp={p.dcp_size}",
        f"world={p.world_size}",
        f"replicated={bool(replicated_layout)}",
        f"canonical={bool(config.canonical_layout)}",
        f"kv_cache_layout={config.kv_cache_layout}",
    )
    return Fingerprint(
        model_id=identity.model_id,
        model_revision=identity.model_revision,
        dtype=str(config.model.dtype),
        block_size=tokens_per_block * config.cache.blocks_per_chunk,
        gpu_block_size=tokens_per_block,
        layer_geometry=geometry,
        kv_layout=row_format,
        tp_size=1,
        hash_algorithm=cfg.hash_algorithm,
        hash_seed=str(hash_seed),
        weights_digest=identity.weights_digest,
        model_settings=identity.model_settings,
        attention_backend=attention_backend,
    )


def tier_fingerprint(
    config: OffloadingConfig,
    stride: int,
    cfg: TieredConfig,
    tier_config: Mapping[str, Any],
    *,
    replicated_layout: bool = False,
    vllm_config: Any | None = None,
    attention_backend: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Fingerprint:
    """The namespace ``TieredDiskTier`` opens for the entry ``tier_config`` (``cfg``: it
    parsed) under vLLM's ``OffloadingConfig`` ``config`` with CPU-tier rows of ``stride``
    bytes; the one function the tier (at start-up) and the tools (offline) compute it
    with. ``vllm_config``: the engine's, default ``common.find_vllm_config()``.

    - the model's identity as vLLM's scheduler resolves it (``model_id`` where the entry
      sets one, else vLLM's ``--model``; ``common.vllm_model_identity``);
    - the hash seed it runs with: the entry's ``hash_seed`` where set, else
      ``PYTHONHASHSEED`` of ``env`` (default ``os.environ``), as vLLM seeds its prefix
      hashes;
    - the attention backend: ``attention_backend`` where given (a server computed
      offline; checked against vLLM's names), else the one every process of the engine
      names (``common.vllm_attention_backend`` over the KV groups' layers).

    Raises ``ConfigError`` naming ``model_path``, an unknown backend, or layers loaded
    here that run another backend than the namespace would name."""
    vc = vllm_config if vllm_config is not None else find_vllm_config()
    identity = vllm_model_identity(config.model.name, cfg, tier_config, vc)
    env = os.environ if env is None else env
    if attention_backend is not None:
        backend = attention_backend_name(attention_backend)
    else:
        backend = vllm_attention_backend(vc, [name for g in config.groups for name in g.layer_names])
    return chunk_fingerprint(
        config,
        stride,
        cfg,
        identity=identity,
        hash_seed=cfg.hash_seed if "hash_seed" in tier_config else env.get("PYTHONHASHSEED", ""),
        attention_backend=backend,
        replicated_layout=replicated_layout,
    )


def check_tier_hash_algorithm(cfg: TieredConfig) -> None:
    """``hash_algorithm`` of a tier entry against vLLM's (``common.check_hash_algorithm``)."""
    check_hash_algorithm(
        cfg, fix="in the tier entry", unseeded="chunks written to the disk tier will never hit after a restart"
    )
