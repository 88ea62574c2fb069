#!/usr/bin/env python3
"""What a busy Python thread in the same process does to O_DIRECT I/O threads.

The disk handlers run their I/O on threads of the worker process (``os.pwritev`` and
``os.preadv`` release the GIL during the call). Each thread needs the GIL back between
two calls, so a thread of the same process that keeps the GIL busy (an engine's model
runner, a full garbage collection) delays every next call, while a busy *process* does
not. This measures it: the raw O_DIRECT write loop of ``bench_disk.py`` (one slot per
call on each of ``--threads`` threads, sequential offsets, one ``fdatasync`` at the end)
alone, beside a thread running plain Python, and beside a process running the same,
interleaved over ``--rounds`` rounds.

    python tools/bench_gil_io.py [--dir PATH] [--block-mib 2] [--total-mib 512] [--rounds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import MiB, RawLoop, busy_thread, header, rotated, scratch_dir, spin, total_rate


def beside(kind: str, run: Callable[[], float]) -> float:
    """``run()`` while a thread or a process spins (``kind``), or alone."""
    if kind == "alone":
        return run()
    if kind == "thread":
        with busy_thread(True):
            time.sleep(0.2)  # the spinner is running before the I/O starts
            return run()
    spawn = mp.get_context("spawn")
    stop = spawn.Event()
    other = spawn.Process(target=spin, args=(stop,))
    other.start()
    time.sleep(0.2)
    try:
        return run()
    finally:
        stop.set()
        other.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    p.add_argument("--block-mib", type=float, default=2)
    p.add_argument("--total-mib", type=int, default=512)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    with scratch_dir(".bench-gil-io-", args.dir) as tmp:
        bs = int(args.block_mib * MiB)
        raw = RawLoop(tmp / "raw.bin", args.total_mib * MiB // bs * bs, bs, args.threads)
        kinds = ("alone", "thread", "process")
        res: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in rotated(kinds, r):
                res[kind].append(beside(kind, lambda: raw.run(True)))
    print(
        header("bench_gil_io")
        + f"; O_DIRECT writes of {args.block_mib} MiB on {args.threads} threads, {args.total_mib} MiB per pass, "
        f"{args.rounds} rounds"
    )
    print(f"{'round':>5} {'alone GB/s':>11} {'+ thread':>9} {'ratio':>6} {'+ process':>10} {'ratio':>6}")
    for r in range(args.rounds):
        a, t, q = (res[k][r] / 1e9 for k in kinds)
        print(f"{r:>5} {a:>11.2f} {t:>9.2f} {t / a:>6.2f} {q:>10.2f} {q / a:>6.2f}")
    total = {k: total_rate(v) / 1e9 for k, v in res.items()}
    print(
        f"{'all':>5} {total['alone']:>11.2f} {total['thread']:>9.2f} {total['thread'] / total['alone']:>6.2f} "
        f"{total['process']:>10.2f} {total['process'] / total['alone']:>6.2f}"
    )


if __name__ == "__main__":
    main()
