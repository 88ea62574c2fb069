"""Start-up of a disk cache that is damaged, half-made or busy: the manifest as
untrusted input, the index page walk and its way back, a refused start that leaves
nothing behind, and the start-up window in which the inspector's destructive commands
must not run. Real namespaces, real LMDB, the real CLI."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path

import lmdb
import pytest

from support import cache_dir_checks as cd
from support import disk_fixtures as fx
from tiered_kv.testing.harness import GPU_BLOCK_SIZE, Hierarchy, config, device
from tiered_kv.disk.format.errors import DiskSizeError
from tiered_kv.disk.format.index import QUARANTINE_SUFFIX, DiskIndex, IndexCorruptError
from tiered_kv.disk.format.index_env import DAMAGE_MARK
from tiered_kv.disk.format.lmdb_check import LmdbDamage, check_data_file
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import CacheLockedError, ManifestError, Namespace, NamespaceError
from tiered_kv.disk.store.store import DiskStore


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("startup") / "cache"
    cd.build_cache(cache)
    return cache


@pytest.fixture
def cache(template, tmp_path) -> Path:
    shutil.copytree(template, tmp_path / "cache")
    return tmp_path / "cache"


def ns_dir(cache: Path) -> Path:
    return next(p.parent for p in cache.glob("*/manifest.json"))


def edit_manifest(cache: Path, change) -> Path:
    path = ns_dir(cache) / "manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    return path


# ---------------------------------------------------------------- the manifest


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("fingerprint.tp_size", "one", "fingerprint.tp_size: expected an integer"),
        ("slot_size", "big", "slot_size: expected"),
        ("slot_size", 4096, "slot_size: expected"),  # smaller than a block: never a run of failing I/O
        ("num_slots", 10**15, "num_slots:"),
        ("num_slots", True, "num_slots: expected"),
        ("checksum", "md5", "checksum: expected one of xxh3_64, crc32c"),
        ("created", None, "created: expected"),
        ("block_bytes", -1, "block_bytes: expected"),
        ("fingerprint.layer_geometry", [["layer.0", ["x"]]], "fingerprint.layer_geometry"),
        ("fingerprint.model_id", None, "fingerprint.model_id: expected a value"),
        ("fingerprint", [], "fingerprint: expected an object"),
        ("namespace_id", "../elsewhere", "namespace_id: expected a directory name"),
        ("format_version", 2, "format_version: 2 is not supported"),
    ],
)
def test_a_bad_manifest_field_is_one_error_naming_the_field_and_the_file(cache, field, value, says):
    def change(doc):
        *parents, last = field.split(".")
        target = doc
        for k in parents:
            target = target[k]
        target[last] = value

    path = edit_manifest(cache, change)
    for open_it in (lambda: Namespace.open_path(path.parent), lambda: cd.start_engine(cache)):
        try:
            got = open_it()
        except ManifestError as e:
            got = ("ManifestError", str(e))
        assert got[0] == "ManifestError", got
        assert says in got[1] and str(path) in got[1], got[1]
    code, text = cd.inspect("summary", str(path.parent))
    assert code == 2 and says in " ".join(text.split()) and "Traceback" not in text, text


@pytest.mark.parametrize(
    "text, says",
    [
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"num_slots": NaN}', "cannot read it as JSON"),
        ("", "cannot read it as JSON"),
        (" " * (2 << 20), "longer than"),
    ],
)
def test_a_manifest_that_is_not_one_is_one_error(cache, text, says):
    path = ns_dir(cache) / "manifest.json"
    path.write_text(text)
    with pytest.raises(ManifestError, match=says):
        Namespace.open_path(path.parent)
    kind, message = cd.start_engine(cache)
    assert kind == "ManifestError" and says in message


def test_an_index_path_that_is_a_regular_file_is_named(cache):
    index = ns_dir(cache) / "index.lmdb"
    shutil.rmtree(index)
    index.write_bytes(b"not an index")
    kind, message = cd.start_engine(cache)
    assert kind == "CacheEntryError" and f"{index} is a regular file, not a directory" in message


# ---------------------------------------------------------------- the index


def test_the_page_walk_finds_the_damage_lmdb_would_meet_later(cache):
    """A key size changed by one bit inside a leaf: LMDB opens the index and its own
    compacting copy passes, but deleting there fails mid-transaction. The walk finds it
    at open, and the engine's start moves the index aside."""
    data = ns_dir(cache) / "index.lmdb" / "data.mdb"
    with open(data, "rb", buffering=0) as f:
        check_data_file(f.fileno())  # the healthy index passes
    leaf = _first_leaf(data)
    raw = bytearray(data.read_bytes())
    page = leaf * 4096
    lower = struct.unpack_from("<H", raw, page + 12)[0]
    first_node = min(struct.unpack_from(f"<{(lower - 16) // 2}H", raw, page + 16))
    raw[page + first_node + 6] ^= 0x04  # the node's key size
    data.write_bytes(bytes(raw))
    with open(data, "rb", buffering=0) as f, pytest.raises(LmdbDamage, match="node area"):
        check_data_file(f.fileno())
    assert cd.start_engine(cache) == ("ok", "")
    assert (ns_dir(cache) / f"index.lmdb{QUARANTINE_SUFFIX}").is_dir()


