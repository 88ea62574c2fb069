"""A server's config file, in every shape the repository ships, read into our keys.

Runs in the operator's process (``tiered-kv doctor``, ``inspect --config``, ``warmup
--config``, through ``model_identity.read_config_file``); its one I/O is reading the
file. The shapes:

- vLLM's whole ``--kv-transfer-config`` JSON (its ``kv_connector_extra_config`` is
  taken, and must name its ``spec_name``: without one vLLM runs ``CPUOffloadingSpec``),
  or that extra config alone (read as ``TieredOffloadingSpec``'s), for
  ``TieredOffloadingSpec``;
- the same for vLLM's own ``TieringOffloadingSpec`` with our ``TieredDiskTier`` among its
  ``secondary_tiers``: the tier entry's keys are ours, ``cpu_bytes_to_use`` (bytes for
  all TP ranks together) becomes ``cpu_bytes`` per rank;
- a ``vllm serve --config`` file (JSON, or YAML where PyYAML is installed) whose
  ``kv-transfer-config`` holds one of the above; its ``tensor-parallel-size``,
  ``block-size``, ``dtype`` and attention backend are read (``serve_flags``).

The extra config is kept as given too (``ServerConfigFile.given``), for tools that
rebuild from it what vLLM builds (the warm-up's CPU-tier rows of ``TieringOffloadingSpec``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, TieredConfig
from tiered_kv.config_values import ConfigError
from tiered_kv.vllm_extra import VLLM_TIER_KEYS, check_chunk_keys, parse_extra_config, parse_tier_config

TIERED_SPEC = "TieredOffloadingSpec"
#: The kv-transfer settings that run ``TieredOffloadingSpec`` under our subclass of vLLM's
#: ``OffloadingConnector`` with failed loads recomputed (each shared-tier hit read once,
#: the engine's prefill rate measured, each worker's metrics exported; see
#: ``tiered_kv.integrations.vllm.connector``): what ``tiered-kv config`` prints.
CONNECTOR = {
    "kv_connector": "TieredOffloadingConnector",
    "kv_connector_module_path": "tiered_kv.integrations.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
TIERING_SPEC = "TieringOffloadingSpec"
#: The module a kv-transfer config names for ``TieredOffloadingSpec`` (``spec_module_path``).
SPEC_MODULE = "tiered_kv.integrations.vllm"
#: The specs vLLM 0.33's factory registers: it imports them itself and ignores a
#: ``spec_module_path`` given with them; any other spec needs one.
VLLM_REGISTERED_SPECS = ("CPUOffloadingSpec", TIERING_SPEC)
#: ``type`` of our disk tier in a ``secondary_tiers`` entry, and its module.
DISK_TIER_TYPE = "TieredDiskTier"
DISK_TIER_MODULE = "tiered_kv.integrations.vllm.secondary_tier"
#: Keys of ``TieringOffloadingSpec``'s extra config that also mean something to our tier:
#: the chunk's size, which the tier's keys and namespace follow.
_TIERING_SHARED_KEYS = ("block_size", "blocks_per_chunk")
_TRANSFER_KEYS = ("kv_transfer_config", "kv-transfer-config")
_TP_KEYS = ("tensor_parallel_size", "tensor-parallel-size")
#: ``vllm serve --dtype`` values, by the name the tools (and torch) give each.
_DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
#: A ``vllm serve --config`` file's keys for ``--attention-backend``.
_BACKEND_KEYS = ("attention-backend", "attention_backend")
#: ``--load-format`` values that load the model directory's own weight files, whose
#: digest the namespace already has; any other (``dummy``'s random weights, a tensorizer
#: or sharded-state artifact, a GGUF file, bitsandbytes' quantization at load) is named
#: in the namespace (``integrations.vllm.common.vllm_model_settings``).
PLAIN_LOAD_FORMATS = ("auto", "pt", "safetensors", "npcache", "fastsafetensors", "runai_streamer")
#: ``vllm serve`` settings that change a server's namespace (``model_settings``, the
#: pipeline's stages) and that the tools do not model, with the value each has unset: a
#: warm-up refuses a file that sets one (its blocks would land where that server never
#: reads). Either spelling of a key; ``load-format``'s plain values are any that read the
#: model's own weight files.
UNMODELLED_SERVE_KEYS = {
    "hf-config-path": (None,),
    "load-format": (None, *PLAIN_LOAD_FORMATS),
    "model-loader-extra-config": (None,),
    "speculative-config": (None,),
    "mamba-cache-dtype": (None, "auto"),
    "mamba-ssm-cache-dtype": (None, "auto"),
    "pipeline-parallel-size": (None, 1),
    "kv-cache-dtype": (None, "auto"),
}
#: The most a config file may hold: a server's config is a few KiB; a larger file is not
#: one, and is refused before it is read whole.
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerConfigFile:
    """What a config file says, in our keys.

    ``extra``: the keys ``TieredConfig.from_dict`` takes (vLLM's pass-through keys
    included); ``spec_name``: the vLLM spec the file loads; ``tp``: the tensor-parallel
    size where the file names it (a ``vllm serve --config`` file), else None;
    ``cpu_bytes_total``: ``TieringOffloadingSpec``'s ``cpu_bytes_to_use``, split per
    rank by ``extra_for``; ``transfer``: below."""

    path: Path
    extra: dict[str, Any]
    spec_name: str = TIERED_SPEC
    tp: int | None = None
    cpu_bytes_total: int | None = None
    #: The kv-transfer config's own keys (``kv_connector``, ``kv_load_failure_policy``,
    #: ...), None where the file is the extra config alone.
    transfer: dict[str, Any] | None = None
    #: The module vLLM loads the spec from (``spec_module_path``), None where the file
    #: names none (vLLM's own registry).
    spec_module_path: str | None = None
    #: The ``kv_connector_extra_config`` exactly as the server is given it (for
    #: ``TieringOffloadingSpec``: vLLM's keys and every ``secondary_tiers`` entry), for
    #: tools that rebuild what vLLM builds from it; None: the same as ``extra``.
    server_extra: dict[str, Any] | None = None
    #: The attention backend a ``vllm serve --config`` file starts the server on (its
    #: ``attention-backend``, upper case as vLLM names it); None where the file sets
    #: none (vLLM then selects one on the serving host).
    attention_backend: str | None = None
    #: The ``UNMODELLED_SERVE_KEYS`` a ``vllm serve --config`` file sets.
    unmodelled: tuple[str, ...] = ()
    #: A ``vllm serve --config`` file's ``block-size`` (tokens per GPU block), None where unset.
    gpu_block_size: int | None = None
    #: A ``vllm serve --config`` file's ``dtype`` in torch's name (``half`` is ``float16``;
    #: ``auto``: vLLM's choice), None where unset.
    dtype: str | None = None

    def serve_flags(self) -> dict[str, Any]:
        """The ``vllm serve`` settings this file starts its server with, among those a
        namespace records, as ``ops.warmup.VllmServe`` keywords (``tp_size``,
        ``gpu_block_size``, ``dtype``): only those the file sets."""
        flags = {"tp_size": self.tp, "gpu_block_size": self.gpu_block_size, "dtype": self.dtype}
        return {k: v for k, v in flags.items() if v is not None}

    @property
    def given(self) -> dict[str, Any]:
        """The extra config as the server is given it (``server_extra``, else ``extra``)."""
        return dict(self.extra if self.server_extra is None else self.server_extra)

    def with_disk_path(self, path: str) -> "ServerConfigFile":
        """The same server with its first disk tier at ``path``, the rest of its settings
        (capacity included) as they were: ``disk_path`` where the config sets it, else the
        first ``{"type": "disk"}`` entry of ``tiers``, else a disk tier of its own, first
        of all; for ``TieringOffloadingSpec``, its ``TieredDiskTier`` entry's
        ``disk_path``, in our keys and in the entry as given."""
        if self.server_extra is None or self.spec_name != TIERING_SPEC:
            return replace(self, extra=_with_first_disk_path(self.extra, path))
        given = dict(self.server_extra)
        given["secondary_tiers"] = [
            {**t, "disk_path": path} if _is_disk_tier(t) else t for t in given["secondary_tiers"]
        ]
        return replace(self, extra={**self.extra, "disk_path": path}, server_extra=given)

    def config(self, tp: int | None = None) -> TieredConfig:
        """The config the server runs at tensor-parallel size ``tp`` (``extra_for``),
        validated as its spec validates it (``tiered_kv.vllm_extra``: what the server
        refuses, a tool refuses too). Raises ``ConfigError`` naming the file."""
        try:
            if self.spec_name == TIERING_SPEC:  # its entry was checked when the file was read
                return TieredConfig.from_dict(self.extra_for(tp), passthrough_keys=VLLM_PASSTHROUGH_KEYS)
            return parse_extra_config(self.extra_for(tp))
        except ConfigError as e:
            raise ConfigError(f"config {self.path}: {e}") from None

    def extra_for(self, tp: int | None = None) -> dict[str, Any]:
        """``extra`` with ``cpu_bytes`` per rank at tensor-parallel size ``tp`` (default:
        the file's, else 1) where the file sizes the CPU tier for all ranks together."""
        out = dict(self.extra)
        if self.cpu_bytes_total is not None:
            # With its unit: ``TieredConfig`` reads a bare number under 1 MiB as a
            # forgotten unit, and vLLM's cpu_bytes_to_use is bytes whatever its size.
            out["cpu_bytes"] = f"{self.cpu_bytes_total // (tp or self.tp or 1)}B"
        return out


def _load(p: Path) -> Any:
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config {p}: larger than {MAX_CONFIG_BYTES >> 20} MiB, so not a server's config")
        text = data.decode()
    except FileNotFoundError:
        raise ConfigError(f"config {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {p}: not readable ({e})") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"config {p}: reading YAML needs PyYAML (pip install pyyaml), or give JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config {p}: not readable YAML ({' '.join(str(e).split())})") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConfigError(f"config {p}: not readable JSON ({e})") from None


