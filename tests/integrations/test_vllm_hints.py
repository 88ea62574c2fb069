"""KV hints and prefetch while waiting, inside vLLM 0.33's real scheduler and worker
connector moving real bytes on CPU tensors (tests/support/vllm_harness.py,
``worker="real"``), with ``TieredPrefetchingConnector`` (the connector that carries
prefetch jobs, ``prefetch_jobs``) and the recompute policy.

What they show: a request that carries ``kv.retain`` keeps its prefix in the CPU tier
through an eviction storm that pushes out an unhinted one, and ``kv.release`` (or the
lease's end) lets it go; ``kv.prefetch`` turns the next request's disk chunks into CPU
hits, with the bytes the prefix calls for; a request that waits behind another has its
disk chunks moved into CPU before it runs, and those it has in CPU held there through the
stores of the request ahead, and an aborted one's queue is dropped; an
envelope that is malformed in every way leaves every tier and every answer as without
hints, and is counted.

I/O: a disk tier in pytest's tmp_path; the test process plays the scheduler and the worker.
"""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest
from prometheus_client import generate_latest
from rich.console import Console

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from test_vllm_tiers import BLOCK, GPU_BLOCK_BYTES, SPEC, _durable, _keys, _prompt, _zero_gpu  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from tiered_kv.config import ConfigError, TieredConfig  # noqa: E402
from tiered_kv.integrations.vllm.common import REQUEST_TENANT  # noqa: E402
from tiered_kv.integrations.vllm.hints import HintSettings  # noqa: E402
from tiered_kv.integrations.vllm.leases import MAX_LEASES  # noqa: E402
from tiered_kv.integrations.vllm.manager import TieredVllmManager  # noqa: E402
from tiered_kv.integrations.vllm.prefetch_jobs import TieredPrefetchingConnector  # noqa: E402
from tiered_kv.cli.stats import render  # noqa: E402
from tiered_kv.ops.metrics_view import parse, summarize  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

CONDUIT = {
    "kv_connector": "TieredPrefetchingConnector",
    "kv_connector_module_path": "tiered_kv.integrations.vllm.prefetch_jobs",
    "kv_load_failure_policy": "recompute",
}
CHUNKS = 4  # chunks of the prefixes the tests follow
STORM = 6  # prompts of CHUNKS chunks each that push a 16-chunk CPU tier's contents out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _build(model_dir, *, disk=None, cpu_chunks: int = 16, tiers=None, **vllm) -> vh.VllmHarness:
    config = {**SPEC, "cpu_bytes": f"{cpu_chunks * GPU_BLOCK_BYTES}B", "block_size": BLOCK, **(tiers or {})}
    if disk is not None:
        config.update(disk_path=str(disk), disk_bytes=f"{256 * 4096}B", promote_on_hit=False)
    return vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real", **CONDUIT, **vllm)


def _action(kind: str, payload, version: str = "1") -> KvHintAction:
    return KvHintAction(action_id=f"a-{kind}", action_type=kind, action_version=version, payload=payload)


def _envelope(*actions: KvHintAction, protocol: str = "0.1") -> KvHintsEnvelope:
    return KvHintsEnvelope(protocol_version=protocol, message_id="m-1", actions=list(actions))


def _add(
    h: vh.VllmHarness, prompt: list[int], hints=None, max_tokens: int = 1, params=None, tenant=None, lora=None
) -> str:
    """``h.add_request`` with a KV-hints envelope (and ``kv_transfer_params``, a tenant's
    ``cache_salt``, a ``LoRARequest``), as vLLM's engine hands them over."""
    req_id = f"hinted-{len(h.scheduler.requests)}-{time.monotonic_ns()}"
    hash_fn = get_hash_fn_by_name(h.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    request = Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params} if params else None
        ),
        pooling_params=None,
        block_hasher=get_request_block_hasher(h.block_size, hash_fn),
        kv_hints=hints,
        cache_salt=tenant,
        lora_request=lora,
    )
    h.scheduler.add_request(request)
    return req_id


