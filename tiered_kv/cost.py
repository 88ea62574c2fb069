"""What a load costs against recomputing: live per-tier load estimates and the decision.

Runs in the scheduler process, inside the composite manager's ``lookup``; no I/O. The
estimates are fed with finished transfers (bytes and seconds as the handlers measure
them, ``TieredStats.record_transfer``); where the handlers run in another process, the
engine adapter passes their results on (``LoadCosts.observe``).

Model, per request (the leading blocks a lookup found offloaded, each with the tier that
would serve it, from token ``start`` on), with the engine's queues in view (``Queues``):

    cost(k) = sum over tiers t holding some of the first k blocks of
                  latency_t + (queued_t + blocks of t loaded) x block_t
              - prefill of those k blocks x (1 + gpu_waiting x busy + arrivals x R / 2)

``block_t`` is one block's load time at tier t's estimated bandwidth, ``queued_t`` the
blocks already queued there (loads and writes in flight: this request waits behind
them), ``gpu_waiting`` the requests waiting for their first GPU step, ``busy`` the share
of recent time the GPU spent computing (``busy_share``, from the steps the adapter
reports through ``note_step``; 1 where it reports none), and ``arrivals x R / 2`` those
expected to arrive while the whole run recomputes (``R`` seconds, at the arrival rate
the adapter reports through ``note_arrival``), each waiting about half of it. A waiting
request waits for the GPU only while the GPU computes: where it is idle half the time,
the queue waits on something else (device memory held by loads, most often), which a
recompute does not lengthen, so a recompute delays each waiting request by the busy
share of its seconds. The decision is ``argmin_k cost(k)`` over ``k = 0 .. n``: zero
(load nothing, recompute everything) is always a candidate. An idle engine reduces this
to comparing each block's load with its prefill; under load the GPU's queue makes
recomputing dearer (a tier is a parallel resource) and a tier's queue makes loading
dearer (a tier busy with writes or other loads is passed over while it is).

A block's prefill includes attention: the ``tokens_per_block`` tokens ending at token
``p`` cost ``tokens_per_block x (1 + attention_per_token x (p - (tokens_per_block - 1) / 2))``
tokens of linear work (every token attends to itself and all before it;
``attention_per_token`` is one attended token's FLOPs over one token's ``2 x parameters``,
from the model's shape: ``attention_per_token``). Loads from several tiers are summed (no
overlap assumed, as ``tools/replay_model.py``).

Each tier's ``bandwidth`` and per-job ``latency`` are an exponentially weighted
least-squares fit of ``seconds = latency + bytes / bandwidth`` over its recent jobs,
seeded with a prior (configured, or the medium's default in ``PRIOR_GBPS``). A tier
the decision passes over gets no new jobs, so its estimate would never recover: every
``probe_every`` passed-over decisions, or ``probe_after_s`` seconds after its last
sample, the decision loads up to the first block of that tier anyway (one block's load
at most more than the best plan), which samples it again; only while the tier has at
most ``probe_queue_blocks`` blocks queued, so a probe never waits behind a backlog
(which the sample would not measure, and the request would pay). Queued writes hold a
probe back for ``STALE_PROBES`` x ``probe_after_s`` at most: a write-through tier may
never be without them, and a tier never sampled again would never be used again. A
sample after such a silence replaces the estimate (``TierCost.restart``): one probe
then brings back a tier whose failures had collapsed it.

Prefill tokens per second (of linear work) and the attention term come from
``tiered_kv.prefill`` (configured, else estimated from the model and the GPU). Where the
engine times its forward passes (``observe`` of ``PREFILL``: the linear work of a step
that was nearly all prefill, attention included as above, and its seconds), the rate is
fitted as a tier's cost is (``seconds = per-step overhead + work / rate``, the marginal
rate being what recomputing more costs) and replaces the estimate; a configured rate is
kept, the measured one only reported beside it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any
from tiered_kv.prefill import DEFAULT_ATTENTION_PER_TOKEN, DEFAULT_PREFILL_TOKENS_PER_S

#: A passed-over tier with writes queued is probed through them once its last sample is
#: this many ``probe_after_s`` old (an unsampled tier would never be used again).
STALE_PROBES = 10
#: Load bandwidth into the GPU before any sample, GB/s, by tier medium: CPU over PCIe 5.0
#: x16 (~80% of 63 GB/s), one PCIe 4.0 NVMe drive, an object store over a network.
PRIOR_GBPS = {"CPU": 50.0, "DISK": 6.0, "REMOTE": 1.0}
#: Per-job latency before any sample, seconds: 0 by default, so the prior alone
#: judges by bandwidth (break-even = KV bytes per token x prefill tokens/s).
PRIOR_LATENCY_S = {"CPU": 0.0, "DISK": 0.0, "REMOTE": 0.0}
#: A job whose seconds are more than this many times the estimate's (or less than its
#: inverse) is folded in at that bound, unless the job before it was such a job too:
#: one stalled job then costs a tier a few probes, not many minutes of them (a 60 s
#: stall of a 64-block job among 8-block jobs at 6 GB/s leaves about 2 GB/s, not
#: 0.003 GB/s), while a real change is followed one job later than without the bound.
OUTLIER_FACTOR = 4.0
#: The timing type of a forward pass that was nearly all prefill (tokens, seconds),
#: beside the load transfer types (``load_transfer_types``).
PREFILL = "prefill"
#: Arrivals, and the GPU's steps, counted over this many seconds for the rate of
#: requests a recompute delays and the share of time the GPU computes.
ARRIVAL_WINDOW_S = 30.0


class TierCost:
    """Load cost of one tier into the GPU: ``seconds = latency_s + bytes / (gbps x 1e9)``.

    An exponentially weighted least-squares fit over recent jobs (weight ``alpha`` for
    the newest; a lone outlier bounded, ``OUTLIER_FACTOR``), seeded with the prior as
    one job. Where recent jobs are all of one size the fit cannot split latency from
    bandwidth: the latency is kept and the bandwidth fitted. The prior is one job of ``ref_bytes`` (best: the tier's block size, so that
    a few jobs of that size outweigh it). Thread-safe."""

    def __init__(self, name: str, gbps: float, latency_s: float = 0.0, alpha: float = 0.2, ref_bytes: int = 1 << 20):
        if not gbps > 0 or not latency_s >= 0 or not 0 < alpha <= 1:
            raise ValueError(
                f"tier {name!r}: expected gbps > 0, latency_s >= 0 and 0 < alpha <= 1, got {gbps}, {latency_s}, {alpha}"
            )
        self.name = name
        self.prior = (gbps, latency_s)
        self.alpha = alpha
        self.gbps, self.latency_s = gbps, latency_s
        self.samples = 0
        self._last_outlier = False  # the last job was outside ``OUTLIER_FACTOR``
        self.last_sample: float | None = None  # time.monotonic() of the newest sample
        self._lock = threading.Lock()
        ref = max(1, ref_bytes)
        self._m = self._moments(ref, latency_s + ref / (gbps * 1e9))

    @staticmethod
    def _moments(x: float, y: float) -> list[float]:
        return [x, y, x * x, x * y]

    def observe(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        """Fold in one finished job of ``nbytes`` that took ``seconds``."""
        if nbytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        with self._lock:
            expected = self.latency_s + nbytes / (self.gbps * 1e9)
            bounded = min(max(seconds, expected / OUTLIER_FACTOR), expected * OUTLIER_FACTOR)
            outlier, after_outlier = bounded != seconds, self._last_outlier
            self._last_outlier = outlier
            if outlier and not after_outlier:
                seconds = bounded
            a = self.alpha
            m = [old + a * (v - old) for old, v in zip(self._m, self._moments(nbytes, seconds))]
            mx, my, mxx, mxy = m
            var = mxx - mx * mx
            # Sizes within ~10% of each other (chunked prefill's steps, one block size) say
            # nothing of a fixed cost: timing noise would fit one that swallows each job.
            slope = (mxy - mx * my) / var if var > 0.01 * mx * mx else 0.0
            latency = my - slope * mx
            if slope <= 0 or latency < 0:  # one job size, or noise: keep the latency
                latency = min(self.latency_s, 0.9 * my)
                slope = (my - latency) / mx
            gbps = 1 / (slope * 1e9) if slope > 0 else math.inf
            if not (gbps > 0 and math.isfinite(mxx + mxy + latency + gbps)):
                return  # a sample past float range (a forged total): the estimate stays
            self._m = m
            self.gbps, self.latency_s = gbps, latency
            self.samples += 1
            self.last_sample = time.monotonic() if now is None else now

    def restart(self, nbytes: int, seconds: float, now: float) -> None:
        """Forget the fit: one job of ``nbytes`` that took ``seconds`` is the estimate,
        the latency kept (where it fits in the job). For a sample after a long silence,
        which says more of the tier now than every older one."""
        if nbytes <= 0 or not 0 < seconds < math.inf:
            return
        with self._lock:
            latency = min(self.latency_s, 0.9 * seconds)
            self._m = self._moments(nbytes, seconds)
            self.gbps, self.latency_s = nbytes / ((seconds - latency) * 1e9), latency
            self._last_outlier = False
            self.samples += 1
            self.last_sample = now

    def seconds(self, nbytes: int) -> float:
        """Estimated seconds of one job loading ``nbytes``."""
        return self.latency_s + nbytes / (self.gbps * 1e9)

    def snapshot(self) -> dict:
        return {"gbps": self.gbps, "latency_s": self.latency_s, "samples": self.samples}


def load_transfer_types(tier_names: Iterable[str]) -> dict[str, str]:
    """Which finished-transfer type samples which tier's load cost: ``cpu_to_gpu`` the
    CPU tier's, ``<name>_to_gpu`` and ``<name>_to_cpu`` lower tier ``<name>``'s."""
    types = {"cpu_to_gpu": "cpu"}
    for name in tier_names:
        if name != "cpu":
            types[f"{name}_to_gpu"] = name
            types[f"{name}_to_cpu"] = name
    return types


class _Window:
    """Values noted with their time, summed over the last ``ARRIVAL_WINDOW_S``."""

    def __init__(self) -> None:
        self._noted: deque[tuple[float, float]] = deque()
        self._sum = 0.0
        self.first: float | None = None  # when the first value was noted

    def add(self, now: float, value: float = 1.0) -> None:
        if self.first is None:
            self.first = now
        self._noted.append((now, value))
        self._sum += value
        self.total(now)

    def total(self, now: float) -> float:
        """The sum of the values noted within the window before ``now``."""
        noted = self._noted
        while noted and now - noted[0][0] > ARRIVAL_WINDOW_S:
            self._sum -= noted.popleft()[1]
        if not noted:
            self._sum = 0.0  # no rounding left over from the values gone
        return self._sum


@dataclass(frozen=True)
class Queues:
    """What the decision sees of the engine's load as it decides (module docstring):
    requests waiting for their first GPU step, and per tier name the blocks queued there
    ahead of a new load (``TieredOffloadingManager.queued_blocks``). An engine adapter
    that sees no GPU queue leaves it 0: the decision of an idle GPU."""

    gpu_waiting: int = 0
    tier_blocks: Mapping[str, int] = field(default_factory=dict)
    #: Per tier name, the loads among ``tier_blocks`` (what a probe waits behind).
    tier_loads: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadPlan:
    """The decision for one request: load the first ``blocks``; ``skipped`` blocks per
    tier name passed over (slower than recomputing them); ``probe`` names the tier that
    a probe sampled (its blocks loaded although the estimate said skip), else None."""

    blocks: int
    skipped: dict[str, int]
    probe: str | None = None


class LoadCosts:
    """Per-tier cost estimates and the per-request decision (module docstring).

    ``tiers``: the ``TierCost`` of each tier by name (``cpu``, ``disk``, ...).
    ``transfer_types``: which finished-transfer type samples which tier (default:
    ``cpu_to_gpu`` -> ``cpu``, ``<name>_to_gpu`` and ``<name>_to_cpu`` -> ``<name>``).
    ``enabled=False`` loads every block found (the behaviour before the decision), while
    still keeping the estimates."""

    def __init__(
        self,
        tiers: Sequence[TierCost],
        *,
        bytes_per_block: int,
        tokens_per_block: int,
        prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
        prefill_configured: bool = False,
        attention_per_token: float = DEFAULT_ATTENTION_PER_TOKEN,
        enabled: bool = True,
        probe_every: int = 64,
        probe_after_s: float = 30.0,
        probe_queue_blocks: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ):
        if bytes_per_block < 1 or tokens_per_block < 1 or not prefill_tokens_per_s > 0:
            raise ValueError(
                "bytes_per_block, tokens_per_block and prefill_tokens_per_s must be > 0, got "
                f"{bytes_per_block}, {tokens_per_block}, {prefill_tokens_per_s}"
            )
        if probe_every < 1 or not probe_after_s > 0 or probe_queue_blocks < 0 or not attention_per_token >= 0:
            raise ValueError(
                "probe_every must be >= 1, probe_after_s > 0, probe_queue_blocks and attention_per_token >= 0, "
                f"got {probe_every}, {probe_after_s}, {probe_queue_blocks}, {attention_per_token}"
            )
        self.tiers = {t.name: t for t in tiers}
        self.bytes_per_block = bytes_per_block
        self.tokens_per_block = tokens_per_block
        self.prefill_tokens_per_s = prefill_tokens_per_s
        #: A configured rate is kept; else measured forward passes replace the estimate.
        self.prefill_configured = prefill_configured
        # seconds = overhead + tokens / rate, fitted as a tier's load cost is ("gbps" is
        # giga-tokens per second here), from the first measured step on: the estimate
        # is no sample of this engine.
        self.prefill_fit: TierCost | None = None
        self.attention_per_token = attention_per_token
        #: The engine's queues, as its adapter last saw them (``Queues``).
        self.queues = Queues()
        self.enabled = enabled
        self.probe_every, self.probe_after_s = probe_every, probe_after_s
        self.probe_queue_blocks = probe_queue_blocks
        self.clock = clock
        self.transfer_types = load_transfer_types(self.tiers)
        self._arrivals = _Window()  # request arrivals
        self._steps = _Window()  # the GPU's steps, in estimated seconds
        self._passed_over = dict.fromkeys(self.tiers, 0)  # decisions since the last probe
        self._since = dict.fromkeys(self.tiers, clock())  # when a tier was last sampled or probed

    @classmethod
    def for_tiers(
        cls,
        mediums: Mapping[str, str],
        *,
        bytes_per_block: int,
        tokens_per_block: int,
        prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
        priors: Mapping[str, float] | None = None,
        **kwargs,
    ) -> "LoadCosts":
        """Costs for tiers ``{name: medium}`` seeded from ``priors`` (GB/s by name), else
        from ``PRIOR_GBPS`` by medium."""
        tiers = [
            TierCost(
                name,
                (priors or {}).get(name, PRIOR_GBPS.get(medium, PRIOR_GBPS["REMOTE"])),
                PRIOR_LATENCY_S.get(medium, 0.0),
                ref_bytes=bytes_per_block,
            )
            for name, medium in mediums.items()
        ]
        return cls(
            tiers,
            bytes_per_block=bytes_per_block,
            tokens_per_block=tokens_per_block,
            prefill_tokens_per_s=prefill_tokens_per_s,
            **kwargs,
        )

    @property
    def break_even_gbps(self) -> float:
        """Load bandwidth at which a block loads as fast as it is recomputed."""
        return self.bytes_per_block / self.tokens_per_block * self.prefill_tokens_per_s / 1e9

    def observe(self, transfer_type: str, nbytes: int, seconds: float, success: bool = True) -> None:
        """A finished transfer (``TieredStats`` observer): samples the tier it read from;
        a failed load is charged its seconds plus the recompute of its ``nbytes``.
        ``PREFILL``: a forward pass of ``nbytes`` tokens of work (``prefill_work``: each
        weighted by the context it attends to), nearly all prefill, sampling the prefill
        rate (module docstring)."""
        if transfer_type == PREFILL:
            if not success or nbytes <= 0 or not 0 < seconds < math.inf:
                return
            if self.prefill_fit is None:
                self.prefill_fit = TierCost(PREFILL, nbytes / seconds / 1e9, ref_bytes=nbytes)
            else:
                self.prefill_fit.observe(nbytes, seconds, self.clock())
            if not self.prefill_configured:
                self.prefill_tokens_per_s = self.prefill_fit.gbps * 1e9
            return
        name = self.transfer_types.get(transfer_type)
        if name is None:
            return
        if not success:
            # A failed load cost its wait and then the recompute of its blocks: charged
            # as one job that took both, so a tier that stalls or fails is passed over
            # (a failure that came back at once must not read as a fast tier).
            if nbytes <= 0 or not 0 <= seconds < math.inf:
                return
            blocks = nbytes / self.bytes_per_block
            seconds += blocks * self.tokens_per_block / self.prefill_tokens_per_s
        tier, now = self.tiers[name], self.clock()
        if tier.last_sample is not None and now - tier.last_sample >= STALE_PROBES * self.probe_after_s:
            tier.restart(nbytes, seconds, now)  # the first sample after a stale spell
        else:
            tier.observe(nbytes, seconds, now)
        self._since[name] = now

    def plan(self, sources: Sequence[str], start: int = 0) -> LoadPlan:
        """Decide for a request whose leading offloaded blocks come from ``sources``
        (tier names, in block order), the first of them beginning at token ``start``."""
        return self.plan_runs([(name, len(list(group))) for name, group in groupby(sources)], start)

    def load_terms(self, name: str) -> tuple[float, float]:
        """Tier ``name``'s part of the cost under the current ``queues``: the wait before
        its first block (its latency and the blocks queued there), and each block's load."""
        tier = self.tiers[name]
        block = self.bytes_per_block / (tier.gbps * 1e9)
        return tier.latency_s + self.queues.tier_blocks.get(name, 0) * block, block

    def note_arrival(self) -> None:
        """A request arrived (the engine adapter's ``on_new_request``): the arrival rate."""
        self._arrivals.add(self.clock())

    @property
    def arrivals_per_s(self) -> float:
        """Requests arrived per second over the last ``ARRIVAL_WINDOW_S``."""
        return self._arrivals.total(self.clock()) / ARRIVAL_WINDOW_S

    def note_step(self, work: float) -> None:
        """The engine scheduled a forward pass of ``work`` tokens of linear work (each
        scheduled token weighted by the context it attends to, ``prefill_work``): its
        seconds at the prefill rate, plus the measured per-step overhead, count towards
        ``busy_share``."""
        if not work > 0 or not math.isfinite(work):
            return
        fit = self.prefill_fit
        self._steps.add(self.clock(), (fit.latency_s if fit is not None else 0.0) + work / self.prefill_tokens_per_s)

    @property
    def busy_share(self) -> float:
        """The share of the last ``ARRIVAL_WINDOW_S`` (or of the time since the first
        step, where shorter) the GPU spent in the steps ``note_step`` reported, at most 1;
        1 before any was reported (an adapter that reports none: every waiting request is
        taken to wait for the GPU)."""
        first = self._steps.first
        if first is None:
            return 1.0
        now = self.clock()
        span = min(ARRIVAL_WINDOW_S, now - first)
        return min(1.0, max(0.0, self._steps.total(now) / span)) if span > 0 else 1.0

    @property
    def gpu_delay(self) -> float:
        """The requests a recompute delays: its own, and those waiting for the GPU, each
        by the share of time the GPU computes (module docstring)."""
        return 1 + self.queues.gpu_waiting * self.busy_share

    def recompute_seconds(self, blocks: int, first: int, start: int = 0) -> float:
        """The prefill of blocks ``first .. first + blocks - 1`` of a run beginning at
        token ``start``, attention included (module docstring)."""
        tpb = self.tokens_per_block
        end_mean = start + tpb * (first + (blocks + 1) / 2)  # mean end token of the blocks
        work = tpb * blocks * (1 + self.attention_per_token * (end_mean - (tpb - 1) / 2))
        return work / self.prefill_tokens_per_s

    def plan_runs(self, runs: Sequence[Sequence[Any]], start: int = 0) -> LoadPlan:
        """``plan`` for the sources given as runs: ``(tier name, blocks)`` in block order.
        Within a run each next block saves at least as much prefill as the one before
        (attention) at the same load cost, so the score is concave along a run and only
        run ends are candidates: the cost is per run, not per block."""
        n = sum(m for _, m in runs)
        if not n or not self.enabled:
            return LoadPlan(n, {})
        per_block: dict[str, float] = {}
        # Requests arriving while the run is recomputed wait behind it too: about half its
        # recompute each, at the arrival rate.
        gpu_delay = self.gpu_delay + self.arrivals_per_s * self.recompute_seconds(n, 0, start) / 2
        score = best = 0.0
        best_k = k = best_run = 0
        for i, (name, m) in enumerate(runs):
            if name not in per_block:
                wait, per_block[name] = self.load_terms(name)
                score += wait
            score += per_block[name] * m - self.recompute_seconds(m, k, start) * gpu_delay
            k += m
            if score < best:  # a run that lowers the score lowers it most at its end
                best_k, best, best_run = k, score, i + 1
        if best_k == n:
            return LoadPlan(n, {})
        skipped: dict[str, int] = {}
        for name, m in runs[best_run:]:
            skipped[name] = skipped.get(name, 0) + m
        probe = self._probe(skipped, first=runs[best_run][0])
        if probe is None:
            return LoadPlan(best_k, skipped)
        # Load up to the probed tier's first block: one block of it, and what precedes it.
        k = best_k
        for name, m in runs[best_run:]:
            if name == probe:
                k += 1
                skipped[name] -= 1
                break
            k += m
            skipped[name] -= m
        return LoadPlan(k, {name: m for name, m in skipped.items() if m}, probe)

    def _probe(self, passed_over: Mapping[str, int], first: str) -> str | None:
        """The passed-over tier due for a sample, if any, among those with at most
        ``probe_queue_blocks`` queued (loads; writes only until its last sample is stale):
        only ``first``, the tier of the first block passed over, so a probe loads one block
        more than the best plan, never a slower run before the probed tier's first block."""
        now = self.clock()
        due = None
        loads, queued, bound = self.queues.tier_loads, self.queues.tier_blocks, self.probe_queue_blocks
        for name in passed_over:
            self._passed_over[name] += 1
            since = now - self._since[name]
            if (
                name == first
                and loads.get(name, 0) <= bound
                and (queued.get(name, 0) <= bound or since >= STALE_PROBES * self.probe_after_s)
                and (self._passed_over[name] >= self.probe_every or since >= self.probe_after_s)
            ):
                due = name
        if due is not None:
            self._passed_over[due] = 0
            self._since[due] = now
        return due

    def snapshot(self) -> dict:
        """Estimates and inputs, for stats and metrics."""
        fit = self.prefill_fit
        return {
            "enabled": self.enabled,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "prefill_source": "configured" if self.prefill_configured else "estimated" if fit is None else "measured",
            "prefill_measured": None
            if fit is None
            else {"tokens_per_s": fit.gbps * 1e9, "step_overhead_s": fit.latency_s, "steps": fit.samples + 1},
            "gpu_busy_share": None if self._steps.first is None else self.busy_share,
            "break_even_gbps": self.break_even_gbps,
            "tiers": {name: t.snapshot() for name, t in self.tiers.items()},
        }


