"""The doctor's memory checks: the CPU tier against the memory and locked-memory limits,
and transparent huge pages.

Runs in the operator's process (``tiered-kv doctor``, ``tiered-kv config``). Reads
resource limits, the machine's and the cgroup's memory size and /sys's huge-page
settings; writes nothing.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from tiered_kv.config import TieredConfig, format_size
from tiered_kv.ops.doctor.report import FAIL, OK, WARN, Check, skipped


THP_FILES = {
    "private": "/sys/kernel/mm/transparent_hugepage/enabled",
    "shared": "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
}


def memlock_limit() -> int | None:
    """This process's soft locked-memory limit in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def memory_limit() -> int:
    """Bytes of memory a process may use here: physical RAM, or the cgroup's limit (a
    container's) when lower. The CPU tier refuses to start above it."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def check_memlock(cfg: TieredConfig | None, limit: int | None) -> Check:
    facts = {"memlock_bytes": limit, "cpu_bytes": cfg.cpu_bytes if cfg else None}
    shown = "unlimited" if limit is None else format_size(limit)
    fix = (
        "raise the locked-memory limit of the server: `ulimit -l unlimited` in its shell, "
        "LimitMEMLOCK=infinity in its systemd unit, or `docker run --ulimit memlock=-1`"
    )
    if limit is None:
        return Check("memlock", OK, "locked-memory limit: unlimited", facts=facts)
    if cfg is None:
        return skipped(
            "memlock",
            f"locked-memory limit {shown}, no config to compare it with cpu_bytes",
            "pass --config PATH",
            facts,
        )
    if limit < cfg.cpu_bytes:
        return Check(
            "memlock",
            WARN,
            f"locked-memory limit {shown} is below cpu_bytes "
            f"{format_size(cfg.cpu_bytes)}: pinning the CPU tier may fail, and it then "
            f"falls back to pageable memory (slower, synchronous GPU copies)",
            fix,
            facts,
        )
    return Check(
        "memlock", OK, f"locked-memory limit {shown} covers cpu_bytes {format_size(cfg.cpu_bytes)}", facts=facts
    )


def check_memory(cfg: TieredConfig | None, tp: int, limit: int) -> Check:
    facts = {"memory_limit_bytes": limit, "tp": tp, "cpu_bytes": cfg.cpu_bytes if cfg else None}
    if cfg is None:
        return Check("memory", OK, f"memory a process may use: {format_size(limit)}", facts=facts)
    per_node = tp * cfg.cpu_bytes
    if cfg.cpu_bytes > limit:
        return Check(
            "memory",
            FAIL,
            f"cpu_bytes {format_size(cfg.cpu_bytes)} is more than the "
            f"{format_size(limit)} of memory a process may use here: the CPU tier "
            f"refuses to start",
            f"lower cpu_bytes below {format_size(limit)}",
            facts,
        )
    if per_node > 0.9 * limit:
        return Check(
            "memory",
            WARN,
            f"TP {tp} x cpu_bytes {format_size(cfg.cpu_bytes)} = {format_size(per_node)} "
            f"is over 90% of this host's {format_size(limit)}: the model's own host "
            f"memory and the page cache are squeezed",
            f"lower cpu_bytes to about {format_size(int(0.7 * limit / tp))} per rank",
            facts,
        )
    return Check(
        "memory",
        OK,
        f"CPU tier: TP {tp} x {format_size(cfg.cpu_bytes)} = {format_size(per_node)} of {format_size(limit)}",
        facts=facts,
    )


def thp_setting(which: str) -> str:
    """The bracketed word of the kernel's transparent huge page file ``which`` ("private"
    or "shared"), or "n/a" where there is none."""
    try:
        text = Path(THP_FILES[which]).read_text()
    except OSError:
        return "n/a"
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def check_thp(private: str, shared: str, disk_io: str | None) -> list[Check]:
    """Huge pages for private memory (the CPU tier, staging buffers: ``MADV_HUGEPAGE``)
    and for shared memory (the CPU tier with ``disk_io: process``)."""
    out = []
    if private in ("always", "madvise"):
        out.append(Check("thp", OK, f"transparent huge pages: {private}", facts={"setting": private}))
    else:
        out.append(
            Check(
                "thp",
                WARN,
                f"transparent huge pages: {private}: host buffers get 4 KiB pages, so a "
                f"disk transfer pins 512 pages per 2 MiB and reaches the device in "
                f"smaller requests",
                f"echo madvise > {THP_FILES['private']}",
                {"setting": private},
            )
        )
    facts = {"setting": shared, "disk_io": disk_io}
    if shared in ("always", "within_size", "advise", "force"):
        out.append(Check("shmem_thp", OK, f"shared-memory huge pages: {shared}", facts=facts))
    elif disk_io == "thread":
        out.append(
            Check("shmem_thp", OK, f"shared-memory huge pages: {shared} (unused: disk_io is thread)", facts=facts)
        )
    else:
        used = "disk_io is process" if disk_io == "process" else "used with disk_io: process"
        out.append(
            Check(
                "shmem_thp",
                WARN,
                f"shared-memory huge pages: {shared} ({used}): the shared CPU tier "
                f"gets 4 KiB pages, and disk transfers ran at 0.65-0.75 of the "
                f"device instead of about 0.9-1.1",
                f"echo advise > {THP_FILES['shared']} (as root; add it to the host's boot configuration to keep it)",
                facts,
            )
        )
    return out
