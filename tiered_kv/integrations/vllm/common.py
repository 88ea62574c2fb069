"""What the scheduler-side and worker-side halves of the vLLM adapter share: the spec that
carries our plans inside vLLM's job metadata, a request's session, the metric names, the
config-info labels, the prefix-hash check, and the model identity and attention backend that go into the
disk namespace.

Imported in the scheduler, the workers and vLLM's API server (which only reads the
metric definitions). No I/O except ``vllm_model_identity``, which reads the weights
digest of the model directory vLLM loads (``tiered_kv.model_identity``: a bounded
sample of each file) in the scheduler and in every worker, each arriving at the same
identity from the same vLLM config and files. ``vllm_attention_backend`` asks vLLM's
attention selector, which on NVIDIA hosts queries the GPU through NVML.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from types import FrameType
from dataclasses import dataclass
from typing import Any

import xxhash
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfo,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)
from vllm.v1.kv_offload.base import LoadStoreSpec as VllmLoadStoreSpec

from tiered_kv.abstract import LoadStoreSpec
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.config_file import PLAIN_LOAD_FORMATS
from tiered_kv.metrics import (
    PENDING_WRITES,
    PROJECT_METRICS,
    TIER_BLOCKS,
    TIER_CAPACITY_BLOCKS,
    TIER_COUNTERS,
    TIER_HELD_BACK_BLOCKS,
    TIER_USED_BLOCKS,
    TIER_VERIFICATIONS,
    TIERS,
    WORKER_JOB_FAILURES,
    CounterValue,
    MetricDef,
)
from tiered_kv.model_identity import resolve_model_dir, weights_digest

logger = logging.getLogger(__name__)


class TieredJobSpec(VllmLoadStoreSpec):
    """Our side of a vLLM transfer job: the composite manager's spec (``inner``: a
    ``TieredStoreSpec`` for a store, a ``CPULoadStoreSpec`` or ``TieredLoadSpec`` for a
    load), in chunk units. Travels from the scheduler to every worker in vLLM's
    connector metadata, so it is plain picklable data."""

    def __init__(self, inner: LoadStoreSpec):
        self.inner = inner

    def __repr__(self) -> str:
        return f"TieredJobSpec({self.inner!r})"


@dataclass(frozen=True)
class CpuOnly:
    """In a request's ``ReqContext`` state (set by ``TieredOffloadingConnector``, which sees
    the ``Request``): its KV is kept and served by the CPU tier alone, never written to,
    read from or prefetched out of a lower tier. A LoRA adapter's requests: vLLM keys their
    blocks by the adapter's name and path, not its weights, and the disk and shared tiers
    outlive a process (and are read by other processes) whose adapter files at that path
    may differ; the CPU tier lives no longer than the adapter this process loaded, as
    vLLM's GPU prefix cache."""

    adapter: str


def refuse_lora(what: str, fix: str) -> None:
    """Raise ``ConfigError`` where vLLM serves LoRA adapters (``--enable-lora``) and
    ``what`` cannot tell their requests' blocks apart (``CpuOnly``): it would keep
    them past a restart that replaced an adapter's files, and serve them to its
    requests. ``fix``: how to serve LoRA with it."""
    vc = find_vllm_config()
    if vc is not None and getattr(vc, "lora_config", None) is not None:
        raise ConfigError(
            f"{what} cannot tell LoRA requests' KV from the base model's (--enable-lora): vLLM keys an "
            f"adapter's blocks by its name and path, and this cache outlives a restart that replaces the "
            f"adapter's files there; {fix}"
        )


@dataclass(frozen=True)
class RequestSession:
    """The session a client names a request in: vLLM's ``Request.session_id`` (from the
    ``X-Session-ID`` header, the request body or ``vllm_xargs``), within the request's
    tenant (``cache_salt``), so two tenants' equal ids are two sessions. vLLM 0.33 hands
    an offloading manager only a ``ReqContext``, so the connector, which sees the
    ``Request``, keeps it in the request's ``ReqContext`` state (``set_state``), and the
    manager passes it with the request's loads and stores to session retention
    (``cpu_retention``, a disk tier's ``retention``). ``session_id`` None: the client
    named no session, and the rule finds it by its prefix chain, within the tenant."""

    tenant: str | None
    session_id: str | None

    #: Longer ids and salts are kept as a digest: the rule keeps up to thousands of
    #: sessions, and a client chooses how long its strings are.
    MAX_KEPT = 256

    @classmethod
    def of(cls, request: Any) -> "RequestSession | None":
        """The session of vLLM's ``request``; None where it names neither a session
        nor a tenant."""
        session_id, tenant = getattr(request, "session_id", None), request_tenant(request)
        if not session_id:
            return None if tenant is None else cls(tenant, None)
        return cls(tenant, _kept(str(session_id)))


