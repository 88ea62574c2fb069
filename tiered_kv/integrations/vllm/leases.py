"""The leases of ``kv.retain`` (``tiered_kv.integrations.vllm.hints``): which chunks each
lease covers, and where each leased chunk is pinned. Scheduler process; bookkeeping
only, no I/O.

A lease is named by its tenant (vLLM's ``cache_salt``; None: none named) and the id its
request gave. While it holds, each chunk it covers is pinned in the first tier holding it
(the CPU tier's manager first, then this node's lower tiers) whose pins are below that
tier's budget, nearest the lease's head first: a prefix lookup needs the head. A chunk
held somewhere, but only in tiers at their budget, is left unpinned and counted
(``clipped``) once. Such chunks are tried again at the step's end (``retry_unpinned``):
after a pin was dropped, nearest their lease's head first; and while any tier is below
its budget, a bounded number a step in turn, so a chunk whose CPU store landed past the
CPU budget is pinned in a lower tier once its copy there becomes loadable.

At most ``MAX_LEASES`` leases are held. A new one past that ends a lease of the tenant
holding the most (the new lease's own tenant where it is among them), the one of that
tenant nearest its end: a tenant displaces another tenant's lease only while it holds
fewer than that tenant, and its own once it holds the largest share.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_kv.abstract import BlockHash

#: Leases held at most; a new one past it ends a lease of the tenant holding the most.
MAX_LEASES = 4096
#: Steps a retry of clipped chunks waits at most after passes that pinned none (doubling):
#: a chunk whose lower-tier copy never lands costs a pass now and then, not every step.
MAX_RETRY_WAIT = 64
#: A lease's key: the request's tenant (None: none named) and the lease id it gave.
LeaseId = tuple[str | None, str]


@dataclass
class Lease:
    keys: list[BlockHash]
    ttl_s: float
    expires: float


class LeaseBook:
    """The leases of ``kv.retain`` (module docstring) over ``tiers``: the CPU tier's
    manager first, then this node's lower tiers; ``names`` theirs, ``budget`` the
    blocks each may pin."""

    def __init__(self, tiers: Sequence[Any], names: Sequence[str], budget: Sequence[int]):
        self.tiers, self.names, self.budget = list(tiers), list(names), list(budget)
        self.leases: dict[LeaseId, Lease] = {}
        self._leases_of: dict[BlockHash, set[LeaseId]] = {}
        self._rank: dict[BlockHash, int] = {}  # a leased block's place in its lease's prefix
        self._pinned: dict[BlockHash, int] = {}  # block -> the tier holding its pin
        self.pinned = [0] * len(self.tiers)
        self._unpinned: set[BlockHash] = set()  # leased, not pinned: held nowhere yet, or no budget
        # Leased, unpinned, held but no budget was left: in the order they are retried.
        self._clipped: dict[BlockHash, None] = {}
        self.clipped = 0  # leased chunks left unpinned for want of budget
        self._freed = False  # a pin was dropped since the last retry
        self._idle = self._wait = 0  # the clipped chunks' retry: its back-off, and steps left of it

    def hold(self, lease_id: LeaseId, ttl_s: float, now: float) -> None:
        """Hold lease ``lease_id`` (created empty, or renewed) for ``ttl_s`` from now."""
        lease = self.leases.get(lease_id)
        if lease is None:
            if len(self.leases) >= MAX_LEASES:
                self.release(self._displaced(lease_id[0]))
            self.leases[lease_id] = Lease([], ttl_s, now + ttl_s)
        else:
            lease.ttl_s, lease.expires = ttl_s, max(lease.expires, now + ttl_s)

    def _displaced(self, tenant: str | None) -> LeaseId:
        """The lease a new one of ``tenant`` ends past ``MAX_LEASES`` (module docstring)."""
        held = Counter(t for t, _ in self.leases)
        most = max(held.values())
        victim = tenant if held[tenant] == most else min((t for t, n in held.items() if n == most), key=str)
        return min((i for i in self.leases if i[0] == victim), key=lambda i: self.leases[i].expires)

    def retain(self, lease_id: LeaseId, keys: Sequence[BlockHash], ttl_s: float, now: float) -> None:
        """Lease ``lease_id`` covers ``keys`` (replacing what it covered) for ``ttl_s`` from now."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            self._drop_keys(lease_id, lease.keys)
        self.leases[lease_id] = Lease(list(keys), ttl_s, now + ttl_s)
        for i, key in enumerate(keys):
            self._leases_of.setdefault(key, set()).add(lease_id)
            self._rank[key] = min(i, self._rank.get(key, i))
        self.pin_where_held(keys)

    def release(self, lease_id: LeaseId) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self._drop_keys(lease_id, lease.keys)
        return lease is not None

    def _drop_keys(self, lease_id: LeaseId, keys: Iterable[BlockHash]) -> None:
        for key in keys:
            holders = self._leases_of.get(key)
            if holders is None:
                continue
            holders.discard(lease_id)
            if not holders:
                del self._leases_of[key]
                del self._rank[key]
                self._unpinned.discard(key)
                self._clipped.pop(key, None)
                tier = self._pinned.pop(key, None)
                if tier is not None:
                    self._unpin(tier, key)

    def renew(self, keys: Iterable[BlockHash], now: float) -> None:
        """A load of ``keys``: every lease holding one of them runs ``ttl_s`` from now."""
        if self._leases_of:
            for key in keys:
                for lease_id in self._leases_of.get(key, ()):
                    lease = self.leases[lease_id]
                    lease.expires = now + lease.ttl_s

    def pin_where_held(self, keys: Iterable[BlockHash]) -> None:
        """Pin each leased, unpinned key of ``keys`` in the first tier holding it that has
        budget left (a CPU pin also ranks the chunk most recent, so evictions do not
        walk past it for long)."""
        if not self._leases_of:
            return
        leased = self._leases_of
        # Head first (stores complete in any order): a prefix lookup needs the head.
        for key in sorted((k for k in keys if k in leased and k not in self._pinned), key=self._rank.__getitem__):
            held = False
            for i, tier in enumerate(self.tiers):
                if not tier.is_loadable(key):
                    continue
                held = True
                if self.pinned[i] < self.budget[i]:
                    if i == 0:
                        tier.pin([key])
                        tier.touch([key])
                    else:
                        tier.prepare_load([key])
                    self._pinned[key] = i
                    self.pinned[i] += 1
                    self._unpinned.discard(key)
                    self._clipped.pop(key, None)
                    break
            else:
                self._unpinned.add(key)
                if held and key not in self._clipped:
                    self._clipped[key] = None
                    self.clipped += 1

    def expire(self, now: float) -> int:
        """Drop the leases past their time; how many."""
        gone = [lease_id for lease_id, lease in self.leases.items() if lease.expires <= now]
        for lease_id in gone:
            self.release(lease_id)
        return len(gone)

    def retry_unpinned(self, limit: int = 1024) -> None:
        """The step's end: pin up to ``limit`` leased chunks that found no tier with budget
        before (a store that lands is pinned as it lands, ``pin_where_held``). Once a pin
        was dropped: those nearest their lease's head first, in an order that does not
        depend on the process's hash seed. Else, while a tier is below its budget (a
        clipped chunk's copy in a lower tier may have become loadable since): the clipped
        ones in turn, those still unpinned going to the back, a pass that pins none
        waiting twice as many steps as the last before the next (``MAX_RETRY_WAIT``)."""
        if self._freed and self._unpinned:
            self._freed = False
            rank = self._rank
            self.pin_where_held(heapq.nsmallest(limit, self._unpinned, key=lambda k: (rank[k], k)))
        elif self._clipped and any(n < b for n, b in zip(self.pinned, self.budget)):
            if self._wait > 0:  # passes that pinned nothing back off, up to MAX_RETRY_WAIT steps
                self._wait -= 1
                return
            clipped = self._clipped
            before = len(self._pinned)
            turn = list(itertools.islice(clipped, limit))
            self.pin_where_held(turn)
            for key in turn:
                if clipped.pop(key, 0) is None:  # still unpinned: to the back
                    clipped[key] = None
            self._idle = 0 if len(self._pinned) > before else min(self._idle * 2 + 1, MAX_RETRY_WAIT)
            self._wait = self._idle

    def _unpin(self, i: int, key: BlockHash) -> None:
        self.pinned[i] -= 1
        self._freed = True
        if i == 0:
            self.tiers[0].unpin([key])
        else:
            self.tiers[i].complete_load([key])

    def clear(self) -> None:
        for key, i in self._pinned.items():
            self._unpin(i, key)
        self.leases.clear()
        self._leases_of.clear()
        self._rank.clear()
        self._pinned.clear()
        self._unpinned.clear()
        self._clipped.clear()
