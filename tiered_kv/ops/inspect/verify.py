"""``verify``: re-read every block of a namespace and check it against its checksum.

Operator's process. Reads the slab files with POSIX I/O (O_DIRECT where the file
system takes it) on a small thread pool, runs of consecutive slots at a time, and
compares each block's checksum with the one its index entry records for that rank.
Without ``repair`` nothing is written, and it may run while an engine uses the cache:
a block that looks corrupt is re-checked against the index afterwards, and if its
entry changed meanwhile (the engine evicted or rewrote it) it is counted as
``changed``, not corrupt. With ``repair`` it holds the writer lock (no engine may run)
and deletes the entries of corrupt, invalid and incomplete blocks; an index whose pages
are damaged is moved aside to ``index.lmdb.corrupt`` and replaced by an empty one
(``index_damage`` says why), so the namespace then verifies clean. Slab files are
opened through the namespace directory's descriptor (``safe_open``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered_kv.disk.format.index import DiskIndex, IndexCorruptError
from tiered_kv.disk.store.io_backends import BackendFile, PosixBackend, aligned_empty, host_view
from tiered_kv.disk.format.namespace import Namespace
from tiered_kv.checksums import checksum_function
from tiered_kv.ops.inspect.cache import EntryTable, InspectError, read_entries
from tiered_kv.ops.inspect.maintenance import delete_entries, exclusive, open_index_for_writing

#: Largest single read.
READ_BYTES = 8 << 20


@dataclass
class VerifyResult:
    """Outcome for one namespace. ``corrupt``: ``{hash, slot, rank, reason}`` per bad
    copy (checksum mismatch, unreadable bytes, or an entry that points outside the slab
    or has the wrong size); ``incomplete``: ``{hash, slot, ranks}`` of entries some rank
    never committed; ``changed``: suspected blocks whose entry changed while reading
    (an engine at work, not corruption)."""

    namespace: str
    blocks: int = 0
    copies_checked: int = 0
    bytes_read: int = 0
    corrupt: list[dict[str, Any]] = field(default_factory=list)
    incomplete: list[dict[str, Any]] = field(default_factory=list)
    changed: int = 0
    repaired: int = 0
    seconds: float = 0.0
    index_damage: str | None = None  # why ``repair`` replaced a damaged index, if it did

    @property
    def corrupt_blocks(self) -> int:
        return len({c["hash"] for c in self.corrupt})

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "blocks": self.blocks,
            "copies_checked": self.copies_checked,
            "bytes_read": self.bytes_read,
            "corrupt_blocks": self.corrupt_blocks,
            "corrupt": self.corrupt,
            "incomplete": self.incomplete,
            "changed": self.changed,
            "repaired": self.repaired,
            "index_damage": self.index_damage,
            "seconds": self.seconds,
        }


def bytes_to_verify(ns: Namespace, table: EntryTable) -> int:
    """Bytes ``verify`` will read for ``table`` (every committed copy)."""
    return int(table.rank_counts().sum()) * ns.manifest.block_bytes


def verify_namespace(
    ns: Namespace,
    *,
    repair: bool = False,
    threads: int = 4,
    progress: Callable[[int], None] | None = None,
    on_table: Callable[[EntryTable], None] | None = None,
) -> VerifyResult:
    """Check every committed copy of every block of ``ns``. ``progress(n)`` is called
    with the bytes of each finished read; ``on_table(table)`` once the index is read
    (e.g. to size a progress bar). Raises ``InspectError`` when the index cannot be
    read, or, with ``repair``, when an engine holds the cache."""
    if not repair:
        return _verify(ns, None, threads, progress, on_table)
    with exclusive([ns], "repair"):
        damage = index_damage(ns)
        index = open_index_for_writing(ns, repair=True)
        try:
            result = _verify(ns, index, threads, progress, on_table)
            result.index_damage = damage
            if index is not None:
                items = {(bytes.fromhex(c["hash"]), c["slot"]) for c in result.corrupt}
                items |= {(bytes.fromhex(c["hash"]), c["slot"]) for c in result.incomplete}
                result.repaired = delete_entries(index, sorted(items))
            return result
        finally:
            if index is not None:
                index.close()


def index_damage(ns: Namespace) -> str | None:
    """Why ``ns``'s index is damaged (its page walk, read-only), or None."""
    try:
        index = ns.open_index(readonly=True)
    except FileNotFoundError:
        return None
    except IndexCorruptError as e:
        return e.reason
    try:
        index.check_pages()
    except IndexCorruptError as e:
        return e.reason
    finally:
        index.close()
    return None


