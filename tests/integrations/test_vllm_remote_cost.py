"""Loads chosen by cost with the shared tier under vLLM 0.33: our connector and vLLM's
real scheduler and worker connector (tests/support/vllm_harness.py, ``worker="real"``), the
bucket a real Ceph RGW behind a proxy that can make every download slower
(tests/support/s3_server.py). The worker's measured download times reach the scheduler's
estimate of the tier; a bucket slower than recomputing is passed over, and used again once
it is fast again."""

from __future__ import annotations

import pytest
from support.s3_server import FaultProxy, skip_module_without_rgw

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)
skip_module_without_rgw()

from support import vllm_harness as vh  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16
CHUNK_BYTES = 4096  # the harness's model: 2 layers x 2 KV heads x 16 tokens x 32 dims x 2 bytes
CONFIG = {
    "spec_name": "TieredOffloadingSpec",
    "spec_module_path": "tiered_kv.integrations.vllm",
    "cpu_bytes": f"{2 * CHUNK_BYTES}B",  # two chunks: each new prompt evicts the last one
    "block_size": BLOCK,
    "promote_on_hit": False,  # every repeat downloads again
    "prefill_tokens_per_s": 100.0,  # a chunk costs 160 ms to recompute
}
ONE_READ = {
    "kv_connector": "TieredOffloadingConnector",
    "kv_connector_module_path": "tiered_kv.integrations.vllm.connector",
    "kv_load_failure_policy": "recompute",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _prompt(seed: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(2 * BLOCK + 1)]


def _serve(h: vh.VllmHarness, prompt: list[int]) -> vh.PrefixHit:
    """``prompt`` served from a cold GPU cache, its chunks then uploaded."""
    h.reset_gpu_prefix_cache()
    req_id = h.add_request(prompt)
    h.settle()
    h.worker_spec._worker.hierarchy.lower_tiers[-1].stager.drain()
    assert h.manager.tier("remote").settle(30)
    return h.prefix_hits[req_id]


def test_under_vllm_a_bucket_slower_than_recomputing_is_passed_over_and_used_again_once_it_recovers(
    model_dir, rgw_server, remote_settings
):
    proxy = FaultProxy(rgw_server.endpoint.removeprefix("http://"), mode="count")
    config = {**CONFIG, "remote": {**remote_settings, "endpoint": proxy.endpoint}}
    with proxy, vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real", **ONE_READ) as h:
        costs = h.manager.costs
        assert costs is not None and costs.enabled
        costs.probe_every = 3
        remote = costs.tiers["remote"]
        docs = [_prompt(seed) for seed in range(3)]
        for doc in docs:
            _serve(h, doc)
        tiers = h.manager.composite.stats.tiers
        fillers = iter(range(1000, 2000))

        def bucket_pass() -> tuple[int, int, list[int]]:
            """Each document once, from the bucket only (a new prompt of two chunks fills
            the CPU tier first): bucket hits, chunks passed over, tokens loaded per document."""
            hits, skipped = tiers["remote"]["hits"], tiers["remote"]["skipped_slower_than_recompute"]
            loaded = []
            for doc in docs:
                _serve(h, _prompt(next(fillers)))
                loaded.append(_serve(h, doc).external)
            return tiers["remote"]["hits"] - hits, tiers["remote"]["skipped_slower_than_recompute"] - skipped, loaded

        hits, skipped, loaded = bucket_pass()
        assert hits == 6 and skipped == 0 and loaded == [2 * BLOCK] * 3, "a fast bucket is used"
        assert remote.samples > 0, "the worker's download times reached the scheduler's estimate"

        proxy.get_delay = 1.0
        bucket_pass()  # the slow downloads are measured
        assert remote.seconds(costs.bytes_per_block) > BLOCK / costs.prefill_tokens_per_s
        hits, skipped, loaded = bucket_pass()
        assert skipped > 0 and loaded.count(0) >= 2, "a bucket slower than recomputing is passed over"
        assert hits <= 2, "only a probe still downloads"

        proxy.get_delay = 0.0
        costs.probe_every = 1  # every decision that passes the bucket over samples it
        for _ in range(10):  # until the probes' samples outweigh the slow ones
            hits, skipped, loaded = bucket_pass()
            if skipped == 0:
                break
        assert hits == 6 and skipped == 0 and loaded == [2 * BLOCK] * 3, "a recovered bucket is used again"
        assert tiers["cpu"]["failed_loads"] == 0
