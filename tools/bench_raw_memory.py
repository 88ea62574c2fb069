#!/usr/bin/env python3
"""How fast the raw device moves blocks, depending on the memory they come from or go to.

A benchmark's raw baseline usually reuses one block-sized buffer per thread (fio does).
A cache cannot: it loads distinct blocks into distinct memory, and writes them from
there. On a virtual disk the host copies every block into or out of guest memory, and
the amount of memory it touches may change its speed. This measures that, in one run,
interleaved: the same O_DIRECT loop as ``bench_disk.py``'s raw path (one ``pwritev`` /
``preadv`` per block on each of ``--threads`` threads, sequential offsets, one
``fdatasync`` after the writes), with block ``i`` from/into window ``i % windows`` of
one buffer, for buffers ("footprints") from one block per thread up to the size of
the handler's host KV cache in ``bench_disk.py``; and, at the largest footprint, each
block gathered from (scattered to) ``--pieces`` layer planes, as the CPU tier stores
it and the handler's vectored I/O moves it.

    python tools/bench_raw_memory.py [--dir PATH] [--sizes 0.5,2,8] [--footprints-mib 8,16,32,64,256]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchlib import MiB, RawLoop, float_list, header, median_range, rotated, scratch_dir, windows_iovec

from tiered_kv.disk.store.io_backends import host_view


def planes(view: memoryview, bs: int, windows: int, pieces: int):
    """Block ``w``'s piece ``p`` at ``p * plane + w * piece``: one plane per layer, as in
    the CPU tier's host KV cache."""
    piece = bs // pieces
    plane = windows * piece
    return lambda i: [
        view[p * plane + i % windows * piece : p * plane + (i % windows + 1) * piece] for p in range(pieces)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory on the disk under test (default: a temporary one under the current directory)",
    )
    p.add_argument("--sizes", type=float_list, default="0.5,2,8", help="block sizes in MiB (default 0.5,2,8)")
    p.add_argument(
        "--footprints-mib",
        default="8,16,32,64,256",
        help="buffer sizes in MiB, each at least one block per thread (default 8,16,32,64,256)",
    )
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per measurement (default 512 MiB)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--pieces", type=int, default=64, help="layer planes a scattered block is split over (default 64)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    with scratch_dir(".bench-raw-memory-", args.dir) as root:
        run(args, root)


def run(args: argparse.Namespace, root: Path) -> None:
    """Every block size's table, its files in ``root``."""
    print(
        header("bench_raw_memory", f"dir={root}")
        + f"; {args.threads} threads, {args.total_mib} MiB per measurement, {args.rounds} rounds, "
        "buffers on transparent huge pages (empty_pageable)"
    )
    print(
        "GB/s, median over the rounds [min-max]; 'reused' = one block buffer per thread, as fio's; "
        f"'scattered' = the largest footprint, each block in {args.pieces} layer planes"
    )
    for size in args.sizes:
        bs = int(size * MiB)
        reused = args.threads * bs
        footprints = sorted({reused} | {max(reused, int(f) * MiB // bs * bs) for f in args.footprints_mib.split(",")})
        loop = RawLoop(
            root / f"raw-{size}.bin",
            args.total_mib * MiB // bs * bs,
            bs,
            args.threads,
            windows=footprints[-1] // bs,
        )
        view = host_view(loop.buf)
        paths = [
            (f"{f // MiB} MiB" + (" reused" if f == reused else ""), windows_iovec(view, bs, f // bs))
            for f in footprints
        ]
        if bs % (args.pieces * 4096) == 0:
            paths.append(("scattered", planes(view, bs, footprints[-1] // bs, args.pieces)))
        res: dict[tuple[str, bool], list[float]] = {(name, w): [] for name, _ in paths for w in (True, False)}
        loop.run(write=True)  # the file's blocks exist before the first read
        for r in range(args.rounds):
            order = rotated(paths, r)
            for write in (True, False):
                for name, iovec in order:
                    res[(name, write)].append(loop.run_iovecs(iovec, write) / 1e9)
        print(f"\n{size} MiB blocks")
        print(f"{'buffer':>16} | {'write':>17} | {'read':>17}")
        for name, _ in paths:
            cells = []
            for write in (True, False):
                cells.append(median_range(res[(name, write)]))
            print(f"{name:>16} | {cells[0]:>17} | {cells[1]:>17}")


if __name__ == "__main__":
    main()
