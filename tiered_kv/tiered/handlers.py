"""Worker-side handlers that carry out the composite manager's plans.

Runs in each worker process (one per TP rank); the lower tiers' I/O runs on their own
stagers' and handlers' threads (``TierSpec.get_worker``), never here. Two pieces:

- ``TieredStoreHandler`` (GPU -> CPU): has each lower tier's stager copy spill victims
  out of their slots, then runs the GPU -> CPU copy into those slots, then has the
  stagers copy write-through blocks out. The job is reported when the GPU copy and the
  staging copies are done; the lower tiers' writes are not waited for, so GPU blocks
  are never held on a lower tier's I/O.
- ``TieredLoadHandler`` (CPU -> GPU and TIERED -> GPU): splits a load by tier; CPU blocks
  go on the CUDA-stream path, a lower tier's blocks straight to the GPU (its
  ``to_gpu`` handler: GDS or a bounce buffer for the disk), or into a CPU slot (its
  ``to_cpu`` handler, verified there) and then to the GPU when promoted. One result per
  job: success only if every part succeeded; a failed one names the GPU blocks of the
  parts that failed (``TransferResult.failed_gpu_blocks``), since the others landed
  whole (a CPU-resident lead before a disk read that failed).

The GPU side of a job is a ``GPULoadStoreSpec`` (whole offloaded blocks, a leading skip
at most) or, for an engine that transfers any GPU-block positions of a block (vLLM
0.33), a ``GPURowsSpec``; with ``gpu_block_granular`` the CPU <-> GPU handlers address
GPU blocks (CPU position ``slot * block_size_factor + j``) rather than whole slots.

Each parent job is a set of branches, each a sequence of steps (a sub-job on an inner
handler, or a future from a thread pool); polling advances them without blocking.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from functools import partial
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec, GPURowsSpec, TierSlotsSpec, chunk_positions, spec_as
from tiered_kv.metrics import TieredStats
from tiered_kv.tiered.transfer_specs import TierWrites, TieredLoadSpec
from tiered_kv.worker.worker import OffloadingHandler, Stager, TransferResult, TransferSpec

logger = logging.getLogger(__name__)

# Sub-job ids on inner handlers live far above any engine job id.
_SUB_JOB_IDS = itertools.count(1 << 48)


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
    finished steps; the job's time is the longest branch's (branches overlap).
    ``gpu_blocks[i]``: the GPU blocks branch ``i`` fills, where it fills any."""

    __slots__ = ("job_id", "branches", "current", "seconds", "nbytes", "gpu_blocks", "failed")

    def __init__(
        self, job_id: int, branches: list[deque[Callable[[], _Step | None]]], gpu_blocks: list[np.ndarray] | None
    ):
        self.job_id = job_id
        self.branches = branches
        self.current: list[_Step | None] = [None] * len(branches)
        self.seconds = [0.0] * len(branches)
        self.nbytes = 0  # moved by its finished steps
        self.gpu_blocks = gpu_blocks
        self.failed: list[int] = []  # branches that failed: the job succeeded if none did

    def failed_gpu_blocks(self) -> tuple[int, ...] | None:
        """The GPU blocks of the failed branches (None where the branches name none)."""
        if self.gpu_blocks is None:
            return None
        return tuple(int(b) for i in self.failed for b in self.gpu_blocks[i])


def _give_up(branch: deque) -> None:
    """Drop a failed branch's steps, telling each that has writes planned (a stage
    step: ``abandon``) that they will not happen, so its tier learns it."""
    while branch:
        step = branch.popleft()
        abandon = getattr(step, "abandon", None)
        if abandon is not None:
            abandon()


class _StageStep:
    """A step of a store job: stage ``writes`` into a lower tier's ``stager``; if it
    never runs, or raises as it starts, the stager is told the writes will not happen."""

    def __init__(self, stager: Stager, writes: TierWrites):
        self.stager, self.writes = stager, writes

    def __call__(self) -> _Step:
        try:
            return _Step("", 0, future=self.stager.stage(self.writes))
        except Exception:
            self.abandon()
            raise

    def abandon(self) -> None:
        self.stager.abandon(self.writes)


