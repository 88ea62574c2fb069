"""Loads chosen by cost: the per-tier estimates, the decision, the prefill estimate, and
the composite's lookup passing over a tier slower than recomputing (real CPU and disk
tiers; a tier that slows down mid-run is passed over and used again once it recovers)."""

from __future__ import annotations

import json
import time

import pytest

from tiered_kv.config import ConfigError, TieredConfig, admit_after
from tiered_kv.cost import PREFILL, LoadCosts, LoadPlan, PrefixScan, Queues, TierCost
from tiered_kv.prefill import (
    DEFAULT_ATTENTION_PER_TOKEN,
    DEFAULT_PREFILL_TOKENS_PER_S,
    attention_per_token,
    configured_prefill,
    estimate_prefill_tokens_per_s,
    model_parameters,
    prefill_work,
)
from tiered_kv.metrics import TieredStats
from tiered_kv.metrics_export import PrometheusMetrics
from tiered_kv.worker.forward_timer import ForwardTimer

LLAMA_31_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
MiB = 1 << 20


# ---------------------------------------------------------------- estimates


def test_a_tier_estimate_fits_latency_and_bandwidth_from_jobs_of_several_sizes():
    cost = TierCost("disk", gbps=6.0)
    for _ in range(40):
        for blocks in (1, 4, 16):
            nbytes = blocks * 2 * MiB
            cost.observe(nbytes, 0.002 + nbytes / 2e9)  # 2 ms a job, 2 GB/s
    assert cost.gbps == pytest.approx(2.0, rel=0.02)
    assert cost.latency_s == pytest.approx(0.002, rel=0.05)
    assert cost.seconds(8 * MiB) == pytest.approx(0.002 + 8 * MiB / 2e9, rel=0.02)
    assert cost.samples == 120


def test_a_tier_estimate_follows_a_slowdown_and_a_recovery_with_one_job_size():
    cost = TierCost("disk", gbps=6.0)
    for gbps in (5.0, 0.5, 5.0):
        for _ in range(30):
            cost.observe(4 * MiB, 4 * MiB / (gbps * 1e9))
        assert cost.seconds(4 * MiB) == pytest.approx(4 * MiB / (gbps * 1e9), rel=0.05)


def test_one_stalled_job_does_not_keep_a_tier_passed_over_and_a_real_slowdown_is_followed():
    """A 64-block job that stalled 60 s among 8-block jobs at 6 GB/s: the estimate stays
    near 2 GB/s, and ten normal jobs bring it back past a 4 GB/s break-even (without the
    bound it fell to 0.003 GB/s and took 40-odd probes, 30 s apart, to come back). A
    tier that really got 20x slower is followed from its second slow job on."""
    cost = TierCost("disk", gbps=6.0, ref_bytes=2 * MiB)
    for _ in range(20):
        cost.observe(16 * MiB, 16 * MiB / 6e9)
    cost.observe(128 * MiB, 60.0)
    assert cost.gbps > 1.9
    for _ in range(10):
        cost.observe(16 * MiB, 16 * MiB / 6e9)
    assert cost.gbps > 4.0
    slowed = TierCost("disk", gbps=6.0, ref_bytes=2 * MiB)
    for _ in range(20):
        slowed.observe(16 * MiB, 16 * MiB / 6e9)
    for _ in range(3):
        slowed.observe(16 * MiB, 16 * MiB / 0.3e9)
    assert slowed.gbps < 1.0


def test_bad_samples_are_ignored_and_bad_priors_refused():
    cost = TierCost("disk", gbps=6.0)
    for nbytes, seconds in ((0, 1.0), (MiB, 0.0), (MiB, float("nan")), (MiB, -1.0)):
        cost.observe(nbytes, seconds)
    assert cost.samples == 0 and cost.gbps == 6.0
    with pytest.raises(ValueError, match="gbps > 0"):
        TierCost("disk", gbps=0)


def test_a_sample_past_float_range_leaves_the_estimate_as_it_was():
    # A finite total forged into the shared timings file can still overflow the fit.
    cost = TierCost("disk", gbps=6.0)
    for nbytes in (1e200, float("inf")):
        cost.observe(nbytes, 1.0)  # type: ignore[arg-type]
    assert cost.samples == 0 and cost.gbps == 6.0 and cost.latency_s == 0.0
    cost.observe(MiB, MiB / 1e9)
    assert cost.samples == 1 and 1.0 < cost.gbps < 6.0


# ---------------------------------------------------------------- the decision


def costs(disk_gbps: float, latency_s: float = 0.0, **kw) -> LoadCosts:
    """Llama-3.1-8B-sized blocks of 16 tokens (2 MiB), prefill 30,800 tokens/s:
    break-even 4.04 GB/s (attention left out unless ``attention_per_token`` is given)."""
    kw.setdefault("attention_per_token", 0.0)
    return LoadCosts(
        [TierCost("cpu", 50.0), TierCost("disk", disk_gbps, latency_s)],
        bytes_per_block=16 * 131072,
        tokens_per_block=16,
        prefill_tokens_per_s=DEFAULT_PREFILL_TOKENS_PER_S,
        **kw,
    )


