"""What workers tell the scheduler outside vLLM's job reports: CPU-slot health and load timings.

Why it exists: vLLM 0.33's worker connector asserts that every transfer succeeded, and
its scheduler always calls ``complete_store``/``complete_load`` with success. Our
worker therefore reports every job as successful, and needs another way to keep a
CPU slot that a failed job was writing (a GPU -> CPU store, or the disk -> CPU half of
a promotion) from ever being served.

The channel is one byte per CPU slot in a small file that the scheduler process and
every worker process of one engine map shared. A worker sets a slot's byte *before* it
reports the job, so by the time all workers have reported and vLLM calls
``complete_*``, the scheduler sees it; the scheduler reads and clears the bytes of
exactly the slots that job wrote (a slot is written by one job at a time, so nothing
else races on it). Any rank failing marks the slot for all ranks.

Where it lives, and why no one else can touch it: in ``tiered-kv-<uid>/``, a directory
of this user's (``0700``) in ``/dev/shm`` (the temporary directory where there is none),
named after a digest of vLLM's engine id, which is unique per engine and data-parallel
replica (a random UUID unless configured). The first process of the engine creates it
(``O_CREAT | O_EXCL | O_NOFOLLOW``, ``0600``); the others open it without following a
link and only if it is a regular file of this user's with mode ``0600``. A directory of
that name that is not this user's own, or not ``0700``, is refused: another user could
otherwise plant the file (and forge or clear failure marks) or a link. I/O: that
directory and file, mapped with ``mmap``.

Load timings (``LoadTimings``) take the same way: vLLM's worker metadata carries the load
bytes and seconds summed over every tier, while the scheduler's load-versus-recompute
decision (``tiered_kv.cost``) needs each tier's. Each worker adds every finished
transfer's bytes, seconds and one job to its rank's running totals for that transfer type
in a second file of the engine's; the scheduler reads the totals each step and feeds the
growth since its last read, as one average job per rank and type, to the tier's estimate.
Each total is guarded by a sequence number (odd while its writer updates it; a reader
that sees it odd or changed skips that total until the next step). The prefill rate
takes the same way: each worker adds the tokens and seconds of its forward passes that
were nearly all prefill (``connector.TieredOffloadingConnector``) as one more type.

Limits: the processes must share a host (as vLLM's own CPU offloading region does).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from tiered_kv.abstract import Closing
from tiered_kv.cost import PREFILL, load_transfer_types
from tiered_kv.disk.format.safe_open import CacheEntryError, open_dir, open_file


def _shared_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def private_dir() -> Path:
    """This user's directory for slot-health files (created ``0700``; module docstring)."""
    return _shared_dir() / f"tiered-kv-{os.geteuid()}"


