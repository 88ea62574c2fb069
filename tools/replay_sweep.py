"""``tools/replay.py --disk-gbps ...``: the load-versus-recompute sweep over a lower
tier's bandwidth, with the disk tier and with the shared tier below CPU.

Runs ``replay_cost`` (block level, the product's managers, no bytes) for each bandwidth
and prints, per lower tier: estimated TTFT of ``no-offload``, ``cpu``, the lower tier
loading every block found (``always``) and cost-aware (the default), the savings
against ``no-offload``, the checks of issue 40 (cost-aware never worse than the better
of no-offload and cpu by more than 2%; at or above break-even, within 2% of the full
gain of always loading), the infinite-cache ceiling and Belady's optimum; and, on the
top bandwidth, ``write_admission: reuse(2)`` against ``all`` and the oracle admission
(blocks written per block read from the lower tier, hit rate). Optionally a plot of TTFT
against bandwidth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any
from pathlib import Path

from benchlib import md_table
from replay_cost import CostRun, CostSetup, LowerModel, belady_hit_rate, infinite_hit_rate, run, used_once_share


@dataclass
class Sweep:
    """One workload's sweep: per lower tier, per bandwidth, the runs by configuration."""

    name: str
    setup: CostSetup
    baseline: dict[str, CostRun]  # no-offload, cpu
    lower: dict[str, dict[float, dict[str, CostRun]]]  # tier -> GB/s -> always / cost-aware
    admission: dict[tuple[float, str], CostRun]  # (disk x working set, all / reuse(2) / oracle), top bandwidth
    infinite: float
    belady: float
    seconds: float
    latencies: dict[str, float]
    belady_cpu: float = 0.0
    used_once: float = 0.0  # share of the distinct blocks that occur in one request only


def sweep(
    name,
    requests,
    tails,
    setup: CostSetup,
    gbps: list[float],
    lowers: list[LowerModel],
    log,
    admission_sizes: dict[float, int] | None = None,
) -> Sweep:
    """``admission_sizes``: disk sizes (x the working set -> blocks) of the write-admission
    table beside the sweep's own (``setup.lower_blocks``)."""
    t0 = time.perf_counter()
    base = {
        "no-offload": run("no-offload", requests, tails, setup, None, offload=False),
        "cpu": run("cpu", requests, tails, setup, None),
    }
    out: dict[str, dict[float, dict[str, CostRun]]] = {}
    admission: dict[tuple[float, str], CostRun] = {}
    for lower in lowers:
        out[lower.name] = {}
        for g in gbps:
            model = LowerModel(lower.name, lower.medium, g, lower.latency_s)
            out[lower.name][g] = {
                "always": run(f"{lower.name}-always", requests, tails, setup, model, cost_aware=False),
                "cost-aware": run(lower.name, requests, tails, setup, model),
            }
        log(f"  {name}: {lower.name} swept ({time.perf_counter() - t0:.0f} s)")
    disk = lowers[0]
    top = LowerModel(disk.name, disk.medium, max(gbps), disk.latency_s)
    for fraction, blocks in sorted((admission_sizes or {}).items(), reverse=True):
        sized = replace(setup, lower_blocks=blocks)
        if blocks == setup.lower_blocks:
            admission[fraction, "all"] = out[disk.name][max(gbps)]["cost-aware"]
        else:
            admission[fraction, "all"] = run(f"{disk.name}-all", requests, tails, sized, top)
        admission[fraction, "reuse(2)"] = run(f"{disk.name}-reuse2", requests, tails, sized, top, admit=2)
        admission[fraction, "oracle"] = run(f"{disk.name}-oracle", requests, tails, sized, top, oracle=True)
        log(f"  {name}: write admission at {fraction:g} x the working set ({time.perf_counter() - t0:.0f} s)")
    capacity = setup.device_blocks + setup.cpu_blocks + setup.lower_blocks
    return Sweep(
        name,
        setup,
        base,
        out,
        admission,
        infinite_hit_rate(requests),
        belady_hit_rate(requests, capacity),
        time.perf_counter() - t0,
        {lower.name: lower.latency_s for lower in lowers},
        belady_hit_rate(requests, setup.device_blocks + setup.cpu_blocks),
        used_once_share(requests),
    )


