#!/usr/bin/env python
"""Scheduler-side cost of the composite manager beside vLLM's own CPU LRU manager.

One process, same block counts, same operation sequence. Prints, per tier size, the
per-block cost (ns) of lookup, prepare_store, complete_store and touch for:

- ``vllm-cpu``: vLLM 0.33's ``CPUOffloadingManager`` (per-key API), when vLLM is importable;
- ``tiered-cpu``: our composite manager over the CPU tier alone;
- ``tiered-cpu+disk``: the composite with the disk tier attached (write-through; block
  placement and index bookkeeping only: no bytes move, so this is the scheduler's cost);
  both tiered rows decide per lookup whether loading beats recomputing (on by default),
  and ``cost-aware off`` is the same composite loading every block found: the
  difference in ``lookup`` is the decision's cost, measured again on its own in alternated
  rounds over runs that span both tiers (``decision_cost``).

And the latency distribution of a 256-block ``prepare_store`` that cascades (a full CPU
tier; every call spills 256 blocks to the disk tier, and in the second half of the
calls, the disk being full, evicts 256 there too; and again on a disk tier that a
restart found full, where every call evicts 256 of those blocks), p50/p99 in
microseconds, beside vLLM's manager evicting 256 blocks from a full tier in the same
run, and beside plain interpreter work of the same median length timed between the
calls (the machine's own jitter). In both managers, each call's store completes after
the next call, so one store is always in flight (pending, not evictable), as in an
engine. Both latency loops run with the heap built before them frozen (``gc.freeze``),
as vLLM's EngineCore runs after startup.

And what the disk tier's flusher thread does per 256 stored blocks in the scheduler
process: ``refresh()`` reading 256 workers' commits from the index log and making the
blocks loadable, beside reading such log records alone, in alternate rounds of the
same run (medians of 200).

    python tools/bench_manager.py                 # 10k, 100k, 1M blocks
    python tools/bench_manager.py --sizes 10000   # quicker
    python tools/bench_manager.py --events        # KV-cache events on, in every manager
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tiered_kv.abstract import PrepareStoreOutput
from tiered_kv.config import (
    TieredConfig,
    parse_cpu_admission,
    parse_cpu_retention,
)
from tiered_kv.cpu import cpu_tier_for_rules
from tiered_kv.cpu.manager import CPUOffloadingManager
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.format.index import DiskIndex
from tiered_kv.disk.scheduler.manager import DiskOffloadingManager
from tiered_kv.kv_layout import KVCacheLayout, LayerLayout
from tiered_kv.mediums import ids_spec, spec_as
from tiered_kv.tiered.manager import TieredOffloadingManager
from tiered_kv.tiered.transfer_specs import TieredStoreSpec

BATCH = 256  # blocks per call, like a long prompt's chunk
#: KV-cache events on in every manager (``--events``). Off by default, as in vLLM (its
#: ``--kv-events-config`` is off unless asked for); when on, the latency loops drain them
#: after each call, untimed, as the engine does every step.
EVENTS = False
#: The CPU tier's ``cpu_admission`` and ``cpu_retention`` (``--cpu-rules``; the config's defaults).
CPU_RULES = (TieredConfig.cpu_admission, TieredConfig.cpu_retention)
LAYOUT = KVCacheLayout((LayerLayout("kv", (1, 2048), False),), __import__("torch").uint8, 16)
LAYOUT_BYTES = LAYOUT.bytes_per_block


def hashes(n: int, start: int = 0) -> list[bytes]:
    """Block hashes ``start .. start+n-1``: 32-byte digests, like an engine's (sha256 by
    default in vLLM), and apart from the ``fill_disk_tier`` ones. Counters would flatter
    the disk tier after a restart, whose lookups by key prefix then all took one path
    through memory."""
    return [
        hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32, person=b"bench").digest() for i in range(start, start + n)
    ]


def stored(out: PrepareStoreOutput | None) -> PrepareStoreOutput:
    """``prepare_store``'s answer, where the benchmark sized the tiers to have room."""
    if out is None:
        raise RuntimeError("prepare_store found no room: the benchmark's tiers are too small")
    return out


