"""One fingerprint's directory in a disk cache: manifest, slab files and writer lock.

Layout of ``<cache_dir>/<namespace_id>/``::

    manifest.json   fingerprint, layout, block/slot sizes, slot count, checksum, format
    index.lmdb/     the LMDB index (see ``index.py``)
    rank<R>.slab    TP rank R's block data: slot s at byte s * slot_size (preallocated)
    lock            writer lock: flock held by the engine's scheduler process, with
                    JSON {pid, host, started, engine_id} naming the holder

Which process does what: the scheduler (manager) creates or opens the namespace and
holds the writer lock for the engine's lifetime, preallocates every rank's slab and
reserves room for the index to grow into; each worker opens it and preallocates its own
rank's slab (``fallocate``, metadata only on ext4/xfs); the inspector opens it
read-only and takes no lock. Creating or growing a namespace first checks that its
filesystem has the room, so a size that does not fit is never recorded. Creating a namespace is race-free between the scheduler and
workers starting at the same time: the directory is built under a temporary name and
renamed into place, so a namespace directory always has a complete manifest.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tiered_kv.config import format_size
from tiered_kv.disk.fingerprint import Fingerprint
from tiered_kv.kv_layout import KVCacheLayout

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
#: Slot alignment: O_DIRECT and GDS need 4 KiB-aligned offsets, lengths and buffers.
SLOT_ALIGN = 4096
MANIFEST = "manifest.json"
INDEX_DIR = "index.lmdb"
INDEX_DATA = "data.mdb"
LOCK = "lock"
#: Disk space set aside for the index: its high-water mark measured about 450 B per slot
#: at TP 1 under churn; this is twice that, plus a little per rank's checksum.
INDEX_RESERVE_MIN = 256 << 10
INDEX_RESERVE_PER_SLOT = 1024
INDEX_RESERVE_PER_RANK_SLOT = 128


class NamespaceError(RuntimeError):
    """A disk-cache namespace cannot be created or opened (the message says why)."""


class FingerprintMismatchError(NamespaceError):
    """A namespace's manifest records another fingerprint; ``fields`` names each difference."""

    def __init__(self, path: Path, diffs: list[str]):
        self.fields = [d.split(":", 1)[0] for d in diffs]
        super().__init__(
            f"disk cache namespace {path} holds blocks of another fingerprint and is not served; "
            f"differing fields: " + "; ".join(diffs))


class CacheLockedError(NamespaceError):
    """Another engine holds the namespace's writer lock; ``holder`` is its lock record."""

    def __init__(self, path: Path, holder: dict[str, Any] | None):
        self.holder = holder or {}
        h = self.holder
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if "started" in h else "?"
        super().__init__(
            f"disk cache {path} is already open for writing by pid {h.get('pid', '?')} on host "
            f"{h.get('host', '?')} (engine {h.get('engine_id', '?')}, since {since}); stop that "
            f"engine, point this one at another disk_path, or open the cache read-only")


def index_reserve_bytes(num_slots: int, tp_size: int) -> int:
    """Disk space reserved for a namespace's index (see ``Namespace.reserve_index``)."""
    return INDEX_RESERVE_MIN + num_slots * (INDEX_RESERVE_PER_SLOT + INDEX_RESERVE_PER_RANK_SLOT * tp_size)


