"""Drive vLLM 0.33's real scheduler and OffloadingConnector on a CPU-only machine.

The test process plays both of vLLM's processes. Scheduler side: a real
``vllm.v1.core.sched.scheduler.Scheduler`` that builds its own scheduler-role
``OffloadingConnector``, hence the spec's real ``OffloadingManager``. Worker side, one of:

* ``worker="ack"`` (default): no bytes move; every load/store job the scheduler emits
  is reported complete in the step that emitted it. For scheduler-side behaviour
  (lookups, hits, evictions, stats, events) with any spec, including vLLM's own
  ``CPUOffloadingSpec``, whose worker refuses to start without CUDA.
* ``worker="real"``: a worker-role ``OffloadingConnector`` built from the same
  kv-transfer config; per-layer KV tensors are allocated on CPU and registered, and
  each step runs the worker hooks in vLLM's order (handle_preemptions, start_load_kv,
  forward, wait_for_save, get_finished, build_connector_worker_meta). The spec's
  ``get_worker`` must work on CPU. Jobs finish whenever the spec's worker says so;
  ``run`` keeps stepping until the connector has nothing in flight.

No model runs. The fake forward pass samples ``SAMPLED_TOKEN_ID`` for every request
whose tokens are all computed, and (real mode) writes into each GPU block it completes
bytes derived from that block's prefix hash, as a model would: same prefix, same KV.
``kv_matches`` then tells whether a request's blocks hold the bytes its hashes call
for, whether they were computed, found in the GPU prefix cache or loaded by the
connector.

The model config comes from a local directory with a ``config.json`` (the hub is
unreachable); ``write_model_config`` writes a small Llama-shaped one.

I/O: writes the model directory it is given; tiering specs map a shared-memory file
under /dev/shm. Importing this module imports vLLM (~10 s on 2 cores).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import prometheus_client
import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import OffloadingManager, OffloadingSpec, OffloadingWorker, TransferResult
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tiered_kv.abstract import Closing

#: The token every fake forward pass samples; not the EOS id of ``write_model_config``.
SAMPLED_TOKEN_ID = 7

_DTYPES = {"float16", "bfloat16", "float32"}


def write_model_config(
    directory: str | Path,
    *,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_attention_heads: int = 4,
    dtype: str = "float16",
    max_position_embeddings: int = 4096,
) -> Path:
    """Write a small Llama ``config.json`` into ``directory``; return the directory.

    vLLM reads only the geometry (layers, KV heads, head size, dtype) from it; no
    weights or tokenizer are needed because no model is loaded.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": head_dim * num_attention_heads,
        "intermediate_size": 4 * head_dim * num_attention_heads,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers,
        "head_dim": head_dim,
        "vocab_size": 1000,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


#: ``VllmHarness.build`` keywords for our connector with vLLM's recompute policy: a failed
#: load is recomputed, so a shared-tier hit is downloaded once, by the worker.
ONE_READ = {
    "kv_connector": "TieredOffloadingConnector",
    "kv_connector_module_path": "tiered_kv.integrations.vllm.connector",
    "kv_load_failure_policy": "recompute",
}

#: Prefill tokens/s our spec is told in the harness: the toy models' prefill on a CPU is
#: slow, so a load from any tier here is faster than recomputing (tests of the
#: load-versus-recompute decision set their own).
HARNESS_PREFILL_TOKENS_PER_S = 200.0