class _PipelineHandler(OffloadingHandler):
    """Runs each job as branches of sequential steps over inner handlers and futures."""

    def __init__(self, stats: TieredStats, inner: Sequence[OffloadingHandler]):
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

    def _start(self, job_id: int, branches: list[deque], gpu_blocks: list[np.ndarray] | None = None) -> bool:
        job = _Job(job_id, branches, gpu_blocks)
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
                    job.seconds[i] += seconds
                    job.nbytes += step.nbytes if result else 0
                    job.current[i] = None
                    if not result:
                        job.failed.append(i)
                        _give_up(branch)  # later steps of a failed branch would act on bad data
                if not branch:
                    break
                try:
                    job.current[i] = branch.popleft()()
                except Exception:  # a step that raises as it starts fails its branch, reported once
                    logger.exception("job %d: a step raised as it started", job.job_id)
                    job.failed.append(i)
                    _give_up(branch)

    def _poll(self) -> None:
        self._collect_inner()
        still = []
        for job_id in self._order:
            job = self._jobs[job_id]
            self._advance(job)
            if all(s is None for s in job.current) and not any(job.branches):
                del self._jobs[job_id]
                if not job.failed:
                    self._finished.append(TransferResult(job_id, True, max(job.seconds, default=0.0), job.nbytes))
                else:
                    self._finished.append(TransferResult(job_id, False, failed_gpu_blocks=job.failed_gpu_blocks()))
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

    ``stagers``: one ``Stager`` per lower tier, in tier order (None where a tier has
    none in this process). ``bytes_per_block``: bytes of one block of ``dst`` (a GPU
    block where the CPU side is addressed per GPU block)."""

    def __init__(
        self,
        gpu_to_cpu: OffloadingHandler,
        bytes_per_block: int,
        stagers: Sequence[Stager | None],
        stats: TieredStats,
    ):
        super().__init__(stats, [gpu_to_cpu])
        self.gpu_to_cpu = gpu_to_cpu
        self.bytes_per_block = bytes_per_block
        self.stagers = list(stagers)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        spills = getattr(dst, "tier_spills", ())
        write_through = getattr(dst, "tier_write_through", ())
        steps: deque = deque()
        for stager, writes in zip(self.stagers, spills):
            if writes and stager is not None:
                steps.append(_StageStep(stager, writes))
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
                steps.append(_StageStep(stager, writes))
        return self._start(job_id, [steps])

    def shutdown(self) -> None:
        super().shutdown()
        self.gpu_to_cpu.shutdown()
        for stager in self.stagers:
            if stager is not None:
                stager.shutdown()


class TieredLoadHandler(_PipelineHandler):
    """Loads to GPU from CPU, the lower tiers, or several (see module docstring).

    ``to_gpu`` and ``to_cpu``: each lower tier's handlers straight into the KV cache and
    into CPU slots, in tier order (None where a tier has no such path); ``tier_names``
    name their transfer types (``disk``: ``disk_to_gpu``, ``disk_to_cpu``).
    ``gpu_block_granular``: the CPU <-> GPU handler addresses GPU blocks, not slots."""

    def __init__(
        self,
        cpu_to_gpu: OffloadingHandler,
        bytes_per_block: int,
        block_size_factor: int,
        to_gpu: Sequence[OffloadingHandler | None],
        to_cpu: Sequence[OffloadingHandler | None],
        stats: TieredStats,
        tier_names: Sequence[str],
        *,
        gpu_block_granular: bool = False,
    ):
        self.to_gpu, self.to_cpu = list(to_gpu), list(to_cpu)
        if not len(self.to_gpu) == len(self.to_cpu) == len(tier_names):
            raise ValueError(
                f"{len(self.to_gpu)} to_gpu, {len(self.to_cpu)} to_cpu handlers and "
                f"{len(tier_names)} tier names: expected one of each per lower tier"
            )
        super().__init__(stats, [cpu_to_gpu, *[h for h in self.to_gpu + self.to_cpu if h is not None]])
        self.cpu_to_gpu = cpu_to_gpu
        self.tier_names = list(tier_names)
        self.bytes_per_block = bytes_per_block
        self.factor = block_size_factor
        self.gpu_block_granular = gpu_block_granular

    def _gpu_rows(self, gpu: GPULoadStoreSpec, num_blocks: int) -> np.ndarray:
        """``(N, factor)`` GPU kernel ids per offloaded block, -1 for skipped ones."""
        if isinstance(gpu, GPURowsSpec):
            if gpu.rows.shape != (num_blocks, self.factor):
                raise ValueError(f"GPU rows {gpu.rows.shape} do not match {num_blocks} blocks of {self.factor}")
            return gpu.rows
        ids = np.concatenate([np.full(gpu.skip_count, -1, dtype=np.int64), gpu.block_ids])
        if len(ids) != num_blocks * self.factor:
            raise ValueError(
                f"GPU spec has {len(gpu.block_ids)} block ids (skip {gpu.skip_count}); "
                f"expected {num_blocks * self.factor} for {num_blocks} offloaded blocks"
            )
        return ids.reshape(num_blocks, self.factor)

    def _cpu_to_gpu_spec(self, cpu_slots: np.ndarray, rows: np.ndarray) -> TransferSpec:
        """The ``cpu_to_gpu`` job copying offloaded blocks in ``cpu_slots`` to GPU ``rows``."""
        if self.gpu_block_granular:
            keep = rows >= 0
            return CPULoadStoreSpec(chunk_positions(cpu_slots, self.factor)[keep]), GPULoadStoreSpec(rows[keep])
        flat = rows.reshape(-1)
        skip = int((flat < 0).sum())
        return CPULoadStoreSpec(cpu_slots), GPULoadStoreSpec(flat[skip:], skip_count=skip)

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
        if (lost := ~from_cpu & (src.tier_slots < 0)).any():  # left their tier since lookup: the job fails
            raise ValueError(f"load spec gives {int(lost.sum())} block(s) no slot in any tier")
        branches = []
        filled: list[np.ndarray] = []  # per branch, the GPU blocks it fills

        def fills(chunks: np.ndarray) -> None:
            chunk_rows = rows[chunks]
            filled.append(chunk_rows[chunk_rows >= 0])

        if from_cpu.any():
            fills(from_cpu)
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
                tier_src = TierSlotsSpec(src.tier_slots[direct], list(hashes[direct]))
                fills(direct)
                branches.append(
                    deque(
                        [
                            partial(
                                submit,
                                to_gpu,
                                f"{name}_to_gpu",
                                len(tier_src) * bpb,
                                (tier_src, GPURowsSpec(rows[direct])),
                            )
                        ]
                    )
                )
            if promoted.any():
                tier_src = TierSlotsSpec(src.tier_slots[promoted], list(hashes[promoted]))
                slots = src.promote_slots[promoted]
                n = len(tier_src) * bpb
                steps = [partial(submit, to_cpu, f"{name}_to_cpu", n, (tier_src, CPULoadStoreSpec(slots)))]
                if (rows[promoted] >= 0).any():  # none: a prefetch, into the CPU tier only
                    steps.append(
                        partial(submit, self.cpu_to_gpu, "cpu_to_gpu", n, self._cpu_to_gpu_spec(slots, rows[promoted]))
                    )
                fills(promoted)
                branches.append(deque(steps))
        return self._start(job_id, branches, filled)

    def shutdown(self) -> None:
        super().shutdown()
        for handler in self._inner:
            handler.shutdown()
