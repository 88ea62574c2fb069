"""Counters and latencies of the hierarchy: per tier (scheduler process), per transfer
type (worker processes) and of the shared tier's store (wherever one runs), as plain
stats objects and as Prometheus metrics.

No I/O. ``TieredStats`` is filled by the composite manager and the tiered handlers;
``Latencies`` holds timings until an exporter drains them; the project's own metrics
(``tiered_kv_*``) are declared once in ``PROJECT_METRICS``, which the vLLM adapter
declares to vLLM and ``tiered_kv.metrics_export.PrometheusMetrics`` exports under the
same names, from the ``*_values`` and ``*_gauges`` helpers here.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

TRANSFER_TYPES = ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu", "disk_to_gpu", "gpu_to_disk")


def gpu_direction(transfer_type: str) -> str | None:
    """vLLM's "load" for a transfer into GPU memory (``<tier>_to_gpu``: transfer types
    are named by tier, so every tier's loads count), "store" for one out of it."""
    return "load" if transfer_type.endswith("_to_gpu") else "store" if transfer_type.startswith("gpu_to_") else None


TIERS = ("cpu", "disk")
TIER_COUNTERS = (
    *("lookups", "hits", "stores", "evictions", "spills", "drops", "checksum_failures", "failed_loads"),
    *("failed_stores", "promotions", "skipped_slower_than_recompute", "probes", "not_admitted"),
    # ``cpu_admission: adaptive(N)`` changed the rule in force (``tiered.admission``).
    "admission_switches",
    # Prefetch while a request waits (``tiered.prefetch``): reads started, blocks a
    # request then loaded, blocks evicted or dropped unused, reads cancelled, failed.
    *("prefetches", "prefetch_used", "prefetch_wasted", "prefetch_cancelled", "prefetch_failed"),
)
#: The tier events also counted in tokens (blocks times tokens per block), as vLLM
#: counts its prefix cache's queries and hits.
TOKEN_EVENTS = ("lookups", "hits")

