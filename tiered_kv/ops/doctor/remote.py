"""The doctor's check of the shared tier: the fleet key, the bucket (or Mooncake master),
and one block object opened with the key.

Runs in the operator's process (``tiered-kv doctor``). It reads the fleet key file or
variable the config names, as a server does at start-up (``keys.load_keyring``: no key
and no ``trusted_bucket``, or a key that cannot be read, fails as the server refuses to
start). Its S3 I/O: one signed GET request for a key that is not there (nothing is
written), and for an endpoint other than AWS's, one unsigned GET of the same key, whose
answer must be S3's: an S3 XML error body or S3's own headers. Any HTTP server answers
404 to a key it does not have; only that second look tells an S3 endpoint from another
server. An object someone put at that key is not downloaded past
``safe_json.MAX_RECORD_BYTES`` (4 KiB by the unsigned GET).

Then, where a key is set, the object check (``check_block_object``): one LIST request
(the first page, ``LIST_PAGE_KEYS`` keys, under ``<prefix>/``), a GET of the
``fingerprint.json`` of at most ``MAX_NAMESPACES`` of the namespaces listed (each at most
``MAX_RECORD_BYTES``) to find one this config's server reads, and a streamed GET of that
namespace's newest block object listed, one ``CHUNK_BYTES`` chunk in memory at a time:
its header says which key id sealed it, and, for an object of at most
``MAX_OBJECT_BYTES``, its tag is verified to the end. An object sealed under a key id
the config does not hold fails, naming both sides' key ids (never a key): the server
would start, and every block of the fleet would be a miss.

For a Mooncake Store: the key as above, a TCP connection to the master's RPC port, then
a client set up with the config's settings asking whether a key that is not there
exists. A Mooncake Store cannot list its keys, so no object is opened there.
"""

from __future__ import annotations

import itertools
import os
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.config_values import redact
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.ops.doctor.report import FAIL, OK, WARN, Check, skipped

if TYPE_CHECKING:  # the S3 client, the keys and the object format are imported where a check needs them
    from tiered_kv.fingerprint import Fingerprint
    from tiered_kv.ops.inspect.remote import BlockObject
    from tiered_kv.remote.store.client import S3Client
    from tiered_kv.remote.format.keys import Keyring


#: Headers S3 and its compatible servers (Ceph RGW, MinIO) put on every answer.
S3_HEADERS = ("x-amz-request-id", "x-amz-id-2", "x-minio-deployment-id")
_S3_ERROR_BODY = re.compile(rb"<Error>\s*<Code>[A-Za-z0-9]+</Code>")
#: Keys the object check lists: S3's first page under the prefix, one LIST request.
LIST_PAGE_KEYS = 1000
#: Namespaces of that page whose ``fingerprint.json`` is read to find one this config's
#: server reads (one bounded GET each).
MAX_NAMESPACES = 16
#: Largest block object downloaded to the end to verify its tag (a block object is a few
#: MiB); of a larger one only the header, which names the key id, is read.
MAX_OBJECT_BYTES = 64 * 1024**2
#: Bytes per streamed chunk of the object: one chunk in memory at a time.
CHUNK_BYTES = 1 << 20


def s3_answer(headers: Iterable[str], body: bytes) -> bool:
    """Whether an HTTP answer is S3's: one of ``S3_HEADERS`` among its ``headers``' names,
    or an S3 XML error body."""
    names = {k.lower() for k in headers}
    return any(h in names for h in S3_HEADERS) or bool(_S3_ERROR_BODY.search(body[:4096]))


def probe_endpoint(url: str, timeout: float, cafile: str | None = None) -> tuple[int | None, bool, str]:
    """One unsigned GET of ``url`` (trusting ``cafile``'s CAs besides the system's):
    ``(HTTP status or None, whether the answer is S3's, what went wrong or the status line)``."""
    context = None
    if cafile is not None and url.startswith("https://"):
        context = ssl.create_default_context()
        context.load_verify_locations(cafile=cafile)
    try:
        request = urllib.request.Request(url, method="GET")
        with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
            return r.status, s3_answer(r.headers, r.read(4096)), f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        body = e.read(4096) if e.fp is not None else b""
        return e.code, s3_answer(e.headers or {}, body), f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return None, False, str(getattr(e, "reason", e))


