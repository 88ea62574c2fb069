"""The engine's prefill rate and what a model costs to recompute: the load decision's
other side (``tiered_kv.cost``), and the break-even ``tiered-kv config`` and ``doctor``
print.

Runs wherever a hierarchy or a tool is built; reads a model directory's ``config.json``
(``configured_prefill``) and asks torch for the GPU's name, nothing else.

Prefill tokens per second (of linear work) come from the config (``prefill_tokens_per_s``),
else from the model and the GPU (``estimate_prefill_tokens_per_s``): ``2 x parameters``
FLOPs per token at ``ASSUMED_MFU`` of the GPU's dense BF16 peak. Llama-3.1-8B (8.03e9
parameters) on one H100 SXM: 0.5 x 989e12 / (2 x 8.03e9) = 30,800 tokens/s; with its
131,072 KV bytes per token, an idle engine's tier pays above 4.0 GB/s for short prompts
and, with attention, above about 2.6 GB/s for blocks 30k tokens into a prompt.
The engine's measured rate replaces the estimate in ``tiered_kv.cost.LoadCosts``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Assumed model FLOPs utilisation of prefill.
ASSUMED_MFU = 0.5
#: Llama-3.1-8B: one attended token's FLOPs (4 x 32 layers x 4096) over one token's
#: linear FLOPs (2 x 8.03e9): ``attention_per_token`` of its config.
DEFAULT_ATTENTION_PER_TOKEN = 4 * 32 * 4096 / (2 * 8.03e9)
#: Llama-3.1-8B bf16 on one H100 SXM at 50% MFU (see the module docstring).
DEFAULT_PREFILL_TOKENS_PER_S = 30_800.0
#: Dense BF16 tensor TFLOPS by GPU name fragment (vendor datasheets, without sparsity).
GPU_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIE": 756.0,
    "H100": 756.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "A10": 125.0,
    "L4": 121.0,
}


@dataclass(frozen=True)
class PrefillEstimate:
    """Prefill tokens per second and how they were arrived at."""

    tokens_per_s: float
    source: str
    #: Set by the operator (``prefill_tokens_per_s``): kept, never replaced by measurements.
    configured: bool = False
    #: The model's ``attention_per_token`` (the default where its config is unknown).
    attention_per_token: float = DEFAULT_ATTENTION_PER_TOKEN


def model_parameters(hf_config: Mapping) -> int:
    """Parameter count of a decoder-only transformer from its HF ``config.json``
    (embeddings, attention with grouped KV heads, a gated MLP; norms ignored)."""
    try:
        h = int(hf_config["hidden_size"])
        layers = int(hf_config["num_hidden_layers"])
        heads = int(hf_config["num_attention_heads"])
        kv = int(hf_config.get("num_key_value_heads", heads))
        head_dim = int(hf_config.get("head_dim") or h // heads)
        inter = int(hf_config["intermediate_size"])
        vocab = int(hf_config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"model config lacks {exc} (needed: hidden_size, num_hidden_layers, num_attention_heads, "
            "intermediate_size, vocab_size)"
        ) from None
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp = 3 * h * inter
    embed = vocab * h * (1 if hf_config.get("tie_word_embeddings") else 2)
    return layers * (attn + mlp) + embed


def attention_per_token(hf_config: Mapping) -> float:
    """One attended token's FLOPs (``4 x layers x query heads x head dim``: a score and a
    weighted value per head) over one token's linear FLOPs (``2 x model_parameters``)."""
    try:
        heads = int(hf_config["num_attention_heads"])
        head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
        layers = int(hf_config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"model config lacks {exc} (needed: num_attention_heads, num_hidden_layers, hidden_size)")
    return 4 * layers * heads * head_dim / (2 * model_parameters(hf_config))


def prefill_work(tokens: int, context: int, attention_per_token: float) -> float:
    """Linear work (in tokens of ``2 x parameters`` FLOPs) of prefilling ``tokens`` tokens
    after ``context`` tokens: each attends to itself and every token before it."""
    return tokens + attention_per_token * (tokens * context + tokens * (tokens + 1) / 2)


