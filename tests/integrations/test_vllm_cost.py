"""Loads chosen by cost inside vLLM 0.33's real scheduler and worker connector (CPU
tensors, tests/support/vllm_harness.py, ``worker="real"``): vLLM asks chunk by chunk, our
manager decides per request; the worker's measured load times reach the scheduler's
estimates; a disk tier that slows down is passed over and used again once it recovers."""

from __future__ import annotations

import time

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from conftest import make_layout  # noqa: E402
from support.disk_fixtures import slow_disk_reads  # noqa: E402
from support.slow_tier import passed_over_while_slow_and_used_again  # noqa: E402

from tiered_kv.integrations.vllm.common import TieredJobSpec  # noqa: E402
from tiered_kv.integrations.vllm.connector import step_work  # noqa: E402
from tiered_kv.tiered.transfer_specs import TieredStoreSpec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16
GPU_BLOCK_BYTES = 4096
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _prompt(seed: int, n: int = 2 * BLOCK + 1) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def _build(model_dir, disk, **extra) -> vh.VllmHarness:
    config = {
        **SPEC,
        "cpu_bytes": f"{2 * GPU_BLOCK_BYTES}B",  # two chunks
        "disk_path": str(disk),
        "disk_bytes": f"{64 * 4096}B",
        "promote_on_hit": False,  # every repeat reads the disk again
        **extra,
    }
    return vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real")


def _serve(h: vh.VllmHarness, prompt: list[int]) -> vh.PrefixHit:
    h.reset_gpu_prefix_cache()
    req_id = h.add_request(prompt)
    h.settle()
    deadline = time.monotonic() + 20
    while h.manager.composite.pending_writes():
        assert time.monotonic() < deadline, "disk writes never became durable"
        time.sleep(0.005)
    return h.prefix_hits[req_id]


def test_under_vllm_a_disk_slower_than_recomputing_is_passed_over_and_used_again_once_it_recovers(model_dir, tmp_path):
    # Prefill at 100 tokens/s: a 16-token chunk costs 160 ms to recompute, far more than
    # this machine's disk takes to read it, far less than the slowed disk's 1.5 s a job.
    with _build(model_dir, tmp_path / "disk", prefill_tokens_per_s=100.0) as h:
        slow = slow_disk_reads([h.worker_spec._worker.load_handler])
        assert slow

        def slow_down(on: bool) -> None:
            for s in slow:
                s.delay = 1.5 if on else 0.0

        passed_over_while_slow_and_used_again(h, "disk", _serve, _prompt, slow_down, BLOCK)
        disk = h.manager.costs.tiers["disk"]
        assert disk.gbps != disk.prior[0]


def test_under_vllm_chunks_past_the_plan_are_misses_and_the_request_is_computed_right(model_dir, tmp_path):
    """A prefill so fast that no tier pays: vLLM's scan of a disk-only prompt is answered
    RETRY once, then MISS from the first chunk; the request computes every token and its
    KV is what the model writes."""
    with _build(model_dir, tmp_path / "disk", prefill_tokens_per_s=1e12) as h:
        doc = _prompt(7)
        _serve(h, doc)
        _serve(h, _prompt(8))  # CPU now holds the filler only
        tiers = h.manager.composite.stats.tiers
        before = tiers["disk"]["skipped_slower_than_recompute"]
        start = len(h.steps)
        hit = _serve(h, doc)
        assert hit.external == 0
        assert tiers["disk"]["skipped_slower_than_recompute"] - before == 2
        assert not any(r.load_jobs for r in h.steps[start:]), "nothing was loaded"
        assert not h.manager.has_pending_work(), "no decision left waiting"


def test_under_vllm_a_cpu_lead_is_loaded_and_the_slow_disk_chunks_after_it_are_misses(model_dir, tmp_path):
    """A prompt whose first two chunks are in CPU and whose third is only on a disk
    slower than recomputing: the CPU chunks are answered as they are found (only counted),
    the disk chunk waits one step for the decision, which loads the CPU chunks and
    recomputes the rest; the next scan answers from that plan."""
    with _build(model_dir, tmp_path / "disk", prefill_tokens_per_s=100.0, cpu_bytes=f"{3 * GPU_BLOCK_BYTES}B") as h:
        costs = h.manager.costs
        assert costs is not None
        doc = _prompt(11, 3 * BLOCK + 1)
        _serve(h, doc)
        _serve(h, _prompt(12, BLOCK + 1))  # evicts the doc's tail chunk from CPU (its head ranks newer)
        costs.tiers["disk"].gbps = 1e-6  # 4 s a chunk against 160 ms of prefill
        costs.probe_every, costs.probe_after_s = 10**9, 1e9
        tiers = h.manager.composite.stats.tiers
        before = tiers["disk"]["skipped_slower_than_recompute"], tiers["cpu"]["hits"]
        hit = _serve(h, doc)
        assert hit.external == 2 * BLOCK, "the CPU chunks are loaded, the disk chunk recomputed"
        assert tiers["disk"]["skipped_slower_than_recompute"] - before[0] == 1
        assert tiers["cpu"]["hits"] - before[1] == 2 and tiers["disk"]["hits"] == 0
        assert not h.manager.has_pending_work()


