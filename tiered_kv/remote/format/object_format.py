"""Object keys and the self-describing object format of the shared tier.

Pure functions, no I/O; used by every process that reads or writes the tier.

One object per block and tensor-parallel rank::

    <prefix>/<namespace id>/<fan-out>/<block hash hex>-r<rank>

``namespace id`` is ``Fingerprint.namespace_id`` (the disk tier's directory name for
the same fingerprint), so an operator finds a model's blocks under one key prefix and a
lifecycle rule can target it. ``fan-out`` is two hex digits of the xxh3 of the block
hash, spreading keys over 256 prefixes (S3 scales request rates per prefix) whatever
the hash looks like. Beside the blocks, ``<prefix>/<namespace id>/fingerprint.json``
holds the fingerprint's canonical JSON, written once, for inspection. Plain objects
(below) live under ``<prefix>/<namespace id>.plain/``: a plain fleet and a sealed one
never write the same key.

Every ``Rejected`` says whether it proves the object bad (``provable``): what a member
may delete or replace is only what it proved, never what it could not open.

An object is sealed (format 2, the default: a fleet key is set) or plain (format 1,
only under ``remote.trusted_bucket`` with no key). A sealed object is a fixed header,
the block hash, the payload encrypted with AES-256-GCM (``tiered_kv.remote.format.keys``), then
the 16-byte tag::

    magic        8s   b"TKVBLOCK"
    version      u16  FORMAT_SEALED (2)
    header_len   u16  bytes before the payload (fixed part + block hash)
    rank         u16
    hash_len     u16
    fingerprint  32s  SHA-256 of the fingerprint's canonical JSON (all of it, not the id)
    key_id       u32  which fleet key sealed it
    nonce        12s  random per object
    payload_len  u64  bytes of plaintext (= of ciphertext)

The associated data is the whole header, block hash included: a reader that holds the
key serves the payload only when the tag verifies over what it expects (its own
fingerprint digest, the block hash and rank it asked for, its buffer's size), so a
patched header, another block's object copied to this key, a payload written without
the key and damaged bytes all fail alike (``auth``). Without the key, the bytes in the
bucket say nothing of the K/V they hold.

A plain object is a fixed header, the block hash, then the payload (the rank's block bytes)::

    magic        8s   b"TKVBLOCK"
    version      u16  FORMAT_PLAIN (1)
    header_len   u16  bytes before the payload (fixed part + block hash)
    rank         u16
    hash_len     u16
    fingerprint  32s  SHA-256 of the fingerprint's canonical JSON (all of it, not the id)
    checksum     8s   name, ASCII, NUL-padded ("xxh3_64", "crc32c")
    check value  u64  that checksum of the payload
    payload_len  u64

little-endian. A reader serves the payload only when every field matches what it
expects (its own fingerprint digest, the block hash and rank it asked for, the size of
its buffer), the object is exactly ``header_len + payload_len`` bytes, and the payload's
checksum matches; anything else is a ``Rejected`` with the reason, which the store
counts as a miss. A plain object's checks stop accidents, not a writer: anyone who can
write the bucket can write a plain object that passes them. The fingerprint digest guards against namespace-id collisions and
against objects copied between prefixes; the checksum against torn or damaged bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from tiered_kv.abstract import BlockHash
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.checksums import checksum_function
from tiered_kv.remote.format.keys import NONCE_BYTES, TAG_BYTES, AuthenticationFailed, Keyring, new_nonce

MAGIC = b"TKVBLOCK"
FORMAT_PLAIN = 1
FORMAT_SEALED = 2
#: The version of ``fingerprint.json`` records (the newest object format).
FORMAT_VERSION = FORMAT_SEALED
_FIXED = struct.Struct("<8sHHHH32s8sQQ")
FIXED_HEADER_BYTES = _FIXED.size
_SEALED = struct.Struct("<8sHHHH32sI12sQ")
SEALED_HEADER_BYTES = _SEALED.size
#: Longest block hash a header holds (vLLM's are 32 bytes, or 8 with xxhash).
MAX_HASH_BYTES = 1024
MANIFEST_NAME = "fingerprint.json"


class Rejected(Exception):
    """An object that must not be served. ``reason`` is one of ``REJECT_REASONS``.

    ``provable``: whether the reader proved the object is no honest object of the key it
    lies at, so that it may delete or replace it (``may_remove``). An honest fleet member
    may write what this reader cannot judge: an object sealed under a key id the reader
    does not hold (a rotation in progress, or a reader with the wrong key), any sealed
    object when the reader has no key, a newer format version, a checksum this node
    cannot compute. Those are kept, whatever else their header says, so that a member
    with the wrong key, an old key or none never destroys what the fleet wrote."""

    def __init__(self, reason: str, detail: str, *, provable: bool, tag: str | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.provable = provable
        #: The store's tag of the version judged, where it gave one (``ObjectClient.replace``).
        self.tag = tag


#: ``format``: not an object of this format (magic, version, lengths);
#: ``foreign``: another fingerprint's object; ``mismatch``: another block or rank;
#: ``size``: an object or payload of another size than the reader's buffer implies
#: (such an object is not even downloaded); ``checksum``: damaged bytes (plain objects);
#: ``auth``: a sealed object whose tag fails (forged, patched, copied or damaged), or a
#: plain object where the tier is keyed; ``key``: sealed under a key this node lacks, or
#: sealed where this node has none; ``version``: a format version newer than this node's.
REJECT_REASONS = ("format", "foreign", "mismatch", "size", "checksum", "auth", "key", "version")


def fingerprint_digest(fingerprint: Fingerprint) -> bytes:
    """The full SHA-256 (32 bytes) of the fingerprint's canonical JSON."""
    return hashlib.sha256(fingerprint.canonical_json().encode()).digest()


