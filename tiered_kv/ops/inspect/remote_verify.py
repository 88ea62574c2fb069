"""Verification and repair of a shared tier's block objects (``tiered-kv inspect verify
--remote CONFIG``, with ``--repair`` or ``--dry-run``), on a tier listed by
``tiered_kv.ops.inspect.remote.open_shared_tier``.

Operator's process. I/O: a streamed GET of each block object checked (all of them, or a
random sample per namespace) on a bounded thread pool, one chunk per thread in memory
whatever the object's size; ``repair_shared_tier`` (the CLI's ``verify --repair``)
deletes the objects proven bad, and only those. The fleet key is the one
``open_shared_tier`` loaded from the config's ``key_file`` / ``key_env``.

``verify`` checks an object as a node does before serving it
(``object_format.verify_stream``), against what its key and namespace say: the
namespace's fingerprint (from its ``fingerprint.json``, where that matches the namespace
id), the block hash and rank in the key; the AES-GCM tag under the config's keyring in a
sealed namespace, the payload's checksum in a plain one. Each finding carries
``provable`` (``object_format.Rejected``): only an object the reader proved to be no
honest object of its key is deletable (``repair_shared_tier``). One it cannot judge (sealed
under a key id the config does not hold, sealed where the config has no key, a newer
format version, a checksum this node cannot compute) is kept, whatever else is wrong
with it, and said why; a config without a key (``trusted_bucket``) repairs no sealed
namespace at all. A namespace id is the first hex digits of the fingerprint digest in
every header, so an object written by another namespace shows as ``foreign`` even where
the namespace's ``fingerprint.json`` is gone (a lifecycle rule may expire it: a warning,
not a fault).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.ops.inspect.cache import InspectError
from tiered_kv.ops.inspect.remote import TRUST_PLAIN, TRUST_SEALED, BlockObject, RemoteNamespace, SharedTier
from tiered_kv.remote.store.client import RemoteError
from tiered_kv.remote.format.object_format import (
    FORMAT_SEALED,
    MAX_HASH_BYTES,
    SEALED_HEADER_BYTES,
    BlockHeader,
    Rejected,
    SealedHeader,
    fingerprint_digest,
    format_version,
    verify_stream,
)

#: ``action`` of a finding: deleted by ``repair_shared_tier``; deleted by it if run (a
#: dry run, or no ``--repair``); kept (not provable, or in a namespace it may not repair).
DELETED, WOULD_DELETE, KEPT = "deleted", "would delete", "kept"
#: A bad object's action where it was replaced between its verification and the repair.
CHANGED = "kept: changed since verified"


@dataclass
class RemoteVerifyResult:
    """What ``verify_shared_tier`` found in one namespace."""

    namespace: str
    sealed: bool
    objects: int
    checked: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    #: Objects proven bad (``Rejected.provable``, or the inspector's own checks of an
    #: object it opened): ``{"key", "hash", "rank", "reason", "detail", "provable",
    #: "key_id", "action"}``.
    bad: list[dict[str, Any]] = field(default_factory=list)
    #: Objects a node would not serve and this config cannot judge (an honest member
    #: may have written them): never deleted. As ``bad``, with ``why``.
    kept: list[dict[str, Any]] = field(default_factory=list)
    #: Objects that vanished between the listing and the read (a lifecycle rule, or a
    #: node deleting a damaged object): not a fault.
    vanished: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: Why ``repair_shared_tier`` deletes nothing here (a sealed namespace and a config
    #: without a key), or None.
    unrepairable: str | None = None
    #: The ETag of each bad object as judged: one replaced since (a node's honest write
    #: over a forgery) is not the object proven bad.
    tags: dict[str, str | None] = field(default_factory=dict, repr=False)

    @property
    def clean(self) -> bool:
        """Nothing found: no bad object, none kept unjudged, no problem."""
        return not self.bad and not self.kept and not self.problems

    def kept_why(self) -> list[dict[str, Any]]:
        """The kept objects grouped by why: ``{"reason", "key_id", "why", "objects"}``."""
        groups: dict[tuple, dict[str, Any]] = {}
        for k in self.kept:
            g = groups.setdefault(
                (k["reason"], k["key_id"], k["why"]),
                {"reason": k["reason"], "key_id": k["key_id"], "why": k["why"], "objects": 0},
            )
            g["objects"] += 1
        return list(groups.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "trust": TRUST_SEALED if self.sealed else TRUST_PLAIN,
            "objects": self.objects,
            "checked": self.checked,
            "bytes_read": self.bytes_read,
            "seconds": self.seconds,
            "bad_objects": len(self.bad),
            "bad": self.bad,
            "kept_objects": len(self.kept),
            "kept": self.kept,
            "kept_why": self.kept_why(),
            "unrepairable": self.unrepairable,
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
    without being read. Each bad finding's ``action`` says what ``repair_shared_tier``
    would do. A failed request raises ``InspectError``."""
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
                ns.namespace, ns.sealed, len(ns.blocks), problems=list(ns.problems), warnings=list(ns.warnings)
            )
            if ns.sealed and tier.keyring is None:
                result.unrepairable = (
                    f"namespace {ns.namespace} holds sealed objects and {tier.config_path} has no key "
                    "(remote.trusted_bucket): name the fleet key in remote.key_file or remote.key_env to judge them"
                )
            sample = ns.blocks if not limit or limit >= len(ns.blocks) else rng.sample(ns.blocks, limit)
            started = time.perf_counter()
            try:
                checks = pool.map(lambda o, ns=ns: _check(tier, ns, o), sample)
                for o, (verdict, tag) in zip(sample, checks):
                    if verdict is None:
                        result.vanished += 1
                        continue
                    result.checked += 1
                    result.bytes_read += o.size
                    if verdict is not True:
                        if verdict["provable"]:
                            verdict["action"] = KEPT if result.unrepairable else WOULD_DELETE
                            result.bad.append(verdict)
                            result.tags[o.key] = tag
                        else:
                            verdict["action"] = KEPT
                            result.kept.append(verdict)
                    if progress is not None:
                        progress(o.size)
            except RemoteError as e:
                raise InspectError(f"cannot read {tier.config.where()}: {type(e).__name__} ({e})") from None
            result.seconds = time.perf_counter() - started
            results.append(result)
    return results


