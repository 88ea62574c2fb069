"""Our ARC against vLLM 0.33's ARC (``cache_policy: arc``), call for call.

Random request streams drive both: each request looks up its chain, loads the hit, offers
the chain to ``prepare_store`` and is touched at its end (vLLM's request finishes there);
a store completes one request late, so stores are in flight when the next request runs,
as in a replay. After every request both hold the same blocks in the same T1 and T2
order with the same target, and every lookup agrees. Ours runs bare and under the
composite (which evicts through ``evict`` before it allocates)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv.cpu import ARCOffloadingManager
from tiered_kv.tiered.manager import TieredOffloadingManager

pytestmark = pytest.mark.vllm

BLOCK = 16


class VllmArc:
    """vLLM's CPU manager with ARC, one request context per request."""

    def __init__(self, slots: int):
        base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed", exc_type=ImportError)
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.base = base
        self.inner = CPUOffloadingManager(num_chunks=slots, cache_policy="arc", enable_events=False)
        self.store_ctx = base.ReqContext(req_id="stores")
        self.ctx = None
        self.n = 0

    def keys(self, hashes):
        return [self.base.make_offload_key(h, 0) for h in hashes]

    def request(self):
        if self.ctx is None:
            self.n += 1
            self.ctx = self.base.ReqContext(req_id=f"r{self.n}")
            self.inner.on_new_request(self.ctx)
        return self.ctx

    def lookup(self, hashes) -> int:
        ctx, n = self.request(), 0
        for key in self.keys(hashes):
            if self.inner.lookup(key, ctx) is not self.base.LookupResult.HIT:
                break
            n += 1
        return n

    def load(self, hashes) -> None:
        keys = self.keys(hashes)
        self.inner.prepare_load(keys, self.request())
        self.inner.complete_load(keys, self.request())

    def prepare_store(self, hashes) -> list[bytes] | None:
        ctx, keys = self.request(), self.keys(hashes)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * BLOCK)
        out = self.inner.prepare_store(keys, ctx)
        return None if out is None else [bytes(self.base.get_offload_block_hash(k)) for k in out.keys_to_store]

    def complete_store(self, hashes) -> None:
        self.inner.complete_store(self.keys(hashes), self.store_ctx)

    def touch(self, hashes) -> None:
        ctx = self.request()
        self.inner.touch(self.keys(hashes), ctx)
        self.inner.on_request_finished(ctx)
        self.ctx = None

    def state(self):
        policy, h = self.inner._policy, lambda k: bytes(self.base.get_offload_block_hash(k))
        return [h(k) for k in policy.t1], [h(k) for k in policy.t2], policy.target_t1_size


def ours_state(arc: ARCOffloadingManager):
    by_slot = arc._hash_by_slot
    return [by_slot[s] for s in arc._t1], [by_slot[s] for s in arc._t2], arc.target_t1


# A request: a prefix family (requests of one family share their head) and a length.
requests = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), min_size=5, max_size=60)


@pytest.mark.parametrize("composite", (False, True), ids=("bare", "composite"))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=requests, slots=st.integers(4, 16))
def test_our_arc_ranks_and_evicts_as_vllms_arc(composite, stream, slots):
    theirs = VllmArc(slots)
    arc = ARCOffloadingManager(slots, BLOCK, enable_events=False)
    ours = TieredOffloadingManager(arc) if composite else arc
    in_flight: list[bytes] | None = None
    for family, length in stream:
        chain = [f"{family}:{i}".encode() for i in range(length)]
        hits = ours.lookup(chain)
        assert hits == theirs.lookup(chain)
        if hits:
            ours.prepare_load(chain[:hits])
            ours.complete_load(chain[:hits])
            theirs.load(chain[:hits])
        out = ours.prepare_store(chain)
        stored = None if out is None else list(out.block_hashes_to_store)
        assert stored == theirs.prepare_store(chain)
        ours.touch(chain)
        theirs.touch(chain)
        if in_flight:
            ours.complete_store(in_flight)
            theirs.complete_store(in_flight)
        in_flight = stored
        assert ours_state(arc) == theirs.state()
