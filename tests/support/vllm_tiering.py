"""vLLM's ``TieringOffloadingSpec`` with a worker that runs without CUDA, for tests of
our ``TieredDiskTier`` under vLLM's real tiering manager (its CPU tier in vLLM's shared
region, its secondary tiers as the config builds them). Name it in an extra config as
``"spec_name": "ShmTieringSpec", "spec_module_path": "support.vllm_tiering"``."""

from __future__ import annotations

from vllm.v1.kv_offload.base import TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from support import vllm_harness as vh

MODULE = __name__


class ShmHostWorker(vh.ChunkCopyWorker):
    """vLLM's CPU worker where it cannot run (it needs CUDA): synchronous copies between
    the CPU tensors standing in for the GPU and vLLM's shared CPU-tier region, through
    the per-worker row views vLLM's own worker takes (``create_next_worker_view``, one
    per canonical tensor), so a row's bytes land in the pages where vLLM's would (the
    rows the scheduler-side tiers see through ``primary_kv_view``)."""

    def __init__(self, kv_caches, spec: TieringOffloadingSpec):
        self.region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=0,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        self.bpc = spec.blocks_per_chunk
        self.gpu = [t.tensor for t in kv_caches.tensors]
        self.page = [t.page_size_bytes for t in kv_caches.tensors]
        self.rows = [self.region.create_next_worker_view(p * self.bpc) for p in self.page]
        self.done: list[TransferResult] = []

    @staticmethod
    def chunk_ids(spec):
        return spec.chunk_ids

    def shutdown(self):
        self.rows.clear()
        self.region.cleanup()


class ShmTieringSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec (its real manager, CPU tier and secondary tiers) with
    ``ShmHostWorker`` as its worker."""

    def get_worker(self, kv_caches):
        if getattr(self, "_shm_worker", None) is None:
            self._shm_worker = ShmHostWorker(kv_caches, self)
        return self._shm_worker
