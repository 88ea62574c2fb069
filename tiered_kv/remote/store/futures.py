"""Futures of batches: the store's requests run one per thread and a caller gets one
future per batch. Plain combinators, no I/O; used by ``store.RemoteStore``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def gather(futures: list[Future], combine: Callable[[list[Any]], object] = list) -> Future:
    """One future for a batch: ``combine`` of the results, in order, once all are done."""
    out: Future = Future()
    if not futures:
        out.set_result(combine([]))
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            try:
                out.set_result(combine([f.result() for f in futures]))
            except BaseException as exc:  # a bug in a task: surfaces on the batch future
                out.set_exception(exc)

    for f in futures:
        f.add_done_callback(done)
    return out


def done_future(value: T) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def all_present(answers: list[bool | None]) -> bool | None:
    """Every rank's object there: False if one is missing, None if one is unknown."""
    if any(a is False for a in answers):
        return False
    return None if any(a is None for a in answers) else True
