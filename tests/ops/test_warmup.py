"""``tiered-kv warmup`` with a tiny randomly initialised Llama (built from a config, no
download): a fresh process's hierarchy hits every full block and loads K/V equal to
the model's own; reruns resume; TP shards heads; bad settings fail with one line.
(``test_warmup_vllm.py`` checks the keys against vLLM's own hashes.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tiered_kv.cli import _load_commands, app
from tiered_kv.disk.format.namespace import WriterLock, list_namespaces
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.ops.hashing import PrefixHasher, resolve_seed
from tiered_kv.memory.host_memory import unpack_blocks
from tiered_kv.ops.inspect import open_cache, read_entries
from tiered_kv.ops.inspect.maintenance import delete_entries, exclusive, open_index_for_writing
from tiered_kv.ops.warmup import warmup
from tiered_kv.ops.warmup.engines import HFEngine
from tiered_kv.ops.warmup.errors import WarmupError
from tiered_kv.ops.warmup.inputs import load_config
from tiered_kv.ops.warmup.layouts import KvFirstLayout, LayoutRequest

transformers = pytest.importorskip("transformers")
_load_commands()
runner = CliRunner()
GPU_BLOCK = 16
HEADS, HEAD_DIM, LAYERS = 2, 16, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(1234)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        intermediate_size=128,
        vocab_size=1000,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir) -> HFEngine:
    torch.set_num_threads(1)
    return HFEngine.from_pretrained(str(model_dir), device="cpu")


def model_kv(engine: HFEngine, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's own K/V for ``tokens``, straight from its forward pass."""
    with torch.inference_mode():
        cache = engine.model(input_ids=torch.tensor([tokens]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


PROMPTS = [
    list(range(10, 50)) + list(range(300, 345)),  # 85 tokens
    list(range(10, 50)) + list(range(500, 530)),  # shares 2.5 blocks of prefix
    list(range(700, 712)),  # shorter than one block
    list(range(800, 864)),  # exactly 4 blocks
]


def write_inputs(tmp_path: Path, block_size: int = GPU_BLOCK, prompts=PROMPTS, **extra) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    config = tmp_path / "kv-transfer-config.json"
    config.write_text(
        json.dumps(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieredOffloadingSpec",
                    "spec_module_path": "tiered_kv.integrations.vllm",
                    "cpu_bytes": "1MiB",
                    "disk_path": str(tmp_path / "cache"),
                    "disk_bytes": "8MiB",
                    "block_size": block_size,
                    "model_id": "tiny-llama",
                    # Every block found is loaded: what the warm-up wrote is what is served,
                    # whatever this machine's measured disk loads would make the decision do.
                    "cost_aware": False,
                    **extra,
                },
            }
        )
    )
    return prompts_file, config


def run_warmup(prompts_file: Path, config: Path, model_dir: Path, *extra: str, code: int = 0, env=None):
    """``tiered-kv warmup`` with the kv-first layout (tiered-kv's own engine), whose
    blocks these tests load through ``HierarchySpec``; ``test_warmup_served.py`` covers
    the default, vLLM's."""
    result = runner.invoke(
        app,
        [
            "warmup",
            str(prompts_file),
            "--model",
            str(model_dir),
            "--config",
            str(config),
            "--device",
            "cpu",
            "--layout",
            "kv-first",
            *extra,
        ],
        env=env,
    )
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def expected_blocks(prompts, chunk_tokens: int) -> int:
    keys = set()
    for p in prompts:
        keys |= {tuple(p[:end]) for end in range(chunk_tokens, len(p) + 1, chunk_tokens)}
    return len(keys)