def test_break_even_is_kv_bytes_per_token_times_prefill_rate():
    assert costs(6).break_even_gbps == pytest.approx(4.04, abs=0.01)


@pytest.mark.parametrize(
    "disk_gbps, expected, skipped",
    [
        (8.0, 6, {}),  # faster than recomputing: everything
        (2.0, 3, {"disk": 3}),  # slower: the CPU head only
    ],
)
def test_the_plan_loads_the_prefix_that_minimises_ttft(disk_gbps, expected, skipped):
    plan = costs(disk_gbps).plan(["cpu"] * 3 + ["disk"] * 3)
    assert (plan.blocks, plan.skipped, plan.probe) == (expected, skipped, None)


def test_a_block_by_block_scan_promises_only_blocks_every_plan_loads():
    """``PrefixScan`` (vLLM asks block by block): wherever it says the blocks so far pay,
    the plan over the whole run loads at least those; where the whole run pays, it says
    so for every block; ``pays_alone`` tells before the first block whether the leading
    run is promised whole."""
    import random
    from itertools import groupby

    rng = random.Random(0)
    for _ in range(300):
        c = costs(
            rng.choice([1.0, 3.0, 5.0, 12.0]),
            latency_s=rng.choice([0.0, 0.002, 0.05]),
            attention_per_token=rng.choice([0.0, DEFAULT_ATTENTION_PER_TOKEN]),
        )
        c.tiers["cpu"].latency_s = rng.choice([0.0, 0.0001, 0.002])
        c.probe_every = 10**9
        c.queues = Queues(rng.choice([0, 3]), {"disk": rng.choice([0, 40])})
        sources = [rng.choice(["cpu", "disk"]) for _ in range(rng.randint(1, 30))]
        start = rng.choice([0, 16 * 2000])
        scan = PrefixScan(c)
        alone = scan.pays_alone(sources[0])
        said = [scan.add(s, start + 16 * (i + 1)) for i, s in enumerate(sources)]
        lead = len(list(next(groupby(sources))[1]))
        assert not alone or all(said[:lead]), "a tier that pays alone is promised its whole leading run"
        if start == 0:
            assert alone == all(said[:lead]) == said[0]
        assert scan.start == start
        best = c.plan(sources, start).blocks
        assert scan.runs == [[k, len(list(g))] for k, g in groupby(sources)]
        promised = said.index(False) if False in said else len(said)
        assert all(not x for x in said[promised:]), "once unsure, unsure for the rest of the scan"
        assert best >= promised, (sources, said, best)
        if all(c.plan(sources[:i], start).blocks == i for i in range(1, len(sources) + 1)):
            assert promised == len(sources), "a run that pays at every length is promised whole"


def test_zero_is_a_candidate_and_a_tier_s_latency_counts_once():
    slow = costs(6.0, latency_s=0.050)  # 50 ms a job: more than 10 blocks' prefill (8.3 ms)
    assert slow.plan(["disk"] * 10).blocks == 0
    assert slow.plan(["disk"] * 1000).blocks == 1000  # 400 ms of load against 519 ms of prefill
    off = costs(0.1)
    off.enabled = False
    assert off.plan(["disk"] * 4).blocks == 4


def test_under_load_the_gpu_queue_makes_recomputing_dearer_and_a_tier_s_queue_loading():
    """3 GB/s is below the idle break-even (4.04): passed over while nobody waits for the
    GPU, loaded once requests do; 8 GB/s is loaded on an idle tier and passed over
    behind a backlog of writes, unless the GPU queue costs more than that wait."""
    slow, fast = costs(3.0), costs(8.0)
    disk = ["disk"] * 8
    assert slow.plan(disk).blocks == 0
    slow.queues = Queues(gpu_waiting=4)
    assert slow.plan(disk).blocks == 8
    assert fast.plan(disk).blocks == 8
    fast.queues = Queues(tier_blocks={"disk": 400})  # 400 x 0.26 ms queued: 105 ms of wait
    assert fast.plan(disk).blocks == 0
    assert fast.plan(["disk"] * 1000).blocks == 1000  # a wait is paid once: a long run still pays
    fast.queues = Queues(gpu_waiting=30, tier_blocks={"disk": 400})  # 8 x 0.52 ms x 31 > 105 ms
    assert fast.plan(disk).blocks == 8


