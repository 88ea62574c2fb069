"""Our disk tier under vLLM 0.33's own TieringOffloadingSpec, driven by vLLM's real
scheduler (tests/support/vllm_harness.py) with the tier loaded by ``module_path``.

vLLM's ``TieringOffloadingManager`` owns the CPU tier and decides cascades and
promotions; ``TieredDiskTier`` is only the tier below it. Byte-level tests use a
worker that copies GPU blocks to and from vLLM's shared CPU region (vLLM's own CPU
worker needs CUDA), so what the tier writes and reads is what the fake forward pass
produced.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from support import vllm_tiering  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from tiered_kv.config import ConfigError  # noqa: E402
from tiered_kv.vllm_extra import parse_tier_config  # noqa: E402
from tiered_kv.integrations.vllm.secondary_tier import TieredDiskTier  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16  # GPU block size in tokens
# 2 layers x 2 KV heads x 16 tokens x (16 + 16) dims x 2 bytes: one GPU block, all layers;
# with one GPU block per chunk it is also one chunk (and one 4 KiB-aligned primary row).
CHUNK = 4096
TIER_MODULE = "tiered_kv.integrations.vllm.secondary_tier"
PROBE = ReqContext(req_id="probe")
SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vllm-tiering-disk.json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


@pytest.fixture(autouse=True)
def _vllm_can_unmap_its_cpu_region(caplog):
    """The tier must drop its views of vLLM's shared CPU region on shutdown (and on a
    failed start-up), or vLLM cannot unmap it. The cycle collector is off meanwhile, so
    a view kept alive only by a reference cycle shows up every time."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
    leaks = [r.getMessage() for r in caplog.get_records("call") if "still exported" in r.getMessage()]
    assert not leaks, leaks


def _extra(disk_path, *, primary_chunks: int, disk_chunks: int, real: bool = False, **tier) -> dict:
    extra = {
        "spec_name": "ShmTieringSpec" if real else "TieringOffloadingSpec",
        "cpu_bytes_to_use": primary_chunks * CHUNK,
        "secondary_tiers": [
            {
                "type": "TieredDiskTier",
                "module_path": TIER_MODULE,
                "disk_path": str(disk_path),
                "disk_bytes": f"{disk_chunks * 4}KiB",
                **tier,
            }
        ],
    }
    if real:
        extra["spec_module_path"] = vllm_tiering.MODULE
    return extra


def _build(model_dir, extra, **kw) -> vh.VllmHarness:
    return vh.VllmHarness.build(model_dir, extra, num_gpu_blocks=32, **kw)


def _tier(h: vh.VllmHarness) -> TieredDiskTier:
    assert isinstance(h.manager, TieringOffloadingManager)
    (tier,) = h.manager.secondary_tiers
    assert isinstance(tier, TieredDiskTier)
    return tier


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def _keys(prompt: list[int]) -> list[bytes]:
    return [make_offload_key(h, 0) for h in vh.hash_blocks(prompt, BLOCK)]


def _run(h: vh.VllmHarness, timeout: float = 30.0) -> None:
    """Step until no request is left and nothing is in flight, disk jobs included
    (they finish on the tier's threads, so give them time between steps)."""
    deadline = time.monotonic() + timeout
    while h.scheduler.has_requests() or h.connector.has_pending_push_work():
        assert time.monotonic() < deadline, "engine still busy"
        h.step()
        time.sleep(0.001)


def _serve(h: vh.VllmHarness, prompt: list[int], max_tokens: int = 1) -> vh.PrefixHit:
    req_id = h.add_request(prompt, max_tokens)
    _run(h)
    return h.prefix_hits[req_id]


