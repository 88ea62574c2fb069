#!/usr/bin/env python3
"""Two vLLM secondary tiers side by side: our ``TieredDiskTier`` and vLLM's built-in ``fs``.

Both tiers are built the way vLLM's ``TieringOffloadingSpec`` builds them (its
``SecondaryTierFactory``, one ``TieringOffloadingSpec`` for a Llama-3.1-8B-like geometry,
one primary buffer handed to both as ``primary_kv_view``) and driven through the calls
vLLM's ``TieringOffloadingManager`` makes: ``submit_store`` (a cascade), ``submit_load``
(a promotion), ``get_finished_jobs``, ``lookup``. Same chunks, same run:

1. store: ``--total-mib`` of random chunks in jobs of ``--job-chunks`` (each size in
   turn), all submitted at once (a burst of cascades: vLLM submits one per request that
   completed chunks in a step); time from the first submit to the last finished job.
2. promote: the same chunks back into other primary rows, then compared byte for byte.
   Rounds alternate which tier goes first; each round uses new chunks. Figures are bytes /
   time over all rounds. Each tier runs with its defaults (fs: 16 read + 16 write
   threads, O_DIRECT where the filesystem takes it, no fsync; ours: 2 store and 4 load
   job threads, 4 I/O threads, O_DIRECT, xxh3-64, one fdatasync + index commit per group
   of queued store jobs).
3. full disk: each tier in turn on an empty small filesystem (``--small-fs``, else a
   64 MiB loop-mounted ext4 made here, which needs root; else skipped), fed twice its
   size in chunks one job at a time: failed stores, which chunks are still found, space
   used. Ours gets ``disk_bytes`` = half the filesystem, and is also opened once with more
   than the free space.
4. flipped byte: four chunks stored in each tier, one byte of the second flipped on disk,
   then promoted: what lands in the primary tier and what a later lookup says.

    python tools/bench_vllm_fs.py [--dir PATH] [--total-mib 512] [--job-chunks 1,8] [--rounds 3]
                                  [--small-fs PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from benchlib import MiB, header  # noqa: E402

from tiered_kv.disk.store.io_backends import aligned_empty  # noqa: E402
from tiered_kv.disk.format.namespace import NamespaceError  # noqa: E402
from tiered_kv.integrations.vllm.secondary_tier import TieredDiskTier  # noqa: E402

TIER_MODULE = "tiered_kv.integrations.vllm.secondary_tier"
END_OF_STEP = ScheduleEndContext((), ())
FULL_DISK_JOB = 8  # chunks per store job in the full-disk run
_job_ids = itertools.count()
_req_ids = itertools.count()


def llama8b_spec(num_rows: int) -> TieringOffloadingSpec:
    """vLLM's tiering spec for Llama-3.1-8B on one GPU: 32 layers x 8 KV heads x 128 x
    bf16 = 128 KiB per token, 16-token blocks, one block per chunk: 2 MiB chunks."""
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(32))
    block_bytes = 32 * 2 * 8 * 128 * 2 * 16
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=layers, group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_rows * block_bytes},
        engine_id="bench-vllm-fs",
        model=OffloadingModelConfig(name="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=0,
            is_parallelism_agnostic=False,
        ),
    )
    return TieringOffloadingSpec(config)


class Primary:
    """A stand-in for vLLM's CPU tier: ``rows`` page-aligned rows of ``stride`` bytes,
    exposed as the ``(num_chunks, stride)`` memoryview vLLM hands its tiers."""

    def __init__(self, rows: int, stride: int):
        self.stride = stride
        self.rows = aligned_empty(rows * stride).view(rows, stride)
        self.view = self.rows.numpy().data

    def fill_random(self, first: int, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rows[first : first + n] = torch.randint(0, 256, (n, self.stride), dtype=torch.uint8, generator=gen)


def make_tier(
    kind: str, spec: TieringOffloadingSpec, primary: Primary, path: Path, disk_bytes: int | None = None
) -> SecondaryTierManager:
    entry: dict[str, Any]
    if kind == "fs":
        entry = {"type": "fs", "root_dir": str(path)}
    else:
        entry = {
            "type": "TieredDiskTier",
            "module_path": TIER_MODULE,
            "disk_path": str(path),
            "disk_bytes": disk_bytes,
        }
    return SecondaryTierFactory.create_secondary_tier(entry, primary.view, spec)


def new_keys(n: int) -> list[OffloadKey]:
    return [make_offload_key(os.urandom(32), 0) for _ in range(n)]


def jobs_for(keys: list[OffloadKey], first_row: int, per_job: int, promotion: bool) -> list[TransferJob]:
    ctx = ReqContext(req_id="bench")
    return [
        TransferJob(
            next(_job_ids),
            keys[i : i + per_job],
            np.arange(first_row + i, first_row + min(i + per_job, len(keys)), dtype=np.int32),
            promotion,
            ctx,
        )
        for i in range(0, len(keys), per_job)
    ]


def run_jobs(tier: SecondaryTierManager, jobs: list[TransferJob]) -> tuple[float, dict]:
    """Submit every job, poll until all finished; (seconds, job id -> JobResult)."""
    t0 = time.perf_counter()
    for job in jobs:
        (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    waiting = {job.job_id for job in jobs}
    results = {}
    while waiting:
        for r in tier.get_finished_jobs():
            results[r.job_id] = r
            waiting.discard(r.job_id)
        if waiting:
            time.sleep(0.0002)
    return time.perf_counter() - t0, results


def settled_lookups(tier: SecondaryTierManager, keys: list[OffloadKey]) -> list[LookupResult]:
    """Lookups as a fresh request sees them (the fs tier answers RETRY until its
    background existence check has run; the engine would ask again next step)."""
    ctx = ReqContext(req_id=f"probe-{next(_req_ids)}")
    tier.on_new_request(ctx)
    try:
        for _ in range(10_000):
            results = [tier.lookup(k, ctx) for k in keys]
            if LookupResult.RETRY not in results:
                return results
            tier.on_schedule_end(END_OF_STEP)
            time.sleep(0.001)
        raise RuntimeError("lookups never settled")
    finally:
        tier.on_request_finished(ctx)


@contextlib.contextmanager
def quiet():
    """No log lines: the tiers log every failed job, and these runs fail on purpose."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def clear_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------- throughput


