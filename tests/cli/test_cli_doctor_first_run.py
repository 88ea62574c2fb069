"""``tiered-kv doctor`` on a host where the server never ran: the disk is timed in the
nearest existing parent of a disk tier's directory that does not exist yet (creating
nothing), a check that could not run says "skipped", a broken config gives its error line
and no "pass --config", an assumed TP is a warning, ``config`` and ``doctor`` print one
break-even, and other libraries' log lines stay off stderr unless ``--verbose``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "tiered-kv"
#: Llama-3.1-8B's config.json: every field the geometry and the parameter count read.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def doctor_json(*args: str) -> tuple[int, dict[str, dict]]:
    result = runner.invoke(app, ["doctor", *args, "--json"])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def write_config(path: Path, disk_path: Path, **extra: object) -> Path:
    path.write_text(
        json.dumps(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieredOffloadingSpec",
                    "spec_module_path": "tiered_kv.integrations.vllm",
                    "cpu_bytes": "1GiB",
                    "disk_path": str(disk_path),
                    "disk_bytes": "64MiB",
                    "model_id": "meta-llama/Llama-3.1-8B-Instruct",
                    **extra,
                },
            }
        )
    )
    return path


def timed(line: dict) -> dict:
    if line["status"] == "skip" and "O_DIRECT probe" in line["message"]:
        pytest.skip(f"this file system refuses O_DIRECT: {line['message']}")
    return line


def test_a_disk_tier_not_created_yet_is_timed_in_its_nearest_existing_parent(tmp_path):
    mount = tmp_path / "nvme"
    mount.mkdir()
    disk = mount / "tiered-kv"
    cfg = write_config(tmp_path / "kv.json", disk)
    _, checks = doctor_json("--config", str(cfg), "--tp", "1", "--read-probe", "4MiB")
    line = timed(checks["disk_read"])
    assert line["status"] in ("ok", "warn"), line
    assert f"(timed in {mount}, the nearest existing parent)" in line["message"], line["message"]
    assert re.search(r"reads \d+\.\d\d GB/s", line["message"]) and line["facts"]["read_gbps"] > 0
    assert line["facts"]["timed_in"] == str(mount) and "break-even of" in line["message"]
    assert not disk.exists() and list(mount.iterdir()) == []  # nothing made, no probe file left


def test_an_existing_disk_tier_is_timed_in_itself(tmp_path):
    disk = tmp_path / "kv"
    disk.mkdir()
    _, checks = doctor_json("--config", str(write_config(tmp_path / "kv.json", disk)), "--read-probe", "4MiB")
    line = timed(checks["disk_read"])
    assert "nearest existing parent" not in line["message"] and line["facts"]["timed_in"] == str(disk)
    assert list(disk.iterdir()) == []


def test_checks_that_could_not_run_say_skipped_never_ok(tmp_path):
    cfg = write_config(tmp_path / "kv.json", tmp_path / "kv")
    _, checks = doctor_json("--config", str(cfg), "--tp", "1", "--read-probe", "0")
    assert checks["disk_read"]["status"] == "skip"
    assert checks["disk_read"]["message"] == "skipped: disk read speed not timed (--read-probe 0)"
    assert checks["remote"]["status"] == "skip" and "no shared tier" in checks["remote"]["message"]
    result = runner.invoke(app, ["doctor", "--config", str(cfg), "--read-probe", "0"], env={"COLUMNS": "300"})
    read = next(ln for ln in result.stdout.splitlines() if "disk_read" in ln)
    assert read.split()[:2] == ["skip", "disk_read"] and "skipped: " in read
    assert re.search(r"\d+ ok, [1-9]\d* skipped, \d+ warning\(s\), \d+ failure\(s\)", result.stdout)


def test_a_broken_config_gives_its_error_line_and_no_pass_config(tmp_path):
    broken = write_config(tmp_path / "kv.json", tmp_path / "kv", cpu_bytes="lots")
    code, checks = doctor_json("--config", str(broken), "--read-probe", "4MiB")
    assert code == 2 and checks["config"]["status"] == "fail" and "cpu_bytes" in checks["config"]["message"]
    for name in ("memlock", "disk_path", "disk_space", "disk_read", "io_path", "hash", "remote"):
        line = checks[name]
        assert line["status"] == "skip", line
        assert line["message"] == f"skipped: config {broken} could not be read (see the config line)"
    result = runner.invoke(app, ["doctor", "--config", str(broken)], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "pass --config" not in result.stdout
    assert not any(ln.split()[:2] == ["ok", "disk_path"] for ln in result.stdout.splitlines())
    assert not (tmp_path / "kv").exists()


def test_an_assumed_tensor_parallel_size_is_a_warning(tmp_path):
    shipped = REPO / "configs" / "llama-3.1-70b-tp4.json"
    code, checks = doctor_json("--config", str(shipped), "--read-probe", "0")
    line = checks["config"]
    assert line["status"] == "warn" and code >= 1
    assert "TP 1 assumed: neither --tp nor the config names the tensor-parallel size" in line["message"]
    assert line["fix"] == "pass --tp N, the server's --tensor-parallel-size" and line["facts"]["tp"] == 1
    _, named = doctor_json("--config", str(shipped), "--tp", "4", "--read-probe", "0")
    assert named["config"]["status"] == "ok" and "TP 4 (--tp)" in named["config"]["message"]
    assert named["config"]["facts"]["tp_assumed"] is False


def _config_break_even(model: Path, out: Path, tp: int, *gpu: str) -> tuple[str, str | None]:
    args = ["config", "--model-config", str(model), "--tp", str(tp), "--cpu-bytes", "1GiB", *gpu]
    args += ["--disk-path", str(out.parent / "kv"), "--disk-bytes", "64MiB", "--output", str(out)]
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    rows = {ln.split("│")[1].strip(): ln for ln in result.stdout.splitlines() if "break-even load" in ln}
    assert "break-even load GB/s / rank" in rows, result.stdout
    # the value column: the row's last number
    rank = re.findall(r"\d+\.\d\d", rows["break-even load GB/s / rank"])[-1]
    node = rows.get("break-even load GB/s / node")
    return rank, re.findall(r"\d+\.\d\d", node)[-1] if node else None


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("gpu", [(), ("--gpu", "H100 SXM")], ids=["default-rate", "h100-estimate"])
def test_config_and_doctor_print_the_same_break_even(tmp_path, tp, gpu):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_31_8B))
    out = tmp_path / "kv.json"
    rank, node = _config_break_even(model, out, tp, *gpu)
    _, checks = doctor_json("--config", str(out), "--tp", str(tp), "--model", str(model), "--read-probe", "4MiB", *gpu)
    line = timed(checks["disk_read"])
    assert f"break-even of {rank} GB/s per rank" in line["message"], (rank, line["message"])
    assert f"{line['facts']['break_even_gbps']:.2f}" == rank
    if tp == 1:
        assert node is None and "for the node" not in line["message"]
    else:  # the disk serves every rank of the node at once
        assert node is not None and f"x TP {tp} = {node} GB/s for the node" in line["message"]
    if not gpu and tp == 4:  # one rank's KV (2 of 8 heads) at the default rate, not the whole model's
        assert rank == f"{2 * 32 * 2 * 128 * 2 * 30_800 / 1e9:.2f}"
    if gpu and tp == 4:  # the estimate for the TP group: 4 x H100
        assert "4 x 989 TFLOPS" in line["message"]


@pytest.fixture
def model_with_weights(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_31_8B))
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    return model


def test_library_log_lines_stay_off_stderr_unless_verbose(tmp_path, model_with_weights):
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING") and k != "VLLM_CONFIGURE_LOGGING"}
    env["COLUMNS"] = "200"
    # With a model directory and a disk tier, config computes the vLLM namespace: it imports vLLM.
    args = ["config", "--model-config", str(model_with_weights), "--cpu-bytes", "1GiB"]
    args += ["--disk-path", str(tmp_path / "kv"), "--disk-bytes", "64MiB"]
    quiet = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "vLLM namespace" in quiet.stdout  # vLLM was imported and used
    lines = [ln for ln in quiet.stderr.splitlines() if ln.strip()]
    assert all(ln.startswith(("warning: ", "error: ")) for ln in lines), quiet.stderr
    assert "vllm" not in quiet.stderr.lower()
    loud = subprocess.run([str(SCRIPT), "--verbose", *args], capture_output=True, text=True, env=env, timeout=300)
    assert loud.returncode == 0 and re.search(r"^(INFO|WARNING) vllm\.", loud.stderr, re.M), loud.stderr
    assert "vllm." not in loud.stdout.split("KV sizing")[0]  # vLLM's lines go to stderr, not stdout
