"""No member harms the fleet through the operator's tool, against a real Ceph RGW.

``tiered-kv inspect verify --remote CONFIG --repair`` with a wrong key, with only the key
before a rotation, or with no key (``trusted_bucket``) keeps every honest object and
says why; with the right key it deletes what it proves bad (a forgery, a flipped bit,
another block's object) and nothing else, and ``--dry-run`` shows the same split. Plain
objects live under a namespace of their own and are judged as plain. A hostile key
under the prefix (a control character, a ``..`` segment), which obstore's listing
refuses, stops no command, is shown escaped, and ``clear`` removes it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.s3_server import BUCKET
from test_inspect_remote import FP, OTHER, run, run_json

from tiered_kv.ops.inspect.remote_hostile import escaped_key, hostile_reason
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore
from tiered_kv.remote.store.client import RemoteError, S3Client
from tiered_kv.remote.format.keys import Keyring
from tiered_kv.remote.format.object_format import block_key

WAIT = 120
BLOCK = 8_000
#: The key before a rotation (the tests' fleet key) and after it; a key of no member.
OLD_KEY = "5f" * 32
NEW_KEY = "a1" * 32
WRONG_KEY = "c3" * 32
READER_KEY_ENV = "TIERED_KV_TEST_READER_KEY"


def _key_id(*keys: str) -> str:
    return f"{Keyring([bytes.fromhex(k) for k in keys]).current_id:08x}"


def _write(settings: dict, keyring: Keyring | None, hashes: list[bytes], seed: int, fp=FP) -> str:
    """Write every rank of each of ``hashes`` through the tier's own store; the namespace
    directory it wrote."""
    rng = np.random.default_rng(seed)
    config = RemoteConfig.from_dict({**settings, "trusted_bucket": keyring is None})
    with RemoteStore(config, fp, keyring=keyring) as store:
        items = [(h, r, rng.bytes(BLOCK)) for h in hashes for r in range(fp.tp_size)]
        assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * len(items)
        return store.namespace.rsplit("/", 1)[1]


def _reader(tmp_path, monkeypatch, settings: dict, key: str | None, name: str = "reader"):
    """A server's config for the inspector: holding ``key`` (several: comma-separated), or
    none with ``trusted_bucket``."""
    remote = {k: v for k, v in settings.items() if k != "key_env"}
    if key is None:
        remote["trusted_bucket"] = True
    else:
        monkeypatch.setenv(READER_KEY_ENV, key)
        remote["key_env"] = READER_KEY_ENV
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"model_id": "org/model", "cpu_bytes": "1GiB", "remote": remote}))
    return path


def _snapshot(s3, prefix: str) -> dict[str, bytes]:
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return {k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


def _listed(s3, prefix: str) -> list[str]:
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


# ---------------------------------------------------------------- keys this tool cannot judge


@pytest.mark.parametrize("reader", ["wrong key", "old key only", "no key"])
def test_repair_without_the_writers_key_keeps_every_honest_object_and_says_why(
    remote_settings, rgw_server, tmp_path, monkeypatch, reader
):
    rng = np.random.default_rng(1)
    hashes = [rng.bytes(32) for _ in range(6)]
    # After a rotation the fleet writes under the new key and still reads the old one.
    writer_keys = (NEW_KEY, OLD_KEY) if reader == "old key only" else (OLD_KEY,)
    ns = _write(remote_settings, Keyring([bytes.fromhex(k) for k in writer_keys]), hashes, seed=2)
    reader_key = {"wrong key": WRONG_KEY, "old key only": OLD_KEY, "no key": None}[reader]
    config = _reader(tmp_path, monkeypatch, remote_settings, reader_key)
    s3 = rgw_server.admin_client()
    prefix = remote_settings["prefix"]
    before = _snapshot(s3, prefix)
    assert len(before) == 13  # 12 block objects and fingerprint.json

    refused = reader == "no key"
    data = run_json("verify", "--remote", config, "--repair", code=2 if refused else 1)
    assert _snapshot(s3, prefix) == before  # every object, byte for byte
    (result,) = data["namespaces"]
    assert (data["bad_objects"], data["kept_objects"], data["deleted"]) == (0, 12, 0)
    assert result["namespace"] == ns and result["trust"] == "sealed" and result["checked"] == 12
    assert {k["reason"] for k in result["kept"]} == {"key"} and {k["action"] for k in result["kept"]} == {"kept"}
    (group,) = result["kept_why"]
    writer_id = _key_id(*writer_keys)
    assert group["objects"] == 12 and group["key_id"] == writer_id and f"key id {writer_id}" in group["why"]
    if refused:
        assert "no key" in group["why"] and "remote.trusted_bucket" in group["why"]
        (why,) = data["repair_refused"]
        assert ns in why and "remote.key_file" in why and "remote.key_env" in why
    else:
        assert f"this config holds {_key_id(reader_key)}" in group["why"] and data["repair_refused"] == []
    assert not data["clean"]

    result = run("verify", "--remote", config, "--repair", code=2 if refused else 1)
    assert f"kept 12 object(s) not ours to judge (never deleted): sealed under key id {writer_id}" in result.stdout
    assert "NOT JUDGED" in result.stdout
    if refused:
        assert "error: --repair refused" in result.stderr and ns in result.stderr
        assert "remote.key_file" in result.stderr
    else:
        assert "repaired: deleted 0 object(s); kept 12 not ours to judge" in result.stdout
    # Reporting alone is no error: without --repair a keyless config verifies the namespace.
    plain = run_json("verify", "--remote", config, code=1)
    assert plain["kept_objects"] == 12 and plain["repair_refused"] == []
    assert _snapshot(s3, prefix) == before


# ---------------------------------------------------------------- what the right key proves bad


def test_repair_with_the_right_key_deletes_what_it_proves_bad_and_nothing_else(
    remote_settings, rgw_server, tmp_path, monkeypatch
):
    rng = np.random.default_rng(3)
    hashes = [rng.bytes(32) for _ in range(6)]
    ns = _write(remote_settings, Keyring([bytes.fromhex(OLD_KEY)]), hashes, seed=4)
    # One block written by a node that already has the next key (a rotation under way).
    rotated = rng.bytes(32)
    assert _write(remote_settings, Keyring([bytes.fromhex(NEW_KEY)]), [rotated], seed=5) == ns
    s3 = rgw_server.admin_client()
    at = f"{remote_settings['prefix']}/{ns}"
    forged_key = block_key(at, rng.bytes(32), 0)
    s3.put_object(Bucket=BUCKET, Key=forged_key, Body=rng.bytes(BLOCK + 200))
    damaged_key = block_key(at, hashes[1], 0)
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=damaged_key)["Body"].read())
    body[-100] ^= 0x01
    s3.put_object(Bucket=BUCKET, Key=damaged_key, Body=bytes(body))
    copied_key = block_key(at, rng.bytes(32), 1)  # another block's genuine object, copied
    s3.copy_object(Bucket=BUCKET, Key=copied_key, CopySource={"Bucket": BUCKET, "Key": block_key(at, hashes[2], 1)})
    config = _reader(tmp_path, monkeypatch, remote_settings, OLD_KEY)
    before = _snapshot(s3, remote_settings["prefix"])
    assert len(before) == 12 + 2 + 2 + 1  # honest, rotated, forged and copied, fingerprint.json

    dry = run_json("verify", "--remote", config, "--dry-run", code=1)
    assert _snapshot(s3, remote_settings["prefix"]) == before
    (result,) = dry["namespaces"]
    split = {b["key"]: (b["reason"], b["action"]) for b in result["bad"]}
    assert split == {
        forged_key: ("format", "would delete"),
        damaged_key: ("auth", "would delete"),
        copied_key: ("mismatch", "would delete"),
    }
    assert all(b["provable"] for b in result["bad"])
    assert {k["key"] for k in result["kept"]} == {block_key(at, rotated, r) for r in (0, 1)}
    assert (dry["would_delete"], dry["deleted"], dry["kept_objects"], dry["dry_run"]) == (3, 0, 2, True)
    text = run("verify", "--remote", config, "--dry-run", code=1).stdout
    assert "dry run: --repair would delete 3 object(s) and keep 2 not ours to judge; nothing deleted" in text
    assert f"sealed under key id {_key_id(NEW_KEY)} (this config holds {_key_id(OLD_KEY)})" in text
    assert _snapshot(s3, remote_settings["prefix"]) == before

    repaired = run_json("verify", "--remote", config, "--repair", code=1)  # 1: two objects kept
    (result,) = repaired["namespaces"]
    assert repaired["deleted"] == 3 and {b["action"] for b in result["bad"]} == {"deleted"}
    after = _snapshot(s3, remote_settings["prefix"])
    assert after == {k: v for k, v in before.items() if k not in (forged_key, damaged_key, copied_key)}
    again = run_json("verify", "--remote", config, code=1)
    assert (again["bad_objects"], again["kept_objects"], again["namespaces"][0]["checked"]) == (0, 2, 13)


def test_a_fingerprint_json_copied_from_another_namespace_makes_no_honest_object_foreign(
    remote_settings, rgw_server, tmp_path, monkeypatch
):
    """fingerprint.json is no authenticated record: one that names another namespace is a
    problem of the namespace, and its objects are judged against the namespace id."""
    rng = np.random.default_rng(11)
    keyring = Keyring([bytes.fromhex(OLD_KEY)])
    ours = _write(remote_settings, keyring, [rng.bytes(32) for _ in range(3)], seed=12)
    theirs = _write(remote_settings, keyring, [rng.bytes(32)], seed=13, fp=OTHER)
    s3 = rgw_server.admin_client()
    prefix = remote_settings["prefix"]
    s3.copy_object(
        Bucket=BUCKET,
        Key=f"{prefix}/{ours}/fingerprint.json",
        CopySource={"Bucket": BUCKET, "Key": f"{prefix}/{theirs}/fingerprint.json"},
    )
    config = _reader(tmp_path, monkeypatch, remote_settings, OLD_KEY)
    before = _snapshot(s3, prefix)
    data = run_json("verify", "--remote", config, "-n", ours, "--repair", code=1)
    (result,) = data["namespaces"]
    assert result["checked"] == 6 and result["bad"] == [] and result["kept"] == []
    assert theirs in result["problems"][0]
    assert _snapshot(s3, prefix) == before


def test_a_plain_namespace_is_listed_beside_the_sealed_one_and_judged_as_plain(
    remote_settings, rgw_server, tmp_path, monkeypatch
):
    rng = np.random.default_rng(6)
    sealed = _write(remote_settings, Keyring([bytes.fromhex(OLD_KEY)]), [rng.bytes(32) for _ in range(2)], seed=7)
    plain_hashes = [rng.bytes(32) for _ in range(3)]
    plain = _write(remote_settings, None, plain_hashes, seed=8)
    assert plain == sealed + ".plain"
    s3 = rgw_server.admin_client()
    prefix = remote_settings["prefix"]
    damaged_key = block_key(f"{prefix}/{plain}", plain_hashes[0], 1)
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=damaged_key)["Body"].read())
    body[-10] ^= 0x80
    s3.put_object(Bucket=BUCKET, Key=damaged_key, Body=bytes(body))
    # A sealed object where objects are plain: no reader of that namespace can judge it.
    sealed_there = block_key(f"{prefix}/{plain}", rng.bytes(32), 0)
    s3.copy_object(
        Bucket=BUCKET,
        Key=sealed_there,
        CopySource={"Bucket": BUCKET, "Key": next(k for k in _listed(s3, prefix) if f"/{sealed}/" in k and "-r" in k)},
    )
    keyed = _reader(tmp_path, monkeypatch, remote_settings, OLD_KEY, "keyed")
    keyless = _reader(tmp_path, monkeypatch, remote_settings, None, "keyless")

    summary = run_json("summary", "--remote", keyed, "--config", keyless)
    by_name = {ns["namespace"]: ns for ns in summary["namespaces"]}
    assert {n: (ns["trust"], ns["objects"]) for n, ns in by_name.items()} == {
        sealed: ("sealed", 4),
        plain: ("plain", 7),
    }
    assert [r["reads"] for r in by_name[sealed]["read_by"]] == [True, False]
    assert [r["reads"] for r in by_name[plain]["read_by"]] == [False, True]
    assert "trust" in by_name[plain]["read_by"][0]["differences"][0]
    assert "plain: checksummed" in run("summary", "--remote", keyed).stdout
    listed = run_json("ls", "--remote", keyed, "-n", plain, "--limit", "0")
    assert [(ns["namespace"], ns["trust"], ns["total"]) for ns in listed["namespaces"]] == [(plain, "plain", 7)]

    data = run_json("verify", "--remote", keyed, "--repair", code=1)
    results = {ns["namespace"]: ns for ns in data["namespaces"]}
    assert results[sealed]["clean"] and results[sealed]["checked"] == 4
    assert [(b["key"], b["reason"], b["action"]) for b in results[plain]["bad"]] == [
        (damaged_key, "checksum", "deleted")
    ]
    assert [(k["key"], k["reason"]) for k in results[plain]["kept"]] == [(sealed_there, "key")]
    assert "plain objects" in results[plain]["kept_why"][0]["why"]
    assert damaged_key not in _listed(s3, prefix) and sealed_there in _listed(s3, prefix)
    # Without a key, the plain namespace is this config's own; the sealed one it only reports.
    only_plain = run_json("verify", "--remote", keyless, "-n", plain, "--repair", code=1)
    assert only_plain["repair_refused"] == [] and only_plain["kept_objects"] == 1
    refused = run_json("verify", "--remote", keyless, "--repair", code=2)
    assert [ns["namespace"] for ns in refused["namespaces"] if ns["unrepairable"]] == [sealed]
    assert len(_listed(s3, prefix)) == (4 + 1) + (6 + 1)  # nothing more deleted
    # clear narrowed to the plain namespace leaves the sealed one whole.
    assert run_json("clear", "--remote", keyed, "-n", plain, "--yes")["deleted_objects"] == 7
    left = _listed(s3, prefix)
    assert len(left) == 5 and all(k.startswith(f"{prefix}/{sealed}/") for k in left)


# ---------------------------------------------------------------- hostile keys


def test_hostile_keys_are_told_by_what_clients_refuse():
    for key, why in (
        (b"p/ns/a\x01b", "a control character"),
        (b"p/ns/a\x7fb", "a control character"),
        (b"p/ns/a\xc2\x85b", "a control character"),  # C1: obstore takes it; a terminal acts on it
        (b"p/ns/../b", "a '..' segment"),
        (b"p/./b", "a '.' segment"),
        (b"p//b", "an empty segment"),
        (b"p/\xff\xfe", "not UTF-8"),
        (b"p/ns/b/", None),  # a console's folder marker: foreign, not hostile
        (b"p/caf\xc3\xa9 a+b~c%41", None),
        (b"p/ns/\xe2\x80\xaeevil", None),  # right-to-left override: shown escaped, harmless
    ):
        assert hostile_reason(key) == why, key
    assert escaped_key(b"p/a\x01b\\c") == "p/a\\x01b\\\\c"
    assert escaped_key(b"p/\x1b[31mred\xff") == "p/\\x1b[31mred\\xff"
    assert escaped_key("p/\u202eevil caf\u00e9".encode()) == "p/\\u202eevil caf\u00e9"


def test_every_key_obstore_refuses_is_hostile(remote_settings, rgw_server):
    """What obstore's listing refuses, measured: each key alone under a prefix of its own."""
    s3 = rgw_server.admin_client()
    base = remote_settings["prefix"]
    keys = ["a\x01b", "a\x1fb", "a\x7fb", "a\x85b", "..", ".", "x//y", "x/", "caf\u00e9", "a b+c", "a%41~#[]"]
    for i, rel in enumerate(keys):
        prefix = f"{base}/k{i}"
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=b"x")
        client = S3Client(RemoteConfig.from_dict({**remote_settings, "prefix": prefix}))
        try:
            list(client.list_info(prefix + "/"))
            refused = False
        except RemoteError:
            refused = True
        if refused:
            assert hostile_reason(f"{prefix}/{rel}".encode()) is not None, rel
        else:
            assert rel in ("a\x85b", "x/") or hostile_reason(f"{prefix}/{rel}".encode()) is None, rel
    assert hostile_reason(f"{base}/k0/a\x01b".encode()) == "a control character"


