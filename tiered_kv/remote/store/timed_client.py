"""Per-request latency of the shared tier: an ``ObjectClient`` that times another.

Runs wherever a ``RemoteStore`` does (the scheduler for probes and verification
downloads, each worker for its rank's uploads and loads), on the store's request
threads. No I/O of its own: each call is the wrapped client's request, timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from tiered_kv.metrics import REMOTE_REQUEST_SECONDS, Latencies
from tiered_kv.remote.store.client import Buffer, ObjectClient, RemoteError, Tagged


class TimedClient:
    """``inner``'s requests, each one's seconds observed in ``latencies`` as
    ``REMOTE_REQUEST_SECONDS`` with its op (``put``, ``get``, ``head``, ``delete``),
    whether it succeeded or raised. Listing is not timed; any other attribute is
    ``inner``'s."""

    def __init__(self, inner: ObjectClient, latencies: Latencies):
        self.inner = inner
        self.latencies = latencies

    def _timed(self, op: str, call: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.latencies.observe(REMOTE_REQUEST_SECONDS, (op,), time.perf_counter() - start)

    def put_new(self, key: str, parts: Sequence[Buffer]) -> bool:
        return self._timed("put", self.inner.put_new, key, parts)

    def put(self, key: str, parts: Sequence[Buffer]) -> None:
        self._timed("put", self.inner.put, key, parts)

    def get(self, key: str, size: int | None = None, limit: int | None = None) -> Buffer | None:
        return self._timed("get", self.inner.get, key, size, limit)

    def get_tagged(self, key: str, size: int | None = None, limit: int | None = None) -> Tagged | None:
        return self._timed("get", self.inner.get_tagged, key, size, limit)

    def get_many(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Buffer | None | RemoteError]:
        """``inner``'s ``BatchGet.get_many``: one request, timed as one ``get``."""
        return self._timed("get", self.inner.get_many, keys, sizes)  # type: ignore[attr-defined]

    def replace(self, key: str, parts: Sequence[Buffer], tag: str | None) -> bool:
        return self._timed("put", self.inner.replace, key, parts, tag)

    def exists(self, key: str) -> bool:
        return self._timed("head", self.inner.exists, key)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """``inner``'s ``BatchProbe.exists_many``: one request, timed as one ``head``."""
        return self._timed("head", self.inner.exists_many, keys)  # type: ignore[attr-defined]

    def delete(self, key: str) -> None:
        self._timed("delete", self.inner.delete, key)

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