def _tp(raw: Mapping[str, Any], p: Path) -> int | None:
    for key in _TP_KEYS:
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config {p}: {key}: expected a positive integer, got {value!r}")
            return value
    return None


def _serve_value(raw: Mapping[str, Any], key: str) -> tuple[str, Any] | None:
    """The key, in either spelling (``block-size``, ``block_size``), and value of a
    ``vllm serve --config`` file's setting; None where the file does not set it."""
    for k in (key, key.replace("-", "_")):
        if raw.get(k) is not None:
            return k, raw[k]
    return None


def _block_size(raw: Mapping[str, Any], p: Path) -> int | None:
    found = _serve_value(raw, "block-size")
    if found is None:
        return None
    key, value = found
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config {p}: {key}: expected a positive integer (tokens per GPU block), got {value!r}")
    return value


def _dtype(raw: Mapping[str, Any], p: Path) -> str | None:
    found = _serve_value(raw, "dtype")
    if found is None:
        return None
    key, value = found
    if not isinstance(value, str) or value.strip().lower() not in _DTYPES:
        raise ConfigError(f"config {p}: {key}: expected one of {', '.join(_DTYPES)}, got {value!r}")
    return _DTYPES[value.strip().lower()]


def _attention_backend(raw: Mapping[str, Any], p: Path) -> str | None:
    """The backend a ``vllm serve --config`` file names: ``attention-backend``, or
    ``attention-config``'s ``backend`` (a mapping, its JSON text, or the dotted key), as
    vLLM 0.33 takes either; two that disagree are refused, as vLLM refuses them."""
    found: dict[str, Any] = {key: raw[key] for key in _BACKEND_KEYS if key in raw}
    for key in ("attention-config", "attention_config"):
        value = raw.get(key)
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except ValueError:
                raise ConfigError(f"config {p}: {key}: not JSON: {value!r}") from None
        if isinstance(value, Mapping) and "backend" in value:
            found[f"{key}.backend"] = value["backend"]
        if f"{key}.backend" in raw:
            found[f"{key}.backend"] = raw[f"{key}.backend"]
    names: dict[str, str] = {}
    for key, value in found.items():
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(
                f"config {p}: {key}: expected vLLM's name of an attention backend (e.g. FLASH_ATTN), got {value!r}"
            )
        names[key] = value.strip().upper()
    if len(set(names.values())) > 1:
        given = ", ".join(f"{k}: {v}" for k, v in names.items())
        raise ConfigError(f"config {p}: the attention backend is named twice, differently ({given}); keep one")
    return next(iter(names.values()), None)


