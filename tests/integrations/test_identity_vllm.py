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


def _prompt_served(model_dir, disk_extra, prompt, writes: bool, **config_kwargs) -> int:
    """Tokens of ``prompt`` a server reads from the lower tiers (after storing it, if
    ``writes``, and waiting until its disk copy is durable)."""
    import time

    from support import vllm_harness as vh

    with vh.VllmHarness.build(model_dir, disk_extra, worker="real", **config_kwargs) as h:
        if writes:
            h.add_request(prompt)
            h.settle()
            deadline = time.monotonic() + 30
            while h.manager.composite.pending_writes() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not h.manager.composite.pending_writes()
            return 0
        rid = h.admit(prompt)
        served = h.prefix_hits[rid].external
        h.settle()
        return served


@pytest.mark.timeout(600)
def test_another_config_file_or_random_weights_never_read_the_models_kv(model_dir, tmp_path):
    """``--hf-config-path`` (here another RoPE base) and ``--load-format dummy`` (random
    weights) change every K and V of the same model directory: a server without them
    reads none of their chunks, and one with them reads its own."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(8)}, str(model_dir / "model.safetensors"))
    alt = tmp_path / "alt-config"
    alt.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (alt / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0}))
    prompt = [100 + (i * 31) % 800 for i in range(3 * 16 + 2)]
    for name, setting in (
        ("hf_config", {"model_kwargs": {"hf_config_path": str(alt)}}),
        ("load_format", {"load_format": "dummy"}),
    ):
        (tmp_path / name).mkdir()
        extra = _extra(tmp_path / name, cpu_bytes="16KiB", block_size=16, disk_bytes="256KiB")
        _prompt_served(model_dir, extra, prompt, writes=True, **setting)
        assert _prompt_served(model_dir, extra, prompt, writes=False) == 0, name
        assert _prompt_served(model_dir, extra, prompt, writes=False, **setting) == 48, name
    # A format that reads the same files keeps the namespace of the default one.
    from support import vllm_harness as vh

    plain = _namespace(model_dir, _extra(tmp_path))
    with vh.VllmHarness.build(model_dir, _extra(tmp_path), worker="real", load_format="safetensors") as h:
        assert h.worker_spec.geometry.fingerprint == plain


@pytest.mark.timeout(300)
def test_a_mamba_state_dtype_and_a_draft_model_are_in_the_namespace(model_dir, tmp_path):
    """A hybrid model's Mamba pages are padded to the attention page, so the state's
    dtype changes no size the geometry records; a draft model's layers travel in the
    target's chunks. Both are named in ``model_settings`` where set."""
    import torch
    from safetensors.torch import save_file
    from support import vllm_harness as vh
    from vllm.config import SpeculativeConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_interface import MambaSpec

    from tiered_kv.integrations.vllm.geometry import offline_geometry

    extra = _extra(tmp_path)

    def hybrid(vc, ssm_dtype, n=8):
        attn = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=16, dtype=vc.model_config.dtype)
        page = attn.page_size_bytes
        shapes, dtypes = ((3, 64), (2, 16, 16)), (vc.model_config.dtype, ssm_dtype)
        mamba = MambaSpec(block_size=256, shapes=shapes, dtypes=dtypes, page_size_padded=page, mamba_cache_mode="align")
        layers = ["model.layers.0.self_attn.attn", "model.layers.1.mixer"]
        t = KVCacheTensor(size=page * n, layers=layers, layer_stride=page * n, block_stride=page)
        groups = [KVCacheGroupSpec(layers[:1], attn), KVCacheGroupSpec(layers[1:], mamba)]
        return KVCacheConfig(num_blocks=n, kv_cache_tensors=[t], kv_cache_groups=groups)

    ssm = {}
    for dtype in ("float32", "bfloat16"):
        vc = vh.make_vllm_config(model_dir, extra, block_size=256, kv_cache_layout="LBNHC")
        vc.cache_config.mamba_ssm_cache_dtype = dtype
        ssm[dtype] = offline_geometry(vc, hybrid(vc, getattr(torch, dtype)), attention_backend="FLASH_ATTN").fingerprint
    assert ssm["float32"].namespace_id != ssm["bfloat16"].namespace_id
    assert "mamba_ssm_cache_dtype=float32" in (ssm["float32"].model_settings or ())

    drafts = {}
    for name, value in (("draft-a", 1.0), ("draft-b", 2.0)):  # one architecture, other weights
        d = vh.write_model_config(tmp_path / name, num_layers=1)
        save_file({"w": torch.full((8,), value)}, str(d / "model.safetensors"))
        vc = vh.make_vllm_config(model_dir, extra, kv_cache_layout="LBNHC")
        vc.speculative_config = SpeculativeConfig(
            model=str(d),
            method="draft_model",
            num_speculative_tokens=2,
            target_model_config=vc.model_config,
            target_parallel_config=vc.parallel_config,
        )
        kcc = vh.make_kv_cache_config(vc, 64)
        drafts[name] = offline_geometry(vc, kcc, attention_backend="FLASH_ATTN").fingerprint
    a, b = drafts.values()
    assert a.namespace_id != b.namespace_id
    assert [line.split(":")[0] for line in a.differences(b)] == ["model_settings"]
    # N-gram drafting adds no layers (vLLM's draft config is the target's): not named.
    vc = vh.make_vllm_config(model_dir, extra, kv_cache_layout="LBNHC")
    vc.speculative_config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=2,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        target_model_config=vc.model_config,
        target_parallel_config=vc.parallel_config,
    )
    ngram = offline_geometry(vc, vh.make_kv_cache_config(vc, 64), attention_backend="FLASH_ATTN").fingerprint
    assert not any(s.startswith("speculative=") for s in ngram.model_settings or ())