def _until_first_token(h: vh.VllmHarness, req_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while h.scheduler.requests[req_id].num_output_tokens < 1:
        assert time.monotonic() < deadline, "no token yet"
        h.step()
        time.sleep(0.001)


def _tier_lookup(h: vh.VllmHarness, key: bytes) -> LookupResult:
    with h.manager.lock:
        return _tier(h).lookup(key, PROBE)


def _primary_lookup(h: vh.VllmHarness, key: bytes) -> LookupResult:
    with h.manager.lock:
        return h.manager.primary_tier.lookup(key, PROBE)


def _record_lookups(h: vh.VllmHarness) -> dict[bytes, list[LookupResult]]:
    """Spy on what vLLM's tiering manager answers the connector, per key."""
    seen: dict[bytes, list[LookupResult]] = {}
    manager = h.manager
    original = manager.lookup

    def lookup(key, req_context, **kw):
        result = original(key, req_context, **kw)
        seen.setdefault(bytes(key), []).append(result)
        return result

    manager.lookup = lookup
    return seen


def _wipe_gpu(h: vh.VllmHarness) -> None:
    h.reset_gpu_prefix_cache()
    for t in h.kv_caches.values():  # only a real load can restore the prefix's bytes
        t.zero_()


def _evict_from_primary(h: vh.VllmHarness, prompt: list[int], *fillers: list[int]) -> None:
    for filler in fillers:
        _serve(h, filler)
    assert all(_primary_lookup(h, k) is LookupResult.MISS for k in _keys(prompt)), (
        "the prompt is still in vLLM's CPU tier; the test would not reach the disk"
    )


def test_chunks_cascade_to_disk_and_a_cpu_miss_is_promoted_back(model_dir, tmp_path):
    with _build(model_dir, _extra(tmp_path / "cache", primary_chunks=4, disk_chunks=16, real=True), worker="real") as h:
        tier = _tier(h)
        a = _prompt(1, 3 * BLOCK + 1)
        keys = _keys(a)
        assert _serve(h, a).external == 0
        # Cascade: every full chunk is on disk, byte for byte what the forward pass wrote.
        assert [_tier_lookup(h, k) for k in keys] == [LookupResult.HIT] * 3
        for k, block_hash in zip(keys, vh.hash_blocks(a, BLOCK)):
            assert tier.store.read_block(0, k) == h.expected_block_bytes(block_hash)
        assert tier.stats.stored == 3

        _evict_from_primary(h, a, _prompt(2, 3 * BLOCK + 1), _prompt(3, 3 * BLOCK + 1))
        _wipe_gpu(h)
        seen = _record_lookups(h)
        req_id = h.add_request(a, max_tokens=3)
        _until_first_token(h, req_id)
        # The disk hit first defers the request (HIT_PENDING), then the promoted chunk hits.
        first = seen[keys[0]]
        assert LookupResult.HIT_PENDING in first and first[-1] is LookupResult.HIT
        assert first.index(LookupResult.HIT_PENDING) < len(first) - 1
        assert h.prefix_hits[req_id].external == 3 * BLOCK
        matches = h.kv_matches(req_id)
        assert len(matches) == 3 and all(matches), matches
        assert tier.stats.promoted == 3 and tier.stats.promotion_failed == 0
        _run(h)

        stats = h.stats()
        assert stats["tiered_kv_disk_tier_stored_chunks"] >= 9
        assert stats["tiered_kv_disk_tier_promoted_chunks"] == 3
        registry = h.publish_metrics()  # every metric we report is declared to vLLM
        assert registry.get_sample_value("tiered_kv_disk_tier_promoted_chunks_total", {"engine": "0"}) == 3
        info = h.manager.config_info()[1]
        assert info["disk_namespace"] == tier.fingerprint.namespace_id
        assert info["disk_capacity_chunks"] == 16 and info["disk_chunk_bytes"] == CHUNK


def test_disk_tier_evicts_lru_chunks_at_its_byte_bound(model_dir, tmp_path):
    with _build(model_dir, _extra(tmp_path / "cache", primary_chunks=2, disk_chunks=4)) as h:
        tier = _tier(h)
        a, b, c = (_prompt(s, 2 * BLOCK + 1) for s in (4, 5, 6))
        _serve(h, a)
        _serve(h, b)  # the disk (4 chunks) is full: a, b
        h.reset_gpu_prefix_cache()
        assert _serve(h, a).external == 2 * BLOCK  # promoted from disk: a is now recent
        _serve(h, c)  # needs 2 slots: b, the least recently used, goes
        assert [_tier_lookup(h, k) for k in _keys(a)] == [LookupResult.HIT] * 2
        assert [_tier_lookup(h, k) for k in _keys(b)] == [LookupResult.MISS] * 2
        assert [_tier_lookup(h, k) for k in _keys(c)] == [LookupResult.HIT] * 2
        assert tier.stats.evicted == 2 and len(tier.disk_manager) == 4
        slab = tier.store.namespace.slab_path(0)
        assert os.path.getsize(slab) == 4 * CHUNK  # the bound is bytes on disk
        h.reset_gpu_prefix_cache()
        assert _serve(h, b).external == 0  # gone from both tiers: recomputed


def test_a_restart_serves_durable_chunks_without_scanning(model_dir, tmp_path):
    cache = tmp_path / "cache"
    a = _prompt(7, 3 * BLOCK + 1)
    # Leaving the block releases the writer lock; the CPU tier (shared memory) is gone.
    with _build(model_dir, _extra(cache, primary_chunks=8, disk_chunks=16, real=True), worker="real") as h:
        _serve(h, a)
        assert _tier(h).stats.stored == 3

    with _build(model_dir, _extra(cache, primary_chunks=8, disk_chunks=16, real=True), worker="real") as h:
        tier = _tier(h)
        assert len(tier.disk_manager) == 3  # from the index alone ...
        assert tier.store.stats.loads == 0 and tier.store.stats.bytes_read == 0  # ... no data read
        assert all(_primary_lookup(h, k) is LookupResult.MISS for k in _keys(a))
        _wipe_gpu(h)
        req_id = h.add_request(a, max_tokens=3)
        _until_first_token(h, req_id)
        assert h.prefix_hits[req_id].external == 3 * BLOCK
        assert all(h.kv_matches(req_id))
        _run(h)


def test_another_chunk_geometry_gets_its_own_namespace(model_dir, tmp_path):
    cache = tmp_path / "cache"
    a = _prompt(8, 4 * BLOCK + 1)
    with _build(model_dir, _extra(cache, primary_chunks=8, disk_chunks=16)) as h:
        _serve(h, a)
        first_ns = _tier(h).fingerprint.namespace_id
    # Two GPU blocks per chunk: the same prefix makes other bytes per chunk.
    extra = _extra(cache, primary_chunks=8, disk_chunks=16)
    extra["cpu_bytes_to_use"] *= 2
    extra["block_size"] = 2 * BLOCK
    extra["secondary_tiers"][0]["disk_bytes"] = "128KiB"
    with _build(model_dir, extra) as h:
        tier = _tier(h)
        assert tier.fingerprint.namespace_id != first_ns
        assert len(tier.disk_manager) == 0
        assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == sorted(
            [first_ns, tier.fingerprint.namespace_id]
        )


def test_a_corrupted_chunk_becomes_a_miss_without_reaching_vllm(model_dir, tmp_path):
    with _build(model_dir, _extra(tmp_path / "cache", primary_chunks=4, disk_chunks=16, real=True), worker="real") as h:
        tier = _tier(h)
        a = _prompt(9, 3 * BLOCK + 1)
        keys = _keys(a)
        _serve(h, a)
        _evict_from_primary(h, a, _prompt(10, 3 * BLOCK + 1), _prompt(11, 3 * BLOCK + 1))
        # Flip one byte of the middle chunk in its slab slot.
        slot = tier.store.entry(keys[1]).slot
        fd = os.open(tier.store.namespace.slab_path(0), os.O_RDWR)
        try:
            offset = slot * tier.store.slot_size + 1234
            os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x40]), offset)
            os.fsync(fd)
        finally:
            os.close(fd)

        _wipe_gpu(h)
        req_id = h.add_request(a, max_tokens=3)
        _until_first_token(h, req_id)
        # Chunk 0 was promoted; chunk 1 failed its checksum, so the prefix stops there
        # and vLLM recomputes the rest, with the right bytes.
        assert h.prefix_hits[req_id].external == BLOCK
        assert all(h.kv_matches(req_id))
        _run(h)
        assert tier.stats.corrupt == 1 and tier.stats.promotion_failed == 1
        assert tier.stats.failed_promotion_jobs == 1
        assert h.stats()["tiered_kv_disk_tier_corrupt_chunks"] == 1
        # The request's recompute stored the chunk again, from the right bytes.
        assert _tier_lookup(h, keys[1]) is LookupResult.HIT
        assert tier.store.read_block(0, keys[1]) == h.expected_block_bytes(vh.hash_blocks(a, BLOCK)[1])


