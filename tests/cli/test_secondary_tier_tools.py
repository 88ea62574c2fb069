"""The operator tools on a disk cache written by vLLM's own ``TieringOffloadingSpec`` with
our ``TieredDiskTier``: ``inspect summary --config`` and ``inspect clear --unread-by``
judge its namespace by that tier's fingerprint (not ``TieredOffloadingSpec``'s),
``warmup`` writes that tier's namespace (whole CPU-tier rows) where a server of the same
config hits it and loads the model's own keys and values, and ``doctor`` counts its
``disk_bytes`` once per node. The attention backend is part of the namespace: servers
on two backends open two, the tools compute each, a config that starts its server on
one backend does not read the other's, and a warm-up for a backend writes the namespace
that backend's server reads. A config shape whose namespace the tools cannot compute,
or the warm-up cannot prove, is refused, and nothing is deleted or written.

The caches are real: vLLM's scheduler (tests/support/vllm_harness.py) with the tier
loaded by ``module_path`` writes them, and a fresh server of the same config finds
the blocks afterwards. Marked ``vllm``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec", reason="vLLM is not installed (make venv installs it)", exc_type=ImportError
)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from support.cli import run_cli, write_transfer_config  # noqa: E402
from support import vllm_harness as vh  # noqa: E402
from support import vllm_tiering  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tiered_kv.disk.format.namespace import list_namespaces  # noqa: E402
from tiered_kv.ops.server_namespace import server_disk  # noqa: E402
from tiered_kv.ops.warmup import VllmServe  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16  # GPU block size in tokens; one GPU block per chunk
CHUNK = 4096  # one chunk of write_model_config's model: one 4 KiB-aligned CPU-tier row
TIER_MODULE = "tiered_kv.integrations.vllm.secondary_tier"
REPO = Path(__file__).resolve().parents[2]
PROMPT = [100 + (i * 31) % 800 for i in range(3 * BLOCK + 1)]


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


def _server(model_dir: Path, extra: dict, *, backend: str | None = None, layout: str = "LBNHC") -> vh.VllmHarness:
    """vLLM's scheduler and connector with ``extra`` (an acknowledging worker), started
    with ``--attention-backend backend`` where given, its engine core having resolved
    the KV-cache layout ``layout`` (LBNHC: vLLM's choice for FlashAttention)."""
    config = vh.make_vllm_config(model_dir, extra, block_size=BLOCK, kv_cache_layout=layout)
    if backend is not None:
        config.attention_config.backend = AttentionBackendEnum[backend]
    kv_cache_config = vh.make_kv_cache_config(config, 32)
    # As vLLM's EngineCore builds it: no vLLM config is current in the scheduler process.
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )
    return vh.VllmHarness(config, kv_cache_config, scheduler, "ack")


def _namespace(h: vh.VllmHarness) -> str:
    """The disk namespace the server opened, whichever spec it runs."""
    tiers = getattr(h.manager, "secondary_tiers", None)
    if tiers:
        (tier,) = tiers
        return tier.fingerprint.namespace_id
    return h.manager.composite.tier("disk").namespace.path.name


def _fill(model_dir: Path, extra: dict, **server) -> str:
    """Serve ``PROMPT`` on a server with ``extra`` (``_server``); the namespace its disk
    tier wrote."""
    with _server(model_dir, extra, **server) as h:
        h.serve(PROMPT)
        tiers = getattr(h.manager, "secondary_tiers", None)
        if tiers:
            assert tiers[0].stats.stored == 3
        return _namespace(h)


def _disk_hits(model_dir: Path, extra: dict, **server) -> list[LookupResult]:
    """What a fresh server with ``extra`` (``_server``) finds on disk for ``PROMPT``'s chunks."""
    keys = [make_offload_key(k, 0) for k in vh.hash_blocks(PROMPT, BLOCK)]
    with _server(model_dir, extra, **server) as h:
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
    config = write_transfer_config(
        tmp_path / "tiering.json", _tiering(root, model_id="tiny", model_path=str(model_dir))
    )
    data = json.loads(run_cli("inspect", "summary", str(root), "--config", str(config), "--json").stdout)
    read = {ns["namespace"]: ns["read_by"][0] for ns in data["namespaces"]}
    assert read[ids["tier"]]["reads"] is True and read[ids["tier"]]["differences"] == []
    assert "unchecked" not in read[ids["tier"]]  # the whole namespace, rows and backend, computed
    assert read[ids["other"]]["reads"] is False
    assert any(d.startswith("model_id: ") for d in read[ids["other"]]["differences"])
    spec = read[ids["spec"]]
    assert spec["reads"] is False and any(d.startswith("layout: ") for d in spec["differences"])
    table = run_cli("inspect", "summary", str(root), "--config", str(config)).stdout
    assert "yes" in table and "whole CPU-tier rows" in table

    # The other way round: TieredOffloadingSpec's config does not read the tier's rows.
    tiered = write_transfer_config(tmp_path / "tiered.json", _tiered(root))
    data = json.loads(run_cli("inspect", "summary", str(root), "--config", str(tiered), "--json").stdout)
    read = {ns["namespace"]: ns["read_by"][0] for ns in data["namespaces"]}
    assert read[ids["spec"]]["reads"] is True
    assert read[ids["tier"]]["reads"] is False and read[ids["other"]]["reads"] is False
    assert any("vllm_cpu_chunk" in d for d in read[ids["tier"]]["differences"])


