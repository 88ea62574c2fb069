"""Agentic conversations as closed loops in the serving replay, and the CPU-tier policy
table with time that ``tools/replay_claude_code.py --serving`` prints.

Runs in the replay's one process; reads nothing itself (the conversations come from
``replay_workloads.read_claude_code_folder``); each replayed row's disk tier keeps an
index under a temporary directory (``replay_serving_stack``), removed afterwards.

The workload (``sessions``), from kv-cache-tester's Claude Code conversations:

- **Chunks**: a request's full 512-token chunks, each named by its last 64-token block
  (which names its whole prefix), as ``replay_claude_code.write_mooncake`` writes them;
  a trailing partial chunk is always computed.
- **Closed loop**: a session (a conversation's main chain, or one sub-agent's) sends its
  next request when the previous one got its first token in the simulation plus the
  trace's gap between the two (``t[k+1] - t[k]``): the client's time between answer and
  next turn. That gap also holds the answer's decode and the trace's own first token (the
  trace's ``api_time``, a few seconds against a median gap of 20 s): decode is not
  simulated, so it stays in the gap, and the trace's first token is counted twice. A
  sub-agent's first request follows the latest request of its conversation's main chain
  at or before it (the one whose answer launched it), by their gap; the main chain goes
  on in parallel, as the trace's times show. A conversation's requests before any
  predecessor count from its start.
- **Long gaps**: a gap over ``max_gap_s`` (default 1 h) is cut to it: the user went away.
  Kept whole, the trace's 7 gaps over an hour (one of 21 h) would outlast every other
  conversation and leave the server idle for most of the replay.
- **Staggered starts, fixed concurrency**: ``users`` clients each run conversations back
  to back, the next one sent as its previous one's last request (in the trace's order) got
  its first token. Conversations are dealt longest first (by their duration at the
  trace's gaps), each to the client with the least work so far (LPT), so all clients end
  near together. By default ``users`` is the most the conversations keep busy to the end:
  their total duration over the longest one's (4 for the 30 files here), so the server
  sees a steady number of conversations until the last one ends.
- **Time scale**: every delay above (gaps, starts) is multiplied by one factor, chosen
  as the serving replay chooses its own: the GPU work of the ``recompute`` configuration
  (``replay_serving_workloads.estimate_work``, in the order the requests arrive with
  instant answers) over the span they then take is the target utilisation; the order
  does not depend on the factor, so neither does the work. Answers take time, which
  stretches a closed loop, so ``time_factor`` then replays ``recompute`` and scales the
  factor by its measured busy share over the target until they agree within 2% (at most
  8 replays, then the closest). At the trace's own gaps these 30 conversations keep one
  H100 a few per cent busy; the factor compresses their gaps 10-50x.

The retention rule (``cpu_retention: session``) runs on the replay's clock, simulated
seconds, while its constants are real ones (uses of a session under
``tiered_kv.tiered.retention.TURN_GAP_S``, 1 s, apart are one turn): compressed, a
session's turns closer than 1 s over the factor in the trace merge for it, so it sees
fewer returns than the turns counted here (the notes print both). A request's own uses
are one turn however far apart (the manager names the request).

What the clients send (``parse_row``: a row is ``<policy>[+disk][+ids][+hints[+prefetch]]``,
the policy's config values first, ``+disk`` for the disk tier's ``retention: session``
too, then what its clients send with each request):

- ``+ids``: each request names its session, as a client sends ``X-Session-ID`` (vLLM's
  ``session_id``): the conversation's id for its main chain, ``<conversation>/<agent>``
  for a sub-agent's. The replay keeps it in the request's ``ReqContext`` as the product's
  connector does (``RequestSession``), and the manager passes it with the request's loads
  and stores to ``cpu_retention``; so it needs a session rule (``lru+session+ids``).
  Without it, the rule infers sessions from the prefix chain.
- ``+hints``: KV hints synthesised from the sessions, as an agent framework (Dynamo's
  router, say) that knows them would send (``client_hints``; the product's reading is
  ``tiered_kv.integrations.vllm.hints``): every turn but its session's last carries
  ``kv.retain`` with ``lease_id`` its session (the ``+ids`` name) and ``ttl_s`` the
  product's ``DEFAULT_TTL_S`` (300 s) times the factor, the same compression as the
  gaps; its session's last turn carries ``kv.release`` instead (a client knows when its
  conversation, or its sub-agent, is done; the lease then ends at that turn's arrival,
  before its load). A fixed TTL, not a multiple of the session's gaps so far: the gaps
  are heavy-tailed (median 20 s, 95.7% under 300 s, some hours), so a session's past
  predicts its next gap poorly, while past 300 s the user has gone away and holding on
  is what the lease budget bounds. The lease runs from the turn's arrival and each load
  of its chunks renews it, so the turn's wait and prefill (not scaled) count against it.
- ``+prefetch`` (after ``+hints``): each turn also carries ``kv.prefetch`` (its disk
  chunks promoted into CPU while it waits); the simulated workers run the jobs
  (``build_stack``'s ``hint_prefetch``), prefetch while waiting staying off, so only
  the hint moves chunks.

The table (``policy_table``), one row per CPU-tier policy named by its config values
(``replay_policies.parse_policy``: ``lru``, ``lru+reuse(2)``, ``lru+session``,
...) and what its clients send, each built by ``replay_serving_stack.build_stack`` as
``HierarchySpec.get_manager`` builds the engine's, its retention rule on the replay's
clock, conversations inferred from the prefix chain unless the clients name them: hit rate (full chunks served by the GPU's prefix
cache, CPU, disk, and all), the share of turns (requests sharing a prefix with their
session's previous request) that found all of it in CPU, and in some tier, on arrival,
TTFT per request (mean, p50, p90, and p90 over LRU's), and the GPU's busy share.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from benchlib import md_table
from replay_policies import Policy, _common_prefix, parse_policy
from replay_serving import DEVICE_TOKENS, LATENCY_MS, run_config
from replay_serving_model import EngineConfig, GpuModel
from replay_serving_sim import Arrival, RunResult
from replay_serving_stack import TierModel
from replay_serving_workloads import TOKENS_PER_BLOCK, Stream, estimate_work
from replay_workloads import CLAUDE_CODE_BLOCK_TOKENS, AgentRequest
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import OffloadKey, make_offload_key

from tiered_kv.integrations.vllm.hints import DEFAULT_TTL_S, PREFETCH, RELEASE, RETAIN

#: Blocks of the trace in one chunk of the replay.
PER_CHUNK = TOKENS_PER_BLOCK // CLAUDE_CODE_BLOCK_TOKENS
MAX_GAP_S = 3600.0
COLUMNS = [
    "policy",
    "hit rate: GPU",
    "CPU",
    "disk",
    "all",
    "turns: prefix in CPU",
    "in any tier",
    "TTFT mean s",
    "p50 s",
    "p90 s",
    "p90 / lru's",
    "GPU busy",
]
#: What a row's clients may send, in this order after the policy (module docstring).
CLIENT_PARTS = ("ids", "hints", "prefetch")
ROW_FORM = (
    "<policy>[+disk][+ids][+hints[+prefetch]]: the policy's config values, +disk (the disk tier's retention: "
    "session as well), then +ids (each request names its "
    "session, for a cpu_retention session rule), +hints (kv.retain per turn, kv.release at a session's "
    "end), +prefetch (kv.prefetch per turn as well)"
)


@dataclass(frozen=True)
class Row:
    """A table row: the CPU tier's config values and what its clients send (module
    docstring): the session's name (``ids``), KV hints (``hints``), ``kv.prefetch`` too."""

    name: str
    policy: Policy
    ids: bool = False
    hints: bool = False
    prefetch: bool = False
    disk: bool = False  # the disk tier's ``retention: session`` (at its default share)


