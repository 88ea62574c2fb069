"""Counters of the hierarchy as a stats object and as Prometheus metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from tiered_kv.sim.driver import DeviceKVCache, EngineDriver
from tiered_kv.metrics import PrometheusMetrics, TieredStats
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.sim.workloads import default_workload


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
    ):
        stats.record_transfer(kind, nbytes, seconds)
    metrics = PrometheusMetrics()
    metrics.update(stats)
    text = generate_latest(metrics.registry).decode()
    for line in (
        "vllm:kv_offload_load_bytes_total 150.0",
        "vllm:kv_offload_load_time_total 0.75",
        "vllm:kv_offload_store_bytes_total 32.0",
        "vllm:kv_offload_store_time_total 0.1875",
    ):
        assert line in text.splitlines()


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
        },
        layout.gpu_block_size,
        layout,
    )
    driver = EngineDriver.from_spec(spec, device)
    driver.run(default_workload(40, seed=3))
    metrics = PrometheusMetrics()
    metrics.update(spec.stats, driver.manager.used_blocks())
    text = generate_latest(metrics.registry).decode()
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
