"""Another local user cannot keep an engine from starting by taking the name of its
slot-health directory (``integrations/vllm/health.py``, ``private_dir``).

The tests run as root and play the other user by planting entries and giving them to
``OTHER_UID``. Most stand a temporary directory in for ``/dev/shm`` and ``/tmp`` (the
module's ``_shared_bases``) and for the home directory's cache (``_home_base``); the
last ones squat the real ``/dev/shm`` (names of a configured engine id made for the
test, removed after it), across processes and through vLLM's real scheduler and
worker connector.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_kv.integrations.vllm import health as hm
from tiered_kv.integrations.vllm.health import LoadTimings, SlotHealth, private_dir

OTHER_UID = 65534
UID = os.geteuid()
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}

pytestmark = pytest.mark.skipif(UID != 0, reason="plays another user with chown: needs root")


def _name(engine_id: str) -> str:
    return f"tiered-kv-{UID}-{hashlib.sha256(engine_id.encode()).hexdigest()[:32]}"


@pytest.fixture
def bases(tmp_path, monkeypatch):
    """(shm, tmp, home cache base) standing in for /dev/shm, /tmp and ~/.cache/tiered-kv."""
    shm, tmp, home = tmp_path / "shm", tmp_path / "tmp", tmp_path / "home"
    for d in (shm, tmp):
        d.mkdir()
        os.chmod(d, 0o1777)
    home.mkdir(mode=0o700)
    monkeypatch.setattr(hm, "_shared_bases", lambda: [shm, tmp])
    monkeypatch.setattr(hm, "_home_base", lambda: home / ".cache" / "tiered-kv")
    monkeypatch.setattr(hm, "_SETTLE_S", 0.0)
    return shm, tmp, home / ".cache" / "tiered-kv"


def _snapshot(path: Path) -> tuple:
    """Everything about the entry at ``path`` (not followed) and, for a directory or a
    link to one, what is in it: a squatted entry must come out the same."""
    st = os.lstat(path)
    inside: list[str] = []
    if os.path.isdir(path):
        inside = sorted(os.listdir(path))
    elif stat.S_ISREG(st.st_mode):
        inside = [path.read_bytes().hex()]
    return (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_mtime_ns, st.st_ino, inside)


def _plant(kind: str, at: Path, elsewhere: Path) -> None:
    """One squatted entry at ``at``, as another local user (or a lapse) leaves it."""
    if kind == "dir-0777":  # mkdir -m 0777, by another user
        at.mkdir()
        os.chmod(at, 0o777)
        os.chown(at, OTHER_UID, OTHER_UID)
    elif kind == "dir-of-another-user":
        at.mkdir(mode=0o700)
        os.chown(at, OTHER_UID, OTHER_UID)
    elif kind == "dir-of-ours-0755":
        at.mkdir()
        os.chmod(at, 0o755)
    elif kind == "link-to-a-dir":  # to a directory the squatter can read
        elsewhere.mkdir(mode=0o700)
        (elsewhere / "marker").write_bytes(b"theirs")
        os.symlink(elsewhere, at)
        os.chown(at, OTHER_UID, OTHER_UID, follow_symlinks=False)
    elif kind == "dangling-link":
        os.symlink(elsewhere, at)
    elif kind == "file":
        at.write_bytes(b"x" * 64)
        os.chmod(at, 0o666)
        os.chown(at, OTHER_UID, OTHER_UID)
    elif kind == "fifo":
        os.mkfifo(at)
        os.chmod(at, 0o666)
        os.chown(at, OTHER_UID, OTHER_UID)
    else:
        raise AssertionError(kind)


KINDS = ["dir-0777", "dir-of-another-user", "dir-of-ours-0755", "link-to-a-dir", "dangling-link", "file", "fifo"]
SAYS = {
    "dir-0777": f"a directory owned by uid {OTHER_UID} (mode 777)",
    "dir-of-another-user": f"a directory owned by uid {OTHER_UID} (mode 700)",
    "dir-of-ours-0755": f"a directory owned by uid {UID} (mode 755)",
    "link-to-a-dir": "a symbolic link to the directory",
    "dangling-link": "a dangling symbolic link",
    "file": f"a regular file owned by uid {OTHER_UID} (mode 666)",
    "fifo": f"a FIFO owned by uid {OTHER_UID} (mode 666)",
}


def _shares_bytes(engine_id: str, num_slots: int = 16) -> Path:
    """Two processes' views of the engine's slot health (and a worker's and the
    scheduler's load timings) are one: a mark made through one is seen through the
    other. The directory they are in, after the scheduler's shutdown removed it."""
    scheduler = SlotHealth.for_engine(engine_id, num_slots)
    worker = SlotHealth.for_engine(engine_id, num_slots)
    reader = LoadTimings.for_engine(engine_id, ["disk"], ranks=1)
    writer = LoadTimings.for_engine(engine_id, ["disk"], ranks=1, rank=0)
    where = scheduler.path.parent
    try:
        assert worker.path == scheduler.path and reader.path.parent == where
        assert stat.S_IMODE(os.lstat(where).st_mode) == 0o700 and os.lstat(where).st_uid == UID
        assert stat.S_ISDIR(os.lstat(where).st_mode)
        assert stat.S_IMODE(os.lstat(scheduler.path).st_mode) == 0o600
        worker.mark_bad([3, 7])
        assert scheduler.take_bad(range(num_slots)) == {3, 7}
        writer.record("disk_to_cpu", 4096, 0.5)
        assert reader.take() == [("disk_to_cpu", 4096.0, 0.5, True)]
    finally:
        worker.close()
        writer.close()
        scheduler.close(unlink=True)
        reader.close(unlink=True)
    assert not where.exists(), "the scheduler's shutdown leaves the engine's directory behind"
    return where


def test_an_engine_unsquatted_keeps_its_files_in_its_own_directory_in_dev_shm(bases):
    shm, _, _ = bases
    engine = "plain-engine"
    assert private_dir(engine) == shm / _name(engine)
    assert _shares_bytes(engine) == shm / _name(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_a_squatted_name_is_left_alone_and_the_engine_starts_past_it(kind, bases, tmp_path, caplog):
    """Each kind of planted entry at the engine's name: never opened, followed or
    written; a warning names it, its owner and mode; the engine's processes share the
    next candidate."""
    shm, _, _ = bases
    engine = f"configured-{kind}"
    squat = shm / _name(engine)
    _plant(kind, squat, tmp_path / "elsewhere")
    before = _snapshot(squat)
    before_elsewhere = _snapshot(tmp_path / "elsewhere") if (tmp_path / "elsewhere").exists() else None
    with caplog.at_level(logging.WARNING, logger=hm.__name__):
        where = _shares_bytes(engine)
    assert where == shm / f"{_name(engine)}-1"
    assert _snapshot(squat) == before
    if before_elsewhere is not None:
        assert _snapshot(tmp_path / "elsewhere") == before_elsewhere
        assert sorted(os.listdir(tmp_path / "elsewhere")) == ["marker"]
    if kind == "dangling-link":
        assert not (tmp_path / "elsewhere").exists()
    said = [r.getMessage() for r in caplog.records if str(squat) in r.getMessage()]
    assert said and SAYS[kind] in said[0] and "another local user" in said[0], said
    assert str(shm / f"{_name(engine)}-1") in said[0]


def test_every_shared_candidate_squatted_leaves_the_files_in_the_home_directory(bases, caplog):
    """A squatter takes every name of the engine in /dev/shm and /tmp: the engine uses
    ~/.cache/tiered-kv, made 0700 level by level."""
    shm, tmp, home_base = bases
    engine = "configured-everywhere"
    for base in (shm, tmp):
        for n in range(hm.CANDIDATES_PER_BASE):
            suffix = "" if n == 0 else f"-{n}"
            _plant("dir-0777", base / f"{_name(engine)}{suffix}", base / "unused")
    with caplog.at_level(logging.WARNING, logger=hm.__name__):
        where = _shares_bytes(engine)
    assert where == home_base / _name(engine)
    for level in (home_base.parent, home_base):
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700 and os.lstat(level).st_uid == UID
    assert len([r for r in caplog.records if "another local user" in r.getMessage()]) == 2 * hm.CANDIDATES_PER_BASE


def test_a_squat_removed_after_one_process_chose_does_not_split_the_engine(bases):
    """The squatter removes their entry between two processes' starts: the second
    process takes the first candidate that is already this user's, not the freed name."""
    shm, _, _ = bases
    engine = "configured-toggled"
    squat = shm / _name(engine)
    _plant("dir-0777", squat, shm / "unused")
    first = SlotHealth.for_engine(engine, 8)
    try:
        assert first.path.parent == shm / f"{_name(engine)}-1"
        squat.rmdir()
        second = SlotHealth.for_engine(engine, 8)
        assert second.path == first.path and not squat.exists()
        second.mark_bad([5])
        assert first.take_bad([5]) == {5}
        second.close()
    finally:
        first.close(unlink=True)


@pytest.mark.parametrize("lapse", ["world-writable, not sticky", "another user's"])
def test_a_base_directory_others_could_rearrange_is_not_used(lapse, bases, caplog):
    """Where another user could rename or remove this user's entries (a base writable by
    others without the sticky bit, or owned by another user), no name is tried."""
    shm, tmp, _ = bases
    if lapse == "another user's":
        os.chown(shm, OTHER_UID, OTHER_UID)
        os.chmod(shm, 0o755)
    else:
        os.chmod(shm, 0o777)
    engine = f"loose-base-{lapse}"
    with caplog.at_level(logging.WARNING, logger=hm.__name__):
        where = _shares_bytes(engine)
    assert where == tmp / _name(engine)
    assert os.listdir(shm) == []
    assert any(str(shm) in r.getMessage() and "others could replace" in r.getMessage() for r in caplog.records)


def test_nothing_left_to_use_is_a_clear_error(bases, monkeypatch):
    """Every candidate squatted and no home directory: the error names each entry."""
    shm, tmp, _ = bases
    monkeypatch.setattr(hm, "_home_base", lambda: None)
    engine = "configured-nowhere"
    for base in (shm, tmp):
        for n in range(hm.CANDIDATES_PER_BASE):
            _plant("file", base / (_name(engine) + ("" if n == 0 else f"-{n}")), base / "unused")
    with pytest.raises(
        RuntimeError, match=re.escape(f"{shm / _name(engine)} is a regular file owned by uid {OTHER_UID}")
    ) as e:
        SlotHealth.for_engine(engine, 8)
    assert "home directory" in str(e.value)


# -- the real /dev/shm ---------------------------------------------------------------


@pytest.fixture
def real_squat(request):
    """Squat /dev/shm for a configured engine id made for this test: the name the old
    layout used for every engine of this user (``tiered-kv-<uid>``, if free) and this
    engine's first candidate, both directories of another user with mode 0777;
    removed afterwards, with whatever the engine left."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    engine = f"squat-test-{os.getpid()}-{request.node.name}"
    planted = [p for p in (shm / f"tiered-kv-{UID}", shm / _name(engine)) if not os.path.lexists(p)]
    for p in planted:
        _plant("dir-0777", p, shm / "unused")
    try:
        yield engine, planted
    finally:
        for n in range(hm.CANDIDATES_PER_BASE):
            p = shm / (_name(engine) + ("" if n == 0 else f"-{n}"))
            if p not in planted and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
        for p in planted:
            p.rmdir()


_CHILD = """
import sys
sys.path[:0] = {paths!r}
from tiered_kv.integrations.vllm.health import SlotHealth
h = SlotHealth.for_engine({engine!r}, 16)
h.mark_bad([2, 9])
print(h.path)
h.close()
"""


def test_another_users_dev_shm_squat_leaves_the_processes_of_an_engine_sharing_one_file(real_squat):
    """In the real /dev/shm: a worker process started separately marks slots, and the
    scheduler (this process) sees them through the same file, past the squat."""
    engine, planted = real_squat
    scheduler = SlotHealth.for_engine(engine, 16)
    try:
        assert scheduler.path.parent == Path("/dev/shm") / f"{_name(engine)}-1"
        code = _CHILD.format(paths=sys.path, engine=engine)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == str(scheduler.path)
        assert scheduler.take_bad(range(16)) == {2, 9}
        for p in planted:
            assert os.lstat(p).st_uid == OTHER_UID and os.listdir(p) == []
    finally:
        scheduler.close(unlink=True)
    assert not scheduler.path.parent.exists()


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_another_users_dev_shm_squat_leaves_a_vllm_engine_starting_and_serving(real_squat, tmp_path):
    """vLLM's real scheduler and worker connector with our spec and a configured engine
    id whose names in /dev/shm are squatted: the engine starts, stores and loads."""
    from support import vllm_harness as vh

    engine, planted = real_squat
    model_dir = vh.write_model_config(tmp_path / "model")
    extra = {**SPEC, "cpu_bytes": "256KiB", "block_size": 16}
    with vh.VllmHarness.build(model_dir, extra, num_gpu_blocks=64, worker="real", engine_id=engine) as h:
        prompt = [100 + (i * 31) % 800 for i in range(2 * 16 + 3)]
        assert h.serve(prompt).external == 0
        h.reset_gpu_prefix_cache()
        assert h.serve(prompt).external == 2 * 16
        where = Path("/dev/shm") / f"{_name(engine)}-1"
        assert sorted(os.listdir(where)) == ["cpu-slot-health", "load-timings"]
    assert not where.exists()
    for p in planted:
        assert os.lstat(p).st_uid == OTHER_UID and os.listdir(p) == []
