"""The shared tier from the operator's side: summary, listing, clearing and eviction of
the objects under a config's ``remote`` prefix (``tiered-kv inspect ... --remote
CONFIG``). Verification and repair are ``remote_verify``; keys that clients parsing keys
as paths cannot hold, ``remote_hostile``.

Operator's process. I/O: S3 requests to the config's bucket: one paged LIST of
``<prefix>/`` (through botocore, ``raw_keys.RawKeys``: an operator tool may list; the
serving path never does) and a GET of each namespace's ``fingerprint.json`` (at most
``safe_json.MAX_RECORD_BYTES``, parsed with a depth bound). ``clear`` and ``evict``
delete. Credentials come from the AWS chain, and the fleet key from the config's
``key_file`` / ``key_env``, as for the tier itself.

Namespaces cannot overlap: an operation reads and deletes only keys that parse exactly
as this format's keys under the config's prefix (``<prefix>/<namespace>/fingerprint.json``
and ``<prefix>/<namespace>/<fan-out of the hash>/<hash hex>-r<rank>``, where a namespace
is ``<16 hex>`` for sealed objects or ``<16 hex>.plain`` for plain ones,
``object_format.namespace_prefix``). Every other key under the prefix, such as the
objects of a prefix nested in it (``team`` and ``team/kv``), is counted as
``foreign_keys`` and never read, reported as bad or deleted.

Hostile keys (``remote_hostile``) are listed here by their bytes, never read, skipped by
summary, ls and verify, and deleted only by ``clear`` (by their exact bytes,
``RawKeys.delete``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.ops.inspect.cache import InspectError
from tiered_kv.ops.inspect.remote_hostile import HostileKey, hostile_reason
from tiered_kv.ops.inspect.summary import ServerConfig
from tiered_kv.model_identity import read_config_file
from tiered_kv.remote.store.client import ObjectInfo, RemoteError, RemoteSetupError, S3Client, WrongSize
from tiered_kv.remote.store.raw_keys import RawKeys
from tiered_kv.remote.config import MAX_KEY_HASH_BYTES, NAMESPACE_ID_CHARS, RemoteConfig
from tiered_kv.remote.format.keys import FleetKeyError, Keyring, load_keyring
from tiered_kv.remote.format.object_format import MANIFEST_NAME, PLAIN_SUFFIX, fan_out
from tiered_kv.remote.format.safe_json import MAX_RECORD_BYTES, RecordError, load_record

_NAMESPACE_RE = re.compile(rf"^[0-9a-f]{{{NAMESPACE_ID_CHARS}}}(?:{re.escape(PLAIN_SUFFIX)})?$")
_BLOCK_RE = re.compile(rf"^([0-9a-f]{{2,{2 * MAX_KEY_HASH_BYTES}}})-r(0|[1-9][0-9]{{0,4}})$")
#: ``ls`` sort keys with ``--remote`` (the disk's ``last-access`` and ``stored`` both mean
#: the object's last-modified time: an object is written once and never touched).
REMOTE_SORTS = {"last-access": "last_modified", "stored": "last_modified", "hash": "hash", "size": "size"}
#: What a namespace's objects are, by its directory name (``object_format.namespace_prefix``).
TRUST_SEALED = "sealed"
TRUST_PLAIN = "plain"


@dataclass(frozen=True)
class RemoteObject:
    """One object under a namespace: a block object (hash and rank from its key), or
    another key (``block_hash`` None)."""

    key: str
    size: int
    last_modified: float
    block_hash: bytes | None = None
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "hash": None if self.block_hash is None else self.block_hash.hex(),
            "rank": self.rank,
            "size": self.size,
            "last_modified": self.last_modified,
        }


@dataclass(frozen=True)
class BlockObject(RemoteObject):
    """A block object, its hash and rank read from its key."""

    block_hash: bytes = b""
    rank: int = 0


@dataclass
class RemoteNamespace:
    """The objects of one namespace directory under the prefix (only keys of this
    format): ``<id>`` holds sealed objects, ``<id>.plain`` plain ones."""

    namespace: str
    blocks: list[BlockObject] = field(default_factory=list)
    manifest: RemoteObject | None = None
    fingerprint: Fingerprint | None = None
    #: What makes the namespace itself suspect (a fingerprint.json that does not match).
    problems: list[str] = field(default_factory=list)
    #: What is worth knowing and harmless (no fingerprint.json: expired by a lifecycle
    #: rule, or deleted; a node writes it again when it starts).
    warnings: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        """The namespace id: the first hex digits of the fingerprint's digest."""
        return self.namespace[:NAMESPACE_ID_CHARS]

    @property
    def sealed(self) -> bool:
        return not self.namespace.endswith(PLAIN_SUFFIX)

    @property
    def trust(self) -> str:
        return TRUST_SEALED if self.sealed else TRUST_PLAIN

    @property
    def checked_fingerprint(self) -> Fingerprint | None:
        """The recorded fingerprint where it is this namespace id's: fingerprint.json is
        no authenticated record, and one copied from another namespace must not make
        every honest object here look foreign."""
        fp = self.fingerprint
        return fp if fp is not None and fp.namespace_id == self.id else None


