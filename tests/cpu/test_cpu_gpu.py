"""GPU <-> CPU handlers: byte-exact round trips in both layouts, block_size_factor and
skip_count, ordering, failures; the `gpu` tests drive real CUDA streams."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from conftest import make_layout, random_tensors
from tiered_kv.memory.device import can_pin_memory
from tiered_kv.memory.host_memory import HostKVCache, expand_block_ids, kv_planes, pack_blocks
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from tiered_kv.cpu import handlers as cpu_gpu
from tiered_kv.cpu.handlers import (
    LOAD_PRIORITY,
    STORE_PRIORITY,
    CpuGpuOffloadingHandlers,
    SingleDirectionOffloadingHandler,
    contiguous_runs,
)
from tiered_kv.worker.worker import OffloadingWorker, TransferResult


def kernel(t: torch.Tensor, kv_first: bool, k: int) -> bytes:
    """Bytes of kernel block ``k`` of one layer tensor."""
    block = t[:, k] if kv_first else t[k]
    return block.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def setup(kv_first, factor, slots=6, gpu_blocks=24, device="cpu", seed=0, shared=False, one_allocation=False):
    layout = make_layout(kv_first, num_gpu_blocks=gpu_blocks, block_size_factor=factor)
    gpu = random_tensors(layout, seed=seed, device=device)
    if one_allocation:
        gpu = one_allocation_of(gpu)
    host = HostKVCache(layout, slots, shared=shared)
    for t in host.tensors:
        t.zero_()
    return layout, gpu, host, CpuGpuOffloadingHandlers(gpu, host)


def one_allocation_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same layers back to back in one tensor, as one engine allocation."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    starts = np.cumsum([0, *(t.numel() * t.element_size() for t in tensors[:-1])]).tolist()
    return [flat[a : a + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for a, t in zip(starts, tensors)]


def run(handler, job_id, spec):
    assert handler.transfer_async(job_id, spec)
    handler.wait({job_id})
    assert handler.get_finished() == [TransferResult(job_id, True)]


def test_a_job_goes_by_dma_where_its_slots_run_long_on_average():
    mib = 1 << 20
    assert cpu_gpu.DMA_RUN_BYTES == 2 * mib
    assert cpu_gpu.in_long_runs(np.arange(8), mib // 2)  # one run of 4 MiB
    assert cpu_gpu.in_long_runs(np.array([9, 3, 8, 2]), mib)  # two runs of 2 MiB, any order
    assert not cpu_gpu.in_long_runs(np.array([9, 3, 7, 2]), mib)  # three runs of 1.3 MiB
    assert not cpu_gpu.in_long_runs(np.arange(3), mib // 2)  # 1.5 MiB in all
    assert not cpu_gpu.in_long_runs(np.array([], dtype=np.int64), mib)


def test_contiguous_runs():
    assert contiguous_runs(np.array([], dtype=np.int64)) == []
    assert contiguous_runs(np.array([3, 4, 5, 9, 10, 12])) == [(0, 3, 3), (3, 5, 9), (5, 6, 12)]


@pytest.mark.parametrize("staging", ["whole", "parts"])  # parts: a job staged 3 kernel blocks at a time
@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])  # shared: disk_io process
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layers", ["apart", "one-allocation"])
def test_round_trip_gpu_cpu_gpu_is_byte_exact(kv_first, factor, device, shared, staging, layers, monkeypatch):
    if staging == "parts":
        layout = make_layout(kv_first, block_size_factor=factor)
        monkeypatch.setattr(cpu_gpu, "MAX_STAGING_BYTES", 3 * layout.bytes_per_block // factor)
    layout, gpu, host, handlers = setup(
        kv_first, factor, device=device, shared=shared, one_allocation=layers == "one-allocation"
    )
    if device == "cpu":  # DMA copies: staged as rows in one copy where the stand-in layers share one allocation
        staged = handlers.gpu_to_cpu_handler.staging_rows(True), handlers.cpu_to_gpu_handler.staging_rows(False)
        assert all((rows is not None) == (layers == "one-allocation") for rows in staged)
    # On a CUDA machine the CPU tier is pinned whichever side stands in for the device.
    assert host.shared == shared and host.pinned == can_pin_memory()
    n = 4
    src_gpu = np.array([17, 2, 9, 11, 20, 0, 5, 6, 13, 1, 22, 3][: n * factor])
    slots = np.array([4, 1, 2, 5])
    run(handlers.gpu_to_cpu_handler, 1, (GPULoadStoreSpec(src_gpu), CPULoadStoreSpec(slots)))
    # Each slot holds its GPU blocks, in order.
    cpu_kernels = expand_block_ids(slots, factor)
    for g, c in zip(src_gpu, cpu_kernels):
        for t_gpu, t_cpu in zip(gpu, host.tensors):
            assert kernel(t_cpu, kv_first, c) == kernel(t_gpu, kv_first, g)
    # Load into other GPU blocks; the rest of the device cache is untouched.
    originals = [t.clone() for t in gpu]
    dst_gpu = np.array([23, 8, 7, 4, 10, 12, 14, 15, 16, 18, 19, 21][: n * factor])
    run(handlers.cpu_to_gpu_handler, 2, (CPULoadStoreSpec(slots), GPULoadStoreSpec(dst_gpu)))
    for g_src, g_dst in zip(src_gpu, dst_gpu):
        for t, orig in zip(gpu, originals):
            assert kernel(t, kv_first, g_dst) == kernel(orig, kv_first, g_src)
    untouched = sorted(set(range(24)) - set(dst_gpu.tolist()))
    for t, orig in zip(gpu, originals):
        for g in untouched:
            assert kernel(t, kv_first, g) == kernel(orig, kv_first, g)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_skip_count_leaves_partial_first_block(kv_first, device):
    factor = 4
    layout, gpu, host, handlers = setup(kv_first, factor, device=device)
    slots = np.array([3, 0])
    src_gpu = np.array([9, 10, 11, 12, 13])  # 8 kernel blocks minus 3 skipped
    run(handlers.gpu_to_cpu_handler, 1, (GPULoadStoreSpec(src_gpu, skip_count=3), CPULoadStoreSpec(slots)))
    cpu_kernels = expand_block_ids(slots, factor)  # [12..15, 0..3]
    for t_gpu, t_cpu in zip(gpu, host.tensors):
        for c in cpu_kernels[:3]:
            assert set(kernel(t_cpu, kv_first, c)) == {0}, "skipped kernel blocks stay as they were"
        for g, c in zip(src_gpu, cpu_kernels[3:]):
            assert kernel(t_cpu, kv_first, c) == kernel(t_gpu, kv_first, g)
    before = [t.clone() for t in gpu]
    dst_gpu = np.array([1, 2, 3, 4, 5])
    run(handlers.cpu_to_gpu_handler, 2, (CPULoadStoreSpec(slots), GPULoadStoreSpec(dst_gpu, skip_count=3)))
    for t, t_before in zip(gpu, before):
        for g_src, g_dst in zip(src_gpu, dst_gpu):
            assert kernel(t, kv_first, g_dst) == kernel(t_before, kv_first, g_src)
        assert kernel(t, kv_first, 0) == kernel(t_before, kv_first, 0)


def test_jobs_complete_and_report_in_submission_order(kv_first):
    layout, gpu, host, handlers = setup(kv_first, 1)
    store = handlers.gpu_to_cpu_handler
    # The same slot written by successive jobs from different GPU blocks: the last
    # submitted must win, and every job is reported once, in order.
    for job in range(10):
        assert store.transfer_async(job, (GPULoadStoreSpec([job]), CPULoadStoreSpec([0])))
    results = store.get_finished()
    assert results == [TransferResult(j, True) for j in range(10)]
    assert store.get_finished() == []
    for t_gpu, t_cpu in zip(gpu, host.tensors):
        assert kernel(t_cpu, kv_first, 0) == kernel(t_gpu, kv_first, 9)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_job_reports_its_copy_time_not_the_time_until_it_was_polled(device):
    """An engine polls once per step: what it learns of a job's time must be the copy's."""
    poll_delay = 0.3
    _, _, _, handlers = setup(False, 2, slots=6, device=device)
    for handler, spec in (
        (handlers.gpu_to_cpu_handler, (GPULoadStoreSpec(list(range(8))), CPULoadStoreSpec([0, 1, 2, 3]))),
        (handlers.cpu_to_gpu_handler, (CPULoadStoreSpec([3, 2, 1, 0]), GPULoadStoreSpec(list(range(8, 16))))),
    ):
        assert handler.transfer_async(5, spec)
        handler.wait({5})
        time.sleep(poll_delay)
        (result,) = handler.get_finished()
        assert result.success and result.seconds is not None
        assert 0 < result.seconds < poll_delay


def test_wait_does_not_swallow_results():
    _, _, _, handlers = setup(False, 1)
    h = handlers.gpu_to_cpu_handler
    h.transfer_async(7, (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0, 1])))
    h.wait({7, 12345})
    assert h.get_finished() == [TransferResult(7, True)]


def test_bad_specs_raise_and_copy_nothing():
    layout, gpu, host, handlers = setup(True, 2, slots=4)
    store = handlers.gpu_to_cpu_handler
    with pytest.raises(ValueError, match="covers 3 kernel blocks"):
        store.transfer_async(1, (GPULoadStoreSpec([1, 2, 3]), CPULoadStoreSpec([0])))
    with pytest.raises(ValueError, match="destination kernel block ids span"):
        store.transfer_async(2, (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([4])))
    with pytest.raises(ValueError, match="source kernel block ids span"):
        store.transfer_async(3, (GPULoadStoreSpec([1, 24]), CPULoadStoreSpec([0])))
    with pytest.raises(ValueError, match="skip_count"):
        store.transfer_async(4, (GPULoadStoreSpec([1], skip_count=2), CPULoadStoreSpec([0])))
    assert store.get_finished() == []
    assert all(int(t.abs().sum()) == 0 for t in host.tensors)


def test_handler_rejects_mismatched_tensors():
    layout = make_layout(False, num_gpu_blocks=8)
    gpu = random_tensors(layout)
    other = random_tensors(make_layout(False, num_gpu_blocks=8, head_dim=4))
    with pytest.raises(ValueError, match="same block shape"):
        SingleDirectionOffloadingHandler(gpu, other, [False] * 3, 1, 1, 0)
    with pytest.raises(ValueError, match="one src tensor"):
        SingleDirectionOffloadingHandler(gpu, gpu[:2], [False] * 3, 1, 1, 0)


def test_copy_failure_is_a_failed_job_not_a_crash(monkeypatch):
    _, gpu, host, handlers = setup(False, 1)
    store = handlers.gpu_to_cpu_handler
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, store)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler)

    def broken_copy(*args):
        raise RuntimeError("injected copy failure")

    assert worker.transfer_async(1, (GPULoadStoreSpec([1]), CPULoadStoreSpec([0])))
    monkeypatch.setattr(store, "_copy", broken_copy)
    assert worker.transfer_async(2, (GPULoadStoreSpec([2]), CPULoadStoreSpec([1])))
    monkeypatch.undo()
    assert worker.transfer_async(3, (CPULoadStoreSpec([0]), GPULoadStoreSpec([5])))
    results = sorted(worker.get_finished())
    assert results == [TransferResult(1, True), TransferResult(2, False), TransferResult(3, True)]
    for t in gpu:
        assert kernel(t, False, 5) == kernel(t, False, 1)


def test_streams_priorities_loads_before_stores():
    assert LOAD_PRIORITY < STORE_PRIORITY


@pytest.mark.gpu
def test_cuda_streams_events_and_pinned_host(kv_first):
    layout, gpu, host, handlers = setup(kv_first, 2, slots=64, gpu_blocks=256, device="cuda")
    assert host.pinned
    store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    assert store._stream.stream.priority > load._stream.stream.priority
    # Many jobs: they complete in order; get_finished never blocks and reports each once.
    rng = np.random.default_rng(0)
    jobs = {}
    for job in range(32):
        slots = rng.choice(64, size=2, replace=False)
        gpu_ids = rng.choice(256, size=4, replace=False)
        jobs[job] = (gpu_ids, slots)
        assert store.transfer_async(job, (GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(slots)))
    seen = []
    while len(seen) < 32:
        got = store.get_finished()
        assert [r.job_id for r in got] == list(range(len(seen), len(seen) + len(got)))
        seen.extend(got)
    assert all(r.success for r in seen)
    # Last writer per slot wins (submission order).
    last = {}
    for job, (gpu_ids, slots) in jobs.items():
        for i, s in enumerate(slots):
            last[int(s)] = gpu_ids[2 * i : 2 * i + 2]
    for s, gpu_ids in last.items():
        for t_gpu, t_cpu in zip(gpu, host.tensors):
            for k, g in enumerate(gpu_ids):
                assert kernel(t_cpu, kv_first, 2 * s + k) == kernel(t_gpu, kv_first, int(g))
    # And back, into a fresh region, with wait().
    slots = np.array(sorted(last)[:8])
    dst = np.arange(100, 116)
    load.transfer_async(99, (CPULoadStoreSpec(slots), GPULoadStoreSpec(dst)))
    load.wait({99})
    assert load.get_finished() == [TransferResult(99, True)]
    torch.cuda.synchronize()
    for i, s in enumerate(slots):
        for t_gpu, t_cpu in zip(gpu, host.tensors):
            for k in range(2):
                assert kernel(t_gpu, kv_first, int(dst[2 * i + k])) == kernel(t_cpu, kv_first, 2 * int(s) + k)


@pytest.mark.gpu
def test_cuda_store_waits_for_compute_stream():
    layout, gpu, host, handlers = setup(False, 1, slots=4, gpu_blocks=8, device="cuda")
    # A slow kernel on the compute stream writes block 3; the store must see its result.
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        big = big @ big / 4096
    gpu[0][3].fill_(7)
    handlers.gpu_to_cpu_handler.transfer_async(1, (GPULoadStoreSpec([3]), CPULoadStoreSpec([0])))
    handlers.gpu_to_cpu_handler.wait({1})
    assert (host.tensors[0][0] == 7).all()


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_gpu_cpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_refuses_cleanly_without_cuda(capsys):
    assert _bench_module().main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_smoke_run_checks_its_own_copies(capsys):
    assert _bench_module().main(["--smoke", "--block-mb", "1", "--layout", "kv-after", "--blocks-per-job", "4"]) == 0
    out = capsys.readouterr().out
    assert "GPU->CPU" in out and "both" in out and "ratio" in out


def test_plane_rows_list_every_planes_blocks_plane_by_plane():
    from tiered_kv.memory.zero_copy import PlaneRows

    # Two planes 10 slices apart, blocks of 2 slices each.
    rows = PlaneRows(torch.empty(0), plane_start=np.array([0, 10]), plane_step=np.array([2, 2]), rows_per_block=2)
    assert rows.index(np.array([1, 3])).tolist() == [2, 3, 6, 7, 12, 13, 16, 17]
    whole = PlaneRows(torch.empty(0), plane_start=np.array([4, 0]), plane_step=np.array([1, 1]), rows_per_block=1)
    assert whole.index(np.array([2, 0])).tolist() == [6, 4, 2, 0]
    # Strided planes (a block-major tier): plane 1 starts a block into plane 0's rows of 3.
    strided = PlaneRows(torch.empty(0), plane_start=np.array([0, 1]), plane_step=np.array([3, 3]), rows_per_block=1)
    assert strided.index(np.array([2, 0])).tolist() == [6, 0, 7, 1]


def test_copy_blocks_moves_every_planes_blocks_in_parts():
    from tiered_kv.memory.zero_copy import PlaneRows, copy_blocks

    # CPU tensors stand in for the device's: the same two kernels run on them.
    rng = np.random.default_rng(1)
    planes, blocks, block = 3, 10, 96
    gap = blocks * block + 32  # source planes 32 bytes apart: 32-byte slices, three per block
    src_mem = torch.from_numpy(rng.integers(0, 2**62, size=planes * gap // 8, dtype=np.int64))
    src = PlaneRows(
        src_mem.view(-1, 4), plane_start=np.arange(planes) * gap // 32, plane_step=np.full(planes, 3), rows_per_block=3
    )
    dst_mem = torch.zeros(planes * blocks * block // 8, dtype=torch.int64)
    dst = PlaneRows(
        dst_mem.view(-1, 12),
        plane_start=np.arange(planes) * blocks,
        plane_step=np.ones(planes, dtype=np.int64),
        rows_per_block=1,
    )
    assert src.block_bytes == dst.block_bytes == planes * block
    src_ids, dst_ids = np.array([7, 0, 3, 9, 4]), np.array([1, 2, 8, 0, 5])
    copy_blocks(src, dst, src_ids, dst_ids, max_staging_bytes=2 * src.block_bytes)  # three parts
    src_bytes, dst_bytes = src_mem.numpy().view(np.uint8), dst_mem.numpy().view(np.uint8)
    for p in range(planes):
        for b in range(blocks):
            got = dst_bytes[(p * blocks + b) * block : (p * blocks + b + 1) * block]
            if b in dst_ids:
                s = src_ids[list(dst_ids).index(b)]
                assert np.array_equal(got, src_bytes[p * gap + s * block : p * gap + (s + 1) * block])
            else:
                assert not got.any(), "a block no job named was written"


def test_the_fused_kernels_rows_name_the_same_bytes_as_the_two_kernels_copy():
    """The one-kernel copy (CUDA only) moves row to row: with sides sliced differently
    (32-byte rows against 96-byte ones), both are seen as rows of their common length,
    and moving those rows on CPU moves exactly the bytes ``copy_blocks`` moves."""
    from tiered_kv.memory.zero_copy import PlaneRows, _common_rows, copy_blocks

    rng = np.random.default_rng(2)
    planes, blocks = 3, 10
    src_mem = torch.from_numpy(rng.integers(0, 2**62, size=planes * blocks * 12, dtype=np.int64))
    src = PlaneRows(src_mem.view(-1, 4), np.arange(planes) * blocks * 3, np.full(planes, 3), rows_per_block=3)
    outs = [torch.zeros(planes * blocks * 12, dtype=torch.int64) for _ in range(2)]
    dst = [PlaneRows(o.view(-1, 12), np.arange(planes) * blocks, np.ones(planes, np.int64), 1) for o in outs]
    src_ids, dst_ids = np.array([7, 0, 3]), np.array([1, 9, 4])
    copy_blocks(src, dst[0], src_ids, dst_ids)
    (src_rows, src_index), (dst_rows, dst_index) = _common_rows(src, dst[1], src_ids, dst_ids)
    assert src_rows.shape[1] == dst_rows.shape[1] == 4 and len(src_index) == len(dst_index) == planes * 3 * 3
    dst_rows[torch.from_numpy(dst_index)] = src_rows[torch.from_numpy(src_index)]
    assert outs[0].any() and torch.equal(outs[0], outs[1])


def test_plane_rows_of_a_block_major_tier_move_blocks_to_and_from_their_slot_rows(kv_first, factor):
    """The copy kernels' view of the CPU tier (its planes strided, one kernel block of
    every layer apart), built over host memory: the same two kernels put each block in
    its slot's row in the codec's byte order, and bring it back."""
    from tiered_kv.memory.zero_copy import PlaneRows, copy_blocks

    layout, gpu, host, handlers = setup(kv_first, factor)
    store = handlers.gpu_to_cpu_handler
    assert len(store._dst_groups) == 1, "the DMA path moves a run of slots of every plane at once"
    assert len(store._src_groups) == len(store._src), "separate layers' planes move one at a time"
    device_rows = PlaneRows.of(store._src, torch.device("cpu"))
    host_rows = PlaneRows.of(store._dst, torch.device("cpu"))
    assert device_rows is None, "the stand-in device's layers are separate allocations"
    assert host_rows.plane_step[0] * host_rows.slice_bytes == layout.bytes_per_block // factor
    assert len(set(host_rows.plane_step.tolist())) == 1 and host_rows.rows_per_block == 1
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in gpu])  # the layers in one allocation
    sizes = [t.numel() * t.element_size() for t in gpu]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    one = [flat[a : a + n].view(t.dtype).view(t.shape) for a, n, t in zip(starts, sizes, gpu)]
    device_rows = PlaneRows.of(
        [p for t, l in zip(one, layout.layers) for p in kv_planes(t, l.kv_before_num_blocks)], torch.device("cpu")
    )
    gpu_ids = np.random.default_rng(5).choice(layout.num_gpu_blocks, size=3 * factor, replace=False)
    slots = np.array([4, 1, 2])
    copy_blocks(device_rows, host_rows, gpu_ids, expand_block_ids(slots, factor))
    want = torch.empty((3, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(gpu, layout, gpu_ids.reshape(3, factor), want)
    assert torch.equal(host.slot_rows[slots], want)
    back = torch.zeros_like(flat)
    zeroed = PlaneRows(
        back.view(device_rows.rows.dtype).view(device_rows.rows.shape),
        device_rows.plane_start,
        device_rows.plane_step,
        device_rows.rows_per_block,
    )
    copy_blocks(host_rows, zeroed, expand_block_ids(slots, factor), gpu_ids)
    moved = torch.from_numpy(device_rows.index(gpu_ids))
    back_rows, flat_rows = back.view(-1, device_rows.slice_bytes), flat.view(-1, device_rows.slice_bytes)
    assert torch.equal(back_rows[moved], flat_rows[moved])
    back_rows[moved] = 0
    assert not back.any(), "rows of blocks no job named were written"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_layers_of_several_block_sizes_are_copied_a_plane_at_a_time(device):
    """Layers of different block shapes (heads of 2 and of 6) cannot be one tensor of rows:
    the handlers still build, in every mode that can run there, and move every block."""
    from tiered_kv.kv_layout import KVCacheLayout, LayerLayout

    layout = KVCacheLayout(
        (LayerLayout("a", (2, 16, 4, 2, 8), True), LayerLayout("b", (2, 16, 4, 6, 8), True)), torch.float16, 4, 1
    )
    for copy_kernels in (None, False):
        gpu = one_allocation_of(random_tensors(layout, seed=4, device=device))  # else no rows are tried on CPU
        host = HostKVCache(layout, 6)
        handlers = CpuGpuOffloadingHandlers(gpu, host, copy_kernels=copy_kernels)
        store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
        assert not store.copy_kernels and store.staging_rows(True) is None
        run(store, 1, (GPULoadStoreSpec(np.array([3, 9, 4])), CPULoadStoreSpec(np.array([0, 1, 2]))))
        originals = [t.clone() for t in gpu]
        run(load, 2, (CPULoadStoreSpec(np.array([0, 1, 2])), GPULoadStoreSpec(np.array([12, 5, 7]))))
        for t, orig in zip(gpu, originals):
            for src, dst in ((3, 12), (9, 5), (4, 7)):
                assert kernel(t, True, dst) == kernel(orig, True, src)


def test_copy_kernels_need_a_device_that_maps_the_host_tier():
    layout, gpu, host, handlers = setup(True, 1)
    assert not handlers.gpu_to_cpu_handler.copy_kernels and not handlers.cpu_to_gpu_handler.copy_kernels
    with pytest.raises(ValueError, match="copy_kernels=True, config gpu_copy: kernels"):
        CpuGpuOffloadingHandlers(gpu, host, copy_kernels=True)


def _device_cache(layout, gap: int, seed: int) -> list[torch.Tensor]:
    """The layout's tensors on CUDA, in one allocation with ``gap`` bytes between
    layers (as separately allocated layers may lie)."""
    data = random_tensors(layout, seed=seed)
    nbytes = [t.numel() * t.element_size() for t in data]
    flat = torch.empty(sum(nbytes) + gap * len(data), dtype=torch.uint8, device="cuda")
    starts = np.cumsum([0, *[n + gap for n in nbytes[:-1]]])
    out = [flat[s : s + n].view(t.dtype).view(t.shape) for s, n, t in zip(starts.tolist(), nbytes, data)]
    for o, t in zip(out, data):
        o.copy_(t)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("gap", [0, 512], ids=["back-to-back", "gaps"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernels"])
def test_copy_kernels_move_the_same_bytes_as_dma_copies(kv_first, factor, gap, fused, monkeypatch):
    # Kernel block rows of 1536 B (kv-first) or 3072 B: a 512 B gap breaks them up.
    from tiered_kv.memory import zero_copy

    if fused:
        pytest.importorskip("triton", reason="the fused copy kernel is a Triton kernel")
        assert zero_copy._fused_copy_rows() is not None
    monkeypatch.setattr(zero_copy, "FUSED_KERNEL", fused)
    monkeypatch.setattr(zero_copy, "FUSED_MIN_BYTES", 0)  # these jobs are a few KiB
    layout = make_layout(kv_first, num_gpu_blocks=48, block_size_factor=factor, heads=3, head_dim=64)
    caches = {}
    monkeypatch.setattr(cpu_gpu, "DMA_RUN_BYTES", 1)  # auto: every job by DMA, staged as rows
    for kernels in (True, False, None):
        gpu = _device_cache(layout, gap, seed=3)
        host = HostKVCache(layout, 12)
        for t in host.tensors:
            t.zero_()
        handlers = CpuGpuOffloadingHandlers(gpu, host, copy_kernels=kernels)
        store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
        assert store.copy_kernels == load.copy_kernels == (kernels is not False)
        if kernels:
            device_rows, host_rows = store.plane_rows
            # Layers back to back are sliced in whole blocks; the gaps need 512 B slices.
            row = 1536 if kv_first else 3072
            assert device_rows.slice_bytes == (512 if gap else row)
            assert host_rows.slice_bytes == row
            assert host_rows.rows_per_block == 1
        rng = np.random.default_rng(7)
        job = 0
        for slots in ([2, 3, 4, 5], [9, 1, 6, 0], [11, 10]):  # one run, scattered, one run reversed
            gpu_ids = rng.choice(48, size=len(slots) * factor, replace=False)
            job += 1
            run(store, job, (GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(np.array(slots))))
            job += 1
            dst = rng.choice(48, size=len(slots) * factor, replace=False)
            run(load, job, (CPULoadStoreSpec(np.array(slots)), GPULoadStoreSpec(dst)))
        torch.cuda.synchronize()
        if kernels is None:
            assert store.staging_rows(True) is not None and load.staging_rows(False) is not None
        caches[kernels] = ([t.cpu() for t in gpu], [t.clone() for t in host.tensors])
    for other in (False, None):
        for a, b in zip(caches[True][0] + caches[True][1], caches[other][0] + caches[other][1]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_row_groups_join_only_planes_that_tile_one_matrix():
    """A DMA copy moves every plane of a run of slots at once only where the planes are
    column ranges of one row-major matrix that they cover exactly (a block-major tier)."""
    rows = torch.arange(5 * 12, dtype=torch.int64).view(5, 12)
    planes = [rows[:, 8:12], rows[:, 0:4], rows[:, 4:8]]  # not in address order
    [(matrix, members)] = cpu_gpu.row_groups(planes)
    assert matrix.data_ptr() == rows.data_ptr() and matrix.shape == rows.shape and torch.equal(matrix, rows)
    assert members == [(0, slice(8, 12)), (1, slice(0, 4)), (2, slice(4, 8))]
    for i, columns in members:
        assert torch.equal(matrix[:, columns], planes[i])

    def alone(ps):
        groups = cpu_gpu.row_groups(ps)
        return len(groups) == len(ps) and all(g[0] is p for g, p in zip(groups, ps))

    assert alone([rows[:, 0:4], rows[:, 8:12]])  # a gap between them
    assert alone([rows[:, 0:4], rows[:, 4:8]])  # rows longer than the planes together
    assert alone([torch.zeros(5, 4, dtype=torch.int64), torch.zeros(5, 4, dtype=torch.int64)])  # apart
    wide = torch.arange(12 * 10, dtype=torch.int64).view(12, 10).t()  # columns, not rows, contiguous
    assert alone([wide[:, 0:6], wide[:, 6:12]])
    assert alone([rows[:, 0:4]])
