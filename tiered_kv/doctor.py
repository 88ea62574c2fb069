"""Host checks before a tiered-kv server starts: the library of ``tiered-kv doctor``.

Runs in the operator's process, on the machine that will serve. Reads resource limits,
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

import importlib.metadata
import importlib.util
import mmap
import os
import resource
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig, format_size

OK, WARN, FAIL = "ok", "warn", "fail"
EXIT_CODES = {OK: 0, WARN: 1, FAIL: 2}
#: The vLLM release the plug-in is built and tested against.
SUPPORTED_VLLM = "0.33"
THP_FILES = {
    "private": "/sys/kernel/mm/transparent_hugepage/enabled",
    "shared": "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
}
#: File systems whose "disk" is memory or another machine: a disk tier there is not local NVMe.
MEMORY_FS = ("tmpfs", "ramfs")
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "9p", "ceph", "glusterfs", "lustre", "beegfs", "gpfs")
_PROBE_BYTES = 4096


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, the verdict, what was found, and (unless
    ok) what to do about it. ``facts`` are the measured values, for ``--json``."""

    name: str
    status: str
    message: str
    fix: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "message": self.message,
            "fix": self.fix,
            "facts": dict(self.facts),
        }


@dataclass
class DoctorReport:
    checks: list[Check]
    config_path: str | None = None

    @property
    def status(self) -> str:
        return max((c.status for c in self.checks), key=EXIT_CODES.__getitem__, default=OK)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_dict(self) -> dict[str, Any]:
        counts = {s: sum(c.status == s for c in self.checks) for s in EXIT_CODES}
        return {
            "path": self.config_path,
            "status": self.status,
            "exit_code": self.exit_code,
            "counts": counts,
            "checks": [c.to_dict() for c in self.checks],
        }


# ---------------------------------------------------------------- the config


def read_config(path: str | os.PathLike) -> TieredConfig:
    """The server's config from a JSON file holding vLLM's whole ``--kv-transfer-config``
    or its ``kv_connector_extra_config`` alone. Raises ``ConfigError`` naming the file."""
    from tiered_kv.model_identity import read_config_file

    raw = read_config_file(path)
    try:
        return TieredConfig.from_dict(raw, passthrough_keys=VLLM_PASSTHROUGH_KEYS)
    except ConfigError as e:
        raise ConfigError(f"config {Path(path)}: {e}") from None


