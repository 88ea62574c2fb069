"""The worker's start-up canary: proves, before the first request, that KV stored through
our handlers and loaded back lands where vLLM's attention reads it. Worker process, once
per rank, inside ``TieredVllmWorker``'s constructor (on by default; ``canary: false`` in
``kv_connector_extra_config`` turns it off).

Our copies move pages as opaque bytes and are checked byte-exact; whether those bytes are
the KV the engine would read rests on how we address vLLM's pages: the canonical tensors
vLLM's connector hands us, the worker's page geometry (``geometry.attention_page_view``,
``geometry.kv_content``: the layout the disk namespace records) and the GPU-block routing
of the handlers (``worker.gpu_rows``, CPU positions). A vLLM that changed any of them
would be served our blocks byte-exact and wrong. The canary:

1. takes ``2 * blocks_per_chunk`` spare GPU blocks, the highest block ids. vLLM's block
   pool hands out free blocks from the front of a queue that starts in id order (block 0
   is its null block), and no request runs before the worker is built (vLLM builds it
   while registering the KV caches, during engine start-up), so these are the last blocks
   a request would get and nothing reads them now. Their bytes are saved and restored.
2. writes a pattern into the first ``blocks_per_chunk`` of them through the worker's page
   geometry: in every layer, K/V, KV head, token and chunk position, each element encodes
   those coordinates (so a value found elsewhere names the axis that moved);
3. stores that chunk through the worker's own store handler (GPU -> CPU tier, one CPU
   slot, exactly the path of every stored block) and loads it back through its own load
   handler into the other ``blocks_per_chunk`` blocks;
4. reads those blocks through the engine's own per-layer KV tensors, the ones vLLM's
   attention layers hold (handed to vLLM's ``register_kv_caches``; found up the call
   stack), splitting K and V as vLLM's FlashAttention backend does
   (``kv_cache.split(head_size, dim=-1)``), and compares every element;
5. for each disk tier, takes the chunk in that CPU slot through the tier's own stager,
   handlers, store and I/O backend, built by the tier's own class over a private
   one-slot store in a scratch directory of the tier's directory, never the scheduler's
   namespace: written from the CPU slot, read straight into the other blocks
   (``GpuDiskHandler``) and, again, into the CPU slot (``CpuDiskHandler``) and on to
   the blocks through the worker's load handler, each followed by step 4
   (``canary_disk``). A disk tier that cannot be exercised there (a read-only or full
   filesystem, an I/O error) is skipped with a warning: I/O problems never stop the
   engine, only values in the wrong place do.

A mismatch raises ``CanaryError`` naming the tier and the path (``cpu tier``, ``disk
tier (written from a CPU slot, read straight into GPU blocks by GpuDiskHandler)``, ...),
the layer and the axis that is wrong ("KV heads and tokens are swapped", "K and V are
swapped", ...): the engine does not start. Success logs what was checked and the time it
took (milliseconds for small models on a CPU; a disk tier adds its namespace's creation,
one write with its ``fdatasync`` and index commits, and two reads).

What it does not cover. The shared tier (``tiered_kv.remote``) is not written: its
bucket is the fleet's, and a start-up write would put there an object no scheduler
asked for, and wait on the network (nor is an out-of-tree tier type taken through; only
``DiskTier`` and its subclasses are). The shared tier's bytes are the CPU slot's bytes:
its stager packs the slot with ``pack_blocks`` into an upload buffer, and its load
handler unpacks a download with ``unpack_blocks`` into a CPU slot or straight into the
GPU tensors, after the object's header and checksum are verified; it orders no page
itself. For the block-major CPU tier, packing or unpacking a slot copies its row as it
lies, so a download into a CPU slot restores the bytes the CPU round trip checked. A
download straight into the GPU goes through the same ``unpack_blocks`` (the same byte
order from a host buffer as from a device one), layout and tensors as
``GpuDiskHandler``'s reads, which step 5 checks only when a disk tier is configured;
beside a shared tier alone, that path is not checked.
Nor does the canary run where the engine's attention tensors are not visible (a worker
built by hand, outside vLLM's connector): it then logs that it was skipped. vLLM 0.33's
attention backends expose no shape or stride query of their own any more (its
``KVCacheLayout`` and ``compute_layout_strides`` replaced them), so the layout comes from
there and the K/V split of a cell from vLLM's ``AttentionSpec`` (K then V).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Protocol

import numpy as np
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.base import CanonicalKVCaches
from vllm.v1.kv_offload.base import GPULoadStoreSpec as VllmGPUSpec

from tiered_kv.config import ConfigError
from tiered_kv.integrations.vllm import geometry
from tiered_kv.integrations.vllm.canary_disk import check_disk_tiers
from tiered_kv.memory.host_memory import HostKVCache
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec, GPURowsSpec, chunk_positions
from tiered_kv.tiered.transfer_specs import TieredStoreSpec
from tiered_kv.tiers import TierSpec
from tiered_kv.worker.worker import OffloadingHandler, TransferSpec

logger = logging.getLogger(__name__)

#: Job ids of the canary's two transfers: negative, never one of vLLM's.
_STORE_JOB, _LOAD_JOB = -101, -102
#: The coordinates each element encodes, in this order along a cell's K (or V) vector.
_FIELDS = ("layer", "kv", "head", "token", "block")
_INT_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Hierarchy(Protocol):
    @property
    def lower_tiers(self) -> Sequence[TierSpec]: ...


class CanaryWorker(Protocol):
    """What the canary uses of ``worker.TieredVllmWorker``."""

    @property
    def rank(self) -> int: ...
    @property
    def factor(self) -> int: ...
    @property
    def host(self) -> HostKVCache: ...
    @property
    def hierarchy(self) -> _Hierarchy: ...
    @property
    def store_handler(self) -> OffloadingHandler: ...
    @property
    def load_handler(self) -> OffloadingHandler: ...


class CanaryError(ConfigError):
    """The start-up canary found KV that does not land where vLLM's attention reads it."""


