"""Opening the entries of a disk cache without trusting what is found there.

Every process that opens a cache (scheduler, workers, their disk I/O processes, the
inspector) opens its files through here; the I/O is ``open``/``mkdir``/``fstat``/
``lstat``/``fchmod`` of cache entries, relative to the descriptor of the directory they
are in. Whoever can write to a cache directory could otherwise plant a symbolic link
(and have the engine write KV bytes, or truncate a file, wherever it points), a FIFO
(and hang every process that opens it) or a file of their own (and read or forge what
the engine keeps there). So:

- files are opened with ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a FIFO then opens at once, or
  fails with ``ENXIO``, instead of blocking), then must be regular files owned by the
  cache's user; ``O_NONBLOCK`` is cleared once they are;
- directories are opened with ``O_NOFOLLOW | O_DIRECTORY`` and must belong to the same
  user;
- entries are created ``0600`` (files) and ``0700`` (directories) whatever the umask,
  and an engine that opens an older entry with looser bits tightens them (``fchmod``);
- anything else is a ``CacheEntryError`` naming the path and what it is ("a symbolic
  link to /etc/passwd", "a FIFO", "a regular file owned by uid 65534").

The cache directory itself (``disk_path``) is the operator's choice and is followed
like any path; a namespace directory and everything in it is opened relative to the
descriptor of the directory above it, so renaming or replacing a directory on the way
cannot redirect an open.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from tiered_kv.disk.format.errors import NamespaceError

FILE_MODE = 0o600
DIR_MODE = 0o700
#: ``owner`` value that accepts whichever user owns the directory (the inspector's
#: read-only opens: the cache's user is whoever made its namespace directory).
ANY_OWNER = -1

_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class CacheEntryError(NamespaceError):
    """An entry of a cache directory is not what the cache keeps there: ``path`` and
    ``what`` it is instead."""

    def __init__(self, path: str | os.PathLike, what: str, expected: str = "a regular file", advice: str | None = None):
        self.path, self.what, self.expected = Path(path), what, expected
        super().__init__(
            f"{path} is {what}, not {expected} of this cache's user, so nothing is read or written through it. "
            + (advice or "Remove it, or give disk_path a directory that only this user can write to")
        )


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return word
    return f"a special file (mode {mode:o})"


def describe(name: str | os.PathLike[str], dir_fd: int | None = None) -> str:
    """What the entry ``name`` (relative to ``dir_fd``) is, not following it: e.g. "a
    symbolic link to /etc/passwd", "a dangling symbolic link to /nowhere", "a FIFO",
    "missing"."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if not stat.S_ISLNK(st.st_mode):
        return _kind(st.st_mode)
    try:
        target = os.readlink(name, dir_fd=dir_fd)
    except OSError:
        target = "?"
    try:
        points_at = os.stat(name, dir_fd=dir_fd)
    except OSError:
        return f"a dangling symbolic link to {target}"
    if stat.S_ISDIR(points_at.st_mode):
        return f"a symbolic link to the directory {target}"
    return f"a symbolic link to {target}"


def check_owner(st: os.stat_result, path: str | os.PathLike, owner: int, expected: str = "a regular file") -> None:
    """Raise ``CacheEntryError`` unless ``st`` belongs to uid ``owner`` (``ANY_OWNER``:
    anyone)."""
    if owner != ANY_OWNER and st.st_uid != owner:
        raise CacheEntryError(
            path, f"{_kind(st.st_mode)} owned by uid {st.st_uid} (this cache's user is uid {owner})", expected
        )


def _owner(owner: int | None) -> int:
    return os.geteuid() if owner is None else owner


def _give_to_owner(fd: int, st: os.stat_result, owner: int) -> os.stat_result:
    """An entry root just made in another user's cache (an operator's tool run as root:
    ``inspect verify --repair``, ``evict``) is given to that user, whose engine would
    otherwise refuse it at its next start."""
    if st.st_uid == 0 != owner != ANY_OWNER and os.geteuid() == 0:
        os.fchown(fd, owner, -1)
        return os.fstat(fd)
    return st


