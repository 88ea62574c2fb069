"""One validated configuration for the whole hierarchy, in human units.

Parsed in every process that builds a spec (scheduler and workers) from the same
dict, e.g. vLLM's ``kv_connector_extra_config``. No I/O except the checks that a
path and a size make sense on this machine, which happen when a tier opens, not here.

Every error names the key, the bad value and what is expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from tiered_kv.config_values import (  # noqa: F401 (ConfigError, sizes, the disk tier's choices, retention: re-exported)
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    DEFAULT_RETENTION_SHARE,
    DISK_IO,
    IO_BACKENDS,
    MAX_RETENTION_SHARE,
    ConfigError,
    MIN_BARE_SIZE,
    format_size,
    parse_bool,
    parse_choice,
    parse_disk_path,
    parse_positive_int,
    parse_retention,
    parse_size,
    parse_text,
    retention_share,
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


def write_policy_per_tier(write_policy: str | Sequence[str], tiers: int) -> tuple[str, ...]:
    """One ``write_policy`` per lower tier, from one for all of them or one each; raises
    ``ValueError`` naming the value and what is expected."""
    if isinstance(write_policy, str) and write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy: expected one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
    policies = (write_policy,) * tiers if isinstance(write_policy, str) else tuple(write_policy)
    if len(policies) != tiers or any(p not in WRITE_POLICIES for p in policies):
        raise ValueError(
            f"write_policy: expected one of {', '.join(WRITE_POLICIES)} per lower tier ({tiers}), got {write_policy!r}"
        )
    return policies


GPU_COPIES = ("auto", "kernels", "dma")
EVICTION_POLICIES = ("lru", "arc")
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


_ADAPTIVE_RE = re.compile(r"^adaptive(?:\((\d+)\))?$")


def parse_cpu_admission(value: Any, key: str) -> str:
    """``"all"``, ``"reuse(N)"`` (N >= 1): the uses a block needs before the CPU tier
    ranks it as any other (until then it is first to evict), or ``"adaptive(N)"`` (N >= 2;
    ``"adaptive"`` is ``"adaptive(2)"``): ``reuse(N)`` while the tier's miniature caches
    find it hits more than ``all`` (``tiered_kv.tiered.admission.AdaptiveAdmission``)."""
    if (rule := _admission_rule(value)) is not None:
        return rule
    m = _ADAPTIVE_RE.match(value.replace(" ", "")) if isinstance(value, str) else None
    if m and int(m.group(1) or 2) >= 2:
        return f"adaptive({int(m.group(1) or 2)})"
    raise ConfigError(
        f"{key}: expected 'all', 'reuse(N)' with N >= 1 (the CPU tier keeps a block first to evict "
        f"until it has been stored or hit N times) or 'adaptive(N)' with N >= 2 (reuse(N) while it "
        f"pays), got {show(value)}"
    )


def adaptive_admission(cpu_admission: str) -> bool:
    """Whether ``cpu_admission`` (parsed) is ``adaptive(N)``."""
    return cpu_admission.startswith("adaptive")


def parse_cpu_retention(value: Any, key: str = "cpu_retention") -> str:
    """``cpu_retention`` (``parse_retention``: the CPU tier's slots)."""
    return parse_retention(value, key)


def admit_after(write_admission: Any, tier_name: str) -> int:
    """Stores-or-hits a block needs before it is written to ``tier_name`` (1 for ``all``;
    N for ``reuse(N)`` and ``adaptive(N)``)."""
    value = write_admission.get(tier_name, "all") if isinstance(write_admission, Mapping) else write_admission
    m = _REUSE_RE.match(value) or _ADAPTIVE_RE.match(value)
    return int(m.group(1)) if m else 1


def _check_tier_names(write_admission: Any, names: list[str]) -> None:
    """A ``write_admission`` mapping names lower tiers the config has (where it has any:
    a tool may add the disk tier later, ``--disk-path``); a typo would leave a tier at
    ``all`` without a word."""
    for name in write_admission if isinstance(write_admission, Mapping) and names else ():
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"write_admission: no lower tier is named {show(name)}{hint} (tiers: {', '.join(names)})")


