"""Damaged cache files under the whole hierarchy: flipped bytes in a slab, a truncated or
deleted slab, a garbage or truncated LMDB index. Each is detected (by the inspector's
check before the engine starts, and by the engine), the affected blocks are dropped or
the index is rebuilt empty with a logged reason, no exception reaches the engine, no
wrong byte is served, and the disk tier works again afterwards."""

from __future__ import annotations

import logging
import random

import pytest

from tiered_kv.testing.harness import (
    Hierarchy,
    delete_slab,
    documents,
    flip_slab_bits,
    garbage_index,
    garbage_index_pages,
    inspect_verify,
    namespace_dirs,
    truncate_index,
    truncate_slab,
    verify_cache,
)
from tiered_kv.disk.format.index import QUARANTINE_SUFFIX

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

DOCS = documents(8, 4, seed=11)  # 32 blocks; the disk tier (64) keeps them all
BLOCKS = [b for d in DOCS for b in d]


@pytest.fixture
def cache(tmp_path):
    """A cache whose disk tier holds every block of ``DOCS``, closed cleanly."""
    h = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64)
    for doc in DOCS:  # one at a time: back-pressure never drops a write
        h.run([doc])
        assert h.settle() == 0
    assert h.disk.loadable_among(BLOCKS) == set(BLOCKS)
    h.close()
    assert verify_cache(tmp_path).ok
    return tmp_path


def assert_inspector_flags(cache_dir, what: str) -> None:
    cli = inspect_verify(cache_dir)
    if cli is not None:
        code, out = cli
        assert code != 0, f"inspect verify passed a cache with {what}:\n{out}"


def serve_everything(cache_dir):
    """Restart the engine on the damaged cache and request every block; returns the
    hierarchy (still open) and the report. Nothing may raise and nothing be wrong."""
    h = Hierarchy(cache_dir, cpu_blocks=8, disk_blocks=64)
    report = h.run(DOCS)
    assert report.requests == len(DOCS) and report.mismatches == 0
    return h, report


def assert_healed(h: Hierarchy, cache_dir) -> None:
    """After the damage was dealt with, blocks reach disk again and the cache verifies."""
    h.run(documents(4, 4, seed=12))
    assert h.settle() == 0
    h.close()
    result = verify_cache(cache_dir)
    assert result.ok and result.verified > 0, result
    cli = inspect_verify(cache_dir)
    if cli is not None:
        assert cli[0] == 0, cli[1]


def test_flipped_bits_in_a_slab_fail_those_loads_only(cache):
    victims = flip_slab_bits(cache, random.Random(5), blocks=6)

    before = verify_cache(cache)
    assert set(before.corrupt) == victims and not before.wrong
    assert_inspector_flags(cache, "flipped bits")

    h, report = serve_everything(cache)
    assert h.spec.store.stats.checksum_failures == len(victims)
    assert h.disk.stats.checksum_failures == len(victims)
    assert report.recomputed_after_failed_load >= len(victims)
    assert report.hits_by_medium.get("DISK", 0) >= len(BLOCKS) - 4 * len(victims)
    assert h.disk.loadable_among(set(BLOCKS) - victims) == set(BLOCKS) - victims, "intact blocks were dropped"
    assert_healed(h, cache)


def test_flipped_bits_under_a_running_engine_are_caught_on_load(cache):
    h = Hierarchy(cache, cpu_blocks=8, disk_blocks=64)
    victims = flip_slab_bits(cache, random.Random(6), blocks=4)  # O_DIRECT reads see the new bytes
    report = h.run(DOCS)
    assert report.mismatches == 0
    assert h.disk.stats.checksum_failures == len(victims)
    assert_healed(h, cache)


@pytest.mark.parametrize("keep_slots", [10, 0], ids=["truncated", "emptied"])
def test_a_truncated_slab_drops_the_blocks_past_its_end_at_startup(cache, keep_slots, caplog):
    gone = truncate_slab(cache, random.Random(7), keep_slots)
    assert gone
    intact = set(BLOCKS) - gone

    before = verify_cache(cache)
    assert set(before.corrupt) == gone
    assert_inspector_flags(cache, "a truncated slab")

    with caplog.at_level(logging.WARNING, logger="tiered_kv.disk.scheduler.manager"):
        h = Hierarchy(cache, cpu_blocks=8, disk_blocks=64)
    assert "missing or truncated" in caplog.text
    assert not h.disk.loadable_among(gone), "blocks past the end of the slab are still offered"
    assert h.disk.loadable_among(intact) == intact
    report = h.run(DOCS)
    assert report.mismatches == 0 and h.spec.store.stats.checksum_failures == 0
    assert_healed(h, cache)


def test_a_deleted_slab_empties_the_tier_and_is_recreated(cache, caplog):
    ns = namespace_dirs(cache)[0]
    delete_slab(cache, random.Random(8))
    before = verify_cache(cache)
    assert len(before.corrupt) + len(before.errors) > 0
    assert_inspector_flags(cache, "a deleted slab")

    with caplog.at_level(logging.WARNING, logger="tiered_kv.disk.scheduler.manager"):
        h, report = serve_everything(cache)
    assert "missing or truncated" in caplog.text
    assert report.offload_hits == 0 and h.spec.store.stats.checksum_failures == 0
    assert (ns / "rank0.slab").exists()
    assert_healed(h, cache)


@pytest.mark.parametrize(
    "damage", [garbage_index, garbage_index_pages, truncate_index], ids=["garbage", "garbage-pages", "truncated"]
)
def test_a_damaged_index_is_set_aside_and_rebuilt_empty(cache, damage, caplog):
    ns = namespace_dirs(cache)[0]
    damage(cache, random.Random(9))

    before = verify_cache(cache)
    assert before.errors or before.corrupt, "the check did not notice the damaged index"
    assert_inspector_flags(cache, "a damaged index")

    with caplog.at_level(logging.ERROR):
        h, report = serve_everything(cache)
    assert "damaged" in caplog.text and "empty index" in caplog.text
    assert (ns / ("index.lmdb" + QUARANTINE_SUFFIX)).is_dir()
    assert report.offload_hits == 0, "blocks were served from an index that could not be read"
    assert_healed(h, cache)


def test_damage_lmdb_meets_only_while_the_engine_reads_its_index_never_stops_it(cache, monkeypatch, caplog):
    """Damage the page walk at open does not see (a page LMDB finds of the wrong type
    while the start-up read iterates it: bytes a seeded fuzz run happened to produce, so
    the read is made to meet it here, for as long as the damaged environment is open):
    the engine starts, serves nothing of that index, and the next start sets it aside."""
    import lmdb

    from tiered_kv.disk.format.index import DiskIndex

    ns = namespace_dirs(cache)[0]
    real = DiskIndex._log_seq
    damaged = []

    def read(self, txn):
        if not damaged:
            damaged.append(self._shared)
        if self._shared is damaged[0]:
            raise lmdb.CorruptedError("mdb_cursor_get: MDB_CORRUPTED: Located page was wrong type")
        return real(self, txn)

    monkeypatch.setattr(DiskIndex, "_log_seq", read)
    with caplog.at_level(logging.ERROR):
        h, report = serve_everything(cache)
    assert damaged and "damaged" in caplog.text
    assert report.offload_hits == 0, "blocks were served from an index that could not be read"
    h.close()
    with caplog.at_level(logging.ERROR):
        h, report = serve_everything(cache)
    assert (ns / ("index.lmdb" + QUARANTINE_SUFFIX)).is_dir() and "empty index" in caplog.text
    assert_healed(h, cache)
