"""``TieredOffloadingSpec``: the whole hierarchy (GPU -> CPU -> disk) as vLLM 0.33's
out-of-tree offloading spec.

``geometry.py`` parses the config and derives the geometry; ``manager.py`` builds the
scheduler side and ``worker.py`` the worker side from them; this module ties the three
to vLLM's ``OffloadingSpec``.

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
  geometry, vLLM's parallel layout and KV-cache layout, the attention backend whose
  kernels write the pages (vLLM's choice for the model on this host, the same in every
  process; a worker whose attention layers use another refuses to start, naming it:
  ``common.vllm_attention_backend``), the world size (one shard per rank) and the
  prefix-hash algorithm and seed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    ConfigInfoMapping,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.base import TIER_LABEL

from tiered_kv.integrations.vllm.canary import CanaryPlan
from tiered_kv.integrations.vllm.common import TieredOffloadingInfo, find_vllm_config, metric_definitions, refuse_lora
from tiered_kv.integrations.vllm.connector import built_by_tiered_connector, failed_loads_recomputed
from tiered_kv.integrations.vllm.geometry import VllmGeometry, check_extra_hash_algorithm
from tiered_kv.vllm_extra import parse_extra_config
from tiered_kv.integrations.vllm.manager import build_manager
from tiered_kv.integrations.vllm.worker import TieredVllmWorker
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.tiers import tier_metric_definitions

logger = logging.getLogger(__name__)


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
        return metric_definitions(tier_metric_definitions(parse_extra_config(extra_config).tier_entries()))

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The hierarchy's labels, ``tier``, then each lower tier type's (``TierSpec``)."""
        keys = dict.fromkeys((*TieredOffloadingInfo.config_info_keys(), TIER_LABEL))
        for entry in parse_extra_config(extra_config).tier_entries():
            keys.update(dict.fromkeys(entry.cls.config_info_keys))
        return tuple(keys)

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.tiered_config = parse_extra_config(self.extra_config)
        # Ours keeps LoRA requests in the CPU tier alone, which (a tier of this process)
        # lives no longer than the adapter the process loaded.
        if self.tiered_config.tier_entries() and not built_by_tiered_connector():
            refuse_lora("TieredOffloadingSpec with lower tiers under this connector", "use TieredOffloadingConnector")
        check_extra_hash_algorithm(self.tiered_config)
        self.geometry = VllmGeometry.from_config(config, self.tiered_config, self.extra_config)
        if self.tiered_config.disk_tier is not None:
            fp = self.geometry.fingerprint
            logger.info(
                "disk namespace %s: model %s @ %s, weights %s, settings %s, attention backend %s, KV-cache layout %s",
                fp.namespace_id,
                fp.model_id,
                fp.model_revision,
                fp.weights_digest or "not covered",
                ", ".join(fp.model_settings or ()) or "none",
                fp.attention_backend,
                self.config.kv_cache_layout or "unresolved",
            )
        #: Our connector with vLLM's recompute policy: a failed load costs a recompute,
        #: so the shared tier's hits are read once, by the workers (``connector.py``).
        self.failed_loads_recomputed = failed_loads_recomputed()
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def config_info(self, hierarchy: HierarchySpec) -> list[ConfigInfoMapping]:
        """One mapping per tier, the CPU tier's first, each labelled with its name."""
        g = self.geometry
        cpu = TieredOffloadingInfo(
            tiered_cpu_slots=g.num_cpu_slots,
            tiered_cpu_bytes_per_rank=g.num_cpu_slots * g.bytes_per_chunk,
            tiered_write_policy=self.tiered_config.write_policy,
            tiered_tokens_per_chunk=g.tokens_per_chunk,
            tiered_bytes_per_chunk_per_rank=g.bytes_per_chunk,
        )
        infos: list[ConfigInfoMapping] = [{**cpu.as_config_info(), TIER_LABEL: "cpu"}]
        infos += [{**tier.config_info(), TIER_LABEL: tier.name} for tier in hierarchy.lower_tiers]
        return infos

    def hierarchy(self, layout: KVCacheLayout) -> HierarchySpec:
        """The hierarchy's one builder for this process: ``layout`` is the scheduler's
        view of a chunk (``VllmGeometry.scheduler_layout``) or a worker's
        (``worker.canonical_layout``); every tier is keyed by vLLM's fingerprint."""
        g = self.geometry
        return HierarchySpec(
            dataclasses.replace(self.tiered_config, block_size=g.tokens_per_chunk),
            g.tokens_per_block,
            layout,
            rank=g.rank,
            tp_size=g.world_size,
            engine_id=self.config.engine_id,
            enable_events=self.kv_events_config.enable_kv_cache_events,
            fingerprint=g.fingerprint,
            failed_loads_recomputed=self.failed_loads_recomputed,
        )

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            hierarchy = self.hierarchy(self.geometry.scheduler_layout())
            self._manager = build_manager(hierarchy, info=self.config_info(hierarchy))
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TieredVllmWorker(
                kv_caches,
                self.hierarchy,
                self.geometry,
                self.config.engine_id,
                recompute_failed_loads=self.failed_loads_recomputed,
                canary=self.canary_plan(),
            )
        return self._worker

    def canary_plan(self) -> CanaryPlan | None:
        """What the worker's start-up canary (``canary.py``) checks, or None with
        ``canary: false``."""
        if not self.tiered_config.canary:
            return None
        vc = find_vllm_config()
        mc = getattr(vc, "model_config", None)
        return CanaryPlan(
            tuple(tuple(g.layer_names) for g in self.config.groups),
            self.config.kv_cache_layout,
            mc.get_head_size() if mc is not None else None,
        )