def throughput(args, spec, root: Path, per_job: int) -> dict[str, dict[str, float]]:
    stride = spec.kv_bytes_per_chunk
    n = args.total_mib * MiB // stride
    primary = Primary(2 * n, stride)
    dirs = {"ours": root / "ours", "fs": root / "fs"}
    for d in dirs.values():
        clear_dir(d)
    tiers = {
        "ours": make_tier("ours", spec, primary, dirs["ours"], disk_bytes=2 * n * stride),
        "fs": make_tier("fs", spec, primary, dirs["fs"]),
    }
    totals = {k: {"store_s": 0.0, "load_s": 0.0, "bytes": 0, "mismatched": 0, "failed_jobs": 0} for k in tiers}
    try:
        for rnd in range(args.rounds):
            order = ["ours", "fs"] if rnd % 2 == 0 else ["fs", "ours"]
            primary.fill_random(0, n, seed=rnd)
            keys = new_keys(n)
            for kind in order:  # the same chunks into each tier
                secs, res = run_jobs(tiers[kind], jobs_for(keys, 0, per_job, False))
                totals[kind]["store_s"] += secs
                totals[kind]["failed_jobs"] += sum(not r.success for r in res.values())
            for kind in order:
                primary.rows[n:].zero_()
                secs, res = run_jobs(tiers[kind], jobs_for(keys, n, per_job, True))
                totals[kind]["load_s"] += secs
                totals[kind]["failed_jobs"] += sum(not r.success for r in res.values())
                same = (primary.rows[n:] == primary.rows[:n]).all(dim=1)
                totals[kind]["mismatched"] += int((~same).sum())
                totals[kind]["bytes"] += n * stride
            clear_dir(dirs["fs"])  # fs never frees space on its own
            print(
                f"# jobs of {per_job}, round {rnd + 1}: "
                + ", ".join(
                    f"{k} store {totals[k]['bytes'] / totals[k]['store_s'] / 1e9:.2f} / promote "
                    f"{totals[k]['bytes'] / totals[k]['load_s'] / 1e9:.2f} GB/s (cumulative)"
                    for k in order
                ),
                flush=True,
            )
    finally:
        for tier in tiers.values():
            tier.shutdown()
    return totals


