"""What the scheduler-side and worker-side halves of the vLLM adapter share: the spec that
carries our plans inside vLLM's job metadata, the metric names, and the config-info
labels. Plain data, no I/O; imported in the scheduler, the workers and vLLM's API
server (which only reads the metric definitions)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_offload.base import (
    ConfigInfo,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)
from vllm.v1.kv_offload.base import LoadStoreSpec as VllmLoadStoreSpec

from tiered_kv.abstract import LoadStoreSpec
from tiered_kv.metrics import TIER_COUNTERS, TIERS


class TieredJobSpec(VllmLoadStoreSpec):
    """Our side of a vLLM transfer job: the composite manager's spec (``inner``: a
    ``TieredStoreSpec`` for a store, a ``CPULoadStoreSpec`` or ``TieredLoadSpec`` for a
    load), in chunk units. Travels from the scheduler to every worker in vLLM's
    connector metadata, so it is plain picklable data."""

    def __init__(self, inner: LoadStoreSpec):
        self.inner = inner

    def __repr__(self) -> str:
        return f"TieredJobSpec({self.inner!r})"


# Names follow tiered_kv.metrics.PrometheusMetrics, so a dashboard works for the demo
# and for vLLM alike. Counters gain the ``_total`` suffix on the endpoint.
TIER_BLOCKS = "tiered_kv_tier_blocks"
TIER_USED_BLOCKS = "tiered_kv_tier_used_blocks"
TIER_CAPACITY_BLOCKS = "tiered_kv_tier_capacity_blocks"
PENDING_DISK_WRITES = "tiered_kv_pending_disk_writes"
DISK_VERIFICATIONS = "tiered_kv_disk_verifications"
WORKER_JOB_FAILURES = "tiered_kv_worker_job_failures"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric the manager reports (vLLM's frontend asserts each reported name was
    declared, with the same label names)."""
    return {
        TIER_BLOCKS: OffloadingCounterMetadata(
            documentation=("Chunks counted per tier and event. Events: "
                           + ", ".join(TIER_COUNTERS) + f". Tiers: {', '.join(TIERS)}."),
            labelnames=("tier", "event")),
        TIER_USED_BLOCKS: OffloadingGaugeMetadata(
            documentation="Chunks held per tier (stored, being stored or being promoted).",
            labelnames=("tier",)),
        TIER_CAPACITY_BLOCKS: OffloadingGaugeMetadata(
            documentation="Chunk slots per tier (per rank: each rank holds its shard of a chunk).",
            labelnames=("tier",)),
        PENDING_DISK_WRITES: OffloadingGaugeMetadata(
            documentation="Chunks queued for a disk write whose outcome is not known yet."),
        DISK_VERIFICATIONS: OffloadingCounterMetadata(
            documentation=("Disk chunks read back and checksum-verified on every rank before a "
                           "lookup reported them as hits; outcome ok or failed (failed chunks "
                           "are dropped and recomputed)."),
            labelnames=("outcome",)),
        WORKER_JOB_FAILURES: OffloadingCounterMetadata(
            documentation=("Worker jobs that failed inside tiered-kv and were reported to vLLM as "
                           "done (vLLM cannot take a failure); kind store or promotion. Their CPU "
                           "slots are never served."),
            labelnames=("kind",)),
    }


@dataclass(frozen=True)
class TieredOffloadingInfo(ConfigInfo):
    """Static facts published on ``vllm:kv_offload_config_info`` (per rank)."""

    tiered_cpu_slots: int
    tiered_cpu_bytes_per_rank: int
    tiered_disk_slots: int
    tiered_disk_path: str | None
    tiered_write_policy: str
    tiered_tokens_per_chunk: int
    tiered_bytes_per_chunk_per_rank: int
