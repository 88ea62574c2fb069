"""HierarchySpec: the one builder of the hierarchy GPU <-> CPU <-> lower tiers.

Constructed in every process from the same config, ``engine_id``, rank and TP size:
the simulator, the demo, the warm-up, the tools and the vLLM plug-in
(``tiered_kv.integrations.vllm``) all build through it. The lower tiers are the config's
``TierEntry`` list (``TieredConfig.tier_entries``: ``disk_path``'s disk tier, ``remote``'s
shared tier, then ``tiers``), each a ``TierSpec`` built by type (``tiered_kv.tiers``).

- ``get_manager`` (scheduler process) sizes the CPU tier and has each tier build its
  manager (the disk tier opens its namespace, takes its writer lock and loads its index;
  the shared tier opens its bucket), composed into ``TieredOffloadingManager``.
  ``get_hit_checks`` gives each tier's check before a hit is promised, for an engine
  whose loads must not fail.
- ``build_handlers`` (worker process) has each tier open its worker side (this rank's
  block I/O) over the CPU tier and the KV cache, and composes the store and load
  handlers around the engine's own GPU <-> CPU handlers. ``get_handlers`` (the seed
  API) allocates the CPU tier and those GPU <-> CPU handlers first; an engine adapter
  that brings its own (vLLM's GPU-block-granular copies) calls ``allocate_host`` and
  ``build_handlers`` itself.

Without lower tiers it is the CPU tier alone with the composite's bookkeeping.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from tiered_kv.abstract import Closing, LoadStoreSpec
from tiered_kv.config import ConfigError, TieredConfig, admit_after
from tiered_kv.prefill import PrefillEstimate, configured_prefill
from tiered_kv.cpu import cpu_tier_for_rules
from tiered_kv.cpu.spec import CPUOffloadingSpec
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from tiered_kv.memory.host_memory import HostKVCache
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.handlers import TieredLoadHandler, TieredStoreHandler
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.transfer_specs import TieredLoadSpec
from tiered_kv.tiers import HitCheck, TierContext, TierSpec, build_tiers
from tiered_kv.worker.worker import OffloadingHandler


class TieredHandlers(NamedTuple):
    """A worker's composite handlers: GPU -> CPU stores (with the lower tiers' writes)
    and loads into the GPU from any tier."""

    store: TieredStoreHandler
    load: TieredLoadHandler


class HierarchySpec(CPUOffloadingSpec, Closing):
    """GPU -> CPU (LRU or ARC) -> the config's lower tiers (module docstring).

    ``rank``/``tp_size``: this process's tensor-parallel rank and the TP size (part of
    the fingerprint). ``engine_id``: shared by the scheduler and its workers so the
    workers may write while the scheduler holds the cache's writer lock.
    ``fingerprint``: the namespace key of every tier; by default derived from the
    config and the layout (``Fingerprint.from_config``), an engine adapter passes its
    own. ``failed_loads_recomputed``: the engine recomputes the blocks of a load that
    failed, so the tiers' hit checks need not verify first (``TierContext``). ``clock``:
    the seconds the tiers' session retention times gaps on; an engine serves on
    ``time.monotonic``, a replay passes its modelled clock so its hit rates do not
    depend on how fast the machine runs it. ``stats`` is shared by the manager and the
    handlers built by this spec.
    """

    def __init__(
        self,
        config: TieredConfig | Mapping[str, Any],
        gpu_block_size: int,
        layout: KVCacheLayout | None = None,
        *,
        rank: int = 0,
        tp_size: int = 1,
        engine_id: str | None = None,
        enable_events: bool = True,
        fingerprint: Fingerprint | None = None,
        failed_loads_recomputed: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(config, gpu_block_size, layout, enable_events)
        if tp_size < 1 or not 0 <= rank < tp_size:
            raise ConfigError(f"rank {rank} / tp_size {tp_size}: expected 0 <= rank < tp_size")
        self.rank, self.tp_size = rank, tp_size
        self.engine_id = engine_id or uuid.uuid4().hex
        self.stats = TieredStats()
        self._given_fingerprint = fingerprint
        self.failed_loads_recomputed = failed_loads_recomputed
        self.clock = clock
        self._lower: list[TierSpec] | None = None

    def _fingerprint(self) -> Fingerprint:
        if self._given_fingerprint is not None:
            return self._given_fingerprint
        cfg = self.config
        if cfg.tiers and cfg.model_path is None and cfg.cover_weights:
            # Else a re-run after new weights at the same path would be served the old
            # checkpoint's KV from the persistent tiers.
            raise ConfigError(
                "model_path: not set, so the namespace of the lower tiers would not cover the model's weights; "
                "set model_path to the model's directory, or cover_weights: false to state that it does not"
            )
        return Fingerprint.from_config(cfg, self._known_layout(), self.tp_size)

    def _known_layout(self) -> KVCacheLayout:
        if self.layout is None:
            raise ConfigError(
                "HierarchySpec needs the KV layout to build its tiers; pass layout=... or call get_handlers first"
            )
        return self.layout

    @property
    def lower_tiers(self) -> list[TierSpec]:
        """The lower tiers' specs, fastest first (built once the KV layout is known)."""
        if self._lower is None:
            ctx = TierContext(
                config=self.config,
                fingerprint=self._fingerprint(),
                layout=self._known_layout(),
                engine_id=self.engine_id,
                rank=self.rank,
                world_size=self.tp_size,
                enable_events=self.enable_events,
                failed_loads_recomputed=self.failed_loads_recomputed,
                clock=self.clock,
            )
            self._lower = build_tiers(self.config.tier_entries(), ctx)
        return self._lower

    @property
    def store(self) -> Any:
        """This worker's store of the first lower tier, once ``get_handlers`` ran."""
        return self.lower_tiers[0].store if self.lower_tiers else None

    # ------------------------------------------------------------ scheduler process

    def get_manager(self) -> TieredOffloadingManager:
        cpu = cpu_tier_for_rules(
            self.config.eviction_policy,
            self.num_cpu_slots,
            self.offloaded_block_size,
            self.config.cpu_admission,
            self.config.cpu_retention,
            enable_events=self.enable_events,
            clock=self.clock,
        )
        lower = []
        try:
            # Slowest first: a start the shared tier refuses (credentials, bucket) leaves
            # no disk namespace behind.
            for tier in reversed(self.lower_tiers):
                lower.append(tier.get_manager())
        except BaseException:
            for manager in lower:
                manager.shutdown()
            raise
        lower.reverse()
        prefill = self.prefill
        composite = TieredOffloadingManager(
            cpu,
            lower,
            write_policy=[t.write_policy for t in self.lower_tiers],
            promote_on_hit=self.config.promote_on_hit,
            max_pending_writes=self.config.max_pending_disk_writes,
            stats=self.stats,
            cost_aware=self.config.cost_aware,
            prefill_tokens_per_s=prefill.tokens_per_s,
            prefill_configured=prefill.configured,
            bytes_per_block=self._known_layout().bytes_per_block,
            admit_after=[admit_after(self.config.write_admission, t.name) for t in self.lower_tiers],
            priors={t.name: t.prior_gbps for t in self.lower_tiers},
        )
        if composite.costs is not None:
            # Where the workers run in this process (the demo, the simulator, a library
            # user) their transfers feed the estimates directly; under vLLM the workers
            # record into their own stats and the scheduler reads ``LoadTimings``.
            self.stats.observers.append(composite.costs.observe)
        return composite

    @property
    def prefill(self) -> PrefillEstimate:
        """Prefill tokens/s the load-versus-recompute decision judges by, and their source
        (``tiered_kv.prefill.configured_prefill``)."""
        return configured_prefill(self.config.prefill_tokens_per_s, self.config.model_path, self.tp_size)

    def get_hit_checks(self, manager: TieredOffloadingManager) -> list[HitCheck]:
        """Each lower tier's check before one of its blocks is promised as a hit, in tier
        order, over ``manager``'s tiers (from ``get_manager``)."""
        checks: list[HitCheck] = []
        try:
            for tier, lower in zip(self.lower_tiers, manager.lower):
                checks.append(tier.get_hit_check(lower))
        except BaseException:
            for check in checks:
                check.shutdown()
            raise
        return checks

    # ------------------------------------------------------------ worker process

    def close(self) -> None:
        """Close the workers' lower-tier stores opened by ``build_handlers``."""
        if self._lower is not None:
            for tier in self._lower:
                tier.close()

    def _host_shared(self) -> bool:
        return any(t.shares_host_memory for t in self.lower_tiers)

    def allocate_host(self) -> HostKVCache:
        """This worker's CPU tier (shared memory where a tier's I/O runs in another
        process), for an adapter that builds its own GPU <-> CPU handlers over it."""
        self.host = HostKVCache(self._known_layout(), self.num_cpu_slots, shared=self._host_shared())
        return self.host

    def build_handlers(
        self,
        gpu_to_cpu: OffloadingHandler,
        cpu_to_gpu: OffloadingHandler,
        gpu_tensors: Sequence[torch.Tensor],
        *,
        gpu_block_granular: bool = False,
        store_bytes_per_block: int | None = None,
    ) -> TieredHandlers:
        """The composite's handlers over the engine's GPU <-> CPU handlers and each lower
        tier's worker side (opened here, over ``self.host`` and ``gpu_tensors``, one per
        layer). ``gpu_block_granular``: the GPU <-> CPU handlers address GPU blocks (CPU
        position ``slot * block_size_factor + j``); ``store_bytes_per_block``: bytes of
        one block of a store job's spec (default: an offloaded block)."""
        layout = self._known_layout()
        if self.host is None:
            raise ConfigError("HierarchySpec.build_handlers needs the CPU tier: call allocate_host first")
        workers = []
        try:
            for tier in reversed(self.lower_tiers):  # slowest first, as in get_manager
                workers.append(tier.get_worker(self.host, gpu_tensors, self.stats))
        except BaseException:
            self.close()
            raise
        workers.reverse()
        store = TieredStoreHandler(
            gpu_to_cpu, store_bytes_per_block or layout.bytes_per_block, [w.stager for w in workers], self.stats
        )
        load = TieredLoadHandler(
            cpu_to_gpu,
            layout.bytes_per_block,
            layout.block_size_factor,
            [w.to_gpu for w in workers],
            [w.to_cpu for w in workers],
            self.stats,
            tier_names=[t.name for t in self.lower_tiers],
            gpu_block_granular=gpu_block_granular,
        )
        return TieredHandlers(store, load)

    def get_handlers(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        kv_before_num_blocks: bool | Mapping[str, bool] = False,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        cpu_gpu = self._cpu_gpu_handlers(kv_caches, kv_before_num_blocks)
        layout = self._known_layout()
        store, load = self.build_handlers(
            cpu_gpu.gpu_to_cpu_handler, cpu_gpu.cpu_to_gpu_handler, [kv_caches[layer.name] for layer in layout.layers]
        )
        yield GPULoadStoreSpec, CPULoadStoreSpec, store
        yield CPULoadStoreSpec, GPULoadStoreSpec, load
        yield TieredLoadSpec, GPULoadStoreSpec, load


__all__ = ["HierarchySpec", "TieredHandlers"]
