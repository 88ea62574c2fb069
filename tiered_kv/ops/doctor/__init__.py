"""Host checks before a tiered-kv server starts: the library of ``tiered-kv doctor``.

Runs in the operator's process, on the machine that will serve (each module of this
package says what its checks read). Reads the server's config file, resource limits,
/proc and /sys, file-system statistics and installed packages' metadata, and where a
shared tier is configured its fleet key, a few bounded requests to its bucket (one
block object at most) or its Mooncake master (``remote.py``). Writes only
probe files, each removed at once: where the disk tier's directory exists, 4 KiB to
learn whether O_DIRECT works there; one of ``read_probe`` bytes to time an O_DIRECT
read there or, before the directory exists, in its nearest existing parent
(``speed.py``); and KvikIO's own probe file where KvikIO is installed. With ``--e2e``
(``e2e.py``), a tiny model's blocks too: in a scratch directory inside each disk tier's
directory (removed), and in a shared tier under that model's own namespace. Imports torch only in ``check_cuda`` and the disk package only to run
KvikIO's probe; changes no setting.

Each check gives one ``Check``: ``ok``; ``skip`` (the check could not run: no config,
one that could not be read, nothing of that kind configured, a probe refused; the line
says why and counts as no verdict); ``warn`` (the server runs, but slower, with less
cache than asked for, with a setting that defeats the disk tier across restarts, or
checked at a tensor-parallel size nothing named); or
``fail`` (the server would refuse to start: a config it rejects, a disk tier it cannot
create or fit, a CPU tier larger than the memory it may use, ``io_backend: kvikio``
where KvikIO cannot run, a shared tier's key it cannot load; or a server that would
start and miss every shared block: a fleet key that does not open the bucket's
objects). Every non-ok line carries the fix. The exit code of the
command is that of the worst line: 0, 1 or 2.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from tiered_kv.config import ConfigError, TieredConfig, format_size
from tiered_kv.config_file import TIERING_SPEC, ServerConfigFile, UnsupportedConfig, read_server_config
from tiered_kv.ops.doctor.connector import check_canary, check_connector
from tiered_kv.ops.doctor.report import EXIT_CODES, FAIL, OK, SKIP, WARN, Check, DoctorReport, skipped
from tiered_kv.ops.doctor.disk import (
    MOUNTINFO,
    check_disk_path,
    check_free_space,
    check_shared_free_space,
    filesystem_of,
    free_space,
)
from tiered_kv.ops.doctor.gpu import SUPPORTED_VLLM, check_cuda, check_io_path, check_vllm, gds_facts
from tiered_kv.ops.doctor.hashes import check_hash
from tiered_kv.ops.doctor.memory import check_memlock, check_memory, check_thp, memlock_limit, memory_limit, thp_setting
from tiered_kv.ops.doctor.remote import check_remote, s3_answer
from tiered_kv.ops.doctor.speed import (
    DEFAULT_PROBE_BYTES,
    check_disk_speed,
    model_geometry,
    model_parameters_of,
    time_o_direct_read,
)
from tiered_kv.ops.server_namespace import server_disk
from tiered_kv.tier_ops import ToolContext

#: The package's API: ``run_doctor`` and each check, with what they measure.
__all__ = [
    "EXIT_CODES",
    "FAIL",
    "OK",
    "SKIP",
    "SUPPORTED_VLLM",
    "WARN",
    "Check",
    "DoctorReport",
    "check_canary",
    "check_connector",
    "check_cuda",
    "check_disk_path",
    "check_disk_speed",
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
    "model_geometry",
    "read_config",
    "run_doctor",
    "s3_answer",
    "thp_setting",
    "time_o_direct_read",
    "tier_size_warnings",
]


#: The advice for a config the tools cannot judge, which the server may nonetheless run.
_UNSUPPORTED_FIX = (
    "the tools do not support this shape (the message says which); give the config of a server "
    "whose disk tier the tools know"
)


def read_config(path: str | os.PathLike, tp: int | None = None) -> TieredConfig:
    """The server's config from a file in any shape ``tiered_kv.config_file`` reads,
    with ``cpu_bytes`` per rank at TP ``tp`` (default: the file's, else 1). Raises
    ``ConfigError`` naming the file."""
    return _validated(read_server_config(path), tp)


def _validated(found: ServerConfigFile, tp: int | None) -> TieredConfig:
    return found.config(tp)


def run_doctor(
    config_path: str | os.PathLike | None = None,
    *,
    tp: int | None = None,
    env: Mapping[str, str] | None = None,
    model: str | None = None,
    prefill_tps: float | None = None,
    read_probe: int = DEFAULT_PROBE_BYTES,
    mountinfo: str | os.PathLike = MOUNTINFO,
    gpu: str | None = None,
) -> DoctorReport:
    """Every check, for the server ``config_path`` describes (None: host checks only) at
    tensor-parallel size ``tp`` (None: the config file's, else 1, a warning). ``model``
    (a model directory or preset), ``prefill_tps`` and ``gpu`` (the GPU's name for the
    prefill estimate; default: this machine's) set the disk tier's break-even;
    ``read_probe`` bytes are read to time the disk (0: not timed). ``env`` defaults to
    this process's environment. Where the config cannot be read, the checks that need it
    are skipped, saying so."""
    env = os.environ if env is None else env
    checks: list[Check] = []
    cfg = None
    config_extra = None
    size = tp or 1
    per_node = False  # disk_bytes per rank (TieredOffloadingSpec) or per node (TieredDiskTier)
    if config_path is not None:
        fix = "fix the config as the message says"
        try:
            found = read_server_config(config_path)
            fix = _UNSUPPORTED_FIX
            disk_tier = server_disk(found)
            fix = "fix the config as the message says"
            per_node = disk_tier.is_secondary_tier
            size = tp or found.tp or 1
            cfg = _validated(found, size)
            config_extra = found.extra_for(size)
            tp_assumed = tp is None and found.tp is None
            if tp is not None:
                tp_said = f"TP {size} (--tp)"
            elif found.tp is not None:
                tp_said = f"TP {size} (from the config)"
            else:
                tp_said = (
                    "TP 1 assumed: neither --tp nor the config names the tensor-parallel size, so the sizes per "
                    "rank, the node's memory and disk and the break-even are checked for one GPU"
                )
            disks = [
                f"disk tier {e.settings.path} ({format_size(e.settings.bytes)} per {disk_tier.disk_bytes_per})"
                for e in cfg.tiers_of_type("disk")
            ]
            disk = ", ".join(disks) or "no disk tier"
            cpu = f"cpu_bytes {format_size(cfg.cpu_bytes)} per rank"
            if found.cpu_bytes_total is not None:
                cpu += f" (cpu_bytes_to_use {format_size(found.cpu_bytes_total)} / TP {size})"
            spec = f"{disk_tier.describe}, " if per_node else ""
            checks.append(
                Check(
                    "config",
                    WARN if tp_assumed else OK,
                    f"config {config_path}: {spec}{cpu}, {disk}; {tp_said}",
                    "pass --tp N, the server's --tensor-parallel-size" if tp_assumed else "",
                    facts={
                        "config": cfg.to_dict(),
                        "tp": size,
                        "tp_source": tp_said,
                        "tp_assumed": tp_assumed,
                        "spec_name": found.spec_name,
                    },
                )
            )
            if found.spec_name != TIERING_SPEC:  # vLLM's tiering runs under vLLM's own connector
                checks.append(check_connector(found.transfer, cfg))
                checks.append(check_canary(cfg))
        except UnsupportedConfig as e:  # the server may run it: the limit is the tools'
            checks.append(Check("config", FAIL, str(e), _UNSUPPORTED_FIX))
        except ConfigError as e:
            checks.append(Check("config", FAIL, str(e), fix))
    checks.append(check_memory(cfg, size, memory_limit()))
    checks.append(check_memlock(cfg, memlock_limit()))
    disk_io = {e.settings.disk_io for e in cfg.tiers_of_type("disk")} if cfg else set()
    shmem_use = "process" if "process" in disk_io else ("thread" if cfg else None)
    checks += check_thp(thp_setting("private"), thp_setting("shared"), shmem_use)
    # Each tier's own checks (``TierSpec.doctor_checks``); a kind the config lacks, one
    # line saying so.
    ctx = ToolContext(cfg or TieredConfig(), size, per_node, config_extra, read_probe, str(mountinfo))
    for entry in cfg.tier_entries() if cfg else ():
        checks += entry.cls.doctor_checks(entry, ctx)
    if cfg is None or not cfg.tiers_of_type("disk"):
        checks += [check_disk_path(cfg, mountinfo), check_free_space(cfg, size)]
    elif (together := check_shared_free_space(cfg, size, per_node=per_node)) is not None:
        checks.append(together)
    try:
        geometry = model_geometry(cfg, model)
    except ConfigError as e:
        checks.append(Check("disk_read", FAIL, f"--model: {e}", "pass a model directory, its config.json or a preset"))
    else:
        params = model_parameters_of(cfg, model)
        speed = check_disk_speed(
            cfg, geometry, prefill_tps=prefill_tps, probe_bytes=read_probe, tp=size, parameters=params, gpu=gpu
        )
        checks.append(speed)
    cuda = check_cuda()
    checks.append(cuda)
    checks.append(check_io_path(cfg, cuda.status == OK))
    checks.append(check_vllm())
    checks.append(check_hash(cfg, env))
    if cfg is None or not cfg.tiers_of_type("remote"):
        checks.append(check_remote(cfg, config_extra))
    if config_path is not None and cfg is None:
        checks = [_unread(c, config_path) for c in checks]
    return DoctorReport(checks, None if config_path is None else str(config_path))


#: The checks whose verdict is a comparison with the config.
_NEEDS_CONFIG = ("memlock", "disk_path", "disk_space", "disk_read", "io_path", "hash", "remote")


def _unread(check: Check, config_path: str | os.PathLike) -> Check:
    """``check`` as run without a config, where ``config_path`` was given but could not be
    read: a check that compares with the config is skipped, naming the config, rather than
    asking for one (host-only lines and a failed ``--model`` keep their verdicts)."""
    if check.name not in _NEEDS_CONFIG or check.status == FAIL:
        return check
    return skipped(check.name, f"config {config_path} could not be read (see the config line)", facts=check.facts)


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
