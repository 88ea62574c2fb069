"""The crash-trial child: the whole hierarchy under a store / evict / load storm, until
SIGKILLed.

Runs in a child process forked by ``crash.CrashRunner``, at the head of its own process
group (with ``disk_io: process`` each rank's disk I/O process is in it too). It builds
the same hierarchy as ``harness.Hierarchy`` on ``cache_dir``, every TP rank of it
(opening what earlier children left),
then replays requests over a fixed universe of prefix chains that is several times the
CPU tier and larger than the disk tier, so blocks are stored, spilled or written
through, evicted from both tiers, loaded back from disk and promoted, all the time.

It appends to ``journal`` (one ``os.write`` per record; ``D`` records are fsynced):

- ``S`` started, ``R`` ready (the hierarchy is open),
- ``B <n>`` before and ``P`` after each disk-tier ``prepare_store`` of ``n`` blocks, with
  ``E <hex>`` for each block it evicted in between,
- ``D <hex>``: the disk manager reports the block loadable (after ``refresh``): it must
  survive any crash from here on, until an ``E`` for it,
- ``M <n>``: loaded blocks whose bytes were wrong so far (must stay 0),
- ``Q <n>``: requests completed since the last ``Q``.

A Python exception ends the child with exit code 3 and its traceback in ``journal.err``.
"""

from __future__ import annotations

import os
import traceback


def _universe(seed: int = 1234) -> list[list[bytes]]:
    """24 documents of 5 blocks: 6 shared 2-block roots x 4 branches of 3 (84 blocks)."""
    import numpy as np

    from tiered_kv.sim.workloads import prefix_hashes

    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(6):
        root = prefix_hashes(rng.integers(0, 50_000, size=(2, 16)))
        for _ in range(4):
            docs.append(root + prefix_hashes(rng.integers(0, 50_000, size=(3, 16)), root[-1]))
    return docs


class _Journal:
    """Append-only records, each one ``write``: a kill tears one only where it crosses a
    page boundary, and the runner cuts that head off (``crash.drop_torn_tail``)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())

    def sync(self) -> None:
        os.fsync(self.fd)


def run(cache_dir: str, journal: str, seed: int, policy: str, disk_io: str = "thread", tp_size: int = 1) -> None:
    os.setpgid(0, 0)  # its disk I/O processes join this group, so the parent can wait for them
    j = _Journal(journal)
    j.note("S")
    try:
        _storm(cache_dir, seed, policy, disk_io, tp_size, j)
    except BaseException:
        with open(journal + ".err", "w") as f:
            f.write(traceback.format_exc())
        os._exit(3)


def _storm(cache_dir: str, seed: int, policy: str, disk_io: str, tp_size: int, j: _Journal) -> None:
    import random

    import numpy as np
    import torch

    from tiered_kv.testing.harness import Hierarchy

    torch.set_num_threads(1)
    h = Hierarchy(
        cache_dir, write_policy=policy, engine_id=f"storm-{seed}", disk_io=disk_io, tp_size=tp_size, all_ranks=True
    )
    disk = h.disk
    inner_prepare_store = disk.prepare_store

    def journaled_prepare_store(block_hashes, **kwargs):
        block_hashes = list(block_hashes)
        j.note(f"B {len(block_hashes)}")
        out = inner_prepare_store(block_hashes, **kwargs)
        for evicted in out.block_hashes_evicted if out is not None else ():
            j.note(f"E {evicted.hex()}")
        j.note("P")
        return out

    disk.prepare_store = journaled_prepare_store  # type: ignore[method-assign]  # journal each reservation
    docs = _universe()
    universe = list(dict.fromkeys(b for d in docs for b in d))
    weights = 1.0 / np.arange(1, len(docs) + 1) ** 0.8
    weights /= weights.sum()
    zipf = weights.tolist()
    rng = random.Random(seed)
    order = np.random.default_rng(seed).permutation(len(docs))  # each child has its own favourites
    acked: set[bytes] = set()
    mismatches = done = 0
    j.note("R")
    while True:
        doc = docs[order[rng.choices(range(len(docs)), zipf)[0]]]
        h.driver.run_request(doc[: rng.randint(2, len(doc))])
        done += 1
        disk.refresh()
        durable = disk.loadable_among(b for b in universe if b not in acked)
        if durable:
            for b in durable:
                j.note(f"D {b.hex()}")
            j.sync()
            acked |= durable
        acked &= disk.loadable_among(acked)  # evictions are journaled inside prepare_store
        if h.driver.report.mismatches != mismatches:
            mismatches = h.driver.report.mismatches
            j.note(f"M {mismatches}")
            j.sync()
        if done % 10 == 0:
            j.note("Q 10")
        if rng.random() < 0.05:
            h.settle()  # now and then, let every queued write land (kills then hit a quiet disk)