#: What a plain namespace's directory adds to the namespace id (``namespace_prefix``).
PLAIN_SUFFIX = ".plain"


def namespace_prefix(prefix: str, fingerprint: Fingerprint, sealed: bool = True) -> str:
    """``<prefix>/<namespace id>``: every sealed object of one fingerprint lies under it;
    plain objects (a trusted bucket, no key) under ``<prefix>/<namespace id>.plain``. The
    two never share a key, so a node of one trust mode never finds, judges, replaces or
    deletes an object of the other (``check_version``)."""
    return f"{prefix}/{fingerprint.namespace_id}{'' if sealed else PLAIN_SUFFIX}"


def manifest_key(prefix: str, fingerprint: Fingerprint, sealed: bool = True) -> str:
    return f"{namespace_prefix(prefix, fingerprint, sealed)}/{MANIFEST_NAME}"


def fan_out(block_hash: BlockHash) -> str:
    return f"{xxhash.xxh3_64_intdigest(block_hash) & 0xFF:02x}"


def block_key(ns_prefix: str, block_hash: BlockHash, rank: int) -> str:
    """The object key of ``rank``'s shard of ``block_hash`` under ``ns_prefix``."""
    return f"{ns_prefix}/{fan_out(block_hash)}/{block_hash.hex()}-r{rank}"


def _checksum_name_field(name: str) -> bytes:
    raw = name.encode("ascii")
    if len(raw) > 8:
        raise ValueError(f"checksum name {name!r} is longer than 8 bytes")
    return raw.ljust(8, b"\0")


def _check_fields(fingerprint: bytes, block_hash: BlockHash, rank: int) -> None:
    """What every header binds must fit its fields; raises ``ValueError`` naming the value."""
    if len(fingerprint) != 32:
        raise ValueError(f"fingerprint digest must be 32 bytes, got {len(fingerprint)}")
    if not 0 < len(block_hash) <= MAX_HASH_BYTES:
        raise ValueError(f"block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(block_hash)}")
    if not 0 <= rank < 1 << 16:
        raise ValueError(f"rank must be in 0..65535, got {rank}")


