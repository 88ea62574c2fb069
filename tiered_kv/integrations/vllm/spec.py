"""``TieredOffloadingSpec``: the whole hierarchy (GPU -> CPU -> disk) as vLLM 0.33's
out-of-tree offloading spec.

vLLM builds the spec from ``kv_connector_extra_config`` in every process of an engine:
the scheduler (``get_manager``), each worker (``get_worker``) and the API server (which
only calls the classmethods, for the metric definitions). Construction parses and
validates the config and does arithmetic; its one I/O is reading the weights digest of
the model directory vLLM loads (a bounded sample of each file, ``common.
vllm_model_identity``). A bad key or value fails every process at start-up with a
message naming it.

How vLLM's units map onto ours (same in every process, derived from ``OffloadingConfig``
alone, so the scheduler and the workers agree without talking):

- an offloaded block is one vLLM *chunk*: ``blocks_per_chunk`` GPU blocks
  (``block_size_factor``). Its key is vLLM's ``OffloadKey`` (the chunk's last block
  hash + the KV-group index), used as our ``BlockHash`` as is (36 bytes with sha256).
- a chunk on one rank is ``worker_kv_bytes_per_block * blocks_per_chunk`` bytes. The
  worker sees that as its ``CanonicalKVCaches`` tensors, one "layer" of our
  ``KVCacheLayout`` each; the scheduler, which has no tensors, uses one pseudo-layer of
  the same bytes. The worker checks that the two agree before it allocates anything.
- ``cpu_bytes`` and ``disk_bytes`` are **per rank** (every worker keeps its own shard of
  every chunk in its own host memory and disk slab); the slot counts follow from the
  bytes per chunk and are the same on every rank.
- the shared tier (``remote``) is a lower tier below the disk tier, or directly below
  CPU where no disk is configured (``remote.py``: scheduler side; ``worker.py``). Its
  objects are per rank (the key and the header name the rank) in the namespace of the
  same fingerprint as the disk tier's, so nodes share chunks exactly when every field
  below agrees.
- the disk namespace fingerprint is built from the model's identity (``model_id`` or
  vLLM's ``--model``; vLLM's ``--revision`` or ``model_revision``; the weights digest of
  the directory vLLM loads; vLLM's code revision, model dtype, quantization, config
  overrides and tokenizer: ``common.vllm_model_identity``), vLLM's KV-cache dtype,
  tokens per block and per chunk, the per-rank bytes per GPU block, each KV group's
  geometry, vLLM's parallel layout and KV-cache layout, the world size (one shard per
  rank) and the prefix-hash algorithm and seed.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig, format_size
from tiered_kv.disk.fingerprint import Fingerprint
from tiered_kv.disk.namespace import slot_size_for
from tiered_kv.integrations.vllm.common import TieredOffloadingInfo, metric_definitions, vllm_model_identity
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout

logger = logging.getLogger(__name__)

#: Keys other vLLM specs read, and what to use with ours instead.
_OTHER_SPECS_KEYS = {
    "cpu_bytes_to_use": "that is the key of vLLM's CPUOffloadingSpec (bytes for all TP ranks "
    "together); TieredOffloadingSpec takes cpu_bytes, per TP rank, "
    'e.g. "cpu_bytes": "64GiB"',
    "secondary_tiers": "that is the key of vLLM's TieringOffloadingSpec; TieredOffloadingSpec "
    "has its own disk tier: set disk_path and disk_bytes",
    "cache_policy_module_path": "that is a key of vLLM's CPUOffloadingSpec; TieredOffloadingSpec's "
    "eviction order is eviction_policy (lru or arc)",
    "store_threshold": "that is a key of vLLM's CPUOffloadingSpec; TieredOffloadingSpec stores every chunk vLLM offers",
    "max_tracker_size": "that is a key of vLLM's CPUOffloadingSpec",
    "tier_poll_interval_s": "that is a key of vLLM's TieringOffloadingSpec",
    "backpressure": "that is a key of vLLM's TieringOffloadingSpec; TieredOffloadingSpec bounds "
    "disk writes with max_pending_disk_writes",
}

_BOOL_PASSTHROUGH = ("offload_prompt_only", "self_describing_kv_events", "canonical_layout")
_NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


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


def _vllm_hash_algorithm() -> str | None:
    """vLLM's ``--prefix-caching-hash-algo`` when a vLLM config is current, else None."""
    from vllm.config import get_current_vllm_config_or_none

    cache = getattr(get_current_vllm_config_or_none(), "cache_config", None)
    algo = getattr(cache, "prefix_caching_hash_algo", None)
    return str(algo) if algo else None