def parse_row(name: str) -> Row:
    """``lru+session+ids`` -> the ``lru+session`` policy, its clients naming sessions;
    raises ``ValueError`` naming the value and the forms accepted."""
    parts = [p.strip() for p in name.strip().split("+")]
    client: list[str] = []
    while len(parts) > 1 and parts[-1] in CLIENT_PARTS:
        client.insert(0, parts.pop())
    disk = len(parts) > 1 and parts[-1] == "disk"
    if disk:
        parts.pop()
    try:
        policy = parse_policy("+".join(parts))
    except ValueError as exc:
        raise ValueError(f"{exc}; a row with time is {ROW_FORM}") from None
    why = ""
    if client != sorted(set(client), key=CLIENT_PARTS.index):
        why = "each part once, in that order"
    elif "ids" in client and not disk and (policy.share is None or policy.retention.startswith("oracle")):
        why = f"+ids names the sessions for a cpu_retention session rule, and {policy.name} has none"
    elif "prefetch" in client and "hints" not in client:
        why = "+prefetch is a hint: +hints+prefetch"
    if why:
        raise ValueError(f"--policies: {name!r}: {why}; expected {ROW_FORM}")
    name = "+".join([policy.name, *(["disk"] if disk else []), *client])
    ids, hints, prefetch = (part in client for part in CLIENT_PARTS)
    return Row(name, policy, ids=ids, hints=hints, prefetch=prefetch, disk=disk)