def _first_leaf(data: Path) -> int:
    """The page number of the first leaf of the ``blocks`` database of the LMDB file
    ``data`` (found from the newest meta page's main database)."""
    from tiered_kv.disk.format.lmdb_check import read_meta

    raw = data.read_bytes()
    _, _, _, main = read_meta(raw[:8192])
    page = raw[main.root * 4096 : (main.root + 1) * 4096]
    lower = struct.unpack_from("<H", page, 12)[0]
    for off in struct.unpack_from(f"<{(lower - 16) // 2}H", page, 16):
        _, _, flags, ksize = struct.unpack_from("<4H", page, off)
        if page[off + 8 : off + 8 + ksize] == b"blocks":
            root = struct.unpack_from("<Q", page, off + 8 + ksize + 40)[0]
            while True:
                p = raw[root * 4096 : (root + 1) * 4096]
                if struct.unpack_from("<H", p, 10)[0] & 0x02:
                    return root
                off0 = struct.unpack_from("<H", p, 16)[0]
                lo, hi, fl, _ = struct.unpack_from("<4H", p, off0)
                root = lo | hi << 16 | fl << 32
    raise AssertionError("no blocks database")


def test_damage_met_while_running_is_marked_and_the_next_start_moves_the_index_aside(cache, caplog):
    """A page damaged after the index was opened (and walked): the read that meets it
    fails, leaves the mark, and the next start moves the index aside."""
    with Namespace.open_path(ns_dir(cache)) as ns, DiskIndex(ns.index_path, ns.tp_size, expected_entries=64) as index:
        leaf = _first_leaf(ns.index_path / "data.mdb")
        with open(ns.index_path / "data.mdb", "r+b", buffering=0) as f:
            os.pwrite(f.fileno(), b"\0\0", leaf * 4096 + 10)  # the page's flags: neither branch nor leaf
        with pytest.raises(lmdb.CorruptedError):
            index.load_all()
    assert (ns_dir(cache) / "index.lmdb" / DAMAGE_MARK).exists()
    with pytest.raises(IndexCorruptError, match="met damage in it while it ran"):
        DiskIndex(ns_dir(cache) / "index.lmdb", 1, expected_entries=64)
    with caplog.at_level(logging.ERROR, logger="tiered_kv"):
        assert cd.start_engine(cache) == ("ok", "")
    assert (ns_dir(cache) / f"index.lmdb{QUARANTINE_SUFFIX}" / DAMAGE_MARK).exists()
    assert any("moved it to" in r.getMessage() for r in caplog.records)


def test_verify_names_the_repair_and_repair_leaves_a_cache_that_verifies_clean(cache):
    cd.damage_index(ns_dir(cache) / "index.lmdb" / "data.mdb")
    code, text = cd.inspect("verify", str(cache))
    flat = " ".join(text.split())
    assert code == 2 and "is damaged" in flat and f"tiered-kv inspect verify --repair {ns_dir(cache)}" in flat, text
    code, text = cd.inspect("verify", str(cache), "--repair")
    assert code == 0, text
    assert (ns_dir(cache) / f"index.lmdb{QUARANTINE_SUFFIX}").is_dir()
    assert cd.inspect("verify", str(cache))[0] == 0
    assert cd.start_engine(cache) == ("ok", "")


# ---------------------------------------------------------------- refused starts


def test_a_start_refused_for_lack_of_space_leaves_no_directory_behind(tmp_path):
    target = tmp_path / "new"
    huge = f"{2 * shutil.disk_usage(tmp_path).free}B"
    with pytest.raises(NamespaceError, match="disk_bytes"):
        Hierarchy(target, disk_bytes=huge)
    assert not target.exists()


