"""Which model a disk cache's blocks belong to: a digest of a model directory that changes
when its weights or its config do, cheap enough for a 400 GB checkpoint.

Runs wherever a namespace fingerprint is built from a model directory: the scheduler and
every worker of an engine (tiered-kv's own spec reads ``model_path``; vLLM's spec the
directory vLLM loads), the warm-up (its ``--model``), ``tiered-kv config`` and
``tiered-kv inspect --config``. I/O, all reads: it lists the directory (recursively,
following the symlinks a Hugging Face cache snapshot is made of), reads each config file
whole, and of each weight file its size, its safetensors header (tensor names, dtypes,
shapes, offsets; at most ``HEADER_MAX`` bytes) and ``SAMPLES`` chunks of ``SAMPLE_BYTES``
at fixed offsets (first, last, evenly spaced between). So the bytes read are bounded per
file whatever the checkpoint's size: about 512 KiB plus the header. Every read goes
through ``read_at``. Nothing is memoised: a digest always describes the files as they
are now.

What the digest covers (``docs/identity.md``):

- the model config in full: ``config.json`` (architecture, geometry, RoPE, quantization
  config), ``generation_config.json``, ``params.json`` and the quantization configs
  ``quantize_config.json``, ``quant_config.json``, ``quantization_config.json``,
  ``hf_quant_config.json``, and every ``*.index.json`` weight map;
- every weight file (``WEIGHT_SUFFIXES``) by relative path and size, its safetensors
  header, and its sampled content (xxh3-128 over all of it);
- the commit of a Hugging Face cache snapshot (``.../snapshots/<commit>/``).

What it does not cover: a change to a weight file that keeps its size and header and
leaves every sampled byte alone (an edit of a few tensors in the middle of a shard), and
files that are neither config nor weights (tokenizer, chat template, README). Change
``model_revision`` when you patch weights in place that way. A tokenizer never changes
the KV of given token ids; the prefix hashes are over token ids.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import xxhash

from tiered_kv.config import ConfigError
from tiered_kv.config_file import read_server_config

#: Config files hashed whole (top level of the model directory), plus ``*.index.json``.
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "params.json",
    "quantize_config.json",
    "quant_config.json",
    "quantization_config.json",
    "hf_quant_config.json",
)
#: Files that hold weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz")
#: Chunks sampled per weight file, and their size.
SAMPLES = 8
SAMPLE_BYTES = 64 << 10
#: The most of a safetensors header that is read (headers are usually well under 1 MiB).
HEADER_MAX = 8 << 20
#: A config file larger than this is sampled like a weight file rather than read whole.
CONFIG_MAX = 16 << 20
#: Hex digits of a digest (xxh3-128).
DIGEST_LEN = 32

_VERSION = b"tiered-kv model digest 1\0"
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def read_at(fd: int, length: int, offset: int) -> bytes:
    """The only reader of model files: ``length`` bytes at ``offset`` (fewer at the end)."""
    out = bytearray()
    while len(out) < length:
        chunk = os.pread(fd, length - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


@dataclass(frozen=True)
class WeightsDigest:
    """A model directory's digest and what went into it. ``bytes_read`` counts the
    bytes read to compute it."""

    path: str
    digest: str
    config_files: tuple[str, ...]
    weight_files: int
    weight_bytes: int
    snapshot: str | None
    bytes_read: int

    def describe(self) -> str:
        """One line: digest, what it covers, the snapshot commit."""
        snap = f", HF snapshot {self.snapshot[:12]}" if self.snapshot else ""
        return (
            f"{self.digest} ({self.weight_files} weight file(s), {_gib(self.weight_bytes)}; "
            f"{', '.join(self.config_files) or 'no config file'}{snap})"
        )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def hf_snapshot_commit(path: str | os.PathLike) -> str | None:
    """The commit of a Hugging Face cache snapshot directory
    (``.../models--org--name/snapshots/<commit>``), else None."""
    p = Path(path)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.name
    return None


def _listing(
    root: Path, key: str
) -> tuple[list[tuple[str, Path, os.stat_result]], list[tuple[str, Path, os.stat_result]]]:
    """(config files, weight files), each sorted ``(relative path, path, stat)``."""
    configs: list[tuple[str, Path, os.stat_result]] = []
    weights: list[tuple[str, Path, os.stat_result]] = []
    seen_dirs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen_dirs:  # a symlink loop
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        top = Path(dirpath) == root
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            is_config = (top and name in CONFIG_FILES) or name.endswith(".index.json")
            if not is_config and not name.endswith(WEIGHT_SUFFIXES):
                continue
            try:
                st = path.stat()
            except OSError as e:
                raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None
            (configs if is_config else weights).append((rel, path, st))
    return sorted(configs), sorted(weights)


def weights_digest(path: str | os.PathLike, key: str = "model_path") -> WeightsDigest:
    """The digest of model directory ``path`` (module docstring). Raises ``ConfigError``
    naming ``key`` when it is not a readable directory holding a config or weights."""
    root = Path(path).expanduser()
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise ConfigError(f"{key}: {str(path)!r} {what}; expected the model's directory (config.json and weight files)")
    root = root.absolute()
    configs, weights = _listing(root, key)
    if not configs and not weights:
        raise ConfigError(
            f"{key}: {str(root)!r} holds no config.json and no weight files "
            f"({', '.join(WEIGHT_SUFFIXES)}); expected the model's directory"
        )
    h = xxhash.xxh3_128(_VERSION)
    nread = 0
    for rel, p, st in configs:
        _field(h, b"config", rel.encode(), struct.pack("<Q", st.st_size))
        nread += _hash_file(h, p, st.st_size, key, whole=st.st_size <= CONFIG_MAX)
    for rel, p, st in weights:
        _field(h, b"weights", rel.encode(), struct.pack("<Q", st.st_size))
        nread += _hash_file(h, p, st.st_size, key, whole=False, header=rel.endswith(".safetensors"))
    snapshot = hf_snapshot_commit(root)
    if snapshot:
        _field(h, b"snapshot", snapshot.encode())
    return WeightsDigest(
        str(root),
        h.hexdigest(),
        tuple(rel for rel, _, _ in configs),
        len(weights),
        sum(st.st_size for _, _, st in weights),
        snapshot,
        nread,
    )


def _field(h: Any, *parts: bytes) -> None:
    for part in parts:
        h.update(struct.pack("<Q", len(part)))
        h.update(part)


def _hash_file(h: Any, path: Path, size: int, key: str, *, whole: bool, header: bool = False) -> int:
    """Hash ``path`` whole or by its header and samples; returns the bytes read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None
    nread = 0
    try:
        if whole or size <= SAMPLES * SAMPLE_BYTES:
            data = read_at(fd, size, 0)
            _field(h, data)
            return len(data)
        if header:
            head = read_at(fd, 8, 0)
            nread += len(head)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            data = read_at(fd, min(n, HEADER_MAX, max(0, size - 8)), 8)
            nread += len(data)
            _field(h, b"header", data)
        step = (size - SAMPLE_BYTES) / (SAMPLES - 1)
        for i in range(SAMPLES):
            data = read_at(fd, SAMPLE_BYTES, int(i * step))
            nread += len(data)
            _field(h, data)
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    return nread


