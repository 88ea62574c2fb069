"""What the cache-directory tests plant in a disk cache and what they run on it
(``tests/test_cache_dir_*.py``).

Runs in the test process and in the child processes those tests start (so that a
hang is a timeout, not a stuck test run). Builds a small real cache with the whole
hierarchy, copies it per case, replaces one entry with something a hostile local user
could plant (a symbolic link to a file outside, a dangling one, one to a directory, a
FIFO, a file or directory of another user), then starts an engine on it and runs every
inspector command, recording what each did. Nothing is mocked: real files, real LMDB,
the real CLI.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import sys
import traceback
from pathlib import Path

from tiered_kv.testing.harness import Hierarchy, documents, expected_bytes, namespace_dirs

#: uid of the "other user" (nobody); the tests run as root, so they can plant its files.
OTHER_UID = 65534
KINDS = ("link-to-file", "dangling-link", "link-to-dir", "fifo", "other-user")
FILE_ENTRIES = ("manifest.json", "lock", "rank0.slab", "index.lmdb/data.mdb", "index.lmdb/lock.mdb")
DIR_ENTRIES = ("index.lmdb", ".")  # "." is the namespace directory itself
#: What the error must say for each kind.
SAYS = {
    "link-to-file": "symbolic link to",
    "dangling-link": "dangling symbolic link",
    "link-to-dir": "symbolic link to the directory",
    "fifo": "a FIFO",
    "other-user": f"uid {OTHER_UID}",
}
COMMANDS = (("summary",), ("ls",), ("verify",), ("verify", "--repair"), ("evict", "--to-size", "0"), ("clear", "--yes"))
DOCS = documents(4, 4, seed=3)


def quiet() -> None:
    """Faults are logged by design; keep them off the output the tests read (child
    processes only: it changes this process's logging for good)."""
    log = logging.getLogger("tiered_kv")
    log.setLevel(logging.CRITICAL)
    log.propagate = False


def build_cache(cache: Path) -> Path:
    """A cache whose disk tier holds every block of ``DOCS``; returns its namespace dir."""
    with Hierarchy(cache, cpu_blocks=8, disk_blocks=32) as h:
        for doc in DOCS:
            h.run([doc])
            h.settle()
    return namespace_dirs(cache)[0]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (not following links): kind, size, bytes of files."""
    out = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, data)
    return out


def plant(ns_dir: Path, entry: str, kind: str, outside: Path) -> Path:
    """Replace ``entry`` of ``ns_dir`` with what ``kind`` names; returns the planted path.
    ``outside`` is a directory beside the cache that links point into."""
    target = ns_dir if entry == "." else ns_dir / entry
    is_dir = target.is_dir()
    outside.mkdir(exist_ok=True)
    (outside / "victim.txt").write_bytes(b"precious bytes that the cache must not touch\n" * 64)
    if kind == "other-user":
        for p in [target, *(target.rglob("*") if is_dir else ())]:
            os.chown(p, OTHER_UID, OTHER_UID, follow_symlinks=False)
        return target
    if is_dir:
        shutil.copytree(target, outside / "copy", symlinks=True)
        shutil.rmtree(target)
    else:
        shutil.copy(target, outside / "copy")
        target.unlink()
    if kind == "link-to-file":
        os.symlink(outside / "victim.txt", target)
    elif kind == "dangling-link":
        os.symlink(outside / "created-by-the-cache", target)
    elif kind == "link-to-dir":
        os.symlink(outside / ("copy" if is_dir else ""), target)
    elif kind == "fifo":
        os.mkfifo(target, 0o600)
    return target


def start_engine(cache: Path) -> tuple[str, str]:
    """Start an engine (worker store, then manager) on ``cache`` and serve every block:
    ``("ok", "")``, ``("wrong", hashes)`` if a block came back wrong, or the error's
    ``(type name, message)``."""
    try:
        h = Hierarchy(cache, cpu_blocks=8, disk_blocks=32)
    except Exception as e:  # reported, and judged by the test
        return type(e).__name__, str(e) + ("" if _expected(e) else "\n" + traceback.format_exc())
    with h:
        report = h.run(DOCS)
        h.settle()
        return ("ok", "") if report.mismatches == 0 else ("wrong", str(report.mismatches))


def _expected(e: BaseException) -> bool:
    from tiered_kv.config import ConfigError
    from tiered_kv.disk.format.namespace import NamespaceError

    return isinstance(e, (NamespaceError, ConfigError))


_app = None


def inspect(*args: str) -> tuple[int, str]:
    """``tiered-kv inspect ARGS`` in this process: (exit code, stdout and stderr); an
    exception that escaped the CLI is reported as exit -1 with its traceback."""
    global _app
    from typer.testing import CliRunner

    if _app is None:
        from tiered_kv.cli import _load_commands, app

        _load_commands()
        _app = app
    result = CliRunner().invoke(_app, ["inspect", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return -1, "".join(traceback.format_exception(result.exception))
    return result.exit_code, result.output


def run_planted(template: Path, work: Path, entry: str, kind: str) -> dict:
    """One case: a fresh copy of ``template``'s cache with ``entry`` planted as ``kind``,
    then an engine start and every inspector command; what each did, and whether the
    directory outside changed."""
    case = work / f"{entry.replace('/', '-').replace('.', 'ns')}-{kind}"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(template, case / "cache", symlinks=True)
    ns_dir = namespace_dirs(case / "cache")[0]
    outside = case / "outside"
    planted = plant(ns_dir, entry, kind, outside)
    before = snapshot(outside)
    out = {"entry": entry, "kind": kind, "planted": str(planted), "engine": start_engine(case / "cache")}
    for cmd in COMMANDS:
        code, text = inspect(cmd[0], str(case / "cache"), *cmd[1:])
        out[" ".join(cmd)] = (code, text)
    out["outside_changed"] = snapshot(outside) != before
    out["created_outside"] = os.path.lexists(outside / "created-by-the-cache")
    return out


def main() -> None:
    """Child process: ``cache_dir_checks.py TEMPLATE WORK CASES_JSON``; one JSON line per
    case, flushed as it finishes (``start`` lines name a case before it runs)."""
    quiet()
    template, work, cases = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    for entry, kind in cases:
        print(json.dumps({"start": [entry, kind]}), flush=True)
        print(json.dumps(run_planted(template, work, entry, kind)), flush=True)


def damage_index(data: Path) -> None:
    """Zero the root page of the main database of the LMDB file ``data`` (a page every
    reader passes through)."""
    from tiered_kv.disk.format.lmdb_check import read_meta

    raw = bytearray(data.read_bytes())
    psize, _, _, main = read_meta(bytes(raw[: 2 * 65536]))
    raw[main.root * psize : (main.root + 1) * psize] = bytes(psize)
    data.write_bytes(bytes(raw))


def blocks_served_right(cache: Path) -> tuple[int, int]:
    """Read every block an engine on ``cache`` would serve; (served, wrong)."""
    from tiered_kv.disk.store.store import DiskStore

    served = wrong = 0
    for ns_dir in namespace_dirs(cache):
        store = DiskStore.open_readonly(ns_dir)
        try:
            snap = store.snapshot()
            hashes = [snap.hash_at(i) for i in range(len(snap.entries))] + [h for h, _ in snap.odd]
            for h in hashes:
                for rank in range(store.tp_size):
                    data = store.read_block(rank, h)
                    if data is not None:
                        served += 1
                        wrong += data != expected_bytes(h, store.block_bytes)
        finally:
            store.close()
    return served, wrong


if __name__ == "__main__":
    main()
