#!/usr/bin/env python
"""Fault-injection trials at scale, and the table in docs/reliability.md.

    python tools/fault_report.py                          # 200 kill -9 trials, 5 rounds of the rest
    python tools/fault_report.py --crash-trials 50 --rounds 2 --seed 7
    python tools/fault_report.py --crash-only --crash-trials 500 --tp 1 2 --disk-io thread process

Runs the fault suite's scenarios (the harness ``tiered_kv.testing``) on the whole hierarchy
(HierarchySpec + EngineDriver, CPU tensors standing in for the GPU, POSIX I/O):

- kill -9 of an engine in the middle of a store / evict / load storm, one cache per TP
  size for all its trials (each child reopens what the last one left), cycling through
  write policies and ``disk_io`` modes; after each kill the cache is verified as left,
  then reopened, and every block acknowledged durable must be there (a trial that fails
  names what failed, and the caches are kept);
- damage to a closed cache (bit flips in a slab, a truncated or deleted slab, a garbage,
  half-garbage or truncated index), then a restart that requests every block;
- I/O faults injected under a running engine (ENOSPC / EIO on slab writes, EIO on fsync,
  EIO on reads) and, as root, a real tmpfs filled to the last byte; then the fault
  clears and the engine must store again.

Prints one Markdown table (plus the command, date and machine) and exits 1 if any trial
lost an intact durable block, served a wrong block or let an exception reach the engine.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import machine, md_table

from tiered_kv.testing.crash import CrashRunner, read_journal
from tiered_kv.testing.harness import (
    DAMAGE,
    Hierarchy,
    InjectingBackend,
    TmpfsMount,
    documents,
    inject_backend,
    namespace_dirs,
    verify_cache,
)
from tiered_kv.disk.format.index import QUARANTINE_SUFFIX


@dataclass
class Row:
    """One kind of fault, summed over its trials."""

    kind: str
    trials: int = 0
    injected: int = 0  # faults injected (kills, damaged blocks or files, failed I/O calls)
    at_risk: int = 0  # durable blocks on disk when the fault struck
    destroyed: int = 0  # of those, blocks whose bytes or index entry the fault itself destroyed
    detected: int | None = 0  # trials whose fault was reported (inspector and engine); None: nothing to report
    lost: int = 0  # durable blocks the fault did not destroy that were gone afterwards
    wrong: int = 0  # loaded blocks whose bytes were not the block's: must be 0
    escaped: int = 0  # exceptions that reached the engine: must be 0
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.lost == 0 and self.wrong == 0 and self.escaped == 0


class LogTap(logging.Handler):
    """Records log messages (WARNING and up) so a trial can see what was reported."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)


DOCS = 8  # documents of 4 blocks per trial: 32 blocks, all of them fit on the disk tier


def fill(cache: Path, seed: int) -> list[list[bytes]]:
    """A cache whose disk tier holds every block of the trial's documents."""
    docs = documents(DOCS, 4, seed=seed)
    h = Hierarchy(cache, cpu_blocks=8, disk_blocks=64)
    for doc in docs:
        h.run([doc])
        h.settle()
    h.close()
    return docs


def crash(work: Path, trials: int, seed: int, tp_size: int = 1, disk_io: tuple[str, ...] = ("thread",)) -> Row:
    modes = "/".join(disk_io)
    row = Row(f"kill -9 during a store / evict / load storm (TP {tp_size}, disk_io {modes})", detected=None)
    runner = CrashRunner(work / f"crash-tp{tp_size}", seed, tp_size=tp_size, disk_io=disk_io)
    phases = {"startup": 0, "storm": 0}
    clean = 0
    by_mode: dict[tuple[str, str], list[int]] = {}  # (policy, disk_io) -> [trials, clean]
    row_incomplete = 0
    for i in range(trials):
        policy, io = runner.mode(i)
        try:
            t = runner.trial(i)
        except AssertionError as e:  # the child died of an exception, not of the kill
            row.escaped += 1
            row.notes.append(f"trial {i} ({policy}, disk_io {io}): {e}")
            continue
        row.trials += 1
        row.injected += 1
        phases[t.phase] += 1
        row.at_risk += t.acked
        row.lost += len(t.lost)
        row.wrong += len(t.verify.wrong)
        counts = by_mode.setdefault((policy, io), [0, 0])
        counts[0] += 1
        # At TP 1 a block commits in one transaction; at TP 2 each rank commits its own
        # copy, so a kill between them leaves an incomplete entry (never served).
        incomplete_ok = tp_size > 1 or t.verify.incomplete == 0
        row_incomplete += t.verify.incomplete
        if t.verify.ok and incomplete_ok and (t.cli is None or t.cli[0] == 0):
            clean += 1
            counts[1] += 1
        else:  # say what was wrong, so that a rare failure can be chased from the report alone
            v = t.verify
            cli = "" if t.cli is None else f", inspect verify exit {t.cli[0]}: {t.cli[1].strip()[-600:]!r}"
            kept = runner.workdir / f"failed-trial-{i}"
            shutil.rmtree(kept, ignore_errors=True)
            os.rename(runner.as_killed, kept)
            row.notes.append(
                f"trial {i} ({t.policy}, disk_io {io}, TP {tp_size}, {t.phase}, kill after "
                f"{t.delay:.3f} s) left a cache that failed verification: {len(v.corrupt)} corrupt "
                f"{[h.hex()[:12] for h in v.corrupt[:8]]}, {len(v.wrong)} wrong "
                f"{[h.hex()[:12] for h in v.wrong[:8]]}, {v.incomplete} incomplete, errors "
                f"{v.errors}{cli}; the cache as the kill left it, and the journal, are in {kept}"
            )
    state = read_journal(runner.journal)
    row.wrong += state.mismatches
    per_mode = ", ".join(f"{p} + {io}: {c}/{n}" for (p, io), (n, c) in sorted(by_mode.items()))
    row.notes.append(
        f"{phases['storm']} kills mid-storm, {phases['startup']} during start-up; the cache as each "
        f"kill left it passed verification (tiered-kv inspect verify and a byte-exact check) "
        f"{clean}/{row.trials} times ({per_mode}); {state.requests} requests, {state.acked_total} "
        f"blocks acknowledged durable, {sum(t.verify.verified for t in runner.trials)} blocks read "
        f"back byte-exact; {sum(t.tolerated for t in runner.trials)} blocks taken by an eviction "
        f"the kill interrupted (not counted as lost); {row_incomplete} incomplete entries left by "
        f"kills between ranks' commits (never served)"
    )
    if clean < row.trials:
        row.escaped += row.trials - clean  # a damaged cache after a kill is a failure too
    return row