def _with_first_disk_path(extra: Mapping[str, Any], path: str) -> dict[str, Any]:
    tiers = extra.get("tiers")
    if extra.get("disk_path") in (None, "") and isinstance(tiers, list):  # null and "": no shorthand tier
        for i, t in enumerate(tiers):
            if isinstance(t, Mapping) and t.get("type") == "disk" and t.get("module_path") is None:
                return {**extra, "tiers": [*tiers[:i], {**t, "path": path}, *tiers[i + 1 :]]}
    return {**extra, "disk_path": path}


def is_tiering(extra: Mapping[str, Any]) -> bool:
    """Whether a server given the extra config ``extra`` runs vLLM's ``TieringOffloadingSpec``:
    only where ``spec_name`` names it. vLLM's factory defaults a missing ``spec_name`` to
    its ``CPUOffloadingSpec``, ``secondary_tiers`` or not (``read_server_config`` refuses
    that shape); a config naming another spec keeps its name, so the tools refuse it
    rather than read its ``secondary_tiers`` as those of vLLM's spec."""
    return extra.get("spec_name") == TIERING_SPEC


class UnsupportedConfig(ConfigError):
    """A config the server may well run but whose disk tier the tools cannot judge (the
    message says which shape): distinct from a config the server refuses, so a tool's
    advice names the tools' limit, not a server error."""


