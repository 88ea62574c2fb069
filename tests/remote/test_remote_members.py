"""The shared tier against its own members, on a real S3 server (Ceph RGW on 127.0.0.1):
a node with the wrong key, a node with only a retired key and a node of a trusted bucket
with no key run the fleet's requests through the whole hierarchy (``HierarchySpec`` under
the engine driver, tests/support/remote_node.py), and every object the fleet wrote is
still there, byte for byte, and served to a fresh fleet node. What a member cannot prove
bad it neither replaces nor deletes."""

from __future__ import annotations

import pytest
from support.s3_server import BUCKET, FLEET_KEY, skip_module_without_rgw

skip_module_without_rgw()

from support.remote_node import BLOCKS_PER_REQUEST, build, requests  # noqa: E402
from test_remote_store import FP, WAIT, blocks, read_back  # noqa: E402

from tiered_kv.remote import PutOutcome, RemoteConfig, RemoteStore  # noqa: E402
from tiered_kv.remote.format.object_format import PLAIN_SUFFIX, block_key  # noqa: E402
from tiered_kv.remote.tier import REMOTE  # noqa: E402

WRONG_KEY = "a7" * 32
NEW_KEY = "3c" * 32
CHAINS = 3
N = CHAINS * BLOCKS_PER_REQUEST


def _objects(rgw_server, prefix: str) -> dict[str, str]:
    """Every object under ``prefix``: key -> ETag (the MD5 of its bytes)."""
    s3 = rgw_server.admin_client()
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


@pytest.mark.parametrize(
    "member",
    ["wrong-key", "retired-key-only", "trusted-no-key"],
)
def test_a_member_racing_the_fleet_leaves_every_fleet_object_intact(
    tmp_path, rgw_server, remote_settings, monkeypatch, member
):
    """The fleet (key F) computes 3 chains; the member runs the same chains (it misses,
    recomputes and stores); then a fresh fleet node hits all 12 blocks from the bucket."""
    fleet_settings = remote_settings
    if member == "retired-key-only":
        # The fleet rotated to NEW_KEY (the old key F still read); the member kept F alone.
        monkeypatch.setenv("ROTATED_KEY", f"{NEW_KEY}\n{FLEET_KEY}")
        fleet_settings = {**remote_settings, "key_env": "ROTATED_KEY"}
        member_settings = remote_settings
    elif member == "wrong-key":
        monkeypatch.setenv("WRONG_FLEET_KEY", WRONG_KEY)
        member_settings = {**remote_settings, "key_env": "WRONG_FLEET_KEY"}
    else:
        member_settings = {**remote_settings, "key_env": None, "trusted_bucket": True}
    reqs = requests(0, CHAINS)
    with build(tmp_path / "fleet-a", fleet_settings) as a:
        first = a.run(reqs)
        assert first.computed == N and a.tier.store.stats().puts_stored == N
        namespace = a.remote.store.namespace
    before = _objects(rgw_server, remote_settings["prefix"])
    assert sum(k.startswith(namespace + "/") for k in before) == N + 1  # the blocks and fingerprint.json

    with build(tmp_path / "member", member_settings, expecting=True) as m:
        report = m.run(reqs)
        assert report.mismatches == 0 and report.hits_by_medium.get(REMOTE, 0) == 0
        stats = m.tier.store.stats()
        assert stats.forgeries_replaced == 0 and stats.damaged_deleted == 0
        if member == "trusted-no-key":
            # Plain objects live in a namespace of their own: it never met the fleet's.
            assert m.remote.store.namespace == namespace + PLAIN_SUFFIX
            assert stats.puts_stored == N and stats.gets_rejected == 0
        else:
            assert m.remote.store.namespace == namespace
            assert stats.rejected["key"] > 0 and stats.kept_unproven >= N  # read, and found at write: kept
            assert stats.puts_stored == 0
    after = _objects(rgw_server, remote_settings["prefix"])
    assert {k: v for k, v in after.items() if k in before} == before  # every fleet object, byte for byte

    with build(tmp_path / "fleet-fresh", fleet_settings, expecting=True) as fresh:
        again = fresh.run(reqs)
        assert again.hits_by_medium == {REMOTE: N}, again.hits_by_medium
        assert again.computed == 0 and again.mismatches == 0


