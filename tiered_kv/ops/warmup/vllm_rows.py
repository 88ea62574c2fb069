"""The ``vllm`` block layout for vLLM's own ``TieringOffloadingSpec`` with our
``TieredDiskTier`` in ``secondary_tiers``: warm-up blocks as that tier stores them,
whole CPU-tier rows, in the namespace it opens for the same model and settings.

Runs in the operator's process (``tiered-kv warmup``). Imports vLLM (config classes and
its tiering spec, whose constructor only does arithmetic: no shared memory, no engine,
no GPU) and reads the model directory's ``config.json`` and a bounded sample of its
weights (the digest); writes nothing.

What the server does, and how it is reproduced here:

- vLLM's scheduler holds the CPU tier as one row per chunk, and the tier below it
  stores a chunk as that whole row: one disk block of ``stride`` bytes, one writer (the
  scheduler) for every TP rank, so the namespace is written as TP size 1. The row's
  geometry is vLLM's own: ``build_offloading_config`` on the ``VllmConfig`` a server
  would have (``vllm_pages.server_vllm_config``, KV-cache config
  ``vllm_pages.decoder_kv_cache_config``), then vLLM's ``TieringOffloadingSpec`` built
  from it gives the row stride (every worker's bytes rounded up to its alignment), the
  bytes per worker and whether the layout is replicated.
- a row: worker ``r``'s cell at byte ``r * cpu_page_size_per_worker`` (vLLM's
  ``SharedOffloadRegion``: one cell per worker, ranks in order), holding per canonical
  tensor (one per layer) the chunk's pages back to back, exactly the bytes
  ``TieredOffloadingSpec``'s rank ``r`` would store (``vllm_pages.pack_rank_chunks``);
  the padding after the last cell is zeros.
- the namespace: ``secondary_config.tier_fingerprint``, the function the tier computes
  it with, on the same ``OffloadingConfig``, stride and entry, naming the server's
  attention backend (``vllm_pages.server_page_order``: ``--attention-backend``, else
  vLLM's choice on this host, else ``FLASH_ATTN``); keys: vLLM's ``OffloadKey`` of a
  chunk (last GPU block's prefix hash, KV group 0).

Refused, with the reason: everything ``vllm_pages`` refuses (unknown architectures,
sliding windows, quantized weights, block-outermost layouts, pages of an attention
backend outside ``vllm_pages.PAGE_READERS``), ``canonical_layout``
(rows of vLLM's canonical pages), a replicated layout (one copy for every rank: MLA),
and any row whose cells do not add up to what the warm-up writes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.config_file import DISK_TIER_TYPE, TIERING_SPEC, disk_tier_entries
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.integrations.vllm.common import configured_attention_backend
from tiered_kv.integrations.vllm.secondary_config import (
    check_tier_hash_algorithm,
    chunk_layout,
    tier_fingerprint,
)
from tiered_kv.vllm_extra import parse_tier_config
from tiered_kv.kv_layout import KVCacheLayout
from tiered_kv.ops.hashing import chunk_keys
from tiered_kv.ops.warmup.errors import WarmupError
from tiered_kv.ops.warmup.layouts import BlockLayout, LayoutRequest, VllmServe
from tiered_kv.ops.warmup.vllm_pages import (
    decoder_kv_cache_config,
    one_line,
    pack_rank_chunks,
    rank_pages,
    recorded_page_order,
    server_vllm_config,
)

SPEC = f"vLLM's {TIERING_SPEC} with {DISK_TIER_TYPE}"


def disk_tier_entry(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """The one ``TieredDiskTier`` entry of ``secondary_tiers`` (``WarmupError`` unless
    there is exactly one)."""
    entries = disk_tier_entries(extra_config)
    if len(entries) != 1:
        raise WarmupError(
            f"secondary_tiers: {TIERING_SPEC} with {len(entries)} {DISK_TIER_TYPE} entries; "
            "the warm-up writes the namespace of exactly one"
        )
    return dict(entries[0])


@dataclass(frozen=True)
class TieringRows:
    """What a server with vLLM's ``TieringOffloadingSpec`` and ``TieredDiskTier`` builds
    at start-up, as far as the tier's namespace goes: its ``VllmConfig``, vLLM's
    ``OffloadingConfig`` (rank 0, as the scheduler has it) and spec (which sized the
    CPU tier's rows), the entry as the tier parsed it, and the namespace it opens."""

    vllm_config: VllmConfig
    offloading: OffloadingConfig
    spec: TieringOffloadingSpec
    tier_config: TieredConfig
    fingerprint: Fingerprint

    @property
    def stride(self) -> int:
        """Bytes of one CPU-tier row, hence of one disk block: vLLM's ``kv_bytes_per_chunk``."""
        return int(self.spec.kv_bytes_per_chunk)


def tiering_rows(serve: VllmServe) -> TieringRows:
    """The rows and namespace of ``TieredDiskTier`` in ``serve``, whose extra config is
    the server's as given, ``secondary_tiers`` included (``vllm_pages.server_vllm_config``);
    its ``fingerprint`` is the disk namespace the tier opens, for any backend vLLM knows.
    Raises ``WarmupError`` naming what the server would refuse, or rows the warm-up does
    not write (module docstring)."""
    # vLLM's spec fills in the entries' back-pressure settings: work on a copy.
    extra = copy.deepcopy(dict(serve.extra_config))
    entry = disk_tier_entry(extra)
    try:
        # The entry as the tier parses it at start-up: what it refuses is refused here.
        tier_config = parse_tier_config(entry)
    except ConfigError as e:
        raise WarmupError(f"{DISK_TIER_TYPE} entry: {e}") from None
    vc = server_vllm_config(replace(serve, extra_config=extra), hash_algorithm=tier_config.hash_algorithm)
    with set_current_vllm_config(vc):
        try:
            offloading = build_offloading_config(vc, decoder_kv_cache_config(vc))
            check_tier_hash_algorithm(tier_config)
        except (AssertionError, ValueError) as e:
            raise WarmupError(f"vLLM refuses this offloading config: {one_line(e)}") from None
        except ConfigError as e:
            raise WarmupError(f"{DISK_TIER_TYPE} entry: {e}") from None
    try:
        spec = TieringOffloadingSpec(offloading)
    except Exception as e:  # vLLM raises plain Exceptions for its own keys (cpu_bytes_to_use)
        raise WarmupError(f"vLLM's {TIERING_SPEC} refuses this config: {one_line(e)}") from None
    if offloading.canonical_layout:
        raise WarmupError(
            "canonical_layout: vLLM's CPU tier then holds its canonical pages, which the warm-up "
            "does not write; remove canonical_layout from the config"
        )
    if spec.replicated_layout:
        raise WarmupError(
            "replicated layout: vLLM's CPU tier keeps one copy of a KV replicated on every rank "
            "(MLA), which the warm-up does not write"
        )
    try:
        fingerprint = tier_fingerprint(
            offloading,
            int(spec.kv_bytes_per_chunk),
            tier_config,
            entry,
            replicated_layout=spec.replicated_layout,
            vllm_config=vc,
            attention_backend=configured_attention_backend(vc),
        )
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    return TieringRows(vc, offloading, spec, tier_config, fingerprint)


class VllmRowsLayout(BlockLayout):
    """Blocks as ``TieredDiskTier`` stores them under vLLM's ``TieringOffloadingSpec`` in
    a server with the request's settings (module docstring). ``request.extra_config`` is
    the server's ``kv_connector_extra_config`` as given (``secondary_tiers`` included).
    Raises ``WarmupError`` naming the setting it cannot match."""

    def __init__(self, request: LayoutRequest):
        super().__init__(request)
        r = request
        if r.model_dir is None:
            raise WarmupError(
                f"--model: the vllm layout needs the model as a local directory ({SPEC}'s namespace "
                "covers its weights digest, and its rows are sized from its config.json)"
            )
        self.rows = tiering_rows(r.vllm_serve())
        self.spec = self.rows.spec
        self.attention_backend, self.page_order = recorded_page_order(self.rows.vllm_config)
        mc = self.rows.vllm_config.model_config
        if mc.get_head_size() != r.geometry.head_dim or mc.get_total_num_kv_heads() != r.geometry.num_kv_heads:
            raise WarmupError(
                f"the model vLLM reads at {r.model_dir} has {mc.get_total_num_kv_heads()} KV heads of "
                f"{mc.get_head_size()}, the engine's {r.geometry.num_kv_heads} of {r.geometry.head_dim}"
            )
        self._check_cells()

    def _check_cells(self) -> None:
        """Refuse rows whose cells are not the pages the warm-up writes, rank by rank."""
        r, spec = self.request, self.spec
        if spec.blocks_per_chunk != r.block_size_factor:
            raise WarmupError(
                f"block_size: vLLM's chunk is {spec.blocks_per_chunk} GPU blocks, the warm-up's {r.block_size_factor}"
            )
        world = self.rows.offloading.parallel.world_size
        if world != r.tp_size:
            raise WarmupError(f"tp: vLLM's CPU tier has a cell for each of {world} workers, the warm-up {r.tp_size}")
        mine = self.rank_bytes
        if spec.cpu_page_size_per_worker != mine or spec.kv_bytes_per_chunk < world * mine:
            raise WarmupError(
                f"vLLM's CPU-tier row holds {spec.cpu_page_size_per_worker} bytes per worker in "
                f"{spec.kv_bytes_per_chunk}, the warm-up's pages {mine} per rank: the row is not one it writes"
            )

    @property
    def rank_bytes(self) -> int:
        """One TP rank's bytes of a chunk: every layer's ``block_size_factor`` pages."""
        r = self.request
        page = 2 * r.geometry.kv_heads_per_rank(r.tp_size) * r.gpu_block_size * r.geometry.head_dim
        return page * r.dtype.itemsize * r.geometry.num_layers * r.block_size_factor

    @property
    def stride(self) -> int:
        return self.rows.stride

    @property
    def disk_ranks(self) -> int:
        return 1  # one writer, vLLM's scheduler, stores every rank's shard in one row

    @cached_property
    def kv_layout(self) -> KVCacheLayout:
        return chunk_layout(self.rows.fingerprint.block_size, self.stride)

    def fingerprint(self, config: TieredConfig) -> Fingerprint:
        return self.rows.fingerprint

    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        return [bytes(make_offload_key(k, 0)) for k in chunk_keys(block_hashes, self.request.block_size_factor)]

    def pages(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], rank: int, num_blocks: int) -> list[torch.Tensor]:
        """TP rank ``rank``'s pages of the prompt's first ``num_blocks`` GPU blocks
        (``vllm_pages.rank_pages``): what vLLM's CPU worker of that rank copies to and
        from its cell of a row."""
        return rank_pages(self.request, self.page_order, kv, rank, num_blocks)

    def pack(self, kv, rank, chunks, out) -> None:
        if rank != 0:
            raise ValueError(f"rank: a row has one writer, rank 0, got {rank}")
        cell = self.spec.cpu_page_size_per_worker
        for tp_rank in range(self.request.tp_size):
            pack_rank_chunks(
                self.request, self.page_order, kv, tp_rank, chunks, out[:, tp_rank * cell : (tp_rank + 1) * cell]
            )
