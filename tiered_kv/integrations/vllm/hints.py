"""vLLM 0.33's KV hints, read by ``TieredVllmManager``, and prefetch while a request waits.
Scheduler process; bookkeeping only, no I/O.

vLLM hands every offloading manager the request's ``KvHintsEnvelope``
(``vllm/v1/kv_hints/protocol.py``) as ``ReqContext.kv_hints``: ``protocol_version``,
``message_id`` and ``actions``, each a ``KvHintAction`` with ``action_id``,
``action_type``, ``action_version`` and a JSON ``payload`` whose schema belongs to the
component that implements the action. This one implements three, all version ``1``
(``action_version`` ``"1"`` or ``"1.<minor>"``), in envelopes of ``protocol_version``
``0.<minor>`` or ``1.<minor>``:

- ``kv.retain``: a lease on this request's prefix. Payload: ``ttl_s`` (seconds, a
  number > 0; default ``DEFAULT_TTL_S``, at most ``HintSettings.max_ttl_s``) and
  ``lease_id`` (a non-empty string of at most ``MAX_LEASE_ID`` characters; default the
  request's id), a name within the request's tenant (its ``cache_salt``, under
  ``TieredOffloadingConnector``): another tenant's equal id is another lease. While the lease holds, each chunk of the prefix is pinned in the
  fastest tier of this node that holds it (CPU first, then a local lower tier; a
  fleet's shared tier is never pinned), as its stores land; a load of a leased chunk
  renews the lease for another ``ttl_s``. A ``kv.retain`` with a ``lease_id`` already
  held moves that lease to this request's prefix (a session's next turn). At most
  ``leases.MAX_LEASES`` leases are held (a new one past that ends a lease of the tenant holding
  the most, that tenant's nearest its end). Pins are bounded per tier
  (``HintSettings.lease_budget``, a share of the tier's slots, at most half): past it a
  chunk is left unpinned (counted), so leases never starve a tier, and pinned in a lower
  tier once a copy there is loadable (``tiered_kv.integrations.vllm.leases``).
- ``kv.prefetch``: promote the prefix's lower-tier chunks (disk, shared tier) into CPU
  now, ahead of the waiting requests' own prefetches, and not cancelled when this
  request runs or ends. No payload fields.
- ``kv.release``: drop a lease once this request ends (finished or aborted), so that a
  session's last turn, which says it is the last, is still served by the lease it ends.
  Payload: ``lease_id`` (default the request's id).

Unknown payload fields are ignored (a newer minor version may add some). An action of
another type or major version, a payload field of the wrong type or out of range, an
envelope of another protocol version, or past the first ``MAX_ACTIONS`` actions, is
ignored and counted (``tiered_kv_hint_actions``); nothing about a hint can fail a
request or the engine.

Prefetch while waiting (``HintSettings.prefetch_waiting``, hint or not): a request's
chunks that a lower tier holds start moving into CPU when the request arrives
(``tiered_kv.tiered.prefetch.Prefetcher``, which reuses the composite's promotion), in
arrival order, behind the loads (a tier reading for a request's load, or congested with
writes, gets none), at most ``prefetch_max_bytes`` in flight; what it brings, and the
chunks it already has in CPU, are held there for it (pinned, oldest request first,
within half the CPU tier's slots, less where leases may pin over a quarter) so the
stores of the requests ahead cannot evict them; its queue and holds are dropped once it
runs (loads or computes), finishes or is aborted. vLLM 0.33 places a request's keys when
it first looks the request up, at the head of its queue: a connector that wants the keys
at arrival calls ``on_request_keys`` right after ``on_new_request`` (``prefetch_jobs``).
A prefetch is a worker job too, which vLLM's connector does not carry: prefetches run
only once whoever carries them (``prefetch_jobs``, or the serving replay's simulated
workers) calls ``enable_prefetch``; until then ``kv.prefetch`` is counted as
``unsupported`` and nothing waits for it.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import ReqContext

from tiered_kv.abstract import BlockHash, LowerTier
from tiered_kv.config import TieredConfig
from tiered_kv.integrations.vllm.common import REQUEST_TENANT, CpuOnly
from tiered_kv.integrations.vllm.health import SlotHealth
from tiered_kv.integrations.vllm.leases import LeaseBook, LeaseId
from tiered_kv.metrics import HINT_ACTIONS, LEASE_PINNED_BYTES, LEASES, PREFETCH_HELD_BYTES, TIER_BLOCKS, CounterValue
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.prefetch import PrefetchJob, Prefetcher

logger = logging.getLogger(__name__)

RETAIN, PREFETCH, RELEASE = "kv.retain", "kv.prefetch", "kv.release"
#: Action type -> the ``action`` label of ``tiered_kv_hint_actions``.
ACTIONS = {RETAIN: "retain", PREFETCH: "prefetch", RELEASE: "release"}
DEFAULT_TTL_S = 300.0
MAX_LEASE_ID = 256
#: Actions read per envelope; the rest are counted as ``too_many``.
MAX_ACTIONS = 16
_VERSION = re.compile(r"(\d{1,9})(?:\.\d{1,9}){0,7}")  # bounded: int() of 4,300 digits raises


@dataclass(frozen=True)
class HintSettings:
    """``prefetch_waiting``: prefetch a waiting request's lower-tier chunks, hint or not;
    ``prefetch_max_bytes``: bytes of prefetch reads in flight; ``lease_budget``: the
    share of each tier's slots leases may pin (0 to 0.5); ``max_ttl_s``: the longest
    lease a hint may ask for."""

    prefetch_waiting: bool = True
    prefetch_max_bytes: int = 256 << 20
    lease_budget: float = 0.25
    max_ttl_s: float = 3600.0

    @classmethod
    def from_config(cls, config: TieredConfig) -> "HintSettings":
        """The config's ``prefetch_waiting``, ``prefetch_max_bytes``, ``lease_budget`` and
        ``lease_max_ttl_s`` (validated there)."""
        return cls(config.prefetch_waiting, config.prefetch_max_bytes, config.lease_budget, config.lease_max_ttl_s)


# ---------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Action:
    """One accepted action: its type (``RETAIN``, ``PREFETCH``, ``RELEASE``), the lease
    it names (retain, release) and the lease's TTL (retain)."""

    kind: str
    lease_id: str | None = None
    ttl_s: float = DEFAULT_TTL_S


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _major(version: Any) -> int | None:
    match = _VERSION.fullmatch(version) if isinstance(version, str) else None
    return int(match.group(1)) if match else None


