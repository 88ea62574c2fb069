"""``tools/replay.py --policies``: the CPU-tier policy table on a trace small enough to
check by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import replay  # noqa: E402
from replay_policies import parse_policy, parse_tokens, replay_hit_rate  # noqa: E402

#: One block per request, a CPU tier of 2 blocks. LRU: block 1 hits in request 2, then
#: 2 and 3 push it out before request 5 (1 hit of 5). Second-use admission: 1 is admitted
#: by its load in request 2; 2 and 3 are first uses, so 3 evicts 2 and request 5 hits
#: (2 of 5). Belady: at request 4 it evicts 3 (never used again, deeper than 2): 2 of 5.
REQUESTS = [[1], [1], [2], [3], [1]]


def write_trace(path: Path) -> Path:
    path.write_text("".join(json.dumps({"input_length": 512, "hash_ids": r}) + "\n" for r in REQUESTS))
    return path


def table_rows(text: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    assert rows[0] == ["policy", "block hit rate", "Belady", "of Belady"]
    return {row[0]: row[1:] for row in rows[2:]}


def test_the_table_of_a_tiny_trace(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl")
    assert replay.main(["--trace", str(trace), "--cpu-tokens", "1024", "--policies", "lru,lru+reuse(2)"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == ["lru", "lru+reuse(2)", "lru+oracle"]
    assert rows["lru"] == ["0.200", "0.400", "0.50"]
    assert rows["lru+reuse(2)"] == ["0.400", "0.400", "1.00"]
    assert rows["lru+oracle"] == ["0.400", "0.400", "1.00"]


def test_hit_rates_drive_the_product_managers():
    assert replay_hit_rate(REQUESTS, 2, "lru") == pytest.approx(1 / 5)
    assert replay_hit_rate(REQUESTS, 2, "lru+reuse(2)") == pytest.approx(2 / 5)
    assert replay_hit_rate(REQUESTS, 2, "arc+reuse(2)") == pytest.approx(2 / 5)
    assert replay_hit_rate(REQUESTS, 3, "lru") == pytest.approx(2 / 5)  # room for all three


def test_names_and_sizes():
    assert parse_policy("arc+reuse( 3 )") == ("arc", "reuse(3)")
    assert parse_policy("lru") == ("lru", "all")
    assert parse_tokens("3M") // 512 == 5859 and parse_tokens("500k") == 500_000
    with pytest.raises(ValueError, match="'fifo'"):
        parse_policy("fifo")
    with pytest.raises(ValueError, match="reuse\\(0\\)"):
        parse_policy("lru+reuse(0)")
    with pytest.raises(ValueError, match="'3X'"):
        parse_tokens("3X")


def test_a_missing_trace_is_named(capsys):
    assert replay.main(["--policies", "lru"]) == 2
    assert "--policies needs --trace" in capsys.readouterr().out
