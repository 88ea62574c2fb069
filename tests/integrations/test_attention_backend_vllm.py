"""The disk namespace names what decides a page's byte order under vLLM: the attention
backend whose kernels write the pages and the KV-cache layout vLLM resolved. Servers that
differ in either read different namespaces of the same cache directory; a server started
on another backend logs which field keeps it from the old one; a worker whose attention
layers run another backend than the one its scheduler names refuses to start, naming it.
The operator tools compute each backend's namespace offline, and ``inspect summary
--config`` says a config that starts its server on one backend does not read the other's.

The engines are vLLM 0.33's real scheduler and worker connector (tests/support/vllm_harness.py)
with real vLLM ``Attention`` layers, each built on the backend under test, loaded in the
engine's config as vLLM's model loader leaves them. Marked ``vllm``.
"""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention.attention import Attention  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tiered_kv.config import ConfigError  # noqa: E402
from tiered_kv.disk.format.namespace import list_namespaces  # noqa: E402
from tiered_kv.fingerprint import Fingerprint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 16
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}
PROMPT = [100 + (i * 31) % 800 for i in range(3 * BLOCK + 2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(
        tmp_path_factory.mktemp("model"),
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )


def _extra(disk, **more) -> dict:
    return {**SPEC, "cpu_bytes": "64KiB", "disk_path": str(disk), "disk_bytes": "1MiB", **more}


def _load_attention_layers(config, backend: str) -> None:
    """vLLM's attention layers of the model, each on ``backend``, registered in
    ``config`` as vLLM's model loader leaves them in a worker (and in an engine core
    that runs the model itself)."""
    cls = AttentionBackendEnum[backend].get_class()
    with set_current_vllm_config(config):
        for i in range(LAYERS):
            Attention(
                HEADS,
                HEAD_DIM,
                HEAD_DIM**-0.5,
                num_kv_heads=KV_HEADS,
                prefix=f"model.layers.{i}.self_attn.attn",
                attn_backend=cls,
            )


def _engine(model_dir, disk, backend: str, *, layout: str = "LBHNC", flag: bool = True, **more) -> vh.VllmHarness:
    """A live engine whose attention layers run ``backend`` over the KV-cache layout
    ``layout``, started with ``--attention-backend backend`` where ``flag``; ``more``:
    more keys of the spec's config."""
    config = vh.make_vllm_config(model_dir, _extra(disk, **more), block_size=BLOCK, kv_cache_layout=layout)
    if flag:
        config.attention_config.backend = AttentionBackendEnum[backend]
    _load_attention_layers(config, backend)
    kv_cache_config = vh.make_kv_cache_config(config, 64)
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )
    engine = vh.VllmHarness(config, kv_cache_config, scheduler, "real")
    try:
        engine._build_worker()
    except BaseException:
        engine.shutdown()
        raise
    return engine


def _serve(engine: vh.VllmHarness) -> int:
    """Serve ``PROMPT`` on a cold GPU cache; the tokens the connector supplied. Waits
    until the stores are durable on disk."""
    req_id = engine.add_request(PROMPT)
    engine.settle()
    while engine.manager.composite.pending_writes():
        engine.wait_background()
    return engine.prefix_hits[req_id].external


def _namespace(engine: vh.VllmHarness) -> str:
    """The namespace the scheduler opened; the worker computes the same one."""
    opened = engine.manager.composite.tier("disk").namespace.path.name
    assert engine.worker_spec.geometry.fingerprint.namespace_id == opened
    return opened


def test_two_servers_differing_only_in_attention_backend_read_different_namespaces(model_dir, tmp_path, caplog):
    disk = tmp_path / "disk"
    with _engine(model_dir, disk, "FLASH_ATTN") as flash:
        assert _serve(flash) == 0
        flash_ns = _namespace(flash)
        fp = flash.worker_spec.geometry.fingerprint
        assert fp.attention_backend == "FLASH_ATTN" and "kv_cache_layout=LBHNC" in fp.kv_layout
    # vLLM's CPU backend reads an LBHNC page as each head's keys, then its values:
    # FlashAttention's pages over the same layout are not its KV.
    caplog.set_level(logging.INFO)
    with _engine(model_dir, disk, "CPU_ATTN") as cpu:
        assert _serve(cpu) == 0, "a CPU_ATTN server loaded FLASH_ATTN pages"
        cpu_ns = _namespace(cpu)
        assert cpu.worker_spec.geometry.fingerprint.differences(fp) == [
            "attention_backend: 'CPU_ATTN' here, 'FLASH_ATTN' in the cache"
        ]
    assert cpu_ns != flash_ns
    assert f"not serving disk cache namespace {flash_ns}" in caplog.text
    assert "attention_backend: 'CPU_ATTN' here, 'FLASH_ATTN' in the cache" in caplog.text
    assert {ns.path.name: ns.fingerprint.attention_backend for ns in list_namespaces(disk)} == {
        flash_ns: "FLASH_ATTN",
        cpu_ns: "CPU_ATTN",
    }
    # The FlashAttention namespace is still there, and a FlashAttention server reads it.
    with _engine(model_dir, disk, "FLASH_ATTN") as again:
        assert _namespace(again) == flash_ns
        assert _serve(again) == 3 * BLOCK
    # A cache written before the field existed records no backend: never read again.
    older = Fingerprint.from_dict({k: v for k, v in fp.to_dict().items() if k != "attention_backend"})
    assert older.namespace_id != flash_ns
    assert fp.differences(older) == ["attention_backend: 'FLASH_ATTN' here, None in the cache"]


def test_two_servers_differing_only_in_kv_cache_layout_read_different_namespaces(model_dir, tmp_path):
    disk = tmp_path / "disk"
    fps = {}
    for layout in ("LBNHC", "LBHNC"):
        # The harness's tensors are head-major whatever the layout: the canary, which
        # reads them through the layout, is off (tests/integrations/test_vllm_canary.py).
        with _engine(model_dir, disk, "FLASH_ATTN", layout=layout, canary=False) as engine:
            fps[layout] = engine.worker_spec.geometry.fingerprint
            assert _namespace(engine) == fps[layout].namespace_id
    assert fps["LBNHC"].namespace_id != fps["LBHNC"].namespace_id
    (line,) = fps["LBNHC"].differences(fps["LBHNC"])
    assert line.startswith("kv_layout: ") and "'kv_cache_layout=LBNHC'" in line and "'kv_cache_layout=LBHNC'" in line


def test_a_worker_on_another_backend_than_its_scheduler_names_refuses_to_start(model_dir, tmp_path):
    """vLLM's scheduler process has no attention layers: it names vLLM's choice for the
    model (here, where vLLM selects none, FLASH_ATTN). Layers that run another backend
    would write pages in an order the namespace does not name."""
    with pytest.raises(ConfigError) as err:
        _engine(model_dir, tmp_path / "disk", "CPU_ATTN", flag=False)
    message = str(err.value)
    assert message.startswith("attention_backend: vLLM's attention layers here use CPU_ATTN")
    assert "names FLASH_ATTN in the disk namespace" in message
    assert "start vLLM with --attention-backend CPU_ATTN" in message
    assert not list_namespaces(tmp_path / "disk"), "a namespace was opened for pages in an unnamed order"


def test_the_scheduler_without_layers_names_what_the_workers_run(model_dir, tmp_path):
    """vLLM's multiprocess engine: the scheduler's connector is built where no attention
    layer is loaded, with no vLLM config current; its namespace is the worker's."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    configs = []
    for role in ("scheduler", "worker"):
        config = vh.make_vllm_config(model_dir, _extra(tmp_path / "disk"), engine_id="e1", kv_cache_layout="LBHNC")
        config.attention_config.backend = AttentionBackendEnum.CPU_ATTN  # vllm serve --attention-backend CPU_ATTN
        if role == "worker":
            _load_attention_layers(config, "CPU_ATTN")
        configs.append(config)
    kv_cache_config = vh.make_kv_cache_config(configs[0], 64)
    scheduler = OffloadingConnector(configs[0], KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        with set_current_vllm_config(configs[1]):
            worker = OffloadingConnector(configs[1], KVConnectorRole.WORKER, kv_cache_config)
        worker.shutdown()
        fp = worker.connector_worker.spec.geometry.fingerprint
        assert fp.attention_backend == "CPU_ATTN"
        assert scheduler.connector_scheduler.manager.composite.tier("disk").namespace.path.name == fp.namespace_id
    finally:
        scheduler.shutdown()


def test_the_tools_compute_each_backends_namespace_and_a_config_on_another_backend_does_not_read_it(
    model_dir, tmp_path
):
    from typer.testing import CliRunner

    from tiered_kv.cli import _load_commands, app
    from tiered_kv.ops.server_namespace import server_disk
    from tiered_kv.ops.warmup import VllmServe

    disk = tmp_path / "disk"
    served = {}
    for backend in ("FLASH_ATTN", "CPU_ATTN"):
        with _engine(model_dir, disk, backend) as engine:
            _serve(engine)
            served[backend] = _namespace(engine)
    extra = _extra(disk)
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    plain = tmp_path / "kv.json"
    plain.write_text(json.dumps(transfer))
    for backend, ns in served.items():
        serve = VllmServe(str(model_dir), kv_cache_layout="LBHNC", attention_backend=backend)
        fp = server_disk(plain).vllm_fingerprint(serve)
        assert fp.namespace_id == ns

    _load_commands()

    def read_by(config) -> dict[str, dict]:
        args = ["inspect", "summary", str(disk), "--config", str(config), "--model", str(model_dir), "--json"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        return {ns["namespace"]: ns["read_by"][0] for ns in json.loads(result.stdout)["namespaces"]}

    # The backend is a server flag: a config that does not set it reads either namespace.
    assert {ns: (r["reads"], r["differences"]) for ns, r in read_by(plain).items()} == {
        ns: (True, []) for ns in served.values()
    }
    # vllm serve --config with attention-backend: CPU_ATTN reads CPU_ATTN's namespace alone.
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"attention-backend": "cpu_attn", "kv-transfer-config": transfer}))
    read = read_by(serve)
    assert read[served["CPU_ATTN"]]["reads"] is True and read[served["CPU_ATTN"]]["differences"] == []
    assert read[served["FLASH_ATTN"]]["reads"] is False
    assert read[served["FLASH_ATTN"]]["differences"] == [
        "attention_backend: 'CPU_ATTN' for the config, 'FLASH_ATTN' in the cache"
    ]
