"""``tools/replay.py --policies`` and ``tools/replay_claude_code.py``: the CPU-tier policy
tables on traces small enough to check by hand, and the Claude Code reader on a real
conversation file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import replay  # noqa: E402
import replay_claude_code  # noqa: E402
from replay_policies import (  # noqa: E402
    Requests,
    chain_sessions,
    parse_policy,
    parse_tokens,
    replay as replay_requests,
    replay_hit_rate,
    with_oracle_rows,
)
from replay_workloads import read_claude_code, read_claude_code_folder, read_mooncake  # noqa: E402

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "claude_code_kvtester"

#: One block per request, a CPU tier of 2 blocks. LRU: block 1 hits in request 2, then
#: 2 and 3 push it out before request 5 (1 hit of 5). Second-use admission: 1 is admitted
#: by its load in request 2; 2 and 3 are first uses, so 3 evicts 2 and request 5 hits
#: (2 of 5). Belady: at request 4 it evicts 3 (never used again, deeper than 2): 2 of 5.
REQUESTS = [[1], [1], [2], [3], [1]]

#: At seconds: a session's two turns 2 s apart, four one-time blocks at 3 s, its third
#: turn at 3.5 s, in a CPU tier of 4 blocks. LRU: the turn-2 hits (2), then the four
#: blocks push 1, 2, 3 out (2 of 13). The session rule holds the chain for the gap seen
#: (2 s, 3 of the 4 slots' budget of 0.75): the third turn hits 3 more (5 of 13).
RETURNING = [(0, [1, 2]), (2000, [1, 2, 3]), *((3000, [10 + i]) for i in range(4)), (3500, [1, 2, 3, 4])]


def write_trace(path: Path, rows=None) -> Path:
    rows = [(0, r) for r in REQUESTS] if rows is None else rows
    path.write_text(
        "".join(json.dumps({"timestamp": t, "input_length": 512 * len(r), "hash_ids": r}) + "\n" for t, r in rows)
    )
    return path


def table_rows(text: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    assert rows[0] == ["policy", "block hit rate", "Belady", "infinite", "of Belady"]
    end = next(i for i, row in enumerate(rows) if i > 0 and row[0] == "mechanism")
    return {row[0]: row[1:] for row in rows[2:end]}


def bound_rows(text: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    start = next(i for i, row in enumerate(rows) if row[0] == "mechanism")
    return {row[0]: row[1:] for row in rows[start + 2 :]}


def test_the_table_of_a_tiny_trace(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl")
    assert replay.main(["--trace", str(trace), "--cpu-tokens", "1024", "--policies", "lru,lru+reuse(2)"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    # The features bound: first uses of a block return 1 in 3 here, second uses always, so
    # from threshold 0.35 up it admits as reuse(2) does.
    features = "lru+admission-features (threshold 0.35)"
    # The learned bound: each half is predicted by a model fitted on the other. In the
    # second half no block returns within the horizon, so block 1 (the first half) is
    # predicted not to return, ranks first to evict, and 2 and 3 push it out: no better
    # than LRU, which the grid's first threshold (0, admit all) is.
    learned = "lru+admission-learned (threshold 0, horizon 2.5 CPU tiers)"
    assert list(rows) == ["lru", "lru+reuse(2)", "lru+admission-oracle", features, learned, "belady"]
    assert rows[features] == ["0.400", "0.400", "0.400", "1.00"]
    assert rows[learned] == ["0.200", "0.400", "0.400", "0.50"]
    assert rows["lru"] == ["0.200", "0.400", "0.400", "0.50"]
    assert rows["lru+reuse(2)"] == ["0.400", "0.400", "0.400", "1.00"]
    assert rows["lru+admission-oracle"] == ["0.400", "0.400", "0.400", "1.00"]
    assert rows["belady"] == ["0.400", "0.400", "0.400", "1.00"]
    # The bounds table: each mechanism's best online rule beside its oracle.
    assert bound_rows(out) == {
        "eviction order": ["lru", "0.50", "belady", "1.00", "+0.50", "no"],
        "admission": ["lru+reuse(2)", "1.00", "lru+admission-oracle", "1.00", "+0.00", "yes"],
        "admission on features": ["lru+reuse(2)", "1.00", "lru+admission-features", "1.00", "+0.00", "yes"],
        "admission, learned": ["lru+reuse(2)", "1.00", "lru+admission-learned", "0.50", "-0.50", "yes"],
    }


def test_the_session_rule_keeps_a_returning_session_where_lru_loses_it(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", RETURNING)
    assert replay.main(["--trace", str(trace), "--cpu-tokens", "2048", "--policies", "lru,lru+session"]) == 0
    rows = table_rows(capsys.readouterr().out)
    retention = "lru+retention-features(0.75) (threshold 0.1, gap quantile 0.5)"
    assert list(rows) == [
        "lru",
        "lru+session",
        "lru+admission-oracle",
        "lru+admission-features (threshold 0.1)",
        "lru+admission-learned (threshold 0, horizon 2.5 CPU tiers)",
        "lru+retention-oracle(0.75)",
        retention,
        "belady",
    ]
    assert rows["lru"][0] == f"{2 / 13:.3f}"
    assert rows["lru+session"][0] == f"{5 / 13:.3f}"
    assert rows["lru+retention-oracle(0.75)"][0] == f"{5 / 13:.3f}"
    # The session's turns return (share 1), so the features bound holds each turn's chain
    # until its gap has passed, as the oracle does.
    assert rows[retention][0] == f"{5 / 13:.3f}"


def test_hit_rates_drive_the_product_managers():
    assert replay_hit_rate(REQUESTS, 2, "lru") == pytest.approx(1 / 5)
    assert replay_hit_rate(REQUESTS, 2, "lru+reuse(2)") == pytest.approx(2 / 5)
    assert replay_hit_rate(REQUESTS, 2, "arc+reuse(2)") == pytest.approx(2 / 5)
    # Adaptive starts as all: by request 4 neither miniature has hit more, so 3 evicts 1.
    assert replay_hit_rate(REQUESTS, 2, "lru+adaptive") == pytest.approx(1 / 5)
    assert replay_hit_rate(REQUESTS, 3, "lru") == pytest.approx(2 / 5)  # room for all three
    # Without time (all requests at 0) no gap is seen: the session rule is LRU.
    assert replay_hit_rate(REQUESTS, 2, "lru+session") == pytest.approx(1 / 5)


def test_names_and_sizes():
    assert parse_policy("arc+reuse( 3 )").name == "arc+reuse(3)"
    assert parse_policy("lru+adaptive+session").name == "lru+adaptive(2)+session"
    assert parse_policy("lru+adaptive").mechanism == "admission"
    assert parse_policy("lru") == parse_policy("lru+all")
    p = parse_policy("lru+reuse(2)+session(0.5)")
    assert (p.eviction, p.admission, p.retention, p.share, p.mechanism) == (
        "lru",
        "reuse(2)",
        "session(0.5)",
        0.5,
        "retention",
    )
    assert parse_policy("lru+oracle").name == "lru+admission-oracle"
    assert parse_policy("lru+retention-oracle(0.5)").is_oracle
    assert with_oracle_rows(["arc", "lru+reuse(2)+session(0.5)"]) == [
        "arc",
        "lru+reuse(2)+session(0.5)",
        "arc+admission-oracle",
        "arc+admission-features",
        "arc+admission-learned",
        "lru+admission-oracle",
        "lru+admission-features",
        "lru+admission-learned",
        "lru+retention-oracle(0.5)",
        "lru+reuse(2)+retention-features(0.5)",
        "belady",
    ]
    p = parse_policy("lru+reuse(2)+retention-features(0.5)")
    assert (p.admission, p.retention, p.share, p.is_oracle) == ("reuse(2)", "features(0.5)", 0.5, True)
    assert parse_policy("lru+admission-features").is_oracle
    learned = parse_policy("lru+admission-learned")
    assert (learned.admission, learned.is_oracle, learned.is_calibrated) == ("learned", True, True)
    with pytest.raises(ValueError, match="admission-learned without retention-features"):
        parse_policy("lru+admission-learned+retention-features")
    assert parse_tokens("3M") // 512 == 5859 and parse_tokens("500k") == 500_000
    with pytest.raises(ValueError, match="'fifo'"):
        parse_policy("fifo")
    with pytest.raises(ValueError, match="reuse\\(0\\)"):
        parse_policy("lru+reuse(0)")
    with pytest.raises(ValueError, match="a second: 'session'"):
        parse_policy("lru+session+session")
    with pytest.raises(ValueError, match="retention-oracle\\(S\\) with 0 < S <= 0.9, got 'retention-oracle\\(2\\)'"):
        parse_policy("lru+retention-oracle(2)")
    with pytest.raises(
        ValueError, match="retention-features\\(S\\) with 0 < S <= 0.9, got 'retention-features\\(1\\)'"
    ):
        parse_policy("lru+retention-features(1)")
    with pytest.raises(ValueError, match="lru\\+admission-features: a bound is replayed at its"):
        replay_requests(Requests.of("r", REQUESTS), 2, "lru+admission-features")
    with pytest.raises(ValueError, match="'3X'"):
        parse_tokens("3X")


#: Short requests come back, longer ones never do, in a CPU tier of 3 blocks: under LRU
#: (and reuse(2), whose first uses go first) two longer requests push the short one out
#: before it returns (0 of 12). The features bound learns that 1-block requests return
#: (share 1) and 2-block ones do not (share 0): it admits only the short ones, so the
#: longer ones evict each other, and both returns hit (2 of 12), as with the oracle.
SHORT_RETURN = [[1], [20, 21], [30, 31], [1], [2], [40, 41], [50, 51], [2]]


def test_the_features_bound_admits_what_its_description_says_returns():
    reqs = Requests.of("short", SHORT_RETURN)
    assert replay_requests(reqs, 3, "lru").hit_rate == 0
    assert replay_requests(reqs, 3, "lru+reuse(2)").hit_rate == 0
    assert replay_requests(reqs, 3, "lru+admission-oracle").hit_rate == pytest.approx(2 / 12)
    for threshold in (0.5, 1.0):
        bound = replay_requests(reqs, 3, "lru+admission-features", features=(threshold, 0.5))
        assert bound.hit_rate == pytest.approx(2 / 12)
    # At a threshold every description reaches, it admits all: LRU.
    assert replay_requests(reqs, 3, "lru+admission-features", features=(0.0, 0.5)).hit_rate == 0


def test_the_learned_bound_admits_what_the_other_half_taught_it():
    # SHORT_RETURN 40 times over fresh ids: each half holds 20 repeats, enough for the
    # classifier's leaves (20 rows at least). A first use of a 1-block request returns,
    # its second use and the 2-block requests do not; a model fitted on either half
    # learns that and admits only the short first uses, as the oracle does (2 of 12).
    repeated = [[100 * k + h for h in r] for k in range(40) for r in SHORT_RETURN]
    reqs = Requests.of("short", repeated)
    assert replay_requests(reqs, 3, "lru").hit_rate == 0
    assert replay_requests(reqs, 3, "lru+admission-oracle").hit_rate == pytest.approx(2 / 12)
    bound = replay_requests(reqs, 3, "lru+admission-learned", features=(0.5, None))
    assert bound.hit_rate == pytest.approx(2 / 12)
    # At a threshold no prediction reaches, nothing is admitted and the short ones go first.
    assert replay_requests(reqs, 3, "lru+admission-learned", features=(1.01, None)).hit_rate == 0


def test_a_table_of_bounds_alone(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl")
    assert replay.main(["--trace", str(trace), "--cpu-tokens", "1024", "--policies", "lru+admission-features"]) == 0
    out = capsys.readouterr().out
    assert list(table_rows(out)) == [
        "lru+admission-features (threshold 0.35)",
        "lru+admission-oracle",
        "lru+admission-learned (threshold 0, horizon 2.5 CPU tiers)",
        "belady",
    ]
    assert bound_rows(out) == {}  # no online rule to set beside a bound


def test_the_learned_bound_without_scikit_learn_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.ensemble", None)  # import fails as if not installed
    trace = write_trace(tmp_path / "t.jsonl")
    assert replay.main(["--trace", str(trace), "--cpu-tokens", "1024", "--policies", "lru"]) == 2
    assert "needs scikit-learn: pip install -e '.[bench]'" in capsys.readouterr().out


def test_a_missing_trace_is_named(capsys):
    assert replay.main(["--policies", "lru"]) == 2
    assert "--policies needs --trace" in capsys.readouterr().out


def test_sessions_by_prefix_chain_claim_a_tail_once():
    r = [[b"a"], [b"a", b"b"], [b"a", b"c"], [b"a", b"b", b"d"], [b"x"]]
    assert chain_sessions(r) == [0, 0, 2, 0, 4]


# ---------------------------------------------------------------- Claude Code


def conversation(path: Path) -> Path:
    """A conversation with a sub-agent whose nested requests fall between the parent's."""
    doc = {
        "id": "trace_0042",
        "block_size": 64,
        "hash_id_scope": "local",
        "requests": [
            {"t": 0.0, "type": "s", "in": 130, "hash_ids": [1, 2]},
            {
                "t": 5.0,
                "type": "subagent",
                "agent_id": "agent_001",
                "requests": [
                    {"t": 0.0, "type": "n", "in": 64, "hash_ids": [7]},
                    {"t": 12.0, "type": "n", "in": 128, "hash_ids": [7, 8]},
                ],
            },
            {"t": 10.0, "type": "n", "in": 192, "hash_ids": [1, 2, 3]},
        ],
    }
    path.write_text(json.dumps(doc))
    return path


