"""``TieredOffloadingSpec`` with two tensor-parallel ranks, driven the way vLLM's connector
drives it: one spec per process (scheduler = rank 0's config, and one per worker), vLLM's
own ``OffloadingConfig``/``CanonicalKVCaches``/``GPULoadStoreSpec`` classes, every job
submitted to both workers and completed only when both have reported it. vLLM's harness
runs one worker, so this is where per-rank shards, per-rank disk slabs and verification
of every rank are checked."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed", exc_type=ImportError)

import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    ReqContext,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from tiered_kv.abstract import Closing  # noqa: E402
from tiered_kv.integrations.vllm import TieredOffloadingSpec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]

PAGES = (1024, 3072)  # two canonical KV tensors per rank; 4 KiB per GPU block per rank
NUM_GPU_BLOCKS = 16
WORLD = 2


def _config(rank: int, engine_id: str, extra: dict, events: bool = False, pp: bool = False) -> OffloadingConfig:
    """Rank ``rank``'s config: two tensor-parallel ranks of every layer, or (``pp``) two
    pipeline stages, each offering only its own layers as vLLM's workers do."""
    layers = (f"layers.{2 * rank}", f"layers.{2 * rank + 1}") if pp else ("layers.0", "layers.1")
    tp, stages = (1, WORLD) if pp else (WORLD, 1)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, layers, 0),),
        worker_kv_bytes_per_block=sum(PAGES),
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig("tp-test-model", "float16", 4096),
        cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(rank, WORLD, tp, stages, 1, 1, 0, 1, None, not pp),
    )


class Engine(Closing):
    """A scheduler-side manager and two workers of one engine, with CPU "GPU" tensors;
    ``pp``: two pipeline stages (the scheduler's config is stage 0's, as vLLM's is)."""

    def __init__(self, extra: dict, events: bool = False, pp: bool = False):
        engine_id = f"tp-test-{uuid.uuid4().hex[:8]}"
        self.manager = TieredOffloadingSpec(_config(0, engine_id, extra, events, pp)).get_manager()
        self.gpu: list[list[torch.Tensor]] = []
        self.workers = []
        for rank in range(WORLD):
            tensors = [torch.zeros((NUM_GPU_BLOCKS, p), dtype=torch.int8) for p in PAGES]
            caches = CanonicalKVCaches(
                [CanonicalKVCacheTensor(t, p) for t, p in zip(tensors, PAGES)],
                [[CanonicalKVCacheRef(i, p) for i, p in enumerate(PAGES)]],
            )
            self.workers.append(TieredOffloadingSpec(_config(rank, engine_id, extra, pp=pp)).get_worker(caches))
            self.gpu.append(tensors)
        self.ctx = ReqContext(req_id="r")
        self._job = 0

    def _run(self, submit) -> None:
        self._job += 1
        for worker in self.workers:
            submit(worker, self._job)
        for worker in self.workers:
            worker.wait({self._job})
            assert [r.job_id for r in worker.get_finished()] == [self._job]

    def store(self, keys: list[bytes], blocks: list[int]) -> None:
        out = self.manager.prepare_store(keys, self.ctx)
        assert out is not None and out.keys_to_store == keys
        gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
        self._run(lambda w, job: w.submit_store(job, gpu, out.store_spec))
        self.manager.complete_store(keys, self.ctx)

    def lookup(self, key: bytes, timeout: float = 10.0) -> LookupResult:
        """The settled answer: wait out HIT_PENDING (verification) like a deferring scheduler."""
        deadline = time.monotonic() + timeout
        while (result := self.manager.lookup(key, self.ctx)) is LookupResult.HIT_PENDING:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return result

    def load(self, keys: list[bytes], blocks: list[int]) -> None:
        spec = self.manager.prepare_load(keys, self.ctx)
        gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
        self._run(lambda w, job: w.submit_load(job, spec, gpu))
        self.manager.complete_load(keys, self.ctx)

    def durable(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.manager.composite.pending_writes():
            assert time.monotonic() < deadline
            time.sleep(0.005)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.manager.shutdown()


def _fill(engine: Engine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tensors in engine.gpu:
        for t in tensors:
            t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8, generator=gen))


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


@pytest.fixture
def engine(tmp_path):
    e = Engine({"cpu_bytes": f"{2 * sum(PAGES)}B", "disk_path": str(tmp_path / "disk"), "disk_bytes": "1MiB"})
    yield e
    e.close()


