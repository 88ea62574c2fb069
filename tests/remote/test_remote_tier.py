"""The shared tier as the third tier (CPU, disk, S3) of the hierarchy, with a real Ceph RGW.

Nodes are built as an engine would be (``HierarchySpec`` with the config's ``remote``
settings, under ``EngineDriver``, see tests/support/remote_node.py), and every block
loaded is compared byte for byte with what was computed for it. Shown here: blocks
evicted from CPU and disk come back from the bucket; two engine processes with their
own CPU and disk tiers share one bucket, and the second hits what the first computed,
while nodes of another model, dtype or hash seed never read those objects; the server
killed mid-run costs failed loads (recomputed) and dropped uploads, never an exception
or a stall.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.s3_server import FaultProxy, skip_module_without_rgw

skip_module_without_rgw()

from support.remote_node import BLOCKS_PER_REQUEST, build, requests  # noqa: E402

from tiered_kv.config import ConfigError  # noqa: E402
from tiered_kv.remote.scheduler.manager import REMOTE  # noqa: E402
from tiered_kv.remote.tier import RemoteTier  # noqa: E402
from tiered_kv.tier_registry import TierEntry  # noqa: E402
from tiered_kv.tiers import TierContext, build_tiers  # noqa: E402

NODE = Path(__file__).resolve().parents[1] / "support" / "remote_node.py"


def _only_remote(node, reqs) -> int:
    """Blocks of ``reqs`` that neither CPU nor disk holds now, only the bucket."""
    manager = node.driver.manager
    return sum(manager.hit_medium(h) == REMOTE for r in reqs for h in r)


def test_blocks_evicted_from_cpu_and_disk_come_back_from_the_bucket(tmp_path, remote_settings):
    with build(tmp_path / "cache", remote_settings) as node:
        assert isinstance(node.spec.lower_tiers[-1], RemoteTier)
        first = node.run(requests(0, 30))  # 120 blocks: CPU and disk hold 16 each, the device 32
        n = 30 * BLOCKS_PER_REQUEST
        assert first.computed == n and first.mismatches == 0 and first.stores_rejected == 0
        assert node.remote.counters["confirmed"] == n and node.remote.counters["released"] == 0
        node.driver.poll()  # the events of uploads seen landing while settling
        assert first.events.get(f"{REMOTE} stored") == n

        reqs = requests(0, 10)  # long gone from the device
        only_remote = _only_remote(node, reqs)
        assert only_remote >= 6 * BLOCKS_PER_REQUEST  # evicted from CPU and disk: only the bucket has them
        again = node.run(reqs)
        assert again.computed == 0 and again.mismatches == 0  # every byte as computed
        remote_hits = again.hits_by_medium.get(REMOTE, 0)
        assert remote_hits >= only_remote
        assert remote_hits + again.hits_by_medium.get("DISK", 0) == 10 * BLOCKS_PER_REQUEST
        moved = sum(t.bytes for k, t in node.spec.stats.transfers.items() if k in ("remote_to_cpu", "remote_to_gpu"))
        assert moved == remote_hits * node.tier.ctx.layout.bytes_per_block
        assert node.spec.stats.tiers["remote"]["hits"] == remote_hits
        assert node.tier.store.stats().gets_hit == remote_hits


def _run_node(settings: dict) -> dict:
    done = subprocess.run(
        [sys.executable, str(NODE), json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_nodes_share_one_bucket_and_other_fingerprints_never_read_it(tmp_path, remote_settings):
    n = 10 * BLOCKS_PER_REQUEST
    common = {"remote": remote_settings, "first": 0, "count": 10}
    a = _run_node({**common, "cache_dir": str(tmp_path / "a")})
    assert a["computed"] == n and a["remote"]["confirmed"] == n and a["puts_stored"] == n

    # Node B: its own process, CPU and disk tiers (empty), the same bucket and fingerprint.
    b = _run_node({**common, "cache_dir": str(tmp_path / "b"), "expecting": True})
    assert b["namespace"] == a["namespace"]
    assert b["hits_by_medium"] == {REMOTE: n}, b
    assert b["computed"] == 0 and b["mismatches"] == 0  # every block A computed, byte-exact
    assert b["gets_hit"] == n and b["puts_stored"] == 0

    # Nodes of another model, dtype or hash seed: the same block hashes, never served.
    for other in ({"model_id": "org/other-model"}, {"dtype": "bfloat16"}, {"hash_seed": "42"}):
        c = _run_node(
            {
                **common,
                "cache_dir": str(tmp_path / f"c-{next(iter(other))}"),
                "expecting": True,
                **other,
            }
        )
        assert c["namespace"] != a["namespace"], other
        assert c["hits_by_medium"] == {} and c["computed"] == n, (other, c)
        assert c["gets_hit"] == 0 and c["gets_rejected"] == 0 and c["gets_absent"] == 0, (other, c)
        assert c["puts_stored"] == n  # its own blocks, in its own namespace


def test_server_killed_mid_run_costs_misses_never_a_crash_or_stall(tmp_path, rgw_server, remote_settings):
    settings = {
        **remote_settings,
        "request_timeout": "1s",
        "retries": 0,
        "failure_threshold": 2,
        "unavailable_cooldown": "30s",
    }
    with build(tmp_path / "cache", settings) as node:
        node.run(requests(0, 12))  # the device keeps requests 4..11, CPU and disk fewer
        assert node.remote.counters["confirmed"] == 12 * BLOCKS_PER_REQUEST
        assert _only_remote(node, requests(0, 4)) > 0
        rgw_server.kill_rgw()
        try:
            # Blocks the bucket held, and new ones: every load from it fails and is
            # recomputed; every upload is dropped or fails; the run completes.
            during = node.run(requests(0, 4) + requests(100, 4))
        finally:
            rgw_server.start_rgw()
        assert during.mismatches == 0
        assert during.hits_by_medium.get(REMOTE, 0) == 0
        assert during.recomputed_after_failed_load > 0
        assert during.computed + during.offload_hits == 8 * BLOCKS_PER_REQUEST
        tier_stats = node.spec.stats.tiers["remote"]
        assert tier_stats["failed_loads"] > 0
        assert tier_stats["drops"] + tier_stats["failed_stores"] >= 4 * BLOCKS_PER_REQUEST
        assert node.remote.counters["released"] >= 4 * BLOCKS_PER_REQUEST  # learned: they never landed
        assert node.remote.num_pending() == 0


def test_uploads_past_the_bound_are_dropped_and_counted_never_waited_for(tmp_path, rgw_server, remote_settings):
    with FaultProxy(rgw_server.endpoint.removeprefix("http://")) as proxy:
        settings = {
            **remote_settings,
            "endpoint": proxy.endpoint,
            "max_pending_upload_bytes": "8KiB",
            "request_timeout": "3s",
            "retries": 0,
            "failure_threshold": 1000,
        }
        node = build(tmp_path / "cache", settings)
        try:
            proxy.set_mode("stall")  # uploads and probes are never answered
            report = node.run(requests(0, 3))  # the first request's upload holds the bound
        finally:
            proxy.set_mode("pass")
            node.close()
    n = BLOCKS_PER_REQUEST
    assert report.computed == 3 * n and report.mismatches == 0
    tier_stats = node.spec.stats.tiers["remote"]
    # The next two requests' uploads are dropped, not queued (and the store's own bound of
    # the same size lets one block of the first through, which times out).
    assert tier_stats["drops"] >= 2 * n and tier_stats["failed_stores"] >= 1
    assert tier_stats["drops"] + tier_stats["failed_stores"] == 3 * n
    assert node.remote.counters["released"] == 3 * n and node.remote.counters["confirmed"] == 0


def test_a_remote_tier_entry_names_the_bad_key(tmp_path, remote_settings):
    with build(tmp_path / "cache", remote_settings) as node:
        ctx = node.tier.ctx
    (tier,) = build_tiers([TierEntry.parse({"type": "remote", **remote_settings}, "tiers[0]")], ctx)
    assert isinstance(tier, RemoteTier)
    assert tier.settings.bucket == remote_settings["bucket"] and tier.name == "remote"
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.max_pending_upload_bytes"):
        TierEntry.parse({"type": "remote", **remote_settings, "max_pending_upload_bytes": "lots"}, "tiers[0]")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.bucket"):
        TierEntry.parse({"type": "remote", "endpoint": remote_settings["endpoint"]}, "tiers[0]")
    with pytest.raises(ValueError, match="rank 1"):
        TierContext(ctx.config, ctx.fingerprint, ctx.layout, "engine", rank=1, world_size=1)


def test_a_bucket_that_stalls_every_other_download_is_passed_over_and_used_again(tmp_path, rgw_server, remote_settings):
    """Built with ``HierarchySpec`` (no vLLM): the node's own transfers feed the decision.
    Every other download stalls past its timeout and fails (recomputed, charged its wait
    and the recompute): within a few requests the tier is passed over; once the bucket
    answers again, the probes' samples bring it back."""
    with FaultProxy(rgw_server.endpoint.removeprefix("http://"), mode="count") as proxy:
        settings = {**remote_settings, "endpoint": proxy.endpoint, "request_timeout": "1s", "retries": 0}
        with build(
            tmp_path / "cache",
            settings,
            expecting=True,
            cost_aware=True,
            prefill_tokens_per_s=100.0,  # a block of 16 tokens costs 160 ms to recompute
            promote_on_hit=False,
        ) as node:
            costs = node.driver.manager.costs
            assert costs is not None and costs.enabled
            node.run(requests(0, 30))  # 120 blocks: CPU and disk keep the last 16 each
            remote = node.spec.stats.tiers["remote"]

            def chain(i: int) -> tuple[int, int]:
                """Request chain ``i`` (only the bucket holds it): remote hits, blocks passed over."""
                hits, skipped = remote["hits"], remote["skipped_slower_than_recompute"]
                report = node.run(requests(i, 1))
                assert report.mismatches == 0
                return remote["hits"] - hits, remote["skipped_slower_than_recompute"] - skipped

            assert chain(0) == (BLOCKS_PER_REQUEST, 0)  # a fast bucket is used
            proxy.stall_every_other_get = True
            passed_over_at = next((i for i in range(1, 8) if chain(i)[1] > 0), None)
            assert passed_over_at is not None and passed_over_at <= 4, passed_over_at
            assert node.tier.store.stats().gets_failed > 0
            proxy.stall_every_other_get = False
            costs.probe_every = 1  # every decision that passes the tier over samples it
            used_again = [chain(i) for i in range(8, 20)]
            assert used_again[-1] == (BLOCKS_PER_REQUEST, 0), used_again
