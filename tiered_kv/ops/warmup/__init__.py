"""Offline warm-up: compute the KV of prompts and write every full block to the disk tier,
so a server's first requests for those prefixes hit.

Runs in one operator process, with the server stopped (it takes the disk namespace's
writer lock, as the server's scheduler would). For each prompt it computes vLLM's
prefix block hashes (``tiered_kv.ops.hashing``), skips the prompt when every full block is
already on disk (so a rerun resumes where a previous one stopped), runs the model once
over the prompt up to its last missing block, and stores the missing blocks through
the tier's own path: the config's first tier whose type offers a warm writer
(``TierSpec.warm_writer``; a disk tier, or a tier of your own), built by type as every
deployment builds it. Its manager's ``prepare_store`` picks slots (a disk tier evicts
LRU blocks if the cache is full), the writer's ``write_blocks`` writes each TP rank's
shard durably (a disk tier also commits its index entry), and ``complete_store`` makes
the blocks loadable. Block I/O and fsync happen on the calling thread here: there is no
engine to keep responsive.

Where the blocks go is a ``BlockLayout``, chosen by name from ``BLOCK_LAYOUTS``: the
KV-cache layout (hence the namespace fingerprint) of the serving engine that will load
them, how a prompt's K/V become one block's bytes, and how a chunk's hash becomes its
key. ``kv-first`` is the engine-agnostic layout of ``tiered_kv`` (``DeviceKVCache``,
``HierarchySpec`` over ``(2, num_blocks, block_size, kv_heads, head_dim)``
tensors named ``layer.<i>``). ``vllm`` (the default) writes what the server the config
names reads: each TP rank's pages for ``TieredOffloadingSpec`` (``vllm_pages``), or
whole CPU-tier rows, every rank's shard in one block from one writer, for vLLM's
``TieringOffloadingSpec`` with ``TieredDiskTier`` (``vllm_rows``), for the server's
attention backend over the KV-cache layout vLLM resolves for it; it writes only page
orders it can prove that backend reads as the model's K/V (``vllm_pages.PAGE_READERS``),
refuses the others in one line, and its report names the backend and layout written
for. Other layouts register with ``register_block_layout``.

Which namespace: the one the serving engine computes from the same config
(``BlockLayout.fingerprint``), so the model's identity comes from the config:
``model_id`` (required: a warm-up never writes as "unknown"), ``model_revision`` and,
where the config names a ``model_path``, that directory's weights digest
(``tiered_kv.model_identity``). ``check_identity`` refuses, before the model is
loaded, a ``--model`` whose digest is not the one the config's ``model_path`` gives:
the server would never read those blocks, and must never read them as its own model's.

KV engines: ``HFEngine`` (transformers, CPU or GPU) computes post-RoPE K/V with the
model's own forward pass. ``run_vllm_warmup`` instead drives vLLM's offline ``LLM``
with our connector, which stores blocks exactly as the server would; it needs CUDA and
vLLM.

This package's modules: the run (here), ``inputs`` (config, prompts, the model's
identity), ``engines`` (the KV engines), ``layouts`` (block layouts), ``vllm_pages`` and
``vllm_rows`` (vLLM's), ``errors``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.config_file import DISK_TIER_TYPE, TIERED_SPEC, TIERING_SPEC, is_tiering
from tiered_kv.disk.store.io_backends import aligned_empty
from tiered_kv.disk.format.namespace import slot_size_for
from tiered_kv.mediums import ids_spec
from tiered_kv.ops.hashing import PrefixHasher, resolve_seed
from tiered_kv.ops.warmup.engines import HFEngine
from tiered_kv.ops.warmup.errors import WarmupError
from tiered_kv.ops.warmup.inputs import check_identity
from tiered_kv.ops.warmup.layouts import BLOCK_LAYOUTS, BlockLayout, LayoutRequest, VllmServe, register_block_layout
from tiered_kv.abstract import LowerTier
from tiered_kv.tier_ops import BlockWriter
from tiered_kv.tier_registry import TierEntry
from tiered_kv.tiers import TierContext, TierSpec, build_tiers

#: The run; ``register_block_layout`` is here too, where docs/cli.md points plug-ins.
__all__ = [
    "DEFAULT_LAYOUT",
    "check_layout",
    "JOB_BYTES",
    "WarmupReport",
    "chunk_tokens_for",
    "register_block_layout",
    "ServerSettings",
    "server_settings",
    "VllmServe",
    "warmup",
]

#: The layout ``tiered-kv warmup`` writes unless told otherwise: what vLLM reads.
DEFAULT_LAYOUT = "vllm"


def _vllm_pages() -> Any:
    """The ``vllm_pages`` module, imported when the vllm layout is chosen (it imports
    vLLM), or ``WarmupError`` saying what to do without vLLM."""
    try:
        from tiered_kv.ops.warmup import vllm_pages
    except ImportError as e:
        raise WarmupError(
            f"the vllm layout computes vLLM's own namespace and needs vLLM importable ({e}); "
            "install vLLM 0.33 here, or use --layout kv-first for tiered-kv's own engine"
        ) from None
    return vllm_pages


def _vllm_layout(request: LayoutRequest) -> BlockLayout:
    """What the server given ``request.extra_config`` reads: whole CPU-tier rows for
    vLLM's ``TieringOffloadingSpec`` with ``TieredDiskTier``, else each rank's pages as
    ``TieredOffloadingSpec`` stores them."""
    pages = _vllm_pages()
    if is_tiering(request.extra_config):
        from tiered_kv.ops.warmup.vllm_rows import VllmRowsLayout

        return VllmRowsLayout(request)
    return pages.VllmPagesLayout(request)


@dataclass(frozen=True)
class ServerSettings:
    """What the ``vllm`` layout writes for, as resolved from a ``VllmServe`` (whose
    dtype, backend and layout may be left to vLLM): the dtype a vLLM server runs the
    model in, so the hf engine computes K/V in it, and the page order it reads, its
    attention backend over the KV-cache layout vLLM resolves for it."""

    dtype: str
    attention_backend: str
    kv_cache_layout: str


def server_settings(serve: VllmServe) -> ServerSettings:
    """The settings of ``serve`` as vLLM resolves them: its dtype, its attention backend
    as ``tiered-kv config`` computes it, and the KV-cache layout vLLM resolves for that
    backend (``vllm_pages.server_page_order``). Checked before the model is loaded:
    raises ``WarmupError`` for a page order the warm-up cannot prove
    (``vllm_pages.check_page_order``) or settings vLLM refuses."""
    pages = _vllm_pages()
    backend, layout = pages.recorded_page_order(pages.server_vllm_config(serve))
    dtype = pages.vllm_model_dtype(serve.model_dir, serve.dtype)
    return ServerSettings(str(dtype).removeprefix("torch."), backend, layout)


register_block_layout(DEFAULT_LAYOUT, _vllm_layout)

#: Blocks written per store job (bounds the staging buffer to about this many bytes).
JOB_BYTES = 64 << 20


@dataclass
class WarmupReport:
    """What a warm-up did. Block counts are offloaded blocks (chunks); ``blocks`` counts
    each distinct chunk key once. ``blocks_present``: already on disk (skipped);
    ``blocks_rejected``: no slot could be had; ``blocks_evicted``: older blocks the
    cache dropped to make room."""

    namespace: str = ""
    namespace_id: str = ""
    model_id: str = ""
    model_revision: str = ""
    #: The weights digest the namespace records; None: the config has no model_path.
    weights_digest: str | None = None
    layout: str = ""
    #: The vLLM spec whose namespace was written: ``TieredOffloadingSpec``, or
    #: ``TieringOffloadingSpec`` (whole CPU-tier rows, for ``TieredDiskTier``).
    spec: str = TIERED_SPEC
    #: vLLM's KV-cache layout of the pages written (``vllm`` layout), else None.
    kv_cache_layout: str | None = None
    #: The attention backend the namespace names, whose server reads the pages in the
    #: order written (``vllm`` layout), else None.
    attention_backend: str | None = None
    prompts: int = 0
    prompts_skipped: int = 0
    prompts_too_short: int = 0
    blocks: int = 0
    blocks_present: int = 0
    blocks_written: int = 0
    blocks_failed: int = 0
    blocks_rejected: int = 0
    blocks_evicted: int = 0
    bytes_written: int = 0
    tokens_computed: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_layout(layout: str, extra_config: Mapping[str, Any], attention_backend: str | None = None) -> None:
    """Refuse a ``--layout`` that is not a key of ``BLOCK_LAYOUTS``, one the server
    given ``extra_config`` never reads (vLLM's ``TieringOffloadingSpec`` reads whole
    CPU-tier rows, which only the ``vllm`` layout writes), or an ``attention_backend``
    with a layout whose engine has none. Raises ``WarmupError``."""
    if layout not in BLOCK_LAYOUTS:
        raise WarmupError(f"--layout: expected one of {', '.join(sorted(BLOCK_LAYOUTS))}, got {layout!r}")
    if attention_backend is not None and layout != DEFAULT_LAYOUT:
        raise WarmupError(
            f"--attention-backend {attention_backend}: --layout {layout} writes a namespace that names no "
            f"attention backend (no vLLM server reads it); drop the option, or use --layout {DEFAULT_LAYOUT}"
        )
    if layout != DEFAULT_LAYOUT and is_tiering(extra_config):
        raise WarmupError(
            f"--layout {layout}: vLLM's {TIERING_SPEC} with {DISK_TIER_TYPE} reads whole CPU-tier rows in a "
            f"namespace of their own, which only --layout {DEFAULT_LAYOUT} writes"
        )


def chunk_tokens_for(config: TieredConfig, gpu_block_size: int) -> int:
    """Tokens per offloaded block: the config's ``block_size``, else vLLM's
    ``blocks_per_chunk`` x the GPU block size, else one GPU block."""
    if gpu_block_size < 1:
        raise WarmupError(f"--gpu-block-size must be a positive number of tokens, got {gpu_block_size}")
    per_chunk = config.passthrough.get("blocks_per_chunk")
    tokens = config.block_size or (int(per_chunk) * gpu_block_size if per_chunk else gpu_block_size)
    if tokens % gpu_block_size:
        raise WarmupError(f"block_size {tokens} is not a multiple of --gpu-block-size {gpu_block_size}")
    return tokens


def warmup(
    prompts: Sequence[Sequence[int]],
    engine: HFEngine,
    config: TieredConfig,
    *,
    gpu_block_size: int = 16,
    tp_size: int = 1,
    layout: str = DEFAULT_LAYOUT,
    extra_config: Mapping[str, Any] | None = None,
    kv_cache_layout: str | None = None,
    attention_backend: str | None = None,
    env: Mapping[str, str] | None = None,
    cache_salts: Sequence[str | None] | None = None,
    progress: Callable[[int, WarmupReport], None] | None = None,
) -> WarmupReport:
    """Write every full block of ``prompts`` (token ids) to ``config``'s disk tier.

    ``gpu_block_size``/``tp_size``: the serving engine's; ``layout``: a key of
    ``BLOCK_LAYOUTS``; ``extra_config``: the server's ``kv_connector_extra_config``
    as given (default: ``config``'s; for vLLM's ``TieringOffloadingSpec`` its
    ``secondary_tiers`` included, ``config`` then being its ``TieredDiskTier`` entry's
    keys, ``inputs.read_server``); ``attention_backend``: the vLLM server's
    ``--attention-backend`` (``vllm`` layout; default vLLM's choice on this host, else
    FLASH_ATTN; pages are written only for ``vllm_pages.PAGE_READERS``);
    ``kv_cache_layout``: vLLM's (``vllm`` layout; default its ``VLLM_KV_CACHE_LAYOUT``,
    else the backend's choice, ``LBNHC`` for FLASH_ATTN); ``env``: where
    ``PYTHONHASHSEED`` is read (default ``os.environ``); ``cache_salts``: each prompt's
    tenant (vLLM's ``cache_salt``; None: unsalted), whose requests alone read its blocks
    (default: none salted). ``progress(i, report)`` is
    called after prompt ``i``. Raises ``WarmupError`` for unusable settings,
    ``HashSettingsError`` when the hashes would not be stable across processes,
    ``CacheLockedError`` when a server holds the cache. The model's identity is
    checked first (``check_identity``). The ``vllm`` layout's namespace always covers
    the weights of the engine's model directory (vLLM digests its ``--model``); the
    ``kv-first`` one covers them where the config names ``model_path``, as tiered-kv's
    own engine does.
    """
    # The first tier the warm-up can write, whichever form names it (disk_path, or an
    # entry of ``tiers``): where the server looks first below CPU.
    target = next((e for e in config.tier_entries() if _warmable(e)), None)
    if target is None:
        raise WarmupError(
            "the config has no disk_path and no tiers entry of type disk (nor of a type whose warm_writer "
            "writes it): there is no tier to warm"
        )
    server_extra = dict(_extra_config(config) if extra_config is None else extra_config)
    tiering = is_tiering(server_extra)
    model_dir = getattr(engine, "model_path", None)
    check_identity(config, model_dir, where=f"its {DISK_TIER_TYPE} entry" if tiering else "the config")
    salts = [None] * len(prompts) if cache_salts is None else list(cache_salts)
    if len(salts) != len(prompts):
        raise WarmupError(f"cache_salts: expected one per prompt ({len(prompts)}), got {len(salts)}")
    for n, (tokens, salt) in enumerate(zip(prompts, salts), 1):
        if salt is not None and not (isinstance(salt, str) and salt):
            raise WarmupError(f"prompt {n}: cache_salt: expected a non-empty string (the tenant), got {salt!r}")
        if len(tokens) and max(tokens) >= engine.vocab_size:
            raise WarmupError(
                f"prompt {n}: token id {max(tokens)} is outside the model's vocabulary ({engine.vocab_size} tokens)"
            )
    check_layout(layout, server_extra, attention_backend)
    chunk_tokens = chunk_tokens_for(config, gpu_block_size)
    try:
        engine.geometry.kv_heads_per_rank(tp_size)
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    hasher = PrefixHasher(
        config.hash_algorithm, resolve_seed(config.hash_algorithm, config.hash_seed, env), gpu_block_size
    )
    blocks = BLOCK_LAYOUTS[layout](
        LayoutRequest(
            engine.geometry,
            engine.dtype,
            gpu_block_size,
            chunk_tokens // gpu_block_size,
            tp_size,
            model_dir=model_dir,
            extra_config=server_extra,
            kv_cache_layout=kv_cache_layout,
            attention_backend=attention_backend,
        )
    )
    kv_layout = blocks.kv_layout
    try:
        fp = blocks.fingerprint(config)
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    engine_id = f"tiered-kv-warmup-{os.getpid()}"
    t0 = time.perf_counter()
    report = WarmupReport(
        namespace=(
            str(Path(target.settings.path) / fp.namespace_id)
            if target.type_name == "disk"
            else f"{target.name}/{fp.namespace_id}"
        ),
        namespace_id=fp.namespace_id,
        model_id=fp.model_id,
        model_revision=fp.model_revision,
        weights_digest=fp.weights_digest,
        layout=layout,
        spec=TIERING_SPEC if tiering else TIERED_SPEC,
        kv_cache_layout=getattr(blocks, "page_order", None),
        attention_backend=fp.attention_backend,
    )
    # The disk tier as every deployment builds it (by type, tiered_kv.tiers), both its
    # scheduler side and one writer's store, in this one process.
    ctx = TierContext(config, fp, kv_layout, engine_id, enable_events=False)
    (tier,) = build_tiers([target], ctx)
    manager = tier.get_manager()
    store = None
    try:
        store = tier.warm_writer()
        assert store is not None, target  # _warmable
        seen: set[bytes] = set()
        for i, (tokens, salt) in enumerate(zip(prompts, salts)):
            keys = blocks.keys(hasher.block_hashes(tokens, salt))
            _warm_prompt(list(tokens), keys, engine, blocks, manager, store, seen, report)
            report.seconds = time.perf_counter() - t0
            if progress is not None:
                progress(i, report)
    finally:
        manager.shutdown()  # flushes the index updates it still holds
        if store is not None:
            store.close()
        report.seconds = time.perf_counter() - t0
    return report


def _warmable(entry: TierEntry) -> bool:
    """Whether the tier type of ``entry`` offers a warm writer (``TierSpec.warm_writer``)."""
    return getattr(entry.cls, "warm_writer", TierSpec.warm_writer) is not TierSpec.warm_writer


def _extra_config(config: TieredConfig) -> dict[str, Any]:
    """``config`` as a server's extra config: its set keys (an empty ``hash_seed`` left
    out: the server then takes ``PYTHONHASHSEED``) and vLLM's pass-through keys."""
    out = {k: v for k, v in config.to_dict().items() if v is not None and not (k == "hash_seed" and v == "")}
    out.update(config.passthrough)
    return out