def checks(s: Sweep, tier: str, g: float) -> tuple[bool, bool | None]:
    """(never worse than the better of no-offload and cpu by more than 2%; at or above
    break-even, within 2% of always loading's gain, else None)."""
    no, cpu = s.baseline["no-offload"].mean_ttft, s.baseline["cpu"].mean_ttft
    runs = s.lower[tier][g]
    cost, always = runs["cost-aware"].mean_ttft, runs["always"].mean_ttft
    never_worse = cost <= 1.02 * min(no, cpu)
    if g < s.setup.break_even_gbps:
        return never_worse, None
    gain_cost, gain_always = no - cost, no - always
    return never_worse, gain_cost >= gain_always - 0.02 * abs(gain_always)


def tables(s: Sweep) -> str:
    no = s.baseline["no-offload"].mean_ttft
    lines = []
    for tier, by_gbps in s.lower.items():
        rows = []
        for g, runs in by_gbps.items():
            nw, fg = checks(s, tier, g)
            a, c = runs["always"], runs["cost-aware"]
            rows.append(
                [
                    f"{g:g}",
                    f"{no * 1e3:.1f}",
                    f"{s.baseline['cpu'].mean_ttft * 1e3:.1f}",
                    f"{a.mean_ttft * 1e3:.1f} ({1 - a.mean_ttft / no:+.1%})",
                    f"{c.mean_ttft * 1e3:.1f} ({1 - c.mean_ttft / no:+.1%})",
                    f"{a.hit_rate:.3f} / {c.hit_rate:.3f}",
                    f"{c.share(tier):.3f}",
                    c.tiers.get(tier, {}).get("skipped_slower_than_recompute", 0),
                    "yes" if nw else "NO",
                    "-" if fg is None else "yes" if fg else "NO",
                ]
            )
        lines.append(
            f"{s.name}, {tier} below CPU"
            + (f" (per-job latency {s.latencies[tier] * 1e3:g} ms)" if s.latencies[tier] else "")
            + ":\n\n"
            + md_table(
                [
                    f"{tier} GB/s",
                    "no-offload ms",
                    "cpu ms",
                    f"cpu+{tier} always ms",
                    f"cpu+{tier} cost-aware ms",
                    "hit rate always / cost-aware",
                    f"{tier} share (cost-aware)",
                    f"{tier} blocks skipped",
                    "never worse (2%)",
                    "full gain (2%)",
                ],
                rows,
            )
        )
    disk = next(iter(s.lower))
    rows = []
    for (fraction, policy), r in s.admission.items():
        t = r.tiers.get(disk, {})
        hits = t.get("hits", 0)
        rows.append(
            [
                f"{fraction:g}",
                policy,
                t.get("stores", 0),
                hits,
                f"{t['stores'] / hits:.2f}" if hits else "-",
                f"{r.hit_rate:.3f}",
                f"{r.mean_ttft * 1e3:.1f}",
            ]
        )
    top = max(s.lower[disk])
    lines.append(
        f"write admission on the {disk} tier at {top:g} GB/s ({s.used_once:.0%} of the distinct "
        "blocks occur in one request only; `oracle` takes a block only if a later request "
        "uses it):\n\n"
        + md_table(
            [
                f"{disk} x working set",
                "write_admission",
                "blocks written",
                "blocks read",
                "written per read",
                "hit rate",
                "TTFT ms",
            ],
            rows,
        )
    )
    lines.append(
        f"references (block hit rate): infinite cache {s.infinite:.3f}; Belady at "
        f"{s.setup.device_blocks + s.setup.cpu_blocks + s.setup.lower_blocks} blocks "
        f"(device + CPU + lower tier) {s.belady:.3f}, at {s.setup.device_blocks + s.setup.cpu_blocks} "
        f"(device + CPU) {s.belady_cpu:.3f} (LRU there, the cpu row: {s.baseline['cpu'].hit_rate:.3f}); "
        f"break-even {s.setup.break_even_gbps:.1f} GB/s"
    )
    return "\n\n".join(lines)


