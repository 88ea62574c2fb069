"""The disk I/O process itself: ``python -m tiered_kv.disk.worker.io_server`` (``disk_io: process``).

Runs in the helper process that a worker's ``DiskIOProcess`` (``io_process.py``) starts.
It opens the namespace with ``DiskStore.open`` and runs each batch's calls, in order per
batch, on a thread pool; all the disk I/O of the store happens here (O_DIRECT reads and
writes, checksums, ``fdatasync``, synced index commits; ``store.py``). It reads and
writes block bytes straight in the worker's shared memory, whose regions arrive as
memfds over a second socket. Messages come over a Unix socket and each call gets one
reply; when the worker closes the socket, it commits what is queued and exits. SIGINT
is ignored, so a Ctrl-C meant for the engine does not cut its commits short.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from tiered_kv.disk.store.block_store import BlockBatch, WriteBlockBatch
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.disk.store.write_batch import WriteBatch
from tiered_kv.memory.shared_memory import MappedRegions
from tiered_kv.memory.slot_views import SlotViews

logger = logging.getLogger(__name__)

__all__ = ["IOServer", "Ref", "main", "portable"]

#: Threads of the I/O process running batch calls (each batch's calls run in order).
SERVER_THREADS = 8

#: How a message names a buffer in shared memory: region, offset, shape, byte strides.
Ref = tuple[int, int, tuple[int, ...], tuple[int, ...]]


class IOServer:
    """The I/O process: one ``DiskStore``, batch calls run in order per batch."""

    #: Opened by ``run`` before any message is dispatched.
    store: DiskStore

    def __init__(self, conn: Connection, fds: socket.socket):
        self.conn, self.fds = conn, fds
        self.regions = MappedRegions()
        self.views: dict[int, SlotViews] = {}
        self.batches: dict[int, _SerialCalls] = {}
        self.pool = ThreadPoolExecutor(SERVER_THREADS, thread_name_prefix="tkv-diskio")
        self._send_lock = threading.Lock()

    def reply(self, token: int, ok: bool, value: Any) -> None:
        if not ok:
            value = portable(value)
        with self._send_lock:
            try:
                self.conn.send((token, ok, value))
            except (OSError, ValueError):
                pass  # the worker is gone; nothing to tell

    def run(self) -> None:
        _, kwargs = self.conn.recv()  # ("open", DiskStore.open's keyword arguments)
        try:
            self.store = DiskStore.open(**kwargs)
        except Exception as e:
            self.conn.send(("error", portable(e)))
            return
        s = self.store
        self.conn.send(
            (
                "ready",
                dict(
                    slot_size=s.slot_size,
                    block_bytes=s.block_bytes,
                    tp_size=s.tp_size,
                    checksum_name=s.checksum_name,
                    backend=s.backend.describe(),
                    namespace_path=str(s.namespace.path),
                ),
            )
        )
        close_token = None
        try:
            while close_token is None:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    break
                close_token = self.dispatch(message)
        finally:
            self.pool.shutdown(wait=True)
            self.store.close()
            self.regions.close()
            if close_token is not None:
                self.reply(close_token, True, None)

    def dispatch(self, m: tuple) -> int | None:
        """Handle one message; after ``close``, returns its token."""
        name = m[0]
        if name == "region":
            _, fds, _, _ = socket.recv_fds(self.fds, 1, 1)
            self.regions.add(m[1], fds[0], m[2])
        elif name == "forget":
            self.regions.remove(m[1])
        elif name == "views":
            self.views[m[1]] = SlotViews.from_rows([self.regions.array(*ref) for ref in m[2]])
        elif name == "begin":
            _, bid, kind, rank, hashes, slots = m
            calls = self.batches[bid] = _SerialCalls(self.pool)
            begin = self.store.begin_write if kind == "write" else self.store.begin_read
            calls.post(lambda: calls.start(begin, rank, hashes, slots))
        elif name in ("submit", "submit_slots", "abandon", "finish"):
            token, bid = m[1], m[2]
            calls = self.batches[bid] if name != "finish" else self.batches.pop(bid)
            call = getattr(self, "_" + name)
            calls.post(lambda: self._run_call(token, lambda: call(token, calls.batch, *m[3:])))
        elif name == "log_failed":
            token = m[1]

            def log_failed() -> bool:
                self.store.log_failed(*m[2:])
                return True

            self.pool.submit(self._guarded, token, log_failed)
        elif name == "stats":
            self.reply(m[1], True, self.store.stats.as_dict())
        elif name == "close":
            return m[1]
        else:
            raise ValueError(f"unknown message {name!r}")
        return None

    def _run_call(self, token: int, call: Callable[[], None]) -> None:
        """``call()``, which replies itself; if it raises, reply with the error."""
        try:
            call()
        except Exception as e:
            self.reply(token, False, e)

    def _guarded(self, token: int, call: Callable[[], Any]) -> None:
        try:
            value = call()
        except Exception as e:
            self.reply(token, False, e)
        else:
            self.reply(token, True, value)

    def _when_done(self, token: int, future: Future | None, value: Callable[[Future], Any]) -> None:
        if future is None:  # a failed batch accepts no more I/O
            self.reply(token, True, False)
            return
        future.add_done_callback(lambda f: self._guarded(token, lambda: value(f)))

    def _submit(self, token: int, batch: BlockBatch, start: int, ref: Ref) -> None:
        self._when_done(token, batch.submit(start, self.regions.tensor(*ref)), _chunk_reply(batch))

    def _submit_slots(self, token: int, batch: BlockBatch, start: int, slots: list[int], vid: int) -> None:
        self._when_done(token, batch.submit_slots(start, self.views[vid], slots), _chunk_reply(batch))

    def _abandon(self, token: int, batch: WriteBlockBatch, message: str) -> None:
        batch.abandon(RuntimeError(message))
        self.reply(token, True, None)

    def _finish(self, token: int, batch: BlockBatch) -> None:
        if isinstance(batch, WriteBatch):
            self._when_done(token, batch.finish_async(), lambda f: f.result())
        else:
            self._guarded(token, batch.finish)


def _chunk_reply(batch: BlockBatch) -> Callable[[Future], bool]:
    """What a submitted chunk's reply says: for a write, True (its buffers are free
    again); for a read, whether every block of it was read and verified."""
    if isinstance(batch, WriteBatch):
        return lambda _done: True
    return lambda done: bool(done.result())


def portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling both ways, else a ``RuntimeError`` saying what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class _SerialCalls:
    """One batch's calls, run in the order posted, one at a time, on a shared pool."""

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool = pool
        self._queue: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        self._running = False
        self.batch: BlockBatch | None = None

    def start(self, begin: Callable[..., BlockBatch], *args: object) -> None:
        self.batch = begin(*args)

    def post(self, call: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(call)
            if self._running:
                return
            self._running = True
        self._pool.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                call = self._queue.popleft()
            try:
                call()
            except Exception:
                logger.exception("a disk I/O process call failed")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"tiered-kv disk I/O process {os.getpid()}: %(levelname)s %(name)s: %(message)s",
    )
    conn = Connection(int(argv[1]))
    fds = socket.socket(fileno=int(argv[2]))
    IOServer(conn, fds).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
