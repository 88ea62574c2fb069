"""The config's ``remote`` key: the shared tier's settings, validated where the rest of the
config is, echoed without credentials, and taken by vLLM's connector too."""

from __future__ import annotations

import json

import pytest

from tiered_kv.config import ConfigError, TieredConfig

SETTINGS = {"endpoint": "http://127.0.0.1:7480", "bucket": "kv-fleet", "write_policy": "evictions"}


def test_remote_settings_are_validated_and_echoed():
    config = TieredConfig.from_dict({"remote": SETTINGS})
    assert config.remote.bucket == "kv-fleet" and config.remote.write_policy == "evictions"
    echoed = json.loads(json.dumps(config.to_dict()))
    assert echoed["remote"]["bucket"] == "kv-fleet"
    assert not any("secret" in key or "access" in key for key in echoed["remote"])
    assert TieredConfig.from_dict({}).remote is None


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
    from tiered_kv.integrations.vllm.geometry import parse_extra_config

    assert parse_extra_config({"cpu_bytes": "1GiB", "remote": SETTINGS}).remote.bucket == "kv-fleet"
    with pytest.raises(ConfigError, match=r"remote\.write_policy"):
        parse_extra_config({"cpu_bytes": "1GiB", "remote": {**SETTINGS, "write_policy": "sometimes"}})
