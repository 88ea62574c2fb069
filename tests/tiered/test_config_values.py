"""Config values: every bad one is a ``ConfigError`` naming its key, on every path that
reads a config (``TieredConfig``, the tiered spec, vLLM's extra config and its secondary
tier entry). Covers non-finite numbers as JSON spells them, wrong types, nulls, sizes
without a unit, and ``disk_bytes`` without ``disk_path``."""

from __future__ import annotations

import json

import pytest

from tiered_kv.config import MIN_BARE_SIZE, ConfigError, TieredConfig, parse_size
from tiered_kv.tiered.spec import HierarchySpec


def from_json(text: str) -> TieredConfig:
    """A config as a server reads it: JSON text (which accepts NaN and Infinity)."""
    return TieredConfig.from_dict(json.loads(text))


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"cpu_bytes": NaN}', "cpu_bytes: expected a size such as 64GiB or a byte count, got NaN"),
        ('{"cpu_bytes": Infinity}', "cpu_bytes: expected a size such as 64GiB or a byte count, got Infinity"),
        ('{"disk_path": "/d", "disk_bytes": -Infinity}', "disk_bytes: expected a size"),
        ('{"cpu_bytes": 1e300}', "cpu_bytes: 1e+300 is too large"),
        ('{"cpu_bytes": null}', "cpu_bytes: expected a size such as 64GiB or a byte count, got null"),
        ('{"cpu_bytes": true}', "cpu_bytes: expected a size such as 64GiB or a byte count, got true"),
        ('{"cpu_bytes": [64]}', "cpu_bytes: expected a size such as 64GiB or a byte count, got [64] (list)"),
        ('{"io_threads": NaN}', "io_threads: expected an integer from 1 to 256, got NaN"),
        ('{"io_threads": 2.5}', "io_threads: expected an integer from 1 to 256, got 2.5"),
        ('{"io_threads": 5000}', "io_threads: expected an integer from 1 to 256, got 5000"),
        ('{"max_pending_disk_writes": null}', "max_pending_disk_writes: expected a positive integer, got null"),
        ('{"promote_on_hit": null}', "promote_on_hit: expected true or false, got null"),
        ('{"write_policy": null}', "write_policy: expected one of write_through, write_back; got null"),
        ('{"hash_algorithm": "md5"}', "hash_algorithm: expected one of sha256, sha256_cbor, xxhash, xxhash_cbor"),
        ('{"hash_algorithm": null}', "hash_algorithm: expected one of"),
        ('{"model_id": null}', "model_id: expected a string, got null; omit the key to use the default"),
        ('{"model_id": 7}', "model_id: expected a string, got 7"),
        ('{"model_id": "  "}', "model_id: expected a non-empty string"),
        ('{"model_revision": null}', "model_revision: expected a string, got null"),
        ('{"hash_seed": null}', "hash_seed: expected a string or an integer, got null"),
        ('{"hash_seed": 1.5}', "hash_seed: expected a string or an integer, got 1.5"),
        ('{"disk_path": false}', "disk_path: expected a directory path (a string), got false"),
        ('{"disk_path": 5}', "disk_path: expected a directory path (a string), got 5"),
        ('{"disk_path": {"dir": "/x"}}', "disk_path: expected a directory path (a string)"),
        (
            '{"disk_path": "/x", "write_admission": {"dsik": "reuse(3)"}}',
            "write_admission: no lower tier is named 'dsik'; did you mean 'disk'? (tiers: disk)",
        ),
    ],
)
def test_bad_values_are_errors_naming_the_key(text, words):
    with pytest.raises(ConfigError) as e:
        from_json(text)
    assert words in str(e.value)


def test_nulls_never_become_the_text_none():
    # Omitting a key gives its default; a string is kept as written; an integer seed is text.
    cfg = from_json('{"model_id": "m", "model_revision": "r1", "hash_seed": 0}')
    assert (cfg.model_id, cfg.model_revision, cfg.hash_seed) == ("m", "r1", "0")
    assert "None" not in (TieredConfig.from_dict({}).model_revision, TieredConfig.from_dict({}).hash_seed)
    # disk_path null (or "") is the documented way to say "no disk tier".
    assert from_json('{"disk_path": null}').disk_tier is None
    assert from_json('{"disk_path": ""}').disk_tier is None


