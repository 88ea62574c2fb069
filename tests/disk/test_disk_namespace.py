"""Disk cache namespaces: fingerprints, manifests, slab preallocation, the writer lock."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from support.disk_fixtures import disk_bytes_for, fingerprint, small_layout
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import (
    CacheLockedError,
    FingerprintMismatchError,
    Namespace,
    NamespaceError,
    WriterLock,
    check_worker_access,
    explain_other_namespaces,
    list_namespaces,
    slot_size_for,
)
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.kv_layout import KVCacheLayout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fingerprint_changes_with_every_field_and_round_trips():
    layout = small_layout()
    base = fingerprint(layout)
    assert Fingerprint.from_dict(base.to_dict()) == base
    variants = [
        fingerprint(layout, model_id="other"),
        fingerprint(layout, model_revision="r2"),
        fingerprint(layout, tp_size=2),
        fingerprint(layout, hash_algorithm="xxhash"),
        fingerprint(layout, hash_seed="1"),
        fingerprint(small_layout(kv_first=False)),
        fingerprint(small_layout(factor=2)),
        fingerprint(small_layout(head_dim=16)),
        fingerprint(small_layout(num_layers=4)),
        fingerprint(KVCacheLayout(small_layout().layers, torch.bfloat16, 4)),
    ]
    ids = {v.namespace_id for v in variants}
    assert base.namespace_id not in ids and len(ids) == len(variants)


def test_fingerprint_rejects_bad_values():
    with pytest.raises(ValueError, match="tp_size"):
        fingerprint(small_layout(), tp_size=0)
    with pytest.raises(ValueError, match="missing fields"):
        Fingerprint.from_dict({"model_id": "x"})


def test_create_writes_manifest_and_preallocates_slabs(tmp_path):
    layout = small_layout()
    fp = fingerprint(layout, tp_size=2)
    ns = Namespace.open(tmp_path, fp, layout, num_slots=10)
    assert ns.path == tmp_path / fp.namespace_id
    m = json.loads((ns.path / "manifest.json").read_text())
    assert m["fingerprint"] == fp.to_dict()
    assert m["slot_size"] == slot_size_for(layout.bytes_per_block) and m["slot_size"] % 4096 == 0
    assert m["num_slots"] == 10 and m["checksum"] == "xxh3_64" and m["format_version"] == 1
    for rank in (0, 1):
        path = ns.allocate_slab(rank)
        st = os.stat(path)
        assert st.st_size == 10 * m["slot_size"]
        assert st.st_blocks * 512 >= st.st_size, "slab must be preallocated, not sparse"
    with pytest.raises(ValueError, match="rank 2"):
        ns.slab_path(2)
    assert [n.path for n in list_namespaces(tmp_path)] == [ns.path]


def test_other_fingerprint_is_never_served_and_names_the_field(tmp_path):
    layout = small_layout()
    a, b = fingerprint(layout), fingerprint(layout, hash_seed="42")
    Namespace.open(tmp_path, a, layout, num_slots=4)
    # Different fingerprints live side by side.
    nb = Namespace.open(tmp_path, b, layout, num_slots=4)
    assert nb.path.name == b.namespace_id != a.namespace_id
    # A namespace directory whose manifest records another fingerprint (copied, renamed or a
    # digest collision) is refused, naming the differing field.
    shutil.rmtree(nb.path)
    shutil.copytree(tmp_path / a.namespace_id, nb.path)
    with pytest.raises(FingerprintMismatchError, match=r"hash_seed: '42' here, '0' in the cache") as ei:
        Namespace.open(tmp_path, b, layout, num_slots=4)
    assert ei.value.fields == ["hash_seed"]
    # ...also through the manager, the way an engine opens it.
    with pytest.raises(FingerprintMismatchError, match="hash_seed"):
        DiskOffloadingManager(tmp_path, b, layout, disk_bytes=disk_bytes_for(layout, 4))
    assert any("hash_seed" in line for line in explain_other_namespaces(tmp_path, fingerprint(layout, hash_seed="7")))


def test_a_cache_in_the_old_block_order_is_never_served(tmp_path):
    """Before ``block_order``, a block of several GPU blocks was stored layer by layer;
    such a cache (a manifest without the field) is refused, naming it. With one GPU
    block per block the order never changed: the record and the namespace id do not
    mention it."""
    assert "block_order" not in fingerprint(small_layout()).to_dict()
    layout = small_layout(factor=2)
    new = fingerprint(layout)
    assert new.block_order == "kernel_blocks"
    ns = Namespace.open(tmp_path, new, layout, num_slots=4)
    manifest = json.loads((ns.path / "manifest.json").read_text())
    del manifest["fingerprint"]["block_order"]
    (ns.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FingerprintMismatchError, match="block_order: 'kernel_blocks' here, None in the cache"):
        Namespace.open(tmp_path, new, layout, num_slots=4)


def test_bad_paths_give_clear_errors(tmp_path):
    layout = small_layout()
    fp = fingerprint(layout)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NamespaceError, match="not a directory"):
        Namespace.open(tmp_path / "file", fp, layout, num_slots=4)
    with pytest.raises(NamespaceError, match="does not exist"):
        Namespace.open(tmp_path / "missing", fp, layout, num_slots=4, create=False)
    ns = Namespace.open(tmp_path / "c", fp, layout, num_slots=4)
    (ns.path / "manifest.json").write_text("{not json")
    with pytest.raises(NamespaceError, match="cannot read"):
        Namespace.open(tmp_path / "c", fp, layout, num_slots=4)
    if os.getuid() != 0:  # root ignores permissions
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(NamespaceError, match="not writable"):
            Namespace.open(ro, fp, layout, num_slots=4)


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir()
    if shutil.which("mount") is None:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


@pytest.mark.faults
def test_preallocation_beyond_free_space_is_a_clear_error(tmp_path):
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "2m"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        layout = small_layout()
        fp = fingerprint(layout)
        with pytest.raises(NamespaceError, match="only .* bytes are free"):
            DiskOffloadingManager(mnt, fp, layout, disk_bytes=64 << 20)
    finally:
        subprocess.run(["umount", str(mnt)])


def _holder_script(cache_dir: str, engine_id: str) -> str:
    return textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.join(REPO, "tests")!r})
        from support.disk_fixtures import small_layout, fingerprint, disk_bytes_for
        from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
        layout = small_layout()
        m = DiskOffloadingManager({cache_dir!r}, fingerprint(layout), layout,
                                  disk_bytes=disk_bytes_for(layout, 8), engine_id={engine_id!r})
        print("ready", flush=True)
        sys.stdin.read()
        m.shutdown()
    """)