@dataclass(frozen=True)
class Turn:
    """One request of the workload: its conversation, prompt tokens, full chunks' ids,
    the earlier request whose first token it waits for (an index; None: it counts from
    0), its delay after that in unscaled seconds, the chunks it shares with its
    session's previous request, its session's name (``<conversation>`` or
    ``<conversation>/<agent>``) and whether it is the last request of its session."""

    conversation: str
    tokens: int
    chunks: list[bytes]
    after: int | None
    delay: float
    prefix: int
    session: str = ""
    last: bool = False


@dataclass(frozen=True)
class Sessions:
    """The closed-loop workload (module docstring): its requests in the order they
    arrive with instant answers at ``times`` (unscaled), each one's predecessor before
    it; ``users`` clients; ``capped`` gaps cut to ``max_gap_s``."""

    name: str
    turns: list[Turn]
    times: list[float]
    users: int
    conversations: int
    capped: int
    max_gap_s: float

    @property
    def stream(self) -> Stream:
        """The requests as the serving replay's stream, at their instant-answer times."""
        return Stream(self.name, self.times, [t.tokens for t in self.turns], [t.chunks for t in self.turns])

    @property
    def makespan(self) -> float:
        return self.times[-1] - self.times[0]

    def arrivals(self, factor: float, row: Row | None = None) -> list[Arrival]:
        """The requests with every delay scaled by ``factor``, their chunks as vLLM's
        offload keys (one KV-cache group), one key object per distinct chunk, with what
        ``row``'s clients send (module docstring; None: nothing)."""
        keys: dict[bytes, OffloadKey] = {}
        ids, hints = row is not None and row.ids, row is not None and row.hints
        prefetch = row is not None and row.prefetch
        return [
            Arrival(
                t.delay * factor,
                t.tokens,
                [keys.get(h) or keys.setdefault(h, make_offload_key(h, 0)) for h in t.chunks],
                after=t.after,
                prefix=t.prefix,
                session=t.session if ids else None,
                hints=client_hints(t, DEFAULT_TTL_S * factor, prefetch, i) if hints else None,
            )
            for i, t in enumerate(self.turns)
        ]


def client_hints(turn: Turn, ttl_s: float, prefetch: bool, number: int) -> KvHintsEnvelope:
    """What a client that knows ``turn``'s session sends with it (request ``number``):
    ``kv.retain`` of its session's lease for ``ttl_s``, or at its session's last turn
    ``kv.release``; ``kv.prefetch`` before either where ``prefetch``."""
    lease = {"lease_id": turn.session}
    if turn.last:
        actions = [KvHintAction(f"{number}-release", RELEASE, "1", lease)]
    else:
        actions = [KvHintAction(f"{number}-retain", RETAIN, "1", {**lease, "ttl_s": ttl_s})]
    if prefetch:
        actions.insert(0, KvHintAction(f"{number}-prefetch", PREFETCH, "1", {}))
    return KvHintsEnvelope(protocol_version="1.0", message_id=f"m{number}", actions=actions)


