"""One replay configuration, built and run end to end through the engine driver.

Runs in one process (scheduler and worker roles, as ``tiered-kv demo`` does). The
configurations compared by ``tools/replay.py``, all under the same trace, the same
device KV cache and, where they have one, the same CPU RAM:

- ``no-offload``: the device prefix cache alone (a manager that holds nothing);
- ``cpu``: our composite manager over the CPU tier alone;
- ``cpu+disk``: the CPU tier over the disk tier (write-through, promote on hit);
  block I/O to files under the run's disk directory; its lookup loads a hit only where
  that beats recomputing, judged with the replay's prefill-cost model (``Tiers.model``:
  its load bandwidths, prefill rate and bytes per token, fixed, so the decision and the
  estimated TTFT agree);
- ``cpu+disk-always``: the same, loading every hit (the decision off);
- ``vllm-cpu``: vLLM 0.33's own CPU LRU manager (``replay_vllm``), bytes moved by our
  CPU handlers;
- ``cpu-arc`` and ``vllm-cpu-arc``: ``cpu`` and ``vllm-cpu`` with ARC for eviction
  policy (``eviction_policy: arc``; vLLM's ``cache_policy: arc``).

The manager and the worker are wrapped in timing proxies, so each engine step (one
request) splits into scheduler-side time (manager calls), worker time (submitting,
polling and waiting for transfers) and the rest (the driver's stand-in for the model:
generating and verifying block bytes).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import torch

from tiered_kv.abstract import BlockHash, OffloadingManager, PrepareStoreOutput
from tiered_kv.sim.driver import DeviceKVCache, DriverReport, EngineDriver, ServiceClock
from tiered_kv.mediums import CPULoadStoreSpec
from tiered_kv.metrics import TRANSFER_TYPES, TieredStats
from tiered_kv.tiered.spec import HierarchySpec
from tiered_kv.worker.worker import OffloadingWorker
from tiered_kv.sim.workloads import Workload

CONFIGS = ("no-offload", "cpu", "cpu+disk", "vllm-cpu", "cpu-arc", "vllm-cpu-arc")
MANAGER_CALLS = (
    "lookup",
    "hit_medium",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "touch",
    "take_events",
)
WORKER_CALLS = ("transfer_async", "get_finished", "wait")


@dataclass(frozen=True)
class Geometry:
    """The replay's KV cache: ``num_layers`` layers of ``num_kv_heads`` x ``head_dim``
    fp16, GPU blocks of ``gpu_block_size`` tokens, ``block_size_factor`` of them per
    offloaded block, ``device_groups`` offloaded-block-sized groups on the device."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    gpu_block_size: int
    block_size_factor: int
    device_groups: int
    kv_first: bool = True
    dtype: torch.dtype = torch.float16

    @property
    def tokens_per_block(self) -> int:
        return self.gpu_block_size * self.block_size_factor

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.tokens_per_block

    def device_cache(self, device: str) -> DeviceKVCache:
        return DeviceKVCache(
            num_layers=self.num_layers,
            num_gpu_blocks=self.device_groups * self.block_size_factor,
            gpu_block_size=self.gpu_block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            kv_before_num_blocks=self.kv_first,
            block_size_factor=self.block_size_factor,
            device=device,
        )

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} head dim, "
            f"{str(self.dtype).removeprefix('torch.')}, {'kv-first' if self.kv_first else 'kv-after'}, "
            f"{self.tokens_per_block}-token blocks of {self.bytes_per_block / 2**20:.3g} MiB "
            f"({self.block_size_factor} GPU block(s) of {self.gpu_block_size} tokens)"
        )


@dataclass(frozen=True)
class Tiers:
    """Capacities in offloaded blocks; ``disk_dir`` is where ``cpu+disk`` puts its
    namespace (a fresh temporary directory under it per run)."""

    cpu_slots: int
    disk_slots: int
    disk_dir: Path
    io_threads: int = 4
    #: The prefill-cost model (``replay_model.PrefillModel``) the decision judges by.
    model: Any = None