def _parse_number(value: Any, key: str, low: float, high: float, what: str, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {show(value)}")
    number = float(value)
    if not math.isfinite(number) or not (low < number if open_low else low <= number) or not number <= high:
        raise ConfigError(f"{key}: expected {what}, got {number}")
    return number


def _parse_positive_float(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}: expected a positive number (tokens per second) or null, got {show(value)}")
    return float(value)


#: The keys a config had before ``tiers``, each a disk tier's setting: folded into the
#: tier entries when the config is parsed (``fold_shorthands``), and read by nothing
#: after. ``disk_path`` and ``disk_bytes`` are a disk tier of their own, first of all;
#: the others are the default of every disk tier that does not set its own.
DISK_SHORTHANDS = {
    "disk_path": "path",
    "disk_bytes": "bytes",
    "disk_eviction_policy": "eviction_policy",
    "disk_retention": "retention",
    "io_backend": "io_backend",
    "checksum": "checksum",
    "io_threads": "io_threads",
    "disk_io": "disk_io",
}
#: Every shorthand: the disk tier's, and ``remote`` (a shared tier after it).
SHORTHAND_KEYS = (*DISK_SHORTHANDS, "remote")


def fold_shorthands(raw: Mapping[str, Any], tiers: Any) -> tuple[TierEntry, ...]:
    """The lower tiers of a config, fastest first: ``disk_path``'s disk tier, ``remote``'s
    shared tier, then the ``tiers`` list, with the disk shorthands in ``raw`` folded in.
    Each tier's settings are validated by its own class (no tier's package is imported
    unless the config names one); errors name the key as it was written."""
    if not isinstance(tiers, (list, tuple)):
        raise ConfigError('tiers: expected a list of tiers, e.g. [{"type": "disk", "path": "/mnt/nvme/kv"}]')
    disk = {DISK_SHORTHANDS[k]: v for k, v in raw.items() if k in DISK_SHORTHANDS}
    path = parse_disk_path(disk.pop("path", None), "disk_path")
    if "bytes" in disk and path is None:
        raise ConfigError(
            "disk_bytes: set without disk_path, so there would be no disk tier to "
            'size; add "disk_path": "/mnt/nvme/tiered-kv" (a directory on '
            "local NVMe) or remove disk_bytes"
        )
    if disk:
        parse = tier_class("disk").parse_settings
        for key, setting in DISK_SHORTHANDS.items():
            if setting in disk:  # alone, so that its error names the key as written
                parse({"path": ".", setting: disk[setting]}, key.removesuffix(setting))
    entries: list[TierEntry] = []
    if path is not None:
        entry = TierEntry.parse({"type": "disk", **disk, "path": path}, "disk_path")
        aliases = tuple((setting, key) for key, setting in DISK_SHORTHANDS.items())
        entries.append(dataclasses.replace(entry, aliases=aliases))
    if raw.get("remote") is not None:
        remote = tier_class("remote").parse_settings(raw["remote"], "remote.")
        entries.append(TierEntry("remote", None, "remote", remote, key="remote"))
    defaults = {k: v for k, v in disk.items() if k != "bytes"}
    for i, item in enumerate(tiers):
        if isinstance(item, Mapping) and item.get("type") == "disk" and item.get("module_path") is None:
            item = {**defaults, **item}
        entries.append(TierEntry.parse(item, f"tiers[{i}]"))
    return tuple(entries)


@dataclass(frozen=True)
class TieredConfig:
    """Validated settings of the hierarchy. Build it with ``TieredConfig.from_dict``.

    Sizes are bytes. ``disk_path=None`` disables the disk tier.
    """

    cpu_bytes: int = 4 * 1024**3
    write_policy: str = "write_through"
    promote_on_hit: bool = True
    #: The CPU tier's eviction order (``tiered_kv.cpu``: lru or arc).
    eviction_policy: str = "lru"
    #: How GPU <-> CPU jobs move bytes: ``kernels`` (copy kernels over the mapped pinned
    #: tier), ``dma`` (copy engines, one copy per run of slots), or ``auto`` (per job:
    #: ``dma`` where its slots run 2 MiB or more, else kernels where the device can map
    #: the tier). See ``tiered_kv.cpu.handlers``.
    gpu_copy: str = "auto"
    #: Blocks allowed to wait for a write to each lower tier (write-through and spills);
    #: the excess is dropped and counted instead of stalling the engine.
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
    #: The CPU tier: ``all`` (every stored block ranks most recent), ``reuse(N)`` (a
    #: block ranks first to evict until it has been stored or hit N times), or
    #: ``adaptive(N)`` (``reuse(N)`` while miniature caches find it hits more than ``all``;
    #: the default, since which fixed rule hits more depends on the tier's size and traffic).
    cpu_admission: str = "adaptive(2)"
    #: The CPU tier: ``none``, or ``session`` / ``session(S)``: hold each returning
    #: session's latest blocks for the gap it learned between its turns, within S (0.75)
    #: of the tier's slots (``tiered_kv.tiered.retention``); ``session`` by default: a
    #: session that keeps to its gaps finds its prefix, the others lose nothing held.
    cpu_retention: str = "session"
    #: vLLM only, with ``TieredPrefetchingConnector``: a waiting request's lower-tier
    #: blocks start moving into the CPU tier when it arrives, at most
    #: ``prefetch_max_bytes`` in flight, and its blocks in CPU are held there until it
    #: runs (``tiered_kv.tiered.prefetch``).
    prefetch_waiting: bool = True
    prefetch_max_bytes: int = 256 << 20
    #: The share of each local tier's slots that ``kv.retain`` hints' leases may pin (0
    #: to 0.5), and the longest lease a hint may ask for, in seconds
    #: (``tiered_kv.integrations.vllm.hints``).
    lease_budget: float = 0.25
    lease_max_ttl_s: float = 3600.0
    #: Offloaded block size in tokens (a multiple of the engine's GPU block size).
    block_size: int | None = None
    model_id: str = "unknown"
    model_revision: str = "main"
    #: The model's directory: its weights digest goes into the disk namespace
    #: (``tiered_kv.model_identity``). Under vLLM, the directory vLLM loads is used.
    model_path: str | None = None
    #: Whether the namespace of the disk and shared tiers covers the model's weights:
    #: outside vLLM (which names the directory it loads) a config with such a tier then
    #: needs ``model_path``; ``false`` states that it does not (synthetic KV, or a model
    #: whose weights never change at its path), and the namespace says "not covered".
    cover_weights: bool = True
    #: vLLM only: each worker checks at start-up that a page stored and loaded through
    #: its handlers lands where vLLM's attention reads it
    #: (``tiered_kv.integrations.vllm.canary``); false skips it.
    canary: bool = True
    #: Every lower tier, fastest first: each a ``TierEntry`` (a ``type`` -- ``disk``,
    #: ``remote``, or a class name with its ``module_path`` -- and its own settings,
    #: validated by the tier's class, ``tiered_kv.tier_registry``). The shorthands
    #: (``SHORTHAND_KEYS``) are folded in here when the config is parsed.
    tiers: tuple[TierEntry, ...] = ()
    hash_algorithm: str = "sha256"
    hash_seed: str = ""
    #: Extra keys an engine adapter passes through untouched (e.g. vLLM's spec_name).
    passthrough: Mapping[str, Any] = field(default_factory=dict)

    _PARSERS: ClassVar[dict[str, Callable[[Any, str], Any]]] = {
        "cpu_bytes": parse_size,
        "write_policy": lambda v, k: parse_choice(v, k, WRITE_POLICIES),
        "promote_on_hit": parse_bool,
        "eviction_policy": lambda v, k: parse_choice(v, k, EVICTION_POLICIES),
        "gpu_copy": lambda v, k: parse_choice(v, k, GPU_COPIES),
        "max_pending_disk_writes": parse_positive_int,
        "cost_aware": parse_bool,
        "prefill_tokens_per_s": _parse_positive_float,
        "write_admission": parse_write_admission,
        "cpu_admission": parse_cpu_admission,
        "cpu_retention": parse_cpu_retention,
        "prefetch_waiting": parse_bool,
        "prefetch_max_bytes": parse_size,
        "lease_budget": lambda v, k: _parse_number(v, k, 0.0, 0.5, "a share of each tier from 0 to 0.5"),
        "lease_max_ttl_s": lambda v, k: _parse_number(v, k, 0.0, math.inf, "seconds > 0", open_low=True),
        "block_size": lambda v, k: None if v is None else parse_positive_int(v, k),
        "model_id": parse_text,
        "model_revision": parse_text,
        "model_path": lambda v, k: None if v is None else parse_text(v, k),
        "cover_weights": parse_bool,
        "canary": parse_bool,
        "hash_algorithm": lambda v, k: parse_choice(v, k, HASH_ALGORITHMS),
        "hash_seed": lambda v, k: parse_text(v, k, empty_ok=True, numbers_ok=True),
    }

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key a config may hold: the fields, then the shorthands."""
        return (*(f.name for f in fields(cls) if f.name != "passthrough"), *SHORTHAND_KEYS)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None = None, passthrough_keys: tuple[str, ...] = ()) -> "TieredConfig":
        """Validate ``raw``. Keys in ``passthrough_keys`` are kept unparsed; any other
        unknown key raises ``ConfigError`` naming it (with the closest known key). The
        shorthands are folded into ``tiers`` (``fold_shorthands``)."""
        raw = dict(raw or {})
        known = cls.keys()
        values: dict[str, Any] = {}
        shorthands: dict[str, Any] = {}
        passthrough: dict[str, Any] = {}
        for key, value in raw.items():
            if key in passthrough_keys:
                passthrough[key] = value
            elif key in SHORTHAND_KEYS:
                shorthands[key] = value
            elif key == "tiers":
                continue  # with the shorthands, below
            elif key in cls._PARSERS:
                values[key] = cls._PARSERS[key](value, key)
            else:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                if key in OTHER_SPECS_KEYS:
                    hint = f": {OTHER_SPECS_KEYS[key]}."
                raise ConfigError(f"unknown config key {show(key)}{hint} Known keys: {', '.join(known)}")
        values["tiers"] = fold_shorthands(shorthands, raw.get("tiers", []))
        names = [e.name for e in values["tiers"]]
        if len(set(names)) != len(names):  # as build_tiers refuses them, for the tools before a server
            raise ConfigError(f"tiers: every lower tier needs its own name; got {', '.join(names)}")
        _check_tier_names(values.get("write_admission"), names)
        return cls(**values, passthrough=passthrough)

    def tier_entries(self) -> tuple[TierEntry, ...]:
        """Every lower tier, fastest first (``tiers``, the shorthands folded in)."""
        return self.tiers

    def tiers_of_type(self, type_name: str) -> tuple[TierEntry, ...]:
        """The lower tiers of one registered type (``disk``, ``remote``), in order."""
        return tuple(e for e in self.tiers if e.type_name == type_name and e.module_path is None)

    @property
    def disk_tier(self) -> TierEntry | None:
        """The first disk tier, fastest first; None without one."""
        return next(iter(self.tiers_of_type("disk")), None)

    @property
    def shared_tier(self) -> TierEntry | None:
        """The first shared tier (type ``remote``); None without one."""
        return next(iter(self.tiers_of_type("remote")), None)

    @property
    def copy_kernels(self) -> bool | None:
        """``gpu_copy`` as the GPU <-> CPU handlers take it: True, False, or None (auto)."""
        return {"auto": None, "kernels": True, "dma": False}[self.gpu_copy]

    def with_disk_path(self, path: str) -> "TieredConfig":
        """This config with the first disk tier on ``path`` (a disk tier of the default
        size first of all, where it has none)."""
        disk = self.disk_tier
        if disk is None:
            return dataclasses.replace(self, tiers=(*fold_shorthands({"disk_path": path}, []), *self.tiers))
        moved = dataclasses.replace(disk, settings=dataclasses.replace(disk.settings, path=path))
        return dataclasses.replace(self, tiers=tuple(moved if e is disk else e for e in self.tiers))

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.keys() if k not in SHORTHAND_KEYS}
        out["tiers"] = [entry.to_dict() for entry in self.tiers]
        return out
