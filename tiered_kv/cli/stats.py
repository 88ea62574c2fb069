"""``tiered-kv stats``: the per-tier view of a running server's Prometheus endpoint.

Operator's process. I/O: one HTTP GET of ``--url`` per refresh, bounded by ``--timeout``
in all and by ``--max-bytes`` (``tiered_kv.ops.metrics_view``); prints tables, or the
JSON envelope with ``--json``. Whatever the endpoint names (tiers, transfer types, the
URL) is printed as text, never read as Rich markup.
With ``--watch SECONDS`` it reads and prints again every SECONDS until interrupted
(one JSON document per line with ``--json``), adding the tiers' counts between the last
two reads (``interval``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tiered_kv.cli import app
from tiered_kv.cli.output import envelope, errors, fail, iso_time, table_console
from tiered_kv.ops.endpoint_get import EndpointError, endpoint_url, printable

#: ``--max-bytes`` unless given: far above any endpoint's metrics, far below a memory problem.
DEFAULT_MAX_BYTES = "64MiB"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{100 * r:.1f}%"


def _latency(lat: dict[str, Any]) -> str:
    if not lat["count"]:
        return "-"
    return f"{_seconds(lat['p50_seconds'])} / {_seconds(lat['p99_seconds'])}"


def _held_back(t: dict[str, Any]) -> str:
    """A tier's slots held back without a block (counted in its used blocks), settling / releasing; "-" for a
    tier that holds none back (the CPU tier, a shared tier)."""
    held = t["held_back_blocks"]
    return f"{held.get('settling', 0)} / {held.get('releasing', 0)}" if held else "-"


def _index_errors(t: dict[str, Any]) -> str:
    """A tier's failed index reads / commits; "-" for a tier that keeps no index."""
    errors = t["index_errors"]
    return f"{errors.get('read', 0)} / {errors.get('flush', 0)}" if errors else "-"


def _text(s: str) -> Text:
    """What the endpoint named, as it is written: never Rich markup, never terminal
    control."""
    return Text(printable(s))


def render(view: dict[str, Any], url: str) -> Group:
    """The view as tables: tiers, transfers, shared tier, sessions and hints."""
    tiers = Table(title=_text(f"tiers at {url}"), title_justify="left")
    tiers.add_column("")
    for t in view["tiers"]:
        tiers.add_column(_text(t["tier"]), justify="right")
    rows = {
        "hit rate (tokens)": lambda t: _pct(t["hit_rate_tokens"]),
        "hits / lookups (tokens)": lambda t: f"{t['hits_tokens']} / {t['lookups_tokens']}",
        "hits / lookups (blocks)": lambda t: f"{t['hits_blocks']} / {t['lookups_blocks']}",
        "stores (blocks)": lambda t: str(t["stores_blocks"]),
        "evictions (blocks)": lambda t: str(t["evictions_blocks"]),
        "used (blocks)": lambda t: str(t["used_blocks"]),
        "held back (settling / releasing)": _held_back,
        "bytes loaded / stored": lambda t: f"{_bytes(t['bytes_loaded'])} / {_bytes(t['bytes_stored'])}",
        "load latency p50 / p99": lambda t: _latency(t["load_latency"]),
        "verify latency p50 / p99": lambda t: _latency(t["verification_latency"]),
        "load estimate (GB/s)": lambda t: "-" if t["load_gbps_estimate"] is None else f"{t['load_gbps_estimate']:.2f}",
        "passed over (blocks)": lambda t: str(t["skipped_slower_blocks"]),
        # CPU: stored but first to evict (cpu_admission); a lower tier: not written (write_admission).
        "not admitted (blocks)": lambda t: (
            str(t["not_admitted_blocks"])
            + (f" ({t['admission_switches']} rule switches)" if t["admission_switches"] else "")
        ),
        "drops (blocks)": lambda t: str(t["drops_blocks"]),
        "failures (blocks)": lambda t: str(t["failures_blocks"]),
        "index errors (read / flush)": _index_errors,
        "prefetched / used / wasted (blocks)": lambda t: "{prefetches} / {prefetch_used} / {prefetch_wasted}".format(
            **t["prefetch_blocks"]
        ),
    }
    interval = view.get("interval")
    if interval is not None:  # --watch: the same over the last refresh
        recent = {t["tier"]: t for t in interval["tiers"]}
        last = f"last {interval['seconds']:.0f}s" if interval["seconds"] >= 10 else f"last {interval['seconds']:.1f}s"
        first, second, *rest = rows.items()
        rows = {
            **dict([first]),
            f"  {last}": lambda t: _pct(recent.get(t["tier"], {}).get("hit_rate_tokens")),
            **dict([second]),
            f"  {last} ": lambda t: "{} / {}".format(
                recent.get(t["tier"], {}).get("hits_tokens", 0), recent.get(t["tier"], {}).get("lookups_tokens", 0)
            ),
            **dict(rest),
        }
    for what, cell in rows.items():
        tiers.add_row(what, *(cell(t) for t in view["tiers"]))
    parts: list[Any] = [tiers]
    prefill = view["prefill_tokens_per_s"]
    if prefill["used"] is not None:
        measured = "" if prefill["measured"] is None else f", measured {prefill['measured']:,.0f}"
        busy = view["gpu_busy_share"]
        busy_text = "" if busy is None else f"; GPU busy {busy:.0%} of the last 30 s (waiting requests weighed by it)"
        parts.append(f"prefill tokens/s used by the load decision: {prefill['used']:,.0f}{measured}{busy_text}")
    if view["transfers"]:
        moved = Table(title="transfers (per job: p50 / p99)", title_justify="left")
        for col in ("type", "bytes", "jobs ok", "jobs failed", "latency"):
            moved.add_column(col, justify="left" if col == "type" else "right")
        for t in view["transfers"]:
            moved.add_row(
                _text(t["transfer_type"]),
                _bytes(t["bytes"]),
                str(t["jobs_ok"]),
                str(t["jobs_failed"]),
                _latency(t["latency"]),
            )
        parts.append(moved)
    remote = view["remote"]
    if remote is not None:
        shared = Table(title="shared tier (this process's store)", title_justify="left", show_header=False)
        shared.add_column("what")
        shared.add_column("value")
        for what in ("uploads", "downloads", "probes", "rejected"):
            shared.add_row(what, _text(", ".join(f"{k} {v}" for k, v in sorted(remote[what].items())) or "-"))
        shared.add_row("bytes", _text(", ".join(f"{k} {_bytes(v)}" for k, v in sorted(remote["bytes"].items())) or "-"))
        shared.add_row("unavailable periods", str(remote["unavailable_periods"]))
        shared.add_row("bad objects deleted", str(remote["damaged_deleted"]))
        shared.add_row("objects kept, not ours to judge", str(remote["kept_unproven"]))
        for op, lat in remote["request_latency"].items():
            shared.add_row(_text(f"{op} latency p50 / p99"), f"{_latency(lat)} ({lat['count']} requests)")
        parts.append(shared)
    sessions = view["sessions"]
    if any(sessions[k] for k in ("retention", "leases", "prefetch_held_bytes", "hint_actions", "canary")):
        kept = Table(title="sessions, hints and the start-up canary", title_justify="left", show_header=False)
        kept.add_column("what")
        kept.add_column("value")
        for tier, r in sessions["retention"].items():
            hold = "-" if r["hold_seconds"] is None else _seconds(r["hold_seconds"])
            kept.add_row(
                _text(f"{tier}: retention"),
                f"{r['returns']} returns, {r['held_blocks']} blocks held for {hold}, "
                f"{r['dropped_for_budget']} let go for the budget"
                + ("" if r["honoured"] else ", not honoured now (they cost hits)")
                + (f" ({r['switches']} switches)" if r["switches"] else ""),
            )
        pinned = ", ".join(f"{k} {_bytes(v)}" for k, v in sorted(sessions["lease_pinned_bytes"].items()))
        kept.add_row(
            "leases (kv.retain)", _text(f"{sessions['leases']} held" + (f", pinning {pinned}" if pinned else ""))
        )
        kept.add_row("held for waiting requests (prefetch)", _bytes(sessions["prefetch_held_bytes"]))
        kept.add_row("hint actions", _text(", ".join(f"{k} {n}" for k, n in sessions["hint_actions"].items()) or "-"))
        kept.add_row(
            "start-up canary", _text(", ".join(f"{k} {n}" for k, n in sorted(sessions["canary"].items())) or "-")
        )
        parts.append(kept)
    return Group(*parts)