def _is_disk_tier(entry: Any) -> bool:
    return isinstance(entry, Mapping) and (
        entry.get("type") == DISK_TIER_TYPE or entry.get("module_path") == DISK_TIER_MODULE
    )


def disk_tier_entries(extra: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The ``TieredDiskTier`` entries of a ``TieringOffloadingSpec`` extra config's
    ``secondary_tiers`` (by ``type`` or by ``module_path``), as given."""
    tiers = extra.get("secondary_tiers")
    return [t for t in tiers if _is_disk_tier(t)] if isinstance(tiers, list) else []


def _tiering(extra: Mapping[str, Any], p: Path) -> tuple[dict[str, Any], int | None]:
    """Our keys of a ``TieringOffloadingSpec`` extra config, and its ``cpu_bytes_to_use``."""
    tiers = extra.get("secondary_tiers")
    if not isinstance(tiers, list):
        raise ConfigError(f"config {p}: secondary_tiers: expected a list of tier entries, got {tiers!r}")
    ours = disk_tier_entries(extra)
    for entry in ours:
        # vLLM's SecondaryTierFactory imports an unregistered type from module_path, and
        # refuses to start without one ("Unknown secondary tier type").
        if entry.get("type") == DISK_TIER_TYPE and entry.get("module_path") is None:
            raise ConfigError(
                f"config {p}: secondary_tiers: a {DISK_TIER_TYPE} entry without module_path, which vLLM "
                f'refuses (unknown secondary tier type); add "module_path": "{DISK_TIER_MODULE}"'
            )
    if not ours:
        raise UnsupportedConfig(
            f"config {p}: {TIERING_SPEC} with 0 {DISK_TIER_TYPE} entries in secondary_tiers: the tools judge "
            f'{DISK_TIER_TYPE}, not vLLM\'s own tiers; add {{"type": "{DISK_TIER_TYPE}", "module_path": '
            f'"{DISK_TIER_MODULE}", "disk_path": ..., "disk_bytes": ...}}'
        )
    if len(ours) > 1:
        paths = ", ".join(repr(t.get("disk_path")) for t in ours)
        raise UnsupportedConfig(
            f"config {p}: {TIERING_SPEC} with {len(ours)} {DISK_TIER_TYPE} entries (disk_path {paths}): the "
            f"server runs them all, but the tools judge one {DISK_TIER_TYPE} per config; give the tools a copy "
            "of the config with one entry per disk tier"
        )
    try:
        parse_tier_config(ours[0])  # as the tier itself checks its entry when vLLM builds it
    except ConfigError as e:
        raise ConfigError(f"config {p}: {DISK_TIER_TYPE} entry: {e}") from None
    try:
        check_chunk_keys(extra)  # as vLLM's connector checks the spec's extra config
    except ConfigError as e:
        raise ConfigError(f"config {p}: {e}") from None
    out = {k: v for k, v in ours[0].items() if k not in VLLM_TIER_KEYS}
    for key in _TIERING_SHARED_KEYS:
        if key in extra and key not in out:
            out[key] = extra[key]
    return out, _cpu_bytes_to_use(extra.get("cpu_bytes_to_use"), p)


def _cpu_bytes_to_use(total: Any, p: Path) -> int:
    """``cpu_bytes_to_use`` as vLLM's ``CPUOffloadingSpec`` reads it: ``int()`` of the value
    (a number, or a string of digits), which must be positive; required, as vLLM refuses
    to start without it."""
    if total is None:
        raise ConfigError(
            f"config {p}: cpu_bytes_to_use is not set, and vLLM's {TIERING_SPEC} refuses to start without it "
            "(the CPU tier's bytes for all TP ranks together)"
        )
    try:
        if isinstance(total, bool) or not isinstance(total, (int, float, str)):
            raise TypeError
        value = int(total)
    except (TypeError, ValueError, OverflowError):
        value = 0
    if value <= 0:
        raise ConfigError(
            f"config {p}: cpu_bytes_to_use: expected a positive number of bytes (an integer, as vLLM reads it "
            f"with int()), got {total!r}"
        )
    return value


def _spec_name(extra: Mapping[str, Any], p: Path, whole: bool) -> str:
    """The spec a server given ``extra`` loads; ``whole``: ``extra`` came inside vLLM's
    kv-transfer config. vLLM's factory takes a missing ``spec_name`` as its
    ``CPUOffloadingSpec``, which reads none of our keys (no disk tier), so a whole
    kv-transfer config without one is refused, as is ``secondary_tiers`` without one;
    an extra config alone, of our keys, is read as ``TieredOffloadingSpec``'s. A
    ``spec_name`` that is not a non-empty string, or a spec vLLM does not register
    without a ``spec_module_path``, is refused, as vLLM's factory refuses it at start."""
    if "spec_name" not in extra:
        if "secondary_tiers" in extra:
            raise ConfigError(
                f"config {p}: secondary_tiers without spec_name: vLLM then runs its CPUOffloadingSpec, which "
                f'ignores secondary_tiers (no disk tier); set "spec_name": "{TIERING_SPEC}"'
            )
        if whole:
            raise ConfigError(
                f"config {p}: kv_connector_extra_config has no spec_name: vLLM then runs its CPUOffloadingSpec, "
                f'which reads none of tiered-kv\'s keys (no disk or shared tier); set "spec_name": "{TIERED_SPEC}" '
                f'and "spec_module_path": "{SPEC_MODULE}"'
            )
        return TIERED_SPEC
    spec = extra["spec_name"]
    if not isinstance(spec, str) or not spec:
        raise ConfigError(
            f'config {p}: spec_name: expected the name of an offloading spec (e.g. "{TIERED_SPEC}"), got {spec!r}'
        )
    if whole and spec not in VLLM_REGISTERED_SPECS and extra.get("spec_module_path") is None:
        raise ConfigError(
            f"config {p}: spec_name {spec!r} without spec_module_path: vLLM registers only "
            f"{', '.join(VLLM_REGISTERED_SPECS)} and refuses to start with another spec it cannot import; "
            f'set "spec_module_path"' + (f': "{SPEC_MODULE}"' if spec == TIERED_SPEC else "")
        )
    return spec


def read_server_config(path: str | os.PathLike) -> ServerConfigFile:
    """Read ``path`` in any shape of the module docstring. Raises ``ConfigError`` naming
    the file."""
    p = Path(path)
    raw = _load(p)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config {p}: expected a JSON object, got {type(raw).__name__}")
    tp, backend, block, dtype = _tp(raw, p), None, None, None
    unmodelled = tuple(
        key
        for key, unset in UNMODELLED_SERVE_KEYS.items()
        if any(k in raw and raw[k] not in unset and raw[k] != {} for k in (key, key.replace("-", "_")))
    )
    for key in _TRANSFER_KEYS:
        if key in raw:
            inner = raw[key]
            if isinstance(inner, str):
                try:
                    inner = json.loads(inner)
                except ValueError as e:
                    raise ConfigError(f"config {p}: {key}: not readable JSON ({e})") from None
            if not isinstance(inner, Mapping):
                raise ConfigError(f"config {p}: {key}: expected an object, got {type(inner).__name__}")
            # vllm serve flags: beside its kv-transfer-config
            backend, block, dtype = _attention_backend(raw, p), _block_size(raw, p), _dtype(raw, p)
            raw = inner
            break
    transfer = None
    if isinstance(raw.get("kv_connector_extra_config"), Mapping):
        transfer = {k: v for k, v in raw.items() if k != "kv_connector_extra_config"}
        raw = raw["kv_connector_extra_config"]
    elif tp is not None:
        raise ConfigError(f"config {p}: a vllm serve config without kv-transfer-config holds no tier settings")
    extra = dict(raw)
    spec = _spec_name(extra, p, transfer is not None)
    module = extra.get("spec_module_path")
    module = None if module is None else str(module)
    if is_tiering(extra):
        ours, total = _tiering(extra, p)
        return ServerConfigFile(
            p,
            ours,
            TIERING_SPEC,
            tp,
            total,
            transfer,
            module,
            server_extra=extra,
            attention_backend=backend,
            unmodelled=unmodelled,
            gpu_block_size=block,
            dtype=dtype,
        )
    return ServerConfigFile(
        p,
        extra,
        spec,
        tp,
        transfer=transfer,
        spec_module_path=module,
        attention_backend=backend,
        unmodelled=unmodelled,
        gpu_block_size=block,
        dtype=dtype,
    )
