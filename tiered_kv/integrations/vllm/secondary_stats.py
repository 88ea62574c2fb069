"""The counters and static facts a ``TieredDiskTier`` reports to vLLM.

Scheduler process, plain data: ``DiskTierStats`` is counted by the tier's calls and
job threads and turned into vLLM's ``OffloadingConnectorStats`` by ``stats_since``;
``metric_definitions`` declares the names (vLLM's frontend asserts each reported name
was declared); ``DiskTierInfo`` goes on ``vllm:kv_offload_config_info``. No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfo,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)


@dataclass
class DiskTierStats:
    """Counters of one tier (monotonic, in chunks unless named otherwise)."""

    stored: int = 0  # written, durable and indexed
    store_failed: int = 0  # the write failed (full disk, EIO, index error): not kept
    store_skipped: int = 0  # refused: no free slot, or too many writes already waiting
    evicted: int = 0  # LRU victims to make room
    promoted: int = 0  # read, verified and copied into vLLM's CPU tier
    promotion_failed: int = 0  # missing, unreadable or corrupt: dropped, recomputed by vLLM
    corrupt: int = 0  # of which failed their checksum (the store's count)
    failed_store_jobs: int = 0
    failed_promotion_jobs: int = 0
    # The disk manager's own counts (``DiskManagerStats.index_errors``), copied at each report.
    index_read_errors: int = 0
    index_flush_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: Prometheus name and help of each counter reported to vLLM.
_COUNTERS = {
    "stored": ("tiered_kv_disk_tier_stored_chunks", "Chunks written to the disk tier, durable and indexed."),
    "store_failed": (
        "tiered_kv_disk_tier_store_failed_chunks",
        "Chunks whose disk write failed (full disk, I/O error); not kept.",
    ),
    "store_skipped": (
        "tiered_kv_disk_tier_store_skipped_chunks",
        "Chunks not written: no free disk slot, or too many writes waiting.",
    ),
    "evicted": ("tiered_kv_disk_tier_evicted_chunks", "Chunks evicted (LRU) from the disk tier to make room."),
    "promoted": ("tiered_kv_disk_tier_promoted_chunks", "Chunks read, verified and copied into vLLM's CPU tier."),
    "promotion_failed": (
        "tiered_kv_disk_tier_promotion_failed_chunks",
        "Chunks that could not be promoted (missing, unreadable or corrupt); dropped from the disk tier.",
    ),
    "corrupt": (
        "tiered_kv_disk_tier_corrupt_chunks",
        "Chunks that failed their checksum on read; dropped from the disk tier.",
    ),
    "index_read_errors": (
        "tiered_kv_disk_tier_index_read_errors",
        "Failed reads of the disk index's log: what the workers wrote stays pending until a read succeeds.",
    ),
    "index_flush_errors": (
        "tiered_kv_disk_tier_index_flush_errors",
        "Failed disk index commits: failed stores' slots stay held back until one succeeds.",
    ),
}
_USED_GAUGE = "tiered_kv_disk_tier_used_chunks"
_HELD_BACK_GAUGE = "tiered_kv_disk_tier_held_back_chunks"


@dataclass(frozen=True)
class DiskTierInfo(ConfigInfo):
    """Static facts of one tier on ``vllm:kv_offload_config_info``."""

    disk_path: str
    disk_namespace: str
    disk_capacity_chunks: int
    disk_chunk_bytes: int
    disk_io_backend: str
    disk_checksum: str


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric a tier reports: its counters, the chunks it holds and the slots it holds back."""
    defs: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc) for name, doc in _COUNTERS.values()
    }
    defs[_USED_GAUGE] = OffloadingGaugeMetadata(documentation="Chunks held by the disk tier.")
    defs[_HELD_BACK_GAUGE] = OffloadingGaugeMetadata(
        documentation="Disk slots neither free nor holding a chunk, per reason: settling (a store given up while a "
        "rank may still write it), releasing (a failed store's, until its partial index entry is deleted).",
        labelnames=("reason",),
    )
    return defs


def stats_since(
    stats: DiskTierStats, reported: DiskTierStats, used_chunks: int, held_back: Mapping[str, int]
) -> OffloadingConnectorStats:
    """Counter increments of ``stats`` over ``reported`` (the last report), the chunks
    held now and the slots held back now per reason (``DiskOffloadingManager.held_back_slots``)."""
    out = OffloadingConnectorStats()
    for attr, (name, _) in _COUNTERS.items():
        delta = getattr(stats, attr) - getattr(reported, attr)
        if delta:
            out.increase_counter(name, delta)
    out.set_gauge(_USED_GAUGE, used_chunks)
    for reason, n in held_back.items():
        out.set_gauge(_HELD_BACK_GAUGE, n, (reason,))
    return out
