"""kill -9 at random moments: reopening finds only intact blocks, and every block whose
store completed before the kill (and was not evicted since) is still there."""

from __future__ import annotations

import os
import random
import time

import pytest

from support import disk_fixtures as fx
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.testing.crash import drop_torn_tail

TRIALS = 20
SEED = 20261122


@pytest.fixture(scope="module")
def ctx():
    return fx.forkserver_context()


def expected_blocks(journal: str) -> tuple[set[bytes], bool]:
    """Blocks the journal says are stored and not evicted since; and whether the kill
    hit a prepare_store (its evictions may have reached the index unjournaled)."""
    present: set[bytes] = set()
    in_prepare = False
    with open(journal) as f:
        for line in f.read().splitlines():
            if line == "B":
                in_prepare = True
            elif line == "P":
                in_prepare = False
            elif line.startswith("E "):
                present.discard(bytes.fromhex(line[2:]))
            elif line.startswith("S "):
                present.add(bytes.fromhex(line[2:]))
    return present, in_prepare


def wait_ready(journal: str, proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    start = os.path.getsize(journal) if os.path.exists(journal) else 0
    while time.monotonic() < deadline:
        with open(journal) as f:
            f.seek(start)
            if "R\n" in f.read():
                return
        assert proc.is_alive(), f"crash child exited early with code {proc.exitcode}"
        time.sleep(0.01)
    raise AssertionError("crash child never became ready")


@pytest.mark.faults
def test_kill_dash_nine_never_leaves_torn_or_lost_blocks(tmp_path, ctx):
    cache, journal = str(tmp_path / "cache"), str(tmp_path / "journal")
    open(journal, "w").close()
    layout = fx.crash_layout()
    fp = fx.fingerprint(layout, tp_size=fx.CRASH_TP)
    nbytes = fx.disk_bytes_for(layout, fx.CRASH_SLOTS)
    rng = random.Random(SEED)
    checked = 0
    for trial in range(TRIALS):
        proc = ctx.Process(target=fx.crash_workload, args=(cache, journal, SEED + trial))
        proc.start()
        wait_ready(journal, proc)
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, 9)
        proc.join(30)
        assert proc.exitcode == -9, f"trial {trial}: child ended with {proc.exitcode}, not by the kill"

        drop_torn_tail(journal)  # a record the kill stopped at a page boundary
        must_have, in_prepare = expected_blocks(journal)
        with (
            DiskOffloadingManager(cache, fp, layout, disk_bytes=nbytes, engine_id=f"check-{trial}") as m,
            DiskStore.open(
                cache, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id=f"check-{trial}"
            ) as store,
        ):
            loadable = list(m.iter_evictable())
            if not in_prepare:
                missing = must_have - set(loadable)
                assert not missing, f"trial {trial}: completed stores lost: {[h.hex()[:12] for h in missing]}"
            for h in loadable:
                for rank in range(fx.CRASH_TP):
                    data = store.read_block(rank, h)
                    assert data == fx.block_content(h, rank, layout.bytes_per_block), (
                        f"trial {trial}: block {h.hex()[:12]} rank {rank} is torn or wrong"
                    )
                checked += 1
            assert store.stats.checksum_failures == 0 and store.stats.missing_entries == 0
            # Reopen reclaimed every partial entry: the index now holds loadable blocks only.
            assert m.flush()
            snap = store.snapshot()
            assert len(snap) == len(loadable)
        # The journal continues: what this check saw is what the next child starts from.
        with open(journal, "a") as f:
            f.write("S " + "\nS ".join(h.hex() for h in loadable) + "\n" if loadable else "")
            for h in must_have - set(loadable):
                f.write(f"E {h.hex()}\n")
    assert checked > TRIALS, "the children stored too little for the test to mean anything"
