"""Block I/O backends of the disk tier: POSIX (O_DIRECT or buffered) and KvikIO (GDS).

Worker processes only (and tools that read the cache). Each backend reads and writes
whole, 4 KiB-aligned slot ranges of a slab file at explicit offsets, makes them durable
with ``sync``, and runs I/O on its own thread pool (``submit``; ``io_pool.IOPool``: reads
before writes), so the handler thread that packs the next chunk never waits on the disk.

- ``PosixBackend``: ``os.preadv``/``os.pwritev`` (which release the GIL) on a thread pool.
  Files are opened with ``O_DIRECT`` when a probe shows the filesystem accepts it
  (buffers, offsets and lengths are 4 KiB-aligned: see ``aligned_empty``); otherwise
  buffered. ``sync`` is ``fdatasync`` either way (O_DIRECT bypasses the page cache but
  not the device's write cache, and converting preallocated extents is metadata).
- ``KvikIOBackend``: ``kvikio.CuFile`` pread/pwrite, GPUDirect Storage straight to and
  from device memory where the driver supports it, KvikIO's compat mode otherwise.
  KvikIO imports without a GPU but fails on the first I/O without ``libcuda``, so
  ``KvikIOBackend.probe`` does a real 4 KiB write and read before it is chosen.

Every backend also has ``preadv``/``pwritev`` of host byte views on the file's POSIX
descriptor; the disk store moves all host memory that way (the views are made by the
thread that submits, so I/O threads touch no tensors), and only device rows through
``pread``/``pwrite``.

``select_backend("auto" | "kvikio" | "posix", ...)`` picks one and logs which and why.
"""

from __future__ import annotations

import errno
import fcntl
import importlib
import logging
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiered_kv.abstract import Closing
from tiered_kv.config_values import DEFAULT_IO_THREADS
from tiered_kv.memory.device import HOST_ALIGN, aligned_empty
from tiered_kv.disk.format.safe_open import fd_path, open_file
from tiered_kv.disk.store.io_pool import READ, IOPool

logger = logging.getLogger(__name__)

ALIGN = HOST_ALIGN  # buffers, offsets and lengths of O_DIRECT I/O
BACKENDS = ("auto", "kvikio", "posix")
#: The disk store coalesces runs of consecutive slots into reads/writes of up to this
#: many bytes (a larger block is one call of its own).
MAX_IO_BYTES = 2 << 20
#: Most buffers one vectored call takes (Linux's ``UIO_MAXIOV``).
IOV_MAX = os.sysconf("SC_IOV_MAX")


class BackendUnavailableError(RuntimeError):
    """The requested I/O backend cannot run on this machine (the message says why)."""


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0


def host_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (shares memory)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"expected a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
    return t.view(torch.uint8).reshape(-1).numpy().data


@dataclass
class BackendFile:
    """An open slab file. ``direct`` says whether I/O bypasses the page cache."""

    path: Path
    fd: int
    direct: bool
    handle: Any = None  # backend-specific (a kvikio.CuFile)


class IOBackend(Closing, ABC):
    """Reads and writes byte ranges of slab files; thread-safe.

    ``pread``/``pwrite`` move exactly ``buf``'s bytes at ``offset`` or raise ``OSError``
    (a short transfer is an error: ``EIO`` at end of file). ``buf`` is a contiguous
    uint8 tensor; host memory always works, device memory only where
    ``device_buffers`` is True.
    """

    name: str = "?"
    #: Whether pread/pwrite accept CUDA tensors.
    device_buffers: bool = False
    #: Whether device buffers go straight to the disk (GPUDirect Storage).
    gds: bool = False

    def __init__(self, threads: int = DEFAULT_IO_THREADS):
        self.threads = threads
        self._pool = IOPool(threads, f"tkv-{self.name}-io")

    @abstractmethod
    def open(
        self, path: str | os.PathLike, readonly: bool = False, dir_fd: int | None = None, owner: int | None = None
    ) -> BackendFile:
        """Open an existing slab file for block I/O: ``path``'s name in the directory open
        as ``dir_fd`` when given (``safe_open``: a regular file of uid ``owner``, no link
        followed, no FIFO opened)."""

    @abstractmethod
    def pread(self, f: BackendFile, buf: torch.Tensor, offset: int) -> None:
        """Fill ``buf`` from ``offset``."""

    @abstractmethod
    def pwrite(self, f: BackendFile, buf: torch.Tensor, offset: int) -> None:
        """Write all of ``buf`` at ``offset`` (not yet durable: see ``sync``)."""

    def preadv(self, f: BackendFile, views: Sequence[memoryview], offset: int) -> None:
        """Fill host ``views`` in turn from ``offset`` (vectored I/O on the file's POSIX
        descriptor, O_DIRECT where the filesystem takes it; every backend has one)."""
        _move_all(os.preadv, f, views, offset, "short read from {path} at offset {at} (end of file?)")

    def pwritev(self, f: BackendFile, views: Sequence[memoryview], offset: int) -> None:
        """Write host ``views`` one after the other at ``offset`` (see ``preadv``; not yet
        durable: see ``sync``)."""
        _move_all(os.pwritev, f, views, offset, "short write to {path} at offset {at}")

    def sync(self, f: BackendFile) -> None:
        """Make every completed write to ``f`` durable (``fdatasync``)."""
        os.fdatasync(f.fd)

    def close_file(self, f: BackendFile) -> None:
        os.close(f.fd)

    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = READ) -> Future:
        """Run ``fn(*args)`` on this backend's I/O thread pool, queued reads (``READ``)
        before writes (``io_pool.WRITE``)."""
        return self._pool.submit(fn, *args, priority=priority)

    def describe(self) -> str:
        return self.name

    def shutdown(self) -> None:
        """Stop the I/O thread pool once its queued work is done. Idempotent."""
        self._pool.shutdown(wait=True)


