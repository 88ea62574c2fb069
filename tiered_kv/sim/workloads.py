"""Synthetic request streams as chains of prefix block hashes.

Used by the engine driver, the demo, tests and benchmarks; pure computation, no I/O.
A request is the list of its blocks' prefix hashes: block i's hash is
``xxh3_128(hash of block i-1 + block i's token ids)``, like an engine's prefix cache,
so requests that share a prefix share its hashes. Sizes are in (offloaded) blocks.
Everything is generated from a seed, so a workload is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from tiered_kv.abstract import BlockHash

TOKEN_VOCAB = 32_000


def prefix_hashes(token_blocks: np.ndarray, parent: BlockHash = b"") -> list[BlockHash]:
    """Prefix hashes of consecutive blocks of token ids (``(num_blocks, tokens_per_block)``)
    following the block whose hash is ``parent`` (``b""`` at the start of a sequence)."""
    hashes = []
    for tokens in np.ascontiguousarray(token_blocks, dtype=np.int32):
        parent = xxhash.xxh3_128(parent + tokens.tobytes()).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Workload:
    """A named list of requests, each the prefix-hash chain of its blocks."""

    name: str
    requests: list[list[BlockHash]]

    @property
    def num_blocks(self) -> int:
        return sum(len(r) for r in self.requests)

    @property
    def num_unique_blocks(self) -> int:
        return len({h for r in self.requests for h in r})


@dataclass(frozen=True)
class ChatWorkloadSpec:
    """Multi-turn chats over a few shared system prompts.

    Each request either opens a conversation (probability ``new_conversation_prob``,
    or when none is open): a system prompt, drawn with Zipf-like popularity, plus a
    first user message; or continues a random open one: its whole history plus one
    turn (the previous answer and the next message). A conversation closes after
    ``max_turns`` requests. Ranges are inclusive, in blocks.
    """

    num_requests: int = 300
    num_system_prompts: int = 4
    system_prompt_blocks: int = 8
    first_message_blocks: tuple[int, int] = (1, 4)
    turn_blocks: tuple[int, int] = (1, 3)
    max_turns: int = 6
    new_conversation_prob: float = 0.35
    tokens_per_block: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_system_prompts", "max_turns", "tokens_per_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("first_message_blocks", "turn_blocks"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if not 0.0 <= self.new_conversation_prob <= 1.0:
            raise ValueError(f"new_conversation_prob must be in [0, 1], got {self.new_conversation_prob}")


def chat_workload(spec: ChatWorkloadSpec) -> Workload:
    """Generate the request stream ``spec`` describes."""
    rng = np.random.default_rng(spec.seed)

    def blocks(n: int, parent: BlockHash) -> list[BlockHash]:
        tokens = rng.integers(0, TOKEN_VOCAB, size=(n, spec.tokens_per_block))
        return prefix_hashes(tokens, parent)

    prompts = [blocks(spec.system_prompt_blocks, b"") for _ in range(spec.num_system_prompts)]
    popularity = 1.0 / np.arange(1, spec.num_system_prompts + 1)
    popularity /= popularity.sum()
    open_chats: list[tuple[list[BlockHash], int]] = []  # (history, turns so far)
    requests = []
    for _ in range(spec.num_requests):
        if not open_chats or rng.random() < spec.new_conversation_prob:
            prompt = prompts[rng.choice(spec.num_system_prompts, p=popularity)]
            history = prompt + blocks(int(rng.integers(*spec.first_message_blocks, endpoint=True)), prompt[-1])
            turns = 1
        else:
            history, turns = open_chats.pop(int(rng.integers(len(open_chats))))
            history = history + blocks(int(rng.integers(*spec.turn_blocks, endpoint=True)), history[-1])
            turns += 1
        requests.append(history)
        if turns < spec.max_turns:
            open_chats.append((history, turns))
    return Workload(f"chat(seed={spec.seed})", requests)


def shared_prefix_workload(
    num_requests: int,
    num_prefixes: int,
    prefix_blocks: int,
    suffix_blocks: tuple[int, int],
    zipf_s: float = 1.1,
    tokens_per_block: int = 16,
    seed: int = 0,
) -> Workload:
    """RAG-like: each request is one of ``num_prefixes`` shared documents, drawn with
    Zipf(``zipf_s``) popularity, followed by a fresh question of ``suffix_blocks``
    (inclusive range) blocks."""
    if min(num_requests, num_prefixes, prefix_blocks, tokens_per_block) < 1:
        raise ValueError("num_requests, num_prefixes, prefix_blocks and tokens_per_block must be >= 1")
    lo, hi = suffix_blocks
    if not 0 <= lo <= hi:
        raise ValueError(f"suffix_blocks must be (lo, hi) with 0 <= lo <= hi, got {suffix_blocks}")
    rng = np.random.default_rng(seed)
    docs = [
        prefix_hashes(rng.integers(0, TOKEN_VOCAB, size=(prefix_blocks, tokens_per_block))) for _ in range(num_prefixes)
    ]
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** zipf_s
    weights /= weights.sum()
    requests = []
    for doc in rng.choice(num_prefixes, size=num_requests, p=weights):
        n = int(rng.integers(lo, hi, endpoint=True))
        tokens = rng.integers(0, TOKEN_VOCAB, size=(n, tokens_per_block))
        requests.append(docs[doc] + prefix_hashes(tokens, docs[doc][-1]))
    return Workload(f"shared-prefix(seed={seed}, zipf={zipf_s})", requests)


def default_workload(num_requests: int = 300, seed: int = 0) -> Workload:
    """The demo's workload: a few hundred multi-turn chat requests over 4 system prompts."""
    return chat_workload(ChatWorkloadSpec(num_requests=num_requests, seed=seed))