def _serve(h: vh.VllmHarness, prompt: list[int], hints=None, tenant=None) -> vh.PrefixHit:
    req_id = _add(h, prompt, hints, tenant=tenant)
    h.settle()
    return h.prefix_hits[req_id]


def _storm(h: vh.VllmHarness, seed: int = 100) -> None:
    for i in range(STORM):
        _serve(h, _prompt(seed + i, CHUNKS * BLOCK + 5))


def _manager(h: vh.VllmHarness) -> TieredVllmManager:
    manager = h.manager
    assert isinstance(manager, TieredVllmManager)
    assert isinstance(h.connector, TieredPrefetchingConnector)
    return manager


# ------------------------------------------------------------------ retain, release


def test_a_retained_prefix_stays_in_cpu_through_an_eviction_storm_and_goes_once_released(model_dir):
    with _build(model_dir) as h:
        m = _manager(h)
        kept, lost = _prompt(1, CHUNKS * BLOCK + 5), _prompt(2, CHUNKS * BLOCK + 5)
        _serve(h, kept, _envelope(_action("kv.retain", {"ttl_s": 60, "lease_id": "session-1"})))
        _serve(h, lost)
        assert all(m.composite.cpu.is_loadable(k) for k in _keys(kept) + _keys(lost))
        _storm(h)
        assert all(m.composite.cpu.is_loadable(k) for k in _keys(kept))
        assert not any(m.composite.cpu.is_loadable(k) for k in _keys(lost))
        assert m.hints.snapshot()["pinned_blocks"] == {"cpu": CHUNKS}
        # Served from the CPU tier, with the prefix's bytes, and the load renews the lease.
        lease = m.hints.leases.leases[None, "session-1"]
        before = lease.expires
        h.reset_gpu_prefix_cache()
        _zero_gpu(h)
        req_id = h.admit(kept)
        assert h.prefix_hits[req_id].external == CHUNKS * BLOCK
        assert all(h.kv_matches(req_id))
        assert lease.expires > before
        h.settle()
        # Another request releases the lease: the next storm takes the prefix too.
        _serve(h, _prompt(3, 20), _envelope(_action("kv.release", {"lease_id": "session-1"})))
        assert m.hints.snapshot()["leases"] == 0 and m.hints.snapshot()["pinned_blocks"] == {"cpu": 0}
        _storm(h, seed=200)
        assert not any(m.composite.cpu.is_loadable(k) for k in _keys(kept))
        assert m.hints.snapshot()["actions"] == {"retain.accepted": 1, "release.accepted": 1}


def test_a_lease_ends_after_its_ttl_and_never_pins_past_its_budget(model_dir):
    with _build(model_dir) as h:
        m = _manager(h)
        now = [0.0]  # the leases' clock, so a slow machine cannot end the lease early
        m.hints.clock = lambda: now[0]
        # 6 chunks against a budget of a quarter of 16 slots: 4 pinned, 2 left to LRU.
        long = _prompt(4, 6 * BLOCK + 5)
        _serve(h, long, _envelope(_action("kv.retain", {"ttl_s": 0.2})))
        snap = m.hints.snapshot()
        assert snap["pinned_blocks"] == {"cpu": 4} and snap["lease_clipped"] == 2
        _storm(h)
        assert [m.composite.cpu.is_loadable(k) for k in _keys(long)] == [True] * 4 + [False] * 2
        now[0] = 0.25
        h.step()  # the step's end drops what expired
        assert m.hints.snapshot()["leases"] == 0 and m.hints.snapshot()["pinned_blocks"] == {"cpu": 0}


