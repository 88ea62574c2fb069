"""``tiered-kv doctor --e2e``: a small real model continued from prefix KV loaded from each
tier equals its cold output, one line per case after the host checks. Without a config:
a CPU and a disk tier in a temporary directory, removed afterwards. With a config: its
disk tier tested in a scratch directory inside the configured one (nothing of it left,
the server's namespaces untouched), and its shared tier as configured: a reachable one
(the real Ceph RGW) passes; one nobody listens on is a skipped line saying why, never a
traceback."""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from support.s3_server import BUCKET, FLEET_KEY_ENV, missing_reason
from tiered_kv.cli import _load_commands, app

pytest.importorskip("transformers")
_load_commands()
runner = CliRunner()
CASES = ["computed", "cpu", "tier", "warmup", "recompute"]


def e2e_lines(*args: str) -> tuple[int, list[dict]]:
    result = runner.invoke(app, ["doctor", "--e2e", "--read-probe", "0", "--json", *args])
    assert "Traceback" not in result.output, result.output
    data = json.loads(result.stdout)
    return result.exit_code, [c for c in data["checks"] if c["name"] == "e2e"]


def write_config(path: Path, tiers: list[dict]) -> Path:
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm", "tiers": tiers}
    path.write_text(
        json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})
    )
    return path


def assert_passed(line: dict, tier: str, blocks: int = 16) -> None:
    assert line["status"] == "ok", line
    assert line["facts"]["tier"] == tier
    for m in line["facts"]["models"]:
        assert m["tokens_equal"] and m["tokens_matching"] == m["steps"] == 32, m
        assert m["max_logit_diff"] <= m["tolerance"] and m["kv_equal"], m
        assert m["sources"] == ({} if tier == "none" else {tier: blocks}), m
    assert "tokens equal llama 32/32, qwen2-gqa 32/32; max logit diff" in line["message"]


def scratch_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("tiered-kv-e2e-*"))


def test_without_a_config_cpu_and_disk_in_a_temporary_directory():
    before = scratch_dirs()
    _, lines = e2e_lines()
    assert [line["facts"]["case"] for line in lines] == CASES
    computed, cpu, disk, warm, recompute = lines
    assert_passed(computed, "none")
    assert_passed(cpu, "cpu")
    assert_passed(disk, "disk")
    assert_passed(warm, "disk")
    assert_passed(recompute, "disk")
    assert all(m["load_failed"] for m in recompute["facts"]["models"])
    assert "2 of 2 loads failed as they must" in recompute["message"]
    assert scratch_dirs() == before  # models and tiers removed


def test_a_shared_tier_nobody_listens_on_is_skipped_and_the_disk_tier_still_checked(tmp_path, s3_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server_dir = tmp_path / "nvme" / "cache"  # the server's directory: not created by the check
    remote = {
        "endpoint": f"http://127.0.0.1:{port}",
        "bucket": BUCKET,
        "key_env": FLEET_KEY_ENV,
        "connect_timeout": "0.2s",
        "request_timeout": "0.5s",
    }
    config = write_config(
        tmp_path / "kv.json",
        [{"type": "disk", "path": str(server_dir), "bytes": "1GiB"}, {"type": "remote", **remote}],
    )
    (tmp_path / "nvme").mkdir()
    result = runner.invoke(
        app, ["doctor", "--e2e", "--read-probe", "0", "--config", str(config)], env={"COLUMNS": "300"}
    )
    assert "Traceback" not in result.output, result.output
    lines = [ln.split(None, 2) for ln in result.stdout.splitlines() if ln.split()[1:2] == ["e2e"]]
    assert [(status, message.split(":")[0]) for status, _, message in lines] == [
        ("ok", "computed prefix (no tier)"),
        ("ok", "CPU tier"),
        ("ok", "tier disk"),
        ("skip", "skipped"),
        ("ok", "warm-up blocks (disk)"),
        ("ok", "failed load from tier disk, recomputed"),
    ]
    assert lines[3][2] == (
        "skipped: tier remote: the remote tier served none of the prefix's 16 blocks stored in it "
        "(not reachable, or it dropped them)"
    )
    assert lines[2][2].startswith("tier disk: tokens equal llama 32/32, qwen2-gqa 32/32; max logit diff")
    assert "2 of 2 loads failed as they must; tokens equal llama 32/32, qwen2-gqa 32/32" in lines[5][2]
    # The disk tier was tested on its own file system and nothing of it is left.
    assert list((tmp_path / "nvme").iterdir()) == []


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_a_reachable_shared_tier_passes(tmp_path, remote_settings):
    config = write_config(tmp_path / "kv.json", [{"type": "remote", **remote_settings}])
    code, lines = e2e_lines("--config", str(config))
    by_case = {line["facts"]["case"]: line for line in lines}
    assert list(by_case) == ["computed", "cpu", "tier", "warmup"]  # no disk tier: nothing to damage
    assert_passed(by_case["tier"], "remote")
    assert_passed(by_case["warmup"], "disk")
