"""Host KV memory, expand_block_ids and the block byte codec (pack/unpack)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from conftest import make_layout, random_tensors
from tiered_kv.memory.device import kernel_huge_pages
from tiered_kv.memory.host_memory import HostKVCache, expand_block_ids, pack_blocks, unpack_blocks
from tiered_kv.memory.slot_views import SlotViews


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Compare KV by bytes: random bytes read as float16 include NaNs."""
    return t.contiguous().view(torch.uint8)


def reference_block_bytes(tensors, layout, kernel_ids) -> bytes:
    """The documented byte order of one offloaded block, built piece by piece: kernel
    blocks in turn, each one's layers in layout order, K before V."""
    parts = []
    for k in kernel_ids:
        for tensor, layer in zip(tensors, layout.layers):
            for plane in (tensor[0, k], tensor[1, k]) if layer.kv_before_num_blocks else (tensor[k],):
                parts.append(plane.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    return b"".join(parts)


def test_expand_block_ids_seed_semantics():
    assert expand_block_ids([0, 1, 3], 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    assert expand_block_ids([2, 5], 3, skip_count=2).tolist() == [8, 15, 16, 17]
    assert expand_block_ids([7, 2], 1).tolist() == [7, 2]
    assert expand_block_ids([], 4).tolist() == []
    with pytest.raises(ValueError, match="skip_count"):
        expand_block_ids([1], 2, skip_count=2)


def test_pack_matches_documented_byte_order(kv_first, factor):
    layout = make_layout(kv_first, num_gpu_blocks=24, block_size_factor=factor)
    tensors = random_tensors(layout)
    rng = np.random.default_rng(1)
    ids = rng.permutation(24)[: 2 * factor].reshape(2, factor).astype(np.int64)
    stride = layout.bytes_per_block + 100
    out = torch.full((2, stride), 0xAB, dtype=torch.uint8)
    pack_blocks(tensors, layout, ids, out)
    for row in range(2):
        want = reference_block_bytes(tensors, layout, ids[row])
        assert out[row, : layout.bytes_per_block].numpy().tobytes() == want
        assert (out[row, layout.bytes_per_block :] == 0xAB).all(), "padding must be left alone"


def test_pack_unpack_round_trip_to_other_ids(kv_first, factor):
    layout = make_layout(kv_first, num_gpu_blocks=24, block_size_factor=factor)
    src_tensors = random_tensors(layout, seed=2)
    dst_tensors = [torch.zeros_like(t) for t in src_tensors]
    n = 24 // factor
    src_ids = np.random.default_rng(3).permutation(24).reshape(n, factor)
    dst_ids = np.random.default_rng(4).permutation(24).reshape(n, factor)
    buf = torch.empty((n, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(src_tensors, layout, src_ids, buf)
    unpack_blocks(buf, dst_tensors, layout, dst_ids)
    for s, d, layer in zip(src_tensors, dst_tensors, layout.layers):
        dim = 1 if layer.kv_before_num_blocks else 0
        assert torch.equal(
            as_bytes(d.index_select(dim, torch.from_numpy(dst_ids.reshape(-1)))),
            as_bytes(s.index_select(dim, torch.from_numpy(src_ids.reshape(-1)))),
        )


def test_skip_entries_leave_bytes_and_blocks_untouched(kv_first):
    layout = make_layout(kv_first, num_gpu_blocks=12, block_size_factor=3)
    src = random_tensors(layout, seed=5)
    ids = np.array([[-1, 4, 7], [1, 2, 3]], dtype=np.int64)
    out = torch.zeros((2, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(src, layout, ids, out)
    full = torch.zeros_like(out)
    pack_blocks(src, layout, np.array([[0, 4, 7], [1, 2, 3]]), full)
    # Exactly the bytes of the skipped kernel block (kernel 0 of row 0) stay zero.
    marker = [torch.zeros_like(t) for t in src]
    for t, l in zip(marker, layout.layers):
        t.view(torch.uint8).select(1 if l.kv_before_num_blocks else 0, 0).fill_(0xFF)
    mask = torch.zeros((1, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(marker, layout, np.array([[0, 4, 7]]), mask)
    skipped = mask[0] == 0xFF
    assert int(skipped.sum()) == layout.bytes_per_block // 3
    assert (out[0][skipped] == 0).all()
    assert torch.equal(out[0][~skipped], full[0][~skipped])
    assert torch.equal(out[1], full[1])

    dst = [torch.zeros_like(t) for t in src]
    sentinel_dim = [1 if l.kv_before_num_blocks else 0 for l in layout.layers]
    for t, dim in zip(dst, sentinel_dim):
        t.select(dim, 9).fill_(7)
    unpack_blocks(full, dst, layout, np.array([[-1, 4, 7], [1, 2, 3]]))
    for s, t, dim in zip(src, dst, sentinel_dim):
        assert (t.select(dim, 9) == 7).all()  # untouched block keeps its content
        assert (t.select(dim, 0) == 0).all()  # the skipped position was not written
        assert torch.equal(as_bytes(t.select(dim, 4)), as_bytes(s.select(dim, 4)))
        assert torch.equal(as_bytes(t.select(dim, 2)), as_bytes(s.select(dim, 2)))


def test_codec_rejects_bad_arguments():
    layout = make_layout(False, num_gpu_blocks=8, block_size_factor=2)
    tensors = random_tensors(layout)
    out = torch.empty((1, layout.bytes_per_block), dtype=torch.uint8)
    with pytest.raises(ValueError, match="block_size_factor=2"):
        pack_blocks(tensors, layout, np.array([[1, 2, 3]]), out)
    with pytest.raises(ValueError, match="out of range"):
        pack_blocks(tensors, layout, np.array([[1, 8]]), out)
    with pytest.raises(ValueError, match="smaller than one block"):
        pack_blocks(tensors, layout, np.array([[1, 2]]), out[:, :-1])
    with pytest.raises(ValueError, match="uint8"):
        pack_blocks(tensors, layout, np.array([[1, 2]]), out.view(torch.int16))
    with pytest.raises(ValueError, match="layer tensors"):
        unpack_blocks(out, tensors[:1], layout, np.array([[1, 2]]))
    with pytest.raises(ValueError, match="contiguous"):
        pack_blocks(
            [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in tensors], layout, np.array([[1, 2]]), out
        )


def test_host_cache_shapes_and_codec_on_host(kv_first, factor):
    layout = make_layout(kv_first, num_gpu_blocks=16, block_size_factor=factor)
    slots = HostKVCache.slots_for_bytes(layout, 5 * layout.bytes_per_block + 1)
    assert slots == 5
    host = HostKVCache.from_bytes(layout, 5 * layout.bytes_per_block)
    assert host.num_slots == 5
    assert host.nbytes == 5 * layout.bytes_per_block
    assert host.pinned == torch.cuda.is_available()
    for t, layer in zip(host.tensors, layout.layers):
        nb = 5 * factor
        assert tuple(t.shape) == ((2, nb) if kv_first else (nb,)) + tuple(layer.block_shape)
    assert host.kernel_ids([2, 0]).tolist() == expand_block_ids([2, 0], factor).reshape(-1, factor).tolist()
    # The codec works on host tensors (the disk tier writes from them).
    src = random_tensors(layout, num_blocks=5 * factor, seed=9)
    for h, s in zip(host.tensors, src):
        h.copy_(s)
    buf = torch.empty((2, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(host.tensors, layout, host.kernel_ids([3, 1]), buf)
    assert buf[0].numpy().tobytes() == reference_block_bytes(src, layout, host.kernel_ids([3])[0])


def test_slots_for_bytes_rejects_too_small():
    layout = make_layout(True)
    with pytest.raises(ValueError, match="holds no block"):
        HostKVCache.slots_for_bytes(layout, layout.bytes_per_block - 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_fallback_to_pageable_memory_is_logged_once(caplog, monkeypatch):
    import tiered_kv.memory.device as device

    monkeypatch.setattr(device, "_logged_fallbacks", set())
    caplog.set_level("INFO", logger="tiered_kv.memory.device")
    layout = make_layout(True)
    first, second = HostKVCache(layout, 2), HostKVCache(layout, 3)
    assert not first.pinned and not second.pinned
    assert len([r for r in caplog.records if "pageable" in r.message]) == 1
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        HostKVCache(layout, 1, pin=True)
    assert device.can_pin_memory() is False


def anon_huge_pages_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (smaps)."""
    return _smaps_kib(address, "AnonHugePages")


def test_pageable_buffers_are_aligned_and_large_ones_get_huge_pages():
    from tiered_kv.memory.device import HUGE_PAGE, empty_pageable

    small = empty_pageable(12345)
    assert small.numel() == 12345 and small.data_ptr() % 4096 == 0
    big = empty_pageable(3 * HUGE_PAGE + 4096)
    assert big.numel() == 3 * HUGE_PAGE + 4096 and big.dtype == torch.uint8
    assert big.data_ptr() % HUGE_PAGE == 0
    big.fill_(7)  # first touch: the kernel backs the advised range now
    assert int(big[-1]) == 7 and int(big.sum()) == 7 * big.numel()
    if kernel_huge_pages() in ("never", "n/a"):
        pytest.skip("transparent huge pages are off on this machine")
    assert anon_huge_pages_kib(big.data_ptr()) >= 2048, "an advised 2 MiB-aligned range got no huge page"


def test_shared_buffers_get_huge_pages_where_the_kernel_gives_them():
    # The CPU tier and staging buffers of ``disk_io: process`` are shared memory; on 4 KiB
    # pages disk I/O to and from them ran at half to three quarters of the device's speed.
    from tiered_kv.memory.device import HUGE_PAGE
    from tiered_kv.memory.shared_memory import empty_shared

    if kernel_huge_pages("shared") in ("never", "deny", "n/a"):
        pytest.skip("this kernel gives shared memory no huge pages (shmem_enabled)")
    big = empty_shared(3 * HUGE_PAGE)
    big.fill_(7)
    assert _smaps_kib(big.data_ptr(), "ShmemPmdMapped") >= 2048, "an advised shared region got no huge page"


def test_shared_memory_on_small_pages_is_warned_once_with_the_fix(tmp_path, monkeypatch, caplog):
    from tiered_kv.memory import device
    from tiered_kv.memory.shared_memory import empty_shared

    setting = tmp_path / "shmem_enabled"
    monkeypatch.setitem(device.THP_SETTINGS, "shared", str(setting))
    monkeypatch.setattr(device, "_logged_fallbacks", set())
    setting.write_text("always within_size advise [never] deny force\n")
    assert kernel_huge_pages("shared") == "never"
    with caplog.at_level(logging.WARNING, logger="tiered_kv.memory.device"):
        empty_shared(device.HUGE_PAGE)
        empty_shared(device.HUGE_PAGE)
        empty_shared(4096)  # too small for a huge page either way
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "shmem_enabled is 'never'" in warnings[0] and f"echo advise > {setting}" in warnings[0]

    caplog.clear()
    monkeypatch.setattr(device, "_logged_fallbacks", set())
    setting.write_text("always within_size [advise] never deny force\n")
    with caplog.at_level(logging.WARNING, logger="tiered_kv.memory.device"):
        empty_shared(device.HUGE_PAGE)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    setting.unlink()
    assert kernel_huge_pages("shared") == "n/a"


def test_the_host_cache_is_block_major_each_slot_its_packed_block(kv_first, factor):
    """A slot's row of the tier's one allocation is exactly what the codec packs from the
    layer views for that slot, and the disk tier sees it as one piece."""
    layout = make_layout(kv_first, block_size_factor=factor, head_dim=16)
    host = HostKVCache(layout, 6, pin=False)
    for t, r in zip(host.tensors, random_tensors(layout, num_blocks=6 * factor, seed=12)):
        t.copy_(r)
        assert tuple(t.shape) == tuple(r.shape) and torch.equal(as_bytes(t), as_bytes(r))
    assert tuple(host.slot_rows.shape) == (6, layout.bytes_per_block)
    assert host.slot_rows.is_contiguous() and host.nbytes == 6 * layout.bytes_per_block
    packed = torch.empty((6, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(host.tensors, layout, host.kernel_ids(range(6)), packed)
    assert torch.equal(packed, host.slot_rows)
    views = SlotViews(host.tensors, layout)
    assert views.pieces_per_slot == 1
    assert bytes(views.pieces(4)[0]) == bytes(host.slot_rows[4].numpy())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the pageable CPU tier")
def test_a_large_pageable_host_cache_starts_on_a_huge_page():
    from tiered_kv.memory.device import HUGE_PAGE

    layout = make_layout(True)
    host = HostKVCache(layout, HUGE_PAGE // layout.bytes_per_block + 1)
    assert host.slot_rows.data_ptr() % HUGE_PAGE == 0


def mapping_holding(address: int) -> tuple[int, int] | None:
    """The ``(start, end)`` of the mapping of this process that holds ``address``, if any."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return lo, hi
    return None


def smaps_kib(address: int, field: str) -> int | None:
    """``field`` (e.g. ``Rss``) of the mapping holding ``address``, in KiB; None when
    this kernel's smaps does not say."""
    try:
        return _smaps_kib(address, field)
    except (OSError, AssertionError):
        return None


def _smaps_kib(address: int, field: str) -> int:
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field + ":":
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {address:#x}")


@pytest.mark.parametrize("nbytes", [12345, 3 * (2 << 20) + 4096], ids=["small", "huge-paged"])
def test_a_mapped_buffer_is_released_while_mapped_then_unmapped_when_its_last_view_dies(nbytes):
    """The lifetime machinery of ``empty_pinned`` (and of large ``empty_pageable``
    buffers), with a recorder where CUDA would register and unregister the pages: the
    release hook sees the bytes still mapped, once, after the last view (a slice here)
    is gone, and the mapping is gone after it."""
    import gc

    from tiered_kv.memory.device import HUGE_PAGE, _empty_mapped

    mapped, released = [], []
    buf = _empty_mapped(
        nbytes,
        on_map=lambda address, n: mapped.append((address, n)),
        on_release=lambda address: released.append((address, mapping_holding(address))),
    )
    address = buf.data_ptr()
    assert mapped == [(address, nbytes)] and buf.numel() == nbytes
    assert buf.untyped_storage().data_ptr() == address and buf.untyped_storage().nbytes() == nbytes, (
        "is_pinned() asks about the storage's first byte: it must be the first one registered"
    )
    assert address % (HUGE_PAGE if nbytes >= HUGE_PAGE else 4096) == 0
    buf.fill_(3)
    piece = buf[4096:8192].view(torch.int32)
    del buf
    gc.collect()
    assert released == [] and mapping_holding(address) is not None
    assert int(piece.view(torch.uint8).sum()) == 3 * 4096, "a slice keeps the bytes mapped"
    del piece
    assert len(released) == 1 and released[0][0] == address
    assert released[0][1] is not None, "released after the bytes were unmapped"
    assert mapping_holding(address) is None, "the mapping outlived its last view"


def test_a_mapped_buffer_whose_registration_fails_is_unmapped_and_never_released():
    from tiered_kv.memory.device import HUGE_PAGE, _empty_mapped

    addresses, released = [], []

    def refuse(address, nbytes):
        addresses.append(address)
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        _empty_mapped(2 * HUGE_PAGE, on_map=refuse, on_release=released.append)
    assert len(addresses) == 1 and mapping_holding(addresses[0]) is None and released == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinned_buffers_without_cuda_are_refused_clearly():
    from tiered_kv.memory.device import cuda_host_register, empty_pinned

    with pytest.raises(RuntimeError, match=r"pinned host memory \(4096 bytes\) .*CUDA is not available"):
        empty_pinned(4096)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        cuda_host_register(0, 4096)
    with pytest.raises(ValueError, match="nbytes"):
        empty_pinned(0)


def host_allocator_bytes() -> int | None:
    """Bytes torch's caching host allocator holds (the key's name varies by version;
    before its first allocation it reports nothing)."""
    stats = torch.cuda.host_memory_stats()
    if not stats:
        return 0
    for key in ("allocated_bytes.current", "allocated_bytes.all.current"):
        if key in stats:
            return int(stats[key])
    return None


@pytest.mark.gpu
def test_empty_pinned_locks_exactly_the_size_asked_outside_torchs_allocator():
    from tiered_kv.memory.device import HUGE_PAGE, empty_pinned

    nbytes = (3 << 30) + 4096  # torch would lock 4 GiB for this
    before = host_allocator_bytes()
    buf = empty_pinned(nbytes)
    assert buf.is_pinned() and buf.numel() == nbytes and buf.data_ptr() % HUGE_PAGE == 0
    if before is not None:
        assert host_allocator_bytes() == before, "taken from torch's caching host allocator"
    rss = smaps_kib(buf.data_ptr(), "Rss")
    if rss is not None:  # registering faults every page in, and only those
        assert nbytes <= rss * 1024 <= nbytes + HUGE_PAGE, rss


@pytest.mark.gpu
def test_a_pinned_host_cache_just_over_a_power_of_two_is_not_rounded_up():
    layout = make_layout(True)
    before = host_allocator_bytes()
    host = HostKVCache(layout, (1 << 30) // layout.bytes_per_block + 1, pin=True)
    assert host.pinned and all(t.is_pinned() for t in host.tensors)
    assert host.nbytes > 1 << 30
    if before is not None:
        assert host_allocator_bytes() == before, "taken from torch's caching host allocator"
    mapped = smaps_kib(host.tensors[0].data_ptr(), "Rss")
    if mapped is not None:
        assert mapped * 1024 < (1 << 30) + 64 * (2 << 20), f"{mapped} KiB locked for {host.nbytes} bytes"


@pytest.mark.gpu
def test_non_blocking_copies_through_a_pinned_buffer_are_exact():
    from tiered_kv.memory.device import empty_pinned

    nbytes = (64 << 20) + 4096 + 3
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    back = torch.zeros_like(src)
    host = empty_pinned(nbytes)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host.copy_(src, non_blocking=True)
        back.copy_(host, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, src)
    assert torch.equal(host[: 1 << 20], src[: 1 << 20].cpu())


@pytest.mark.gpu
def test_a_refused_registration_leaves_no_cuda_error_behind():
    from tiered_kv.memory.device import HUGE_PAGE, cuda_host_register, empty_pinned

    buf = empty_pinned(HUGE_PAGE)
    with pytest.raises(RuntimeError, match=rf"cudaHostRegister of {HUGE_PAGE} bytes .*failed \(CUDA error \d+"):
        cuda_host_register(buf.data_ptr(), HUGE_PAGE)  # registered already
    # A kernel launch raises the thread's last CUDA error, were one left standing.
    assert float(torch.ones(4, device="cuda").mul(2).sum()) == 8.0
    assert buf.is_pinned()


def unregistrations(monkeypatch, module) -> list[bool]:
    """Spy on ``module.cuda_host_unregister`` (the real one still runs): its results."""
    real, results = module.cuda_host_unregister, []

    def unregister(address):
        results.append(real(address))
        return results[-1]

    monkeypatch.setattr(module, "cuda_host_unregister", unregister)
    return results


@pytest.mark.gpu
def test_freed_pinned_buffers_are_unregistered_without_error(monkeypatch, caplog):
    import tiered_kv.memory.device as device

    results = unregistrations(monkeypatch, device)
    caplog.set_level("ERROR")
    for _ in range(5):
        buf = device.empty_pinned(1 << 30)
        buf[::4096] = 1
        address = buf.data_ptr()
        del buf
        assert mapping_holding(address) is None
    assert results == [True] * 5
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


@pytest.mark.gpu
def test_freed_pinned_shared_regions_are_unregistered_without_error(monkeypatch, caplog):
    from tiered_kv.memory import shared_memory

    results = unregistrations(monkeypatch, shared_memory)
    caplog.set_level("ERROR")
    for _ in range(3):
        buf = shared_memory.empty_shared((256 << 20) + 4096, pin=True)
        assert buf.is_pinned()
        buf.copy_(torch.ones(buf.numel(), dtype=torch.uint8, device="cuda"))
        address = buf.data_ptr()
        del buf
        assert shared_memory.locate(address, 1) is None and mapping_holding(address) is None
    assert results == [True] * 3
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_resolve_device():
    from tiered_kv.memory.device import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="not available"):
            resolve_device("cuda")


def test_whole_slot_and_arbitrary_ids_give_the_same_bytes_through_padded_rows(kv_first, factor):
    """CPU-tier slots (aligned groups of kernel blocks) move as whole rows straight
    between the tensors and the packed buffer; other ids take the general path. Both
    must give the documented bytes, read from and write to padded rows only up to
    bytes_per_block, and leave every other block alone."""
    layout = make_layout(kv_first, num_gpu_blocks=8 * factor, block_size_factor=factor)
    src = random_tensors(layout, seed=11)
    stride = layout.bytes_per_block + 4096
    slots = [5, 0, 6]
    aligned = expand_block_ids(slots, factor).reshape(-1, factor)
    shifted = aligned + 1 if factor > 1 else aligned[::-1].copy()  # misaligned runs (or reordered)
    for ids in (aligned, shifted):
        out = torch.full((3, stride), 0xCD, dtype=torch.uint8)
        pack_blocks(src, layout, ids, out)
        for row in range(3):
            assert out[row, : layout.bytes_per_block].numpy().tobytes() == reference_block_bytes(src, layout, ids[row])
        assert (out[:, layout.bytes_per_block :] == 0xCD).all(), "padding must be left alone"

        dst = [torch.zeros_like(t) for t in src]
        unpack_blocks(out, dst, layout, ids)
        dims = [1 if l.kv_before_num_blocks else 0 for l in layout.layers]
        written = set(ids.reshape(-1).tolist())
        for s, d, dim in zip(src, dst, dims):
            for k in range(8 * factor):
                if k in written:
                    assert torch.equal(as_bytes(d.select(dim, k)), as_bytes(s.select(dim, k)))
                else:
                    assert (as_bytes(d.select(dim, k)) == 0).all(), f"kernel block {k} must stay untouched"


def random_slots(kv_first: bool, factor: int, seed: int):
    """A layout with 16-wide heads and a 5-slot host cache of random bytes, and its views."""
    layout = make_layout(kv_first, block_size_factor=factor, head_dim=16)
    host = HostKVCache(layout, 5, pin=False)
    for t, r in zip(host.tensors, random_tensors(layout, num_blocks=5 * factor, seed=seed)):
        t.copy_(r)
    return layout, host, SlotViews(host.tensors, layout)


@pytest.mark.parametrize("kv_first", [True, False])
@pytest.mark.parametrize("factor", [1, 2])
def test_slot_views_are_the_packed_bytes_in_place(kv_first, factor):
    layout, host, views = random_slots(kv_first, factor, seed=3)
    assert views.slot_bytes == layout.bytes_per_block
    out = torch.empty((2, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(host.tensors, layout, host.kernel_ids([4, 1]), out)
    for row, slot in zip(out, [4, 1]):
        assert b"".join(bytes(p) for p in views.pieces(slot)) == bytes(row.numpy())
    views.pieces(2)[0][:4] = b"\x01\x02\x03\x04"  # the views write through to the tier
    out2 = torch.empty((1, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(host.tensors, layout, host.kernel_ids([2]), out2)
    assert bytes(out2[0, :4].numpy()) == b"\x01\x02\x03\x04"
    assert host.slot_rows.data_ptr() % 4096 == 0, "the tier starts page-aligned"


@pytest.mark.parametrize("kv_first", [True, False])
@pytest.mark.parametrize("factor", [1, 2])
def test_slot_views_pack_and_unpack_as_the_codec_does(kv_first, factor):
    layout, host, views = random_slots(kv_first, factor, seed=4)
    padded = layout.bytes_per_block + 4096  # rows of a disk slot: padding past the block
    ours, codec = (torch.zeros((3, padded), dtype=torch.uint8) for _ in range(2))
    views.pack([3, 0, 4], ours)
    pack_blocks(host.tensors, layout, host.kernel_ids([3, 0, 4]), codec)
    assert torch.equal(ours, codec) and not ours[:, layout.bytes_per_block :].any()
    other = HostKVCache(layout, 5, pin=False)
    for t in other.tensors:
        t.zero_()
    SlotViews(other.tensors, layout).unpack(ours, [1, 2, 0])
    back = torch.zeros_like(ours)
    pack_blocks(other.tensors, layout, other.kernel_ids([1, 2, 0]), back)
    assert torch.equal(back, codec)
    untouched = torch.zeros((2, padded), dtype=torch.uint8)
    pack_blocks(other.tensors, layout, other.kernel_ids([3, 4]), untouched)
    assert not untouched.any(), "slots not named were written"


@pytest.mark.parametrize("factor", [1, 2])
def test_slot_views_of_per_layer_tensors_are_the_packed_bytes(kv_first, factor):
    layout = make_layout(kv_first, block_size_factor=factor, head_dim=16)
    tensors = per_layer_tensors(layout, 4 * factor)
    for t, r in zip(tensors, random_tensors(layout, num_blocks=4 * factor, seed=13)):
        t.copy_(r)
    views = SlotViews(tensors, layout)
    planes = sum(2 if layer.kv_before_num_blocks else 1 for layer in layout.layers)
    assert views.pieces_per_slot == planes * factor  # per plane and kernel block: none lie end to end
    packed = torch.empty((4, layout.bytes_per_block), dtype=torch.uint8)
    pack_blocks(tensors, layout, expand_block_ids(range(4), factor).reshape(-1, factor), packed)
    for slot in range(4):
        assert b"".join(bytes(p) for p in views.pieces(slot)) == bytes(packed[slot].numpy())


@pytest.mark.parametrize("pad", [0, 3], ids=["word-rows", "odd-rows"])
@pytest.mark.parametrize("slots", [[1, 2, 3, 0], [0, 1, 2, 3, 4], [4, 0, 1]])
def test_slot_views_pack_matches_the_codec_for_runs_and_scattered_slots(slots, pad):
    # Rows of an odd length cannot be moved as 8-byte words: those runs move bytes.
    layout, host, views = random_slots(True, 2, seed=5)
    ours, codec = (torch.zeros((len(slots), layout.bytes_per_block + pad), dtype=torch.uint8) for _ in range(2))
    views.pack(slots, ours)
    pack_blocks(host.tensors, layout, host.kernel_ids(slots), codec)
    assert torch.equal(ours, codec)
    with pytest.raises(ValueError, match=rf"\({len(slots)}, >= {layout.bytes_per_block}\)"):
        views.pack(slots, ours[:, : layout.bytes_per_block - 1])


def per_layer_tensors(layout, num_slots: int) -> list[torch.Tensor]:
    """Host tensors as an engine may hand them over: each layer a contiguous tensor,
    back to back in one allocation, each starting on a page."""
    shapes = [
        ((2, num_slots) if layer.kv_before_num_blocks else (num_slots,)) + tuple(layer.block_shape)
        for layer in layout.layers
    ]
    sizes = [int(np.prod(shape)) * layout.element_size for shape in shapes]
    starts = np.concatenate(([0], np.cumsum([-(-size // 4096) * 4096 for size in sizes])))
    flat = torch.empty(int(starts[-1]), dtype=torch.uint8)
    return [
        flat[start : start + size].view(layout.dtype).view(shape)
        for start, size, shape in zip(starts.tolist(), sizes, shapes)
    ]


@pytest.mark.parametrize("pad", [0, 4096, 3], ids=["rows", "padded-rows", "odd-rows"])
@pytest.mark.parametrize("kv_first", [True, False], ids=["kv-first", "kv-after"])
def test_scattered_slots_of_alike_layers_pack_a_block_at_a_time_as_the_codec_does(kv_first, pad):
    # With 16 slots every layer fills whole pages of the cache's one allocation, so the
    # planes lie at equal distances and scattered slots are copied a block at a time
    # (``_blocks``). With 5, a layer's K and V planes lie closer than one layer's V and
    # the next layer's K (a page apart), and each plane is gathered on its own. Rows of
    # an odd length take that way too.
    layout = make_layout(kv_first, block_size_factor=1)
    tensors = per_layer_tensors(layout, 16)
    for t, r in zip(tensors, random_tensors(layout, num_blocks=16, seed=8)):
        t.copy_(r)
    views = SlotViews(tensors, layout)
    assert views._blocks is not None
    if kv_first:
        assert SlotViews(per_layer_tensors(layout, 5), layout)._blocks is None
    slots = [9, 2, 15, 0, 7]
    ours, codec = (torch.zeros((len(slots), layout.bytes_per_block + pad), dtype=torch.uint8) for _ in range(2))
    views.pack(slots, ours)
    pack_blocks(tensors, layout, np.array(slots).reshape(-1, 1), codec)
    assert torch.equal(ours, codec)
