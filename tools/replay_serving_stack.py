"""The product's scheduler side as ``tools/replay_serving.py`` drives it: one
``TieredVllmManager`` per configuration, built from the product's own pieces.

Runs in the replay's one process; I/O: a temporary directory per stack (the lower tier's
slab files and LMDB index, sized by the tier's block count but for a tiny block layout,
since no KV bytes move), and the engine's private files of ``SlotHealth`` and
``LoadTimings`` (as ``build_manager`` makes them), all removed by ``close``.

What is the product's code: the CPU tier's manager (``cpu_tier_manager``: LRU unless
given, with the ``cpu_admission`` and ``cpu_retention`` given, default the product's),
the lower tier's ``DiskOffloadingManager`` (for ``--tier shared`` the same
manager named ``remote`` with medium ``REMOTE``, so its prior is
``PRIOR_GBPS["REMOTE"]``), the composite ``TieredOffloadingManager`` (write-through,
promote on hit, ``max_pending_disk_writes`` as configured by default), ``LoadCosts``
seeded with ``PRIOR_GBPS`` and the prefill estimate ``tiered_kv.cost`` makes for the
model on the GPU (not configured, so measured forward passes replace it), the disk
tier's ``DiskHitCheck``, ``TieredVllmManager`` (with its ``KvHints``: the requests'
leases and releases, prefetch while waiting where the configuration turns it on, and
``kv.prefetch`` hints' jobs where the caller runs them, at the product's default bound
unless given) and the ``LoadTimings`` channel through which it reads the workers'
transfer times.

What is modelled: the hit check's reads. By default none, as deployed with this
project's connector and vLLM's recompute policy (what ``tiered-kv config`` prints): a
chunk the tier's index holds is a hit at once and read once, by the worker's load
(``DiskHitCheck`` without a verifier). With ``verify`` (vLLM's own connector, or a model
of several KV-cache groups) the ``DiskVerifier`` is ``SimVerifier``: each verification
is a read of one chunk on the tier's I/O channel, its result there once that read ends;
it always passes. The shared tier's object store is an index that knows every object
this node wrote (no HEAD probes, so no RETRY while locating), checked as the disk's is.
The clock of ``LoadCosts`` is the replay's simulated seconds (the probe after
``probe_after_s`` follows simulated time). The workers' side is the simulator's
(``replay_serving_sim``): it records each finished load's transfer time into
``LoadTimings`` as the product's worker does.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from replay_cost import LAYOUT
from replay_serving_io import Slowdown

from tiered_kv.config import (
    TieredConfig,
    parse_cpu_admission,
    parse_cpu_retention,
    parse_retention,
    retention_share,
)
from tiered_kv.cost import LoadCosts, Queues
from tiered_kv.cpu import cpu_tier_for_rules
from tiered_kv.disk.format.manifest import slot_size_for
from tiered_kv.disk.scheduler.hit_check import DiskHitCheck
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.scheduler.verify import DiskVerifier, Verification
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.integrations.vllm.health import LoadTimings, SlotHealth
from tiered_kv.integrations.vllm.hints import HintSettings
from tiered_kv.integrations.vllm.manager import TieredVllmManager
from tiered_kv.mediums import CPU
from tiered_kv.metrics import Latencies
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiers import HitCheck

#: The configurations the replay compares. ``e460906``: the decision as it was at that
#: commit, for comparison: the same estimates, blind to the queues (``Queues`` stays
#: empty) and to attention (prefill cost linear in tokens), and a request whose run has
#: a chunk slower than recomputing is decided at the end of the step that scanned it.
CONFIGS = ("always", "recompute", "cost-aware", "e460906", "cost-aware+prefetch", "cost-aware+instant-prefetch")
DECIDING = ("cost-aware", "e460906", "cost-aware+prefetch", "cost-aware+instant-prefetch")
#: Configurations whose waiting requests' lower-tier chunks are prefetched into CPU
#: (``tiered_kv.integrations.vllm.hints``; the simulated workers run the jobs).
PREFETCHING = ("cost-aware+prefetch", "cost-aware+instant-prefetch")
#: The bound of prefetch while waiting: the product's prefetch jobs, unbounded in bytes
#: in flight, each landing in CPU the moment it is issued, its reads taking no time on
#: the tier's channel (``replay_serving_sim``).
INSTANT_PREFETCH = "cost-aware+instant-prefetch"
#: Bytes in flight the bound allows: more than any replay's working set.
UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class TierModel:
    """The lower tier: which product tier it stands for (``disk`` or ``shared``), its
    bandwidth (GB/s, reads and writes alike), per-job latency, whether a hit is read
    back before it is promised (``verify``: module docstring), its slow episodes, and the
    share of its reads that fail."""

    kind: str
    gbps: float
    latency_s: float
    verify: bool
    slow: Slowdown | None = None
    fail_rate: float = 0.0  # the share of its reads that fail (``replay_serving_sim``)

    def __post_init__(self) -> None:
        if self.kind not in ("disk", "shared"):
            raise ValueError(f"tier {self.kind!r}: expected disk or shared")
        if not 0 <= self.fail_rate < 1:
            raise ValueError(f"tier {self.kind}: fail rate {self.fail_rate!r}, expected a share in [0, 1)")
        if not self.gbps > 0 or not self.latency_s >= 0:
            raise ValueError(f"tier {self.kind}: expected gbps > 0 and latency >= 0, got {self.gbps}, {self.latency_s}")

    @property
    def name(self) -> str:
        """The tier's name in the product (stats, transfer types)."""
        return "disk" if self.kind == "disk" else "remote"

    @property
    def medium(self) -> str:
        return "DISK" if self.kind == "disk" else "REMOTE"


