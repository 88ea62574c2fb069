"""Load/store specs as data: ids given as lists become int64 arrays when read, the
caller's list is not shared, specs pickle (scheduler -> worker) before and after the
conversion, and columns of different lengths are refused."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tiered_kv.mediums import CPULoadStoreSpec, DiskLoadStoreSpec, GPULoadStoreSpec
from tiered_kv.tiered.transfer_specs import TierWrite, TierWrites, TieredLoadSpec, TieredStoreSpec


@pytest.mark.parametrize("ids", [[3, 1, 2], np.array([3, 1, 2], dtype=np.int32), (3, 1, 2), range(3, 0, -1)])
def test_block_ids_read_as_a_flat_int64_array(ids):
    spec = CPULoadStoreSpec(ids)
    assert len(spec) == 3
    assert spec.block_ids.dtype == np.int64 and spec.block_ids.shape == (3,)
    assert spec.block_ids.tolist() == list(ids)
    assert spec.id_list() == list(ids)


def test_a_list_is_copied_and_stays_a_list_until_read():
    slots = [5, 6, 7]
    spec = DiskLoadStoreSpec(slots, [b"a", b"b", b"c"])
    slots.append(8)  # the manager reuses its lists: the spec must not see it
    assert len(spec) == 3 and spec.id_list() == [5, 6, 7]
    assert isinstance(spec.id_list(), list)
    again = pickle.loads(pickle.dumps(spec))  # unconverted, as the scheduler sends it
    assert again.block_ids.tolist() == [5, 6, 7] and again.block_hashes == [b"a", b"b", b"c"]
    assert spec.block_ids.tolist() == [5, 6, 7]
    assert spec.block_ids is spec.block_ids, "converted once, then kept"
    assert pickle.loads(pickle.dumps(spec)).block_ids.tolist() == [5, 6, 7]


def test_gpu_spec_keeps_skip_count_and_nested_arrays_flatten():
    spec = GPULoadStoreSpec(np.array([[1, 2], [3, 4]]), skip_count=1)
    assert spec.block_ids.tolist() == [1, 2, 3, 4] and spec.skip_count == 1 and len(spec) == 4


def test_disk_writes_columns_and_their_checks():
    writes = TierWrites([1, 2], [10, 20], [b"x", b"y"])
    assert list(writes) == [TierWrite(1, 10, b"x"), TierWrite(2, 20, b"y")]
    assert writes.cpu_slots.dtype == np.int64 and writes.tier_slots.tolist() == [10, 20]
    assert pickle.loads(pickle.dumps(TierWrites([1], [2], [b"z"]))).tier_slots.tolist() == [2]
    assert len(TierWrites()) == 0 and TierWrites().cpu_slots.dtype == np.int64
    with pytest.raises(ValueError, match="2 cpu_slots, 1 tier_slots and 2 block_hashes"):
        TierWrites([1, 2], [10], [b"x", b"y"])
    store = TieredStoreSpec([4, 5], spills=[TierWrite(1, 10, b"x")])
    assert store.block_ids.tolist() == [4, 5] and store.spills.cpu_slots.tolist() == [1]
    assert len(store.write_through) == 0


def test_tiered_load_spec_columns_and_their_checks():
    spec = TieredLoadSpec([0, -1], [-1, 7], [-1, 3], [b"a", b"b"])
    assert len(spec) == 2
    assert spec.tier_slots.dtype == np.int64 and spec.promote_slots.tolist() == [-1, 3]
    with pytest.raises(ValueError, match="one entry per block"):
        TieredLoadSpec([0], [-1, 7], [-1, 3], [b"a", b"b"])
