"""The bounds of admission and retention rules that decide on what the tier sees
(``tools/replay.py --policies``, the rows ``<eviction>+admission-features`` and
``<eviction>+retention-features(S)``).

The admission oracle (``replay_policies.OracleAdmission``) knows each block's future, which
no rule can. This bound knows only how the trace behaves on average: each block a request
stores is described by what an online rule could observe at that moment (``FEATURES``), the
trace is read once in hindsight for the share of blocks of each description that are used
again later, and a block is admitted when its description's share reaches a threshold. The
row replays every threshold of ``THRESHOLDS`` through the product's CPU manager and keeps
the best: no admission rule that decides on these features with one threshold does better
on this trace, up to the error of calibrating on the very blocks it admits (which only
raises the bound). ``cpu_admission: reuse(N)`` is one such rule (uses so far >= N - 1).

Retention likewise: the retention oracle (``replay_policies.OracleRetention``) knows which
session comes back and when. This bound describes each request by ``SESSION_FEATURES``,
learns in hindsight per description the share of requests whose session comes back and
the ``quantile`` of their gaps, and after a request holds its chain, within the budget,
until that quantile has passed, when the share reaches a threshold. The row keeps the
best of ``THRESHOLDS`` x ``QUANTILES``: the bound of any rule that guesses who comes back,
and when, from those features (``cpu_retention: session`` guesses from the recent gaps
of all sessions).

Runs in the replay tool's process; reads nothing but the requests it is given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.admission import WriteAdmission
from tiered_kv.tiered.retention import SessionRetention, _Session

#: What a store of block ``h`` at position ``d`` of a request observes, each in coarse bins
#: (log2, capped) so that no bin is so small that calibrating it would learn one block's future.
FEATURES = (
    "uses of the block so far (0, 1, 2, 3+)",
    "its depth in the request",
    "the request's length in blocks",
    "the request's leading blocks seen before",
    "its session's requests so far",
)
SESSION_FEATURES = (
    "its session's requests so far",
    "the gap since its session's previous request",
    "the request's length in blocks",
)
QUANTILES = (0.5, 0.75, 0.9)
THRESHOLDS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
_CAP = 12


def _bin(n: int) -> int:
    return min(n.bit_length(), _CAP)


def store_features(requests: Sequence[Sequence[Hashable]], sessions: Sequence[Hashable]) -> list[list[tuple]]:
    """Per request, per block, its ``FEATURES`` as a store of it sees them."""
    uses: Counter = Counter()
    turns: Counter = Counter()
    out = []
    for blocks, session in zip(requests, sessions):
        seen = 0
        for h in blocks:
            if not uses[h]:
                break
            seen += 1
        head = (_bin(len(blocks)), _bin(seen), _bin(turns[session]))
        out.append([(min(uses[h], 3), _bin(d)) + head for d, h in enumerate(blocks)])
        uses.update(blocks)
        turns[session] += 1
    return out


def return_shares(requests: Sequence[Sequence[Hashable]], features: Sequence[Sequence[tuple]]) -> dict[tuple, float]:
    """Per description, the share of its stores whose block the trace uses again later."""
    last = {h: i for i, blocks in enumerate(requests) for h in blocks}
    stores: Counter = Counter()
    again: Counter = Counter()
    for i, (blocks, described) in enumerate(zip(requests, features)):
        for h, f in zip(blocks, described):
            stores[f] += 1
            again[f] += last[h] > i
    return {f: again[f] / n for f, n in stores.items()}


class DecidedAdmission(WriteAdmission):
    """Admission a bound decides per block: ``used`` is told each request's blocks before
    they are stored, in trace order, and sets ``_decision``; the block's latest use
    decides until its next. Keeps no use counts."""

    def __init__(self, stats: TieredStats):
        super().__init__([2], ["cpu"], 1, stats)  # asked on every store
        self._next = 0
        self._decision: dict = {}

    def note(self, block_hashes: Sequence) -> None:
        """Counts nothing: the bound's calibration decides."""

    def used(self, block_hashes: Sequence) -> None:
        raise NotImplementedError

    def admits(self, i: int, block_hash) -> bool:
        return self._decision.get(block_hash, False)

    def admitted(self, i: int, block_hashes: list) -> list:
        admitted = [h for h in block_hashes if self._decision.get(h, False)]
        self.stats.count(self.names[i], "not_admitted", len(block_hashes) - len(admitted))
        return admitted


