"""``tiered-kv inspect`` on real caches written by the whole hierarchy (HierarchySpec
+ EngineDriver, as ``tiered-kv demo`` does): every command, with tables and with --json,
on a healthy cache, a cache with a flipped byte, a cache an engine in another process
holds open, an empty directory and paths that are not caches; plus a 1M-entry index."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from support import disk_fixtures as fx
from tiered_kv.cli import _load_commands, app
from tiered_kv.disk.format.index import DiskIndex
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import Namespace, list_namespaces
from tiered_kv.sim.driver import DeviceKVCache, EngineDriver
from tiered_kv.ops.inspect import evict, open_cache, read_entries
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.sim.workloads import default_workload

_load_commands()
runner = CliRunner()
GPU_BLOCK = 16
# Every block found is loaded (the decision, swayed by this machine's measured loads, is tested on its own).
CONFIG = {
    "cpu_bytes": "256KiB",
    "disk_bytes": "4MiB",
    "block_size": GPU_BLOCK,
    "model_id": "inspect-test",
    "cover_weights": False,  # synthetic KV
    "cost_aware": False,
}


def device_cache() -> DeviceKVCache:
    return DeviceKVCache(
        num_layers=2,
        num_gpu_blocks=64,
        gpu_block_size=GPU_BLOCK,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float16,
        kv_before_num_blocks=True,
        device="cpu",
    )


@contextlib.contextmanager
def engine(cache_dir: Path) -> Iterator[EngineDriver]:
    """An engine on ``cache_dir``, closed when the block ends: its worker, its manager,
    then the spec's disk store."""
    with HierarchySpec({**CONFIG, "disk_path": str(cache_dir)}, gpu_block_size=GPU_BLOCK) as spec:
        driver = EngineDriver.from_spec(spec, device_cache())
        with driver.manager, driver.worker:
            yield driver


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A cache written by the three-tier hierarchy replaying a chat workload."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("hierarchy") / "cache"
    with engine(path) as driver:
        report = driver.run(default_workload(80, seed=3))
    assert report.mismatches == 0 and report.blocks_stored > 50
    return path


