"""``tiered-kv doctor`` on a config with a shared tier, against the real test server: the
bucket answers (ok), a bucket that does not exist and refused credentials (fail, with the
fix), and an endpoint nobody listens on (warn: the server would serve with misses)."""

from __future__ import annotations

import json
import socket

from support.s3_server import skip_module_without_rgw

skip_module_without_rgw()

from tiered_kv.ops import doctor as dr  # noqa: E402
from tiered_kv.config import TieredConfig  # noqa: E402


def _check(remote: dict):
    return dr.check_remote(TieredConfig.from_dict({"remote": remote}))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_shared_tier_line(remote_settings, monkeypatch):
    ok = _check(remote_settings)
    assert ok.status == dr.OK and remote_settings["bucket"] in ok.message
    missing = _check({**remote_settings, "bucket": "no-such-bucket-here"})
    assert missing.status == dr.FAIL and "does not exist" in missing.message and "aws s3 mb" in missing.fix
    down = _check(
        {**remote_settings, "endpoint": f"http://127.0.0.1:{_closed_port()}", "request_timeout": "1s", "retries": 0}
    )
    assert down.status == dr.WARN and "did not answer" in down.message
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    refused = _check(remote_settings)
    assert refused.status == dr.FAIL and "refused" in refused.message and "AWS_PROFILE" in refused.fix
    assert "wrong-secret" not in json.dumps(refused.to_dict())
    assert dr.check_remote(TieredConfig.from_dict({})).status == dr.OK
