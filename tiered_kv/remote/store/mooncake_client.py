"""The shared tier's ``ObjectClient`` over a Mooncake Store (``MooncakeDistributedStore``).

Runs in whichever process opened the tier (the scheduler for membership probes, each
worker for block uploads and downloads); every call is one or two blocking requests to
the Mooncake master (metadata) and to the client holding the object's memory (bytes,
through Mooncake's transfer engine over TCP, or RDMA when ``mooncake_protocol`` says
so), made from the store's thread pool. Needs the ``mooncake`` extra
(``mooncake-transfer-engine-non-cuda``) and Debian's ``libibverbs1`` and ``librdmacm1``.

What a Mooncake Store is, and how each of its traits maps onto the tier's contract:

- Objects live in memory that clients donate (``global_segment_size``) and vanish with
  the donating process. Serving nodes donate nothing by default
  (``mooncake_segment_bytes`` 0); operators run a standalone ``mooncake_client`` to hold
  the pool. A vanished object is a miss.
- A master restart loses every object (its metadata is in memory): misses, never errors.
  While the master is down each request fails after the master client's own RPC timeout
  (about 4 s, not configurable through the Python API) with ``Unavailable``, so the
  store's failure threshold soon stops sending. A master or holder that hangs instead
  holds a call for Mooncake's transfer timeout (about 30 s): the store's deadline
  (``futures.Deadlines``) answers the caller first. Once the master is back, the standalone client
  mounts its memory again and writes succeed. The first request on a connection to the
  old master fails at once (RPC_FAIL, end of file): a failure that fast is sent again
  (``STALE_RETRIES``).
- Mooncake's ``put`` on a key that exists keeps the first value and reports success.
  ``put_new`` therefore asks ``is_exist`` first (False when there) and then puts: two
  nodes racing on a key may both see True, and the pool keeps one of the two objects,
  both valid copies of the block (verified by the store). ``put``, the replacing write
  (of an object the store proved bad), is one ``upsert``; the store reads the key back
  and counts the replacement only once it verifies, since a racing writer may still get
  its value in between.
- A missing key reads as empty bytes or as error -704: a miss (None), not an error.
- One transfer never exceeds the process's local buffer (``mooncake_buffer_bytes``): a
  larger object is refused before it is sent (``ObjectTooLarge``, naming the setting).
  The store bounds a batched read by it too.
- Objects carry the same header as the S3 backend's and are verified by the store before
  a byte is used; ``tenant_id`` (``mooncake_tenant``) separates tenants.
- The metadata server the master runs (``--enable_http_metadata_server``) and the
  transfer engine's listening sockets bind 0.0.0.0 whatever host they are given
  (``mooncake_master`` 0.3.13): keep the pool's network private.
- No listing: a Mooncake Store cannot enumerate keys, so ``list`` raises
  ``ListingUnsupported`` (``tiered-kv inspect --remote`` says so).
- Existence checks and reads go many keys to a request (``exists_many``:
  ``batch_is_exist``; ``get_many``: ``batch_get_into``), so the store probes and reads a
  request's blocks with a request where S3 needs one per object.

Transfers: with ``mooncake_zero_copy`` (the default) a write hands Mooncake pointers to
the caller's buffers (``batch_put_from_multi_buffers``: header and block pieces where
they lie) and a read lands in a per-thread buffer (``get_into``; registered with
``register_buffer`` over RDMA), returned as a view valid until that thread's next
``get`` (the store verifies and copies it out within the same task). Over RDMA the caller's buffers are not
registered, so writes go through ``put_parts`` (the local buffer) there. Without it:
``put_parts`` and ``get``, one copy each way inside Mooncake.

Start-up never waits long for an absent master: its RPC port is probed with
``connect_timeout`` before ``setup`` (which would retry for about 90 s), and a failed
start-up is retried on use at most once per ``unavailable_cooldown``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tiered_kv.remote.store.client import Buffer, RemoteError, RemoteSetupError, Tagged, Unavailable, WrongSize
from tiered_kv.remote.config import RemoteConfig

_INSTALL_HINT = (
    "the mooncake backend needs Mooncake's store: pip install 'tiered-kv[mooncake]' (CPU machines) or "
    "'tiered-kv[mooncake-cuda]', and Debian's libibverbs1 librdmacm1 (apt-get install libibverbs1 librdmacm1)"
)
#: Mooncake's error codes met on the serving path (``mooncake/include/types.h``).
OBJECT_NOT_FOUND = -704
BUFFER_OVERFLOW = -600
RPC_FAIL = -900
#: Attempts of a request whose RPCs fail at once (stale connections after a master restart).
STALE_RETRIES = 8
#: The longest wait between two set-ups that the master answered but that failed (seconds).
SETUP_RETRY_MAX_S = 600.0
#: Answers of a master that is up and refuses this one write (Mooncake 0.3's ``types.h``):
#: no room in the pool, a key another writer holds, a tenant's quota. A dropped upload,
#: never an outage.
PUT_REFUSALS = {
    -200: "NO_AVAILABLE_HANDLE",
    -703: "REPLICA_IS_NOT_READY",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -1700: "TENANT_QUOTA_EXCEEDED",
}
ERROR_NAMES = {**PUT_REFUSALS, -600: "BUFFER_OVERFLOW", -704: "OBJECT_NOT_FOUND", -900: "RPC_FAIL", -901: "RPC_TIMEOUT"}


class ObjectTooLarge(RemoteError):
    """An object larger than the process's Mooncake transfer buffer."""