def timed(fn, batches) -> float:
    """Seconds per block of ``fn(batch)`` over all batches."""
    t0 = time.perf_counter()
    for batch in batches:
        fn(batch)
    return (time.perf_counter() - t0) / sum(map(len, batches))


def batches_of(keys: list, size: int = BATCH) -> list[list]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


def bench_ours(manager, n: int) -> dict[str, float]:
    keys = hashes(n)
    b = batches_of(keys)
    out = {}
    outs = []
    out["prepare_store"] = timed(lambda k: outs.append(manager.prepare_store(k)), b)
    out["complete_store"] = timed(manager.complete_store, b)
    out["lookup"] = timed(manager.lookup, b)
    out["touch"] = timed(manager.touch, b)
    return out


def vllm_manager(n: int):
    """vLLM's CPU LRU manager of ``n`` blocks with one request context, and its key
    maker; None when vLLM is not installed."""
    try:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmCPU
    except Exception:
        return None
    manager = VllmCPU(num_chunks=n, cache_policy="lru", enable_events=EVENTS)
    ctx = ReqContext(req_id="bench")
    manager.on_new_request(ctx)
    return manager, ctx, make_offload_key


def bench_vllm(n: int) -> dict[str, float] | None:
    vllm = vllm_manager(n)
    if vllm is None:
        return None
    manager, ctx, make_offload_key = vllm
    keys = [make_offload_key(h, 0) for h in hashes(n)]
    b = batches_of(keys)
    out = {
        "prepare_store": timed(lambda k: manager.prepare_store(k, ctx), b),
        "complete_store": timed(lambda k: manager.complete_store(k, ctx), b),
        "lookup": timed(lambda k: [manager.lookup(key, ctx) for key in k], b),
        "touch": timed(lambda k: manager.touch(k, ctx), b),
    }
    return out


def vllm_evicting_latency(n: int, calls: int) -> list[float] | None:
    """Per-call seconds of a 256-block prepare_store on vLLM's CPU manager when it is full:
    it evicts 256 LRU blocks (and, having no lower tier, drops them). Each store
    completes after the next call, as in ``cascade_latency``, its same-run reference."""
    vllm = vllm_manager(n)
    if vllm is None:
        return None
    manager, ctx, make_offload_key = vllm
    for batch in batches_of([make_offload_key(h, 0) for h in hashes(n)]):
        manager.prepare_store(batch, ctx)
        manager.complete_store(batch, ctx)
    lat: list[float] = []
    in_flight: list = []
    with serving_heap():
        for i in range(calls):
            batch = [make_offload_key(h, 0) for h in hashes(BATCH, n + i * BATCH)]
            t0 = time.perf_counter()
            out = manager.prepare_store(batch, ctx)
            lat.append(time.perf_counter() - t0)
            assert out is not None
            manager.complete_store(in_flight, ctx)  # the previous call's store, one call late
            in_flight = batch
            if EVENTS:
                manager.take_events()
    return lat


@contextlib.contextmanager
def serving_heap():
    """Time what follows as an engine would run it: vLLM's EngineCore freezes the heap
    built at startup (``freeze_gc_heap``), so the collector's full passes skip it. The
    same for both managers; collections still run."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def percentiles(lat: list[float]) -> str:
    lat = sorted(lat)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    return f"{statistics.median(lat) * 1e6:9.0f} {p99 * 1e6:9.0f} {lat[-1] * 1e6:9.0f}"


def disk_manager(tmp: str, n: int) -> DiskOffloadingManager:
    fp = Fingerprint.from_layout(LAYOUT, model_id="bench-manager")
    return DiskOffloadingManager(tmp, fp, LAYOUT, disk_bytes=n * 4096, enable_events=EVENTS)


def cpu_manager(n: int) -> CPUOffloadingManager:
    """The CPU tier as a default config builds it: LRU with ``cpu_admission`` and
    ``cpu_retention`` (``--cpu-rules``)."""
    return cpu_tier_for_rules("lru", n, 16, *CPU_RULES, enable_events=EVENTS)


def busy_loop(iterations: int) -> None:
    """Plain interpreter work: what the machine's own jitter does to a call of this length."""
    x = 0
    for i in range(iterations):
        x += i