def _chunks(r: AgentRequest) -> list[bytes]:
    full = r.tokens // TOKENS_PER_BLOCK
    return [r.blocks[PER_CHUNK * c + PER_CHUNK - 1].to_bytes(8, "big") for c in range(full)]


def _conversation(reqs: Sequence[AgentRequest], max_gap_s: float) -> tuple[list[tuple], int]:
    """One conversation's requests (time order) as ``(predecessor, delay, prefix,
    offset)`` with predecessors as indices into ``reqs`` (None: from the start) and
    ``offset`` the time from its start with instant answers; and the gaps cut."""
    last: dict[tuple[str, str], int] = {}
    main: int | None = None
    out: list[tuple] = []
    capped = 0
    for k, r in enumerate(reqs):
        pred = last.get(r.session)
        if pred is None and r.session[1]:
            pred = main  # a sub-agent's first request: launched by the main chain's latest
        gap = r.time - (reqs[pred].time if pred is not None else 0.0)
        capped += gap > max_gap_s
        delay = min(gap, max_gap_s)
        prev = last.get(r.session)
        prefix = _common_prefix(_chunks(reqs[prev]), _chunks(r)) if prev is not None else 0
        out.append((pred, delay, prefix, (out[pred][3] if pred is not None else 0.0) + delay))
        last[r.session] = k
        if not r.session[1]:
            main = k
    return out, capped


def auto_users(durations: Sequence[float]) -> int:
    """The most clients that the conversations keep busy to the end: their total
    duration over the longest one's (at least 1)."""
    longest = max(durations)
    return max(1, math.floor(sum(durations) / longest)) if longest > 0 else len(durations)


def sessions(
    agent_requests: Sequence[AgentRequest], users: int | None = None, max_gap_s: float = MAX_GAP_S
) -> Sessions:
    """The closed-loop workload of ``agent_requests`` (``read_claude_code_folder``)
    for ``users`` clients (None: ``auto_users``); module docstring."""
    if not max_gap_s > 0:
        raise ValueError(f"--max-gap-s: expected > 0, got {max_gap_s}")
    if users is not None and users < 1:
        raise ValueError(f"--users: expected >= 1, got {users}")
    by_conv: dict[str, list[AgentRequest]] = {}
    for r in agent_requests:
        by_conv.setdefault(r.session[0], []).append(r)
    if not by_conv:
        raise ValueError("no request")
    chains, capped = {}, 0
    for name, reqs in by_conv.items():
        chains[name], n = _conversation(reqs, max_gap_s)
        capped += n
    duration = {name: max(c[3] for c in chain) for name, chain in chains.items()}
    n_users = users or auto_users(list(duration.values()))
    order = sorted(by_conv, key=lambda name: (-duration[name], name))
    loads = [(0.0, u) for u in range(n_users)]
    start: dict[str, float] = {}
    previous: dict[str, str | None] = {}  # the conversation its client ran before it
    last_of_user: dict[int, str] = {}
    for name in order:
        load, u = heapq.heappop(loads)
        start[name], previous[name] = load, last_of_user.get(u)
        last_of_user[u] = name
        heapq.heappush(loads, (load + duration[name], u))
    rank = {name: i for i, name in enumerate(order)}
    # The request a conversation's client waits for before the next one: its last at instant answers.
    final = {name: max(range(len(c)), key=lambda k: (c[k][3], k)) for name, c in chains.items()}
    rows = sorted(
        ((start[name] + c[3], rank[name], k, name) for name, chain in chains.items() for k, c in enumerate(chain)),
    )
    index = {(name, k): i for i, (_, _, k, name) in enumerate(rows)}
    last_of = {(name, r.session): k for name, reqs in by_conv.items() for k, r in enumerate(reqs)}
    turns = []
    for _, _, k, name in rows:
        pred, delay, prefix, _ = chains[name][k]
        if pred is not None:
            after: int | None = index[(name, pred)]
        elif (prev := previous[name]) is not None:
            after = index[(prev, final[prev])]
        else:
            after = None
        r = by_conv[name][k]
        session = name if not r.session[1] else f"{name}/{r.session[1]}"
        last = k == last_of[(name, r.session)]
        turns.append(Turn(name, r.tokens, _chunks(r), after, delay, prefix, session, last))
    return Sessions(
        f"{len(by_conv)} conversations as closed loops",
        turns,
        [t for t, *_ in rows],
        n_users,
        len(by_conv),
        capped,
        max_gap_s,
    )