def gpu_bf16_tflops(gpu_name: str) -> float | None:
    """Dense BF16 TFLOPS of ``gpu_name`` (e.g. torch's device name), or None if unknown."""
    name = gpu_name.upper()
    for fragment, tflops in GPU_BF16_TFLOPS.items():
        if fragment.upper() in name:
            return tflops
    return None


def estimate_prefill_tokens_per_s(
    parameters: int | None, gpu_name: str | None, mfu: float = ASSUMED_MFU, gpus: int = 1
) -> PrefillEstimate:
    """``mfu x gpus x peak / (2 x parameters)`` (a tensor-parallel group of ``gpus``), or
    the Llama-3.1-8B-on-H100 default (saying why) where the model or the GPU is unknown."""
    tflops = gpu_bf16_tflops(gpu_name) if gpu_name else None
    if parameters and tflops:
        tps = mfu * gpus * tflops * 1e12 / (2 * parameters)
        group = f"{gpus} x " if gpus > 1 else ""
        return PrefillEstimate(
            tps,
            f"{mfu:.0%} MFU x {group}{tflops:g} TFLOPS dense BF16 ({gpu_name}) / "
            f"(2 x {parameters / 1e9:.2f}e9 FLOP/token)",
        )
    missing = " and ".join(
        w for w, ok in (("the model's parameters", parameters), (f"the GPU ({gpu_name or 'none'})", tflops)) if not ok
    )
    return PrefillEstimate(
        DEFAULT_PREFILL_TOKENS_PER_S,
        f"default for Llama-3.1-8B on one H100 SXM ({missing} unknown): "
        f"{ASSUMED_MFU:.0%} MFU x 989 TFLOPS / (2 x 8.03e9 FLOP/token)",
    )


def configured_prefill(prefill_tokens_per_s: float | None, model_path: str | None, gpus: int = 1) -> PrefillEstimate:
    """The decision's prefill rate: the configured ``prefill_tokens_per_s``, else the estimate from the
    model directory's ``config.json`` (where readable) and ``gpus`` of this machine's GPU (the TP group);
    with the model's ``attention_per_token`` where its config is readable, else the default."""
    parameters, attention = None, DEFAULT_ATTENTION_PER_TOKEN
    if model_path:
        try:
            with open(Path(model_path) / "config.json", encoding="utf-8") as f:
                hf_config = json.load(f)
            parameters, attention = model_parameters(hf_config), attention_per_token(hf_config)
        except (OSError, ValueError, AttributeError):
            parameters = None
    if prefill_tokens_per_s:
        return PrefillEstimate(prefill_tokens_per_s, "configured (prefill_tokens_per_s)", True, attention)
    estimate = estimate_prefill_tokens_per_s(parameters, local_gpu_name(), gpus=gpus)
    return PrefillEstimate(estimate.tokens_per_s, estimate.source, False, attention)


def local_gpu_name() -> str | None:
    try:  # this machine's first CUDA device's name
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # no usable CUDA (or no torch): the estimate's default
        return None


@dataclass(frozen=True)
class BreakEven:
    """Load GB/s at which a token loads as fast as it is recomputed (``LoadCosts``): one rank's KV
    bytes per token x the TP group's prefill tokens/s; ``tp`` times that per node (ranks load at once)."""

    kv_bytes_per_token: int
    tp: int
    prefill: PrefillEstimate

    @property
    def rank_gbps(self) -> float:
        return self.kv_bytes_per_token * self.prefill.tokens_per_s / 1e9

    @property
    def node_gbps(self) -> float:
        return self.tp * self.rank_gbps


def break_even(kv_bytes: int, tp: int, tps: float | None, params: int | None, gpu: str | None, given: str) -> BreakEven:
    """``tiered-kv config``'s and ``doctor``'s: one rank's ``kv_bytes`` per token x ``tps`` (``given`` says
    whence), else x the estimate for ``tp`` GPUs ``gpu`` running a model of ``params`` parameters."""
    prefill = PrefillEstimate(tps, given, True) if tps else estimate_prefill_tokens_per_s(params, gpu, gpus=tp)
    return BreakEven(kv_bytes, tp, prefill)
