"""The LMDB environment under a disk index: opening it safely, finding damage, sharing it.

Every process that opens a namespace's index (scheduler, workers, their disk I/O
processes, the inspector) opens its environment here. LMDB opens ``data.mdb`` and
``lock.mdb`` itself, by name; so first the index directory is opened relative to the
namespace directory's descriptor (no symbolic link followed, ``0700``, the cache's
user's), both files are checked with ``lstat`` (regular files of that user, so that
LMDB neither writes through a link nor hangs on a FIFO), and LMDB is given the
directory as ``/proc/self/fd/<descriptor>``, so no rename on the way can redirect it.
It creates its files ``0600``.

A damaged index is found when it is opened: a ``data.mdb`` shorter than its meta page
says (which would otherwise be SIGBUS on the first read), one LMDB refuses, or, for
writers, a page walk (``lmdb_check``: every page header, every branch's children, the
free list) and LMDB's compacting copy to ``/dev/null``. A writer that later meets
damage LMDB reports leaves a ``damaged`` mark in the index directory, so the next
start finds it too. Writers opened with ``repair`` (the engine's scheduler and workers)
move a damaged index aside to ``index.lmdb.corrupt`` and start an empty one, logging
why; the blocks it described are recomputed, and no block is ever served from an index
that cannot be read. Others get ``IndexCorruptError``.

LMDB allows one open environment per path per process, so environments are shared
through a per-process registry (``acquire_env``/``release_env``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from tiered_kv.abstract import Closing
from tiered_kv.disk.format.lmdb_check import LmdbDamage, check_data_file
from tiered_kv.disk.format.safe_open import ANY_OWNER, check_entry, fd_path, open_dir, open_file

logger = logging.getLogger(__name__)

T = TypeVar("T")

DATA = "data.mdb"
LOCK = "lock.mdb"


def _give_to_dir_owner(index_fd: int) -> None:
    """The files LMDB just made as root (an operator's ``inspect verify --repair``) in
    another user's index go to that user, the directory's owner: as root's, the engine
    would refuse them at its next start."""
    owner = os.fstat(index_fd).st_uid
    if os.geteuid() != 0 or owner == 0:
        return
    for name in (DATA, LOCK):
        try:
            if os.stat(name, dir_fd=index_fd, follow_symlinks=False).st_uid == 0:
                os.chown(name, owner, -1, dir_fd=index_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass


#: Left in the index directory by a writer that met damage at run time.
DAMAGE_MARK = "damaged"
QUARANTINE_SUFFIX = ".corrupt"
DB_NAMES = ("blocks", "slots", "log", "meta")
#: LMDB errors that mean the file's contents are damaged, not that the environment
#: (permissions, space, locks) is wrong.
CORRUPTION = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
    lmdb.IncompatibleError,
    lmdb.BadValsizeError,
)
#: Of those, what only damage causes once the environment is open (a bad value size
#: can also be a caller's mistake).
DAMAGE_SEEN = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError)


class IndexCorruptError(RuntimeError):
    """The index at ``path`` cannot be read as an index (``reason`` says why)."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"disk index {path} is damaged: {reason}")


class SharedEnv(Closing):
    """One process's handle on an LMDB environment, shared by every ``DiskIndex`` on it.

    Transactions go through ``run`` so the map can be resized safely: LMDB requires no
    active transaction in the process while ``set_mapsize`` runs.
    """

    def __init__(self, path: Path, readonly: bool, map_size: int, index_fd: int):
        self.path = path
        self.readonly = readonly
        self.refs = 0
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False
        self._closed = False
        self._index_fd = os.dup(index_fd)  # for the damage mark
        self.env = self._open(path, readonly, map_size, index_fd)
        self.dbs: dict[str, Any] = {}
        try:
            if not readonly:
                # Before any named database is opened: opening one reads the main
                # database's pages, which LMDB trusts (a damaged one can abort the process).
                self.walk(index_fd)
            for name in DB_NAMES:
                try:
                    self.dbs[name] = self.env.open_db(name.encode(), create=not readonly)
                except lmdb.NotFoundError:
                    self.dbs[name] = None  # a read-only open of an index never written to
        except CORRUPTION as e:
            self.close()
            raise IndexCorruptError(path, f"{type(e).__name__}: {e}") from e
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the environment and the index directory's descriptor. Idempotent: a
        second close must not close a descriptor number the process has reused since."""
        if self._closed:
            return
        self._closed = True
        self.env.close()
        os.close(self._index_fd)

    def walk(self, index_fd: int) -> None:
        """Raise ``IndexCorruptError`` unless every page is sound, so a damaged page is
        found here, at open, instead of in the middle of serving: the page walk of
        ``lmdb_check`` (every page header, branch, node bound, overflow run and free
        list entry; numpy over the mapped file), of the snapshot of a read transaction
        held meanwhile, so that other processes may write."""
        try:
            os.stat(DAMAGE_MARK, dir_fd=index_fd, follow_symlinks=False)
            raise IndexCorruptError(self.path, f"a process met damage in it while it ran (the '{DAMAGE_MARK}' mark)")
        except FileNotFoundError:
            pass
        try:
            data = os.open(DATA, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=index_fd)
        except FileNotFoundError:
            return  # a read-only open of an index never written to
        try:
            with self.env.begin() as txn:
                if not check_data_file(data, txn.id()):
                    logger.info("disk index %s: writers moved on during the page walk; not checked", self.path)
        except LmdbDamage as e:
            raise IndexCorruptError(self.path, str(e)) from None
        finally:
            os.close(data)

    def check_pages(self) -> None:
        """``walk`` on demand (readers: the inspector). Raises ``IndexCorruptError``."""
        self.walk(self._index_fd)

    def mark_damaged(self, error: BaseException) -> None:
        """Record that ``error`` (LMDB reporting damage) happened in this index, so the
        next start moves it aside (best effort; logged)."""
        if self.readonly:
            return
        try:
            os.close(
                open_file(DAMAGE_MARK, os.O_WRONLY, path=self.path / DAMAGE_MARK, dir_fd=self._index_fd, create=True)
            )
            logger.error(
                "disk index %s is damaged (%s: %s); it is moved aside and started empty at the next start",
                self.path,
                type(error).__name__,
                error,
            )
        except OSError as e:
            logger.error("disk index %s is damaged (%s) and the mark could not be left: %s", self.path, error, e)

    @staticmethod
    def _open(path: Path, readonly: bool, map_size: int, index_fd: int) -> lmdb.Environment:
        kwargs: dict[str, Any] = dict(
            subdir=True,
            max_dbs=8,
            readonly=readonly,
            create=not readonly,
            mode=0o600,
            readahead=False,
            meminit=False,
            max_readers=1022,
        )
        where = fd_path(index_fd) or str(path)
        try:
            if os.stat(DATA, dir_fd=index_fd).st_size == 0:
                # LMDB starts such a file afresh. Not an error: a peer creating the index
                # this instant shows the same (LMDB's own lock orders the two).
                logger.warning("disk index %s: data.mdb is empty (truncated?); it starts empty", path)
        except FileNotFoundError:
            pass
        try:
            if readonly:
                try:
                    # Without lock.mdb no engine has the index open (a writer keeps it), and
                    # an inspector must not make it: as another user (root) it would be
                    # theirs, and the engine would refuse it at its next start.
                    locked = os.path.exists(os.path.join(where, LOCK))
                    env = lmdb.open(where, lock=locked, **kwargs)
                except CORRUPTION:
                    raise
                except lmdb.Error as e:
                    # The lock file is not writable (e.g. a read-only mount): read without
                    # the reader table, which is only safe while no engine writes.
                    logger.warning(
                        "opening %s read-only without locking (%s); results may be "
                        "inconsistent if an engine is writing",
                        path,
                        e,
                    )
                    env = lmdb.open(where, lock=False, **kwargs)
            else:
                env = lmdb.open(where, map_size=map_size, **kwargs)
                _give_to_dir_owner(index_fd)
        except CORRUPTION as e:
            raise IndexCorruptError(path, f"{type(e).__name__}: {e}") from e
        try:
            _check_not_truncated(env, path, index_fd)
            if not readonly:
                env.reader_check()  # clear reader slots of processes that died (kill -9)
        except BaseException:
            env.close()
            raise
        return env

    def run(self, fn: Callable[[lmdb.Transaction], T], write: bool = False) -> T:
        """Run ``fn(txn)`` in a transaction (committed if ``write``), retrying after
        adopting a grown map (``MDB_MAP_RESIZED``) or growing a full one (writers). An
        error that means damage leaves the damage mark (``mark_damaged``) and is raised."""
        while True:
            self._enter()
            try:
                with self.env.begin(write=write) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                grow = False
            except lmdb.MapFullError:
                if not write:
                    raise
                grow = True
            except DAMAGE_SEEN as e:
                self.mark_damaged(e)
                raise
            finally:
                self._exit()
            self._resize(grow)

    def _enter(self) -> None:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1

    def _exit(self) -> None:
        with self._cond:
            self._active -= 1
            if self._active == 0:
                self._cond.notify_all()

    def _resize(self, grow: bool) -> None:
        with self._cond:
            if self._resizing:  # another thread is on it; wait and retry with its result
                while self._resizing:
                    self._cond.wait()
                return
            self._resizing = True  # new transactions wait from here on
            while self._active:
                self._cond.wait()
        try:
            if grow:
                new = self.env.info()["map_size"] * 2
                logger.info("LMDB index %s is full; growing the map to %d MiB", self.path, new >> 20)
                self.env.set_mapsize(new)
            else:
                self.env.set_mapsize(0)  # adopt the size another process grew it to
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


def _check_not_truncated(env: lmdb.Environment, path: Path, index_fd: int) -> None:
    """Raise ``IndexCorruptError`` if ``data.mdb`` ends before the last page its meta
    page records. Both numbers come from the meta pages and ``stat``, never from the
    map: reading a page past the end of the file is SIGBUS. (A writer extends the file
    before it publishes a meta page naming the new pages, so a live index never fails.)"""
    pages = env.info()["last_pgno"] + 1
    need = pages * env.stat()["psize"]
    size = os.stat(DATA, dir_fd=index_fd).st_size
    if size < need:
        raise IndexCorruptError(path, f"data.mdb is truncated: {size} bytes, but its {pages} pages need {need}")


_registry: dict[str, SharedEnv] = {}
_registry_lock = threading.Lock()


def acquire_env(
    path: Path, readonly: bool, map_size: int, repair: bool = False, dir_fd: int | None = None, owner: int | None = None
) -> SharedEnv:
    """This process's environment of the index at ``path`` (opened if it is the first
    user). ``dir_fd`` is the descriptor of the directory holding it (the namespace's;
    opened from ``path`` when None), ``owner`` the uid its files must belong to
    (default: this process's for writers, the directory's for readers). Raises
    ``FileNotFoundError`` (read-only, no index yet), ``IndexCorruptError`` or
    ``CacheEntryError``."""
    key = os.path.realpath(path)
    with _registry_lock:
        shared = _registry.get(key)
        if shared is not None and shared.readonly and not readonly:
            raise RuntimeError(
                f"LMDB index {path} is already open read-only in this process; "
                f"close the read-only handles before opening it for writing"
            )
        if shared is None:
            parent = dir_fd if dir_fd is not None else os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if owner is None:
                    owner = ANY_OWNER if readonly else os.geteuid()
                if owner == ANY_OWNER:
                    owner = os.fstat(parent).st_uid
                seen = _inode(path.name, parent)
                try:
                    shared = _open_shared(path, readonly, map_size, parent, owner)
                except IndexCorruptError as e:
                    if readonly or not repair:
                        raise
                    shared = _rebuild(path, map_size, e, seen, parent, owner)
            finally:
                if dir_fd is None:
                    os.close(parent)
            _registry[key] = shared
        shared.refs += 1
        return shared


def release_env(shared: SharedEnv) -> None:
    with _registry_lock:
        shared.refs -= 1
        if shared.refs == 0:
            _registry.pop(os.path.realpath(shared.path), None)
            shared.close()


def _open_shared(path: Path, readonly: bool, map_size: int, parent: int, owner: int) -> SharedEnv:
    """Open the index directory ``path.name`` in ``parent`` (created ``0700`` for
    writers), check LMDB's files in it, and open the environment there."""
    try:
        index_fd = open_dir(
            path.name, path=path, dir_fd=parent, owner=owner, create=not readonly, fix_mode=not readonly
        )
    except FileNotFoundError:
        raise FileNotFoundError(f"no LMDB index at {path}") from None
    try:
        for name in (DATA, LOCK):
            st = check_entry(name, dir_fd=index_fd, path=path / name, owner=owner)
            if st is not None and st.st_mode & 0o077 and not readonly:
                os.close(open_file(name, os.O_RDONLY, path=path / name, dir_fd=index_fd, owner=owner))
            if st is None and name == DATA and readonly:
                raise FileNotFoundError(f"no LMDB index at {path}")
        return SharedEnv(path, readonly, map_size, index_fd)
    finally:
        os.close(index_fd)


def _inode(name: str, parent: int) -> int | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return None


def _rebuild(
    path: Path, map_size: int, damage: IndexCorruptError, seen: int | None, parent: int, owner: int
) -> SharedEnv:
    """Move the damaged index (directory inode ``seen``) aside and open an empty one in
    its place. Serialised between processes by a lock file next to it; a process that
    finds the index already replaced (by a peer that saw the same damage) opens the
    replacement instead."""
    name = f".{path.name}.repair"
    fd = open_file(name, os.O_RDWR, path=path.parent / name, dir_fd=parent, owner=owner, create=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _inode(path.name, parent) == seen:
            aside = path.name + QUARANTINE_SUFFIX
            shutil.rmtree(aside, dir_fd=parent, ignore_errors=True)
            os.rename(path.name, aside, src_dir_fd=parent, dst_dir_fd=parent)
            os.fsync(parent)
            logger.error(
                "%s; moved it to %s and starting with an empty index (the blocks it described will be recomputed)",
                damage,
                path.parent / aside,
            )
        return _open_shared(path, False, map_size, parent, owner)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return _open_shared(path, False, map_size, parent, owner)  # a peer moved it, not yet recreated
        raise
    finally:
        os.close(fd)
