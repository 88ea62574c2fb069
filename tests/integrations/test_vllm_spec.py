"""``TieredOffloadingSpec`` as vLLM 0.33 loads it: from the files in configs/, through
vLLM's own ``OffloadingSpecFactory`` and connector, and with every kind of bad config
failing at start-up with a message that names the key and what is expected."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: The files in configs/ that select our spec (others, e.g. for vLLM's tiering spec, are
#: tested with that spec).
CONFIG_FILES = [
    p
    for p in sorted((REPO / "configs").glob("*.json"))
    if json.loads(p.read_text())["kv_connector_extra_config"].get("spec_name") == "TieredOffloadingSpec"
]
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


def test_tiered_kv_imports_without_vllm_and_the_integration_says_why_not():
    """Run where ``import vllm`` fails: the package works, the integration explains."""
    code = """
import sys
class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm' (blocked by the test)")
sys.meta_path.insert(0, NoVllm())
import tiered_kv, tiered_kv.config, tiered_kv.tiered.manager
try:
    import tiered_kv.integrations.vllm
except ImportError as e:
    print("IMPORT-ERROR:", e)
else:
    print("NO ERROR")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR: tiered_kv.integrations.vllm needs vLLM 0.33" in out.stdout
    assert "The rest of tiered_kv works without vLLM" in out.stdout


vllm_only = pytest.mark.vllm


def test_configs_has_files_for_our_spec():
    assert len(CONFIG_FILES) >= 3, "configs/ lost its TieredOffloadingSpec files"


def _factory_config(
    extra: dict, *, layers: int, kv_heads_per_rank: int, head_dim: int, world_size: int, tokens_per_block: int = 16
):
    """The ``OffloadingConfig`` vLLM builds for a bf16 Llama-shaped model (rank 0)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    bytes_per_token = 2 * layers * kv_heads_per_rank * head_dim * 2
    chunk_tokens = int(extra.get("block_size", tokens_per_block))
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, names, 0),),
        worker_kv_bytes_per_block=bytes_per_token * tokens_per_block,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="factory-test",
        model=OffloadingModelConfig(extra.get("model_id", "m"), "bfloat16", 131072),
        cache=OffloadingCacheConfig(tokens_per_block, chunk_tokens // tokens_per_block),
        parallel=OffloadingParallelConfig(0, world_size, world_size, 1, 1, 1, 0, 1, None, True),
    )


# configs/README.md: geometry per file, and the CPU blocks per rank its table promises.
_README = {
    "llama-3.1-8b-1xh100.json": (dict(layers=32, kv_heads_per_rank=8, head_dim=128, world_size=1), 32_768),
    "llama-3.1-70b-tp4.json": (dict(layers=80, kv_heads_per_rank=2, head_dim=128, world_size=4), 39_321),
    "qwen2.5-7b-instruct-1m-tp4.json": (dict(layers=28, kv_heads_per_rank=1, head_dim=128, world_size=4), 74_898),
}


@pytest.fixture
def target_machine(monkeypatch):
    """The configs' machines, not this one: memory enough for their cpu_bytes."""
    monkeypatch.setattr("tiered_kv.integrations.vllm.geometry.host_memory_limit", lambda: 2 << 40)


@vllm_only
@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_vllms_factory_loads_our_spec_from_each_config_file(path, tmp_path, target_machine):
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from tiered_kv.integrations.vllm import TieredOffloadingSpec

    extra = json.loads(path.read_text())["kv_connector_extra_config"]
    if "disk_path" in extra:
        extra["disk_path"] = str(tmp_path / "disk")
    geometry, cpu_blocks = _README[path.name]
    assert OffloadingSpecFactory.get_spec_cls(extra) is TieredOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(_factory_config(extra, **geometry))
    assert isinstance(spec, TieredOffloadingSpec)
    assert spec.geometry.num_cpu_slots == cpu_blocks
    assert spec.geometry.fingerprint.tp_size == geometry["world_size"]
    assert spec.geometry.fingerprint.model_id == extra["model_id"]
    assert not (tmp_path / "disk").exists(), "constructing the spec must do no I/O"


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support import vllm_harness as vh

    return vh.write_model_config(tmp_path_factory.mktemp("model"))


@vllm_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_each_config_file_serves_through_vllm_with_its_keys(path, model_dir, tmp_path):
    """Every key of the file goes through vLLM's real scheduler and worker connector; only
    the paths and sizes are scaled to this machine and the test model."""
    from support import vllm_harness as vh

    extra = json.loads(path.read_text())["kv_connector_extra_config"]
    extra.update(disk_path=str(tmp_path / "disk"), cpu_bytes="256KiB", disk_bytes="4MiB")
    tokens = int(extra["block_size"])
    with vh.VllmHarness.build(model_dir, extra, num_gpu_blocks=64, worker="real") as h:
        prompt = _prompt(11, 2 * tokens + 3)
        assert h.serve(prompt).external == 0
        h.reset_gpu_prefix_cache()
        assert h.serve(prompt).external == 2 * tokens
        assert any((tmp_path / "disk").iterdir()), "the disk namespace was not created"


