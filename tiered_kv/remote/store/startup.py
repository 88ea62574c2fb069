"""The shared tier's start-up check: the namespace manifest written once and read back.

Runs where a ``RemoteStore`` is opened (each worker, the scheduler, the operator's tools),
once, on the caller's thread: one write-once PUT and one GET of ``fingerprint.json``
under the namespace (``object_format.manifest_key``). It tells wrong credentials and a
missing bucket (start-up errors) from a server that does not answer (serving goes on,
with misses); nothing read from the manifest gates serving.
"""

from __future__ import annotations

import json
import logging

from tiered_kv.fingerprint import Fingerprint
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.remote.format.object_format import FORMAT_VERSION, manifest_key
from tiered_kv.remote.format.safe_json import MAX_RECORD_BYTES, RecordError, load_record
from tiered_kv.remote.store.client import (
    AccessDenied,
    BucketMissing,
    ConditionalPutRefused,
    ObjectClient,
    RemoteError,
    RemoteSetupError,
    WrongSize,
)
from tiered_kv.remote.store.write_once import WriteOnce

logger = logging.getLogger(__name__)


def manifest(fingerprint: Fingerprint) -> bytes:
    """A namespace's ``fingerprint.json``: format version and fingerprint."""
    return json.dumps(
        {"format": FORMAT_VERSION, "fingerprint": fingerprint.to_dict()}, sort_keys=True, separators=(",", ":")
    ).encode()


def check_namespace(
    config: RemoteConfig, fingerprint: Fingerprint, sealed: bool, writer: WriteOnce, client: ObjectClient
) -> bool:
    """Write (once, through ``writer``) and read back the namespace manifest. True when it
    worked, False when the server did not answer (logged: serving goes on, with misses);
    raises ``RemoteSetupError`` naming endpoint and bucket when the credentials are
    refused or the bucket does not exist. A manifest that records another fingerprint,
    is too large or is not a record is logged: anyone who can write the bucket can put
    one there, and serving needs nothing from it (every block carries the fingerprint
    digest, under the tag)."""
    where = config.server()
    key = manifest_key(config.prefix, fingerprint, sealed=sealed)
    try:
        writer.put(key, [manifest(fingerprint)])
        stored = client.get(key, limit=MAX_RECORD_BYTES)
    except ConditionalPutRefused as exc:  # only under conditional_put "always"
        raise RemoteSetupError(
            f"shared tier: {where} does not implement conditional PUT (If-None-Match: *; {exc}), "
            "and remote.conditional_put is 'always'; use 'auto' to write with an existence check instead"
        ) from None
    except AccessDenied as exc:
        raise RemoteSetupError(
            f"shared tier: {where} refused the credentials or the request ({exc}); "
            "check AWS_ACCESS_KEY_ID / AWS_PROFILE and the bucket's policy"
        ) from None
    except BucketMissing:
        raise RemoteSetupError(
            f"shared tier: {where} does not exist; create it (e.g. aws s3 mb "
            f"s3://{config.bucket} --endpoint-url URL) or fix 'bucket'"
        ) from None
    except WrongSize as exc:
        logger.warning("shared tier: %s in %s is not a fingerprint record (%s); serving goes on", key, where, exc)
        return True
    except RemoteError as exc:
        logger.warning(
            "shared tier: %s did not answer the start-up check (%s); serving goes on, with misses until it answers",
            where,
            exc,
        )
        return False
    if stored is not None:
        try:
            differs = load_record(bytes(stored), "record").get("fingerprint") != fingerprint.to_dict()
            why = "records another fingerprint than this node's under the same namespace id"
        except RecordError as exc:
            differs, why = True, f"is not a fingerprint record ({exc})"
        if differs:  # a namespace-id collision, or a record someone wrote
            logger.warning("shared tier: %s in %s %s; serving goes on (blocks carry the full digest)", key, where, why)
    return True
