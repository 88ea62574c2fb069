"""The writer lock of a disk-cache namespace, and who holds it.

The engine's scheduler process takes the lock (an ``flock`` on the namespace's ``lock``
file, with a JSON record of the holder) for the engine's lifetime; its workers, their
disk I/O processes and the inspector read the record and probe the lock; the
inspector's destructive commands take it too. All opens go through the namespace's
directory descriptor (``safe_open``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tiered_kv.disk.format.errors import NamespaceError
from tiered_kv.disk.format.safe_open import open_file, read_file

LOCK = "lock"
_LOCK_RECORD_BYTES = 64 << 10

_T = TypeVar("_T")


class LockedDirectory(Protocol):
    """What the lock needs of a namespace directory (``namespace.Namespace``)."""

    path: Path
    fd: int
    owner: int

    @property
    def lock_path(self) -> Path: ...

    def open_entry(self, name: str, flags: int, create: bool = False) -> int: ...

    def taken(self, thing: _T) -> _T: ...


class CacheLockedError(NamespaceError):
    """Another engine holds the namespace's writer lock; ``holder`` is its lock record."""

    def __init__(self, path: Path, holder: dict[str, Any] | None):
        self.holder = holder or {}
        h = self.holder
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if "started" in h else "?"
        super().__init__(
            f"disk cache {path} is already open for writing by pid {h.get('pid', '?')} on host "
            f"{h.get('host', '?')} (engine {h.get('engine_id', '?')}, since {since}); stop that "
            f"engine, point this one at another disk_path, or open the cache read-only"
        )


class WriterLock:
    """The engine's exclusive claim on a namespace: an ``flock`` on ``lock`` plus a JSON
    record of the holder. Released by ``release()`` or by the kernel when the holder dies
    (a ``kill -9`` leaves no stale lock)."""

    def __init__(self, path: Path, fd: int, record: dict[str, Any]):
        self.path = path
        self._fd: int | None = fd
        self.record = record

    @classmethod
    def acquire(cls, ns: LockedDirectory, engine_id: str, timeout: float = 1.0) -> "WriterLock":
        """Take the lock or raise ``CacheLockedError`` naming the holder. Retries for
        ``timeout`` seconds because workers probe the lock for an instant."""
        path = ns.lock_path
        try:
            fd = ns.open_entry(LOCK, os.O_RDWR, create=True)
        except OSError as e:
            raise NamespaceError(f"cannot open the writer lock {path}: {e.strerror}") from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = read_holder(ns)
                    os.close(fd)
                    raise CacheLockedError(ns.path, holder) from None
                time.sleep(0.02)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "engine_id": engine_id}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return ns.taken(cls(path, fd, record))

    def release(self) -> None:
        """Drop the lock (idempotent). The record is cleared so readers see no holder."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None


def read_holder(ns: LockedDirectory) -> dict[str, Any] | None:
    """The lock record of the current holder, or None if the record is empty/unreadable."""
    try:
        text = read_file(
            LOCK, dir_fd=ns.fd, path=ns.lock_path, limit=_LOCK_RECORD_BYTES, owner=ns.owner, fix_mode=False
        )
        record = json.loads(text) if text.strip() else None
    except (OSError, ValueError, NamespaceError):
        return None
    return record if isinstance(record, dict) else None


def current_holder(ns: LockedDirectory) -> dict[str, Any] | None:
    """The holder's record if some process holds the writer lock now, else None.
    (Probes with a non-blocking flock that is dropped at once.) Raises
    ``CacheEntryError`` when ``lock`` is not the cache's own file."""
    try:
        fd = open_file(LOCK, os.O_RDONLY, path=ns.lock_path, dir_fd=ns.fd, owner=ns.owner, fix_mode=False)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(ns) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_worker_access(ns: LockedDirectory, engine_id: str | None) -> None:
    """Let a worker write only if no engine holds the namespace, or the holder is its own
    engine: same ``engine_id``, or (without an id) the holder is this process or its parent.
    Raises ``CacheLockedError`` otherwise."""
    holder = current_holder(ns)
    if holder is None:
        return
    if engine_id is not None and holder.get("engine_id") == engine_id:
        return
    if engine_id is None and holder.get("pid") in (os.getpid(), os.getppid()):
        return
    if not holder:
        return  # holder still writing its record; it is the engine that just started
    raise CacheLockedError(ns.path, holder)