_BAD_CONFIGS = [
    ({"cpu_byte": "1MiB"}, r"unknown config key 'cpu_byte'; did you mean 'cpu_bytes'\?"),
    ({"cpu_bytes": "64 gigs"}, r"cpu_bytes: cannot parse size '64 gigs'.*e\.g\. '64GiB'"),
    ({"cpu_bytes": "100B"}, r"cpu_bytes: 100 B per rank holds no chunk; one chunk is 4\.00 KiB"),
    ({"cpu_bytes": 64}, r"cpu_bytes: 64 has no unit, so it would mean 64 bytes.*'64B' if you mean bytes"),
    ({"cpu_bytes": "8GiB", "disk_bytes": "1TiB"}, r"disk_bytes: set without disk_path"),
    ({"cpu_bytes": "64TiB"}, r"cpu_bytes: 64(\.00)? TiB per rank is more than this process may use"),
    ({"remote": {"bucket": "kv-b", "request_timeout": 1e309}}, r"remote\.request_timeout: duration must be at most"),
    ({"disk_path": "DISK", "disk_bytes": "1TB!"}, r"disk_bytes: cannot parse size '1TB!'"),
    ({"disk_path": "DISK", "disk_bytes": "1000B"}, r"disk_bytes: 1000 B per rank holds no chunk"),
    ({"write_policy": "sometimes"}, r"write_policy: expected one of write_through, write_back; got 'sometimes'"),
    ({"promote_on_hit": "maybe"}, r"promote_on_hit: expected true or false, got 'maybe'"),
    ({"io_backend": "gds"}, r"io_backend: expected one of auto, kvikio, posix; got 'gds'"),
    ({"eviction_policy": "mru"}, r"eviction_policy: expected one of lru, arc; got 'mru'"),
    ({"disk_eviction_policy": "arc"}, r"disk_eviction_policy: the disk tier evicts in LRU order only"),
    ({"checksum": "md5"}, r"checksum: expected one of xxh3_64, crc32c; got 'md5'"),
    ({"io_threads": 0}, r"io_threads: expected an integer from 1 to 256, got 0"),
    ({"io_threads": 20000}, r"io_threads: expected an integer from 1 to 256, got 20000"),
    ({"max_pending_disk_writes": "many"}, r"max_pending_disk_writes: expected a positive integer"),
    ({"cpu_bytes_to_use": 1 << 20}, r"cpu_bytes_to_use: not a TieredOffloadingSpec key.*takes cpu_bytes per TP rank"),
    ({"secondary_tiers": []}, r"secondary_tiers: not a TieredOffloadingSpec key.*use disk_path and disk_bytes"),
    ({"offload_prompt_only": "false"}, r"offload_prompt_only: expected true or false \(a JSON boolean\), got 'false'"),
    ({"canonical_layout": True}, r"canonical_layout: not supported by TieredOffloadingSpec"),
    ({"sync_load_budget_bytes": "1GiB"}, r"sync_load_budget_bytes: expected a byte count >= 0"),
    (
        {"hash_algorithm": "xxhash"},
        r"hash_algorithm: 'xxhash' does not match vLLM's --prefix-caching-hash-algo 'sha256'",
    ),
    ({"disk_path": "FILE"}, r"disk_path .* exists and is not a directory"),
]


@vllm_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "bad,message", _BAD_CONFIGS, ids=[next(iter(b)) + "=" + str(list(b.values())[-1]) for b, _ in _BAD_CONFIGS]
)
def test_a_bad_config_fails_vllm_start_up_naming_the_key(bad, message, model_dir, tmp_path):
    from support import vllm_harness as vh

    from tiered_kv.config import ConfigError
    from tiered_kv.disk.format.namespace import NamespaceError

    (tmp_path / "FILE").write_text("not a directory")
    bad = {k: str(tmp_path / v) if k == "disk_path" else v for k, v in bad.items()}
    extra = {**SPEC, "cpu_bytes": "1MiB", **bad}
    with pytest.raises((ConfigError, NamespaceError), match=message):
        h = vh.VllmHarness.build(model_dir, extra, worker="real")
        h.shutdown()


def _readme_serve_example() -> dict:
    text = (REPO / "README.md").read_text()
    start = text.index("--kv-transfer-config '") + len("--kv-transfer-config '")
    return json.loads(text[start : text.index("'", start)])


@vllm_only
def test_the_readme_vllm_serve_example_is_a_valid_config(tmp_path, target_machine):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from tiered_kv.config_file import CONNECTOR
    from tiered_kv.config import TieredConfig, VLLM_PASSTHROUGH_KEYS

    config = _readme_serve_example()
    # The connector settings `tiered-kv config` prints, naming our subclass of vLLM's connector.
    assert {k: v for k, v in config.items() if k != "kv_connector_extra_config"} == CONNECTOR
    connector = getattr(importlib.import_module(config["kv_connector_module_path"]), config["kv_connector"])
    assert issubclass(connector, OffloadingConnector)
    extra = config["kv_connector_extra_config"]
    # Every key of the example is one the README's tables document.
    readme = (REPO / "README.md").read_text()
    for key in extra:
        assert f"`{key}`" in readme, f"README does not document {key}"
    for key in (*TieredConfig.keys(), *VLLM_PASSTHROUGH_KEYS):
        assert f"`{key}`" in readme, f"README does not document {key}"
    extra["disk_path"] = str(tmp_path / "disk")
    spec = OffloadingSpecFactory.create_spec(
        _factory_config(extra, layers=32, kv_heads_per_rank=8, head_dim=128, world_size=1)
    )
    assert spec.geometry.num_cpu_slots == 32_768
    assert spec.tiered_config.write_policy == "write_through" and spec.tiered_config.promote_on_hit
