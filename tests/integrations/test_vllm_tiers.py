"""``TieredOffloadingSpec`` inside vLLM 0.33's real scheduler and worker connector, moving
real bytes on CPU tensors (tests/support/vllm_harness.py, ``worker="real"``): stores, hits and
loads through the CPU tier and the disk tier, a disk chunk corrupted between store and
lookup, workers whose jobs fail, a restart, a cache reset, and the metrics on vLLM's
Prometheus side."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import threading
import time

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

import torch  # noqa: E402
from prometheus_client import start_http_server  # noqa: E402
from support import vllm_harness as vh  # noqa: E402
from typer.testing import CliRunner  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402

from tiered_kv.cli import _load_commands, app  # noqa: E402
import tiered_kv.integrations.vllm.spec as spec_module  # noqa: E402
from tiered_kv.integrations.vllm.connector import TieredOffloadingConnector  # noqa: E402
from tiered_kv.integrations.vllm import TieredOffloadingSpec  # noqa: E402
from tiered_kv.integrations.vllm.manager import TieredVllmManager  # noqa: E402
from tiered_kv.integrations.vllm.worker import TieredVllmWorker, gpu_rows  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16  # GPU block size in tokens
GPU_BLOCK_BYTES = 4096  # 2 layers x 2 KV heads x 16 tokens x 32 dims x 2 bytes
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def _build(model_dir, *, chunk_tokens: int = BLOCK, cpu_chunks: int = 16, disk=None, **extra):
    chunk = GPU_BLOCK_BYTES * chunk_tokens // BLOCK
    config = {**SPEC, "cpu_bytes": f"{cpu_chunks * chunk}B", "block_size": chunk_tokens, **extra}
    if disk is not None:
        config.update(disk_path=str(disk), disk_bytes=f"{64 * 4096 * max(1, chunk // 4096)}B")
    return vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real")


def _serve(h: vh.VllmHarness, prompt: list[int]) -> vh.PrefixHit:
    req_id = h.add_request(prompt)
    h.settle()
    return h.prefix_hits[req_id]


def _durable(h: vh.VllmHarness, timeout: float = 20.0) -> None:
    """Wait until every queued disk write is durable and seen by the manager, and the
    worker's writers have counted them (the manager can see an outcome first)."""
    deadline = time.monotonic() + timeout
    while h.manager.composite.pending_writes():
        assert time.monotonic() < deadline, "disk writes never became durable"
        time.sleep(0.005)
    if h.worker == "real":
        for tier in h.worker_spec._worker.hierarchy.lower_tiers:
            if tier.stager is not None:
                tier.stager.drain()


def _zero_gpu(h: vh.VllmHarness) -> None:
    for t in h.kv_caches.values():
        t.zero_()


def _keys(prompt: list[int], chunk_tokens: int = BLOCK) -> list[bytes]:
    """The offload keys of the prompt's full chunks: the last block hash of each chunk."""
    hashes = vh.hash_blocks(prompt, BLOCK)
    per = chunk_tokens // BLOCK
    return [make_offload_key(hashes[i], 0) for i in range(per - 1, len(hashes), per)]


# ------------------------------------------------------------------ CPU tier


@pytest.mark.parametrize("chunk_tokens", [BLOCK, 2 * BLOCK, 3 * BLOCK], ids=["f1", "f2", "f3"])
def test_cpu_tier_stores_then_loads_the_same_bytes(model_dir, chunk_tokens):
    with _build(model_dir, chunk_tokens=chunk_tokens) as h:
        assert isinstance(h.manager, TieredVllmManager)
        assert isinstance(h.worker_spec, TieredOffloadingSpec)
        prompt = _prompt(1, 4 * chunk_tokens + 3)
        assert _serve(h, prompt).external == 0
        keys = _keys(prompt, chunk_tokens)
        assert all(h.manager.composite.cpu.is_loadable(k) for k in keys)
        h.reset_gpu_prefix_cache()
        _zero_gpu(h)  # only a real load can bring the prefix's bytes back
        req_id = h.admit(prompt)
        assert h.prefix_hits[req_id].external == 4 * chunk_tokens
        matches = h.kv_matches(req_id)
        assert len(matches) == 4 * chunk_tokens // BLOCK and all(matches), matches
        h.settle()
        assert h.manager.composite.stats.tiers["cpu"]["hits"] == 4


