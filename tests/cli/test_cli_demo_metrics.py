"""``tiered-kv demo --metrics-port``: the demo run as the console script, serving its
hierarchy's Prometheus endpoint; ``tiered-kv stats`` reads per-tier hits from it, and
every metric the Grafana dashboard (dashboards/*.json) and the alert rules
(dashboards/alerts.yml) query is on it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.promql import promql_metric_names
from typer.testing import CliRunner

from tiered_kv.cli import _load_commands, app

_load_commands()
runner = CliRunner()

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}

#: Queried by the dashboard, exported by vLLM's endpoint only: the vLLM adapter's hit
#: checks verify a lower tier's chunks before a lookup reports them (the demo's engine
#: loop looks up without them). The panel says "(vLLM)".
VLLM_ONLY = {"tiered_kv_tier_verifications_total"}

#: Declared on the demo's endpoint but with no series in this run: labelled metrics
#: of a shared tier (the demo has none), of verification (vLLM's hit checks), of session
#: retention's events and learned gaps (the demo's requests are not sessions), of KV hints and start-up canaries (vLLM's workers and
#: requests), and the GPU's busy share (vLLM's steps, noted by its connector). Every other queried name must have at
#: least one sample.
NO_SERIES_IN_THIS_RUN = {
    "tiered_kv_retention_ttl_seconds",
    "tiered_kv_hint_actions_total",
    "tiered_kv_canary_checks_total",
    "tiered_kv_remote_bytes_total",
    "tiered_kv_remote_uploads_total",
    "tiered_kv_remote_downloads_total",
    "tiered_kv_remote_rejected_objects_total",
    "tiered_kv_remote_request_seconds_bucket",
    "tiered_kv_verification_seconds_bucket",
    "tiered_kv_gpu_busy_share",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Demo:
    """``tiered-kv demo --metrics-port PORT --hold ...`` as a subprocess."""

    def __init__(self, tmp: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.stderr_path = tmp / "stderr"
        script = Path(sys.executable).with_name("tiered-kv")
        # 12 MiB of CPU tier and a disk tier: blocks are served from both.
        args = ["demo", "--requests", "80", "--cpu-bytes", "12MiB", "--device", "cpu", "--cache-dir", str(tmp / "c")]
        args += ["--metrics-port", str(self.port), "--hold", "120"]
        with open(self.stderr_path, "w") as err:
            # Ctrl-C reaches the demo as from a terminal, though this run's shell may have
            # started it in the background (SIGINT ignored, which a child inherits).
            self.proc = subprocess.Popen(
                [str(script), *args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_for_hold(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while "replay done" not in self.stderr():
            assert self.proc.poll() is None, f"the demo exited early: {self.stderr()}"
            assert time.monotonic() < deadline, f"the replay never finished: {self.stderr()}"
            time.sleep(0.2)

    def exposition(self) -> str:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            return r.read().decode()

    def stop(self) -> tuple[int, str]:
        """Interrupt the hold as an operator would (Ctrl-C); the exit code and stdout."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        out, _ = self.proc.communicate(timeout=60)
        return self.proc.returncode, out


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = Demo(tmp_path_factory.mktemp("demo"))
    try:
        d.wait_for_hold()
        d.text = d.exposition()
        yield d
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def _names(text: str) -> tuple[set[str], set[str]]:
    """The exposition's declared names (each family with its type's suffixes) and the
    names that have at least one sample."""
    declared, sampled = set(), set()
    for family in text_string_to_metric_families(text):
        declared.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
        sampled.update(s.name for s in family.samples)
    return declared, sampled


def _dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) of every query of every dashboard."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']!r}", target["expr"]))
    return out


def test_stats_shows_hits_of_every_tier_from_the_demo(demo):
    result = runner.invoke(app, ["stats", "--url", demo.url, "--json"])
    assert result.exit_code == 0, result.output
    tiers = {t["tier"]: t for t in json.loads(result.stdout)["tiers"]}
    assert set(tiers) == {"cpu", "disk"}
    for name, row in tiers.items():
        assert row["hits_blocks"] > 0 and row["hits_tokens"] > 0, f"{name}: {row}"
        assert row["used_blocks"] > 0, f"{name}: {row}"
    assert tiers["disk"]["bytes_loaded"] > 0 and tiers["cpu"]["load_gbps_estimate"] is not None
    table = runner.invoke(app, ["stats", "--url", demo.url])
    assert table.exit_code == 0 and "hits / lookups (blocks)" in table.stdout