class _Head:
    """The chunks of an object as they come, remembering its first bytes (enough for a
    sealed header with the longest hash: which key id it names)."""

    def __init__(self, total: int, chunks: Iterator[memoryview]):
        self._chunks = chunks
        self.total = total
        self.first = bytearray()

    def __iter__(self) -> _Head:
        return self

    def __next__(self) -> memoryview:
        piece = next(self._chunks)
        room = SEALED_HEADER_BYTES + MAX_HASH_BYTES - len(self.first)
        if room > 0:
            self.first += piece[:room]
        return piece

    def key_id(self) -> int | None:
        try:
            if format_version(memoryview(self.first)) != FORMAT_SEALED:
                return None
            return SealedHeader.unpack(memoryview(self.first), self.total).key_id
        except Rejected:
            return None


def _finding(o: BlockObject, reason: str, detail: str, provable: bool, key_id: int | None = None) -> dict[str, Any]:
    return {
        "key": o.key,
        "hash": o.block_hash.hex(),
        "rank": o.rank,
        "reason": reason,
        "detail": detail,
        "provable": provable,
        "key_id": None if key_id is None else f"{key_id:08x}",
    }


def _why_kept(tier: SharedTier, ns: RemoteNamespace, r: Rejected, key_id: int | None) -> str:
    """Why an object is not this config's to judge, the same words for every object of
    one cause (the summary groups by them). Key ids only: never key material."""
    if r.reason == "key":
        sealed = "sealed" if key_id is None else f"sealed under key id {key_id:08x}"
        if not ns.sealed:
            return f"{sealed}, in a namespace of plain objects (read without a key)"
        if tier.keyring is None:
            return f"{sealed}; this config holds no key (remote.trusted_bucket)"
        return f"{sealed} (this config holds {', '.join(f'{k:08x}' for k in tier.keyring.key_ids)})"
    if r.reason == "version":
        return f"a newer format ({r.detail})"
    return r.detail