@pytest.fixture(params=["tp", "pp"])
def ranks(request, tmp_path):
    """Two tensor-parallel ranks, or two pipeline stages."""
    extra = {"cpu_bytes": f"{2 * sum(PAGES)}B", "disk_path": str(tmp_path / "disk"), "disk_bytes": "1MiB"}
    with Engine(extra, pp=request.param == "pp") as e:
        yield e


def test_each_rank_keeps_its_own_shard_through_cpu_and_disk(ranks, tmp_path):
    engine = ranks
    _fill(engine, 1)
    snapshot = [[t.clone() for t in tensors] for tensors in engine.gpu]
    engine.store([_key(1), _key(2)], [3, 4])
    engine.durable()
    engine.store([_key(3), _key(4)], [5, 6])  # the CPU tier holds 2 chunks: 1 and 2 go to disk only
    engine.durable()
    composite = engine.manager.composite
    assert not composite.cpu.is_loadable(_key(1)) and composite.tier("disk").is_loadable(_key(1))
    assert sorted(p.name for p in composite.tier("disk").namespace.path.glob("rank*.slab")) == [
        "rank0.slab",
        "rank1.slab",
    ]

    assert engine.manager.lookup(_key(1), engine.ctx) is LookupResult.HIT_PENDING
    assert engine.lookup(_key(1)) is LookupResult.HIT and engine.lookup(_key(2)) is LookupResult.HIT
    for tensors in engine.gpu:
        for t in tensors:
            t.zero_()
    engine.load([_key(1), _key(2)], [10, 11])
    for rank in range(WORLD):
        for now, then in zip(engine.gpu[rank], snapshot[rank]):
            assert torch.equal(now[10], then[3]) and torch.equal(now[11], then[4])
    assert not torch.equal(engine.gpu[0][0][10], engine.gpu[1][0][10]), "ranks must differ"
    assert [p.name for p in (tmp_path / "disk").iterdir() if p.is_dir()] == [composite.tier("disk").namespace.path.name]


def test_pipeline_stages_of_unequal_layers_are_refused_naming_them(tmp_path):
    """vLLM splits 5 layers over 2 stages as 3 and 2: the stages' chunks differ in bytes,
    and every rank's tiers are sized by one chunk's."""
    from support import vllm_harness as vh
    from vllm.config import set_current_vllm_config

    from tiered_kv.config import ConfigError

    model = vh.write_model_config(tmp_path / "model", num_layers=5)
    extra = {"cpu_bytes": "1MiB"}
    with set_current_vllm_config(vh.make_vllm_config(model, extra)):
        with pytest.raises(ConfigError, match=r"pipeline_parallel_size 2 splits .* stages of 3, 2 layers"):
            TieredOffloadingSpec(_config(1, "pp-uneven", extra, pp=True))
    even = vh.write_model_config(tmp_path / "even", num_layers=4)
    with set_current_vllm_config(vh.make_vllm_config(even, extra)):
        fp = TieredOffloadingSpec(_config(1, "pp-even", extra, pp=True)).geometry.fingerprint
    assert "pp_layers=2,2" in fp.kv_layout


def test_a_chunk_corrupt_on_one_rank_only_is_a_miss(engine):
    _fill(engine, 2)
    engine.store([_key(1), _key(2)], [1, 2])
    engine.durable()
    engine.store([_key(3), _key(4)], [5, 6])
    engine.durable()
    disk = engine.manager.composite.tier("disk")
    slot = disk.slot_of(_key(2))
    with open(disk.namespace.slab_path(1), "r+b") as f:  # rank 1's shard only
        f.seek(slot * disk.slot_size + 7)
        b = f.read(1)
        f.seek(slot * disk.slot_size + 7)
        f.write(bytes([b[0] ^ 1]))
    assert engine.lookup(_key(1)) is LookupResult.HIT
    assert engine.lookup(_key(2)) is LookupResult.MISS
    assert not disk.is_loadable(_key(2))
    assert engine.manager.stats.tiers["disk"]["checksum_failures"] == 1