def check_remote(cfg: TieredConfig | None, extra: Mapping[str, Any] | None = None) -> Check:
    """The shared tier, where the config has one: the fleet key as the server loads it;
    for S3, one GET request for a key that is not there (nothing is written), which tells
    refused credentials, a missing bucket and a server that does not answer apart, then
    one block object opened with the key (``check_block_object``). ``extra`` is the
    config's own keys (its ``kv_connector_extra_config``): the fingerprint fields it pins
    choose the namespace whose object is opened; None: any namespace under the prefix."""
    if cfg is None or (shared := cfg.shared_tier) is None:
        return skipped("remote", "no shared tier configured")
    remote: RemoteConfig = shared.settings
    if remote.backend == "mooncake":
        return check_mooncake(remote)
    from tiered_kv.remote.store.client import (
        AccessDenied,
        BucketMissing,
        ClientMissing,
        CredentialsMissing,
        RemoteError,
        RemoteSetupError,
        S3Client,
        WrongSize,
    )
    from tiered_kv.remote.format.safe_json import MAX_RECORD_BYTES

    where = f"bucket {remote.bucket!r} at {remote.endpoint or 'AWS S3'}"
    facts: dict[str, Any] = {"endpoint": remote.endpoint, "bucket": remote.bucket, "prefix": remote.prefix}
    keys = _load_keys(remote, facts)
    if isinstance(keys, Check):
        return keys
    keyring, cautions = keys
    if remote.plaintext_endpoint():
        cautions.append(
            (
                f"{remote.endpoint} is plain http to another host",
                "use an https endpoint (remote.ca_bundle for a private CA)",
            )
        )
    try:
        client = S3Client(remote)
        client.get(f"{remote.prefix}/doctor-probe", limit=MAX_RECORD_BYTES)
    except WrongSize as e:
        cautions.append(
            (
                f"{remote.prefix}/doctor-probe holds an object nobody should have written ({e}; not read)",
                f"delete {remote.prefix}/doctor-probe and find out who can write the bucket",
            )
        )
    except ClientMissing as e:
        return Check("remote", FAIL, f"shared tier: {e}", "install the client: pip install 'tiered-kv[s3]'", facts)
    except CredentialsMissing as e:
        return Check(
            "remote",
            FAIL,
            f"shared tier: {e}",
            "give the server's user credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE (or remote.profile) naming a profile in ~/.aws/credentials, or an instance role",
            facts,
        )
    except RemoteSetupError as e:
        return Check("remote", FAIL, f"shared tier: {e}", "check the AWS configuration (~/.aws/config)", facts)
    except AccessDenied as e:
        return Check(
            "remote",
            FAIL,
            f"shared tier: {where} refused the credentials or the request ({e})",
            "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and allow s3:GetObject, "
            "s3:PutObject, s3:DeleteObject and s3:ListBucket on the bucket",
            facts,
        )
    except BucketMissing:
        return Check(
            "remote",
            FAIL,
            f"shared tier: {where} does not exist",
            f"create it (aws s3 mb s3://{remote.bucket}) or fix remote.bucket",
            facts,
        )
    except RemoteError as e:
        return Check(
            "remote",
            WARN,
            f"shared tier: {where} did not answer ({e}); the server would serve with misses until it does",
            "check remote.endpoint and the network path to it",
            facts,
        )
    if remote.endpoint is not None:
        url = f"{remote.endpoint.rstrip('/')}/{remote.bucket}/{remote.prefix}/doctor-probe"
        status, is_s3, said = probe_endpoint(url, remote.request_timeout, remote.ca_bundle)
        facts = {**facts, "probe_status": status, "s3_answer": is_s3}
        if not is_s3:
            return Check(
                "remote",
                FAIL,
                f"shared tier: {remote.endpoint} answered {said} without S3's headers (x-amz-request-id) "
                f"or an S3 XML error body: not an S3 endpoint",
                "point remote.endpoint at the S3 service (scheme, host and port of the RGW, MinIO or S3 "
                "endpoint, without the bucket)",
                facts,
            )
    message = f"shared tier: {where} answers as S3"
    if keyring is None:
        message += "; no key, so no object's key to check"
    else:
        found = check_block_object(client, remote, keyring, None if extra is None else _pinned(extra))
        facts = {**facts, **found.facts}
        if found.status == FAIL:
            return Check("remote", FAIL, f"shared tier: {found.message}", found.fix, facts)
        if found.status == WARN:
            cautions.append((found.message, found.fix))
        else:
            message += f"; {found.message}"
    if cautions:
        message += "; " + "; ".join(m for m, _ in cautions)
        return Check("remote", WARN, message, "; ".join(f for _, f in cautions), facts)
    return Check("remote", OK, message, facts=facts)


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


