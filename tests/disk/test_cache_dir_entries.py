"""Entries planted in a disk cache: links, FIFOs and another user's files.

Whoever can write to a cache directory could replace a slab, the index, the lock or
the manifest with a symbolic link (to a file outside, dangling, or to a directory), a
FIFO, or a file of their own. For each such entry and each kind, an engine started on
the cache and every inspector command must stop with one clear error naming the path
and what it is, write nothing outside the cache, never hang, and print no traceback.
The cases run in a child process under a timeout (a hang fails the test, naming the
case), on copies of one real cache. Runs as root (the tests chown a file to uid 65534
to plant another user's); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from support import cache_dir_checks as cd

pytestmark = [
    pytest.mark.faults,
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root"),
]

TESTS = Path(__file__).resolve().parents[1]
CASE_TIMEOUT = 420


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("template") / "cache"
    cd.build_cache(cache)
    return cache


def run_cases(template: Path, work: Path, cases: list[tuple[str, str]]) -> list[dict]:
    """Run ``cases`` in a child process; fail naming the case that was running if it
    does not finish in time."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "support" / "cache_dir_checks.py"), str(template), str(work), json.dumps(cases)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=CASE_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        started = [json.loads(line)["start"] for line in out.splitlines() if '"start"' in line]
        pytest.fail(f"hung on case {started[-1] if started else '?'} (no result within {CASE_TIMEOUT} s)")
    assert proc.returncode == 0, f"the case runner failed:\n{err[-3000:]}"
    return [json.loads(line) for line in out.splitlines() if '"start"' not in line]


def check(result: dict) -> None:
    where = f"{result['entry']} as {result['kind']}"
    planted, says = result["planted"], cd.SAYS[result["kind"]]
    assert not result["outside_changed"], f"{where}: a file outside the cache was changed"
    assert not result["created_outside"], f"{where}: a file was created outside the cache"
    kind, message = result["engine"]
    assert kind == "CacheEntryError", f"{where}: the engine's start was {kind}: {message}"
    assert planted in message and says in message and "Traceback" not in message, f"{where}: {message}"
    for cmd in cd.COMMANDS:
        code, text = result[" ".join(cmd)]
        assert "Traceback" not in text, f"{where}: inspect {' '.join(cmd)} printed a traceback:\n{text}"
        assert code == 2 and "error:" in text, f"{where}: inspect {' '.join(cmd)} exited {code}:\n{text}"
        assert planted in " ".join(text.split()) and says in " ".join(text.split()), (
            f"{where}: inspect {' '.join(cmd)} did not name the entry and what it is:\n{text}"
        )


def test_planted_files_stop_the_engine_and_every_inspector_command(template, tmp_path):
    cases = [(entry, kind) for entry in cd.FILE_ENTRIES for kind in cd.KINDS]
    results = run_cases(template, tmp_path, cases)
    assert [(r["entry"], r["kind"]) for r in results] == cases
    for r in results:
        check(r)


def test_planted_directories_stop_the_engine_and_every_inspector_command(template, tmp_path):
    cases = [(entry, kind) for entry in cd.DIR_ENTRIES for kind in cd.KINDS]
    results = run_cases(template, tmp_path, cases)
    assert [(r["entry"], r["kind"]) for r in results] == cases
    for r in results:
        if (r["entry"], r["kind"]) == (".", "other-user"):
            # A namespace wholly of another user is that user's cache: the engine (a
            # different user) refuses it; the inspector reads it as its owner's, as an
            # administrator inspecting a service's cache would.
            kind, message = r["engine"]
            assert kind == "CacheEntryError" and f"uid {cd.OTHER_UID}" in message, message
            assert not r["outside_changed"]
            for cmd in cd.COMMANDS:
                assert "Traceback" not in r[" ".join(cmd)][1]
            continue
        check(r)


def test_a_healthy_copy_of_the_template_starts_and_serves(template, tmp_path):
    """The control: the same copy without a planted entry is served in full."""
    import shutil

    shutil.copytree(template, tmp_path / "cache")
    assert cd.start_engine(tmp_path / "cache") == ("ok", "")
    served, wrong = cd.blocks_served_right(tmp_path / "cache")
    assert served == 16 and wrong == 0
    assert cd.inspect("verify", str(tmp_path / "cache"))[0] == 0


