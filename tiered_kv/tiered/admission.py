"""Admission by reuse: ``write_admission: all | reuse(N)`` per lower tier, and
``cpu_admission: all | reuse(N) | adaptive(N)`` for the CPU tier.

Scheduler process, inside the composite manager (and the CPU tier's manager); no I/O.
A block is written into a lower tier with ``admit_after`` N > 1 only once it has been
stored or hit N times, counted over a bounded history of recent blocks (the oldest
forgotten first), so a block used once costs no lower-tier write. The CPU tier uses
the same rule to rank a block it does not admit yet first to evict
(``tiered_kv.cpu.manager``).

``adaptive(N)`` (``AdaptiveAdmission``) picks between ``all`` and ``reuse(N)`` as it
goes: two miniature caches, each ``1/rate`` of the tier's size, run the two rules over
the uses of a ``1/rate`` sample of block hashes (a spatially sampled simulation: its hit
rate tracks a full-size cache's), and the tier follows whichever hit more over the
recent uses. Which rule wins depends on the tier's size and the traffic (``reuse(2)``
wins on Mooncake's traces at 3M tokens, loses at 10M and on agentic sessions whose
newest blocks come back once, after a tool's gap): a fixed choice is wrong somewhere.
The same holds for ``cpu_retention: session``'s holds, so with a retention rule two more
miniatures run the two rules passing held blocks over, and the tier honours the holds
only while they pay (``AdaptiveAdmission``).
"""

from __future__ import annotations

import zlib
from collections import Counter, OrderedDict
from collections.abc import Container, Sequence
from typing import Protocol

from tiered_kv.abstract import BlockHash
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.retention import SessionRetention


