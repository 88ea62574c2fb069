"""One validated configuration for the whole hierarchy, in human units.

Parsed in every process that builds a spec (scheduler and workers) from the same
dict, e.g. vLLM's ``kv_connector_extra_config``. No I/O except the checks that a
path and a size make sense on this machine, which happen when a tier opens, not here.

Every error names the key, the bad value and what is expected.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from tiered_kv.config_values import (  # noqa: F401 (ConfigError, parse_size, format_size, CHECKSUMS: re-exported)
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    ConfigError,
    MIN_BARE_SIZE,
    format_size,
    parse_bool,
    parse_choice,
    parse_disk_path,
    parse_positive_int,
    parse_size,
    parse_text,
    show,
)
from tiered_kv.tier_registry import TierEntry, tier_class

#: Keys of vLLM's ``kv_connector_extra_config`` that vLLM itself reads (its spec factory,
#: ``OffloadingSpec`` and the OffloadingConnector); our vLLM spec passes them through.
#: ``block_size`` is not among them: it means the same to both and is ours to validate.
VLLM_PASSTHROUGH_KEYS = (
    "spec_name",
    "spec_module_path",
    "blocks_per_chunk",
    "offload_prompt_only",
    "self_describing_kv_events",
    "canonical_layout",
    "sync_load_budget_bytes",
)

#: Keys of vLLM's own offloading specs that look like ours but are not: what to use instead
#: (a close spelling would suggest the wrong key).
OTHER_SPECS_KEYS = {
    "cpu_bytes_to_use": "that is the key of vLLM's CPUOffloadingSpec and TieringOffloadingSpec, bytes for all TP "
    "ranks together; TieredOffloadingSpec takes cpu_bytes per TP rank (cpu_bytes_to_use / TP), or keep "
    '"spec_name": "TieringOffloadingSpec" with our disk tier in secondary_tiers (configs/vllm-tiering-disk.json)',
    "secondary_tiers": "that is the key of vLLM's TieringOffloadingSpec; set its spec_name, or use disk_path and "
    "disk_bytes with TieredOffloadingSpec",
}

WRITE_POLICIES = ("write_through", "write_back")
IO_BACKENDS = ("auto", "kvikio", "posix")
DISK_IO = ("thread", "process")
GPU_COPIES = ("auto", "kernels", "dma")
EVICTION_POLICIES = ("lru", "arc")
#: The disk tier's order is kept in its index (last access per block): LRU only.
DISK_EVICTION_POLICIES = ("lru",)
#: vLLM's ``--prefix-caching-hash-algo`` values (``tiered_kv.ops.hashing`` computes them all).
HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


_REUSE_RE = re.compile(r"^reuse\((\d+)\)$")


def _admission_rule(value: Any) -> str | None:
    """``"all"`` or ``"reuse(N)"`` (N >= 1, spaces ignored) in its canonical spelling, else None."""
    if value == "all":
        return value
    m = _REUSE_RE.match(value.replace(" ", "")) if isinstance(value, str) else None
    return f"reuse({int(m.group(1))})" if m and int(m.group(1)) >= 1 else None


def parse_write_admission(value: Any, key: str) -> Any:
    """``"all"``, ``"reuse(N)"`` (N >= 1), or a mapping of lower-tier name to one of those."""
    if isinstance(value, Mapping):
        return {str(k): parse_write_admission(v, f"{key}.{k}") for k, v in value.items()}
    if (rule := _admission_rule(value)) is not None:
        return rule
    raise ConfigError(
        f"{key}: expected 'all', 'reuse(N)' with N >= 1 (write a block to a lower tier once it has "
        f"been stored or hit N times), or a mapping of tier name to one of those, got {show(value)}"
    )


def parse_cpu_admission(value: Any, key: str) -> str:
    """``"all"`` or ``"reuse(N)"`` (N >= 1): the uses a block needs before the CPU tier
    ranks it as any other (until then it is first to evict)."""
    if (rule := _admission_rule(value)) is not None:
        return rule
    raise ConfigError(
        f"{key}: expected 'all' or 'reuse(N)' with N >= 1 (the CPU tier keeps a block first to evict "
        f"until it has been stored or hit N times), got {show(value)}"
    )


def admit_after(write_admission: Any, tier_name: str) -> int:
    """Stores-or-hits a block needs before it is written to ``tier_name`` (1 for ``all``)."""
    value = write_admission.get(tier_name, "all") if isinstance(write_admission, Mapping) else write_admission
    m = _REUSE_RE.match(value)
    return int(m.group(1)) if m else 1


def _parse_positive_float(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}: expected a positive number (tokens per second) or null, got {show(value)}")
    return float(value)


def _parse_remote(value: Any, key: str) -> Any:
    # By the registry: the shared tier's settings are its tier class's (no import of the
    # shared tier's package until a config names one).
    return tier_class("remote").parse_settings(value, f"{key}.")


def _parse_tiers(value: Any, key: str) -> tuple[TierEntry, ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f'{key}: expected a list of tiers, e.g. [{{"type": "disk", "path": "/mnt/nvme/kv"}}]')
    return tuple(TierEntry.parse(item, f"{key}[{i}]") for i, item in enumerate(value))


def _parse_disk_eviction_policy(value: Any, key: str) -> str:
    if value == "arc":
        raise ConfigError(
            f"{key}: the disk tier evicts in LRU order only (its index keeps each "
            f"block's last access), got 'arc'; ARC is for the CPU tier: "
            f"set eviction_policy: arc"
        )
    return parse_choice(value, key, DISK_EVICTION_POLICIES)


@dataclass(frozen=True)
class TieredConfig:
    """Validated settings of the hierarchy. Build it with ``TieredConfig.from_dict``.

    Sizes are bytes. ``disk_path=None`` disables the disk tier.
    """

    cpu_bytes: int = 4 * 1024**3
    disk_path: str | None = None
    disk_bytes: int = 64 * 1024**3
    write_policy: str = "write_through"
    promote_on_hit: bool = True
    io_backend: str = "auto"
    #: The CPU tier's eviction order (``tiered_kv.cpu``: lru or arc).
    eviction_policy: str = "lru"
    disk_eviction_policy: str = "lru"
    checksum: str = DEFAULT_CHECKSUM
    io_threads: int = 4
    #: Where a worker's disk I/O runs: ``thread`` (threads of the worker process) or
    #: ``process`` (a helper process per worker, off the worker's GIL; the CPU tier is
    #: then shared memory). See ``tiered_kv.disk.worker.io_process``.
    disk_io: str = "thread"
    #: How GPU <-> CPU jobs move bytes: ``kernels`` (copy kernels over the mapped pinned
    #: tier), ``dma`` (copy engines, one copy per run of slots), or ``auto`` (per job:
    #: ``dma`` where its slots run 2 MiB or more, else kernels where the device can map
    #: the tier). See ``tiered_kv.cpu.handlers``.
    gpu_copy: str = "auto"
    #: Blocks allowed to wait for a disk write (write-through and spills); the excess is
    #: dropped and counted instead of stalling the engine.
    max_pending_disk_writes: int = 1024
    #: Load a block only when that beats recomputing it (``tiered_kv.cost``); false loads
    #: every block found, as before.
    cost_aware: bool = True
    #: Prefill tokens per second of the served model on this GPU; None: estimated from the
    #: model and the GPU (``tiered_kv.prefill.estimate_prefill_tokens_per_s``).
    prefill_tokens_per_s: float | None = None
    #: Per lower tier: ``all`` (every block), or ``reuse(N)`` (a block once it has been
    #: stored or hit N times); one value for every lower tier, or a mapping by tier name.
    write_admission: Any = "all"
    #: The CPU tier: ``all`` (every stored block ranks most recent), or ``reuse(N)`` (a
    #: block ranks first to evict until it has been stored or hit N times).
    cpu_admission: str = "all"
    #: Offloaded block size in tokens (a multiple of the engine's GPU block size).
    block_size: int | None = None
    model_id: str = "unknown"
    model_revision: str = "main"
    #: The model's directory: its weights digest goes into the disk namespace
    #: (``tiered_kv.model_identity``). Under vLLM, the directory vLLM loads is used.
    model_path: str | None = None
    #: The shared tier below the disk tier (S3-compatible object storage): a mapping of
    #: ``tiered_kv.remote.config.RemoteConfig`` settings (endpoint, bucket, prefix, ...),
    #: validated into one; None for no shared tier.
    remote: Any = None
    #: More lower tiers below those of ``disk_path`` and ``remote``, fastest first: each
    #: a mapping with a ``type`` (``disk``, ``remote``, or a class name with its
    #: ``module_path``), validated by the tier's own class (``tiered_kv.tier_registry``).
    tiers: tuple[TierEntry, ...] = ()
    hash_algorithm: str = "sha256"
    hash_seed: str = ""
    #: Extra keys an engine adapter passes through untouched (e.g. vLLM's spec_name).
    passthrough: Mapping[str, Any] = field(default_factory=dict)

    _PARSERS: ClassVar[dict[str, Callable[[Any, str], Any]]] = {
        "cpu_bytes": parse_size,
        "disk_path": parse_disk_path,
        "disk_bytes": parse_size,
        "write_policy": lambda v, k: parse_choice(v, k, WRITE_POLICIES),
        "promote_on_hit": parse_bool,
        "io_backend": lambda v, k: parse_choice(v, k, IO_BACKENDS),
        "eviction_policy": lambda v, k: parse_choice(v, k, EVICTION_POLICIES),
        "disk_eviction_policy": _parse_disk_eviction_policy,
        "checksum": lambda v, k: parse_choice(v, k, CHECKSUMS),
        "io_threads": parse_positive_int,
        "disk_io": lambda v, k: parse_choice(v, k, DISK_IO),
        "gpu_copy": lambda v, k: parse_choice(v, k, GPU_COPIES),
        "max_pending_disk_writes": parse_positive_int,
        "cost_aware": parse_bool,
        "prefill_tokens_per_s": _parse_positive_float,
        "write_admission": parse_write_admission,
        "cpu_admission": parse_cpu_admission,
        "block_size": lambda v, k: None if v is None else parse_positive_int(v, k),
        "model_id": parse_text,
        "model_revision": parse_text,
        "model_path": lambda v, k: None if v is None else parse_text(v, k),
        "remote": lambda v, k: None if v is None else _parse_remote(v, k),
        "tiers": _parse_tiers,
        "hash_algorithm": lambda v, k: parse_choice(v, k, HASH_ALGORITHMS),
        "hash_seed": lambda v, k: parse_text(v, k, empty_ok=True, numbers_ok=True),
    }

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "passthrough")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None = None, passthrough_keys: tuple[str, ...] = ()) -> "TieredConfig":
        """Validate ``raw``. Keys in ``passthrough_keys`` are kept unparsed; any other
        unknown key raises ``ConfigError`` naming it (with the closest known key)."""
        raw = dict(raw or {})
        known = cls.keys()
        values: dict[str, Any] = {}
        passthrough: dict[str, Any] = {}
        for key, value in raw.items():
            if key in passthrough_keys:
                passthrough[key] = value
                continue
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                if key in OTHER_SPECS_KEYS:
                    hint = f": {OTHER_SPECS_KEYS[key]}."
                raise ConfigError(f"unknown config key {show(key)}{hint} Known keys: {', '.join(known)}")
            values[key] = cls._PARSERS[key](value, key)
        if "disk_bytes" in values and values.get("disk_path") is None:
            raise ConfigError(
                "disk_bytes: set without disk_path, so there would be no disk tier to "
                'size; add "disk_path": "/mnt/nvme/tiered-kv" (a directory on '
                "local NVMe) or remove disk_bytes"
            )
        return cls(**values, passthrough=passthrough)

    @property
    def copy_kernels(self) -> bool | None:
        """``gpu_copy`` as the GPU <-> CPU handlers take it: True, False, or None (auto)."""
        return {"auto": None, "kernels": True, "dma": False}[self.gpu_copy]

    def tier_entries(self) -> tuple[TierEntry, ...]:
        """Every lower tier, fastest first: ``disk_path``'s disk tier, ``remote``'s shared
        tier, then ``tiers``."""
        own: list[TierEntry] = []
        if self.disk_path:
            own.append(
                TierEntry.parse({"type": "disk", "path": self.disk_path, "bytes": f"{self.disk_bytes}B"}, "disk_path")
            )
        if self.remote is not None:
            own.append(TierEntry("remote", None, "remote", self.remote))
        return (*own, *self.tiers)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.keys()}
        if self.remote is not None:
            out["remote"] = self.remote.to_dict()  # holds no credentials: safe to echo
        out["tiers"] = [entry.to_dict() for entry in self.tiers]
        return out