def test_a_full_disk_fails_the_store_job_and_is_counted(model_dir, tmp_path):
    h = _build(model_dir, _extra(tmp_path / "cache", primary_chunks=4, disk_chunks=16))
    try:
        tier = _tier(h)
        backend = tier.store.backend
        real_pwritev = backend.pwritev

        def enospc(*args):  # fault injection: the device is full
            raise OSError(errno.ENOSPC, "No space left on device")

        backend.pwritev = enospc
        a = _prompt(12, 2 * BLOCK + 1)
        _serve(h, a)  # no exception reaches vLLM
        assert tier.stats.store_failed == 2 and tier.stats.failed_store_jobs == 1
        assert tier.store.stats.enospc == 1
        assert [_tier_lookup(h, k) for k in _keys(a)] == [LookupResult.MISS] * 2
        tier.disk_manager.flush()  # a failed store's slot comes back once its entry is deleted
        assert tier.disk_manager.num_free_slots() == 16
        assert h.stats()["tiered_kv_disk_tier_store_failed_chunks"] == 2

        backend.pwritev = real_pwritev  # space again: the tier carries on
        b = _prompt(13, 2 * BLOCK + 1)
        _serve(h, b)
        assert [_tier_lookup(h, k) for k in _keys(b)] == [LookupResult.HIT] * 2
    finally:
        h.shutdown()


