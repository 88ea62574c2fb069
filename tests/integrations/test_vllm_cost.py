"""Loads chosen by cost inside vLLM 0.33's real scheduler and worker connector (CPU
tensors, tests/support/vllm_harness.py, ``worker="real"``): vLLM asks chunk by chunk, our
manager decides per request; the worker's measured load times reach the scheduler's
estimates; a disk tier that slows down is passed over and used again once it recovers."""

from __future__ import annotations

import time

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from support.disk_fixtures import slow_disk_reads  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16
GPU_BLOCK_BYTES = 4096
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _prompt(seed: int, n: int = 2 * BLOCK + 1) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def _build(model_dir, disk, **extra) -> vh.VllmHarness:
    config = {
        **SPEC,
        "cpu_bytes": f"{2 * GPU_BLOCK_BYTES}B",  # two chunks
        "disk_path": str(disk),
        "disk_bytes": f"{64 * 4096}B",
        "promote_on_hit": False,  # every repeat reads the disk again
        **extra,
    }
    return vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real")


def _serve(h: vh.VllmHarness, prompt: list[int]) -> vh.PrefixHit:
    h.reset_gpu_prefix_cache()
    req_id = h.add_request(prompt)
    h.settle()
    deadline = time.monotonic() + 20
    while h.manager.composite.pending_writes():
        assert time.monotonic() < deadline, "disk writes never became durable"
        time.sleep(0.005)
    return h.prefix_hits[req_id]


def test_under_vllm_a_disk_slower_than_recomputing_is_passed_over_and_used_again_once_it_recovers(model_dir, tmp_path):
    # Prefill at 100 tokens/s: a 16-token chunk costs 160 ms to recompute, far more than
    # this machine's disk takes to read it, far less than the slowed disk's 1.5 s a job.
    with _build(model_dir, tmp_path / "disk", prefill_tokens_per_s=100.0) as h:
        manager = h.manager
        costs = manager.costs
        assert costs is not None and costs.enabled
        costs.probe_every = 3
        disk = costs.tiers["disk"]
        slow = slow_disk_reads([h.worker_spec._worker.load_handler])
        assert slow
        docs = [_prompt(seed) for seed in range(3)]
        for doc in docs:
            _serve(h, doc)
        tiers = manager.composite.stats.tiers
        fillers = iter(range(1000, 2000))

        def disk_pass() -> tuple[int, int, list[int]]:
            """Each document once, disk-only (a new prompt of two chunks fills the CPU
            tier first): disk hits, disk chunks passed over, tokens loaded per document."""
            hits, skipped = tiers["disk"]["hits"], tiers["disk"]["skipped_slower_than_recompute"]
            loaded = []
            for doc in docs:
                _serve(h, _prompt(next(fillers)))
                loaded.append(_serve(h, doc).external)
            return tiers["disk"]["hits"] - hits, tiers["disk"]["skipped_slower_than_recompute"] - skipped, loaded

        hits, skipped, loaded = disk_pass()
        assert hits == 6 and skipped == 0 and loaded == [2 * BLOCK] * 3, "a fast disk is used"
        assert disk.samples > 0, "the worker's load times reached the scheduler's estimate"
        assert disk.gbps != costs.tiers["disk"].prior[0]

        for s in slow:
            s.delay = 1.5
        disk_pass()  # the slow reads are measured
        assert disk.seconds(costs.bytes_per_block) > BLOCK / costs.prefill_tokens_per_s
        hits, skipped, loaded = disk_pass()
        assert skipped > 0 and loaded.count(0) >= 2, "a disk slower than recomputing is passed over"
        assert hits <= 2, "only a probe still reads it"

        for s in slow:
            s.delay = 0.0
        costs.probe_every = 1  # every decision that passes the disk over samples it
        for _ in range(10):  # until the probes' samples outweigh the slow ones
            hits, skipped, loaded = disk_pass()
            if skipped == 0:
                break
        assert hits == 6 and skipped == 0 and loaded == [2 * BLOCK] * 3, "a recovered disk is used again"
        assert h.manager.composite.stats.tiers["cpu"]["failed_loads"] == 0


def test_under_vllm_chunks_past_the_plan_are_misses_and_the_request_is_computed_right(model_dir, tmp_path):
    """A prefill so fast that no tier pays: vLLM's scan of a disk-only prompt is answered
    RETRY once, then MISS from the first chunk; the request computes every token and its
    KV is what the model writes."""
    with _build(model_dir, tmp_path / "disk", prefill_tokens_per_s=1e12) as h:
        doc = _prompt(7)
        _serve(h, doc)
        _serve(h, _prompt(8))  # CPU now holds the filler only
        tiers = h.manager.composite.stats.tiers
        before = tiers["disk"]["skipped_slower_than_recompute"]
        start = len(h.steps)
        hit = _serve(h, doc)
        assert hit.external == 0
        assert tiers["disk"]["skipped_slower_than_recompute"] - before == 2
        assert not any(r.load_jobs for r in h.steps[start:]), "nothing was loaded"
        assert not h.manager.has_pending_work(), "no decision left waiting"
