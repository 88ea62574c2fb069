"""A worker's disk I/O in a helper process of its own, off the worker's GIL.

``DiskIOProcess`` is a ``DiskStore`` for the disk handlers (``begin_write``,
``begin_read``, batches with ``submit``/``submit_slots``/``finish_async``...) whose
store really runs in a child process that it starts: the O_DIRECT reads and writes,
the checksums, the ``fdatasync`` and the synced index commits all happen there, so the
worker's own Python (its model runner) neither waits for them nor is slowed by them.
In the worker, a batch costs a few small messages; in one process, every I/O, checksum
and commit step needs the worker's GIL back, so a busy thread and the disk pipeline
slow each other down (docs/benchmarks.md, "Disk tier", thread vs process beside a busy
thread).

Which process does what:

- Worker (``DiskIOProcess``, ``_HelperBatch``): sends each batch's calls over a Unix
  socket, in order, and resolves futures from the replies. Block bytes never cross the
  socket: every buffer a batch names (the CPU tier, the staging buffers) must be
  shared memory (``tiered_kv.memory.shared_memory``; ``host_buffer`` allocates it), and
  travels as ``(region, offset, shape, strides)``. A region's memfd is sent once, over
  a second socket, before the first message that names it.
- I/O process (``IOServer``, ``python -m tiered_kv.disk.worker.io_server``; ``io_server.py``):
  opens the namespace with ``DiskStore.open`` (same arguments, same checks and errors)
  and runs each batch's calls in order on a thread pool, against the same shared
  memory. What is durable when, and the order of data, ``fdatasync`` and index
  commits, are exactly the store's (``store.py``): this module only moves where it runs.

Faults: if the I/O process dies (killed, out of memory), every batch in flight fails
(writes: every block logged failed or never committed, so never loadable; reads:
failed, so the engine recomputes), it is logged and counted in ``process_failures``,
and the next batch starts a new process. A worker that dies closes the socket; the I/O
process then commits what it has queued and exits. The I/O process ignores SIGINT, so
a Ctrl-C meant for the engine does not cut its commits short.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from tiered_kv.config_values import DEFAULT_CHECKSUM, DEFAULT_IO_THREADS
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.worker.io_server import Ref
from tiered_kv.disk.store.store import BlockIO, DiskStoreStats
from tiered_kv.memory.shared_memory import SharedRegion, empty_shared, locate, on_free, region_fd
from tiered_kv.memory.slot_views import SlotViews
from tiered_kv.kv_layout import KVCacheLayout

logger = logging.getLogger(__name__)

__all__ = ["DiskIOProcess"]

#: Seconds to wait for the I/O process to open the store, and to close it.
START_TIMEOUT = 120.0
CLOSE_TIMEOUT = 60.0
#: After a start that failed, batches fail at once for this long before the next try.
RESTART_BACKOFF = 5.0
_DIED = object()  # what a call returns when the I/O process is gone before it replied


class _HelperBackend:
    """What the handlers read of ``store.backend``: buffers are host memory only."""

    gds = False
    device_buffers = False

    def __init__(self, description: str):
        self._description = description

    def describe(self) -> str:
        return f"{self._description}, in a helper process"


class _Child:
    """One I/O process and its two sockets."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, fds: socket.socket, generation: int):
        self.proc, self.conn, self.fds, self.generation = proc, conn, fds, generation
        self.regions: set[int] = set()  # shared regions sent to it
        self.views: dict[int, int] = {}  # id(SlotViews) -> id sent to it
        self.alive = True


