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


from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.config_file import ServerConfigFile, read_server_config
from tiered_kv.model_identity import weights_digest
from tiered_kv.ops.server_namespace import ServerDisk, server_disk
from tiered_kv.ops.warmup.errors import WarmupError


def _read(path: str | os.PathLike) -> ServerConfigFile:
    try:
        return read_server_config(path)
    except ConfigError as e:
        raise WarmupError(str(e)) from None


def read_extra_config(path: str | os.PathLike) -> dict[str, Any]:
    """The connector's extra config as the server is given it, from a JSON file holding
    either vLLM's whole ``--kv-transfer-config`` (its ``kv_connector_extra_config`` is
    taken) or that extra config alone: for vLLM's ``TieringOffloadingSpec``, its own keys
    and ``secondary_tiers`` (``load_config`` reads our keys out of it)."""
    return _read(path).given


def check_server_shape(path: str | os.PathLike | ServerConfigFile) -> ServerDisk:
    """The disk tier of the server ``path`` configures (``server_namespace``), or
    ``WarmupError`` naming the file for a spec whose namespace the tools cannot compute:
    the warm-up would write blocks that server never reads."""
    try:
        return server_disk(path)
    except ConfigError as e:
        raise WarmupError(str(e)) from None


def load_config(path: str | os.PathLike | ServerConfigFile) -> TieredConfig:
    """The server's validated config, in our keys, from ``path`` (a file, or one read
    by ``read_server_config``): for ``TieringOffloadingSpec``, its ``TieredDiskTier``
    entry's keys and the chunk size (``config_file``)."""
    found = path if isinstance(path, ServerConfigFile) else _read(path)
    try:
        return found.config()
    except ConfigError as e:
        raise WarmupError(str(e)) from None


@dataclass(frozen=True)
class WarmupServer:
    """The server a warm-up fills, from its config file: which spec writes its disk tier
    (``disk``), our validated keys (``config``) and its extra config as given
    (``extra``), all three with the disk tier at ``--disk-path`` where one is given."""

    disk: ServerDisk
    config: TieredConfig
    extra: dict[str, Any]


def read_server(path: str | os.PathLike, disk_path: str | None = None) -> WarmupServer:
    """Read, and check the shape of, the server config at ``path`` (``check_server_shape``,
    ``load_config``); ``disk_path``: the disk tier's directory instead of the file's.
    Raises ``WarmupError`` naming the file."""
    found = _read(path)
    if found.unmodelled:
        raise WarmupError(
            f"config {path}: {', '.join(found.unmodelled)}: the warm-up computes the namespace of a server "
            f"without {'this setting' if len(found.unmodelled) == 1 else 'these settings'}, so the server "
            f"would read none of its blocks; warm up a server started without it"
        )
    if disk_path:
        found = found.with_disk_path(disk_path)
    disk = check_server_shape(found)
    return WarmupServer(disk, load_config(found), found.given)


@dataclass
class Prompt:
    """One line of the prompts file: token ids, or text to tokenize, and the tenant
    (vLLM's ``cache_salt``) whose requests read its blocks (None: unsalted requests)."""

    line: int
    token_ids: list[int] | None = None
    text: str | None = None
    cache_salt: str | None = None


#: Request fields that change a prompt's KV or its block hashes in vLLM in ways the
#: warm-up does not compute (an adapter, multimodal inputs, embeddings): a line carrying
#: one is refused, not warmed as the plain prompt, which no such request would read.
KV_CHANGING_KEYS = frozenset(
    {"lora_request", "lora_name", "lora_path", "multi_modal_data", "mm_processor_kwargs", "prompt_embeds"}
)


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
    """Prompts from a JSONL file. Each non-empty line is ``{"token_ids": [...]}``
    (or ``prompt_token_ids``), ``{"text": "..."}`` (or ``prompt``), a bare list of token
    ids, or a bare string. An object may name its tenant, ``"cache_salt": "..."`` (a
    non-empty string, as vLLM takes it): only that tenant's requests read its blocks.
    Raises ``WarmupError`` naming the first bad line."""
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
            if changing := sorted(KV_CHANGING_KEYS.intersection(item)):
                raise WarmupError(
                    f"{p}:{n}: {', '.join(changing)}: the warm-up computes a prompt's KV from its tokens alone; a request "
                    f"with {changing[0]} has KV (and block hashes) of its own, which this would not be"
                )
            ids = item.get("token_ids", item.get("prompt_token_ids"))
            text = item.get("text", item.get("prompt"))
            if ids is None and text is None:
                raise WarmupError(f"{p}:{n}: expected a 'token_ids' or 'text' key, got keys {sorted(item)}")
            salt = item.get("cache_salt")
            if salt is not None and not (isinstance(salt, str) and salt):
                raise WarmupError(f"{p}:{n}: cache_salt: expected a non-empty string (the tenant), got {salt!r}")
            item = ids if ids is not None else text
        else:
            salt = None
        if isinstance(item, str):
            out.append(Prompt(n, text=item, cache_salt=salt))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item):
            out.append(Prompt(n, token_ids=item, cache_salt=salt))
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


def check_identity(config: TieredConfig, model_path: str | None, *, where: str = "the config") -> WarmupIdentity:
    """Refuse to warm a namespace a server with ``config`` would not read, or would
    read as another model's: a config without ``model_id``, or a ``model_path`` whose
    weights digest is not that of ``model_path`` (the ``--model`` directory; None skips
    that check). Reads both directories' digests (bounded, ``model_identity``). Raises
    ``WarmupError`` naming the field; ``where``: where the config's keys go, for its fix.

    Without ``model_id`` a vLLM server files its blocks under its ``--model`` exactly as
    typed (a hub id, or a path), which the warm-up cannot know: its own ``--model`` must
    be a directory it loads, often not the string the server is started with. Taking it
    would write blocks that server never reads, so the warm-up refuses instead."""
    if config.model_id == "unknown":
        raise WarmupError(
            "model_id: the config sets none, so a vLLM server files its blocks under its --model as typed "
            "(a hub id or a path), which the warm-up cannot know; "
            f'add "model_id": "<the server\'s --model>" to {where} (the server then uses it too)'
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
