"""The registry of tier types and the config's list of lower tiers (``TierEntry``).

Imported by ``tiered_kv.config`` in every process; no I/O, and no import of any tier:
a type's class is imported by name when an entry names it (``module:class`` strings, or
the entry's ``module_path``, as vLLM's ``SecondaryTierFactory`` does), so a config can
be validated without loading a tier it does not use.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tiered_kv.config_values import ConfigError


class TierType(Protocol):
    """What the registry needs of a tier class (``tiered_kv.tiers.TierSpec`` has it)."""

    default_name: str
    shared: bool
    config_info_keys: tuple[str, ...]

    @classmethod
    def parse_settings(cls, raw: Mapping[str, Any], key_prefix: str) -> Any:
        """The entry's own settings, validated; errors name ``key_prefix + key``."""

    @classmethod
    def doctor_checks(cls, entry: "TierEntry", ctx: Any) -> list[Any]:
        """The tier's lines of ``tiered-kv doctor``: ``tier_ops.Check`` each (see ``TierSpec``)."""

    @classmethod
    def inspector(cls, entry: "TierEntry", ctx: Any) -> Any:
        """What ``inspect --tier`` runs on the tier: a ``tier_ops.TierInspector`` or None."""

    def get_manager(self) -> Any:
        """The scheduler side (see ``TierSpec``)."""


#: The tier types this package ships: type name -> ``module:class``. A new backend of
#: the project is one line here; an outside tier names its ``module_path`` instead.
TIER_TYPES: dict[str, str] = {
    "disk": "tiered_kv.disk.tier:DiskTier",
    "remote": "tiered_kv.remote.tier:RemoteTier",
}

_registered: dict[str, type[TierType]] = {}


def register_tier_type(type_name: str, cls: type[TierType]) -> None:
    """Make ``cls`` buildable as ``{"type": type_name}`` in this process (tests, plug-ins
    imported before the spec is built). Raises ``ValueError`` for a taken name."""
    if not _is_tier_class(cls):
        raise TypeError(f"tier type {type_name!r}: expected a TierSpec subclass, got {cls!r}")
    if type_name in TIER_TYPES or _registered.get(type_name, cls) is not cls:
        raise ValueError(f"tier type {type_name!r} is already registered")
    _registered[type_name] = cls


def tier_class(type_name: str, module_path: str | None = None, *, key: str = "tiers") -> type[TierType]:
    """The ``TierSpec`` class of a config entry. Raises ``ConfigError`` naming ``key``,
    the type and what is known."""
    if module_path is not None:
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            raise ConfigError(f"{key}.module_path: cannot import {module_path!r}: {exc}") from None
        cls = getattr(module, type_name, None)
        if cls is None:
            raise ConfigError(f"{key}.type: module {module_path!r} has no class {type_name!r}")
    elif type_name in _registered:
        cls = _registered[type_name]
    elif type_name in TIER_TYPES:
        module_name, _, attr = TIER_TYPES[type_name].partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
    else:
        known = ", ".join(sorted({*TIER_TYPES, *_registered}))
        raise ConfigError(
            f"{key}.type: unknown tier type {type_name!r}; expected one of {known}, "
            f"or a class name with its module_path"
        )
    if not _is_tier_class(cls):
        raise ConfigError(f"{key}.type: {type_name!r} is not a TierSpec subclass (tiered_kv.tiers.TierSpec)")
    return cls


@dataclass(frozen=True)
class TierEntry:
    """One lower tier of the config, validated by its own class: ``settings`` is what
    ``cls.parse_settings`` returned; ``name`` names it in stats and transfer types;
    ``medium`` (None: the type's own) is the medium its events name, which tells two
    tiers of one type apart."""

    type_name: str
    module_path: str | None
    name: str
    settings: Any
    medium: str | None = None
    #: Where the entry was written (``tiers[0]``, or a shorthand: ``disk_path``,
    #: ``remote``), and the shorthand keys its settings were written as.
    key: str = "tiers"
    aliases: tuple[tuple[str, str], ...] = ()

    def setting_key(self, setting: str) -> str:
        """The config key ``setting`` was written as, for an error message."""
        return dict(self.aliases).get(setting) or f"{self.key}.{setting}"

    def to_dict(self) -> dict[str, Any]:
        """The entry as config keys (settings objects with a ``to_dict`` are expanded)."""
        out: dict[str, Any] = {"type": self.type_name, "name": self.name}
        if self.module_path is not None:
            out["module_path"] = self.module_path
        if self.medium is not None:
            out["medium"] = self.medium
        settings = self.settings
        if hasattr(settings, "to_dict"):
            out.update(settings.to_dict())
        elif settings is not None and hasattr(settings, "__dataclass_fields__"):
            out.update({k: v for k in settings.__dataclass_fields__ if (v := getattr(settings, k)) is not None})
        return out

    @property
    def cls(self) -> type[TierType]:
        return tier_class(self.type_name, self.module_path)

    @classmethod
    def parse(cls, raw: Any, key: str) -> "TierEntry":
        """Validate one ``tiers`` item: a mapping with ``type`` (and ``module_path``,
        ``name``), the rest checked by the tier class."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{key}: expected a mapping with a 'type' key, got {raw!r}")
        raw = dict(raw)
        type_name = raw.pop("type", None)
        if not isinstance(type_name, str) or not type_name:
            raise ConfigError(f"{key}.type: expected a tier type name (e.g. 'disk'), got {type_name!r}")
        module_path = raw.pop("module_path", None)
        if module_path is not None and not isinstance(module_path, str):
            raise ConfigError(f"{key}.module_path: expected a module name, got {module_path!r}")
        tier = tier_class(type_name, module_path, key=key)
        name = raw.pop("name", tier.default_name)
        if not isinstance(name, str) or not name.isidentifier() or name == "cpu":
            raise ConfigError(f"{key}.name: expected an identifier other than 'cpu', got {name!r}")
        medium = raw.pop("medium", None)
        if medium is not None and (not isinstance(medium, str) or not medium.isidentifier()):
            raise ConfigError(f"{key}.medium: expected an identifier such as 'DISK2', got {medium!r}")
        return cls(type_name, module_path, name, tier.parse_settings(raw, f"{key}."), medium, key)


def _is_tier_class(cls: object) -> bool:
    return isinstance(cls, type) and all(
        callable(getattr(cls, name, None)) for name in ("parse_settings", "get_manager", "get_worker")
    )


__all__ = ["TIER_TYPES", "TierEntry", "TierType", "register_tier_type", "tier_class"]