def test_a_leases_chunks_past_the_cpu_budget_are_pinned_on_disk_once_their_copy_is_loadable(model_dir, tmp_path):
    """Each leased chunk is pinned in the fastest local tier holding it within that tier's
    budget: those past the CPU tier's budget, left unpinned there as their stores land
    (their disk writes still queued), are pinned on disk at a step's end once their disk
    copy is loadable, and stay there through a CPU storm."""
    with _build(model_dir, disk=tmp_path / "disk") as h:  # lease budgets: 4 CPU slots, 64 disk slots
        m = _manager(h)
        long = _prompt(4, 6 * BLOCK + 5)
        _serve(h, long, _envelope(_action("kv.retain", {"ttl_s": 600, "lease_id": "chat"})))
        _durable(h)
        h.step()
        keys, disk = _keys(long), m.composite.tier("disk")
        snap = m.hints.snapshot()
        assert snap["pinned_blocks"] == {"cpu": 4, "disk": 2} and snap["lease_clipped"] == 2
        assert [disk.is_pinned(k) for k in keys] == [False] * 4 + [True] * 2
        _storm(h)
        _durable(h)
        assert [m.composite.cpu.is_loadable(k) for k in keys] == [True] * 4 + [False] * 2
        assert [disk.is_pinned(k) for k in keys] == [False] * 4 + [True] * 2
        assert m.hints.snapshot()["pinned_blocks"] == {"cpu": 4, "disk": 2}
        h.reset_gpu_prefix_cache()
        _zero_gpu(h)
        req_id = h.admit(long)
        assert h.prefix_hits[req_id].external == 6 * BLOCK and all(h.kv_matches(req_id))
        h.settle()
        _serve(h, _prompt(3, 20), _envelope(_action("kv.release", {"lease_id": "chat"})))
        assert m.hints.snapshot()["pinned_blocks"] == {"cpu": 0, "disk": 0}
        assert not any(disk.is_pinned(k) for k in keys)


def test_past_the_lease_cap_a_new_lease_ends_one_of_the_tenant_holding_the_most(model_dir):
    """Leases are capped (``MAX_LEASES``): a tenant (``cache_salt``) retaining without end
    ends its own leases, nearest their end first, once it holds the most, never another
    tenant's; a tenant holding fewer ends one of the largest holder's."""
    with _build(model_dir) as h:
        m = _manager(h)
        now = [0.0]
        m.hints.clock = lambda: now[0]
        alice = _prompt(1, CHUNKS * BLOCK + 5)
        _serve(h, alice, _envelope(_action("kv.retain", {"ttl_s": 600, "lease_id": "chat"})), tenant="alice")

        def retain(tenant: str, lease_id: str) -> None:
            now[0] += 0.001
            ctx = ReqContext(
                req_id=f"{tenant}-{lease_id}",
                kv_hints=_envelope(_action("kv.retain", {"lease_id": lease_id, "ttl_s": 1e9})),
            )
            token = REQUEST_TENANT.set(tenant)  # as the connector sets it around the call
            try:
                m.on_new_request(ctx)
            finally:
                REQUEST_TENANT.reset(token)
            m.on_request_finished(ctx)

        for i in range(MAX_LEASES):
            retain("mallory", f"m{i}")
        leases = m.hints.leases.leases
        assert Counter(t for t, _ in leases) == {"alice": 1, "mallory": MAX_LEASES - 1}
        assert ("mallory", "m0") not in leases and ("mallory", "m1") in leases  # its own, nearest its end
        assert all(k in m.hints.leases._pinned for k in leases["alice", "chat"].keys)
        assert m.hints.snapshot()["pinned_blocks"] == {"cpu": CHUNKS}
        retain("bob", "b0")
        assert ("bob", "b0") in leases and ("mallory", "m1") not in leases and ("alice", "chat") in leases
        assert len(leases) == MAX_LEASES


# ------------------------------------------------------------------ prefetch


def _disk_only(h: vh.VllmHarness, *prompts: list[int]) -> list[bytes]:
    """Serve ``prompts``, let their disk writes land, push them out of CPU (and forget
    the GPU prefix cache): their keys."""
    for prompt in prompts:
        _serve(h, prompt)
    _durable(h)
    _storm(h)
    _durable(h)
    h.reset_gpu_prefix_cache()
    keys = [k for prompt in prompts for k in _keys(prompt)]
    m = _manager(h)
    assert not any(m.composite.cpu.is_loadable(k) for k in keys)
    assert all(m.composite.tier("disk").is_loadable(k) for k in keys)
    return keys