@pytest.fixture
def cache(built_cache, tmp_path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(built_cache, dst)
    return dst


def run(*args: str, code: int = 0):
    result = runner.invoke(app, ["inspect", *map(str, args)])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def run_json(*args: str, code: int = 0) -> dict:
    return json.loads(run(*args, "--json", code=code).stdout)


def only_namespace(cache_dir: Path) -> Namespace:
    (ns,) = list_namespaces(cache_dir)
    return ns


# ---------------------------------------------------------------- summary / ls


def test_layers_are_read_from_each_writers_geometry():
    from tiered_kv.ops.server_namespace import kv_layers

    own = tuple((f"layer{i}", (2, 16, 2, 8)) for i in range(5))
    pages = (
        ("vllm_worker_block", (4096,)),
        ("kv_group0:20_layers:0123abcd", (16, 0)),
        ("kv_group1:4_layers:ff", (16, 2)),
    )
    rows = (("vllm_cpu_chunk", (8192, 4096, 1)), ("kv_group0", (16, 28, 0)))
    staged = (("vllm_worker_block", (4096,)), ("kv_group0", (16, 0)))  # pipeline parallel: groups only
    assert [kv_layers(g) for g in (own, pages, rows, staged, ())] == [5, 24, 28, None, 0]


def test_summary_describes_the_namespace_the_hierarchy_wrote(cache):
    ns = only_namespace(cache)
    table = read_entries(ns)
    data = run_json("summary", cache)
    (s,) = data["namespaces"]
    assert s["namespace"] == ns.path.name
    assert s["fingerprint"]["model_id"] == "inspect-test" and s["fingerprint"]["dtype"] == "float16"
    assert s["fingerprint"]["tp_size"] == 1 and s["layers"] == 2
    assert s["blocks"] == len(table) > 50 and s["incomplete_entries"] == 0
    assert s["used_bytes"] == s["blocks"] * ns.manifest.slot_size
    assert s["capacity_bytes"] == ns.manifest.num_slots * ns.manifest.slot_size == 4 << 20
    # JSON timestamps are ISO 8601 (UTC)
    assert datetime.fromisoformat(s["oldest_stored"]).timestamp() == pytest.approx(table.store_time.min())
    assert datetime.fromisoformat(s["newest_stored"]).timestamp() == pytest.approx(table.store_time.max())
    assert s["hits_total"] == int(table.hits.sum()) > 0  # the replay hit disk blocks
    assert s["engine"] is None and s["health"] == {"status": "ok", "problems": []}
    assert s["io_backend"]["posix_direct"] in (True, False)

    text = run("summary", cache).stdout
    for word in ("inspect-test", "float16", f"{s['blocks']:,} of", "health", "ok", "posix"):
        assert word in text
    # A namespace directory itself is accepted too.
    assert run_json("summary", ns.path)["namespaces"][0]["blocks"] == s["blocks"]
    # Leftovers of interrupted operations are pointed out.
    (cache / ".tiered-kv-bench-123-abc").mkdir()
    (cache / ".tiered-kv-canary-x1y2").mkdir()
    assert sorted(run_json("summary", cache)["problems"]) == [
        f"{name}: left by an interrupted namespace creation, clear, bench or start-up canary (safe to delete "
        "while no engine starts)"
        for name in (".tiered-kv-bench-123-abc", ".tiered-kv-canary-x1y2")
    ]


def test_ls_lists_filters_and_sorts_entries(cache):
    table = read_entries(only_namespace(cache))
    data = run_json("ls", cache, "--limit", 0)
    (lst,) = data["namespaces"]
    assert lst["total"] == lst["matching"] == len(lst["entries"]) == len(table)
    access = [e["last_access"] for e in lst["entries"]]
    assert access == sorted(access, reverse=True)  # newest first by default
    assert all(e["ranks"] == [0] and e["complete"] and e["size"] == table.size[0] for e in lst["entries"])

    hot = run_json("ls", cache, "--sort", "hits", "--limit", 5)["namespaces"][0]["entries"]
    assert [e["hits"] for e in hot] == sorted(table.hits.tolist(), reverse=True)[:5]
    hit = run_json("ls", cache, "--min-hits", 1, "--limit", 0)["namespaces"][0]
    assert hit["matching"] == int((table.hits >= 1).sum()) > 0
    assert all(e["hits"] >= 1 for e in hit["entries"])
    slots = run_json("ls", cache, "--sort", "slot", "--asc", "--limit", 3)["namespaces"][0]["entries"]
    assert [e["slot"] for e in slots] == sorted(table.slot.tolist())[:3]

    target = lst["entries"][7]["hash"]
    by_hash = run_json("ls", cache, "--hash", target[:9])["namespaces"][0]["entries"]
    assert target in [e["hash"] for e in by_hash] and all(e["hash"].startswith(target[:9]) for e in by_hash)
    assert run_json("ls", cache, "--older-than", "1d")["namespaces"][0]["matching"] == 0
    assert run_json("ls", cache, "--newer-than", "1d")["namespaces"][0]["matching"] == len(table)
    assert run_json("ls", cache, "--state", "incomplete")["namespaces"][0]["matching"] == 0

    text = run("ls", cache, "--limit", 4).stdout
    assert "4 shown" in text and target[:12] in run("ls", cache, "--hash", target[:9]).stdout


# ---------------------------------------------------------------- verify


def test_verify_passes_a_healthy_cache(cache):
    data = run_json("verify", cache)
    (r,) = data["namespaces"]
    ns = only_namespace(cache)
    assert r["blocks"] == r["copies_checked"] == len(read_entries(ns)) > 50
    assert r["bytes_read"] == r["blocks"] * ns.manifest.block_bytes
    assert data["corrupt_blocks"] == 0 and r["incomplete"] == []
    assert "OK" in run("verify", cache).stdout


def test_verify_finds_a_flipped_byte_and_repair_drops_that_block(cache):
    ns = only_namespace(cache)
    table = read_entries(ns)
    victim = 5
    bad_hash, slot = table.hash(victim), int(table.slot[victim])
    fx.flip_byte(ns.slab_path(0), slot * ns.manifest.slot_size + 1234)

    data = run_json("verify", cache, code=1)
    assert data["corrupt_blocks"] == 1
    (c,) = data["namespaces"][0]["corrupt"]
    assert (c["hash"], c["slot"], c["rank"], c["reason"]) == (bad_hash.hex(), slot, 0, "checksum mismatch")
    text = run("verify", cache, code=1).stdout
    assert "CORRUPT" in text and bad_hash.hex()[:16] in text and "--repair" in text
    assert len(read_entries(ns)) == len(table)  # plain verify changes nothing

    repaired = run_json("verify", cache, "--repair")  # exit 0: repaired, and now clean
    assert repaired["namespaces"][0]["repaired"] == 1 and repaired["clean"]
    assert run_json("verify", cache)["corrupt_blocks"] == 0
    assert run_json("ls", cache, "--hash", bad_hash.hex())["namespaces"][0]["matching"] == 0
    # The next engine neither serves the block nor loses any other.
    with engine(cache) as driver:
        assert driver.manager.lookup([bad_hash]) == 0
        assert len(driver.manager.tier("disk")) == len(table) - 1


def test_verify_reports_a_truncated_slab_as_unreadable(cache):
    ns = only_namespace(cache)
    table = read_entries(ns)
    top = int(table.slot.max())
    os.truncate(ns.slab_path(0), top * ns.manifest.slot_size)  # the last block's bytes are gone
    assert any(
        "shorter than its entries need" in p for p in run_json("summary", cache)["namespaces"][0]["health"]["problems"]
    )
    data = run_json("verify", cache, code=1)
    reasons = {c["slot"]: c["reason"] for c in data["namespaces"][0]["corrupt"]}
    assert top in reasons and reasons[top].startswith("unreadable")


# ---------------------------------------------------------------- evict / clear


def test_evict_to_size_drops_least_recently_used_blocks(cache):
    ns = only_namespace(cache)
    before = read_entries(ns)
    slot = ns.manifest.slot_size
    target = (len(before) // 2) * slot
    data = run_json("evict", cache, "--to-size", f"{target}B")
    after = read_entries(ns)
    assert data["evicted"] == len(before) - len(after) == len(before) - len(before) // 2
    assert len(after) * slot <= target
    gone = np.isin(before.last_access, after.last_access, invert=True)
    assert before.last_access[gone].max() <= after.last_access.min()  # LRU order
    (row,) = data["namespaces"]
    assert row["namespace"] == ns.path.name and row["used_after"] == len(after) * slot
    # The next engine sees the freed slots as free.
    with DiskOffloadingManager(cache, ns.fingerprint, device_cache().layout, disk_bytes=4 << 20) as m:
        assert len(m) == len(after) and m.num_free_slots() == ns.manifest.num_slots - len(after)


def test_evict_older_than(cache):
    ns = only_namespace(cache)
    before = read_entries(ns)
    assert run_json("evict", cache, "--older-than", "1d")["evicted"] == 0
    cut = float(np.median(before.last_access))
    result = evict(open_cache(cache), older_than=0, now=cut)
    after = read_entries(ns)
    assert result.evicted == int((before.last_access < cut).sum()) > 0
    assert len(after) == len(before) - result.evicted and after.last_access.min() >= cut
    assert "evicted" in run("evict", cache, "--older-than", "2w").stdout


def test_clear_removes_the_namespace(cache):
    ns = only_namespace(cache)
    assert "pass --yes" in run("clear", cache, code=2).stderr  # no terminal to confirm on
    data = run_json("clear", cache, "--yes")
    assert data["removed"] == [ns.path.name] and data["freed_bytes"] >= 4 << 20
    assert not ns.path.exists() and list(cache.iterdir()) == []
    assert run_json("summary", cache)["namespaces"] == []
    # The cache directory is usable again: an engine starts an empty namespace.
    with engine(cache) as driver:
        assert len(driver.manager.tier("disk")) == 0


# ---------------------------------------------------------------- an engine holds the cache

_ENGINE = textwrap.dedent("""
    import time, torch
    from tiered_kv.sim.driver import DeviceKVCache, EngineDriver
    from tiered_kv.tiered.spec import HierarchySpec
    spec = HierarchySpec({config!r}, gpu_block_size={block})
    dev = DeviceKVCache(num_layers=2, num_gpu_blocks=64, gpu_block_size={block}, num_kv_heads=2, head_dim=32,
                        dtype=torch.float16, kv_before_num_blocks=True, device="cpu")
    driver = EngineDriver.from_spec(spec, dev)
    print("ready", flush=True)
    time.sleep(120)
""")


def test_an_open_engine_allows_reads_and_refuses_changes(cache):
    script = _ENGINE.format(config={**CONFIG, "disk_path": str(cache)}, block=GPU_BLOCK)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        n = len(read_entries(only_namespace(cache)))
        s = run_json("summary", cache)["namespaces"][0]
        assert s["engine"]["pid"] == proc.pid and s["engine"]["host"] == socket.gethostname()
        assert s["blocks"] == n
        assert f"pid {proc.pid}" in run("summary", cache).stdout
        assert run_json("ls", cache)["namespaces"][0]["total"] == n
        assert run_json("verify", cache)["corrupt_blocks"] == 0
        for args in (("evict", cache, "--to-size", "1MiB"), ("clear", cache, "--yes"), ("verify", cache, "--repair")):
            err = run(*args, code=2).stderr
            assert err.startswith("error: refusing to") and f"pid {proc.pid} on host {socket.gethostname()}" in err
            assert len(err.strip().splitlines()) == 1
        assert len(read_entries(only_namespace(cache))) == n  # nothing changed
    finally:
        proc.kill()
        proc.wait()
    # Once the engine is gone (even by kill -9) the lock is free again.
    assert run_json("evict", cache, "--to-size", "0")["namespaces"]


# ---------------------------------------------------------------- bench


def test_bench_measures_tier_and_raw_and_leaves_nothing_behind(cache):
    before = sorted(p.name for p in cache.iterdir())
    data = run_json("bench", cache, "--size", "8MiB", "--block-size", "1MiB", "--rounds", "2", "--threads", "2")
    for kind in ("raw_write", "tier_write", "raw_read", "tier_read"):
        assert len(data["gbps"][kind]) == 2 and all(v > 0 for v in data["gbps"][kind])
    assert data["write_ratio"] > 0 and data["read_ratio"] > 0
    assert data["total_bytes"] == 8 << 20 and data["backend"]["name"] in ("posix", "kvikio")
    assert sorted(p.name for p in cache.iterdir()) == before
    assert run_json("verify", cache)["corrupt_blocks"] == 0
    text = run("bench", cache, "--size", "4MiB", "--block-size", "1MiB", "--rounds", "1").stdout
    assert "tier write" in text and "tier / raw" in text
    assert "multiple of 4096" in run("bench", cache, "--block-size", "1000B", code=2).stderr


# ---------------------------------------------------------------- empty and non-caches


def test_an_empty_directory_is_an_empty_cache(tmp_path):
    assert run_json("summary", tmp_path)["namespaces"] == []
    assert "empty cache" in run("summary", tmp_path).stdout
    assert run_json("ls", tmp_path)["namespaces"] == []
    assert run_json("verify", tmp_path)["corrupt_blocks"] == 0
    assert run_json("evict", tmp_path, "--to-size", "1GiB")["evicted"] == 0
    assert run_json("clear", tmp_path, "--yes")["removed"] == []


@pytest.mark.parametrize("command", ["summary", "ls", "verify", "clear"])
def test_paths_that_are_not_caches_give_one_line_errors(tmp_path, command):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "sub").mkdir()
    bad_manifest = tmp_path / "ns" / "abc"
    bad_manifest.mkdir(parents=True)
    (bad_manifest / "manifest.json").write_text("{not json")
    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path / "notes.txt": "is a file",
        tmp_path: "is not a tiered-kv disk cache",
    }
    for path, words in cases.items():
        for extra in ((), ("--json",)):
            result = runner.invoke(app, ["inspect", command, str(path), *extra])
            assert result.exit_code == 2 and "Traceback" not in result.output
            assert result.stderr.startswith("error: ") and words in result.stderr
            assert len(result.stderr.strip().splitlines()) == 1
            if extra:
                assert words in json.loads(result.stdout)["error"]
    # A directory whose only namespace is unreadable is reported, not crashed on.
    if command == "summary":
        data = run_json("summary", tmp_path / "ns")
        assert data["namespaces"] == [] and "cannot read" in data["problems"][0]