#: The tenant (``cache_salt``, kept as ``RequestSession`` keeps it) of the request whose
#: ``on_new_request`` runs now: vLLM builds the ``ReqContext`` it hands the manager inside
#: that call, without the tenant, so ``TieredOffloadingConnector`` sets this around it.
#: None under a connector that does not (vLLM's own): then one tenant's names are all's.
REQUEST_TENANT: ContextVar[str | None] = ContextVar("tiered_kv_request_tenant", default=None)


def request_tenant(request: Any) -> str | None:
    """The tenant of vLLM's ``request`` (its ``cache_salt``), or None."""
    tenant = getattr(request, "cache_salt", None)
    return None if tenant is None else _kept(str(tenant))


def _kept(text: str) -> str:
    """``text``, or its digest past ``RequestSession.MAX_KEPT`` characters (and for a text
    that spells a digest, so that it never names another text's scope)."""
    if len(text) <= RequestSession.MAX_KEPT and not text.startswith("sha256:"):
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# Names follow tiered_kv.metrics.PROJECT_METRICS (TIER_BLOCKS, TIER_USED_BLOCKS, the
# capacity, pending-write and job-failure metrics and the rest come from there), so a
# dashboard and its alerts work for the demo and for vLLM alike. Counters gain the
# ``_total`` suffix on the endpoint; the documentation below says what they count here.


def _vllm_metadata(d: MetricDef) -> OffloadingMetricMetadata:
    if d.kind == "histogram":
        return OffloadingHistogramMetadata(documentation=d.documentation, labelnames=d.labelnames, buckets=d.buckets)
    kind = OffloadingCounterMetadata if d.kind == "counter" else OffloadingGaugeMetadata
    return kind(documentation=d.documentation, labelnames=d.labelnames)


def metric_definitions(extra: Sequence[MetricDef] = ()) -> dict[str, OffloadingMetricMetadata]:
    """Every metric the manager reports (vLLM's frontend asserts each reported name was
    declared, with the same label names); ``extra``: those the config's tier types add
    (``tiers.tier_metric_definitions``).

    The scheduler's (the manager's ``get_stats``): per-tier counters in chunks and
    tokens (its bookkeeping), verification timings (its verifiers), and the shared
    tier's request counters and timings of its own store (membership probes,
    verification downloads, the manifest). Each worker's, with ``TieredOffloadingConnector``
    (``TieredVllmWorker.take_stats``, carried by vLLM with the step's output and summed
    over ranks): its transfer jobs and their timings (``TRANSFER_JOBS``,
    ``TRANSFER_SECONDS``) and its own shared-tier store's (its rank's uploads and
    loads); with vLLM's plain connector a worker reports nothing. With several engines
    (data parallel) each engine reports its own."""
    shared = {
        d.name: _vllm_metadata(d) for d in (*PROJECT_METRICS, *extra) if d.name not in (TIER_BLOCKS, TIER_USED_BLOCKS)
    }
    return shared | {
        TIER_BLOCKS: OffloadingCounterMetadata(
            documentation=(
                "Chunks counted per tier and event. Events: "
                + ", ".join(TIER_COUNTERS)
                + f". Tiers: {', '.join(TIERS)}."
            ),
            labelnames=("tier", "event"),
        ),
        TIER_USED_BLOCKS: OffloadingGaugeMetadata(
            documentation="Chunks held per tier (stored, being stored or being promoted).", labelnames=("tier",)
        ),
        TIER_CAPACITY_BLOCKS: OffloadingGaugeMetadata(
            documentation="Chunk slots per tier (per rank: each rank holds its shard of a chunk).", labelnames=("tier",)
        ),
        PENDING_WRITES: OffloadingGaugeMetadata(
            documentation="Chunks queued for a write into a lower tier whose outcome is not known yet.",
            labelnames=("tier",),
        ),
        TIER_HELD_BACK_BLOCKS: OffloadingGaugeMetadata(
            documentation=(
                "Chunk slots of a disk tier neither free nor holding a chunk (counted in used chunks), per reason: "
                "settling (a store given up while a rank may still write it, until every rank logged an outcome "
                "there), releasing (a failed store's, until its partial index entry is deleted)."
            ),
            labelnames=("tier", "reason"),
        ),
        TIER_VERIFICATIONS: OffloadingCounterMetadata(
            documentation=(
                "Lower-tier chunks checked before a lookup reported them as hits (the disk "
                "tier reads them back on every rank against their checksums; the shared "
                "tier downloads and verifies every rank's object); outcome ok or failed "
                "(failed chunks are dropped there and recomputed)."
            ),
            labelnames=("tier", "outcome"),
        ),
        WORKER_JOB_FAILURES: OffloadingCounterMetadata(
            documentation=(
                "Worker jobs that failed inside tiered-kv and were reported to vLLM as "
                "done (vLLM cannot take a failure); kind store, promotion or load (a copy "
                "from the CPU tier to the GPU). Their CPU slots are never served."
            ),
            labelnames=("kind",),
        ),
    }