def _next_request_hits(h: vh.VllmHarness, prefix: list[int], hints) -> tuple[dict[str, int], list[bool]]:
    """A request on ``prefix`` carrying ``hints``, then another on the same prefix: where
    the second one's prefix came from (chunks per tier) and whether its bytes match."""
    m = _manager(h)
    _serve(h, prefix + _prompt(7, 9), hints)
    h.settle()
    h.reset_gpu_prefix_cache()
    _zero_gpu(h)
    before = {t: m.composite.stats.tiers[t]["hits"] for t in ("cpu", "disk")}
    req_id = h.admit(prefix + _prompt(8, 11))
    matches = h.kv_matches(req_id)
    h.settle()
    return {t: m.composite.stats.tiers[t]["hits"] - before[t] for t in before}, matches


def test_a_prefetch_hint_turns_the_next_requests_disk_chunks_into_cpu_hits(model_dir, tmp_path):
    prefix = _prompt(5, CHUNKS * BLOCK)
    with _build(model_dir, disk=tmp_path / "plain") as h:
        _disk_only(h, prefix)
        plain, matches = _next_request_hits(h, prefix, None)
        assert plain == {"cpu": 0, "disk": CHUNKS} and all(matches)
    with _build(model_dir, disk=tmp_path / "hinted") as h:
        _disk_only(h, prefix)
        hinted, matches = _next_request_hits(h, prefix, _envelope(_action("kv.prefetch", {})))
        assert hinted == {"cpu": CHUNKS, "disk": 0} and all(matches)
        snap = _manager(h).hints.snapshot()
        assert snap["prefetch"]["disk.prefetches"] == CHUNKS and snap["prefetch"]["disk.prefetch_used"] == CHUNKS
        stats = h.stats()
        assert stats["tiered_kv_tier_blocks:('disk', 'prefetches')"] == CHUNKS
        assert stats["tiered_kv_tier_blocks:('disk', 'prefetch_used')"] == CHUNKS
        h.publish_metrics()  # vLLM's Prometheus side takes them (it refuses an undeclared metric)


def test_a_waiting_request_has_its_disk_chunks_in_cpu_before_it_runs_and_an_aborted_ones_are_dropped(
    model_dir, tmp_path
):
    prefix, other = _prompt(6, CHUNKS * BLOCK), _prompt(9, CHUNKS * BLOCK)
    with _build(model_dir, disk=tmp_path / "disk", max_num_seqs=1) as h:
        m = _manager(h)
        _disk_only(h, prefix, other)
        keys, other_keys = _keys(prefix), _keys(other)
        # One request runs (decoding for a while); two wait behind it, one aborted at once.
        runner = _add(h, _prompt(10, 40), max_tokens=30)
        h.step()
        waiter = _add(h, prefix + _prompt(11, 9), max_tokens=3)
        aborted = _add(h, other + _prompt(12, 9))
        h.scheduler.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
        h.step_until(lambda: all(m.composite.cpu.is_loadable(k) for k in keys))
        assert h.scheduler.requests[waiter].status == RequestStatus.WAITING
        before = m.composite.stats.tiers["disk"]["hits"]
        _zero_gpu(h)  # only a load brings the prefix's bytes
        h.step_until(lambda: h.scheduler.requests[waiter].num_output_tokens >= 1)
        assert h.scheduler.requests.get(runner) is None
        assert h.prefix_hits[waiter].external == CHUNKS * BLOCK and all(h.kv_matches(waiter))
        h.settle()
        assert m.composite.stats.tiers["disk"]["hits"] == before  # every chunk came from CPU
        # The aborted request's queue went before any of it was read.
        assert not any(m.composite.cpu.is_loadable(k) for k in other_keys)
        snap = m.hints.snapshot()["prefetch"]
        assert snap["disk.prefetches"] == snap["disk.prefetch_used"] == CHUNKS
        assert snap["disk.prefetch_cancelled"] == CHUNKS


