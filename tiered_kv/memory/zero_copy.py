"""KV planes seen as rows of one CUDA tensor, so a kernel moves a whole job across the bus.

Worker process. A pinned host buffer is mapped into the GPU's address space (unified
virtual addressing), so a CUDA kernel can read and write it in place. ``PlaneRows``
spans every plane of one side of a transfer (the device's layers, or the host tier's)
with one 2-D tensor whose rows are equal slices of the address range from the first
plane to the end of the last. Any set of blocks of every plane is then a list of row
numbers, and ``copy_blocks`` moves a job of the GPU <-> CPU handlers
(``tiered_kv.cpu.handlers``) in one Triton kernel from row to row (``fused_copy``), or
two torch kernels: an ``index_select`` from one side into a staging tensor on the
device and an ``index_copy_`` into the other. Either way a job's cost does not grow
with its layers (docs/benchmarks.md, "GPU <-> CPU"). The handlers' DMA path uses the
same view to gather a job into its staging in one copy.

The spanning tensor covers whatever lies between the planes too (other allocations),
but only row numbers inside the planes are ever formed. Its rows are the largest
slice that divides the block row and every plane's distance from the first, so planes
anywhere (vLLM allocates each layer on its own) still work; the row numbers grow when
the slices are small.

The tensors are made through ``__cuda_array_interface__``, which takes a device
address and a layout: no copy, no allocation. The device address of a host page comes
from the driver (``cuPointerGetAttribute``) and is usually the host address itself.
Where the driver has none (the memory is not pinned, or no CUDA driver),
``PlaneRows.of`` returns None and callers keep their DMA path. No I/O.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

#: ``CU_POINTER_ATTRIBUTE_DEVICE_POINTER`` of the CUDA driver API.
_DEVICE_POINTER_ATTRIBUTE = 3
#: Array-interface type strings of the integer types rows are moved as, widest first.
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
    status = driver.cuPointerGetAttribute(ctypes.byref(out), _DEVICE_POINTER_ATTRIBUTE, ctypes.c_uint64(host_address))
    return out.value if status == 0 else None


class _ArrayInterface:
    """What ``torch.as_tensor`` reads to alias memory it did not allocate; it keeps this
    object, and so ``owner``, alive as long as the tensor."""

    def __init__(self, address: int, shape: Sequence[int], dtype: torch.dtype, owner: object):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": _TYPESTRS[dtype],
            "data": (address, False),
            "version": 3,
            "strides": None,
        }
        self.owner = owner


def _word_dtype(nbytes: int) -> torch.dtype:
    return next(d for d in _TYPESTRS if nbytes % d.itemsize == 0)


class PlaneRows:
    """The planes of one side of a transfer as rows of one tensor (CUDA, or a host view
    in tests).

    Build with ``of``. ``rows`` is a 2-D tensor (of the widest integer words that
    divide a slice) whose row ``plane_start[p] + block * plane_step[p] + j`` is the
    ``j``-th slice of ``block`` in plane ``p``, for ``j < rows_per_block``.
    ``index(block_ids)`` lists those rows for every plane, plane by plane and block by
    block: gathering them and scattering the result with another side's ``index`` of
    other blocks moves those blocks' bytes across.
    """

    def __init__(self, rows: torch.Tensor, plane_start: np.ndarray, plane_step: np.ndarray, rows_per_block: int):
        self.rows = rows
        self.plane_start = plane_start
        self.plane_step = plane_step
        self.rows_per_block = rows_per_block

    @classmethod
    def of(cls, planes: Sequence[torch.Tensor], device: torch.device) -> "PlaneRows | None":
        """``planes``: 2-D tensors of contiguous block rows, any distance apart (a
        block-major host tier's planes are strided), on CUDA ``device`` or in pinned host
        memory mapped for it. None when the rows are not all of one length (layers of
        several block sizes), a host plane is not mapped, or the planes are mapped at
        different offsets from their host addresses (several registrations that the
        device sees apart). With ``device`` the CPU, the rows are a view of host planes
        that share one storage (None where they do not). Raises ``ValueError`` for a
        plane whose rows are not contiguous."""
        block_bytes = planes[0].shape[1] * planes[0].element_size()
        mapped_host = planes[0].device.type == "cpu" and device.type == "cuda"
        starts, steps, shift = [], [], None
        for p in planes:
            if p.stride(1) != 1:
                raise ValueError("planes must be rows of contiguous bytes")
            if p.shape[1] * p.element_size() != block_bytes:
                return None
            address = p.data_ptr()
            if mapped_host:
                mapped = device_address(address)
                if mapped is None or (shift is not None and mapped - address != shift):
                    return None
                shift = mapped - address
            starts.append(address)
            steps.append(p.stride(0) * p.element_size())
        first = min(starts)
        end = max(s + (p.shape[0] - 1) * step + block_bytes for s, step, p in zip(starts, steps, planes))
        offsets = [s - first for s in starts]
        slice_bytes = math.gcd(block_bytes, *offsets, *steps)
        dtype = _word_dtype(slice_bytes)
        shape = ((end - first) // slice_bytes, slice_bytes // dtype.itemsize)
        if device.type == "cuda":
            with torch.cuda.device(device):
                rows = torch.as_tensor(_ArrayInterface(first + (shift or 0), shape, dtype, list(planes)), device=device)
        else:
            host_rows = _host_rows(planes, first, shape, dtype)
            if host_rows is None:
                return None
            rows = host_rows
        return cls(
            rows,
            np.array(offsets, dtype=np.int64) // slice_bytes,
            np.array(steps, dtype=np.int64) // slice_bytes,
            block_bytes // slice_bytes,
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in all planes together."""
        return len(self.plane_start) * self.rows_per_block * self.slice_bytes

    @property
    def slice_bytes(self) -> int:
        return self.rows.shape[1] * self.rows.element_size()

    def index(self, block_ids: np.ndarray) -> np.ndarray:
        """Row numbers of blocks ``block_ids`` of every plane (plane-major, then block,
        then slice)."""
        firsts = self.plane_start[:, None] + np.asarray(block_ids, dtype=np.int64)[None, :] * self.plane_step[:, None]
        if self.rows_per_block == 1:
            return firsts.ravel()
        return (firsts[:, :, None] + np.arange(self.rows_per_block)).ravel()


def _host_rows(
    planes: Sequence[torch.Tensor], first: int, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor | None:
    """A host view of ``shape`` words of ``dtype`` from address ``first``, over the one
    storage every plane lies in; None where they lie in several."""
    storage = planes[0].untyped_storage()
    if any(p.untyped_storage().data_ptr() != storage.data_ptr() for p in planes):
        return None
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    start = first - storage.data_ptr()
    return whole[start : start + shape[0] * shape[1] * dtype.itemsize].view(dtype).view(shape)


#: Most device memory a copy takes for staging; larger jobs move in parts of this size.
#: vLLM leaves little device memory beside its KV cache, and a job can be thousands of
#: blocks (a long prompt's prefix).
MAX_STAGING_BYTES = 64 << 20


def copy_blocks(
    src: PlaneRows, dst: PlaneRows, src_ids: np.ndarray, dst_ids: np.ndarray, max_staging_bytes: int = MAX_STAGING_BYTES
) -> None:
    """Copy block ``src_ids[i]`` of every plane of ``src`` to block ``dst_ids[i]`` of
    ``dst`` (the same planes in the same order), on the current stream: on CUDA with
    Triton, a job of ``FUSED_MIN_BYTES`` or more in one kernel from row to row
    (``fused_copy``); else per part of at most ``max_staging_bytes``, a gather into
    staging on ``src.rows``' device (CUDA, or CPU in tests) and a scatter into ``dst``."""
    device = src.rows.device
    fused = device.type == "cuda" and FUSED_KERNEL and len(src_ids) * src.block_bytes >= FUSED_MIN_BYTES
    copy_rows = _fused_copy_rows() if fused else None
    if copy_rows is not None:
        (src_rows, src_index), (dst_rows, dst_index) = _common_rows(src, dst, src_ids, dst_ids)
        both = torch.from_numpy(np.concatenate([src_index, dst_index])).to(device, non_blocking=True)
        copy_rows(src_rows, dst_rows, both[: len(src_index)], both[len(src_index) :])
        return
    per_part = max(1, max_staging_bytes // src.block_bytes)
    for start in range(0, len(src_ids), per_part):
        src_index = src.index(src_ids[start : start + per_part])
        dst_index = dst.index(dst_ids[start : start + per_part])
        both = torch.from_numpy(np.concatenate([src_index, dst_index])).to(device, non_blocking=True)
        staging = src.rows.index_select(0, both[: len(src_index)])
        # The two sides may slice a block differently: the same bytes in rows of another shape.
        dst.rows.index_copy_(0, both[len(src_index) :], staging.view(dst.rows.dtype).view(-1, dst.rows.shape[1]))


#: Whether ``copy_blocks`` uses the one-kernel copy where it can (``tools/bench_gpu_cpu.py``
#: turns it off to measure the two-kernel path beside it), and from how many bytes a job:
#: a Triton launch costs more CPU than torch's two, which jobs of a few MiB notice
#: (``tools/replay.py --gpu``: 0.49 against 0.34 ms a store job of 3.5 MiB on an H200),
#: while from 16 MiB the one kernel moves as much one way and more both ways at once.
FUSED_KERNEL = True
FUSED_MIN_BYTES = 16 << 20


@functools.cache
def _fused_copy_rows() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    try:
        from tiered_kv.memory.fused_copy import copy_rows
    except ImportError:  # no Triton: the two-kernel path
        return None
    return copy_rows


def _common_rows(
    src: PlaneRows, dst: PlaneRows, src_ids: np.ndarray, dst_ids: np.ndarray
) -> tuple[tuple[torch.Tensor, np.ndarray], tuple[torch.Tensor, np.ndarray]]:
    """Both sides as rows of one length (the largest that divides both sides' slices),
    with the row numbers of the blocks named."""
    common = math.gcd(src.slice_bytes, dst.slice_bytes)
    dtype = _word_dtype(common)
    out = []
    for side, ids in ((src, src_ids), (dst, dst_ids)):
        index, per = side.index(ids), side.slice_bytes // common
        if per > 1:
            index = (index[:, None] * per + np.arange(per)).ravel()
        out.append((side.rows.view(dtype).view(-1, common // dtype.itemsize), index))
    return out[0], out[1]
