"""What an operator gives a warm-up: the server's config, the prompts, and the model
whose identity the blocks are filed under.

Runs in the operator's process (``tiered-kv warmup``). Reads the config and prompt
files, and where the config names a ``model_path``, that directory's weights to digest
them (``tiered_kv.model_identity``); writes nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig
from tiered_kv.model_identity import read_config_file, weights_digest
from tiered_kv.ops.warmup.errors import WarmupError
from tiered_kv.ops.server_namespace import server_disk


def read_extra_config(path: str | os.PathLike) -> dict[str, Any]:
    """The connector's extra config from a JSON file holding either vLLM's whole
    ``--kv-transfer-config`` (its ``kv_connector_extra_config`` is taken) or that
    extra config alone."""
    try:
        return read_config_file(path)
    except ConfigError as e:
        raise WarmupError(str(e)) from None


def check_server_shape(path: str | os.PathLike) -> None:
    """Refuse a config whose server reads a namespace the warm-up does not write: a
    spec the tools cannot compute (``server_namespace``), or vLLM's
    ``TieringOffloadingSpec`` with ``TieredDiskTier``, whose blocks are whole CPU-tier
    rows laid out by vLLM's CPU tier (every TP rank's shard and the row's padding) in a
    namespace of their own. Raises ``WarmupError`` naming the file."""
    try:
        disk = server_disk(path)
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    if disk.is_secondary_tier:
        raise WarmupError(
            f"config {path}: {disk.describe}: not supported by the warm-up, which writes "
            "TieredOffloadingSpec's namespace; that tier reads whole CPU-tier rows in a namespace of its own. "
            "Warm that server by sending it the prompts, or serve with TieredOffloadingSpec "
            "(configs/llama-3.1-8b-1xh100.json)"
        )


def load_config(path: str | os.PathLike) -> TieredConfig:
    """The server's validated config from ``path`` (see ``read_extra_config``)."""
    try:
        return TieredConfig.from_dict(read_extra_config(path), passthrough_keys=VLLM_PASSTHROUGH_KEYS)
    except ConfigError as e:
        raise WarmupError(f"config {path}: {e}") from None


@dataclass
class Prompt:
    """One line of the prompts file: token ids, or text to tokenize."""

    line: int
    token_ids: list[int] | None = None
    text: str | None = None


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
    """Prompts from a JSONL file. Each non-empty line is ``{"token_ids": [...]}``
    (or ``prompt_token_ids``), ``{"text": "..."}`` (or ``prompt``), a bare list of token
    ids, or a bare string. Raises ``WarmupError`` naming the first bad line."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise WarmupError(f"prompts file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WarmupError(f"cannot read prompts file {p}: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise WarmupError(f"{p}:{n}: not JSON ({e})") from None
        if isinstance(item, Mapping):
            ids = item.get("token_ids", item.get("prompt_token_ids"))
            text = item.get("text", item.get("prompt"))
            if ids is None and text is None:
                raise WarmupError(f"{p}:{n}: expected a 'token_ids' or 'text' key, got keys {sorted(item)}")
            item = ids if ids is not None else text
        if isinstance(item, str):
            out.append(Prompt(n, text=item))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item):
            out.append(Prompt(n, token_ids=item))
        else:
            raise WarmupError(f"{p}:{n}: expected token ids (a list of non-negative integers) or text")
    return out


def tokenize(prompts: Sequence[Prompt], tokenizer: Any | None) -> list[list[int]]:
    """Token ids of every prompt; text goes through ``tokenizer`` (an HF tokenizer,
    special tokens added as vLLM does for a plain prompt)."""
    out = []
    for pr in prompts:
        if pr.token_ids is not None:
            out.append(pr.token_ids)
        elif tokenizer is None:
            raise WarmupError(
                f"prompt on line {pr.line} is text; pass --tokenizer DIR (a local tokenizer) or give token_ids"
            )
        else:
            out.append(list(tokenizer(pr.text)["input_ids"]))
    return out


@dataclass(frozen=True)
class WarmupIdentity:
    """Which model the warmed blocks are filed under: the config's ``model_id`` and
    ``model_revision``, and ``weights_digest``, the digest of the config's
    ``model_path`` (None: the config names none, so the namespace does not cover the
    weights). ``model_digest``: the digest of the model warmed (None: unknown)."""

    model_id: str
    model_revision: str
    weights_digest: str | None
    model_digest: str | None


def check_identity(config: TieredConfig, model_path: str | None) -> WarmupIdentity:
    """Refuse to warm a namespace a server with ``config`` would not read, or would
    read as another model's: a config without ``model_id``, or a ``model_path`` whose
    weights digest is not that of ``model_path`` (the ``--model`` directory; None skips
    that check). Reads both directories' digests (bounded, ``model_identity``). Raises
    ``WarmupError`` naming the field."""
    if config.model_id == "unknown":
        raise WarmupError(
            'model_id: the config sets none, so the blocks would be filed under "unknown", '
            "a name no vLLM server reads (it uses its --model) and every model of this geometry "
            'shares; add "model_id": "<model>" to the config (vLLM\'s --model is the usual value)'
        )
    try:
        server = weights_digest(config.model_path).digest if config.model_path else None
        mine = weights_digest(model_path, key="--model").digest if model_path else None
    except ConfigError as e:
        raise WarmupError(str(e)) from None
    if server is not None and mine is not None and server != mine:
        raise WarmupError(
            f"weights_digest: the config's model_path {config.model_path!r} has weights digest "
            f"{server} but --model {model_path!r} has {mine}, so a server with this config would "
            f"not read these blocks; warm up with the model the config names, or fix model_path"
        )
    return WarmupIdentity(config.model_id, config.model_revision, server, mine)
