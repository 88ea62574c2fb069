"""One fingerprint's directory in a disk cache: manifest, slab files and writer lock.

Layout of ``<cache_dir>/<namespace_id>/`` (directories ``0700``, files ``0600``)::

    manifest.json   fingerprint, layout, block/slot sizes, slot count, checksum, format
                    (``manifest.py``: read as untrusted input, every field checked)
    index.lmdb/     the LMDB index (see ``index.py``)
    rank<R>.slab    TP rank R's block data: slot s at byte s * slot_size (preallocated)
    lock            writer lock: flock held by the engine's scheduler process, with
                    JSON {pid, host, started, engine_id} naming the holder

Which process does what: the scheduler (manager) creates or opens the namespace and
holds the writer lock for the engine's lifetime, preallocates every rank's slab and
reserves room for the index to grow into; each worker opens it and preallocates its own
rank's slab (``fallocate``, metadata only on ext4/xfs); the inspector opens it
read-only and takes no lock. Creating or growing a namespace first checks that its
filesystem has the room, so a size that does not fit is never recorded. Creating a
namespace is race-free between the scheduler and workers starting at the same time: the
directory is built under a temporary name and renamed into place, so a namespace
directory always has a complete manifest. A start refused before the namespace existed
leaves no directory behind.

A ``Namespace`` holds the namespace directory's descriptor, and every entry in it is
opened relative to that descriptor through ``safe_open`` (no symbolic link followed, no
FIFO opened, nothing of another user's used; start-up checks every entry first). Each
engine process (scheduler, worker, disk I/O process) also holds a shared ``flock`` on
that directory while it has the namespace open, so the inspector's destructive
commands, which take it exclusively after the writer lock, cannot run while any of them
has it open, including the moment between a worker opening it and its scheduler taking
the writer lock. ``close()`` releases both the descriptor and that claim. Making a new
namespace is ``namespace_dir``'s; the writer lock is ``locks``'.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import stat
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_kv.abstract import Closing
from tiered_kv.config_values import DEFAULT_CHECKSUM, format_size
from tiered_kv.disk.format.errors import DiskSizeError, NamespaceError
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.format.locks import (
    LOCK,
    CacheLockedError,
    WriterLock,
    check_worker_access,
    current_holder,
    read_holder,
)
from tiered_kv.disk.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    SLOT_ALIGN,
    Manifest,
    ManifestError,
    slot_size_for,
)
from tiered_kv.disk.format.namespace_dir import (
    check_free_space,
    create_namespace,
    index_reserve_bytes,
    prepare_cache_dir,
    remove_empty,
)
from tiered_kv.disk.format.safe_open import ANY_OWNER, CacheEntryError, check_entry, open_dir, open_file
from tiered_kv.kv_layout import KVCacheLayout

if TYPE_CHECKING:  # imported where it is opened: the index imports the namespace's helpers
    from tiered_kv.disk.format.index import DiskIndex

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "SLOT_ALIGN",
    "CacheEntryError",
    "CacheLockedError",
    "DiskSizeError",
    "FingerprintMismatchError",
    "Manifest",
    "ManifestError",
    "Namespace",
    "NamespaceError",
    "WriterLock",
    "check_worker_access",
    "current_holder",
    "explain_other_namespaces",
    "list_namespaces",
    "read_holder",
    "slot_size_for",
]

INDEX_DIR = "index.lmdb"
INDEX_DATA = "data.mdb"
INDEX_LOCK = "lock.mdb"
#: Seconds an engine process waits for an inspector command that holds the namespace.
SHARED_LOCK_TIMEOUT = 2.0


class FingerprintMismatchError(NamespaceError):
    """A namespace's manifest records another fingerprint; ``fields`` names each difference."""

    def __init__(self, path: Path, diffs: list[str]):
        self.fields = [d.split(":", 1)[0] for d in diffs]
        super().__init__(
            f"disk cache namespace {path} holds blocks of another fingerprint and is not served; "
            f"differing fields: " + "; ".join(diffs)
        )


