"""Same output cold and warm: a real model's greedy continuation from prefix KV that came
back from a tier, against the same continuation computed cold (DESIGN property 16).

Runs in one process (a test, or the operator's ``tiered-kv doctor --e2e``) in the
scheduler and worker roles at once, as ``tiered_kv.sim.driver`` does: CPU tensors stand
in for the GPU's KV cache (CUDA tensors where asked for). Its I/O: the small models'
files in the directory it is given (random weights from a transformers config, never a
download); the tiers' own I/O through their real managers and handlers (built by
``HierarchySpec``): each disk tier's directory (the small model's namespace), the shared
tier's bucket or store (objects in the small model's namespace under the configured
prefix, sealed with the fleet key, left there as every node leaves its uploads); the
warm-up's writes to a directory it is given; and one byte flipped in a disk tier's slab.

For each model (``SHAPES``: a Llama with one KV head per query head, a Qwen2 with two
query heads per KV head) and one prompt (a prefix of whole offloaded blocks and a tail),
the cold output is the model's prefill of the whole prompt and 32 greedy tokens; each
case continues from the prefix's K/V as it came back, in transformers' ``DynamicCache``:

- **computed**: as the model computed them (the split alone, no tier);
- **cpu**: written into the "GPU" tensors, stored (GPU -> CPU), the tensors zeroed,
  loaded back (CPU -> GPU);
- **tier**, each lower tier of the config: stored by one engine (write-through), which
  then stops; a second engine, whose CPU tier never held them, loads every block;
- **warmup**: written by ``tiered_kv.ops.warmup`` (the ``kv-first`` layout) to a disk
  tier, loaded by an engine on it;
- **recompute**: a block in the middle of the prefix damaged on a disk tier: the load
  fails, and the blocks of the failed job are recomputed over what it left.

A case passes with the cold tokens and every logit within the dtype's tolerance
(``TOLERANCE``, relative to the largest cold logit). The prefix's own blocks in another
order would pass too (attention sums over the cached pairs, each key carrying its
position): ``kv_equal`` says whether the K/V were the model's bytes exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiered_kv.abstract import BlockHash, Closing
from tiered_kv.config import TieredConfig
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.mediums import GPULoadStoreSpec
from tiered_kv.memory.host_memory import expand_block_ids
from tiered_kv.ops.hashing import PrefixHasher, chunk_keys, resolve_seed
from tiered_kv.ops.warmup import warmup
from tiered_kv.ops.warmup.engines import HFEngine, import_transformers
from tiered_kv.sim.driver import DeviceKVCache
from tiered_kv.tier_registry import TierEntry
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.spec import HierarchySpec

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each (kv_heads, tokens, head_dim)

GPU_BLOCK_SIZE = 16
STEPS = 32
PREFIX_TOKENS = 256
TAIL_TOKENS = 9
#: Largest logit difference allowed, as a fraction of the largest cold logit (at least 1):
#: what one prefill against a prefill split at the prefix may differ by in each dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
#: Weights drawn wider than transformers' default (0.02), so that the continuation
#: depends on the prefix: one block of K zeroed moves the logits by 0.1-0.5, a
#: thousand times the tolerance, where the default moves them by 4e-4.
INIT_RANGE = 0.1
#: The config keys an engine of this check takes from the config it is given: how blocks
#: move between GPU and CPU and stay in CPU, never what they are. (A tier's own settings,
#: the disk tier's I/O backend and checksum among them, travel in its entry.)
CARRIED_KEYS = ("gpu_copy", "eviction_policy", "promote_on_hit")
SETTLE_SECONDS = 60.0


class EquivalenceError(Exception):
    """A case could not run as asked (a tier that stores or serves nothing, a refused
    store); the message names the tier and what happened."""


@dataclass(frozen=True)
class ModelShape:
    """A small decoder of a real architecture: ``architecture`` names transformers'
    ``<architecture>Config`` and ``<architecture>ForCausalLM``."""

    name: str
    architecture: str
    num_heads: int = 4
    num_kv_heads: int = 4
    hidden_size: int = 64
    num_layers: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512


SHAPES = (
    ModelShape("llama", "Llama", num_kv_heads=4),
    ModelShape("qwen2-gqa", "Qwen2", num_kv_heads=2),
)


@dataclass
class Continuation:
    """Greedy tokens and, per step, the logits they were chosen from (float32, CPU)."""

    tokens: list[int]
    logits: torch.Tensor


@dataclass
class TinyModel:
    """One of ``SHAPES`` with random weights, saved in ``path`` and loaded from there."""

    shape: ModelShape
    engine: HFEngine
    path: Path

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def model_id(self) -> str:
        return f"tiered-kv-e2e/{self.shape.name}"

    def prefix_kv(self, tokens: Sequence[int]) -> KV:
        """The model's K/V of ``tokens`` (post-RoPE keys), as the warm-up computes them."""
        return self.engine.kv(tokens)

    def greedy(self, tokens: Sequence[int], prefix: KV | None = None, steps: int = STEPS) -> Continuation:
        """``steps`` greedy tokens after ``tokens``: with ``prefix`` (K/V of the leading
        tokens) only the rest is computed, as an engine does after a prefix hit."""
        from transformers import DynamicCache

        device = self.engine.device
        cache: Any = None
        start = 0
        if prefix is not None:
            cache = DynamicCache()
            for i, (k, v) in enumerate(prefix):
                cache.update(k[None].to(device), v[None].to(device), i)
            start = prefix[0][0].shape[1]
        ids = torch.tensor([list(tokens)[start:]], dtype=torch.long, device=device)
        out_tokens: list[int] = []
        logits = []
        with torch.inference_mode():
            out = self.engine.model(input_ids=ids, past_key_values=cache, use_cache=True)
            for step in range(steps):
                last = out.logits[0, -1].float().cpu()
                out_tokens.append(int(last.argmax()))
                logits.append(last)
                if step + 1 < steps:
                    nxt = torch.tensor([[out_tokens[-1]]], dtype=torch.long, device=device)
                    out = self.engine.model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        return Continuation(out_tokens, torch.stack(logits))


