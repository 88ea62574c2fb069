"""``tiered-kv inspect summary|ls|verify|evict|clear --remote CONFIG``: the shared tier of a config.

Operator's process; the library is ``tiered_kv.ops.inspect.remote`` (and ``remote_verify``
for ``verify``): S3 LIST and GETs of the config's bucket; ``verify --repair`` also deletes
the objects it proved bad, ``evict`` and ``clear`` the objects they select, nothing else,
and with ``--dry-run`` nothing. ``tiered_kv.cli.inspect`` hands a command here, with all
its options by name, when it is given ``--remote``; options that mean something only for a
disk cache are refused with a one-line reason. Output as the disk commands': Rich tables,
or the JSON envelope with ``--json``. A key under the prefix is printed only escaped
(``escaped_key``) and never as Rich markup. ``verify`` exits 1 (``EXIT_CORRUPT``) when
anything is left that a node would not serve (an object proven bad and not deleted, one
kept as not this config's to judge), a namespace has a problem, or a hostile key is there;
2 when ``--repair`` or ``--dry-run`` is refused for a namespace (sealed objects, a config
without a key), after the report.
"""

from __future__ import annotations

import functools
import inspect
import time
import typing
from collections.abc import Callable
from typing import Any, Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tiered_kv.cli.output import (
    EXIT_ERROR,
    emit_json,
    errors,
    fail,
    progress_bar,
    short_hash,
    table_console,
    timestamp,
    with_iso_times,
)
from tiered_kv.config import format_size

EXIT_CORRUPT = 1


def on_remote(command: str, options: dict[str, Any]) -> None:
    """Run ``command`` of this module with the options of ``tiered_kv.cli.inspect``'s
    command of that name (given ``--remote``), by name."""
    globals()[command](**options)


def on_remote_option(command: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator of a disk command whose PATH is optional: adds ``--remote CONFIG``, with
    which this module's ``command`` runs instead, and ``--tier NAME --config FILE``
    (``inspect_tier``: the config's tier of that name); without them, PATH is required."""
    from tiered_kv.cli.inspect_options import _REMOTE
    from tiered_kv.cli.inspect_tier import _TIER, _TIER_CONFIG, on_tier

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def run(**options: Any) -> None:
            tier, config = options.pop("tier", None), options.pop("config", None)
            if tier is not None:
                return on_tier(command, {**options, "tier": tier, "config": config}, run, run)
            if config is not None:
                fail("--config applies with --tier NAME (the server's config that names the tier)", options["json_out"])
            if options.get("remote") is not None:
                return on_remote(command, options)
            options.pop("remote", None)
            return fn(**{**options, "path": need_path(options["path"], options["json_out"])})

        signature = inspect.signature(fn)
        added = {"remote": _REMOTE, "tier": _TIER, "config": _TIER_CONFIG}
        params = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=Optional[str])
            for n, d in added.items()
        ]
        run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *params])  # type: ignore[attr-defined]  # read by typer
        run.__annotations__ = {**typing.get_type_hints(fn), **dict.fromkeys(added, Optional[str])}
        return run

    return wrap


def need_path(path: str | None, json_out: bool) -> str:
    """A disk command's PATH, which is optional only because ``--remote`` replaces it."""
    if path is None:
        fail("give a cache directory (PATH), or --remote CONFIG for a shared tier", json_out)
    return path


def _errors(json_out: bool):
    from tiered_kv.ops.inspect import InspectError

    return errors(json_out, (InspectError,))


def _refuse(what: str) -> None:
    from tiered_kv.ops.inspect import InspectError

    raise InspectError(f"{what} does not apply to a shared tier (--remote)")


def _open(remote: str, path: str | None, namespace: str | None, model: str | None = None):
    from tiered_kv.ops.inspect import InspectError
    from tiered_kv.ops.inspect.remote import open_shared_tier

    if path is not None:
        raise InspectError(f"give a cache directory or --remote CONFIG, not both (got {path!r} and {remote!r})")
    return open_shared_tier(remote, namespace, model)