# ---------------------------------------------------------------- memory


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
        return Check(
            "memlock", OK, f"locked-memory limit: {shown} (pass --config to compare it with cpu_bytes)", facts=facts
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


# ---------------------------------------------------------------- the disk tier's directory


def existing_ancestor(path: str | os.PathLike) -> Path:
    """``path`` itself if it exists, else its nearest existing parent."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def filesystem_of(path: str | os.PathLike) -> dict[str, str]:
    """``{"type", "mount_point", "source"}`` of the mount holding ``path`` (from
    /proc/self/mountinfo; empty strings where it cannot be read)."""
    target = os.path.realpath(existing_ancestor(path))
    best = {"type": "", "mount_point": "", "source": ""}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
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


def check_disk_path(cfg: TieredConfig | None) -> Check:
    if cfg is None or cfg.disk_path is None:
        return Check("disk_path", OK, "no disk tier configured" + ("" if cfg else " (pass --config)"))
    path = Path(cfg.disk_path).expanduser()
    fs = filesystem_of(path)
    facts: dict[str, Any] = {"disk_path": str(path), "exists": path.exists(), "filesystem": fs}
    if path.exists() and not path.is_dir():
        return Check(
            "disk_path",
            FAIL,
            f"disk_path {path} exists and is not a directory",
            "point disk_path at a directory (it is created if missing)",
            facts,
        )
    where = existing_ancestor(path)
    if not os.access(where, os.W_OK | os.X_OK):
        what = "is not writable" if where == path.absolute() else f"cannot be created ({where} is not writable)"
        return Check(
            "disk_path",
            FAIL,
            f"disk_path {path} {what} by uid {os.getuid()}",
            f"create it and give it to the server's user: mkdir -p {path} && chown <user> {path}",
            facts,
        )
    reason = probe_o_direct(path) if path.is_dir() else None
    facts["o_direct"] = None if not path.is_dir() else reason is None
    kind = fs["type"] or "unknown"
    on = f"{kind} on {fs['source'] or '?'} (mounted at {fs['mount_point'] or '?'})"
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


def check_free_space(cfg: TieredConfig | None, tp: int) -> Check:
    if cfg is None or cfg.disk_path is None:
        return Check("disk_space", OK, "no disk tier: no space needed")
    path = Path(cfg.disk_path).expanduser()
    need = tp * cfg.disk_bytes
    free = free_space(path)
    held = _bytes_under(path) if path.is_dir() else 0
    facts = {"needed_bytes": need, "free_bytes": free, "held_bytes": held, "tp": tp}
    what = f"TP {tp} x disk_bytes {format_size(cfg.disk_bytes)} = {format_size(need)}"
    fix = f"lower disk_bytes to at most {format_size(max(0, (free + held) // tp))} per rank, or free space"
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


# ---------------------------------------------------------------- CUDA, GDS, vLLM


def nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version from /proc, or None without one."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return None


def check_cuda() -> Check:
    driver = nvidia_driver_version()
    facts: dict[str, Any] = {"driver": driver}
    try:
        import torch
    except Exception as e:  # a broken install can raise anything
        return Check(
            "cuda",
            FAIL,
            f"torch cannot be imported: {type(e).__name__}: {e}",
            "reinstall torch (vLLM's pinned version on a GPU server)",
            facts,
        )
    facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    if torch.version.cuda is None:
        return Check(
            "cuda",
            WARN,
            f"CUDA absent: torch {torch.__version__} is a CPU-only build"
            + (f" (NVIDIA driver {driver} is loaded)" if driver else "")
            + "; the hierarchy runs on CPU (pageable memory, synchronous copies)",
            "on a GPU server install a CUDA build of torch (the one vLLM pins)",
            facts,
        )
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:
        count, facts["error"] = 0, f"{type(e).__name__}: {e}"
    if count == 0:
        return Check(
            "cuda",
            WARN,
            f"CUDA absent: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
            + (f"; NVIDIA driver {driver}" if driver else "; no NVIDIA driver loaded"),
            "check `nvidia-smi`, the driver, and CUDA_VISIBLE_DEVICES",
            facts,
        )
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    facts.update(devices=names)
    return Check(
        "cuda",
        OK,
        f"{count} GPU(s): {', '.join(sorted(set(names)))}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}); driver {driver or '?'}",
        facts=facts,
    )


def gds_facts() -> dict[str, Any]:
    """What is installed for GPUDirect Storage: KvikIO, libcufile, the nvidia-fs module."""
    kvikio = next((d for d in ("kvikio-cu13", "kvikio-cu12", "kvikio") if _dist_version(d)), None)
    return {
        "kvikio": f"{kvikio} {_dist_version(kvikio)}" if kvikio else None,
        "kvikio_importable": _module_found("kvikio"),
        "cufile": _module_found("nvidia.cufile") or _library_found("cufile"),
        "nvidia_fs": Path("/sys/module/nvidia_fs").exists() or Path("/proc/driver/nvidia-fs").exists(),
    }


def _module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package
        return False


def _library_found(name: str) -> bool:
    import ctypes.util

    return ctypes.util.find_library(name) is not None


def _dist_version(name: str | None) -> str | None:
    if name is None:
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_io_path(cfg: TieredConfig | None, cuda: bool) -> Check:
    """Which I/O path the disk tier would take, as ``io_backend: auto`` chooses it."""
    facts = gds_facts()
    installed = (
        f"KvikIO {'installed' if facts['kvikio'] else 'not installed'}, "
        f"cuFile {'found' if facts['cufile'] else 'not found'}, "
        f"nvidia-fs {'loaded' if facts['nvidia_fs'] else 'not loaded'}"
    )
    if cfg is None or cfg.disk_path is None:
        return Check("io_path", OK, f"no disk tier; {installed}", facts=facts)
    facts["io_backend"] = cfg.io_backend
    path = Path(cfg.disk_path).expanduser()
    if cfg.io_backend == "posix":
        return Check("io_path", OK, f"disk tier I/O: posix (configured); {installed}", facts=facts)
    reason = None if facts["kvikio_importable"] else "KvikIO is not installed"
    if reason is None and not path.is_dir():
        reason = f"{path} does not exist yet, so KvikIO was not probed"
    if reason is None:
        from tiered_kv.disk.io_backends import KvikIOBackend

        reason = KvikIOBackend.probe(path)
        if reason is None:
            backend = KvikIOBackend(1)
            facts["gds"] = backend.gds
            backend.shutdown()
            if backend.gds:
                return Check("io_path", OK, f"disk tier I/O: KvikIO with GPUDirect Storage; {installed}", facts=facts)
            return Check(
                "io_path",
                WARN if cuda else OK,
                f"disk tier I/O: KvikIO in compat mode (POSIX underneath, no GPUDirect); {installed}",
                "load nvidia-fs (modprobe nvidia-fs) and check `gdscheck -p`" if cuda else "",
                facts,
            )
    facts["reason"] = reason
    if cfg.io_backend == "kvikio":
        return Check(
            "io_path",
            FAIL,
            f"io_backend is kvikio but KvikIO cannot run: {reason}",
            "install tiered-kv[cu12] or [cu13] on a machine with a CUDA driver, or set io_backend to auto or posix",
            facts,
        )
    text = f"disk tier I/O: posix, O_DIRECT where the file system takes it ({reason}); {installed}"
    if cuda and not facts["kvikio"]:
        return Check(
            "io_path",
            WARN,
            text,
            "for GPUDirect Storage: pip install 'tiered-kv[cu12]' (or [cu13]) and load nvidia-fs",
            facts,
        )
    return Check("io_path", OK, text, facts=facts)


def check_vllm() -> Check:
    version = _dist_version("vllm")
    facts = {"vllm": version, "supported": SUPPORTED_VLLM}
    if version is None:
        return Check(
            "vllm",
            WARN,
            "vLLM is not installed: the plug-in cannot load (demo, inspect and warmup --engine hf work without it)",
            f"pip install vllm=={SUPPORTED_VLLM}.0",
            facts,
        )
    if ".".join(version.split("+")[0].split(".")[:2]) != SUPPORTED_VLLM:
        return Check(
            "vllm",
            WARN,
            f"vLLM {version} is installed; the plug-in is built for {SUPPORTED_VLLM}.x, "
            f"whose kv_offload API it implements",
            f"pip install vllm=={SUPPORTED_VLLM}.0",
            facts,
        )
    return Check("vllm", OK, f"vLLM {version}", facts=facts)


# ---------------------------------------------------------------- prefix hashes

_RANDOM_SEEDED = ("xxhash", "xxhash_cbor")


def check_hash(cfg: TieredConfig | None, env: Mapping[str, str]) -> Check:
    """Whether the block hashes the server computes survive a restart and match the
    config's ``hash_seed`` (vLLM seeds its prefix hashes with PYTHONHASHSEED)."""
    env_seed = env.get("PYTHONHASHSEED")
    facts = {
        "PYTHONHASHSEED": env_seed,
        "hash_algorithm": cfg.hash_algorithm if cfg else None,
        "hash_seed": cfg.hash_seed if cfg else None,
    }
    if cfg is None:
        shown = "unset" if env_seed is None else repr(env_seed)
        return Check(
            "hash", OK, f"PYTHONHASHSEED is {shown} here (pass --config to compare with hash_seed)", facts=facts
        )
    algo, seed = cfg.hash_algorithm, cfg.hash_seed
    if seed and env_seed is not None and env_seed != seed:
        return Check(
            "hash",
            WARN,
            f"hash_seed {seed!r} differs from PYTHONHASHSEED={env_seed!r} in this "
            f"environment: blocks warmed up here would not match the server's",
            f"run the server (and warmup) with PYTHONHASHSEED={seed}",
            facts,
        )
    if seed and env_seed is None:
        return Check(
            "hash",
            WARN,
            f"hash_seed is {seed!r} but PYTHONHASHSEED is unset here; vLLM seeds its prefix hashes with PYTHONHASHSEED",
            f"run the server with PYTHONHASHSEED={seed}",
            facts,
        )
    if algo in _RANDOM_SEEDED and not seed and env_seed is None:
        return Check(
            "hash",
            WARN,
            f"hash_algorithm {algo} is seeded randomly per process while PYTHONHASHSEED "
            f"is unset: after a restart no block on disk ever hits",
            "run the server with PYTHONHASHSEED=<n> and set hash_seed to the same <n>, or use hash_algorithm sha256",
            facts,
        )
    how = (
        f"seed PYTHONHASHSEED={env_seed}" if env_seed is not None else f"seed {seed!r}" if seed else "vLLM's fixed seed"
    )
    return Check("hash", OK, f"prefix hashes: {algo} with {how}: stable across restarts", facts=facts)


# ---------------------------------------------------------------- all of it


def check_remote(cfg: TieredConfig | None) -> Check:
    """The shared tier's bucket, where the config has one: one GET request for a key that
    is not there (nothing is written), which tells refused credentials, a missing bucket
    and a server that does not answer apart."""
    if cfg is None or cfg.remote is None:
        return Check("remote", OK, "no shared tier configured")
    from tiered_kv.remote.client import AccessDenied, BucketMissing, RemoteError, RemoteSetupError, S3Client

    remote = cfg.remote
    where = f"bucket {remote.bucket!r} at {remote.endpoint or 'AWS S3'}"
    facts = {"endpoint": remote.endpoint, "bucket": remote.bucket, "prefix": remote.prefix}
    try:
        S3Client(remote).get(f"{remote.prefix}/doctor-probe")
    except RemoteSetupError as e:
        return Check("remote", FAIL, f"shared tier: {e}", "install the client: pip install 'tiered-kv[s3]'", facts)
    except AccessDenied as e:
        return Check(
            "remote",
            FAIL,
            f"shared tier: {where} refused the credentials or the request ({e})",
            "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and allow s3:GetObject, "
            "s3:PutObject, s3:DeleteObject and s3:ListBucket on the bucket",
            facts,
        )
    except BucketMissing:
        return Check(
            "remote",
            FAIL,
            f"shared tier: {where} does not exist",
            f"create it (aws s3 mb s3://{remote.bucket}) or fix remote.bucket",
            facts,
        )
    except RemoteError as e:
        return Check(
            "remote",
            WARN,
            f"shared tier: {where} did not answer ({e}); the server would serve with misses until it does",
            "check remote.endpoint and the network path to it",
            facts,
        )
    return Check("remote", OK, f"shared tier: {where} answers", facts=facts)


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
