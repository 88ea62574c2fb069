"""``TieredOffloadingConnector``: vLLM 0.33's ``OffloadingConnector`` with failed loads
recomputed instead of fatal. Worker processes (and the scheduler, which builds the same
class and uses it unchanged).

vLLM's ``OffloadingConnector`` asserts that every load job succeeded, so a chunk may be
promised as a hit only once its bytes are known good: the shared tier's hit check then
downloads and verifies every rank's object in the scheduler before the workers read it
again (two downloads per hit). vLLM also has a path for loads that fail: a worker
connector reports the GPU blocks it could not fill (``get_block_ids_with_load_errors``)
and, with ``kv_load_failure_policy: "recompute"``, the scheduler recomputes the request
from the first of them. This connector takes that path: our worker reports every job
done, and the GPU blocks of the parts of a load that failed (a shared-tier object that
failed its header or checksum check, vanished, or could not be read; the parts that
landed, a CPU-resident lead, are not) are reported here, in the same step as the job,
so the request recomputes from the first of them and never runs on them.

Select it, with the recompute policy, in vLLM's kv-transfer config::

    --kv-transfer-config '{"kv_connector": "TieredOffloadingConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spec_name": "TieredOffloadingSpec",
            "spec_module_path": "tiered_kv.integrations.vllm", ...}}'

``TieredOffloadingSpec``, built inside this connector's constructor (in the scheduler
and in every worker alike; vLLM's engine core has no current config to read), then
promises a shared-tier chunk as a hit once every rank's object is known present,
without the scheduler's verifying download: each hit is read once, by the worker that
needs it, and verified there before a byte reaches the KV cache. Not for a model of
several KV-cache groups (a hybrid model): vLLM 0.33 cannot map failed block ids of such
a model back to requests and stops the engine if given any, so there the connector
reports none and the scheduler verifies each hit first, as with vLLM's connector.

It also measures the engine's prefill rate for the load-versus-recompute decision: the
scheduler marks each step whose scheduled tokens are nearly all prefill (at least
``PREFILL_SHARE``; decode and speculative tokens are the rest) and that loads nothing
with its work (``TieredConnectorMetadata``: tokens weighted by attention, as the decision
counts them), so neither a batch of decodes nor a wait for loads passes for a slow prefill;
each worker times that step's forward pass (``tiered_kv.worker.forward_timer``) and
adds it to the engine's ``LoadTimings`` as type ``PREFILL``, which the scheduler folds
into ``LoadCosts`` every step. Every step's work, decodes included, is noted too
(``LoadCosts.note_step``): the GPU's busy share, by which the decision discounts a queue
that waits on something else. With vLLM's plain ``OffloadingConnector`` nothing is
measured: the configured or estimated rate is used, and the GPU is taken as always busy.

It names each request's session for the manager: vLLM 0.33 hands the manager only a
``ReqContext``, without the ``Request.session_id`` a client sent (``X-Session-ID``), so
``on_new_request`` keeps it in that context's state (``common.RequestSession``, with the
request's tenant, also where no session is named), where the manager reads it for the
request's loads and stores (session retention, which learns each tenant's gaps). Under
vLLM's plain ``OffloadingConnector`` sessions come from the prefix chain alone.

And it exports each worker's metrics (vLLM's connector reports none from a worker):
its transfer jobs and their timings per transfer type, and its shared-tier store's
uploads and downloads, handed to vLLM with each step's output, which sums them over
ranks and over the scheduler's own onto its Prometheus endpoint.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import KVCacheConfig

from tiered_kv.cost import LoadCosts
from tiered_kv.integrations.vllm.common import REQUEST_TENANT, CpuOnly, RequestSession, request_tenant
from tiered_kv.prefill import prefill_work
from tiered_kv.worker.forward_timer import ForwardTimer

logger = logging.getLogger(__name__)


#: Set by ``TieredOffloadingConnector`` while vLLM's constructor builds the spec.
_RECOMPUTING: ContextVar[bool] = ContextVar("tiered_kv_failed_loads_recomputed", default=False)
_OURS: ContextVar[bool] = ContextVar("tiered_kv_connector", default=False)


def built_by_tiered_connector() -> bool:
    """Whether the spec being built belongs to ``TieredOffloadingConnector``, which sees
    each request (its LoRA adapter, its session) and not only its blocks."""
    return _OURS.get()


def failed_loads_recomputed() -> bool:
    """Whether the spec being built belongs to this connector with vLLM's recompute
    policy and a model of one KV-cache group: a failed load then costs a recompute of
    its blocks. False for a spec built by any other connector."""
    return _RECOMPUTING.get()


#: A step is timed when at least this share of its scheduled tokens is prefill.
PREFILL_SHARE = 0.9


def step_work(scheduler_output: Any, attention_per_token: float = 0.0) -> int:
    """The work of a step (vLLM's ``SchedulerOutput``) in linear tokens: every scheduled
    token, each request's weighted by the context they attend to
    (``tiered_kv.prefill.prefill_work``, the decision's own measure), so a step deep into
    a long prompt does not pass for a slower GPU."""
    total = scheduler_output.total_num_scheduled_tokens
    if total <= 0 or not attention_per_token:
        return max(0, total)
    computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    work = sum(
        prefill_work(n, computed.get(req_id, 0), attention_per_token)
        for req_id, n in scheduler_output.num_scheduled_tokens.items()
    )
    return round(work)


def is_prefill_step(scheduler_output: Any) -> bool:
    """Whether at least ``PREFILL_SHARE`` of a step's scheduled tokens are prefill: a
    request scheduled for more than one token beyond its speculative ones is in prefill
    (a decode step schedules one)."""
    total = scheduler_output.total_num_scheduled_tokens
    if total <= 0:
        return False
    spec = scheduler_output.scheduled_spec_decode_tokens or {}
    prefill = 0
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        n -= len(spec.get(req_id, ()))
        if n > 1:
            prefill += n
    return prefill >= PREFILL_SHARE * total


@dataclass
class TieredConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's metadata of a step, and the work of its forward pass to time as prefill
    (0: not timed; ``step_work`` of a step that ``is_prefill_step`` and loads nothing)."""

    prefill_tokens: int = 0


class TieredOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` that reports the GPU blocks of failed loads (module
    docstring) and times the forward passes that are nearly all prefill, for the
    load-versus-recompute decision (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        recompute = vllm_config.kv_transfer_config is not None and (
            vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        )
        groups = len(kv_cache_config.kv_cache_groups)
        if recompute and groups > 1:
            logger.warning(
                "the model has %d KV-cache groups: vLLM 0.33 cannot recompute single blocks of such a "
                "model, so failed loads are not reported to it and each shared-tier hit is verified by "
                "the scheduler before the workers read it",
                groups,
            )
        token, ours = _RECOMPUTING.set(recompute and groups == 1), _OURS.set(True)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _RECOMPUTING.reset(token)
            _OURS.reset(ours)

    def on_new_request(self, request: Any) -> None:
        token = REQUEST_TENANT.set(request_tenant(request))  # hints scope lease ids by it
        try:
            super().on_new_request(request)
        finally:
            REQUEST_TENANT.reset(token)
        session, scheduler = RequestSession.of(request), self.connector_scheduler
        lora = getattr(request, "lora_request", None)
        if (session is None and lora is None) or scheduler is None:
            return
        # The context vLLM just built for this request and passes to every manager call
        # of it; only the scheduler's state holds it.
        status = scheduler._req_status.get(request.request_id)
        if status is None:
            return
        if session is not None:
            status.req_context.set_state(session)
        if lora is not None:
            status.req_context.set_state(CpuOnly(str(getattr(lora, "lora_name", lora))))

    def get_block_ids_with_load_errors(self) -> set[int]:
        take = getattr(self._worker(), "take_failed_gpu_blocks", None)
        return take() if take is not None else set()

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if type(meta) is not OffloadingConnectorMetadata:
            return meta
        costs = self._costs()
        work = step_work(scheduler_output, costs.attention_per_token if costs is not None else 0.0)
        if costs is not None:
            costs.note_step(work)
        return TieredConnectorMetadata(
            load_jobs=meta.load_jobs,
            store_jobs=meta.store_jobs,
            jobs_to_flush=meta.jobs_to_flush,
            # A step that loads may wait for its loads inside the forward pass: not timed.
            prefill_tokens=0 if meta.load_jobs or not is_prefill_step(scheduler_output) else work,
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        timer = self._timer()
        if timer is not None:
            meta = self._connector_metadata
            timer.start(meta.prefill_tokens if isinstance(meta, TieredConnectorMetadata) else 0)

    def wait_for_save(self) -> None:
        timer = self._timer()
        if timer is not None:
            timer.stop()
        super().wait_for_save()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """In a worker, this rank's metrics since the last step (``TieredVllmWorker.
        take_stats``), which vLLM carries to the scheduler with the step's output and
        sums over ranks; in the scheduler, the manager's, as vLLM's connector does."""
        if self.connector_scheduler is not None:
            return super().get_kv_connector_stats()
        take = getattr(self._worker(), "take_stats", None)
        return take() if take is not None else None

    def _costs(self) -> LoadCosts | None:
        costs = getattr(getattr(self.connector_scheduler, "manager", None), "costs", None)
        return costs if isinstance(costs, LoadCosts) else None

    def _worker(self) -> Any:
        return self.connector_worker.worker if self.connector_worker is not None else None

    def _timer(self) -> ForwardTimer | None:
        return getattr(self._worker(), "forward_timer", None)


__all__ = ["TieredConnectorMetadata", "TieredOffloadingConnector", "failed_loads_recomputed"]