class ListingUnsupported(RemoteError):
    """A Mooncake Store cannot list its keys."""


def describe(rc: int) -> str:
    return f"mooncake error {rc} ({ERROR_NAMES.get(rc, 'see mooncake types.h')})"


def master_answers(address: str, timeout: float) -> bool:
    """Whether a TCP connection to the master's RPC ``host:port`` opens within ``timeout``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _pointer(buf: Buffer) -> tuple[int, int, np.ndarray]:
    array = np.frombuffer(memoryview(buf), dtype=np.uint8)
    return array.ctypes.data, array.nbytes, array


class MooncakeClient:
    """``ObjectClient`` over a ``MooncakeDistributedStore`` set up from ``config``'s
    ``mooncake_*`` settings. Thread-safe; a context manager."""

    def __init__(self, config: RemoteConfig):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise RemoteSetupError(f"{_INSTALL_HINT} ({type(exc).__name__}: {exc})") from None
        self.config = config
        self._factory = MooncakeDistributedStore
        self._lock = threading.Lock()
        self._local = threading.local()
        self._raw: Any = None
        self._retry_at = 0.0
        self._failed_setups = 0  # in a row, past the master answering
        self._closed = False
        self._rdma = config.mooncake_protocol == "rdma"
        self.setup_error: str | None = None
        try:
            self._store()
        except Unavailable:
            pass  # retried on use; the store's start-up check logs it

    @property
    def raw(self) -> Any:
        """The ``MooncakeDistributedStore`` (set up on first use)."""
        return self._store()

    def _store(self) -> Any:
        raw = self._raw
        if raw is not None:
            return raw
        with self._lock:
            if self._raw is not None:
                return self._raw
            if self._closed:
                raise Unavailable("the Mooncake client is closed")
            if time.monotonic() < self._retry_at:
                raise Unavailable(f"no Mooncake master at {self.config.mooncake_master} ({self.setup_error})")
            c = self.config
            if not master_answers(c.mooncake_master, min(c.connect_timeout, c.request_timeout)):
                self._failed_setup("its RPC port did not accept a connection")
            raw = self._factory()
            rc = raw.setup(
                {
                    "local_hostname": c.mooncake_local_hostname,
                    "metadata_server": c.mooncake_metadata_server,
                    "global_segment_size": c.mooncake_segment_bytes,
                    "local_buffer_size": c.mooncake_buffer_bytes,
                    "protocol": c.mooncake_protocol,
                    "rdma_devices": c.mooncake_rdma_devices,
                    "master_server_addr": c.mooncake_master,
                    "tenant_id": c.mooncake_tenant,
                }
            )
            if rc != 0:
                # Mooncake keeps the sockets of a failed set-up (about 20): each try costs
                # them, so the tries back off, doubling up to SETUP_RETRY_MAX_S.
                self._failed_setups += 1
                why = f"setup returned {describe(rc)}; metadata server {c.mooncake_metadata_server}"
                self._failed_setup(why, backoff=2 ** min(self._failed_setups - 1, 16))
            self._raw, self.setup_error, self._failed_setups = raw, None, 0
            return raw

    def _failed_setup(self, why: str, backoff: float = 1.0) -> None:
        self.setup_error = why
        wait = min(self.config.unavailable_cooldown * backoff, max(SETUP_RETRY_MAX_S, self.config.unavailable_cooldown))
        self._retry_at = time.monotonic() + wait
        raise Unavailable(f"no Mooncake master at {self.config.mooncake_master} ({why})")

    def _call(self, method: Any, *args: Any) -> Any:
        """``method(*args)``, sent again (``STALE_RETRIES`` in all) while it fails with
        RPC_FAIL faster than a connection attempt could time out: pooled connections to a
        master that restarted, each failing once."""
        for _ in range(STALE_RETRIES):
            start = time.monotonic()
            rc = method(*args)
            first = rc[0] if isinstance(rc, list) else rc
            if first != RPC_FAIL or time.monotonic() - start >= self.config.connect_timeout:
                break
        return rc

    def _fits(self, size: int) -> None:
        if size > self.config.mooncake_buffer_bytes:
            raise ObjectTooLarge(
                f"object of {size} bytes exceeds remote.mooncake_buffer_bytes ({self.config.mooncake_buffer_bytes}); "
                "raise it above the block size"
            )

    # -- ObjectClient -----------------------------------------------------------------

    def put_new(self, key: str, parts: Sequence[Buffer]) -> bool:
        """Write unless ``key`` exists (``is_exist``, then a put that keeps any first value)."""
        if self.exists(key):
            return False
        self._put(key, parts)
        return True

    def put(self, key: str, parts: Sequence[Buffer]) -> None:
        """Replace the object at ``key`` in one request (``upsert_parts``: Mooncake's ``put``
        keeps a key's first value), so no reader finds the key missing meanwhile and a failed
        write leaves the object that was there."""
        self._fits(sum(memoryview(p).nbytes for p in parts))
        self._check_put(key, self._call(self._store().upsert_parts, key, *parts))

    def replace(self, key: str, parts: Sequence[Buffer], tag: str | None) -> bool:
        """``put``: Mooncake has no versions to name (``tag`` is always None here)."""
        self.put(key, parts)
        return True

    def get_tagged(self, key: str, size: int | None = None, limit: int | None = None) -> Tagged | None:
        data = self.get(key, size, limit)
        return None if data is None else Tagged(data, None)

    def _put(self, key: str, parts: Sequence[Buffer]) -> None:
        raw = self._store()
        if self.config.mooncake_zero_copy and not self._rdma:
            pointers = [_pointer(p) for p in parts]
            self._fits(sum(n for _, n, _ in pointers))
            ptrs, sizes = [p for p, _, _ in pointers], [n for _, n, _ in pointers]
            rc = self._call(raw.batch_put_from_multi_buffers, [key], [ptrs], [sizes])[0]
        else:
            self._fits(sum(memoryview(p).nbytes for p in parts))
            rc = self._call(raw.put_parts, key, *parts)
        self._check_put(key, rc)

    @staticmethod
    def _check_put(key: str, rc: int) -> None:
        if rc in PUT_REFUSALS:
            raise RemoteError(f"put {key} refused: {describe(rc)}")
        if rc != 0:
            raise Unavailable(f"put {key}: {describe(rc)}")

    def get(self, key: str, size: int | None = None, limit: int | None = None) -> Buffer | None:
        raw = self._store()
        if limit is not None and size is None:  # learn the size first: nothing over the limit is read
            actual = self._call(raw.get_size, key)
            if actual == OBJECT_NOT_FOUND:
                return None
            if actual < 0:
                raise Unavailable(f"get_size {key}: {describe(actual)}")
            if actual > limit:
                raise WrongSize(actual, limit, limit=True)
        if size is None or not self.config.mooncake_zero_copy:
            data = self._call(raw.get, key)
            if not data:  # b'' is Mooncake's answer for a missing key
                return None
            if size is not None and len(data) != size:
                raise WrongSize(len(data), size)
            return data
        self._fits(size)
        buf = self._arena(raw, size)
        rc = self._call(raw.get_into, key, buf.ctypes.data, size)
        if rc == size:
            return memoryview(buf.data)[:size]
        if rc == OBJECT_NOT_FOUND:
            return None
        if rc >= 0:
            raise WrongSize(rc, size)
        if rc == BUFFER_OVERFLOW:  # the object is larger than asked: learn its size
            actual = raw.get_size(key)
            if actual == OBJECT_NOT_FOUND:
                return None
            if actual >= 0:
                raise WrongSize(actual, size)
        raise Unavailable(f"get {key}: {describe(rc)}")

    def get_many(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Buffer | None | RemoteError]:
        """``BatchGet``: one ``batch_get_into`` of every key into this thread's buffer (with
        ``mooncake_zero_copy``), else one ``get_batch`` (copies inside Mooncake)."""
        if len(keys) != len(sizes):
            raise ValueError(f"get_many: {len(keys)} keys and {len(sizes)} sizes")
        if not keys:
            return []
        raw = self._store()
        self._fits(sum(sizes))
        if not self.config.mooncake_zero_copy:
            values = self._call(raw.get_batch, list(keys))
            if len(values) != len(keys):
                raise Unavailable(f"get_batch of {len(keys)} keys: {len(values)} answers")
            return [(v if len(v) == n else WrongSize(len(v), n)) if v else None for v, n in zip(values, sizes)]
        buf = self._arena(raw, sum(sizes))
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        rcs = self._call(raw.batch_get_into, list(keys), [buf.ctypes.data + s for s in starts], list(sizes))
        if len(rcs) != len(keys):
            raise Unavailable(f"batch_get_into of {len(keys)} keys: {len(rcs)} answers")
        view = memoryview(buf.data)
        out: list[Buffer | None | RemoteError] = []
        for key, start, size, rc in zip(keys, starts, sizes, rcs):
            if rc == size:
                out.append(view[start : start + size])
            elif rc == OBJECT_NOT_FOUND:
                out.append(None)
            elif rc >= 0 or rc == BUFFER_OVERFLOW:  # its size is learnt by whoever judges it
                out.append(WrongSize(rc if rc >= 0 else size + 1, size))
            else:
                out.append(Unavailable(f"get {key}: {describe(rc)}"))
        return out

    def _arena(self, raw: Any, size: int) -> np.ndarray:
        """This thread's read buffer, grown to ``size`` bytes; registered with the transfer
        engine over RDMA (TCP transfers reach any address of the process)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < size:
            old, buf = buf, np.empty(max(size, 1 << 20), dtype=np.uint8)
            self._local.buf = buf
            if self._rdma:
                if old is not None:
                    raw.unregister_buffer(old.ctypes.data)
                rc = raw.register_buffer(buf.ctypes.data, buf.nbytes)
                if rc != 0:
                    self._local.buf = None
                    self._local.failed = buf  # held: a later buffer at its address could not register
                    raise Unavailable(f"register_buffer of {buf.nbytes} bytes: {describe(rc)}")
        return buf

    def exists(self, key: str) -> bool:
        rc = self._call(self._store().is_exist, key)
        if rc < 0:
            raise Unavailable(f"is_exist {key}: {describe(rc)}")
        return rc == 1

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """``BatchProbe``: one ``batch_is_exist`` for every key."""
        if not keys:
            return []
        answers = self._call(self._store().batch_is_exist, list(keys))
        if len(answers) != len(keys) or any(rc < 0 for rc in answers):
            bad = next((rc for rc in answers if rc < 0), None)
            raise Unavailable(
                f"batch_is_exist of {len(keys)} keys: {describe(bad) if bad is not None else 'no answer'}"
            )
        return [rc == 1 for rc in answers]

    def delete(self, key: str) -> None:
        rc = self._call(self._store().remove, key, True)
        if rc not in (0, OBJECT_NOT_FOUND):
            raise Unavailable(f"remove {key}: {describe(rc)}")

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        raise ListingUnsupported(f"{self.config.where()}: a Mooncake Store cannot list keys")

    def health(self) -> int:
        """Mooncake's ``health_check``: 0 when the master answers."""
        return self._store().health_check()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            raw, self._raw = self._raw, None
        if raw is not None:
            raw.close()

    def __enter__(self) -> MooncakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
