#!/usr/bin/env python
"""Restart cost of the disk tier: how long reopening a namespace takes with N blocks in
its index (the manager adopts the LMDB index; no block data is read).

    python tools/bench_reopen.py                  # 100k and 1M blocks
    python tools/bench_reopen.py --blocks 1000000 --repeat 3

Baseline in the same run: a bare LMDB cursor scan of the same index (the floor any
index-based restart pays).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import lmdb
import numpy as np
import torch

from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.format.index import DiskIndex
from tiered_kv.disk.format.index_records import entry_dtype
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import Namespace
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout

LAYOUT = KVCacheLayout((LayerLayout("kv", (1, 4096), False),), torch.uint8, 16)


def fill(index: DiskIndex, n: int) -> None:
    """``n`` complete entries with random 32-byte hashes, written in one transaction."""
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 256, size=(n, 32), dtype=np.uint8).view("V32").ravel())
    keys = keys.view(np.uint8).reshape(-1, 32)
    arr = np.zeros(len(keys), dtype=entry_dtype(1, 32))
    arr["slot"] = rng.permutation(len(keys))
    arr["size"] = LAYOUT.bytes_per_block
    arr["store_time"] = time.time()
    arr["last_access"] = rng.random(len(keys))
    arr["ranks"] = 1
    arr["hash"] = keys.view("S32").ravel()
    blob, kb, sz = arr.tobytes(), keys.tobytes(), arr.dtype.itemsize
    items = [(kb[i * 32 : (i + 1) * 32], blob[i * sz : (i + 1) * sz]) for i in range(len(keys))]
    index._shared.run(lambda txn: txn.cursor(db=index._db("blocks")).putmulti(items, append=True), write=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    fp = Fingerprint.from_layout(LAYOUT, model_id="bench-reopen")
    print(f"# load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    print(f"{'blocks':>9} {'lmdb scan s':>12} {'reopen s (best)':>16} {'reopen s (worst)':>17} {'loadable':>9}")
    for n in args.blocks:
        with tempfile.TemporaryDirectory(prefix="bench-reopen-") as tmp:
            ns = Namespace.open(tmp, fp, LAYOUT, num_slots=n)
            ns.allocate_slab(0)
            idx = DiskIndex(ns.index_path, 1, expected_entries=n)
            fill(idx, n)
            idx.close()
            env = lmdb.open(str(ns.index_path), readonly=True, lock=False, max_dbs=8)
            t0 = time.perf_counter()
            with env.begin() as txn:
                scanned = sum(1 for _ in txn.cursor(db=env.open_db(b"blocks", txn=txn)))
            scan = time.perf_counter() - t0
            env.close()
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                m = DiskOffloadingManager(tmp, fp, LAYOUT, disk_bytes=n * 4096)
                times.append(time.perf_counter() - t0)
                loadable = len(m)
                m.shutdown()
            assert scanned == loadable
            print(f"{n:>9} {scan:>12.3f} {min(times):>16.3f} {max(times):>17.3f} {loadable:>9}")
    print(f"# load average (1 min) at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
