#!/usr/bin/env python
"""GPU <-> pinned-CPU throughput of the offloading handlers vs one large pinned copy.

For each offloaded block size (default 0.5, 1 and 2 MB: 32 layers x 8 KV heads x 128
head dim, bf16, 4/8/16 tokens per block) it moves ``--total-mb`` of blocks through
``CpuGpuOffloadingHandlers`` in jobs of ``--blocks-per-job`` blocks (random device
blocks, consecutive CPU slots as the LRU manager hands them out, or with
``--scattered-slots`` slots in a shuffled order, as a CPU tier that has evicted for a
while hands them out), with copy kernels over the mapped host tier (the Triton kernel,
then torch's two) and with DMA copies: GPU->CPU, CPU->GPU and both at once. ``gpu_copy:
auto`` takes DMA for a job whose slots run 2 MiB or more, kernels otherwise; the
columns show what each costs. And, in the same run, the same number of bytes as one
``cudaMemcpyAsync`` between one device buffer and one pinned host buffer (per
direction and both directions at once on two streams). Prints GB/s and the ratio.

    .venv/bin/python tools/bench_gpu_cpu.py [--block-mb 0.5 1 2] [--total-mb 2048]

Needs CUDA; without it, exits with code 2 and a message (``--smoke`` runs a tiny
configuration on CPU only to check the script itself; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tiered_kv.sim.driver import DeviceKVCache  # noqa: E402
from tiered_kv.memory.host_memory import HostKVCache, pack_blocks  # noqa: E402
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from tiered_kv.cpu.handlers import CpuGpuOffloadingHandlers  # noqa: E402
from tiered_kv.memory import zero_copy  # noqa: E402

LAYERS, HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
SMOKE_LAYERS, SMOKE_HEADS, SMOKE_HEAD_DIM = 2, 2, 16


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--block-mb",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 2.0],
        help="offloaded block sizes in MiB (multiples of 1/8 MiB)",
    )
    p.add_argument("--total-mb", type=int, default=2048, help="MiB moved per measurement and direction")
    p.add_argument("--blocks-per-job", type=int, default=32, help="blocks per transfer job")
    p.add_argument("--layout", choices=("kv-first", "kv-after"), default="kv-first")
    p.add_argument("--repeats", type=int, default=3, help="measurements per cell; the median is shown")
    p.add_argument("--scattered-slots", action="store_true", help="jobs of shuffled CPU slots, not consecutive ones")
    p.add_argument("--smoke", action="store_true", help="tiny run that also works on CPU (checks the script)")
    return p.parse_args(argv)


class Clock:
    """Wall time of work on the device, synchronising before and after."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def median_gbps(clock: Clock, fn, nbytes: int, repeats: int) -> float:
    fn()  # warm-up: allocator, streams, first-touch of pinned pages
    return statistics.median(nbytes / clock.time(fn) / 1e9 for _ in range(repeats))