def _scheduler_side(tmp_path, cpu_slots: int = 8, disk_gbps: float = 1e-6):
    """vLLM's scheduler-side manager over a CPU and a disk tier, the disk ``disk_gbps``
    (by default seconds a chunk against milliseconds of prefill), probes off."""
    from tiered_kv.cpu.manager import CPUOffloadingManager
    from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
    from tiered_kv.fingerprint import Fingerprint
    from tiered_kv.integrations.vllm.health import SlotHealth
    from tiered_kv.integrations.vllm.manager import TieredVllmManager
    from tiered_kv.tiered.manager import TieredOffloadingManager
    from tiered_kv.tiers import TrustedHitCheck

    layout = make_layout(True)
    fp = Fingerprint.from_layout(layout, model_id="m")
    disk = DiskOffloadingManager(
        tmp_path / "disk", fp, layout, disk_bytes=64 * layout.bytes_per_block, poll_interval=None
    )
    composite = TieredOffloadingManager(
        CPUOffloadingManager(cpu_slots, layout.gpu_block_size), disk, prefill_tokens_per_s=100.0
    )
    manager = TieredVllmManager(
        composite, [TrustedHitCheck(disk)], health=SlotHealth(tmp_path / "health", composite.cpu.num_slots)
    )
    costs = composite.costs
    assert costs is not None
    costs.tiers["disk"].gbps = disk_gbps
    costs.probe_every, costs.probe_after_s = 10**9, 1e9
    return manager, composite, disk, layout.gpu_block_size


def _on_disk_only(manager, composite, disk, keys) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    writer = ReqContext(req_id="writer")
    out = manager.prepare_store(keys, writer)
    disk.complete_store(out.store_spec.inner.tier_write_through[0].block_hashes)  # durable, as a flush makes it
    manager.complete_store(keys, writer)
    for key in keys:
        composite.cpu.remove(key)


def test_a_hybrid_model_s_chunks_placed_in_two_batches_are_all_planned(tmp_path):
    """Two KV-cache groups whose chunks vLLM placed group by group, then again as the
    request grew (other groups' keys between a group's): every chunk on a fast disk is
    a hit in both groups, the full-attention group's read ahead past the other's keys."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

    manager, composite, disk, tpb = _scheduler_side(tmp_path, cpu_slots=16, disk_gbps=100.0)
    groups = [[make_offload_key(bytes([i]) * 32, g) for i in range(4)] for g in (0, 1)]
    try:
        _on_disk_only(manager, composite, disk, groups[0] + groups[1])
        ctx = ReqContext(req_id="r")
        for batch in (range(2), range(2, 4)):
            for keys in groups:
                for i in batch:
                    ctx.set_offload_key_position(keys[i], (i + 1) * tpb)
        full = [manager.lookup(key, ctx) for key in groups[0]]
        window = [manager.lookup(key, ctx) for key in reversed(groups[1])]  # vLLM: last chunk first
        manager.on_schedule_end(ScheduleEndContext((), ()))
        assert full == [LookupResult.HIT] * 4 and window == [LookupResult.HIT] * 4
    finally:
        composite.shutdown()


def test_a_plan_made_at_a_step_s_end_is_made_anew_once_the_request_is_preempted(tmp_path):
    """A hybrid model's request decided at a step's end to recompute every chunk (on a
    disk far slower than recomputing); it ran, its chunks were stored in CPU, and it was
    preempted: looked up again, its chunks are CPU hits, as for a new request."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

    manager, composite, disk, tpb = _scheduler_side(tmp_path, cpu_slots=16)
    keys = [make_offload_key(bytes([i]) * 32, g) for g in (0, 1) for i in range(3)]
    try:
        _on_disk_only(manager, composite, disk, keys)
        ctx = ReqContext(req_id="r")
        for n, key in enumerate(keys):
            ctx.set_offload_key_position(key, (n % 3 + 1) * tpb)
        manager.on_new_request(ctx)

        def step(preempted: tuple[str, ...] = ()) -> list[LookupResult]:
            manager.on_schedule_end(ScheduleEndContext((), preempted))
            return [manager.lookup(key, ctx) for key in keys]

        step()
        assert step() == [LookupResult.MISS] * 6  # the plan made at the first step's end
        out = manager.prepare_store(keys, ctx)
        assert out is not None and sorted(out.keys_to_store) == sorted(keys)
        manager.complete_store(keys, ctx)
        assert step() == [LookupResult.MISS] * 6  # still waiting: the plan stands
        assert step(preempted=("r",)) == [LookupResult.HIT] * 6
    finally:
        composite.shutdown()