def open_file(
    name: str | os.PathLike,
    flags: int,
    *,
    path: str | os.PathLike,
    dir_fd: int | None = None,
    owner: int | None = None,
    create: bool = False,
    exclusive: bool = False,
    fix_mode: bool = True,
) -> int:
    """A descriptor of the regular file ``name`` (relative to ``dir_fd``; ``path`` is its
    name in messages), opened with ``flags`` plus ``O_NOFOLLOW``, and never blocking on
    a FIFO. ``create`` makes it ``0600`` if missing (``exclusive``: it must not exist).
    It must belong to uid ``owner`` (default: this process's); ``fix_mode`` tightens
    looser permission bits to ``0600``.

    Raises ``CacheEntryError`` for anything but such a file, ``FileNotFoundError`` when
    it is missing (and not created), ``OSError`` for other failures."""
    flags |= _FILE_FLAGS
    if create:
        flags |= os.O_CREAT | (os.O_EXCL if exclusive else 0)
    try:
        fd = os.open(name, flags, FILE_MODE, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (
            errno.ELOOP,
            errno.EISDIR,
            errno.ENXIO,
            errno.EEXIST,
            errno.ENOTDIR,
            errno.EOPNOTSUPP,
            errno.ETXTBSY,
        ):
            raise CacheEntryError(path, describe(name, dir_fd)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheEntryError(path, _kind(st.st_mode))
        if create:
            st = _give_to_owner(fd, st, _owner(owner))
        check_owner(st, path, _owner(owner))
        if fix_mode and st.st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir(
    name: str | os.PathLike,
    *,
    path: str | os.PathLike,
    dir_fd: int | None = None,
    owner: int | None = None,
    create: bool = False,
    fix_mode: bool = True,
) -> int:
    """A descriptor of the directory ``name`` (relative to ``dir_fd``), not following a
    symbolic link; ``create`` makes it ``0700`` if missing. Ownership and ``fix_mode``
    as for ``open_file`` (``0700``). Raises ``CacheEntryError``, ``FileNotFoundError``
    or ``OSError``."""
    if create:
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CacheEntryError(path, describe(name, dir_fd), "a directory") from None
        raise
    try:
        st = os.fstat(fd)
        if create:
            st = _give_to_owner(fd, st, _owner(owner))
        check_owner(st, path, _owner(owner), "a directory")
        if fix_mode and st.st_mode & 0o077:
            os.fchmod(fd, DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_entry(
    name: str, *, dir_fd: int, path: str | os.PathLike, directory: bool = False, owner: int | None = None
) -> os.stat_result | None:
    """``lstat`` of ``name`` in ``dir_fd``: None when it is missing; raises
    ``CacheEntryError`` unless it is a regular file (``directory``: a directory) of uid
    ``owner``. For files another library opens by name (LMDB's), checked before it
    does."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    expected = "a directory" if directory else "a regular file"
    ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not ok:
        raise CacheEntryError(path, describe(name, dir_fd), expected)
    check_owner(st, path, _owner(owner), expected)
    return st


def read_file(
    name: str, *, dir_fd: int, path: str | os.PathLike, limit: int, owner: int | None = None, fix_mode: bool = True
) -> bytes:
    """The first ``limit`` + 1 bytes at most of the regular file ``name`` (see
    ``open_file``), so a caller can tell a file longer than ``limit``."""
    fd = open_file(name, os.O_RDONLY, path=path, dir_fd=dir_fd, owner=owner, fix_mode=fix_mode)
    try:
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def fd_path(fd: int, name: str | None = None) -> str | None:
    """A path naming what ``fd`` is open on (plus ``name`` inside it) for libraries that
    take paths, resolved through the descriptor rather than the directory names on the
    way (``/proc/self/fd``); None where ``/proc`` is not mounted."""
    base = f"/proc/self/fd/{fd}"
    if not os.path.exists(base):
        return None
    return base if name is None else f"{base}/{name}"


def others_can_write(root: Path, st: os.stat_result) -> str | None:
    """Why a user other than this one (or root) could change the entries of ``disk_path``
    ``root`` (its ``st``), None where none can. Whoever can moves an engine's namespaces
    away, durable blocks with them, or plants one under the name its next start opens."""
    if st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022:
        return None
    return (
        f"disk_path {root} is a directory owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: "
        f"another user could remove or replace the cache in it"
    )
