"""``tiered-kv inspect verify`` on a disk cache, after the checks: whether a namespace
just repaired now verifies clean (``_clean_after_repair``), and the report as Rich tables
(``_print_verify``). ``tiered_kv.cli.inspect`` runs the command; ``inspect_remote`` has
the shared tier's.

Operator's process. I/O: ``_clean_after_repair`` reads the namespace's entries and,
where the repair dropped corrupt blocks, looks them up in its LMDB index opened
read-only; ``_print_verify`` prints to stdout.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tiered_kv.cli.output import short_hash
from tiered_kv.config_values import format_size


def _clean_after_repair(ns, result) -> bool:
    """Whether ``ns``, just repaired, now verifies clean: every entry complete and in
    range, and none of the corrupt blocks left in the index. (Every other block was
    read and matched its checksum under the same writer lock, so that is all a second
    full pass could find.)"""
    from tiered_kv.disk.format.index import DiskIndex
    from tiered_kv.ops.inspect import read_entries

    table = read_entries(ns)
    m = ns.manifest
    in_range = (table.slot >= 0) & (table.slot < m.num_slots) & (table.size == m.block_bytes)
    if not bool(table.complete.all()) or not bool(in_range.all()):
        return False
    bad = sorted({bytes.fromhex(c["hash"]) for c in result.corrupt})
    if not bad:
        return True
    try:
        index = DiskIndex(ns.index_path, ns.tp_size, readonly=True)
    except FileNotFoundError:
        return True
    try:
        return all(entry is None for entry in index.get_many(bad))
    finally:
        index.close()


def _print_verify(results, repair: bool, path, clean: list[bool]) -> None:
    console = Console()
    if not results:
        console.print(f"{path}: no namespaces, nothing to verify")
    for k, r in enumerate(results):
        rate = r.bytes_read / r.seconds / 1e9 if r.seconds else 0.0
        verdict = "[red]CORRUPT[/]" if r.corrupt else "[green]OK[/]"
        console.print(
            f"namespace {r.namespace}: {r.blocks:,} blocks, {r.copies_checked:,} copies checked "
            f"({format_size(r.bytes_read)} in {r.seconds:.2f} s, {rate:.2f} GB/s): {verdict}",
            soft_wrap=True,
        )
        if r.corrupt:
            t = Table(title=f"{r.corrupt_blocks} corrupt block(s)", title_justify="left")
            for col in ("hash", "slot", "rank", "problem"):
                t.add_column(col)
            for c in r.corrupt[:50]:
                t.add_row(
                    short_hash(c["hash"]), str(c["slot"]), "-" if c["rank"] is None else str(c["rank"]), c["reason"]
                )
            console.print(t)
        if r.incomplete:
            console.print(
                f"[yellow]{len(r.incomplete):,} incomplete entries[/] (some TP rank never committed: "
                f"an interrupted store; never served)",
                soft_wrap=True,
            )
        if r.changed:
            console.print(
                f"{r.changed} suspect block(s) changed while reading (the engine evicted or rewrote them): not corrupt",
                soft_wrap=True,
            )
        if repair:
            verdict = "[green]now verifies clean[/]" if clean[k] else "[red]still not clean[/]"
            console.print(f"repaired: dropped {r.repaired:,} entries; {verdict}")
        elif r.corrupt or r.incomplete:
            console.print("run again with --repair (engine stopped) to drop them")
