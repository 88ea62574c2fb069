"""Offline warm-up: compute the KV of prompts and write every full block to the disk tier,
so a server's first requests for those prefixes hit.

Runs in one operator process, with the server stopped (it takes the disk namespace's
writer lock, as the server's scheduler would). For each prompt it computes vLLM's
prefix block hashes (``tiered_kv.hashing``), skips the prompt when every full block is
already on disk (so a rerun resumes where a previous one stopped), runs the model once
over the prompt up to its last missing block, and stores the missing blocks through
the disk tier's own path: ``DiskOffloadingManager.prepare_store`` picks slots (evicting
LRU blocks if the cache is full), ``DiskStore.write_blocks`` writes each TP rank's
shard, makes it durable and commits its index entry, and ``complete_store`` makes the
blocks loadable. Block I/O and fsync happen on the calling thread here: there is no
engine to keep responsive.

Where the blocks go is a ``BlockLayout``, chosen by name from ``BLOCK_LAYOUTS``: the
KV-cache layout (hence the namespace fingerprint) of the serving engine that will load
them, how a prompt's K/V become one block's bytes, and how a chunk's hash becomes its
key. ``kv-first`` is the engine-agnostic layout of ``tiered_kv`` (``DeviceKVCache``,
``TieredOffloadingSpec`` over ``(2, num_blocks, block_size, kv_heads, head_dim)``
tensors named ``layer.<i>``). Other layouts (vLLM's) register with
``register_block_layout``.

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
"""

from __future__ import annotations

import importlib
import json
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig
from tiered_kv.disk.fingerprint import Fingerprint
from tiered_kv.disk.io_backends import aligned_empty
from tiered_kv.disk.manager import DiskOffloadingManager
from tiered_kv.disk.namespace import slot_size_for
from tiered_kv.disk.store import DiskStore
from tiered_kv.hashing import PrefixHasher, chunk_keys, resolve_seed
from tiered_kv.host_memory import pack_blocks
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.model_identity import read_config_file, resolve_model_dir, weights_digest
from tiered_kv.sizing import ModelGeometry

#: Blocks written per store job (bounds the staging buffer to about this many bytes).
JOB_BYTES = 64 << 20


class WarmupError(RuntimeError):
    """The warm-up cannot run as asked (one-line, operator-facing reason)."""


# ---------------------------------------------------------------- inputs


def read_extra_config(path: str | os.PathLike) -> dict[str, Any]:
    """The connector's extra config from a JSON file holding either vLLM's whole
    ``--kv-transfer-config`` (its ``kv_connector_extra_config`` is taken) or that
    extra config alone."""
    try:
        return read_config_file(path)
    except ConfigError as e:
        raise WarmupError(str(e)) from None


def load_config(path: str | os.PathLike) -> TieredConfig:
    """The server's validated config from ``path`` (see ``read_extra_config``)."""
    try:
        return TieredConfig.from_dict(read_extra_config(path), passthrough_keys=VLLM_PASSTHROUGH_KEYS)
    except ConfigError as e:
        raise WarmupError(f"config {path}: {e}") from None


