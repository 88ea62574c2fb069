"""The engine driver end to end over the real CPU tier: byte-exact loads, accounting,
and faults (corrupted host memory, failing handlers) counted rather than raised."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.cpu.spec import CPUOffloadingSpec
from tiered_kv.sim.driver import DeviceKVCache, EngineDriver, ServiceClock, block_content
from tiered_kv.memory.host_memory import HostKVCache
from tiered_kv.mediums import CPU, CPULoadStoreSpec, GPULoadStoreSpec
from tiered_kv.cpu.handlers import CpuGpuOffloadingHandlers
from tiered_kv.worker.worker import OffloadingWorker
from tiered_kv.sim.workloads import ChatWorkloadSpec, chat_workload, default_workload, shared_prefix_workload


def small_device(kv_first=True, factor=1, groups=32):
    return DeviceKVCache(
        num_layers=3,
        num_gpu_blocks=groups * factor,
        gpu_block_size=4,
        num_kv_heads=2,
        head_dim=8,
        kv_before_num_blocks=kv_first,
        block_size_factor=factor,
        device="cpu",
    )


def driver_for(dev, cpu_blocks):
    spec = CPUOffloadingSpec(
        {"cpu_bytes": f"{cpu_blocks * dev.layout.bytes_per_block}B", "block_size": dev.layout.offloaded_block_size},
        gpu_block_size=4,
    )
    return EngineDriver.from_spec(spec, dev), spec


def check_accounting(r):
    assert r.blocks_requested == r.device_hits + r.offload_hits + r.computed
    assert r.blocks_looked_up == r.blocks_requested - r.device_hits


def test_block_content_is_deterministic_and_distinct():
    a = block_content([b"x", b"y"], 1000)
    assert a.shape == (2, 1000) and a.dtype == torch.uint8
    assert torch.equal(a, block_content([b"x", b"y"], 1000))
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a[0, :500], a[0, 500:]), "positions (layers) differ within a block"


@pytest.mark.parametrize("kv_first", [True, False], ids=["kv-first", "kv-after"])
@pytest.mark.parametrize("factor", [1, 2])
def test_run_is_byte_exact_with_hits_and_evictions(kv_first, factor):
    dev = small_device(kv_first, factor)
    driver, spec = driver_for(dev, cpu_blocks=60)
    workload = chat_workload(ChatWorkloadSpec(num_requests=120, system_prompt_blocks=4, seed=3))
    r = driver.run(workload)
    assert r.requests == 120 and r.mismatches == 0 and r.failed_jobs == 0
    assert r.offload_hits > 0 and r.hits_by_medium == {CPU: r.offload_hits}
    assert r.events["CPU removed"] > 0, "the working set exceeds the CPU tier"
    assert r.events["CPU stored"] == r.blocks_stored
    check_accounting(r)
    bpb = dev.layout.bytes_per_block
    load, store = r.transfers["CPU->GPU"], r.transfers["GPU->CPU"]
    assert load.blocks == r.offload_hits and load.bytes == load.blocks * bpb
    assert store.blocks == r.blocks_stored and store.bytes == store.blocks * bpb
    assert load.seconds > 0 and store.gbps > 0
    assert not driver._jobs, "run() drains outstanding stores"
    pool = driver._pool
    assert not pool.busy and not pool.orphans
    assert sorted([*pool.cached.values(), *pool.free]) == list(range(pool.num_groups))


def test_verification_catches_corrupted_host_memory():
    dev = small_device()
    driver, spec = driver_for(dev, cpu_blocks=200)
    workload = shared_prefix_workload(40, num_prefixes=3, prefix_blocks=4, suffix_blocks=(1, 2), seed=1)
    driver.run(workload.requests[:20])
    assert driver.report.mismatches == 0
    spec.host.slot_rows.view(-1)[::997] ^= 1  # a bit flip in every CPU slot
    # Evict the device copies so the next requests must load from the CPU tier.
    for i in range(30):
        driver.run_request([bytes([i]) * 16])
    driver.run(workload.requests[20:])
    assert driver.report.mismatches > 0


class FailingLoads(CpuGpuOffloadingHandlers):
    """Fault injection: every CPU->GPU copy raises inside the real handler."""

    def __init__(self, *args):
        super().__init__(*args)

        def broken(*_):
            raise RuntimeError("injected load failure")

        self.cpu_to_gpu_handler._copy = broken


def test_failed_loads_are_recomputed_not_raised():
    dev = small_device()
    host = HostKVCache(dev.layout, 100)
    handlers = FailingLoads(dev.kv_caches, host)
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler)
    manager = CPUOffloadingManager(100, dev.layout.offloaded_block_size)
    driver = EngineDriver(manager, worker, dev)  # generic: any manager + worker
    r = driver.run(default_workload(80, seed=2))
    assert r.recomputed_after_failed_load > 0 and r.offload_hits == 0
    assert r.transfers["CPU->GPU"].failed_jobs == r.transfers["CPU->GPU"].jobs == r.failed_jobs
    assert r.mismatches == 0
    check_accounting(r)
    # Loads were released: nothing stays pinned in the manager.
    assert manager.num_evictable() == len(manager)


def test_failed_stores_free_their_slots():
    dev = small_device()
    driver, spec = driver_for(dev, cpu_blocks=100)
    store_handler = driver.worker.transfer_type_to_handler[("GPU", "CPU")]

    def broken(*_):
        raise RuntimeError("injected store failure")

    store_handler._copy = broken
    r = driver.run(default_workload(30, seed=4))
    assert r.blocks_stored == 0 and r.offload_hits == 0
    assert r.transfers["GPU->CPU"].failed_jobs == r.transfers["GPU->CPU"].jobs > 0
    assert driver.manager.num_free_slots() == 100
    assert "CPU stored" not in r.events


def test_full_tier_rejects_stores_and_keeps_going():
    dev = small_device(groups=40)
    driver, spec = driver_for(dev, cpu_blocks=2)
    r = driver.run([[bytes([i, j]) for j in range(5)] for i in range(4)])
    assert r.stores_rejected == 4 and r.blocks_stored == 0 and r.mismatches == 0


def test_request_longer_than_device_cache_is_a_clear_error():
    dev = small_device(groups=4)
    driver, _ = driver_for(dev, cpu_blocks=10)
    with pytest.raises(ValueError, match="needs 5 device blocks"):
        driver.run_request([bytes([i]) for i in range(5)])


def test_device_prefix_cache_frees_replaced_groups():
    from tiered_kv.sim.driver import _DevicePrefixCache

    pool = _DevicePrefixCache(3)
    (a, b) = pool.allocate(2)
    pool.insert([b"A", b"B"], [a, b])
    pool.hold([b])  # e.g. B's store is in flight
    (c,) = pool.allocate(1)
    pool.insert([b"B"], [c])  # B recomputed into a new group
    assert pool.cached[b"B"] == c and b not in pool.free
    pool.release([b])
    assert b in pool.free and not pool.orphans
    pool.insert([b"A"], pool.allocate(1))
    assert a in pool.free, "an idle replaced group is freed at once"
    assert sorted([*pool.cached.values(), *pool.free]) == [0, 1, 2]


def test_device_prefix_cache_waits_for_a_store_rather_than_evicting_past_it():
    from tiered_kv.sim.driver import _DevicePrefixCache

    pool = _DevicePrefixCache(2)
    (a, b) = pool.allocate(2)
    pool.insert([b"A", b"B"], [a, b])
    pool.hold([a])  # A, the least recent, has a store in flight
    assert pool.allocate(1) is None and list(pool.cached) == [b"A", b"B"], "B was evicted in A's place"
    assert pool.allocate(1, own={a}) == [b], "the running request's own group is skipped, not waited for"
    assert list(pool.cached) == [b"A"]


def test_workload_generators_share_prefixes_and_are_reproducible():
    w = default_workload(200, seed=5)
    assert w.requests == default_workload(200, seed=5).requests
    assert w.requests != default_workload(200, seed=6).requests
    assert len(w.requests) == 200 and w.num_unique_blocks < w.num_blocks / 2
    firsts = {r[0] for r in w.requests}
    assert len(firsts) <= 4, "every chat starts with one of the system prompts"
    rag = shared_prefix_workload(50, num_prefixes=5, prefix_blocks=3, suffix_blocks=(0, 2), seed=0)
    assert all(3 <= len(r) <= 5 for r in rag.requests)
    with pytest.raises(ValueError, match="turn_blocks"):
        ChatWorkloadSpec(turn_blocks=(3, 1))


def test_a_service_clock_moves_by_each_requests_prefill_time():
    dev = small_device()
    clock = ServiceClock(tokens_per_s=100.0)
    driver = EngineDriver(driver_for(dev, cpu_blocks=60)[0].manager, driver_for(dev, 60)[0].worker, dev, clock)
    workload = chat_workload(ChatWorkloadSpec(num_requests=20, system_prompt_blocks=4, seed=1))
    seen = []
    for request in workload.requests:
        seen.append(clock())
        driver.run_request(request)
    tokens = [len(r) * dev.layout.offloaded_block_size for r in workload.requests]
    # Each request's uses happen at the clock's time, then it moves on by that request.
    assert seen == pytest.approx([sum(tokens[:i]) / 100.0 for i in range(20)])
    assert clock() == pytest.approx(sum(tokens) / 100.0)
    with pytest.raises(ValueError, match="tokens_per_s: expected > 0, got 0"):
        ServiceClock(0)


def test_session_retention_times_gaps_on_the_replays_clock():
    from tiered_kv.tiered.spec import HierarchySpec

    dev = small_device(groups=40)
    workload = chat_workload(ChatWorkloadSpec(num_requests=150, system_prompt_blocks=4, seed=7))
    # 4-token blocks at 20 tokens/s: a turn's gap is seconds of modelled time, though the
    # whole run takes well under a second of this machine's (where no session would return).
    clock = ServiceClock(tokens_per_s=20.0)
    config = {"cpu_bytes": f"{48 * dev.layout.bytes_per_block}B", "cpu_retention": "session"}
    spec = HierarchySpec(config, 4, dev.layout, clock=clock)
    driver = EngineDriver.from_spec(spec, dev, clock)
    retention = driver.manager.cpu.retention
    assert retention is not None and retention.clock is clock
    report = driver.run(workload)
    driver.manager.shutdown()
    assert report.mismatches == 0
    assert retention.counts["returns"] > 0 and retention.counts["held"] > 0, "sessions came back"
    assert retention.ttl_s is not None and retention.ttl_s > 1.0, "gaps of modelled seconds"