def _move_all(
    call: Callable[[int, list, int], int], f: BackendFile, views: Sequence[memoryview], offset: int, short: str
) -> None:
    """``call`` (``os.preadv``/``os.pwritev``) until every byte of ``views`` is moved."""
    views = list(views)
    first = done = 0
    while first < len(views):
        n = call(f.fd, views[first:] if first else views, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, short.format(path=f.path, at=offset + done))
        done += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]


class PosixBackend(IOBackend):
    """``preadv``/``pwritev`` on a thread pool; O_DIRECT where the filesystem takes it."""

    name = "posix"

    def __init__(self, threads: int = DEFAULT_IO_THREADS, direct: bool = True):
        super().__init__(threads)
        self.want_direct = direct

    def open(
        self, path: str | os.PathLike, readonly: bool = False, dir_fd: int | None = None, owner: int | None = None
    ) -> BackendFile:
        path = Path(path)
        fd, direct = _open_fd(path, readonly, self.want_direct, dir_fd, owner)
        return BackendFile(path, fd, direct)

    def pread(self, f: BackendFile, buf: torch.Tensor, offset: int) -> None:
        self.preadv(f, [host_view(buf)], offset)

    def pwrite(self, f: BackendFile, buf: torch.Tensor, offset: int) -> None:
        self.pwritev(f, [host_view(buf)], offset)

    def describe(self) -> str:
        return f"posix ({self.threads} threads, O_DIRECT {'requested' if self.want_direct else 'off'})"


class KvikIOBackend(IOBackend):
    """``kvikio.CuFile`` reads and writes; GDS for device buffers where available."""

    name = "kvikio"
    device_buffers = True

    def __init__(self, threads: int = DEFAULT_IO_THREADS):
        import kvikio  # noqa: F401  (probe() has shown it works)

        super().__init__(threads)
        self._kvikio = kvikio
        self.gds = not _kvikio_compat_mode()

    @staticmethod
    def probe(directory: str | os.PathLike[str]) -> str | None:
        """None if KvikIO can really read and write here, else why not."""
        try:
            import kvikio
        except Exception as e:  # ImportError, or a broken install raising anything
            return f"import kvikio failed: {e}"
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvikio-probe-") as tmp:
                data = np.arange(ALIGN, dtype=np.uint8)
                back = np.zeros(ALIGN, dtype=np.uint8)
                f = kvikio.CuFile(tmp.name, "r+")
                try:
                    f.pwrite(data, ALIGN, 0).get()
                    f.pread(back, ALIGN, 0).get()
                finally:
                    f.close()
                if not np.array_equal(data, back):
                    return "a KvikIO probe write did not read back the same bytes"
        except Exception as e:
            return f"a KvikIO probe read/write failed: {type(e).__name__}: {e}"
        return None

    def open(
        self, path: str | os.PathLike, readonly: bool = False, dir_fd: int | None = None, owner: int | None = None
    ) -> BackendFile:
        path = Path(path)
        # A plain descriptor for fdatasync (KvikIO has no sync call) and vectored host I/O;
        # KvikIO opens the same file through it.
        fd, _ = _open_fd(path, readonly, True, dir_fd, owner)
        try:
            handle = self._kvikio.CuFile(fd_path(fd) or str(path), "r" if readonly else "r+")
        except BaseException:
            os.close(fd)
            raise
        return BackendFile(path, fd, True, handle)

    def _buffer(self, buf: torch.Tensor) -> Any:
        return buf if buf.device.type == "cuda" else buf.numpy()

    def pread(self, f: BackendFile, buf: torch.Tensor, offset: int) -> None:
        n = f.handle.pread(self._buffer(buf), buf.numel(), offset).get()
        if n != buf.numel():
            raise OSError(errno.EIO, f"short read from {f.path} at offset {offset}: {n} of {buf.numel()}")

    def pwrite(self, f: BackendFile, buf: torch.Tensor, offset: int) -> None:
        n = f.handle.pwrite(self._buffer(buf), buf.numel(), offset).get()
        if n != buf.numel():
            raise OSError(errno.EIO, f"short write to {f.path} at offset {offset}: {n} of {buf.numel()}")

    def close_file(self, f: BackendFile) -> None:
        try:
            f.handle.close()
        finally:
            os.close(f.fd)

    def describe(self) -> str:
        return f"kvikio ({'GDS' if self.gds else 'compat mode'}, {self.threads} threads)"


