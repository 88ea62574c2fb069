"""Never serve another model's KV: the namespace covers the model's weights and config.

A tiny randomly initialised Llama is saved into a directory; warmed blocks are found by a
fresh hierarchy with the same config, and not found (the log naming the weights digest)
once the weights or an activation-changing config field are replaced in place. The
digest of a multi-GB checkpoint reads a bounded number of bytes (counted at the one
reader function), and the warm-up refuses a model the config does not name.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from support.cli import run_cli, write_transfer_config
from tiered_kv import model_identity as mi
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.disk.format.namespace import list_namespaces

transformers = pytest.importorskip("transformers")

GPU_BLOCK = 16
HEADS, HEAD_DIM, LAYERS = 2, 16, 2
PROMPTS = [list(range(10, 60)), list(range(10, 40)) + list(range(500, 540))]
KEYS_PER_PROMPT = [3, 4]
DISTINCT_BLOCKS = 6  # the two prompts share their first block


def save_tiny_llama(path: Path, seed: int, **config) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        intermediate_size=128,
        vocab_size=1000,
        **config,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return save_tiny_llama(tmp_path / "model", seed=1)


def server_config(tmp_path: Path, model_dir: Path | None, **extra) -> TieredConfig:
    raw = {
        "cpu_bytes": "1MiB",
        "disk_path": str(tmp_path / "cache"),
        "disk_bytes": "8MiB",
        "block_size": GPU_BLOCK,
        "model_id": "tiny-llama",
        **extra,
    }
    if model_dir is not None:
        raw["model_path"] = str(model_dir)
    return TieredConfig.from_dict(raw)


def warm(model_dir: Path, config: TieredConfig, layout: str = "kv-first"):
    """Warm ``PROMPTS`` up; ``kv-first`` for ``hits_in_a_fresh_hierarchy``, ``vllm`` for
    what a vLLM server reads."""
    from tiered_kv.ops.warmup import warmup
    from tiered_kv.ops.warmup.engines import HFEngine

    torch.set_num_threads(1)
    engine = HFEngine.from_pretrained(str(model_dir), device="cpu")
    return warmup(PROMPTS, engine, config, gpu_block_size=GPU_BLOCK, layout=layout)


def hits_in_a_fresh_hierarchy(config: TieredConfig) -> list[int]:
    """Per prompt, the blocks a new ``HierarchySpec`` (scheduler and worker) over a
    device cache of the model's geometry finds on disk."""
    from tiered_kv.sim.driver import DeviceKVCache
    from tiered_kv.ops.hashing import PrefixHasher, chunk_keys, resolve_seed
    from tiered_kv.tiered.spec import HierarchySpec

    dev = DeviceKVCache(
        num_layers=LAYERS,
        num_gpu_blocks=16,
        gpu_block_size=GPU_BLOCK,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        kv_before_num_blocks=True,
        device="cpu",
    )
    with HierarchySpec(config, gpu_block_size=GPU_BLOCK) as spec:
        worker = spec.build_worker(dev.kv_caches, True)
        with spec.get_manager() as manager, worker:  # the worker shuts down first
            hasher = PrefixHasher("sha256", resolve_seed("sha256", ""), GPU_BLOCK)
            return [manager.lookup(chunk_keys(hasher.block_hashes(p), 1)) for p in PROMPTS]


# ---------------------------------------------------------------- the must-show cases


def test_weights_replaced_in_place_are_never_served(model_dir, tmp_path, caplog):
    config = server_config(tmp_path, model_dir)
    report = warm(model_dir, config)
    assert report.blocks_written == DISTINCT_BLOCKS
    assert report.weights_digest == mi.weights_digest(model_dir).digest
    assert hits_in_a_fresh_hierarchy(config) == KEYS_PER_PROMPT  # the control: same model, all hit
    old = mi.weights_digest(model_dir).digest

    save_tiny_llama(model_dir, seed=2)  # a fine-tune: same geometry, same path, other weights
    assert mi.weights_digest(model_dir).digest != old
    with caplog.at_level(logging.WARNING, logger="tiered_kv.disk.scheduler.manager"):
        assert hits_in_a_fresh_hierarchy(config) == [0, 0]
    (line,) = [r.getMessage() for r in caplog.records if "not serving disk cache namespace" in r.getMessage()]
    assert f"weights_digest: '{mi.weights_digest(model_dir).digest}' here, '{old}' in the cache" in line
    assert line.split(": ", 1)[1].startswith("weights_digest")  # the only field that differs
    # The old namespace is not deleted: it is simply no longer read.
    assert {ns.fingerprint.weights_digest for ns in list_namespaces(tmp_path / "cache")} >= {old}


