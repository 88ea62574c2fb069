"""``tiered-kv`` starts light: ``--version``, ``--help`` and shell completion import no
heavy library (torch, numpy, LMDB, vLLM), because each command's module is loaded only
when that command runs. Checked by what a fresh interpreter has imported, not by time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import COMMANDS, _load_commands, app

HEAVY = ("torch", "numpy", "lmdb", "vllm", "transformers")
SCRIPT = Path(sys.executable).parent / "tiered-kv"

_PROBE = """
import json, sys
from tiered_kv.cli import main
args, watched = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["tiered-kv", *args]
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = [m for m in watched if m in sys.modules]
print("PROBE", json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def probe(*args: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :]), proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("--version",),
        ("inspect", "--help"),
        ("inspect", "ls", "--help"),
        ("doctor", "--help"),
        ("config", "--help"),
    ],
)
def test_help_and_version_import_nothing_heavy(args):
    result, out = probe(*args)
    assert result["code"] in (0, None) and result["heavy"] == []
    assert out.strip()


def test_version_names_the_package():
    from importlib.metadata import version

    result, out = probe("--version")
    assert out.strip() == f"tiered-kv {version('tiered-kv')}"


def test_the_listing_shows_every_command_before_any_is_loaded():
    result, out = probe("--help")
    for name in COMMANDS:
        assert f" {name} " in out


def test_listed_one_liners_match_the_commands_own_help():
    _load_commands()
    from typer.main import get_group

    group = get_group(app)
    for name, (_, line) in COMMANDS.items():
        real = group.commands[name]
        first = " ".join((real.help or "").split("\n\n")[0].split())
        assert first == line, name


def test_a_command_runs_without_load_commands():
    """Resolving a name loads its module on demand."""
    result = CliRunner().invoke(app, ["inspect", "ls", "--help"])
    assert result.exit_code == 0 and "--older-than" in result.output


def test_ls_help_names_the_librarys_choices():
    from tiered_kv.cli.inspect import SORT_HELP, STATE_HELP
    from tiered_kv.ops.inspect.summary import SORT_KEYS, STATES

    assert SORT_HELP == ", ".join(SORT_KEYS) and STATE_HELP == ", ".join(STATES)


def _complete(words: str) -> list[str]:
    env = {
        **os.environ,
        "_TIERED_KV_COMPLETE": "complete_bash",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
    }
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    return proc.stdout.split()


@pytest.mark.skipif(not SCRIPT.exists(), reason="the tiered-kv script is not installed in this environment")
def test_shell_completion_of_commands_and_options():
    assert {"inspect", "doctor", "demo", "config", "warmup"} <= set(_complete("tiered-kv "))
    assert _complete("tiered-kv ins") == ["inspect"]
    assert {"summary", "ls", "verify", "evict", "clear", "bench"} <= set(_complete("tiered-kv inspect "))
    assert "--dry-run" in _complete("tiered-kv inspect evict --")


def test_show_completion_prints_a_script():
    # In a process of its own, as a user runs it from a shell (typer names the shell by
    # the process's parents): typer registers its shells' scripts when the command
    # starts, which an app built earlier in this process may skip.
    done = subprocess.run(
        ["bash", "-c", f"'{SCRIPT}' --show-completion; exit $?"],  # not exec'd: bash stays its parent
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "_TIERED_KV_COMPLETE" in done.stdout, done.stderr