def test_an_operator_running_the_tools_as_root_leaves_no_entry_of_root_in_a_users_cache(template, tmp_path):
    """The cache is another user's (the engine's); root runs the read-only summary on an
    index whose lock.mdb a backup left out, then repairs a damaged index. Whatever the
    tools make there is that user's: an entry of root's would stop the engine's next
    start (``CacheEntryError``, as above)."""
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(template, cache)
    for p in [cache, *cache.rglob("*")]:
        os.chown(p, cd.OTHER_UID, cd.OTHER_UID, follow_symlinks=False)
    ns_dir = cd.namespace_dirs(cache)[0]

    def roots() -> list[str]:
        return [str(p) for p in [cache, *cache.rglob("*")] if os.lstat(p).st_uid == 0]

    (ns_dir / "index.lmdb" / "lock.mdb").unlink()
    assert cd.inspect("summary", str(cache))[0] == 0
    assert roots() == [], "the read-only summary made an entry of root's"
    cd.damage_index(ns_dir / "index.lmdb" / "data.mdb")
    code, text = cd.inspect("verify", "--repair", str(cache))
    assert code == 0 and "now verifies clean" in text, text
    assert roots() == [], "the repair made entries of root's"


_HEALTH_CASES = """
import json, os, sys
sys.path[:0] = {paths!r}
from tiered_kv.integrations.vllm.health import SlotHealth
out = []
for name in {names!r}:
    try:
        SlotHealth(os.path.join({base!r}, name), 8).close()
        out.append([name, "opened"])
    except Exception as e:
        out.append([name, type(e).__name__ + ": " + str(e)])
print(json.dumps(out))
"""


def test_the_slot_health_file_is_never_adopted_from_someone_else(tmp_path):
    """vLLM's slot-health map in /dev/shm: a planted link, FIFO or another user's file
    is refused (no hang: a child under a timeout), and so is a private directory that
    is not this user's or not 0700."""
    base = tmp_path / "private"
    base.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 100)
    os.symlink(victim, base / "link")
    os.symlink(tmp_path / "nowhere", base / "dangling")
    os.symlink(tmp_path, base / "dirlink")
    os.mkfifo(base / "fifo")
    (base / "theirs").write_bytes(b"\0" * 8)
    os.chown(base / "theirs", cd.OTHER_UID, cd.OTHER_UID)
    (base / "loose").write_bytes(b"\0" * 8)
    os.chmod(base / "loose", 0o644)
    names = ["link", "dangling", "dirlink", "fifo", "theirs", "loose", "fresh"]
    code = _HEALTH_CASES.format(paths=sys.path, names=names, base=str(base))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = dict(json.loads(run.stdout))
    for name, says in (
        ("link", "symbolic link to"),
        ("dangling", "dangling symbolic link"),
        ("dirlink", "symbolic link to the directory"),
        ("fifo", "a FIFO"),
        ("theirs", f"uid {cd.OTHER_UID}"),
        ("loose", "mode 644"),
    ):
        assert got[name].startswith("CacheEntryError") and says in got[name], (name, got[name])
    assert got["fresh"] == "opened"
    assert stat.S_IMODE(os.stat(base / "fresh").st_mode) == 0o600
    assert victim.read_bytes() == b"x" * 100 and not (tmp_path / "nowhere").exists()

    from tiered_kv.integrations.vllm.health import SlotHealth

    loose = tmp_path / "loose-dir"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(RuntimeError, match="mode 755"):
        SlotHealth(loose / "h", 8)
    theirs = tmp_path / "their-dir"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, cd.OTHER_UID, cd.OTHER_UID)
    with pytest.raises(RuntimeError, match=f"uid {cd.OTHER_UID}"):
        SlotHealth(theirs / "h", 8)
    os.symlink(base, tmp_path / "linked-dir")
    with pytest.raises(RuntimeError, match="symbolic link to the directory"):
        SlotHealth(tmp_path / "linked-dir" / "h", 8)
