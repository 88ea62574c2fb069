"""``tools/bench_remote.py``'s two-node replay, small, against the real Ceph RGW of the
test run: node B hits blocks node A computed, through the shared tier, byte-exact (the
replay raises on any mismatch), and the table shows both nodes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from support.s3_server import skip_module_without_rgw

from tiered_kv.remote import RemoteConfig

skip_module_without_rgw()

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_remote.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_remote", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_node_b_hits_what_node_a_computed(remote_settings):
    tool = load_tool()
    shape = tool.ReplayShape(
        requests=24, documents=3, document_blocks=4, device_blocks=8, cpu_blocks=8, disk_blocks=8, layers=2, kv_heads=2
    )
    config = RemoteConfig.from_dict(remote_settings)
    rows = tool.replay(config, shape, seed=1, log=lambda s: None)
    a, b, tail = rows
    assert (a["node"], b["node"], a["requests"], b["requests"]) == ("A", "B", 12, 12)
    assert a["uploaded"] > 0 and a["dropped"] == 0
    # B starts with empty tiers: every document block it does not compute comes from A's uploads.
    assert b["remote"] > 0 and b["computed"] < a["computed"]
    for row in (a, b):
        assert abs(row["device"] + row["cpu"] + row["disk"] + row["remote"] + row["computed"] - 1) < 1e-9
    assert tool._delete_prefix(config, tail["prefix"]) == a["uploaded"] + b["uploaded"] + 1  # + fingerprint.json
    table = tool.replay_table(rows)
    assert table.count("\n") == 3 and "| B | 12 |" in table
