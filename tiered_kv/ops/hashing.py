"""Prefix block hashes equal to the ones vLLM's prefix cache computes, without vLLM.

Pure computation, no I/O; used by the offline warm-up (``tiered_kv.ops.warmup``) and by
tools that must name blocks the way a serving engine does. The scheme (learned from
vLLM 0.33's ``kv_cache_utils``/``utils.hashing``; nothing is imported from it):

- A block is ``block_size`` tokens (the engine's GPU block size); only full blocks are
  hashed. Block *i* hashes ``(parent, tuple(token ids of block i), extra_keys)`` where
  ``parent`` is block *i-1*'s hash, or for the first block the *none hash*
  ``hash_fn(seed)``. ``extra_keys`` is None for plain text prompts (no LoRA,
  multimodal inputs or cache salt); a tenant's ``cache_salt`` makes the first block's
  ``(("cache_salt", salt),)`` (vLLM 0.33 tags each extra key), and every later block's
  hash inherits it through its parent. Prompts with LoRA, multimodal inputs or
  embeddings are not handled here.
- ``hash_fn`` is one of ``sha256`` (pickle, protocol ``HIGHEST_PROTOCOL``, then SHA-256),
  ``sha256_cbor`` (canonical CBOR, then SHA-256), ``xxhash`` / ``xxhash_cbor`` (the same
  serialisations, then XXH3-128).
- The seed is ``PYTHONHASHSEED`` when set; otherwise a fixed string for the sha256
  algorithms and fresh random bytes per process for the xxhash ones. So xxhash hashes
  are reproducible across processes (and a warm-up useful) only with a fixed seed.
- An offloaded block ("chunk") of ``blocks_per_chunk`` hash blocks is keyed by the hash
  of its last hash block, which chains the whole prefix.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: vLLM's none-hash seed for the sha256 algorithms when PYTHONHASHSEED is unset.
DEFAULT_SEED = "vllm-none-hash"
_RANDOM_SEEDED = ("xxhash", "xxhash_cbor")


class HashSettingsError(ValueError):
    """The hash settings cannot give block hashes that are stable across processes, or
    name an unknown algorithm (the message says what to set)."""


# ---------------------------------------------------------------- serialisations


def cbor_encode(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding) of ``None``, bools, ints
    (up to 64 bits), bytes, str, and tuples/lists of these. Raises ``TypeError`` for
    anything else."""
    out = bytearray()
    _cbor(obj, out)
    return bytes(out)


def _cbor_head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 1 << 8:
        out += bytes((major << 5 | 24, n))
    elif n < 1 << 16:
        out += bytes((major << 5 | 25,)) + struct.pack(">H", n)
    elif n < 1 << 32:
        out += bytes((major << 5 | 26,)) + struct.pack(">I", n)
    elif n < 1 << 64:
        out += bytes((major << 5 | 27,)) + struct.pack(">Q", n)
    else:
        raise TypeError(f"integer {n} does not fit 64 bits; bignums are not supported")


def _cbor(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True or obj is False:
        out.append(0xF5 if obj else 0xF4)
    elif isinstance(obj, int):
        _cbor_head(0, obj, out) if obj >= 0 else _cbor_head(1, -1 - obj, out)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        _cbor_head(2, len(data), out)
        out += data
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _cbor_head(3, len(data), out)
        out += data
    elif isinstance(obj, (tuple, list)):
        _cbor_head(4, len(obj), out)
        for item in obj:
            _cbor(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode a {type(obj).__name__}")


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _xxh3_128(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_ALGORITHMS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickle, _sha256),
    "sha256_cbor": (cbor_encode, _sha256),
    "xxhash": (_pickle, _xxh3_128),
    "xxhash_cbor": (cbor_encode, _xxh3_128),
}


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """The object hash ``algorithm`` names (one of ``HASH_ALGORITHMS``)."""
    try:
        serialise, digest = _ALGORITHMS[algorithm]
    except KeyError:
        raise HashSettingsError(
            f"hash_algorithm: expected one of {', '.join(HASH_ALGORITHMS)} "
            f"(vLLM's --prefix-caching-hash-algo), got {algorithm!r}"
        ) from None
    return lambda obj: digest(serialise(obj))


def resolve_seed(algorithm: str, configured: str = "", env: Mapping[str, str] | None = None) -> str:
    """The none-hash seed a server configured with ``hash_seed=configured`` uses.

    ``configured`` is the config's ``hash_seed``: empty means "whatever vLLM picks",
    otherwise the ``PYTHONHASHSEED`` the server runs with. ``env`` (default
    ``os.environ``) is this process's environment: a ``PYTHONHASHSEED`` here must agree
    with ``configured``. Raises ``HashSettingsError`` when the two disagree, or when the
    algorithm is seeded randomly per process and no seed is fixed anywhere.
    """
    hash_function(algorithm)  # validates the name
    env = os.environ if env is None else env
    from_env = env.get("PYTHONHASHSEED")
    if from_env is not None:
        if configured and configured != from_env:
            raise HashSettingsError(
                f"hash_seed {configured!r} in the config differs from PYTHONHASHSEED={from_env!r} "
                f"in this environment; set them to the same value the server uses"
            )
        return from_env
    if configured:
        return configured
    if algorithm in _RANDOM_SEEDED:
        raise HashSettingsError(
            f"hash_algorithm {algorithm} is seeded randomly per process unless PYTHONHASHSEED is "
            f"set, so block hashes would never match the server's: run the server with "
            f"PYTHONHASHSEED=<value> and set hash_seed to the same <value> in the config "
            f"(or use hash_algorithm sha256)"
        )
    return DEFAULT_SEED


class PrefixHasher:
    """Chained block hashes of token sequences for one algorithm, seed and block size."""

    def __init__(self, algorithm: str, seed: str, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
        self.algorithm = algorithm
        self.block_size = block_size
        self._hash = hash_function(algorithm)
        self.none_hash = self._hash(seed)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """One hash per full block of ``token_ids`` (a trailing partial block has none),
        as vLLM hashes them for a request of the tenant ``cache_salt`` (None or empty:
        none, as vLLM takes an empty salt)."""
        tokens = [int(t) for t in token_ids]  # numpy ints would pickle differently
        parent = self.none_hash
        out = []
        bs = self.block_size
        extra: tuple[tuple[str, str], ...] | None = (("cache_salt", cache_salt),) if cache_salt else None
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = self._hash((parent, tuple(tokens[start : start + bs]), extra))
            extra = None  # vLLM salts the first block only; the chain carries it on
            out.append(parent)
        return out


def chunk_keys(block_hashes: Sequence[bytes], blocks_per_chunk: int, suffix: bytes = b"") -> list[bytes]:
    """Keys of offloaded blocks made of ``blocks_per_chunk`` hash blocks each: the hash of
    each full chunk's last block, plus ``suffix`` (e.g. vLLM's 4-byte KV-group index)."""
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    return [bytes(h) + suffix for h in block_hashes[blocks_per_chunk - 1 :: blocks_per_chunk]]
