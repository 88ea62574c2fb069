"""``tiered-kv inspect`` as an operator scripts it, on a cache ``tiered-kv demo`` wrote:
ages need a unit (``--older-than 7`` is refused, not 7 seconds), ``evict`` and ``clear``
have dry runs that change nothing, ``verify --repair`` exits 0 once the cache verifies
clean, and every command's ``--json`` is one envelope (schema, version, path, ISO 8601
times, namespaces as a list, full hashes)."""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from support import disk_fixtures as fx
from tiered_kv.cli import app
from tiered_kv.cli.output import HASH_PREFIX, SCHEMA_VERSION
from tiered_kv.ops.inspect import open_cache, read_entries

runner = CliRunner()
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "cache"
    result = runner.invoke(
        app, ["demo", "--requests", "40", "--device", "cpu", "--cache-dir", str(path), "--disk-bytes", "8MiB"]
    )
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture
def cache(demo_cache, tmp_path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(demo_cache, dst)
    return dst


def run(*args, code: int = 0):
    result = runner.invoke(app, ["inspect", *map(str, args)])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def run_json(*args, code: int = 0) -> dict:
    return json.loads(run(*args, "--json", code=code).stdout)


def entries(cache: Path) -> int:
    (ns,) = open_cache(cache).namespaces
    return len(read_entries(ns))


def assert_envelope(data: dict, command: str, path: Path) -> None:
    assert data["schema"] == f"tiered-kv/inspect-{command}" and data["schema_version"] == SCHEMA_VERSION
    assert ISO.match(data["generated"])
    generated = datetime.fromisoformat(data["generated"])
    assert abs((datetime.now(timezone.utc) - generated).total_seconds()) < 600
    assert data["path"] == str(path)


# ---------------------------------------------------------------- ages need a unit


def test_an_age_without_a_unit_is_refused_and_nothing_is_evicted(cache):
    before = entries(cache)
    err = run("evict", cache, "--older-than", "7", code=2).stderr
    assert err.startswith("error: --older-than: '7' has no unit; write 7d for days") and len(err.splitlines()) == 1
    assert "'7' has no unit" in run("ls", cache, "--newer-than", "7", code=2).stderr
    assert "cannot parse age '7y'" in run("evict", cache, "--older-than", "7y", code=2).stderr
    assert entries(cache) == before
    # With a unit it is taken: every block was used within the last week.
    assert run_json("evict", cache, "--older-than", "7d")["evicted"] == 0
    # 0 is 0 in any unit.
    assert run_json("evict", cache, "--older-than", "0", "--dry-run")["evicted"] == before


def test_a_bare_small_size_is_refused_with_a_hint(cache):
    err = run("evict", cache, "--to-size", "4096", code=2).stderr
    assert "--to-size: '4096' has no unit" in err and "'4096B' if you mean bytes" in err
    assert run_json("evict", cache, "--to-size", "1GiB")["evicted"] == 0


# ---------------------------------------------------------------- dry runs


def test_evict_dry_run_reports_what_evict_then_does(cache):
    before = entries(cache)
    slot = open_cache(cache).namespaces[0].manifest.slot_size
    target = f"{(before // 3) * slot}B"
    planned = run_json("evict", cache, "--to-size", target, "--dry-run")
    assert planned["dry_run"] is True and planned["evicted"] == before - before // 3 > 0
    assert entries(cache) == before  # nothing changed
    assert "would evict" in run("evict", cache, "--to-size", target, "--dry-run").stdout
    done = run_json("evict", cache, "--to-size", target)
    assert done["dry_run"] is False
    assert (done["evicted"], done["freed_bytes"]) == (planned["evicted"], planned["freed_bytes"])
    assert done["namespaces"] == planned["namespaces"]
    assert entries(cache) == before // 3


def test_clear_dry_run_deletes_nothing_and_needs_no_confirmation(cache):
    names = sorted(p.name for p in cache.iterdir())
    planned = run_json("clear", cache, "--dry-run")
    assert planned["dry_run"] is True and planned["removed"] == names and planned["freed_bytes"] > 0
    assert [n["namespace"] for n in planned["namespaces"]] == names
    assert sorted(p.name for p in cache.iterdir()) == names
    assert "would remove 1 namespace(s)" in run("clear", cache, "--dry-run").stdout
    done = run_json("clear", cache, "--yes")
    assert done["removed"] == planned["removed"]
    # The real clear also removes the lock record it writes while it holds the lock.
    assert planned["freed_bytes"] <= done["freed_bytes"] <= planned["freed_bytes"] + (64 << 10)
    assert list(cache.iterdir()) == []


# ---------------------------------------------------------------- verify --repair


def test_verify_repair_exits_0_when_the_repaired_cache_verifies_clean(cache):
    (ns,) = open_cache(cache).namespaces
    table = read_entries(ns)
    fx.flip_byte(ns.slab_path(0), int(table.slot[3]) * ns.manifest.slot_size + 100)
    found = run_json("verify", cache, code=1)
    assert found["corrupt_blocks"] == 1 and found["clean"] is False
    repaired = run_json("verify", cache, "--repair")  # exit 0
    assert repaired["corrupt_blocks"] == 1 and repaired["clean"] is True
    assert repaired["namespaces"][0]["repaired"] == 1 and repaired["namespaces"][0]["clean_after_repair"]
    after = run_json("verify", cache)
    assert after["corrupt_blocks"] == 0 and after["clean"] is True
    assert after["namespaces"][0]["blocks"] == len(table) - 1
    assert "now verifies clean" in run("verify", cache, "--repair").stdout


# ---------------------------------------------------------------- the JSON envelope


def test_every_inspect_command_has_the_envelope(cache):
    (ns,) = open_cache(cache).namespaces
    table = read_entries(ns)
    summary = run_json("summary", cache)
    assert_envelope(summary, "summary", cache)
    (s,) = summary["namespaces"]
    for key in ("created", "oldest_stored", "newest_stored", "least_recent_access", "most_recent_access"):
        assert ISO.match(s[key]), key
    ls = run_json("ls", cache, "--limit", 0)
    assert_envelope(ls, "ls", cache)
    (lst,) = ls["namespaces"]
    assert lst["namespace"] == ns.path.name and len(lst["entries"]) == len(table)
    for e in lst["entries"]:
        assert ISO.match(e["stored"]) and ISO.match(e["last_access"])
        assert len(e["hash"]) == 2 * len(table.hash(0))  # the full hash
    verify = run_json("verify", cache)
    assert_envelope(verify, "verify", cache)
    assert [n["namespace"] for n in verify["namespaces"]] == [ns.path.name]
    evict = run_json("evict", cache, "--to-size", "1GiB", "--dry-run")
    assert_envelope(evict, "evict", cache)
    assert isinstance(evict["namespaces"], list) and evict["namespaces"][0]["namespace"] == ns.path.name
    clear = run_json("clear", cache, "--dry-run")
    assert_envelope(clear, "clear", cache)
    bench = run_json("bench", cache, "--size", "2MiB", "--block-size", "1MiB", "--rounds", "1", "--threads", "1")
    assert_envelope(bench, "bench", cache)
    backend = bench["backend"]
    assert backend["name"] in ("posix", "kvikio") and backend["threads"] == 1
    assert isinstance(backend["gds"], bool) and isinstance(backend["o_direct"], bool)
    assert isinstance(bench["raw"]["o_direct"], bool)
    # Errors too: the envelope with the message.
    err = json.loads(run("summary", cache / "missing", "--json", code=2).stdout)
    assert err["schema"] == "tiered-kv/inspect-summary" and "does not exist" in err["error"]


def test_tables_show_one_hash_prefix_length(cache):
    (ns,) = open_cache(cache).namespaces
    table = read_entries(ns)
    full = {table.hash(i).hex() for i in range(len(table))}
    text = run("ls", cache, "--limit", 0).stdout
    shown = set(re.findall(r"^\s+([0-9a-f]{8,})\s", text, re.M))
    assert shown and all(len(h) == HASH_PREFIX for h in shown)
    assert shown == {h[:HASH_PREFIX] for h in full}
    fx.flip_byte(ns.slab_path(0), int(table.slot[0]) * ns.manifest.slot_size)
    assert table.hash(0).hex()[:HASH_PREFIX] in run("verify", cache, code=1).stdout
    assert table.hash(0).hex()[: HASH_PREFIX + 1] not in run("verify", cache, code=1).stdout


def untimed(data):
    """``data`` without what a second run measures anew (times, rates)."""
    if isinstance(data, dict):
        timed = ("generated", "seconds", "gbps", "per_s", "elapsed")
        return {k: untimed(v) for k, v in data.items() if not any(t in k for t in timed)}
    if isinstance(data, list):
        return [untimed(v) for v in data]
    return data


def test_a_tier_named_in_a_config_is_inspected_as_its_directory(cache, tmp_path):
    """``--tier NAME --config FILE`` finds the tier by its name in the server's config, in
    either grammar, and a disk tier answers as its directory does; an unknown name and a
    missing config are one error line each."""
    for extra in (
        {"disk_path": str(cache), "disk_bytes": "8MiB"},
        {"tiers": [{"type": "disk", "name": "nvme", "path": str(cache), "bytes": "8MiB"}]},
    ):
        name = "nvme" if "tiers" in extra else "disk"
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps(extra))
        for verb in ("summary", "ls", "verify"):
            # summary keeps the config as one whose reads it judges, as summary PATH --config does
            by_path = run_json(verb, cache, *(("--config", config) if verb == "summary" else ()))
            by_tier = run_json(verb, "--tier", name, "--config", config)
            assert untimed(by_tier) == untimed(by_path), verb
        for verb, *args in (("evict", "--to-size", "1MiB", "--dry-run"), ("clear", "--dry-run")):
            by_path = run_json(verb, cache, *args)
            by_tier = run_json(verb, "--tier", name, "--config", config, *args)
            assert untimed(by_tier) == untimed(by_path), verb
            assert by_tier["dry_run"] and entries(cache) == 64  # nothing changed
    missing = run("ls", "--tier", "ssd", "--config", config, code=2)
    assert "has no tier of that name (its tiers: nvme)" in missing.output
    alone = run("ls", "--tier", "nvme", code=2)
    assert "give the server's config (--config FILE, once)" in alone.output
    stray = run("ls", str(cache), "--config", config, code=2)
    assert "--config applies with --tier NAME" in stray.output