@dataclass
class Prompt:
    """One line of the prompts file: token ids, or text to tokenize."""

    line: int
    token_ids: list[int] | None = None
    text: str | None = None


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
    """Prompts from a JSONL file. Each non-empty line is ``{"token_ids": [...]}``
    (or ``prompt_token_ids``), ``{"text": "..."}`` (or ``prompt``), a bare list of token
    ids, or a bare string. Raises ``WarmupError`` naming the first bad line."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise WarmupError(f"prompts file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WarmupError(f"cannot read prompts file {p}: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise WarmupError(f"{p}:{n}: not JSON ({e})") from None
        if isinstance(item, Mapping):
            ids = item.get("token_ids", item.get("prompt_token_ids"))
            text = item.get("text", item.get("prompt"))
            if ids is None and text is None:
                raise WarmupError(f"{p}:{n}: expected a 'token_ids' or 'text' key, got keys {sorted(item)}")
            item = ids if ids is not None else text
        if isinstance(item, str):
            out.append(Prompt(n, text=item))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item):
            out.append(Prompt(n, token_ids=item))
        else:
            raise WarmupError(f"{p}:{n}: expected token ids (a list of non-negative integers) or text")
    return out


def tokenize(prompts: Sequence[Prompt], tokenizer: Any | None) -> list[list[int]]:
    """Token ids of every prompt; text goes through ``tokenizer`` (an HF tokenizer,
    special tokens added as vLLM does for a plain prompt)."""
    out = []
    for pr in prompts:
        if pr.token_ids is not None:
            out.append(pr.token_ids)
        elif tokenizer is None:
            raise WarmupError(
                f"prompt on line {pr.line} is text; pass --tokenizer DIR (a local tokenizer) or give token_ids"
            )
        else:
            out.append(list(tokenizer(pr.text)["input_ids"]))
    return out


# ---------------------------------------------------------------- KV engine


def import_transformers() -> Any:
    """The ``transformers`` module, or ``WarmupError`` saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise WarmupError(f"the hf engine needs transformers ({e}); pip install 'tiered-kv[warmup]'") from None


def _layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value) of a transformers cache, across its API generations."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


