"""CPU-tier policy table: block hit rate per eviction policy and CPU admission, beside Belady.

``python tools/replay.py --trace T --cpu-tokens 3M --policies lru,arc,lru+reuse(2)``

Replays a Mooncake FAST'25 trace (``fleet_trace``: 512-token blocks, prefix-chained
ids), requests in file order, through the product's own managers: a
``TieredOffloadingManager`` with no lower tier over the CPU tier's manager
(``tiered_kv.cpu.cpu_tier_manager``) of the policy's ``eviction_policy`` and
``cpu_admission``. No device cache and no bytes: per request, ``lookup``, load its
leading hits, store every block, touch the chain. A policy is named as its config
values: ``lru``, ``arc``, ``lru+reuse(2)``; ``<policy>+oracle`` admits only blocks the
trace uses again later (the bound for any admission rule, as Belady's is for eviction).

Columns: block hit rate (leading-run hits over all blocks), Belady's optimum at the
same capacity (``replay_cost.belady_hit_rate``: the block used again furthest ahead
goes first; among blocks never used again, the deepest first), and their ratio.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from benchlib import md_table
from fleet_trace import TOKENS_PER_BLOCK, read_mooncake_trace
from replay_cost import belady_hit_rate

from tiered_kv.config import EVICTION_POLICIES, ConfigError, admit_after, parse_cpu_admission
from tiered_kv.cpu import cpu_tier_manager
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.admission import WriteAdmission
from tiered_kv.tiered.manager import TieredOffloadingManager

DEFAULT_POLICIES = "lru,arc,lru+reuse(2),arc+reuse(2)"
COLUMNS = ["policy", "block hit rate", "Belady", "of Belady"]
_TOKENS_RE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)$")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policies",
        help=f"print the CPU-tier policy table for --trace (a Mooncake trace) instead, e.g. {DEFAULT_POLICIES}; "
        "each <eviction_policy>[+<cpu_admission>|+oracle]",
    )
    p.add_argument("--cpu-tokens", default="3M", help="CPU tier size in tokens for --policies (k, M, G: 10^3, 6, 9)")


def parse_tokens(value: str) -> int:
    """``3M`` -> 3,000,000 (decimal suffixes k, M, G)."""
    m = _TOKENS_RE.match(value.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--cpu-tokens: expected a positive token count such as 3M or 500k, got {value!r}")
    return int(float(m.group(1)) * 10 ** (3 * " kmg".index(m.group(2).lower() or " ")))


def parse_policy(name: str) -> tuple[str, str]:
    """``lru+reuse(2)`` -> (``lru``, ``reuse(2)``); admission ``all`` when not given."""
    eviction, _, admission = name.strip().partition("+")
    if eviction not in EVICTION_POLICIES:
        raise ValueError(
            f"--policies: {name!r}: expected <eviction_policy>[+<cpu_admission>|+oracle] with an "
            f"eviction_policy among {', '.join(EVICTION_POLICIES)}, got {eviction!r}"
        )
    if admission == "oracle":
        return eviction, admission
    try:
        return eviction, parse_cpu_admission(admission or "all", f"--policies: {name!r}: cpu_admission")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


class OracleAdmission(WriteAdmission):
    """Admits a block only while the trace still has a use of it to come; ``used`` is
    told each request's blocks before they are stored."""

    def __init__(self, requests: Sequence[Sequence], stats: TieredStats):
        super().__init__([2], ["cpu"], 1, stats)  # asked on every store; keeps no history
        self.remaining = Counter(h for r in requests for h in r)

    def note(self, block_hashes: Sequence) -> None:
        """Counts nothing: the trace's remaining uses decide."""

    def used(self, block_hashes: Sequence) -> None:
        self.remaining.subtract(block_hashes)

    def admits(self, i: int, block_hash) -> bool:
        return self.remaining[block_hash] > 0

    def admitted(self, i: int, block_hashes: list) -> list:
        admitted = [h for h in block_hashes if self.remaining[h] > 0]
        self.stats.count(self.names[i], "not_admitted", len(block_hashes) - len(admitted))
        return admitted


def replay_hit_rate(requests: Sequence[Sequence[int]], capacity: int, policy: str) -> float:
    """Leading-run block hits over all blocks of ``requests`` through the product's
    managers under ``policy`` (module docstring), ``capacity`` CPU blocks."""
    eviction, admission = parse_policy(policy)
    keyed = [[h.to_bytes(8, "big") for h in r] for r in requests]
    oracle = admission == "oracle"
    n = 2 if oracle else admit_after(admission, "cpu")
    cpu = cpu_tier_manager(eviction, capacity, TOKENS_PER_BLOCK, enable_events=False, admit_after=n)
    manager = TieredOffloadingManager(cpu, None, costs=None)
    future = OracleAdmission(keyed, manager.stats) if oracle else None
    if future is not None:
        cpu.admission = future
    hits = total = 0
    for keys in keyed:
        k = manager.lookup(keys)
        hits += k
        total += len(keys)
        if k:
            manager.prepare_load(keys[:k])
            manager.complete_load(keys[:k])
        if future is not None:
            future.used(keys)
        stored = manager.prepare_store(keys)
        if stored is not None:
            manager.complete_store(stored.block_hashes_to_store)
        manager.touch(keys)
    manager.shutdown()
    return hits / max(1, total)


def with_oracle_rows(policies: list[str]) -> list[str]:
    """``policies`` plus ``<eviction>+oracle`` for each eviction policy named, unless given."""
    out = list(policies)
    for eviction in dict.fromkeys(parse_policy(p)[0] for p in policies):
        if f"{eviction}+oracle" not in out:
            out.append(f"{eviction}+oracle")
    return out


def policy_table(requests: Sequence[Sequence[int]], capacity: int, policies: list[str]) -> tuple[str, dict]:
    """The markdown table and ``{policy: (hit rate, Belady, ratio)}``."""
    belady = belady_hit_rate(requests, capacity)
    rows, values = [], {}
    for policy in policies:
        rate = replay_hit_rate(requests, capacity, policy)
        ratio = rate / belady if belady else 0.0
        values[policy] = (rate, belady, ratio)
        rows.append([policy, f"{rate:.3f}", f"{belady:.3f}", f"{ratio:.2f}"])
    return md_table(COLUMNS, rows), values


def main_policies(args, argv: Sequence[str]) -> int:
    """``tools/replay.py --policies``: print the table for ``args.trace``."""
    started = time.perf_counter()
    command = "python tools/replay.py " + " ".join(argv)
    try:
        if args.trace is None:
            raise ValueError("--policies needs --trace FILE (a Mooncake FAST'25 trace, JSON lines)")
        policies = with_oracle_rows([p for p in args.policies.split(",") if p.strip()])
        capacity = parse_tokens(args.cpu_tokens) // TOKENS_PER_BLOCK
        if capacity < 1:
            raise ValueError(f"--cpu-tokens: {args.cpu_tokens!r} holds no {TOKENS_PER_BLOCK}-token block")
        requests = [r.blocks for r in read_mooncake_trace(Path(args.trace))]
    except (ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    table, _ = policy_table(requests, capacity, policies)
    blocks = sum(map(len, requests))
    distinct = len({h for r in requests for h in r})
    print(
        f"command: `{command}`\n\ntrace: {args.trace}: {len(requests)} requests, {blocks} full blocks, "
        f"{distinct} distinct; CPU tier: {capacity} blocks of {TOKENS_PER_BLOCK} tokens; no device cache; "
        f"requests in file order\n\n{table}\n\nwall time: {time.perf_counter() - started:.1f} s"
    )
    return 0
