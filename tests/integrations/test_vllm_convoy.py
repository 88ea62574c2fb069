"""No convoy: many requests sharing a prefix that is being loaded from disk wait for
that one load, not for each other.

Peers' users hit this: 50 concurrent requests serialised behind one in-flight load
(vLLM #44294: 12x the TTFT, -40% throughput), lookups that start late (vLLM #41784).
Here 50 requests sharing a 10,000-token prefix (625 GPU blocks of 16 tokens, offloaded
chunk = one block; the issue's figure, at full scale) with distinct 16-token suffixes
arrive in the same step while the prefix is on disk only, and vLLM 0.33's real
scheduler and worker connector step the engine (tests/support/vllm_harness.py,
``worker="real"``), with both connectors: ours with the recompute policy
(``vh.ONE_READ``: a disk hit is promised at once) and vLLM's own ``OffloadingConnector``
(the scheduler first reads the prefix back and checks it: HIT_PENDING).

What is measured, in engine steps from the one all requests arrive in (step 0): the
step each request's prefix was available (its load reported done by the worker, or a
hit in vLLM's GPU prefix cache when it was admitted) and the step its first token was
sampled. The load the prefix needs is the steps from arrival until the one load is
reported done (with vLLM's connector this includes the scheduler's verifying read,
which is part of getting that prefix off disk with it). No request may wait longer
than that plus one step (the forward pass that samples its first token); the prefix
is read from disk once per reader (``DiskStore.begin_read``), not once per request;
exactly one load job is emitted; every request's GPU blocks hold the prefix's bytes.

Why it holds: vLLM 0.33's scheduler-side connector defers (``None`` from
``get_num_new_matched_tokens``) a request whose hit chunks are being loaded by another
(``_chunks_being_loaded``); the loading request then re-enters the queue first
(``kv_holding_waiting``) and caches its blocks, so in the same step every deferred
request hits the whole prefix in the GPU prefix cache.

I/O: a disk tier in pytest's tmp_path; the test process plays the scheduler and the
worker.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from test_vllm_tiers import BLOCK, GPU_BLOCK_BYTES, SPEC, _durable, _keys, _prompt, _serve, _zero_gpu  # noqa: E402

from tiered_kv.integrations.vllm.connector import TieredOffloadingConnector  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PREFIX_TOKENS = 10_000  # 625 blocks of BLOCK tokens
SUFFIX_TOKENS = BLOCK  # one full block of its own per request
REQUESTS = 50
# Holds the prefix (vLLM offers a request's chunks not stored yet again with the next
# step's, and a batch larger than the CPU tier never fits), and is then pushed out by
# a prompt longer than it, so the prefix ends up on disk only.
CPU_CHUNKS = (PREFIX_TOKENS + SUFFIX_TOKENS) // BLOCK + 16
MAX_BATCHED = 1024  # fits every request's suffix in one step: 50 x 16 tokens
GPU_BLOCKS = 1024  # the prefix and a suffix block per request; the pushing prompt
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"), max_position_embeddings=16384)


def _build(model_dir, disk, **vllm) -> vh.VllmHarness:
    config = {**SPEC, "cpu_bytes": f"{CPU_CHUNKS * GPU_BLOCK_BYTES}B", "block_size": BLOCK}
    config.update(disk_path=str(disk), disk_bytes=f"{2048 * 4096}B")
    return vh.VllmHarness.build(
        model_dir,
        config,
        num_gpu_blocks=GPU_BLOCKS,
        worker="real",
        max_num_seqs=64,  # every request can be admitted in one step
        max_num_batched_tokens=MAX_BATCHED,
        max_model_len=12_800,
        **vllm,
    )


def _prefix_on_disk_only(h: vh.VllmHarness, prefix: list[int]) -> None:
    """Serve the prefix (stored in CPU and written through to disk), then a prompt
    longer than the CPU tier that pushes it out of CPU; forget the GPU's copy."""
    _serve(h, prefix + _prompt(900, SUFFIX_TOKENS))
    _durable(h)
    _serve(h, _prompt(901, (CPU_CHUNKS + 16) * BLOCK + 1))
    _durable(h)
    composite = h.manager.composite
    keys = _keys(prefix)
    assert len(keys) == PREFIX_TOKENS // BLOCK
    assert not any(composite.cpu.is_loadable(k) for k in keys)
    assert all(composite.tier("disk").is_loadable(k) for k in keys)
    h.reset_gpu_prefix_cache()
    _zero_gpu(h)  # only a load can bring the prefix's bytes back


