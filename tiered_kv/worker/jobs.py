"""Job bookkeeping shared by the handlers that run their jobs on threads of their own,
and how they read a job's CPU or GPU spec as rows of kernel block ids.

Worker process. ``ThreadedHandler`` keeps the part of the ``OffloadingHandler``
contract that does not depend on what a job moves: the jobs in flight, the results
not yet collected, ``get_finished``, ``wait`` and an idempotent ``shutdown``. A
subclass validates a job in ``transfer_async``, hands it to ``_submit`` (which runs it
on the handler's job threads) and reports its outcome once with ``_finish``, from
whichever thread learns it. ``cpu_kernel_rows`` and ``gpu_kernel_rows`` turn a job's
CPU slots or GPU block ids into one row of ``block_size_factor`` kernel block ids per
offloaded block. No I/O of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tiered_kv.memory.host_memory import expand_block_ids
from tiered_kv.mediums import CPULoadStoreSpec, GPULoadStoreSpec, GPURowsSpec
from tiered_kv.worker.worker import OffloadingHandler, TransferResult


class ThreadedHandler(OffloadingHandler):
    """An ``OffloadingHandler`` whose jobs run on ``threads`` threads named ``name``.

    ``shutdown`` refuses new jobs, waits for the queued and running ones, then for
    every job still to be reported (a job may be reported after its thread is done,
    e.g. when a group commit settles it), and finally calls ``_release``."""

    def __init__(self, threads: int, name: str):
        self._jobs = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._cond = threading.Condition()
        self._finished: list[TransferResult] = []
        self._inflight: set[int] = set()
        self._closed = False

    def _submit(self, job_id: int, run: Callable[..., Any], *args: Any) -> bool:
        """Run ``run(*args)`` on a job thread as job ``job_id``; False once shut down."""
        with self._cond:
            if self._closed:
                return False
            self._inflight.add(job_id)
        self._jobs.submit(run, *args)
        return True

    def _finish(self, job_id: int, ok: bool, seconds: float, nbytes: int) -> None:
        """Report job ``job_id`` (its time and size are kept for a success only)."""
        with self._cond:
            self._inflight.discard(job_id)
            self._finished.append(TransferResult(job_id, ok, seconds if ok else None, nbytes if ok else None))
            self._cond.notify_all()

    def get_finished(self) -> list[TransferResult]:
        with self._cond:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not (self._inflight & set(job_ids)))

    def shutdown(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._jobs.shutdown(wait=True)
        with self._cond:
            self._cond.wait_for(lambda: not self._inflight)
        self._release()

    def _release(self) -> None:
        """What the subclass frees once no job runs (called once, by ``shutdown``)."""


def cpu_kernel_rows(spec: CPULoadStoreSpec, n: int, factor: int, unit: str = "blocks") -> np.ndarray:
    """``(n, factor)`` kernel ids of the CPU slots of ``spec``, one slot per block;
    raises ``ValueError`` (naming the ``unit`` of ``n``) when the counts differ."""
    if len(spec) != n:
        raise ValueError(f"{len(spec)} CPU slots but {n} {unit}; expected one per block")
    return expand_block_ids(spec.block_ids, factor).reshape(-1, factor)


def gpu_kernel_rows(spec: GPULoadStoreSpec, n: int, factor: int, unit: str = "blocks") -> np.ndarray:
    """``(n, factor)`` GPU block ids of ``spec`` (-1 for the first ``skip_count``
    positions, or wherever a ``GPURowsSpec`` has -1); raises ``ValueError`` (naming the
    ``unit`` of ``n``) when ``spec`` does not cover ``n`` blocks of ``factor`` GPU blocks
    less ``skip_count``."""
    if isinstance(spec, GPURowsSpec):
        if spec.rows.shape != (n, factor):
            raise ValueError(f"GPU rows {spec.rows.shape} do not match {n} {unit} of {factor} GPU blocks")
        return spec.rows
    skip = spec.skip_count
    if not 0 <= skip < factor or len(spec) + skip != n * factor:
        raise ValueError(
            f"GPU spec has {len(spec)} block ids with skip_count {skip}; {n} {unit} of "
            f"{factor} GPU blocks need {n * factor} - skip_count ids"
        )
    ids = np.full(n * factor, -1, dtype=np.int64)
    ids[skip:] = spec.block_ids
    return ids.reshape(n, factor)


__all__ = ["ThreadedHandler", "cpu_kernel_rows", "gpu_kernel_rows"]
