"""``tiered-kv inspect summary|ls|verify --remote CONFIG`` against a real Ceph RGW.

Blocks are written by the shared tier's own ``RemoteStore`` (headers, checksums, the
namespace's fingerprint.json), under two fingerprints; the inspector then summarises and
lists them, and verify finds a damaged object (its bytes overwritten through the S3 API
as a faulty disk or a buggy copier would) and a foreign one (another namespace's object
copied under this namespace's key), exits 1, and with --repair deletes them.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from support.s3_server import BUCKET, skip_module_without_rgw
from typer.testing import CliRunner

from tiered_kv.cli import _load_commands, app
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore
from tiered_kv.remote.format.object_format import SEALED_HEADER_BYTES, block_key

skip_module_without_rgw()

_load_commands()
runner = CliRunner()
WAIT = 120
BLOCK = 40_000
OBJECT = SEALED_HEADER_BYTES + 32 + BLOCK + 16  # header, 32-byte hash, payload, tag
#: The config's node: model org/model, TP 2. Another model's node shares the bucket.
FP = Fingerprint("org/model", "main", "float16", 16, 16, (("layer.0", (2, 16, 2, 8)),), ("kv_first",), 2, "sha256", "")
OTHER = dataclasses.replace(FP, model_id="other/model", tp_size=1)


def run(*args: str, code: int = 0):
    result = runner.invoke(app, ["inspect", *map(str, args)])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def run_json(*args: str, code: int = 0) -> dict:
    return json.loads(run(*args, "--json", code=code).stdout)


@pytest.fixture
def bucket(remote_settings, tmp_path):
    """A config file naming a fresh prefix of the test bucket, and the blocks written
    there: 5 blocks of FP with both ranks plus one with rank 0 only, 3 of OTHER."""
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"model_id": "org/model", "cpu_bytes": "1GiB", "remote": remote_settings}))
    rng = np.random.default_rng(0)
    settings = RemoteConfig.from_dict(remote_settings)
    ours = [rng.bytes(32) for _ in range(6)]
    theirs = [rng.bytes(32) for _ in range(3)]
    with RemoteStore(settings, FP) as a, RemoteStore(settings, OTHER) as b:
        items = [(h, r, rng.bytes(BLOCK)) for h in ours for r in (0, 1)][:-1]
        assert a.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 11
        assert b.put_blocks([(h, 0, rng.bytes(BLOCK)) for h in theirs]).result(WAIT) == [PutOutcome.STORED] * 3
        namespaces = a.namespace.rsplit("/", 1)[1], b.namespace.rsplit("/", 1)[1]
    return config, namespaces, ours, theirs


def test_summary_counts_objects_per_namespace_and_marks_the_one_the_config_reads(bucket):
    config, (ours, theirs), _, _ = bucket
    data = run_json("summary", "--remote", config)
    assert data["schema"] == "tiered-kv/inspect-summary" and data["schema_version"] == 1
    assert data["path"].startswith(f"s3://{BUCKET}/t-") and data["bucket"] == BUCKET
    by_id = {ns["namespace"]: ns for ns in data["namespaces"]}
    assert set(by_id) == {ours, theirs}
    a, b = by_id[ours], by_id[theirs]
    assert (a["objects"], a["blocks"], a["complete_blocks"], a["bytes"]) == (11, 6, 5, 11 * OBJECT)
    assert (b["objects"], b["blocks"], b["complete_blocks"]) == (3, 3, 3)
    assert a["fingerprint"]["model_id"] == "org/model" and a["fingerprint"]["tp_size"] == 2
    assert a["read_by"] == [{"config": str(config), "reads": True, "differences": []}]
    assert not b["read_by"][0]["reads"] and "model_id" in b["read_by"][0]["differences"][0]
    assert data["objects"] == 14 and a["problems"] == [] and data["stray_objects"] == []
    assert a["newest"].endswith("Z")  # ISO 8601, as every timestamp of the envelope

    table = run("summary", "--remote", config).stdout
    assert ours in table and theirs in table and "org/model" in table and "14 objects" in table
    # --namespace narrows it; a second --config is marked too.
    only = run_json("summary", "--remote", config, "--namespace", theirs[:6], "--config", config)
    assert [ns["namespace"] for ns in only["namespaces"]] == [theirs]
    assert [r["reads"] for r in only["namespaces"][0]["read_by"]] == [False, False]


def test_ls_lists_each_object_with_hash_rank_size_and_last_modified(bucket):
    config, (ours, _), hashes, _ = bucket
    data = run_json("ls", "--remote", config, "--namespace", ours, "--sort", "hash", "--limit", "0")
    (ns,) = data["namespaces"]
    assert (ns["total"], ns["matching"], ns["tp_size"]) == (11, 11, 2)
    listed = [(o["hash"], o["rank"]) for o in ns["objects"]]
    assert listed == sorted((h.hex(), r) for h in hashes for r in (0, 1) if (h, r) != (hashes[-1], 1))
    assert all(o["size"] == OBJECT and o["last_modified"].endswith("Z") for o in ns["objects"])
    # Filters: a hash prefix, an age, a limit.
    one = run_json("ls", "--remote", config, "-n", ours, "--hash", hashes[2].hex()[:10])["namespaces"][0]
    assert sorted((o["hash"], o["rank"]) for o in one["objects"]) == [(hashes[2].hex(), 0), (hashes[2].hex(), 1)]
    assert run_json("ls", "--remote", config, "-n", ours, "--older-than", "1h")["namespaces"][0]["matching"] == 0
    assert len(run_json("ls", "--remote", config, "-n", ours, "--limit", "3")["namespaces"][0]["objects"]) == 3
    assert hashes[0].hex()[:16] in run("ls", "--remote", config, "-n", ours, "--limit", "0").stdout


def test_verify_is_clean_on_what_the_tier_wrote(bucket):
    config, (ours, theirs), _, _ = bucket
    data = run_json("verify", "--remote", config)
    assert data["clean"] and data["bad_objects"] == 0
    checked = {ns["namespace"]: ns["checked"] for ns in data["namespaces"]}
    assert checked == {ours: 11, theirs: 3}
    # A sample: --limit objects per namespace.
    sample = run_json("verify", "--remote", config, "--limit", "2")
    assert {ns["namespace"]: ns["checked"] for ns in sample["namespaces"]} == {ours: 2, theirs: 2}
    assert "OK" in run("verify", "--remote", config).stdout


def test_verify_reports_a_damaged_and_a_foreign_object_and_repair_deletes_them(bucket, rgw_server, remote_settings):
    config, (ours, theirs), hashes, foreign_hashes = bucket
    s3 = rgw_server.admin_client()
    prefix = remote_settings["prefix"]
    damaged_key = block_key(f"{prefix}/{ours}", hashes[1], 0)
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=damaged_key)["Body"].read())
    body[-100] ^= 0x01  # one bit of the payload
    s3.put_object(Bucket=BUCKET, Key=damaged_key, Body=bytes(body))
    # Another namespace's object copied under a key of ours (its hash, our namespace).
    foreign_key = block_key(f"{prefix}/{ours}", foreign_hashes[0], 0)
    s3.copy_object(
        Bucket=BUCKET,
        Key=foreign_key,
        CopySource={"Bucket": BUCKET, "Key": block_key(f"{prefix}/{theirs}", foreign_hashes[0], 0)},
    )
    # A key that is not this format's is left alone by every command (it may be another
    # prefix's: namespaces cannot overlap).
    stray_key = f"{prefix}/{ours}/notes.txt"
    s3.put_object(Bucket=BUCKET, Key=stray_key, Body=b"not a block")

    data = run_json("verify", "--remote", config, code=1)
    assert not data["clean"] and data["bad_objects"] == 2
    (a,) = [ns for ns in data["namespaces"] if ns["namespace"] == ours]
    (b,) = [ns for ns in data["namespaces"] if ns["namespace"] == theirs]
    assert b["clean"] and b["checked"] == 3
    reasons = {bad["key"]: bad["reason"] for bad in a["bad"]}
    assert reasons == {damaged_key: "auth", foreign_key: "foreign"}
    (foreign,) = [bad for bad in a["bad"] if bad["reason"] == "foreign"]
    assert theirs in foreign["detail"] and foreign["hash"] == foreign_hashes[0].hex()
    text = run("verify", "--remote", config, code=1).stdout
    assert "BAD" in text and "auth" in text and "foreign" in text and "--repair" in text

    repaired = run_json("verify", "--remote", config, "--repair")
    assert repaired["deleted"] == 2 and repaired["clean"]
    assert s3.get_object(Bucket=BUCKET, Key=stray_key)["Body"].read() == b"not a block"
    assert run_json("summary", "--remote", config)["foreign_keys"] == 1
    after = run_json("verify", "--remote", config)
    assert after["clean"] and {ns["namespace"]: ns["checked"] for ns in after["namespaces"]} == {ours: 10, theirs: 3}


def test_repair_leaves_an_object_replaced_since_it_was_judged(bucket, rgw_server, remote_settings):
    """Verification may take hours on a large bucket: a node that meets the damaged
    object meanwhile replaces it with its honest write. The repair deletes only the
    version it proved bad."""
    from tiered_kv.ops.inspect.remote import open_shared_tier
    from tiered_kv.ops.inspect.remote_verify import CHANGED, repair_shared_tier, verify_shared_tier

    config, (ours, _), hashes, _ = bucket
    s3 = rgw_server.admin_client()
    key = block_key(f"{remote_settings['prefix']}/{ours}", hashes[2], 0)
    honest = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=honest[:-1] + bytes([honest[-1] ^ 1]))  # a flipped tag bit
    tier = open_shared_tier(str(config))
    results = verify_shared_tier(tier)
    assert [b["key"] for r in results for b in r.bad] == [key]
    s3.put_object(Bucket=BUCKET, Key=key, Body=honest)  # as a node's replacing write leaves it
    assert repair_shared_tier(tier, results) == 0
    assert [b["action"] for r in results for b in r.bad] == [CHANGED]
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == honest
    # Judged again, unchanged since: deleted.
    s3.put_object(Bucket=BUCKET, Key=key, Body=honest[:-1] + bytes([honest[-1] ^ 1]))
    assert repair_shared_tier(tier, verify_shared_tier(tier)) == 1
    assert run_json("verify", "--remote", config)["clean"]


def test_without_its_fingerprint_json_a_namespace_still_tells_foreign_objects(bucket, rgw_server, remote_settings):
    """A lifecycle rule may expire a namespace's fingerprint.json: a warning, not a fault;
    the namespace id is the start of the digest every header holds."""
    config, (ours, theirs), _, foreign_hashes = bucket
    s3 = rgw_server.admin_client()
    prefix = remote_settings["prefix"]
    s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/{ours}/fingerprint.json")
    data = run_json("verify", "--remote", config)
    (a,) = [ns for ns in data["namespaces"] if ns["namespace"] == ours]
    assert data["clean"] and a["checked"] == 11 and "fingerprint.json" in a["warnings"][0]
    summary = run_json("summary", "--remote", config, "-n", ours)["namespaces"][0]
    assert summary["fingerprint"] is None and summary["read_by"][0]["reads"] is None and summary["warnings"]
    assert "cannot tell" in run("summary", "--remote", config, "-n", ours).output
    # The live fleet's own namespace, its fingerprint.json expired: `--unread-by` the
    # live config must not judge it unread; the other model's namespace it can judge.
    cleared = run_json("clear", "--remote", config, "--unread-by", config, "--yes", "--dry-run")
    assert [ns["namespace"] for ns in cleared["namespaces"]] == [theirs]
    foreign_key = block_key(f"{prefix}/{ours}", foreign_hashes[1], 0)
    s3.copy_object(
        Bucket=BUCKET,
        Key=foreign_key,
        CopySource={"Bucket": BUCKET, "Key": block_key(f"{prefix}/{theirs}", foreign_hashes[1], 0)},
    )
    data = run_json("verify", "--remote", config, "-n", ours, code=1)
    assert [(b["key"], b["reason"]) for b in data["namespaces"][0]["bad"]] == [(foreign_key, "foreign")]


def test_bad_input_gets_one_line(bucket, tmp_path):
    config, _, _, _ = bucket
    no_remote = tmp_path / "plain.json"
    no_remote.write_text(json.dumps({"model_id": "org/model"}))
    for args, words in (
        (("summary", "--remote", no_remote), "no 'remote' key"),
        (("summary", "--remote", tmp_path / "missing.json"), "does not exist"),
        (("summary", tmp_path, "--remote", config), "not both"),
        (("summary",), "--remote CONFIG"),
        (("ls", "--remote", config, "--min-hits", "2"), "--min-hits"),
        (("ls", "--remote", config, "--sort", "slot"), "--sort"),
        (("verify", tmp_path, "--limit", "3"), "--limit applies to --remote only"),
    ):
        result = run(*args, code=2)
        assert words in result.output and "Traceback" not in result.output


def test_a_bucket_that_does_not_exist_is_one_error_naming_it(remote_settings, tmp_path):
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"remote": {**remote_settings, "bucket": "no-such-bucket-here"}}))
    data = json.loads(run("summary", "--remote", config, "--json", code=2).stdout)
    assert "no-such-bucket-here" in data["error"] and "BucketMissing" in data["error"]


def test_a_fingerprint_json_planted_in_the_bucket_is_shown_not_read_as_markup(bucket, rgw_server, remote_settings):
    config, _, _, _ = bucket
    record = {"format": 2, "fingerprint": {**FP.to_dict(), "model_id": "[/oops][green]org/model[/green]"}}
    key = f"{remote_settings['prefix']}/0123456789abcdef/fingerprint.json"
    rgw_server.admin_client().put_object(Bucket=BUCKET, Key=key, Body=json.dumps(record).encode())
    assert "[/oops][green]org/model[/green]" in run("summary", "--remote", config).output
