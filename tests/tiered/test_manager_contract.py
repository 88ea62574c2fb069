"""vLLM's manager contract, as its own regression tests state it, against every manager:
a ``prepare_store`` never evicts a block it was offered (that would leave a hole in the
request's chain: the blocks behind it unreachable, each holding a slot), so after
``complete_store`` the request's lookup is its full length, or the call returned None
and changed nothing. Then the same as a property over random call sequences, with
loads pinning blocks and stores left in flight; and the recency rule: a stored
request's head ranks most recent."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from support.disk_fixtures import disk_bytes_for, fingerprint, small_layout
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.cpu import ARCOffloadingManager, CPUOffloadingManager, cpu_tier_manager
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.tiered.manager import TieredOffloadingManager


def b(*ids: int) -> list[bytes]:
    return [str(i).encode() for i in ids]


class Managers:
    """Builds each manager under test over ``slots`` blocks of room in its first tier."""

    KINDS = ("cpu-lru", "cpu-arc", "disk", "composite-cpu", "composite-cpu-disk", "composite-arc-disk")

    def __init__(self) -> None:
        self._dirs: list[str] = []
        self._open: list = []

    def make(self, kind: str, slots: int, disk_slots: int = 6):
        if kind == "cpu-lru":
            m = CPUOffloadingManager(slots, 16)
        elif kind == "cpu-arc":
            m = ARCOffloadingManager(slots, 16)
        elif kind == "disk":
            m = self._disk(slots)
        elif kind == "composite-cpu":
            m = TieredOffloadingManager(CPUOffloadingManager(slots, 16))
        else:
            policy = "arc" if "arc" in kind else "lru"
            m = TieredOffloadingManager(
                cpu_tier_manager(policy, slots, 16), self._disk(disk_slots), max_pending_writes=64
            )
        self._open.append(m)
        return m

    def _disk(self, slots: int) -> DiskOffloadingManager:
        path = tempfile.mkdtemp(prefix="tkv-contract-")
        self._dirs.append(path)
        layout = small_layout()
        return DiskOffloadingManager(
            path,
            fingerprint(layout),
            layout,
            disk_bytes=disk_bytes_for(layout, slots),
            engine_id="contract",
            poll_interval=None,
        )

    def close(self) -> None:
        for m in self._open:
            m.shutdown()
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def managers():
    made = Managers()
    yield made
    made.close()


def settle_disk(m) -> None:
    """What a worker's durable disk writes tell the composite: its pending disk blocks land."""
    disk = m.tier("disk") if isinstance(m, TieredOffloadingManager) else None
    if disk is not None and disk.num_pending():
        disk.complete_store(list(disk.pending_blocks()))


def store(m, hashes: list[bytes]):
    out = m.prepare_store(hashes)
    if out is not None:
        m.complete_store(out.block_hashes_to_store)
        settle_disk(m)
    return out


@pytest.mark.parametrize("kind", Managers.KINDS)
def test_a_grown_request_never_evicts_its_own_blocks(managers, kind):
    """The reproduction of the contract bug: 4 slots, blocks 1-2 stored, then the same
    request grown to 1-5. Block 2 must not make room for 3-5."""
    m = managers.make(kind, 4, disk_slots=4)
    store(m, b(1, 2))
    out = m.prepare_store(b(1, 2, 3, 4, 5))
    if out is None:
        assert m.lookup(b(1, 2)) == 2, "a refused store changes nothing"
        return
    assert not set(out.block_hashes_evicted) & set(b(1, 2, 3, 4, 5))
    m.complete_store(out.block_hashes_to_store)
    settle_disk(m)
    assert m.lookup(b(1, 2, 3, 4, 5)) == 5


@pytest.mark.parametrize("kind", ("cpu-lru", "cpu-arc", "disk", "composite-cpu"))
def test_room_comes_from_other_requests_when_they_have_it(managers, kind):
    m = managers.make(kind, 5)
    store(m, b(9))
    store(m, b(1, 2))
    out = m.prepare_store(b(1, 2, 3, 4, 5))
    assert out is not None and out.block_hashes_to_store == b(3, 4, 5)
    assert out.block_hashes_evicted == b(9)
    m.complete_store(out.block_hashes_to_store)
    assert m.lookup(b(1, 2, 3, 4, 5)) == 5


