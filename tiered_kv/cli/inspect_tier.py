"""``tiered-kv inspect VERB --tier NAME --config FILE``: any tier of a server's config.

Operator's process. The tier is found by its name in the config (any shape
``tiered_kv.config_file`` reads); a disk tier is inspected at its directory as a cache
PATH is, a shared tier as with ``--remote FILE`` (its alias), and any other tier by its
own ``TierInspector`` (``TierSpec.inspector``, ``tiered_kv.tier_ops``), which reads the
tier's own storage. A tier that offers no inspector is refused, named.
"""

from __future__ import annotations

from typing import Any, Callable

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tiered_kv.cli.output import emit_json, errors, fail

_TIER = typer.Option(
    None,
    "--tier",
    metavar="NAME",
    help="A tier of the server's config (--config FILE) by its name: a disk tier, the shared tier "
    "(as --remote FILE), or any tier type that offers an inspector.",
)
_TIER_CONFIG = typer.Option(
    None, "--config", metavar="PATH", help="With --tier: the server's config that names the tier."
)


def on_tier(command: str, options: dict[str, Any], disk: Callable[..., None], remote: Callable[..., None]) -> None:
    """Run ``command`` on the tier named ``options["tier"]`` of the one ``--config``:
    ``disk`` (the command on a cache PATH) for a disk tier, ``remote`` (the command with
    ``--remote``) for a shared tier, else the tier's own inspector (summary, ls, verify,
    clear)."""
    from tiered_kv.config_values import ConfigError
    from tiered_kv.ops.doctor import read_config
    from tiered_kv.tier_ops import InspectRefused, ToolContext

    json_out, name = options["json_out"], options.pop("tier")
    given = options.get("config")
    configs = [given] if isinstance(given, str) else list(given or [])
    if len(configs) != 1 or options.get("path") is not None or options.get("remote") is not None:
        fail(f"--tier {name}: give the server's config (--config FILE, once) and no PATH or --remote", json_out)
    with errors(json_out, (ConfigError, InspectRefused)):
        cfg = read_config(configs[0])
        entry = next((e for e in cfg.tier_entries() if e.name == name), None)
        if entry is None:
            names = ", ".join(e.name for e in cfg.tier_entries()) or "none"
            raise ConfigError(f"--tier {name}: the config {configs[0]} has no tier of that name (its tiers: {names})")
        # summary's --config (which configs read each namespace) keeps the config; the
        # other verbs take none.
        keep = configs if command == "summary" else None
        if entry.module_path is None and entry.type_name == "disk":
            return disk(**{**options, "path": entry.settings.path, "config": keep, "tier": None})
        if entry.module_path is None and entry.type_name == "remote":
            return remote(**{**options, "remote": configs[0], "config": None, "tier": None})
        inspector = entry.cls.inspector(entry, ToolContext(cfg))
        if inspector is None:
            raise InspectRefused(f"--tier {name}: a tier of type {entry.type_name} offers no inspector")
        data: dict[str, Any] = {"tier": name, "type": entry.type_name}
        if command == "ls":
            data["entries"] = inspector.ls(options["limit"])
        elif command == "clear":
            if not options.get("dry_run") and not options.get("yes"):
                raise InspectRefused(
                    f"inspect clear --tier {name}: deletes every block of the tier; pass --yes, or --dry-run to "
                    "see what it would delete"
                )
            data.update(inspector.clear(bool(options.get("dry_run"))))
        elif command in ("summary", "verify"):
            data.update(getattr(inspector, command)())
        else:  # evict's size and age limits are a disk tier's and a bucket's
            raise inspector.refuse(command)
    if json_out:
        emit_json(data)
        return
    table = Table(title=f"tier {escape(name)} ({escape(entry.type_name)})", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in data.items():
        shown = "\n".join(str(v) for v in value) if isinstance(value, list) else str(value)
        table.add_row(escape(str(key)), escape(shown))
    Console().print(table)