#: Latency histogram buckets, in seconds: 100 us to 30 s (a shared-tier request that
#: times out lands in the last buckets).
LATENCY_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05)
LATENCY_BUCKETS += (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

TIER_BLOCKS = "tiered_kv_tier_blocks"
TIER_TOKENS = "tiered_kv_tier_tokens"
TIER_USED_BLOCKS = "tiered_kv_tier_used_blocks"
TIER_LOAD_GBPS = "tiered_kv_tier_load_gbps"
TIER_LOAD_LATENCY = "tiered_kv_tier_load_latency_seconds"
TIER_WRITTEN_PER_READ = "tiered_kv_tier_bytes_written_per_read"
PREFILL_TOKENS_PER_S = "tiered_kv_prefill_tokens_per_second"
GPU_BUSY_SHARE = "tiered_kv_gpu_busy_share"
TRANSFER_JOBS = "tiered_kv_transfer_jobs"
TRANSFER_SECONDS = "tiered_kv_transfer_seconds"
VERIFICATION_SECONDS = "tiered_kv_verification_seconds"
#: Declared by the vLLM adapter (only its hit checks verify before a hit).
TIER_VERIFICATIONS = "tiered_kv_tier_verifications"
REMOTE_REQUEST_SECONDS = "tiered_kv_remote_request_seconds"
REMOTE_UPLOADS = "tiered_kv_remote_uploads"
REMOTE_DOWNLOADS = "tiered_kv_remote_downloads"
REMOTE_PROBES = "tiered_kv_remote_probes"
REMOTE_BYTES = "tiered_kv_remote_bytes"
REMOTE_REJECTED = "tiered_kv_remote_rejected_objects"
REMOTE_UNAVAILABLE = "tiered_kv_remote_unavailable_periods"
REMOTE_DAMAGED_DELETED = "tiered_kv_remote_damaged_deleted"
REMOTE_KEPT_UNPROVEN = "tiered_kv_remote_kept_unproven"
REMOTE_CONDITIONAL_REFUSED = "tiered_kv_remote_conditional_put_refused"
REMOTE_UNCONDITIONAL_PUTS = "tiered_kv_remote_unconditional_puts"
REMOTE_FORGERIES_REPLACED = "tiered_kv_remote_forgeries_replaced"
HINT_ACTIONS = "tiered_kv_hint_actions"
CANARY_CHECKS = "tiered_kv_canary_checks"
LEASES = "tiered_kv_leases"
LEASE_PINNED_BYTES = "tiered_kv_lease_pinned_bytes"
PREFETCH_HELD_BYTES = "tiered_kv_prefetch_held_bytes"
TIER_CAPACITY_BLOCKS = "tiered_kv_tier_capacity_blocks"
TIER_HELD_BACK_BLOCKS = "tiered_kv_tier_held_back_blocks"
TIER_INDEX_ERRORS = "tiered_kv_tier_index_errors"
PENDING_WRITES = "tiered_kv_tier_pending_writes"
PENDING_WRITES_LIMIT = "tiered_kv_tier_pending_writes_limit"
WORKER_JOB_FAILURES = "tiered_kv_worker_job_failures"
RETENTION_EVENTS = "tiered_kv_retention_events"
RETENTION_HELD_BLOCKS = "tiered_kv_retention_held_blocks"
RETENTION_TTL = "tiered_kv_retention_ttl_seconds"
RETENTION_HONOURED = "tiered_kv_retention_honoured"
#: The kinds of ``WORKER_JOB_FAILURES``.
JOB_FAILURE_KINDS = ("store", "promotion")


@dataclass(frozen=True)
class MetricDef:
    """One of the project's own metrics: its name (a counter gains ``_total`` on the
    endpoint, a histogram ``_bucket``, ``_sum`` and ``_count``), ``kind`` (``counter``,
    ``gauge`` or ``histogram``), help text, label names and, for a histogram, buckets."""

    name: str
    kind: str
    documentation: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


#: The ``tiered_kv_*`` metrics ``PrometheusMetrics`` exports; the vLLM adapter declares
#: the same names (``integrations/vllm/common.py``), so one dashboard reads both.
PROJECT_METRICS: tuple[MetricDef, ...] = (
    MetricDef(TIER_BLOCKS, "counter", "Blocks counted per tier and event", ("tier", "event")),
    MetricDef(
        TIER_TOKENS,
        "counter",
        "Tokens counted per tier and event (blocks times tokens per block); events: " + ", ".join(TOKEN_EVENTS),
        ("tier", "event"),
    ),
    MetricDef(TIER_USED_BLOCKS, "gauge", "Blocks held per tier", ("tier",)),
    MetricDef(TIER_CAPACITY_BLOCKS, "gauge", "Block slots per tier", ("tier",)),
    MetricDef(
        TIER_HELD_BACK_BLOCKS, "gauge", "Block slots neither free nor holding a block, per reason", ("tier", "reason")
    ),
    MetricDef(
        TIER_INDEX_ERRORS,
        "counter",
        "Failed operations on a disk tier's index, per op: read (of its log: what workers wrote stays pending until a "
        "read succeeds), flush (a commit, tried again)",
        ("tier", "op"),
    ),
    MetricDef(
        PENDING_WRITES, "gauge", "Blocks queued for a write into a lower tier whose outcome is not known yet", ("tier",)
    ),
    MetricDef(
        PENDING_WRITES_LIMIT,
        "gauge",
        "Most blocks a lower tier may have queued for writing (max_pending_disk_writes); past it stores are refused",
        ("tier",),
    ),
    MetricDef(
        WORKER_JOB_FAILURES,
        "counter",
        "Store and promotion jobs that failed in a worker; kind: " + ", ".join(JOB_FAILURE_KINDS),
        ("kind",),
    ),
    MetricDef(TIER_LOAD_GBPS, "gauge", "Estimated load bandwidth into the GPU per tier, GB/s", ("tier",)),
    MetricDef(TIER_LOAD_LATENCY, "gauge", "Estimated per-job load latency per tier, seconds", ("tier",)),
    MetricDef(TIER_WRITTEN_PER_READ, "gauge", "Bytes written into a tier per byte read from it", ("tier",)),
    MetricDef(
        PREFILL_TOKENS_PER_S,
        "gauge",
        "Prefill tokens per second: 'used' by the load-versus-recompute decision, and 'measured' on the "
        "engine's own forward passes where it times them",
        ("kind",),
    ),
    MetricDef(
        GPU_BUSY_SHARE,
        "gauge",
        "Share of the last 30 s the GPU spent computing, 'estimated' by the load decision from the steps it is told of",
        ("kind",),
    ),
    MetricDef(TRANSFER_JOBS, "counter", "Transfer jobs finished", ("transfer_type", "outcome")),
    MetricDef(
        TRANSFER_SECONDS,
        "histogram",
        "Seconds of each successful transfer job, per transfer type (disk loads: disk_to_cpu, disk_to_gpu)",
        ("transfer_type",),
        LATENCY_BUCKETS,
    ),
    MetricDef(
        VERIFICATION_SECONDS,
        "histogram",
        "Seconds to verify one chunk on every rank before a lookup reports it as a hit, per tier",
        ("tier",),
        LATENCY_BUCKETS,
    ),
    MetricDef(
        REMOTE_REQUEST_SECONDS,
        "histogram",
        "Seconds of each shared-tier request, whatever its outcome; op: get, put, head, delete",
        ("op",),
        LATENCY_BUCKETS,
    ),
    MetricDef(
        REMOTE_UPLOADS, "counter", "Shared-tier block uploads; outcome: stored, present, dropped, failed", ("outcome",)
    ),
    MetricDef(
        REMOTE_DOWNLOADS,
        "counter",
        "Shared-tier block downloads; outcome: hit, absent, failed, skipped (server unavailable), rejected",
        ("outcome",),
    ),
    MetricDef(REMOTE_PROBES, "counter", "Shared-tier existence probes (HEAD); outcome: ok, failed", ("outcome",)),
    MetricDef(REMOTE_BYTES, "counter", "Block bytes moved to and from the shared tier", ("direction",)),
    MetricDef(REMOTE_REJECTED, "counter", "Shared-tier objects refused by a check, per reason", ("reason",)),
    MetricDef(REMOTE_UNAVAILABLE, "counter", "Times the shared-tier store stopped sending after consecutive failures"),
    MetricDef(REMOTE_DAMAGED_DELETED, "counter", "Shared-tier objects deleted on reading them, proven bad"),
    MetricDef(REMOTE_FORGERIES_REPLACED, "counter", "Shared-tier objects proven bad at a write and replaced"),
    MetricDef(
        REMOTE_KEPT_UNPROVEN,
        "counter",
        "Shared-tier objects refused and left in place: this node cannot prove them bad "
        "(sealed under a key id it does not hold, sealed where it has no key, a newer format)",
    ),
    MetricDef(REMOTE_CONDITIONAL_REFUSED, "counter", "Conditional PUTs the server refused as unsupported"),
    MetricDef(REMOTE_UNCONDITIONAL_PUTS, "counter", "Shared-tier writes sent as a plain PUT after a HEAD"),
    MetricDef(
        HINT_ACTIONS,
        "counter",
        "KV-hint actions read from requests, per action (retain, prefetch, release, other) and outcome "
        "(accepted, malformed, unsupported, unsupported_version, unknown_action, too_many)",
        ("action", "outcome"),
    ),
    MetricDef(LEASES, "gauge", "Leases held by kv.retain hints"),
    MetricDef(
        CANARY_CHECKS,
        "counter",
        "Workers' start-up canaries; outcome: passed, partial (a disk tier could not be exercised: logged), skipped "
        "(the engine's attention tensors not visible, or no spare blocks), off (canary: false). A failed one stops "
        "the engine",
        ("outcome",),
    ),
    MetricDef(LEASE_PINNED_BYTES, "gauge", "Bytes pinned by leases per tier", ("tier",)),
    MetricDef(
        PREFETCH_HELD_BYTES, "gauge", "Bytes of CPU-tier blocks held for waiting requests (prefetch while waiting)"
    ),
    MetricDef(
        RETENTION_EVENTS,
        "counter",
        "Session retention per tier: returns (a session's turns after its first), held (blocks a hold "
        "took), dropped (held blocks let go early for the budget), switches (the tier began or stopped "
        "honouring holds, cpu_admission adaptive(N))",
        ("tier", "event"),
    ),
    MetricDef(RETENTION_HELD_BLOCKS, "gauge", "Blocks session retention holds per tier", ("tier",)),
    MetricDef(RETENTION_TTL, "gauge", "Session retention's hold time per tier, learned from sessions' gaps", ("tier",)),
    MetricDef(
        RETENTION_HONOURED, "gauge", "1 while the tier passes held blocks over, 0 while they cost hits", ("tier",)
    ),
)

#: ``RemoteStats`` attribute -> (metric, label values).
_REMOTE_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "puts_stored": (REMOTE_UPLOADS, ("stored",)),
    "puts_present": (REMOTE_UPLOADS, ("present",)),
    "puts_dropped": (REMOTE_UPLOADS, ("dropped",)),
    "puts_failed": (REMOTE_UPLOADS, ("failed",)),
    "gets_hit": (REMOTE_DOWNLOADS, ("hit",)),
    "gets_absent": (REMOTE_DOWNLOADS, ("absent",)),
    "gets_failed": (REMOTE_DOWNLOADS, ("failed",)),
    "gets_skipped": (REMOTE_DOWNLOADS, ("skipped",)),
    "gets_rejected": (REMOTE_DOWNLOADS, ("rejected",)),
    "probes": (REMOTE_PROBES, ("ok",)),
    "probes_failed": (REMOTE_PROBES, ("failed",)),
    "put_bytes": (REMOTE_BYTES, ("upload",)),
    "get_bytes": (REMOTE_BYTES, ("download",)),
    "unavailable_periods": (REMOTE_UNAVAILABLE, ()),
    "damaged_deleted": (REMOTE_DAMAGED_DELETED, ()),
    "forgeries_replaced": (REMOTE_FORGERIES_REPLACED, ()),
    "kept_unproven": (REMOTE_KEPT_UNPROVEN, ()),
    "conditional_put_refused": (REMOTE_CONDITIONAL_REFUSED, ()),
    "puts_unconditional": (REMOTE_UNCONDITIONAL_PUTS, ()),
}