def test_clear_unread_by_keeps_the_tiers_namespace_and_its_blocks(model_dir, cache, tmp_path):
    root, ids = cache
    extra = _tiering(root, model_id="tiny", model_path=str(model_dir))
    config = write_transfer_config(tmp_path / "tiering.json", extra)
    dry = json.loads(run_cli("inspect", "clear", str(root), "--unread-by", str(config), "--dry-run", "--json").stdout)
    assert sorted(dry["removed"]) == sorted([ids["other"], ids["spec"]])
    cleared = json.loads(run_cli("inspect", "clear", str(root), "--unread-by", str(config), "--yes", "--json").stdout)
    assert sorted(cleared["removed"]) == sorted([ids["other"], ids["spec"]])
    assert _names(root) == {ids["tier"]}
    # The blocks are still there, and a server with that config still finds them.
    assert _disk_hits(model_dir, extra) == [LookupResult.HIT] * 3


def test_a_shape_the_tools_cannot_compute_is_refused_and_nothing_is_deleted(model_dir, cache, tmp_path):
    root, ids = cache
    cpu_only = write_transfer_config(
        tmp_path / "cpu.json", {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30}
    )
    named = {**_tiering(root), "spec_name": "MyTieringSpec", "spec_module_path": "my_tiering.spec"}
    renamed = write_transfer_config(tmp_path / "renamed.json", named)
    good = write_transfer_config(tmp_path / "tiering.json", _tiering(root, model_id="tiny", model_path=str(model_dir)))
    for bad, what in (
        (cpu_only, "spec_name 'CPUOffloadingSpec'"),
        (renamed, "spec_name 'MyTieringSpec'"),
    ):
        before = _names(root)
        out = run_cli("inspect", "clear", str(root), "--unread-by", str(good), "--unread-by", str(bad), "--yes", code=2)
        assert out.stderr.startswith(f"error: --config {bad}: config {bad}: {what}"), out.stderr
        assert "TieredDiskTier" in out.stderr and len(out.stderr.splitlines()) == 1
        assert _names(root) == before == set(ids.values())
        run_cli("inspect", "summary", str(root), "--config", str(bad), code=2)
    assert _disk_hits(model_dir, _tiering(root, model_id="tiny", model_path=str(model_dir))) == [LookupResult.HIT] * 3


def test_a_spec_module_path_beside_vllms_registered_spec_is_not_read(model_dir, cache, tmp_path):
    """vLLM loads ``TieringOffloadingSpec`` by its registered name and never reads a
    ``spec_module_path`` beside it: the tools judge that config as the server runs it."""
    root, ids = cache
    for module in ("tiered_kv.integrations.vllm", "my_tiering.spec"):
        extra = {**_tiering(root, model_id="tiny", model_path=str(model_dir)), "spec_module_path": module}
        config = write_transfer_config(tmp_path / "tiering.json", extra)
        data = json.loads(run_cli("inspect", "summary", str(root), "--config", str(config), "--json").stdout)
        read = {ns["namespace"]: ns["read_by"][0]["reads"] for ns in data["namespaces"]}
        assert read == {ids["tier"]: True, ids["other"]: False, ids["spec"]: False}, (module, read)
        assert _disk_hits(model_dir, extra) == [LookupResult.HIT] * 3  # and so does its server


def _serve_config(path: Path, extra: dict, backend: str) -> Path:
    """A ``vllm serve --config`` file that starts the server on ``backend``."""
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    path.write_text(json.dumps({"attention-backend": backend, "kv-transfer-config": transfer}))
    return path


