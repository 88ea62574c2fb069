"""The shared tier on a real Mooncake Store (tests/support/mooncake_server.py: ``mooncake_master``
and a standalone ``mooncake_client`` on 127.0.0.1): the client's mapping of Mooncake's
semantics, the store's round trips in both transfer modes, foreign and damaged objects,
two engine processes sharing the pool byte for byte, and the master or the client killed
mid-run costing misses, never an error or a stall."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.mooncake_server import skip_module_without_mooncake

skip_module_without_mooncake()

from support.remote_node import BLOCKS_PER_REQUEST, build, requests  # noqa: E402

from tiered_kv.config import ConfigError  # noqa: E402
from tiered_kv.fingerprint import Fingerprint  # noqa: E402
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore  # noqa: E402
from tiered_kv.remote.store.client import WrongSize  # noqa: E402
from tiered_kv.remote.store.mooncake_client import ListingUnsupported, MooncakeClient, ObjectTooLarge  # noqa: E402
from tiered_kv.remote.format.object_format import block_key, object_size  # noqa: E402
from tiered_kv.remote.store.store import GET_BATCH, GET_BATCH_BYTES  # noqa: E402
from tiered_kv.remote.tier import REMOTE  # noqa: E402

FP = Fingerprint("org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), 1, "sha256", "")
WAIT = 120
NODE = Path(__file__).resolve().parents[1] / "support" / "remote_node.py"


def blocks(n: int, size: int = 64 << 10, seed: int = 0) -> list[tuple[bytes, int, bytes]]:
    rng = np.random.default_rng(seed)
    return [(rng.bytes(32), 0, rng.bytes(size)) for _ in range(n)]


def read_back(store: RemoteStore, items) -> tuple[list[bool], list[bytearray]]:
    bufs = [bytearray(len(data)) for _, _, data in items]
    hits = store.get_blocks([(h, r, b) for (h, r, _), b in zip(items, bufs)]).result(WAIT)
    return hits, bufs


@pytest.fixture(params=[True, False], ids=["zero-copy", "copy"])
def config(request, mooncake_server) -> RemoteConfig:
    return RemoteConfig.from_dict(mooncake_server.settings(mooncake_zero_copy=request.param))


def test_client_maps_mooncake_semantics(config):
    with MooncakeClient(config) as client:
        key = f"{config.prefix}/k"
        assert client.get(key) is None and client.get(key, 10) is None and not client.exists(key)
        assert client.put_new(key, [b"head", memoryview(b"-first")])
        assert bytes(client.get(key, 10)) == b"head-first" and client.exists(key)
        # Write-once: a second put_new reports the object there and leaves it; put replaces
        # (Mooncake's own put keeps a key's first value), at any size.
        assert not client.put_new(key, [b"other value"])
        assert bytes(client.get(key)) == b"head-first"
        client.put(key, [b"head-", memoryview(b"other")])
        assert bytes(client.get(key)) == b"head-other"
        client.put(key, [b"longer", b"-value"])
        assert bytes(client.get(key)) == b"longer-value"
        # A replacing write refused before it is sent leaves the object that was there.
        with pytest.raises(ObjectTooLarge, match="mooncake_buffer_bytes"):
            client.put(key, [bytes(config.mooncake_buffer_bytes + 1)])
        assert bytes(client.get(key)) == b"longer-value"
        client.put(key, [b"head-other"])
        with pytest.raises(WrongSize) as wrong:
            client.get(key, 8)
        assert wrong.value.size == 10
        with pytest.raises(WrongSize):
            client.get(key, 12)
        client.delete(key)
        client.delete(key)  # deleting a missing key is not an error
        assert client.get(key, 10) is None
        with pytest.raises(ObjectTooLarge, match="mooncake_buffer_bytes"):
            client.put(key, [bytes(config.mooncake_buffer_bytes + 1)])
        with pytest.raises(ListingUnsupported, match="cannot list"):
            list(client.list(config.prefix))


def test_round_trip_is_byte_exact_and_write_once(config):
    with RemoteStore(config, FP) as store:
        items = blocks(12, size=300_001)
        assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 12
        hits, bufs = read_back(store, items)
        assert hits == [True] * 12 and all(bytes(b) == d for b, (_, _, d) in zip(bufs, items))
        other = [(h, r, bytes(len(d))) for h, r, d in items]
        assert store.put_blocks(other).result(WAIT) == [PutOutcome.PRESENT] * 12
        hits, bufs = read_back(store, items)
        assert all(bytes(b) == d for b, (_, _, d) in zip(bufs, items))
        missing = blocks(1, seed=99)
        assert read_back(store, missing)[0] == [False] and store.stats().gets_absent == 1
        assert store.exists([h for h, _, _ in items] + [missing[0][0]]).result(WAIT) == [True] * 12 + [False]


def test_a_requests_blocks_are_probed_many_to_a_request(mooncake_server):
    """Mooncake answers many existence checks at once (``batch_is_exist``): the store asks
    up to ``PROBE_BATCH`` keys (blocks times ranks) per request, each answer in its place,
    a block whose ranks fall in two requests included."""
    config = RemoteConfig.from_dict(mooncake_server.settings())
    three_ranks = dataclasses.replace(FP, tp_size=3)
    with RemoteStore(config, three_ranks) as store:
        rng = np.random.default_rng(5)
        hashes = [rng.bytes(32) for _ in range(400)]
        whole, half = hashes[340:343], hashes[343:345]  # block 341's keys are the 1,024th to 1,026th
        items = [(h, r, rng.bytes(4096)) for h in whole for r in range(3)] + [(h, 0, rng.bytes(4096)) for h in half]
        assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * len(items)
        store.latencies.drain()
        found = store.exists(hashes).result(WAIT)
        assert found == [False] * 340 + [True] * 3 + [False] * 57  # every rank's object, or False
        heads = [o for o in store.latencies.drain() if o[1] == ("head",)]
        assert len(heads) == 2, "1,200 keys in two requests (1,024 + 176)"
        assert store.exists(half, ranks=[0]).result(WAIT) == [True, True]
        assert store.stats().probes == 1202 and store.stats().probes_failed == 0


def test_a_requests_blocks_are_read_many_to_a_request_each_judged_alone(config, mooncake_server):
    """Mooncake sends many objects at once (``batch_get_into``, or ``get_batch`` without
    zero copy): the store reads up to ``GET_BATCH`` objects and ``GET_BATCH_BYTES`` per
    request, each verified into its own buffer; an absent object is a miss among hits, and
    one cut short is read again alone, judged malformed and deleted."""
    items = blocks(100, size=300_000, seed=11)
    with RemoteStore(config, FP) as store:
        assert store.put_blocks(items[:-1]).result(WAIT) == [PutOutcome.STORED] * 99
        raw = mooncake_server.raw_client()
        try:
            key = block_key(store.namespace, items[40][0], 0)
            truncated = bytes(raw.get(key))[:-1000]
            assert raw.remove(key, True) == 0 and raw.put(key, truncated) == 0
        finally:
            raw.close()
        store.latencies.drain()
        hits, bufs = read_back(store, items)
        assert hits == [i not in (40, 99) for i in range(100)]
        assert all(bytes(b) == d for i, (b, (_, _, d)) in enumerate(zip(bufs, items)) if hits[i])
        assert not any(bufs[40]) and not any(bufs[99])
        per_batch = GET_BATCH_BYTES // object_size(True, 32, 300_000)
        assert per_batch < 100 <= 2 * per_batch <= 2 * GET_BATCH
        gets = [o for o in store.latencies.drain() if o[1] == ("get",)]
        # Two batches, and the cut object read alone: its size first, then up to twice the block's.
        assert len(gets) == 2 + 2, gets
        s = store.stats()
        assert (s.gets_hit, s.gets_absent, s.rejected["format"], s.damaged_deleted) == (98, 1, 1, 1)
        assert store.exists([items[40][0]]).result(WAIT) == [False]


def test_a_fault_inside_a_batched_read_fails_its_blocks_and_raises_nothing(config, monkeypatch, caplog):
    """Faults never raise out of ``get_blocks``: a batch whose request fails, and a block
    whose verification fails in an unforeseen way (injected), are counted failed reads."""
    from tiered_kv.remote.store import store as store_module

    items = blocks(3, seed=12)
    with RemoteStore(config, FP) as store:
        assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 3
        calls = []

        def broken_verify(*args, **kwargs):  # fault injection: a bug below the store
            calls.append(args)
            raise RuntimeError("injected")

        with monkeypatch.context() as m:
            m.setattr(store_module, "verify_into", broken_verify)
            assert read_back(store, items)[0] == [False] * 3 and len(calls) == 3
        assert store.stats().gets_failed == 3 and "injected" in caplog.text
        with monkeypatch.context() as m:
            m.setattr(store._client.inner, "get_many", lambda keys, sizes: 1 / 0)
            assert read_back(store, items)[0] == [False] * 3
        assert store.stats().gets_failed == 6
        hits, bufs = read_back(store, items)
        assert hits == [True] * 3 and [bytes(b) for b in bufs] == [d for _, _, d in items]


def test_another_fingerprint_never_reads_the_blocks(config):
    items = blocks(4, seed=1)
    with RemoteStore(config, FP) as a:
        a.put_blocks(items).result(WAIT)
    with RemoteStore(config, dataclasses.replace(FP, dtype="bfloat16")) as b:
        assert b.exists([h for h, _, _ in items]).result(WAIT) == [False] * 4
        hits, bufs = read_back(b, items)
        assert hits == [False] * 4 and not any(any(buf) for buf in bufs)


def test_a_foreign_object_under_our_key_is_refused_and_counted(config, mooncake_server):
    ((h, r, data),) = blocks(1, seed=2)
    other = dataclasses.replace(FP, hash_seed="another")
    with RemoteStore(config, other) as a, RemoteStore(config, FP) as b:
        a.put_blocks([(h, r, data)]).result(WAIT)
        raw = mooncake_server.raw_client()
        try:
            foreign = raw.get(block_key(a.namespace, h, r))
            assert raw.put(block_key(b.namespace, h, r), foreign) == 0
        finally:
            raw.close()
        assert b.exists([h]).result(WAIT) == [True]
        hits, (buf,) = read_back(b, [(h, r, data)])
        assert hits == [False] and not any(buf)
        assert b.stats().rejected["foreign"] == 1


def test_a_damaged_object_is_a_counted_miss_and_is_stored_again(config, mooncake_server):
    ((h, r, data),) = blocks(1, size=100_000, seed=3)
    with RemoteStore(config, FP) as store:
        store.put_blocks([(h, r, data)]).result(WAIT)
        key = block_key(store.namespace, h, r)
        raw = mooncake_server.raw_client()
        try:
            damaged = bytearray(raw.get(key))
            damaged[-5000] ^= 0x10
            assert raw.remove(key, True) == 0 and raw.put(key, bytes(damaged)) == 0
        finally:
            raw.close()
        hits, (buf,) = read_back(store, [(h, r, data)])
        assert hits == [False] and not any(buf)
        s = store.stats()
        assert s.rejected["checksum"] == 1 and s.damaged_deleted == 1
        assert store.put_blocks([(h, r, data)]).result(WAIT) == [PutOutcome.STORED]
        hits, (buf,) = read_back(store, [(h, r, data)])
        assert hits == [True] and buf == data


def test_config_names_the_bad_mooncake_key(mooncake_server):
    with pytest.raises(ConfigError, match=r"remote\.mooncake_protocol"):
        RemoteConfig.from_dict(mooncake_server.settings(mooncake_protocol="udp"), key_prefix="remote.")
    with pytest.raises(ConfigError, match=r"remote\.backend"):
        RemoteConfig.from_dict({"backend": "redis"}, key_prefix="remote.")


def test_absent_master_is_a_miss_at_once_not_a_start_up_error(mooncake_server):
    config = RemoteConfig.from_dict(mooncake_server.settings(mooncake_master="127.0.0.1:1"))
    with RemoteStore(config, FP) as store:
        assert not store.reachable
        items = blocks(2, seed=4)
        assert not any(o.durable for o in store.put_blocks(items).result(WAIT))
        assert read_back(store, items)[0] == [False, False]


def _run_node(settings: dict) -> dict:
    done = subprocess.run(
        [sys.executable, str(NODE), json.dumps(settings)], capture_output=True, text=True, timeout=600, env=os.environ
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_nodes_share_the_pool_byte_exact_and_other_fingerprints_never_read_it(tmp_path, mooncake_server):
    n = 10 * BLOCKS_PER_REQUEST
    common = {"remote": mooncake_server.settings(), "first": 0, "count": 10}
    a = _run_node({**common, "cache_dir": str(tmp_path / "a")})
    assert a["computed"] == n and a["remote"]["confirmed"] == n and a["puts_stored"] == n

    b = _run_node({**common, "cache_dir": str(tmp_path / "b"), "expecting": True})
    assert b["namespace"] == a["namespace"]
    assert b["hits_by_medium"] == {REMOTE: n}, b
    assert b["computed"] == 0 and b["mismatches"] == 0  # every block A computed, byte-exact
    assert b["gets_hit"] == n and b["puts_stored"] == 0

    c = _run_node({**common, "cache_dir": str(tmp_path / "c"), "expecting": True, "dtype": "bfloat16"})
    assert c["namespace"] != a["namespace"]
    assert c["hits_by_medium"] == {} and c["computed"] == n and c["gets_hit"] == 0 and c["gets_rejected"] == 0


def _only_remote(node, reqs) -> int:
    return sum(node.driver.manager.hit_medium(h) == REMOTE for r in reqs for h in r)


FAULT_SETTINGS = {"retries": 0, "failure_threshold": 2, "unavailable_cooldown": "1s"}
#: Requests sent while the master was down fail after its RPC timeout (about 4 s), and
#: the last of them may land after the restart: past this, none is left in flight.
RPC_TIMEOUT = 5.0


def test_master_restart_loses_the_pool_as_misses_and_the_engine_keeps_serving(tmp_path, mooncake_server):
    with build(tmp_path / "cache", mooncake_server.settings(**FAULT_SETTINGS)) as node:
        node.run(requests(0, 12))
        assert node.remote.counters["confirmed"] == 12 * BLOCKS_PER_REQUEST
        assert _only_remote(node, requests(0, 4)) > 0
        mooncake_server.kill_master()
        try:
            during = node.run(requests(0, 2) + requests(100, 2))
        finally:
            mooncake_server.start_master()
            mooncake_server.wait_writable()
            time.sleep(RPC_TIMEOUT)
        assert during.mismatches == 0 and during.hits_by_medium.get(REMOTE, 0) == 0
        assert during.computed + during.offload_hits == 4 * BLOCKS_PER_REQUEST
        # Back up, and empty: what the pool held is gone, as misses, never an error.
        failed = node.tier.store.stats().gets_failed
        after = node.run(requests(2, 2))
        assert after.mismatches == 0 and after.hits_by_medium.get(REMOTE, 0) == 0
        assert after.computed + after.offload_hits == 2 * BLOCKS_PER_REQUEST
        assert node.tier.store.stats().gets_failed == failed
        # New blocks land in the restarted pool again, and are served from it.
        node.run(requests(200, 12))
        again = node.run(requests(200, 4))
        assert again.mismatches == 0 and again.hits_by_medium.get(REMOTE, 0) > 0, again
        assert node.remote.num_pending() == 0


def test_holding_client_killed_costs_misses_never_a_crash(tmp_path, mooncake_server):
    with build(tmp_path / "cache", mooncake_server.settings(**FAULT_SETTINGS)) as node:
        node.run(requests(300, 12))
        assert _only_remote(node, requests(300, 4)) > 0
        mooncake_server.kill_client()
        try:
            during = node.run(requests(300, 4) + requests(400, 2))
        finally:
            mooncake_server.start_client()
            mooncake_server.wait_writable()
            time.sleep(RPC_TIMEOUT)
        assert during.mismatches == 0 and during.hits_by_medium.get(REMOTE, 0) == 0
        assert during.recomputed_after_failed_load + during.computed > 0
        assert during.computed + during.offload_hits == 6 * BLOCKS_PER_REQUEST
        assert node.remote.num_pending() == 0


@pytest.mark.parametrize("who", ["master", "client"])
def test_a_hung_master_or_holder_costs_misses_by_the_request_deadline(mooncake_server, who):
    """A hung daemon (stopped, its sockets open) answers nothing: Mooncake's own transfer
    timeout is about 30 s; reads and probes are misses by the store's deadline, and an
    answer that comes later writes nothing into the caller's buffers."""
    import signal

    settings = mooncake_server.settings(request_timeout="1s", connect_timeout="0.5s", retries=0)
    store = RemoteStore(RemoteConfig.from_dict(settings), FP)
    items = blocks(4, seed=7)
    assert all(o.durable for o in store.put_blocks(items).result(WAIT))
    proc = getattr(mooncake_server, who)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        bufs = [bytearray(len(data)) for _, _, data in items]
        got = store.get_blocks([(h, r, b) for (h, r, _), b in zip(items, bufs)])
        known = store.exists([h for h, _, _ in items])
        # Probes ask the master only: with the holder hung it still answers.
        assert got.result(WAIT) == [False] * 4 and known.result(WAIT) == [None if who == "master" else True] * 4
        waited = time.monotonic() - start
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert waited < 1.5 + 5, f"{waited:.1f} s: the deadline is 1.5 s"
    assert store.stats().gets_failed == 4 and store.stats().probes_failed == (4 if who == "master" else 0)
    time.sleep(RPC_TIMEOUT)  # the hung requests' late answers land: in no caller's buffer
    assert not any(any(b) for b in bufs)
    hits, bufs = read_back(store, items)
    assert hits == [True] * 4 and [bytes(b) for b in bufs] == [data for _, _, data in items]
    store.close()