def test_outside_vllm_a_config_without_model_path_must_say_the_weights_are_not_covered(model_dir, tmp_path):
    """A namespace without the weights would serve the old checkpoint's KV after new weights
    at the same path: such a config is refused unless it says so (``cover_weights: false``)."""
    silent = server_config(tmp_path, None)
    with pytest.raises(ConfigError, match=r"model_path: not set, .* or cover_weights: false"):
        hits_in_a_fresh_hierarchy(silent)
    assert not (tmp_path / "cache").exists() or not list_namespaces(tmp_path / "cache")  # nothing opened
    stated = server_config(tmp_path, None, cover_weights=False)
    assert warm(model_dir, stated).weights_digest is None
    assert hits_in_a_fresh_hierarchy(stated) == KEYS_PER_PROMPT
    (ns,) = list_namespaces(tmp_path / "cache")
    assert ns.fingerprint.weights_digest is None  # the namespace says it: not covered
    with pytest.raises(ConfigError, match=r"cover_weights: expected true or false"):
        TieredConfig.from_dict({"cover_weights": "perhaps"})


def test_a_config_json_change_that_changes_activations_is_never_served(model_dir, tmp_path, caplog):
    config = server_config(tmp_path, model_dir)
    warm(model_dir, config)
    old = mi.weights_digest(model_dir).digest
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_theta"] = 500000.0  # same geometry and weights, different keys after RoPE
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="tiered_kv.disk.scheduler.manager"):
        assert hits_in_a_fresh_hierarchy(config) == [0, 0]
    (line,) = [r.getMessage() for r in caplog.records if "not serving disk cache namespace" in r.getMessage()]
    assert "weights_digest:" in line and old in line


def test_the_log_names_model_id_when_only_the_model_id_differs(model_dir, tmp_path, caplog):
    warm(model_dir, server_config(tmp_path, model_dir))
    with caplog.at_level(logging.WARNING, logger="tiered_kv.disk.scheduler.manager"):
        assert hits_in_a_fresh_hierarchy(server_config(tmp_path, model_dir, model_id="other")) == [0, 0]
    (line,) = [r.getMessage() for r in caplog.records if "not serving disk cache namespace" in r.getMessage()]
    assert "model_id: 'other' here, 'tiny-llama' in the cache" in line
    assert "weights_digest" not in line


# ---------------------------------------------------------------- the digest itself


