"""KV-cache sizing arithmetic: bytes per token from a model's geometry, blocks per tier.

Pure arithmetic plus reading one HF ``config.json``; no other I/O. Used by the
``tiered-kv config`` command and by the tables in configs/README.md.

Conventions (the ones the tiers use):
- A full-attention layer stores K and V: ``2 * kv_heads * head_dim`` elements per token.
- Tensor parallelism splits KV heads across ranks; when TP exceeds the KV-head count
  every rank keeps one (replicated) head, as vLLM does.
- A multi-head latent attention layer (DeepSeek-V2/V3) stores one compressed latent per
  token, ``kv_lora_rank + qk_rope_head_dim`` elements, and every TP rank keeps all of it
  (vLLM's MLA cache is one "head" of that size, not split by TP).
- ``cpu_bytes`` and ``disk_bytes`` are budgets **per TP rank**: every worker process
  holds its own shard of every offloaded block in host memory and in its own disk
  files, and the scheduler counts slots once for all ranks. A node therefore spends
  ``tp * cpu_bytes`` of RAM and ``tp * disk_bytes`` of disk.
- A CPU slot holds exactly one offloaded block; a disk slot is the block rounded up to
  4 KiB (O_DIRECT alignment).
- Sizing the tiers (``from_hf_config(..., full_attention_only=True)``), a hybrid model
  (HF ``layer_types`` naming sliding-window, linear-attention or other layers beside
  ``full_attention``) counts its full-attention layers, whose KV grows with the whole
  prompt; the others keep a bounded state per request and are left out
  (``ModelGeometry.other_layers`` says how many). A model whose every layer uses a
  sliding window, or that has no full-attention layer, is refused with the reason.
  Without the flag every layer counts (the warm-up's engines, which refuse such models
  with their own reasons).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.config import ConfigError

#: Bytes per element of the KV-cache dtypes vLLM offers (``--kv-cache-dtype`` and
#: model dtypes), under the spellings HF configs and vLLM use.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: Disk slots are padded to this many bytes (the disk tier's O_DIRECT alignment).
DISK_ALIGNMENT = 4096


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (e.g. ``"bfloat16"`` -> 2, ``"torch.float16"`` -> 2)."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ConfigError(f"dtype: unknown KV-cache dtype {dtype!r}; expected one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelGeometry:
    """The KV-relevant shape of a decoder model (whole model, before any TP split)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    name: str = ""
    #: Multi-head latent attention: one latent of ``head_dim`` elements per token and
    #: layer (``num_kv_heads`` is 1), the same on every TP rank.
    mla: bool = False
    #: Layers left out of the sizing (hybrid models): kind -> count, e.g.
    #: ``{"sliding_attention": 24}``; empty for a model of full-attention layers only.
    other_layers: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        _positive_int(self.num_layers, "num_layers")
        _positive_int(self.num_kv_heads, "num_kv_heads")
        _positive_int(self.head_dim, "head_dim")
        dtype_bytes(self.dtype)
        if self.mla and self.num_kv_heads != 1:
            raise ConfigError(f"num_kv_heads: an MLA model stores one latent per token, got {self.num_kv_heads}")

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads one TP rank stores. TP must divide the KV heads or be a multiple of
        them (vLLM's rule); beyond the head count, heads are replicated. An MLA latent is
        kept whole on every rank."""
        _positive_int(tp, "tp")
        if self.mla:
            return 1
        if tp <= self.num_kv_heads:
            if self.num_kv_heads % tp:
                raise ConfigError(
                    f"tp: {tp} does not divide the model's {self.num_kv_heads} "
                    f"KV heads; use a divisor of {self.num_kv_heads}"
                )
            return self.num_kv_heads // tp
        if tp % self.num_kv_heads:
            raise ConfigError(
                f"tp: {tp} is larger than the model's {self.num_kv_heads} KV heads but not a multiple of it"
            )
        return 1

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes one token occupies on one TP rank (all layers; K and V, or the MLA latent)."""
        planes = 1 if self.mla else 2
        return planes * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes

    def describe(self, tp: int = 1) -> str:
        """The geometry in words, e.g. ``32 layers, 8 KV heads (2 per rank), head_dim 128, bfloat16``."""
        if self.other_layers:
            others = ", ".join(f"{n} {kind}" for kind, n in self.other_layers)
            return (
                f"{self.num_layers} full-attention layers (not counted: {others}), {self.num_kv_heads} KV heads "
                f"({self.kv_heads_per_rank(tp)} per rank), head_dim {self.head_dim}, {self.dtype}"
            )
        if self.mla:
            return f"{self.num_layers} layers, MLA latent of {self.head_dim} (the same on every rank), {self.dtype}"
        return (
            f"{self.num_layers} layers, {self.num_kv_heads} KV heads ({self.kv_heads_per_rank(tp)} per rank), "
            f"head_dim {self.head_dim}, {self.dtype}"
        )

    def arithmetic(self, tp: int = 1) -> str:
        """How ``kv_bytes_per_token(tp)`` is computed, e.g. ``2 x 32 x 8 x 128 x 2 B``."""
        if self.mla:
            return f"{self.num_layers} x {self.head_dim} x {self.dtype_bytes} B"
        return f"2 x {self.num_layers} x {self.kv_heads_per_rank(tp)} x {self.head_dim} x {self.dtype_bytes} B"

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | str | Path, dtype: str | None = None, *, full_attention_only: bool = False
    ) -> "ModelGeometry":
        """Geometry from an HF ``config.json`` (a path to it or to its directory, or the
        parsed dict). Handles Llama, Mistral, Qwen2/2.5/3 and other GQA decoders, and
        multimodal wrappers that nest the decoder in ``text_config``. ``head_dim``
        defaults to ``hidden_size / num_attention_heads``; ``num_key_value_heads`` to
        ``num_attention_heads`` (plain multi-head attention). ``dtype`` overrides the
        config's ``torch_dtype`` (the KV-cache dtype, e.g. ``fp8``). A config with
        ``kv_lora_rank`` (DeepSeek-V2/V3) is an MLA model: its latent is ``kv_lora_rank +
        qk_rope_head_dim`` elements per token and layer. ``full_attention_only``: count
        only full-attention layers, or refuse (module docstring)."""
        source = "config"
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            source = str(path)
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError:
                raise ConfigError(
                    f"model config: {path} does not exist; expected an HF config.json or the directory holding one"
                ) from None
            except json.JSONDecodeError as exc:
                raise ConfigError(f"model config: {path} is not valid JSON ({exc})") from None
            if not isinstance(config, Mapping):
                raise ConfigError(f"model config: {path} holds a JSON {type(config).__name__}, expected an object")
        raw: Mapping[str, Any] = config
        if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), Mapping):
            raw = raw["text_config"]

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ConfigError(f"{source}: missing {key!r}; cannot size the KV cache")
            return raw[key]

        num_layers = _positive_int(need("num_hidden_layers"), f"{source}: num_hidden_layers")
        others: tuple[tuple[str, int], ...] = ()
        if full_attention_only:
            num_layers, others = _full_attention_layers(raw, num_layers, source)
        model_dtype = dtype or raw.get("torch_dtype") or raw.get("dtype") or config.get("torch_dtype") or "bfloat16"
        # A file's model is named by its directory: its _name_or_path is often a path on
        # the machine that wrote the checkpoint.
        name = path.parent.name if source != "config" else str(config.get("_name_or_path") or "")
        name = name or str(raw.get("model_type") or "")
        if raw.get("kv_lora_rank") is not None:
            rank = _positive_int(raw["kv_lora_rank"], f"{source}: kv_lora_rank")
            rope = _positive_int(need("qk_rope_head_dim"), f"{source}: qk_rope_head_dim")
            return cls(num_layers, 1, rank + rope, str(model_dtype), name, mla=True, other_layers=others)
        num_heads = _positive_int(need("num_attention_heads"), f"{source}: num_attention_heads")
        kv_heads = raw.get("num_key_value_heads")
        kv_heads = num_heads if kv_heads is None else _positive_int(kv_heads, f"{source}: num_key_value_heads")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            hidden = _positive_int(need("hidden_size"), f"{source}: hidden_size")
            if hidden % num_heads:
                raise ConfigError(
                    f"{source}: hidden_size {hidden} is not a multiple of "
                    f"num_attention_heads {num_heads} and head_dim is absent"
                )
            head_dim = hidden // num_heads
        head_dim = _positive_int(head_dim, f"{source}: head_dim")
        return cls(num_layers, kv_heads, head_dim, str(model_dtype), name, other_layers=others)


