"""The doctor's check of the shared tier's bucket (or Mooncake master).

Runs in the operator's process (``tiered-kv doctor``). Its I/O: one signed GET request
for a key that is not there (nothing is written), where the config names a shared tier,
and for an endpoint other than AWS's, one unsigned GET of the same key, whose answer
must be S3's: an S3 XML error body or S3's own headers. Any HTTP server answers 404 to a
key it does not have; only that second look tells an S3 endpoint from another server.
An object someone put at that key is not downloaded past ``safe_json.MAX_RECORD_BYTES``
(4 KiB by the unsigned GET). It also reads the fleet key file or variable the config names.
For a Mooncake Store: a TCP connection to the master's RPC port, then a client set up
with the config's settings asking whether a key that is not there exists.
"""

from __future__ import annotations

import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterable


from tiered_kv.config import TieredConfig
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.ops.doctor.report import FAIL, OK, WARN, Check


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


def check_remote(cfg: TieredConfig | None) -> Check:
    """The shared tier's bucket, where the config has one: one GET request for a key that
    is not there (nothing is written), which tells refused credentials, a missing bucket
    and a server that does not answer apart."""
    if cfg is None or cfg.remote is None:
        return Check("remote", OK, "no shared tier configured")
    if cfg.remote.backend == "mooncake":
        return check_mooncake(cfg.remote)
    from tiered_kv.remote.client import (
        AccessDenied,
        BucketMissing,
        ClientMissing,
        CredentialsMissing,
        RemoteError,
        RemoteSetupError,
        S3Client,
        WrongSize,
    )
    from tiered_kv.remote.keys import FleetKeyError, load_keyring
    from tiered_kv.remote.safe_json import MAX_RECORD_BYTES

    remote = cfg.remote
    where = f"bucket {remote.bucket!r} at {remote.endpoint or 'AWS S3'}"
    facts = {"endpoint": remote.endpoint, "bucket": remote.bucket, "prefix": remote.prefix}
    try:
        keyring = load_keyring(remote)
    except FleetKeyError as e:
        return Check("remote", FAIL, str(e), "openssl rand -hex 32 > FILE; chmod 600 FILE", facts)
    facts["key_ids"] = [] if keyring is None else [f"{k:08x}" for k in keyring.key_ids]
    cautions = []
    if keyring is None:
        cautions.append(
            (
                "the bucket is declared trusted and no key is set: blocks are stored in plaintext",
                "name a fleet key (remote.key_file or remote.key_env)",
            )
        )
    if remote.plaintext_endpoint():
        cautions.append(
            (
                f"{remote.endpoint} is plain http to another host",
                "use an https endpoint (remote.ca_bundle for a private CA)",
            )
        )
    try:
        S3Client(remote).get(f"{remote.prefix}/doctor-probe", limit=MAX_RECORD_BYTES)
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
    if cautions:
        message = f"shared tier: {where} answers as S3; " + "; ".join(m for m, _ in cautions)
        return Check("remote", WARN, message, "; ".join(f for _, f in cautions), facts)
    return Check("remote", OK, f"shared tier: {where} answers as S3", facts=facts)


def check_mooncake(remote: RemoteConfig) -> Check:
    """The Mooncake master: its RPC port accepts a connection, and a client set up from the
    config (metadata server, protocol, tenant) gets an answer to one existence query."""
    from tiered_kv.remote.client import RemoteError, RemoteSetupError
    from tiered_kv.remote.mooncake_client import MooncakeClient, master_answers

    where = remote.where()
    facts = {
        "backend": "mooncake",
        "master": remote.mooncake_master,
        "metadata_server": remote.mooncake_metadata_server,
        "protocol": remote.mooncake_protocol,
        "tenant": remote.mooncake_tenant,
        "prefix": remote.prefix,
    }
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
    return Check("remote", OK, f"shared tier: Mooncake master at {remote.mooncake_master} answers", facts=facts)