def summary(
    remote: str,
    path: str | None,
    namespace: str | None,
    config: list[str] | None,
    model: str | None,
    json_out: bool,
) -> None:
    with _errors(json_out):
        from tiered_kv.ops.inspect.remote import summarize_shared_tier
        from tiered_kv.ops.inspect.summary import ServerConfig

        tier = _open(remote, path, namespace, model)
        data = summarize_shared_tier(tier, [ServerConfig.load(c, model) for c in config or ()])
    if json_out:
        data["namespaces"] = [with_iso_times(ns, ("oldest", "newest")) for ns in data["namespaces"]]
        data["hostile_keys"] = [with_iso_times(h, ("last_modified",)) for h in data["hostile_keys"]]
        emit_json(data)
        return
    console = Console()
    console.print(
        f"shared tier {tier.config.where()}: {len(data['namespaces'])} namespace(s), "
        f"{data['objects']:,} objects, {format_size(data['bytes'])}",
        soft_wrap=True,
    )
    _print_hostile(console, tier)
    if not data["namespaces"]:
        console.print("no namespaces yet (a node writes one when its shared tier starts)")
        return
    for ns in data["namespaces"]:
        fp = ns["fingerprint"]
        t = Table(title=f"namespace {ns['namespace']}", show_header=False, title_justify="left")
        t.add_column("field", style="bold")
        t.add_column("value")
        t.add_row("objects are", _TRUST_TEXT[ns["trust"]])
        if fp is not None:
            # fingerprint.json is anyone's bytes: its fields are shown, never read as markup.
            t.add_row("model", Text(f"{fp['model_id']} @ {fp['model_revision']}"))
            t.add_row("KV", Text(f"{fp['dtype']}, TP {fp['tp_size']}, {fp['block_size']} tokens per block"))
            t.add_row("prefix hash", Text(f"{fp['hash_algorithm']}, seed {fp['hash_seed']!r}"))
        complete = ns["complete_blocks"]
        t.add_row(
            "blocks",
            f"{ns['blocks']:,}" + ("" if complete in (None, ns["blocks"]) else f" ({complete:,} with every rank)"),
        )
        t.add_row("objects", f"{ns['objects']:,}, {format_size(ns['bytes'])}")
        t.add_row("stored", f"oldest {timestamp(ns['oldest'])}, newest {timestamp(ns['newest'])}")
        for r in ns["read_by"]:
            verdict = {True: "[green]yes[/]", False: "[yellow]no[/]: ", None: "[yellow]cannot tell[/]: "}[r["reads"]]
            verdict += escape("; ".join(r["differences"]))
            t.add_row("read by", f"{r['config']}: {verdict}")
        if ns["problems"]:
            t.add_row("problems", Text("\n".join(f"- {p}" for p in ns["problems"])))
        if ns["warnings"]:
            t.add_row("warnings", Text("\n".join(f"- {p}" for p in ns["warnings"])))
        console.print(t)
    if data["foreign_keys"]:
        console.print(
            f"{data['foreign_keys']:,} other key(s) under the prefix are not this format's (e.g. a prefix "
            "nested in this one): left alone by every command",
            soft_wrap=True,
        )
    if data["stray_objects"]:
        console.print(
            f"[yellow]warning:[/] {len(data['stray_objects'])} object(s) directly under the prefix, in no namespace",
            soft_wrap=True,
        )


#: How ``summary`` says what a namespace's objects are.
_TRUST_TEXT = {
    "sealed": "sealed: encrypted and authenticated under the fleet key",
    "plain": "plain: checksummed, not encrypted (remote.trusted_bucket)",
}


