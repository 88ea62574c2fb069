"""A request's lookups as the load-versus-recompute decision reads them (scheduler process,
no I/O): ``CostScan``, the chunks vLLM asked about in a row and, once decided, how far the
request loads; ``positions_of``, the fast path to vLLM's key -> position map. Used by
``TieredVllmManager.lookup`` (``manager.py``, whose docstring says how a scan is decided).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from tiered_kv.cost import LoadCosts, PrefixScan


@dataclass
class CostScan:
    """One request's leading offloaded chunks in the order its lookups found them, and
    once decided, the last token position it loads (-1: none). A new scan from the start
    (a failed load, no room to schedule) decides anew; a plan made at a step's end
    (``late``) stands until the request is preempted.

    While every chunk so far is a CPU chunk and a run of CPU chunks pays at every length
    (``PrefixScan.pays_alone``), the chunks are only counted (``lead``, ending at token
    ``lead_end``): every plan loads them (``PrefixScan``'s promise), so their keys and
    positions are never read. The first other chunk adds them to ``prefix``."""

    prefix: PrefixScan
    keys: list[bytes] = field(default_factory=list)  # after the lead
    positions: list[int] = field(default_factory=list)
    boundary: int | None = None
    late: bool = False
    leading: bool = True
    lead: int = 0
    lead_end: int = -1
    last: int = -1  # the position of the last chunk asked

    @classmethod
    def start(cls, costs: LoadCosts) -> "CostScan":
        prefix = PrefixScan(costs)
        return cls(prefix, leading=prefix.pays_alone("cpu"))

    def restart(self, costs: LoadCosts) -> None:
        """Forget the chunks asked so far (vLLM scans the request again from the start)."""
        self.prefix = PrefixScan(costs)
        self.keys.clear()
        self.positions.clear()
        self.lead, self.lead_end, self.last = 0, -1, -1
        self.boundary = self.boundary if self.late else None
        # A plan that stands answers every chunk, a CPU one too (no lead counted past it).
        self.leading = self.boundary is None and self.prefix.pays_alone("cpu")

    def lead_with(self, position: int) -> None:
        """One more CPU chunk of the lead, ending at token ``position``."""
        self.last = self.lead_end = position
        self.lead += 1

    def boundary_for(self, k: int) -> int:
        """The last token position of a plan that loads the first ``k`` chunks."""
        return self.positions[k - self.lead - 1] if k > self.lead else self.lead_end if k else -1


def positions_of(req_context: ReqContext) -> Callable[[OffloadKey], int | None]:
    """``req_context.get_offload_key_position``, asked per key: in vLLM 0.33 the
    positions are a dict that is never replaced, whose own ``get`` saves a Python call
    per key; where a later vLLM keeps them otherwise, its method."""
    positions = getattr(req_context, "_offload_key_positions", None)
    return positions.get if isinstance(positions, dict) else req_context.get_offload_key_position
