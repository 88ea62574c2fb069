"""The Prometheus endpoint of ``tiered-kv demo --metrics-port``: the demo's hierarchy
exported through ``tiered_kv.metrics.PrometheusMetrics`` on prometheus_client's HTTP
server, so ``tiered-kv stats``, Prometheus and the Grafana dashboard (``dashboards/``)
have something to read without a vLLM server.

I/O: one listening socket (``--metrics-host``, 127.0.0.1 unless given) served by a
daemon thread. The exports themselves run on the demo's own thread, between requests
and while holding, because the manager and the driver are not thread-safe.
"""

from __future__ import annotations

import time

from prometheus_client import start_http_server

from tiered_kv.mediums import GPU
from tiered_kv.metrics import hierarchy_occupancy, index_error_values
from tiered_kv.metrics_export import PrometheusMetrics
from tiered_kv.sim.driver import EngineDriver
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.retention import retention_metric_values
from tiered_kv.tiered.spec import HierarchySpec

#: Seconds between exports while the workload runs and while holding: a scrape every
#: few seconds sees fresh values, and the cost of an export stays out of the replay.
EXPORT_INTERVAL_S = 0.5


class DemoEndpoint:
    """``PrometheusMetrics`` served on ``host:port`` (port 0: any free one, see
    ``url``), fed from a hierarchy's spec and driver once ``attach`` names them.
    ``tokens_per_block``: tokens of one offloaded block."""

    def __init__(self, host: str, port: int, tokens_per_block: int):
        self.metrics = PrometheusMetrics(tokens_per_block=tokens_per_block)
        try:
            self.server, self._thread = start_http_server(port, addr=host, registry=self.metrics.registry)
        except OSError as e:
            # Address in use, a host that does not resolve, a privileged port: say which.
            raise OSError(f"--metrics-port {port}: cannot serve metrics on {host}:{port}: {e.strerror or e}") from e
        self.spec: HierarchySpec | None = None
        self.driver: EngineDriver | None = None
        self._last_export = 0.0

    def attach(self, spec: HierarchySpec, driver: EngineDriver) -> None:
        self.spec, self.driver = spec, driver

    @property
    def url(self) -> str:
        host, port = str(self.server.server_address[0]), self.server.server_port
        return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"

    def export(self) -> None:
        """Mirror the hierarchy's counters, occupancy, load estimates, failed store jobs
        and the retention rules' counts and holds into the metrics."""
        if self.spec is None or self.driver is None:
            return
        manager = self.driver.manager
        costs = getattr(manager, "costs", None)
        report = self.driver.report
        # The demo's worker jobs that tiered-kv reports failed: stores out of GPU memory
        # (its promotions ride on load jobs, counted per transfer type).
        failed_stores = sum(t.failed_jobs for d, t in report.transfers.items() if d.startswith(f"{GPU}->"))
        tiers: list[tuple[str, object]] = []
        if isinstance(manager, TieredOffloadingManager):
            tiers = [("cpu", manager.cpu), *((t.name, t) for t in manager.lower)]
        kept, holds = retention_metric_values(tiers)
        self.metrics.update(
            self.spec.stats,
            occupancy=hierarchy_occupancy(manager),
            costs=costs.snapshot() if costs is not None else None,
            job_failures={"store": failed_stores},
            counters=[*kept, *index_error_values(t for _, t in tiers[1:])],
            gauges=holds,
        )
        self._last_export = time.monotonic()

    def maybe_export(self) -> None:
        """``export`` if the last one is older than ``EXPORT_INTERVAL_S``."""
        if time.monotonic() - self._last_export >= EXPORT_INTERVAL_S:
            self.export()

    def hold(self, seconds: float) -> None:
        """Keep serving for ``seconds``, settling late jobs (write-behind disk writes)
        and exporting as they land."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(EXPORT_INTERVAL_S, left))
            if self.driver is not None:
                self.driver.poll()
            self.export()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