def test_a_wrong_key_store_never_replaces_and_a_keyed_store_never_judges_a_plain_namespace(
    rgw_server, remote_settings, monkeypatch
):
    """Store level, both ways: the wrong key finds the fleet's objects at write and at read
    and leaves them; the fleet's objects and a trusted node's never share a key."""
    items = blocks(4, seed=21)
    with RemoteStore(RemoteConfig.from_dict(remote_settings), FP) as fleet:
        assert fleet.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 4
        keys = [block_key(fleet.namespace, h, r) for h, r, _ in items]
    before = _objects(rgw_server, remote_settings["prefix"])
    monkeypatch.setenv("WRONG_FLEET_KEY", WRONG_KEY)
    with RemoteStore(RemoteConfig.from_dict({**remote_settings, "key_env": "WRONG_FLEET_KEY"}), FP) as wrong:
        assert wrong.put_blocks(items).result(WAIT) == [PutOutcome.PRESENT] * 4
        assert read_back(wrong, items)[0] == [False] * 4
        s = wrong.stats()
        assert s.kept_unproven == 8 and s.rejected["key"] == 4 and s.forgeries_replaced == 0
        assert s.damaged_deleted == 0
    trusted = RemoteConfig.from_dict({**remote_settings, "key_env": None, "trusted_bucket": True})
    with RemoteStore(trusted, FP) as plain:
        assert plain.put_blocks(items).result(WAIT) == [PutOutcome.STORED] * 4  # its own keys
        assert read_back(plain, items)[0] == [True] * 4
        assert not set(block_key(plain.namespace, h, r) for h, r, _ in items) & set(keys)
    after = _objects(rgw_server, remote_settings["prefix"])
    assert {k: after[k] for k in before} == before
    with RemoteStore(RemoteConfig.from_dict(remote_settings), FP) as fleet:
        hits, bufs = read_back(fleet, items)
        assert hits == [True] * 4 and [bytes(b) for b in bufs] == [d for _, _, d in items]


@pytest.mark.parametrize("damage", ["truncated", "padded"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "verified"])
def test_an_object_of_another_size_is_repaired_by_the_next_node_that_meets_it(
    tmp_path, rgw_server, remote_settings, damage, recompute
):
    """A block's object cut short (a copier that stopped) or padded, in this fleet's own
    format: the first node that meets it proves it bad and deletes it, recomputes the
    block and stores it again, so a later node hits it. Under either load policy: with
    ``recompute`` the worker's read judges it, else the scheduler's verification."""
    reqs = requests(0, 1)
    with build(tmp_path / "a", remote_settings) as a:
        a.run(reqs)
        key = block_key(a.remote.store.namespace, reqs[0][1], 0)
    s3 = rgw_server.admin_client()
    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    bad = body[: len(body) // 2] if damage == "truncated" else body + bytes(100)
    s3.put_object(Bucket=BUCKET, Key=key, Body=bad)
    kw = {"expecting": True, "failed_loads_recomputed": recompute}
    with build(tmp_path / "b", remote_settings, **kw) as b:
        first = b.run(reqs)
        assert first.mismatches == 0 and first.computed >= BLOCKS_PER_REQUEST - 1
        assert b.tier.store.stats().damaged_deleted + b.remote.store.stats().damaged_deleted == 1
    with build(tmp_path / "c", remote_settings, **kw) as c:
        again = c.run(reqs)
        assert again.hits_by_medium == {REMOTE: BLOCKS_PER_REQUEST}, again.hits_by_medium
        assert again.mismatches == 0 and again.recomputed_after_failed_load == 0
    assert s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] == len(body)