class SlotHealth(Closing):
    """One byte per CPU slot, shared by the processes of one engine (module docstring).

    ``num_slots`` must be the same in every process. Opening creates the file if needed
    and never clears it, so the processes may start in any order. Raises
    ``RuntimeError`` (a ``CacheEntryError``) when the file or its directory is not this
    user's own.
    """

    def __init__(self, path: str | os.PathLike, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.path = Path(path)
        self.num_slots = num_slots
        self._map = _map_private(self.path, num_slots)

    @classmethod
    def for_engine(cls, engine_id: str, num_slots: int) -> "SlotHealth":
        """The health map of engine ``engine_id`` (same file in every process)."""
        return cls(_engine_file(engine_id, "cpu-slot-health"), num_slots)

    def mark_bad(self, slots: Iterable[int]) -> None:
        """Record that the last write of each slot failed on this process's rank."""
        for slot in slots:
            self._map[int(slot)] = 1

    def take_bad(self, slots: Iterable[int]) -> set[int]:
        """Of ``slots``, those marked bad; their marks are cleared."""
        bad = set()
        for slot in slots:
            slot = int(slot)
            if self._map[slot]:
                self._map[slot] = 0
                bad.add(slot)
        return bad

    def clear(self) -> None:
        """Forget every mark (after a cache reset, once no worker writes any slot)."""
        self._map[:] = bytes(self.num_slots)

    def close(self, unlink: bool = False) -> None:
        """Unmap; ``unlink`` removes the file (the scheduler does, at shutdown)."""
        if not self._map.closed:
            self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class LoadTimings(Closing):
    """Running totals of finished transfers per rank and transfer type, shared by the
    processes of one engine (module docstring). ``transfer_types`` and ``ranks`` must
    be the same in every process; a worker writes with ``rank`` set (its own totals
    only), the scheduler reads with ``take``."""

    _RECORD = struct.Struct("<Qddd")  # sequence, bytes, seconds, jobs

    def __init__(self, path: str | os.PathLike, transfer_types: Sequence[str], ranks: int, rank: int | None = None):
        if ranks < 1 or not transfer_types or (rank is not None and not 0 <= rank < ranks):
            raise ValueError(
                f"expected ranks >= 1, some transfer types and 0 <= rank < ranks, got "
                f"{ranks}, {list(transfer_types)!r}, {rank}"
            )
        self.path = Path(path)
        self.types = {t: i for i, t in enumerate(transfer_types)}
        self.ranks, self.rank = ranks, rank
        self._map = _map_private(self.path, ranks * len(self.types) * self._RECORD.size)
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[float, float, float]] = {}

    @classmethod
    def for_engine(
        cls, engine_id: str, tier_names: Sequence[str], ranks: int, rank: int | None = None
    ) -> "LoadTimings":
        """The timings of engine ``engine_id`` (same file in every process) for the load
        transfers of the lower tiers ``tier_names`` and the CPU tier, and for forward
        passes that were nearly all prefill (``PREFILL``: tokens in place of bytes)."""
        types = [*load_transfer_types(["cpu", *tier_names]), PREFILL]
        return cls(_engine_file(engine_id, "load-timings"), types, ranks, rank)

    def _offset(self, rank: int, index: int) -> int:
        return (rank * len(self.types) + index) * self._RECORD.size

    def record(self, transfer_type: str, nbytes: int, seconds: float, success: bool = True) -> None:
        """Add one finished transfer to this rank's totals (a ``TieredStats`` observer);
        failed transfers and types not shared are left out."""
        index = self.types.get(transfer_type)
        if index is None or not success or self.rank is None or self._map.closed:
            return
        off = self._offset(self.rank, index)
        with self._lock:
            seq, b, s, j = self._RECORD.unpack_from(self._map, off)
            self._RECORD.pack_into(self._map, off, seq + 1, b, s, j)
            self._RECORD.pack_into(self._map, off, seq + 2, b + nbytes, s + seconds, j + 1)

    def take(self) -> list[tuple[str, float, float]]:
        """Per rank and type whose totals grew since the last call: ``(transfer type,
        bytes, seconds)`` of the average job among the new ones."""
        out = []
        for name, index in self.types.items():
            for rank in range(self.ranks):
                off = self._offset(rank, index)
                seq, b, s, j = self._RECORD.unpack_from(self._map, off)
                if seq & 1 or self._RECORD.unpack_from(self._map, off)[0] != seq:
                    continue  # being written: next time
                b0, s0, j0 = self._seen.get(off, (0.0, 0.0, 0.0))
                if j > j0 and b > b0 and s > s0 and math.isfinite(b + s + j):  # a torn or forged total: skipped
                    out.append((name, (b - b0) / (j - j0), (s - s0) / (j - j0)))
                self._seen[off] = (b, s, j)
        return out

    def clear(self) -> None:
        """Zero every total (the scheduler, before any worker starts)."""
        self._map[:] = bytes(len(self._map))
        self._seen.clear()

    def close(self, unlink: bool = False) -> None:
        if not self._map.closed:
            self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


def _engine_file(engine_id: str, kind: str) -> Path:
    """This engine's file of ``kind`` in this user's private directory."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:32]
    return private_dir() / f"{digest}.{kind}"


def _map_private(path: Path, size: int) -> mmap.mmap:
    """``path`` (a file of this user's in a private directory, module docstring) mapped,
    ``size`` bytes, created or grown as needed and never cleared."""
    try:
        parent = _open_private_dir(path.parent)
        try:
            fd = _open_private(path, parent)
        finally:
            os.close(parent)
    except CacheEntryError as e:
        raise CacheEntryError(e.path, e.what, e.expected, _ADVICE) from None
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


_ADVICE = "Remove it: it holds nothing an engine needs once no engine of this user runs"


def _open_private_dir(path: Path) -> int:
    """The directory ``path`` (created ``0700`` if missing), not following a link; it
    must be this user's, with no access for anyone else."""
    top = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_dir(path.name, path=path, dir_fd=top, create=True, fix_mode=False)
    finally:
        os.close(top)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & 0o077:
        os.close(fd)
        raise CacheEntryError(path, f"a directory with mode {mode:o}", "a directory (mode 700)")
    return fd


def _open_private(path: Path, parent: int) -> int:
    """``path`` (its name in ``parent``, a private directory) created ``0600`` with
    ``O_EXCL | O_NOFOLLOW``, or, made by another process of this engine, opened if it
    is a regular file of this user's with mode ``0600``."""
    try:
        return open_file(path.name, os.O_RDWR, path=path, dir_fd=parent, create=True, exclusive=True)
    except CacheEntryError:
        if not stat.S_ISREG(os.lstat(path.name, dir_fd=parent).st_mode):
            raise
    fd = open_file(path.name, os.O_RDWR, path=path, dir_fd=parent, fix_mode=False)
    if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        os.close(fd)
        raise CacheEntryError(path, f"a file with mode {mode:o}", "a file (mode 600)")
    return fd
