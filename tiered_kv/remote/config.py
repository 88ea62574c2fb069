"""Validated settings of the shared tier (S3-compatible object storage), in human units.

Parsed in every process that opens the tier (the scheduler for membership probes, each
worker for its uploads and downloads) from the same dict; no I/O here. Credentials are
never part of it: they come from the standard AWS chain (environment, shared credentials
and config files with an optional profile, container or instance roles), so the config
can be echoed and logged whole.

Every error names the key, the bad value and what is expected.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar
from urllib.parse import urlsplit

from tiered_kv.config_values import CHECKSUMS, DEFAULT_CHECKSUM, ConfigError, parse_size

#: What the shared tier receives: every block the CPU tier stores (``write_through``), or
#: only the blocks the local tiers evict (``evictions``).
REMOTE_WRITE_POLICIES = ("write_through", "evictions")
#: How writes stay write-once: ``auto`` sends ``If-None-Match: *`` and, on a server that
#: refuses it as unsupported, switches to an existence check (HEAD) then a plain PUT;
#: ``always`` refuses such a server (a start-up error); ``never`` always checks then PUTs.
CONDITIONAL_PUT_MODES = ("auto", "always", "never")

_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|min|h)?\s*$")
_DURATION_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}
#: S3's bucket naming rules (lower case, digits, dots and hyphens; 3 to 63 characters).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


def parse_duration(value: Any, key: str) -> float:
    """Seconds from a number or a string such as ``"500ms"``, ``"2s"``, ``"1m"``; > 0."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a duration such as 2s or 500ms, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ConfigError(f"{key}: expected a duration such as 2s or 500ms (or a number of seconds), got {value!r}")
    if not seconds > 0:
        raise ConfigError(f"{key}: duration must be positive, got {value!r}")
    return seconds


def _choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ConfigError(f"{key}: expected one of {', '.join(choices)}; got {value!r}")


def _int_in(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key}: expected an integer in {low}..{high}, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{key}: expected an integer in {low}..{high}, got {value!r}") from None
    if not low <= n <= high:
        raise ConfigError(f"{key}: expected an integer in {low}..{high}, got {value!r}")
    return n