def test_requests_that_wait_while_the_gpu_idles_are_not_delayed_by_a_recompute():
    """With 4 requests waiting, 3 GB/s (below the idle break-even) is loaded while the
    engine reports no steps (each waiting request taken to wait for the GPU) and while
    the GPU computes 90% of the time. Where it computes 5% of the time the queue waits on
    something else (device memory held by loads), which a recompute does not lengthen:
    the run is recomputed. Steps older than the window no longer count."""
    now = [0.0]
    c = costs(3.0, clock=lambda: now[0], probe_after_s=1e9)  # no probe: the plan alone
    c.queues = Queues(gpu_waiting=4)
    disk = ["disk"] * 8
    assert c.busy_share == 1.0
    assert c.plan(disk).blocks == 8
    for share in (0.9, 0.05):
        for _ in range(30):  # a step a second, of ``share`` seconds of work
            c.note_step(DEFAULT_PREFILL_TOKENS_PER_S * share)
            now[0] += 1.0
        assert c.busy_share == pytest.approx(share)
        assert c.gpu_delay == pytest.approx(1 + 4 * share)
        assert c.plan(disk).blocks == (8 if share > 0.5 else 0)
    c.note_step(float("nan"))
    c.note_step(-5.0)
    assert c.busy_share == pytest.approx(0.05)
    metrics = PrometheusMetrics()
    metrics.update(TieredStats(), costs=c.snapshot())
    assert metrics.registry.get_sample_value("tiered_kv_gpu_busy_share", {"kind": "estimated"}) == pytest.approx(0.05)
    assert costs(3.0).snapshot()["gpu_busy_share"] is None  # no step reported: no gauge


def test_requests_arriving_while_a_long_run_recomputes_make_recomputing_it_dearer():
    """At 3 GB/s (below the idle break-even) a 6,400-block run (102k tokens, 3.3 s to
    recompute) is passed over with nobody arriving; at one arrival every 2 s, each
    request arriving during that recompute waits about half of it, and the run loads.
    Arrivals older than the window no longer count."""
    now = [0.0]
    c = costs(3.0, clock=lambda: now[0], probe_after_s=1e9)  # no probe: the plan alone
    run = ["disk"] * 6400
    assert c.plan(run).blocks == 0
    for _ in range(15):  # 15 arrivals in 30 s
        c.note_arrival()
        now[0] += 2.0
    assert c.arrivals_per_s == pytest.approx(0.5)
    assert c.plan(run).blocks == 6400
    assert c.plan(["disk"] * 8).blocks == 0  # a short run delays nobody much
    now[0] += 60.0
    c.note_arrival()
    assert c.arrivals_per_s == pytest.approx(1 / 30)
    assert c.plan(run).blocks == 0


def test_attention_makes_blocks_deep_in_a_prompt_dearer_to_recompute():
    """Llama-3.1-8B's shape: blocks from token 0 load slower than they recompute at
    3 GB/s; 60k tokens into a prompt attention makes recomputing them 2x dearer."""
    assert attention_per_token(LLAMA_31_8B) == pytest.approx(DEFAULT_ATTENTION_PER_TOKEN, rel=0.01)
    c = costs(3.0, attention_per_token=attention_per_token(LLAMA_31_8B))
    assert c.plan(["disk"] * 8).blocks == 0
    assert c.plan(["disk"] * 8, start=60_000).blocks == 8
    assert c.recompute_seconds(1, 0, 60_000) == pytest.approx(2.96 * c.recompute_seconds(1, 0), rel=0.02)
    assert prefill_work(16, 60_000, 0.0) == 16
    a = DEFAULT_ATTENTION_PER_TOKEN
    assert prefill_work(2, 10, a) == pytest.approx(2 + a * (11 + 12))  # tokens 11 and 12 attend to 11 and 12


def test_the_attention_term_comes_from_the_model_s_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_31_8B, "num_hidden_layers": 64}))
    deep = configured_prefill(None, str(tmp_path))
    assert deep.attention_per_token > DEFAULT_ATTENTION_PER_TOKEN
    assert configured_prefill(12_345.0, str(tmp_path)).attention_per_token == deep.attention_per_token
    assert configured_prefill(None, str(tmp_path / "missing")).attention_per_token == DEFAULT_ATTENTION_PER_TOKEN


def test_a_passed_over_tier_is_probed_every_nth_decision_and_after_a_while():
    now = [0.0]
    c = costs(1.0, probe_every=3, probe_after_s=10.0, clock=lambda: now[0])
    sources = ["cpu", "cpu", "disk", "disk"]
    plans = [c.plan(sources) for _ in range(6)]
    assert [p.blocks for p in plans] == [2, 2, 3, 2, 2, 3]
    assert [p.probe for p in plans] == [None, None, "disk", None, None, "disk"]
    assert plans[2].skipped == {"disk": 1}
    now[0] = 11.0
    c.queues = Queues(tier_blocks={"disk": 5}, tier_loads={"disk": 5})  # a probe would wait behind loads: not yet
    assert c.plan(sources).probe is None
    c.queues = Queues()
    assert c.plan(sources).probe == "disk"  # 10 s since the last probe
    c.observe("disk_to_gpu", 2 * MiB, 0.001)  # a sample resets the timer
    now[0] = 15.0
    assert c.plan(sources).probe is None


