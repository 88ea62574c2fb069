"""A warm-up a vLLM server reads: ``tiered-kv warmup``'s hf engine (a tiny Llama built
from a config, no download) writes blocks, then vLLM 0.33's real scheduler and
OffloadingConnector with ``TieredOffloadingSpec`` (``vllm_harness``, TP 1) or the spec
built per rank from vLLM's own ``build_offloading_config`` (TP 2, as vLLM's connector
builds it in each process) look the prompts up, hit, and load pages whose bytes are
the warm-up's and whose keys and values, read the way vLLM's FlashAttention splits a
page, are the model's own. After new weights land at the same path, the warm-up and
the server move to a new namespace and read nothing of the old one. Marked ``vllm``."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed", exc_type=ImportError)
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)

from support import vllm_harness  # noqa: E402
from tiered_kv.disk.format.namespace import list_namespaces  # noqa: E402
from tiered_kv.integrations.vllm import TieredOffloadingSpec  # noqa: E402
from tiered_kv.ops.inspect import read_entries  # noqa: E402
from tiered_kv.ops.warmup import warmup  # noqa: E402
from tiered_kv.ops.warmup.engines import HFEngine  # noqa: E402
from tiered_kv.ops.warmup.errors import WarmupError  # noqa: E402
from tiered_kv.ops.warmup.inputs import load_config, read_extra_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

GPU_BLOCK, HEADS, HEAD_DIM, LAYERS = 16, 2, 16, 3
PROMPTS = [
    list(range(10, 50)) + list(range(300, 345)),  # 85 tokens: 5 full blocks
    list(range(10, 50)) + list(range(500, 530)),  # 70 tokens, shares 2 blocks with the first
]


def save_tiny_llama(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=HEADS * 2 * HEAD_DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=128,
        vocab_size=1000,
    )
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def write_config(tmp_path: Path, **extra) -> Path:
    path = tmp_path / "kv-transfer-config.json"
    path.write_text(
        json.dumps(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieredOffloadingSpec",
                    "spec_module_path": "tiered_kv.integrations.vllm",
                    "cpu_bytes": "256KiB",
                    "disk_path": str(tmp_path / "cache"),
                    "disk_bytes": "8MiB",
                    "model_id": "tiny-llama",
                    **extra,
                },
            }
        )
    )
    return path


def warm(model_dir: Path, config: Path, tp: int, cache_salts=None):
    torch.set_num_threads(1)
    engine = HFEngine.from_pretrained(str(model_dir), dtype="bfloat16", device="cpu")
    report = warmup(
        PROMPTS,
        engine,
        load_config(config),
        gpu_block_size=GPU_BLOCK,
        tp_size=tp,
        extra_config=read_extra_config(config),
        kv_cache_layout="LBNHC",
        cache_salts=cache_salts,
    )
    return engine, report


def model_kv(engine: HFEngine, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's own per-layer (K, V), each (heads, tokens, head_dim), from its forward pass."""
    with torch.inference_mode():
        cache = engine.model(input_ids=torch.tensor([tokens]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def split_page(page: bytes, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's page as vLLM's FlashAttention reads it under LBNHC: physical
    (tokens, heads, K|V), split with ``split(head_size, dim=-1)``; (heads, tokens, D) each."""
    raw = torch.frombuffer(bytearray(page), dtype=torch.bfloat16).view(GPU_BLOCK, heads, 2 * HEAD_DIM)
    k, v = raw.split(HEAD_DIM, dim=-1)
    return k.permute(1, 0, 2), v.permute(1, 0, 2)


def page_is_the_models(page_bytes: list[bytes], kv, block: int, heads: list[int]) -> bool:
    tokens = slice(block * GPU_BLOCK, (block + 1) * GPU_BLOCK)
    for page, (k, v) in zip(page_bytes, kv):
        got_k, got_v = split_page(page, len(heads))
        if not (torch.equal(got_k, k[heads, tokens]) and torch.equal(got_v, v[heads, tokens])):
            return False
    return True


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return save_tiny_llama(tmp_path / "model", seed=1)


# ---------------------------------------------------------------- TP 1: the real scheduler and worker


def serve_and_read_pages(model_dir: Path, config: Path, prompt: list[int], cache_salt: str | None = None):
    """Serve ``prompt`` (of the tenant ``cache_salt``) on a fresh harness; its prefix hit,
    the server's namespace id, and the bytes (per full block, per layer) its GPU blocks
    held once loaded."""
    # The harness's tensors are head-major whatever layout is declared, and this test reads
    # their bytes as the declared layout's pages; the start-up canary reads them through
    # that layout, so it is off here (tests/integrations/test_vllm_canary.py allocates
    # the tensors per layout and runs it).
    extra = {**read_extra_config(config), "canary": False}
    with vllm_harness.VllmHarness.build(
        model_dir,
        extra,
        block_size=GPU_BLOCK,
        worker="real",
        model_kwargs={"dtype": "bfloat16"},
        kv_cache_layout="LBNHC",
    ) as h:
        namespace = h.worker_spec.geometry.fingerprint.namespace_id
        rid = h.add_request(prompt, max_tokens=2, cache_salt=cache_salt)
        full = len(prompt) // GPU_BLOCK
        pages = None
        deadline = time.monotonic() + 120  # the disk chunks are read back on threads first
        while pages is None and time.monotonic() < deadline:
            h.step()
            request = h.scheduler.requests.get(rid)
            if request is not None and request.num_computed_tokens >= len(prompt):
                ids = h.block_ids(rid)[:full]
                pages = [
                    [bytes(t[i].contiguous().view(torch.uint8).numpy()) for t in h.kv_caches.values()] for i in ids
                ]
            time.sleep(0.001)
        assert pages is not None, "the request never got its prompt's KV"
        h.run()
        return h.prefix_hits[rid], namespace, pages


def test_tp1_vllm_hits_every_warmed_block_and_loads_the_models_kv(model_dir, tmp_path):
    config = write_config(tmp_path, block_size=2 * GPU_BLOCK)  # a chunk of 2 GPU blocks
    engine, report = warm(model_dir, config, tp=1)
    assert report.blocks_written == 3 and report.blocks_failed == 0  # 85 tokens: 2 chunks; 70: 1 new
    hit, namespace, pages = serve_and_read_pages(model_dir, config, PROMPTS[0])
    assert namespace == report.namespace_id
    assert hit.external == 4 * GPU_BLOCK and hit.local == 0  # both chunks from disk; the 5th block computed
    kv = model_kv(engine, PROMPTS[0])
    # byte-exact: what the warm-up computed and packed is what landed in vLLM's pages
    layout_pages = _warmup_pages(engine, config, kv, rank=0, tp=1, blocks=4)
    for block in range(4):
        assert pages[block] == layout_pages[block]
        assert page_is_the_models(pages[block], kv, block, heads=[0, 1])
    # the fifth block was computed by the harness's fake forward, not loaded
    assert not page_is_the_models(pages[4], kv, 4, heads=[0, 1])
    hit, _, _ = serve_and_read_pages(model_dir, config, PROMPTS[1])
    assert hit.external == 4 * GPU_BLOCK


def test_a_tenants_warmed_blocks_answer_that_tenant_only(model_dir, tmp_path):
    config = write_config(tmp_path, block_size=2 * GPU_BLOCK)
    engine, report = warm(model_dir, config, tp=1, cache_salts=["tenant-a", None])
    # The salted prompt's 2 chunks and the unsalted one's 2 share no key.
    assert report.blocks_written == 4 and report.blocks_failed == 0
    hit, _, pages = serve_and_read_pages(model_dir, config, PROMPTS[0], cache_salt="tenant-a")
    assert hit.external == 4 * GPU_BLOCK
    kv = model_kv(engine, PROMPTS[0])
    assert all(page_is_the_models(pages[block], kv, block, heads=[0, 1]) for block in range(4))
    # Another tenant reads nothing; an unsalted request only the unsalted prompt's shared chunk.
    assert serve_and_read_pages(model_dir, config, PROMPTS[0], cache_salt="tenant-b")[0].external == 0
    assert serve_and_read_pages(model_dir, config, PROMPTS[0])[0].external == 2 * GPU_BLOCK
    assert serve_and_read_pages(model_dir, config, PROMPTS[1], cache_salt="tenant-a")[0].external == 2 * GPU_BLOCK


def _warmup_pages(engine, config, kv, *, rank: int, tp: int, blocks: int) -> list[list[bytes]]:
    """The warm-up layout's pages of the first ``blocks`` GPU blocks on ``rank``: per block,
    per layer."""
    from tiered_kv.ops.warmup.layouts import LayoutRequest
    from tiered_kv.ops.warmup.vllm_pages import VllmPagesLayout

    cfg = load_config(config)
    factor = (cfg.block_size or GPU_BLOCK) // GPU_BLOCK
    layout = VllmPagesLayout(
        LayoutRequest(
            engine.geometry,
            engine.dtype,
            GPU_BLOCK,
            factor,
            tp,
            model_dir=engine.model_path,
            extra_config=read_extra_config(config),
            kv_cache_layout="LBNHC",
        )
    )
    tensors = layout.pages(kv, rank, blocks)
    return [[bytes(t[b].view(torch.uint8).numpy()) for t in tensors] for b in range(blocks)]


def test_new_weights_at_the_same_path_get_a_new_namespace_and_never_the_old_kv(model_dir, tmp_path):
    config = write_config(tmp_path)
    old_engine, old = warm(model_dir, config, tp=1)
    old_kv = model_kv(old_engine, PROMPTS[0])
    save_tiny_llama(model_dir, seed=2)  # a new checkpoint lands at the same path
    engine, new = warm(model_dir, config, tp=1)
    assert new.namespace_id != old.namespace_id and new.weights_digest != old.weights_digest
    assert new.blocks_present == 0 and new.blocks_written == old.blocks_written  # nothing skipped as present
    hit, namespace, pages = serve_and_read_pages(model_dir, config, PROMPTS[0])
    assert namespace == new.namespace_id and hit.external == 5 * GPU_BLOCK
    kv = model_kv(engine, PROMPTS[0])
    for block in range(5):
        assert page_is_the_models(pages[block], kv, block, heads=[0, 1])
        assert not page_is_the_models(pages[block], old_kv, block, heads=[0, 1])
    hits = {ns.path.name: int(read_entries(ns).hits.sum()) for ns in list_namespaces(tmp_path / "cache")}
    assert hits == {old.namespace_id: 0, new.namespace_id: 5}, "the server read the old checkpoint's namespace"


# ---------------------------------------------------------------- TP 2: one spec per rank


def tp2_vllm_config(model_dir: Path, extra: dict) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True, seed=0),
        cache_config=CacheConfig(block_size=GPU_BLOCK, cache_dtype="auto", enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=2),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            engine_id=f"tp2-{uuid.uuid4().hex[:8]}",
        ),
        device_config=DeviceConfig(device="cpu"),
    )


def test_tp2_each_rank_loads_its_heads_of_the_warmed_kv(model_dir, tmp_path):
    config = write_config(tmp_path)
    engine, report = warm(model_dir, config, tp=2)
    assert (
        report.blocks_written == 7 and report.bytes_written == 7 * 2 * LAYERS * 1024
    )  # blocks x ranks x layers x page
    vc = tp2_vllm_config(model_dir, read_extra_config(config))
    vc.cache_config.kv_cache_layout = "LBNHC"  # as the engine core records it
    num_blocks = 16
    kv_cache_config = vllm_harness.make_kv_cache_config(vc, num_blocks)
    specs, gpu = [], []
    for rank in range(2):
        vc.parallel_config.rank = rank
        with set_current_vllm_config(vc):
            specs.append(TieredOffloadingSpec(build_offloading_config(vc, kv_cache_config)))
    assert {s.geometry.fingerprint.namespace_id for s in specs} == {report.namespace_id}
    manager = specs[0].get_manager()
    page = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    workers = []
    for spec in specs:
        tensors = [torch.zeros((num_blocks, page), dtype=torch.int8) for _ in range(LAYERS)]
        caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, page) for t in tensors], [[CanonicalKVCacheRef(i, page) for i in range(LAYERS)]]
        )
        workers.append(spec.get_worker(caches))
        gpu.append(tensors)
    try:
        ctx = ReqContext(req_id="r")
        keys = [make_offload_key(h, 0) for h in vllm_harness.hash_blocks(PROMPTS[0], GPU_BLOCK)]
        deadline = time.monotonic() + 30
        for key in keys:
            while (result := manager.lookup(key, ctx)) is LookupResult.HIT_PENDING:
                assert time.monotonic() < deadline
                time.sleep(0.002)
            assert result is LookupResult.HIT
        spec = manager.prepare_load(keys, ctx)
        blocks = list(range(3, 3 + len(keys)))
        for worker in workers:
            worker.submit_load(1, spec, GPULoadStoreSpec(blocks, [len(blocks)], [0]))
        for worker in workers:
            worker.wait({1})
            assert [r.job_id for r in worker.get_finished()] == [1]
        manager.complete_load(keys, ctx)
        kv = model_kv(engine, PROMPTS[0])
        for rank in range(2):
            expected = _warmup_pages(engine, config, kv, rank=rank, tp=2, blocks=len(keys))
            for i, block in enumerate(blocks):
                loaded = [bytes(t[block].view(torch.uint8).numpy()) for t in gpu[rank]]
                assert loaded == expected[i]
                assert page_is_the_models(loaded, kv, i, heads=[rank])  # rank r holds KV head r
    finally:
        for worker in workers:
            worker.shutdown()
        manager.shutdown()


def test_settings_vllm_would_store_otherwise_are_refused(model_dir, tmp_path):
    config = write_config(tmp_path)
    engine = HFEngine.from_pretrained(str(model_dir), dtype="bfloat16", device="cpu")
    cfg, extra = load_config(config), read_extra_config(config)
    with pytest.raises(WarmupError, match="--kv-cache-layout: expected one of LBNHC, LBHNC"):
        warmup(PROMPTS, engine, cfg, extra_config=extra, kv_cache_layout="BLHNC")
    with pytest.raises(WarmupError, match="^tp: 3 is larger than the model's 2 KV heads"):
        warmup(PROMPTS, engine, cfg, extra_config=extra, tp_size=3)
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [8.0] * 8}
    refused = {
        # vLLM keeps a sliding window's layers in a KV group of their own.
        "mistral": (transformers.MistralConfig, {"sliding_window": 64}, "^sliding_window: 64 in the model's config"),
        # vLLM rotates with the factors --max-model-len picks, transformers with the ones
        # each prompt's length picks (the same prefix would be stored two ways).
        "longrope": (
            transformers.LlamaConfig,
            {"max_position_embeddings": 4096, "rope_scaling": {**longrope, "original_max_position_embeddings": 64}},
            "^longrope: vLLM rotates every key of this LongRoPE model with its long",
        ),
        # transformers rescales by a forward pass's length past the trained context.
        "dynamic": (
            transformers.LlamaConfig,
            {"max_position_embeddings": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            "^rope_type dynamic: transformers rescales",
        ),
        # transformers' default rotary embedding turns the whole head, vLLM a part of it.
        "partial": (
            transformers.LlamaConfig,
            {"partial_rotary_factor": 0.5},
            "^partial_rotary_factor 0.5: vLLM rotates",
        ),
    }
    for name, (config_class, more, words) in refused.items():
        torch.manual_seed(3)
        shape = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
        model = config_class(hidden_size=64, vocab_size=1000, **shape, **more)
        transformers.AutoModelForCausalLM.from_config(model).to(torch.bfloat16).save_pretrained(tmp_path / name)
        engine = HFEngine.from_pretrained(str(tmp_path / name), dtype="bfloat16", device="cpu")
        with pytest.raises(WarmupError, match=words):
            warmup(PROMPTS, engine, cfg, extra_config={**extra, "model_id": f"tiny-{name}"})
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- the commands


def test_cli_default_writes_what_vllm_reads_and_inspect_answers_for_vllm(model_dir, tmp_path):
    from typer.testing import CliRunner

    from tiered_kv.cli import _load_commands, app

    _load_commands()
    config = write_config(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS))

    def cli(*args: str) -> str:
        result = CliRunner().invoke(app, list(args), env={"COLUMNS": "250", "VLLM_KV_CACHE_LAYOUT": None})
        assert result.exit_code == 0, result.output
        return result.stdout

    common = ("warmup", str(prompts), "--model", str(model_dir), "--config", str(config), "--device", "cpu", "--json")
    served = json.loads(cli(*common))  # the defaults: vLLM's layout, --dtype auto
    kv_first = json.loads(cli(*common, "--layout", "kv-first"))
    assert served["layout"] == "vllm" and served["blocks_written"] == 7
    hit, namespace, _ = serve_and_read_pages(model_dir, config, PROMPTS[0])
    assert namespace == served["namespace_id"] and hit.external == 5 * GPU_BLOCK

    data = json.loads(
        cli("inspect", "summary", str(tmp_path / "cache"), "--config", str(config), "--model", str(model_dir), "--json")
    )
    read = {ns["namespace"]: ns["read_by"][0] for ns in data["namespaces"]}
    # The model's layers, not the entries of vLLM's geometry (one page, one KV-cache group).
    assert {ns["layers"] for ns in data["namespaces"]} == {LAYERS}
    assert read[served["namespace_id"]] == {"config": str(config), "reads": True, "differences": []}
    theirs = read[kv_first["namespace_id"]]
    assert not theirs["reads"] and "unchecked" not in theirs
    # kv-first: its own geometry, no model settings, no attention backend, and no weights
    # digest without model_path
    assert {d.split(":")[0] for d in theirs["differences"]} == {
        "weights_digest",
        "layer_geometry",
        "kv_layout",
        "model_settings",
        "attention_backend",
    }
    table = cli("inspect", "summary", str(tmp_path / "cache"), "--config", str(config), "--model", str(model_dir))
    assert "a vLLM server with this config" in table and "layer_geometry: (vllm_worker_block" in table
    assert f"{LAYERS} layers, vLLM's pages (vllm_worker_block)" in table
    refused = CliRunner().invoke(app, [*common, "--kv-cache-layout", "BLHNC"])
    assert refused.exit_code == 2 and refused.stderr.startswith("error: --kv-cache-layout: expected one of LBNHC")
    # Without the model directory only the pinned fields can be compared, and it says so.
    loose = json.loads(cli("inspect", "summary", str(tmp_path / "cache"), "--config", str(config), "--json"))
    assert all("give --model" in ns["read_by"][0]["unchecked"] for ns in loose["namespaces"])
