"""What this machine can do for KV transfers: CUDA, pinned memory, streams and events.

Used in worker processes (and by tests and tools). On a CUDA build with a GPU the
helpers hand out real CUDA streams and events; on a CPU-only machine they degrade to
stand-ins that run work synchronously, so the same handler code runs everywhere.
``torch.Tensor.pin_memory`` raises on CPU-only torch, hence the probe: callers ask
``can_pin_memory()`` instead of trying. Each fallback is logged once per process.
No I/O beyond allocating memory and reading the cgroup's memory limit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

_logged_fallbacks: set[str] = set()


def log_fallback_once(what: str) -> None:
    """Log ``what`` (a fallback this process takes) at INFO, the first time only."""
    if what not in _logged_fallbacks:
        _logged_fallbacks.add(what)
        logger.info("%s", what)


@functools.cache
def cuda_available() -> bool:
    """True when torch has CUDA and a device is visible."""
    return torch.cuda.is_available()


@functools.cache
def can_pin_memory() -> bool:
    """True when page-locked host memory can be allocated (needs CUDA). Probed once."""
    if not cuda_available():
        return False
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return False
    return True


#: Alignment of ``empty_host`` tensors (a page: what O_DIRECT needs).
HOST_ALIGN = 4096


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
            log_fallback_once("no CUDA: host KV tensors use ordinary (pageable) memory, "
                              "copies run synchronously")
    elif pin and not can_pin_memory():
        raise RuntimeError("pinned host memory was requested but CUDA is not available")
    # Page-aligned, so rows of it can go to the disk with O_DIRECT without a copy.
    nbytes = math.prod(shape) * dtype.itemsize
    base = torch.empty(nbytes + HOST_ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-base.data_ptr()) % HOST_ALIGN
    return base[start:start + nbytes].view(dtype).view(tuple(shape))


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
            raise RuntimeError("device 'cuda' was requested but CUDA is not available; "
                               "use 'cpu' or 'auto'")
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


class TransferStream:
    """An ordered queue of copies on ``device``: a CUDA stream with ``priority`` (lower
    is more urgent), or, for a CPU device, immediate execution.

    ``scope()`` makes the stream current for the enclosed work; ``record_event()``
    returns an object with ``query()`` (never blocks) and ``synchronize()`` (blocks)
    that completes once all work enqueued so far has run.
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

    def record_event(self):
        if self.stream is None:
            return COMPLETED
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