def iterations_for(seconds: float) -> int:
    """``busy_loop`` iterations that take about ``seconds`` here (median of 21 tries)."""
    probe = 20_000
    tries = []
    for _ in range(21):
        t0 = time.perf_counter()
        busy_loop(probe)
        tries.append(time.perf_counter() - t0)
    return max(1, round(probe * seconds / statistics.median(tries)))


def thread_cpu(thread) -> float:
    """CPU seconds ``thread`` has used so far."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def fill_disk_tier(tmp: str, n: int) -> None:
    """Leave a disk tier of ``n`` blocks, all durable, in ``tmp``: what a restart finds.
    Their hashes are digests, like an engine's block hashes."""
    disk = disk_manager(tmp, n)
    worker_index = DiskIndex(disk.namespace.index_path, 1)
    for start in range(0, n, 4096):
        batch = [
            hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).digest() for i in range(start, min(n, start + 4096))
        ]
        slots = ids_spec(stored(disk.prepare_store(batch, fresh=True)).store_spec).block_ids.tolist()
        worker_index.commit_stored(0, batch, slots, [disk.block_bytes] * len(batch), [0] * len(batch))
    worker_index.close()
    disk.shutdown()


def cascade_latency(
    n: int, tmp: str, calls: int, restarted: bool = False
) -> tuple[list[float], list[float], list[float]]:
    """Per-call seconds of a 256-block prepare_store on a full CPU tier (write_back: every
    call spills 256 blocks). The disk tier starts empty and holds ``calls * 128``
    blocks, so the first half of the calls fills it and the second half also evicts 256
    disk blocks each (the steady state of a full hierarchy). ``restarted``: the disk
    tier holds ``calls * 256`` blocks and starts full, opened from the index of an
    earlier run (``fill_disk_tier``), so every call evicts 256 blocks that the restart
    found, the state of the first hours after a restart. Between calls, untimed, the
    previous call's GPU copies complete (so one store is always in flight, as in an
    engine whose workers report a step later) and a worker commits the spilled blocks to
    the disk index (synced, as after their bytes are durable; no bytes are written): the
    next call's refresh reads those records, as it does in an engine.

    Also returns the machine's noise floor, interleaved: after each of the last
    ``calls - 50`` calls, the seconds of a ``busy_loop`` sized to the median of the
    first 50; and the CPU seconds per call of the disk tier's flusher thread (reading
    the workers' log records, index writes), over each half of the calls: background
    work of the scheduler process, which shares its GIL."""
    disk_blocks = calls * BATCH if restarted else calls * BATCH // 2
    if restarted:
        fill_disk_tier(tmp, disk_blocks)
    disk = disk_manager(tmp, disk_blocks)
    worker_index = DiskIndex(disk.namespace.index_path, 1)
    manager = TieredOffloadingManager(cpu_manager(n), disk, write_policy="write_back", max_pending_writes=4 * BATCH)
    for batch in batches_of(hashes(n)):
        manager.complete_store(stored(manager.prepare_store(batch)).block_hashes_to_store)
    lat: list[float] = []
    floor: list[float] = []
    in_flight: list[bytes] = []
    busy = 0
    flusher = [thread_cpu(disk._flusher)]
    with serving_heap():
        for i in range(calls):
            if i == calls // 2:
                flusher.append(thread_cpu(disk._flusher))
            batch = hashes(BATCH, n + i * BATCH)
            t0 = time.perf_counter()
            out = stored(manager.prepare_store(batch))
            lat.append(time.perf_counter() - t0)
            spills = spec_as(out.store_spec, TieredStoreSpec).spills
            assert len(spills) == BATCH, f"call {i}: {len(spills)} spills"
            manager.complete_store(in_flight)  # the previous call's store, one call late
            in_flight = out.block_hashes_to_store
            if EVENTS:
                manager.take_events()
            worker_index.commit_stored(
                0, spills.block_hashes, spills.tier_slots.tolist(), [disk.block_bytes] * len(spills), [0] * len(spills)
            )
            if i == 49:
                busy = iterations_for(statistics.median(lat))
            if busy:
                t0 = time.perf_counter()
                busy_loop(busy)
                floor.append(time.perf_counter() - t0)
    disk.flush()
    flusher.append(thread_cpu(disk._flusher))
    worker_index.close()
    manager.shutdown()
    half = [calls // 2, calls - calls // 2]
    return lat, floor, [(b - a) / k for a, b, k in zip(flusher, flusher[1:], half)]


def per_key_lookup(m: TieredOffloadingManager, tmp: str):
    """Our vLLM plug-in's manager over ``m`` (vLLM 0.33 asks it per key), as a function
    that scans runs of keys, one new request each, and ends the step (where undecided
    requests are decided); None without vLLM."""
    try:
        from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

        from tiered_kv.integrations.vllm.health import SlotHealth
        from tiered_kv.integrations.vllm.manager import TieredVllmManager
        from tiered_kv.tiers import TrustedHitCheck
    except Exception:
        return None
    health = SlotHealth(Path(tmp) / "slot-health", m.cpu.num_slots)
    vm = TieredVllmManager(m, [TrustedHitCheck(tier) for tier in m.lower], health=health)

    def contexts(batches):
        out = []
        for i, batch in enumerate(batches):
            ctx = ReqContext(req_id=f"r{i}")
            for j, key in enumerate(batch):
                ctx.set_offload_key_position(key, (j + 1) * 16)
            out.append(ctx)
        return out

    def scan(batches, ctxs) -> float:
        t0 = time.perf_counter()
        for batch, ctx in zip(batches, ctxs):
            for key in batch:
                vm.lookup(key, ctx)
        vm.on_schedule_end(ScheduleEndContext((), ()))
        return (time.perf_counter() - t0) / sum(map(len, batches))

    return contexts, scan


def decision_cost(n: int, tmp: str, rounds: int = 21) -> dict[str, float]:
    """Median ns per block of the composite's ``lookup`` over CPU + disk with the
    load-versus-recompute decision on and off, rounds alternated in one process (the
    machine drifts), of our vLLM plug-in's per-key lookup (the same decision, asked per
    key, decided at the step's end) on and off, of the same over CPU-resident blocks only,
    as vLLM's own CPU manager is asked, and of vLLM's manager's per-key lookup in the same
    rounds (the last three only with vLLM).
    Half of the looked-up blocks are on disk only, the decision judging Llama-3.1-8B-sized
    blocks (2 MiB) from a disk at 2 GB/s with 0.1 ms a job: below break-even, so its
    runs take the decision's full path (a scan of the run) and are passed over."""
    m = TieredOffloadingManager(cpu_manager(n // 2), disk_manager(tmp, 2 * n))
    costs = m.costs
    assert costs is not None  # the composite's decision is on by default
    costs.bytes_per_block = 16 * 131_072
    costs.tiers["disk"].gbps, costs.tiers["disk"].latency_s = 2.0, 1e-4
    keys = hashes(n)
    for batch in batches_of(keys):  # write-through: all on disk, the newest half in CPU
        out = stored(m.prepare_store(batch))
        m.complete_store(out.block_hashes_to_store)
        m.lower[0].complete_store(spec_as(out.store_spec, TieredStoreSpec).tier_write_through[0].block_hashes)
    batches = batches_of(keys)
    cpu_batches = batches_of([k for k in keys if m.cpu.is_loadable(k)])  # what vLLM's manager is asked
    vllm = vllm_manager(n)
    vkeys = None
    if vllm is not None:
        vm, ctx, make_offload_key = vllm
        vkeys = batches_of([make_offload_key(h, 0) for h in keys])
        for batch in vkeys:
            vm.prepare_store(batch, ctx)
            vm.complete_store(batch, ctx)
    ours = per_key_lookup(m, tmp)
    times: dict[str, list[float]] = {}
    with serving_heap():
        for _ in range(rounds):
            for enabled in (True, False):
                costs.enabled = enabled
                times.setdefault("on" if enabled else "off", []).append(timed(m.lookup, batches))
                if ours is not None:
                    contexts, scan = ours
                    ctxs = contexts(batches)
                    times.setdefault("per-key on" if enabled else "per-key off", []).append(scan(batches, ctxs))
                    cpu_ctxs = contexts(cpu_batches)
                    times.setdefault("per-key cpu on" if enabled else "per-key cpu off", []).append(
                        scan(cpu_batches, cpu_ctxs)
                    )
            if vkeys is not None:
                times.setdefault("vllm-cpu", []).append(timed(lambda k: [vm.lookup(key, ctx) for key in k], vkeys))
    m.shutdown()
    return {name: statistics.median(t) for name, t in times.items()}


def refresh_cost(n: int, tmp: str, rounds: int = 200) -> tuple[float, float]:
    """Median seconds of reading 256 freshly committed log records, and of ``refresh()``
    (which reads them and makes the blocks loadable), each timed on fresh records in
    alternate rounds, with a disk tier of ``n`` blocks half full. The flusher thread only
    applies index writes here, and is idle while a call is timed."""
    disk = DiskOffloadingManager(
        tmp,
        Fingerprint.from_layout(LAYOUT, model_id="bench-manager"),
        LAYOUT,
        disk_bytes=n * 4096,
        poll_interval=None,
        enable_events=EVENTS,
    )
    worker_index = DiskIndex(disk.namespace.index_path, 1)
    read, whole = [], []
    fill = n // 2 // BATCH
    for i in range(fill + 2 * rounds):
        batch = hashes(BATCH, i * BATCH)
        slots = ids_spec(stored(disk.prepare_store(batch, fresh=True)).store_spec).block_ids.tolist()
        worker_index.commit_stored(0, batch, slots, [disk.block_bytes] * BATCH, [0] * BATCH)
        disk.flush()  # the flusher's index writes for the last round are done: nothing runs beside
        t0 = time.perf_counter()
        if i % 2:
            disk.index.read_log_columns(disk._log_seen, BATCH)
            read.append(time.perf_counter() - t0)
        done = disk.refresh()
        if not i % 2:
            whole.append(time.perf_counter() - t0)
        assert len(done.durable) == BATCH
    worker_index.close()
    disk.shutdown()
    return statistics.median(read[-rounds:]), statistics.median(whole[-rounds:])


def main() -> int:
    global EVENTS, CPU_RULES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--cascade-calls", type=int, default=1000)
    ap.add_argument(
        "--events",
        action="store_true",
        help="KV-cache events on in every manager (drained after each latency-loop call)",
    )
    ap.add_argument(
        "--cpu-rules",
        default=",".join(CPU_RULES),
        help=f"the CPU tier's cpu_admission,cpu_retention (default: the config's, {','.join(CPU_RULES)})",
    )
    args = ap.parse_args()
    EVENTS = args.events
    admission, _, retention = args.cpu_rules.partition(",")
    try:
        CPU_RULES = (
            parse_cpu_admission(admission, "--cpu-rules"),
            parse_cpu_retention(retention or "none", "--cpu-rules"),
        )
    except ValueError as e:
        ap.error(str(e))
    print(f"CPU tier: cpu_admission {CPU_RULES[0]}, cpu_retention {CPU_RULES[1]}")
    ops = ("lookup", "prepare_store", "complete_store", "touch")
    print(f"per-block cost in ns ({BATCH}-block calls); ratio = tiered / vllm-cpu")
    header = f"{'blocks':>9} {'manager':>16} " + " ".join(f"{o:>15}" for o in ops)
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        rows = {}
        vllm = bench_vllm(n)
        if vllm:
            rows["vllm-cpu"] = vllm
        rows["tiered-cpu"] = bench_ours(TieredOffloadingManager(cpu_manager(n), bytes_per_block=LAYOUT_BYTES), n)
        for name, cost_aware in (("tiered-cpu+disk", True), ("  cost-aware off", False)):
            with tempfile.TemporaryDirectory(prefix="bench-manager-") as tmp:
                m = TieredOffloadingManager(cpu_manager(n), disk_manager(tmp, 2 * n), cost_aware=cost_aware)
                rows[name] = bench_ours(m, n)
                m.shutdown()
        for name, r in rows.items():
            cells = []
            for o in ops:
                cell = f"{r[o] * 1e9:9.0f}"
                if vllm and name != "vllm-cpu":
                    cell += f" ({r[o] / vllm[o]:.2f})"
                cells.append(f"{cell:>15}")
            print(f"{n:>9} {name:>16} " + " ".join(cells))
    print()
    print(
        f"{BATCH}-block prepare_store on a full CPU tier, {args.cascade_calls} calls: tiered = the "
        f"composite, every call spilling {BATCH} blocks to disk (write_back); vllm-cpu = vLLM's "
        f"manager evicting {BATCH} blocks (no lower tier). Tiered rows: all calls, the first half "
        f"(the disk tier filling), the second half (the disk full, evicting {BATCH} blocks per call "
        f"too); restarted = a second run whose disk tier starts full, opened from an earlier run's index, "
        f"so every call evicts {BATCH} of the blocks the restart found; py loop = plain interpreter work sized to the tiered median, timed after each call "
        f"(this machine's own jitter)"
    )
    print(
        f"{'CPU blocks':>10} {'manager':>10} {'p50 us':>9} {'p99 us':>9} {'max us':>9} {'flusher us':>13}"
        f"  (flusher = CPU per call of the disk tier's background thread)"
    )
    for n in args.sizes:
        vllm_lat = vllm_evicting_latency(n, args.cascade_calls)
        if vllm_lat:
            print(f"{n:>10} {'vllm-cpu':>10} {percentiles(vllm_lat)}")
        with tempfile.TemporaryDirectory(prefix="bench-manager-") as tmp:
            lat, floor, flusher = cascade_latency(n, tmp, args.cascade_calls)
        half = len(lat) // 2
        with tempfile.TemporaryDirectory(prefix="bench-manager-") as tmp:
            restarted, _, restarted_flusher = cascade_latency(n, tmp, args.cascade_calls, restarted=True)
        for name, part, background in (
            ("tiered", lat, None),
            ("filling", lat[:half], flusher[0]),
            ("disk full", lat[half:], flusher[1]),
            ("restarted", restarted, sum(restarted_flusher) / 2),
            ("py loop", floor, None),
        ):
            cpu = "" if background is None else f"{background * 1e6:13.0f}"
            print(f"{n:>10} {name:>10} {percentiles(part)}{cpu}")
    print()
    print(
        f"lookup of {BATCH}-block runs over CPU + disk (half on a disk below break-even), median ns per block of 21 alternated rounds"
    )
    print(
        f"{'blocks':>9} {'decision on':>12} {'off':>8} {'decision':>9} {'per-key on':>11} {'per-key off':>12} "
        f"{'per-key, CPU blocks: on':>24} {'off':>5} {'vllm-cpu lookup':>16}"
    )
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-manager-") as tmp:
            d = decision_cost(n, tmp)
        ns = {k: f"{v * 1e9:.0f}" for k, v in d.items()}
        print(
            f"{n:>9} {ns['on']:>12} {ns['off']:>8} {(d['on'] - d['off']) * 1e9:>9.0f} {ns.get('per-key on', '-'):>11} "
            f"{ns.get('per-key off', '-'):>12} {ns.get('per-key cpu on', '-'):>24} {ns.get('per-key cpu off', '-'):>5} "
            f"{ns.get('vllm-cpu', '-'):>16}"
        )
    print()
    print(f"disk index refresh of {BATCH} committed blocks (the flusher's work per {BATCH} stores), median us")
    print(f"{'disk blocks':>11} {'log read':>9} {'refresh':>9}  (refresh = log read + making blocks loadable)")
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-manager-") as tmp:
            read, fold = refresh_cost(n, tmp)
        print(f"{n:>11} {read * 1e6:>9.0f} {fold * 1e6:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
