"""Every operator tool computes the namespace the server its config names would read, for
every shape of config the project documents:

- ``TieredOffloadingSpec`` with ``disk_path`` (and ``disk_bytes``);
- ``TieredOffloadingSpec`` with ``"tiers": [{"type": "disk", "path": ..., "bytes": ...}]``;
- ``TieredOffloadingSpec`` with a disk tier and a shared tier (a real Ceph RGW,
  tests/support/s3_server.py; skipped, saying why, where it cannot run), in both forms:
  ``disk_path`` with ``remote``, and two ``tiers`` entries;
- vLLM's ``TieringOffloadingSpec`` with our ``TieredDiskTier`` in ``secondary_tiers``.

For each, a real server (vLLM's scheduler and connector, tests/support/vllm_harness.py)
built from the config writes a cache, as does one of another model id beside it; then
``inspect summary --config`` says the server reads its namespace and not the other,
``inspect clear --unread-by`` keeps it (and its blocks) and removes the other,
``warmup --config`` writes that very namespace, which a server built from the same config
then hits, and ``server_namespace.ServerDisk.vllm_fingerprint`` computes it offline.
Marked ``vllm``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec", reason="vLLM is not installed (make venv installs it)", exc_type=ImportError
)
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from support.cli import run_cli, write_transfer_config  # noqa: E402
from support import vllm_harness as vh  # noqa: E402

from tiered_kv.disk.format.namespace import list_namespaces  # noqa: E402
from tiered_kv.ops.inspect import read_entries  # noqa: E402
from tiered_kv.ops.server_namespace import server_disk  # noqa: E402
from tiered_kv.ops.warmup import VllmServe  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16  # GPU block size in tokens; one GPU block per chunk
CHUNK = 4096  # one GPU block of every layer of the model below: one 4 KiB-aligned row
#: What the first server serves (the cache the tools judge), and what is warmed.
SERVED = [100 + (i * 31) % 800 for i in range(3 * BLOCK + 1)]
WARMED = [200 + (i * 17) % 700 for i in range(4 * BLOCK + 5)]
TIERED = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


def _disk_path(root: Path, remote: dict | None, model_id: str) -> dict:
    return {**TIERED, "cpu_bytes": "64KiB", "disk_path": str(root), "disk_bytes": "256KiB", "model_id": model_id}


def _tiers(root: Path, remote: dict | None, model_id: str) -> dict:
    return {
        **TIERED,
        "cpu_bytes": "64KiB",
        "tiers": [{"type": "disk", "path": str(root), "bytes": "256KiB"}],
        "model_id": model_id,
    }


def _disk_path_and_remote(root: Path, remote: dict | None, model_id: str) -> dict:
    return {**_disk_path(root, remote, model_id), "remote": remote}


def _tiers_disk_and_remote(root: Path, remote: dict | None, model_id: str) -> dict:
    extra = _tiers(root, remote, model_id)
    extra["tiers"].append({"type": "remote", **(remote or {})})
    return extra


def _tiering(root: Path, remote: dict | None, model_id: str) -> dict:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8 * CHUNK,
        "secondary_tiers": [
            {
                "type": "TieredDiskTier",
                "module_path": "tiered_kv.integrations.vllm.secondary_tier",
                "disk_path": str(root),
                "disk_bytes": "256KiB",
                "model_id": model_id,
            }
        ],
    }


#: shape -> (extra config of a server with its disk tier at root, whether it has a shared tier)
SHAPES: dict[str, tuple[Callable[[Path, dict | None, str], dict], bool]] = {
    "disk_path": (_disk_path, False),
    "tiers-disk": (_tiers, False),
    "disk_path-and-remote": (_disk_path_and_remote, True),
    "tiers-disk-and-remote": (_tiers_disk_and_remote, True),
    "tiering-TieredDiskTier": (_tiering, False),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama with weights (the warm-up computes its KV): bfloat16, 2 layers of 2 KV
    heads of 16, so one GPU block of every layer is 4 KiB."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1000,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _server(model_dir: Path, extra: dict, **kw) -> vh.VllmHarness:
    # LBNHC: the KV-cache layout a FlashAttention server records (and the warm-up's default).
    return vh.VllmHarness.build(model_dir, extra, num_gpu_blocks=32, kv_cache_layout="LBNHC", **kw)


def _disk_namespace(h: vh.VllmHarness) -> str:
    tiers = getattr(h.manager, "secondary_tiers", None)
    if tiers:
        (tier,) = tiers
        return tier.fingerprint.namespace_id
    return h.manager.composite.tier("disk").namespace.path.name


def _fill(model_dir: Path, extra: dict) -> str:
    """Serve ``SERVED`` on a server with ``extra``, its blocks written to disk; the
    namespace its disk tier wrote."""
    if extra.get("spec_name") == "TieredOffloadingSpec":
        # Our spec's workers write the disk tier: run them. The harness's tensors are
        # head-major whatever layout is declared, so the start-up canary, which reads them
        # through the declared layout, is off (tests/integrations/test_vllm_canary.py).
        with _server(model_dir, {**extra, "canary": False}, worker="real") as h:
            h.serve(SERVED)
            return _disk_namespace(h)
    # vLLM's tiering: the scheduler writes the tier below its CPU tier (its CPU worker
    # needs CUDA; the rows' bytes are tests/cli/test_secondary_tier_tools.py's business).
    with _server(model_dir, extra) as h:
        h.serve(SERVED)
        return _disk_namespace(h)


def _blocks(root: Path) -> dict[str, int]:
    return {ns.path.name: len(read_entries(ns)) for ns in list_namespaces(root)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_tool_answers_for_the_namespace_its_server_reads(shape, model_dir, tmp_path, request):
    build, shared = SHAPES[shape]
    remote = request.getfixturevalue("remote_settings") if shared else None
    root = tmp_path / "cache"
    extra = build(root, remote, "tiny-llama")
    config = write_transfer_config(tmp_path / "server.json", extra)

    # A real cache: the server's namespace, and another model's beside it.
    served = _fill(model_dir, extra)
    stray = _fill(model_dir, build(root, remote, "another-model"))
    assert served != stray and _blocks(root) == {served: 3, stray: 3}
    # The whole namespace, computed offline from the config and the model as every tool does.
    serve = VllmServe(str(model_dir), kv_cache_layout="LBNHC")
    assert server_disk(config).vllm_fingerprint(serve).namespace_id == served

    # inspect summary --config: that server reads its namespace, not the other.
    data = json.loads(
        run_cli("inspect", "summary", str(root), "--config", str(config), "--model", str(model_dir), "--json").stdout
    )
    read = {ns["namespace"]: ns["read_by"][0] for ns in data["namespaces"]}
    assert read[served]["reads"] is True and read[served]["differences"] == [], read[served]
    assert read[stray]["reads"] is False
    assert any(d.startswith("model_id: ") for d in read[stray]["differences"]), read[stray]

    # inspect clear --unread-by: keeps it, blocks and all; removes the other.
    cleared = json.loads(run_cli("inspect", "clear", str(root), "--unread-by", str(config), "--yes", "--json").stdout)
    assert cleared["removed"] == [stray]
    assert _blocks(root) == {served: 3}

    # warmup --config: writes that very namespace, and a server from the same config hits it.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": WARMED}) + "\n")
    report = json.loads(
        run_cli(
            "warmup",
            str(prompts),
            "--model",
            str(model_dir),
            "--config",
            str(config),
            "--device",
            "cpu",
            "--json",
        ).stdout
    )
    assert report["namespace_id"] == served and report["blocks_written"] == 4
    assert _blocks(root) == {served: 7}
    with _server(model_dir, extra) as h:
        assert _disk_namespace(h) == served
        if shared:
            assert h.manager.tier("remote") is not None  # the server has its shared tier too
        hit = h.serve(WARMED)
    assert hit.external == 4 * BLOCK and hit.local == 0


@pytest.mark.parametrize("shape", ["disk_path", "tiers-disk", "tiering-TieredDiskTier"])
def test_disk_path_moves_the_servers_first_disk_tier_whichever_form_names_it(shape, model_dir, tmp_path):
    build, _ = SHAPES[shape]
    configured, elsewhere = tmp_path / "configured", tmp_path / "elsewhere"
    config = write_transfer_config(tmp_path / "server.json", build(configured, None, "tiny-llama"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": WARMED}) + "\n")
    args = ("warmup", str(prompts), "--model", str(model_dir), "--config", str(config), "--device", "cpu")
    report = json.loads(run_cli(*args, "--disk-path", str(elsewhere), "--json").stdout)
    assert Path(report["namespace"]).parent == elsewhere and not configured.exists()
    # The same tier moved: its capacity is the config's, not a default one's.
    (summary,) = json.loads(run_cli("inspect", "summary", str(elsewhere), "--json").stdout)["namespaces"]
    assert summary["blocks"] == 4 and summary["num_slots"] * summary["slot_bytes"] == 256 << 10
    with _server(model_dir, build(elsewhere, None, "tiny-llama")) as h:
        assert _disk_namespace(h) == report["namespace_id"]
        assert h.serve(WARMED).external == 4 * BLOCK


def _serve_file(path: Path, model_dir: Path, extra: dict, **flags) -> Path:
    """A ``vllm serve --config`` file for ``model_dir`` with ``flags`` (its keys as vLLM's
    flags are spelled) and ``extra`` as its ``kv_connector_extra_config``."""
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    path.write_text(json.dumps({"model": str(model_dir), **flags, "kv-transfer-config": transfer}))
    return path


def test_warmup_and_summary_take_the_serve_files_block_size_dtype_and_tp(model_dir, tmp_path):
    """A ``vllm serve --config`` file's ``block-size``, ``dtype`` and
    ``tensor-parallel-size`` start its server: ``warmup --config`` writes for them (an
    option that contradicts one is refused, naming both values) and ``inspect summary
    --config`` judges by them."""
    root = tmp_path / "cache"
    extra = _disk_path(root, None, "tiny-llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": WARMED}) + "\n")
    warm = ("warmup", str(prompts), "--model", str(model_dir), "--device", "cpu")

    serve = _serve_file(tmp_path / "serve.json", model_dir, extra, **{"block-size": 32, "dtype": "float16"})
    out = run_cli(*warm, "--config", str(serve), "--gpu-block-size", "16", code=2)
    assert (
        out.stderr.startswith(f"error: --gpu-block-size 16: the config {serve} starts the server with block-size 32")
        and len(out.stderr.splitlines()) == 1
    ), out.stderr
    out = run_cli(*warm, "--config", str(serve), "--dtype", "bfloat16", code=2)
    assert "--dtype bfloat16" in out.stderr and "dtype float16" in out.stderr, out.stderr
    assert not root.exists()
    report = json.loads(run_cli(*warm, "--config", str(serve), "--json").stdout)
    assert report["blocks_written"] == len(WARMED) // 32
    with _server(model_dir, {**extra, "canary": False}, block_size=32, model_kwargs={"dtype": "float16"}) as h:
        assert _disk_namespace(h) == report["namespace_id"]
        assert h.serve(WARMED).external == len(WARMED) // 32 * 32

    # TP 2 in the file: the warm-up writes TP 2's namespace, which the tools compute for
    # that file, and the summary says that file's server does not read TP 1's.
    tp1 = _fill(model_dir, extra)
    tp2 = _serve_file(tmp_path / "tp2.json", model_dir, extra, **{"tensor-parallel-size": 2})
    out = run_cli(*warm, "--config", str(tp2), "--tp", "1", code=2)
    assert out.stderr.startswith(f"error: --tp 1: the config {tp2} starts the server with tensor-parallel-size 2")
    report = json.loads(run_cli(*warm, "--config", str(tp2), "--json").stdout)
    expected = server_disk(tp2).vllm_fingerprint(VllmServe(str(model_dir), kv_cache_layout="LBNHC"))
    assert report["namespace_id"] == expected.namespace_id != tp1 and expected.tp_size == 2
    summary = run_cli("inspect", "summary", str(root), "--config", str(tp2), "--model", str(model_dir), "--json")
    read = {ns["namespace"]: ns["read_by"][0]["reads"] for ns in json.loads(summary.stdout)["namespaces"]}
    assert read[tp1] is False and read[report["namespace_id"]] is True, read
