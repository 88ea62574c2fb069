"""``tiered-kv config --attention-backend``: two servers differing only in attention backend
get different namespace ids, the command prints both, and each is the namespace a vLLM
server on that backend opens (vLLM 0.33's real connector). Marked ``vllm``."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import app
import tiered_kv.cli.config_cmd  # noqa: F401  (registers the command)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

runner = CliRunner()


@pytest.fixture
def model_dir(tmp_path):
    """A small Llama directory with a weights file (the vLLM namespace covers its digest)."""
    import torch
    from safetensors.torch import save_file
    from support import vllm_harness as vh

    path = vh.write_model_config(tmp_path / "model")
    save_file({"w": torch.ones(4)}, str(path / "model.safetensors"))
    return path


def _config(model_dir, tmp_path, *more: str):
    args = ["config", "--model-config", str(model_dir), "--cpu-bytes", "1MiB"]
    args += ["--disk-path", str(tmp_path / "cache"), "--disk-bytes", "8MiB", *more]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    return result


def _namespaces(out: str) -> dict[str, str]:
    """Printed vLLM namespace id -> the rest of its line."""
    return dict(re.findall(r"^vLLM namespace ([0-9a-f]{16}): (.*)$", out, re.M))


def test_two_attention_backends_print_two_namespace_ids(model_dir, tmp_path):
    both = _config(model_dir, tmp_path, "--attention-backend", "flash_attn", "--attention-backend", "CPU_ATTN")
    assert both.exit_code == 0, both.output
    printed = _namespaces(both.stdout)
    assert len(printed) == 2, both.stdout
    by_backend = {re.search(r"--attention-backend (\w+)", line)[1]: ns for ns, line in printed.items()}
    assert set(by_backend) == {"FLASH_ATTN", "CPU_ATTN"}
    # The layout vLLM resolves for each: FlashAttention declares none (vLLM prefers LBNHC),
    # the CPU backend reads LBHNC only.
    assert "KV-cache layout LBNHC" in printed[by_backend["FLASH_ATTN"]]
    assert "KV-cache layout LBHNC" in printed[by_backend["CPU_ATTN"]]
    # One backend: its namespace alone, and the serve line starts the server on it.
    one = _config(model_dir, tmp_path, "--attention-backend", "CPU_ATTN")
    assert list(_namespaces(one.stdout)) == [by_backend["CPU_ATTN"]]
    assert "--attention-backend CPU_ATTN --kv-transfer-config" in " ".join(one.stdout.split())
    # Without the option: vLLM's choice on this host, FLASH_ATTN where vLLM selects none.
    default = _config(model_dir, tmp_path)
    (line,) = _namespaces(default.stdout).items()
    assert line[0] == by_backend["FLASH_ATTN"] and "attention backend FLASH_ATTN" in line[1]
    assert "--attention-backend" not in default.stdout.split("vllm serve", 1)[1].split("--kv-transfer-config")[0]


def test_an_unknown_attention_backend_is_refused_with_the_names_vllm_knows(model_dir, tmp_path):
    bad = _config(model_dir, tmp_path, "--attention-backend", "FAST_ATTN")
    assert bad.exit_code == 2
    assert bad.stderr.startswith("error: --attention-backend: expected one of vLLM's attention backends (FLASH_ATTN,")
    assert "got 'FAST_ATTN'" in bad.stderr


def test_the_printed_namespace_is_the_one_a_server_on_that_backend_opens(model_dir, tmp_path):
    from support import vllm_harness as vh
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    written = tmp_path / "kv.json"
    result = _config(model_dir, tmp_path, "--attention-backend", "CPU_ATTN", "-o", str(written))
    (printed,) = _namespaces(result.stdout)
    extra = json.loads(written.read_text())["kv_connector_extra_config"]
    # vllm serve DIR --attention-backend CPU_ATTN: the engine core resolves CPU_ATTN's layout.
    config = vh.make_vllm_config(model_dir, extra, kv_cache_layout="LBHNC")
    config.attention_config.backend = AttentionBackendEnum.CPU_ATTN
    scheduler = OffloadingConnector(config, KVConnectorRole.SCHEDULER, vh.make_kv_cache_config(config, 64))
    try:
        disk = scheduler.connector_scheduler.manager.composite.tier("disk")
        assert disk.namespace.path.name == printed
        assert disk.namespace.fingerprint.attention_backend == "CPU_ATTN"
    finally:
        scheduler.shutdown()
