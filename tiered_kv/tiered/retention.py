"""Session retention: the CPU tier's ``cpu_retention: session`` and a disk tier's
``retention: session``, one rule with a budget per tier.

Scheduler process; bookkeeping only, no I/O. Chats and coding agents come back: a
session's next turn extends its previous prompt after a gap (the user reading, a tool
running), and under LRU a burst of one-time blocks in that gap can push the previous
turn's blocks out just before they are wanted. This rule learns how long sessions stay
away and holds each session's latest chain for that long, within a budget.

Sessions. Where the engine names a request's session, that name is the session, and
its uses within one turn add up to the turn's chain (vLLM stores a request's blocks a
step's worth at a time). Under vLLM that name is the client's ``session_id`` (the
``X-Session-ID`` header, the request body or ``vllm_xargs``) within its tenant: the
connector keeps it in the request's ``ReqContext`` and the manager passes it with the
request's loads and stores (``observe``'s ``session``), so an LLM agent's turn that
rewrote its context is still its session's next turn. A caller of the seed API, which
has no parameter for it, sets ``session`` around a request's calls instead (the
replay does). Otherwise the prefix chain names it: a use whose blocks
contain the last block of a session's latest use (block hashes are prefix-chained, so
equal hash means equal prefix) extends the session it continues, the deepest such block deciding;
each session's last block is claimed by one continuation only, so a shared system
prompt that was once a whole request does not merge everyone after it into one
session. A returning request's load names its previous turn's blocks, so a request
stored a step at a time is still found by its next turn. Where the caller names the
request a use is of (``observe``'s ``request``: under vLLM its id), a request's uses
are one turn of one session however long its prefill takes, its later steps found by
the request; other uses of a session less than ``TURN_GAP_S`` apart are one turn too
(a request's load and its store arrive together), though another named request of it
(an agent's parallel calls) takes the turn's chain over only where it is longer. A
chain is at most the budget, head first.

Gaps and holds. The gap between a session's turns is recorded over a window of recent
gaps of its tenant (all the tenant's sessions together, since one session has few): the
``tenant`` of the session's name where it has one (vLLM's ``cache_salt``, kept in
``RequestSession``, whose ``session_id`` is None where the client named no session: the
prefix chain finds it, within that tenant); the sessions of no tenant share one window.
So one tenant's many short gaps never shorten another tenant's holds once it has
gaps of its own. At most ``MAX_TENANTS`` windows are kept, the least recently added to
going first; a tenant without one takes the hold of every tenant's gaps together
(``ttl_s``, another window). The hold time (TTL) is the ``quantile`` of the window's
gaps, within ``[min_ttl_s, max_ttl_s]``. At each use of a session
that has come back at least ``min_turns - 1`` times (a first request returns less often
than a later one: 22% against 62-86% on Mooncake's synthetic trace), its chain is held
until ``now + TTL``, replacing its previous hold; a hold ends at its deadline, or
earlier when the budget needs room.

Budget. At most ``budget`` blocks (a share of the tier's slots, below 1) are held at
once. Past it the holds that end soonest go first, the deepest block of a chain before
its head (a prefix hit needs the head). A held block is only passed over by eviction:
when nothing else can be evicted, the manager takes held blocks too, so holds can never
keep a store from the tier.

The CPU manager (``tiered_kv.cpu.manager``) asks ``holds`` about the blocks it is about
to evict and sets those aside; ``take_ended`` tells it which holds ended since (those
blocks go first to evict, as the least recent ones they were), while the rule is
``honoured``: with ``cpu_admission: adaptive(N)`` the CPU tier passes held blocks over
only while its miniature caches find that pays (``tiered_kv.tiered.admission``). A disk
tier's manager (``tiered_kv.disk.scheduler.manager``) has its own rule over its own slots, told of the
same uses by the composite (``TieredOffloadingManager``): its eviction passes over held
blocks in place, in LRU order, and takes them last; a hold that ended leaves its blocks
where their last use put them, the least recent after a storm.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Hashable, Iterable, Sequence

from tiered_kv.abstract import BlockHash
from tiered_kv.config_values import DEFAULT_RETENTION_SHARE, MAX_RETENTION_SHARE
from tiered_kv.metrics import (
    RETENTION_EVENTS,
    RETENTION_HELD_BLOCKS,
    RETENTION_HONOURED,
    RETENTION_TTL,
    CounterValue,
)

#: Uses of one session closer than this are one turn (seconds).
TURN_GAP_S = 1.0
#: Tenants whose gaps are kept at most (a window each); past it the least recent goes.
MAX_TENANTS = 1024


class _Gaps:
    """A window of recent gaps between turns, and the hold time they give."""

    __slots__ = ("gaps", "ttl")

    def __init__(self, window: int):
        self.gaps: deque[float] = deque(maxlen=window)
        self.ttl: float | None = None


class _Session:
    """One session: its tenant, when it was last used, its turns so far, its latest
    chain's last block (for prefix matching), the blocks it holds (head first) and until
    when."""

    __slots__ = ("tenant", "last", "turns", "tail", "chain", "held", "deadline", "seq", "request")

    def __init__(self, now: float, request: Hashable | None, tenant: Hashable | None = None):
        self.tenant = tenant  # the name's ``tenant`` where it has one (vLLM's cache_salt)
        self.last = now
        self.request = request  # the request of its latest use, where the caller named it
        self.turns = 1
        self.tail: BlockHash | None = None
        self.chain: list[BlockHash] = []  # this turn's blocks so far, head first
        self.held: list[BlockHash] = []
        self.deadline = now
        self.seq = 0  # the hold's number: heap entries of an older hold are stale


class SessionRetention:
    """Learns sessions' gaps and holds their latest chains (module docstring).

    ``num_slots``: the tier's slots; ``share``: the most of them held at once.
    ``clock``: seconds (``time.monotonic``; a replay passes its trace's clock)."""

    def __init__(
        self,
        num_slots: int,
        share: float = DEFAULT_RETENTION_SHARE,
        *,
        quantile: float = 0.9,
        min_ttl_s: float = 1.0,
        max_ttl_s: float = 1800.0,
        min_turns: int = 2,
        window: int = 512,
        max_sessions: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1, got {num_slots}")
        if not 0 < share <= MAX_RETENTION_SHARE:
            raise ValueError(f"share: expected 0 < share <= {MAX_RETENTION_SHARE} of the tier's slots, got {share}")
        if not 0 <= quantile <= 1:
            raise ValueError(f"quantile: expected 0 <= quantile <= 1, got {quantile}")
        if not 0 < min_ttl_s <= max_ttl_s:
            raise ValueError(f"min_ttl_s, max_ttl_s: expected 0 < min <= max, got {min_ttl_s}, {max_ttl_s}")
        if min_turns < 1 or window < 1:
            raise ValueError(f"min_turns, window: expected >= 1, got {min_turns}, {window}")
        #: The most blocks held at once.
        self.budget = max(1, int(share * num_slots))
        self.quantile, self.min_ttl_s, self.max_ttl_s = quantile, min_ttl_s, max_ttl_s
        self.min_turns = min_turns
        self.clock = clock
        self._max_sessions = max_sessions if max_sessions is not None else max(1024, num_slots)
        self._window = window
        # Per tenant (None: none named), least recently recorded first: its window of
        # recent gaps and the hold time they give.
        self._gaps: OrderedDict[Hashable, _Gaps] = OrderedDict()
        self._all = _Gaps(window)  # every tenant's: the hold of a tenant without a window of its own
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()  # least recently used first
        self._tails: dict[BlockHash, Hashable] = {}  # a session's latest last block -> the session
        self._requests: OrderedDict[Hashable, Hashable] = OrderedDict()  # a named request -> its session
        self._next_id = 0
        self._held: dict[BlockHash, int] = {}  # held block -> sessions holding it
        # One entry per hold, (deadline or rank, seq, session), lazily invalidated by seq.
        self._by_deadline: list[tuple[float, int, Hashable]] = []
        self._by_rank: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        self._ended: list[BlockHash] = []
        self._ended_cap = 2 * self.budget + 1024
        #: Set when ended holds were too many to list: ``take_ended`` returned None.
        self.ended_overflow = False
        #: Holds ended so far: a miniature cache that passes held blocks over looks again
        #: at what it set aside only once this moved (``tiered_kv.tiered.admission``).
        self.ends = 0
        #: Counters: returns (turns after a session's first), blocks held, blocks dropped
        #: for the budget, switches of ``honoured``.
        self.counts = {"returns": 0, "held": 0, "dropped": 0, "switches": 0}
        #: Whether the tier passes held blocks over now. The rule learns and holds either
        #: way; the CPU tier's ``cpu_admission: adaptive(N)`` turns this off while its
        #: miniature caches find the holds cost hits (``tiered_kv.tiered.admission``).
        self.honoured = True
        #: The session the engine names for the uses told next without one (the seed
        #: API's calls); None: the prefix chain decides.
        self.session: Hashable | None = None

    # ---- what the manager asks ----

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` is held (as of the last ``refresh``)."""
        return block_hash in self._held

    def __contains__(self, block_hash: object) -> bool:
        """``holds``: the rule is the container of the blocks it holds."""
        return block_hash in self._held

    @property
    def held_blocks(self) -> Container[BlockHash]:
        """The blocks held (as of the last ``refresh``): a live view, for a miniature cache
        that asks of each block it would evict (``tiered_kv.tiered.admission``)."""
        return self._held

    def num_held(self) -> int:
        return len(self._held)

    def refresh(self) -> None:
        """End the holds whose deadline has passed."""
        now, heap, sessions = self.clock(), self._by_deadline, self._sessions
        while heap and heap[0][0] <= now:
            _, seq, s_id = heapq.heappop(heap)
            s = sessions.get(s_id)
            if s is not None and s.seq == seq:
                self._unhold(s, len(s.held))

    def take_ended(self) -> list[BlockHash] | None:
        """The blocks whose hold ended since the last call (by time, budget or the
        session moving on; some may be held again since: ask ``holds``), or None when
        there were too many to keep: then any block set aside may have ended."""
        if self.ended_overflow:
            self.ended_overflow = False
            return None
        ended, self._ended = self._ended, []
        return ended

    def holding(self) -> SessionRetention | None:
        """For a tier whose eviction passes held blocks over in place (the disk tier's:
        nothing set aside, so no ended hold to hear of): this rule, its holds past their
        deadline ended, while it holds any; else None."""
        self.refresh()
        self.take_ended()
        return self if self._held else None

    @property
    def ttl_s(self) -> float | None:
        """The hold time learned from every tenant's gaps together, or None before the
        first gap."""
        return self._all.ttl

    def ttl_of(self, tenant: Hashable | None) -> float | None:
        """The hold time of ``tenant``'s sessions: from its own gaps, else (none yet, or
        its window gone past ``MAX_TENANTS``) from every tenant's; None before the first."""
        kept = self._gaps.get(tenant)
        return kept.ttl if kept is not None else self._all.ttl

    def metric_values(self, tier: str) -> tuple[list[CounterValue], list[CounterValue]]:
        """The counters (totals) and gauges of this rule as ``tier``'s metrics: its
        ``counts``, the blocks held, whether they are honoured and the hold time (once
        learned)."""
        self.refresh()
        counters: list[CounterValue] = [(RETENTION_EVENTS, (tier, event), n) for event, n in self.counts.items()]
        gauges: list[CounterValue] = [
            (RETENTION_HELD_BLOCKS, (tier,), len(self._held)),
            (RETENTION_HONOURED, (tier,), int(self.honoured)),
        ]
        if self._all.ttl is not None:
            gauges.append((RETENTION_TTL, (tier,), self._all.ttl))
        return counters, gauges

    # ---- what the manager tells ----

    def observe(
        self, block_hashes: Sequence[BlockHash], session: Hashable | None = None, request: Hashable | None = None
    ) -> None:
        """A use of ``block_hashes`` (one request's chain or its leading part, head first),
        of ``session`` where the engine names it, else of the session its prefix chain
        says; ``request``, where named, makes all of that request's uses one turn."""
        if not block_hashes:
            return
        now = self.clock()
        named = session if session is not None else self.session
        s_id, s = self._session_of(block_hashes, named, now, request)
        same_request = request is not None and request == s.request
        if not same_request and now - s.last >= TURN_GAP_S:
            self._record_gap(now - s.last, s.tenant)
            s.turns += 1
            self.counts["returns"] += 1
            s.chain = list(block_hashes)
        elif (same_request or named is not None and request is None) and s.tail not in block_hashes:
            # The turn's next step. Never more than the budget, head first: a busy
            # session's requests, under TURN_GAP_S apart, must not grow it without end.
            s.chain = (s.chain + list(block_hashes))[: self.budget]
        elif len(block_hashes) >= len(s.chain):
            s.chain = list(block_hashes)
        s.last, s.request = now, request
        if request is not None:
            self._requests[request] = s_id
            self._requests.move_to_end(request)
            while len(self._requests) > self._max_sessions:
                self._requests.popitem(last=False)
        last = s.chain[-1]
        if s.tail is not None and self._tails.get(s.tail) == s_id:
            del self._tails[s.tail]
        s.tail = last
        self._tails[last] = s_id
        plan = self._plan(s, s.chain, now)
        before, s.held = s.held, []
        if plan is not None and plan[0]:
            self._hold(s_id, s, *plan)
        # Released after the new hold is counted: a block in both stays held throughout.
        self._drop(before)
        self._trim_sessions()

    # ---- the rule (a replay's oracle overrides ``_plan`` and ``_rank``) ----

    def _plan(self, s: _Session, block_hashes: Sequence[BlockHash], now: float) -> tuple[list, float] | None:
        """What to hold for session ``s`` after this use (head first), and until when;
        None: nothing."""
        ttl = self.ttl_of(s.tenant)
        if s.turns < self.min_turns or ttl is None:
            return None
        return list(block_hashes), now + ttl

    def _rank(self, deadline: float) -> float:
        """Budget order: the hold of smallest rank gives up blocks first (here the one
        that ends soonest)."""
        return deadline

    # ---- internals ----

    def _session_of(
        self, block_hashes: Sequence[BlockHash], session: Hashable | None, now: float, request: Hashable | None
    ) -> tuple[Hashable, _Session]:
        sessions = self._sessions
        tenant = getattr(session, "tenant", None)
        if getattr(session, "session_id", "") is None:
            session = None  # a tenant that named no session: found by its prefix chain
        if session is None and request is not None:
            placed = self._requests.get(request)  # a later step of a request already placed
            session = placed if placed in sessions else None
        if session is None:
            tails = self._tails
            for block_hash in reversed(block_hashes):
                s_id = tails.get(block_hash)
                if s_id is not None and s_id in sessions:
                    sessions.move_to_end(s_id)
                    return s_id, sessions[s_id]
            self._next_id += 1
            session = ("chain", self._next_id)
        s = sessions.get(session)
        if s is None:
            s = sessions[session] = _Session(now, request, tenant)
        sessions.move_to_end(session)
        return session, s

    def _record_gap(self, gap: float, tenant: Hashable | None) -> None:
        kept = self._gaps.get(tenant)
        if kept is None:
            kept = self._gaps[tenant] = _Gaps(self._window)
            while len(self._gaps) > MAX_TENANTS:
                self._gaps.popitem(last=False)
        self._gaps.move_to_end(tenant)
        for window in (kept, self._all):
            window.gaps.append(gap)
            ordered = sorted(window.gaps)
            q = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
            window.ttl = min(self.max_ttl_s, max(self.min_ttl_s, q))

    def _hold(self, s_id: Hashable, s: _Session, blocks: list[BlockHash], deadline: float) -> None:
        held = self._held
        blocks = list(dict.fromkeys(blocks))
        for block_hash in blocks:
            held[block_hash] = held.get(block_hash, 0) + 1
        self._seq += 1
        s.held, s.deadline, s.seq = blocks, deadline, self._seq
        heapq.heappush(self._by_deadline, (deadline, s.seq, s_id))
        heapq.heappush(self._by_rank, (self._rank(deadline), s.seq, s_id))
        self.counts["held"] += len(blocks)
        heap, sessions = self._by_rank, self._sessions
        while len(held) > self.budget and heap:
            entry = heap[0]
            other = sessions.get(entry[2])
            if other is None or other.seq != entry[1] or not other.held:
                heapq.heappop(heap)
                continue
            before = len(held)
            # Deepest first: a prefix hit needs the head.
            while other.held and len(held) > self.budget:
                self._unhold(other, 1)
            self.counts["dropped"] += before - len(held)
        for name in ("_by_deadline", "_by_rank"):
            if len(getattr(self, name)) > 2 * len(sessions) + 1024:
                self._compact(name)

    def _unhold(self, s: _Session, n: int) -> None:
        """End ``s``'s hold on its ``n`` deepest held blocks."""
        n = min(n, len(s.held))
        if n:
            self._drop(s.held[len(s.held) - n :][::-1])
            del s.held[len(s.held) - n :]

    def _drop(self, blocks: Iterable[BlockHash]) -> None:
        """One holder fewer for each of ``blocks``; those left with none have ended."""
        held, ended = self._held, self._ended
        for block_hash in blocks:
            left = held[block_hash] - 1
            if left:
                held[block_hash] = left
            else:
                del held[block_hash]
                ended.append(block_hash)
                self.ends += 1
        if len(ended) > self._ended_cap:
            # Nobody drained them (a tier that does not evict): the manager rechecks
            # what it set aside instead.
            ended.clear()
            self.ended_overflow = True

    def _trim_sessions(self) -> None:
        sessions = self._sessions
        while len(sessions) > self._max_sessions:
            s_id, s = sessions.popitem(last=False)
            self._unhold(s, len(s.held))
            if s.tail is not None and self._tails.get(s.tail) == s_id:
                del self._tails[s.tail]

    def _compact(self, name: str) -> None:
        sessions = self._sessions
        heap = [e for e in getattr(self, name) if (s := sessions.get(e[2])) is not None and s.seq == e[1] and s.held]
        heapq.heapify(heap)
        setattr(self, name, heap)


def retention_metric_values(tiers: Iterable[tuple[str, object]]) -> tuple[list[CounterValue], list[CounterValue]]:
    """``metric_values`` of each of ``tiers`` (name, manager) whose manager has a rule
    (its ``retention``), under the tier's name: the counters and the gauges."""
    counters: list[CounterValue] = []
    gauges: list[CounterValue] = []
    for name, tier in tiers:
        if isinstance(rule := getattr(tier, "retention", None), SessionRetention):
            kept = rule.metric_values(name)
            counters += kept[0]
            gauges += kept[1]
    return counters, gauges