def summary(sweeps: list[Sweep]) -> str:
    """One row per workload and lower tier: TTFT saving against no-offload per bandwidth,
    always loading / cost-aware, beside the CPU tier alone's."""
    gbps = list(next(iter(sweeps[0].lower.values())))
    rows = []
    for s in sweeps:
        no = s.baseline["no-offload"].mean_ttft
        for tier, by_gbps in s.lower.items():
            cells = [
                f"{1 - r['always'].mean_ttft / no:+.0%} / {1 - r['cost-aware'].mean_ttft / no:+.0%}"
                for r in by_gbps.values()
            ]
            rows.append([s.name, tier, f"{1 - s.baseline['cpu'].mean_ttft / no:+.0%}", *cells])
    return "TTFT saving against no-offload (estimated), always loading / cost-aware:\n\n" + md_table(
        ["workload", "lower tier", "cpu", *(f"{g:g} GB/s" for g in gbps)], rows
    )


def plot(sweeps: list[Sweep], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = list(sweeps[0].lower)
    fig, axes = plt.subplots(len(tiers), len(sweeps), figsize=(3.4 * len(sweeps), 3.0 * len(tiers)), squeeze=False)
    for col, s in enumerate(sweeps):
        no = s.baseline["no-offload"].mean_ttft * 1e3
        cpu = s.baseline["cpu"].mean_ttft * 1e3
        for row, tier in enumerate(tiers):
            ax = axes[row][col]
            g = list(s.lower[tier])
            ax.plot(g, [s.lower[tier][x]["always"].mean_ttft * 1e3 for x in g], "o--", label=f"cpu+{tier}, always load")
            ax.plot(
                g, [s.lower[tier][x]["cost-aware"].mean_ttft * 1e3 for x in g], "s-", label=f"cpu+{tier}, cost-aware"
            )
            ax.axhline(no, color="gray", ls=":", label="no-offload")
            ax.axhline(cpu, color="black", ls="-.", lw=0.8, label="cpu")
            ax.axvline(s.setup.break_even_gbps, color="red", lw=0.6, label="break-even")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{s.name}: {tier}", fontsize=9)
            ax.set_xlabel(f"{tier} GB/s", fontsize=8)
            if col == 0:
                ax.set_ylabel("mean TTFT ms (est.)", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: Mooncake traces: a device cache of 512k tokens (about what one H100 keeps for
#: Llama-3.1-8B beside its weights) and the paper's 3M-token local cache as the CPU tier.
MOONCAKE_DEVICE_TOKENS = 512 * 1024
MOONCAKE_CPU_TOKENS = 3_000_000


def add_args(p) -> None:
    """This sweep's options of ``tools/replay.py``."""
    p.add_argument("--disk-gbps", help="sweep a lower tier's bandwidth instead (block level, replay_sweep.py)")
    p.add_argument("--workloads", default="", help="for --disk-gbps: generated workloads, e.g. chat,rag,mixed")
    p.add_argument("--traces", default="", help="for --disk-gbps: comma-separated Mooncake FAST'25 traces")
    p.add_argument(
        "--shared-latency-ms", type=float, default=5.0, help="for --disk-gbps: the shared tier's per-job latency"
    )
    p.add_argument(
        "--admission-disk",
        default="",
        help="for --disk-gbps: more disk sizes (x the working set, e.g. 0.5,0.1) for the write-admission table",
    )


def check_args(args, p) -> None:
    """Parse and check this sweep's options (``p.error`` on bad ones)."""
    from replay_workloads import WORKLOADS

    args.workloads = [w for w in args.workloads.split(",") if w]
    args.traces = [Path(t) for t in args.traces.split(",") if t]
    try:
        args.admission_disk = sorted({float(x) for x in args.admission_disk.split(",") if x})
    except ValueError:
        p.error(f"--admission-disk: expected comma-separated fractions such as 0.5,0.1, got {args.admission_disk!r}")
    if any(not f > 0 for f in args.admission_disk):
        p.error(f"--admission-disk: fractions must be > 0, got {args.admission_disk}")
    if args.disk_gbps is None:
        return
    try:
        args.disk_gbps = sorted({float(x) for x in args.disk_gbps.split(",")})
    except ValueError:
        p.error(f"--disk-gbps: expected comma-separated GB/s such as 0.5,1,2,4,8, got {args.disk_gbps!r}")
    if not args.workloads and not args.traces:
        args.workloads = [args.workload] if args.trace is None else []
        args.traces = [args.trace] if args.trace is not None else []
    if any(g <= 0 for g in args.disk_gbps) or any(w not in WORKLOADS for w in args.workloads):
        p.error(f"--disk-gbps needs positive GB/s and --workloads among {', '.join(WORKLOADS)}")
    missing = [str(t) for t in args.traces if not t.is_file()]
    if missing:
        p.error(f"--traces: no such file: {', '.join(missing)} (Mooncake traces live in ../shared/traces/)")
    if args.shared_latency_ms < 0:
        p.error(f"--shared-latency-ms must be >= 0, got {args.shared_latency_ms}")


def main_sweep(args, log) -> str:
    """The sweep for ``args.workloads`` and ``args.traces``; returns the markdown."""
    from replay_workloads import FULL, QUICK, generate, read_mooncake

    gbps = args.disk_gbps
    lowers = [
        LowerModel("disk", "DISK", gbps[0], 0.0),
        LowerModel("shared", "REMOTE", gbps[0], args.shared_latency_ms / 1e3),
    ]
    m = args.model
    items: list[tuple[str, list[Any], list[int], int, Any]] = []
    tpb = 16
    for kind in args.workloads:
        w = generate(kind, QUICK if args.quick else FULL, tpb, args.scale, args.seed)
        items.append((kind, list(w.requests), [0] * len(w.requests), tpb, None))
    for path in args.traces:
        t = read_mooncake(path)
        items.append((Path(path).stem.replace("mooncake_fast25_", "mooncake "), t.requests, t.tail_tokens, 512, t))
    sweeps = []
    for name, requests, tails, block_tokens, trace in items:
        ws = len({h for r in requests for h in r})
        if trace is None:
            device = max(2 * max(map(len, requests)), round(args.device_fraction * ws))
            cpu = max(1, round(args.cpu_fraction * ws))
        else:
            device, cpu = MOONCAKE_DEVICE_TOKENS // block_tokens, MOONCAKE_CPU_TOKENS // block_tokens
        setup = CostSetup(
            block_tokens,
            m.kv_bytes_per_token,
            m.prefill_tps,
            m.load_gbps["CPU"],
            device,
            cpu,
            max(1, round(args.disk_fraction * ws)),
        )
        log(f"{name}: {len(requests)} requests, working set {ws} blocks of {block_tokens} tokens")
        sizes = {f: max(1, round(f * ws)) for f in {args.disk_fraction, *args.admission_disk}}
        sweeps.append(sweep(name, requests, tails, setup, gbps, lowers, log, sizes))
    parts = []
    for s in sweeps:
        st = s.setup
        parts.append(
            f"#### {s.name}\n\n{len(s.baseline['cpu'].ttft)} requests, {st.tokens_per_block}-token blocks of "
            f"{st.bytes_per_block / 2**20:g} MiB; device cache {st.device_blocks}, CPU tier {st.cpu_blocks}, "
            f"lower tier {st.lower_blocks} blocks; {s.seconds:.0f} s\n\n" + tables(s)
        )
    parts.insert(0, summary(sweeps))
    ok = all(
        nw and fg is not False
        for s in sweeps
        for tier in s.lower
        for g in s.lower[tier]
        for nw, fg in [checks(s, tier, g)]
    )
    parts.append(f"all checks pass: {'yes' if ok else 'NO'}")
    if args.plots:
        title = (
            f"estimated TTFT against lower-tier bandwidth; {m.name}, prefill {m.prefill_tps:,.0f} tokens/s, "
            f"break-even {m.break_even_gbps:.1f} GB/s"
        )
        path = plot(sweeps, args.plots / "replay_ttft_vs_bandwidth.png", title)
        parts.append(f"plot: {path}")
    return "\n\n".join(parts)