class Namespace(Closing):
    """An opened namespace directory: its manifest, paths and descriptor (``fd``).

    ``owner`` is the uid every entry must belong to: this process's for an engine,
    the directory's own for the inspector's read-only opens. ``writer`` opens (the
    engine's) hold the shared directory lock, and tighten looser permission bits.
    """

    #: Read when the namespace is opened, before the handle is handed out.
    manifest: Manifest

    def __init__(self, path: Path, fd: int, owner: int, writer: bool):
        self.path = path
        self.fd = fd
        self.owner = owner
        self.writer = writer
        #: Whether this process created the namespace in this open (see ``discard_new``).
        self.created = False
        self._created_dirs: list[Path] = []  # cache directories made for it, outermost last
        self._users = 1
        self._taken: list | None = None
        self._close = weakref.finalize(self, os.close, fd)

    def retain(self) -> "Namespace":
        """Count one more user of this handle; each user calls ``close`` once."""
        self._users += 1
        return self

    def close(self) -> None:
        """Drop one user; the last closes the directory's descriptor, and with it this
        process's claim on the namespace (also when the handle is garbage collected).
        Once the last user is gone, a further close does nothing."""
        self._users -= 1
        if self._users <= 0:
            self._close()

    @contextlib.contextmanager
    def starting(self) -> Iterator["Namespace"]:
        """An engine's start-up on this handle: if the block fails, the index handles and
        the writer lock it took through this namespace are closed, and the namespace is
        removed if this open created it (``discard_new``)."""
        self._taken = []
        try:
            yield self
        except BaseException:
            for thing in reversed(self._taken):
                try:
                    thing.release() if isinstance(thing, WriterLock) else thing.close()
                except Exception:
                    logger.exception("closing %s after a refused start", self.path)
            self.discard_new()
            raise
        finally:
            self._taken = None

    def taken(self, thing: Any) -> Any:
        """Note an index handle or lock taken through this namespace (see ``starting``)."""
        if self._taken is not None:
            self._taken.append(thing)
        return thing

    @contextlib.contextmanager
    def handover(self) -> Iterator["Namespace"]:
        """For an opener handing this handle to a new owner (which ``retain``s it) in the
        ``with`` block: afterwards the opener's use ends; if the block fails, a namespace
        this open created is removed (``discard_new``) and the handle closed."""
        try:
            yield self
        except BaseException:
            self.discard_new()
            raise
        self.close()

    @property
    def closed(self) -> bool:
        return not self._close.alive

    @property
    def fingerprint(self) -> Fingerprint:
        return self.manifest.parsed_fingerprint

    @property
    def tp_size(self) -> int:
        return self.fingerprint.tp_size

    @property
    def index_path(self) -> Path:
        return self.path / INDEX_DIR

    @property
    def lock_path(self) -> Path:
        return self.path / LOCK

    def slab_path(self, rank: int) -> Path:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} is out of range for tp_size {self.tp_size}")
        return self.path / f"rank{rank}.slab"

    # ------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        cache_dir: str | os.PathLike,
        fingerprint: Fingerprint,
        layout: KVCacheLayout,
        *,
        num_slots: int | None = None,
        disk_bytes: int | None = None,
        checksum: str = DEFAULT_CHECKSUM,
        create: bool = True,
    ) -> "Namespace":
        """Open ``fingerprint``'s namespace in ``cache_dir`` for an engine process,
        creating both if absent (``num_slots``, or as many as ``disk_bytes`` holds, then
        sizes it; an existing namespace keeps its own, see ``grow``). Raises
        ``DiskSizeError`` when ``disk_bytes`` holds no slot, ``FingerprintMismatchError`` if its manifest
        records another fingerprint, ``CacheEntryError`` for an entry that is not the
        cache's own, ``ManifestError`` for a damaged manifest, ``CacheLockedError`` while
        an inspector command changes it, ``NamespaceError`` for an unusable path."""
        if disk_bytes is not None:
            num_slots = disk_bytes // slot_size_for(layout.bytes_per_block)
            if num_slots < 1:
                raise DiskSizeError(
                    f"disk_bytes={disk_bytes} holds no block; one disk slot is "
                    f"{slot_size_for(layout.bytes_per_block)} bytes"
                )
        root, root_fd, made = prepare_cache_dir(cache_dir, create)
        name = fingerprint.namespace_id
        ns_dir = root / name
        owner = os.geteuid()
        try:
            created = False
            for _ in range(8):
                try:
                    fd = open_dir(name, path=ns_dir, dir_fd=root_fd, owner=owner)
                except FileNotFoundError:
                    if not create:
                        raise NamespaceError(f"no namespace {name} in {root}") from None
                    if num_slots is None:
                        raise NamespaceError(
                            f"no namespace {name} in {root}, and neither num_slots nor disk_bytes to size one"
                        ) from None
                    created = create_namespace(root, root_fd, name, fingerprint, layout, num_slots, checksum)
                    continue
                except OSError as e:
                    raise NamespaceError(f"cannot open {ns_dir}: {e.strerror}") from None
                ns = cls(ns_dir, fd, owner, writer=True)
                try:
                    ns._hold_shared()
                    if not _still_at(root_fd, name, fd):
                        ns.close()  # removed by `inspect clear` meanwhile: start afresh
                        continue
                    ns._load_checked()
                    ns._check_serves(fingerprint, layout)
                except BaseException:
                    ns.close()
                    raise
                ns.created, ns._created_dirs = created, made
                return ns
            raise NamespaceError(f"{ns_dir} kept disappearing while it was being opened")
        except BaseException:
            remove_empty(made)
            raise
        finally:
            os.close(root_fd)

    @classmethod
    def open_path(cls, ns_dir: str | os.PathLike) -> "Namespace":
        """Open an existing namespace directory as it is, read-only (inspector; no
        fingerprint check, no lock, nothing written). Its entries must belong to
        whoever owns the directory. Raises ``NamespaceError`` (and its kinds)."""
        p = Path(ns_dir)
        try:
            parent = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise NamespaceError(f"cannot open {p.parent}: {e.strerror}") from None
        try:
            fd = open_dir(p.name, path=p, dir_fd=parent, owner=ANY_OWNER, fix_mode=False)
        except FileNotFoundError:
            raise NamespaceError(f"{p} does not exist") from None
        except OSError as e:
            raise NamespaceError(f"cannot open {p}: {e.strerror}") from None
        finally:
            os.close(parent)
        ns = cls(p, fd, os.fstat(fd).st_uid, writer=False)
        try:
            ns._load_checked()
        except BaseException:
            ns.close()
            raise
        return ns

    def _load_checked(self) -> None:
        self.manifest = Manifest.read(self.path, self.fd, owner=self.owner, fix_mode=self.writer)
        self.check_entries()
        m = self.manifest
        st = os.fstatvfs(self.fd)
        fs_bytes = st.f_blocks * st.f_frsize
        if m.num_slots * m.slot_size > fs_bytes:
            raise ManifestError(
                self.path / MANIFEST,
                "num_slots",
                f"{m.num_slots} slots of {m.slot_size} B ({format_size(m.num_slots * m.slot_size)} "
                f"per rank) cannot be on a filesystem of {format_size(fs_bytes)}",
            )

    def _check_serves(self, fingerprint: Fingerprint, layout: KVCacheLayout) -> None:
        """Raise unless this namespace holds ``fingerprint``'s blocks as ``layout`` lays
        them out (the engine's own view of what the manifest must say)."""
        m = self.manifest
        diffs = fingerprint.differences(self.fingerprint)
        if diffs:
            raise FingerprintMismatchError(self.path, diffs)
        if m.block_bytes != layout.bytes_per_block:
            raise FingerprintMismatchError(
                self.path, [f"block_bytes: {layout.bytes_per_block} here, {m.block_bytes} in the cache"]
            )
        if m.namespace_id != self.path.name:
            raise ManifestError(
                self.path / MANIFEST,
                "namespace_id",
                f"{m.namespace_id!r} does not name its directory {self.path.name!r}",
            )

    def check_entries(self) -> None:
        """Raise ``CacheEntryError`` if any entry the cache opens (lock, index, slabs)
        is there but is not a regular file (or directory) of ``owner``: checked at
        start-up, so one error names it before anything is read or written."""
        for name in (LOCK, *(f"rank{r}.slab" for r in range(self.tp_size)), f".{INDEX_DIR}.repair"):
            check_entry(name, dir_fd=self.fd, path=self.path / name, owner=self.owner)
        if check_entry(INDEX_DIR, dir_fd=self.fd, path=self.index_path, directory=True, owner=self.owner) is None:
            return
        ifd = open_dir(INDEX_DIR, path=self.index_path, dir_fd=self.fd, owner=self.owner, fix_mode=self.writer)
        try:
            for name in (INDEX_DATA, INDEX_LOCK):
                check_entry(name, dir_fd=ifd, path=self.index_path / name, owner=self.owner)
        finally:
            os.close(ifd)

    def _hold_shared(self, timeout: float = SHARED_LOCK_TIMEOUT) -> None:
        """Take the shared directory lock (module docstring), waiting ``timeout`` for an
        inspector command that holds it exclusively; then ``CacheLockedError``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CacheLockedError(self.path, read_holder(self)) from None
                time.sleep(0.02)

    def lock_exclusive(self) -> bool:
        """Try to hold the directory lock exclusively (the inspector's destructive
        commands, after the writer lock): False while any engine process has the
        namespace open."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def open_index(self, **kwargs: Any) -> DiskIndex:
        """This namespace's ``DiskIndex`` (``kwargs``: its options), its files checked and
        opened through this directory's descriptor."""
        from tiered_kv.disk.format.index import DiskIndex

        return self.taken(DiskIndex(self.index_path, self.tp_size, dir_fd=self.fd, owner=self.owner, **kwargs))

    def open_entry(self, name: str, flags: int, create: bool = False) -> int:
        """A descriptor of the file ``name`` in this directory (``safe_open.open_file``)."""
        return open_file(
            name, flags, path=self.path / name, dir_fd=self.fd, owner=self.owner, create=create, fix_mode=self.writer
        )

    def reload(self) -> Manifest:
        """Re-read the manifest (another process may have grown ``num_slots``)."""
        self.manifest = Manifest.read(self.path, self.fd, owner=self.owner, fix_mode=self.writer)
        return self.manifest

    def grow(self, num_slots: int) -> None:
        """Raise the manifest's ``num_slots`` (only the writer-lock holder calls this).
        Raises ``NamespaceError`` first if the filesystem cannot hold the larger size."""
        if num_slots > self.manifest.num_slots:
            check_free_space(self.path, num_slots, self.manifest.slot_size, self.tp_size, self)
            logger.info("disk namespace %s: growing from %d to %d slots", self.path, self.manifest.num_slots, num_slots)
            self.manifest.num_slots = num_slots
            self.manifest.write_atomic(self.path, self.fd)

    def allocate_slab(self, rank: int) -> Path:
        """Create rank ``rank``'s slab if missing and preallocate ``num_slots`` slots.

        Uses ``fallocate`` (no data written); where the filesystem lacks it, the file is
        extended sparsely and a full disk shows up later as failed, counted stores.
        Raises ``NamespaceError`` when the space is not there.
        """
        path = self.slab_path(rank)
        size = self.manifest.num_slots * self.manifest.slot_size
        try:
            fd = self.open_entry(path.name, os.O_RDWR, create=True)
        except OSError as e:
            raise NamespaceError(f"cannot open {path}: {e.strerror}") from None
        try:
            if os.fstat(fd).st_size >= size and _allocated_bytes(fd) >= size:
                return path
            try:
                _fallocate(fd, size)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    logger.warning(
                        "%s: the filesystem cannot preallocate (%s); the slab is sparse "
                        "and a full disk will fail stores",
                        path,
                        e.strerror,
                    )
                    if os.fstat(fd).st_size < size:
                        os.ftruncate(fd, size)
                elif e.errno == errno.ENOSPC:
                    free = shutil.disk_usage(self.path).free
                    raise NamespaceError(
                        f"cannot preallocate {path}: {size} bytes ({self.manifest.num_slots} slots of "
                        f"{self.manifest.slot_size}) requested but only {free} bytes are free; lower "
                        f"disk_bytes or free space"
                    ) from e
                else:
                    raise NamespaceError(f"cannot preallocate {path}: {e}") from e
        finally:
            os.close(fd)
        return path

    def reserve_index(self) -> None:
        """Set aside disk space for the index to grow into (``fallocate`` that keeps the
        file size LMDB reads), so that a filesystem filling up later cannot fail the
        index commits that record stores and their failures. Raises ``NamespaceError``
        when the space is not there; skipped where the filesystem cannot preallocate."""
        want = index_reserve_bytes(self.manifest.num_slots, self.tp_size)
        path = self.index_path / INDEX_DATA
        ifd = open_dir(INDEX_DIR, path=self.index_path, dir_fd=self.fd, owner=self.owner)
        try:
            fd = open_file(INDEX_DATA, os.O_RDWR, path=path, dir_fd=ifd, owner=self.owner)
        finally:
            os.close(ifd)
        try:
            if _allocated_bytes(fd) >= want:
                return
            _fallocate(fd, want, keep_size=True)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                logger.warning(
                    "%s: the filesystem cannot preallocate (%s); a full disk may fail index commits", path, e.strerror
                )
            elif e.errno == errno.ENOSPC:
                raise NamespaceError(
                    f"cannot reserve {format_size(want)} for the index {path}: only "
                    f"{format_size(shutil.disk_usage(self.path).free)} free; lower "
                    f"disk_bytes or free space"
                ) from e
            else:
                raise NamespaceError(f"cannot reserve space for the index {path}: {e}") from e
        finally:
            os.close(fd)

    def allocated_bytes(self) -> int:
        """Disk space this namespace's slabs and index hold now, counted up to what
        ``allocate_slab`` and ``reserve_index`` would claim."""
        m = self.manifest
        slab = m.num_slots * m.slot_size
        paths = [(f"rank{r}.slab", slab) for r in range(self.tp_size)]
        paths.append((f"{INDEX_DIR}/{INDEX_DATA}", index_reserve_bytes(m.num_slots, self.tp_size)))
        total = 0
        for name, cap in paths:
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat.S_ISREG(st.st_mode):
                total += min(st.st_blocks * 512, cap)
        return total

    def discard_new(self) -> None:
        """After a refused start: remove the namespace if this open created it and no
        other process has it open (it holds nothing yet), and the cache directories
        made for it if they are empty. Best effort, logged; closes the namespace."""
        try:
            if self.created and not self.closed and self.lock_exclusive() and _still_at_path(self):
                root = self.path.parent
                trash = root / f".trash-{self.path.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
                os.rename(self.path, trash)
                shutil.rmtree(trash, ignore_errors=True)
                logger.info("removed %s, created by this refused start", self.path)
                remove_empty(self._created_dirs)
        except OSError as e:
            logger.warning("could not remove %s after a refused start: %s", self.path, e)
        finally:
            self._close()


