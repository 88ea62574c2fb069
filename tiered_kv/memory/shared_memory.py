"""Host memory that the disk I/O process can reach: shared regions, named by number.

A worker that runs its disk I/O in a helper process (``tiered_kv.disk.worker.io_process``)
allocates the buffers that helper reads and writes, the CPU tier and the disk staging
buffers, with ``empty_shared``: each is a memfd (anonymous shared memory, no file on any
filesystem) mapped ``MAP_SHARED``. ``locate`` turns an address in this process into
``(region, offset)``, the form in which a buffer crosses to the helper, which maps the
same memfd once (``MappedRegions``) and from then on reads and writes those bytes in
place: no copy, only the address travels.

Worker processes call ``empty_shared``/``locate``; the I/O process calls
``MappedRegions``. No I/O beyond mapping memory (and reading the kernel's huge page
setting for shared memory).

The regions hold KV bytes, which encode users' prompts. A memfd has no name in any
directory, so nothing can be planted in its place or open it by name; its mode is
still set to ``0600`` (the kernel makes it ``0777``), so that reaching it through
``/proc/<pid>/fd`` takes its owner's rights as well as the right to inspect that process.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from tiered_kv.abstract import Closing
from tiered_kv.memory.device import (
    HUGE_PAGE,
    THP_SETTINGS,
    cuda_host_register,
    cuda_host_unregister,
    kernel_huge_pages,
    log_fallback_once,
)

__all__ = ["SharedRegion", "empty_shared", "locate", "region_fd", "on_free", "MappedRegions"]


class SharedRegion(NamedTuple):
    """One memfd mapping of this process."""

    id: int
    fd: int
    address: int
    nbytes: int


_ids = itertools.count(1)
# Reentrant: the collector may free a region, and so run its finalizer (_forget), at any
# allocation, also one made while this thread holds the lock.
_lock = threading.RLock()
_starts: list[int] = []  # sorted addresses of live regions
_regions: dict[int, SharedRegion] = {}  # address -> region
_free_listeners: list[weakref.WeakMethod] = []


def _advise_huge_pages(region: mmap.mmap) -> None:
    """Ask for huge pages for a shared region, and warn once where the kernel's setting
    for shared memory gives it none. On 4 KiB pages a disk transfer pins 512 pages per
    2 MiB, which holds ``disk_io: process`` well under the raw device's speed; with
    ``shmem_enabled`` set to ``advise`` it is not (docs/benchmarks.md, "Disk tier",
    shared memory on huge pages)."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:
            log_fallback_once(f"shared host memory cannot use huge pages ({e})")
    setting = kernel_huge_pages("shared")
    if setting in ("never", "deny"):
        log_fallback_once(
            f"shared host memory gets no huge pages here (the kernel's shmem_enabled is {setting!r}), "
            f"so disk I/O to and from it (the CPU tier and staging buffers with disk_io: process) "
            f"runs at about half to three quarters of the device's speed. To give it huge "
            f"pages: echo advise > {THP_SETTINGS['shared']}",
            logging.WARNING,
        )


def empty_shared(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` in a new shared region (page-aligned,
    advised for huge pages where the kernel gives them to shared memory).

    ``pin=True`` page-locks it for CUDA copies (``cuda_host_register``: exactly
    ``nbytes``, where torch's pinned allocations are rounded up to a power of two) and
    raises ``RuntimeError`` when that fails. When the last tensor viewing the region is
    freed it is unlocked, unmapped and forgotten, in that order."""
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    try:
        fd = os.memfd_create("tiered-kv", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as e:
        raise RuntimeError(f"shared host memory needs memfd_create (Linux): {e}") from e
    try:
        os.fchmod(fd, 0o600)  # KV bytes: its owner's only, also through /proc/<pid>/fd
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.close(fd)
        raise RuntimeError(f"cannot map {nbytes} bytes of shared host memory: {e}") from e
    if nbytes >= HUGE_PAGE:
        _advise_huge_pages(region)
    # Tensors hold a memoryview and its finalizer the mmap, so the finalizer runs while
    # the region is still mapped: freeing the mmap itself would unmap it before its weak
    # references are told, and CUDA must forget the pages before they go.
    view = memoryview(region)
    tensor = torch.frombuffer(view, dtype=torch.uint8)
    address = tensor.data_ptr()
    if pin:
        try:
            cuda_host_register(address, nbytes)
        except RuntimeError:
            del tensor
            view.release()
            region.close()
            os.close(fd)
            raise
    entry = SharedRegion(next(_ids), fd, address, nbytes)
    with _lock:
        bisect.insort(_starts, address)
        _regions[address] = entry
    # Not at exit: tensors still alive then may still be in use by daemon threads.
    weakref.finalize(view, _forget, entry, pin, region).atexit = False
    return tensor


def on_free(method: Callable[[int], None]) -> None:
    """Call the bound ``method(region_id)`` whenever a shared region is freed (from the
    thread that dropped its last tensor, maybe inside a lock of the caller's: it must
    only record the id). Held weakly."""
    with _lock:
        _free_listeners.append(weakref.WeakMethod(method))


def _forget(entry: SharedRegion, pinned: bool, region: mmap.mmap) -> None:
    with _lock:
        if _regions.get(entry.address) is entry:
            del _regions[entry.address]
            _starts.pop(bisect.bisect_left(_starts, entry.address))
        registered = _free_listeners[:]  # a nested _forget may prune the list meanwhile
        listeners = [m() for m in registered]
        _free_listeners[:] = [m for m, alive in zip(registered, listeners) if alive is not None]
    if pinned:
        cuda_host_unregister(entry.address)  # logs, never raises: this is a finalizer
    region.close()
    os.close(entry.fd)
    for listener in listeners:
        if listener is not None:
            listener(entry.id)


def locate(address: int, nbytes: int) -> tuple[SharedRegion, int] | None:
    """The region holding ``[address, address + nbytes)`` and the offset there, or None
    when those bytes are not (wholly) in one shared region of this process."""
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return None
        region = _regions[_starts[i]]
    offset = address - region.address
    return (region, offset) if offset + nbytes <= region.nbytes else None


def region_fd(region_id: int) -> int:
    """The memfd of live region ``region_id`` (to pass to the I/O process)."""
    with _lock:
        for region in _regions.values():
            if region.id == region_id:
                return region.fd
    raise KeyError(f"no live shared region {region_id}")


class MappedRegions(Closing):
    """The I/O process's side: regions received as file descriptors, mapped once each.
    Not thread-safe for ``add``; ``array`` may run on any thread once added."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def add(self, region_id: int, fd: int, nbytes: int) -> None:
        """Map region ``region_id`` from ``fd`` (which this call closes)."""
        try:
            self._maps[region_id] = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def remove(self, region_id: int) -> None:
        """Forget region ``region_id`` (the worker freed it): unmapped once no array
        made from it is left."""
        self._maps.pop(region_id, None)

    def array(self, region_id: int, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
        """Bytes of a region as a uint8 array (``strides`` in bytes), sharing its memory.
        Raises ``ValueError`` when they fall outside it."""
        region = self._maps.get(region_id)
        if region is None:
            raise ValueError(f"shared region {region_id} was never sent to this process")
        return np.ndarray(shape, dtype=np.uint8, buffer=region, offset=offset, strides=strides)

    def tensor(self, region_id: int, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(self.array(region_id, offset, shape, strides))

    def close(self) -> None:
        self._maps.clear()  # unmapped once no array views them
