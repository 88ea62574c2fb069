"""The shared tier's pieces that need no server: config validation, object keys and
headers, and the scheduler's membership cache."""

from __future__ import annotations

import dataclasses
import re

import pytest
import xxhash

from tiered_kv.config import ConfigError
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.store.checksums import checksum_function
from tiered_kv.remote.config import RemoteConfig, parse_duration
from tiered_kv.remote.scheduler.membership import Membership, MembershipCache
from tiered_kv.remote.format.object_format import (
    FIXED_HEADER_BYTES,
    BlockHeader,
    Rejected,
    block_key,
    encode_header,
    fingerprint_digest,
    manifest_key,
    namespace_prefix,
    pieces_checksum,
    verified_payload,
)

FP = Fingerprint("org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), 1, "sha256", "")


def test_config_defaults_and_units():
    c = RemoteConfig.from_dict(
        {
            "bucket": "kv-fleet",
            "endpoint": "http://127.0.0.1:7480/",
            "prefix": "/team/kv/",
            "request_timeout": "500ms",
            "max_pending_upload_bytes": "64MiB",
            "absent_ttl": "1m",
        }
    )
    assert c.endpoint == "http://127.0.0.1:7480"
    assert c.prefix == "team/kv"
    assert c.request_timeout == 0.5
    assert c.max_pending_upload_bytes == 64 << 20
    assert c.absent_ttl == 60.0
    assert c.write_policy == "write_through"
    assert "s3://kv-fleet/team/kv at http://127.0.0.1:7480" == c.where()
    assert RemoteConfig.from_dict({"bucket": "kv-fleet"}).where() == "s3://kv-fleet/tiered-kv at AWS S3 (us-east-1)"


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({}, "bucket: required"),
        ({"bucket": "Bad_Bucket"}, "bucket: expected an S3 bucket name"),
        ({"bucket": "kv-b", "endpoint": "ftp://host"}, "endpoint: expected an http:// or https:// URL"),
        ({"bucket": "kv-b", "endpoint": "http://host:7480/kv-b"}, "bucket and prefix have their own keys"),
        ({"bucket": "kv-b", "prefix": "a/../b"}, "prefix: expected a key prefix"),
        ({"bucket": "kv-b", "request_timeout": "soon"}, "request_timeout: expected a duration"),
        ({"bucket": "kv-b", "request_timeout": 0}, "request_timeout: duration must be positive"),
        ({"bucket": "kv-b", "max_connections": 0}, "max_connections: expected an integer in 1..1024"),
        ({"bucket": "kv-b", "write_policy": "always"}, "write_policy: expected one of write_through, evictions"),
        ({"bucket": "kv-b", "checksum": "md5"}, "checksum: expected one of xxh3_64, crc32c"),
        ({"bucket": "kv-b", "endpont": "http://h"}, "did you mean 'endpoint'"),
        ({"bucket": "kv-b", "request_timeout": float("inf")}, "request_timeout: duration must be at most 3600s"),
        ({"bucket": "kv-b", "request_timeout": 1e14}, "request_timeout: duration must be at most 3600s"),
        ({"bucket": "kv-b", "connect_timeout": "2h"}, "connect_timeout: duration must be at most 60s"),
        ({"bucket": "kv-b", "unavailable_cooldown": float("inf")}, "unavailable_cooldown: duration must be at most"),
        ({"bucket": "kv-b", "absent_ttl": float("nan")}, "absent_ttl: duration must be positive"),
        ({"bucket": "kv-b", "absent_ttl": "2000h"}, "absent_ttl: duration must be at most 86400s"),
        ({"bucket": "kv-b", "prefix": "p" * 1100}, "prefix: 1100 characters is too long"),
        ({"bucket": "kv-b", "max_pending_upload_bytes": "1000TiB"}, "max_pending_upload_bytes: at most 64GiB"),
        ({"bucket": "kv-b", "key_env": "deadbeef" * 8 + "!"}, "key_env: expected the name of an environment variable"),
        ({"bucket": "kv-b", "key_env": "K", "key_file": "/k"}, "name one place for the fleet key"),
        ({"bucket": "kv-b", "trusted_bucket": "yes"}, "trusted_bucket: expected true or false"),
    ],
)
def test_config_errors_name_key_and_value(raw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        RemoteConfig.from_dict(raw)


def test_config_refuses_credentials_in_the_endpoint_without_echoing_them():
    with pytest.raises(ConfigError) as err:
        RemoteConfig.from_dict({"bucket": "kv-b", "endpoint": "http://AKIDEXAMPLE:s3cr3t@host:7480"})
    assert "must not carry credentials" in str(err.value)
    assert "s3cr3t" not in str(err.value)


def test_parse_duration():
    assert parse_duration(2, "k") == 2.0
    assert parse_duration("250 ms", "k") == 0.25
    assert parse_duration("2min", "k") == 120.0
    with pytest.raises(ConfigError, match="k: expected a duration"):
        parse_duration(True, "k")


def test_keys_are_namespaced_fanned_out_and_per_rank():
    ns = namespace_prefix("kv", FP)
    assert ns == f"kv/{FP.namespace_id}"
    key = block_key(ns, b"\x01\xff", 3)
    fan = xxhash.xxh3_64_intdigest(b"\x01\xff") & 0xFF
    assert key == f"{ns}/{fan:02x}/01ff-r3"
    assert block_key(ns, b"\x01\xff", 0) != key
    assert manifest_key("kv", FP) == f"{ns}/fingerprint.json"
    other = dataclasses.replace(FP, dtype="bfloat16")
    assert namespace_prefix("kv", other) != ns
    # Fan-out spreads even hashes that share their first bytes.
    assert len({block_key(ns, b"same-prefix-%d" % i, 0).split("/")[2] for i in range(200)}) > 100


def _object(payload: bytes, *, fp=FP, block_hash=b"h1", rank=0, checksum="xxh3_64") -> bytearray:
    header = encode_header(
        fingerprint_digest(fp), block_hash, rank, [memoryview(payload)], checksum, pieces_checksum(checksum)
    )
    return bytearray(header + payload)


@pytest.mark.parametrize("checksum", ["xxh3_64", "crc32c"])
def test_checksum_over_pieces_is_the_checksum_of_their_concatenation(checksum):
    data = bytes(range(256)) * 300
    pieces = [memoryview(data)[a:b] for a, b in ((0, 1), (1, 5000), (5000, 5000), (5000, len(data)))]
    assert pieces_checksum(checksum)(pieces) == checksum_function(checksum)(memoryview(data))
    assert pieces_checksum(checksum)([memoryview(data)]) == checksum_function(checksum)(memoryview(data))


def _verify(obj, *, fp=FP, block_hash=b"h1", rank=0, size=None):
    return verified_payload(
        memoryview(obj),
        fingerprint=fingerprint_digest(fp),
        block_hash=block_hash,
        rank=rank,
        size=len(obj) - FIXED_HEADER_BYTES - len(block_hash) if size is None else size,
        checksums=checksum_function,
    )


@pytest.mark.parametrize("checksum", ["xxh3_64", "crc32c"])
def test_header_round_trip(checksum):
    payload = bytes(range(256)) * 40
    obj = _object(payload, block_hash=b"\x00" * 32, rank=5, checksum=checksum)
    header = BlockHeader.unpack(memoryview(obj))
    assert (header.block_hash, header.rank, header.payload_len, header.checksum_name) == (
        b"\x00" * 32,
        5,
        len(payload),
        checksum,
    )
    assert header.fingerprint == fingerprint_digest(FP)
    assert bytes(_verify(obj, block_hash=b"\x00" * 32, rank=5)) == payload


def test_every_check_rejects_with_its_reason():
    payload = b"kv" * 1000
    good = _object(payload)
    cases = {
        "foreign": lambda: _verify(_object(payload, fp=dataclasses.replace(FP, hash_seed="42"))),
        "mismatch": lambda: _verify(good, block_hash=b"h2"),
        "size": lambda: _verify(good, size=len(payload) - 1),
    }
    flipped = bytearray(good)
    flipped[-1] ^= 1
    cases["checksum"] = lambda: _verify(flipped, size=len(payload))
    other_rank = _object(payload, rank=1)
    cases["mismatch"] = lambda: _verify(other_rank, rank=0)
    for reason, call in cases.items():
        with pytest.raises(Rejected) as err:
            call()
        assert err.value.reason == reason, (reason, err.value)
        assert err.value.provable, reason  # none of these is an honest object of its key
    bad_magic = bytearray(good)
    bad_magic[0] ^= 0xFF
    truncated = good[:-10]
    zero = bytearray(good)
    zero[8] = 0
    for obj in (bad_magic, truncated, zero, good[:20]):
        with pytest.raises(Rejected) as err:
            _verify(obj, size=len(payload))
        assert err.value.reason == "format" and err.value.provable
    # A newer format version may be a newer member's: refused, and not this reader's to judge.
    future = bytearray(good)
    future[8] = 3
    with pytest.raises(Rejected) as err:
        _verify(future, size=len(payload))
    assert err.value.reason == "version" and not err.value.provable


def test_membership_cache_present_absent_ttl_and_bound():
    now = [100.0]
    cache = MembershipCache(max_entries=3, absent_ttl=5.0, clock=lambda: now[0])
    assert cache.state(b"a") is Membership.UNKNOWN
    cache.mark_present([b"a", b"b"])
    cache.mark_absent([b"c"])
    assert cache.states([b"a", b"b", b"c", b"d"]) == [
        Membership.PRESENT,
        Membership.PRESENT,
        Membership.ABSENT,
        Membership.UNKNOWN,
    ]
    now[0] += 5.0  # another node may have uploaded it by now
    assert cache.state(b"c") is Membership.UNKNOWN
    cache.mark_absent([b"a"])  # a download missed: no longer trusted present
    assert cache.state(b"a") is Membership.ABSENT
    cache.mark_present([b"x", b"y", b"z"])  # bound 3: b"b" (least recently used) goes
    assert cache.state(b"b") is Membership.UNKNOWN
    assert cache.counts() == (3, 1)
    cache.forget([b"x", b"a"])
    assert cache.states([b"x", b"a"]) == [Membership.UNKNOWN, Membership.UNKNOWN]


def test_the_longest_key_fits_s3s_limit():
    from tiered_kv.fingerprint import NAMESPACE_ID_LEN
    from tiered_kv.remote.config import NAMESPACE_ID_CHARS, S3_MAX_KEY_BYTES, longest_key

    assert NAMESPACE_ID_CHARS == NAMESPACE_ID_LEN
    room = S3_MAX_KEY_BYTES - longest_key("")
    config = RemoteConfig.from_dict({"bucket": "kv-b", "prefix": "p" * room})
    fp = Fingerprint("m", "r", "float16", 16, 16, (("l", (2, 16, 2, 8)),), ("kv_first",), 1, "sha256", "")
    key = block_key(namespace_prefix(config.prefix, fp, sealed=False), b"\xff" * 64, 65535)  # the longer one
    assert len(key.encode()) == longest_key(config.prefix) == S3_MAX_KEY_BYTES
    with pytest.raises(ConfigError, match=f"use at most {room} characters"):
        RemoteConfig.from_dict({"bucket": "kv-b", "prefix": "p" * (room + 1)})


def test_sealed_objects_bind_every_header_field():
    from tiered_kv.remote.format.keys import Keyring
    from tiered_kv.remote.format.object_format import SEALED_HEADER_BYTES, seal

    ring = Keyring([bytes(range(32))])
    digest, block_hash, payload = b"\x01" * 32, b"\x02" * 32, bytes(range(256)) * 40
    obj = b"".join(seal(ring, digest, block_hash, 3, [memoryview(payload[:1000]), memoryview(payload[1000:])]))
    assert len(obj) == SEALED_HEADER_BYTES + 32 + len(payload) + 16 and payload[:64] not in obj

    def read(data, **kw):
        args = {"fingerprint": digest, "block_hash": block_hash, "rank": 3, "size": len(payload), "keyring": ring}
        return bytes(verified_payload(memoryview(bytes(data)), **{**args, **kw}))

    assert read(obj) == payload
    # Every byte of the header and the body is covered: one flipped bit anywhere fails.
    for at in [*range(0, SEALED_HEADER_BYTES + 32), SEALED_HEADER_BYTES + 40, len(obj) - 20, len(obj) - 1]:
        forged = bytearray(obj)
        forged[at] ^= 0x01
        with pytest.raises(Rejected) as err:
            read(forged)
        assert err.value.reason in ("auth", "format", "foreign", "mismatch", "size", "key", "version"), at
        # A reader that holds the key proves every forgery bad, except where the flipped bit
        # names a key id it does not hold, or a newer version: not its to judge.
        unjudged = 48 <= at < 52 or 8 <= at < 10 and int.from_bytes(forged[8:10], "little") > 2
        assert err.value.provable is not unjudged, (at, err.value)
    with pytest.raises(Rejected, match="key id") as err:
        read(obj, keyring=Keyring([bytes(32)]))
    assert not err.value.provable
    # The key id is read before anything else of the header: a reader with another key
    # cannot judge an object whatever its header says.
    patched = bytearray(obj)
    patched[SEALED_HEADER_BYTES] ^= 0x01  # the block hash
    with pytest.raises(Rejected) as err:
        read(patched, keyring=Keyring([bytes(32)]))
    assert err.value.reason == "key" and not err.value.provable
    with pytest.raises(Rejected) as err:
        read(obj, keyring=None)
    assert err.value.reason == "key" and not err.value.provable


@pytest.mark.parametrize("chunk", [1, 16, 40, 64, 1 << 20])
def test_an_object_verified_as_it_streams_in_chunks_of_any_size(chunk):
    """``verify_stream`` (``inspect verify --remote`` and the doctor) reads the header
    length from its own field, whatever the first chunk holds: an honest object is never
    judged bad, the one that ``--repair`` would delete, and a forged one still is."""
    from tiered_kv.remote.format.keys import Keyring
    from tiered_kv.remote.format.object_format import seal, verify_stream

    ring = Keyring([bytes(range(32))])
    digest, block_hash = b"\x01" * 32, b"\x02" * 32
    obj = b"".join(seal(ring, digest, block_hash, 3, [memoryview(bytes(range(256)) * 8)]))

    def verify(data: bytes):
        pieces = (data[i : i + chunk] for i in range(0, len(data), chunk))
        return verify_stream(len(data), pieces, fingerprint=digest, block_hash=block_hash, rank=3, keyring=ring)

    assert verify(obj).rank == 3
    forged = bytearray(obj)
    forged[-20] ^= 0x01
    with pytest.raises(Rejected) as err:
        verify(bytes(forged))
    assert err.value.reason == "auth" and err.value.provable