def select_backend(kind: str, directory: str | os.PathLike, threads: int = DEFAULT_IO_THREADS) -> IOBackend:
    """Build the backend ``kind`` names (``auto``, ``kvikio`` or ``posix``) for files in
    ``directory``. ``auto`` takes KvikIO only if its probe succeeds. Logs the choice and
    why; raises ``BackendUnavailableError`` when ``kvikio`` is asked for and cannot run,
    ``ValueError`` for an unknown kind."""
    if kind not in BACKENDS:
        raise ValueError(f"io_backend: expected one of {', '.join(BACKENDS)}; got {kind!r}")
    if kind == "posix":
        logger.info("disk I/O backend: posix (configured)")
        return PosixBackend(threads)
    reason = KvikIOBackend.probe(directory)
    if reason is None:
        backend = KvikIOBackend(threads)
        logger.info(
            "disk I/O backend: %s (%s)",
            backend.describe(),
            "configured" if kind == "kvikio" else "auto: KvikIO probe succeeded",
        )
        return backend
    if kind == "kvikio":
        raise BackendUnavailableError(
            f"io_backend=kvikio cannot run here: {reason}. Install "
            f"tiered-kv[cu12] or [cu13] on a machine with a CUDA driver, "
            f"or use io_backend=posix/auto"
        )
    logger.info("disk I/O backend: posix (auto: KvikIO not usable: %s)", reason)
    return PosixBackend(threads)


def _kvikio_compat_mode() -> bool:
    """Whether KvikIO falls back to POSIX I/O (no GDS); the API moved between releases."""
    # A submodule that ``import kvikio`` does not load in every release (26.10 does not).
    defaults = importlib.import_module("kvikio.defaults")
    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(defaults, name, None)
        if fn is not None:
            try:
                value = fn()
            except Exception:
                continue
            return bool(value) if not hasattr(value, "name") else value.name != "OFF"
    return True


def _open_fd(
    path: Path, readonly: bool, want_direct: bool, dir_fd: int | None = None, owner: int | None = None
) -> tuple[int, bool]:
    """A descriptor of ``path`` (``safe_open.open_file``; its name in ``dir_fd`` when
    given), with O_DIRECT when wanted and the filesystem takes it; and whether it has it."""
    fd = open_file(
        path.name if dir_fd is not None else path,
        os.O_RDONLY if readonly else os.O_RDWR,
        path=path,
        dir_fd=dir_fd,
        owner=owner,
        fix_mode=not readonly,
    )
    if want_direct and hasattr(os, "O_DIRECT"):
        reason = _set_direct(fd)
        if reason is None:
            return fd, True
        _log_once(f"{path.parent}: O_DIRECT unavailable ({reason}); using buffered I/O + fdatasync")
    return fd, False


def _set_direct(fd: int) -> str | None:
    """Turn on O_DIRECT for ``fd`` if an aligned O_DIRECT read works there (None), else
    leave it off and say why not."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        if os.fstat(fd).st_size >= ALIGN:
            buf = aligned_empty(ALIGN)
            os.preadv(fd, [host_view(buf)], 0)
    except OSError as e:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return e.strerror
    return None


_logged: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.info("%s", msg)
