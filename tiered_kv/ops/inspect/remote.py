"""The shared tier from the operator's side: summary, listing and verification of the
objects under a config's ``remote`` prefix (``tiered-kv inspect ... --remote CONFIG``).

Operator's process. I/O: S3 requests to the config's bucket: one paged LIST of
``<prefix>/`` (an operator tool may list; the serving path never does), a GET of each
namespace's ``fingerprint.json`` (at most ``safe_json.MAX_RECORD_BYTES``, parsed with a
depth bound), and for ``verify`` a streamed GET of each block object checked (all of
them, or a random sample per namespace) on a bounded thread pool, one chunk per thread
in memory whatever the object's size. ``clear`` and ``evict`` (and the CLI's ``verify
--repair``) delete. Credentials come from the AWS chain, and the fleet key from the
config's ``key_file`` / ``key_env``, as for the tier itself.

Namespaces cannot overlap: an operation touches only keys that parse exactly as this
format's keys under the config's prefix (``<prefix>/<16 hex>/fingerprint.json`` and
``<prefix>/<16 hex>/<fan-out of the hash>/<hash hex>-r<rank>``). Every other key under
the prefix, such as the objects of a prefix nested in it (``team`` and ``team/kv``), is
counted as ``foreign_keys`` and never read, reported as bad or deleted.

``verify`` checks an object as a node does before serving it
(``object_format.verified_payload``), against what its key and namespace say: the
namespace's fingerprint (from its ``fingerprint.json``), the block hash and rank in the
key; the payload's checksum. Problems are the reader's reasons (``format``, ``foreign``,
``mismatch``, ``checksum``, ``auth``, ``key``). A namespace id is the first hex digits of the fingerprint digest in every header, so an
object written by another namespace shows as ``foreign`` even where the namespace's
``fingerprint.json`` is gone (a lifecycle rule may expire it: a warning, not a fault).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.ops.inspect.cache import InspectError
from tiered_kv.ops.inspect.summary import ServerConfig
from tiered_kv.model_identity import read_config_file
from tiered_kv.remote.client import ObjectInfo, RemoteError, RemoteSetupError, S3Client, WrongSize
from tiered_kv.remote.config import MAX_KEY_HASH_BYTES, NAMESPACE_ID_CHARS, RemoteConfig
from tiered_kv.remote.keys import FleetKeyError, Keyring, load_keyring
from tiered_kv.remote.object_format import (
    MANIFEST_NAME,
    Rejected,
    fan_out,
    fingerprint_digest,
    verify_stream,
)
from tiered_kv.remote.safe_json import MAX_RECORD_BYTES, RecordError, load_record

_NAMESPACE_RE = re.compile(rf"^[0-9a-f]{{{NAMESPACE_ID_CHARS}}}$")
_BLOCK_RE = re.compile(rf"^([0-9a-f]{{2,{2 * MAX_KEY_HASH_BYTES}}})-r(0|[1-9][0-9]{{0,4}})$")
#: ``ls`` sort keys with ``--remote`` (the disk's ``last-access`` and ``stored`` both mean
#: the object's last-modified time: an object is written once and never touched).
REMOTE_SORTS = {"last-access": "last_modified", "stored": "last_modified", "hash": "hash", "size": "size"}


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
    """The objects of one namespace id under the prefix (only keys of this format)."""

    namespace: str
    blocks: list[BlockObject] = field(default_factory=list)
    manifest: RemoteObject | None = None
    fingerprint: Fingerprint | None = None
    #: What makes the namespace itself suspect (a fingerprint.json that does not match).
    problems: list[str] = field(default_factory=list)
    #: What is worth knowing and harmless (no fingerprint.json: expired by a lifecycle
    #: rule, or deleted; a node writes it again when it starts).
    warnings: list[str] = field(default_factory=list)


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
        remote = TieredConfig.from_dict(extra, passthrough_keys=VLLM_PASSTHROUGH_KEYS).remote
    except ConfigError as e:
        raise InspectError(f"--remote {config_path}: {e}") from None
    if remote is None:
        raise InspectError(f"--remote {config_path}: the config has no 'remote' key, so no shared tier to inspect")
    return remote


def open_shared_tier(config_path: str, namespace: str | None = None, model: str | None = None) -> SharedTier:
    """List ``config_path``'s shared tier (namespaces whose id starts with ``namespace``)
    and read each namespace's fingerprint. ``model`` as for ``summary --model``. Raises
    ``InspectError`` naming the endpoint and bucket when they cannot be read."""
    config = remote_config(config_path)
    if config.backend != "s3":
        raise InspectError(
            f"--remote {config_path}: the shared tier is a Mooncake Store ({config.where()}), which cannot list "
            "its keys; inspect --remote reads S3 buckets only. `tiered-kv doctor` checks that its master answers"
        )
    reader = ServerConfig.load(config_path, model)
    try:
        client = S3Client(config)
    except RemoteSetupError as e:
        raise InspectError(str(e)) from None
    keyring = key_error = None
    try:
        keyring = load_keyring(config)
    except FleetKeyError as e:
        key_error = str(e)
    root = config.prefix + "/"
    by_id: dict[str, RemoteNamespace] = {}
    strays = []
    foreign = 0
    try:
        for info in client.list_info(root):
            rel = info.key[len(root) :]
            if "/" not in rel:
                strays.append(RemoteObject(info.key, info.size, info.last_modified))
                continue
            parsed = parse_key(rel, info)
            if parsed is None:
                foreign += 1
                continue
            ns_id, obj = parsed
            if namespace and not ns_id.startswith(namespace):
                continue
            ns = by_id.setdefault(ns_id, RemoteNamespace(ns_id))
            if isinstance(obj, BlockObject):
                ns.blocks.append(obj)
            else:
                ns.manifest = obj
        for ns in by_id.values():
            _read_manifest(client, ns)
    except RemoteError as e:
        raise InspectError(f"cannot read {config.where()}: {type(e).__name__} ({e})") from None
    namespaces = sorted(by_id.values(), key=lambda n: n.namespace)
    return SharedTier(config_path, config, client, reader, namespaces, strays, foreign, keyring, key_error)


def parse_key(rel: str, info: ObjectInfo) -> tuple[str, RemoteObject] | None:
    """``(namespace id, object)`` when ``rel`` (a key less ``<prefix>/``) is exactly a key
    this format writes: a namespace's fingerprint.json (``block_hash`` None) or a block
    object whose fan-out directory is its hash's; else None."""
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