def _verify(ns: Namespace, index: DiskIndex | None, threads: int, progress, on_table) -> VerifyResult:
    t0 = time.perf_counter()
    m = ns.manifest
    try:
        checksum = checksum_function(m.checksum)
    except (RuntimeError, ValueError) as e:
        raise InspectError(f"{ns.path.name}: {e}") from None
    table = read_entries(ns, index)
    if on_table is not None:
        on_table(table)
    result = VerifyResult(ns.path.name)
    valid_shape = (table.slot >= 0) & (table.slot < m.num_slots) & (table.size == m.block_bytes)
    complete = table.complete
    result.blocks = int((complete & valid_shape).sum())
    for i in np.flatnonzero(~complete).tolist():
        result.incomplete.append(
            {
                "hash": table.hash(i).hex(),
                "slot": int(table.slot[i]),
                "ranks": [r for r in range(ns.tp_size) if int(table.ranks[i]) >> r & 1],
            }
        )
    for i in np.flatnonzero(~valid_shape).tolist():
        result.corrupt.append(
            {
                "hash": table.hash(i).hex(),
                "slot": int(table.slot[i]),
                "rank": None,
                "reason": f"invalid entry: slot {int(table.slot[i])} of {m.num_slots}, "
                f"size {int(table.size[i])} of {m.block_bytes}",
            }
        )
    suspects: list[tuple[int, int, str]] = []  # (row, rank, reason)
    backend = PosixBackend(1)
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="tkv-verify") as pool:
            for rank in range(ns.tp_size):
                on_rank = valid_shape & (((table.ranks >> np.uint64(rank)) & np.uint64(1)) == 1)
                rows = np.flatnonzero(on_rank)
                rows = rows[np.argsort(table.slot[rows], kind="stable")]
                suspects += _verify_rank(
                    ns, rank, table, rows, backend, pool, 2 * max(1, threads), checksum, progress, result
                )
    finally:
        backend.shutdown()
    _settle_suspects(ns, table, suspects, index is not None, result)
    result.seconds = time.perf_counter() - t0
    return result


def _verify_rank(
    ns: Namespace,
    rank: int,
    table: EntryTable,
    rows: np.ndarray,
    backend: PosixBackend,
    pool: ThreadPoolExecutor,
    in_flight: int,
    checksum,
    progress,
    result: VerifyResult,
) -> list[tuple[int, int, str]]:
    """Check rank ``rank``'s copies of ``rows`` (sorted by slot), at most ``in_flight``
    reads at a time; returns the suspects."""
    m = ns.manifest
    if not len(rows):
        return []
    path = ns.slab_path(rank)
    try:
        f = backend.open(path, True, ns.fd, ns.owner)
    except OSError as e:
        return [(int(i), rank, f"{path.name} cannot be opened: {e.strerror}") for i in rows]
    per_read = max(1, READ_BYTES // m.slot_size)
    slots = table.slot[rows]
    runs, start = [], 0
    for k in range(1, len(rows) + 1):
        if k == len(rows) or slots[k] != slots[k - 1] + 1 or k - start == per_read:
            runs.append((start, k))
            start = k
    suspects: list[tuple[int, int, str]] = []
    try:
        window: list[Future] = []
        for lo, hi in runs:
            window.append(
                pool.submit(
                    _check_run,
                    f,
                    backend,
                    rows[lo:hi],
                    int(slots[lo]),
                    rank,
                    table,
                    m.slot_size,
                    m.block_bytes,
                    checksum,
                )
            )
            if len(window) >= in_flight:
                suspects += _collect(window.pop(0), m.block_bytes, progress, result)
        for fut in window:
            suspects += _collect(fut, m.block_bytes, progress, result)
    finally:
        backend.close_file(f)
    return suspects


def _check_run(
    f: BackendFile,
    backend: PosixBackend,
    rows: np.ndarray,
    first_slot: int,
    rank: int,
    table: EntryTable,
    slot_size: int,
    block_bytes: int,
    checksum,
) -> tuple[int, list]:
    n = len(rows)
    buf = aligned_empty(n * slot_size)
    try:
        backend.pread(f, buf, first_slot * slot_size)
    except OSError as e:
        return n, [(int(i), rank, f"unreadable: {e.strerror or e}") for i in rows]
    view = buf.view(n, slot_size)
    bad = []
    for j, i in enumerate(rows.tolist()):
        if checksum(host_view(view[j, :block_bytes])) != int(table.checksums[i, rank]):
            bad.append((i, rank, "checksum mismatch"))
    return n, bad


def _collect(fut: Future, block_bytes: int, progress, result: VerifyResult) -> list:
    n, bad = fut.result()
    result.copies_checked += n
    result.bytes_read += n * block_bytes
    if progress is not None:
        progress(n * block_bytes)
    return bad


def _settle_suspects(
    ns: Namespace, table: EntryTable, suspects: list[tuple[int, int, str]], locked: bool, result: VerifyResult
) -> None:
    """Record suspects as corrupt, except (when an engine may be running) those whose
    entry no longer says what was checked."""
    if not suspects:
        return
    current = None
    if not locked:
        hashes = [table.hash(i) for i, _, _ in suspects]
        index = ns.open_index(readonly=True)
        try:
            current = index.get_many(hashes)
        finally:
            index.close()
    for k, (i, rank, reason) in enumerate(suspects):
        if current is not None:
            now = current[k]
            if (
                now is None
                or now.slot != int(table.slot[i])
                or not now.has_rank(rank)
                or now.checksums[rank] != int(table.checksums[i, rank])
            ):
                result.changed += 1
                continue
        result.corrupt.append({"hash": table.hash(i).hex(), "slot": int(table.slot[i]), "rank": rank, "reason": reason})
