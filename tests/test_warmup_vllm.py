"""The warm-up's block keys equal the prefix hashes vLLM 0.33 itself computes for the same
tokens and settings (its request block hasher, every algorithm, with and without a
fixed PYTHONHASHSEED), so a server finds what the warm-up wrote. Marked ``vllm``."""

from __future__ import annotations

import pytest
import torch

from test_warmup import GPU_BLOCK, PROMPTS, engine, expected_blocks, model_dir, write_inputs  # noqa: F401
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import list_namespaces
from tiered_kv.ops.hashing import chunk_keys
from tiered_kv.ops.inspect import read_entries
from tiered_kv.ops.warmup import warmup
from tiered_kv.ops.warmup.inputs import load_config
from tiered_kv.ops.warmup.layouts import KvFirstLayout, LayoutRequest


@pytest.mark.vllm
@pytest.mark.parametrize(
    "algo,seed,factor", [("sha256", None, 1), ("sha256_cbor", None, 2), ("xxhash", "99", 1), ("xxhash_cbor", "99", 2)]
)
def test_written_keys_equal_vllms_block_hashes(engine, tmp_path, monkeypatch, algo, seed, factor):  # noqa: F811
    import vllm_harness

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    _, config_file = write_inputs(tmp_path, block_size=GPU_BLOCK * factor, hash_algorithm=algo)
    report = warmup(PROMPTS, engine, load_config(config_file), gpu_block_size=GPU_BLOCK)
    assert report.blocks_written == expected_blocks(PROMPTS, GPU_BLOCK * factor)
    (ns,) = list_namespaces(tmp_path / "cache")
    table = read_entries(ns)
    written = {table.hash(i) for i in range(len(table))}
    theirs = set()
    for tokens in PROMPTS:
        theirs |= set(chunk_keys(vllm_harness.hash_blocks(tokens, GPU_BLOCK, algo), factor))
    assert written == theirs
    # The disk manager a server opens finds them under those keys.
    m = DiskOffloadingManager(
        tmp_path / "cache",
        ns.fingerprint,
        KvFirstLayout(LayoutRequest(engine.geometry, torch.float32, GPU_BLOCK, factor, 1)).kv_layout,
        disk_bytes=8 << 20,
    )
    try:
        assert all(m.is_loadable(k) for k in theirs)
    finally:
        m.shutdown()