def _load_keys(remote: RemoteConfig, facts: dict[str, Any]) -> Check | tuple[Keyring | None, list[tuple[str, str]]]:
    """The config's keyring as the server loads it, and the cautions it brings (a trusted
    bucket without a key, a key file other users can read); a failing ``Check`` where the
    server would refuse to start. Adds ``key_ids`` to ``facts``."""
    from tiered_kv.remote.format.keys import FleetKeyError, load_keyring

    try:
        keyring = load_keyring(remote)
    except FleetKeyError as e:
        if remote.key_file is not None:
            fix = (
                f"put the fleet's key in {redact(remote.key_file)} (mode 600, readable by the server's user), "
                "or fix remote.key_file"
            )
        elif remote.key_env is not None:
            fix = (
                f"set {redact(remote.key_env)} to the fleet's key in the server's environment (the doctor reads "
                "its own: run it with the server's), or fix remote.key_env"
            )
        else:
            fix = (
                "openssl rand -hex 32 > FILE; chmod 600 FILE; name FILE in remote.key_file (or a variable "
                "holding the key in remote.key_env), the same key on every node of the fleet"
            )
        return Check("remote", FAIL, str(e), fix, facts)
    facts["key_source"] = key_source(remote)
    facts["key_ids"] = [] if keyring is None else [f"{k:08x}" for k in keyring.key_ids]
    cautions = []
    if keyring is None:
        cautions.append(
            (
                "the bucket is declared trusted and no key is set: blocks are stored in plaintext",
                "name a fleet key (remote.key_file or remote.key_env)",
            )
        )
    else:
        facts["current_key_id"] = f"{keyring.current_id:08x}"
        if remote.key_file is not None and _mode(remote.key_file) & 0o077:
            cautions.append(
                (
                    f"remote.key_file {redact(remote.key_file)} is readable by other users",
                    f"chmod 600 {redact(remote.key_file)}",
                )
            )
    return keyring, cautions


def _mode(path: str) -> int:
    try:
        return os.stat(path).st_mode
    except OSError:  # read a moment ago: gone since, which the server's start-up will say
        return 0


def _pinned(extra: Mapping[str, Any]) -> dict[str, Any] | None:
    """The fingerprint fields a server with extra config ``extra`` is bound to
    (``model_identity.pinned_fields``); without the weights digest where its
    ``model_path`` cannot be read here. None: nothing narrows the namespaces."""
    from tiered_kv.model_identity import pinned_fields

    try:
        return pinned_fields(extra)
    except ConfigError:
        pass
    try:
        return pinned_fields({k: v for k, v in extra.items() if k != "model_path"})
    except ConfigError:
        return None


