"""Admission by reuse: ``write_admission: all | reuse(N)`` per lower tier, and
``cpu_admission: all | reuse(N)`` for the CPU tier.

Scheduler process, inside the composite manager (and the CPU tier's manager); no I/O.
A block is written into a lower tier with ``admit_after`` N > 1 only once it has been
stored or hit N times, counted over a bounded history of recent blocks (the oldest
forgotten first), so a block used once costs no lower-tier write. The CPU tier uses
the same rule to rank a block it does not admit yet first to evict
(``tiered_kv.cpu.manager``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tiered_kv.abstract import BlockHash
from tiered_kv.metrics import TieredStats


class WriteAdmission:
    """Uses per recent block and the admission rule per lower tier.

    ``admit_after[i]``: the stores-or-hits lower tier ``i`` (named ``names[i]``) needs
    before it takes a block (1: every block). ``bound``: blocks remembered at most.
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
        self._uses: OrderedDict[BlockHash, int] | None = OrderedDict() if any(n > 1 for n in admit_after) else None

    def note(self, block_hashes: Sequence[BlockHash]) -> None:
        """A store or a hit of each block."""
        uses = self._uses
        if uses is None:
            return
        for h in block_hashes:
            uses[h] = uses.pop(h, 0) + 1
        while len(uses) > self.bound:
            uses.popitem(last=False)

    def admits(self, i: int, block_hash: BlockHash) -> bool:
        """Whether tier ``i`` takes ``block_hash`` now; counts nothing."""
        n, uses = self.admit_after[i], self._uses
        return n <= 1 or uses is None or uses.get(block_hash, 0) >= n

    def admitted(self, i: int, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """The members of ``block_hashes`` lower tier ``i`` takes now, in order."""
        n, uses = self.admit_after[i], self._uses
        if n <= 1 or not block_hashes or uses is None:
            return block_hashes
        admitted = [h for h in block_hashes if uses.get(h, 0) >= n]
        self.stats.count(self.names[i], "not_admitted", len(block_hashes) - len(admitted))
        return admitted
