"""Worker-side handlers that carry out the composite manager's plans.

Runs in each worker process (one per TP rank). Three pieces:

- ``DiskStager``: copies CPU slots into staging buffers (memcpy, on a thread) and then
  writes them to this rank's slab on the disk I/O pool. A disk write never reads a CPU
  slot after staging, so the manager may reuse the slot as soon as the store job that
  carried the write is reported; the block becomes loadable from disk when this rank's
  index commit (after the data is durable) is seen by the manager. Staging memory is
  bounded; a write that finds none is dropped, recorded as failed in the index log and
  counted.
- ``TieredStoreHandler`` (GPU -> CPU): stages spill victims out of their slots, then runs
  the GPU -> CPU copy into those slots, then stages write-through copies. The job is
  reported when the GPU copy and the staging copies are done; the disk writes are not
  waited for, so GPU blocks are never held on disk I/O.
- ``TieredLoadHandler`` (CPU -> GPU and TIERED -> GPU): splits a load by tier; CPU blocks
  go on the CUDA-stream path, disk blocks straight to the GPU (GDS or bounce buffer), or
  disk -> CPU slot (checksum verified) -> GPU when promoted. One result per job: success
  only if every part succeeded.

Each parent job is a set of branches, each a sequence of steps (a sub-job on an inner
handler, or a future from a thread pool); polling advances them without blocking.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from functools import partial
from collections.abc import Callable, Sequence
from typing import NamedTuple
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from tiered_kv.abstract import Closing
from tiered_kv.disk.worker.block_store import BlockStore
from tiered_kv.memory.host_memory import HostKVCache, pack_blocks
from tiered_kv.mediums import CPULoadStoreSpec, DiskLoadStoreSpec, GPULoadStoreSpec, spec_as
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.transfer_specs import DiskWrites, TieredLoadSpec
from tiered_kv.worker.worker import OffloadingHandler, PerTier, Stager, TransferResult, TransferSpec, per_tier

logger = logging.getLogger(__name__)

# Sub-job ids on inner handlers live far above any engine job id.
_SUB_JOB_IDS = itertools.count(1 << 48)


class _Staged(NamedTuple):
    """Packed blocks waiting for the disk writer."""

    hashes: list
    disk_slots: list
    rows: torch.Tensor
    buf: torch.Tensor


class DiskStager(Closing):
    """Stage CPU slots into aligned buffers and write them to disk for one rank.

    ``store`` is this process's ``DiskStore``; ``capacity_blocks`` bounds staging memory
    (blocks waiting for their disk write on this rank). One writer thread writes
    whatever is staged when it wakes as one write batch, so many store jobs share one
    ``fdatasync`` and one index commit, and goes on with the next while it commits.
    ``synchronous=True`` stages and writes on the caller's thread instead (a replay that
    must behave the same every time, as a property test needs).
    """

    def __init__(
        self,
        host: HostKVCache,
        store: BlockStore,
        rank: int,
        capacity_blocks: int,
        stats: TieredStats,
        synchronous: bool = False,
        tier_name: str = "disk",
    ):
        self.host = host
        #: The lower tier this stager writes: names its stats and transfer type.
        self.tier_name = tier_name
        self.store = store
        self.rank = rank
        self.stats = stats
        self.slot_size = store.slot_size
        self.synchronous = synchronous
        self._budget = capacity_blocks
        self._cached: list[torch.Tensor] = []  # free staging buffers, reused by size
        self._allocated_rows = 0
        self._lock = threading.Lock()
        self._queue: deque[_Staged] = deque()
        self._wake = threading.Condition(self._lock)
        self._writing = False
        self._committing = 0  # write batches whose commit is still in flight
        self._closed = False
        self._packer = None if synchronous else ThreadPoolExecutor(1, thread_name_prefix="tiered-kv-stage")
        self._writer = None
        if not synchronous:
            self._writer = threading.Thread(target=self._write_loop, name="tiered-kv-diskwrite", daemon=True)
            self._writer.start()

    def _take_buffer(self, rows: int) -> torch.Tensor | None:
        with self._lock:
            fitting = [i for i, b in enumerate(self._cached) if b.shape[0] >= rows]
            if fitting:
                # Tensors compare element-wise, so pick by position, never by value.
                return self._cached.pop(min(fitting, key=lambda i: self._cached[i].shape[0]))
            while self._cached and self._allocated_rows + rows > self._budget:
                self._allocated_rows -= self._cached.pop().shape[0]
            if self._allocated_rows + rows > self._budget:
                return None
            self._allocated_rows += rows
        return self.store.host_buffer(rows * self.slot_size).view(rows, self.slot_size)

    def stage(self, writes: DiskWrites) -> Future[None]:
        """Start copying ``writes``' CPU slots out; the returned future is done once the
        slots may be overwritten (copied, or dropped for lack of staging memory). The
        disk write itself continues in the background."""
        if self._packer is None:
            self._stage(writes)
            future: Future[None] = Future()
            future.set_result(None)
            return future
        return self._packer.submit(self._stage, writes)

    def _stage(self, writes: DiskWrites) -> None:
        hashes = writes.block_hashes
        disk_slots = writes.disk_slots.tolist()
        buf = self._take_buffer(len(writes))
        if buf is None:
            logger.warning("%s staging full: dropping %d writes on rank %d", self.tier_name, len(writes), self.rank)
            self.stats.count(self.tier_name, "drops", len(writes))
            self._record_failed(hashes, disk_slots)
            return
        rows = buf[: len(writes)]
        try:
            kernel_ids = self.host.kernel_ids(writes.cpu_slots)
            pack_blocks(self.host.tensors, self.host.layout, kernel_ids, rows)
        except Exception:
            logger.exception("staging %d disk writes failed on rank %d; dropping them", len(writes), self.rank)
            with self._lock:
                self._cached.append(buf)
            self.stats.count(self.tier_name, "drops", len(writes))
            self._record_failed(hashes, disk_slots)
            return
        staged = _Staged(hashes, disk_slots, rows, buf)
        if self.synchronous:
            self._write([staged])
            return
        with self._wake:
            self._queue.append(staged)
            self._wake.notify()

    def _record_failed(self, hashes: list, disk_slots: list) -> None:
        """Tell the manager (through the index log) that these writes will not happen."""
        try:
            self.store.log_failed(self.rank, hashes, disk_slots)
        except Exception:
            logger.exception("could not record %d dropped disk writes in the index", len(hashes))

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
                self._writing = True
            try:
                self._write(batch)
            finally:
                with self._wake:
                    self._writing = False
                    self._wake.notify_all()

    def _write(self, staged: list[_Staged]) -> None:
        """One write batch for every staged job. The writer moves on once the writes are
        done (the buffers are free again); the batch's ``fdatasync`` and index commit
        then overlap the next batch's writes, and settle its outcome."""
        hashes = [h for s in staged for h in s.hashes]
        disk_slots = [d for s in staged for d in s.disk_slots]
        start = time.perf_counter()
        try:
            batch = self.store.begin_write(self.rank, hashes, disk_slots)
        except Exception:  # the store reports faults itself; this is a last resort
            logger.exception("disk write of %d blocks failed on rank %d", len(hashes), self.rank)
            self._record_failed(hashes, disk_slots)
            self._release(staged)
            self._committed(len(hashes), start, None)
            return
        try:
            first = 0
            for s in staged:
                batch.submit(first, s.rows)
                first += len(s.hashes)
        except Exception as e:
            logger.exception("disk write of %d blocks failed on rank %d", len(hashes), self.rank)
            batch.abandon(e)
        finally:
            batch.wait_idle()
            self._release(staged)
        with self._lock:
            self._committing += 1
        done = batch.finish_async()
        done.add_done_callback(lambda f: self._committed(len(hashes), start, f))
        if self.synchronous:
            done.result()

    def _release(self, staged: list[_Staged]) -> None:
        with self._lock:
            self._cached.extend(s.buf for s in staged)

    def _committed(self, n: int, start: float, done: Future | None) -> None:
        ok = done is not None and done.exception() is None and all(done.result())
        self.stats.record_transfer(
            f"cpu_to_{self.tier_name}", n * self.host.layout.bytes_per_block, time.perf_counter() - start, success=ok
        )
        if not ok:
            self.stats.count(self.tier_name, "failed_stores", n)
        if done is not None:
            with self._wake:
                self._committing -= 1
                self._wake.notify_all()

    def drain(self) -> None:
        """Block until every staged write has reached the disk (or failed)."""
        if self._packer is not None:
            self._packer.submit(lambda: None).result()
        with self._wake:
            while self._queue or self._writing or self._committing:
                self._wake.wait()

    def shutdown(self) -> None:
        self.drain()
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._packer is not None:
            self._packer.shutdown(wait=True)
        if self._writer is not None:
            self._writer.join()