@pytest.mark.timeout(300)
def test_longrope_factors_online_quantization_and_model_class_overrides_are_in_the_namespace(model_dir, tmp_path):
    """vLLM rotates a LongRoPE model's keys with its long factors where --max-model-len
    passes the original context, its short ones otherwise: the cached keys differ. Online
    quantization's config (which layers) and a model class override (other model code)
    change the KV as the weights would."""
    from types import SimpleNamespace

    from support import vllm_harness as vh

    from tiered_kv.integrations.vllm.common import vllm_model_settings

    phi3 = tmp_path / "phi3"
    phi3.mkdir()
    factors = {"short_factor": [1.0 + 0.05 * i for i in range(8)], "long_factor": [1.0 + 2.0 * i for i in range(8)]}
    (phi3 / "config.json").write_text(
        json.dumps(
            {
                **json.loads((model_dir / "config.json").read_text()),
                "architectures": ["Phi3ForCausalLM"],
                "model_type": "phi3",
                "max_position_embeddings": 131072,
                "original_max_position_embeddings": 4096,
                "rope_scaling": {"type": "longrope", **factors},
            }
        )
    )
    longrope = {
        n: vllm_model_settings(vh.make_vllm_config(phi3, _extra(tmp_path), max_model_len=n)) for n in (2048, 8192)
    }
    assert "longrope=short" in longrope[2048] and "longrope=long" in longrope[8192]

    def settings(max_model_len, **more):  # the model config's other fields as vLLM sets them
        vc = vh.make_vllm_config(model_dir, _extra(tmp_path), max_model_len=max_model_len)
        mc = SimpleNamespace(**{**vc.model_config.__dict__, **more})
        return vllm_model_settings(SimpleNamespace(**{**vc.__dict__, "model_config": mc}))

    fp8 = settings(2048, quantization_config={"ignore": ["lm_head"]})
    fewer = settings(2048, quantization_config={"ignore": ["lm_head", "model.layers.0.*"]})
    assert {s.split("=")[0] for s in set(fp8) ^ set(fewer)} == {"quantization_config"}
    overridden = settings(2048, model_class_overrides={"LlamaForCausalLM": "mine:Llama"})
    assert {s.split("=")[0] for s in set(overridden) - set(settings(2048))} == {"model_class_overrides"}
    # Without them a namespace is named as before.
    plain = vllm_model_settings(vh.make_vllm_config(model_dir, _extra(tmp_path)))
    assert plain == ("code_revision=none", "model_dtype=float16", "quantization=none")


