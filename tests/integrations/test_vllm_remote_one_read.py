"""One read per shared-tier hit: ``TieredOffloadingConnector`` with vLLM's recompute policy.

With vLLM's own ``OffloadingConnector`` a failed load is fatal, so the scheduler
downloads and verifies every rank's object of a chunk before calling it a hit, and the
worker downloads it again. With our connector and ``kv_load_failure_policy: recompute``
a chunk known present on every rank is a hit at once; the worker's read is the only
one, verified before a byte reaches the KV cache, and a chunk that fails there is
reported to vLLM, which recomputes it. Requests are counted at a proxy in front of the
real Ceph RGW (tests/support/s3_server.py), so every download that reaches the server is
seen.
"""

from __future__ import annotations

from collections import Counter

import pytest
from support.s3_server import BUCKET, FaultProxy, skip_module_without_rgw

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)
skip_module_without_rgw()

from support import vllm_harness as vh  # noqa: E402
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402

from tiered_kv.integrations.vllm.connector import TieredOffloadingConnector  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16
CHUNK_BYTES = 4096  # the harness's model: 2 layers x 2 KV heads x 16 tokens x 32 dims x 2 bytes
CHUNKS = 5
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _prompt(seed: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(CHUNKS * BLOCK + 3)]


def _keys(prompt: list[int]) -> list[bytes]:
    return [make_offload_key(h, 0) for h in vh.hash_blocks(prompt, BLOCK)]


def _node(model_dir, remote: dict, **vllm) -> vh.VllmHarness:
    """A node with a CPU tier of 16 chunks and the shared tier (no disk tier)."""
    config = {**SPEC, "cpu_bytes": f"{16 * CHUNK_BYTES}B", "block_size": BLOCK, "remote": remote}
    return vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real", **vllm)


def _upload_from_node_a(model_dir, settings: dict, prompt: list[int]) -> list[bytes]:
    with _node(model_dir, settings) as a:
        req_id = a.admit(prompt)
        computed = [a.gpu_block_bytes(b) for b in a.block_ids(req_id)[:CHUNKS]]
        a.settle()
        a.worker_spec._worker.hierarchy.lower_tiers[-1].stager.drain()
        assert a.manager.tier("remote").settle(30)
    return computed


def _chunk_gets(proxy: FaultProxy, keys: list[bytes]) -> Counter[str]:
    """GET requests that reached the server, per chunk (by its key's hex)."""
    out: Counter[str] = Counter()
    for (method, path), n in proxy.requests.items():
        for key in keys:
            if method == "GET" and key.hex() in path:
                out[key.hex()] += n
    return out


def test_each_shared_tier_hit_is_downloaded_once_and_verified_by_the_worker(
    tmp_path, model_dir, rgw_server, remote_settings
):
    prompt = _prompt(1)
    computed = _upload_from_node_a(model_dir, remote_settings, prompt)
    proxy = FaultProxy(rgw_server.endpoint.removeprefix("http://"), mode="count")
    with _node(model_dir, {**remote_settings, "endpoint": proxy.endpoint}, **vh.ONE_READ) as b:
        assert isinstance(b.worker_connector, TieredOffloadingConnector)
        assert b.worker_spec.failed_loads_recomputed
        req_id = b.admit(prompt)
        assert b.prefix_hits[req_id].external == CHUNKS * BLOCK
        assert [b.gpu_block_bytes(i) for i in b.block_ids(req_id)[:CHUNKS]] == computed
        b.settle()
        gets = _chunk_gets(proxy, _keys(prompt)[:CHUNKS])
        # One download per chunk and rank (TP 1: one object each), the worker's own.
        assert gets == Counter({k.hex(): 1 for k in _keys(prompt)[:CHUNKS]}), gets
        assert b.manager.check("remote").outcomes() == {}  # no verifying download in the scheduler
        # vLLM's endpoint shows the worker's downloads (our connector hands them over),
        # as many as reached the server, and the worker's load jobs with their timings.
        registry = b.publish_metrics()

        def value(name, **labels):
            return registry.get_sample_value(name, {"engine": "0", **labels})

        assert value("tiered_kv_remote_downloads_total", outcome="hit") == CHUNKS == sum(gets.values())
        assert value("tiered_kv_remote_bytes_total", direction="download") >= CHUNKS * CHUNK_BYTES
        assert value("tiered_kv_remote_request_seconds_count", op="get") >= CHUNKS
        loads = sum(len(step.load_jobs) for step in b.steps)  # read into CPU slots, then copied in
        for kind in ("remote_to_cpu", "cpu_to_gpu"):
            assert value("tiered_kv_transfer_jobs_total", transfer_type=kind, outcome="ok") == loads >= 1
            assert value("tiered_kv_transfer_seconds_count", transfer_type=kind) == loads


