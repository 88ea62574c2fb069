#!/usr/bin/env python3
"""Disk tier throughput vs the raw device, measured in the same run, interleaved.

For each block size (0.5, 2 and 8 MiB by default) and each round: the four writes
(raw, raw into reused buffers, store, handler store), then the four reads, their order
rotated every round (the disk drifts minute to minute). Every path moves the same
bytes per measurement with the same number of I/O threads:

- raw: a plain O_DIRECT loop: one ``pwritev``/``preadv`` of one slot (the block rounded
  up to 4 KiB) at a time on each of the I/O threads, sequential offsets in a
  preallocated file next to the cache, and one ``fdatasync`` at the end of the writes
  (the least syncing any durable write can do). Its blocks go from/into their own
  places in a buffer as large as the handler's host KV cache, as the tier's do: the
  same memory footprint as the tier's own I/O.
- raw, reused buffers: the device as fio measures it (``fio --direct=1`` when fio is
  installed, else the loop above with one block-sized buffer per I/O thread, reused
  for every block). On the development VMs a virtio disk reads faster into a few
  reused megabytes than into a KV cache's worth of memory (docs/benchmarks.md, "Disk
  tier"; ``tools/bench_raw_memory.py`` measures it), a speed no cache that loads
  distinct blocks into distinct memory can have; it is printed, with the tier's ratios
  against it, but the targets' ratios are against the raw loop above.
- store / load: the disk tier's I/O path, ``DiskStore`` jobs of pre-packed blocks,
  ``--job-threads`` jobs at a time: checksums of every block (``--checksum``, on the store's
  checksum threads), O_DIRECT writes of coalesced runs on the I/O threads, then per
  group of jobs that finish together one ``fdatasync`` and one synced LMDB commit
  (a job thread takes its next job once its writes are done, as in the handlers);
  every round re-stores the same blocks into the same slots, so every job also pays
  the synced index transaction that makes a slot unloadable before it is overwritten
  (the case of a full cache reusing evicted slots). Loads read and verify every block.
- handler: the whole worker path, a ``CpuDiskHandler`` moving blocks between a host KV
  cache (``HostKVCache``, block-major: each slot's block one contiguous piece) and the
  disk: with vectored I/O straight from/into the cache's memory where each block's
  pieces are page-aligned and at least 32 KiB (every size here), else packed by the
  store into its pack buffers, 8 MiB at a time (and unpacked on load). Each size's line
  says which ("vectored" or "packed"). A job's blocks come from consecutive CPU slots,
  or, with ``--scattered-slots``, from slots in a shuffled order, as from a CPU tier
  whose LRU has churned. With ``--disk-io process`` both run in the store's helper
  process (``tiered_kv.disk.worker.io_process``), on a host cache in shared memory.

Every path's host buffers (the raw loop's, the store's rows, the host KV cache, the
staging buffers) are the tier's long-lived kind, ``empty_pageable``: 2 MiB-aligned and
advised onto transparent huge pages (``--small-pages``: ordinary pages, to compare);
the header prints the kernel's THP modes for private and for shared memory (with
``--disk-io process`` the buffers are shared memory, on huge pages only where the
second allows). The heap built at setup is frozen, as a vLLM worker's is after warm-up
(``--live-heap``: not); ``--busy-thread`` adds a thread running plain Python beside
every path, as an engine worker's own Python would.

Ratios are tier / raw over all rounds (bytes / time summed); two more tables give the
per-round ratios (each path against the raw loop of the same round, then against the
raw run into reused buffers), median and range.
The process CPU time of each path (all threads, user + system) is printed next, in
seconds per GB moved; with ``--trace``, last, how many ``preadv``/``pwritev`` calls
each path kept in flight on average and how long one took, and how long it ran
before its first call and after its last (``IOTrace``).

    python tools/bench_disk.py [--dir PATH] [--sizes 0.5,2,8] [--total-mib 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from bench_disk_trace import IOTrace, worker_heap
from benchlib import MiB, RawLoop, busy_thread, cpu_seconds, float_list, header, per_round, rotated, total_rate

from tiered_kv.config import CHECKSUMS
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.memory import device
from tiered_kv.memory.device import kernel_huge_pages
from tiered_kv.disk.format.namespace import slot_size_for
from tiered_kv.disk.worker.io_process import DiskIOProcess
from tiered_kv.disk.store.batch import views_fit
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.memory.host_memory import HostKVCache
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.mediums import CPULoadStoreSpec, DiskLoadStoreSpec
from tiered_kv.disk.worker.handlers import CpuDiskHandler


def model_layout(block_bytes: int) -> KVCacheLayout:
    """A Llama-8B-like geometry (32 layers, 8 KV heads, head dim 128, fp16: 128 KiB per
    token) with 4-token GPU blocks, grouped into offloaded blocks of ``block_bytes``."""
    per_gpu_block = 32 * 2 * 4 * 8 * 128 * 2
    factor = max(1, block_bytes // per_gpu_block)
    layers = tuple(LayerLayout(f"model.layers.{i}.self_attn", (2, 4 * factor * 2, 4, 8, 128), True) for i in range(32))
    return KVCacheLayout(layers, torch.float16, 4, factor)


class Fio:
    """fio --direct=1 with the same block size and thread count."""

    def __init__(self, path: Path, total: int, bs: int, threads: int):
        self.path, self.total, self.bs, self.threads = path, total, bs, threads

    def run(self, write: bool) -> float:
        per_job = self.total // self.threads // self.bs * self.bs
        cmd = [
            "fio",
            "--name=raw",
            f"--filename={self.path}",
            "--direct=1",
            "--ioengine=psync",
            f"--rw={'write' if write else 'read'}",
            f"--bs={self.bs}",
            f"--numjobs={self.threads}",
            f"--size={per_job}",
            f"--offset_increment={per_job}",
            "--group_reporting",
            "--end_fsync=1" if write else "--end_fsync=0",
            "--output-format=json",
        ]
        out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        return float(out["jobs"][0]["write" if write else "read"]["bw_bytes"])


class StoreBench:
    """Store ``total`` bytes of pre-packed blocks through ``DiskStore`` (checksums, O_DIRECT,
    fdatasync and synced index commits), ``job_threads`` jobs at a time, then load and
    verify them: the disk tier's own I/O path, without the CPU tier's pack/unpack."""

    def __init__(self, store: DiskStore | DiskIOProcess, block_bytes: int, n: int, per_job: int, job_threads: int):
        self.store, self.n, self.per_job, self.block_bytes = store, n, per_job, block_bytes
        self.pool = ThreadPoolExecutor(job_threads)
        self.bufs = [
            store.host_buffer(per_job * store.slot_size).view(per_job, store.slot_size) for _ in range(job_threads)
        ]
        for b in self.bufs:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
        self.hashes = [b"S" + i.to_bytes(8, "big") + os.urandom(23) for i in range(n)]

    def run(self, write: bool) -> float:
        t0 = time.perf_counter()
        futs = [
            self.pool.submit(
                self._write if write else self.store.read_blocks,
                0,
                self.hashes[a : a + self.per_job],
                list(range(self.n + a, self.n + min(self.n, a + self.per_job))),
                self.bufs[k % len(self.bufs)][: min(self.per_job, self.n - a)],
            )
            for k, a in enumerate(range(0, self.n, self.per_job))
        ]
        # A store's job thread is free once its writes are done (as in the handlers);
        # its outcome comes with the group commit.
        ok = [all(f.result().result() if write else f.result()) for f in futs]
        dt = time.perf_counter() - t0
        if not all(ok):
            raise RuntimeError(f"{ok.count(False)} store jobs failed")
        return self.n * self.block_bytes / dt

    def _write(self, rank: int, hashes: list[bytes], slots: list[int], rows: torch.Tensor):
        batch = self.store.begin_write(rank, hashes, slots)
        batch.submit(0, rows)
        batch.wait_idle()
        return batch.finish_async()

    def close(self) -> None:
        self.pool.shutdown()


class TierBench:
    """Store ``total`` bytes of blocks through a CpuDiskHandler, then load them back."""

    def __init__(
        self,
        root: Path,
        block_bytes: int,
        total: int,
        job_bytes: int,
        backend: str,
        io_threads: int,
        job_threads: int,
        disk_io: str = "thread",
        checksum: str = "xxh3_64",
        scattered: bool = False,
    ):
        self.layout = model_layout(block_bytes)
        self.slot = slot_size_for(self.layout.bytes_per_block)
        self.n = max(1, total // self.layout.bytes_per_block)
        self.per_job = max(1, job_bytes // self.layout.bytes_per_block)
        fp = Fingerprint.from_layout(self.layout, model_id="bench")
        # Twice n slots: the handler uses 0..n-1, StoreBench n..2n-1.
        opener = DiskIOProcess.open if disk_io == "process" else DiskStore.open
        self.store = opener(
            root,
            fp,
            self.layout,
            disk_bytes=2 * self.n * self.slot,
            checksum=checksum,
            io_backend=backend,
            io_threads=io_threads,
        )
        host_slots = min(self.n, 2 * job_threads * self.per_job)
        self.host = HostKVCache(self.layout, host_slots, shared=disk_io == "process")
        self.host.slot_rows.copy_(torch.randint(0, 256, self.host.slot_rows.shape, dtype=torch.uint8))
        self.handler = CpuDiskHandler(
            self.store, 0, self.host, self.layout, job_threads=job_threads, staging_bytes=max(2 * self.slot, job_bytes)
        )
        self.hashes = [i.to_bytes(8, "big") + os.urandom(24) for i in range(self.n)]
        self.job = 0
        # Job i's blocks come from CPU slots i*per_job.. (runs of consecutive slots), or with
        # ``scattered`` from those places of one fixed shuffle of the slots, as in a CPU
        # tier whose LRU has churned.
        order = np.arange(self.host.num_slots)
        if scattered:
            np.random.default_rng(0).shuffle(order)
        self.host_order = order.tolist()

    def _jobs(self):
        for a in range(0, self.n, self.per_job):
            b = min(self.n, a + self.per_job)
            host = [self.host_order[(a + i) % self.host.num_slots] for i in range(b - a)]
            yield CPULoadStoreSpec(host), DiskLoadStoreSpec(list(range(a, b)), self.hashes[a:b])

    def run(self, write: bool) -> float:
        ids = []
        t0 = time.perf_counter()
        for cpu, disk in self._jobs():
            self.job += 1
            ids.append(self.job)
            self.handler.transfer_async(self.job, (cpu, disk) if write else (disk, cpu))
        self.handler.wait(set(ids))
        dt = time.perf_counter() - t0
        results = self.handler.get_finished()
        if not all(r.success for r in results):
            raise RuntimeError(f"{sum(not r.success for r in results)} tier jobs failed")
        return self.n * self.layout.bytes_per_block / dt

    def close(self) -> None:
        self.handler.shutdown()
        self.store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory on the disk under test (default: a temporary one under the current directory)",
    )
    p.add_argument("--sizes", type=float_list, default="0.5,2,8", help="block sizes in MiB (default 0.5,2,8)")
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per measurement (default 512 MiB)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size (default 3)")
    p.add_argument("--job-mib", type=int, default=32, help="bytes per tier job (default 32 MiB)")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--job-threads", type=int, default=4, help="jobs in flight (default 4)")
    p.add_argument("--backend", default="auto", choices=("auto", "posix", "kvikio"))
    p.add_argument(
        "--busy-thread",
        action="store_true",
        help="run plain Python on one more thread of this process throughout, as an engine "
        "worker's own Python would (every path, the raw loop included)",
    )
    p.add_argument(
        "--disk-io",
        default="thread",
        choices=("thread", "process"),
        help="where the store and handler paths run their disk I/O: threads of this process "
        "(default) or a helper process (tiered_kv.disk.worker.io_process)",
    )
    p.add_argument(
        "--raw",
        default="auto",
        choices=("auto", "fio", "loop"),
        help="how the raw run into reused buffers is measured: fio (auto: where installed) or the O_DIRECT loop",
    )
    p.add_argument(
        "--checksum",
        default="xxh3_64",
        choices=CHECKSUMS,
        help="the tier's block checksum (default xxh3_64, the tier's default)",
    )
    p.add_argument("--plot", type=Path, default=None, help="also write a bar chart (PNG) here")
    p.add_argument(
        "--live-heap",
        action="store_true",
        help="do not freeze the heap built at setup (vLLM's workers freeze it after warm-up), "
        "so full garbage collections walk it all",
    )
    p.add_argument(
        "--scattered-slots",
        action="store_true",
        help="the handler's jobs take their blocks from CPU slots in a shuffled order, as from a "
        "CPU tier whose LRU has churned (default: runs of consecutive slots)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="time every preadv/pwritev call and print, per path, the calls in flight on average "
        "and the time per call (not with --disk-io process, whose calls run in the helper)",
    )
    p.add_argument(
        "--small-pages",
        action="store_true",
        help="host buffers on ordinary 4 KiB pages, not advised onto huge pages (to compare)",
    )
    args = p.parse_args()
    if args.trace and args.disk_io == "process":
        p.error("--trace times this process's calls; with --disk-io process they run in the helper process")
    if args.small_pages:
        device.HUGE_PAGE = 1 << 62  # no buffer is that large: empty_pageable takes torch.empty

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=".bench-disk-", dir=args.dir or Path.cwd()))
    use_fio = args.raw == "fio" or (args.raw == "auto" and shutil.which("fio") is not None)
    total = args.total_mib * MiB
    print(header("bench_disk", f"dir={root}"))
    print(
        f"# raw = O_DIRECT pwritev/preadv loop over a buffer the size of the handler's host KV cache, "
        f"{args.io_threads} threads; raw into reused buffers = "
        f"{'fio --direct=1 --ioengine=psync' if use_fio else 'the same loop, one block buffer per thread'}; "
        f"tier = CpuDiskHandler, {args.job_mib} MiB jobs, "
        f"{args.job_threads} job threads, {args.io_threads} I/O threads, {args.checksum} checksums; "
        f"{args.total_mib} MiB per "
        f"measurement, {args.rounds} rounds; THP {kernel_huge_pages('private')} "
        f"(shared memory: {kernel_huge_pages('shared')}); heap "
        f"{'live (--live-heap)' if args.live_heap else 'frozen after setup, as in a vLLM worker'}"
        f"{'; a busy Python thread beside every path (--busy-thread)' if args.busy_thread else ''}"
        f"; disk I/O in {'a helper process' if args.disk_io == 'process' else 'threads of this process'}"
        f"{', host buffers on 4 KiB pages (--small-pages)' if args.small_pages else ''}"
        f"; handler jobs from {'shuffled' if args.scattered_slots else 'consecutive'} CPU slots"
    )
    rows = []
    try:
        for size in args.sizes:
            bs = int(size * MiB)
            tier = TierBench(
                root / f"cache-{size}",
                bs,
                total,
                args.job_mib * MiB,
                args.backend,
                args.io_threads,
                args.job_threads,
                args.disk_io,
                args.checksum,
                args.scattered_slots,
            )
            raw_bs, raw_file = tier.slot, root / f"raw-{size}.bin"
            raw = RawLoop(raw_file, tier.n * raw_bs, raw_bs, args.io_threads, windows=tier.host.num_slots)
            hot = (
                Fio(raw_file, tier.n * raw_bs, raw_bs, args.io_threads)
                if use_fio
                else RawLoop(raw_file, tier.n * raw_bs, raw_bs, args.io_threads)
            )
            store = StoreBench(tier.store, tier.layout.bytes_per_block, tier.n, tier.per_job, args.job_threads)
            benches = (("raw", raw), ("hot", hot), ("store", store), ("tier", tier))
            res: dict[str, list[float]] = {f"{name}_{d}": [] for d in "wr" for name, _ in benches}
            cpu = {k: 0.0 for k in res}
            spins = {k: [0, 0.0] for k in res}  # busy thread: loops, seconds
            helper = tier.store.pid if isinstance(tier.store, DiskIOProcess) else None
            trace = IOTrace() if args.trace else None
            with worker_heap(frozen=not args.live_heap) as gc_pauses, busy_thread(args.busy_thread) as progress:
                for r in range(args.rounds):
                    # Rotate the order each round so no path always runs right after another.
                    order = rotated(benches, r)
                    for write in (True, False):
                        for name, bench in order:
                            key = f"{name}_{'w' if write else 'r'}"
                            c0, s0, t0 = cpu_seconds(helper), progress[0], time.perf_counter()
                            gc_pauses.key = key
                            with trace.measuring(key) if trace else contextlib.nullcontext():
                                res[key].append(bench.run(write))
                            cpu[key] += cpu_seconds(helper) - c0
                            spins[key][0] += progress[0] - s0
                            spins[key][1] += time.perf_counter() - t0
            backend = tier.store.backend.describe()
            direct = tier.store._files[0].direct if isinstance(tier.store, DiskStore) else "(in the helper)"
            views = tier.handler._views
            path = "staged" if views is None else "vectored" if views_fit(views, tier.store.slot_size) else "packed"
            store.close()
            tier.close()
            # Harmonic mean = total bytes / total time over the rounds.
            agg = {k: total_rate(v) / 1e9 for k, v in res.items()}
            moved = args.rounds * tier.n * tier.layout.bytes_per_block / 1e9
            agg.update({f"cpu_{k}": v / moved for k, v in cpu.items()})
            agg.update({f"spin_{k}": loops * 1000 / seconds / 1e6 for k, (loops, seconds) in spins.items()})
            rows.append((size, agg, res, trace))
            print(
                f"# {size} MiB blocks: backend {backend}, O_DIRECT {direct}, handler {path}, per-round GB/s "
                + ", ".join(f"{k}=[{' '.join(f'{x / 1e9:.2f}' for x in v)}]" for k, v in res.items())
                + "; garbage-collector pauses, ms: "
                + ", ".join(f"{k}={gc_pauses.ms[k]:.0f}" for k in res)
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print()
    print(
        "GB/s; store = DiskStore (checksum + O_DIRECT + fdatasync + synced index commits, shared by "
        "jobs that finish together); handler = CpuDiskHandler (from/to a host KV cache: vectored or packed, see above)"
    )
    print(
        f"{'block':>9} | {'raw write':>9} {'store':>6} {'ratio':>5} {'handler':>7} {'ratio':>5} | "
        f"{'raw read':>8} {'load':>6} {'ratio':>5} {'handler':>7} {'ratio':>5} | {'raw, reused buffers':>19}"
    )
    for size, agg, _, _ in rows:
        print(
            f"{size:>5} MiB | {agg['raw_w']:>9.2f} {agg['store_w']:>6.2f} {agg['store_w'] / agg['raw_w']:>5.2f} "
            f"{agg['tier_w']:>7.2f} {agg['tier_w'] / agg['raw_w']:>5.2f} | {agg['raw_r']:>8.2f} "
            f"{agg['store_r']:>6.2f} {agg['store_r'] / agg['raw_r']:>5.2f} {agg['tier_r']:>7.2f} "
            f"{agg['tier_r'] / agg['raw_r']:>5.2f} | {agg['hot_w']:>7.2f} w {agg['hot_r']:>6.2f} r"
        )
    for baseline, against in (
        ("raw", "the raw loop of its own round, seconds apart"),
        ("hot", "the raw run into reused buffers of its own round"),
    ):
        print()
        print(f"Per-round ratios (each path against {against}): median [min-max]; a wide range is the disk drifting")
        print(f"{'block':>9} | {'store write':>17} {'handler write':>17} | {'load':>17} {'handler read':>17}")
        for size, _, res, _ in rows:
            cells = [
                per_round(res[f"{tier}_{d}"], res[f"{baseline}_{d}"])
                for tier, d in (("store", "w"), ("tier", "w"), ("store", "r"), ("tier", "r"))
            ]
            print(f"{size:>5} MiB | {cells[0]:>17} {cells[1]:>17} | {cells[2]:>17} {cells[3]:>17}")
    print()
    print(
        "CPU seconds per GB moved (this process, all threads, user + system; with --disk-io process "
        "the I/O process's too)"
    )
    print(f"{'block':>9} | {'raw write':>9} {'store':>6} {'handler':>7} | {'raw read':>8} {'load':>6} {'handler':>7}")
    for size, agg, _, _ in rows:
        print(
            f"{size:>5} MiB | {agg['cpu_raw_w']:>9.3f} {agg['cpu_store_w']:>6.3f} {agg['cpu_tier_w']:>7.3f} | "
            f"{agg['cpu_raw_r']:>8.3f} {agg['cpu_store_r']:>6.3f} {agg['cpu_tier_r']:>7.3f}"
        )
    if args.busy_thread:
        print()
        print(
            "The busy thread's own progress beside each path (million additions per second): "
            "what an engine's Python keeps while the disk tier works"
        )
        print(
            f"{'block':>9} | {'raw write':>9} {'store':>6} {'handler':>7} | {'raw read':>8} {'load':>6} {'handler':>7}"
        )
        for size, agg, _, _ in rows:
            print(
                f"{size:>5} MiB | {agg['spin_raw_w']:>9.1f} {agg['spin_store_w']:>6.1f} {agg['spin_tier_w']:>7.1f} | "
                f"{agg['spin_raw_r']:>8.1f} {agg['spin_store_r']:>6.1f} {agg['spin_tier_r']:>7.1f}"
            )
    if args.trace:
        print()
        print(
            "preadv/pwritev calls: mean calls in flight x mean ms per call (--trace); raw keeps every I/O thread "
            "in a call, a path that keeps fewer spends time between calls, one with slower calls loses in the device"
        )
        print(
            f"{'block':>9} | {'raw write':>13} {'store':>13} {'handler':>13} | {'raw read':>13} {'load':>13} "
            f"{'handler':>13}"
        )
        for size, _, _, trace in rows:
            if trace is None:
                continue
            cells = [" ".join(f"{trace.cell(f'{path}_{d}'):>13}" for path in ("raw", "store", "tier")) for d in "wr"]
            print(f"{size:>5} MiB | " + " | ".join(cells))
        print()
        print(
            "Milliseconds before the first call and after the last one ended, per measurement (--trace): what "
            "a path pays once per measurement (a store's first synced index clear, its last fdatasync and "
            "commit), beside the raw loop's final fdatasync"
        )
        print(
            f"{'block':>9} | {'raw write':>13} {'store':>13} {'handler':>13} | {'raw read':>13} {'load':>13} "
            f"{'handler':>13}"
        )
        for size, _, _, trace in rows:
            if trace is None:
                continue
            cells = [
                " ".join(f"{trace.edges_cell(f'{path}_{d}'):>13}" for path in ("raw", "store", "tier")) for d in "wr"
            ]
            print(f"{size:>5} MiB | " + " | ".join(cells))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        x = np.arange(len(rows))
        series = (
            ("raw_w", "raw write"),
            ("store_w", "store"),
            ("tier_w", "handler store"),
            ("raw_r", "raw read"),
            ("store_r", "load"),
            ("tier_r", "handler load"),
        )
        for i, (key, label) in enumerate(series):
            ax.bar(x + (i - 2.5) * 0.13, [agg[key] for _, agg, _, _ in rows], 0.13, label=label)
        ax.set_xticks(x, [f"{s} MiB" for s, _, _, _ in rows])
        ax.set_ylabel("GB/s")
        ax.set_title("disk tier vs raw device (same run, interleaved)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
