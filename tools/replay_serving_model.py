"""The machine the serving replay simulates (``replay_serving_sim``): one GPU's prefill
cost, from the model's FLOPs with attention at a stated MFU, the engine's limits, and
its GPU prefix cache. Pure computation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuModel:
    """Prefill cost of one GPU (default: Llama-3.1-8B bf16 on one H100 SXM, 989 TFLOPS
    dense BF16, an ASSUMED 50% MFU: 30,800 tokens/s before attention)."""

    params: float = 8.03e9
    layers: int = 32
    hidden: int = 4096
    kv_bytes_per_token: int = 131_072
    mfu: float = 0.5
    peak_tflops: float = 989.0
    step_overhead_s: float = 0.002

    def __post_init__(self) -> None:
        if min(self.params, self.layers, self.hidden, self.kv_bytes_per_token, self.mfu, self.peak_tflops) <= 0:
            raise ValueError(f"every model figure must be > 0, got {self}")
        if self.step_overhead_s < 0:
            raise ValueError(f"step overhead must be >= 0 s, got {self.step_overhead_s}")

    def flops(self, tokens: int, context: int) -> float:
        """FLOPs of prefilling ``tokens`` tokens after ``context`` tokens: every token attends
        to itself and all before it."""
        return 2 * self.params * tokens + 4 * self.layers * self.hidden * (tokens * context + tokens * (tokens + 1) / 2)

    def seconds(self, flops: float) -> float:
        return flops / (self.mfu * self.peak_tflops * 1e12)

    @property
    def linear_tokens_per_s(self) -> float:
        """Prefill tokens/s with attention ignored (``tiered_kv.cost``'s estimate)."""
        return self.mfu * self.peak_tflops * 1e12 / (2 * self.params)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's limits and the CPU link: tokens per step, running requests, GPU KV
    cache (and prefix cache) in chunks, CPU <-> GPU GB/s each way, tokens per chunk."""

    device_blocks: int
    token_budget: int = 8192
    max_seqs: int = 256
    cpu_gbps: float = 50.0
    tokens_per_block: int = 512

    def __post_init__(self) -> None:
        if (
            min(self.device_blocks, self.token_budget, self.max_seqs, self.tokens_per_block) < 1
            or not self.cpu_gbps > 0
        ):
            raise ValueError(f"engine limits must be positive, got {self}")


class DeviceCache:
    """The GPU prefix cache: an LRU set of chunks (``estimate_work`` models the CPU tier
    with one too)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: OrderedDict[Hashable, None] = OrderedDict()

    def lookup(self, keys: Sequence[Hashable], limit: int, start: int = 0) -> int:
        """How many of ``keys[start:limit]`` it holds, in a row from ``start``."""
        n, limit = start, min(limit, len(keys))
        while n < limit and keys[n] in self.keys:
            n += 1
        return n - start

    def insert(self, keys: Sequence[Hashable]) -> None:
        """``keys`` most recent, the first of them most recent of all."""
        for key in reversed(keys):
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)
