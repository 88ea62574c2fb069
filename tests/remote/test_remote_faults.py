"""Faults of the shared tier with a real S3 server (Ceph RGW on 127.0.0.1): the server
killed mid-run, throttling (503 SlowDown) and silence through a proxy, a server down at
start-up, wrong credentials, a missing bucket, no credentials at all.

Each fault must cost misses and dropped uploads, counted and logged, never an exception
out of the store's calls and never a wait past the configured timeouts; a wrong setup
must be one clear error naming the endpoint and the bucket.
"""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest
from support.s3_server import BUCKET, SECRET_KEY, FaultProxy, skip_module_without_rgw

from tiered_kv.fingerprint import Fingerprint
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteSetupError, RemoteStore

pytestmark = pytest.mark.faults

skip_module_without_rgw()

FP = Fingerprint("org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), 1, "sha256", "")
WAIT = 120  # a hang guard on futures, far beyond every configured timeout


def blocks(n: int, size: int = 32 << 10, seed: int = 0) -> list[tuple[bytes, int, bytes]]:
    rng = np.random.default_rng(seed)
    return [(rng.bytes(32), 0, rng.bytes(size)) for _ in range(n)]


def get(store: RemoteStore, items) -> list[bool]:
    return store.get_blocks([(h, r, bytearray(len(d))) for h, r, d in items]).result(WAIT)


def test_server_killed_mid_run_costs_misses_not_exceptions(rgw_server, remote_settings, caplog):
    config = RemoteConfig.from_dict(
        {
            **remote_settings,
            "request_timeout": "2s",
            "retries": 0,
            "failure_threshold": 4,
            "unavailable_cooldown": "500ms",
        }
    )
    stored, later = blocks(8, seed=1), blocks(8, seed=2)
    with RemoteStore(config, FP) as store:
        assert store.put_blocks(stored).result(WAIT) == [PutOutcome.STORED] * 8
        rgw_server.kill_rgw()
        try:
            with caplog.at_level(logging.WARNING, logger="tiered_kv.remote.store.store"):
                uploads = store.put_blocks(later).result(WAIT)
                reads = get(store, stored)
                probes = store.exists([h for h, _, _ in stored]).result(WAIT)
        finally:
            rgw_server.start_rgw()
        assert all(o in (PutOutcome.FAILED, PutOutcome.DROPPED) for o in uploads)
        assert reads == [False] * 8
        assert probes == [None] * 8  # unknown, not "absent": nothing was learned
        s = store.stats()
        assert s.puts_failed + s.puts_dropped == 8
        assert s.gets_failed + s.gets_skipped == 8
        assert s.unavailable_periods >= 1
        assert "did not answer" in caplog.text or "failed" in caplog.text
        assert SECRET_KEY not in caplog.text
        # radosgw is back (the cluster kept the objects): hits again, the lost uploads retried.
        store._read_health._open_until = store._put_health._open_until = 0.0  # end the cooldowns now
        assert get(store, stored) == [True] * 8
        assert store.put_blocks(later).result(WAIT) == [PutOutcome.STORED] * 8


def test_throttling_503_costs_misses_and_recovers(rgw_server, remote_settings):
    target = rgw_server.endpoint.removeprefix("http://")
    items = blocks(6)
    with FaultProxy(target) as proxy:
        config = RemoteConfig.from_dict(
            {**remote_settings, "endpoint": proxy.endpoint, "retries": 1, "failure_threshold": 1000}
        )
        with RemoteStore(config, FP) as store:
            assert store.put_blocks(items[:3]).result(WAIT) == [PutOutcome.STORED] * 3
            proxy.set_mode("503")
            assert store.put_blocks(items[3:]).result(WAIT) == [PutOutcome.FAILED] * 3
            assert get(store, items[:3]) == [False] * 3
            assert store.exists([items[0][0]]).result(WAIT) == [None]
            assert proxy.requests_refused >= 7  # every request, retried once
            proxy.set_mode("pass")
            assert get(store, items[:3]) == [True] * 3
            assert store.put_blocks(items[3:]).result(WAIT) == [PutOutcome.STORED] * 3
            s = store.stats()
            assert (s.puts_failed, s.gets_failed, s.probes_failed) == (3, 3, 1)


def test_a_silent_server_costs_at_most_the_timeout_then_answers_at_once(rgw_server, remote_settings):
    """Requests that are never answered end at request_timeout; after failure_threshold
    of them the store stops sending for the cooldown and answers misses at once."""
    target = rgw_server.endpoint.removeprefix("http://")
    items = blocks(4)
    with FaultProxy(target) as proxy:
        config = RemoteConfig.from_dict(
            {
                **remote_settings,
                "endpoint": proxy.endpoint,
                "retries": 0,
                "request_timeout": "300ms",
                "max_connections": 4,
                "failure_threshold": 4,
                "unavailable_cooldown": "1h",
            }
        )
        with RemoteStore(config, FP) as store:
            store.put_blocks(items).result(WAIT)
            proxy.set_mode("stall")
            assert get(store, items) == [False] * 4  # four timeouts
            s = store.stats()
            assert s.gets_failed == 4 and s.unavailable_periods == 1
            proxy.set_mode("pass")  # the server is back, but the store waits out its cooldown
            assert get(store, items) == [False] * 4
            assert store.put_blocks(blocks(2, seed=9)).result(WAIT) == [PutOutcome.DROPPED] * 2
            s = store.stats()
            assert (s.gets_skipped, s.gets_failed) == (4, 4)


def test_server_down_at_start_up_is_not_fatal(remote_settings):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    config = RemoteConfig.from_dict({**remote_settings, "endpoint": f"http://127.0.0.1:{port}"})
    with RemoteStore(config, FP) as store:
        assert store.reachable is False
        items = blocks(2)
        assert all(not o.durable for o in store.put_blocks(items).result(WAIT))
        assert get(store, items) == [False, False]


def test_wrong_credentials_are_one_clear_start_up_error(rgw_server, remote_settings, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-xyz")
    with pytest.raises(RemoteSetupError) as err:
        RemoteStore(RemoteConfig.from_dict(remote_settings), FP)
    message = str(err.value)
    assert f"bucket {BUCKET!r} at {rgw_server.endpoint}" in message
    assert "refused the credentials" in message and "SignatureDoesNotMatch" in message
    assert "not-the-secret-xyz" not in message
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NOSUCHKEY")
    with pytest.raises(RemoteSetupError, match="InvalidAccessKeyId"):
        RemoteStore(RemoteConfig.from_dict(remote_settings), FP)


def test_missing_bucket_is_one_clear_start_up_error(rgw_server, remote_settings):
    with pytest.raises(RemoteSetupError) as err:
        RemoteStore(RemoteConfig.from_dict({**remote_settings, "bucket": "no-such-bucket"}), FP)
    message = str(err.value)
    assert f"bucket 'no-such-bucket' at {rgw_server.endpoint} does not exist" in message


def test_no_credentials_at_all_says_where_to_put_them(remote_settings, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteSetupError, match="no AWS credentials found for s3://tiered-kv-tests/.*AWS_PROFILE"):
        RemoteStore(RemoteConfig.from_dict(remote_settings), FP)
    with pytest.raises(RemoteSetupError, match="AWS profile 'fleet' not found"):
        RemoteStore(RemoteConfig.from_dict({**remote_settings, "profile": "fleet"}), FP)


def test_credentials_from_a_named_profile(remote_settings, monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    creds = tmp_path / "credentials"
    creds.write_text(f"[fleet]\naws_access_key_id = tieredkvtest\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    config = RemoteConfig.from_dict({**remote_settings, "profile": "fleet"})
    with RemoteStore(config, FP) as store:
        assert store.reachable
        assert "fleet" not in repr(store._client.credentials) and SECRET_KEY not in repr(store._client.credentials)
        items = blocks(1)
        assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED]


def test_a_namespace_recording_another_fingerprint_is_logged_and_serving_goes_on(remote_settings, caplog):
    """Anyone who can write the bucket can write fingerprint.json: it is information, not
    a gate (every block carries the full fingerprint digest, under its tag)."""
    import obstore

    from tiered_kv.remote.format.object_format import manifest_key

    config = RemoteConfig.from_dict(remote_settings)
    with RemoteStore(config, FP) as store:
        assert store.reachable
        key = manifest_key(config.prefix, FP)
        obstore.put(store._client.raw, key, b'{"format":1,"fingerprint":{"model_id":"someone/else"}}', mode="overwrite")
    with caplog.at_level(logging.WARNING, logger="tiered_kv.remote"):
        with RemoteStore(config, FP) as store:
            assert store.reachable
            assert store.put_blocks(blocks(1)).result(WAIT) == [PutOutcome.STORED]
    assert "records another fingerprint than this node's" in caplog.text


def test_failed_uploads_never_stop_the_reads_of_blocks_in_the_bucket(rgw_server, remote_settings):
    """Uploads that fail (here 503s on PUT only; a full Mooncake pool alike) stop uploads
    for the cooldown, not reads: a hit the scheduler has just verified is still read."""
    target = rgw_server.endpoint.removeprefix("http://")
    stored, late = blocks(3), blocks(4, seed=5)
    with FaultProxy(target) as proxy:
        config = RemoteConfig.from_dict(
            {
                **remote_settings,
                "endpoint": proxy.endpoint,
                "retries": 1,
                "failure_threshold": 2,
                "unavailable_cooldown": "1h",
            }
        )
        with RemoteStore(config, FP) as store:
            assert store.put_blocks(stored).result(WAIT) == [PutOutcome.STORED] * 3
            proxy.set_mode("503-put")
            outcomes = [store.put_blocks([one]).result(WAIT)[0] for one in late]
            assert outcomes == [PutOutcome.FAILED] * 2 + [PutOutcome.DROPPED] * 2
            assert store.stats().unavailable_periods == 1
            proxy.set_mode("pass")
            assert get(store, stored) == [True] * 3 and store.stats().gets_skipped == 0
            assert store.put_blocks(blocks(1, seed=9)).result(WAIT) == [PutOutcome.DROPPED]


def test_a_verification_stands_for_a_few_seconds_only(rgw_server, remote_settings):
    """A block verified but not loaded (its request aborted, or waiting for GPU blocks)
    whose object then goes: past ``VERIFIED_FOR_S`` it is verified again, and missed,
    rather than promised to a load that would fail (where vLLM cannot recompute it)."""
    from support.s3_server import BUCKET as bucket
    from tiered_kv.remote.format.object_format import block_key
    from tiered_kv.remote.scheduler.hit_check import VERIFIED_FOR_S, RemoteHitCheck, RemoteVerifier
    from tiered_kv.remote.scheduler.manager import RemoteOffloadingManager
    from tiered_kv.tiers import HitState

    config = RemoteConfig.from_dict(remote_settings)
    (item,) = blocks(1)
    now = [0.0]
    with RemoteStore(config, FP) as writer:
        assert writer.put_blocks([item]).result(WAIT) == [PutOutcome.STORED]
        manager = RemoteOffloadingManager(RemoteStore(config, FP), block_size=16)
        check = RemoteHitCheck(manager, RemoteVerifier(manager.store, 1, len(item[2])), clock=lambda: now[0])
        try:
            manager.expect([item[0]])
            manager.wait_probes(WAIT)
            assert manager.is_loadable(item[0])  # the probe's answer, folded in as the engine's lookup does
            assert check.lookup(item[0]) is HitState.PENDING
            check.verifier.wait(WAIT)
            check.collect()
            assert check.lookup(item[0]) is HitState.HIT
            rgw_server.admin_client().delete_object(Bucket=bucket, Key=block_key(writer.namespace, item[0], 0))
            now[0] += VERIFIED_FOR_S / 2
            assert check.lookup(item[0]) is HitState.HIT  # moments later: the load is let go
            now[0] += VERIFIED_FOR_S
            assert check.lookup(item[0]) is HitState.PENDING  # verified again, and found gone
            check.verifier.wait(WAIT)
            check.collect()
            assert check.outcomes() == {"ok": 1, "failed": 1} and not manager.is_loadable(item[0])
        finally:
            check.shutdown()
            manager.shutdown()
