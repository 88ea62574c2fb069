#!/usr/bin/env python3
"""Host buffers on transparent huge pages against 4 KiB pages, for disk transfers.

The tier's long-lived pageable buffers (the CPU tier without CUDA, staging) come from
``device.empty_pageable``: 2 MiB-aligned and advised ``MADV_HUGEPAGE``. This script
measures what that buys, in one process, with four paths interleaved over the rounds
(order rotated every round, as the disk drifts):

- ``raw 4k`` / ``raw thp``: ``bench_disk.py``'s plain O_DIRECT loop, its buffers on
  4 KiB pages / from ``empty_pageable``;
- ``handler 4k`` / ``handler thp``: ``CpuDiskHandler`` between a host KV cache and the
  disk (``bench_disk.py``'s ``TierBench``), the cache and its staging buffers on 4 KiB
  pages / from ``empty_pageable``.

Buffers under 2 MiB are the same in both modes (``torch.empty``). Prints GB/s over all
rounds (bytes / time summed), each path against both raw loops, and CPU seconds per GB.

    python tools/bench_host_pages.py [--sizes 0.5,2,8] [--rounds 8] [--dir PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_disk import TierBench
from benchlib import MiB, RawLoop, cpu_seconds, float_list, header, rotated, scratch_dir, total_rate

from tiered_kv.memory import device


def build(root: Path, block_bytes: int, total: int, small_pages: bool) -> tuple[TierBench, RawLoop]:
    """A handler bench (its staging buffers made now) and a raw loop, every host buffer
    on 4 KiB pages when ``small_pages``."""
    saved = device.HUGE_PAGE
    if small_pages:
        device.HUGE_PAGE = 1 << 62  # no buffer is that large: empty_pageable takes torch.empty
    try:
        tier = TierBench(root / f"tier-{small_pages}", block_bytes, total, 32 * MiB, "posix", 4, 4)
        staging = tier.handler._staging
        held = [staging.acquire() for _ in range(4)]
        for buf in held:
            staging.release(buf)
        raw = RawLoop(root / f"raw-{small_pages}.bin", tier.n * tier.slot, tier.slot, 4)
    finally:
        device.HUGE_PAGE = saved
    return tier, raw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float_list, default="0.5,2,8", help="block sizes in MiB (default 0.5,2,8)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per measurement")
    p.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    args = p.parse_args()
    total = args.total_mib * MiB
    print(
        header(
            "bench_host_pages",
            f"THP {device.kernel_huge_pages()}",
            f"{args.rounds} rounds, {args.total_mib} MiB per measurement, 4 I/O threads",
        )
    )
    print(
        f"{'block':>9} {'dir':>5} {'path':>14} {'pages':>5} | {'GB/s':>5} {'/raw 4k':>7} {'/raw thp':>8} | "
        f"{'CPU s/GB':>8}"
    )
    for size in args.sizes:
        with scratch_dir(".bench-pages-", args.dir) as root:
            tier_4k, raw_4k = build(root, int(size * MiB), total, small_pages=True)
            tier_thp, raw_thp = build(root, int(size * MiB), total, small_pages=False)
            paths: dict[tuple[str, str], TierBench | RawLoop] = {
                ("raw", "4k"): raw_4k,
                ("raw", "thp"): raw_thp,
                ("tier", "4k"): tier_4k,
                ("tier", "thp"): tier_thp,
            }
            kind = "views" if tier_4k.handler._views is not None else "staged"
            for write in (True, False):
                speeds: dict[tuple[str, str], list[float]] = {k: [] for k in paths}
                cpu = dict.fromkeys(paths, 0.0)
                for r in range(args.rounds):
                    for key in rotated(list(paths), r):
                        c0 = cpu_seconds()
                        speeds[key].append(paths[key].run(write))
                        cpu[key] += cpu_seconds() - c0
                gbs = {k: total_rate(v) / 1e9 for k, v in speeds.items()}
                moved = args.rounds * total / 1e9
                for (path, pages), v in gbs.items():
                    label = f"{size} MiB" if (path, pages, write) == ("raw", "4k", True) else ""
                    name = "raw loop" if path == "raw" else f"handler {kind}"
                    print(
                        f"{label:>9} {'write' if write else 'read':>5} {name:>14} {pages:>5} | {v:>5.2f} "
                        f"{v / gbs['raw', '4k']:>7.2f} {v / gbs['raw', 'thp']:>8.2f} | "
                        f"{cpu[path, pages] / moved:>8.2f}"
                    )
            tier_4k.close()
            tier_thp.close()


if __name__ == "__main__":
    main()
