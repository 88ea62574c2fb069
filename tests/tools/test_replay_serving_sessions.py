"""``tools/replay_serving_sessions.py`` and ``tools/replay_claude_code.py --serving``: the
closed loop (a request arrives at its predecessor's first token plus its gap, never
before; a session's turns in order; a client's next conversation after its last one),
the clients' shares and the gaps cut, the time factor's calibration, the CPU tier's
policy per row built as the product builds it, the rows whose clients name their
sessions or send KV hints (the names reaching the retention rule, the leases the
manager holds), and the table the command prints, on small conversations in
kv-cache-tester's format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.base", reason="vLLM is not installed (make venv installs it)", exc_type=ImportError
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import replay_claude_code  # noqa: E402
import replay_serving_sessions as sessions_mod  # noqa: E402
from replay_serving_sessions import Setup, auto_users, parse_row, run_policy, sessions, time_factor  # noqa: E402
from replay_serving_model import EngineConfig, GpuModel  # noqa: E402
from replay_serving_sim import Arrival  # noqa: E402
from replay_serving_stack import TierModel, build_stack  # noqa: E402
from replay_workloads import read_claude_code_folder  # noqa: E402
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

REAL = Path(__file__).resolve().parents[3] / "shared" / "traces" / "claude_code_kvtester"


def request(t: float, chunks: int, first_id: int = 0, extra: int = 100) -> dict:
    """A request of ``chunks`` 512-token chunks plus ``extra`` tokens whose 64-token block
    ids run from ``first_id``: requests with the same ``first_id`` share their prefix."""
    tokens = 512 * chunks + extra
    return {"t": t, "type": "n", "in": tokens, "out": 10, "hash_ids": list(range(first_id, first_id - (-tokens // 64)))}


def conversation(folder: Path, number: int, requests: list[dict]) -> None:
    doc = {"id": f"trace_{number:04d}", "block_size": 64, "hash_id_scope": "local", "requests": requests}
    (folder / f"trace_{number:04d}.json").write_text(json.dumps(doc))


def write_set(folder: Path) -> Path:
    """Three conversations: one long with a sub-agent launched after its second request,
    one with a 2-hour gap, one short; each turn extends its session's previous prompt."""
    folder.mkdir(exist_ok=True)
    sub = {"t": 12.0, "type": "subagent", "agent_id": "agent_1", "requests": [request(0, 2, 5000), request(4, 3, 5000)]}
    conversation(folder, 1, [request(0, 2), request(10, 4), sub, request(30, 6), request(60, 8)])
    conversation(folder, 2, [request(0, 3), request(20, 4), request(7220, 5)])
    conversation(folder, 3, [request(0, 2), request(5, 3)])
    return folder


def small_setup(cpu_blocks: int = 64, config: str = "always") -> Setup:
    return Setup(
        GpuModel(), EngineConfig(device_blocks=16), TierModel("disk", 3.0, 0.0, False), cpu_blocks, 256, config
    )


def test_a_request_waits_for_its_predecessors_first_token_plus_its_delay():
    keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(1, 9)]
    reqs = [Arrival(0.0, 4096 + 100, keys), Arrival(2.5, 4096 + 300, keys, after=0, prefix=8)]
    out = run_policy("lru", reqs, small_setup())
    first_token = out.arrived[0] + out.ttft[0]
    assert out.arrived == [0.0, pytest.approx(first_token + 2.5, rel=1e-12)]
    assert out.survived == {"turns": 1, "CPU": 1, "any": 1}  # its prefix was stored by the first
    with pytest.raises(ValueError, match="expected an earlier request"):
        run_policy("lru", [Arrival(0.0, 600, keys[:1], after=0)], small_setup())


