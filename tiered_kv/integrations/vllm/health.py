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

A load whose CPU -> GPU copy failed marks the slots it read, too (``LoadSlots``): served
again, the chunk would fail again, and vLLM, which recomputes a request whose load
failed, would load it again without end. Many loads may read one slot at once, so such
a mark says only that some read of the slot's chunk failed; whichever of those loads
ends first takes it, and the chunk is never served again and leaves the CPU tier once
no load pins it. A slot is marked only while a load pins its chunk, and the mark is
taken when that load ends (or, for loads a cache reset abandoned, once vLLM reports
them flushed), before the slot can hold another chunk: no mark reaches a later one.

Where it lives (``private_dir``): in a directory of the engine's own, mode ``0700``,
named after this user's uid and a digest of vLLM's engine id (unique per engine and
data-parallel replica): ``tiered-kv-<uid>-<digest>`` in ``/dev/shm``. Nothing passes
between the processes before they open it (vLLM's engine core builds the workers' side
before the scheduler's, each from the config), so every process finds it on its own,
from the engine id, the uid and what is on disk, the same way. The environment is left out
(``$XDG_RUNTIME_DIR`` is not used): the processes of one engine need not share it
(Ray's workers), and a login session's runtime directory goes at its logout.

Why no one else can touch it, or keep it from being made:

- vLLM's default engine id is a random UUID that stays inside the engine's processes,
  so no one can know the name before the engine's first process makes it; from then on
  it is this user's, and in a sticky directory (``/dev/shm``, ``/tmp``) no one else
  can remove, rename or replace it. A base directory that anyone else could do that in
  (writable by others without the sticky bit, or owned by another user) is not used.
- a configured engine id is predictable, so its name may be taken (squatted) already:
  by a link, a file, a FIFO, a directory of another user's or one with any access for
  others. Such an entry is never opened, followed or written: a WARNING names it, its
  owner and mode, and the next candidate is tried: ``<name>-1`` to ``<name>-7``, the
  same in the temporary directory, and last ``~/.cache/tiered-kv/<name>`` (the home
  directory from the password database), where no one else can make entries. So a
  squat never stops the engine; only a home directory this user cannot write to on top
  of every candidate squatted does (a ``CacheEntryError`` naming each).
- the choice is the first candidate that is already this user's (a ``0700`` directory
  owned by the effective uid, not a link); only when none is, the first missing one is
  made, and the first of this user's taken again. An entry that another user made can
  be removed by them later, but one of this user's stays, so a process that starts
  after another has chosen makes the same choice. A process that chose past a squatted
  candidate waits ``_SETTLE_S`` and takes the first of this user's again, so processes
  choosing at the same moment, one of them before a squat went and one after, end in
  the same place unless one stalls for longer than that between two system calls.

In that directory the first process of the engine creates each file (``O_CREAT |
O_EXCL | O_NOFOLLOW``, ``0600``); the others open it without following a link and only
if it is a regular file of this user's with mode ``0600``. Anything else there can
only be this user's or root's doing, and is refused (``CacheEntryError``). I/O: the
candidates' ``lstat``/``open``/``mkdir``, those files, mapped with ``mmap``; the
scheduler removes the files and the directory at shutdown.

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

import errno
import hashlib
import logging
import math
import mmap
import os
import pwd
import stat
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tiered_kv.abstract import Closing
from tiered_kv.cost import PREFILL, load_transfer_types
from tiered_kv.disk.format.safe_open import CacheEntryError, describe, open_dir, open_file
from tiered_kv.mediums import ids_spec
from tiered_kv.tiered.transfer_specs import TieredLoadSpec

if TYPE_CHECKING:
    from tiered_kv.abstract import LoadStoreSpec
    from tiered_kv.cpu.manager import CPUOffloadingManager

logger = logging.getLogger(__name__)

#: Names tried in each shared base directory for one engine (a squatter can take any
#: number of them; past these, the home directory's).
CANDIDATES_PER_BASE = 8
#: How long a process that chose past a squatted candidate waits before it looks again
#: (module docstring).
_SETTLE_S = 0.2

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _shared_bases() -> list[Path]:
    """The shared directories an engine's private directory may be made in, tmpfs first."""
    bases = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    return [b for i, b in enumerate(bases) if b not in bases[:i]]


def _home_base() -> Path | None:
    """This user's own directory for the last candidate (module docstring); the home
    directory from the password database, ``$HOME`` for a uid without an entry."""
    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        home = os.environ.get("HOME", "")
    return Path(home) / ".cache" / "tiered-kv" if os.path.isabs(home) else None


class _Unusable(Exception):
    """A candidate (or its base directory) that is not used, and why."""


def private_dir(engine_id: str) -> Path:
    """The private directory of engine ``engine_id`` (``0700``, this user's), made if
    needed: the same in every process of the engine (module docstring). Raises
    ``CacheEntryError`` when every candidate is taken and none can be made."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:32]
    name = f"tiered-kv-{os.geteuid()}-{digest}"
    names = [name] + [f"{name}-{n}" for n in range(1, CANDIDATES_PER_BASE)]
    candidates = [base / n for base in _shared_bases() for n in names]
    home = _home_base()
    if home is not None:
        candidates.append(home / name)
    why: dict[Path, str] = {}
    chosen = _first_ours(candidates, why)
    if chosen is None:
        for path in candidates:
            if path not in why and path.parent not in why and _probe(path, why, create=True):
                break
        chosen = _first_ours(candidates, why)
    if chosen is not None and any(p in why for p in candidates[: candidates.index(chosen)]):
        time.sleep(_SETTLE_S)
        chosen = _first_ours(candidates, why)
    passed = candidates if chosen is None else candidates[: candidates.index(chosen)]
    notes = [(p, why[p]) for p in dict.fromkeys(q for c in passed for q in (c.parent, c)) if p in why]
    if chosen is None:
        raise CacheEntryError(
            candidates[0],
            "unusable, and so is every other place for it (" + "; ".join(f"{p} {w}" for p, w in notes) + ")",
            "a directory (mode 700)",
            "Remove those entries, or give this user a home directory it can write to",
        )
    for path, what in notes:
        _warn_once(path, what, chosen)
    return chosen


def _first_ours(candidates: Sequence[Path], why: dict[Path, str]) -> Path | None:
    for path in candidates:
        if path.parent not in why and _probe(path, why):
            return path
    return None


_warned: set[tuple[Path, str]] = set()


def _warn_once(path: Path, what: str, chosen: Path) -> None:
    if (path, what) not in _warned:
        _warned.add((path, what))
        logger.warning("%s %s; this engine's slot-health files are in %s instead", path, what, chosen)


def _probe(path: Path, why: dict[Path, str], *, create: bool = False) -> bool:
    """Whether ``path`` is this user's private directory (``create``: made ``0700`` if
    missing, with the home candidate's base). Not following any link at ``path``; a
    candidate found to be something else is recorded in ``why``, and so is a base
    directory that cannot hold one (then no name in it is tried again)."""
    try:
        base = _open_base(path.parent, create=create and path.parent == _home_base())
    except FileNotFoundError:
        return False  # a missing base (no /dev/shm; the home candidate's, until made)
    except (OSError, _Unusable) as e:
        why[path.parent] = f"is not used for slot-health files: {e}"
        return False
    try:
        if create:
            try:
                os.mkdir(path.name, 0o700, dir_fd=base)
            except FileExistsError:
                pass
            except OSError as e:
                why[path.parent] = f"is not used for slot-health files: no directory can be made in it ({e.strerror})"
                return False
        try:
            fd = os.open(path.name, _DIR_FLAGS, dir_fd=base)
        except FileNotFoundError:
            return False
        except OSError:
            why[path] = _squatted(path.name, base)
            return False
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                why[path] = _squatted(path.name, base)
                return False
            if st.st_mode & 0o700 != 0o700:  # ours, made under a umask that took owner bits
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    finally:
        os.close(base)
    why.pop(path, None)
    return True


def _squatted(name: str, dir_fd: int) -> str:
    """Why the entry ``name`` in ``dir_fd`` is left alone: what it is, its owner and
    mode (not following it)."""
    what = describe(name, dir_fd)
    try:
        st = os.lstat(name, dir_fd=dir_fd)
        what += f" owned by uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):o})"
    except OSError:
        pass
    return (
        f"is {what}, not a directory of this user's with mode 700, so it is left alone "
        "(another local user may have made it to keep this user's engines from starting)"
    )


def _open_base(base: Path, *, create: bool = False) -> int:
    """A descriptor of the directory ``base``, in which no one but this user and root
    can remove, rename or replace this user's entries. ``create``: the home candidate's
    base, made ``0700`` level by level below the home directory, not following links."""
    if not create:
        return _trusted(os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), base)
    home = base.parent.parent
    fd = _trusted(os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), home)
    path = home
    for part in base.relative_to(home).parts:
        path = path / part
        try:
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _Unusable(f"{path} is {describe(part, fd)}") from None
                raise
        finally:
            os.close(fd)
        fd = _trusted(sub, path)
    return fd


def _trusted(fd: int, path: Path) -> int:
    """``fd`` if its directory is root's or this user's and no one else can write to it
    (or it is sticky); closed otherwise."""
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        os.close(fd)
        raise _Unusable(
            f"{path} is a directory owned by uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):o}) "
            "in which others could replace this user's entries"
        )
    return fd


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
        self._in_engine_dir = False

    @classmethod
    def for_engine(cls, engine_id: str, num_slots: int) -> "SlotHealth":
        """The health map of engine ``engine_id`` (same file in every process)."""
        health = cls(_engine_file(engine_id, "cpu-slot-health"), num_slots)
        health._in_engine_dir = True
        return health

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
        """Unmap; ``unlink`` removes the file (the scheduler does, at shutdown), and the
        engine's private directory once it is empty."""
        if not self._map.closed:
            self._map.close()
        if unlink:
            _unlink(self.path, self._in_engine_dir)


class LoadSlots:
    """The CPU slot each load in flight reads a chunk from (a CPU hit) or promotes it
    into, per (request, key), and what their ``SlotHealth`` marks mean when the load ends
    (module docstring). Scheduler process. ``cpu``: the CPU tier's manager;
    ``failures``: the manager's count of failed worker jobs, by kind.

    A promotion's mark says the chunk's new bytes are bad: the caller does not keep them.
    A read's mark says a copy of the chunk to the GPU failed: the chunk is *suspect*,
    answered MISS by every lookup (``suspect``) and dropped from the CPU tier as soon as
    no load or lease pins it (``drop``); the request's recomputed KV is stored afresh.
    """

    def __init__(self, health: SlotHealth, cpu: "CPUOffloadingManager", failures: Counter[str]):
        self.health, self.cpu, self.failures = health, cpu, failures
        self._reads: dict[tuple[str, bytes], int] = {}
        self._writes: dict[tuple[str, bytes], int] = {}
        self._abandoned: dict[int, bytes] = {}  # read slots of loads a cache reset abandoned
        #: Chunks a failed read left suspect, and the slot each was in then.
        self.suspect: dict[bytes, int] = {}

    def started(self, req_id: str, keys: Sequence[bytes], spec: "LoadStoreSpec") -> None:
        """Request ``req_id``'s load of ``keys`` was prepared as ``spec`` (the composite's:
        a ``TieredLoadSpec``, or CPU slots when every chunk is CPU-resident)."""
        if isinstance(spec, TieredLoadSpec):
            for key, read, write in zip(spec.block_hashes, spec.cpu_slots.tolist(), spec.promote_slots.tolist()):
                if read >= 0:
                    self._reads[(req_id, key)] = read
                elif write >= 0:
                    self._writes[(req_id, key)] = write
        else:
            self._reads.update(zip([(req_id, key) for key in keys], ids_spec(spec).id_list()))

    def ended(self, req_id: str, keys: Sequence[bytes]) -> set[bytes]:
        """Request ``req_id``'s load of ``keys`` ended: the marks of its slots are taken,
        and the chunks whose promotion or read failed are returned (the reads' now
        suspect), logged and counted once for the job. A mark that another load of the
        same chunk set is taken here too: it says the same of the chunk."""
        reads = {key: slot for key in keys if (slot := self._reads.pop((req_id, key), None)) is not None}
        writes = {key: slot for key in keys if (slot := self._writes.pop((req_id, key), None)) is not None}
        bad = self.health.take_bad([*reads.values(), *writes.values()])
        if not bad:
            return set()
        promoted = {key for key, slot in writes.items() if slot in bad}
        read = {key for key, slot in reads.items() if slot in bad}
        if promoted:
            msg = "request %s: the promotion of %d lower-tier chunks into the CPU tier failed in a worker; %s"
            logger.error(msg, req_id, len(promoted), "the chunks are not kept in CPU")
            self.failures["promotion"] += 1
        if read:
            msg = "request %s: a worker failed to load %d chunks from the CPU tier; %s"
            logger.error(msg, req_id, len(read), "they are not served again and are dropped from it")
            self.failures["load"] += 1
            self.suspect.update((key, reads[key]) for key in read)
        return promoted | read

    def drop(self) -> None:
        """Drop from the CPU tier each suspect chunk that nothing pins any more; forget
        those that left it (evicted, emptied by a reset)."""
        cpu = self.cpu
        for key, slot in list(self.suspect.items()):
            if cpu.slot_of(key) == slot and cpu.is_loadable(key):
                try:
                    cpu.remove(key)
                except ValueError:  # pinned by another load or a lease: never served, dropped later
                    continue
            del self.suspect[key]

    def abandon(self) -> list[int]:
        """A cache reset: vLLM ends none of the loads in flight. Returns the slots their
        promotions write (the caller forgets their marks once the loads are flushed);
        their reads' marks are taken then (``flushed``)."""
        self._abandoned.update((slot, key) for (_, key), slot in self._reads.items())
        writes = list(self._writes.values())
        self._reads.clear()
        self._writes.clear()
        return writes

    def flushed(self) -> None:
        """Every load a reset abandoned is flushed and unpinned: a read of theirs that
        failed leaves its chunk suspect, as ``ended`` does."""
        abandoned, self._abandoned = self._abandoned, {}
        for slot in self.health.take_bad(abandoned):
            self.suspect[abandoned[slot]] = slot
        self.drop()


#: What a load type's failed totals add to its name in ``LoadTimings``.
FAILED = ":failed"


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
        self._in_engine_dir = False

    @classmethod
    def for_engine(
        cls, engine_id: str, tier_names: Sequence[str], ranks: int, rank: int | None = None
    ) -> "LoadTimings":
        """The timings of engine ``engine_id`` (same file in every process) for the load
        transfers of the lower tiers ``tier_names`` and the CPU tier, and for forward
        passes that were nearly all prefill (``PREFILL``: tokens in place of bytes)."""
        loads = list(load_transfer_types(["cpu", *tier_names]))
        types = [*loads, *(t + FAILED for t in loads), PREFILL]
        timings = cls(_engine_file(engine_id, "load-timings"), types, ranks, rank)
        timings._in_engine_dir = True
        return timings

    def _offset(self, rank: int, index: int) -> int:
        return (rank * len(self.types) + index) * self._RECORD.size

    def record(self, transfer_type: str, nbytes: int, seconds: float, success: bool = True) -> None:
        """Add one finished transfer to this rank's totals (a ``TieredStats`` observer);
        a failed one to its type's failed totals (the decision charges what it cost),
        where there are such; types not shared are left out."""
        index = self.types.get(transfer_type if success else transfer_type + FAILED)
        if index is None or self.rank is None or self._map.closed:
            return
        off = self._offset(self.rank, index)
        with self._lock:
            seq, b, s, j = self._RECORD.unpack_from(self._map, off)
            self._RECORD.pack_into(self._map, off, seq + 1, b, s, j)
            self._RECORD.pack_into(self._map, off, seq + 2, b + nbytes, s + seconds, j + 1)

    def take(self) -> list[tuple[str, float, float, bool]]:
        """Per rank and type whose totals grew since the last call: ``(transfer type,
        bytes, seconds, success)`` of the average job among the new ones."""
        out = []
        for name, index in self.types.items():
            for rank in range(self.ranks):
                off = self._offset(rank, index)
                seq, b, s, j = self._RECORD.unpack_from(self._map, off)
                if seq & 1 or self._RECORD.unpack_from(self._map, off)[0] != seq:
                    continue  # being written: next time
                b0, s0, j0 = self._seen.get(off, (0.0, 0.0, 0.0))
                if j > j0 and b > b0 and s > s0 and math.isfinite(b + s + j):  # a torn or forged total: skipped
                    failed = name.endswith(FAILED)
                    out.append((name.removesuffix(FAILED), (b - b0) / (j - j0), (s - s0) / (j - j0), not failed))
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
            _unlink(self.path, self._in_engine_dir)


def _engine_file(engine_id: str, kind: str) -> Path:
    """This engine's file of ``kind`` in its private directory."""
    return private_dir(engine_id) / kind


def _unlink(path: Path, in_engine_dir: bool) -> None:
    """Remove ``path`` and, when it is in an engine's private directory, that directory
    once it is empty (the other file may still be open)."""
    path.unlink(missing_ok=True)
    if in_engine_dir:
        try:
            path.parent.rmdir()
        except OSError:
            pass


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