def time_factor(
    work_s: float,
    makespan_s: float,
    utilisation: float,
    busy_at: Callable[[float], float],
    rounds: int = 8,
    tolerance: float = 0.02,
) -> tuple[float, float, int]:
    """The factor on the delays (module docstring): from ``work_s`` over the span
    ``makespan_s`` at the target ``utilisation``, then scaled by ``busy_at(factor)``'s
    measured busy share over the target until within ``tolerance`` of it (at most
    ``rounds`` replays, then the closest: a closed loop's busy share is not monotonic in
    the factor, its span being its last conversation's); the factor, its busy share and
    the replays run."""
    if not 0 < utilisation <= 1:
        raise ValueError(f"--utilisation: expected 0 < u <= 1, got {utilisation}")
    factor = work_s / utilisation / makespan_s if makespan_s > 0 and work_s > 0 else 1.0
    best = (math.inf, factor, 0.0)
    for n in range(1, rounds + 1):
        busy = busy_at(factor)
        best = min(best, (abs(busy - utilisation), factor, busy))
        if abs(busy - utilisation) <= tolerance * utilisation or busy <= 0:
            return factor, busy, n
        factor *= busy / utilisation
    return best[1], best[2], rounds


@dataclass(frozen=True)
class Setup:
    """What every row shares: the model, the engine, the disk tier, the capacities."""

    gpu: GpuModel
    engine: EngineConfig
    tier: TierModel
    cpu_blocks: int
    disk_blocks: int
    config: str
    scratch: Path | None = None


def run_policy(policy: str, arrivals: Sequence[Arrival], setup: Setup, config: str | None = None) -> RunResult:
    """One row: ``arrivals`` (``Sessions.arrivals`` for the row's clients) through the
    product's managers with the CPU tier under ``policy`` (a row, ``parse_row``), in
    ``config`` (default ``setup``'s)."""
    row = parse_row(policy)
    p = row.policy
    if p.is_oracle:
        raise ValueError(f"--policies: {policy!r}: an oracle is replayed without time only (drop --serving)")
    return run_config(
        config or setup.config,
        arrivals,
        setup.gpu,
        setup.engine,
        setup.tier,
        setup.cpu_blocks,
        setup.disk_blocks,
        setup.scratch,
        cpu_retention=p.retention,
        cpu_admission=p.admission,
        eviction_policy=p.eviction,
        hint_prefetch=row.prefetch,
        disk_retention="session" if row.disk else "none",
    )


def hit_rates(r: RunResult, chunks: int) -> dict[str, float]:
    """Full chunks served by each source (GPU, CPU, disk) and in all, over ``chunks``."""
    out = {
        k: r.tokens[src] / TOKENS_PER_BLOCK / max(1, chunks)
        for k, src in (("GPU", "GPU"), ("CPU", "CPU"), ("disk", "tier"))
    }
    out["all"] = sum(out.values())
    return out


