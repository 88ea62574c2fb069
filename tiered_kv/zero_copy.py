"""Page-locked host memory seen as CUDA tensors, so kernels move KV across the bus.

Worker process. A pinned host buffer is mapped into the GPU's address space (unified
virtual addressing), so a CUDA kernel can read and write it in place. ``on_device``
wraps such a buffer, and ``stacked`` wraps equally spaced planes of one tier as one
3-D tensor. A whole transfer job then runs as one ``index_select`` or ``index_copy_``
over every layer (``tiered_kv.worker.cpu_gpu``), rather than one DMA copy per layer
and per run of slots. On an H100 that took 0.5 MiB blocks from 10 to 50 GB/s, and the
CPU time from 1.8 ms to 20 us per 32-block job (docs/benchmarks.md, "GPU <-> CPU").

The tensors are made through ``__cuda_array_interface__``, which takes a device
address and a layout: no copy, no allocation. The device address of a host page comes
from the driver (``cuPointerGetAttribute``), and is usually the host address itself.
Where the driver has none (the memory is not pinned, or it has no CUDA mapping),
``on_device`` returns None and callers keep their DMA path. No I/O.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

#: ``CU_POINTER_ATTRIBUTE_DEVICE_POINTER`` of the CUDA driver API.
_DEVICE_POINTER_ATTRIBUTE = 3
#: Array-interface type strings of the integer types that KV rows are copied as.
_TYPESTRS = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.uint8: "|u1"}


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def device_address(host_address: int) -> int | None:
    """The address at which the current CUDA device reaches the pinned host byte at
    ``host_address``, or None where it cannot (not page-locked, or no driver)."""
    driver = _driver()
    if driver is None:
        return None
    out = ctypes.c_uint64()
    status = driver.cuPointerGetAttribute(ctypes.byref(out), _DEVICE_POINTER_ATTRIBUTE,
                                          ctypes.c_uint64(host_address))
    return out.value if status == 0 else None


class _ArrayInterface:
    """What ``torch.as_tensor`` reads to alias memory it did not allocate; it keeps this
    object, and so ``owner``, alive as long as the tensor."""

    def __init__(self, address: int, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype,
                 owner: object):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "strides": tuple(s * dtype.itemsize for s in strides),
            "typestr": _TYPESTRS[dtype], "data": (address, False), "version": 3}
        self.owner = owner


def _alias(address: int, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype,
           device: torch.device, owner: object) -> torch.Tensor:
    with torch.cuda.device(device):
        return torch.as_tensor(_ArrayInterface(address, shape, strides, dtype, owner), device=device)


def on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A tensor on CUDA ``device`` over the same bytes as pinned CPU tensor ``host``
    (same shape and strides; an integer dtype of ``_TYPESTRS``), or None when the
    device cannot address that memory. Writes through either are seen by the other
    once the kernel that made them is done."""
    if host.device.type != "cpu" or host.dtype not in _TYPESTRS or not host.is_pinned():
        return None
    address = device_address(host.data_ptr())
    if address is None:
        return None
    return _alias(address, host.shape, host.stride(), host.dtype, device, host)


def stacked(planes: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``planes`` (CUDA tensors alike in shape, strides and dtype) as one tensor with a
    leading plane dimension, when each starts the same distance after the one before;
    else None. Element ``[p, ...]`` is ``planes[p][...]``: the planes keep their memory,
    and the result keeps them alive."""
    first = planes[0]
    if len(planes) < 2 or first.device.type != "cuda" or first.dtype not in _TYPESTRS:
        return None
    if any(p.shape != first.shape or p.stride() != first.stride() or p.dtype != first.dtype
           or p.device != first.device for p in planes):
        return None
    gap_bytes = planes[1].data_ptr() - first.data_ptr()
    extent_bytes = first.shape[0] * first.stride(0) * first.element_size()
    if gap_bytes < extent_bytes or gap_bytes % first.element_size():  # overlapping, or misaligned
        return None
    if any(b.data_ptr() - a.data_ptr() != gap_bytes for a, b in zip(planes, planes[1:])):
        return None
    return _alias(first.data_ptr(), (len(planes), *first.shape), (gap_bytes // first.element_size(), *first.stride()),
                  first.dtype, first.device, list(planes))
