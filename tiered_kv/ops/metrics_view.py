"""The per-tier view of a Prometheus endpoint that exports tiered-kv's metrics
(``tiered-kv stats``): a vLLM server with the tiered connector, or a process that
serves ``tiered_kv.metrics_export.PrometheusMetrics``.

Operator's process. I/O: one HTTP GET of the endpoint per ``scrape``, bounded in time
and size (``tiered_kv.ops.endpoint_get``); the rest is arithmetic on the samples, which
``check`` first proves fit for it (finite counts, buckets that never decrease). Series that differ only in labels the view does not use
(vLLM's ``engine`` and ``model_name``) are summed. Quantiles are estimated from the
histograms' buckets as PromQL's ``histogram_quantile`` does (linear within a bucket),
over everything the endpoint counted since it started.
"""

from __future__ import annotations

import io
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tiered_kv.metrics import (
    CANARY_CHECKS,
    GPU_BUSY_SHARE,
    HINT_ACTIONS,
    LEASE_PINNED_BYTES,
    LEASES,
    PREFETCH_HELD_BYTES,
    PREFILL_TOKENS_PER_S,
    REMOTE_BYTES,
    REMOTE_DAMAGED_DELETED,
    REMOTE_KEPT_UNPROVEN,
    REMOTE_DOWNLOADS,
    REMOTE_PROBES,
    REMOTE_REJECTED,
    REMOTE_REQUEST_SECONDS,
    REMOTE_UNAVAILABLE,
    REMOTE_UPLOADS,
    RETENTION_EVENTS,
    RETENTION_HELD_BLOCKS,
    RETENTION_HONOURED,
    RETENTION_TTL,
    TIER_BLOCKS,
    TIER_HELD_BACK_BLOCKS,
    TIER_INDEX_ERRORS,
    TIER_LOAD_GBPS,
    TIER_TOKENS,
    TIER_USED_BLOCKS,
    TRANSFER_JOBS,
    TRANSFER_SECONDS,
    VERIFICATION_SECONDS,
)
from tiered_kv.ops.endpoint_get import DEFAULT_MAX_BYTES, EndpointError, get, shorten

#: Sample name -> [(labels, value)].
Samples = dict[str, list[tuple[dict[str, str], float]]]
LabelMatch = Callable[[Mapping[str, str]], bool]

#: Quantiles the view shows.
QUANTILES = (0.5, 0.99)
#: Per-tier events that are failures: the block was not loaded or not stored.
FAILURE_EVENTS = ("failed_loads", "failed_stores", "checksum_failures")
_TRANSFER_BYTES = "vllm:kv_offload_total_bytes_total"
#: The most samples of the viewed metrics one answer may hold: an engine exports a few
#: thousand; a larger answer is not one, and would take memory out of all proportion.
MAX_SAMPLES = 200_000


def scrape(url: str, timeout: float = 10.0, max_bytes: int = DEFAULT_MAX_BYTES) -> Samples:
    """GET ``url`` (``endpoint_url``'s form) and parse what the view reads of it, within
    ``timeout`` seconds in all, the answer at most ``max_bytes`` long, and ``check``
    it. Raises ``EndpointError`` naming the URL."""
    deadline = time.monotonic() + timeout
    samples = parse(viewed(get(url, timeout, max_bytes).decode("utf-8", "replace"), url, deadline), url)
    check(samples, url)
    return samples


def viewed(text: str, where: str = "the endpoint", deadline: float | None = None) -> str:
    """The lines of ``_VIEWED`` metrics of an exposition (an engine's others passed over
    unparsed), at most ``MAX_SAMPLES`` samples, sifted by ``deadline``
    (``time.monotonic()``). Raises ``EndpointError``."""
    kept, count = [], 0
    for n, line in enumerate(io.StringIO(text)):
        if n % 100_000 == 0 and deadline is not None and time.monotonic() > deadline:
            raise EndpointError(f"{where}: its answer took longer than the timeout to read")
        if line.startswith(_VIEWED):
            count += 1
            if count > MAX_SAMPLES:
                raise EndpointError(f"{where} answered more than {MAX_SAMPLES:,} samples of tiered-kv's metrics")
            kept.append(line)
        elif line.startswith(("# HELP ", "# TYPE ")) and line[7:].startswith(_VIEWED):
            kept.append(line)
    return "".join(kept)


