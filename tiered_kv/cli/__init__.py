"""The ``tiered-kv`` command line. Each sub-command lives in its own module here and
registers itself on ``app``; this module only assembles them."""

from __future__ import annotations

import importlib
import logging

import typer

app = typer.Typer(
    name="tiered-kv",
    help="Multi-tier KV-cache for LLM inference: demo, inspect the disk cache, warm it up, make configs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Multi-tier KV-cache for LLM inference."""
    # A callback keeps ``app`` a command group: with a single registered command typer
    # would otherwise run it as the root and reject its name as an extra argument.


# Modules that add commands to ``app`` when imported. A missing one is skipped so a
# partially installed tree still offers the commands it has.
_COMMAND_MODULES = ("demo", "inspect", "config_cmd", "warmup")


def _load_commands() -> None:
    for name in _COMMAND_MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _load_commands()
    app()
