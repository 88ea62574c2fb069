"""vLLM's ``kv_connector_extra_config`` for our specs, checked as the runtime checks it:
``TieredOffloadingSpec``'s (``parse_extra_config``) and one ``TieredDiskTier`` entry of
``TieringOffloadingSpec``'s ``secondary_tiers`` (``parse_tier_config``).

Any process: the engine's (``integrations.vllm.geometry``, ``secondary_config``) and an
operator's tools (``doctor``, ``warmup``, ``inspect``, through
``config_file.ServerConfigFile.config``), so a config the server refuses is refused by
the tools too. Validation only; no I/O and no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiered_kv.config import OTHER_SPECS_KEYS, VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig

__all__ = ["VLLM_TIER_KEYS", "check_chunk_keys", "parse_extra_config", "parse_tier_config"]

#: Keys other vLLM specs read, and what to use with ours instead (the tools' hints too).
_OTHER_SPECS_KEYS = {
    **OTHER_SPECS_KEYS,
    "cache_policy_module_path": "that is a key of vLLM's CPUOffloadingSpec; TieredOffloadingSpec's "
    "eviction order is eviction_policy (lru or arc)",
    "store_threshold": "that is a key of vLLM's CPUOffloadingSpec; TieredOffloadingSpec stores every chunk vLLM offers",
    "max_tracker_size": "that is a key of vLLM's CPUOffloadingSpec",
    "tier_poll_interval_s": "that is a key of vLLM's TieringOffloadingSpec",
    "backpressure": "that is a key of vLLM's TieringOffloadingSpec; TieredOffloadingSpec bounds "
    "disk writes with max_pending_disk_writes",
}

_BOOL_PASSTHROUGH = ("offload_prompt_only", "self_describing_kv_events", "canonical_layout", "canary")


def parse_extra_config(extra: Mapping[str, Any]) -> TieredConfig:
    """Validate vLLM's ``kv_connector_extra_config`` for ``TieredOffloadingSpec``.

    Our keys are parsed by ``TieredConfig`` (human sizes); vLLM's own keys
    (``VLLM_PASSTHROUGH_KEYS``) pass through after a type check, because vLLM applies
    ``bool()``/``int()`` to them and would silently read ``"false"`` as true. Raises
    ``ConfigError`` naming the key, the value and what is expected."""
    for key, why in _OTHER_SPECS_KEYS.items():
        if key in extra:
            raise ConfigError(f"{key}: not a TieredOffloadingSpec key: {why}")
    for key in _BOOL_PASSTHROUGH:
        if key in extra and not isinstance(extra[key], bool):
            raise ConfigError(f"{key}: expected true or false (a JSON boolean), got {extra[key]!r}")
    if extra.get("canonical_layout"):
        raise ConfigError(
            "canonical_layout: not supported by TieredOffloadingSpec, which stores "
            "each rank's KV pages as they are; remove the key or set it to false"
        )
    check_chunk_keys(extra)
    if "blocks_per_chunk" in extra:
        value = extra["blocks_per_chunk"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"blocks_per_chunk: expected a positive integer (GPU blocks per offloaded chunk), got {value!r}"
            )
    if "sync_load_budget_bytes" in extra:
        value = extra["sync_load_budget_bytes"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"sync_load_budget_bytes: expected a byte count >= 0 (an integer; vLLM reads it as is), got {value!r}"
            )
    for key in ("spec_name", "spec_module_path"):
        if key in extra and not isinstance(extra[key], str):
            raise ConfigError(f"{key}: expected a string, got {extra[key]!r}")
    return TieredConfig.from_dict(extra, passthrough_keys=VLLM_PASSTHROUGH_KEYS)


def check_chunk_keys(extra: Mapping[str, Any]) -> None:
    """Refuse an extra config that sizes the offloaded chunk twice, in tokens
    (``block_size``) and in GPU blocks (``blocks_per_chunk``), as vLLM's offloading
    connector refuses it at start-up (any spec); a key set to null counts as unset there."""
    if extra.get("block_size") is not None and extra.get("blocks_per_chunk") is not None:
        raise ConfigError(
            f"block_size ({extra['block_size']!r}) and blocks_per_chunk ({extra['blocks_per_chunk']!r}) both set, "
            "which vLLM refuses at start-up (specify only one); keep one of them"
        )


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
