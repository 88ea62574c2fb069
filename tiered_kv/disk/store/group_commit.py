"""Group commit of a disk store's index writes: steps 1 and 3 of every store (``store.py``).

Runs wherever a ``DiskStore`` runs (a worker process or its disk I/O process), on one
committer thread per store. Its I/O: one ``fdatasync`` per slab that a queued step 3
wrote to, then one synced LMDB transaction for everything queued
(``DiskIndex.commit_group``); a transaction that fails is retried job by job, and a job
that still cannot commit gets its blocks logged ``failed``.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import lmdb

from tiered_kv.abstract import Closing
from tiered_kv.disk.format.index import DiskIndex
from tiered_kv.disk.format.index_records import StoredBlocks
from tiered_kv.disk.store.io_backends import BackendFile

logger = logging.getLogger(__name__)

__all__ = ["GroupCommitter", "IndexWrite"]


class IndexWrite:
    """One job's queued index write: its step 1 (``clear``) or its step 3. The committer
    sets ``checksums`` entries to None for blocks that did not become durable,
    ``committed`` once the transaction holding it committed, and ``error``; ``wait``
    returns once all of that is settled."""

    __slots__ = ("clear", "rank", "file", "hashes", "slots", "checksums", "committed", "error", "done")

    def __init__(
        self,
        clear: bool,
        rank: int,
        file: BackendFile | None,
        hashes: list[bytes],
        slots: list[int],
        checksums: list[int | None] | None = None,
    ):
        self.clear, self.rank, self.file, self.hashes, self.slots = clear, rank, file, hashes, slots
        self.checksums = list(checksums) if checksums is not None else []
        self.committed = False
        self.error: BaseException | None = None
        self.done: Future = Future()  # result: this write, once settled

    def wait(self) -> "IndexWrite":
        return self.done.result()

    def stored(self, size: int) -> StoredBlocks:
        return StoredBlocks(self.rank, self.hashes, self.slots, [size] * len(self.hashes), self.checksums)

    def durable_writes(self) -> bool:
        return not self.clear and any(c is not None for c in self.checksums)


class GroupCommitter(Closing):
    """Group commit of one store's index writes, all ranks (see ``store.py``'s docstring).

    ``clear`` and ``commit`` queue a write and return it at once; its owner ``wait``s
    before relying on it. One committer thread (started on first use) takes everything
    queued while it was busy as the next group: it syncs and commits the group and
    wakes the owners. A clear therefore runs while its job packs its first rows, and
    jobs that finish together share one ``fdatasync`` and one transaction. Failures stay
    per job: a failed ``fdatasync`` fails the commits of that slab only, and a
    transaction that fails is retried job by job, so one job's bad write can neither
    fail nor commit another's.
    """

    def __init__(self, sync: Callable[[BackendFile], None], index: DiskIndex, block_bytes: int):
        # ``sync``, not a backend: the store's backend may be swapped under it (faults).
        self._sync, self._index, self._block_bytes = sync, index, block_bytes
        self._cond = threading.Condition()
        self._queue: list[IndexWrite] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def clear(self, rank: int, hashes: list[bytes], slots: list[int]) -> IndexWrite:
        """Queue step 1 for one job. Its slots may be overwritten only once ``wait()``
        returned with no ``error``."""
        return self._enqueue(IndexWrite(True, rank, None, hashes, slots))

    def commit(
        self, rank: int, file: BackendFile | None, hashes: list[bytes], slots: list[int], checksums: list[int | None]
    ) -> IndexWrite:
        """Queue step 3 for one job (blocks with a None checksum are logged failed)."""
        return self._enqueue(IndexWrite(False, rank, file, hashes, slots, checksums))

    def close(self) -> None:
        """Commit what is queued, then stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _enqueue(self, req: IndexWrite) -> IndexWrite:
        with self._cond:
            if self._closed:
                req.error = RuntimeError("disk store is closed")
                req.checksums = [None] * len(req.checksums)
                req.done.set_result(req)
                return req
            self._queue.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tkv-disk-commit", daemon=True)
                self._thread.start()
            self._cond.notify()
        return req

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                group, self._queue = self._queue, []
            try:
                self._lead(group)
            finally:
                for r in group:
                    r.done.set_result(r)

    def _lead(self, group: list[IndexWrite]) -> None:
        try:
            # Durability first: one fdatasync per slab covers every queued job's writes.
            files: dict[int, tuple[BackendFile, list[IndexWrite]]] = {}
            for r in group:
                if r.durable_writes() and r.file is not None:
                    files.setdefault(id(r.file), (r.file, []))[1].append(r)
            for f, reqs in files.values():
                try:
                    self._sync(f)
                except OSError as e:
                    for r in reqs:
                        r.error = e
                        r.checksums = [None] * len(r.hashes)
            self._transact(group)
        except Exception as e:  # never leave a waiting job without an outcome
            logger.exception("disk index group commit failed")
            for r in group:
                if not r.committed:
                    r.error = r.error or e
                    r.checksums = [None] * len(r.checksums)

    def _transact(self, group: list[IndexWrite]) -> None:
        try:
            self._index.commit_group(
                [r.stored(self._block_bytes) for r in group if not r.clear],
                [(r.rank, r.hashes, r.slots) for r in group if r.clear],
            )
        except lmdb.Error as e:
            if len(group) > 1:  # find the job(s) that cannot commit; the others still do
                for r in group:
                    self._transact([r])
                return
            r = group[0]
            r.error = r.error or (
                OSError(errno.ENOSPC, f"index commit failed: {e}")
                if "No space" in str(e)
                else RuntimeError(f"index commit failed: {e}")
            )
            if not r.clear:
                r.checksums = [None] * len(r.hashes)
                self._index.log_failed(r.rank, r.hashes, r.slots)
            return
        for r in group:
            r.committed = True