def parse_hints(envelope: Any, req_id: str, max_ttl_s: float) -> tuple[list[Action], Counter[tuple[str, str]]]:
    """The accepted actions of ``envelope`` (a ``KvHintsEnvelope`` or its JSON form; None:
    none), and every action's ``(action, outcome)`` count (module docstring). Never raises."""
    outcomes: Counter[tuple[str, str]] = Counter()
    actions: list[Action] = []
    if envelope is None:
        return actions, outcomes
    raw_actions = _field(envelope, "actions")
    if not isinstance(raw_actions, (list, tuple)):
        outcomes[("other", "malformed")] += 1
        return actions, outcomes
    supported = _major(_field(envelope, "protocol_version")) in (0, 1)
    for i, raw in enumerate(raw_actions):
        kind = _field(raw, "action_type")
        label = ACTIONS.get(kind, "other") if isinstance(kind, str) else "other"
        if i >= MAX_ACTIONS:
            outcomes[(label, "too_many")] += 1
            continue
        if not supported:
            outcomes[(label, "unsupported_version")] += 1
            continue
        if label == "other":
            outcomes[(label, "unknown_action")] += 1
            continue
        if _major(_field(raw, "action_version")) != 1:
            outcomes[(label, "unsupported_version")] += 1
            continue
        action = _action(kind, _field(raw, "payload"), req_id, max_ttl_s)
        outcomes[(label, "accepted" if action is not None else "malformed")] += 1
        if action is not None:
            actions.append(action)
    return actions, outcomes