def build_model(
    shape: ModelShape, directory: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> TinyModel:
    """``shape`` with weights drawn from ``seed`` (the caller's random state untouched),
    saved under ``directory/<name>`` and loaded back as the warm-up loads a model. Raises
    ``WarmupError`` without transformers."""
    transformers = import_transformers()
    config = getattr(transformers, f"{shape.architecture}Config")(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        initializer_range=INIT_RANGE,
    )
    transformers.utils.logging.disable_progress_bar()
    path = Path(directory) / shape.name
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, f"{shape.architecture}ForCausalLM")(config)
    model.save_pretrained(path)
    return TinyModel(shape, HFEngine.from_pretrained(str(path), dtype=dtype, device=device), path)


def prompt_tokens(model: TinyModel, seed: int = 0) -> list[int]:
    """``PREFIX_TOKENS`` + ``TAIL_TOKENS`` token ids drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, model.shape.vocab_size, PREFIX_TOKENS + TAIL_TOKENS)]


@dataclass
class Comparison:
    """A continuation against the cold one: tokens equal up to ``matching`` of ``steps``,
    and the largest logit difference over the steps both took the same path."""

    steps: int
    matching: int
    max_logit_diff: float
    tolerance: float

    @property
    def tokens_equal(self) -> bool:
        return self.matching == self.steps

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.max_logit_diff <= self.tolerance


def compare(cold: Continuation, warm: Continuation, dtype: torch.dtype) -> Comparison:
    """``warm`` held to ``cold`` at ``dtype``'s tolerance (``TOLERANCE``)."""
    steps = len(cold.tokens)
    matching = next((i for i, (a, b) in enumerate(zip(cold.tokens, warm.tokens)) if a != b), steps)
    # Logits of step i depend on tokens before i only: compared up to the first difference.
    upto = min(matching + 1, steps)
    diff = float((cold.logits[:upto] - warm.logits[:upto]).abs().max())
    scale = max(1.0, float(cold.logits.abs().max()))
    return Comparison(steps, matching, diff, TOLERANCE.get(dtype, 5e-2) * scale)


