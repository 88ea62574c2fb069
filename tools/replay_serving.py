#!/usr/bin/env python
"""TTFT under load: a serving replay with time, through the product's own managers.

Requests arrive at a trace's timestamps (a Mooncake FAST'25 trace) or as a Poisson
process (a generated workload), their gaps scaled so that the GPU is about
``--utilisation`` busy in the ``recompute`` configuration. One prefill GPU steps as vLLM
0.33's scheduler does (token budget per step, chunked prefill, a waiting queue, async
loads), its prefill time per step from the model's FLOPs with attention at a stated
MFU; the CPU link and the lower tier are first-in first-out I/O channels that loads,
hit-check reads and writes share (``replay_serving_sim``). The managers are the
product's, driven through ``TieredVllmManager`` in vLLM 0.33's call order
(``replay_serving_stack`` says what is the product's code and what is modelled).
Configurations, on the same arrivals:

- ``always``: CPU tier over the lower tier, every chunk found loaded (cost-aware off);
- ``recompute``: the CPU tier alone: lower tiers never loaded (nor written);
- ``cost-aware``: CPU over the lower tier with the product's decision, seeded from its
  priors (``PRIOR_GBPS``: disk 6, shared 1 GB/s; prefill estimated at its assumed 50%
  MFU, attention from the model's shape) and fed the transfers and forward passes the
  replay simulates, as the workers' timings feed it; it sees the queues its scheduler
  sees (requests waiting, the tier's loads and writes in flight), not their sizes;
- ``e460906``: the same decision blind to queues and attention, as at that commit;
- ``cost-aware+prefetch`` (``--prefetch`` adds it): ``cost-aware`` with prefetch while
  waiting (``tiered_kv.integrations.vllm.hints``, on by default in the product; the
  other rows run without it): each arriving request's lower-tier chunks are read into
  CPU while it waits, behind the tier's loads, at most ``--prefetch-max-bytes`` in flight.
- ``cost-aware+instant-prefetch``: its bound, the same prefetch jobs with no limit in
  flight, each landing in CPU the moment it is issued without a read: what prefetch
  while waiting could give at most, with the decision and the queue as they are.

Prints a markdown table per run: TTFT mean, p50, p90, p99 (ms), goodput (share of
requests with TTFT <= ``--slo-ms``), GPU busy share (step time over the span from the
first arrival to the last first token), prompt tokens by source, and GB read and
written per tier (the lower tier's reads: all, and of them the hit-check reads and,
with a prefetching row, the prefetch reads). A second table says where the time to first
token goes (``phases_table``): waiting for the lookup, loading, waiting after the load,
computing; and for the requests that loaded from the lower tier, what hiding each load
in its wait before the lookup would save (prefetch at arrival, to first order).

Faults the decision cannot see, the same in every configuration: ``--tier-slow
FACTOR,EVERY_S,FOR_S`` (the lower tier's jobs started in slow episodes take FACTOR x as
long) and ``--tier-fail SHARE`` (that share of the chunks its loads and prefetches read
fail, after taking their time; the notes count the failed reads).

    python tools/replay_serving.py --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \\
        --utilisation 0.9 --tier-gbps 3
    python tools/replay_serving.py --workload long-context --utilisation 0.7 --tier-gbps 1 --tier shared
    python tools/replay_serving.py --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \\
        --utilisation 0.9 --configs cost-aware --prefetch
    python tools/replay_serving.py --workload long-context --utilisation 0.3 --tier-gbps 2 --tier-fail 0.01

Runs in one process; reads the trace; each configuration's lower tier keeps an index
under a temporary directory (``--scratch``), removed afterwards.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from benchlib import md_table  # noqa: E402
from replay_serving_io import ReadsFirstChannel, Slowdown  # noqa: E402
from replay_serving_model import EngineConfig, GpuModel  # noqa: E402
from replay_serving_sim import Arrival, Channel, Engine, Events, RunResult  # noqa: E402
from replay_serving_stack import CONFIGS, DECIDING, PREFETCHING, TierModel, build_stack  # noqa: E402
from replay_serving_workloads import (  # noqa: E402
    GENERATED,
    TOKENS_PER_BLOCK,
    Stream,
    arrivals,
    estimate_work,
    generated,
    mooncake,
    time_scale,
)

from tiered_kv.config import TieredConfig, parse_cpu_admission, parse_cpu_retention  # noqa: E402
from tiered_kv.config_values import parse_size  # noqa: E402
from tiered_kv.integrations.vllm.hints import HintSettings  # noqa: E402
from tiered_kv.prefill import ASSUMED_MFU  # noqa: E402

#: The Mooncake paper's local cache (3M tokens) and the device cache of earlier replays.
CPU_TOKENS = 3_000_000
DEVICE_TOKENS = 512 * 1024
#: The lower tier holds the working set, with room to spare.
LOWER_FRACTION = 1.25
LATENCY_MS = {"disk": 0.1, "shared": 5.0}


def run_config(
    config: str,
    reqs: Sequence[Arrival],
    gpu: GpuModel,
    engine: EngineConfig,
    tier: TierModel,
    cpu_blocks: int,
    lower_blocks: int,
    scratch: Path | None = None,
    prefetch_max_bytes: int = HintSettings.prefetch_max_bytes,
    cpu_retention: str = TieredConfig.cpu_retention,
    cpu_admission: str = TieredConfig.cpu_admission,
    eviction_policy: str = "lru",
    hint_prefetch: bool = False,
    disk_retention: str = "none",
) -> RunResult:
    """One configuration (``CONFIGS``) over ``reqs``, the CPU tier under the config values
    given, the workers running ``kv.prefetch`` hints' jobs where ``hint_prefetch``
    (``build_stack``)."""
    events = Events()
    bpb = gpu.kv_bytes_per_token * engine.tokens_per_block
    # The disk tier's I/O pool runs reads first; the shared tier's connections do not.
    channel = (
        ReadsFirstChannel(events, tier.gbps, tier.latency_s, tier.slow, write_piece=bpb)
        if tier.kind == "disk"
        else Channel(events, tier.gbps, tier.latency_s, tier.slow)
    )

    def verify_read(key: bytes, slot: int, done) -> None:
        channel.submit(bpb, "verify", lambda start, end: done())

    stack = build_stack(
        config,
        tier,
        cpu_blocks=cpu_blocks,
        lower_blocks=lower_blocks,
        tokens_per_block=engine.tokens_per_block,
        bytes_per_block=bpb,
        # The product's own estimate: its assumed MFU, attention ignored.
        prefill_tokens_per_s=ASSUMED_MFU * gpu.peak_tflops * 1e12 / (2 * gpu.params),
        # From the model's shape, as ``configured_prefill`` reads it from config.json.
        attention_per_token=4 * gpu.layers * gpu.hidden / (2 * gpu.params),
        clock=lambda: events.now,
        verify_read=verify_read,
        scratch=scratch,
        prefetch_max_bytes=prefetch_max_bytes,
        cpu_retention=cpu_retention,
        cpu_admission=cpu_admission,
        eviction_policy=eviction_policy,
        hint_prefetch=hint_prefetch,
        disk_retention=disk_retention,
    )
    try:
        return Engine(reqs, stack, events, channel, gpu, engine).run()
    finally:
        stack.close()


def _gb(n: float) -> str:
    return f"{n / 1e9:,.0f}" if n >= 10e9 else f"{n / 1e9:.1f}"


def table(results: Sequence[RunResult], tier: TierModel, slo_s: float) -> str:
    """The markdown table of ``results`` (module docstring)."""
    name = tier.name
    prefetched = any(r.config in PREFETCHING for r in results)
    headers = [
        "config",
        "mean TTFT ms",
        "p50 TTFT ms",
        "p90 TTFT ms",
        "p99 TTFT ms",
        f"goodput @ {slo_s * 1e3:g} ms",
        "GPU busy",
        f"tokens GPU / CPU / {name} / computed %",
        f"{name} GB read (hit checks{', prefetch' if prefetched else ''})",
        f"{name} GB written",
        "CPU GB read",
        "CPU GB written",
    ]
    rows = []
    for r in results:
        t = np.asarray(r.ttft) * 1e3
        p50, p90, p99 = np.percentile(t, [50, 90, 99])
        total = sum(r.tokens.values())
        shares = " / ".join(f"{100 * r.tokens[k] / total:.0f}" for k in ("GPU", "CPU", "tier", "computed"))
        lower = r.channel_bytes["tier"]
        read = lower["read"] + lower["verify"] + lower["prefetch"]
        parts = [lower["verify"], lower["prefetch"]] if prefetched else [lower["verify"]]
        rows.append(
            [
                r.config,
                f"{t.mean():,.0f}",
                f"{p50:,.0f}",
                f"{p90:,.0f}",
                f"{p99:,.0f}",
                f"{np.mean(t <= slo_s * 1e3):.3f}",
                f"{r.busy_s / r.span_s:.2f}",
                shares,
                f"{_gb(read)} ({', '.join(map(_gb, parts))})",
                _gb(lower["write"]),
                _gb(r.channel_bytes["CPU->GPU"]["read"]),
                _gb(r.channel_bytes["GPU->CPU"]["write"]),
            ]
        )
    return md_table(headers, rows, left=1)


def phases_table(results: Sequence[RunResult], tier: TierModel) -> str:
    """Where the time to first token goes (``RunResult.phases``), mean seconds per request:
    waiting for the lookup that admits it, loading, waiting for the step that runs it after
    its load, computing; and, for the requests that loaded from the lower tier, their wait
    and load, and what hiding each load in its wait would save (prefetch at arrival, to
    first order: it leaves out the tier time the hidden loads free for others): the
    lower-tier load of a request that waited no longer than that, its wait otherwise,
    over the mean TTFT."""
    name = tier.name
    headers = ["config", "waiting", "loading", "after load", "computing", f"share loading from {name}"]
    headers += ["their waiting", "their loading", "loads hidden in waits save"]
    rows = []
    for r in results:
        p = np.asarray([ph[:4] for ph in r.phases]).reshape(-1, 4)
        lower = np.asarray([ph[4] for ph in r.phases], dtype=bool)
        ttft = p.sum(axis=1).mean()
        saves = np.minimum(p[lower, 0], p[lower, 1]).sum() / len(p)
        waits = [f"{p[lower, i].mean():.2f}" if lower.any() else "-" for i in (0, 1)]
        rows.append([r.config, *(f"{x:.2f}" for x in p.mean(axis=0)), f"{lower.mean():.2f}", *waits])
        rows[-1].append(f"{saves:.2f} s ({100 * saves / ttft:.1f}%)")
    return md_table(headers, rows, left=1)


def notes(results: Sequence[RunResult], tier: TierModel) -> list[str]:
    """What the decision ended up believing, and how often requests waited a step."""
    out = []
    for r in results:
        line = f"- {r.config}: {r.steps:,} steps, {r.deferred:,} deferred lookups"
        stats = r.tier_stats.get(tier.name, {})
        if r.config in DECIDING and r.costs:
            est = r.costs["tiers"].get(tier.name, {})
            line += (
                f"; final estimates {tier.name} {est.get('gbps', math.nan):.2f} GB/s ({est.get('samples', 0)} samples), "
                f"prefill {r.costs['prefill_tokens_per_s']:,.0f} tokens/s ({r.costs['prefill_source']}); "
                f"{stats.get('skipped_slower_than_recompute', 0):,} {tier.name} chunks passed over, "
                f"{stats.get('probes', 0):,} probes"
            )
        if r.config != "recompute":
            line += f"; {tier.name} writes dropped (back-pressure) {stats.get('drops', 0):,}"
        if tier.fail_rate:
            line += f"; {r.failed_reads:,} {tier.name} reads failed"
        if r.prefetch:
            n = {event.split(".", 1)[1]: v for event, v in r.prefetch.items()}
            line += (
                f"; {n['prefetches']:,} {tier.name} chunks prefetched: used {n['prefetch_used']:,}, wasted "
                f"{n['prefetch_wasted']:,}, failed {n['prefetch_failed']:,}; {n['prefetch_cancelled']:,} "
                "dropped from queues as their requests ran"
            )
        out.append(line)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="a Mooncake FAST'25 trace (jsonl)")
    src.add_argument("--workload", choices=GENERATED, help="a generated workload, Poisson arrivals")
    p.add_argument("--utilisation", type=float, default=0.7, help="target GPU busy share of recompute (default 0.7)")
    p.add_argument("--tier-gbps", type=float, default=3.0, help="lower tier GB/s, reads and writes (default 3)")
    p.add_argument("--tier", choices=("disk", "shared"), default="disk", help="which product tier (default disk)")
    p.add_argument("--tier-latency-ms", type=float, help="per job (default: disk 0.1, shared 5)")
    p.add_argument(
        "--tier-slow",
        metavar="FACTOR,EVERY_S,FOR_S",
        help="slow episodes: the lower tier's jobs FACTOR x as long for the last FOR_S of every EVERY_S\n"
        "simulated seconds (e.g. 10,600,60); the decision learns of them only from what it times",
    )
    p.add_argument(
        "--tier-fail",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="the share of the chunks lower-tier reads (loads, prefetches) take that fail, after their\n"
        "time; a failed load's request is computed from its first failed chunk, as vLLM's recompute\n"
        "policy does with the blocks the worker reports (default 0)",
    )
    p.add_argument(
        "--verify",
        choices=("none", "read"),
        default="none",
        help="hit check before a lower-tier hit (default none: one read per hit, this project's\n"
        "connector with vLLM's recompute policy; read: read back first, then load: vLLM's own connector)",
    )
    p.add_argument("--slo-ms", type=float, default=5000.0, help="TTFT SLO of the goodput column (default 5000)")
    p.add_argument("--limit", type=int, help="the first N requests only")
    p.add_argument("--requests", type=int, help="generated workloads: request count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS[:4]), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="add cost-aware+prefetch: cost-aware with every waiting request's lower-tier\n"
        "chunks prefetched into CPU (the product's default; the other rows run without it)",
    )
    p.add_argument(
        "--prefetch-max-bytes",
        default="256MiB",
        help="prefetch reads in flight (the product's prefetch_max_bytes; default 256MiB)",
    )
    p.add_argument(
        "--cpu-retention",
        default=TieredConfig.cpu_retention,
        help=f"the CPU tier's cpu_retention: none, session, session(S) (default: the product's, {TieredConfig.cpu_retention})",
    )
    p.add_argument(
        "--cpu-admission",
        default=TieredConfig.cpu_admission,
        help=f"the CPU tier's cpu_admission: all, reuse(N), adaptive(N) (default: the product's, {TieredConfig.cpu_admission})",
    )
    p.add_argument("--token-budget", type=int, default=8192, help="tokens per step (default 8192)")
    p.add_argument("--max-seqs", type=int, default=256)
    p.add_argument("--device-tokens", type=int, default=DEVICE_TOKENS, help="GPU KV and prefix cache (default 512Ki)")
    p.add_argument("--cpu-tokens", type=int, default=CPU_TOKENS, help="CPU tier (default 3M: the paper's local cache)")
    p.add_argument("--lower-tokens", type=int, help=f"lower tier (default {LOWER_FRACTION} x the working set)")
    p.add_argument("--cpu-gbps", type=float, default=50.0, help="CPU <-> GPU each way (default 50)")
    p.add_argument("--mfu", type=float, default=0.5, help="prefill's true MFU in the simulation (default 0.5)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense BF16 (default 989: H100 SXM)")
    p.add_argument("--params", type=float, default=8.03e9, help="model parameters (default Llama-3.1-8B)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096, help="attention width: heads x head dim")
    p.add_argument("--kv-bytes-per-token", type=int, default=131_072)
    p.add_argument("--step-overhead-ms", type=float, default=2.0, help="fixed cost per step (default 2)")
    p.add_argument("--scratch", type=Path, help="where the lower tier's index lives while it runs")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        p.error(f"--configs: {bad or 'none'}; expected some of {', '.join(CONFIGS)}")
    if args.prefetch and "cost-aware+prefetch" not in configs:
        configs.append("cost-aware+prefetch")
    args.configs = configs
    try:
        args.prefetch_max_bytes = parse_size(args.prefetch_max_bytes, "--prefetch-max-bytes")
        args.cpu_retention = parse_cpu_retention(args.cpu_retention, "--cpu-retention")
        args.cpu_admission = parse_cpu_admission(args.cpu_admission, "--cpu-admission")
        args.tier_slow = Slowdown.parse(args.tier_slow) if args.tier_slow else None
        if not 0 <= args.tier_fail < 1:
            raise ValueError(f"--tier-fail {args.tier_fail:g}: expected a share in [0, 1)")
    except ValueError as e:
        p.error(str(e))
    return args


def _slow_text(slow: Slowdown | None) -> str:
    if slow is None:
        return ""
    return f" ({slow.factor:g}x as long for {slow.for_s:g} s of every {slow.every_s:g} s)"


def replay(args: argparse.Namespace) -> tuple[str, list[RunResult], TierModel]:
    """One replay as ``args`` (``parse_args``) say: its header, each configuration's
    result, and the lower tier's model."""
    stream: Stream = mooncake(args.trace) if args.trace else generated(args.workload, args.seed, args.requests)
    stream = stream.head(args.limit)
    gpu = GpuModel(
        args.params,
        args.layers,
        args.hidden,
        args.kv_bytes_per_token,
        args.mfu,
        args.peak_tflops,
        args.step_overhead_ms / 1e3,
    )
    engine = EngineConfig(
        max(1, args.device_tokens // TOKENS_PER_BLOCK), args.token_budget, args.max_seqs, args.cpu_gbps
    )
    latency = args.tier_latency_ms if args.tier_latency_ms is not None else LATENCY_MS[args.tier]
    tier = TierModel(args.tier, args.tier_gbps, latency / 1e3, args.verify == "read", args.tier_slow, args.tier_fail)
    cpu_blocks = max(1, args.cpu_tokens // TOKENS_PER_BLOCK)
    ws = stream.working_set
    lower_blocks = max(
        1, args.lower_tokens // TOKENS_PER_BLOCK if args.lower_tokens else math.ceil(LOWER_FRACTION * ws)
    )
    work = estimate_work(stream, gpu, engine.device_blocks, cpu_blocks, engine.token_budget)
    factor = time_scale(stream, work, args.utilisation)
    reqs = arrivals(stream, factor)
    # Failed reads (``--tier-fail``) are counted in the notes, not logged one by one.
    log = logging.getLogger("tiered_kv")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        results = [
            run_config(
                c,
                reqs,
                gpu,
                engine,
                tier,
                cpu_blocks,
                lower_blocks,
                args.scratch,
                args.prefetch_max_bytes,
                args.cpu_retention,
                args.cpu_admission,
            )
            for c in args.configs
        ]
    finally:
        log.setLevel(level)
    bpb = gpu.kv_bytes_per_token * TOKENS_PER_BLOCK
    header = (
        f"{stream.name}: {len(reqs):,} requests, {sum(stream.tokens) / len(reqs):,.0f} prompt tokens on average "
        f"(token-weighted {sum(t * t for t in stream.tokens) / sum(stream.tokens):,.0f}, longest "
        f"{max(stream.tokens):,}); working set {ws:,} chunks of {TOKENS_PER_BLOCK} tokens ({bpb / 2**20:g} MiB)\n"
        f"arrivals x{factor:.3g} (span {reqs[-1].time:,.0f} s) for {args.utilisation:g} GPU utilisation of "
        f"recompute (estimated work {work:,.0f} s); prefill {gpu.linear_tokens_per_s:,.0f} tokens/s before "
        f"attention at {gpu.mfu:g} MFU x {gpu.peak_tflops:g} TFLOPS, {args.step_overhead_ms:g} ms a step, "
        f"{engine.token_budget} tokens a step\n"
        f"{tier.name} tier ({tier.medium}): {tier.gbps:g} GB/s, {latency:g} ms a job"
        f"{_slow_text(tier.slow)}{f', {100 * tier.fail_rate:g}% of chunk reads failing' if tier.fail_rate else ''}, "
        f"{'hits read back first' if tier.verify else 'no read-back check'}; capacities: device "
        f"{engine.device_blocks:,}, CPU {cpu_blocks:,} ({args.cpu_gbps:g} GB/s; cpu_admission {args.cpu_admission}, "
        f"cpu_retention {args.cpu_retention}), {tier.name} {lower_blocks:,} chunks\n"
    )
    return header, results, tier


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header, results, tier = replay(args)
    print(header)
    print(table(results, tier, args.slo_ms / 1e3))
    print("\nWhere the time to first token goes (mean s per request):\n")
    print(phases_table(results, tier))
    print()
    print("\n".join(notes(results, tier)))
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