def test_the_workload_chains_sessions_sub_agents_and_each_clients_conversations(tmp_path):
    folder = write_set(tmp_path / "set")
    s = sessions(read_claude_code_folder(folder), users=2, max_gap_s=3600)
    assert s.users == 2 and s.conversations == 3 and s.capped == 1
    turns = s.turns
    assert all(t.after is None or t.after < i for i, t in enumerate(turns))
    assert s.times == sorted(s.times)
    by_conv = {}
    for i, t in enumerate(turns):
        by_conv.setdefault(t.conversation, []).append(i)
    one = [turns[i] for i in by_conv["trace_0001"]]
    # Main chain 0, 10, 30, 60 s; the sub-agent at 12 s follows the request at 10 s.
    assert [t.tokens // 512 for t in one] == [2, 4, 2, 3, 6, 8]
    assert [t.delay for t in one] == [0.0, 10.0, 2.0, 4.0, 20.0, 30.0]
    assert [turns[t.after].tokens // 512 if t.after is not None else None for t in one] == [None, 2, 4, 2, 4, 6]
    assert [t.prefix for t in one] == [0, 2, 0, 2, 4, 6]
    # The 2-hour gap is cut to the hour.
    two = [turns[i] for i in by_conv["trace_0002"]]
    assert [t.delay for t in two] == [0.0, 20.0, 3600.0]
    # Longest first, each to the client with the least work: 1 (60 s) and 2 (3,620 s)
    # start at 0; 3 follows 1's last request (at 60 s).
    starts = {c: s.times[ids[0]] for c, ids in by_conv.items()}
    assert starts == {"trace_0001": 0.0, "trace_0002": 0.0, "trace_0003": 60.0}
    three = turns[by_conv["trace_0003"][0]]
    assert turns[three.after].conversation == "trace_0001" and turns[three.after].tokens // 512 == 8
    assert auto_users([60.0, 3620.0, 5.0]) == 1 and auto_users([100.0, 60.0, 50.0, 10.0]) == 2


def test_the_closed_loop_in_the_simulation(tmp_path):
    s = sessions(read_claude_code_folder(write_set(tmp_path / "set")), users=2)
    arrivals = s.arrivals(0.5)
    out = run_policy("lru", arrivals, small_setup())
    first_token = [a + t for a, t in zip(out.arrived, out.ttft)]
    for i, (a, turn) in enumerate(zip(arrivals, s.turns)):
        if turn.after is None:
            assert out.arrived[i] == pytest.approx(0.5 * turn.delay)
        else:
            assert out.arrived[i] == pytest.approx(first_token[turn.after] + 0.5 * turn.delay, rel=1e-12)
            assert out.arrived[i] >= first_token[turn.after]
    assert len(out.ttft) == len(s.turns) == 11
    chain = [i for i, t in enumerate(s.turns) if t.conversation == "trace_0002"]
    assert [out.arrived[i] for i in chain] == sorted(out.arrived[i] for i in chain)
    assert all(first_token[a] <= out.arrived[b] for a, b in zip(chain, chain[1:]))
    assert out.survived["turns"] == sum(1 for t in s.turns if t.prefix)


def test_the_time_factor_settles_where_the_replay_is_as_busy_as_asked():
    # Busy share of work 100 s over the scaled gaps (1,000 s) plus answers that take 300 s.
    calls = []

    def busy_at(factor: float) -> float:
        calls.append(factor)
        return 100.0 / (1000.0 * factor + 300.0)

    factor, busy, rounds = time_factor(100.0, 1000.0, 0.2, busy_at)
    assert busy == pytest.approx(0.2, rel=0.02) and factor == pytest.approx(0.2, rel=0.05)
    assert calls[0] == pytest.approx(0.5) and rounds == len(calls) <= 8
    # Never within 2%: the closest of the replays.
    shares = iter([0.3, 0.1, 0.25, 0.12, 0.26, 0.3, 0.1, 0.3])
    factor, busy, rounds = time_factor(100.0, 1000.0, 0.2, lambda f: next(shares))
    assert (busy, rounds) == (0.25, 8)
    with pytest.raises(ValueError, match="utilisation"):
        time_factor(1.0, 1.0, 1.5, busy_at)


def test_each_row_runs_the_products_cpu_tier_under_its_config_values(tmp_path):
    stack = build_stack(
        "always",
        TierModel("disk", 3.0, 0.0, False),
        cpu_blocks=32,
        lower_blocks=64,
        tokens_per_block=512,
        bytes_per_block=512 * 131_072,
        prefill_tokens_per_s=30_000.0,
        attention_per_token=0.0,
        clock=lambda: 0.0,
        verify_read=lambda key, slot, done: done(),
        scratch=tmp_path,
        cpu_retention="session",
        cpu_admission="reuse(2)",
        eviction_policy="arc",
        disk_retention="session",
    )
    try:
        cpu = stack.manager.composite.cpu
        assert type(cpu).__name__ == "ARCOffloadingManager"
        assert cpu.retention is not None and cpu.admission.admit_after == (2,)
        disk = stack.lower
        assert disk is not None and disk.retention is not None and disk.retention.clock() == 0.0
    finally:
        stack.close()
    row = parse_row("lru+session+disk+ids")
    assert row.name == "lru+session+disk+ids" and row.disk and row.ids and not parse_row("lru+session").disk
    # On the conversations: reuse(2) admits only chunks used twice; lru every one stored.
    s = sessions(read_claude_code_folder(write_set(tmp_path / "set")), users=2)
    rows = {p: run_policy(p, s.arrivals(0.2), small_setup(cpu_blocks=8)) for p in ("lru", "lru+reuse(2)")}
    cpu = {p: r.tier_stats["cpu"] for p, r in rows.items()}
    assert cpu["lru"]["not_admitted"] == 0 and cpu["lru"]["stores"] > 0
    admitted = {p: c["stores"] - c["not_admitted"] for p, c in cpu.items()}
    assert admitted["lru+reuse(2)"] < admitted["lru"]
    with pytest.raises(ValueError, match="oracle"):
        run_policy("lru+admission-oracle", s.arrivals(0.2), small_setup())


def test_the_command_prints_one_row_per_policy(tmp_path, capsys):
    folder = write_set(tmp_path / "set")
    argv = ["--serving", "--traces", str(folder), "--utilisation", "0.5", "--scratch", str(tmp_path)]
    assert replay_claude_code.main([*argv, "--policies", "lru,lru+reuse(2),lru+session", "--users", "2"]) == 0
    out = capsys.readouterr().out
    table, phases = (t.splitlines() for t in out.split("\n\n") if t.startswith("|"))
    assert [c.strip() for c in table[0].strip("|").split("|")] == sessions_mod.COLUMNS
    assert [line.split("|")[1].strip() for line in table[2:]] == ["lru", "lru+reuse(2)", "lru+session"]
    assert table[2].split("|")[11].strip() == "1.00"  # p90 over LRU's own
    assert phases[0].split("|")[2].strip() == "waiting"  # and where each row's time goes
    assert [line.split("|")[1].strip() for line in phases[2:]] == ["lru", "lru+reuse(2)", "lru+session"]
    assert "3 conversations" in out and "2 clients" in out and "1 gaps over 3600 s" in out
    for bad in (["--policies", "lru+retention-oracle"], ["--config", "sometimes"], ["--utilisation", "1.5"]):
        with pytest.raises(SystemExit):
            replay_claude_code.main([*argv, *bad])


def write_rewritten(folder: Path) -> Path:
    """``write_set`` and a fourth conversation whose second turn rewrote its context (a
    prefix of its own, as after a compaction), which the third turn then extends."""
    write_set(folder)
    conversation(folder, 4, [request(0, 2, 0), request(10, 3, 9000), request(20, 4, 9000)])
    return folder


def test_named_sessions_reach_the_retention_rule(tmp_path):
    s = sessions(read_claude_code_folder(write_rewritten(tmp_path / "set")), users=2)
    named = {t.session for t in s.turns}
    assert named == {"trace_0001", "trace_0001/agent_1", "trace_0002", "trace_0003", "trace_0004"}
    assert [t.last for t in s.turns].count(True) == len(named)  # one last turn per session
    row = parse_row("lru+session+ids")
    assert (row.name, row.policy.retention, row.ids, row.hints) == ("lru+session+ids", "session", True, False)
    arrivals = s.arrivals(1.0, row)
    assert [a.session for a in arrivals] == [t.session for t in s.turns] and all(a.hints is None for a in arrivals)
    assert all(a.session is None for a in s.arrivals(1.0, parse_row("lru+session")))
    # At factor 1 every gap is over the rule's 1 s turn gap: told the names, it sees each
    # session's every later turn come back; inferring from the prefix chain, it takes the
    # rewritten turn for a new session.
    out = {
        name: run_policy(name, s.arrivals(1.0, parse_row(name)), small_setup())
        for name in ("lru+session", "lru+session+ids")
    }
    assert out["lru+session+ids"].retention["returns"] == len(s.turns) - len(named) == 9
    assert out["lru+session"].retention["returns"] == 8


def test_hinted_rows_make_the_manager_hold_leases_and_release_them(tmp_path):
    s = sessions(read_claude_code_folder(write_rewritten(tmp_path / "set")), users=2)
    n_sessions = len({t.session for t in s.turns})
    row = parse_row("lru+hints")
    arrivals = s.arrivals(0.5, row)
    for a, t in zip(arrivals, s.turns):
        assert a.session is None and a.hints is not None
        (action,) = a.hints.actions
        if t.last:
            assert (action.action_type, action.payload) == ("kv.release", {"lease_id": t.session})
        else:  # the product's default TTL, compressed as the gaps are
            assert (action.action_type, action.payload) == ("kv.retain", {"lease_id": t.session, "ttl_s": 150.0})
    out = run_policy("lru+hints", arrivals, small_setup())
    h = out.hints
    assert h["actions"] == {"retain.accepted": len(s.turns) - n_sessions, "release.accepted": n_sessions}
    assert h["peak"]["leases"] > 0 and h["peak"]["cpu"] > 0  # leases held, their chunks pinned
    assert h["leases"] == 0 and h["pinned_blocks"] == {"cpu": 0, "disk": 0}  # every session released its lease
    # Each session's last turn released a lease still held, but trace_0002's, whose
    # hour-long last gap (1,800 s here) outlasted its 150 s TTL.
    assert h["on_arrival"]["kv.release"] == n_sessions and h["on_arrival"]["kv.release.held"] == n_sessions - 1
    # kv.prefetch acts only where the workers run prefetch jobs: the row turns them on.
    prefetching = run_policy("lru+hints+prefetch", s.arrivals(0.5, parse_row("lru+hints+prefetch")), small_setup())
    assert prefetching.hints["actions"]["prefetch.accepted"] == len(s.turns)
    assert "prefetch.unsupported" not in prefetching.hints["actions"] and prefetching.prefetch
    # A row without hints sends none, and its notes say nothing of them.
    plain = run_policy("lru", s.arrivals(0.5, parse_row("lru")), small_setup())
    assert plain.hints["actions"] == {} and plain.hints["peak"] == {}
    notes = sessions_mod.notes([("lru", plain), ("lru+hints", out)], small_setup().tier)
    assert "hints:" not in notes[0]
    assert "of 9 naming a lease an earlier turn named, 8 found it held within its TTL" in notes[1]
    assert "release.accepted 5, retain.accepted 9" in notes[1] and "at the end 0 leases" in notes[1]


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("lru+sessoin", "'lru+sessoin'"),
        ("lru+ids", "'lru+ids': +ids names the sessions for a cpu_retention session rule"),
        ("lru+prefetch", "'lru+prefetch': +prefetch is a hint"),
        ("lru+hints+ids", "'lru+hints+ids': each part once, in that order; expected <policy>[+disk][+ids][+hints["),
        ("lru+ids+session", "'lru+ids+session'"),
    ],
)
def test_an_unknown_row_is_refused_naming_it_and_the_forms(name, says):
    with pytest.raises(ValueError) as info:
        parse_row(name)
    assert says in str(info.value) and "[+ids][+hints[+prefetch]]" in str(info.value)


