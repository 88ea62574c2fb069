"""A ``TieredDiskTier`` entry of vLLM's ``secondary_tiers``: its keys checked, and the
disk namespace of vLLM's CPU-tier rows (``chunk_layout``, ``chunk_fingerprint``,
``tier_fingerprint``).

Runs in vLLM's scheduler process, when the tier is built (``secondary_tier.py`` says
what a chunk is on disk and why each fingerprint field is there), and in the operator's
process, where ``tiered-kv warmup`` computes the same namespace without an engine
(``tiered_kv.ops.warmup.vllm_rows``). Validation and arithmetic only; no I/O except
``tier_fingerprint``'s weights digest (``common.vllm_model_identity``).
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
from tiered_kv.integrations.vllm.common import VllmModelIdentity, check_hash_algorithm, vllm_model_identity
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout

#: Keys of a ``secondary_tiers`` entry that belong to vLLM (its factory reads them).
VLLM_TIER_KEYS = ("type", "module_path", "locality", "backpressure")

#: Our own keys that mean nothing under vLLM's tiering spec, and what to do instead.
_NOT_FOR_A_SECONDARY_TIER = {
    "remote": "the shared tier is not a part of this disk tier; it runs under TieredOffloadingSpec",
    "tiers": "this entry is one disk tier; list more tiers under TieredOffloadingSpec, or add "
    "another secondary_tiers entry",
    "cpu_bytes": "the CPU tier is vLLM's here; size it with cpu_bytes_to_use in kv_connector_extra_config",
    "write_policy": "vLLM copies every chunk that reaches its CPU tier to every secondary "
    "tier (write-through); there is no other policy",
    "promote_on_hit": "vLLM always promotes a secondary-tier hit into its CPU tier",
    "block_size": "the chunk size is vLLM's; set block_size in kv_connector_extra_config, not inside the tier entry",
    "gpu_copy": "vLLM's own handlers move bytes between the GPU and its CPU tier here",
}


def parse_tier_config(raw: Mapping[str, Any]) -> TieredConfig:
    """Validate one ``secondary_tiers`` entry (with or without vLLM's ``type`` and
    ``module_path``). Our keys use human units as in ``TieredConfig``; vLLM's keys
    (``VLLM_TIER_KEYS``) pass through. Raises ``ConfigError`` naming an unknown key, a
    bad value, a key that has no meaning here, or a missing ``disk_path``."""
    cfg = TieredConfig.from_dict(raw, passthrough_keys=VLLM_TIER_KEYS)
    for key, why in _NOT_FOR_A_SECONDARY_TIER.items():
        if key in raw:
            raise ConfigError(f"{key}: not a setting of the TieredDiskTier secondary tier: {why}")
    if cfg.tiers_of_type("disk") != cfg.tiers:
        raise ConfigError("tiers: not a setting of the TieredDiskTier secondary tier: it is one disk tier, disk_path")
    if cfg.disk_tier is None:
        raise ConfigError(
            "disk_path: required; the directory (on local NVMe) that holds the "
            'disk tier, e.g. "disk_path": "/mnt/nvme/tiered-kv"'
        )
    return cfg


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
    replicated_layout: bool = False,
    model_id: str | None = None,
    hash_seed: str | None = None,
    identity: VllmModelIdentity | None = None,
) -> Fingerprint:
    """The namespace key of vLLM CPU-tier rows of ``stride`` bytes (module docstring).
    ``model_id``/``hash_seed`` override ``cfg``'s (callers resolve the defaults);
    ``identity`` gives the model's revision, weights
    digest and settings."""
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
        model_id=str(model_id if model_id is not None else cfg.model_id),
        model_revision=identity.model_revision if identity is not None else cfg.model_revision,
        dtype=str(config.model.dtype),
        block_size=tokens_per_block * config.cache.blocks_per_chunk,
        gpu_block_size=tokens_per_block,
        layer_geometry=geometry,
        kv_layout=row_format,
        tp_size=1,
        hash_algorithm=cfg.hash_algorithm,
        hash_seed=str(hash_seed if hash_seed is not None else cfg.hash_seed),
        weights_digest=identity.weights_digest if identity is not None else None,
        model_settings=identity.model_settings if identity is not None else None,
    )


def tier_fingerprint(
    config: OffloadingConfig,
    stride: int,
    cfg: TieredConfig,
    tier_config: Mapping[str, Any],
    *,
    replicated_layout: bool = False,
    vllm_config: Any | None = None,
    env: Mapping[str, str] | None = None,
) -> Fingerprint:
    """The namespace ``TieredDiskTier`` opens for the entry ``tier_config`` (``cfg``: it
    parsed) under vLLM's ``OffloadingConfig`` ``config`` with CPU-tier rows of ``stride``
    bytes: the model's identity as vLLM's scheduler resolves it (``model_id`` where the
    entry sets one, else vLLM's ``--model``; ``vllm_config``: default the engine's,
    ``common.find_vllm_config``), and the hash seed it runs with (the entry's
    ``hash_seed`` where set, else ``PYTHONHASHSEED`` of ``env``, default
    ``os.environ``, as vLLM seeds its prefix hashes). Raises ``ConfigError`` naming
    ``model_path``."""
    identity = vllm_model_identity(config.model.name, cfg, tier_config, vllm_config)
    env = os.environ if env is None else env
    return chunk_fingerprint(
        config,
        stride,
        cfg,
        replicated_layout=replicated_layout,
        model_id=identity.model_id,
        identity=identity,
        hash_seed=cfg.hash_seed if "hash_seed" in tier_config else env.get("PYTHONHASHSEED", ""),
    )


def check_tier_hash_algorithm(cfg: TieredConfig) -> None:
    """``hash_algorithm`` of a tier entry against vLLM's (``common.check_hash_algorithm``)."""
    check_hash_algorithm(
        cfg, fix="in the tier entry", unseeded="chunks written to the disk tier will never hit after a restart"
    )