# A fresh engine process: for each config, the tiered hierarchy over a device cache of the
# model's geometry looks up and loads every prompt's blocks, and keeps what landed in its
# device tensors.
_FRESH = textwrap.dedent("""
    import json, sys, torch
    from tiered_kv.sim.driver import DeviceKVCache
    from tiered_kv.ops.hashing import PrefixHasher, chunk_keys, resolve_seed
    from tiered_kv.memory.host_memory import expand_block_ids
    from tiered_kv.mediums import GPULoadStoreSpec
    import dataclasses
    from tiered_kv.tiered.spec import HierarchySpec
    from tiered_kv.ops.warmup.inputs import load_config
    prompts_path, out_path, *config_paths = sys.argv[1:]
    results = []
    for config_path in config_paths:
        # The server's config as the server reads it; the weights are those the warm-up
        # was given (a vLLM server names its own model directory).
        cfg = dataclasses.replace(load_config(config_path), cover_weights=False)
        f = cfg.block_size // {block}
        dev = DeviceKVCache(num_layers={layers}, num_gpu_blocks=32 * f, gpu_block_size={block},
                            num_kv_heads={heads}, head_dim={head_dim}, dtype=torch.float32,
                            kv_before_num_blocks=True, block_size_factor=f, device="cpu")
        spec = HierarchySpec(cfg, gpu_block_size={block})
        worker = spec.build_worker(dev.kv_caches, True)
        manager = spec.get_manager()
        hasher = PrefixHasher(cfg.hash_algorithm, resolve_seed(cfg.hash_algorithm, cfg.hash_seed), {block})
        out = []
        for job, line in enumerate(open(prompts_path)):
            keys = chunk_keys(hasher.block_hashes(json.loads(line)["token_ids"]), f)
            hits = manager.lookup(keys)
            ok = []
            if keys:
                kernel = expand_block_ids(range(len(keys)), f)
                worker.transfer_async(job, (manager.prepare_load(keys), GPULoadStoreSpec(kernel)))
                worker.wait({{job}})
                ok = [r.success for r in worker.get_finished()]
                manager.complete_load(keys, success=all(ok))
            out.append({{"keys": len(keys), "hits": hits, "ok": ok,
                        "kv": [t[:, :len(keys) * f].clone() for t in dev.tensors]}})
        worker.shutdown()
        manager.shutdown()
        spec.store.close()
        results.append(out)
    torch.save(results, out_path)
""").format(block=GPU_BLOCK, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM)


def load_in_fresh_process(prompts_file: Path, configs: list[Path], tmp_path: Path) -> list[list[dict]]:
    out = tmp_path / "loaded.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH, str(prompts_file), str(out), *map(str, configs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return torch.load(out)


