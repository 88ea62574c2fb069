"""``tiered-kv config`` with built-in presets and a local ``config.json``: the published
geometries give the known KV bytes per token (MLA included), the printed ``vllm serve``
line names the model, and tier sizes beyond this host's memory or free disk draw a
warning."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import app
from tiered_kv.config import ConfigError
from tiered_kv.ops.doctor import free_space, memory_limit
from tiered_kv.ops.presets import PRESETS, find_preset
from tiered_kv.ops.sizing import ModelGeometry, plan_tiers

runner = CliRunner()


def config(*args: str):
    return runner.invoke(app, ["config", *args], env={"COLUMNS": "400"})


# Bytes of KV per token on one rank at TP 1: 2 (K, V) x layers x KV heads x head_dim x 2 B
# for the GQA models, layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B for DeepSeek-V3.
@pytest.mark.parametrize(
    "name, per_token",
    [
        ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),
        ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),
        ("llama-3.1-405b", 2 * 126 * 8 * 128 * 2),
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),
        ("qwen2.5-72b", 2 * 80 * 8 * 128 * 2),
        ("mistral-7b", 2 * 32 * 8 * 128 * 2),
        ("deepseek-v3", 61 * 576 * 2),
    ],
)
def test_presets_give_the_published_kv_size(name, per_token):
    assert PRESETS[name].geometry.kv_bytes_per_token(1) == per_token


def test_tp_splits_kv_heads_but_not_an_mla_latent():
    llama = PRESETS["llama-3.1-70b"].geometry
    assert llama.kv_bytes_per_token(8) == llama.kv_bytes_per_token(1) // 8
    deepseek = PRESETS["deepseek-v3"].geometry
    assert deepseek.mla and deepseek.kv_bytes_per_token(8) == deepseek.kv_bytes_per_token(1) == 70_272
    plan = plan_tiers(deepseek, tp=8, cpu_bytes=64 << 30)
    assert plan.block_bytes == 16 * 70_272


def test_find_preset_by_name_or_hub_id():
    assert find_preset("Llama-3.1-8B").model == "meta-llama/Llama-3.1-8B-Instruct"
    assert find_preset("deepseek-ai/deepseek-v3").name == "deepseek-v3"
    with pytest.raises(ConfigError, match="no preset 'gpt-9'; expected one of llama-3.1-8b"):
        find_preset("gpt-9")


def test_preset_prints_the_config_and_a_serve_line_naming_the_model():
    result = config("--preset", "llama-3.1-70b", "--tp", "4", "--cpu-bytes", "40GiB")
    assert result.exit_code == 0, result.output
    assert "2 x 80 x 2 x 128 x 2 B" in result.stdout and "81,920 B" in result.stdout
    serve = next(ln for ln in result.stdout.splitlines() if ln.startswith("vllm serve "))
    assert serve.startswith("vllm serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 4 ")
    extra = json.loads(serve.split("--kv-transfer-config '", 1)[1].rstrip("'"))["kv_connector_extra_config"]
    assert extra["model_id"] == "meta-llama/Llama-3.1-70B-Instruct"


def test_mla_preset_shows_the_latent_arithmetic():
    result = config("--preset", "deepseek-v3", "--tp", "8", "--cpu-bytes", "64GiB")
    assert result.exit_code == 0, result.output
    assert "61 x 576 x 2 B" in result.stdout and "70,272 B" in result.stdout
    assert "MLA latent of 576" in result.stdout


def test_a_local_config_json_by_path(tmp_path):
    model = tmp_path / "my-mla-model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "deepseek_v2",
                "num_hidden_layers": 27,
                "num_attention_heads": 16,
                "hidden_size": 2048,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "torch_dtype": "bfloat16",
            }
        )
    )
    geometry = ModelGeometry.from_hf_config(model / "config.json")
    assert geometry.mla and geometry.kv_bytes_per_token() == 27 * 576 * 2
    for path in (model, model / "config.json"):
        result = config("--model-config", str(path), "--cpu-bytes", "8GiB", "--model-id", "my-mla-model")
        assert result.exit_code == 0, result.output
        assert f"vllm serve {model} " in result.stdout


def test_preset_and_model_config_conflict(tmp_path):
    result = config("--preset", "mistral-7b", "--model-config", str(tmp_path))
    assert result.exit_code == 2 and "--preset: give either --preset or --model-config" in result.stderr


def test_sizes_beyond_this_host_warn(tmp_path):
    ram = memory_limit()
    too_much_ram = f"{ram // (1 << 30) + 1}GiB"
    result = config("--preset", "qwen2.5-7b", "--cpu-bytes", too_much_ram)
    assert result.exit_code == 0, result.output
    assert "warning: the CPU tier takes TP 1 x" in result.stderr and "more than this host's" in result.stderr
    too_much_disk = f"{free_space(tmp_path) // (1 << 30) + 1}GiB"
    result = config(
        "--preset",
        "qwen2.5-7b",
        "--cpu-bytes",
        "1GiB",
        "--disk-path",
        str(tmp_path / "kv"),
        "--disk-bytes",
        too_much_disk,
    )
    assert result.exit_code == 0, result.output
    assert "warning: the disk tier takes" in result.stderr and str(tmp_path / "kv") in result.stderr
    quiet = config(
        "--preset", "qwen2.5-7b", "--cpu-bytes", "1GiB", "--disk-path", str(tmp_path / "kv"), "--disk-bytes", "1GiB"
    )
    assert "warning" not in quiet.stderr
