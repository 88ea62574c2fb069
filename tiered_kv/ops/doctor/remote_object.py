"""The doctor's object check of an S3 shared tier (``check_block_object``): the newest
block objects of the namespace this config's server reads, opened with the fleet key.

One LIST request (the first page, ``LIST_PAGE_KEYS`` keys, under ``<prefix>/``), a GET of
the ``fingerprint.json`` of at most ``MAX_NAMESPACES`` of the namespaces listed (each at
most ``MAX_RECORD_BYTES``) to find one this config's server reads, then a streamed GET of
each of that namespace's ``SAMPLE_OBJECTS`` newest block objects listed, one
``CHUNK_BYTES`` chunk in memory at a time. Each header says which key id sealed the
object; of the newest one sealed under a key id the config holds, and of at most
``MAX_OBJECT_BYTES``, the tag is verified to the end; of the others only the first chunk
is read. At most ``MAX_OBJECT_BYTES`` plus ``SAMPLE_OBJECTS`` chunks come down.

The objects sampled are counted by key id. The check fails only where none of them opens
with the config's keys and some are sealed under a key id it does not hold, naming those
key ids with their counts (never a key): the server would start, and every block of the
fleet would be a miss. Where some open and others are sealed under a key id the config
does not hold, it warns, counting them: one object is all a member with the wrong key, or
anyone who can write the bucket, needs to be the newest, and a node holding the fleet's key
is not told to take another one a minority of the objects use.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiered_kv.config_values import redact
from tiered_kv.ops.doctor.report import FAIL, OK, WARN
from tiered_kv.remote.config import RemoteConfig

if TYPE_CHECKING:  # the S3 client, the keys and the object format are imported where a check needs them
    from tiered_kv.fingerprint import Fingerprint
    from tiered_kv.ops.inspect.remote import BlockObject
    from tiered_kv.remote.format.keys import Keyring
    from tiered_kv.remote.store.client import RemoteError, S3Client


#: Keys the object check lists: S3's first page under the prefix, one LIST request.
LIST_PAGE_KEYS = 1000
#: Namespaces of that page whose ``fingerprint.json`` is read to find one this config's
#: server reads (one bounded GET each).
MAX_NAMESPACES = 16
#: Newest block objects of that namespace whose header (the key id that sealed each) is
#: read: one object under a wrong key among them does not decide the check.
SAMPLE_OBJECTS = 8
#: Largest block object downloaded to the end to verify its tag (a block object is a few
#: MiB); of a larger one only the header, which names the key id, is read.
MAX_OBJECT_BYTES = 64 * 1024**2
#: Bytes per streamed chunk of an object: one chunk in memory at a time.
CHUNK_BYTES = 1 << 20


def key_source(remote: RemoteConfig) -> str:
    """Where the config's fleet key comes from, for messages (never the key)."""
    if remote.key_file is not None:
        return f"remote.key_file {redact(remote.key_file)}"
    if remote.key_env is not None:
        return f"remote.key_env {redact(remote.key_env)}"
    return "no key (remote.trusted_bucket)"


def held_key_ids(keyring: Keyring) -> str:
    """The key ids ``keyring`` holds, the current one (which seals every write) first."""
    others = [f"{k:08x}" for k in keyring.key_ids if k != keyring.current_id]
    return ", ".join([f"{keyring.current_id:08x} (current)", *others])


@dataclass(frozen=True)
class ObjectCheck:
    """What ``check_block_object`` found: a status, a message (without the ``shared
    tier:`` lead), the fix unless ok, and its facts."""

    status: str
    message: str
    fix: str = ""
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Sample:
    """What the headers of the newest block objects of ``namespace`` said, newest first."""

    namespace: str
    #: Sealed under a key id the config holds: (object, key id).
    opened: list[tuple[BlockObject, int]] = field(default_factory=list)
    #: Sealed under a key id the config does not hold: (object, key id).
    foreign: list[tuple[BlockObject, int]] = field(default_factory=list)
    #: Not a sealed block object the server serves: (object, why).
    unserved: list[tuple[BlockObject, str]] = field(default_factory=list)
    #: Deleted between the listing and the GET.
    gone: list[BlockObject] = field(default_factory=list)
    #: The object whose GET failed, and why; the sampling stops there.
    error: tuple[BlockObject, RemoteError] | None = None
    #: The newest opened object, checked to its tag as the server checks it.
    verdict: ObjectCheck | None = None

    @property
    def read(self) -> int:
        """Objects whose header was read."""
        return len(self.opened) + len(self.foreign) + len(self.unserved)

    def facts(self) -> dict[str, Any]:
        ids = Counter(f"{k:08x}" for _, k in self.opened + self.foreign)
        return {"objects_sampled": self.read, "sampled_key_ids": dict(ids.most_common())}