def test_servers_on_two_attention_backends_open_two_namespaces_and_the_tools_tell_them_apart(model_dir, tmp_path):
    root = tmp_path / "cache"
    extra = _tiering(root, model_id="tiny", model_path=str(model_dir))
    # vLLM's CPU backend reads LBHNC only and FlashAttention any layout: the same one for both.
    flash = _fill(model_dir, extra, backend="FLASH_ATTN", layout="LBHNC")
    assert _disk_hits(model_dir, extra, backend="FLASH_ATTN", layout="LBHNC") == [LookupResult.HIT] * 3
    # A CPU_ATTN server orders a page otherwise: it never loads FlashAttention's rows.
    assert _disk_hits(model_dir, extra, backend="CPU_ATTN", layout="LBHNC") == [LookupResult.MISS] * 3
    cpu = _fill(model_dir, extra, backend="CPU_ATTN", layout="LBHNC")
    fps = {ns.path.name: ns.fingerprint for ns in list_namespaces(root)}
    assert set(fps) == {flash, cpu}
    assert fps[cpu].differences(fps[flash]) == ["attention_backend: 'CPU_ATTN' here, 'FLASH_ATTN' in the cache"]

    # Computed offline, per backend, by the function the warm-up and inspect use.
    plain = write_transfer_config(tmp_path / "tiering.json", extra)
    disk = server_disk(plain)
    for backend, ns in (("FLASH_ATTN", flash), ("CPU_ATTN", cpu)):
        fp = disk.vllm_fingerprint(VllmServe(str(model_dir), kv_cache_layout="LBHNC", attention_backend=backend))
        assert fp.namespace_id == ns

    # A config that leaves the backend to the server's flags reads either (as for TP or
    # the layout); one that starts its server on CPU_ATTN reads CPU_ATTN's alone.
    data = json.loads(run_cli("inspect", "summary", str(root), "--config", str(plain), "--json").stdout)
    assert [(ns["read_by"][0]["reads"], ns["read_by"][0]["differences"]) for ns in data["namespaces"]] == [
        (True, [])
    ] * 2
    on_cpu = _serve_config(tmp_path / "serve-cpu.json", extra, "CPU_ATTN")
    data = json.loads(run_cli("inspect", "summary", str(root), "--config", str(on_cpu), "--json").stdout)
    read = {ns["namespace"]: ns["read_by"][0] for ns in data["namespaces"]}
    assert read[cpu]["reads"] is True and read[cpu]["differences"] == [] and "unchecked" not in read[cpu]
    assert read[flash]["reads"] is False
    assert read[flash]["differences"] == ["attention_backend: 'CPU_ATTN' for the config, 'FLASH_ATTN' in the cache"]
    table = " ".join(run_cli("inspect", "summary", str(root), "--config", str(on_cpu)).stdout.split())
    assert "no: attention_backend: 'CPU_ATTN' for the config, 'FLASH_ATTN' in the cache" in table
    dry = json.loads(run_cli("inspect", "clear", str(root), "--unread-by", str(on_cpu), "--dry-run", "--json").stdout)
    assert dry["removed"] == [flash]


# ---------------------------------------------------------------- warm-up


def _save_llama(path: Path, layers: int = 2) -> Path:
    """A tiny Llama with weights, bfloat16, 2 KV heads of 16: with 2 layers one GPU block
    of every layer is one 4 KiB row, as in write_model_config's model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1000,
    )
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return _save_llama(tmp_path_factory.mktemp("tiny-llama"))


def _warm(weights_dir: Path, config: Path, prompts: Path, *extra: str, code: int = 0):
    return run_cli(
        "warmup",
        str(prompts),
        "--model",
        str(weights_dir),
        "--config",
        str(config),
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        *extra,
        code=code,
    )


def _prompts(tmp_path: Path, *prompts: list[int]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    return path


def _model_kv(weights_dir: Path, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's own per-layer (K, V), each (heads, tokens, head_dim), from its forward pass."""
    from tiered_kv.ops.warmup.engines import HFEngine

    engine = HFEngine.from_pretrained(str(weights_dir), dtype="bfloat16", device="cpu")
    return engine.kv(tokens)


