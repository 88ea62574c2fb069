"""Fixtures shared by the vLLM integration tests."""

from __future__ import annotations

from collections import Counter

import pytest


@pytest.fixture
def disk_reads(monkeypatch) -> Counter[bytes]:
    """Blocks read from any disk store of this process (a scheduler's verifier, the
    workers), by block hash: counted where every read of a block begins."""
    from tiered_kv.disk.worker.store import DiskStore

    reads: Counter[bytes] = Counter()
    original = DiskStore.begin_read

    def counting(self, rank, hashes, slots):
        reads.update(bytes(h) for h in hashes)
        return original(self, rank, hashes, slots)

    monkeypatch.setattr(DiskStore, "begin_read", counting)
    return reads
