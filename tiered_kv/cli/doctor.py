"""``tiered-kv doctor``: check this host before a tiered-kv server starts on it.

Operator's process; the checks (and the I/O they do: probe files in the disk tier's
directory or its nearest existing parent, each removed) are ``tiered_kv.ops.doctor``;
``--e2e`` adds the lines of ``tiered_kv.ops.doctor.e2e`` (a small model through the
config's tiers). Prints one line per check, ok / skip (could not run, says why) / warn /
fail with the fix, or the JSON envelope with ``--json``; exits with the worst line's
code: 0 all ok or skipped, 1 a warning, 2 a failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from tiered_kv.cli import app
from tiered_kv.cli.output import emit_json, errors

_STYLE = {"ok": "green", "skip": "cyan", "warn": "yellow", "fail": "red"}


@app.command("doctor")
def doctor(
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        metavar="PATH",
        help="The server's config: vLLM --kv-transfer-config JSON (TieredOffloadingSpec, or TieringOffloadingSpec "
        "with TieredDiskTier), its kv_connector_extra_config, or a vllm serve --config file.",
    ),
    tp: Optional[int] = typer.Option(
        None,
        "--tp",
        min=1,
        metavar="N",
        help="The server's tensor-parallel size (tier sizes are per rank). Default: the config file's, else 1.",
    ),
    model: Optional[str] = typer.Option(
        None,
        "--model",
        metavar="PATH",
        help="The model (directory, config.json or a --preset name of tiered-kv config) for the disk's "
        "break-even. Default: the config's model_path or model_id.",
    ),
    prefill_tps: Optional[float] = typer.Option(
        None,
        "--prefill-tps",
        min=1,
        metavar="N",
        help="The server's prefill tokens/s, for the break-even. Default: the config's prefill_tokens_per_s, else "
        "estimated for the model on TP of --gpu (as tiered-kv config does), else 30,800 (Llama-3.1-8B, one H100).",
    ),
    gpu: Optional[str] = typer.Option(
        None,
        "--gpu",
        metavar="NAME",
        help="GPU model for the prefill estimate, e.g. 'H100 SXM'. Default: this machine's GPU.",
    ),
    read_probe: str = typer.Option(
        "64MiB", "--read-probe", metavar="SIZE", help="Bytes written then read with O_DIRECT to time the disk; 0: skip."
    ),
    e2e: bool = typer.Option(
        False,
        "--e2e",
        help="Also check that a small real model (random weights, no download) continues the same from prefix KV "
        "loaded from each tier of the config (CPU, disk, shared, warm-up blocks, a failed load recomputed) as when "
        "computed cold: one line per tier with the tokens equal, the largest logit difference and the time. "
        "Without --config: a CPU and a disk tier in a temporary directory.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print JSON on stdout instead of lines."),
) -> None:
    """Check this host for the tiered KV cache: memory locking, huge pages, the disk tier's directory, CUDA, GDS,
    vLLM and hash settings.

    The disk tier's directory must be on the disk meant for it (a path on the root file
    system or below a missing mount point is flagged) and read faster than the model's
    break-even (KV bytes per token x prefill tokens/s, per rank as tiered-kv config prints it; the disk
    serves TP ranks at once). Before the directory exists the disk is timed in its nearest existing parent.

    A check that could not run says "skipped" and why. Exit code: 0 when every check is ok or skipped, 1 when
    the worst is a warning (a TP size assumed is one), 2 when one fails (the server would refuse to start)."""
    with errors(json_out):
        from tiered_kv.config import parse_size
        from tiered_kv.ops.doctor import run_doctor

        probe = 0 if read_probe.strip() == "0" else parse_size(read_probe, "--read-probe")
        report = run_doctor(config, tp=tp, model=model, prefill_tps=prefill_tps, read_probe=probe, gpu=gpu)
        if e2e:
            from tiered_kv.ops.doctor.e2e import check_e2e

            report.checks += check_e2e(config, tp)
    if json_out:
        emit_json(report.to_dict())
    else:
        console = Console(highlight=False)
        for c in report.checks:
            console.print(f"[{_STYLE[c.status]}]{c.status:>4}[/]  {c.name:<10}  {escape(c.message)}", soft_wrap=True)
            if c.fix:
                console.print(f"{'':>4}  {'':<10}  fix: {escape(c.fix)}", soft_wrap=True)
        counts = {s: sum(c.status == s for c in report.checks) for s in _STYLE}
        console.print(
            f"{counts['ok']} ok, {counts['skip']} skipped, {counts['warn']} warning(s), {counts['fail']} failure(s)"
        )
    raise typer.Exit(report.exit_code)
