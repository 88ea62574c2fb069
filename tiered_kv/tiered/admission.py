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
"""

from __future__ import annotations

import zlib
from collections import Counter, OrderedDict
from collections.abc import Sequence

from tiered_kv.abstract import BlockHash
from tiered_kv.metrics import TieredStats


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
        """The members of ``block_hashes`` lower tier ``i`` takes now, in order."""
        n = self.admit_after[i]
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
#: Sampled uses over which a miniature's hits count, in miniature sizes: long enough to
#: hold a block's reuse at the tier's size, short enough to follow a change of traffic.
SCORE_WINDOW = 4


class MiniatureCache:
    """Hashes only: an LRU cache of ``capacity`` blocks that ranks a block first to evict
    until its ``admit_after``-th use (as the CPU tier does), uses remembered for
    ``HISTORY`` x ``capacity`` blocks."""

    HISTORY = 4

    def __init__(self, capacity: int, admit_after: int):
        self.capacity = max(1, capacity)
        self.admit_after = admit_after
        self._warm: OrderedDict[BlockHash, None] = OrderedDict()
        self._cold: OrderedDict[BlockHash, None] = OrderedDict()
        self._uses: OrderedDict[BlockHash, int] = OrderedDict()

    def use(self, block_hash: BlockHash) -> bool:
        """A use of ``block_hash``: whether it was cached; it is cached after."""
        warm, cold = self._warm, self._cold
        admitted = True
        if self.admit_after > 1:
            uses = self._uses
            n = uses[block_hash] = uses.pop(block_hash, 0) + 1
            if len(uses) > self.HISTORY * self.capacity:
                uses.popitem(last=False)
            admitted = n >= self.admit_after
        if block_hash in warm:
            warm.move_to_end(block_hash)
            return True
        hit = block_hash in cold
        if hit:
            if not admitted:
                return True
            del cold[block_hash]
        (warm if admitted else cold)[block_hash] = None
        if len(warm) + len(cold) > self.capacity:
            (cold if cold else warm).popitem(last=False)
        return hit

    def __len__(self) -> int:
        return len(self._warm) + len(self._cold)


class AdaptiveAdmission(WriteAdmission):
    """``cpu_admission: adaptive(N)``: ``reuse(N)`` while its miniature cache hits more than
    ``all``'s over the recent sampled uses, else ``all`` (module docstring). ``capacity``:
    the tier's slots. ``reuse_chosen`` says which rule is in force; ``stats`` counts each
    switch (``cpu``'s ``admission_switches``)."""

    def __init__(self, admit_after: int, capacity: int, bound: int, stats: TieredStats):
        if not isinstance(admit_after, int) or admit_after < 2:
            raise ValueError(f"adaptive admission: expected admit_after >= 2, got {admit_after!r}")
        super().__init__([admit_after], ["cpu"], bound, stats)
        self.rate = min(MAX_SAMPLING_RATE, max(1, capacity // MINIATURE_SLOTS))
        size = max(1, capacity // self.rate)
        self._all = MiniatureCache(size, 1)
        self._reuse = MiniatureCache(size, admit_after)
        self._keep = 1.0 - 1.0 / (SCORE_WINDOW * size)
        #: Decayed hits of ``reuse(N)``'s miniature minus ``all``'s.
        self.score = 0.0
        self.reuse_chosen = False

    def note(self, block_hashes: Sequence[BlockHash]) -> None:
        super().note(block_hashes)
        rate, keep, score = self.rate, self._keep, self.score
        reuse, everything = self._reuse.use, self._all.use
        if rate > 1 and block_hashes:
            # crc32 for bytes: the same sample in every process (Python's hash of bytes is
            # salted per process), so a replay repeats itself.
            key = zlib.crc32 if isinstance(block_hashes[0], (bytes, bytearray)) else hash
            block_hashes = [h for h in block_hashes if key(h) % rate == 0]
        for h in block_hashes:
            score = score * keep + reuse(h) - everything(h)
        self.score = score
        if (score > 0) != self.reuse_chosen:
            self.reuse_chosen = score > 0
            self.stats.count("cpu", "admission_switches")

    def in_force(self, i: int) -> bool:
        return self.reuse_chosen

    def admits(self, i: int, block_hash: BlockHash) -> bool:
        return not self.reuse_chosen or super().admits(i, block_hash)

    def admitted(self, i: int, block_hashes: list[BlockHash]) -> list[BlockHash]:
        return super().admitted(i, block_hashes) if self.reuse_chosen else block_hashes