class _TimedCalls:
    """Forwards attribute access to ``inner``; the names in ``timed`` are wrapped so each
    call's wall time (including consuming a returned generator) is recorded per name
    (``calls``) and added to the current step. Names ``inner`` lacks stay missing (AttributeError),
    so ``getattr(proxy, name, None)`` probes behave as on ``inner``."""

    def __init__(self, inner, timed: Iterable[str]):
        self._inner = inner
        self._timed = frozenset(timed)
        self.calls: dict[str, list[float]] = {}  # name -> seconds of each call
        self.step_seconds = 0.0

    def __getattr__(self, name: str):
        target = getattr(self._inner, name)
        if name not in self._timed:
            return target
        samples = self.calls.setdefault(name, [])

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = target(*args, **kwargs)
                if name == "take_events":
                    out = list(out)
                return out
            finally:
                dt = time.perf_counter() - t0
                samples.append(dt)
                self.step_seconds += dt

        self.__dict__[name] = timed  # later lookups skip __getattr__
        return timed

    def take_step(self) -> float:
        """Seconds spent in timed calls since the last ``take_step``."""
        s, self.step_seconds = self.step_seconds, 0.0
        return s


class NullManager(OffloadingManager):
    """Offloads nothing: every lookup misses and every store is declined as done."""

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        return 0

    def prepare_load(self, block_hashes: Iterable[BlockHash]):
        raise KeyError("NullManager holds no block")

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput:
        return PrepareStoreOutput([], CPULoadStoreSpec([]), [])


@dataclass
class Step:
    """One engine step (one request): seconds by role and blocks by where they came from."""

    seconds: float
    manager_seconds: float
    worker_seconds: float
    blocks: int
    device: int
    cpu: int
    disk: int
    computed: int


@dataclass
class RunResult:
    """What one configuration did on one trace."""

    config: str
    report: DriverReport
    steps: list[Step]
    manager_calls: dict[str, list[float]]  # call name -> seconds of each call
    worker_calls: dict[str, list[float]]
    transfers: dict[str, dict] = field(default_factory=dict)  # TieredStats.as_dict()["transfers"]
    tiers: dict[str, dict] = field(default_factory=dict)  # TieredStats.as_dict()["tiers"]
    cpu_slots: int = 0
    disk_slots: int = 0
    io: str = ""

    @property
    def manager_seconds(self) -> float:
        return sum(map(sum, self.manager_calls.values()))

    def blocks_from(self, source: str) -> int:
        """Blocks served per source: ``GPU`` (device prefix cache), ``CPU``, ``DISK``, or
        ``computed``; they add up to the blocks requested."""
        r = self.report
        if source == "GPU":
            return r.device_hits
        if source == "computed":
            return r.computed
        return r.hits_by_medium.get(source, 0)


