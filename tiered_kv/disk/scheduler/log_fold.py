"""How the disk manager folds the workers' log records into its state (``manager.py``).

Scheduler process, with the manager's lock held (on the scheduler's thread or the
flusher's); no I/O: the records were read from the index log by one LMDB read
transaction (``DiskIndex.read_log_columns``). A pending block becomes durable once every
rank logged ``ok`` for the slot it waits on; a ``failed`` record marks it failed, and
its slot is freed once every rank has logged an outcome; a ``corrupt`` record drops a
loadable block. A store given up while ranks may still write its slot (``settling``:
the job failed on one rank, or a reset abandoned it) keeps the slot out of use until
every rank has logged its outcome there, so a write landing late can never count
toward, or mix with, a later store to that slot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from tiered_kv.abstract import BlockHash
from tiered_kv.disk.format.index_records import LOG_CORRUPT, LOG_FAILED, LOG_OK

__all__ = ["NO_PROGRESS", "Progress", "RefreshResult", "UnreadSettles", "fold_good_writes", "fold_log"]


@dataclass
class RefreshResult:
    """What ``refresh()`` changed: blocks that became loadable, pending blocks whose store
    failed on some rank, and loadable blocks dropped as corrupt."""

    durable: list[BlockHash]
    failed: list[BlockHash]
    corrupt: list[BlockHash]
    more: bool = False  # stopped at its record limit: call again

    def __bool__(self) -> bool:
        return bool(self.durable or self.failed or self.corrupt)


class Progress(NamedTuple):
    """What the log said so far about a pending block (absent until its first record)."""

    ranks: int  # bitmask of ranks whose bytes are durable
    reported: int  # ranks that logged an outcome (ok or failed): done with the slot
    failed: bool


NO_PROGRESS = Progress(0, 0, False)


class UnreadSettles:
    """Blocks whose job settled before ``refresh()`` read their workers' log records.

    Records name a block by (hash, slot) alone, and the free list hands a freed slot out
    again first, so a record of a settled store (or a failed load's ``corrupt``) left
    unread would settle the block's next store to that slot before a byte of it is
    written, or drop it. Workers log before their job completes, so a log read that
    begins after ``settle`` sees the job's records: the manager reads the log before
    storing a block named here again, and ``read_up_to`` forgets the blocks such a read
    covered. Not thread-safe alone: mutated under the manager's lock, read on the
    scheduler's thread (``read_up_to`` rebinds, never empties in place)."""

    def __init__(self, bound: int) -> None:
        self.settled = 0  # jobs settled so far
        self._at: dict[bytes, int] = {}  # hash -> ``settled`` when its job settled
        self._bound = bound  # past it the log is read whatever is stored (no refresh otherwise: replays)

    def settle(self, hashes: Iterable[bytes]) -> list[bytes]:
        """A job over ``hashes`` settled (its records are in the log); returns them."""
        hashes = list(hashes)
        self.settled += 1
        self._at.update(dict.fromkeys(hashes, self.settled))
        return hashes

    def must_read(self, hashes: Iterable[bytes]) -> bool:
        """Whether the log must be read before ``hashes`` are stored: one of them is
        named here, or more blocks than ``bound`` are."""
        at = self._at
        return len(at) > self._bound or any(h in at for h in hashes)

    def read_up_to(self, settled: int) -> None:
        """A log read that began when ``settled`` jobs had settled has been applied."""
        self._at = {h: n for h, n in self._at.items() if n > settled}

    def __len__(self) -> int:
        return len(self._at)


def fold_good_writes(pending: dict[bytes, int], hashes: list[bytes], slots: list[int]) -> list[tuple[bytes, int]]:
    """``fold_log`` for the usual case, one rank and only ``ok`` records, with a
    fraction of its per-record work: a record makes its block durable if the block
    still waits for that slot (it leaves ``pending``)."""
    durable = []
    get = pending.get
    for h, slot in zip(hashes, slots):
        if get(h) == slot:
            del pending[h]
            durable.append((h, slot))
    return durable


def fold_log(
    pending: dict[bytes, int],
    progress: dict[bytes, Progress],
    full: int,
    records: tuple[list[bytes], list[int], list[int], list[int]],
    result: RefreshResult,
    *,
    drop_corrupt: Callable[[bytes, int], bool],
    free_failed: Callable[[bytes, int], None],
    settling: dict[int, tuple[bytes, int]] | None = None,
    free_settled: Callable[[bytes, int], None] | None = None,
) -> list[tuple[bytes, int]]:
    """Fold log ``records`` (hashes, statuses, ranks, slots) into ``pending`` (hash ->
    the slot it waits on) and ``progress``, with ``full`` the bitmask of every rank;
    returns the ``(hash, slot)`` pairs that became durable on every rank, in log order.
    ``drop_corrupt(h, slot)`` drops a loadable block found corrupt (True if it was
    loadable from that slot); ``free_failed(h, slot)`` frees the slot of a failed
    store that no rank still writes. ``settling`` (slot -> the hash of the store given
    up there, and the ranks that logged its outcome so far) takes the records of those
    stores; ``free_settled(h, slot)`` frees each once every rank has. Failed and corrupt blocks
    go into ``result``."""
    durable = []
    for h, status, rank, slot in zip(*records):
        if status == LOG_CORRUPT:
            if drop_corrupt(h, slot):
                result.corrupt.append(h)
            continue
        if pending.get(h) != slot:
            if settling and (given_up := settling.get(slot)) is not None and given_up[0] == h:
                reported = given_up[1] | 1 << rank
                if reported & full == full:
                    del settling[slot]
                    assert free_settled is not None
                    free_settled(h, slot)
                else:
                    settling[slot] = (h, reported)
            continue
        ranks, reported, failed = progress.get(h, NO_PROGRESS)
        bit = 1 << rank
        reported |= bit
        if status == LOG_OK and not failed:
            ranks |= bit
            if ranks & full == full:
                del pending[h]
                progress.pop(h, None)
                durable.append((h, slot))
                continue
        elif status == LOG_FAILED and not failed:
            failed = True
            result.failed.append(h)
        if failed and reported & full == full:
            # No rank still writes the slot: free it now. A store planned
            # without a job (the composite's spills and write-through) gets
            # no complete_store to do it.
            del pending[h]
            progress.pop(h, None)
            free_failed(h, slot)
        else:
            progress[h] = Progress(ranks, reported, failed)
    return durable
