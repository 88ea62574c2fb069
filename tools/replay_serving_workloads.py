"""Request streams with arrival times for ``tools/replay_serving.py``, and the time scale
that sets the GPU's load. Pure computation, plus reading one Mooncake trace file.

A stream is, per request, its arrival (seconds, before scaling), its prompt tokens and
the hashes of its full 512-token chunks (prefix-chained: equal hash, equal prefix).

- Mooncake FAST'25 traces (``read_mooncake``): the trace's timestamps and ``hash_ids``;
  a trailing partial block is always computed.
- Generated (``chat``, ``rag``, ``mixed``: ``replay_workloads.generate`` at 512-token
  blocks, its ``FULL`` preset; ``long-context``: ``long_context``), arriving as a
  Poisson process (exponential gaps, mean 1 s before scaling), seeded.

Time scaling (``time_scale``): the gaps between arrivals are multiplied by one factor so
that the GPU work of the ``recompute`` configuration over the scaled span is the target
utilisation. That work is estimated in one pass in arrival order (``estimate_work``):
per request, the leading chunks found in an LRU device cache and then in an LRU CPU tier
of the replay's sizes are not computed; the rest costs the model's prefill FLOPs
(attention included) plus one step overhead per token budget's worth. Requests
overlapping in time share steps, so the replay's measured busy share comes out near the
target rather than on it; the table reports the measured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from replay_serving_model import DeviceCache, GpuModel
from replay_serving_sim import Arrival
from replay_workloads import FULL, generate, read_mooncake
from vllm.v1.kv_offload.base import OffloadKey, make_offload_key

TOKENS_PER_BLOCK = 512
GENERATED = ("chat", "rag", "mixed", "long-context")


@dataclass(frozen=True)
class Stream:
    """``times[i]`` (s, unscaled), ``tokens[i]`` and ``blocks[i]`` (full chunks' hashes)."""

    name: str
    times: list[float]
    tokens: list[int]
    blocks: list[list[bytes]]

    def __post_init__(self) -> None:
        if not self.times or not len(self.times) == len(self.tokens) == len(self.blocks):
            raise ValueError(f"{self.name}: expected the same positive number of times, token counts and block lists")
        for i, (t, b) in enumerate(zip(self.tokens, self.blocks)):
            if t < 1 or len(b) > t // TOKENS_PER_BLOCK:
                raise ValueError(f"{self.name}: request {i} has {t} tokens and {len(b)} full blocks")

    @property
    def working_set(self) -> int:
        """Distinct full chunks."""
        return len({h for b in self.blocks for h in b})

    def head(self, limit: int | None) -> "Stream":
        """The first ``limit`` requests (all when None)."""
        if limit is None or limit >= len(self.times):
            return self
        if limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        return Stream(self.name, self.times[:limit], self.tokens[:limit], self.blocks[:limit])


def mooncake(path: Path) -> Stream:
    """A Mooncake FAST'25 trace in timestamp order (ms -> s)."""
    t = read_mooncake(path)
    order = sorted(range(len(t.requests)), key=lambda i: t.timestamps[i])
    return Stream(
        Path(path).stem.replace("mooncake_fast25_", "mooncake "),
        [t.timestamps[i] / 1e3 for i in order],
        [len(t.requests[i]) * t.tokens_per_block + t.tail_tokens[i] for i in order],
        [[h.to_bytes(8, "big") for h in t.requests[i]] for i in order],
    )


def poisson_times(n: int, seed: int) -> list[float]:
    """``n`` arrivals of a unit-rate Poisson process, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0, n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def long_context(requests: int, documents: int, seed: int) -> list[tuple[int, list[bytes]]]:
    """Prompts of 64k-128k tokens: one of ``documents`` documents (120-240 chunks each,
    Zipf(1.1)-popular) and a fresh question of 512-4,096 tokens; as (tokens, full chunks)."""
    if requests < 1 or documents < 1:
        raise ValueError(f"long-context: requests and documents must be >= 1, got {requests}, {documents}")
    rng = np.random.default_rng(seed)
    ids = iter(range(1, 1 << 62))
    docs = [[next(ids) for _ in range(int(rng.integers(120, 240, endpoint=True)))] for _ in range(documents)]
    weights = 1.0 / np.arange(1, documents + 1) ** 1.1
    weights /= weights.sum()
    out = []
    for d in rng.choice(documents, size=requests, p=weights).tolist():
        question = int(rng.integers(512, 4096, endpoint=True))
        tokens = len(docs[d]) * TOKENS_PER_BLOCK + question
        blocks = docs[d] + [next(ids) for _ in range(question // TOKENS_PER_BLOCK)]
        out.append((tokens, [h.to_bytes(8, "big") for h in blocks]))
    return out


def generated(kind: str, seed: int, requests: int | None = None) -> Stream:
    """A generated workload (module docstring) with Poisson arrivals; ``requests``
    sets the long-context count (default 300) and scales the others (default 1,000)."""
    if kind not in GENERATED:
        raise ValueError(f"--workload {kind!r}: expected one of {', '.join(GENERATED)}")
    if kind == "long-context":
        rows = long_context(requests or 300, 80, seed)
    else:
        w = generate(kind, FULL, TOKENS_PER_BLOCK, (requests or 1000) / 1000, seed)
        rows = [(len(r) * TOKENS_PER_BLOCK, list(r)) for r in w.requests]
    return Stream(kind, poisson_times(len(rows), seed + 7), [t for t, _ in rows], [b for _, b in rows])


def estimate_work(stream: Stream, gpu: GpuModel, device_blocks: int, cpu_blocks: int, token_budget: int) -> float:
    """GPU seconds the ``recompute`` configuration spends on ``stream`` (module docstring)."""
    device, cpu = DeviceCache(device_blocks), DeviceCache(cpu_blocks)
    work = 0.0
    for tokens, blocks in zip(stream.tokens, stream.blocks):
        limit = min(len(blocks), (tokens - 1) // TOKENS_PER_BLOCK)
        d = device.lookup(blocks, limit)
        cached = (d + cpu.lookup(blocks, limit, d)) * TOKENS_PER_BLOCK
        n = tokens - cached
        work += gpu.seconds(gpu.flops(n, cached)) + math.ceil(n / token_budget) * gpu.step_overhead_s
        device.insert(blocks)
        cpu.insert(blocks)
    return work


def time_scale(stream: Stream, work_s: float, utilisation: float) -> float:
    """The factor on the gaps that makes ``work_s`` fill ``utilisation`` of the span."""
    if not 0 < utilisation <= 2:
        raise ValueError(f"--utilisation must be in (0, 2], got {utilisation}")
    span = stream.times[-1] - stream.times[0]
    if span <= 0:
        return 1.0  # one request, or all at once: nothing to scale
    return work_s / utilisation / span


def arrivals(stream: Stream, factor: float) -> list[Arrival]:
    """The stream's requests at scaled times, their chunks as vLLM's offload keys
    (one KV-cache group), one key object per distinct chunk."""
    keys: dict[bytes, OffloadKey] = {}
    t0 = stream.times[0]
    out = []
    for t, tokens, blocks in zip(stream.times, stream.tokens, stream.blocks):
        chunk_keys = []
        for h in blocks:
            key = keys.get(h)
            if key is None:
                key = keys[h] = make_offload_key(h, 0)
            chunk_keys.append(key)
        out.append(Arrival((t - t0) * factor, tokens, chunk_keys))
    return out
