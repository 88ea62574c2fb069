"""``tiered-kv doctor`` on a config with a shared tier, against the real test server: the
bucket answers (ok), a bucket that does not exist and refused credentials (fail, with the
fix), and an endpoint nobody listens on (warn: the server would serve with misses).

The fleet key as the server loads it: a missing key file fails as the server's start-up
does. One block object, written by the tier's own ``RemoteStore`` under key A, is opened
with the config's keys: a config holding only key B fails naming both key ids (never a
key), key A passes, and so does a rotation's key file (a new key first, A second); a
bucket with no object yet passes saying nothing was checked. The newest objects are
sampled: one object under another key, the newest of the namespace, warns counting it
(its key is not offered as the fix); the check fails only where none of them opens."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import numpy as np
from support.s3_server import BUCKET, skip_module_without_rgw
from typer.testing import CliRunner

skip_module_without_rgw()

from tiered_kv.cli import _load_commands, app  # noqa: E402
from tiered_kv.config import TieredConfig  # noqa: E402
from tiered_kv.fingerprint import Fingerprint  # noqa: E402
from tiered_kv.ops import doctor as dr  # noqa: E402
from tiered_kv.ops.doctor.remote_object import SAMPLE_OBJECTS  # noqa: E402
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore  # noqa: E402
from tiered_kv.remote.format.keys import Keyring  # noqa: E402

_load_commands()
WAIT = 120
#: Three fleet keys (fixed test values): A seals the bucket's objects, B is another fleet's, C a new one.
KEY_A, KEY_B, KEY_C = "a1" * 32, "b2" * 32, "c3" * 32
#: The config's model (org/model), and another model sharing the bucket under key B.
FP = Fingerprint("org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), 2, "sha256", "")
OTHER = dataclasses.replace(FP, model_id="other/model", tp_size=1)


def key_id(key: str) -> str:
    return f"{Keyring([bytes.fromhex(key)]).current_id:08x}"


def _check(remote: dict):
    return dr.check_remote(TieredConfig.from_dict({"remote": remote}))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _key_file(tmp_path, name: str, *keys: str) -> str:
    path = tmp_path / name
    path.write_text("".join(k + "\n" for k in keys))
    path.chmod(0o600)
    return str(path)


def _write(settings: dict, fingerprint: Fingerprint, n: int, seed: int) -> str:
    """``n`` blocks of ``fingerprint`` (both ranks) through the tier's own store; its namespace id."""
    rng = np.random.default_rng(seed)
    with RemoteStore(RemoteConfig.from_dict(settings), fingerprint) as store:
        items = [(rng.bytes(32), r, rng.bytes(20_000)) for _ in range(n) for r in range(fingerprint.tp_size)]
        assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * len(items)
        return store.namespace.rsplit("/", 1)[1]


def _doctor(tmp_path, remote: dict) -> tuple[dr.Check, int]:
    """The remote line and exit code of ``tiered-kv doctor --config`` on org/model's config."""
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"model_id": "org/model", "cpu_bytes": "64MiB", "remote": remote}))
    result = CliRunner().invoke(app, ["doctor", "--config", str(config), "--read-probe", "0", "--json"])
    assert "Traceback" not in result.output
    (line,) = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "remote"]
    return dr.Check(**line), result.exit_code


def test_the_shared_tier_line(remote_settings, monkeypatch):
    ok = _check(remote_settings)
    assert ok.status == dr.OK and remote_settings["bucket"] in ok.message
    assert "no object to check yet" in ok.message  # an empty prefix: the key is not vouched for
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
    assert dr.check_remote(TieredConfig.from_dict({})).status == dr.SKIP  # nothing of that kind to check


def test_a_shared_tier_in_the_tiers_list_is_checked_as_the_remote_one_is(remote_settings, tmp_path):
    config = tmp_path / "kv.json"
    entry = {"type": "remote", **remote_settings, "bucket": "no-such-bucket-here"}
    config.write_text(json.dumps({"model_id": "org/model", "cpu_bytes": "64MiB", "tiers": [entry]}))
    result = CliRunner().invoke(app, ["doctor", "--config", str(config), "--read-probe", "0", "--json"])
    (line,) = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "remote"]
    assert line["status"] == dr.FAIL and "does not exist" in line["message"], line
    assert result.exit_code == 2


def test_a_key_the_server_cannot_load_fails_as_its_start_up_does(remote_settings, tmp_path):
    gone = str(tmp_path / "no-such-key")
    check = _check({**remote_settings, "key_env": None, "key_file": gone})
    assert check.status == dr.FAIL and gone in check.message and "cannot be read" in check.message
    assert gone in check.fix
    short = _key_file(tmp_path, "short", "ab" * 16)
    check = _check({**remote_settings, "key_env": None, "key_file": short})
    assert check.status == dr.FAIL and "16 bytes" in check.message and "ab" * 16 not in json.dumps(check.to_dict())
    check = _check({k: v for k, v in remote_settings.items() if k != "key_env"})
    assert check.status == dr.FAIL and "remote.trusted_bucket" in check.message and "openssl rand" in check.fix


