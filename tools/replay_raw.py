"""Raw limits of this machine, measured in the same run as the replay, to set its
transfer GB/s beside.

- ``host_copy_gbps``: one large host-to-host ``copy_`` (what the GPU<->CPU handlers do
  when CPU tensors stand in for the GPU).
- ``disk_gbps``: a plain O_DIRECT ``pwritev``/``preadv`` loop in the disk tier's slot size
  and thread count (``benchlib.RawLoop``), one fdatasync at the end of the writes.
- ``pinned_copy_gbps`` (CUDA): one pinned ``cudaMemcpyAsync`` per direction, CUDA events.
- ``kvikio_read_gbps`` (CUDA): one raw KvikIO ``CuFile.pread`` of a file into device memory.

Each writes and reads only its own temporary buffers and files.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchlib import RawLoop


def host_copy_gbps(nbytes: int, repeats: int = 3) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def disk_gbps(directory: Path, nbytes: int, block_bytes: int, threads: int) -> dict[str, float]:
    """O_DIRECT write then read GB/s of ``nbytes`` in ``block_bytes`` I/Os (rounded to 4 KiB)."""
    bs = -(-block_bytes // 4096) * 4096
    total = max(1, nbytes // bs) * bs
    fd, name = tempfile.mkstemp(prefix="replay-raw-", dir=directory)
    os.close(fd)
    try:
        loop = RawLoop(Path(name), total, bs, threads)
        return {"write": loop.run(write=True) / 1e9, "read": loop.run(write=False) / 1e9}
    finally:
        os.unlink(name)


def pinned_copy_gbps(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """One pinned cudaMemcpyAsync per direction (median of ``repeats``), GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    out = {}
    for name, dst, src in (("H2D", dev, host), ("D2H", host, dev)):
        times = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9  # the first copy warms up
    return out


def kvikio_read_gbps(directory: Path, nbytes: int, repeats: int = 3) -> float | str:
    """One raw KvikIO read of an ``nbytes`` file into device memory, GB/s; or why not."""
    try:
        import kvikio
    except Exception as exc:
        return f"kvikio unavailable ({type(exc).__name__}: {exc})"
    fd, name = tempfile.mkstemp(prefix="replay-kvikio-", dir=directory)
    try:
        block = os.urandom(1 << 20)
        for _ in range(-(-nbytes // len(block))):
            os.write(fd, block)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the device, not the page cache
        os.close(fd)
        fd = -1
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        times = []
        with kvikio.CuFile(name, "r") as f:
            for _ in range(repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                f.pread(dev, nbytes, 0).get()
                times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times[1:]) / 1e9
    except Exception as exc:  # a GPU host without cuFile support: say so, keep the run
        return f"kvikio read failed ({type(exc).__name__}: {exc})"
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(name)
