"""The config's ``remote`` key: the shared tier's settings, validated where the rest of the
config is, echoed without credentials, and taken by vLLM's connector too. A fleet key
pasted into a setting is refused and never echoed (config errors, ``doctor --json``,
``inspect --remote``, the engine's start-up error), and a key file that is not a regular
file (a FIFO, a directory, a device, a socket) is refused at once, saying what it is."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from tiered_kv.config import ConfigError, TieredConfig

SETTINGS = {"endpoint": "http://127.0.0.1:7480", "bucket": "kv-fleet", "write_policy": "evictions"}


def test_remote_settings_are_validated_and_echoed():
    config = TieredConfig.from_dict({"remote": SETTINGS})
    remote = config.shared_tier.settings
    assert remote.bucket == "kv-fleet" and remote.write_policy == "evictions"
    (echoed,) = json.loads(json.dumps(config.to_dict()))["tiers"]
    assert echoed["type"] == "remote" and echoed["bucket"] == "kv-fleet"
    assert not any("secret" in key or "access" in key for key in echoed)
    assert TieredConfig.from_dict({}).shared_tier is None


@pytest.mark.parametrize(
    "remote,message",
    [
        ({**SETTINGS, "bukcet": "x"}, r"remote\.'bukcet'; did you mean remote\.'bucket'"),
        ({"endpoint": "http://127.0.0.1:7480"}, r"remote\.bucket: required"),
        ({**SETTINGS, "write_policy": "sometimes"}, r"remote\.write_policy"),
        (5, r"remote: expected a mapping"),
    ],
)
def test_bad_remote_settings_name_the_key(remote, message):
    with pytest.raises(ConfigError, match=message):
        TieredConfig.from_dict({"remote": remote})


def test_the_remote_write_policy_is_the_composites_per_tier_policy():
    from tiered_kv.fingerprint import Fingerprint
    from tiered_kv.sim.driver import DeviceKVCache
    from tiered_kv.tiers import TierContext, build_tiers

    layout = DeviceKVCache(
        num_layers=2, num_gpu_blocks=8, gpu_block_size=4, num_kv_heads=1, head_dim=8, device="cpu"
    ).layout
    fingerprint = Fingerprint.from_layout(layout, model_id="m")
    for remote, policy in ((SETTINGS, "write_back"), ({**SETTINGS, "write_policy": "write_through"}, "write_through")):
        config = TieredConfig.from_dict({"remote": {**remote, "trusted_bucket": True}})  # no key needed here
        (tier,) = build_tiers(config.tier_entries(), TierContext(config, fingerprint, layout, "engine"))
        assert tier.write_policy == policy


@pytest.mark.vllm
def test_vllm_takes_the_remote_key_and_names_a_bad_one():
    pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed", exc_type=ImportError)
    from tiered_kv.vllm_extra import parse_extra_config

    assert parse_extra_config({"cpu_bytes": "1GiB", "remote": SETTINGS}).shared_tier.settings.bucket == "kv-fleet"
    with pytest.raises(ConfigError, match=r"remote\.write_policy"):
        parse_extra_config({"cpu_bytes": "1GiB", "remote": {**SETTINGS, "write_policy": "sometimes"}})


# --- The fleet key is never echoed, and a key file that is not a regular file is refused
# at once. Keys pasted where their file or variable is named, as an operator would paste
# the output of ``openssl rand -hex 32`` or ``openssl rand -base64 32``.

#: 64 hex digits starting with a letter: passes the variable-name rule of key_env.
HEX_KEY = "e97145e7b1947520459f3588941f69ae9fe3b2f6d11edafda0c9f78b7f6de384"
#: base64 with '+' and '/', as openssl prints it.
B64_KEY = "HKgWAighDPskB0+vvNj1WwQtgA09lOa1/k6ylgYmfmc="
#: base64 of 32 bytes without '+', '/' and its padding: passes the variable-name rule too.
B64_NAME_KEY = "OSm5khnWI0Fgzz5WCKGEDPfaFKU8ru1Dh2t3k2vE0mQ"
PASTED = [
    pytest.param("key_file", HEX_KEY, id="key_file-hex"),
    pytest.param("key_file", B64_KEY, id="key_file-base64"),
    pytest.param("key_env", HEX_KEY, id="key_env-hex"),
    pytest.param("key_env", B64_NAME_KEY, id="key_env-base64"),
]
CLOSED_ENDPOINT = "http://127.0.0.1:9"  # discard: nothing answers there


def assert_not_echoed(text: str, key: str) -> None:
    """No 12 characters of ``key`` in a row appear in ``text`` (not the key, nor a piece)."""
    for i in range(len(key) - 11):
        assert key[i : i + 12] not in text, f"{key[i : i + 12]!r} of the key is in {text!r}"


def _settings(**extra) -> dict:
    return {"endpoint": CLOSED_ENDPOINT, "bucket": "kv-fleet", "request_timeout": "1s", "retries": 0, **extra}


def _config_file(tmp_path, **remote) -> str:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"model_id": "org/model", "cpu_bytes": "1GiB", "remote": _settings(**remote)}))
    return str(path)


def test_the_key_examples_pass_the_rules_that_used_to_echo_them():
    import re

    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", HEX_KEY) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", B64_NAME_KEY)
    from tiered_kv.remote.format.keys import parse_keys

    assert len(parse_keys(HEX_KEY, "x")[0]) == 32 and len(parse_keys(B64_KEY, "x")[0]) == 32


def test_a_key_a_digit_short_or_behind_a_byte_order_mark_gets_the_right_words():
    from tiered_kv.remote.format.keys import FleetKeyError, parse_keys

    with pytest.raises(FleetKeyError, match="key 1 is 63 hex digits; expected 64") as refused:
        parse_keys(HEX_KEY[:-1], "remote.key_file /k")
    assert_not_echoed(str(refused.value), HEX_KEY[:-1])
    assert parse_keys("\ufeff" + HEX_KEY + "\n", "remote.key_file /k") == parse_keys(HEX_KEY, "x")
    with pytest.raises(FleetKeyError, match=r"key 1 \(5 characters\) is neither 64 hex digits nor base64 of 32 bytes"):
        parse_keys("zz!zz", "remote.key_file /k")


@pytest.mark.parametrize("setting,key", PASTED)
def test_a_key_pasted_as_its_file_or_variable_is_refused_without_being_echoed(setting, key):
    with pytest.raises(ConfigError) as refused:
        TieredConfig.from_dict({"remote": _settings(**{setting: key})})
    message = str(refused.value)
    assert_not_echoed(message, key)
    assert message.startswith(f"remote.{setting}: expected ") and "never goes in the config" in message
    assert ("path of a file" if setting == "key_file" else "name of an environment variable") in message


@pytest.mark.parametrize(
    "setting,key",
    [
        ("prefix", HEX_KEY),
        ("profile", B64_KEY),
        ("mooncake_tenant", B64_NAME_KEY),
        ("trusted_bucket", HEX_KEY),
        ("region", f"{HEX_KEY},{B64_KEY}"),
        ("key_env", B64_KEY),
        ("key_file", f"/run/secrets/{B64_NAME_KEY}"),
    ],
)
def test_a_key_pasted_into_any_remote_setting_is_refused_without_being_echoed(setting, key):
    with pytest.raises(ConfigError, match=rf"^remote\.{setting}: ") as refused:
        TieredConfig.from_dict({"remote": _settings(**{setting: key})})
    for part in key.split(","):
        assert_not_echoed(str(refused.value), part)


@pytest.mark.parametrize(
    "remote",
    [
        {"key_file": [HEX_KEY]},
        {"checksum": f"0x{HEX_KEY}"},
        {"retries": f"KEY={B64_KEY}"},
        {"connect_timeout": B64_KEY},
        {f"nope{HEX_KEY}": 1},
    ],
)
def test_messages_about_other_values_never_show_a_key_in_them(remote):
    from tiered_kv.config_values import REDACTED

    with pytest.raises(ConfigError) as refused:
        TieredConfig.from_dict({"remote": _settings(**remote)})
    assert_not_echoed(str(refused.value), HEX_KEY)
    assert_not_echoed(str(refused.value), B64_KEY)
    assert REDACTED in str(refused.value) or "never goes in the config" in str(refused.value)


def test_what_looks_like_a_key():
    import base64
    import random

    from tiered_kv.config_values import holds_key, looks_like_key, show

    rng = random.Random(0)
    for _ in range(2000):  # every random key, in every form these tools read or print
        raw = rng.randbytes(32)
        for text in (
            raw.hex(),
            raw.hex().upper(),
            base64.b64encode(raw).decode(),
            base64.b64encode(raw).decode().rstrip("="),
            base64.urlsafe_b64encode(raw).decode(),
        ):
            assert looks_like_key(text) and holds_key(text) and show(text) != repr(text), text
    names = [
        "TIERED_KV_FLEET_KEY",
        "TIERED_KV_FLEET_KEY_PRODUCTION_CLUSTER_EU_WEST_1",
        "/etc/tiered-kv/fleet.key",
        "/var/run/secrets/kubernetes.io/serviceaccount/tiered-kv-fleet-key",
        "~/keys/fleet",
        "tiered-kv",
        "http://127.0.0.1:7480",
        "meta-llama/Llama-3.1-8B-Instruct",
        "deadbeef" * 7,  # 56 hex digits: 28 bytes, shorter than any key
    ]
    for name in names:
        assert not looks_like_key(name) and show(name) == repr(name), name
    # Taken as a path, but its 47 base64 characters in mixed case are not shown.
    mixed_case_path = "/home/Operator/Secrets/TieredKV/ProductionFleet.key"
    assert not looks_like_key(mixed_case_path) and holds_key(mixed_case_path)
    assert looks_like_key(f"{HEX_KEY}, {B64_KEY}") and looks_like_key(f" {HEX_KEY}\n")
    assert looks_like_key(f"0x{HEX_KEY}") and looks_like_key(f"/run/secrets/{HEX_KEY}")
    assert looks_like_key(f"export FLEET_KEY='{B64_KEY}'") and looks_like_key(f'"{HEX_KEY}";')
    assert show([1, {"k": B64_KEY}]) == show(f"KEY={B64_KEY}") == "<redacted: looks like key material>"


def test_a_key_files_name_that_looks_like_a_key_is_not_shown(tmp_path):
    from tiered_kv.remote.config import RemoteConfig
    from tiered_kv.remote.format.keys import FleetKeyError, load_keyring

    for config in (
        RemoteConfig(bucket="kv-fleet", key_file=str(tmp_path / f"0x{HEX_KEY}")),  # a path, and missing
        RemoteConfig(bucket="kv-fleet", key_env=B64_NAME_KEY),  # built past from_dict: not set
    ):
        with pytest.raises(FleetKeyError) as refused:
            load_keyring(config)
        assert_not_echoed(str(refused.value), HEX_KEY)
        assert_not_echoed(str(refused.value), B64_NAME_KEY)
        assert "redacted" in str(refused.value)


def _cli(*args: str, env: dict | None = None) -> tuple[int, str]:
    """``tiered-kv ARGS`` in this process: exit code, and stdout and stderr together."""
    from typer.testing import CliRunner

    from tiered_kv.cli import app

    result = CliRunner().invoke(app, list(args), env=env)
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout + result.stderr


@pytest.mark.parametrize("setting,key", PASTED)
def test_doctor_and_inspect_never_echo_a_pasted_key(setting, key, tmp_path):
    config = _config_file(tmp_path, **{setting: key})
    code, out = _cli("doctor", "--config", config, "--json")
    assert code != 0 and f"remote.{setting}" in out and "never goes in the config" in out
    assert_not_echoed(out, key)
    code, out = _cli("inspect", "summary", "--remote", config)
    assert code != 0 and f"remote.{setting}" in out and "never goes in the config" in out
    assert_not_echoed(out, key)
    code, out = _cli("inspect", "summary", "--remote", config, "--json")
    assert code != 0 and json.loads(out.splitlines()[0])["error"]
    assert_not_echoed(out, key)


def _vllm_offloading_config(extra: dict):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="key-test",
        model=OffloadingModelConfig("key-test-model", "float16", 4096),
        cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


@pytest.mark.vllm
@pytest.mark.parametrize("setting,key", PASTED)
def test_the_engines_start_up_error_never_echoes_a_pasted_key(setting, key):
    pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed", exc_type=ImportError)
    import traceback

    from tiered_kv.integrations.vllm import TieredOffloadingSpec

    extra = {"cpu_bytes": "64MiB", "remote": _settings(**{setting: key})}
    with pytest.raises(ConfigError) as refused:
        TieredOffloadingSpec(_vllm_offloading_config(extra))
    logged = "".join(traceback.format_exception(refused.value))  # what vLLM's server log shows
    assert f"remote.{setting}" in logged
    assert_not_echoed(logged, key)


# --- What the key file must be.


def _fifo(tmp_path) -> str:
    path = str(tmp_path / "fleet.key")
    os.mkfifo(path, 0o600)
    return path


def _socket_file() -> tuple[socket.socket, str]:
    # An AF_UNIX path is at most 107 bytes: a short directory of its own.
    directory = tempfile.mkdtemp(prefix="tkv-key-")
    path = os.path.join(directory, "fleet.key")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    return sock, path


@pytest.mark.timeout(60)  # a FIFO opened for reading with no writer blocks for ever
@pytest.mark.parametrize("kind", ["FIFO", "link to a FIFO", "directory", "character device", "socket"])
def test_a_key_file_that_is_not_a_regular_file_is_refused_saying_what_it_is(kind, tmp_path):
    from tiered_kv.remote.config import RemoteConfig
    from tiered_kv.remote.format.keys import FleetKeyError, load_keyring

    sock = None
    if kind == "FIFO":
        path, what = _fifo(tmp_path), "a FIFO"
    elif kind == "link to a FIFO":
        path, what = str(tmp_path / "link"), "a FIFO"
        os.symlink(_fifo(tmp_path), path)
    elif kind == "directory":
        path, what = str(tmp_path), "a directory"
    elif kind == "character device":
        path, what = "/dev/null", "a character device"
    else:
        sock, path = _socket_file()
        what = "a socket"
    try:
        with pytest.raises(FleetKeyError) as refused:
            load_keyring(RemoteConfig.from_dict(_settings(key_file=path), key_prefix="remote."))
    finally:
        if sock is not None:
            sock.close()
            shutil.rmtree(os.path.dirname(path))
    message = str(refused.value)
    assert message.startswith(f"remote.key_file {path}: is {what}")
    assert "not a regular file" in message and "file holding the fleet key" in message
    if kind == "link to a FIFO":
        assert f"the link leads to {tmp_path / 'fleet.key'}" in message


def test_a_key_file_reached_through_symbolic_links_is_read(tmp_path):
    """As Kubernetes mounts a secret: ``key -> ..data/key``, ``..data -> ..2026_01_01``."""
    from tiered_kv.remote.config import RemoteConfig
    from tiered_kv.remote.format.keys import load_keyring

    (tmp_path / "..2026_01_01").mkdir()
    (tmp_path / "..2026_01_01" / "key").write_text(HEX_KEY + "\n")
    os.chmod(tmp_path / "..2026_01_01" / "key", 0o600)
    os.symlink("..2026_01_01", tmp_path / "..data")
    os.symlink("..data/key", tmp_path / "key")
    linked = load_keyring(RemoteConfig(bucket="kv-fleet", key_file=str(tmp_path / "key")))
    (tmp_path / "plain").write_text(HEX_KEY)
    os.chmod(tmp_path / "plain", 0o600)
    plain = load_keyring(RemoteConfig(bucket="kv-fleet", key_file=str(tmp_path / "plain")))
    assert plain is not None and linked.key_ids == plain.key_ids


def test_a_key_file_over_the_bound_is_refused_and_not_read(tmp_path):
    from tiered_kv.remote.config import RemoteConfig
    from tiered_kv.remote.format.keys import MAX_KEY_FILE_BYTES, FleetKeyError, load_keyring

    path = tmp_path / "fleet.key"
    path.write_text(HEX_KEY + "\n" + "#" * MAX_KEY_FILE_BYTES)
    with pytest.raises(FleetKeyError, match=r"remote\.key_file .*fleet\.key: \d+ bytes; a key file holds a few keys"):
        load_keyring(RemoteConfig(bucket="kv-fleet", key_file=str(path)))


_MAIN = "import sys; from tiered_kv.cli import main; sys.argv[0] = 'tiered-kv'; main()"


def _run_cli(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """``tiered-kv ARGS`` as a process of its own (lines not wrapped): a hang ends in
    ``TimeoutExpired``. Without ``env``, fake AWS credentials and no instance metadata."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_EC2_METADATA_DISABLED="true", AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    return subprocess.run(
        [sys.executable, "-c", _MAIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "COLUMNS": "1000"},
    )