class CounterIncreases:
    """Turns monotonic totals into what a vLLM stats payload carries: each counter's
    increase since the last report (one object per reporting process)."""

    def __init__(self) -> None:
        self._reported: dict[tuple[str, tuple[str, ...]], float] = {}

    def report(self, stats: OffloadingConnectorStats, totals: Iterable[CounterValue]) -> None:
        """Add to ``stats`` each of ``totals`` that grew since the last report."""
        for name, labels, total in totals:
            delta = total - self._reported.get((name, labels), 0)
            if delta > 0:
                stats.increase_counter(name, delta, labels)
                self._reported[name, labels] = total


@dataclass(frozen=True)
class TieredOffloadingInfo(ConfigInfo):
    """Static facts of the hierarchy published on ``vllm:kv_offload_config_info`` (per
    rank): the sample labelled ``tier="cpu"``; each lower tier adds its own sample, with
    its own facts (``TierSpec.config_info``)."""

    tiered_cpu_slots: int
    tiered_cpu_bytes_per_rank: int
    tiered_write_policy: str
    tiered_tokens_per_chunk: int
    tiered_bytes_per_chunk_per_rank: int


# ---------------------------------------------------------------- prefix hashes

_NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


def vllm_hash_algorithm() -> str | None:
    """vLLM's ``--prefix-caching-hash-algo`` where the engine's config is found
    (``find_vllm_config``: in the scheduler too), else None."""
    cache = getattr(find_vllm_config(), "cache_config", None)
    algo = getattr(cache, "prefix_caching_hash_algo", None)
    return str(algo) if algo else None


def check_hash_algorithm(cfg: TieredConfig, *, fix: str, unseeded: str) -> None:
    """Our ``hash_algorithm`` is part of the namespace, so it is never guessed (every
    process, and every start of the engine, must compute the same namespace); it must
    match vLLM's where vLLM's config is visible. Raises ``ConfigError`` ending with
    ``fix`` (where to set it); warns, saying what is lost (``unseeded``), when the hash
    is seeded per process."""
    engine_algo = vllm_hash_algorithm()
    if engine_algo is not None and engine_algo != cfg.hash_algorithm:
        raise ConfigError(
            f"hash_algorithm: {cfg.hash_algorithm!r} does not match vLLM's "
            f'--prefix-caching-hash-algo {engine_algo!r}; set "hash_algorithm": '
            f'"{engine_algo}" {fix}'
        )
    if cfg.hash_algorithm in _NON_CRYPTO_HASHES and not os.environ.get("PYTHONHASHSEED"):
        logger.warning(
            "prefix hashes use %s with a random per-process seed (PYTHONHASHSEED is "
            "unset): %s; set PYTHONHASHSEED or use sha256",
            cfg.hash_algorithm,
            unseeded,
        )


# ---------------------------------------------------------------- model identity