class _Step:
    """One awaited thing of a job: a sub-job on an inner handler or a thread future.
    A future's end is stamped when it completes, so its time excludes the wait for
    the next poll, as an inner handler's own measure does."""

    __slots__ = ("handler", "sub_id", "future", "kind", "nbytes", "started", "ended")

    def __init__(
        self,
        kind: str,
        nbytes: int,
        handler: OffloadingHandler | None = None,
        sub_id: int | None = None,
        future: Future | None = None,
    ):
        self.kind, self.nbytes = kind, nbytes
        self.handler, self.sub_id, self.future = handler, sub_id, future
        self.started = time.perf_counter()
        self.ended: float | None = None
        if future is not None:
            future.add_done_callback(self._stamp)

    def _stamp(self, _future: Future) -> None:
        self.ended = time.perf_counter()


class _Job:
    """A parent job. ``seconds[i]``: the summed transfer time of branch ``i``'s
    finished steps; the job's time is the longest branch's (branches overlap)."""

    __slots__ = ("job_id", "branches", "current", "ok", "seconds", "nbytes")

    def __init__(self, job_id: int, branches: list[deque[Callable[[], _Step | None]]]):
        self.job_id = job_id
        self.branches = branches
        self.current: list[_Step | None] = [None] * len(branches)
        self.ok = True
        self.seconds = [0.0] * len(branches)
        self.nbytes = 0  # moved by its finished steps


