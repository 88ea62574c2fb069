"""``tiered-kv doctor``: check this host before a tiered-kv server starts on it.

Operator's process; the checks (and the I/O they do: one probe file in the disk tier's
directory) are ``tiered_kv.ops.doctor``. Prints one line per check, ok / warn / fail with
the fix, or the JSON envelope with ``--json``; exits with the worst line's code: 0 all
ok, 1 a warning, 2 a failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from tiered_kv.cli import app
from tiered_kv.cli.output import emit_json, errors

_STYLE = {"ok": "green", "warn": "yellow", "fail": "red"}


@app.command("doctor")
def doctor(
    config: Optional[Path] = typer.Option(
        None, "--config", help="The server's config: vLLM --kv-transfer-config JSON or its kv_connector_extra_config."
    ),
    tp: int = typer.Option(1, "--tp", min=1, help="The server's tensor-parallel size (tier sizes are per rank)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON on stdout instead of lines."),
) -> None:
    """Check this host for the tiered KV cache: memory locking, huge pages, the disk tier's directory, CUDA, GDS,
    vLLM and hash settings.

    Exit code: 0 when every check is ok, 1 when the worst is a warning, 2 when one fails
    (the server would refuse to start)."""
    with errors(json_out):
        from tiered_kv.ops.doctor import run_doctor

        report = run_doctor(config, tp=tp)
    if json_out:
        emit_json(report.to_dict())
    else:
        console = Console(highlight=False)
        for c in report.checks:
            console.print(f"[{_STYLE[c.status]}]{c.status:>4}[/]  {c.name:<10}  {escape(c.message)}", soft_wrap=True)
            if c.fix:
                console.print(f"{'':>4}  {'':<10}  fix: {escape(c.fix)}", soft_wrap=True)
        counts = {s: sum(c.status == s for c in report.checks) for s in _STYLE}
        console.print(f"{counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failure(s)")
    raise typer.Exit(report.exit_code)
