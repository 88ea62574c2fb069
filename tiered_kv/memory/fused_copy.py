"""One Triton kernel that moves rows between two CUDA-addressable tensors: row
``src_rows[i]`` of ``src`` to row ``dst_rows[i]`` of ``dst``, with no staging.

Worker process, CUDA only; imported by ``tiered_kv.memory.zero_copy`` where Triton is
installed (it ships with PyTorch's CUDA wheels). No I/O: one side is usually pinned
host memory mapped into the device (``PlaneRows``), so the kernel's loads or stores
cross the bus.

Why a kernel of our own rather than ``index_select`` then ``index_copy_``: those two
launch grids as large as the job, so a load and a store on two streams take turns on
the SMs and both directions together move no more than one (docs/benchmarks.md, "GPU
<-> CPU"); they also pass every byte through a staging buffer in device memory. This
kernel runs a fixed number of programs, each looping over rows, so a load and a store
run side by side and the bus carries both directions at once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: Bytes each program moves per step of its loop (one vectorised load and store).
STEP_BYTES = 16 << 10
#: Programs per streaming multiprocessor: a load's and a store's fit on every SM together.
PROGRAMS_PER_SM = 1
#: Warps per program.
NUM_WARPS = 8


@triton.jit
def _copy_rows(src, dst, src_rows, dst_rows, n_rows, ROW: tl.constexpr, STEP: tl.constexpr):  # type: ignore[no-untyped-def]
    for i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        s = tl.load(src_rows + i).to(tl.int64) * ROW
        d = tl.load(dst_rows + i).to(tl.int64) * ROW
        for start in range(0, ROW, STEP):
            cols = start + tl.arange(0, STEP)
            mask = cols < ROW
            tl.store(dst + d + cols, tl.load(src + s + cols, mask=mask), mask=mask)


@functools.cache
def _programs(device: torch.device) -> int:
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Row ``src_rows[i]`` of ``src`` into row ``dst_rows[i]`` of ``dst`` for every ``i``,
    on the current stream. ``src`` and ``dst``: 2-D contiguous CUDA tensors of one dtype
    and row length; the row numbers: int64 CUDA tensors of one length, in range (not
    checked here: the caller checks on the host)."""
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(f"rows differ: {src.dtype} x {src.shape[1]} against {dst.dtype} x {dst.shape[1]}")
    n = len(src_rows)
    if not n:
        return
    row = src.shape[1]
    step = min(triton.next_power_of_2(row), max(1, STEP_BYTES // src.element_size()))
    grid = (min(n, _programs(src.device)),)
    _copy_rows[grid](src, dst, src_rows, dst_rows, n, ROW=row, STEP=step, num_warps=NUM_WARPS)