def test_transfers_sample_the_tier_they_read_from():
    c = costs(6.0)
    stats = TieredStats()
    stats.observers.append(c.observe)
    for _ in range(50):
        stats.record_transfer("disk_to_cpu", 4 * MiB, 4 * MiB / 1e9)  # 1 GB/s
        stats.record_transfer("cpu_to_disk", 4 * MiB, 1.0)  # a write: not a load
    assert c.tiers["disk"].gbps == pytest.approx(1.0, rel=0.05) and c.tiers["cpu"].samples == 0
    snap = c.snapshot()
    assert snap["tiers"]["disk"]["samples"] == 50 and snap["break_even_gbps"] == pytest.approx(4.04, abs=0.01)
    metrics = PrometheusMetrics()
    metrics.update(stats, costs=snap)
    assert metrics.registry.get_sample_value("tiered_kv_tier_load_gbps", {"tier": "disk"}) == pytest.approx(
        1.0, rel=0.05
    )


def test_a_failed_load_is_charged_its_wait_and_the_recompute():
    """A tier whose every other load stalls 2 s and fails is passed over, and so is one
    whose loads fail after a few ms; one whose loads fail at once is never taken for a
    fast tier."""
    stalling, failing = costs(6.0), costs(6.0)
    block = stalling.bytes_per_block
    recompute = stalling.tokens_per_block / stalling.prefill_tokens_per_s
    for i in range(10):
        if i % 2:
            stalling.observe("disk_to_gpu", block, 2.0, success=False)
        else:
            stalling.observe("disk_to_gpu", block, block / 8e9)  # 8 GB/s when it answers
        failing.observe("disk_to_gpu", block, 1e-6, success=False)
    assert stalling.tiers["disk"].seconds(block) > recompute
    assert stalling.plan(["disk"] * 4).blocks == 0
    assert failing.tiers["disk"].seconds(block) >= 0.9 * recompute  # about what recomputing costs, not 0
    erring = costs(6.0)
    for _ in range(10):
        erring.observe("disk_to_gpu", block, 0.005, success=False)  # an error answer after 5 ms
    assert erring.plan(["disk"] * 4).blocks == 0
    for bad in (float("nan"), float("inf"), -1.0):  # no measure: ignored
        failing.observe("disk_to_gpu", block, bad, success=False)
    failing.observe("disk_to_gpu", 0, 1.0, success=False)
    assert failing.tiers["disk"].samples == 10
    failing.observe("disk_to_gpu", block, 0.0, success=False)
    assert failing.tiers["disk"].samples == 11  # a failure in no time still cost the recompute


def test_measured_prefill_steps_replace_the_estimate_unless_a_rate_was_configured():
    # An engine at 5,000 tokens/s with 10 ms a step: steps of 512-4096 tokens.
    sizes = [512, 2048, 1024, 4096, 768] * 4
    estimated, configured = costs(6.0), costs(6.0)
    configured.prefill_configured = True
    stats = TieredStats()
    for c in (estimated, configured):
        assert c.snapshot()["prefill_measured"] is None
        c.observe(PREFILL, 1000, 0.0)  # bad samples: ignored
        c.observe(PREFILL, 1000, float("nan"))
        c.observe(PREFILL, 0, 1.0)
        c.observe(PREFILL, 1000, 1.0, success=False)
        assert c.prefill_fit is None
        for n in sizes:
            c.observe(PREFILL, n, 0.010 + n / 5000)
    fit = estimated.snapshot()["prefill_measured"]
    assert fit["tokens_per_s"] == pytest.approx(5000, rel=0.03) and fit["step_overhead_s"] == pytest.approx(
        0.01, rel=0.2
    )
    assert fit["steps"] == len(sizes)
    assert (
        estimated.prefill_tokens_per_s == fit["tokens_per_s"] and estimated.snapshot()["prefill_source"] == "measured"
    )
    assert estimated.break_even_gbps == pytest.approx(2 * MiB / 16 * 5000 / 1e9, rel=0.03)
    assert configured.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S, "a configured rate is kept"
    assert configured.snapshot()["prefill_source"] == "configured"
    assert configured.snapshot()["prefill_measured"]["tokens_per_s"] == pytest.approx(5000, rel=0.03)
    metrics = PrometheusMetrics()
    metrics.update(stats, costs=configured.snapshot())
    gauge = metrics.registry.get_sample_value
    assert gauge("tiered_kv_prefill_tokens_per_second", {"kind": "used"}) == DEFAULT_PREFILL_TOKENS_PER_S
    assert gauge("tiered_kv_prefill_tokens_per_second", {"kind": "measured"}) == pytest.approx(5000, rel=0.03)


