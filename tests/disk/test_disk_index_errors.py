"""A disk tier's failed index operations reach the exporter
(``tiered_kv_tier_index_errors_total{tier, op}``) and ``tiered-kv stats``: a failed read of the index log (what the
workers wrote stays pending until a read succeeds) and a failed index write (tried again).
Real manager, store, LMDB, composite and exporter; LMDB's errors are injected, as a real
index cannot be made to fail on demand."""

from __future__ import annotations

import lmdb
from test_disk_held_back import engine, stats_read
from test_disk_log_attempts import slots_of
from support.disk_fixtures import block_hash

from tiered_kv.metrics import TIER_INDEX_ERRORS, index_error_values
from tiered_kv.metrics_export import PrometheusMetrics

A = block_hash("A")


def unreadable(*args, **kwargs):
    """Fault injection: LMDB fails a read of the index log."""
    raise lmdb.Error("injected: the log cannot be read")


def exported(metrics: PrometheusMetrics, composite) -> dict[str, float | None]:
    metrics.update(composite.stats, counters=index_error_values(composite.lower))
    value = metrics.registry.get_sample_value
    return {op: value(f"{TIER_INDEX_ERRORS}_total", {"tier": "disk", "op": op}) for op in ("read", "flush")}


def test_failed_index_reads_and_writes_are_counted_and_exported(tmp_path):
    with engine(tmp_path) as (composite, s, layout):
        disk, metrics = composite.tier("disk"), PrometheusMetrics()
        out = disk.prepare_store([A])
        for rank in (0, 1):
            s.log_failed(rank, [A], slots_of(out))
        read_log = disk.index.read_log_columns
        disk.index.read_log_columns = unreadable
        assert not disk.refresh() and disk.num_free_slots() == 3, "nothing applied"
        disk.index.read_log_columns = read_log
        assert exported(metrics, composite) == {"read": 1, "flush": 0}, "a series from the start"

        flusher = disk._index_flusher
        apply_batch = flusher._index.apply_batch

        def failing(*args, **kwargs):  # fault injection: the index write fails
            raise lmdb.Error("injected: the index write fails")

        flusher._index.apply_batch = failing
        disk.refresh()  # the failed store's slot now waits for its entry's deletion
        disk.flush(timeout=0.5)  # the write fails: counted, the slot kept back
        flusher._index.apply_batch = apply_batch
        errors = exported(metrics, composite)
        assert errors["read"] == 1 and errors["flush"] is not None and errors["flush"] >= 1
        assert errors["flush"] == disk.stats.index_flush_errors
        assert disk.flush() and disk.num_free_slots() == 4, "written once the index takes it"
        assert exported(metrics, composite)["flush"] == disk.stats.index_flush_errors, "a total, not re-added"


def test_tiered_kv_stats_shows_them_per_tier(tmp_path):
    """``tiered-kv stats`` against the exporter of a hierarchy whose disk index failed one read."""
    with engine(tmp_path) as (composite, s, layout):
        disk, metrics = composite.tier("disk"), PrometheusMetrics()
        disk.prepare_store([A])
        read_log = disk.index.read_log_columns
        disk.index.read_log_columns = unreadable
        disk.refresh()
        disk.index.read_log_columns = read_log
        assert exported(metrics, composite) == {"read": 1, "flush": 0}
        tiers, cells = stats_read(metrics, "index errors (read / flush)")
        assert tiers["disk"]["index_errors"] == {"read": 1, "flush": 0} and tiers["cpu"]["index_errors"] == {}
        assert cells == ["-", "1 / 0"]
