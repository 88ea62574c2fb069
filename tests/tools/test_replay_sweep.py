"""``tools/replay.py --disk-gbps``: Mooncake traces read as given, the bandwidth sweep's
checks and references, and the block-level replay against its own invariants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import replay  # noqa: E402
from replay_cost import (  # noqa: E402
    CostSetup,
    LowerModel,
    belady_hit_rate,
    infinite_hit_rate,
    run,
    used_once_share,
)
from replay_workloads import read_mooncake, read_trace  # noqa: E402


def write_mooncake(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_mooncake_trace_keeps_full_blocks_and_counts_the_partial_tail(tmp_path):
    path = write_mooncake(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 7, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 9, "input_length": 100, "output_length": 5, "hash_ids": [9]},
        ],
    )
    t = read_mooncake(path)
    assert t.requests == [[1, 2], [1, 2], []]
    assert t.tail_tokens == [76, 0, 100] and t.timestamps == [0, 7, 9]
    w = read_trace(path, 16)  # the real-bytes replay: one block per 512-token block
    assert [len(r) for r in w.requests] == [2, 2] and w.requests[0] == w.requests[1]


def test_a_bad_mooncake_line_is_named(tmp_path):
    path = write_mooncake(tmp_path / "t.jsonl", [{"input_length": 1100, "hash_ids": [1, 2]}])
    with pytest.raises(ValueError, match=r"t.jsonl:1: .*2 hash_ids for input_length 1100"):
        read_mooncake(path)


def test_references_infinite_and_belady():
    requests = [[1, 2], [3], [1, 2], [3], [1]]
    assert infinite_hit_rate(requests) == pytest.approx(4 / 7)
    assert belady_hit_rate(requests, 100) == pytest.approx(4 / 7)
    assert belady_hit_rate(requests, 2) < 4 / 7  # one of the three blocks must go


def test_the_replay_s_block_sources_add_up_and_a_slow_tier_is_passed_over(tmp_path):
    requests = [[i % 5, 100 + i % 5, 200 + i % 5] for i in range(60)]
    tails = [10] * len(requests)
    setup = CostSetup(512, 131072, 30800.0, 50.0, device_blocks=3, cpu_blocks=3, lower_blocks=30)
    fast = run("fast", requests, tails, setup, LowerModel("disk", "DISK", 8.0), scratch=tmp_path)
    slow = run("slow", requests, tails, setup, LowerModel("disk", "DISK", 0.5), scratch=tmp_path)
    always = run("always", requests, tails, setup, LowerModel("disk", "DISK", 0.5), cost_aware=False, scratch=tmp_path)
    for r in (fast, slow, always):
        assert sum(r.blocks.values()) == 180
    assert fast.blocks["disk"] > 0 and fast.tiers["disk"]["skipped_slower_than_recompute"] == 0
    assert slow.tiers["disk"]["skipped_slower_than_recompute"] > 0
    assert slow.blocks["disk"] < always.blocks["disk"] / 10  # probes only
    assert slow.mean_ttft < always.mean_ttft


def test_the_oracle_admission_writes_only_blocks_used_again_and_keeps_all_s_hit_rate(tmp_path):
    # Every fourth block comes back five requests later, after the device and CPU dropped it.
    requests: list[list[int]] = []
    for i in range(40):
        requests.append([1000 + i])
        if i >= 5 and (i - 5) % 4 == 0:
            requests.append([1000 + i - 5])
    reused = len(requests) - 40
    assert used_once_share(requests) == pytest.approx((40 - reused) / 40)
    tails = [0] * len(requests)
    setup = CostSetup(512, 131072, 30800.0, 50.0, device_blocks=1, cpu_blocks=2, lower_blocks=100)
    disk = LowerModel("disk", "DISK", 8.0)
    runs = {
        "all": run("all", requests, tails, setup, disk, scratch=tmp_path),
        "reuse(2)": run("reuse2", requests, tails, setup, disk, admit=2, scratch=tmp_path),
        "oracle": run("oracle", requests, tails, setup, disk, oracle=True, scratch=tmp_path),
    }
    assert runs["all"].hit_rate == pytest.approx(reused / len(requests))
    assert runs["all"].tiers["disk"]["stores"] == 40
    assert runs["oracle"].hit_rate == runs["all"].hit_rate
    assert runs["oracle"].tiers["disk"]["stores"] == reused  # the blocks a later request uses
    assert runs["oracle"].tiers["disk"]["not_admitted"] > 0
    assert runs["reuse(2)"].hit_rate == 0  # each block's one reuse is its second use: computed again


def test_the_sweep_prints_checks_and_references_and_passes_on_chat(tmp_path, capsys):
    md = tmp_path / "sweep.md"
    rc = replay.main(
        ["--disk-gbps", "0.5,8", "--workloads", "chat", "--quick", "--markdown", str(md), "--plots", str(tmp_path)]
    )
    out = md.read_text()
    assert rc == 0 and "all checks pass: yes" in out
    assert "chat, disk below CPU" in out and "chat, shared below CPU (per-job latency 5 ms)" in out
    assert "infinite cache" in out and "Belady" in out and "reuse(2)" in out and "oracle" in out
    assert "of the distinct blocks occur in one request only" in out
    assert (tmp_path / "replay_ttft_vs_bandwidth.png").stat().st_size > 10_000


def test_a_missing_trace_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        replay.main(["--disk-gbps", "1", "--traces", str(tmp_path / "nope.jsonl")])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err
