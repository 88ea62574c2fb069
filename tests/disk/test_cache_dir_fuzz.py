"""Fuzzing a disk cache's manifest and index pages.

The manifest and the LMDB index are read back from disk, so they are untrusted input.
Seeded mutations of each (fields deleted, retyped or set to hostile values; bytes
flipped, cut or replaced; index pages flipped, zeroed, copied or cut) go through an
engine's start-up (a worker's store, then the scheduler's manager; every block it then
holds is loaded and compared byte for byte) and through one inspector command each, in
turn, so every command sees a share. Each must end in a start, or in one error naming
what is wrong (``NamespaceError``, or exit 2 with an ``error:`` line; ``verify`` may
exit 1), never a traceback, and no engine is ever served a wrong block.
``TIERED_KV_FUZZ_MUTATIONS`` sets the count (default 520: half manifest, half index).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from support import cache_dir_checks as cd
from tiered_kv.testing.harness import GPU_BLOCK_SIZE, config, device, expected_bytes, namespace_dirs
from tiered_kv.config import ConfigError
from tiered_kv.disk.format.index import QUARANTINE_SUFFIX
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.namespace import NamespaceError
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.tiered.spec import HierarchySpec

MUTATIONS = int(os.environ.get("TIERED_KV_FUZZ_MUTATIONS", "520"))
SEED = 20261125
DISK_BLOCKS = 32
HOSTILE = [
    None,
    True,
    False,
    0,
    -1,
    1,
    3,
    2**63,
    10**15,
    1.5,
    -0.0,
    1e308,
    "",
    "one",
    "big",
    "NaN",
    "../../etc",
    "x" * 5000,
    [],
    {},
    [1, 2],
    {"a": 1},
    [[["deep"]]],
    "\u00e9\u4e2d",
]


@pytest.fixture(scope="module")
def engine_args(tmp_path_factory):
    """A template cache full of known blocks, and what an engine opens it with."""
    cache = tmp_path_factory.mktemp("fuzz") / "cache"
    cd.build_cache(cache)
    layout = device().layout
    spec = HierarchySpec(config(cache, layout.bytes_per_block, 8, DISK_BLOCKS), GPU_BLOCK_SIZE, layout)
    hashes = sorted({b for doc in cd.DOCS for b in doc})
    return cache, spec._fingerprint(), layout, hashes


def start_and_serve(cache: Path, fp, layout, hashes) -> str:
    """An engine's start on ``cache`` (worker store, then manager) and a load of every
    block it holds; "refused" on a start-up error, "index replaced" when it moved a
    damaged index aside, "ok" otherwise. Raises on a wrong block or any other exception."""
    disk_bytes = DISK_BLOCKS * layout.bytes_per_block
    aside = next(cache.glob(f"*/index.lmdb{QUARANTINE_SUFFIX}"), None)
    store = manager = None
    try:
        try:
            store = DiskStore.open(
                cache, fp, layout, disk_bytes=disk_bytes, io_backend="posix", io_threads=1, engine_id="fuzz"
            )
            manager = DiskOffloadingManager(
                cache, fp, layout, disk_bytes=disk_bytes, engine_id="fuzz", enable_events=False, poll_interval=None
            )
        except (NamespaceError, ConfigError) as e:
            assert str(e).strip(), "an error without a message"
            return "refused"
        held = sorted(manager.loadable_among(hashes))
        if held:
            spec = manager.prepare_load(held)
            slots = [int(s) for s in spec.block_ids]
            out = torch.zeros((len(held), store.slot_size), dtype=torch.uint8)
            ok = store.read_blocks(0, held, slots, out)
            manager.complete_load(held)
            for h, good, row in zip(held, ok, out):
                if good:
                    assert bytes(row[: store.block_bytes].numpy()) == expected_bytes(h, store.block_bytes), (
                        f"block {h.hex()[:12]} was served with another block's bytes"
                    )
        if aside is None and next(cache.glob(f"*/index.lmdb{QUARANTINE_SUFFIX}"), None) is not None:
            return "index replaced"
        return "ok"
    finally:
        if manager is not None:
            manager.shutdown()
        if store is not None:
            store.close()


def inspect_ok(args: list[str]) -> int:
    code, text = cd.inspect(*args)
    assert code in (0, 1, 2) and "Traceback" not in text, f"inspect {' '.join(args)}: exit {code}\n{text}"
    if code == 2:
        assert text.count("error:") == 1, f"inspect {' '.join(args)}: not one error line\n{text}"
    if code == 1:
        assert args[0] == "verify", f"inspect {' '.join(args)} exited 1\n{text}"
    return code


# ---------------------------------------------------------------- manifest mutations


def _paths(doc: dict) -> list[tuple[str, ...]]:
    out = [(k,) for k in doc]
    out += [("fingerprint", k) for k in doc["fingerprint"]] + [("layout", k) for k in doc["layout"]]
    return out


def mutate_manifest(text: str, rng: random.Random) -> bytes:
    doc = json.loads(text)
    how = rng.randrange(10)
    if how <= 4:  # one field deleted, retyped or hostile
        path = rng.choice(_paths(doc))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if rng.random() < 0.15:
            del parent[path[-1]]
        else:
            parent[path[-1]] = rng.choice(HOSTILE)
    elif how == 5:  # plausible but wrong numbers
        key = rng.choice(["num_slots", "slot_size", "block_bytes", "created", "format_version"])
        doc[key] = rng.choice([doc[key] * 2, doc[key] // 2, doc[key] + 1, doc[key] - 4096, 0, -1, 10**15])
    elif how == 6:  # another engine's values
        choices = ["crc32c", "md5", "0" * 16, doc["namespace_id"][::-1]]
        doc[rng.choice(["checksum", "namespace_id"])] = rng.choice(choices)
        if rng.random() < 0.5:
            doc["fingerprint"][rng.choice(["tp_size", "dtype", "block_size"])] = rng.choice([2, "bfloat16", 32])
    elif how == 7:  # an unknown field, or a different document
        return rng.choice(
            [b"[]", b"null", b"1", b'"manifest"', b"", b"{", b"{}", json.dumps({**doc, "extra": 1}).encode()]
        )
    else:  # bytes flipped, cut, inserted, or numbers JSON does not have
        raw = bytearray(json.dumps(doc).encode())
        pick = rng.randrange(4)
        if pick == 0:
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(raw))
                raw[i] ^= 1 << rng.randrange(8)
        elif pick == 1:
            raw = raw[: rng.randrange(len(raw))]
        elif pick == 2:
            i = rng.randrange(len(raw))
            raw[i:i] = rng.randbytes(rng.randint(1, 8))
        else:  # "num_slots": NaN, "x": <the old value>
            bad = rng.choice([b"NaN", b"Infinity", b"-Infinity"])
            raw = raw.replace(b'"num_slots": ', b'"num_slots": ' + bad + b', "x": ', 1)
        return bytes(raw)
    return json.dumps(doc, allow_nan=True).encode()


# ---------------------------------------------------------------- index page mutations


def mutate_index(data: bytes, rng: random.Random) -> bytes:
    raw = bytearray(data)
    psize = 4096
    last = struct.unpack_from("<Q", raw, 136)[0] if len(raw) >= 2 * psize else 1
    pages = max(3, min(len(raw) // psize, last + 1))
    how = rng.randrange(10)
    if how <= 5:  # a few bits of the used pages, now and then of a meta page
        for _ in range(rng.choice([1, 1, 2, 4, 16])):
            lo = 0 if rng.random() < 0.1 else 2 * psize
            i = rng.randrange(lo, pages * psize)
            raw[i] ^= 1 << rng.randrange(8)
    elif how == 6:  # a page zeroed or filled with noise
        p = rng.randrange(pages)
        raw[p * psize : (p + 1) * psize] = bytes(psize) if rng.random() < 0.5 else rng.randbytes(psize)
    elif how == 7:  # one page copied over another
        a, b = rng.randrange(2, pages), rng.randrange(pages)
        raw[b * psize : (b + 1) * psize] = raw[a * psize : (a + 1) * psize]
    elif how == 8:  # a node's bytes in a leaf page
        p = rng.randrange(2, pages)
        i = p * psize + rng.randrange(16, psize)
        raw[i : i + 8] = rng.randbytes(8)
    else:  # cut at a page boundary
        raw = raw[: rng.randrange(1, pages) * psize]
    return bytes(raw)


# ---------------------------------------------------------------- the test


def _fresh(template: Path, work: Path, manifest: bytes, index: bytes, link_slabs: bool) -> tuple[Path, Path]:
    """A copy of ``template`` at ``work`` with this manifest and index; its slabs are
    hard links where nothing will write them (the inspector's copy), else copies."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(
        template,
        work,
        copy_function=lambda src, dst: (
            os.link(src, dst) if link_slabs and src.endswith(".slab") else shutil.copy2(src, dst)
        ),
    )
    ns_dir = namespace_dirs(work)[0]
    (ns_dir / "manifest.json").write_bytes(manifest)
    (ns_dir / "index.lmdb" / "data.mdb").write_bytes(index)
    return work, ns_dir