def find_vllm_config(max_depth: int = 32) -> Any | None:
    """The engine's ``VllmConfig``, or None where there is none (a spec built by hand).

    vLLM hands an offloading spec only its ``OffloadingConfig``, which names the model but
    not its revision, tokenizer or quantization. Workers build the spec with the engine's
    config current (``set_current_vllm_config``); the scheduler's EngineCore does not, so
    there the config is taken from the caller that is building the connector (a local
    named ``vllm_config`` of type ``VllmConfig`` up the stack: OffloadingConnector's
    constructor in vLLM 0.33). Both sides thus read the same config."""
    current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        found = frame.f_locals.get("vllm_config")
        if isinstance(found, VllmConfig):
            return found
        frame = frame.f_back
    return None


@dataclass(frozen=True)
class VllmModelIdentity:
    """The fingerprint fields that say which model an engine's KV comes from (see
    ``tiered_kv.fingerprint``), and the directory whose weights were digested."""

    model_id: str
    model_revision: str
    weights_digest: str | None
    model_settings: tuple[str, ...] | None
    model_dir: str | None


def vllm_model_settings(vllm_config: Any) -> tuple[str, ...]:
    """vLLM's settings that change the KV of given token ids beyond the weights and the
    KV dtype (the fingerprint's ``dtype`` is vLLM's KV-cache dtype): the model's code
    revision, dtype and quantization method, config overrides, layers kept out of a
    quantized KV cache, and the tokenizer where it is not the model's own; where set,
    online quantization's config and model class overrides (digests), the LongRoPE
    factors ``--max-model-len`` picks,
    a config file other than the model's (``--hf-config-path``: a digest of the config
    vLLM built), a load format that does not read the model's weight files, a Mamba
    state dtype, and a speculative draft model (its layers' KV travels in the chunks).
    Each of the later ones is named only where it is set, so a namespace without them
    stays as it was."""
    mc = vllm_config.model_config
    out = [
        f"code_revision={mc.code_revision or 'none'}",
        f"model_dtype={str(mc.dtype).removeprefix('torch.')}",
        f"quantization={mc.quantization or 'none'}",
    ]
    overrides = mc.hf_overrides
    if callable(overrides):
        out.append(f"hf_overrides={getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', '?')}")
    elif overrides:
        out.append(f"hf_overrides={_digest(overrides)}")
    for name in ("quantization_config", "model_class_overrides"):  # which layers, which model code
        if value := getattr(mc, name, None):
            out.append(f"{name}={_digest(value)}")
    if rope := longrope_factors(mc):
        out.append(f"longrope={rope}")
    cache = vllm_config.cache_config
    skip = getattr(cache, "kv_cache_dtype_skip_layers", None)
    if skip:
        out.append(f"kv_cache_dtype_skip_layers={','.join(map(str, skip))}")
    if mc.tokenizer and mc.tokenizer != mc.model:
        out.append(f"tokenizer={mc.tokenizer}")
    if mc.tokenizer_revision and mc.tokenizer_revision != mc.revision:
        out.append(f"tokenizer_revision={mc.tokenizer_revision}")
    load = getattr(vllm_config, "load_config", None)
    download_dir = getattr(load, "download_dir", None)
    hf_config_path = getattr(mc, "hf_config_path", None)
    if hf_config_path and hf_config_path != mc.model:
        out.append(f"hf_config={_config_digest(str(hf_config_path), download_dir)}")
    load_format = str(getattr(load, "load_format", "auto") or "auto")
    if load_format.lower() not in PLAIN_LOAD_FORMATS:
        extra = json.dumps(getattr(load, "model_loader_extra_config", None) or {}, sort_keys=True, default=str)
        out.append(f"load_format={load_format}:{hashlib.sha256(extra.encode()).hexdigest()[:16]}")
    for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
        value = str(getattr(cache, name, "auto") or "auto")
        if value != "auto":
            out.append(f"{name}={value}")
    draft = _draft_model(vllm_config)
    if draft is not None:
        out.append(f"speculative={draft}")
    return tuple(out)


