"""The worker's start-up canary (``tiered_kv/integrations/vllm/canary.py``) inside vLLM 0.33's
real worker connector (tests/support/vllm_harness.py, ``worker="real"``, CPU tensors): it
passes on the KV-cache layouts vLLM allocates (layer-outermost head-major and token-major,
block-outermost), restores the blocks it borrowed, refuses to start when the worker's page
geometry disagrees with the engine's tensors (heads and tokens, K and V) or the handlers
route GPU blocks wrongly, naming the tier, the layer and the axis, and is skipped with
``canary: false``. With a disk tier it also takes the pattern through that tier's own
stager, handlers and I/O backend over a scratch store (``canary_disk.py``), leaving no file
and no block behind; a page-order bug in the disk tier's packing refuses the start naming
``disk`` and the axis, and a scratch store it cannot write or read only skips the disk
tier, with a warning."""

from __future__ import annotations

import errno
import logging
import time

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

import torch  # noqa: E402
from support import vllm_harness as vh  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.v1.kv_cache_interface import create_kv_cache_views  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

import tiered_kv.disk.worker.stager as stager_module  # noqa: E402
import tiered_kv.integrations.vllm.canary_disk as canary_disk  # noqa: E402
import tiered_kv.integrations.vllm.worker as worker_module  # noqa: E402
from tiered_kv.config import ConfigError  # noqa: E402
from tiered_kv.disk.store.io_backends import PosixBackend  # noqa: E402
from tiered_kv.disk.store.store import DiskStore  # noqa: E402
from tiered_kv.disk.worker.handlers import GpuDiskHandler  # noqa: E402
from tiered_kv.integrations.vllm import geometry  # noqa: E402
from tiered_kv.integrations.vllm.canary import CanaryError  # noqa: E402
from tiered_kv.memory.slot_views import SlotViews  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm", "cpu_bytes": "64KiB"}
PASSED = "start-up canary passed"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


class LayoutHarness(vh.VllmHarness):
    """The harness with the engine's KV tensors allocated as vLLM's model runner does for
    the config's KV-cache layout: one backing buffer, per-layer views from vLLM's own
    ``create_kv_cache_views`` (the tensors its attention layers hold), registered with
    vLLM's worker connector."""

    def _build_worker(self) -> None:
        layout = KVCacheLayout[self.vllm_config.cache_config.kv_cache_layout]
        group = self.kv_cache_config.kv_cache_groups[0]
        spec, names = group.kv_cache_spec, group.layer_names
        tensor = self.kv_cache_config.kv_cache_tensors[0]
        if not layout.is_layer_compact:  # a block of every layer's pages
            tensor.layer_stride, tensor.block_stride = spec.page_size_bytes, spec.page_size_bytes * len(names)
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        self.kv_caches.update(
            zip(names, create_kv_cache_views(raw, spec, self.kv_cache_config.num_blocks, layout, tensor))
        )
        with set_current_vllm_config(self.vllm_config):
            self.worker_connector = OffloadingConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.worker_connector.register_kv_caches(self.kv_caches)


def _build(model_dir, layout: str | None = "LBHNC", **extra) -> vh.VllmHarness:
    """An engine of 32 GPU blocks, chunks of 2 GPU blocks, KV tensors in ``layout``
    (None: the plain harness's tensors, layout left unresolved)."""
    config = {**SPEC, "block_size": 2 * BLOCK, **extra}
    cls = vh.VllmHarness if layout is None else LayoutHarness
    return cls.build(model_dir, config, num_gpu_blocks=32, block_size=BLOCK, worker="real", kv_cache_layout=layout)


