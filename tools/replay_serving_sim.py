"""The discrete-event serving simulator behind ``tools/replay_serving.py``.

Runs in one process, single-threaded, in simulated seconds; no KV bytes move and no
model runs. I/O: none of its own (the managers it drives keep a small index under a
temporary directory, ``replay_serving_stack``).

One prefill instance (Mooncake's disaggregated prefill: a request ends at its first
token; decode is not modelled) steps as vLLM 0.33's scheduler does with the
``OffloadingConnector``:

- **Schedule** (at the step's start): running requests first (FCFS, chunked prefill),
  then requests whose loads finished, then waiting ones in arrival order, while the
  step's token budget lasts and fewer than ``max_seqs`` run. A waiting request takes its
  device prefix-cache hit (an LRU of ``device_blocks`` chunks), then the connector asks
  the manager chunk by chunk (``lookup(key, req_context)``: HIT and HIT_PENDING count,
  RETRY keeps scanning, MISS stops; any HIT_PENDING or RETRY defers the request to a
  later step, as does a hit chunk another request is still loading). A hit is loaded
  asynchronously (``prepare_load``; the request waits, using no budget, and runs once the
  load is reported done); no hit schedules its tokens at once. A request is admitted
  only while the prompts admitted and not finished fit in ``device_blocks`` (vLLM's
  block allocation; prompts are reserved whole, a simplification). At least one token
  of every prompt is computed.
- **Step end of the scheduler** (``build_connector_meta``): the chunks each scheduled
  request completes this step are offered to ``prepare_store``, finished requests get
  ``on_request_finished``, then ``on_schedule_end`` (where the manager reads the
  timings and decides the requests it deferred).
- **Forward pass**: ``step_overhead_s`` plus, per scheduled chunk of ``n`` tokens after
  ``c`` tokens of context, ``(2 x params x n + 4 x layers x hidden x (n x c + n(n+1)/2))
  / (mfu x peak FLOP/s)``: every token attends to itself and all before it. Load jobs
  start with it; store jobs (GPU -> CPU) start when it ends. Every step's work
  (``tiered_kv.prefill.prefill_work``, attention included) is noted (``note_step``), and a
  step that loads nothing is timed into ``LoadTimings`` (``PREFILL``), as the connector does.
- **Reports**: jobs that ended by a step's end are reported at the next step
  (``complete_load`` / ``complete_store``); loaded chunks enter the device cache.
- **Prefetch** (a configuration that turns it on, ``replay_serving_stack.PREFETCHING``):
  the manager learns each request's keys when it arrives, as ``prefetch_jobs``'s
  connector places them; after ``on_schedule_end`` the step's prefetch jobs
  (``KvHints.take_jobs``) are read chunk by chunk on the lower tier's channel (in order
  with its other jobs: the manager issues them only behind the tier's loads), each
  chunk's time recorded as ``<tier>_to_cpu``, and a job is reported (``KvHints.complete``)
  at the step after its last chunk landed (``INSTANT_PREFETCH``: the step after it was issued).

Arrivals: each request at its time, or (``Arrival.after``) a delay after an earlier
request's first token, as a client that waits for its answer sends its next turn
(``replay_serving_sessions``). A request naming a ``prefix`` shared with its session's
previous request is counted on arrival as a turn, and whether all of that prefix is in
the CPU tier, and in some tier (the GPU's prefix cache included). A request may name its
session (vLLM's ``session_id``, in its ``ReqContext``) and carry KV hints (its
``ReqContext.kv_hints``): leases are counted on arrival and at every step (``RunResult.hints``).
Each request's time to first token is split into phases (``RunResult.phases``).

Not called: ``get_load_source``, ``take_events`` and ``get_stats`` (vLLM's metrics and
KV events: they change no answer). Not modelled: decode, preemption, tensor parallelism,
a GPU KV cache shared between running requests and the prefix cache (both
are ``device_blocks``), reads and writes at different speeds or in parallel queues.

I/O channels (``replay_serving_io``), each one job at a time, a job taking ``latency +
bytes / bandwidth`` from when the jobs ahead of it are done: CPU -> GPU (loads from CPU,
and the second leg of a promoted load), GPU -> CPU (stores), and the lower tier, whose
loads, hit-check reads (one chunk each, where hits are read back first) and writes
(spills at the store's start, write-through copies once the GPU -> CPU copy landed) all
queue on it, first in first out, but a disk's reads before its writes (its I/O pool's
order). A write makes its chunk loadable when it ends (the worker's index commit,
learned by the manager at once). Each finished load records
its own transfer time (from its start on the channel, not its wait in the queue: the
handler's clock starts when its thread takes the job) into ``LoadTimings`` per transfer
type, which the manager reads at ``on_schedule_end``. An idle engine steps again at the
next event (an arrival, a job's end), or after ``step_overhead_s`` while a request waits
for the manager's decision.

Failed reads (``TierModel.fail_rate``, per chunk): a lower-tier read of a load or a
prefetch fails when it ends, after taking its time, timed as failed (the decision
charges what it cost). As the product's worker does, a failed load's promote slots are
marked bad (``SlotHealth``) and the chunks of its failed reads reported; vLLM's
``recompute`` policy computes the request from the first of them (a CPU lead is kept).
A failed prefetch chunk's slot is marked bad. Deterministic: no wall clock; which reads
fail is fixed by a hash of the reader and the chunk.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from replay_serving_io import Channel, Events
from replay_serving_model import DeviceCache, EngineConfig, GpuModel
from replay_serving_stack import INSTANT_PREFETCH, Stack
from vllm.v1.kv_hints import KvHintsEnvelope
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

from tiered_kv.cost import PREFILL
from tiered_kv.integrations.vllm.common import RequestSession
from tiered_kv.prefill import prefill_work
from tiered_kv.tiered.transfer_specs import TieredLoadSpec, TieredStoreSpec

_HIT, _PENDING, _RETRY = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY


@dataclass(frozen=True)
class Arrival:
    """One request: when it arrives (s), its prompt tokens, its full chunks' keys. With
    ``after`` (an earlier request's index in the list), ``time`` counts from that
    request's first token instead of from 0: a client that waits for its answer.
    ``prefix``: the leading chunks it shares with its session's previous request, whose
    presence on arrival is counted (``RunResult.survived``); ``session``, ``hints``: sent with it."""

    time: float
    tokens: int
    keys: Sequence[OffloadKey]
    after: int | None = None
    prefix: int = 0
    session: str | None = None  # the session the client names (vLLM's ``session_id``)
    hints: KvHintsEnvelope | None = None


@dataclass(eq=False)
class Request:
    rid: int
    arrival: float
    tokens: int
    keys: Sequence[OffloadKey]
    ctx: ReqContext
    max_chunks: int  # chunks that may come from a cache: at least one token is computed
    computed: int = 0  # vLLM's num_computed_tokens
    next_store: int = 0  # vLLM's next_stored_chunk_idx
    first_token: float | None = None
    sources: Counter[str] = field(default_factory=Counter)  # tokens by where they came from
    # When its lookup admitted it, its load was reported done, its first tokens were scheduled.
    admitted: float | None = None
    loaded: float | None = None
    started: float | None = None


@dataclass(eq=False)
class _Job:
    req: Request
    keys: list[OffloadKey]
    store: bool
    parts: int = 0
    promote_slots: list[int] = field(default_factory=list)  # the CPU slots a load promotes into
    tier_keys: set[OffloadKey] = field(default_factory=set)  # a load's chunks from the lower tier
    failed: set[OffloadKey] = field(default_factory=set)  # the chunks of its reads that failed


@dataclass
class RunResult:
    """One configuration's run: per-request TTFT (s, arrival order), GPU busy seconds,
    the span from the first arrival to the last first token, bytes per channel and kind,
    prompt tokens by source, steps and deferred lookups, and the manager's final
    estimates and tier counters."""

    config: str
    ttft: list[float]
    busy_s: float
    span_s: float
    channel_bytes: dict[str, Counter[str]]
    tokens: Counter[str]
    steps: int
    deferred: int
    costs: dict
    tier_stats: dict
    prefetch: dict = field(default_factory=dict)  # ``KvHints.snapshot()["prefetch"]`` where prefetch ran
    arrived: list[float] = field(default_factory=list)  # per request (s), in the list's order
    # Requests with a ``prefix`` ("turns"), and of them those that found all of it in
    # the CPU tier ("CPU") and in some tier, the GPU's prefix cache included ("any").
    survived: Counter[str] = field(default_factory=Counter)
    retention: dict = field(default_factory=dict)  # the CPU tier's ``SessionRetention.counts``, where it has one
    # ``KvHints.snapshot()`` less ``prefetch``; ``peak``: the most leases and pins per tier
    # at a step; ``on_arrival``: per action type, those naming a lease, ``.again`` one named
    # before, ``.held`` one held within its TTL.
    hints: dict = field(default_factory=dict)
    # Per request (arrival order): seconds waiting for its lookup, loading, waiting after
    # its load, computing to its first token; and whether it loaded from a lower tier.
    phases: list[tuple[float, float, float, float, bool]] = field(default_factory=list)
    failed_reads: int = 0  # lower-tier reads (of loads and prefetches) that failed


class Engine:
    """Replays ``arrivals`` through ``stack``'s manager (module docstring)."""

    def __init__(
        self,
        arrivals: Sequence[Arrival],
        stack: Stack,
        events: Events,
        tier_channel: Channel,
        gpu: GpuModel,
        engine: EngineConfig,
    ):
        self.stack, self.events, self.gpu, self.cfg = stack, events, gpu, engine
        self.manager = stack.manager
        self.costs = stack.manager.costs
        self.attention = self.costs.attention_per_token if self.costs is not None else 0.0
        self.tier_name = stack.tier.name if stack.tier is not None else None
        self.h2d = Channel(events, engine.cpu_gbps)
        self.d2h = Channel(events, engine.cpu_gbps)
        self.tier = tier_channel
        self.bpb = gpu.kv_bytes_per_token * engine.tokens_per_block
        self.device = DeviceCache(engine.device_blocks)
        tpb = engine.tokens_per_block
        self.requests = []
        self.arrivals = list(arrivals)
        self.due: list[tuple[float, int]] = []  # (arrival, index) of requests not arrived yet, as a heap
        self.dependents: dict[int, list[int]] = {}
        for i, a in enumerate(self.arrivals):
            if a.after is None:
                self.due.append((a.time, i))
            elif 0 <= a.after < i and a.time >= 0:
                self.dependents.setdefault(a.after, []).append(i)
            else:
                raise ValueError(f"request {i}: after={a.after}, time={a.time}; expected an earlier request, time >= 0")
            ctx = ReqContext(req_id=f"r{i}", kv_hints=a.hints)
            if a.session is not None:
                ctx.set_state(RequestSession(None, a.session))
            for j, key in enumerate(a.keys):
                ctx.set_offload_key_position(key, (j + 1) * tpb)
            self.requests.append(Request(i, a.time, a.tokens, a.keys, ctx, min(len(a.keys), (a.tokens - 1) // tpb)))
        heapq.heapify(self.due)
        self.survived: Counter[str] = Counter()
        self.waiting: deque[Request] = deque()
        self.ready: deque[Request] = deque()  # loads reported done
        self.running: list[Request] = []
        self.finished: list[Request] = []  # to be signalled at the next step
        self.reported: list[_Job] = []  # jobs that ended, reported at the next step
        self.prefetched: list[int] = []  # prefetch jobs that ended, reported at the next step
        self.being_loaded: Counter[OffloadKey] = Counter()
        self.reserved = 0  # prompt tokens of admitted, unfinished requests
        self.busy = 0.0
        self.steps = self.deferred = 0
        self.peak: Counter[str] = Counter()  # leases and pinned chunks per tier, at most
        self.on_arrival: Counter[str] = Counter()  # ``RunResult.hints``
        self.leases_named: set[str] = set()  # lease ids named so far
        self.fail_rate = stack.tier.fail_rate if stack.tier is not None else 0.0
        self.failed_reads = 0

    # ------------------------------------------------------------------ jobs

    def _read_fails(self, reader: object, chunks: Sequence[object]) -> bool:
        """Whether ``reader``'s read of ``chunks`` failed: any of its chunks, each at
        ``TierModel.fail_rate``, drawn from a hash of the reader and the chunk, so that
        every configuration sees the same read of the same chunk fail (common random
        numbers: a difference between configurations is theirs, not the draws')."""
        if not self.fail_rate:
            return False
        failed = any(_uniform(reader, key) < self.fail_rate for key in chunks)
        self.failed_reads += failed
        return failed

    def _part_done(self, job: _Job) -> None:
        job.parts -= 1
        if not job.parts:
            self.reported.append(job)

    def _load(self, r: Request, keys: list[OffloadKey]) -> None:
        """Issue the load job of ``keys`` for ``r`` (now: the step's start)."""
        spec = self.manager.prepare_load(keys, r.ctx).inner
        job = _Job(r, keys, store=False)
        bpb, record = self.bpb, self.stack.timings.record
        cpu_slots, promote = [0] * len(keys), [-1] * len(keys)
        if isinstance(spec, TieredLoadSpec):
            cpu_slots, promote = spec.cpu_slots.tolist(), spec.promote_slots.tolist()
        direct = [k for k, c, p in zip(keys, cpu_slots, promote) if c < 0 and p < 0]
        promoted = {k: p for k, c, p in zip(keys, cpu_slots, promote) if c < 0 <= p}
        n_cpu = len(keys) - len(direct) - len(promoted)
        job.promote_slots, job.tier_keys = list(promoted.values()), {*direct, *promoted}
        tpb = self.cfg.tokens_per_block
        r.sources.update(CPU=n_cpu * tpb, tier=(len(keys) - n_cpu) * tpb)

        def timed(kind: str, nbytes: int, then: Callable[[], None]) -> Callable[[float, float], None]:
            def done(start: float, end: float) -> None:
                record(kind, nbytes, end - start)
                then()

            return done

        def tier_read(kind: str, chunks: list[OffloadKey], then: Callable[[bool], None]) -> None:
            def done(start: float, end: float) -> None:
                failed = self._read_fails(r.rid, chunks)
                record(kind, len(chunks) * bpb, end - start, not failed)
                job.failed.update(chunks if failed else ())
                then(not failed)

            self.tier.submit(len(chunks) * bpb, "read", done)

        finish = lambda: self._part_done(job)  # noqa: E731
        if n_cpu:
            job.parts += 1
            self.h2d.submit(n_cpu * bpb, "read", timed("cpu_to_gpu", n_cpu * bpb, finish))
        if direct:
            job.parts += 1
            tier_read(f"{self.tier_name}_to_gpu", direct, lambda ok: finish())
        if promoted:
            job.parts += 1
            nbytes = len(promoted) * bpb

            def second_leg(ok: bool) -> None:
                if ok:
                    self.h2d.submit(nbytes, "read", timed("cpu_to_gpu", nbytes, finish))
                else:  # nothing goes on to the GPU
                    finish()

            tier_read(f"{self.tier_name}_to_cpu", list(promoted), second_leg)
        self.being_loaded.update(keys)

    def _store(self, r: Request, keys: list[OffloadKey], spec: TieredStoreSpec) -> None:
        """Issue a store job (now: the forward pass's end) and its lower-tier writes."""
        job = _Job(r, keys, store=True, parts=1)
        lower, bpb = self.stack.lower, self.bpb
        write_through = spec.tier_write_through[0] if lower is not None and spec.tier_write_through else None
        spills = spec.tier_spills[0] if lower is not None and spec.tier_spills else None

        def write(hashes: list) -> None:
            if lower is not None:
                self.tier.submit(len(hashes) * bpb, "write", lambda s, e: lower.complete_store(hashes))

        if spills is not None and len(spills):
            write(list(spills.block_hashes))

        def landed(start: float, end: float) -> None:
            self._part_done(job)
            if write_through is not None and len(write_through):
                write(list(write_through.block_hashes))

        self.d2h.submit(len(keys) * bpb, "write", landed)

    def _prefetch(self) -> None:
        """The step's prefetch jobs (``prefetch_jobs`` carries them under vLLM): each chunk
        read tier -> CPU on the tier's channel, in order with its other jobs, the job
        reported at the step after its last chunk landed."""
        record, bpb = self.stack.timings.record, self.bpb
        if self.stack.config == INSTANT_PREFETCH:  # the bound: landed now, no read timed
            self.prefetched += [job.job_id for job in self.manager.hints.take_jobs()]
            return
        for job in self.manager.hints.take_jobs():
            left = [len(job.spec)]

            def done(start: float, end: float, job_id: int, left: list[int], slot: int, key: bytes) -> None:
                failed = self._read_fails(("prefetch", job_id), [key])
                record(f"{self.tier_name}_to_cpu", bpb, end - start, not failed)
                if failed:
                    self.manager.health.mark_bad([slot])
                left[0] -= 1
                if not left[0]:
                    self.prefetched.append(job_id)

            for slot, key in zip(job.spec.promote_slots.tolist(), job.spec.block_hashes):
                self.tier.submit(bpb, "prefetch", partial(done, job_id=job.job_id, left=left, slot=slot, key=key))

    def _report(self) -> None:
        """vLLM's ``update_connector_output``: the jobs that ended, in the order they did."""
        done, self.prefetched = self.prefetched, []
        for job_id in done:
            self.manager.hints.complete(job_id)
        jobs, self.reported = self.reported, []
        for job in jobs:
            r = job.req
            if job.store:
                self.manager.complete_store(job.keys, r.ctx)
                continue
            if job.failed:
                # The worker marks a failed job's promote slots and reports the GPU blocks of
                # its failed reads; vLLM's recompute policy computes the request from the first.
                self.manager.health.mark_bad(job.promote_slots)
                lost = job.keys[next(i for i, k in enumerate(job.keys) if k in job.failed) :]
                tier, tpb = sum(k in job.tier_keys for k in lost), self.cfg.tokens_per_block
                r.computed -= len(lost) * tpb
                r.next_store = r.computed // tpb
                r.sources.subtract({"CPU": (len(lost) - tier) * tpb, "tier": tier * tpb})
            self.manager.complete_load(job.keys, r.ctx)
            self.being_loaded.subtract(job.keys)
            self.being_loaded += Counter()
            self.device.insert(r.keys[: r.computed // self.cfg.tokens_per_block])
            r.loaded = self.events.now
            self.ready.append(r)

    # ------------------------------------------------------------------ lookups

    def _lookup(self, r: Request, start: int) -> tuple[int | None, bool]:
        """The connector's lookup from chunk ``start``: chunks to load, or None (deferred),
        and whether the manager answered RETRY."""
        keys = r.keys[start : r.max_chunks]
        lookup, ctx = self.manager.lookup, r.ctx
        hits, defer, retry = 0, False, False
        for key in keys:
            result = lookup(key, ctx)
            if result is _HIT:
                hits += 1
            elif result is _PENDING:
                hits += 1
                defer = True
            elif result is _RETRY:
                defer = retry = True
            else:
                break
        if defer:
            return None, retry
        if hits and self.being_loaded and any(k in self.being_loaded for k in keys[:hits]):
            return None, False
        return hits, False

    def _arrive(self, r: Request) -> None:
        """``r`` arrives now: counted as a turn whose prefix did or did not survive, queued."""
        prefix = self.arrivals[r.rid].prefix
        if prefix:
            keys, composite = r.keys[:prefix], self.manager.composite
            self.survived["turns"] += 1
            self.survived["CPU"] += all(composite.cpu.is_loadable(k) for k in keys)
            self.survived["any"] += all(k in self.device.keys or composite.hit_tier(k) is not None for k in keys)
        held, seen, count = self.manager.hints.leases.leases, self.leases_named, self.on_arrival
        for action in r.ctx.kv_hints.actions if r.ctx.kv_hints is not None else ():
            if (lease_id := action.payload.get("lease_id")) is not None:
                kind = action.action_type
                # A lease past its TTL stays in the book until the next step's end drops it (no tenants here).
                live = (None, lease_id) in held and held[None, lease_id].expires > self.events.now
                count.update({kind: 1, f"{kind}.again": lease_id in seen, f"{kind}.held": live})
                seen.add(lease_id)
        self.manager.on_new_request(r.ctx)
        self.waiting.append(r)

    # ------------------------------------------------------------------ steps

    def _schedule(self) -> tuple[list[tuple[Request, int]], list[str], bool, bool]:
        """One step's scheduling: (request, tokens) pairs, ids of requests scheduled for the
        first time, whether a lookup was deferred on RETRY, and whether a load was issued."""
        cfg, tpb = self.cfg, self.cfg.tokens_per_block
        budget = cfg.token_budget
        scheduled: list[tuple[Request, int]] = []
        new_ids: list[str] = []
        for r in self.running:
            if budget <= 0:
                break
            n = min(r.tokens - r.computed, budget)
            scheduled.append((r, n))
            budget -= n
        while self.ready and budget > 0 and len(self.running) < cfg.max_seqs:
            r = self.ready.popleft()
            r.started = self.events.now
            n = min(r.tokens - r.computed, budget)
            scheduled.append((r, n))
            self.running.append(r)
            new_ids.append(r.ctx.req_id)
            budget -= n
        retry = loaded = False
        kept: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_seqs:
            r = self.waiting.popleft()
            n_dev = self.device.lookup(r.keys, r.max_chunks)
            hits, retried = self._lookup(r, n_dev)
            if hits is None:
                self.deferred += 1
                retry |= retried
                kept.append(r)
                continue
            if self.reserved and self.reserved + r.tokens > cfg.device_blocks * tpb:
                kept.append(r)  # vLLM's allocation fails: no more admissions this step
                break
            self.reserved += r.tokens
            r.admitted = r.started = self.events.now
            r.sources["GPU"] += n_dev * tpb
            r.computed = (n_dev + hits) * tpb
            if hits:
                r.next_store = n_dev + hits
                self._load(r, list(r.keys[n_dev : n_dev + hits]))
                loaded = True
                continue
            n = min(r.tokens - r.computed, budget)
            scheduled.append((r, n))
            self.running.append(r)
            new_ids.append(r.ctx.req_id)
            budget -= n
        self.waiting.extendleft(reversed(kept))
        return scheduled, new_ids, retry, loaded

    def _offer_stores(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, list, TieredStoreSpec]]:
        """vLLM's ``_build_store_jobs``: each request's chunks complete after this step."""
        stores = []
        tpb = self.cfg.tokens_per_block
        for r, n in scheduled:
            chunks = min((r.computed + n) // tpb, len(r.keys))
            if chunks <= r.next_store:
                continue
            out = self.manager.prepare_store(list(r.keys[r.next_store : chunks]), r.ctx)
            if out is None:
                continue  # offered again next step
            r.next_store = chunks
            if out.keys_to_store:
                stores.append((r, list(out.keys_to_store), out.store_spec.inner))  # type: ignore[attr-defined]
        return stores

    def run(self) -> RunResult:
        ev, gpu, tpb = self.events, self.gpu, self.cfg.tokens_per_block
        reqs, due = self.requests, self.due
        if not due:
            raise ValueError("no request arrives at a time of its own (every one names an earlier one)")
        first = due[0][0]
        ev.run_until(first)
        done = 0
        book = self.manager.hints.leases
        while done < len(reqs):
            self._report()
            for name, n in (("leases", len(book.leases)), *zip(book.names, book.pinned)) if book.leases else ():
                self.peak[name] = max(self.peak[name], n)
            while due and due[0][0] <= ev.now:
                t, i = heapq.heappop(due)
                reqs[i].arrival = t
                self._arrive(reqs[i])
            scheduled, new_ids, retry, loaded = self._schedule()
            stores = self._offer_stores(scheduled)
            for r in self.finished:
                self.manager.on_request_finished(r.ctx)
            self.finished = []
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=new_ids, preempted_req_ids=()))
            self._prefetch()
            self.steps += 1
            if scheduled:
                flops = sum(gpu.flops(n, r.computed) for r, n in scheduled)
                # The product's connector notes every step's work, as the decision counts it.
                work = sum(prefill_work(n, r.computed, self.attention) for r, n in scheduled)
                seconds = gpu.step_overhead_s + gpu.seconds(flops)
                if self.costs is not None:
                    self.costs.note_step(work)
                self.busy += seconds
                end = ev.now + seconds
                ev.run_until(end)
                for r, n in scheduled:
                    before = r.computed // tpb
                    r.computed += n
                    self.device.insert(r.keys[before : min(r.computed // tpb, len(r.keys))])
                    if r.computed >= r.tokens:
                        r.first_token = end
                        self.reserved -= r.tokens
                        self.running.remove(r)
                        self.finished.append(r)
                        self.device.insert(r.keys)
                        done += 1
                        for j in self.dependents.get(r.rid, ()):
                            heapq.heappush(due, (end + self.arrivals[j].time, j))
                for r, keys, spec in stores:
                    self._store(r, keys, spec)
                step_tokens = sum(n for _, n in scheduled)
                if not loaded and sum(n for _, n in scheduled if n > 1) >= 0.9 * step_tokens:
                    self.stack.timings.record(PREFILL, round(work), seconds)
                continue
            wake = min(ev.next_time(), due[0][0] if due else math.inf)
            if retry or self.ready or self.reported or self.prefetched:
                wake = min(wake, ev.now + gpu.step_overhead_s)
            if wake == math.inf:
                stalled = f"the replay stalled at {ev.now:.3f} s with {len(self.waiting)} requests waiting"
                raise RuntimeError(f"{stalled} and nothing in flight: a prompt larger than the device cache?")
            ev.run_until(wake)
        for r in self.finished:  # the last step's, which no later step signals
            self.manager.on_request_finished(r.ctx)
        last = max(r.first_token for r in reqs if r.first_token is not None)
        tokens: Counter[str] = Counter()
        for r in reqs:
            tokens.update(r.sources)
            tokens["computed"] += r.tokens - sum(r.sources.values())
        costs = self.costs.snapshot() if self.costs is not None else {}
        retention = self.manager.composite.cpu.retention
        hints = self.manager.hints.snapshot()
        prefetch = hints.pop("prefetch")
        hints |= {"peak": dict(self.peak), "on_arrival": dict(self.on_arrival)}
        return RunResult(
            self.stack.config,
            [r.first_token - r.arrival for r in reqs if r.first_token is not None],
            self.busy,
            last - first,
            {"CPU->GPU": self.h2d.bytes, "GPU->CPU": self.d2h.bytes, "tier": self.tier.bytes},
            tokens,
            self.steps,
            self.deferred,
            costs,
            self.manager.stats.as_dict()["tiers"],
            prefetch,
            [r.arrival for r in reqs],
            self.survived,
            dict(retention.counts) if retention is not None else {},
            hints,
            [_phases(r) for r in reqs if r.first_token is not None],
            self.failed_reads,
        )


def _uniform(*parts: object) -> float:
    """A number in [0, 1) fixed by ``parts`` (their repr), the same in every run."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _phases(r: Request) -> tuple[float, float, float, float, bool]:
    """``RunResult.phases`` of a finished request (so admitted and started)."""
    admitted, started, first = r.admitted, r.started, r.first_token
    assert admitted is not None and started is not None and first is not None
    loaded = r.loaded if r.loaded is not None else admitted
    return admitted - r.arrival, loaded - admitted, started - loaded, first - started, r.sources["tier"] > 0