@dataclass
class Arrival:
    """Per request, engine steps counted from the step all requests arrived in."""

    available: dict[str, int]  # prefix loaded (worker reported) or hit in the GPU cache
    first_token: dict[str, int]
    load_jobs: dict[str, list[int]]  # request -> the steps its load jobs were emitted in
    loaded: dict[str, int]  # request -> the step its load was reported done
    matches: dict[str, bool]  # request -> every GPU block held its hash's bytes


def _arrive_together(h: vh.VllmHarness, prefix: list[int]) -> Arrival:
    ids = [h.add_request(prefix + _prompt(1000 + i, SUFFIX_TOKENS), max_tokens=2) for i in range(REQUESTS)]
    start = len(h.steps)
    out = Arrival({}, {}, {}, {}, {})
    while len(out.first_token) < REQUESTS:
        step = len(h.steps) - start
        assert step < MAX_STEPS, f"{REQUESTS - len(out.first_token)} requests without a first token"
        record = h.step()
        for req_id in set(record.load_jobs.values()):
            out.load_jobs.setdefault(req_id, []).append(step)
        for req_id in record.finished_recving:
            out.loaded[req_id] = step
            out.available[req_id] = step
        for req_id in ids:
            hit = h.prefix_hits.get(req_id)
            if req_id not in out.available and hit is not None and hit.local >= PREFIX_TOKENS:
                out.available[req_id] = step
            request = h.scheduler.requests.get(req_id)
            if req_id not in out.first_token and request is not None and request.num_output_tokens >= 1:
                out.first_token[req_id] = step
                matches = h.kv_matches(req_id)  # while it still holds its blocks
                out.matches[req_id] = len(matches) == (PREFIX_TOKENS + SUFFIX_TOKENS) // BLOCK and all(matches)
    h.settle()
    return out


@pytest.mark.parametrize("connector", ["ours", "vllm"])
def test_requests_sharing_a_prefix_on_disk_wait_for_its_one_load_not_for_each_other(
    model_dir, tmp_path, disk_reads, connector
):
    extra = vh.ONE_READ if connector == "ours" else {}
    with _build(model_dir, tmp_path / "disk", **extra) as h:
        assert isinstance(h.worker_connector, TieredOffloadingConnector) == (connector == "ours")
        prefix = _prompt(7, PREFIX_TOKENS)
        _prefix_on_disk_only(h, prefix)
        keys = _keys(prefix)
        disk_reads.clear()
        verified_before = h.manager.check("disk").outcomes().get("ok", 0)

        got = _arrive_together(h, prefix)

        # One request loads the prefix, in one job; the others wait for it.
        assert len(got.load_jobs) == 1, got.load_jobs
        ((loader, emitted),) = got.load_jobs.items()
        assert len(emitted) == 1 and h.prefix_hits[loader].external == PREFIX_TOKENS
        loaded = got.loaded[loader]
        need = loaded + 1  # steps from arrival until the prefix's load was reported done
        waits = {r: s + 1 for r, s in got.first_token.items()}  # steps until the first token
        summary = (
            f"{connector}: load emitted at step {emitted[0]}, reported at step {loaded} (need {need} steps); "
            f"prefix available at steps {sorted(Counter(got.available.values()).items())}; "
            f"first tokens at steps {sorted(Counter(got.first_token.values()).items())}"
        )
        print(summary)
        for req_id in got.first_token:
            if req_id != loader:
                hit = h.prefix_hits[req_id]
                # Served by the GPU prefix cache once the one load landed: no load of its own.
                assert (hit.local, hit.external) == (PREFIX_TOKENS, 0), (req_id, hit)
                assert got.available[req_id] == loaded + 1, summary
        assert max(waits.values()) <= need + 1, summary
        assert all(got.matches.values()), [r for r, ok in got.matches.items() if not ok]

        # Read once by the worker that loads it; with vLLM's connector also once by the
        # scheduler's check before the hit is promised. Never once per request.
        per_chunk = Counter(disk_reads[k] for k in keys)
        verified = h.manager.check("disk").outcomes().get("ok", 0) - verified_before
        if connector == "ours":
            assert emitted == [0], summary  # promised at once
            assert per_chunk == {1: len(keys)}, per_chunk
            assert verified == 0
        else:
            assert emitted[0] >= 1, summary  # HIT_PENDING while the scheduler reads it back
            assert per_chunk == {2: len(keys)}, per_chunk
            assert verified == len(keys)