def test_a_waiting_requests_chunks_in_cpu_are_held_through_the_stores_of_the_request_ahead(model_dir, tmp_path):
    """The request ahead stores more chunks than the CPU tier has slots while the next one
    waits: without the hold, the waiter's prefix would be evicted and read from disk. An
    aborted waiter's holds go at once."""
    prefix, other = _prompt(15, CHUNKS * BLOCK), _prompt(18, CHUNKS * BLOCK)
    with _build(model_dir, disk=tmp_path / "disk", max_num_seqs=1, max_num_batched_tokens=4 * BLOCK) as h:
        m = _manager(h)
        _serve(h, prefix)
        _serve(h, other)
        _durable(h)
        h.reset_gpu_prefix_cache()
        keys = _keys(prefix)
        assert all(m.composite.cpu.is_loadable(k) for k in keys + _keys(other))
        runner = _add(h, _prompt(16, 20 * BLOCK), max_tokens=2)  # 20 chunks, 4 a step
        h.step()
        waiter = _add(h, prefix + _prompt(17, 9), max_tokens=3)
        aborted = _add(h, other + _prompt(19, 9), max_tokens=3)
        h.step()
        prefetcher = m.hints.prefetcher
        assert prefetcher is not None and prefetcher.held_blocks == 2 * CHUNKS
        assert prefetcher.max_held == 8  # half the 16 slots, beside leases' quarter
        h.scheduler.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
        h.step()
        assert prefetcher.held_blocks == CHUNKS
        assert h.stats()["tiered_kv_prefetch_held_bytes"] == CHUNKS * GPU_BLOCK_BYTES
        # What an operator sees: vLLM's endpoint, read by ``tiered-kv stats``.
        view = summarize(parse(generate_latest(h.publish_metrics()).decode()))
        assert view["sessions"]["prefetch_held_bytes"] == CHUNKS * GPU_BLOCK_BYTES
        console = Console(record=True, width=200)
        console.print(render(view, "vllm"))
        (line,) = [line for line in console.export_text().splitlines() if "held for waiting requests" in line]
        assert "16.0 KiB" in line, line
        evicted = m.composite.stats.tiers["cpu"]["evictions"]
        h.step_until(lambda: runner not in h.scheduler.requests)
        assert m.composite.stats.tiers["cpu"]["evictions"] - evicted >= CHUNKS  # the storm came
        assert h.scheduler.requests[waiter].status == RequestStatus.WAITING
        assert all(m.composite.cpu.is_loadable(k) for k in keys)
        before = m.composite.stats.tiers["disk"]["hits"]
        _zero_gpu(h)  # only a load brings the prefix's bytes
        h.step_until(lambda: h.scheduler.requests[waiter].num_output_tokens >= 1)
        assert h.prefix_hits[waiter].external == CHUNKS * BLOCK and all(h.kv_matches(waiter))
        h.settle()
        assert m.composite.stats.tiers["disk"]["hits"] == before  # every chunk came from CPU
        assert prefetcher.held_blocks == 0 and h.stats()["tiered_kv_prefetch_held_bytes"] == 0
        h.publish_metrics()  # vLLM's Prometheus side takes the gauge (it refuses an undeclared metric)


def test_holds_and_leases_together_leave_a_quarter_of_the_cpu_tier_unpinned(model_dir, tmp_path):
    for budget, held in ((0.1, 8), (0.25, 8), (0.4, 6), (0.5, 4)):
        with _build(model_dir, disk=tmp_path / f"disk-{budget}", tiers={"lease_budget": budget}) as h:
            prefetcher = _manager(h).hints.prefetcher
            assert prefetcher is not None and prefetcher.max_held == held, budget


