"""Full disks and I/O errors under the whole hierarchy: stores fail cleanly and are
counted, loads fall back to recompute (the failed job is reported, never raised), the
engine keeps serving, and once the fault clears, stores resume and survive a restart."""

from __future__ import annotations

import errno
import shutil

import pytest

from tiered_kv.disk.format.namespace import NamespaceError

from tiered_kv.testing.harness import Hierarchy, InjectingBackend, TmpfsMount, documents, inject_backend, verify_cache

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]


def all_blocks(docs) -> list[bytes]:
    return [b for d in docs for b in d]


@pytest.mark.parametrize("fault", ["enospc_write", "eio_write", "eio_sync"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_store_faults_are_counted_and_stores_resume_when_cleared(tmp_path, fault, policy):
    h = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64, write_policy=policy)
    io = InjectingBackend()
    inject_backend(h, io)
    kind, _, call = fault.partition("_")
    setattr(io, f"fail_{call}", errno.ENOSPC if kind == "enospc" else errno.EIO)

    faulty = documents(10, 4, seed=1)  # 40 blocks through an 8-block CPU tier: spills or write-through
    report = h.run(faulty)
    assert h.settle() == 0, "failed disk writes are still pending: their slots never come back"
    assert report.requests == 10 and report.mismatches == 0
    assert sum(io.injected.values()) > 0
    disk_stats = h.spec.stats.tiers["disk"]
    assert disk_stats["failed_stores"] > 0
    assert h.spec.store.stats.store_failures > 0
    if kind == "enospc":
        assert h.spec.store.stats.enospc > 0
    assert h.disk.stats.store_failures > 0
    assert not h.disk.loadable_among(all_blocks(faulty)), "a block whose write failed is loadable"

    setattr(io, f"fail_{call}", None)  # space returns / the device recovers
    healthy = documents(6, 4, seed=2)
    for doc in healthy:  # one request at a time, so back-pressure never drops a write
        h.run([doc])
        assert h.settle() == 0
    if policy == "write_through":
        expected = set(all_blocks(healthy))
    else:  # write-back: only what fell out of the CPU tier went to disk
        expected = set(all_blocks(healthy)) - set(h.manager.cpu.iter_evictable())
    on_disk = h.disk.loadable_among(expected)
    assert on_disk == expected, f"{len(expected - on_disk)} blocks never reached disk after the fault cleared"
    h.close()

    # What was stored after recovery is durable: a restarted engine loads it from disk.
    again = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64)
    report = again.run([d for d in healthy if set(d) <= on_disk])
    assert report.mismatches == 0 and report.computed == 0
    again.close()
    assert verify_cache(tmp_path).ok


def test_read_errors_fall_back_to_recompute_and_the_recomputed_blocks_load_once_the_device_recovers(tmp_path):
    docs = documents(8, 4, seed=3)
    h = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64)
    h.run(docs)
    h.settle()
    h.close()

    h = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64)
    io = InjectingBackend()
    inject_backend(h, io)
    io.fail_read = errno.EIO
    report = h.run(docs)
    assert io.injected["read"] > 0
    assert report.requests == len(docs) and report.mismatches == 0
    assert report.failed_jobs > 0, "the failed loads were not reported as failed jobs"
    assert report.recomputed_after_failed_load > 0
    assert h.spec.stats.tiers["disk"]["failed_loads"] > 0
    assert h.spec.stats.transfers["disk_to_cpu"].failed_jobs + h.spec.stats.transfers["disk_to_gpu"].failed_jobs > 0

    # The blocks a read failed on are dropped (offered again, they would fail every load
    # that meets them); their recomputed copies were stored anew and load once it recovers.
    io.fail_read = None
    h.driver.report.hits_by_medium.clear()
    h.close()
    h = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64)
    report = h.run(docs)
    assert report.mismatches == 0 and report.hits_by_medium.get("DISK", 0) > 0
    h.close()


@pytest.fixture
def tmpfs(tmp_path):
    mnt = TmpfsMount(tmp_path / "mnt", 16 << 20)
    if not mnt.mount():
        pytest.skip("cannot mount a tmpfs here (needs root); the injected ENOSPC tests cover the path")
    yield mnt
    mnt.unmount()


def test_a_really_full_filesystem_does_not_stop_the_disk_tier(tmpfs):
    """A tmpfs filled to the last byte after the engine started. The slabs and the
    index's room to grow were reserved at startup, so stores go on succeeding, the
    engine restarts on the full disk, and only a cache that would need new space (a
    new namespace) is refused, with a message naming disk_bytes."""
    cache = tmpfs.path / "cache"
    h = Hierarchy(cache, cpu_blocks=8, disk_blocks=128)
    warm = documents(4, 4, seed=4)
    h.run(warm)
    h.settle()
    filler = tmpfs.fill(leave=0)
    assert shutil.disk_usage(tmpfs.path).free < 64 << 10

    full = documents(24, 4, seed=5)
    for doc in full:
        report = h.run([doc])
        assert h.settle() == 0
    assert report.requests == 4 + 24 and report.mismatches == 0
    assert h.spec.store.stats.store_failures == 0 and h.disk.stats.index_flush_errors == 0
    recent = set(all_blocks(full[-6:]))
    assert h.disk.loadable_among(recent) == recent
    h.close()

    h = Hierarchy(cache, cpu_blocks=8, disk_blocks=128)  # restart on the full disk
    report = h.run(full[-6:])
    assert report.mismatches == 0 and report.computed == 0
    h.close()
    with pytest.raises(NamespaceError, match="disk_bytes"):
        Hierarchy(cache, cpu_blocks=8, disk_blocks=128, model_id="another-model")

    filler.unlink()
    assert verify_cache(cache).ok


_INDEX_CANNOT_GROW = """
import json, resource, sys, time
from tiered_kv.testing.harness import Hierarchy, documents

h = Hierarchy(sys.argv[1], cpu_blocks=8, disk_blocks=64)  # at most 16 disk writes pending
h.run(documents(2, 4, seed=1)); h.settle()
# No file may be written past its second page (EFBIG; ENOSPC and EIO take the same path):
# the stores' writes fail, and so does every index transaction, the one that logs those
# failures too.
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
for d in documents(20, 4, seed=2):
    h.run([d])
h.settle()
failed = h.spec.store.stats.store_failures
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
deadline = time.monotonic() + 60
while h.disk.num_pending() and time.monotonic() < deadline:
    h.settle(); time.sleep(0.2)
after = documents(6, 4, seed=3)
for d in after:
    h.run([d]); h.settle()
blocks = {b for d in after for b in d}
print(json.dumps({"failed": failed, "seen": h.disk.stats.store_failures, "pending": h.disk.num_pending(),
                  "loadable": len(h.disk.loadable_among(blocks)), "blocks": len(blocks)}))
h.close()
"""


def test_failed_stores_the_index_could_not_log_are_logged_once_it_can(tmp_path):
    """A store fails because the index cannot commit; logging that failure needs the same
    index. Its record is kept and written later: otherwise the manager never frees those
    slots, and once its pending bound fills the disk tier stores nothing again."""
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _INDEX_CANNOT_GROW, str(tmp_path)], capture_output=True, text=True, timeout=150
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["failed"] >= 16, "the fault did not fail as many stores as may be pending"
    assert out["seen"] == out["failed"] and out["pending"] == 0
    assert out["loadable"] == out["blocks"], "the disk tier stored nothing once the index could grow again"
