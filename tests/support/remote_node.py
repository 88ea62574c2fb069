"""One engine node of the shared-tier tests: CPU, disk and shared tiers under an engine driver.

Imported by tests/remote/test_remote_tier.py, and run as a process of its own by the two-node
test (``python tests/support/remote_node.py '<json settings>'``), so that each node has its own
memory, threads, S3 connections and cache directory, as separate machines would. As a
process it runs the requests it is given, lets its uploads land, and prints one JSON
line: what the driver saw (hits per medium, blocks computed, mismatches) and what the
shared tier's stores counted. I/O: the node's cache directory and the S3 server.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiered_kv.config import TieredConfig
from tiered_kv.sim.driver import DeviceKVCache, DriverReport, EngineDriver
from tiered_kv.remote.scheduler.manager import RemoteOffloadingManager
from tiered_kv.remote.tier import RemoteTier
from tiered_kv.abstract import Closing
from tiered_kv.tiered.spec import HierarchySpec

GPU_BLOCK_SIZE = 16
BLOCKS_PER_REQUEST = 4


def requests(first: int, count: int) -> list[list[bytes]]:
    """``count`` requests of distinct 4-block chains (the same bytes on every node)."""
    return [
        [hashlib.sha256(f"request {r} block {i}".encode()).digest() for i in range(BLOCKS_PER_REQUEST)]
        for r in range(first, first + count)
    ]


class ExpectingDriver(EngineDriver):
    """Asks the shared tier about a request's blocks in one batch before looking them up,
    and waits for the answers: what an engine does when a lookup answers HIT_PENDING (it
    defers the request a step). Without it a node discovers another node's chain one
    block per lookup."""

    remote: RemoteOffloadingManager

    def run_request(self, block_hashes) -> None:
        block_hashes = list(block_hashes)
        rest = block_hashes[self._pool.lookup(block_hashes) :]
        if rest and self.remote.expect(rest):
            self.remote.wait_probes(60)
        super().run_request(block_hashes)


@dataclass
class Node(Closing):
    spec: HierarchySpec
    driver: EngineDriver
    tier: RemoteTier

    @property
    def remote(self) -> RemoteOffloadingManager:
        return self.driver.manager.lower[-1]

    def run(self, reqs: list[list[bytes]]) -> DriverReport:
        """Run ``reqs`` with a fresh report, each request's jobs settled before the next
        (so which blocks each tier keeps never depends on timing), then let every upload
        land or fail and the manager learn which."""
        report = self.driver.report = DriverReport()
        for block_hashes in reqs:
            self.driver.run_request(block_hashes)
            self.driver.drain()
        self.settle()
        return report

    def settle(self) -> None:
        self.tier.stager.drain()
        assert self.remote.settle(120), "pending uploads never settled"

    def close(self) -> None:
        self.driver.worker.shutdown()
        self.driver.manager.shutdown()
        self.spec.close()


def build(
    cache_dir: Path,
    remote: dict[str, Any],
    *,
    model_id: str = "org/model",
    hash_seed: str = "",
    dtype: str = "float16",
    cpu_bytes: str = "128KiB",
    disk_bytes: str = "128KiB",
    expecting: bool = False,
    cost_aware: bool = False,
    failed_loads_recomputed: bool = False,
    **extra: Any,
) -> Node:
    """A node: 32 device blocks of 8 KiB, CPU and disk tiers of 16 blocks each (write-through), and the
    shared tier of ``remote`` settings under this node's fingerprint; ``extra``: more config keys;
    ``failed_loads_recomputed``: the engine's policy for a failed load (vLLM's ``recompute``)."""
    device = DeviceKVCache(
        num_layers=2,
        num_gpu_blocks=32,
        gpu_block_size=GPU_BLOCK_SIZE,
        num_kv_heads=2,
        head_dim=32,
        dtype=getattr(torch, dtype),
        device="cpu",
    )
    # The shared tier from the config's ``remote`` key, as a user configures it.
    config = TieredConfig.from_dict(
        {
            "cpu_bytes": cpu_bytes,
            "disk_path": str(cache_dir),
            "disk_bytes": disk_bytes,
            "block_size": GPU_BLOCK_SIZE,
            "model_id": model_id,
            "cover_weights": False,  # synthetic KV
            "hash_seed": hash_seed,
            "remote": remote,
            # Every block found is loaded: these nodes show where blocks go; the decision,
            # which this machine's loopback requests would sway, is tested on its own.
            "cost_aware": cost_aware,
            **extra,
        }
    )
    engine_id = hashlib.sha256(str(cache_dir).encode()).hexdigest()[:16]
    spec = HierarchySpec(
        config, GPU_BLOCK_SIZE, device.layout, engine_id=engine_id, failed_loads_recomputed=failed_loads_recomputed
    )
    tier = spec.lower_tiers[-1]
    assert [t.name for t in spec.lower_tiers] == ["disk", "remote"]
    driver = (ExpectingDriver if expecting else EngineDriver).from_spec(spec, device)
    if expecting:
        driver.remote = driver.manager.lower[-1]
    return Node(spec, driver, tier)


def summary(node: Node, report: DriverReport) -> dict[str, Any]:
    worker = node.tier.store.stats()
    scheduler = node.remote.store.stats()
    return {
        "hits_by_medium": report.hits_by_medium,
        "computed": report.computed,
        "offload_hits": report.offload_hits,
        "mismatches": report.mismatches,
        "recomputed_after_failed_load": report.recomputed_after_failed_load,
        "gets_hit": worker.gets_hit,
        "gets_rejected": worker.gets_rejected,
        "gets_absent": worker.gets_absent,
        "puts_stored": worker.puts_stored,
        "probes": scheduler.probes,
        "remote": dict(node.remote.counters),
        "namespace": node.remote.store.namespace,
    }


def main(argv: list[str]) -> int:
    """Settings: ``remote`` (dict), ``cache_dir``, ``first``, ``count``, and optionally
    ``model_id``, ``hash_seed``, ``dtype``, ``expecting``."""
    settings = json.loads(argv[1])
    torch.set_num_threads(1)
    node = build(
        Path(settings["cache_dir"]),
        settings["remote"],
        model_id=settings.get("model_id", "org/model"),
        hash_seed=settings.get("hash_seed", ""),
        dtype=settings.get("dtype", "float16"),
        expecting=settings.get("expecting", False),
    )
    try:
        report = node.run(requests(settings["first"], settings["count"]))
        print(json.dumps(summary(node, report)))
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
