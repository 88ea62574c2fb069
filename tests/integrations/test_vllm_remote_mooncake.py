"""The Mooncake backend of the shared tier under vLLM 0.33: ``TieredOffloadingSpec`` in the
real scheduler and worker connector (tests/support/vllm_harness.py, ``worker="real"``, CPU tensors),
against a real Mooncake Store (tests/support/mooncake_server.py). Two harnesses with their own cache
directories stand for two nodes sharing the pool: the second loads what the first computed,
byte for byte; with the master restarted in between, it computes again and never fails a load.
"""

from __future__ import annotations


import pytest
from support.mooncake_server import skip_module_without_mooncake

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)
skip_module_without_mooncake()

from support import vllm_harness as vh  # noqa: E402

from tiered_kv.integrations.vllm.manager import TieredVllmManager  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16
CHUNK_BYTES = 4096
CHUNKS = 5
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}
WAIT = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _prompt(seed: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(CHUNKS * BLOCK + 3)]


def _node(model_dir, remote: dict, cache_dir) -> vh.VllmHarness:
    config = {
        **SPEC,
        "cpu_bytes": f"{16 * CHUNK_BYTES}B",
        "block_size": BLOCK,
        "remote": remote,
        "disk_path": str(cache_dir),
        "disk_bytes": f"{64 * 4096}B",
    }
    h = vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real")
    assert isinstance(h.manager, TieredVllmManager) and h.manager.tier("remote") is not None
    return h


def _worker(h: vh.VllmHarness):
    return h.worker_spec._worker


def _remote_store(h: vh.VllmHarness):
    """The worker's own store of the shared tier."""
    return _worker(h).hierarchy.lower_tiers[-1].store


def _compute_on(h: vh.VllmHarness, prompt: list[int]) -> list[bytes]:
    req_id = h.admit(prompt)
    assert h.prefix_hits[req_id].external == 0 and all(h.kv_matches(req_id))
    computed = [h.gpu_block_bytes(b) for b in h.block_ids(req_id)[:CHUNKS]]
    h.settle()
    _worker(h).hierarchy.lower_tiers[-1].stager.drain()
    return computed


def test_node_b_loads_what_node_a_computed_through_mooncake_byte_exact(tmp_path, model_dir, mooncake_server):
    settings = mooncake_server.settings()
    prompt = _prompt(1)
    with _node(model_dir, settings, tmp_path / "a") as a:
        computed = _compute_on(a, prompt)
        assert a.manager.tier("remote").settle(WAIT) and a.manager.tier("remote").counters["confirmed"] == CHUNKS
    with _node(model_dir, settings, tmp_path / "b") as b:
        req_id = b.admit(prompt)
        assert b.prefix_hits[req_id].external == CHUNKS * BLOCK
        assert [b.gpu_block_bytes(i) for i in b.block_ids(req_id)[:CHUNKS]] == computed
        assert all(b.kv_matches(req_id))
        assert b.manager.stats.tiers["remote"]["hits"] == CHUNKS
        assert _remote_store(b).stats().gets_hit == CHUNKS
        assert b.manager.check("remote").verifier.store.stats().gets_hit == CHUNKS  # verified before the hit
        b.settle()
        assert b.manager.check("remote").outcomes() == {"ok": CHUNKS}


def test_master_restart_between_nodes_costs_a_recompute_never_a_failed_load(tmp_path, model_dir, mooncake_server):
    settings = mooncake_server.settings()
    prompt = _prompt(2)
    with _node(model_dir, settings, tmp_path / "a") as a:
        _compute_on(a, prompt)
    mooncake_server.kill_master()
    mooncake_server.start_master()
    mooncake_server.wait_writable()
    with _node(model_dir, settings, tmp_path / "b") as b:
        req_id = b.admit(prompt)
        assert b.prefix_hits[req_id].external == 0  # the pool lost everything: computed again
        assert all(b.kv_matches(req_id))
        assert b.manager.stats.tiers["remote"]["hits"] == 0
        assert not b.manager._failure_counts
        b.settle()
        # The restarted pool takes this node's chunks, and serves them.
        _worker(b).hierarchy.lower_tiers[-1].stager.drain()
        assert b.manager.tier("remote").settle(WAIT) and b.manager.tier("remote").counters["confirmed"] == CHUNKS