def test_an_unreadable_chunk_becomes_a_miss_instead_of_a_retry_loop(model_dir, tmp_path):
    with _build(model_dir, _extra(tmp_path / "cache", primary_chunks=2, disk_chunks=16)) as h:
        tier = _tier(h)
        a = _prompt(15, 2 * BLOCK + 1)
        _serve(h, a)
        _evict_from_primary(h, a, _prompt(16, 2 * BLOCK + 1))
        backend = tier.store.backend
        real_preadv = backend.preadv

        def eio(*args):  # fault injection: the device fails reads
            raise OSError(errno.EIO, "Input/output error")

        backend.preadv = eio
        h.reset_gpu_prefix_cache()
        req_id = h.add_request(a)
        _run(h)  # a chunk kept after a failed read would be promoted again and again
        assert h.prefix_hits[req_id].external == 0
        assert tier.stats.promotion_failed == 2 and tier.stats.corrupt == 0
        assert tier.stats.failed_promotion_jobs == 1
        backend.preadv = real_preadv


def test_calls_never_wait_for_the_disk_and_a_backlog_is_bounded(model_dir, tmp_path):
    h = _build(model_dir, _extra(tmp_path / "cache", primary_chunks=8, disk_chunks=16, max_pending_disk_writes=2))
    release = threading.Event()
    try:
        tier = _tier(h)
        backend = tier.store.backend
        real_pwritev = backend.pwritev

        def stalled(*args):  # fault injection: a disk that does not answer
            release.wait(60)
            return real_pwritev(*args)

        backend.pwritev = stalled
        a, b = _prompt(17, 2 * BLOCK + 1), _prompt(18, 2 * BLOCK + 1)
        t0 = time.monotonic()
        for prompt in (a, b):
            req_id = h.add_request(prompt)
            for _ in range(10):  # the request finishes; its cascade waits on the disk
                h.step()
            assert req_id not in h.scheduler.requests
        assert time.monotonic() - t0 < 5
        assert not h.scheduler.has_unfinished_requests()
        assert tier.has_pending_work() and h.connector.has_pending_push_work()
        assert _tier_lookup(h, _keys(a)[0]) is LookupResult.MISS  # not visible before durable
        # a's two chunks fill the backlog (max_pending_disk_writes=2): b's are refused.
        assert tier.stats.store_skipped == 2 and tier.stats.failed_store_jobs == 1
        release.set()
        _run(h)
        assert [_tier_lookup(h, k) for k in _keys(a)] == [LookupResult.HIT] * 2
        assert [_tier_lookup(h, k) for k in _keys(b)] == [LookupResult.MISS] * 2
        assert h.stats()["tiered_kv_disk_tier_store_skipped_chunks"] == 2
    finally:
        release.set()
        h.shutdown()


def test_store_jobs_that_queue_up_share_one_sync_and_commit(model_dir, tmp_path):
    h = _build(model_dir, _extra(tmp_path / "cache", primary_chunks=8, disk_chunks=16))
    release = threading.Event()
    rows = None
    try:
        tier = _tier(h)
        rows = np.asarray(h.manager.primary_tier.get_kv_memoryview())
        rows[:4] = np.random.default_rng(0).integers(0, 256, rows[:4].shape, dtype=np.uint8)
        backend = tier.store.backend
        real_pwritev, real_sync = backend.pwritev, backend.sync
        syncs = []

        def stalled(*args):  # fault injection: a slow disk, so jobs queue up behind it
            release.wait(60)
            return real_pwritev(*args)

        backend.pwritev = stalled
        backend.sync = lambda f: (syncs.append(f), real_sync(f))
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
        # Driven directly (not through vLLM's manager, which must not see these jobs).
        with h.manager.lock:
            for i, key in enumerate(keys):
                tier.submit_store(TransferJob(10_000 + i, [key], np.array([i], dtype=np.int32), False, PROBE))
            release.set()
            tier.drain_jobs()
            results = {r.job_id: r for r in tier.get_finished_jobs()}
        assert sorted(results) == [10_000, 10_001, 10_002, 10_003]
        assert all(r.success and r.transfer_bytes == CHUNK for r in results.values())
        # Both store threads were stuck on their first job; the other two went as one group.
        assert len(syncs) < len(keys)
        for i, key in enumerate(keys):
            assert _tier_lookup(h, key) is LookupResult.HIT
            assert tier.store.read_block(0, key) == rows[i].tobytes()
    finally:
        release.set()
        rows = None  # our own view of vLLM's region, or vLLM could not unmap it
        h.shutdown()


