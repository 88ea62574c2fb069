"""The doctor's check of the disk tier's read speed against the model's break-even.

Runs in the operator's process (``tiered-kv doctor``). Its I/O: one probe file
(``probe_bytes``, 64 MiB by default) written with O_DIRECT in the disk tier's directory
or, before its first run creates it, in its nearest existing parent (the file system it
will be on), read back with O_DIRECT by the tier's number of I/O threads (the page cache
never answers), and removed. Reads the model's ``config.json`` where the model is known.

Loading a token from a tier beats recomputing it only when the tier reads faster than
``KV bytes per token x prefill tokens per second`` (the break-even; README's rule), as
``tiered_kv.prefill.break_even`` computes it for ``tiered-kv config`` too: one rank's KV
bytes at the prefill rate of the TP group (``--prefill-tps``, else the config's
``prefill_tokens_per_s``, else estimated for TP GPUs); the disk is compared with TP times
that, as every rank of the node reads its shard from it at once.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.config import ConfigError, TieredConfig, format_size
from tiered_kv.prefill import break_even, local_gpu_name, model_parameters
from tiered_kv.ops.doctor.disk import existing_ancestor
from tiered_kv.ops.doctor.report import OK, WARN, Check, skipped
from tiered_kv.ops.presets import find_preset
from tiered_kv.ops.sizing import ModelGeometry

#: Prefill tokens/s where the model or the GPU is unknown: Llama-3.1-8B on one H100 SXM at
#: an assumed 50% MFU (0.5 x 989 TFLOPS / (2 x 8.03e9 FLOP per token); tools/replay_model.py).
DEFAULT_PREFILL_TPS = 30_800.0
DEFAULT_PROBE_BYTES = 64 << 20
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ReadSpeed:
    """``bytes_read`` read in ``seconds`` with O_DIRECT by ``threads`` threads in chunks of
    ``chunk`` bytes."""

    bytes_read: int
    seconds: float
    threads: int
    chunk: int

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def time_o_direct_read(directory: str | os.PathLike, probe_bytes: int, threads: int = 4) -> ReadSpeed:
    """Write ``probe_bytes`` (rounded up to 1 MiB) to a probe file in ``directory`` with
    O_DIRECT and time reading it back with O_DIRECT on ``threads`` threads; the file is
    removed. Raises ``OSError`` where the file system refuses O_DIRECT or room."""
    chunks = max(1, -(-probe_bytes // _CHUNK))
    path = Path(directory) / f".tiered-kv-doctor-read-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_NOFOLLOW, 0o600)
    try:
        buf = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT needs
        try:
            buf.write(os.urandom(_CHUNK))
            for i in range(chunks):
                os.pwrite(fd, buf, i * _CHUNK)
            os.fdatasync(fd)
        finally:
            buf.close()

        def read(part: int) -> int:
            own = mmap.mmap(-1, _CHUNK)
            try:
                return sum(os.preadv(fd, [own], i * _CHUNK) for i in range(part, chunks, threads))
            finally:
                own.close()

        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            done = sum(pool.map(read, range(threads)))
            seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return ReadSpeed(done, seconds, threads, _CHUNK)


def model_geometry(cfg: TieredConfig | None, model: str | None) -> ModelGeometry | None:
    """The model's KV geometry: ``model`` (a model directory, its ``config.json``, or a
    preset's name or hub id), else the config's ``model_path``, else a preset whose hub
    id is the config's ``model_id``; None when none of them is known. Raises
    ``ConfigError`` for a ``model`` that is none of those."""
    if model is not None:
        if Path(model).exists():
            return ModelGeometry.from_hf_config(model, full_attention_only=True)
        return find_preset(model).geometry
    if cfg is None:
        return None
    if cfg.model_path and (Path(cfg.model_path) / "config.json").is_file():
        return ModelGeometry.from_hf_config(cfg.model_path, full_attention_only=True)
    try:
        return find_preset(cfg.model_id).geometry
    except ConfigError:
        return None


def model_parameters_of(cfg: TieredConfig | None, model: str | None) -> int | None:
    """The model's parameter count, for the prefill estimate, from the config ``model_geometry``
    reads (None where it is unknown or lacks the fields)."""
    hf: object = None
    try:
        if model is not None:
            hf = _read_json(model) if Path(model).exists() else find_preset(model).hf_config
        elif cfg is not None and cfg.model_path and (Path(cfg.model_path) / "config.json").is_file():
            hf = _read_json(cfg.model_path)
        elif cfg is not None:
            hf = find_preset(cfg.model_id).hf_config
        if isinstance(hf, dict) and "num_hidden_layers" not in hf and isinstance(hf.get("text_config"), dict):
            hf = hf["text_config"]
        return model_parameters(hf) if isinstance(hf, dict) else None
    except (ConfigError, OSError, ValueError):
        return None


def _read_json(path: str) -> object:
    p = Path(path)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def check_disk_speed(
    cfg: TieredConfig | None,
    geometry: ModelGeometry | None,
    *,
    prefill_tps: float | None = None,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    tp: int = 1,
    parameters: int | None = None,
    gpu: str | None = None,
) -> Check:
    """The disk tier's O_DIRECT read speed against ``geometry``'s break-even at TP ``tp``
    (``tiered_kv.prefill.break_even``): at ``prefill_tps``, else the config's
    ``prefill_tokens_per_s``, else the estimate for ``tp`` GPUs ``gpu`` (default: this
    machine's) and a model of ``parameters``; the default where those are unknown, said
    to be assumed."""
    if cfg is None or (disk := cfg.disk_tier) is None:
        return skipped("disk_read", "no disk tier configured: no read speed to time")
    path = Path(disk.settings.path).expanduser()
    if probe_bytes <= 0:
        return skipped("disk_read", "disk read speed not timed (--read-probe 0)", "pass --read-probe SIZE to time it")
    where = path if path.is_dir() else existing_ancestor(path)
    try:
        speed = time_o_direct_read(where, probe_bytes, disk.settings.io_threads)
    except OSError as e:
        return skipped(
            "disk_read",
            f"disk read speed not timed: the O_DIRECT probe in {where} failed ({e.strerror})",
            f"run doctor as the server's user, on a file system that takes O_DIRECT, or create {path}",
        )
    facts: dict[str, Any] = {
        "read_gbps": round(speed.gbps, 3),
        "probe_bytes": speed.bytes_read,
        "threads": speed.threads,
        "chunk_bytes": speed.chunk,
        "timed_in": str(where),
    }
    # Before the first run the directory is missing: its parent is the file system it will be on.
    at = "" if where == path else f" (timed in {where}, the nearest existing parent)"
    measured = (
        f"disk_path {path}{at} reads {speed.gbps:.2f} GB/s (O_DIRECT, {speed.threads} threads of "
        f"{format_size(speed.chunk)} reads, {format_size(speed.bytes_read)})"
    )
    if geometry is None:
        return Check(
            "disk_read",
            OK,
            f"{measured}; not compared with a break-even: the model is unknown "
            f"(set model_path in the config or pass --model)",
            facts=facts,
        )
    given, whence = (prefill_tps, "--prefill-tps") if prefill_tps else (cfg.prefill_tokens_per_s, "")
    whence = whence or "configured (prefill_tokens_per_s)"
    even = break_even(geometry.kv_bytes_per_token(tp), tp, given, parameters, gpu or local_gpu_name(), whence)
    source = even.prefill.source
    if not given and source.startswith("default"):  # the model or the GPU is unknown
        source = f"assumed: {source}; pass --prefill-tps"
    tps = even.prefill.tokens_per_s
    facts.update(
        {
            "break_even_gbps": round(even.rank_gbps, 3),
            "node_break_even_gbps": round(even.node_gbps, 3),
            "tp": tp,
            "kv_bytes_per_token": even.kv_bytes_per_token,
            "prefill_tps": tps,
            "model": geometry.name,
        }
    )
    node = f" (x TP {tp} = {even.node_gbps:.2f} GB/s for the node, its ranks reading at once)" if tp > 1 else ""
    rule = (
        f"break-even of {even.rank_gbps:.2f} GB/s per rank{node} for {geometry.name or 'the model'} "
        f"({even.kv_bytes_per_token:,} B of KV per token per rank x {tps:,.0f} prefill tokens/s, {source})"
    )
    if speed.gbps < even.node_gbps:
        return Check(
            "disk_read",
            WARN,
            f"{measured}, below the {rule}: a block loaded from this disk arrives later than its recompute",
            "put disk_path on faster local NVMe (or several drives striped), or leave disk_path unset",
            facts,
        )
    return Check("disk_read", OK, f"{measured}, above the {rule}", facts=facts)