@pytest.mark.timeout(300)
def test_the_tools_never_judge_unread_nor_warm_a_namespace_of_settings_they_do_not_read(model_dir, tmp_path):
    """Servers started with ``--hf-config-path``, ``--load-format dummy`` or two
    pipeline stages write namespaces a config file cannot tell the tools about:
    ``inspect clear --unread-by`` keeps them (with a plain config, or the servers' own
    ``vllm serve`` files), and ``warmup`` refuses such a file, naming the setting."""
    import torch
    from safetensors.torch import save_file
    from support import vllm_harness as vh
    from support.cli import run_cli
    from vllm.config import ParallelConfig

    from tiered_kv.disk.format.namespace import Namespace, list_namespaces
    from tiered_kv.integrations.vllm.geometry import offline_geometry

    save_file({"w": torch.ones(8)}, str(model_dir / "model.safetensors"))
    alt = tmp_path / "alt-config"
    alt.mkdir()
    (alt / "config.json").write_text(json.dumps({**json.loads((model_dir / "config.json").read_text()), "x": 1}))
    cache = tmp_path / "cache"
    extra = {**SPEC, "cpu_bytes": "1MiB", "disk_path": str(cache), "disk_bytes": "4MiB", "model_id": "tiny"}
    servers = {
        "hf_config": ({"hf-config-path": str(alt)}, {"model_kwargs": {"hf_config_path": str(alt)}}),
        "dummy": ({"load-format": "dummy"}, {"load_format": "dummy"}),
        "pp": ({"pipeline-parallel-size": 2}, {}),
        # Flags the tools do model, with vLLM's defaults: the namespaces they name are kept.
        "dp": ({"data-parallel-size": 2}, {}),
        "tokenizer": ({"tokenizer": str(alt)}, {"model_kwargs": {"tokenizer": str(alt)}}),
        "hf_overrides": (
            {"hf-overrides": {"rms_norm_eps": 1e-6}},
            {"model_kwargs": {"hf_overrides": {"rms_norm_eps": 1e-6}}},
        ),
    }
    files = []
    for name, (serve_keys, config_kwargs) in servers.items():
        vc = vh.make_vllm_config(model_dir, extra, kv_cache_layout="LBNHC", **config_kwargs)
        if name == "pp":
            vc.parallel_config = ParallelConfig(pipeline_parallel_size=2)
        if name == "dp":
            vc.parallel_config.data_parallel_size, vc.parallel_config.data_parallel_index = 2, 1
        geometry = offline_geometry(vc, vh.make_kv_cache_config(vc, 64), attention_backend="FLASH_ATTN")
        Namespace.open(cache, geometry.fingerprint, geometry.scheduler_layout(), disk_bytes=4 << 20).close()
        transfer = {
            "kv_connector": "TieredOffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        serve = {
            "model": str(model_dir),
            "attention-backend": "FLASH_ATTN",
            **serve_keys,
            "kv-transfer-config": transfer,
        }
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(serve))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"model": str(model_dir), "kv-transfer-config": transfer}))
    assert len(list_namespaces(cache)) == len(servers)
    for configs in ([plain], files):
        unread = [a for f in configs for a in ("--unread-by", str(f))]
        out = run_cli("inspect", "clear", str(cache), *unread, "--model", str(model_dir), "--yes", "--json").stdout
        assert json.loads(out)["removed"] == [] and len(list_namespaces(cache)) == len(servers)
    summary = json.loads(
        run_cli("inspect", "summary", str(cache), "--config", str(plain), "--model", str(model_dir), "--json").stdout
    )
    flagged = [ns["read_by"][0] for ns in summary["namespaces"] if "dp_replica=1/2" in ns["fingerprint"]["kv_layout"]]
    assert (
        flagged[0]["differences"] == [] and "differ only where `vllm serve` flags set them" in flagged[0]["unchecked"]
    )
    assert "1 x PP 2 (2 ranks)" in run_cli("inspect", "summary", str(cache)).stdout
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": list(range(40))}) + "\n")
    for f, key in zip(files, ("hf-config-path", "load-format", "pipeline-parallel-size")):
        result = run_cli("warmup", str(prompts), "--config", str(f), "--model", str(model_dir), code=None)
        assert result.exit_code != 0 and key in result.output and "would read none of its blocks" in result.output
