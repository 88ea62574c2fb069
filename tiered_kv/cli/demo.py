"""``tiered-kv demo``: the engine driver on the embedded chat workload through the whole
hierarchy, GPU (or CPU standing in for it) -> pinned CPU tier -> disk tier and back,
with every loaded block verified.

Runs scheduler and worker roles in this one process; allocates the device KV cache
and the CPU tier in memory and, with ``--cache-dir``, opens (or creates) the disk
tier there, so a second run finds the first run's blocks on disk. Exits 1 if any
loaded block differed from what was stored. With ``--metrics-port`` it serves the
hierarchy's Prometheus metrics while it runs (``tiered_kv.cli.demo_metrics``), and
``--hold`` keeps serving after the replay. With ``--remote`` a shared tier sits below the
disk tier and the workload runs twice (``tiered_kv.cli.demo_remote``).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Literal, Optional

import torch
import typer
from rich.console import Console
from rich.table import Table

from tiered_kv.cli import app
from tiered_kv.cli.demo_metrics import DemoEndpoint
from tiered_kv.cli.demo_remote import (
    DemoCommand,
    ProbingDriver,
    DemoSharedTier,
    DemoSharedTierError,
    pass_dir,
    settle_uploads,
    shared_tier,
)
from tiered_kv.cli.output import emit_json, errors
from tiered_kv.config import format_size, parse_size
from tiered_kv.metrics import TRANSFER_TYPES
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.sim.driver import DeviceKVCache, DriverReport, EngineDriver, ServiceClock
from tiered_kv.sim.workloads import default_workload

GPU_BLOCK_SIZE = 16  # tokens per GPU block
DEVICE_GROUPS = 64  # offloaded-block-sized groups the device cache holds


def _check_port(value: Optional[str]) -> Optional[str]:
    """``--metrics-port`` as given, once it reads as a TCP port (taken as text so that
    the error names whatever was given)."""
    if value is not None and not (value.strip().isdigit() and 0 <= int(value) <= 65535):
        raise typer.BadParameter(f"{value!r} is not a TCP port: expected 0 (any free port) to 65535")
    return value


@app.command(cls=DemoCommand)
def demo(
    cache_dir: Optional[Path] = typer.Option(
        None,
        "--cache-dir",
        metavar="PATH",
        help="Disk-tier directory (its last component is created if absent); without it, GPU <-> CPU only.",
    ),
    requests: int = typer.Option(300, "--requests", min=1, metavar="N", help="Requests to replay."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Workload seed."),
    cpu_bytes: str = typer.Option("8MiB", "--cpu-bytes", metavar="SIZE", help="CPU tier size, e.g. 8MiB, 1GiB."),
    disk_bytes: str = typer.Option("256MiB", "--disk-bytes", metavar="SIZE", help="Disk tier size, e.g. 256MiB, 1TiB."),
    write_policy: Literal["write_through", "write_back"] = typer.Option(
        "write_through", "--write-policy", help="When blocks reach the disk."
    ),
    promote_on_hit: bool = typer.Option(True, "--promote/--no-promote", help="Bring disk hits back into the CPU tier."),
    device: Literal["auto", "cpu", "cuda"] = typer.Option("auto", "--device", help="Where the 'GPU' KV cache lives."),
    layout: Literal["kv-first", "kv-after"] = typer.Option(
        "kv-first",
        "--layout",
        help="kv-first: (2, num_blocks, ...); kv-after: (num_blocks, 2, ...).",
    ),
    block_size_factor: int = typer.Option(
        1, "--block-size-factor", min=1, metavar="N", help="GPU blocks per offloaded block."
    ),
    disk_io: Literal["thread", "process"] = typer.Option("thread", "--disk-io", help="Where the disk I/O runs."),
    metrics_port: Optional[str] = typer.Option(
        None,
        "--metrics-port",
        callback=_check_port,
        metavar="PORT",
        help="Serve the hierarchy's Prometheus metrics on PORT while the demo runs (0: any free port).",
    ),
    metrics_host: str = typer.Option(
        "127.0.0.1", "--metrics-host", metavar="HOST", help="Address the metrics endpoint listens on."
    ),
    hold: float = typer.Option(
        0.0,
        "--hold",
        min=0,
        metavar="SECONDS",
        help="With --metrics-port: keep serving for SECONDS after the replay (for `tiered-kv stats` or Grafana).",
    ),
    remote: Optional[str] = typer.Option(
        None,
        "--remote",
        metavar="[CONFIG_OR_URL]",
        help="Add a shared tier below the disk tier: a config file's 'remote' section, an S3 bucket "
        "http(s)://HOST[:PORT]/BUCKET, or, without a value, a throwaway server. The workload runs twice, "
        "the second time with empty CPU and disk tiers, so it is served from the shared tier.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout instead of tables."),
) -> None:
    """Replay a chat workload through GPU -> CPU -> disk and back; print hit rate per
    tier, bytes and GB/s per transfer type.

    Every block loaded back is checked byte for byte; any mismatch exits 1. Run it twice
    with the same --cache-dir: the second run is served from the first run's disk blocks.
    With --metrics-port the endpoint serves the same metrics as vLLM's (the dashboard's)."""
    console = Console()
    if hold and metrics_port is None:
        raise typer.BadParameter("needs --metrics-port (nothing is served to hold)", param_hint="'--hold'")
    if remote is not None and metrics_port is not None:
        raise typer.BadParameter(
            "cannot be combined with --remote (its two passes are two hierarchies)", param_hint="'--metrics-port'"
        )
    endpoint: DemoEndpoint | None = None
    shared: DemoSharedTier | None = None
    first: tuple[DriverReport, HierarchySpec] | None = None
    with ExitStack() as stack:
        with errors(json_out, (OSError, RuntimeError, DemoSharedTierError)):
            parse_size(cpu_bytes, "--cpu-bytes")
            if remote is not None:
                # First: a bad value or a server that cannot start ends the command at once.
                shared = stack.enter_context(shared_tier(remote))
                typer.echo(f"shared tier: {shared.where}", err=True)
            if metrics_port is not None:
                # First: a port that cannot be served ends the command before any tier is built.
                endpoint = DemoEndpoint(metrics_host, int(metrics_port), GPU_BLOCK_SIZE * block_size_factor)
                typer.echo(f"metrics: {endpoint.url}", err=True)
            config = {
                "cpu_bytes": cpu_bytes,
                "block_size": GPU_BLOCK_SIZE * block_size_factor,
                "write_policy": write_policy,
                "promote_on_hit": promote_on_hit,
                "disk_io": disk_io,
                "model_id": "tiered-kv-demo",
                "cover_weights": False,  # a toy model of random KV: no weights to cover
                # The demo's device is this machine's CPU and its model a toy: recomputing
                # has no true cost to weigh a load against, so every block found is loaded.
                "cost_aware": False,
            }
            if cache_dir is not None:
                config.update(disk_path=str(cache_dir), disk_bytes=disk_bytes)
            elif shared is not None:
                config.update(disk_path=pass_dir(shared, 1), disk_bytes=disk_bytes)
            if shared is not None:
                config["remote"] = shared.settings
            dev, spec, driver = _build(config, device, layout, block_size_factor, shared is not None)
            if endpoint is not None:
                endpoint.attach(spec, driver)
        if dev.device.type == "cpu":
            # Jobs here are a few hundred KB: OpenMP threads gain nothing, and on a busy
            # 2-core machine their barriers stall for whole scheduler ticks.
            torch.set_num_threads(1)
        workload = default_workload(requests, seed)
        if shared is not None:
            with errors(json_out, (OSError, RuntimeError)):
                # Pass 1 fills every tier; pass 2 starts with empty CPU and disk tiers (a
                # fresh hierarchy on a fresh directory), so what it finds comes from the
                # shared tier, and every such block is verified like any other.
                first = (driver.run(workload), spec)
                settle_uploads(spec, driver)
                _shutdown(spec, driver)
                config["disk_path"] = pass_dir(shared, 2)
                dev, spec, driver = _build(config, device, layout, block_size_factor, True)
                typer.echo("second pass: CPU and disk tiers empty", err=True)
        if endpoint is None:
            report = driver.run(workload)
        else:
            report = _run_served(driver, workload, endpoint, hold)
        _shutdown(spec, driver)
    shown_dir = (
        cache_dir if shared is None or spec.config.disk_tier is None else Path(spec.config.disk_tier.settings.path)
    )
    if json_out:
        data = _report_dict(report, workload, spec)
        if first is not None and shared is not None:
            data["shared_tier"] = shared.where
            data["first_pass"] = _report_dict(first[0], workload, first[1])
        emit_json(data, shown_dir)
    else:
        if first is not None:
            _print_first_pass(console, *first)
        _print(console, report, workload, dev, spec, shown_dir)
    mismatches = report.mismatches + (first[0].mismatches if first is not None else 0)
    if mismatches:
        typer.echo(f"error: {mismatches} loaded block(s) differ from what was stored", err=True)
        raise typer.Exit(1)


def _build(
    config: dict, device: str, layout: str, block_size_factor: int, probing: bool
) -> tuple[DeviceKVCache, HierarchySpec, EngineDriver]:
    """The device cache, the hierarchy of ``config`` and the driver over both (one that
    asks the shared tier ahead of each request where ``probing``)."""
    dev = DeviceKVCache(
        num_gpu_blocks=DEVICE_GROUPS * block_size_factor,
        gpu_block_size=GPU_BLOCK_SIZE,
        kv_before_num_blocks=layout == "kv-first",
        block_size_factor=block_size_factor,
        device=device,
    )
    clock = ServiceClock()  # session retention on the modelled engine's time: runs repeat
    spec = HierarchySpec(config, gpu_block_size=GPU_BLOCK_SIZE, clock=clock)
    return dev, spec, (ProbingDriver if probing else EngineDriver).from_spec(spec, dev, clock)


def _shutdown(spec: HierarchySpec, driver: EngineDriver) -> None:
    driver.worker.shutdown()
    driver.manager.shutdown()
    if spec.store is not None:
        spec.store.close()  # the store object stays: the report describes its I/O
    for tier in spec.lower_tiers[1:]:
        tier.close()


def _print_first_pass(console: Console, report: DriverReport, spec: HierarchySpec) -> None:
    uploaded = spec.stats.tiers.get("remote", {}).get("stores", 0)
    console.print(
        f"first pass (shared tier empty): {report.blocks_requested} blocks, {report.computed} computed, "
        f"{report.offload_hits} tier hits, {uploaded} stored in the shared tier, mismatches: {report.mismatches}",
        soft_wrap=True,
    )


def _run_served(driver: EngineDriver, workload, endpoint: DemoEndpoint, hold: float) -> DriverReport:
    """``driver.run(workload)``, exporting between requests; then serve for ``hold``
    seconds (the endpoint closes before the hierarchy shuts down)."""
    try:
        start = time.perf_counter()
        for block_hashes in workload.requests:
            driver.run_request(block_hashes)
            endpoint.maybe_export()
        driver.drain()
        driver.report.wall_seconds += time.perf_counter() - start
        endpoint.export()
        if hold:
            typer.echo(f"replay done; serving {endpoint.url} for {hold:g} s (Ctrl-C stops)", err=True)
            try:
                endpoint.hold(hold)
            except KeyboardInterrupt:
                pass  # the operator is done looking: report and exit as after a full hold
    finally:
        endpoint.close()
    return driver.report


def _media(spec: HierarchySpec) -> tuple[str, ...]:
    """The media whose hits the report counts (the shared tier's where there is one)."""
    return ("CPU", "DISK", "REMOTE") if spec.config.shared_tier is not None else ("CPU", "DISK")


def _report_dict(report: DriverReport, workload, spec: HierarchySpec) -> dict:
    """The run as ``--json`` prints it (in the envelope of ``tiered_kv.cli.output``)."""
    transfers = {
        name: {"jobs": t.jobs, "failed_jobs": t.failed_jobs, "bytes": t.bytes, "seconds": t.seconds, "gbps": t.gbps}
        for name in TRANSFER_TYPES
        if (t := spec.stats.transfers[name]).jobs
    }
    return {
        "workload": {
            "name": workload.name,
            "requests": len(workload.requests),
            "blocks": workload.num_blocks,
            "distinct_blocks": workload.num_unique_blocks,
        },
        "blocks_requested": report.blocks_requested,
        "device_hits": report.device_hits,
        "blocks_looked_up": report.blocks_looked_up,
        "tier_hits": report.offload_hits,
        "tier_hit_rate": report.offload_hit_rate,
        "total_hit_rate": report.total_hit_rate,
        "hits_by_tier": {m: report.hits_by_medium.get(m, 0) for m in _media(spec)},
        "computed": report.computed,
        "recomputed_after_failed_load": report.recomputed_after_failed_load,
        "mismatches": report.mismatches,
        "failed_jobs": report.failed_jobs,
        "stores_rejected": report.stores_rejected,
        "transfers": transfers,
        "tiers": spec.stats.tiers,
        "events": dict(sorted(report.events.items())),
        "wall_seconds": report.wall_seconds,
    }


def _print(
    console: Console,
    report: DriverReport,
    workload,
    dev: DeviceKVCache,
    spec: HierarchySpec,
    cache_dir: Optional[Path],
) -> None:
    bpb = dev.layout.bytes_per_block
    setup = Table(title="tiered-kv demo", show_header=False)
    setup.add_row(
        "workload",
        f"{workload.name}: {len(workload.requests)} requests, "
        f"{workload.num_blocks} blocks ({workload.num_unique_blocks} distinct)",
    )
    kind = "CUDA" if dev.device.type == "cuda" else "CPU tensors standing in for the GPU"
    setup.add_row(
        "device KV cache",
        f"{kind}; {len(dev.layout.layers)} layers, "
        f"{'kv-first' if dev.kv_before_num_blocks else 'kv-after'}, "
        f"{dev.num_groups} blocks of {format_size(bpb)}",
    )
    memory = "pinned" if spec.host is not None and spec.host.pinned else "pageable (no CUDA)"
    setup.add_row("CPU tier", f"{spec.num_cpu_slots} slots = {format_size(spec.num_cpu_slots * bpb)}, {memory}")
    if cache_dir and (disk := spec.config.disk_tier) is not None:
        setup.add_row(
            "disk tier",
            f"{cache_dir}: {format_size(disk.settings.bytes)}, "
            f"{spec.config.write_policy}, promote on hit: {spec.config.promote_on_hit}, "
            f"I/O: {spec.store.backend.describe() if spec.store else '-'}",
        )
    else:
        setup.add_row("disk tier", "off (pass --cache-dir DIR)")
    if (shared := spec.config.shared_tier) is not None:
        setup.add_row("shared tier", f"{shared.settings.where()}, {shared.settings.write_policy}")

    console.print(setup)
    hits = Table(title="hits (offloaded blocks)")
    for col in ("blocks", "device hits", "asked of tiers", "tier hits", "tier hit rate", "total hit rate", "computed"):
        hits.add_column(col, justify="right")
    hits.add_row(
        str(report.blocks_requested),
        str(report.device_hits),
        str(report.blocks_looked_up),
        str(report.offload_hits),
        f"{report.offload_hit_rate:.1%}",
        f"{report.total_hit_rate:.1%}",
        str(report.computed),
    )
    console.print(hits)
    console.print(
        f"hit rate: {report.offload_hit_rate:.1%} of the blocks asked of the tiers, "
        f"{report.total_hit_rate:.1%} of all blocks (device + tiers)",
        soft_wrap=True,
    )
    per_tier = Table(title="hit rate per tier (blocks asked of the tiers)")
    for col in ("tier", "hits", "hit rate"):
        per_tier.add_column(col, justify="right")
    for medium in _media(spec):
        n = report.hits_by_medium.get(medium, 0)
        rate = n / report.blocks_looked_up if report.blocks_looked_up else 0.0
        per_tier.add_row(medium, str(n), f"{rate:.1%}")
    console.print(per_tier)

    moved = Table(title="transfers by type (seconds summed over jobs; GB/s per job)")
    for col in ("transfer type", "jobs", "failed", "bytes", "seconds", "GB/s"):
        moved.add_column(col, justify="right")
    for name in TRANSFER_TYPES:
        t = spec.stats.transfers[name]
        if t.jobs:
            moved.add_row(
                name, str(t.jobs), str(t.failed_jobs), format_size(t.bytes), f"{t.seconds:.3f}", f"{t.gbps:.2f}"
            )
    console.print(moved)
    tiers = spec.stats.tiers
    console.print("CPU tier: " + ", ".join(f"{k} {v}" for k, v in tiers["cpu"].items() if v), soft_wrap=True)
    console.print("disk tier: " + ", ".join(f"{k} {v}" for k, v in tiers["disk"].items() if v), soft_wrap=True)
    if "remote" in tiers:
        console.print("shared tier: " + ", ".join(f"{k} {v}" for k, v in tiers["remote"].items() if v), soft_wrap=True)
    events = ", ".join(f"{k} {v}" for k, v in sorted(report.events.items())) or "none"
    console.print(f"events: {events}")
    colour = "green" if report.mismatches == 0 else "red"
    console.print(
        f"[{colour}]mismatches: {report.mismatches}[/]  failed jobs: {report.failed_jobs}  "
        f"recomputed after failed loads: {report.recomputed_after_failed_load}  "
        f"stores rejected: {report.stores_rejected}  wall: {report.wall_seconds:.2f} s",
        soft_wrap=True,
    )
