"""Which disk namespace a server built from a config file reads, and how its disk tier
is sized: the one answer every operator tool gives (``inspect summary --config``,
``inspect clear --unread-by``, ``warmup --config``, ``doctor --config``).

Operator's process; reads the config file (``config_file``) and, where asked for a whole
namespace (``ServerDisk.vllm_fingerprint``), the model's ``config.json`` and weights
digest. Two server shapes write a disk namespace, and from the same model they write
different ones:

- ``TieredOffloadingSpec`` (``integrations.vllm.geometry``): each TP rank writes its
  own shard of every block, ``disk_bytes`` is per rank; the namespace's layer geometry
  starts with ``vllm_worker_block`` and its TP size is the engine's.
- vLLM's ``TieringOffloadingSpec`` with our ``TieredDiskTier`` in ``secondary_tiers``
  (``integrations.vllm.secondary_config``): vLLM's scheduler is the one writer, each
  block is a whole CPU-tier row (every TP rank's shard and the row's padding),
  ``disk_bytes`` is per node; the namespace's layer geometry starts with
  ``vllm_cpu_chunk`` and its TP size is 1.

Both name the attention backend whose kernels write the pages, a ``vllm serve`` flag
(``--attention-backend``), not a key of the extra config: a ``vllm serve --config``
file may set it (``ServerDisk.attention_backend``); elsewhere the tools take it as
given, or for a namespace, from its record.

Any other spec (vLLM's CPU-only spec, a spec loaded from another module) is refused
with ``ConfigError``: its namespace is not one the tools can compute, and a guess
could delete a cache that server reads, or fill one it never reads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tiered_kv.config_values import ConfigError
from tiered_kv.config_file import (
    DISK_TIER_TYPE,
    SPEC_MODULE,
    TIERED_SPEC,
    TIERING_SPEC,
    VLLM_REGISTERED_SPECS,
    ServerConfigFile,
    read_server_config,
)

if TYPE_CHECKING:  # torch: not for `--help`
    from tiered_kv.fingerprint import Fingerprint
    from tiered_kv.ops.warmup.layouts import VllmServe

#: The first entry of a namespace's layer geometry, per spec that writes it (the
#: pseudo-layers of ``geometry.VllmGeometry.scheduler_layout`` and
#: ``secondary_config.chunk_layout``).
TIERED_MARK = "vllm_worker_block"
TIERING_MARK = "vllm_cpu_chunk"
_GROUP_LAYERS = re.compile(r"kv_group\d+:(\d+)_layers:\w+")


def kv_layers(layer_geometry: Sequence[Sequence[Any]]) -> int | None:
    """How many model layers a block of a namespace with this ``layer_geometry``
    holds: its entries for our own layout (one per layer), the KV-cache groups' layer
    counts for a vLLM server's namespace; None where the namespace does not record
    them (a pipeline-parallel ``TieredOffloadingSpec`` names its groups only)."""
    first = str(layer_geometry[0][0]) if layer_geometry and layer_geometry[0] else None
    if first == TIERING_MARK:
        return sum(int(shape[1]) for _, shape in layer_geometry[1:])
    if first == TIERED_MARK:
        found = [_GROUP_LAYERS.fullmatch(str(name)) for name, _ in layer_geometry[1:]]
        return sum(int(m[1]) for m in found if m) if found and all(found) else None
    return len(layer_geometry)


#: The modules a ``spec_module_path`` may name for each spec the tools compute.
_SPEC_MODULES = {TIERED_SPEC: SPEC_MODULE, TIERING_SPEC: "vllm."}
_SUPPORTED = (
    f"{TIERED_SPEC} (spec_module_path {SPEC_MODULE}), or vLLM's {TIERING_SPEC} "
    f"with one {DISK_TIER_TYPE} entry in secondary_tiers"
)


@dataclass(frozen=True)
class ServerDisk:
    """The disk tier of a server built from ``found``: which spec writes it, where it
    lives, how ``disk_bytes`` counts, and which namespaces that spec can have written."""

    found: ServerConfigFile

    @property
    def attention_backend(self) -> str | None:
        """The attention backend a ``vllm serve --config`` file starts the server on
        (``ServerConfigFile.attention_backend``); None where it sets none."""
        return self.found.attention_backend

    @property
    def spec_name(self) -> str:
        return self.found.spec_name

    @property
    def is_secondary_tier(self) -> bool:
        """True for ``TieredDiskTier`` under vLLM's ``TieringOffloadingSpec``."""
        return self.found.spec_name == TIERING_SPEC

    @property
    def disk_path(self) -> str | None:
        value = self.found.extra.get("disk_path")
        return None if value is None else str(value)

    @property
    def describe(self) -> str:
        """The spec in words, for messages."""
        return f"vLLM's {TIERING_SPEC} with {DISK_TIER_TYPE}" if self.is_secondary_tier else TIERED_SPEC

    @property
    def disk_bytes_per(self) -> str:
        """``node`` where one writer (vLLM's scheduler) holds the tier for all ranks, else ``rank``."""
        return "node" if self.is_secondary_tier else "rank"

    def extra_for(self, tp: int | None = None) -> dict[str, Any]:
        """Our keys of the config (``ServerConfigFile.extra_for``)."""
        return self.found.extra_for(tp)

    def vllm_fingerprint(self, serve: VllmServe) -> Fingerprint:
        """The whole namespace a vLLM server with this config opens, started as
        ``serve`` says but with the extra config this file gives its spec (in place of
        ``serve.extra_config``), the TP size, GPU block size and dtype a ``vllm serve
        --config`` file sets (``ServerConfigFile.serve_flags``: the server started from the
        file runs them, whatever ``serve`` says) and, where ``serve`` names no attention
        backend, the file's ``attention_backend``: computed with vLLM's own config code, by the
        module the warm-up writes it with (``ops.warmup.vllm_pages`` for
        ``TieredOffloadingSpec``, ``ops.warmup.vllm_rows`` for ``TieredDiskTier``'s
        rows). Imports vLLM; reads the model's ``config.json`` and weights digest.
        Raises ``WarmupError`` naming what cannot be computed."""
        backend = serve.attention_backend or self.attention_backend
        serve = replace(serve, **self.found.serve_flags())
        if self.is_secondary_tier:
            from tiered_kv.ops.warmup.vllm_rows import tiering_rows

            return tiering_rows(replace(serve, extra_config=self.found.given, attention_backend=backend)).fingerprint
        from tiered_kv.ops.warmup.vllm_pages import server_fingerprint

        extra = self.found.extra_for(serve.tp_size)
        return server_fingerprint(replace(serve, extra_config=extra, attention_backend=backend))

    def shape_differences(self, fingerprint: Mapping[str, Any]) -> list[str]:
        """Why a namespace of ``fingerprint`` (a ``Fingerprint.to_dict`` record) cannot
        have been written by this config's spec, one line each (empty: it can)."""
        geometry = fingerprint.get("layer_geometry") or ()
        first = str(geometry[0][0]) if geometry and geometry[0] else None
        out = []
        if self.is_secondary_tier:
            if first != TIERING_MARK:
                out.append(
                    f"layout: {self.describe} writes whole CPU-tier rows ({TIERING_MARK}); the cache holds "
                    f"{first or 'no layer'} blocks (another spec's namespace)"
                )
            if fingerprint.get("tp_size") != 1:
                out.append(
                    f"tp_size: 1 for {self.describe} (one writer, vLLM's scheduler), "
                    f"{fingerprint.get('tp_size')!r} in the cache"
                )
        elif first == TIERING_MARK:
            out.append(
                f"layout: {TIERED_SPEC} writes each rank's pages ({TIERED_MARK}); the cache holds "
                f"whole CPU-tier rows ({TIERING_MARK}, vLLM's {TIERING_SPEC} with {DISK_TIER_TYPE})"
            )
        return out


def server_disk(config: str | os.PathLike | ServerConfigFile) -> ServerDisk:
    """The disk tier of a server built from ``config`` (a path, or a file already read
    by ``read_server_config``). Raises ``ConfigError`` naming the file for a spec whose
    namespace the tools cannot compute (module docstring)."""
    found = config if isinstance(config, ServerConfigFile) else read_server_config(config)
    spec = found.spec_name
    if spec not in _SPEC_MODULES:
        raise ConfigError(
            f"config {found.path}: spec_name {spec!r}: the tools compute the disk namespace of {_SUPPORTED}; "
            "a namespace of another spec is not theirs to judge"
        )
    module = None if spec in VLLM_REGISTERED_SPECS else found.spec_module_path
    if module is not None and not str(module).startswith(_SPEC_MODULES[spec]):
        raise ConfigError(
            f"config {found.path}: spec_module_path {module!r}: a {spec} loaded from another module may write "
            f"another namespace; the tools compute the disk namespace of {_SUPPORTED}"
        )
    return ServerDisk(found)
