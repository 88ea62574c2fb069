"""The shared tier (``remote``) under vLLM 0.33: ``TieredOffloadingSpec`` in the real scheduler
and worker connector (tests/support/vllm_harness.py, ``worker="real"``, CPU tensors), against a real
Ceph RGW (tests/support/s3_server.py).

Two harnesses with their own cache directories stand for two nodes sharing one bucket: the
second loads what the first computed, byte for byte, while nodes of another fingerprint never
read it. A lookup of a chunk whose membership probe is still in flight asks vLLM to retry
(made deterministic with a proxy that never answers), and a server that fails costs misses,
never a failed load reported to vLLM (whose worker asserts every load succeeded). A bucket
made slower than recomputing (a proxy delays every download) is passed over, and used again
once it is fast again.
"""

from __future__ import annotations


import pytest
from support.s3_server import BUCKET, FaultProxy, skip_module_without_rgw

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)
skip_module_without_rgw()

from support import vllm_harness as vh  # noqa: E402
from support.slow_tier import passed_over_while_slow_and_used_again  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from tiered_kv.integrations.vllm.manager import TieredVllmManager  # noqa: E402
from tiered_kv.remote.scheduler.manager import REMOTE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16  # GPU block size in tokens (one chunk)
CHUNK_BYTES = 4096  # 2 layers x 2 KV heads x 16 tokens x 32 dims x 2 bytes
CHUNKS = 5
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}
WAIT = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _prompt(seed: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(CHUNKS * BLOCK + 3)]


def _keys(prompt: list[int]) -> list[bytes]:
    return [make_offload_key(h, 0) for h in vh.hash_blocks(prompt, BLOCK)]


def _node(model_dir, remote: dict, cache_dir=None, **extra) -> vh.VllmHarness:
    """One node: CPU tier (16 chunks), a disk tier in ``cache_dir`` where given, the bucket."""
    config = {**SPEC, "cpu_bytes": f"{16 * CHUNK_BYTES}B", "block_size": BLOCK, "remote": remote, **extra}
    if cache_dir is not None:
        config.update(disk_path=str(cache_dir), disk_bytes=f"{64 * 4096}B")
    h = vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real")
    assert isinstance(h.manager, TieredVllmManager) and h.manager.tier("remote") is not None
    return h


def _worker(h: vh.VllmHarness):
    return h.worker_spec._worker


def _remote_store(h: vh.VllmHarness):
    """The worker's own store of the shared tier."""
    return _worker(h).hierarchy.lower_tiers[-1].store


def _uploaded(h: vh.VllmHarness) -> None:
    """Every upload node ``h``'s worker staged has landed (or failed)."""
    _worker(h).hierarchy.lower_tiers[-1].stager.drain()


def _objects(rgw_server, prefix: str) -> list[str]:
    listed = rgw_server.admin_client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return [o["Key"] for o in listed.get("Contents", ())]


def _compute_on(h: vh.VllmHarness, prompt: list[int]) -> list[bytes]:
    """Serve ``prompt`` on ``h`` from scratch and return its chunks' KV bytes, as computed."""
    req_id = h.admit(prompt)
    assert h.prefix_hits[req_id].external == 0
    assert all(h.kv_matches(req_id))
    computed = [h.gpu_block_bytes(b) for b in h.block_ids(req_id)[:CHUNKS]]
    h.settle()
    _uploaded(h)
    return computed


def test_node_b_loads_what_node_a_computed_byte_exact(tmp_path, model_dir, rgw_server, remote_settings):
    prompt = _prompt(1)
    with _node(model_dir, remote_settings, tmp_path / "a") as a:
        computed = _compute_on(a, prompt)
        keys = set(_objects(rgw_server, remote_settings["prefix"]))
        # One object per chunk and rank (the key names the rank), besides the manifest.
        assert sum(k.endswith("-r0") for k in keys) == CHUNKS
        assert all(any(k.endswith(f"{key.hex()}-r0") for k in keys) for key in _keys(prompt))
        assert a.manager.tier("remote").settle(WAIT) and a.manager.tier("remote").counters["confirmed"] == CHUNKS

    with _node(model_dir, remote_settings, tmp_path / "b") as b:  # a fresh cache directory: nothing local
        req_id = b.admit(prompt)
        assert b.prefix_hits[req_id].external == CHUNKS * BLOCK
        ids = b.block_ids(req_id)[:CHUNKS]
        assert [b.gpu_block_bytes(i) for i in ids] == computed
        assert all(b.kv_matches(req_id))
        stats = b.manager.stats.tiers
        assert stats["remote"]["hits"] == CHUNKS and stats["disk"]["hits"] == 0 and stats["cpu"]["hits"] == 0
        assert _remote_store(b).stats().gets_hit == CHUNKS  # the workers' own reads
        assert b.manager.check("remote").verifier.store.stats().gets_hit == CHUNKS  # verified before the hit
        b.settle()
        assert b.manager.check("remote").outcomes() == {"ok": CHUNKS}
        registry = b.publish_metrics()  # vLLM's Prometheus side accepts every name reported

        def value(name, **labels):
            return registry.get_sample_value(name, {"engine": "0", **labels})

        # The scheduler's own store: its verification downloads, each request timed.
        assert value("tiered_kv_remote_downloads_total", outcome="hit") == CHUNKS
        assert value("tiered_kv_verification_seconds_count", tier="remote") == CHUNKS
        assert value("tiered_kv_remote_request_seconds_count", op="get") >= CHUNKS
        assert value("tiered_kv_tier_tokens_total", tier="remote", event="hits") == CHUNKS * BLOCK