def _sparse_checkpoint(root: Path, shards: int, shard_bytes: int) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 80}))
    for i in range(shards):
        with open(root / f"model-{i:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.truncate(shard_bytes)  # sparse: no data blocks, reads as zeros
    (root / "tokenizer.json").write_text("{}")  # not part of the digest
    return root


def test_a_multi_gb_checkpoint_is_digested_from_a_bounded_number_of_bytes(tmp_path, monkeypatch):
    shards, shard_bytes = 6, 3 << 30  # 18 GiB of weights
    root = _sparse_checkpoint(tmp_path / "big", shards, shard_bytes)
    counted = []

    def counting_read_at(fd, length, offset):
        data = os.pread(fd, length, offset)
        counted.append(len(data))
        return data

    monkeypatch.setattr(mi, "read_at", counting_read_at)
    d = mi.weights_digest(root)
    config_bytes = (root / "config.json").stat().st_size
    assert (d.weight_files, d.weight_bytes, d.config_files) == (shards, shards * shard_bytes, ("config.json",))
    assert sum(counted) == d.bytes_read
    # Per shard: the 8-byte safetensors header length (0 here) and 8 samples of 64 KiB.
    assert d.bytes_read == shards * (8 + mi.SAMPLES * mi.SAMPLE_BYTES) + config_bytes
    assert d.bytes_read <= mi.max_bytes_read(shards, config_bytes) < (64 << 20)
    assert mi.weights_digest(root).digest == d.digest  # deterministic


def test_what_the_digest_covers_and_what_it_does_not(tmp_path):
    root = _sparse_checkpoint(tmp_path / "big", 2, 1 << 30)
    shard = root / "model-00000-of-00002.safetensors"
    base = mi.weights_digest(root).digest

    def poke(offset: int, data: bytes) -> str:
        with open(shard, "r+b") as f:
            f.seek(offset)
            f.write(data)
        return mi.weights_digest(root).digest

    step = ((1 << 30) - mi.SAMPLE_BYTES) // (mi.SAMPLES - 1)
    sampled = 3 * step + 100  # inside the fourth sample
    assert poke(sampled, b"\x01") != base
    assert poke(sampled, b"\x00") == base  # back as it was
    # Between samples: the documented blind spot (same size, same header, same samples).
    assert poke(3 * step + mi.SAMPLE_BYTES + 4096, b"\x01") == base
    # Size, names, the header, and the config are covered.
    with open(shard, "r+b") as f:
        f.truncate((1 << 30) + 4096)
    grown = mi.weights_digest(root).digest
    assert grown != base
    os.rename(shard, root / "renamed.safetensors")
    assert mi.weights_digest(root).digest not in (base, grown)
    (root / "generation_config.json").write_text('{"temperature": 0.1}')
    assert len({mi.weights_digest(root).digest, grown, base}) == 3
    (root / "tokenizer.json").write_text('{"changed": true}')  # tokenizers never change KV
    before = mi.weights_digest(root).digest
    (root / "README.md").write_text("notes")
    assert mi.weights_digest(root).digest == before


def test_a_hugging_face_cache_snapshot_counts_its_commit(tmp_path):
    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny"
    commits = {"main": "a" * 40, "v1": "b" * 40}
    for ref, commit in commits.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        save_tiny_llama(repo / "snapshots" / commit, seed=1)  # the same files at both commits
    main = mi.resolve_model_dir("org/tiny", download_dir=str(hub))
    v1 = mi.resolve_model_dir("org/tiny", "v1", download_dir=str(hub))
    assert (main, v1) == (repo / "snapshots" / commits["main"], repo / "snapshots" / commits["v1"])
    assert mi.resolve_model_dir("org/tiny", "b" * 40, download_dir=str(hub)) == v1
    assert mi.resolve_model_dir("org/tiny", "v2", download_dir=str(hub)) is None
    assert mi.weights_digest(main).snapshot == commits["main"]
    assert mi.weights_digest(main).digest != mi.weights_digest(v1).digest


def test_a_model_path_that_is_not_a_model_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    for path, words in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "holds no config.json")):
        with pytest.raises(ConfigError, match=f"model_path: .*{words}"):
            mi.weights_digest(path)


# ---------------------------------------------------------------- warm-up identity


def test_warmup_refuses_a_model_the_config_does_not_name(model_dir, tmp_path):
    from tiered_kv.ops.warmup.errors import WarmupError

    other = save_tiny_llama(tmp_path / "other", seed=3)
    with pytest.raises(WarmupError, match=r"^weights_digest: the config's model_path .* but --model .* has"):
        warm(other, server_config(tmp_path, model_dir))
    with pytest.raises(WarmupError, match=r"^model_id: the config sets none"):
        warm(
            model_dir,
            TieredConfig.from_dict(
                {"disk_path": str(tmp_path / "cache"), "block_size": GPU_BLOCK, "model_path": str(model_dir)}
            ),
        )
    assert not (tmp_path / "cache").exists(), "nothing is written before the identity is checked"
    # A copy of the same model elsewhere is the same model.
    import shutil

    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    assert warm(copy, server_config(tmp_path, model_dir)).blocks_written == DISTINCT_BLOCKS