def test_a_cpu_chunk_that_a_disk_load_still_reads_is_judged_as_a_disk_chunk(tmp_path):
    """A chunk that an unfinished load reads from disk is read from disk again, even once
    it is in CPU too (``hit_tier``): after a request's CPU chunks it is judged at the
    disk's cost, not counted into the CPU lead; once that load ends it is a CPU chunk."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

    manager, composite, disk, tpb = _scheduler_side(tmp_path)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    writer, reader = ReqContext(req_id="writer"), ReqContext(req_id="reader")
    try:
        out = manager.prepare_store(keys, writer)
        assert out is not None
        assert isinstance(out.store_spec, TieredJobSpec) and isinstance(out.store_spec.inner, TieredStoreSpec)
        disk.complete_store(out.store_spec.inner.tier_write_through[0].block_hashes)  # durable, as a flush makes it
        manager.prepare_load([keys[1]], reader)  # the CPU copy still being stored: read from disk
        manager.complete_store(keys, writer)
        assert all(composite.cpu.is_loadable(k) for k in keys)

        def scan(req_id: str) -> list[LookupResult]:
            ctx = ReqContext(req_id=req_id)
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, (i + 1) * tpb)
            answers = [manager.lookup(key, ctx) for key in keys]
            manager.on_schedule_end(ScheduleEndContext((), ()))
            return answers

        assert scan("during")[:2] == [LookupResult.HIT, LookupResult.MISS]  # decided at once: passed over
        manager.complete_load([keys[1]], reader)
        assert scan("after") == [LookupResult.HIT] * 3
    finally:
        composite.shutdown()


MODEL_TOKENS_PER_S = 2000.0


def _measuring(model_dir, disk, **extra) -> vh.VllmHarness:
    """A node running our connector over a model of ``MODEL_TOKENS_PER_S``."""
    config = {**SPEC, "cpu_bytes": f"{16 * GPU_BLOCK_BYTES}B", "disk_path": str(disk), "disk_bytes": "256KiB", **extra}
    return vh.VllmHarness.build(
        model_dir, config, num_gpu_blocks=64, worker="real", forward_tokens_per_s=MODEL_TOKENS_PER_S, **vh.ONE_READ
    )


@pytest.mark.parametrize("configured", [None, 150.0])
def test_under_vllm_the_prefill_rate_is_measured_on_the_engines_own_prefill_steps(model_dir, tmp_path, configured):
    """Our connector times the forward passes of steps that are nearly all prefill: the
    fitted marginal rate is the model's (a decode step, one token after a fixed cost,
    would read as a far slower prefill: none is timed). It replaces the estimate unless
    the operator configured one, which is kept, the measured rate reported beside it;
    both reach vLLM's metrics endpoint."""
    with _measuring(model_dir, tmp_path / "disk", prefill_tokens_per_s=configured) as h:
        costs = h.manager.costs
        assert costs is not None
        assert costs.snapshot()["prefill_source"] == ("configured" if configured else "estimated")
        for seed, chunks in enumerate([2, 8, 4, 12, 3, 10, 6, 14]):  # steps of 33-225 tokens
            h.admit(_prompt(100 + seed, chunks * BLOCK + 1), max_tokens=4)
            h.settle()
        snap = costs.snapshot()
        measured = snap["prefill_measured"]
        assert measured is not None and measured["steps"] >= 8
        assert 0.7 * MODEL_TOKENS_PER_S <= measured["tokens_per_s"] <= 1.1 * MODEL_TOKENS_PER_S, measured
        if configured:
            assert snap["prefill_source"] == "configured" and costs.prefill_tokens_per_s == configured
        else:
            assert snap["prefill_source"] == "measured" and costs.prefill_tokens_per_s == measured["tokens_per_s"]
        registry = h.publish_metrics()

        def gauge(kind: str) -> float | None:
            return registry.get_sample_value("tiered_kv_prefill_tokens_per_second", {"engine": "0", "kind": kind})

        assert gauge("used") == pytest.approx(costs.prefill_tokens_per_s, rel=0.2)
        assert gauge("measured") == pytest.approx(measured["tokens_per_s"], rel=0.2)
        assert registry.get_sample_value("tiered_kv_tier_load_gbps", {"engine": "0", "tier": "disk"}) > 0


