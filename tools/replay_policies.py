"""CPU-tier policy table: block hit rate per eviction policy, CPU admission and retention,
beside their oracles, Belady and the infinite cache.

``python tools/replay.py --trace T --cpu-tokens 3M --policies lru,arc,lru+reuse(2),lru+session``

Replays a Mooncake FAST'25 trace (``replay_workloads.read_mooncake``: 512-token blocks,
prefix-chained ids, arrival times), requests in file order (which is time order), through
the product's own managers: a ``TieredOffloadingManager`` with no lower tier over the CPU
tier's manager (``tiered_kv.cpu.cpu_tier_manager``) of the policy's ``eviction_policy``,
``cpu_admission`` and ``cpu_retention``, the retention rule's clock at each request's
arrival. No device cache and no bytes: per request, ``lookup``, load its leading hits,
store every block, touch the chain (``replay``; ``tools/replay_claude_code.py`` adds a
disk tier below).

A policy is named as its config values joined by ``+``: ``lru``, ``arc``,
``lru+reuse(2)``, ``lru+session``, ``lru+reuse(2)+session(0.25)``. The oracles, each
the bound of one mechanism at the same capacity:

- ``<policy>+admission-oracle``: admits only blocks the trace uses again later (the
  bound for any admission rule);
- ``<policy>+retention-oracle``: holds, within ``session``'s budget, exactly the blocks
  each session's next turn reuses, until it comes; past the budget the hold that ends
  last gives up blocks first (the bound for any rule that guesses who comes back, and
  when);
- ``<policy>+admission-features`` and ``<policy>+retention-features(S)``: the best
  admission, and the best retention within ``session(S)``'s budget, that decide on what the
  tier sees, calibrated on the trace in hindsight (``replay_feature_bound``: the bound for
  any rule deciding on those features; the row names the parameters it chose);
- ``<policy>+admission-learned``: admission by a classifier over every quantity the tier
  sees, each half of the trace predicted by a model fitted on the other
  (``replay_learned_bound``: the bound for rules that learn; the row names its threshold
  and horizon);
- ``belady``: Belady's optimum (``replay_cost.belady_hit_rate``: the block used again
  furthest ahead goes first; among blocks never used again, the deepest first), the
  bound for any eviction order.

Sessions, for the retention oracle and the survival count, are the workload's where it
names them, else the prefix chain's (``chain_sessions``: the rule's own inference, run
over the whole trace).

Columns: block hit rate (leading-run hits over all blocks), Belady at the same capacity,
the infinite cache (every block seen before is a hit), the rate over Belady's. A second
table sets the best online rule of each mechanism beside its oracle.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from benchlib import md_table
from replay_cost import belady_hit_rate, infinite_hit_rate
from replay_feature_bound import QUANTILES, THRESHOLDS, DecidedAdmission, FeatureAdmission, FeatureRetention
from replay_learned_bound import LEARNED_GRID, LearnedAdmission, learned_probabilities
from replay_workloads import read_mooncake

from tiered_kv.config import (
    EVICTION_POLICIES,
    MAX_RETENTION_SHARE,
    ConfigError,
    adaptive_admission,
    admit_after,
    parse_cpu_admission,
    parse_cpu_retention,
    retention_share,
)
from tiered_kv.cpu import cpu_tier_manager
from tiered_kv.tiered.retention import SessionRetention, _Session
from tiered_kv.disk.format.manifest import slot_size_for
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.mediums import spec_as
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.transfer_specs import TieredStoreSpec

DEFAULT_POLICIES = "lru,arc,lru+reuse(2),arc+reuse(2),lru+session,lru+reuse(2)+session"
COLUMNS = ["policy", "block hit rate", "Belady", "infinite", "of Belady"]
ORACLES = ("admission-oracle", "admission-features", "admission-learned", "retention-oracle", "retention-features")
#: Admission rows that know more than the tier: the oracle and the bounds.
_BOUND_ADMISSIONS = ("oracle", "features", "learned")
TOKENS_PER_BLOCK = 512
_TOKENS_RE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)$")
#: The disk tier's index layout: small, since no bytes move.
_LAYOUT = KVCacheLayout((LayerLayout("kv", (1, 64), False),), torch.uint8, 16)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policies",
        help=f"print the CPU-tier policy table for --trace (a Mooncake trace) instead, e.g. {DEFAULT_POLICIES}; "
        "each <eviction_policy>[+<cpu_admission>][+<cpu_retention>], or an oracle "
        f"(<eviction_policy>+{'|'.join(ORACLES)}, belady)",
    )
    p.add_argument("--cpu-tokens", default="3M", help="CPU tier size in tokens for --policies (k, M, G: 10^3, 6, 9)")


def parse_tokens(value: str) -> int:
    """``3M`` -> 3,000,000 (decimal suffixes k, M, G)."""
    m = _TOKENS_RE.match(value.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--cpu-tokens: expected a positive token count such as 3M or 500k, got {value!r}")
    return int(float(m.group(1)) * 10 ** (3 * " kmg".index(m.group(2).lower() or " ")))


@dataclass(frozen=True)
class Policy:
    """A table row: its name and config values. ``admission`` and ``retention`` may be
    ``oracle`` or ``features``, ``admission`` also ``learned`` (``oracle(S)``,
    ``features(S)``: retention's at the budget share S); ``eviction`` ``belady`` is
    Belady's optimum (computed, not replayed)."""

    name: str
    eviction: str
    admission: str = "all"
    retention: str = "none"

    @property
    def mechanism(self) -> str:
        """What the row varies: ``retention``, ``admission`` or ``eviction order``."""
        if self.retention != "none":
            return "retention"
        return "admission" if self.admission != "all" else "eviction order"

    @property
    def is_oracle(self) -> bool:
        return (
            self.admission in _BOUND_ADMISSIONS
            or self.retention.startswith(("oracle", "features"))
            or self.eviction == "belady"
        )

    @property
    def is_calibrated(self) -> bool:
        """A bound replayed over a grid of parameters (features, learned)."""
        return self.admission in ("features", "learned") or self.retention.startswith("features")

    @property
    def share(self) -> float | None:
        """The retention budget's share of the CPU tier (rule or oracle); None: none."""
        return retention_share(re.sub(r"^(oracle|features)", "session", self.retention))


def parse_policy(name: str) -> Policy:
    """``lru+reuse(2)+session`` -> ``Policy(eviction="lru", admission="reuse(2)",
    retention="session")``; raises ``ValueError`` naming the bad part."""
    expected = (
        f"<eviction_policy>[+<cpu_admission>][+<cpu_retention>] with an eviction_policy among "
        f"{', '.join(EVICTION_POLICIES)}, or +{' or +'.join(ORACLES)}, or belady"
    )
    eviction, *parts = [p.strip() for p in name.strip().split("+")]
    if eviction == "belady" and not parts:
        return Policy("belady", "belady")
    if eviction not in EVICTION_POLICIES:
        raise ValueError(f"--policies: {name!r}: expected {expected}, got {eviction!r}")
    admission, retention = "all", "none"
    for part in parts:
        bare = part.replace(" ", "")
        if bare.startswith(("session", "retention-oracle", "retention-features")):
            if retention != "none":
                raise ValueError(f"--policies: {name!r}: expected one cpu_retention, got a second: {part!r}")
            if bare.startswith("session"):
                retention = parse_cpu_retention(bare, f"--policies: {name!r}: cpu_retention")
                continue
            kind = "oracle" if bare.startswith("retention-oracle") else "features"
            try:  # retention-oracle(S): the oracle at session(S)'s budget; features alike
                share = parse_cpu_retention("session" + bare[len(f"retention-{kind}") :])
            except ValueError:
                raise ValueError(
                    f"--policies: {name!r}: expected retention-{kind} or retention-{kind}(S) with 0 < S <= "
                    f"{MAX_RETENTION_SHARE}, got {part!r}"
                ) from None
            retention = kind + share[len("session") :]
        elif admission != "all":
            raise ValueError(f"--policies: {name!r}: expected one cpu_admission, got a second: {part!r}")
        elif part in ("admission-oracle", "oracle"):
            admission = "oracle"
        elif part in ("admission-features", "admission-learned"):
            admission = part[len("admission-") :]
        else:
            try:
                admission = parse_cpu_admission(part, f"--policies: {name!r}: cpu_admission")
            except ConfigError as exc:
                raise ValueError(f"{exc}; or expected {expected}") from None
    if admission == "learned" and retention.startswith("features"):  # each has its own grid
        raise ValueError(f"--policies: {name!r}: expected admission-learned without retention-features")
    canonical = [eviction]
    canonical += [] if admission == "all" else [_admission_name(admission)]
    canonical += (
        []
        if retention == "none"
        else [f"retention-{retention}" if retention.startswith(("oracle", "features")) else retention]
    )
    return Policy("+".join(canonical), eviction, admission, retention)


def _admission_name(admission: str) -> str:
    return f"admission-{admission}" if admission in _BOUND_ADMISSIONS else admission


# ---------------------------------------------------------------- the stream


@dataclass(frozen=True)
class Requests:
    """What a replay plays: per request its full blocks' hashes, arrival (seconds) and
    session; ``named``: the engine names the sessions (vLLM's ``session_id``), so the
    retention rule is told them instead of inferring them; ``outputs``: the tokens each
    generated, where the trace says (else none)."""

    name: str
    blocks: list[list[bytes]]
    times: list[float]
    sessions: Sequence[Hashable]
    named: bool = False
    tokens_per_block: int = TOKENS_PER_BLOCK
    outputs: Sequence[int] = ()

    @classmethod
    def of(
        cls,
        name: str,
        requests: Sequence[Sequence],
        times: Sequence[float] | None = None,
        outputs: Sequence[int] = (),
    ) -> Requests:
        """Block ids (ints or bytes) with times (default all 0), sessions by prefix chain."""
        blocks = [[h.to_bytes(8, "big") if isinstance(h, int) else h for h in r] for r in requests]
        t = list(times) if times is not None else [0.0] * len(blocks)
        return cls(name, blocks, t, chain_sessions(blocks), outputs=outputs)

    @property
    def working_set(self) -> int:
        return len({h for r in self.blocks for h in r})


def chain_sessions(requests: Sequence[Sequence[bytes]]) -> list[int]:
    """Each request's session by its prefix chain, as ``SessionRetention`` infers it: a
    request containing the last block of a session's latest request extends it (the
    deepest such block decides), each such block claimed once."""
    tails: dict = {}
    out: list[int] = []
    for r in requests:
        s = next((tails.pop(h) for h in reversed(r) if h in tails), None)
        if s is None:
            s = len(out)
        out.append(s)
        if r:
            tails[r[-1]] = s
    return out


def mooncake_requests(path: Path) -> Requests:
    """A Mooncake FAST'25 trace (file order; timestamps in ms -> s)."""
    t = read_mooncake(path)
    return Requests.of(t.name, t.requests, [ms / 1e3 for ms in t.timestamps], t.output_tokens)


# ---------------------------------------------------------------- oracles


class OracleAdmission(DecidedAdmission):
    """Admits a block only while the trace still has a use of it to come."""

    def __init__(self, requests: Sequence[Sequence], stats: TieredStats):
        super().__init__(stats)
        self.remaining = Counter(h for r in requests for h in r)

    def used(self, block_hashes: Sequence) -> None:
        self.remaining.subtract(block_hashes)
        for h in block_hashes:
            self._decision[h] = self.remaining[h] > 0


class OracleRetention(SessionRetention):
    """Retention that knows the future: after request ``current`` it holds the blocks its
    session's next request reuses, until that request arrives; past the budget the hold
    that ends last gives up blocks first. The replay sets ``current`` before each request."""

    def __init__(self, reqs: Requests, num_slots: int, share: float, clock):
        super().__init__(num_slots, share, min_turns=1, max_sessions=len(reqs.blocks) + 1, clock=clock)
        self._reqs = reqs
        self._next: list[int | None] = [None] * len(reqs.blocks)
        later: dict = {}
        for i in range(len(reqs.blocks) - 1, -1, -1):
            self._next[i] = later.get(reqs.sessions[i])
            later[reqs.sessions[i]] = i
        self.current = -1
        self._planned = -1

    def observe(
        self, block_hashes: Sequence[bytes], session: Hashable | None = None, request: Hashable | None = None
    ) -> None:
        i = self.current
        if i == self._planned or i < 0:
            return
        self._planned = i
        s_id = self._reqs.sessions[i]
        s = self._sessions.get(s_id)
        if s is None:
            s = self._sessions[s_id] = _Session(self.clock(), None)
        before, s.held = s.held, []
        j = self._next[i]
        if j is not None:
            reused = set(self._reqs.blocks[j])
            hold = [h for h in self._reqs.blocks[i] if h in reused]
            if hold:
                self._hold(s_id, s, hold, self._reqs.times[j] + 1e-3)
        self._drop(before)

    def _rank(self, deadline: float) -> float:
        return -deadline


# ---------------------------------------------------------------- the replay


@dataclass
class Outcome:
    """Blocks requested and served per tier; ``turns``: requests whose session's previous
    request shares a prefix with them, ``survived_*``: of those, the ones that found all
    of that prefix in CPU / in any tier when they arrived."""

    policy: str
    blocks: int = 0
    cpu_hits: int = 0
    lower_hits: int = 0
    turns: int = 0
    survived_cpu: int = 0
    survived_any: int = 0
    held_share: float = 0.0

    @property
    def hit_rate(self) -> float:
        return (self.cpu_hits + self.lower_hits) / max(1, self.blocks)

    @property
    def cpu_rate(self) -> float:
        return self.cpu_hits / max(1, self.blocks)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _disk(work: Path, blocks: int) -> DiskOffloadingManager:
    return DiskOffloadingManager(
        work,
        Fingerprint.from_layout(_LAYOUT, model_id="replay-policies"),
        _LAYOUT,
        disk_bytes=blocks * slot_size_for(_LAYOUT.bytes_per_block),
        enable_events=False,
        poll_interval=None,
    )


def _common_prefix(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def replay(
    reqs: Requests,
    capacity: int,
    policy: Policy | str,
    lower_blocks: int = 0,
    scratch: Path | None = None,
    features: tuple[float, float | None] | None = None,
) -> Outcome:
    """Play ``reqs`` through the product's managers under ``policy`` (module docstring):
    ``capacity`` CPU blocks, over a disk tier of ``lower_blocks`` (none when 0).
    ``features``: a features bound's (threshold, gap quantile), the learned bound's
    (threshold, horizon)."""
    policy = parse_policy(policy) if isinstance(policy, str) else policy
    if policy.eviction == "belady":
        raise ValueError("belady is computed (belady_hit_rate), not replayed")
    if policy.is_calibrated and features is None:
        raise ValueError(f"{policy.name}: a bound is replayed at its (threshold, quantile or horizon): features=")
    threshold, quantile = features or (0.0, 0.0)
    clock = _Clock()
    retention: SessionRetention | None = None
    if policy.share is not None:
        if policy.retention.startswith("oracle"):
            retention = OracleRetention(reqs, capacity, policy.share, clock)
        elif policy.retention.startswith("features"):
            assert quantile is not None
            retention = FeatureRetention(
                reqs.blocks, reqs.times, reqs.sessions, capacity, policy.share, threshold, quantile, clock
            )
        else:
            retention = SessionRetention(capacity, policy.share, clock=clock)
    oracle = policy.admission in _BOUND_ADMISSIONS
    n = 2 if oracle else admit_after(policy.admission, "cpu")
    cpu = cpu_tier_manager(
        policy.eviction,
        capacity,
        reqs.tokens_per_block,
        enable_events=False,
        admit_after=n,
        retention=retention,
        adaptive=not oracle and adaptive_admission(policy.admission),
    )
    work = Path(tempfile.mkdtemp(prefix="replay-policies-", dir=scratch)) if lower_blocks else None
    lower = _disk(work, lower_blocks) if work is not None else None
    manager = TieredOffloadingManager(cpu, lower, costs=None, cost_aware=False)
    future: DecidedAdmission | None = None
    if policy.admission == "oracle":
        future = OracleAdmission(reqs.blocks, manager.stats)
    elif policy.admission == "features":
        future = FeatureAdmission(reqs.blocks, reqs.sessions, threshold, manager.stats)
    elif policy.admission == "learned":
        outputs = reqs.outputs or [0] * len(reqs.blocks)
        p = learned_probabilities(reqs.blocks, reqs.times, reqs.sessions, outputs, quantile, capacity)
        future = LearnedAdmission(p, threshold, manager.stats)
    if future is not None:
        cpu.admission = future
    out = Outcome(policy.name)
    previous: dict = {}
    held = 0
    try:
        for i, (keys, t, session) in enumerate(zip(reqs.blocks, reqs.times, reqs.sessions)):
            clock.now = t
            if isinstance(retention, (OracleRetention, FeatureRetention)):
                retention.current = i
            elif retention is not None:
                retention.session = session if reqs.named else None
            k = manager.lookup(keys)
            c = _common_prefix(previous.get(session, ()), keys)
            if c:
                out.turns += 1
                out.survived_any += k >= c
                out.survived_cpu += cpu.lookup(keys) >= c
            previous[session] = keys
            out.blocks += len(keys)
            if k:
                in_cpu = sum(1 for h in keys[:k] if manager.hit_tier(h) == -1)
                out.cpu_hits += in_cpu
                out.lower_hits += k - in_cpu
                manager.prepare_load(keys[:k])
                manager.complete_load(keys[:k])
            if future is not None:
                future.used(keys)
            stored = manager.prepare_store(keys)
            if stored is not None:
                manager.complete_store(stored.block_hashes_to_store)
                spec = spec_as(stored.store_spec, TieredStoreSpec)
                for tier, writes in zip(manager.lower, spec.tier_write_through):
                    tier.complete_store(writes.block_hashes)
                for tier, writes in zip(manager.lower, spec.tier_spills):
                    tier.complete_store(writes.block_hashes)
            manager.touch(keys)
            if retention is not None:
                held += retention.num_held()
    finally:
        manager.shutdown()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    out.held_share = held / max(1, len(reqs.blocks)) / capacity
    return out


def replay_hit_rate(requests: Sequence[Sequence[int]], capacity: int, policy: str) -> float:
    """Leading-run block hits over all blocks of ``requests`` (block ids, all at time 0)
    through the product's managers under ``policy``, ``capacity`` CPU blocks."""
    return replay(Requests.of("requests", requests), capacity, policy).hit_rate


def with_oracle_rows(policies: list[str]) -> list[str]:
    """``policies`` plus, unless given, each eviction policy's admission oracle, its
    retention oracle where a row varies retention, and ``belady``."""
    parsed = [parse_policy(p) for p in policies]
    out = [p.name for p in parsed]
    for eviction in dict.fromkeys(p.eviction for p in parsed if p.eviction != "belady"):
        oracles = [f"{eviction}+admission-{a}" for a in _BOUND_ADMISSIONS]
        for p in parsed:
            if p.eviction == eviction and p.share is not None and not p.is_oracle:
                oracles.append(parse_policy(f"{eviction}+retention-oracle({p.share:g})").name)
                oracles.append(_features_bound(p))
        out += [o for o in dict.fromkeys(oracles) if o not in out]
    if "belady" not in out:
        out.append("belady")
    return out


def _features_bound(p: Policy) -> str:
    """The retention features bound beside retention row ``p``, at its admission."""
    admission = "" if p.admission == "all" else f"+{p.admission}"
    return parse_policy(f"{p.eviction}{admission}+retention-features({p.share:g})").name


def policy_table(reqs: Requests, capacity: int, policies: list[str], log=None) -> tuple[str, dict[str, tuple]]:
    """The markdown table and ``{policy: (hit rate, Belady, ratio)}``."""
    belady = belady_hit_rate(reqs.blocks, capacity)
    infinite = infinite_hit_rate(reqs.blocks)
    rows, values = [], {}
    for name in policies:
        policy = parse_policy(name)
        t0 = time.perf_counter()
        label = policy.name
        if policy.eviction == "belady":
            rate = belady
        elif policy.is_calibrated:
            learned = policy.admission == "learned"
            quantiles = QUANTILES if policy.share is not None else QUANTILES[:1]
            grid = LEARNED_GRID if learned else [(t, q) for t in THRESHOLDS for q in quantiles]
            results = [(replay(reqs, capacity, policy, features=tq).hit_rate, tq) for tq in grid]
            rate, (t, q) = max(results, key=lambda r: r[0])  # the first of the grid that does best
            second = f", horizon {'ever' if q is None else f'{q:g} CPU tiers'}" if learned else ""
            if not learned and policy.share is not None:
                second = f", gap quantile {q:g}"
            label = f"{policy.name} (threshold {t:g}{second})"
        else:
            rate = replay(reqs, capacity, policy).hit_rate
        if log is not None:
            log(f"  {label}: {rate:.3f} ({time.perf_counter() - t0:.1f} s)")
        ratio = rate / belady if belady else 0.0
        values[policy.name] = (rate, belady, ratio)
        rows.append([label, f"{rate:.3f}", f"{belady:.3f}", f"{infinite:.3f}", f"{ratio:.2f}"])
    return md_table(COLUMNS, rows), values


def bound_table(values: dict[str, tuple], target: float = 0.05) -> str:
    """Per mechanism: the best online rule beside its oracle, and beside the bound of
    rules deciding on the features the tier sees, in shares of Belady."""
    rows = []
    policies = {name: parse_policy(name) for name in values}
    for label, mechanism, oracle_of in (
        ("eviction order", "eviction order", lambda p: "belady"),
        ("admission", "admission", lambda p: f"{p.eviction}+admission-oracle"),
        ("admission on features", "admission", lambda p: f"{p.eviction}+admission-features"),
        ("admission, learned", "admission", lambda p: f"{p.eviction}+admission-learned"),
        ("retention", "retention", lambda p: parse_policy(f"{p.eviction}+retention-oracle({p.share:g})").name),
        ("retention on features", "retention", _features_bound),
    ):
        online = [p for p in policies.values() if not p.is_oracle and p.mechanism == mechanism]
        pairs = [(p, oracle_of(p)) for p in online if oracle_of(p) in values]
        if not pairs:
            continue
        best, bound = max(pairs, key=lambda pb: values[pb[0].name][0])
        gap = values[bound][2] - values[best.name][2]
        rows.append(
            [
                label,
                best.name,
                f"{values[best.name][2]:.2f}",
                bound,
                f"{values[bound][2]:.2f}",
                f"{gap:+.2f}",
                "yes" if gap <= target else "no",
            ]
        )
    return md_table(
        ["mechanism", "best online rule", "of Belady", "its bound", "of Belady", "bound - rule", f"within {target}"],
        rows,
    )


def main_policies(args, argv: Sequence[str]) -> int:
    """``tools/replay.py --policies``: print the tables for ``args.trace``."""
    started = time.perf_counter()
    command = "python tools/replay.py " + " ".join(argv)
    try:
        if args.trace is None:
            raise ValueError("--policies needs --trace FILE (a Mooncake FAST'25 trace, JSON lines)")
        policies = with_oracle_rows([p for p in args.policies.split(",") if p.strip()])
        capacity = parse_tokens(args.cpu_tokens) // TOKENS_PER_BLOCK
        if capacity < 1:
            raise ValueError(f"--cpu-tokens: {args.cpu_tokens!r} holds no {TOKENS_PER_BLOCK}-token block")
        reqs = mooncake_requests(Path(args.trace))
        table, values = policy_table(reqs, capacity, policies)
    except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: a bound's missing dependency
        print(f"error: {exc}")
        return 2
    blocks = sum(map(len, reqs.blocks))
    print(
        f"command: `{command}`\n\ntrace: {args.trace}: {len(reqs.blocks)} requests, {blocks} full blocks, "
        f"{reqs.working_set} distinct, {len(set(reqs.sessions))} sessions by prefix chain; CPU tier: {capacity} "
        f"blocks of {TOKENS_PER_BLOCK} tokens; no device cache; requests in file order, the retention rule's "
        f"clock at their timestamps\n\n{table}\n\n{bound_table(values)}\n\n"
        f"wall time: {time.perf_counter() - started:.1f} s"
    )
    return 0
