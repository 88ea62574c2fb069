"""OffloadingWorker routing: registration, unregistered and duplicate medium pairs,
and faulty handlers reported as failed jobs instead of crashes."""

from __future__ import annotations

import pytest

from conftest import make_layout, random_tensors
from tiered_kv.memory.host_memory import HostKVCache
from tiered_kv.mediums import CPULoadStoreSpec, DiskLoadStoreSpec, GPULoadStoreSpec
from tiered_kv.cpu.handlers import CpuGpuOffloadingHandlers
from tiered_kv.worker.worker import (
    HandlerRegistrationError,
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    UnregisteredTransferError,
)


class FaultyHandler(OffloadingHandler):
    """Fault injection: raises or refuses on demand."""

    def __init__(self, raise_on_submit=False, refuse=False, raise_on_finished=False):
        self.raise_on_submit, self.refuse, self.raise_on_finished = raise_on_submit, refuse, raise_on_finished
        self.accepted: list[int] = []
        self.waited: list[set[int]] = []
        self.shutdowns = 0

    def transfer_async(self, job_id, spec):
        if self.raise_on_submit:
            raise RuntimeError("injected submit failure")
        if self.refuse:
            return False
        self.accepted.append(job_id)
        return True

    def get_finished(self):
        if self.raise_on_finished:
            raise RuntimeError("injected get_finished failure")
        done, self.accepted = self.accepted, []
        return [TransferResult(j, True) for j in done]

    def wait(self, job_ids):
        self.waited.append(set(job_ids))

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def real_worker():
    layout = make_layout(True, num_gpu_blocks=8)
    gpu = random_tensors(layout)
    host = HostKVCache(layout, 4)
    handlers = CpuGpuOffloadingHandlers(gpu, host)
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler)
    with worker:
        yield worker, handlers, gpu, host


def test_routes_by_medium_pair(real_worker):
    worker, handlers, gpu, host = real_worker
    store = (GPULoadStoreSpec([3]), CPULoadStoreSpec([1]))
    load = (CPULoadStoreSpec([1]), GPULoadStoreSpec([6]))
    assert worker.handler_for(store) is handlers.gpu_to_cpu_handler
    assert worker.handler_for(load) is handlers.cpu_to_gpu_handler
    assert worker.transfer_async(1, store)
    worker.wait({1})
    assert worker.transfer_async(2, load)
    worker.wait({2})
    assert sorted(worker.get_finished()) == [TransferResult(1, True), TransferResult(2, True)]
    for t in gpu:
        assert t[:, 6].numpy().tobytes() == t[:, 3].numpy().tobytes()


def test_unregistered_pair_is_a_wiring_error(real_worker):
    worker, *_ = real_worker
    spec = (CPULoadStoreSpec([0]), DiskLoadStoreSpec([0], [b"h"]))
    with pytest.raises(UnregisteredTransferError, match=r"CPU -> DISK.*registered: CPU -> GPU, GPU -> CPU"):
        worker.transfer_async(1, spec)
    assert worker.get_finished() == []


def test_duplicate_pair_is_rejected_and_keeps_the_first(real_worker):
    worker, handlers, *_ = real_worker
    with pytest.raises(HandlerRegistrationError, match="GPU -> CPU"):
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, FaultyHandler())
    assert worker.handler_for((GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))) is handlers.gpu_to_cpu_handler


def test_a_refused_or_raising_submission_is_never_reported():
    """The seed's contract: a job transfer_async did not accept was never submitted, so
    get_finished does not report it (a caller that settled it at once must not see it
    again)."""
    worker = OffloadingWorker()
    good, bad, refusing = FaultyHandler(), FaultyHandler(raise_on_submit=True), FaultyHandler(refuse=True)
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, good)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, bad)
    worker.register_handler(CPULoadStoreSpec, DiskLoadStoreSpec, refusing)
    assert worker.transfer_async(1, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    assert not worker.transfer_async(2, (CPULoadStoreSpec([0]), GPULoadStoreSpec([0])))
    assert not worker.transfer_async(3, (CPULoadStoreSpec([0]), DiskLoadStoreSpec([0], [b"x"])))
    assert sorted(worker.get_finished()) == [TransferResult(1, True)]
    assert worker.get_finished() == []


def test_handler_raising_in_get_finished_fails_only_its_jobs():
    worker = OffloadingWorker()
    good, bad = FaultyHandler(), FaultyHandler(raise_on_finished=True)
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, good)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, bad)
    worker.transfer_async(1, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    worker.transfer_async(2, (CPULoadStoreSpec([0]), GPULoadStoreSpec([0])))
    assert sorted(worker.get_finished()) == [TransferResult(1, True), TransferResult(2, False)]


def test_wait_goes_to_the_handler_running_each_job():
    worker = OffloadingWorker()
    a, b = FaultyHandler(), FaultyHandler()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, a)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, b)
    worker.transfer_async(1, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    worker.transfer_async(2, (CPULoadStoreSpec([0]), GPULoadStoreSpec([0])))
    worker.wait({1, 2, 99})
    assert a.waited == [{1}] and b.waited == [{2}]


def test_bad_spec_in_real_handler_is_a_failed_job(real_worker):
    worker, *_ = real_worker
    # 2 GPU blocks into 1 CPU slot: the handler raises ValueError, the worker reports failure.
    assert not worker.transfer_async(5, (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([0])))
    assert worker.get_finished() == []


def test_results_carry_transfer_size_and_type(real_worker):
    """As vLLM 0.33's results do: the bytes a job moved and its (src, dst) mediums."""
    worker, handlers, *_ = real_worker
    assert worker.transfer_async(6, (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([0, 1])))
    worker.wait({6})
    (result,) = worker.get_finished()
    kernel_block = handlers.gpu_to_cpu_handler._kernel_block_bytes
    assert result.success and result.transfer_size == 2 * kernel_block > 0
    assert result.transfer_type == ("GPU", "CPU") and result.seconds is not None


def test_a_worker_used_in_a_with_block_shuts_every_handler_down_even_when_the_block_raises():
    store, load = FaultyHandler(), FaultyHandler(raise_on_finished=True)
    with pytest.raises(RuntimeError, match="the engine failed"):
        with OffloadingWorker() as worker:
            worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, store)
            worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, load)
            raise RuntimeError("the engine failed")
    assert (store.shutdowns, load.shutdowns) == (1, 1)
    with store:  # a handler alone is a context manager too
        pass
    assert store.shutdowns == 2


def test_a_step_that_raises_as_it_starts_fails_its_job_once_and_nothing_after_it_runs(tmp_path):
    """A spill's staging step raises at once (the fault: a stager shut down, as at exit):
    the store job is reported failed, exactly once, and its GPU -> CPU copy never runs
    into a CPU slot the scheduler may already have handed on."""
    import numpy as np
    import torch

    from tiered_kv.mediums import TierWrites
    from tiered_kv.testing.harness import Hierarchy
    from tiered_kv.tiered.transfer_specs import TieredStoreSpec

    with Hierarchy(str(tmp_path / "c"), cpu_blocks=4, disk_blocks=40, write_policy="write_back") as h:
        h.stager.shutdown()
        host, factor = h.spec.host, h.device.layout.block_size_factor
        before = host.slot_rows[1].clone()
        dst = TieredStoreSpec([1], spills=[TierWrites([0], [7], [b"victim"])], write_through=[TierWrites()])
        worker = h.driver.worker
        assert worker.transfer_async(99, (GPULoadStoreSpec(np.arange(factor) + 2 * factor), dst))
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(99, False)]
        assert worker.get_finished() == [] and torch.equal(before, host.slot_rows[1])
