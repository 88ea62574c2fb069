"""The doctor's check of the disk tier's read speed against the model's break-even.

Runs in the operator's process (``tiered-kv doctor``). Its I/O: where the disk tier's
directory exists, one probe file (``probe_bytes``, 64 MiB by default) written there
with O_DIRECT, read back with O_DIRECT by the tier's number of I/O threads (the page
cache never answers), and removed. Reads the model's ``config.json`` where the model is
known.

Loading a token from a tier beats recomputing it only when the tier reads faster than
``KV bytes per token x prefill tokens per second`` (the break-even; README's rule). The
KV bytes are the whole model's (every TP rank reads its shard from the same host at
once); the prefill rate is the operator's ``--prefill-tps`` or an assumed default.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.config import ConfigError, TieredConfig, format_size
from tiered_kv.ops.doctor.report import OK, WARN, Check
from tiered_kv.ops.presets import find_preset
from tiered_kv.ops.sizing import ModelGeometry

#: Prefill tokens/s assumed without ``--prefill-tps``: Llama-3.1-8B on one H100 SXM at
#: an assumed 50% MFU (0.5 x 989 TFLOPS / (2 x 8.03e9 FLOP per token); tools/replay_model.py).
DEFAULT_PREFILL_TPS = 30_800.0
DEFAULT_PREFILL_SOURCE = "assumed: Llama-3.1-8B on one H100 SXM at 50% MFU; pass --prefill-tps"
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


def check_disk_speed(
    cfg: TieredConfig | None,
    geometry: ModelGeometry | None,
    *,
    prefill_tps: float | None = None,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
) -> Check:
    """The disk tier's O_DIRECT read speed against ``geometry``'s break-even at
    ``prefill_tps`` (default ``DEFAULT_PREFILL_TPS``, said to be assumed)."""
    if cfg is None or cfg.disk_path is None:
        return Check("disk_read", OK, "no disk tier: no read speed to time")
    path = Path(cfg.disk_path).expanduser()
    if probe_bytes <= 0:
        return Check("disk_read", OK, "disk read speed not timed (--read-probe 0)")
    if not path.is_dir():
        return Check("disk_read", OK, f"disk read speed not timed: {path} does not exist yet")
    try:
        speed = time_o_direct_read(path, probe_bytes, cfg.io_threads)
    except OSError as e:
        return Check("disk_read", OK, f"disk read speed not timed: O_DIRECT probe in {path} failed ({e.strerror})")
    facts: dict[str, Any] = {
        "read_gbps": round(speed.gbps, 3),
        "probe_bytes": speed.bytes_read,
        "threads": speed.threads,
        "chunk_bytes": speed.chunk,
    }
    measured = (
        f"disk_path {path} reads {speed.gbps:.2f} GB/s (O_DIRECT, {speed.threads} threads of "
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
    tps = DEFAULT_PREFILL_TPS if prefill_tps is None else prefill_tps
    source = DEFAULT_PREFILL_SOURCE if prefill_tps is None else "--prefill-tps"
    per_token = geometry.kv_bytes_per_token(1)
    break_even = per_token * tps / 1e9
    facts.update(
        {
            "break_even_gbps": round(break_even, 3),
            "kv_bytes_per_token": per_token,
            "prefill_tps": tps,
            "model": geometry.name,
        }
    )
    rule = (
        f"break-even of {break_even:.2f} GB/s for {geometry.name or 'the model'} ({per_token:,} B of KV per token "
        f"x {tps:,.0f} prefill tokens/s, {source})"
    )
    if speed.gbps < break_even:
        return Check(
            "disk_read",
            WARN,
            f"{measured}, below the {rule}: a block loaded from this disk arrives later than its recompute",
            "put disk_path on faster local NVMe (or several drives striped), or leave disk_path unset",
            facts,
        )
    return Check("disk_read", OK, f"{measured}, above the {rule}", facts=facts)
