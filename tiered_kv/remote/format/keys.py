"""The fleet key of the shared tier: loading, key ids, and the per-object AEAD.

Runs in every process that opens the shared tier (each worker, the scheduler, the
inspector); its only I/O is reading the key file named by ``remote.key_file`` or the
environment variable named by ``remote.key_env``, once, at start-up. A key never
appears in the config, in a message or in a log line: messages name the file or the
variable (or not even that, where the name itself looks like a key:
``config_values.redact``), and a key by its id.

The key file must be a regular file (the path may be a symbolic link to one, as the
secrets Kubernetes mounts are). Whatever else is there is refused with what it is, before
a read can block: a FIFO would hang every process that opens the tier, a device could
stream without end. So it is stat'ed first, opened with ``O_NONBLOCK`` (a FIFO swapped in
after the stat then opens at once), and checked again with ``fstat`` on what was opened;
it is read up to ``MAX_KEY_FILE_BYTES``.

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
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiered_kv.config_values import ConfigError, redact
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
    hex_digits = re.fullmatch(r"[0-9a-fA-F]+", text) is not None
    if hex_digits and len(text) % 2:  # a digit lost (or added) in a copy: hex, not base64
        raise FleetKeyError(
            f"{where}: key {n} is {len(text)} hex digits; expected {2 * KEY_BYTES} (e.g. openssl rand -hex 32)"
        )
    try:
        raw = bytes.fromhex(text) if hex_digits else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raise FleetKeyError(
            f"{where}: key {n} ({len(text)} characters) is neither {2 * KEY_BYTES} hex digits nor base64 of "
            f"{KEY_BYTES} bytes"
        ) from None
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
    text = text.removeprefix("\ufeff")  # a byte-order mark some editors write first
    tokens = [t for t in _SEPARATORS.split(text.strip()) if t and not t.startswith("#")]
    if not tokens:
        raise FleetKeyError(f"{where}: holds no key; expected 64 hex digits (e.g. openssl rand -hex 32)")
    return [_decode(t, where, n + 1) for n, t in enumerate(tokens)]


def _not_regular(path: str, where: str) -> FleetKeyError:
    from tiered_kv.disk.format.safe_open import describe  # the disk package loads torch: on failure only

    real = os.path.realpath(path)
    # What the path ends at: a link to a FIFO is a FIFO to whoever opens it.
    what = describe(real)
    leads = "" if real == os.path.abspath(path) else f" (the link leads to {redact(real)})"
    return FleetKeyError(
        f"{where}: is {what}{leads}, not a regular file; expected the path of a file holding the fleet key "
        "(e.g. openssl rand -hex 32 > FILE; chmod 600 FILE)"
    )


def _read_key_file(path: str, where: str) -> tuple[str, os.stat_result]:
    """The text of the key file at ``path`` and its ``fstat``; ``FleetKeyError`` naming
    ``where`` for anything but a readable regular file of at most ``MAX_KEY_FILE_BYTES``."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise _not_regular(path, where)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise FleetKeyError(f"{where}: cannot be read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, where)
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise FleetKeyError(f"{where}: {st.st_size} bytes; a key file holds a few keys (at most 64 KiB)")
        chunks, left = [], MAX_KEY_FILE_BYTES
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise FleetKeyError(f"{where}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("ascii", errors="replace"), st


def load_keyring(config: RemoteConfig) -> Keyring | None:
    """The config's keyring; None when ``trusted_bucket`` is set and no key is named
    (a warning, at every start). ``FleetKeyError`` when no key is named and the bucket is
    not declared trusted, or the named key cannot be read."""
    if config.key_file is not None:
        where = f"remote.key_file {redact(config.key_file)}"
        text, st = _read_key_file(config.key_file, where)
        if st.st_mode & 0o077:
            logger.warning(
                "shared tier: %s is readable by other users (mode %o); chmod 600 it", where, st.st_mode & 0o777
            )
        return Keyring(parse_keys(text, where))
    if config.key_env is not None:
        where = f"remote.key_env: environment variable {redact(config.key_env)}"
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