def test_disk_bytes_below_one_block_is_refused_before_anything_is_made(tmp_path):
    target = tmp_path / "cache"
    with pytest.raises(DiskSizeError, match="disk_bytes=4096 holds no block"):
        Hierarchy(target, disk_bytes="4KiB")
    assert not target.exists()
    code, text = _demo(target, "--disk-bytes", "4KiB")
    assert code == 2 and "holds no block" in text and "Traceback" not in text, text
    assert not target.exists()


def _demo(cache_dir: Path, *args: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from tiered_kv.cli import _load_commands, app

    _load_commands()
    r = CliRunner().invoke(app, ["demo", "--cache-dir", str(cache_dir), "--requests", "2", *args])
    return r.exit_code, r.output + (
        "" if r.exception is None or isinstance(r.exception, SystemExit) else f"Traceback: {r.exception!r}"
    )


def test_a_refused_start_removes_the_namespace_it_created(tmp_path):
    layout = fx.small_layout()
    fp = fx.fingerprint(layout)
    ns = Namespace.open(tmp_path, fp, layout, num_slots=4)
    assert ns.created and ns.path.is_dir()
    with pytest.raises(RuntimeError, match="refused"):
        with ns.starting():
            raise RuntimeError("refused")
    assert not ns.path.exists() and ns.closed
    # One that existed before stays.
    Namespace.open(tmp_path, fp, layout, num_slots=4).close()
    ns = Namespace.open(tmp_path, fp, layout, num_slots=4)
    assert not ns.created
    with pytest.raises(RuntimeError):
        with ns.starting():
            raise RuntimeError("refused")
    assert ns.path.is_dir()


# ---------------------------------------------------------------- the start-up window


def test_destructive_commands_wait_for_every_engine_process_even_one_starting(cache):
    """A worker opened the store, its scheduler has not taken the writer lock yet: clear,
    evict and verify --repair are refused, naming why, and work once it is gone."""
    layout = device().layout
    fp = _engine_fingerprint(cache, layout)
    with DiskStore.open(cache, fp, layout, disk_bytes=32 * layout.bytes_per_block, io_backend="posix"):
        for cmd in (("clear", "--yes"), ("evict", "--to-size", "0"), ("verify", "--repair")):
            code, text = cd.inspect(cmd[0], str(cache), *cmd[1:])
            assert code == 2 and "open by an engine process" in " ".join(text.split()), text
        assert ns_dir(cache).is_dir()
    code, text = cd.inspect("clear", str(cache), "--yes")
    assert code == 0 and not list(cache.glob("*/manifest.json")), text


def test_an_engine_starting_while_the_inspector_changes_the_cache_is_refused_naming_it(cache):
    from tiered_kv.ops.inspect.cache import open_cache
    from tiered_kv.ops.inspect.maintenance import exclusive

    layout = device().layout
    fp = _engine_fingerprint(cache, layout)
    opened = open_cache(cache)
    with exclusive(opened.namespaces, "clear"):
        with pytest.raises(CacheLockedError, match="tiered-kv inspect clear"):
            DiskOffloadingManager(cache, fp, layout, disk_bytes=32 * layout.bytes_per_block)
    m = DiskOffloadingManager(cache, fp, layout, disk_bytes=32 * layout.bytes_per_block)
    assert len(m) == 16
    m.shutdown()


def test_a_namespace_removed_under_a_starting_engine_is_made_afresh(cache):
    layout = device().layout
    fp = _engine_fingerprint(cache, layout)
    old = ns_dir(cache)
    os.rename(old, cache / ".trash-by-someone")
    with DiskOffloadingManager(cache, fp, layout, disk_bytes=32 * layout.bytes_per_block) as m:
        assert len(m) == 0 and m.namespace.path == old and old.is_dir()


def _engine_fingerprint(cache: Path, layout):
    from tiered_kv.tiered.spec import HierarchySpec

    return HierarchySpec(config(cache, layout.bytes_per_block, 8, 32), GPU_BLOCK_SIZE, layout)._fingerprint()


def test_nothing_is_refused_for_an_entry_it_does_not_open(cache):
    """Leftovers beside the entries (a temporary manifest, a repair lock, a moved-aside
    index) are not the engine's business: they do not stop it."""
    d = ns_dir(cache)
    (d / ".manifest.json.123.abcd").write_text("{}")
    os.symlink("/etc/passwd", d / "unrelated-link")
    assert cd.start_engine(cache) == ("ok", "")
    assert cd.inspect("verify", str(cache))[0] == 0
