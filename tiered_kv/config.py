"""One validated configuration for the whole hierarchy, in human units.

Parsed in every process that builds a spec (scheduler and workers) from the same
dict, e.g. vLLM's ``kv_connector_extra_config``. No I/O except the checks that a
path and a size make sense on this machine, which happen when a tier opens, not here.

Every error names the key, the bad value and what is expected.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid."""


#: A size given as a bare number (no unit) below this is taken for a mistake: "cpu_bytes":
#: 64 meant 64 GiB, not 64 bytes. Write "64B" to mean bytes.
MIN_BARE_SIZE = 1024**2
#: Nothing in the hierarchy can address more bytes than a signed 64-bit offset.
MAX_SIZE = 2**63 - 1


def show(value: Any) -> str:
    """``value`` as the config file spells it: null, true, NaN, Infinity, 'text'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return repr(value)


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from a string such as ``"64GiB"``, ``"1.5 TB"``, ``"512MiB"``, ``"4096B"``, or
    a bare number of bytes of at least 1 MiB.

    Raises ``ConfigError`` naming ``key`` for anything else: sizes <= 0, non-finite
    numbers, and a bare number (``64``, ``"64"``) under 1 MiB, which is almost always a
    forgotten unit (the message says how to write bytes on purpose).
    """
    expected = "expected a size such as 64GiB or a byte count"
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{key}: {expected}, got {show(value)}")
    bare = True
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {expected}, got {show(value)} (not a finite number)")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{key}: cannot parse size {value!r}; expected a number with an optional unit "
                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '64GiB'"
            )
        bare = unit == ""
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(f"{key}: {expected}, got {show(value)} ({type(value).__name__})")
    if n <= 0:
        raise ConfigError(f"{key}: size must be positive, got {show(value)}")
    if n > MAX_SIZE:
        raise ConfigError(f"{key}: {show(value)} is too large (at most {MAX_SIZE} bytes)")
    if bare and n < MIN_BARE_SIZE:
        raise ConfigError(
            f"{key}: {show(value)} has no unit, so it would mean {n} bytes; sizes without a unit "
            f"must be at least 1 MiB ({MIN_BARE_SIZE} bytes). Write a unit, e.g. '{n}GiB', or "
            f"'{n}B' if you mean bytes"
        )
    return n


def format_size(n: int) -> str:
    """``1073741824`` -> ``"1.00 GiB"``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{key}: expected true or false, got {show(value)}")


def _parse_choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ConfigError(f"{key}: expected one of {', '.join(choices)}; got {show(value)}")


def _parse_positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key}: expected a positive integer, got {show(value)}")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{key}: expected a positive integer, got {show(value)}") from None
    if n <= 0:
        raise ConfigError(f"{key}: expected a positive integer, got {show(value)}")
    return n


def _parse_text(value: Any, key: str, *, empty_ok: bool = False, numbers_ok: bool = False) -> str:
    """A string setting. null is refused (it would otherwise become the text "None"):
    omitting the key is how to ask for the default."""
    if numbers_ok and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        what = "a string or an integer" if numbers_ok else "a string"
        hint = "; omit the key to use the default" if value is None else ""
        raise ConfigError(f"{key}: expected {what}, got {show(value)}{hint}")
    if not empty_ok and not value.strip():
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}; omit the key to use the default")
    return value


def _parse_disk_path(value: Any, key: str) -> str | None:
    """A directory path; null or "" means no disk tier. Anything but a string is refused
    (``false`` would otherwise become a directory named ``False``)."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"{key}: expected a directory path (a string), got {show(value)}; omit the key for no disk tier"
        )
    if "\0" in value:
        raise ConfigError(f"{key}: a path cannot contain a NUL character, got {value!r}")
    return value if value.strip() else None


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