@dataclass(frozen=True)
class BlockHeader:
    """The header of one stored block (see the module docstring for the layout)."""

    fingerprint: bytes
    block_hash: BlockHash
    rank: int
    checksum_name: str
    checksum: int
    payload_len: int

    def pack(self) -> bytes:
        _check_fields(self.fingerprint, self.block_hash, self.rank)
        return _FIXED.pack(
            MAGIC,
            FORMAT_PLAIN,
            FIXED_HEADER_BYTES + len(self.block_hash),
            self.rank,
            len(self.block_hash),
            self.fingerprint,
            _checksum_name_field(self.checksum_name),
            self.checksum,
            self.payload_len,
        ) + bytes(self.block_hash)

    @classmethod
    def unpack(cls, data: memoryview, total: int | None = None) -> BlockHeader:
        """The header at the start of ``data``, an object of ``total`` bytes (``len(data)``
        by default); ``Rejected("format")`` if there is none."""
        total = len(data) if total is None else total
        if len(data) < FIXED_HEADER_BYTES:
            raise Rejected("format", f"object of {total} bytes is shorter than a header", provable=True)
        magic, version, header_len, rank, hash_len, fp, cname, value, payload_len = _FIXED.unpack_from(data)
        if magic != MAGIC:
            raise Rejected("format", f"magic {magic!r}, expected {MAGIC!r}", provable=True)
        if version != FORMAT_PLAIN:
            raise Rejected(
                "format", f"format version {version}, expected a plain object ({FORMAT_PLAIN})", provable=True
            )
        if header_len != FIXED_HEADER_BYTES + hash_len or not 0 < hash_len <= MAX_HASH_BYTES:
            raise Rejected("format", f"header length {header_len} with a {hash_len}-byte hash", provable=True)
        if total != header_len + payload_len:
            raise Rejected(
                "format", f"object of {total} bytes, header says {header_len} + {payload_len}", provable=True
            )
        try:
            name = cname.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise Rejected("format", f"checksum name {cname!r}", provable=True) from None
        if len(data) < header_len:
            raise Rejected("format", f"object of {total} bytes is shorter than its header", provable=True)
        return cls(fp, bytes(data[FIXED_HEADER_BYTES:header_len]), rank, name, value, payload_len)

    @property
    def header_len(self) -> int:
        return FIXED_HEADER_BYTES + len(self.block_hash)


def pieces_checksum(name: str) -> Callable[[Sequence[memoryview]], int]:
    """``checksum_function(name)`` over the concatenation of byte views, hashed where
    they lie (one call for one piece; else xxh3 streamed, or crc32c continued)."""
    one = checksum_function(name)
    if name == "xxh3_64":

        def many(pieces: Sequence[memoryview]) -> int:
            h = xxhash.xxh3_64()
            for piece in pieces:
                h.update(piece)
            return h.intdigest()
    else:
        import crc32c  # checksum_function checked that it is there

        def many(pieces: Sequence[memoryview]) -> int:
            value = 0
            for piece in pieces:
                value = crc32c.crc32c(piece, value)
            return value

    return lambda pieces: one(pieces[0]) if len(pieces) == 1 else many(pieces)


def encode_header(
    fingerprint: bytes,
    block_hash: BlockHash,
    rank: int,
    pieces: Sequence[memoryview],
    checksum_name: str,
    checksum: Callable[[Sequence[memoryview]], int],
) -> bytes:
    """The header bytes that go before the payload, the concatenation of ``pieces``
    (its checksum, ``pieces_checksum(checksum_name)``, computed here)."""
    return BlockHeader(
        fingerprint, bytes(block_hash), int(rank), checksum_name, checksum(pieces), sum(len(p) for p in pieces)
    ).pack()