def test_gpu_rows_follow_vllms_block_indices_and_tail():
    # Group 0 starts 1 block into its first chunk and stops 1 short of the end of its
    # last one; group 1 is whole. Chunks of 3 GPU blocks.
    spec = GPULoadStoreSpec([7, 8, 9, 10, 20, 21, 22], group_sizes=[4, 3], block_indices=[4, 0])
    rows = gpu_rows(spec, 3, 3)
    assert rows.tolist() == [[-1, 7, 8], [9, 10, -1], [20, 21, 22]]
    with pytest.raises(ValueError, match="covers 3 chunks of 3 blocks; the offloading spec has 2"):
        gpu_rows(spec, 3, 2)


def test_worker_moves_partial_first_and_last_chunks_exactly(model_dir):
    """A load that starts mid-chunk and stops mid-chunk (vLLM's block_indices and a
    truncated hit) writes exactly those GPU blocks and no others."""
    with _build(model_dir, chunk_tokens=3 * BLOCK) as h:
        worker = h.worker_spec.get_worker(None)
        assert isinstance(worker, TieredVllmWorker)
        manager, ctx = h.manager, ReqContext(req_id="direct")
        gen = torch.Generator().manual_seed(3)
        for t in h.kv_caches.values():
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen)
            )
        before = {n: t.clone() for n, t in h.kv_caches.items()}
        keys = [b"k" * 32 + bytes(4), b"q" * 32 + bytes(4)]
        out = manager.prepare_store(keys, ctx)
        # Specs reach the workers pickled in vLLM's connector metadata.
        store_spec = pickle.loads(pickle.dumps(out.store_spec))
        worker.submit_store(1, GPULoadStoreSpec(list(range(10, 16)), [6], [0]), store_spec)
        worker.wait({1})
        assert [r.job_id for r in worker.get_finished()] == [1]
        manager.complete_store(keys, ctx)
        # Load back: skip the first block of chunk 0, stop after the first block of chunk 1.
        spec = pickle.loads(pickle.dumps(manager.prepare_load(keys, ctx)))
        worker.submit_load(2, spec, GPULoadStoreSpec([40, 41, 42], [3], [1]))
        worker.wait({2})
        (result,) = worker.get_finished()
        assert result.success and result.transfer_size == 3 * GPU_BLOCK_BYTES
        manager.complete_load(keys, ctx)
        for name, t in h.kv_caches.items():
            now, then = t.view(torch.uint8), before[name].view(torch.uint8)  # bytes: NaN != NaN
            for dst, src in ((40, 11), (41, 12), (42, 13)):
                assert torch.equal(now[dst], then[src])
            untouched = [b for b in range(64) if b not in (40, 41, 42)]
            assert torch.equal(now[untouched], then[untouched])


def test_transfer_times_are_the_jobs_own_not_the_time_until_vllm_polled(model_dir, tmp_path):
    """vLLM polls once per engine step and turns ``transfer_time`` into its
    ``vllm:kv_offload_total_time`` metric: a step-long wait must not count as transfer."""
    poll_delay = 0.3
    with _build(model_dir, disk=tmp_path / "disk") as h:
        worker = h.worker_spec.get_worker(None)
        manager, ctx = h.manager, ReqContext(req_id="timed")
        keys = [bytes([i]) * 32 + bytes(4) for i in range(3)]
        store_spec = manager.prepare_store(keys, ctx).store_spec
        worker.submit_store(1, GPULoadStoreSpec(list(range(3)), [3], [0]), store_spec)
        worker.wait({1})
        time.sleep(poll_delay)
        (stored,) = worker.get_finished()
        manager.complete_store(keys, ctx)
        worker.submit_load(2, manager.prepare_load(keys, ctx), GPULoadStoreSpec(list(range(8, 11)), [3], [0]))
        worker.wait({2})
        time.sleep(poll_delay)
        (loaded,) = worker.get_finished()
        manager.complete_load(keys, ctx)
        for result in (stored, loaded):
            assert result.success and result.transfer_size == 3 * GPU_BLOCK_BYTES
            assert 0 < result.transfer_time < poll_delay
        for kind in ("gpu_to_cpu", "cpu_to_gpu"):
            moved = worker.stats.transfers[kind]
            assert moved.jobs == 1 and moved.bytes == 3 * GPU_BLOCK_BYTES
            assert 0 < moved.seconds < poll_delay