def corruption(work: Path, kind: str, rounds: int, seed: int) -> Row:
    row = Row(kind)
    for r in range(rounds):
        cache = work / f"{kind.replace(' ', '-')}-{r}"
        docs = fill(cache, seed + r)
        blocks = {b for d in docs for b in d}
        destroyed = DAMAGE[kind](cache, random.Random(seed * 1000 + r))
        row.trials += 1
        row.injected += len(destroyed) if kind == "slab bit flips" else 1
        row.at_risk += len(blocks)
        row.destroyed += len(destroyed)
        before = verify_cache(cache)
        inspector_saw = bool(before.corrupt or before.errors)
        tap = LogTap()
        logging.getLogger("tiered_kv").addHandler(tap)
        try:
            h = Hierarchy(cache, cpu_blocks=8, disk_blocks=64)
            report = h.run(docs)
            h.settle()
            stats = h.disk.stats
            engine_saw = (
                stats.checksum_failures >= len(destroyed)
                if kind == "slab bit flips"
                else tap.saw("missing or truncated")
                if "slab" in kind
                else (namespace_dirs(cache)[0] / ("index.lmdb" + QUARANTINE_SUFFIX)).is_dir()
            )
            row.wrong += report.mismatches
            row.lost += len((blocks - destroyed) - h.disk.loadable_among(blocks))
            h.close()
        except Exception as e:  # the whole point is that this never happens
            row.escaped += 1
            row.notes.append(f"round {r}: {type(e).__name__}: {e}")
            continue
        finally:
            logging.getLogger("tiered_kv").removeHandler(tap)
        row.detected = (row.detected or 0) + (inspector_saw and engine_saw)
        after = verify_cache(cache)
        row.wrong += len(after.wrong)
        if not after.ok:
            row.notes.append(f"round {r}: cache still damaged after the restart: {after}")
    return row


IO_FAULTS = {
    "ENOSPC on slab writes": ("write", errno.ENOSPC),
    "EIO on slab writes": ("write", errno.EIO),
    "EIO on fsync": ("sync", errno.EIO),
    "EIO on reads": ("read", errno.EIO),
}


def io_fault(work: Path, kind: str, rounds: int, seed: int) -> Row:
    call, err = IO_FAULTS[kind]
    row = Row(kind)
    resumed = failed_ops = recomputed = 0
    for r in range(rounds):
        cache = work / f"{kind.replace(' ', '-')}-{r}"
        old = fill(cache, seed + r)
        durable = {b for d in old for b in d}
        row.trials += 1
        row.at_risk += len(durable)
        try:
            h = Hierarchy(cache, cpu_blocks=8, disk_blocks=128)  # room for old, new and later blocks
            io = InjectingBackend()
            inject_backend(h, io)
            setattr(io, f"fail_{call}", err)
            new = documents(DOCS, 4, seed=seed + 100 + r)
            report = h.run((old if call == "read" else new) + old[:2])
            h.settle()
            row.injected += sum(io.injected.values())
            failed_ops += h.spec.store.stats.store_failures + h.spec.stats.tiers["disk"]["failed_loads"]
            recomputed += report.recomputed_after_failed_load
            row.wrong += report.mismatches
            row.detected = (row.detected or 0) + (
                (h.spec.store.stats.store_failures if call != "read" else h.spec.stats.tiers["disk"]["failed_loads"])
                > 0
            )
            setattr(io, f"fail_{call}", None)
            later = documents(2, 4, seed=seed + 200 + r)
            for doc in later:
                h.run([doc])
                h.settle()
            later_blocks = {b for d in later for b in d}
            resumed += h.disk.loadable_among(later_blocks) == later_blocks
            row.lost += len(durable - h.disk.loadable_among(durable))
            h.close()
        except Exception as e:
            row.escaped += 1
            row.notes.append(f"round {r}: {type(e).__name__}: {e}")
    row.notes.append(
        f"{failed_ops} failed stores/loads counted, {recomputed} blocks recomputed after failed "
        f"loads, stores resumed in {resumed}/{row.trials} trials once the fault cleared"
    )
    return row