def make_vllm_config(
    model_dir: str | Path,
    extra_config: dict[str, Any],
    *,
    block_size: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 2048,
    max_num_seqs: int = 16,
    prefix_caching_hash_algo: str = "sha256",
    engine_id: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    kv_cache_layout: str | None = None,
    kv_connector: str = "OffloadingConnector",
    kv_connector_module_path: str | None = None,
    kv_load_failure_policy: str = "fail",
    load_format: str = "auto",
) -> VllmConfig:
    """A CPU ``VllmConfig`` whose kv-transfer config selects the OffloadingConnector
    with ``extra_config`` as ``kv_connector_extra_config``. Prefix caching and chunked
    prefill are on, as in a default vLLM server. ``model_kwargs`` go to ``ModelConfig``
    (vLLM's ``--revision``, ``--quantization``...). ``kv_cache_layout``: the layout
    vLLM's engine core resolves (``LBNHC`` with FlashAttention), None: unresolved.
    ``kv_connector`` (with its ``kv_connector_module_path``) and ``kv_load_failure_policy``
    are vLLM's kv-transfer settings of those names, ``load_format`` its
    ``--load-format``. Our spec judges loads against
    ``HARNESS_PREFILL_TOKENS_PER_S`` unless ``extra_config`` names a prefill rate."""
    extra_config = dict(extra_config)
    if extra_config.get("spec_name") == "TieredOffloadingSpec":
        extra_config.setdefault("prefill_tokens_per_s", HARNESS_PREFILL_TOKENS_PER_S)
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            seed=0,
            max_model_len=max_model_len,
            **(model_kwargs or {}),
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            cache_dtype="auto",
            enable_prefix_caching=True,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=kv_connector,
            kv_connector_module_path=kv_connector_module_path,
            kv_load_failure_policy=kv_load_failure_policy,
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra_config),
            engine_id=engine_id or f"harness-{uuid.uuid4().hex[:12]}",
        ),
        # Without an accelerator vLLM cannot infer a device type; name one.
        device_config=DeviceConfig(device="cpu"),
        load_config=LoadConfig(load_format=load_format),
    )
    config.cache_config.kv_cache_layout = kv_cache_layout  # as the engine core records it
    return config


def make_kv_cache_config(vllm_config: VllmConfig, num_gpu_blocks: int) -> KVCacheConfig:
    """One full-attention group over every layer, ``num_gpu_blocks`` blocks, layers
    outermost in one backing allocation (the layout vLLM 0.33's planner gives a plain
    decoder on one GPU: ``KVCacheTensor.size`` is the whole allocation, so
    ``worker_kv_bytes_per_block`` is every layer's page)."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
    )
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(model_config.get_num_layers(parallel_config))]
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * num_gpu_blocks * len(layer_names),
            layers=layer_names,
            layer_stride=page * num_gpu_blocks,
            block_stride=page,
        )
    ]
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    return KVCacheConfig(
        num_blocks=num_gpu_blocks, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)]
    )


@dataclass
class StepRecord:
    """What one engine step did, seen at the connector boundary."""

    scheduler_output: SchedulerOutput
    #: job id -> request id of the load / store jobs the scheduler emitted this step.
    load_jobs: dict[int, str]
    store_jobs: dict[int, str]
    #: requests the scheduler reported finished this step.
    finished_req_ids: set[str]
    #: requests whose async load the worker reported done this step.
    finished_recving: set[str]
    #: the connector stats payload this step sent towards Prometheus (scheduler and
    #: worker stats merged, ``OffloadingConnectorStats.data``), or None.
    kv_connector_stats: dict[str, Any] | None = None


@dataclass(frozen=True)
class PrefixHit:
    """Where a request's prompt came from when the scheduler first admitted it."""

    num_prompt_tokens: int
    #: tokens found in the GPU prefix cache
    local: int
    #: tokens the connector supplied (loads from the offloading tiers)
    external: int


