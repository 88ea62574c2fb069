"""Output plumbing shared by the operator commands (``inspect``, ``warmup``): one-line
errors with a non-zero exit instead of tracebacks, JSON on stdout, and progress bars
on stderr that appear only on a terminal and never with ``--json``."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tiered_kv.config import ConfigError
from tiered_kv.disk.namespace import NamespaceError

EXIT_ERROR = 2


def fail(message: str, json_out: bool, code: int = EXIT_ERROR) -> NoReturn:
    """Print ``error: message`` (one line) on stderr, and ``{"error": ...}`` on stdout in
    JSON mode; exit with ``code``."""
    message = " ".join(str(message).split())
    if json_out:
        typer.echo(json.dumps({"error": message}))
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def errors(json_out: bool, expected: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Turn failures into ``fail``: the message alone for ``expected`` errors (and
    config/namespace errors), type and message for anything else. ``TIERED_KV_DEBUG=1``
    re-raises unexpected ones with their traceback."""
    try:
        yield
    except typer.Exit:
        raise
    except (ConfigError, NamespaceError, *expected) as e:
        fail(str(e), json_out)
    except KeyboardInterrupt:
        fail("interrupted", json_out, 130)
    except Exception as e:
        if os.environ.get("TIERED_KV_DEBUG"):
            raise
        fail(f"{type(e).__name__}: {e}", json_out)


class ProgressBar:
    """One task of a Rich progress bar; ``advance(n)``, ``set_total(n)``."""

    def __init__(self, progress: Progress, description: str, total: float | None):
        self._progress = progress
        self._task = progress.add_task(description, total=total)

    def advance(self, n: float) -> None:
        self._progress.advance(self._task, n)

    def set_total(self, n: float) -> None:
        self._progress.update(self._task, total=n, completed=0)

    def set_description(self, text: str) -> None:
        self._progress.update(self._task, description=text)


@contextlib.contextmanager
def progress_bar(json_out: bool, description: str, total: float | None = None,
                 *columns: Any) -> Iterator[ProgressBar]:
    """A transient progress bar on stderr (terminals only, never with ``--json``);
    ``columns`` default to a count of completed units."""
    console = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), *(columns or (MofNCompleteColumn(),)),
                   TimeRemainingColumn(), console=console, transient=True,
                   disable=json_out or not console.is_terminal)
    with bar:
        yield ProgressBar(bar, description, total)


def emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def timestamp(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