def test_disk_path_false_creates_no_directory(tmp_path, monkeypatch):
    """The old parser made str(False): a cache directory ./False next to the server."""
    monkeypatch.chdir(tmp_path)
    for value in (False, 5, 0):
        with pytest.raises(ConfigError, match="disk_path: expected a directory path"):
            HierarchySpec({"cpu_bytes": "1MiB", "disk_path": value, "disk_bytes": "8MiB"}, gpu_block_size=16)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [64, "64", 1000.0, MIN_BARE_SIZE - 1, " 4096 "])
def test_a_bare_number_under_one_mib_is_refused_with_a_hint(value):
    with pytest.raises(ConfigError) as e:
        TieredConfig.from_dict({"cpu_bytes": value})
    text = str(e.value)
    n = int(float(str(value)))
    assert text.startswith("cpu_bytes: ") and f"would mean {n} bytes" in text
    assert f"'{n}GiB'" in text and f"'{n}B' if you mean bytes" in text


@pytest.mark.parametrize(
    "value, expected",
    [
        ("64B", 64),
        ("4096 B", 4096),
        ("64KiB", 64 << 10),
        ("1.5KB", 1500),
        (MIN_BARE_SIZE, MIN_BARE_SIZE),
        (str(MIN_BARE_SIZE), MIN_BARE_SIZE),
        (8 << 30, 8 << 30),
        (2.5e9, 2_500_000_000),
        ("64GiB", 64 << 30),
    ],
)
def test_sizes_with_a_unit_or_of_a_mib_and_more_are_taken(value, expected):
    assert parse_size(value, "cpu_bytes") == expected


def test_disk_bytes_without_disk_path_is_an_error():
    for raw in (
        {"disk_bytes": "1TiB"},
        {"disk_bytes": "1TiB", "disk_path": None},
        {"disk_bytes": "1TiB", "disk_path": ""},
    ):
        with pytest.raises(ConfigError, match="disk_bytes: set without disk_path"):
            TieredConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="disk_bytes: set without disk_path"):
        HierarchySpec({"cpu_bytes": "1MiB", "disk_bytes": "8MiB"}, gpu_block_size=16)
    assert TieredConfig.from_dict({"disk_path": "/d", "disk_bytes": "1TiB"}).disk_tier.settings.bytes == 1 << 40


def test_vllms_extra_config_refuses_the_same_values():
    spec = pytest.importorskip("tiered_kv.integrations.vllm.spec")
    base = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}
    for extra, words in (
        ({"cpu_bytes": 64}, "cpu_bytes: 64 has no unit"),
        ({"cpu_bytes": "8GiB", "disk_bytes": "1TiB"}, "disk_bytes: set without disk_path"),
        ({"cpu_bytes": float("nan")}, "cpu_bytes: expected a size"),
        ({"cpu_bytes": "8GiB", "disk_path": False}, "disk_path: expected a directory path"),
        ({"cpu_bytes": "8GiB", "hash_seed": None}, "hash_seed: expected a string"),
    ):
        with pytest.raises(ConfigError, match=words):
            spec.parse_extra_config({**base, **extra})
    assert spec.parse_extra_config({**base, "cpu_bytes": "64B"}).cpu_bytes == 64


def test_vllms_secondary_tier_entry_refuses_the_same_values(tmp_path):
    tier = pytest.importorskip("tiered_kv.integrations.vllm.secondary_tier")
    for entry, words in (
        ({"disk_path": str(tmp_path), "disk_bytes": 1000}, "disk_bytes: 1000 has no unit"),
        ({"disk_path": str(tmp_path), "disk_bytes": float("inf")}, "disk_bytes: expected a size"),
        ({"disk_path": 5, "disk_bytes": "1GiB"}, "disk_path: expected a directory path"),
    ):
        with pytest.raises(ConfigError, match=words):
            tier.parse_tier_config(entry)
