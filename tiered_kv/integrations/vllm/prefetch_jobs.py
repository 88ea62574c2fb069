"""Prefetch jobs through vLLM 0.33's connector: ``PrefetchConduit``, and
``TieredPrefetchingConnector``, ``TieredOffloadingConnector`` with it. Scheduler and
worker processes.

vLLM's ``OffloadingConnector`` carries only the jobs of requests (a load into a
request's GPU blocks, a store out of them), and its scheduler places a request's keys
only when it first looks the request up, at the head of its queue. Prefetch
(``hints``: a waiting request's lower-tier chunks promoted into CPU while it waits, and
``kv.prefetch`` hints) needs both earlier and otherwise, so this conduit adds:

- **Keys at arrival** (scheduler): right after vLLM's ``on_new_request`` the request's
  offload keys are placed as vLLM's own lookup would place them
  (``RequestOffloadState.update_offload_keys``; placing them again later adds nothing)
  and the manager's ``KvHints.on_request_keys`` is called.
- **Jobs to the workers**: each step's prefetch jobs (``KvHints.take_jobs``) ride in the
  step's connector metadata (``prefetch_jobs``: job id -> ``TieredJobSpec`` of a
  ``TieredLoadSpec``), under negative job ids, which vLLM's own job ids (counted up
  from 0) never take. Each worker submits them after the step's loads, on its load
  handler, as promotions whose GPU side has no rows: read tier -> CPU and verified there;
  a job that fails marks its CPU slots in ``SlotHealth``, as any load does.
- **Completions back**: a worker reports a prefetch job done through vLLM's own
  ``completed_jobs`` (summed over ranks by vLLM), with no size or time, so vLLM's load and
  store metrics never count it (the tier's transfer metrics do). The scheduler takes the
  negative ids out before vLLM reads the rest and completes a job once every rank
  reported it (``KvHints.complete``).

What stays vLLM's: every request's loads and stores, their order and its accounting; a
prefetch job never holds a GPU block, so vLLM's flushes and preemptions never wait for
one. A cache reset abandons the prefetches in flight (``KvHints.reset``); their
completions, whenever they come, drop what they read.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import LoadStoreSpec as VllmLoadStoreSpec
from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult
from vllm.v1.outputs import KVConnectorOutput

from tiered_kv.integrations.vllm.common import TieredJobSpec
from tiered_kv.integrations.vllm.connector import TieredConnectorMetadata, TieredOffloadingConnector
from tiered_kv.tiered.transfer_specs import TieredLoadSpec

logger = logging.getLogger(__name__)


@dataclass
class PrefetchMetadata(TieredConnectorMetadata):
    """A step's metadata and its prefetch jobs (vLLM job id -> ``TieredJobSpec``)."""

    prefetch_jobs: dict[int, TieredJobSpec] = field(default_factory=dict)


def vllm_job_id(job_id: int) -> int:
    """A prefetch job's id among vLLM's (below every id vLLM gives its own jobs)."""
    return -job_id


class PrefetchWorker:
    """A rank's ``OffloadingWorker`` (``TieredVllmWorker``) that also runs prefetch jobs
    (module docstring); everything else goes to it unchanged."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._prefetching: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit_prefetch(self, job_id: int, spec: VllmLoadStoreSpec) -> None:
        src = spec.inner if isinstance(spec, TieredJobSpec) else None
        if not isinstance(src, TieredLoadSpec):
            raise TypeError(f"prefetch job {job_id}: expected a TieredJobSpec of a TieredLoadSpec, got {spec!r}")
        self._prefetching.add(job_id)
        self.inner.submit_prefetch(job_id, src)

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self.inner.submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return self.inner.submit_load(job_id, src_spec, dst_spec, expedited)

    def get_finished(self) -> list[VllmTransferResult]:
        out = []
        for result in self.inner.get_finished():
            if result.job_id in self._prefetching:
                self._prefetching.discard(result.job_id)
                result = VllmTransferResult(result.job_id, True)  # neither a vLLM load nor a store
            out.append(result)
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()


class PrefetchConduit:
    """The connector hooks of the module docstring, for a subclass of vLLM's
    ``OffloadingConnector`` whose manager is ``TieredVllmManager``."""

    connector_scheduler: Any
    connector_worker: Any
    _connector_metadata: Any

    def _conduit_init(self) -> None:
        self._prefetch_reports: Counter[int] = Counter()
        scheduler = self.connector_scheduler
        hints = getattr(getattr(scheduler, "manager", None), "hints", None)
        if hints is not None:
            hints.enable_prefetch()

    def _hints(self) -> Any:
        return getattr(getattr(self.connector_scheduler, "manager", None), "hints", None)

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)  # type: ignore[misc]
        hints = self._hints()
        status = self.connector_scheduler._req_status.get(request.request_id) if hints is not None else None
        if status is not None:
            status.update_offload_keys()
            hints.on_request_keys(status.req_context)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        hints = self._hints()
        if hints is None or not isinstance(meta, TieredConnectorMetadata):
            return meta
        jobs = {vllm_job_id(job.job_id): TieredJobSpec(job.spec) for job in hints.take_jobs()}
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name != "prefetch_jobs"}
        return PrefetchMetadata(**fields, prefetch_jobs=jobs)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        hints = self._hints()
        if isinstance(meta, OffloadingWorkerMetadata) and hints is not None:
            workers = self.connector_scheduler.config.num_workers
            for job_id in [j for j in meta.completed_jobs if j < 0]:
                self._prefetch_reports[job_id] += meta.completed_jobs.pop(job_id)
                if self._prefetch_reports[job_id] >= workers:
                    del self._prefetch_reports[job_id]
                    hints.complete(-job_id)
        super().update_connector_output(connector_output)  # type: ignore[misc]

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)  # type: ignore[misc]
        worker = self.connector_worker
        if worker is not None and worker.worker is not None and not isinstance(worker.worker, PrefetchWorker):
            worker.worker = PrefetchWorker(worker.worker)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]
        worker = getattr(self.connector_worker, "worker", None)
        meta = self._connector_metadata
        jobs = meta.prefetch_jobs if isinstance(meta, PrefetchMetadata) else None
        if jobs and isinstance(worker, PrefetchWorker):
            for job_id, spec in jobs.items():  # after the step's loads: behind them on the handler
                worker.submit_prefetch(job_id, spec)


class TieredPrefetchingConnector(PrefetchConduit, TieredOffloadingConnector):
    """``TieredOffloadingConnector`` with prefetch jobs (module docstring); selected as
    ``"kv_connector": "TieredPrefetchingConnector"``, ``"kv_connector_module_path":
    "tiered_kv.integrations.vllm.prefetch_jobs"``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        self._conduit_init()


__all__ = ["PrefetchConduit", "PrefetchMetadata", "PrefetchWorker", "TieredPrefetchingConnector", "vllm_job_id"]