def test_every_metric_the_dashboard_queries_is_on_the_demo_endpoint(demo):
    declared, sampled = _names(demo.text)
    exprs = _dashboard_exprs()
    assert exprs, "no dashboard queries found"
    queried: set[str] = set()
    for where, expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"{where}: {expr!r} reads no metric"
        missing = names - declared - VLLM_ONLY
        assert not missing, f"{where} reads {sorted(missing)}, which the demo's endpoint does not export"
        empty = names - sampled - VLLM_ONLY - NO_SERIES_IN_THIS_RUN
        assert not empty, f"{where} reads {sorted(empty)}, declared but without a series after the replay"
        queried |= names
    # The allow-lists name only what they must: what the demo does export leaves them.
    assert VLLM_ONLY <= queried and not VLLM_ONLY & declared
    assert NO_SERIES_IN_THIS_RUN <= queried and not NO_SERIES_IN_THIS_RUN & sampled, sorted(
        NO_SERIES_IN_THIS_RUN & sampled
    )
    # The load decision and the write queue have panels, with values on this endpoint.
    for name in (
        "tiered_kv_tier_load_gbps",
        "tiered_kv_prefill_tokens_per_second",
        "tiered_kv_tier_pending_writes",
        "tiered_kv_tier_pending_writes_limit",
    ):
        assert name in queried and name in sampled, name


def test_dashboard_filters_by_instance_and_model(demo):
    declared, _ = _names(demo.text)
    for path in sorted(DASHBOARDS.glob("*.json")):
        variables = {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}
        assert {"instance", "model_name"} <= set(variables), path.name
        for name in ("instance", "model_name"):
            # label_values(METRIC{...}, LABEL): the values come from a metric the endpoint has.
            series = variables[name]["definition"].split("(", 1)[1].rsplit(",", 1)[0]
            names = promql_metric_names(series)
            assert names and names <= declared, f"{path.name}: ${name} lists values of {sorted(names)}"
            # "All" must match series without the label too (model_name outside vLLM).
            assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    for where, expr in _dashboard_exprs():
        for var in ("$instance", "$model_name"):
            assert var in expr, f"{where}: {expr!r} ignores {var}"


def test_alert_rules_parse_and_query_only_metrics_the_endpoint_has(demo):
    import yaml

    rules = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    declared, _ = _names(demo.text)
    alerts = [r for group in rules["groups"] for r in group["rules"]]
    assert all(group["name"] and group["rules"] for group in rules["groups"])
    used: set[str] = set()
    for rule in alerts:
        assert rule["alert"] and rule["labels"]["severity"] and rule["annotations"]["summary"], rule
        names = promql_metric_names(rule["expr"])
        assert names, rule["alert"]
        missing = names - declared
        assert not missing, f"alert {rule['alert']} reads {sorted(missing)}, which the endpoint does not export"
        used |= names
    for name in (
        "tiered_kv_tier_blocks_total",  # checksum failures
        "tiered_kv_worker_job_failures_total",
        "tiered_kv_tier_pending_writes",
        "tiered_kv_tier_pending_writes_limit",
        "tiered_kv_remote_unavailable_periods_total",
    ):
        assert name in used, f"no alert reads {name}"


def test_the_demo_reports_after_an_interrupted_hold(demo):
    code, out = demo.stop()
    assert code == 0, demo.stderr()
    assert "mismatches: 0" in out
    with pytest.raises(OSError):  # the endpoint is gone with the demo
        demo.exposition()


def test_bad_metrics_options_name_the_value():
    for bad in ("70000", "nine", "-1", "80.5"):
        result = runner.invoke(app, ["demo", "--metrics-port", bad])
        assert result.exit_code == 2, (bad, result.output)
        assert f"'--metrics-port': '{bad}' is not a TCP port" in result.output
    result = runner.invoke(app, ["demo", "--hold", "5"])
    assert result.exit_code == 2 and "--metrics-port" in result.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["demo", "--requests", "1", "--device", "cpu", "--metrics-port", str(port)])
    assert result.exit_code == 2
    assert f"--metrics-port {port}: cannot serve metrics on 127.0.0.1:{port}" in result.stderr