# ---------------------------------------------------------------- full disk


@contextlib.contextmanager
def small_filesystem(given: str | None, mib: int = 64):
    """(path, how) of an empty small filesystem, or (None, why not)."""
    if given:
        yield Path(given), f"{given} (given)"
        return
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        yield None, "needs root and mkfs.ext4 for a loop-mounted ext4 (or pass --small-fs)"
        return
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-fs-small-"))
    image, mnt = work / "fs.img", work / "mnt"
    mnt.mkdir()
    try:
        with open(image, "wb") as f:
            f.truncate(mib * MiB)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        shutil.rmtree(work, ignore_errors=True)
        yield None, f"could not mount a loop ext4 ({e}); pass --small-fs"
        return
    try:
        yield mnt, f"a {mib} MiB ext4 loop device"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(work, ignore_errors=True)


def full_disk(args, spec) -> None:
    stride = spec.kv_bytes_per_chunk
    with small_filesystem(args.small_fs) as (mnt, how):
        if mnt is None:
            print(f"full disk: skipped ({how})")
            return
        size = shutil.disk_usage(mnt).total
        n = 2 * size // stride  # twice what fits
        primary = Primary(n, stride)
        primary.fill_random(0, n, seed=99)
        keys = new_keys(n)
        print(
            f"full disk: {how}, {size / MiB:.0f} MiB; {n} chunks of {stride // MiB} MiB "
            f"({n * stride / MiB:.0f} MiB) stored one job of {FULL_DISK_JOB} at a time"
        )
        for kind in ("ours", "fs"):
            clear_dir(mnt / kind)
            budget = (size // 2) // stride * stride
            tier = make_tier(kind, spec, primary, mnt / kind, disk_bytes=budget)
            try:
                jobs = jobs_for(keys, 0, FULL_DISK_JOB, False)
                failed = []
                with quiet():
                    for job in jobs:
                        _, res = run_jobs(tier, [job])
                        if not res[job.job_id].success:
                            failed.append(job.job_id)
                found = settled_lookups(tier, keys)
            finally:
                tier.shutdown()
            hits = [r is LookupResult.HIT for r in found]
            first_fail = (jobs.index(next(j for j in jobs if j.job_id == failed[0])) + 1) if failed else None
            leftovers = sum(1 for f in (mnt / kind).rglob("*.tmp"))
            name = "TieredDiskTier" if kind == "ours" else "vLLM fs"
            print(
                f"  {name}: {'disk_bytes ' + str(budget // MiB) + ' MiB, ' if kind == 'ours' else ''}"
                f"failed store jobs {len(failed)} of {len(jobs)}"
                f"{f' (from job {first_fail} on)' if failed else ''}; chunks found {sum(hits)} of {n} "
                f"(oldest half {sum(hits[: n // 2])}, newest half {sum(hits[n // 2 :])}, "
                f"newest chunk {'found' if hits[-1] else 'MISSING'}); space used {du(mnt / kind) / MiB:.0f} "
                f"MiB, free {shutil.disk_usage(mnt).free / MiB:.0f} MiB"
                f"{f', {leftovers} .tmp files left' if leftovers else ''}"
            )
            clear_dir(mnt / kind)
        try:
            tier = make_tier("ours", spec, primary, mnt / "ours", disk_bytes=2 * size)
            tier.shutdown()
            print("  TieredDiskTier with disk_bytes > free space: started (the filesystem cannot preallocate?)")
        except NamespaceError as e:
            print(f"  TieredDiskTier with disk_bytes = {2 * size / MiB:.0f} MiB (> free): refuses to start: {e}")
        clear_dir(mnt / "ours")


# ---------------------------------------------------------------- flipped byte


def flipped_byte(args, spec, root: Path) -> None:
    stride = spec.kv_bytes_per_chunk
    primary = Primary(8, stride)
    primary.fill_random(0, 4, seed=7)
    keys = new_keys(4)
    print("flipped byte: 4 chunks stored, one byte of chunk 2 flipped on disk, the 4 promoted")
    for kind in ("ours", "fs"):
        clear_dir(root / kind)
        tier = make_tier(kind, spec, primary, root / kind, disk_bytes=64 * stride)
        try:
            run_jobs(tier, jobs_for(keys, 0, 4, False))
            if isinstance(tier, FileSystemTierManager):
                path, offset = tier.file_mapper.get_file_name(keys[1]), 1234
            else:
                assert isinstance(tier, TieredDiskTier)
                entry = tier.store.entry(keys[1])
                assert entry is not None  # stored by the jobs above
                path, offset = str(tier.store.namespace.slab_path(0)), entry.slot * tier.store.slot_size + 1234
            fd = os.open(path, os.O_RDWR)
            try:
                os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x01]), offset)
                os.fsync(fd)
            finally:
                os.close(fd)
            primary.rows[4:].zero_()
            with quiet():
                _, res = run_jobs(tier, jobs_for(keys, 4, 4, True))
            (result,) = res.values()
            same = (primary.rows[4:8] == primary.rows[0:4]).all(dim=1).tolist()
            after = settled_lookups(tier, keys)
        finally:
            tier.shutdown()
        ok = result.successful_keys
        promoted = 4 if result.success else len(ok or ())
        name = "TieredDiskTier" if kind == "ours" else "vLLM fs"
        wrong = [i + 1 for i, s in enumerate(same) if not s and (result.success or keys[i] in (ok or ()))]
        print(
            f"  {name}: promotion job {'succeeded' if result.success else 'failed'}, {promoted} of 4 chunks "
            f"handed to the CPU tier, {len(wrong)} of them with wrong bytes"
            f"{' (chunk ' + ', '.join(map(str, wrong)) + ': served to the GPU as is)' if wrong else ''}; "
            f"lookup of chunk 2 afterwards: {after[1].name}"
            + (f"; checksum failures counted: {tier.stats.corrupt}" if isinstance(tier, TieredDiskTier) else "")
        )
        clear_dir(root / kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory on the disk to measure (default: a temp dir under the repo)")
    p.add_argument("--total-mib", type=int, default=512, help="MiB stored and promoted per round")
    p.add_argument("--job-chunks", default="1,8", help="chunks per store/promotion job (a list)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--small-fs", help="an empty small filesystem for the full-disk test")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("vllm").setLevel(logging.WARNING)

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix=".bench-vllm-fs-", dir=Path.cwd()))
    root.mkdir(parents=True, exist_ok=True)
    spec = llama8b_spec(num_rows=1)
    try:
        import vllm.fs_io_C  # noqa: F401

        fs_io = "C extension"
    except Exception as e:  # ImportError, or a missing CUDA library behind it
        fs_io = f"pure Python (vllm.fs_io_C not importable: {str(e).splitlines()[0]})"
    print(
        header("bench_vllm_fs")
        + f"  load average {os.getloadavg()[0]:.2f}  dir {root} ({shutil.disk_usage(root).free / 2**30:.0f} GiB free)"
    )
    job_sizes = [int(x) for x in args.job_chunks.split(",")]
    print(
        f"# chunk {spec.kv_bytes_per_chunk // MiB} MiB (Llama-3.1-8B, 16 tokens), {args.total_mib} MiB per "
        f"round, jobs of {args.job_chunks} chunks, {args.rounds} rounds; vLLM fs I/O path: {fs_io}"
    )
    try:
        results = {per_job: throughput(args, spec, root, per_job) for per_job in job_sizes}
        print()
        print(
            "| chunks per job | tier | store GB/s | promote GB/s | store vs fs | promote vs fs | "
            "failed jobs | chunks promoted with wrong bytes |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for per_job, totals in results.items():
            fs = totals["fs"]
            for kind, name in (("ours", "TieredDiskTier (ours)"), ("fs", "vLLM fs")):
                t = totals[kind]
                w, r = t["bytes"] / t["store_s"] / 1e9, t["bytes"] / t["load_s"] / 1e9
                print(
                    f"| {per_job} | {name} | {w:.2f} | {r:.2f} | {w / (fs['bytes'] / fs['store_s'] / 1e9):.2f} | "
                    f"{r / (fs['bytes'] / fs['load_s'] / 1e9):.2f} | {t['failed_jobs']} | {t['mismatched']} |"
                )
        print()
        full_disk(args, spec)
        print()
        flipped_byte(args, spec, root)
        print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