def test_doctor_checks_the_master_answers(mooncake_server):
    from tiered_kv.config import TieredConfig
    from tiered_kv.ops import doctor as dr

    # The test store is a trusted pool without a key: a warning, as a keyless S3 bucket's.
    up = dr.check_remote(TieredConfig.from_dict({"remote": mooncake_server.settings()}))
    assert up.status == dr.WARN and mooncake_server.master_address in up.message and "plaintext" in up.message
    assert up.facts["backend"] == "mooncake"
    down = dr.check_remote(TieredConfig.from_dict({"remote": mooncake_server.settings(mooncake_master="127.0.0.1:1")}))
    assert down.status == dr.WARN and "no Mooncake master answers at 127.0.0.1:1" in down.message


def test_inspect_remote_says_it_reads_s3_only(mooncake_server, tmp_path):
    from typer.testing import CliRunner

    from tiered_kv.cli import _load_commands, app

    _load_commands()
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"remote": mooncake_server.settings()}))
    result = CliRunner().invoke(app, ["inspect", "summary", "--remote", str(config)])
    assert result.exit_code == 2, result.output
    assert "Mooncake Store" in result.output and "S3 buckets only" in result.output
    assert "Traceback" not in result.output


@pytest.fixture
def sealed(mooncake_server, monkeypatch) -> RemoteConfig:
    """A shared tier on the pool with a fleet key (sealed objects)."""
    monkeypatch.setenv("MOONCAKE_FLEET_KEY", "5f" * 32)
    return RemoteConfig.from_dict(mooncake_server.settings(trusted_bucket=False, key_env="MOONCAKE_FLEET_KEY"))