def _read_manifest(client: S3Client, ns: RemoteNamespace) -> None:
    if ns.manifest is None:
        ns.warnings.append(
            f"no {MANIFEST_NAME} (a lifecycle rule may have expired it; a node writes it again when it starts): "
            "the fingerprint is unknown, objects are checked against the namespace id"
        )
        return
    try:
        data = client.get(ns.manifest.key, limit=MAX_RECORD_BYTES)
        record = load_record(bytes(data or b""), MANIFEST_NAME)
        ns.fingerprint = Fingerprint.from_dict(record["fingerprint"])
    except (WrongSize, RecordError, TypeError, ValueError, KeyError) as e:
        ns.problems.append(f"{MANIFEST_NAME} is not a fingerprint record ({e})")
        return
    if ns.fingerprint.namespace_id != ns.namespace:
        ns.problems.append(
            f"{MANIFEST_NAME} records the fingerprint of namespace {ns.fingerprint.namespace_id}, "
            f"not {ns.namespace}: written under another prefix or copied"
        )


# ---------------------------------------------------------------- summary


def _reads(reader: ServerConfig, ns: RemoteNamespace) -> dict[str, Any]:
    if ns.fingerprint is None:
        return {"config": reader.path, "reads": False, "differences": ["no fingerprint recorded"]}
    d = reader.differences(ns.fingerprint.to_dict())
    return {"config": reader.path, "reads": not d, "differences": d}