def test_node_without_disk_tier_shares_through_the_bucket(tmp_path, model_dir, remote_settings):
    """The shared tier directly below CPU where a node has no disk tier."""
    prompt = _prompt(2)
    with _node(model_dir, remote_settings) as a:
        assert [t.name for t in a.manager.composite.lower] == ["remote"] and a.manager.tier("disk") is None
        computed = _compute_on(a, prompt)
    with _node(model_dir, remote_settings) as b:
        req_id = b.admit(prompt)
        assert b.prefix_hits[req_id].external == CHUNKS * BLOCK
        assert [b.gpu_block_bytes(i) for i in b.block_ids(req_id)[:CHUNKS]] == computed
        b.settle()


@pytest.mark.parametrize("other", ["dtype", "hash_seed"])
def test_a_node_of_another_fingerprint_never_reads_the_chunks(tmp_path, model_dir, remote_settings, other):
    prompt = _prompt(3)
    with _node(model_dir, remote_settings, tmp_path / "a") as a:
        _compute_on(a, prompt)
        namespace = a.manager.tier("remote").store.namespace
    if other == "dtype":  # same geometry and bytes per block, another KV dtype
        other_dir = vh.write_model_config(tmp_path / "bf16", dtype="bfloat16")
        c = _node(other_dir, remote_settings, tmp_path / "c")
    else:
        c = _node(model_dir, remote_settings, tmp_path / "c", hash_seed="another-seed")
    try:
        assert c.manager.tier("remote").store.namespace != namespace
        req_id = c.admit(prompt)  # the same vLLM hashes, another namespace
        assert c.prefix_hits[req_id].external == 0
        assert all(c.kv_matches(req_id))
        assert c.manager.stats.tiers["remote"]["hits"] == 0
        assert c.manager.check("remote").verifier.store.stats().gets_hit == 0
        assert _remote_store(c).stats().gets_hit == 0
        c.settle()
    finally:
        c.shutdown()


def test_lookup_asks_again_while_the_probe_is_in_flight_then_hits(tmp_path, model_dir, rgw_server, remote_settings):
    prompt = _prompt(4)
    keys = _keys(prompt)
    with _node(model_dir, remote_settings, tmp_path / "a") as a:
        _compute_on(a, prompt)
    target = rgw_server.endpoint.removeprefix("http://")
    with FaultProxy(target) as proxy:
        # Probes wait on the proxy, not on a timeout that could run out under a slow machine.
        slow = {**remote_settings, "endpoint": proxy.endpoint, "request_timeout": "120s", "retries": 3}
        with _node(model_dir, slow, tmp_path / "b") as b:
            manager = b.manager
            proxy.set_mode("stall")
            req_id = b.add_request(prompt, max_tokens=3)
            for _ in range(3):
                b.step()
                # The scheduler deferred the request: nothing computed, nothing loaded.
                assert b.scheduler.requests[req_id].num_computed_tokens == 0
                assert not any(r.load_jobs for r in b.steps)
                assert manager.lookup(keys[0], ReqContext(req_id)) is LookupResult.RETRY
                assert manager.has_pending_work()
            assert manager.tier("remote").num_probing() == CHUNKS
            proxy.set_mode("pass")  # the probes are answered (on a retry through the proxy)
            assert manager.tier("remote").wait_probes(WAIT)
            while b.scheduler.requests[req_id].num_output_tokens < 1:
                b.step()
                b.wait_background()
            assert b.prefix_hits[req_id].external == CHUNKS * BLOCK
            assert all(b.kv_matches(req_id))
            assert manager.stats.tiers["remote"]["hits"] == CHUNKS
            b.settle()