def test_under_vllm_every_step_counts_towards_the_gpu_s_busy_share(model_dir, tmp_path):
    """Our connector notes each step vLLM's scheduler builds, decode steps included,
    weighted as the decision weighs work: the busy share that discounts a queue waiting
    on something other than the GPU."""
    with _measuring(model_dir, tmp_path / "disk") as h:
        costs = h.manager.costs
        assert costs is not None and costs.busy_share == 1.0  # no step yet
        noted: list[float] = []
        note = costs.note_step
        costs.note_step = lambda work: (noted.append(work), note(work))[1]  # type: ignore[method-assign]
        since = len(h.steps)
        for seed, chunks in enumerate([2, 8, 4]):
            h.admit(_prompt(200 + seed, chunks * BLOCK + 1), max_tokens=4)
            h.settle()
        outputs = [r.scheduler_output for r in h.steps[since:] if r.scheduler_output.total_num_scheduled_tokens]
        decodes = [o for o in outputs if max(o.num_scheduled_tokens.values()) == 1]
        assert decodes
        assert [w for w in noted if w] == [step_work(o, costs.attention_per_token) for o in outputs]  # none: 0
        assert 0 < costs.busy_share <= 1
        share = h.publish_metrics().get_sample_value("tiered_kv_gpu_busy_share", {"engine": "0", "kind": "estimated"})
        assert share == pytest.approx(costs.busy_share, abs=0.1)  # read a moment apart


def test_only_a_step_that_is_nearly_all_prefill_is_timed():
    from dataclasses import replace

    from vllm.v1.core.sched.output import SchedulerOutput

    from tiered_kv.integrations.vllm.connector import is_prefill_step, step_work

    def step(tokens: dict[str, int], spec: dict[str, list[int]] | None = None) -> int:
        out = replace(
            SchedulerOutput.make_empty(),
            num_scheduled_tokens=tokens,
            total_num_scheduled_tokens=sum(tokens.values()),
            scheduled_spec_decode_tokens=spec or {},
        )
        return step_work(out) if is_prefill_step(out) else 0

    assert step({}) == 0
    assert step({"a": 512}) == 512
    assert step({"a": 500, "b": 1, "c": 1}) == 502  # two decodes beside a prefill chunk
    assert step({"a": 1, "b": 1, "c": 1}) == 0  # decodes only
    assert step({"a": 60, **{f"d{i}": 1 for i in range(10)}}) == 0  # 86% prefill
    assert step({"a": 4, "b": 4}, {"a": [7, 7, 7], "b": [7, 7, 7]}) == 0  # speculative decodes
    assert step({"a": 200, "b": 4}, {"b": [7, 7, 7]}) == 204


def test_a_prefill_step_counts_its_tokens_by_the_context_they_attend_to():
    """The timed work of a step is the decision's own measure (``prefill_work``): a chunk
    60k tokens into a prompt weighs what attention makes it, so the rate measured on such
    steps is not read as a slower GPU."""
    from dataclasses import replace

    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from tiered_kv.prefill import DEFAULT_ATTENTION_PER_TOKEN as A
    from tiered_kv.prefill import prefill_work
    from tiered_kv.integrations.vllm.connector import is_prefill_step, step_work

    cached = replace(CachedRequestData.make_empty(), req_ids=["deep", "fresh"], num_computed_tokens=[60_000, 0])
    out = replace(
        SchedulerOutput.make_empty(),
        num_scheduled_tokens={"deep": 512, "fresh": 512},
        total_num_scheduled_tokens=1024,
        scheduled_cached_reqs=cached,
    )
    assert step_work(out) == 1024  # no model shape: tokens as they are
    weighted = step_work(out, A)
    assert weighted == round(prefill_work(512, 60_000, A) + prefill_work(512, 0, A))
    assert weighted > 1.9 * 1024  # the deep chunk costs about 3x a fresh one
    decodes = replace(out, num_scheduled_tokens={"deep": 1, "fresh": 1}, total_num_scheduled_tokens=2)
    assert not is_prefill_step(decodes)
    assert step_work(decodes, A) == pytest.approx(2 + A * 60_001, abs=1)  # busy all the same
