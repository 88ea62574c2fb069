"""The doctor's checks of the disk tier's directory: file system, O_DIRECT, free space.

Runs in the operator's process (``tiered-kv doctor``, ``tiered-kv config``). Reads
file-system statistics and /proc/self/mountinfo; writes one thing: where the directory
exists, a 4 KiB probe file in it (removed at once) to learn whether O_DIRECT works there.
A check without a disk tier to look at says "skipped" (``report.skipped``), never "ok".
"""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path
from typing import Any

from tiered_kv.config import TieredConfig, format_size
from tiered_kv.disk.format.safe_open import others_can_write
from tiered_kv.ops.doctor.report import FAIL, OK, WARN, Check, skipped


#: File systems whose "disk" is memory or another machine: a disk tier there is not local NVMe.
MEMORY_FS = ("tmpfs", "ramfs")
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "9p", "ceph", "glusterfs", "lustre", "beegfs", "gpfs")
_PROBE_BYTES = 4096
#: Where the kernel lists this process's mounts (``filesystem_of`` takes another for tests).
MOUNTINFO = "/proc/self/mountinfo"


def existing_ancestor(path: str | os.PathLike) -> Path:
    """``path`` itself if it exists, else its nearest existing parent."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def filesystem_of(path: str | os.PathLike, mountinfo: str | os.PathLike = MOUNTINFO) -> dict[str, str]:
    """``{"type", "mount_point", "source"}`` of the mount holding ``path`` or, where it
    does not exist, its nearest existing parent (from ``mountinfo``, the kernel's
    /proc/self/mountinfo format; empty strings where it cannot be read)."""
    target = os.path.realpath(existing_ancestor(path))
    best = {"type": "", "mount_point": "", "source": ""}
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        mount = fields[4].encode().decode("unicode_escape")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best["mount_point"]):
            best = {"type": tail[0], "mount_point": mount, "source": tail[1]}
    return best


def probe_o_direct(directory: str | os.PathLike) -> str | None:
    """None if a 4 KiB O_DIRECT write and read work in ``directory``, else why not. Uses
    a probe file it removes."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = Path(directory) / f".tiered-kv-doctor-{os.getpid()}"
    buf = mmap.mmap(-1, _PROBE_BYTES)  # page-aligned, as O_DIRECT needs
    buf.write(b"\xa5" * _PROBE_BYTES)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        return f"O_DIRECT open failed: {e.strerror}"
    try:
        if os.pwrite(fd, buf, 0) != _PROBE_BYTES or os.preadv(fd, [buf], 0) != _PROBE_BYTES:
            return "a short O_DIRECT transfer"
    except OSError as e:
        return f"O_DIRECT transfer failed: {e.strerror}"
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
        buf.close()
    return None


def check_disk_path(cfg: TieredConfig | None, mountinfo: str | os.PathLike = MOUNTINFO) -> Check:
    """The disk tier's directory: a directory the server can create (only its last
    component: the engine makes no parent) and write, on a local disk that is not the
    root file system (where an unmounted NVMe's mount point leaves it), taking O_DIRECT."""
    if cfg is None:
        return skipped("disk_path", "no config, so no disk tier to check", "pass --config PATH")
    if (disk := cfg.disk_tier) is None:
        return skipped("disk_path", "no disk tier configured")
    path = Path(disk.settings.path).expanduser()
    fs = filesystem_of(path, mountinfo)
    facts: dict[str, Any] = {"disk_path": str(path), "exists": path.exists(), "filesystem": fs}
    if path.exists() and not path.is_dir():
        return Check(
            "disk_path",
            FAIL,
            f"disk_path {path} exists and is not a directory",
            "point disk_path at a directory (its last component is created if missing)",
            facts,
        )
    where = existing_ancestor(path)
    parent = path.absolute().parent
    if not parent.exists():
        missing = next(p for p in reversed((parent, *parent.parents)) if not p.exists())
        facts["missing"] = str(missing)
        return Check(
            "disk_path",
            FAIL,
            f"disk_path {path}: {missing} does not exist, so the server refuses to start (it creates "
            f"only the last component of disk_path); is the disk meant for it mounted?",
            f"mount the NVMe at {missing} (see lsblk and /etc/fstab), or mkdir -p {parent} "
            f"if {where} is the file system meant",
            facts,
        )
    if not os.access(where, os.W_OK | os.X_OK):
        what = "is not writable" if where == path.absolute() else f"cannot be created ({where} is not writable)"
        return Check(
            "disk_path",
            FAIL,
            f"disk_path {path} {what} by uid {os.getuid()}",
            f"create it and give it to the server's user: mkdir {path} && chown <user> {path}",
            facts,
        )
    if path.is_dir() and (problem := others_can_write(path, os.stat(path))):
        return Check(
            "disk_path",
            FAIL,
            f"{problem}, so the server refuses to start on it",
            f"give it to the server's user and let only that user write it: chown <user> {path} && chmod go-w {path}",
            facts,
        )
    reason = probe_o_direct(path) if path.is_dir() else None
    facts["o_direct"] = None if not path.is_dir() else reason is None
    kind = fs["type"] or "unknown"
    on = f"{kind} on {fs['source'] or '?'} (mounted at {fs['mount_point'] or '?'})"
    facts["root_filesystem"] = fs["mount_point"] == "/"
    if kind in MEMORY_FS:
        return Check(
            "disk_path",
            WARN,
            f"disk_path {path} is on {on}: memory, not disk; the 'disk' tier would take RAM and vanish at reboot",
            "put disk_path on a local NVMe file system (ext4 or xfs)",
            facts,
        )
    if kind in NETWORK_FS or kind.startswith("fuse"):
        return Check(
            "disk_path",
            WARN,
            f"disk_path {path} is on {on}, not a local disk: latency and locking differ from local NVMe",
            "put disk_path on a local NVMe file system (ext4 or xfs)",
            facts,
        )
    if fs["mount_point"] == "/":
        return Check(
            "disk_path",
            WARN,
            f"disk_path {path} is on the root file system, {on}: where an NVMe is meant to be mounted "
            f"below it, it is not, and the disk tier would fill the system disk",
            "mount the NVMe (e.g. at /mnt/nvme, see lsblk) and put disk_path below its mount point; "
            "on a host whose root file system is the NVMe, this warning stands",
            facts,
        )
    if reason is not None:
        return Check(
            "disk_path",
            WARN,
            f"disk_path {path} ({on}) refuses O_DIRECT ({reason}): the disk tier "
            f"uses buffered I/O + fdatasync, slower and filling the page cache",
            "use a file system that takes O_DIRECT (ext4, xfs)",
            facts,
        )
    if not path.exists():
        return Check(
            "disk_path", OK, f"disk_path {path} will be created on {on} (O_DIRECT not probed yet)", facts=facts
        )
    return Check("disk_path", OK, f"disk_path {path}: {on}, O_DIRECT works", facts=facts)