def test_a_forward_timer_on_cpu_times_each_marked_pass_and_nothing_else():
    seen: list[tuple[int, float]] = []
    timer = ForwardTimer(lambda tokens, seconds: seen.append((tokens, seconds)))
    timer.start(0)  # a step not marked as prefill
    time.sleep(0.01)
    timer.stop()
    timer.stop()  # no pass open
    timer.start(300)
    time.sleep(0.02)
    timer.stop()
    assert len(seen) == 1 and seen[0][0] == 300 and 0.02 <= seen[0][1] < 1.0


@pytest.mark.gpu
def test_a_forward_timer_on_cuda_times_the_gpu_work_not_its_launch():
    import torch

    seen: list[tuple[int, float]] = []
    timer = ForwardTimer(lambda tokens, seconds: seen.append((tokens, seconds)), cuda=True)
    a = torch.randn(4096, 4096, device="cuda")
    a = a @ a / 64  # cuBLAS set up before the timed pass
    torch.cuda.synchronize()
    timer.start(4096)
    t0 = time.perf_counter()
    for _ in range(20):
        a = a @ a / 64
    issued = time.perf_counter() - t0
    timer.stop()  # the matmuls are still running: nothing recorded yet, nothing waited for
    torch.cuda.synchronize()
    gpu = time.perf_counter() - t0
    timer.poll()
    assert len(seen) == 1 and seen[0][0] == 4096
    assert seen[0][1] > issued and seen[0][1] <= gpu * 1.05


# ---------------------------------------------------------------- prefill estimate and config


def test_prefill_estimate_for_llama_3_1_8b_on_h100_is_the_design_figure(tmp_path):
    params = model_parameters(LLAMA_31_8B)
    assert params == pytest.approx(8.03e9, rel=0.005)
    est = estimate_prefill_tokens_per_s(params, "NVIDIA H100 80GB HBM3")
    assert est.tokens_per_s == pytest.approx(30_800, rel=0.01)
    assert "50% MFU x 989 TFLOPS" in est.source
    unknown = estimate_prefill_tokens_per_s(params, None)
    assert unknown.tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S and "GPU (none)" in unknown.source
    with pytest.raises(ValueError, match="intermediate_size"):
        model_parameters({"hidden_size": 1})


def test_config_keys_of_the_decision_and_of_write_admission():
    cfg = TieredConfig.from_dict(
        {"prefill_tokens_per_s": 12000, "cost_aware": False, "write_admission": {"disk": "reuse(2)"}}
    )
    assert (cfg.prefill_tokens_per_s, cfg.cost_aware) == (12000.0, False)
    assert admit_after(cfg.write_admission, "disk") == 2 and admit_after(cfg.write_admission, "remote") == 1
    assert TieredConfig().cost_aware and admit_after(TieredConfig().write_admission, "disk") == 1
    for bad in ("reuse(0)", "some", 3):
        with pytest.raises(ConfigError, match="write_admission.*reuse"):
            TieredConfig.from_dict({"write_admission": bad})
    with pytest.raises(ConfigError, match="prefill_tokens_per_s: expected a positive number"):
        TieredConfig.from_dict({"prefill_tokens_per_s": -5})
    assert json.dumps(cfg.to_dict())  # printable as given


# ---------------------------------------------------------------- the composite's lookup


