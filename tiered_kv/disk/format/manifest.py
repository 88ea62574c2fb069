"""A namespace's ``manifest.json``: what it records, and reading it as untrusted input.

Every process that opens a namespace reads it (scheduler, workers, their disk I/O
processes, the inspector); the scheduler or worker that creates or grows a namespace
writes it (a new file beside it, fsynced, renamed over it). The I/O goes through
``safe_open``, relative to the namespace directory's descriptor.

The manifest says how to read the slab files (block and slot sizes, slot count,
checksum), so a damaged or forged one must never be half-believed: ``Manifest.parse``
checks every field's type and range, and the fingerprint record's, and a bad one is
one ``ManifestError`` naming the field and the file. (Checks against what an engine
computes, such as the fingerprint and block size, are the namespace's.)
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tiered_kv.config import CHECKSUMS
from tiered_kv.disk.format.errors import NamespaceError
from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.format.safe_open import open_file, read_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
#: Slot alignment: O_DIRECT and GDS need 4 KiB-aligned offsets, lengths and buffers.
SLOT_ALIGN = 4096
#: A manifest is a few KiB; anything much longer is not one.
MAX_MANIFEST_BYTES = 1 << 20
#: Largest block or slot a manifest may name (1 TiB), and largest slab (2^62 bytes):
#: far beyond any real cache, small enough that no size arithmetic overflows.
MAX_BLOCK_BYTES = 1 << 40
MAX_SLAB_BYTES = 1 << 62
_MAX_DIM = 1 << 31


class ManifestError(NamespaceError):
    """A manifest that cannot be used: ``path``, and ``field`` (None: the whole file)."""

    def __init__(self, path: str | os.PathLike, field_name: str | None, problem: str):
        self.path, self.field = Path(path), field_name
        where = f"{path}: {field_name}" if field_name else str(path)
        super().__init__(
            f"{where}: {problem}; the namespace cannot be used as it is (delete "
            f"{Path(path).parent} to let an engine start it afresh)"
        )


def slot_size_for(block_bytes: int) -> int:
    """Bytes of one disk slot: the block rounded up to ``SLOT_ALIGN``."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


