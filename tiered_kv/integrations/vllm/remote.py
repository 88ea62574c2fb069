"""The shared tier (S3-compatible object storage) under vLLM 0.33: its scheduler side.

Runs in the scheduler process. ``build_remote`` opens the scheduler's ``RemoteStore``
(the start-up check: one PUT of the namespace manifest and one GET, raising
``RemoteSetupError`` naming endpoint and bucket on wrong credentials or a missing
bucket) and the tier's ``RemoteOffloadingManager``, which answers membership from
memory and probes the bucket (HEAD requests) on the store's threads.

``RemoteVerifier`` is what keeps a failed download from ever being reported to vLLM
as a hit (vLLM's worker connector asserts every load succeeded, and a load cannot be
undone once the request runs on it): before a chunk only the bucket holds is a HIT,
every rank's object of it is downloaded here, into scratch memory, and its header
(fingerprint, block hash, rank, size) and checksum are verified, on the store's
threads. A chunk that fails is a miss for ``absent_ttl`` (a damaged object is deleted
by the store). The price is a second download of each remote hit (the workers then
read their own rank's object into the CPU tier or the KV cache, verifying it again);
what is left is an object lost between the two reads, which the worker logs as an
error naming the job. Scratch memory is bounded (``VERIFY_BYTES``): past it a chunk
waits for its turn (the lookup stays pending).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np

from tiered_kv.abstract import Closing
from tiered_kv.integrations.vllm.geometry import VllmGeometry
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.remote.store import RemoteStore
from tiered_kv.remote.tier import REMOTE, RemoteOffloadingManager

logger = logging.getLogger(__name__)

#: Scratch memory of the chunks being verified at once (every rank's object of each).
VERIFY_BYTES = 256 << 20


def remote_write_policy(remote: RemoteConfig) -> str:
    """The composite's policy for the shared tier: ``write_through`` shares every chunk
    the node stores; ``evictions`` only the chunks the local tiers evict."""
    return "write_back" if remote.write_policy == "evictions" else "write_through"


def build_remote(
    remote: RemoteConfig, geometry: VllmGeometry, enable_events: bool
) -> tuple[RemoteOffloadingManager, "RemoteVerifier"]:
    """The shared tier's manager and verifier over one scheduler-side store (closed by
    the manager's ``shutdown``). Raises ``RemoteSetupError`` (see module docstring)."""
    store = RemoteStore(remote, geometry.fingerprint)
    manager = RemoteOffloadingManager(
        store, block_size=geometry.tokens_per_chunk, name="remote", medium=REMOTE, enable_events=enable_events
    )
    return manager, RemoteVerifier(store, geometry.world_size, geometry.bytes_per_chunk)


class RemoteVerifier(Closing):
    """Downloads and verifies every rank's object of a chunk (see module docstring).

    ``submit`` never waits; ``results`` hands back ``(key, ok)`` pairs on the caller's
    thread; ``busy`` says whether some are still being read."""

    def __init__(self, store: RemoteStore, world_size: int, bytes_per_chunk: int, budget_bytes: int = VERIFY_BYTES):
        self.store = store
        self.world_size = world_size
        self.bytes_per_chunk = bytes_per_chunk
        self.max_in_flight = max(1, budget_bytes // max(1, world_size * bytes_per_chunk))
        self._lock = threading.Condition()
        self._in_flight: set[bytes] = set()
        self._done: deque[tuple[bytes, bool]] = deque()
        self._closed = False

    def submit(self, key: bytes) -> bool:
        """Start verifying ``key``; False when the scratch bound is reached (ask again)."""
        with self._lock:
            if self._closed or key in self._in_flight:
                return key in self._in_flight
            if len(self._in_flight) >= self.max_in_flight:
                return False
            self._in_flight.add(key)
        scratch = np.empty((self.world_size, self.bytes_per_chunk), dtype=np.uint8)
        try:
            future = self.store.get_blocks([(key, r, scratch[r]) for r in range(self.world_size)])
        except Exception:
            logger.debug("shared tier: verification of a chunk not sent", exc_info=True)
            self._finish(key, False)
            return True

        def downloaded(f: Future, scratch: np.ndarray = scratch) -> None:  # holds the buffer until then
            self._downloaded(key, f)

        future.add_done_callback(downloaded)
        return True

    def _downloaded(self, key: bytes, future: Future) -> None:
        try:
            ok = all(future.result())
        except Exception:
            ok = False
        self._finish(key, ok)

    def _finish(self, key: bytes, ok: bool) -> None:
        with self._lock:
            self._in_flight.discard(key)
            self._done.append((key, ok))
            self._lock.notify_all()

    def results(self) -> Iterator[tuple[bytes, bool]]:
        while self._done:
            yield self._done.popleft()

    def busy(self) -> bool:
        return bool(self._in_flight or self._done)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no verification is in flight (tests, tools); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._in_flight, timeout)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