def test_objects_sealed_under_another_key_fail_naming_both_key_ids(remote_settings, tmp_path):
    a = _key_file(tmp_path, "a", KEY_A)
    b = _key_file(tmp_path, "b", KEY_B)
    settings = {**remote_settings, "key_env": None}
    ours = _write({**settings, "key_file": a}, FP, 3, seed=0)
    _write({**settings, "key_file": b}, OTHER, 2, seed=1)  # another model's fleet, another key

    wrong, code = _doctor(tmp_path, {**settings, "key_file": b})
    assert code == 2 and wrong.status == dr.FAIL
    assert f"sealed under key id {key_id(KEY_A)}" in wrong.message and f"{key_id(KEY_B)} (current)" in wrong.message
    assert b in wrong.message and key_id(KEY_A) in wrong.fix
    assert wrong.facts["object_namespace"] == ours and wrong.facts["object_key_id"] == key_id(KEY_A)
    text = json.dumps(wrong.to_dict())
    assert KEY_A not in text and KEY_B not in text

    right, code = _doctor(tmp_path, {**settings, "key_file": a})
    assert right.status == dr.OK and code != 2, right
    assert f"sealed under key id {key_id(KEY_A)}, its current key" in right.message and "opens with it" in right.message
    assert right.facts["object_namespace"] == ours  # org/model's namespace, not other/model's under key B

    rotating = _key_file(tmp_path, "rotating", KEY_C, KEY_A)  # the new key first, the old one second
    rotation, _ = _doctor(tmp_path, {**settings, "key_file": rotating})
    assert rotation.status == dr.OK, rotation
    assert (
        f"{key_id(KEY_A)}, an older key it still reads" in rotation.message
        and f"{key_id(KEY_C)} (current)" in rotation.message
    )

    # The server of another model reads only other/model's namespace, sealed under key B.
    other = dr.check_remote(
        TieredConfig.from_dict({"model_id": "other/model", "remote": {**settings, "key_file": b}}),
        {"model_id": "other/model", "remote": {**settings, "key_file": b}},
    )
    assert other.status == dr.OK and other.facts["object_namespace"] != ours, other


def test_one_object_under_another_key_among_the_newest_warns_and_fails_only_where_none_opens(remote_settings, tmp_path):
    settings = {**remote_settings, "key_env": None}
    a, b, c = (_key_file(tmp_path, k, key) for k, key in (("a", KEY_A), ("b", KEY_B), ("c", KEY_C)))
    _write({**settings, "key_file": a}, FP, 10, seed=3)  # the fleet: 20 objects (both ranks) under key A
    time.sleep(1.1)  # S3's last-modified has 1 s resolution: the next object is the newest
    rng = np.random.default_rng(4)
    with RemoteStore(RemoteConfig.from_dict({**settings, "key_file": b}), FP) as rogue:  # one object, key B
        assert rogue.put_blocks([(rng.bytes(32), 0, rng.bytes(20_000))]).result(WAIT) == [PutOutcome.STORED]
    n = SAMPLE_OBJECTS
    assert 1 < n < 21

    fleet, code = _doctor(tmp_path, {**settings, "key_file": a})
    assert fleet.status == dr.WARN and code == 1, fleet
    assert f"sealed under key id {key_id(KEY_A)}, its current key" in fleet.message and "opens with it" in fleet.message
    assert f"1 of the {n} newest block objects" in fleet.message
    assert f"is sealed under key id {key_id(KEY_B)}, which remote.key_file {a} does not hold" in fleet.message
    assert "inspect verify --remote" in fleet.fix and key_id(KEY_B) not in fleet.fix  # never "install the rogue key"
    assert fleet.facts["objects_sampled"] == n
    assert fleet.facts["sampled_key_ids"] == {key_id(KEY_A): n - 1, key_id(KEY_B): 1}

    # The rogue's own config: most of the sample is under key A, so A is offered, as the fleet's key.
    member, code = _doctor(tmp_path, {**settings, "key_file": b})
    assert member.status == dr.WARN and code == 1, member
    assert f"{n - 1} of the {n} newest block objects" in member.message and key_id(KEY_A) in member.message
    assert f"if key id {key_id(KEY_A)} is the fleet's key" in member.fix

    # None of the sample opens with key C: a failure, naming both key ids with their counts; the
    # fix names the key that seals most of the sample, never the one object's.
    other, code = _doctor(tmp_path, {**settings, "key_file": c})
    assert other.status == dr.FAIL and code == 2, other
    assert f"none of the {n} newest block objects" in other.message
    assert f"key ids {key_id(KEY_A)} ({n - 1} of {n}), {key_id(KEY_B)} (1 of {n})" in other.message
    assert f"which remote.key_file {c} does not hold: it holds key ids {key_id(KEY_C)} (current)" in other.message
    assert f"give this server the fleet's key (id {key_id(KEY_A)})" in other.fix and key_id(KEY_B) not in other.fix


def test_a_damaged_object_under_the_right_key_is_a_warning(remote_settings, rgw_server, tmp_path):
    settings = {**remote_settings, "key_env": None, "key_file": _key_file(tmp_path, "a", KEY_A)}
    _write(settings, FP, 1, seed=2)
    s3 = rgw_server.admin_client()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=settings["prefix"] + "/")["Contents"]
    for key in [o["Key"] for o in listed if not o["Key"].endswith(".json")]:  # both ranks' objects
        body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        body[-40] ^= 1  # a flipped ciphertext bit: the tag no longer verifies
        s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    check, code = _doctor(tmp_path, settings)
    assert code == 1 and check.status == dr.WARN, check
    assert f"key id {key_id(KEY_A)}, its current key" in check.message and "would not serve it (auth" in check.message
    assert "inspect verify --remote" in check.fix


def test_a_trusted_bucket_without_a_key_opens_no_object(remote_settings):
    check = _check({**remote_settings, "key_env": None, "trusted_bucket": True})
    assert check.status == dr.WARN and "plaintext" in check.message and "no object's key to check" in check.message