@dataclass(frozen=True)
class SealedHeader:
    """The header of one sealed block (see the module docstring for the layout)."""

    fingerprint: bytes
    block_hash: BlockHash
    rank: int
    key_id: int
    nonce: bytes
    payload_len: int

    def pack(self) -> bytes:
        _check_fields(self.fingerprint, self.block_hash, self.rank)
        return _SEALED.pack(
            MAGIC,
            FORMAT_SEALED,
            SEALED_HEADER_BYTES + len(self.block_hash),
            self.rank,
            len(self.block_hash),
            self.fingerprint,
            self.key_id,
            self.nonce,
            self.payload_len,
        ) + bytes(self.block_hash)

    @classmethod
    def unpack(cls, data: memoryview, total: int | None = None) -> SealedHeader:
        """The header at the start of ``data``, an object of ``total`` bytes (``len(data)``
        by default); ``Rejected("format")`` if there is none."""
        total = len(data) if total is None else total
        if len(data) < SEALED_HEADER_BYTES:
            raise Rejected("format", f"object of {total} bytes is shorter than a header", provable=True)
        magic, version, header_len, rank, hash_len, fp, key_id, nonce, payload_len = _SEALED.unpack_from(data)
        if magic != MAGIC or version != FORMAT_SEALED:
            raise Rejected(
                "format", f"magic {magic!r} version {version}, expected {MAGIC!r} {FORMAT_SEALED}", provable=True
            )
        if header_len != SEALED_HEADER_BYTES + hash_len or not 0 < hash_len <= MAX_HASH_BYTES:
            raise Rejected("format", f"header length {header_len} with a {hash_len}-byte hash", provable=True)
        if total != header_len + payload_len + TAG_BYTES:
            raise Rejected(
                "format",
                f"object of {total} bytes, header says {header_len} + {payload_len} + {TAG_BYTES}",
                provable=True,
            )
        if len(data) < header_len:
            raise Rejected("format", f"object of {total} bytes is shorter than its header", provable=True)
        return cls(fp, bytes(data[SEALED_HEADER_BYTES:header_len]), rank, key_id, nonce, payload_len)

    @property
    def header_len(self) -> int:
        return SEALED_HEADER_BYTES + len(self.block_hash)


def object_size(sealed: bool, hash_len: int, payload_len: int) -> int:
    """Bytes of the object holding a ``payload_len``-byte block under a ``hash_len``-byte hash."""
    if sealed:
        return SEALED_HEADER_BYTES + hash_len + payload_len + TAG_BYTES
    return FIXED_HEADER_BYTES + hash_len + payload_len


def format_version(data: memoryview) -> int:
    """The format version of object ``data``; ``Rejected("format")`` when it is not one."""
    if len(data) < 10 or bytes(data[:8]) != MAGIC:
        raise Rejected("format", f"no {MAGIC!r} magic at the start of a {len(data)}-byte object", provable=True)
    return int.from_bytes(data[8:10], "little")


def check_version(version: int, sealed: bool) -> None:
    """Whether a reader of a tier whose objects are ``sealed`` (or plain) may judge an
    object of ``version``: ``Rejected`` when it is not its kind. A plain object where
    objects are sealed is provably no honest one (plain objects live under another
    namespace, ``namespace_prefix``); a sealed object seen without a key, and a newer
    version, are not this reader's to judge."""
    if version > FORMAT_VERSION:
        raise Rejected(
            "version", f"format version {version}; this node reads {FORMAT_PLAIN} and {FORMAT_SEALED}", provable=False
        )
    if version not in (FORMAT_PLAIN, FORMAT_SEALED):
        raise Rejected("format", f"format version {version}", provable=True)
    if sealed and version != FORMAT_SEALED:
        raise Rejected(
            "auth", f"format {version} object, not sealed, where this tier's objects are sealed", provable=True
        )
    if not sealed and version == FORMAT_SEALED:
        raise Rejected("key", "a sealed object; this node has no key (remote.trusted_bucket)", provable=False)


def read_header(data: memoryview) -> BlockHeader | SealedHeader:
    """The header of a plain or sealed object."""
    return SealedHeader.unpack(data) if format_version(data) == FORMAT_SEALED else BlockHeader.unpack(data)


def seal(
    keyring: Keyring, fingerprint: bytes, block_hash: BlockHash, rank: int, pieces: Sequence[memoryview]
) -> list[bytes | bytearray | memoryview]:
    """The parts of the sealed object holding the concatenation of ``pieces``: header,
    ciphertext, tag (a fresh nonce; the current key)."""
    size = sum(len(p) for p in pieces)
    header = SealedHeader(fingerprint, bytes(block_hash), int(rank), keyring.current_id, new_nonce(), size).pack()
    ciphertext, tag = keyring.seal(header[16 + 32 + 4 : 16 + 32 + 4 + NONCE_BYTES], header, pieces)
    return [header, ciphertext, tag]