def test_a_fresh_process_hits_every_block_and_loads_the_models_kv(model_dir, engine, tmp_path):
    configs = []
    for factor in (1, 2):  # offloaded blocks of one and of two GPU blocks
        prompts_file, config = write_inputs(tmp_path / f"f{factor}", block_size=GPU_BLOCK * factor)
        configs.append(config)
        report = json.loads(run_warmup(prompts_file, config, model_dir, "--json").stdout)
        chunk = GPU_BLOCK * factor
        assert report["blocks"] == report["blocks_written"] == expected_blocks(PROMPTS, chunk)
        assert report["prompts"] == 4 and report["prompts_too_short"] == 1 and report["blocks_failed"] == 0
        assert report["bytes_written"] == report["blocks_written"] * 2 * LAYERS * chunk * HEADS * HEAD_DIM * 4

    for factor, loaded in zip((1, 2), load_in_fresh_process(prompts_file, configs, tmp_path)):
        chunk = GPU_BLOCK * factor
        for tokens, got in zip(PROMPTS, loaded):
            n = len(tokens) // chunk
            assert got["keys"] == got["hits"] == n  # every full block hits
            if not n:
                continue
            assert got["ok"] == [True]
            for (k, v), layer in zip(model_kv(engine, tokens), got["kv"]):
                # layer: (2, kernel blocks, block tokens, heads, dim) -> (heads, tokens, dim)
                as_model = layer.reshape(2, n * chunk, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
                torch.testing.assert_close(as_model[0], k[:, : n * chunk])
                torch.testing.assert_close(as_model[1], v[:, : n * chunk])


def test_summary_table_and_resuming(model_dir, tmp_path):
    prompts_file, config = write_inputs(tmp_path)
    text = run_warmup(prompts_file, config, model_dir).stdout
    total = expected_blocks(PROMPTS, GPU_BLOCK)
    for words in (
        f"{total} distinct: {total} written",
        "4 (0 already complete, 1 shorter",
        "bytes written",
        "tokens computed",
        "2 layers, 2 KV heads x 16, float32",
    ):
        assert words in text

    again = json.loads(run_warmup(prompts_file, config, model_dir, "--json").stdout)
    assert (again["blocks_written"], again["blocks_present"], again["tokens_computed"]) == (0, total, 0)
    assert again["prompts_skipped"] == 3

    # Lose the tail blocks of the first prompt (as after an interrupted run): only they are redone.
    cache = open_cache(tmp_path / "cache")
    (ns,) = cache.namespaces
    hasher = PrefixHasher("sha256", resolve_seed("sha256", ""), GPU_BLOCK)
    tail = hasher.block_hashes(PROMPTS[0])[3:]
    with exclusive([ns], "test"):
        index = open_index_for_writing(ns)
        table = read_entries(ns, index)
        slot_of = {table.hash(i): int(table.slot[i]) for i in range(len(table))}
        assert delete_entries(index, [(h, slot_of[h]) for h in tail]) == len(tail) == 2
        index.close()
    resumed = json.loads(run_warmup(prompts_file, config, model_dir, "--json").stdout)
    assert (resumed["blocks_written"], resumed["blocks_present"]) == (2, total - 2)
    assert resumed["tokens_computed"] == 5 * GPU_BLOCK and resumed["prompts_skipped"] == 2


def test_tensor_parallel_ranks_hold_their_heads(engine, tmp_path):
    _, config_file = write_inputs(tmp_path)
    config = load_config(config_file)
    report = warmup([PROMPTS[3]], engine, config, gpu_block_size=GPU_BLOCK, tp_size=2, layout="kv-first")
    # Each rank stores its one head: together, every head once.
    assert report.blocks_written == 4 and report.bytes_written == 4 * 2 * LAYERS * GPU_BLOCK * HEADS * HEAD_DIM * 4
    (ns,) = list_namespaces(tmp_path / "cache")
    assert ns.fingerprint.tp_size == 2
    layout = KvFirstLayout(LayoutRequest(engine.geometry, torch.float32, GPU_BLOCK, 1, 2)).kv_layout
    keys = PrefixHasher("sha256", resolve_seed("sha256", ""), GPU_BLOCK).block_hashes(PROMPTS[3])
    store = DiskStore.open_readonly(ns.path)
    try:
        kv = model_kv(engine, PROMPTS[3])
        for rank in range(2):
            tensors = [torch.empty(layer.shape[:1] + (4,) + layer.shape[2:]) for layer in layout.layers]
            for b, key in enumerate(keys):
                raw = store.read_block(rank, key)
                assert raw is not None
                unpack_blocks(
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(1, -1), tensors, layout, np.array([[b]])
                )
            for (k, v), t in zip(kv, tensors):  # t: (2, 4 blocks, 16, 1 head, dim)
                got = t.reshape(2, 4 * GPU_BLOCK, 1, HEAD_DIM).permute(0, 2, 1, 3)
                torch.testing.assert_close(got[0], k[rank : rank + 1])
                torch.testing.assert_close(got[1], v[rank : rank + 1])
    finally:
        store.close()


def test_settings_that_cannot_work_fail_with_one_line(model_dir, tmp_path):
    prompts_file, config = write_inputs(tmp_path)
    cases = [
        (
            write_inputs(tmp_path / "x", hash_algorithm="xxhash")[1],
            (),
            {"PYTHONHASHSEED": None},
            "run the server with PYTHONHASHSEED=<value> and set hash_seed",
        ),
        (config, ("--engine", "vllm"), None, "needs CUDA + vLLM"),
        (config, ("--engine", "jax"), None, "'jax' is not one of 'hf', 'vllm'"),
        (config, ("--gpu-block-size", "12"), None, "not a multiple of --gpu-block-size 12"),
        (config, ("--layout", "sideways"), None, "--layout: expected one of kv-first"),
        (config, ("--tp", "3"), None, "larger than the model's 2 KV heads but not a multiple"),
        (tmp_path / "missing.json", (), None, "does not exist"),
    ]
    for cfg, extra, env, words in cases:
        result = run_warmup(prompts_file, cfg, model_dir, *extra, code=2, env=env)
        assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    # Settings the seed can be fixed with work for xxhash.
    xx = write_inputs(tmp_path / "xx", hash_algorithm="xxhash", hash_seed="42")[1]
    assert (
        json.loads(run_warmup(prompts_file, xx, model_dir, "--json", env={"PYTHONHASHSEED": None}).stdout)[
            "blocks_written"
        ]
        > 0
    )

    bad = tmp_path / "bad.jsonl"
    for content, words in (
        ('{"token_ids": [1, 2]}\n[1, -3]\n', "bad.jsonl:2: expected token ids"),
        ('{"tokens": [1]}\n', "expected a 'token_ids' or 'text' key"),
        ('{"token_ids": [1, 2], "cache_salt": ""}\n', "bad.jsonl:1: cache_salt: expected a non-empty string"),
        ('{"token_ids": [1, 2], "cache_salt": 7}\n', "bad.jsonl:1: cache_salt: expected a non-empty string"),
        ('{"text": "hi", "lora_name": "sql"}\n', "bad.jsonl:1: lora_name: the warm-up computes a prompt's KV"),
        ('{"text": "hello"}\n', "cannot load a tokenizer"),
        ("[5, 99999]\n", "token id 99999 is outside the model's vocabulary"),
    ):
        bad.write_text(content)
        result = run_warmup(bad, config, model_dir, code=2)
        assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_running_server_keeps_the_cache(model_dir, tmp_path):
    prompts_file, config = write_inputs(tmp_path)
    run_warmup(prompts_file, config, model_dir)
    (ns,) = list_namespaces(tmp_path / "cache")
    lock = WriterLock.acquire(ns, "server")
    try:
        result = run_warmup(prompts_file, config, model_dir, code=2)
        assert f"already open for writing by pid {os.getpid()}" in result.stderr
    finally:
        lock.release()


def test_a_disk_tier_named_in_tiers_is_warmed_where_the_server_reads_it(model_dir, tmp_path):
    """The canonical form of the same disk tier (an entry of ``tiers``, no disk_path): the
    warm-up writes the namespace a server built from that config hits."""
    cache = tmp_path / "cache"
    prompts_file, config = write_inputs(tmp_path)
    doc = json.loads(config.read_text())
    extra = doc["kv_connector_extra_config"]
    del extra["disk_path"], extra["disk_bytes"]
    extra["tiers"] = [{"type": "disk", "path": str(cache), "bytes": "8MiB"}]
    config.write_text(json.dumps(doc))
    report = json.loads(run_warmup(prompts_file, config, model_dir, "--json").stdout)
    assert report["blocks_written"] == expected_blocks(PROMPTS, GPU_BLOCK) > 0
    assert Path(report["namespace"]).parent == cache
    (loaded,) = load_in_fresh_process(prompts_file, [config], tmp_path)
    for tokens, got in zip(PROMPTS, loaded):
        assert got["keys"] == got["hits"] == len(tokens) // GPU_BLOCK


def test_library_rejects_a_config_without_disk_tier(engine):
    from tiered_kv.config import TieredConfig

    with pytest.raises(WarmupError, match="no disk_path and no tiers entry of type disk"):
        warmup([PROMPTS[0]], engine, TieredConfig.from_dict({}))


def test_text_prompts_go_through_the_tokenizer(model_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    text = " ".join(words)
    ids = [i + 1 for i in range(40)]
    prompts_file, config = write_inputs(tmp_path, prompts=[ids])
    prompts_file.write_text(json.dumps({"text": text}) + "\n")
    report = json.loads(
        run_warmup(prompts_file, config, model_dir, "--tokenizer", str(tmp_path / "tok"), "--json").stdout
    )
    assert report["blocks_written"] == 2
    # The same tokens given as ids are already there.
    prompts_file.write_text(json.dumps({"token_ids": ids}) + "\n")
    again = json.loads(run_warmup(prompts_file, config, model_dir, "--json").stdout)
    assert (again["blocks_present"], again["blocks_written"]) == (2, 0)
    # A tenant's line: the same tokens under its salt are new blocks, keyed as vLLM keys
    # that tenant's requests; a rerun finds them.
    prompts_file.write_text(json.dumps({"text": text, "cache_salt": "tenant-a"}) + "\n")
    salted = json.loads(
        run_warmup(prompts_file, config, model_dir, "--tokenizer", str(tmp_path / "tok"), "--json").stdout
    )
    assert (salted["blocks_present"], salted["blocks_written"]) == (0, 2)
    (ns,) = open_cache(tmp_path / "cache").namespaces
    table = read_entries(ns)
    on_disk = {table.hash(i) for i in range(len(table))}
    hasher = PrefixHasher("sha256", resolve_seed("sha256", ""), GPU_BLOCK)
    assert on_disk == set(hasher.block_hashes(ids)) | set(hasher.block_hashes(ids, "tenant-a"))
    again = json.loads(
        run_warmup(prompts_file, config, model_dir, "--json", "--tokenizer", str(tmp_path / "tok")).stdout
    )
    assert (again["blocks_present"], again["blocks_written"]) == (2, 0)
