"""The shared tier's block store: futures over verified, write-once S3 objects.

Runs in each worker process (uploads of its rank's block bytes, downloads into its CPU
slots) and in the scheduler process (batched membership probes for ``membership``).
All object-store I/O happens on the store's own thread pool of ``max_connections``
threads, one blocking request each, so the caller never waits on the network: every
call validates its arguments, queues the requests and returns a
``concurrent.futures.Future`` at once.

What durable means here: a block's object is in the bucket once its PUT returned
(``PutOutcome.STORED``) or a write-once PUT found it there (``PRESENT``). A reader learns
of other nodes' blocks only through the bucket (``exists``, ``get_blocks``); no other
channel exists.

Writes are write-once (``write_once``: how, and why its fallback keeps these
guarantees): each object is one PUT, visible whole or not at all, carrying
``If-None-Match: *`` where the server honours it; under ``conditional_put`` ``auto`` a
server that refuses the condition as unsupported gets a HEAD and a plain PUT instead
(counted: ``conditional_put_refused``, ``puts_unconditional``).

Faults never raise out of ``put_blocks`` / ``get_blocks`` / ``exists``: a server that is
down, slow or hung (a read or probe is a miss once ``(retries + 1) x request_timeout +
connect_timeout`` has passed since it was asked, whatever the backend's own bounds: a
Mooncake transfer's is about 30 s), throttling (503 SlowDown) or refusing turns into ``FAILED`` uploads, misses and
unknown membership, logged (rate-limited) and counted in ``stats()``. After
``failure_threshold`` consecutive transient failures the store stops sending for
``unavailable_cooldown`` and answers at once (``DROPPED`` uploads, misses): failed reads
stop reads and uploads, failed uploads only uploads (a refusing or full server must not
cost the loads of hits just verified). A block
whose object fails any check of ``object_format`` (foreign fingerprint, other block,
other size, a tag that does not verify, damaged bytes, a key this node lacks) is a
counted miss and nothing of it stays in the caller's buffer (a sealed object is
decrypted into it, and the buffer zeroed when the tag then fails).

What a node may do to an object is decided by what it can prove (``Rejected.provable``):
an object proven bad (a tag or checksum that fails under a key this node holds,
another block's object copied to this key, a malformed one) is deleted when read, and
replaced when a write finds it, the replacement counted (``forgeries_replaced``) only
once it reads back verified. An object this node cannot judge (sealed under a key id
it does not hold, sealed where it has no key, a newer format) is left in place and
counted (``kept_unproven``): a member with the wrong key, a retired key or none never
deletes or replaces what the fleet wrote.

Objects are sealed (AES-256-GCM under the fleet key, ``keys``, on the store's threads)
unless the config declares the bucket trusted and names no key; with neither, the
constructor raises a ``ConfigError`` naming ``remote.key_file`` / ``remote.key_env``.
Plain objects live under a namespace of their own (``object_format.namespace_prefix``),
so sealed and plain fleets never meet. ``fingerprint.json`` is information, never a gate.
Wrong credentials or a missing bucket are a ``RemoteSetupError`` from the
constructor's start-up check, naming the endpoint and the bucket.

A store is opened in the process that uses it, after any fork (obstore's runtime
and connections do not survive one), e.g. by each worker from the shared config.

Memory: uploads hold at most ``max_pending_upload_bytes`` of accepted blocks (a block
past the bound is ``DROPPED`` at once), plus one object body per connection; downloads
write into the caller's buffers, with one object body per connection in flight, or one
batch (``GET_BATCH_BYTES``) where the client reads many objects a request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from tiered_kv.abstract import BlockHash
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.remote.store.client import (
    BatchGet,
    BatchProbe,
    Buffer,
    ObjectClient,
    Tagged,
    Unavailable,
    WrongSize,
)
from tiered_kv.metrics import Latencies
from tiered_kv.remote.store.backends import open_client
from tiered_kv.remote.store.fetch import fetch_object
from tiered_kv.remote.config import MAX_KEY_HASH_BYTES, RemoteConfig
from tiered_kv.remote.store.health import FaultLog, Health
from tiered_kv.remote.format.keys import Keyring, load_keyring
from tiered_kv.remote.store.timed_client import TimedClient
from tiered_kv.remote.store.startup import check_namespace
from tiered_kv.remote.store.write_once import WriteOnce
from tiered_kv.remote.store.futures import (
    Claim,
    Deadlines,
    chain,
    done_future,
    gather,
    present_per_block,
    split_batches,
)
from tiered_kv.remote.store.outcomes import GetItem, PutItem, PutOutcome, RemoteStats, byte_views
from tiered_kv.remote.format.object_format import (
    Rejected,
    block_key,
    encode_header,
    fingerprint_digest,
    namespace_prefix,
    object_size,
    pieces_checksum,
    seal,
    verified_payload,
    verify_into,
)

logger = logging.getLogger(__name__)

#: Keys one existence request asks at most where the client answers many (``BatchProbe``).
PROBE_BATCH = 1024
#: Objects and bytes one read request moves at most where the client sends many (``BatchGet``).
GET_BATCH = 64
GET_BATCH_BYTES = 16 << 20

T = TypeVar("T")
#: A block to read: its hash, its rank and the caller's buffer pieces.
_Read = tuple[bytes, int, list[memoryview]]


class RemoteStore:
    """Blocks of one namespace (``fingerprint``) in ``config``'s bucket. A context manager.

    ``client`` replaces the client of ``config.backend`` (an ``ObjectClient``);
    ``check=False`` skips the start-up check (for tools that only read). ``keyring``
    replaces the config's keys (``keys.load_keyring``: None only for a trusted bucket).
    """

    def __init__(
        self,
        config: RemoteConfig,
        fingerprint: Fingerprint,
        *,
        client: ObjectClient | None = None,
        check: bool = True,
        keyring: Keyring | None | bool = True,
    ):
        self.config = config
        self.keyring: Keyring | None = load_keyring(config) if keyring is True else keyring or None
        if keyring is None and not config.trusted_bucket:
            raise ValueError("RemoteStore: keyring None (no encryption) needs remote.trusted_bucket")
        if config.plaintext_endpoint():
            logger.warning(
                "shared tier: %s is plain http to another host: requests, and the object keys (block "
                "hashes) in them, cross the network unencrypted%s; use https (remote.ca_bundle for a private CA)",
                config.endpoint,
                "" if self.keyring is not None else ", and so does the KV itself (no key)",
            )
        self.fingerprint = fingerprint
        self.tp_size = fingerprint.tp_size
        self.namespace = namespace_prefix(config.prefix, fingerprint, sealed=self.keyring is not None)
        self._digest = fingerprint_digest(fingerprint)
        self._checksum = pieces_checksum(config.checksum)
        #: Each request's seconds, for an exporter to drain (``tiered_kv.metrics``).
        self.latencies = Latencies()
        inner = client if client is not None else open_client(config)
        #: Keys one existence request asks: many where the server answers them at once.
        self._probe_batch = PROBE_BATCH if isinstance(inner, BatchProbe) else 1
        #: Bytes one read request moves at most where the server sends many objects (else 0).
        self._get_batch_bytes = min(GET_BATCH_BYTES, config.mooncake_buffer_bytes) if isinstance(inner, BatchGet) else 0
        self._client = TimedClient(inner, self.latencies)
        self._writer = WriteOnce(self._client, config)
        self._lock = threading.Lock()
        self._stats = RemoteStats()
        self._pending_bytes = 0
        self._closed = False
        self._log = FaultLog(config.where())
        # Reads stop only on failed reads: failed uploads (a full Mooncake pool, slow PUTs)
        # must not skip the load of a hit the scheduler has just verified. Uploads stop on
        # either: a server that does not answer reads will not take writes.
        self._read_health = Health(config.failure_threshold, config.unavailable_cooldown, self._went_unavailable)
        self._put_health = Health(config.failure_threshold, config.unavailable_cooldown, self._went_unavailable)
        self._pool = ThreadPoolExecutor(config.max_connections, thread_name_prefix="tkv-remote")
        # Reads and probes answer within what S3's own bounds allow (every attempt), even
        # where the backend's are longer (Mooncake's transfer timeout, about 30 s).
        self._deadlines = Deadlines((config.retries + 1) * config.request_timeout + config.connect_timeout)
        self.reachable = True
        if check:
            try:
                self.reachable = check_namespace(
                    config, fingerprint, self.keyring is not None, self._writer, self._client
                )
            except BaseException:
                self.close()
                raise

    # -- writes -----------------------------------------------------------------------

    def put_blocks(self, blocks: Sequence[PutItem], *, copy: bool = False) -> Future[list[PutOutcome]]:
        """Upload each ``(block hash, rank, bytes)``; one ``PutOutcome`` per block, in order.

        The caller keeps the bytes unchanged until the future is done, unless ``copy``
        (then they are copied now, and count against the pending-upload bound until sent).
        """
        items = [self._put_item(i, b) for i, b in enumerate(blocks)]
        with self._lock:
            self._check_open()
        futures = []
        for block_hash, rank, views in items:
            size = sum(len(v) for v in views)
            with self._lock:
                # One block larger than the bound still goes when nothing else is pending.
                admit = self._pending_bytes + size <= self.config.max_pending_upload_bytes or not self._pending_bytes
                if admit and self._writable():
                    self._pending_bytes += size
                else:
                    self._stats.puts_dropped += 1
                    futures.append(done_future(PutOutcome.DROPPED))
                    continue
            if copy:
                views = [memoryview(b"".join(views))]
            futures.append(self._pool.submit(self._put_one, block_hash, rank, views, size))
        return gather(futures)

    def _put_item(self, i: int, block: Any) -> tuple[bytes, int, list[memoryview]]:
        try:
            block_hash, rank, data = block
        except (TypeError, ValueError):
            raise TypeError(f"put_blocks[{i}]: expected (block_hash, rank, bytes), got {block!r:.80}") from None
        return self._key_parts(i, "put_blocks", block_hash, rank) + (byte_views(data, f"put_blocks[{i}]", False),)

    def _key_parts(self, i: int, call: str, block_hash: Any, rank: Any) -> tuple[bytes, int]:
        if not isinstance(block_hash, (bytes, bytearray)) or not block_hash:
            raise TypeError(f"{call}[{i}]: block hash must be non-empty bytes, got {block_hash!r:.80}")
        if len(block_hash) > MAX_KEY_HASH_BYTES:
            raise ValueError(f"{call}[{i}]: block hash of {len(block_hash)} bytes, at most {MAX_KEY_HASH_BYTES}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise ValueError(
                f"{call}[{i}]: rank must be in 0..{self.tp_size - 1} (tp_size {self.tp_size}), got {rank!r}"
            )
        return bytes(block_hash), rank

    def _put_one(self, block_hash: bytes, rank: int, views: list[memoryview], size: int) -> PutOutcome:
        try:
            if not self._writable():
                with self._lock:
                    self._stats.puts_dropped += 1
                return PutOutcome.DROPPED
            key = block_key(self.namespace, block_hash, rank)
            if self.keyring is not None:
                parts = seal(self.keyring, self._digest, block_hash, rank, views)
            else:
                header = encode_header(self._digest, block_hash, rank, views, self.config.checksum, self._checksum)
                parts = [header, *views]
            if self._writer.put(key, parts):
                outcome = PutOutcome.STORED
            else:
                outcome = self._replace_if_bad(key, block_hash, rank, size, parts)
            self._put_health.success()
            with self._lock:
                if outcome is PutOutcome.STORED:
                    self._stats.puts_stored += 1
                    self._stats.put_bytes += size
                elif outcome is PutOutcome.PRESENT:
                    self._stats.puts_present += 1
                else:
                    self._stats.puts_failed += 1
            return outcome
        except Exception as exc:
            self._log.request_failed(exc, "upload failed", self._put_health)
            with self._lock:
                self._stats.puts_failed += 1
            return PutOutcome.FAILED
        finally:
            with self._lock:
                self._pending_bytes -= size

    def _replace_if_bad(self, key: str, block_hash: bytes, rank: int, size: int, parts: list) -> PutOutcome:
        """The write found ``key`` taken. The object there stays unless this node proves
        it bad (``Rejected.provable``): ``PRESENT``. Else that version, and only that one
        (``ObjectClient.replace``: another node may have replaced it meanwhile), is
        replaced, and the replacement counts once it reads back verified (``STORED``); an
        object still bad after the write (a store that keeps a key's first value, or a
        forger racing) is a ``FAILED`` upload, one written by another node meanwhile is
        judged anew, once."""
        found, tag = self._judge(key, block_hash, rank, size, writing=True)
        if found is None:
            return PutOutcome.PRESENT
        if not found.provable:  # an honest member may have written it: not ours to judge
            with self._lock:
                self._stats.kept_unproven += 1
            return PutOutcome.PRESENT
        if not self._client.replace(key, parts, tag):
            now, _ = self._judge(key, block_hash, rank, size, writing=True)
            if now is None:  # a good copy, or none (a reader deleted the bad one): write-once
                return PutOutcome.STORED if self._writer.put(key, parts) else PutOutcome.PRESENT
            if not now.provable:
                with self._lock:
                    self._stats.kept_unproven += 1
                return PutOutcome.PRESENT
            self._log("replacing an object failed", f"{key}: replaced meanwhile by another bad one ({now.reason})")
            return PutOutcome.FAILED
        after, _ = self._judge(key, block_hash, rank, size, writing=True)
        if after is not None:
            self._log("replacing an object failed", f"{key}: still {after.reason} after the replacing write")
            return PutOutcome.FAILED
        with self._lock:
            self._stats.forgeries_replaced += 1
        self._log("object replaced", f"{key}: the object there did not verify ({found.reason})")
        return PutOutcome.STORED

    def _judge(
        self, key: str, block_hash: bytes, rank: int, size: int, writing: bool = False
    ) -> tuple[Rejected | None, str | None]:
        """Why the object at ``key`` would not be served for this block, or None when it
        would or is absent (a node deleted it, and whoever stores it next is honest or is
        checked), with the tag of the version judged. Of another size than a writer's own
        block's bytes, the object is provably not this block's (``_fetch``)."""
        tag = None
        try:
            found = self._fetch(key, block_hash, size, writing)
            if found is None:
                return None, None
            tag = found.tag
            verified_payload(
                memoryview(found.data),
                fingerprint=self._digest,
                block_hash=block_hash,
                rank=rank,
                size=size,
                keyring=self.keyring,
            )
        except Rejected as rejected:
            return rejected, tag if rejected.tag is None else rejected.tag
        return None, tag

    def _fetch(self, key: str, block_hash: bytes, size: int, writing: bool) -> Tagged | None:
        """``fetch.fetch_object`` for a block of ``size`` bytes."""
        expected = object_size(self.keyring is not None, len(block_hash), size)
        return fetch_object(self._client, key, expected, self.keyring is not None, writing)

    # -- reads ------------------------------------------------------------------------

    def get_blocks(self, blocks: Sequence[GetItem]) -> Future[list[bool]]:
        """Download each ``(block hash, rank, buffer or pieces)`` into its bytes, whose
        size is the block's. One bool per block: True when they now hold the verified
        bytes; on False they hold nothing of the object (untouched, or zeroed). Where the
        client sends many objects a request (``BatchGet``), up to ``GET_BATCH`` objects
        and ``GET_BATCH_BYTES`` go in one, under one deadline."""
        items: list[_Read] = []
        for i, block in enumerate(blocks):
            try:
                block_hash, rank, buf = block
            except (TypeError, ValueError):
                raise TypeError(f"get_blocks[{i}]: expected (block_hash, rank, buffer), got {block!r:.80}") from None
            items.append(
                self._key_parts(i, "get_blocks", block_hash, rank) + (byte_views(buf, f"get_blocks[{i}]", True),)
            )
        with self._lock:
            self._check_open()
        if not self._get_batch_bytes:
            return gather([self._read_alone(item) for item in items])
        sizes = [self._object_bytes(item) for item in items]
        batches = split_batches(items, sizes, GET_BATCH, self._get_batch_bytes)
        return gather([answer for batch in batches for answer in self._read_batch(batch)])

    def _object_bytes(self, item: _Read) -> int:
        return object_size(self.keyring is not None, len(item[0]), sum(len(d) for d in item[2]))

    def _read_alone(self, item: _Read) -> Future:
        late = partial(self._late, what="download", answer=False)
        return self._deadlines.submit(self._pool, self._get_one, *item, on_expiry=late)

    def _read_batch(self, batch: list[_Read]) -> list[Future]:
        """One future per block of ``batch``, read in one request; an object of another
        size than its block's is read again alone, to be judged (``_get_one``)."""
        answers: list[Future] = [Future() for _ in batch]

        def settle(read: Future) -> None:
            if read.exception() is not None:  # a bug in the read: each block's future says so
                for answer in answers:
                    answer.set_exception(read.exception())
                return
            for item, answer, ok in zip(batch, answers, read.result()):
                if ok is not None:
                    answer.set_result(ok)
                    continue
                try:
                    chain(self._read_alone(item), answer)
                except RuntimeError:  # closed meanwhile: the pool takes no more requests
                    answer.set_result(False)

        late = partial(self._late, what="download", count=len(batch), answer=[False] * len(batch))
        self._deadlines.submit(self._pool, self._get_some, batch, on_expiry=late).add_done_callback(settle)
        return answers

    def _get_some(self, claim: Claim, batch: list[_Read]) -> list[bool | None]:
        """``_get_one`` for each block of ``batch``, in one request (``BatchGet``); None
        for a block whose object is of another size."""
        missed: list[bool | None] = [False] * len(batch)
        if not self._read_health.available():
            with self._lock:
                self._stats.gets_skipped += len(batch)
            return missed
        keys = [block_key(self.namespace, block_hash, rank) for block_hash, rank, _ in batch]
        try:
            found: list[Any] = self._client.get_many(keys, [self._object_bytes(item) for item in batch])
        except Exception as exc:
            found = [exc] * len(batch)
        if not claim.take():  # answered past the deadline: settled as failed, the buffers are not ours
            return missed
        failed = [f for f in found if isinstance(f, Exception) and not isinstance(f, WrongSize)]
        if failed:
            self._log.request_failed(failed[0], "download failed", self._read_health)
            with self._lock:
                self._stats.gets_failed += len(failed)
        else:
            self._read_health.success()
        return [  # None: another size, judged alone; False: failed, counted above
            None if isinstance(d, WrongSize) else False if isinstance(d, Exception) else self._land(k, *i, d)
            for k, i, d in zip(keys, batch, found)
        ]

    def _get_one(self, claim: Claim, block_hash: bytes, rank: int, dest: list[memoryview]) -> bool:
        if not self._read_health.available():
            with self._lock:
                self._stats.gets_skipped += 1
            return False
        key = block_key(self.namespace, block_hash, rank)
        try:
            found = self._fetch(key, block_hash, sum(len(d) for d in dest), writing=False)
        except Rejected as rejected:  # the server answered
            if not claim.take():
                return False
            self._read_health.success()
            return self._rejected(key, rejected)
        except Exception as exc:
            if claim.take():
                self._log.request_failed(exc, "download failed", self._read_health)
                with self._lock:
                    self._stats.gets_failed += 1
            return False
        if not claim.take():  # answered past the deadline: settled as failed, the buffer is not ours
            return False
        self._read_health.success()
        return self._land(key, block_hash, rank, dest, None if found is None else found.data)

    def _land(self, key: str, block_hash: bytes, rank: int, dest: list[memoryview], data: Buffer | None) -> bool:
        """Verify the object read at ``key`` (None: absent) into ``dest``; count the outcome."""
        if data is None:
            with self._lock:
                self._stats.gets_absent += 1
            return False
        try:
            verify_into(
                memoryview(data), dest, fingerprint=self._digest, block_hash=block_hash, rank=rank, keyring=self.keyring
            )
        except Rejected as rejected:
            return self._rejected(key, rejected)
        except Exception as exc:  # not the object's doing: a bug, logged with its traceback
            self._log.request_failed(exc, "download failed", self._read_health)
            with self._lock:
                self._stats.gets_failed += 1
            return False
        with self._lock:
            self._stats.gets_hit += 1
            self._stats.get_bytes += sum(len(d) for d in dest)
        return True

    def _rejected(self, key: str, rejected: Rejected) -> bool:
        """A read object that fails a check: counted, and deleted where proven bad. False."""
        self._log(f"object rejected ({rejected.reason})", f"{key}: {rejected.detail}")
        with self._lock:
            self._stats.rejected[rejected.reason] += 1
        if rejected.provable:
            self._delete_damaged(key)
        else:
            with self._lock:
                self._stats.kept_unproven += 1
        return False

    def _delete_damaged(self, key: str) -> None:
        """An object proven bad would stay a miss for every node (writes are write-once):
        delete it so the next node that computes the block stores it again."""
        try:
            self._client.delete(key)
        except Exception as exc:
            self._log("deleting a damaged object failed", f"{key}: {exc}")
            return
        with self._lock:
            self._stats.damaged_deleted += 1

    # -- membership -------------------------------------------------------------------

    def exists(
        self, block_hashes: Sequence[BlockHash], ranks: Sequence[int] | None = None
    ) -> Future[list[bool | None]]:
        """Whether the bucket holds each block: True when every rank's object is there
        (``ranks``: all of the fingerprint's by default), False when one is missing,
        None when the server did not say. One request per block and rank (HEAD), or per
        ``PROBE_BATCH`` of them where the client answers many at once (``BatchProbe``)."""
        ranks = list(range(self.tp_size)) if ranks is None else list(ranks)
        if not ranks:
            raise ValueError("exists: ranks must name at least one rank (None means all of them)")
        keyed = [self._key_parts(i, "exists", h, r) for i, h in enumerate(block_hashes) for r in ranks]
        with self._lock:
            self._check_open()
        batches = [keyed[i : i + self._probe_batch] for i in range(0, len(keyed), self._probe_batch)]
        late = partial(self._late, what="existence probe")
        submit = partial(self._deadlines.submit, self._pool, self._exists_some)
        probes = [submit(b, on_expiry=partial(late, count=len(b), answer=[None] * len(b))) for b in batches]
        return gather(probes, partial(present_per_block, ranks=len(ranks)))

    def _exists_some(self, claim: Claim, keyed: list[tuple[bytes, int]]) -> list[bool | None]:
        unknown: list[bool | None] = [None] * len(keyed)
        if not self._read_health.available():
            with self._lock:
                self._stats.probes_failed += len(keyed)
            return unknown
        keys = [block_key(self.namespace, h, r) for h, r in keyed]
        try:
            found = self._client.exists_many(keys) if self._probe_batch > 1 else [self._client.exists(keys[0])]
            if not claim.take():
                return unknown
            self._read_health.success()
        except Exception as exc:
            if claim.take():
                self._log.request_failed(exc, "existence probe failed", self._read_health)
                with self._lock:
                    self._stats.probes_failed += len(keyed)
            return unknown
        with self._lock:
            self._stats.probes += len(keyed)
        return list(found)

    # -- faults, stats, life cycle -----------------------------------------------------

    def _late(self, claim: Claim, what: str, count: int = 1, answer: T = None) -> T:  # type: ignore[assignment]
        """A read or probe of ``count`` objects unanswered by its deadline: failed (``answer``),
        and a failure of the server where it was sent (not where it waited for a connection)."""
        counter = "gets_failed" if what == "download" else "probes_failed"
        with self._lock:
            setattr(self._stats, counter, getattr(self._stats, counter) + count)
        if claim.started:
            why = Unavailable(f"no answer within {self._deadlines.seconds:g} s")
            self._log.request_failed(why, f"{what} timed out", self._read_health)
        return answer

    def _writable(self) -> bool:
        return self._read_health.available() and self._put_health.available()

    def _went_unavailable(self, failures: int) -> None:
        with self._lock:
            self._stats.unavailable_periods += 1
        logger.warning(
            "shared tier: %s failed %d requests in a row; not sending for %.1fs",
            self.config.where(),
            failures,
            self.config.unavailable_cooldown,
        )

    def stats(self) -> RemoteStats:
        """A copy of the counters."""
        with self._lock:
            s = self._stats
            return RemoteStats(
                **{
                    **s.__dict__,
                    "rejected": dict(s.rejected),
                    "conditional_put_refused": self._writer.refused,
                    "puts_unconditional": self._writer.unconditional,
                }
            )

    @property
    def conditional_put(self) -> bool:
        """Whether writes send ``If-None-Match: *`` now (False after a refusal under
        ``auto``, and under ``never``)."""
        return self._writer.conditional

    @property
    def pending_upload_bytes(self) -> int:
        return self._pending_bytes

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RemoteStore is closed")

    def close(self, wait: bool = True) -> None:
        """Stop accepting calls; with ``wait``, let queued requests finish (each bounded
        by the request timeout, or answered at once while the server is unavailable)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait)
        self._deadlines.close()
        self._client.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
