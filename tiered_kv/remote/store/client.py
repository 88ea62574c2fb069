"""The object-store client of the shared tier: S3 requests through obstore.

Runs in whichever process opened the tier (the scheduler for membership probes, each
worker for block uploads and downloads); every call is one blocking HTTP request (with
at most ``RemoteConfig.retries`` more after a transient failure), made from the store's
thread pool. obstore (Rust's object_store) lets go of the GIL for the whole request and
moved 0.5 MiB blocks at about twice boto3's rate on a 2-core machine, where boto3's
Python-side signing and parsing competed with the server for the cores
(docs/benchmarks.md, ``tools/bench_remote.py``).

Errors come out as three kinds: ``Unavailable`` (network, timeout, 5xx such as 503
SlowDown: a miss or a dropped upload for the caller), ``AccessDenied`` and
``BucketMissing`` (the configuration is wrong: a start-up error). A missing object is
not an error (``get`` gives None, ``exists`` False); neither is a write-once put that
finds the object there (``put_new`` gives False). A fourth kind belongs to ``put_new``
alone: ``ConditionalPutRefused``, a server that does not implement ``If-None-Match: *``
on PUT (older MinIO and Ceph answer 501 NotImplemented, others 400 naming the header);
the store then writes with ``exists`` and a plain ``put`` instead (see ``store``).

Credentials come from botocore's standard chain (environment, shared credentials and
config files with ``profile`` or AWS_PROFILE, container and instance roles), handed to
obstore through a callback it calls again before they expire. They are never logged,
never put into a message, and never kept in the config.

``raw_keys.RawKeys`` (the operator's inspector only) lists and deletes keys by their
exact bytes, where obstore cannot.
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # obstore's option types exist for type checkers only
    from obstore.store import ClientConfig, RetryConfig, S3Config, S3Credential
    from typing_extensions import Buffer
else:
    try:
        from collections.abc import Buffer  # Python 3.12+
    except ImportError:  # pragma: no cover - older Pythons
        Buffer = bytes | bytearray | memoryview

from tiered_kv.remote.config import RemoteConfig

logger = logging.getLogger(__name__)

#: What to install for the S3 backend, in the error raised where obstore or botocore is missing.
S3_INSTALL_HINT = "the shared tier needs obstore and botocore: pip install 'tiered-kv[s3]'"
_CODE_RE = re.compile(r"<Code>([A-Za-z0-9]+)</Code>")
_STATUS_RE = re.compile(r"status code: (\d{3} [A-Za-z ]+)")
_STATUS_NUMBER_RE = re.compile(r"status code: (\d{3})\b")
#: The elements of an S3 error body that say what was refused (not ``Resource``: it holds
#: the key, whose prefix is the operator's and may contain any word).
_ERROR_TEXT_RE = re.compile(r"<(Code|Message|ArgumentName|ArgumentValue|Header|HeaderName)>([^<]*)</\1>")
#: Codes that name a conditional request but are not a refusal of it: the object exists
#: (412), or a concurrent write conflicted (409, retried as a transient failure).
_NOT_A_REFUSAL = ("PreconditionFailed", "ConditionalRequestConflict")
#: How long obstore may keep a set of credentials before asking the chain again
#: (botocore refreshes expiring role credentials itself when asked).
_CREDENTIALS_TTL = datetime.timedelta(minutes=10)


class RemoteError(RuntimeError):
    """A failed request to the object store."""


class Unavailable(RemoteError):
    """The store did not answer in time, or answered with a transient failure."""


class AccessDenied(RemoteError):
    """The store refused the credentials or the operation (HTTP 403)."""


class BucketMissing(RemoteError):
    """The bucket does not exist at the endpoint."""


class WrongSize(RemoteError):
    """The object is not the size asked for, or larger than the limit (its body was not
    read); ``tag`` is its version tag where the store has one (``Tagged``)."""

    def __init__(self, size: int, expected: int, limit: bool = False, tag: str | None = None):
        super().__init__(f"object of {size} bytes, expected {'at most ' if limit else ''}{expected}")
        self.size = size
        self.tag = tag


class Tagged(NamedTuple):
    """An object's bytes and its version tag (S3's ETag), which ``replace`` names to
    write over that version only; None where the store has no tags."""

    data: Buffer
    tag: str | None


class ConditionalPutRefused(RemoteError):
    """The server does not implement the write-once PUT (``If-None-Match: *``)."""


class RemoteSetupError(RuntimeError):
    """The shared tier cannot start: credentials, bucket or library missing or wrong."""


class ClientMissing(RemoteSetupError):
    """The S3 client libraries (obstore, botocore) are not installed."""


class CredentialsMissing(RemoteSetupError):
    """No AWS credentials, or a named profile that does not exist."""


class ObjectInfo(NamedTuple):
    """One object of a listing."""

    key: str
    size: int
    #: Seconds since the epoch.
    last_modified: float


class ListedKey(NamedTuple):
    """One object of a ``RawKeys`` listing: its key exactly as the server holds it."""

    raw: bytes
    size: int
    #: Seconds since the epoch.
    last_modified: float


class ObjectClient(Protocol):
    """What the store needs of an object store (one blocking request per call)."""

    def put_new(self, key: str, parts: Sequence[Buffer]) -> bool:
        """Write the concatenation of ``parts`` as one object unless ``key`` exists
        (``If-None-Match: *``); True if written, False if it was there."""

    def put(self, key: str, parts: Sequence[Buffer]) -> None:
        """Write the concatenation of ``parts`` as one object, replacing any there (a plain
        PUT: for servers that refuse ``put_new``'s condition)."""

    def get(self, key: str, size: int | None = None, limit: int | None = None) -> Buffer | None:
        """The whole object, or None when there is none; ``WrongSize`` without reading
        it when ``size`` is given and the object has another, or ``limit`` is given and
        the object is larger. A read of a key anyone may have written gives one of them."""

    def get_tagged(self, key: str, size: int | None = None, limit: int | None = None) -> Tagged | None:
        """``get``, with the version's tag."""

    def replace(self, key: str, parts: Sequence[Buffer], tag: str | None) -> bool:
        """Write the concatenation of ``parts`` over the object at ``key`` only while it
        is the version tagged ``tag`` (``If-Match``): True if written, False if another
        write replaced or removed that version meanwhile. ``tag`` None: over whatever is
        there (a store without tags)."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix``."""

    def close(self) -> None: ...


@runtime_checkable
class BatchProbe(Protocol):
    """An ``ObjectClient`` whose server answers many existence checks in one request
    (Mooncake's ``batch_is_exist``; S3 has none: its probes go one HEAD each, in parallel)."""

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each of ``keys`` exists, in order, in one request; raises the client's
        ``RemoteError`` when the server did not answer for every key."""


@runtime_checkable
class BatchGet(Protocol):
    """An ``ObjectClient`` whose server sends many objects in one request (Mooncake's
    ``batch_get_into``; S3 has none: its reads go one GET each, in parallel)."""

    def get_many(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Buffer | None | RemoteError]:
        """Each of ``keys``, in order, in one request: its bytes where it is ``sizes[i]``
        long (valid until this thread's next read), None where it is absent, ``WrongSize``
        where it is of another size (its bytes unread), another ``RemoteError`` where the
        server failed that one object; raises ``RemoteError`` when the request failed."""


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REFUSED_RE = re.compile(r"ConnectError\(\s*\"([^\"]+)\",\s*([^,\s]+),")
_DNS_RE = re.compile(r"dns error|failed to lookup address", re.IGNORECASE)


def describe_failure(exc: BaseException, config: RemoteConfig | None = None) -> str:
    """A short reason: the S3 error code or HTTP status where the message has one; a
    timeout as a timeout with the limit that ran out (``config``'s ``connect_timeout`` or
    ``request_timeout``, named as the setting); a refused connection or an unknown host
    as such."""
    text = str(exc)
    if m := _CODE_RE.search(text):
        return m.group(1)
    if m := _STATUS_RE.search(text):
        return m.group(1).strip()
    if "kind: Timeout" in text or "TimedOut" in text or "timed out" in text.lower():
        connect = "kind: Connect" in text
        if config is None:
            return "connect timed out" if connect else "timed out"
        if connect:
            limit = min(config.connect_timeout, config.request_timeout)
            return f"connect timed out after {limit:g} s (connect_timeout)"
        retried = f", {config.retries} retr{'y' if config.retries == 1 else 'ies'} allowed" if config.retries else ""
        return f"timed out after {config.request_timeout:g} s (request_timeout{retried})"
    if "ConnectionRefused" in text or "Connection refused" in text:
        m = _REFUSED_RE.search(text)
        return f"connection refused by {m.group(2)}" if m else "connection refused"
    if _DNS_RE.search(text):
        return "the endpoint's host name does not resolve"
    # obstore: "Generic S3 error: Error performing PUT <url> in 2.0s - HTTP error: <cause>"
    return _first_line(exc, 1000).rsplit(" - ", 1)[-1][:160]


def conditional_put_refusal(message: str) -> str | None:
    """Why a conditional PUT failed, when its error ``message`` says the server does not
    implement the condition (HTTP 501, code NotImplemented, or a 4xx error whose code or
    message names If-None-Match, If-Match or conditional requests); None for any other failure
    (503 SlowDown, timeouts, 403, 409 ConditionalRequestConflict...)."""
    status_match = _STATUS_NUMBER_RE.search(message)
    status = int(status_match.group(1)) if status_match else None
    parts = dict(reversed(_ERROR_TEXT_RE.findall(message)))  # the first of each element
    code = parts.get("Code")
    if code in _NOT_A_REFUSAL:
        return None
    reason = " ".join(str(p) for p in (status, code) if p is not None)
    if status == 501 or code == "NotImplemented":
        return reason
    if status is not None and 400 <= status < 500 and status not in (403, 404, 409, 412):
        named = " ".join(parts.values()).lower()
        if "if-none-match" in named or "if-match" in named or "conditional" in named:
            return f"{reason}: {parts['Message']}" if parts.get("Message") else reason
    return None


class AwsCredentials:
    """obstore's credential callback over botocore's standard chain."""

    def __init__(self, config: RemoteConfig):
        try:
            import botocore.exceptions
            import botocore.session
        except ImportError:
            raise ClientMissing(S3_INSTALL_HINT) from None
        try:
            session = botocore.session.Session(profile=config.profile)
            resolved = session.get_credentials()
        except botocore.exceptions.ProfileNotFound:
            raise CredentialsMissing(
                f"AWS profile {config.profile!r} not found (in ~/.aws/config or "
                f"~/.aws/credentials) for {config.where()}"
            ) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise RemoteSetupError(
                f"cannot resolve AWS credentials for {config.where()}: {type(exc).__name__}"
            ) from None
        if resolved is None:
            raise CredentialsMissing(
                f"no AWS credentials found for {config.where()}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (or the config's profile) with ~/.aws/credentials"
            )
        self._resolved = resolved
        #: The botocore session the credentials came from (``RawKeys`` makes its client there).
        self.session = session
        self.method = getattr(resolved, "method", "unknown")  # e.g. "env", "shared-credentials-file"

    def __call__(self) -> S3Credential:
        frozen = self._resolved.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.datetime.now(datetime.timezone.utc) + _CREDENTIALS_TTL,
        }

    def __repr__(self) -> str:  # never the keys
        return f"AwsCredentials(method={self.method!r})"


class S3Client:
    """``ObjectClient`` over obstore's ``S3Store`` for ``config``'s bucket.

    Path-style requests to a custom endpoint (Ceph RGW, MinIO and the like),
    virtual-hosted ones to AWS. Idle connections kept: ``max_connections``; the store's
    thread pool keeps the number of requests in flight at that bound too.
    """

    def __init__(self, config: RemoteConfig, credentials: AwsCredentials | None = None):
        try:
            import obstore
            import obstore.exceptions
            from obstore.store import S3Store
        except ImportError:
            raise ClientMissing(S3_INSTALL_HINT) from None
        self._obstore = obstore
        self._exc = obstore.exceptions
        #: Whether the server refused ``If-Match`` on a PUT as unsupported: replacements
        #: are plain PUTs from then on (logged once, as one of an object without an ETag).
        self.if_match_refused = False
        self._warned_unconditional = False
        self.config = config
        self.credentials = credentials or AwsCredentials(config)
        timeout = datetime.timedelta(seconds=config.request_timeout)
        options: ClientConfig = {
            "timeout": timeout,
            "connect_timeout": datetime.timedelta(seconds=min(config.connect_timeout, config.request_timeout)),
            "pool_max_idle_per_host": str(config.max_connections),
            "pool_idle_timeout": datetime.timedelta(seconds=30),
            "user_agent": "tiered-kv",
        }
        s3: S3Config = {"region": config.region}
        if config.endpoint is not None:
            s3["endpoint"] = config.endpoint
            s3["virtual_hosted_style_request"] = False
            options["allow_http"] = config.endpoint.startswith("http://")
        else:
            s3["virtual_hosted_style_request"] = True
        if config.ca_bundle is not None:
            try:
                with open(config.ca_bundle, "rb") as f:
                    options["root_certificate"] = f.read(4 * 1024**2)
            except OSError as e:
                raise RemoteSetupError(
                    f"remote.ca_bundle {config.ca_bundle}: cannot be read ({e.strerror or e})"
                ) from None
        retry: RetryConfig = {
            "max_retries": config.retries,
            "retry_timeout": timeout,
            "backoff": {
                "init_backoff": datetime.timedelta(milliseconds=50),
                "max_backoff": datetime.timedelta(milliseconds=500),
                "base": 2,
            },
        }
        self.raw = S3Store(
            config.bucket, config=s3, client_options=options, retry_config=retry, credential_provider=self.credentials
        )

    def _error(self, exc: Exception) -> RemoteError:
        reason = describe_failure(exc, self.config)
        if isinstance(exc, (self._exc.PermissionDeniedError, self._exc.UnauthenticatedError)):
            return AccessDenied(reason)
        if "NoSuchBucket" in str(exc):
            return BucketMissing(reason)
        return Unavailable(reason)

    def put_new(self, key: str, parts: Sequence[Buffer]) -> bool:
        try:
            self._obstore.put(self.raw, key, list(parts), mode="create", use_multipart=False)
        except self._exc.AlreadyExistsError:
            return False
        except Exception as exc:  # everything else is classified; nothing escapes as is
            if (refusal := conditional_put_refusal(str(exc))) is not None:
                raise ConditionalPutRefused(refusal) from None
            raise self._error(exc) from None
        return True

    def put(self, key: str, parts: Sequence[Buffer]) -> None:
        try:
            self._obstore.put(self.raw, key, list(parts), mode="overwrite", use_multipart=False)
        except Exception as exc:
            raise self._error(exc) from None

    def replace(self, key: str, parts: Sequence[Buffer], tag: str | None) -> bool:
        if tag is None or self.if_match_refused:
            self._unconditional(key, parts, "gave no ETag for the object judged" if tag is None else None)
            return True
        bare = tag.strip('"')
        # RFC 7232 quotes an entity tag; Ceph RGW matches only the bare one. A version
        # that changed matches neither form, so trying both adds no window.
        refusal = None
        for form in (bare, f'"{bare}"'):
            try:
                self._obstore.put(self.raw, key, list(parts), mode={"e_tag": form}, use_multipart=False)
                return True
            except (self._exc.PreconditionError, self._exc.AlreadyExistsError):
                continue  # 412, or 409 ConditionalRequestConflict: another write won
            except FileNotFoundError:
                return False  # removed since it was read
            except Exception as exc:
                if (refusal := conditional_put_refusal(str(exc))) is None:
                    raise self._error(exc) from None
        if refusal is None:
            return False
        self.if_match_refused = True
        self._unconditional(key, parts, f"refused a conditional PUT (If-Match) as unsupported ({refusal})")
        return True

    def _unconditional(self, key: str, parts: Sequence[Buffer], why: str | None) -> None:
        """The plain PUT of a replacement that cannot name the version judged, logged once."""
        if why is not None and not self._warned_unconditional:
            self._warned_unconditional = True
            logger.warning(
                "shared tier: %s %s; an object proven bad is replaced with a plain PUT, which may overwrite "
                "a copy another node wrote meanwhile",
                self.config.where(),
                why,
            )
        self.put(key, parts)

    def get(self, key: str, size: int | None = None, limit: int | None = None) -> Buffer | None:
        found = self.get_tagged(key, size, limit)
        return None if found is None else found.data

    def get_tagged(self, key: str, size: int | None = None, limit: int | None = None) -> Tagged | None:
        try:
            result = self._obstore.get(self.raw, key)
            actual = int(result.meta["size"])
            tag = result.meta.get("e_tag")
            if size is not None and actual != size:
                raise WrongSize(actual, size, tag=tag)
            if limit is not None and actual > limit:
                raise WrongSize(actual, limit, limit=True, tag=tag)
            return Tagged(result.bytes(), tag)
        except WrongSize:
            raise
        except FileNotFoundError as exc:
            if "NoSuchBucket" in str(exc):
                raise BucketMissing("NoSuchBucket") from None
            return None
        except Exception as exc:
            raise self._error(exc) from None

    def stream(self, key: str, chunk_bytes: int = 8 << 20) -> tuple[int, Iterator[memoryview], str | None] | None:
        """The object's size, its body in chunks of about ``chunk_bytes`` (one in memory
        at a time) and its ETag, or None when there is none (for the operator's
        verification of objects of any size; the serving path reads whole objects of a
        known size)."""
        try:
            result = self._obstore.get(self.raw, key)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._error(exc) from None

        def body() -> Iterator[memoryview]:
            try:
                for piece in result.stream(min_chunk_size=chunk_bytes):
                    yield memoryview(piece)
            except Exception as exc:
                raise self._error(exc) from None

        return int(result.meta["size"]), body(), result.meta.get("e_tag")

    def etag(self, key: str) -> str | None:
        """The object's ETag now (HEAD), or None when there is none."""
        try:
            return self._obstore.head(self.raw, key).get("e_tag") or ""
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._error(exc) from None

    def exists(self, key: str) -> bool:
        try:
            self._obstore.head(self.raw, key)
        except FileNotFoundError:
            return False  # HEAD has no body: a missing bucket reads as a missing object
        except Exception as exc:
            raise self._error(exc) from None
        return True

    def delete(self, key: str) -> None:
        try:
            self._obstore.delete(self.raw, key)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._error(exc) from None

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        try:
            for batch in self._obstore.list(self.raw, prefix=prefix):
                for meta in batch:
                    yield meta["path"], int(meta["size"])
        except Exception as exc:
            raise self._error(exc) from None

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` with its size and last-modified time, in pages of
        1000 keys (for the operator's inspector; the serving path never lists)."""
        try:
            for batch in self._obstore.list(self.raw, prefix=prefix, chunk_size=1000):
                for meta in batch:
                    yield ObjectInfo(meta["path"], int(meta["size"]), meta["last_modified"].timestamp())
        except Exception as exc:
            raise self._error(exc) from None

    def close(self) -> None:
        """Nothing to release: obstore drops its connections with the store object."""

    def __enter__(self) -> S3Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:  # for the type checker only: the store takes this client as an ``ObjectClient``

    def _as_object_client(client: S3Client) -> ObjectClient:
        return client