@dataclass
class SharedTier:
    """A config's shared tier, listed: its settings, its client and its namespaces."""

    config_path: str
    config: RemoteConfig
    client: S3Client
    reader: ServerConfig
    namespaces: list[RemoteNamespace]
    #: Keys directly under the prefix, in no namespace.
    strays: list[RemoteObject]
    #: Keys under the prefix that are not this format's (another prefix nested in this
    #: one, or anything else): counted, never read or deleted.
    foreign_keys: int = 0
    keyring: Keyring | None = None
    #: Why the fleet key could not be loaded (``verify`` needs it; listing does not).
    key_error: str | None = None
    #: Keys under the prefix no path-parsing client can hold, whatever ``namespace``
    #: narrowed the listing to: they stop such clients for the whole prefix.
    hostile: list[HostileKey] = field(default_factory=list)
    #: Lists and deletes keys by their bytes (hostile keys).
    raw_keys: RawKeys | None = None

    @property
    def where(self) -> str:
        return f"s3://{self.config.bucket}/{self.config.prefix}"

    def header(self) -> dict[str, Any]:
        """The fields every ``--remote`` document starts with."""
        return {
            "path": self.where,
            "config": self.config_path,
            "endpoint": self.config.endpoint,
            "bucket": self.config.bucket,
            "prefix": self.config.prefix,
        }


def remote_config(config_path: str) -> RemoteConfig:
    """The ``remote`` settings of a server's config file; ``InspectError`` naming the file
    when it has none or they are invalid."""
    try:
        extra = read_config_file(config_path)
        shared = TieredConfig.from_dict(extra, passthrough_keys=VLLM_PASSTHROUGH_KEYS).shared_tier
    except ConfigError as e:
        raise InspectError(f"--remote {config_path}: {e}") from None
    if shared is None:
        raise InspectError(
            f"--remote {config_path}: the config has no 'remote' key (nor a tiers entry of type remote), "
            "so no shared tier to inspect"
        )
    return shared.settings


def open_shared_tier(config_path: str, namespace: str | None = None, model: str | None = None) -> SharedTier:
    """List ``config_path``'s shared tier (namespaces whose directory name starts with
    ``namespace``) and read each namespace's fingerprint. ``model`` as for ``summary
    --model``. Raises ``InspectError`` naming the endpoint and bucket when they cannot be
    read."""
    config = remote_config(config_path)
    if config.backend != "s3":
        raise InspectError(
            f"--remote {config_path}: the shared tier is a Mooncake Store ({config.where()}), which cannot list "
            "its keys; inspect --remote reads S3 buckets only. `tiered-kv doctor` checks that its master answers"
        )
    reader = ServerConfig.load(config_path, model)
    try:
        client = S3Client(config)
        raw_keys = RawKeys(config, client.credentials)
    except RemoteSetupError as e:
        raise InspectError(str(e)) from None
    keyring = key_error = None
    try:
        keyring = load_keyring(config)
    except FleetKeyError as e:
        key_error = str(e)
    root = config.prefix + "/"
    by_name: dict[str, RemoteNamespace] = {}
    strays = []
    hostile = []
    foreign = 0
    try:
        for listed in raw_keys.list(root):
            if not listed.raw.startswith(root.encode()):
                continue  # not under the prefix: never touched
            if (why := hostile_reason(listed.raw)) is not None:
                first = listed.raw[len(root) :].split(b"/", 1)
                inside = first[0].decode("utf-8", "replace") if len(first) == 2 else ""
                hostile.append(
                    HostileKey(
                        listed.raw,
                        listed.size,
                        listed.last_modified,
                        why,
                        inside if _NAMESPACE_RE.match(inside) else None,
                    )
                )
                continue
            info = ObjectInfo(listed.raw.decode("utf-8"), listed.size, listed.last_modified)
            rel = info.key[len(root) :]
            if "/" not in rel:
                strays.append(RemoteObject(info.key, info.size, info.last_modified))
                continue
            parsed = parse_key(rel, info)
            if parsed is None:
                foreign += 1
                continue
            name, obj = parsed
            if namespace and not name.startswith(namespace):
                continue
            ns = by_name.setdefault(name, RemoteNamespace(name))
            if isinstance(obj, BlockObject):
                ns.blocks.append(obj)
            else:
                ns.manifest = obj
        for ns in by_name.values():
            _read_manifest(client, ns)
    except RemoteError as e:
        raise InspectError(f"cannot read {config.where()}: {type(e).__name__} ({e})") from None
    namespaces = sorted(by_name.values(), key=lambda n: n.namespace)
    return SharedTier(
        config_path, config, client, reader, namespaces, strays, foreign, keyring, key_error, hostile, raw_keys
    )


