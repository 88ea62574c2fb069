"""The three-tier hierarchy end to end in one process: CPU evictions cascade to disk,
repeated prefixes come back from CPU or disk byte-exact, and the disk outlives a restart."""

from __future__ import annotations

import numpy as np
import pytest

from tiered_kv.sim.driver import DeviceKVCache, EngineDriver
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.sim.workloads import prefix_hashes

CPU_SLOTS = 16


def build(tmp_path, device, **config):
    layout = device.layout
    base = {
        "cpu_bytes": f"{CPU_SLOTS * layout.bytes_per_block}B",
        "disk_path": str(tmp_path),
        "model_id": "hierarchy-test",
        "cover_weights": False,
        # Every block found is loaded: what is tested here is where blocks go, not the
        # decision (tests/tiered/test_cost.py), which this CPU's measured loads would sway.
        "cost_aware": False,
    }
    spec = HierarchySpec({**base, **config}, layout.gpu_block_size, layout)
    return spec, EngineDriver.from_spec(spec, device)


def settle(driver, spec):
    """Finish jobs and let queued disk writes land, as time passing would."""
    driver.drain()
    for tier in spec.lower_tiers:
        tier.stager.drain()
    driver.manager.pending_writes()  # folds in the index commits


def close(driver, spec):
    driver.worker.shutdown()
    driver.manager.shutdown()
    spec.store.close()


