"""Counters and latencies of the hierarchy as stats objects and as Prometheus metrics:
a real run of the simulator's engine loop, the shared tier's store against a real S3
server (Ceph RGW) with faults injected by a proxy, and the Grafana dashboard's queries
checked against the names the project exports."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest
from support.promql import promql_metric_names
from support.s3_server import FaultProxy, missing_reason

from tiered_kv.fingerprint import Fingerprint
from tiered_kv.metrics import (
    REMOTE_REQUEST_SECONDS,
    TIER_TOKENS,
    TRANSFER_SECONDS,
    VERIFICATION_SECONDS,
    Latencies,
    TieredStats,
)
from tiered_kv.metrics_export import PrometheusMetrics
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore
from tiered_kv.sim.driver import DeviceKVCache, EngineDriver
from tiered_kv.sim.workloads import default_workload
from tiered_kv.tiered.spec import HierarchySpec

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "tiered-kv.json"


def test_stats_record_and_merge():
    a, b = TieredStats(), TieredStats()
    a.count("cpu", "hits", 3)
    a.record_transfer("gpu_to_cpu", 1000, 0.5)
    b.record_transfer("gpu_to_cpu", 500, 0.5)
    b.record_transfer("disk_to_cpu", 10, 1.0, success=False)
    a.merge(b)
    snap = a.as_dict()
    assert snap["tiers"]["cpu"]["hits"] == 3
    assert snap["transfers"]["gpu_to_cpu"] == {
        "bytes": 1500,
        "blocks": 0,
        "seconds": 1.0,
        "jobs": 2,
        "failed_jobs": 0,
        "gbps": 1500 / 1.0 / 1e9,
    }
    assert snap["transfers"]["disk_to_cpu"]["failed_jobs"] == 1 and snap["transfers"]["disk_to_cpu"]["bytes"] == 0


def test_vllms_flat_load_and_store_metrics_sum_the_transfers_into_and_out_of_gpu():
    stats = TieredStats()
    for kind, nbytes, seconds in (
        ("cpu_to_gpu", 100, 0.5),
        ("disk_to_gpu", 50, 0.25),
        ("gpu_to_cpu", 30, 0.125),
        ("gpu_to_disk", 2, 0.0625),
        ("cpu_to_disk", 999, 9.0),
        ("disk_to_cpu", 7, 1.0),
        ("remote_to_gpu", 1000, 2.0),  # every tier's loads, by the tier's name
        ("remote_to_cpu", 5000, 3.0),
    ):
        stats.record_transfer(kind, nbytes, seconds)
    metrics = PrometheusMetrics()
    metrics.update(stats)
    text = generate_latest(metrics.registry).decode()
    for line in (
        "vllm:kv_offload_load_bytes_total 1150.0",
        "vllm:kv_offload_load_time_total 2.75",
        "vllm:kv_offload_store_bytes_total 32.0",
        "vllm:kv_offload_store_time_total 0.1875",
    ):
        assert line in text.splitlines()


def _settle(stats: TieredStats) -> None:
    """Wait until the disk writes a run queued have landed (the counters stop moving)."""
    before = None
    deadline = time.monotonic() + 60
    while (now := stats.as_dict()) != before:
        assert time.monotonic() < deadline, "the counters never settled"
        before = now
        time.sleep(0.1)


def test_prometheus_metrics_follow_a_real_run(tmp_path):
    device = DeviceKVCache(
        num_layers=2, num_gpu_blocks=64, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu"
    )
    layout = device.layout
    spec = HierarchySpec(
        {
            "cpu_bytes": f"{32 * layout.bytes_per_block}B",
            "disk_path": str(tmp_path),
            "disk_bytes": "4MiB",
            "model_id": "metrics",
            "cover_weights": False,
        },
        layout.gpu_block_size,
        layout,
    )
    driver = EngineDriver.from_spec(spec, device)
    driver.run(default_workload(40, seed=3))
    _settle(spec.stats)
    metrics = PrometheusMetrics(tokens_per_block=spec.offloaded_block_size)
    jobs = {name: t.jobs - t.failed_jobs for name, t in spec.stats.transfers.items()}
    metrics.update(spec.stats, driver.manager.used_blocks())
    text = generate_latest(metrics.registry).decode()
    registry = metrics.registry
    for tier, counters in spec.stats.tiers.items():
        for event in ("lookups", "hits"):
            tokens = registry.get_sample_value(f"{TIER_TOKENS}_total", {"tier": tier, "event": event})
            assert (tokens or 0) == counters[event] * spec.offloaded_block_size
    assert spec.stats.tiers["cpu"]["lookups"] > 0
    # One observation per successful job, each drained once.
    for name, n in jobs.items():
        assert registry.get_sample_value(f"{TRANSFER_SECONDS}_count", {"transfer_type": name}) == (n or None)
    assert spec.stats.latencies.drain() == []
    stored = spec.stats.transfers["gpu_to_cpu"].bytes
    assert stored > 0
    assert f'vllm:kv_offload_total_bytes_total{{transfer_type="gpu_to_cpu"}} {float(stored)}' in text
    assert f"vllm:kv_offload_store_bytes_total {float(stored)}" in text
    assert 'tiered_kv_tier_blocks_total{event="evictions",tier="cpu"}' in text
    assert 'tiered_kv_tier_used_blocks{tier="cpu"} 32.0' in text
    # A second update adds only the increase: totals equal the stats, not twice them.
    driver.run(default_workload(10, seed=4))
    metrics.update(spec.stats, driver.manager.used_blocks())
    text = generate_latest(metrics.registry).decode()
    assert (
        f'vllm:kv_offload_total_bytes_total{{transfer_type="gpu_to_cpu"}} '
        f"{float(spec.stats.transfers['gpu_to_cpu'].bytes)}"
    ) in text
    driver.worker.shutdown()
    driver.manager.shutdown()
    spec.store.close()


def test_latencies_are_bounded_and_drained_once():
    lat = Latencies(max_pending=3)
    for i in range(5):
        lat.observe(TRANSFER_SECONDS, ("disk_to_cpu",), float(i))
    assert [seconds for _, _, seconds in lat.drain()] == [2.0, 3.0, 4.0]
    assert lat.discarded == 2 and lat.drain() == []
    with pytest.raises(ValueError, match="max_pending: expected at least 1, got 0"):
        Latencies(0)


# ---------------------------------------------------------------- the shared tier

FP = Fingerprint("org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), 1, "sha256", "")
WAIT = 120  # a hang guard on futures, far beyond every configured timeout


def _blocks(n: int, seed: int, size: int = 16 << 10) -> list[tuple[bytes, int, bytes]]:
    rng = np.random.default_rng(seed)
    return [(rng.bytes(32), 0, rng.bytes(size)) for _ in range(n)]


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_shared_tier_counters_and_request_latencies_are_exported(rgw_server, remote_settings):
    """Stored, rejected, failed and dropped uploads and an unavailable period, made by a
    real server and a proxy answering 503, reach the endpoint as the store counted them."""
    stored, late = _blocks(4, seed=1), _blocks(4, seed=2)
    with FaultProxy(rgw_server.endpoint.removeprefix("http://")) as proxy:
        config = RemoteConfig.from_dict(
            {
                **remote_settings,
                "endpoint": proxy.endpoint,
                "retries": 0,
                "failure_threshold": 2,
                "unavailable_cooldown": "1h",
                "max_connections": 1,
            }
        )
        with RemoteStore(config, FP) as store:
            assert store.put_blocks(stored).result(WAIT) == [PutOutcome.STORED] * 4
            bufs = [bytearray(len(d)) for _, _, d in stored]
            bufs[0] = bytearray(len(bufs[0]) + 1)  # another size: the object is rejected
            hits = store.get_blocks([(h, r, b) for (h, r, _), b in zip(stored, bufs)]).result(WAIT)
            assert hits == [False, True, True, True]
            proxy.set_mode("503")
            outcomes = store.put_blocks(late).result(WAIT)
            assert outcomes[:2] == [PutOutcome.FAILED] * 2 and outcomes[2:] == [PutOutcome.DROPPED] * 2
            rs = store.stats()
            metrics = PrometheusMetrics()
            metrics.update(TieredStats(), remote=[rs], latencies=[store.latencies])
    value = metrics.registry.get_sample_value
    assert rs.puts_stored == 4 and rs.puts_failed == 2 and rs.puts_dropped == 2 and rs.unavailable_periods == 1
    for outcome, n in {"stored": 4, "failed": 2, "dropped": 2}.items():
        assert value("tiered_kv_remote_uploads_total", {"outcome": outcome}) == n
    assert value("tiered_kv_remote_downloads_total", {"outcome": "hit"}) == 3
    assert value("tiered_kv_remote_downloads_total", {"outcome": "rejected"}) == 1
    assert value("tiered_kv_remote_rejected_objects_total", {"reason": "size"}) == 1
    assert value("tiered_kv_remote_unavailable_periods_total") == 1
    assert value("tiered_kv_remote_bytes_total", {"direction": "upload"}) == rs.put_bytes == 4 * (16 << 10)
    # Every request sent is timed: the start-up check's PUT and GET, 4 + 2 block PUTs
    # (the 2 dropped were never sent), 4 GETs and one more of the object of another size
    # (read whole to judge it).
    assert value(f"{REMOTE_REQUEST_SECONDS}_count", {"op": "put"}) == 1 + 4 + 2
    assert value(f"{REMOTE_REQUEST_SECONDS}_count", {"op": "get"}) == 1 + 4 + 1
    assert value(f"{REMOTE_REQUEST_SECONDS}_sum", {"op": "put"}) > 0


def test_a_store_that_restarts_among_those_summed_keeps_its_counters_moving():
    """Two processes' stores feed one metric; one restarts and counts from 0: what it
    counts after the restart is added at once (a sum would stay below its old total, and
    the metric would stand still until it passed it). Replaced forgeries are exported."""
    from tiered_kv.remote.store.outcomes import RemoteStats

    metrics, stats = PrometheusMetrics(), TieredStats()
    a, b = RemoteStats(gets_hit=1000), RemoteStats(gets_hit=1000, forgeries_replaced=2)
    metrics.update(stats, remote=[a, b])

    def hits():
        return metrics.registry.get_sample_value("tiered_kv_remote_downloads_total", {"outcome": "hit"})

    assert hits() == 2000
    assert metrics.registry.get_sample_value("tiered_kv_remote_forgeries_replaced_total") == 2
    b = RemoteStats()  # restarted
    for served, total in ((300, 2300), (600, 2600)):
        b.gets_hit = served
        metrics.update(stats, remote=[a, b])
        assert hits() == total
    a.gets_hit += 5
    metrics.update(stats, remote=[a, b])
    assert hits() == 2605


# ---------------------------------------------------------------- the dashboard

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_names() -> set[str]:
    """Every sample name the project exports: PrometheusMetrics' families, and the
    metrics the vLLM adapter declares to vLLM."""
    pytest.importorskip("vllm", reason="the vLLM adapter's metric definitions need vLLM")
    from tiered_kv.integrations.vllm.common import metric_definitions
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingHistogramMetadata

    names = set()
    for family in PrometheusMetrics().registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    for name, meta in metric_definitions().items():
        kind = "counter" if isinstance(meta, OffloadingCounterMetadata) else "gauge"
        kind = "histogram" if isinstance(meta, OffloadingHistogramMetadata) else kind
        names.update(name + suffix for suffix in _SUFFIXES[kind])
    return names


def test_the_query_check_finds_a_name_nobody_exports():
    expr = 'histogram_quantile(0.99, sum by (le, op) (rate(tiered_kv_nope_seconds_bucket{op="get"}[$__rate_interval])))'
    assert promql_metric_names(expr) == {"tiered_kv_nope_seconds_bucket"}
    assert "tiered_kv_nope_seconds_bucket" not in exported_names()
    two = "sum(rate(a_total[5m])) / on (tier) group_left sum(b:c)"
    assert promql_metric_names(two) == {"a_total", "b:c"}


def test_every_dashboard_query_names_exported_metrics_only():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    used: set[str] = set()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = promql_metric_names(target["expr"])
            assert names, f"panel {panel['title']!r}: {target['expr']!r} reads no metric"
            unknown = names - exported
            assert not unknown, f"panel {panel['title']!r} reads {sorted(unknown)}, which nothing exports"
            used |= names
    # What the dashboard must show: hit rate in tokens, bytes, the three latencies,
    # drops and failures of the tiers and of the shared tier.
    for name in (
        f"{TIER_TOKENS}_total",
        "vllm:kv_offload_load_bytes_total",
        "tiered_kv_remote_bytes_total",
        f"{TRANSFER_SECONDS}_bucket",
        f"{VERIFICATION_SECONDS}_bucket",
        f"{REMOTE_REQUEST_SECONDS}_bucket",
        "tiered_kv_tier_blocks_total",
        "tiered_kv_remote_uploads_total",
        "tiered_kv_remote_rejected_objects_total",
        "tiered_kv_remote_unavailable_periods_total",
    ):
        assert name in used, f"the dashboard shows no {name}"


def test_a_tier_types_own_metric_is_declared_and_fed_outside_vllm():
    """The exporter outside vLLM declares what a config's tier types add
    (``TierSpec.metric_definitions``) and advances their totals as they grow."""
    from tiered_kv.metrics import MetricDef

    extra = MetricDef("files_tier_files_written", "counter", "Block files written", ("rank",))
    metrics = PrometheusMetrics(extra=[extra])
    for total in (3, 3, 5):
        metrics.update(TieredStats(), counters=[(extra.name, ("0",), total)])
    value = metrics.registry.get_sample_value("files_tier_files_written_total", {"rank": "0"})
    assert value == 5