#: A counter's value: (metric, label values, total since the source started).
CounterValue = tuple[str, tuple[str, ...], float]


def remote_counter_values(stats: Any) -> list[CounterValue]:
    """The shared tier's counters of ``stats`` (a ``tiered_kv.remote.RemoteStats``) as metric totals."""
    out = [(metric, labels, getattr(stats, attr)) for attr, (metric, labels) in _REMOTE_FIELDS.items()]
    out += [(REMOTE_REJECTED, (reason,), n) for reason, n in stats.rejected.items()]
    return out


def tier_counter_values(tiers: Mapping[str, Mapping[str, int]], tokens_per_block: int | None) -> list[CounterValue]:
    """Per-tier counters (``TieredStats.as_dict()["tiers"]``) as metric totals: every event in blocks,
    ``TOKEN_EVENTS`` also in tokens (not when ``tokens_per_block`` is None)."""
    out: list[CounterValue] = []
    for tier, counters in tiers.items():
        for event, value in counters.items():
            out.append((TIER_BLOCKS, (tier, event), value))
            if event in TOKEN_EVENTS and tokens_per_block is not None:
                out.append((TIER_TOKENS, (tier, event), value * tokens_per_block))
    return out


def transfer_job_values(transfers: Mapping[str, Mapping[str, float]]) -> list[CounterValue]:
    """The transfer jobs of ``transfers`` (``TieredStats.as_dict()["transfers"]``) as
    metric totals, per transfer type and outcome (ok, failed)."""
    out: list[CounterValue] = []
    for name, t in transfers.items():
        out += [
            (TRANSFER_JOBS, (name, "ok"), t["jobs"] - t["failed_jobs"]),
            (TRANSFER_JOBS, (name, "failed"), t["failed_jobs"]),
        ]
    return out


