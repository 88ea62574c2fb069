"""Prometheus export of the hierarchy's stats outside vLLM (``tiered-kv demo --metrics-port``,
tools): ``PrometheusMetrics`` mirrors ``TieredStats`` snapshots into prometheus_client
metrics named in vLLM's style (``vllm:kv_offload_*``) plus the project's own
(``tiered_kv.metrics.PROJECT_METRICS``). Inside vLLM the adapter reports the same names
through vLLM's own metrics (``integrations/vllm/common.py``).

Runs in whichever process exports; no I/O (serving the registry is the caller's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tiered_kv.metrics import (
    JOB_FAILURE_KINDS,
    PROJECT_METRICS,
    TIER_USED_BLOCKS,
    WORKER_JOB_FAILURES,
    CounterValue,
    Latencies,
    MetricDef,
    Occupancy,
    TieredStats,
    cost_gauges,
    gpu_direction,
    occupancy_gauges,
    remote_counter_values,
    tier_counter_values,
    transfer_job_values,
    written_per_read_gauges,
)

__all__ = ["PrometheusMetrics"]


class PrometheusMetrics:
    """prometheus_client metrics fed from ``TieredStats`` snapshots.

    ``update(stats)`` sets each metric to the snapshot's value (counters are exported as
    monotonically increasing totals: only the increase since the last update is added)
    and drains the timings into the histograms. vLLM 0.33's names:
    ``vllm:kv_offload_{load,store}_{bytes,time}`` (into and out of GPU memory, whatever
    the tier) and its older ``vllm:kv_offload_total_{bytes,time}`` per
    ``transfer_type`` (all six of ours); then the project's own ``PROJECT_METRICS``.
    ``tokens_per_block``: tokens of one of the manager's blocks (the spec's
    ``offloaded_block_size``); without it ``TIER_TOKENS`` stays empty. ``extra``: the
    metrics the config's tier types add (``tiers.tier_metric_definitions``), fed by
    ``update(counters=...)`` (their ``worker_counters``).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        tokens_per_block: int | None = None,
        extra: Sequence[MetricDef] = (),
    ):
        if tokens_per_block is not None and tokens_per_block < 1:
            raise ValueError(f"tokens_per_block: expected at least 1, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
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
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        #: The project's own metrics by name (``PROJECT_METRICS``).
        self.metrics: dict[str, Any] = {}
        for d in (*PROJECT_METRICS, *(e for e in extra if e.name not in {p.name for p in PROJECT_METRICS})):
            buckets = {"buckets": d.buckets} if d.buckets is not None else {}
            self.metrics[d.name] = kinds[d.kind](d.name, d.documentation, d.labelnames, registry=r, **buckets)
        # Every kind from the start: an alert on their increase sees a series before the first failure.
        for kind in JOB_FAILURE_KINDS:
            self.metrics[WORKER_JOB_FAILURES].labels(kind)
        self._last: dict[tuple, float] = {}

    def _advance(self, counter: Counter, labels: tuple, value: float, store: int | None = None) -> None:
        """Add what ``value``, a total, grew by since the last update. Of a shared-tier
        ``store`` (its place in ``update``'s ``remote``), a total that fell is a store
        that started again, all of whose total is new."""
        key = (id(counter), labels, store)
        last = self._last.get(key, 0)
        child = counter.labels(*labels) if labels else counter  # a series from the first update, at 0
        if store is not None and value < last:
            last = self._last[key] = 0  # the store started again
        if value > last:
            child.inc(value - last)
            self._last[key] = value

    def update(
        self,
        stats: TieredStats,
        used_blocks: Mapping[str, int] | None = None,
        *,
        remote: Sequence[Any] = (),
        latencies: Iterable[Latencies] = (),
        costs: Mapping | None = None,
        occupancy: Occupancy | None = None,
        job_failures: Mapping[str, float] | None = None,
        counters: Iterable[CounterValue] = (),
        gauges: Iterable[CounterValue] = (),
    ) -> None:
        """Export ``stats``, the tiers' ``used_blocks``, the summed counters of the
        shared-tier stores' ``remote`` stats (``RemoteStore.stats()``, e.g. the
        scheduler's and a worker's), the load estimates of ``costs`` (a
        ``LoadCosts.snapshot()``), the tiers' ``occupancy`` (e.g.
        ``hierarchy_occupancy(manager)``, which includes ``used_blocks``), the failed
        worker jobs per kind of ``job_failures`` (totals since the start), the tiers' own
        ``counters`` (totals, e.g. their ``worker_counters()``) and ``gauges`` (values now, e.g.
        session retention's ``retention_metric_values``), and drain
        ``stats.latencies`` and ``latencies`` (e.g. a store's ``RemoteStore.latencies``)."""
        snap = stats.as_dict()
        for name, labels, value in [*occupancy_gauges(occupancy), *cost_gauges(costs), *written_per_read_gauges(stats)]:
            self.metrics[name].labels(*labels).set(value)
        for kind, n in (job_failures or {}).items():
            self._advance(self.metrics[WORKER_JOB_FAILURES], (kind,), n)
        transfers = snap["transfers"]
        for direction in ("load", "store"):
            types = [t for t in transfers if gpu_direction(t) == direction]
            self._advance(self.gpu_bytes[direction], (), sum(transfers[t]["bytes"] for t in types))
            self._advance(self.gpu_time[direction], (), sum(transfers[t]["seconds"] for t in types))
        for name, t in transfers.items():
            self._advance(self.bytes, (name,), t["bytes"])
            self._advance(self.time, (name,), t["seconds"])
        for i, rs in enumerate(remote, 1):  # each store's totals its own: one may restart
            for metric, labels, value in remote_counter_values(rs):
                self._advance(self.metrics[metric], labels, value, i)
        own = tier_counter_values(snap["tiers"], self.tokens_per_block) + transfer_job_values(transfers)
        for metric, labels, value in [*own, *counters]:
            self._advance(self.metrics[metric], labels, value)
        for tier, n in (used_blocks or {}).items():
            self.metrics[TIER_USED_BLOCKS].labels(tier).set(n)
        for name, labels, value in gauges:
            self.metrics[name].labels(*labels).set(value)
        for source in (stats.latencies, *latencies):
            for metric, labels, seconds in source.drain():
                self.metrics[metric].labels(*labels).observe(seconds)