def test_a_cache_reset_drops_every_lease_and_what_a_prefetch_in_flight_reads(model_dir, tmp_path):
    prefix, kept = _prompt(13, CHUNKS * BLOCK), _prompt(14, CHUNKS * BLOCK + 5)
    with _build(model_dir, disk=tmp_path / "disk", max_num_seqs=1) as h:
        m = _manager(h)
        _disk_only(h, prefix)
        _serve(h, kept, _envelope(_action("kv.retain", {})))
        assert m.hints.snapshot()["pinned_blocks"]["cpu"] == CHUNKS
        # A request waits behind a running one; the reset comes while its prefetch is
        # in flight (the workers' report of its end not yet read by the scheduler).
        runner = _add(h, _prompt(10, 40), max_tokens=30)
        h.step()
        waiter = _add(h, prefix + _prompt(15, 9))
        h.step()
        assert m.hints.prefetcher.bytes_in_flight > 0
        h.scheduler.finish_requests([runner, waiter], RequestStatus.FINISHED_ABORTED)
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
        assert m.hints.snapshot()["leases"] == 0
        h.settle()
        assert m.hints.prefetcher.bytes_in_flight == 0
        deadline = time.monotonic() + 20
        disk = m.composite.tier("disk")
        # In flight at the reset: their slots come back once every rank has an outcome there.
        while m.check("disk")._stale_writes or disk.num_pending() or disk.num_free_slots() < disk.capacity:
            assert time.monotonic() < deadline, "stale disk writes were never dropped"
            h.step()
            time.sleep(0.005)
        assert m.composite.used_blocks() == {"cpu": 0, "disk": 0}


# ------------------------------------------------------------------ malformed


MALFORMED = [
    _envelope(
        _action("kv.retain", {"ttl_s": "soon"}),
        _action("kv.retain", {"ttl_s": -1}),
        _action("kv.retain", {"ttl_s": True}),
        _action("kv.retain", {"lease_id": 5}),
        _action("kv.release", {"lease_id": ""}),
        _action("kv.prefetch", "all of it"),
        _action("kv.prefetch", {}, version="2.0"),
        _action("kv.evict", {}),
        KvHintAction(action_id="x", action_type=None, action_version=None, payload=None),  # type: ignore[arg-type]
    ),
    _envelope(_action("kv.prefetch", {}), protocol="7"),
    KvHintsEnvelope(protocol_version="0.1", message_id="m", actions="kv.prefetch"),  # type: ignore[arg-type]
    _envelope(*[_action("kv.release", {}) for _ in range(20)]),
]


def test_a_malformed_envelope_changes_nothing_and_is_counted(model_dir, tmp_path):
    """The same requests, without hints and with an envelope malformed in every way:
    the same hits, stores and evictions in every tier, no lease, no prefetch."""
    prefix = _prompt(5, CHUNKS * BLOCK)
    runs = []
    for i, envelopes in enumerate([[None] * len(MALFORMED), MALFORMED]):
        with _build(model_dir, disk=tmp_path / f"run{i}") as h:
            m = _manager(h)
            _disk_only(h, prefix)
            for j, envelope in enumerate(envelopes):
                _serve(h, prefix + _prompt(20 + j, 9), envelope)
            _durable(h)
            events = ("hits", "stores", "evictions", "promotions")
            tiers = {t: {e: c[e] for e in events} for t, c in m.composite.stats.tiers.items()}
            cpu = [m.composite.cpu.is_loadable(k) for k in _keys(prefix)]
            runs.append((tiers, cpu, m.hints.snapshot()))
    (plain_tiers, plain_cpu, plain), (tiers, cpu, hinted) = runs
    assert tiers == plain_tiers and cpu == plain_cpu
    assert hinted["leases"] == plain["leases"] == 0 and hinted["prefetch"] == plain["prefetch"]
    assert hinted["actions"] == {
        "retain.malformed": 4,
        "release.malformed": 1,
        "prefetch.malformed": 1,
        "prefetch.unsupported_version": 2,
        "other.unknown_action": 2,
        "other.malformed": 1,
        "release.accepted": 16,
        "release.too_many": 4,
    }


