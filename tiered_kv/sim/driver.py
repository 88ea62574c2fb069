"""An engine stand-in that drives any offloading manager and worker end to end.

Runs the scheduler and the model-runner roles in one process, as the demo, the tests
and the benchmarks need: it owns a small "device" KV cache (CUDA tensors when asked
and available, CPU tensors standing in otherwise) with its own LRU prefix cache of
GPU blocks, so blocks fall out of it and must come back from the offloading tiers.
For each request (a prefix-hash chain, see ``tiered_kv.sim.workloads``) it calls the
manager as a scheduler would (lookup, prepare_load, complete_load, prepare_store,
complete_store, touch) and the worker as a model runner would (transfer_async, wait,
get_finished). Every block's bytes are a pure function of its hash, so each loaded
block is checked byte for byte against what must have been stored. A failed load is
recomputed and counted, never raised. It does no I/O itself; the tiers it drives may.

Time: with a ``ServiceClock`` the driver models an engine that serves one request after
another, each taking its tokens' prefill time; the hierarchy's time-aware rules (session
retention) read that clock, so a run's hit rates do not depend on this machine's speed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import xxhash

from tiered_kv.abstract import BlockHash, OffloadingManager
from tiered_kv.memory.device import resolve_device
from tiered_kv.memory.host_memory import expand_block_ids, pack_blocks, unpack_blocks
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.mediums import GPULoadStoreSpec
from tiered_kv.metrics import TransferCounter
from tiered_kv.prefill import DEFAULT_PREFILL_TOKENS_PER_S
from tiered_kv.spec import OffloadingSpec
from tiered_kv.worker.worker import OffloadingHandler, TransferResult, TransferSpec
from tiered_kv.sim.workloads import Workload

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def block_content(block_hashes: Sequence[BlockHash], nbytes: int) -> torch.Tensor:
    """The bytes every offloaded block must hold: ``(N, nbytes)`` uint8, a pure function
    of each hash (splitmix64 of the hash's seed and the word position), so they differ
    between blocks and between layers (layers occupy different positions)."""
    seeds = np.fromiter((xxhash.xxh3_64_intdigest(h) for h in block_hashes), dtype=np.uint64, count=len(block_hashes))
    words = -(-nbytes // 8)
    x = seeds[:, None] + (np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return torch.from_numpy(x.view(np.uint8)[:, :nbytes])


class DeviceKVCache:
    """Per-layer KV tensors standing for one GPU's KV cache (named ``layer.{i}``).

    ``num_gpu_blocks`` kernel blocks of ``gpu_block_size`` tokens, ``num_kv_heads`` x
    ``head_dim`` each, in either layout; ``device`` is ``auto``, ``cpu`` or ``cuda``.
    """

    def __init__(
        self,
        num_layers: int = 8,
        num_gpu_blocks: int = 64,
        gpu_block_size: int = 16,
        num_kv_heads: int = 4,
        head_dim: int = 64,
        dtype: torch.dtype = torch.float16,
        kv_before_num_blocks: bool = True,
        block_size_factor: int = 1,
        device: str = "auto",
    ):
        if num_gpu_blocks % block_size_factor:
            raise ValueError(
                f"num_gpu_blocks ({num_gpu_blocks}) must be a multiple of block_size_factor ({block_size_factor})"
            )
        self.device = resolve_device(device)
        block = (gpu_block_size, num_kv_heads, head_dim)
        shape = (2, num_gpu_blocks, *block) if kv_before_num_blocks else (num_gpu_blocks, 2, *block)
        self.kv_before_num_blocks = kv_before_num_blocks
        self.kv_caches: dict[str, torch.Tensor] = {
            f"layer.{i}": torch.zeros(shape, dtype=dtype, device=self.device) for i in range(num_layers)
        }
        self.layout = KVCacheLayout.from_tensors(
            self.kv_caches, gpu_block_size, block_size_factor, kv_before_num_blocks
        )

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self.kv_caches.values())

    @property
    def num_groups(self) -> int:
        """Offloaded-block-sized groups of kernel blocks the device holds."""
        return self.layout.num_gpu_blocks // self.layout.block_size_factor


@dataclass
class DriverReport:
    """What a run did. Block counts are offloaded blocks.

    ``blocks_requested`` = ``device_hits`` (served by the device prefix cache) +
    ``offload_hits`` (loaded from the tiers and verified; by medium in
    ``hits_by_medium``, from the load spec's medium) + ``computed`` (written by "the
    model", including ``recomputed_after_failed_load`` and mismatched blocks).
    ``blocks_looked_up``: asked of the manager; ``mismatches``: loaded blocks whose
    bytes differed from what was stored (must be 0); ``stores_rejected``:
    ``prepare_store`` returned None; ``events``: manager events as ``"MEDIUM
    stored|removed" -> blocks``.
    """

    requests: int = 0
    blocks_requested: int = 0
    device_hits: int = 0
    blocks_looked_up: int = 0
    offload_hits: int = 0
    hits_by_medium: dict[str, int] = field(default_factory=dict)
    computed: int = 0
    recomputed_after_failed_load: int = 0
    mismatches: int = 0
    stores_rejected: int = 0
    blocks_stored: int = 0
    failed_jobs: int = 0
    # Per direction (e.g. ``"CPU->GPU"``); ``seconds`` is the time at least one job of the
    # direction was in flight, so overlapping jobs are not double-counted.
    transfers: dict[str, TransferCounter] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    wall_seconds: float = 0.0

    @property
    def offload_hit_rate(self) -> float:
        """Share of the blocks asked of the manager that it served."""
        return self.offload_hits / self.blocks_looked_up if self.blocks_looked_up else 0.0

    @property
    def total_hit_rate(self) -> float:
        """Share of all requested blocks not computed (device or offload hits)."""
        served = self.device_hits + self.offload_hits
        return served / self.blocks_requested if self.blocks_requested else 0.0


class _DevicePrefixCache:
    """The engine's GPU prefix cache: block hash -> group of kernel blocks, LRU. Groups
    held by the running request or by an unfinished store are never reused."""

    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        self.cached: OrderedDict[BlockHash, int] = OrderedDict()
        self.free = list(range(num_groups - 1, -1, -1))
        self.busy: dict[int, int] = {}  # group -> holders
        self.orphans: set[int] = set()  # replaced while held: freed on release

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.cached:
            n += 1
        return n

    def hold(self, groups: Iterable[int]) -> None:
        for g in groups:
            self.busy[g] = self.busy.get(g, 0) + 1

    def release(self, groups: Iterable[int]) -> None:
        for g in groups:
            left = self.busy[g] - 1
            if left:
                self.busy[g] = left
            else:
                del self.busy[g]
                if g in self.orphans:
                    self.orphans.remove(g)
                    self.free.append(g)

    def allocate(self, n: int, own: Container[int] = ()) -> list[int] | None:
        """``n`` groups, evicting the least-recent cached blocks other than the running
        request's ``own`` groups; None (changing nothing) if one of those victims is
        held by an unfinished store, or there are too few. The caller then waits for
        the stores and asks again, so which blocks stay cached never depends on how
        fast stores finish (every configuration of a replay sees the same device hits)."""
        need = n - len(self.free)
        victims = []
        if need > 0:
            for block_hash, g in self.cached.items():
                if g in own:
                    continue
                if g in self.busy:
                    return None
                victims.append(block_hash)
                if len(victims) == need:
                    break
            if len(victims) < need:
                return None
        for block_hash in victims:
            self.free.append(self.cached.pop(block_hash))
        return [self.free.pop() for _ in range(n)]

    def insert(self, block_hashes: Sequence[BlockHash], groups: Sequence[int]) -> None:
        """Map each hash to its new group. A hash can already be cached when its prefix
        was evicted before it; its old group is freed (once no longer held)."""
        for block_hash, g in zip(block_hashes, groups):
            old = self.cached.get(block_hash)
            if old is not None:
                if old in self.busy:
                    self.orphans.add(old)
                else:
                    self.free.append(old)
            self.cached[block_hash] = g

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            self.cached.move_to_end(block_hash)


@dataclass
class _Job:
    kind: str  # "load" or "store"
    direction: str
    block_hashes: list[BlockHash]
    groups: list[int]


class JobWorker(Protocol):
    """What the driver needs of a worker: an ``OffloadingWorker``, or one per rank
    behind one (``tiered_kv.testing.ranks.RankWorkers``)."""

    @property
    def handlers(self) -> Collection[OffloadingHandler]: ...

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool: ...

    def get_finished(self) -> list[TransferResult]: ...

    def wait(self, job_ids: set[int]) -> None: ...

    def shutdown(self) -> None: ...


class ServiceClock:
    """Seconds on a modelled engine that prefills ``tokens_per_s`` (the product's prior,
    ``tiered_kv.prefill``) and serves one request after another: a request's uses
    happen at the clock's time, then ``advance`` moves it on by that request's tokens.
    Every configuration of a replay sees the same time, whatever it hit."""

    def __init__(self, tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S):
        if not tokens_per_s > 0:
            raise ValueError(f"tokens_per_s: expected > 0, got {tokens_per_s!r}")
        self.tokens_per_s = tokens_per_s
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, tokens: int) -> None:
        """One request of ``tokens`` tokens served."""
        self.now += tokens / self.tokens_per_s


class EngineDriver:
    """Drives ``manager`` (scheduler side) and ``worker`` (model-runner side, built over
    ``device``'s KV tensors) through request streams and records a ``DriverReport``;
    advances ``clock`` (module docstring) by each request, where given.

    Use ``EngineDriver.from_spec`` to build both from an ``OffloadingSpec``.
    """

    def __init__(
        self, manager: OffloadingManager, worker: JobWorker, device: DeviceKVCache, clock: ServiceClock | None = None
    ):
        self.manager = manager
        self.worker = worker
        self.device = device
        self.clock = clock
        self.layout = device.layout
        self.report = DriverReport()
        self._pool = _DevicePrefixCache(device.num_groups)
        self._jobs: dict[int, _Job] = {}
        self._next_job = 0
        self._in_flight: dict[str, int] = {}
        self._busy_since: dict[str, float] = {}
        self._load_results: dict[int, bool] = {}

    @classmethod
    def from_spec(
        cls, spec: OffloadingSpec, device: DeviceKVCache, clock: ServiceClock | None = None
    ) -> "EngineDriver":
        """Build the worker over ``device``'s tensors (first: a spec may learn the
        layout from them), then the manager; ``clock``: the one the spec's rules read."""
        if spec.block_size_factor != device.layout.block_size_factor:
            raise ValueError(
                f"spec block_size_factor {spec.block_size_factor} != device cache's {device.layout.block_size_factor}"
            )
        worker = spec.build_worker(device.kv_caches, device.kv_before_num_blocks)
        return cls(spec.get_manager(), worker, device, clock)

    # ---- running ----

    def run(self, requests: Workload | Iterable[Sequence[BlockHash]]) -> DriverReport:
        """Run every request, then wait for outstanding stores; returns the report."""
        if isinstance(requests, Workload):
            requests = requests.requests
        start = time.perf_counter()
        for block_hashes in requests:
            self.run_request(block_hashes)
        self.drain()
        self.report.wall_seconds += time.perf_counter() - start
        return self.report

    def run_request(self, block_hashes: Sequence[BlockHash]) -> None:
        """One request: device hits, offload hits loaded and verified, misses computed,
        new blocks offloaded (asynchronously)."""
        block_hashes = list(block_hashes)
        report = self.report
        report.requests += 1
        report.blocks_requested += len(block_hashes)
        pool = self._pool
        n_device = pool.lookup(block_hashes)
        report.device_hits += n_device
        device_groups = [pool.cached[h] for h in block_hashes[:n_device]]
        pool.hold(device_groups)
        rest = block_hashes[n_device:]
        groups = self._allocate_groups(len(rest), set(device_groups))
        pool.hold(groups)
        try:
            report.blocks_looked_up += len(rest)
            n_hit = self.manager.lookup(rest) if rest else 0
            to_compute = list(range(n_hit, len(rest)))
            if n_hit:
                to_compute = self._load(rest[:n_hit], groups[:n_hit]) + to_compute
            self._compute([rest[i] for i in to_compute], [groups[i] for i in to_compute])
            report.computed += len(to_compute)
            pool.insert(rest, groups)
            # Head of the chain most recent: the device evicts tails first, as engines do.
            pool.touch(reversed(block_hashes))
            self._store(block_hashes)
            self.manager.touch(block_hashes)
        finally:
            pool.release(device_groups)
            pool.release(groups)
        self.poll()
        if self.clock is not None:
            self.clock.advance(len(block_hashes) * self.layout.offloaded_block_size)

    def poll(self) -> None:
        """Settle finished jobs (never blocks) and collect manager events."""
        self._settle(self.worker.get_finished())
        for event in self.manager.take_events():
            key = f"{event.medium} {'removed' if event.removed else 'stored'}"
            self.report.events[key] = self.report.events.get(key, 0) + len(event.block_hashes)

    def drain(self) -> None:
        """Wait for every outstanding job and settle it."""
        while self._jobs:
            outstanding = set(self._jobs)
            self.worker.wait(outstanding)
            self.poll()
            if set(self._jobs) == outstanding:
                raise RuntimeError(
                    f"jobs {sorted(outstanding)} were waited for but never reported "
                    f"finished; a handler breaks its contract"
                )

    # ---- steps ----

    def _allocate_groups(self, n: int, own: set[int]) -> list[int]:
        groups = self._pool.allocate(n, own)
        if groups is None:  # device blocks are held by unfinished stores
            self.drain()
            groups = self._pool.allocate(n, own)
        if groups is None:
            raise ValueError(
                f"a request needs {n} device blocks but the device cache has only "
                f"{self._pool.num_groups}; use a larger device cache or shorter requests"
            )
        return groups

    def _kernel_ids(self, groups: Sequence[int]) -> np.ndarray:
        return expand_block_ids(groups, self.layout.block_size_factor)

    def _load(self, block_hashes: list[BlockHash], groups: list[int]) -> list[int]:
        """Load and verify; return the indices (into ``block_hashes``) to recompute."""
        report = self.report
        # A multi-tier manager says which tier serves each block; otherwise the spec's medium does.
        hit_medium = getattr(self.manager, "hit_medium", None)
        media = [hit_medium(h) for h in block_hashes] if hit_medium else None
        src_spec = self.manager.prepare_load(block_hashes)
        media = media or [src_spec.medium()] * len(block_hashes)
        ok = False
        try:
            job_id = self._submit("load", (src_spec, GPULoadStoreSpec(self._kernel_ids(groups))), block_hashes, groups)
            self.worker.wait({job_id})
            self.poll()
            # Not reported after wait: the handler broke its contract; recompute.
            ok = self._load_results.pop(job_id, False)
        finally:
            self.manager.complete_load(block_hashes, success=ok)
        if not ok:
            report.recomputed_after_failed_load += len(block_hashes)
            return list(range(len(block_hashes)))
        bad = self._verify(block_hashes, groups)
        report.mismatches += len(bad)
        report.offload_hits += len(block_hashes) - len(bad)
        bad_set = set(bad)
        for i, medium in enumerate(media):
            if i not in bad_set:
                report.hits_by_medium[medium] = report.hits_by_medium.get(medium, 0) + 1
        return bad

    def _verify(self, block_hashes: list[BlockHash], groups: list[int]) -> list[int]:
        f = self.layout.block_size_factor
        got = torch.empty((len(block_hashes), self.layout.bytes_per_block), dtype=torch.uint8)
        pack_blocks(self.device.tensors, self.layout, self._kernel_ids(groups).reshape(-1, f), got)
        want = block_content(block_hashes, self.layout.bytes_per_block)
        return torch.nonzero((got != want).any(dim=1)).reshape(-1).tolist()

    def _compute(self, block_hashes: list[BlockHash], groups: list[int]) -> None:
        if not block_hashes:
            return
        f = self.layout.block_size_factor
        content = block_content(block_hashes, self.layout.bytes_per_block)
        unpack_blocks(content, self.device.tensors, self.layout, self._kernel_ids(groups).reshape(-1, f))

    def _store(self, block_hashes: list[BlockHash]) -> None:
        out = self.manager.prepare_store(block_hashes)
        if out is None:
            self.report.stores_rejected += 1
            return
        if not out.block_hashes_to_store:
            return
        to_store = list(out.block_hashes_to_store)
        groups = [self._pool.cached[h] for h in to_store]
        self._pool.hold(groups)
        self._submit("store", (GPULoadStoreSpec(self._kernel_ids(groups)), out.store_spec), to_store, groups)

    def _submit(self, kind: str, spec: TransferSpec, block_hashes: list[BlockHash], groups: list[int]) -> int:
        """Submit a job and start its direction's clock. A job the worker refused was
        never submitted (the seed's contract): it is settled as failed here."""
        direction = f"{spec[0].medium()}->{spec[1].medium()}"
        job_id = self._next_job
        self._next_job += 1
        self.report.transfers.setdefault(direction, TransferCounter()).jobs += 1
        if not self._in_flight.get(direction):
            self._busy_since[direction] = time.perf_counter()
        self._in_flight[direction] = self._in_flight.get(direction, 0) + 1
        self._jobs[job_id] = _Job(kind, direction, block_hashes, groups)
        try:
            accepted = self.worker.transfer_async(job_id, spec)
        except Exception:  # wiring bug (no handler for the pair): nothing was submitted
            del self._jobs[job_id]
            self._in_flight[direction] -= 1
            raise
        if not accepted:  # never submitted, so never reported: settle it as failed now
            self._settle([TransferResult(job_id, False)])
        return job_id

    def _settle(self, results: list[TransferResult]) -> None:
        now = time.perf_counter()
        for result in results:
            job_id, success = result.job_id, result.success
            job = self._jobs.pop(job_id, None)
            if job is None:
                continue
            stats = self.report.transfers[job.direction]
            self._in_flight[job.direction] -= 1
            if not self._in_flight[job.direction]:
                stats.seconds += now - self._busy_since[job.direction]
            if success:
                stats.blocks += len(job.block_hashes)
                stats.bytes += len(job.block_hashes) * self.layout.bytes_per_block
            else:
                stats.failed_jobs += 1
                self.report.failed_jobs += 1
            if job.kind == "store":
                self._pool.release(job.groups)
                self.manager.complete_store(job.block_hashes, success=success)
                if success:
                    self.report.blocks_stored += len(job.block_hashes)
            else:
                self._load_results[job_id] = success