def _digest(value: Any) -> str:
    """16 hex digits of a setting's value as JSON (a dataclass by its fields)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rope_parameter_sets(text_config: Any) -> list[dict]:
    """A model's rotary-embedding parameters (``rope_parameters``, or the older
    ``rope_scaling``): one dict per layer type where the config gives them per type,
    else the one dict; none where the config has none."""
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    return [p for p in params.values() if isinstance(p, dict)] or [params]


def longrope_factors(mc: Any) -> str | None:
    """``long`` or ``short``: the factors a LongRoPE model rotates every key with, which
    vLLM picks by ``--max-model-len`` (long past the original context), so the cached
    keys differ between the two; None for any other position encoding."""
    text = getattr(mc, "hf_text_config", None)
    for p in rope_parameter_sets(text):
        if (p.get("rope_type") or p.get("type")) == "longrope":
            original = p.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", 0)
            return "long" if int(mc.max_model_len) > int(original or 0) else "short"
    return None


def _config_digest(path: str, download_dir: str | None) -> str:
    """A digest of the config files at ``path`` (a directory, or its Hugging Face cache
    snapshot; a file), as every process of an engine and every node reads them: not of
    the config object, which model code may change in a worker; ``path`` itself where
    they are not on this machine."""
    file = Path(path).expanduser()
    if file.is_file():
        return xxhash.xxh3_64_hexdigest(file.read_bytes())
    found = resolve_model_dir(path, None, download_dir)
    if found is None:
        return f"{path}:unknown"
    return weights_digest(found, key="hf_config_path").digest[:16]


def _draft_model(vllm_config: Any) -> str | None:
    """The speculative draft model whose layers vLLM adds to the KV cache: its method
    and weights digest, or where its directory is not on this machine its name and
    revision; None without one, or where the method drafts with the target itself
    (n-grams: vLLM's draft config is then the target's)."""
    spec = getattr(vllm_config, "speculative_config", None)
    dm = getattr(spec, "draft_model_config", None)
    if spec is None or dm is None or dm is getattr(spec, "target_model_config", None) or dm is vllm_config.model_config:
        return None
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    found = resolve_model_dir(str(dm.model), dm.revision, download_dir)
    if found is None:
        return f"{spec.method}:{dm.model}@{dm.revision or 'none'}"
    return f"{spec.method}:{weights_digest(found, key='speculative_config.model').digest[:16]}"


def vllm_model_identity(
    model_name: str, cfg: TieredConfig, extra: Mapping[str, Any], vllm_config: Any | None = None
) -> VllmModelIdentity:
    """Which model the engine serves, as the disk namespace records it.

    ``model_id``: the config's where it sets one, else vLLM's ``--model``.
    ``model_revision``: vLLM's ``--revision``, else the config's ``model_revision``.
    ``weights_digest``: of the directory vLLM loads (``--model`` itself, or its snapshot
    in the HF cache at ``--revision`` under ``--download-dir``); a ``model_path`` in the
    config must have the same digest, and stands in where vLLM's directory is not on
    this machine. ``model_settings``: ``vllm_model_settings``. ``vllm_config``: default
    ``find_vllm_config()``. Raises ``ConfigError`` naming model_path."""
    vc = vllm_config if vllm_config is not None else find_vllm_config()
    mc = getattr(vc, "model_config", None)
    model = str(getattr(mc, "model", None) or model_name)
    revision = getattr(mc, "revision", None) or cfg.model_revision
    model_id = cfg.model_id if "model_id" in extra else model_name
    download_dir = getattr(getattr(vc, "load_config", None), "download_dir", None)
    found = resolve_model_dir(model, getattr(mc, "revision", None), download_dir)
    digest = where = None
    if found is not None:
        digest, where = weights_digest(found, key="--model").digest, str(found)
    if cfg.model_path:
        given = weights_digest(cfg.model_path)
        if digest is not None and given.digest != digest:
            raise ConfigError(
                f"model_path: {cfg.model_path!r} has weights digest {given.digest}, but the "
                f"model vLLM loads ({where}) has {digest}; remove model_path (vLLM's own "
                f"model directory is used) or point it at a copy of that model"
            )
        if digest is None:
            digest, where = given.digest, given.path
    if digest is None:
        logger.warning(
            "the disk namespace does not cover the model's weights: %r is not a local directory "
            "and not in the Hugging Face cache here; set model_path in kv_connector_extra_config "
            "to a local copy of the model",
            model,
        )
    settings = vllm_model_settings(vc) if mc is not None else None
    return VllmModelIdentity(str(model_id), str(revision), digest, settings, where)


# ---------------------------------------------------------------- attention backend

#: The backend the namespace names where vLLM cannot select one on this host (no
#: accelerator platform, e.g. a CPU-only machine without vLLM's CPU build) and none is
#: configured: vLLM 0.33's first choice on NVIDIA Ampere and Hopper GPUs.
DEFAULT_ATTENTION_BACKEND = "FLASH_ATTN"
DEFAULT_MLA_ATTENTION_BACKEND = "FLASH_ATTN_MLA"


def attention_backend_name(name: str, key: str = "attention_backend") -> str:
    """``name`` as vLLM names the backend (its ``AttentionBackendEnum`` member, any
    case). Raises ``ConfigError`` naming ``key``, the value and the names vLLM knows."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    known = [b.name for b in AttentionBackendEnum]
    upper = str(name).strip().upper()
    if upper not in known:
        raise ConfigError(f"{key}: expected one of vLLM's attention backends ({', '.join(known)}), got {name!r}")
    return upper