def test_a_fifo_as_key_file_is_one_failure_in_doctor_and_no_hang_in_inspect(tmp_path):
    fifo = _fifo(tmp_path)
    config = _config_file(tmp_path, key_file=fifo)
    doctor = _run_cli("doctor", "--config", config)
    assert doctor.returncode != 0
    lines = [line for line in (doctor.stdout + doctor.stderr).splitlines() if "FIFO" in line]
    assert len(lines) == 1 and lines[0].split()[:2] == ["fail", "remote"], doctor.stdout + doctor.stderr
    assert f"remote.key_file {fifo}: is a FIFO" in lines[0]
    doctor_json = _run_cli("doctor", "--config", config, "--json")
    remote = {c["name"]: c for c in json.loads(doctor_json.stdout)["checks"]}["remote"]
    assert doctor_json.returncode != 0 and remote["status"] == "fail" and "is a FIFO" in remote["message"]
    # The listing needs no key, so summary goes on to the server (which does not answer);
    # before, it never got there.
    inspect = _run_cli("inspect", "summary", "--remote", config)
    errors = [line for line in inspect.stderr.splitlines() if line.startswith("error: ")]
    assert inspect.returncode != 0 and len(errors) == 1, inspect.stdout + inspect.stderr


def test_inspect_verify_names_a_fifo_as_key_file_in_one_error_line(remote_settings, tmp_path):
    """Against the real test server, so that the listing succeeds and verify needs the key."""
    fifo = _fifo(tmp_path)
    config = tmp_path / "kv.json"
    remote = {**remote_settings, "key_env": None, "key_file": fifo}
    config.write_text(json.dumps({"model_id": "org/model", "remote": remote}))
    done = _run_cli("inspect", "verify", "--remote", str(config), env=dict(os.environ), timeout=60)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode != 0 and len(errors) == 1, done.stdout + done.stderr
    assert f"remote.key_file {fifo}: is a FIFO" in errors[0]


@pytest.mark.vllm
@pytest.mark.timeout(120)
def test_the_engine_refuses_a_fifo_as_key_file_at_start(tmp_path):
    pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed", exc_type=ImportError)
    from tiered_kv.integrations.vllm import TieredOffloadingSpec
    from tiered_kv.remote.format.keys import FleetKeyError

    fifo = _fifo(tmp_path)
    spec = TieredOffloadingSpec(_vllm_offloading_config({"cpu_bytes": "64MiB", "remote": _settings(key_file=fifo)}))
    with pytest.raises(FleetKeyError, match=rf"remote\.key_file {fifo}: is a FIFO"):
        spec.get_manager()
