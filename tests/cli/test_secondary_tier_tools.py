"""The operator tools on a disk cache written by vLLM's own ``TieringOffloadingSpec`` with
our ``TieredDiskTier``: ``inspect summary --config`` and ``inspect clear --unread-by``
judge its namespace by that tier's fingerprint (not ``TieredOffloadingSpec``'s),
``warmup`` refuses to write a namespace that tier would not read, and ``doctor`` counts
its ``disk_bytes`` once per node. A config shape whose namespace the tools cannot
compute is refused, and nothing is deleted.

The caches are real: vLLM's scheduler (tests/support/vllm_harness.py) with the tier
loaded by ``module_path`` writes them, and a fresh server of the same config finds
the blocks afterwards. Marked ``vllm``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec", reason="vLLM is not installed (make venv installs it)", exc_type=ImportError
)

from support import vllm_harness as vh  # noqa: E402
from typer.testing import CliRunner  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from tiered_kv.cli import _load_commands, app  # noqa: E402
from tiered_kv.disk.format.namespace import list_namespaces  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16  # GPU block size in tokens; one GPU block per chunk
CHUNK = 4096  # one chunk of write_model_config's model: one 4 KiB-aligned CPU-tier row
TIER_MODULE = "tiered_kv.integrations.vllm.secondary_tier"
REPO = Path(__file__).resolve().parents[2]
PROMPT = [100 + (i * 31) % 800 for i in range(3 * BLOCK + 1)]


def _cli(*args: str, code: int | None = 0):
    """Run the CLI; ``code``: the exit code it must end with (None: any)."""
    _load_commands()
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})
    assert code is None or result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def _tiering(cache: Path, **tier) -> dict:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8 * CHUNK,
        "secondary_tiers": [
            {
                "type": "TieredDiskTier",
                "module_path": TIER_MODULE,
                "disk_path": str(cache),
                "disk_bytes": "64KiB",
                **tier,
            }
        ],
    }


def _tiered(cache: Path) -> dict:
    return {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "tiered_kv.integrations.vllm",
        "cpu_bytes": "64KiB",
        "disk_path": str(cache),
        "disk_bytes": "64KiB",
    }


def _write(path: Path, extra: dict) -> Path:
    """vLLM's whole --kv-transfer-config, as the server is given it."""
    path.write_text(
        json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})
    )
    return path


def _fill(model_dir: Path, extra: dict) -> str:
    """Serve ``PROMPT`` on a server with ``extra``; the namespace its disk tier wrote."""
    with vh.VllmHarness.build(model_dir, extra, num_gpu_blocks=32) as h:
        h.serve(PROMPT)
        tiers = getattr(h.manager, "secondary_tiers", None)
        if tiers:
            (tier,) = tiers
            assert tier.stats.stored == 3
            return tier.fingerprint.namespace_id
        return h.manager.composite.tier("disk").namespace.path.name


def _disk_hits(model_dir: Path, extra: dict) -> list[LookupResult]:
    """What a fresh server with ``extra`` finds on disk for ``PROMPT``'s chunks."""
    keys = [make_offload_key(k, 0) for k in vh.hash_blocks(PROMPT, BLOCK)]
    with vh.VllmHarness.build(model_dir, extra, num_gpu_blocks=32) as h:
        (tier,) = h.manager.secondary_tiers
        with h.manager.lock:
            return [tier.lookup(k, ReqContext(req_id="probe")) for k in keys]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


@pytest.fixture
def cache(model_dir, tmp_path):
    """A cache holding three namespaces: the tier's for the model, the tier's for another
    model_id, and TieredOffloadingSpec's for the model."""
    root = tmp_path / "cache"
    ids = {
        "tier": _fill(model_dir, _tiering(root, model_id="tiny", model_path=str(model_dir))),
        "other": _fill(model_dir, _tiering(root, model_id="other")),
        "spec": _fill(model_dir, _tiered(root)),
    }
    assert len(set(ids.values())) == 3 and {ns.path.name for ns in list_namespaces(root)} == set(ids.values())
    return root, ids


def _names(root: Path) -> set[str]:
    return {ns.path.name for ns in list_namespaces(root)}


def test_summary_says_the_tier_reads_its_own_namespace_and_no_other(model_dir, cache, tmp_path):
    root, ids = cache
    config = _write(tmp_path / "tiering.json", _tiering(root, model_id="tiny", model_path=str(model_dir)))
    data = json.loads(_cli("inspect", "summary", str(root), "--config", str(config), "--json").stdout)
    read = {ns["namespace"]: ns["read_by"][0] for ns in data["namespaces"]}
    assert read[ids["tier"]]["reads"] is True and read[ids["tier"]]["differences"] == []
    assert "TieringOffloadingSpec" in read[ids["tier"]]["unchecked"]
    assert read[ids["other"]]["reads"] is False
    assert any(d.startswith("model_id: ") for d in read[ids["other"]]["differences"])
    spec = read[ids["spec"]]
    assert spec["reads"] is False and any(d.startswith("layout: ") for d in spec["differences"])
    table = _cli("inspect", "summary", str(root), "--config", str(config)).stdout
    assert "yes" in table and "whole CPU-tier rows" in table

    # The other way round: TieredOffloadingSpec's config does not read the tier's rows.
    tiered = _write(tmp_path / "tiered.json", _tiered(root))
    data = json.loads(_cli("inspect", "summary", str(root), "--config", str(tiered), "--json").stdout)
    read = {ns["namespace"]: ns["read_by"][0] for ns in data["namespaces"]}
    assert read[ids["spec"]]["reads"] is True
    assert read[ids["tier"]]["reads"] is False and read[ids["other"]]["reads"] is False
    assert any("vllm_cpu_chunk" in d for d in read[ids["tier"]]["differences"])


