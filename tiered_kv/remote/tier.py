"""``RemoteTier``: what the shared tier contributes to the hierarchy, in each process.

Built in every process from the same ``TierEntry`` (``tiers: [{"type": "remote", ...}]``
or the config's ``remote`` settings, a ``RemoteConfig``). In the scheduler process,
``get_manager`` opens a store for existence probes, with the start-up check that names
endpoint and bucket on wrong credentials (``RemoteOffloadingManager``, the composite's
``LowerTier``), and ``get_hit_check`` has every rank's object of a block downloaded and
verified before it is promised as a hit (``RemoteHitCheck``). In each worker process,
``get_worker`` opens this rank's own store (after any fork) and returns its stager
(uploads from CPU slots) and its load handlers (downloads into CPU slots or the KV
cache), from ``tiered_kv.remote.worker.handlers``. Network I/O happens on the stores' threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tiered_kv.metrics import remote_counter_values
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.remote.format.keys import Keyring, load_keyring
from tiered_kv.remote.scheduler.manager import REMOTE
from tiered_kv.tier_ops import Check, ToolContext
from tiered_kv.tier_registry import TierEntry
from tiered_kv.tiers import HitCheck, TierContext, TierSpec

if TYPE_CHECKING:
    import torch

    from tiered_kv.abstract import LowerTier
    from tiered_kv.memory.host_memory import HostKVCache
    from tiered_kv.metrics import CounterValue, Observation, TieredStats
    from tiered_kv.remote.scheduler.manager import RemoteOffloadingManager
    from tiered_kv.remote.store.store import RemoteStore
    from tiered_kv.worker.worker import LowerTierWorker


class RemoteTier(TierSpec):
    """The shared tier (module docstring); ``settings`` is a ``RemoteConfig``. Its
    blocks are the fleet's: a cache reset forgets them here but leaves the bucket."""

    default_name = "remote"
    medium = REMOTE
    #: Another node's blocks: the bucket's lifecycle rule removes them unannounced.
    shared = True
    settings: RemoteConfig
    store: "RemoteStore | None"

    def __init__(self, settings: RemoteConfig, ctx: TierContext, name: str | None = None, medium: str | None = None):
        super().__init__(settings, ctx, name, medium)
        #: The fleet key, read when the tiers are built: before any tier opens anything,
        #: so a start refused for its key leaves nothing behind (``keys.load_keyring``).
        self.keyring: Keyring | None = load_keyring(settings)

    @classmethod
    def parse_settings(cls, raw: Mapping[str, Any], key_prefix: str) -> RemoteConfig:
        return RemoteConfig.from_dict(raw, key_prefix=key_prefix)

    config_info_keys = ("tier_type", "remote_backend", "remote_endpoint", "remote_bucket", "remote_prefix")

    def config_info(self) -> dict[str, Any]:
        s = self.settings
        return dict(zip(self.config_info_keys, ("remote", s.backend, s.endpoint, s.bucket, s.prefix)))

    @classmethod
    def doctor_checks(cls, entry: TierEntry, ctx: ToolContext) -> list[Check]:
        """Its fleet key as the server loads it, its server's answer and one block object
        opened with the key (``tiered_kv.ops.doctor.remote``)."""
        import dataclasses

        from tiered_kv.ops.doctor.remote import check_remote

        return [check_remote(dataclasses.replace(ctx.config, tiers=(entry,)), ctx.extra)]

    @property
    def write_policy(self) -> str:
        """``write_through`` shares every block the node stores; ``evictions``
        (``write_back``) only what the CPU tier evicts."""
        return "write_back" if self.settings.write_policy == "evictions" else "write_through"

    def get_manager(self) -> "RemoteOffloadingManager":
        """Scheduler process: opens a store for probes (its start-up check raises
        ``RemoteSetupError`` naming endpoint and bucket on wrong credentials or a
        missing bucket; a server that does not answer is logged and costs misses)."""
        from tiered_kv.remote.scheduler.manager import RemoteOffloadingManager
        from tiered_kv.remote.store.store import RemoteStore

        ctx = self.ctx
        return RemoteOffloadingManager(
            RemoteStore(self.settings, ctx.fingerprint, keyring=self.keyring),
            block_size=ctx.layout.offloaded_block_size,
            name=self.name,
            medium=self.medium,
            enable_events=ctx.enable_events,
        )

    def get_hit_check(self, manager: "LowerTier") -> HitCheck:
        from tiered_kv.remote.scheduler.hit_check import RemoteHitCheck, RemoteVerifier
        from tiered_kv.remote.scheduler.manager import RemoteOffloadingManager

        assert isinstance(manager, RemoteOffloadingManager), manager
        ctx = self.ctx
        if ctx.failed_loads_recomputed:
            return RemoteHitCheck(manager, None)  # each hit read once, verified by the worker that reads it
        return RemoteHitCheck(manager, RemoteVerifier(manager.store, ctx.world_size, ctx.layout.bytes_per_block))

    def get_worker(
        self, host: "HostKVCache", gpu_tensors: Sequence["torch.Tensor"], stats: "TieredStats"
    ) -> "LowerTierWorker":
        """Worker process: this rank's store (its start-up check raises as
        ``get_manager``'s does), stager and load handlers."""
        from tiered_kv.remote.worker.handlers import RemoteLoadHandler, RemoteStager
        from tiered_kv.remote.store.store import RemoteStore
        from tiered_kv.worker.worker import LowerTierWorker

        ctx = self.ctx
        if self.store is None:
            # The start-up check here too: the worker side opens first in some engines, and
            # wrong credentials or a missing bucket must stop it before a disk tier opens.
            self.store = RemoteStore(self.settings, ctx.fingerprint, keyring=self.keyring)
        store, rank, layout = self.store, ctx.rank, ctx.layout
        self.stager = RemoteStager(
            host, store, rank, self.settings.max_pending_upload_bytes, stats, tier_name=self.name
        )
        return LowerTierWorker(
            stager=self.stager,
            to_gpu=RemoteLoadHandler(store, rank, list(gpu_tensors), layout, to_gpu=True, tier_name=self.name),
            to_cpu=RemoteLoadHandler(store, rank, host.tensors, layout, to_gpu=False, tier_name=self.name),
        )

    def worker_counters(self) -> list["CounterValue"]:
        return remote_counter_values(self.store.stats()) if self.store is not None else []

    def worker_timings(self) -> list["Observation"]:
        return self.store.latencies.drain() if self.store is not None else []

    def close(self) -> None:
        """Close this worker's store (the handlers using it must be shut down first)."""
        if self.store is not None:
            self.store.close()
            self.store = None


__all__ = ["RemoteTier"]