class HFEngine:
    """A transformers causal LM computing prompts' K/V (post-RoPE keys, as attention
    caches them). ``kv(token_ids)`` returns per layer ``(K, V)``, each
    ``(num_kv_heads, len(token_ids), head_dim)`` on the CPU, in the model's dtype."""

    def __init__(self, model: torch.nn.Module, device: str | torch.device | None = None, model_path: str | None = None):
        self.model = model.eval()
        #: The directory the weights were loaded from (None: unknown, not checked).
        self.model_path = model_path
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.config.vocab_size)
        self.geometry = ModelGeometry.from_hf_config(
            model.config.to_dict(), dtype=str(self.dtype).removeprefix("torch.")
        )

    @classmethod
    def from_pretrained(cls, model: str, dtype: str = "auto", device: str = "auto") -> "HFEngine":
        """Load ``model`` (a local directory or a hub id available offline) with
        ``dtype`` (``auto`` = the checkpoint's) on ``device`` (``auto``, ``cpu``, ``cuda``)."""
        transformers = import_transformers()
        transformers.utils.logging.disable_progress_bar()
        dev = torch.device(
            "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        )
        torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype, None)
        if torch_dtype is None or (dtype != "auto" and not isinstance(torch_dtype, torch.dtype)):
            raise WarmupError(f"--dtype: expected auto, float32, float16 or bfloat16, got {dtype!r}")
        try:
            m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        except OSError as e:
            raise WarmupError(f"cannot load model {model!r}: {e}".splitlines()[0]) from None
        found = resolve_model_dir(model)
        return cls(m.to(dev), dev, model_path=None if found is None else str(found))

    def kv(self, token_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            cache = self.model(input_ids=ids, use_cache=True).past_key_values
        out = []
        for i, (k, v) in enumerate(_layer_kv(cache)):
            if k.shape[2] != len(token_ids):
                raise WarmupError(
                    f"layer {i} cached {k.shape[2]} of {len(token_ids)} positions (sliding-window "
                    f"attention?); the hf engine needs full attention in every layer"
                )
            out.append((k[0].to("cpu"), v[0].to("cpu")))
        return out


# ---------------------------------------------------------------- block layouts


@dataclass(frozen=True)
class LayoutRequest:
    """What a ``BlockLayout`` factory is given: the model's KV geometry and dtype, the
    serving engine's GPU block size, GPU blocks per offloaded block, and TP size."""

    geometry: ModelGeometry
    dtype: torch.dtype
    gpu_block_size: int
    block_size_factor: int
    tp_size: int

    @property
    def chunk_tokens(self) -> int:
        return self.gpu_block_size * self.block_size_factor

    def rank_heads(self, rank: int) -> list[int]:
        """KV heads TP rank ``rank`` holds (heads are replicated when TP exceeds them)."""
        h = self.geometry.num_kv_heads
        per = self.geometry.kv_heads_per_rank(self.tp_size)
        if self.tp_size <= h:
            return list(range(rank * per, (rank + 1) * per))
        return [rank * h // self.tp_size]


class BlockLayout(ABC):
    """How warm-up blocks are laid out, keyed and namespaced for one kind of serving
    engine: what its scheduler would open the disk tier with and its workers write."""

    def __init__(self, request: LayoutRequest):
        self.request = request

    @property
    @abstractmethod
    def kv_layout(self) -> KVCacheLayout:
        """One rank's layout of the serving engine's KV cache (the same on every rank);
        fixes the block bytes."""

    def fingerprint(self, config: TieredConfig) -> Fingerprint:
        """The namespace the serving engine computes for ``config`` (by default the one
        ``tiered_kv``'s own specs compute from the layout)."""
        return Fingerprint.from_config(config, self.kv_layout, self.request.tp_size)

    @abstractmethod
    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Disk keys of a prompt's full chunks from its per-GPU-block prefix hashes."""

    @abstractmethod
    def pack(
        self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], rank: int, chunks: Sequence[int], out: torch.Tensor
    ) -> None:
        """Write rank ``rank``'s bytes of the prompt's chunks ``chunks`` (indices) into
        ``out[i, :bytes_per_block]`` (uint8 ``(len(chunks), stride)``); ``kv`` is the
        prompt's per-layer ``(K, V)``, each ``(num_kv_heads, tokens, head_dim)``."""


class KvFirstLayout(BlockLayout):
    """``tiered_kv``'s engine-agnostic layout: per layer ``layer.<i>`` a tensor
    ``(2, num_blocks, gpu_block_size, kv_heads_per_rank, head_dim)`` in the model's
    dtype; a chunk's key is the prefix hash of its last GPU block."""

    @property
    def kv_layout(self) -> KVCacheLayout:
        r = self.request
        shape = (2, r.block_size_factor, r.gpu_block_size, r.geometry.kv_heads_per_rank(r.tp_size), r.geometry.head_dim)
        layers = tuple(LayerLayout(f"layer.{i}", shape, True) for i in range(r.geometry.num_layers))
        return KVCacheLayout(layers, r.dtype, r.gpu_block_size, r.block_size_factor)

    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        return chunk_keys(block_hashes, self.request.block_size_factor)

    def pack(self, kv, rank, chunks, out) -> None:
        r = self.request
        heads = torch.tensor(r.rank_heads(rank))
        ntok = (max(chunks) + 1) * r.chunk_tokens
        tensors = []
        for k, v in kv:
            both = torch.stack([k.index_select(0, heads)[:, :ntok], v.index_select(0, heads)[:, :ntok]])
            # (2, heads, tokens, dim) -> (2, kernel blocks, block tokens, heads, dim)
            both = both.permute(0, 2, 1, 3).reshape(2, ntok // r.gpu_block_size, r.gpu_block_size, len(heads), -1)
            tensors.append(both.to(r.dtype).contiguous())
        f = r.block_size_factor
        ids = np.asarray(chunks, dtype=np.int64)[:, None] * f + np.arange(f, dtype=np.int64)
        pack_blocks(tensors, self.kv_layout, ids, out)


#: Block layouts by name: ``name -> factory(LayoutRequest) -> BlockLayout``.
BLOCK_LAYOUTS: dict[str, Callable[[LayoutRequest], BlockLayout]] = {"kv-first": KvFirstLayout}


def register_block_layout(name: str, factory: Callable[[LayoutRequest], BlockLayout]) -> None:
    """Make ``factory`` selectable as ``--layout name``."""
    BLOCK_LAYOUTS[name] = factory


# ---------------------------------------------------------------- identity


@dataclass(frozen=True)
class WarmupIdentity:
    """Which model the warmed blocks are filed under: the config's ``model_id`` and
    ``model_revision``, and ``weights_digest``, the digest of the config's
    ``model_path`` (None: the config names none, so the namespace does not cover the
    weights). ``model_digest``: the digest of the model warmed (None: unknown)."""

    model_id: str
    model_revision: str
    weights_digest: str | None
    model_digest: str | None


def check_identity(config: TieredConfig, model_path: str | None) -> WarmupIdentity:
    """Refuse to warm a namespace a server with ``config`` would not read, or would
    read as another model's: a config without ``model_id``, or a ``model_path`` whose
    weights digest is not that of ``model_path`` (the ``--model`` directory; None skips
    that check). Reads both directories' digests (bounded, ``model_identity``). Raises
    ``WarmupError`` naming the field."""
    if config.model_id == "unknown":
        raise WarmupError(
            'model_id: the config sets none, so the blocks would be filed under "unknown", '
            "a name no vLLM server reads (it uses its --model) and every model of this geometry "
            'shares; add "model_id": "<model>" to the config (vLLM\'s --model is the usual value)'
        )
    try:
        server = weights_digest(config.model_path).digest if config.model_path else None
        mine = weights_digest(model_path, key="--model").digest if model_path else None
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    if server is not None and mine is not None and server != mine:
        raise WarmupError(
            f"weights_digest: the config's model_path {config.model_path!r} has weights digest "
            f"{server} but --model {model_path!r} has {mine}, so a server with this config would "
            f"not read these blocks; warm up with the model the config names, or fix model_path"
        )
    return WarmupIdentity(config.model_id, config.model_revision, server, mine)


# ---------------------------------------------------------------- the run


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
    layout: str = "kv-first",
    env: Mapping[str, str] | None = None,
    progress: Callable[[int, WarmupReport], None] | None = None,
) -> WarmupReport:
    """Write every full block of ``prompts`` (token ids) to ``config``'s disk tier.

    ``gpu_block_size``/``tp_size``: the serving engine's; ``layout``: a key of
    ``BLOCK_LAYOUTS``; ``env``: where ``PYTHONHASHSEED`` is read (default
    ``os.environ``). ``progress(i, report)`` is called after prompt ``i``. Raises
    ``WarmupError`` for unusable settings, ``HashSettingsError`` when the hashes would
    not be stable across processes, ``CacheLockedError`` when a server holds the cache.
    The model's identity is checked first (``check_identity``).
    """
    if not config.disk_path:
        raise WarmupError("the config has no disk_path: there is no disk tier to warm")
    check_identity(config, getattr(engine, "model_path", None))
    for n, tokens in enumerate(prompts, 1):
        if len(tokens) and max(tokens) >= engine.vocab_size:
            raise WarmupError(
                f"prompt {n}: token id {max(tokens)} is outside the model's vocabulary ({engine.vocab_size} tokens)"
            )
    if layout not in BLOCK_LAYOUTS:
        raise WarmupError(f"--layout: expected one of {', '.join(sorted(BLOCK_LAYOUTS))}, got {layout!r}")
    chunk_tokens = chunk_tokens_for(config, gpu_block_size)
    try:
        engine.geometry.kv_heads_per_rank(tp_size)
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    hasher = PrefixHasher(
        config.hash_algorithm, resolve_seed(config.hash_algorithm, config.hash_seed, env), gpu_block_size
    )
    blocks = BLOCK_LAYOUTS[layout](
        LayoutRequest(engine.geometry, engine.dtype, gpu_block_size, chunk_tokens // gpu_block_size, tp_size)
    )
    kv_layout = blocks.kv_layout
    try:
        fp = blocks.fingerprint(config)
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    engine_id = f"tiered-kv-warmup-{os.getpid()}"
    t0 = time.perf_counter()
    report = WarmupReport(
        namespace=str(Path(config.disk_path) / fp.namespace_id),
        namespace_id=fp.namespace_id,
        model_id=fp.model_id,
        model_revision=fp.model_revision,
        weights_digest=fp.weights_digest,
        layout=layout,
    )
    manager = DiskOffloadingManager(
        config.disk_path,
        fp,
        kv_layout,
        disk_bytes=config.disk_bytes,
        checksum=config.checksum,
        engine_id=engine_id,
        enable_events=False,
    )
    store = None
    try:
        store = DiskStore.open(
            config.disk_path,
            fp,
            kv_layout,
            disk_bytes=config.disk_bytes,
            checksum=config.checksum,
            io_backend=config.io_backend,
            io_threads=config.io_threads,
            engine_id=engine_id,
        )
        seen: set[bytes] = set()
        for i, tokens in enumerate(prompts):
            _warm_prompt(list(tokens), engine, hasher, blocks, manager, store, seen, report)
            report.seconds = time.perf_counter() - t0
            if progress is not None:
                progress(i, report)
    finally:
        manager.shutdown()  # flushes the index updates it still holds
        if store is not None:
            store.close()
        report.seconds = time.perf_counter() - t0
    return report


def _warm_prompt(
    tokens: list[int],
    engine: HFEngine,
    hasher: PrefixHasher,
    blocks: BlockLayout,
    manager: DiskOffloadingManager,
    store: DiskStore,
    seen: set[bytes],
    report: WarmupReport,
) -> None:
    report.prompts += 1
    keys = blocks.keys(hasher.block_hashes(tokens))
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
    manager: DiskOffloadingManager,
    store: DiskStore,
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
    slots = out.store_spec.id_list()
    rows = aligned_empty(len(todo) * slot_size).view(len(todo), slot_size)
    rows.zero_()
    ok = np.ones(len(todo), dtype=bool)
    for rank in range(blocks.request.tp_size):
        blocks.pack(kv, rank, todo_chunks, rows)
        ok &= np.asarray(store.write_blocks(rank, todo, slots, rows), dtype=bool)
    done = [k for k, good in zip(todo, ok) if good]
    failed = [k for k, good in zip(todo, ok) if not good]
    manager.complete_store(done, success=True)
    if failed:
        manager.complete_store(failed, success=False)
    report.blocks_written += len(done)
    report.blocks_failed += len(failed)
    report.bytes_written += len(done) * blocks.kv_layout.bytes_per_block * blocks.request.tp_size


# ---------------------------------------------------------------- the vllm engine


def require_vllm_engine() -> None:
    """Raise ``WarmupError`` unless a CUDA device is visible and vLLM imports."""
    if not torch.cuda.is_available():
        raise WarmupError(
            "the vllm engine needs CUDA + vLLM: no CUDA device is visible here (use --engine hf on this machine)"
        )
    try:
        importlib.import_module("vllm")
    except Exception as e:
        raise WarmupError(f"the vllm engine needs CUDA + vLLM: cannot import vLLM ({e})") from None


def run_vllm_warmup(
    prompts: Sequence[Sequence[int]],
    model: str,
    extra_config: Mapping[str, Any],
    *,
    gpu_block_size: int = 16,
    tp_size: int = 1,
) -> int:
    """Prefill ``prompts`` with vLLM's offline ``LLM`` and our connector configured by
    ``extra_config`` (the server's store path, forced to write-through so every block
    reaches the disk), then shut the engine down. Returns the number of prompts run.
    Raises ``WarmupError`` unless CUDA and vLLM are usable here."""
    require_vllm_engine()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {**extra_config, "write_policy": "write_through"}
    llm = LLM(
        model=model,
        block_size=gpu_block_size,
        tensor_parallel_size=tp_size,
        enable_prefix_caching=True,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    try:
        llm.generate(
            [TokensPrompt(prompt_token_ids=list(t)) for t in prompts], SamplingParams(max_tokens=1), use_tqdm=False
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    return len(prompts)