def parse(text: str, where: str = "the endpoint") -> Samples:
    """Samples of Prometheus' text exposition format. Raises ``EndpointError``."""
    samples: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[s.name].append((dict(s.labels), float(s.value)))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise EndpointError(f"{where} did not answer in Prometheus' text format ({shorten(exc)})") from None
    return dict(samples)


_CUMULATIVE = ("_total", "_bucket", "_count", "_sum")
#: Where the counters the view reads start.
_VIEWED = ("tiered_kv_", "vllm:kv_offload_")
#: The gauges and histograms the view reads.
_VIEWED_GAUGES = (
    TIER_LOAD_GBPS,
    PREFILL_TOKENS_PER_S,
    GPU_BUSY_SHARE,
    TIER_USED_BLOCKS,
    TIER_HELD_BACK_BLOCKS,
    LEASES,
    LEASE_PINNED_BYTES,
    PREFETCH_HELD_BYTES,
    RETENTION_HELD_BLOCKS,
    RETENTION_TTL,
    RETENTION_HONOURED,
)
_VIEWED_HISTOGRAMS = (TRANSFER_SECONDS, VERIFICATION_SECONDS, REMOTE_REQUEST_SECONDS)


def _series(name: str, labels: Mapping[str, str]) -> str:
    shown = ",".join(f'{k}="{shorten(v, 60)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{shown}}}" if shown else name


def _number(v: float) -> str:
    return "NaN" if math.isnan(v) else ("+Inf" if v == math.inf else ("-Inf" if v == -math.inf else f"{v:g}"))


def check(samples: Samples, where: str = "the endpoint") -> None:
    """Raises ``EndpointError`` naming the series and what was expected where a series the
    view reads would be misread: a counter or histogram count that is not a finite number
    >= 0, a gauge that is not finite, a bucket whose ``le`` is not a number, or a
    histogram whose bucket counts decrease as ``le`` grows. Other series are not read,
    so not judged."""
    histograms = {f"{h}{suffix}" for h in _VIEWED_HISTOGRAMS for suffix in ("_bucket", "_count")}
    for name, series in samples.items():
        counted = name in histograms or (name.endswith("_total") and name.startswith(_VIEWED))
        if not counted and name not in _VIEWED_GAUGES:
            continue
        for labels, v in series:
            if not math.isfinite(v) or (counted and v < 0):
                expected = "a finite count >= 0" if counted else "a finite number"
                raise EndpointError(f"{where}: {_series(name, labels)} is {_number(v)}; expected {expected}")
        if name.endswith("_bucket"):
            _check_buckets(name, series, where)


def _check_buckets(name: str, series: list[tuple[dict[str, str], float]], where: str) -> None:
    histograms: dict[tuple[tuple[str, str], ...], list[tuple[float, str, float]]] = defaultdict(list)
    for labels, count in series:
        le = labels.get("le", "")
        try:
            bound = float(le)
        except ValueError:
            bound = math.nan
        if math.isnan(bound):
            raise EndpointError(
                f'{where}: {_series(name, labels)} has le="{shorten(le, 60)}"; expected a bucket bound such '
                "as 0.1 or +Inf"
            )
        histograms[tuple(sorted((k, v) for k, v in labels.items() if k != "le"))].append((bound, le, count))
    for rest, buckets in histograms.items():
        buckets.sort()
        for (_, low_le, low), (_, high_le, high) in zip(buckets, buckets[1:]):
            if high < low:
                raise EndpointError(
                    f"{where}: histogram {_series(name, dict(rest))} counts {_number(low)} at "
                    f'le="{shorten(low_le, 60)}" but {_number(high)} at le="{shorten(high_le, 60)}"; '
                    "expected bucket counts that never decrease as le grows"
                )


def since(now: Samples, before: Samples) -> Samples:
    """What was counted between two scrapes: ``now``'s counters and histograms less
    ``before``'s, gauges as ``now``. A series lower than before (the server restarted)
    counts from 0."""
    out: Samples = {}
    for name, series in now.items():
        if not name.endswith(_CUMULATIVE):
            out[name] = series
            continue
        old = {tuple(sorted(labels.items())): v for labels, v in before.get(name, ())}
        diff = []
        for labels, v in series:
            prev = old.get(tuple(sorted(labels.items())), 0.0)
            diff.append((labels, v - prev if v >= prev else v))
        out[name] = diff
    return out


def _match(**labels: str) -> LabelMatch:
    return lambda have: all(have.get(k) == v for k, v in labels.items())


def total(samples: Samples, name: str, match: LabelMatch = lambda _: True) -> float:
    """The sum of ``name``'s series whose labels ``match``."""
    return sum(v for labels, v in samples.get(name, ()) if match(labels))


def gauge(samples: Samples, name: str, match: LabelMatch = lambda _: True) -> float | None:
    """The mean of gauge ``name``'s series that ``match`` (one per engine), or None."""
    values = [v for labels, v in samples.get(name, ()) if match(labels)]
    return sum(values) / len(values) if values else None


def by_label(samples: Samples, name: str, label: str, match: LabelMatch = lambda _: True) -> dict[str, float]:
    """``name``'s series that ``match``, summed per value of ``label``."""
    out: dict[str, float] = defaultdict(float)
    for labels, v in samples.get(name, ()):
        if label in labels and match(labels):
            out[labels[label]] += v
    return dict(out)


def quantile(samples: Samples, histogram: str, q: float, match: LabelMatch = lambda _: True) -> float | None:
    """The ``q`` quantile of ``histogram``'s observations whose labels ``match`` (the
    series' buckets summed), or None without observations."""
    buckets = by_label(samples, f"{histogram}_bucket", "le", match)
    bounds = sorted((float(le), n) for le, n in buckets.items())
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if math.isinf(bound):
                return lower  # past the last finite bucket: its bound, as PromQL answers
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _latency(samples: Samples, histogram: str, match: LabelMatch) -> dict[str, Any]:
    out: dict[str, Any] = {"count": int(total(samples, f"{histogram}_count", match))}
    for q in QUANTILES:
        out[f"p{round(q * 100)}_seconds"] = quantile(samples, histogram, q, match)
    return out


def _is_load(transfer_type: str, tier: str) -> bool:
    """Whether ``transfer_type`` loads from ``tier`` into memory that serves requests
    (GPU, or the CPU tier from a lower one): ``disk_to_cpu``, ``disk_to_gpu``,
    ``cpu_to_gpu``; not a spill such as ``cpu_to_disk``."""
    src, _, dst = transfer_type.partition("_to_")
    return src == tier and dst in ("gpu", "cpu") and dst != tier


def _loads_from(tier: str) -> LabelMatch:
    return lambda labels: _is_load(labels.get("transfer_type", ""), tier)


def _rate(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _tier(samples: Samples, tier: str) -> dict[str, Any]:
    blocks = by_label(samples, f"{TIER_BLOCKS}_total", "event", _match(tier=tier))
    tokens = by_label(samples, f"{TIER_TOKENS}_total", "event", _match(tier=tier))
    transfers = by_label(samples, _TRANSFER_BYTES, "transfer_type")
    return {
        "tier": tier,
        "lookups_tokens": int(tokens.get("lookups", 0)),
        "hits_tokens": int(tokens.get("hits", 0)),
        "hit_rate_tokens": _rate(tokens.get("hits", 0), tokens.get("lookups", 0)),
        "lookups_blocks": int(blocks.get("lookups", 0)),
        "hits_blocks": int(blocks.get("hits", 0)),
        "stores_blocks": int(blocks.get("stores", 0)),
        "evictions_blocks": int(blocks.get("evictions", 0)),
        "drops_blocks": int(blocks.get("drops", 0)),
        "skipped_slower_blocks": int(blocks.get("skipped_slower_than_recompute", 0)),
        "not_admitted_blocks": int(blocks.get("not_admitted", 0)),
        "admission_switches": int(blocks.get("admission_switches", 0)),
        "load_gbps_estimate": gauge(samples, TIER_LOAD_GBPS, _match(tier=tier)),
        "failures_blocks": int(sum(blocks.get(e, 0) for e in FAILURE_EVENTS)),
        "used_blocks": int(total(samples, TIER_USED_BLOCKS, _match(tier=tier))),
        # Counted in used_blocks; only a tier that holds slots back exports them.
        "held_back_blocks": {
            k: int(v) for k, v in by_label(samples, TIER_HELD_BACK_BLOCKS, "reason", _match(tier=tier)).items()
        },
        # Only a tier that keeps an index exports its failed reads and commits.
        "index_errors": {
            k: int(v) for k, v in by_label(samples, f"{TIER_INDEX_ERRORS}_total", "op", _match(tier=tier)).items()
        },
        "bytes_loaded": int(sum(v for t, v in transfers.items() if _is_load(t, tier))),
        "bytes_stored": int(sum(v for t, v in transfers.items() if t.endswith(f"_to_{tier}"))),
        "load_latency": _latency(samples, TRANSFER_SECONDS, _loads_from(tier)),
        "verification_latency": _latency(samples, VERIFICATION_SECONDS, _match(tier=tier)),
        "prefetch_blocks": {e: int(blocks.get(e, 0)) for e in ("prefetches", "prefetch_used", "prefetch_wasted")},
    }


def _sessions(samples: Samples) -> dict[str, Any]:
    """Session retention per tier that has a rule, leases and KV-hint actions, and the
    workers' start-up canaries (their outcomes summed over ranks)."""
    retention = {}
    for tier in sorted(by_label(samples, RETENTION_HELD_BLOCKS, "tier")):
        events = by_label(samples, f"{RETENTION_EVENTS}_total", "event", _match(tier=tier))
        retention[tier] = {
            "returns": int(events.get("returns", 0)),
            "held_blocks": int(total(samples, RETENTION_HELD_BLOCKS, _match(tier=tier))),
            "hold_seconds": gauge(samples, RETENTION_TTL, _match(tier=tier)),
            "dropped_for_budget": int(events.get("dropped", 0)),
            # Each engine honours its holds but while ``cpu_admission: adaptive(N)`` finds they cost hits.
            "honoured": (g := gauge(samples, RETENTION_HONOURED, _match(tier=tier))) is None or g >= 1,
            "switches": int(events.get("switches", 0)),
        }
    actions: dict[str, int] = {}
    for labels, v in samples.get(f"{HINT_ACTIONS}_total", []):
        key = f"{labels.get('action', '?')}.{labels.get('outcome', '?')}"
        actions[key] = actions.get(key, 0) + int(v)
    return {
        "retention": retention,
        "leases": int(total(samples, LEASES)),
        "lease_pinned_bytes": {k: int(v) for k, v in by_label(samples, LEASE_PINNED_BYTES, "tier").items()},
        "prefetch_held_bytes": int(total(samples, PREFETCH_HELD_BYTES)),
        "hint_actions": {k: n for k, n in sorted(actions.items()) if n},
        "canary": {k: int(v) for k, v in by_label(samples, f"{CANARY_CHECKS}_total", "outcome").items() if v},
    }


def _transfers(samples: Samples) -> list[dict[str, Any]]:
    names = set(by_label(samples, _TRANSFER_BYTES, "transfer_type"))
    names |= set(by_label(samples, f"{TRANSFER_JOBS}_total", "transfer_type"))
    out = []
    for name in sorted(names):
        jobs = by_label(samples, f"{TRANSFER_JOBS}_total", "outcome", _match(transfer_type=name))
        out.append(
            {
                "transfer_type": name,
                "bytes": int(total(samples, _TRANSFER_BYTES, _match(transfer_type=name))),
                "jobs_ok": int(jobs.get("ok", 0)),
                "jobs_failed": int(jobs.get("failed", 0)),
                "latency": _latency(samples, TRANSFER_SECONDS, _match(transfer_type=name)),
            }
        )
    return out


def _remote(samples: Samples) -> dict[str, Any] | None:
    # An unlabelled counter is exported (at 0) by every PrometheusMetrics; a series with
    # labels exists only once a store counted something.
    if not any(
        name.startswith("tiered_kv_remote_") and any(labels for labels, _ in series) for name, series in samples.items()
    ):
        return None

    def count(metric: str, label: str) -> dict[str, int]:
        return {k: int(v) for k, v in by_label(samples, f"{metric}_total", label).items()}

    ops = sorted(by_label(samples, f"{REMOTE_REQUEST_SECONDS}_count", "op"))
    return {
        "uploads": count(REMOTE_UPLOADS, "outcome"),
        "downloads": count(REMOTE_DOWNLOADS, "outcome"),
        "probes": count(REMOTE_PROBES, "outcome"),
        "bytes": count(REMOTE_BYTES, "direction"),
        "rejected": {k: v for k, v in count(REMOTE_REJECTED, "reason").items() if v},
        "unavailable_periods": int(total(samples, f"{REMOTE_UNAVAILABLE}_total")),
        "damaged_deleted": int(total(samples, f"{REMOTE_DAMAGED_DELETED}_total")),
        "kept_unproven": int(total(samples, f"{REMOTE_KEPT_UNPROVEN}_total")),
        "request_latency": {op: _latency(samples, REMOTE_REQUEST_SECONDS, _match(op=op)) for op in ops},
    }


def summarize(samples: Samples) -> dict[str, Any]:
    """The view: ``tiers`` (per tier: hit rate in tokens, blocks, bytes loaded from it
    and stored into it, load and verification latency, the load estimate and blocks passed over as slower
    than recomputing, drops, failures, prefetched blocks, slots held back per reason), ``transfers`` (per
    transfer type), ``remote`` (the shared tier's store, or None when the endpoint has none), ``sessions``
    (session retention per tier, leases, KV-hint actions, start-up canaries), ``prefill_tokens_per_s`` (used,
    measured; None if absent), ``gpu_busy_share`` (the decision's estimate; None if absent) and ``gpu``
    (vLLM's load and store bytes)."""
    tiers = by_label(samples, f"{TIER_BLOCKS}_total", "tier")
    order = {"cpu": 0, "disk": 1, "remote": 3}
    return {
        "tiers": [_tier(samples, t) for t in sorted(tiers, key=lambda t: (order.get(t, 2), t))],
        "transfers": _transfers(samples),
        "remote": _remote(samples),
        "sessions": _sessions(samples),
        "prefill_tokens_per_s": {
            kind: gauge(samples, PREFILL_TOKENS_PER_S, _match(kind=kind)) for kind in ("used", "measured")
        },
        "gpu_busy_share": gauge(samples, GPU_BUSY_SHARE),
        "gpu": {
            "load_bytes": int(total(samples, "vllm:kv_offload_load_bytes_total")),
            "store_bytes": int(total(samples, "vllm:kv_offload_store_bytes_total")),
        },
    }
