"""The fleet key of the shared tier: loading, key ids, and the per-object AEAD.

Runs in every process that opens the shared tier (each worker, the scheduler, the
inspector); its only I/O is reading the key file named by ``remote.key_file`` or the
environment variable named by ``remote.key_env``, once, at start-up. A key never
appears in the config, in a message or in a log line: messages name the file or the
variable, and a key by its id.

A key is 32 random bytes, written as 64 hex digits or as base64 (e.g. ``openssl rand
-hex 32``). A key file or variable may hold several, one per line (or separated by
spaces or commas): the first is the current key, under which every object is written;
the others are only read, so that a fleet rotates without losing its bucket (hand the
new key to every node as a second key, then make it the first, then drop the old one).

Objects are encrypted with AES-256-GCM (``cryptography``). The cipher key is not the
fleet key itself but HKDF-SHA256 of it (``info`` names the purpose), and its id
(``key_id``: four bytes of HKDF with another ``info``, never 0) goes into each object's
header, so a reader picks the right key and a node without it says which one it lacks.
The 12-byte nonce is random per object; the associated data is the whole header
(format version, full fingerprint digest, block hash, rank, key id, nonce, length), so
an object whose header was patched, or which was copied to another block's key, fails
authentication like one whose ciphertext was changed.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiered_kv.config_values import ConfigError
from tiered_kv.remote.config import RemoteConfig

if TYPE_CHECKING:  # cryptography is imported where a key is used
    from cryptography.hazmat.primitives.ciphers import AEADDecryptionContext

logger = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
#: Bound on a key file's size: a handful of keys, not a file someone put there by mistake.
MAX_KEY_FILE_BYTES = 64 * 1024
_SEPARATORS = re.compile(r"[\s,]+")
#: Per thread: the buffer ``Keyring.seal`` writes into, reused (a fresh multi-MiB
#: allocation per object costs page faults that show in throughput).
_scratch = threading.local()


class FleetKeyError(ConfigError):
    """The key named by the config cannot be used; the message names the file or the
    variable and what is expected, never the key."""


class AuthenticationFailed(Exception):
    """An object's tag does not verify under the key its header names."""


def _hkdf(key: bytes, info: bytes, length: int) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(key)


def _decode(text: str, where: str, n: int) -> bytes:
    try:
        raw = bytes.fromhex(text) if re.fullmatch(r"[0-9a-fA-F]+", text) else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raise FleetKeyError(f"{where}: key {n} is neither hex nor base64") from None
    if len(raw) != KEY_BYTES:
        raise FleetKeyError(
            f"{where}: key {n} is {len(raw)} bytes; expected {KEY_BYTES} random bytes as 64 hex digits "
            "or base64 (e.g. openssl rand -hex 32)"
        )
    return raw


@dataclass(frozen=True)
class _Key:
    key_id: int
    cipher_key: bytes


