"""The CPU tier's LRU manager: seed API semantics, ref-counts, eviction, events, and
the extension API the composite manager uses."""

from __future__ import annotations

import random

import pytest

from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.mediums import CPU, CPULoadStoreSpec


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def hs(*ids: int) -> list[bytes]:
    return [h(i) for i in ids]


def stored(mgr: CPUOffloadingManager, *ids: int) -> None:
    out = mgr.prepare_store(hs(*ids))
    assert out is not None
    mgr.complete_store(hs(*ids))


def snapshot(mgr: CPUOffloadingManager):
    return (
        [(k, mgr.slot_of(k), mgr._readers.get(k, 0), k not in mgr._pending) for k in mgr.iter_lru()],
        sorted(mgr._free),
        mgr.num_evictable(),
    )


def test_store_then_lookup_and_events():
    mgr = CPUOffloadingManager(num_slots=4, block_size=16)
    out = mgr.prepare_store(hs(1, 2, 3))
    assert out.block_hashes_to_store == hs(1, 2, 3)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1, 2]
    assert out.block_hashes_evicted == []
    assert mgr.lookup(hs(1, 2, 3)) == 0, "pending blocks are not loadable"
    assert mgr.take_events() == []
    mgr.complete_store(hs(1, 2, 3))
    assert mgr.lookup(hs(1, 2, 3, 4)) == 3
    assert mgr.lookup(hs(2, 9, 3)) == 1, "only the leading run counts"
    (event,) = mgr.take_events()
    assert (event.block_hashes, event.block_size, event.medium, event.removed) == (hs(1, 2, 3), 16, CPU, False)
    assert mgr.take_events() == []
    # Already offloaded blocks are not stored again.
    out = mgr.prepare_store(hs(2, 3, 4))
    assert out.block_hashes_to_store == hs(4)
    assert len(out.store_spec) == 1


def test_prepare_load_returns_slots_in_order_and_rejects_unloadable():
    mgr = CPUOffloadingManager(4, 16)
    out = mgr.prepare_store(hs(1, 2, 3))
    slots = dict(zip(out.block_hashes_to_store, out.store_spec.block_ids.tolist()))
    mgr.complete_store(hs(1, 2))
    spec = mgr.prepare_load(hs(2, 1))
    assert spec.block_ids.tolist() == [slots[h(2)], slots[h(1)]]
    before = snapshot(mgr)
    with pytest.raises(KeyError, match=h(3).hex()):
        mgr.prepare_load(hs(1, 3))  # 3 is still pending
    with pytest.raises(KeyError):
        mgr.prepare_load(hs(7))
    assert snapshot(mgr) == before, "a rejected prepare_load pins nothing"


def test_lru_eviction_follows_touch_order():
    mgr = CPUOffloadingManager(4, 16, enable_events=True)
    stored(mgr, 1, 2, 3, 4)
    mgr.take_events()
    # One store's blocks go in head-most-recent: 4, 3, 2, 1 (old -> new). Touching
    # makes the first touched the most recent: 4, 3, 1, 2.
    mgr.touch(hs(2, 1))
    mgr.touch(hs(99))  # unknown: ignored
    out = mgr.prepare_store(hs(5, 6))
    assert out.block_hashes_evicted == hs(4, 3)
    assert mgr.lookup(hs(1)) == 1 and mgr.lookup(hs(2)) == 1
    assert mgr.lookup(hs(3)) == 0 and mgr.lookup(hs(4)) == 0
    (removed,) = mgr.take_events()
    assert removed.removed and removed.medium == CPU and removed.block_hashes == hs(4, 3)
    # The evicted slots are the ones handed to the new blocks.
    assert sorted(out.store_spec.block_ids.tolist()) == sorted(
        [s for s in range(4) if s not in (mgr.slot_of(h(1)), mgr.slot_of(h(2)))]
    )


def test_pinned_and_pending_blocks_are_never_evicted():
    mgr = CPUOffloadingManager(4, 16)
    stored(mgr, 1, 2, 3)
    mgr.prepare_load(hs(1))  # pinned by a load
    mgr.prepare_load(hs(1))  # twice
    assert mgr.prepare_store(hs(4)) is not None  # 4 takes the free slot, stays pending
    out = mgr.prepare_store(hs(5, 6))  # only 2 and 3 are evictable (3 older: stored tail-first)
    assert out.block_hashes_evicted == hs(3, 2)
    assert mgr.is_loadable(h(1)) and h(4) in mgr
    # Now everything is pinned or pending: nothing can be evicted.
    before = snapshot(mgr)
    assert mgr.prepare_store(hs(7)) is None
    assert snapshot(mgr) == before, "prepare_store -> None changes nothing"
    mgr.complete_load(hs(1))
    assert mgr.prepare_store(hs(7)) is None, "still one reader left"
    mgr.complete_load(hs(1))
    out = mgr.prepare_store(hs(7))
    assert out.block_hashes_evicted == hs(1)


