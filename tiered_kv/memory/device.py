"""What this machine can do for KV transfers: CUDA, pinned memory, streams and events.

Used in worker processes (and by tests and tools). On a CUDA build with a GPU the
helpers hand out real CUDA streams and events; on a CPU-only machine they degrade to
stand-ins that run work synchronously, so the same handler code runs everywhere.
``torch.Tensor.pin_memory`` raises on CPU-only torch, hence the probe: callers ask
``can_pin_memory()`` instead of trying. Each fallback is logged once per process.
Long-lived pinned buffers are mapped here and registered with CUDA (``empty_pinned``),
not taken from torch, whose pinned allocations are rounded up to powers of two.
No I/O beyond allocating memory and reading the cgroup's memory limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import mmap
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

_logged_fallbacks: set[str] = set()


def log_fallback_once(what: str, level: int = logging.INFO) -> None:
    """Log ``what`` (a fallback this process takes) at ``level``, the first time only."""
    if what not in _logged_fallbacks:
        _logged_fallbacks.add(what)
        logger.log(level, "%s", what)


@functools.cache
def cuda_available() -> bool:
    """True when torch has CUDA and a device is visible."""
    return torch.cuda.is_available()


@functools.cache
def can_pin_memory() -> bool:
    """True when page-locked host memory can be allocated (needs CUDA). Probed once,
    the way ``empty_pinned`` allocates it."""
    if not cuda_available():
        return False
    try:
        empty_pinned(HOST_ALIGN)
    except RuntimeError:
        return False
    return True


#: The kernel's transparent huge page settings for private anonymous memory and for
#: shared memory (``empty_shared``'s memfds); ``kernel_huge_pages`` reads them.
THP_SETTINGS = {
    "private": "/sys/kernel/mm/transparent_hugepage/enabled",
    "shared": "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
}


def kernel_huge_pages(memory: str = "private") -> str:
    """The kernel's transparent huge page setting for ``memory`` ("private" or
    "shared"): the bracketed word of its sysfs file (``always``, ``madvise``, ``advise``,
    ``never``...), or "n/a" where there is none."""
    try:
        with open(THP_SETTINGS[memory]) as f:
            text = f.read()
    except OSError:
        return "n/a"
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


#: Alignment of ``empty_host`` tensors (a page: what O_DIRECT needs).
HOST_ALIGN = 4096
#: Long-lived host buffers of at least this size are aligned to it and advised onto
#: transparent huge pages (see ``empty_pageable`` and ``empty_pinned``).
HUGE_PAGE = 2 << 20


def aligned_empty(nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` whose first byte is 4 KiB-aligned
    (``HOST_ALIGN``, what O_DIRECT needs), for a short-lived buffer.

    Pageable host memory or device memory; over-allocates by one page and slices, so it
    works for any allocator. Page-locked memory comes from ``empty_pinned``.
    """
    base = torch.empty(nbytes + HOST_ALIGN, dtype=torch.uint8, device=device)
    start = (-base.data_ptr()) % HOST_ALIGN
    return base[start : start + nbytes]


def empty_pageable(nbytes: int) -> torch.Tensor:
    """An uninitialised pageable uint8 host tensor of ``nbytes``, 4 KiB-aligned, for a
    long-lived buffer (the CPU tier, staging pools).

    From ``HUGE_PAGE`` bytes on it is a private anonymous mapping of its own, starting on
    a 2 MiB boundary and advised for transparent huge pages (``MADV_HUGEPAGE``; the
    kernel's THP setting has the last word). A disk transfer from such memory pins one
    page per 2 MiB instead of 512 and reaches the device in fewer, larger requests
    (docs/benchmarks.md, "Disk tier", host buffers on huge pages). Its pages are
    faulted in, zeroed, on first touch, so short-lived buffers are better taken from
    ``aligned_empty``.
    """
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return aligned_empty(nbytes)
    return _empty_mapped(nbytes)


