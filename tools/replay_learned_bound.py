"""The bound of admission rules that learn from everything the tier sees
(``tools/replay.py --policies``, the row ``<eviction>+admission-learned``).

``replay_feature_bound`` calibrates one threshold over coarse descriptions of a store. This
bound gives a learner more room: a gradient-boosted classifier (scikit-learn's
``HistGradientBoostingClassifier``) over every quantity in ``LEARNED_FEATURES``, each
exact rather than binned, predicts whether a stored block is used again within a horizon
(``HORIZONS``, in CPU tiers' worth of blocks requested, or ever). The trace is cut in two
halves of its requests; each half is predicted by a model fitted on the other, so no
block is judged by a model that saw its own future, and each model learns from the
trace's whole behaviour elsewhere, the far future included, which no online rule can.
A block is admitted when its predicted probability reaches a threshold; the row replays
every ``(threshold, horizon)`` through the product's CPU manager and keeps the best.

The request's output length is known only when the request finishes, after its blocks
are stored; the bound uses it at the store, which only raises the bound.

Runs in the replay tool's process; reads nothing but the requests it is given.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Sequence

import numpy as np

from replay_feature_bound import DecidedAdmission

from tiered_kv.metrics import TieredStats

#: What is known of block ``h`` at position ``d`` of a request when it is stored.
LEARNED_FEATURES = (
    "the request's length in blocks",
    "its blocks not seen before",
    "its leading blocks seen before",
    "its output length in tokens",
    "its session's requests so far",
    "seconds since its session's previous request",
    "seconds since its session's first request",
    "requests in the last 60 s",
    "the block's depth",
    "blocks after it in the request",
    "the block's uses so far",
)
#: Used again within this many CPU tiers' worth of blocks requested; None: ever.
HORIZONS: tuple[float | None, ...] = (2.5, 5.0, None)
LEARNED_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # 0: admit all, as the eviction policy alone
#: The (threshold, horizon) pairs the row replays, in the order the first best is kept.
LEARNED_GRID: list[tuple[float, float | None]] = [(t, h) for h in HORIZONS for t in LEARNED_THRESHOLDS]
_WINDOW_S = 60.0


def learned_features(
    requests: Sequence[Sequence[Hashable]],
    times: Sequence[float],
    sessions: Sequence[Hashable],
    outputs: Sequence[int],
) -> np.ndarray:
    """One row of ``LEARNED_FEATURES`` per block of every request, in trace order."""
    uses: Counter = Counter()
    turns: Counter = Counter()
    first: dict = {}
    last: dict = {}
    window: deque = deque()
    rows: list[list[float]] = []
    for blocks, t, session, out in zip(requests, times, sessions, outputs):
        while window and window[0] < t - _WINDOW_S:
            window.popleft()
        window.append(t)
        lead = 0
        for h in blocks:
            if not uses[h]:
                break
            lead += 1
        new = sum(1 for h in blocks if not uses[h])
        since = t - last[session] if session in last else -1.0
        age = t - first.setdefault(session, t)
        n = len(blocks)
        head = [n, new, lead, out, turns[session], since, age, len(window)]
        rows += [head + [d, n - d, uses[h]] for d, h in enumerate(blocks)]
        uses.update(blocks)
        turns[session] += 1
        last[session] = t
    return np.asarray(rows, dtype=np.float64).reshape(-1, len(LEARNED_FEATURES))


def reuse_labels(requests: Sequence[Sequence[Hashable]], horizon: int | None) -> np.ndarray:
    """Per block of every request: is it requested again within ``horizon`` blocks requested
    after it (None: ever)?"""
    count = sum(map(len, requests))
    labels = np.zeros(count, dtype=bool)
    following: dict = {}
    at = count
    for blocks in reversed(requests):
        at -= len(blocks)
        for d in range(len(blocks) - 1, -1, -1):
            h, here = blocks[d], at + d
            again = following.get(h)
            labels[here] = again is not None and (horizon is None or again - here <= horizon)
            following[h] = here
    return labels


def cross_fitted(features: np.ndarray, labels: np.ndarray, request_of: np.ndarray, seed: int = 0) -> np.ndarray:
    """Each block's probability of ``labels`` from a model fitted on the other half of the
    requests (``request_of``: each row's request index)."""
    try:
        from sklearn.ensemble import HistGradientBoostingClassifier
    except ImportError:
        raise RuntimeError(
            "the learned admission bound needs scikit-learn: pip install -e '.[bench]' (or scikit-learn>=1.4)"
        ) from None

    first = request_of < (request_of.max(initial=0) + 1) // 2
    out = np.zeros(len(labels))
    for train, test in ((first, ~first), (~first, first)):
        if not test.any():
            continue
        seen = labels[train]
        if len(set(seen.tolist())) < 2:  # one class (or none) to learn from: its share
            out[test] = seen.mean() if len(seen) else 0.5
            continue
        model = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, random_state=seed)
        out[test] = model.fit(features[train], seen).predict_proba(features[test])[:, 1]
    return out


#: The latest trace's fits per (horizon, capacity), kept with the trace they belong to.
_FITTED: dict[tuple[float | None, int], tuple[Sequence, list[np.ndarray]]] = {}


def learned_probabilities(
    requests: Sequence[Sequence[Hashable]],
    times: Sequence[float],
    sessions: Sequence[Hashable],
    outputs: Sequence[int],
    horizon: float | None,
    capacity: int,
) -> list[np.ndarray]:
    """Per request, its blocks' cross-fitted probabilities of use within ``horizon`` CPU
    tiers (``capacity`` blocks each); fitted once per trace, horizon and capacity."""
    key = (horizon, capacity)
    fitted = _FITTED.get(key)
    if fitted is None or fitted[0] is not requests:
        if any(trace is not requests for trace, _ in _FITTED.values()):
            _FITTED.clear()  # one trace at a time
        features = learned_features(requests, times, sessions, outputs)
        labels = reuse_labels(requests, None if horizon is None else int(horizon * capacity))
        request_of = np.repeat(np.arange(len(requests)), [len(r) for r in requests])
        flat = cross_fitted(features, labels, request_of)
        bounds = np.cumsum([0, *map(len, requests)])
        fitted = _FITTED[key] = (requests, [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
    return fitted[1]


class LearnedAdmission(DecidedAdmission):
    """Admits a block when its predicted probability (``probabilities``, per request in
    trace order) reaches ``threshold``."""

    def __init__(self, probabilities: Sequence[np.ndarray], threshold: float, stats: TieredStats):
        super().__init__(stats)
        self._probabilities = probabilities
        self.threshold = threshold

    def used(self, block_hashes: Sequence) -> None:
        p = self._probabilities[self._next]
        self._next += 1
        for h, q in zip(block_hashes, p.tolist()):
            self._decision[h] = q >= self.threshold
