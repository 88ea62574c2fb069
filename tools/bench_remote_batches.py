#!/usr/bin/env python
"""A request's blocks on a Mooncake Store, many to a request: probes and reads of the shared tier.

Probes (``--only probes``). The scheduler asks the shared tier whether it holds a
request's chunks before it reports them (vLLM asks again next step while the answer is
out), so a probe's time is time to first token for a request whose prefix only the fleet
holds. Per request size (blocks times ``--tp`` ranks, half of the blocks present), the
median over ``--rounds`` of:

- ``tier``: ``RemoteStore.exists``, as the scheduler calls it: up to ``PROBE_BATCH`` keys
  per request (``batch_is_exist``);
- ``tier, a key per request``: the same store with a client that answers one key per
  request (as S3's HEAD does), its requests spread over the store's threads;
- ``raw batch``: one ``batch_is_exist`` of every key on the tier's own
  ``MooncakeDistributedStore``, the floor;
- ``raw loop``: ``is_exist`` key after key on it.

S3 has no batched existence check, so an S3 tier's probes are the ``a key per request``
row over HEADs.

Reads (``--only reads``). A load of a request's blocks out of the shared tier: per block
size, ``RemoteStore.get_blocks`` of ``--read-mib`` MiB of sealed blocks (verified and
decrypted into the caller's buffers), GB/s as the median over ``--rounds`` of:

- ``tier``: up to ``GET_BATCH`` objects and ``GET_BATCH_BYTES`` a request
  (``batch_get_into``);
- ``tier, an object per request``: the same store reading one object a request
  (``get_into``), its requests spread over the store's threads (as S3's GETs are);

the two interleaved, their order alternating by round.

    python tools/bench_remote_batches.py                   # a throwaway Mooncake Store
    python tools/bench_remote_batches.py --blocks 16,256,2048 --tp 4 --rounds 30
    python tools/bench_remote_batches.py --only reads --sizes 0.25,2,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiered_kv.fingerprint import Fingerprint  # noqa: E402
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore  # noqa: E402
from tiered_kv.remote.format.object_format import block_key  # noqa: E402
from tiered_kv.remote.store.mooncake_client import MooncakeClient  # noqa: E402
from tiered_kv.testing.mooncake_server import MooncakeServer, missing_reason  # noqa: E402


class KeyPerRequest(MooncakeClient):
    """A Mooncake client without ``exists_many`` and ``get_many``: the store sends one
    request per key."""

    exists_many = None  # type: ignore[assignment]
    get_many = None  # type: ignore[assignment]


def median_ms(call: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def fingerprint(tp: int, seed: str = "") -> Fingerprint:
    return Fingerprint(
        "org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), tp, "sha256", seed
    )


def probes(config: RemoteConfig, sizes: list[int], tp: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    hashes = [rng.bytes(32) for _ in range(max(sizes))]
    fp = fingerprint(tp)
    with RemoteStore(config, fp) as tier, RemoteStore(config, fp, client=KeyPerRequest(config)) as per_key:
        present = [(h, r, rng.bytes(1024)) for h in hashes[::2] for r in range(tp)]
        assert all(o == PutOutcome.STORED for o in tier.put_blocks(present).result(120))
        raw = tier._client.inner._store()
        print(f"existence probes on a Mooncake Store (loopback, TCP), {tp} rank(s) a block, half present;")
        print(f"median ms of {rounds} rounds")
        print(f"{'blocks':>7} {'keys':>6} {'tier':>8} {'a key per request':>18} {'raw batch':>10} {'raw loop':>9}")
        for n in sizes:
            keys = [block_key(tier.namespace, h, r) for h in hashes[:n] for r in range(tp)]
            want = [i % 2 == 0 for i in range(n)]
            assert tier.exists(hashes[:n]).result(60) == want == per_key.exists(hashes[:n]).result(60)
            row = [
                median_ms(lambda: tier.exists(hashes[:n]).result(60), rounds),
                median_ms(lambda: per_key.exists(hashes[:n]).result(60), rounds),
                median_ms(lambda: raw.batch_is_exist(keys), rounds),
                median_ms(lambda: [raw.is_exist(k) for k in keys], rounds),
            ]
            print(f"{n:>7} {len(keys):>6} {row[0]:>8.2f} {row[1]:>18.2f} {row[2]:>10.2f} {row[3]:>9.2f}")


def reads(config: RemoteConfig, sizes_mib: list[float], total_mib: float, rounds: int) -> None:
    os.environ["TIERED_KV_BENCH_KEY"] = os.urandom(32).hex()  # a fleet key for this run only
    config = RemoteConfig.from_dict({**config.to_dict(), "trusted_bucket": False, "key_env": "TIERED_KV_BENCH_KEY"})
    rng = np.random.default_rng(1)
    print(
        f"\nreads of {total_mib:g} MiB of sealed blocks on a Mooncake Store (loopback, TCP), "
        f"{config.max_connections} connections; GB/s, median of {rounds} rounds"
    )
    print(f"{'block':>9} {'blocks':>7} {'tier':>7} {'an object per request':>22} {'ratio':>6}")
    for mib in sizes_mib:
        size = int(mib * (1 << 20))
        n = max(1, int(total_mib * (1 << 20)) // size)
        fp = fingerprint(1, f"reads-{size}")
        with RemoteStore(config, fp) as tier, RemoteStore(config, fp, client=KeyPerRequest(config)) as per_object:
            items = [(rng.bytes(32), 0, rng.bytes(size)) for _ in range(n)]
            assert all(o == PutOutcome.STORED for o in tier.put_blocks(items).result(300))
            dests = [np.zeros(size, np.uint8) for _ in range(n)]
            gbps: dict[str, list[float]] = {"tier": [], "per object": []}
            for r in range(rounds):
                order = [("tier", tier), ("per object", per_object)]
                for name, store in order if r % 2 else order[::-1]:
                    start = time.perf_counter()
                    hits = store.get_blocks([(h, 0, d) for (h, _, _), d in zip(items, dests)]).result(300)
                    gbps[name].append(n * size / (time.perf_counter() - start) / 1e9)
                    if not all(hits) or bytes(dests[-1]) != items[-1][2]:
                        raise RuntimeError(f"{name}: {sum(hits)} of {n} blocks read back")
            a, b = statistics.median(gbps["tier"]), statistics.median(gbps["per object"])
            print(f"{mib:>6g} MiB {n:>7} {a:>7.3f} {b:>22.3f} {a / b:>6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["probes", "reads"], help="one of the two tables")
    p.add_argument("--blocks", default="16,256,2048", help="probes: blocks per request, comma-separated")
    p.add_argument("--tp", type=int, default=1, help="probes: ranks per block (an object each)")
    p.add_argument("--sizes", default="0.25,2,8", help="reads: block sizes in MiB, comma-separated")
    p.add_argument("--read-mib", type=float, default=128, help="reads: MiB read per path and round")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    if (why := missing_reason()) is not None:
        sys.exit(why)
    with tempfile.TemporaryDirectory() as d, MooncakeServer(Path(d)).start() as server:
        config = RemoteConfig.from_dict({**server.settings(), "request_timeout": "30s"})
        if args.only != "reads":
            probes(config, [int(b) for b in args.blocks.split(",")], args.tp, args.rounds)
        if args.only != "probes":
            reads(config, [float(s) for s in args.sizes.split(",")], args.read_mib, args.rounds)


if __name__ == "__main__":
    main()
