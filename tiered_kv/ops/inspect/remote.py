"""The shared tier from the operator's side: summary, listing and verification of the
objects under a config's ``remote`` prefix (``tiered-kv inspect ... --remote CONFIG``).

Operator's process. I/O: S3 requests to the config's bucket, never a write or a delete:
one paged LIST of ``<prefix>/`` (an operator tool may list; the serving path never
does), a GET of each namespace's ``fingerprint.json``, and for ``verify`` a GET of each
block object checked (all of them, or a random sample per namespace) on a bounded
thread pool, one object body per thread in memory. Credentials come from the AWS chain,
as for the tier itself.

``verify`` checks an object as a node does before serving it
(``object_format.verified_payload``), against what its key and namespace say: the
namespace's fingerprint (from its ``fingerprint.json``), the block hash and rank in the
key; the payload's checksum. Problems are the reader's reasons (``format``, ``foreign``,
``mismatch``, ``checksum``) plus ``key``: an object under a namespace whose key is not a
block key of this format (never read by a node, but it occupies the bucket). A
namespace id is the first hex digits of the fingerprint digest in every header, so an
object written by another namespace shows as ``foreign`` even where the namespace's
``fingerprint.json`` is gone (a lifecycle rule may expire it: a warning, not a fault).
"""

from __future__ import annotations

import json
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
from tiered_kv.remote.client import ObjectInfo, RemoteError, RemoteSetupError, S3Client
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.remote.object_format import (
    MANIFEST_NAME,
    BlockHeader,
    Rejected,
    fan_out,
    fingerprint_digest,
    verified_payload,
)

_BLOCK_RE = re.compile(r"^([0-9a-f]{2})/([0-9a-f]+)-r([0-9]+)$")
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
    """The objects of one namespace id under the prefix."""

    namespace: str
    blocks: list[BlockObject] = field(default_factory=list)
    others: list[RemoteObject] = field(default_factory=list)
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
    reader = ServerConfig.load(config_path, model)
    try:
        client = S3Client(config)
    except RemoteSetupError as e:
        raise InspectError(str(e)) from None
    root = config.prefix + "/"
    by_id: dict[str, RemoteNamespace] = {}
    strays = []
    try:
        for info in client.list_info(root):
            ns_id, _, rest = info.key[len(root) :].partition("/")
            if not rest:
                strays.append(RemoteObject(info.key, info.size, info.last_modified))
                continue
            if namespace and not ns_id.startswith(namespace):
                continue
            ns = by_id.setdefault(ns_id, RemoteNamespace(ns_id))
            _add(ns, rest, info)
        for ns in by_id.values():
            _read_manifest(client, ns)
    except RemoteError as e:
        raise InspectError(f"cannot read {config.where()}: {type(e).__name__} ({e})") from None
    return SharedTier(config_path, config, client, reader, sorted(by_id.values(), key=lambda n: n.namespace), strays)


def _add(ns: RemoteNamespace, rest: str, info: ObjectInfo) -> None:
    if rest == MANIFEST_NAME:
        ns.manifest = RemoteObject(info.key, info.size, info.last_modified)
        return
    m = _BLOCK_RE.match(rest)
    if m and len(m.group(2)) % 2 == 0:
        ns.blocks.append(
            BlockObject(info.key, info.size, info.last_modified, bytes.fromhex(m.group(2)), int(m.group(3)))
        )
    else:
        ns.others.append(RemoteObject(info.key, info.size, info.last_modified))


def _read_manifest(client: S3Client, ns: RemoteNamespace) -> None:
    if ns.manifest is None:
        ns.warnings.append(
            f"no {MANIFEST_NAME} (a lifecycle rule may have expired it; a node writes it again when it starts): "
            "the fingerprint is unknown, objects are checked against the namespace id"
        )
        return
    data = client.get(ns.manifest.key)
    if data is None:
        ns.problems.append(f"{MANIFEST_NAME} went away while it was being read")
        return
    try:
        ns.fingerprint = Fingerprint.from_dict(json.loads(bytes(data))["fingerprint"])
    except (TypeError, ValueError, KeyError) as e:
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
                "other_objects": len(ns.others),
                "other_bytes": sum(o.size for o in ns.others),
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
    if threads < 1:
        raise InspectError(f"--threads: expected a positive count, got {threads}")
    rng = rng or random.Random()
    results = []
    with ThreadPoolExecutor(threads, thread_name_prefix="tkv-inspect-remote") as pool:
        for ns in tier.namespaces:
            result = RemoteVerifyResult(
                ns.namespace, len(ns.blocks), problems=list(ns.problems), warnings=list(ns.warnings)
            )
            for o in ns.others:
                result.bad.append(_bad(o, "key", "not a block key (<fan-out>/<block hash hex>-r<rank>)"))
            sample = ns.blocks if not limit or limit >= len(ns.blocks) else rng.sample(ns.blocks, limit)
            started = time.perf_counter()
            try:
                for o, verdict in zip(sample, pool.map(lambda o, ns=ns: _check(tier.client, ns, o), sample)):
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


def _check(client: S3Client, ns: RemoteNamespace, o: BlockObject) -> Any:
    """True when a node of ``ns`` would serve ``o``; None when it is gone; else
    ``(reason, detail)``. A namespace id is the start of the fingerprint digest every
    header holds, so which namespace wrote an object shows even without a manifest."""
    data = client.get(o.key)
    if data is None:
        return None
    view = memoryview(data)
    fan = o.key.rsplit("/", 2)[-2]
    if fan != fan_out(o.block_hash):
        return ("key", f"fan-out directory {fan}, the hash gives {fan_out(o.block_hash)}")
    if ns.fingerprint is not None and o.rank >= ns.fingerprint.tp_size:
        return ("key", f"rank {o.rank} in a namespace of TP {ns.fingerprint.tp_size}")
    try:
        header = BlockHeader.unpack(view)
        writer = header.fingerprint.hex()[: len(ns.namespace)]
        if writer != ns.namespace:
            return ("foreign", f"written by namespace {writer}")
        digest = header.fingerprint if ns.fingerprint is None else fingerprint_digest(ns.fingerprint)
        verified_payload(view, fingerprint=digest, block_hash=o.block_hash, rank=o.rank, size=header.payload_len)
    except Rejected as r:
        return (r.reason, r.detail)
    return True
