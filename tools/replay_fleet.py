#!/usr/bin/env python
"""A fleet of nodes sharing one real shared tier, replaying a Mooncake trace, against the same
fleet with local tiers only, in one run.

Each of ``--nodes`` simulated nodes has its own local cache of ``--local-blocks`` blocks
(LRU over block ids, the CPU tier's policy; ``--disk-blocks`` adds an LRU disk tier
below it). The fleet shares one real shared tier, a ``RemoteStore`` over Ceph RGW
(``--backend s3``, a throwaway server from tools/rgw_server.sh, or ``--endpoint``) or a
Mooncake Store (``--backend mooncake``, a throwaway master and standalone client, or
``--mooncake-master``), bounded to ``--shared-blocks`` blocks (LRU; evicted objects are
deleted, so both backends hold the same set). Requests of a trace
(``../shared/traces/mooncake_fast25_*.jsonl``: ``hash_ids`` are prefix-chained ids of
512-token blocks) are served in file order, routed to nodes round-robin or by prefix
affinity (the node of the id of the request's first ``--affinity-blocks`` blocks: every
request of the conversation trace shares its first block), both in one run.

Per request and node: the longest prefix of its full blocks in the local tiers is a local
hit; the following blocks the shared tier holds (by the fleet's index of what it stored)
are read from it through ``get_blocks`` (fingerprint, checksum and bytes verified; a
failed read counts as computed and in ``shared failed``); the rest is computed and
written through to the shared tier; every block of the request enters the node's local
tiers. The local-only fleet runs the same requests on its own copies of the local tiers.

Token hit rate = hit blocks x 512 / input tokens (the trailing partial block is never a
hit). Estimated prefill time = the sum over requests of ``PrefillModel.ttft``
(tools/replay_model.py: prefill of the computed tokens plus loading the hit tokens at
``--load-gbps`` per tier and ``--shared-gbps`` from the shared tier, ASSUMED). Objects
carry ``--block-bytes`` of KV each (scaled down: the hit rates do not depend on it).

    python tools/replay_fleet.py --backend mooncake --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl
    python tools/replay_fleet.py --backend s3 --trace ... --limit 2000

``--timed`` replays the trace in time instead (tools/replay_fleet_time.py, whose options
it then takes): requests at the trace's arrival times queue on prefill nodes picked by a
router, fleets of equal total capacity with and without a shared pool compared by hit
rate, TTFT and goodput; no server.

    python tools/replay_fleet.py --timed --trace ../shared/traces/mooncake_fast25_synthetic_trace.jsonl --slo 2s

I/O: the trace file (read only), the shared tier's server, and the daemons' scratch logs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet_trace import LRU, PAPER, TOKENS_PER_BLOCK, Request, read_mooncake_trace  # noqa: E402
from replay_model import DEFAULT_LOAD_GBPS, PrefillModel  # noqa: E402

from tiered_kv.fingerprint import Fingerprint  # noqa: E402
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore  # noqa: E402

RGW_SCRIPT = Path(__file__).resolve().parent / "rgw_server.sh"
RGW_KEYS = {"AWS_ACCESS_KEY_ID": "tieredkvtest", "AWS_SECRET_ACCESS_KEY": "tieredkvtestsecret"}
ROUTINGS = ("round-robin", "prefix-affinity")


class LocalTiers:
    """A node's CPU tier (LRU) and optional disk tier below it (LRU of CPU's evictions)."""

    def __init__(self, cpu_blocks: int, disk_blocks: int):
        self.cpu, self.disk = LRU(cpu_blocks), LRU(disk_blocks)

    def prefix(self, blocks: tuple[int, ...]) -> tuple[int, int]:
        """Blocks of the longest local prefix: (from CPU, from disk)."""
        cpu = disk = 0
        for b in blocks:
            if b in self.cpu:
                cpu += 1
            elif b in self.disk:
                disk += 1
            else:
                break
        return cpu, disk

    def admit(self, blocks: tuple[int, ...]) -> None:
        self.disk.touch(self.cpu.touch(blocks))


@dataclass
class Tally:
    requests: int = 0
    tokens: int = 0
    cpu: int = 0  # hit blocks per source
    disk: int = 0
    shared: int = 0
    shared_failed: int = 0
    prefill_s: float = 0.0

    def hit_rate(self) -> float:
        return (self.cpu + self.disk + self.shared) * TOKENS_PER_BLOCK / max(1, self.tokens)


@dataclass
class FleetResult:
    routing: str
    with_shared: list[Tally]
    local_only: list[Tally]
    puts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def payload(block: int, size: int) -> bytes:
    """The KV bytes of block ``block`` (the same on every node that computes it)."""
    seed = block.to_bytes(8, "little", signed=True)
    out = b""
    while len(out) < size:
        out += hashlib.blake2b(seed + len(out).to_bytes(4, "little")).digest()
    return out[:size]


def fingerprint(block_bytes: int) -> Fingerprint:
    return Fingerprint(
        "fleet/replay", "main", "uint8", TOKENS_PER_BLOCK, TOKENS_PER_BLOCK, (("kv", (block_bytes,)),),
        ("blocks_first",), 1, "sha256", "",
    )  # fmt: skip


def node_of(routing: str, i: int, request: Request, nodes: int, depth: int) -> int:
    """Round-robin, or prefix affinity: the node of the request's block id at ``depth``
    (a prefix-chained id names the whole prefix up to it; shorter requests use their last)."""
    if routing == "round-robin" or not request.blocks:
        return i % nodes
    block = request.blocks[min(depth, len(request.blocks)) - 1]
    digest = hashlib.blake2b(block.to_bytes(8, "little", signed=True), digest_size=8).digest()
    return int.from_bytes(digest, "little") % nodes


def replay(
    requests: list[Request], routing: str, store: RemoteStore | None, args, model: PrefillModel, log=print
) -> FleetResult:
    n = args.nodes
    shared_nodes = [LocalTiers(args.local_blocks, args.disk_blocks) for _ in range(n)]
    local_nodes = [LocalTiers(args.local_blocks, args.disk_blocks) for _ in range(n)]
    with_shared, local_only = [Tally() for _ in range(n)], [Tally() for _ in range(n)]
    index = LRU(args.shared_blocks)  # what the shared tier holds
    deleter = Deleter(store, args.connections) if store is not None else None
    puts = {o.value: 0 for o in PutOutcome}
    size = args.block_bytes
    started = time.perf_counter()
    for i, req in enumerate(requests):
        k = node_of(routing, i, req, n, args.affinity_blocks)
        # Local tiers only.
        cpu, disk = local_nodes[k].prefix(req.blocks)
        t = local_only[k]
        t.requests, t.tokens, t.cpu, t.disk = t.requests + 1, t.tokens + req.input_tokens, t.cpu + cpu, t.disk + disk
        t.prefill_s += model.ttft(
            req.input_tokens - (cpu + disk) * TOKENS_PER_BLOCK,
            {"CPU": cpu * TOKENS_PER_BLOCK, "DISK": disk * TOKENS_PER_BLOCK},
        )
        local_nodes[k].admit(req.blocks)
        # Local tiers, then the shared tier.
        cpu, disk = shared_nodes[k].prefix(req.blocks)
        rest = req.blocks[cpu + disk :]
        run = 0
        while run < len(rest) and rest[run] in index:
            run += 1
        got = run if store is None else 0  # no server: the index stands in for it
        if run and store is not None:
            bufs = [bytearray(size) for _ in range(run)]
            hits = store.get_blocks([(_key(b), 0, buf) for b, buf in zip(rest[:run], bufs)]).result()
            while got < run and hits[got] and bufs[got] == payload(rest[got], size):
                got += 1
        t = with_shared[k]
        t.requests, t.tokens, t.cpu, t.disk = t.requests + 1, t.tokens + req.input_tokens, t.cpu + cpu, t.disk + disk
        t.shared += got
        t.shared_failed += run - got
        t.prefill_s += model.ttft(
            req.input_tokens - (cpu + disk + got) * TOKENS_PER_BLOCK,
            {"CPU": cpu * TOKENS_PER_BLOCK, "DISK": disk * TOKENS_PER_BLOCK, "SHARED": got * TOKENS_PER_BLOCK},
        )
        new = [b for b in rest[got:] if b not in index]
        index.touch(rest[:got])
        if new and store is None:
            puts["stored"] += len(new)
            index.touch(new)
        elif new:
            assert store is not None and deleter is not None  # set together
            outcomes = store.put_blocks([(_key(b), 0, payload(b, size)) for b in new]).result()
            for o in outcomes:
                puts[o.value] += 1
            evicted = index.touch([b for b, o in zip(new, outcomes) if o.durable])
            if evicted:
                deleter.delete(evicted)
        shared_nodes[k].admit(req.blocks)
        if args.progress and (i + 1) % args.progress == 0:
            rate = (i + 1) / (time.perf_counter() - started)
            log(f"  {routing}: {i + 1:,}/{len(requests):,} requests, {rate:,.0f} req/s")
    if deleter is not None:
        deleter.close()
    return FleetResult(routing, with_shared, local_only, puts, time.perf_counter() - started)


def _key(block: int) -> bytes:
    return block.to_bytes(8, "little", signed=True)


class Deleter:
    """Deletes the objects the bounded shared tier evicts, through the store's own client
    (one request each, ``connections`` at once; the store has no delete of its own)."""

    def __init__(self, store: RemoteStore, connections: int):
        from concurrent.futures import ThreadPoolExecutor

        self.store = store
        self.pool = ThreadPoolExecutor(connections)

    def delete(self, blocks: list[int]) -> None:
        from tiered_kv.remote.format.object_format import block_key

        keys = [block_key(self.store.namespace, _key(b), 0) for b in blocks]
        list(self.pool.map(self.store._client.delete, keys))

    def close(self) -> None:
        self.pool.shutdown()


def summarize(result: FleetResult) -> dict:
    def fleet(ts: list[Tally]) -> Tally:
        out = Tally()
        for t in ts:
            for f in ("requests", "tokens", "cpu", "disk", "shared", "shared_failed", "prefill_s"):
                setattr(out, f, getattr(out, f) + getattr(t, f))
        return out

    s, l = fleet(result.with_shared), fleet(result.local_only)
    return {
        "routing": result.routing,
        "hit_shared": s.hit_rate(),
        "hit_local": l.hit_rate(),
        "hit_ratio": s.hit_rate() / l.hit_rate() if l.hit_rate() else float("inf"),
        "prefill_ratio": s.prefill_s / l.prefill_s,
        "shared_share": s.shared * TOKENS_PER_BLOCK / max(1, s.tokens),
        "shared_failed": s.shared_failed,
        "prefill_shared_s": s.prefill_s,
        "prefill_local_s": l.prefill_s,
        "puts": result.puts,
        "seconds": result.seconds,
        "nodes": [
            {
                "requests": a.requests,
                "hit_shared": a.hit_rate(),
                "hit_local": b.hit_rate(),
                "prefill_shared_s": a.prefill_s,
                "prefill_local_s": b.prefill_s,
            }
            for a, b in zip(result.with_shared, result.local_only)
        ],  # fmt: skip
    }


def tables(trace: str, rows: list[dict]) -> str:
    paper = next((v for k, v in PAPER.items() if k in trace), None)
    out = [
        "| routing | hit rate, shared | hit rate, local only | ratio | paper | prefill time ratio | paper |"
        " from shared tier | failed shared reads | requests per node |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['routing']} | {r['hit_shared']:.3f} | {r['hit_local']:.3f} | {r['hit_ratio']:.2f}x "
            f"| {f'{paper[0]:.2f}x' if paper else '-'} | {r['prefill_ratio']:.2f}x | {f'{paper[1]:.2f}x' if paper else '-'} "
            f"| {r['shared_share']:.3f} | {r['shared_failed']} "
            f"| {min(per_node := [nd['requests'] for nd in r['nodes']]):,}-{max(per_node):,} |"
        )
    for r in rows:
        out.append(f"\nper node, {r['routing']}:\n")
        out.append(
            "| node | requests | hit rate, shared | hit rate, local only | prefill s, shared | prefill s, local |"
        )
        out.append("|---|---|---|---|---|---|")
        for k, nd in enumerate(r["nodes"]):
            out.append(
                f"| {k} | {nd['requests']:,} | {nd['hit_shared']:.3f} | {nd['hit_local']:.3f} "
                f"| {nd['prefill_shared_s']:,.0f} | {nd['prefill_local_s']:,.0f} |"
            )
    return "\n".join(out)


@contextmanager
def shared_tier(args) -> Iterator[dict | None]:
    """The shared tier's settings: a running server's, or a throwaway one's (None: no server)."""
    if args.backend == "none":
        yield None
        return
    if args.backend == "mooncake":
        moon = {"backend": "mooncake"}
        if args.mooncake_master:
            yield {**moon, "mooncake_master": args.mooncake_master, "mooncake_metadata_server": args.metadata_server}
            return
        from tiered_kv.testing.mooncake_server import MooncakeServer, missing_reason

        if (reason := missing_reason()) is not None:
            sys.exit(f"replay_fleet: {reason}")
        with tempfile.TemporaryDirectory(prefix="fleet-mooncake-") as scratch:
            with MooncakeServer(Path(scratch), segment="1 GB").start() as server:
                yield {**server.settings(), **moon}
        return
    if args.endpoint:
        yield {"endpoint": args.endpoint, "bucket": args.bucket}
        return
    os.environ.update(RGW_KEYS)
    os.environ.pop("AWS_PROFILE", None)
    with tempfile.TemporaryDirectory(prefix="fleet-rgw-") as scratch:
        env = {**os.environ, "RGW_OWNER_PID": str(os.getpid())}
        done = subprocess.run(["bash", str(RGW_SCRIPT), "start", scratch], capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"replay_fleet: could not start Ceph RGW: {done.stderr.strip()[-1500:]}")
        try:
            endpoint = done.stdout.strip().splitlines()[-1].removeprefix("endpoint=")
            import botocore.session

            botocore.session.get_session().create_client(
                "s3", endpoint_url=endpoint, region_name="us-east-1"
            ).create_bucket(Bucket=args.bucket)
            yield {"endpoint": endpoint, "bucket": args.bucket}
        finally:
            subprocess.run(["bash", str(RGW_SCRIPT), "stop", scratch], capture_output=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, type=Path, help="a Mooncake trace (jsonl with input_length, hash_ids)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--local-blocks", type=int, default=5859, help="each node's CPU tier (5,859 x 512 = 3M tokens)")
    p.add_argument("--disk-blocks", type=int, default=0, help="each node's disk tier below CPU (0: none)")
    p.add_argument("--shared-blocks", type=int, help="the shared tier's bound (default: nodes x local blocks)")
    p.add_argument("--block-bytes", type=int, default=256, help="KV bytes per block object (scaled down)")
    p.add_argument("--routing", default=",".join(ROUTINGS), help=f"comma-separated: {', '.join(ROUTINGS)}")
    p.add_argument(
        "--affinity-blocks",
        type=int,
        default=2,
        help="prefix affinity routes by the id of the request's first N blocks (1: the first block, which every "
        "request of the conversation trace shares)",
    )
    p.add_argument(
        "--backend",
        choices=("s3", "mooncake", "none"),
        default="mooncake",
        help="the shared tier's server; none: its index alone (every read it predicts served, no I/O)",
    )
    p.add_argument("--endpoint", help="s3: a running endpoint (credentials from the AWS chain); default: start RGW")
    p.add_argument("--bucket", default="tiered-kv-fleet")
    p.add_argument("--mooncake-master", help="mooncake: a running master's host:port (default: start one)")
    p.add_argument("--metadata-server", help="mooncake: its metadata server URL")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--shared-gbps", type=float, default=12.5, help="ASSUMED shared tier -> GPU load GB/s")
    p.add_argument("--progress", type=int, default=2000, help="log every N requests (0: never)")
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument("--timed", action="store_true", help="replay in time instead (tools/replay_fleet_time.py --help)")
    args = p.parse_args(argv)
    args.shared_blocks = args.shared_blocks if args.shared_blocks is not None else args.nodes * args.local_blocks
    args.routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    bad = [r for r in args.routings if r not in ROUTINGS]
    if bad or not args.routings:
        p.error(f"--routing: expected some of {', '.join(ROUTINGS)}, got {args.routing!r}")
    if min(args.nodes, args.local_blocks, args.block_bytes, args.affinity_blocks) < 1:
        p.error("--nodes, --local-blocks, --block-bytes and --affinity-blocks must be >= 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--timed" in argv:
        import replay_fleet_time

        return replay_fleet_time.main([a for a in argv if a != "--timed"], prog="replay_fleet.py --timed")
    args = parse_args(argv)
    requests = read_mooncake_trace(args.trace, args.limit)
    model = PrefillModel(load_gbps={**DEFAULT_LOAD_GBPS, "SHARED": args.shared_gbps})
    print(
        f"# {args.trace.name}: {len(requests):,} requests, {sum(r.input_tokens for r in requests):,} input tokens; "
        f"{args.nodes} nodes x {args.local_blocks:,} local blocks (+{args.disk_blocks:,} disk), shared tier "
        f"{args.backend} bounded to {args.shared_blocks:,} blocks of {args.block_bytes} B",
        flush=True,
    )
    print(f"# prefill-cost model: {model.describe()}, shared tier {args.shared_gbps:g} GB/s (ASSUMED)", flush=True)
    rows = []
    if args.backend == "none":
        for routing in args.routings:
            rows.append(summarize(replay(requests, routing, None, args, model)))
            rows[-1]["store"] = None
            print(f"# {routing}: {rows[-1]['seconds']:.0f} s, no server (index only)", flush=True)
    with shared_tier(args) as settings:
        for routing in args.routings if settings is not None else ():
            assert settings is not None
            config = RemoteConfig.from_dict(
                {
                    **settings,
                    "prefix": f"fleet-{uuid.uuid4().hex[:8]}",
                    "max_connections": args.connections,
                    "request_timeout": "30s",
                    # Hit rates do not depend on sealing: objects carry header and checksum only.
                    "trusted_bucket": True,
                }
            )
            with RemoteStore(config, fingerprint(args.block_bytes)) as store:
                result = replay(requests, routing, store, args, model)
                stats = store.stats()
            row = summarize(result)
            row["store"] = {"gets_hit": stats.gets_hit, "rejected": stats.gets_rejected, "failed": stats.gets_failed}
            rows.append(row)
            print(f"# {routing}: {result.seconds:.0f} s, store {row['store']}, puts {row['puts']}", flush=True)
    print()
    print(tables(args.trace.name, rows))
    if args.json:
        args.json.write_text(json.dumps({"trace": args.trace.name, "args": vars(args) | {"trace": str(args.trace)},
                                         "rows": rows}, default=str, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