@pytest.mark.parametrize("moment", ["between-reads", "before-replacing"])
def test_a_member_with_the_wrong_key_replaces_only_the_version_it_proved_bad(
    rgw_server, remote_settings, monkeypatch, moment
):
    """A damaged object that two writers meet at once: a fleet node repairs it while a
    node with the wrong key is judging it (between its two reads of an object of another
    size, or after its judgement and before its replacing write). The wrong-key node
    keeps the fleet's repaired object, which it cannot judge, and the fleet reads it."""
    import numpy as np

    from tiered_kv.remote.store.client import S3Client, WrongSize

    class Racing(S3Client):
        """An S3 client that runs ``race`` once, at ``moment``."""

        race = None

        def _once(self):
            race, self.race = self.race, None
            if race is not None:
                race()

        def get_tagged(self, key, size=None, limit=None):
            try:
                return super().get_tagged(key, size, limit)
            except WrongSize:
                if moment == "between-reads":
                    self._once()
                raise

        def replace(self, key, parts, tag):
            if moment == "before-replacing":
                self._once()
            return super().replace(key, parts, tag)

    monkeypatch.setenv("WRONG_FLEET_KEY", WRONG_KEY)
    wrong_config = RemoteConfig.from_dict({**remote_settings, "key_env": "WRONG_FLEET_KEY"})
    rng = np.random.default_rng(7)
    item = (rng.bytes(32), 0, rng.bytes(8192))
    s3 = rgw_server.admin_client()
    with RemoteStore(RemoteConfig.from_dict(remote_settings), FP) as fleet:
        key = block_key(fleet.namespace, item[0], 0)
        assert fleet.put_blocks([item]).result(WAIT) == [PutOutcome.STORED]
        good = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=key, Body=good[: len(good) // 2])
        client = Racing(wrong_config)
        client.race = lambda: fleet.put_blocks([item]).result(WAIT)
        with RemoteStore(wrong_config, FP, client=client) as wrong:
            assert wrong.put_blocks([item]).result(WAIT) == [PutOutcome.PRESENT]
            assert client.race is None  # the fleet's repair ran
            assert wrong.stats().forgeries_replaced == 0 and wrong.stats().kept_unproven == 1
        assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() != good[: len(good) // 2]
        buf = bytearray(len(item[2]))
        assert fleet.get_blocks([(item[0], 0, buf)]).result(WAIT) == [True] and bytes(buf) == item[2]


def test_a_writer_whose_proven_bad_object_a_reader_deleted_meanwhile_stores_its_own(rgw_server, remote_settings):
    """A fleet node proves an object bad; before its replacing write a reader deletes
    that object: the conditional replacement finds no version to replace, and the
    node stores its block anew instead of taking the empty key for its copy."""
    import numpy as np

    from tiered_kv.remote.store.client import S3Client

    config = RemoteConfig.from_dict(remote_settings)
    s3 = rgw_server.admin_client()

    class ReaderFirst(S3Client):
        def replace(self, key, parts, tag):
            s3.delete_object(Bucket=BUCKET, Key=key)  # a reader's delete of the damaged object
            return super().replace(key, parts, tag)

    rng = np.random.default_rng(11)
    item = (rng.bytes(32), 0, rng.bytes(8192))
    with RemoteStore(config, FP) as fleet:
        key = block_key(fleet.namespace, item[0], 0)
        assert fleet.put_blocks([item]).result(WAIT) == [PutOutcome.STORED]
        good = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=key, Body=good[: len(good) // 2])
    with RemoteStore(config, FP, client=ReaderFirst(config)) as node:
        assert node.put_blocks([item]).result(WAIT) == [PutOutcome.STORED]
        buf = bytearray(len(item[2]))
        assert node.get_blocks([(item[0], 0, buf)]).result(WAIT) == [True] and bytes(buf) == item[2]
