"""The disk cache's namespace key: everything that changes the bytes of a stored block.

Built in every process (scheduler and workers) from the same config and KV layout, so
all of them agree on the namespace directory. Plain data; the one I/O is
``from_config`` with a ``model_path`` set, which reads the model directory's weights
digest (``tiered_kv.model_identity``: a bounded sample of each file). Two engines whose fingerprints differ in any field never share blocks: they
use different namespaces, and opening a namespace whose manifest records another
fingerprint fails naming each field that differs.

Which model the blocks belong to is four fields: ``model_id``, ``model_revision``,
``weights_digest`` (config and sampled weights of the model directory) and
``model_settings`` (engine settings that change the model's activations, e.g. vLLM's
``--quantization``); ``docs/identity.md`` says what each covers.

Which order a page's bytes are in is, under vLLM, the attention backend that reads and
writes it (``attention_backend``) and the KV-cache layout vLLM resolved for it (in
``kv_layout``): two servers that differ in either never share a namespace.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from tiered_kv.config import TieredConfig
from tiered_kv.kv_layout import KVCacheLayout

#: Hex digits of the namespace id (a prefix of the fingerprint's SHA-256).
NAMESPACE_ID_LEN = 16


@dataclass(frozen=True)
class Fingerprint:
    """Identity of a disk-cache namespace.

    ``block_size`` is tokens per offloaded block; ``layer_geometry`` is
    ``((layer name, block shape), ...)`` in layout order; ``kv_layout`` says per layer
    whether the KV dimension comes before num_blocks (``"kv_first"``) or not
    (``"blocks_first"``). ``tp_size`` is the tensor-parallel width: each rank stores its
    own shard of every block, and a block is complete only with all of them.

    ``block_order`` names the byte order of a stored block where it has a choice, with
    more than one GPU block per offloaded block: ``"kernel_blocks"``, GPU blocks one
    after the other, each with all its layers (``tiered_kv.memory.host_memory``). Caches
    written before it existed had each layer's GPU blocks together; they have no
    ``block_order`` and are not served. With one GPU block per block there is one
    order, the field is None and left out of the record, and the namespace is what it
    always was.

    ``weights_digest`` is ``model_identity.weights_digest`` of the model directory, None
    where no directory is known (then the record leaves it out). ``model_settings`` are
    ``"name=value"`` strings of the serving engine's settings that change the KV beyond
    the weights (vLLM's revision, quantization, tokenizer...), None where the engine has
    none to give. Records written before these fields existed lack them: read back as
    None, so such a namespace differs from every one that has them.

    ``attention_backend`` is the name vLLM gives the attention backend whose kernels
    read and write the pages (``"FLASH_ATTN"``, ``"CPU_ATTN"``...): two backends may
    lay out the same logical page differently, so the pages of one are not the KV of
    the other. None where no engine backend decides the order (tiered-kv's own engine,
    the simulator), and in records written before it existed.
    """

    model_id: str
    model_revision: str
    dtype: str
    block_size: int
    gpu_block_size: int
    layer_geometry: tuple[tuple[str, tuple[int, ...]], ...]
    kv_layout: tuple[str, ...]
    tp_size: int
    hash_algorithm: str
    hash_seed: str
    block_order: str | None = None
    weights_digest: str | None = None
    model_settings: tuple[str, ...] | None = None
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.tp_size > 64:
            raise ValueError(f"tp_size must be in 1..64 (one bit per rank in the index), got {self.tp_size}")
        if self.block_size < 1 or self.gpu_block_size < 1 or self.block_size % self.gpu_block_size:
            raise ValueError(
                f"block_size ({self.block_size} tokens) must be a positive multiple of "
                f"gpu_block_size ({self.gpu_block_size} tokens)"
            )

    @classmethod
    def from_layout(
        cls,
        layout: KVCacheLayout,
        *,
        model_id: str,
        model_revision: str = TieredConfig.model_revision,
        tp_size: int = 1,
        hash_algorithm: str = TieredConfig.hash_algorithm,
        hash_seed: str = TieredConfig.hash_seed,
        weights_digest: str | None = None,
        model_settings: tuple[str, ...] | None = None,
    ) -> "Fingerprint":
        """The fingerprint of one rank's ``layout`` (all ranks of a TP group share it)."""
        return cls(
            model_id=str(model_id),
            model_revision=str(model_revision),
            dtype=str(layout.dtype).removeprefix("torch."),
            block_size=layout.offloaded_block_size,
            gpu_block_size=layout.gpu_block_size,
            layer_geometry=tuple((l.name, tuple(int(d) for d in l.block_shape)) for l in layout.layers),
            kv_layout=tuple("kv_first" if l.kv_before_num_blocks else "blocks_first" for l in layout.layers),
            tp_size=int(tp_size),
            hash_algorithm=str(hash_algorithm),
            hash_seed=str(hash_seed),
            block_order="kernel_blocks" if layout.block_size_factor > 1 else None,
            weights_digest=weights_digest,
            model_settings=None if model_settings is None else tuple(str(x) for x in model_settings),
        )

    @classmethod
    def from_config(cls, config: Any, layout: KVCacheLayout, tp_size: int = 1) -> "Fingerprint":
        """From a ``TieredConfig`` (model_id, model_revision, hash_algorithm, hash_seed,
        and the weights digest of model_path when it is set: reads that directory).
        Raises ``ConfigError`` naming model_path when it is not a model directory."""
        model_path = getattr(config, "model_path", None)
        digest = None
        if model_path:
            from tiered_kv.model_identity import weights_digest

            digest = weights_digest(model_path).digest
        return cls.from_layout(
            layout,
            model_id=config.model_id,
            model_revision=config.model_revision,
            tp_size=tp_size,
            hash_algorithm=config.hash_algorithm,
            hash_seed=config.hash_seed,
            weights_digest=digest,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (tuples become lists); optional fields that are None are left out."""
        return {k: v for k, v in json.loads(json.dumps(asdict(self))).items() if not (v is None and k in _OPTIONAL)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Fingerprint":
        """Inverse of ``to_dict``. Raises ``ValueError`` naming missing or unknown fields."""
        names = {f.name for f in fields(cls)}
        missing, unknown = names - set(data) - _OPTIONAL, set(data) - names
        if missing or unknown:
            raise ValueError(
                f"fingerprint record has missing fields {sorted(missing)} and unknown fields {sorted(unknown)}"
            )
        d = dict(data)
        d["layer_geometry"] = tuple((str(n), tuple(int(x) for x in s)) for n, s in d["layer_geometry"])
        d["kv_layout"] = tuple(d["kv_layout"])
        if d.get("model_settings") is not None:
            d["model_settings"] = tuple(str(x) for x in d["model_settings"])
        return cls(**d)

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def namespace_id(self) -> str:
        """Short hex digest naming this fingerprint's directory in a cache dir."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:NAMESPACE_ID_LEN]

    def differences(self, other: "Fingerprint") -> list[str]:
        """One line per differing field, identity fields first:
        ``"dtype: 'float16' here, 'bfloat16' in the cache"`` (``None``: not recorded)."""
        out = []
        for f in sorted(fields(self), key=lambda f: f.name not in IDENTITY_FIELDS):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append(f"{f.name}: {_short(mine)} here, {_short(theirs)} in the cache")
        return out


#: Fields a record may lack (None then): added after caches were written without them.
_OPTIONAL = frozenset({"block_order", "weights_digest", "model_settings", "attention_backend"})
#: The fields that say which model the blocks belong to.
IDENTITY_FIELDS = ("model_id", "model_revision", "weights_digest", "model_settings")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
