"""The doctor's check of vLLM's connector settings: what the engine will run our spec under.

Runs in the operator's process (``tiered-kv doctor``); no I/O (reads the config file's
kv-transfer keys it is given).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiered_kv.config import TieredConfig
from tiered_kv.config_file import CONNECTOR
from tiered_kv.ops.doctor.report import FAIL, OK, WARN, Check

OURS = CONNECTOR["kv_connector"]
OURS_MODULE = CONNECTOR["kv_connector_module_path"]
#: Our connectors by the name ``kv_connector`` takes, and the module vLLM loads each from:
#: ``TieredOffloadingConnector``, and its subclass that also carries prefetch jobs to the
#: workers (``integrations.vllm.prefetch_jobs``), which keeps everything it does.
OUR_CONNECTORS = {OURS: OURS_MODULE, "TieredPrefetchingConnector": "tiered_kv.integrations.vllm.prefetch_jobs"}
#: vLLM's own connector, by the name ``kv_connector`` takes.
VLLMS = "OffloadingConnector"
#: The settings to add, as a config writes them.
_SETTINGS = ", ".join(
    f'"{k}": "{CONNECTOR[k]}"' for k in ("kv_connector", "kv_connector_module_path", "kv_load_failure_policy")
)


def check_connector(transfer: Mapping[str, Any] | None, cfg: TieredConfig | None) -> Check:
    """Whether vLLM will run ``TieredOffloadingSpec`` under one of our connectors
    (``OUR_CONNECTORS``) with its recompute policy (each shared-tier hit read once, failed
    loads recomputed, the prefill rate measured, the workers' metrics exported), under
    vLLM's own connector (which works, without those), or under one that cannot load it.
    ``transfer``: the kv-transfer config's own keys (None: the file is the extra config
    alone)."""
    if transfer is None:
        return Check("connector", OK, "the file holds the extra config alone: the connector is what vllm serve names")
    name = transfer.get("kv_connector")
    module = transfer.get("kv_connector_module_path")
    policy = transfer.get("kv_load_failure_policy", "fail")
    facts = {"kv_connector": name, "kv_connector_module_path": module, "kv_load_failure_policy": policy}
    shared = cfg is not None and any(e.cls.shared for e in cfg.tier_entries())
    if name in OUR_CONNECTORS:
        expected = OUR_CONNECTORS[name]
        if module != expected:
            return Check(
                "connector",
                FAIL,
                f"kv_connector {name} with kv_connector_module_path {module!r}: vLLM cannot load it",
                f'set "kv_connector_module_path": "{expected}"',
                facts,
            )
        if policy != "recompute":
            twice = ", and each shared-tier hit is downloaded twice (verified by the scheduler first)"
            return Check(
                "connector",
                WARN,
                f"{name} with kv_load_failure_policy {policy!r}: a load that fails fails its request"
                + (twice if shared else ""),
                'set "kv_load_failure_policy": "recompute"',
                facts,
            )
        return Check(
            "connector",
            OK,
            f"{name} with the recompute policy: each shared-tier hit read once, failed loads recomputed, "
            f"prefill rate measured, workers' metrics exported",
            facts=facts,
        )
    if name == VLLMS:
        lacks = "the prefill rate is estimated, not measured, and the workers' metrics are not exported"
        if shared:
            return Check(
                "connector",
                WARN,
                f"vLLM's {VLLMS}: each shared-tier hit is downloaded twice (the scheduler verifies it first); {lacks}",
                f"select our subclass: {_SETTINGS}",
                facts,
            )
        return Check("connector", OK, f"vLLM's {VLLMS}: {lacks} ({OURS} adds them)", facts=facts)
    return Check(
        "connector",
        WARN,
        f"kv_connector {name!r}: TieredOffloadingSpec is loaded by vLLM's {VLLMS} and its subclasses, such as {OURS}",
        f"select {_SETTINGS}",
        facts,
    )


def check_canary(cfg: TieredConfig) -> Check:
    """Whether each worker runs the start-up canary (``integrations.vllm.canary``): a
    page stored and loaded through the handlers must land where vLLM's attention reads it,
    or the engine does not start."""
    if cfg.canary:
        return Check(
            "canary",
            OK,
            "start-up canary on: each worker proves a stored and loaded page lands where vLLM's attention reads it",
        )
    return Check(
        "canary",
        WARN,
        "start-up canary off (canary: false): a page order the workers get wrong would be served without a check",
        "remove canary: false (the canary takes milliseconds at start-up)",
    )