class Keyring:
    """The current key (for writes) and every key a reader accepts, by key id.

    ``seal``/``open`` are thread-safe and keep no state between calls."""

    def __init__(self, keys: Sequence[bytes]):
        if not keys:
            raise ValueError("a keyring needs at least one key")
        derived = []
        for key in keys:
            key_id = int.from_bytes(_hkdf(key, b"tiered-kv shared tier key id", 4), "little") or 1
            derived.append(_Key(key_id, _hkdf(key, b"tiered-kv shared tier AES-256-GCM", KEY_BYTES)))
        self._current = derived[0]
        self._by_id = {k.key_id: k for k in reversed(derived)}

    @property
    def current_id(self) -> int:
        return self._current.key_id

    @property
    def key_ids(self) -> list[int]:
        return sorted(self._by_id)

    def __repr__(self) -> str:  # never the keys
        return f"Keyring(current={self.current_id:08x}, readable={[f'{k:08x}' for k in self.key_ids]})"

    def seal(self, nonce: bytes, aad: bytes, pieces: Sequence[memoryview]) -> tuple[memoryview, bytes]:
        """The ciphertext of the concatenation of ``pieces`` and its tag. The ciphertext
        lies in this thread's scratch buffer: valid until the thread's next ``seal``."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        enc = Cipher(algorithms.AES(self._current.cipher_key), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        size = sum(len(p) for p in pieces)
        out = getattr(_scratch, "buf", None)
        if out is None or len(out) < size + 15:  # update_into wants room for one more block
            out = _scratch.buf = bytearray(size + 15)
        view = memoryview(out)
        at = 0
        for piece in pieces:
            at += enc.update_into(piece, view[at:])
        enc.finalize()
        return view[:size], enc.tag

    def open(self, key_id: int, nonce: bytes, aad: bytes, ciphertext: memoryview, tag: bytes) -> bytearray:
        """The plaintext, once the tag verified; ``KeyError`` for a key id this ring does
        not hold, ``AuthenticationFailed`` when the tag does not verify."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        key = self._by_id[key_id]
        dec = Cipher(algorithms.AES(key.cipher_key), modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        out = bytearray(len(ciphertext) + 15)
        n = dec.update_into(ciphertext, out)
        try:
            dec.finalize()
        except InvalidTag:
            raise AuthenticationFailed("the tag does not verify") from None
        del out[n:]
        return out

    def open_into(
        self, key_id: int, nonce: bytes, aad: bytes, ciphertext: memoryview, tag: bytes, dest: Sequence[memoryview]
    ) -> None:
        """Decrypt into ``dest`` (pieces whose sizes add up to the ciphertext's) and check
        the tag; on ``AuthenticationFailed`` every piece is zeroed, so nothing of a forged
        object stays there. ``KeyError`` for a key id this ring does not hold."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        dec = Cipher(algorithms.AES(self._by_id[key_id].cipher_key), modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        at = 0
        for d in dest:
            n = len(d)
            head = max(0, n - TAG_BYTES)  # update_into needs 15 spare bytes after its output
            if head:
                dec.update_into(ciphertext[at : at + head], d)
            if n > head:
                d[head:] = dec.update(ciphertext[at + head : at + n])
            at += n
        try:
            dec.finalize()
        except InvalidTag:
            for d in dest:
                d[:] = bytes(len(d))
            raise AuthenticationFailed("the tag does not verify") from None

    def opener(self, key_id: int, nonce: bytes, aad: bytes) -> AEADDecryptionContext:
        """A streaming GCM decryptor (``update``, then ``finalize_with_tag``) for a key id
        this ring holds (``KeyError`` otherwise), with ``aad`` already authenticated."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        dec = Cipher(algorithms.AES(self._by_id[key_id].cipher_key), modes.GCM(nonce)).decryptor()
        dec.authenticate_additional_data(aad)
        return dec

    def holds(self, key_id: int) -> bool:
        return key_id in self._by_id


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def parse_keys(text: str, where: str) -> list[bytes]:
    """The keys in ``text`` (first: current), each checked; ``FleetKeyError`` naming ``where``."""
    tokens = [t for t in _SEPARATORS.split(text.strip()) if t and not t.startswith("#")]
    if not tokens:
        raise FleetKeyError(f"{where}: holds no key; expected 64 hex digits (e.g. openssl rand -hex 32)")
    return [_decode(t, where, n + 1) for n, t in enumerate(tokens)]


def load_keyring(config: RemoteConfig) -> Keyring | None:
    """The config's keyring; None when ``trusted_bucket`` is set and no key is named
    (a warning, at every start). ``FleetKeyError`` when no key is named and the bucket is
    not declared trusted, or the named key cannot be read."""
    if config.key_file is not None:
        where = f"remote.key_file {config.key_file}"
        try:
            st = os.stat(config.key_file)
            if st.st_size > MAX_KEY_FILE_BYTES:
                raise FleetKeyError(f"{where}: {st.st_size} bytes; a key file holds a few keys (at most 64 KiB)")
            with open(config.key_file, encoding="ascii", errors="replace") as f:
                text = f.read(MAX_KEY_FILE_BYTES)
        except OSError as e:
            raise FleetKeyError(f"{where}: cannot be read ({e.strerror or e})") from None
        if st.st_mode & 0o077:
            logger.warning(
                "shared tier: %s is readable by other users (mode %o); chmod 600 it", where, st.st_mode & 0o777
            )
        return Keyring(parse_keys(text, where))
    if config.key_env is not None:
        where = f"remote.key_env: environment variable {config.key_env}"
        value = os.environ.get(config.key_env)
        if not value:
            raise FleetKeyError(f"{where} is not set or empty")
        return Keyring(parse_keys(value[:MAX_KEY_FILE_BYTES], where))
    if not config.trusted_bucket:
        raise FleetKeyError(
            "shared tier: no key. Objects in the bucket are encrypted and authenticated with a fleet key: "
            "name a file holding it (remote.key_file) or an environment variable (remote.key_env); "
            "generate one with: openssl rand -hex 32. To store blocks unencrypted and unauthenticated, "
            "where everyone who can write the bucket is trusted with every tenant's KV, set "
            "remote.trusted_bucket: true"
        )
    logger.warning(
        "shared tier: %s is declared trusted (remote.trusted_bucket) and no key is set: blocks are "
        "stored in plaintext, and anyone who can write the bucket can make this node serve KV of "
        "their choosing",
        config.where(),
    )
    return None
