"""``tiered-kv demo --remote``: the demo's hierarchy with a shared tier, on a throwaway
Mooncake Store it starts and stops itself (skipped where Mooncake is not installed), and
the errors of a ``--remote`` value that names no shared tier."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from support.mooncake_server import skip_module_without_mooncake
from tiered_kv.cli import _load_commands, app

_load_commands()
runner = CliRunner()
SCRIPT = Path(sys.executable).with_name("tiered-kv")
ARGS = ["demo", "--remote", "--device", "cpu", "--cpu-bytes", "2MiB"]


def _env(tmp_path: Path) -> dict[str, str]:
    """The environment of a demo whose scratch directory lands in ``tmp_path/tmp``."""
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    return {**os.environ, "TMPDIR": str(scratch_root)}


def _rpc_port(stderr: str) -> str:
    match = re.search(r"shared tier: throwaway Mooncake Store, master 127\.0\.0\.1:(\d+)", stderr)
    assert match, stderr[-3000:]
    return match.group(1)


def _daemons_on(port: str) -> list[str]:
    """Command lines of the processes still serving the master's RPC port."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if f"--rpc_port={port}".encode() in argv or any(
            a.endswith(f":{port}".encode()) and a.startswith(b"--master_server_address=") for a in argv
        ):
            found.append(b" ".join(argv).decode(errors="replace"))
    return found


def _remote_hits(stdout: str) -> int:
    row = next(line for line in stdout.splitlines() if "REMOTE" in line and "%" in line)
    return int(row.split("│")[2].strip())


def test_demo_remote_second_pass_is_served_from_a_throwaway_shared_tier(tmp_path):
    skip_module_without_mooncake()
    env = _env(tmp_path)
    done = subprocess.run(
        [str(SCRIPT), *ARGS, "--requests", "40"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    port = _rpc_port(done.stderr)
    assert "mismatches: 0" in done.stdout
    first = next(line for line in done.stdout.splitlines() if line.startswith("first pass"))
    assert first.endswith("mismatches: 0"), first
    assert _remote_hits(done.stdout) > 0, done.stdout
    assert "shared tier: lookups" in done.stdout
    assert not _daemons_on(port)
    assert not list(Path(env["TMPDIR"]).iterdir()), "the scratch directory was left behind"


def test_ctrl_c_stops_the_throwaway_server_and_removes_its_scratch_directory(tmp_path):
    skip_module_without_mooncake()
    env = _env(tmp_path)
    proc = subprocess.Popen(
        [str(SCRIPT), *ARGS, "--requests", "3000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # Ctrl-C reaches the demo as from a terminal, though this run's shell may have
        # started it in the background (SIGINT ignored, which a child inherits).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        seen = []
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if "shared tier: throwaway" in line:
                break
        port = _rpc_port("".join(seen))
        time.sleep(1)  # into the replay
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not _daemons_on(port)
    assert not list(Path(env["TMPDIR"]).iterdir()), "the scratch directory was left behind"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("no-such-config.json", "no such file"),
        ("ftp://host/bucket", "unsupported scheme"),
        ("http://127.0.0.1:9", "not an S3 bucket URL"),
    ],
)
def test_bad_remote_value_exits_2_naming_it(tmp_path, value, expected):
    result = runner.invoke(app, ["demo", "--remote", value, "--requests", "1", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert f"--remote {value!r}" in result.output
    assert expected in result.output


def test_config_without_a_remote_section_exits_2_naming_it(tmp_path):
    config = tmp_path / "tiers.json"
    config.write_text('{"cpu_bytes": "8MiB"}')
    result = runner.invoke(app, ["demo", "--remote", str(config), "--requests", "1", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert str(config) in result.output and "no 'remote' section" in result.output


def test_without_a_server_to_start_exits_2_saying_what_to_install(monkeypatch):
    import tiered_kv.cli.demo_remote as demo_remote
    import tiered_kv.testing.mooncake_server as mooncake_server

    monkeypatch.setattr(mooncake_server, "missing_reason", lambda: "no Mooncake here")
    monkeypatch.setattr(demo_remote, "_rgw_ready", lambda: False)
    result = runner.invoke(app, ["demo", "--remote", "--requests", "1", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    for text in ("tiered-kv[mooncake]", "make rgw", "--remote CONFIG"):
        assert text in result.output
