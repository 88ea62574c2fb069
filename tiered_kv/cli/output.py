"""Output plumbing shared by the operator commands: one-line errors with a non-zero exit
instead of tracebacks, JSON on stdout in one envelope, and progress bars on stderr that
appear only on a terminal and never with ``--json``.

Operator's process; writes only to stdout and stderr. Kept free of heavy imports (torch,
numpy, LMDB): every command imports it, including ``--help``.

The JSON envelope. Every ``--json`` document (and every JSON error) is an object with

- ``schema``: ``tiered-kv/<command>`` (e.g. ``tiered-kv/inspect-summary``), and
  ``schema_version`` (``SCHEMA_VERSION``; bumped when a field changes meaning or goes),
- ``generated``: when it was made, ISO 8601 in UTC,
- ``path``: the cache directory or file the command worked on (null when none),
- the command's own fields beside them; ``namespaces``, where present, is a list of
  objects each naming its ``namespace``. Timestamps are ISO 8601 strings; block hashes
  are full hex (tables show the first ``HASH_PREFIX`` characters).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NoReturn

import typer

from tiered_kv.config import ConfigError

EXIT_ERROR = 2
#: Version of every command's JSON schema (see the module docstring).
SCHEMA_VERSION = 1
#: Characters of a block hash shown in tables (JSON always has the full hash).
HASH_PREFIX = 16


def iso_time(t: float | None) -> str | None:
    """``t`` (seconds since the epoch) as ISO 8601 in UTC, e.g. ``2026-11-21T09:30:00.123456Z``;
    None stays None."""
    if t is None:
        return None
    return _dt.datetime.fromtimestamp(float(t), _dt.timezone.utc).isoformat().replace("+00:00", "Z")


def with_iso_times(data: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` with each of ``keys`` that it holds turned into ``iso_time``."""
    out = dict(data)
    for key in keys:
        if key in out:
            out[key] = iso_time(out[key])
    return out


def _current_context() -> Any:
    # Typer 0.2x runs on its own copy of click; earlier releases on click itself.
    for name in ("typer._click.globals", "click"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        ctx = module.get_current_context(silent=True)
        if ctx is not None:
            return ctx
    return None


def _schema(ctx: Any = None) -> str:
    """``tiered-kv/<sub-command path>`` of ``ctx``, by default the command running now."""
    ctx = _current_context() if ctx is None else ctx
    parts = ctx.command_path.split()[1:] if ctx is not None else []
    return "tiered-kv/" + ("-".join(parts) or "tiered-kv")


def envelope(data: Mapping[str, Any], path: Any = None, ctx: Any = None) -> dict[str, Any]:
    """``data`` with the envelope's fields (see the module docstring). ``path`` defaults to
    ``data["path"]``; ``ctx``: the command's click context (the one running by default)."""
    head = {"schema": _schema(ctx), "schema_version": SCHEMA_VERSION, "generated": iso_time(time.time()), "path": None}
    out = {**head, **data}
    if path is not None:
        out["path"] = str(path)
    elif out["path"] is not None:
        out["path"] = str(out["path"])
    return out


def emit_json(data: Mapping[str, Any], path: Any = None) -> None:
    """Print ``data`` in the envelope, as indented JSON on stdout."""
    typer.echo(json.dumps(envelope(data, path), indent=2, sort_keys=True))


def fail(message: str, json_out: bool, code: int = EXIT_ERROR) -> NoReturn:
    """Print ``error: message`` (one line) on stderr, and the envelope with ``error`` on
    stdout in JSON mode; exit with ``code``."""
    message = " ".join(str(message).split())
    if json_out:
        typer.echo(json.dumps(envelope({"error": message}), sort_keys=True))
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _is_namespace_error(e: BaseException) -> bool:
    # Looked up, not imported: the disk package pulls in torch, and an exception of it
    # can only exist once it has been imported.
    module = sys.modules.get("tiered_kv.disk.format.namespace")
    return module is not None and isinstance(e, module.NamespaceError)


@contextlib.contextmanager
def errors(json_out: bool, expected: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Turn failures into ``fail``: the message alone for ``expected`` errors (and
    config/namespace errors), type and message for anything else. ``TIERED_KV_DEBUG=1``
    re-raises unexpected ones with their traceback."""
    try:
        yield
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        fail("interrupted", json_out, 130)
    except Exception as e:
        if isinstance(e, (ConfigError, *expected)) or _is_namespace_error(e):
            fail(str(e), json_out)
        if os.environ.get("TIERED_KV_DEBUG"):
            raise
        fail(f"{type(e).__name__}: {e}", json_out)


class ProgressBar:
    """One task of a Rich progress bar; ``advance(n)``, ``set_total(n)``."""

    def __init__(self, progress: Any, description: str, total: float | None):
        self._progress = progress
        self._task = progress.add_task(description, total=total)

    def advance(self, n: float) -> None:
        self._progress.advance(self._task, n)

    def set_total(self, n: float) -> None:
        self._progress.update(self._task, total=n, completed=0)

    def set_description(self, text: str) -> None:
        self._progress.update(self._task, description=text)


@contextlib.contextmanager
def progress_bar(json_out: bool, description: str, total: float | None = None, *columns: Any) -> Iterator[ProgressBar]:
    """A transient progress bar on stderr (terminals only, never with ``--json``);
    ``columns`` default to a count of completed units."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        *(columns or (MofNCompleteColumn(),)),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=json_out or not console.is_terminal,
    )
    with bar:
        yield ProgressBar(bar, description, total)


def table_console() -> Any:
    """A Rich console for tables on stdout: the terminal's width on a terminal; piped or
    redirected, unbounded, so no column is cut or folded."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=10_000)


def timestamp(t: float | None) -> str:
    """``t`` in local time for tables, ``-`` for None."""
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def short_hash(hex_hash: str) -> str:
    """A block hash as tables show it."""
    return hex_hash[:HASH_PREFIX]
