"""``tools/replay_fleet.py`` on a small Mooncake-format trace: a fleet sharing a real Mooncake
Store reaches exactly the hit rates its index predicts (every shared read verified, none
failed), above the same fleet with local tiers only, and bad arguments get a clear error."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from support.mooncake_server import skip_module_without_mooncake

skip_module_without_mooncake()

TOOL = Path(__file__).resolve().parents[2] / "tools" / "replay_fleet.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("replay_fleet", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write_trace(path: Path, requests: int = 120, seed: int = 0) -> None:
    """Requests over 6 shared prefixes of 3-6 blocks each, then 1-3 blocks of their own."""
    rng = np.random.default_rng(seed)
    prefixes = [list(range(100 * p, 100 * p + int(rng.integers(3, 7)))) for p in range(6)]
    next_id = 10_000
    with open(path, "w") as f:
        for t in range(requests):
            ids = list(prefixes[int(rng.integers(0, 6))])
            for _ in range(int(rng.integers(1, 4))):
                ids.append(next_id)
                next_id += 1
            tokens = len(ids) * 512 - int(rng.integers(0, 300))
            f.write(json.dumps({"timestamp": t, "input_length": tokens, "output_length": 1, "hash_ids": ids}) + "\n")


def test_shared_fleet_matches_its_index_and_beats_local_only(tmp_path, mooncake_server):
    tool = load_tool()
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    common = ["--trace", str(trace), "--nodes", "3", "--local-blocks", "4", "--shared-blocks", "40", "--progress", "0"]
    tool.main([*common, "--backend", "none", "--json", str(tmp_path / "none.json")])
    tool.main(
        [
            *common,
            "--backend",
            "mooncake",
            "--mooncake-master",
            mooncake_server.master_address,
            "--metadata-server",
            mooncake_server.metadata_server,
            "--json",
            str(tmp_path / "mooncake.json"),
        ]
    )
    none = json.loads((tmp_path / "none.json").read_text())["rows"]
    real = json.loads((tmp_path / "mooncake.json").read_text())["rows"]
    assert [r["routing"] for r in real] == ["round-robin", "prefix-affinity"]
    for n, r in zip(none, real):
        assert r["shared_failed"] == 0 and r["store"]["rejected"] == 0 and r["store"]["failed"] == 0
        assert r["store"]["gets_hit"] > 0
        for key in ("hit_shared", "hit_local", "prefill_shared_s", "prefill_local_s"):
            assert r[key] == pytest.approx(n[key]), key
        assert len(r["nodes"]) == 3 and sum(nd["requests"] for nd in r["nodes"]) == 120
    rr = real[0]
    assert rr["hit_shared"] > rr["hit_local"] and rr["prefill_ratio"] < 1


def test_bad_arguments_name_the_option(tmp_path):
    tool = load_tool()
    with pytest.raises(SystemExit):
        tool.parse_args(["--trace", "x", "--routing", "random"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 10}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: bad trace line"):
        tool.read_mooncake_trace(bad)
