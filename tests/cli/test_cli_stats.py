"""``tiered-kv stats`` against a real Prometheus endpoint: prometheus_client's HTTP
server exporting ``PrometheusMetrics`` of a real hierarchy (GPU -> CPU -> disk) driven
by the simulator's engine loop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server
from typer.testing import CliRunner

from support.remote_node import build as build_node
from support.remote_node import requests as node_requests
from support.s3_server import missing_reason

from tiered_kv.cli import _load_commands, app
from tiered_kv.metrics import LATENCY_BUCKETS
from tiered_kv.metrics_export import PrometheusMetrics
from tiered_kv.ops.metrics_view import parse, quantile, since
from tiered_kv.sim.driver import DeviceKVCache, EngineDriver
from tiered_kv.sim.workloads import default_workload
from tiered_kv.tiered.spec import HierarchySpec

_load_commands()


class Served:
    """A hierarchy, its metrics and the endpoint serving them."""

    def __init__(self, tmp_path, config: dict | None = None):
        device = DeviceKVCache(
            num_layers=2, num_gpu_blocks=24, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu"
        )
        layout = device.layout
        self.spec = HierarchySpec(
            {
                "cpu_bytes": f"{32 * layout.bytes_per_block}B",
                "disk_path": str(tmp_path / "disk"),
                "disk_bytes": "4MiB",
                "model_id": "stats",
                "cover_weights": False,
                **(config or {}),
            },
            layout.gpu_block_size,
            layout,
        )
        self.driver = EngineDriver.from_spec(self.spec, device)
        self.metrics = PrometheusMetrics(tokens_per_block=self.spec.offloaded_block_size)
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.metrics.registry)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"

    def run(self, requests: int, seed: int) -> None:
        """Run requests, wait until the disk writes they queued have landed, export."""
        self.driver.run(default_workload(requests, seed=seed))
        stats, before = self.spec.stats, None
        deadline = time.monotonic() + 60
        while (now := stats.as_dict()) != before:
            assert time.monotonic() < deadline, "the counters never settled"
            before = now
            time.sleep(0.1)
            self.driver.poll()
        self.snapshot = now
        self.costs = self.driver.manager.costs.snapshot()
        self.metrics.update(stats, self.driver.manager.used_blocks(), costs=self.costs)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.driver.worker.shutdown()
        self.driver.manager.shutdown()
        self.spec.close()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path)
    s.run(40, seed=3)
    s.run(40, seed=3)  # the same prompts again, once the first run's disk writes landed
    yield s
    s.close()


def _stats(*args: str):
    return CliRunner().invoke(app, ["stats", *args])


def test_json_view_matches_the_hierarchys_counters(served):
    result = _stats("--url", served.url, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "tiered-kv/stats" and doc["url"] == served.url
    tiers = {t["tier"]: t for t in doc["tiers"]}
    assert list(tiers) == ["cpu", "disk"]
    stats, per_block = served.snapshot, served.spec.offloaded_block_size
    for name, row in tiers.items():
        counters = stats["tiers"][name]
        assert row["hits_blocks"] == counters["hits"] and row["lookups_blocks"] == counters["lookups"]
        assert row["hits_tokens"] == counters["hits"] * per_block
        assert row["lookups_tokens"] == counters["lookups"] * per_block
        assert row["drops_blocks"] == counters["drops"]
        assert row["hit_rate_tokens"] == pytest.approx(counters["hits"] / counters["lookups"])
    assert tiers["cpu"]["hits_tokens"] > 0 and tiers["disk"]["hits_tokens"] > 0
    assert tiers["cpu"]["used_blocks"] == served.driver.manager.used_blocks()["cpu"]
    transfers = stats["transfers"]
    disk_reads = [t for t in transfers if t.startswith("disk_to_")]
    assert tiers["disk"]["bytes_loaded"] == sum(transfers[t]["bytes"] for t in disk_reads) > 0
    assert tiers["disk"]["bytes_stored"] == transfers["cpu_to_disk"]["bytes"] + transfers["gpu_to_disk"]["bytes"]
    # A spill to disk is not a load from the CPU tier.
    assert tiers["cpu"]["bytes_loaded"] == transfers["cpu_to_gpu"]["bytes"]
    assert tiers["cpu"]["load_latency"]["count"] == transfers["cpu_to_gpu"]["jobs"]
    # Every successful disk load is one observation of the latency histogram.
    latency = tiers["disk"]["load_latency"]
    assert latency["count"] == sum(transfers[t]["jobs"] - transfers[t]["failed_jobs"] for t in disk_reads)
    assert 0 < latency["p50_seconds"] <= latency["p99_seconds"] <= LATENCY_BUCKETS[-1]
    by_type = {t["transfer_type"]: t for t in doc["transfers"]}
    assert by_type["gpu_to_cpu"]["bytes"] == transfers["gpu_to_cpu"]["bytes"]
    assert by_type["gpu_to_cpu"]["jobs_ok"] == transfers["gpu_to_cpu"]["jobs"]
    assert doc["remote"] is None  # no shared tier configured
    # The load-versus-recompute decision's inputs: each tier's estimate, the prefill rate.
    for name, row in tiers.items():
        assert row["load_gbps_estimate"] == pytest.approx(served.costs["tiers"][name]["gbps"])
        assert row["skipped_slower_blocks"] == stats["tiers"][name].get("skipped_slower_than_recompute", 0)
        assert row["not_admitted_blocks"] == stats["tiers"][name].get("not_admitted", 0)
        assert row["admission_switches"] == stats["tiers"][name].get("admission_switches", 0)
    assert doc["prefill_tokens_per_s"] == {"used": served.costs["prefill_tokens_per_s"], "measured": None}
    assert doc["gpu"]["store_bytes"] == transfers["gpu_to_cpu"]["bytes"] + transfers["gpu_to_disk"]["bytes"]


def test_blocks_turned_away_by_admission_are_shown_per_tier(tmp_path):
    # reuse(2) everywhere: a first use is ranked first to evict in CPU and not written to disk.
    s = Served(tmp_path, {"cpu_admission": "reuse(2)", "write_admission": "reuse(2)"})
    try:
        s.run(40, seed=3)
        result = _stats("--url", s.url, "--json")
        assert result.exit_code == 0, result.output
        tiers = {t["tier"]: t for t in json.loads(result.stdout)["tiers"]}
        for name in ("cpu", "disk"):
            assert tiers[name]["not_admitted_blocks"] == s.snapshot["tiers"][name]["not_admitted"] > 0
            assert tiers[name]["admission_switches"] == 0  # fixed rules never switch
        table = _stats("--url", s.url).stdout
        (line,) = [line for line in table.splitlines() if "not admitted (blocks)" in line]
        assert [c.strip() for c in line.split("│")[2:-1]] == [
            str(tiers[n]["not_admitted_blocks"]) for n in ("cpu", "disk")
        ]
    finally:
        s.close()


def test_table_shows_each_tier(served):
    result = _stats("--url", served.url)
    assert result.exit_code == 0, result.output
    cpu, disk = served.snapshot["tiers"]["cpu"], served.snapshot["tiers"]["disk"]
    rates = [f"{100 * t['hits'] / t['lookups']:.1f}%" for t in (cpu, disk)]
    (line,) = [line for line in result.stdout.splitlines() if "hit rate (tokens)" in line]
    assert [cell.strip() for cell in line.split("│")[2:-1]] == rates, result.stdout  # one column per tier
    assert "transfers" in result.stdout and "disk_to_cpu" in result.stdout
    assert "load estimate (GB/s)" in result.stdout and "prefill tokens/s used by the load decision" in result.stdout
    assert "GPU busy" not in result.stdout  # no engine reported its steps


def test_the_gpu_busy_share_the_decision_weighs_waiting_requests_by(served):
    costs = served.driver.manager.costs
    costs.note_step(costs.prefill_tokens_per_s * 0.5)  # half a second of work, just now
    served.metrics.update(served.spec.stats, costs=costs.snapshot())
    doc = json.loads(_stats("--url", served.url, "--json").stdout)
    assert doc["gpu_busy_share"] == costs.snapshot()["gpu_busy_share"] == 1.0  # no span yet: counted busy
    result = _stats("--url", served.url)
    assert "GPU busy 100% of the last 30 s" in result.stdout, result.stdout


def test_watch_prints_the_new_counts_each_time(served):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-c", "from tiered_kv.cli import main; main()", "stats", "--url", served.url]
    proc = subprocess.Popen(
        [*cmd, "--watch", "0.2", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        first = json.loads(proc.stdout.readline())
        assert "interval" not in first
        served.run(20, seed=5)  # more requests, exported before the next refresh
        lookups = served.snapshot["tiers"]["cpu"]["lookups"] * served.spec.offloaded_block_size
        counted = 0  # lookups the intervals saw
        for _ in range(50):
            doc = json.loads(proc.stdout.readline())
            assert 0.1 < doc["interval"]["seconds"] < 30
            counted += doc["interval"]["tiers"][0]["lookups_tokens"]
            if doc["tiers"][0]["lookups_tokens"] == lookups:
                break
        else:
            pytest.fail(f"--watch never showed {lookups} cpu lookup tokens")
        assert first["tiers"][0]["lookups_tokens"] < lookups
        assert counted == lookups - first["tiers"][0]["lookups_tokens"]  # each refresh shows what is new
        assert proc.poll() is None  # still watching
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_the_shared_tier_shows_with_its_stores_counters(tmp_path, remote_settings):
    """A node with CPU, disk and shared tiers on a real S3 server: its requests run twice,
    the second time partly from the bucket; both of its stores (the scheduler's probes,
    the worker's uploads and loads) are exported, summed."""
    node = build_node(tmp_path / "node", remote_settings, expecting=True)
    server = None
    try:
        node.run(node_requests(0, 12))
        node.run(node_requests(0, 12))
        stores = [node.tier.store, node.remote.store]
        metrics = PrometheusMetrics(tokens_per_block=node.spec.offloaded_block_size)
        counted = [s.stats() for s in stores]
        metrics.update(
            node.spec.stats,
            node.driver.manager.used_blocks(),
            remote=counted,
            latencies=[s.latencies for s in stores],
        )
        server, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        result = _stats("--url", url, "--json")
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        remote_hits = node.spec.stats.tiers["remote"]["hits"]
        tiers = {t["tier"]: t for t in doc["tiers"]}
        assert list(tiers) == ["cpu", "disk", "remote"]
        assert tiers["remote"]["hits_tokens"] == remote_hits * node.spec.offloaded_block_size > 0
        shared = doc["remote"]
        assert shared["uploads"]["stored"] == sum(c.puts_stored for c in counted) > 0
        assert shared["downloads"]["hit"] == sum(c.gets_hit for c in counted) >= remote_hits
        assert shared["probes"]["ok"] == sum(c.probes for c in counted) > 0
        assert shared["bytes"]["upload"] == sum(c.put_bytes for c in counted)
        assert shared["unavailable_periods"] == 0 and shared["rejected"] == {}
        # One timing per request: each probe a HEAD, each block download a GET.
        assert shared["request_latency"]["head"]["count"] >= shared["probes"]["ok"]
        assert shared["request_latency"]["get"]["count"] >= shared["downloads"]["hit"]
        assert shared["request_latency"]["get"]["p99_seconds"] > 0
        table = _stats("--url", url)
        assert table.exit_code == 0 and "shared tier" in table.stdout and "get latency p50 / p99" in table.stdout
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        node.close()


def test_unreachable_endpoint_is_one_error_line_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/metrics"
    result = _stats("--url", url)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {url} could not be read") and result.stderr.count("\n") == 1
    result = _stats("--url", f"127.0.0.1:{port}/metrics")  # no scheme: read as http://
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {url} could not be read: ")
    assert "Connection refused" in result.stderr and result.stderr.count("\n") == 1


def test_an_endpoint_without_tiered_kv_metrics_is_refused():
    registry = CollectorRegistry()
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        result = _stats("--url", url, "--json")
        assert result.exit_code == 2 and "exports no tiered-kv metrics" in result.stderr
        assert json.loads(result.stdout)["error"].startswith(url)
    finally:
        server.shutdown()
        server.server_close()


def test_quantiles_follow_the_buckets():
    registry = CollectorRegistry()
    h = Histogram("t_seconds", "t", ["op"], buckets=(0.001, 0.01, 0.1), registry=registry)
    for i in range(100):  # 0.0005 .. 0.0995 s, evenly
        h.labels("get").observe(0.0005 + i * 0.001)
    h.labels("put").observe(5.0)  # past the last finite bucket
    samples = parse(generate_latest(registry).decode())
    get = lambda labels: labels.get("op") == "get"  # noqa: E731
    # 1 observation <= 1 ms, 10 <= 10 ms, 100 <= 100 ms: linear inside the bucket.
    assert quantile(samples, "t_seconds", 0.5, get) == pytest.approx(0.01 + 0.09 * (50 - 10) / 90)
    assert quantile(samples, "t_seconds", 0.01, get) == pytest.approx(0.001)
    assert quantile(samples, "t_seconds", 0.5, lambda labels: labels.get("op") == "put") == 0.1
    assert quantile(samples, "t_seconds", 0.5, lambda labels: labels.get("op") == "head") is None


def test_since_subtracts_counters_and_keeps_gauges():
    before = parse('a_total{t="x"} 5\nb_bucket{le="1.0"} 2\ng 7\n')
    now = parse('a_total{t="x"} 8\na_total{t="y"} 1\nb_bucket{le="1.0"} 1\ng 3\n')
    diff = since(now, before)
    assert sorted((labels["t"], v) for labels, v in diff["a_total"]) == [("x", 3.0), ("y", 1.0)]
    assert diff["b_bucket"] == [({"le": "1.0"}, 1.0)]  # lower than before: a restart, counted from 0
    assert diff["g"] == [({}, 3.0)]


def test_session_retention_on_each_tier_shows_through_the_demos_endpoint(tmp_path):
    """A hierarchy with ``cpu_retention`` and ``disk_retention``, exported as ``tiered-kv
    demo --metrics-port`` exports it: the stats view gives each tier's returns, blocks
    held and learned hold time, as the rules count them."""
    from tiered_kv.cli.demo_metrics import DemoEndpoint

    device = DeviceKVCache(
        num_layers=2, num_gpu_blocks=24, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu"
    )
    layout = device.layout
    spec = HierarchySpec(
        {
            "cpu_bytes": f"{32 * layout.bytes_per_block}B",
            "disk_path": str(tmp_path / "disk"),
            "disk_bytes": "4MiB",
            "model_id": "stats",
            "cover_weights": False,
            "cpu_retention": "session(0.5)",
            "disk_retention": "session(0.5)",
        },
        layout.gpu_block_size,
        layout,
    )
    driver = EngineDriver.from_spec(spec, device)
    endpoint = DemoEndpoint("127.0.0.1", 0, spec.offloaded_block_size)
    try:
        endpoint.attach(spec, driver)
        manager = driver.manager
        rules = {"cpu": manager.cpu.retention, "disk": manager.lower[0].retention}
        now = [0.0]
        for rule in rules.values():
            rule.clock = lambda: now[0]
        for t in (0.0, 10.0):  # the same conversations come back 10 s later
            now[0] = t
            driver.run(default_workload(20, seed=5))
        endpoint.export()
        result = _stats("--url", endpoint.url, "--json")
        assert result.exit_code == 0, result.output
        retention = json.loads(result.stdout)["sessions"]["retention"]
        assert set(retention) == {"cpu", "disk"}
        for tier, rule in rules.items():
            row = retention[tier]
            assert row["returns"] == rule.counts["returns"] > 0, (tier, row)
            assert row["held_blocks"] == rule.num_held() > 0 and row["hold_seconds"] == 10.0
            assert (row["honoured"], row["switches"]) == (rule.honoured, rule.counts["switches"]), (tier, row)
        table = _stats("--url", endpoint.url)
        assert table.exit_code == 0 and "sessions, hints and the start-up canary" in table.stdout
        (line,) = [line for line in table.stdout.splitlines() if "cpu: retention" in line]
        assert f"{retention['cpu']['returns']} returns" in line and "held for 10.00 s" in line, line
        # What ``cpu_admission: adaptive(N)`` sets when its miniatures find the holds cost hits.
        cpu_rule = rules["cpu"]
        cpu_rule.honoured, cpu_rule.counts["switches"] = False, cpu_rule.counts["switches"] + 1
        endpoint.export()
        retention = json.loads(_stats("--url", endpoint.url, "--json").stdout)["sessions"]["retention"]
        assert not retention["cpu"]["honoured"] and retention["disk"]["honoured"]
        assert retention["cpu"]["switches"] == cpu_rule.counts["switches"] >= 1
        (line,) = [line for line in _stats("--url", endpoint.url).stdout.splitlines() if "cpu: retention" in line]
        assert "not honoured now" in line and f"({cpu_rule.counts['switches']} switches)" in line, line
    finally:
        endpoint.close()
        driver.worker.shutdown()
        driver.manager.shutdown()
        spec.close()