def _page_is_the_models(page: bytes, k: torch.Tensor, v: torch.Tensor, block: int, heads=(0, 1)) -> bool:
    """One layer's page as vLLM's FlashAttention reads it under LBNHC, (tokens, heads,
    K|V) split with ``split(head_size, dim=-1)``, against the model's K and V of
    ``heads`` (a TP rank's)."""
    raw = torch.frombuffer(bytearray(page), dtype=torch.bfloat16).view(BLOCK, len(heads), 32)
    got_k, got_v = (x.permute(1, 0, 2) for x in raw.split(16, dim=-1))
    tokens, heads = slice(block * BLOCK, (block + 1) * BLOCK), list(heads)
    return torch.equal(got_k, k[heads, tokens]) and torch.equal(got_v, v[heads, tokens])


def test_a_warmup_with_the_tiers_config_is_hit_and_loads_the_models_kv(weights_dir, tmp_path):
    root = tmp_path / "cache"
    config = write_transfer_config(tmp_path / "tiering.json", _tiering(root, model_id="tiny-llama"))
    report = json.loads(_warm(weights_dir, config, _prompts(tmp_path, PROMPT), "--json").stdout)
    assert report["spec"] == "TieringOffloadingSpec" and report["layout"] == "vllm"
    assert report["blocks_written"] == 3 and report["bytes_written"] == 3 * CHUNK  # one row per chunk, one writer
    assert _names(root) == {report["namespace_id"]}
    extra = json.loads(config.read_text())["kv_connector_extra_config"]

    # A server built from the same config finds every chunk on disk and promotes it.
    with vh.VllmHarness.build(weights_dir, extra, num_gpu_blocks=32, kv_cache_layout="LBNHC") as h:
        (tier,) = h.manager.secondary_tiers
        assert tier.fingerprint.namespace_id == report["namespace_id"]
        assert h.serve(PROMPT).external == 3 * BLOCK
        assert tier.stats.promoted == 3 and tier.stats.stored == 0

    # The same server with vLLM's CPU worker (its row views) in place: the pages that land
    # in the "GPU" are the model's own keys and values, as the warm-up computed them.
    real = {**extra, "spec_name": "ShmTieringSpec", "spec_module_path": vllm_tiering.MODULE}
    with vh.VllmHarness.build(weights_dir, real, num_gpu_blocks=32, worker="real", kv_cache_layout="LBNHC") as h:
        req = h.add_request(PROMPT, max_tokens=2)
        deadline = time.monotonic() + 60
        while (r := h.scheduler.requests.get(req)) is None or r.num_computed_tokens < len(PROMPT):
            assert time.monotonic() < deadline, "the request never got its prompt's KV"
            h.step()
            time.sleep(0.001)
        pages = [
            [bytes(t[b].contiguous().view(torch.uint8).numpy()) for t in h.kv_caches.values()] for b in h.block_ids(req)
        ]
        h.run()
        assert h.prefix_hits[req].external == 3 * BLOCK
    kv = _model_kv(weights_dir, PROMPT)
    for block in range(3):
        assert all(_page_is_the_models(page, k, v, block) for page, (k, v) in zip(pages[block], kv))
    assert not all(_page_is_the_models(page, k, v, 3) for page, (k, v) in zip(pages[3], kv))  # computed, not loaded

    # A rerun finds every chunk and writes nothing.
    again = json.loads(_warm(weights_dir, config, _prompts(tmp_path, PROMPT), "--json").stdout)
    assert again["blocks_present"] == 3 and again["blocks_written"] == 0 and again["prompts_skipped"] == 1


