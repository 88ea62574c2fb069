"""ARC (adaptive replacement) order for the CPU tier: ``eviction_policy: arc``.

Scheduler process; pure bookkeeping, no I/O. The same manager as
``CPUOffloadingManager`` (slots, pending and pinned blocks, the ``prepare_store``
rules), with another eviction order behind its ``_order_*`` hooks:

- T1 holds blocks used once since they entered (stored, or promoted from disk), T2
  blocks used again (a load, or a ``touch`` after their bytes landed). Each is kept
  least recent first, by slot.
- B1 and B2 remember the hashes of blocks evicted from T1 and T2 (at most
  ``num_slots`` each). Storing a block again that B1 remembers says recency was
  undervalued: the target size of T1 grows; one that B2 remembers shrinks it.
- Eviction takes from T1 while T1 is at or above its target, else from T2, and from
  whichever list still has an evictable block when the preferred one has none.

vLLM 0.33's CPU manager offers the same policy under the same name; a request's head
ranks most recent within its list, as in LRU.

A request ends with its ``touch`` (the driver touches a request's chain once, after its
store is prepared). After that touch's own ranking, the blocks the request used are ranked
once more, head last so it ends most recent, as vLLM re-ranks at a request's end: a block
it only stored (still pending, or landed) keeps its list and moves to that list's most
recent end; a block it read (a load, or offered again once loadable) counts as one use,
T1 to T2. Blocks in the chain it did not use, such as another request's store still in
flight, are ranked by the touch alone, so they end below the request's own blocks.

Blocks that ``cpu_admission`` does not admit yet are in neither list: they go before
both (``CPUOffloadingManager``'s ``_cold``), and leave no ghost when evicted, since
ARC did not choose them. Once admitted a block joins T1 as a new one, and the use
that admitted it moves it to T2 when its request ends.

With ``cpu_retention: session`` a held block that eviction reaches leaves its list
(``_kept``) while its hold lasts; a use puts it back at its list's most recent end, the
end of its hold at its list's least recent end (``CPUOffloadingManager``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from itertools import compress

from tiered_kv.abstract import BlockHash
from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.tiered.retention import SessionRetention


class ARCOffloadingManager(CPUOffloadingManager):
    """``CPUOffloadingManager`` with ARC's eviction order (module docstring)."""

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        enable_events: bool = True,
        admit_after: int = 1,
        admission_history: int | None = None,
        retention: SessionRetention | None = None,
        adaptive: bool = False,
    ):
        super().__init__(num_slots, block_size, enable_events, admit_after, admission_history, retention, adaptive)
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[BlockHash, None] = OrderedDict()
        self._b2: OrderedDict[BlockHash, None] = OrderedDict()
        self.target_t1 = 0.0
        # Blocks used by a request whose touch has not come yet: True once read (a load,
        # or offered again when loadable), False when only stored by it.
        self._awaiting_touch: dict[BlockHash, bool] = {}

    def iter_lru(self) -> Iterator[BlockHash]:
        """Pending and loadable blocks in the order ARC would evict them (if none were
        pinned). Lazy: do not change the manager while iterating."""
        return map(self._occupant, self._arc_order(()))

    def iter_evictable(self, protected: Collection[BlockHash] = ()) -> Iterator[BlockHash]:
        excluded = self._pending.union(self._readers, protected)
        return map(self._occupant, self._arc_order(excluded))

    def _arc_order(self, excluded: Collection[BlockHash], kept: bool = True) -> Iterator[int]:
        """Slots in eviction order, skipping blocks in ``excluded``; those set aside
        last, unless not ``kept``."""
        hash_by_slot = self._hash_by_slot
        yield from (s for s in self._cold if hash_by_slot[s] not in excluded)
        t1 = (s for s in self._t1 if hash_by_slot[s] not in excluded)
        t2 = (s for s in self._t2 if hash_by_slot[s] not in excluded)
        t1_size = len(self._t1)
        while True:
            slot = None
            if t1_size >= int(self.target_t1):
                slot = next(t1, None)
                if slot is not None:
                    t1_size -= 1
            if slot is None:
                slot = next(t2, None)
            if slot is None:
                slot = next(t1, None)
                if slot is None:
                    break
                t1_size -= 1
            yield slot
        if kept:
            yield from (s for s in self._kept if hash_by_slot[s] not in excluded)

    # ---- the hooks ----

    def pin(self, block_hashes: Iterable[BlockHash]) -> None:
        block_hashes = list(block_hashes)
        super().pin(block_hashes)
        self._note_read(block_hashes)

    def rank_request(self, block_hashes: Iterable[BlockHash]) -> None:
        block_hashes = list(block_hashes)
        self._note_read([h for h in block_hashes if self.is_loadable(h)])
        super().rank_request(block_hashes)

    def _note_read(self, block_hashes: list[BlockHash]) -> None:
        """A read of blocks its request did not store itself counts as that request's use."""
        awaiting = self._awaiting_touch
        for block_hash in block_hashes:
            if awaiting.get(block_hash) is not False:
                awaiting[block_hash] = True

    def note_store_misses(self, block_hashes: Iterable[BlockHash]) -> None:
        # Before room is made: which list gives up a block depends on the adapted target.
        for block_hash in reversed(list(block_hashes)):
            self._ghost_hit(block_hash)

    def _order_insert(self, block_hashes: list[BlockHash], slots: list[int]) -> None:
        awaiting = self._awaiting_touch
        for block_hash in reversed(block_hashes):
            self._b1.pop(block_hash, None)
            self._b2.pop(block_hash, None)
            awaiting.setdefault(block_hash, False)
        t1 = self._t1
        for slot in reversed(slots):
            t1[slot] = None

    def _order_cold(self, block_hashes: list[BlockHash], slots: list[int]) -> None:
        for block_hash in block_hashes:
            self._b1.pop(block_hash, None)
            self._b2.pop(block_hash, None)
        super()._order_cold(block_hashes, slots)

    def _order_demote(self) -> None:
        cold = self._cold
        for lst in (self._t1, self._t2):
            ranked = list(lst)
            admitted = self.admission.admits_each(0, list(map(self._occupant, ranked)))
            for slot in compress(ranked, [not a for a in admitted]):
                del lst[slot]
                cold[slot] = None

    def _order_warm(self, slots: list[int]) -> None:
        awaiting, t1 = self._awaiting_touch, self._t1
        for slot in reversed(slots):
            awaiting.setdefault(self._occupant(slot), False)
            t1[slot] = None

    def _order_touch(self, slots: list[int]) -> None:
        self._restore_kept(slots)
        t1, t2, hash_by_slot, pending, cold = self._t1, self._t2, self._hash_by_slot, self._pending, self._cold
        for slot in reversed(slots):
            if cold and slot in cold:
                continue
            if slot in t1 and hash_by_slot[slot] not in pending:
                del t1[slot]
                t2[slot] = None
            elif slot in t2:
                t2.move_to_end(slot)
            else:  # a block still being stored was not used twice
                t1.move_to_end(slot)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        block_hashes = list(block_hashes)
        for block_hash in reversed(block_hashes):
            if block_hash not in self._slot_by_hash:
                self._ghost_hit(block_hash)
        super().touch(block_hashes)
        self._end_request(block_hashes)

    def _end_request(self, block_hashes: list[BlockHash]) -> None:
        """Rank the blocks the touching request used (module docstring), head last."""
        awaiting, slot_by_hash, t1, t2 = self._awaiting_touch, self._slot_by_hash, self._t1, self._t2
        if not awaiting:
            return
        for block_hash in reversed(block_hashes):
            read = awaiting.pop(block_hash, None)
            if read is None:
                continue
            slot = slot_by_hash[block_hash]
            if self._kept and slot in self._kept:
                self._restore_kept([slot])
            if slot in self._cold:
                continue
            if slot in t1:
                if read:
                    del t1[slot]
                    t2[slot] = None
                else:
                    t1.move_to_end(slot)
            else:
                t2.move_to_end(slot)

    def _order_refresh(self, slots: list[int]) -> None:
        self._restore_kept(slots)
        t1, t2, cold = self._t1, self._t2, self._cold
        for slot in reversed(slots):
            if not cold or slot not in cold:
                (t1 if slot in t1 else t2).move_to_end(slot)

    def _release(self, block_hash: BlockHash) -> int:
        self._awaiting_touch.pop(block_hash, None)
        return super()._release(block_hash)

    def _order_release(self, slot: int) -> None:
        if self._kept and self._kept.pop(slot, None) is not None:
            return
        if self._cold.pop(slot, 0) is None or self._t1.pop(slot, 0) is None:
            return
        self._t2.pop(slot, None)

    def _take_victims(self, n: int, protected: Collection[BlockHash]) -> tuple[list[BlockHash], list[int]] | None:
        if self.retention is not None:
            self._set_aside(n, protected)
        excluded = self._pending.union(self._readers, protected)
        slots = []
        for slot in self._arc_order(excluded):
            slots.append(slot)
            if len(slots) == n:
                break
        else:
            return None
        victims = list(map(self._occupant, slots))
        self._restore_kept(slots)  # none, unless nothing else could be evicted
        for block_hash, slot in zip(victims, slots):
            # A block not admitted yet was not ARC's choice to evict: it leaves no ghost.
            if self._cold.pop(slot, 0) is not None:
                ghosts = self._b1 if self._t1.pop(slot, 0) is None else self._b2
                self._t2.pop(slot, None)
                ghosts[block_hash] = None
            self._awaiting_touch.pop(block_hash, None)
            del self._slot_by_hash[block_hash]
            self._hash_by_slot[slot] = None
            self._free.append(slot)
        for ghosts in (self._b1, self._b2):
            for _ in range(len(ghosts) - self._num_slots):
                ghosts.popitem(last=False)
        return victims, slots

    # ---- retention: set-aside slots leave their list and come back to it ----

    def _eviction_slots(self) -> Iterator[int]:
        return self._arc_order((), kept=False)

    def _order_keep(self, slot: int) -> None:
        if self._cold.pop(slot, 0) is None:
            self._kept[slot] = 0
        elif self._t1.pop(slot, 0) is None:
            self._kept[slot] = 1
        else:
            del self._t2[slot]
            self._kept[slot] = 2

    def _order_lapse(self, slot: int, came_from: int) -> None:
        """Back to its list's least recent end (``_cold`` for a block not admitted)."""
        if came_from == 0:
            self._cold[slot] = None
            return
        lst = self._t1 if came_from == 1 else self._t2
        lst[slot] = None
        lst.move_to_end(slot, last=False)

    def _restore_kept(self, slots: Iterable[int]) -> None:
        """Set-aside slots among ``slots`` go back to their list, most recent."""
        kept = self._kept
        if kept:
            for slot in slots:
                came_from = kept.pop(slot, None)
                if came_from is not None:
                    (self._cold, self._t1, self._t2)[came_from][slot] = None

    def _ghost_hit(self, block_hash: BlockHash) -> None:
        """Adapt T1's target to a block that ARC evicted and is wanted again."""
        b1, b2 = self._b1, self._b2
        if block_hash in b1:
            self.target_t1 = min(self.target_t1 + max(1.0, len(b2) / len(b1)), self._num_slots)
            b1.move_to_end(block_hash)
        elif block_hash in b2:
            self.target_t1 = max(self.target_t1 - max(1.0, len(b1) / len(b2)), 0.0)
            b2.move_to_end(block_hash)
