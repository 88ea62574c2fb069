#!/usr/bin/env python
"""A prefill fleet in time: a Mooncake trace's requests arrive at its timestamps and queue
on the node a router picks; fleets of equal total cache capacity, with and without one
shared pool, compared by hit rate, time to first token and goodput at a TTFT SLO.

``python tools/replay_fleet.py --timed --trace ...`` runs it (or this file directly).

What it models:

- Arrivals: the trace's ``timestamp`` (ms) in timestamp order, the gaps multiplied by one
  factor so that recomputing every request would keep the fleet's GPUs ``--utilisation``
  busy: factor = recompute GPU seconds / (utilisation x nodes x trace span), the rule of
  ``tools/replay_serving_workloads.time_scale`` applied to a fleet (not imported: that
  module pulls in vLLM).
- A node: one prefill GPU serving its queue first-in first-out, one request at a time.
  Service time = prefill of the tokens not hit (``tiered_kv.prefill.prefill_work``, attention
  to the hit prefix included) at ``--prefill-tps`` tokens/s of linear work (default 30,800:
  Llama-3.1-8B bf16 on one H100 SXM at an ASSUMED 50% MFU, ``tools/replay_model.py``), plus
  loading the hit tokens' KV (131,072 B/token for Llama-3.1-8B) from the node's local cache
  at ``--local-gbps`` (default 50 GB/s, a CPU tier over PCIe 5.0, ASSUMED) and from the
  shared pool at ``--shared-gbps`` (default 12.5 GB/s, one 100 Gb/s NIC, ASSUMED); loading
  and compute do not overlap. TTFT = finish - arrival; every prompt computes at least its
  last token (a full last block is never a hit). No decode.
- Caches: LRU over the 512-token block ids of the trace (prefix-chained),
  ``fleet_trace.LRU``. A hit is the longest prefix in the node's local cache, then the
  blocks following it that the pool holds; both are looked up when the request starts, and its
  blocks enter the node's cache (and its computed blocks the pool) when it finishes, so a
  request never hits KV that is still being computed. The pool is inclusive (a node's blocks
  may be in it too) and a local hit does not refresh the pool's copy, so at equal capacity a
  pool too small for the working set can hit less often than a local fleet whose router
  keeps each conversation on one node.
- Fleets at equal total capacity (``--local-blocks`` L, ``--shared-blocks`` S, ``--nodes``
  n): ``local``: n nodes of L + S/n blocks each, no pool; ``shared``: n nodes of L blocks
  each plus one pool of S blocks every node reads.
- Routers, deciding at arrival from what a router can know (each node's cache contents and
  the estimated work queued on it): ``cache-aware`` picks the lowest estimated TTFT (queued
  work + prefill of the tokens the node lacks + loading those it holds locally or in the
  pool: Mooncake's Conductor rule); ``least-work`` the least queued work; ``longest-prefix``
  the longest local prefix, queue ignored but for ties; ``round-robin`` turn by turn.
  Queued work is the running request's remaining time plus each waiting request's estimate
  made when it was routed (ties: less queued work, then turn order).

Not modelled: decode and its interference, batching several prompts into one step,
chunked prefill, tensor parallelism, a GPU prefix cache, transfer queues and their
contention (a load takes bytes / bandwidth), the pool's own placement or replication, KV of
requests still being computed (never shared), failures.

I/O: reads the trace file; writes ``--json`` if given; prints the tables. No server: the
pool is its index alone.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet_trace import LRU, PAPER, TOKENS_PER_BLOCK, Request, trace_rows  # noqa: E402
from replay_model import DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_LOAD_GBPS, DEFAULT_PREFILL_TPS  # noqa: E402

from tiered_kv.config_values import ConfigError  # noqa: E402
from tiered_kv.prefill import DEFAULT_ATTENTION_PER_TOKEN, prefill_work  # noqa: E402
from tiered_kv.remote.config import parse_duration  # noqa: E402

FLEETS = ("local", "shared")
ROUTERS = ("cache-aware", "least-work", "longest-prefix", "round-robin")
#: The rows compared by default: the headline baseline first, the shared pool's rows last.
DEFAULT_ROWS = (
    "local/cache-aware",
    "local/round-robin",
    "local/longest-prefix",
    "shared/least-work",
    "shared/cache-aware",
)
BASELINE, HEADLINE = "local/cache-aware", "shared/least-work"


@dataclass(frozen=True)
class TimedRequest:
    arrival_s: float  # unscaled, from the trace's first request
    request: Request


def read_timed_trace(path: Path, limit: int | None = None) -> list[TimedRequest]:
    """A Mooncake FAST'25 trace's requests (``timestamp`` ms, ``input_length``, ``hash_ids``)
    in timestamp order (stable), arrivals from the first one's."""
    rows = list(trace_rows(path, limit, timed=True))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TimedRequest((t - t0) / 1e3, r) for t, r in rows]


