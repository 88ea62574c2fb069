"""The replay's plots (matplotlib, PNG): hit rate against disk size, GB/s per transfer
type beside the raw limits, and cost against working-set size. Writes three files into
the given directory, named after the workload; no other I/O.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from replay_model import PrefillModel  # noqa: E402

COLOURS = {
    "no-offload": "#7f7f7f",
    "cpu": "#1f77b4",
    "cpu+disk": "#d62728",
    "vllm-cpu": "#2ca02c",
    "cpu+disk-direct": "#9467bd",
}
TIER_COLOURS = {"GPU": "#9ecae1", "CPU": "#1f77b4", "DISK": "#d62728"}
TRANSFERS = ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu", "disk_to_gpu")


def _share(r, source: str) -> float:
    return r.blocks_from(source) / r.report.blocks_requested


def _mean_ttft(r, model: PrefillModel, tpb: int) -> float:
    return statistics.fmean(model.ttft(s.computed * tpb, {"CPU": s.cpu * tpb, "DISK": s.disk * tpb}) for s in r.steps)


def hit_rate_vs_disk(path: Path, disk_points, results, shape, tiers, title: str) -> None:
    xs = [f for f, _ in disk_points]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    bottom = [0.0] * len(xs)
    for tier in ("GPU", "CPU", "DISK"):
        ys = [100 * _share(r, tier) for _, r in disk_points]
        top = [b + y for b, y in zip(bottom, ys)]
        label = "device prefix cache (GPU)" if tier == "GPU" else f"{tier} tier"
        ax.fill_between(xs, bottom, top, color=TIER_COLOURS[tier], alpha=0.85, label=f"cpu+disk: {label}")
        bottom = top
    ax.plot(xs, bottom, "k.-", lw=1)
    for name in ("cpu", "vllm-cpu", "no-offload"):
        if name in results:
            hit = 100 * (1 - _share(results[name], "computed"))
            ax.axhline(hit, color=COLOURS[name], ls="--", lw=1.5, label=f"{name} (no disk): {hit:.1f}%")
    ax.set_xlabel(
        f"disk tier size / working set ({shape.working_set} blocks); CPU tier fixed at "
        f"{tiers.cpu_slots / shape.working_set:.2f} x working set"
    )
    ax.set_ylabel("token hit rate (% of requested tokens)")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, max(xs) * 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"Hit rate against disk size: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def gbps_per_transfer(path: Path, results, raw: dict, raw_reference, title: str) -> None:
    configs = [n for n, r in results.items() if any(r.transfers[t]["jobs"] for t in TRANSFERS)]
    types = [t for t in TRANSFERS if any(results[n].transfers[t]["jobs"] for n in configs)]
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for i, name in enumerate(configs):
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(types))]
        ys = [results[name].transfers[t]["gbps"] for t in types]
        ax.bar(xs, ys, width, color=COLOURS.get(name, "#333333"), label=name)
    for j, t in enumerate(types):
        ref = raw_reference(raw, t)
        if ref:
            ax.hlines(ref[1], j - 0.45, j + 0.45, colors="k", linestyles="-", lw=2)
            ax.annotate(
                f"raw {ref[0]}\n{ref[1]:.2f}",
                (j, ref[1]),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=7,
            )
    ax.set_xticks(range(len(types)), [t.replace("_to_", " -> ").upper() for t in types])
    ax.set_ylabel("GB/s (bytes / summed handler job time)")
    top = max(
        [results[n].transfers[t]["gbps"] for n in configs for t in types]
        + [ref[1] for t in types if (ref := raw_reference(raw, t))]
    )
    ax.set_ylim(0, top * 1.3)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"GB/s per transfer type, black bars: raw limit measured in the same run\n{title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cost_vs_working_set(path: Path, ws_points, model: PrefillModel, tpb: int, tiers, title: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    configs = list(ws_points[0][1]) if ws_points else []
    for name in configs:
        xs = [ws / tiers.cpu_slots for ws, _ in ws_points]
        left.plot(
            xs, [_mean_ttft(p[name], model, tpb) * 1e3 for _, p in ws_points], "o-", color=COLOURS.get(name), label=name
        )
        per_block = [
            sum(s.manager_seconds for s in p[name].steps) / p[name].report.blocks_requested * 1e6 for _, p in ws_points
        ]
        right.plot(xs, per_block, "o-", color=COLOURS.get(name), label=name)
    left.set_xlabel("working set / CPU tier size")
    left.set_ylabel("estimated mean TTFT (ms)")
    left.set_title(f"Prefill cost: {model.name}", fontsize=9)
    right.set_xlabel("working set / CPU tier size")
    right.set_ylabel("scheduler-side time per requested block (us)")
    right.set_title("Manager calls, measured on this machine", fontsize=9)
    right.set_yscale("log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.axvline(1.0, color="k", lw=0.8, ls=":", label="working set = CPU tier")
        ax.axvline(tiers.disk_slots / tiers.cpu_slots, color="#d62728", lw=0.8, ls=":", label="working set = disk tier")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"Cost against working-set size: {title}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(
    directory: Path,
    sweeps: dict,
    results,
    raw: dict,
    raw_reference,
    model: PrefillModel,
    tpb: int,
    shape,
    tiers,
    kind: str,
    title: str,
) -> list[Path]:
    """Write the three PNGs; returns their paths."""
    paths = [
        directory / f"replay_{kind}_hit_rate_vs_disk.png",
        directory / f"replay_{kind}_gbps_per_transfer.png",
        directory / f"replay_{kind}_cost_vs_working_set.png",
    ]
    hit_rate_vs_disk(paths[0], sweeps["disk"], results, shape, tiers, title)
    gbps_per_transfer(paths[1], results, raw, raw_reference, title)
    written = paths[:2]
    if sweeps["working_set"]:
        cost_vs_working_set(paths[2], sweeps["working_set"], model, tpb, tiers, title)
        written.append(paths[2])
    return written