@pytest.mark.parametrize("kind", ("cpu-lru", "cpu-arc", "composite-cpu"))
def test_blocks_pinned_by_other_loads_leave_a_store_no_room_but_never_a_hole(managers, kind):
    """The case a touch before the store cannot hide: every block but the request's own
    is pinned by loads of other requests."""
    m = managers.make(kind, 4)
    store(m, b(1, 2))
    store(m, b(9))
    m.prepare_load(b(9))  # another request is loading block 9
    m.touch(b(1, 2))
    assert m.prepare_store(b(1, 2, 3, 4, 5)) is None
    assert m.lookup(b(1, 2)) == 2
    m.complete_load(b(9))
    out = m.prepare_store(b(1, 2, 3, 4))
    assert out is not None and out.block_hashes_evicted == b(9)


@pytest.mark.parametrize("kind", ("cpu-lru", "cpu-arc", "composite-cpu"))
def test_a_stored_request_ranks_its_head_most_recent(managers, kind):
    """After storing 1-2 and then 1-4, the LRU victims of the next stores are the
    request's tail first (4, then 3), never its head."""
    m = managers.make(kind, 6)
    store(m, b(1, 2))
    store(m, b(1, 2, 3, 4))
    store(m, b(20, 21))  # fills the tier
    out = m.prepare_store(b(30))
    assert out.block_hashes_evicted == b(4)
    m.complete_store(out.block_hashes_to_store)
    out = m.prepare_store(b(31))
    assert out.block_hashes_evicted == b(3)
    assert m.lookup(b(1, 2)) == 2


def test_arc_keeps_reused_blocks_over_a_scan():
    """ARC's point: blocks used twice (T2) outlive a one-time scan that LRU would let
    flush them."""
    lru, arc = CPUOffloadingManager(4, 16), ARCOffloadingManager(4, 16)
    for m in (lru, arc):
        store(m, b(1, 2))
        m.prepare_load(b(1, 2))
        m.complete_load(b(1, 2))
        m.touch(b(1, 2))  # reused: T2 under ARC
        for i in range(10, 16):  # a scan of one-time blocks
            store(m, b(i))
    assert lru.lookup(b(1, 2)) == 0
    assert arc.lookup(b(1, 2)) == 2


def test_arc_learns_from_ghost_hits():
    arc = ARCOffloadingManager(2, 16)
    store(arc, b(1))
    store(arc, b(2))
    store(arc, b(3))  # evicts 1 from T1 into B1
    assert arc.target_t1 == 0
    store(arc, b(1))  # wanted again: recency was undervalued
    assert arc.target_t1 > 0


def test_eviction_policy_config():
    assert TieredConfig.from_dict({"eviction_policy": "arc"}).eviction_policy == "arc"
    assert isinstance(cpu_tier_manager("arc", 4, 16), ARCOffloadingManager)
    with pytest.raises(ConfigError, match="eviction_policy.*'mru'"):
        TieredConfig.from_dict({"eviction_policy": "mru"})
    with pytest.raises(ConfigError, match="disk_eviction_policy: the disk tier evicts in LRU order only"):
        TieredConfig.from_dict({"disk_eviction_policy": "arc"})


# ------------------------------------------------------------------ property


UNIVERSE = b(*range(10))
requests = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=5, unique=True)