def test_warmup_cli_names_the_namespace_and_the_identity(model_dir, tmp_path):
    from typer.testing import CliRunner

    from tiered_kv.cli import _load_commands, app

    _load_commands()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS))

    def run(extra: dict, model: Path, code: int, *args: str):
        config = tmp_path / "config.json"
        config.write_text(
            json.dumps({"disk_path": str(tmp_path / "cache"), "disk_bytes": "8MiB", "block_size": GPU_BLOCK, **extra})
        )
        result = CliRunner().invoke(
            app,
            ["warmup", str(prompts), "--model", str(model), "--config", str(config), "--device", "cpu", *args],
            env={"COLUMNS": "200"},
        )
        assert result.exit_code == code, result.output
        return result

    out = run({"model_id": "tiny-llama", "model_path": str(model_dir)}, model_dir, 0, "--json")
    report = json.loads(out.stdout)
    assert report["weights_digest"] == mi.weights_digest(model_dir).digest
    (ns,) = list_namespaces(tmp_path / "cache")
    assert report["namespace_id"] == ns.path.name and ns.fingerprint.weights_digest == report["weights_digest"]
    table = run({"model_id": "tiny-llama", "model_path": str(model_dir)}, model_dir, 0).stdout
    assert ns.path.name in table and f"tiny-llama @ main; weights {report['weights_digest']}" in table

    other = save_tiny_llama(tmp_path / "other", seed=5)
    refused = run({"model_id": "tiny-llama", "model_path": str(model_dir)}, other, 2)
    assert refused.stderr.startswith("error: weights_digest:") and len(refused.stderr.splitlines()) == 1
    assert "error: model_id: the config sets none" in run({"model_path": str(model_dir)}, model_dir, 2).stderr
    # Without model_path vLLM's namespace still covers the weights: it digests its --model.
    loose = json.loads(run({"model_id": "tiny-llama"}, model_dir, 0, "--json").stdout)
    assert loose["weights_digest"] == report["weights_digest"] and loose["namespace_id"] == report["namespace_id"]
    # tiered-kv's own engine covers them only with model_path, and the warm-up says so.
    kv_first = run({"model_id": "tiny-llama"}, model_dir, 0, "--layout", "kv-first")
    assert "not covered" in kv_first.stdout and f'add "model_path": "{model_dir}"' in kv_first.stderr


# ---------------------------------------------------------------- the operator's view


def test_inspect_marks_what_a_config_reads_and_clears_only_the_rest(model_dir, tmp_path):
    cache = tmp_path / "cache"
    base = {"disk_path": str(cache), "disk_bytes": "8MiB", "block_size": GPU_BLOCK}
    current = write_transfer_config(
        tmp_path / "current.json", {**base, "model_id": "tiny-llama", "model_path": str(model_dir)}
    )
    other = write_transfer_config(tmp_path / "other.json", {**base, "model_id": "other", "model_path": str(model_dir)})
    old_digest = mi.weights_digest(model_dir).digest
    warm(model_dir, server_config(tmp_path, model_dir), "vllm")  # the weights before the update
    save_tiny_llama(model_dir, seed=2)
    new_digest = mi.weights_digest(model_dir).digest
    warm(model_dir, server_config(tmp_path, model_dir), "vllm")
    warm(model_dir, server_config(tmp_path, model_dir, model_id="other"), "vllm")
    ids = {(ns.fingerprint.model_id, ns.fingerprint.weights_digest): ns.path.name for ns in list_namespaces(cache)}
    stale, live, others = ids["tiny-llama", old_digest], ids["tiny-llama", new_digest], ids["other", new_digest]

    data = json.loads(run_cli("inspect", "summary", str(cache), "--config", str(current), "--json").stdout)
    read = {ns["namespace"]: ns["read_by"][0] for ns in data["namespaces"]}
    assert read[live] == {"config": str(current), "reads": True, "differences": []}
    assert read[stale]["differences"] == [f"weights_digest: '{new_digest}' for the config, '{old_digest}' in the cache"]
    assert read[others]["differences"] == ["model_id: 'tiny-llama' for the config, 'other' in the cache"]
    table = run_cli("inspect", "summary", str(cache), "--config", str(current)).stdout
    assert old_digest in table and new_digest in table and "weights_digest: " in table

    # A vLLM config that names neither: --model stands for vLLM's --model.
    bare = write_transfer_config(tmp_path / "bare.json", base)
    data = json.loads(
        run_cli("inspect", "summary", str(cache), "--config", str(bare), "--model", str(model_dir), "--json").stdout
    )
    assert all(any(d.startswith("model_id: ") for d in ns["read_by"][0]["differences"]) for ns in data["namespaces"])

    cleared = json.loads(
        run_cli(
            "inspect", "clear", str(cache), "--unread-by", str(current), "--unread-by", str(other), "--yes", "--json"
        ).stdout
    )
    assert cleared["removed"] == [stale]
    assert sorted(ns.path.name for ns in list_namespaces(cache)) == sorted([live, others])
    bad = run_cli("inspect", "summary", str(cache), "--config", str(tmp_path / "nope.json"), code=2)
    assert "nope.json does not exist" in bad.stderr


