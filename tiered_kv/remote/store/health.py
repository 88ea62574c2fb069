"""The shared tier's fault accounting: consecutive failures that pause requests, and a
rate-limited log of faults.

Runs in every process with a ``RemoteStore``, on its threads; no I/O but logging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tiered_kv.remote.store.client import ConditionalPutRefused, RemoteError, Unavailable

logger = logging.getLogger("tiered_kv.remote.store.store")


class Health:
    """Consecutive transient failures; past the threshold, requests pause for a cooldown."""

    def __init__(self, threshold: int, cooldown: float, on_open: Callable[[int], None]):
        self._threshold, self._cooldown, self._on_open = threshold, cooldown, on_open
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until = 0.0

    def available(self) -> bool:
        return time.monotonic() >= self._open_until

    def success(self) -> None:
        self._failures = 0

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._failures >= self._threshold and self.available():
                self._open_until = time.monotonic() + self._cooldown
                failures, self._failures = self._failures, 0
                self._on_open(failures)


class FaultLog:
    """Logs the first fault of each kind in full, then one summary per ``every`` seconds;
    ``where``: the server, named in the messages of failed requests."""

    def __init__(self, where: str = "", every: float = 60.0):
        self._where, self._every = where, every
        self._lock = threading.Lock()
        self._state: dict[str, list[float]] = {}  # kind -> [next log time, suppressed count]

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            state = self._state.get(kind)
            if state is None:
                self._state[kind] = [now + self._every, 0]
                suppressed = -1
            elif now >= state[0]:
                suppressed, state[0], state[1] = int(state[1]), now + self._every, 0
            else:
                state[1] += 1
                return
        more = "" if suppressed < 0 else f" ({suppressed} more since the last report)"
        logger.warning("shared tier: %s: %s%s", kind, message, more)

    def request_failed(self, exc: Exception, what: str, health: Health) -> None:
        """A request that raised ``exc``: a transient failure (``Unavailable``) counts
        against ``health``; a refusal is logged as what it is; anything else is a bug,
        logged with its traceback."""
        if isinstance(exc, Unavailable):
            health.failure()
            self(what, f"{self._where}: {exc}")
        elif isinstance(exc, ConditionalPutRefused):  # conditional_put "always": not transient
            self(what, f"{self._where}: conditional PUT not implemented ({exc}); conditional_put is always")
        elif isinstance(exc, RemoteError):  # refused for what it is (too large for the buffer, ...)
            self(what, f"{self._where}: {type(exc).__name__} ({exc})")
        else:
            logger.error("shared tier: %s", what, exc_info=exc)
