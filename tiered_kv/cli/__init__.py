"""The ``tiered-kv`` command line. Each sub-command lives in its own module here and
registers itself on ``app``; this module only assembles them.

Operator's process; no I/O here. A command's module is imported only when that command
runs (or its help is asked for): the heavy libraries some of them need (torch, numpy,
LMDB, vLLM) would otherwise cost every ``--help``, ``--version`` and shell completion
seconds. The top-level listing and name completion use ``COMMANDS`` below instead.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from typing import Any, Optional

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer 0.2x runs on its own copy of click; earlier releases on click itself
    from typer._click import exceptions as _click_exceptions
    from typer.exceptions import Abort as _Abort
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as _click_exceptions  # type: ignore[no-redef]  # the same module there
    from click.exceptions import Abort as _Abort  # type: ignore[assignment]  # the same class there

#: Sub-command name -> (module under ``tiered_kv.cli``, one-line help shown in the
#: top-level listing before the module is loaded). The one-liners must match the
#: commands' own first help lines (tests/cli/test_cli_startup.py checks).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "demo",
        "Replay a chat workload through GPU -> CPU -> disk and back; print hit rate per "
        "tier, bytes and GB/s per transfer type.",
    ),
    "inspect": ("inspect", "Inspect a disk cache: summary, ls, verify, evict, clear, bench. Add --json for scripts."),
    "config": ("config_cmd", "Size the CPU and disk tiers for a model and print the --kv-transfer-config JSON."),
    "warmup": ("warmup", "Write the KV of every full block of every prompt to the disk tier (resumable)."),
    "doctor": (
        "doctor",
        "Check this host for the tiered KV cache: memory locking, huge pages, the disk "
        "tier's directory, CUDA, GDS, vLLM and hash settings.",
    ),
    "stats": (
        "stats",
        "Show a server's tiers live from its Prometheus endpoint: hit rate in tokens, blocks, bytes, latency, drops, failures.",
    ),
}


class LazyGroup(TyperGroup):
    """The root group: lists every command of ``COMMANDS`` and imports a command's module
    only when that command is resolved (to run it, show its help or complete its
    options)."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(dict.fromkeys([*COMMANDS, *self.commands]))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = self.commands.get(cmd_name)
        if cmd is None and cmd_name in COMMANDS:
            # A stand-in carrying the one-line help, for the listing and name completion.
            return TyperCommand(cmd_name, help=COMMANDS[cmd_name][1])
        return cmd

    def main(
        self,
        args: Any = None,
        prog_name: Any = None,
        complete_var: Any = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        """Run as click does, but every usage error (an unknown option, a bad value, a
        missing argument) is one ``error:`` line on stderr with exit code 2, like the
        commands' own errors (``tiered_kv.cli.output.fail``), never a box or a block."""
        try:
            rv = super().main(
                args, prog_name, complete_var, standalone_mode=False, windows_expand_args=windows_expand_args, **extra
            )
        except _click_exceptions.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # a group run bare: its help, as is
                typer.echo(e.format_message(), err=True)
                if not standalone_mode:
                    raise
                sys.exit(e.exit_code)
            line = " ".join(e.format_message().split()).replace("Value error, ", "")
            ctx = getattr(e, "ctx", None)
            if isinstance(e, _click_exceptions.UsageError) and ctx is not None:
                line += f" (see '{ctx.command_path} --help')"
            if "--json" in (sys.argv[1:] if args is None else list(args)):  # scripts read stdout
                from tiered_kv.cli.output import envelope

                typer.echo(json.dumps(envelope({"error": line}, ctx=ctx), sort_keys=True))
            typer.echo(f"error: {line}", err=True)
            if not standalone_mode:
                raise
            sys.exit(e.exit_code)
        except _Abort:
            typer.echo("error: aborted", err=True)
            if not standalone_mode:
                raise
            sys.exit(1)
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] in COMMANDS and args[0] not in self.commands:
            loaded = _load_command(args[0])
            if loaded is not None:
                self.commands[args[0]] = loaded
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="tiered-kv",
    cls=LazyGroup,
    help="Multi-tier KV-cache for LLM inference: demo, inspect the disk cache, warm it up, make configs, check a host.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiered-kv")
    except PackageNotFoundError:  # running from a source tree that was never installed
        from tiered_kv import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tiered-kv {_version()}")
        raise typer.Exit()


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record comes (a test runner
    swaps it), showing tiered-kv's own records and, only where ``verbose``, every other
    library's."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it; sys.stderr wins
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == "tiered_kv" or record.name.startswith("tiered_kv.")
        return (own or self.verbose) and super().filter(record)


def configure_logging(verbose: bool = False) -> None:
    """What reaches stderr: tiered-kv's own warnings (beside its ``error:``/``warning:``
    lines); with ``verbose`` also its info lines and every library's (vLLM, Mooncake,
    urllib3, botocore, ...), which otherwise stay off the terminal, as the commands
    report what matters in their own words."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _Stderr)]:
        root.removeHandler(handler)
    handler = _Stderr(verbose)
    handler.setLevel(logging.INFO if verbose else logging.WARNING)
    root.addHandler(handler)
    if verbose:
        root.setLevel(min(root.getEffectiveLevel(), logging.INFO))
        # vLLM's own handler writes to stdout, where --json output goes.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    else:
        # vLLM configures a handler of its own unless told not to; its records then
        # reach the root logger, and the filter above.
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.captureWarnings(True)  # Python warnings (urllib3's, torch's) as py.warnings records


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="Also show info lines and the log lines of the libraries used (vLLM, Mooncake, urllib3, botocore).",
    ),
) -> None:
    """Multi-tier KV-cache for LLM inference."""
    # A callback keeps ``app`` a command group: with a single registered command typer
    # would otherwise run it as the root and reject its name as an extra argument.
    configure_logging(verbose)


def _import(name: str) -> bool:
    """Import the module of command ``name``; False when it is not installed (a
    partially installed tree still offers the commands it has)."""
    module = f"{__name__}.{COMMANDS[name][0]}"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return False
    return True


def _load_command(name: str) -> Any:
    """The click command ``name`` as its module registers it on ``app``, or None."""
    if not _import(name):
        return None
    return typer.main.get_group(app).commands.get(name)


def _load_commands() -> None:
    """Import every command module (tests and tools that want ``app`` complete)."""
    for name in COMMANDS:
        _import(name)


def main() -> None:
    configure_logging()  # the root callback reconfigures it once --verbose is parsed
    app()
