"""What the operator's tools ask of a tier: the types of the operator hooks on the seam.

Imported by ``tiered_kv.tiers`` (whose ``TierSpec`` has the hooks, each with a default)
and by the tools (``tiered-kv doctor``, ``inspect --tier``, ``config``); no I/O here.
The tools iterate the config's tiers and ask each tier's class, so a tier written
outside the package shows up in them with no edit outside its own module:

| hook (``TierSpec``) | asked by | default |
|---|---|---|
| ``doctor_checks(entry, ctx)`` | ``tiered-kv doctor`` | one ``skip`` line: no checks declared |
| ``inspector(entry, ctx)`` | ``tiered-kv inspect VERB --tier NAME`` (summary, ls, verify, clear) | None: the tier is refused, named |
| ``config_info()`` / ``config_info_keys`` | vLLM's ``vllm:kv_offload_config_info`` | the tier's type |
| ``warm_writer()`` | ``tiered-kv warmup`` (the config's first tier that offers one) | None: not warmed |
| ``prior_gbps`` | the load decision before its first sample | a network's |
| ``metric_definitions``, ``worker_counters`` / ``worker_timings`` | vLLM's metrics, the exporter, ``tiered-kv stats`` | none beyond the hierarchy's (every tier is a ``tier`` label of those) |

A ``Check`` is one line of the doctor's report; a ``TierInspector`` is what ``inspect``
does with one tier (its verbs refuse by default, naming the tier and the verb).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from tiered_kv.config import TieredConfig
    from tiered_kv.tier_registry import TierEntry


OK, WARN, FAIL = "ok", "warn", "fail"
#: A check that could not run (no config, a config that could not be read, a probe the
#: file system refused, ``--read-probe 0``): no verdict, so no part in the exit code.
SKIP = "skip"
EXIT_CODES = {OK: 0, WARN: 1, FAIL: 2}
STATUSES = (OK, SKIP, WARN, FAIL)


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report: what was checked, the verdict, what was found, and
    (unless ok) what to do about it. ``facts`` are the measured values, for ``--json``. A
    ``SKIP`` line's message starts with "skipped" and says why (``skipped``)."""

    name: str
    status: str
    message: str
    fix: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "message": self.message,
            "fix": self.fix,
            "facts": dict(self.facts),
        }


def skipped(name: str, why: str, fix: str = "", facts: Mapping[str, Any] | None = None) -> Check:
    """The line of check ``name``, which could not run because of ``why``."""
    return Check(name, SKIP, f"skipped: {why}", fix, dict(facts or {}))


@dataclass(frozen=True)
class ToolContext:
    """What a tool knows of the server when it asks a tier: its whole config, its
    tensor-parallel size, whether a disk tier's ``bytes`` count per node (vLLM's
    ``TieringOffloadingSpec``: one writer for all ranks) rather than per rank, the
    server's connector settings (``extra``), and the doctor's probe settings."""

    config: "TieredConfig"
    tp: int = 1
    per_node: bool = False
    extra: Mapping[str, Any] | None = None
    read_probe: int = 0
    mountinfo: str = "/proc/self/mountinfo"


class BlockWriter(Protocol):
    """What the warm-up writes a tier's blocks through (``TierSpec.warm_writer``), in the
    operator's process, beside the tier's own bookkeeping (its ``get_manager``, whose
    ``prepare_store`` gives the slots and whose ``complete_store`` makes them loadable)."""

    def write_blocks(
        self, rank: int, block_hashes: Sequence[bytes], slots: Sequence[int], rows: "torch.Tensor"
    ) -> Sequence[bool]:
        """Write rank ``rank``'s bytes of each block (one row of ``rows`` each, at least
        the layout's block bytes, zero padded) durably; per block, whether it was."""

    def close(self) -> None:
        """Release what the writer opened. Idempotent."""


class InspectRefused(Exception):
    """A verb a tier's inspector does not offer (the message names the tier and the verb)."""


class TierInspector:
    """What ``tiered-kv inspect VERB --tier NAME`` does with one tier. Operator's process;
    each verb reads (or, for ``evict`` and ``clear``, changes) the tier's own storage.
    Every verb refuses by default, naming the tier: a tier offers what it can answer for.
    Results are JSON-able mappings, printed as a table or with ``--json``."""

    def __init__(self, entry: "TierEntry", ctx: ToolContext):
        self.entry = entry
        self.ctx = ctx

    def refuse(self, verb: str) -> InspectRefused:
        """The error of a verb this tier does not offer."""
        return InspectRefused(
            f"inspect {verb} --tier {self.entry.name}: a tier of type {self.entry.type_name} does not offer it"
        )

    def summary(self) -> dict[str, Any]:
        """What the tier holds: blocks, bytes, capacity, and whatever else it knows."""
        raise self.refuse("summary")

    def ls(self, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` of its blocks (0: all), one mapping each."""
        raise self.refuse("ls")

    def verify(self) -> dict[str, Any]:
        """Read every block back and check it; counts by outcome."""
        raise self.refuse("verify")

    def clear(self, dry_run: bool) -> dict[str, Any]:
        """Drop every block (``dry_run``: only say how many)."""
        raise self.refuse("clear")


__all__ = [
    "EXIT_CODES",
    "FAIL",
    "OK",
    "SKIP",
    "STATUSES",
    "WARN",
    "BlockWriter",
    "Check",
    "InspectRefused",
    "TierInspector",
    "ToolContext",
    "skipped",
]
