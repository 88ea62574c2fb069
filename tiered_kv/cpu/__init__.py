"""The pinned-CPU tier: its managers (scheduler process), its GPU <-> CPU handlers
(``handlers``, worker process) and its spec.

Eviction policies of the CPU tier (``eviction_policy``):

============  ==========================================================================
``lru``       least recently used first (``CPUOffloadingManager``); the default
``arc``       adaptive replacement: recency and reuse frequency balanced by ghost hits
              (``ARCOffloadingManager``)
============  ==========================================================================

Both never evict the blocks offered to the ``prepare_store`` call that needs room, and
rank a stored request's head most recent. With ``cpu_admission: reuse(N)`` either one
ranks a block first to evict until its Nth use (``CPUOffloadingManager``), with
``adaptive(N)`` only while miniature caches find that it pays; with
``cpu_retention: session`` either one passes over the blocks a ``SessionRetention``
holds for returning sessions (``tiered_kv.tiered.retention``). ``cpu_tier_for_rules``
builds the manager from those config values, for the hierarchy's spec and every tool
that measures it.
"""

import time
from collections.abc import Callable

from tiered_kv.config import adaptive_admission, admit_after, retention_share
from tiered_kv.cpu.arc import ARCOffloadingManager
from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.tiered.retention import SessionRetention

_POLICIES = {"lru": CPUOffloadingManager, "arc": ARCOffloadingManager}


def cpu_tier_manager(
    eviction_policy: str,
    num_slots: int,
    block_size: int,
    enable_events: bool = True,
    admit_after: int = 1,
    retention: SessionRetention | None = None,
    adaptive: bool = False,
) -> CPUOffloadingManager:
    """The CPU tier's manager for ``eviction_policy`` (``lru`` or ``arc``); ``admit_after``
    N > 1 (``cpu_admission: reuse(N)``) ranks a block first to evict until its Nth use,
    with ``adaptive`` (``adaptive(N)``) only while that pays; ``retention``
    (``cpu_retention: session``) holds returning sessions' blocks."""
    try:
        cls = _POLICIES[eviction_policy]
    except KeyError:
        raise ValueError(f"eviction_policy: expected one of {', '.join(_POLICIES)}, got {eviction_policy!r}") from None
    return cls(
        num_slots,
        block_size,
        enable_events=enable_events,
        admit_after=admit_after,
        retention=retention,
        adaptive=adaptive,
    )


def cpu_tier_for_rules(
    eviction_policy: str,
    num_slots: int,
    block_size: int,
    cpu_admission: str,
    cpu_retention: str,
    enable_events: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> CPUOffloadingManager:
    """The CPU tier's manager for the config values ``eviction_policy``, ``cpu_admission``
    and ``cpu_retention`` (parsed), the retention rule on ``clock``: what the hierarchy's
    spec builds, and what the replays and benchmarks build to measure it."""
    share = retention_share(cpu_retention)
    return cpu_tier_manager(
        eviction_policy,
        num_slots,
        block_size,
        enable_events=enable_events,
        admit_after=admit_after(cpu_admission, "cpu"),
        adaptive=adaptive_admission(cpu_admission),
        retention=None if share is None else SessionRetention(num_slots, share, clock=clock),
    )


__all__ = [
    "ARCOffloadingManager",
    "CPUOffloadingManager",
    "SessionRetention",
    "cpu_tier_for_rules",
    "cpu_tier_manager",
]