def full_filesystem(work: Path, rounds: int, seed: int) -> Row:
    row = Row("full filesystem (tmpfs filled to the last byte)", detected=None)
    for r in range(rounds):
        mnt = TmpfsMount(work / f"tmpfs-{r}", 16 << 20)
        if not mnt.mount():
            row.notes.append("skipped: mounting a tmpfs needs root")
            return row
        try:
            cache = mnt.path / "cache"
            old = fill(cache, seed + r)
            durable = {b for d in old for b in d}
            h = Hierarchy(cache, cpu_blocks=8, disk_blocks=64)
            filler = mnt.fill(leave=0)
            row.trials += 1
            row.injected += 1
            row.at_risk += len(durable)
            new = documents(DOCS, 4, seed=seed + 300 + r)
            for doc in new:
                report = h.run([doc])
                h.settle()
            row.wrong += report.mismatches
            row.lost += len(durable - h.disk.loadable_among(durable))
            new_blocks = {b for d in new for b in d}
            stored = len(h.disk.loadable_among(new_blocks))
            row.notes.append(
                f"round {r}: {stored}/{len(new_blocks)} new blocks durable while the disk was full, "
                f"{h.spec.store.stats.store_failures} failed stores"
            )
            h.close()
            filler.unlink()
        except Exception as e:
            row.escaped += 1
            row.notes.append(f"round {r}: {type(e).__name__}: {e}")
        finally:
            mnt.unmount()
    return row


def table(rows: list[Row]) -> str:
    return md_table(
        [
            "fault",
            "trials",
            "faults injected",
            "durable blocks at risk",
            "destroyed by the fault",
            "detected",
            "intact blocks lost",
            "wrong blocks served",
            "exceptions to the engine",
        ],
        [
            [
                r.kind,
                r.trials,
                r.injected,
                r.at_risk,
                r.destroyed,
                "n/a" if r.detected is None else f"{r.detected}/{r.trials}",
                r.lost,
                r.wrong,
                r.escaped,
            ]
            for r in rows
        ],
        left=1,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crash-trials", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5, help="trials per corruption and I/O fault kind")
    ap.add_argument("--seed", type=int, default=20261123)
    ap.add_argument("--workdir", type=Path, default=None, help="where caches go (default: a temporary dir)")
    ap.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=[1],
        help="TP sizes of the kill -9 trials (each gets --crash-trials trials on a cache of its own)",
    )
    ap.add_argument(
        "--disk-io",
        nargs="+",
        default=["thread"],
        choices=["thread", "process"],
        help="disk_io modes the kill -9 trials cycle through",
    )
    ap.add_argument("--crash-only", action="store_true", help="run only the kill -9 trials")
    args = ap.parse_args()
    # Faults are logged by design; keep them for the trials' own checks, off the console.
    quiet = logging.getLogger("tiered_kv")
    quiet.setLevel(logging.WARNING)
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tiered-kv-faults-"))
    t0 = time.time()
    rows = [crash(work, args.crash_trials, args.seed, tp, tuple(args.disk_io)) for tp in args.tp]
    if not args.crash_only:
        rows += [corruption(work, kind, args.rounds, args.seed) for kind in DAMAGE]
        rows += [io_fault(work, kind, args.rounds, args.seed) for kind in IO_FAULTS]
        rows.append(full_filesystem(work, min(args.rounds, 2), args.seed))
    if args.workdir is None and all(r.clean for r in rows):
        shutil.rmtree(work, ignore_errors=True)
    elif args.workdir is None:
        print(f"caches kept for inspection in {work}")
    print("command: python tools/fault_report.py " + " ".join(sys.argv[1:]))
    print(
        f"date: {time.strftime('%Y-%m-%d %H:%M')}; machine: {machine()}, {platform.platform()}; "
        f"{time.time() - t0:.0f} s\n"
    )
    print(table(rows))
    print()
    for r in rows:
        for note in r.notes:
            print(f"- {r.kind}: {note}")
    bad = [r.kind for r in rows if not r.clean]
    if bad:
        print(f"\nFAIL: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
