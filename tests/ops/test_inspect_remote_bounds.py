"""The operator's tools on a shared bucket against a real Ceph RGW: namespaces whose
prefixes nest (``team`` and ``team/kv``) cannot touch each other's objects through
``verify --repair``, ``evict`` or ``clear``; a 200 MiB block object and a 64 MiB
doctor probe are checked in bounded memory; doctor names a missing key and warns about
plain http and a trusted bucket."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import struct

import numpy as np
import pytest
from support.s3_server import BUCKET, FLEET_KEY_ENV, skip_module_without_rgw
from test_inspect_remote import FP, run_json

from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore
from tiered_kv.remote.format.object_format import SEALED_HEADER_BYTES, block_key

skip_module_without_rgw()

WAIT = 120


def _fill(settings: dict, seed: int, n: int = 4) -> list[bytes]:
    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(32) for _ in range(n)]
    with RemoteStore(RemoteConfig.from_dict(settings), FP) as store:
        items = [(h, r, rng.bytes(20_000)) for h in hashes for r in (0, 1)]
        assert store.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * len(items)
    return hashes


def _snapshot(s3, prefix: str) -> dict[str, bytes]:
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return {k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


def _config(tmp_path, name: str, settings: dict):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"model_id": "org/model", "cpu_bytes": "1GiB", "remote": settings}))
    return path


@pytest.mark.parametrize("acting", ["outer", "inner"])
def test_nested_prefixes_never_touch_each_other(remote_settings, rgw_server, tmp_path, acting):
    base = remote_settings["prefix"]
    prefixes = {"outer": f"{base}/team", "inner": f"{base}/team/kv"}
    settings = {name: {**remote_settings, "prefix": p} for name, p in prefixes.items()}
    hashes = {name: _fill(s, seed) for seed, (name, s) in enumerate(settings.items())}
    configs = {name: _config(tmp_path, name, s) for name, s in settings.items()}
    other = "inner" if acting == "outer" else "outer"
    s3 = rgw_server.admin_client()
    # Damage one object of each: verify of one reports its own, repair deletes its own.
    for name in prefixes:
        ns = run_json("summary", "--remote", configs[name])["namespaces"][0]["namespace"]
        key = block_key(f"{prefixes[name]}/{ns}", hashes[name][0], 0)
        body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        body[-50] ^= 1
        s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    untouched = _snapshot(s3, prefixes[other])
    if acting == "inner":
        untouched = {k: v for k, v in untouched.items() if not k.startswith(prefixes["inner"] + "/")}
    before = _snapshot(s3, prefixes[acting])

    summary = run_json("summary", "--remote", configs[acting])
    assert [ns["objects"] for ns in summary["namespaces"]] == [8]
    assert summary["foreign_keys"] == (9 if acting == "outer" else 0)
    verified = run_json("verify", "--remote", configs[acting], code=1)
    assert verified["bad_objects"] == 1 and verified["namespaces"][0]["checked"] == 8
    assert run_json("verify", "--remote", configs[acting], "--repair")["deleted"] == 1
    dry = run_json("clear", "--remote", configs[acting], "--dry-run")
    assert dry["dry_run"] and dry["deleted_objects"] == 8  # 7 blocks and fingerprint.json
    assert len(_snapshot(s3, prefixes[acting])) == len(before) - 1
    evicted = run_json("evict", "--remote", configs[acting], "--to-size", "0")
    assert evicted["deleted_objects"] == 7
    cleared = run_json("clear", "--remote", configs[acting], "--yes")
    assert cleared["deleted_objects"] == 1  # what is left: fingerprint.json
    left = _snapshot(s3, prefixes[acting])
    if acting == "outer":
        left = {k: v for k, v in left.items() if not k.startswith(prefixes["inner"] + "/")}
    assert left == {}
    after = _snapshot(s3, prefixes[other])
    if acting == "inner":
        after = {k: v for k, v in after.items() if not k.startswith(prefixes["inner"] + "/")}
    assert after == untouched  # byte-identical, every key


def _in_child(task: str, args: tuple, env: dict) -> tuple[object, int]:
    """Run ``task`` in this fresh process; (its result, ru_maxrss growth in KiB)."""
    os.environ.update(env)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if task == "verify":
        from tiered_kv.cli import _load_commands, app
        from typer.testing import CliRunner

        _load_commands()
        result = CliRunner().invoke(app, ["inspect", "verify", "--remote", args[0], "--json"])
        out: object = json.loads(result.stdout)
    else:
        from tiered_kv.config import TieredConfig
        from tiered_kv.ops import doctor as dr

        check = dr.check_remote(TieredConfig.from_dict({"remote": args[0]}))
        out = (check.status, check.message)
    return out, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before


def _child(task: str, *args) -> tuple[object, int]:
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", FLEET_KEY_ENV))}
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_in_child, (task, args, env))


def test_a_200_mib_block_object_is_verified_in_bounded_memory(remote_settings, rgw_server, tmp_path):
    (h,) = _fill(remote_settings, 7, n=1)
    config = _config(tmp_path, "kv", remote_settings)
    ns = run_json("summary", "--remote", config)["namespaces"][0]["namespace"]
    key = block_key(f"{remote_settings['prefix']}/{ns}", h, 1)
    s3 = rgw_server.admin_client()
    honest = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    header_len = SEALED_HEADER_BYTES + 32
    payload = 200 << 20
    header = bytearray(honest[:header_len])
    struct.pack_into("<Q", header, SEALED_HEADER_BYTES - 8, payload)  # payload_len claims 200 MiB
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(header) + bytes(payload + 16))
    data, grown_kib = _child("verify", str(config))
    (result,) = data["namespaces"]
    assert [b["reason"] for b in result["bad"]] == ["auth"]  # streamed through to the tag
    assert result["checked"] == 2 and result["bytes_read"] > payload
    assert grown_kib < 96 * 1024, f"{grown_kib} KiB"  # whole, the object alone is 200 MiB


def test_doctor_reads_no_more_than_a_record_and_names_what_is_wrong(remote_settings, rgw_server, tmp_path):
    s3 = rgw_server.admin_client()
    s3.put_object(Bucket=BUCKET, Key=f"{remote_settings['prefix']}/doctor-probe", Body=bytes(64 << 20))
    (status, message), grown_kib = _child("doctor", remote_settings)
    assert status == "warn" and "doctor-probe holds an object" in message
    assert grown_kib < 32 * 1024, f"{grown_kib} KiB"
    (status, message), _ = _child("doctor", {k: v for k, v in remote_settings.items() if k != "key_env"})
    assert status == "fail" and "remote.key_file" in message and "remote.trusted_bucket" in message
    trusted = {**remote_settings, "key_env": None, "trusted_bucket": True}
    s3.delete_object(Bucket=BUCKET, Key=f"{remote_settings['prefix']}/doctor-probe")
    (status, message), _ = _child("doctor", trusted)
    assert status == "warn" and "plaintext" in message