def test_clear_keeps_namespaces_that_only_the_servers_own_flags_tell_apart(model_dir, tmp_path, monkeypatch):
    """A hash seed the config leaves to the server's ``PYTHONHASHSEED`` and the revision
    vLLM's ``--revision`` sets are the server's, not the config's: the tool cannot know
    them, so ``clear --unread-by`` keeps a namespace that differs only there."""
    cache = tmp_path / "cache"
    live = write_transfer_config(
        tmp_path / "live.json",
        {"disk_path": str(cache), "disk_bytes": "8MiB", "block_size": GPU_BLOCK, "model_id": "tiny-llama"},
    )
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    warm(model_dir, server_config(tmp_path, model_dir), "vllm")  # a server run with PYTHONHASHSEED=42
    monkeypatch.delenv("PYTHONHASHSEED")
    warm(model_dir, server_config(tmp_path, model_dir, model_revision="v2"), "vllm")  # `vllm serve --revision v2`
    seeds = sorted((ns.fingerprint.hash_seed, ns.fingerprint.model_revision) for ns in list_namespaces(cache))
    assert seeds == [("", "v2"), ("42", "main")]
    args = ("inspect", "clear", str(cache), "--unread-by", str(live), "--model", str(model_dir), "--yes", "--json")
    assert json.loads(run_cli(*args).stdout)["removed"] == [] and len(list_namespaces(cache)) == 2
    # A key set to null is unset, for vLLM and the server alike: a null block_size is one
    # GPU block per chunk, the namespaces' 16 tokens.
    null = write_transfer_config(
        tmp_path / "null.json",
        {"disk_path": str(cache), "disk_bytes": "8MiB", "block_size": None, "model_id": "tiny-llama"},
    )
    args = ("inspect", "clear", str(cache), "--unread-by", str(null), "--model", str(model_dir), "--yes", "--json")
    assert json.loads(run_cli(*args).stdout)["removed"] == [] and len(list_namespaces(cache)) == 2


def test_another_spelling_of_the_model_directory_reads_the_same_namespace(model_dir, tmp_path, monkeypatch):
    """vLLM records ``--model`` as the server was given it (here its absolute path); an
    operator's ``--model`` spelled another way (relative to where the tool runs) names the
    same directory, so ``clear --unread-by`` keeps that namespace and clears only another
    model's."""
    cache = tmp_path / "cache"
    warm(model_dir, server_config(tmp_path, model_dir, model_id=str(model_dir)), "vllm")  # vllm serve /abs/dir
    warm(model_dir, server_config(tmp_path, model_dir, model_id="another-model"), "vllm")
    ids = {ns.fingerprint.model_id: ns.path.name for ns in list_namespaces(cache)}
    bare = write_transfer_config(
        tmp_path / "bare.json", {"disk_path": str(cache), "disk_bytes": "8MiB", "block_size": GPU_BLOCK}
    )
    monkeypatch.chdir(model_dir.parent)
    model = f"./{model_dir.name}"
    data = json.loads(
        run_cli("inspect", "summary", str(cache), "--config", str(bare), "--model", model, "--json").stdout
    )
    read = {ns["namespace"]: ns["read_by"][0]["differences"] for ns in data["namespaces"]}
    assert read[ids[str(model_dir)]] == []
    assert read[ids["another-model"]] == [f"model_id: {model!r} for the config, 'another-model' in the cache"]
    args = ("inspect", "clear", str(cache), "--unread-by", str(bare), "--model", model, "--yes", "--json")
    assert json.loads(run_cli(*args).stdout)["removed"] == [ids["another-model"]]
    assert [ns.path.name for ns in list_namespaces(cache)] == [ids[str(model_dir)]]