class SimVerifier:
    """Stands in for ``DiskVerifier``: ``submit`` hands the read of one chunk to
    ``read(key, slot, done)``, which calls ``done()`` once the read ended in simulated
    time; ``results`` returns what ended since the last call (every check passes)."""

    def __init__(self, read: Callable[[bytes, int, Callable[[], None]], None]):
        self._read = read
        self._done: list[Verification] = []
        self._inflight = 0
        self.latencies = Latencies()

    def submit(self, key: bytes, slot: int) -> None:
        self._inflight += 1
        self._read(key, slot, lambda: self._done.append(Verification(key, slot, True)))

    def results(self) -> list[Verification]:
        out, self._done = self._done, []
        self._inflight -= len(out)
        return out

    def busy(self) -> bool:
        return self._inflight > 0

    def shutdown(self) -> None:
        return


@dataclass
class Stack:
    """One configuration's manager, the workers' end of its timings channel, and what
    ``close`` removes."""

    config: str
    manager: TieredVllmManager
    timings: LoadTimings  # the workers' end (rank 0)
    tier: TierModel | None  # None: no lower tier (``recompute``)
    work: Path

    @property
    def lower(self) -> DiskOffloadingManager | None:
        return cast(DiskOffloadingManager, self.manager.composite.lower[0]) if self.tier is not None else None

    def close(self) -> None:
        try:
            self.manager.shutdown()
        finally:
            self.timings.close()
            shutil.rmtree(self.work, ignore_errors=True)


