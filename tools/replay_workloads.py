"""Workloads for ``tools/replay.py``: generated presets, or a trace read from a file.

Pure computation plus reading/writing one JSON-lines trace file. Every request is the
prefix-hash chain of its full blocks (``tiered_kv.sim.workloads``), so shared prefixes
(system prompts, chat histories, documents) share hashes.

Presets (``scale`` multiplies their request and document counts, so the working set
grows with it while each request keeps its shape):

- ``chat``: multi-turn conversations with growing histories over 4 shared system
  prompts (Zipf-popular); a turn adds the previous answer and the next message.
- ``rag``: one of many documents, Zipf(1.1)-popular, then a fresh question.
- ``mixed``: the chat and RAG streams interleaved at random, half each.

Trace format, one request per line: ``{"token_ids": [...]}`` (hashed into full blocks
of the replay's block size; a trailing partial block is not offloadable and is
dropped), ``{"block_hashes": ["<hex>", ...]}`` (what ``--save-trace`` writes), or
Mooncake's FAST'25 format (``read_mooncake``): ``{"timestamp", "input_length",
"output_length", "hash_ids": [ints]}``, ``hash_ids`` the prefix-chained ids of
512-token blocks, of which the last is partial unless ``input_length`` is a multiple
of 512 (a partial block is not offloadable: its tokens are always computed).

Agentic coding conversations (``read_claude_code``, ``read_claude_code_folder``): the
kv-cache-tester files (64-token blocks, ids local to a conversation), for
``tools/replay_claude_code.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered_kv.sim.workloads import ChatWorkloadSpec, Workload, chat_workload, prefix_hashes, shared_prefix_workload

WORKLOADS = ("chat", "rag", "mixed")


@dataclass(frozen=True)
class Preset:
    """Sizes of the generated workloads, in blocks (tokens = blocks x block size)."""

    chat_requests: int
    system_prompt_blocks: int
    first_message_blocks: tuple[int, int]
    turn_blocks: tuple[int, int]
    max_turns: int
    rag_requests: int
    rag_documents: int
    document_blocks: int
    question_blocks: tuple[int, int]


FULL = Preset(
    chat_requests=500,
    system_prompt_blocks=16,
    first_message_blocks=(2, 6),
    turn_blocks=(2, 6),
    max_turns=8,
    rag_requests=500,
    rag_documents=120,
    document_blocks=24,
    question_blocks=(1, 3),
)
QUICK = Preset(
    chat_requests=160,
    system_prompt_blocks=8,
    first_message_blocks=(1, 4),
    turn_blocks=(1, 4),
    max_turns=6,
    rag_requests=160,
    rag_documents=40,
    document_blocks=12,
    question_blocks=(1, 2),
)


def generate(kind: str, preset: Preset, tokens_per_block: int, scale: float = 1.0, seed: int = 0) -> Workload:
    """The ``kind`` workload (see the module docstring) at ``scale``."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; expected one of {', '.join(WORKLOADS)}")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")

    def chat(n: float) -> Workload:
        return chat_workload(
            ChatWorkloadSpec(
                num_requests=max(1, round(n)),
                num_system_prompts=4,
                system_prompt_blocks=preset.system_prompt_blocks,
                first_message_blocks=preset.first_message_blocks,
                turn_blocks=preset.turn_blocks,
                max_turns=preset.max_turns,
                new_conversation_prob=0.3,
                tokens_per_block=tokens_per_block,
                seed=seed,
            )
        )

    def rag(n: float, docs: float) -> Workload:
        return shared_prefix_workload(
            max(1, round(n)),
            max(1, round(docs)),
            preset.document_blocks,
            preset.question_blocks,
            zipf_s=1.1,
            tokens_per_block=tokens_per_block,
            seed=seed + 1,
        )

    if kind == "chat":
        w = chat(preset.chat_requests * scale)
        return Workload(f"chat x{scale:g}", w.requests)
    if kind == "rag":
        w = rag(preset.rag_requests * scale, preset.rag_documents * scale)
        return Workload(f"rag x{scale:g}", w.requests)
    a = chat(preset.chat_requests * scale / 2).requests
    b = rag(preset.rag_requests * scale / 2, preset.rag_documents * scale / 2).requests
    order = np.random.default_rng(seed + 2).permutation(len(a) + len(b))
    both = a + b
    return Workload(f"mixed x{scale:g}", [both[i] for i in order])


MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class MooncakeTrace:
    """A Mooncake FAST'25 trace: per request its full blocks' ids, the tokens of its
    trailing partial block, its arrival (ms since the trace began) and the tokens it
    generated."""

    name: str
    requests: list[list[int]]
    tail_tokens: list[int]
    timestamps: list[int]
    output_tokens: list[int]
    tokens_per_block: int = MOONCAKE_BLOCK_TOKENS

    def workload(self) -> Workload:
        """The full blocks as a replay workload (8-byte block hashes)."""
        return Workload(self.name, [[h.to_bytes(8, "big") for h in r] for r in self.requests if r])


def is_mooncake(path: Path) -> bool:
    """Whether the first line of ``path`` is a Mooncake FAST'25 record."""
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        return "hash_ids" in json.loads(first)
    except ValueError:
        return False


def read_mooncake(path: Path) -> MooncakeTrace:
    """A Mooncake FAST'25 trace; raises ``ValueError`` naming the bad line."""
    requests, tails, stamps, outputs = [], [], [], []
    b = MOONCAKE_BLOCK_TOKENS
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = [int(h) for h in row["hash_ids"]]
                length = int(row["input_length"])
                if length < 0 or len(ids) != -(-length // b):
                    raise ValueError(f"{len(ids)} hash_ids for input_length {length}; expected ceil(length / {b})")
                full = length // b
                requests.append(ids[:full])
                tails.append(length - full * b)
                stamps.append(int(row.get("timestamp", 0)))
                outputs.append(int(row.get("output_length", 0)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: bad Mooncake trace line ({exc}); expected "
                    '{"timestamp": ms, "input_length": tokens, "hash_ids": [ints]}'
                ) from None
    if not requests:
        raise ValueError(f"{path}: no request")
    return MooncakeTrace(f"trace {Path(path).name}", requests, tails, stamps, outputs)


CLAUDE_CODE_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class AgentRequest:
    """One LLM request of an agentic conversation: its arrival (seconds since the
    conversation began), its prompt tokens, the ids of its full blocks (made unique
    across conversations) and its session: the conversation, with the sub-agent's id
    for a sub-agent's requests."""

    time: float
    tokens: int
    blocks: tuple[int, ...]
    session: tuple[str, str]


def read_claude_code(path: Path) -> list[AgentRequest]:
    """One kv-cache-tester conversation file (``traces/claude_code_kvtester/`` README):
    its requests with the sub-agents' nested ones flattened, in time order. A nested
    request's ``t`` counts from its sub-agent's start (its ``t`` in the parent). Block
    ids are local to a conversation (``hash_id_scope: local``): each is prefixed with
    the conversation's number, so two conversations never share a block. Raises
    ``ValueError`` naming the file and what is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        conversation = str(doc["id"])
        if doc.get("block_size", CLAUDE_CODE_BLOCK_TOKENS) != CLAUDE_CODE_BLOCK_TOKENS:
            raise ValueError(f"block_size {doc['block_size']}; expected {CLAUDE_CODE_BLOCK_TOKENS}")
        if doc.get("hash_id_scope", "local") != "local":
            raise ValueError(f"hash_id_scope {doc['hash_id_scope']!r}; expected 'local'")
        number = int(re.sub(r"\D", "", conversation) or 0)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"{path}: not a kv-cache-tester conversation ({exc}); expected "
            '{"id": "trace_NNNN", "block_size": 64, "hash_id_scope": "local", "requests": [...]}'
        ) from None
    out: list[AgentRequest] = []

    def walk(requests: list, start: float, agent: str, where: str) -> None:
        for k, r in enumerate(requests):
            at = f"{where}[{k}]"
            try:
                t = start + float(r["t"])
                if r.get("type") == "subagent":
                    walk(r["requests"], t, str(r.get("agent_id", at)), f"{at}.requests")
                    continue
                ids = [int(h) for h in r["hash_ids"]]
                tokens = int(r["in"])
                if len(ids) > tokens // CLAUDE_CODE_BLOCK_TOKENS + 1 or not 0 <= min(ids, default=0) < 2**32:
                    raise ValueError(f"{len(ids)} hash_ids (0 <= id < 2**32) for {tokens} tokens")
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(
                    f"{path}: {at}: bad request ({exc}); expected "
                    '{"t": s, "type": "s"|"n", "in": tokens, "hash_ids": [ints]} or '
                    '{"t": s, "type": "subagent", "agent_id": ..., "requests": [...]}'
                ) from None
            full = ids[: tokens // CLAUDE_CODE_BLOCK_TOKENS]
            out.append(AgentRequest(t, tokens, tuple((number << 32) | h for h in full), (conversation, agent)))

    walk(doc.get("requests", []), 0.0, "", "requests")
    out.sort(key=lambda r: r.time)  # stable: a parent's request before a nested one at the same time
    return out


def read_claude_code_folder(folder: Path) -> list[AgentRequest]:
    """Every ``*.json`` conversation in ``folder`` on one server: all begin at time 0,
    their requests interleaved by time."""
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise ValueError(f"{folder}: no *.json conversation file")
    requests = [r for f in files for r in read_claude_code(f)]
    requests.sort(key=lambda r: r.time)
    return requests


def read_trace(path: Path, tokens_per_block: int) -> Workload:
    """Requests from a JSON-lines trace (format in the module docstring). A Mooncake
    trace's 512-token blocks each become one block of the replay."""
    if is_mooncake(path):
        return read_mooncake(path).workload()
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "block_hashes" in row:
                    requests.append([bytes.fromhex(h) for h in row["block_hashes"]])
                elif "token_ids" in row:
                    tokens = np.asarray(row["token_ids"], dtype=np.int64)
                    n = len(tokens) // tokens_per_block
                    requests.append(prefix_hashes(tokens[: n * tokens_per_block].reshape(n, tokens_per_block)))
                else:
                    raise ValueError("expected a 'token_ids' or a 'block_hashes' key")
            except (ValueError, TypeError, AttributeError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: bad trace line ({exc}); expected "
                    '{"token_ids": [ints]} or {"block_hashes": ["hex", ...]}'
                ) from None
    requests = [r for r in requests if r]
    if not requests:
        raise ValueError(f"{path}: no request with at least one full {tokens_per_block}-token block")
    return Workload(f"trace {Path(path).name}", requests)


def write_trace(workload: Workload, path: Path) -> None:
    """Write ``workload`` in the ``block_hashes`` trace format."""
    with open(path, "w", encoding="utf-8") as f:
        for request in workload.requests:
            f.write(json.dumps({"block_hashes": [h.hex() for h in request]}) + "\n")


@dataclass(frozen=True)
class Shape:
    """Sizes of a workload: requests, blocks and tokens requested, working set (distinct
    blocks) and the longest request, in blocks."""

    requests: int
    blocks: int
    working_set: int
    longest: int
    tokens_per_block: int

    @classmethod
    def of(cls, workload: Workload, tokens_per_block: int) -> "Shape":
        return cls(
            len(workload.requests),
            workload.num_blocks,
            workload.num_unique_blocks,
            max(len(r) for r in workload.requests),
            tokens_per_block,
        )

    def describe(self, bytes_per_block: int) -> str:
        t = self.tokens_per_block
        return (
            f"{self.requests} requests, {self.blocks} blocks = {self.blocks * t:,} tokens requested; "
            f"working set {self.working_set} blocks = {self.working_set * t:,} tokens = "
            f"{self.working_set * bytes_per_block / 2**30:.2f} GiB; longest request {self.longest} blocks"
        )
