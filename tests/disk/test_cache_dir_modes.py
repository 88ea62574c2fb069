"""KV at rest is its owner's: every directory of a disk cache is 0700 and every file
0600 under the usual umask 022, for everything an engine and the inspector make (slabs,
index, lock, manifest, a damaged index moved aside and its replacement), and an engine
tightens an older cache's looser modes. Shared memory regions and vLLM's slot-health
file are 0600 in a 0700 directory. The engine runs in a child process that sets umask
022 itself, so the test process's own umask does not matter."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from support import cache_dir_checks as cd

TESTS = Path(__file__).resolve().parents[1]

_ENGINE = """
import os, sys
os.umask(0o022)
sys.path[:0] = {paths!r}
from support import cache_dir_checks as cd
cd.quiet()
from tiered_kv.testing.harness import Hierarchy
for disk_io in {disk_io!r}:
    h = Hierarchy({cache!r}, cpu_blocks=8, disk_blocks=32, disk_io=disk_io)
    for doc in cd.DOCS:
        h.run([doc])
        h.settle()
    h.close()
print(cd.inspect("verify", {cache!r}, "--repair")[0])
"""


def modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and everything under it (not following links)."""
    out = {".": stat.S_IMODE(os.lstat(root).st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def loose(found: dict[str, int], root: Path) -> list[str]:
    bad = []
    for rel, mode in found.items():
        want = 0o700 if (root / rel).is_dir() else 0o600
        if mode != want:
            bad.append(f"{rel}: {mode:o} (want {want:o})")
    return bad


def run_engine(cache: Path, disk_io: tuple[str, ...] = ("thread",)) -> None:
    """An engine on ``cache`` under umask 022 in a child, once per mode in ``disk_io``
    (``process``: the disk I/O process makes the files), then ``verify --repair``."""
    code = _ENGINE.format(paths=[str(TESTS), *sys.path], cache=str(cache), disk_io=disk_io)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split()[-1] == "0", run.stdout + run.stderr


@pytest.mark.timeout(600)
def test_everything_an_engine_and_the_inspector_make_is_owner_only_under_umask_022(tmp_path):
    (tmp_path / "made").mkdir()
    cache = tmp_path / "made" / "the-engine"
    run_engine(cache, ("process", "thread"))
    found = modes(cache)
    ns = [p for p in found if p.count("/") == 0 and p != "."]
    assert ns and {
        "lock",
        "manifest.json",
        "rank0.slab",
        "index.lmdb",
        "index.lmdb/data.mdb",
        "index.lmdb/lock.mdb",
    } <= {p.split("/", 1)[1] for p in found if "/" in p}
    assert loose(found, cache) == [], "loose modes"
    # The directory made for disk_path itself is the engine's too.
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700

    # A damaged index is moved aside and replaced: both stay owner-only.
    cd.damage_index(next(cache.glob("*/index.lmdb/data.mdb")))
    run_engine(cache)
    found = modes(cache)
    assert any(p.endswith("index.lmdb.corrupt") for p in found), "the damaged index was not moved aside"
    assert loose(found, cache) == []


def test_an_engine_tightens_an_older_cache(tmp_path):
    cache = tmp_path / "cache"
    run_engine(cache)
    for p in cache.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    run_engine(cache)
    # disk_path itself is the operator's (it may be shared); everything in it is tightened.
    assert [m for m in loose(modes(cache), cache) if not m.startswith(".:")] == []


def test_shared_memory_and_the_slot_health_file_are_owner_only(tmp_path):
    from tiered_kv.integrations.vllm.health import SlotHealth, private_dir
    from tiered_kv.memory.shared_memory import empty_shared, locate

    old = os.umask(0o022)
    try:
        t = empty_shared(1 << 16)
        region, _ = locate(t.data_ptr(), 1)
        assert stat.S_IMODE(os.fstat(region.fd).st_mode) == 0o600
        h = SlotHealth.for_engine(f"modes-test-{os.getpid()}", 16)
        try:
            assert h.path.parent == private_dir(f"modes-test-{os.getpid()}")
            assert stat.S_IMODE(os.stat(h.path).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(h.path.parent).st_mode) == 0o700
            assert os.stat(h.path.parent).st_uid == os.geteuid()
            # A second process of the engine joins the same file.
            again = SlotHealth.for_engine(f"modes-test-{os.getpid()}", 16)
            h.mark_bad([3])
            assert again.take_bad([3, 4]) == {3}
            again.close()
        finally:
            h.close(unlink=True)
    finally:
        os.umask(old)


def test_load_timings_reach_the_scheduler_from_worker_processes_per_rank():
    """Two worker processes (ranks 0 and 1) add transfers to the engine's load timings;
    the scheduler's reader gets each rank's average new job once (failed ones apart), only the shared types,
    and the file is the user's own (0600)."""
    import multiprocessing

    from tiered_kv.integrations.vllm.health import LoadTimings

    engine = f"timings-test-{os.getpid()}"
    reader = LoadTimings.for_engine(engine, ["disk"], ranks=2)
    try:
        reader.clear()
        assert stat.S_IMODE(os.stat(reader.path).st_mode) == 0o600
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_record_timings, args=(engine, rank)) for rank in (0, 1)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0
        got = sorted(reader.take())
        assert got == sorted(
            [("disk_to_cpu", 3000.0, 0.5, True), ("disk_to_cpu", 6000.0, 1.0, True), ("cpu_to_gpu", 100.0, 0.25, True)]
            + [("cpu_to_gpu", 200.0, 0.5, True)]
            # Failed jobs apart, so the decision charges what they cost.
            + [("cpu_to_gpu", 5.0, 1.0, False), ("cpu_to_gpu", 5.0, 1.0, False)]
        )
        assert reader.take() == []  # nothing new
        forged = LoadTimings.for_engine(engine, ["disk"], ranks=2, rank=0)
        forged.record("disk_to_cpu", float("inf"), 1.0)  # a same-user writer's garbage
        forged.record("cpu_to_gpu", 10, float("nan"))
        forged.close()
        assert reader.take() == []
    finally:
        reader.close(unlink=True)


def _record_timings(engine: str, rank: int) -> None:
    from tiered_kv.integrations.vllm.health import LoadTimings

    w = LoadTimings.for_engine(engine, ["disk"], ranks=2, rank=rank)
    scale = rank + 1
    w.record("disk_to_cpu", 2000 * scale, 0.4 * scale)
    w.record("disk_to_cpu", 4000 * scale, 0.6 * scale)
    w.record("cpu_to_gpu", 100 * scale, 0.25 * scale)
    w.record("cpu_to_gpu", 5, 1.0, success=False)  # a failed job: its own totals
    w.record("gpu_to_cpu", 999, 1.0)  # a store: not a load cost
    w.close()
