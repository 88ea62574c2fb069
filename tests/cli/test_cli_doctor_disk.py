"""``tiered-kv doctor`` against the mistakes that cost an operator a disk or a day: a
``disk_path`` below a mount point with nothing mounted (judged from a mountinfo table in
the kernel's format, over real directories), the engine refusing to create a missing
mount point, every config the repository ships read (both vLLM specs), TP read from a
``vllm serve --config`` file or said to be assumed, the disk's O_DIRECT read timed
against the model's break-even, and an HTTP server answering a bare 404 refused as an S3
endpoint (a real ``http.server`` on a free port)."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import app
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.config_file import read_server_config
from tiered_kv.disk.format.namespace import NamespaceError
from tiered_kv.model_identity import read_config_file
from tiered_kv.ops import doctor as dr
from tiered_kv.ops.presets import find_preset

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.json"))
runner = CliRunner()


def mountinfo(tmp_path: Path, mounts: dict[str, tuple[str, str]]) -> Path:
    """A /proc/self/mountinfo-format table: mount point -> (fs type, source)."""
    lines = [
        f"{i + 20} 1 259:{i} / {point} rw,relatime shared:{i} - {kind} {source} rw"
        for i, (point, (kind, source)) in enumerate(mounts.items())
    ]
    path = tmp_path / "mountinfo"
    path.write_text("\n".join(lines) + "\n")
    return path


def disk_cfg(path: Path) -> TieredConfig:
    return TieredConfig.from_dict({"disk_path": str(path), "disk_bytes": "1GiB"})


def test_an_unmounted_mount_point_is_flagged(tmp_path):
    root_only = mountinfo(tmp_path, {"/": ("ext4", "/dev/vda")})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    wanted = mnt / "nvme" / "tiered-kv"
    # The mount point itself is missing: the server would refuse to start.
    missing = dr.check_disk_path(disk_cfg(wanted), root_only)
    assert missing.status == "fail" and f"{mnt / 'nvme'} does not exist" in missing.message
    assert "mounted" in missing.message and f"mount the NVMe at {mnt / 'nvme'}" in missing.fix
    assert not (mnt / "nvme").exists()
    # The mount point exists but nothing is mounted on it: the root file system answers.
    (mnt / "nvme").mkdir()
    unmounted = dr.check_disk_path(disk_cfg(wanted), root_only)
    assert unmounted.status == "warn" and "root file system" in unmounted.message
    assert "ext4 on /dev/vda (mounted at /)" in unmounted.message and unmounted.facts["root_filesystem"]
    # Mounted there: the path is judged on the NVMe's file system.
    mounted = mountinfo(tmp_path, {"/": ("ext4", "/dev/vda"), str(mnt / "nvme"): ("xfs", "/dev/nvme0n1")})
    ok = dr.check_disk_path(disk_cfg(wanted), mounted)
    assert ok.status == "ok" and "will be created on xfs on /dev/nvme0n1" in ok.message, ok.message
    assert ok.facts["filesystem"] == {"type": "xfs", "mount_point": str(mnt / "nvme"), "source": "/dev/nvme0n1"}


def test_the_engine_refuses_to_create_a_missing_mount_point(tmp_path):
    from tiered_kv.disk.format.namespace_dir import prepare_cache_dir

    (tmp_path / "mnt").mkdir()
    with pytest.raises(NamespaceError, match=f"{tmp_path / 'mnt' / 'nvme'} does not exist"):
        prepare_cache_dir(tmp_path / "mnt" / "nvme" / "tiered-kv", create=True)
    assert list((tmp_path / "mnt").iterdir()) == []
    root, fd, made = prepare_cache_dir(tmp_path / "mnt" / "tiered-kv", create=True)
    import os

    os.close(fd)
    assert made == [root] and root.is_dir()


@pytest.mark.parametrize("owner, mode", [(12345, 0o700), (None, 0o777), (None, 0o1777), (None, 0o770)])
def test_a_disk_path_another_user_can_write_is_refused_and_the_doctor_says_so(tmp_path, owner, mode):
    """Whoever can write disk_path can move an engine's namespace away (its durable
    blocks with it) or plant one under the name its next start opens."""
    import os

    from tiered_kv.testing.harness import Hierarchy

    shared = tmp_path / "tiered-kv"
    shared.mkdir()
    shared.chmod(mode)
    if owner is not None:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(shared, owner, owner)
    mounted = mountinfo(tmp_path, {"/": ("ext4", "/dev/vda"), str(tmp_path): ("xfs", "/dev/nvme0n1")})
    check = dr.check_disk_path(disk_cfg(shared), mounted)
    assert check.status == "fail" and f"owned by uid {owner or os.geteuid()} with mode {mode:o}" in check.message
    assert f"chmod go-w {shared}" in check.fix
    with pytest.raises(NamespaceError, match="another user could remove or replace the cache in it; expected"):
        Hierarchy(str(shared), cpu_blocks=4, disk_blocks=8)
    assert list(shared.iterdir()) == []
    shared.chmod(0o755)
    os.chown(shared, os.geteuid(), os.getegid())
    assert dr.check_disk_path(disk_cfg(shared), mounted).status == "ok"
    Hierarchy(str(shared), cpu_blocks=4, disk_blocks=8).close()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_read(path, tmp_path):
    found = read_server_config(path)
    cfg = dr.read_config(path)
    assert cfg.disk_tier.settings.path == "/mnt/nvme/tiered-kv" and cfg.disk_tier.settings.bytes > 0
    code, data = _doctor("--config", str(path), "--read-probe", "0")
    line = {c["name"]: c for c in data["checks"]}["config"]
    # No TP in the file nor on the command line: checked at TP 1, a warning saying so.
    assert line["status"] == "warn" and "TP 1 assumed" in line["message"] and "--tp N" in line["fix"], line
    assert code >= 1 and line["facts"]["tp_assumed"] is True
    # inspect --config and warmup --config read it through the same reader.
    assert read_config_file(path) == found.extra_for()
    from tiered_kv.ops.warmup.inputs import load_config

    assert load_config(path).disk_tier == cfg.disk_tier
    result = runner.invoke(app, ["inspect", "summary", str(tmp_path), "--config", str(path), "--json"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    if found.spec_name == "TieringOffloadingSpec":
        assert "cpu_bytes_to_use" in line["message"]
        assert (
            dr.read_config(path, tp=4).cpu_bytes
            == json.loads(path.read_text())["kv_connector_extra_config"]["cpu_bytes_to_use"] // 4
        )


def test_tp_from_a_vllm_serve_config_file_and_from_the_option(tmp_path):
    inner = json.loads((REPO / "configs" / "llama-3.1-8b-1xh100.json").read_text())
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"tensor-parallel-size": 4, "kv-transfer-config": json.dumps(inner)}))
    _, data = _doctor("--config", str(serve), "--read-probe", "0")
    checks = {c["name"]: c for c in data["checks"]}
    assert "TP 4 (from the config)" in checks["config"]["message"] and checks["config"]["facts"]["tp"] == 4
    _, data = _doctor("--config", str(serve), "--tp", "2", "--read-probe", "0")
    assert "TP 2 (--tp)" in {c["name"]: c for c in data["checks"]}["config"]["message"]
    yaml = pytest.importorskip("yaml")
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text(
        yaml.safe_dump(
            {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "tensor-parallel-size": 8,
                "kv-transfer-config": json.dumps(inner),
            }
        )
    )
    found = read_server_config(serve_yaml)
    assert found.tp == 8 and found.extra == inner["kv_connector_extra_config"]
    no_tier = tmp_path / "bare.json"
    no_tier.write_text(json.dumps({"tensor-parallel-size": 2}))
    with pytest.raises(ConfigError, match="without kv-transfer-config holds no tier settings"):
        read_server_config(no_tier)
    fs_only = tmp_path / "fs-only.json"
    fs_only.write_text(
        json.dumps(
            {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1 << 30,
                "secondary_tiers": [{"type": "fs", "root": "/tmp/x"}],
            }
        )
    )
    with pytest.raises(ConfigError, match="TieringOffloadingSpec with 0 TieredDiskTier entries"):
        read_server_config(fs_only)


def test_a_serve_config_names_its_attention_backend_either_way_vllm_takes(tmp_path):
    """``attention-backend: X`` or ``attention-config: {backend: X}`` (a mapping, JSON
    text, or the dotted key): the same server, the same namespace; two names refused."""
    inner = json.dumps(json.loads((REPO / "configs" / "llama-3.1-8b-1xh100.json").read_text()))
    serve = tmp_path / "serve.json"
    for spelling in (
        {"attention-backend": "triton_attn"},
        {"attention-config": {"backend": "TRITON_ATTN"}},
        {"attention-config": '{"backend": "TRITON_ATTN"}'},
        {"attention-config.backend": "TRITON_ATTN"},
        {"attention_backend": "TRITON_ATTN", "attention-config": {"backend": "triton_attn"}},
    ):
        serve.write_text(json.dumps({**spelling, "kv-transfer-config": inner}))
        assert read_server_config(serve).attention_backend == "TRITON_ATTN", spelling
    serve.write_text(
        json.dumps(
            {
                "attention-backend": "FLASH_ATTN",
                "attention-config": {"backend": "TRITON_ATTN"},
                "kv-transfer-config": inner,
            }
        )
    )
    with pytest.raises(ConfigError, match="the attention backend is named twice, differently"):
        read_server_config(serve)


def test_the_disk_read_is_timed_against_the_break_even(tmp_path):
    cfg = disk_cfg(tmp_path)
    geometry = find_preset("llama-3.1-8b").geometry
    slow = dr.check_disk_speed(cfg, geometry, prefill_tps=1e12, probe_bytes=4 << 20)
    if slow.status == "skip" and "not timed" in slow.message:
        pytest.skip(f"no O_DIRECT here: {slow.message}")
    assert slow.status == "warn" and "below the break-even" in slow.message and slow.fix
    assert slow.facts["break_even_gbps"] == pytest.approx(131_072 * 1e12 / 1e9, rel=1e-3)
    fast = dr.check_disk_speed(cfg, geometry, prefill_tps=1, probe_bytes=4 << 20)
    assert fast.status == "ok" and "above the break-even" in fast.message and "--prefill-tps" in fast.message
    assert fast.facts["read_gbps"] > 0 and fast.facts["probe_bytes"] == 4 << 20
    assumed = dr.check_disk_speed(cfg, geometry, probe_bytes=4 << 20)
    assert "assumed" in assumed.message
    unknown = dr.check_disk_speed(cfg, None, probe_bytes=4 << 20)
    assert unknown.status == "ok" and "model is unknown" in unknown.message
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    # The model comes from the config's model_id where a preset knows it.
    known = TieredConfig.from_dict({"model_id": "meta-llama/Llama-3.1-8B-Instruct"})
    assert dr.model_geometry(known, None) == geometry


class _NotS3(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = b"<html><body>404 Not Found</body></html>"
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


def test_an_http_server_answering_404_is_not_an_s3_endpoint(monkeypatch):
    pytest.importorskip("obstore")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotS3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        cfg = TieredConfig.from_dict(
            {"remote": {"endpoint": endpoint, "bucket": "kv-bucket", "retries": 0, "trusted_bucket": True}}
        )
        line = dr.check_remote(cfg)
    finally:
        server.shutdown()
        server.server_close()
    assert line.status == "fail" and "not an S3 endpoint" in line.message and "HTTP 404" in line.message
    assert "remote.endpoint" in line.fix and line.facts["s3_answer"] is False
    assert dr.s3_answer({"x-amz-request-id": "tx0"}, b"") and dr.s3_answer(
        {}, b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code></Error>"
    )


def test_a_hung_endpoint_is_said_to_time_out_with_its_limit(monkeypatch):
    import socket

    pytest.importorskip("obstore")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    held = []
    with socket.socket() as listener:  # accepts connections and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        stop = threading.Event()

        def accept():
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    held.append(listener.accept()[0])
                except OSError:
                    pass

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        remote = {
            "endpoint": endpoint,
            "bucket": "kv-bucket",
            "request_timeout": "1s",
            "retries": 0,
            "trusted_bucket": True,
        }
        try:
            line = dr.check_remote(TieredConfig.from_dict({"remote": remote}))
        finally:
            stop.set()
            thread.join()
            for conn in held:
                conn.close()
    assert line.status == "warn" and "timed out after 1 s (request_timeout)" in line.message, line.message
    assert "error sending request" not in line.message


def test_missing_credentials_get_the_credentials_fix(monkeypatch, tmp_path):
    pytest.importorskip("botocore")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    cfg = TieredConfig.from_dict(
        {"remote": {"endpoint": "http://127.0.0.1:9", "bucket": "kv-bucket", "trusted_bucket": True}}
    )
    line = dr.check_remote(cfg)
    assert line.status == "fail" and "no AWS credentials" in line.message
    assert "pip install" not in line.fix and "AWS_ACCESS_KEY_ID" in line.fix


def _doctor(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["doctor", *args, "--json"])
    assert "Traceback" not in result.output
    return result.exit_code, json.loads(result.stdout)


def test_a_disk_tier_from_the_tiers_list_is_checked_like_disk_path(tmp_path):
    root_only = mountinfo(tmp_path, {"/": ("ext4", "/dev/vda")})
    config = tmp_path / "kv.json"
    second = tmp_path / "mnt" / "nvme2" / "tiered-kv"
    config.write_text(
        json.dumps(
            {
                "disk_path": str(tmp_path / "kv"),
                "disk_bytes": "1GiB",
                "tiers": [{"type": "disk", "path": str(second), "bytes": "1GiB", "name": "disk2"}],
            }
        )
    )
    report = dr.run_doctor(config, read_probe=0, mountinfo=root_only)
    disk_checks = [c for c in report.checks if c.name == "disk_path"]
    assert len(disk_checks) == 2
    assert disk_checks[1].status == "fail" and f"{second.parent.parent} does not exist" in disk_checks[1].message


@pytest.mark.parametrize("shorthand", [{}, {"disk_path": None}, {"disk_path": ""}])
def test_moving_the_disk_tier_moves_the_one_the_config_has(tmp_path, shorthand):
    """``warmup --disk-path`` moves the server's first disk tier, its size and checksum
    kept, as ``TieredConfig.with_disk_path`` does; a ``disk_path`` of null or "" is no
    tier of its own (it used to add a default-sized second one)."""
    tiers = [{"type": "disk", "path": "/srv/a", "bytes": "2GiB", "checksum": "crc32c"}]
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({**shorthand, "model_id": "m", "tiers": tiers}))
    moved = read_server_config(path).with_disk_path("/srv/b").config().tiers
    expected = TieredConfig.from_dict({"model_id": "m", "tiers": tiers}).with_disk_path("/srv/b").tiers
    assert (
        [(e.name, e.settings.path, e.settings.bytes, e.settings.checksum) for e in moved]
        == [(e.name, e.settings.path, e.settings.bytes, e.settings.checksum) for e in expected]
        == [("disk", "/srv/b", 2 << 30, "crc32c")]
    )


def test_disk_tiers_sharing_a_file_system_are_checked_together(tmp_path):
    """Each tier fits alone; together they need more than the file system has free,
    and the second to start would refuse: the doctor says so."""
    half = max(1, dr.free_space(tmp_path) * 6 // 10 // (1 << 20))
    tiers = [
        {"type": "disk", "name": f"d{i}", "path": str(tmp_path / f"d{i}"), "bytes": f"{half}MiB", "medium": f"DISK{i}"}
        for i in (1, 2)
    ]
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"cpu_bytes": "1GiB", "model_id": "m", "cover_weights": False, "tiers": tiers}))
    _, data = _doctor("--config", str(path), "--tp", "1", "--read-probe", "0")
    checks = [c for c in data["checks"] if c["name"].startswith("disk_space")]
    assert [c["status"] for c in checks] == ["ok", "ok", "fail"], checks
    assert "share one file system" in checks[-1]["message"] and "file systems of their own" in checks[-1]["fix"]
    assert not (tmp_path / "d1").exists()


def test_serve_settings_the_tools_do_not_model_are_named(tmp_path):
    """A vllm serve --config file with an fp8 KV cache: the warm-up computes a server of
    vLLM's default cache dtype, whose namespace that server never reads."""
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "tiered_kv.integrations.vllm",
        "cpu_bytes": "1GiB",
    }
    transfer = {"kv_connector": "TieredOffloadingConnector", "kv_connector_extra_config": extra}
    for value, named in (("fp8", ("kv-cache-dtype",)), ("auto", ())):
        path = tmp_path / f"{value}.json"
        path.write_text(json.dumps({"model": "m", "kv-cache-dtype": value, "kv-transfer-config": transfer}))
        assert read_server_config(path).unmodelled == named