def _build(
    config: str, geometry: Geometry, tiers: Tiers, device: str, work_dir: Path, promote_on_hit: bool
) -> tuple[EngineDriver, HierarchySpec | None, Callable[[], None]]:
    """The driver for ``config`` and its spec (None for ``no-offload``), plus a closer."""
    dev = geometry.device_cache(device)
    if config == "no-offload":
        driver = EngineDriver(NullManager(), OffloadingWorker(), dev)
        return driver, None, lambda: None
    bpb = geometry.bytes_per_block
    raw = {
        "cpu_bytes": f"{tiers.cpu_slots * bpb}B",
        "block_size": geometry.tokens_per_block,
        "model_id": "tiered-kv-replay",
        "cover_weights": False,  # synthetic KV
        "write_policy": "write_through",
        "promote_on_hit": promote_on_hit,
        "io_threads": tiers.io_threads,
    }
    if config == "cpu-arc":
        raw["eviction_policy"] = "arc"
    if config.startswith("cpu+disk"):
        raw["disk_path"] = str(work_dir)
        raw["disk_bytes"] = f"{tiers.disk_slots * (-(-bpb // 4096) * 4096)}B"
    # Session retention times gaps on the modelled engine's clock, the same in every
    # configuration: hit rates that do not depend on this machine's speed.
    clock = ServiceClock() if tiers.model is None else ServiceClock(tiers.model.prefill_tps)
    spec = HierarchySpec(raw, gpu_block_size=geometry.gpu_block_size, clock=clock)
    worker = spec.build_worker(dev.kv_caches, dev.kv_before_num_blocks)
    manager: OffloadingManager
    if config in ("vllm-cpu", "vllm-cpu-arc"):
        from replay_vllm import VllmCpuManagerAdapter

        manager = VllmCpuManagerAdapter(
            spec.num_cpu_slots, geometry.tokens_per_block, policy="arc" if config.endswith("-arc") else "lru"
        )
    elif config in ("cpu", "cpu+disk", "cpu+disk-always", "cpu-arc"):
        manager = spec.get_manager()
        if manager.costs is not None and tiers.model is not None:
            m, costs = tiers.model, manager.costs
            # The modelled tier speeds decide here, not this machine's measured copies.
            spec.stats.observers.remove(costs.observe)
            costs.bytes_per_block = m.kv_bytes_per_token * geometry.tokens_per_block
            costs.prefill_tokens_per_s = m.prefill_tps
            for name, tier in costs.tiers.items():
                tier.gbps = m.load_gbps["CPU" if name == "cpu" else "DISK"]
            costs.enabled = config != "cpu+disk-always"
    else:
        raise ValueError(f"unknown configuration {config!r}; expected one of {', '.join(CONFIGS)}")

    def close() -> None:
        manager.shutdown()
        if spec.store is not None:
            spec.store.close()

    return EngineDriver(manager, worker, dev, clock), spec, close


def run_config(
    config: str, workload: Workload, geometry: Geometry, tiers: Tiers, device: str = "cpu", promote_on_hit: bool = True
) -> RunResult:
    """Replay ``workload`` through ``config``; every loaded block is verified by the driver.
    ``promote_on_hit=False`` sends ``cpu+disk``'s disk hits straight to the device."""
    tiers.disk_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="replay-", dir=tiers.disk_dir))
    try:
        driver, spec, close = _build(config, geometry, tiers, device, work_dir, promote_on_hit)
        # Timing proxies with the manager's and the worker's methods.
        manager: Any = _TimedCalls(driver.manager, MANAGER_CALLS)
        worker: Any = _TimedCalls(driver.worker, WORKER_CALLS)
        driver.manager, driver.worker = manager, worker
        report = driver.report
        steps = []
        try:
            start = time.perf_counter()
            for block_hashes in workload.requests:
                before = (report.device_hits, dict(report.hits_by_medium), report.computed)
                t0 = time.perf_counter()
                driver.run_request(block_hashes)
                dt = time.perf_counter() - t0
                hits = report.hits_by_medium
                steps.append(
                    Step(
                        dt,
                        manager.take_step(),
                        worker.take_step(),
                        len(block_hashes),
                        report.device_hits - before[0],
                        hits.get("CPU", 0) - before[1].get("CPU", 0),
                        hits.get("DISK", 0) - before[1].get("DISK", 0),
                        report.computed - before[2],
                    )
                )
            driver.drain()
            report.wall_seconds = time.perf_counter() - start
        finally:
            worker.shutdown()  # finishes the disk writes still queued, so their bytes count
            io = spec.store.backend.describe() if spec is not None and spec.store is not None else ""
            close()
        stats = spec.stats.as_dict() if spec is not None else TieredStats().as_dict()
        return RunResult(
            config,
            report,
            steps,
            manager.calls,
            worker.calls,
            transfers={k: stats["transfers"][k] for k in TRANSFER_TYPES},
            tiers=stats["tiers"],
            cpu_slots=spec.num_cpu_slots if spec is not None else 0,
            disk_slots=tiers.disk_slots if config.startswith("cpu+disk") else 0,
            io=io,
        )
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
