"""The doctor's check of the shared tier's bucket.

Runs in the operator's process (``tiered-kv doctor``). Its I/O: one GET request for a
key that is not there (nothing is written; an object someone put there is not
downloaded past ``safe_json.MAX_RECORD_BYTES``), where the config names a shared tier,
and a read of the fleet key file or variable the config names.
"""

from __future__ import annotations


from tiered_kv.config import TieredConfig
from tiered_kv.ops.doctor.report import FAIL, OK, WARN, Check


def check_remote(cfg: TieredConfig | None) -> Check:
    """The shared tier's bucket, where the config has one: one GET request for a key that
    is not there (nothing is written), which tells refused credentials, a missing bucket
    and a server that does not answer apart."""
    if cfg is None or cfg.remote is None:
        return Check("remote", OK, "no shared tier configured")
    from tiered_kv.remote.client import (
        AccessDenied,
        BucketMissing,
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
        return Check("remote", FAIL, f"shared tier: {e}", "openssl rand -hex 32 > FILE; chmod 600 FILE", facts)
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
    except RemoteSetupError as e:
        return Check("remote", FAIL, f"shared tier: {e}", "install the client: pip install 'tiered-kv[s3]'", facts)
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
    if cautions:
        message = f"shared tier: {where} answers; " + "; ".join(m for m, _ in cautions)
        return Check("remote", WARN, message, "; ".join(f for _, f in cautions), facts)
    return Check("remote", OK, f"shared tier: {where} answers", facts=facts)
