"""kill -9 trials of the whole hierarchy: the runner, its journal and what it checks.

Runs in the calling process (the fault suite's tests, ``tools/fault_report.py``). Each
trial forks a ``storm_child`` from the harness's fork server, kills it with SIGKILL at a random
moment, waits for its disk I/O processes to finish, then verifies the cache as the
kill left it and reopens it as an engine would (see ``CrashRunner``).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tiered_kv.testing.harness import (
    Hierarchy,
    CacheCheck,
    fork_context,
    inspect_verify,
    namespace_dirs,
    verify_cache,
)


@dataclass
class JournalState:
    """What the crash children's journal says must be on disk."""

    acked: set[bytes] = field(default_factory=set)  # durable-acknowledged, not evicted since
    open_bracket: int = 0  # blocks asked of a disk prepare_store the kill interrupted (0: none)
    mismatches: int = 0  # wrong blocks the children's engines were served
    requests: int = 0
    acked_total: int = 0
    ready: bool = False


def drop_torn_tail(path: str | os.PathLike) -> None:
    """Cut a record the kill tore off the journal's end. A record is one ``write``, but a
    kill lands between the pages of one that crosses a page boundary, leaving its head
    without its newline; the child had not finished it, so it records nothing, and the
    next record must start on a line of its own."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def read_journal(path: str | os.PathLike) -> JournalState:
    """Replay the journal (see ``storm_child``). Across children it is one history."""
    st = JournalState()
    base_mismatches = 0
    with open(path) as f:
        for line in f.read().splitlines():
            tag, _, arg = line.partition(" ")
            if tag == "S":
                st.ready = False
                st.open_bracket = 0
                base_mismatches = st.mismatches
            elif tag == "R":
                st.ready = True
            elif tag == "B":
                st.open_bracket = int(arg)
            elif tag == "P":
                st.open_bracket = 0
            elif tag == "E":
                st.acked.discard(bytes.fromhex(arg))
            elif tag == "D":
                h = bytes.fromhex(arg)
                if h not in st.acked:
                    st.acked.add(h)
                    st.acked_total += 1
            elif tag == "M":
                st.mismatches = base_mismatches + int(arg)
            elif tag == "Q":
                st.requests += int(arg)
    return st


@dataclass
class CrashTrial:
    """One kill -9 trial and what the check after it found."""

    trial: int
    policy: str
    phase: str  # "startup" or "storm": when the kill landed
    delay: float
    acked: int  # blocks the journal says must have survived
    lost: list[bytes]
    tolerated: int  # missing blocks an interrupted eviction may explain
    verify: CacheCheck
    cli: tuple[int, str] | None
    loadable_after_reopen: int
    disk_io: str = "thread"
    tp_size: int = 1


def wait_group_gone(pgid: int, timeout: float) -> bool:
    """Wait until no live process is left in process group ``pgid`` (a crash child
    leads its own group, so its disk I/O processes are in it); False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        alive = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                alive = True
                break
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _wait_for(journal: Path, start: int, tag: str, proc, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(journal) as f:
            f.seek(start)
            if f"{tag}\n" in f.read():
                return True
        if not proc.is_alive():
            return False
        time.sleep(0.002)
    return False


class CrashRunner:
    """Runs kill -9 trials on one cache directory, each child picking up what the
    previous one left. Trial ``i`` uses seed ``seed + i``; policies alternate between
    write-through and write-back, and every two trials the next of ``disk_io`` modes
    (``thread``: disk I/O in the engine's process; ``process``: in a helper process of
    each rank, which outlives the kill until it has committed its queue); about one
    kill in six lands during start-up (opening the namespace, reclaiming,
    preallocating), the rest during the storm. ``tp_size`` > 1 runs every rank in the
    child (``ranks.RanksDriver``)."""

    STARTUP_SHARE = 1 / 6
    MAX_STORM_DELAY = 0.6
    #: Seconds a helper I/O process may take to commit and exit after its worker died.
    HELPER_EXIT_TIMEOUT = 60.0

    def __init__(
        self, workdir: str | os.PathLike, seed: int, *, tp_size: int = 1, disk_io: tuple[str, ...] = ("thread",)
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cache = self.workdir / "cache"
        self.journal = self.workdir / "journal"
        self.journal.touch()
        self.seed = seed
        self.tp_size = tp_size
        self.disk_io = tuple(disk_io)
        self.rng = random.Random(seed)
        self.trials: list[CrashTrial] = []
        #: The last trial's cache (and journal) as the kill left it, before any check.
        self.as_killed = self.workdir / "as-killed"

    def mode(self, i: int) -> tuple[str, str]:
        """Trial ``i``'s write policy and disk_io mode."""
        return ("write_through", "write_back")[i % 2], self.disk_io[(i // 2) % len(self.disk_io)]

    def trial(self, i: int) -> CrashTrial:
        from tiered_kv.testing import storm_child

        policy, disk_io = self.mode(i)
        start = self.journal.stat().st_size
        proc = fork_context().Process(
            target=storm_child.run,
            args=(str(self.cache), str(self.journal), self.seed + i, policy, disk_io, self.tp_size),
        )
        proc.start()
        startup = self.rng.random() < self.STARTUP_SHARE
        if startup:
            if not _wait_for(self.journal, start, "S", proc, 60):
                raise AssertionError(self._child_failure(proc, "never started"))
            delay = self.rng.uniform(0.0, 0.08)
        else:
            if not _wait_for(self.journal, start, "R", proc, 60):
                raise AssertionError(self._child_failure(proc, "never became ready"))
            delay = self.rng.uniform(0.0, self.MAX_STORM_DELAY)
        time.sleep(delay)
        if not proc.is_alive():
            raise AssertionError(self._child_failure(proc, "exited before the kill"))
        os.kill(proc.pid, 9)
        proc.join(30)
        if proc.exitcode != -9:
            raise AssertionError(self._child_failure(proc, f"ended with {proc.exitcode}, not by the kill"))
        if not wait_group_gone(proc.pid, self.HELPER_EXIT_TIMEOUT):
            raise AssertionError(
                f"trial {i}: a disk I/O process of the killed engine was still running "
                f"{self.HELPER_EXIT_TIMEOUT:.0f} s after the kill"
            )
        # The evidence, before the checks reopen (and so repair) the cache.
        shutil.rmtree(self.as_killed, ignore_errors=True)
        self.as_killed.mkdir()
        if self.cache.exists():
            shutil.copytree(self.cache, self.as_killed / "cache")
        shutil.copy(self.journal, self.as_killed / "journal")
        drop_torn_tail(self.journal)
        result = self._check(i, policy, "startup" if startup else "storm", delay)
        result.disk_io, result.tp_size = disk_io, self.tp_size
        self.trials.append(result)
        return result

    def _child_failure(self, proc, what: str) -> str:
        err = Path(f"{self.journal}.err")
        detail = err.read_text() if err.exists() else "(no traceback)"
        if proc.is_alive():
            os.kill(proc.pid, 9)
            proc.join(10)
        return f"crash child {what}: {detail}"

    def _check(self, i: int, policy: str, phase: str, delay: float) -> CrashTrial:
        """Verify the cache exactly as the kill left it, then reopen it as an engine
        would and check every acknowledged block is loadable."""
        st = read_journal(self.journal)
        verify = verify_cache(self.cache)
        cli = inspect_verify(self.cache) if namespace_dirs(self.cache) else None
        loadable: set[bytes] = set()
        if namespace_dirs(self.cache):
            with Hierarchy(self.cache, engine_id=f"check-{i}", tp_size=self.tp_size, all_ranks=True) as h:
                loadable = h.disk.loadable_among(st.acked) if st.acked else set()
                n_loadable = len(h.disk)
        else:
            n_loadable = 0
        missing = sorted(st.acked - loadable)
        tolerated = min(len(missing), st.open_bracket)
        lost = missing[tolerated:]
        # Blocks an interrupted eviction took are evicted as far as later trials go.
        with open(self.journal, "a") as f:
            for block in missing:
                f.write(f"E {block.hex()}\n")
        return CrashTrial(i, policy, phase, delay, len(st.acked), lost, tolerated, verify, cli, n_loadable)