def _print_hostile(console: Console, tier: Any, limit: int = 20) -> None:
    """The hostile keys, escaped, as plain text (a key is never read as Rich markup)."""
    if not tier.hostile:
        return
    console.print(
        f"[yellow]warning:[/] {len(tier.hostile):,} hostile key(s) under the prefix: no node wrote them, and S3 "
        "clients that parse keys as paths fail on the whole prefix while they are there; never read "
        "(`clear --remote` deletes them)",
        soft_wrap=True,
    )
    for h in tier.hostile[:limit]:
        console.print(Text(f"  {h.shown}  ({h.why})"), soft_wrap=True)
    if len(tier.hostile) > limit:
        console.print(f"  ... and {len(tier.hostile) - limit:,} more (--json lists them all)")


def ls(
    remote: str,
    path: str | None,
    namespace: str | None,
    state: str,
    hash_prefix: str | None,
    min_hits: int,
    older_than: str | None,
    newer_than: str | None,
    sort: str,
    ascending: bool | None,
    limit: int,
    json_out: bool,
) -> None:
    with _errors(json_out):
        from tiered_kv.config_values import parse_age
        from tiered_kv.ops.inspect.remote import list_shared_tier

        if state != "all":
            _refuse("--state (each rank's object is listed on its own)")
        if min_hits:
            _refuse("--min-hits (no hits are recorded in a bucket)")
        now = time.time()
        tier = _open(remote, path, namespace)
        data = list_shared_tier(
            tier,
            hash_prefix=hash_prefix,
            older_than=None if older_than is None else parse_age(older_than, "--older-than"),
            newer_than=None if newer_than is None else parse_age(newer_than, "--newer-than"),
            sort=sort,
            ascending=ascending,
            limit=limit,
            now=now,
        )
    if json_out:
        for ns in data["namespaces"]:
            ns["objects"] = [with_iso_times(o, ("last_modified",)) for o in ns["objects"]]
        data["hostile_keys"] = [with_iso_times(h, ("last_modified",)) for h in data["hostile_keys"]]
        emit_json(data)
        return
    console = table_console()
    _print_hostile(console, tier)
    if not data["namespaces"]:
        console.print(f"{tier.config.where()}: no namespaces, no objects", soft_wrap=True)
    for ns in data["namespaces"]:
        console.print(
            f"namespace {ns['namespace']} ({ns['trust']}): {len(ns['objects']):,} shown, "
            f"{ns['matching']:,} matching, {ns['total']:,} objects",
            soft_wrap=True,
        )
        t = Table(box=box.SIMPLE_HEAD)
        for col in ("hash", "rank", "size", "last modified"):
            t.add_column(col, justify="right" if col in ("rank", "size") else "left", no_wrap=True)
        for o in ns["objects"]:
            t.add_row(short_hash(o["hash"]), str(o["rank"]), format_size(o["size"]), timestamp(o["last_modified"]))
        console.print(t)


def verify(
    remote: str,
    path: str | None,
    namespace: str | None,
    repair: bool,
    threads: int,
    limit: int,
    json_out: bool,
    dry_run: bool = False,
) -> None:
    with _errors(json_out):
        from rich.progress import DownloadColumn

        from tiered_kv.ops.inspect.remote_verify import repair_shared_tier, verify_shared_tier

        tier = _open(remote, path, namespace)
        total = sum(o.size for ns in tier.namespaces for o in ns.blocks) if not limit else None
        with progress_bar(json_out, "verifying", total, DownloadColumn()) as bar:
            results = verify_shared_tier(tier, limit=limit, threads=threads, progress=bar.advance)
        deleted = repair_shared_tier(tier, results, dry_run=dry_run) if repair or dry_run else 0
    asked = repair or dry_run
    refused = [r.unrepairable for r in results if r.unrepairable] if asked else []
    bad = sum(len(r.bad) for r in results)
    kept = sum(len(r.kept) for r in results)
    left = any(b["action"] != "deleted" for r in results for b in r.bad)
    failed = left or kept > 0 or any(r.problems for r in results) or bool(tier.hostile)
    if json_out:
        emit_json(
            {
                **tier.header(),
                "bad_objects": bad,
                "kept_objects": kept,
                "repair": repair,
                "dry_run": dry_run,
                "deleted": 0 if dry_run else deleted,
                "would_delete": deleted if dry_run else 0,
                "repair_refused": refused,
                "clean": not failed,
                "hostile_keys": [with_iso_times(h.to_dict(), ("last_modified",)) for h in tier.hostile],
                "namespaces": [r.to_dict() for r in results],
            }
        )
    else:
        _print_verify(tier, results, repair, dry_run, deleted, limit)
    if refused:
        for why in refused:
            typer.echo(f"error: --{'repair' if repair else 'dry-run'} refused: {why}", err=True)
        raise typer.Exit(EXIT_ERROR)
    if failed:
        raise typer.Exit(EXIT_CORRUPT)


