"""The doctor's check of the shared tier: the fleet key, the bucket (or Mooncake master),
and the newest block objects opened with the key.

Runs in the operator's process (``tiered-kv doctor``). It reads the fleet key file or
variable the config names, as a server does at start-up (``keys.load_keyring``: no key
and no ``trusted_bucket``, or a key that cannot be read, fails as the server refuses to
start). Its S3 I/O: one signed GET request for a key that is not there (nothing is
written), and for an endpoint other than AWS's, one unsigned GET of the same key, whose
answer must be S3's: an S3 XML error body or S3's own headers. Any HTTP server answers
404 to a key it does not have; only that second look tells an S3 endpoint from another
server. An object someone put at that key is not downloaded past
``safe_json.MAX_RECORD_BYTES`` (4 KiB by the unsigned GET).

Then, where a key is set, the object check (``remote_object.check_block_object``): one
LIST request, the ``fingerprint.json`` of the namespaces listed to find one this config's
server reads, and that namespace's newest block objects (at most
``remote_object.SAMPLE_OBJECTS``) streamed, counted by the key id that sealed each. It
fails where none of them opens with the config's keys, naming the key ids found with their
counts (never a key): the server would start, and every block of the fleet would be a
miss. Where some open and others are sealed under a key id the config does not hold, it
warns, counting them.

For a Mooncake Store: the key as above, a TCP connection to the master's RPC port, then
a client set up with the config's settings asking whether a key that is not there
exists. A Mooncake Store cannot list its keys, so no object is opened there.
"""

from __future__ import annotations

import os
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.config_values import redact
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.ops.doctor.remote_object import check_block_object, held_key_ids, key_source
from tiered_kv.ops.doctor.report import FAIL, OK, WARN, Check, skipped

if TYPE_CHECKING:  # the keys are imported where a check needs them
    from tiered_kv.remote.format.keys import Keyring


#: Headers S3 and its compatible servers (Ceph RGW, MinIO) put on every answer.
S3_HEADERS = ("x-amz-request-id", "x-amz-id-2", "x-minio-deployment-id")
_S3_ERROR_BODY = re.compile(rb"<Error>\s*<Code>[A-Za-z0-9]+</Code>")


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