@dataclass(frozen=True)
class ObjectCheck:
    """What ``check_block_object`` found: a status, a message (without the ``shared
    tier:`` lead), the fix unless ok, and its facts."""

    status: str
    message: str
    fix: str = ""
    facts: dict[str, Any] = field(default_factory=dict)


def check_block_object(
    client: S3Client, remote: RemoteConfig, keyring: Keyring, pinned: Mapping[str, Any] | None
) -> ObjectCheck:
    """Open one block object with ``keyring``, as the config's server would: the newest
    block object listed (first page under ``<prefix>/``) of the first namespace whose
    ``fingerprint.json`` matches ``pinned`` (None: any namespace). Fails where the object
    is sealed under a key id ``keyring`` does not hold; ok without an object to open,
    saying so; warns where the object cannot be read or is not one the server serves."""
    from tiered_kv.remote.store.client import RemoteError

    source = key_source(remote)
    try:
        chosen, seen = _choose_object(client, remote.prefix, pinned)
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
    namespace, obj, fingerprint = chosen
    try:
        return _open_object(client, remote, keyring, namespace, obj, fingerprint)
    except RemoteError as e:
        return ObjectCheck(
            WARN,
            f"could not read {obj.key} to check the key ({e}); the key is not checked",
            "run the doctor again once the bucket answers",
            {"object": obj.key},
        )


