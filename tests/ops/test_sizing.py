"""KV sizing arithmetic against hand-computed values for published model geometries."""

from __future__ import annotations

import json

import pytest

from tiered_kv.config import ConfigError
from tiered_kv.ops.sizing import ModelGeometry, dtype_bytes, plan_tiers

GiB = 1024**3

# Published HF configs, abbreviated to the keys that matter (values as on the hub).
LLAMA_31_8B = {
    "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "torch_dtype": "bfloat16",
}
LLAMA_31_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 80,
    "torch_dtype": "bfloat16",
}
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "torch_dtype": "bfloat16",
}
# Qwen3-8B states head_dim explicitly (128 = 4096 / 32 here, but taken from the key).
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 36,
    "torch_dtype": "bfloat16",
}
# Mistral-Nemo: head_dim 128 although hidden_size / heads = 5120 / 32 = 160.
MISTRAL_NEMO = {
    "model_type": "mistral",
    "hidden_size": 5120,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 40,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    "config, layers, kv_heads, head_dim, per_token",
    [
        # 2 (K,V) x layers x kv_heads x head_dim x 2 bytes
        (LLAMA_31_8B, 32, 8, 128, 131_072),  # 128 KiB
        (LLAMA_31_70B, 80, 8, 128, 327_680),  # 320 KiB
        (QWEN25_7B, 28, 4, 128, 57_344),  # 56 KiB
        (QWEN3_8B, 36, 8, 128, 147_456),  # 144 KiB
        (MISTRAL_NEMO, 40, 8, 128, 163_840),  # 160 KiB, not 200 KiB
    ],
    ids=["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen3-8b", "mistral-nemo"],
)
def test_kv_bytes_per_token_from_hf_configs(config, layers, kv_heads, head_dim, per_token):
    g = ModelGeometry.from_hf_config(config)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype_bytes) == (layers, kv_heads, head_dim, 2)
    assert g.kv_bytes_per_token() == per_token


def test_head_dim_absent_is_hidden_over_heads_and_mha_without_kv_heads():
    g = ModelGeometry.from_hf_config(
        {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768, "torch_dtype": "float16"}
    )
    assert (g.num_kv_heads, g.head_dim) == (12, 64)
    assert g.kv_bytes_per_token() == 2 * 12 * 12 * 64 * 2 == 36_864


def test_config_file_directory_and_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert ModelGeometry.from_hf_config(tmp_path).kv_bytes_per_token() == 131_072
    # A file's model is named by its directory, never by a _name_or_path the checkpoint carried.
    assert ModelGeometry.from_hf_config(tmp_path / "config.json").name == tmp_path.name
    assert ModelGeometry.from_hf_config(LLAMA_31_8B).name == LLAMA_31_8B["_name_or_path"]
    wrapped = {
        "model_type": "mistral3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_size": 5120,
        },
    }
    g = ModelGeometry.from_hf_config(wrapped)
    assert (g.num_layers, g.dtype) == (40, "bfloat16")


def test_tensor_parallel_splits_kv_heads_and_replicates_beyond_them():
    g = ModelGeometry(80, 8, 128, "bfloat16")
    assert g.kv_bytes_per_token(4) == 327_680 // 4 == 81_920
    assert g.kv_bytes_per_token(8) == 40_960
    # TP 16 > 8 KV heads: each rank still holds one head
    assert g.kv_bytes_per_token(16) == 40_960
    with pytest.raises(ConfigError, match="tp: 3 does not divide the model's 8 KV heads"):
        g.kv_bytes_per_token(3)
    with pytest.raises(ConfigError, match="tp: 12 is larger than"):
        g.kv_bytes_per_token(12)


def test_dtype_override_and_spellings():
    assert dtype_bytes("torch.float16") == 2 and dtype_bytes("FP8") == 1 and dtype_bytes("fp32") == 4
    g = ModelGeometry.from_hf_config(LLAMA_31_8B, dtype="fp8")
    assert g.kv_bytes_per_token() == 65_536
    with pytest.raises(ConfigError, match="unknown KV-cache dtype 'int3'"):
        dtype_bytes("int3")


def test_plan_llama_8b_one_h100():
    # 16-token blocks of 128 KiB/token = 2 MiB; 64 GiB CPU and 1 TiB disk per rank
    plan = plan_tiers(
        ModelGeometry.from_hf_config(LLAMA_31_8B), block_size=16, cpu_bytes=64 * GiB, disk_bytes=1024 * GiB
    )
    assert plan.block_bytes == 2 * 1024**2 == plan.disk_slot_bytes
    assert (plan.cpu_blocks, plan.cpu_tokens) == (32_768, 524_288)
    assert (plan.disk_blocks, plan.disk_tokens) == (524_288, 8_388_608)


def test_plan_pads_disk_slots_to_4k():
    # 3 layers x 1 KV head x 100 dim x 2 B x 2 = 1200 B/token; 16 tokens = 19,200 B
    plan = plan_tiers(
        ModelGeometry(3, 1, 100, "float16"), block_size=16, cpu_bytes=192_000, disk_bytes=20_480 * 3 + 100
    )
    assert plan.block_bytes == 19_200 and plan.disk_slot_bytes == 20_480
    assert plan.cpu_blocks == 10 and plan.disk_blocks == 3


def test_plan_rejects_useless_or_inconsistent_budgets():
    g = ModelGeometry(32, 8, 128, "bfloat16")
    with pytest.raises(ConfigError, match=r"cpu_bytes: 1000 bytes hold no block; one 16-token block is 2097152"):
        plan_tiers(g, cpu_bytes=1000)
    with pytest.raises(ConfigError, match="disk_bytes: 4096 bytes hold no block"):
        plan_tiers(g, cpu_bytes=GiB, disk_bytes=4096)
    with pytest.raises(
        ConfigError, match="block_size: 24 tokens is not a multiple of the GPU block size 16; use a multiple such as 32"
    ):
        plan_tiers(g, cpu_bytes=GiB, block_size=24)
    with pytest.raises(ConfigError, match="cpu_bytes: expected a positive integer, got 0"):
        plan_tiers(g, cpu_bytes=0)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_attention_heads": 8, "hidden_size": 512}, "missing 'num_hidden_layers'"),
        (
            {"num_hidden_layers": 2, "num_attention_heads": 6, "hidden_size": 512},
            "hidden_size 512 is not a multiple of num_attention_heads 6",
        ),
        (
            {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "num_key_value_heads": 0},
            "num_key_value_heads: expected a positive integer, got 0",
        ),
        (
            {"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512},
            "missing 'qk_rope_head_dim'",
        ),  # an MLA latent needs both parts
        (
            {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "torch_dtype": "float64"},
            "unknown KV-cache dtype 'float64'",
        ),
    ],
)
def test_bad_configs_name_the_problem(config, message):
    with pytest.raises(ConfigError, match=message):
        ModelGeometry.from_hf_config(config)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ModelGeometry.from_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ModelGeometry.from_hf_config(tmp_path)
