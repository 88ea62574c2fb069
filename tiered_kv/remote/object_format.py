"""Object keys and the self-describing object format of the shared tier.

Pure functions, no I/O; used by every process that reads or writes the tier.

One object per block and tensor-parallel rank::

    <prefix>/<namespace id>/<fan-out>/<block hash hex>-r<rank>

``namespace id`` is ``Fingerprint.namespace_id`` (the disk tier's directory name for
the same fingerprint), so an operator finds a model's blocks under one key prefix and a
lifecycle rule can target it. ``fan-out`` is two hex digits of the xxh3 of the block
hash, spreading keys over 256 prefixes (S3 scales request rates per prefix) whatever
the hash looks like. Beside the blocks, ``<prefix>/<namespace id>/fingerprint.json``
holds the fingerprint's canonical JSON, written once, for inspection.

An object is a fixed header, the block hash, then the payload (the rank's block bytes)::

    magic        8s   b"TKVBLOCK"
    version      u16  FORMAT_VERSION
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
counts as a miss. The fingerprint digest guards against namespace-id collisions and
against objects copied between prefixes; the checksum against torn or damaged bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from tiered_kv.abstract import BlockHash
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.checksums import checksum_function

MAGIC = b"TKVBLOCK"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHHHH32s8sQQ")
FIXED_HEADER_BYTES = _FIXED.size
#: Longest block hash a header holds (vLLM's are 32 bytes, or 8 with xxhash).
MAX_HASH_BYTES = 1024
MANIFEST_NAME = "fingerprint.json"


class Rejected(Exception):
    """An object that must not be served. ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


#: ``format``: not an object of this format (magic, version, lengths);
#: ``foreign``: another fingerprint's object; ``mismatch``: another block or rank;
#: ``size``: an object or payload of another size than the reader's buffer implies
#: (such an object is not even downloaded); ``checksum``: damaged bytes.
REJECT_REASONS = ("format", "foreign", "mismatch", "size", "checksum")


def fingerprint_digest(fingerprint: Fingerprint) -> bytes:
    """The full SHA-256 (32 bytes) of the fingerprint's canonical JSON."""
    return hashlib.sha256(fingerprint.canonical_json().encode()).digest()


def namespace_prefix(prefix: str, fingerprint: Fingerprint) -> str:
    """``<prefix>/<namespace id>``: every object of one fingerprint lies under it."""
    return f"{prefix}/{fingerprint.namespace_id}"


def manifest_key(prefix: str, fingerprint: Fingerprint) -> str:
    return f"{namespace_prefix(prefix, fingerprint)}/{MANIFEST_NAME}"


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
        if len(self.fingerprint) != 32:
            raise ValueError(f"fingerprint digest must be 32 bytes, got {len(self.fingerprint)}")
        if not 0 < len(self.block_hash) <= MAX_HASH_BYTES:
            raise ValueError(f"block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(self.block_hash)}")
        if not 0 <= self.rank < 1 << 16:
            raise ValueError(f"rank must be in 0..65535, got {self.rank}")
        return _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            FIXED_HEADER_BYTES + len(self.block_hash),
            self.rank,
            len(self.block_hash),
            self.fingerprint,
            _checksum_name_field(self.checksum_name),
            self.checksum,
            self.payload_len,
        ) + bytes(self.block_hash)

    @classmethod
    def unpack(cls, data: memoryview) -> BlockHeader:
        """The header at the start of ``data``; ``Rejected("format")`` if there is none."""
        if len(data) < FIXED_HEADER_BYTES:
            raise Rejected("format", f"object of {len(data)} bytes is shorter than a header")
        magic, version, header_len, rank, hash_len, fp, cname, value, payload_len = _FIXED.unpack_from(data)
        if magic != MAGIC:
            raise Rejected("format", f"magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise Rejected("format", f"format version {version}, this reader knows {FORMAT_VERSION}")
        if header_len != FIXED_HEADER_BYTES + hash_len or not 0 < hash_len <= MAX_HASH_BYTES:
            raise Rejected("format", f"header length {header_len} with a {hash_len}-byte hash")
        if len(data) != header_len + payload_len:
            raise Rejected("format", f"object of {len(data)} bytes, header says {header_len} + {payload_len}")
        try:
            name = cname.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise Rejected("format", f"checksum name {cname!r}") from None
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


def verified_payload(
    data: memoryview,
    *,
    fingerprint: bytes,
    block_hash: BlockHash,
    rank: int,
    size: int,
    checksums: Callable[[str], Callable[[memoryview], int]] = checksum_function,
) -> memoryview:
    """The payload of object ``data`` once every check passed; else ``Rejected``.

    ``checksums(name)`` gives the checksum function an object names (a writer may use
    another checksum than the reader's own setting: it does not change the bytes).
    """
    header = BlockHeader.unpack(data)
    if header.fingerprint != fingerprint:
        raise Rejected(
            "foreign", f"fingerprint {header.fingerprint.hex()[:16]}..., expected {fingerprint.hex()[:16]}..."
        )
    if header.block_hash != block_hash or header.rank != rank:
        raise Rejected(
            "mismatch",
            f"holds block {header.block_hash.hex()} rank {header.rank}, expected {bytes(block_hash).hex()} rank {rank}",
        )
    if header.payload_len != size:
        raise Rejected("size", f"payload of {header.payload_len} bytes, expected {size}")
    try:
        fn = checksums(header.checksum_name)
    except (ValueError, RuntimeError) as exc:
        raise Rejected("format", f"checksum {header.checksum_name!r}: {exc}") from None
    payload = data[header.header_len :]
    if fn(payload) != header.checksum:
        raise Rejected("checksum", f"{header.checksum_name} of the payload differs from the header's")
    return payload