@dataclass
class VllmHarness(Closing):
    """A live vLLM scheduler and OffloadingConnector; see the module docstring.
    ``with VllmHarness.build(...) as h:`` shuts it down at the end."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler: Scheduler
    worker: Literal["ack", "real"]
    worker_connector: OffloadingConnector | None = None
    #: layer name -> KV tensor (num_blocks, kv_heads, block_size, 2 * head_dim) (real mode)
    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    #: request id -> its prefix hit, recorded on the step that admitted it.
    prefix_hits: dict[str, PrefixHit] = field(default_factory=dict)
    _req_counter: Iterator[int] = field(default_factory=itertools.count)
    #: The fake forward pass takes ``tokens / forward_tokens_per_s`` seconds (a model of
    #: that speed); None: as fast as the machine writes the blocks.
    forward_tokens_per_s: float | None = None

    @classmethod
    def build(
        cls,
        model_dir: str | Path,
        extra_config: dict[str, Any],
        *,
        num_gpu_blocks: int = 64,
        block_size: int = 16,
        worker: Literal["ack", "real"] = "ack",
        forward_tokens_per_s: float | None = None,
        **config_kwargs: Any,
    ) -> "VllmHarness":
        """Build the scheduler and, for ``worker="real"``, the worker connector.

        ``extra_config`` is vLLM's ``kv_connector_extra_config``: ``spec_name`` +
        ``spec_module_path`` select an out-of-tree spec; without them vLLM uses its
        ``CPUOffloadingSpec`` (which needs ``cpu_bytes_to_use``). ``block_size`` is the
        GPU block size in tokens; the offloaded block size is ``extra_config
        ["block_size"]`` (a multiple of it) or ``blocks_per_chunk``. ``config_kwargs``
        go to ``make_vllm_config``; ``forward_tokens_per_s``: the fake model's speed.
        """
        if worker not in ("ack", "real"):
            raise ValueError(f"worker must be 'ack' or 'real', got {worker!r}")
        vllm_config = make_vllm_config(model_dir, extra_config, block_size=block_size, **config_kwargs)
        kv_cache_config = make_kv_cache_config(vllm_config, num_gpu_blocks)
        # As vLLM's EngineCore builds it: no vLLM config is current in the scheduler process.
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            log_stats=True,
        )
        harness = cls(vllm_config, kv_cache_config, scheduler, worker, forward_tokens_per_s=forward_tokens_per_s)
        if worker == "real":
            harness._build_worker()
        return harness

    def _build_worker(self) -> None:
        group = self.kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        assert isinstance(spec, FullAttentionSpec)
        for name in group.layer_names:
            # vLLM 0.33's standard layout: num_blocks first, then heads, tokens, K|V.
            self.kv_caches[name] = torch.zeros(
                (
                    self.kv_cache_config.num_blocks,
                    spec.num_kv_heads,
                    spec.block_size,
                    spec.head_size + spec.head_size_v,
                ),
                dtype=spec.dtype,
            )
        with set_current_vllm_config(self.vllm_config):
            kv = self.vllm_config.kv_transfer_config
            connector_cls = OffloadingConnector
            if kv.kv_connector_module_path:  # an out-of-tree subclass, as vLLM's factory loads it
                connector_cls = getattr(importlib.import_module(kv.kv_connector_module_path), kv.kv_connector)
            self.worker_connector = connector_cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.worker_connector.register_kv_caches(self.kv_caches)

    # -- what tests look at -----------------------------------------------------------

    @property
    def connector(self) -> OffloadingConnector:
        """The scheduler-role connector the Scheduler built."""
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        return connector

    @property
    def manager(self) -> OffloadingManager:
        """The spec's manager, as vLLM's scheduler-side connector holds it."""
        return self.connector.scheduler.manager

    @property
    def worker_spec(self) -> OffloadingSpec:
        """The spec instance inside the worker connector (real mode)."""
        assert self.worker_connector is not None, "worker_spec needs worker='real'"
        assert self.worker_connector.connector_worker is not None
        return self.worker_connector.connector_worker.spec

    @property
    def block_size(self) -> int:
        return self.vllm_config.cache_config.block_size

    def block_ids(self, req_id: str) -> list[int]:
        """GPU block ids the KV cache manager gives a request that holds blocks."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def gpu_block_bytes(self, block_id: int) -> bytes:
        """Every layer's bytes of one GPU block, in layer order (real mode)."""
        return b"".join(t[block_id].contiguous().view(torch.uint8).numpy().tobytes() for t in self.kv_caches.values())

    def expected_block_bytes(self, block_hash: bytes) -> bytes:
        """The bytes the fake forward pass writes for a full block with this hash."""
        saved = {name: t[0].clone() for name, t in self.kv_caches.items()}
        try:
            self._write_block(0, block_hash)
            return self.gpu_block_bytes(0)
        finally:
            for name, t in self.kv_caches.items():
                t[0].copy_(saved[name])

    def kv_matches(self, req_id: str) -> list[bool]:
        """Per full block of a running request: do its GPU bytes match its hash?"""
        request = self.scheduler.requests[req_id]
        ids = self.block_ids(req_id)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(ids))
        return [
            self.gpu_block_bytes(ids[i]) == self.expected_block_bytes(bytes(request.block_hashes[i]))
            for i in range(num_full)
        ]

    # -- driving ----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        max_tokens: int = 1,
        req_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
        **request_fields: Any,
    ) -> str:
        """Queue a request (of the tenant ``cache_salt``, where given); it finishes after
        ``max_tokens`` sampled tokens. ``request_fields``: more of vLLM's ``Request``
        (``lora_request``, ``session_id``...)."""
        req_id = req_id or f"req-{next(self._req_counter)}"
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
        )
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.block_size, hash_fn),
            cache_salt=cache_salt,
            **request_fields,
        )
        self.scheduler.add_request(request)
        return req_id

    def step(self) -> StepRecord:
        """One engine step: schedule, run the worker side, feed the outputs back."""
        # The scheduler's calls run with no vLLM config current, as in vLLM's engine core;
        # the worker's with it, as vLLM's workers run.
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        self._record_prefix_hits()
        with set_current_vllm_config(self.vllm_config):
            kv_output = self._run_real_worker(output, meta) if self.worker == "real" else self._ack_worker(meta)
        record = StepRecord(
            scheduler_output=output,
            load_jobs={jid: job.req_id for jid, job in meta.load_jobs.items()},
            store_jobs={jid: job.req_id for jid, job in meta.store_jobs.items()},
            finished_req_ids=set(output.finished_req_ids),
            finished_recving=set(kv_output.finished_recving or ()),
        )
        outputs = self.scheduler.update_from_output(output, self._model_output(output, kv_output))
        for engine_output in outputs.values():
            if engine_output.scheduler_stats is not None:
                record.kv_connector_stats = engine_output.scheduler_stats.kv_connector_stats
        self.steps.append(record)
        return record

    def run(self, max_steps: int = 200, timeout: float = 60.0) -> list[StepRecord]:
        """Step until no request is left and the connector has nothing in flight.

        Work that finishes on background threads (disk verification, disk writes) is
        given wall time too: after ``max_steps`` steps it keeps stepping, yielding the
        CPU between steps, until ``timeout`` seconds have passed, as a real engine's
        idle loop would on a busy machine."""
        records = []
        deadline = time.monotonic() + timeout
        while True:
            if not self.scheduler.has_requests() and not self.connector.has_pending_push_work():
                return records
            if len(records) >= max_steps:
                if time.monotonic() > deadline:
                    raise AssertionError(f"engine still busy after {len(records)} steps and {timeout} s")
                time.sleep(0.005)
            records.append(self.step())

    def wait_background(self, timeout: float = 30.0) -> None:
        """Let the scheduler's background work finish: each lower tier's check (disk
        read-backs, shared-tier verifications) and the shared tier's existence probes.
        Nothing to wait for under a manager without them."""
        manager = self.manager
        tier = getattr(manager, "tier", None)
        remote = tier("remote") if tier is not None else None
        if remote is not None:
            remote.wait_probes(timeout)
        for check in getattr(manager, "checks", ()):
            if getattr(check, "verifier", None) is not None:
                check.verifier.wait(timeout)

    def step_until(self, done: Callable[[], bool], max_steps: int = 3000, timeout: float = 30.0) -> None:
        """Step until ``done()``, letting the background work finish between steps."""
        for _ in range(max_steps):
            if done():
                return
            self.step()
            self.wait_background(timeout)
            time.sleep(0.0005)
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def settle(self, max_steps: int = 3000, timeout: float = 30.0) -> None:
        """Step until no request is left and the connector has nothing in flight."""
        self.step_until(
            lambda: not self.scheduler.has_requests() and not self.connector.has_pending_push_work(), max_steps, timeout
        )

    def admit(
        self, prompt_token_ids: list[int], max_tokens: int = 3, timeout: float = 30.0, **request_fields: Any
    ) -> str:
        """Add a request (``request_fields`` as for ``add_request``) and step until its
        first token: its loads have landed and it still holds its blocks, so
        ``kv_matches`` can look at them."""
        req_id = self.add_request(prompt_token_ids, max_tokens=max_tokens, **request_fields)
        self.step_until(lambda: self.scheduler.requests[req_id].num_output_tokens >= 1, timeout=timeout)
        return req_id

    def serve(self, prompt_token_ids: list[int], max_tokens: int = 1) -> PrefixHit:
        """Run one request to completion (and its stores to the end); its prefix hit."""
        req_id = self.add_request(prompt_token_ids, max_tokens)
        self.run()
        return self.prefix_hits[req_id]

    def reset_gpu_prefix_cache(self) -> None:
        """Forget the GPU prefix cache, so the next lookups must go to the connector."""
        if not self.scheduler.reset_prefix_cache():
            raise AssertionError("GPU prefix cache reset refused: a request holds blocks")

    def stats(self, since_step: int = 0) -> dict[str, float]:
        """The connector stats of steps ``since_step`` onwards, merged and reduced to
        flat numbers the way vLLM's log line does (``OffloadingConnectorStats.reduce``:
        counters summed, gauges latest, histograms as ``_count``/``_sum``)."""
        merged = OffloadingConnectorStats()
        for record in self.steps[since_step:]:
            if record.kv_connector_stats is not None:
                merged.aggregate(OffloadingConnectorStats(data=record.kv_connector_stats))
        return merged.reduce()

    def publish_metrics(self, registry: CollectorRegistry | None = None) -> CollectorRegistry:
        """Feed every step's stats payload through vLLM's own Prometheus side
        (``OffloadPromMetrics``, which registers the spec's
        ``build_metric_definitions`` and asserts that every reported metric is among
        them) into ``registry`` (a fresh one by default); return the registry."""
        registry = registry or CollectorRegistry()
        metric_types = {
            cls: functools.partial(cls, registry=registry)
            for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
        }
        prom = OffloadPromMetrics(self.vllm_config, metric_types, ["engine"], {0: ["0"]})
        for record in self.steps:
            if record.kv_connector_stats is not None:
                prom.observe(record.kv_connector_stats, engine_idx=0)
        return registry

    def shutdown(self) -> None:
        """Shut the worker connector, then the scheduler (and its connector) down."""
        if self.worker_connector is not None:
            self.worker_connector.shutdown()
        self.scheduler.shutdown()

    # -- internals --------------------------------------------------------------------

    def _record_prefix_hits(self) -> None:
        # The scheduler fills prefill_stats when it admits a request and hands them to
        # the output processor in update_from_output, so they are read in between.
        for req_id, request in self.scheduler.requests.items():
            stats = request.prefill_stats
            if req_id in self.prefix_hits or stats is None or not stats.num_prompt_tokens:
                continue
            self.prefix_hits[req_id] = PrefixHit(
                stats.num_prompt_tokens, stats.num_local_cached_tokens, stats.num_external_cached_tokens
            )

    def _ack_worker(self, meta: OffloadingConnectorMetadata) -> KVConnectorOutput:
        worker_meta = OffloadingWorkerMetadata()
        for job_id in (*meta.load_jobs, *meta.store_jobs):
            worker_meta.mark_completed(job_id)
        # Sync loads finish inside the step; only async ones are reported as received.
        recving = {job.req_id for job in meta.load_jobs.values() if not job.sync}
        return KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=worker_meta if worker_meta.completed_jobs else None,
        )

    def _run_real_worker(self, output: SchedulerOutput, meta: OffloadingConnectorMetadata) -> KVConnectorOutput:
        worker = self.worker_connector
        assert worker is not None
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
        self._fake_forward(output)
        worker.wait_for_save()  # in every step, as vLLM's model runner (a step of no tokens may store)
        _, recving = worker.get_finished(output.finished_req_ids)
        # vLLM's model runner asks for failed loads right after get_finished.
        invalid = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()  # then, as vLLM's model runner asks
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        return KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=worker_meta,
            invalid_block_ids=invalid,
            kv_connector_stats=stats,
        )

    def _fake_forward(self, output: SchedulerOutput) -> None:
        if self.forward_tokens_per_s:
            time.sleep(output.total_num_scheduled_tokens / self.forward_tokens_per_s)
        # schedule() has already advanced num_computed_tokens past this step's tokens.
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens
            first = (end - num_tokens) // self.block_size
            last = min(end // self.block_size, len(request.block_hashes))
            ids = self.block_ids(req_id)
            for i in range(first, last):
                self._write_block(ids[i], bytes(request.block_hashes[i]))

    def _write_block(self, block_id: int, block_hash: bytes) -> None:
        gen = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little") >> 1)
        for tensor in self.kv_caches.values():
            raw = tensor[block_id].view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))

    def _model_output(self, output: SchedulerOutput, kv_output: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            # Only a request with every token computed samples (not a prefill chunk).
            sampled.append([SAMPLED_TOKEN_ID] if request.num_computed_tokens >= request.num_tokens else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )


def hash_blocks(
    token_ids: list[int], block_size: int, algo: str = "sha256", cache_salt: str | None = None
) -> list[bytes]:
    """vLLM's prefix block hashes of ``token_ids`` (full blocks only) for the tenant
    ``cache_salt``, the values the connector turns into offload keys with
    ``make_offload_key(hash, group_idx)``."""
    hash_fn: Callable[[Any], bytes] = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    request = Request(
        request_id="hash-probe",
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, hash_fn),
        cache_salt=cache_salt,
    )
    return [bytes(h) for h in request.block_hashes]