@dataclass
class Manifest:
    """Contents of ``manifest.json``. ``num_slots`` may grow (never shrinks) when an
    engine reopens the namespace with a larger ``disk_bytes``."""

    namespace_id: str
    fingerprint: dict[str, Any]
    layout: dict[str, Any]
    block_bytes: int
    slot_size: int
    num_slots: int
    checksum: str
    created: float
    format_version: int = FORMAT_VERSION
    created_by: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        #: The fingerprint record as a ``Fingerprint`` (set by ``parse`` and ``new``; not a field).
        self.parsed_fingerprint: Fingerprint

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def read(
        cls, ns_dir: str | os.PathLike, dir_fd: int | None = None, owner: int | None = None, fix_mode: bool = True
    ) -> "Manifest":
        """Read and check ``ns_dir``'s manifest (through ``dir_fd``, the directory's
        descriptor, when given). Raises ``ManifestError`` or ``NamespaceError``."""
        path = Path(ns_dir) / MANIFEST
        own_fd = dir_fd is None
        if dir_fd is None:
            try:
                dir_fd = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                raise NamespaceError(f"cannot open {ns_dir}: {e.strerror}") from None
        try:
            raw = read_file(
                MANIFEST, dir_fd=dir_fd, path=path, limit=MAX_MANIFEST_BYTES, owner=owner, fix_mode=fix_mode
            )
        except FileNotFoundError:
            raise NamespaceError(f"{ns_dir} is not a disk cache namespace: {MANIFEST} is missing") from None
        except OSError as e:
            raise NamespaceError(f"cannot read {path}: {e.strerror}") from None
        finally:
            if own_fd:
                os.close(dir_fd)
        return cls.parse(raw, path)

    @classmethod
    def parse(cls, raw: bytes, path: str | os.PathLike) -> "Manifest":
        """A manifest from the bytes of ``path``, every field checked (module docstring)."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(path, None, f"longer than {MAX_MANIFEST_BYTES} bytes; a manifest is a few KiB")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ManifestError(path, None, f"cannot read it as JSON ({e})") from None
        if not isinstance(data, dict):
            raise ManifestError(path, None, f"expected a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != FORMAT_VERSION or not _is_int(version):
            raise ManifestError(
                path, "format_version", f"{_show(version)} is not supported (this build reads version {FORMAT_VERSION})"
            )
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.name not in ("format_version", "created_by")}
        missing, unknown = sorted(required - set(data)), sorted(set(data) - names)
        if missing:
            raise ManifestError(path, missing[0], "missing")
        if unknown:
            raise ManifestError(path, unknown[0], "not a manifest field")

        def need(name: str, ok: bool, expected: str) -> None:
            if not ok:
                raise ManifestError(path, name, f"expected {expected}, got {_show(data[name])}")

        need(
            "namespace_id",
            isinstance(data["namespace_id"], str)
            and 0 < len(data["namespace_id"]) <= 255
            and "/" not in data["namespace_id"],
            "a directory name",
        )
        need("fingerprint", isinstance(data["fingerprint"], dict), "an object")
        need("layout", isinstance(data["layout"], dict), "an object")
        need("created_by", isinstance(data.get("created_by", {}), dict), "an object")
        bb = data["block_bytes"]
        need("block_bytes", _is_int(bb) and 0 < bb <= MAX_BLOCK_BYTES, f"a byte count in 1..{MAX_BLOCK_BYTES}")
        ss = data["slot_size"]
        need(
            "slot_size",
            _is_int(ss) and ss == slot_size_for(bb),
            f"{slot_size_for(bb)} (block_bytes {bb} rounded up to {SLOT_ALIGN})",
        )
        n = data["num_slots"]
        need(
            "num_slots",
            _is_int(n) and 0 < n <= MAX_SLAB_BYTES // ss,
            f"a slot count in 1..{MAX_SLAB_BYTES // ss} ({ss}-byte slots)",
        )
        need("checksum", data["checksum"] in CHECKSUMS, f"one of {', '.join(CHECKSUMS)}")
        t = data["created"]
        need("created", (_is_int(t) or isinstance(t, float)) and 0 <= t < 1e11, "a time in seconds since 1970")
        m = cls(**data)
        m.parsed_fingerprint = fingerprint_from_record(m.fingerprint, path)
        return m

    def write_atomic(self, ns_dir: str | os.PathLike, dir_fd: int) -> None:
        """Replace ``ns_dir``'s manifest (``dir_fd``: its descriptor) with this one: a new
        file written and fsynced beside it, renamed over it, the directory fsynced."""
        tmp = f".{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        fd = open_file(tmp, os.O_WRONLY, path=Path(ns_dir) / tmp, dir_fd=dir_fd, create=True, exclusive=True)
        try:
            try:
                data = self.to_json().encode()
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, MANIFEST, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        os.fsync(dir_fd)

    @classmethod
    def new(
        cls,
        namespace_id: str,
        fp: Fingerprint,
        layout_record: dict[str, Any],
        block_bytes: int,
        num_slots: int,
        checksum: str,
        created_by: dict[str, Any],
    ) -> "Manifest":
        m = cls(
            namespace_id=namespace_id,
            fingerprint=fp.to_dict(),
            layout=layout_record,
            block_bytes=block_bytes,
            slot_size=slot_size_for(block_bytes),
            num_slots=int(num_slots),
            checksum=checksum,
            created=time.time(),
            created_by=created_by,
        )
        m.parsed_fingerprint = fp
        return m


def fingerprint_from_record(record: dict[str, Any], path: str | os.PathLike) -> Fingerprint:
    """The ``Fingerprint`` a manifest records, each field's type checked first. Raises
    ``ManifestError`` naming ``fingerprint.<field>``."""
    for f in fields(Fingerprint):
        if f.name not in record:
            continue  # Fingerprint.from_dict names missing fields
        value = record[f.name]
        expected = _check_type(str(f.type), f.name, value)
        if expected is not None:
            raise ManifestError(path, f"fingerprint.{f.name}", f"expected {expected}, got {_show(value)}")
    try:
        return Fingerprint.from_dict(record)
    except (TypeError, ValueError, KeyError) as e:
        raise ManifestError(path, "fingerprint", str(e)) from None


def _check_type(annotation: str, name: str, value: Any) -> str | None:
    """None if ``value`` (from JSON) fits the field's annotation, else what it expects.
    Annotations this does not know are left to ``Fingerprint`` itself."""
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    if value is None:
        return None if optional else "a value, not null"
    if name == "layer_geometry":
        ok = (
            isinstance(value, list)
            and value
            and all(
                isinstance(x, list)
                and len(x) == 2
                and isinstance(x[0], str)
                and isinstance(x[1], list)
                # >= 0: vLLM's KV-group entries record "no sliding window" as 0.
                and all(_is_int(d) and 0 <= d < _MAX_DIM for d in x[1])
                for x in value
            )
        )
        return None if ok else "a list of [layer name, [block shape]]"
    if base == "str":
        return None if isinstance(value, str) else "a string"
    if base == "int":
        return None if _is_int(value) and 0 < value < _MAX_DIM else f"an integer in 1..{_MAX_DIM - 1}"
    if base == "tuple[str, ...]":
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
        return None if ok else "a list of strings"
    return None