def empty_pinned(nbytes: int) -> torch.Tensor:
    """An uninitialised page-locked uint8 host tensor of ``nbytes``, 4 KiB-aligned, for a
    long-lived buffer: the pinned counterpart of ``empty_pageable``.

    ``torch.empty(pin_memory=True)`` would take it from torch's caching host allocator
    (``ATen/core/CachingHostAllocator.h``), which rounds every block up to the next power
    of two and keeps freed blocks cached: a 64 GiB CPU tier would lock 128 GiB. This maps
    memory of its own instead, as ``empty_pageable`` does (from 2 MiB on, on transparent
    huge pages), and page-locks exactly those ``nbytes`` with ``cuda_host_register``
    (which faults them all in now). The pages are unlocked and unmapped when the last
    tensor viewing them is freed; the caller keeps a tensor alive while copies into or
    out of it may still run. Raises ``RuntimeError`` without CUDA or when the pages
    cannot be locked.
    """
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    return _empty_mapped(nbytes, on_map=cuda_host_register, on_release=cuda_host_unregister)


def _empty_mapped(
    nbytes: int, on_map: Callable[[int, int], None] | None = None, on_release: Callable[[int], object] | None = None
) -> torch.Tensor:
    """``nbytes`` of a private anonymous mapping of their own, from 2 MiB on starting on a
    2 MiB boundary and advised for huge pages, as a uint8 tensor whose storage is exactly
    those bytes.

    ``on_map(address, nbytes)`` runs on them once they are mapped (if it raises, they
    are unmapped and the error propagates); ``on_release(address)`` runs when the last
    tensor viewing them is freed, while they are still mapped, and then they are unmapped.
    """
    huge = nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    try:
        region = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # what torch.empty raises when memory cannot be had
        raise RuntimeError(f"cannot map {nbytes} bytes of host memory: {e}") from e
    whole = memoryview(region)
    start = (-torch.frombuffer(whole, dtype=torch.uint8).data_ptr()) % HUGE_PAGE if huge else 0
    # The storage starts where ``on_map`` starts: ``is_pinned()`` asks CUDA about the
    # storage's first byte. And tensors hold this memoryview, not the mmap: freeing the
    # mmap unmaps it before its weak references are told, too late for ``on_release``.
    # The memoryview's finalizer holds the mmap instead, so it runs while still mapped.
    view = whole[start : start + nbytes]
    whole.release()
    tensor = torch.frombuffer(view, dtype=torch.uint8)
    address = tensor.data_ptr()
    if huge:
        try:  # before on_map: locking the pages faults them in, and then they stay small
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # a kernel without THP: ordinary pages
            log_fallback_once(f"transparent huge pages are unavailable ({e}); host buffers use 4 KiB pages")
    if on_map is not None:
        try:
            on_map(address, nbytes)
        except BaseException:
            del tensor
            view.release()
            region.close()
            raise
    # Not at exit: tensors still alive then may still be in use by daemon threads.
    weakref.finalize(view, _release_mapping, region, address, on_release).atexit = False
    return tensor


def _release_mapping(region: mmap.mmap, address: int, on_release: Callable[[int], object] | None) -> None:
    # A finalizer: it runs wherever the last tensor was dropped, and must not raise.
    try:
        if on_release is not None:
            on_release(address)
    except Exception:
        logger.exception("releasing the host buffer at %#x failed", address)
    finally:
        region.close()


def cuda_host_register(address: int, nbytes: int) -> None:
    """Page-lock the host memory ``[address, address + nbytes)`` for CUDA copies
    (``cudaHostRegister``), exactly that much, unlike torch's pinned allocations.
    Raises ``RuntimeError`` without CUDA or when CUDA refuses (the error number
    included). Undo with ``cuda_host_unregister`` before the memory is unmapped."""
    if not cuda_available():
        raise RuntimeError(f"pinned host memory ({nbytes} bytes) was requested but CUDA is not available")
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(err) != 0:
        _clear_cuda_error()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed ({_cuda_error(err)})")


def cuda_host_unregister(address: int) -> bool:
    """Undo ``cuda_host_register(address, ...)``. Logs an error with CUDA's error number
    and returns False when CUDA refuses, never raises: it runs from finalizers."""
    err = torch.cuda.cudart().cudaHostUnregister(address)
    if int(err) != 0:
        _clear_cuda_error()
        logger.error("cudaHostUnregister of the host memory at %#x failed (%s)", address, _cuda_error(err))
        return False
    return True