class ChunkCopyWorker(OffloadingWorker):
    """A vLLM worker that copies bytes synchronously between CPU tensors standing in for
    the GPU (``gpu``, one per canonical tensor, ``page`` bytes per block) and host rows
    (``rows``: row c of ``rows[t]`` is chunk c of tensor t; GPU block j of a chunk sits at
    byte offset j * page), for tests of offloading managers without CUDA (vLLM's own
    worker needs it). Subclasses set those attributes and ``bpc`` (blocks per chunk);
    ``chunk_ids(spec)`` says where a medium's spec keeps its chunk ids."""

    gpu: list[torch.Tensor]
    page: list[int]
    rows: list[torch.Tensor]
    bpc: int

    @staticmethod
    def chunk_ids(spec):
        return spec.block_ids

    def _copy(self, gpu_spec, chunk_ids, to_host: bool) -> None:
        start = 0
        for size, first_logical in zip(gpu_spec.group_sizes, gpu_spec.block_indices):
            ids = gpu_spec.block_ids[start : start + size]
            start += size
            for i, block in enumerate(ids):
                logical = first_logical + i
                chunk = chunk_ids[logical // self.bpc - first_logical // self.bpc]
                sub = logical % self.bpc
                for gpu, rows, page in zip(self.gpu, self.rows, self.page):
                    cell = rows[chunk, sub * page : (sub + 1) * page]
                    if to_host:
                        cell.copy_(gpu[block])
                    else:
                        gpu[block].copy_(cell)

    def submit_store(self, job_id, src_spec, dst_spec):
        self._copy(src_spec, self.chunk_ids(dst_spec), to_host=True)
        self.done.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        self._copy(dst_spec, self.chunk_ids(src_spec), to_host=False)
        self.done.append(TransferResult(job_id, True))
        return True

    def get_finished(self):
        done, self.done = self.done, []
        return done

    def wait(self, job_ids):
        return None