def bench_handlers(block_mb: float, args, device: str, clock: Clock, copy_kernels: bool) -> dict[str, Any]:
    layers, heads, head_dim = (SMOKE_LAYERS, SMOKE_HEADS, SMOKE_HEAD_DIM) if args.smoke else (LAYERS, HEADS, HEAD_DIM)
    token_bytes = layers * 2 * heads * head_dim * torch.empty((), dtype=DTYPE).element_size()
    tokens = round(block_mb * 2**20 / token_bytes)
    if tokens < 1 or abs(tokens * token_bytes - block_mb * 2**20) > 1:
        raise SystemExit(f"--block-mb {block_mb}: not a whole number of tokens of {token_bytes} bytes")
    block_bytes = tokens * token_bytes
    n_blocks = max(args.blocks_per_job, args.total_mb * 2**20 // block_bytes)
    n_jobs = n_blocks // args.blocks_per_job
    n_blocks = n_jobs * args.blocks_per_job
    dev = DeviceKVCache(
        num_layers=layers,
        num_gpu_blocks=n_blocks,
        gpu_block_size=tokens,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=DTYPE,
        kv_before_num_blocks=args.layout == "kv-first",
        device=device,
    )
    for i, t in enumerate(dev.tensors):
        t.normal_(mean=float(i))
    host = HostKVCache(dev.layout, n_blocks)
    handlers = CpuGpuOffloadingHandlers(dev.kv_caches, host, copy_kernels=copy_kernels)
    store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    rng = np.random.default_rng(0)
    gpu_ids = rng.permutation(n_blocks).reshape(n_jobs, args.blocks_per_job)
    order = rng.permutation(n_blocks) if args.scattered_slots else np.arange(n_blocks)
    slots = order.reshape(n_jobs, args.blocks_per_job)
    next_id = iter(range(10**9))

    def run(stores: bool, loads: bool) -> None:
        ids = {}
        for j in range(n_jobs):
            if stores:
                job = next(next_id)
                ids[job] = store
                store.transfer_async(job, (GPULoadStoreSpec(gpu_ids[j]), CPULoadStoreSpec(slots[j])))
            if loads:
                job = next(next_id)
                ids[job] = load
                load.transfer_async(job, (CPULoadStoreSpec(slots[j]), GPULoadStoreSpec(gpu_ids[j])))
        for handler in {store, load}:
            handler.wait({j for j, h in ids.items() if h is handler})
            results = handler.get_finished()
            if not all(r.success for r in results):
                raise SystemExit("a transfer job failed; see the log")

    total = n_blocks * block_bytes
    out = {
        "GPU->CPU": median_gbps(clock, lambda: run(True, False), total, args.repeats),
        "CPU->GPU": median_gbps(clock, lambda: run(False, True), total, args.repeats),
        "both": median_gbps(clock, lambda: run(True, True), 2 * total, args.repeats),
    }
    # Spot check: the host slots hold exactly the device blocks they were stored from.
    run(True, False)
    sample = rng.choice(n_jobs, size=min(4, n_jobs), replace=False)
    got = torch.empty((len(sample) * args.blocks_per_job, block_bytes), dtype=torch.uint8)
    want = torch.empty_like(got)
    pack_blocks(host.tensors, dev.layout, slots[sample].reshape(-1, 1), got)
    pack_blocks(dev.tensors, dev.layout, gpu_ids[sample].reshape(-1, 1), want)
    if not torch.equal(got, want):
        raise SystemExit("stored bytes differ from the device blocks: the handler is broken")
    store.shutdown()
    load.shutdown()
    slices = [rows.slice_bytes for rows in store.plane_rows] if copy_kernels and store.plane_rows else None
    return {"blocks": n_blocks, "block_bytes": block_bytes, "total": total, "slices": slices, **out}


def bench_memcpy(nbytes: int, device: str, clock: Clock, repeats: int) -> dict[str, float]:
    """One copy of ``nbytes`` between a device buffer and a pinned host buffer."""
    cuda = device == "cuda"
    dev_bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    host_bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)] if cuda else [None, None]

    def copy(dst, src, stream):
        if stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    out = {
        "GPU->CPU": median_gbps(clock, lambda: copy(host_bufs[0], dev_bufs[0], streams[0]), nbytes, repeats),
        "CPU->GPU": median_gbps(clock, lambda: copy(dev_bufs[0], host_bufs[0], streams[0]), nbytes, repeats),
        "both": median_gbps(
            clock,
            lambda: (copy(host_bufs[0], dev_bufs[0], streams[0]), copy(dev_bufs[1], host_bufs[1], streams[1])),
            2 * nbytes,
            repeats,
        ),
    }
    dev_bufs.clear()  # free the buffers before the cache is emptied
    host_bufs.clear()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(
            "bench_gpu_cpu: needs a CUDA GPU, but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); nothing was measured.",
            file=sys.stderr,
        )
        return 2
    if args.smoke:
        args.total_mb, args.repeats = min(args.total_mb, 8), 1
        args.block_mb = [mb / 64 for mb in args.block_mb]  # the smoke geometry is 64x smaller
    device = "cuda" if cuda else "cpu"
    clock = Clock(cuda)
    console = Console(width=160)  # the whole table on one line per row, also in a log
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke run: numbers are meaningless)"
    console.print(
        f"{datetime.datetime.now().isoformat(timespec='seconds')}  {name}  torch {torch.__version__}"
        f"  layout {args.layout}  {args.blocks_per_job} blocks/job  {args.total_mb} MiB per cell"
        f"  {'shuffled' if args.scattered_slots else 'consecutive'} CPU slots"
    )
    console.print("command: " + " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]))
    fused = cuda and zero_copy._fused_copy_rows() is not None
    table = Table(
        title="handlers (copy kernels: one fused, or index_select + index_copy_; DMA copies) "
        "vs one large pinned cudaMemcpyAsync (GB/s, median)"
    )
    for col in (
        "block",
        "direction",
        "fused",
        "2 kernels",
        "DMA",
        "memcpy",
        "fused ratio",
        "2-kernel ratio",
        "DMA ratio",
    ):
        table.add_column(col, justify="right")
    slices = {}
    for block_mb in args.block_mb:
        # Kernels only where the host tier can be mapped (CUDA); DMA is the only path on CPU.
        f = bench_handlers(block_mb, args, device, clock, copy_kernels=True) if fused else None
        zero_copy.FUSED_KERNEL = False
        try:
            k = bench_handlers(block_mb, args, device, clock, copy_kernels=True) if cuda else None
        finally:
            zero_copy.FUSED_KERNEL = True
        d = bench_handlers(block_mb, args, device, clock, copy_kernels=False)
        m = bench_memcpy(d["total"], device, clock, args.repeats)
        if k is not None:
            slices[f"{d['block_bytes'] / 2**20:.3g} MiB"] = k["slices"]
        for direction in ("GPU->CPU", "CPU->GPU", "both"):

            def cells(r: dict[str, Any] | None) -> tuple[str, str]:
                return (f"{r[direction]:.2f}", f"{r[direction] / m[direction]:.2f}") if r else ("-", "-")

            (fg, fr), (kg, kr), (dg, dr) = cells(f), cells(k), cells(d)
            table.add_row(
                f"{d['block_bytes'] / 2**20:.3g} MiB", direction, fg, kg, dg, f"{m[direction]:.2f}", fr, kr, dr
            )
        if cuda:
            torch.cuda.empty_cache()
    console.print(table)
    if slices:
        console.print(
            "copy kernels move each block as slices of (device, host) bytes: "
            + ", ".join(f"{b}: {d}, {h}" for b, (d, h) in slices.items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