def parse_key(rel: str, info: ObjectInfo) -> tuple[str, RemoteObject] | None:
    """``(namespace directory, object)`` when ``rel`` (a key less ``<prefix>/``) is exactly
    a key this format writes: a namespace's fingerprint.json (``block_hash`` None) or a
    block object whose fan-out directory is its hash's; else None."""
    parts = rel.split("/")
    if not _NAMESPACE_RE.match(parts[0]):
        return None
    if len(parts) == 2 and parts[1] == MANIFEST_NAME:
        return parts[0], RemoteObject(info.key, info.size, info.last_modified)
    if len(parts) != 3 or not (m := _BLOCK_RE.match(parts[2])) or len(m.group(1)) % 2:
        return None
    block_hash = bytes.fromhex(m.group(1))
    if parts[1] != fan_out(block_hash) or int(m.group(2)) >= 1 << 16:
        return None
    return parts[0], BlockObject(info.key, info.size, info.last_modified, block_hash, int(m.group(2)))


def load_fingerprint(client: S3Client, key: str) -> Fingerprint:
    """The fingerprint the record at ``key`` holds (a GET of at most
    ``safe_json.MAX_RECORD_BYTES``); ``ValueError`` saying why for a missing, oversized
    or malformed record (anyone who can write the bucket can put one there)."""
    try:
        data = client.get(key, limit=MAX_RECORD_BYTES)
        return Fingerprint.from_dict(load_record(bytes(data or b""), MANIFEST_NAME)["fingerprint"])
    except (WrongSize, RecordError, TypeError, ValueError, KeyError) as e:
        raise ValueError(str(e)) from None


def _read_manifest(client: S3Client, ns: RemoteNamespace) -> None:
    if ns.manifest is None:
        ns.warnings.append(
            f"no {MANIFEST_NAME} (a lifecycle rule may have expired it; a node writes it again when it starts): "
            "the fingerprint is unknown, objects are checked against the namespace id"
        )
        return
    try:
        ns.fingerprint = load_fingerprint(client, ns.manifest.key)
    except ValueError as e:
        ns.problems.append(f"{MANIFEST_NAME} is not a fingerprint record ({e})")
        return
    if ns.fingerprint.namespace_id != ns.id:
        ns.problems.append(
            f"{MANIFEST_NAME} records the fingerprint of namespace {ns.fingerprint.namespace_id}, "
            f"not {ns.id}: written under another prefix or copied (objects are checked against the namespace id)"
        )


# ---------------------------------------------------------------- summary


def _reader_sealed(reader: ServerConfig) -> bool | None:
    """Whether a server with ``reader``'s config reads sealed namespaces (it names a key)
    or plain ones (``trusted_bucket`` and no key); None where it has no shared tier."""
    remote = reader.extra.get("remote")
    if not isinstance(remote, dict):
        return None
    return bool(remote.get("key_file") or remote.get("key_env"))