@dataclass(frozen=True)
class CanaryPlan:
    """What the canary needs from the spec: each offloaded KV group's layer names (vLLM's
    ``OffloadingConfig.groups``), the KV-cache layout vLLM reports (None: not resolved;
    the layout of the engine's tensors is then taken) and the head size (K's share of a
    cell; None: half the cell)."""

    group_layer_names: tuple[tuple[str, ...], ...]
    kv_cache_layout: str | None
    head_size: int | None = None


@dataclass(frozen=True)
class _Layer:
    name: str
    index: int
    tensor: int
    within: int
    num_within: int
    engine: torch.Tensor


def engine_kv_tensors(max_depth: int = 32) -> Mapping[str, torch.Tensor] | None:
    """The engine's per-layer KV tensors, as vLLM's worker connector received them in
    ``register_kv_caches`` (the tensors its attention layers hold), found up the call
    stack; None where the worker is not being built from there."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        if frame.f_code.co_name == "register_kv_caches":
            found = frame.f_locals.get("kv_caches")
            if isinstance(found, dict) and all(isinstance(t, torch.Tensor) for t in found.values()):
                return found
        frame = frame.f_back
    return None


def run_canary(
    worker: CanaryWorker,
    kv_caches: CanonicalKVCaches,
    plan: CanaryPlan,
    engine: Mapping[str, torch.Tensor] | None,
    rows_of: Callable[[VllmGPUSpec, int, int], np.ndarray],
) -> str:
    """Run the canary (module docstring) on ``worker``'s handlers, with its translation of
    vLLM's GPU specs (``rows_of``: ``worker.gpu_rows``); return its outcome (the
    ``tiered_kv_canary_checks`` label): ``passed``, ``partial`` (a disk tier could not be
    exercised) or ``skipped`` (it could not run at all); each logged. Raises
    ``CanaryError`` on a mismatch."""
    started = time.perf_counter()
    if engine is None:
        logger.info(
            "rank %d: start-up canary skipped: the engine's attention KV tensors are not visible "
            "(this worker was not built by vLLM's register_kv_caches)",
            worker.rank,
        )
        return "skipped"
    layers = _layers(kv_caches, plan, engine)
    tensors = [t.tensor for t in kv_caches.tensors]
    num_blocks = tensors[0].shape[0]
    f = worker.factor
    if not layers or num_blocks < 2 * f + 1 or any(layer.engine.shape[0] != num_blocks for layer in layers):
        logger.info(
            "rank %d: start-up canary skipped: %d attention layers over %d GPU blocks (it needs %d "
            "spare blocks and one attention view per block)",
            worker.rank,
            len(layers),
            num_blocks,
            2 * f,
        )
        return "skipped"
    src = np.arange(num_blocks - 2 * f, num_blocks - f, dtype=np.int64)
    dst = np.arange(num_blocks - f, num_blocks, dtype=np.int64)
    spare = torch.as_tensor(np.concatenate([src, dst]), device=tensors[0].device)
    saved = [t[spare].clone() for t in tensors]
    skipped: list[str] = []  # disk tiers the canary could not exercise (logged)
    try:
        for t in tensors:
            t[spare] = 0
        for layer in layers:
            _write_pattern(layer, tensors[layer.tensor], src, plan, _layout(plan, layer))
        if tensors[0].is_cuda:
            torch.cuda.synchronize(tensors[0].device)
        rows = _round_trip(worker, src, dst, rows_of)
        for layer in layers:
            _check(layer, dst, plan, _layout(plan, layer), worker.rank)

        def check(tier: str) -> None:
            for layer in layers:
                _check(layer, dst, plan, _layout(plan, layer), worker.rank, tier)

        lower = check_disk_tiers(worker, worker.hierarchy.lower_tiers, tensors, rows, check, skipped)
    finally:
        for t, s in zip(tensors, saved):
            t[spare] = s
        if tensors[0].is_cuda:
            torch.cuda.synchronize(tensors[0].device)
    seconds = time.perf_counter() - started
    logger.info(
        "rank %d: start-up canary passed: %d layers, GPU -> cpu -> GPU through the worker's handlers%s, "
        "every value where vLLM's attention reads it (%.1f ms)",
        worker.rank,
        len(layers),
        "".join(f"; {line}" for line in lower),
        seconds * 1e3,
    )
    return "partial" if skipped else "passed"


def _layers(kv_caches: CanonicalKVCaches, plan: CanaryPlan, engine: Mapping[str, torch.Tensor]) -> list[_Layer]:
    """The attention layers to check: the first layer name of each canonical tensor's
    slot (aliased layers share bytes), with the engine's tensor for it."""
    out: list[_Layer] = []
    seen: set[tuple[int, int]] = set()
    for names, refs in zip(plan.group_layer_names, kv_caches.group_data_refs):
        packed = len(refs) != len(names)  # vLLM's block-outermost layouts: one tensor, every layer
        for j, name in enumerate(names):
            tensor = refs[0].tensor_idx if packed else refs[j].tensor_idx
            within, num_within = (j, len(names)) if packed else (0, 1)
            t = engine.get(name)
            if (tensor, within) in seen or t is None or t.dim() != 4:
                continue
            seen.add((tensor, within))
            out.append(_Layer(name, len(out), tensor, within, num_within, t))
    return out


