"""The shared tier against a writer of the bucket, on a real S3 server (Ceph RGW on
127.0.0.1): forged, patched, replayed and pre-planted objects are never served and do
not stick; a bucket reader without the key learns no K/V byte; keys rotate; a foreign,
huge or deeply nested fingerprint record never stops serving and costs bounded memory."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import resource

import pytest
from support.s3_server import FLEET_KEY, FLEET_KEY_ENV, skip_module_without_rgw
from test_remote_store import FP, WAIT, blocks, read_back

from tiered_kv.config_values import ConfigError
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore
from tiered_kv.remote.format.object_format import (
    SEALED_HEADER_BYTES,
    block_key,
    encode_header,
    fingerprint_digest,
    manifest_key,
    pieces_checksum,
)

skip_module_without_rgw()

OTHER_KEY = "a7" * 32


def _raw(store: RemoteStore):
    return store._client.raw


def _plain_object(fp, block_hash: bytes, rank: int, payload: bytes) -> bytes:
    """A format-1 object with a correct checksum: what anyone who can write the bucket can make."""
    view = [memoryview(payload)]
    return (
        encode_header(fingerprint_digest(fp), block_hash, rank, view, "xxh3_64", pieces_checksum("xxh3_64")) + payload
    )


@pytest.fixture
def store(remote_settings):
    with RemoteStore(RemoteConfig.from_dict(remote_settings), FP) as s:
        yield s


def test_the_bucket_holds_no_plaintext_and_another_key_reads_nothing(store, remote_settings, monkeypatch):
    import obstore

    items = blocks(3, size=200_000, seed=11)
    assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 3
    for h, r, data in items:
        raw = obstore.get(_raw(store), block_key(store.namespace, h, r)).bytes().to_bytes()
        assert len(raw) == SEALED_HEADER_BYTES + len(h) + len(data) + 16
        body = raw[SEALED_HEADER_BYTES + len(h) :]
        # No 16-byte run of the block appears anywhere in the object.
        assert not any(data[i : i + 16] in raw for i in range(0, len(data) - 16, 997))
        assert sum(a == b for a, b in zip(body, data)) < len(data) // 64  # ~1/256 by chance
    monkeypatch.setenv("OTHER_FLEET_KEY", OTHER_KEY)
    other = RemoteConfig.from_dict({**remote_settings, "key_env": "OTHER_FLEET_KEY"})
    with RemoteStore(other, FP) as thief:
        hits, bufs = read_back(thief, items)
        assert hits == [False] * 3 and not any(any(b) for b in bufs)
        assert thief.stats().rejected["key"] == 3
        assert thief.stats().damaged_deleted == 0  # a key it lacks is not a forgery
    hits, bufs = read_back(store, items)
    assert hits == [True] * 3 and [bytes(b) for b in bufs] == [d for _, _, d in items]


def test_forged_patched_and_replayed_objects_are_never_served(store):
    import obstore

    (a, b, c) = blocks(3, size=50_000, seed=12)
    raw = _raw(store)
    store.put_blocks([a, b]).result(WAIT)
    key_a, key_b, key_c = (block_key(store.namespace, h, r) for h, r, _ in (a, b, c))
    obj_b = bytes(obstore.get(raw, key_b).bytes())
    # Replayed: b's honest object under a's key (its header names b).
    obstore.put(raw, key_a, obj_b, mode="overwrite")
    # Patched: b's honest object with its header's block hash set to c's.
    patched = bytearray(obj_b)
    patched[SEALED_HEADER_BYTES : SEALED_HEADER_BYTES + 32] = c[0]
    obstore.put(raw, key_c, bytes(patched), mode="overwrite")
    hits, bufs = read_back(store, [a, c])
    assert hits == [False, False] and not any(any(x) for x in bufs)
    s = store.stats()
    assert s.rejected["mismatch"] == 1 and s.rejected["auth"] == 1
    # Both proven bad by a reader that holds the key: gone after the first read.
    assert s.damaged_deleted == 2 and store.exists([a[0], c[0]]).result(WAIT) == [False, False]
    # A plain object with a correct checksum (format 1, no key needed) is refused too: of
    # another size than the block's sealed object, it is read and proven unsealed where
    # this fleet seals, and deleted by the reader.
    obstore.put(raw, key_c, _plain_object(FP, c[0], c[1], c[2]), mode="overwrite")
    hits, _ = read_back(store, [c])
    s = store.stats()
    assert hits == [False] and s.rejected["auth"] == 2 and s.kept_unproven == 0 and s.damaged_deleted == 3
    # So is one planted while a writer was away: a writer that finds it replaces it.
    obstore.put(raw, key_c, _plain_object(FP, c[0], c[1], c[2]), mode="overwrite")
    assert store.put_blocks([a, c]).result(WAIT) == [PutOutcome.STORED] * 2
    assert store.stats().forgeries_replaced == 1
    assert read_back(store, [a, b, c])[0] == [True] * 3


def test_the_honest_writer_replaces_a_preplanted_forgery(store):
    import obstore

    items = blocks(4, size=30_000, seed=13)
    raw = _raw(store)
    for h, r, data in items:  # planted before any honest write: same keys, forged payloads
        obstore.put(raw, block_key(store.namespace, h, r), _plain_object(FP, h, r, bytes(len(data))), mode="create")
    assert store.exists([h for h, _, _ in items]).result(WAIT) == [True] * 4
    assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 4
    assert store.stats().forgeries_replaced == 4
    hits, bufs = read_back(store, items)
    assert hits == [True] * 4 and [bytes(b) for b in bufs] == [d for _, _, d in items]
    # An honest object in place is left as it is (write-once, verified).
    assert store.put_blocks(items[:1]).result(WAIT) == [PutOutcome.PRESENT]
    assert store.stats().forgeries_replaced == 4


def test_keys_rotate_old_objects_stay_readable(store, remote_settings, monkeypatch):
    old = blocks(2, seed=14)
    store.put_blocks(old).result(WAIT)
    monkeypatch.setenv("ROTATED_KEY", f"{OTHER_KEY}\n{FLEET_KEY}\n")  # new first, then the old one
    rotated = RemoteConfig.from_dict({**remote_settings, "key_env": "ROTATED_KEY"})
    new = blocks(2, seed=15)
    with RemoteStore(rotated, FP) as node:
        assert read_back(node, old)[0] == [True, True]
        assert node.put_blocks(new).result(WAIT) == [PutOutcome.STORED] * 2
        assert node.keyring.current_id != store.keyring.current_id
    # A node still on the old key alone cannot read the new objects, and leaves them.
    assert read_back(store, new)[0] == [False, False]
    assert store.stats().rejected["key"] == 2 and store.stats().damaged_deleted == 0


def test_no_key_refuses_to_start_unless_the_bucket_is_declared_trusted(remote_settings, caplog, tmp_path):
    bare = {k: v for k, v in remote_settings.items() if k != "key_env"}
    with pytest.raises(ConfigError, match=r"remote\.key_file.*remote\.key_env.*remote\.trusted_bucket"):
        RemoteStore(RemoteConfig.from_dict(bare), FP)
    with pytest.raises(ConfigError, match="environment variable NO_SUCH_KEY_VAR is not set"):
        RemoteStore(RemoteConfig.from_dict({**bare, "key_env": "NO_SUCH_KEY_VAR"}), FP)
    short = tmp_path / "short.key"
    short.write_text("abcd\n")
    with pytest.raises(ConfigError, match=r"short\.key: key 1 is 2 bytes; expected 32") as err:
        RemoteStore(RemoteConfig.from_dict({**bare, "key_file": str(short)}), FP)
    assert "abcd" not in str(err.value)
    good = tmp_path / "fleet.key"
    good.write_text(FLEET_KEY + "\n")
    good.chmod(0o600)
    with RemoteStore(RemoteConfig.from_dict({**bare, "key_file": str(good)}), FP) as s:
        assert s.keyring is not None
    with caplog.at_level(logging.WARNING, logger="tiered_kv.remote"):
        with RemoteStore(RemoteConfig.from_dict({**bare, "trusted_bucket": True}), FP) as s:
            assert s.keyring is None
            assert s.put_blocks(blocks(1)).result(WAIT) == [PutOutcome.STORED]
    assert "declared trusted" in caplog.text and FLEET_KEY not in caplog.text


def test_plain_http_to_another_host_warns(remote_settings, caplog):
    settings = {**remote_settings, "endpoint": "http://10.1.2.3:7480"}
    with caplog.at_level(logging.WARNING, logger="tiered_kv.remote"):
        RemoteStore(RemoteConfig.from_dict(settings), FP, check=False).close()
        RemoteStore(RemoteConfig.from_dict(remote_settings), FP, check=False).close()  # loopback: quiet
    assert caplog.text.count("plain http to another host") == 1
    assert not RemoteConfig.from_dict({**settings, "endpoint": "https://rgw.internal"}).plaintext_endpoint()


# ---------------------------------------------------------------- the fingerprint record


def _start_and_measure(settings: dict, env: dict) -> tuple[bool, int, list[str]]:
    """In a fresh process: open a store (its start-up check reads the record), store and
    read a block. (served, ru_maxrss growth in KiB, warnings)."""
    os.environ.update(env)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("tiered_kv.remote").addHandler(handler)
    items = blocks(1, seed=16)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with RemoteStore(RemoteConfig.from_dict(settings), FP) as store:
        store.put_blocks(items).result(WAIT)
        served = read_back(store, items)[0] == [True]
    return served, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, records


@pytest.mark.parametrize("record", ["huge", "nested", "foreign"])
def test_a_planted_fingerprint_record_never_stops_serving(remote_settings, record):
    import obstore

    config = RemoteConfig.from_dict(remote_settings)
    body = {
        "huge": b" " * (64 << 20),
        "nested": b"[" * 30_000 + b"]" * 30_000,
        "foreign": json.dumps({"format": 2, "fingerprint": dataclasses.replace(FP, model_id="x/y").to_dict()}).encode(),
    }[record]
    with RemoteStore(config, FP, check=False) as s:
        obstore.put(_raw(s), manifest_key(config.prefix, FP), body, mode="overwrite")
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", FLEET_KEY_ENV))}
    with multiprocessing.get_context("spawn").Pool(1) as node:
        served, grown_kib, warnings = node.apply(_start_and_measure, (remote_settings, env))
    assert served
    assert grown_kib < 48 * 1024, f"{grown_kib} KiB"  # a 64 MiB body read whole would be more
    expected = {"huge": "is not a fingerprint record", "nested": "nested", "foreign": "another fingerprint"}[record]
    assert any(expected in w for w in warnings), warnings


@pytest.mark.parametrize("fault", ["no key", "refused credentials"])
def test_a_start_the_shared_tier_refuses_leaves_no_disk_namespace(remote_settings, tmp_path, monkeypatch, fault):
    from support.remote_node import build

    from tiered_kv.remote.store.client import RemoteSetupError

    settings = {k: v for k, v in remote_settings.items() if k != "key_env"} if fault == "no key" else remote_settings
    if fault == "refused credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError if fault == "no key" else RemoteSetupError) as err:
        build(cache, settings)
    assert ("remote.key_file" if fault == "no key" else "refused the credentials") in str(err.value)
    assert not cache.exists() or not any(cache.iterdir()), sorted(p.name for p in cache.iterdir())