def _check_hash_algorithm(cfg: TieredConfig) -> None:
    """Our ``hash_algorithm`` (never guessed: every process must compute the same
    namespace) must match vLLM's when vLLM's config is visible."""
    engine_algo = _vllm_hash_algorithm()
    if engine_algo is not None and engine_algo != cfg.hash_algorithm:
        raise ConfigError(
            f"hash_algorithm: {cfg.hash_algorithm!r} does not match vLLM's "
            f'--prefix-caching-hash-algo {engine_algo!r}; set "hash_algorithm": '
            f'"{engine_algo}" so the disk cache is keyed by the hashes vLLM computes'
        )
    if cfg.hash_algorithm in _NON_CRYPTO_HASHES and not os.environ.get("PYTHONHASHSEED"):
        logger.warning(
            "prefix hashes use %s with a random per-process seed (PYTHONHASHSEED is "
            "unset): chunks on the disk tier will never hit after a restart, nor the "
            "shared tier's on another node; set PYTHONHASHSEED or use sha256",
            cfg.hash_algorithm,
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
    def from_config(cls, config: OffloadingConfig, cfg: TieredConfig, extra: Mapping[str, Any]) -> "VllmGeometry":
        """Derive the geometry; raises ``ConfigError`` when it cannot hold a chunk."""
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
        bytes_per_chunk = config.worker_kv_bytes_per_block * bpc
        num_cpu_slots = cfg.cpu_bytes // bytes_per_chunk
        if num_cpu_slots < 1:
            raise ConfigError(
                f"cpu_bytes: {format_size(cfg.cpu_bytes)} per rank holds no chunk; one "
                f"chunk is {format_size(bytes_per_chunk)} per rank ({bpc} GPU blocks of "
                f"{config.worker_kv_bytes_per_block} bytes); expected at least that"
            )
        if cfg.disk_path:
            if p.world_size > 64:
                raise ConfigError(
                    f"disk_path: the disk tier keeps one shard per rank and supports at "
                    f"most 64 ranks; this engine has {p.world_size}"
                )
            if cfg.disk_bytes < slot_size_for(bytes_per_chunk):
                raise ConfigError(
                    f"disk_bytes: {format_size(cfg.disk_bytes)} per rank holds no chunk; "
                    f"one disk slot is {format_size(slot_size_for(bytes_per_chunk))}"
                )
        return cls(
            tokens_per_block,
            bpc,
            config.worker_kv_bytes_per_block,
            p.rank,
            p.world_size,
            num_cpu_slots,
            _fingerprint(config, cfg, extra),
        )


def _fingerprint(config: OffloadingConfig, cfg: TieredConfig, extra: Mapping[str, Any]) -> Fingerprint:
    p = config.parallel
    bpc = config.cache.blocks_per_chunk
    geometry = (("vllm_worker_block", (int(config.worker_kv_bytes_per_block),)),)
    for g in config.groups:
        names = hashlib.sha256("\n".join(g.layer_names).encode()).hexdigest()[:16]
        geometry += (
            (
                f"kv_group{g.group_id}:{len(g.layer_names)}_layers:{names}",
                (int(g.tokens_per_block), int(g.sliding_window_size_in_chunks or 0)),
            ),
        )
    layout = (
        f"kv_cache_layout={config.kv_cache_layout}",
        f"tp={p.tp_size}",
        f"pp={p.pp_size}",
        f"pcp={p.pcp_size}",
        f"dcp={p.dcp_size}",
        "pages=per_rank",
    )
    if p.data_parallel_size > 1:
        # Each DP replica is its own engine and writer: give it its own namespace.
        layout += (f"dp_replica={p.data_parallel_index}/{p.data_parallel_size}",)
    ident = vllm_model_identity(config.model.name, cfg, extra)
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
    )


class TieredOffloadingSpec(OffloadingSpec):
    """GPU -> pinned CPU (LRU) -> NVMe disk (LRU, persistent, checksummed) -> shared
    S3-compatible bucket (optional) for vLLM 0.33.

    Select it with ``"spec_name": "TieredOffloadingSpec", "spec_module_path":
    "tiered_kv.integrations.vllm"`` in ``kv_connector_extra_config``; the other keys are
    ``TieredConfig``'s (README, "Use with vLLM"). ``get_manager`` (scheduler) opens the
    disk namespace, takes its writer lock and loads its index, and opens and checks the
    shared tier's bucket; ``get_worker`` (each worker) allocates the host tier and opens
    this rank's slab and its own connection to the bucket.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return TieredOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.tiered_config = parse_extra_config(self.extra_config)
        _check_hash_algorithm(self.tiered_config)
        self.geometry = VllmGeometry.from_config(config, self.tiered_config, self.extra_config)
        if self.tiered_config.disk_path:
            fp = self.geometry.fingerprint
            logger.info(
                "disk namespace %s: model %s @ %s, weights %s, settings %s",
                fp.namespace_id,
                fp.model_id,
                fp.model_revision,
                fp.weights_digest or "not covered",
                ", ".join(fp.model_settings or ()) or "none",
            )
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def config_info(self) -> TieredOffloadingInfo:
        g, cfg = self.geometry, self.tiered_config
        return TieredOffloadingInfo(
            tiered_cpu_slots=g.num_cpu_slots,
            tiered_cpu_bytes_per_rank=g.num_cpu_slots * g.bytes_per_chunk,
            tiered_disk_slots=(cfg.disk_bytes // slot_size_for(g.bytes_per_chunk)) if cfg.disk_path else 0,
            tiered_disk_path=cfg.disk_path,
            tiered_write_policy=cfg.write_policy,
            tiered_tokens_per_chunk=g.tokens_per_chunk,
            tiered_bytes_per_chunk_per_rank=g.bytes_per_chunk,
        )

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from tiered_kv.integrations.vllm.manager import build_manager

            self._manager = build_manager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from tiered_kv.integrations.vllm.worker import TieredVllmWorker

            self._worker = TieredVllmWorker(kv_caches, self)
        return self._worker
