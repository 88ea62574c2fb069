"""The tier seam from outside the package: a tier written here, one file per block and
rank in a directory of its own, registered by ``module_path`` in the config alone, runs
under vLLM 0.33's real scheduler and worker connector (tests/support/vllm_harness.py,
``worker="real"``) below our CPU tier, and its blocks come back byte-exact. Nothing
under tiered_kv/ knows of it. Also: the vLLM plug-in's manager and workers are built by
``HierarchySpec``, the builder the simulator, the demo and the tools use.

``FileTier`` is a real tier, not a mock: its worker side writes each block's bytes to
``<dir>/<hash>.r<rank>`` (written to a temporary name, fsynced, renamed), its
scheduler side learns a block is durable when every rank's file is there (``refresh``),
and its loads read those files back into CPU slots or the KV cache.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import torch

from tiered_kv.abstract import BlockHash, Closing, OffloadingEvent, PrepareStoreOutput
from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.memory.host_memory import HostKVCache, pack_blocks, unpack_blocks
from tiered_kv.mediums import TierSlotsSpec
from tiered_kv.metrics import MetricDef, TieredStats
from tiered_kv.tier_ops import FAIL, OK, Check, TierInspector, ToolContext
from tiered_kv.tier_registry import TierEntry
from tiered_kv.tiered.transfer_specs import TierWrites
from tiered_kv.tiers import TierSpec
from tiered_kv.worker.jobs import ThreadedHandler, cpu_kernel_rows, gpu_kernel_rows
from tiered_kv.worker.worker import LowerTierWorker, TransferSpec

FILE = "FILE"
FILES_WRITTEN = "files_tier_files_written"


class FileSlots(TierSlotsSpec):
    """Blocks of a ``FileTier``: addressed by hash (the slot ids are unused)."""

    @staticmethod
    def medium() -> str:
        return FILE


def _path(directory: str, block_hash: bytes, rank: int) -> str:
    return os.path.join(directory, f"{block_hash.hex()}.r{rank}")


class FileTierManager(Closing):
    """Scheduler side: an LRU of at most ``capacity`` blocks, pending until every rank's
    file exists."""

    reads_first = False  # its worker writes and reads in the order they come

    def __init__(self, directory: str, capacity: int, world_size: int, block_size: int, name: str, medium: str):
        self.directory, self.world_size, self.block_size = directory, world_size, block_size
        self.name, self.medium = name, medium
        self.on_corrupt = None
        self._capacity = capacity
        self._loadable: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        self._pending: set[bytes] = set()
        self._pins: dict[bytes, int] = {}
        self._events: list[OffloadingEvent] = []

    @property
    def capacity(self) -> int:
        return self._capacity

    def num_free_slots(self) -> int:
        return self._capacity - len(self._loadable) - len(self._pending)

    def is_loadable(self, block_hash: BlockHash) -> bool:
        return block_hash in self._loadable

    def is_pending(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pending

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return 0 if block_hash in self._loadable else None

    def absent_among(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        return [h for h in block_hashes if h not in self._loadable and h not in self._pending]

    def prepare_store(
        self, block_hashes: Iterable[BlockHash], *, fresh: bool = False, protected: Container[BlockHash] = ()
    ) -> PrepareStoreOutput | None:
        new = list(dict.fromkeys(self.absent_among(block_hashes)))
        keep = set(new)
        victims = [h for h in self.iter_evictable() if h not in keep and h not in protected]
        short = len(new) - self.num_free_slots()
        if short > len(victims):
            return None
        for victim in victims[: max(short, 0)]:
            self.remove(victim)
        self._pending.update(new)
        return PrepareStoreOutput(new, FileSlots([0] * len(new), new), victims[: max(short, 0)])

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        for h in block_hashes:
            if h in self._pending:
                self._pending.discard(h)
                if success:
                    self._land(h)

    def _land(self, block_hash: bytes) -> None:
        self._loadable[block_hash] = None
        self._events.append(OffloadingEvent([block_hash], self.block_size, self.medium, removed=False))

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> FileSlots:
        hashes = list(block_hashes)
        for h in hashes:
            if h not in self._loadable:
                raise KeyError(h)
            self._pins[h] = self._pins.get(h, 0) + 1
        return FileSlots([0] * len(hashes), hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        for h in block_hashes:
            self._pins[h] -= 1
            if not self._pins[h]:
                del self._pins[h]

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        for h in reversed(list(block_hashes)):
            if h in self._loadable:
                self._loadable.move_to_end(h)

    def remove(self, block_hash: BlockHash) -> bool:
        if self._pins.get(block_hash) or block_hash not in self._loadable:
            return False
        del self._loadable[block_hash]
        for rank in range(self.world_size):
            try:
                os.unlink(_path(self.directory, block_hash, rank))
            except FileNotFoundError:
                pass
        self._events.append(OffloadingEvent([block_hash], self.block_size, self.medium, removed=True))
        return True

    def iter_evictable(self) -> Iterator[BlockHash]:
        return iter([h for h in self._loadable if not self._pins.get(h)])

    def num_pending(self) -> int:
        return len(self._pending)

    def pending_blocks(self) -> set[BlockHash]:
        return set(self._pending)

    def refresh(self) -> int:
        """A pending block lands once every rank's file is there."""
        landed = [
            h for h in self._pending if all(os.path.exists(_path(self.directory, h, r)) for r in range(self.world_size))
        ]
        self.complete_store(landed)
        return len(landed)

    def take_events(self) -> Iterable[OffloadingEvent]:
        out, self._events = self._events, []
        return out

    def shutdown(self) -> None:
        return