class FeatureAdmission(DecidedAdmission):
    """Admits a block when the trace's share of used-again blocks with its description
    reaches ``threshold``."""

    def __init__(
        self,
        requests: Sequence[Sequence[Hashable]],
        sessions: Sequence[Hashable],
        threshold: float,
        stats: TieredStats,
    ):
        super().__init__(stats)
        self._features = store_features(requests, sessions)
        self._shares = return_shares(requests, self._features)
        self.threshold = threshold

    def used(self, block_hashes: Sequence) -> None:
        i = self._next
        self._next += 1
        for h, f in zip(block_hashes, self._features[i]):
            self._decision[h] = self._shares[f] >= self.threshold


def session_features(
    requests: Sequence[Sequence[Hashable]], times: Sequence[float], sessions: Sequence[Hashable]
) -> tuple[list[tuple], list[int | None]]:
    """Per request its ``SESSION_FEATURES`` (gaps in whole seconds, binned), and the index
    of its session's next request (None: the session does not come back)."""
    turns: Counter = Counter()
    last: dict = {}
    described: list[tuple] = []
    following: list[int | None] = [None] * len(requests)
    for i, (blocks, t, session) in enumerate(zip(requests, times, sessions)):
        previous = last.get(session)
        gap = 0 if previous is None else int(t - times[previous]) + 1
        described.append((_bin(turns[session]), _bin(gap), _bin(len(blocks))))
        if previous is not None:
            following[previous] = i
        last[session] = i
        turns[session] += 1
    return described, following


class FeatureRetention(SessionRetention):
    """Holds request ``current``'s chain when the trace's share of returning sessions
    with its description reaches ``threshold``, until its description's ``quantile``
    of return gaps has passed; the replay sets ``current`` before each request."""

    def __init__(
        self,
        requests: Sequence[Sequence[bytes]],
        times: Sequence[float],
        sessions: Sequence[Hashable],
        num_slots: int,
        share: float,
        threshold: float,
        quantile: float,
        clock,
    ):
        super().__init__(num_slots, share, min_turns=1, max_sessions=len(requests) + 1, clock=clock)
        self._chains, self._session_ids = requests, sessions
        self._described, following = session_features(requests, times, sessions)
        gaps: dict[tuple, list[float]] = {}
        counts: Counter = Counter()
        for i, f in enumerate(self._described):
            counts[f] += 1
            j = following[i]
            if j is not None:
                gaps.setdefault(f, []).append(times[j] - times[i])
        self._plans: dict[tuple, float] = {}  # description -> hold seconds, where it holds
        for f, returned in gaps.items():
            if len(returned) / counts[f] >= threshold:
                returned.sort()
                self._plans[f] = returned[min(len(returned) - 1, int(quantile * len(returned)))]
        self.current = -1
        self._planned = -1

    def observe(self, block_hashes: Sequence, session: Hashable | None = None, request: Hashable | None = None) -> None:
        i = self.current
        if i == self._planned or i < 0:
            return
        self._planned = i
        s_id = self._session_ids[i]
        s = self._sessions.get(s_id)
        if s is None:
            s = self._sessions[s_id] = _Session(self.clock(), None)
        before, s.held = s.held, []
        hold_s = self._plans.get(self._described[i])
        if hold_s is not None and self._chains[i]:
            self._hold(s_id, s, list(self._chains[i]), self.clock() + hold_s + 1e-3)
        self._drop(before)
