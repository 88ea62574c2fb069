"""Validated settings of the shared tier (S3-compatible object storage or a Mooncake
Store, ``backend``), in human units.

Parsed in every process that opens the tier (the scheduler for membership probes, each
worker for its uploads and downloads) from the same dict; no I/O here. Credentials are
never part of it: they come from the standard AWS chain (environment, shared credentials
and config files with an optional profile, container or instance roles), so the config
can be echoed and logged whole.

Every error names the key, the bad value (``show``: never what looks like a key) and
what is expected. Every duration has a finite upper bound (``DURATION_LIMITS``), and the
prefix is short enough that the longest object key (``longest_key``) stays within S3's
1024-byte limit.

The fleet key is never part of the config either: ``key_file`` names a file and
``key_env`` an environment variable that hold it (``tiered_kv.remote.format.keys``). A value
that looks like a key (``config_values.looks_like_key``), pasted into those or any other
setting, is refused without being echoed: the config is printed whole (``tiered-kv
doctor --json``, ``to_dict``), and its values appear in messages and logs.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar
from urllib.parse import urlsplit

from tiered_kv.config_values import CHECKSUMS, DEFAULT_CHECKSUM, ConfigError, looks_like_key, parse_size, show

#: What the shared tier receives: every block the CPU tier stores (``write_through``), or
#: only the blocks the local tiers evict (``evictions``).
REMOTE_WRITE_POLICIES = ("write_through", "evictions")
#: How writes stay write-once: ``auto`` sends ``If-None-Match: *`` and, on a server that
#: refuses it as unsupported, switches to an existence check (HEAD) then a plain PUT;
#: ``always`` refuses such a server (a start-up error); ``never`` always checks then PUTs.
CONDITIONAL_PUT_MODES = ("auto", "always", "never")
#: Where the objects live: S3-compatible object storage, or a Mooncake Store's
#: distributed DRAM pool (``backends`` maps each to its client).
REMOTE_BACKENDS = ("s3", "mooncake")
#: How a Mooncake Store moves bytes: its transfer engine over TCP, or RDMA.
MOONCAKE_PROTOCOLS = ("tcp", "rdma")

_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|min|h)?\s*$")
_DURATION_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}
#: S3's bucket naming rules (lower case, digits, dots and hyphens; 3 to 63 characters).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: Upper bound per duration key, in seconds: no setting may make a wait, a cooldown or a
#: cache entry last for ever (or overflow a timer).
DURATION_LIMITS = {
    "connect_timeout": 60.0,
    "request_timeout": 3600.0,
    "absent_ttl": 86400.0,
    "unavailable_cooldown": 3600.0,
}
#: Bound on ``max_pending_upload_bytes`` (host memory held by uploads not yet sent).
MAX_PENDING_UPLOAD_BYTES = 64 * 1024**3
#: S3's limit on an object key, in bytes of UTF-8.
S3_MAX_KEY_BYTES = 1024
#: Longest block hash the shared tier stores (vLLM's are 32 bytes, 8 with xxhash).
MAX_KEY_HASH_BYTES = 64
#: ``Fingerprint.namespace_id``'s length (``tiered_kv.fingerprint.NAMESPACE_ID_LEN``,
#: which imports this module's importer: a test keeps the two equal).
NAMESPACE_ID_CHARS = 16
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


def longest_key(prefix: str) -> int:
    """Bytes of the longest object key under ``prefix``:
    ``<prefix>/<namespace id>[.plain]/<fan-out>/<hash hex>-r<rank>`` with the longest hash
    and rank (a plain namespace's directory is the longer: ``object_format.PLAIN_SUFFIX``)."""
    namespace = NAMESPACE_ID_CHARS + len(".plain")
    return len(prefix.encode()) + 1 + namespace + 1 + 2 + 1 + 2 * MAX_KEY_HASH_BYTES + len("-r65535")


def parse_duration(value: Any, key: str, limit: float = math.inf) -> float:
    """Seconds from a number or a string such as ``"500ms"``, ``"2s"``, ``"1m"``; > 0
    and at most ``limit``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a duration such as 2s or 500ms, got {show(value)}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ConfigError(f"{key}: expected a duration such as 2s or 500ms (or a number of seconds), got {show(value)}")
    if not seconds > 0:
        raise ConfigError(f"{key}: duration must be positive, got {show(value)}")
    if not seconds <= limit:
        raise ConfigError(f"{key}: duration must be at most {limit:g}s, got {show(value)}")
    return seconds


def _bounded_duration(value: Any, key: str) -> float:
    return parse_duration(value, key, DURATION_LIMITS[key.rsplit(".", 1)[-1]])


def _choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ConfigError(f"{key}: expected one of {', '.join(choices)}; got {show(value)}")


def _int_in(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key}: expected an integer in {low}..{high}, got {show(value)}")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{key}: expected an integer in {low}..{high}, got {show(value)}") from None
    if not low <= n <= high:
        raise ConfigError(f"{key}: expected an integer in {low}..{high}, got {show(value)}")
    return n


def _endpoint(value: Any, key: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a URL such as http://127.0.0.1:7480, got {show(value)}")
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{key}: expected an http:// or https:// URL such as http://127.0.0.1:7480, got {show(value)}"
        )
    if parts.username or parts.password:
        # Never echo the value: it holds a secret (which need not look like a key).
        raise ConfigError(
            f"{key}: the URL must not carry credentials (user:secret@host); they come from "
            "the AWS environment, profile or credentials file"
        )
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ConfigError(
            f"{key}: expected scheme://host[:port] only (the bucket and prefix have their own keys), got {show(value)}"
        )
    try:
        _ = parts.port  # parsed on access: a bad port raises here
    except ValueError:
        raise ConfigError(f"{key}: bad port in {show(value)}") from None
    return f"{parts.scheme}://{parts.netloc}"


def _bucket(value: Any, key: str) -> str:
    if not isinstance(value, str) or not _BUCKET_RE.match(value) or ".." in value:
        raise ConfigError(
            f"{key}: expected an S3 bucket name (3-63 characters: lower-case letters, digits, "
            f"'.' and '-', starting and ending with a letter or digit), got {show(value)}"
        )
    return value


def _prefix(value: Any, key: str) -> str:
    text = value.strip("/") if isinstance(value, str) else None
    if not text or not _PREFIX_RE.match(text) or any(p in (".", "..") for p in text.split("/")):
        raise ConfigError(
            f"{key}: expected a key prefix such as 'tiered-kv' or 'team/kv' (letters, digits, "
            f"'.', '_', '-', segments joined by '/'), got {show(value)}"
        )
    if longest_key(text) > S3_MAX_KEY_BYTES:
        raise ConfigError(
            f"{key}: {len(text)} characters is too long: the longest object key under it would be "
            f"{longest_key(text)} bytes, over S3's {S3_MAX_KEY_BYTES}; use at most "
            f"{S3_MAX_KEY_BYTES - longest_key('')} characters"
        )
    return text


def _pending_bytes(value: Any, key: str) -> int:
    n = parse_size(value, key)
    if n > MAX_PENDING_UPLOAD_BYTES:
        raise ConfigError(f"{key}: at most {MAX_PENDING_UPLOAD_BYTES // 1024**3}GiB of host memory, got {show(value)}")
    return n


def _host_port(value: Any, key: str) -> str:
    text = value.strip() if isinstance(value, str) else ""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in text):
        raise ConfigError(f"{key}: expected host:port such as 127.0.0.1:50051, got {show(value)}")
    return text


def _metadata_server(value: Any, key: str) -> str:
    text = value.strip() if isinstance(value, str) else ""
    parts = urlsplit(text)
    if text == "P2PHANDSHAKE" or (parts.scheme in ("http", "etcd") and parts.hostname):
        return text
    raise ConfigError(
        f"{key}: expected the metadata server's URL such as http://127.0.0.1:8080/metadata "
        f"(or etcd://host:port, or P2PHANDSHAKE), got {show(value)}"
    )


def _bool(value: Any, key: str) -> bool:
    # A JSON boolean only: "yes" for trusted_bucket must not switch off authentication.
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}: expected true or false (a JSON boolean), got {show(value)}")


def _path(value: Any, key: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a file path, got {show(value)}")
    return os.path.expanduser(value)


def _env_name(value: Any, key: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        # Never echo a value that is not a variable name: it may be the key itself, in
        # a form ``looks_like_key`` does not know.
        raise ConfigError(
            f"{key}: expected the name of an environment variable (letters, digits, '_'), such as "
            "TIERED_KV_FLEET_KEY; the key itself never goes in the config"
        )
    return value


def _optional_name(value: Any, key: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise ConfigError(f"{key}: expected a name without spaces, got {show(value)}")
    return value.strip()


#: What a setting whose value looks like a key expects instead (the value is not shown:
#: a message goes to terminals and logs).
_KEY_PASTED = {
    "key_file": (
        "expected the path of a file holding the fleet key, got a value that looks like a key "
        "itself (not shown); the key itself never goes in the config: write it to a file "
        "(chmod 600) and name that file here, or name an environment variable holding it in "
        "key_env. (A path is taken for a key where it runs 64 hex digits, or 43 letters and "
        "digits in mixed case, without a '.' in between: rename such a file)"
    ),
    "key_env": (
        "expected the name of an environment variable holding the fleet key, such as "
        "TIERED_KV_FLEET_KEY, got a value that looks like a key itself (not shown); the key "
        "itself never goes in the config: export it in that variable and name the variable here"
    ),
    "": (
        "got a value that looks like a key (not shown); the fleet key never goes in the "
        "config: name a file holding it (key_file) or an environment variable (key_env)"
    ),
}


@dataclass(frozen=True)
class RemoteConfig:
    """Settings of the shared tier. Build it with ``RemoteConfig.from_dict``.

    ``backend`` ``s3``: ``endpoint`` None means AWS S3 itself (``region``'s endpoint).
    Objects live under ``<prefix>/<namespace id>/...`` in ``bucket``; every node of a
    fleet that serves the same model with the same settings shares them.

    ``backend`` ``mooncake``: the same keys in a Mooncake Store whose master is
    ``mooncake_master`` (``bucket``, ``endpoint``, ``region`` and ``profile`` unused).
    This process donates ``mooncake_segment_bytes`` of its memory to the pool (0: none;
    a standalone ``mooncake_client`` holds the objects, which vanish with the process
    that donated their memory) and copies through a local buffer of
    ``mooncake_buffer_bytes``, the bound on one transfer.
    """

    bucket: str = ""
    backend: str = "s3"
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
    #: File holding the fleet key(s) (``tiered_kv.remote.format.keys``); never the key itself.
    key_file: str | None = None
    #: Environment variable holding the fleet key(s), where no ``key_file`` is named.
    key_env: str | None = None
    #: Store blocks unencrypted and unauthenticated: everyone who can write the bucket is
    #: trusted. Without a key and without this, the shared tier refuses to start.
    trusted_bucket: bool = False
    #: PEM file of CA certificates to trust for an https endpoint (besides the system's).
    ca_bundle: str | None = None
    #: The Mooncake master's RPC address.
    mooncake_master: str = "127.0.0.1:50051"
    #: The transfer engine's metadata server (the master's HTTP one, etcd, or P2PHANDSHAKE).
    mooncake_metadata_server: str = "http://127.0.0.1:8080/metadata"
    #: ``MOONCAKE_PROTOCOLS``.
    mooncake_protocol: str = "tcp"
    #: RDMA devices for ``rdma`` (e.g. ``mlx5_0``); empty: the engine finds them.
    mooncake_rdma_devices: str = ""
    #: The address other Mooncake clients reach this process at.
    mooncake_local_hostname: str = "127.0.0.1"
    #: Memory this process donates to the pool (objects in it vanish with the process).
    mooncake_segment_bytes: int = 0
    #: This process's transfer buffer: no single object or batch may exceed it.
    mooncake_buffer_bytes: int = 64 * 1024**2
    #: Writes straight from the caller's buffers and reads into a registered buffer
    #: (``batch_put_from_multi_buffers`` / ``get_into``) instead of ``put_parts`` / ``get``.
    mooncake_zero_copy: bool = True
    #: Mooncake's tenant: objects of one tenant are invisible to another.
    mooncake_tenant: str = "default"

    _PARSERS: ClassVar[dict[str, Callable[[Any, str], Any]]] = {
        "bucket": _bucket,
        "backend": lambda v, k: _choice(v, k, REMOTE_BACKENDS),
        "endpoint": _endpoint,
        "prefix": _prefix,
        "region": lambda v, k: _optional_name(v, k) or "us-east-1",
        "profile": _optional_name,
        "write_policy": lambda v, k: _choice(v, k, REMOTE_WRITE_POLICIES),
        "max_connections": lambda v, k: _int_in(v, k, 1, 1024),
        "max_pending_upload_bytes": _pending_bytes,
        "connect_timeout": _bounded_duration,
        "request_timeout": _bounded_duration,
        "retries": lambda v, k: _int_in(v, k, 0, 10),
        "checksum": lambda v, k: _choice(v, k, CHECKSUMS),
        "absent_ttl": _bounded_duration,
        "membership_entries": lambda v, k: _int_in(v, k, 1, 1 << 30),
        "failure_threshold": lambda v, k: _int_in(v, k, 1, 1 << 20),
        "unavailable_cooldown": _bounded_duration,
        "conditional_put": lambda v, k: _choice(v, k, CONDITIONAL_PUT_MODES),
        "key_file": _path,
        "key_env": _env_name,
        "trusted_bucket": _bool,
        "ca_bundle": _path,
        "mooncake_master": _host_port,
        "mooncake_metadata_server": _metadata_server,
        "mooncake_protocol": lambda v, k: _choice(v, k, MOONCAKE_PROTOCOLS),
        "mooncake_rdma_devices": lambda v, k: _optional_name(v, k) or "",
        "mooncake_local_hostname": lambda v, k: _optional_name(v, k) or "127.0.0.1",
        "mooncake_segment_bytes": lambda v, k: 0 if v in (0, "0") else parse_size(v, k),
        "mooncake_buffer_bytes": parse_size,
        "mooncake_zero_copy": _bool,
        "mooncake_tenant": lambda v, k: _optional_name(v, k) or "default",
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
                raise ConfigError(f"unknown config key {key_prefix}{show(key)}{hint} Known keys: {', '.join(known)}")
            if key == "bucket" and value == "":  # unset (``to_dict`` of a mooncake config)
                continue
            if looks_like_key(value):
                raise ConfigError(f"{key_prefix}{key}: {_KEY_PASTED.get(key, _KEY_PASTED[''])}")
            values[key] = cls._PARSERS[key](value, key_prefix + key)
        if values.get("backend", "s3") == "s3" and "bucket" not in values:
            raise ConfigError(f"{key_prefix}bucket: required (the S3 bucket every node of the fleet shares)")
        if values.get("key_file") and values.get("key_env"):
            raise ConfigError(
                f"{key_prefix}key_file and {key_prefix}key_env: name one place for the fleet key, not two"
            )
        return cls(**values)

    def plaintext_endpoint(self) -> bool:
        """Whether requests go over plain http to a host other than this machine's loopback."""
        if self.endpoint is None or not self.endpoint.startswith("http://"):
            return False
        host = urlsplit(self.endpoint).hostname or ""
        return host not in ("localhost", "::1") and not host.startswith("127.")

    def to_dict(self) -> dict[str, Any]:
        """Every setting; safe to log (no credentials are held here)."""
        return {k: getattr(self, k) for k in self.keys()}

    def server(self) -> str:
        """``bucket 'b' at endpoint`` (or ``where()`` for a Mooncake Store) for start-up messages."""
        if self.backend == "mooncake":
            return self.where()
        return f"bucket {self.bucket!r} at {self.endpoint or 'AWS S3'}"

    def where(self) -> str:
        """``s3://bucket/prefix at endpoint`` (or ``mooncake://master/prefix``) for messages."""
        if self.backend == "mooncake":
            return f"mooncake://{self.mooncake_master}/{self.prefix} (tenant {self.mooncake_tenant})"
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint or f'AWS S3 ({self.region})'}"
