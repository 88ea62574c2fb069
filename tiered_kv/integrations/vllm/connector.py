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
done, and the GPU blocks of a load that failed (a shared-tier object that failed its
header or checksum check, vanished, or could not be read) are reported here, in the same
step as the job, so the request recomputes them and never runs on them.

Select it, with the recompute policy, in vLLM's kv-transfer config::

    --kv-transfer-config '{"kv_connector": "TieredOffloadingConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spec_name": "TieredOffloadingSpec",
            "spec_module_path": "tiered_kv.integrations.vllm", ...}}'

``TieredOffloadingSpec`` sees both settings and then promises a shared-tier chunk as a
hit once every rank's object is known present, without the scheduler's verifying
download: each hit is read once, by the worker that needs it, and verified there before
a byte reaches the KV cache.
"""

from __future__ import annotations

from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

#: The ``kv_connector`` name that selects this class.
CONNECTOR_NAME = "TieredOffloadingConnector"


def failed_loads_recomputed() -> bool:
    """Whether the engine being built runs this connector with the recompute policy
    (read from vLLM's current config; False outside one)."""
    config = get_current_vllm_config_or_none()
    kv = config.kv_transfer_config if config is not None else None
    return kv is not None and kv.kv_connector == CONNECTOR_NAME and kv.kv_load_failure_policy == "recompute"


class TieredOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` that reports the GPU blocks of failed loads (module docstring)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        take = getattr(worker, "take_failed_gpu_blocks", None)
        return take() if take is not None else set()


__all__ = ["CONNECTOR_NAME", "TieredOffloadingConnector", "failed_loads_recomputed"]