# ------------------------------------------------------------------ disk tier


@pytest.mark.parametrize("disk_io", ["thread", "process"])
def test_a_chunk_evicted_from_cpu_is_verified_then_loaded_from_disk(model_dir, tmp_path, disk_io):
    with _build(model_dir, cpu_chunks=2, disk=tmp_path / "disk", disk_io=disk_io) as h:
        worker = h.worker_spec._worker
        assert type(worker.hierarchy.store).__name__ == ("DiskIOProcess" if disk_io == "process" else "DiskStore")
        assert worker.host.shared == (disk_io == "process")
        a, b = _prompt(2, 2 * BLOCK + 1), _prompt(3, 2 * BLOCK + 1)
        _serve(h, a)
        _durable(h)
        _serve(h, b)  # the CPU tier (2 chunks) now holds b; a is on disk only
        _durable(h)
        composite = h.manager.composite
        keys = _keys(a)
        assert not any(composite.cpu.is_loadable(k) for k in keys)
        assert all(composite.tier("disk").is_loadable(k) for k in keys)

        h.reset_gpu_prefix_cache()
        _zero_gpu(h)
        start = len(h.steps)
        tiers = composite.stats.tiers
        disk_lookups = tiers["disk"]["lookups"]
        req_id = h.admit(a)
        assert tiers["disk"]["lookups"] >= disk_lookups + 2  # both chunks were asked of the disk
        load_steps = [i for i, r in enumerate(h.steps[start:]) if req_id in r.load_jobs.values()]
        assert load_steps and load_steps[0] >= 1, "a disk hit must be verified before it is a HIT"
        assert h.prefix_hits[req_id].external == 2 * BLOCK
        assert all(h.kv_matches(req_id))
        h.settle()
        assert h.manager.check("disk").outcomes()["ok"] == 2
        # Promoted on the way: the next request for a is served from the CPU tier.
        assert all(composite.cpu.is_loadable(k) for k in keys)
        h.reset_gpu_prefix_cache()
        before, disk_lookups = tiers["cpu"]["hits"], tiers["disk"]["lookups"]
        assert _serve(h, a).external == 2 * BLOCK
        assert tiers["cpu"]["hits"] == before + 2
        assert tiers["disk"]["lookups"] == disk_lookups  # CPU had both: the disk was not asked