class _PipelineHandler(OffloadingHandler):
    """Runs each job as branches of sequential steps over inner handlers and futures."""

    def __init__(self, stats: TieredStats, inner: Sequence[OffloadingHandler | None]):
        self.stats = stats
        self._inner = list(dict.fromkeys(h for h in inner if h is not None))
        self._jobs: dict[int, _Job] = {}
        self._order: list[int] = []
        self._inner_done: dict[int, TransferResult] = {}
        self._finished: list[TransferResult] = []

    def _submit_inner(self, handler: OffloadingHandler, kind: str, nbytes: int, spec: TransferSpec) -> _Step:
        sub_id = next(_SUB_JOB_IDS)
        step = _Step(kind, nbytes, handler=handler, sub_id=sub_id)
        try:
            accepted = handler.transfer_async(sub_id, spec)
        except Exception:
            logger.exception("%s raised submitting a %s transfer", type(handler).__name__, kind)
            accepted = False
        if not accepted:
            self._inner_done[sub_id] = TransferResult(sub_id, False)
        return step

    def _start(self, job_id: int, branches: list[deque]) -> bool:
        job = _Job(job_id, branches)
        self._jobs[job_id] = job
        self._order.append(job_id)
        self._advance(job)
        return True

    def _collect_inner(self) -> None:
        for handler in self._inner:
            for result in handler.get_finished():
                self._inner_done[result.job_id] = result

    def _step_result(self, step: _Step) -> tuple[bool, float] | None:
        """``(success, seconds)`` once the step finished, None while it runs. The
        seconds are the inner handler's own measure where it has one."""
        if step.future is not None:
            if not step.future.done() or step.ended is None:
                return None
            ok = step.future.exception() is None and step.future.result() is not False
            return ok, step.ended - step.started
        assert step.sub_id is not None  # a step without a future is a sub-job
        result = self._inner_done.pop(step.sub_id, None)
        if result is None:
            return None
        seconds = result.seconds if result.seconds is not None else time.perf_counter() - step.started
        return result.success, seconds

    def _advance(self, job: _Job) -> None:
        for i, branch in enumerate(job.branches):
            while True:
                step = job.current[i]
                if step is not None:
                    outcome = self._step_result(step)
                    if outcome is None:
                        break
                    result, seconds = outcome
                    if step.future is not None and step.future.exception() is not None:
                        logger.error("job %d: %s step raised", job.job_id, step.kind, exc_info=step.future.exception())
                    if step.kind:
                        self.stats.record_transfer(step.kind, step.nbytes, seconds, result)
                    job.ok &= result
                    job.seconds[i] += seconds
                    job.nbytes += step.nbytes if result else 0
                    job.current[i] = None
                    if not result:
                        branch.clear()  # later steps of a failed branch would act on bad data
                if not branch:
                    break
                job.current[i] = branch.popleft()()

    def _poll(self) -> None:
        self._collect_inner()
        still = []
        for job_id in self._order:
            job = self._jobs[job_id]
            self._advance(job)
            if all(s is None for s in job.current) and not any(job.branches):
                del self._jobs[job_id]
                self._finished.append(
                    TransferResult(job_id, job.ok, max(job.seconds) if job.ok else None, job.nbytes if job.ok else None)
                )
            else:
                still.append(job_id)
        self._order = still

    def get_finished(self) -> list[TransferResult]:
        self._poll()
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        while True:
            self._poll()
            waiting = [self._jobs[j] for j in job_ids if j in self._jobs]
            if not waiting:
                return
            for step in (s for job in waiting for s in job.current if s is not None):
                if step.future is not None:
                    step.future.exception()  # blocks until done
                elif step.sub_id not in self._inner_done:
                    assert step.handler is not None and step.sub_id is not None  # a sub-job
                    step.handler.wait({step.sub_id})
                break

    def shutdown(self) -> None:
        self.wait(set(self._jobs))