def policy_table(results: Sequence[tuple[str, RunResult]], chunks: int, belady: float | None = None) -> str:
    """The markdown table of the rows (module docstring); ``chunks``: full chunks
    requested, the hit rates' denominator; ``belady``: Belady's hit rate at the device +
    CPU capacity, adding the column ``of Belady`` (GPU + CPU hits over it)."""
    p90s = {name: float(np.percentile(r.ttft, 90)) for name, r in results}
    lru = p90s.get("lru")
    rows = []
    for name, r in results:
        t = np.asarray(r.ttft)
        p50, p90 = np.percentile(t, [50, 90])
        h = hit_rates(r, chunks)
        turns = r.survived["turns"]
        rows.append(
            [
                name,
                *(f"{h[k]:.3f}" for k in ("GPU", "CPU", "disk", "all")),
                *([f"{(h['GPU'] + h['CPU']) / belady:.2f}"] if belady else []),
                f"{r.survived['CPU'] / max(1, turns):.3f}",
                f"{r.survived['any'] / max(1, turns):.3f}",
                f"{t.mean():.2f}",
                f"{p50:.2f}",
                f"{p90:.2f}",
                f"{p90 / lru:.2f}" if lru else "-",
                f"{r.busy_s / r.span_s:.2f}",
            ]
        )
    columns = COLUMNS if not belady else [*COLUMNS[:5], "of Belady", *COLUMNS[5:]]
    return md_table(columns, rows, left=1)


def notes(results: Sequence[tuple[str, RunResult]], tier: TierModel) -> list[str]:
    """Per row: turns counted, chunks stored into CPU and promoted into it, and of both
    those ``cpu_admission`` turned away (ranked first to evict), disk hits and dropped writes, the span, what
    ``cpu_retention`` saw (returns: turns after a session's first, as it tells them), and
    what the hints did (``hint_note``)."""
    out = []
    for name, r in results:
        cpu, lower = r.tier_stats.get("cpu", {}), r.tier_stats.get(tier.name, {})
        stored = cpu.get("stores", 0)
        out.append(
            f"- {name}: {r.survived['turns']:,} turns; CPU stored {stored:,} chunks and promoted "
            f"{cpu.get('promotions', 0):,}, of them {cpu.get('not_admitted', 0):,} not admitted (first to evict), "
            f"evicted {cpu.get('evictions', 0):,}; {tier.name} hits "
            f"{lower.get('hits', 0):,} chunks, writes dropped (back-pressure) {lower.get('drops', 0):,}; span "
            f"{r.span_s:,.0f} s, {r.steps:,} steps"
            + (
                f"; retention: {r.retention['returns']:,} returns seen, {r.retention['held']:,} chunk holds, "
                f"{r.retention['dropped']:,} dropped for its budget"
                if r.retention
                else ""
            )
            + hint_note(r, tier)
        )
    return out


def hint_note(r: RunResult, tier: TierModel) -> str:
    """What the manager did with the row's hints (``KvHints.snapshot``, and the peaks and
    leases on arrival the engine sampled); empty where none was sent."""
    actions, h = r.hints.get("actions", {}), r.hints
    if not actions:
        return ""
    arrived = h["on_arrival"]
    again = sum(arrived.get(f"{a}.again", 0) for a in (RETAIN, RELEASE))
    held = sum(arrived.get(f"{a}.held", 0) for a in (RETAIN, RELEASE))
    peak = h["peak"]
    counted = ", ".join(f"{k} {v:,}" for k, v in sorted(actions.items()))
    prefetched = r.prefetch.get(f"{tier.name}.prefetches", 0)
    return (
        f"; hints: actions {counted}; of {again:,} naming a lease an earlier turn named, {held:,} found it held "
        f"within its TTL on arrival; at most {peak.get('leases', 0):,} leases at once, pinning at most "
        f"{peak.get('cpu', 0):,} CPU and {peak.get(tier.name, 0):,} {tier.name} chunks; {h['lease_clipped']:,} "
        f"leased chunks left unpinned for the budget; at the end {h['leases']:,} leases"
        + (f"; {prefetched:,} chunks prefetched from {tier.name}" if r.prefetch else "")
    )