def _raw_put(mooncake_server, key: str, value: bytes) -> None:
    raw = mooncake_server.raw_client()
    try:
        assert raw.put(key, value) == 0
    finally:
        raw.close()


def test_a_planted_forgery_is_replaced_by_the_honest_write_and_counted_once_verified(sealed, mooncake_server):
    """Mooncake keeps a key's first value: the replacing write removes it first, and the
    replacement counts only once it reads back verified."""
    items = blocks(2, size=80_000, seed=31)
    with RemoteStore(sealed, FP) as store:
        size = len(items[0][2]) + 32 + 16 + 90  # about an object's size: a forgery need not match
        for h, r, _ in items:
            _raw_put(mooncake_server, block_key(store.namespace, h, r), os.urandom(size))
        assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 2
        assert store.stats().forgeries_replaced == 2
        hits, bufs = read_back(store, items)
        assert hits == [True] * 2 and [bytes(b) for b in bufs] == [d for _, _, d in items]


def test_a_copied_object_is_gone_after_the_first_read(sealed, mooncake_server):
    (a, b) = blocks(2, size=50_000, seed=32)
    with RemoteStore(sealed, FP) as store:
        store.put_blocks([a]).result(WAIT)
        raw = mooncake_server.raw_client()
        try:
            honest_a = raw.get(block_key(store.namespace, a[0], a[1]))
            assert raw.put(block_key(store.namespace, b[0], b[1]), honest_a) == 0  # a's object at b's key
        finally:
            raw.close()
        hits, (buf,) = read_back(store, [b])
        assert hits == [False] and not any(buf)
        s = store.stats()
        assert s.rejected["mismatch"] == 1 and s.damaged_deleted == 1
        assert store.exists([b[0]]).result(WAIT) == [False]  # no miss pinned beyond that read
        assert store.put_blocks([b]).result(WAIT) == [PutOutcome.STORED]
        assert read_back(store, [a, b])[0] == [True, True]