def _print_verify(tier: Any, results: list, repair: bool, dry_run: bool, deleted: int, limit: int) -> None:
    console = Console()
    _print_hostile(console, tier)
    if not results:
        console.print(f"{tier.config.where()}: no namespaces, nothing to verify", soft_wrap=True)
    for r in results:
        rate = r.bytes_read / r.seconds / 1e9 if r.seconds else 0.0
        if r.bad or r.problems:
            verdict = "[red]BAD[/]"
        elif r.kept:
            verdict = "[yellow]NOT JUDGED[/]"
        else:
            verdict = "[green]OK[/]"
        sampled = f"a sample of {r.checked:,}" if limit and r.checked < r.objects else f"{r.checked:,}"
        console.print(
            f"namespace {r.namespace} ({'sealed' if r.sealed else 'plain'}): {sampled} of {r.objects:,} objects "
            f"checked ({format_size(r.bytes_read)} in {r.seconds:.2f} s, {rate:.2f} GB/s): {verdict}",
            soft_wrap=True,
        )
        if r.bad:
            t = Table(title=f"{len(r.bad)} object(s) proven bad", title_justify="left")
            for col in ("hash", "rank", "problem", "detail", "action"):
                t.add_column(col)
            for b in r.bad[:50]:
                t.add_row(short_hash(b["hash"]), str(b["rank"]), b["reason"], escape(b["detail"]), b["action"])
            console.print(t)
        for g in r.kept_why():
            console.print(
                f"[yellow]kept[/] {g['objects']:,} object(s) not ours to judge (never deleted): {escape(g['why'])}",
                soft_wrap=True,
            )
        if r.unrepairable and (r.bad or r.kept or repair or dry_run):
            console.print(
                f"[yellow]--repair does not touch this namespace:[/] {escape(r.unrepairable)}", soft_wrap=True
            )
        for p in r.problems:
            console.print(f"[red]problem:[/] {escape(p)}", soft_wrap=True)
        for w in r.warnings:
            console.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)
        if r.vanished:
            console.print(f"{r.vanished} object(s) deleted between the listing and the read: not a fault")
    kept = sum(len(r.kept) for r in results)
    if dry_run:
        console.print(
            f"dry run: --repair would delete {deleted:,} object(s) and keep {kept:,} not ours to judge; nothing deleted",
            soft_wrap=True,
        )
    elif repair:
        console.print(f"repaired: deleted {deleted:,} object(s); kept {kept:,} not ours to judge", soft_wrap=True)
    elif any(b["action"] == "would delete" for r in results for b in r.bad):
        console.print(
            "run again with --repair to delete the objects proven bad (a server stores the block again when it "
            "next computes it); --dry-run shows what it would delete and keep",
            soft_wrap=True,
        )


