#!/usr/bin/env python
"""Scheduler-side cost of the composite manager beside vLLM's own CPU LRU manager.

One process, same block counts, same operation sequence. Prints, per tier size, the
per-block cost (ns) of lookup, prepare_store, complete_store and touch for:

- ``vllm-cpu``: vLLM 0.33's ``CPUOffloadingManager`` (per-key API), when vLLM is importable;
- ``tiered-cpu``: our composite manager over the CPU tier alone;
- ``tiered-cpu+disk``: the composite with the disk tier attached (write-through; block
  placement and index bookkeeping only: no bytes move, so this is the scheduler's cost).

And the latency distribution of a 256-block ``prepare_store`` that cascades (a full CPU
tier; every call evicts 256 blocks to the disk tier), p50/p99 in microseconds.

    python tools/bench_manager.py                 # 10k, 100k, 1M blocks
    python tools/bench_manager.py --sizes 10000   # quicker
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np

from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.disk.fingerprint import Fingerprint
from tiered_kv.disk.manager import DiskOffloadingManager
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.tiered.manager import TieredOffloadingManager

BATCH = 256  # blocks per call, like a long prompt's chunk
LAYOUT = KVCacheLayout((LayerLayout("kv", (1, 2048), False),), __import__("torch").uint8, 16)


def hashes(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(start, start + n)]


def timed(fn, batches) -> float:
    """Seconds per block of ``fn(batch)`` over all batches."""
    t0 = time.perf_counter()
    for batch in batches:
        fn(batch)
    return (time.perf_counter() - t0) / sum(map(len, batches))


def batches_of(keys: list, size: int = BATCH) -> list[list]:
    return [keys[i:i + size] for i in range(0, len(keys), size)]


def bench_ours(manager, n: int) -> dict[str, float]:
    keys = hashes(n)
    b = batches_of(keys)
    out = {}
    outs = []
    out["prepare_store"] = timed(lambda k: outs.append(manager.prepare_store(k)), b)
    out["complete_store"] = timed(manager.complete_store, b)
    out["lookup"] = timed(manager.lookup, b)
    out["touch"] = timed(manager.touch, b)
    return out


def bench_vllm(n: int) -> dict[str, float] | None:
    try:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmCPU
    except Exception:
        return None
    manager = VllmCPU(num_chunks=n, cache_policy="lru")
    ctx = ReqContext(req_id="bench")
    manager.on_new_request(ctx)
    keys = [make_offload_key(h, 0) for h in hashes(n)]
    b = batches_of(keys)
    out = {"prepare_store": timed(lambda k: manager.prepare_store(k, ctx), b),
           "complete_store": timed(lambda k: manager.complete_store(k, ctx), b),
           "lookup": timed(lambda k: [manager.lookup(key, ctx) for key in k], b),
           "touch": timed(lambda k: manager.touch(k, ctx), b)}
    return out


def disk_manager(tmp: str, n: int) -> DiskOffloadingManager:
    fp = Fingerprint.from_layout(LAYOUT, model_id="bench-manager")
    return DiskOffloadingManager(tmp, fp, LAYOUT, disk_bytes=n * 4096)


def cascade_latency(n: int, tmp: str, calls: int) -> list[float]:
    """Per-call seconds of a 256-block prepare_store (+ complete_store) on a full CPU tier."""
    disk = disk_manager(tmp, 2 * n + calls * BATCH)
    manager = TieredOffloadingManager(CPUOffloadingManager(n, 16), disk, write_policy="write_back",
                                      max_pending_disk_writes=10 * BATCH)
    for batch in batches_of(hashes(n)):
        manager.complete_store(manager.prepare_store(batch).block_hashes_to_store)
    lat = []
    for i in range(calls):
        batch = hashes(BATCH, n + i * BATCH)
        t0 = time.perf_counter()
        out = manager.prepare_store(batch)
        lat.append(time.perf_counter() - t0)
        assert out is not None and len(out.store_spec.spills) == BATCH
        manager.complete_store(out.block_hashes_to_store)
        # The "worker" acknowledges the spills as failed so the pending bound never bites:
        # this measures the scheduler's decision cost, not disk throughput.
        manager.complete_store([w.block_hash for w in out.store_spec.spills], success=False)
        disk.complete_store([w.block_hash for w in out.store_spec.spills], success=False)
        manager._disk_pending.clear()
    manager.shutdown()
    return lat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--cascade-calls", type=int, default=200)
    args = ap.parse_args()
    ops = ("lookup", "prepare_store", "complete_store", "touch")
    print(f"per-block cost in ns ({BATCH}-block calls); ratio = tiered / vllm-cpu")
    header = f"{'blocks':>9} {'manager':>16} " + " ".join(f"{o:>15}" for o in ops)
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        rows = {}
        vllm = bench_vllm(n)
        if vllm:
            rows["vllm-cpu"] = vllm
        rows["tiered-cpu"] = bench_ours(TieredOffloadingManager(CPUOffloadingManager(n, 16)), n)
        with tempfile.TemporaryDirectory(prefix="bench-manager-") as tmp:
            m = TieredOffloadingManager(CPUOffloadingManager(n, 16), disk_manager(tmp, 2 * n))
            rows["tiered-cpu+disk"] = bench_ours(m, n)
            m.shutdown()
        for name, r in rows.items():
            cells = []
            for o in ops:
                cell = f"{r[o] * 1e9:9.0f}"
                if vllm and name != "vllm-cpu":
                    cell += f" ({r[o] / vllm[o]:.2f})"
                cells.append(f"{cell:>15}")
            print(f"{n:>9} {name:>16} " + " ".join(cells))
    print()
    print(f"{BATCH}-block prepare_store that cascades (write_back spills to disk), {args.cascade_calls} calls")
    print(f"{'CPU blocks':>10} {'p50 us':>9} {'p99 us':>9} {'max us':>9}")
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-manager-") as tmp:
            lat = sorted(cascade_latency(n, tmp, args.cascade_calls))
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"{n:>10} {statistics.median(lat) * 1e6:9.0f} {p99 * 1e6:9.0f} {lat[-1] * 1e6:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