class TieredStoreHandler(_PipelineHandler):
    """GPU -> CPU stores carrying spills and write-through copies (see module docstring).

    ``stagers``: one ``Stager`` per lower tier, in tier order (one alone is the first
    tier's; None where a tier has none in this process)."""

    def __init__(
        self,
        gpu_to_cpu: OffloadingHandler,
        layout_bytes_per_block: int,
        stagers: PerTier[Stager],
        stats: TieredStats,
    ):
        super().__init__(stats, [gpu_to_cpu])
        self.gpu_to_cpu = gpu_to_cpu
        self.bytes_per_block = layout_bytes_per_block
        self.stagers = per_tier(stagers)

    @property
    def stager(self) -> Stager | None:
        """The first lower tier's stager."""
        return self.stagers[0]

    @stager.setter
    def stager(self, stager: Stager | None) -> None:
        self.stagers[0] = stager

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        spills = getattr(dst, "tier_spills", ())
        write_through = getattr(dst, "tier_write_through", ())
        steps: deque = deque()
        for stager, writes in zip(self.stagers, spills):
            if writes and stager is not None:
                steps.append(partial(self._stage_step, stager, writes))
        plain_dst = CPULoadStoreSpec(spec_as(dst, CPULoadStoreSpec).block_ids)
        steps.append(
            partial(
                self._submit_inner,
                self.gpu_to_cpu,
                "gpu_to_cpu",
                len(plain_dst) * self.bytes_per_block,
                (src, plain_dst),
            )
        )
        for stager, writes in zip(self.stagers, write_through):
            if writes and stager is not None:
                steps.append(partial(self._stage_step, stager, writes))
        return self._start(job_id, [steps])

    @staticmethod
    def _stage_step(stager: Stager, writes: DiskWrites) -> _Step:
        return _Step("", 0, future=stager.stage(writes))

    def shutdown(self) -> None:
        super().shutdown()
        self.gpu_to_cpu.shutdown()
        for stager in self.stagers:
            if stager is not None:
                stager.shutdown()