def slot_size_for(block_bytes: int) -> int:
    """Bytes of one disk slot: the block rounded up to ``SLOT_ALIGN``."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


@dataclass
class Manifest:
    """Contents of ``manifest.json``. ``num_slots`` may grow (never shrinks) when an
    engine reopens the namespace with a larger ``disk_bytes``."""

    namespace_id: str
    fingerprint: dict[str, Any]
    layout: dict[str, Any]
    block_bytes: int
    slot_size: int
    num_slots: int
    checksum: str
    created: float
    format_version: int = FORMAT_VERSION
    created_by: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def read(cls, ns_dir: Path) -> "Manifest":
        path = ns_dir / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise NamespaceError(f"{ns_dir} is not a disk cache namespace: {MANIFEST} is missing") from None
        except (OSError, ValueError) as e:
            raise NamespaceError(f"cannot read {path}: {e}") from e
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise NamespaceError(f"{path}: format_version {version!r} is not supported "
                                 f"(this build reads version {FORMAT_VERSION})")
        try:
            return cls(**data)
        except TypeError as e:
            raise NamespaceError(f"{path}: malformed manifest ({e})") from e

    def write_atomic(self, ns_dir: Path) -> None:
        tmp = ns_dir / f".{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ns_dir / MANIFEST)
        _fsync_dir(ns_dir)


class Namespace:
    """An opened namespace directory: its manifest and paths. Holds no file handles."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint.from_dict(self.manifest.fingerprint)

    @property
    def tp_size(self) -> int:
        return int(self.manifest.fingerprint["tp_size"])

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

    @classmethod
    def open(cls, cache_dir: str | os.PathLike, fingerprint: Fingerprint, layout: KVCacheLayout, *,
             num_slots: int, checksum: str = "xxh3_64", create: bool = True) -> "Namespace":
        """Open ``fingerprint``'s namespace in ``cache_dir``, creating both if absent.

        ``num_slots`` is used when creating; an existing namespace keeps its own (see
        ``grow``). Raises ``FingerprintMismatchError`` if the directory's manifest records
        another fingerprint, ``NamespaceError`` for an unusable path.
        """
        root = _prepare_cache_dir(cache_dir, create)
        ns_dir = root / fingerprint.namespace_id
        if not ns_dir.exists():
            if not create:
                raise NamespaceError(f"no namespace {fingerprint.namespace_id} in {root}")
            _create(root, ns_dir, fingerprint, layout, num_slots, checksum)
        ns = cls(ns_dir, Manifest.read(ns_dir))
        theirs = Fingerprint.from_dict(ns.manifest.fingerprint)
        diffs = fingerprint.differences(theirs)
        if diffs:
            raise FingerprintMismatchError(ns_dir, diffs)
        if ns.manifest.block_bytes != layout.bytes_per_block:
            raise FingerprintMismatchError(ns_dir, [
                f"block_bytes: {layout.bytes_per_block} here, {ns.manifest.block_bytes} in the cache"])
        return ns

    @classmethod
    def open_path(cls, ns_dir: str | os.PathLike) -> "Namespace":
        """Open an existing namespace directory as it is (inspector; no fingerprint check)."""
        p = Path(ns_dir)
        return cls(p, Manifest.read(p))

    def reload(self) -> Manifest:
        """Re-read the manifest (another process may have grown ``num_slots``)."""
        self.manifest = Manifest.read(self.path)
        return self.manifest

    def grow(self, num_slots: int) -> None:
        """Raise the manifest's ``num_slots`` (only the writer-lock holder calls this).
        Raises ``NamespaceError`` first if the filesystem cannot hold the larger size."""
        if num_slots > self.manifest.num_slots:
            _check_free_space(self.path, num_slots, self.manifest.slot_size, self.tp_size, self)
            logger.info("disk namespace %s: growing from %d to %d slots", self.path,
                        self.manifest.num_slots, num_slots)
            self.manifest.num_slots = num_slots
            self.manifest.write_atomic(self.path)

    def allocate_slab(self, rank: int) -> Path:
        """Create rank ``rank``'s slab if missing and preallocate ``num_slots`` slots.

        Uses ``fallocate`` (no data written); where the filesystem lacks it, the file is
        extended sparsely and a full disk shows up later as failed, counted stores.
        Raises ``NamespaceError`` when the space is not there.
        """
        path = self.slab_path(rank)
        size = self.manifest.num_slots * self.manifest.slot_size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size >= size and _allocated_bytes(fd) >= size:
                return path
            try:
                _fallocate(fd, size)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    logger.warning("%s: the filesystem cannot preallocate (%s); the slab is sparse "
                                   "and a full disk will fail stores", path, e.strerror)
                    if os.fstat(fd).st_size < size:
                        os.ftruncate(fd, size)
                elif e.errno == errno.ENOSPC:
                    free = shutil.disk_usage(self.path).free
                    raise NamespaceError(
                        f"cannot preallocate {path}: {size} bytes ({self.manifest.num_slots} slots of "
                        f"{self.manifest.slot_size}) requested but only {free} bytes are free; lower "
                        f"disk_bytes or free space") from e
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
        fd = os.open(path, os.O_RDWR)
        try:
            if _allocated_bytes(fd) >= want:
                return
            _fallocate(fd, want, keep_size=True)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                logger.warning("%s: the filesystem cannot preallocate (%s); a full disk may fail "
                               "index commits", path, e.strerror)
            elif e.errno == errno.ENOSPC:
                raise NamespaceError(f"cannot reserve {format_size(want)} for the index {path}: only "
                                     f"{format_size(shutil.disk_usage(self.path).free)} free; lower "
                                     f"disk_bytes or free space") from e
            else:
                raise NamespaceError(f"cannot reserve space for the index {path}: {e}") from e
        finally:
            os.close(fd)

    def allocated_bytes(self) -> int:
        """Disk space this namespace's slabs and index hold now, counted up to what
        ``allocate_slab`` and ``reserve_index`` would claim."""
        m = self.manifest
        slab = m.num_slots * m.slot_size
        paths = [(self.path / f"rank{r}.slab", slab) for r in range(self.tp_size)]
        paths.append((self.index_path / INDEX_DATA, index_reserve_bytes(m.num_slots, self.tp_size)))
        total = 0
        for path, cap in paths:
            try:
                total += min(os.stat(path).st_blocks * 512, cap)
            except FileNotFoundError:
                pass
        return total