@dataclass(frozen=True)
class Speeds:
    """Prefill rate and load bandwidths (module docstring); seconds of one request."""

    prefill_tps: float = DEFAULT_PREFILL_TPS
    local_gbps: float = DEFAULT_LOAD_GBPS["CPU"]
    shared_gbps: float = 12.5
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    attention_per_token: float = DEFAULT_ATTENTION_PER_TOKEN

    def service(self, tokens: int, local_tokens: int = 0, shared_tokens: int = 0) -> float:
        hit = local_tokens + shared_tokens
        compute = prefill_work(tokens - hit, hit, self.attention_per_token) / self.prefill_tps
        load = self.kv_bytes_per_token * (local_tokens / self.local_gbps + shared_tokens / self.shared_gbps) / 1e9
        return compute + load

    def describe(self) -> str:
        return (
            f"prefill {self.prefill_tps:,.0f} tokens/s of linear work with attention (Llama-3.1-8B bf16, "
            f"H100 SXM at an ASSUMED 50% MFU), KV {self.kv_bytes_per_token:,} B/token, loads ASSUMED: "
            f"local cache {self.local_gbps:g} GB/s, shared pool {self.shared_gbps:g} GB/s"
        )


def recompute_seconds(requests: list[TimedRequest], speeds: Speeds) -> float:
    return sum(speeds.service(r.request.input_tokens) for r in requests)


