"""Timing forward passes, for the prefill rate the load-versus-recompute decision uses.

Worker process (one per GPU); no I/O. An engine adapter starts the timer when a forward
pass that is nearly all prefill is about to be issued and stops it once the pass has
been issued (under vLLM: ``integrations/vllm/connector.py``, which hands each finished
pass to the engine's ``LoadTimings`` for the scheduler). On CUDA the two ends are events
on the current stream, read once the GPU has passed them (never waited for), since the
pass runs asynchronously; elsewhere the pass is synchronous and the clock is read.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

#: Timed passes whose end the GPU has not reached yet, at most (older ones are dropped).
MAX_OPEN_PASSES = 16


class ForwardTimer:
    """Times forward passes (module docstring) and hands each finished one to
    ``record(tokens, seconds)``. ``cuda``: time with CUDA events on the current stream
    (the forward pass runs asynchronously there), else with the clock. Worker process;
    one pass open at a time, from ``start`` to ``stop``."""

    def __init__(self, record: Callable[[int, float], None], cuda: bool = False):
        self.record = record
        self.cuda = cuda
        self._open: tuple[int, Any] | None = None
        self._issued: deque[tuple[int, Any, Any]] = deque(maxlen=MAX_OPEN_PASSES)

    def start(self, tokens: int) -> None:
        """A forward pass of ``tokens`` prefill tokens is about to be issued."""
        if tokens <= 0:
            self._open = None
            return
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._open = (tokens, begin)
        else:
            self._open = (tokens, time.perf_counter())

    def stop(self) -> None:
        """The pass started last has been issued: its time is recorded once known."""
        opened, self._open = self._open, None
        if opened is not None:
            tokens, begin = opened
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._issued.append((tokens, begin, end))
            else:
                self.record(tokens, time.perf_counter() - begin)
        self.poll()

    def poll(self) -> None:
        """Record the issued passes the GPU has finished, oldest first; never waits."""
        issued = self._issued
        while issued and issued[0][2].query():
            tokens, begin, end = issued.popleft()
            self.record(tokens, begin.elapsed_time(end) / 1e3)