def test_numbers_past_any_bound_in_an_envelope_are_malformed_never_raised():
    """msgspec decodes a JSON integer of any size as a Python int, and vLLM types the
    versions as strings only: neither may raise out of ``on_new_request`` (the engine's)."""
    from tiered_kv.integrations.vllm.hints import parse_hints

    def envelope(protocol="1", action="1", payload=None):
        retain = {"action_type": "kv.retain", "action_version": action, "payload": payload or {"ttl_s": 5}}
        return {"protocol_version": protocol, "actions": [retain]}

    huge = "9" * 5000
    cases = {
        "ttl past float's range": (envelope(payload={"ttl_s": 10**400}), ("retain", "accepted")),
        "protocol version of 5,000 digits": (envelope(protocol=huge), ("retain", "unsupported_version")),
        "action version of 5,000 digits": (envelope(action=huge + ".0"), ("retain", "unsupported_version")),
    }
    for what, (raw, outcome) in cases.items():
        actions, outcomes = parse_hints(raw, "req", max_ttl_s=60.0)
        assert outcomes == {outcome: 1}, what
    actions, _ = parse_hints(cases["ttl past float's range"][0], "req", max_ttl_s=60.0)
    assert actions[0].ttl_s == 60.0 and isinstance(actions[0].ttl_s, float)