def evict(
    remote: str,
    path: str | None,
    to_size: str | None,
    older_than: str | None,
    namespace: str | None,
    dry_run: bool,
    json_out: bool,
) -> None:
    with _errors(json_out):
        from tiered_kv.config_values import parse_age, parse_size
        from tiered_kv.ops.inspect.remote import evict_shared_tier

        size = None if to_size is None else (0 if to_size.strip() == "0" else parse_size(to_size, "--to-size"))
        age = None if older_than is None else parse_age(older_than, "--older-than")
        tier = _open(remote, path, namespace)
        result = evict_shared_tier(tier, to_size=size, older_than=age, dry_run=dry_run)
    _report_deletion(tier, result, "evict", json_out)


def clear(
    remote: str,
    path: str | None,
    namespace: str | None,
    unread_by: list[str] | None,
    model: str | None,
    yes: bool,
    dry_run: bool,
    json_out: bool,
) -> None:
    with _errors(json_out):
        import sys

        from tiered_kv.ops.inspect import InspectError
        from tiered_kv.ops.inspect.remote import clear_shared_tier, read_differences
        from tiered_kv.ops.inspect.summary import ServerConfig

        tier = _open(remote, path, namespace, model)
        if unread_by:
            readers = [ServerConfig.load(c, model) for c in unread_by]
            # Every reader must be known not to read it: a namespace without its own
            # fingerprint.json may be the live fleet's (None), and stays.
            tier.namespaces = [ns for ns in tier.namespaces if all(read_differences(r, ns) for r in readers)]
        # Narrowed to some namespaces, clear deletes only the hostile keys inside them.
        whole_prefix = not namespace and not unread_by
        names = {ns.namespace for ns in tier.namespaces}
        hostile = [h for h in tier.hostile if whole_prefix or h.namespace in names]
        if (tier.namespaces or hostile) and not dry_run and not yes:
            what = ", ".join(
                [
                    *(f"namespace {ns.namespace}" for ns in tier.namespaces),
                    *([f"{len(hostile)} hostile key(s)"] if hostile else []),
                ]
            )
            if not sys.stdin.isatty():
                raise InspectError(f"clear would delete {what} of {tier.where}; pass --yes to confirm")
            if not typer.confirm(f"delete {what} of {tier.where}?"):
                raise InspectError("not confirmed; nothing deleted")
        result = clear_shared_tier(tier, dry_run=dry_run, whole_prefix=whole_prefix)
    _report_deletion(tier, result, "clear", json_out)


def _report_deletion(tier: Any, result: Any, command: str, json_out: bool) -> None:
    if json_out:
        emit_json(
            {
                **tier.header(),
                "dry_run": result.dry_run,
                "deleted_objects": result.objects,
                "freed_bytes": result.freed_bytes,
                "foreign_keys": tier.foreign_keys,
                "deleted_hostile_keys": len(result.hostile),
                "hostile_keys": [with_iso_times(h, ("last_modified",)) for h in result.hostile],
                "namespaces": [{"namespace": ns_id, **v} for ns_id, v in result.namespaces.items()],
            }
        )
        return
    verb = "would delete" if result.dry_run else "deleted"
    t = Table(
        title=f"{command} {tier.config.where()}: {verb} {result.objects:,} object(s), "
        f"{format_size(result.freed_bytes)}" + (" (dry run: nothing changed)" if result.dry_run else ""),
        title_justify="left",
    )
    for col in ("namespace", verb, "freed", "before", "after"):
        t.add_column(col, justify="left" if col == "namespace" else "right")
    for ns_id, v in result.namespaces.items():
        t.add_row(
            ns_id,
            f"{v['objects']:,}",
            format_size(v["freed_bytes"]),
            format_size(v["bytes_before"]),
            format_size(v["bytes_after"]),
        )
    console = Console()
    console.print(t)
    if result.hostile:
        console.print(f"{verb} {len(result.hostile):,} hostile key(s) under the prefix (by their exact bytes):")
        for h in result.hostile:
            console.print(Text(f"  {h['key']}  ({h['why']})"), soft_wrap=True)
