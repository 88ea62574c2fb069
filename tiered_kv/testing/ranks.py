"""Every tensor-parallel rank of one engine in one process, for the fault suite.

Runs in a test process or a crash child. vLLM runs one worker per rank, each with its
own KV cache, and reports a job finished once every worker has; here each rank's
``HierarchySpec`` builds a real worker over its own ``DeviceKVCache``, and
``RankWorkers`` puts them behind the one worker that ``EngineDriver`` drives. Every
rank holds the same bytes for a block (``block_content``), so what each rank loads
and stores can be checked exactly. No I/O of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiered_kv.sim.driver import DeviceKVCache, EngineDriver, block_content
from tiered_kv.memory.host_memory import pack_blocks, unpack_blocks
from tiered_kv.worker.worker import OffloadingHandler, OffloadingWorker, TransferResult, TransferSpec


class RankWorkers:
    """One worker per rank behind the ``OffloadingWorker`` calls the driver makes: a
    job is submitted to every rank and finishes once each rank has reported it, failed
    if any rank failed it."""

    def __init__(self, workers: Sequence[OffloadingWorker]):
        self.workers = list(workers)
        self._reports: dict[int, list[bool]] = {}

    @property
    def handlers(self) -> list[OffloadingHandler]:
        return [h for w in self.workers for h in w.handlers]

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        accepted = [w.transfer_async(job_id, spec) for w in self.workers]
        return all(accepted)

    def get_finished(self) -> list[TransferResult]:
        done = []
        for w in self.workers:
            for r in w.get_finished():
                seen = self._reports.setdefault(r.job_id, [])
                seen.append(r.success)
                if len(seen) == len(self.workers):
                    del self._reports[r.job_id]
                    done.append(TransferResult(r.job_id, all(seen)))
        return done

    def wait(self, job_ids: set[int]) -> None:
        for w in self.workers:
            w.wait(job_ids)

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()


class RanksDriver(EngineDriver):
    """``EngineDriver`` over every rank's device cache: a computed block is written to
    each, and a loaded block must hold its bytes on each (a rank that loaded wrong
    bytes counts as a mismatch)."""

    def __init__(self, manager, worker: RankWorkers, devices: Sequence[DeviceKVCache]):
        super().__init__(manager, worker, devices[0])
        self.devices = list(devices)

    def _compute(self, block_hashes, groups) -> None:
        if not block_hashes:
            return
        f = self.layout.block_size_factor
        content = block_content(block_hashes, self.layout.bytes_per_block)
        for dev in self.devices:
            unpack_blocks(content, dev.tensors, self.layout, self._kernel_ids(groups).reshape(-1, f))

    def _verify(self, block_hashes, groups) -> list[int]:
        f = self.layout.block_size_factor
        want = block_content(block_hashes, self.layout.bytes_per_block)
        bad: set[int] = set()
        for dev in self.devices:
            got = torch.empty((len(block_hashes), self.layout.bytes_per_block), dtype=torch.uint8)
            pack_blocks(dev.tensors, self.layout, self._kernel_ids(groups).reshape(-1, f), got)
            bad.update(torch.nonzero((got != want).any(dim=1)).reshape(-1).tolist())
        return sorted(bad)
