"""``tiered-kv config`` gives a ``vllm serve`` line that runs as printed and a config an
operator does not have to correct: the KV-cache dtype on the line, the model's own name
(not a stale ``_name_or_path``), TieredConfig's default CPU size, a warning without a disk
tier, the shared tier from ``--remote-*``, and hybrid models sized by their
full-attention layers (or refused with the reason)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tiered_kv.cli.config_cmd  # noqa: F401  (registers the command)
from tiered_kv.cli import app
from tiered_kv.config import TieredConfig, parse_size
from tiered_kv.ops.sizing import ModelGeometry

runner = CliRunner()
README = Path(__file__).resolve().parents[2] / "README.md"

HYBRID = {
    "_name_or_path": "/fsx/users/someone/run-7/checkpoint-1200",
    "model_type": "gemma3_text",
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 512,
    "torch_dtype": "bfloat16",
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
}


def _run(*args: str):
    return runner.invoke(app, ["config", *args], env={"COLUMNS": "200"})


def _serve_line(stdout: str) -> str:
    return next(ln for ln in stdout.splitlines() if ln.startswith("vllm serve "))


def _model(tmp_path: Path, name: str, config: dict) -> Path:
    model = tmp_path / name
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_fp8_sizing_puts_the_kv_cache_dtype_on_the_serve_line(tmp_path):
    fp8 = _run("--preset", "llama-3.1-8b", "--dtype", "fp8", "--disk-path", "/mnt/nvme/kv", "--disk-bytes", "1TiB")
    assert fp8.exit_code == 0, fp8.output
    assert "2 x 32 x 8 x 128 x 1 B" in fp8.stdout
    line = _serve_line(fp8.stdout)
    assert line.startswith("vllm serve meta-llama/Llama-3.1-8B-Instruct ") and " --kv-cache-dtype fp8 " in line
    # The model's own dtype needs no flag; another one is vLLM's --dtype.
    same = _serve_line(_run("--preset", "llama-3.1-8b", "--dtype", "bfloat16").stdout)
    assert "--dtype" not in same and "--kv-cache-dtype" not in same
    half = _serve_line(_run("--preset", "llama-3.1-8b", "--dtype", "fp16").stdout)
    assert " --dtype float16 " in half
    # vLLM serves a float32 model in a 16-bit dtype unless told: sized at 4 B, the line says so.
    model = _model(tmp_path, "fp32-model", {**HYBRID, "layer_types": None, "torch_dtype": "float32"})
    assert " --dtype float32 " in _serve_line(_run("--model-config", str(model)).stdout)
    refused = _run("--preset", "llama-3.1-8b", "--dtype", "int8")
    assert refused.exit_code == 2 and "vLLM has no 'int8' KV cache" in refused.stderr


def test_model_id_is_the_directory_or_hub_id_never_a_stale_path(tmp_path):
    model = _model(tmp_path, "Llama-3.1-8B-Instruct", {**HYBRID, "layer_types": None})
    result = _run("--model-config", str(model), "--json")
    extra = json.loads(result.stdout)["kv_connector_extra_config"]
    assert extra["model_id"] == "Llama-3.1-8B-Instruct" and "/fsx" not in result.stdout
    snapshot = _model(tmp_path, "hub/models--acme--Tiny-Chat/snapshots/0123abcd", {**HYBRID, "layer_types": None})
    extra = json.loads(_run("--model-config", str(snapshot / "config.json"), "--json").stdout)
    assert extra["kv_connector_extra_config"]["model_id"] == "acme/Tiny-Chat"
    table = _run("--model-config", str(model))
    assert "KV sizing: Llama-3.1-8B-Instruct" in table.stdout and f"vllm serve {model} " in table.stdout


def test_the_default_cpu_size_is_tiered_configs_and_readmes():
    extra = json.loads(_run("--preset", "qwen2.5-7b", "--json").stdout)["kv_connector_extra_config"]
    assert parse_size(extra["cpu_bytes"]) == TieredConfig().cpu_bytes == 4 << 30
    assert f"| `cpu_bytes` | `{extra['cpu_bytes']}` |" in README.read_text()


def test_no_disk_tier_is_a_warning_and_the_remote_options_add_a_shared_tier():
    result = _run(
        "--preset",
        "llama-3.1-8b",
        "--remote-endpoint",
        "http://rgw.internal:8000",
        "--remote-bucket",
        "kv-cache",
        "--remote-prefix",
        "prod",
        "--remote-key-file",
        "/etc/tiered-kv/fleet.key",
        "--json",
    )
    assert result.exit_code == 0, result.output
    assert "warning: no disk tier (no --disk-path)" in result.stderr
    extra = json.loads(result.stdout)["kv_connector_extra_config"]
    assert extra["remote"] == {
        "endpoint": "http://rgw.internal:8000",
        "bucket": "kv-cache",
        "prefix": "prod",
        "key_file": "/etc/tiered-kv/fleet.key",
    }
    cfg = TieredConfig.from_dict(extra, passthrough_keys=("spec_name", "spec_module_path"))
    assert cfg.shared_tier.settings.bucket == "kv-cache" and cfg.shared_tier.settings.prefix == "prod"
    missing = _run("--preset", "llama-3.1-8b", "--remote-endpoint", "http://rgw:8000")
    assert missing.exit_code == 2 and "--remote-bucket: required with --remote-endpoint" in missing.stderr
    bad = _run("--preset", "llama-3.1-8b", "--remote-bucket", "No_Such", "--remote-key-env", "FLEET_KEY")
    assert bad.exit_code == 2 and "bucket" in bad.stderr and bad.stderr.count("\n") == 1


def test_a_hybrid_model_is_sized_by_its_full_attention_layers(tmp_path):
    g = ModelGeometry.from_hf_config(HYBRID, full_attention_only=True)
    assert g.num_layers == 2 and g.other_layers == (("sliding_attention", 6),)
    assert ModelGeometry.from_hf_config(HYBRID).num_layers == 8  # every layer, for the warm-up's engines
    assert g.kv_bytes_per_token() == 2 * 2 * 2 * 64 * 2
    model = _model(tmp_path, "hybrid", HYBRID)
    result = _run("--model-config", str(model), "--disk-path", str(tmp_path / "kv"), "--disk-bytes", "1GiB")
    assert result.exit_code == 0, result.output
    assert "2 full-attention layers (not counted: 6 sliding_attention)" in result.stdout
    assert "warning: sized by the model's 2 full-attention layers" in result.stderr


@pytest.mark.parametrize(
    "config, words",
    [
        ({**HYBRID, "layer_types": ["sliding_attention"] * 8}, "no full-attention layer"),
        ({**HYBRID, "layer_types": None, "sliding_window": 4096}, "every layer uses a sliding window of 4096"),
        ({**HYBRID, "layer_types": ["full_attention"] * 3}, "layer_types lists 3 layers"),
    ],
)
def test_models_without_full_attention_are_refused_with_the_reason(tmp_path, config, words):
    model = _model(tmp_path, "m", config)
    result = _run("--model-config", str(model))
    assert result.exit_code == 2 and words in result.stderr and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_a_disabled_sliding_window_is_full_attention():
    qwen = {**HYBRID, "layer_types": None, "sliding_window": 131072, "use_sliding_window": False}
    assert ModelGeometry.from_hf_config(qwen, full_attention_only=True).num_layers == 8
