#!/usr/bin/env python
"""The shared tier's store path against the raw S3 clients, in one run, interleaved.

Per block size (0.5, 2 and 8 MiB by default) and round, each path puts the same
payloads under keys of its own, then gets them back into preallocated buffers, with the
same number of requests in flight (``--connections``):

- ``obstore``: raw ``obstore.put(mode="create")`` / ``obstore.get().bytes()`` copied
  into the buffer, on a thread pool;
- ``boto3``: raw ``put_object(IfNoneMatch="*")`` / ``get_object`` read into the buffer
  (``readinto``), on a thread pool, when boto3 is importable;
- ``tier``: ``RemoteStore.put_blocks`` / ``get_blocks`` (header, checksum, verification,
  write-once), over obstore.

The order of the paths rotates every round, since a shared machine drifts; each
path's objects are deleted after its gets so the server's memory stays bounded. Prints
GB/s per path (median over rounds) and the tier over raw obstore.

    python tools/bench_remote.py                         # starts a throwaway Ceph RGW itself
    python tools/bench_remote.py --endpoint http://127.0.0.1:7480 --bucket kv-bench
                                 # a running server; credentials from the AWS chain

Starting its own server needs the Ceph packages (``make rgw``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tiered_kv.disk.fingerprint import Fingerprint
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore

SCRIPT = Path(__file__).resolve().parent / "rgw_server.sh"
KEYS = {"AWS_ACCESS_KEY_ID": "tieredkvtest", "AWS_SECRET_ACCESS_KEY": "tieredkvtestsecret"}


@contextlib.contextmanager
def own_server(memstore_bytes: int):
    """A throwaway Ceph RGW (tools/rgw_server.sh) for the run; yields its endpoint."""
    with tempfile.TemporaryDirectory(prefix="bench-rgw-") as scratch:
        env = {**os.environ, "RGW_MEMSTORE_BYTES": str(memstore_bytes), "RGW_OWNER_PID": str(os.getpid())}
        started = time.perf_counter()
        done = subprocess.run(["bash", str(SCRIPT), "start", scratch], capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"bench_remote: could not start Ceph RGW: {done.stderr.strip()[-1500:]}")
        print(f"# Ceph RGW started in {time.perf_counter() - started:.1f} s", flush=True)
        try:
            yield done.stdout.strip().splitlines()[-1].removeprefix("endpoint=")
        finally:
            subprocess.run(["bash", str(SCRIPT), "stop", scratch], capture_output=True)


def fingerprint(block_bytes: int) -> Fingerprint:
    return Fingerprint(
        "bench/model", "main", "uint8", 16, 16, (("kv", (block_bytes,)),), ("blocks_first",), 1, "sha256", ""
    )


class Paths:
    """The measured paths for one block size; each ``put``/``get`` moves every block once."""

    def __init__(self, config: RemoteConfig, block_bytes: int, connections: int):
        import obstore

        self.obstore = obstore
        self.config = config
        self.pool = ThreadPoolExecutor(connections)
        self.store = RemoteStore(config, fingerprint(block_bytes))
        self.raw = self.store._client.raw  # the same obstore S3Store settings as the tier's
        self.boto = None
        with contextlib.suppress(ImportError):
            import boto3
            from botocore.config import Config

            self.boto = boto3.client(
                "s3",
                endpoint_url=config.endpoint,
                region_name=config.region,
                config=Config(max_pool_connections=connections, retries={"max_attempts": 1 + config.retries}),
            )

    def names(self, wanted: list[str]) -> list[str]:
        return [n for n in wanted if n != "boto3" or self.boto is not None]

    def run(self, name: str, payloads: list[np.ndarray], buffers: list[np.ndarray]) -> tuple[float, float]:
        """Seconds to put all payloads, and to get them all back (verified)."""
        tag = uuid.uuid4().hex[:8]
        if name == "tier":
            items = [(f"{tag}-{i}".encode(), 0, p) for i, p in enumerate(payloads)]
            t0 = time.perf_counter()
            outcomes = self.store.put_blocks(items).result()
            t1 = time.perf_counter()
            hits = self.store.get_blocks([(h, 0, b) for (h, _, _), b in zip(items, buffers)]).result()
            t2 = time.perf_counter()
            if outcomes != [PutOutcome.STORED] * len(items) or not all(hits):
                raise RuntimeError(f"tier: {outcomes.count(PutOutcome.STORED)} stored, {sum(hits)} read back")
            from tiered_kv.remote.object_format import block_key

            keys = [block_key(self.store.namespace, h, 0) for h, _, _ in items]
        else:
            keys = [f"{self.config.prefix}/raw/{tag}/{i}" for i in range(len(payloads))]
            put, get = (self._obstore_put, self._obstore_get) if name == "obstore" else (self._boto_put, self._boto_get)
            t0 = time.perf_counter()
            list(self.pool.map(put, keys, payloads))
            t1 = time.perf_counter()
            list(self.pool.map(get, keys, buffers))
            t2 = time.perf_counter()
        if not np.array_equal(buffers[-1], payloads[-1]):
            raise RuntimeError(f"{name}: the bytes read back differ")
        for b in buffers:
            b.fill(0)
        list(self.pool.map(lambda k: self.obstore.delete(self.raw, k), keys))
        return t1 - t0, t2 - t1

    def _obstore_put(self, key: str, payload: np.ndarray) -> None:
        self.obstore.put(self.raw, key, payload, mode="create", use_multipart=False)

    def _obstore_get(self, key: str, buf: np.ndarray) -> None:
        memoryview(buf)[:] = memoryview(self.obstore.get(self.raw, key).bytes())

    def _boto_put(self, key: str, payload: np.ndarray) -> None:
        self.boto.put_object(Bucket=self.config.bucket, Key=key, Body=payload.tobytes(), IfNoneMatch="*")

    def _boto_get(self, key: str, buf: np.ndarray) -> None:
        body = self.boto.get_object(Bucket=self.config.bucket, Key=key)["Body"]
        view, n = memoryview(buf), 0
        while n < len(view) and (got := body._raw_stream.readinto(view[n:])):
            n += got
        body.close()
        if n != len(view):
            raise RuntimeError(f"boto3: {key} gave {n} bytes, expected {len(view)}")

    def close(self) -> None:
        self.store.close()
        self.pool.shutdown()

    def __enter__(self) -> Paths:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bench(
    config: RemoteConfig,
    sizes_mib: list[float],
    total_bytes: int,
    rounds: int,
    connections: int,
    paths_wanted: list[str],
    log: Callable[[str], None],
) -> dict[float, dict[str, tuple[list[float], list[float]]]]:
    results: dict[float, dict[str, tuple[list[float], list[float]]]] = {}
    rng = np.random.default_rng(0)
    for mib in sizes_mib:
        size = int(mib * (1 << 20))
        n = max(connections, total_bytes // size)
        payloads = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
        buffers = [np.zeros(size, np.uint8) for _ in range(n)]
        with Paths(config, size, connections) as paths:
            names = paths.names(paths_wanted)
            per = {name: ([], []) for name in names}
            paths.run("obstore", payloads[:connections], buffers[:connections])  # warm connections
            for r in range(rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    tp, tg = paths.run(name, payloads, buffers)
                    per[name][0].append(size * n / tp / 1e9)
                    per[name][1].append(size * n / tg / 1e9)
                    log(
                        f"  {mib:g} MiB x {n}, round {r + 1}, {name:8s} put {per[name][0][-1]:.3f} "
                        f"get {per[name][1][-1]:.3f} GB/s"
                    )
        results[mib] = per
    return results


def table(results: dict[float, dict[str, tuple[list[float], list[float]]]]) -> str:
    """Medians over rounds; the ratios are medians of each round's ratio to raw obstore
    (the two ran minutes apart at most, so a drifting machine moves both)."""
    lines = ["| block | path | put GB/s | get GB/s | put / obstore | get / obstore |", "|---|---|---|---|---|---|"]
    for mib, per in results.items():
        base_puts, base_gets = per["obstore"]
        for name, (puts, gets) in per.items():
            rp = statistics.median(p / b for p, b in zip(puts, base_puts))
            rg = statistics.median(g / b for g, b in zip(gets, base_gets))
            lines.append(
                f"| {mib:g} MiB | {name} | {statistics.median(puts):.3f} | {statistics.median(gets):.3f} "
                f"| {rp:.2f} | {rg:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", help="a running S3 endpoint (default: start a throwaway Ceph RGW)")
    p.add_argument("--bucket", default="tiered-kv-bench", help="bucket (created when the server is our own)")
    p.add_argument("--sizes", default="0.5,2,8", help="block sizes in MiB, comma-separated")
    p.add_argument("--total", default="128MiB", help="bytes moved per path, size and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=8, help="requests in flight, every path alike")
    p.add_argument("--paths", default="obstore,tier,boto3", help="paths to measure (obstore is always one)")
    args = p.parse_args()
    wanted = ["obstore"] + [n for n in args.paths.split(",") if n in ("tier", "boto3")]
    from tiered_kv.config import parse_size

    sizes = [float(s) for s in args.sizes.split(",")]
    total = parse_size(args.total, "--total")

    def run(endpoint: str) -> None:
        config = RemoteConfig.from_dict(
            {
                "endpoint": endpoint,
                "bucket": args.bucket,
                "prefix": "bench",
                "max_connections": args.connections,
                "request_timeout": "60s",
                "max_pending_upload_bytes": "64GiB",
            }
        )
        print(
            f"# {config.where()}, {args.connections} connections, {args.rounds} rounds, "
            f"{args.total} per path and round",
            flush=True,
        )
        results = bench(config, sizes, total, args.rounds, args.connections, wanted, lambda s: print(s, flush=True))
        print()
        print(table(results))

    if args.endpoint:
        run(args.endpoint)
        return
    os.environ.update(KEYS)  # the throwaway server's user, whatever else the environment holds
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    with own_server(max(2 << 30, 4 * total)) as endpoint:
        import botocore.session

        botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1"
        ).create_bucket(Bucket=args.bucket)
        run(endpoint)


if __name__ == "__main__":
    main()
