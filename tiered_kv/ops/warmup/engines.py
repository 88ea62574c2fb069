"""The warm-up's KV engines: ``HFEngine`` (transformers, CPU or GPU) and vLLM's offline
``LLM`` with this project's connector (``run_vllm_warmup``, CUDA only).

Runs in the operator's process (``tiered-kv warmup``). Reads the model's files; the
vLLM engine stores blocks through the connector exactly as the server would (its own
workers write the disk tier); ``HFEngine`` only computes K/V (no file writes).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tiered_kv.config_file import is_tiering
from tiered_kv.model_identity import resolve_model_dir
from tiered_kv.ops.sizing import ModelGeometry
from tiered_kv.ops.warmup.errors import WarmupError


def import_transformers() -> Any:
    """The ``transformers`` module, or ``WarmupError`` saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise WarmupError(f"the hf engine needs transformers ({e}); pip install 'tiered-kv[warmup]'") from None


def _layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value) of a transformers cache, across its API generations."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


class HFEngine:
    """A transformers causal LM computing prompts' K/V (post-RoPE keys, as attention
    caches them). ``kv(token_ids)`` returns per layer ``(K, V)``, each
    ``(num_kv_heads, len(token_ids), head_dim)`` on the CPU, in the model's dtype."""

    def __init__(self, model: torch.nn.Module, device: str | torch.device | None = None, model_path: str | None = None):
        self.model = model.eval()
        #: The directory the weights were loaded from (None: unknown, not checked).
        self.model_path = model_path
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config: Any = model.config  # a transformers PretrainedConfig
        self.vocab_size = int(config.vocab_size)
        self.geometry = ModelGeometry.from_hf_config(config.to_dict(), dtype=str(self.dtype).removeprefix("torch."))

    @classmethod
    def from_pretrained(cls, model: str, dtype: str = "auto", device: str = "auto") -> "HFEngine":
        """Load ``model`` (a local directory or a hub id available offline) with
        ``dtype`` (``auto`` = the checkpoint's) on ``device`` (``auto``, ``cpu``, ``cuda``)."""
        transformers = import_transformers()
        transformers.utils.logging.disable_progress_bar()
        dev = torch.device(
            "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        )
        torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype, None)
        if torch_dtype is None or (dtype != "auto" and not isinstance(torch_dtype, torch.dtype)):
            raise WarmupError(f"--dtype: expected auto, float32, float16 or bfloat16, got {dtype!r}")
        try:
            m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        except OSError as e:
            raise WarmupError(f"cannot load model {model!r}: {e}".splitlines()[0]) from None
        found = resolve_model_dir(model)
        return cls(m.to(dev), dev, model_path=None if found is None else str(found))

    def kv(self, token_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            cache = self.model(input_ids=ids, use_cache=True).past_key_values
        out = []
        for i, (k, v) in enumerate(_layer_kv(cache)):
            if k.shape[2] != len(token_ids):
                raise WarmupError(
                    f"layer {i} cached {k.shape[2]} of {len(token_ids)} positions (sliding-window "
                    f"attention?); the hf engine needs full attention in every layer"
                )
            out.append((k[0].to("cpu"), v[0].to("cpu")))
        return out


def require_vllm_engine() -> None:
    """Raise ``WarmupError`` unless a CUDA device is visible and vLLM imports."""
    if not torch.cuda.is_available():
        raise WarmupError(
            "the vllm engine needs CUDA + vLLM: no CUDA device is visible here (use --engine hf on this machine)"
        )
    try:
        importlib.import_module("vllm")
    except Exception as e:
        raise WarmupError(f"the vllm engine needs CUDA + vLLM: cannot import vLLM ({e})") from None


def run_vllm_warmup(
    prompts: Sequence[Sequence[int]],
    model: str,
    extra_config: Mapping[str, Any],
    *,
    gpu_block_size: int = 16,
    tp_size: int = 1,
    attention_backend: str | None = None,
    cache_salts: Sequence[str | None] | None = None,
) -> int:
    """Prefill ``prompts`` (each of the tenant ``cache_salts[i]``, where given) with vLLM's offline ``LLM`` and the server's spec configured by
    ``extra_config`` (the server's extra config as given, its store path: ours forced to
    write-through so every block reaches the disk; vLLM's ``TieringOffloadingSpec``
    already copies every chunk to each secondary tier) on the server's
    ``--attention-backend`` (None: vLLM's choice), then shut the engine down.
    Returns the number of prompts run. Raises ``WarmupError`` unless CUDA and vLLM are
    usable here."""
    require_vllm_engine()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = dict(extra_config) if is_tiering(extra_config) else {**extra_config, "write_policy": "write_through"}
    llm = LLM(
        model=model,
        block_size=gpu_block_size,
        tensor_parallel_size=tp_size,
        enable_prefix_caching=True,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
        # The backend is part of the namespace: the engine must run the server's.
        attention_config=None if attention_backend is None else {"backend": attention_backend.strip().upper()},
    )
    try:
        salts = cache_salts or [None] * len(prompts)
        inputs = [
            TokensPrompt(prompt_token_ids=list(t), cache_salt=s) if s else TokensPrompt(prompt_token_ids=list(t))
            for t, s in zip(prompts, salts)
        ]
        llm.generate(inputs, SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return len(prompts)
