"""Making a namespace: the cache directory, the room it needs, and building it in place.

Runs in whichever engine process (scheduler or worker) opens a namespace first; I/O:
``mkdir`` of the cache directory and of a namespace under a temporary name (``0700``),
its manifest and lock file (``0600``, through ``safe_open``), a ``rename`` into place,
``statvfs`` for the free space. ``namespace.Namespace.open`` calls it; nothing here
opens an existing namespace.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Protocol

from tiered_kv.config import format_size
from tiered_kv.disk.format.errors import DiskSizeError, NamespaceError
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.format.locks import LOCK
from tiered_kv.disk.format.manifest import Manifest, slot_size_for
from tiered_kv.disk.format.safe_open import open_dir, open_file, others_can_write
from tiered_kv.kv_layout import KVCacheLayout

logger = logging.getLogger(__name__)


class HeldSpace(Protocol):
    """What the free-space check needs of an open namespace (``namespace.Namespace``)."""

    def allocated_bytes(self) -> int: ...


#: Disk space set aside for the index: its high-water mark measured about 450 B per slot
#: at TP 1 under churn; this is twice that, plus a little per rank's checksum.
INDEX_RESERVE_MIN = 256 << 10
INDEX_RESERVE_PER_SLOT = 1024
INDEX_RESERVE_PER_RANK_SLOT = 128


def index_reserve_bytes(num_slots: int, tp_size: int) -> int:
    """Disk space reserved for a namespace's index (see ``Namespace.reserve_index``)."""
    return INDEX_RESERVE_MIN + num_slots * (INDEX_RESERVE_PER_SLOT + INDEX_RESERVE_PER_RANK_SLOT * tp_size)


def prepare_cache_dir(cache_dir: str | os.PathLike, create: bool) -> tuple[Path, int, list[Path]]:
    """``cache_dir`` (followed like any path: the operator chose it), its descriptor, and
    the directories made for it (``0700``; innermost first) when it did not exist. Only
    the last component is made: a missing parent (often an unmounted disk's mount point)
    is a ``NamespaceError`` naming it."""
    root = Path(cache_dir).expanduser()
    made: list[Path] = []
    if root.exists() and not root.is_dir():
        raise NamespaceError(f"disk_path {root} exists and is not a directory")
    if not root.exists():
        if not create:
            raise NamespaceError(f"disk_path {root} does not exist")
        parent = root.absolute().parent
        if not parent.exists():
            missing = next(p for p in reversed((parent, *parent.parents)) if not p.exists())
            raise NamespaceError(
                f"disk_path {root}: {missing} does not exist; the disk tier creates only the last "
                f"component of disk_path, so that a disk that is not mounted never fills the file "
                f"system below its mount point: mount it, or create {parent} first"
            )
        try:
            os.mkdir(root, 0o700)
            made.insert(0, root)
        except FileExistsError:
            pass  # made meanwhile by a peer of this engine
        except OSError as e:
            remove_empty(made)
            raise NamespaceError(f"cannot create disk_path {root}: {e.strerror}") from e
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        remove_empty(made)
        raise NamespaceError(f"cannot open disk_path {root}: {e.strerror}") from e
    if create and not os.access(root, os.W_OK | os.X_OK):
        os.close(fd)
        raise NamespaceError(f"disk_path {root} is not writable by this process (uid {os.getuid()})")
    if create and (problem := others_can_write(root, os.fstat(fd))):
        os.close(fd)
        raise NamespaceError(
            f"{problem}; expected a directory of this user (uid {os.geteuid()}) or root that only its owner "
            f"can write (chmod go-w), or a disk_path that does not exist yet"
        )
    return root, fd, made


def remove_empty(dirs: list[Path]) -> None:
    """Remove the directories in ``dirs`` (innermost first) that are empty."""
    for p in dirs:
        try:
            os.rmdir(p)
        except OSError:
            return


def check_free_space(where: Path, num_slots: int, slot_size: int, tp_size: int, ns: HeldSpace | None = None) -> None:
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
            f"lower disk_bytes or free space"
        )


def create_namespace(
    root: Path, root_fd: int, name: str, fp: Fingerprint, layout: KVCacheLayout, num_slots: int, checksum: str
) -> bool:
    """Build namespace ``name`` under a temporary name and rename it into place; False
    when a peer's got there first (theirs is used)."""
    if num_slots is None or num_slots < 1:
        raise DiskSizeError(
            f"a namespace needs at least one slot of {slot_size_for(layout.bytes_per_block)} "
            f"bytes, got num_slots={num_slots}"
        )
    check_free_space(root, num_slots, slot_size_for(layout.bytes_per_block), fp.tp_size)
    tmp = f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    made = False
    try:
        os.mkdir(tmp, 0o700, dir_fd=root_fd)
        made = True
        tfd = open_dir(tmp, path=root / tmp, dir_fd=root_fd)
        try:
            manifest = Manifest.new(
                name,
                fp,
                {**layout.describe(), "bytes_per_block": layout.bytes_per_block},
                layout.bytes_per_block,
                num_slots,
                checksum,
                {"pid": os.getpid(), "host": socket.gethostname()},
            )
            manifest.write_atomic(root / tmp, tfd)
            os.close(open_file(LOCK, os.O_WRONLY, path=root / tmp / LOCK, dir_fd=tfd, create=True, exclusive=True))
        finally:
            os.close(tfd)
        try:
            os.rename(tmp, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return False  # another process created it first; use theirs
        made = False
        os.fsync(root_fd)
        logger.info(
            "created disk cache namespace %s (%d slots of %d bytes)", root / name, num_slots, manifest.slot_size
        )
        return True
    except OSError as e:
        raise NamespaceError(f"cannot create namespace in {root}: {e}") from e
    finally:
        if made:
            shutil.rmtree(tmp, dir_fd=root_fd, ignore_errors=True)
