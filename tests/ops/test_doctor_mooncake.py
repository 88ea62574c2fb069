"""``tiered-kv doctor`` on a config whose shared tier is a Mooncake Store, against a real
master: the fleet key is loaded as the server loads it, so no key without
``trusted_bucket`` and a key file that cannot be read fail as the server's start-up does;
with a key the line says which key ids it holds and that no object is opened (a Mooncake
Store cannot list its keys)."""

from __future__ import annotations

import json

from support.mooncake_server import skip_module_without_mooncake
from typer.testing import CliRunner

skip_module_without_mooncake()

from tiered_kv.cli import _load_commands, app  # noqa: E402
from tiered_kv.config import TieredConfig  # noqa: E402
from tiered_kv.ops import doctor as dr  # noqa: E402
from tiered_kv.remote.format.keys import Keyring  # noqa: E402

_load_commands()
KEY = "d4" * 32


def _check(remote: dict) -> dr.Check:
    return dr.check_remote(TieredConfig.from_dict({"remote": remote}))


def test_no_key_fails_as_the_server_refuses_to_start(mooncake_server, tmp_path):
    keyless = mooncake_server.settings(trusted_bucket=False)
    check = _check(keyless)
    assert check.status == dr.FAIL and "no key" in check.message and "remote.trusted_bucket" in check.message
    assert "openssl rand -hex 32" in check.fix
    # The command as an operator runs it: exit 2, the same line.
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"model_id": "org/model", "cpu_bytes": "64MiB", "remote": keyless}))
    result = CliRunner().invoke(app, ["doctor", "--config", str(config), "--read-probe", "0", "--json"])
    assert result.exit_code == 2, result.output
    (line,) = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "remote"]
    assert line["status"] == "fail" and "remote.key_file" in line["message"]


def test_a_missing_key_file_fails_naming_it(mooncake_server, tmp_path):
    gone = str(tmp_path / "fleet.key")
    check = _check(mooncake_server.settings(trusted_bucket=False, key_file=gone))
    assert check.status == dr.FAIL and f"remote.key_file {gone}: cannot be read" in check.message
    assert gone in check.fix


def test_a_readable_key_is_named_by_its_ids_and_no_object_is_opened(mooncake_server, tmp_path):
    path = tmp_path / "fleet.key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    check = _check(mooncake_server.settings(trusted_bucket=False, key_file=str(path)))
    key_id = f"{Keyring([bytes.fromhex(KEY)]).current_id:08x}"
    assert check.status == dr.OK, check
    assert f"holds key ids {key_id} (current)" in check.message and "the object check is S3-only" in check.message
    assert check.facts["key_ids"] == [key_id] and KEY not in json.dumps(check.to_dict())
    path.chmod(0o644)
    loose = _check(mooncake_server.settings(trusted_bucket=False, key_file=str(path)))
    assert loose.status == dr.WARN and "readable by other users" in loose.message and "chmod 600" in loose.fix
    trusted = _check(mooncake_server.settings())
    assert trusted.status == dr.WARN and "plaintext" in trusted.message
