"""Loads from the CPU tier that fail in a worker, inside vLLM 0.33's real scheduler and
worker connector moving real bytes on CPU tensors (tests/support/vllm_harness.py,
``worker="real"``), with ``TieredOffloadingConnector`` and the recompute policy.

What they show: a chunk whose copy to the GPU keeps failing is served once, not again:
the request is recomputed within a few steps, the failure is counted and logged once,
and once copies work the prompt's recomputed chunks are hits with the right bytes; a disk
read that fails behind a CPU-resident lead leaves the lead in the CPU tier; a chunk that
another load still pins when a failure is learned is not served, and is dropped once
free; the mark of a load that a cache reset abandoned reaches no chunk stored later.

I/O: a disk tier in pytest's tmp_path for one test; the test process plays the scheduler
and the worker.
"""

from __future__ import annotations

import errno
import logging

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from test_vllm_tiers import BLOCK, GPU_BLOCK_BYTES, SPEC, _durable, _keys, _prompt, _serve, _zero_gpu  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.faults, pytest.mark.timeout(300)]

LOAD_FAILURES = "tiered_kv_worker_job_failures:('load',)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _harness(model_dir, **extra) -> vh.VllmHarness:
    config = {**SPEC, "cpu_bytes": f"{8 * GPU_BLOCK_BYTES}B", "block_size": BLOCK, **extra}
    return vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real", **vh.ONE_READ)


def _loads(h: vh.VllmHarness, since: int) -> int:
    return sum(len(step.load_jobs) for step in h.steps[since:])


def test_a_cpu_chunk_whose_copy_to_the_gpu_keeps_failing_is_recomputed_then_served_again(
    model_dir, monkeypatch, caplog
):
    with _harness(model_dir) as h:
        prompt = _prompt(41, 3 * BLOCK + 1)
        _serve(h, prompt)
        keys = _keys(prompt)
        cpu = h.manager.composite.cpu
        assert all(cpu.is_loadable(k) for k in keys)
        copies = []

        def broken_copy(*args, **kwargs):
            copies.append(args)
            raise RuntimeError("injected: device copy failed")

        monkeypatch.setattr(h.worker_spec._worker.load_handler.cpu_to_gpu, "_copy", broken_copy)
        h.reset_gpu_prefix_cache()
        first = len(h.steps)
        with caplog.at_level(logging.ERROR, logger="tiered_kv.integrations.vllm"):
            h.add_request(prompt)
            for _ in range(10):
                if not h.scheduler.has_requests():
                    break
                h.step()
        assert not h.scheduler.has_requests(), f"unfinished after 10 steps and {_loads(h, first)} load jobs"
        assert _loads(h, first) == 1 and len(copies) == 1, "a chunk whose load failed was served again"
        dropped = [r for r in caplog.records if "failed to load 3 chunks from the CPU tier" in r.getMessage()]
        assert len(dropped) == 1, caplog.text
        assert h.stats()[LOAD_FAILURES] == 1
        assert h.manager.composite.stats.tiers["cpu"]["failed_loads"] == 3

        monkeypatch.undo()
        h.settle()
        assert all(cpu.is_loadable(k) for k in keys), "the recomputed chunks were not stored afresh"
        h.reset_gpu_prefix_cache()
        _zero_gpu(h)  # only a real load can bring the prefix's bytes back
        req_id = h.admit(prompt)
        assert h.prefix_hits[req_id].external == 3 * BLOCK
        assert all(h.kv_matches(req_id)), h.kv_matches(req_id)
        h.settle()
        assert h.stats()[LOAD_FAILURES] == 1