def configured_attention_backend(vllm_config: Any) -> str | None:
    """vLLM's ``--attention-backend`` where the config sets one, else None."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return None if backend is None else str(backend.name)


def selected_attention_backend(vllm_config: Any) -> str | None:
    """The backend vLLM's selector picks for the model's attention on this host's
    platform, as vLLM's own connectors learn it in a process without attention layers
    (``get_current_attn_backends``): from the model's head size and dtype, the KV-cache
    dtype, MLA or not, and ``--attention-backend``. None where the selector cannot pick
    one here (no platform, a backend that does not import)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return None
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                head_size=mc.get_head_size(),
                dtype=mc.dtype,
                kv_cache_dtype=vllm_config.cache_config.cache_dtype,
                use_mla=mc.use_mla,
            )
        return str(backend.get_name())
    except Exception as e:  # the platform's selector raises what its checks find
        logger.debug("vLLM selects no attention backend on this host: %s", e)
        return None


def loaded_attention_backends(vllm_config: Any, layer_names: Iterable[str]) -> dict[str, str]:
    """Layer name -> backend name of vLLM's standard attention layers (``Attention``,
    ``MLAAttention``; not their subclasses, which choose their own) among
    ``layer_names`` loaded in this process: a worker's, or the engine core's where it
    runs the model itself. Empty where none is loaded (vLLM's scheduler process)."""
    forward_context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    if not forward_context:
        return {}
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return {
        name: str(layer.get_attn_backend().get_name())
        for name in layer_names
        if type(layer := forward_context.get(name)) in (Attention, MLAAttention)
    }


def vllm_attention_backend(vllm_config: Any, layer_names: Iterable[str]) -> str:
    """The attention backend a server's disk namespace names, the same in every process
    of the engine: vLLM's selection on this host (``selected_attention_backend``), else
    ``--attention-backend``, else ``DEFAULT_ATTENTION_BACKEND`` (``..._MLA_...`` for an
    MLA model). The scheduler has no attention layers to ask, so every process names
    this prediction; where the layers are loaded (``loaded_attention_backends``), they
    must all use it, or the pages would be in another order than the namespace says:
    raises ``ConfigError`` naming the layers' backends and the fix (an explicit
    ``--attention-backend``, which the scheduler's prediction follows)."""
    mc = getattr(vllm_config, "model_config", None)
    default = DEFAULT_MLA_ATTENTION_BACKEND if getattr(mc, "use_mla", False) else DEFAULT_ATTENTION_BACKEND
    predicted = selected_attention_backend(vllm_config) or configured_attention_backend(vllm_config) or default
    loaded = loaded_attention_backends(vllm_config, layer_names)
    used = sorted(set(loaded.values()))
    if used and used != [predicted]:
        raise ConfigError(
            f"attention_backend: vLLM's attention layers here use {', '.join(used)} (e.g. "
            f"{next(n for n, b in loaded.items() if b != predicted)}), but a process without them "
            f"(vLLM's scheduler) names {predicted} in the disk namespace; start vLLM with "
            f"--attention-backend {used[0]} so every process names the backend that writes the pages"
            + ("" if len(used) == 1 else "; layers of several backends in one KV-cache group are not supported")
        )
    return predicted