def test_the_command_prints_the_clients_rows(tmp_path, capsys):
    folder = write_set(tmp_path / "set")
    argv = ["--serving", "--traces", str(folder), "--utilisation", "0.5", "--scratch", str(tmp_path), "--users", "2"]
    assert replay_claude_code.main([*argv, "--policies", "lru,lru+session+ids,lru+hints"]) == 0
    out = capsys.readouterr().out
    table = next(t.splitlines() for t in out.split("\n\n") if t.startswith("|"))
    assert [line.split("|")[1].strip() for line in table[2:]] == ["lru", "lru+session+ids", "lru+hints"]
    assert "clients: 4 sessions" in out and "kv.retain (lease_id its session, ttl_s 300 s x" in out
    assert "- lru+hints:" in out and "; hints: actions release.accepted 4, retain.accepted 7;" in out
    with pytest.raises(SystemExit):
        replay_claude_code.main([*argv, "--policies", "lru+bogus"])
    err = capsys.readouterr().err
    assert "'lru+bogus'" in err and "<policy>[+disk][+ids][+hints[+prefetch]]" in err


@pytest.mark.skipif(not REAL.is_dir(), reason="the Claude Code traces are not here")
def test_two_real_conversations_with_time(tmp_path, capsys):
    folder = tmp_path / "real"
    folder.mkdir()
    for name in ("trace_0026.json", "trace_0032.json"):  # 3 requests each
        (folder / name).write_bytes((REAL / name).read_bytes())
    argv = ["--serving", "--traces", str(folder), "--utilisation", "0.5", "--policies", "lru,lru+session"]
    assert replay_claude_code.main([*argv, "--scratch", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 conversations, 6 requests" in out and "| lru+session" in out
