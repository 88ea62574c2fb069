#!/usr/bin/env python
"""Mooncake's FAST'25 traces with time: one row per CPU-tier policy, beside Belady's
optimum and the infinite cache.

The serving replay (``tools/replay_serving.py``: one prefill GPU, vLLM 0.33's scheduler,
FIFO I/O channels, the product's managers in vLLM's call order) on a Mooncake trace,
each row's CPU tier under one policy named by its config values, as
``tools/replay_claude_code.py --serving`` replays the Claude Code conversations
(``replay_serving_sessions``: the same rows, table and notes):

- **Arrivals**: open loop, at the trace's timestamps (requests in timestamp order), the
  gaps scaled so that the ``recompute`` configuration's estimated GPU work fills
  ``--utilisation`` of the span (``replay_serving_workloads.time_scale``), as
  ``tools/replay_serving.py`` scales them.
- **Sessions**: the traces name none; a request that contains the last chunk of a
  session's latest request extends it (``replay_policies.chain_sessions``, as
  the session rule infers them). A turn is a request sharing a prefix with its
  session's previous request; the table's turn columns count those that found all of it
  in CPU, and in some tier, on arrival.
- **Rows** (``replay_serving_sessions.parse_row``): ``<policy>[+disk][+ids][+hints[+prefetch]]``.
  ``+ids``: each request names its chained session, as a client sending vLLM's
  ``session_id`` would; ``+hints``: KV hints synthesised from the chained sessions
  (``kv.retain`` leased to the session on every turn but its last, ``kv.release`` on
  its last), TTL the product's 300 s times the time factor.
- **References** (no time, arrival order): Belady's optimum (furthest next use evicted,
  ties deepest block first) at the device cache plus the CPU tier's capacity, the
  comparable column being the table's ``GPU + CPU`` hits (``of Belady``); Belady at the
  CPU tier's capacity alone (``tools/replay.py --policies``' column); and the infinite
  cache, every chunk seen before found.

Defaults: the paper's 3M-token CPU tier (5,859 chunks of 512 tokens), the device cache
512Ki tokens, a disk tier of 1.25 x the working set at 3 GB/s, configuration
``cost-aware``.

    python tools/replay_mooncake_sessions.py \\
        --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl --utilisation 0.9
    python tools/replay_mooncake_sessions.py --trace T --utilisation 0.3 --policies 'lru,lru+hints'

Runs in one process; reads the trace; each row's disk tier keeps an index under a
temporary directory (``--scratch``), removed afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from replay_cost import belady_hit_rate, infinite_hit_rate
from replay_policies import _common_prefix, chain_sessions, parse_tokens
from replay_serving import CPU_TOKENS, DEVICE_TOKENS, LATENCY_MS, LOWER_FRACTION, phases_table
from replay_serving_model import EngineConfig, GpuModel
from replay_serving_sim import RunResult
from replay_serving_sessions import Sessions, Setup, Turn, notes, parse_row, policy_table, run_policy
from replay_serving_stack import TierModel
from replay_serving_workloads import TOKENS_PER_BLOCK, Stream, estimate_work, mooncake, time_scale

from tiered_kv.config import TieredConfig

#: The product's default CPU-tier policy, as a row.
DEFAULT_ROW = f"{TieredConfig.eviction_policy}+{TieredConfig.cpu_admission}+{TieredConfig.cpu_retention}"
POLICIES = (
    "lru",
    "arc",
    "lru+session",
    "lru+hints",
    "lru+reuse(2)",
    "lru+adaptive(2)",
    DEFAULT_ROW,
    f"{DEFAULT_ROW}+hints",
)


def chained(stream: Stream) -> Sessions:
    """``stream``'s requests as open-loop turns (each at its own time, none waiting for
    another) in sessions chained by prefix (module docstring)."""
    session = chain_sessions(stream.blocks)
    last = {s: i for i, s in enumerate(session)}
    previous: dict[int, int] = {}
    turns = []
    t0 = stream.times[0]
    for i, (t, tokens, chunks) in enumerate(zip(stream.times, stream.tokens, stream.blocks)):
        s = session[i]
        before = previous.get(s)
        prefix = _common_prefix(stream.blocks[before], chunks) if before is not None else 0
        previous[s] = i
        turns.append(Turn(f"s{s}", tokens, chunks, None, t - t0, prefix, f"s{s}", last[s] == i))
    return Sessions(stream.name, turns, list(stream.times), 0, len(last), 0, math.inf)


def replay(
    stream: Stream,
    policies: Sequence[str],
    *,
    utilisation: float,
    cpu_tokens: int = CPU_TOKENS,
    device_tokens: int = DEVICE_TOKENS,
    tier_gbps: float = 3.0,
    config: str = "cost-aware",
    scratch: Path | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> tuple[str, list[tuple[str, RunResult]], Setup, float]:
    """Each policy's row over ``stream`` at ``utilisation``: the header, the rows, what
    they shared and Belady's hit rate at the device + CPU capacity."""
    rows = [parse_row(name) for name in policies]
    s = chained(stream)
    gpu, engine = GpuModel(), EngineConfig(max(1, device_tokens // TOKENS_PER_BLOCK))
    tier = TierModel("disk", tier_gbps, LATENCY_MS["disk"] / 1e3, False)
    ws = stream.working_set
    cpu_blocks = max(1, cpu_tokens // TOKENS_PER_BLOCK)
    setup = Setup(gpu, engine, tier, cpu_blocks, max(1, math.ceil(LOWER_FRACTION * ws)), config, scratch)
    work = estimate_work(stream, gpu, engine.device_blocks, cpu_blocks, engine.token_budget)
    factor = time_scale(stream, work, utilisation)
    results = []
    for row in rows:
        t0 = time.perf_counter()
        results.append((row.name, run_policy(row.name, s.arrivals(factor, row), setup)))
        log(f"  {row.name}: {time.perf_counter() - t0:.0f} s")
    both = belady_hit_rate(stream.blocks, engine.device_blocks + cpu_blocks)
    turns = sum(1 for t in s.turns if t.prefix)
    header = (
        f"{stream.name}: {len(s.turns):,} requests in {s.conversations:,} sessions chained by prefix ({turns:,} "
        f"turns extending their session's previous prompt), {sum(stream.tokens) / len(s.turns):,.0f} prompt tokens "
        f"on average; working set {ws:,} chunks of {TOKENS_PER_BLOCK} tokens\n"
        f"arrivals at the trace's times x{factor:.3g} for {utilisation:g} GPU utilisation of recompute (estimated "
        f"work {work:,.0f} s); Llama-3.1-8B on one H100 (prefill {gpu.linear_tokens_per_s:,.0f} tokens/s before "
        f"attention at {gpu.mfu:g} MFU), {engine.token_budget} tokens a step; configuration {config}\n"
        f"capacities: device {engine.device_blocks:,} chunks, CPU {cpu_blocks:,} ({engine.cpu_gbps:g} GB/s), disk "
        f"{setup.disk_blocks:,} ({LOWER_FRACTION:g} x working set, {tier.gbps:g} GB/s); the product's default "
        f"policy: {DEFAULT_ROW}\n"
        f"references (no time, arrival order): Belady at device + CPU {both:.3f}, at CPU alone "
        f"{belady_hit_rate(stream.blocks, cpu_blocks):.3f}; infinite cache {infinite_hit_rate(stream.blocks):.3f}"
    )
    if any(row.hints for row in rows):
        header += (
            f"\n+hints: kv.retain (lease_id its chained session, ttl_s 300 s x {factor:.3g}) on every turn but "
            "its session's last, which sends kv.release"
        )
    return header, results, setup, both


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, required=True, help="a Mooncake FAST'25 trace (jsonl)")
    p.add_argument("--utilisation", type=float, default=0.9, help="target GPU busy share of recompute (default 0.9)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"rows (default {','.join(POLICIES)})")
    p.add_argument("--cpu-tokens", default="3M", help="CPU tier in tokens (k, M, G: 10^3, 6, 9; default 3M)")
    p.add_argument("--device-tokens", type=int, default=DEVICE_TOKENS, help="GPU prefix cache (default 512Ki)")
    p.add_argument("--tier-gbps", type=float, default=3.0, help="disk GB/s, reads and writes (default 3)")
    p.add_argument("--config", default="cost-aware", help="tools/replay_serving.py's row (default cost-aware)")
    p.add_argument("--limit", type=int, help="the first N requests only")
    p.add_argument("--scratch", type=Path, help="where the disk tier's index lives while it runs")
    args = p.parse_args(argv)
    try:
        args.cpu_tokens = parse_tokens(args.cpu_tokens)
        args.policies = [parse_row(x).name for x in args.policies.split(",") if x.strip()]
        if not 0 < args.utilisation <= 2:
            raise ValueError(f"--utilisation: expected 0 < u <= 2, got {args.utilisation:g}")
        if not 0 < args.tier_gbps < math.inf:
            raise ValueError(f"--tier-gbps: expected a finite rate > 0, got {args.tier_gbps:g}")
        if args.device_tokens < TOKENS_PER_BLOCK:
            raise ValueError(
                f"--device-tokens: expected at least one chunk ({TOKENS_PER_BLOCK}), got {args.device_tokens}"
            )
    except ValueError as exc:
        p.error(str(exc))
    if not args.policies:
        p.error("--policies: expected at least one row")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    command = "python tools/replay_mooncake_sessions.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        stream = mooncake(args.trace).head(args.limit)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    header, results, setup, belady = replay(
        stream,
        args.policies,
        utilisation=args.utilisation,
        cpu_tokens=args.cpu_tokens,
        device_tokens=args.device_tokens,
        tier_gbps=args.tier_gbps,
        config=args.config,
        scratch=args.scratch,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    chunks = sum(map(len, stream.blocks))
    phases = phases_table([dataclasses.replace(r, config=name) for name, r in results], setup.tier)
    print(
        f"command: `{command}`\n\n{header}\n\n{policy_table(results, chunks, belady)}\n\n"
        f"Where the time to first token goes (mean s per request):\n\n{phases}\n\n"
        + "\n".join(notes(results, setup.tier))
        + "\n\nhit rate: full chunks served by the GPU's prefix cache, CPU and disk, over all full chunks; of "
        "Belady: GPU + CPU hits over Belady's at their capacity. Turns: requests sharing a prefix with their "
        "session's previous request; prefix in CPU / in any tier: the share that found all of it there on "
        "arrival. TTFT per request, arrival to first token."
    )
    print(f"\nwall time: {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