def test_bad_options_give_one_line_errors(cache):
    for args, words in (
        (("ls", cache, "--sort", "size"), "--sort"),
        (("ls", cache, "--hash", "xyz"), "hexadecimal"),
        (("ls", cache, "--older-than", "soon"), "cannot parse age"),
        (("evict", cache), "--to-size SIZE or --older-than AGE"),
        (("evict", cache, "--to-size", "lots"), "cannot parse size"),
        (("summary", cache, "-n", "zzz"), "no namespace matching 'zzz'"),
    ):
        err = run(*args, code=2).stderr
        assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- a million entries


def test_summary_and_ls_handle_a_million_entries(tmp_path):
    """Correct answers at scale; how long they take is for a benchmark, not an assert."""
    layout = fx.small_layout()
    n = 1_000_000
    ns = Namespace.open(tmp_path, fx.fingerprint(layout), layout, num_slots=n)
    with open(ns.slab_path(0), "wb") as f:
        f.truncate(n * ns.manifest.slot_size)  # sparse: only the sizes are checked
    index = DiskIndex(ns.index_path, 1, expected_entries=n)
    hashes = fx.fill_index(index, n, layout.bytes_per_block)
    index.close()
    s = run_json("summary", tmp_path)["namespaces"][0]
    assert s["blocks"] == len(hashes) and s["health"]["status"] == "ok"
    lst = run_json("ls", tmp_path, "--sort", "last-access", "--limit", 20, "--hash", hashes[0].hex()[:2])
    entries = lst["namespaces"][0]["entries"]
    assert len(entries) == 20 and all(e["hash"].startswith(hashes[0].hex()[:2]) for e in entries)
    assert lst["namespaces"][0]["matching"] == sum(h[0] == hashes[0][0] for h in hashes)
