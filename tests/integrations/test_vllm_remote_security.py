"""The shared tier under vLLM 0.33 against a writer of the bucket and across tenants:
the real scheduler and worker connector (tests/support/vllm_harness.py, ``worker="real"``, CPU
tensors) on a real Ceph RGW (tests/support/s3_server.py).

A patched object and a replayed one in the bucket are never loaded: the node computes
those chunks, its uploads replace the forgeries, and the next node hits every chunk with
the right bytes. Requests of two tenants (vLLM's ``cache_salt``, folded into the first
block's hash and so into every chained hash) never hit each other's chunks in the CPU,
disk or shared tier, in either direction, while a tenant's own requests hit.
"""

from __future__ import annotations

import time

import pytest
from support.s3_server import BUCKET, skip_module_without_rgw

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)
skip_module_without_rgw()

from support import vllm_harness as vh  # noqa: E402
from test_vllm_remote import (  # noqa: E402
    BLOCK,
    CHUNKS,
    _compute_on,
    _keys,
    _node,
    _prompt,
    _remote_store,
    _uploaded,
)

from tiered_kv.remote.format.object_format import SEALED_HEADER_BYTES  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _key_of(rgw_server, prefix: str, chunk_key: bytes) -> str:
    listed = rgw_server.admin_client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    (key,) = [o["Key"] for o in listed.get("Contents", ()) if o["Key"].endswith(f"{chunk_key.hex()}-r0")]
    return key


def test_forged_and_replayed_chunks_are_never_loaded_and_do_not_stick(tmp_path, model_dir, rgw_server, remote_settings):
    prompt = _prompt(21)
    keys = _keys(prompt)
    with _node(model_dir, remote_settings, tmp_path / "a") as a:
        computed = _compute_on(a, prompt)
    s3 = rgw_server.admin_client()
    prefix = remote_settings["prefix"]
    objects = {i: _key_of(rgw_server, prefix, keys[i]) for i in range(CHUNKS)}
    body = {i: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for i, k in objects.items()}
    # Chunk 1: chunk 3's object with its header's block hash patched to chunk 1's.
    patched = bytearray(body[3])
    patched[SEALED_HEADER_BYTES : SEALED_HEADER_BYTES + len(keys[1])] = keys[1]
    s3.put_object(Bucket=BUCKET, Key=objects[1], Body=bytes(patched))
    # Chunk 3: chunk 4's object, verbatim (a replay under another key).
    s3.put_object(Bucket=BUCKET, Key=objects[3], Body=body[4])

    with _node(model_dir, remote_settings, tmp_path / "b") as b:
        req_id = b.add_request(prompt, max_tokens=3)
        while b.scheduler.requests[req_id].num_output_tokens < 1:
            b.step()
            b.wait_background()
            time.sleep(0.0005)
        assert b.prefix_hits[req_id].external == BLOCK  # chunk 0 only: chunk 1 fails authentication
        assert all(b.kv_matches(req_id))
        assert [b.gpu_block_bytes(i) for i in b.block_ids(req_id)[:CHUNKS]] == computed
        verifier = b.manager.check("remote").verifier.store.stats()
        assert verifier.rejected["auth"] == 1 and verifier.rejected["mismatch"] == 1  # chunks 1 and 3
        assert verifier.gets_hit == CHUNKS - 2
        assert verifier.damaged_deleted == 2  # both proven bad by a node that holds the key: gone
        b.settle()
        _uploaded(b)
        stored = _remote_store(b).stats()
        assert stored.forgeries_replaced == 0 and stored.puts_stored == 2  # chunks 1 and 3 written afresh

    with _node(model_dir, remote_settings, tmp_path / "c") as c:
        req_id = c.add_request(prompt, max_tokens=3)
        while c.scheduler.requests[req_id].num_output_tokens < 1:
            c.step()
            c.wait_background()
            time.sleep(0.0005)
        assert c.prefix_hits[req_id].external == CHUNKS * BLOCK
        assert [c.gpu_block_bytes(i) for i in c.block_ids(req_id)[:CHUNKS]] == computed
        c.settle()


def _serve(h: vh.VllmHarness, prompt: list[int], salt: str | None) -> tuple[int, list[bytes]]:
    """Serve ``prompt`` for tenant ``salt`` from an empty GPU prefix cache: (tokens vLLM
    took from the connector, the chunks' KV bytes)."""
    h.reset_gpu_prefix_cache()
    req_id = h.add_request(prompt, max_tokens=3, cache_salt=salt)
    while h.scheduler.requests[req_id].num_output_tokens < 1:
        h.step()
        h.wait_background()
        time.sleep(0.0005)
    assert all(h.kv_matches(req_id))
    chunks = [h.gpu_block_bytes(i) for i in h.block_ids(req_id)[:CHUNKS]]
    external = h.prefix_hits[req_id].external
    h.settle()
    _uploaded(h)
    return external, chunks


def test_tenants_never_hit_each_others_chunks_in_any_tier(tmp_path, model_dir, remote_settings):
    prompt = _prompt(22)
    salted = {s: vh.hash_blocks(prompt, BLOCK, cache_salt=s) for s in ("tenant-1", "tenant-2")}
    assert not set(salted["tenant-1"]) & set(salted["tenant-2"])  # every chained hash differs
    with _node(model_dir, remote_settings, tmp_path / "a") as a:
        assert _serve(a, prompt, "tenant-1")[0] == 0
        # tenant-1's chunks are in a's CPU tier, disk tier and the bucket: tenant-2 misses all.
        external, two = _serve(a, prompt, "tenant-2")
        assert external == 0
        external, one = _serve(a, prompt, "tenant-1")
        assert external == CHUNKS * BLOCK and one != two  # a's own CPU tier, tenant-1's bytes
        assert a.manager.stats.tiers["cpu"]["hits"] == CHUNKS
        assert _serve(a, prompt, None)[0] == 0  # no salt: a third tenant
    with _node(model_dir, remote_settings, tmp_path / "a") as a2:  # same disk, empty CPU tier
        assert _serve(a2, prompt, "tenant-3")[0] == 0
        external, again = _serve(a2, prompt, "tenant-2")
        assert external == CHUNKS * BLOCK and again == two
        assert a2.manager.stats.tiers["disk"]["hits"] == CHUNKS and a2.manager.stats.tiers["remote"]["hits"] == 0
    with _node(model_dir, remote_settings, tmp_path / "b") as b:  # nothing local: the bucket only
        assert _serve(b, prompt, "tenant-4")[0] == 0
        external, from_bucket = _serve(b, prompt, "tenant-1")
        assert external == CHUNKS * BLOCK and from_bucket == one
        external, from_bucket = _serve(b, prompt, "tenant-2")
        assert external == CHUNKS * BLOCK and from_bucket == two
        assert b.manager.stats.tiers["remote"]["hits"] == 2 * CHUNKS