class ContractMachine(RuleBasedStateMachine):
    """Random stores (completed at once or left in flight), loads that pin, touches."""

    kind = "cpu-lru"

    def __init__(self):
        super().__init__()
        self.made = Managers()
        self.m = self.made.make(self.kind, 4)
        self.in_flight: list[list[bytes]] = []
        self.loading: list[list[bytes]] = []

    def teardown(self):
        self.made.close()

    def _prepare(self, req):
        out = self.m.prepare_store(req)
        if out is not None:
            assert not set(out.block_hashes_evicted) & set(req), (
                f"prepare_store({req}) evicted its own {set(out.block_hashes_evicted) & set(req)}"
            )
        return out

    @rule(req=requests)
    def store_now(self, req):
        out = self._prepare(req)
        if out is None:
            return
        self.m.complete_store(out.block_hashes_to_store)
        settle_disk(self.m)
        # Blocks another store still has in flight become loadable when it completes.
        elsewhere = {h for batch in self.in_flight for h in batch}
        reachable = next((i for i, h in enumerate(req) if h in elsewhere), len(req))
        assert self.m.lookup(req) >= reachable, f"a hole in {req} after its store"

    @rule(req=requests)
    def store_later(self, req):
        out = self._prepare(req)
        if out is not None and out.block_hashes_to_store:
            self.in_flight.append(list(out.block_hashes_to_store))

    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(0, 10), success=st.booleans())
    def finish_store(self, i, success):
        self.m.complete_store(self.in_flight.pop(i % len(self.in_flight)), success=success)
        # A failed store's disk slot is free once the index flusher deletes its partial entry:
        # waited for here, so the next rules see the same state on every run (hypothesis replays them).
        disk = self.m.tier("disk") if isinstance(self.m, TieredOffloadingManager) else self.m
        if isinstance(disk, DiskOffloadingManager):
            assert disk.flush()

    @rule(req=requests)
    def load(self, req):
        n = self.m.lookup(req)
        if n:
            self.m.prepare_load(req[:n])
            self.loading.append(req[:n])

    @precondition(lambda self: self.loading)
    @rule(i=st.integers(0, 10))
    def finish_load(self, i):
        self.m.complete_load(self.loading.pop(i % len(self.loading)))

    @rule(req=requests)
    def touch(self, req):
        self.m.touch(req)


def _machine(kind: str):
    cls = type(f"Contract_{kind.replace('-', '_')}", (ContractMachine,), {"kind": kind})
    return settings(
        max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )(cls).TestCase


TestContractCpuLru = _machine("cpu-lru")
TestContractCpuArc = _machine("cpu-arc")
TestContractDisk = _machine("disk")
TestContractCompositeCpu = _machine("composite-cpu")
TestContractCompositeCpuDisk = _machine("composite-cpu-disk")
TestContractCompositeArcDisk = _machine("composite-arc-disk")


# ------------------------------------------------------------------ vLLM 0.33's adapter


@pytest.mark.vllm
def test_the_vllm_adapter_never_evicts_a_requests_own_chunks(tmp_path):
    """Through vLLM's own manager interface: every chunk but the request's own is pinned by
    another request's load, so the grown store is refused, never given a hole."""
    pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
        reason="vLLM is not installed (make venv installs it)",
        exc_type=ImportError,
    )
    from support import vllm_harness as vh
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    config = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "tiered_kv.integrations.vllm",
        "cpu_bytes": f"{4 * 4096}B",
        "block_size": 16,
    }
    h = vh.VllmHarness.build(vh.write_model_config(tmp_path / "model"), config, num_gpu_blocks=64, worker="real")
    try:
        m = h.manager
        key = {i: make_offload_key(str(i).encode().ljust(32, b"."), 0) for i in (1, 2, 3, 4, 5, 9)}
        mine, other = ReqContext(req_id="mine"), ReqContext(req_id="other")

        def stored(ids, ctx):
            out = m.prepare_store([key[i] for i in ids], ctx)
            m.complete_store(out.keys_to_store, ctx)

        stored((1, 2), mine)
        stored((9,), other)
        m.prepare_load([key[9]], other)  # the other request's load pins chunk 9
        out = m.prepare_store([key[i] for i in (1, 2, 3, 4, 5)], mine)
        if out is not None:
            assert not set(out.evicted_keys) & {key[i] for i in (1, 2, 3, 4, 5)}
            m.complete_store(out.keys_to_store, mine)
        assert [m.lookup(key[i], mine) for i in (1, 2)] == [LookupResult.HIT] * 2
        m.complete_load([key[9]], other)
    finally:
        h.shutdown()
