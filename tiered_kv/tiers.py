"""The tier seam: what one tier below the CPU tier contributes in each process.

Imported in every process (scheduler, workers, tools); no I/O here. A tier is a
``TierSpec`` subclass registered under a type name (``disk``, ``remote``) or named by
``module_path`` in the config, as vLLM's ``SecondaryTierFactory`` does
(``tiered_kv.tier_registry``). The config lists
the lower tiers in order, fastest first::

    "tiers": [{"type": "disk", "path": "/mnt/nvme/tiered-kv", "bytes": "1TiB"},
              {"type": "remote", "endpoint": "https://s3.internal", "bucket": "kv"},
              {"type": "MyTier", "module_path": "my_pkg.my_tier", ...}]

and the keys users had before the list (``disk_path``, ``remote``) are mapped onto it
(``TieredConfig.tier_entries``): ``disk_path`` is a ``disk`` entry first, ``remote`` a
``remote`` entry after it, then ``tiers``.

``HierarchySpec`` (``tiered_kv.tiered.spec``) is the one builder: in the scheduler it has
each tier build its manager (``get_manager``, the composite's ``LowerTier``) and, for an
engine that cannot take a failed load (vLLM 0.33), the check that must pass before a
block of the tier is promised as a hit (``get_hit_check``); in each worker it has each
tier build its worker side (``get_worker``: a stager for writes from CPU slots, handlers
for reads into CPU slots and into the KV cache). Adding a tier adds a package with a
``TierSpec`` and one line in ``tier_registry.TIER_TYPES`` (or a ``module_path``),
nothing else.

The operator's tools ask the same classes (``tiered_kv.tier_ops``): ``doctor_checks``,
``inspector``, ``config_info``, ``prior_gbps``, each with a default, so a tier shows up
in ``tiered-kv doctor``, ``inspect --tier NAME``, vLLM's config info, the exporter and
the load decision from its own module.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from tiered_kv.abstract import BlockHash, Closing, LowerTier
from tiered_kv.config_values import ConfigError
from tiered_kv.cost import PRIOR_GBPS
from tiered_kv.tier_ops import BlockWriter, Check, TierInspector, ToolContext, skipped
from tiered_kv.tier_registry import TierEntry

if TYPE_CHECKING:
    import torch

    from tiered_kv.config import TieredConfig
    from tiered_kv.fingerprint import Fingerprint
    from tiered_kv.kv_layout import KVCacheLayout
    from tiered_kv.memory.host_memory import HostKVCache
    from tiered_kv.metrics import CounterValue, MetricDef, Observation, TieredStats
    from tiered_kv.worker.worker import LowerTierWorker


@dataclass(frozen=True)
class TierContext:
    """What every tier of one hierarchy is built from, the same in every process except
    ``layout`` (the process's own view of a block: the scheduler may have no tensors)
    and ``rank``."""

    config: "TieredConfig"
    fingerprint: "Fingerprint"
    layout: "KVCacheLayout"
    engine_id: str
    rank: int = 0
    world_size: int = 1
    enable_events: bool = True
    #: The engine recomputes the blocks of a load that failed (vLLM with our connector
    #: and ``kv_load_failure_policy: recompute``): a hit need not be verified first.
    failed_loads_recomputed: bool = False
    #: Seconds the scheduler-side rules time sessions on (``retention: session``); a
    #: replay passes its modelled clock.
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank}: expected 0 <= rank < world size ({self.world_size})")


class HitState(enum.Enum):
    """A tier's answer before a block is promised as a hit (``HitCheck.lookup``)."""

    HIT = "hit"  #: loadable, and a load of it will not fail
    PENDING = "pending"  #: loadable once a check in flight passes: ask again next step
    MISS = "miss"  #: not servable from this tier
    RETRY = "retry"  #: whether the tier holds it is not known yet: ask again


class HitCheck(Protocol):
    """Scheduler process. What must hold before a block of one tier is promised as a hit
    to an engine whose load jobs must not fail (vLLM 0.33's worker asserts each did).
    Every call returns at once; the checks run on the check's own threads."""

    def lookup(self, block_hash: BlockHash) -> HitState:
        """The block is loadable from this tier: may it be promised now?"""

    def locating(self, block_hash: BlockHash) -> bool:
        """Whether the tier is still finding out if it holds a block it does not hold now."""

    def loading(self, block_hash: BlockHash) -> None:
        """A load of the block was prepared: a check passed counts for one load."""

    def collect(self) -> bool:
        """Fold in the checks that finished (cheap: before a lookup that asks this
        check). True if any did: a block that failed may have left its tier."""

    def step(self) -> None:
        """Once per engine step: ``collect``, then the tier's own housekeeping."""

    def busy(self) -> bool:
        """Whether some check is in flight (the engine must keep stepping)."""

    def reset(self) -> None:
        """Forget every check passed; blocks being written now are never served."""

    def outcomes(self) -> Mapping[str, int]:
        """Checks finished so far, by outcome (``ok``, ``failed``)."""

    def counters(self) -> list["CounterValue"]:
        """The totals this tier's scheduler side exports: its checks' outcomes
        (``TIER_VERIFICATIONS``), and whatever its manager's store counts."""

    def timings(self) -> list["Observation"]:
        """The timings observed since the last call (each handed out once)."""

    def shutdown(self) -> None:
        """Stop the check's threads and close what it opened. Idempotent."""


class TrustedHitCheck:
    """The check of a tier whose loadable blocks are always loadable (nothing to verify).
    Its step folds in the tier's writes that landed (``refresh``) while some are pending,
    for a tier with no thread of its own that does."""

    def __init__(self, manager: LowerTier):
        self.manager = manager

    def lookup(self, block_hash: BlockHash) -> HitState:
        return HitState.HIT

    def locating(self, block_hash: BlockHash) -> bool:
        return False

    def loading(self, block_hash: BlockHash) -> None:
        return

    def collect(self) -> bool:
        return False

    def step(self) -> None:
        if self.manager.num_pending():
            self.manager.refresh()

    def busy(self) -> bool:
        return False

    def reset(self) -> None:
        return

    def outcomes(self) -> Mapping[str, int]:
        return {}

    def counters(self) -> list["CounterValue"]:
        return []

    def timings(self) -> list["Observation"]:
        return []

    def shutdown(self) -> None:
        return


class TierSpec(Closing, ABC):
    """One lower tier's part of the hierarchy, built in every process from the same
    ``TierEntry`` and ``TierContext``.

    ``name``: the tier's name in stats and transfer types (``disk``: ``cpu_to_disk``);
    ``medium``: the medium of its events and load specs; ``write_policy``: how the
    composite feeds it (``write_through``: every stored block; ``write_back``: CPU
    evictions only). ``store``: the worker's open store once ``get_worker`` ran (tools
    and tests read it), else None; ``stager``: likewise its stager.
    """

    #: The name a tier of this type gets when the config names none.
    default_name: ClassVar[str] = "tier"
    #: The medium of its events and specs (``"DISK"``, ``"REMOTE"``); an entry may set its own.
    medium: str = "DISK"
    #: Whether its blocks are a fleet's rather than this node's: a cache reset leaves
    #: them, their removal is never announced, and engines report its hits as external.
    shared: ClassVar[bool] = False
    #: Load GB/s the load decision assumes before its first sample (``tiered_kv.cost``):
    #: by the tier's type, whatever its medium is named; a network's by default.
    prior_gbps: ClassVar[float] = PRIOR_GBPS["REMOTE"]

    def __init__(self, settings: Any, ctx: TierContext, name: str | None = None, medium: str | None = None):
        self.settings = settings
        self.ctx = ctx
        self.name = name or self.default_name
        if medium is not None:
            self.medium = medium
        self.store: Any = None
        self.stager: Any = None

    @classmethod
    def parse_settings(cls, raw: Mapping[str, Any], key_prefix: str) -> Any:
        """Validate a config entry's own keys (``type``, ``module_path`` and ``name``
        removed); errors name ``key_prefix + key``. The default takes none."""
        if raw:
            raise ConfigError(f"{key_prefix}{next(iter(raw))}: not a setting of a {cls.__name__} tier")
        return None

    @property
    def write_policy(self) -> str:
        """The composite's policy for this tier (default: the config's ``write_policy``)."""
        return self.ctx.config.write_policy

    @property
    def shares_host_memory(self) -> bool:
        """Whether this tier's worker side reaches the CPU tier from another process (the
        CPU tier is then allocated in shared memory)."""
        return False

    @abstractmethod
    def get_manager(self) -> LowerTier:
        """Scheduler process: the tier's bookkeeping (the composite's ``LowerTier``).
        Opens what it needs (an index, a connection); errors name the setting at fault."""

    def get_hit_check(self, manager: LowerTier) -> HitCheck:
        """Scheduler process: the check before a block of ``manager`` is promised as a
        hit to an engine whose loads must not fail. Default: none needed."""
        return TrustedHitCheck(manager)

    @abstractmethod
    def get_worker(
        self, host: "HostKVCache", gpu_tensors: Sequence["torch.Tensor"], stats: "TieredStats"
    ) -> "LowerTierWorker":
        """Worker process: the stager and the load handlers of this rank, over the CPU
        tier ``host`` and the KV cache ``gpu_tensors`` (one per layer of the layout).
        Handlers take GPU sides as ``GPULoadStoreSpec`` or per-block ``GPURowsSpec``."""

    def worker_counters(self) -> list["CounterValue"]:
        """Worker process: the totals of what ``get_worker`` opened, for an exporter
        (a shared tier's store: this rank's uploads and downloads). Default: none."""
        return []

    def worker_timings(self) -> list["Observation"]:
        """Worker process: the timings of what ``get_worker`` opened observed since the
        last call (each handed out once). Default: none."""
        return []

    def close(self) -> None:
        """Close what ``get_worker`` opened (its handlers are shut down first). Idempotent."""
        return

    # ------------------------------------------------------------ operator hooks

    #: The labels ``config_info`` fills (vLLM declares them before any tier is built).
    config_info_keys: ClassVar[tuple[str, ...]] = ("tier_type",)
    #: Metrics this tier type reports beyond the hierarchy's (``metrics.PROJECT_METRICS``,
    #: which name every tier by a ``tier`` label), through ``worker_counters`` /
    #: ``worker_timings``: declared to vLLM and to the exporter for the config's tiers
    #: (``tier_metric_definitions``). Default: none.
    metric_definitions: ClassVar[tuple["MetricDef", ...]] = ()

    def config_info(self) -> dict[str, Any]:
        """Static facts on vLLM's ``vllm:kv_offload_config_info`` (one mapping per tier,
        labelled by its name); keys from ``config_info_keys``. Default: the tier's type."""
        return {"tier_type": type(self).__name__}

    @classmethod
    def doctor_checks(cls, entry: TierEntry, ctx: ToolContext) -> list[Check]:
        """Operator's process, before a server starts: the host checks this tier needs
        (``tiered-kv doctor``), each a ``Check`` whose non-ok lines carry the fix. Reads
        what it must, writes at most probe files it removes. Default: none declared."""
        return [skipped(f"tier_{entry.name}", f"tier {entry.name} ({entry.type_name}) declares no checks of its own")]

    def warm_writer(self) -> BlockWriter | None:
        """Operator's process: what ``tiered-kv warmup`` writes this tier's blocks through,
        beside the bookkeeping of ``get_manager`` (``BlockWriter``). Default: None, and the
        warm-up writes the config's first tier that offers one."""
        return None

    @classmethod
    def inspector(cls, entry: TierEntry, ctx: ToolContext) -> TierInspector | None:
        """Operator's process: what ``tiered-kv inspect VERB --tier NAME`` runs on this tier
        (``TierInspector``). Default: None, and the tools refuse the tier, naming it."""
        return None


def tier_metric_definitions(entries: Sequence[TierEntry]) -> tuple["MetricDef", ...]:
    """The metrics the tier types of ``entries`` add (``TierSpec.metric_definitions``),
    each name once."""
    found: dict[str, MetricDef] = {}
    for entry in entries:
        for d in getattr(entry.cls, "metric_definitions", ()):
            found.setdefault(d.name, d)
    return tuple(found.values())


def build_tiers(entries: Sequence[TierEntry], ctx: TierContext) -> list[TierSpec]:
    """The ``TierSpec`` of each entry, in order; names must differ."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ConfigError(f"tiers: every lower tier needs its own name; got {', '.join(names)}")
    tiers: list[TierSpec] = []
    for entry in entries:
        cls = entry.cls
        if not issubclass(cls, TierSpec):
            raise ConfigError(f"tiers.type: {entry.type_name!r} is not a subclass of tiered_kv.tiers.TierSpec")
        tiers.append(cls(entry.settings, ctx, entry.name, entry.medium))
    return tiers


__all__ = [
    "HitCheck",
    "HitState",
    "TierContext",
    "TierSpec",
    "TrustedHitCheck",
    "build_tiers",
    "tier_metric_definitions",
]