def test_hostile_keys_stop_no_command_are_shown_escaped_and_clear_removes_them(
    remote_settings, rgw_server, tmp_path, monkeypatch
):
    rng = np.random.default_rng(9)
    ns = _write(remote_settings, Keyring([bytes.fromhex(OLD_KEY)]), [rng.bytes(32) for _ in range(2)], seed=10)
    s3 = rgw_server.admin_client()
    prefix = remote_settings["prefix"]
    hostile = {
        f"{prefix}/{ns}/bad\x01key": f"{prefix}/{ns}/bad\\x01key",
        f"{prefix}/{ns}/../escape": f"{prefix}/{ns}/../escape",
        f"{prefix}/\x1b[31mred": f"{prefix}/\\x1b[31mred",
    }
    for key in hostile:
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"not a block")
    settings = RemoteConfig.from_dict(remote_settings)
    with pytest.raises(RemoteError):  # what every command met: obstore fails the listing
        list(S3Client(settings).list_info(prefix + "/"))
    config = _reader(tmp_path, monkeypatch, remote_settings, OLD_KEY)

    summary = run_json("summary", "--remote", config)
    assert {h["key"]: h["why"] for h in summary["hostile_keys"]} == {
        hostile[f"{prefix}/{ns}/bad\x01key"]: "a control character",
        hostile[f"{prefix}/{ns}/../escape"]: "a '..' segment",
        hostile[f"{prefix}/\x1b[31mred"]: "a control character",
    }
    assert [(n["namespace"], n["objects"]) for n in summary["namespaces"]] == [(ns, 4)]
    listed = run_json("ls", "--remote", config, "--limit", "0")
    assert listed["namespaces"][0]["total"] == 4 and len(listed["hostile_keys"]) == 3
    verified = run_json("verify", "--remote", config, code=1)  # 1: hostile keys are there
    assert verified["namespaces"][0]["clean"] and verified["namespaces"][0]["checked"] == 4
    assert len(verified["hostile_keys"]) == 3 and not verified["clean"]
    for args, code in ((("summary",), 0), (("ls",), 0), (("verify",), 1)):
        out = run(*args, "--remote", config, code=code).output
        assert "\x01" not in out and "\x1b" not in out
        assert "3 hostile key(s)" in out and "bad\\x01key" in out and "\\x1b[31mred" in out

    dry = run_json("clear", "--remote", config, "--dry-run")
    assert dry["deleted_hostile_keys"] == 3 and len(_listed(s3, prefix)) == 5 + 3
    cleared = run_json("clear", "--remote", config, "--yes")
    assert (cleared["deleted_objects"], cleared["deleted_hostile_keys"]) == (5, 3)
    assert _listed(s3, prefix) == []
