"""The doctor's check of the prefix-hash settings: would blocks on disk hit after a restart?

Runs in the operator's process (``tiered-kv doctor``); no I/O (reads the config and
the environment it is given).
"""

from __future__ import annotations

from collections.abc import Mapping

from tiered_kv.config import TieredConfig
from tiered_kv.ops.doctor.report import OK, WARN, Check, skipped


_RANDOM_SEEDED = ("xxhash", "xxhash_cbor")


def check_hash(cfg: TieredConfig | None, env: Mapping[str, str]) -> Check:
    """Whether the block hashes the server computes survive a restart and match the
    config's ``hash_seed`` (vLLM seeds its prefix hashes with PYTHONHASHSEED)."""
    env_seed = env.get("PYTHONHASHSEED")
    facts = {
        "PYTHONHASHSEED": env_seed,
        "hash_algorithm": cfg.hash_algorithm if cfg else None,
        "hash_seed": cfg.hash_seed if cfg else None,
    }
    if cfg is None:
        shown = "unset" if env_seed is None else repr(env_seed)
        return skipped(
            "hash", f"PYTHONHASHSEED is {shown} here, no config to compare with hash_seed", "pass --config PATH", facts
        )
    algo, seed = cfg.hash_algorithm, cfg.hash_seed
    if seed and env_seed is not None and env_seed != seed:
        return Check(
            "hash",
            WARN,
            f"hash_seed {seed!r} differs from PYTHONHASHSEED={env_seed!r} in this "
            f"environment: blocks warmed up here would not match the server's",
            f"run the server (and warmup) with PYTHONHASHSEED={seed}",
            facts,
        )
    if seed and env_seed is None:
        return Check(
            "hash",
            WARN,
            f"hash_seed is {seed!r} but PYTHONHASHSEED is unset here; vLLM seeds its prefix hashes with PYTHONHASHSEED",
            f"run the server with PYTHONHASHSEED={seed}",
            facts,
        )
    if algo in _RANDOM_SEEDED and not seed and env_seed is None:
        return Check(
            "hash",
            WARN,
            f"hash_algorithm {algo} is seeded randomly per process while PYTHONHASHSEED "
            f"is unset: after a restart no block on disk ever hits",
            "run the server with PYTHONHASHSEED=<n> and set hash_seed to the same <n>, or use hash_algorithm sha256",
            facts,
        )
    how = (
        f"seed PYTHONHASHSEED={env_seed}" if env_seed is not None else f"seed {seed!r}" if seed else "vLLM's fixed seed"
    )
    return Check("hash", OK, f"prefix hashes: {algo} with {how}: stable across restarts", facts=facts)