def test_the_reader_flattens_sub_agents_in_time_order(tmp_path):
    got = read_claude_code(conversation(tmp_path / "c.json"))
    assert [(r.time, r.session, r.tokens) for r in got] == [
        (0.0, ("trace_0042", ""), 130),
        (5.0, ("trace_0042", "agent_001"), 64),
        (10.0, ("trace_0042", ""), 192),
        (17.0, ("trace_0042", "agent_001"), 128),
    ]
    assert got[2].blocks == ((42 << 32) | 1, (42 << 32) | 2, (42 << 32) | 3)  # local ids, prefixed
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"id": "trace_1", "requests": [{"t": 0, "type": "n", "in": 64}]}))
    with pytest.raises(ValueError, match="bad.json: requests\\[0\\]: bad request \\('hash_ids'\\)"):
        read_claude_code(bad)


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"{TRACES} is absent")
def test_the_reader_reads_a_real_conversation_with_sub_agents():
    got = read_claude_code(TRACES / "trace_0010.json")
    doc = json.loads((TRACES / "trace_0010.json").read_text())
    subs = [r for r in doc["requests"] if r["type"] == "subagent"]
    nested = sum(len(s["requests"]) for s in subs)
    assert len(got) == len(doc["requests"]) - len(subs) + nested
    times = [r.time for r in got]
    assert times == sorted(times)
    agents = [r.session[1] for r in got]
    first = agents.index("agent_001")
    assert got[first].time == pytest.approx(subs[0]["t"])  # a nested t counts from its sub-agent's start
    assert "" in agents[first : agents.index("agent_002")], "the parent's requests interleave with the sub-agent's"
    assert all(b >> 32 == 10 for r in got for b in r.blocks)


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"{TRACES} is absent")
def test_the_claude_code_replay_on_two_real_conversations(tmp_path, capsys):
    for name in ("trace_0012.json", "trace_0026.json"):
        (tmp_path / name).write_bytes((TRACES / name).read_bytes())
    argv = ["--traces", str(tmp_path), "--policies", "lru,lru+session,lru+retention-oracle", "--session-ids"]
    assert replay_claude_code.main([*argv, "--export-mooncake", str(tmp_path / "cc.jsonl")]) == 0
    out = capsys.readouterr().out
    rows = {r[0]: r[1:] for r in ([c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()) if r}
    assert {"lru", "lru+session", "lru+retention-oracle", "lru+session, session ids given"} <= set(rows)
    assert rows["lru"][3] == "1.000"  # CPU hits against LRU's
    exported = read_mooncake(tmp_path / "cc.jsonl")
    reqs = read_claude_code_folder(tmp_path)
    assert len(exported.requests) == len(reqs)
    assert [len(r) for r in exported.requests] == [r.tokens // 512 for r in reqs]


def test_a_disk_tier_serves_what_the_cpu_tier_lost(tmp_path):
    reqs = Requests.of("t", [[1, 2], [3, 4], [1, 2, 5]], [0, 1, 2])
    cpu_only = replay_requests(reqs, 2, "lru")
    with_disk = replay_requests(reqs, 2, "lru", lower_blocks=8, scratch=tmp_path)
    assert (cpu_only.cpu_hits, cpu_only.lower_hits) == (0, 0)
    assert (with_disk.cpu_hits, with_disk.lower_hits) == (0, 2)
    assert (with_disk.turns, with_disk.survived_cpu, with_disk.survived_any) == (1, 0, 1)