def written_per_read_gauges(stats: TieredStats) -> list[CounterValue]:
    """``TIER_WRITTEN_PER_READ`` of each tier of ``stats`` read from at least once."""
    return [(TIER_WRITTEN_PER_READ, (t,), r) for t, r in stats.written_per_read().items() if r is not None]


def cost_gauges(costs: Mapping | None) -> list[CounterValue]:
    """The load-cost gauges of ``costs`` (a ``LoadCosts.snapshot()``, or None): each
    tier's estimated bandwidth and job latency, the prefill rate the decision uses and,
    once measured, the measured one, and the GPU's busy share once steps are reported."""
    if not costs:
        return []
    out: list[CounterValue] = []
    for tier, est in costs["tiers"].items():
        out += [(TIER_LOAD_GBPS, (tier,), est["gbps"]), (TIER_LOAD_LATENCY, (tier,), est["latency_s"])]
    out.append((PREFILL_TOKENS_PER_S, ("used",), costs["prefill_tokens_per_s"]))
    if costs.get("prefill_measured"):
        out.append((PREFILL_TOKENS_PER_S, ("measured",), costs["prefill_measured"]["tokens_per_s"]))
    if costs.get("gpu_busy_share") is not None:
        out.append((GPU_BUSY_SHARE, ("estimated",), costs["gpu_busy_share"]))
    return out