def test_settings_read_their_keys_and_name_a_bad_value():
    raw = {"prefetch_waiting": False, "prefetch_max_bytes": "64MiB", "lease_budget": 0.1, "lease_max_ttl_s": 60}
    got = HintSettings.from_config(TieredConfig.from_dict(raw))
    assert got == HintSettings(prefetch_waiting=False, prefetch_max_bytes=64 << 20, lease_budget=0.1, max_ttl_s=60.0)
    assert HintSettings.from_config(TieredConfig()) == HintSettings()
    for raw, message in [
        ({"lease_budget": 0.75}, "lease_budget: expected a share of each tier from 0 to 0.5, got 0.75"),
        ({"lease_budget": "a lot"}, "lease_budget: expected a number, got 'a lot'"),
        ({"lease_max_ttl_s": 0}, "lease_max_ttl_s: expected seconds > 0, got 0.0"),
        ({"lease_max_ttl_s": float("inf")}, "lease_max_ttl_s: expected seconds > 0, got inf"),
        ({"lease_budget": float("nan")}, "lease_budget: expected a share of each tier from 0 to 0.5, got nan"),
        ({"prefetch_waiting": "maybe"}, "prefetch_waiting: expected true or false"),
        ({"prefetch_max_bytes": "lots"}, "prefetch_max_bytes"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            TieredConfig.from_dict(raw)


def test_a_lease_id_names_a_lease_within_its_tenant_only(model_dir):
    """Tenants (``cache_salt``) name leases independently: another tenant's release or
    retain of the same ``lease_id`` neither ends nor takes over this one's lease."""
    with _build(model_dir) as h:
        m = _manager(h)
        alice, bob = _prompt(1, CHUNKS * BLOCK + 5), _prompt(3, 2 * BLOCK + 5)
        retain = _envelope(_action("kv.retain", {"ttl_s": 600, "lease_id": "chat-1"}))
        _serve(h, alice, retain, tenant="alice")
        _serve(h, _prompt(2, 20), _envelope(_action("kv.release", {"lease_id": "chat-1"})), tenant="bob")
        _serve(h, bob, retain, tenant="bob")
        leases = m.hints.leases.leases
        assert set(leases) == {("alice", "chat-1"), ("bob", "chat-1")}
        kept = leases["alice", "chat-1"].keys  # salted by the tenant: not _keys(alice)
        assert len(kept) == CHUNKS and not set(kept) & set(leases["bob", "chat-1"].keys)
        assert all(k in m.hints.leases._pinned for k in kept), "another tenant unpinned this tenant's lease"


def test_a_release_ends_its_lease_when_the_releasing_request_ends(model_dir):
    """A session's last turn says so with ``kv.release``: the lease still serves that turn
    (an eviction storm while it waits cannot take its prefix) and ends with it."""
    with _build(model_dir) as h:
        m = _manager(h)
        kept = _prompt(1, CHUNKS * BLOCK + 5)
        _serve(h, kept, _envelope(_action("kv.retain", {"ttl_s": 60, "lease_id": "chat"})))
        _storm(h)
        h.reset_gpu_prefix_cache()
        last = _add(h, kept[: CHUNKS * BLOCK] + [7] * BLOCK, _envelope(_action("kv.release", {"lease_id": "chat"})))
        assert m.hints.snapshot()["leases"] == 1 and m.hints.snapshot()["pinned_blocks"] == {"cpu": CHUNKS}
        _storm(h, seed=300)  # arrives behind the last turn, which is served first
        assert h.prefix_hits[last].external == CHUNKS * BLOCK
        assert m.hints.snapshot()["leases"] == 0 and m.hints.snapshot()["pinned_blocks"] == {"cpu": 0}
        assert m.hints.snapshot()["actions"] == {"retain.accepted": 1, "release.accepted": 1}


def test_leased_chunks_left_unpinned_are_retried_head_first_whatever_the_hash_seed():
    """Past the budget a lease's chunks wait unpinned; once a pin is dropped, a retry of at
    most ``limit`` of them takes those nearest their lease's head, not the first ones a
    set of keys happens to yield (which moves with PYTHONHASHSEED)."""
    from tiered_kv.cpu import cpu_tier_manager
    from tiered_kv.integrations.vllm.leases import LeaseBook

    cpu = cpu_tier_manager("lru", 64, BLOCK, enable_events=False)
    keys = [bytes([i]) * 32 for i in range(40)]
    assert cpu.prepare_store(keys) is not None
    cpu.complete_store(keys)
    book = LeaseBook([cpu], ["cpu"], [4])
    book.retain("chat", keys, ttl_s=60.0, now=0.0)
    assert book.pinned == [4] and book.clipped == 36 and set(book._pinned) == set(keys[:4])
    book._drop_keys("chat", keys[:2])  # two pins go, as a shorter lease on them would end
    assert book.pinned == [2]
    book.retry_unpinned(limit=3)
    assert book.pinned == [4] and set(book._pinned) == set(keys[2:6])


def test_a_clipped_chunk_whose_lower_copy_never_lands_is_retried_now_and_then_not_every_step():
    """Chunks past the CPU budget wait for a lower-tier copy; where none lands (a disk
    that admits nothing), the retry backs off, doubling up to ``MAX_RETRY_WAIT`` steps,
    and a copy that lands later is still pinned within that many steps."""
    from tiered_kv.cpu import cpu_tier_manager
    from tiered_kv.integrations.vllm.leases import MAX_RETRY_WAIT, LeaseBook

    cpu = cpu_tier_manager("lru", 64, BLOCK, enable_events=False)
    lower = cpu_tier_manager("lru", 64, BLOCK, enable_events=False)
    keys = [bytes([i]) * 32 for i in range(40)]
    assert cpu.prepare_store(keys) is not None
    cpu.complete_store(keys)
    book = LeaseBook([cpu, lower], ["cpu", "lower"], [4, 64])
    book.retain("chat", keys, ttl_s=60.0, now=0.0)
    assert book.pinned == [4, 0] and book.clipped == 36
    looked = []
    is_loadable = lower.is_loadable
    lower.is_loadable = lambda key: looked.append(key) or is_loadable(key)  # counts the retry's work
    passes = 0
    for _ in range(300):
        before = len(looked)
        book.retry_unpinned()
        passes += len(looked) > before
    assert 5 <= passes <= 12, passes
    assert lower.prepare_store(keys[4:6]) is not None
    lower.complete_store(keys[4:6])
    for _ in range(MAX_RETRY_WAIT + 1):
        book.retry_unpinned()
    assert book.pinned == [4, 2]