def test_a_wrong_key_member_leaves_the_fleets_objects(sealed, mooncake_server, monkeypatch):
    items = blocks(3, size=40_000, seed=33)
    monkeypatch.setenv("WRONG_FLEET_KEY", "a7" * 32)
    wrong_config = dataclasses.replace(sealed, key_env="WRONG_FLEET_KEY")
    with RemoteStore(sealed, FP) as fleet, RemoteStore(wrong_config, FP) as wrong:
        assert fleet.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 3
        assert wrong.put_blocks(items).result(WAIT) == [PutOutcome.PRESENT] * 3
        assert read_back(wrong, items)[0] == [False] * 3
        s = wrong.stats()
        assert s.kept_unproven == 6 and s.forgeries_replaced == 0 and s.damaged_deleted == 0
        hits, bufs = read_back(fleet, items)
        assert hits == [True] * 3 and [bytes(x) for x in bufs] == [d for _, _, d in items]


def test_set_ups_the_master_answers_but_that_fail_back_off(mooncake_server):
    """The master's RPC port answers but the metadata server does not: each failed
    set-up keeps Mooncake's sockets, so the tries space out, doubling from the cooldown,
    rather than one per ``unavailable_cooldown`` for as long as the outage lasts."""
    from tiered_kv.remote.store.client import Unavailable

    settings = mooncake_server.settings(mooncake_metadata_server="http://127.0.0.1:1/metadata")
    cfg = RemoteConfig.from_dict({**settings, "unavailable_cooldown": "1s"})
    client = MooncakeClient(cfg)
    try:
        waits = []
        for _ in range(3):
            waits.append(client._retry_at - time.monotonic())
            assert client.setup_error is not None and "setup returned" in client.setup_error
            client._retry_at = 0.0  # the wait is over
            with pytest.raises(Unavailable):
                client.exists("k")
        assert 0.5 < waits[0] <= 1.0 and 1.5 < waits[1] <= 2.0 and 3.5 < waits[2] <= 4.0, waits
    finally:
        client.close()


