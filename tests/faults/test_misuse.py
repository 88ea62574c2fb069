"""Misuse at startup: a second engine on the same cache, a cache made for another model,
dtype or TP layout, unusable paths, sizes the machine cannot hold, bad or unknown keys.
Each is refused with an error naming the value (or, for a cache of another
fingerprint, never served and logged with the field that differs), before anything is
left behind that would stop a corrected configuration from working."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess

import pytest
import torch

from tiered_kv.testing.harness import (
    GPU_BLOCK_SIZE,
    Hierarchy,
    config,
    device,
    documents,
    namespace_dirs,
    open_engine_elsewhere,
    verify_cache,
)
from tiered_kv.config import ConfigError, format_size
from tiered_kv.memory.device import host_memory_limit
from tiered_kv.disk.format.namespace import CacheLockedError, FingerprintMismatchError, Manifest, NamespaceError
from tiered_kv.tiered.spec import HierarchySpec

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

DOCS = documents(4, 4, seed=21)
BLOCKS = {b for d in DOCS for b in d}


def fill(cache_dir, **kwargs) -> None:
    h = Hierarchy(cache_dir, **kwargs)
    for doc in DOCS:
        h.run([doc])
        h.settle()
    assert h.disk.loadable_among(BLOCKS) == BLOCKS
    h.close()


def test_a_second_engine_on_the_same_cache_is_refused_naming_the_first(tmp_path):
    first = Hierarchy(tmp_path, engine_id="first")
    elsewhere = open_engine_elsewhere(tmp_path)
    assert elsewhere.startswith("CacheLockedError"), elsewhere
    assert f"pid {os.getpid()}" in elsewhere and "engine first" in elsewhere and str(tmp_path) in elsewhere
    with pytest.raises(CacheLockedError, match=f"pid {os.getpid()}"):
        Hierarchy(tmp_path, engine_id="second")

    for doc in DOCS:  # the refusals did not disturb the engine that holds the cache
        first.run([doc])
        first.settle()
    assert first.disk.loadable_among(BLOCKS) == BLOCKS
    first.close()
    assert open_engine_elsewhere(tmp_path) == "ok"  # and once it is gone, the cache is free
    again = Hierarchy(tmp_path, engine_id="second")
    assert again.run(DOCS).computed == 0
    again.close()


@pytest.mark.parametrize(
    "change, field",
    [({"model_id": "another-model"}, None), ({"dtype": torch.bfloat16}, "dtype"), ({"tp_size": 2}, "tp_size")],
    ids=["model", "dtype", "tp"],
)
def test_a_cache_of_another_model_dtype_or_tp_layout_is_never_served(tmp_path, change, field, caplog):
    fill(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.disk.scheduler.manager"):
        other = Hierarchy(tmp_path, **change)
    report = other.run(DOCS)
    assert report.offload_hits == 0 and report.mismatches == 0
    other.close()
    assert len(namespace_dirs(tmp_path)) == 2, "the other configuration did not get its own namespace"
    if field is not None:  # same model, other bytes: say why the old cache is not used
        assert re.search(rf"not serving disk cache namespace .*{field}: .* here, .* in the cache", caplog.text)
    mine = Hierarchy(tmp_path)  # and the first configuration still finds its blocks
    assert mine.run(DOCS).computed == 0
    mine.close()


def test_a_namespace_whose_manifest_records_another_fingerprint_is_refused_naming_the_field(tmp_path):
    fill(tmp_path)
    layout = device(dtype=torch.bfloat16).layout
    spec = HierarchySpec(config(tmp_path, layout.bytes_per_block), GPU_BLOCK_SIZE, layout)
    ns = namespace_dirs(tmp_path)[0]
    ns.rename(ns.with_name(spec._fingerprint().namespace_id))  # a directory copied under the wrong name
    with pytest.raises(FingerprintMismatchError, match="dtype: 'bfloat16' here, 'float16' in the cache") as err:
        Hierarchy(tmp_path, dtype=torch.bfloat16)
    assert err.value.fields == ["dtype"]


def test_a_disk_path_that_is_a_file_or_lies_under_one_is_a_clear_error(tmp_path):
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    with pytest.raises(NamespaceError, match=f"disk_path {re.escape(str(file))} exists and is not a directory"):
        Hierarchy(file)
    with pytest.raises(NamespaceError, match=f"cannot create disk_path {re.escape(str(file / 'cache'))}"):
        Hierarchy(file / "cache")


def test_a_missing_disk_path_is_created_but_never_its_parents(tmp_path):
    path = tmp_path / "mnt" / "nvme" / "tiered-kv"
    (tmp_path / "mnt").mkdir()
    with pytest.raises(NamespaceError, match=f"{re.escape(str(tmp_path / 'mnt' / 'nvme'))} does not exist"):
        Hierarchy(path)
    assert list((tmp_path / "mnt").iterdir()) == []  # no mount point made on the parent's file system
    (tmp_path / "mnt" / "nvme").mkdir()
    h = Hierarchy(path)
    h.run(DOCS)
    h.settle()
    h.close()
    assert path.is_dir() and len(namespace_dirs(path)) == 1 and verify_cache(path).verified > 0


def _read_only_dir(tmp_path, populate: bool):
    """A directory this process cannot write: a read-only tmpfs for root (root ignores
    permission bits), mode 0555 otherwise. Yields its path, already holding a cache if
    ``populate``."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        if populate:
            fill(path)
        path.chmod(0o555)
        return path, lambda: path.chmod(0o755)
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(path)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a read-only tmpfs here")
    if populate:
        fill(path)
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
    return path, lambda: subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("populate", [False, True], ids=["empty", "existing-cache"])