class Hierarchy:
    """The composite over a real CPU tier and a real disk tier, driven by hand: ``store``
    plays the workers, writing each write-through copy with a real ``DiskStore``."""

    def __init__(self, tmp_path, cost: LoadCosts | None, admit: int = 1, cpu_slots: int = 4, disk_blocks: int = 32):
        from support.disk_fixtures import disk_bytes_for, fingerprint, small_layout

        from tiered_kv.cpu.manager import CPUOffloadingManager
        from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
        from tiered_kv.disk.store.store import DiskStore
        from tiered_kv.tiered.manager import TieredOffloadingManager

        self.layout = layout = small_layout()
        fp, nbytes = fingerprint(layout), disk_bytes_for(layout, disk_blocks)
        self.disk = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e", poll_interval=None)
        self.store_ = DiskStore.open(tmp_path, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e")
        self.manager = TieredOffloadingManager(
            CPUOffloadingManager(cpu_slots, 16), self.disk, costs=cost, admit_after=admit
        )

    def store(self, hashes):
        from support.disk_fixtures import content_rows

        m = self.manager
        out = m.prepare_store(hashes)
        m.complete_store(out.block_hashes_to_store)
        for writes in (out.store_spec.tier_write_through[0], out.store_spec.tier_spills[0]):
            if len(writes):
                assert all(
                    self.store_.write_blocks(
                        0,
                        writes.block_hashes,
                        writes.tier_slots.tolist(),
                        content_rows(writes.block_hashes, 0, self.layout, self.store_.slot_size),
                    )
                )
        m.pending_writes()
        return out

    def close(self):
        self.store_.close()
        self.manager.shutdown()


def block_costs(disk_gbps: float, bytes_per_block: int, **kw) -> LoadCosts:
    return LoadCosts(
        [TierCost("cpu", 50.0), TierCost("disk", disk_gbps)],
        bytes_per_block=bytes_per_block,
        tokens_per_block=16,
        prefill_tokens_per_s=DEFAULT_PREFILL_TOKENS_PER_S,
        **kw,
    )


def test_blocks_on_a_slow_tier_are_skipped_counted_not_promoted_and_not_hits(tmp_path):
    from support.disk_fixtures import block_hash, small_layout

    bpb = 16 * 131072  # the decision judges Llama-sized blocks; the bytes moved are the layout's
    h = Hierarchy(tmp_path, block_costs(1.0, bpb, probe_every=1000))
    try:
        m = h.manager
        blocks = [block_hash(i) for i in range(8)]
        h.store(blocks[:4])
        h.store(blocks[4:])  # through a 4-slot CPU tier: the head is left on disk only
        media = [m.hit_medium(b) for b in blocks]
        assert media == ["DISK"] * 4 + ["CPU"] * 4
        assert m.lookup(blocks) == 0  # the run starts on the slow disk: recompute all
        assert m.stats.tiers["disk"]["skipped_slower_than_recompute"] == 4
        assert m.stats.tiers["cpu"]["skipped_slower_than_recompute"] == 4
        assert m.stats.tiers["disk"]["hits"] == 0 and m.stats.tiers["cpu"]["promotions"] == 0
        m.costs.tiers["disk"].gbps = 8.0  # now faster than recomputing
        assert m.lookup(blocks) == 8
        assert small_layout().bytes_per_block < bpb
    finally:
        h.close()


def test_the_default_decision_loads_what_is_faster_than_recomputing(tmp_path):
    """Without a given cost model the composite builds one from the tier's block bytes
    and each medium's prior (disk 6 GB/s: above break-even)."""
    from support.disk_fixtures import block_hash

    h = Hierarchy(tmp_path, None)
    try:
        m = h.manager
        assert m.costs is not None and m.costs.enabled
        assert m.costs.bytes_per_block == h.layout.bytes_per_block
        blocks = [block_hash(i) for i in range(8)]
        h.store(blocks[:4])
        h.store(blocks[4:])
        assert m.hit_medium(blocks[0]) == "DISK" and m.lookup(blocks) == 8
    finally:
        h.close()


def test_reuse_2_writes_a_block_to_disk_only_once_it_was_stored_or_hit_twice(tmp_path):
    from support.disk_fixtures import block_hash

    h = Hierarchy(tmp_path, None, admit=2)
    try:
        m = h.manager
        once = [block_hash(i) for i in range(4)]
        out = h.store(once)
        assert out.store_spec.tier_write_through[0].block_hashes == []  # stored once: CPU only
        assert m.stats.tiers["disk"]["not_admitted"] == 4
        m.prepare_load(once[:2])  # a hit: the second use of the first two
        m.complete_load(once[:2])
        h.store([block_hash(i) for i in range(10, 14)])  # evicts all four from CPU
        assert [m.hit_medium(b) for b in once] == ["DISK", "DISK", None, None]
        assert m.stats.tiers["disk"]["stores"] == 2
    finally:
        h.close()


# ---------------------------------------------------------------- real tiers, live costs


def test_a_disk_tier_that_slows_down_is_passed_over_and_used_again_once_it_recovers(tmp_path):
    """The real hierarchy (HierarchySpec, CPU + disk, the engine driver moving and
    verifying bytes), the composite's estimates fed from the handlers' transfers."""
    import numpy as np
    from support.disk_fixtures import slow_disk_reads

    from tiered_kv.sim.driver import DeviceKVCache, EngineDriver
    from tiered_kv.sim.workloads import prefix_hashes
    from tiered_kv.tiered.spec import HierarchySpec

    device = DeviceKVCache(num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu")
    layout = device.layout
    spec = HierarchySpec(
        {
            "cpu_bytes": f"{4 * layout.bytes_per_block}B",
            "disk_path": str(tmp_path),
            "disk_bytes": f"{64 * 4096}B",
            "model_id": "cost-test",
            "cover_weights": False,
            "promote_on_hit": False,  # every repeat reads the disk again
        },
        layout.gpu_block_size,
        layout,
    )
    driver = EngineDriver.from_spec(spec, device)
    m = driver.manager
    # Prefill at 100 tokens/s: a 16-token block costs 160 ms to recompute (a 4-block document 640 ms), far more than
    # this machine's disk takes to read it, and far less than the slowed disk's 2 s a job.
    m.costs.prefill_tokens_per_s = 100.0
    m.costs.probe_every = 3
    spec.stats.observers.append(m.costs.observe)
    slow = slow_disk_reads(driver.worker.handlers)
    assert slow
    rng = np.random.default_rng(0)
    docs = [prefix_hashes(rng.integers(0, 50_000, size=(4, 16))) for _ in range(6)]

    def settle():
        driver.drain()
        for tier in spec.lower_tiers:
            tier.stager.drain()
        m.pending_writes()

    def disk_pass():
        """Each document once, after its blocks left the device and CPU: returns the
        disk blocks loaded and skipped."""
        before = dict(m.stats.tiers["disk"])
        for doc in docs:
            driver.run_request(docs[(docs.index(doc) + 3) % 6])  # pushes the others out of the device
            settle()
            driver.run_request(doc)
            settle()
        after = m.stats.tiers["disk"]
        return after["hits"] - before["hits"], after["skipped_slower_than_recompute"] - before[
            "skipped_slower_than_recompute"
        ]

    try:
        for doc in docs:
            driver.run_request(doc)
        settle()
        hits, skipped = disk_pass()
        assert hits > 0 and skipped == 0, "a fast disk is used"
        assert driver.report.mismatches == 0

        for s in slow:
            s.delay = 2.0
        disk_pass()  # the first slow reads are measured
        hits, skipped = disk_pass()
        assert skipped > 0, "a disk slower than recomputing is passed over"
        assert hits <= skipped / 2, "only probes still read it"
        assert m.stats.tiers["disk"]["probes"] > 0

        for s in slow:
            s.delay = 0.0
        for _ in range(3):  # probes sample the recovered disk
            disk_pass()
        hits, skipped = disk_pass()
        assert hits > 0 and skipped == 0, "a recovered disk is used again"
        assert driver.report.mismatches == 0 and driver.report.failed_jobs == 0
    finally:
        driver.worker.shutdown()
        m.shutdown()
        spec.store.close()


def test_tiered_kv_config_prints_the_prefill_estimate_its_formula_and_break_even(tmp_path):
    from typer.testing import CliRunner

    import tiered_kv.cli.config_cmd  # noqa: F401  (registers the command)
    from tiered_kv.cli import app

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_31_8B, "torch_dtype": "bfloat16"}))
    base = ["config", "--model-config", str(tmp_path / "config.json"), "--model-id", "m", "--cpu-bytes", "1GiB"]
    result = CliRunner().invoke(app, [*base, "--gpu", "H100 SXM"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "50% MFU x 989 TFLOPS dense BF16 (H100 SXM) / (2 x 8.03e9 FLOP/token)" in result.output
    assert "30,791" in result.output and "4.04" in result.output
    assert "replaces the estimate" in result.output  # under vLLM, by the measured rate
    given = CliRunner().invoke(app, [*base, "--prefill-tokens-per-s", "20000", "--json"])
    assert given.exit_code == 0, given.output
    assert json.loads(given.stdout)["kv_connector_extra_config"]["prefill_tokens_per_s"] == 20000


def test_each_tier_is_seeded_with_its_own_types_prior_whatever_its_medium_is_named(tmp_path):
    """A second disk tier (medium ``DISK2``) starts from the disk's prior, not from the
    fallback for a medium the cost model does not know."""
    from tiered_kv.cost import PRIOR_GBPS
    from tiered_kv.sim.driver import DeviceKVCache
    from tiered_kv.tiered.spec import HierarchySpec

    layout = DeviceKVCache(2, 8, 16, 2, 16, device="cpu").layout
    disk = {"path": str(tmp_path / "disk2"), "bytes": f"{64 * 4096}B", "name": "disk2", "medium": "DISK2"}
    config = {"cpu_bytes": f"{4 * layout.bytes_per_block}B", "disk_path": str(tmp_path / "disk"), "disk_bytes": "1MiB"}
    spec = HierarchySpec(
        {**config, "model_id": "priors", "cover_weights": False, "tiers": [{"type": "disk", **disk}]}, 16, layout
    )
    manager = spec.get_manager()
    try:
        assert manager.costs is not None
        assert [t.name for t in manager.lower] == ["disk", "disk2"]
        assert manager.costs.tiers["disk2"].prior[0] == manager.costs.tiers["disk"].prior[0] == PRIOR_GBPS["DISK"]
        assert PRIOR_GBPS["DISK"] != PRIOR_GBPS["REMOTE"]  # the fallback the second tier got before
    finally:
        manager.shutdown()


def test_a_new_disk_load_waits_for_the_loads_in_flight_not_for_the_disk_s_writes(tmp_path):
    """The disk tier's I/O pool runs reads before writes, so the decision's queue for the
    disk counts its loads in flight and not its pending writes; a tier whose reads and
    writes share one queue (``reads_first`` False, as the shared tier's) counts both."""
    from support.disk_fixtures import block_hash

    h = Hierarchy(tmp_path, None)
    try:
        m = h.manager
        blocks = [block_hash(i) for i in range(8)]
        h.store(blocks[:4])
        h.store(blocks[4:])  # the first four are now on disk only
        assert m.hit_medium(blocks[0]) == "DISK"
        writing = m.prepare_store([block_hash(i) for i in range(100, 104)])  # spills: pending disk writes
        assert writing is not None and h.disk.num_pending() > 0
        assert m.queued_blocks()["disk"] == 0
        m.prepare_load(blocks[:4])
        assert m.queued_blocks()["disk"] == 4  # the load's blocks, in flight
        h.disk.reads_first = False
        assert m.queued_blocks()["disk"] == 4 + h.disk.num_pending()
    finally:
        h.close()


def test_steps_of_one_size_fit_a_rate_not_an_overhead_that_swallows_them():
    """Chunked prefill times steps of nearly one size (their work differing only by
    attention): a fit of a fixed cost per step to those, with 2% timing noise, used to
    swallow each step in the fixed cost and leave a rate 100x too fast, so recomputing
    looked free and a disk twice as fast as recomputing was passed over."""
    import random

    rng = random.Random(1)
    rate, overhead, block_bytes = 30_800.0, 0.005, 2 << 20
    costs = LoadCosts(
        [TierCost("cpu", 50.0, ref_bytes=block_bytes), TierCost("disk", 8.0, ref_bytes=block_bytes)],
        bytes_per_block=block_bytes,
        tokens_per_block=16,
        prefill_tokens_per_s=rate,
        attention_per_token=0.0,
    )
    fitted, recomputed = [], 0
    for step in range(1000):
        work = rng.uniform(7900, 8400)
        costs.observe(PREFILL, round(work), (overhead + work / rate) * rng.gauss(1, 0.02))
        if step >= 100:
            fitted.append(costs.prefill_tokens_per_s)
            recomputed += costs.plan_runs([("disk", 64)]).blocks == 0  # the disk loads 2x faster
    assert recomputed == 0 and max(fitted) < 1.2 * rate and min(fitted) > 0.8 * rate


def test_a_probe_never_loads_a_slower_run_before_the_probed_tier():
    """Both tiers passed over and unsampled for long; the first (a slow shared tier) is
    too busy to be probed. The second is not probed through it: that meant loading the
    slow run first, 40x slower than recomputing, at every probe."""
    block_bytes, now = 2 << 20, [0.0]
    costs = LoadCosts(
        [TierCost(n, g, ref_bytes=block_bytes) for n, g in (("cpu", 50.0), ("remote", 0.1), ("disk", 2.0))],
        bytes_per_block=block_bytes,
        tokens_per_block=16,
        prefill_tokens_per_s=30_800,
        attention_per_token=0.0,
        clock=lambda: now[0],
    )
    busy = {"remote": 10 * costs.probe_queue_blocks, "disk": 0}
    costs.queues = Queues(0, busy, busy)
    now[0] = 10 * costs.probe_after_s
    assert costs.plan_runs([("remote", 100), ("disk", 50)]) == LoadPlan(0, {"remote": 100, "disk": 50})
    costs.queues = Queues(0, {})  # no longer busy: the first tier passed over is probed, one block of it
    assert costs.plan_runs([("remote", 100), ("disk", 50)]) == LoadPlan(1, {"remote": 99, "disk": 50}, "remote")


def test_a_tier_with_writes_queued_is_probed_once_stale_and_used_again_once_fast():
    """A write-through shared tier may always have uploads queued: a probe waits behind
    them (its request pays), so they hold probes back, but only until the tier's last
    sample is stale. A tier whose estimate collapsed (a hung server's failed loads) is
    then probed through them, and that one sample brings it back once it is fast."""
    from tiered_kv.cost import STALE_PROBES

    block_bytes, now = 2 << 20, [0.0]
    remote = TierCost("remote", 8.0, ref_bytes=block_bytes)
    costs = LoadCosts(
        [TierCost("cpu", 50.0, ref_bytes=block_bytes), remote],
        bytes_per_block=block_bytes,
        tokens_per_block=16,
        prefill_tokens_per_s=30_800,
        attention_per_token=0.0,
        clock=lambda: now[0],
    )
    assert costs.plan_runs([("remote", 8)]).blocks == 8
    for _ in range(3):  # the server hangs: three loads fail after 4 s each
        costs.observe("remote_to_gpu", 8 * block_bytes, 4.0, False)
    assert costs.plan_runs([("remote", 8)]).blocks == 0
    costs.queues = Queues(0, {"remote": 5}, {"remote": 0})  # uploads pending (past probe_queue_blocks), no load
    stale = STALE_PROBES * costs.probe_after_s
    probes = []
    for step in range(int(1.5 * stale / 0.05)):  # a decision every 50 ms
        now[0] = step * 0.05
        plan = costs.plan_runs([("remote", 8)])
        if plan.probe == "remote":  # the probe's block loads at the server's full speed again
            probes.append(now[0])
            costs.observe("remote_to_gpu", block_bytes, block_bytes / 8e9, True)
    assert probes and probes[0] >= stale, "a probe waited behind the uploads before the tier was stale"
    assert len(probes) == 1 and costs.plan_runs([("remote", 8)]).blocks == 8, "the tier is fast and still passed over"
