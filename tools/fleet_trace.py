"""The Mooncake FAST'25 traces as the fleet replays read them (tools/replay_fleet.py in
file order, tools/replay_fleet_time.py in time): requests of 512-token blocks with
prefix-chained ids, an LRU over block ids, and the paper's fleet figures. Runs in the
replay's process; reads the trace file only.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
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


def trace_rows(path: Path, limit: int | None = None, timed: bool = False) -> Iterator[tuple[float, Request]]:
    """Per line of a Mooncake FAST'25 trace (``input_length``, ``hash_ids``; ``timestamp``
    in ms where ``timed``, else 0), in file order: its timestamp and its request."""
    fields = '"input_length": int >= 1, "hash_ids": [int, ...]'
    expected = '{"timestamp": ms, ' + fields + "}" if timed else "{" + fields + "}"
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and lineno > limit:
                return
            try:
                row = json.loads(line)
                stamp = float(row["timestamp"]) if timed else 0.0
                tokens, ids = int(row["input_length"]), [int(h) for h in row["hash_ids"]]
                if tokens < 1:
                    raise ValueError(f"input_length {tokens} < 1")
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace line ({exc}); expected {expected}") from None
            yield stamp, Request(tokens, tuple(ids[: tokens // TOKENS_PER_BLOCK]))


def read_mooncake_trace(path: Path, limit: int | None = None) -> list[Request]:
    """The requests of a Mooncake FAST'25 trace, in file order (``trace_rows``)."""
    return [request for _, request in trace_rows(path, limit)]


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
