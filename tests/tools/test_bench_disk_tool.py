"""``tools/bench_disk.py`` on a few megabytes (the handler's jobs from shuffled CPU
slots): it runs every path, prints its tables, and ``--trace`` accounts for every I/O
call (never more in flight than I/O threads)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_disk.py"


def test_a_small_traced_run_prints_every_table_and_plausible_call_counts(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--dir",
            str(tmp_path),
            "--sizes",
            "0.5,2",
            "--total-mib",
            "16",
            "--job-mib",
            "4",
            "--rounds",
            "1",
            "--io-threads",
            "3",
            "--trace",
            "--scattered-slots",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for heading in (
        "GB/s; store = DiskStore",
        "Per-round ratios",
        "CPU seconds per GB moved",
        "preadv/pwritev calls: mean calls in flight",
        "Milliseconds before the first call",
    ):
        assert heading in text
    calls, edges = text.split("preadv/pwritev calls")[1].split("Milliseconds before the first call")

    def rows(table: str) -> list[str]:
        found = [line for line in table.splitlines() if re.match(r"\s+[\d.]+ MiB \|", line)]
        assert len(found) == 2
        return found

    for row in rows(calls):
        cells = re.findall(r"([\d.]+) x\s+([\d.]+)", row)
        assert len(cells) == 6  # raw, store, handler; writes then reads
        for in_flight, ms in cells:
            assert 0 < float(in_flight) <= 3.05 and float(ms) > 0
    for row in rows(edges):
        cells = re.findall(r"(-?[\d.]+) \+\s+(-?[\d.]+)", row)
        assert len(cells) == 6
        for before, after in cells:  # each path's own calls lie within its measurement
            assert 0 <= float(before) < 5000 and 0 <= float(after) < 5000
    assert not list(tmp_path.iterdir()), "the tool removes its scratch directory"


def test_the_handler_writes_and_reads_small_blocks_in_place(tmp_path):
    # The CPU tier is block-major: a 0.5 MiB block is one page-aligned piece, moved
    # without packing (it was 64 pieces of 8 KiB, one per layer plane, and packed).
    out = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--dir",
            str(tmp_path),
            "--sizes",
            "0.5",
            "--total-mib",
            "8",
            "--job-mib",
            "4",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "handler vectored" in out.stdout