def time_factor(requests: list[TimedRequest], speeds: Speeds, nodes: int, utilisation: float) -> float:
    """The factor on the trace's gaps that makes recomputing everything fill ``utilisation``."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        return 1.0  # one request, or all at once: nothing to scale
    return recompute_seconds(requests, speeds) / (utilisation * nodes * span)


@dataclass
class Node:
    cache: LRU
    queue: deque = field(default_factory=deque)  # (request index, estimated service s)
    queued_s: float = 0.0  # estimates of the waiting requests
    running: tuple[int, int] | None = None  # (request index, hit blocks)
    free_at: float = 0.0  # when the running request finishes
    busy_s: float = 0.0
    requests: int = 0

    def backlog(self, now: float) -> float:
        return max(0.0, (self.free_at - now if self.running else 0.0) + self.queued_s)


def leading(cache: LRU, blocks: tuple[int, ...], start: int, limit: int) -> int:
    n, ids = start, cache.ids
    while n < limit and blocks[n] in ids:
        n += 1
    return n - start


@dataclass
class RowResult:
    row: str
    ttft_s: list[float]
    tokens: int
    hit_blocks: int
    shared_blocks: int
    busy_s: list[float]
    requests: list[int]
    span_s: float
    seconds: float = 0.0


def simulate(
    requests: list[TimedRequest], row: str, *, nodes: int, local_blocks: int, shared_blocks: int,
    speeds: Speeds, factor: float,
) -> RowResult:  # fmt: skip
    """One fleet and router (``row``, ``fleet/router``) over ``requests`` at ``factor``."""
    started = time.perf_counter()
    fleet, router = row.split("/")
    shared = fleet == "shared"
    per_node = local_blocks if shared else local_blocks + shared_blocks // nodes
    pool = LRU(shared_blocks) if shared else None
    fleet_nodes = [Node(LRU(per_node)) for _ in range(nodes)]
    arrival = [r.arrival_s * factor for r in requests]
    ttft = [0.0] * len(requests)
    heap: list[tuple[float, int]] = []
    totals = {"hit": 0, "shared": 0}

    def hits(node: Node, req: Request) -> tuple[int, int]:
        limit = min(len(req.blocks), (req.input_tokens - 1) // TOKENS_PER_BLOCK)
        local = leading(node.cache, req.blocks, 0, limit)
        return local, leading(pool, req.blocks, local, limit) if pool is not None else 0

    def estimate(node: Node, req: Request) -> float:
        local, from_pool = hits(node, req)
        return speeds.service(req.input_tokens, local * TOKENS_PER_BLOCK, from_pool * TOKENS_PER_BLOCK)

    def start(k: int, now: float) -> None:
        node = fleet_nodes[k]
        i, est = node.queue.popleft()
        node.queued_s -= est
        req = requests[i].request
        local, from_pool = hits(node, req)
        node.cache.touch(req.blocks[:local])
        if pool is not None:
            pool.touch(req.blocks[local : local + from_pool])
        s = speeds.service(req.input_tokens, local * TOKENS_PER_BLOCK, from_pool * TOKENS_PER_BLOCK)
        node.running, node.free_at = (i, local + from_pool), now + s
        node.busy_s += s
        totals["hit"] += local + from_pool
        totals["shared"] += from_pool
        heapq.heappush(heap, (node.free_at, k))

    def finish(k: int) -> None:
        node = fleet_nodes[k]
        assert node.running is not None  # a heap entry is a running request
        i, hit = node.running
        node.running = None
        req = requests[i].request
        ttft[i] = node.free_at - arrival[i]
        node.cache.touch(req.blocks)
        if pool is not None:
            pool.touch(req.blocks[hit:])  # computed here, written through
        if node.queue:
            start(k, node.free_at)

    for i, timed in enumerate(requests):
        now, req = arrival[i], timed.request
        while heap and heap[0][0] <= now:
            finish(heapq.heappop(heap)[1])
        turn = [(k - i) % nodes for k in range(nodes)]
        if router == "round-robin":
            k = i % nodes
            est = estimate(fleet_nodes[k], req)
        elif router == "least-work":
            k = min(range(nodes), key=lambda k: (fleet_nodes[k].backlog(now), turn[k]))
            est = estimate(fleet_nodes[k], req)
        elif router == "longest-prefix":
            k = min(range(nodes), key=lambda k: (-hits(fleet_nodes[k], req)[0], fleet_nodes[k].backlog(now), turn[k]))
            est = estimate(fleet_nodes[k], req)
        else:
            ests = [estimate(nd, req) for nd in fleet_nodes]
            waits = [nd.backlog(now) for nd in fleet_nodes]
            k = min(range(nodes), key=lambda k: (waits[k] + ests[k], waits[k], turn[k]))
            est = ests[k]
        node = fleet_nodes[k]
        node.queue.append((i, est))
        node.queued_s += est
        node.requests += 1
        if node.running is None:
            start(k, now)
    while heap:
        finish(heapq.heappop(heap)[1])
    span = max(a + t for a, t in zip(arrival, ttft)) - arrival[0]
    return RowResult(
        row, ttft, sum(r.request.input_tokens for r in requests), totals["hit"], totals["shared"],
        [nd.busy_s for nd in fleet_nodes], [nd.requests for nd in fleet_nodes], span,
        time.perf_counter() - started,
    )  # fmt: skip


def summarize(r: RowResult, slo_s: float) -> dict:
    ttft = np.asarray(r.ttft_s)
    nodes = len(r.busy_s)
    return {
        "row": r.row,
        "hit_rate": r.hit_blocks * TOKENS_PER_BLOCK / max(1, r.tokens),
        "from_pool": r.shared_blocks * TOKENS_PER_BLOCK / max(1, r.tokens),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "goodput": float((ttft <= slo_s).mean()),
        "gpu_s": sum(r.busy_s),
        "busy": sum(r.busy_s) / (nodes * r.span_s) if r.span_s > 0 else 1.0,
        "requests_per_node": r.requests,
        "busy_per_node_s": r.busy_s,
        "seconds": r.seconds,
    }


def ratios(rows: dict[str, dict], row: str, base: str) -> dict | None:
    if row not in rows or base not in rows:
        return None
    a, b = rows[row], rows[base]

    def div(x: float, y: float) -> float:
        return x / y if y else float("inf")

    return {
        "hit_rate": div(a["hit_rate"], b["hit_rate"]),
        "gpu_s": div(a["gpu_s"], b["gpu_s"]),
        "ttft_mean": div(a["ttft_mean_s"], b["ttft_mean_s"]),
        "ttft_p90": div(a["ttft_p90_s"], b["ttft_p90_s"]),
    }


def table(trace: str, rows: list[dict], slo_s: float) -> str:
    out = [
        f"| fleet / router | token hit rate | from pool | TTFT mean s | p50 s | p90 s | goodput, TTFT <= {slo_s:g} s "
        "| GPU busy | GPU s | requests per node |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = r["requests_per_node"]
        out.append(
            f"| {r['row']} | {r['hit_rate']:.3f} | {r['from_pool']:.3f} | {r['ttft_mean_s']:.2f} | {r['ttft_p50_s']:.2f} "
            f"| {r['ttft_p90_s']:.2f} | {r['goodput']:.3f} | {r['busy']:.2f} | {r['gpu_s']:,.0f} "
            f"| {min(per):,}-{max(per):,} |"
        )
    out.append(
        "\nToken hit rate: hit blocks x 512 / input tokens (from pool: the pool's part); GPU busy: service "
        "seconds / (nodes x time to the last first token); GPU s: their sum, the paper's prefill GPU time."
    )
    by_row = {r["row"]: r for r in rows}
    paper = next((v for k, v in PAPER.items() if k in trace), None)
    measured = []
    for row, base in ((HEADLINE, BASELINE), ("shared/cache-aware", BASELINE), (HEADLINE, "local/round-robin")):
        if q := ratios(by_row, row, base):
            measured.append(
                f"{row} over {base}: hit rate {q['hit_rate']:.2f}x, GPU time {q['gpu_s']:.2f}x, "
                f"TTFT mean {q['ttft_mean']:.2f}x, p90 {q['ttft_p90']:.2f}x"
            )
    this = f" (this trace's: {paper[0]:.2f}x / {paper[1]:.2f}x)" if paper else ""
    out.append(
        "\nPaper (Mooncake FAST'25, Fig. 10: 10 prefill nodes x 3M tokens, global vs local cache, "
        "conversation / synthetic): hit rate 2.22x / 2.36x, prefill GPU time 0.76x / 0.52x"
        f"{this}. Measured here: " + ("; ".join(measured) or "(rows to compare not run)") + "."
    )
    return "\n".join(out)


def capacity_line(args) -> str:
    n, L, S = args.nodes, args.local_blocks, args.shared_blocks
    per = L + S // n

    def tok(blocks: int) -> str:
        return f"{blocks * TOKENS_PER_BLOCK / 1e6:.2f}M tokens"

    return (
        f"# equal total capacity: local = {n} nodes x {per:,} blocks ({tok(per)}) = {n * per:,} blocks; "
        f"shared = {n} nodes x {L:,} blocks ({tok(L)}) + a pool of {S:,} blocks ({tok(S)}) = {n * L + S:,} blocks"
    )


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    return parse


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _utilisation(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 2:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 2], the fleet's recompute-all load, got {text!r}")
    return value


def _duration(text: str) -> float:
    try:
        return parse_duration(text, "--slo")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--slo: ")) from None


def parse_args(argv=None, prog: str | None = None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--trace", required=True, type=Path, help="a Mooncake trace (jsonl: timestamp, input_length, hash_ids)"
    )
    p.add_argument("--limit", type=_positive(int), help="replay only the first N requests of the file")
    p.add_argument("--nodes", type=_positive(int), default=10, help="prefill nodes (default 10, the paper's)")
    p.add_argument(
        "--local-blocks", type=_count, default=5859, help="L: each node's local cache (5,859 x 512 = 3M tokens)"
    )
    p.add_argument("--shared-blocks", type=_count, help="S: the pool (default: nodes x L, the nodes' memory pooled)")
    p.add_argument("--utilisation", type=_utilisation, default=0.7, help="recompute-all GPU load (default 0.7)")
    p.add_argument("--slo", type=_duration, default=2.0, help="TTFT SLO for goodput, e.g. 2s, 500ms (default 2s)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated fleet/router pairs: "
                   f"fleet in {', '.join(FLEETS)}, router in {', '.join(ROUTERS)}")  # fmt: skip
    p.add_argument("--prefill-tps", type=_positive(float), default=DEFAULT_PREFILL_TPS, help="linear tokens/s")
    p.add_argument("--local-gbps", type=_positive(float), default=DEFAULT_LOAD_GBPS["CPU"], help="ASSUMED GB/s")
    p.add_argument("--shared-gbps", type=_positive(float), default=12.5, help="ASSUMED pool -> GPU GB/s")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args(argv)
    if args.shared_blocks is None:
        args.shared_blocks = args.nodes * args.local_blocks
    if args.local_blocks + args.shared_blocks // args.nodes < 1:
        p.error(f"--local-blocks {args.local_blocks} and --shared-blocks {args.shared_blocks}: no cache at all")
    args.row_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in args.row_list or [""]:
        fleet, _, router = r.partition("/")
        if fleet not in FLEETS or router not in ROUTERS:
            p.error(f"--rows: bad row {r!r} in {args.rows!r}; expected fleet/router with fleet in "
                    f"{', '.join(FLEETS)} and router in {', '.join(ROUTERS)}, e.g. local/cache-aware")  # fmt: skip
    try:
        args.requests = read_timed_trace(args.trace, args.limit)
    except (OSError, ValueError) as exc:
        p.error(f"--trace {str(args.trace)!r}: {exc}")
    return args


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    requests: list[TimedRequest] = args.requests
    speeds = Speeds(args.prefill_tps, args.local_gbps, args.shared_gbps)
    factor = time_factor(requests, speeds, args.nodes, args.utilisation)
    span = requests[-1].arrival_s * factor
    tokens = sum(r.request.input_tokens for r in requests)
    print(
        f"# {args.trace.name}: {len(requests):,} requests, {tokens:,} input tokens, at the trace's times x "
        f"{factor:.3f} ({requests[-1].arrival_s:,.0f} s -> {span:,.0f} s): recomputing everything would keep "
        f"{args.nodes} GPUs {args.utilisation:g} busy",
        flush=True,
    )
    print(f"# {speeds.describe()}; FIFO per node, no decode", flush=True)
    print(capacity_line(args), flush=True)
    common = dict(nodes=args.nodes, local_blocks=args.local_blocks, shared_blocks=args.shared_blocks)
    rows = [summarize(simulate(requests, r, speeds=speeds, factor=factor, **common), args.slo) for r in args.row_list]
    print(f"# simulated in {sum(r['seconds'] for r in rows):.1f} s\n", flush=True)
    print(table(args.trace.name, rows, args.slo))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "requests"} | {"trace": str(args.trace)}
        doc = {"trace": args.trace.name, "factor": factor, "args": settings, "rows": rows}
        args.json.write_text(json.dumps(doc, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