def replay(
    agent_requests: Sequence[AgentRequest],
    policies: Sequence[str],
    *,
    utilisation: float,
    users: int | None = None,
    max_gap_s: float = MAX_GAP_S,
    cpu_fraction: float = 0.25,
    disk_fraction: float = 0.5,
    config: str = "cost-aware",
    tier_gbps: float = 3.0,
    device_tokens: int = DEVICE_TOKENS,
    scratch: Path | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> tuple[str, list[tuple[str, RunResult]], Setup]:
    """Each policy's row over the closed-loop workload of ``agent_requests``: the
    header that says what ran, the rows, and what they shared. The CPU and disk tiers
    are ``cpu_fraction`` and ``disk_fraction`` of the working set; the device cache is
    ``device_tokens``, or the longest prompt where that is longer."""
    s = sessions(agent_requests, users, max_gap_s)
    stream = s.stream
    ws, longest = stream.working_set, max(stream.tokens)
    device_blocks = max(device_tokens // TOKENS_PER_BLOCK, -(-longest // TOKENS_PER_BLOCK))
    gpu, engine = GpuModel(), EngineConfig(device_blocks)
    tier = TierModel("disk", tier_gbps, LATENCY_MS["disk"] / 1e3, False)
    cpu_blocks, disk_blocks = max(1, round(cpu_fraction * ws)), max(1, round(disk_fraction * ws))
    setup = Setup(gpu, engine, tier, cpu_blocks, disk_blocks, config, scratch)
    work = estimate_work(stream, gpu, device_blocks, cpu_blocks, engine.token_budget)

    def busy_at(factor: float) -> float:
        r = run_policy("lru", s.arrivals(factor), setup, "recompute")
        log(f"  recompute at x{factor:.4g}: GPU busy {r.busy_s / r.span_s:.3f}")
        return r.busy_s / r.span_s

    factor, busy, rounds = time_factor(work, s.makespan, utilisation, busy_at)
    rows = [parse_row(name) for name in policies]
    results = []
    for row in rows:
        results.append((row.name, run_policy(row.name, s.arrivals(factor, row), setup)))
        log(f"  {row.name}: done")
    sub = sum(1 for r in agent_requests if r.session[1])
    chunks = sum(len(t.chunks) for t in s.turns)
    grown = " (grown to hold the longest prompt)" if device_blocks * TOKENS_PER_BLOCK > device_tokens else ""
    header = (
        f"workload: {s.conversations} conversations, {len(s.turns):,} requests ({sub} in sub-agents), "
        f"{sum(stream.tokens) / len(s.turns):,.0f} prompt tokens on average (longest {longest:,}), {chunks:,} full "
        f"chunks of {TOKENS_PER_BLOCK} tokens, working set {ws:,} chunks\n"
        f"closed loops: {s.users} clients running conversations back to back, longest first; each request "
        f"sent at its predecessor's first token + the trace's gap ({s.capped} gaps over {s.max_gap_s:g} s cut to it), "
        f"gaps x{factor:.4g} so recompute (CPU alone, LRU) keeps the GPU {busy:.2f} busy (target "
        f"{utilisation:g}, {rounds} calibrating replays; instant-answer estimate {work:,.0f} GPU s over "
        f"{s.makespan:,.0f} s unscaled)\n"
        f"model: Llama-3.1-8B on one H100 (prefill {gpu.linear_tokens_per_s:,.0f} tokens/s before attention at "
        f"{gpu.mfu:g} MFU), {engine.token_budget} tokens a step; configuration {config}\n"
        f"capacities: device {device_blocks:,} chunks{grown}, CPU {cpu_blocks:,} ({cpu_fraction:g} x working set, "
        f"{engine.cpu_gbps:g} GB/s), disk {disk_blocks:,} ({disk_fraction:g} x, {tier.gbps:g} GB/s, "
        f"{tier.latency_s * 1e3:g} ms a job)"
    )
    sent = []
    if any(row.ids for row in rows):
        sent.append("+ids: each request names its session")
    if any(row.hints for row in rows):
        sent.append(
            f"+hints: kv.retain (lease_id its session, ttl_s {DEFAULT_TTL_S:g} s x {factor:.4g} = "
            f"{DEFAULT_TTL_S * factor:.3g} s) on every turn but its session's last, which sends kv.release"
        )
    if any(row.prefetch for row in rows):
        sent.append("+prefetch: kv.prefetch on every turn")
    if sent:
        clients = len({t.session for t in s.turns})
        header += f"\nclients: {clients} sessions (conversations and sub-agents); " + "; ".join(sent)
    return header, results, setup