def list_namespaces(cache_dir: str | os.PathLike) -> list[Namespace]:
    """Every readable namespace in ``cache_dir`` (unreadable ones are logged and skipped)."""
    root = Path(cache_dir)
    out = []
    if not root.is_dir():
        return out
    for child in sorted(root.iterdir()):
        if child.name.startswith(".") or not child.is_dir():
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
        if (theirs.model_id == fingerprint.model_id or theirs.layer_geometry == fingerprint.layer_geometry
                or (theirs.weights_digest is not None and theirs.weights_digest == fingerprint.weights_digest)):
            lines.append(f"{ns.path.name}: " + "; ".join(fingerprint.differences(theirs)))
    return lines


class WriterLock:
    """The engine's exclusive claim on a namespace: an ``flock`` on ``lock`` plus a JSON
    record of the holder. Released by ``release()`` or by the kernel when the holder dies
    (a ``kill -9`` leaves no stale lock)."""

    def __init__(self, path: Path, fd: int, record: dict[str, Any]):
        self.path = path
        self._fd: int | None = fd
        self.record = record

    @classmethod
    def acquire(cls, ns: Namespace, engine_id: str, timeout: float = 1.0) -> "WriterLock":
        """Take the lock or raise ``CacheLockedError`` naming the holder. Retries for
        ``timeout`` seconds because workers probe the lock for an instant."""
        path = ns.lock_path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "engine_id": engine_id}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return cls(path, fd, record)

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


def read_holder(ns: Namespace) -> dict[str, Any] | None:
    """The lock record of the current holder, or None if the record is empty/unreadable."""
    try:
        text = ns.lock_path.read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def current_holder(ns: Namespace) -> dict[str, Any] | None:
    """The holder's record if some process holds the writer lock now, else None.
    (Probes with a non-blocking flock that is dropped at once.)"""
    try:
        fd = os.open(ns.lock_path, os.O_RDONLY)
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


def check_worker_access(ns: Namespace, engine_id: str | None) -> None:
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


# ---------------------------------------------------------------- helpers


def _prepare_cache_dir(cache_dir: str | os.PathLike, create: bool) -> Path:
    root = Path(cache_dir).expanduser()
    if root.exists() and not root.is_dir():
        raise NamespaceError(f"disk_path {root} exists and is not a directory")
    if not root.exists():
        if not create:
            raise NamespaceError(f"disk_path {root} does not exist")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise NamespaceError(f"cannot create disk_path {root}: {e.strerror}") from e
    if create and not os.access(root, os.W_OK | os.X_OK):
        raise NamespaceError(f"disk_path {root} is not writable by this process (uid {os.getuid()})")
    return root


def _check_free_space(where: Path, num_slots: int, slot_size: int, tp_size: int,
                      ns: Namespace | None = None) -> None:
    """Raise ``NamespaceError`` unless the filesystem of ``where`` has room for a
    namespace of ``num_slots`` (every rank's slab plus the index reserve), counting what
    ``ns`` (an existing namespace) already holds. Checked before a manifest records the
    size, so a size that does not fit never sticks to the cache directory."""
    slabs = tp_size * num_slots * slot_size
    need = slabs + index_reserve_bytes(num_slots, tp_size)
    held = ns.allocated_bytes() if ns is not None else 0
    free = shutil.disk_usage(where).free
    if need - held > free:
        raise NamespaceError(
            f"disk_bytes: {format_size(num_slots * slot_size)} per rank ({num_slots} slots of {slot_size} B) "
            f"x {tp_size} rank(s) plus {format_size(need - slabs)} for the index needs "
            f"{format_size(need - held)} more on the filesystem of {where}, but only {free} bytes are "
            f"free ({format_size(free)}; {format_size(held)} already held by this namespace); "
            f"lower disk_bytes or free space")


def _create(root: Path, ns_dir: Path, fp: Fingerprint, layout: KVCacheLayout, num_slots: int,
            checksum: str) -> None:
    if num_slots < 1:
        raise NamespaceError(f"a namespace needs at least one slot, got num_slots={num_slots}")
    _check_free_space(root, num_slots, slot_size_for(layout.bytes_per_block), fp.tp_size)
    tmp = root / f".tmp-{ns_dir.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        manifest = Manifest(
            namespace_id=ns_dir.name, fingerprint=fp.to_dict(),
            layout={**layout.describe(), "bytes_per_block": layout.bytes_per_block},
            block_bytes=layout.bytes_per_block, slot_size=slot_size_for(layout.bytes_per_block),
            num_slots=int(num_slots), checksum=checksum, created=time.time(),
            created_by={"pid": os.getpid(), "host": socket.gethostname()})
        manifest.write_atomic(tmp)
        (tmp / LOCK).touch()
        try:
            os.rename(tmp, ns_dir)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # Another process created it first; use theirs.
        else:
            _fsync_dir(root)
            logger.info("created disk cache namespace %s (%d slots of %d bytes)", ns_dir,
                        num_slots, manifest.slot_size)
    except OSError as e:
        raise NamespaceError(f"cannot create namespace in {root}: {e}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