class TieredLoadHandler(_PipelineHandler):
    """Loads to GPU from CPU, the lower tiers, or several (see module docstring).

    ``disk_to_gpu`` and ``disk_to_cpu``: the first lower tier's handlers, or a sequence
    of them per lower tier (None where a tier has no such path); ``tier_names`` name
    the lower tiers' transfer types (``disk``: ``disk_to_gpu``, ``disk_to_cpu``)."""

    def __init__(
        self,
        cpu_to_gpu: OffloadingHandler,
        bytes_per_block: int,
        block_size_factor: int,
        disk_to_gpu: PerTier[OffloadingHandler],
        disk_to_cpu: PerTier[OffloadingHandler],
        stats: TieredStats,
        tier_names: Sequence[str] = ("disk",),
    ):
        self.to_gpu, self.to_cpu = per_tier(disk_to_gpu), per_tier(disk_to_cpu)
        super().__init__(stats, [cpu_to_gpu, *self.to_gpu, *self.to_cpu])
        self.cpu_to_gpu = cpu_to_gpu
        self.tier_names = list(tier_names)
        self.bytes_per_block = bytes_per_block
        self.factor = block_size_factor

    @property
    def disk_to_gpu(self) -> OffloadingHandler | None:
        """The first lower tier's handler straight to the GPU."""
        return self.to_gpu[0]

    @property
    def disk_to_cpu(self) -> OffloadingHandler | None:
        """The first lower tier's handler into CPU slots."""
        return self.to_cpu[0]

    def _gpu_rows(self, gpu: GPULoadStoreSpec, num_blocks: int) -> np.ndarray:
        """``(N, factor)`` GPU kernel ids per offloaded block, -1 for skipped ones."""
        ids = np.concatenate([np.full(gpu.skip_count, -1, dtype=np.int64), gpu.block_ids])
        if len(ids) != num_blocks * self.factor:
            raise ValueError(
                f"GPU spec has {len(gpu.block_ids)} block ids (skip {gpu.skip_count}); "
                f"expected {num_blocks * self.factor} for {num_blocks} offloaded blocks"
            )
        return ids.reshape(num_blocks, self.factor)

    @staticmethod
    def _gpu_spec(rows: np.ndarray) -> GPULoadStoreSpec:
        flat = rows.reshape(-1)
        skip = int((flat < 0).sum())
        return GPULoadStoreSpec(flat[skip:], skip_count=skip)

    # The three hooks below are where the GPU side of a job is expressed. An engine
    # adapter whose GPU specs are not "leading skip only" (vLLM 0.33 also truncates the
    # last block of a load) overrides them and gives kernel-level inner handlers.

    def _cpu_to_gpu_spec(self, cpu_slots: np.ndarray, rows: np.ndarray) -> TransferSpec:
        """The ``cpu_to_gpu`` job copying offloaded blocks in ``cpu_slots`` to GPU ``rows``."""
        return CPULoadStoreSpec(cpu_slots), self._gpu_spec(rows)

    def _disk_gpu_spec(self, rows: np.ndarray) -> GPULoadStoreSpec:
        """The GPU side of a ``disk_to_gpu`` job writing GPU ``rows``."""
        return self._gpu_spec(rows)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec[0], spec_as(spec[1], GPULoadStoreSpec)
        submit = self._submit_inner  # steps are built now, run later: bind their arguments
        if not isinstance(src, TieredLoadSpec):
            cpu_slots = spec_as(src, CPULoadStoreSpec).block_ids
            n = len(cpu_slots) * self.bytes_per_block
            inner = self._cpu_to_gpu_spec(cpu_slots, self._gpu_rows(dst, len(cpu_slots)))
            return self._start(job_id, [deque([partial(submit, self.cpu_to_gpu, "cpu_to_gpu", n, inner)])])
        rows = self._gpu_rows(dst, len(src))
        bpb = self.bytes_per_block
        hashes = np.array(src.block_hashes, dtype=object)
        from_cpu = src.cpu_slots >= 0
        branches = []
        if from_cpu.any():
            branches.append(
                deque(
                    [
                        partial(
                            submit,
                            self.cpu_to_gpu,
                            "cpu_to_gpu",
                            int(from_cpu.sum()) * bpb,
                            self._cpu_to_gpu_spec(src.cpu_slots[from_cpu], rows[from_cpu]),
                        )
                    ]
                )
            )
        for t in np.unique(src.lower_tiers[~from_cpu]).tolist():
            if t >= len(self.to_gpu):
                raise ValueError(
                    f"load spec names blocks of lower tier {t} but this worker has {len(self.to_gpu)} lower tier(s)"
                )
            to_gpu, to_cpu, name = self.to_gpu[t], self.to_cpu[t], self.tier_names[t]
            here = (~from_cpu) & (src.lower_tiers == t)
            promoted = here & (src.promote_slots >= 0) & (to_cpu is not None)
            direct = here & ~promoted
            if direct.any():
                if to_gpu is None:
                    raise ValueError(f"load spec names {name} blocks for the GPU but the {name} tier has no path there")
                tier_src = DiskLoadStoreSpec(src.disk_slots[direct], list(hashes[direct]))
                branches.append(
                    deque(
                        [
                            partial(
                                submit,
                                to_gpu,
                                f"{name}_to_gpu",
                                len(tier_src) * bpb,
                                (tier_src, self._disk_gpu_spec(rows[direct])),
                            )
                        ]
                    )
                )
            if promoted.any():
                tier_src = DiskLoadStoreSpec(src.disk_slots[promoted], list(hashes[promoted]))
                slots = src.promote_slots[promoted]
                n = len(tier_src) * bpb
                branches.append(
                    deque(
                        [
                            partial(submit, to_cpu, f"{name}_to_cpu", n, (tier_src, CPULoadStoreSpec(slots))),
                            partial(
                                submit, self.cpu_to_gpu, "cpu_to_gpu", n, self._cpu_to_gpu_spec(slots, rows[promoted])
                            ),
                        ]
                    )
                )
        return self._start(job_id, branches)

    def shutdown(self) -> None:
        super().shutdown()
        for handler in self._inner:
            handler.shutdown()