def build_stack(
    config: str,
    tier: TierModel,
    *,
    cpu_blocks: int,
    lower_blocks: int,
    tokens_per_block: int,
    bytes_per_block: int,
    prefill_tokens_per_s: float,
    attention_per_token: float,
    clock: Callable[[], float],
    verify_read: Callable[[bytes, int, Callable[[], None]], None],
    scratch: Path | None = None,
    prefetch_max_bytes: int = HintSettings.prefetch_max_bytes,
    cpu_retention: str = TieredConfig.cpu_retention,
    cpu_admission: str = TieredConfig.cpu_admission,
    eviction_policy: str = TieredConfig.eviction_policy,
    hint_prefetch: bool = False,
    disk_retention: str = "none",
) -> Stack:
    """The product's scheduler side for ``config`` (``CONFIGS``): ``recompute`` is the CPU
    tier alone (no lower tier configured, so none is ever read or written), ``always``
    and ``cost-aware`` the CPU tier over ``tier`` with the decision off and on,
    ``e460906`` the decision blind to queues and attention, ``cost-aware+prefetch``
    the decision with prefetch while waiting (at most ``prefetch_max_bytes`` in flight),
    and ``INSTANT_PREFETCH`` its bound (no limit in flight; the simulation reads nothing);
    ``eviction_policy``, ``cpu_admission`` and ``cpu_retention``: the CPU tier's config
    values (``TieredConfig``), built as ``HierarchySpec.get_manager`` builds them, the
    retention rule on the replay's clock. ``hint_prefetch``: the workers run prefetch jobs
    (so ``kv.prefetch`` hints act) in any configuration, with prefetch while waiting
    still only where the configuration turns it on. ``disk_retention``: the lower tier's
    ``retention`` (a disk tier's config value), on the replay's clock.
    ``verify_read`` reads one chunk for the hit check where ``tier.verify`` (``SimVerifier``)."""
    if config not in CONFIGS:
        raise ValueError(f"configuration {config!r}: expected one of {', '.join(CONFIGS)}")
    if min(cpu_blocks, lower_blocks) < 1:
        raise ValueError(f"cpu_blocks and lower_blocks must be >= 1, got {cpu_blocks}, {lower_blocks}")
    work = Path(tempfile.mkdtemp(prefix="replay-serving-", dir=scratch))
    engine_id = f"replay-serving-{uuid.uuid4().hex[:12]}"
    cpu = cpu_tier_for_rules(
        eviction_policy,
        cpu_blocks,
        tokens_per_block,
        parse_cpu_admission(cpu_admission, "cpu_admission"),
        parse_cpu_retention(cpu_retention, "--cpu-retention"),
        enable_events=False,
        clock=clock,
    )
    lower: list[DiskOffloadingManager] = []
    used = tier if config != "recompute" else None
    try:
        if used is not None:
            lower.append(
                DiskOffloadingManager(
                    work / "tier",
                    Fingerprint.from_layout(LAYOUT, model_id="replay-serving"),
                    LAYOUT,
                    disk_bytes=lower_blocks * slot_size_for(LAYOUT.bytes_per_block),
                    enable_events=False,
                    poll_interval=None,  # writes are learned when the simulated worker ends them
                    name=used.name,
                    medium=used.medium,
                    retention_share=retention_share(parse_retention(disk_retention, "disk_retention", "the disk tier")),
                )
            )
            if lower[-1].retention is not None:
                lower[-1].retention.clock = clock
            lower[-1].reads_first = used.kind == "disk"  # as the product's tier of that kind
        costs = LoadCosts.for_tiers(
            {"cpu": CPU, **{t.name: t.medium for t in lower}},
            bytes_per_block=bytes_per_block,
            tokens_per_block=tokens_per_block,
            prefill_tokens_per_s=prefill_tokens_per_s,
            attention_per_token=attention_per_token if config != "e460906" else 0.0,
            clock=clock,
        )
        composite = TieredOffloadingManager(
            cpu,
            lower,
            costs=costs,
            cost_aware=config in DECIDING,
            promote_on_hit=TieredConfig.promote_on_hit,
            max_pending_writes=TieredConfig.max_pending_disk_writes,
            write_policy=TieredConfig.write_policy,
        )
        checks: list[HitCheck] = []
        if used is not None:
            verifier = cast(DiskVerifier, SimVerifier(verify_read)) if used.verify else None
            checks.append(DiskHitCheck(lower[0], verifier))
        health = SlotHealth.for_engine(engine_id, cpu_blocks)
        health.clear()
        names = [t.name for t in lower]
        reader = LoadTimings.for_engine(engine_id, names, 1)
        reader.clear()
        writer = LoadTimings.for_engine(engine_id, names, 1, rank=0)
        manager = TieredVllmManager(
            composite,
            checks,
            shared=[used.kind == "shared"] if used else [],
            health=health,
            timings=reader,
            hints=HintSettings(
                prefetch_waiting=config in PREFETCHING,
                prefetch_max_bytes=UNBOUNDED if config == INSTANT_PREFETCH else prefetch_max_bytes,
            ),
        )
        if config in PREFETCHING or hint_prefetch:
            manager.hints.enable_prefetch()
        if config == "e460906":  # sees no queue, and decides a request a step after its scan
            manager._queues = Queues  # type: ignore[method-assign]
            composite.queued_blocks = composite.queued_loads = dict  # type: ignore[method-assign]
            costs.note_arrival = lambda: None  # type: ignore[method-assign]
            manager._ahead = lambda *args: None  # type: ignore[method-assign]
    except BaseException:
        for m in lower:
            m.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Stack(config, manager, writer, used, work)
