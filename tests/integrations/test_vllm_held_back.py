"""Disk slots held back (neither free nor holding a chunk) on vLLM 0.33's Prometheus side,
through vLLM's real scheduler and its ``OffloadPromMetrics`` (tests/support/vllm_harness.py):
``tiered_kv_tier_held_back_blocks{tier, reason}`` from ``TieredOffloadingSpec``'s scheduler,
``tiered_kv_disk_tier_held_back_chunks{reason}`` from ``TieredDiskTier`` under vLLM's tiering;
and the disk index's failed reads, ``tiered_kv_tier_index_errors_total{tier, op}`` and
``tiered_kv_disk_tier_index_read_errors_total`` (LMDB's error injected).

The held-back slot is a store given up with no rank ever reporting on it: what the
hierarchy does when a store job fails before any worker wrote (``complete_store(success=
False)``), and the case where only this gauge tells an operator why the disk tier shrank.

I/O: disk tiers in pytest's tmp_path; the test process plays the scheduler and the worker.
"""

from __future__ import annotations

import time

import lmdb
import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from test_vllm_tiers import BLOCK, _build, _durable, _keys, _prompt, _serve  # noqa: E402

from tiered_kv.disk.scheduler.manager import DiskOffloadingManager  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def test_held_back_disk_slots_reach_vllms_prometheus_side(model_dir, tmp_path):
    with _build(model_dir, disk=tmp_path / "disk") as h:
        _serve(h, _prompt(70, 2 * BLOCK + 1))
        _durable(h)
        composite = h.manager.composite
        disk = composite.tier("disk")
        assert isinstance(disk, DiskOffloadingManager)

        def exported(reason: str) -> float | None:
            h.step()  # the scheduler's stats go out with a step's output
            registry = h.publish_metrics()  # fails if a reported metric was not declared
            labels = {"engine": "0", "tier": "disk", "reason": reason}
            return registry.get_sample_value("tiered_kv_tier_held_back_blocks", labels)

        assert (exported("settling"), exported("releasing")) == (0, 0), "a series from the start"
        keys = _keys(_prompt(71, 2 * BLOCK + 1))
        out = composite.prepare_store(keys)  # a store job carrying write-through copies to disk
        assert out is not None
        slots = out.store_spec.write_through.tier_slots.tolist()
        composite.complete_store(keys, success=False)  # it failed; no worker ever wrote or logged
        assert (exported("settling"), exported("releasing")) == (2, 0)
        assert disk.num_free_slots() == disk.capacity - 2 - len(disk)

        store = h.worker_spec._worker.load_handler.to_cpu[0].store
        store.log_failed(0, keys, slots)  # what a worker logs for writes that will not happen
        deadline = time.monotonic() + 10
        while sum(disk.held_back_slots().values()) and time.monotonic() < deadline:
            time.sleep(0.01)  # the flusher reads the record and deletes the entries
        assert (exported("settling"), exported("releasing")) == (0, 0)
        assert disk.num_free_slots() == disk.capacity - len(disk)


def test_a_tiered_disk_tiers_held_back_slots_reach_vllms_prometheus_side(model_dir, tmp_path):
    from test_vllm_secondary_tier import _build as build_tiering
    from test_vllm_secondary_tier import _extra, _tier
    from test_vllm_secondary_tier import _keys as tiering_keys
    from test_vllm_secondary_tier import _prompt as tiering_prompt

    with build_tiering(model_dir, _extra(tmp_path / "cache", primary_chunks=4, disk_chunks=16)) as h:
        tier = _tier(h)

        def exported(reason: str) -> float | None:
            h.step()
            registry = h.publish_metrics()
            return registry.get_sample_value("tiered_kv_disk_tier_held_back_chunks", {"engine": "0", "reason": reason})

        assert (exported("settling"), exported("releasing")) == (0, 0)
        with h.manager.lock:
            key = tiering_keys(tiering_prompt(72, BLOCK + 1))[0]
            assert tier.disk_manager.prepare_store([key]) is not None
            tier.disk_manager.abandon_store([key])  # given up; no rank ever reports on it
        assert (exported("settling"), exported("releasing")) == (1, 0)
        assert tier.disk_manager.num_free_slots() == 15


def _fail_a_log_read(disk: DiskOffloadingManager) -> int:
    """Fault injection: LMDB fails one ``refresh``'s read of the disk index's log; the
    failed reads counted so far (the flusher's own refreshes may meet the fault too)."""

    def unreadable(*args, **kwargs):
        raise lmdb.Error("injected: the log cannot be read")

    read_log, disk.index.read_log_columns = disk.index.read_log_columns, unreadable
    try:
        disk.refresh()
    finally:
        disk.index.read_log_columns = read_log
    return disk.stats.index_read_errors


def test_disk_index_errors_reach_vllms_prometheus_side(model_dir, tmp_path):
    with _build(model_dir, disk=tmp_path / "disk") as h:
        disk = h.manager.composite.tier("disk")
        assert isinstance(disk, DiskOffloadingManager)

        def exported(op: str) -> float | None:
            h.step()
            registry = h.publish_metrics()
            return registry.get_sample_value(
                "tiered_kv_tier_index_errors_total", {"engine": "0", "tier": "disk", "op": op}
            )

        assert not exported("read") and not exported("flush")  # reported from the first increase
        errors = _fail_a_log_read(disk)
        assert errors >= 1 and exported("read") == errors and not exported("flush")


def test_a_tiered_disk_tiers_index_errors_reach_vllms_prometheus_side(model_dir, tmp_path):
    from test_vllm_secondary_tier import _build as build_tiering
    from test_vllm_secondary_tier import _extra, _tier

    with build_tiering(model_dir, _extra(tmp_path / "cache", primary_chunks=4, disk_chunks=16)) as h:
        disk = _tier(h).disk_manager

        def exported() -> float | None:
            h.step()
            registry = h.publish_metrics()
            return registry.get_sample_value("tiered_kv_disk_tier_index_read_errors_total", {"engine": "0"})

        errors = _fail_a_log_read(disk)
        assert errors >= 1 and exported() == errors
        assert exported() == errors, "reported once, not again"
