"""``tools/replay.py --workload chat --quick``: the comparison table and its invariants,
run in-process once for the module; plus the tool's trace format, its refusals and the
vLLM manager adapter."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import replay  # noqa: E402
from replay_vllm import vllm_import_error  # noqa: E402
from replay_workloads import QUICK, generate, read_trace, write_trace  # noqa: E402

from tiered_kv.sim.workloads import prefix_hashes  # noqa: E402

VLLM_MISSING = vllm_import_error()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    out = io.StringIO()
    threads = torch.get_num_threads()  # the tool sets 1 for its CPU replay
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = replay.main(["--workload", "chat", "--quick", "--disk-dir", str(tmp), "--json", str(tmp / "r.json")])
    finally:
        torch.set_num_threads(threads)
    return rc, out.getvalue(), json.loads((tmp / "r.json").read_text()), tmp


def test_quick_chat_prints_the_comparison_table(quick_run):
    rc, text, data, tmp = quick_run
    assert rc == 0, text
    table = text.split("## Token hit rate per tier")[1].split("##")[0]
    header = next(line for line in table.splitlines() if line.startswith("|"))
    for col in ("GPU", "CPU", "DISK", "computed", "mismatches", "TTFT saving", "sched p50 us/step"):
        assert col in header
    configs = (
        ["no-offload", "cpu", "cpu+disk"]
        + ([] if VLLM_MISSING else ["vllm-cpu"])
        + ["cpu-arc"]
        + ([] if VLLM_MISSING else ["vllm-cpu-arc"])
    )
    assert list(data["results"]) == configs
    for name in configs:
        assert any(line.split("|")[1].strip() == name for line in table.splitlines() if line.startswith("|"))
    if VLLM_MISSING:
        assert "vllm-cpu, vllm-cpu-arc skipped" in text
    assert "mismatches: 0  failed jobs: 0" in text
    for transfer in ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu"):
        assert transfer in text.split("## Transfers")[1]
    assert not list(tmp.glob("replay-*")), "run directories were left behind"


def test_every_block_is_accounted_for_once(quick_run):
    _, _, data, _ = quick_run
    device_hits = set()
    for name, r in data["results"].items():
        rep = r["report"]
        assert rep["mismatches"] == 0 and rep["failed_jobs"] == 0, name
        served = rep["device_hits"] + sum(rep["hits_by_medium"].values()) + rep["computed"]
        assert served == rep["blocks_requested"] == data["shape"]["blocks"], name
        assert sum(rep["hits_by_medium"].values()) == rep["offload_hits"], name
        for step in r["steps"]:
            assert step["device"] + step["cpu"] + step["disk"] + step["computed"] == step["blocks"], name
        assert sum(s["disk"] for s in r["steps"]) == rep["hits_by_medium"].get("DISK", 0), name
        device_hits.add(rep["device_hits"])
    # Same trace, same device cache: the device prefix cache serves the same blocks everywhere.
    assert len(device_hits) == 1


def test_tiers_rank_as_expected_and_bytes_match_blocks(quick_run):
    _, _, data, _ = quick_run
    res = data["results"]
    bpb = replay.Geometry(**replay.QUICK_GEOMETRY, device_groups=1).bytes_per_block
    # The working set is 4x the CPU tier: the disk tier must serve what the CPU tier lost.
    assert data["shape"]["working_set"] >= 3.5 * data["tiers"]["cpu_slots"]
    assert res["no-offload"]["report"]["offload_hits"] == 0
    assert all(t["bytes"] == 0 for t in res["no-offload"]["transfers"].values())
    assert "DISK" not in res["cpu"]["report"]["hits_by_medium"]
    assert res["cpu+disk"]["report"]["hits_by_medium"]["DISK"] > 0
    assert (
        res["cpu+disk"]["report"]["computed"]
        < res["cpu"]["report"]["computed"]
        < res["no-offload"]["report"]["computed"]
    )
    for name in ("cpu", "cpu+disk"):
        r = res[name]
        assert r["transfers"]["gpu_to_cpu"]["bytes"] == r["report"]["blocks_stored"] * bpb, name
    # Every disk hit came through disk -> CPU (promotion on) and then CPU -> GPU.
    r = res["cpu+disk"]
    assert r["transfers"]["disk_to_cpu"]["bytes"] >= r["report"]["hits_by_medium"]["DISK"] * bpb


@pytest.mark.skipif(VLLM_MISSING is not None, reason=f"vLLM not importable: {VLLM_MISSING}")
def test_vllm_lru_serves_about_what_ours_does_with_the_same_ram(quick_run):
    _, _, data, _ = quick_run
    ours, theirs = data["results"]["cpu"]["report"], data["results"]["vllm-cpu"]["report"]
    assert theirs["blocks_stored"] > 0 and theirs["hits_by_medium"]["CPU"] > 0
    # Both are LRU over the same number of slots; they differ only in recency details.
    assert abs(theirs["hits_by_medium"]["CPU"] - ours["hits_by_medium"]["CPU"]) <= 0.1 * ours["blocks_looked_up"]


@pytest.mark.skipif(VLLM_MISSING is not None, reason=f"vLLM not importable: {VLLM_MISSING}")
def test_vllm_adapter_speaks_the_seed_api():
    from replay_vllm import VllmCpuManagerAdapter

    m = VllmCpuManagerAdapter(num_slots=4, block_size=16)
    a = [bytes([i]) * 16 for i in range(6)]
    out = m.prepare_store(a[:3])
    assert out.block_hashes_to_store == a[:3] and sorted(out.store_spec.block_ids.tolist()) == [0, 1, 2]
    assert m.lookup(a[:3]) == 0  # being stored: not loadable yet
    m.touch(a[:3])
    m.complete_store(a[:2])
    assert m.lookup(a[:3]) == 2 and m.lookup(a[1:3]) == 1
    spec = m.prepare_load(a[:2])
    assert spec.medium() == "CPU" and len(spec.block_ids) == 2
    m.complete_load(a[:2])
    m.touch(a[:2])
    m.complete_store([a[2]], success=False)
    out = m.prepare_store(a[3:6])  # 2 free slots + 1 eviction of an unpinned block
    assert out is not None and len(out.block_hashes_evicted) == 1 and out.block_hashes_evicted[0] in a[:2]
    events = m.take_events()
    assert {e.medium for e in events} == {"CPU"} and any(e.removed for e in events)


def test_trace_round_trip_and_token_ids(tmp_path):
    w = generate("mixed", QUICK, 16, scale=0.2)
    write_trace(w, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl", 16).requests == w.requests
    tokens = list(range(40))  # 2 full blocks of 16 and a partial one, dropped
    (tmp_path / "tok.jsonl").write_text(json.dumps({"token_ids": tokens}) + "\n")
    want = prefix_hashes(torch.arange(32).reshape(2, 16).numpy())
    assert read_trace(tmp_path / "tok.jsonl", 16).requests == [want]
    (tmp_path / "bad.jsonl").write_text('{"tokens": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_trace(tmp_path / "bad.jsonl", 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_mode_refuses_cleanly_without_cuda(capsys):
    assert replay.main(["--gpu", "--quick"]) == 2
    assert "--gpu needs a CUDA device" in capsys.readouterr().err


def test_bad_options_name_the_value(capsys):
    with pytest.raises(SystemExit) as e:
        replay.main(["--quick", "--load-gbps", "CPU=fast"])
    assert e.value.code == 2 and "'CPU=fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay.main(["--quick", "--configs", "cpu,gpu-only"])
    assert "'gpu-only'" in capsys.readouterr().err