@dataclass(frozen=True)
class Occupancy:
    """Per tier: blocks held (``used``) and block slots (``capacity``); per lower tier: blocks queued for
    writing into it (``pending_writes``) and the most it may queue (``pending_writes_limit``: past it,
    stores are refused) and, where it has them, the slots it holds back per reason (``held_back_slots()``)."""

    used: Mapping[str, int]
    capacity: Mapping[str, int]
    pending_writes: Mapping[str, int]
    pending_writes_limit: Mapping[str, int]
    held_back: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


def hierarchy_occupancy(manager: Any) -> Occupancy:
    """The occupancy of a ``tiered_kv.tiered.manager.TieredOffloadingManager`` (its CPU tier and its lower
    tiers). Pending writes are read, not refreshed: at most a flusher poll old."""
    lower = manager.lower
    return Occupancy(
        used=manager.used_blocks(),
        capacity={"cpu": manager.cpu.num_slots, **{t.name: t.capacity for t in lower}},
        pending_writes={t.name: t.num_pending() for t in lower},
        pending_writes_limit={t.name: manager.max_pending_writes for t in lower},
        held_back={t.name: t.held_back_slots() for t in lower if hasattr(t, "held_back_slots")},
    )


def index_error_values(tiers: Iterable[Any]) -> list[CounterValue]:
    """The index errors of those lower ``tiers`` that keep an index (their ``stats``
    have ``index_errors()``: ``DiskManagerStats``), per op, as metric totals."""
    out: list[CounterValue] = []
    for t in tiers:
        errors = getattr(getattr(t, "stats", None), "index_errors", None)
        out += [(TIER_INDEX_ERRORS, (t.name, op), n) for op, n in errors().items()] if errors else []
    return out


def occupancy_gauges(occupancy: Occupancy | None) -> list[CounterValue]:
    """The gauges of ``occupancy`` (None: none)."""
    if occupancy is None:
        return []
    out: list[CounterValue] = []
    for name, values in (
        (TIER_USED_BLOCKS, occupancy.used),
        (TIER_CAPACITY_BLOCKS, occupancy.capacity),
        (PENDING_WRITES, occupancy.pending_writes),
        (PENDING_WRITES_LIMIT, occupancy.pending_writes_limit),
    ):
        out += [(name, (tier,), n) for tier, n in values.items()]
    out += [(TIER_HELD_BACK_BLOCKS, (t, why), n) for t, held in occupancy.held_back.items() for why, n in held.items()]
    return out


#: One timing: (histogram metric, label values, seconds).
Observation = tuple[str, tuple[str, ...], float]


class Latencies:
    """Timings waiting for an exporter to drain them. Thread-safe.

    Bounded: past ``max_pending`` undrained timings the oldest are discarded (counted
    in ``discarded``), so a process that nobody scrapes holds at most that many. Each
    object has one exporter: ``drain`` hands a timing out once."""

    def __init__(self, max_pending: int = 65536):
        if max_pending < 1:
            raise ValueError(f"max_pending: expected at least 1, got {max_pending}")
        self._pending: deque[Observation] = deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self.discarded = 0

    def observe(self, metric: str, labels: tuple[str, ...], seconds: float) -> None:
        with self._lock:
            if len(self._pending) == self._pending.maxlen:
                self.discarded += 1
            self._pending.append((metric, labels, seconds))

    def drain(self) -> list[Observation]:
        """The timings observed since the last call, oldest first."""
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
        return out


