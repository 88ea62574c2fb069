"""The inspector on caches left by a writer killed with SIGKILL mid-run (TP=2): a child
killed between its ranks' commits, and the disk-crash workload killed at random moments.
A crash never leaves a corrupt committed copy; incomplete entries are reported and
``verify --repair`` drops them; an engine then opens a clean cache."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from support import disk_fixtures as fx
from test_disk_crash import wait_ready
from tiered_kv.cli import _load_commands, app
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager

_load_commands()
runner = CliRunner()

_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from support import disk_fixtures as fx
    from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
    from tiered_kv.disk.store.store import DiskStore
    layout = fx.crash_layout()
    fp = fx.fingerprint(layout, tp_size=2)
    nbytes = fx.disk_bytes_for(layout, fx.CRASH_SLOTS)
    mgr = DiskOffloadingManager({cache!r}, fp, layout, disk_bytes=nbytes, engine_id="writer")
    store = DiskStore.open({cache!r}, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="writer")

    def write(hashes, ranks):
        out = mgr.prepare_store(hashes)
        slots = out.store_spec.block_ids
        for r in ranks:
            assert all(store.write_blocks(r, hashes, slots, fx.content_rows(hashes, r, layout, store.slot_size)))
        return out

    done = [fx.block_hash(f"done-{{i}}") for i in range(6)]
    write(done, [0, 1])
    mgr.complete_store(done)
    write([fx.block_hash(f"half-{{i}}") for i in range(3)], [0])  # rank 1 never writes these
    print("ready", flush=True)
    time.sleep(600)
""")


def inspect_json(*args, code: int = 0) -> dict:
    result = runner.invoke(app, ["inspect", *map(str, args), "--json"])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


@pytest.mark.faults
def test_a_writer_killed_between_ranks_leaves_incomplete_entries_that_repair_drops(tmp_path):
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER.format(tests=str(Path(__file__).resolve().parents[1]), cache=str(cache))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    half = {fx.block_hash(f"half-{i}").hex() for i in range(3)}

    s = inspect_json("summary", cache)["namespaces"][0]
    assert s["engine"] is None  # the kernel dropped the dead writer's lock
    assert (s["blocks"], s["incomplete_entries"]) == (6, 3)
    assert s["fingerprint"]["tp_size"] == 2 and s["used_bytes"] == 6 * 2 * s["slot_bytes"]
    assert s["health"]["status"] == "warning" and "3 incomplete entries" in s["health"]["problems"][0]

    listed = inspect_json("ls", cache, "--state", "incomplete")["namespaces"][0]["entries"]
    assert {e["hash"] for e in listed} == half
    assert all(e["ranks"] == [0] and not e["complete"] for e in listed)
    table = runner.invoke(app, ["inspect", "ls", str(cache), "--state", "incomplete"]).stdout
    assert table.count("1/2") == 3

    v = inspect_json("verify", cache)["namespaces"][0]
    assert v["corrupt"] == [] and v["blocks"] == 6
    assert v["copies_checked"] == 6 * 2 + 3  # every committed copy, of partial entries too
    assert {e["hash"] for e in v["incomplete"]} == half

    # A damaged copy on rank 1 is found and named by rank.
    ns_dir = Path(s["path"])
    victim = next(e for e in inspect_json("ls", cache, "--state", "complete")["namespaces"][0]["entries"])
    fx.flip_byte(ns_dir / "rank1.slab", victim["slot"] * s["slot_bytes"] + 77)
    bad = inspect_json("verify", cache, code=1)["namespaces"][0]["corrupt"]
    assert [(c["hash"], c["rank"]) for c in bad] == [(victim["hash"], 1)]

    fixed = inspect_json("verify", cache, "--repair")["namespaces"][0]  # exit 0: repaired and clean
    assert fixed["repaired"] == 3 + 1
    clean = inspect_json("verify", cache)["namespaces"][0]
    assert (clean["corrupt"], clean["incomplete"], clean["blocks"]) == ([], [], 5)
    assert inspect_json("summary", cache)["namespaces"][0]["health"] == {"status": "ok", "problems": []}
    layout = fx.crash_layout()
    with DiskOffloadingManager(
        cache, fx.fingerprint(layout, tp_size=2), layout, disk_bytes=fx.disk_bytes_for(layout, fx.CRASH_SLOTS)
    ) as m:
        assert len(m) == 5 and m.stats.reclaimed_at_open == 0


@pytest.fixture(scope="module")
def ctx():
    return fx.forkserver_context()


@pytest.mark.faults
def test_random_sigkills_never_leave_a_corrupt_committed_copy(tmp_path, ctx):
    cache, journal = str(tmp_path / "cache"), str(tmp_path / "journal")
    open(journal, "w").close()
    rng = random.Random(7)
    for trial in range(3):
        proc = ctx.Process(target=fx.crash_workload, args=(cache, journal, 100 + trial))
        proc.start()
        wait_ready(journal, proc)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        v = inspect_json("verify", cache)["namespaces"][0]
        assert v["corrupt"] == [] and v["copies_checked"] >= 2 * v["blocks"] > 0
        repaired = inspect_json("verify", cache, "--repair")["namespaces"][0]
        assert repaired["repaired"] == len(v["incomplete"])
        s = inspect_json("summary", cache)["namespaces"][0]
        assert s["incomplete_entries"] == 0 and s["health"]["status"] == "ok"


@pytest.mark.faults
def test_verify_beside_a_busy_writer_reports_no_false_corruption(tmp_path, ctx):
    """Blocks evicted or rewritten while verify reads them are counted as changed, never
    as corrupt (the read-only inspector runs beside a live engine)."""
    cache, journal = str(tmp_path / "cache"), str(tmp_path / "journal")
    open(journal, "w").close()
    proc = ctx.Process(target=fx.crash_workload, args=(cache, journal, 7))
    proc.start()
    try:
        wait_ready(journal, proc)
        checked = 0
        for _ in range(6):
            v = inspect_json("verify", cache)["namespaces"][0]
            assert v["corrupt"] == [], v["corrupt"]
            checked += v["copies_checked"]
            s = inspect_json("summary", cache)["namespaces"][0]
            assert s["engine"]["pid"] == proc.pid
        assert checked > 0 and proc.is_alive()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