def max_bytes_read(weight_files: int, config_bytes: int = 0) -> int:
    """The most ``weights_digest`` reads for ``weight_files`` weight files whatever
    their sizes, plus ``config_bytes`` of config files read whole."""
    return weight_files * (8 + HEADER_MAX + SAMPLES * SAMPLE_BYTES) + config_bytes


# ---------------------------------------------------------------- where a model lives


def hf_hub_cache(download_dir: str | None = None) -> Path:
    """The Hugging Face hub cache directory: ``download_dir`` (vLLM's ``--download-dir``),
    else ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model_dir(model: str, revision: str | None = None, download_dir: str | None = None) -> Path | None:
    """The local directory of ``model``: itself when it is a directory, else the
    Hugging Face cache snapshot of repo ``model`` at ``revision`` (a branch, tag or
    commit; default ``main``), else None. Reads only directory entries and a ref file."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p.absolute()
    if model.count("/") > 1 or not model.strip("/"):
        return None
    repo = hf_hub_cache(download_dir) / ("models--" + model.strip("/").replace("/", "--"))
    rev = revision or "main"
    commit = rev if _SHA_RE.match(rev) else None
    if commit is None:
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except OSError:
            return None
    snap = repo / "snapshots" / commit
    return snap if snap.is_dir() else None


