"""kill -9 of the whole hierarchy (HierarchySpec + EngineDriver in one process)
at random moments of a store / evict / load storm, 50 seeded trials on one cache.

After each kill the cache, exactly as the kill left it, passes ``tiered-kv inspect
verify`` and a block-by-block check against the bytes every block must hold; reopened
as an engine would, every block the dead engine acknowledged durable (the disk manager
reported it loadable) and did not evict since is loadable and byte-exact; and no engine
was ever served a wrong block. ``TIERED_KV_CRASH_TRIALS`` changes the trial count.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from tiered_kv.testing.crash import CrashRunner, drop_torn_tail, read_journal
from tiered_kv.testing.harness import Hierarchy, inspect_cli_available, verify_cache

TRIALS = int(os.environ.get("TIERED_KV_CRASH_TRIALS", "50"))
SEED = 20261123


@pytest.mark.faults
@pytest.mark.timeout(900)
def test_kill_dash_nine_loses_no_acknowledged_block_and_serves_nothing_wrong(tmp_path):
    runner = CrashRunner(tmp_path, SEED)
    for i in range(TRIALS):
        t = runner.trial(i)
        where = f"trial {i} ({t.policy}, killed during {t.phase} after {t.delay:.3f} s)"
        assert t.verify.ok, f"{where}: the cache as the kill left it is damaged: {t.verify}"
        assert t.verify.incomplete == 0, f"{where}: partial entries (TP 1 commits a block in one transaction)"
        if t.cli is not None:
            assert t.cli[0] == 0, f"{where}: tiered-kv inspect verify failed:\n{t.cli[1]}"
        assert not t.lost, f"{where}: {len(t.lost)} acknowledged blocks lost: {[h.hex()[:12] for h in t.lost]}"
        assert t.tolerated <= 6, f"{where}: {t.tolerated} blocks missing beyond one interrupted eviction"
    state = read_journal(runner.journal)
    assert state.mismatches == 0, f"the engines were served {state.mismatches} wrong blocks"

    # The trials meant something: kills landed in both phases, blocks were acknowledged
    # and checked, and the storm moved blocks through every tier.
    phases = Counter(t.phase for t in runner.trials)
    assert phases["storm"] >= TRIALS // 2 and phases["startup"] >= 1, phases
    assert state.acked_total > 5 * TRIALS and state.requests > 5 * TRIALS
    assert sum(t.verify.verified for t in runner.trials) > 10 * TRIALS
    if inspect_cli_available():
        assert all(t.cli is not None for t in runner.trials if t.verify.namespaces)

    # Finally, an engine reopens the cache and serves what it holds.
    h = Hierarchy(runner.cache, engine_id="final")
    held = len(h.disk)
    h.close()
    final = verify_cache(runner.cache)
    assert final.ok and final.verified == held > 0


def test_a_journal_record_the_kill_tore_is_cut_and_the_next_starts_its_own_line(tmp_path):
    """A kill can stop one ``write`` at a page boundary: the head of a record, no newline."""
    journal = tmp_path / "journal"
    journal.write_bytes(b"S\nR\nD " + b"ab" * 16 + b"\nQ 3\nQ ")
    drop_torn_tail(journal)
    with open(journal, "a") as f:  # what the runner or the next child appends
        f.write("S\nM 0\n")
    state = read_journal(journal)
    assert state.acked == {bytes.fromhex("ab" * 16)} and state.requests == 3 and state.mismatches == 0
    drop_torn_tail(journal)  # a whole journal is left as it is
    assert journal.read_bytes().endswith(b"Q 3\nS\nM 0\n")