@pytest.mark.parametrize("layout", [None, "LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_the_canary_passes_on_every_layout_and_returns_the_blocks_it_borrowed(model_dir, layout, caplog):
    caplog.set_level(logging.INFO, logger="tiered_kv.integrations.vllm.canary")
    with _build(model_dir, layout) as h:
        passed = [r.getMessage() for r in caplog.records if PASSED in r.getMessage()]
        assert len(passed) == 1 and "2 layers" in passed[0] and "GPU -> cpu -> GPU" in passed[0]
        # Counted once on the worker's metrics, as passed.
        worker = h.worker_spec.get_worker(None)
        assert worker.canary_outcome == "passed"
        counted = worker.take_stats()
        assert counted is not None
        _, values = counted.metric_sections()
        assert values["tiered_kv_canary_checks"] == {("passed",): 1}, values
        again = worker.take_stats()  # counted once
        assert again is None or "tiered_kv_canary_checks" not in again.metric_sections()[1]
        # The spare blocks (the last 4) hold what they held before: zeros.
        for t in h.kv_caches.values():
            assert not t.view(torch.int8 if t.element_size() == 1 else torch.int16).any()
        # And the engine serves: a prompt stored, then loaded back from the CPU tier.
        prompt = [100 + i % 800 for i in range(4 * BLOCK)]
        h.add_request(prompt)
        h.run()
        h.scheduler.reset_prefix_cache()
        req = h.add_request(prompt, max_tokens=2)
        h.step()
        assert h.prefix_hits[req].external > 0 and all(h.kv_matches(req))
        h.run()


def _swap_heads_and_tokens(real):
    def planted(pages, layer, num_layers, shape, dtype, layout):
        other = {"LBHNC": "LBNHC", "LBNHC": "LBHNC", "BLHNC": "BLNHC", "BLNHC": "BLHNC"}[layout]
        return real(pages, layer, num_layers, shape, dtype, other)

    return planted


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC"])
def test_a_page_geometry_with_heads_and_tokens_swapped_refuses_the_start(model_dir, layout, monkeypatch):
    monkeypatch.setattr(geometry, "attention_page_view", _swap_heads_and_tokens(geometry.attention_page_view))
    with pytest.raises(CanaryError) as err:
        _build(model_dir, layout)
    message = str(err.value)
    assert "the cpu tier returns KV" in message
    assert "layer model.layers.0.self_attn.attn" in message
    assert "KV heads and tokens are swapped" in message


def test_a_page_geometry_with_k_and_v_swapped_refuses_the_start(model_dir, monkeypatch):
    real = geometry.kv_content
    monkeypatch.setattr(geometry, "kv_content", lambda content, head_size: real(content, head_size)[::-1])
    with pytest.raises(
        CanaryError, match=r"the cpu tier .* layer model\.layers\.0\.self_attn\.attn .*: K and V are swapped"
    ):
        _build(model_dir)


def test_handlers_that_route_gpu_blocks_wrongly_refuse_the_start(model_dir, monkeypatch):
    real, calls = worker_module.gpu_rows, []

    def stores_reversed(spec, f, n):  # the store (the first job) takes a chunk's blocks back to front
        calls.append(spec)
        rows = real(spec, f, n)
        return rows[:, ::-1].copy() if len(calls) == 1 else rows

    monkeypatch.setattr(worker_module, "gpu_rows", stores_reversed)
    with pytest.raises(CanaryError, match=r"layer model\.layers\.0\.self_attn\.attn .*: GPU blocks are out of place"):
        _build(model_dir)


def test_canary_false_skips_it(model_dir, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tiered_kv.integrations.vllm.canary")
    monkeypatch.setattr(geometry, "attention_page_view", _swap_heads_and_tokens(geometry.attention_page_view))
    with _build(model_dir, canary=False) as h:
        assert h.worker_connector is not None
    assert not [r for r in caplog.records if "canary" in r.getMessage()]


def test_a_canary_value_that_is_not_a_boolean_is_refused(model_dir):
    with pytest.raises(ConfigError, match="canary: expected true or false .*got 'no'"):
        _build(model_dir, canary="no")


# ------------------------------------------------------------------ disk tier

HEADS, HEAD_DIM = 2, 16  # write_model_config's KV heads and head size
DISK_CHECKED = "disk: cpu -> disk -> GPU, and -> cpu -> GPU, through the tier's own stager, handlers and I/O backend"
NOT_CHECKED = "the disk tier was not checked"


def _with_disk(model_dir, tmp_path, layout: str | None = "LBHNC", **extra) -> vh.VllmHarness:
    return _build(model_dir, layout, disk_path=str(tmp_path / "disk"), disk_bytes="1MiB", **extra)


def _swap_k_and_v(rows: torch.Tensor, nbytes: int) -> None:
    """Swap the K and V halves of every cell of the blocks in ``rows`` (uint8, a block per row)."""
    cells = rows[:, :nbytes].clone().view(torch.int16).view(len(rows), -1, 2, HEAD_DIM)
    rows[:, :nbytes] = cells.flip(2).contiguous().view(len(rows), -1).view(torch.uint8)


def _swap_heads_and_tokens_in(rows: torch.Tensor, nbytes: int) -> None:
    """Read every page of the blocks in ``rows`` as (tokens, heads) where it is (heads, tokens)."""
    pages = rows[:, :nbytes].clone().view(torch.int16).view(len(rows), -1, HEADS, BLOCK, 2 * HEAD_DIM)
    rows[:, :nbytes] = pages.transpose(2, 3).contiguous().view(len(rows), -1).view(torch.uint8)


@pytest.mark.parametrize("disk_io", ["thread", "process"])
def test_the_canary_takes_the_pattern_through_the_disk_tier_and_leaves_nothing_behind(
    model_dir, tmp_path, disk_io, caplog
):
    caplog.set_level(logging.INFO, logger="tiered_kv.integrations.vllm")
    with _with_disk(model_dir, tmp_path, disk_io=disk_io) as h:
        passed = [r.getMessage() for r in caplog.records if PASSED in r.getMessage()]
        assert len(passed) == 1 and "GPU -> cpu -> GPU" in passed[0] and DISK_CHECKED in passed[0], passed
        assert ("in a helper process" in passed[0]) == (disk_io == "process")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "canary" in r.getMessage()]
        worker = h.worker_spec.get_worker(None)
        assert worker.canary_outcome == "passed"
        # No scratch directory left: the tier's directory holds its namespace alone.
        namespace = worker.hierarchy.lower_tiers[0].ctx.fingerprint.namespace_id
        assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == [namespace]
        # The scheduler's namespace gained no block: nothing in its manager, and its
        # index (read by a store of its own) has no entry, the canary's key least of all.
        assert len(h.manager.composite.tier("disk")) == 0
        store = DiskStore.open_readonly(tmp_path / "disk" / namespace)
        try:
            assert len(store.snapshot()) == 0 and store.entry(canary_disk.CANARY_HASH) is None
        finally:
            store.close()
        # The spare GPU blocks hold what they held before: zeros.
        for t in h.kv_caches.values():
            assert not t.view(torch.int16).any()
        # And the engine then stores its own blocks there.
        prompt = [100 + i % 800 for i in range(4 * BLOCK)]
        h.add_request(prompt)
        h.run()
        deadline = time.monotonic() + 20
        while h.manager.composite.pending_writes():
            assert time.monotonic() < deadline, "disk writes never became durable"
            time.sleep(0.005)
        assert len(h.manager.composite.tier("disk")) == 2  # the prompt's two chunks


def _unpack_then(real, damage):
    def planted(self, rows, ids):
        damage(rows, self.layout.bytes_per_block)
        return real(self, rows, ids)

    return planted


def test_a_disk_read_into_the_gpu_with_k_and_v_swapped_refuses_the_start(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(GpuDiskHandler, "_unpack", _unpack_then(GpuDiskHandler._unpack, _swap_k_and_v))
    with pytest.raises(CanaryError) as err:
        _with_disk(model_dir, tmp_path)
    message = str(err.value)
    assert "the disk tier (written from a CPU slot, read straight into GPU blocks by GpuDiskHandler)" in message
    assert "layer model.layers.0.self_attn.attn" in message and "K and V are swapped" in message
    assert "so this tier's own handlers move pages" in message  # not vLLM's layout: the CPU tier passed
    assert not list((tmp_path / "disk").glob(canary_disk.SCRATCH_PREFIX + "*"))  # removed all the same


def test_a_disk_read_into_a_cpu_slot_with_heads_and_tokens_swapped_refuses_the_start(model_dir, tmp_path, monkeypatch):
    # Blocks of 8 KiB: the store reads a CPU slot through a pack buffer that SlotViews
    # unpacks into the slot (pieces under 32 KiB do not go to the disk in place).
    real = SlotViews.unpack

    def planted(self, src, slots):
        _swap_heads_and_tokens_in(src, self.slot_bytes)
        return real(self, src, slots)

    monkeypatch.setattr(SlotViews, "unpack", planted)
    with pytest.raises(CanaryError) as err:
        _with_disk(model_dir, tmp_path)
    message = str(err.value)
    assert "the disk tier (written from a CPU slot, read into a CPU slot by CpuDiskHandler, then to GPU)" in message
    assert "layer model.layers.0.self_attn.attn" in message and "KV heads and tokens are swapped" in message


def test_a_disk_write_with_k_and_v_swapped_refuses_the_start(model_dir, tmp_path, monkeypatch):
    real = stager_module.pack_blocks

    def planted(tensors, layout, ids, rows):
        real(tensors, layout, ids, rows)
        _swap_k_and_v(rows, layout.bytes_per_block)

    monkeypatch.setattr(stager_module, "pack_blocks", planted)
    with pytest.raises(CanaryError, match=r"the disk tier \(written from a CPU slot.*K and V are swapped"):
        _with_disk(model_dir, tmp_path)


def test_a_scratch_location_that_cannot_be_written_skips_the_disk_tier_and_the_engine_starts(
    model_dir, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="tiered_kv.integrations.vllm")
    real = canary_disk.tempfile.mkdtemp

    def read_only(*args, prefix=None, **kwargs):
        if prefix == canary_disk.SCRATCH_PREFIX:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(canary_disk.tempfile, "mkdtemp", read_only)
    with _with_disk(model_dir, tmp_path) as h:
        warned = [
            r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and NOT_CHECKED in r.getMessage()
        ]
        assert len(warned) == 1 and "cannot make a scratch directory" in warned[0] and "Read-only" in warned[0]
        assert "The engine starts" in warned[0]
        passed = [r.getMessage() for r in caplog.records if PASSED in r.getMessage()]
        assert len(passed) == 1 and "GPU -> cpu -> GPU" in passed[0] and "disk:" not in passed[0]
        assert h.worker_spec.get_worker(None).canary_outcome == "partial"
        prompt = [100 + i % 800 for i in range(4 * BLOCK)]
        h.add_request(prompt)
        h.run()


def test_an_io_error_in_the_scratch_store_skips_the_disk_tier_never_refuses(model_dir, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tiered_kv.integrations.vllm")
    real = PosixBackend.preadv

    def failing(self, f, views, offset):
        if canary_disk.SCRATCH_PREFIX in str(f.path):
            raise OSError(errno.EIO, "Input/output error")
        return real(self, f, views, offset)

    monkeypatch.setattr(PosixBackend, "preadv", failing)
    with _with_disk(model_dir, tmp_path) as h:
        warned = [
            r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and NOT_CHECKED in r.getMessage()
        ]
        assert len(warned) == 1 and "read into the GPU (GpuDiskHandler)" in warned[0] and "failed" in warned[0]
        assert h.worker_spec.get_worker(None).canary_outcome == "partial"
        assert not list((tmp_path / "disk").glob(canary_disk.SCRATCH_PREFIX + "*"))
