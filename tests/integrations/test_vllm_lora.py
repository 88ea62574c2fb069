"""LoRA requests under vLLM's real scheduler and worker: vLLM keys an adapter's blocks by
its name and path, not its weights, and the disk and shared tiers outlive a restart that
replaces the files at that path. ``TieredOffloadingConnector`` sees each request's
adapter and no tier keeps or serves its KV (vLLM's GPU prefix cache still does, as it
lives no longer than the adapter it loaded); a spec that cannot tell LoRA requests
apart (under vLLM's own connector, or ``TieredDiskTier``) refuses an engine serving LoRA.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from test_vllm_tiers import BLOCK, GPU_BLOCK_BYTES, SPEC, _durable, _prompt, _serve  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

from tiered_kv.config import ConfigError  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _config(disk) -> dict:
    return {
        **SPEC,
        "cpu_bytes": f"{4 * GPU_BLOCK_BYTES}B",
        "block_size": BLOCK,
        "disk_path": str(disk),
        "disk_bytes": f"{64 * 4096}B",
    }


def _serve_lora(h: vh.VllmHarness, prompt: list[int], lora: LoRARequest) -> int:
    """Serve ``prompt`` under ``lora``; the tokens a tier gave it."""
    req_id = h.add_request(prompt, lora_request=lora)
    h.settle()
    return h.prefix_hits[req_id].external


def test_no_tier_keeps_or_serves_a_lora_requests_kv_with_our_connector(model_dir, tmp_path):
    lora = LoRARequest("sql-expert", 1, str(tmp_path / "adapters" / "sql-expert"))
    prompt = _prompt(5, 3 * BLOCK + 2)
    with vh.VllmHarness.build(
        model_dir, _config(tmp_path / "disk"), num_gpu_blocks=64, worker="real", **vh.ONE_READ
    ) as h:
        assert _serve_lora(h, prompt, lora) == 0
        _durable(h)
        composite = h.manager.composite
        assert composite.cpu.num_slots == composite.cpu.num_free_slots(), "a LoRA request's chunks were stored"
        assert composite.tier("disk").num_free_slots() == composite.tier("disk").capacity
        h.reset_gpu_prefix_cache()
        assert _serve_lora(h, prompt, lora) == 0
        # The same prompt without the adapter is offloaded as ever.
        assert _serve(h, prompt).external == 0
        _durable(h)
        assert composite.cpu.num_free_slots() < composite.cpu.num_slots


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