@pytest.mark.faults
def test_second_writer_is_refused_naming_the_holder(tmp_path):
    layout = small_layout()
    fp = fingerprint(layout)
    proc = subprocess.Popen(
        [sys.executable, "-c", _holder_script(str(tmp_path), "engine-A")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(CacheLockedError) as ei:
            DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, 8), engine_id="engine-B")
        msg = str(ei.value)
        assert f"pid {proc.pid}" in msg and socket.gethostname() in msg and "engine-A" in msg
        # A worker of another engine is refused too; one of the holder's engine may write.
        with pytest.raises(CacheLockedError, match=f"pid {proc.pid}"):
            DiskStore.open(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, 8), engine_id="engine-B")
        store = DiskStore.open(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, 8), engine_id="engine-A")
        store.close()
        # The inspector's read-only open works while the engine holds the lock.
        ro = DiskStore.open_readonly(tmp_path / fp.namespace_id)
        assert len(ro.snapshot()) == 0
        ro.close()
    finally:
        proc.communicate("", timeout=30)
    # Once the holder is gone, the cache opens for writing.
    m = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, 8), engine_id="engine-B")
    m.shutdown()


def test_lock_is_released_by_a_killed_holder(tmp_path):
    layout = small_layout()
    fp = fingerprint(layout)
    proc = subprocess.Popen(
        [sys.executable, "-c", _holder_script(str(tmp_path), "engine-A")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait(timeout=30)
    m = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, 8), engine_id="engine-B")
    m.shutdown()


def test_worker_access_in_the_holders_own_process(tmp_path):
    layout = small_layout()
    fp = fingerprint(layout)
    ns = Namespace.open(tmp_path, fp, layout, num_slots=4)
    check_worker_access(ns, None)  # no holder
    lock = WriterLock.acquire(ns, "E1")
    try:
        check_worker_access(ns, "E1")
        check_worker_access(ns, None)  # holder is this very process
        with pytest.raises(CacheLockedError, match="engine E1"):
            check_worker_access(ns, "E2")
        with pytest.raises(CacheLockedError):
            WriterLock.acquire(ns, "E2", timeout=0.1)
    finally:
        lock.release()
    WriterLock.acquire(ns, "E2").release()


def test_capacity_can_grow_on_reopen(tmp_path):
    layout = small_layout()
    fp = fingerprint(layout)
    m = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, 4))
    m.shutdown()
    with DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=disk_bytes_for(layout, 12)) as m:
        assert m.capacity == 12 and m.num_free_slots() == 12
        assert os.path.getsize(m.namespace.slab_path(0)) == 12 * m.slot_size