def test_a_truncated_object_is_proven_bad_and_a_caller_s_wrong_size_deletes_nothing(config, mooncake_server):
    """Of another size than the block's object, an object is read (the zero-copy read
    stops short of it) and judged: cut short, it is malformed and deleted, and the next
    write stores the block; a caller whose buffer is a byte larger deletes nothing."""
    ((h, r, data),) = blocks(1, size=100_000, seed=4)
    with RemoteStore(config, FP) as store:
        store.put_blocks([(h, r, data)]).result(WAIT)
        hits, _ = read_back(store, [(h, r, data + b"x")])
        assert hits == [False] and store.stats().rejected["size"] == 1 and store.stats().damaged_deleted == 0
        key = block_key(store.namespace, h, r)
        raw = mooncake_server.raw_client()
        try:
            truncated = bytes(raw.get(key))[:-3000]
            assert raw.remove(key, True) == 0 and raw.put(key, truncated) == 0
        finally:
            raw.close()
        hits, (buf,) = read_back(store, [(h, r, data)])
        s = store.stats()
        assert hits == [False] and not any(buf) and s.rejected["format"] == 1 and s.damaged_deleted == 1
        assert store.exists([h]).result(WAIT) == [False]
        assert store.put_blocks([(h, r, data)]).result(WAIT) == [PutOutcome.STORED]
        assert read_back(store, [(h, r, data)]) == ([True], [bytearray(data)])