def test_a_disk_read_that_fails_behind_a_cpu_lead_keeps_the_lead(model_dir, tmp_path, monkeypatch):
    """Only the chunks whose copy failed are dropped: the CPU-resident lead of a load
    landed whole before the disk read behind it failed, and vLLM keeps it."""
    with _harness(model_dir, disk_path=str(tmp_path / "disk"), disk_bytes=f"{64 * 4096}B") as h:
        prompt = _prompt(42, 3 * BLOCK + 1)
        _serve(h, prompt)
        _durable(h)
        keys = _keys(prompt)
        cpu = h.manager.composite.cpu
        cpu.remove(keys[-1])  # the tail now on disk only

        def bad_sector(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        backend = h.worker_spec._worker.load_handler.to_cpu[0].store.backend
        monkeypatch.setattr(backend, "pread", bad_sector)
        monkeypatch.setattr(backend, "preadv", bad_sector)
        h.reset_gpu_prefix_cache()
        first = len(h.steps)
        _serve(h, prompt)
        assert _loads(h, first) == 1
        assert all(cpu.is_loadable(k) for k in keys[:2]), "the CPU lead that landed was dropped"
        assert LOAD_FAILURES not in h.stats()


def test_a_chunk_another_load_pins_is_not_served_and_dropped_once_free(model_dir):
    """Two loads read the same chunk; the worker marks its slot when one's copy fails
    (as ``TieredVllmWorker._fail`` does) and the other ends first: the chunk stays under
    the load still reading it, is answered MISS meanwhile, and leaves the CPU tier when
    that load ends. The chunk stored afresh in a slot is not touched by the old mark."""
    with _harness(model_dir) as h:
        prompt = _prompt(43, 2 * BLOCK + 1)
        _serve(h, prompt)
        m, cpu = h.manager, h.manager.composite.cpu
        keys = _keys(prompt)
        failing, other = ReqContext(req_id="failing"), ReqContext(req_id="other")
        m.prepare_load(keys, failing)
        m.prepare_load(keys, other)
        slot = cpu.slot_of(keys[0])
        m.health.mark_bad([slot])
        m.complete_load(keys, other)
        assert cpu.is_loadable(keys[0]), "removed under a load still reading it"
        asking = ReqContext(req_id="asking")
        assert m.lookup(keys[0], asking) == LookupResult.MISS
        assert m.lookup(keys[1], asking) == LookupResult.HIT
        m.complete_load(keys, failing)
        assert keys[0] not in cpu and cpu.is_loadable(keys[1])
        assert m.health.take_bad([slot]) == set()

        fresh = ReqContext(req_id="fresh")
        out = m.prepare_store([keys[0]], fresh)
        assert out is not None and list(out.keys_to_store) == [keys[0]]
        m.complete_store([keys[0]], fresh)
        assert cpu.is_loadable(keys[0])
        assert m.lookup(keys[0], ReqContext(req_id="later")) == LookupResult.HIT


def test_a_failed_read_of_a_load_a_reset_abandoned_reaches_no_later_chunk(model_dir):
    """vLLM ends no load that a cache reset catches in flight: the mark its failed copy
    left is taken once the reset's jobs are flushed, so it drops no chunk stored in the
    slot later; a load that began after the reset and still pins the chunk keeps it until
    it ends, and the chunk is not served meanwhile."""
    with _harness(model_dir) as h:
        prompt = _prompt(44, 2 * BLOCK + 1)
        _serve(h, prompt)
        m, cpu = h.manager, h.manager.composite.cpu
        keys = _keys(prompt)
        slots = cpu.slots_of(keys)
        abandoned, late = ReqContext(req_id="abandoned"), ReqContext(req_id="late")
        m.prepare_load(keys, abandoned)
        m.reset_cache()
        assert all(cpu.is_loadable(k) for k in keys)  # pinned by the load in flight
        m.prepare_load(keys[:1], late)
        m.health.mark_bad(slots)
        m.on_reset_flushed()
        assert m.health.take_bad(slots) == set()
        assert cpu.is_loadable(keys[0]) and keys[1] not in cpu
        assert m.lookup(keys[0], ReqContext(req_id="asking")) == LookupResult.MISS
        m.complete_load(keys[:1], late)
        assert keys[0] not in cpu

        fresh = ReqContext(req_id="fresh")
        out = m.prepare_store(keys, fresh)
        assert out is not None
        m.complete_store(keys, fresh)
        assert all(cpu.is_loadable(k) for k in keys), "a mark from before the reset dropped a chunk stored since"


def test_disk_writes_that_fail_in_a_worker_are_counted_where_an_operator_looks(model_dir, tmp_path, monkeypatch):
    """Only the workers see a disk write fail (here: the device is full): the failed
    blocks reach vLLM's Prometheus side as the disk tier's ``failed_stores``, and the
    engine goes on serving from CPU."""
    with _harness(model_dir, disk_path=str(tmp_path / "disk"), disk_bytes=f"{64 * 4096}B") as h:
        store = h.worker_spec._worker.load_handler.to_cpu[0].store

        def full(*args, **kwargs):  # fault injection: no space left on the device
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store.backend, "pwritev", full)
        monkeypatch.setattr(store.backend, "pwrite", full)
        prompts = [_prompt(60 + i, 2 * BLOCK + 1) for i in range(3)]
        for prompt in prompts:
            _serve(h, prompt)
        _durable(h)
        h.step()  # the worker hands its counts over with a step's output
        failed = h.worker_spec._worker.stats.as_dict()["tiers"]["disk"]["failed_stores"]
        assert failed >= 2 * len(prompts)
        registry = h.publish_metrics()
        labels = {"engine": "0", "tier": "disk", "event": "failed_stores"}
        assert registry.get_sample_value("tiered_kv_tier_blocks_total", labels) == failed
        disk = h.manager.composite.tier("disk")
        assert not any(disk.is_loadable(k) for p in prompts for k in _keys(p))
        h.reset_gpu_prefix_cache()
        assert _serve(h, prompts[-1]).external == 2 * BLOCK  # CPU still serves
