"""LoRA requests under vLLM's real scheduler and worker: vLLM keys an adapter's blocks by
its name and path, not its weights, and the disk and shared tiers outlive a process (and
are read by others) whose adapter files at that path may differ. ``TieredOffloadingConnector``
sees each request's adapter: the CPU tier alone keeps and serves its KV (it lives no
longer than the adapter this process loaded, as vLLM's GPU prefix cache), never a lower
tier, neither written nor read. A spec that cannot tell LoRA requests apart (under vLLM's
own connector, or ``TieredDiskTier``) refuses an engine serving LoRA.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from test_vllm_tiers import BLOCK, GPU_BLOCK_BYTES, SPEC, _durable, _prompt, _serve, _zero_gpu  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from tiered_kv.config import ConfigError  # noqa: E402
from tiered_kv.integrations.vllm import connector as connector_module  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _config(disk, **extra) -> dict:
    return {
        **SPEC,
        "cpu_bytes": f"{4 * GPU_BLOCK_BYTES}B",
        "block_size": BLOCK,
        "disk_path": str(disk),
        "disk_bytes": f"{64 * 4096}B",
        **extra,
    }


def _build(model_dir, disk, **extra) -> vh.VllmHarness:
    return vh.VllmHarness.build(model_dir, _config(disk, **extra), num_gpu_blocks=64, worker="real", **vh.ONE_READ)


def _serve_lora(h: vh.VllmHarness, prompt: list[int], lora: LoRARequest) -> int:
    """Serve ``prompt`` under ``lora``; the tokens a tier gave it."""
    req_id = h.add_request(prompt, lora_request=lora)
    h.settle()
    return h.prefix_hits[req_id].external


def _on_disk(h: vh.VllmHarness, keys) -> list:
    disk = h.manager.composite.tier("disk")
    return [k for k in keys if disk.is_loadable(k) or disk.is_pending(k)]


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_the_cpu_tier_alone_keeps_and_serves_a_lora_requests_kv(model_dir, tmp_path, write_policy):
    lora = LoRARequest("sql-expert", 1, str(tmp_path / "adapters" / "sql-expert"))
    prompt = _prompt(5, 3 * BLOCK + 2)
    with _build(model_dir, tmp_path / "disk", write_policy=write_policy) as h:
        composite = h.manager.composite
        disk = composite.tier("disk")
        assert _serve_lora(h, prompt, lora) == 0
        _durable(h)
        lora_keys = list(composite.cpu.iter_evictable())
        assert len(lora_keys) == 3, "the LoRA request's three full chunks are in the CPU tier"
        assert disk.num_free_slots() == disk.capacity and not _on_disk(h, lora_keys)
        # Served from CPU, with the bytes its own forward pass computed.
        h.reset_gpu_prefix_cache()
        _zero_gpu(h)
        req_id = h.admit(prompt, lora_request=lora)
        assert h.prefix_hits[req_id].external == 3 * BLOCK
        assert all(h.kv_matches(req_id))
        h.settle()
        # Other requests push the LoRA chunks out of CPU (write_back spills its victims):
        # they leave the hierarchy, and the others' chunks reach the disk as ever.
        for seed in range(6, 9):
            assert _serve(h, _prompt(seed, 3 * BLOCK + 2)).external == 0
        _durable(h)
        assert not any(composite.cpu.is_loadable(k) for k in lora_keys)
        assert not _on_disk(h, lora_keys), "a LoRA request's chunk was written to the disk tier"
        assert disk.capacity - disk.num_free_slots() >= 3
        assert composite.admission._cpu_only == set(), "the held chunks left CPU and are forgotten"
        h.reset_gpu_prefix_cache()
        assert _serve_lora(h, prompt, lora) == 0
        # The same prompt without the adapter has keys of its own, offloaded as ever.
        h.reset_gpu_prefix_cache()
        assert _serve(h, prompt).external == 0
        _durable(h)
        h.reset_gpu_prefix_cache()
        assert _serve(h, prompt).external == 3 * BLOCK


def test_a_lora_chunk_another_writer_left_on_disk_is_never_read(model_dir, tmp_path, monkeypatch):
    """A disk tier shared with a process that wrote LoRA chunks down (one that did not mark
    them, standing in for an adapter of other weights at the same name and path): a LoRA
    request never reads them, while the plain chunks of that disk are served."""
    lora = LoRARequest("sql-expert", 1, str(tmp_path / "adapters" / "sql-expert"))
    prompt, plain = _prompt(5, 3 * BLOCK + 2), _prompt(9, 3 * BLOCK + 2)

    @dataclasses.dataclass(frozen=True)
    class Unmarked:
        adapter: str

    with monkeypatch.context() as m:
        m.setattr(connector_module, "CpuOnly", Unmarked)
        with _build(model_dir, tmp_path / "disk") as h:
            assert _serve_lora(h, prompt, lora) == 0
            lora_keys = list(h.manager.composite.cpu.iter_evictable())
            assert _serve(h, plain).external == 0
            _durable(h)
            assert len(_on_disk(h, lora_keys)) == 3
    with _build(model_dir, tmp_path / "disk") as h:
        assert len(_on_disk(h, lora_keys)) == 3
        assert _serve_lora(h, prompt, lora) == 0
        assert _serve(h, plain).external == 3 * BLOCK
        assert h.manager.composite.stats.tiers["disk"]["hits"] == 3


def test_a_waiting_lora_request_moves_nothing_into_cpu_where_a_plain_one_does(model_dir, tmp_path, monkeypatch):
    """Prefetch under ``TieredPrefetchingConnector``, while requests wait behind a running
    one: a plain request's disk chunks move into CPU; a LoRA request's chunks that an
    unmarked writer left on that disk stay where they are, whether it only waits or also
    carries ``kv.prefetch``, and it is served from none of them."""
    from test_vllm_hints import CHUNKS, _action, _add, _envelope
    from test_vllm_hints import _build as build_prefetching

    lora = LoRARequest("sql-expert", 1, str(tmp_path / "adapters" / "sql-expert"))
    prompt, plain = _prompt(5, CHUNKS * BLOCK), _prompt(9, CHUNKS * BLOCK)

    @dataclasses.dataclass(frozen=True)
    class Unmarked:
        adapter: str

    with monkeypatch.context() as m:
        m.setattr(connector_module, "CpuOnly", Unmarked)
        with build_prefetching(model_dir, disk=tmp_path / "disk") as h:
            _add(h, prompt, lora=lora)
            h.settle()
            lora_keys = list(h.manager.composite.cpu.iter_evictable())
            _add(h, plain)
            h.settle()
            plain_keys = [k for k in h.manager.composite.cpu.iter_evictable() if k not in lora_keys]
            _durable(h)
            assert len(lora_keys) == len(plain_keys) == CHUNKS and len(_on_disk(h, lora_keys + plain_keys)) == 8
    with build_prefetching(model_dir, disk=tmp_path / "disk", max_num_seqs=1) as h:
        cpu = h.manager.composite.cpu
        runner = _add(h, _prompt(10, 40), max_tokens=30)
        h.step()
        hinted = _add(h, prompt + _prompt(11, 9), hints=_envelope(_action("kv.prefetch", {})), lora=lora)
        waiting = _add(h, prompt + _prompt(12, 9), lora=lora)
        other = _add(h, plain + _prompt(13, 9))
        h.step_until(lambda: all(cpu.is_loadable(k) for k in plain_keys))
        assert h.scheduler.requests[runner].status == RequestStatus.RUNNING
        assert not any(cpu.is_loadable(k) for k in lora_keys)
        assert h.manager.hints.snapshot()["prefetch"]["disk.prefetches"] == CHUNKS
        h.settle()
        assert h.prefix_hits[hinted].external == h.prefix_hits[waiting].external == 0
        assert h.prefix_hits[other].external == CHUNKS * BLOCK
        assert h.manager.composite.stats.tiers["disk"]["hits"] == 0  # the plain prefix came from CPU


@pytest.mark.parametrize("where", ["vLLM's connector", "TieredDiskTier"])
def test_a_spec_that_cannot_tell_lora_requests_apart_refuses_an_engine_serving_lora(model_dir, tmp_path, where):
    from vllm.config import LoRAConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    if where == "TieredDiskTier":
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 20,
            "secondary_tiers": [
                {
                    "type": "TieredDiskTier",
                    "module_path": "tiered_kv.integrations.vllm.secondary_tier",
                    "disk_path": str(tmp_path / "d"),
                    "disk_bytes": "4MiB",
                }
            ],
        }
        config = vh.make_vllm_config(model_dir, extra, **vh.ONE_READ)
    else:
        config = vh.make_vllm_config(model_dir, _config(tmp_path / "disk"))
    config.lora_config = LoRAConfig(max_lora_rank=8)
    with pytest.raises(ConfigError, match="cannot tell LoRA requests' KV from the base model's"):
        OffloadingConnector(config, KVConnectorRole.SCHEDULER, vh.make_kv_cache_config(config, 64))


def test_a_cpu_tier_alone_under_vllms_connector_serves_an_engine_serving_lora(model_dir):
    """No tier of it outlives the process: LoRA requests' KV is as safe there as in
    vLLM's GPU prefix cache, and the engine starts."""
    from vllm.config import LoRAConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    config = vh.make_vllm_config(model_dir, {**SPEC, "cpu_bytes": f"{4 * GPU_BLOCK_BYTES}B", "block_size": BLOCK})
    config.lora_config = LoRAConfig(max_lora_rank=8)
    connector = OffloadingConnector(config, KVConnectorRole.SCHEDULER, vh.make_kv_cache_config(config, 64))
    assert connector.connector_scheduler.manager.composite.lower == []
