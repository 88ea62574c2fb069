"""vLLM-compatible prefix hashes (tiered_kv.ops.hashing): the serialisations, the seed rules,
the chaining, and (marked ``vllm``) equality with vLLM 0.33's own functions."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiered_kv.ops.hashing import (
    DEFAULT_SEED,
    HASH_ALGORITHMS,
    HashSettingsError,
    PrefixHasher,
    cbor_encode,
    chunk_keys,
    hash_function,
    resolve_seed,
)

ALGOS = list(HASH_ALGORITHMS)
_atoms = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=64) | st.text(max_size=40)
_values = st.recursive(
    _atoms, lambda inner: st.lists(inner, max_size=5).map(tuple) | st.lists(inner, max_size=5), max_leaves=30
)


@settings(max_examples=150, deadline=None)
@given(_values)
@example(b"x" * 300)
@example(("\u00e9" * 200, b"y" * 70_000, 2**40))
def test_cbor_encoding_is_canonical_cbor(value):
    cbor2 = pytest.importorskip("cbor2")
    assert cbor_encode(value) == cbor2.dumps(value, canonical=True)


def test_cbor_rejects_what_it_cannot_encode():
    with pytest.raises(TypeError, match="float"):
        cbor_encode((1.5,))
    with pytest.raises(TypeError, match="64 bits"):
        cbor_encode(2**64)


def test_hash_functions_are_the_documented_ones():
    obj = (b"parent", (1, 2, 3), None)
    assert hash_function("sha256")(obj) == hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert hash_function("sha256_cbor")(obj) == hashlib.sha256(cbor_encode(obj)).digest()
    assert len(hash_function("xxhash")(obj)) == len(hash_function("xxhash_cbor")(obj)) == 16
    with pytest.raises(HashSettingsError, match="expected one of sha256, sha256_cbor, xxhash, xxhash_cbor.*'md5'"):
        hash_function("md5")


def test_seed_rules():
    assert resolve_seed("sha256", "", {}) == DEFAULT_SEED
    assert resolve_seed("sha256_cbor", "", {"PYTHONHASHSEED": "7"}) == "7"
    assert resolve_seed("xxhash", "7", {}) == "7"  # the config names the server's PYTHONHASHSEED
    assert resolve_seed("xxhash", "7", {"PYTHONHASHSEED": "7"}) == "7"
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(HashSettingsError, match="PYTHONHASHSEED=<value> and set hash_seed"):
            resolve_seed(algo, "", {})
    with pytest.raises(HashSettingsError, match="hash_seed '1' in the config differs from PYTHONHASHSEED='2'"):
        resolve_seed("sha256", "1", {"PYTHONHASHSEED": "2"})


@pytest.mark.parametrize("algo", ALGOS)
def test_block_hashes_chain_full_blocks_only(algo):
    hasher = PrefixHasher(algo, "s", block_size=4)
    tokens = list(range(100, 118))  # 4 full blocks + 2 tokens
    hashes = hasher.block_hashes(tokens)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    assert hasher.block_hashes(tokens[:9]) == hashes[:2]  # a prefix's hashes are a prefix
    assert hasher.block_hashes(np.array(tokens, dtype=np.int64)) == hashes  # numpy ints pickle differently
    fn = hash_function(algo)
    assert hashes[0] == fn((fn("s"), (100, 101, 102, 103), None))
    assert hashes[1] == fn((hashes[0], (104, 105, 106, 107), None))
    changed = hasher.block_hashes(tokens[:5] + [0] + tokens[6:])
    assert changed[0] == hashes[0] and changed[1:] != hashes[1:]  # everything after a change differs
    assert PrefixHasher(algo, "other", 4).block_hashes(tokens)[0] != hashes[0]
    assert hasher.block_hashes(tokens[:3]) == []


def test_chunk_keys_take_each_chunks_last_block():
    hashes = [bytes([i]) * 4 for i in range(7)]
    assert chunk_keys(hashes, 1) == hashes
    assert chunk_keys(hashes, 3) == [hashes[2], hashes[5]]  # the trailing partial chunk has no key
    assert chunk_keys(hashes, 2, suffix=b"\0\0\0\1") == [h + b"\0\0\0\1" for h in (hashes[1], hashes[3], hashes[5])]


# ---------------------------------------------------------------- against vLLM itself


@pytest.mark.vllm
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("seed", [None, "12345"])
def test_hashes_equal_vllms(algo, seed, monkeypatch):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from support import vllm_harness

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        if algo.startswith("xxhash"):
            with pytest.raises(HashSettingsError):
                resolve_seed(algo, "")
            return
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 150_000, 16 * 9 + 5).tolist()
    ours = PrefixHasher(algo, resolve_seed(algo, ""), 16).block_hashes(tokens)

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    assert bytes(kv_cache_utils.NONE_HASH) == hash_function(algo)(resolve_seed(algo, ""))
    parent, theirs = None, []
    for start in range(0, len(tokens) - 15, 16):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[start : start + 16], None)
        theirs.append(bytes(parent))
    assert ours == theirs
    # And what vLLM's scheduler attaches to a request (its request block hasher).
    assert ours == vllm_harness.hash_blocks(tokens, 16, algo)
    # A tenant's request: the salt enters the first block and every hash after it.
    salted = PrefixHasher(algo, resolve_seed(algo, ""), 16).block_hashes(tokens, "tenant-a")
    assert salted == vllm_harness.hash_blocks(tokens, 16, algo, cache_salt="tenant-a")
    assert not set(salted) & set(ours)
    assert salted != vllm_harness.hash_blocks(tokens, 16, algo, cache_salt="tenant-b")
    assert PrefixHasher(algo, resolve_seed(algo, ""), 16).block_hashes(tokens, "") == ours  # vLLM: empty is none
