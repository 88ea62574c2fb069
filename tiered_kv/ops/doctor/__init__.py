"""Host checks before a tiered-kv server starts: the library of ``tiered-kv doctor``.

Runs in the operator's process, on the machine that will serve (each module of this
package says what its checks read). Reads resource limits,
/proc and /sys, file-system statistics and installed packages' metadata. Writes one
thing: where the disk tier's directory exists, a 4 KiB probe file in it (removed at
once) to learn whether O_DIRECT works there, and KvikIO's own probe file where KvikIO is
installed. Imports torch only in ``check_cuda`` and the disk package only to run
KvikIO's probe; changes no setting.

Each check gives one ``Check``: ``ok``; ``warn`` (the server runs, but slower, with less
cache than asked for, or with a setting that defeats the disk tier across restarts); or
``fail`` (the server would refuse to start: a config it rejects, a disk tier it cannot
create or fit, a CPU tier larger than the memory it may use, ``io_backend: kvikio``
where KvikIO cannot run). Every non-ok line carries the fix. The exit code of the
command is that of the worst line: 0, 1 or 2.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig, format_size
from tiered_kv.ops.doctor.report import EXIT_CODES, FAIL, OK, WARN, Check, DoctorReport
from tiered_kv.ops.doctor.disk import check_disk_path, check_free_space, filesystem_of, free_space
from tiered_kv.ops.doctor.gpu import SUPPORTED_VLLM, check_cuda, check_io_path, check_vllm, gds_facts
from tiered_kv.ops.doctor.hashes import check_hash
from tiered_kv.ops.doctor.memory import check_memlock, check_memory, check_thp, memlock_limit, memory_limit, thp_setting
from tiered_kv.ops.doctor.remote import check_remote

#: The package's API: ``run_doctor`` and each check, with what they measure.
__all__ = [
    "EXIT_CODES",
    "FAIL",
    "OK",
    "SUPPORTED_VLLM",
    "WARN",
    "Check",
    "DoctorReport",
    "check_cuda",
    "check_disk_path",
    "check_free_space",
    "check_hash",
    "check_io_path",
    "check_memlock",
    "check_memory",
    "check_remote",
    "check_thp",
    "check_vllm",
    "filesystem_of",
    "free_space",
    "gds_facts",
    "memlock_limit",
    "memory_limit",
    "read_config",
    "run_doctor",
    "thp_setting",
    "tier_size_warnings",
]


def read_config(path: str | os.PathLike) -> TieredConfig:
    """The server's config from a JSON file holding vLLM's whole ``--kv-transfer-config``
    or its ``kv_connector_extra_config`` alone. Raises ``ConfigError`` naming the file."""
    from tiered_kv.model_identity import read_config_file

    raw = read_config_file(path)
    try:
        return TieredConfig.from_dict(raw, passthrough_keys=VLLM_PASSTHROUGH_KEYS)
    except ConfigError as e:
        raise ConfigError(f"config {Path(path)}: {e}") from None


def run_doctor(
    config_path: str | os.PathLike | None = None, *, tp: int = 1, env: Mapping[str, str] | None = None
) -> DoctorReport:
    """Every check, for the server ``config_path`` describes (None: host checks only) at
    tensor-parallel size ``tp``. ``env`` defaults to this process's environment."""
    env = os.environ if env is None else env
    checks: list[Check] = []
    cfg = None
    if config_path is not None:
        try:
            cfg = read_config(config_path)
            disk = (
                f"disk tier {cfg.disk_path} ({format_size(cfg.disk_bytes)} per rank)"
                if cfg.disk_path
                else "no disk tier"
            )
            checks.append(
                Check(
                    "config",
                    OK,
                    f"config {config_path}: cpu_bytes {format_size(cfg.cpu_bytes)} per rank, {disk}",
                    facts={"config": cfg.to_dict()},
                )
            )
        except ConfigError as e:
            checks.append(Check("config", FAIL, str(e), "fix the config: the server refuses it"))
    checks.append(check_memory(cfg, tp, memory_limit()))
    checks.append(check_memlock(cfg, memlock_limit()))
    checks += check_thp(thp_setting("private"), thp_setting("shared"), cfg.disk_io if cfg else None)
    checks.append(check_disk_path(cfg))
    checks.append(check_free_space(cfg, tp))
    cuda = check_cuda()
    checks.append(cuda)
    checks.append(check_io_path(cfg, cuda.status == OK))
    checks.append(check_vllm())
    checks.append(check_hash(cfg, env))
    checks.append(check_remote(cfg))
    return DoctorReport(checks, None if config_path is None else str(config_path))


def tier_size_warnings(cpu_bytes: int, disk_bytes: int, disk_path: str | None, tp: int) -> Iterable[str]:
    """Warnings where a node's tiers (``tp`` ranks) exceed this host's memory or the free
    space on ``disk_path``'s file system (for ``tiered-kv config``, run on the server)."""
    limit = memory_limit()
    if tp * cpu_bytes > limit:
        yield (
            f"the CPU tier takes TP {tp} x {format_size(cpu_bytes)} = {format_size(tp * cpu_bytes)} of host "
            f"memory, more than this host's {format_size(limit)}"
        )
    if disk_path and disk_bytes:
        free = free_space(disk_path)
        if tp * disk_bytes > free:
            yield (
                f"the disk tier takes TP {tp} x {format_size(disk_bytes)} = {format_size(tp * disk_bytes)}, "
                f"more than the {format_size(free)} free on the file system of {disk_path}"
            )