def _key_held(header: SealedHeader, keyring: Keyring) -> None:
    """``Rejected("key")`` (not provable) unless ``keyring`` holds the header's key id:
    checked before anything else of a sealed header, which only the tag makes evidence."""
    if not keyring.holds(header.key_id):
        raise Rejected(
            "key",
            f"sealed under key id {header.key_id:08x}; this node holds {[f'{k:08x}' for k in keyring.key_ids]}",
            provable=False,
        )


_AUTH_FAILED = "the tag does not verify: forged, patched, copied from another key, or damaged"


def _opened(
    data: memoryview, keyring: Keyring, *, fingerprint: bytes, block_hash: BlockHash, rank: int, size: int
) -> bytearray:
    header = SealedHeader.unpack(data)
    _key_held(header, keyring)
    _check_identity(header, fingerprint, block_hash, rank, size)
    end = header.header_len + header.payload_len
    try:
        return keyring.open(
            header.key_id,
            header.nonce,
            bytes(data[: header.header_len]),
            data[header.header_len : end],
            bytes(data[end:]),
        )
    except AuthenticationFailed:
        raise Rejected("auth", _AUTH_FAILED, provable=True) from None


def _check_identity(
    header: BlockHeader | SealedHeader, fingerprint: bytes, block_hash: BlockHash, rank: int, size: int
) -> None:
    """The header names this namespace, block, rank and size. A sealed header is checked
    only under a key id the reader holds (``_key_held`` first): whether its tag then
    verifies (a genuine object copied to the wrong key) or not (a forgery), the object
    is provably no honest one of this key."""
    if header.fingerprint != fingerprint:
        raise Rejected(
            "foreign",
            f"fingerprint {header.fingerprint.hex()[:16]}..., expected {fingerprint.hex()[:16]}...",
            provable=True,
        )
    if header.block_hash != block_hash or header.rank != rank:
        raise Rejected(
            "mismatch",
            f"holds block {header.block_hash.hex()} rank {header.rank}, expected {bytes(block_hash).hex()} rank {rank}",
            provable=True,
        )
    if header.payload_len != size:
        raise Rejected("size", f"payload of {header.payload_len} bytes, expected {size}", provable=True)


def _plain_checksum(header: BlockHeader, checksums: Callable[[str], Callable[[memoryview], int]]) -> Callable:
    """The checksum function a plain object names; one this node cannot compute (not
    installed here) is no evidence against the object."""
    try:
        return checksums(header.checksum_name)
    except (ValueError, RuntimeError) as exc:
        raise Rejected("format", f"checksum {header.checksum_name!r}: {exc}", provable=False) from None


def verify_into(
    data: memoryview,
    dest: Sequence[memoryview],
    *,
    fingerprint: bytes,
    block_hash: BlockHash,
    rank: int,
    keyring: Keyring | None,
) -> None:
    """``verified_payload``, its payload written into ``dest`` (pieces adding up to the
    block's size): a sealed object is decrypted there directly. On ``Rejected`` the
    pieces hold nothing of the object (untouched, or zeroed after a failed tag)."""
    size = sum(len(d) for d in dest)
    version = format_version(data)
    check_version(version, keyring is not None)
    if keyring is None:
        payload = verified_payload(data, fingerprint=fingerprint, block_hash=block_hash, rank=rank, size=size)
        at = 0
        for d in dest:
            d[:] = payload[at : at + len(d)]
            at += len(d)
        return
    header = SealedHeader.unpack(data)
    _key_held(header, keyring)
    _check_identity(header, fingerprint, block_hash, rank, size)
    end = header.header_len + header.payload_len
    try:
        keyring.open_into(
            header.key_id,
            header.nonce,
            bytes(data[: header.header_len]),
            data[header.header_len : end],
            bytes(data[end:]),
            dest,
        )
    except AuthenticationFailed:
        raise Rejected("auth", _AUTH_FAILED, provable=True) from None


