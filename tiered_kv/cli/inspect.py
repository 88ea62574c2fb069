"""``tiered-kv inspect``: look inside a disk cache, check it, trim it, measure its device.

Operator's process; the library is ``tiered_kv.ops.inspect``. ``summary``, ``ls`` and ``verify`` are read-only and
work while an engine has the cache open; ``verify --repair``, ``evict`` and ``clear`` take the writer lock and are
refused while an engine holds it (with ``--dry-run``, ``evict`` and ``clear`` only read and report); ``bench`` works
in a scratch directory it removes. Every command prints Rich tables, or JSON on stdout with ``--json`` (the envelope
of ``tiered_kv.cli.output``); progress bars go to stderr (terminals only). Failures print one ``error: ...`` line on
stderr and exit 2 (in JSON mode stdout also gets the envelope with ``error``); ``verify`` exits 1 when it finds
corruption, and ``verify --repair`` exits 0 once the repaired cache verifies clean. With ``--remote CONFIG`` every
command but ``bench`` looks at that config's shared tier: ``cli.inspect_remote``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Literal, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from tiered_kv.cli import app
from tiered_kv.cli.inspect_options import _CACHE_PATH, _DRY_RUN, _JSON, _NAMESPACE, _READ_BY_CONFIG, _REMOTE
from tiered_kv.cli.inspect_options import _SERVER_MODEL, _VERIFY_DRY_RUN, SORT_HELP, STATE_HELP
from tiered_kv.cli.inspect_remote import need_path, on_remote, on_remote_option
from tiered_kv.cli.inspect_tier import _TIER, _TIER_CONFIG, on_tier
from tiered_kv.cli.inspect_verify import _clean_after_repair, _print_verify
from tiered_kv.cli.output import emit_json, errors, fail, progress_bar, short_hash, timestamp, with_iso_times
from tiered_kv.cli.output import table_console
from tiered_kv.config_values import format_size, parse_age, parse_size
from tiered_kv.ops.server_namespace import TIERED_MARK, TIERING_MARK

# The inspector's library (tiered_kv.ops.inspect) is imported inside each command: it pulls
# in torch, numpy and LMDB, which ``tiered-kv inspect --help`` should not wait for.

inspect_app = typer.Typer(
    name="inspect",
    help="Inspect a disk cache: summary, ls, verify, evict, clear, bench. Add --json for scripts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.add_typer(inspect_app, name="inspect")

EXIT_CORRUPT = 1

#: Timestamp fields of the JSON documents (seconds since the epoch in the library,
#: ISO 8601 on the way out).
_NS_TIMES = ("created", "oldest_stored", "newest_stored", "least_recent_access", "most_recent_access")
_ENTRY_TIMES = ("stored", "last_access")


# ---------------------------------------------------------------- helpers


def _errors(json_out: bool):
    from tiered_kv.ops.inspect import InspectError

    return errors(json_out, (InspectError,))


def _bytes_bar(json_out: bool, description: str, total: int | None = None):
    from rich.progress import DownloadColumn

    return progress_bar(json_out, description, total, DownloadColumn())


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    s = max(0.0, now - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit} ago"
    return f"{s:.0f}s ago"


def _compact_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n}B"


def _holder(h: dict[str, Any] | None) -> str:
    if h is None:
        return "none (closed)"
    if not h:
        return "an engine is starting"
    return (
        f"pid {h.get('pid', '?')} on {h.get('host', '?')} (engine {h.get('engine_id', '?')}, "
        f"since {timestamp(h.get('started'))})"
    )


def _ns_json(ns: dict[str, Any]) -> dict[str, Any]:
    out = with_iso_times(ns, _NS_TIMES)
    if out.get("engine"):
        out["engine"] = with_iso_times(out["engine"], ("started",))
    return out


# ---------------------------------------------------------------- summary


@inspect_app.command()
def summary(
    path: Optional[str] = _CACHE_PATH,
    namespace: Optional[str] = _NAMESPACE,
    config: Optional[list[str]] = _READ_BY_CONFIG,
    model: Optional[str] = _SERVER_MODEL,
    remote: Optional[str] = _REMOTE,
    tier: Optional[str] = _TIER,
    json_out: bool = _JSON,
) -> None:
    """Each namespace: fingerprint, blocks, bytes used and capacity, ages, hits, I/O, health;
    with --config, whether a server with that config would read it. With --remote: a shared
    tier's namespaces, objects and bytes, and whether that config reads each. With --tier
    NAME and --config: that tier of the config, whatever its type."""
    options = {k: v for k, v in locals().items() if k != "tier"}
    if tier is not None:
        return on_tier("summary", {**options, "tier": tier}, summary, summary)
    if remote is not None:
        return on_remote("summary", options)
    path = need_path(path, json_out)
    with _errors(json_out):
        from tiered_kv.ops.inspect import open_cache, summarize_cache
        from tiered_kv.ops.inspect.summary import ServerConfig, describe_io, mark_read_by

        data = summarize_cache(open_cache(path, namespace))
        if config:
            mark_read_by(data, [ServerConfig.load(c, model) for c in config])
    if json_out:
        out = {k: v for k, v in data.items() if k != "generated"}
        out["namespaces"] = [_ns_json(ns) for ns in data["namespaces"]]
        emit_json(out)
        return
    console = Console()
    now = data["generated"]
    console.print(f"disk cache {data['path']}: {len(data['namespaces'])} namespace(s)", soft_wrap=True)
    for ns in data["namespaces"]:
        fp = ns["fingerprint"]
        t = Table(title=f"namespace {ns['namespace']}", show_header=False, title_justify="left")
        t.add_column("field", style="bold")
        t.add_column("value")
        t.add_row("model", f"{fp['model_id']} @ {fp['model_revision']}")
        t.add_row("weights", fp.get("weights_digest") or "not recorded (the namespace does not cover the weights)")
        if fp.get("model_settings"):
            t.add_row("settings", ", ".join(fp["model_settings"]))
        for r in ns.get("read_by", ()):
            t.add_row(
                "read by",
                f"{r['config']}: "
                + (
                    (
                        "[green]yes[/]: a vLLM server with this config and the namespace's TP, GPU block "
                        "size and dtype reads it"
                        + (
                            f" ({r['unchecked']}; only the fields the config pins were compared)"
                            if "unchecked" in r
                            else ""
                        )
                    )
                    if r["reads"]
                    else "[yellow]no[/]: " + "; ".join(r["differences"])
                ),
            )
        geometry = fp["layer_geometry"]
        layers = "layers not recorded" if ns["layers"] is None else f"{ns['layers']} layers"
        if geometry and geometry[0] and geometry[0][0] in (TIERED_MARK, TIERING_MARK):
            shape = f"vLLM's pages ({geometry[0][0]})"  # bytes as vLLM lays them out: no per-layer shape
        else:
            shape = "block shape " + " / ".join(str(s) for s in sorted({tuple(s) for _, s in geometry}))
        t.add_row("KV", f"{fp['dtype']}, {layers}, {shape}, {', '.join(sorted(set(fp['kv_layout'])))}")
        t.add_row(
            "block",
            f"{fp['block_size']} tokens ({fp['block_size'] // fp['gpu_block_size']} GPU "
            f"block(s) of {fp['gpu_block_size']}), {format_size(ns['block_bytes'])} per rank",
        )
        # ``tp_size`` counts every rank's shard; under pipeline parallelism it is TP x PP.
        row = dict(str(x).split("=", 1) for x in fp["kv_layout"] if "=" in str(x))
        pp = row.get("pp", "1")
        t.add_row("TP", str(fp["tp_size"]) if pp == "1" else f"{row.get('tp', '?')} x PP {pp} ({fp['tp_size']} ranks)")
        t.add_row("prefix hash", f"{fp['hash_algorithm']}, seed {fp['hash_seed']!r}")
        t.add_row(
            "blocks",
            f"{ns['blocks']:,} of {ns['num_slots']:,} slots ({ns['fill']:.1%})"
            + (f", {ns['incomplete_entries']:,} incomplete" if ns["incomplete_entries"] else ""),
        )
        t.add_row(
            "used / capacity",
            f"{format_size(ns['used_bytes'])} / {format_size(ns['capacity_bytes'])} "
            f"(slabs on disk: {format_size(ns['slab_bytes_on_disk'])})",
        )
        t.add_row("stored", f"oldest {timestamp(ns['oldest_stored'])}, newest {timestamp(ns['newest_stored'])}")
        t.add_row("last access", f"{_ago(ns['least_recent_access'], now)} .. {_ago(ns['most_recent_access'], now)}")
        t.add_row("hits", f"{ns['hits_total']:,} total, {ns['blocks_with_hits']:,} blocks hit, max {ns['hits_max']:,}")
        t.add_row("checksum", ns["checksum"])
        t.add_row("I/O", describe_io(ns["io_backend"]))
        t.add_row("engine", _holder(ns["engine"]))
        health = ns["health"]
        colour = {"ok": "green", "warning": "yellow", "error": "red"}[health["status"]]
        t.add_row("health", f"[{colour}]{health['status']}[/]" + "".join(f"\n- {p}" for p in health["problems"]))
        console.print(t)
    for p in data["problems"]:
        console.print(f"[yellow]warning:[/] {p}", soft_wrap=True)
    if not data["namespaces"] and not data["problems"]:
        console.print("empty cache: no namespaces yet (an engine creates one on first start)")


# ---------------------------------------------------------------- ls


@inspect_app.command("ls")
def ls(
    path: Optional[str] = _CACHE_PATH,
    namespace: Optional[str] = _NAMESPACE,
    state: str = typer.Option(
        "all", "--state", metavar="<all|complete|incomplete>", help=f"{STATE_HELP}: complete = every TP rank committed."
    ),
    hash_prefix: Optional[str] = typer.Option(
        None, "--hash", metavar="HEX", help="Only hashes starting with this hex prefix."
    ),
    min_hits: int = typer.Option(0, "--min-hits", min=0, metavar="N", help="Only entries hit at least this often."),
    older_than: Optional[str] = typer.Option(
        None, "--older-than", metavar="AGE", help="Last access before this age, e.g. 7d."
    ),
    newer_than: Optional[str] = typer.Option(
        None, "--newer-than", metavar="AGE", help="Last access within this age, e.g. 1h."
    ),
    sort: str = typer.Option(
        "last-access",
        "--sort",
        metavar="<last-access|stored|hits|slot|hash|size>",
        help=f"{SORT_HELP}; with --remote: last-access, hash, size.",
    ),
    ascending: Optional[bool] = typer.Option(
        None, "--asc/--desc", help="Order (default: descending; ascending for hash)."
    ),
    limit: int = typer.Option(50, "--limit", min=0, metavar="N", help="Rows per namespace; 0 = all."),
    remote: Optional[str] = _REMOTE,
    tier: Optional[str] = _TIER,
    config: Optional[str] = _TIER_CONFIG,
    json_out: bool = _JSON,
) -> None:
    """Entries: hash prefix, slot, size, ranks present, stored and last-access times, hits.
    With --remote: a shared tier's objects (hash, rank, size, last modified). With --tier
    NAME --config FILE: that tier of the config, whatever its type."""
    options = {k: v for k, v in locals().items() if k not in ("tier", "config")}
    if tier is not None:
        return on_tier("ls", {**options, "tier": tier, "config": config}, ls, ls)
    if config is not None:
        fail("--config applies with --tier NAME (the server's config that names the tier)", json_out)
    if remote is not None:
        return on_remote("ls", options)
    path = need_path(path, json_out)
    with _errors(json_out):
        from tiered_kv.ops.inspect import ListFilter, list_entries, open_cache

        flt = ListFilter(
            state=state,
            hash_prefix=hash_prefix,
            min_hits=min_hits,
            older_than=None if older_than is None else parse_age(older_than, "--older-than"),
            newer_than=None if newer_than is None else parse_age(newer_than, "--newer-than"),
            sort=sort,
            ascending=ascending,
            limit=limit,
        )
        cache = open_cache(path, namespace)
        now = time.time()
        listings = [list_entries(ns, flt, now=now) for ns in cache.namespaces]
    if json_out:
        emit_json(
            {
                "path": str(cache.path),
                "namespaces": [
                    {**lst, "entries": [with_iso_times(e, _ENTRY_TIMES) for e in lst["entries"]]} for lst in listings
                ],
            }
        )
        return
    console = table_console()
    if not listings:
        console.print(f"{cache.path}: no namespaces, no entries")
    for lst in listings:
        t = Table(
            box=box.SIMPLE_HEAD,
            title=f"namespace {lst['namespace']}: {len(lst['entries']):,} shown, {lst['matching']:,} "
            f"matching, {lst['total']:,} entries",
            title_justify="left",
        )
        for col in ("hash", "slot", "size", "ranks", "stored", "last access", "hits"):
            t.add_column(col, justify="right" if col in ("slot", "size", "hits") else "left", no_wrap=True)
        for e in lst["entries"]:
            ranks = f"{len(e['ranks'])}/{lst['tp_size']}"
            t.add_row(
                short_hash(e["hash"]),
                str(e["slot"]),
                _compact_size(e["size"]),
                ranks if e["complete"] else f"[yellow]{ranks}[/]",
                time.strftime("%m-%d %H:%M:%S", time.localtime(e["stored"])),
                _ago(e["last_access"], now),
                str(e["hits"]),
            )
        console.print(t)


# ---------------------------------------------------------------- verify


@inspect_app.command()
def verify(
    path: Optional[str] = _CACHE_PATH,
    namespace: Optional[str] = _NAMESPACE,
    repair: bool = typer.Option(
        False,
        "--repair",
        help="Drop corrupt, invalid and incomplete entries (needs the cache closed); "
        "with --remote, delete the objects proven bad (never one this config cannot judge).",
    ),
    threads: int = typer.Option(4, "--threads", min=1, metavar="N", help="Parallel reads."),
    limit: int = typer.Option(
        0,
        "--limit",
        min=0,
        metavar="N",
        help="With --remote: check a random sample of this many objects per namespace; 0 = all.",
    ),
    remote: Optional[str] = _REMOTE,
    tier: Optional[str] = _TIER,
    config: Optional[str] = _TIER_CONFIG,
    json_out: bool = _JSON,
    dry_run: bool = _VERIFY_DRY_RUN,
) -> None:
    """Re-read every block and check its checksum; exit 1 if any block is corrupt (with
    --repair: unless the repair dropped them all and the cache now verifies clean). With
    --remote: download a shared tier's objects and check header and tag or checksum;
    exit 1 if any is bad, or kept as not this config's to judge (docs/cli.md). With --tier
    NAME --config FILE: that tier of the config, whatever its type."""
    options = {k: v for k, v in locals().items() if k not in ("tier", "config")}
    if tier is not None:
        return on_tier("verify", {**options, "tier": tier, "config": config}, verify, verify)
    if config is not None:
        fail("--config applies with --tier NAME (the server's config that names the tier)", json_out)
    if remote is not None:
        return on_remote("verify", options)
    if limit:
        fail("--limit applies to --remote only (a disk cache is verified whole)", json_out)
    if dry_run:
        fail("--dry-run applies to --remote only (verify without --repair changes no cache)", json_out)
    path = need_path(path, json_out)
    results, clean = [], []
    with _errors(json_out):
        from tiered_kv.ops.inspect import open_cache, verify_namespace
        from tiered_kv.ops.inspect.verify import bytes_to_verify

        cache = open_cache(path, namespace)
        for ns in cache.namespaces:
            with _bytes_bar(json_out, f"verifying {ns.path.name}") as bar:
                results.append(
                    verify_namespace(
                        ns,
                        repair=repair,
                        threads=threads,
                        progress=bar.advance,
                        on_table=lambda table: bar.set_total(bytes_to_verify(ns, table)),
                    )
                )
            if repair:
                clean.append(_clean_after_repair(ns, results[-1]))
    corrupt = sum(r.corrupt_blocks for r in results)
    failed = bool(corrupt) and not (repair and all(clean))
    if json_out:
        namespaces = [r.to_dict() for r in results]
        if repair:
            for d, ok in zip(namespaces, clean):
                d["clean_after_repair"] = ok
        emit_json(
            {
                "path": str(cache.path),
                "corrupt_blocks": corrupt,
                "repair": repair,
                "clean": not failed if repair else not corrupt,
                "namespaces": namespaces,
            }
        )
    else:
        _print_verify(results, repair, cache.path, clean)
    if failed:
        raise typer.Exit(EXIT_CORRUPT)


# ---------------------------------------------------------------- evict / clear


@inspect_app.command("evict")
@on_remote_option("evict")
def evict_cmd(
    path: Optional[str] = _CACHE_PATH,
    to_size: Optional[str] = typer.Option(
        None, "--to-size", metavar="SIZE", help="Evict LRU blocks until used bytes are at most this, e.g. 100GiB."
    ),
    older_than: Optional[str] = typer.Option(
        None,
        "--older-than",
        metavar="AGE",
        help="Evict blocks not accessed within this age, e.g. 7d (a unit is required: s, m, h, d, w).",
    ),
    namespace: Optional[str] = _NAMESPACE,
    dry_run: bool = _DRY_RUN,
    json_out: bool = _JSON,
) -> None:
    """Drop blocks by age and/or down to a size (LRU across namespaces); the cache must be closed."""
    with _errors(json_out):
        from tiered_kv.ops.inspect import InspectError, evict, open_cache

        if to_size is None and older_than is None:
            raise InspectError("evict needs --to-size SIZE or --older-than AGE")
        size = None if to_size is None else (0 if to_size.strip() == "0" else parse_size(to_size, "--to-size"))
        age = None if older_than is None else parse_age(older_than, "--older-than")
        cache = open_cache(need_path(path, json_out), namespace)
        with progress_bar(json_out or dry_run, "evicting") as bar:
            result = evict(cache, to_size=size, older_than=age, progress=bar.advance, dry_run=dry_run)
    if json_out:
        emit_json(
            {
                "path": str(cache.path),
                "dry_run": dry_run,
                "evicted": result.evicted,
                "freed_bytes": result.freed_bytes,
                "namespaces": [{"namespace": ns_id, **v} for ns_id, v in result.namespaces.items()],
            }
        )
        return
    verb = "would evict" if dry_run else "evicted"
    t = Table(
        title=f"{verb} {result.evicted:,} block(s), {'would free' if dry_run else 'freed'} "
        f"{format_size(result.freed_bytes)}" + (" (dry run: nothing changed)" if dry_run else ""),
        title_justify="left",
    )
    for col in ("namespace", verb, "freed", "used before", "used after"):
        t.add_column(col, justify="left" if col == "namespace" else "right")
    for ns_id, v in result.namespaces.items():
        t.add_row(
            ns_id,
            f"{v['evicted']:,}",
            format_size(v["freed_bytes"]),
            format_size(v["used_before"]),
            format_size(v["used_after"]),
        )
    Console().print(t)


@inspect_app.command("clear")
@on_remote_option("clear")
def clear_cmd(
    path: Optional[str] = _CACHE_PATH,
    namespace: Optional[str] = _NAMESPACE,
    unread_by: Optional[list[str]] = typer.Option(
        None,
        "--unread-by",
        metavar="PATH",
        help="Only namespaces that no server with any of these configs would read (repeatable; see summary --config).",
    ),
    model: Optional[str] = _SERVER_MODEL,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    dry_run: bool = _DRY_RUN,
    json_out: bool = _JSON,
) -> None:
    """Delete namespaces (blocks, index, slab files); the cache must be closed."""
    with _errors(json_out):
        from tiered_kv.ops.inspect import InspectError, clear, open_cache

        cache = open_cache(need_path(path, json_out), namespace)
        if unread_by:
            from tiered_kv.ops.inspect.summary import ServerConfig, unread_namespaces

            cache.namespaces = unread_namespaces(cache, [ServerConfig.load(c, model) for c in unread_by])
        if not cache.namespaces:
            result: dict[str, Any] = {"removed": [], "freed_bytes": 0}
        elif dry_run:
            result = clear(cache, dry_run=True)
        else:
            ids = ", ".join(ns.path.name for ns in cache.namespaces)
            if not yes:
                if not sys.stdin.isatty():
                    raise InspectError(f"clear would delete namespace(s) {ids}; pass --yes to confirm")
                if not typer.confirm(f"delete namespace(s) {ids} in {cache.path}?"):
                    raise InspectError("not confirmed; nothing deleted")
            result = clear(cache)
    if json_out:
        emit_json(
            {
                "path": str(cache.path),
                "dry_run": dry_run,
                **result,
                "namespaces": [{"namespace": ns_id} for ns_id in result["removed"]],
            }
        )
        return
    verb = "would remove" if dry_run else "removed"
    Console().print(
        f"{verb} {len(result['removed'])} namespace(s) "
        f"({', '.join(result['removed']) or 'none'}), {'would free' if dry_run else 'freed'} "
        f"{format_size(result['freed_bytes'])}" + (" (dry run: nothing deleted)" if dry_run else ""),
        soft_wrap=True,
    )


# ---------------------------------------------------------------- bench


@inspect_app.command()
def bench(
    path: str = typer.Argument(..., help="Cache directory (a scratch directory is made inside it)."),
    size: str = typer.Option("1GiB", "--size", metavar="SIZE", help="Bytes written and read per pass."),
    block_bytes: str = typer.Option(
        "2MiB", "--block-bytes", metavar="SIZE", help="Bytes per tier block (a 4 KiB multiple), e.g. 2MiB."
    ),
    block_size_old: Optional[str] = typer.Option(None, "--block-size", hidden=True),
    rounds: int = typer.Option(3, "--rounds", min=1, metavar="N", help="Interleaved rounds."),
    threads: int = typer.Option(4, "--threads", min=1, metavar="N", help="I/O threads (tier and raw)."),
    backend: Literal["auto", "kvikio", "posix"] = typer.Option("auto", "--backend", help="The tier's I/O path."),
    json_out: bool = _JSON,
) -> None:
    """Tier store/load GB/s on the cache's device beside a raw O_DIRECT baseline, interleaved."""
    with _errors(json_out):
        from tiered_kv.ops.inspect import run_bench

        total = parse_size(size, "--size")
        if block_size_old is not None:  # the old name of --block-bytes (sizes in tokens are --block-size elsewhere)
            block_bytes = block_size_old
        block = parse_size(block_bytes, "--block-bytes", example_unit="KiB")
        with _bytes_bar(json_out, "benchmarking", total=4 * rounds * (total // block) * block) as bar:
            result = run_bench(
                path,
                total_bytes=total,
                block_bytes=block,
                rounds=rounds,
                threads=threads,
                backend=backend,
                progress=bar.advance,
            )
    if json_out:
        emit_json(result.to_dict())
        return
    t = Table(title=f"disk tier vs raw device: {result.path}", title_justify="left")
    t.add_column("pass")
    for r in range(rounds):
        t.add_column(f"round {r + 1} GB/s", justify="right")
    t.add_column("median GB/s", justify="right")
    for kind in ("raw_write", "tier_write", "raw_read", "tier_read"):
        t.add_row(kind.replace("_", " "), *(f"{v:.2f}" for v in result.gbps[kind]), f"{result.median(kind):.2f}")
    console = Console()
    console.print(t)
    console.print(
        f"tier / raw: write {result.ratio('write'):.0%}, read {result.ratio('read'):.0%}  "
        f"({format_size(result.total_bytes)} per pass, {format_size(result.block_bytes)} blocks, "
        f"{result.threads} threads; tier I/O: {result.backend['description']}; raw: {result.raw_mode})",
        soft_wrap=True,
    )
