"""Built-in model geometries for ``tiered-kv config --preset``: common models whose KV size
an operator wants without downloading a ``config.json``.

Pure data and lookup; no I/O. Each preset holds the KV-relevant fields of the model's
published Hugging Face ``config.json`` and is parsed by ``ModelGeometry.from_hf_config``,
exactly as a local ``config.json`` is, so the two paths cannot disagree. ``model`` is the
hub id that ``vllm serve`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.config import ConfigError
from tiered_kv.ops.sizing import ModelGeometry


@dataclass(frozen=True)
class Preset:
    """A model by short ``name`` (``llama-3.1-8b``), its hub id ``model``, and the fields of
    its ``config.json`` that size the KV cache."""

    name: str
    model: str
    hf_config: dict[str, Any]

    @property
    def geometry(self) -> ModelGeometry:
        return ModelGeometry.from_hf_config({**self.hf_config, "_name_or_path": self.model})


def _gqa(
    layers: int, heads: int, kv_heads: int, hidden: int, model_type: str, intermediate: int, vocab: int
) -> dict[str, Any]:
    """A dense model's fields; ``intermediate_size`` and ``vocab_size`` count its parameters
    for the prefill estimate (``tiered_kv.prefill.model_parameters``)."""
    return {
        "model_type": model_type,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
    }


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", _gqa(32, 32, 8, 4096, "llama", 14336, 128256)),
        Preset("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", _gqa(80, 64, 8, 8192, "llama", 28672, 128256)),
        Preset(
            "llama-3.1-405b", "meta-llama/Llama-3.1-405B-Instruct", _gqa(126, 128, 8, 16384, "llama", 53248, 128256)
        ),
        Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", _gqa(28, 28, 4, 3584, "qwen2", 18944, 152064)),
        Preset("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", _gqa(80, 64, 8, 8192, "qwen2", 29568, 152064)),
        Preset(
            "mistral-7b",
            "mistralai/Mistral-7B-Instruct-v0.3",
            {**_gqa(32, 32, 8, 4096, "mistral", 14336, 32768), "head_dim": 128},
        ),
        # Multi-head latent attention: the cache holds kv_lora_rank + qk_rope_head_dim = 576
        # elements per token and layer, whatever the 128 attention heads.
        Preset(
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3",
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 61,
                "num_attention_heads": 128,
                "num_key_value_heads": 128,
                "hidden_size": 7168,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128,
                "v_head_dim": 128,
                "torch_dtype": "bfloat16",
            },
        ),
    )
}


def find_preset(name: str) -> Preset:
    """The preset called ``name`` (its short name or hub id, any case). Raises
    ``ConfigError`` listing the presets otherwise."""
    key = name.strip().lower()
    for preset in PRESETS.values():
        if key in (preset.name, preset.model.lower()):
            return preset
    raise ConfigError(
        f"--preset: no preset {name!r}; expected one of {', '.join(PRESETS)} "
        f"(or pass --model-config PATH for any other model)"
    )


def preset_source(preset: str | None, model_config: Path | None) -> tuple[Any, str | None]:
    """What ``tiered-kv config`` reads the geometry from (a preset's config dict, or the
    ``--model-config`` path, or None for the manual options) and the model ``vllm serve``
    should be given (the hub id, or the local model directory), if known."""
    if preset is None:
        if model_config is None:
            return None, None
        directory = model_config.parent if model_config.name == "config.json" else model_config
        return model_config, str(directory)
    if model_config is not None:
        raise ConfigError("--preset: give either --preset or --model-config, not both")
    found = find_preset(preset)
    return {**found.hf_config, "_name_or_path": found.model}, found.model