def check_block_object(
    client: S3Client, remote: RemoteConfig, keyring: Keyring, pinned: Mapping[str, Any] | None
) -> ObjectCheck:
    """Open the ``SAMPLE_OBJECTS`` newest block objects listed (first page under
    ``<prefix>/``) of the first namespace whose ``fingerprint.json`` matches ``pinned``
    (None: any namespace) with ``keyring``, as the config's server would. Fails where none
    opens and some are sealed under a key id ``keyring`` does not hold; warns where some
    open and others are sealed so, where one cannot be read, or is not one the server
    serves; ok without an object to open, saying so."""
    from tiered_kv.remote.store.client import RemoteError

    source = key_source(remote)
    try:
        chosen, seen = _choose_objects(client, remote.prefix, pinned)
    except RemoteError as e:
        return ObjectCheck(
            WARN,
            f"could not list {remote.prefix}/ to open a block object with the key ({e}); the key is not checked",
            "run the doctor again once the bucket answers LIST requests (s3:ListBucket)",
        )
    if chosen is None:
        others = f" ({seen} namespace(s) listed, none of them this config's by its fingerprint.json)" if seen else ""
        return ObjectCheck(
            OK,
            f"{source} holds key ids {held_key_ids(keyring)}; no object to check yet: no block object under "
            f"{remote.prefix}/ that this config's server reads among the first {LIST_PAGE_KEYS} keys{others}, "
            "so the key was not checked against the bucket",
            facts={"object": None},
        )
    namespace, objects, fingerprint = chosen
    sample = _Sample(namespace)
    for obj in objects:
        try:
            _open_object(client, remote, keyring, sample, obj, fingerprint)
        except RemoteError as e:
            sample.error = (obj, e)
            break
    return _judge(remote, keyring, sample)


def _choose_objects(
    client: S3Client, prefix: str, pinned: Mapping[str, Any] | None
) -> tuple[tuple[str, list[BlockObject], Fingerprint | None] | None, int]:
    """``((namespace id, its newest block objects listed, newest first, at most
    SAMPLE_OBJECTS), its fingerprint), namespaces listed)`` for the first namespace of the
    first page under ``<prefix>/`` that a server pinned to ``pinned`` reads; None where
    there is none."""
    from tiered_kv.model_identity import unread_fields
    from tiered_kv.ops.inspect.remote import BlockObject, parse_key

    root = prefix + "/"
    listed: dict[str, list[BlockObject]] = {}
    for info in itertools.islice(client.list_info(root), LIST_PAGE_KEYS):
        parsed = parse_key(info.key[len(root) :], info)
        if parsed is None:
            continue  # another prefix's keys, strays
        namespace, obj = parsed
        if isinstance(obj, BlockObject):  # not fingerprint.json
            listed.setdefault(namespace, []).append(obj)
    for namespace in list(listed)[:MAX_NAMESPACES]:
        fingerprint = _read_fingerprint(client, f"{root}{namespace}")
        if fingerprint is not None and fingerprint.namespace_id != namespace:
            continue  # a record copied from elsewhere says nothing about this namespace
        if pinned is None or (fingerprint is not None and not unread_fields(fingerprint.to_dict(), pinned)):
            # the newest are the likeliest sealed under the current key
            newest = sorted(listed[namespace], key=lambda o: (o.last_modified, o.key), reverse=True)
            return (namespace, newest[:SAMPLE_OBJECTS], fingerprint), len(listed)
    return None, len(listed)


def _read_fingerprint(client: S3Client, namespace_key: str) -> Fingerprint | None:
    """The fingerprint a namespace's ``fingerprint.json`` records, or None."""
    from tiered_kv.ops.inspect.remote import load_fingerprint
    from tiered_kv.remote.format.object_format import MANIFEST_NAME

    try:
        return load_fingerprint(client, f"{namespace_key}/{MANIFEST_NAME}")
    except ValueError:
        return None


