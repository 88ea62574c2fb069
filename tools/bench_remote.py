#!/usr/bin/env python
"""The shared tier against the raw S3 (or Mooncake) clients, and two nodes sharing one bucket.

Throughput (``--only throughput``). Per block size (0.5, 2 and 8 MiB by default) and round, each path puts the same
payloads under keys of its own, then gets them back into preallocated buffers, with the
same number of requests in flight (``--connections``):

- ``obstore``: raw ``obstore.put(mode="create")`` / ``obstore.get().bytes()`` copied
  into the buffer, on a thread pool;
- ``boto3``: raw ``put_object(IfNoneMatch="*")`` / ``get_object`` read into the buffer
  (``readinto``), on a thread pool, when boto3 is importable;
- ``tier``: ``RemoteStore.put_blocks`` / ``get_blocks`` (objects sealed with AES-256-GCM
  under the fleet key on the store's threads, verification, write-once), over obstore;
- ``tier-plain``: the same under ``trusted_bucket`` with no key (header and checksum only).

Before the table, one core's AES-256-GCM speed (seal and open of one block) gives the
cost of encryption in CPU seconds per GB.

With ``--backend mooncake`` (a Mooncake Store, ``remote.backend: mooncake``) the paths
are ``mooncake`` (raw ``put_from`` / ``get_into`` on the tier's own
``MooncakeDistributedStore``, from and into the same buffers), ``mooncake-batch`` (raw
``put_from``, then ``batch_get_into`` in the batches the tier reads: at most
``GET_BATCH`` objects and ``GET_BATCH_BYTES``), ``mooncake-copy`` (raw ``put`` /
``get``), ``tier`` (zero-copy transfers, the default) and ``tier-copy``
(``mooncake_zero_copy: false``); ratios are over raw ``mooncake``.

The order of the paths rotates every round, since a shared machine drifts; each
path's objects are deleted after its gets so the server's memory stays bounded. Prints
GB/s per path (median over rounds) and the tier over raw obstore.

Two-node replay (``--only replay``). Two nodes, each with its own device cache, CPU
and disk tiers and cache directory, built as an engine builds them (the config's
``remote`` settings under ``HierarchySpec`` and the engine driver), share the
bucket under a fresh prefix. One shared-prefix (RAG) workload is split in two: node A
runs the first half, its uploads land, then node B runs the second half, which asks
for the same documents with other questions. Prints each node's token hit rate per
tier (device prefix cache, CPU, disk, shared) and what was computed; every loaded
block is compared with what was computed for it (mismatches must be 0).

    python tools/bench_remote.py --start-rgw             # a throwaway Ceph RGW (make rgw)
    python tools/bench_remote.py --endpoint http://127.0.0.1:7480 --bucket kv-bench
    python tools/bench_remote.py --config kv.json         # the config's remote key
    python tools/bench_remote.py --backend mooncake       # a throwaway Mooncake Store
    python tools/bench_remote.py --backend mooncake --mooncake-master 127.0.0.1:50051 \
        --metadata-server http://127.0.0.1:8080/metadata  # a running one
                                 # a running server; credentials from the AWS chain

Objects go under the prefixes ``bench`` and ``bench-replay-<random>``, and are deleted
as the run goes and at its end. With ``--endpoint`` or ``--config``, credentials come
from the AWS chain; the bucket must exist. The fleet key is the config's (``--config``),
else a random one for the run.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore
from tiered_kv.remote.store.futures import split_batches
from tiered_kv.remote.store.store import GET_BATCH, GET_BATCH_BYTES

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
        self.config = config
        self.pool = ThreadPoolExecutor(connections)
        self.store = RemoteStore(config, fingerprint(block_bytes))
        plain = RemoteConfig.from_dict({**config.to_dict(), "key_file": None, "key_env": None, "trusted_bucket": True})
        self.plain = RemoteStore(plain, fingerprint(block_bytes), keyring=None)
        self.raw = self.store._client.raw  # the same client settings as the tier's
        self.boto: Any = None  # a boto3 S3 client (boto3 has no type information)
        self.mooncake = config.backend == "mooncake"
        if self.mooncake:
            copy = RemoteConfig.from_dict({**config.to_dict(), "mooncake_zero_copy": False})
            self.store_copy = RemoteStore(copy, fingerprint(block_bytes))
            return
        import obstore

        self.obstore = obstore
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
        if self.mooncake:
            return ["mooncake", "mooncake-batch", "tier", "tier-copy", "mooncake-copy"]
        return [n for n in wanted if n != "boto3" or self.boto is not None]

    def run(self, name: str, payloads: list[np.ndarray], buffers: list[np.ndarray]) -> tuple[float, float]:
        """Seconds to put all payloads, and to get them all back (verified)."""
        tag = uuid.uuid4().hex[:8]
        if name in ("tier", "tier-plain", "tier-copy"):
            store = {"tier": self.store, "tier-plain": self.plain}.get(name) or self.store_copy
            items = [(f"{tag}-{i}".encode(), 0, p) for i, p in enumerate(payloads)]
            t0 = time.perf_counter()
            outcomes = store.put_blocks(items).result()
            t1 = time.perf_counter()
            hits = store.get_blocks([(h, 0, b) for (h, _, _), b in zip(items, buffers)]).result()
            t2 = time.perf_counter()
            if outcomes != [PutOutcome.STORED] * len(items) or not all(hits):
                raise RuntimeError(f"tier: {outcomes.count(PutOutcome.STORED)} stored, {sum(hits)} read back")
            from tiered_kv.remote.format.object_format import block_key

            keys = [block_key(store.namespace, h, 0) for h, _, _ in items]
        else:
            keys = [f"{self.config.prefix}/raw/{tag}/{i}" for i in range(len(payloads))]
            put, get = {
                "obstore": (self._obstore_put, self._obstore_get),
                "boto3": (self._boto_put, self._boto_get),
                "mooncake": (self._mooncake_put, self._mooncake_get),
                "mooncake-batch": (self._mooncake_put, self._mooncake_get),
                "mooncake-copy": (self._mooncake_copy_put, self._mooncake_copy_get),
            }[name]
            t0 = time.perf_counter()
            list(self.pool.map(put, keys, payloads))
            t1 = time.perf_counter()
            if get is self._mooncake_get and name == "mooncake-batch":
                sizes = [b.nbytes for b in buffers]
                batches = split_batches(list(zip(keys, buffers)), sizes, GET_BATCH, GET_BATCH_BYTES)
                list(self.pool.map(self._mooncake_batch_get, batches))
            else:
                list(self.pool.map(get, keys, buffers))
            t2 = time.perf_counter()
        if not np.array_equal(buffers[-1], payloads[-1]):
            raise RuntimeError(f"{name}: the bytes read back differ")
        for b in buffers:
            b.fill(0)
        if self.mooncake:
            list(self.pool.map(lambda k: self.raw.remove(k, True), keys))
        else:
            list(self.pool.map(lambda k: self.obstore.delete(self.raw, k), keys))
        return t1 - t0, t2 - t1

    def _mooncake_put(self, key: str, payload: np.ndarray) -> None:
        if (rc := self.raw.put_from(key, payload.ctypes.data, payload.nbytes)) != 0:
            raise RuntimeError(f"mooncake put_from {key}: {rc}")

    def _mooncake_get(self, key: str, buf: np.ndarray) -> None:
        if (rc := self.raw.get_into(key, buf.ctypes.data, buf.nbytes)) != buf.nbytes:
            raise RuntimeError(f"mooncake get_into {key}: {rc}")

    def _mooncake_batch_get(self, batch: list[tuple[str, np.ndarray]]) -> None:
        keys, bufs = [k for k, _ in batch], [b for _, b in batch]
        rcs = self.raw.batch_get_into(keys, [b.ctypes.data for b in bufs], [b.nbytes for b in bufs])
        if rcs != [b.nbytes for b in bufs]:
            raise RuntimeError(f"mooncake batch_get_into of {len(keys)} keys: {rcs[:4]}")

    def _mooncake_copy_put(self, key: str, payload: np.ndarray) -> None:
        if (rc := self.raw.put(key, payload)) != 0:
            raise RuntimeError(f"mooncake put {key}: {rc}")

    def _mooncake_copy_get(self, key: str, buf: np.ndarray) -> None:
        memoryview(buf.data)[:] = self.raw.get(key)

    def _obstore_put(self, key: str, payload: np.ndarray) -> None:
        self.obstore.put(self.raw, key, payload, mode="create", use_multipart=False)

    def _obstore_get(self, key: str, buf: np.ndarray) -> None:
        buf.data[:] = memoryview(self.obstore.get(self.raw, key).bytes())

    def _boto_put(self, key: str, payload: np.ndarray) -> None:
        self.boto.put_object(Bucket=self.config.bucket, Key=key, Body=payload.tobytes(), IfNoneMatch="*")

    def _boto_get(self, key: str, buf: np.ndarray) -> None:
        body = self.boto.get_object(Bucket=self.config.bucket, Key=key)["Body"]
        view, n = buf.data, 0
        while n < len(view) and (got := body._raw_stream.readinto(view[n:])):
            n += got
        body.close()
        if n != len(view):
            raise RuntimeError(f"boto3: {key} gave {n} bytes, expected {len(view)}")

    def close(self) -> None:
        self.store.close()
        self.plain.close()
        if self.mooncake:
            self.store_copy.close()
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
            per: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
            paths.run(names[0], payloads[:connections], buffers[:connections])  # warm connections
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


def cipher_cost(keyring, block_bytes: int = 8 << 20, rounds: int = 8) -> str:
    """One core's AES-256-GCM speed over one block, sealed then opened: GB/s and CPU
    seconds per GB each way."""
    from tiered_kv.remote.format.keys import new_nonce

    block = np.random.default_rng(1).integers(0, 256, block_bytes, dtype=np.uint8).data
    nonce, aad = new_nonce(), b"header"
    dest = [memoryview(bytearray(block_bytes))]
    seal_s, open_s = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ciphertext, tag = keyring.seal(nonce, aad, [block])
        t1 = time.perf_counter()
        keyring.open_into(keyring.current_id, nonce, aad, ciphertext, tag, dest)
        t2 = time.perf_counter()
        seal_s.append(t1 - t0)
        open_s.append(t2 - t1)
    gb = block_bytes / 1e9
    s, o = statistics.median(seal_s) / gb, statistics.median(open_s) / gb
    return (
        f"# AES-256-GCM on one core, {block_bytes >> 20} MiB blocks: seal {1 / s:.2f} GB/s ({s:.3f} CPU s per GB), "
        f"open {1 / o:.2f} GB/s ({o:.3f} CPU s per GB)"
    )


def table(results: dict[float, dict[str, tuple[list[float], list[float]]]]) -> str:
    """Medians over rounds; the ratios are medians of each round's ratio to the raw client
    measured first (obstore, or mooncake; the two ran minutes apart at most, so a drifting
    machine moves both)."""
    base = next(iter(next(iter(results.values()))))
    lines = [f"| block | path | put GB/s | get GB/s | put / {base} | get / {base} |", "|---|---|---|---|---|---|"]
    for mib, per in results.items():
        base_puts, base_gets = per[base]
        for name, (puts, gets) in per.items():
            rp = statistics.median(p / b for p, b in zip(puts, base_puts))
            rg = statistics.median(g / b for g, b in zip(gets, base_gets))
            lines.append(
                f"| {mib:g} MiB | {name} | {statistics.median(puts):.3f} | {statistics.median(gets):.3f} "
                f"| {rp:.2f} | {rg:.2f} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------- two nodes, one bucket

GPU_BLOCK = 16


@dataclass
class ReplayShape:
    """The replay's sizes: the workload, and each node's tiers in blocks."""

    requests: int = 200
    documents: int = 40
    document_blocks: int = 16
    question_blocks: tuple[int, int] = (1, 3)
    device_blocks: int = 64
    cpu_blocks: int = 64
    disk_blocks: int = 192
    layers: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    # The replay's KV is synthetic and its blocks small, so a real model's prefill rate
    # would make many shared-tier loads lose to recomputing: the replay measures what
    # node B finds of node A's uploads, so recomputing is made slow enough that every
    # load pays (the load-versus-recompute decision has its own benchmarks).
    prefill_tokens_per_s: float = 100.0


class _Node:
    """One engine node: a device cache, the tiers of ``config`` (CPU, disk in ``cache_dir``,
    the shared tier), and the engine driver, as ``HierarchySpec`` builds them."""

    def __init__(self, name: str, cache_dir: Path, remote: dict[str, Any], shape: ReplayShape):
        import torch

        from tiered_kv.remote.scheduler.manager import RemoteOffloadingManager
        from tiered_kv.sim.driver import DeviceKVCache, EngineDriver
        from tiered_kv.tiered.spec import HierarchySpec

        self.name = name
        self.device = DeviceKVCache(
            num_layers=shape.layers,
            num_gpu_blocks=shape.device_blocks,
            gpu_block_size=GPU_BLOCK,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            dtype=torch.float16,
            device="cpu",
        )
        self.block_bytes = self.device.layout.bytes_per_block
        config = TieredConfig.from_dict(
            {
                "cpu_bytes": f"{shape.cpu_blocks * self.block_bytes}B",
                "disk_path": str(cache_dir),
                "disk_bytes": f"{shape.disk_blocks * self.block_bytes}B",
                "block_size": GPU_BLOCK,
                "model_id": "bench/replay",
                "cover_weights": False,  # synthetic KV
                "prefill_tokens_per_s": shape.prefill_tokens_per_s,
                "remote": remote,
            }
        )
        self.spec = HierarchySpec(config, GPU_BLOCK, self.device.layout, engine_id=f"bench-{name}")
        self.tier = self.spec.lower_tiers[-1]
        worker = self.spec.build_worker(self.device.kv_caches, self.device.kv_before_num_blocks)
        manager = self.spec.get_manager()  # after the worker, as EngineDriver.from_spec does
        shared = manager.lower[-1]
        assert isinstance(shared, RemoteOffloadingManager)
        self.remote = shared
        self.driver = EngineDriver(manager, worker, self.device)

    def run(self, requests: list[list[bytes]]):
        """Each request as an engine serves it: the shared tier is asked about its blocks
        in one batch first (an engine defers a request while a lookup answers
        HIT_PENDING), and its jobs settle before the next; then the uploads land."""
        from tiered_kv.sim.driver import DriverReport

        report = self.driver.report = DriverReport()
        started = time.perf_counter()
        for block_hashes in requests:
            if self.remote.expect(block_hashes):
                self.remote.wait_probes(60)
            self.driver.run_request(block_hashes)
            self.driver.drain()
        self.tier.stager.drain()
        if not self.remote.settle(300):
            raise RuntimeError(f"node {self.name}: uploads did not settle within 300 s")
        report.wall_seconds = time.perf_counter() - started
        return report

    def close(self) -> None:
        self.driver.worker.shutdown()
        self.driver.manager.shutdown()
        self.spec.close()


def replay(config: RemoteConfig, shape: ReplayShape, seed: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Node A then node B on the two halves of one shared-prefix workload; a row per node."""
    from tiered_kv.remote.scheduler.manager import REMOTE
    from tiered_kv.sim.workloads import shared_prefix_workload

    workload = shared_prefix_workload(
        shape.requests,
        shape.documents,
        shape.document_blocks,
        shape.question_blocks,
        tokens_per_block=GPU_BLOCK,
        seed=seed,
    )
    half = len(workload.requests) // 2
    remote = {**config.to_dict(), "prefix": f"bench-replay-{uuid.uuid4().hex[:8]}"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as scratch:
        for name, requests in (("A", workload.requests[:half]), ("B", workload.requests[half:])):
            node = _Node(name, Path(scratch) / name, remote, shape)
            try:
                report = node.run(requests)
                stats = node.tier.store.stats()
            finally:
                node.close()
            if report.mismatches:
                raise RuntimeError(f"node {name}: {report.mismatches} loaded blocks differ from what was computed")
            blocks = report.blocks_requested
            rows.append(
                {
                    "node": name,
                    "requests": len(requests),
                    "tokens": blocks * GPU_BLOCK,
                    "device": report.device_hits / blocks,
                    "cpu": report.hits_by_medium.get("CPU", 0) / blocks,
                    "disk": report.hits_by_medium.get("DISK", 0) / blocks,
                    "remote": report.hits_by_medium.get(REMOTE, 0) / blocks,
                    "computed": report.computed / blocks,
                    "uploaded": stats.puts_stored,
                    "dropped": stats.puts_dropped + stats.puts_failed,
                    "seconds": report.wall_seconds,
                    "block_bytes": node.block_bytes,
                }
            )
            log(f"  node {name}: {rows[-1]}")
    rows.append({"prefix": remote["prefix"]})
    return rows


def replay_table(rows: list[dict[str, Any]]) -> str:
    """Token hit rates per tier (all blocks are full, so token and block rates agree)."""
    lines = [
        "| node | requests | tokens | device | CPU | disk | shared | computed | uploaded / dropped | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "node" not in r:
            continue
        lines.append(
            f"| {r['node']} | {r['requests']} | {r['tokens']:,} | {r['device']:.1%} | {r['cpu']:.1%} "
            f"| {r['disk']:.1%} | {r['remote']:.1%} | {r['computed']:.1%} | {r['uploaded']} / {r['dropped']} "
            f"| {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def _delete_prefix(config: RemoteConfig, prefix: str) -> int:
    from tiered_kv.remote.store.client import S3Client

    if config.backend == "mooncake":  # no listing: every key under the prefix, by pattern
        import re

        from tiered_kv.remote.store.mooncake_client import MooncakeClient

        with MooncakeClient(config) as client:
            return max(0, client.raw.remove_by_regex("^" + re.escape(prefix + "/") + ".*", True))

    s3 = S3Client(config)
    keys = [key for key, _ in s3.list(prefix + "/")]
    with ThreadPoolExecutor(config.max_connections) as pool:
        list(pool.map(s3.delete, keys))
    return len(keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--endpoint", help="a running S3 endpoint, e.g. http://127.0.0.1:7480 (with --bucket)")
    where.add_argument("--config", help="a server's config file: its 'remote' key names endpoint and bucket")
    where.add_argument("--start-rgw", action="store_true", help="start a throwaway Ceph RGW (tools/rgw_server.sh)")
    p.add_argument("--backend", choices=("s3", "mooncake"), default="s3", help="the shared tier's backend")
    p.add_argument("--mooncake-master", help="mooncake: a running master's host:port (default: start one)")
    p.add_argument("--metadata-server", help="mooncake: its metadata server URL (with --mooncake-master)")
    p.add_argument("--bucket", default="tiered-kv-bench", help="bucket (created when the server is our own)")
    p.add_argument("--only", choices=("throughput", "replay"), help="run one part (default: both)")
    p.add_argument("--sizes", default="0.5,2,8", help="block sizes in MiB, comma-separated")
    p.add_argument("--total", default="128MiB", help="bytes moved per path, size and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=8, help="requests in flight, every path alike")
    p.add_argument("--paths", default="obstore,tier,tier-plain,boto3", help="paths to measure (obstore is always one)")
    p.add_argument("--requests", type=int, default=ReplayShape.requests, help="replay: requests, both nodes together")
    p.add_argument("--seed", type=int, default=0, help="replay: workload seed")
    args = p.parse_args()
    wanted = ["obstore"] + [n for n in args.paths.split(",") if n in ("tier", "tier-plain", "boto3")]
    from tiered_kv.config import parse_size

    sizes = [float(s) for s in args.sizes.split(",")]
    total = parse_size(args.total, "--total")

    def run(config: RemoteConfig) -> None:
        if config.key_file is None and config.key_env is None:
            os.environ["TIERED_KV_BENCH_KEY"] = os.urandom(32).hex()  # a key for this run only
            config = RemoteConfig.from_dict({**config.to_dict(), "key_env": "TIERED_KV_BENCH_KEY"})
        config = RemoteConfig.from_dict(
            {
                **config.to_dict(),
                "prefix": "bench",
                "max_connections": args.connections,
                "request_timeout": "60s",
                "max_pending_upload_bytes": "64GiB",
            }
        )
        log = lambda s: print(s, flush=True)  # noqa: E731
        if args.only != "replay":
            print(
                f"# {config.where()}, {args.connections} connections, {args.rounds} rounds, "
                f"{args.total} per path and round",
                flush=True,
            )
            from tiered_kv.remote.format.keys import load_keyring

            print(cipher_cost(load_keyring(config)), flush=True)
            results = bench(config, sizes, total, args.rounds, args.connections, wanted, log)
            print()
            print(table(results))
        if args.only != "throughput":
            shape = ReplayShape(requests=args.requests)
            print(f"\n# two nodes, one bucket: {shape}", flush=True)
            rows = replay(config, shape, args.seed, log)
            print(f"# {_delete_prefix(config, rows[-1]['prefix'])} replay objects deleted\n")
            print(replay_table(rows))

    if args.config:
        from tiered_kv.model_identity import read_config_file

        try:
            shared = TieredConfig.from_dict(read_config_file(args.config)).shared_tier
        except ConfigError as e:
            sys.exit(f"bench_remote: {e}")
        if shared is None:
            sys.exit(f"bench_remote: {args.config} has no shared tier")
        run(shared.settings)
        return
    if args.backend == "mooncake":
        moon = {"backend": "mooncake", "mooncake_buffer_bytes": "512MiB"}
        if args.mooncake_master:
            run(
                RemoteConfig.from_dict(
                    {**moon, "mooncake_master": args.mooncake_master, "mooncake_metadata_server": args.metadata_server}
                )
            )
            return
        from tiered_kv.testing.mooncake_server import MooncakeServer, missing_reason

        if (reason := missing_reason()) is not None:
            sys.exit(f"bench_remote: {reason}")
        with tempfile.TemporaryDirectory(prefix="bench-mooncake-") as scratch:
            started = time.perf_counter()
            with MooncakeServer(Path(scratch), segment=f"{max(1 << 30, 3 * total) >> 20} MB").start() as server:
                print(f"# Mooncake Store started in {time.perf_counter() - started:.1f} s", flush=True)
                run(RemoteConfig.from_dict({**server.settings(), **moon}))
        return
    if args.endpoint:
        run(RemoteConfig.from_dict({"endpoint": args.endpoint, "bucket": args.bucket}))
        return
    if not args.start_rgw:
        p.error("one of --endpoint, --config, --start-rgw (or --backend mooncake) is required")
    os.environ.update(KEYS)  # the throwaway server's user, whatever else the environment holds
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    with own_server(max(2 << 30, 4 * total)) as endpoint:
        import botocore.session

        botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1"
        ).create_bucket(Bucket=args.bucket)
        run(RemoteConfig.from_dict({"endpoint": endpoint, "bucket": args.bucket}))


if __name__ == "__main__":
    main()
