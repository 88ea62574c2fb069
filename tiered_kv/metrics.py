"""Counters of the hierarchy: per tier (scheduler process) and per transfer type
(worker processes), as a plain stats object and as Prometheus metrics.

No I/O. ``TieredStats`` is filled by the composite manager and the tiered handlers;
``PrometheusMetrics`` mirrors a stats snapshot into prometheus_client metrics named
in vLLM's style (``vllm:kv_offload_*``) plus the project's own (``tiered_kv_*``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

TRANSFER_TYPES = ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu", "disk_to_gpu", "gpu_to_disk")
#: The transfer types into and out of GPU memory: vLLM's "load" and "store".
GPU_LOADS = ("cpu_to_gpu", "disk_to_gpu")
GPU_STORES = ("gpu_to_cpu", "gpu_to_disk")
TIERS = ("cpu", "disk")
TIER_COUNTERS = (
    "lookups",
    "hits",
    "stores",
    "evictions",
    "spills",
    "drops",
    "checksum_failures",
    "failed_loads",
    "failed_stores",
    "promotions",
)


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
    jobs overlap and ``gbps`` is the rate of one job, as in vLLM's metrics."""

    tiers: dict[str, dict[str, int]] = field(
        default_factory=lambda: {t: dict.fromkeys(TIER_COUNTERS, 0) for t in TIERS}
    )
    transfers: dict[str, TransferCounter] = field(
        default_factory=lambda: {t: TransferCounter() for t in TRANSFER_TYPES}
    )
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
                    k: {
                        "bytes": v.bytes,
                        "blocks": v.blocks,
                        "seconds": v.seconds,
                        "jobs": v.jobs,
                        "failed_jobs": v.failed_jobs,
                        "gbps": v.gbps,
                    }
                    for k, v in self.transfers.items()
                },
            }


class PrometheusMetrics:
    """prometheus_client metrics fed from ``TieredStats`` snapshots.

    ``update(stats)`` sets each metric to the snapshot's value (counters are exported as
    monotonically increasing totals: only the increase since the last update is added).
    vLLM 0.33's names: ``vllm:kv_offload_{load,store}_{bytes,time}`` (into and out of
    GPU memory, whatever the tier) and its older ``vllm:kv_offload_total_{bytes,time}``
    per ``transfer_type`` (all six of ours); then the project's own ``tiered_kv_*``.
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.gpu_bytes = {
            "load": Counter("vllm:kv_offload_load_bytes", "Bytes loaded from offload storage to GPU", registry=r),
            "store": Counter("vllm:kv_offload_store_bytes", "Bytes stored from GPU to offload storage", registry=r),
        }
        self.gpu_time = {
            "load": Counter("vllm:kv_offload_load_time", "Seconds of loads from offload storage to GPU", registry=r),
            "store": Counter("vllm:kv_offload_store_time", "Seconds of stores from GPU to offload storage", registry=r),
        }
        self.bytes = Counter(
            "vllm:kv_offload_total_bytes", "Bytes moved by KV offloading", ["transfer_type"], registry=r
        )
        self.time = Counter(
            "vllm:kv_offload_total_time", "Seconds spent in KV offloading transfers", ["transfer_type"], registry=r
        )
        self.jobs = Counter(
            "tiered_kv_transfer_jobs", "Transfer jobs finished", ["transfer_type", "outcome"], registry=r
        )
        self.tier_events = Counter(
            "tiered_kv_tier_blocks", "Blocks counted per tier and event", ["tier", "event"], registry=r
        )
        self.occupancy = Gauge("tiered_kv_tier_used_blocks", "Blocks held per tier", ["tier"], registry=r)
        self._last: dict[tuple, float] = {}

    def _advance(self, counter: Counter, labels: tuple, value: float) -> None:
        key = (id(counter), labels)
        delta = value - self._last.get(key, 0)
        if delta > 0:
            (counter.labels(*labels) if labels else counter).inc(delta)
            self._last[key] = value

    def update(self, stats: TieredStats, used_blocks: dict[str, int] | None = None) -> None:
        snap = stats.as_dict()
        transfers = snap["transfers"]
        for direction, types in (("load", GPU_LOADS), ("store", GPU_STORES)):
            self._advance(self.gpu_bytes[direction], (), sum(transfers[t]["bytes"] for t in types))
            self._advance(self.gpu_time[direction], (), sum(transfers[t]["seconds"] for t in types))
        for name, t in transfers.items():
            self._advance(self.bytes, (name,), t["bytes"])
            self._advance(self.time, (name,), t["seconds"])
            self._advance(self.jobs, (name, "ok"), t["jobs"] - t["failed_jobs"])
            self._advance(self.jobs, (name, "failed"), t["failed_jobs"])
        for tier, counters in snap["tiers"].items():
            for event, value in counters.items():
                self._advance(self.tier_events, (tier, event), value)
        for tier, n in (used_blocks or {}).items():
            self.occupancy.labels(tier).set(n)