def test_server_failing_during_verification_costs_misses_never_a_failed_load(
    tmp_path, model_dir, rgw_server, remote_settings
):
    prompt = _prompt(5)
    with _node(model_dir, remote_settings, tmp_path / "a") as a:
        _compute_on(a, prompt)
    target = rgw_server.endpoint.removeprefix("http://")
    with FaultProxy(target) as proxy:
        with _node(model_dir, {**remote_settings, "endpoint": proxy.endpoint}, tmp_path / "b") as b:
            manager = b.manager
            req_id = b.add_request(prompt, max_tokens=3)
            b.step()  # lookups send the membership probes
            assert manager.tier("remote").wait_probes(WAIT)
            proxy.set_mode("503")  # the chunks are known present; now every request fails
            while b.scheduler.requests[req_id].num_output_tokens < 1:
                b.step()
                b.wait_background()
            assert b.prefix_hits[req_id].external == 0  # recomputed
            assert all(b.kv_matches(req_id))
            assert (
                manager.check("remote").outcomes().get("failed", 0) >= 1
                and "ok" not in manager.check("remote").outcomes()
            )
            assert manager.stats.tiers["remote"]["hits"] == 0
            assert _remote_store(b).stats().gets_hit == 0
            assert not manager._failure_counts  # no worker job failed
            b.settle()  # uploads fail or are dropped; the engine goes on
            assert not b.scheduler.has_requests()


def test_server_down_costs_misses_and_the_engine_goes_on(tmp_path, model_dir, rgw_server, remote_settings):
    target = rgw_server.endpoint.removeprefix("http://")
    with FaultProxy(target) as proxy:
        with _node(model_dir, {**remote_settings, "endpoint": proxy.endpoint}, tmp_path / "b") as b:
            proxy.set_mode("503")
            for seed in (6, 7):
                req_id = b.admit(_prompt(seed))
                assert b.prefix_hits[req_id].external == 0
                assert all(b.kv_matches(req_id))
                b.settle()
            _uploaded(b)
            store = _remote_store(b).stats()
            assert store.puts_stored == 0 and store.puts_failed + store.puts_dropped >= 2 * CHUNKS
            assert REMOTE not in {b.manager.composite.hit_medium(k) for k in _keys(_prompt(6))}


@pytest.mark.parametrize("fault", ["slow", "stalls"])
def test_under_vllm_a_bucket_slower_than_recomputing_is_passed_over_and_used_again_once_it_recovers(
    model_dir, rgw_server, remote_settings, fault
):
    """Our connector (one download per hit, by the worker) in front of a bucket behind a
    proxy that makes every download slower, or leaves every other one unanswered (each
    such load fails after its timeout and is recomputed): the worker's download times,
    failed ones charged what they cost, reach the scheduler's estimate of the tier,
    which decides as for the disk."""

    def prompt(seed: int) -> list[int]:
        return _prompt(seed)[: 2 * BLOCK + 1]

    def serve(h: vh.VllmHarness, prompt: list[int]) -> vh.PrefixHit:
        h.reset_gpu_prefix_cache()
        req_id = h.add_request(prompt)
        h.settle(max_steps=20_000)  # a load whose downloads stall waits out their 1 s timeouts
        _uploaded(h)
        assert h.manager.tier("remote").settle(WAIT)
        return h.prefix_hits[req_id]

    proxy = FaultProxy(rgw_server.endpoint.removeprefix("http://"), mode="count")
    config = {
        **SPEC,
        "cpu_bytes": f"{2 * CHUNK_BYTES}B",  # two chunks: each new prompt evicts the last one
        "block_size": BLOCK,
        # A stalled download fails after 1 s (no retry): charged that second and the recompute.
        "remote": {**remote_settings, "endpoint": proxy.endpoint}
        | ({"request_timeout": "1s", "retries": 0} if fault == "stalls" else {}),
        "promote_on_hit": False,  # every repeat downloads again
        "prefill_tokens_per_s": 100.0,  # a chunk costs 160 ms to recompute
    }
    with proxy, vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real", **vh.ONE_READ) as h:

        def slow_down(on: bool) -> None:
            if fault == "slow":
                proxy.get_delay = 1.0 if on else 0.0
            else:
                proxy.stall_every_other_get = on

        passed_over_while_slow_and_used_again(
            h, "remote", serve, prompt, slow_down, BLOCK, loads_fail=fault == "stalls"
        )
