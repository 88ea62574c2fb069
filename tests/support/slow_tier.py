"""The scenario each real lower tier is tested with under vLLM (tests/integrations:
test_vllm_cost.py for the disk, test_vllm_remote.py for the shared tier): a tier
that gets slower than recomputing is passed over, and used again once it recovers."""

from __future__ import annotations

from collections.abc import Callable

from support import vllm_harness as vh


def passed_over_while_slow_and_used_again(
    h: vh.VllmHarness,
    tier: str,
    serve: Callable[[vh.VllmHarness, list[int]], vh.PrefixHit],
    prompt: Callable[[int], list[int]],
    slow_down: Callable[[bool], None],
    block: int,
    loads_fail: bool = False,
) -> None:
    """Three documents of two chunks each, served from lower tier ``tier`` only (a new
    prompt of two chunks fills the CPU tier before each): all loaded while the tier is
    fast; passed over (but for a probe) once ``slow_down(True)`` has been measured; all
    loaded again once ``slow_down(False)``'s speed has been probed back. ``serve``
    serves a prompt from a cold GPU cache and waits until the tier holds its chunks;
    ``prompt(seed)`` is a prompt of two chunks and a token. ``loads_fail``: the slow
    tier's loads fail (a stall that times out) rather than finish late."""
    costs = h.manager.costs
    assert costs is not None and costs.enabled
    costs.probe_every = 3
    estimate = costs.tiers[tier]
    docs = [prompt(seed) for seed in range(3)]
    for doc in docs:
        serve(h, doc)
    tiers = h.manager.composite.stats.tiers
    fillers = iter(range(1000, 2000))

    def tier_pass() -> tuple[int, int, list[int]]:
        """Each document once: tier hits, chunks passed over, tokens loaded per document."""
        hits, skipped = tiers[tier]["hits"], tiers[tier]["skipped_slower_than_recompute"]
        loaded = []
        for doc in docs:
            serve(h, prompt(next(fillers)))
            loaded.append(serve(h, doc).external)
        return tiers[tier]["hits"] - hits, tiers[tier]["skipped_slower_than_recompute"] - skipped, loaded

    hits, skipped, loaded = tier_pass()
    assert hits == 6 and skipped == 0 and loaded == [2 * block] * 3, f"a fast {tier} tier is used"
    assert estimate.samples > 0, "the worker's load times reached the scheduler's estimate"

    slow_down(True)
    tier_pass()  # the slow loads are measured
    assert estimate.seconds(costs.bytes_per_block) > block / costs.prefill_tokens_per_s
    hits, skipped, loaded = tier_pass()
    assert skipped > 0 and loaded.count(0) >= 2, f"a {tier} tier slower than recomputing is passed over"
    assert hits <= 2, "only a probe still reads it"

    slow_down(False)
    costs.probe_every = 1  # every decision that passes the tier over samples it
    for _ in range(10):  # until the probes' samples outweigh the slow ones
        hits, skipped, loaded = tier_pass()
        if skipped == 0:
            break
    assert hits == 6 and skipped == 0 and loaded == [2 * block] * 3, f"a recovered {tier} tier is used again"
    failed = h.worker_spec._worker.stats.tiers["cpu"]["failed_loads"]  # counted where the loads ran
    assert (failed > 0) == loads_fail, failed