#: ``layer_types`` entries whose KV grows with the whole prompt (HF's spelling).
FULL_ATTENTION = ("full_attention", "attention", "global_attention")


def _full_attention_layers(
    raw: Mapping[str, Any], num_layers: int, source: str
) -> tuple[int, tuple[tuple[str, int], ...]]:
    """Full-attention layers of an HF config and the others by kind (module docstring);
    raises ``ConfigError`` for a model without a full-attention layer."""
    types = raw.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != num_layers:
            raise ConfigError(f"{source}: layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}")
        full = sum(t in FULL_ATTENTION for t in types)
        counts: dict[str, int] = {}
        for t in types:
            if t not in FULL_ATTENTION:
                counts[str(t)] = counts.get(str(t), 0) + 1
        if full == 0:
            raise ConfigError(
                f"{source}: no full-attention layer (layer_types: {', '.join(sorted(counts))}); its KV does not grow "
                f"with the prompt, so there is no prefix KV for the tiers to size or keep"
            )
        return full, tuple(sorted(counts.items()))
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", True):
        raise ConfigError(
            f"{source}: every layer uses a sliding window of {window} tokens (sliding_window, no layer_types), so "
            f"the KV of a prefix longer than the window is not all kept; the tiers cannot be sized as full attention. "
            f"Give the model's layer_types, or size it with --layers N (its full-attention layers)"
        )
    return num_layers, ()


