"""Host (CPU-tier) KV memory and the block byte codec shared by the tiers.

Worker process. ``HostKVCache`` holds ``num_slots`` offloaded blocks *block-major*:
one allocation of ``num_slots`` rows, each slot's row its block's bytes in the codec's
byte order, so a slot is one contiguous piece of memory that the disk tier writes and
reads as it lies. Each layer is still seen as a tensor shaped like the device layer
(``num_blocks = num_slots * block_size_factor``; CPU slot ``s`` is kernel blocks
``s*f .. s*f+f-1``, the seed's ``expand_block_ids`` semantics): a strided view whose
kernel-block rows lie one kernel block of all layers apart. The memory is pinned when
CUDA is present and pageable otherwise (logged once, see ``tiered_kv.device``). A tier
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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from functools import cached_property

import numpy as np
import torch

from tiered_kv import device as machine  # module, so tests can stand in for its probes
from tiered_kv.config import ConfigError, format_size
from tiered_kv.device import empty_host, host_memory_limit
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.shared_memory import empty_shared

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


def _layer_planes(tensor: torch.Tensor, layer: LayerLayout) -> list[torch.Tensor]:
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
        for plane in _layer_planes(tensor, layer):
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


class SlotViews:
    """Each CPU slot's bytes where they lie in the host tensors, for vectored disk I/O
    without a staging copy: its pieces in ``pack_blocks``' byte order (per kernel block,
    one piece per plane), pieces that lie end to end in memory joined. A block-major
    ``HostKVCache``'s slot is then one piece; per-layer tensors give one piece per plane
    (per plane and kernel block when ``block_size_factor > 1``). Raises ``ValueError``
    for tensors that are not host tensors of ``layout`` with contiguous kernel blocks."""

    def __init__(self, tensors: Sequence[torch.Tensor], layout: KVCacheLayout):
        if len(tensors) != len(layout.layers):
            raise ValueError(f"expected {len(layout.layers)} layer tensors, got {len(tensors)}")
        f = layout.block_size_factor
        planes: list[np.ndarray] = []  # (num_kernel_blocks, B) bytes
        for tensor, layer in zip(tensors, layout.layers):
            if tensor.device.type != "cpu":
                raise ValueError(f"layer {layer.name!r}: slot views need host tensors, got {tensor.device}")
            for plane in _layer_planes(tensor, layer):
                if plane.shape[0] % f:
                    raise ValueError(f"layer {layer.name!r}: {plane.shape[0]} kernel blocks are not whole slots of {f}")
                planes.append(plane.numpy())
        self._keep = planes  # the memory of joined pieces, which as_strided does not hold
        self._rows = _joined([plane[j::f] for j in range(f) for plane in planes])

    @classmethod
    def from_rows(cls, rows: Sequence[np.ndarray]) -> "SlotViews":
        """Views over ``rows`` (per piece: ``(num_slots, piece_bytes)`` uint8 arrays, in
        block byte order), e.g. the same host cache mapped by another process."""
        views = cls.__new__(cls)
        views._rows = list(rows)
        return views

    @property
    def rows(self) -> list[np.ndarray]:
        """Per piece, every slot's: ``(num_slots, piece_bytes)`` uint8."""
        return list(self._rows)

    @property
    def pieces_per_slot(self) -> int:
        return len(self._rows)

    @property
    def slot_bytes(self) -> int:
        return sum(r.shape[1] for r in self._rows)

    @property
    def smallest_piece(self) -> int:
        return min(r.shape[1] for r in self._rows)

    def aligned(self, alignment: int) -> bool:
        """Whether every piece starts, and every piece's length is, a multiple of ``alignment``."""
        return all(r.ctypes.data % alignment == 0 and r.strides[0] % alignment == 0 for r in self._rows)

    def pieces(self, slot: int) -> list[memoryview]:
        """Writable views of slot ``slot``'s bytes, in block byte order (slices of the
        pieces' byte views: no numpy object per piece, under half the cost)."""
        return [view[slot * stride : slot * stride + width] for view, stride, width in self._piece_views]

    def pack(self, slots: Sequence[int], out: torch.Tensor) -> None:
        """Copy slots ``slots`` into the rows of ``out`` (uint8 ``(len(slots), >=
        slot_bytes)``), one block per row in block byte order: what ``pack_blocks``
        makes of those slots, in one ``torch._foreach_copy_`` call of 8-byte words where
        the memory allows, which gives the GIL up once: runs of consecutive slots a piece
        at a time, scattered slots a block at a time (``_blocks``). A numpy copy per
        piece gave the GIL up 64 times per chunk of 0.5 MiB blocks (a per-layer tier's
        64 planes), and beside a busy
        Python thread each time waited up to the 5 ms switch interval to take it back,
        which slowed small-block handler writes several times over there, from runs
        of slots and from scattered ones alike. See ``unpack`` for why the
        other direction copies piece by piece instead."""
        self._check_packed(slots, out)
        index, runs = _slot_runs(slots)
        rows, word = out.numpy(), self._words[0].element_size()
        if runs is not None:
            pieces, dst = self._words, _numpy_words(rows, word)
            if dst is None:  # rows of another alignment: move bytes
                pieces, dst = self._byte_pieces, out
            outs, ins, offset = [], [], 0
            for piece in pieces:
                width = piece.shape[1]
                for first, end, slot in runs:
                    outs.append(dst[first:end, offset : offset + width])
                    ins.append(piece[slot : slot + end - first])
                offset += width
            torch._foreach_copy_(outs, ins)
            return
        blocks = self._blocks
        if blocks is not None:
            count, width = blocks.shape[1], blocks.shape[2] * word
            dst = _numpy_words(
                np.lib.stride_tricks.as_strided(
                    rows, shape=(len(index), count, width), strides=(rows.strides[0], width, 1)
                ),
                word,
            )
            if dst is not None:
                step = max(1, _SERIAL_COPY_WORDS // blocks.shape[2])  # pieces per copy
                outs, ins = [], []
                for i, slot in enumerate(index.tolist()):
                    for p in range(0, count, step):
                        outs.append(dst[i, p : p + step])
                        ins.append(blocks[slot, p : p + step])
                torch._foreach_copy_(outs, ins)
                return
        offset = 0
        for piece in self._rows:
            width = piece.shape[1]
            np.take(piece, index, axis=0, out=rows[:, offset : offset + width])
            offset += width

    def unpack(self, src: torch.Tensor, slots: Sequence[int]) -> None:
        """Inverse of ``pack``: write the rows of ``src`` into slots ``slots``, piece by
        piece, as memoryview slice assignments. These keep the GIL. A numpy copy gives it
        up, and beside a thread running Python it waits up to the 5 ms switch interval to
        take it back, once per copy: 64 per chunk of 0.5 MiB blocks of a per-layer tier. Unpacking runs on the
        disk threads of an engine worker, beside such a thread, where the handoffs
        dominated small-block reads. Packing gained little that way and lost
        when idle, as do small pieces here: each copy costs about a microsecond of Python
        (docs/benchmarks.md, "Disk tier", the GIL handoff)."""
        self._check_packed(slots, src)
        flat = memoryview(src.numpy()).cast("B")
        slots, stride, offset = [int(s) for s in slots], src.shape[1], 0
        for view, row_stride, width in self._piece_views:
            for i, slot in enumerate(slots):
                here, at = slot * row_stride, i * stride + offset
                view[here : here + width] = flat[at : at + width]
            offset += width

    def _check_packed(self, slots: Sequence[int], packed: torch.Tensor) -> None:
        if packed.dim() != 2 or packed.shape[0] != len(slots) or packed.shape[1] < self.slot_bytes:
            raise ValueError(
                f"packed rows must be a ({len(slots)}, >= {self.slot_bytes}) tensor; got {tuple(packed.shape)}"
            )

    @cached_property
    def _byte_pieces(self) -> list[torch.Tensor]:
        """The pieces' rows as uint8 tensors (sharing their memory)."""
        return [torch.from_numpy(rows) for rows in self._rows]

    @cached_property
    def _words(self) -> list[torch.Tensor]:
        """``_byte_pieces`` as 8-byte words where every piece allows it. A CPU copy of a
        run of 16 slots' pieces is then 16384 elements, under torch's grain size, so it
        runs on the calling thread: as bytes it was split across the intra-op threads,
        at twice the CPU."""
        words = [_numpy_words(rows, 8) for rows in self._rows]
        if any(w is None for w in words):
            return self._byte_pieces
        return words

    @cached_property
    def _blocks(self) -> torch.Tensor | None:
        """Every piece at once, ``(num_slots, pieces, piece)`` in ``_words``' words, so
        that ``[s]`` is slot ``s``'s block: where the pieces have one shape and lie at
        equal distances in one allocation (a block-major ``HostKVCache``'s one piece, or
        per-layer tensors of alike layers back to back). None otherwise."""
        first = self._rows[0]
        if any(r.shape != first.shape or r.strides != first.strides for r in self._rows):
            return None
        gaps = {b.ctypes.data - a.ctypes.data for a, b in zip(self._rows, self._rows[1:])} or {first.shape[1]}
        gap = gaps.pop()
        if gaps or gap < first.shape[1]:
            return None
        every = np.lib.stride_tricks.as_strided(
            first, shape=(first.shape[0], len(self._rows), first.shape[1]), strides=(first.strides[0], gap, 1)
        )
        return _numpy_words(every, self._words[0].element_size())

    @cached_property
    def _piece_views(self) -> list[tuple[memoryview, int, int]]:
        """Per piece: one byte view from its first slot's piece to its last's, the
        distance between two slots' pieces in it, and a piece's length."""
        return [
            (
                memoryview(
                    np.lib.stride_tricks.as_strided(
                        rows, shape=((rows.shape[0] - 1) * rows.strides[0] + rows.shape[1],), strides=(1,)
                    )
                ),
                rows.strides[0],
                rows.shape[1],
            )
            for rows in self._rows
        ]


#: Largest copy torch runs on the calling thread (its grain size, in elements): a larger
#: one is split across the intra-op threads, at more CPU for no gain here.
_SERIAL_COPY_WORDS = 32768


def _numpy_words(a: np.ndarray, size: int) -> torch.Tensor | None:
    """``a`` (uint8, its last axis contiguous) as a tensor of ``size``-byte integers
    sharing its memory, or None where its last axis, an outer stride or its address is
    no multiple of ``size``. Made through numpy: a torch ``view`` gives up the GIL."""
    if size == 1:
        return torch.from_numpy(a)
    if a.shape[-1] % size or any(st % size for st in a.strides[:-1]) or a.ctypes.data % size:
        return None
    return torch.from_numpy(a.view(np.dtype(f"i{size}")))


def _joined(pieces: list[np.ndarray]) -> list[np.ndarray]:
    """``pieces`` (each ``(num_slots, width)``, rows a fixed distance apart), with every
    run of pieces that lie end to end in memory, at one distance between slots, made
    one wider piece."""
    out = [pieces[0]]
    for piece in pieces[1:]:
        last = out[-1]
        if piece.strides[0] == last.strides[0] and piece.ctypes.data == last.ctypes.data + last.shape[1]:
            out[-1] = np.lib.stride_tricks.as_strided(
                last, shape=(last.shape[0], last.shape[1] + piece.shape[1]), strides=last.strides
            )
        else:
            out.append(piece)
    return out


def _slot_runs(slots: Sequence[int]) -> tuple[np.ndarray, list[tuple[int, int, int]] | None]:
    """``slots`` as an int64 array, and its runs of consecutive slots as ``(first row,
    end row, first slot)``; None when the runs average under two slots, and ``pack``
    copies slot by slot (or, where the planes are not evenly spaced, gathers each plane
    with ``np.take``: into the strided columns of a packed buffer that gathers into a
    temporary array and copies it again, its ``out`` must be contiguous)."""
    index = np.asarray(slots, dtype=np.int64).reshape(-1)
    starts = np.flatnonzero(np.diff(index) != 1) + 1
    if 2 * (len(starts) + 1) > len(index):
        return index, None
    firsts = [0, *starts.tolist()]
    ends = [*firsts[1:], len(index)]
    return index, list(zip(firsts, ends, index[firsts].tolist()))


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
    it in shared memory (``tiered_kv.shared_memory``; pinned by registering it with
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