def test_a_hub_ids_weights_are_not_judged_by_the_configs_revision(tmp_path, monkeypatch):
    """The server digests the snapshot of vLLM's ``--revision`` (``main`` without one),
    never the config's ``model_revision``: a tool given a hub id cannot know which, so it
    pins no digest for it (a directory's it does)."""
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = hub / "models--org--tiny"
    for ref, commit, seed in (("main", "a" * 40, 1), ("v2", "b" * 40, 2)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        save_tiny_llama(repo / "snapshots" / commit, seed=seed)
    extra = {"disk_path": str(tmp_path / "cache"), "model_revision": "v2"}
    assert "weights_digest" not in mi.pinned_fields(extra, model="org/tiny")
    assert mi.pinned_fields(extra, model="org/tiny")["model_id"] == "org/tiny"
    snapshot = repo / "snapshots" / ("b" * 40)
    assert mi.pinned_fields(extra, model=str(snapshot))["weights_digest"] == mi.weights_digest(snapshot).digest
    with pytest.raises(ConfigError, match="--model: 'org/missing' is neither a directory nor in the local"):
        mi.pinned_fields(extra, model="org/missing")


def test_config_command_takes_the_model_from_its_directory_and_prints_the_namespace(model_dir, tmp_path):
    args = (
        "config",
        "--model-config",
        str(model_dir),
        "--cpu-bytes",
        "1MiB",
        "--disk-path",
        str(tmp_path / "cache"),
        "--disk-bytes",
        "8MiB",
        "--block-size",
        str(GPU_BLOCK),
        "--gpu-block-size",
        str(GPU_BLOCK),
    )
    extra = json.loads(run_cli(*args, "--json").stdout)["kv_connector_extra_config"]
    assert extra["model_path"] == str(model_dir.absolute())
    assert extra["model_id"] not in ("", "unknown")
    out = run_cli(*args, "--model-id", "tiny-llama", "-o", str(tmp_path / "config.json")).stdout
    digest = mi.weights_digest(model_dir).digest
    assert f"model_id 'tiny-llama' @ main; weights {digest}" in out
    printed = out.split("kv-first namespace ", 1)[1].split(":")[0]
    served = out.split("vLLM namespace ", 1)[1].split(":")[0]
    # The warm-up with that very file writes the namespace the command printed.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": PROMPTS[0]}) + "\n")
    report = json.loads(
        run_cli(
            "warmup",
            str(prompts),
            "--model",
            str(model_dir),
            "--config",
            str(tmp_path / "config.json"),
            "--device",
            "cpu",
            "--layout",
            "kv-first",
            "--json",
        ).stdout
    )
    assert report["namespace_id"] == printed and report["weights_digest"] == digest
    # The default warm-up writes what a vLLM server with that config reads, as printed.
    default = json.loads(
        run_cli(
            "warmup",
            str(prompts),
            "--model",
            str(model_dir),
            "--config",
            str(tmp_path / "config.json"),
            "--device",
            "cpu",
            "--json",
        ).stdout
    )
    assert default["namespace_id"] == served != printed
    # No model at all: the id is required, never "unknown".
    err = run_cli("config", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--cpu-bytes", "1MiB", code=2)
    assert "--model-id: required" in err.stderr
