"""One read per disk hit: ``TieredOffloadingConnector`` with vLLM's recompute policy.

With vLLM's own ``OffloadingConnector`` a failed load is fatal, so the scheduler reads
every rank's bytes of a disk chunk back and checks them before calling it a hit
(HIT_PENDING for at least one step), and each worker reads them again. With our
connector and ``kv_load_failure_policy: recompute`` a chunk the index holds on every
rank is a hit at once; each worker's read is the only one, verified against the
checksum before a byte is used, and a chunk that fails there is recomputed. Every read
that reaches a disk store (the scheduler's verifier and the worker's own) is counted at
``DiskStore.begin_read``; vLLM's real scheduler and worker connector drive the tier.
"""

from __future__ import annotations


import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from test_vllm_tiers import BLOCK, GPU_BLOCK_BYTES, SPEC, _corrupt, _durable, _keys, _prompt, _serve, _zero_gpu  # noqa: E402

from tiered_kv.integrations.vllm.connector import TieredOffloadingConnector  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

CHUNKS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _build(model_dir, disk, **vllm) -> vh.VllmHarness:
    """A CPU tier of ``CHUNKS`` chunks over a disk tier; ``vllm``: the connector settings."""
    config = {**SPEC, "cpu_bytes": f"{CHUNKS * GPU_BLOCK_BYTES}B", "block_size": BLOCK}
    config.update(disk_path=str(disk), disk_bytes=f"{64 * 4096}B")
    return vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real", **vllm)


def _on_disk_only(h: vh.VllmHarness, seed: int) -> list[int]:
    """A prompt of ``CHUNKS`` chunks stored, then pushed out of the CPU tier by another."""
    prompt, other = _prompt(seed, CHUNKS * BLOCK + 1), _prompt(seed + 100, CHUNKS * BLOCK + 1)
    _serve(h, prompt)
    _durable(h)
    _serve(h, other)
    _durable(h)
    composite = h.manager.composite
    assert not any(composite.cpu.is_loadable(k) for k in _keys(prompt))
    assert all(composite.tier("disk").is_loadable(k) for k in _keys(prompt))
    h.reset_gpu_prefix_cache()
    _zero_gpu(h)
    return prompt


@pytest.mark.parametrize("connector", ["ours", "vllm"])
def test_each_disk_hit_is_read_once_by_the_worker_with_our_connector(model_dir, tmp_path, disk_reads, connector):
    extra = vh.ONE_READ if connector == "ours" else {}
    with _build(model_dir, tmp_path / "disk", **extra) as h:
        assert isinstance(h.worker_connector, TieredOffloadingConnector) == (connector == "ours")
        prompt = _on_disk_only(h, 1)
        keys = _keys(prompt)
        disk_reads.clear()
        start = len(h.steps)
        req_id = h.admit(prompt)
        assert h.prefix_hits[req_id].external == CHUNKS * BLOCK
        assert all(h.kv_matches(req_id))  # every byte as computed
        h.settle()
        per_chunk = [disk_reads[k] for k in keys]
        first_load = min(i for i, r in enumerate(h.steps[start:]) if req_id in r.load_jobs.values())
        if connector == "ours":
            assert per_chunk == [1] * CHUNKS, disk_reads  # one read per rank (TP 1) per hit: the worker's
            assert h.manager.check("disk").outcomes() == {}  # no verifying read in the scheduler
            assert first_load == 0  # promised at once: no step deferred for a verification
        else:
            assert per_chunk == [2] * CHUNKS, disk_reads  # the scheduler's verification, then the worker's
            assert h.manager.check("disk").outcomes()["ok"] == CHUNKS
            assert first_load >= 1


def test_a_chunk_that_fails_at_the_worker_is_recomputed_never_served(model_dir, tmp_path):
    with _build(model_dir, tmp_path / "disk", **vh.ONE_READ) as h:
        prompt = _on_disk_only(h, 2)
        _corrupt(h, _keys(prompt)[1])  # the second chunk, after the index recorded it
        req_id = h.admit(prompt)
        # Promised whole (no read in the scheduler); the worker's read of the second chunk
        # fails its checksum and vLLM recomputes from there: every GPU block is right.
        assert h.prefix_hits[req_id].external == CHUNKS * BLOCK
        matches = h.kv_matches(req_id)
        assert len(matches) == CHUNKS and all(matches), matches
        h.settle()
        worker = h.worker_spec._worker
        assert worker.take_failed_gpu_blocks() == set()  # handed to vLLM already
        assert h.manager.composite.tier("disk").stats.checksum_failures == 1
        # The engine goes on, and the chunk is offloaded again.
        h.reset_gpu_prefix_cache()
        assert _serve(h, prompt).external == CHUNKS * BLOCK


def test_a_cpu_lead_that_landed_is_kept_when_the_disk_read_after_it_fails(model_dir, tmp_path):
    """A prompt whose first chunk is in CPU and the rest on disk, the last disk chunk
    corrupted: the load's CPU part lands, its disk part fails its checksum, and the
    worker reports to vLLM only the GPU blocks of the disk part, which vLLM recomputes
    from its first; the CPU lead is not computed again. Every GPU block is right."""
    with _build(model_dir, tmp_path / "disk", **vh.ONE_READ) as h:
        prompt = _on_disk_only(h, 3)
        keys = _keys(prompt)
        assert _serve(h, prompt[: BLOCK + 1]).external == BLOCK  # chunk 0 promoted into CPU
        composite = h.manager.composite
        assert composite.cpu.is_loadable(keys[0]) and not any(composite.cpu.is_loadable(k) for k in keys[1:])
        h.reset_gpu_prefix_cache()
        _zero_gpu(h)
        _corrupt(h, keys[-1])
        worker = h.worker_spec._worker
        reported: list[set[int]] = []
        take = worker.take_failed_gpu_blocks
        worker.take_failed_gpu_blocks = lambda: reported.append(take()) or reported[-1]
        req_id = h.admit(prompt)
        assert h.prefix_hits[req_id].external == CHUNKS * BLOCK
        matches = h.kv_matches(req_id)
        assert len(matches) == CHUNKS and all(matches), matches
        h.settle()
        failed = set().union(*reported)
        assert len(failed) == (CHUNKS - 1) * worker.factor  # the disk part's blocks, not the CPU lead's
        assert composite.tier("disk").stats.checksum_failures == 1