def _layout(plan: CanaryPlan, layer: _Layer) -> str:
    """The layout the worker's page geometry assumes: vLLM's, else the one whose strides
    (vLLM's ``compute_layout_strides``) the engine's tensor has."""
    if plan.kv_cache_layout is not None:
        return plan.kv_cache_layout
    t = layer.engine
    _, heads, tokens, content = t.shape
    spec = FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=content, head_size_v=0, dtype=t.dtype)
    itemsize = t.element_size()
    # vLLM's strides are in bytes with C counted in bytes; the tensor's in elements.
    actual = (t.stride(1) * itemsize, t.stride(2) * itemsize, t.stride(3))
    for layout in KVCacheLayout:
        strides = compute_layout_strides(spec, t.shape[0], layer.num_within, layout)
        if strides[2:] == actual:
            return layout.name
    raise CanaryError(
        f"start-up canary: the engine's KV tensor of layer {layer.name} has shape {tuple(t.shape)} and "
        f"strides {t.stride()}, which match no vLLM KV-cache layout ({', '.join(x.name for x in KVCacheLayout)}); "
        f"expected one of them"
    )


def _codes(shape: tuple[int, ...], kv: int, layer: int, blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """The pattern of one of K (``kv`` 0) or V (1) of a layer over ``blocks`` chunk
    positions: ``shape`` is ``(blocks, H, N, D)``; element ``d`` of a cell encodes field
    ``d % 5`` of (layer, kv, head, token, block), plus 1 so no code is 0 (an unfilled
    block reads as zeros), plus a multiple of 64 per repeat so every element differs."""
    b, h, n, d = torch.meshgrid(*(torch.arange(s) for s in shape), indexing="ij")
    fields = torch.stack([torch.full_like(b, layer), torch.full_like(b, kv), h, n, b])
    value = fields.gather(0, (d % len(_FIELDS)).unsqueeze(0)).squeeze(0) + 1
    bits = 8 * torch.empty(0, dtype=dtype).element_size() - 1
    return ((value + 64 * (d // len(_FIELDS))) % (1 << min(bits, 15))).to(dtype)


def _write_pattern(layer: _Layer, pages: torch.Tensor, src: np.ndarray, plan: CanaryPlan, layout: str) -> None:
    t = layer.engine
    _, heads, tokens, content = t.shape
    view = geometry.attention_page_view(
        pages, layer.within, layer.num_within, (heads, tokens, content), t.dtype, layout
    )
    ints = view.view(_INT_DTYPES[t.element_size()])
    idx = torch.as_tensor(src, device=pages.device)
    for kv, part in enumerate(geometry.kv_content(content, plan.head_size or content // 2)):
        sub = ints[..., part]
        sub[idx] = _codes(tuple(sub[idx].shape), kv, layer.index, len(src), ints.dtype).to(pages.device)


def _round_trip(
    worker: CanaryWorker, src: np.ndarray, dst: np.ndarray, rows_of: Callable[[VllmGPUSpec, int, int], np.ndarray]
) -> np.ndarray:
    """One chunk GPU -> CPU slot 0 -> GPU through the worker's own handlers and its
    translation of vLLM's GPU specs (``rows_of``), as every stored and loaded chunk;
    returns the loads' GPU rows (``dst`` as ``rows_of`` gives it)."""
    f = worker.factor
    rows = rows_of(VllmGPUSpec(src.tolist(), [f], [0]), f, 1)
    store = (GPULoadStoreSpec(rows[rows >= 0]), TieredStoreSpec(chunk_positions(np.array([0]), f)[rows >= 0]))
    _run(worker.store_handler, _STORE_JOB, store, "store (GPU -> cpu)", worker.rank)
    rows = rows_of(VllmGPUSpec(dst.tolist(), [f], [0]), f, 1)
    _run(worker.load_handler, _LOAD_JOB, (CPULoadStoreSpec([0]), GPURowsSpec(rows)), "load (cpu -> GPU)", worker.rank)
    return rows


def _run(handler: OffloadingHandler, job_id: int, spec: TransferSpec, what: str, rank: int) -> None:
    if not handler.transfer_async(job_id, spec):
        raise CanaryError(f"start-up canary: rank {rank}: the cpu tier's {what} handler refused the canary's job")
    handler.wait({job_id})
    deadline = time.monotonic() + 60
    while True:
        done = [r for r in handler.get_finished() if r.job_id == job_id]
        if done:
            break
        if time.monotonic() > deadline:
            raise CanaryError(f"start-up canary: rank {rank}: the cpu tier's {what} did not finish in 60 s")
        time.sleep(0.001)
    if not done[0].success:
        raise CanaryError(f"start-up canary: rank {rank}: the cpu tier's {what} of the canary's chunk failed")


def _check(layer: _Layer, dst: np.ndarray, plan: CanaryPlan, layout: str, rank: int, tier: str = "cpu tier") -> None:
    """Read the loaded blocks through the engine's own tensor and compare every element;
    raise ``CanaryError`` naming ``tier`` (the path the blocks came) and the axis that moved."""
    t = layer.engine
    ints = t.view(_INT_DTYPES[t.element_size()])
    got = ints[torch.as_tensor(dst, device=t.device)].cpu()
    head_size = plan.head_size or t.shape[3] // 2
    # vLLM's FlashAttention backend: ``key_cache, value_cache = kv_cache.split(head_size, dim=-1)``.
    parts = got.split(head_size, dim=-1)
    for kv, part in enumerate(parts):
        expected = _codes(tuple(part.shape), kv, layer.index, len(dst), part.dtype)
        if torch.equal(part, expected):
            continue
        wrong = (part != expected).any(-1)
        b, h, n = wrong.nonzero()[0].tolist()
        cell, want = part[b, h, n], expected[b, h, n]
        found = {f: int(cell[i]) - 1 for i, f in enumerate(_FIELDS) if i < len(cell)}
        wanted = {f: int(want[i]) - 1 for i, f in enumerate(_FIELDS) if i < len(want)}
        # Every wrong cell's coordinates, so the axis is named from the whole block.
        k = min(len(_FIELDS), part.shape[-1])
        differs = (part[wrong][:, :k] != expected[wrong][:, :k]).any(0).tolist()
        moved = [f for f, d in zip(_FIELDS, differs) if d]
        nothing = not part[wrong].any()
        why = (
            "this vLLM's KV pages are not laid out as TieredOffloadingSpec addresses them"
            if tier == "cpu tier"  # a lower tier is checked only after the CPU tier passed
            else "the CPU tier's round trip put every value in place, so this tier's own handlers move pages"
        )
        raise CanaryError(
            f"start-up canary: the {tier} returns KV that vLLM's attention does not read where it "
            f"was written: layer {layer.name} (rank {rank}): {_axis(moved, nothing)}. At "
            f"{'KV'[kv]}[block {dst[b]}, KV head {h}, token {n}] expected "
            f"{_describe(wanted)}, found {_describe(found)} (page layout the worker assumes: {layout}; "
            f"the engine's tensor: shape {tuple(t.shape)}, strides {t.stride()}). The engine is not "
            f"started: {why}"
        )


def _axis(moved: Sequence[str], nothing: bool) -> str:
    """Name the axis that moved: ``moved`` are the coordinates that differ between the
    values found and those expected, over every wrong cell of a block."""
    if nothing:
        return "nothing arrived (the loaded blocks read as zeros)"
    if set(moved) == {"head", "token"}:
        return "KV heads and tokens are swapped"
    if list(moved) == ["kv"]:
        return "K and V are swapped"
    names = {"layer": "layers", "kv": "K and V", "head": "KV heads", "token": "tokens", "block": "GPU blocks"}
    return " and ".join(names[f] for f in moved) + " are out of place" if moved else "values differ"


def _describe(fields: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in fields.items())


__all__: Sequence[str] = ("CanaryError", "CanaryPlan", "engine_kv_tensors", "run_canary")