def test_a_chunk_is_not_served_from_disk_until_every_rank_wrote_it(tmp_path):
    """A write-through that only one rank completed leaves the chunk unloadable."""
    with Engine(
        {"cpu_bytes": f"{2 * sum(PAGES)}B", "disk_path": str(tmp_path / "disk"), "disk_bytes": "1MiB"}
    ) as engine:
        _fill(engine, 3)

        def lost(writes):  # rank 1 loses its disk writes (e.g. it dies before writing)
            done: Future = Future()
            done.set_result(None)
            return done

        engine.workers[1].store_handler.stagers[0].stage = lost
        engine.store([_key(1), _key(2)], [1, 2])
        time.sleep(0.3)
        engine.store([_key(3), _key(4)], [5, 6])  # 1 and 2 leave the CPU tier
        time.sleep(0.3)
        assert engine.manager.composite.pending_writes() == 4  # never durable on rank 1
        assert engine.lookup(_key(1)) is LookupResult.MISS


def test_kv_events_name_the_tier(tmp_path):
    engine = Engine(
        {"cpu_bytes": f"{2 * sum(PAGES)}B", "disk_path": str(tmp_path / "disk"), "disk_bytes": "1MiB"}, events=True
    )
    try:
        _fill(engine, 4)
        engine.store([_key(1), _key(2)], [1, 2])
        engine.durable()
        # Evicts key 2 from the CPU tier (it is on disk): one store's tail is older than its head.
        engine.store([_key(3)], [3])
        engine.durable()
        seen = [(e.medium, e.removed, sorted(e.keys)) for e in engine.manager.take_events()]
        assert (Medium.CPU, False, [_key(1), _key(2)]) in seen
        assert (Medium.CPU, True, [_key(2)]) in seen
        stored_on_disk = sorted(k for m, removed, keys in seen if m is Medium.STORAGE and not removed for k in keys)
        assert stored_on_disk == [_key(1), _key(2), _key(3)]
        assert engine.manager.take_events() == []
    finally:
        engine.close()


def test_a_store_failed_on_one_rank_never_mixes_with_its_next_store(tmp_path):
    """Rank 1's GPU->CPU copy of a chunk fails while rank 0's disk write of it is still
    queued; the chunk is computed again (other bytes) and stored again. The disk takes
    it again only once every rank has an outcome for the failed store (rank 1 logs the
    write it dropped, rank 0's late write lands), and a load from disk then gives the
    new bytes on every rank."""
    with Engine({"cpu_bytes": f"{2 * sum(PAGES)}B", "disk_path": str(tmp_path / "disk"), "disk_bytes": "1MiB"}) as e:
        disk = e.manager.composite.tier("disk")
        stager = e.workers[0].store_handler.stagers[0]
        write, gate, batches = stager._write, threading.Event(), []

        def gated(staged):  # rank 0's first disk write batch waits for the gate
            batches.append(len(batches))
            if len(batches) == 1:
                gate.wait()
            return write(staged)

        stager._write = gated
        copy = e.workers[1].store_handler.gpu_to_cpu
        submit, fail_once = copy.transfer_async, [True]

        def failing(job, spec):
            if fail_once:
                fail_once.pop()
                raise RuntimeError("injected: rank 1's GPU->CPU copy fails")
            return submit(job, spec)

        copy.transfer_async = failing
        key = _key(1)
        _fill(e, 1)
        e.store([key], [3])  # failed on rank 1: dropped
        _fill(e, 2)
        new = [[t[3].clone() for t in tensors] for tensors in e.gpu]
        e.store([key], [3])  # into CPU; not to disk while rank 0 may still write the old store
        time.sleep(0.2)
        disk.refresh()
        assert not disk.is_loadable(key) and not disk.is_pending(key)
        gate.set()  # rank 0's write of the failed store lands
        deadline = time.monotonic() + 10
        while disk.num_free_slots() < disk.capacity and time.monotonic() < deadline:
            disk.refresh()
            disk.flush()
        assert disk.num_free_slots() == disk.capacity, "the failed store's slot never came back"
        e.store([_key(2), _key(3)], [4, 5])  # the chunk leaves the CPU tier for the disk
        e.durable()
        assert disk.is_loadable(key)
        assert e.lookup(key) is LookupResult.HIT
        for tensors in e.gpu:
            for t in tensors:
                t.zero_()
        e.load([key], [10])
        for rank in range(WORLD):
            assert all(torch.equal(t[10], b) for t, b in zip(e.gpu[rank], new[rank])), f"rank {rank}"