@dataclass
class TransferCounter:
    """Jobs, blocks, bytes and seconds of one transfer type (blocks and bytes count
    successful jobs only)."""

    bytes: int = 0
    seconds: float = 0.0
    jobs: int = 0
    failed_jobs: int = 0
    blocks: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class TieredStats:
    """Thread-safe counters. ``tiers[tier][counter]`` counts blocks; ``transfers[type]``
    counts bytes and seconds: each job's transfer time as its handler measures it, from
    when it starts moving data to when its last byte lands (CUDA events for device
    copies), never the wait until the engine polls it; summed over jobs, so concurrent
    jobs overlap and ``gbps`` is the rate of one job, as in vLLM's metrics. Each
    successful job's seconds also go to ``latencies`` (``TRANSFER_SECONDS``), which
    ``merge`` leaves alone (each object's are drained by its own exporter)."""

    tiers: dict[str, dict[str, int]] = field(
        default_factory=lambda: {t: dict.fromkeys(TIER_COUNTERS, 0) for t in TIERS}
    )
    transfers: dict[str, TransferCounter] = field(
        default_factory=lambda: {t: TransferCounter() for t in TRANSFER_TYPES}
    )
    latencies: Latencies = field(default_factory=Latencies, repr=False, compare=False)
    #: Called with ``(transfer_type, bytes, seconds, success)`` of every recorded transfer
    #: (e.g. ``tiered_kv.cost.LoadCosts.observe``), outside the lock.
    observers: list[Callable[[str, int, float, bool], None]] = field(default_factory=list, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, tier: str, counter: str, n: int = 1) -> None:
        """Add ``n`` to ``tier``'s ``counter`` (a tier named here for the first time, such
        as a second disk tier, starts with every counter at 0)."""
        if n:
            with self._lock:
                self._tier(tier)[counter] += n

    def _tier(self, tier: str) -> dict[str, int]:
        counters = self.tiers.get(tier)
        if counters is None:
            counters = self.tiers[tier] = dict.fromkeys(TIER_COUNTERS, 0)
        return counters

    def record_transfer(
        self, transfer_type: str, num_bytes: int, seconds: float, success: bool = True, blocks: int = 0
    ) -> None:
        with self._lock:
            t = self.transfers.get(transfer_type)
            if t is None:  # a lower tier's own types, e.g. cpu_to_disk2
                t = self.transfers[transfer_type] = TransferCounter()
            t.jobs += 1
            if success:
                t.bytes += num_bytes
                t.blocks += blocks
                t.seconds += seconds
            else:
                t.failed_jobs += 1
        if success:
            self.latencies.observe(TRANSFER_SECONDS, (transfer_type,), seconds)
        for observe in self.observers:
            observe(transfer_type, num_bytes, seconds, success)

    def written_per_read(self) -> dict[str, float | None]:
        """Per tier: blocks written into it per block later read from it (its ``stores``
        over its ``hits``; blocks are of one size, so the same in bytes); None before
        any read."""
        with self._lock:
            return {k: (v["stores"] / v["hits"] if v["hits"] else None) for k, v in self.tiers.items()}

    def merge(self, other: "TieredStats") -> None:
        """Add ``other``'s counters into these (e.g. a worker's into the manager's view)."""
        with self._lock:
            for tier, counters in other.tiers.items():
                mine_tier = self._tier(tier)
                for name, value in counters.items():
                    mine_tier[name] += value
            for name, t in other.transfers.items():
                mine = self.transfers.setdefault(name, TransferCounter())
                mine.bytes += t.bytes
                mine.blocks += t.blocks
                mine.seconds += t.seconds
                mine.jobs += t.jobs
                mine.failed_jobs += t.failed_jobs

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "tiers": {k: dict(v) for k, v in self.tiers.items()},
                "transfers": {
                    k: {f: getattr(v, f) for f in ("bytes", "blocks", "seconds", "jobs", "failed_jobs", "gbps")}
                    for k, v in self.transfers.items()
                },
            }