class WriteAdmission:
    """Uses per recent block and the admission rule per lower tier.

    ``admit_after[i]``: the stores-or-hits lower tier ``i`` (named ``names[i]``) needs
    before it takes a block (1: every block). ``bound``: blocks remembered at most; a
    use is remembered until ``bound / 2`` to ``bound`` other blocks were used after it
    (two generations of counters: a third of the cost per use of one ordered history).
    Blocks turned away are counted in ``stats`` as the tier's ``not_admitted``."""

    def __init__(self, admit_after: Sequence[int], names: Sequence[str], bound: int, stats: TieredStats):
        if len(admit_after) != len(names) or any(not isinstance(n, int) or n < 1 for n in admit_after):
            raise ValueError(
                f"admit_after: expected an int >= 1 per lower tier ({len(names)}), got {list(admit_after)!r}"
            )
        self.admit_after = tuple(admit_after)
        self.names = tuple(names)
        self.bound = max(1, bound)
        self.stats = stats
        self._counting = any(n > 1 for n in admit_after)
        self._recent: Counter[BlockHash] = Counter()
        self._older: Counter[BlockHash] = Counter()
        self._cpu_only: set[BlockHash] = set()

    def hold_in_cpu(self, block_hashes: Sequence[BlockHash]) -> None:
        """No lower tier takes these blocks (being stored in CPU) by a write-through or a
        spill, whatever the rule, until ``forget``: KV whose key does not name all that
        made it (a LoRA adapter's, keyed by the adapter's name and path, not its weights)
        must not outlive this process in a persistent tier."""
        self._cpu_only.update(block_hashes)

    def forget(self, block_hashes: Sequence[BlockHash]) -> None:
        """These blocks left the CPU tier (evicted, or their store failed)."""
        if self._cpu_only:
            self._cpu_only.difference_update(block_hashes)

    def cpu_only(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` is held in CPU (``hold_in_cpu``)."""
        return block_hash in self._cpu_only

    def note(self, block_hashes: Sequence[BlockHash]) -> None:
        """A store or a hit of each block."""
        if not self._counting:
            return
        recent = self._recent
        recent.update(block_hashes)  # counted in C: the scheduler calls this per stored block
        if 2 * len(recent) >= self.bound:
            self._older, self._recent = recent, Counter()

    def uses(self, block_hash: BlockHash) -> int:
        """The stores and hits of ``block_hash`` remembered."""
        return self._recent.get(block_hash, 0) + self._older.get(block_hash, 0)

    def in_force(self, i: int) -> bool:
        """Whether tier ``i``'s rule turns any block away now."""
        return self.admit_after[i] > 1

    def admits(self, i: int, block_hash: BlockHash) -> bool:
        """Whether tier ``i`` takes ``block_hash`` now; counts nothing."""
        n = self.admit_after[i]
        return n <= 1 or self.uses(block_hash) >= n

    def admits_each(self, i: int, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """``admits`` for each of ``block_hashes``, in order; counts nothing."""
        n = self.admit_after[i]
        if n <= 1 or not self.in_force(i):
            return [True] * len(block_hashes)
        recent, older = self._recent.get, self._older.get
        return [recent(h, 0) + older(h, 0) >= n for h in block_hashes]

    def admitted(self, i: int, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """The members of ``block_hashes`` lower tier ``i`` takes now, in order (never
        one held in CPU)."""
        n = self.admit_after[i]
        if self._cpu_only and block_hashes:
            block_hashes = [h for h in block_hashes if h not in self._cpu_only]
        if n <= 1 or not block_hashes:
            return block_hashes
        recent, older = self._recent.get, self._older.get
        admitted = [h for h in block_hashes if recent(h, 0) + older(h, 0) >= n]
        self.stats.count(self.names[i], "not_admitted", len(block_hashes) - len(admitted))
        return admitted


#: A miniature cache holds at least this many blocks, so its hit rate is not noise; the
#: sampling rate is the tier's slots over this, within 1-64.
MINIATURE_SLOTS = 512
MAX_SAMPLING_RATE = 64
#: Sampled uses a miniature remembers a block's uses for, in miniature sizes.
USE_HISTORY = 4
#: Sampled uses over which a miniature's hits count, in miniature sizes: long enough to
#: hold a block's reuse at the tier's size, short enough to follow a change of traffic.
SCORE_WINDOW = 4
#: Holds stop being honoured only while the best miniature without them hits this share
#: more than the best one with them, and are honoured again once a held one hits as much:
#: the configured rule stays unless the evidence against it is clear, and the tier does
#: not flap between two near-equal choices.
HOLDS_MARGIN = 0.02


class Holds(Protocol):
    """What a miniature cache asks of a retention rule (``SessionRetention`` is one): the
    blocks held now (a live view) and how many holds have ended so far."""

    ends: int

    @property
    def held_blocks(self) -> Container[BlockHash]: ...


class MiniatureCache:
    """Hashes only: an LRU cache of ``capacity`` blocks that ranks a block first to evict
    until a use of it is ``admitted`` (as the CPU tier does; the caller counts the uses,
    once for every miniature). With ``holds`` (a retention rule), eviction passes held
    blocks over as the CPU tier does: they are set aside, held blocks go only when
    nothing else can, and once holds have ended (``holds.ends`` moved) every block set
    aside that is no longer held goes first to evict, as the tier lapses them. A block
    set aside stays only while held: letting ended holds out one eviction at a time
    would keep them longer than the tier does, and rate the holds worse than they are."""

    def __init__(self, capacity: int, holds: Holds | None = None):
        self.capacity = max(1, capacity)
        self._holds = holds
        self._held: Container[BlockHash] = () if holds is None else holds.held_blocks
        self._ends = 0 if holds is None else holds.ends
        self._warm: OrderedDict[BlockHash, None] = OrderedDict()
        self._cold: OrderedDict[BlockHash, None] = OrderedDict()
        self._aside: OrderedDict[BlockHash, None] = OrderedDict()

    def use(self, block_hash: BlockHash, admitted: bool = True) -> bool:
        """A use of ``block_hash``: whether it was cached; it is cached after, ranked
        first to evict unless ``admitted``."""
        warm, cold = self._warm, self._cold
        if block_hash in warm:
            warm.move_to_end(block_hash)
            return True
        if (holds := self._holds) is not None:
            return self._use_holding(block_hash, admitted, holds)
        hit = block_hash in cold
        if hit:
            if not admitted:
                return True
            del cold[block_hash]
        (warm if admitted else cold)[block_hash] = None
        if len(warm) + len(cold) > self.capacity:
            (cold if cold else warm).popitem(last=False)
        return hit

    def _use_holding(self, block_hash: BlockHash, admitted: bool, holds: Holds) -> bool:
        """``use`` of a block not in the warm list, eviction passing held blocks over."""
        warm, cold, aside, held = self._warm, self._cold, self._aside, self._held
        hit = block_hash in cold or block_hash in aside
        if hit:
            if block_hash in cold and not admitted:
                return True
            cold.pop(block_hash, None)
            aside.pop(block_hash, None)  # a use ranks it again
        (warm if admitted else cold)[block_hash] = None
        if len(warm) + len(cold) + len(aside) > self.capacity:
            if aside and holds.ends != self._ends:
                self._ends = holds.ends
                for lapsed in [b for b in aside if b not in held]:
                    del aside[lapsed]
                    cold[lapsed] = None  # after the blocks not admitted, as the tier ranks them
            for ranked in (cold, warm):
                while ranked:
                    victim = ranked.popitem(last=False)[0]
                    if victim not in held:
                        return hit
                    aside[victim] = None
            aside.popitem(last=False)  # nothing but held blocks
        return hit

    def __len__(self) -> int:
        return len(self._warm) + len(self._cold) + len(self._aside)


class AdaptiveAdmission(WriteAdmission):
    """``cpu_admission: adaptive(N)``: ``reuse(N)`` while its miniature cache hits more than
    ``all``'s over the recent sampled uses, else ``all`` (module docstring). ``capacity``:
    the tier's slots. ``reuse_chosen`` says which rule is in force; ``stats`` counts each
    switch (``cpu``'s ``admission_switches``).

    With ``holds`` (``cpu_retention: session``'s rule) it also decides whether the tier
    honours the holds: two more miniatures run each admission rule with eviction passing
    held blocks over. The tier stops honouring the holds while the best miniature without
    them hits ``HOLDS_MARGIN`` more than the best with them, and honours them again once
    a held one hits as much (the rule's ``honoured``, each change counted as its
    ``switches``); ``reuse(N)`` or ``all`` is then chosen within the pair in force. Holds pay where
    sessions come back within their gap and the blocks they push out would not; where
    other traffic comes back sooner (a RAG corpus beside chats) they cost hits."""

    def __init__(
        self,
        admit_after: int,
        capacity: int,
        bound: int,
        stats: TieredStats,
        holds: SessionRetention | None = None,
    ):
        if not isinstance(admit_after, int) or admit_after < 2:
            raise ValueError(f"adaptive admission: expected admit_after >= 2, got {admit_after!r}")
        super().__init__([admit_after], ["cpu"], bound, stats)
        self.rate = min(MAX_SAMPLING_RATE, max(1, capacity // MINIATURE_SLOTS))
        size = max(1, capacity // self.rate)
        self._keep = 1.0 - 1.0 / (SCORE_WINDOW * size)
        # Sampled uses per block, remembered for USE_HISTORY miniature sizes: one count
        # that every reuse(N) miniature reads.
        self._uses: OrderedDict[BlockHash, int] = OrderedDict()
        self._history = USE_HISTORY * size
        # The miniatures: all, reuse(N), and with holds all and reuse(N) passing held
        # blocks over; ``hits``: each one's decayed hits. The holds are honoured from the
        # start, as configured.
        self.holds = holds
        passing = () if holds is None else (holds, holds)
        self._miniatures = tuple(MiniatureCache(size, rule) for rule in (None, None, *passing))
        self.hits = [0.0] * len(self._miniatures)
        self.reuse_chosen = False

    def note(self, block_hashes: Sequence[BlockHash]) -> None:
        super().note(block_hashes)
        rate = self.rate
        if rate > 1 and block_hashes:
            # crc32 for bytes: the same sample in every process (Python's hash of bytes is
            # salted per process), so a replay repeats itself.
            key = zlib.crc32 if isinstance(block_hashes[0], (bytes, bytearray)) else hash
            block_hashes = [h for h in block_hashes if key(h) % rate == 0]
        keep, hits, holds = self._keep, self.hits, self.holds
        sampled = zip(block_hashes, self._count_uses(block_hashes))
        if holds is None:
            a, r = (m.use for m in self._miniatures)
            h0, h1 = hits
            for h, admitted in sampled:
                h0, h1 = h0 * keep + a(h), h1 * keep + r(h, admitted)
            hits[:] = h0, h1
            pair = 0
        else:
            a, r, a_held, r_held = (m.use for m in self._miniatures)
            h0, h1, h2, h3 = hits
            for h, admitted in sampled:
                h0, h1 = h0 * keep + a(h), h1 * keep + r(h, admitted)
                h2, h3 = h2 * keep + a_held(h), h3 * keep + r_held(h, admitted)
            hits[:] = h0, h1, h2, h3
            free, kept = max(h0, h1), max(h2, h3)
            honoured = free <= (1 + HOLDS_MARGIN) * kept if holds.honoured else kept >= free
            if honoured != holds.honoured:
                holds.honoured = honoured
                holds.counts["switches"] += 1
            pair = 2 if honoured else 0
        reuse = hits[pair + 1] > hits[pair]  # within the pair in force
        if reuse != self.reuse_chosen:
            self.reuse_chosen = reuse
            self.stats.count("cpu", "admission_switches")

    def _count_uses(self, sampled: Sequence[BlockHash]) -> list[bool]:
        """Counts a use of each of ``sampled``: whether it is at least the N-th remembered
        (``reuse(N)`` admits it)."""
        uses, n, history = self._uses, self.admit_after[0], self._history
        admitted = []
        for h in sampled:
            k = uses[h] = uses.pop(h, 0) + 1
            if len(uses) > history:
                uses.popitem(last=False)
            admitted.append(k >= n)
        return admitted

    def in_force(self, i: int) -> bool:
        return self.reuse_chosen

    def admits(self, i: int, block_hash: BlockHash) -> bool:
        return not self.reuse_chosen or super().admits(i, block_hash)

    def admitted(self, i: int, block_hashes: list[BlockHash]) -> list[BlockHash]:
        return super().admitted(i, block_hashes) if self.reuse_chosen else block_hashes