def test_evict_takes_lru_evictable_blocks_and_frees_their_slots():
    mgr = CPUOffloadingManager(5, 16)
    for i in (1, 2, 3, 4):
        stored(mgr, i)  # LRU order 1, 2, 3, 4
    mgr.take_events()
    slot_of = {i: mgr.slot_of(h(i)) for i in (1, 2, 3, 4)}
    victims, slots = mgr.evict(2)  # nothing pinned or pending: straight from the LRU end
    assert victims == hs(1, 2) and slots == [slot_of[1], slot_of[2]]
    assert mgr.num_free_slots() == 3 and h(1) not in mgr and h(2) not in mgr
    (event,) = mgr.take_events()
    assert event.removed and event.block_hashes == hs(1, 2)
    mgr.prepare_load(hs(3))  # pinned
    assert mgr.prepare_store(hs(5)) is not None  # pending
    before = snapshot(mgr)
    assert mgr.evict(2) is None, "only block 4 is evictable"
    assert snapshot(mgr) == before, "evict -> None changes nothing"
    assert mgr.evict(1) == (hs(4), [slot_of[4]])
    assert mgr.num_evictable() == 0


def test_prepare_store_none_when_request_exceeds_evictable():
    mgr = CPUOffloadingManager(3, 16)
    stored(mgr, 1, 2)
    before = snapshot(mgr)
    assert mgr.prepare_store(hs(3, 4, 5, 6)) is None  # 4 new > 3 slots
    assert snapshot(mgr) == before
    assert mgr.take_events()[-1].removed is False  # only the earlier stored event
    out = mgr.prepare_store(hs(3, 4, 5))
    assert out.block_hashes_evicted == hs(2, 1)  # one store's tail is older than its head


def test_complete_store_failure_frees_only_pending_blocks():
    mgr = CPUOffloadingManager(4, 16)
    stored(mgr, 1)
    mgr.take_events()
    mgr.prepare_store(hs(2, 3))
    assert mgr.num_free_slots() == 1
    mgr.complete_store(hs(1, 2, 3), success=False)  # 1 was already stored: untouched
    assert mgr.num_free_slots() == 3
    assert h(2) not in mgr and h(3) not in mgr
    assert mgr.lookup(hs(1)) == 1
    assert mgr.take_events() == [], "blocks never loadable are not reported removed"
    out = mgr.prepare_store(hs(2, 3, 4))
    assert out.block_hashes_to_store == hs(2, 3, 4) and out.block_hashes_evicted == []


def test_duplicates_in_one_store_take_one_slot():
    mgr = CPUOffloadingManager(4, 16)
    out = mgr.prepare_store(hs(1, 1, 2))
    assert out.block_hashes_to_store == hs(1, 2)
    assert mgr.num_free_slots() == 2


def test_unpin_misuse_raises_and_rolls_back():
    mgr = CPUOffloadingManager(4, 16)
    stored(mgr, 1, 2)
    mgr.pin(hs(1, 2))
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="not pinned"):
        mgr.unpin(hs(1, 2, 2))
    assert snapshot(mgr) == before
    with pytest.raises(ValueError):
        mgr.complete_load(hs(9))
    mgr.unpin(hs(1, 2))
    assert mgr.num_evictable() == 2


def test_events_can_be_disabled():
    mgr = CPUOffloadingManager(1, 16, enable_events=False)
    stored(mgr, 1)
    stored(mgr, 2)
    assert mgr.take_events() == []