def documents(num_docs: int, blocks_per_doc: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [prefix_hashes(rng.integers(0, 50_000, size=(blocks_per_doc, 16))) for _ in range(num_docs)]


@pytest.mark.parametrize("disk_io", ["thread", "process"])
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_working_set_5x_cpu_and_half_of_disk_hits_on_every_repeat(tmp_path, write_policy, disk_io):
    device = DeviceKVCache(num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu")
    working_set = 5 * CPU_SLOTS
    disk_bytes = f"{2 * working_set * 4096}B"  # the working set is half the disk tier
    spec, driver = build(tmp_path, device, disk_bytes=disk_bytes, write_policy=write_policy, disk_io=disk_io)
    assert spec.host.shared == (disk_io == "process")
    docs = documents(num_docs=working_set // 8, blocks_per_doc=8)
    assert sum(map(len, docs)) == working_set

    first = driver.run(docs)
    settle(driver, spec)
    assert first.mismatches == 0 and first.computed == working_set

    hits_before, device_before = first.offload_hits, first.device_hits
    driver.report.hits_by_medium.clear()
    second = driver.run(docs)  # the same (cumulative) report object
    assert second.mismatches == 0
    assert second.computed == working_set, "the second pass recomputed a block it had offloaded"
    served = (second.offload_hits - hits_before) + (second.device_hits - device_before)
    assert served == working_set
    assert second.hits_by_medium.get("DISK", 0) > 0  # most of it could only come from disk
    stats = spec.stats.tiers
    assert stats["cpu"]["evictions"] > 0 and stats["disk"]["checksum_failures"] == 0
    if write_policy == "write_back":  # spills are the only disk writes
        assert stats["disk"]["stores"] == stats["cpu"]["spills"] > 0
    close(driver, spec)


@pytest.mark.parametrize("disk_io", ["thread", "process"])
def test_disk_blocks_survive_a_restart_and_stale_cpu_state_does_not(tmp_path, disk_io):
    device = DeviceKVCache(num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu")
    docs = documents(num_docs=6, blocks_per_doc=8, seed=1)
    spec, driver = build(tmp_path, device, disk_bytes="4MiB", disk_io=disk_io)
    driver.run(docs)
    settle(driver, spec)
    close(driver, spec)

    device2 = DeviceKVCache(
        num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu"
    )
    spec2, driver2 = build(tmp_path, device2, disk_bytes="4MiB", disk_io=disk_io)
    report = driver2.run(docs)
    assert report.mismatches == 0
    assert report.computed == 0, "a restarted hierarchy recomputed blocks that were durable on disk"
    assert report.hits_by_medium.get("DISK", 0) > 0
    close(driver2, spec2)


def test_back_pressure_drops_disk_writes_instead_of_stalling(tmp_path):
    device = DeviceKVCache(num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu")
    spec, driver = build(tmp_path, device, disk_bytes="4MiB", max_pending_disk_writes=1)
    docs = documents(num_docs=4, blocks_per_doc=8, seed=2)
    report = driver.run(docs)
    assert report.mismatches == 0 and report.stores_rejected == 0
    assert spec.stats.tiers["disk"]["drops"] > 0
    close(driver, spec)


class WriteBackHierarchy:
    """The composite over a 3-slot CPU tier and an 8-slot disk tier (write_back), driven
    by hand: ``stored`` plays the workers, writing each spill with a real ``DiskStore``."""

    def __init__(self, tmp_path):
        from support.disk_fixtures import disk_bytes_for, fingerprint, small_layout
        from tiered_kv.cpu.manager import CPUOffloadingManager
        from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
        from tiered_kv.disk.store.store import DiskStore
        from tiered_kv.tiered.manager import TieredOffloadingManager

        self.layout = layout = small_layout()
        fp, nbytes = fingerprint(layout), disk_bytes_for(layout, 8)
        self.disk = DiskOffloadingManager(tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e", poll_interval=None)
        self.store = DiskStore.open(tmp_path, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e")
        self.manager = TieredOffloadingManager(CPUOffloadingManager(3, 16), self.disk, write_policy="write_back")

    def stored(self, hashes, success=True):
        from support.disk_fixtures import content_rows

        m, store = self.manager, self.store
        out = m.prepare_store(hashes)
        m.complete_store(out.block_hashes_to_store, success=success)
        spills = out.store_spec.spills
        if len(spills):  # the worker writes them; the index commit makes them durable
            assert all(
                store.write_blocks(
                    0,
                    spills.block_hashes,
                    spills.tier_slots.tolist(),
                    content_rows(spills.block_hashes, 0, self.layout, store.slot_size),
                )
            )
        m.pending_writes()  # folds in the commits
        return out

    def close(self):
        self.store.close()
        self.manager.shutdown()


@pytest.fixture
def write_back(tmp_path):
    h = WriteBackHierarchy(tmp_path)
    yield h
    h.close()


@pytest.mark.parametrize("disk_still_has_it", [True, False])
def test_write_back_spills_a_promoted_block_only_if_the_disk_lost_it(write_back, disk_still_has_it):
    """With write_back the composite skips the disk lookup for CPU victims that never came
    from disk. A promoted block did: evicted from CPU while still on disk it is simply
    dropped there (stored once, no slot leaked); once the disk has lost it, it is spilled."""
    from support.disk_fixtures import block_hash

    h = write_back
    m, disk, stored = h.manager, h.disk, h.stored
    A, B, C, D, E, F = (block_hash(i) for i in range(6))
    for block in (A, B, C):  # one by one: A ends least recent
        stored([block])
    assert stored([D]).store_spec.spills.block_hashes == [A]
    assert stored([E], success=False).store_spec.spills.block_hashes == [B]  # E's slot is free again
    spec = m.prepare_load([A])  # from disk, promoted into the free slot
    assert spec.promote_slots.tolist() != [-1]
    m.complete_load([A])
    assert m.hit_medium(A) == "CPU" and disk.is_loadable(A)
    if not disk_still_has_it:
        assert disk.remove(A)
    m.touch([C, D])  # A is now the least recent CPU block
    free_before = disk.num_free_slots()
    out = stored([F])
    assert m.cpu.slot_of(A) is None
    if disk_still_has_it:
        assert len(out.store_spec.spills) == 0 and out.block_hashes_evicted == []
        assert disk.is_loadable(A) and disk.num_free_slots() == free_before
    else:
        assert out.store_spec.spills.block_hashes == [A] and out.block_hashes_evicted == []
        assert disk.is_loadable(A) and disk.num_free_slots() == free_before - 1
    assert m.lookup([A]) == 1


def test_lookup_counts_the_blocks_it_asks_each_tier_about(write_back):
    from support.disk_fixtures import block_hash

    h = write_back
    m = h.manager
    A, B, C, D, E = (block_hash(i) for i in range(5))
    for block in (A, B, C, D):  # D evicts A, which spills to disk
        h.stored([block])
    assert m.hit_medium(A) == "DISK" and m.hit_medium(B) == "CPU"
    tiers = m.stats.tiers
    assert m.lookup([B, A, E, C]) == 2  # B in CPU, A on disk, E nowhere: the run stops
    assert (tiers["cpu"]["lookups"], tiers["disk"]["lookups"]) == (3, 2)
    assert m.lookup([B, C, D]) == 3  # all in CPU: the disk tier is not asked
    assert (tiers["cpu"]["lookups"], tiers["disk"]["lookups"]) == (6, 2)


def test_corrupt_disk_blocks_and_failed_loads_are_counted_per_tier(write_back):
    from support.disk_fixtures import block_hash, flip_byte
    from tiered_kv.disk.store.io_backends import aligned_empty

    h = write_back
    m, store = h.manager, h.store
    A, B, C, D = (block_hash(i) for i in range(4))
    for block in (A, B, C, D):  # A spills to disk
        h.stored([block])
    slot = store.entry(A).slot
    flip_byte(store.namespace.slab_path(0), slot * store.slot_size + 7)
    spec = m.prepare_load([A])
    rows = aligned_empty(store.slot_size).view(1, store.slot_size)
    assert store.read_blocks(0, [A], spec.tier_slots.tolist(), rows) == [False]  # the worker's read
    m.complete_load([A], success=False)
    assert m.stats.tiers["disk"]["checksum_failures"] == 1
    assert (m.stats.tiers["disk"]["failed_loads"], m.stats.tiers["cpu"]["failed_loads"]) == (1, 0)
    m.prepare_load([B, C])  # a CPU load whose job fails: no disk block was involved
    m.complete_load([B, C], success=False)
    assert (m.stats.tiers["disk"]["failed_loads"], m.stats.tiers["cpu"]["failed_loads"]) == (1, 2)
    assert m.hit_medium(A) is None and m.lookup([A]) == 0
    m.tier("disk").refresh()  # the record is not counted twice
    assert m.stats.tiers["disk"]["checksum_failures"] == 1 == m.tier("disk").stats.checksum_failures


def test_an_engine_built_in_with_blocks_releases_the_cache_even_when_the_block_raises(tmp_path):
    device = DeviceKVCache(num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu")
    layout = device.layout
    config = {
        "cpu_bytes": f"{CPU_SLOTS * layout.bytes_per_block}B",
        "disk_path": str(tmp_path),
        "disk_bytes": "4MiB",
        "cost_aware": False,
        "cover_weights": False,
    }
    docs = documents(num_docs=2, blocks_per_doc=8, seed=4)
    with pytest.raises(RuntimeError, match="the engine failed"):
        with HierarchySpec(config, layout.gpu_block_size, layout) as spec:
            with spec.build_worker(device.kv_caches, device.kv_before_num_blocks) as worker:
                with spec.get_manager() as manager:
                    assert EngineDriver(manager, worker, device).run(docs).mismatches == 0
                    raise RuntimeError("the engine failed")
    assert spec.store is None  # the spec closed its disk store
    # Every block the failed engine stored was made durable before it closed.
    with HierarchySpec(config, layout.gpu_block_size, layout) as spec:
        with spec.build_worker(device.kv_caches, device.kv_before_num_blocks) as worker:
            with spec.get_manager() as manager:
                assert EngineDriver(manager, worker, device).run(docs).computed == 0


def test_two_disk_tiers_each_with_its_own_io_backend_and_checksum(tmp_path):
    """Each disk tier has its own settings: the shorthands are the first tier's and the
    default of a second that sets none of its own, and a second tier's own keys win."""
    device = DeviceKVCache(num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu")
    second = {"type": "disk", "name": "slow", "path": str(tmp_path / "slow"), "bytes": "4MiB", "checksum": "crc32c"}
    spec, driver = build(tmp_path / "fast", device, disk_bytes="4MiB", io_backend="posix", io_threads=2, tiers=[second])
    try:
        fast, slow = spec.lower_tiers
        assert (fast.settings.checksum, slow.settings.checksum) == ("xxh3_64", "crc32c")
        assert (fast.settings.io_threads, slow.settings.io_threads) == (2, 2)  # the shorthand's default
        assert fast.store.checksum_name == "xxh3_64" and slow.store.checksum_name == "crc32c"
        docs = documents(num_docs=6, blocks_per_doc=8, seed=3)
        report = driver.run(docs + docs)  # 48 blocks, 16 CPU slots: the repeat loads from disk
        settle(driver, spec)
        assert report.mismatches == 0 and report.hits_by_medium.get("DISK", 0) > 0, report
    finally:
        driver.worker.shutdown()
        driver.manager.shutdown()
        for tier in spec.lower_tiers:
            tier.close()


def test_a_disk_block_found_corrupt_between_lookup_and_load_fails_one_load_not_the_engine(tmp_path):
    """The flusher may drop a block a worker found corrupt at any moment, also between the
    lookup that counted it and the load: that load fails and its request is recomputed;
    the engine goes on (it used to raise in ``prepare_load``)."""
    device = DeviceKVCache(num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16, device="cpu")
    docs = documents(num_docs=6, blocks_per_doc=8, seed=2)  # 3x the CPU tier: the first ones end on disk only
    spec, driver = build(tmp_path, device, disk_bytes="4MiB")
    driver.run(docs)
    settle(driver, spec)
    disk, store = driver.manager.tier("disk"), spec.store
    victim = docs[0][3]
    assert driver.manager.hit_medium(victim) == "DISK"
    lookup = driver.manager.lookup

    def lookup_then_corrupt(block_hashes):  # the fault: a worker's corrupt record, read right after lookup
        n = lookup(block_hashes)
        if victim in block_hashes[:n]:
            store.index.drop_corrupt(0, [(victim, disk.slot_of(victim))])
            disk.refresh()
        return n

    driver.manager.lookup = lookup_then_corrupt
    before = driver.report.recomputed_after_failed_load
    report = driver.run([docs[0]])
    assert report.recomputed_after_failed_load > before and report.mismatches == 0
    driver.manager.lookup = lookup
    again = driver.run(docs[:2])  # the engine goes on, and recomputes what it lost
    assert again.mismatches == 0 and driver.manager.hit_medium(victim) is not None
    close(driver, spec)


def test_staging_memory_that_cannot_be_had_drops_the_spills_and_frees_their_disk_slots(tmp_path, monkeypatch):
    """A spill's staging buffer could not be mapped (memfd, mmap or pinning refused): the
    writes are dropped and logged failed, so the disk tier frees their slots; nothing
    waits for them forever (they would count against max_pending_disk_writes) and the
    staging budget is whole again."""
    from tiered_kv.testing.harness import Hierarchy

    with Hierarchy(str(tmp_path / "c"), cpu_blocks=4, disk_blocks=40, write_policy="write_back") as h:
        stager, real = h.stager, h.stager.store.host_buffer
        refused = []

        def host_buffer(nbytes, pin=False):  # the fault: the first mapping is refused
            if not refused:
                refused.append(nbytes)
                raise RuntimeError("cannot map shared host memory: Too many open files")
            return real(nbytes, pin)

        monkeypatch.setattr(stager.store, "host_buffer", host_buffer)
        h.run([[f"r{r}b{i}".encode() for i in range(4)] for r in range(4)])  # each request spills the last
        h.settle()
        h.disk.refresh()
        assert refused and h.manager.pending_writes() == 0
        assert stager._allocated_rows == sum(b.shape[0] for b in stager._cached)
        assert h.manager.stats.tiers["disk"]["drops"] == 4