def test_a_tp2_row_holds_each_ranks_heads_where_that_ranks_worker_reads_them(tmp_path):
    # Three layers: a rank's cell is 3 KiB, a row of two cells is padded to 8 KiB.
    model = _save_llama(tmp_path / "model", layers=3)
    root = tmp_path / "cache"
    config = write_transfer_config(tmp_path / "tiering.json", _tiering(root, model_id="tiny-llama"))
    report = json.loads(_warm(model, config, _prompts(tmp_path, PROMPT), "--tp", "2", "--json").stdout)
    assert report["blocks_written"] == 3 and report["bytes_written"] == 3 * 8192
    # vLLM's scheduler of a TP 2 server: its spec, CPU tier and our tier, from the same config.
    extra = json.loads(config.read_text())["kv_connector_extra_config"]
    vc = vh.make_vllm_config(model, extra, kv_cache_layout="LBNHC")
    vc.parallel_config.tensor_parallel_size = vc.parallel_config.world_size = 2
    with set_current_vllm_config(vc):
        spec = TieringOffloadingSpec(build_offloading_config(vc, vh.make_kv_cache_config(vc, 16)))
        manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert tier.fingerprint.namespace_id == report["namespace_id"]
        assert (spec.kv_bytes_per_chunk, spec.cpu_page_size_per_worker) == (8192, 3072)
        keys = [make_offload_key(k, 0) for k in vh.hash_blocks(PROMPT, BLOCK)]
        rows = np.array([3, 0, 2], dtype=np.int64)
        ctx = ReqContext(req_id="probe")
        with manager.lock:
            assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
            tier.submit_load(TransferJob(1, keys, rows, True, ctx))  # the promotion vLLM would start
        tier.drain_jobs()
        with manager.lock:
            assert [r.success for r in tier.get_finished_jobs()] == [True]
        kv = _model_kv(model, PROMPT)
        for rank in range(2):
            # The views vLLM's CPU worker of this rank copies pages from: one per layer.
            region = SharedOffloadRegion(
                engine_id=spec.config.engine_id,
                num_chunks=spec.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                cpu_page_size=spec.cpu_page_size_per_worker,
            )
            views = [region.create_next_worker_view(1024) for _ in kv]
            for block, row in enumerate(rows):
                pages = [bytes(view[row].view(torch.uint8).numpy()) for view in views]
                assert all(_page_is_the_models(p, k, v, block, heads=[rank]) for p, (k, v) in zip(pages, kv))
            padding = [bytes(region.base_tensor[r * 8192 + 6144 : (r + 1) * 8192].numpy()) for r in rows]
            views.clear()
            region.cleanup()
            assert padding == [bytes(2048)] * 3
    finally:
        manager.shutdown()


def test_the_shipped_tiering_config_warms_where_its_server_reads(weights_dir, tmp_path):
    shipped = json.loads((REPO / "configs" / "vllm-tiering-disk.json").read_text())
    extra = shipped["kv_connector_extra_config"]
    assert extra["secondary_tiers"][0]["model_id"] == "meta-llama/Llama-3.1-8B-Instruct"
    # As shipped, sized for a test: its disk tier is preallocated, so 1 TiB is not an option here.
    extra["cpu_bytes_to_use"] = 8 * CHUNK
    extra["secondary_tiers"][0]["disk_bytes"] = "64KiB"
    config = tmp_path / "shipped.json"
    config.write_text(json.dumps(shipped))
    root = tmp_path / "cache"
    report = json.loads(
        _warm(weights_dir, config, _prompts(tmp_path, PROMPT), "--disk-path", str(root), "--json").stdout
    )
    assert report["blocks_written"] == 3 and report["model_id"] == "meta-llama/Llama-3.1-8B-Instruct"
    extra["secondary_tiers"][0]["disk_path"] = str(root)
    with vh.VllmHarness.build(weights_dir, extra, num_gpu_blocks=32, kv_cache_layout="LBNHC") as h:
        assert h.serve(PROMPT).external == 3 * BLOCK


@pytest.mark.parametrize("spec", ["TieringOffloadingSpec", "TieredOffloadingSpec"])
def test_a_warmup_for_a_backend_writes_the_namespace_that_backends_server_reads(spec, weights_dir, tmp_path):
    root = tmp_path / "cache"
    extra = _tiering(root, model_id="tiny-llama") if spec == "TieringOffloadingSpec" else _tiered(root)
    extra.setdefault("model_id", "tiny-llama")
    config = write_transfer_config(tmp_path / "server.json", extra)
    prompts = _prompts(tmp_path, PROMPT)
    report = json.loads(_warm(weights_dir, config, prompts, "--attention-backend", "triton_attn", "--json").stdout)
    assert report["spec"] == spec and report["blocks_written"] == 3
    assert (report["attention_backend"], report["kv_cache_layout"]) == ("TRITON_ATTN", "LBNHC")
    table = " ".join(_warm(weights_dir, config, prompts, "--attention-backend", "TRITON_ATTN").stdout.split())
    assert "page order │ attention backend TRITON_ATTN over KV-cache layout LBNHC" in table
    # A server on that backend hits every chunk; one on vLLM's default reads another namespace.
    with _server(weights_dir, extra, backend="TRITON_ATTN") as h:
        assert _namespace(h) == report["namespace_id"]
        assert h.serve(PROMPT).external == 3 * BLOCK
    with _server(weights_dir, extra) as h:
        assert _namespace(h) != report["namespace_id"]
        assert h.serve(PROMPT).external == 0

    # Orders it cannot prove, or names vLLM does not know: one line each, nothing written.
    before = {ns.path.name: len(list(ns.path.iterdir())) for ns in list_namespaces(root)}
    cases = [
        (("--attention-backend", "CPU_ATTN"), "--attention-backend CPU_ATTN: the warm-up writes pages as FLASH_ATTN"),
        (("--attention-backend", "FAST_ATTN"), "--attention-backend: expected one of vLLM's attention backends"),
        (
            ("--attention-backend", "CPU_ATTN", "--kv-cache-layout", "LBNHC"),
            "--kv-cache-layout: LBNHC is not a layout the CPU_ATTN attention backend reads",
        ),
    ]
    for args, what in cases:
        out = _warm(weights_dir, config, prompts, *args, code=2)
        assert out.stderr.startswith(f"error: {what}"), out.stderr
        assert len(out.stderr.splitlines()) == 1
    assert {ns.path.name: len(list(ns.path.iterdir())) for ns in list_namespaces(root)} == before


