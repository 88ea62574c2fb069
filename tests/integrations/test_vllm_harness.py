"""vLLM 0.33's own CPU offloading driven through its real scheduler on CPU.

Proves the harness (tests/support/vllm_harness.py) that the integration tests reuse: a request's
blocks are stored through the OffloadingConnector, a second request with the same
prefix is served from the offloading tier after the GPU prefix cache is dropped, and
(with a byte-moving worker) the loaded GPU blocks hold exactly the stored bytes.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

import torch  # noqa: E402
from support import vllm_harness as vh  # noqa: E402
from vllm.v1.kv_offload.base import TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16  # GPU block size in tokens
# 2 layers x 2 KV heads x 16 tokens x (16 + 16) dims x 2 bytes: one GPU block, all layers.
GPU_BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _cpu_spec_config(num_chunks: int, page_bytes: int, **extra) -> dict:
    # CPUOffloadingSpec sizes its pool as cpu_bytes_to_use // (bytes per chunk rounded
    # up to a 4 KiB page), so this gives exactly num_chunks chunks.
    chunk = -(-page_bytes // 4096) * 4096
    return {"cpu_bytes_to_use": num_chunks * chunk, **extra}


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def test_cpu_spec_stores_then_serves_a_prefix_from_the_cpu_tier(model_dir):
    with vh.VllmHarness.build(model_dir, _cpu_spec_config(16, GPU_BLOCK_BYTES), num_gpu_blocks=32) as h:
        assert isinstance(h.manager, CPUOffloadingManager)
        prompt = _prompt(1, 5 * BLOCK + 3)

        first = h.serve(prompt)
        assert first == vh.PrefixHit(num_prompt_tokens=len(prompt), local=0, external=0)
        stores = [r for r in h.steps if r.store_jobs]
        assert stores, "the five full prompt blocks were never offered to the manager"

        h.reset_gpu_prefix_cache()
        second = h.serve(prompt)
        # All five full blocks come back from the CPU tier; the tail is recomputed.
        assert second.external == 5 * BLOCK and second.local == 0
        loads = [r for r in h.steps if r.load_jobs]
        assert len(loads) == 1

        # A prompt that shares only the first two blocks hits only those.
        h.reset_gpu_prefix_cache()
        other = prompt[: 2 * BLOCK] + _prompt(2, 3 * BLOCK)
        assert h.serve(other).external == 2 * BLOCK


def test_cpu_spec_evicts_lru_chunks_when_the_pool_is_full(model_dir):
    with vh.VllmHarness.build(model_dir, _cpu_spec_config(4, GPU_BLOCK_BYTES), num_gpu_blocks=32) as h:
        a, b = _prompt(3, 2 * BLOCK + 1), _prompt(4, 2 * BLOCK + 1)
        h.serve(a)
        h.serve(b)  # the pool (4 chunks) now holds a's 2 blocks and b's 2 blocks
        c = _prompt(5, 2 * BLOCK + 1)
        h.serve(c)  # needs 2 chunks: the least recently used (a's) go
        h.reset_gpu_prefix_cache()
        assert h.serve(a).external == 0
        h.reset_gpu_prefix_cache()
        assert h.serve(c).external == 2 * BLOCK


def test_hash_blocks_are_the_hashes_the_scheduler_uses(model_dir):
    with vh.VllmHarness.build(model_dir, _cpu_spec_config(4, GPU_BLOCK_BYTES)) as h:
        prompt = _prompt(6, 3 * BLOCK + 5)
        req_id = h.add_request(prompt)
        request = h.scheduler.requests[req_id]
        assert [bytes(x) for x in request.block_hashes] == vh.hash_blocks(prompt, BLOCK)
        assert len(vh.hash_blocks(prompt, BLOCK)) == 3
        h.run()


def test_stats_flow_through_vllms_prometheus_side(model_dir):
    with vh.VllmHarness.build(model_dir, _cpu_spec_config(8, GPU_BLOCK_BYTES), num_gpu_blocks=32) as h:
        h.serve(_prompt(7, 3 * BLOCK + 1))
        h.reset_gpu_prefix_cache()
        h.serve(_prompt(7, 3 * BLOCK + 1))
        stats = h.stats()
        assert "vllm:kv_offload_cpu_cache_usage_perc" in stats
        assert stats["vllm:kv_offload_lookup_sync_delay_seconds_count"] >= 2
        registry = h.publish_metrics()
        # the static facts the CPU manager reports once, as the config info series
        info = registry.get_sample_value(
            "vllm:kv_offload_config_info",
            {
                "engine": "0",
                "cpu_num_chunks": "8",
                "cpu_blocks_per_chunk": "1",
                "cpu_kv_cache_size_bytes": str(8 * GPU_BLOCK_BYTES),
                "cpu_kv_cache_size_tokens": str(8 * 2048 // 128),
            },
        )
        assert info == 1.0
        assert registry.get_sample_value("vllm:kv_offload_lookup_sync_delay_seconds_count", {"engine": "0"}) >= 2


class HostWorker(vh.ChunkCopyWorker):
    """Copies bytes synchronously between the CPU "GPU" tensors and a host pool (vLLM's
    own worker needs CUDA). Chunk c of canonical tensor t is row c of host[t]; GPU block
    j of a chunk sits at byte offset j * page in that row."""

    def __init__(self, kv_caches, blocks_per_chunk: int, num_chunks: int):
        self.gpu = [t.tensor for t in kv_caches.tensors]
        self.page = [t.page_size_bytes for t in kv_caches.tensors]
        self.bpc = blocks_per_chunk
        self.host = self.rows = [torch.zeros((num_chunks, p * blocks_per_chunk), dtype=torch.int8) for p in self.page]
        self.done: list[TransferResult] = []


class HostWorkerCPUSpec(CPUOffloadingSpec):
    """vLLM's CPUOffloadingSpec (its real manager) with the byte-moving HostWorker."""

    def get_worker(self, kv_caches):
        return HostWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)