def read_differences(reader: ServerConfig, ns: RemoteNamespace) -> list[str] | None:
    """Why a server with ``reader``'s config would not read namespace ``ns`` (empty: it
    would): its fingerprint, and the trust mode (a node with a key reads only sealed
    namespaces, one without only plain ones). None where that cannot be told: the
    namespace has no fingerprint.json of its own id (expired by a lifecycle rule while
    its fleet runs, deleted, or one copied from another namespace), so a tool that
    deletes what no config reads must keep it."""
    fp = ns.checked_fingerprint
    if fp is None:
        return None
    out = reader.differences(fp.to_dict())
    sealed = _reader_sealed(reader)
    if sealed is not None and sealed != ns.sealed:
        out.append(
            "trust: the config has a fleet key and reads sealed namespaces; this one holds plain objects"
            if sealed
            else "trust: the config has no key (remote.trusted_bucket) and reads plain namespaces; "
            "this one holds sealed objects"
        )
    return out


def _reads(reader: ServerConfig, ns: RemoteNamespace) -> dict[str, Any]:
    d = read_differences(reader, ns)
    if d is None:
        return {"config": reader.path, "reads": None, "differences": [f"unknown: no {MANIFEST_NAME} of this namespace"]}
    return {"config": reader.path, "reads": not d, "differences": d}


def summarize_shared_tier(tier: SharedTier, others: Sequence[ServerConfig] = ()) -> dict[str, Any]:
    """Per namespace: trust mode, fingerprint, block objects and bytes, blocks with every
    rank, ages, problems, and ``read_by``: whether a server with the ``--remote`` config
    (first) and each of ``others`` reads it; then the other and the hostile keys."""
    out = []
    for ns in tier.namespaces:
        tp = ns.fingerprint.tp_size if ns.fingerprint else None
        ranks: dict[bytes, int] = {}
        for o in ns.blocks:
            ranks[o.block_hash] = ranks.get(o.block_hash, 0) + 1
        times = [o.last_modified for o in ns.blocks]
        out.append(
            {
                "namespace": ns.namespace,
                "id": ns.id,
                "trust": ns.trust,
                "fingerprint": None if ns.fingerprint is None else ns.fingerprint.to_dict(),
                "objects": len(ns.blocks),
                "bytes": sum(o.size for o in ns.blocks),
                "blocks": len(ranks),
                "complete_blocks": None if tp is None else sum(n >= tp for n in ranks.values()),
                "oldest": min(times, default=None),
                "newest": max(times, default=None),
                "read_by": [_reads(r, ns) for r in (tier.reader, *others)],
                "problems": list(ns.problems),
                "warnings": list(ns.warnings),
            }
        )
    return {
        **tier.header(),
        "objects": sum(n["objects"] for n in out),
        "bytes": sum(n["bytes"] for n in out),
        "namespaces": out,
        "stray_objects": [o.key for o in tier.strays],
        "foreign_keys": tier.foreign_keys,
        "hostile_keys": [h.to_dict() for h in tier.hostile],
    }


# ---------------------------------------------------------------- ls


def list_shared_tier(
    tier: SharedTier,
    *,
    hash_prefix: str | None = None,
    older_than: float | None = None,
    newer_than: float | None = None,
    sort: str = "last-access",
    ascending: bool | None = None,
    limit: int = 50,
    now: float | None = None,
) -> dict[str, Any]:
    """Block objects per namespace (hash, rank, size, last modified), filtered and sorted
    (descending unless ``ascending``; ``hash`` ascending unless ``ascending`` is False);
    and the hostile keys, which are listed, never read."""
    if sort not in REMOTE_SORTS:
        raise InspectError(f"--sort with --remote: expected one of {', '.join(REMOTE_SORTS)}, got {sort!r}")
    if hash_prefix is not None and not re.fullmatch(r"[0-9a-fA-F]*", hash_prefix):
        raise InspectError(f"--hash: expected hex digits, got {hash_prefix!r}")
    now = time.time() if now is None else now
    column = REMOTE_SORTS[sort]
    asc = ascending if ascending is not None else column == "hash"
    namespaces = []
    for ns in tier.namespaces:
        rows = [
            o
            for o in ns.blocks
            if (not hash_prefix or o.block_hash.hex().startswith(hash_prefix.lower()))
            and (older_than is None or o.last_modified < now - older_than)
            and (newer_than is None or o.last_modified >= now - newer_than)
        ]
        key = {
            "last_modified": lambda o: (o.last_modified, o.key),
            "hash": lambda o: (o.block_hash, o.rank),
            "size": lambda o: (o.size, o.key),
        }[column]
        rows.sort(key=key, reverse=not asc)
        namespaces.append(
            {
                "namespace": ns.namespace,
                "trust": ns.trust,
                "tp_size": ns.fingerprint.tp_size if ns.fingerprint else None,
                "total": len(ns.blocks),
                "matching": len(rows),
                "objects": [o.to_dict() for o in (rows if limit == 0 else rows[:limit])],
            }
        )
    return {**tier.header(), "namespaces": namespaces, "hostile_keys": [h.to_dict() for h in tier.hostile]}