def _open_object(
    client: S3Client,
    remote: RemoteConfig,
    keyring: Keyring,
    sample: _Sample,
    obj: BlockObject,
    fingerprint: Fingerprint | None,
) -> None:
    """Stream ``obj``'s header into ``sample``: its key id against ``keyring``; for the
    first object that opens, then (up to ``MAX_OBJECT_BYTES``) its tag, as the server
    checks it before serving it. ``RemoteError`` where the GET fails."""
    from tiered_kv.remote.format.object_format import (
        FORMAT_SEALED,
        Rejected,
        SealedHeader,
        format_version,
        stream_header,
    )

    found = client.stream(obj.key, CHUNK_BYTES)
    if found is None:
        sample.gone.append(obj)
        return
    total, chunks, _ = found
    rest = iter(chunks)
    head = stream_header(rest)
    try:
        version = format_version(memoryview(head))
        if version != FORMAT_SEALED:
            sample.unserved.append(
                (
                    obj,
                    f"{obj.key} is a format {version} object, not sealed under a fleet key: the server "
                    "serves only sealed objects here, so it is a miss",
                )
            )
            return
        header = SealedHeader.unpack(memoryview(head), total)
    except Rejected as e:
        sample.unserved.append((obj, f"{obj.key} is not a block object the server serves ({e})"))
        return
    if not keyring.holds(header.key_id):
        sample.foreign.append((obj, header.key_id))
        return
    sample.opened.append((obj, header.key_id))
    if sample.verdict is None:
        sample.verdict = _verify(remote, keyring, sample.namespace, obj, header.key_id, total, head, rest, fingerprint)


def _verify(
    remote: RemoteConfig,
    keyring: Keyring,
    namespace: str,
    obj: BlockObject,
    key_id: int,
    total: int,
    head: bytearray,
    rest: Iterator[memoryview],
    fingerprint: Fingerprint | None,
) -> ObjectCheck:
    """The check of ``obj``, sealed under ``key_id`` which ``keyring`` holds: its tag
    verified to the end (up to ``MAX_OBJECT_BYTES``) from ``head`` and the ``rest``."""
    from tiered_kv.remote.format.object_format import Rejected, fingerprint_digest, verify_stream

    facts: dict[str, Any] = {
        "object": obj.key,
        "object_namespace": namespace,
        "object_bytes": obj.size,
        "object_key_id": f"{key_id:08x}",
    }
    which = "its current key" if key_id == keyring.current_id else "an older key it still reads (never writes)"
    opened = (
        f"{key_source(remote)} holds key ids {held_key_ids(keyring)}; {obj.key} (namespace {namespace}) is "
        f"sealed under key id {key_id:08x}, {which}"
    )
    if total > MAX_OBJECT_BYTES:
        return ObjectCheck(
            OK,
            f"{opened}; its tag was not verified: {total} bytes is more than the {MAX_OBJECT_BYTES >> 20} MiB "
            "the doctor downloads",
            facts=facts,
        )
    try:
        verify_stream(
            total,
            itertools.chain([bytes(head)], rest),
            fingerprint=None if fingerprint is None else fingerprint_digest(fingerprint),
            block_hash=obj.block_hash,
            rank=obj.rank,
            keyring=keyring,
        )
    except Rejected as e:
        return ObjectCheck(WARN, f"{opened}, but the server would not serve it ({e})", _inspect_fix(remote), facts)
    return ObjectCheck(OK, f"{opened}, and opens with it", facts=facts)


def _inspect_fix(remote: RemoteConfig) -> str:
    return f"`tiered-kv inspect verify --remote CONFIG` lists every such object under {remote.prefix}/"


def _counted(keys: list[tuple[BlockObject, int]], of: int) -> tuple[str, int, int]:
    """``("key id X" or "key ids X (n of N), Y (m of N)", the most common key id, its count)``."""
    counts = Counter(k for _, k in keys).most_common()
    if len(counts) == 1:
        return f"key id {counts[0][0]:08x}", counts[0][0], counts[0][1]
    return "key ids " + ", ".join(f"{k:08x} ({n} of {of})" for k, n in counts), counts[0][0], counts[0][1]


