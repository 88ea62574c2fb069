"""CPU-slot health: how workers tell the scheduler that a job left a CPU slot unusable.

Why it exists: vLLM 0.33's worker connector asserts that every transfer succeeded, and
its scheduler always calls ``complete_store``/``complete_load`` with success. Our
worker therefore reports every job as successful, and needs another way to keep a
CPU slot that a failed job was writing (a GPU -> CPU store, or the disk -> CPU half of
a promotion) from ever being served.

The channel is one byte per CPU slot in a small file that the scheduler process and
every worker process of one engine map shared (``/dev/shm`` where it exists, the
temporary directory otherwise; named after vLLM's engine id, which is unique per engine
and data-parallel replica). A worker sets a slot's byte *before* it reports the job, so
by the time all workers have reported and vLLM calls ``complete_*``, the scheduler sees
it; the scheduler reads and clears the bytes of exactly the slots that job wrote (a slot
is written by one job at a time, so nothing else races on it). Any rank failing marks
the slot for all ranks.

Limits: the processes must share a host (as vLLM's own CPU offloading region does).
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path


def _shared_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SlotHealth:
    """One byte per CPU slot, shared by the processes of one engine (module docstring).

    ``num_slots`` must be the same in every process. Opening creates the file if needed
    and never clears it, so the processes may start in any order.
    """

    def __init__(self, path: str | os.PathLike, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.path = Path(path)
        self.num_slots = num_slots
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < num_slots:
                os.ftruncate(fd, num_slots)
            self._map = mmap.mmap(fd, num_slots)
        finally:
            os.close(fd)

    @classmethod
    def for_engine(cls, engine_id: str, num_slots: int) -> "SlotHealth":
        """The health map of engine ``engine_id`` (same file in every process)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:128]
        return cls(_shared_dir() / f"tiered-kv-{safe}-cpu-slot-health", num_slots)

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
