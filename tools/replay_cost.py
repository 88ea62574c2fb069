"""Block-level replay of the load-versus-recompute decision against a lower tier's bandwidth.

Runs in one process; no block bytes move. The managers are the product's own: a
``TieredOffloadingManager`` over our CPU tier and a ``DiskOffloadingManager`` (its index
in a temporary directory, removed afterwards), deciding with ``tiered_kv.cost``. Every
load and store is settled at once, and each tier's load time is modelled (latency plus
bytes over the bandwidth given), fed back to the estimates as a handler's measure would
be. The device prefix cache is an LRU over blocks, head of each request most recent.

Per request, estimated TTFT = load time of the blocks the manager chose, per tier
(``latency + bytes / bandwidth``) + prefill of every other token not in the device
cache (the trailing partial block included) at the model's prefill tokens/s
(``replay_model.py``). Configurations, all on the same trace:

- ``no-offload``: the device prefix cache alone;
- ``cpu``: the CPU tier alone (cost-aware);
- ``<lower>-always``: CPU over the lower tier, every block found loaded (cost-aware off);
- ``<lower>``: the same, cost-aware (the default);
- ``<lower>-reuse2``: cost-aware, ``write_admission: reuse(2)`` for the lower tier;
- ``<lower>-oracle``: cost-aware, the lower tier taking a block only if the trace uses it
  again later (``OracleAdmission``: the bound for any write admission, as Belady's is for
  eviction).

References beside them: the infinite-cache ceiling (every block seen before is a hit)
and Belady's optimum at the capacity of the device cache, CPU and lower tier together
(evicting the block reused furthest in the future), both as block hit rates.
"""

from __future__ import annotations

import heapq
import shutil
import statistics
import tempfile
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiered_kv.cost import LoadCosts, TierCost
from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.format.manifest import slot_size_for
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.admission import WriteAdmission
from tiered_kv.tiered.manager import TieredOffloadingManager

#: The index's block layout: small, since no bytes move; the cost model uses the model's.
LAYOUT = KVCacheLayout((LayerLayout("kv", (1, 64), False),), torch.uint8, 16)


@dataclass(frozen=True)
class LowerModel:
    """The modelled lower tier: its name and medium, bandwidth into the GPU, per-job latency."""

    name: str
    medium: str
    gbps: float
    latency_s: float = 0.0


@dataclass(frozen=True)
class CostSetup:
    """Model and capacities of one replay (capacities in blocks)."""

    tokens_per_block: int
    kv_bytes_per_token: int
    prefill_tps: float
    cpu_gbps: float
    device_blocks: int
    cpu_blocks: int
    lower_blocks: int

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.tokens_per_block

    @property
    def break_even_gbps(self) -> float:
        return self.kv_bytes_per_token * self.prefill_tps / 1e9


@dataclass
class CostRun:
    """What one configuration did: mean TTFT (s), block counts by source, per-tier stats."""

    config: str
    ttft: list[float] = field(default_factory=list)
    blocks: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, dict] = field(default_factory=dict)

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttft)

    def share(self, source: str) -> float:
        return self.blocks.get(source, 0) / max(1, sum(self.blocks.values()))

    @property
    def hit_rate(self) -> float:
        return 1 - self.share("computed")


class OracleAdmission(WriteAdmission):
    """Write admission that knows the future: a lower tier takes a block only while the
    trace has a use of it still to come. ``used`` is told each request's blocks before
    they are stored."""

    def __init__(self, requests: Sequence[Sequence], names: Sequence[str], stats: TieredStats):
        super().__init__([2] * len(names), names, 1, stats)  # every tier asked, no history kept
        self.remaining = Counter(h for r in requests for h in r)

    def note(self, block_hashes: Sequence) -> None:
        """Counts nothing: the trace's remaining uses decide."""

    def used(self, block_hashes: Sequence) -> None:
        self.remaining.subtract(block_hashes)

    def admitted(self, i: int, block_hashes: list) -> list:
        admitted = [h for h in block_hashes if self.remaining[h] > 0]
        self.stats.count(self.names[i], "not_admitted", len(block_hashes) - len(admitted))
        return admitted