def test_clear_unread_by_keeps_the_tiers_namespace_and_its_blocks(model_dir, cache, tmp_path):
    root, ids = cache
    extra = _tiering(root, model_id="tiny", model_path=str(model_dir))
    config = _write(tmp_path / "tiering.json", extra)
    dry = json.loads(_cli("inspect", "clear", str(root), "--unread-by", str(config), "--dry-run", "--json").stdout)
    assert sorted(dry["removed"]) == sorted([ids["other"], ids["spec"]])
    cleared = json.loads(_cli("inspect", "clear", str(root), "--unread-by", str(config), "--yes", "--json").stdout)
    assert sorted(cleared["removed"]) == sorted([ids["other"], ids["spec"]])
    assert _names(root) == {ids["tier"]}
    # The blocks are still there, and a server with that config still finds them.
    assert _disk_hits(model_dir, extra) == [LookupResult.HIT] * 3


def test_a_shape_the_tools_cannot_compute_is_refused_and_nothing_is_deleted(model_dir, cache, tmp_path):
    root, ids = cache
    cpu_only = _write(tmp_path / "cpu.json", {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30})
    elsewhere = _tiering(root)
    elsewhere["spec_module_path"] = "my_tiering.spec"
    subclass = _write(tmp_path / "subclass.json", elsewhere)
    named = {**_tiering(root), "spec_name": "MyTieringSpec", "spec_module_path": "my_tiering.spec"}
    renamed = _write(tmp_path / "renamed.json", named)
    good = _write(tmp_path / "tiering.json", _tiering(root, model_id="tiny", model_path=str(model_dir)))
    for bad, what in (
        (cpu_only, "spec_name 'CPUOffloadingSpec'"),
        (subclass, "spec_module_path 'my_tiering.spec'"),
        (renamed, "spec_name 'MyTieringSpec'"),
    ):
        before = _names(root)
        out = _cli("inspect", "clear", str(root), "--unread-by", str(good), "--unread-by", str(bad), "--yes", code=2)
        assert out.stderr.startswith(f"error: --config {bad}: config {bad}: {what}"), out.stderr
        assert "TieredDiskTier" in out.stderr and len(out.stderr.splitlines()) == 1
        assert _names(root) == before == set(ids.values())
        _cli("inspect", "summary", str(root), "--config", str(bad), code=2)
    assert _disk_hits(model_dir, _tiering(root, model_id="tiny", model_path=str(model_dir))) == [LookupResult.HIT] * 3


def test_warmup_refuses_the_tiers_config_and_writes_nothing(model_dir, tmp_path):
    root = tmp_path / "cache"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": PROMPT}) + "\n")
    config = _write(tmp_path / "tiering.json", _tiering(root, model_id="tiny", model_path=str(model_dir)))
    for path in (config, REPO / "configs" / "vllm-tiering-disk.json"):
        out = _cli("warmup", str(prompts), "--model", str(model_dir), "--config", str(path), "--device", "cpu", code=2)
        assert out.stderr.startswith(f"error: config {path}: vLLM's TieringOffloadingSpec with TieredDiskTier"), (
            out.stderr
        )
        assert "not supported by the warm-up" in out.stderr and len(out.stderr.splitlines()) == 1
    assert not root.exists()
    cpu_only = _write(tmp_path / "cpu.json", {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30})
    out = _cli("warmup", str(prompts), "--model", str(model_dir), "--config", str(cpu_only), code=2)
    assert "spec_name 'CPUOffloadingSpec'" in out.stderr


def test_doctor_counts_the_tiers_disk_bytes_once_per_node(tmp_path):
    root = tmp_path / "cache"
    tiering = _write(tmp_path / "tiering.json", _tiering(root))
    tiered = _write(tmp_path / "tiered.json", _tiered(root))

    def disk_space(config: Path) -> dict:
        out = _cli("doctor", "--config", str(config), "--tp", "4", "--read-probe", "0", "--json", code=None)
        return {c["name"]: c for c in json.loads(out.stdout)["checks"]}

    per_node = disk_space(tiering)
    assert per_node["disk_space"]["facts"]["needed_bytes"] == 64 << 10, per_node["disk_space"]
    assert "per node" in per_node["disk_space"]["message"] and "TP 4 x" not in per_node["disk_space"]["message"]
    assert "(64.00 KiB per node)" in per_node["config"]["message"]
    per_rank = disk_space(tiered)
    assert per_rank["disk_space"]["facts"]["needed_bytes"] == 4 * (64 << 10)
    assert "TP 4 x disk_bytes" in per_rank["disk_space"]["message"]
    assert "(64.00 KiB per rank)" in per_rank["config"]["message"]
    # A spec whose disk tier the tools do not know is a failed config line, not a guess.
    cpu_only = _write(tmp_path / "cpu.json", {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30})
    out = _cli("doctor", "--config", str(cpu_only), "--read-probe", "0", "--json", code=2)
    line = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["config"]
    assert line["status"] == "fail" and "spec_name 'CPUOffloadingSpec'" in line["message"], line
    assert "disk tier the tools know" in line["fix"]