def summarize_shared_tier(tier: SharedTier, others: Sequence[ServerConfig] = ()) -> dict[str, Any]:
    """Per namespace: fingerprint, block objects and bytes, blocks with every rank, ages,
    other keys, problems, and ``read_by``: whether a server with the ``--remote`` config
    (first) and each of ``others`` reads it."""
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
    (descending unless ``ascending``; ``hash`` ascending unless ``ascending`` is False)."""
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
                "tp_size": ns.fingerprint.tp_size if ns.fingerprint else None,
                "total": len(ns.blocks),
                "matching": len(rows),
                "objects": [o.to_dict() for o in (rows if limit == 0 else rows[:limit])],
            }
        )
    return {**tier.header(), "namespaces": namespaces}


# ---------------------------------------------------------------- verify


@dataclass
class RemoteVerifyResult:
    """What ``verify_shared_tier`` found in one namespace."""

    namespace: str
    objects: int
    checked: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    #: ``{"key", "hash", "rank", "reason", "detail"}`` per object that a node would not serve.
    bad: list[dict[str, Any]] = field(default_factory=list)
    #: Objects that vanished between the listing and the read (a lifecycle rule, or a
    #: node deleting a damaged object): not a fault.
    vanished: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.bad and not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "objects": self.objects,
            "checked": self.checked,
            "bytes_read": self.bytes_read,
            "seconds": self.seconds,
            "bad_objects": len(self.bad),
            "bad": self.bad,
            "vanished": self.vanished,
            "problems": self.problems,
            "warnings": self.warnings,
            "clean": self.clean,
        }


def verify_shared_tier(
    tier: SharedTier,
    *,
    limit: int = 0,
    threads: int = 4,
    progress: Callable[[int], None] | None = None,
    rng: random.Random | None = None,
) -> list[RemoteVerifyResult]:
    """Download and check the block objects of each namespace (``limit`` > 0: a random
    sample of that many per namespace). Keys that are not block keys are reported
    without being read. A failed request raises ``InspectError``."""
    if limit < 0:
        raise InspectError(f"--limit: expected 0 (all) or a positive count, got {limit}")
    if tier.key_error is not None:
        raise InspectError(tier.key_error)
    if threads < 1:
        raise InspectError(f"--threads: expected a positive count, got {threads}")
    rng = rng or random.Random()
    results = []
    with ThreadPoolExecutor(threads, thread_name_prefix="tkv-inspect-remote") as pool:
        for ns in tier.namespaces:
            result = RemoteVerifyResult(
                ns.namespace, len(ns.blocks), problems=list(ns.problems), warnings=list(ns.warnings)
            )
            sample = ns.blocks if not limit or limit >= len(ns.blocks) else rng.sample(ns.blocks, limit)
            started = time.perf_counter()
            try:
                checks = pool.map(lambda o, ns=ns: _check(tier, ns, o), sample)
                for o, verdict in zip(sample, checks):
                    if verdict is None:
                        result.vanished += 1
                        continue
                    result.checked += 1
                    result.bytes_read += o.size
                    if verdict is not True:
                        result.bad.append(_bad(o, *verdict))
                    if progress is not None:
                        progress(o.size)
            except RemoteError as e:
                raise InspectError(f"cannot read {tier.config.where()}: {type(e).__name__} ({e})") from None
            result.seconds = time.perf_counter() - started
            results.append(result)
    return results


def _bad(o: RemoteObject, reason: str, detail: str) -> dict[str, Any]:
    return {
        "key": o.key,
        "hash": None if o.block_hash is None else o.block_hash.hex(),
        "rank": o.rank,
        "reason": reason,
        "detail": detail,
    }


def _check(tier: SharedTier, ns: RemoteNamespace, o: BlockObject) -> Any:
    """True when a node of ``ns`` would serve ``o``; None when it is gone; else
    ``(reason, detail)``. A namespace id is the start of the fingerprint digest every
    header holds, so which namespace wrote an object shows even without a manifest.
    The object is streamed: memory stays one chunk whatever its size."""
    if ns.fingerprint is not None and o.rank >= ns.fingerprint.tp_size:
        return ("mismatch", f"rank {o.rank} in a namespace of TP {ns.fingerprint.tp_size}")
    got = tier.client.stream(o.key)
    if got is None:
        return None
    total, chunks = got
    digest = None if ns.fingerprint is None else fingerprint_digest(ns.fingerprint)
    try:
        header = verify_stream(
            total, chunks, fingerprint=digest, block_hash=o.block_hash, rank=o.rank, keyring=tier.keyring
        )
    except Rejected as r:
        return (r.reason, r.detail)
    writer = header.fingerprint.hex()[: len(ns.namespace)]
    if writer != ns.namespace:
        return ("foreign", f"written by namespace {writer}")
    return True


# ---------------------------------------------------------------- clear / evict


@dataclass
class RemoteDeletion:
    """What ``clear_shared_tier`` or ``evict_shared_tier`` deleted (or would, dry run)."""

    dry_run: bool
    #: Per namespace id: ``{"objects", "freed_bytes", "bytes_before", "bytes_after"}``.
    namespaces: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def objects(self) -> int:
        return sum(v["objects"] for v in self.namespaces.values())

    @property
    def freed_bytes(self) -> int:
        return sum(v["freed_bytes"] for v in self.namespaces.values())


def _delete(tier: SharedTier, doomed: dict[str, list[RemoteObject]], dry_run: bool) -> RemoteDeletion:
    out = RemoteDeletion(dry_run)
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
        if dry_run:
            continue
        try:
            for o in gone:
                tier.client.delete(o.key)
        except RemoteError as e:
            raise InspectError(f"cannot delete in {tier.config.where()}: {type(e).__name__} ({e})") from None
    return out


def clear_shared_tier(tier: SharedTier, *, dry_run: bool = False) -> RemoteDeletion:
    """Delete every object of the listed namespaces (blocks and fingerprint.json): only
    keys of this format under the prefix, never a nested prefix's."""
    return _delete(
        tier, {ns.namespace: [*ns.blocks, *([ns.manifest] if ns.manifest else [])] for ns in tier.namespaces}, dry_run
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
