"""The doctor's checks of CUDA, GPUDirect Storage (KvikIO) and vLLM.

Runs in the operator's process (``tiered-kv doctor``). Reads installed packages'
metadata, the NVIDIA driver's version and whether nvidia-fs is loaded; imports torch only in ``check_cuda``, and
the disk package only to run KvikIO's probe (which writes and removes its own probe
file in the disk tier's directory).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from tiered_kv.config import TieredConfig
from tiered_kv.ops.doctor.report import FAIL, OK, WARN, Check, skipped


#: The vLLM release the plug-in is built and tested against.
SUPPORTED_VLLM = "0.33"


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
    if cfg is None or (disk := cfg.disk_tier) is None:
        return skipped("io_path", f"no disk tier configured; {installed}", facts=facts)
    io_backend = facts["io_backend"] = disk.settings.io_backend
    path = Path(disk.settings.path).expanduser()
    if io_backend == "posix":
        return Check("io_path", OK, f"disk tier I/O: posix (configured); {installed}", facts=facts)
    reason = None if facts["kvikio_importable"] else "KvikIO is not installed"
    if reason is None and not path.is_dir():
        reason = f"{path} does not exist yet, so KvikIO was not probed"
    if reason is None:
        from tiered_kv.disk.store.io_backends import KvikIOBackend

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
    if io_backend == "kvikio":
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