@dataclass(frozen=True)
class TierPlan:
    """How a model's KV blocks fit the CPU and disk budgets of one TP rank."""

    geometry: ModelGeometry
    tp: int
    block_size: int
    cpu_bytes: int
    disk_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Per rank."""
        return self.geometry.kv_bytes_per_token(self.tp)

    @property
    def block_bytes(self) -> int:
        """One offloaded block on one rank."""
        return self.kv_bytes_per_token * self.block_size

    @property
    def disk_slot_bytes(self) -> int:
        """One disk slot: the block padded to the disk alignment."""
        return -(-self.block_bytes // DISK_ALIGNMENT) * DISK_ALIGNMENT

    @property
    def cpu_blocks(self) -> int:
        return self.cpu_bytes // self.block_bytes

    @property
    def disk_blocks(self) -> int:
        return self.disk_bytes // self.disk_slot_bytes

    @property
    def cpu_tokens(self) -> int:
        return self.cpu_blocks * self.block_size

    @property
    def disk_tokens(self) -> int:
        return self.disk_blocks * self.block_size


def plan_tiers(
    geometry: ModelGeometry,
    *,
    tp: int = 1,
    block_size: int = 16,
    cpu_bytes: int,
    disk_bytes: int = 0,
    gpu_block_size: int = 16,
) -> TierPlan:
    """Check the inputs and size both tiers (``disk_bytes=0``: no disk tier).

    ``block_size`` is the offloaded block in tokens and must be a multiple of the
    engine's ``gpu_block_size``. A tier budget that cannot hold a single block is an
    error, since the tier would be useless.
    """
    _positive_int(block_size, "block_size")
    _positive_int(gpu_block_size, "gpu_block_size")
    if block_size % gpu_block_size:
        raise ConfigError(
            f"block_size: {block_size} tokens is not a multiple of the GPU "
            f"block size {gpu_block_size}; use a multiple such as "
            f"{-(-block_size // gpu_block_size) * gpu_block_size}"
        )
    geometry.kv_heads_per_rank(tp)  # validates tp
    if isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int) or disk_bytes < 0:
        raise ConfigError(f"disk_bytes: expected a byte count >= 0, got {disk_bytes!r}")
    plan = TierPlan(geometry, tp, block_size, _positive_int(cpu_bytes, "cpu_bytes"), disk_bytes)
    if plan.cpu_blocks == 0:
        raise ConfigError(
            f"cpu_bytes: {cpu_bytes} bytes hold no block; one {block_size}-token "
            f"block is {plan.block_bytes} bytes per rank"
        )
    if disk_bytes and plan.disk_blocks == 0:
        raise ConfigError(
            f"disk_bytes: {disk_bytes} bytes hold no block; one disk slot is {plan.disk_slot_bytes} bytes per rank"
        )
    return plan