WRITE_POLICIES = ("write_through", "write_back")
IO_BACKENDS = ("auto", "kvikio", "posix")
DISK_IO = ("thread", "process")
GPU_COPIES = ("auto", "kernels", "dma")
EVICTION_POLICIES = ("lru", "arc")
#: The disk tier's order is kept in its index (last access per block): LRU only.
DISK_EVICTION_POLICIES = ("lru",)
CHECKSUMS = ("xxh3_64", "crc32c")
#: vLLM's ``--prefix-caching-hash-algo`` values (``tiered_kv.hashing`` computes them all).
HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _parse_remote(value: Any, key: str) -> Any:
    from tiered_kv.remote.config import RemoteConfig  # imports this module: not at load time

    return RemoteConfig.from_dict(value, key_prefix=f"{key}.")


def _parse_disk_eviction_policy(value: Any, key: str) -> str:
    if value == "arc":
        raise ConfigError(
            f"{key}: the disk tier evicts in LRU order only (its index keeps each "
            f"block's last access), got 'arc'; ARC is for the CPU tier: "
            f"set eviction_policy: arc"
        )
    return _parse_choice(value, key, DISK_EVICTION_POLICIES)


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
    checksum: str = "xxh3_64"
    io_threads: int = 4
    #: Where a worker's disk I/O runs: ``thread`` (threads of the worker process) or
    #: ``process`` (a helper process per worker, off the worker's GIL; the CPU tier is
    #: then shared memory). See ``tiered_kv.disk.io_process``.
    disk_io: str = "thread"
    #: How GPU <-> CPU jobs move bytes: ``kernels`` (copy kernels over the mapped pinned
    #: tier, two per job), ``dma`` (copy engines, one copy per layer and run of slots),
    #: or ``auto`` (kernels where the device can map the tier). See
    #: ``tiered_kv.worker.cpu_gpu``.
    gpu_copy: str = "auto"
    #: Blocks allowed to wait for a disk write (write-through and spills); the excess is
    #: dropped and counted instead of stalling the engine.
    max_pending_disk_writes: int = 1024
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
    hash_algorithm: str = "sha256"
    hash_seed: str = ""
    #: Extra keys an engine adapter passes through untouched (e.g. vLLM's spec_name).
    passthrough: Mapping[str, Any] = field(default_factory=dict)

    _PARSERS = {
        "cpu_bytes": parse_size,
        "disk_path": _parse_disk_path,
        "disk_bytes": parse_size,
        "write_policy": lambda v, k: _parse_choice(v, k, WRITE_POLICIES),
        "promote_on_hit": _parse_bool,
        "io_backend": lambda v, k: _parse_choice(v, k, IO_BACKENDS),
        "eviction_policy": lambda v, k: _parse_choice(v, k, EVICTION_POLICIES),
        "disk_eviction_policy": _parse_disk_eviction_policy,
        "checksum": lambda v, k: _parse_choice(v, k, CHECKSUMS),
        "io_threads": _parse_positive_int,
        "disk_io": lambda v, k: _parse_choice(v, k, DISK_IO),
        "gpu_copy": lambda v, k: _parse_choice(v, k, GPU_COPIES),
        "max_pending_disk_writes": _parse_positive_int,
        "block_size": lambda v, k: None if v is None else _parse_positive_int(v, k),
        "model_id": _parse_text,
        "model_revision": _parse_text,
        "model_path": lambda v, k: None if v is None else _parse_text(v, k),
        "remote": lambda v, k: None if v is None else _parse_remote(v, k),
        "hash_algorithm": lambda v, k: _parse_choice(v, k, HASH_ALGORITHMS),
        "hash_seed": lambda v, k: _parse_text(v, k, empty_ok=True, numbers_ok=True),
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
                raise ConfigError(f"unknown config key {key!r}{hint} Known keys: {', '.join(known)}")
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

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.keys()}
        if self.remote is not None:
            out["remote"] = self.remote.to_dict()  # holds no credentials: safe to echo
        return out
