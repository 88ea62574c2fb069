"""``summary``: one record per namespace of a disk cache, and ``ls``: its entries.

Operator's process, read-only: reads manifests, one index snapshot per namespace, the
lock record, and the slab files' sizes; probes (reads) one 4 KiB page of a slab to
tell whether O_DIRECT works there. Everything else is numpy over the snapshot, so a
namespace of a million blocks is summarised or listed in about a second.

``mark_read_by`` says, for a vLLM server config, whether a vLLM server with it would
read each namespace: the fields it pins (``model_identity.pinned_fields``: model id,
revision, weights digest of its model directory, hash settings, block size; and the
attention backend of a ``vllm serve --config`` file that sets one) and, where the model
directory is known and vLLM imports, the rest of the namespace its spec computes
(worker-block or CPU-tier-row and KV-group geometry, KV-cache layout, model settings,
attention backend: ``server_namespace.ServerDisk.vllm_fingerprint``, for a server
started with the namespace's own TP size, GPU block size, dtype, KV-cache layout and
attention backend, which are ``vllm serve`` flags, not config keys). So a namespace
that differs from the config's only in the attention backend is read only where the
config leaves the backend to the server's flags. Every config also rules out the
namespaces its spec cannot have written (``server_namespace``: ``TieredDiskTier``
under vLLM's ``TieringOffloadingSpec`` writes whole CPU-tier rows at TP size 1, our
spec each rank's pages); a spec the tools cannot compute is refused. Computing the weights digest
reads a bounded sample of that model directory; the vLLM check reads its
``config.json`` and imports vLLM.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered_kv.config import ConfigError
from tiered_kv.disk.store.io_backends import PosixBackend
from tiered_kv.disk.format.namespace import Namespace, current_holder
from tiered_kv.ops.inspect.cache import CacheDir, EntryTable, InspectError, read_entries
from tiered_kv.model_identity import pinned_fields, resolve_model_dir, unread_fields
from tiered_kv.ops.server_namespace import TIERING_MARK, ServerDisk, kv_layers, server_disk


def io_backend_info(ns: Namespace) -> dict[str, Any]:
    """How block I/O would run on this namespace's files: whether the first slab takes
    O_DIRECT (probed by a read; None when there is no readable slab, with ``slab_error``
    saying why) and whether KvikIO is installed (the engine probes GDS itself at
    start-up; the inspector never writes, so it does not)."""
    slab = ns.slab_path(0)
    direct: bool | None = None
    error = None if slab.exists() else "no slab yet"
    if error is None:
        backend = PosixBackend(1)
        try:
            f = backend.open(slab, True, ns.fd, ns.owner)
            direct = f.direct
            backend.close_file(f)
        except OSError as e:
            error = f"cannot open {slab.name}: {e.strerror}"
        finally:
            backend.shutdown()
    return {
        "posix_direct": direct,
        "slab_error": error,
        "kvikio_installed": importlib.util.find_spec("kvikio") is not None,
    }


def describe_io(info: dict[str, Any]) -> str:
    if info["posix_direct"] is None:
        direct = f"posix ({info['slab_error']})"
    else:
        direct = "posix, O_DIRECT" if info["posix_direct"] else "posix, buffered (no O_DIRECT here)"
    kvikio = "KvikIO installed (GDS probed by the engine)" if info["kvikio_installed"] else "KvikIO not installed"
    return f"{direct}; {kvikio}"


def _time_range(values: np.ndarray) -> tuple[float | None, float | None]:
    if not len(values):
        return None, None
    return float(values.min()), float(values.max())


def summarize_namespace(ns: Namespace, table: EntryTable | None = None) -> dict[str, Any]:
    """The namespace's fingerprint, occupancy, ages, hits, I/O and health as a JSON-able
    dict. ``health.status`` is ``ok``, ``warning`` or ``error``; ``health.problems``
    says what is wrong, one line each."""
    m = ns.manifest
    fp = ns.fingerprint
    tp = ns.tp_size
    problems: list[tuple[str, str]] = []  # (severity, text)
    try:
        table = table if table is not None else read_entries(ns)
    except InspectError as e:
        problems.append(("error", str(e)))
        table = EntryTable.empty(tp)
    holder = current_holder(ns)

    complete = table.complete
    in_range = (table.slot >= 0) & (table.slot < m.num_slots)
    valid = complete & in_range & (table.size == m.block_bytes)
    invalid = int((complete & ~valid).sum())
    incomplete = int((~complete).sum())
    slots = table.slot[valid]
    duplicates = int(len(slots) - np.count_nonzero(np.bincount(slots, minlength=1)))
    blocks = int(valid.sum())
    if invalid:
        problems.append(
            (
                "error",
                f"{invalid} entries point outside the slab or have the wrong size "
                f"(never served; `verify --repair` drops them)",
            )
        )
    if duplicates:
        problems.append(("error", f"{duplicates} entries share a slot with another entry"))
    if incomplete:
        why = (
            "in flight or left by a crash"
            if holder is not None
            else "left by an interrupted store; not loadable, reclaimed at the next engine start "
            "or by `verify --repair`"
        )
        problems.append(("warning", f"{incomplete} incomplete entries ({why})"))
    slab_bytes = 0
    for rank in range(tp):
        path = ns.slab_path(rank)
        if not path.exists():
            if blocks or incomplete:
                problems.append(("error", f"{path.name} is missing but the index has entries"))
            continue
        st = path.stat()
        slab_bytes += st.st_blocks * 512
        on_rank = ((table.ranks >> np.uint64(rank)) & np.uint64(1)) == 1
        needed = (int(table.slot[on_rank].max(initial=-1)) + 1) * m.slot_size
        if st.st_size < needed:
            problems.append(("error", f"{path.name} is {st.st_size} bytes, shorter than its entries need ({needed})"))
    if ns.path.name != m.namespace_id or fp.namespace_id != m.namespace_id:
        problems.append(
            ("warning", f"directory {ns.path.name} does not match its fingerprint's namespace id {fp.namespace_id}")
        )

    oldest, newest = _time_range(table.store_time[valid])
    least, most = _time_range(table.last_access[valid])
    hits = table.hits[valid]
    status = "error" if any(s == "error" for s, _ in problems) else ("warning" if problems else "ok")
    return {
        "namespace": ns.path.name,
        "path": str(ns.path),
        "fingerprint": fp.to_dict(),
        "layers": kv_layers(fp.layer_geometry),
        "block_tokens": fp.block_size,
        "block_bytes": m.block_bytes,
        "slot_bytes": m.slot_size,
        "checksum": m.checksum,
        "created": m.created,
        "blocks": blocks,
        "incomplete_entries": incomplete,
        "invalid_entries": invalid,
        "num_slots": m.num_slots,
        "fill": blocks / m.num_slots if m.num_slots else 0.0,
        "used_bytes": blocks * m.slot_size * tp,
        "capacity_bytes": m.num_slots * m.slot_size * tp,
        "slab_bytes_on_disk": slab_bytes,
        "oldest_stored": oldest,
        "newest_stored": newest,
        "least_recent_access": least,
        "most_recent_access": most,
        "hits_total": int(hits.sum()),
        "hits_max": int(hits.max(initial=0)),
        "blocks_with_hits": int((hits > 0).sum()),
        "io_backend": io_backend_info(ns),
        "engine": holder,
        "health": {"status": status, "problems": [text for _, text in problems]},
    }


def summarize_cache(cache: CacheDir) -> dict[str, Any]:
    """``summarize_namespace`` for each namespace, plus cache-level problems."""
    problems = [f"{path.name}: {why}" for path, why in cache.unreadable]
    problems += [
        f"{p.name}: left by an interrupted namespace creation, clear, bench or start-up canary "
        "(safe to delete while no engine starts)"
        for p in cache.leftovers
    ]
    return {
        "path": str(cache.path),
        "generated": time.time(),
        "namespaces": [summarize_namespace(ns) for ns in cache.namespaces],
        "problems": problems,
    }


# ---------------------------------------------------------------- which config reads what


#: Fingerprint fields a vLLM server derives beyond those its config pins
#: (``pinned_fields``): compared where vLLM's namespace can be computed here. Not the
#: revision (vLLM's ``--revision``) nor a hash seed the config leaves to the server's
#: ``$PYTHONHASHSEED``: like TP, settings of the server this tool cannot know, so a
#: namespace that differs only there is never judged unread.
VLLM_FIELDS = (
    "block_size",
    "layer_geometry",
    "kv_layout",
    "model_settings",
    "attention_backend",
)
#: ``model_settings`` entries of ``vllm serve`` settings the tools do not model
#: (``config_file.UNMODELLED_SERVE_KEYS``): a namespace that names one, or pipeline
#: stages, is compared on the pinned fields only, never judged unread by the rest.
UNMODELLED = ("hf_config=", "load_format=", "mamba_cache_dtype=", "mamba_ssm_cache_dtype=", "speculative=")


@dataclass
class ServerConfig:
    """A vLLM server's config file, the fingerprint fields it pins (``pinned_fields``),
    and what computing the rest of its namespace needs: the raw extra config, the model
    directory (vLLM's ``--model``, else the config's ``model_path``; None: not known
    here) and the spec that writes its disk tier (``server_namespace``)."""

    path: str
    pinned: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    model_dir: str | None = None
    disk: ServerDisk | None = None
    _expected: dict[tuple, dict[str, Any] | str] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, path: str, model: str | None = None) -> "ServerConfig":
        """Read ``path`` (vLLM's ``--kv-transfer-config`` JSON or its extra config);
        ``model``: the server's ``--model`` where the config sets no model_id or
        model_path. Raises ``InspectError`` naming the file and the problem, or a spec
        whose namespace cannot be computed here (``server_namespace.server_disk``)."""
        try:
            disk = server_disk(path)
            extra = disk.extra_for()
            pinned = pinned_fields(extra, model=model)
        except ConfigError as e:
            raise InspectError(f"--config {path}: {e}") from None
        if disk.attention_backend is not None:
            pinned["attention_backend"] = disk.attention_backend
        found = resolve_model_dir(model) if model is not None else None
        where = str(found) if found is not None else extra.get("model_path")
        return cls(str(path), pinned, dict(extra), None if where is None else str(where), disk)

    def vllm_fingerprint(self, fingerprint: dict[str, Any]) -> dict[str, Any] | str:
        """The fingerprint this config's spec computes in a vLLM server with it, started
        with the namespace's TP size, GPU block size, dtype, KV-cache layout and attention
        backend (``vllm serve`` flags, not config keys; the backend the config's own where
        it sets one), as a record; or why it cannot be computed here (no model directory,
        no vLLM, a model the warm-up cannot match). The TP size of a ``TieredDiskTier``
        namespace is in its row format (``tp=``): the namespace itself records TP 1."""
        if self.model_dir is None:
            return "vLLM's geometry not checked: give --model (the server's model directory)"
        row = dict(x.split("=", 1) for x in fingerprint.get("kv_layout", ()) if "=" in str(x))
        unmodelled = [str(x) for x in fingerprint.get("model_settings") or () if str(x).startswith(UNMODELLED)]
        unmodelled += [f"pp={row['pp']}"] if row.get("pp", "1") != "1" else []
        if unmodelled:
            return (
                f"vLLM's geometry not checked: written by a server with {', '.join(unmodelled)}, settings "
                "a config file does not give this tool"
            )
        geometry = fingerprint.get("layer_geometry") or ()
        tp = fingerprint.get("tp_size")
        if geometry and geometry[0] and geometry[0][0] == TIERING_MARK and "tp" in row:
            tp = row["tp"]
        backend = self.pinned.get("attention_backend") or fingerprint.get("attention_backend")
        key = (tp, fingerprint.get("gpu_block_size"), fingerprint.get("dtype"), row.get("kv_cache_layout"), backend)
        if key not in self._expected:
            self._expected[key] = _vllm_fingerprint(self.disk, self.model_dir, self.extra, *key)
        return self._expected[key]

    def differences(self, fingerprint: dict[str, Any]) -> list[str]:
        """Why a vLLM server with this config would not read a namespace of
        ``fingerprint`` (empty: it would). The pinned fields always; the geometry,
        layout, model settings and attention backend vLLM derives where
        ``vllm_fingerprint`` computes, but never an entry a ``vllm serve`` flag sets
        (``_by_flags``): the tool computes the server's defaults there."""
        out = self.disk.shape_differences(fingerprint) if self.disk is not None else []
        out += unread_fields(fingerprint, self.pinned)
        expected = self.vllm_fingerprint(fingerprint)
        if isinstance(expected, dict):
            for key in VLLM_FIELDS:
                want, have = expected.get(key), fingerprint.get(key)
                if key not in self.pinned and want != have and not _by_flags(key, want, have):
                    out.append(f"{key}: {_brief(want)} for the config, {_brief(have)} in the cache")
        return out

    def unchecked(self, fingerprint: dict[str, Any]) -> str | None:
        """Why only some fields were compared, or None."""
        expected = self.vllm_fingerprint(fingerprint)
        if isinstance(expected, str):
            return expected
        flagged = [
            f"{key} {_brief(fingerprint.get(key))}"
            for key in ("model_settings", "kv_layout")
            if key not in self.pinned and expected.get(key) != fingerprint.get(key)
            if _by_flags(key, expected.get(key), fingerprint.get(key))
        ]
        if flagged:
            return f"vLLM's settings not checked: the cache's {'; '.join(flagged)} differ only where `vllm serve` flags set them"
        return None


#: ``kv_layout`` entries of ``vllm serve`` flags (context and data parallelism), not of a config.
FLAG_LAYOUT = ("pcp=", "dcp=", "dp_replica=")


def _by_flags(key: str, want: Any, have: Any) -> bool:
    """Whether ``want`` (the namespace of a server run with this config and vLLM's
    defaults) and ``have`` differ only in what ``vllm serve`` flags set: every
    ``model_settings`` entry (``--dtype``, ``--quantization``, ``--tokenizer``,
    ``--hf-overrides``, ``--max-model-len``...), and the parallelism of ``kv_layout``.
    A namespace without model settings is another writer's, not another flag's."""
    if key == "model_settings":
        return want is not None and have is not None
    if key == "kv_layout" and want is not None and have is not None:
        kept = [[str(x) for x in v if not str(x).startswith(FLAG_LAYOUT)] for v in (want, have)]
        return kept[0] == kept[1]
    return False


def _brief(value: Any) -> str:
    """A fingerprint value on one short line: a geometry by its entries' names."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(str(x[0]) if isinstance(x, (list, tuple)) else str(x) for x in value) + ")"
    return repr(value)


def _vllm_fingerprint(
    disk: ServerDisk | None,
    model_dir: str,
    extra: dict[str, Any],
    tp: Any,
    gpu_block_size: Any,
    dtype: Any,
    layout: str | None,
    backend: str | None,
) -> dict[str, Any] | str:
    """``ServerDisk.vllm_fingerprint`` with these ``vllm serve`` settings (without a
    ``disk``: ``TieredOffloadingSpec``'s, from ``extra``), as a record, or why not."""
    try:
        from tiered_kv.ops.warmup.errors import WarmupError
        from tiered_kv.ops.warmup.layouts import VllmServe
        from tiered_kv.ops.warmup.vllm_pages import server_fingerprint
    except ImportError as e:
        return f"vLLM's geometry not checked: vLLM does not import here ({e})"
    try:
        serve = VllmServe(
            model_dir,
            extra,
            dtype=str(dtype),
            gpu_block_size=int(gpu_block_size),
            tp_size=int(tp),
            kv_cache_layout=layout if layout not in (None, "None") else None,
            attention_backend=backend,
        )
        fp = disk.vllm_fingerprint(serve) if disk is not None else server_fingerprint(serve)
    except (WarmupError, ConfigError, TypeError, ValueError) as e:
        return f"vLLM's geometry not checked: {e}"
    return fp.to_dict()


def mark_read_by(data: dict[str, Any], configs: list[ServerConfig]) -> None:
    """Add ``read_by`` to each namespace of ``summarize_cache``'s ``data``: per config,
    ``{"config", "reads", "differences"}``, plus ``"unchecked"`` saying why only the
    pinned fields were compared, where so."""
    for ns in data["namespaces"]:
        ns["read_by"] = []
        for c in configs:
            d = c.differences(ns["fingerprint"])
            row = {"config": c.path, "reads": not d, "differences": d}
            if (why := c.unchecked(ns["fingerprint"])) is not None:
                row["unchecked"] = why
            ns["read_by"].append(row)


def unread_namespaces(cache: CacheDir, configs: list[ServerConfig]) -> list[Namespace]:
    """The namespaces of ``cache`` that no server with any of ``configs`` would read."""
    return [ns for ns in cache.namespaces if all(c.differences(ns.manifest.fingerprint) for c in configs)]


# ---------------------------------------------------------------- ls

SORT_KEYS = ("last-access", "stored", "hits", "slot", "hash")
STATES = ("all", "complete", "incomplete")


@dataclass
class ListFilter:
    """Which entries ``list_entries`` returns and in what order. Ages are seconds before
    ``now`` (by last access); ``limit`` 0 means all. Sorting is descending (most recent,
    most hits, highest slot first) unless ``ascending``; ``hash`` sorts ascending unless
    ``ascending`` is False explicitly."""

    state: str = "all"
    hash_prefix: str | None = None
    min_hits: int = 0
    older_than: float | None = None
    newer_than: float | None = None
    sort: str = "last-access"
    ascending: bool | None = None
    limit: int = 50

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise InspectError(f"--state: expected one of {', '.join(STATES)}, got {self.state!r}")
        if self.sort not in SORT_KEYS:
            raise InspectError(f"--sort: expected one of {', '.join(SORT_KEYS)}, got {self.sort!r}")
        if self.limit < 0:
            raise InspectError(f"--limit: expected 0 (all) or a positive count, got {self.limit}")


def list_entries(
    ns: Namespace, flt: ListFilter, table: EntryTable | None = None, now: float | None = None
) -> dict[str, Any]:
    """Entries of ``ns`` matching ``flt``, sorted, as JSON-able rows, with the counts
    before and after filtering."""
    now = time.time() if now is None else now
    table = table if table is not None else read_entries(ns)
    mask = np.ones(len(table), dtype=bool)
    if flt.state != "all":
        mask &= table.complete if flt.state == "complete" else ~table.complete
    if flt.hash_prefix:
        mask &= table.hash_prefix_mask(flt.hash_prefix)
    if flt.min_hits:
        mask &= table.hits >= flt.min_hits
    if flt.older_than is not None:
        mask &= table.last_access < now - flt.older_than
    if flt.newer_than is not None:
        mask &= table.last_access >= now - flt.newer_than
    rows = np.flatnonzero(mask)
    ascending = flt.ascending if flt.ascending is not None else flt.sort == "hash"
    if flt.sort == "hash":
        if table.in_hash_order:
            rows = rows if ascending else rows[::-1]
        else:
            rows = np.asarray(sorted(rows.tolist(), key=table.hash, reverse=not ascending), dtype=np.int64)
    else:
        column = {"last-access": table.last_access, "stored": table.store_time, "hits": table.hits, "slot": table.slot}[
            flt.sort
        ][rows]
        order = np.argsort(column, kind="stable")
        rows = rows[order if ascending else order[::-1]]
    shown = rows if flt.limit == 0 else rows[: flt.limit]
    present = table.rank_counts()
    entries = []
    for i in shown.tolist():
        mask_bits = int(table.ranks[i])
        entries.append(
            {
                "hash": table.hash(i).hex(),
                "slot": int(table.slot[i]),
                "size": int(table.size[i]),
                "ranks": [r for r in range(table.tp_size) if mask_bits >> r & 1],
                "complete": bool(present[i] == table.tp_size),
                "stored": float(table.store_time[i]),
                "last_access": float(table.last_access[i]),
                "hits": int(table.hits[i]),
            }
        )
    return {
        "namespace": ns.path.name,
        "tp_size": table.tp_size,
        "total": len(table),
        "matching": int(len(rows)),
        "entries": entries,
    }
