"""Write-once writes on S3 servers without conditional PUT, against a real server (Ceph RGW
on 127.0.0.1). RGW honours ``If-None-Match: *``; ``FaultProxy`` in front of it refuses
conditional PUTs as older MinIO and Ceph do (501 NotImplemented, or 400 naming the header)
and forwards everything else, so the objects written after the fallback are real ones.

The store must detect the refusal (and nothing else) as such, warn once, count it, and go
on writing with an existence check and a plain PUT that never replaces a stored block.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from support.s3_server import BUCKET, FaultProxy

from tiered_kv.config_values import ConfigError
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteSetupError, RemoteStore
from tiered_kv.remote.store.client import conditional_put_refusal

FP = Fingerprint("org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), 1, "sha256", "")
WAIT = 120  # seconds: a hang guard on futures, far beyond any request timeout
WARNING = "refused a conditional PUT"
REFUSING_MODES = ("no-conditional-put", "no-conditional-put-400")


def blocks(n: int, size: int = 48 << 10, seed: int = 0) -> list[tuple[bytes, int, bytes]]:
    rng = np.random.default_rng(seed)
    return [(rng.bytes(32), 0, rng.bytes(size)) for _ in range(n)]


def read_back(store: RemoteStore, items) -> list[bytes | None]:
    bufs = [bytearray(len(data)) for _, _, data in items]
    hits = store.get_blocks([(h, r, b) for (h, r, _), b in zip(items, bufs)]).result(WAIT)
    return [bytes(b) if hit else None for hit, b in zip(hits, bufs)]


def warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and WARNING in r.getMessage()]


@pytest.fixture
def proxy(rgw_server):
    with FaultProxy(rgw_server.endpoint.removeprefix("http://")) as p:
        yield p


def through(settings: dict, proxy: FaultProxy, **extra) -> RemoteConfig:
    return RemoteConfig.from_dict({**settings, "endpoint": proxy.endpoint, **extra})


@pytest.mark.parametrize("mode", REFUSING_MODES)
def test_a_refusing_server_gets_checked_plain_puts_that_never_overwrite(remote_settings, proxy, mode, caplog):
    proxy.set_mode(mode)
    items = blocks(6)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.remote"):
        with RemoteStore(through(remote_settings, proxy), FP) as store:
            # The start-up check's manifest write met the refusal and fell back.
            assert store.reachable and not store.conditional_put
            refused_at_start = proxy.requests_refused
            assert refused_at_start >= 1
            assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 6
            # Another node's bytes for the same blocks: HEAD finds each, nothing is replaced.
            other = [(h, r, bytes(len(d))) for h, r, d in items]
            assert store.put_blocks(other).result(WAIT) == [PutOutcome.PRESENT] * 6
            s = store.stats()
            assert proxy.requests_refused == refused_at_start  # no conditional PUT sent after the switch
    assert (s.conditional_put_refused, s.puts_unconditional) == (1, 1 + 6)  # the manifest, then the blocks
    assert (s.puts_stored, s.puts_present, s.puts_failed) == (6, 6, 0)
    [warning] = warnings(caplog)
    text = warning.getMessage()
    assert BUCKET in text and proxy.endpoint in text and "HEAD" in text and "harmless" in text
    # Real objects on the real server, byte-exact, read without the proxy.
    with RemoteStore(RemoteConfig.from_dict(remote_settings), FP) as direct:
        assert read_back(direct, items) == [d for _, _, d in items]


def test_concurrent_first_refusals_warn_once_and_all_blocks_land(rgw_server, remote_settings, proxy, caplog):
    """Uploads in flight when the first refusal comes back each fall back; one warning."""
    proxy.set_mode("no-conditional-put")
    items = blocks(12, seed=3)
    config = through(remote_settings, proxy, max_connections=8)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.remote"):
        with RemoteStore(config, FP, check=False) as store:
            assert store.conditional_put
            assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 12
            s = store.stats()
            assert not store.conditional_put
    assert s.conditional_put_refused >= 1 and s.puts_unconditional == 12
    assert len(warnings(caplog)) == 1
    with RemoteStore(RemoteConfig.from_dict(remote_settings), FP) as direct:
        assert read_back(direct, items) == [d for _, _, d in items]


def test_a_server_that_honours_it_gets_conditional_puts(remote_settings, proxy, caplog):
    items = blocks(4, seed=1)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.remote"):
        with RemoteStore(through(remote_settings, proxy), FP) as store:
            assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 4
            other = [(h, r, bytes(len(d))) for h, r, d in items]
            assert store.put_blocks(other).result(WAIT) == [PutOutcome.PRESENT] * 4
            assert read_back(store, items) == [d for _, _, d in items]
            s = store.stats()
            assert store.conditional_put
    assert (s.conditional_put_refused, s.puts_unconditional) == (0, 0)  # never a HEAD-then-PUT
    assert proxy.requests_refused == 0 and not warnings(caplog)


def test_an_ordinary_failure_does_not_switch_to_the_fallback(remote_settings, proxy, caplog):
    """503 SlowDown on a conditional PUT is a failed upload, not a missing feature."""
    proxy.set_mode("503")
    items = blocks(3, seed=2)
    config = through(remote_settings, proxy, retries=0, failure_threshold=1000)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.remote"):
        with RemoteStore(config, FP) as store:
            assert not store.reachable  # the start-up check's PUT was throttled too
            assert store.put_blocks(items).result(WAIT) == [PutOutcome.FAILED] * 3
            assert store.conditional_put
            proxy.set_mode("pass")
            assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 3
            s = store.stats()
    assert (s.conditional_put_refused, s.puts_unconditional, s.puts_failed) == (0, 0, 3)
    assert not warnings(caplog)


def test_always_makes_a_refusing_server_a_start_up_error(remote_settings, proxy):
    proxy.set_mode("no-conditional-put")
    config = through(remote_settings, proxy, conditional_put="always")
    with pytest.raises(RemoteSetupError, match=r"does not implement conditional PUT") as raised:
        RemoteStore(config, FP)
    message = str(raised.value)
    assert BUCKET in message and proxy.endpoint in message and "'auto'" in message


def test_always_on_a_server_unreachable_at_start_fails_uploads_without_falling_back(remote_settings, proxy):
    proxy.set_mode("503")
    config = through(remote_settings, proxy, conditional_put="always", retries=0, failure_threshold=1000)
    with RemoteStore(config, FP) as store:
        proxy.set_mode("no-conditional-put")
        assert store.put_blocks(blocks(2, seed=4)).result(WAIT) == [PutOutcome.FAILED] * 2
        s = store.stats()
        assert store.conditional_put and s.puts_unconditional == 0 and s.conditional_put_refused == 2


def test_never_sends_no_condition(remote_settings, proxy, caplog):
    proxy.set_mode("no-conditional-put")
    items = blocks(3, seed=5)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.remote"):
        with RemoteStore(through(remote_settings, proxy, conditional_put="never"), FP) as store:
            assert not store.conditional_put
            assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 3
            assert store.put_blocks(items).result(WAIT) == [PutOutcome.PRESENT] * 3
            assert read_back(store, items) == [d for _, _, d in items]
            s = store.stats()
    assert proxy.requests_refused == 0 and not warnings(caplog)
    assert (s.conditional_put_refused, s.puts_unconditional) == (0, 1 + 3)


def test_conditional_put_setting_is_validated():
    assert RemoteConfig.from_dict({"bucket": "kv-fleet"}).conditional_put == "auto"
    assert RemoteConfig.from_dict({"bucket": "kv-fleet", "conditional_put": "Never"}).conditional_put == "never"
    with pytest.raises(ConfigError, match=r"remote\.conditional_put: expected one of auto, always, never; got 'maybe'"):
        RemoteConfig.from_dict({"bucket": "kv-fleet", "conditional_put": "maybe"}, key_prefix="remote.")


def _s3_error(status: str, code: str, message: str, extra: str = "") -> str:
    """An error as obstore words it, the S3 error body included."""
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>{extra}'
        f"<Resource>/kv/conditional-team/ab/cd</Resource></Error>"
    )
    return (
        "Generic S3 error: Error performing PUT http://rgw:7480/kv/conditional-team/ab/cd in 3ms - "
        f"Server returned non-2xx status code: {status}: {body}"
    )


@pytest.mark.parametrize(
    "message,refused",
    [
        (_s3_error("501 Not Implemented", "NotImplemented", "A header you provided implies functionality"), True),
        (_s3_error("400 Bad Request", "NotImplemented", "not implemented"), True),
        (_s3_error("400 Bad Request", "InvalidArgument", "bad", "<ArgumentName>If-None-Match</ArgumentName>"), True),
        (_s3_error("400 Bad Request", "InvalidRequest", "Conditional writes are not supported"), True),
        ("Generic S3 error: Error performing PUT http://rgw/k - Server returned non-2xx status code: 501 ", True),
        (_s3_error("503 Service Unavailable", "SlowDown", "Please reduce your request rate."), False),
        (_s3_error("409 Conflict", "ConditionalRequestConflict", "A conflicting conditional operation"), False),
        (_s3_error("412 Precondition Failed", "PreconditionFailed", "At least one of the pre-conditions"), False),
        (_s3_error("403 Forbidden", "AccessDenied", "Access Denied"), False),
        # The key's prefix names "conditional": only the error's own words count.
        (_s3_error("400 Bad Request", "InvalidDigest", "The Content-MD5 you specified was invalid"), False),
        ("Generic S3 error: Error performing PUT http://rgw/k - HTTP error: operation timed out", False),
    ],
)
def test_only_a_refusal_of_the_condition_counts_as_one(message, refused):
    assert (conditional_put_refusal(message) is not None) == refused