def verified_payload(
    data: memoryview,
    *,
    fingerprint: bytes,
    block_hash: BlockHash,
    rank: int,
    size: int,
    keyring: Keyring | None = None,
    checksums: Callable[[str], Callable[[memoryview], int]] = checksum_function,
) -> memoryview:
    """The payload of object ``data`` once every check passed; else ``Rejected``.

    With a ``keyring`` only sealed objects are served (decrypted, once the tag verified);
    without one (a trusted bucket) only plain objects. ``checksums(name)`` gives the
    checksum function a plain object names (a writer may use another checksum than the
    reader's own setting: it does not change the bytes).
    """
    check_version(format_version(data), keyring is not None)
    if keyring is not None:
        return memoryview(_opened(data, keyring, fingerprint=fingerprint, block_hash=block_hash, rank=rank, size=size))
    header = BlockHeader.unpack(data)
    _check_identity(header, fingerprint, block_hash, rank, size)
    fn = _plain_checksum(header, checksums)
    payload = data[header.header_len :]
    if fn(payload) != header.checksum:
        raise Rejected("checksum", f"{header.checksum_name} of the payload differs from the header's", provable=True)
    return payload


def stream_header(chunks: Iterator[bytes | memoryview]) -> bytearray:
    """The first chunks of an arriving object, taken from ``chunks`` until they hold its
    whole header (as its ``header_len`` says), or until there are no more."""
    head = bytearray()
    need = 12  # magic (8 bytes), version (u16), header_len (u16): the layouts above
    for chunk in chunks:
        head += chunk
        if len(head) >= need:
            need = max(need, int.from_bytes(head[10:12], "little"))
            if len(head) >= need:
                break
    return head


def verify_stream(
    total: int,
    chunks: Iterable[bytes | memoryview],
    *,
    fingerprint: bytes | None,
    block_hash: BlockHash,
    rank: int,
    keyring: Keyring | None,
) -> BlockHeader | SealedHeader:
    """``verified_payload``'s checks over an object of ``total`` bytes that arrives in
    ``chunks``, holding one chunk at a time (an operator's verification of objects of any
    size in bounded memory); the plaintext is dropped. ``fingerprint`` None accepts the
    digest the header names. Returns the header; ``Rejected`` as ``verified_payload``."""
    it = iter(chunks)
    head = stream_header(it)
    version = format_version(memoryview(head))
    check_version(version, keyring is not None)
    header = (SealedHeader if version == FORMAT_SEALED else BlockHeader).unpack(memoryview(head), total)
    if isinstance(header, SealedHeader):
        assert keyring is not None  # check_version refused a sealed object without a keyring
        _key_held(header, keyring)
    _check_identity(header, fingerprint or header.fingerprint, block_hash, rank, header.payload_len)
    body = memoryview(head)[header.header_len :]
    if isinstance(header, SealedHeader):
        assert keyring is not None
        sink = keyring.opener(header.key_id, header.nonce, bytes(head[: header.header_len]))
        tail = bytearray()
        for piece in _chain(body, it):
            tail += piece
            if len(tail) > TAG_BYTES:
                sink.update(memoryview(tail)[: len(tail) - TAG_BYTES])
                del tail[: len(tail) - TAG_BYTES]
        try:
            sink.finalize_with_tag(bytes(tail))
        except Exception:
            raise Rejected("auth", _AUTH_FAILED, provable=True) from None
        return header
    _plain_checksum(header, checksum_function)  # the name is known, and crc32c importable
    streamed = xxhash.xxh3_64() if header.checksum_name == "xxh3_64" else None
    value = 0
    for piece in _chain(body, it):
        if streamed is not None:
            streamed.update(piece)
        else:  # crc32c (checked above that it is there), continued piece by piece
            import crc32c

            value = crc32c.crc32c(piece, value)
    if (streamed.intdigest() if streamed is not None else value) != header.checksum:
        raise Rejected("checksum", f"{header.checksum_name} of the payload differs from the header's", provable=True)
    return header


def _chain(first: memoryview, rest: Iterator[bytes | memoryview]) -> Iterator[memoryview]:
    if len(first):
        yield first
    for piece in rest:
        yield memoryview(piece)