def _cuda_error(err: Any) -> str:  # torch's cudaError
    return f"CUDA error {int(err)}: {torch.cuda.cudart().cudaGetErrorString(err)}"


def _clear_cuda_error() -> None:
    """Reset this thread's last CUDA error. torch's ``cudart()`` bindings leave a failed
    call's error standing, and torch's next kernel launch would raise it as its own."""
    library = _cuda_runtime()
    if library is not None:
        library.cudaGetLastError()


@functools.cache
def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch has loaded (``RTLD_NOLOAD``: never another copy,
    whose errors would be its own), or None."""
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
    log_fallback_once(
        "the CUDA runtime library was not found; a refused cudaHostRegister may "
        "surface as an error of a later CUDA call"
    )
    return None


def empty_host(shape: Sequence[int], dtype: torch.dtype, pin: bool | None = None) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when possible, its first byte aligned to
    ``HOST_ALIGN``.

    ``pin=None`` pins when ``can_pin_memory()``; ``pin=True`` raises ``RuntimeError`` when
    pinning is impossible; ``pin=False`` never pins. Falling back to pageable memory is
    logged once.
    """
    if pin is None:
        pin = can_pin_memory()
        if not pin:
            log_fallback_once("no CUDA: host KV tensors use ordinary (pageable) memory, copies run synchronously")
    elif pin and not can_pin_memory():
        raise RuntimeError("pinned host memory was requested but CUDA is not available")
    # Page-aligned, so rows of it can go to the disk with O_DIRECT without a copy.
    nbytes = math.prod(shape) * dtype.itemsize
    flat = empty_pinned(nbytes) if pin else empty_pageable(nbytes)
    return flat.view(dtype).view(tuple(shape))


def host_memory_limit() -> int:
    """Bytes of memory this process may use: physical RAM, or the cgroup's memory limit
    (a container's) when that is lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; ``"cpu"``; ``"cuda"`` (raises
    ``RuntimeError`` without CUDA). Anything else raises ``ValueError``."""
    if name == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not cuda_available():
            raise RuntimeError("device 'cuda' was requested but CUDA is not available; use 'cpu' or 'auto'")
        return torch.device("cuda")
    raise ValueError(f"device: expected auto, cpu or cuda; got {name!r}")


class CompletedEvent:
    """Stand-in for a CUDA event whose work already ran synchronously (or never will)."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return


#: The one completed event, for work that ran synchronously.
COMPLETED = CompletedEvent()


class HostTimingEvent(CompletedEvent):
    """A completed event that remembers when it was recorded: the CPU stand-in for a
    CUDA event with timing, for work that runs synchronously on the host."""

    __slots__ = ("recorded_at",)

    def __init__(self) -> None:
        self.recorded_at = time.perf_counter()

    def elapsed_time(self, end: "HostTimingEvent") -> float:
        """Milliseconds from this event to ``end``, as ``torch.cuda.Event.elapsed_time``."""
        return (end.recorded_at - self.recorded_at) * 1e3


class TransferStream:
    """An ordered queue of copies on ``device``: a CUDA stream with ``priority`` (lower
    is more urgent), or, for a CPU device, immediate execution.

    ``scope()`` makes the stream current for the enclosed work; ``record_event()``
    returns an object with ``query()`` (never blocks) and ``synchronize()`` (blocks)
    that completes once all work enqueued so far has run. ``record_event(timing=True)``
    also has ``elapsed_time(end)``: milliseconds between two such events, as the device
    ran the work between them.
    """

    def __init__(self, device: torch.device, priority: int = 0):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device, priority=priority) if self.is_cuda else None

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def wait_for_compute(self) -> None:
        """Order later work on this stream after everything already queued on the
        device's current (compute) stream, e.g. the kernels that wrote the KV cache."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def record_event(self, timing: bool = False) -> CompletedEvent | torch.cuda.Event:
        if self.stream is None:
            return HostTimingEvent() if timing else COMPLETED
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