def _judge(remote: RemoteConfig, keyring: Keyring, sample: _Sample) -> ObjectCheck:
    """The check's outcome from the objects ``sample`` read."""
    source, namespace, n = key_source(remote), sample.namespace, sample.read
    held = held_key_ids(keyring)
    if sample.opened:
        assert sample.verdict is not None
        verdict = sample.verdict
        status, messages, fixes = verdict.status, [verdict.message], [verdict.fix] if verdict.fix else []
        if sample.foreign:
            status = WARN
            ids, top, top_n = _counted(sample.foreign, n)
            k = len(sample.foreign)
            messages.append(
                f"{k} of the {n} newest block objects of namespace {namespace} sampled {'is' if k == 1 else 'are'} "
                f"sealed under {ids}, which {source} does not hold: this server would read none of them (each a "
                "miss)"
            )
            fix = (
                f"`tiered-kv inspect verify --remote CONFIG` counts the objects under {remote.prefix}/ sealed under "
                "a key id this config does not hold (it keeps them): find the member that writes them, or who "
                "else writes the bucket, and give that member the fleet's key"
            )
            if 2 * top_n > n:  # most of the sample: the fleet's key may be the one this node lacks
                fix += (
                    f"; if key id {top:08x} is the fleet's key (or a rotation's new one), give it to this server "
                    f"in {source}, first, and the old one after it"
                )
            fixes.append(fix)
        if sample.unserved:
            status = WARN
            u = len(sample.unserved)
            messages.append(f"{u} of the {n} sampled {'is' if u == 1 else 'are'} not served: {sample.unserved[0][1]}")
            fixes.append(_inspect_fix(remote))
        if sample.error is not None:
            messages.append(f"{sample.error[0].key} could not be read ({sample.error[1]}), so {n} were sampled")
        return ObjectCheck(
            status, "; ".join(messages), "; ".join(dict.fromkeys(fixes)), {**verdict.facts, **sample.facts()}
        )
    facts: dict[str, Any] = {"object_namespace": namespace, **sample.facts()}
    if sample.foreign:
        obj, key_id = sample.foreign[0]
        facts = {"object": obj.key, **facts, "object_bytes": obj.size, "object_key_id": f"{key_id:08x}"}
        ids, top, top_n = _counted(sample.foreign, n)
        k = len(sample.foreign)
        sealed = f"{obj.key} (namespace {namespace}) is sealed under key id {key_id:08x}"
        if n > 1:
            sealed = (
                f"none of the {n} newest block objects of namespace {namespace} sampled opens: {k} "
                f"{'is' if k == 1 else 'are'} sealed under {ids} (the newest {obj.key})"
            )
        unserved = ""
        if sample.unserved:
            u = len(sample.unserved)
            unserved = f"; {u} of the {n} sampled {'is' if u == 1 else 'are'} not served: {sample.unserved[0][1]}"
        if sample.error is not None:
            return ObjectCheck(
                WARN,
                f"could not read {sample.error[0].key} to check the key ({sample.error[1]}); the key is not "
                f"checked: {sealed}, which {source} does not hold{unserved}",
                "run the doctor again once the bucket answers",
                facts,
            )
        if 2 * top_n > n:
            fix = (
                f"give this server the fleet's key (id {top:08x}) in {source}, first; during a rotation, the new "
                "key first and the old one after it"
            )
        else:  # no key id seals most of the sample: which one is the fleet's is not for the doctor to say
            fix = (
                f"`tiered-kv inspect verify --remote CONFIG` counts the objects under {remote.prefix}/ by the key id "
                "that sealed them: give this server the fleet's key, first; during a rotation, the new key first "
                "and the old one after it"
            )
        return ObjectCheck(
            FAIL,
            f"{sealed}, which {source} does not hold: it holds key ids {held}. This server would read none of "
            f"the blocks sealed under it (each a miss){unserved}",
            fix,
            facts,
        )
    if sample.unserved:
        obj, why = sample.unserved[0]
        u = len(sample.unserved)
        more = f" ({u} of the {n} newest block objects sampled are not served)" if u > 1 else ""
        return ObjectCheck(
            WARN, why + more, _inspect_fix(remote), {"object": obj.key, **facts, "object_bytes": obj.size}
        )
    if sample.error is not None:
        obj, e = sample.error
        return ObjectCheck(
            WARN,
            f"could not read {obj.key} to check the key ({e}); the key is not checked",
            "run the doctor again once the bucket answers",
            {"object": obj.key, **facts},
        )
    gone = sample.gone
    what = f"{gone[0].key} was" if len(gone) == 1 else f"the {len(gone)} newest block objects listed were"
    return ObjectCheck(
        OK,
        f"{source} holds key ids {held}; no object to check: {what} deleted since listed, so the key was not "
        "checked against the bucket",
        facts={"object": gone[0].key, **facts},
    )