def _warm_prompt(
    tokens: list[int],
    keys: list[bytes],
    engine: HFEngine,
    blocks: BlockLayout,
    manager: LowerTier,
    store: BlockWriter,
    seen: set[bytes],
    report: WarmupReport,
) -> None:
    """Store the blocks of ``tokens`` (whose chunk keys are ``keys``) not yet on disk."""
    report.prompts += 1
    if not keys:
        report.prompts_too_short += 1
        return
    new = [k for k in keys if k not in seen]
    seen.update(new)
    report.blocks += len(new)
    missing = [i for i, k in enumerate(keys) if not manager.is_loadable(k)]
    report.blocks_present += sum(1 for k in new if manager.is_loadable(k))
    if not missing:
        report.prompts_skipped += 1
        return
    chunk_tokens = blocks.request.chunk_tokens
    kv = engine.kv(tokens[: (missing[-1] + 1) * chunk_tokens])
    report.tokens_computed += (missing[-1] + 1) * chunk_tokens
    slot_size = slot_size_for(blocks.kv_layout.bytes_per_block)
    per_job = max(1, JOB_BYTES // slot_size)
    for start in range(0, len(missing), per_job):
        _store_chunks(missing[start : start + per_job], keys, kv, blocks, manager, store, slot_size, report)


def _store_chunks(
    chunks: list[int],
    keys: list[bytes],
    kv,
    blocks: BlockLayout,
    manager: LowerTier,
    store: BlockWriter,
    slot_size: int,
    report: WarmupReport,
) -> None:
    out = manager.prepare_store([keys[c] for c in chunks])
    if out is None:
        report.blocks_rejected += len(chunks)
        return
    report.blocks_evicted += len(out.block_hashes_evicted)
    todo = list(out.block_hashes_to_store)
    if not todo:
        return
    index_of = {keys[c]: c for c in chunks}
    todo_chunks = [index_of[k] for k in todo]
    slots = ids_spec(out.store_spec).id_list()
    rows = aligned_empty(len(todo) * slot_size).view(len(todo), slot_size)
    rows.zero_()
    ok = np.ones(len(todo), dtype=bool)
    for rank in range(blocks.disk_ranks):
        blocks.pack(kv, rank, todo_chunks, rows)
        ok &= np.asarray(store.write_blocks(rank, todo, slots, rows), dtype=bool)
    done = [k for k, good in zip(todo, ok) if good]
    failed = [k for k, good in zip(todo, ok) if not good]
    manager.complete_store(done, success=True)
    if failed:
        manager.complete_store(failed, success=False)
    report.blocks_written += len(done)
    report.blocks_failed += len(failed)
    report.bytes_written += len(done) * blocks.kv_layout.bytes_per_block * blocks.disk_ranks
