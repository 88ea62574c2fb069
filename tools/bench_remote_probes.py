#!/usr/bin/env python
"""Existence probes of a request's blocks on a Mooncake Store: the shared tier against the raw client.

The scheduler asks the shared tier whether it holds a request's chunks before it reports
them (vLLM asks again next step while the answer is out), so a probe's time is time to
first token for a request whose prefix only the fleet holds. Per request size (blocks
times ``--tp`` ranks, half of the blocks present), the median over ``--rounds`` of:

- ``tier``: ``RemoteStore.exists``, as the scheduler calls it: up to ``PROBE_BATCH`` keys
  per request (``batch_is_exist``);
- ``tier, a key per request``: the same store with a client that answers one key per
  request (as S3's HEAD does), its requests spread over the store's threads;
- ``raw batch``: one ``batch_is_exist`` of every key on the tier's own
  ``MooncakeDistributedStore``, the floor;
- ``raw loop``: ``is_exist`` key after key on it.

S3 has no batched existence check, so an S3 tier's probes are the ``a key per request``
row over HEADs.

    python tools/bench_remote_probes.py                    # a throwaway Mooncake Store
    python tools/bench_remote_probes.py --blocks 16,256,2048 --tp 4 --rounds 30
"""

from __future__ import annotations

import argparse
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
    """A Mooncake client without ``exists_many``: the store sends one probe per key."""

    exists_many = None  # type: ignore[assignment]


def median_ms(call: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="16,256,2048", help="blocks per request, comma-separated")
    p.add_argument("--tp", type=int, default=1, help="ranks per block (an object each)")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    if (why := missing_reason()) is not None:
        sys.exit(why)
    sizes = [int(b) for b in args.blocks.split(",")]
    fp = Fingerprint(
        "org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), args.tp, "sha256", ""
    )
    rng = np.random.default_rng(0)
    hashes = [rng.bytes(32) for _ in range(max(sizes))]
    with tempfile.TemporaryDirectory() as d, MooncakeServer(Path(d)).start() as server:
        config = RemoteConfig.from_dict({**server.settings(), "request_timeout": "30s"})
        with RemoteStore(config, fp) as tier, RemoteStore(config, fp, client=KeyPerRequest(config)) as per_key:
            present = [(h, r, rng.bytes(1024)) for h in hashes[::2] for r in range(args.tp)]
            assert all(o == PutOutcome.STORED for o in tier.put_blocks(present).result(120))
            raw = tier._client.inner._store()
            print(f"existence probes on a Mooncake Store (loopback, TCP), {args.tp} rank(s) a block, half present;")
            print(f"median ms of {args.rounds} rounds")
            print(f"{'blocks':>7} {'keys':>6} {'tier':>8} {'a key per request':>18} {'raw batch':>10} {'raw loop':>9}")
            for n in sizes:
                keys = [block_key(tier.namespace, h, r) for h in hashes[:n] for r in range(args.tp)]
                want = [i % 2 == 0 for i in range(n)]
                assert tier.exists(hashes[:n]).result(60) == want == per_key.exists(hashes[:n]).result(60)
                row = [
                    median_ms(lambda: tier.exists(hashes[:n]).result(60), args.rounds),
                    median_ms(lambda: per_key.exists(hashes[:n]).result(60), args.rounds),
                    median_ms(lambda: raw.batch_is_exist(keys), args.rounds),
                    median_ms(lambda: [raw.is_exist(k) for k in keys], args.rounds),
                ]
                print(f"{n:>7} {len(keys):>6} {row[0]:>8.2f} {row[1]:>18.2f} {row[2]:>10.2f} {row[3]:>9.2f}")


if __name__ == "__main__":
    main()