def _check(tier: SharedTier, ns: RemoteNamespace, o: BlockObject) -> tuple[Any, str | None]:
    """``_judge`` of ``o`` and the ETag of the version judged."""
    got = tier.client.stream(o.key)
    if got is None:
        return None, None
    total, chunks, tag = got
    return _judge(tier, ns, o, total, chunks), tag or ""  # as ``S3Client.etag`` names a version without one


def _judge(tier: SharedTier, ns: RemoteNamespace, o: BlockObject, total: int, chunks: Iterator[memoryview]) -> Any:
    """True when a node of ``ns`` would serve ``o`` (its ``total`` bytes in ``chunks``),
    else a finding (``_finding``). An object is judged only where it opens: a sealed one under
    a key id the config holds, a plain one with a checksum this node computes. Then the
    inspector's own checks are as provable as the object's: the namespace that wrote it
    (a namespace id is the start of the fingerprint digest every header holds, so it
    shows even without a manifest) and a rank beyond the namespace's TP (the digest
    covers the TP size, so no honest node of it writes that rank). The object is
    streamed: memory stays one chunk whatever its size."""
    head = _Head(total, chunks)
    fp = ns.checked_fingerprint
    digest = None if fp is None else fingerprint_digest(fp)
    keyring = tier.keyring if ns.sealed else None
    tp = None if fp is None else fp.tp_size
    beyond = tp is not None and o.rank >= tp
    try:
        header = verify_stream(total, head, fingerprint=digest, block_hash=o.block_hash, rank=o.rank, keyring=keyring)
    except Rejected as r:
        if r.provable:
            return _finding(o, r.reason, r.detail, True, head.key_id())
        kid = head.key_id()
        found = _finding(o, r.reason, r.detail, False, kid)
        found["why"] = _why_kept(tier, ns, r, kid)
        if beyond:
            found["detail"] += f" (its key names rank {o.rank}, beyond the namespace's TP {tp})"
        return found
    if ns.sealed and isinstance(header, BlockHeader):  # read without a key, where objects are sealed
        return _finding(o, "auth", "a plain object in a namespace of sealed objects", True)
    writer = header.fingerprint.hex()[: len(ns.id)]
    if writer != ns.id:
        return _finding(o, "foreign", f"written by namespace {writer}", True, head.key_id())
    if beyond:
        return _finding(o, "mismatch", f"rank {o.rank} in a namespace of TP {tp}", True, head.key_id())
    return True


def repair_shared_tier(tier: SharedTier, results: Sequence[RemoteVerifyResult], *, dry_run: bool = False) -> int:
    """Delete each object ``verify_shared_tier`` proved bad (``action`` "would delete"),
    and only those: no node would serve one, and while it is there no node can store
    the right block under its key (writes are write-once). Kept objects stay, and a
    namespace ``unrepairable`` is left whole. ``dry_run``: delete nothing. Returns how
    many were (or would be) deleted; sets each one's ``action``."""
    deleted = 0
    try:
        for r in results:
            for b in r.bad:
                if b["action"] != WOULD_DELETE:
                    continue
                if not dry_run:
                    # Only the version judged: a node may have replaced it since (a
                    # forgery its write found), hours later on a large bucket.
                    if tier.client.etag(b["key"]) != r.tags.get(b["key"]):
                        b["action"] = CHANGED
                        continue
                    tier.client.delete(b["key"])
                    b["action"] = DELETED
                deleted += 1
    except RemoteError as e:
        raise InspectError(f"cannot delete in {tier.config.where()}: {type(e).__name__} ({e})") from None
    return deleted
