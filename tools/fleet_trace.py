"""The Mooncake FAST'25 traces as the fleet replays read them (tools/replay_fleet.py in
file order, tools/replay_fleet_time.py in time): requests of 512-token blocks with
prefix-chained ids, an LRU over block ids, and the paper's fleet figures. Runs in the
replay's process; reads the trace file only.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

TOKENS_PER_BLOCK = 512
#: The paper's Fig. 10 (10 prefill nodes x 3M tokens, global vs local cache): hit rate
#: and prefill GPU time of the global cache over local caches.
PAPER = {"conversation": (2.22, 0.76), "synthetic": (2.36, 0.52), "toolagent": (1.38, 0.74)}


@dataclass(frozen=True)
class Request:
    input_tokens: int
    blocks: tuple[int, ...]  # ids of its full 512-token blocks


def read_mooncake_trace(path: Path, limit: int | None = None) -> list[Request]:
    """Requests of a Mooncake FAST'25 trace (``input_length``, ``hash_ids``), in file order."""
    out: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            try:
                row = json.loads(line)
                tokens, ids = int(row["input_length"]), [int(h) for h in row["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f'{path}:{lineno}: bad trace line ({exc}); expected {{"input_length": int, "hash_ids": [int, ...]}}'
                ) from None
            out.append(Request(tokens, tuple(ids[: tokens // TOKENS_PER_BLOCK])))
    return out


class LRU:
    """Block ids, most recently used last; ``capacity`` 0 holds nothing."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.ids: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.ids

    def touch(self, blocks) -> list[int]:
        """Insert or refresh ``blocks`` in order; the ids evicted."""
        evicted = []
        for b in blocks:
            if b in self.ids:
                self.ids.move_to_end(b)
            elif self.capacity:
                self.ids[b] = None
                if len(self.ids) > self.capacity:
                    evicted.append(self.ids.popitem(last=False)[0])
        return evicted
