"""The scheduler-side contract: what an offloading manager promises.

Runs in the scheduler process. Nothing here moves bytes or does I/O; a manager
only tracks where blocks live and hands the worker specs that say where to read
or write them.

The primitives (kept from vLLM's kv_offload seed API):

- ``lookup()``: length of the leading run of blocks that are offloaded and loadable.
- ``prepare_load()``: pin blocks against eviction and say where to read them.
- ``touch()``: mark blocks recently used (also for blocks the GPU prefix cache served).
- ``complete_load()``: unpin blocks pinned by ``prepare_load``.
- ``prepare_store()``: choose where new blocks go (evicting if needed) or return None.
- ``complete_store()``: make stored blocks loadable, or free them on failure.
- ``take_events()``: stored/removed notifications, each naming its medium.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

#: A block's identity: the engine's prefix hash of the block's tokens. Bytes, because
#: the disk tier persists it as an LMDB key (at most 511 bytes).
BlockHash = bytes


class LoadStoreSpec(ABC):
    """Where a worker finds (or puts) blocks of KV data on one medium."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium this spec addresses, e.g. ``"GPU"``, ``"CPU"``, ``"DISK"``."""


@dataclass
class PrepareStoreOutput:
    """Answer to ``prepare_store``.

    ``block_hashes_to_store``: the subset of the requested blocks that must be written
    (blocks already offloaded are left out). ``store_spec``: where to write them, in
    the same order. ``block_hashes_evicted``: blocks that left the offloaded set to
    make room (for a multi-tier manager: blocks that left the whole hierarchy).
    """

    block_hashes_to_store: list[BlockHash]
    store_spec: LoadStoreSpec
    block_hashes_evicted: list[BlockHash]


@dataclass
class OffloadingEvent:
    """Blocks that became loadable (``removed=False``) or stopped being loadable
    (``removed=True``) on ``medium``. ``block_size`` is in tokens."""

    block_hashes: list[BlockHash]
    block_size: int
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """Tracks offloaded blocks and decides eviction. Scheduler process; no I/O that blocks."""

    @abstractmethod
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """Return the length of the longest leading run of ``block_hashes`` that are
        offloaded and loadable now. A block being stored does not count."""

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin the given (loadable) blocks until ``complete_load`` and return where to
        read them, in the given order. Raises ``KeyError`` naming a block that is
        not loadable."""

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Mark the blocks as most recently used, the first one most recent of all: a
        request's head is what later prefix hits need, and its tail is useless without
        it (vLLM's LRU orders them the same way). Unknown blocks are ignored."""
        return

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Unpin blocks pinned by ``prepare_load`` (once per ``prepare_load``).

        ``success`` (an extension of the seed API) says whether the load job succeeded;
        a manager that also lands loaded blocks in a faster tier (promotion) must not
        make them loadable there after a failed load."""
        return

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Reserve space for the blocks not yet offloaded, evicting unpinned blocks
        (LRU by default) if needed. Reserved blocks are pinned and not loadable until
        ``complete_store``. Returns None, changing nothing, when they cannot all fit."""

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Finish a ``prepare_store``: on success the blocks become loadable; on
        failure the blocks still pending are freed and forgotten."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Return the events collected since the last call (and forget them)."""
        return ()

    def shutdown(self) -> None:
        """Release resources (threads, files, index handles). Idempotent."""
        return