def test_warmup_takes_the_backend_of_a_serve_config_and_refuses_another(weights_dir, tmp_path):
    root = tmp_path / "cache"
    extra = _tiering(root, model_id="tiny-llama")
    config = _serve_config(tmp_path / "serve.json", extra, "TRITON_ATTN")
    prompts = _prompts(tmp_path, PROMPT)
    out = _warm(weights_dir, config, prompts, "--attention-backend", "FLASH_ATTN", code=2)
    assert out.stderr.startswith(
        f"error: --attention-backend FLASH_ATTN: the config {config} starts the server with attention-backend "
        "TRITON_ATTN"
    )
    assert not root.exists()
    report = json.loads(_warm(weights_dir, config, prompts, "--json").stdout)
    assert report["attention_backend"] == "TRITON_ATTN" and report["blocks_written"] == 3
    with _server(weights_dir, extra, backend="TRITON_ATTN") as h:
        assert _namespace(h) == report["namespace_id"] and h.serve(PROMPT).external == 3 * BLOCK


def test_warmup_refuses_what_it_cannot_prove_and_writes_nothing(weights_dir, tmp_path):
    root = tmp_path / "cache"
    prompts = _prompts(tmp_path, PROMPT)
    cases = [
        (_tiering(root), "model_id: the config sets none", "to its TieredDiskTier entry"),
        (
            {**_tiering(root, model_id="tiny-llama"), "canonical_layout": True},
            "canonical_layout: vLLM's CPU tier then holds its canonical pages",
            "remove canonical_layout",
        ),
        (
            _tiering(root, model_id="tiny-llama", block_size=32),
            "TieredDiskTier entry: block_size: not a setting of the TieredDiskTier secondary tier",
            "set block_size in kv_connector_extra_config",
        ),
    ]
    for n, (extra, what, fix) in enumerate(cases):
        config = write_transfer_config(tmp_path / f"bad{n}.json", extra)
        out = _warm(weights_dir, config, prompts, code=2)
        assert out.stderr.startswith("error: ") and what in out.stderr, out.stderr
        assert fix in out.stderr and len(out.stderr.splitlines()) == 1
    good = write_transfer_config(tmp_path / "tiering.json", _tiering(root, model_id="tiny-llama"))
    out = _warm(weights_dir, good, prompts, "--layout", "kv-first", code=2)
    assert out.stderr.startswith("error: --layout kv-first: vLLM's TieringOffloadingSpec with TieredDiskTier reads")
    cpu_only = write_transfer_config(
        tmp_path / "cpu.json", {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30}
    )
    out = _warm(weights_dir, cpu_only, prompts, code=2)
    assert "spec_name 'CPUOffloadingSpec'" in out.stderr and len(out.stderr.splitlines()) == 1
    assert not root.exists()


def test_doctor_counts_the_tiers_disk_bytes_once_per_node(tmp_path):
    root = tmp_path / "cache"
    tiering = write_transfer_config(tmp_path / "tiering.json", _tiering(root))
    tiered = write_transfer_config(tmp_path / "tiered.json", _tiered(root))

    def disk_space(config: Path) -> dict:
        out = run_cli("doctor", "--config", str(config), "--tp", "4", "--read-probe", "0", "--json", code=None)
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
    cpu_only = write_transfer_config(
        tmp_path / "cpu.json", {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30}
    )
    out = run_cli("doctor", "--config", str(cpu_only), "--read-probe", "0", "--json", code=2)
    line = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["config"]
    assert line["status"] == "fail" and "spec_name 'CPUOffloadingSpec'" in line["message"], line
    assert "disk tier the tools know" in line["fix"]