def test_a_read_only_disk_path_is_a_clear_error(tmp_path, populate):
    path, undo = _read_only_dir(tmp_path, populate)
    try:
        with pytest.raises(NamespaceError, match=f"disk_path {re.escape(str(path))} is not writable"):
            Hierarchy(path)
    finally:
        undo()


@pytest.mark.parametrize(
    "key, value",
    [
        ("cpu_bytes", 0),
        ("cpu_bytes", "-1GiB"),
        ("disk_bytes", 0),
        ("disk_bytes", -5),
        ("cpu_bytes", "lots"),
        ("disk_bytes", "1 parsec"),
        ("io_threads", 0),
        ("max_pending_disk_writes", -1),
        ("write_policy", "sometimes"),
        ("io_backend", "carrier-pigeon"),
    ],
)
def test_bad_values_fail_at_startup_naming_the_key_and_the_value(tmp_path, key, value):
    with pytest.raises(ConfigError) as err:
        Hierarchy(tmp_path, **{key: value})
    assert key in str(err.value) and str(value) in str(err.value)
    assert not namespace_dirs(tmp_path), "a rejected configuration left a namespace behind"


def test_an_unknown_key_is_refused_with_the_closest_known_one(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'cpu_byte'; did you mean 'cpu_bytes'"):
        Hierarchy(tmp_path, cpu_byte="1GiB")


def test_cpu_bytes_beyond_this_machines_memory_is_refused_before_allocating(tmp_path):
    limit = host_memory_limit()
    with pytest.raises(ConfigError, match="cpu_bytes") as err:
        Hierarchy(tmp_path, cpu_bytes=limit + (1 << 30))
    assert format_size(limit) in str(err.value)


def test_disk_bytes_too_small_for_one_block_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="disk_bytes=1024 holds no block"):
        Hierarchy(tmp_path, disk_bytes="1024B")


def test_disk_bytes_beyond_the_free_space_is_refused_and_does_not_stick(tmp_path):
    huge = 2 * shutil.disk_usage(tmp_path).free
    with pytest.raises(NamespaceError, match="disk_bytes: .* lower disk_bytes or free space"):
        Hierarchy(tmp_path, disk_bytes=huge)
    assert not namespace_dirs(tmp_path) and not list(tmp_path.glob(".tmp-*"))

    fill(tmp_path, disk_blocks=64)  # a size that fits works
    ns = namespace_dirs(tmp_path)[0]
    with pytest.raises(NamespaceError, match="disk_bytes: .* already held by this namespace"):
        Hierarchy(tmp_path, disk_bytes=huge)  # growing past the free space is refused too
    assert Manifest.read(ns).num_slots == 64, "the refused size was recorded in the manifest"
    again = Hierarchy(tmp_path, disk_blocks=64)
    assert again.run(DOCS).computed == 0
    again.close()
