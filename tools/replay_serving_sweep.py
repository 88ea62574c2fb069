#!/usr/bin/env python
"""The serving replay's grid: ``tools/replay_serving.py`` per workload, tier, utilisation
and tier bandwidth, summarised as one markdown table of mean and p90 TTFT per cell.

Each cell is one ``replay_serving`` run (same arrivals for every configuration); a cell
is **met** where ``cost-aware`` is within ``--tolerance`` (default 3%) of the better of
``always`` and ``recompute`` in both mean and p90 TTFT. Cells run in ``--jobs`` worker
processes; each keeps its lower tier's index under a temporary directory, removed after.
Options it does not name go to every replay (faults: ``--tier-slow``, ``--tier-fail``).

    python tools/replay_serving_sweep.py \\
        --workloads ../shared/traces/mooncake_fast25_conversation_trace.jsonl,long-context \\
        --tiers disk,shared --utilisation 0.3,0.7,0.9 --gbps 1,2,3,6 --jobs 2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from benchlib import md_table  # noqa: E402
from replay_serving import parse_args, replay  # noqa: E402
from replay_serving_workloads import GENERATED  # noqa: E402

#: The columns of a cell, in order.
SHOWN = ("always", "recompute", "cost-aware", "e460906")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def cell(workload: str, tier: str, utilisation: float, gbps: float, extra: Sequence[str]) -> dict:
    """One replay: per configuration, mean and p90 TTFT in seconds."""
    src = ["--workload", workload] if workload in GENERATED else ["--trace", workload]
    args = parse_args(
        [
            *src,
            "--tier",
            tier,
            "--utilisation",
            str(utilisation),
            "--tier-gbps",
            str(gbps),
            "--configs",
            ",".join(SHOWN),
            *extra,
        ]
    )
    _, results, _ = replay(args)
    out = {}
    for r in results:
        t = np.asarray(r.ttft)
        out[r.config] = (float(t.mean()), float(np.percentile(t, 90)))
    return {"workload": workload, "tier": tier, "u": utilisation, "gbps": gbps, "ttft": out}


def met(ttft: dict, tolerance: float) -> tuple[bool, bool]:
    """Whether cost-aware is within ``tolerance`` of the better baseline, in mean and in p90."""
    return tuple(
        ttft["cost-aware"][i] <= (1 + tolerance) * min(ttft["always"][i], ttft["recompute"][i]) for i in (0, 1)
    )


def _name(workload: str) -> str:
    stem = Path(workload).stem
    return stem.removeprefix("mooncake_fast25_").removesuffix("_trace") if workload not in GENERATED else workload


def _fmt(seconds: float) -> str:
    return f"{seconds:,.0f}" if seconds >= 100 else f"{seconds:.1f}" if seconds >= 1 else f"{seconds:.2f}"


def render(cells: list[dict], gbps: Sequence[float], tolerance: float) -> str:
    """One row per workload, tier and utilisation; per bandwidth ``mean; p90`` TTFT (s) of
    ``always / recompute / cost-aware / e460906``, bold where cost-aware misses."""
    rows = []
    by_key = {(c["workload"], c["tier"], c["u"], c["gbps"]): c for c in cells}
    for workload, tier, u in dict.fromkeys((c["workload"], c["tier"], c["u"]) for c in cells):
        row = [_name(workload), tier, f"{u:g}"]
        for g in gbps:
            c = by_key.get((workload, tier, u, g))
            if c is None:
                row.append("")
                continue
            ttft = c["ttft"]
            parts = []
            for i, ok in zip((0, 1), met(ttft, tolerance)):
                text = " / ".join(_fmt(ttft[k][i]) for k in SHOWN if k in ttft)
                parts.append(text if ok else f"**{text}**")
            row.append("; ".join(parts))
        rows.append(row)
    return md_table(["workload", "tier", "U", *(f"{g:g} GB/s" for g in gbps)], rows, left=3)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--workloads", required=True, help=f"comma-separated: Mooncake trace paths or {', '.join(GENERATED)}"
    )
    p.add_argument("--tiers", default="disk,shared")
    p.add_argument("--utilisation", default="0.3,0.7,0.9")
    p.add_argument("--gbps", default="1,2,3,6")
    p.add_argument(
        "--tolerance", type=float, default=0.03, help="cost-aware's allowance over the better (default 0.03)"
    )
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args, extra = p.parse_known_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    us, gbps = _floats(args.utilisation), _floats(args.gbps)
    grid = [(w, t, u, g) for w in workloads for t in tiers for u in us for g in gbps]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(cell, *key, extra) for key in grid]
        cells = [f.result() for f in futures]
    print(render(cells, gbps, args.tolerance))
    ok = sum(all(met(c["ttft"], args.tolerance)) for c in cells)
    print(
        f"\ncost-aware within {args.tolerance:.0%} of the better of always and recompute, mean and p90: "
        f"{ok} of {len(cells)} cells ({time.perf_counter() - t0:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
