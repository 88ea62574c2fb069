"""``tools/replay_mooncake_sessions.py``: a Mooncake trace's requests as open-loop turns
of sessions chained by prefix, one row per CPU-tier policy through the serving replay,
its ``of Belady`` column against Belady at the device + CPU capacity, the synthesised
hints reaching the manager, and bad rows refused; on a small trace in Mooncake's format."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.base", reason="vLLM is not installed (make venv installs it)", exc_type=ImportError
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import replay_mooncake_sessions as tool  # noqa: E402
from replay_cost import belady_hit_rate  # noqa: E402
from replay_serving_workloads import mooncake  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def write_trace(path: Path) -> Path:
    """Three sessions of four turns, each turn extending its previous prompt by two
    512-token blocks, interleaved with one-off requests; 10 s apart."""
    rows, t, fresh = [], 0, 10_000
    for turn in range(4):
        for s in range(3):
            ids = list(range(100 * s, 100 * s + 2 * (turn + 1)))
            rows.append({"timestamp": t, "input_length": 512 * len(ids) + 100, "hash_ids": [*ids, fresh]})
            fresh, t = fresh + 1, t + 10_000
        rows.append({"timestamp": t, "input_length": 512 * 3, "hash_ids": [fresh, fresh + 1, fresh + 2]})
        fresh, t = fresh + 3, t + 10_000
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_requests_become_open_loop_turns_of_sessions_chained_by_prefix(tmp_path):
    s = tool.chained(mooncake(write_trace(tmp_path / "t.jsonl")))
    assert len(s.turns) == 16 and s.conversations == 3 + 4
    by_session: dict[str, list] = {}
    for t in s.turns:
        by_session.setdefault(t.session, []).append(t)
        assert t.after is None  # open loop: each at its own time
    chains = [turns for turns in by_session.values() if len(turns) == 4]
    assert len(chains) == 3
    for turns in chains:
        assert [t.prefix for t in turns] == [0, 2, 4, 6]  # chunks shared with the session's previous
        assert [t.last for t in turns] == [False, False, False, True]
    assert [t.delay for t in s.turns][:3] == [0.0, 10.0, 20.0]


def test_the_command_prints_one_row_per_policy_beside_belady(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl")
    args = ["--trace", str(trace), "--cpu-tokens", "3k", "--device-tokens", "1024", "--utilisation", "0.5"]
    assert tool.main([*args, "--policies", "lru,lru+hints,lru+session+ids", "--scratch", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    stream = mooncake(trace)
    belady = belady_hit_rate(stream.blocks, 2 + 5)
    assert f"Belady at device + CPU {belady:.3f}" in out
    lines = out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("| policy")))
    header, table = lines[at], lines[at + 2 : at + 5]
    assert [line.split("|")[1].strip() for line in table] == ["lru", "lru+hints", "lru+session+ids"]
    assert not lines[at + 5]
    cols = [c.strip() for c in header.split("|")[1:-1]]
    chunks = sum(map(len, stream.blocks))
    for line in table:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        gpu, cpu = float(cells[cols.index("hit rate: GPU")]), float(cells[cols.index("CPU")])
        assert float(cells[cols.index("of Belady")]) == pytest.approx((gpu + cpu) / belady, abs=0.006 + 1 / chunks)
    # The synthesised hints reach the manager: a retain per turn but a session's last, a release at each last.
    hinted = next(line for line in out.splitlines() if line.startswith("- lru+hints:"))
    assert re.search(r"release\.accepted 7, retain\.accepted 9", hinted), hinted


@pytest.mark.parametrize(
    "args, says",
    [
        (["--policies", "lru+bogus"], "lru+bogus"),
        (["--policies", "lru+prefetch"], "lru+prefetch"),
        (["--policies", "lru+ids"], "lru+ids"),
        (["--tier-gbps", "inf"], "--tier-gbps: expected a finite rate > 0, got inf"),
        (["--tier-gbps", "-1"], "got -1"),
        (["--device-tokens", "0"], "--device-tokens: expected at least one chunk (512), got 0"),
        (["--utilisation", "nan"], "--utilisation: expected 0 < u <= 2, got nan"),
    ],
)
def test_a_bad_value_is_refused_naming_it(args, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--trace", str(write_trace(tmp_path / "t.jsonl")), *args])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