# ---------------------------------------------------------------- a server's config file


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The connector's extra config, in our keys, from a server's config file in any
    shape the repository ships (``tiered_kv.config_file``: vLLM's whole
    ``--kv-transfer-config`` or its extra config, for our spec or for vLLM's
    ``TieringOffloadingSpec`` with our disk tier). Raises ``ConfigError`` naming the file."""
    return read_server_config(path).extra_for()


def pinned_fields(extra: Mapping[str, Any], *, model: str | None = None) -> dict[str, Any]:
    """The fingerprint fields a server with extra config ``extra`` is bound to, whatever
    its engine's geometry: ``model_id``, ``hash_seed`` and ``block_size`` where the
    config sets them, ``hash_algorithm``, and the weights digest of ``model_path``. Not
    ``model_revision``: vLLM's ``--revision`` overrides the config's, so a tool that
    judges which namespaces a server reads cannot know it. ``model`` is the server's model (vLLM's ``--model``: a
    directory or a hub id in the local HF cache) for a config that sets no
    ``model_id`` or ``model_path``: vLLM fills those in from it. A key set to null is
    unset, as vLLM and the runtime take it. For a hub id the weights digest is not
    pinned: the server digests the snapshot of its ``--revision`` (``main`` without
    one), which the tool cannot see either. Raises ``ConfigError``."""
    from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, TieredConfig

    cfg = TieredConfig.from_dict(extra, passthrough_keys=VLLM_PASSTHROUGH_KEYS)
    out: dict[str, Any] = {"hash_algorithm": cfg.hash_algorithm}
    for key in ("model_id", "hash_seed", "block_size"):
        if extra.get(key) is not None:
            out[key] = getattr(cfg, key)
    if "model_id" not in out and model is not None:
        out["model_id"] = model
    where = cfg.model_path
    if where is None and model is not None:
        local = Path(model).expanduser()
        if local.is_dir():
            where = str(local.absolute())
        elif not (hf_hub_cache() / ("models--" + model.strip("/").replace("/", "--"))).is_dir():
            raise ConfigError(
                f"--model: {model!r} is neither a directory nor in the local Hugging Face cache ({hf_hub_cache()})"
            )
    if where is not None:
        out["weights_digest"] = weights_digest(where).digest
    return out


def unread_fields(fingerprint: Mapping[str, Any], pinned: Mapping[str, Any]) -> list[str]:
    """One line per field where a namespace's ``fingerprint`` record differs from what a
    server is ``pinned`` to (``pinned_fields``); empty when that server would read it
    (given an engine of the namespace's geometry)."""
    out = []
    for key, want in pinned.items():
        have = fingerprint.get(key)
        if have != want and not (key == "model_id" and _same_directory(want, have)):
            out.append(f"{key}: {_show(want)} for the config, {_show(have)} in the cache")
    return out


def _same_directory(a: Any, b: Any) -> bool:
    """Whether two model ids are spellings of one local directory, as seen from here: a
    server records its ``--model`` as it was given (``./llama``, ``/models/llama``), and a
    tool given another spelling of that directory must not judge its namespace unread.
    A spelling that names no directory here (a hub id, a path relative to another
    working directory) is compared as written."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    x, y = Path(a).expanduser(), Path(b).expanduser()
    return x.is_dir() and y.is_dir() and x.resolve() == y.resolve()


def _show(value: Any) -> str:
    return "none" if value is None else repr(value)
