"""``tiered-kv config``: the printed kv-transfer-config and its arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import app
import tiered_kv.cli.config_cmd  # noqa: F401  (registers the command)
from tiered_kv.config_file import CONNECTOR
from tiered_kv.config import TieredConfig, parse_size

REPO = Path(__file__).resolve().parents[2]

runner = CliRunner()

LLAMA_8B = {
    "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "torch_dtype": "bfloat16",
}


def _run(*args: str):
    # wide enough that rich never wraps a table cell
    return runner.invoke(app, ["config", *args], env={"COLUMNS": "200"})


def _json(*args: str) -> dict:
    result = _run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_from_model_config_is_a_valid_tiered_config(tmp_path):
    model = tmp_path / "Llama-3.1-8B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**LLAMA_8B, "_name_or_path": "/fsx/users/someone/ckpt-1200"}))
    cfg = _json(
        "--model-config",
        str(model),
        "--cpu-bytes",
        "64GiB",
        "--disk-path",
        "/mnt/nvme/kv",
        "--disk-bytes",
        "1TiB",
        "--block-size",
        "32",
    )
    # Our connector with vLLM's recompute policy: each shared-tier hit read once.
    assert cfg["kv_connector"] == "TieredOffloadingConnector" and cfg["kv_role"] == "kv_both"
    assert cfg["kv_connector_module_path"] == "tiered_kv.integrations.vllm.connector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    extra = cfg["kv_connector_extra_config"]
    assert extra == {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "tiered_kv.integrations.vllm",
        "cpu_bytes": "64GiB",
        "disk_path": "/mnt/nvme/kv",
        "disk_bytes": "1TiB",
        "block_size": 32,
        "model_id": "Llama-3.1-8B-Instruct",
    }
    parsed = TieredConfig.from_dict(extra, passthrough_keys=("spec_name", "spec_module_path"))
    assert (parsed.cpu_bytes, parsed.disk_tier.settings.bytes, parsed.block_size) == (64 * 1024**3, 1024**4, 32)


def test_manual_geometry_table_shows_the_arithmetic():
    result = _run(
        "--layers",
        "80",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--tp",
        "4",
        "--cpu-bytes",
        "40GiB",
        "--block-size",
        "16",
        "--model-id",
        "llama-70b",
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    # 2 x 80 x (8/4) x 128 x 2 B = 81,920 B per token per rank; x16 = 1,310,720 B
    assert "2 x 80 x 2 x 128 x 2 B" in out and "81,920 B" in out
    assert "1,310,720 B" in out
    # 40 GiB / 1.25 MiB = 32,768 blocks = 524,288 tokens; node RAM 4 x 40 GiB
    assert "32,768 blocks = 524,288 tokens" in out
    assert "160.00 GiB" in out
    assert '"model_id": "llama-70b"' in out


def test_output_file_matches_stdout(tmp_path):
    target = tmp_path / "kv.json"
    cfg = _json(
        "--layers",
        "2",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--dtype",
        "float16",
        "--cpu-bytes",
        "1MiB",
        "--model-id",
        "tiny",
        "-o",
        str(target),
    )
    assert json.loads(target.read_text()) == cfg
    assert cfg["kv_connector_extra_config"]["model_id"] == "tiny"
    missing = tmp_path / "no-such-dir" / "kv.json"
    result = _run("--preset", "llama-3.1-8b", "-o", str(missing))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"error: --output {missing}: No such file or directory" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers", "32", "--kv-heads", "8"], "--head-dim: required without --model-config"),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tp", "3"],
            "tp: 3 does not divide the model's 8 KV heads",
        ),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--cpu-bytes", "lots"],
            "--cpu-bytes: cannot parse size 'lots'",
        ),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--cpu-bytes", "1MiB"],
            "cpu_bytes: 1048576 bytes hold no block",
        ),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--disk-bytes", "1TiB"],
            "--disk-bytes: needs --disk-path",
        ),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--disk-path", "/x"],
            "--disk-path: needs --disk-bytes",
        ),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--block-size", "20"],
            "block_size: 20 tokens is not a multiple of the GPU block size 16",
        ),
        (
            ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "int4"],
            "unknown KV-cache dtype 'int4'",
        ),
    ],
)
def test_bad_inputs_exit_2_with_the_reason(args, message):
    result = _run(*args)
    assert result.exit_code == 2
    assert message in result.stderr.replace("\n", " ")
    assert result.stdout == ""


def test_model_config_and_manual_geometry_conflict(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    result = _run("--model-config", str(tmp_path), "--layers", "2")
    assert result.exit_code == 2 and "--layers: give either --model-config" in result.stderr


# vllm-tiering-disk.json configures vLLM's own TieringOffloadingSpec with our disk tier
# below it; tests/integrations/test_vllm_secondary_tier.py checks it.
@pytest.mark.parametrize(
    "path",
    sorted(p for p in (REPO / "configs").glob("*.json") if p.name != "vllm-tiering-disk.json"),
    ids=lambda p: p.name,
)
def test_shipped_configs_are_valid(path):
    cfg = json.loads(path.read_text())
    assert {k: v for k, v in cfg.items() if k != "kv_connector_extra_config"} == CONNECTOR
    extra = cfg["kv_connector_extra_config"]
    parsed = TieredConfig.from_dict(extra, passthrough_keys=("spec_name", "spec_module_path"))
    assert parsed.cpu_bytes == parse_size(extra["cpu_bytes"])
    assert extra["spec_module_path"] == "tiered_kv.integrations.vllm"


GEOMETRY = ("--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--cpu-bytes", "1MiB", "--model-id", "tiny")


def test_a_shared_tier_without_a_key_is_refused_naming_the_options(tmp_path):
    target = tmp_path / "kv.json"
    result = _run(*GEOMETRY, "--remote-bucket", "kv-fleet", "-o", str(target))
    assert result.exit_code == 2 and result.stdout == ""
    said = " ".join(result.stderr.split())
    for option in ("--remote-key-file", "--remote-key-env", "--trusted-bucket", "openssl rand -hex 32"):
        assert option in said, said
    assert not target.exists()  # nothing the server would refuse is written
    both = _run(*GEOMETRY, "--remote-bucket", "kv-fleet", "--remote-key-file", "/k", "--remote-key-env", "K")
    assert both.exit_code == 2 and "not both" in both.stderr
    trusted_and_key = _run(*GEOMETRY, "--remote-bucket", "kv-fleet", "--remote-key-env", "K", "--trusted-bucket")
    assert trusted_and_key.exit_code == 2 and "--trusted-bucket" in trusted_and_key.stderr
    no_bucket = _run(*GEOMETRY, "--remote-key-env", "K")
    assert no_bucket.exit_code == 2 and "--remote-bucket: required with --remote-key-env" in no_bucket.stderr
    not_a_name = _run(*GEOMETRY, "--remote-bucket", "kv-fleet", "--remote-key-env", "ab" * 32)
    assert not_a_name.exit_code == 2 and "remote.key_env" in not_a_name.stderr
    assert "ab" * 32 not in not_a_name.stderr  # it may be the key itself: never echoed


def test_the_key_options_write_a_config_the_server_accepts(tmp_path, monkeypatch):
    target = tmp_path / "kv.json"
    monkeypatch.delenv("TIERED_KV_FLEET_KEY", raising=False)
    result = _run(
        *GEOMETRY, "--remote-bucket", "kv-fleet", "--remote-key-env", "TIERED_KV_FLEET_KEY", "-o", str(target)
    )
    assert result.exit_code == 0, result.output
    extra = json.loads(target.read_text())["kv_connector_extra_config"]
    assert extra["remote"] == {"bucket": "kv-fleet", "key_env": "TIERED_KV_FLEET_KEY"}
    cfg = TieredConfig.from_dict(extra, passthrough_keys=("spec_name", "spec_module_path"))
    remote = cfg.shared_tier.settings
    assert remote.key_env == "TIERED_KV_FLEET_KEY" and not remote.trusted_bucket
    # The variable is not set on this host: said, not refused (the server's environment has it).
    assert "TIERED_KV_FLEET_KEY is not set" in " ".join(result.stderr.split())

    key = tmp_path / "fleet.key"
    key.write_text("c3" * 32 + "\n")
    key.chmod(0o600)
    with_file = _json(*GEOMETRY, "--remote-bucket", "kv-fleet", "--remote-key-file", str(key))
    assert with_file["kv_connector_extra_config"]["remote"] == {"bucket": "kv-fleet", "key_file": str(key)}
    assert "c3" * 32 not in json.dumps(with_file)
    trusted = _run(*GEOMETRY, "--remote-bucket", "kv-fleet", "--trusted-bucket", "--json")
    assert trusted.exit_code == 0, trusted.output
    remote = json.loads(trusted.stdout)["kv_connector_extra_config"]["remote"]
    assert remote == {"bucket": "kv-fleet", "trusted_bucket": True} and "unencrypted" in trusted.stderr


def test_a_presets_prefill_estimate_counts_its_own_parameters():
    """A preset knows its parameters (intermediate and vocabulary sizes): a 70B model's
    estimate on 4 H100s is its own, not the 8B default (2.2x too fast a prefill)."""
    result = _run("--preset", "llama-3.1-70b", "--tp", "4", "--gpu", "H100 SXM")
    assert result.exit_code == 0, result.output
    assert "70.55e9 FLOP/token" in result.output and "14,018" in result.output
    assert "default for Llama-3.1-8B" not in result.output