@pytest.mark.faults
@pytest.mark.timeout(600)
def test_mutated_manifests_and_index_pages_give_errors_or_right_blocks(engine_args, tmp_path):
    template, fp, layout, hashes = engine_args
    rng = random.Random(SEED)
    ns_template = namespace_dirs(template)[0]
    manifest = (ns_template / "manifest.json").read_bytes()
    index = (ns_template / "index.lmdb" / "data.mdb").read_bytes()
    outcomes = {
        "manifest": {"ok": 0, "refused": 0, "index replaced": 0},
        "index": {"ok": 0, "refused": 0, "index replaced": 0},
    }
    codes: dict[str, list[int]] = {}
    for i in range(MUTATIONS):
        kind = "manifest" if i % 2 == 0 else "index"
        state = (
            (mutate_manifest(manifest.decode(), rng), index)
            if kind == "manifest"
            else (manifest, mutate_index(index, rng))
        )
        cmd = cd.COMMANDS[(i // 2) % len(cd.COMMANDS)]
        _, ns_dir = _fresh(template, tmp_path / "inspect", *state, link_slabs=True)
        code = inspect_ok([cmd[0], str(ns_dir), *cmd[1:], *(["--json"] if i % 4 else [])])
        codes.setdefault(" ".join(cmd), []).append(code)
        # The engine starts on the mutation itself, not on what the inspector left.
        cache, _ = _fresh(template, tmp_path / "engine", *state, link_slabs=False)
        outcomes[kind][start_and_serve(cache, fp, layout, hashes)] += 1

    print(
        f"fuzz: {MUTATIONS} mutations, engine {outcomes}, inspector exit codes "
        f"{ {cmd: np.bincount(seen, minlength=3).tolist() for cmd, seen in codes.items()} }"
    )
    # The mutations meant something: manifests were refused and served, damaged index
    # pages were found and replaced (and some flips, in unused bytes, were harmless),
    # every command both succeeded and refused, and an untouched copy serves every block.
    assert outcomes["manifest"]["ok"] and outcomes["manifest"]["refused"], outcomes
    assert outcomes["index"]["ok"] and outcomes["index"]["index replaced"], outcomes
    for cmd, seen in codes.items():
        assert 0 in seen and 2 in seen, (cmd, np.bincount(seen))
    cache, _ = _fresh(template, tmp_path / "engine", manifest, index, link_slabs=False)
    assert start_and_serve(cache, fp, layout, hashes) == "ok"
    assert cd.blocks_served_right(cache) == (len(hashes), 0)