def _endpoint(value: Any, key: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a URL such as http://127.0.0.1:7480, got {value!r}")
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: expected an http:// or https:// URL such as http://127.0.0.1:7480, got {value!r}")
    if parts.username or parts.password:
        # Never echo the value: it holds a secret.
        raise ConfigError(
            f"{key}: the URL must not carry credentials (user:secret@host); they come from "
            "the AWS environment, profile or credentials file"
        )
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ConfigError(
            f"{key}: expected scheme://host[:port] only (the bucket and prefix have their own keys), got {value!r}"
        )
    try:
        _ = parts.port  # parsed on access: a bad port raises here
    except ValueError:
        raise ConfigError(f"{key}: bad port in {value!r}") from None
    return f"{parts.scheme}://{parts.netloc}"


def _bucket(value: Any, key: str) -> str:
    if not isinstance(value, str) or not _BUCKET_RE.match(value) or ".." in value:
        raise ConfigError(
            f"{key}: expected an S3 bucket name (3-63 characters: lower-case letters, digits, "
            f"'.' and '-', starting and ending with a letter or digit), got {value!r}"
        )
    return value


def _prefix(value: Any, key: str) -> str:
    text = value.strip("/") if isinstance(value, str) else None
    if not text or not _PREFIX_RE.match(text) or any(p in (".", "..") for p in text.split("/")):
        raise ConfigError(
            f"{key}: expected a key prefix such as 'tiered-kv' or 'team/kv' (letters, digits, "
            f"'.', '_', '-', segments joined by '/'), got {value!r}"
        )
    return text


def _optional_name(value: Any, key: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise ConfigError(f"{key}: expected a name without spaces, got {value!r}")
    return value.strip()


@dataclass(frozen=True)
class RemoteConfig:
    """Settings of the shared tier. Build it with ``RemoteConfig.from_dict``.

    ``endpoint`` None means AWS S3 itself (``region``'s endpoint). Objects live under
    ``<prefix>/<namespace id>/...`` in ``bucket``; every node of a fleet that serves
    the same model with the same settings shares them.
    """

    bucket: str
    endpoint: str | None = None
    prefix: str = "tiered-kv"
    region: str = "us-east-1"
    #: AWS profile to take credentials from (else AWS_PROFILE, else the default chain).
    profile: str | None = None
    write_policy: str = "write_through"
    #: Requests in flight at once per process: the connection pool's bound.
    max_connections: int = 16
    #: Bytes of blocks accepted for upload and not yet uploaded; a block past it is
    #: dropped and counted instead of waiting.
    max_pending_upload_bytes: int = 256 * 1024**2
    #: Bound on opening a connection (within ``request_timeout``, which bounds it too).
    connect_timeout: float = 0.5
    #: Whole-request bound (connect, send, receive) for one attempt: what a slow server
    #: can cost a load before it becomes a miss.
    request_timeout: float = 2.0
    #: Extra attempts after a transient failure (5xx such as 503 SlowDown, reset), begun
    #: only within ``request_timeout`` of the first: a request ends within twice that.
    retries: int = 1
    checksum: str = DEFAULT_CHECKSUM
    #: How long a "not in the bucket" answer is trusted: another node may upload it.
    absent_ttl: float = 10.0
    #: Entries the scheduler-side membership cache keeps (present and absent each).
    membership_entries: int = 1 << 20
    #: Consecutive transient failures after which requests are skipped (misses,
    #: dropped uploads) for ``unavailable_cooldown``, so a dead server costs no waits.
    failure_threshold: int = 8
    unavailable_cooldown: float = 5.0
    #: ``CONDITIONAL_PUT_MODES``: whether writes send ``If-None-Match: *``.
    conditional_put: str = "auto"

    _PARSERS: ClassVar[dict[str, Callable[[Any, str], Any]]] = {
        "bucket": _bucket,
        "endpoint": _endpoint,
        "prefix": _prefix,
        "region": lambda v, k: _optional_name(v, k) or "us-east-1",
        "profile": _optional_name,
        "write_policy": lambda v, k: _choice(v, k, REMOTE_WRITE_POLICIES),
        "max_connections": lambda v, k: _int_in(v, k, 1, 1024),
        "max_pending_upload_bytes": parse_size,
        "connect_timeout": parse_duration,
        "request_timeout": parse_duration,
        "retries": lambda v, k: _int_in(v, k, 0, 10),
        "checksum": lambda v, k: _choice(v, k, CHECKSUMS),
        "absent_ttl": parse_duration,
        "membership_entries": lambda v, k: _int_in(v, k, 1, 1 << 30),
        "failure_threshold": lambda v, k: _int_in(v, k, 1, 1 << 20),
        "unavailable_cooldown": parse_duration,
        "conditional_put": lambda v, k: _choice(v, k, CONDITIONAL_PUT_MODES),
    }

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, key_prefix: str = "") -> RemoteConfig:
        """Validate ``raw``. Unknown keys raise ``ConfigError`` naming the closest known
        key; ``key_prefix`` (e.g. ``"remote."``) is put before key names in messages."""
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"{key_prefix.rstrip('.') or 'remote'}: expected a mapping of settings, got {type(raw).__name__}"
            )
        known = cls.keys()
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {key_prefix}{close[0]!r}?" if close else ""
                raise ConfigError(f"unknown config key {key_prefix}{key!r}{hint} Known keys: {', '.join(known)}")
            values[key] = cls._PARSERS[key](value, key_prefix + key)
        if "bucket" not in values:
            raise ConfigError(f"{key_prefix}bucket: required (the S3 bucket every node of the fleet shares)")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Every setting; safe to log (no credentials are held here)."""
        return {k: getattr(self, k) for k in self.keys()}

    def where(self) -> str:
        """``s3://bucket/prefix at endpoint`` for messages."""
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint or f'AWS S3 ({self.region})'}"
