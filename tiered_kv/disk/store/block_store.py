"""What the disk tier's handlers need of a block store, as named types.

``BlockStore`` is implemented by ``DiskStore`` (the store in the worker process) and by
``DiskIOProcess`` (the same store run in a helper process, ``disk_io: process``); the
handlers (``tiered_kv.disk.worker.handlers``), the stager and the warm-up take either. A store
hands out one batch per job: a ``WriteBlockBatch`` writes runs of blocks with their
checksums, a ``BlockBatch`` reads them and verifies them against those.

Worker process; these are interfaces only, no I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # annotations only: the slot views live with the host memory
    from tiered_kv.memory.slot_views import SlotViews


class BlockBatch(Protocol):
    """One job's blocks in one rank's file: ``hashes[i]`` in disk slot ``slots[i]``."""

    def submit(self, start: int, rows: torch.Tensor, host_rows: torch.Tensor | None = None) -> Future | None:
        """Write (or read into) blocks ``start ..`` from ``rows`` (uint8, one block per
        row); ``host_rows``: host rows holding the same bytes, for checksums of device
        rows. The future is done once ``rows`` may be reused; None if the batch failed."""

    def submit_slots(self, start: int, views: SlotViews, slots: Sequence[int]) -> Future | None:
        """Move CPU-tier slots ``slots`` (the host cache's ``views``) as blocks ``start ..``."""

    def wait_idle(self) -> None:
        """Wait until no submitted I/O still uses its rows."""

    def finish(self) -> list[bool]:
        """Wait for every block; per-block success (a read: present and verified)."""


class WriteBlockBatch(BlockBatch, Protocol):
    """A ``BlockBatch`` that writes: its blocks become loadable once ``finish`` says so,
    and one that cannot be completed is abandoned rather than left half-written."""

    def abandon(self, e: BaseException) -> None:
        """Fail the batch because of ``e`` (raised while producing its rows): no further
        ``submit`` is accepted, and ``finish`` reports every block failed and logs them
        failed in the index."""

    def finish_async(self) -> Future[list[bool]]:
        """``finish`` as a future (done once the blocks' index commit settled)."""


class BlockStore(Protocol):
    """A namespace's blocks, opened by one worker for one or more ranks."""

    slot_size: int
    block_bytes: int
    tp_size: int
    checksum_name: str
    backend: Any  # the I/O backend (``gds`` says whether GPU memory goes straight to disk)

    def begin_write(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> WriteBlockBatch:
        """A batch that stores ``hashes`` into ``slots``: loadable once ``finish`` says so."""

    def begin_read(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> BlockBatch:
        """A batch that loads and verifies ``hashes`` from ``slots``."""

    def write_blocks(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int], data: torch.Tensor) -> list[bool]:
        """``begin_write``, one ``submit`` of ``data`` and ``finish``."""

    def read_blocks(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int], out: torch.Tensor) -> list[bool]:
        """``begin_read``, one ``submit`` into ``out`` and ``finish``."""

    def log_failed(self, rank: int, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """Record in the index that writes of ``hashes`` into ``slots`` will not happen (a
        stager dropped them), so the scheduler releases those pending slots."""

    def takes_slots(self, views: SlotViews) -> bool:
        """Whether batches can move these CPU-tier slots where they lie (no staging)."""

    def host_buffer(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        """Host memory that ``submit`` accepts as rows."""

    def close(self) -> None:
        """Release the store (idempotent)."""
