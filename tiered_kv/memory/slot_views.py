"""``SlotViews``: byte views of the CPU tier's slots where they lie, for the disk tier.

Worker process, and a worker's disk I/O process (``disk_io: process``: there the views
are rebuilt from the shared memory the worker sends, ``from_rows``). No file I/O: the
views hand the disk store each slot's pieces for vectored reads and writes in place
(``pieces``), and pack and unpack slots into rows of bytes (``pack``/``unpack``:
memory copies) where the pieces are too small or misaligned to move in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch

from tiered_kv.memory.host_memory import layer_planes
from tiered_kv.kv_layout import KVCacheLayout

__all__ = ["SlotViews"]


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
            for plane in layer_planes(tensor, layer):
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
            dst_words = _numpy_words(
                np.lib.stride_tricks.as_strided(
                    rows, shape=(len(index), count, width), strides=(rows.strides[0], width, 1)
                ),
                word,
            )
            if dst_words is not None:
                step = max(1, _SERIAL_COPY_WORDS // blocks.shape[2])  # pieces per copy
                outs, ins = [], []
                for i, slot in enumerate(index.tolist()):
                    for p in range(0, count, step):
                        outs.append(dst_words[i, p : p + step])
                        ins.append(blocks[slot, p : p + step])
                torch._foreach_copy_(outs, ins)
                return
        offset = 0
        for piece_rows in self._rows:
            width = piece_rows.shape[1]
            np.take(piece_rows, index, axis=0, out=rows[:, offset : offset + width])
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
        flat = src.numpy().data.cast("B")
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
        words = [w for w in (_numpy_words(rows, 8) for rows in self._rows) if w is not None]
        return words if len(words) == len(self._rows) else self._byte_pieces

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
                np.lib.stride_tricks.as_strided(
                    rows, shape=((rows.shape[0] - 1) * rows.strides[0] + rows.shape[1],), strides=(1,)
                ).data,
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
