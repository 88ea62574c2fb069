"""Session retention (``cpu_retention``, a disk tier's ``retention``) with vLLM's session
ids, inside vLLM 0.33's real scheduler and worker connector moving real bytes on CPU
tensors (tests/support/vllm_harness.py, ``worker="real"``), through both of our
connectors.

What they show: requests that carry one ``session_id`` are one session even when a turn
does not extend the previous prompt (an LLM agent that rewrote its context), so that
turn's chunks are held through an eviction storm and the next turn finds them in the
CPU tier; the same requests without the id are unrelated chains, nothing is held and the
storm takes them. A disk tier's ``retention`` does the same on disk through a storm
that empties the CPU tier. Equal ids of two tenants (``cache_salt``) are two sessions.
Requests without an id still name their session by the prefix chain. The rules' counts
and holds reach vLLM's Prometheus side. The rules' clock is the test's, so turns are
seconds apart without waiting.

I/O: a disk tier in pytest's tmp_path for the disk test.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from test_vllm_tiers import BLOCK, GPU_BLOCK_BYTES, SPEC, _prompt  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tiered_kv.tiered.retention import SessionRetention  # noqa: E402
from tiered_kv.integrations.vllm.common import RequestSession  # noqa: E402
from tiered_kv.integrations.vllm.manager import TieredVllmManager  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

CONNECTORS = {
    "offloading": {
        "kv_connector": "TieredOffloadingConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm.connector",
    },
    "prefetching": {
        "kv_connector": "TieredPrefetchingConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm.prefetch_jobs",
    },
}
CHUNKS = 4  # chunks of each turn's prompt
STORM = 12  # one-time prompts of CHUNKS chunks each: more than a 16-chunk CPU tier and the disk tier hold


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _build(model_dir, connector: str = "prefetching") -> tuple[vh.VllmHarness, SessionRetention, Clock]:
    config = {**SPEC, "cpu_bytes": f"{16 * GPU_BLOCK_BYTES}B", "block_size": BLOCK, "cpu_retention": "session(0.5)"}
    h = _harness(model_dir, config, connector)
    manager = h.manager
    assert isinstance(manager, TieredVllmManager)
    retention = manager.composite.cpu.retention
    assert isinstance(retention, SessionRetention) and retention.budget == 8
    clock = Clock()
    retention.clock = clock
    return h, retention, clock


def _harness(model_dir, config: dict, connector: str = "prefetching") -> vh.VllmHarness:
    h = vh.VllmHarness.build(
        model_dir,
        config,
        num_gpu_blocks=64,
        worker="real",
        kv_load_failure_policy="recompute",
        **CONNECTORS[connector],
    )
    assert type(h.connector).__name__ == CONNECTORS[connector]["kv_connector"]
    return h


def _serve(h: vh.VllmHarness, prompt: list[int], session_id: str | None = None, cache_salt: str | None = None) -> str:
    """One request, as vLLM's engine hands it over with the client's session id, run to
    the end of its stores (and of its disk writes)."""
    req_id = f"turn-{len(h.scheduler.requests)}-{time.monotonic_ns()}"
    hash_fn = get_hash_fn_by_name(h.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    request = Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(h.block_size, hash_fn),
        cache_salt=cache_salt,
        session_id=session_id,
    )
    h.scheduler.add_request(request)
    h.settle()
    deadline = time.monotonic() + 20
    while h.manager.composite.pending_writes():
        assert time.monotonic() < deadline, "disk writes never became durable"
        time.sleep(0.005)
    return req_id


def _rewritten_turns(h: vh.VllmHarness, clock: Clock, session_id: str | None) -> int:
    """An LLM agent's two turns 10 s apart, the second not extending the first (its context
    rewritten), an eviction storm of one-time prompts, then a third turn extending the
    second; the hits of the third turn, from any tier."""
    first, second = _prompt(1, CHUNKS * BLOCK + 5), _prompt(2, CHUNKS * BLOCK + 5)
    _serve(h, first, session_id)
    clock.now += 10
    _serve(h, second, session_id)
    clock.now += 0.5
    for i in range(STORM):
        _serve(h, _prompt(100 + i, CHUNKS * BLOCK + 5))
    clock.now += 2
    h.reset_gpu_prefix_cache()
    tiers = h.manager.composite.stats.tiers
    before = sum(t["hits"] for t in tiers.values())
    _serve(h, second + _prompt(3, 2 * BLOCK), session_id)
    return sum(t["hits"] for t in tiers.values()) - before


@pytest.mark.parametrize("connector", list(CONNECTORS))
def test_a_session_id_makes_a_rewritten_turn_a_return_whose_chunks_survive_a_storm(model_dir, connector):
    h, retention, clock = _build(model_dir, connector)
    with h:
        assert _rewritten_turns(h, clock, "agent-7") == CHUNKS  # the second turn's, held through the storm
        assert retention.counts["returns"] == 2  # the second turn and the third
        assert retention.counts["held"] >= CHUNKS and retention.counts["dropped"] == 0
        assert retention.ttl_s == 10
        stats = h.stats()
        assert stats["tiered_kv_retention_events:('cpu', 'returns')"] == 2
        assert stats["tiered_kv_retention_held_blocks:('cpu',)"] == retention.num_held() > 0
        assert stats["tiered_kv_retention_ttl_seconds:('cpu',)"] == 10
        registry = h.publish_metrics()  # vLLM's Prometheus side takes them (it refuses an undeclared metric)
        value = registry.get_sample_value(
            "tiered_kv_retention_events_total", {"engine": "0", "tier": "cpu", "event": "returns"}
        )
        assert value == 2


def test_without_a_session_id_a_rewritten_turn_is_another_chain_and_the_storm_takes_it(model_dir):
    h, retention, clock = _build(model_dir)
    with h:
        assert _rewritten_turns(h, clock, None) == 0
        # Only the third turn returns: it extends the second's chain, which nothing held.
        assert retention.counts["returns"] == 1
        assert retention.ttl_s == 2.5


def test_without_a_session_id_a_turn_that_extends_the_last_is_a_return(model_dir):
    h, retention, clock = _build(model_dir)
    with h:
        first = _prompt(4, CHUNKS * BLOCK + 5)
        _serve(h, first)
        clock.now += 10
        _serve(h, first + _prompt(5, 2 * BLOCK))
        assert retention.counts["returns"] == 1 and retention.ttl_s == 10


def test_equal_session_ids_of_two_tenants_are_two_sessions(model_dir):
    h, retention, clock = _build(model_dir)
    with h:
        _serve(h, _prompt(6, CHUNKS * BLOCK), "chat-1", cache_salt="tenant-a")
        clock.now += 10
        _serve(h, _prompt(7, CHUNKS * BLOCK), "chat-1", cache_salt="tenant-b")
        assert retention.counts["returns"] == 0
        clock.now += 10
        _serve(h, _prompt(8, CHUNKS * BLOCK), "chat-1", cache_salt="tenant-a")
        assert retention.counts["returns"] == 1 and retention.ttl_s == 20
        sessions = [s for s in retention._sessions if isinstance(s, RequestSession)]
        assert sorted(str(s.tenant) for s in sessions) == ["tenant-a", "tenant-b"]


@pytest.mark.parametrize("session_id", ["agent-7", None], ids=["named", "unnamed"])
def test_a_disk_tiers_retention_keeps_a_named_sessions_tail_through_a_storm_that_empties_cpu(
    model_dir, tmp_path, session_id
):
    config = {
        **SPEC,
        "cpu_bytes": f"{8 * GPU_BLOCK_BYTES}B",
        "block_size": BLOCK,
        "disk_path": str(tmp_path / "disk"),
        "disk_bytes": f"{16 * GPU_BLOCK_BYTES}B",
        "disk_retention": "session(0.5)",
        "cpu_retention": "none",  # the storm must empty the CPU tier
        "promote_on_hit": False,
    }
    with _harness(model_dir, config) as h:
        manager = h.manager
        assert isinstance(manager, TieredVllmManager) and manager.composite.cpu.retention is None
        disk = manager.tier("disk")
        retention = getattr(disk, "retention", None)
        assert isinstance(retention, SessionRetention) and retention.budget == 8
        clock = Clock()
        retention.clock = clock
        hits = _rewritten_turns(h, clock, session_id)
        if session_id is None:
            assert hits == 0 and retention.counts["returns"] == 1
            return
        assert hits == CHUNKS and manager.composite.stats.tiers["disk"]["hits"] == CHUNKS
        assert retention.counts["returns"] == 2
        stats = h.stats()
        assert stats["tiered_kv_retention_events:('disk', 'returns')"] == 2
        assert stats["tiered_kv_retention_held_blocks:('disk',)"] == retention.num_held() > 0
        h.publish_metrics()


def test_a_clients_long_session_id_is_kept_as_a_digest():
    """A client chooses how long its session id is; the rule keeps thousands of sessions,
    so a long id (or salt) is kept as a fixed-size digest: equal ids still one session,
    different ones two, short ones as sent."""
    from types import SimpleNamespace

    huge = "s" * (1 << 20)
    a = RequestSession.of(SimpleNamespace(session_id=huge, cache_salt="t" * 10_000))
    b = RequestSession.of(SimpleNamespace(session_id=huge, cache_salt="t" * 10_000))
    c = RequestSession.of(SimpleNamespace(session_id=huge + "x", cache_salt="t" * 10_000))
    assert a is not None and a == b and a != c
    assert len(a.session_id) <= RequestSession.MAX_KEPT and a.tenant is not None and len(a.tenant) <= 100
    assert RequestSession.of(SimpleNamespace(session_id="chat-7", cache_salt=None)) == RequestSession(None, "chat-7")
    assert RequestSession.of(SimpleNamespace(session_id=None, cache_salt="t")) == RequestSession("t", None)
    assert RequestSession.of(SimpleNamespace(session_id=None, cache_salt=None)) is None
    # A short salt that spells a long one's digest is another tenant (leases, sessions).
    spelled = RequestSession.of(SimpleNamespace(session_id=huge, cache_salt=a.tenant))
    assert spelled is not None and spelled.tenant != a.tenant and spelled != a
