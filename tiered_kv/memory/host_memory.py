"""Host (CPU-tier) KV memory and the block byte codec shared by the tiers.

Worker process. ``HostKVCache`` holds ``num_slots`` offloaded blocks *block-major*:
one allocation of ``num_slots`` rows, each slot's row its block's bytes in the codec's
byte order, so a slot is one contiguous piece of memory that the disk tier writes and
reads as it lies. Each layer is still seen as a tensor shaped like the device layer
(``num_blocks = num_slots * block_size_factor``; CPU slot ``s`` is kernel blocks
``s*f .. s*f+f-1``, the seed's ``expand_block_ids`` semantics): a strided view whose
kernel-block rows lie one kernel block of all layers apart. The memory is pinned when
CUDA is present and pageable otherwise (logged once, see ``tiered_kv.memory.device``). A tier
larger than the memory the process may use (RAM or the cgroup limit) is refused before
anything is allocated; a pinned allocation that fails (locked-memory limits) falls back
to pageable memory with a warning saying what to change.

``pack_blocks`` / ``unpack_blocks`` turn offloaded blocks into flat bytes and back, so
the disk tier can write whole blocks from any per-layer tensors (device or host). Byte
order of one offloaded block: its kernel blocks ``0..f-1`` one after the other; within
a kernel block, layers in layout order, and within a layer whose KV dimension comes
before num_blocks, K then V. With one kernel block per offloaded block (``f = 1``, the
default) that is layers in layout order, K before V. Both loop over layers only.

No file I/O here; only memory allocation, tensor copies and reading the memory limit.
The disk tier's byte views of the slots where they lie are ``slot_views.py``'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from tiered_kv.memory import device as machine  # module, so tests can stand in for its probes
from tiered_kv.config import ConfigError, format_size
from tiered_kv.memory.device import empty_host, host_memory_limit
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.memory.shared_memory import empty_shared

logger = logging.getLogger(__name__)


def expand_block_ids(block_ids: Sequence[int] | np.ndarray, block_size_factor: int, skip_count: int = 0) -> np.ndarray:
    """Kernel (GPU-sized) block ids of offloaded blocks made of ``block_size_factor``
    kernel blocks each, with the first ``skip_count`` kernel ids dropped.

    ``[0, 1, 3]`` with factor 4 -> ``[0..3, 4..7, 12..15]``. Returns int64.
    Raises ``ValueError`` unless ``0 <= skip_count < block_size_factor``.
    """
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if block_size_factor < 1:
        raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
    if not 0 <= skip_count < block_size_factor:
        raise ValueError(f"skip_count must be in [0, {block_size_factor}), got {skip_count}")
    if block_size_factor == 1:
        return ids.copy()
    kernel = (ids[:, None] * block_size_factor + np.arange(block_size_factor, dtype=np.int64)).reshape(-1)
    return kernel[skip_count:]


def kv_planes(tensor: torch.Tensor, kv_before_num_blocks: bool) -> list[torch.Tensor]:
    """``tensor``'s kernel blocks as 2-D uint8 views ``(num_blocks, B)`` sharing its
    memory: ``[K, V]`` when the KV dimension comes first (B = bytes of one kernel block
    of K), else one plane (B = bytes of one whole kernel block). Every row is contiguous,
    so per-plane ``index_select``/``index_copy_`` move whole blocks; rows may lie any
    distance apart (a block-major ``HostKVCache``'s layers are strided views). Raises
    ``ValueError`` if a kernel block of ``tensor`` is not contiguous, or ``tensor`` is
    not ``(2, num_blocks, ...)`` when the KV dimension comes first."""
    if kv_before_num_blocks and (tensor.dim() < 2 or tensor.shape[0] != 2):
        raise ValueError(
            f"KV tensor with the KV dimension first must have shape (2, num_blocks, ...); got {tuple(tensor.shape)}"
        )
    try:
        rows = tensor.view(2, tensor.shape[1], -1) if kv_before_num_blocks else tensor.view(tensor.shape[0], -1)
        rows = rows.view(torch.uint8)
        if rows.stride(-1) == 1 or rows.shape[-1] == 1:
            return [rows[0], rows[1]] if kv_before_num_blocks else [rows]
    except RuntimeError:
        pass
    raise ValueError(
        f"each kernel block of a KV tensor must be contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()})"
    )


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (2-D uint8, contiguous rows) viewed as the widest integer type its row
    length and alignment allow. Element-wise kernels such as CPU ``index_copy_`` run
    several times faster on 8-byte words than on bytes."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if (
            rows.shape[-1] % size == 0
            and rows.storage_offset() % size == 0
            and all(st % size == 0 for st in rows.stride()[:-1])
        ):
            return rows.view(dtype)
    return rows


def scatter_rows(plane: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``plane[index[i]] = rows[i]`` for uint8 ``plane`` and ``rows`` of the same shape
    past dim 0 (``rows`` on any device, copied to ``plane``'s if needed). Rows of a
    strided view (e.g. a column range of a staging buffer) are read in place, not
    copied first."""
    if rows.device != plane.device or rows.stride(-1) != 1:
        rows = rows.to(plane.device).contiguous()
    words_plane, words_rows = _same_words(plane, rows)
    words_plane.index_copy_(0, index, words_rows)


def layer_planes(tensor: torch.Tensor, layer: LayerLayout) -> list[torch.Tensor]:
    if tuple(tensor.shape[2 if layer.kv_before_num_blocks else 1 :]) != tuple(layer.block_shape):
        raise ValueError(
            f"layer {layer.name!r}: tensor shape {tuple(tensor.shape)} does not "
            f"match the layout's block shape {layer.block_shape}"
        )
    try:
        return kv_planes(tensor, layer.kv_before_num_blocks)
    except ValueError as exc:
        raise ValueError(f"layer {layer.name!r}: {exc}") from None


def _check_codec_args(
    tensors: Sequence[torch.Tensor], layout: KVCacheLayout, block_ids: np.ndarray, buf: torch.Tensor, name: str
) -> np.ndarray:
    if len(tensors) != len(layout.layers):
        raise ValueError(f"expected {len(layout.layers)} layer tensors (one per layout layer), got {len(tensors)}")
    ids = np.asarray(block_ids, dtype=np.int64)
    f = layout.block_size_factor
    if ids.ndim != 2 or ids.shape[1] != f:
        raise ValueError(f"block_ids must have shape (N, block_size_factor={f}); got {ids.shape}")
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[0] != ids.shape[0]:
        raise ValueError(
            f"{name} must be a uint8 tensor of shape ({ids.shape[0]}, stride); got {buf.dtype} {tuple(buf.shape)}"
        )
    if buf.shape[1] < layout.bytes_per_block:
        raise ValueError(f"{name} stride {buf.shape[1]} is smaller than one block ({layout.bytes_per_block} bytes)")
    if ids.size:
        nb = tensors[0].shape[1 if layout.layers[0].kv_before_num_blocks else 0]
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= nb:
            raise ValueError(f"block_ids out of range: found {lo}..{hi}, expected -1 (skip) or 0..{nb - 1}")
    return ids


def _whole_groups(ids: np.ndarray, tensors: Sequence[torch.Tensor], layout: KVCacheLayout) -> np.ndarray | None:
    """For ``ids`` whose every row is one aligned group of kernel blocks
    (``g*f .. g*f+f-1``, no skips; always so for CPU-tier slots), the group numbers
    ``g``, else None. Then each plane can be viewed as ``(num_blocks/f, f, B)`` and a
    block's kernel blocks move in one row straight between that view and the packed
    buffer, with no temporary in between."""
    f = layout.block_size_factor
    first = ids[:, 0]
    if (first < 0).any() or (first % f).any():
        return None
    if f > 1 and not (ids == first[:, None] + np.arange(f, dtype=np.int64)).all():
        return None
    if any(t.shape[1 if layer.kv_before_num_blocks else 0] % f for t, layer in zip(tensors, layout.layers)):
        return None
    return first // f


def _block_planes(
    tensors: Sequence[torch.Tensor], layout: KVCacheLayout, packed: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per plane of every layer (layout order, K before V): the plane ``(num_blocks, B)``
    and its bytes in every packed row, ``(N, f, B)``: kernel block ``j``'s copy of the
    plane, at the plane's offset within a kernel block's bytes (the codec's byte order)."""
    n, f = packed.shape[0], layout.block_size_factor
    kernel_rows = packed[:, : layout.bytes_per_block].view(n, f, layout.bytes_per_block // f)
    offset = 0
    for tensor, layer in zip(tensors, layout.layers):
        for plane in layer_planes(tensor, layer):
            width = plane.shape[1]
            yield plane, kernel_rows[:, :, offset : offset + width]
            offset += width


def _same_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` as the same word type (both ``as_words``, else both bytes)."""
    wa, wb = as_words(a), as_words(b)
    return (wa, wb) if wa.dtype == wb.dtype else (a, b)


class _Index:
    """One index tensor per device, made on first use."""

    def __init__(self, ids: np.ndarray):
        self._ids = ids
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        index = self._by_device.get(device)
        if index is None:
            index = self._by_device[device] = torch.from_numpy(self._ids).to(device)
        return index


def pack_blocks(
    tensors: Sequence[torch.Tensor], layout: KVCacheLayout, block_ids: np.ndarray, out: torch.Tensor
) -> None:
    """Copy N offloaded blocks from per-layer ``tensors`` into ``out`` (uint8, shape
    ``(N, stride)``, ``stride >= layout.bytes_per_block``), one row per block, in the
    module's byte order.

    ``block_ids`` is int64 ``(N, block_size_factor)`` of kernel block ids; -1 skips that
    kernel block (its bytes in ``out`` are left as they were). Bytes past
    ``bytes_per_block`` in each row are not touched. Raises ``ValueError`` for shapes,
    dtypes or ids that do not fit.
    """
    ids = _check_codec_args(tensors, layout, block_ids, out, "out")
    n, f = ids.shape
    if n == 0:
        return
    groups = _whole_groups(ids, tensors, layout)
    if groups is not None and all(t.device == out.device for t in tensors):
        index = _Index(groups)
        for plane, dst in _block_planes(tensors, layout, out):
            src, dst = _same_words(plane.view(plane.shape[0] // f, f, plane.shape[1]), dst)
            torch.index_select(src, 0, index.on(out.device), out=dst)  # gathers into the strided rows
        return
    flat = ids.reshape(-1)
    skip = flat < 0
    any_skip = bool(skip.any())
    index = _Index(np.where(skip, 0, flat))
    keep = torch.from_numpy(~skip.reshape(n, f)).to(out.device) if any_skip else None
    for plane, dst in _block_planes(tensors, layout, out):
        gathered = plane.index_select(0, index.on(plane.device)).view(n, f, plane.shape[1])
        if keep is None:
            dst.copy_(gathered)
        else:
            dst[keep] = gathered.to(out.device)[keep]


def unpack_blocks(
    src: torch.Tensor, tensors: Sequence[torch.Tensor], layout: KVCacheLayout, block_ids: np.ndarray
) -> None:
    """Inverse of ``pack_blocks``: write N blocks from ``src`` (uint8 ``(N, stride)``)
    into per-layer ``tensors`` at the kernel block ids ``block_ids`` (int64
    ``(N, block_size_factor)``; -1 leaves that kernel block untouched). Raises
    ``ValueError`` for shapes, dtypes or ids that do not fit."""
    ids = _check_codec_args(tensors, layout, block_ids, src, "src")
    n, f = ids.shape
    if n == 0:
        return
    groups = _whole_groups(ids, tensors, layout)
    if groups is not None:
        index = _Index(groups)
        for plane, rows in _block_planes(tensors, layout, src):
            scatter_rows(plane.view(plane.shape[0] // f, f, plane.shape[1]), index.on(plane.device), rows)
        return
    flat = ids.reshape(-1)
    kept = flat >= 0
    all_kept = bool(kept.all())
    index = _Index(flat if all_kept else flat[kept])
    keep = None if all_kept else torch.from_numpy(kept).to(src.device)
    for plane, rows in _block_planes(tensors, layout, src):
        rows = rows.reshape(n * f, plane.shape[1])
        scatter_rows(plane, index.on(plane.device), rows if keep is None else rows[keep])


def _layer_views(slot_rows: torch.Tensor, layout: KVCacheLayout) -> list[torch.Tensor]:
    """Per layer of ``layout``, a view of ``slot_rows`` (uint8, one offloaded block per
    row in the codec's byte order) shaped like the device layer with ``block_size_factor``
    kernel blocks per row: kernel block rows ``bytes_per_block / f`` bytes apart, K and V
    (when the KV dimension comes first) one plane apart."""
    num_kernel_blocks = slot_rows.shape[0] * layout.block_size_factor
    kernel_elements = layout.bytes_per_block // layout.block_size_factor // layout.element_size
    elements = slot_rows.view(-1).view(layout.dtype)
    views, offset = [], 0
    for layer in layout.layers:
        block = math.prod(layer.block_shape)
        inner = [math.prod(layer.block_shape[i + 1 :]) for i in range(len(layer.block_shape))]
        if layer.kv_before_num_blocks:
            shape, stride = (2, num_kernel_blocks, *layer.block_shape), (block, kernel_elements, *inner)
        else:
            shape, stride = (num_kernel_blocks, *layer.block_shape), (kernel_elements, *inner)
        views.append(elements.as_strided(shape, stride, elements.storage_offset() + offset))
        offset += layer.elements_per_gpu_block
    return views


class HostKVCache:
    """``num_slots`` offloaded blocks of ``layout`` in host memory, block-major.

    ``slot_rows`` is the whole tier, ``(num_slots, bytes_per_block)`` uint8: row ``s``
    is slot ``s``'s block in the codec's byte order (``pack_blocks``), so one slot is
    one contiguous piece. ``tensors[i]`` is a view of layer ``layout.layers[i]`` shaped
    like the device layer with ``num_blocks = num_slots * block_size_factor``; slot
    ``s`` is kernel blocks ``s*f .. s*f+f-1``, and consecutive kernel blocks of a layer
    lie ``bytes_per_block / f`` bytes apart. Memory is pinned when CUDA is present
    (``pin=None``), else pageable (logged once); if pinning fails it is pageable too,
    with a warning. ``pin=True`` or ``False`` demands that kind and raises
    ``RuntimeError`` (with what to change) when it cannot be had. ``shared=True`` puts
    it in shared memory (``tiered_kv.memory.shared_memory``; pinned by registering it with
    CUDA) so a disk I/O process can reach the slots. Raises ``ConfigError`` naming
    cpu_bytes when the tier exceeds ``host_memory_limit()``. Contents start
    uninitialised.
    """

    def __init__(self, layout: KVCacheLayout, num_slots: int, pin: bool | None = None, shared: bool = False):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        nbytes = num_slots * layout.bytes_per_block
        limit = host_memory_limit()
        if nbytes > limit:
            raise ConfigError(
                f"cpu_bytes: the CPU tier needs {format_size(nbytes)} ({num_slots} blocks of "
                f"{layout.bytes_per_block} B) but this machine lets this process use "
                f"{format_size(limit)} of memory; lower cpu_bytes"
            )
        pinning = pin if pin is not None else machine.can_pin_memory()
        self.shared = shared
        try:
            self.slot_rows = self._allocate(pin)
        except (RuntimeError, MemoryError) as e:
            if pin is not None or not pinning:  # that kind was demanded, or nothing was pinned
                raise RuntimeError(
                    f"cannot allocate the CPU tier's {format_size(nbytes)} of "
                    f"{'pinned' if pinning else 'pageable'} memory ({e}); lower cpu_bytes"
                    + (", or raise the locked-memory limit (ulimit -l, docker --ulimit memlock=-1)" if pinning else "")
                ) from e
            logger.warning(
                "pinning the CPU tier's %s failed (%s); using pageable memory, so GPU<->CPU "
                "copies are slower and synchronous. Lower cpu_bytes or raise the locked-memory "
                "limit (ulimit -l, docker --ulimit memlock=-1) to get pinned memory back",
                format_size(nbytes),
                e,
            )
            try:
                self.slot_rows = self._allocate(False)
            except (RuntimeError, MemoryError) as e2:
                raise RuntimeError(
                    f"cannot allocate the CPU tier's {format_size(nbytes)} of host memory ({e2}); lower cpu_bytes"
                ) from e2
        self.tensors = _layer_views(self.slot_rows, layout)
        self.pinned = self.slot_rows.is_pinned()

    def _allocate(self, pin: bool | None) -> torch.Tensor:
        """The tier's one allocation as slot rows, starting on a page (on a 2 MiB huge
        page from 2 MiB on: ``empty_pageable``)."""
        nbytes = self.num_slots * self.layout.bytes_per_block
        if self.shared:
            flat = empty_shared(nbytes, pin=pin if pin is not None else machine.can_pin_memory())
        else:
            flat = empty_host((nbytes,), torch.uint8, pin)
        return flat.view(self.num_slots, self.layout.bytes_per_block)

    @staticmethod
    def slots_for_bytes(layout: KVCacheLayout, cpu_bytes: int) -> int:
        """How many offloaded blocks fit in ``cpu_bytes``; raises ``ValueError`` if not
        one, or if they need more memory than this process may use (``host_memory_limit``):
        checked before the scheduler sizes anything by it, so a size that cannot be
        allocated is an error naming cpu_bytes, not a ``MemoryError``."""
        slots = cpu_bytes // layout.bytes_per_block
        if slots < 1:
            raise ValueError(
                f"cpu_bytes={cpu_bytes} holds no block; one offloaded block is {layout.bytes_per_block} bytes"
            )
        limit = host_memory_limit()
        if slots * layout.bytes_per_block > limit:
            raise ValueError(
                f"{format_size(cpu_bytes)} is more memory than this machine lets this process use "
                f"({format_size(limit)}); lower cpu_bytes"
            )
        return slots

    @classmethod
    def from_bytes(
        cls, layout: KVCacheLayout, cpu_bytes: int, pin: bool | None = None, shared: bool = False
    ) -> "HostKVCache":
        """As many slots as fit in ``cpu_bytes``."""
        return cls(layout, cls.slots_for_bytes(layout, cpu_bytes), pin, shared)

    @property
    def nbytes(self) -> int:
        return self.slot_rows.numel()

    def kernel_ids(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """``(N, block_size_factor)`` kernel ids of ``slots``, the codec's ``block_ids``."""
        f = self.layout.block_size_factor
        return expand_block_ids(slots, f).reshape(-1, f)