@pytest.mark.parametrize("offloaded_block", [BLOCK, 2 * BLOCK], ids=["f1", "f2"])
def test_real_worker_loads_back_the_stored_bytes(model_dir, offloaded_block):
    extra = _cpu_spec_config(
        16,
        GPU_BLOCK_BYTES * offloaded_block // BLOCK,
        spec_name="HostWorkerCPUSpec",
        spec_module_path=__name__,
        block_size=offloaded_block,
    )
    with vh.VllmHarness.build(model_dir, extra, num_gpu_blocks=32, worker="real") as h:
        assert type(h.worker_spec).__name__ == "HostWorkerCPUSpec"
        prompt = _prompt(8, 4 * BLOCK + 2)
        h.serve(prompt)
        h.reset_gpu_prefix_cache()
        # Zero every GPU block so only a real load can restore the prefix's bytes.
        for t in h.kv_caches.values():
            t.zero_()
        req_id = h.add_request(prompt, max_tokens=3)
        for _ in range(10):  # until the first token: the load has landed, blocks held
            h.step()
            if h.scheduler.requests[req_id].num_output_tokens >= 1:
                break
        assert h.prefix_hits[req_id].external == 4 * BLOCK
        matches = h.kv_matches(req_id)
        assert len(matches) == 4 and all(matches), matches
        h.run()


def test_tiering_spec_promotes_from_an_out_of_tree_secondary_tier(model_dir):
    """vLLM's TieringOffloadingSpec loads a secondary tier named by class + module_path,
    cascades stores to it, and serves a block evicted from the CPU primary by promoting
    it: the first lookup defers the request (no load that step), the load follows."""
    from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 2 * GPU_BLOCK_BYTES,  # a primary of two chunks
        "secondary_tiers": [
            {"type": "ExampleSecondaryTierManager", "module_path": "vllm.v1.kv_offload.tiering.example.manager"}
        ],
    }
    with vh.VllmHarness.build(model_dir, extra, num_gpu_blocks=32) as h:
        assert isinstance(h.manager, TieringOffloadingManager)
        (tier,) = h.manager.secondary_tiers
        assert isinstance(tier, ExampleSecondaryTierManager)
        a, b = _prompt(9, 2 * BLOCK + 1), _prompt(10, 2 * BLOCK + 1)
        h.serve(a)
        h.serve(b)  # evicts a's two chunks from the primary; the secondary keeps them
        h.reset_gpu_prefix_cache()
        req_id = h.add_request(a)
        records = h.run()
        load_steps = [i for i, r in enumerate(records) if req_id in r.load_jobs.values()]
        assert load_steps and load_steps[0] >= 1, "a promotion must defer the first lookup"
        assert h.prefix_hits[req_id].external == 2 * BLOCK
