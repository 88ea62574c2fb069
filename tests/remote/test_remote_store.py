"""The shared tier's store against a real S3 server (Ceph RGW on 127.0.0.1): round trips,
write-once, ranks, two nodes sharing a bucket, foreign and damaged objects, membership."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from itertools import pairwise

import numpy as np
import pytest
from support.s3_server import FaultProxy, skip_module_without_rgw

from tiered_kv.fingerprint import Fingerprint
from tiered_kv.remote import (
    MembershipCache,
    MembershipProber,
    PutOutcome,
    RemoteConfig,
    RemoteStore,
)
from tiered_kv.remote.format.object_format import block_key

skip_module_without_rgw()

FP = Fingerprint("org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), 1, "sha256", "")
WAIT = 120  # seconds: a hang guard on futures, far beyond any request timeout


def blocks(n: int, size: int = 64 << 10, seed: int = 0, rank: int = 0) -> list[tuple[bytes, int, bytes]]:
    rng = np.random.default_rng(seed)
    return [(rng.bytes(32), rank, rng.bytes(size)) for _ in range(n)]


def read_back(store: RemoteStore, items, size: int | None = None) -> tuple[list[bool], list[bytearray]]:
    bufs = [bytearray(size if size is not None else len(data)) for _, _, data in items]
    hits = store.get_blocks([(h, r, b) for (h, r, _), b in zip(items, bufs)]).result(WAIT)
    return hits, bufs


@pytest.fixture
def config(remote_settings) -> RemoteConfig:
    return RemoteConfig.from_dict(remote_settings)


@pytest.fixture
def store(config):
    with RemoteStore(config, FP) as s:
        yield s


def test_round_trip_is_byte_exact_and_write_once(store):
    items = blocks(12, size=300_001)  # odd size: nothing relies on alignment
    assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 12
    hits, bufs = read_back(store, items)
    assert hits == [True] * 12
    assert all(bytes(b) == data for b, (_, _, data) in zip(bufs, items))
    # The same blocks again (another node, or a retry) leave the stored objects as they are.
    other = [(h, r, bytes(len(d))) for h, r, d in items]
    assert store.put_blocks(other).result(WAIT) == [PutOutcome.PRESENT] * 12
    hits, bufs = read_back(store, items)
    assert all(bytes(b) == data for b, (_, _, data) in zip(bufs, items))
    s = store.stats()
    assert (s.puts_stored, s.puts_present, s.gets_hit, s.put_bytes) == (12, 12, 24, 12 * 300_001)


def test_missing_block_is_a_miss_and_leaves_the_buffer_alone(store):
    ((h, r, data),) = blocks(1)
    buf = bytearray(b"\xaa" * len(data))
    assert store.get_blocks([(h, r, buf)]).result(WAIT) == [False]
    assert buf == b"\xaa" * len(data)
    assert store.stats().gets_absent == 1
    assert store.exists([h]).result(WAIT) == [False]


def test_buffers_of_any_contiguous_kind(store):
    arr = np.arange(4096, dtype=np.float16)
    assert store.put_blocks([(b"np", 0, arr), (b"mv", 0, memoryview(arr.tobytes()))]).result(WAIT) == [
        PutOutcome.STORED,
        PutOutcome.STORED,
    ]
    out = np.zeros_like(arr)
    assert store.get_blocks([(b"np", 0, out)]).result(WAIT) == [True]
    assert np.array_equal(out, arr)


def test_a_block_in_pieces_goes_and_comes_back_where_it_lies(store):
    """A CPU slot in several pieces (per-layer tensors) needs no packing either way."""
    ((h, r, data),) = blocks(1, size=96 << 10)
    cuts = [0, 1000, 40_000, 40_000, len(data)]
    pieces = [memoryview(data)[a:b] for a, b in pairwise(cuts)]
    assert store.put_blocks([(h, r, pieces)]).result(WAIT) == [PutOutcome.STORED]
    hits, (whole,) = read_back(store, [(h, r, data)])
    assert hits == [True] and whole == data
    out = bytearray(len(data))
    parts = [memoryview(out)[a:b] for a, b in pairwise(cuts)]
    assert store.get_blocks([(h, r, parts)]).result(WAIT) == [True]
    assert out == data


def test_copy_lets_the_caller_reuse_its_buffer_at_once(store):
    buf = bytearray(b"\x01" * 50_000)
    future = store.put_blocks([(b"copied", 0, buf)], copy=True)
    buf[:] = b"\x02" * 50_000  # a CPU slot reused before the upload finished
    assert future.result(WAIT) == [PutOutcome.STORED]
    hits, (back,) = read_back(store, [(b"copied", 0, bytes(50_000))])
    assert hits == [True] and back == b"\x01" * 50_000


def test_bad_arguments_raise_clear_errors(store):
    with pytest.raises(ValueError, match=r"put_blocks\[0\]: rank must be in 0..0 \(tp_size 1\), got 1"):
        store.put_blocks([(b"h", 1, b"x")])
    with pytest.raises(TypeError, match=r"put_blocks\[1\]: block hash must be non-empty bytes"):
        store.put_blocks([(b"h", 0, b"x"), ("h", 0, b"x")])
    with pytest.raises(TypeError, match=r"get_blocks\[0\]: expected a bytes-like object"):
        store.get_blocks([(b"h", 0, [0, 1])])
    with pytest.raises(ValueError, match=r"get_blocks\[0\]: the buffer is read-only"):
        store.get_blocks([(b"h", 0, b"read-only")])
    with pytest.raises(ValueError, match=r"put_blocks\[0\]: no bytes"):
        store.put_blocks([(b"h", 0, [])])
    with pytest.raises(ValueError, match="C-contiguous"):
        store.put_blocks([(b"h", 0, np.zeros((4, 4), np.uint8)[:, ::2])])
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put_blocks([(b"h", 0, b"x")])


def test_a_block_is_present_only_with_every_rank(config):
    fp2 = dataclasses.replace(FP, tp_size=2)
    with RemoteStore(config, fp2) as store:
        (h, _, r0), (_, _, r1) = blocks(2)
        assert store.put_blocks([(h, 0, r0)]).result(WAIT) == [PutOutcome.STORED]
        assert store.exists([h]).result(WAIT) == [False]
        assert store.exists([h], ranks=[0]).result(WAIT) == [True]
        assert store.put_blocks([(h, 1, r1)]).result(WAIT) == [PutOutcome.STORED]
        assert store.exists([h]).result(WAIT) == [True]
        hits, bufs = read_back(store, [(h, 0, r0), (h, 1, r1)])
        assert hits == [True, True] and bufs == [r0, r1]


def _node_a(settings: dict, items: list, env: dict) -> list[str]:
    os.environ.update(env)
    with RemoteStore(RemoteConfig.from_dict(settings), FP) as store:
        return [o.value for o in store.put_blocks(items).result(WAIT)]


def test_two_nodes_share_a_bucket(remote_settings, config):
    items = blocks(16, size=1 << 20, seed=7)
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "TIERED_KV_"))}
    with multiprocessing.get_context("spawn").Pool(1) as node_a:
        assert node_a.apply(_node_a, (remote_settings, items, env)) == ["stored"] * 16
    with RemoteStore(config, FP) as node_b:
        assert node_b.exists([h for h, _, _ in items]).result(WAIT) == [True] * 16
        hits, bufs = read_back(node_b, items)
        assert hits == [True] * 16
        assert all(bytes(b) == data for b, (_, _, data) in zip(bufs, items))
        assert node_b.put_blocks(items[:2]).result(WAIT) == [PutOutcome.PRESENT] * 2


def test_another_fingerprint_never_reads_the_blocks(config, rgw_server):
    items = blocks(4)
    with RemoteStore(config, FP) as a:
        a.put_blocks(items).result(WAIT)
    for field, value in (("dtype", "bfloat16"), ("hash_seed", "1234"), ("model_id", "org/other")):
        other = dataclasses.replace(FP, **{field: value})
        with RemoteStore(config, other) as b:
            assert b.exists([h for h, _, _ in items]).result(WAIT) == [False] * 4
            hits, bufs = read_back(b, items)
            assert hits == [False] * 4 and all(not any(buf) for buf in bufs)


def test_a_foreign_object_under_our_key_is_refused_and_counted(config, rgw_server):
    """An object copied in from another namespace (or a colliding id) fails the header's
    full fingerprint check."""
    import obstore

    other = dataclasses.replace(FP, dtype="bfloat16")
    ((h, r, data),) = blocks(1)
    with RemoteStore(config, other) as a, RemoteStore(config, FP) as b:
        a.put_blocks([(h, r, data)]).result(WAIT)
        raw = a._client.raw
        obstore.copy(raw, block_key(a.namespace, h, r), block_key(b.namespace, h, r))
        assert b.exists([h]).result(WAIT) == [True]  # the object is there ...
        hits, (buf,) = read_back(b, [(h, r, data)])
        assert hits == [False] and not any(buf)  # ... and is not served
        assert b.stats().rejected["foreign"] == 1


@pytest.mark.parametrize("trusted", [False, True], ids=["sealed", "plain"])
def test_a_damaged_object_is_a_counted_miss_and_is_stored_again(remote_settings, trusted):
    """Sealed, the tag fails; plain (a trusted bucket, no key), the checksum does."""
    import obstore

    settings = {**remote_settings, "key_env": None, "trusted_bucket": True} if trusted else remote_settings
    with RemoteStore(RemoteConfig.from_dict(settings), FP) as store:
        _damaged_object_round(store, obstore, "checksum" if trusted else "auth")


def _damaged_object_round(store, obstore, reason: str) -> None:
    ((h, r, data),) = blocks(1, size=100_000)
    store.put_blocks([(h, r, data)]).result(WAIT)
    key = block_key(store.namespace, h, r)
    raw = store._client.raw
    damaged = bytearray(obstore.get(raw, key).bytes())
    damaged[-5000] ^= 0x10  # one bit of the payload
    obstore.put(raw, key, bytes(damaged), mode="overwrite")
    hits, (buf,) = read_back(store, [(h, r, data)])
    assert hits == [False] and not any(buf)
    s = store.stats()
    assert s.rejected[reason] == 1 and s.damaged_deleted == 1
    # Deleted, so the next node that computes the block stores it whole again.
    assert store.put_blocks([(h, r, data)]).result(WAIT) == [PutOutcome.STORED]
    hits, (buf,) = read_back(store, [(h, r, data)])
    assert hits == [True] and buf == data


def test_a_buffer_of_another_size_is_a_miss(store):
    ((h, r, data),) = blocks(1)
    store.put_blocks([(h, r, data)]).result(WAIT)
    hits, (buf,) = read_back(store, [(h, r, data)], size=len(data) + 1)
    assert hits == [False] and not any(buf)
    assert store.stats().rejected["size"] == 1
    assert store.exists([h]).result(WAIT) == [True]  # a caller's mistake deletes nothing


def test_uploads_past_the_pending_bound_are_dropped_not_queued(rgw_server, remote_settings):
    """Behind a server that never answers, three blocks fill the bound; the other seven
    are dropped at once rather than queued behind them."""
    with FaultProxy(rgw_server.endpoint.removeprefix("http://")) as proxy:
        config = RemoteConfig.from_dict(
            {
                **remote_settings,
                "endpoint": proxy.endpoint,
                "max_pending_upload_bytes": "300000B",
                "request_timeout": "3s",
                "retries": 0,
                "failure_threshold": 100,
            }
        )
        with RemoteStore(config, FP) as store:
            proxy.set_mode("stall")
            future = store.put_blocks(blocks(10, size=100_000))
            assert store.pending_upload_bytes == 300_000
            assert future.result(WAIT) == [PutOutcome.FAILED] * 3 + [PutOutcome.DROPPED] * 7
            s = store.stats()
            assert (s.puts_failed, s.puts_dropped) == (3, 7)
            assert store.pending_upload_bytes == 0


def test_membership_prober_fills_the_cache_without_blocking(config):
    items = blocks(6)
    hashes = [h for h, _, _ in items]
    with RemoteStore(config, FP) as writer, RemoteStore(config, FP) as scheduler_side:
        writer.put_blocks(items[:4]).result(WAIT)
        cache = MembershipCache(absent_ttl=config.absent_ttl)
        prober = MembershipProber(scheduler_side, cache)
        first = prober.lookup(hashes)
        assert first.hits == 0 and first.pending
        assert prober.wait_idle(WAIT)
        assert prober.lookup(hashes) == (4, False)  # blocks 4, 5 are known absent now
        sent = prober.probes_sent
        assert prober.lookup(hashes) == (4, False) and prober.probes_sent == sent  # no request: cached
        # Our own uploads are known at once.
        writer.put_blocks(items[4:]).result(WAIT)
        cache.mark_present(hashes[4:])
        assert prober.lookup(hashes) == (6, False)