def test_extension_api_for_the_composite():
    mgr = CPUOffloadingManager(5, 16)
    assert mgr.num_slots == 5 and mgr.num_free_slots() == 5
    stored(mgr, 1, 2, 3, 4)
    mgr.take_events()
    mgr.touch(hs(1))
    mgr.pin(hs(3))
    assert list(mgr.iter_evictable()) == hs(4, 2, 1)  # stored tail-first; 1 touched; 3 pinned
    slot = mgr.slot_of(h(2))
    assert mgr.remove(h(2)) == slot
    assert h(2) not in mgr and mgr.slot_of(h(2)) is None and mgr.num_free_slots() == 2
    (event,) = mgr.take_events()
    assert event.removed and event.block_hashes == hs(2)
    with pytest.raises(ValueError, match="pinned"):
        mgr.remove(h(3))
    with pytest.raises(KeyError):
        mgr.remove(h(2))
    evicted: list[bytes] = []
    slots = mgr.allocate(hs(10, 11, 12), evicted)
    assert len(set(slots)) == 3 and evicted == hs(4)  # 2 free + LRU 4 (3 pinned, 1 touched)
    assert h(10) in mgr and not mgr.is_loadable(h(10))
    with pytest.raises(ValueError, match="already"):
        mgr.allocate(hs(10))
    with pytest.raises(ValueError, match="duplicates"):
        mgr.allocate(hs(20, 20))
    assert mgr.allocate(hs(20, 21)) is None  # only block 1 is evictable
    mgr.unpin(hs(3))
    assert mgr.allocate(hs(20, 21), None) is not None
    assert mgr.lookup(hs(1)) == 0 and mgr.lookup(hs(3)) == 0


class ReferenceLRU:
    """A deliberately naive model of the manager's contract."""

    def __init__(self, n):
        self.n = n
        self.order: list[bytes] = []  # least recent first
        self.ref: dict[bytes, int] = {}
        self.ready: dict[bytes, bool] = {}

    def evictable(self):
        return [k for k in self.order if self.ready[k] and self.ref[k] == 0]

    def prepare_store(self, keys):
        new = []
        for k in keys:
            if k not in self.ready and k not in new:
                new.append(k)
        need = len(new) - (self.n - len(self.order))
        ev = [k for k in self.evictable() if k not in keys]  # never the call's own blocks
        if need > len(ev):
            return None
        victims = ev[: max(need, 0)]
        for k in victims:
            self.order.remove(k)
            del self.ref[k], self.ready[k]
        for k in reversed(new):
            self.order.append(k)
            self.ref[k], self.ready[k] = 0, False
        if len(new) < len(dict.fromkeys(keys)):  # the whole request ranks most recent, head first
            for k in reversed(list(dict.fromkeys(keys))):
                self.order.remove(k)
                self.order.append(k)
        return new, victims


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_match_reference_model(seed):
    rnd = random.Random(seed)
    mgr, ref = CPUOffloadingManager(12, 16), ReferenceLRU(12)
    pending: list[list[bytes]] = []
    loads: list[list[bytes]] = []
    for _ in range(400):
        op = rnd.random()
        keys = hs(*rnd.sample(range(30), rnd.randint(1, 5)))
        if op < 0.35:
            got = mgr.prepare_store(keys)
            want = ref.prepare_store(keys)
            if want is None:
                assert got is None
            else:
                assert (got.block_hashes_to_store, got.block_hashes_evicted) == want
                pending.append(got.block_hashes_to_store)
        elif op < 0.55 and pending:
            batch = pending.pop(rnd.randrange(len(pending)))
            ok = rnd.random() < 0.8
            mgr.complete_store(batch, success=ok)
            for k in batch:
                if ok:
                    ref.ready[k] = True
                else:
                    ref.order.remove(k)
                    del ref.ref[k], ref.ready[k]
        elif op < 0.7:
            n = mgr.lookup(keys)
            want = 0
            while want < len(keys) and ref.ready.get(keys[want]):
                want += 1
            assert n == want
            if n:
                mgr.prepare_load(keys[:n])
                for k in keys[:n]:
                    ref.ref[k] += 1
                loads.append(keys[:n])
        elif op < 0.85 and loads:
            batch = loads.pop(rnd.randrange(len(loads)))
            mgr.complete_load(batch)
            for k in batch:
                ref.ref[k] -= 1
        elif op < 0.9 and ref.evictable():
            k = rnd.choice(ref.evictable())
            slot = mgr.slot_of(k)
            assert mgr.remove(k) == slot and slot in mgr._free
            ref.order.remove(k)
            del ref.ref[k], ref.ready[k]
        else:
            mgr.touch(keys)
            for k in reversed(keys):  # the first touched ends most recent
                if k in ref.ready:
                    ref.order.remove(k)
                    ref.order.append(k)
        # Invariants: slots are a partition of the pool; recency and counts agree.
        slots = [mgr.slot_of(k) for k in ref.order]
        assert len(set(slots)) == len(slots)
        assert set(slots).isdisjoint(mgr._free)
        assert len(slots) + mgr.num_free_slots() == 12
        assert list(mgr.iter_lru()) == ref.order, "pending and pinned blocks keep their recency too"
        assert list(mgr.iter_evictable()) == ref.evictable()
        assert mgr.num_evictable() == len(ref.evictable())