class PrefixScan:
    """A request's leading offloaded blocks given one at a time, for an engine that asks
    block by block (vLLM 0.33). ``add`` answers whether loading every block so far is
    estimated faster than loading any shorter prefix of them: while it is, no block that
    follows can make ``LoadCosts.plan_runs`` load fewer, so those blocks may be promised
    at once. ``runs`` collects the blocks for the plan once the run is known whole. Each
    tier is judged by its estimate and the queues when the scan first meets it, the GPU's
    queue when it meets its first block."""

    def __init__(self, costs: LoadCosts):
        self.costs = costs
        self.runs: list[list] = []  # [tier name, blocks], plan_runs' form
        self.start: int | None = None  # the token the first block begins at
        self._per_block: dict[str, float] = {}  # per tier seen: load_terms' per block
        self._gpu_delay: float | None = None  # the decision's gpu_delay when the scan began
        self._score = self._best = 0.0
        self._paying = True

    def pays_alone(self, name: str) -> bool:
        """Whether, before any block is added, a run of tier ``name`` pays at every length
        (its first block's load, its wait included, beats recomputing it at the start of
        a prompt, and so does each next one, whose recompute only costs more): then
        ``add(name, ...)`` would answer True for every block of such a run. False once a
        block was added."""
        if self.runs:
            return False
        costs = self.costs
        if not costs.enabled:
            return True
        wait, per_block = costs.load_terms(name)
        return wait + per_block < costs.recompute_seconds(1, 0) * costs.gpu_delay

    def add(self, name: str, end: int) -> bool:
        """One more block, of tier ``name``, ending at token ``end``."""
        runs = self.runs
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
        costs = self.costs
        if self.start is None:
            self.start = max(0, end - costs.tokens_per_block)
        if not costs.enabled:
            return True
        per_block = self._per_block.get(name)
        if per_block is None:  # the tier's first block: its wait, once
            wait, per_block = costs.load_terms(name)
            self._per_block[name] = per_block
            self._score += wait
        if self._gpu_delay is None:  # read once: the queues stand still while a scan runs
            self._gpu_delay = costs.gpu_delay
        index = (end - self.start) // costs.tokens_per_block - 1  # of this block in the run
        self._score += per_block - costs.recompute_seconds(1, index, self.start) * self._gpu_delay
        if self._score < self._best:
            self._best = self._score
        else:
            self._paying = False
        return self._paying