def _choose_object(
    client: S3Client, prefix: str, pinned: Mapping[str, Any] | None
) -> tuple[tuple[str, BlockObject, Fingerprint | None] | None, int]:
    """``((namespace id, its newest block object listed, its fingerprint), namespaces
    listed)`` for the first namespace of the first page under ``<prefix>/`` that a server
    pinned to ``pinned`` reads; None where there is none."""
    from tiered_kv.model_identity import unread_fields
    from tiered_kv.ops.inspect.remote import BlockObject, parse_key

    root = prefix + "/"
    newest: dict[str, BlockObject] = {}
    for info in itertools.islice(client.list_info(root), LIST_PAGE_KEYS):
        parsed = parse_key(info.key[len(root) :], info)
        if parsed is None:
            continue  # another prefix's keys, strays
        namespace, obj = parsed
        if not isinstance(obj, BlockObject):
            continue  # fingerprint.json
        if namespace not in newest or obj.last_modified > newest[namespace].last_modified:
            newest[namespace] = obj  # the newest is the likeliest sealed under the current key
    for namespace in list(newest)[:MAX_NAMESPACES]:
        fingerprint = _read_fingerprint(client, f"{root}{namespace}")
        if fingerprint is not None and fingerprint.namespace_id != namespace:
            continue  # a record copied from elsewhere says nothing about this namespace
        if pinned is None or (fingerprint is not None and not unread_fields(fingerprint.to_dict(), pinned)):
            return (namespace, newest[namespace], fingerprint), len(newest)
    return None, len(newest)


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
    namespace: str,
    obj: BlockObject,
    fingerprint: Fingerprint | None,
) -> ObjectCheck:
    """Stream ``obj``: its header's key id against ``keyring``, then (up to
    ``MAX_OBJECT_BYTES``) its tag, as the server checks it before serving it."""
    from tiered_kv.remote.format.object_format import (
        FORMAT_SEALED,
        Rejected,
        SealedHeader,
        fingerprint_digest,
        format_version,
        stream_header,
        verify_stream,
    )

    source = key_source(remote)
    facts: dict[str, Any] = {"object": obj.key, "object_namespace": namespace, "object_bytes": obj.size}
    found = client.stream(obj.key, CHUNK_BYTES)
    if found is None:
        return ObjectCheck(
            OK,
            f"{source} holds key ids {held_key_ids(keyring)}; no object to check: {obj.key} was deleted "
            "since it was listed, so the key was not checked against the bucket",
            facts=facts,
        )
    total, chunks = found
    rest = iter(chunks)
    head = stream_header(rest)
    inspect_fix = f"`tiered-kv inspect verify --remote CONFIG` lists every such object under {remote.prefix}/"
    try:
        version = format_version(memoryview(head))
        if version != FORMAT_SEALED:
            return ObjectCheck(
                WARN,
                f"{obj.key} is a format {version} object, not sealed under a fleet key: the server "
                "serves only sealed objects here, so it is a miss",
                inspect_fix,
                facts,
            )
        header = SealedHeader.unpack(memoryview(head), total)
    except Rejected as e:
        return ObjectCheck(WARN, f"{obj.key} is not a block object the server serves ({e})", inspect_fix, facts)
    facts["object_key_id"] = f"{header.key_id:08x}"
    if not keyring.holds(header.key_id):
        return ObjectCheck(
            FAIL,
            f"{obj.key} (namespace {namespace}) is sealed under key id {header.key_id:08x}, which "
            f"{source} does not hold: it holds key ids {held_key_ids(keyring)}. This server "
            "would read none of the blocks sealed under it (each a miss)",
            f"give this server the fleet's key (id {header.key_id:08x}) in {source}, first; during a "
            "rotation, the new key first and the old one after it",
            facts,
        )
    which = "its current key" if header.key_id == keyring.current_id else "an older key it still reads (never writes)"
    opened = (
        f"{source} holds key ids {held_key_ids(keyring)}; {obj.key} (namespace {namespace}) is sealed under "
        f"key id {header.key_id:08x}, {which}"
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
        return ObjectCheck(WARN, f"{opened}, but the server would not serve it ({e})", inspect_fix, facts)
    return ObjectCheck(OK, f"{opened}, and opens with it", facts=facts)


def check_mooncake(remote: RemoteConfig) -> Check:
    """The fleet key as the server loads it; the Mooncake master: its RPC port accepts a
    connection, and a client set up from the config (metadata server, protocol, tenant)
    gets an answer to one existence query. No object is opened: a Mooncake Store cannot
    list its keys."""
    from tiered_kv.remote.store.client import RemoteError, RemoteSetupError
    from tiered_kv.remote.store.mooncake_client import MooncakeClient, master_answers

    where = remote.where()
    facts: dict[str, Any] = {
        "backend": "mooncake",
        "master": remote.mooncake_master,
        "metadata_server": remote.mooncake_metadata_server,
        "protocol": remote.mooncake_protocol,
        "tenant": remote.mooncake_tenant,
        "prefix": remote.prefix,
    }
    keys = _load_keys(remote, facts)
    if isinstance(keys, Check):
        return keys
    keyring, cautions = keys
    if not master_answers(remote.mooncake_master, remote.connect_timeout):
        return Check(
            "remote",
            WARN,
            f"shared tier: no Mooncake master answers at {remote.mooncake_master}; "
            "the server would serve with misses until one does",
            "start mooncake_master (and a standalone mooncake_client holding memory), or fix remote.mooncake_master",
            facts,
        )
    try:
        with MooncakeClient(remote) as client:
            client.exists(f"{remote.prefix}/doctor-probe")
    except RemoteSetupError as e:
        return Check(
            "remote", FAIL, f"shared tier: {e}", "install the client: pip install 'tiered-kv[mooncake]'", facts
        )
    except RemoteError as e:
        return Check(
            "remote",
            WARN,
            f"shared tier: {where} did not answer a query ({e})",
            "check remote.mooncake_metadata_server and that a mooncake_client holds memory for the pool",
            facts,
        )
    message = f"shared tier: Mooncake master at {remote.mooncake_master} answers"
    if keyring is not None:
        message += (
            f"; {key_source(remote)} holds key ids {held_key_ids(keyring)}, not checked against a "
            "stored object: a Mooncake Store cannot list its keys (the object check is S3-only)"
        )
    if cautions:
        message += "; " + "; ".join(m for m, _ in cautions)
        return Check("remote", WARN, message, "; ".join(f for _, f in cautions), facts)
    return Check("remote", OK, message, facts=facts)