def _bytes_under(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def free_space(path: str | os.PathLike) -> int:
    """Free bytes on the file system that holds (or would hold) ``path``."""
    return shutil.disk_usage(existing_ancestor(path)).free


def check_free_space(cfg: TieredConfig | None, tp: int, *, per_node: bool = False) -> Check:
    """Whether the disk tier fits the free space of its file system: ``disk_bytes`` per
    rank (``tp`` shards), or once for the node where ``per_node`` (vLLM's
    ``TieringOffloadingSpec`` with ``TieredDiskTier``: one writer for every rank)."""
    if cfg is None or (disk := cfg.disk_tier) is None:
        return skipped("disk_space", "no disk tier configured: no space needed")
    path = Path(disk.settings.path).expanduser()
    size = disk.settings.bytes
    writers = 1 if per_node else tp
    need = writers * size
    free = free_space(path)
    held = _bytes_under(path) if path.is_dir() else 0
    facts = {"needed_bytes": need, "free_bytes": free, "held_bytes": held, "tp": tp, "per_node": per_node}
    if per_node:
        what = f"disk_bytes {format_size(size)} per node (one TieredDiskTier for TP {tp})"
    else:
        what = f"TP {tp} x disk_bytes {format_size(size)} = {format_size(need)}"
    fix = (
        f"lower disk_bytes to at most {format_size(max(0, (free + held) // writers))} "
        f"per {'node' if per_node else 'rank'}, or free space"
    )
    if need <= free:
        return Check("disk_space", OK, f"{what}; {format_size(free)} free", facts=facts)
    if need <= free + held:
        return Check(
            "disk_space",
            WARN,
            f"{what}, {format_size(free)} free plus {format_size(held)} already in "
            f"{path}: enough only if those files are this model's namespace",
            f"{fix} (`tiered-kv inspect summary {path}` shows what is there)",
            facts,
        )
    return Check(
        "disk_space",
        FAIL,
        f"{what} but only {format_size(free)} free"
        + (f" (+ {format_size(held)} in {path})" if held else "")
        + ": the disk tier refuses to start",
        fix,
        facts,
    )


def check_shared_free_space(cfg: TieredConfig | None, tp: int, *, per_node: bool = False) -> Check | None:
    """Where two or more disk tiers share a file system, whether all of them fit its
    free space together (each tier's own check sees only itself); None where no file
    system holds more than one."""
    by_device: dict[int, list] = {}
    for entry in cfg.tiers_of_type("disk") if cfg is not None else ():
        path = Path(entry.settings.path).expanduser()
        by_device.setdefault(os.stat(existing_ancestor(path)).st_dev, []).append((path, entry.settings.bytes))
    shared = [tiers for tiers in by_device.values() if len(tiers) > 1]
    if not shared:
        return None
    writers = 1 if per_node else tp
    lines, worst = [], OK
    for tiers in shared:
        need = writers * sum(size for _, size in tiers)
        free = free_space(tiers[0][0])
        held = sum(_bytes_under(path) for path, _ in tiers if path.is_dir())
        status = OK if need <= free else WARN if need <= free + held else FAIL
        worst = FAIL if FAIL in (worst, status) else WARN if WARN in (worst, status) else OK
        names = ", ".join(str(path) for path, _ in tiers)
        lines.append(f"{names} share one file system: {format_size(need)} together, {format_size(free)} free")
    fix = "" if worst == OK else "give the disk tiers file systems of their own, lower their disk_bytes, or free space"
    return Check("disk_space_total", worst, "; ".join(lines), fix)
