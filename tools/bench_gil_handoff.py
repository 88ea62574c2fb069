"""What a call costs a disk-tier worker thread when another thread of its process runs Python.

A call that releases the GIL must take it back afterwards, and while another thread is
running Python that wait lasts until the other thread drops the GIL: at the latest after
the interpreter's switch interval (``sys.getswitchinterval()``, 5 ms by default). In a
vLLM worker the main thread runs Python between kernel launches, so every such release
on a disk-tier thread (torch calls, numpy copies above a few hundred elements, ctypes)
can turn microseconds into milliseconds. Pure-Python work and calls that keep the GIL
(slicing a memoryview or a numpy array) pay nothing extra.

For each call, the mean time per call alone and beside one thread that spins in Python
(both measured in this run, alternating), and their ratio:

    python tools/bench_gil_handoff.py [--calls 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from benchlib import busy_thread, header

from tiered_kv.disk.store.io_backends import host_view


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="calls per measurement (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = p.parse_args()

    rows = torch.zeros(16, 1 << 20, dtype=torch.uint8)  # 16 rows of 1 MiB, as a staging buffer
    flat = host_view(rows)
    array = rows.numpy()
    piece = np.zeros((16, 8 << 10), dtype=np.uint8)  # 8 KiB pieces of 16 slots: a 0.5 MiB block's plane
    packed = np.zeros((16, 64 << 10), dtype=np.uint8)
    calls: dict[str, Callable[[], object]] = {
        "torch: rows[2:5]": lambda: rows[2:5],
        "torch: rows.reshape(-1)": lambda: rows.reshape(-1),
        "host_view(rows[2])": lambda: host_view(rows[2]),
        "memoryview slice": lambda: flat[2 << 20 : 5 << 20],
        "numpy slice": lambda: array[2:5],
        "numpy copy, 16 x 8 KiB": lambda: packed[:, : 8 << 10].__setitem__(slice(None), piece),
    }
    alone: dict[str, list[float]] = {k: [] for k in calls}
    busy: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(args.rounds):
        for beside in (False, True) if r % 2 == 0 else (True, False):
            for name, fn in calls.items():
                if beside:
                    with busy_thread(True):  # a thread running plain Python, as an engine's main thread would
                        time.sleep(0.01)
                        busy[name].append(per_call_us(fn, args.calls))
                else:
                    alone[name].append(per_call_us(fn, args.calls))

    print(
        header("bench_gil_handoff")
        + f"  python {sys.version.split()[0]}  torch {torch.__version__}  numpy {np.__version__}  switch interval "
        f"{sys.getswitchinterval() * 1e3:.1f} ms  {args.calls} calls x {args.rounds} rounds"
    )
    print(f"{'call':<26} | {'alone us':>9} | {'beside busy Python us':>21} | {'ratio':>7}")
    for name in calls:
        a, b = float(np.median(alone[name])), float(np.median(busy[name]))
        print(f"{name:<26} | {a:>9.1f} | {b:>21.1f} | {b / a:>7.1f}")


if __name__ == "__main__":
    main()
