"""``tiered-kv doctor`` on this machine, for real: every line ok / warn / fail with a fix,
exit code that of the worst line, CUDA absent (on a CPU-only machine) a warning and not a
crash; and each check's verdict on the real limits, directories and settings it is
given."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tiered_kv.ops import doctor as dr
from tiered_kv.cli import app
from tiered_kv.config import TieredConfig

runner = CliRunner()
NAMES = {
    "remote",
    "memory",
    "memlock",
    "thp",
    "shmem_thp",
    "disk_path",
    "disk_space",
    "disk_read",
    "cuda",
    "io_path",
    "vllm",
    "hash",
}


def cuda_visible() -> bool:
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def run_doctor(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["doctor", *args, "--json"])
    assert "Traceback" not in result.output
    return result.exit_code, json.loads(result.stdout)


def by_name(data: dict) -> dict[str, dict]:
    return {c["name"]: c for c in data["checks"]}


def write_config(path: Path, extra: dict) -> Path:
    path.write_text(
        json.dumps(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieredOffloadingSpec",
                    "spec_module_path": "tiered_kv.integrations.vllm",
                    **extra,
                },
            }
        )
    )
    return path


def test_doctor_json_on_this_machine():
    code, data = run_doctor()
    assert data["schema"] == "tiered-kv/doctor" and data["path"] is None
    checks = by_name(data)
    assert set(checks) == NAMES
    for c in data["checks"]:
        assert c["status"] in ("ok", "skip", "warn", "fail") and c["message"]
        assert bool(c["fix"]) == (c["status"] in ("warn", "fail")) or c["status"] == "skip", c
        assert (c["status"] == "skip") == c["message"].startswith("skipped: "), c
    # Without --config the checks that compare with it could not run: none of them says ok.
    for name in ("memlock", "disk_path", "disk_space", "disk_read", "io_path", "hash", "remote"):
        assert checks[name]["status"] == "skip" or (name == "memlock" and "unlimited" in checks[name]["message"])
    worst = max((c["status"] for c in data["checks"] if c["status"] != "skip"), key=["ok", "warn", "fail"].index)
    assert data["status"] == worst and code == data["exit_code"] == {"ok": 0, "warn": 1, "fail": 2}[worst]
    cuda = checks["cuda"]
    if cuda_visible():
        assert cuda["status"] == "ok"
    else:
        assert cuda["status"] == "warn" and cuda["message"].startswith("CUDA absent")


def test_doctor_prints_one_line_per_check_with_the_fix():
    result = runner.invoke(app, ["doctor"], env={"COLUMNS": "300"})
    assert "Traceback" not in result.output
    lines = result.stdout.splitlines()
    statuses = [ln.split()[0] for ln in lines if ln.split() and ln.split()[0] in ("ok", "skip", "warn", "fail")]
    assert len(statuses) == len(NAMES)
    assert sum(ln.strip().startswith("fix: ") for ln in lines) >= len([s for s in statuses if s in ("warn", "fail")])
    assert result.exit_code == max({"ok": 0, "skip": 0, "warn": 1, "fail": 2}[s] for s in statuses)
    assert f"{statuses.count('skip')} skipped" in lines[-1]


def test_a_disk_tier_that_does_not_fit_fails_with_exit_2(tmp_path):
    cfg = write_config(
        tmp_path / "kv.json", {"cpu_bytes": "1GiB", "disk_path": str(tmp_path / "cache"), "disk_bytes": "4096TiB"}
    )
    code, data = run_doctor("--config", str(cfg))
    space = by_name(data)["disk_space"]
    assert code == 2 and space["status"] == "fail" and "refuses to start" in space["message"]
    assert "lower disk_bytes" in space["fix"] and data["path"] == str(cfg)
    # The directory is not created by the check.
    assert not (tmp_path / "cache").exists()


def test_tp_multiplies_what_a_node_needs(tmp_path):
    free = dr.free_space(tmp_path)
    per_rank = max(1, free // 3 // (1 << 20))
    cfg = write_config(
        tmp_path / "kv.json", {"cpu_bytes": "1GiB", "disk_path": str(tmp_path), "disk_bytes": f"{per_rank}MiB"}
    )
    assert by_name(run_doctor("--config", str(cfg))[1])["disk_space"]["status"] == "ok"
    assert by_name(run_doctor("--config", str(cfg), "--tp", "8")[1])["disk_space"]["status"] == "fail"


def test_a_config_the_server_refuses_fails(tmp_path):
    cfg = write_config(tmp_path / "kv.json", {"cpu_bytes": 64})
    code, data = run_doctor("--config", str(cfg))
    line = by_name(data)["config"]
    assert code == 2 and line["status"] == "fail" and "cpu_bytes: 64 has no unit" in line["message"]
    code, data = run_doctor("--config", str(tmp_path / "missing.json"))
    assert code == 2 and "does not exist" in by_name(data)["config"]["message"]


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"canonical_layout": True}, "canonical_layout: not supported by TieredOffloadingSpec"),
        ({"offload_prompt_only": "false"}, "offload_prompt_only: expected true or false (a JSON boolean)"),
        ({"blocks_per_chunk": "2"}, "blocks_per_chunk: expected a positive integer"),
        (
            {"disk_path": "/srv/a", "tiers": [{"type": "disk", "path": "/srv/b"}]},
            "tiers: every lower tier needs its own name; got disk, disk",
        ),
        (
            {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1 << 30,
                "secondary_tiers": [
                    {
                        "type": "TieredDiskTier",
                        "module_path": "tiered_kv.integrations.vllm.secondary_tier",
                        "disk_path": "/srv/a",
                        "write_policy": "write_back",
                    }
                ],
            },
            "TieredDiskTier entry: write_policy: not a setting of the TieredDiskTier secondary tier",
        ),
    ],
)
def test_the_doctor_refuses_what_the_runtime_refuses(tmp_path, extra, words):
    """The tools validate a config with the spec's own parser (``tiered_kv.vllm_extra``):
    each of these stops the server at start-up, so the doctor must fail it too."""
    cfg = write_config(tmp_path / "kv.json", {"cpu_bytes": "1GiB", **extra})
    code, data = run_doctor("--config", str(cfg), "--read-probe", "0")
    line = by_name(data)["config"]
    assert code == 2 and line["status"] == "fail" and words in line["message"], line


def test_disk_path_checks_on_real_directories(tmp_path):
    ok = dr.check_disk_path(TieredConfig.from_dict({"disk_path": str(tmp_path), "disk_bytes": "1GiB"}))
    assert ok.facts["filesystem"]["type"] and ok.facts["o_direct"] in (True, False)
    expected = "ok" if ok.facts["o_direct"] and not ok.facts["root_filesystem"] else "warn"
    assert ok.status == expected, ok.message
    assert list(tmp_path.iterdir()) == []  # the O_DIRECT probe file is gone
    new = dr.check_disk_path(TieredConfig.from_dict({"disk_path": str(tmp_path / "a"), "disk_bytes": "1GiB"}))
    assert new.status == expected and not (tmp_path / "a").exists()
    if expected == "ok":
        assert "will be created" in new.message
    deep = dr.check_disk_path(TieredConfig.from_dict({"disk_path": str(tmp_path / "a" / "b"), "disk_bytes": "1GiB"}))
    assert deep.status == "fail" and f"{tmp_path / 'a'} does not exist" in deep.message
    (tmp_path / "file").write_text("x")
    bad = dr.check_disk_path(TieredConfig.from_dict({"disk_path": str(tmp_path / "file"), "disk_bytes": "1GiB"}))
    assert bad.status == "fail" and "is not a directory" in bad.message


@pytest.mark.skipif(dr.filesystem_of("/dev/shm")["type"] != "tmpfs", reason="/dev/shm is not tmpfs here")
def test_a_disk_path_in_memory_is_a_warning(tmp_path):
    # A directory the server would make there (/dev/shm itself is everyone's: refused).
    c = dr.check_disk_path(TieredConfig.from_dict({"disk_path": f"/dev/shm/{tmp_path.name}", "disk_bytes": "1GiB"}))
    assert c.status == "warn" and "memory, not disk" in c.message
    shared = dr.check_disk_path(TieredConfig.from_dict({"disk_path": "/dev/shm", "disk_bytes": "1GiB"}))
    assert shared.status == "fail" and "another user could remove or replace the cache in it" in shared.message


def test_memlock_and_memory_against_cpu_bytes():
    limit = dr.memlock_limit()
    big = TieredConfig.from_dict({"cpu_bytes": "1000TiB"})
    memlock = dr.check_memlock(big, limit)
    assert memlock.status == ("ok" if limit is None else "warn")
    assert dr.check_memlock(big, 1 << 20).status == "warn" and "ulimit -l" in dr.check_memlock(big, 1 << 20).fix
    assert dr.check_memlock(big, None).status == "ok"
    memory = dr.check_memory(big, 1, dr.memory_limit())
    assert memory.status == "fail" and "refuses to start" in memory.message
    small = TieredConfig.from_dict({"cpu_bytes": "1MiB"})
    assert dr.check_memory(small, 1, dr.memory_limit()).status == "ok"


def test_huge_page_settings():
    assert [c.status for c in dr.check_thp("madvise", "advise", "process")] == ["ok", "ok"]
    private, shared = dr.check_thp("never", "never", "process")
    assert private.status == shared.status == "warn"
    assert "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled" in shared.fix
    assert dr.check_thp("always", "never", "thread")[1].status == "ok"  # shared memory unused
    assert dr.thp_setting("private") in ("always", "madvise", "never", "n/a")


@pytest.mark.parametrize(
    "raw, env, status, words",
    [
        ({}, {}, "ok", "vLLM's fixed seed"),
        ({"hash_algorithm": "xxhash"}, {}, "warn", "no block on disk ever hits"),
        ({"hash_algorithm": "xxhash"}, {"PYTHONHASHSEED": "0"}, "ok", "PYTHONHASHSEED=0"),
        ({"hash_seed": "42"}, {"PYTHONHASHSEED": "7"}, "warn", "differs from PYTHONHASHSEED='7'"),
        ({"hash_seed": "42"}, {}, "warn", "PYTHONHASHSEED is unset"),
        ({"hash_seed": "42"}, {"PYTHONHASHSEED": "42"}, "ok", "PYTHONHASHSEED=42"),
    ],
)
def test_hash_seed_against_pythonhashseed(raw, env, status, words):
    c = dr.check_hash(TieredConfig.from_dict(raw), env)
    assert c.status == status and words in c.message


def test_io_path_and_vllm_lines(tmp_path):
    raw = {"disk_path": str(tmp_path), "disk_bytes": "1GiB"}
    line = dr.check_io_path(TieredConfig.from_dict(raw), cuda=cuda_visible())
    if not dr.gds_facts()["kvikio_importable"]:
        assert line.status == "ok" and line.message.startswith("disk tier I/O: posix")
        forced = dr.check_io_path(TieredConfig.from_dict({**raw, "io_backend": "kvikio"}), cuda=False)
        assert forced.status == "fail" and "KvikIO cannot run" in forced.message
    posix = dr.check_io_path(TieredConfig.from_dict({**raw, "io_backend": "posix"}), cuda=False)
    assert posix.status == "ok" and posix.message.startswith("disk tier I/O: posix (configured)")
    vllm = dr.check_vllm()
    assert vllm.facts["supported"] == dr.SUPPORTED_VLLM
    assert vllm.status == ("ok" if (vllm.facts["vllm"] or "").startswith(dr.SUPPORTED_VLLM + ".") else "warn")


def test_no_probe_file_is_left_anywhere(tmp_path):
    cfg = write_config(
        tmp_path / "kv.json", {"cpu_bytes": "1GiB", "disk_path": str(tmp_path / "c"), "disk_bytes": "1GiB"}
    )
    (tmp_path / "c").mkdir()
    run_doctor("--config", str(cfg))
    assert os.listdir(tmp_path / "c") == []


def test_connector_settings_say_what_the_engine_gets(tmp_path):
    shipped = Path(__file__).resolve().parents[2] / "configs" / "llama-3.1-8b-1xh100.json"
    code, data = run_doctor("--config", str(shipped))
    connector = by_name(data)["connector"]
    assert connector["status"] == "ok" and "each shared-tier hit read once" in connector["message"]
    # The file as vLLM's own tiering loads it: our connector is not its business.
    tiering = Path(__file__).resolve().parents[2] / "configs" / "vllm-tiering-disk.json"
    assert "connector" not in by_name(run_doctor("--config", str(tiering))[1])

    ours = {
        "kv_connector": "TieredOffloadingConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    shared = TieredConfig.from_dict({"remote": {"bucket": "kv-fleet", "trusted_bucket": True}})
    local = TieredConfig()
    cases = [
        (ours, shared, "ok", None),
        ({**ours, "kv_load_failure_policy": "fail"}, local, "warn", '"kv_load_failure_policy": "recompute"'),
        ({k: v for k, v in ours.items() if k != "kv_load_failure_policy"}, local, "warn", "recompute"),
        (
            {k: v for k, v in ours.items() if k != "kv_connector_module_path"},
            local,
            "fail",
            ours["kv_connector_module_path"],
        ),
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}, shared, "warn", "TieredOffloadingConnector"),
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}, local, "ok", None),
        ({"kv_connector": "LMCacheConnectorV1"}, local, "warn", "TieredOffloadingConnector"),
        (None, local, "ok", None),  # the extra config alone
    ]
    for transfer, cfg, status, fix in cases:
        check = dr.check_connector(transfer, cfg)
        assert check.status == status, (transfer, check)
        assert (fix is None) == (not check.fix) and (fix is None or fix in check.fix), (transfer, check)


def test_the_canary_setting_is_read_and_its_line_warns_when_it_is_off(tmp_path):
    """``canary`` is a key of the one grammar: every tool reads it, and doctor says when a
    config turns the start-up check off."""
    base = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm", "cpu_bytes": "1GiB"}
    lines = {}
    for name, extra in (("on", base), ("off", {**base, "canary": False})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(extra))
        report = dr.run_doctor(path, tp=1, read_probe=0)
        (lines[name],) = [c for c in report.checks if c.name == "canary"]
        assert not [c for c in report.checks if c.name == "config" and c.status == "fail"], report.checks
    assert lines["on"].status == "ok" and lines["off"].status == "warn" and "canary: false" in lines["off"].message


def _tiering_config(path: Path, cache: Path, **extra) -> Path:
    """vLLM's whole ``--kv-transfer-config`` for ``TieringOffloadingSpec`` with one
    ``TieredDiskTier`` at ``cache``, ``extra`` over its extra config."""
    entry = {
        "type": "TieredDiskTier",
        "module_path": "tiered_kv.integrations.vllm.secondary_tier",
        "disk_path": str(cache),
        "disk_bytes": "256KiB",
        "model_id": "m",
    }
    inner = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 * 4096, "secondary_tiers": [entry], **extra}
    path.write_text(
        json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": inner})
    )
    return path


def _config_line(path: Path) -> dict:
    return by_name(run_doctor("--config", str(path), "--tp", "1", "--read-probe", "0")[1])["config"]


def test_a_config_is_read_as_vllm_reads_it(tmp_path):
    """What vLLM 0.33 refuses at start-up, doctor fails; what it runs, doctor reads as it
    runs it (vLLM's OffloadingSpecFactory, SecondaryTierFactory, build_offloading_config,
    CPUOffloadingSpec)."""
    cache = tmp_path / "cache"
    entry = {
        "type": "TieredDiskTier",
        "module_path": "tiered_kv.integrations.vllm.secondary_tier",
        "disk_path": str(cache),
        "disk_bytes": "256KiB",
        "model_id": "m",
    }
    # No spec_name: vLLM runs its CPUOffloadingSpec, which has no disk tier at all.
    nospec = _tiering_config(tmp_path / "nospec.json", cache)
    given = json.loads(nospec.read_text())
    del given["kv_connector_extra_config"]["spec_name"]
    nospec.write_text(json.dumps(given))
    line = _config_line(nospec)
    assert line["status"] == "fail" and "secondary_tiers without spec_name" in line["message"], line
    assert "CPUOffloadingSpec" in line["message"] and '"spec_name": "TieringOffloadingSpec"' in line["message"]
    # A TieredDiskTier entry without module_path: vLLM's "Unknown secondary tier type".
    bare = {k: v for k, v in entry.items() if k != "module_path"}
    line = _config_line(_tiering_config(tmp_path / "nomodule.json", cache, secondary_tiers=[bare]))
    assert line["status"] == "fail" and "without module_path" in line["message"], line
    assert '"module_path": "tiered_kv.integrations.vllm.secondary_tier"' in line["message"]
    # The chunk sized twice: vLLM's connector refuses it, whichever spec.
    line = _config_line(write_config(tmp_path / "both.json", {"block_size": 32, "blocks_per_chunk": 2}))
    assert line["status"] == "fail" and "block_size (32) and blocks_per_chunk (2) both set" in line["message"], line
    line = _config_line(_tiering_config(tmp_path / "both-tiering.json", cache, block_size=32, blocks_per_chunk=2))
    assert line["status"] == "fail" and "both set" in line["message"], line
    # What vLLM runs: cpu_bytes_to_use as a string of digits (int() reads it), and a
    # spec_module_path beside the registered TieringOffloadingSpec (never read).
    line = _config_line(_tiering_config(tmp_path / "str.json", cache, cpu_bytes_to_use=str(8 * 4096)))
    assert line["status"] == "ok" and "cpu_bytes_to_use 32.00 KiB" in line["message"], line
    line = _config_line(_tiering_config(tmp_path / "mod.json", cache, spec_module_path="tiered_kv.integrations.vllm"))
    assert line["status"] == "ok", line
    line = _config_line(_tiering_config(tmp_path / "half.json", cache, cpu_bytes_to_use="32KiB"))
    assert line["status"] == "fail" and "cpu_bytes_to_use" in line["message"] and "'32KiB'" in line["message"]
    # vLLM's CPU primary tier has no default size: its spec refuses to start without one.
    line = _config_line(_tiering_config(tmp_path / "nocpu.json", cache, cpu_bytes_to_use=None))
    assert line["status"] == "fail" and "cpu_bytes_to_use is not set" in line["message"], line


def test_a_whole_config_names_its_spec_as_vllm_needs_it(tmp_path):
    """vLLM's factory runs ``CPUOffloadingSpec`` for a kv-transfer config without
    ``spec_name`` (none of our keys read) and cannot import a spec it does not register
    without ``spec_module_path``: doctor, inspect and the warm-up refuse both, naming the
    keys to add; an extra config alone is still ours."""
    from support.cli import run_cli, write_transfer_config

    ours = {"cpu_bytes": "64KiB", "disk_path": str(tmp_path / "cache"), "disk_bytes": "256KiB", "model_id": "m"}
    nospec = write_transfer_config(tmp_path / "nospec.json", ours, spec=False)
    line = _config_line(nospec)
    assert line["status"] == "fail" and "has no spec_name" in line["message"], line
    assert (
        "CPUOffloadingSpec" in line["message"]
        and '"spec_module_path": "tiered_kv.integrations.vllm"' in line["message"]
    )
    (tmp_path / "cache").mkdir()
    (prompts := tmp_path / "prompts.jsonl").write_text('{"token_ids": [1, 2, 3]}\n')
    for args in (
        ("inspect", "summary", str(tmp_path / "cache"), "--config"),
        ("warmup", str(prompts), "--model", "m", "--config"),
    ):
        out = run_cli(*args, str(nospec), code=2)
        assert out.stderr.startswith("error: ") and "has no spec_name" in out.stderr, out.stderr
    nomodule = write_transfer_config(tmp_path / "nomodule.json", {**ours, "spec_name": "TieredOffloadingSpec"})
    line = _config_line(nomodule)
    assert line["status"] == "fail" and "'TieredOffloadingSpec' without spec_module_path" in line["message"], line
    assert '"spec_module_path": "tiered_kv.integrations.vllm"' in line["message"], line
    # The same keys as an extra config alone, and the whole config as `tiered-kv config` prints it.
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps(ours))
    for path in (alone, write_transfer_config(tmp_path / "whole.json", ours)):
        line = _config_line(path)
        assert line["status"] == "ok" and "256.00 KiB" in line["message"], line


def test_two_disk_tiers_are_the_tools_limit_not_a_server_error(tmp_path):
    """vLLM runs two TieredDiskTier entries; the tools judge one, and say so."""
    cache = tmp_path / "cache"
    config = _tiering_config(tmp_path / "two.json", cache)
    given = json.loads(config.read_text())
    (entry,) = given["kv_connector_extra_config"]["secondary_tiers"]
    given["kv_connector_extra_config"]["secondary_tiers"].append({**entry, "disk_path": str(tmp_path / "cache2")})
    config.write_text(json.dumps(given))
    line = _config_line(config)
    assert line["status"] == "fail" and "2 TieredDiskTier entries" in line["message"], line
    assert "the server runs them all" in line["message"] and "tools do not support" in line["fix"], line
    assert "refuses" not in line["fix"]


def test_our_prefetching_connector_is_ours(tmp_path):
    """``TieredPrefetchingConnector`` is ``TieredOffloadingConnector`` with prefetch jobs:
    ok with the recompute policy, and its own module path is the one asked for."""
    prefetching = {
        "kv_connector": "TieredPrefetchingConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm.prefetch_jobs",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    check = dr.check_connector(prefetching, TieredConfig())
    assert check.status == "ok" and check.message.startswith("TieredPrefetchingConnector with the recompute"), check
    check = dr.check_connector({**prefetching, "kv_load_failure_policy": "fail"}, TieredConfig())
    assert check.status == "warn" and '"kv_load_failure_policy": "recompute"' in check.fix, check
    wrong = {**prefetching, "kv_connector_module_path": "tiered_kv.integrations.vllm.connector"}
    check = dr.check_connector(wrong, TieredConfig())
    assert check.status == "fail" and "tiered_kv.integrations.vllm.prefetch_jobs" in check.fix, check
    config = tmp_path / "kv.json"
    config.write_text(
        json.dumps(
            {
                **prefetching,
                "kv_connector_extra_config": {
                    "spec_name": "TieredOffloadingSpec",
                    "spec_module_path": "tiered_kv.integrations.vllm",
                    "cpu_bytes": "1GiB",
                    "disk_path": str(tmp_path / "cache"),
                    "disk_bytes": "1GiB",
                },
            }
        )
    )
    line = by_name(run_doctor("--config", str(config), "--tp", "1", "--read-probe", "0")[1])["connector"]
    assert line["status"] == "ok" and "TieredPrefetchingConnector" in line["message"], line
