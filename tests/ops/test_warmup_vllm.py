"""The warm-up's block keys are the offload keys vLLM 0.33 itself makes for the same
tokens and settings (its request block hasher, every algorithm, with and without a
fixed PYTHONHASHSEED, plus the KV-group index), so a server finds what the warm-up
wrote (``test_warmup_served.py`` serves them). Marked ``vllm``."""

from __future__ import annotations

import pytest

from test_warmup import GPU_BLOCK, PROMPTS, engine, expected_blocks, model_dir, write_inputs  # noqa: F401
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import list_namespaces
from tiered_kv.ops.hashing import chunk_keys
from tiered_kv.ops.inspect import read_entries
from tiered_kv.ops.warmup import warmup
from tiered_kv.ops.warmup.inputs import load_config, read_extra_config
from tiered_kv.ops.warmup.layouts import LayoutRequest


@pytest.mark.vllm
@pytest.mark.parametrize(
    "algo,seed,factor", [("sha256", None, 1), ("sha256_cbor", None, 2), ("xxhash", "99", 1), ("xxhash_cbor", "99", 2)]
)
def test_written_keys_equal_vllms_block_hashes(engine, tmp_path, monkeypatch, algo, seed, factor):  # noqa: F811
    from support import vllm_harness
    from vllm.v1.kv_offload.base import make_offload_key

    from tiered_kv.ops.warmup.vllm_pages import VllmPagesLayout

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    _, config_file = write_inputs(tmp_path, block_size=GPU_BLOCK * factor, hash_algorithm=algo)
    extra = read_extra_config(config_file)
    report = warmup(PROMPTS, engine, load_config(config_file), gpu_block_size=GPU_BLOCK, extra_config=extra)
    assert report.blocks_written == expected_blocks(PROMPTS, GPU_BLOCK * factor)
    (ns,) = list_namespaces(tmp_path / "cache")
    table = read_entries(ns)
    written = {table.hash(i) for i in range(len(table))}
    theirs = set()
    for tokens in PROMPTS:
        theirs |= {
            make_offload_key(h, 0) for h in chunk_keys(vllm_harness.hash_blocks(tokens, GPU_BLOCK, algo), factor)
        }
    assert written == theirs
    # The disk manager a server opens finds them under those keys.
    m = DiskOffloadingManager(
        tmp_path / "cache",
        ns.fingerprint,
        VllmPagesLayout(
            LayoutRequest(
                engine.geometry, engine.dtype, GPU_BLOCK, factor, 1, model_dir=engine.model_path, extra_config=extra
            )
        ).kv_layout,
        disk_bytes=8 << 20,
    )
    try:
        assert all(m.is_loadable(k) for k in theirs)
    finally:
        m.shutdown()