# ---------------------------------------------------------------- clear / evict


@dataclass
class RemoteDeletion:
    """What ``clear_shared_tier`` or ``evict_shared_tier`` deleted (or would, dry run)."""

    dry_run: bool
    #: Per namespace directory: ``{"objects", "freed_bytes", "bytes_before", "bytes_after"}``.
    namespaces: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Hostile keys deleted (or that would be): ``HostileKey.to_dict``.
    hostile: list[dict[str, Any]] = field(default_factory=list)

    @property
    def objects(self) -> int:
        return sum(v["objects"] for v in self.namespaces.values())

    @property
    def freed_bytes(self) -> int:
        return sum(v["freed_bytes"] for v in self.namespaces.values())


def _delete(
    tier: SharedTier, doomed: dict[str, list[RemoteObject]], dry_run: bool, hostile: Sequence[HostileKey] = ()
) -> RemoteDeletion:
    out = RemoteDeletion(dry_run, hostile=[h.to_dict() for h in hostile])
    root = (tier.config.prefix + "/").encode()
    try:
        for ns in tier.namespaces:
            gone = doomed.get(ns.namespace, [])
            before = sum(o.size for o in ns.blocks) + (ns.manifest.size if ns.manifest else 0)
            freed = sum(o.size for o in gone)
            out.namespaces[ns.namespace] = {
                "objects": len(gone),
                "freed_bytes": freed,
                "bytes_before": before,
                "bytes_after": before - freed,
            }
            if not dry_run:
                for o in gone:
                    tier.client.delete(o.key)
        if not dry_run:
            for h in hostile:
                assert h.raw.startswith(root) and tier.raw_keys is not None  # listed under the prefix
                tier.raw_keys.delete(h.raw)
    except RemoteError as e:
        raise InspectError(f"cannot delete in {tier.config.where()}: {type(e).__name__} ({e})") from None
    return out


def clear_shared_tier(tier: SharedTier, *, dry_run: bool = False, whole_prefix: bool = True) -> RemoteDeletion:
    """Delete every object of the listed namespaces (blocks and fingerprint.json): only
    keys of this format under the prefix, never a nested prefix's; and the hostile keys
    (``whole_prefix``: every one under the prefix; else those inside the namespaces
    cleared), by their bytes."""
    names = {ns.namespace for ns in tier.namespaces}
    hostile = [h for h in tier.hostile if whole_prefix or h.namespace in names]
    return _delete(
        tier,
        {ns.namespace: [*ns.blocks, *([ns.manifest] if ns.manifest else [])] for ns in tier.namespaces},
        dry_run,
        hostile,
    )


def evict_shared_tier(
    tier: SharedTier,
    *,
    to_size: int | None = None,
    older_than: float | None = None,
    now: float | None = None,
    dry_run: bool = False,
) -> RemoteDeletion:
    """Delete block objects stored more than ``older_than`` seconds ago, then the oldest
    others until the listed namespaces hold at most ``to_size`` bytes of blocks (an
    object is written once, so stored time is its age; nodes store evicted blocks again
    when they next compute them)."""
    if to_size is None and older_than is None:
        raise InspectError("evict needs --to-size SIZE or --older-than AGE")
    now = time.time() if now is None else now
    blocks = sorted((o.last_modified, o.key, ns.namespace, o) for ns in tier.namespaces for o in ns.blocks)
    doomed: dict[str, list[RemoteObject]] = {}
    total = sum(o.size for *_, o in blocks)
    for stored, _, ns_id, o in blocks:
        if (older_than is not None and stored < now - older_than) or (to_size is not None and total > to_size):
            doomed.setdefault(ns_id, []).append(o)
            total -= o.size
    return _delete(tier, doomed, dry_run)
