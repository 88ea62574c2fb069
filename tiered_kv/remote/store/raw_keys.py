"""Listing and deleting shared-tier keys by their exact bytes, for the operator's inspector.

Runs in the ``tiered-kv inspect --remote`` process only; each call is one or more
blocking S3 requests through botocore, with ``S3Client``'s endpoint, region, CA bundle
and credentials. obstore's listing fails on the whole prefix at the first key its paths
cannot hold (an ASCII control character, a ``.`` or ``..`` segment, an empty segment),
and it cannot address such a key to delete it; the serving path never meets such a key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote_to_bytes

from tiered_kv.remote.config import RemoteConfig
from tiered_kv.remote.store.client import (
    S3_INSTALL_HINT,
    AccessDenied,
    AwsCredentials,
    BucketMissing,
    ClientMissing,
    ListedKey,
    RemoteError,
    RemoteSetupError,
    Unavailable,
)


class RawKeys:
    """Listing and deleting of any key under a prefix, by its exact bytes, over botocore
    (for the operator's inspector; the serving path never lists and never meets such a
    key: it reads and writes only the keys it computes).

    The listing asks for URL-encoded keys (``EncodingType=url``) and decodes them to
    bytes itself, so a key with control characters, or one that is not UTF-8, comes back
    as it is instead of failing the page or being mangled by the XML parser. Requests
    are path-style to a custom endpoint, as ``S3Client``'s."""

    def __init__(self, config: RemoteConfig, credentials: AwsCredentials | None = None):
        try:
            import botocore.config
            import botocore.exceptions
        except ImportError:
            raise ClientMissing(S3_INSTALL_HINT) from None
        self._botocore_exc = botocore.exceptions
        self.config = config
        credentials = credentials or AwsCredentials(config)
        options = botocore.config.Config(
            region_name=config.region,
            connect_timeout=min(config.connect_timeout, config.request_timeout),
            read_timeout=config.request_timeout,
            retries={"total_max_attempts": config.retries + 1, "mode": "standard"},
            s3={"addressing_style": "path" if config.endpoint is not None else "virtual"},
            user_agent_extra="tiered-kv",
            # A key that is not UTF-8 is passed as bytes, which botocore's validation
            # refuses though its URL encoding takes them.
            parameter_validation=False,
        )
        try:
            self._s3 = credentials.session.create_client(
                "s3",
                endpoint_url=config.endpoint,
                verify=config.ca_bundle if config.ca_bundle is not None else None,
                config=options,
            )
        except botocore.exceptions.BotoCoreError as exc:
            raise RemoteSetupError(f"cannot make an S3 client for {config.where()}: {type(exc).__name__}") from None

    def _error(self, exc: Exception) -> RemoteError:
        if isinstance(exc, self._botocore_exc.ClientError):
            error: dict[str, Any] = exc.response.get("Error", {})
            code = str(error.get("Code") or "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            reason = code or f"HTTP {status}"
            if code == "NoSuchBucket":
                return BucketMissing(reason)
            if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return AccessDenied(reason)
            return Unavailable(reason)
        e = self._botocore_exc
        if isinstance(exc, e.ConnectTimeoutError):
            limit = min(self.config.connect_timeout, self.config.request_timeout)
            return Unavailable(f"connect timed out after {limit:g} s (connect_timeout)")
        if isinstance(exc, e.ReadTimeoutError):
            return Unavailable(f"timed out after {self.config.request_timeout:g} s (request_timeout)")
        if isinstance(exc, e.EndpointConnectionError):
            return Unavailable("cannot connect to the endpoint (refused, or its host name does not resolve)")
        return Unavailable(type(exc).__name__)

    def list(self, prefix: str) -> Iterator[ListedKey]:
        """Every object whose key starts with ``prefix``, in pages of 1000 keys."""
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.config.bucket,
                Prefix=prefix,
                EncodingType="url",
                PaginationConfig={"PageSize": 1000},
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    # Form encoding: a space may come as "+", and a "+" always as "%2B".
                    raw = unquote_to_bytes(item["Key"].replace("+", " "))
                    yield ListedKey(raw, int(item["Size"]), item["LastModified"].timestamp())
        except (self._botocore_exc.ClientError, self._botocore_exc.BotoCoreError) as exc:
            raise self._error(exc) from None

    def delete(self, raw: bytes) -> None:
        """Delete the object at ``raw`` (a key as ``list`` gave it); gone already is fine."""
        try:
            key: str | bytes = raw.decode("utf-8")
        except UnicodeDecodeError:
            key = raw
        try:
            self._s3.delete_object(Bucket=self.config.bucket, Key=key)
        except (self._botocore_exc.ClientError, self._botocore_exc.BotoCoreError) as exc:
            raise self._error(exc) from None

    def close(self) -> None:
        self._s3.close()