def _corrupt(h: vh.VllmHarness, key: bytes) -> None:
    disk = h.manager.composite.tier("disk")
    slot = disk.slot_of(key)
    with open(disk.namespace.slab_path(0), "r+b") as f:
        f.seek(slot * disk.slot_size + 100)
        byte = f.read(1)
        f.seek(slot * disk.slot_size + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def test_a_disk_chunk_corrupted_after_store_is_a_miss_and_recomputed(model_dir, tmp_path, caplog):
    with _build(model_dir, cpu_chunks=3, disk=tmp_path / "disk") as h:
        a, b = _prompt(4, 3 * BLOCK + 1), _prompt(5, 3 * BLOCK + 1)
        _serve(h, a)
        _durable(h)
        _serve(h, b)
        _durable(h)
        keys = _keys(a)
        _corrupt(h, keys[1])  # a's second chunk, between store and lookup

        h.reset_gpu_prefix_cache()
        _zero_gpu(h)
        with caplog.at_level(logging.WARNING):
            req_id = h.admit(a)
        # The first chunk is served, the corrupt one and everything after it recomputed.
        assert h.prefix_hits[req_id].external == BLOCK
        assert all(h.kv_matches(req_id)), "the recomputed KV must be right"
        assert "failed its checksum" in caplog.text
        h.settle()
        # Dropped from the disk tier (the recomputed chunk may since have been stored again).
        assert h.manager.composite.tier("disk").stats.checksum_failures == 1
        assert h.manager.check("disk").outcomes()["failed"] == 1
        # The engine runs on, and the recomputed chunks are offloaded again.
        assert _serve(h, _prompt(6, 2 * BLOCK + 1)).num_prompt_tokens == 2 * BLOCK + 1
        h.reset_gpu_prefix_cache()
        assert _serve(h, a).external == 3 * BLOCK


def test_a_restarted_engine_serves_the_disk_tier(model_dir, tmp_path):
    prompt = _prompt(7, 3 * BLOCK + 2)
    with _build(model_dir, cpu_chunks=4, disk=tmp_path / "disk") as h:
        _serve(h, prompt)
        _durable(h)
    with _build(model_dir, cpu_chunks=4, disk=tmp_path / "disk") as h:
        assert h.manager.composite.tier("disk").is_loadable(_keys(prompt)[0])
        _zero_gpu(h)
        req_id = h.admit(prompt)
        assert h.prefix_hits[req_id].external == 3 * BLOCK
        assert all(h.kv_matches(req_id))
        h.settle()


# ------------------------------------------------------------------ worker faults


def test_a_failed_store_in_a_worker_is_reported_done_and_never_served(model_dir, monkeypatch, caplog):
    with _build(model_dir) as h:
        worker = h.worker_spec.get_worker(None)

        def broken_copy(*args, **kwargs):
            raise RuntimeError("injected: device copy failed")

        monkeypatch.setattr(worker.store_handler.gpu_to_cpu, "_copy", broken_copy)
        prompt = _prompt(8, 2 * BLOCK + 1)
        with caplog.at_level(logging.ERROR):
            _serve(h, prompt)  # vLLM asserts every job succeeded: it must not see this one
        assert "store job" in caplog.text and "failed" in caplog.text
        composite = h.manager.composite
        assert not any(k in composite.cpu for k in _keys(prompt)), "garbage became loadable"
        monkeypatch.undo()
        h.reset_gpu_prefix_cache()
        assert _serve(h, prompt).external == 0  # recomputed, then stored for real
        h.reset_gpu_prefix_cache()
        assert _serve(h, prompt).external == 2 * BLOCK
        stats = h.stats()
        assert stats["tiered_kv_worker_job_failures:('store',)"] == 1


def test_a_failed_promotion_in_a_worker_is_not_kept_in_cpu(model_dir, tmp_path, monkeypatch, caplog):
    with _build(model_dir, cpu_chunks=2, disk=tmp_path / "disk") as h:
        a, b = _prompt(9, 2 * BLOCK + 1), _prompt(10, 2 * BLOCK + 1)
        _serve(h, a)
        _durable(h)
        _serve(h, b)
        _durable(h)
        worker = h.worker_spec.get_worker(None)
        # The read fails *after* the scheduler verified the chunks (a dying disk).
        monkeypatch.setattr(worker.load_handler.to_cpu[0], "_load_job", lambda *a, **k: False)
        h.reset_gpu_prefix_cache()
        with caplog.at_level(logging.ERROR):
            _serve(h, a)
        assert "load job" in caplog.text
        composite = h.manager.composite
        assert not any(k in composite.cpu for k in _keys(a)), "a failed promotion was kept"
        assert all(composite.tier("disk").is_loadable(k) for k in _keys(a))
        assert h.stats()["tiered_kv_worker_job_failures:('promotion',)"] == 1
        monkeypatch.undo()
        h.reset_gpu_prefix_cache()
        _zero_gpu(h)
        req_id = h.admit(a)  # the engine runs on and serves the chunks again
        assert h.prefix_hits[req_id].external == 2 * BLOCK and all(h.kv_matches(req_id))
        h.settle()


# ------------------------------------------------------------------ reset, metrics


def test_a_connector_cache_reset_empties_every_tier(model_dir, tmp_path, monkeypatch):
    with _build(model_dir, cpu_chunks=4, disk=tmp_path / "disk") as h:
        prompt, late = _prompt(11, 3 * BLOCK + 1), _prompt(14, 2 * BLOCK + 1)
        _serve(h, prompt)
        _durable(h)
        # late's disk writes are still in flight at the reset: they must not be served after.
        store = h.worker_spec.get_worker(None).hierarchy.store
        gate, begin_write = threading.Event(), store.begin_write
        monkeypatch.setattr(store, "begin_write", lambda *a, **k: gate.wait(30) and begin_write(*a, **k))
        _serve(h, late)
        assert h.manager.composite.pending_writes() == 2
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
        h.settle()
        gate.set()
        deadline = time.monotonic() + 20
        while h.manager.check("disk")._stale_writes:
            assert time.monotonic() < deadline, "stale disk writes were never dropped"
            h.step()  # an idle step still ends with on_schedule_end
            time.sleep(0.005)
        composite = h.manager.composite
        assert composite.used_blocks() == {"cpu": 0, "disk": 0}
        assert _serve(h, prompt).external == 0
        h.reset_gpu_prefix_cache()
        assert _serve(h, late).external == 0


def test_a_store_that_fails_while_a_reset_waits_for_its_jobs_is_not_served(model_dir):
    """After a reset vLLM waits for the jobs in flight (its fence) while new ones run. A
    new store job that fails, reported in the same worker output as the fence's last job,
    keeps its failure mark: only the fenced jobs' slots are forgotten when the fence ends.
    The worker is played by hand ("ack"): it marks a failed job's slots before reporting
    it, as ``TieredVllmWorker._fail`` does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    config = {**SPEC, "cpu_bytes": f"{16 * GPU_BLOCK_BYTES}B", "block_size": BLOCK}
    with vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="ack") as h:
        m, jobs = h.manager, {}

        def step(report=(), failed_keys=()):
            out = h.scheduler.schedule()
            jobs.update(dict.fromkeys(out.kv_connector_metadata.store_jobs, "store"))
            m.health.mark_bad([m.composite.cpu.slot_of(k) for k in failed_keys])
            done = OffloadingWorkerMetadata()
            for job in report:
                done.mark_completed(job)
                jobs.pop(job)
            output = KVConnectorOutput(kv_connector_worker_meta=done if report else None)
            h.scheduler.update_from_output(out, h._model_output(out, output))

        h.add_request(_prompt(21, 3 * BLOCK + 1), max_tokens=2)
        for _ in range(4):
            step()
        fenced = list(jobs)
        assert fenced and h.scheduler.reset_prefix_cache(reset_connector=True)
        late = _prompt(22, 3 * BLOCK + 1)
        h.add_request(late, max_tokens=2)
        for _ in range(4):
            step()
        failing = [job for job in jobs if job not in fenced]
        reserved = [k for k in _keys(late) if k in m.composite.cpu]
        assert failing and reserved
        step(report=fenced + failing, failed_keys=reserved)
        assert not any(m.composite.cpu.is_loadable(k) for k in _keys(late)), "a failed store's chunks are served"


def test_tier_metrics_reach_vllms_prometheus_side(model_dir, tmp_path):
    with _build(model_dir, cpu_chunks=2, disk=tmp_path / "disk") as h:
        a, b = _prompt(12, 2 * BLOCK + 1), _prompt(13, 2 * BLOCK + 1)
        _serve(h, a)
        _durable(h)
        _serve(h, b)
        _durable(h)
        h.reset_gpu_prefix_cache()
        _serve(h, a)
        registry = h.publish_metrics()  # fails if a reported metric was not declared

        def value(name, **labels):
            return registry.get_sample_value(name, {"engine": "0", **labels})

        assert value("tiered_kv_tier_blocks_total", tier="cpu", event="stores") == 4
        assert value("tiered_kv_tier_blocks_total", tier="disk", event="stores") == 4
        assert value("tiered_kv_tier_blocks_total", tier="disk", event="hits") == 2
        assert value("tiered_kv_tier_blocks_total", tier="cpu", event="promotions") == 2
        assert value("tiered_kv_tier_verifications_total", tier="disk", outcome="ok") == 2
        assert value("tiered_kv_verification_seconds_count", tier="disk") == 2  # one timing per verification
        assert value("tiered_kv_tier_tokens_total", tier="disk", event="hits") == 2 * BLOCK
        lookups = value("tiered_kv_tier_blocks_total", tier="disk", event="lookups")
        assert value("tiered_kv_tier_tokens_total", tier="disk", event="lookups") == lookups * BLOCK > 0
        assert value("tiered_kv_tier_capacity_blocks", tier="cpu") == 2
        assert value("tiered_kv_tier_used_blocks", tier="disk") == 4
        assert value("tiered_kv_tier_bytes_written_per_read", tier="disk") == 2.0  # 4 chunks written, 2 read
        assert value("vllm:kv_offload_load_bytes_total") == 2 * GPU_BLOCK_BYTES
        # vLLM's own connector carries nothing of a worker's (ours does: below).
        assert value("tiered_kv_transfer_jobs_total", transfer_type="gpu_to_cpu", outcome="ok") is None
        info = {
            s.labels["tier"]: s.labels
            for m in registry.collect()
            if m.name == "vllm:kv_offload_config_info"
            for s in m.samples
        }
        assert info["cpu"]["tiered_cpu_slots"] == "2"
        assert info["disk"]["disk_path"] == str(tmp_path / "disk") and info["disk"]["tier_type"] == "disk"


def test_with_our_connector_each_workers_transfers_reach_vllms_prometheus_side(model_dir, tmp_path):
    """vLLM's connector reports nothing from a worker; ours hands each step's transfer
    jobs and timings over with the step's output (counted once, however many steps)."""
    config = {**SPEC, "cpu_bytes": f"{2 * GPU_BLOCK_BYTES}B", "block_size": BLOCK}
    config.update(disk_path=str(tmp_path / "disk"), disk_bytes=f"{64 * 4096}B")
    with vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real", **vh.ONE_READ) as h:
        a, b = _prompt(14, 2 * BLOCK + 1), _prompt(15, 2 * BLOCK + 1)
        _serve(h, a)
        _durable(h)
        _serve(h, b)
        _durable(h)
        h.reset_gpu_prefix_cache()
        assert _serve(h, a).external == 2 * BLOCK  # from the disk: CPU holds b's chunks
        h.settle()
        registry = h.publish_metrics()

        def value(name, **labels):
            return registry.get_sample_value(name, {"engine": "0", **labels})

        stores = sum(len(step.store_jobs) for step in h.steps)
        loads = sum(len(step.load_jobs) for step in h.steps)
        assert value("tiered_kv_transfer_jobs_total", transfer_type="gpu_to_cpu", outcome="ok") == stores >= 2
        assert value("tiered_kv_transfer_jobs_total", transfer_type="disk_to_cpu", outcome="ok") == loads == 1
        assert value("tiered_kv_transfer_jobs_total", transfer_type="cpu_to_gpu", outcome="ok") == loads
        # The endpoint's totals are the worker's own: nothing lost or counted twice.
        transfers = h.worker_spec._worker.stats.as_dict()["transfers"]
        moved = {kind: t for kind, t in transfers.items() if t["jobs"]}
        assert set(moved) == {"gpu_to_cpu", "cpu_to_disk", "disk_to_cpu", "cpu_to_gpu"}
        for kind, t in moved.items():
            assert value("tiered_kv_transfer_jobs_total", transfer_type=kind, outcome="ok") == t["jobs"]
            assert value("tiered_kv_transfer_seconds_count", transfer_type=kind) == t["jobs"]
            assert value("tiered_kv_transfer_seconds_sum", transfer_type=kind) == pytest.approx(t["seconds"])
        # What an operator reads from vLLM's endpoint: each tier's load latency.
        _load_commands()
        server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        try:
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            result = CliRunner().invoke(app, ["stats", "--url", url, "--json"])
        finally:
            server.shutdown()
            server.server_close()
        assert result.exit_code == 0, result.output
        tiers = {t["tier"]: t for t in json.loads(result.stdout)["tiers"]}
        assert tiers["disk"]["load_latency"]["count"] == loads
        assert tiers["disk"]["load_latency"]["p50_seconds"] > 0
        assert tiers["cpu"]["load_latency"]["count"] == transfers["cpu_to_gpu"]["jobs"]


@pytest.mark.faults
def test_a_disk_read_that_fails_is_one_failed_load_that_moves_no_bytes_and_is_not_offered_again(
    model_dir, tmp_path, monkeypatch
):
    """The disk fails to read a chunk (an I/O error, injected: no device fails on
    demand): the request recomputes it, vLLM's load counters show no bytes for the failed
    job, and the chunk, dropped from the disk tier, is not offered to fail again (the
    request's recomputed chunks are stored anew)."""
    import errno

    config = {**SPEC, "cpu_bytes": f"{2 * GPU_BLOCK_BYTES}B", "block_size": BLOCK}
    config.update(disk_path=str(tmp_path / "disk"), disk_bytes=f"{64 * 4096}B")
    with vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real", **vh.ONE_READ) as h:
        a, b = _prompt(16, 2 * BLOCK + 1), _prompt(17, 2 * BLOCK + 1)
        for prompt in (a, b):
            _serve(h, prompt)
            _durable(h)

        def bad_sector(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        backend = h.worker_spec._worker.load_handler.to_cpu[0].store.backend
        monkeypatch.setattr(backend, "pread", bad_sector)
        monkeypatch.setattr(backend, "preadv", bad_sector)
        h.reset_gpu_prefix_cache()
        assert _serve(h, a).external == 2 * BLOCK  # offered from the disk: CPU holds b's chunks
        h.settle()
        assert sum(len(step.load_jobs) for step in h.steps) == 1
        registry = h.publish_metrics()

        def value(name, **labels):
            return registry.get_sample_value(name, {"engine": "0", **labels})

        assert value("tiered_kv_transfer_jobs_total", transfer_type="disk_to_cpu", outcome="failed") == 1
        assert not value("vllm:kv_offload_load_bytes_total")


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_failed_loads_are_left_to_vllm_to_recompute_only_for_a_model_of_one_kv_cache_group(
    model_dir, monkeypatch, caplog, role
):
    """vLLM 0.33 stops the engine when a connector reports failed block ids of a model of
    several KV-cache groups; our connector then reports none (and the shared tier's hits
    are verified before they are promised). Decided where vLLM builds the connector,
    with no vLLM config current, as in vLLM's engine core."""
    seen: list[bool] = []
    decide = spec_module.failed_loads_recomputed
    monkeypatch.setattr(spec_module, "failed_loads_recomputed", lambda: seen.append(decide()) or seen[-1])
    config = vh.make_vllm_config(
        model_dir, {**SPEC, "cpu_bytes": f"{16 * GPU_BLOCK_BYTES}B", "block_size": BLOCK}, **vh.ONE_READ
    )
    one_group = vh.make_kv_cache_config(config, 64)
    full = one_group.kv_cache_groups[0].kv_cache_spec
    layers = one_group.kv_cache_groups[0].layer_names
    window = SlidingWindowSpec(
        block_size=full.block_size,
        num_kv_heads=full.num_kv_heads,
        head_size=full.head_size,
        dtype=full.dtype,
        sliding_window=4 * BLOCK,
    )
    hybrid = dataclasses.replace(
        one_group, kv_cache_groups=[KVCacheGroupSpec(layers[:1], full), KVCacheGroupSpec(layers[1:], window)]
    )
    for connector_cls, kv_cache_config in (
        (TieredOffloadingConnector, one_group),
        (TieredOffloadingConnector, hybrid),
        (OffloadingConnector, one_group),  # vLLM's own: a failed load is fatal there
    ):
        connector_cls(config, role, kv_cache_config).shutdown()
    assert seen == [True, False, False]
    assert "the model has 2 KV-cache groups" in caplog.text
