#!/usr/bin/env python
"""Agentic coding sessions on one server: CPU-tier policies over a disk tier.

Reads the kv-cache-tester Claude Code conversations (``--traces``, default
``../shared/traces/claude_code_kvtester``: 64-token blocks, ids local to a conversation,
so each is prefixed with its conversation's number; sub-agents' nested requests
flattened in time order, ``replay_workloads.read_claude_code``), interleaves all of them
on one server by their times (every conversation starts at 0), and replays them through
the product's managers (``replay_policies.replay``): a CPU tier of ``--cpu-fraction`` of
the working set under each policy, over a disk tier of ``--disk-fraction`` (LRU, write
through, hits promoted to CPU). The retention rule's clock is the requests' time.

Per policy (named as its config values, as in ``tools/replay.py --policies``): block hit
rate from CPU, from disk, and in all; CPU hits against LRU's; and the share of turns
(a request whose session's previous request shares a prefix with it: the previous turn
of its conversation, or of its sub-agent) that find that whole prefix in CPU, and in any
tier, when they arrive: the sessions whose prefix survived their tool gap. Sessions are
the conversations (and sub-agents): ``session`` rows infer them from the prefix chain,
as a server without session ids does; ``--session-ids`` adds the rows with the ids
given, as vLLM's ``session_id`` would. References: Belady's optimum for the CPU tier's
capacity alone, and the infinite cache.

``--serving`` replays them with time instead (``replay_serving_sessions``): each
conversation a closed loop (a turn sent when the previous one got its first token plus
the trace's gap), ``--users`` clients running them back to back, the gaps scaled so that
recomputing keeps the GPU ``--utilisation`` busy, through the serving replay's GPU and
I/O channels and the product's managers in vLLM's call order (``--config``, default
``cost-aware``). Per policy: hit rate from the GPU's prefix cache, CPU and disk, the
turns whose prefix survived their tool gap, TTFT per request against LRU's, GPU busy;
then where each row's time to first token goes (``replay_serving.phases_table``).
A row there may add what its clients send with each request, after the policy
(``replay_serving_sessions.parse_row``): ``+ids``, the session's name (vLLM's
``session_id``) for the session rule (``lru+session+ids``); ``+hints``, KV hints
synthesised from the sessions (``kv.retain`` leased to the session on each turn,
``kv.release`` at its last; ``lru+hints``); ``+hints+prefetch``, ``kv.prefetch`` too.

``--export-mooncake FILE`` writes the workload in Mooncake's FAST'25 format (512-token
chunks, a chunk named by its last 64-token block, which names its prefix) for
``tools/replay_serving.py --trace FILE``, the serving replay with time (its CPU tier runs
the product's default policy; it takes no policy of ours).

    python tools/replay_claude_code.py
    python tools/replay_claude_code.py --policies lru,lru+session --session-ids
    python tools/replay_claude_code.py --serving --utilisation 0.8
    python tools/replay_claude_code.py --serving --utilisation 0.8 --users 16 \\
        --policies 'lru,lru+session,lru+session+ids,lru+hints,lru+reuse(2)'

Runs in one process; reads the conversation files; the disk tier keeps an index under a
temporary directory (``--scratch``), removed afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import md_table  # noqa: E402
from replay_cost import belady_hit_rate, infinite_hit_rate  # noqa: E402
from replay_policies import Outcome, Requests, parse_policy, replay  # noqa: E402
from replay_workloads import CLAUDE_CODE_BLOCK_TOKENS, AgentRequest, read_claude_code_folder  # noqa: E402

DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "claude_code_kvtester"
DEFAULT_POLICIES = "lru,arc,lru+reuse(2),lru+session,lru+reuse(2)+session,lru+retention-oracle,lru+admission-oracle"
SERVING_POLICIES = "lru,lru+session,lru+reuse(2),lru+reuse(2)+session"
COLUMNS = [
    "policy",
    "CPU",
    "disk",
    "hit rate",
    "CPU hits / lru's",
    "CPU of Belady",
    "turns: prefix in CPU",
    "in any tier",
]
#: The serving replay's chunk: 8 blocks of 64 tokens.
CHUNK_TOKENS = 512


def requests_of(agent_requests: Sequence[AgentRequest], named: bool = False) -> Requests:
    """The replay's stream: blocks as 8-byte hashes, times, sessions (conversation and
    sub-agent); ``named``: the retention rule is told the sessions."""
    return Requests(
        "claude code",
        [[h.to_bytes(8, "big") for h in r.blocks] for r in agent_requests],
        [r.time for r in agent_requests],
        [r.session for r in agent_requests],
        named=named,
        tokens_per_block=CLAUDE_CODE_BLOCK_TOKENS,
    )


def write_mooncake(agent_requests: Sequence[AgentRequest], path: Path) -> int:
    """Write the requests as a Mooncake FAST'25 trace of 512-token chunks; the chunks
    written."""
    per = CHUNK_TOKENS // CLAUDE_CODE_BLOCK_TOKENS
    ids: dict[int, int] = {}
    chunks = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in agent_requests:
            full = r.tokens // CHUNK_TOKENS
            hash_ids = [ids.setdefault(r.blocks[per * c + per - 1], len(ids)) for c in range(full)]
            if r.tokens % CHUNK_TOKENS:
                hash_ids.append(ids.setdefault(-len(ids) - 1, len(ids)))  # a partial chunk, never shared
            chunks += full
            row = {"timestamp": round(r.time * 1e3), "input_length": r.tokens, "output_length": 0, "hash_ids": hash_ids}
            f.write(json.dumps(row) + "\n")
    return chunks


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="folder of kv-cache-tester *.json files")
    p.add_argument(
        "--policies",
        help=f"comma-separated (default {DEFAULT_POLICIES}; with --serving {SERVING_POLICIES}); with --serving "
        "a row may add the disk tier's retention and what its clients send: <policy>[+disk][+ids][+hints[+prefetch]], "
        "e.g. lru+session+disk (retention: session on the disk tier too), lru+session+ids (each request names its "
        "session), lru+hints (kv.retain leased to the session per turn, kv.release at its end), lru+hints+prefetch "
        "(kv.prefetch too)",
    )
    p.add_argument("--cpu-fraction", type=float, default=0.25, help="CPU tier = this x the working set (0.25)")
    p.add_argument("--disk-fraction", type=float, default=0.5, help="disk tier = this x the working set (0.5)")
    p.add_argument("--session-ids", action="store_true", help="add the session rows with the session ids given")
    p.add_argument("--export-mooncake", type=Path, help="also write the workload for tools/replay_serving.py --trace")
    p.add_argument("--scratch", type=Path, help="where the disk tier's index lives while it runs")
    s = p.add_argument_group("with time (--serving)")
    s.add_argument("--serving", action="store_true", help="replay with time: closed loops, TTFT (module docstring)")
    s.add_argument("--utilisation", type=float, default=0.7, help="GPU busy share of recompute (default 0.7)")
    s.add_argument("--users", type=int, help="conversations at once (default: their total duration over the longest)")
    s.add_argument("--max-gap-s", type=float, default=3600.0, help="longer gaps are cut to this (default 3600)")
    s.add_argument("--config", default="cost-aware", help="tools/replay_serving.py's row (default cost-aware)")
    s.add_argument("--tier-gbps", type=float, default=3.0, help="disk GB/s, reads and writes (default 3)")
    s.add_argument("--device-tokens", type=int, default=512 * 1024, help="GPU cache (default 512Ki)")
    args = p.parse_args(argv)
    for name in ("cpu_fraction", "disk_fraction"):
        if not 0 < getattr(args, name) <= 4:
            p.error(f"--{name.replace('_', '-')}: expected 0 < x <= 4 (of the working set), got {getattr(args, name)}")
    policies = args.policies or (SERVING_POLICIES if args.serving else DEFAULT_POLICIES)
    try:
        if args.serving:
            from replay_serving_sessions import parse_row  # vLLM's types: only with --serving

            rows = [parse_row(x) for x in policies.split(",") if x.strip()]
            args.policies, parsed = [x.name for x in rows], [x.policy for x in rows]
        else:
            parsed = [parse_policy(x) for x in policies.split(",") if x.strip()]
            args.policies = [x.name for x in parsed]
    except ValueError as exc:
        p.error(str(exc))
    if not args.policies or "belady" in args.policies:
        p.error("--policies: expected at least one replayed policy (belady is a reference column here)")
    if args.serving:
        if any(x.is_oracle for x in parsed) or args.session_ids or args.export_mooncake:
            p.error("--serving: replays the policies' config values only (no oracle, --session-ids, --export-mooncake)")
        if not 0 < args.utilisation <= 1 or not args.max_gap_s > 0 or (args.users is not None and args.users < 1):
            p.error("--serving: expected 0 < --utilisation <= 1, --max-gap-s > 0, --users >= 1")
        from replay_serving_stack import CONFIGS  # vLLM's types: only with --serving

        if args.config not in CONFIGS:
            p.error(f"--config: expected one of {', '.join(CONFIGS)}, got {args.config!r}")
    return args


def table(results: list[tuple[str, Outcome]], belady: float) -> str:
    lru = next((o for name, o in results if name == "lru"), None)
    rows = []
    for name, o in results:
        rows.append(
            [
                name,
                f"{o.cpu_rate:.3f}",
                f"{o.lower_hits / max(1, o.blocks):.3f}",
                f"{o.hit_rate:.3f}",
                "-" if lru is None or not lru.cpu_hits else f"{o.cpu_hits / lru.cpu_hits:.3f}",
                f"{o.cpu_rate / belady:.2f}" if belady else "-",
                f"{o.survived_cpu / max(1, o.turns):.3f}",
                f"{o.survived_any / max(1, o.turns):.3f}",
            ]
        )
    return md_table(COLUMNS, rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    command = "python tools/replay_claude_code.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        agent_requests = read_claude_code_folder(args.traces)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    if args.serving:
        return main_serving(args, agent_requests, command, started)
    reqs = requests_of(agent_requests)
    ws = reqs.working_set
    cpu, disk = max(1, round(args.cpu_fraction * ws)), max(1, round(args.disk_fraction * ws))
    runs: list[tuple[str, Requests, str]] = [(name, reqs, name) for name in args.policies]
    if args.session_ids:
        named = requests_of(agent_requests, named=True)
        runs += [
            (f"{name}, session ids given", named, name)
            for name in args.policies
            if parse_policy(name).retention not in ("none", "oracle")
        ]
    results = []
    for label, stream, name in runs:
        t0 = time.perf_counter()
        results.append((label, replay(stream, cpu, name, lower_blocks=disk, scratch=args.scratch)))
        print(f"  {label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    belady = belady_hit_rate(reqs.blocks, cpu)
    conversations = len({r.session[0] for r in agent_requests})
    blocks = sum(map(len, reqs.blocks))
    turns = results[0][1].turns
    print(
        f"command: `{command}`\n\n"
        f"workload: {conversations} conversations from {args.traces}, {len(reqs.blocks)} requests "
        f"({sum(1 for r in agent_requests if r.session[1])} in sub-agents, {len(set(reqs.sessions))} sessions), "
        f"{blocks:,} blocks of {CLAUDE_CODE_BLOCK_TOKENS} tokens, working set {ws:,} blocks, {turns} turns that "
        f"extend their session's previous prefix; interleaved by time on one server (span "
        f"{max(reqs.times):,.0f} s)\n"
        f"tiers: CPU {cpu:,} blocks ({args.cpu_fraction:g} x working set) over disk {disk:,} blocks "
        f"({args.disk_fraction:g} x, LRU, write-through, hits promoted); no device cache\n"
        f"references: Belady at the CPU tier's capacity alone {belady:.3f}, infinite cache "
        f"{infinite_hit_rate(reqs.blocks):.3f}\n\n{table(results, belady)}\n\n"
        "CPU, disk, hit rate: leading-run block hits served by each tier, over all blocks. Turns: requests "
        "sharing a prefix with their session's previous request; prefix in CPU / in any tier: the share of "
        "them that found all of it there on arrival."
    )
    if args.export_mooncake:
        chunks = write_mooncake(agent_requests, args.export_mooncake)
        print(f"\nwrote {args.export_mooncake}: {len(agent_requests)} requests, {chunks:,} full 512-token chunks")
    print(f"\nwall time: {time.perf_counter() - started:.1f} s")
    return 0


def main_serving(args: argparse.Namespace, agent_requests: Sequence[AgentRequest], command: str, started: float) -> int:
    """``--serving``: the policy table with time (``replay_serving_sessions``)."""
    import replay_serving_sessions as serving  # vLLM's types: only with --serving
    from replay_serving import phases_table

    header, results, setup = serving.replay(
        agent_requests,
        args.policies,
        utilisation=args.utilisation,
        users=args.users,
        max_gap_s=args.max_gap_s,
        cpu_fraction=args.cpu_fraction,
        disk_fraction=args.disk_fraction,
        config=args.config,
        tier_gbps=args.tier_gbps,
        device_tokens=args.device_tokens,
        scratch=args.scratch,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    chunks = sum(r.tokens // serving.TOKENS_PER_BLOCK for r in agent_requests)
    phases = phases_table([dataclasses.replace(r, config=name) for name, r in results], setup.tier)
    print(
        f"command: `{command}`\n\n{header}\n\n{serving.policy_table(results, chunks)}\n\n"
        f"Where the time to first token goes (mean s per request):\n\n{phases}\n\n"
        + "\n".join(serving.notes(results, setup.tier))
        + "\n\nhit rate: full chunks served by the GPU's prefix cache, CPU and disk, over all full chunks. Turns: "
        "requests sharing a prefix with their session's previous request; prefix in CPU / in any tier (GPU, CPU, "
        "disk): the share of them that found all of it there on arrival. TTFT per request, arrival to first token."
    )
    print(f"\nwall time: {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