def list_namespaces(cache_dir: str | os.PathLike) -> list[Namespace]:
    """Every readable namespace in ``cache_dir``, opened read-only (unreadable ones, and
    entries that are not directories of their own, are logged and skipped)."""
    root = Path(cache_dir)
    out: list[Namespace] = []
    if not root.is_dir():
        return out
    for child in sorted(root.iterdir()):
        if child.name.startswith(".") or child.is_symlink() or not child.is_dir():
            continue
        try:
            out.append(Namespace.open_path(child))
        except NamespaceError as e:
            logger.warning("skipping %s: %s", child, e)
    return out


def explain_other_namespaces(cache_dir: str | os.PathLike, fingerprint: Fingerprint) -> list[str]:
    """For each other namespace in ``cache_dir`` of the same model id, weights or layer
    geometry, why it is not served: every differing field, ``model_id`` and
    ``weights_digest`` included. Used to log why a restart does not find an old cache."""
    lines = []
    for ns in list_namespaces(cache_dir):
        if ns.path.name == fingerprint.namespace_id:
            continue
        try:
            theirs = ns.fingerprint
        except (ValueError, TypeError):
            continue
        if (
            theirs.model_id == fingerprint.model_id
            or theirs.layer_geometry == fingerprint.layer_geometry
            or (theirs.weights_digest is not None and theirs.weights_digest == fingerprint.weights_digest)
        ):
            lines.append(f"{ns.path.name}: " + "; ".join(fingerprint.differences(theirs)))
    return lines


# ---------------------------------------------------------------- helpers


def _still_at(root_fd: int, name: str, fd: int) -> bool:
    """Whether ``name`` in ``root_fd`` is still the directory open as ``fd``."""
    try:
        here = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except OSError:
        return False
    st = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino)


def _still_at_path(ns: Namespace) -> bool:
    try:
        root_fd = os.open(ns.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _still_at(root_fd, ns.path.name, ns.fd)
    finally:
        os.close(root_fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


_FALLOC_FL_KEEP_SIZE = 1


def _fallocate(fd: int, size: int, keep_size: bool = False) -> None:
    """Allocate blocks for bytes [0, size) and extend the file (mode 0), or leave its
    size alone (``keep_size``). Raises OSError."""
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE if keep_size else 0, 0, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _allocated_bytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512
