"""Resources: pinned memory that cannot be had, and shutdown with transfers in flight.

Pinning needs CUDA, so the refusal is injected here (``device.cuda_host_register``
raising as it does when the driver cannot lock the pages); the fallback itself is real.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest

import tiered_kv.memory.device
from tiered_kv.testing.harness import Hierarchy, device, documents, namespace_dirs, verify_cache
from tiered_kv.disk.format.namespace import Namespace, current_holder
from tiered_kv.memory.host_memory import HostKVCache

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

DOCS = documents(16, 4, seed=31)


@pytest.fixture
def pinning_refused(monkeypatch):
    """CUDA present (as far as the probe goes) but every pinned allocation refused."""
    refused = []

    def register(address, nbytes):
        refused.append(nbytes)
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed (CUDA error 2)")

    monkeypatch.setattr(tiered_kv.memory.device, "can_pin_memory", lambda: True)
    monkeypatch.setattr(tiered_kv.memory.device, "cuda_host_register", register)
    return refused


def test_a_refused_pinned_allocation_falls_back_to_pageable_memory_with_guidance(pinning_refused, caplog):
    layout = device().layout
    with caplog.at_level(logging.WARNING):
        host = HostKVCache(layout, 8)
    assert pinning_refused and not host.pinned and len(host.tensors) == len(layout.layers)
    assert "ulimit -l" in caplog.text and "cpu_bytes" in caplog.text
    with pytest.raises(RuntimeError, match=r"pinned memory .*lower cpu_bytes, or raise the locked-memory limit"):
        HostKVCache(layout, 8, pin=True)


def test_the_whole_hierarchy_serves_when_pinning_is_refused(tmp_path, pinning_refused):
    h = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64)
    for doc in DOCS[:8]:
        h.run([doc])
        assert h.settle() == 0
    report = h.run(DOCS[:8])  # again: from CPU and disk
    assert pinning_refused and not h.spec.host.pinned
    assert report.mismatches == 0 and report.failed_jobs == 0
    assert report.hits_by_medium.get("DISK", 0) > 0, "disk loads failed without pinned staging buffers"
    h.close()


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


def _close_worker_first(h: Hierarchy) -> None:
    h.close()


def _close_manager_first(h: Hierarchy) -> None:  # the scheduler process may exit before its workers
    h.driver.manager.shutdown()
    h.driver.worker.shutdown()
    h.spec.store.close()


def _close_store_under_the_worker(h: Hierarchy) -> None:  # queued disk writes find the store closed
    h.spec.store.close()
    h.driver.worker.shutdown()
    h.driver.manager.shutdown()


@pytest.mark.parametrize(
    "close",
    [_close_worker_first, _close_manager_first, _close_store_under_the_worker],
    ids=["worker-first", "manager-first", "store-first"],
)
def test_shutdown_with_transfers_in_flight_neither_hangs_nor_leaves_stray_files(tmp_path, close):
    before = _threads()
    h = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64)
    for doc in DOCS:  # no drain: stores, spills and write-through copies are in flight
        h.driver.run_request(doc)
    closer = threading.Thread(target=close, args=(h,))
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "shutdown hung with transfers in flight"

    ns = namespace_dirs(tmp_path)[0]
    assert os.listdir(tmp_path) == [ns.name], "stray files in the cache directory"
    assert set(os.listdir(ns)) <= {"manifest.json", "index.lmdb", "rank0.slab", "lock"}
    assert set(os.listdir(ns / "index.lmdb")) == {"data.mdb", "lock.mdb"}
    assert current_holder(Namespace.open_path(ns)) is None, "the writer lock outlived shutdown"
    leftover = [t.name for t in _threads() - before]
    assert not leftover, f"threads still running after shutdown: {leftover}"
    result = verify_cache(tmp_path)
    assert result.ok and result.incomplete == 0, result

    again = Hierarchy(tmp_path, cpu_blocks=8, disk_blocks=64)  # the next engine starts at once
    assert again.run(DOCS).mismatches == 0
    again.close()