@app.command("stats")
def stats(
    url: str = typer.Option(
        ...,
        "--url",
        metavar="URL",
        help="The Prometheus endpoint: HOST:PORT/PATH (read as http://), http://... or https://..., "
        "e.g. localhost:8000/metrics.",
    ),
    watch: Optional[float] = typer.Option(
        None, "--watch", metavar="SECONDS", min=0.1, help="Read and print again every SECONDS until interrupted."
    ),
    timeout: float = typer.Option(
        10.0,
        "--timeout",
        metavar="SECONDS",
        min=0.1,
        help="Give up on a read after this long in all: connect, headers and body.",
    ),
    max_bytes: str = typer.Option(
        DEFAULT_MAX_BYTES, "--max-bytes", metavar="SIZE", help="Refuse a body larger than this, e.g. 64MiB."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print JSON on stdout instead of tables."),
) -> None:
    """Show a server's tiers live from its Prometheus endpoint: hit rate in tokens, blocks, bytes, latency, drops,
    failures.

    Counts are totals since the server started (with --watch, the hit rate over the last
    refresh too); latencies are p50 / p99 estimated from the histograms' buckets. Under vLLM
    the endpoint carries the scheduler's counts and, with TieredOffloadingConnector, each
    worker's transfer jobs and timings and its shared-tier uploads and downloads (vLLM sums
    them over ranks); with vLLM's OffloadingConnector those stay in the workers."""
    from tiered_kv.config_values import parse_size
    from tiered_kv.ops.metrics_view import scrape, since, summarize

    console = table_console()
    with errors(json_out, (EndpointError,)):
        url, limit = endpoint_url(url), parse_size(max_bytes, "--max-bytes", "MiB")
    previous = None
    while True:
        with errors(json_out, (EndpointError,)):
            samples, at = scrape(url, timeout, limit), time.monotonic()
            view = summarize(samples)
            if previous is not None:
                view["interval"] = {
                    "seconds": at - previous[1],
                    "tiers": summarize(since(samples, previous[0]))["tiers"],
                }
            previous = samples, at
        if not view["tiers"] and view["remote"] is None:
            fail(f"{url} exports no tiered-kv metrics (no tiered_kv_tier_blocks_total)", json_out)
        if json_out:
            doc = envelope({"url": url, **view}, path=None)
            typer.echo(json.dumps(doc, sort_keys=True) if watch else json.dumps(doc, indent=2, sort_keys=True))
        else:
            if watch:
                if console.is_terminal:
                    console.clear()
                console.print(f"{iso_time(time.time())}  every {watch:g}s, Ctrl-C to stop", highlight=False)
            console.print(render(view, url))
        if not watch:
            return
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            raise typer.Exit(0) from None