class FileStager(Closing):
    """Worker side of writes: packs the CPU slots and writes each block's file on the
    caller's thread (durable before the future is done)."""

    def __init__(self, host: HostKVCache, directory: str, rank: int):
        self.host, self.directory, self.rank = host, directory, rank
        self.files_written = 0

    def stage(self, writes: TierWrites) -> Future[None]:
        rows = torch.empty((len(writes), self.host.layout.bytes_per_block), dtype=torch.uint8)
        pack_blocks(self.host.tensors, self.host.layout, self.host.kernel_ids(writes.cpu_slots), rows)
        for block_hash, row in zip(writes.block_hashes, rows):
            final = _path(self.directory, block_hash, self.rank)
            with open(final + ".tmp", "wb") as f:
                f.write(row.numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(final + ".tmp", final)
            self.files_written += 1
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def drain(self) -> None:
        return

    def shutdown(self) -> None:
        return


class FileWriter:
    """The warm-up's writer (``TierSpec.warm_writer``): one file per block and rank, as
    the stager writes them."""

    def __init__(self, directory: str, block_bytes: int):
        self.directory, self.block_bytes = directory, block_bytes

    def write_blocks(self, rank: int, block_hashes, slots, rows) -> list[bool]:
        for block_hash, row in zip(block_hashes, rows):
            final = _path(self.directory, block_hash, rank)
            with open(final + ".tmp", "wb") as f:
                f.write(row[: self.block_bytes].numpy().tobytes())
                os.fsync(f.fileno())
            os.replace(final + ".tmp", final)
        return [True] * len(block_hashes)

    def close(self) -> None:
        return


class FileLoadHandler(ThreadedHandler):
    """Block files -> CPU slots or the KV cache (``tensors``)."""

    def __init__(self, directory: str, rank: int, tensors: Sequence[torch.Tensor], layout: Any, *, to_gpu: bool):
        super().__init__(1, "file-tier-load")
        self.directory, self.rank, self.tensors, self.layout, self.to_gpu = directory, rank, tensors, layout, to_gpu

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        f = self.layout.block_size_factor
        n = len(src.block_hashes)
        ids = gpu_kernel_rows(dst, n, f) if self.to_gpu else cpu_kernel_rows(dst, n, f)
        return self._submit(job_id, self._run, job_id, list(src.block_hashes), ids)

    def _run(self, job_id: int, hashes: list[bytes], ids: np.ndarray) -> None:
        start = time.perf_counter()
        rows = torch.empty((len(hashes), self.layout.bytes_per_block), dtype=torch.uint8)
        ok = True
        for row, block_hash in zip(rows, hashes):
            try:
                with open(_path(self.directory, block_hash, self.rank), "rb") as f:
                    data = f.read()
            except OSError:
                ok = False
                break
            row.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if ok:
            unpack_blocks(rows, self.tensors, self.layout, ids)
        self._finish(job_id, ok, time.perf_counter() - start, rows.numel())


class FileTier(TierSpec):
    """A lower tier of one file per block and rank under ``path``, ``blocks`` at most."""

    default_name = "files"
    medium = FILE
    prior_gbps = 3.5  # read by the load decision: the tier states its own

    @classmethod
    def parse_settings(cls, raw: Mapping[str, Any], key_prefix: str) -> dict:
        if not isinstance(raw.get("path"), str):
            raise ConfigError(f"{key_prefix}path: expected a directory, got {raw.get('path')!r}")
        blocks = raw.get("blocks", 64)
        if not isinstance(blocks, int) or blocks < 1:
            raise ConfigError(f"{key_prefix}blocks: expected a positive number of blocks, got {blocks!r}")
        return {"path": raw["path"], "blocks": blocks}

    def get_manager(self) -> FileTierManager:
        os.makedirs(self.settings["path"], exist_ok=True)
        ctx = self.ctx
        manager = FileTierManager(
            self.settings["path"],
            self.settings["blocks"],
            ctx.world_size,
            ctx.layout.offloaded_block_size,
            self.name,
            self.medium,
        )
        # What a previous process left: every block whose files are all there, again.
        names = [n for n in os.listdir(manager.directory) if n.endswith(".r0")]
        manager._pending.update(bytes.fromhex(n[: -len(".r0")]) for n in names)
        manager.refresh()
        return manager

    def warm_writer(self) -> "FileWriter":
        return FileWriter(self.settings["path"], self.ctx.layout.bytes_per_block)

    # The operator's hooks: what doctor checks, what `inspect --tier` shows, what vLLM's
    # config info says of it.

    config_info_keys = ("tier_type", "files_path")
    metric_definitions = (MetricDef(FILES_WRITTEN, "counter", "Block files written by this rank"),)

    def worker_counters(self) -> list:
        return [(FILES_WRITTEN, (), self.stager.files_written)] if self.stager is not None else []

    def config_info(self) -> dict[str, Any]:
        return {"tier_type": "files", "files_path": self.settings["path"]}

    @classmethod
    def doctor_checks(cls, entry: TierEntry, ctx: ToolContext) -> list[Check]:
        path = entry.settings["path"]
        parent = os.path.dirname(os.path.abspath(path))
        if os.access(path if os.path.isdir(path) else parent, os.W_OK):
            return [Check("files_dir", OK, f"file tier {entry.name}: {path} is writable")]
        return [Check("files_dir", FAIL, f"file tier {entry.name}: {path} cannot be written", f"mkdir -p {path}")]

    @classmethod
    def inspector(cls, entry: TierEntry, ctx: ToolContext) -> TierInspector:
        return FileInspector(entry, ctx)

    def get_worker(self, host: HostKVCache, gpu_tensors: Sequence[torch.Tensor], stats: TieredStats) -> LowerTierWorker:
        path, rank, layout = self.settings["path"], self.ctx.rank, self.ctx.layout
        self.stager = FileStager(host, path, rank)
        return LowerTierWorker(
            stager=self.stager,
            to_gpu=FileLoadHandler(path, rank, gpu_tensors, layout, to_gpu=True),
            to_cpu=FileLoadHandler(path, rank, host.tensors, layout, to_gpu=False),
        )


class FileInspector(TierInspector):
    """``inspect summary --tier``: the blocks whose every rank's file is there."""

    def summary(self) -> dict[str, Any]:
        path = self.entry.settings["path"]
        names = [n for n in os.listdir(path) if ".r" in n and not n.startswith(".")]
        return {
            "path": path,
            "blocks": len({n.partition(".r")[0] for n in names}),
            "bytes": sum(os.path.getsize(os.path.join(path, n)) for n in names),
        }


def test_a_tier_entry_is_validated_by_its_own_class(tmp_path):
    entry = {"type": "FileTier", "module_path": __name__, "path": str(tmp_path)}
    cfg = TieredConfig.from_dict({"tiers": [entry]})
    assert [(e.type_name, e.name, e.settings["blocks"]) for e in cfg.tier_entries()] == [("FileTier", "files", 64)]
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.blocks: expected a positive number of blocks, got 0"):
        TieredConfig.from_dict({"tiers": [{**entry, "blocks": 0}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.type: module .* has no class 'NoSuchTier'"):
        TieredConfig.from_dict({"tiers": [{**entry, "type": "NoSuchTier"}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.type: unknown tier type 'files'; expected one of disk, remote"):
        TieredConfig.from_dict({"tiers": [{"type": "files"}]})


def test_the_warm_up_writes_a_tier_written_outside_the_package(tmp_path):
    """``tiered-kv warmup``'s library writes the config's first tier that offers a warm
    writer: one file per block, and a fresh hierarchy of the same config finds every block."""
    transformers = pytest.importorskip("transformers")
    from tiered_kv.ops.hashing import PrefixHasher, chunk_keys, resolve_seed
    from tiered_kv.ops.warmup import warmup
    from tiered_kv.ops.warmup.engines import HFEngine
    from tiered_kv.sim.driver import DeviceKVCache
    from tiered_kv.tiered.spec import HierarchySpec

    torch.manual_seed(1)
    llama = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=500
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "model")
    files = tmp_path / "files"
    config = TieredConfig.from_dict(
        {
            "cpu_bytes": "1MiB",
            "block_size": 16,
            "model_id": "tiny",
            "cover_weights": False,
            "tiers": [{"type": "FileTier", "module_path": __name__, "path": str(files), "blocks": 64}],
        }
    )
    prompts = [[7 + (i * 13 + j) % 480 for j in range(50)] for i in range(2)]
    engine = HFEngine.from_pretrained(str(tmp_path / "model"), device="cpu")
    report = warmup(prompts, engine, config, gpu_block_size=16, layout="kv-first")
    assert report.blocks_written == 6 and report.namespace.startswith("files/")
    assert len(list(files.glob("*.r0"))) == 6
    # A fresh process's hierarchy over a device cache of the model's geometry: every block found.
    device = DeviceKVCache(num_layers=2, num_gpu_blocks=8, gpu_block_size=16, num_kv_heads=2, head_dim=16)
    with HierarchySpec(config, gpu_block_size=16) as spec:
        spec.build_worker(device.kv_caches, True).shutdown()
        with spec.get_manager() as manager:
            hasher = PrefixHasher("sha256", resolve_seed("sha256", ""), 16)
            assert [manager.lookup(chunk_keys(hasher.block_hashes(p), 1)) for p in prompts] == [3, 3]


# ------------------------------------------------------------------ under vLLM

vllm_base = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM is not installed (make venv installs it)",
    exc_type=ImportError,
)

from support import vllm_harness as vh  # noqa: E402
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402

from tiered_kv.integrations.vllm.manager import TieredVllmManager  # noqa: E402
from tiered_kv.tiered.manager import TieredOffloadingManager  # noqa: E402
from tiered_kv.tiered.spec import HierarchySpec  # noqa: E402

BLOCK = 16
GPU_BLOCK_BYTES = 4096  # the harness's model: 2 layers x 2 KV heads x 16 tokens x 32 dims x 2 bytes
SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vh.write_model_config(tmp_path_factory.mktemp("model"))


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def _keys(prompt: list[int]) -> list[bytes]:
    return [make_offload_key(h, 0) for h in vh.hash_blocks(prompt, BLOCK)]


def _settle(h: vh.VllmHarness) -> None:
    for _ in range(3000):
        if not h.scheduler.has_requests() and not h.connector.has_pending_push_work():
            return
        h.step()
        time.sleep(0.0005)
    raise AssertionError("engine still busy")


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_tier_written_outside_the_package_serves_vllm_byte_exact(model_dir, tmp_path, monkeypatch):
    built: list[tuple[str, HierarchySpec]] = []
    for method in ("get_manager", "build_handlers"):
        original = getattr(HierarchySpec, method)

        def spy(self, *args, _original=original, _method=method, **kwargs):
            built.append((_method, self))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(HierarchySpec, method, spy)

    files = tmp_path / "files"
    config = {
        **SPEC,
        "cpu_bytes": f"{8 * GPU_BLOCK_BYTES}B",  # 8 chunks: a second prompt of 6 spills the first
        "write_policy": "write_back",
        "tiers": [{"type": "FileTier", "module_path": __name__, "path": str(files), "blocks": 32}],
    }
    with vh.VllmHarness.build(model_dir, config, num_gpu_blocks=64, worker="real") as h:
        # The plug-in's manager and worker came from the one builder.
        assert isinstance(h.manager, TieredVllmManager)
        assert isinstance(h.manager.composite, TieredOffloadingManager)
        assert [m for m, _ in built] == ["get_manager", "build_handlers"]
        scheduler_spec, worker_spec = (s for _, s in built)
        assert [type(t) for t in scheduler_spec.lower_tiers] == [FileTier] == [type(t) for t in worker_spec.lower_tiers]
        assert isinstance(h.manager.composite.lower[0], FileTierManager)
        assert h.manager.costs is not None and h.manager.costs.tiers["files"].prior[0] == FileTier.prior_gbps

        first, second = _prompt(1, 6 * BLOCK + 3), _prompt(2, 6 * BLOCK + 3)
        for prompt in (first, second):
            h.add_request(prompt)
            _settle(h)
        h.manager.composite.tier("files").refresh()
        on_files = [k for k in _keys(first) if h.manager.composite.tier("files").is_loadable(k)]
        assert on_files and not any(h.manager.composite.cpu.is_loadable(k) for k in on_files), (
            "the CPU tier's evictions should have spilled the first prompt to the file tier"
        )
        assert len(list(files.iterdir())) >= len(on_files)

        h.reset_gpu_prefix_cache()
        for t in h.kv_caches.values():
            t.zero_()  # only a real load can bring the prefix's bytes back
        req_id = h.add_request(first, max_tokens=3)
        for _ in range(3000):
            h.step()
            if h.scheduler.requests[req_id].num_output_tokens >= 1:
                break
            time.sleep(0.0005)
        assert h.prefix_hits[req_id].external == 6 * BLOCK
        matches = h.kv_matches(req_id)
        assert len(matches) == 6 and all(matches), matches
        _settle(h)
        assert h.manager.composite.stats.tiers["files"]["hits"] >= len(on_files)

        # What an operator sees of it, with no edit outside this module: vLLM's Prometheus
        # endpoint and `tiered-kv stats`' view of it name the tier and its traffic.
        from prometheus_client import generate_latest

        from tiered_kv.ops.metrics_view import parse, summarize

        view = summarize(parse(generate_latest(h.publish_metrics()).decode()))
        files_view = next(t for t in view["tiers"] if t["tier"] == "files")
        assert files_view["hits_blocks"] >= len(on_files) and files_view["hit_rate_tokens"], files_view
        assert files_view["load_gbps_estimate"] is not None and files_view["load_gbps_estimate"] > 0, files_view
        # The exporter: vLLM's load bytes count the file tier's loads to the GPU, and its
        # config info carries the tier's own sample.
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for m in h.publish_metrics().collect() for s in m.samples
        }
        loaded = samples[("vllm:kv_offload_load_bytes_total", (("engine", "0"),))]
        assert loaded >= len(on_files) * GPU_BLOCK_BYTES, samples
        # Its own metric: declared to vLLM from the config alone, reported by the worker.
        from tiered_kv.integrations.vllm.spec import TieredOffloadingSpec

        assert FILES_WRITTEN in TieredOffloadingSpec.build_metric_definitions(config)
        worker_stats = h.worker_spec.get_worker(None).take_stats()
        assert worker_stats is not None
        assert worker_stats.metric_sections()[1][FILES_WRITTEN][()] >= len(on_files)
        infos = [dict(labels) for (n, labels), _ in samples.items() if n == "vllm:kv_offload_config_info"]
        assert {"tier": "files", "tier_type": "files", "files_path": str(files)}.items() <= next(
            i for i in infos if i.get("tier") == "files"
        ).items(), infos

    # doctor and inspect, from the server's config file alone.
    config_file = tmp_path / "server.json"
    config_file.write_text(
        json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": config})
    )
    from tiered_kv.ops.doctor import run_doctor

    report = run_doctor(config_file, tp=1, read_probe=0)
    assert [(c.name, c.status) for c in report.checks if c.name == "files_dir"] == [("files_dir", "ok")]
    from typer.testing import CliRunner

    from tiered_kv.cli import _load_commands, app

    _load_commands()
    out = CliRunner().invoke(app, ["inspect", "summary", "--tier", "files", "--config", str(config_file), "--json"])
    assert out.exit_code == 0, out.output
    shown = json.loads(out.stdout)
    assert shown["type"] == "FileTier" and shown["blocks"] >= len(on_files), shown
    table = CliRunner().invoke(app, ["inspect", "summary", "--tier", "files", "--config", str(config_file)])
    assert table.exit_code == 0 and "tier files (FileTier)" in table.stdout, table.output
    missing = CliRunner().invoke(app, ["inspect", "summary", "--tier", "nope", "--config", str(config_file)])
    assert missing.exit_code == 2 and "its tiers: files" in missing.output, missing.output
    # A verb the tier's inspector does not offer is refused, naming the tier; its files stay.
    kept = len(list(files.iterdir()))
    refused = CliRunner().invoke(app, ["inspect", "clear", "--tier", "files", "--config", str(config_file), "--yes"])
    assert refused.exit_code == 2 and "a tier of type FileTier does not offer it" in refused.output, refused.output
    assert len(list(files.iterdir())) == kept
