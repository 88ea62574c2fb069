"""vLLM 0.33's own CPU offloading manager behind this project's seed-style manager API.

Scheduler-side only, no I/O. ``tools/replay.py`` runs the same engine-driver trace
through it, with the same number of CPU slots as our CPU tier, while the bytes move
through our CPU handlers (the specs it returns name CPU slots, as ours do).

How the two APIs meet: vLLM's manager works per key (``OffloadKey`` = block hash +
KV-group index; one group here) and per request (``ReqContext``). The driver calls,
per request, ``lookup`` -> ``prepare_load`` -> ``complete_load`` -> ``prepare_store``
-> ``touch``, so a request context is opened by the first call after a ``touch`` and
finished (``on_request_finished``, which commits vLLM's LRU recency) by ``touch``.
``lookup`` over a list counts the leading keys vLLM reports as ``HIT`` (a
``HIT_PENDING`` block is still being stored: not loadable, like ours). Key positions
(end token of each block) are recorded before ``prepare_store`` so vLLM's LRU ranks a
request's tail blocks older than its head, as it does inside vLLM.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from tiered_kv.abstract import BlockHash, OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiered_kv.mediums import CPU, CPULoadStoreSpec

if TYPE_CHECKING:  # vLLM is imported where the adapter is built
    from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, ReqContext


def vllm_import_error() -> str | None:
    """Why vLLM's CPU offloading manager cannot be imported here, or None."""
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception as exc:  # a missing or broken install: the comparison is skipped
        return f"{type(exc).__name__}: {exc}"
    return None


class VllmCpuManagerAdapter(OffloadingManager):
    """vLLM's ``CPUOffloadingManager`` (``policy`` lru or arc, ``num_slots`` chunks of one
    offloaded block each) presented with the seed API. ``block_size`` is the offloaded
    block in tokens (labels events and gives key positions)."""

    def __init__(self, num_slots: int, block_size: int, policy: str = "lru"):
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self._base = base
        self.block_size = block_size
        self.inner = CPUOffloadingManager(num_chunks=num_slots, cache_policy=policy, enable_events=True)
        self._ids = itertools.count()
        self._ctx: ReqContext | None = None
        # complete_store arrives after its request finished; vLLM ignores its context.
        self._store_ctx = base.ReqContext(req_id="replay-stores")

    # ---- request contexts ----

    def _request(self) -> ReqContext:
        if self._ctx is None:
            self._ctx = self._base.ReqContext(req_id=f"replay-{next(self._ids)}")
            self.inner.on_new_request(self._ctx)
        return self._ctx

    def _keys(self, block_hashes: Iterable[BlockHash]) -> list:
        make = self._base.make_offload_key
        return [make(h, 0) for h in block_hashes]

    def _hashes(self, keys: Iterable) -> list[BlockHash]:
        return [bytes(self._base.get_offload_block_hash(k)) for k in keys]

    # ---- seed API ----

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        ctx, hit = self._request(), self._base.LookupResult.HIT
        n = 0
        for key in self._keys(block_hashes):
            if self.inner.lookup(key, ctx) is not hit:
                break
            n += 1
        return n

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> CPULoadStoreSpec:
        spec = self.inner.prepare_load(self._keys(block_hashes), self._request())
        return CPULoadStoreSpec(cast("BlockIDsLoadStoreSpec", spec).block_ids)  # vLLM declares the base type

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        self.inner.complete_load(self._keys(block_hashes), self._request())

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        ctx = self._request()
        keys = self._keys(block_hashes)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * self.block_size)
        out = self.inner.prepare_store(keys, ctx)
        if out is None:
            return None
        return PrepareStoreOutput(
            self._hashes(out.keys_to_store),
            CPULoadStoreSpec(cast("BlockIDsLoadStoreSpec", out.store_spec).block_ids),
            self._hashes(out.evicted_keys),
        )

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        self.inner.complete_store(self._keys(block_hashes), self._store_ctx, success)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        ctx = self._request()
        self.inner.touch(self._keys(block_hashes), ctx)
        self.inner.on_request_finished(ctx)
        self._ctx = None

    def take_events(self) -> list[OffloadingEvent]:
        return [
            OffloadingEvent(self._hashes(e.keys), self.block_size, CPU, e.removed) for e in self.inner.take_events()
        ]