def test_tier_config_is_validated_in_human_units(tmp_path):
    cfg = parse_tier_config(
        {
            "type": "TieredDiskTier",
            "module_path": TIER_MODULE,
            "locality": "LOCAL",
            "disk_path": str(tmp_path),
            "disk_bytes": "2GiB",
            "io_backend": "posix",
            "max_pending_disk_writes": 64,
        }
    )
    assert cfg.disk_tier.settings.bytes == 2 * 1024**3 and cfg.disk_tier.settings.io_backend == "posix"
    assert cfg.max_pending_disk_writes == 64
    with pytest.raises(ConfigError, match=r"'disk_byte'.*did you mean 'disk_bytes'"):
        parse_tier_config({"disk_path": str(tmp_path), "disk_byte": "1GiB"})
    with pytest.raises(ConfigError, match=r"disk_bytes: cannot parse size '12 parsecs'"):
        parse_tier_config({"disk_path": str(tmp_path), "disk_bytes": "12 parsecs"})
    with pytest.raises(ConfigError, match=r"cpu_bytes: .*cpu_bytes_to_use"):
        parse_tier_config({"disk_path": str(tmp_path), "cpu_bytes": "1GiB"})
    with pytest.raises(ConfigError, match=r"gpu_copy: .*vLLM's own handlers"):
        parse_tier_config({"disk_path": str(tmp_path), "gpu_copy": "dma"})
    with pytest.raises(ConfigError, match=r"disk_path: required"):
        parse_tier_config({"io_backend": "posix"})
    with pytest.raises(ConfigError, match=r"disk_bytes: set without disk_path"):
        parse_tier_config({"disk_bytes": "1GiB"})


def test_bad_tier_config_fails_vllm_start_up_naming_the_key(model_dir, tmp_path):
    extra = _extra(tmp_path / "cache", primary_chunks=4, disk_chunks=16, io_backed="posix")
    with pytest.raises(ConfigError, match=r"'io_backed'.*did you mean 'io_backend'"):
        _build(model_dir, extra)
    extra = _extra(tmp_path / "cache", primary_chunks=4, disk_chunks=16, hash_algorithm="xxhash")
    with pytest.raises(ConfigError, match=r"hash_algorithm: 'xxhash' does not match .*'sha256'"):
        _build(model_dir, extra)


def test_the_shipped_config_runs_under_vllm(model_dir, tmp_path):
    cfg = json.loads(SHIPPED_CONFIG.read_text())
    assert cfg["kv_connector"] == "OffloadingConnector" and cfg["kv_role"] == "kv_both"
    extra = cfg["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert int(extra["cpu_bytes_to_use"]) == 64 * 1024**3  # vLLM applies int() to it
    (entry,) = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(entry) is TieredDiskTier
    assert parse_tier_config(entry).disk_tier.settings.bytes == 1024**4
    # The frontend process only asks the classes what they will report.
    assert "tiered_kv_disk_tier_corrupt_chunks" in TieringOffloadingSpec.build_metric_definitions(extra)
    assert "disk_namespace" in TieringOffloadingSpec.config_info_keys(extra)
    # The same config, pointed at a test directory and sized for a test, runs as is.
    extra = json.loads(json.dumps(extra))
    extra["cpu_bytes_to_use"] = 4 * CHUNK
    extra["secondary_tiers"][0].update(disk_path=str(tmp_path / "cache"), disk_bytes="64KiB")
    with _build(model_dir, extra) as h:
        a = _prompt(19, 2 * BLOCK + 1)
        _serve(h, a)
        assert [_tier_lookup(h, k) for k in _keys(a)] == [LookupResult.HIT] * 2
