"""LRU manager of the pinned-CPU tier: which block sits in which CPU slot.

Scheduler process; pure bookkeeping, no I/O and no locks (the scheduler calls it from
one thread). The bytes live in the workers' ``HostKVCache``; this class only hands out
slot ids in ``CPULoadStoreSpec``s.

A block is in one of two states: *pending* (reserved by ``prepare_store``/``allocate``,
bytes still in flight, not loadable) or *loadable*. A loadable block carries a read
ref-count (``prepare_load``/``pin``); only loadable blocks with ref-count 0 are
evictable, so a slot is never reused while a transfer still reads or writes it.
Recency is the order of an ``OrderedDict`` of *slots* (free slots first, then the
others from least to most recent); eviction takes the first evictable block after the
free slots. ``ARCOffloadingManager`` (``tiered_kv.cpu.arc``) keeps another order behind
the same hooks (``_order_*``, ``_take_victims``).

Two rules of vLLM's contract shape ``prepare_store``: the blocks offered to one call
are never its eviction victims (evicting one would leave a hole in the request's chain,
with the blocks behind it unreachable by any prefix lookup; the call returns None
instead), and afterwards the request's blocks are the most recent ones, its head
(first block) most recent of all, since a prefix hit needs the head. It is keyed by slot, not by hash, so its key set never changes: a dict
whose keys churn (256 out, 256 in per store) rebuilds itself every ``2 x capacity /
256`` calls or so, and an ``OrderedDict`` rebuild is the slow kind (23 ms at 100k
entries, 212 ms at 1M on the benchmark VM). Only the plain ``hash -> slot`` dict
churns (its rebuild costs 8 and 90 ms there).

Admission (``cpu_admission: reuse(N)``, ``admit_after`` N > 1; with ``adaptive(N)``
only while that rule pays, ``tiered_kv.tiered.admission``): a block enters only
once it has been used N times (offered to a store, or loaded), counted by the
composite's ``WriteAdmission`` rule over a bounded history of recent blocks. Every
lower tier is written from a CPU slot, so a block not admitted yet still takes one
(the store, its events and its lower-tier writes are as without admission), but it
is kept apart, first to evict: those blocks go before any other, oldest first, the
deepest of a request first. A touch leaves them there; once admitted (a later use:
a load, or an offer while it is still here) a block ranks as any other.

Retention (``cpu_retention: session``, ``retention``): a ``SessionRetention``
(``tiered_kv.tiered.retention``) holds returning sessions' latest blocks for their learned
gap. Eviction passes a held block over: it is set aside (``_kept``, where free slots go,
like the blocks not admitted), out of the ranking, until its hold ends (then it goes
first to evict, as the least recent block it was) or a use ranks it again; when nothing
else can be evicted, set-aside blocks are, so holds never keep a store out. With
``adaptive(N)`` the holds are passed over only while the rule is ``honoured`` (its
miniature caches find they pay); when it stops, set-aside blocks go first to evict.

The state is kept in containers of hashes and ints only (``hash -> slot``, ``slot ->
hash``, the set of pending hashes, ``hash -> readers`` for pinned blocks), never one
object per block: a tier of a million blocks adds nothing for Python's cyclic garbage
collector to walk, so the scheduler thread sees no collection pauses that grow with
the tier.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from itertools import chain, compress, filterfalse, islice
from typing import cast

from tiered_kv.abstract import BlockHash, OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiered_kv.tiered.retention import SessionRetention
from tiered_kv.mediums import CPU, CPULoadStoreSpec
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.admission import AdaptiveAdmission, WriteAdmission

#: Blocks the admission history remembers, per CPU slot: a block's second use counts
#: as one only while the first is remembered (the measured choice: tools/replay.py
#: --policies).
ADMISSION_HISTORY_PER_SLOT = 4


def _short(block_hash: BlockHash) -> str:
    return block_hash.hex()[:16] if isinstance(block_hash, (bytes, bytearray)) else repr(block_hash)


class CPUOffloadingManager(OffloadingManager):
    """LRU ``OffloadingManager`` over ``num_slots`` CPU slots.

    ``block_size`` (tokens per offloaded block) only labels events. With
    ``enable_events`` every state change a consumer can see (stored, evicted,
    removed) is reported with medium ``"CPU"`` by ``take_events``. ``admit_after``:
    the uses a block needs before it ranks as any other (1: every block; module
    docstring), remembered for ``admission_history`` blocks (default
    ``ADMISSION_HISTORY_PER_SLOT`` per slot); ``adaptive``: N applies only while
    ``cpu_admission: adaptive(N)``'s miniature caches find it pays
    (``tiered_kv.tiered.admission.AdaptiveAdmission``). ``retention``: ``cpu_retention``'s
    ``SessionRetention``, or None (module docstring).

    Beyond the seed API, the composite manager uses ``num_slots``, ``num_free_slots``,
    ``iter_evictable``, ``evict``, ``missing_among``, ``remove``, ``slot_of``,
    ``is_loadable``, ``in``, ``pin``/``unpin`` and ``allocate``.
    """

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
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        history = ADMISSION_HISTORY_PER_SLOT * num_slots if admission_history is None else admission_history
        #: ``cpu_admission``'s rule; its ``stats`` count the blocks not admitted (``cpu``).
        self.admission = (
            AdaptiveAdmission(admit_after, num_slots, history, TieredStats(), holds=retention)
            if adaptive
            else WriteAdmission([admit_after], ["cpu"], history, TieredStats())
        )
        self._admitting = admit_after > 1
        # Slots of blocks not admitted yet, in eviction order: evicted before any other.
        self._cold: OrderedDict[int, None] = OrderedDict()
        self.retention = retention
        # Slots set aside while held, in the order set aside -> where they came from
        # (0: not admitted; 1: ranked; ARC: 1 T1, 2 T2).
        self._kept: OrderedDict[int, int] = OrderedDict()
        self._num_slots = num_slots
        self.block_size = block_size
        self._slot_by_hash: dict[BlockHash, int] = {}  # pending and loadable blocks
        self._hash_by_slot: list[BlockHash | None] = [None] * num_slots
        #: ``_hash_by_slot[slot]`` for a slot known to be taken (so never None).
        self._occupant = cast("Callable[[int], BlockHash]", self._hash_by_slot.__getitem__)
        # Every slot: the free ones and those in ``_cold`` and ``_kept`` first (in any
        # order), then the others, least recent first.
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self._pending: set[BlockHash] = set()  # reserved, bytes in flight: not loadable
        self._readers: dict[BlockHash, int] = {}  # loadable blocks pinned by loads
        # Popped from the end: slots are first handed out in ascending order, which
        # gives the GPU<->CPU copies long contiguous runs.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._num_evictable = 0
        self._events: list[OffloadingEvent] | None = [] if enable_events else None

    # ---- capacity and introspection ----

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def num_free_slots(self) -> int:
        """Slots holding no block (neither pending nor loadable)."""
        return len(self._free)

    def num_evictable(self) -> int:
        """Loadable blocks with no reader: what ``allocate`` may evict."""
        return self._num_evictable

    def __len__(self) -> int:
        return len(self._slot_by_hash)

    def __contains__(self, block_hash: object) -> bool:
        """True for pending and loadable blocks."""
        return block_hash in self._slot_by_hash

    def missing_among(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """The members of ``block_hashes`` that are neither pending nor loadable here."""
        return list(filterfalse(self._slot_by_hash.__contains__, block_hashes))

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot of a pending or loadable block, else None."""
        return self._slot_by_hash.get(block_hash)

    def slots_of(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        """The slots of pending or loadable blocks; ``KeyError`` for another block."""
        return list(map(self._slot_by_hash.__getitem__, block_hashes))

    def is_loadable(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_by_hash and block_hash not in self._pending

    def iter_lru(self) -> Iterator[BlockHash]:
        """Pending and loadable blocks in eviction order: those not admitted yet, then
        the others least recent first, then those set aside while held. Lazy: do not
        change the manager while iterating."""
        cold, kept = self._cold, self._kept
        rest = map(self._occupant, islice(self._order, len(self._free) + len(cold) + len(kept), None))
        return chain(map(self._occupant, cold), rest, map(self._occupant, kept)) if cold or kept else rest

    def iter_evictable(self, protected: Collection[BlockHash] = ()) -> Iterator[BlockHash]:
        """Unpinned loadable blocks not in ``protected``, in eviction order. Lazy: do
        not change the manager while iterating (collect what you need first)."""
        if not self._pending and not self._readers and not protected:
            return self.iter_lru()
        excluded = self._pending.union(self._readers, protected)
        return filterfalse(excluded.__contains__, self.iter_lru())

    # ---- seed API ----

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        blocks, pending = self._slot_by_hash, self._pending
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in blocks or block_hash in pending:
                break
            hits += 1
        return hits

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> CPULoadStoreSpec:
        block_hashes = list(block_hashes)
        self.note_uses(block_hashes)
        self.pin(block_hashes)
        return CPULoadStoreSpec(self.slots_of(block_hashes))

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """A use of ``block_hashes`` (in request order): the first ends most recent."""
        self._order_touch(self._present_slots(block_hashes))

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        self.unpin(block_hashes)

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """The seed's ``prepare_store``: none of ``block_hashes`` is evicted to make room
        (None, changing nothing, when room cannot be made otherwise); afterwards the
        offered blocks rank most recent, the first of them most recent of all."""
        offered = list(dict.fromkeys(block_hashes))
        self.note_uses(offered)
        blocks = self._slot_by_hash
        new = list(filterfalse(blocks.__contains__, offered))
        evicted: list[BlockHash] = []
        self.note_store_misses(new)
        slots = self._allocate(new, evicted, protected=offered)
        if slots is None:
            return None
        if len(new) < len(offered):
            self.rank_request(offered)
        return PrepareStoreOutput(new, CPULoadStoreSpec(slots), evicted)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Pending blocks among ``block_hashes`` become loadable (``success``) or are
        freed and forgotten. Blocks that are not pending are left alone."""
        pending = self._pending
        done = [block_hash for block_hash in dict.fromkeys(block_hashes) if block_hash in pending]
        pending.difference_update(done)
        if success:
            # Pending blocks have no readers: each one becomes evictable.
            self._num_evictable += len(done)
        else:
            for block_hash in done:
                self._release(block_hash)
        if success and done:
            self._emit(done, removed=False)

    def take_events(self) -> list[OffloadingEvent]:
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # ---- extensions for the composite manager ----

    def pin(self, block_hashes: Iterable[BlockHash]) -> None:
        """Add one reader to each (loadable) block, protecting it from eviction until
        ``unpin``. All or nothing: raises ``KeyError`` naming a block that is not
        loadable, changing nothing."""
        blocks, pending, readers = self._slot_by_hash, self._pending, self._readers
        block_hashes = list(block_hashes)
        for block_hash in block_hashes:
            if block_hash not in blocks or block_hash in pending:
                raise KeyError(f"block {_short(block_hash)} is not loadable in the CPU tier")
        for block_hash in block_hashes:
            n = readers.get(block_hash, 0)
            if n == 0:
                self._num_evictable -= 1
            readers[block_hash] = n + 1
        if self._cold:
            self._warm_admitted(block_hashes)

    def unpin(self, block_hashes: Iterable[BlockHash]) -> None:
        """Drop one reader from each block. All or nothing: raises ``ValueError``
        naming a block that is unknown or has no reader, changing nothing."""
        block_hashes = list(block_hashes)
        readers = self._readers
        needed = Counter(block_hashes)
        for block_hash, n in needed.items():
            if readers.get(block_hash, 0) < n:
                raise ValueError(
                    f"unpin/complete_load of block {_short(block_hash)} that "
                    f"is not pinned (unknown, or more releases than pins)"
                )
        for block_hash, n in needed.items():
            left = readers[block_hash] - n
            if left:
                readers[block_hash] = left
            else:
                del readers[block_hash]
                self._num_evictable += 1

    def note_uses(
        self, block_hashes: Iterable[BlockHash], session: Hashable | None = None, request: Hashable | None = None
    ) -> None:
        """A use of each block (offered to a store, or loaded), as ``cpu_admission``
        counts them and ``cpu_retention`` learns sessions from them (of ``session``
        where the engine names it, by ``request`` where named: ``SessionRetention.observe``).
        The seed API calls it itself; the composite calls it for its own ``prepare_store``
        and ``prepare_load``."""
        if self._admitting or self.retention is not None:
            block_hashes = list(block_hashes)
            if self._admitting:
                admission = self.admission
                was_in_force = admission.in_force(0)
                admission.note(block_hashes)
                if not was_in_force and admission.in_force(0):
                    self._order_demote()
            if self.retention is not None:
                self.retention.observe(block_hashes, session, request)

    def note_store_misses(self, block_hashes: Iterable[BlockHash]) -> None:
        """``block_hashes`` (absent here) are about to be stored or promoted, before room
        is made for them. LRU ignores it; ARC adapts its target to blocks it evicted
        earlier, as vLLM's ARC does on a store miss."""

    def rank_request(self, block_hashes: Iterable[BlockHash]) -> None:
        """Rank a stored request's blocks (in request order) most recent, the first
        most recent of all, without counting it as a use (ARC keeps them where they
        are in its lists). Blocks not admitted yet stay first to evict unless admitted
        now."""
        if self._cold:
            block_hashes = list(block_hashes)
            self._warm_admitted(block_hashes)
        self._order_refresh(self._present_slots(block_hashes))

    def allocate(
        self,
        block_hashes: list[BlockHash],
        evicted: list[BlockHash] | None = None,
        *,
        checked: bool = True,
        protected: Collection[BlockHash] = (),
        admit: bool = False,
    ) -> list[int] | None:
        """Reserve one slot per hash in ``block_hashes`` (distinct, none already here),
        evicting unpinned blocks not in ``protected`` in eviction order as needed. The
        new blocks are pending and most recent, the first most recent of all (those
        ``cpu_admission`` does not admit yet first to evict, unless ``admit``: blocks
        prefetched for a load to come). Returns their slots in order, or None,
        changing nothing, when free plus evictable slots are too few. Evicted hashes are
        appended to ``evicted`` and reported in a removed event. ``checked=False`` skips
        verifying that the hashes are distinct and absent, for a caller that just
        established it (``missing_among`` on a deduplicated list)."""
        block_hashes = list(block_hashes)
        if checked:
            blocks = self._slot_by_hash
            if not blocks.keys().isdisjoint(block_hashes):
                block_hash = next(h for h in block_hashes if h in blocks)
                raise ValueError(f"allocate: block {_short(block_hash)} is already in the CPU tier")
            if len(set(block_hashes)) != len(block_hashes):
                raise ValueError("allocate: block_hashes contains duplicates")
        return self._allocate(block_hashes, evicted, protected=protected, admit=admit)

    def evict(self, n: int, protected: Collection[BlockHash] = ()) -> tuple[list[BlockHash], list[int]] | None:
        """Drop ``n`` evictable blocks not in ``protected``, in eviction order (least
        recent first), report them removed, and return them with their (now free)
        slots; None, changing nothing, if fewer than ``n`` qualify."""
        if n > self._num_evictable:
            return None
        taken = self._take_victims(n, protected)
        if taken is None:
            return None
        self._num_evictable -= n
        self._emit(taken[0], removed=True)
        return taken

    def _allocate(
        self,
        block_hashes: list[BlockHash],
        evicted: list[BlockHash] | None,
        protected: Collection[BlockHash] = (),
        admit: bool = False,
    ) -> list[int] | None:
        """``allocate`` for hashes known to be new and distinct."""
        need = len(block_hashes) - len(self._free)
        if need > self._num_evictable:
            return None
        free, hash_by_slot = self._free, self._hash_by_slot
        if need > 0:
            taken = self.evict(need, protected)
            if taken is None:
                return None
            if evicted is not None:
                evicted.extend(taken[0])
        slots = free[len(free) - len(block_hashes) :][::-1]
        del free[len(free) - len(block_hashes) :]
        self._slot_by_hash.update(zip(block_hashes, slots))
        for block_hash, slot in zip(block_hashes, slots):
            hash_by_slot[slot] = block_hash
        self._pending.update(block_hashes)
        if self._admitting and not admit:
            admitted = self.admission.admitted(0, block_hashes)
            if len(admitted) < len(block_hashes):
                self._insert_split(block_hashes, slots, set(admitted))
                return slots
        self._order_insert(block_hashes, slots)
        return slots

    def _insert_split(self, block_hashes: list[BlockHash], slots: list[int], admitted: set[BlockHash]) -> None:
        """Rank new blocks: the ``admitted`` ones most recent, the others first to evict."""
        pairs = list(zip(block_hashes, slots))
        warm = [(h, s) for h, s in pairs if h in admitted]
        if warm:
            self._order_insert([h for h, _ in warm], [s for _, s in warm])
        self._order_cold([h for h, _ in pairs if h not in admitted], [s for h, s in pairs if h not in admitted])

    def _warm_admitted(self, block_hashes: list[BlockHash]) -> None:
        """Blocks kept first to evict that ``cpu_admission`` admits now (at their Nth
        use) leave that place and rank as any other block from here on."""
        cold, get, admits = self._cold, self._slot_by_hash.get, self.admission.admits
        slots = [s for h in block_hashes if (s := get(h)) is not None and s in cold and admits(0, h)]
        for slot in slots:
            del cold[slot]
        if slots:
            self._order_warm(slots)

    def remove(self, block_hash: BlockHash) -> int:
        """Drop an unpinned loadable block, report it removed, and return its (now
        free) slot. Raises ``KeyError`` if the block is not loadable, ``ValueError``
        if it is pinned."""
        if block_hash not in self._slot_by_hash or block_hash in self._pending:
            raise KeyError(f"remove: block {_short(block_hash)} is not loadable in the CPU tier")
        if block_hash in self._readers:
            raise ValueError(f"remove: block {_short(block_hash)} is pinned by {self._readers[block_hash]} reader(s)")
        slot = self._release(block_hash)
        self._num_evictable -= 1
        self._emit([block_hash], removed=True)
        return slot

    # ---- internals ----

    def _present_slots(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        get = self._slot_by_hash.get
        return [slot for slot in map(get, block_hashes) if slot is not None]

    def _release(self, block_hash: BlockHash) -> int:
        """Forget ``block_hash`` and free its slot."""
        slot = self._slot_by_hash.pop(block_hash)
        self._hash_by_slot[slot] = None
        self._order_release(slot)
        self._free.append(slot)
        return slot

    # ---- the eviction order (LRU here; ARC overrides these) ----

    def _order_insert(self, block_hashes: list[BlockHash], slots: list[int]) -> None:
        """New blocks (in request order) enter as the most recent, the first most recent
        of all: it is what later prefix hits need, and the tail is useless without it."""
        to_end = self._order.move_to_end
        for slot in reversed(slots):
            to_end(slot)

    def _order_touch(self, slots: list[int]) -> None:
        """A use of the blocks in ``slots`` (request order): the first ends most recent.
        Blocks not admitted yet stay first to evict; a block set aside, or first to
        evict since its hold ended, ranks again."""
        to_end, cold, kept = self._order.move_to_end, self._cold, self._kept
        for slot in reversed(slots):
            if kept and slot in kept:
                if kept.pop(slot) == 0:
                    cold[slot] = None
                    continue
            elif cold and slot in cold:
                if self._admitting:
                    continue
                del cold[slot]
            to_end(slot)

    _order_refresh = _order_touch  # for LRU, ranking a request is a use

    def _order_cold(self, block_hashes: list[BlockHash], slots: list[int]) -> None:
        """New blocks not admitted (request order) go first to evict, after those kept
        there before; the deepest of them first, since a prefix hit needs the head.
        Their slots stay where the free ones are in ``_order``."""
        cold = self._cold
        for slot in reversed(slots):
            cold[slot] = None

    def _order_demote(self) -> None:
        """``cpu_admission: adaptive(N)`` turned ``reuse(N)`` on: the ranked blocks it does
        not admit go first to evict, least recent first, as if it had been on when they
        were stored (else they would outlive every block stored after, since those not
        admitted are evicted first)."""
        order, cold = self._order, self._cold
        ranked = list(islice(order, len(self._free) + len(cold) + len(self._kept), None))
        admitted = self.admission.admits_each(0, list(map(self._occupant, ranked)))
        to_front = order.move_to_end
        for slot in compress(ranked, [not a for a in admitted]):
            to_front(slot, False)
            cold[slot] = None

    def _order_warm(self, slots: list[int]) -> None:
        """Slots just taken out of ``_cold`` join the ranked ones, most recent."""
        self._order_touch(slots)

    def _order_release(self, slot: int) -> None:
        """``slot`` was freed (not evicted): it joins the free ones, in front."""
        self._order.move_to_end(slot, last=False)
        if self._cold:
            self._cold.pop(slot, None)
        if self._kept:
            self._kept.pop(slot, None)

    def _take_victims(self, n: int, protected: Collection[BlockHash]) -> tuple[list[BlockHash], list[int]] | None:
        """Free the first ``n`` evictable blocks not in ``protected`` in eviction order
        (the caller checked that ``n`` are evictable): their hashes and slots, or None,
        changing nothing, when ``protected`` leaves fewer than ``n``."""
        slot_by_hash, hash_by_slot, free = self._slot_by_hash, self._hash_by_slot, self._free
        pending, readers = self._pending, self._readers
        # Usually the n slots right after the free ones: in-flight stores are the most
        # recent blocks, pinned ones were just looked up, and a request's own blocks
        # were ranked most recent when it was stored.
        # Blocks not admitted go first; their slots are already where free slots go.
        if self.retention is not None:
            self._set_aside(n, protected)
        cold = self._cold
        taken_cold = min(n, len(cold))
        front = len(free) + len(cold) + len(self._kept)
        slots = list(islice(self._order, front, front + n - taken_cold))  # already where free slots go
        if taken_cold:
            slots[:0] = islice(cold, taken_cold)
        victims = list(map(self._occupant, slots))
        if (
            len(slots) == n
            and (not pending or pending.isdisjoint(victims))
            and (not readers or readers.keys().isdisjoint(victims))
            and (not protected or set(protected).isdisjoint(victims))
        ):
            for _ in range(taken_cold):
                cold.popitem(last=False)
            for block_hash in victims:
                del slot_by_hash[block_hash]
            for slot in slots:
                hash_by_slot[slot] = None
            free.extend(slots)
            return victims, slots
        victims = list(islice(self.iter_evictable(protected), n))
        if len(victims) < n:
            return None
        return victims, list(map(self._release, victims))

    # ---- retention (``cpu_retention``) ----

    def _set_aside(self, n: int, protected: Collection[BlockHash]) -> None:
        """Blocks set aside whose hold ended go first to evict again; held blocks among
        the next ``n`` victims (none of ``protected``) are set aside."""
        retention, kept, occupant = cast(SessionRetention, self.retention), self._kept, self._occupant
        retention.refresh()
        ended = retention.take_ended()
        honoured = retention.honoured  # ``adaptive(N)`` may find that holds cost hits
        if kept:
            get = self._slot_by_hash.get
            if not honoured or ended is None:
                slots = list(kept)
            else:
                slots = [s for h in ended if (s := get(h)) is not None and s in kept]
            for slot in dict.fromkeys(slots):  # a hold may end twice (held again between)
                if not honoured or not retention.holds(occupant(slot)):
                    self._order_lapse(slot, kept.pop(slot))
        if not honoured or not retention.num_held():
            return
        holds, pending, readers = retention.holds, self._pending, self._readers
        if protected and not isinstance(protected, (set, frozenset)):
            protected = set(protected)
        held, found = [], 0
        for slot in self._eviction_slots():
            block_hash = occupant(slot)
            if holds(block_hash):
                held.append(slot)
            elif block_hash not in pending and block_hash not in readers and block_hash not in protected:
                found += 1
                if found == n:
                    break
        for slot in held:
            self._order_keep(slot)

    def _eviction_slots(self) -> Iterator[int]:
        """Taken slots not set aside, in eviction order (pinned and pending included)."""
        front = len(self._free) + len(self._cold) + len(self._kept)
        return chain(self._cold, islice(self._order, front, None))

    def _order_keep(self, slot: int) -> None:
        """Set a held block's slot aside: out of the ranking, where free slots go."""
        if self._cold.pop(slot, 0) is None:
            self._kept[slot] = 0
        else:
            self._order.move_to_end(slot, last=False)
            self._kept[slot] = 1

    def _order_lapse(self, slot: int, came_from: int) -> None:
        """A set-aside block's hold ended: it goes first to evict (it was the least
        recent when set aside, and no use has ranked it since)."""
        self._cold[slot] = None

    def _emit(self, block_hashes: list[BlockHash], removed: bool) -> None:
        if self._events is not None and block_hashes:
            self._events.append(OffloadingEvent(block_hashes, self.block_size, CPU, removed))