class DeviceLRU:
    """The device prefix cache: an LRU set of blocks."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict = OrderedDict()

    def lookup(self, request: Sequence) -> int:
        n = 0
        for h in request:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, request: Sequence) -> None:
        for h in reversed(request):  # head most recent
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def _manager(setup: CostSetup, lower: LowerModel | None, work: Path, cost_aware: bool, admit: int):
    cpu = CPUOffloadingManager(setup.cpu_blocks, setup.tokens_per_block, enable_events=False)
    tiers = []
    if lower is not None:
        fp = Fingerprint.from_layout(LAYOUT, model_id="replay-cost")
        tiers.append(
            DiskOffloadingManager(
                work,
                fp,
                LAYOUT,
                disk_bytes=setup.lower_blocks * slot_size_for(LAYOUT.bytes_per_block),
                enable_events=False,
                poll_interval=None,
                name=lower.name,
                medium=lower.medium,
            )
        )
    costs = LoadCosts(
        [TierCost("cpu", setup.cpu_gbps)]
        + ([TierCost(lower.name, lower.gbps, lower.latency_s)] if lower is not None else []),
        bytes_per_block=setup.bytes_per_block,
        tokens_per_block=setup.tokens_per_block,
        prefill_tokens_per_s=setup.prefill_tps,
        probe_after_s=float("inf"),
    )
    return TieredOffloadingManager(
        cpu, tiers, costs=costs, cost_aware=cost_aware, admit_after=admit, promote_on_hit=True
    )


def run(
    config: str,
    requests: Sequence[Sequence],
    tail_tokens: Sequence[int],
    setup: CostSetup,
    lower: LowerModel | None,
    *,
    offload: bool = True,
    cost_aware: bool = True,
    admit: int = 1,
    oracle: bool = False,
    scratch: Path | None = None,
) -> CostRun:
    """Replay ``requests`` (block ids, prefix-chained) with ``tail_tokens[i]`` more
    tokens each (a trailing partial block); ``offload=False`` is ``no-offload``;
    ``oracle``: the lower tiers admit by ``OracleAdmission`` instead of ``admit``."""
    out = CostRun(config, blocks=dict.fromkeys(["GPU", "CPU", lower.name if lower else "lower", "computed"], 0))
    work = Path(tempfile.mkdtemp(prefix="replay-cost-", dir=scratch))
    device = DeviceLRU(setup.device_blocks)
    manager = _manager(setup, lower, work, cost_aware, admit) if offload else None
    keyed = [[h.to_bytes(8, "big") if isinstance(h, int) else h for h in r] for r in requests]
    oracle_admission = None
    if oracle and manager is not None:
        oracle_admission = OracleAdmission(keyed, manager.admission.names, manager.stats)
        manager.admission = oracle_admission
    load_model = {"CPU": (setup.cpu_gbps, 0.0)}
    if lower is not None:
        load_model[lower.medium] = (lower.gbps, lower.latency_s)
    bpb, per_token = setup.bytes_per_block, 1 / setup.prefill_tps
    try:
        for keys, tail in zip(keyed, tail_tokens):
            n_dev = device.lookup(keys)
            rest = keys[n_dev:]
            k = manager.lookup(rest) if manager is not None and rest else 0
            seconds = (len(rest) - k) * setup.tokens_per_block * per_token + tail * per_token
            if k:
                assert manager is not None  # only the tiers serve past the device
                by_medium: dict[str, int] = {}
                for h in rest[:k]:
                    m = manager.hit_medium(h)
                    by_medium[m] = by_medium.get(m, 0) + 1
                manager.prepare_load(rest[:k])
                manager.complete_load(rest[:k])
                for medium, n in by_medium.items():
                    gbps, lat = load_model[medium]
                    t = lat + n * bpb / (gbps * 1e9)
                    seconds += t
                    name = "cpu" if medium == "CPU" or lower is None else lower.name
                    if manager.costs is not None:
                        manager.costs.observe(f"{name}_to_gpu", n * bpb, t)
                    out.blocks["CPU" if medium == "CPU" else name] += n
            out.blocks["GPU"] += n_dev
            out.blocks["computed"] += len(rest) - k
            out.ttft.append(seconds)
            device.insert(keys)
            if oracle_admission is not None:
                oracle_admission.used(keys)
            if manager is not None:
                stored = manager.prepare_store(keys)
                if stored is not None:
                    manager.complete_store(stored.block_hashes_to_store)
                    for tier, writes in zip(manager.lower, stored.store_spec.tier_write_through):
                        tier.complete_store(writes.block_hashes)
                    for tier, writes in zip(manager.lower, stored.store_spec.tier_spills):
                        tier.complete_store(writes.block_hashes)
                manager.touch(keys)
        if manager is not None:
            out.tiers = manager.stats.as_dict()["tiers"]
    finally:
        if manager is not None:
            manager.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return out


def infinite_hit_rate(requests: Sequence[Sequence]) -> float:
    """Blocks of the leading run seen before, over all blocks."""
    seen: set = set()
    hits = total = 0
    for request in requests:
        run = True
        for h in request:
            run = run and h in seen
            hits += run
            seen.add(h)
        total += len(request)
    return hits / total


def used_once_share(requests: Sequence[Sequence]) -> float:
    """The share of the distinct blocks that occur in one request only."""
    uses = Counter(h for r in requests for h in r)
    return sum(1 for n in uses.values() if n == 1) / max(1, len(uses))


def belady_hit_rate(requests: Sequence[Sequence], capacity: int) -> float:
    """Leading-run block hits of a cache of ``capacity`` blocks that evicts the block
    whose next use is furthest (Belady's MIN), every request's blocks inserted."""
    flat = [h for r in requests for h in r]
    nxt = [0] * len(flat)
    last: dict = {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = last.get(flat[i], len(flat) + i)
        last[flat[i]] = i
    cache: dict = {}  # block -> its next use
    heap: list = []  # (-next use, block), lazily invalidated
    hits = pos = 0
    for request in requests:
        run = True
        for h in request:
            run = run and h in cache
            hits += run
            cache[h] = nxt[pos]
            heapq.heappush(heap, (-nxt[pos], h))
            pos += 1
        while len(cache) > capacity:
            neg, h = heapq.heappop(heap)
            if cache.get(h) == -neg:
                del cache[h]
    return hits / len(flat)
