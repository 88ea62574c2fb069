"""Disk slots held back, neither free nor holding a block, and the gauge that shows them
(``tiered_kv_tier_held_back_blocks{tier, reason}``): a store given up while a rank may still
write it (``settling``, until every rank logged an outcome there) and a failed store's slot
whose partial index entry is not deleted yet (``releasing``). Real manager, store, LMDB,
composite and exporter; the index flusher writes only when asked (a long ``flush_interval``,
no log polling), so each state stays until the test moves it on."""

from __future__ import annotations

import contextlib
import json

from prometheus_client import generate_latest, start_http_server
from support.disk_fixtures import block_hash, disk_bytes_for, fingerprint, small_layout
from test_disk_log_attempts import slots_of, write

from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.disk.store.store import DiskStore
from tiered_kv.metrics import TIER_HELD_BACK_BLOCKS, hierarchy_occupancy
from tiered_kv.metrics_export import PrometheusMetrics
from tiered_kv.tiered.manager import TieredOffloadingManager

A, B = block_hash("A"), block_hash("B")
SLOTS = 4


@contextlib.contextmanager
def engine(tmp_path):
    """A hierarchy (CPU over a two-rank disk tier) and the disk store every rank's worker writes."""
    layout = small_layout()
    fp = fingerprint(layout, tp_size=2)
    nbytes = disk_bytes_for(layout, SLOTS)
    with (
        DiskOffloadingManager(
            tmp_path, fp, layout, disk_bytes=nbytes, engine_id="e", poll_interval=None, flush_interval=3600
        ) as disk,
        DiskStore.open(tmp_path, fp, layout, disk_bytes=nbytes, io_backend="posix", engine_id="e") as store,
    ):
        yield TieredOffloadingManager(CPUOffloadingManager(4, 16), disk), store, layout


def exported(metrics: PrometheusMetrics, composite: TieredOffloadingManager) -> dict[str, float | None]:
    """The gauge per reason for the disk tier, as the exporter sets it from the hierarchy now."""
    metrics.update(composite.stats, occupancy=hierarchy_occupancy(composite))
    value = metrics.registry.get_sample_value
    return {why: value(TIER_HELD_BACK_BLOCKS, {"tier": "disk", "reason": why}) for why in ("settling", "releasing")}


def test_settling_and_releasing_slots_are_shown_until_they_are_free(tmp_path):
    with engine(tmp_path) as (composite, s, layout):
        disk, metrics = composite.tier("disk"), PrometheusMetrics()
        assert isinstance(disk, DiskOffloadingManager)
        assert exported(metrics, composite) == {"settling": 0, "releasing": 0}, "a series from the start"
        assert metrics.registry.get_sample_value(TIER_HELD_BACK_BLOCKS, {"tier": "cpu", "reason": "settling"}) is None

        first = disk.prepare_store([A])
        disk.abandon_store([A])  # its job failed on one rank: both ranks may still write it
        failed = disk.prepare_store([B])
        for rank in (0, 1):  # both ranks' writes of B failed (a full disk): logged
            s.log_failed(rank, [B], slots_of(failed))
        disk.refresh()
        assert exported(metrics, composite) == {"settling": 1, "releasing": 1}
        assert disk.num_free_slots() == SLOTS - 2 and composite.used_blocks()["disk"] == 2, "counted as used"
        text = generate_latest(metrics.registry).decode()
        assert f'{TIER_HELD_BACK_BLOCKS}{{reason="settling",tier="disk"}} 1.0' in text.splitlines()

        for rank in (0, 1):  # the given-up store's writes land late: every rank has reported
            write(s, layout, rank, [A], slots_of(first))
        disk.refresh()
        assert not disk.is_loadable(A)
        assert exported(metrics, composite) == {"settling": 0, "releasing": 2}, "now waiting for the index"
        assert disk.num_free_slots() == SLOTS - 2

        assert disk.flush()  # both partial entries deleted: the slots are free again
        assert exported(metrics, composite) == {"settling": 0, "releasing": 0}
        assert disk.num_free_slots() == SLOTS and s.entry(A) is None and s.entry(B) is None


def test_a_store_no_rank_reports_stays_settling(tmp_path):
    """A given-up store whose ranks never log an outcome (a worker that lost the job) keeps
    its slot out of use for the life of the manager: the gauge is how an operator sees it."""
    with engine(tmp_path) as (composite, s, layout):
        disk, metrics = composite.tier("disk"), PrometheusMetrics()
        assert isinstance(disk, DiskOffloadingManager)
        disk.prepare_store([A])
        disk.abandon_store([A])
        for _ in range(3):
            disk.refresh()
            assert disk.flush()
            assert exported(metrics, composite) == {"settling": 1, "releasing": 0}
        assert disk.held_back_slots() == {"settling": 1, "releasing": 0} and disk.num_free_slots() == SLOTS - 1


def stats_read(metrics: PrometheusMetrics, row: str) -> tuple[dict[str, dict], list[str]]:
    """What ``tiered-kv stats`` prints against a real endpoint (prometheus_client's HTTP
    server) serving ``metrics``: the tiers of its ``--json`` view by name, and the cells of
    the table's ``row`` (one per tier, in the view's order)."""
    from typer.testing import CliRunner

    from tiered_kv.cli import _load_commands, app

    _load_commands()
    server, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        result = CliRunner().invoke(app, ["stats", "--url", url, "--json"])
        assert result.exit_code == 0, result.output
        tiers = {t["tier"]: t for t in json.loads(result.stdout)["tiers"]}
        table = CliRunner().invoke(app, ["stats", "--url", url]).stdout
    finally:
        server.shutdown()
        server.server_close()
    (line,) = [line for line in table.splitlines() if row in line]
    return tiers, [c.strip() for c in line.split("│")[2:-1]]


def test_tiered_kv_stats_shows_them_beside_the_used_blocks(tmp_path):
    """``tiered-kv stats`` against the exporter of a hierarchy whose store job failed before
    any rank wrote (settling) and whose other store every rank failed (releasing)."""
    with engine(tmp_path / "disk") as (composite, s, layout):
        disk = composite.tier("disk")
        assert isinstance(disk, DiskOffloadingManager)
        keys = [block_hash(f"job{i}") for i in range(2)]
        assert composite.prepare_store(keys) is not None  # into CPU, written through to disk
        composite.complete_store(keys, success=False)  # the job failed: the disk copies are given up
        failed = disk.prepare_store([B])
        for rank in (0, 1):
            s.log_failed(rank, [B], slots_of(failed))
        disk.refresh()
        metrics = PrometheusMetrics()
        assert exported(metrics, composite) == {"settling": 2, "releasing": 1}
        tiers, cells = stats_read(metrics, "held back (settling / releasing)")
        assert tiers["disk"]["held_back_blocks"] == {"settling": 2, "releasing": 1}
        assert tiers["disk"]["used_blocks"] == 3 and tiers["cpu"]["held_back_blocks"] == {}
        assert cells == ["-", "2 / 1"]