def test_spec_sizes_the_tier_and_builds_both_directions():
    from conftest import make_layout, random_tensors
    from tiered_kv.config import ConfigError
    from tiered_kv.cpu.spec import CPUOffloadingSpec
    from tiered_kv.cpu.handlers import SingleDirectionOffloadingHandler

    layout = make_layout(True, block_size_factor=2)
    config = {"cpu_bytes": f"{10 * layout.bytes_per_block + 5}B", "block_size": 8}
    with pytest.raises(ConfigError, match="needs the KV layout"):
        CPUOffloadingSpec(config, gpu_block_size=4).get_manager()
    with pytest.raises(ConfigError, match="block_size_factor 2 does not match the config's 1"):
        CPUOffloadingSpec({"cpu_bytes": "1MiB"}, gpu_block_size=4, layout=layout)
    with pytest.raises(ConfigError, match="cpu_bytes: .* holds no block"):
        CPUOffloadingSpec({"cpu_bytes": "10B", "block_size": 8}, 4, layout=layout).get_manager()

    scheduler_spec = CPUOffloadingSpec(config, gpu_block_size=4, layout=layout)
    mgr = scheduler_spec.get_manager()
    assert mgr.num_slots == 10 and mgr.block_size == 8

    worker_spec = CPUOffloadingSpec(config, gpu_block_size=4)
    tensors = dict(zip((l.name for l in layout.layers), random_tensors(layout)))
    pairs = list(worker_spec.get_handlers(tensors, kv_before_num_blocks=True))
    assert [(s.medium(), d.medium()) for s, d, _ in pairs] == [("GPU", "CPU"), ("CPU", "GPU")]
    assert all(isinstance(h, SingleDirectionOffloadingHandler) for *_, h in pairs)
    assert worker_spec.host.num_slots == 10 and worker_spec.num_cpu_slots == 10
    worker = CPUOffloadingSpec(config, gpu_block_size=4, layout=layout).build_worker(tensors, True)
    assert set(worker.transfer_type_to_handler) == {("GPU", "CPU"), ("CPU", "GPU")}
    with pytest.raises(ConfigError, match="do not match"):
        other = make_layout(True, block_size_factor=2, head_dim=4)
        CPUOffloadingSpec(config, 4, layout=other).build_worker(tensors, True)


def test_gpu_copy_picks_the_handlers_copy_path():
    from conftest import make_layout, random_tensors
    from tiered_kv.config import ConfigError
    from tiered_kv.cpu.spec import CPUOffloadingSpec
    from tiered_kv.memory.device import cuda_available

    layout = make_layout(True)
    config = {"cpu_bytes": f"{4 * layout.bytes_per_block}B"}
    device = "cuda" if cuda_available() else "cpu"
    tensors = dict(zip((l.name for l in layout.layers), random_tensors(layout, device=device)))
    with pytest.raises(ConfigError, match="gpu_copy: expected one of"):
        CPUOffloadingSpec({**config, "gpu_copy": "dmaa"}, gpu_block_size=4)
    # auto: kernels for jobs of short runs of slots where the device maps the tier, DMA for the rest.
    for choice, kernels in (
        ("auto", cuda_available()),
        ("dma", False),
        *((("kernels", True),) if cuda_available() else ()),
    ):
        pairs = list(
            CPUOffloadingSpec({**config, "gpu_copy": choice}, gpu_block_size=4).get_handlers(
                tensors, kv_before_num_blocks=True
            )
        )
        assert all(h.copy_kernels == kernels for *_, h in pairs), choice
    if not cuda_available():  # nothing on this machine can map the host tier for a device
        with pytest.raises(ValueError, match="config gpu_copy: kernels.*use gpu_copy auto or dma"):
            list(
                CPUOffloadingSpec({**config, "gpu_copy": "kernels"}, gpu_block_size=4).get_handlers(
                    tensors, kv_before_num_blocks=True
                )
            )