def test_an_object_that_fails_at_the_worker_is_recomputed_never_served(
    tmp_path, model_dir, rgw_server, remote_settings
):
    prompt = _prompt(2)
    _upload_from_node_a(model_dir, remote_settings, prompt)
    admin = rgw_server.admin_client()
    victim = _keys(prompt)[2].hex()
    listed = admin.list_objects_v2(Bucket=BUCKET, Prefix=remote_settings["prefix"] + "/")
    (key,) = [o["Key"] for o in listed["Contents"] if victim in o["Key"]]
    body = bytearray(admin.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[-100:] = bytes(100)  # the last KV bytes zeroed: the object no longer verifies
    admin.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))

    with _node(model_dir, remote_settings, **vh.ONE_READ) as b:
        for t in b.kv_caches.values():
            t.zero_()
        req_id = b.admit(prompt)
        # The request ran on the chunks that verified and recomputed from the damaged one
        # on: every GPU block holds the bytes its prefix calls for.
        matches = b.kv_matches(req_id)
        assert len(matches) == CHUNKS and all(matches), matches
        b.settle()
        worker = b.worker_spec._worker
        assert worker.stats.tiers["cpu"]["failed_loads"] >= 1  # counted where it happened
        registry = b.publish_metrics()  # and on vLLM's endpoint, from the worker
        assert (
            registry.get_sample_value("tiered_kv_remote_downloads_total", {"engine": "0", "outcome": "rejected"}) == 1
        )
        assert worker.take_failed_gpu_blocks() == set()  # handed to vLLM already


def test_a_lora_requests_kv_never_reaches_the_bucket_nor_is_looked_for_there(
    tmp_path, model_dir, rgw_server, remote_settings
):
    """A LoRA request's KV is the CPU tier's alone (``CpuOnly``): its stores upload no
    object and its lookups ask the bucket about none, while the same prompt without the
    adapter is uploaded as ever."""
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("sql-expert", 1, str(tmp_path / "adapters" / "sql-expert"))
    prompt = _prompt(3)
    proxy = FaultProxy(rgw_server.endpoint.removeprefix("http://"), mode="count")
    with _node(model_dir, {**remote_settings, "endpoint": proxy.endpoint}, **vh.ONE_READ) as b:
        remote = b.manager.tier("remote")

        def serve_lora() -> int:
            req_id = b.add_request(prompt, lora_request=lora)
            b.settle()
            return b.prefix_hits[req_id].external

        def settled() -> None:
            b.worker_spec._worker.hierarchy.lower_tiers[-1].stager.drain()
            assert remote.settle(30)

        def requests_for(keys: list[bytes]) -> list[tuple[str, str]]:
            return [(method, path) for method, path in proxy.requests if any(k.hex() in path for k in keys)]

        assert serve_lora() == 0
        lora_keys = list(b.manager.composite.cpu.iter_evictable())
        assert len(lora_keys) == CHUNKS
        settled()
        b.reset_gpu_prefix_cache()
        assert serve_lora() == CHUNKS * BLOCK  # from CPU
        assert requests_for(lora_keys) == []
        b.reset_gpu_prefix_cache()
        assert b.serve(prompt).external == 0  # its own keys: computed, and uploaded
        settled()
        plain = _keys(prompt)[:CHUNKS]
        assert {method for method, _ in requests_for(plain)} >= {"PUT"}
        assert requests_for(lora_keys) == []