def kv_equal(a: KV, b: KV) -> bool:
    return all(torch.equal(x[0].cpu(), y[0].cpu()) and torch.equal(x[1].cpu(), y[1].cpu()) for x, y in zip(a, b))


class Engine(Closing):
    """One engine's hierarchy over ``config`` (``HierarchySpec``: manager and worker in
    this process) and a "GPU" KV cache of ``model``'s geometry holding ``blocks``
    offloaded blocks (kv-first, ``layer.<i>``)."""

    def __init__(self, config: TieredConfig, model: TinyModel, blocks: int, device: str = "cpu"):
        self.model = model
        self.block_tokens = config.block_size or GPU_BLOCK_SIZE
        self.factor = self.block_tokens // GPU_BLOCK_SIZE
        geometry = model.engine.geometry
        self.kv = DeviceKVCache(
            num_layers=geometry.num_layers,
            num_gpu_blocks=blocks * self.factor,
            gpu_block_size=GPU_BLOCK_SIZE,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            dtype=model.dtype,
            block_size_factor=self.factor,
            device=device,
        )
        self.spec = HierarchySpec(
            config,
            GPU_BLOCK_SIZE,
            self.kv.layout,
            engine_id=f"tiered-kv-e2e-{uuid.uuid4().hex[:12]}",
            enable_events=False,
            failed_loads_recomputed=True,  # as under vLLM's recompute policy: each hit read once
        )
        self.hasher = PrefixHasher(
            config.hash_algorithm, resolve_seed(config.hash_algorithm, config.hash_seed, {}), GPU_BLOCK_SIZE
        )
        self.worker: Any = None
        self.manager: Any = None
        self._job = 0
        try:
            self.worker = self.spec.build_worker(self.kv.kv_caches, True)
            manager = self.spec.get_manager()
        except BaseException:
            self.close()
            raise
        assert isinstance(manager, TieredOffloadingManager)  # what HierarchySpec builds
        self.manager = manager

    def keys(self, tokens: Sequence[int]) -> list[BlockHash]:
        """Keys of the offloaded blocks of ``tokens``' whole blocks."""
        return chunk_keys(self.hasher.block_hashes(tokens), self.factor)

    def write(self, kv: KV, blocks: int) -> None:
        """Put the first ``blocks`` offloaded blocks of ``kv`` into the "GPU" tensors,
        laid out as the warm-up lays the model's K/V out (``KvFirstLayout``)."""
        n = blocks * self.factor
        for tensor, (k, v) in zip(self.kv.tensors, kv):
            for i, part in enumerate((k, v)):
                heads, _, dim = part.shape
                tensor[i, :n] = part[:, : n * GPU_BLOCK_SIZE].permute(1, 0, 2).reshape(n, GPU_BLOCK_SIZE, heads, dim)

    def read(self, blocks: int) -> KV:
        """K/V of the first ``blocks`` offloaded blocks of the "GPU" tensors."""
        n = blocks * self.factor
        out = []
        for tensor in self.kv.tensors:
            k, v = (tensor[i, :n].reshape(n * GPU_BLOCK_SIZE, *tensor.shape[3:]).permute(1, 0, 2) for i in (0, 1))
            out.append((k.contiguous().cpu(), v.contiguous().cpu()))
        return out

    def zero(self) -> None:
        for tensor in self.kv.tensors:
            tensor.zero_()

    def _run(self, spec: tuple) -> bool:
        job, self._job = self._job, self._job + 1
        if not self.worker.transfer_async(job, spec):
            return False
        self.worker.wait({job})
        return all(r.success for r in self.worker.get_finished() if r.job_id == job)

    def store(self, keys: list[BlockHash]) -> None:
        """Store the blocks at the head of the "GPU" tensors as ``keys`` (GPU -> CPU, and
        each write-through tier from there), then wait until every lower tier has them
        or has given up on them."""
        out = self.manager.prepare_store(keys)
        if out is None:
            raise EquivalenceError(f"the hierarchy refused to store the prefix's {len(keys)} blocks (no room)")
        todo = list(out.block_hashes_to_store)
        if todo:
            where = {k: i for i, k in enumerate(keys)}
            ok = self._run((GPULoadStoreSpec(expand_block_ids([where[k] for k in todo], self.factor)), out.store_spec))
            self.manager.complete_store(todo, success=ok)
            if not ok:
                raise EquivalenceError(f"the GPU -> CPU store of {len(todo)} blocks failed")
        self.settle()

    def settle(self, timeout: float = SETTLE_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        for tier in self.spec.lower_tiers:
            tier.stager.drain()
        for lower in self.manager.lower:
            settle: Callable[[float], bool] | None = getattr(lower, "settle", None)
            if settle is not None:
                settle(max(deadline - time.monotonic(), 0.0))
                continue
            while lower.num_pending() and time.monotonic() < deadline:
                lower.refresh()
                time.sleep(0.01)

    def sources(self, keys: list[BlockHash], timeout: float = SETTLE_SECONDS) -> list[str | None]:
        """Which tier a load would read each block from (``cpu``, a lower tier's name,
        None), once the tiers that learn of blocks by asking (the shared tier) have
        asked: what an engine does when a lookup answers pending."""
        for lower in self.manager.lower:
            expect = getattr(lower, "expect", None)
            if expect is not None and expect(keys):
                lower.wait_probes(timeout)
        where = [self.manager.hit_tier(k) for k in keys]
        return [None if i is None else "cpu" if i < 0 else self.manager.lower[i].name for i in where]

    def load(self, keys: list[BlockHash]) -> bool:
        """Load the blocks of ``keys`` into the head of the "GPU" tensors (one job, as an
        engine loads a request's hits); False when the job failed or some block was not
        found."""
        found = self.manager.lookup(keys)
        if not found:
            return False
        spec = self.manager.prepare_load(keys[:found])
        ok = False
        try:
            ok = self._run((spec, GPULoadStoreSpec(expand_block_ids(np.arange(found), self.factor))))
        finally:
            self.manager.complete_load(keys[:found], success=ok)
        return ok and found == len(keys)

    def namespace_dir(self, tier_name: str) -> Path:
        """The namespace directory of this engine's disk tier ``tier_name``."""
        tier = next(t for t in self.spec.lower_tiers if t.name == tier_name)
        return Path(tier.settings.path) / tier.ctx.fingerprint.namespace_id

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        if self.manager is not None:
            self.manager.shutdown()
            self.manager = None
        self.spec.close()


def damage_block(namespace_dir: Path, block_hash: BlockHash) -> None:
    """Flip one byte in the middle of rank 0's copy of ``block_hash`` in a closed disk
    namespace, past the index and its checksum: what a failing drive does."""
    store = DiskStore.open_readonly(namespace_dir)
    try:
        entry = store.entry(block_hash)
        if entry is None:
            raise EquivalenceError(f"block {block_hash.hex()[:16]} is not in {namespace_dir}: nothing to damage")
        offset = entry.slot * store.slot_size + store.block_bytes // 2
        slab = store.namespace.slab_path(0)
    finally:
        store.close()
    with open(slab, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        os.fsync(f.fileno())


@dataclass
class CaseResult:
    """One case for one model: ``case`` (``computed``, ``cpu``, ``tier``, ``warmup`` or
    ``recompute``), ``tier`` (the tier the prefix came from: ``none``, ``cpu``, a lower
    tier's name), the ``comparison`` with the cold output, whether the K/V continued
    from were the model's bytes (``kv_equal``), the blocks per source tier (None:
    nowhere), whether the load failed (it must in the recompute case, and only there),
    and the seconds of the case and of its load. ``error``: why the case could not run
    (a tier that could not be opened, stored or served nothing, a failed load); then
    ``comparison`` is None."""

    case: str
    tier: str
    model: str
    blocks: int = 0
    comparison: Comparison | None = None
    kv_equal: bool | None = None
    sources: dict[str, int] = field(default_factory=dict)
    load_failed: bool = False
    seconds: float = 0.0
    load_seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        ok = self.error is None and self.comparison is not None and self.comparison.ok
        return ok and self.load_failed == (self.case == "recompute")


def engine_config(settings: TieredConfig, model: TinyModel, tiers: Sequence[TierEntry], blocks: int) -> TieredConfig:
    """The config of one engine of this check: ``tiers`` below a CPU tier of twice the
    prefix, the model's identity (its weights digest included, so no other weights'
    blocks are ever read as these), every block stored everywhere and every hit loaded,
    and the block movers of ``settings`` (``CARRIED_KEYS``)."""
    carried = {k: v for k, v in settings.to_dict().items() if k in CARRIED_KEYS}
    block_tokens = settings.block_size or GPU_BLOCK_SIZE
    g = model.engine.geometry
    block_bytes = 2 * g.num_layers * block_tokens * g.num_kv_heads * g.head_dim * model.dtype.itemsize
    cfg = TieredConfig.from_dict(
        {
            **carried,
            "cpu_bytes": f"{2 * blocks * block_bytes}B",
            "block_size": block_tokens,
            "model_id": model.model_id,
            "model_path": str(model.path),
            "write_policy": "write_through",
            "cost_aware": False,
        }
    )
    return dataclasses.replace(cfg, tiers=tuple(write_through(t) for t in tiers))


def write_through(entry: TierEntry) -> TierEntry:
    """``entry`` writing every stored block (a tier's own ``write_policy`` setting)."""
    settings = entry.settings
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        if any(f.name == "write_policy" for f in dataclasses.fields(settings)):
            return dataclasses.replace(entry, settings=dataclasses.replace(settings, write_policy="write_through"))
    return entry


class Cases:
    """The cases for one model (module docstring): each method fills a ``CaseResult``
    and returns the K/V to continue from."""

    def __init__(self, model: TinyModel, settings: TieredConfig, device: str = "cpu", seed: int = 0):
        self.model, self.settings, self.device = model, settings, device
        self.tokens = prompt_tokens(model, seed)
        block_tokens = settings.block_size or GPU_BLOCK_SIZE
        if PREFIX_TOKENS % block_tokens:
            raise EquivalenceError(f"block_size {block_tokens}: expected a divisor of {PREFIX_TOKENS} tokens")
        self.blocks = PREFIX_TOKENS // block_tokens
        self.prefix = self.tokens[:PREFIX_TOKENS]
        self.cold = model.greedy(self.tokens)
        self.kv = model.prefix_kv(self.prefix)

    def run(self, case: str, tier: str, fill: Callable[[CaseResult], KV]) -> CaseResult:
        """One case, timed; whatever it raises is its ``error`` (the operator's check
        reports it on its line, never as a traceback)."""
        result = CaseResult(case, tier, self.model.shape.name, self.blocks)
        t0 = time.perf_counter()
        try:
            kv = fill(result)
            result.kv_equal = kv_equal(kv, self.kv)
            result.comparison = compare(self.cold, self.model.greedy(self.tokens, kv), self.model.dtype)
        except Exception as e:  # whatever a tier raises, it is this case's outcome
            result.error = str(e) if isinstance(e, EquivalenceError) else f"{type(e).__name__}: {e}"
        result.seconds = time.perf_counter() - t0
        return result

    def _engine(self, tiers: Sequence[TierEntry]) -> Engine:
        return Engine(
            engine_config(self.settings, self.model, tiers, self.blocks), self.model, self.blocks, self.device
        )

    def _load(self, engine: Engine, result: CaseResult, expect_from: str) -> None:
        keys = engine.keys(self.prefix)
        sources = engine.sources(keys)
        for name in sources:
            result.sources[str(name)] = result.sources.get(str(name), 0) + 1
        if result.case != "recompute" and all(s is None for s in sources):
            raise EquivalenceError(
                f"the {expect_from} tier served none of the prefix's {len(keys)} blocks stored in it "
                f"(not reachable, or it dropped them)"
            )
        if any(s != expect_from for s in sources):
            raise EquivalenceError(
                f"the {expect_from} tier was to serve all {len(keys)} blocks of the prefix, "
                f"but they would come from {result.sources}"
            )
        engine.zero()
        t0 = time.perf_counter()
        result.load_failed = not engine.load(keys)
        result.load_seconds = time.perf_counter() - t0
        if result.load_failed and result.case != "recompute":
            raise EquivalenceError(f"the load of {len(keys)} blocks from the {expect_from} tier failed")

    def cpu(self, result: CaseResult) -> KV:
        with self._engine(()) as engine:
            engine.write(self.kv, self.blocks)
            engine.store(engine.keys(self.prefix))
            self._load(engine, result, "cpu")
            return engine.read(self.blocks)

    def tier(self, result: CaseResult, entry: TierEntry) -> KV:
        """Stored by one engine, loaded by the next, whose CPU tier never held the blocks."""
        with self._engine([entry]) as engine:
            engine.write(self.kv, self.blocks)
            engine.store(engine.keys(self.prefix))
        with self._engine([entry]) as engine:
            self._load(engine, result, entry.name)
            return engine.read(self.blocks)

    def warmup(self, result: CaseResult, directory: Path, like: TierEntry | None = None) -> KV:
        """``tiered_kv.ops.warmup`` writes the prefix to a disk tier in ``directory``
        (with the settings of disk tier ``like``, if given); an engine on that tier loads it."""
        entry = TierEntry.parse({"type": "disk", "path": str(directory), "bytes": "16MiB"}, "warmup")
        if like is not None:
            entry = dataclasses.replace(like, settings=dataclasses.replace(like.settings, path=str(directory)))
        config = engine_config(self.settings, self.model, [entry], self.blocks)
        report = warmup(
            [self.prefix], self.model.engine, config, gpu_block_size=GPU_BLOCK_SIZE, layout="kv-first", env={}
        )
        if report.blocks_written != self.blocks:
            raise EquivalenceError(f"the warm-up wrote {report.blocks_written} of the prefix's {self.blocks} blocks")
        with self._engine([entry]) as engine:
            self._load(engine, result, entry.name)
            return engine.read(self.blocks)

    def recompute(self, result: CaseResult, entry: TierEntry) -> KV:
        """A block in the middle of the prefix damaged on disk tier ``entry`` (stored
        there first unless ``tier`` did): the load fails, and the engine recomputes every
        block of the failed job over what the load left in the "GPU" tensors."""
        with self._engine([entry]) as engine:
            keys = engine.keys(self.prefix)
            if engine.sources(keys) != [entry.name] * len(keys):
                engine.write(self.kv, self.blocks)
                engine.store(keys)
            namespace = engine.namespace_dir(entry.name)
        damage_block(namespace, keys[len(keys) // 2])
        with self._engine([entry]) as engine:
            self._load(engine, result, entry.name)
            if result.load_failed:
                engine.write(self.model.prefix_kv(self.prefix), self.blocks)
            # A load that passed served the damaged block: continued from, so the line shows what it costs.
            return engine.read(self.blocks)


def run_equivalence(
    model: TinyModel,
    settings: TieredConfig,
    *,
    tiers: Sequence[TierEntry] | None = None,
    warmup_dir: Path | None = None,
    recompute: bool = True,
    device: str = "cpu",
    seed: int = 0,
) -> Iterator[CaseResult]:
    """Every case for ``model`` (module docstring), in order: computed, cpu, each of
    ``tiers`` (default: ``settings.tier_entries()``), warmup (into ``warmup_dir``; None
    leaves it out; with the first disk tier's settings), and recompute on the first disk
    tier (with ``recompute``)."""
    tiers = list(settings.tier_entries() if tiers is None else tiers)
    disk = next((e for e in tiers if e.type_name == "disk" and e.module_path is None), None)
    cases = Cases(model, settings, device, seed)
    yield cases.run("computed", "none", lambda result: cases.kv)
    yield cases.run("cpu", "cpu", cases.cpu)
    for entry in tiers:
        yield cases.run("tier", entry.name, functools.partial(cases.tier, entry=entry))
    if warmup_dir is not None:
        warm = functools.partial(cases.warmup, directory=warmup_dir, like=disk)
        yield cases.run("warmup", "disk" if disk is None else disk.name, warm)
    if recompute and disk is not None:
        yield cases.run("recompute", disk.name, functools.partial(cases.recompute, entry=disk))
