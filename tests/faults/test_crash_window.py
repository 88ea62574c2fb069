"""A kill between a store's first step (clearing the slot's entry) and its last (the
commit), when the block stored is the one already recorded in that slot: an evicted
block stored again lands in the slot it left, since freed slots are handed out first.

Clearing took away the rank's bit and left the entry with none: at TP 1 an entry that
no rank has committed, which ``tiered-kv inspect verify`` and the crash storm report as
incomplete (never served, reclaimed at the next start), though TP 1 commits a block in
one transaction. The crash storm's one unexplained trial in 1,940 fits this window. An
entry left with no rank is deleted instead. Real store, real LMDB, a real SIGKILL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import disk_fixtures as fx
from tiered_kv.testing.harness import verify_cache
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import Namespace

TESTS = Path(__file__).resolve().parent.parent

_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = {paths!r}
    from support import disk_fixtures as fx
    from tiered_kv.disk.store.store import DiskStore
    layout = fx.small_layout()
    fp = fx.fingerprint(layout, tp_size={tp})
    store = DiskStore.open({cache!r}, fp, layout, disk_bytes=fx.disk_bytes_for(layout, 8), io_backend="posix")
    h = fx.block_hash("stored again")
    for rank in range({tp}):
        assert store.write_blocks(rank, [h], [3], fx.content_rows([h], rank, layout, store.slot_size)) == [True]
    # Stored again into slot 3: step 1 commits the clear of rank 0's copy, then the kill.
    store.index.clear_for_overwrite(0, [h], [3])
    os.kill(os.getpid(), signal.SIGKILL)
""")


def kill_after_the_clear(cache: Path, tp: int) -> None:
    code = _CHILD.format(paths=[str(TESTS), *sys.path], cache=str(cache), tp=tp)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr


@pytest.mark.faults
def test_at_tp1_a_kill_after_clearing_a_slot_for_its_own_block_leaves_no_partial_entry(tmp_path):
    kill_after_the_clear(tmp_path, tp=1)
    found = verify_cache(tmp_path, check_content=False)
    assert (found.entries, found.incomplete, found.ok) == (0, 0, True), found
    layout = fx.small_layout()
    with DiskOffloadingManager(tmp_path, fx.fingerprint(layout), layout, disk_bytes=fx.disk_bytes_for(layout, 8)) as m:
        assert len(m) == 0 and m.stats.reclaimed_at_open == 0


@pytest.mark.faults
def test_at_tp2_the_other_ranks_copy_stays_recorded_and_is_never_served(tmp_path):
    kill_after_the_clear(tmp_path, tp=2)
    found = verify_cache(tmp_path, check_content=False)
    assert (found.entries, found.incomplete, found.ok) == (1, 1, True), found
    layout = fx.small_layout()
    fp = fx.fingerprint(layout, tp_size=2)
    with DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=fx.disk_bytes_for(layout, 8)) as m:
        assert len(m) == 0 and m.stats.reclaimed_at_open == 1


def test_a_slot_committed_and_cleared_in_one_group_keeps_no_entry(tmp_path):
    """The same in one transaction: a group commit that records a block and clears its
    slot (the clear wins: not loadable) leaves no entry at TP 1, and at TP 2 an entry
    only while another rank's copy is recorded."""
    layout = fx.small_layout()
    for tp in (1, 2):
        ns = Namespace.open(tmp_path / f"tp{tp}", fx.fingerprint(layout, tp_size=tp), layout, num_slots=8)
        index = ns.open_index()
        h = fx.block_hash("both")
        from tiered_kv.disk.format.index import StoredBlocks

        if tp == 2:
            index.commit_stored(1, [h], [2], [layout.bytes_per_block], [7])
        index.commit_group([StoredBlocks(0, [h], [2], [layout.bytes_per_block], [5])], [(0, [h], [2])])
        entry = index.get(h)
        if tp == 1:
            assert entry is None
        else:
            assert entry is not None and entry.ranks == 0b10
            index.clear_for_overwrite(1, [h], [2])
            assert index.get(h) is None
        index.close()
        ns.close()
