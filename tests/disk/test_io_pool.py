"""``IOPool``: the disk tier's I/O threads run queued reads before queued writes, writes in
the order they came, hand errors to the futures, and finish queued work at shutdown."""

from __future__ import annotations

import threading

import pytest

from tiered_kv.disk.store.io_pool import READ, WRITE, IOPool


def test_queued_reads_run_before_queued_writes_and_each_kind_in_order():
    pool = IOPool(1, "test-io")
    running = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def busy() -> None:
        running.set()
        release.wait(10)

    try:
        pool.submit(busy, priority=WRITE)
        assert running.wait(10)
        futures = [
            pool.submit(order.append, name, priority=priority)
            for name, priority in (("w1", WRITE), ("r1", READ), ("w2", WRITE), ("r2", READ))
        ]
        assert pool.queued() == 4
        release.set()
        for f in futures:
            f.result(10)
    finally:
        release.set()
        pool.shutdown()
    # The running write is never interrupted; then both reads, then the writes as queued.
    assert order == ["r1", "r2", "w1", "w2"]


def test_errors_reach_the_future_and_the_thread_goes_on():
    pool = IOPool(2, "test-io")
    try:
        failed = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(10)
        assert pool.submit(lambda x: x + 1, 41, priority=WRITE).result(10) == 42
    finally:
        pool.shutdown()


def test_shutdown_runs_what_was_queued_then_refuses_more():
    pool = IOPool(1, "test-io")
    gate = threading.Event()
    done: list[int] = []
    pool.submit(gate.wait, 10)
    futures = [pool.submit(done.append, i, priority=WRITE) for i in range(5)]
    gate.set()
    pool.shutdown(wait=True)
    assert done == list(range(5)) and all(f.done() for f in futures)
    with pytest.raises(RuntimeError, match="after the pool was shut down"):
        pool.submit(done.append, 6)
    pool.shutdown()  # idempotent
    with pytest.raises(ValueError, match="io threads must be >= 1, got 0"):
        IOPool(0, "test-io")
