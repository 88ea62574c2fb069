"""``tiered-kv demo`` through typer's runner and as the installed console script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from tiered_kv.cli import _load_commands, app
from tiered_kv.sim.driver import EngineDriver

_load_commands()
runner = CliRunner()


def test_demo_reports_hits_and_transfers(tmp_path):
    result = runner.invoke(
        app,
        [
            "demo",
            "--requests",
            "60",
            "--cpu-bytes",
            "64MiB",
            "--device",
            "cpu",
            "--layout",
            "kv-after",
            "--block-size-factor",
            "2",
            "--cache-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("60 requests", "kv-after", "hit rate: ", "cpu_to_gpu", "gpu_to_cpu", "GB/s", "mismatches: 0"):
        assert text in out
    assert list(tmp_path.glob("*/manifest.json")), "the disk tier created no namespace in --cache-dir"


def _disk_hits(output: str) -> int:
    row = next(line for line in output.splitlines() if "DISK" in line and "%" in line)
    return int(row.split("│")[2].strip())


def test_second_demo_run_is_served_from_the_first_runs_disk_blocks(tmp_path):
    args = ["demo", "--requests", "80", "--cpu-bytes", "2MiB", "--device", "cpu", "--cache-dir", str(tmp_path)]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    second = runner.invoke(app, args + ["--disk-io", "process"])  # either kind reads the same cache
    assert "in a helper process" in second.output
    assert second.exit_code == 0, second.output
    assert "mismatches: 0" in second.output
    assert _disk_hits(second.output) > _disk_hits(first.output)
    assert "disk_to_cpu" in second.output
    # Every block the first run offloaded comes back from disk. A block is recomputed (and
    # stored) the second time only if the first run's store of it was refused: a 16-slot CPU
    # tier can be full of still-in-flight stores, and prepare_store then says None.
    if re.search(r"stores rejected: 0\b", first.output):
        assert "gpu_to_cpu" not in second.output


def test_demo_rejects_bad_options():
    result = runner.invoke(app, ["demo", "--layout", "sideways"])
    assert result.exit_code == 2 and "'sideways' is not one of 'kv-first', 'kv-after'" in result.output
    result = runner.invoke(app, ["demo", "--cpu-bytes", "lots"])
    assert result.exit_code == 2 and "cannot parse size 'lots'" in result.output
    result = runner.invoke(app, ["demo", "--disk-io", "fork", "--cache-dir", "/nonexistent/x"])
    assert result.exit_code == 2 and "--disk-io" in result.output and "'fork' is not one of" in result.output


def test_demo_exits_nonzero_on_mismatch(monkeypatch):
    # Fault injection: the verifier reports the first loaded block of each load as bad.
    monkeypatch.setattr(EngineDriver, "_verify", lambda self, hashes, groups: [0])
    # A CPU tier larger than the workload's distinct blocks: every block asked of it hits.
    result = runner.invoke(app, ["demo", "--requests", "40", "--device", "cpu", "--cpu-bytes", "16MiB"])
    assert result.exit_code == 1
    assert "error: " in result.stderr and "loaded block(s) differ from what was stored" in result.stderr


def test_console_script_runs_the_demo():
    script = Path(sys.executable).with_name("tiered-kv")
    proc = subprocess.run(
        [str(script), "demo", "--requests", "30", "--device", "cpu"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "mismatches: 0" in proc.stdout
