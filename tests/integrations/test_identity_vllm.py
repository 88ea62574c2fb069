"""Under vLLM the disk namespace covers what vLLM knows about the model: ``--revision``
(over the config's ``model_revision``), the weights digest of the directory it loads,
the model's dtype, quantization, code revision and tokenizer. The scheduler process,
which vLLM builds without a current config, arrives at the same namespace as the
workers. Marked ``vllm``."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.vllm

SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


@pytest.fixture
def model_dir(tmp_path):
    from support import vllm_harness as vh

    return vh.write_model_config(tmp_path / "model")


def _extra(tmp_path, **more):
    return {**SPEC, "cpu_bytes": "1MiB", "disk_path": str(tmp_path / "disk"), "disk_bytes": "4MiB", **more}


def _namespace(model_dir, extra, **model_kwargs):
    """The fingerprint the worker computes and the namespace the scheduler opened."""
    from support import vllm_harness as vh

    h = vh.VllmHarness.build(model_dir, extra, worker="real", model_kwargs=model_kwargs)
    try:
        fp = h.worker_spec.geometry.fingerprint
        assert h.manager.composite.tier("disk").namespace.path.name == fp.namespace_id
        return fp
    finally:
        h.shutdown()


@pytest.mark.timeout(300)
def test_vllms_revision_separates_namespaces(model_dir, tmp_path):
    from tiered_kv.model_identity import weights_digest

    extra = _extra(tmp_path)
    v1 = _namespace(model_dir, extra, revision="v1")
    v2 = _namespace(model_dir, extra, revision="v2")
    again = _namespace(model_dir, extra, revision="v1")
    assert v1.namespace_id != v2.namespace_id and again.namespace_id == v1.namespace_id
    assert (v1.model_revision, v2.model_revision) == ("v1", "v2")
    assert v1.differences(v2) == ["model_revision: 'v1' here, 'v2' in the cache"]
    assert v1.weights_digest == weights_digest(model_dir).digest
    # model_id defaults to vLLM's --model; the config's model_revision counts only where
    # vLLM has no --revision.
    assert v1.model_id == str(model_dir)
    pinned = _namespace(model_dir, _extra(tmp_path, model_revision="r7"))
    assert pinned.model_revision == "r7"
    assert _namespace(model_dir, _extra(tmp_path, model_revision="r7"), revision="v1") == v1


@pytest.mark.timeout(300)
def test_weights_tokenizer_and_quantization_settings_change_the_namespace(model_dir, tmp_path):
    from support import vllm_harness as vh

    extra = _extra(tmp_path)
    base = _namespace(model_dir, extra)
    assert base.model_settings == ("code_revision=none", "model_dtype=float16", "quantization=none")
    tok = _namespace(model_dir, extra, tokenizer=str(tmp_path / "tok"), code_revision="c1")
    assert "tokenizer=" + str(tmp_path / "tok") in tok.model_settings
    assert {line.split(":")[0] for line in base.differences(tok)} == {"model_settings"}
    # Same geometry, new weights file at the same path: another namespace.
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, str(model_dir / "model.safetensors"))
    new = _namespace(model_dir, extra)
    assert [line.split(":")[0] for line in base.differences(new)] == ["weights_digest"]
    # A model_path in the config must be vLLM's model (by digest), not another one.
    other = vh.write_model_config(tmp_path / "other", num_layers=3)
    from tiered_kv.config import ConfigError

    with pytest.raises(ConfigError, match=r"model_path: .* has weights digest .* but the model vLLM loads"):
        _namespace(model_dir, _extra(tmp_path, model_path=str(other)))


@pytest.mark.timeout(300)
def test_the_scheduler_without_a_current_config_agrees_with_the_workers(model_dir, tmp_path):
    """vLLM's EngineCore builds the scheduler's connector with no current vLLM config;
    the spec must still see --revision there, or its namespace would differ from the
    workers' (which are built inside ``set_current_vllm_config``)."""
    from support import vllm_harness as vh
    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    config = vh.make_vllm_config(model_dir, _extra(tmp_path), model_kwargs={"revision": "v3"})
    kv_cache_config = vh.make_kv_cache_config(config, 64)
    assert get_current_vllm_config_or_none() is None
    scheduler = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        with set_current_vllm_config(config):
            worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        worker.shutdown()
        fp = worker.connector_worker.spec.geometry.fingerprint
        assert fp.model_revision == "v3" and fp.model_settings is not None
        disk = scheduler.connector_scheduler.manager.composite.tier("disk")
        assert disk.namespace.path.name == fp.namespace_id
        assert json.loads((disk.namespace.path / "manifest.json").read_text())["fingerprint"]["model_revision"] == "v3"
    finally:
        scheduler.shutdown()
