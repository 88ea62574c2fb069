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

``LowerTier`` is what the composite manager (``tiered_kv.tiered.manager``) needs of
each tier below the CPU tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable


#: A block's identity: the engine's prefix hash of the block's tokens. Bytes, because
#: the disk tier persists it as an LMDB key (at most 511 bytes).
BlockHash = bytes

_Owner = TypeVar("_Owner", bound="Closing")


class Closing:
    """A resource owner (threads, files, mappings, index handles) as a context manager:
    ``with Owner(...) as owner:`` ends with ``owner.close()``, on success or error.
    ``close()`` defaults to ``shutdown()``, the seed contract's name for it, so managers,
    handlers and workers answer to both; a class that owns a ``close()`` overrides it."""

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the resources: ``shutdown()`` unless the class defines its own."""
        self.shutdown()

    def shutdown(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not define shutdown()")


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


class OffloadingManager(Closing, ABC):
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


@runtime_checkable
class LowerTier(Protocol):
    """What the composite manager needs of a tier below the first (CPU) one: the disk
    tier, a second disk tier, the shared tier, or any ``tiered_kv.tiers.TierSpec``'s
    manager. Scheduler process; every call is
    bookkeeping (the tier's bytes move in the workers), and none may block on I/O.

    A block in a lower tier is *pending* (reserved by ``prepare_store``, bytes on their
    way: not loadable, but as good as present for the cascade) or *loadable*. Pending
    blocks become loadable when the workers' writes are durable, which the tier learns
    on its own (``refresh``), or by ``complete_store``.
    """

    #: The tier's name in stats and transfer types (``"disk"``: ``cpu_to_disk``, ...).
    name: str
    #: The medium its events and ``hit_medium`` name (``"DISK"``).
    medium: str
    #: Called with the blocks a refresh dropped because a worker found them corrupt.
    on_corrupt: Callable[[list[BlockHash]], None] | None
    #: Whether the tier's workers run queued reads before queued writes (the disk tier's
    #: I/O pool), so that a load waits for the loads ahead of it, not for the writes.
    reads_first: bool

    @property
    def capacity(self) -> int:
        """Blocks the tier holds at most."""

    def num_free_slots(self) -> int:
        """Slots neither loadable nor pending."""

    def is_loadable(self, block_hash: BlockHash) -> bool:
        """Whether a load may read the block from this tier now."""

    def is_pending(self, block_hash: BlockHash) -> bool:
        """Whether a write of the block into this tier is on its way."""

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot of a loadable block, else None."""

    def absent_among(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """The members of ``block_hashes`` neither loadable nor pending here, in order."""

    def prepare_store(
        self, block_hashes: Iterable[BlockHash], *, fresh: bool = False, protected: Container[BlockHash] = ()
    ) -> PrepareStoreOutput | None:
        """Reserve slots (pending) for the absent ones among ``block_hashes``, evicting
        neither those nor ``protected``; None, changing nothing, when room cannot be
        made. ``fresh``: the caller knows the hashes are distinct and absent."""

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Pending blocks become loadable (``success``) or are released."""

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin loadable blocks against eviction; where to read them (slots)."""

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Unpin blocks pinned by ``prepare_load``; ``success=False``: their load failed
        (the tier may doubt what it holds of them)."""

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """A use, in request order: the first ends most recent."""

    def remove(self, block_hash: BlockHash) -> bool:
        """Drop a loadable unpinned block; False if it is pinned."""

    def iter_evictable(self) -> Iterator[BlockHash]:
        """Loadable unpinned blocks in eviction order."""

    def num_pending(self) -> int:
        """Blocks whose write the tier has not seen land yet."""

    def pending_blocks(self) -> set[BlockHash]:
        """Those blocks (a copy)."""

    def refresh(self) -> object:
        """Fold in the outcomes of writes the workers finished."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored/removed events since the last call, with this tier's medium."""

    def shutdown(self) -> None:
        """Release the tier's threads and handles. Idempotent."""


@runtime_checkable
class AbandonsStores(Protocol):
    """A lower tier that can give up pending stores whose writes some rank may still make
    (the job failed on another rank, or a cache reset abandoned it), and wait for every
    rank's outcome before it reuses their slots (the disk tier). A tier without it is
    told ``complete_store(success=False)``."""

    def abandon_store(self, block_hashes: Iterable[BlockHash]) -> None:
        """Never make these pending blocks loadable; free each slot once no rank writes it."""
