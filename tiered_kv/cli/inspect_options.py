"""The options ``tiered-kv inspect``'s commands share (cache path, namespace, ``--json``,
``--config``, ``--model``, ``--remote``, ``--dry-run``), each with its metavar and help, and
``ls``'s choices as its help shows them.

Operator's process; declarations only, no I/O.
"""

from __future__ import annotations

import typer

_JSON = typer.Option(False, "--json", help="Print JSON on stdout instead of tables.")
_NAMESPACE = typer.Option(None, "--namespace", "-n", metavar="ID", help="Only namespaces whose id starts with this.")
_READ_BY_CONFIG = typer.Option(
    None,
    "--config",
    metavar="PATH",
    help="A server's config (vLLM --kv-transfer-config JSON or its "
    "extra config; repeatable): say whether it reads each namespace.",
)
_SERVER_MODEL = typer.Option(
    None,
    "--model",
    metavar="PATH",
    help="The server's --model (directory or hub id in the local HF cache), "
    "for a config without model_id or model_path.",
)
_REMOTE = typer.Option(
    None,
    "--remote",
    metavar="PATH",
    help="A server's config with a 'remote' key: inspect that shared tier (S3 bucket) instead of a cache directory.",
)
_CACHE_PATH = typer.Argument(
    None, metavar="PATH", help="Cache directory (or one namespace directory); none with --remote."
)
_DRY_RUN = typer.Option(False, "--dry-run", help="Report what would go, change nothing (needs no lock).")
_VERIFY_DRY_RUN = typer.Option(
    False,
    "--dry-run",
    help="With --remote: show what --repair would delete and what it would keep, delete nothing.",
)
#: ``ls`` choices as its help shows them (the library's ``SORT_KEYS`` and ``STATES``
#: validate; a test keeps the two in step).
SORT_HELP = "last-access, stored, hits, slot, hash"
STATE_HELP = "all, complete, incomplete"

__all__ = [
    "SORT_HELP",
    "STATE_HELP",
    "_CACHE_PATH",
    "_DRY_RUN",
    "_JSON",
    "_NAMESPACE",
    "_READ_BY_CONFIG",
    "_REMOTE",
    "_SERVER_MODEL",
    "_VERIFY_DRY_RUN",
]
