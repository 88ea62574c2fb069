"""``tools/replay_fleet_time.py`` (``replay_fleet.py --timed``): the queue's clock against
hand-computed times (a request waiting behind another, a pool that serves only what has
finished), and on small generated traces: a cache-aware router beats round-robin, a shared
pool at equal capacity hits at least as often as a cache-aware local fleet, more load
means longer TTFTs, queue-aware routing spreads a hot prefix that pure prefix affinity
piles onto one node; bad arguments exit 2 naming the value. No server, no GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import replay_fleet  # noqa: E402
import replay_fleet_time as timed  # noqa: E402
from replay_fleet import Request  # noqa: E402
from replay_fleet_time import Speeds, TimedRequest, simulate  # noqa: E402

SPEEDS = Speeds()


def conversations(path: Path, seed: int = 0, convs: int = 40, turns: int = 5, groups: int = 4) -> None:
    """Conversations under ``groups`` system prompts of 3 blocks, each turn adding 2-4 blocks
    to its history; conversations start over 600 s, turns 20-60 s apart."""
    rng = np.random.default_rng(seed)
    rows, fresh = [], iter(range(100_000, 10**9))
    for c in range(convs):
        history = [1000 * (c % groups) + j for j in range(3)]
        t = float(rng.uniform(0, 600))
        for _ in range(turns):
            history = history + [next(fresh) for _ in range(int(rng.integers(2, 5)))]
            tokens = len(history) * 512 - int(rng.integers(1, 400))
            rows.append({"timestamp": int(t * 1e3), "input_length": tokens, "output_length": 1, "hash_ids": history})
            t += float(rng.uniform(20, 60))
    rng.shuffle(rows)  # the reader orders by timestamp
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def hot_document(path: Path, seed: int = 0, requests: int = 300) -> None:
    """One request reads a 30-block document alone; 30 s later the rest arrive (Poisson, 1 s
    apart on average): 80% read the same document and add 4-8 blocks of their own, the
    others are 4-block prompts of their own."""
    rng = np.random.default_rng(seed)
    fresh = iter(range(100_000, 10**9))
    t, lines = 0.0, []
    for i in range(requests):
        if i == 0 or rng.random() < 0.8:
            ids = list(range(30)) + [next(fresh) for _ in range(int(rng.integers(4, 9)))]
        else:
            ids = [next(fresh) for _ in range(4)]
        tokens = len(ids) * 512 - 100
        lines.append(json.dumps({"timestamp": int(t * 1e3), "input_length": tokens, "hash_ids": ids}) + "\n")
        t += 30.0 if i == 0 else float(rng.exponential(1.0))
    path.write_text("".join(lines))


def run(tmp_path: Path, trace: Path, *extra: str, name: str = "out") -> dict[str, dict]:
    out = tmp_path / f"{name}.json"
    assert timed.main(["--trace", str(trace), "--json", str(out), *extra]) == 0
    return {r["row"]: r for r in json.loads(out.read_text())["rows"]}


SMALL = ("--nodes", "4", "--local-blocks", "20", "--shared-blocks", "80")


def test_a_request_waits_behind_the_one_ahead_and_then_hits_its_blocks():
    req = Request(5 * 512 - 10, (1, 2, 3, 4, 5))
    result = simulate([TimedRequest(0.0, req), TimedRequest(0.0, req)], "local/round-robin", nodes=1,
                      local_blocks=10, shared_blocks=0, speeds=SPEEDS, factor=1.0)  # fmt: skip
    first = SPEEDS.service(req.input_tokens)
    # The second runs once the first is done and finds all 4 full blocks but the last in cache
    # (a prompt always computes its last token): 4 loaded, the rest computed after them.
    assert result.ttft_s[0] == pytest.approx(first)
    assert result.ttft_s[1] == pytest.approx(first + SPEEDS.service(req.input_tokens, 4 * 512, 0))
    assert result.hit_blocks == 4 and result.busy_s == [pytest.approx(result.ttft_s[1])]


def test_the_pool_serves_only_what_has_finished():
    req = Request(8 * 512 + 7, tuple(range(8)))
    stream = [TimedRequest(0.0, req), TimedRequest(0.0, req), TimedRequest(100.0, req)]
    result = simulate(stream, "shared/least-work", nodes=3, local_blocks=0, shared_blocks=50, speeds=SPEEDS,
                      factor=1.0)  # fmt: skip
    alone = SPEEDS.service(req.input_tokens)
    # The second starts on another node while the first is still computing: no hit.
    assert result.ttft_s[:2] == [pytest.approx(alone), pytest.approx(alone)]
    # The third, on the idle third node with no local cache, reads all 8 blocks from the pool.
    assert result.ttft_s[2] == pytest.approx(SPEEDS.service(req.input_tokens, 0, 8 * 512))
    assert result.requests == [1, 1, 1] and result.shared_blocks == 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_aware_routing_beats_round_robin(tmp_path, seed):
    trace = tmp_path / "conv.jsonl"
    conversations(trace, seed)
    rows = run(tmp_path, trace, *SMALL, "--rows", "local/cache-aware,local/round-robin")
    aware, rr = rows["local/cache-aware"], rows["local/round-robin"]
    # Round-robin finds a conversation's history only where its previous turn happened to run.
    assert aware["hit_rate"] > rr["hit_rate"] + 0.1
    assert aware["ttft_mean_s"] < rr["ttft_mean_s"] and aware["gpu_s"] < rr["gpu_s"]
    assert rr["requests_per_node"] == [50, 50, 50, 50] and sum(aware["requests_per_node"]) == 200


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_pool_holding_the_working_set_hits_at_least_as_often_at_equal_capacity(tmp_path, seed):
    trace = tmp_path / "conv.jsonl"
    conversations(trace, seed)  # under 600 distinct blocks
    # 4 x 220 local blocks against 4 x 20 + a pool of 800: the pool keeps every block ever
    # computed, so only KV still being computed is missed.
    rows = run(tmp_path, trace, "--nodes", "4", "--local-blocks", "20", "--shared-blocks", "800")
    local = rows["local/cache-aware"]
    for row in ("shared/least-work", "shared/cache-aware"):
        assert rows[row]["hit_rate"] >= local["hit_rate"], row
        assert rows[row]["from_pool"] > 0.1, row
    assert local["from_pool"] == 0
    for r in rows.values():
        assert sum(r["requests_per_node"]) == 200 and 0 < r["goodput"] <= 1 and 0 < r["busy"] < 1


def test_more_load_means_longer_ttft(tmp_path):
    trace = tmp_path / "conv.jsonl"
    conversations(trace, 3)
    low = run(tmp_path, trace, *SMALL, "--utilisation", "0.3", name="low")
    high = run(tmp_path, trace, *SMALL, "--utilisation", "0.95", name="high")
    for row in ("local/cache-aware", "local/round-robin", "shared/least-work"):
        assert high[row]["ttft_mean_s"] > low[row]["ttft_mean_s"], row
        assert high[row]["busy"] > low[row]["busy"], row


def test_queue_aware_routing_spreads_a_hot_prefix(tmp_path):
    trace = tmp_path / "hot.jsonl"
    hot_document(trace)
    rows = run(tmp_path, trace, "--nodes", "4", "--local-blocks", "100", "--shared-blocks", "0",
               "--utilisation", "2", "--rows", "local/longest-prefix,local/cache-aware")  # fmt: skip
    affinity, aware = rows["local/longest-prefix"], rows["local/cache-aware"]
    # Pure prefix affinity sends every reader of the document to the node that holds it.
    assert max(affinity["requests_per_node"]) >= 0.75 * 300
    assert max(aware["requests_per_node"]) < 0.5 * 300
    assert aware["ttft_p90_s"] < affinity["ttft_p90_s"] and aware["goodput"] >= affinity["goodput"]


def test_the_fleet_tool_runs_the_timed_mode(tmp_path, capsys):
    trace = tmp_path / "conv.jsonl"
    conversations(trace, 0, convs=10)
    out = tmp_path / "fleet.json"
    assert replay_fleet.main(["--timed", "--trace", str(trace), *SMALL, "--slo", "500ms", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| local/cache-aware |" in text and "goodput, TTFT <= 0.5 s" in text and "Fig. 10" in text
    assert "equal total capacity: local = 4 nodes x 40 blocks" in text and "= 160 blocks" in text
    doc = json.loads(out.read_text())
    assert [r["row"] for r in doc["rows"]] == list(timed.DEFAULT_ROWS) and doc["args"]["slo"] == 0.5


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--utilisation", "3"], ["--utilisation", "'3'", "(0, 2]"]),
        (["--utilisation", "busy"], ["--utilisation", "'busy'"]),
        (["--slo", "soon"], ["--slo", "'soon'", "2s"]),
        (["--nodes", "0"], ["--nodes", "'0'", "positive"]),
        (["--local-blocks", "-1"], ["--local-blocks", "'-1'", ">= 0"]),
        (["--shared-gbps", "0"], ["--shared-gbps", "'0'"]),
        (["--rows", "local/magic"], ["--rows", "'local/magic'", "cache-aware"]),
        (["--local-blocks", "0", "--shared-blocks", "0"], ["--local-blocks 0", "--shared-blocks 0"]),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(tmp_path, capsys, flags, names):
    trace = tmp_path / "conv.jsonl"
    conversations(trace, 0, convs=2)
    with pytest.raises(SystemExit) as exc:
        replay_fleet.main(["--timed", "--trace", str(trace), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for name in names:
        assert name in err, (name, err)


def test_a_bad_trace_line_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n{"input_length": 10}\n')
    with pytest.raises(SystemExit) as exc:
        timed.main(["--trace", str(bad)])
    assert exc.value.code == 2 and "bad.jsonl:2: bad trace line" in capsys.readouterr().err