def _action(kind: str, payload: Any, req_id: str, max_ttl_s: float) -> Action | None:
    if not isinstance(payload, Mapping):
        return None
    if kind == PREFETCH:
        return Action(PREFETCH)
    lease_id = payload.get("lease_id", req_id)
    if not isinstance(lease_id, str) or not 0 < len(lease_id) <= MAX_LEASE_ID:
        return None
    if kind == RELEASE:
        return Action(RELEASE, lease_id)
    ttl = payload.get("ttl_s", DEFAULT_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < math.inf:
        return None
    return Action(RETAIN, lease_id, min(ttl, max_ttl_s) * 1.0)  # an int past float's range: no float()


def request_keys(req_context: ReqContext) -> list[BlockHash]:
    """The request's chunk keys vLLM has placed so far, in prefix order (empty before
    its first lookup unless a connector placed them at arrival)."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict) or not positions:
        return []
    return sorted(positions, key=positions.__getitem__)


# ---------------------------------------------------------------- the manager's side


@dataclass
class _Request:
    context: ReqContext
    actions: list[Action] = field(default_factory=list)
    started: bool = False  # loading or scheduled: its own prefetch is over
    tenant: str | None = None  # the scope of its lease ids
    releases: list[LeaseId] = field(default_factory=list)  # leases it ends when it ends


class KvHints:
    """What ``TieredVllmManager`` does with hints and waiting requests (module docstring).
    ``shared``: per lower tier, whether it is a fleet's (never pinned); ``health``: the
    slot marks a failed prefetch leaves; ``clock``: seconds, for lease TTLs."""

    def __init__(
        self,
        composite: TieredOffloadingManager,
        *,
        shared: Sequence[bool],
        health: SlotHealth,
        settings: HintSettings | None = None,
        bytes_per_block: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings or HintSettings()
        self.composite, self.health, self.clock = composite, health, clock
        self.bytes_per_block = bytes_per_block
        local = [t for t, s in zip(composite.lower, shared) if not s]
        self._local: list[LowerTier] = local
        fraction = self.settings.lease_budget
        self.leases = LeaseBook(
            [composite.cpu, *local],
            ["cpu", *(t.name for t in local)],
            [int(fraction * composite.cpu.num_slots), *(int(fraction * t.capacity) for t in local)],
        )
        self.prefetcher: Prefetcher | None = None
        self._requests: dict[str, _Request] = {}
        self._awaiting_keys: set[str] = set()
        self._jobs: list[PrefetchJob] = []
        self._outcomes: Counter[tuple[str, str]] = Counter()
        self._warned: set[tuple[str, str]] = set()

    @classmethod
    def for_manager(cls, manager: Any, settings: HintSettings | None = None) -> "KvHints":
        """For ``TieredVllmManager`` ``manager``: its composite, tiers, slot health and
        clock (the load estimates')."""
        composite: TieredOffloadingManager = manager.composite
        costs = composite.costs
        block_bytes = next((getattr(t, "block_bytes", None) for t in composite.lower), None)
        return cls(
            composite,
            shared=manager.shared,
            health=manager.health,
            settings=settings,
            bytes_per_block=costs.bytes_per_block if costs is not None else block_bytes or 1,
            clock=costs.clock if costs is not None else time.monotonic,
        )

    def enable_prefetch(self) -> None:
        """Whoever runs prefetch jobs on the workers turns prefetch on (module docstring).
        What it holds for waiting requests and what leases pin leave at least a quarter
        of the CPU tier's slots unpinned: holds take half the slots, less where the lease
        budget is over a quarter."""
        if self.prefetcher is None and self.composite.lower:
            slots = self.composite.cpu.num_slots
            leased = int(self.settings.lease_budget * slots)
            self.prefetcher = Prefetcher(
                self.composite,
                bytes_per_block=self.bytes_per_block,
                max_bytes_in_flight=max(self.settings.prefetch_max_bytes, self.bytes_per_block),
                max_held=max(1, min(slots // 2, slots - slots // 4 - leased)),
            )

    # ------------------------------------------------------------------ requests

    def on_new_request(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        actions, outcomes = parse_hints(req_context.kv_hints, req_id, self.settings.max_ttl_s)
        if self.prefetcher is None and ("prefetch", "accepted") in outcomes:
            # No worker runs prefetch jobs here (``enable_prefetch``): nothing would move.
            outcomes[("prefetch", "unsupported")] += outcomes.pop(("prefetch", "accepted"))
            actions = [a for a in actions if a.kind != PREFETCH]
        self._note(outcomes, req_id)
        request = _Request(req_context, tenant=REQUEST_TENANT.get())
        now = self.clock()
        for action in actions:
            lease_id = (request.tenant, action.lease_id or req_id)
            if action.kind == RELEASE:
                request.releases.append(lease_id)
                continue
            if action.kind == RETAIN:
                # Held now; it covers this request's prefix once its keys are placed (a
                # lease already held keeps its chunks until then).
                self.leases.hold(lease_id, action.ttl_s, now)
            request.actions.append(action)
        if request.actions or request.releases or (self.prefetcher is not None and self.settings.prefetch_waiting):
            self._requests[req_id] = request
            self._awaiting_keys.add(req_id)
            self.on_request_keys(req_context)

    def on_request_keys(self, req_context: ReqContext) -> None:
        """The request's keys are placed (at arrival by a connector that places them, else
        at its first lookup, noticed at the step's end): its hints and its prefetch act."""
        req_id = req_context.req_id
        request = self._requests.get(req_id)
        if request is None or req_id not in self._awaiting_keys:
            return
        keys = request_keys(req_context)
        if not keys:
            return
        self._awaiting_keys.discard(req_id)
        # A request served by CPU alone (``CpuOnly``) has nothing to move up into it.
        prefetcher = self.prefetcher if req_context.get_state(CpuOnly) is None else None
        for action in request.actions:
            lease_id = (request.tenant, action.lease_id or req_id)
            if action.kind == RETAIN and lease_id in self.leases.leases:  # not released since
                self.leases.retain(lease_id, keys, action.ttl_s, self.clock())
            elif action.kind == PREFETCH and prefetcher is not None:
                prefetcher.want(f"hint:{req_id}", keys, first=True)
        if prefetcher is not None and self.settings.prefetch_waiting and not request.started:
            prefetcher.want(req_id, keys)
        if not request.actions and not request.releases:
            del self._requests[req_id]

    def _started(self, req_id: str) -> None:
        if self.prefetcher is not None:
            self.prefetcher.cancel(req_id)
        request = self._requests.get(req_id)
        if request is not None:
            request.started = True

    def on_load(self, req_id: str, keys: Sequence[BlockHash]) -> None:
        """The request loads ``keys`` (``prepare_load``): its prefetch is over; leases renew."""
        self._started(req_id)
        if self.prefetcher is not None:
            self.prefetcher.loaded(keys)
        self.leases.renew(keys, self.clock())

    def on_stored(self, keys: Sequence[BlockHash]) -> None:
        """Stores of ``keys`` landed in CPU: leased ones are pinned."""
        self.leases.pin_where_held(keys)

    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        if self.prefetcher is not None:
            self.prefetcher.cancel(req_id)
        request = self._requests.pop(req_id, None)
        self._awaiting_keys.discard(req_id)
        for lease_id in request.releases if request is not None else ():
            self.leases.release(lease_id)

    def step(self, new_req_ids: Iterable[str]) -> None:
        """The step's end: keys placed since, requests scheduled, leases expired, jobs issued."""
        for req_id in new_req_ids:
            self._started(req_id)
        for req_id in list(self._awaiting_keys):
            self.on_request_keys(self._requests[req_id].context)
        self.leases.expire(self.clock())
        self.leases.retry_unpinned()
        if self.prefetcher is not None:
            self._jobs += self.prefetcher.issue()

    # ------------------------------------------------------------------ jobs

    def take_jobs(self) -> list[PrefetchJob]:
        """The prefetch jobs issued since the last call, for the workers."""
        jobs, self._jobs = self._jobs, []
        return jobs

    def complete(self, job_id: int) -> None:
        """Prefetch job ``job_id`` ended on every rank; the chunks of its CPU slots a
        worker marked bad are dropped."""
        if self.prefetcher is None:
            return
        hashes, slots = self.prefetcher.job_blocks(job_id)
        bad = self.health.take_bad(slots)
        failed = [h for h, s in zip(hashes, slots) if s in bad]
        if failed:
            logger.error(
                "prefetch job %d: %d chunks did not reach the CPU tier; they are not kept", job_id, len(failed)
            )
        for block_hash in self.prefetcher.complete(job_id, failed):
            for tier in self._local:  # read before a reset: the reset drops them too
                tier.remove(block_hash)

    def busy(self) -> bool:
        """Prefetch jobs to hand out or in flight: the engine keeps stepping to see them end."""
        return bool(self._jobs) or (self.prefetcher is not None and self.prefetcher.bytes_in_flight > 0)

    def reset(self) -> None:
        """A cache reset: every lease is dropped (the KV it held may be stale), every
        prefetch queue forgotten; prefetches in flight end as failed."""
        self.leases.clear()
        if self.prefetcher is not None:
            self.prefetcher.abandon()
            for job in self.take_jobs():
                self.complete(job.job_id)

    # ------------------------------------------------------------------ metrics

    def _note(self, outcomes: Counter[tuple[str, str]], req_id: str) -> None:
        self._outcomes.update(outcomes)
        for key in outcomes:
            if key[1] != "accepted" and key not in self._warned:
                self._warned.add(key)
                logger.warning("request %s: KV hint ignored (%s, %s); counted from now on", req_id, *key)

    def counters(self) -> list[CounterValue]:
        """Totals: prefetch events per source tier (``tiered_kv_tier_blocks``), and the
        hint actions."""
        out: list[CounterValue] = []
        if self.prefetcher is not None:
            out += [(TIER_BLOCKS, (tier, event), n) for tier, event, n in self.prefetcher.counters()]
        out += [(HINT_ACTIONS, key, n) for key, n in self._outcomes.items()]
        return out

    def gauges(self) -> list[CounterValue]:
        out: list[CounterValue] = [(LEASES, (), len(self.leases.leases))]
        out += [
            (LEASE_PINNED_BYTES, (name,), n * self.bytes_per_block)
            for name, n in zip(self.leases.names, self.leases.pinned)
        ]
        if self.prefetcher is not None:
            out.append((PREFETCH_HELD_BYTES, (), self.prefetcher.held_blocks * self.bytes_per_block))
        return out

    def snapshot(self) -> dict[str, Any]:
        """Everything counted so far, for tests and the replay."""
        prefetch = {f"{t}.{e}": n for t, e, n in self.prefetcher.counters()} if self.prefetcher is not None else {}
        return {
            "actions": {f"{a}.{o}": n for (a, o), n in self._outcomes.items()},
            "leases": len(self.leases.leases),
            "pinned_blocks": dict(zip(self.leases.names, self.leases.pinned)),
            "lease_clipped": self.leases.clipped,
            "prefetch": prefetch,
        }