class DiskIOProcess(BlockIO):
    """A ``DiskStore`` (for the disk handlers) running in a child process; see the
    module docstring. Thread-safe. Open it with ``DiskIOProcess.open``. Its
    ``write_blocks``/``read_blocks`` need rows in shared memory (``host_buffer``)."""

    def __init__(self, open_kwargs: dict[str, Any]):
        self._open_kwargs = open_kwargs
        self._lock = threading.Lock()  # the child, and sends on its sockets
        self._pending_lock = threading.Lock()  # never held while sending: the reply reader takes it
        self._pending: dict[int, tuple[Future, Any, int]] = {}  # token -> (future, value on death, generation)
        self._tokens = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._views_keep: dict[int, SlotViews] = {}  # keeps registered views (and their ids) alive
        self._freed: deque[int] = deque()  # regions freed here, to be unmapped there
        # Writes to log failed that no process could take (one died, or a start is
        # backing off): sent to the next one first, or their slots would stay pending.
        # Bounded by the tier's slots: a slot stays pending, never written again, until
        # its failure is logged.
        self._unlogged: deque[tuple] = deque()
        on_free(self._region_freed)
        self._child: _Child | None = None
        self._failed_start_at = 0.0
        self._closed = False
        #: Calls failed because the I/O process died or could not start (logged).
        self.process_failures = 0
        self.restarts = 0
        info = self._start()
        self.slot_size: int = info["slot_size"]
        self.block_bytes: int = info["block_bytes"]
        self.tp_size: int = info["tp_size"]
        self.checksum_name: str = info["checksum_name"]
        self.namespace_path: str = info["namespace_path"]
        self.backend = _HelperBackend(info["backend"])

    @property
    def pid(self) -> int | None:
        """The running I/O process's pid (None when there is none)."""
        child = self._child
        return child.proc.pid if child is not None and child.alive else None

    @classmethod
    def open(
        cls,
        cache_dir: str | os.PathLike,
        fingerprint: Fingerprint,
        layout: KVCacheLayout,
        *,
        disk_bytes: int,
        checksum: str = DEFAULT_CHECKSUM,
        io_backend: str = "auto",
        io_threads: int = DEFAULT_IO_THREADS,
        engine_id: str | None = None,
    ) -> "DiskIOProcess":
        """``DiskStore.open`` in a new I/O process (same arguments, same errors, raised
        here). ``io_backend`` must be a name: a backend object cannot cross processes."""
        if not isinstance(io_backend, str):
            raise TypeError(f"io_backend: expected a backend name for the I/O process, got {io_backend!r}")
        return cls(
            dict(
                cache_dir=os.fspath(cache_dir),
                fingerprint=fingerprint,
                layout=layout,
                disk_bytes=disk_bytes,
                checksum=checksum,
                io_backend=io_backend,
                io_threads=io_threads,
                engine_id=engine_id,
            )
        )

    # ------------------------------------------------------------ process

    def _start(self) -> dict[str, Any]:
        """Start an I/O process and open the store there; returns what it reported."""
        ours, theirs = socket.socketpair()
        our_fds, their_fds = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tiered_kv.disk.worker.io_server",
                    str(theirs.fileno()),
                    str(their_fds.fileno()),
                ],
                pass_fds=(theirs.fileno(), their_fds.fileno()),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
            their_fds.close()
        conn = Connection(ours.detach())
        try:
            conn.send(("open", self._open_kwargs))
            if not conn.poll(START_TIMEOUT):
                raise RuntimeError(f"the disk I/O process did not open the store in {START_TIMEOUT:.0f} s")
            kind, payload = conn.recv()
        except (EOFError, OSError, RuntimeError) as e:
            conn.close()
            our_fds.close()
            proc.kill()
            proc.wait()
            if isinstance(e, RuntimeError):
                raise
            raise RuntimeError(
                f"the disk I/O process exited while opening the store (exit code {proc.returncode})"
            ) from e
        if kind == "error":
            conn.close()
            our_fds.close()
            proc.wait()
            raise payload
        child = _Child(proc, conn, our_fds, next(self._generations))
        self._child = child
        threading.Thread(target=self._read_replies, args=(child,), name="tkv-diskio-replies", daemon=True).start()
        logger.info("disk I/O process %d serves %s (%s)", proc.pid, payload["namespace_path"], payload["backend"])
        return payload

    def _live_child(self) -> _Child | None:
        """The running I/O process, started again if it died (under ``_lock``); None
        while a failed start is backing off."""
        child = self._child
        if child is not None and child.alive:
            return child
        if self._closed or time.monotonic() - self._failed_start_at < RESTART_BACKOFF:
            return None
        try:
            self._start()
        except Exception:
            logger.exception("restarting the disk I/O process failed; disk transfers fail for %.0f s", RESTART_BACKOFF)
            self._failed_start_at = time.monotonic()
            return None
        self.restarts += 1
        return self._child

    def _read_replies(self, child: _Child) -> None:
        while True:
            try:
                token, ok, value = child.conn.recv()
            except (EOFError, OSError):
                break
            with self._pending_lock:
                entry = self._pending.pop(token, None)
            if entry is None:
                continue
            if ok:
                entry[0].set_result(value)
            else:
                entry[0].set_exception(value)
        self._lost(child)

    def _lost(self, child: _Child) -> None:
        """The I/O process is gone: fail what it had in flight."""
        with self._lock:
            child.alive = False
            closing = self._closed
            with self._pending_lock:
                tokens = [t for t, e in self._pending.items() if e[2] == child.generation]
                dead = [self._pending.pop(t) for t in tokens]
            if not closing:
                self.process_failures += len(dead)
        child.conn.close()
        child.fds.close()
        code = child.proc.wait()
        if not closing:
            logger.error(
                "the disk I/O process %d exited (code %s) with %d calls in flight; they fail, "
                "and the next disk transfer starts a new one",
                child.proc.pid,
                code,
                len(dead),
            )
        for future, on_death, _ in dead:
            future.set_result(on_death)

    def _call(
        self, message: tuple, on_death: Any, child: _Child | None = None, refs: Callable[[_Child], tuple] = lambda c: ()
    ) -> Future:
        """Send ``message`` (its token is added after the name, ``refs(child)`` at the
        end) to ``child`` (default: the running process, started if needed); the future
        gets the reply, or ``on_death`` if the process is gone before replying."""
        future: Future = Future()
        with self._lock:
            child = child if child is not None else self._live_child()
            if child is None or not child.alive:
                self.process_failures += 1
                future.set_result(on_death)
                return future
            token = next(self._tokens)
            self._send_freed(child)
            while self._unlogged and self._send(
                child, (self._unlogged[0][0], next(self._tokens)) + self._unlogged[0][1:]
            ):
                self._unlogged.popleft()
            try:  # may send regions and views first; ValueError (not shared memory) propagates
                message = (message[0], token) + message[1:] + refs(child)
            except OSError:
                future.set_result(on_death)
                return future
            with self._pending_lock:
                self._pending[token] = (future, on_death, child.generation)
            if not self._send(child, message):
                with self._pending_lock:
                    self._pending.pop(token, None)
                future.set_result(on_death)
        return future

    def _send(self, child: _Child, message: tuple) -> bool:
        """Send on ``child``'s socket (under ``_lock``); False if it is gone."""
        try:
            child.conn.send(message)
            return True
        except (OSError, ValueError):  # ValueError: the connection was closed
            return False

    def _region_freed(self, region_id: int) -> None:
        self._freed.append(region_id)  # no lock: this may run inside any of ours

    def _send_freed(self, child: _Child) -> None:
        """Let ``child`` unmap the regions freed here that it has (under ``_lock``), so
        staging buffers that come and go do not pile up there."""
        while self._freed:
            region_id = self._freed.popleft()
            if region_id in child.regions:
                child.regions.discard(region_id)
                self._send(child, ("forget", region_id))

    def _share(self, child: _Child, region_id: int, nbytes: int) -> None:
        """Send region ``region_id`` to ``child`` unless it has it (under ``_lock``)."""
        if region_id in child.regions:
            return
        socket.send_fds(child.fds, [b"r"], [region_fd(region_id)])
        child.conn.send(("region", region_id, nbytes))
        child.regions.add(region_id)

    def _ref(self, child: _Child, t: torch.Tensor | np.ndarray) -> Ref:
        """How ``child`` finds ``t``'s bytes (under ``_lock``). Raises ``ValueError``
        unless it is a uint8 host array or tensor in one shared region."""
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise ValueError(f"the disk I/O process needs host buffers; got one on {t.device}")
        a = t.numpy() if isinstance(t, torch.Tensor) else t
        if a.dtype != np.uint8:
            raise ValueError(f"the disk I/O process needs uint8 buffers; got {a.dtype}")
        found = _located(a)
        if found is None:
            raise ValueError(
                "a buffer handed to the disk I/O process is not in shared memory; "
                "allocate it with store.host_buffer (or a HostKVCache with shared=True)"
            )
        region, offset = found
        self._share(child, region.id, region.nbytes)
        return region.id, offset, tuple(a.shape), tuple(a.strides)

    def _views_id(self, child: _Child, views: SlotViews) -> int:
        """The id under which ``child`` knows ``views`` (sent on first use; under ``_lock``)."""
        vid = child.views.get(id(views))
        if vid is None:
            vid = len(child.views) + 1
            refs = [self._ref(child, rows) for rows in views.rows]
            child.conn.send(("views", vid, refs))
            child.views[id(views)] = vid
            self._views_keep[id(views)] = views
        return vid

    # ------------------------------------------------------------ DiskStore API

    def takes_slots(self, views: SlotViews) -> bool:
        """As ``DiskStore.takes_slots``, and only for views of shared memory."""
        return views.slot_bytes == self.block_bytes and all(_located(rows) is not None for rows in views.rows)

    def host_buffer(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        """Shared host memory (page-locked when ``pin``) that the I/O process can reach."""
        return empty_shared(nbytes, pin=pin)

    def begin_write(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> "_HelperBatch":
        return _HelperBatch(self, "write", rank, list(hashes), [int(s) for s in slots])

    def begin_read(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> "_HelperBatch":
        return _HelperBatch(self, "read", rank, list(hashes), [int(s) for s in slots])

    def log_failed(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """As ``DiskStore.log_failed``. Where no I/O process takes it now, it is queued
        for the next one to start (logged; never lost: the manager would keep the slots)."""
        message = ("log_failed", rank, list(hashes), [int(s) for s in slots])
        if not self._call(message, False).result():
            logger.warning("no disk I/O process to log %d failed writes; the next one logs them", len(hashes))
            with self._lock:
                self._unlogged.append(message)

    @property
    def stats(self) -> DiskStoreStats:
        """The I/O process's store counters (zeros while it is not running)."""
        counts = self._call(("stats",), None).result(timeout=CLOSE_TIMEOUT)
        return DiskStoreStats(**counts) if counts else DiskStoreStats()

    def close(self) -> None:
        """Commit what is queued, stop the I/O process and wait for it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            child = self._child
        if child is None or not child.alive:
            return
        done = self._call(("close",), None, child)
        try:
            done.result(timeout=CLOSE_TIMEOUT)
        except TimeoutError:
            logger.error("the disk I/O process %d did not close in %.0f s; killing it", child.proc.pid, CLOSE_TIMEOUT)
            child.proc.kill()
        child.proc.wait()


def _located(a: np.ndarray) -> tuple[SharedRegion, int] | None:
    """``locate`` of every byte ``a`` spans (its strides included)."""
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, a.strides)) if a.size else 0
    return locate(a.ctypes.data, span)


class _HelperBatch:
    """A ``WriteBatch`` or ``ReadBatch`` whose calls run in the I/O process, in order."""

    def __init__(self, proc: DiskIOProcess, kind: str, rank: int, hashes: list[bytes], slots: list[int]):
        if len(hashes) != len(slots):
            raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots; expected one slot per hash")
        self._proc, self._kind = proc, kind
        self._rank, self._hashes, self._slots = rank, hashes, slots
        self._futures: list[Future] = []
        self._id = next(proc._batch_ids)
        with proc._lock:
            child = proc._live_child()
            if child is not None and not proc._send(child, ("begin", self._id, kind, rank, hashes, slots)):
                child = None
            if child is None:
                proc.process_failures += 1
        self._child = child

    def _do(self, name: str, args: tuple, on_death: Any, refs: Callable[[_Child], tuple] = lambda c: ()) -> Future:
        """Run ``name`` on this batch in the I/O process; ``refs`` adds arguments that
        need the child (buffer references)."""
        if self._child is None:
            future: Future = Future()
            future.set_result(on_death)
            return future
        return self._proc._call((name, self._id) + args, on_death, self._child, refs)

    def submit(self, start: int, rows: torch.Tensor, host_rows: torch.Tensor | None = None) -> Future:
        """As ``WriteBatch.submit`` / ``ReadBatch.submit`` (host rows in shared memory)."""
        if host_rows is not None:
            raise ValueError("the disk I/O process takes host rows only (no host_rows mirror)")
        fut = self._refusing(lambda: self._do("submit", (start,), False, lambda c: (self._proc._ref(c, rows),)))
        self._futures.append(fut)
        return fut

    def submit_slots(self, start: int, views: SlotViews, slots: Sequence[int]) -> Future:
        """As ``WriteBatch.submit_slots`` / ``ReadBatch.submit_slots``."""
        fut = self._refusing(
            lambda: self._do(
                "submit_slots", (start, [int(s) for s in slots]), False, lambda c: (self._proc._views_id(c, views),)
            )
        )
        self._futures.append(fut)
        return fut

    def _refusing(self, submit: Callable[[], Future]) -> Future:
        """``submit()``; a buffer the I/O process cannot reach fails the whole batch
        (as an abandoned one) before the ``ValueError`` goes to the caller."""
        try:
            return submit()
        except ValueError as e:
            self.abandon(e)
            raise

    def wait_idle(self) -> None:
        for f in self._futures:
            f.exception()

    def abandon(self, e: BaseException) -> None:
        self._do("abandon", (f"{type(e).__name__}: {e}",), None)

    def finish_async(self) -> "Future[list[bool]]":
        out: Future = Future()

        def settle(finished: Future) -> None:
            try:
                value = finished.result()
            except Exception as e:  # the I/O process answered with an error: the batch failed
                logger.error(
                    "disk %s batch of %d blocks failed in the I/O process: %s", self._kind, len(self._hashes), e
                )
                value = _DIED
            if value is _DIED:
                if self._kind == "write":
                    self._log_lost_writes()
                value = [False] * len(self._hashes)
            out.set_result(value)

        self._do("finish", (), _DIED).add_done_callback(settle)
        return out

    def _log_lost_writes(self) -> None:
        """The I/O process died before settling this batch's writes: log them failed
        through the next one, so the manager frees their slots (a block whose ``ok``
        was logged before the death stays: the manager ignores a later ``failed``)."""
        self._proc.log_failed(self._rank, self._hashes, self._slots)

    def finish(self) -> list[bool]:
        return self.finish_async().result()
