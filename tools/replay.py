#!/usr/bin/env python
"""Replay workload shapes through the whole hierarchy, beside the alternatives.

Generates (``--workload chat|rag|mixed``) or reads (``--trace FILE``) a request stream
and replays it with the engine driver, moving and verifying real bytes, through each
configuration in one run, with the same trace, device KV cache and CPU RAM:
``no-offload`` (device prefix cache only), ``cpu`` (our CPU tier), ``cpu+disk`` (CPU
tier over the disk tier) and ``vllm-cpu`` (vLLM 0.33's own CPU offloading manager,
where vLLM is installed). Tier sizes are fractions of the working set (the distinct
blocks of the trace), so the disk tier matters. It prints:

- token hit rate per tier (device prefix cache = GPU, CPU, DISK, computed; they add
  up to 100%), mismatched blocks (must be 0);
- an estimated TTFT and its saving against ``no-offload`` from a stated prefill-cost
  model (``replay_model.py``; every figure is an option);
- scheduler-side time per step (manager calls, timed by a proxy) beside worker time;
- bytes and GB/s per transfer type beside this machine's raw limits, measured in the
  same run (``replay_raw.py``).

With ``--plots DIR`` it also sweeps the disk size and the working-set size and writes
``replay_<workload>_hit_rate_vs_disk.png``, ``replay_<workload>_gbps_per_transfer.png`` and
``replay_<workload>_cost_vs_working_set.png``. ``--markdown FILE`` writes every table as
markdown, ``--json FILE`` the raw results (per request, per call).

    python tools/replay.py --workload chat --quick              # < 1 min on 2 cores
    python tools/replay.py --workload chat --plots docs/img --markdown out.md
    python tools/replay.py --gpu ...                             # needs CUDA

Runs scheduler and worker roles in this one process; the disk tier lives in a fresh
temporary directory under ``--disk-dir`` per run, removed afterwards.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import replay_policies  # noqa: E402
import replay_raw  # noqa: E402
import replay_sweep  # noqa: E402
from benchlib import machine as machine_basics  # noqa: E402
from benchlib import md_table  # noqa: E402
from replay_model import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_MODEL,
    DEFAULT_PREFILL_TPS,
    SOURCE,  # noqa: E402
    PrefillModel,
    parse_load_gbps,
)
from replay_stack import CONFIGS, Geometry, RunResult, Tiers, run_config  # noqa: E402
from replay_vllm import vllm_import_error  # noqa: E402
from replay_workloads import FULL, QUICK, WORKLOADS, Shape, generate, read_trace, write_trace  # noqa: E402

FULL_GEOMETRY: dict[str, Any] = dict(num_layers=8, num_kv_heads=8, head_dim=128, gpu_block_size=16, block_size_factor=1)
QUICK_GEOMETRY: dict[str, Any] = dict(num_layers=4, num_kv_heads=4, head_dim=64, gpu_block_size=16, block_size_factor=1)
TRANSFER_TYPES = ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu", "disk_to_gpu")
SOURCES = ("GPU", "CPU", "DISK", "computed")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=WORKLOADS, default="chat", help="generated workload preset")
    p.add_argument("--trace", type=Path, help="read requests from a JSON-lines trace instead (see replay_workloads.py)")
    p.add_argument("--save-trace", type=Path, help="write the replayed requests as a block-hash trace")
    p.add_argument("--quick", action="store_true", help="small blocks and a short trace (a smoke run)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the preset's request/document counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {','.join(CONFIGS)} (plus cpu+disk-direct: no promotion; "
        "cpu+disk-always: every hit loaded)",
    )
    p.add_argument("--cpu-fraction", type=float, default=0.25, help="CPU tier = this x the working set")
    p.add_argument("--disk-fraction", type=float, default=1.25, help="disk tier = this x the working set")
    p.add_argument(
        "--device-fraction",
        type=float,
        default=1 / 16,
        help="device prefix cache = this x the working set (at least 2 x the longest request)",
    )
    p.add_argument(
        "--disk-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the disk tier and the raw disk baseline put their (temporary) files",
    )
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--model-name", default=DEFAULT_MODEL)
    p.add_argument("--prefill-tps", type=float, default=DEFAULT_PREFILL_TPS, help="prefill tokens/s of the model")
    p.add_argument("--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN)
    p.add_argument("--load-gbps", default="CPU=50,DISK=6", help="assumed load GB/s per tier into the GPU")
    p.add_argument("--plots", type=Path, help="sweep disk and working-set sizes and write PNGs here")
    p.add_argument(
        "--disk-sweep",
        default="0.125,0.25,0.5,0.75,1.25",
        help="disk sizes for --plots, as fractions of the working set",
    )
    p.add_argument("--ws-sweep", default="0.5,1,2", help="workload scales for --plots (fixed tier sizes)")
    p.add_argument("--markdown", type=Path, help="also write the tables as markdown to this file")
    p.add_argument("--json", type=Path, help="write the raw results as JSON")
    p.add_argument("--gpu", action="store_true", help="the device KV cache on CUDA, raw limits of the GPU host")
    replay_sweep.add_args(p)
    replay_policies.add_args(p)
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    known = CONFIGS + ("cpu+disk-direct", "cpu+disk-always")
    for c in args.configs:
        if c not in known:
            p.error(f"--configs: unknown configuration {c!r}; expected some of {', '.join(known)}")
    for name in ("cpu_fraction", "disk_fraction", "device_fraction", "scale"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    replay_sweep.check_args(args, p)
    try:
        args.model = PrefillModel(
            args.model_name, args.prefill_tps, args.kv_bytes_per_token, parse_load_gbps(args.load_gbps)
        )
        args.disk_sweep = [float(x) for x in args.disk_sweep.split(",")]
        args.ws_sweep = [float(x) for x in args.ws_sweep.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    return args


# ---------------------------------------------------------------- tables


def quantile(samples, q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


class Summary:
    """The numbers of one ``RunResult`` under the prefill model."""

    def __init__(self, r: RunResult, model: PrefillModel, tokens_per_block: int):
        self.r = r
        blocks = r.report.blocks_requested
        self.share = {s: r.blocks_from(s) / blocks for s in SOURCES}
        t = tokens_per_block
        self.ttft = [model.ttft(s.computed * t, {"CPU": s.cpu * t, "DISK": s.disk * t}) for s in r.steps]
        self.mean_ttft = statistics.fmean(self.ttft)
        sched = [s.manager_seconds for s in r.steps]
        self.sched_p50, self.sched_p99 = quantile(sched, 0.5), quantile(sched, 0.99)
        self.sched_per_block = sum(sched) / blocks
        self.worker_mean = statistics.fmean(s.worker_seconds for s in r.steps)
        self.step_mean = statistics.fmean(s.seconds for s in r.steps)
        self.bytes_moved = sum(t["bytes"] for t in r.transfers.values())

    @property
    def hit_rate(self) -> float:
        return 1 - self.share["computed"]


def comparison_table(sums: dict[str, Summary]) -> str:
    base = sums.get("no-offload")
    rows = []
    for name, s in sums.items():
        saving = "-" if base is None or name == "no-offload" else pct(1 - s.mean_ttft / base.mean_ttft)
        rows.append(
            [
                name,
                *(pct(s.share[k]) for k in SOURCES),
                pct(s.hit_rate),
                s.r.report.mismatches,
                f"{s.mean_ttft * 1e3:.2f}",
                saving,
                f"{s.sched_p50 * 1e6:.0f}",
                f"{s.sched_p99 * 1e6:.0f}",
                f"{s.sched_per_block * 1e6:.2f}",
                f"{s.worker_mean * 1e3:.2f}",
                f"{s.step_mean * 1e3:.2f}",
                f"{s.bytes_moved / 2**20:.0f}",
                f"{s.r.report.wall_seconds:.1f}",
            ]
        )
    return md_table(
        [
            "config",
            "GPU",
            "CPU",
            "DISK",
            "computed",
            "hit rate",
            "mismatches",
            "TTFT ms (est.)",
            "TTFT saving",
            "sched p50 us/step",
            "sched p99 us/step",
            "sched us/block",
            "worker ms/step",
            "step ms",
            "MiB moved",
            "wall s",
        ],
        rows,
    )


def raw_reference(raw: dict, transfer: str) -> tuple[str, float] | None:
    """The raw limit to set a transfer type beside: (label, GB/s)."""
    if "pinned" in raw:
        ref = {
            "gpu_to_cpu": ("pinned D2H", raw["pinned"]["D2H"]),
            "cpu_to_gpu": ("pinned H2D", raw["pinned"]["H2D"]),
            "disk_to_gpu": ("KvikIO read", raw["kvikio_read"]),
        }.get(transfer)
        if ref and isinstance(ref[1], float):
            return ref
    return {
        "gpu_to_cpu": ("host copy", raw["host_copy"]),
        "cpu_to_gpu": ("host copy", raw["host_copy"]),
        "cpu_to_disk": ("O_DIRECT write", raw["disk"]["write"]),
        "disk_to_cpu": ("O_DIRECT read", raw["disk"]["read"]),
        "disk_to_gpu": ("O_DIRECT read", raw["disk"]["read"]),
    }.get(transfer)


def transfer_table(results: dict[str, RunResult], raw: dict) -> str:
    rows = []
    for name, r in results.items():
        for t in TRANSFER_TYPES:
            c = r.transfers.get(t)
            if not c or not c["jobs"]:
                continue
            ref = raw_reference(raw, t)
            ratio = f"{c['gbps'] / ref[1]:.2f}" if ref and ref[1] > 0 else "-"
            rows.append(
                [
                    name,
                    t,
                    c["jobs"],
                    c["failed_jobs"],
                    f"{c['bytes'] / 2**20:.1f}",
                    f"{c['seconds']:.3f}",
                    f"{c['gbps']:.2f}",
                    f"{ref[0]} {ref[1]:.2f}" if ref else "-",
                    ratio,
                ]
            )
    return md_table(["config", "transfer", "jobs", "failed", "MiB", "handler s", "GB/s", "raw GB/s", "ratio"], rows)


def scheduler_table(results: dict[str, RunResult]) -> str:
    calls = sorted({c for r in results.values() for c in r.manager_calls})
    rows = []
    for name, r in results.items():
        cells = []
        for c in calls:
            v = r.manager_calls.get(c)
            cells.append(f"{quantile(v, 0.5) * 1e6:.1f} / {quantile(v, 0.99) * 1e6:.0f}" if v else "-")
        rows.append([name, *cells, f"{r.manager_seconds * 1e3:.1f}"])
    return md_table(["config (p50 / p99 us per call)", *calls, "total ms"], rows)


# ---------------------------------------------------------------- runs


def geometry_for(args, shape: Shape) -> Geometry:
    base = QUICK_GEOMETRY if args.quick else FULL_GEOMETRY
    groups = max(2 * shape.longest, round(args.device_fraction * shape.working_set))
    return Geometry(**base, device_groups=groups)


def tiers_for(args, working_set: int, disk_fraction: float | None = None) -> Tiers:
    f = args.disk_fraction if disk_fraction is None else disk_fraction
    return Tiers(
        cpu_slots=max(1, round(args.cpu_fraction * working_set)),
        disk_slots=max(1, round(f * working_set)),
        disk_dir=args.disk_dir,
        io_threads=args.io_threads,
        model=args.model,
    )


def measure_raw(args, geometry: Geometry) -> dict:
    size = (64 if args.quick else 256) << 20
    raw = {
        "host_copy": replay_raw.host_copy_gbps(size),
        "disk": replay_raw.disk_gbps(args.disk_dir, size, geometry.bytes_per_block, args.io_threads),
    }
    if args.gpu:
        raw["pinned"] = replay_raw.pinned_copy_gbps(size)
        raw["kvikio_read"] = replay_raw.kvikio_read_gbps(args.disk_dir, size)
    return raw


def run_all(configs, workload, geometry, tiers, device, log) -> dict[str, RunResult]:
    results = {}
    for name in configs:
        t0 = time.perf_counter()
        if name == "cpu+disk-direct":
            r = run_config("cpu+disk", workload, geometry, tiers, device, promote_on_hit=False)
            r.config = name
        else:
            r = run_config(name, workload, geometry, tiers, device)
        results[name] = r
        log(f"  {name}: {time.perf_counter() - t0:.1f} s")
    return results


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{machine_basics()}, {gpu}, torch {torch.__version__}"


def setup_lines(args, command, workload, shape, geometry, tiers) -> list[str]:
    bpb = geometry.bytes_per_block
    ws = shape.working_set
    return [
        f"command: `{command}`",
        f"date: {datetime.date.today().isoformat()}; machine: {machine()}",
        f"workload: {workload.name}: {shape.describe(bpb)}",
        f"KV layout: {geometry.describe()}",
        f"device prefix cache: {geometry.device_groups} blocks ({geometry.device_groups / ws:.3f} x working set)",
        f"CPU tier: {tiers.cpu_slots} blocks = {tiers.cpu_slots * bpb / 2**20:.0f} MiB "
        f"({tiers.cpu_slots / ws:.2f} x working set; the same RAM for every configuration with a CPU tier)",
        f"disk tier: {tiers.disk_slots} blocks = {tiers.disk_slots * bpb / 2**20:.0f} MiB "
        f"({tiers.disk_slots / ws:.2f} x working set), write-through, promote on hit, under {args.disk_dir}",
        f"prefill-cost model: {args.model.describe()}",
        f"model source: {SOURCE}",
    ]


def raw_line(raw: dict) -> str:
    line = (
        f"raw limits (same run): host copy {raw['host_copy']:.2f} GB/s, O_DIRECT write "
        f"{raw['disk']['write']:.2f} / read {raw['disk']['read']:.2f} GB/s"
    )
    if "pinned" in raw:
        line += f", pinned cudaMemcpyAsync H2D {raw['pinned']['H2D']:.2f} / D2H {raw['pinned']['D2H']:.2f} GB/s"
        kv = raw["kvikio_read"]
        line += f", KvikIO read {kv:.2f} GB/s" if isinstance(kv, float) else f", {kv}"
    return line


def main(argv=None) -> int:
    args = parse_args(argv)
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.policies:
        return replay_policies.main_policies(args, sys.argv[1:] if argv is None else argv)
    if args.disk_gbps is not None:
        command = "python tools/replay.py " + " ".join(sys.argv[1:] if argv is None else argv)
        body = replay_sweep.main_sweep(args, log)
        text = f"command: `{command}`; date: {datetime.date.today().isoformat()}; machine: {machine()}\n"
        text += f"prefill-cost model: {args.model.describe()}\n\n" + body
        print(text)
        if args.markdown:
            args.markdown.write_text(text + "\n")
        return 0 if "all checks pass: yes" in text else 1
    if args.gpu and not torch.cuda.is_available():
        print(
            "error: --gpu needs a CUDA device, and torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}). Run without --gpu for the CPU replay.",
            file=sys.stderr,
        )
        return 2
    device = "cuda" if args.gpu else "cpu"
    if device == "cpu":
        # Jobs here are small: OpenMP threads gain nothing, and on 2 cores their
        # barriers stall whole steps (as tiered-kv demo found).
        torch.set_num_threads(1)
    tpb = (QUICK_GEOMETRY if args.quick else FULL_GEOMETRY)["gpu_block_size"]
    workload = (
        read_trace(args.trace, tpb)
        if args.trace
        else generate(args.workload, QUICK if args.quick else FULL, tpb, args.scale, args.seed)
    )
    if args.save_trace:
        write_trace(workload, args.save_trace)
    shape = Shape.of(workload, tpb)
    geometry = geometry_for(args, shape)
    tiers = tiers_for(args, shape.working_set)
    configs = list(args.configs)
    if args.gpu and "cpu+disk-direct" not in configs:
        configs.append("cpu+disk-direct")  # disk hits straight to the GPU: the DISK->GPU number
    notes = []
    vllm_configs = [c for c in configs if c.startswith("vllm-")]
    if vllm_configs:
        t0 = time.perf_counter()
        if (why := vllm_import_error()) is not None:
            for c in vllm_configs:
                configs.remove(c)
            notes.append(f"{', '.join(vllm_configs)} skipped: vLLM's CPU offloading manager cannot be imported ({why})")
        else:
            notes.append(f"importing vLLM's CPU offloading manager took {time.perf_counter() - t0:.1f} s")

    command = "python tools/replay.py " + " ".join(sys.argv[1:] if argv is None else argv)
    setup = setup_lines(args, command, workload, shape, geometry, tiers)
    log("\n".join(setup))
    raw = measure_raw(args, geometry)
    log("replaying:")
    results = run_all(configs, workload, geometry, tiers, device, log)
    sums = {name: Summary(r, args.model, tpb) for name, r in results.items()}
    setup += [f"disk I/O: {next((r.io for r in results.values() if r.io), '-')}", raw_line(raw), *notes]
    sections = [
        (
            "Token hit rate per tier, estimated TTFT, time per step",
            comparison_table(sums) + "\n\nGPU/CPU/DISK/computed: share of requested tokens served by the device prefix "
            "cache, each tier, or computed (they add up to 100%). TTFT: mean over requests under the prefill-cost "
            "model; saving against no-offload. sched: manager calls per step (one request); worker: submitting, "
            "polling and waiting for transfers; step: the whole step, including the driver generating and "
            "verifying block bytes.",
        ),
        (
            "Transfers (handler wall time per job, summed; raw limits measured in the same run)",
            transfer_table(results, raw),
        ),
        ("Scheduler-side cost per manager call", scheduler_table(results)),
    ]
    sweeps = {}
    if args.plots:
        sweeps = run_sweeps(args, workload, geometry, tiers, device, results, log)
        sections += sweep_sections(sweeps, args.model, tpb)
        sections.append(
            (
                "Plots",
                "\n".join(f"- {p}" for p in write_plots(args, sweeps, results, raw, workload, shape, geometry, tiers)),
            )
        )
    setup.append(
        f"load average (1 min) at start / end: {load_at_start:.1f} / {os.getloadavg()[0]:.1f} "
        "(other work on this machine slows every configuration)"
    )
    sections.insert(0, ("Setup", "\n".join(f"- {line}" for line in setup)))
    text = "\n\n".join(f"### {title}\n\n{body}" for title, body in sections)
    print(text)
    every = [
        *results.values(),
        *(r for _, r in sweeps.get("disk", [])),
        *(r for _, p in sweeps.get("working_set", []) for r in p.values()),
    ]
    mismatches = sum(r.report.mismatches for r in every)
    failed = sum(r.report.failed_jobs for r in every)
    print(f"\nmismatches: {mismatches}  failed jobs: {failed}  total time: {time.perf_counter() - started:.1f} s")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(to_json(results, sweeps, raw, shape, geometry, tiers, args), indent=1))
    return 1 if mismatches else 0


def write_plots(args, sweeps, results, raw, workload, shape, geometry, tiers) -> list[Path]:
    import replay_plots  # matplotlib only when plotting

    args.plots.mkdir(parents=True, exist_ok=True)
    kind = args.trace.stem if args.trace else args.workload
    title = (
        f"{workload.name}, {geometry.bytes_per_block / 2**20:g} MiB blocks, "
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} CPUs, {'GPU' if args.gpu else 'no GPU'}"
    )
    return replay_plots.write_all(
        args.plots,
        sweeps,
        results,
        raw,
        raw_reference,
        args.model,
        geometry.tokens_per_block,
        shape,
        tiers,
        kind,
        title,
    )


# ---------------------------------------------------------------- sweeps


def run_sweeps(args, workload, geometry, tiers, device, results, log) -> dict:
    """Disk size (cpu+disk only) on this trace; working-set size (every config but
    cpu+disk-direct) with the tier sizes fixed at this trace's. Points equal to the main
    run reuse its results."""
    out: dict[str, list[Any]] = {"disk": [], "working_set": []}
    working_set = Shape.of(workload, geometry.tokens_per_block).working_set
    log("disk-size sweep (cpu+disk):")
    for f in sorted(set(args.disk_sweep)):
        if f == args.disk_fraction and "cpu+disk" in results:
            r = results["cpu+disk"]
        else:
            r = run_config("cpu+disk", workload, geometry, tiers_for(args, working_set, f), device)
            log(f"  disk {f:g} x working set: {r.report.wall_seconds:.1f} s")
        out["disk"].append((f, r))
    if args.trace:
        log("working-set sweep skipped: it needs a generated workload")
        return out
    log("working-set sweep (tier sizes fixed):")
    configs = [c for c in results if c != "cpu+disk-direct"]
    for scale in sorted(set(args.ws_sweep)):
        if scale == 1:
            out["working_set"].append((working_set, {c: results[c] for c in configs}))
            continue
        w = generate(
            args.workload, QUICK if args.quick else FULL, geometry.tokens_per_block, args.scale * scale, args.seed
        )
        shape = Shape.of(w, geometry.tokens_per_block)
        g = replace(geometry, device_groups=max(geometry.device_groups, 2 * shape.longest))
        out["working_set"].append((shape.working_set, run_all(configs, w, g, tiers, device, log)))
        log(f"  scale {scale:g}: working set {shape.working_set} blocks")
    return out


def sweep_sections(sweeps, model, tpb) -> list[tuple[str, str]]:
    rows = []
    for f, r in sweeps["disk"]:
        s = Summary(r, model, tpb)
        rows.append(
            [
                f"{f:g}",
                r.disk_slots,
                *(pct(s.share[k]) for k in SOURCES),
                pct(s.hit_rate),
                f"{s.mean_ttft * 1e3:.2f}",
                r.report.mismatches,
            ]
        )
    disk = md_table(
        ["disk / working set", "disk blocks", "GPU", "CPU", "DISK", "computed", "hit rate", "TTFT ms", "mismatches"],
        rows,
    )
    rows = []
    for ws, point in sweeps["working_set"]:
        for name, r in point.items():
            s = Summary(r, model, tpb)
            rows.append(
                [
                    ws,
                    name,
                    pct(s.hit_rate),
                    f"{s.mean_ttft * 1e3:.2f}",
                    f"{s.sched_p50 * 1e6:.0f}",
                    f"{s.sched_per_block * 1e6:.2f}",
                    r.report.mismatches,
                ]
            )
    ws = md_table(
        ["working set (blocks)", "config", "hit rate", "TTFT ms", "sched p50 us/step", "sched us/block", "mismatches"],
        rows,
    )
    return [("Hit rate against disk size (cpu+disk)", disk), ("Cost against working-set size", ws)]


def to_json(results, sweeps, raw, shape, geometry, tiers, args) -> dict:
    def calls(c: dict[str, list[float]]) -> dict:
        return {
            k: {"calls": len(v), "seconds": sum(v), "p50_s": quantile(v, 0.5), "p99_s": quantile(v, 0.99)}
            for k, v in c.items()
        }

    def one(r: RunResult) -> dict:
        rep = asdict(r.report)
        return {
            "config": r.config,
            "report": rep,
            "manager_calls": calls(r.manager_calls),
            "worker_calls": calls(r.worker_calls),
            "transfers": r.transfers,
            "tiers": r.tiers,
            "cpu_slots": r.cpu_slots,
            "disk_slots": r.disk_slots,
            "steps": [asdict(s) for s in r.steps],
        }

    return {
        "shape": asdict(shape),
        "geometry": {**asdict(geometry), "dtype": str(geometry.dtype)},
        "tiers": {**asdict(tiers), "disk_dir": str(tiers.disk_dir)},
        "raw": raw,
        "model": asdict(args.model),
        "results": {k: one(r) for k, r in results.items()},
        "disk_sweep": [(f, one(r)) for f, r in sweeps.get("disk", [])],
        "working_set_sweep": [(ws, {k: one(r) for k, r in p.items()}) for ws, p in sweeps.get("working_set", [])],
    }


if __name__ == "__main__":
    sys.exit(main())
