"""The store's request deadlines (``futures.Deadlines``): a request still out at its
deadline is settled by it; its late answer is dropped (the caller's buffer is no longer
its own); one still queued then is never sent. Real threads, no server: the hang is a
request that blocks until released."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiered_kv.remote.store.futures import Claim, Deadlines, split_batches


def test_a_request_out_at_its_deadline_is_settled_by_it_and_its_late_answer_is_dropped():
    pool = ThreadPoolExecutor(1)
    deadlines = Deadlines(0.2)
    release, wrote, sent = threading.Event(), [], []

    def hung(claim: Claim, name: str) -> str:
        sent.append(name)
        release.wait(10)
        if claim.take():  # as ``RemoteStore._get_one`` does before writing the caller's buffer
            wrote.append(name)
        return name

    expired: list[Claim] = []

    def on_expiry(claim: Claim) -> str:
        expired.append(claim)
        return "miss"

    first = deadlines.submit(pool, hung, "first", on_expiry=on_expiry)
    queued = deadlines.submit(pool, hung, "queued", on_expiry=on_expiry)  # behind the hung one
    assert first.result(5) == "miss" and queued.result(5) == "miss"
    assert [c.started for c in expired] == [True, False]  # sent and hung, or only waiting
    release.set()
    pool.shutdown(wait=True)
    assert sent == ["first"], "a request settled while queued was sent"
    assert wrote == [] and first.result() == "miss"

    # Answers and errors within the deadline are the request's own.
    pool = ThreadPoolExecutor(2)
    assert deadlines.submit(pool, lambda claim: 7, on_expiry=on_expiry).result(5) == 7

    def broken(claim: Claim) -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        deadlines.submit(pool, broken, on_expiry=on_expiry).result(5)
    assert len(expired) == 2
    deadlines.close()
    pool.shutdown()


def test_batches_keep_order_and_both_bounds_and_an_oversized_item_goes_alone():
    items = list(range(7))
    assert split_batches(items, [4, 4, 4, 10, 1, 1, 1], count=2, limit=9) == [[0, 1], [2], [3], [4, 5], [6]]
    assert split_batches(items, [1] * 7, count=3, limit=100) == [[0, 1, 2], [3, 4, 5], [6]]
    assert split_batches([], [], count=3, limit=1) == []
