"""Shared test set-up: skip ``gpu`` tests without CUDA and ``vllm`` tests without vLLM; small KV layouts in both layouts."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from tiered_kv.kv_layout import KVCacheLayout, LayerLayout

# The shared-tier tests' real S3 server (Ceph RGW), started once per run when first needed.
from support.s3_server import remote_settings, rgw_server, s3_env  # noqa: F401,E402

# The Mooncake backend's real store (mooncake_master and a standalone mooncake_client).
from support.mooncake_server import mooncake_server  # noqa: F401,E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def make_layout(
    kv_before_num_blocks: bool,
    num_gpu_blocks: int = 32,
    block_size_factor: int = 1,
    num_layers: int = 3,
    gpu_block_size: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float16,
) -> KVCacheLayout:
    """A small layout: per layer (2, nb, bs, heads, hd) or (nb, 2, bs, heads, hd)."""
    block = (gpu_block_size, heads, head_dim)
    shape = (2, num_gpu_blocks, *block) if kv_before_num_blocks else (num_gpu_blocks, 2, *block)
    layers = tuple(LayerLayout(f"layer.{i}", shape, kv_before_num_blocks) for i in range(num_layers))
    return KVCacheLayout(layers, dtype, gpu_block_size, block_size_factor)


def random_tensors(
    layout: KVCacheLayout, num_blocks: int | None = None, seed: int = 0, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Per-layer tensors of ``layout`` (optionally with another num_blocks) full of random bytes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in layout.layers:
        shape = list(layer.shape)
        if num_blocks is not None:
            shape[1 if layer.kv_before_num_blocks else 0] = num_blocks
        raw = torch.randint(
            0, 256, (int(torch.tensor(shape).prod()) * layout.element_size,), dtype=torch.uint8, generator=gen
        )
        out.append(raw.view(layout.dtype).reshape(shape).to(device))
    return out


@pytest.fixture(params=[True, False], ids=["kv-first", "kv-after"])
def kv_first(request) -> bool:
    return request.param


@pytest.fixture(params=[1, 3], ids=["f1", "f3"])
def factor(request) -> int:
    return request.param


@functools.cache
def _vllm_import_error() -> str | None:
    """Why vLLM's offloading connector cannot be imported, or None when it can."""
    try:
        importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector")
    except Exception as exc:  # a broken install skips too, with its reason shown
        return f"{type(exc).__name__}: {exc}"
    return None


def pytest_runtest_setup(item):
    if "vllm" in item.keywords and (reason := _vllm_import_error()) is not None:
        pytest.skip(f"needs vLLM (make venv installs it): {reason}")


@pytest.fixture
def disk_reads(monkeypatch):
    """Blocks read from any disk store of this process (a scheduler's verifier, the
    workers), by block hash: counted where every read of a block begins."""
    from collections import Counter

    from tiered_kv.disk.store.store import DiskStore

    reads: Counter[bytes] = Counter()
    original = DiskStore.begin_read

    def counting(self, rank, hashes, slots):
        reads.update(bytes(h) for h in hashes)
        return original(self, rank, hashes, slots)

    monkeypatch.setattr(DiskStore, "begin_read", counting)
    return reads
