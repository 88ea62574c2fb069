"""``tiered-kv config``: size the tiers for a model and print vLLM's kv-transfer-config.

Reads one HF ``config.json`` when ``--model-config`` is given, and writes the JSON to
``--output`` when asked. Where ``--model-config`` names a model directory with weight
files, it also reads that directory's weights digest (``tiered_kv.model_identity``: a
bounded sample of each file) and records the directory as ``model_path``. The printed
JSON is what ``vllm serve --kv-transfer-config`` takes; its ``kv_connector_extra_config``
is validated with ``TieredConfig.from_dict`` before it is printed, so every key is one
the spec accepts. ``model_id`` is ``--model-id``, else the preset's hub id, else the
hub id of a model directory in the Hugging Face cache, else the model directory's own
name (never the config's ``_name_or_path``, often a path on the machine that trained
it), never a silent "unknown"; with a disk tier the table ends with the identity the
namespace records and its id. The printed ``vllm serve`` line runs as printed: the
model's path or hub id, and the KV-cache dtype the sizing assumed.

A vLLM server's namespace also names its attention backend and KV-cache layout (no config
key sets them): printed per ``--attention-backend`` (one also goes on the ``vllm serve``
line), else for ``offline_attention_backend``'s default, where vLLM is installed.

A shared tier (``--remote-bucket``) is written only with the fleet key's place
(``--remote-key-file`` or ``--remote-key-env``) or ``--trusted-bucket``, as the server
starts only with one (``config_remote``); the key named is read there once, to warn
where it cannot be loaded on this host, and never goes in the output.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from tiered_kv.cli import app
from tiered_kv.cli.config_remote import _key_warnings, _remote
from tiered_kv.cli.output import fail
from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig, format_size, parse_size
from tiered_kv.config_file import CONNECTOR, SPEC_MODULE, TIERED_SPEC
from tiered_kv.ops.doctor import tier_size_warnings
from tiered_kv.ops.presets import PRESETS, preset_source
from tiered_kv.ops.sizing import ModelGeometry, TierPlan, dtype_bytes, plan_tiers

#: The CPU tier's size when --cpu-bytes is not given: TieredConfig's own default, so a
#: config that leaves cpu_bytes out and one printed here size the tier alike.
DEFAULT_CPU_BYTES = format_size(TieredConfig.cpu_bytes).replace(".00 ", "").replace(" ", "")


def _size_value(text: str, key: str) -> int | str:
    """Keep the user's spelling ("64GiB") in the config once it parses; bare numbers as ints."""
    parse_size(text, key)
    stripped = text.strip()
    return int(stripped) if stripped.isdigit() else stripped


def build_kv_transfer_config(
    plan: TierPlan,
    *,
    cpu_bytes: str,
    disk_path: Optional[str],
    disk_bytes: Optional[str],
    model_id: str,
    remote: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """vLLM's kv-transfer-config dict for ``plan``; raises ``ConfigError`` if the
    extra config is not one ``TieredConfig`` accepts."""
    extra: dict[str, Any] = {
        "spec_name": TIERED_SPEC,
        "spec_module_path": SPEC_MODULE,
        "cpu_bytes": _size_value(cpu_bytes, "cpu_bytes"),
    }
    if disk_path:
        extra["disk_path"] = disk_path
        extra["disk_bytes"] = _size_value(disk_bytes or "", "disk_bytes")
    extra["block_size"] = plan.block_size
    extra["model_id"] = model_id
    if remote:
        extra["remote"] = remote
    TieredConfig.from_dict(extra, passthrough_keys=VLLM_PASSTHROUGH_KEYS)
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def arithmetic_table(plan: TierPlan) -> Table:
    """The sizing arithmetic, one row per step, per TP rank unless marked."""
    g, tp = plan.geometry, plan.tp
    table = Table(title=f"KV sizing: {g.name or 'model'} (TP={tp})", show_header=True)
    table.add_column("quantity")
    table.add_column("arithmetic")
    table.add_column("value", justify="right")
    table.add_row("geometry", g.describe(tp), "")
    table.add_row("KV bytes / token / rank", g.arithmetic(tp), f"{plan.kv_bytes_per_token:,} B")
    table.add_row(
        "block / rank",
        f"{plan.block_size} tokens x {plan.kv_bytes_per_token:,} B",
        f"{plan.block_bytes:,} B ({format_size(plan.block_bytes)})",
    )
    table.add_row(
        "CPU tier / rank",
        f"{plan.cpu_bytes:,} B / {plan.block_bytes:,} B",
        f"{plan.cpu_blocks:,} blocks = {plan.cpu_tokens:,} tokens",
    )
    table.add_row("CPU tier RAM / node", f"TP {tp} x {format_size(plan.cpu_bytes)}", format_size(tp * plan.cpu_bytes))
    if plan.disk_bytes:
        table.add_row("disk slot / rank", f"{plan.block_bytes:,} B rounded up to 4 KiB", f"{plan.disk_slot_bytes:,} B")
        table.add_row(
            "disk tier / rank",
            f"{plan.disk_bytes:,} B / {plan.disk_slot_bytes:,} B",
            f"{plan.disk_blocks:,} blocks = {plan.disk_tokens:,} tokens",
        )
        table.add_row("disk / node", f"TP {tp} x {format_size(plan.disk_bytes)}", format_size(tp * plan.disk_bytes))
    return table


@app.command("config")
def config(
    model_config: Optional[Path] = typer.Option(
        None,
        "--model-config",
        metavar="PATH",
        help="The model's directory (or its config.json) to read the geometry from; vllm serve is given it.",
    ),
    preset: Optional[str] = typer.Option(
        None, "--preset", metavar="NAME", help=f"A built-in model geometry: {', '.join(PRESETS)}."
    ),
    layers: Optional[int] = typer.Option(
        None, "--layers", min=1, metavar="N", help="Full-attention decoder layers (without --model-config)."
    ),
    kv_heads: Optional[int] = typer.Option(
        None, "--kv-heads", min=1, metavar="N", help="KV heads of the whole model (without --model-config)."
    ),
    head_dim: Optional[int] = typer.Option(
        None, "--head-dim", min=1, metavar="N", help="Head dimension (without --model-config)."
    ),
    dtype: Optional[str] = typer.Option(
        None,
        "--dtype",
        metavar="DTYPE",
        help="KV-cache dtype: bfloat16, float16, float32, fp8, fp8_e4m3 or fp8_e5m2 (the vllm serve line "
        "gets --kv-cache-dtype or --dtype to match). Default: the model's, else bfloat16.",
    ),
    tp: int = typer.Option(1, "--tp", min=1, metavar="N", help="Tensor-parallel size."),
    cpu_bytes: str = typer.Option(
        DEFAULT_CPU_BYTES, "--cpu-bytes", metavar="SIZE", help="CPU tier budget per TP rank, e.g. 64GiB."
    ),
    disk_bytes: Optional[str] = typer.Option(
        None, "--disk-bytes", metavar="SIZE", help="Disk tier budget per TP rank, e.g. 1TiB (needs --disk-path)."
    ),
    disk_path: Optional[str] = typer.Option(
        None, "--disk-path", metavar="PATH", help="Disk tier directory on local NVMe; omit for no disk tier."
    ),
    block_size: int = typer.Option(
        16, "--block-size", min=1, metavar="N", help="Offloaded block size in tokens (a multiple of --gpu-block-size)."
    ),
    gpu_block_size: int = typer.Option(
        16, "--gpu-block-size", min=1, metavar="N", help="vLLM's --block-size (tokens per GPU block)."
    ),
    model_id: Optional[str] = typer.Option(
        None,
        "--model-id",
        metavar="ID",
        help="Model id recorded in the disk-cache fingerprint. Default: the preset's or HF cache's hub id, "
        "else the model directory's name.",
    ),
    remote_endpoint: Optional[str] = typer.Option(
        None, "--remote-endpoint", metavar="URL", help="Shared tier: the S3 endpoint (omit for AWS S3)."
    ),
    remote_bucket: Optional[str] = typer.Option(
        None, "--remote-bucket", metavar="NAME", help="Shared tier: the bucket (adds a shared S3 tier)."
    ),
    remote_prefix: Optional[str] = typer.Option(
        None, "--remote-prefix", metavar="PREFIX", help="Shared tier: the key prefix (default: tiered-kv)."
    ),
    remote_region: Optional[str] = typer.Option(
        None, "--remote-region", metavar="REGION", help="Shared tier: the bucket's region (default: us-east-1)."
    ),
    remote_key_file: Optional[str] = typer.Option(
        None,
        "--remote-key-file",
        metavar="PATH",
        help="Shared tier: the file on the server holding the fleet key (remote.key_file; make one with "
        "openssl rand -hex 32). The key itself never goes in the config.",
    ),
    remote_key_env: Optional[str] = typer.Option(
        None,
        "--remote-key-env",
        metavar="NAME",
        help="Shared tier: the server's environment variable holding the fleet key (remote.key_env).",
    ),
    trusted_bucket: bool = typer.Option(
        False,
        "--trusted-bucket",
        help="Shared tier: no key; blocks stored unencrypted and unauthenticated, for a bucket only trusted "
        "writers can reach (remote.trusted_bucket).",
    ),
    gpu: Optional[str] = typer.Option(
        None,
        "--gpu",
        metavar="NAME",
        help="GPU model for the prefill estimate, e.g. 'H100 SXM'. Default: this machine's GPU.",
    ),
    model_params: Optional[float] = typer.Option(
        None,
        "--model-params",
        metavar="N",
        help="Model parameters for the prefill estimate, e.g. 8.03e9. Default: from config.",
    ),
    prefill_tokens_per_s: Optional[float] = typer.Option(
        None,
        "--prefill-tokens-per-s",
        metavar="N",
        help="Measured prefill tokens/s (per TP group): recorded in the config.",
    ),
    attention_backends: Optional[list[str]] = typer.Option(
        None,
        "--attention-backend",
        metavar="NAME",
        help="vLLM's attention backend on the server (vllm serve --attention-backend), e.g. FLASH_ATTN or "
        "CPU_ATTN: part of the vLLM namespace printed. Repeat it to print the namespace of each. Default: "
        "vLLM's choice on this host, else FLASH_ATTN.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print only the JSON."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", metavar="PATH", help="Also write the JSON to this file."
    ),
) -> None:
    """Size the CPU and disk tiers for a model and print the --kv-transfer-config JSON.

    Hybrid models (sliding-window or linear-attention layers beside full attention) are
    sized by their full-attention layers; a model with none is refused with the reason."""
    console = Console()
    try:
        source, serve_model = preset_source(preset, model_config)
        plan, model_name = _plan(
            source, layers, kv_heads, head_dim, dtype, tp, cpu_bytes, disk_bytes, disk_path, block_size, gpu_block_size
        )
        remote = _remote(
            remote_endpoint,
            remote_bucket,
            remote_prefix,
            remote_region,
            remote_key_file,
            remote_key_env,
            trusted_bucket,
        )
        kv_config = build_kv_transfer_config(
            plan,
            cpu_bytes=cpu_bytes,
            disk_path=disk_path,
            disk_bytes=disk_bytes,
            model_id=_model_id(model_id, preset, source, serve_model),
            remote=remote,
        )
        if prefill_tokens_per_s is not None:
            kv_config["kv_connector_extra_config"]["prefill_tokens_per_s"] = prefill_tokens_per_s
            TieredConfig.from_dict(kv_config["kv_connector_extra_config"], passthrough_keys=VLLM_PASSTHROUGH_KEYS)
        identity = _add_model_path(kv_config, source)
        serve_flags = _serve_dtype_flags(dtype, source)
        backends = [_backend_name(b) for b in attention_backends or ()]
        if len(backends) == 1:
            serve_flags += f" --attention-backend {backends[0]}"
    except ConfigError as exc:
        fail(str(exc), as_json)
    warnings = list(tier_size_warnings(plan.cpu_bytes, plan.disk_bytes, disk_path, tp))
    warnings += _key_warnings(remote)
    if not disk_path:
        warnings.append(
            "no disk tier (no --disk-path): blocks evicted from the CPU tier are gone and nothing outlives a "
            "restart; add --disk-path DIR --disk-bytes SIZE on local NVMe (tiered-kv doctor checks it)"
        )
    if plan.geometry.other_layers:
        others = ", ".join(f"{n} {kind}" for kind, n in plan.geometry.other_layers)
        warnings.append(f"sized by the model's {plan.geometry.num_layers} full-attention layers; not counted: {others}")
    for warning in warnings:
        typer.echo(f"warning: {' '.join(warning.split())}", err=True)
    text = json.dumps(kv_config, indent=2)
    if output is not None:
        try:
            output.write_text(text + "\n")
        except OSError as e:
            fail(f"--output {output}: {e.strerror or e}", as_json)
    if as_json:
        sys.stdout.write(text + "\n")
        return
    console.print(arithmetic_table(plan))
    console.print(cost_table(plan, source, gpu, model_params, prefill_tokens_per_s))
    console.print_json(text)
    serve_model = serve_model or kv_config["kv_connector_extra_config"].get("model_id") or "<model>"
    console.print(
        f"vllm serve {serve_model} --tensor-parallel-size {tp} --block-size {gpu_block_size}{serve_flags} "
        f"--kv-transfer-config '{json.dumps(kv_config)}'",
        highlight=False,
        soft_wrap=True,
    )
    if disk_path:
        _print_identity(console, kv_config, identity, plan, gpu_block_size, backends)


def cost_table(
    plan: TierPlan, source: Any, gpu: Optional[str], params: Optional[float], given_tps: Optional[float]
) -> Table:
    """Prefill tokens/s (given, else estimated with its formula) and the break-even load
    bandwidth per rank: what the load-versus-recompute decision starts from."""
    from tiered_kv.prefill import break_even, local_gpu_name, model_parameters

    if params is None:
        try:
            params = model_parameters(_hf_dict(source))
        except (OSError, ValueError):
            params = None
    given = "given (--prefill-tokens-per-s): recorded as prefill_tokens_per_s"
    even = break_even(
        plan.kv_bytes_per_token, plan.tp, given_tps, int(params) if params else None, gpu or local_gpu_name(), given
    )
    tps = even.prefill.tokens_per_s
    table = Table(title="Load versus recompute (tiered_kv.cost)", show_header=True)
    table.add_column("quantity")
    table.add_column("arithmetic")
    table.add_column("value", justify="right")
    table.add_row(
        "prefill tokens / s", given if given_tps is not None else f"estimated: {even.prefill.source}", f"{tps:,.0f}"
    )
    table.add_row(
        "measured prefill tokens / s",
        "under vLLM with TieredOffloadingConnector: fitted on the engine's own prefill steps",
        "reported beside it" if given_tps is not None else "replaces the estimate",
    )
    table.add_row(
        "break-even load GB/s / rank",
        f"{plan.kv_bytes_per_token:,} B/token x {tps:,.0f} tokens/s",
        f"{even.rank_gbps:.2f}",
    )
    if plan.tp > 1:
        table.add_row("break-even load GB/s / node", f"TP {plan.tp} x {even.rank_gbps:.2f}", f"{even.node_gbps:.2f}")
    table.add_row("decision", "per request: load the prefix that minimises load time + prefill of the rest", "on")
    return table


def _hf_dict(source: Any) -> dict:
    if isinstance(source, dict):
        return source
    if source is None:
        raise ValueError("no model config")
    path = Path(source)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def _plan(
    model_config: Optional[Path],
    layers: Optional[int],
    kv_heads: Optional[int],
    head_dim: Optional[int],
    dtype: Optional[str],
    tp: int,
    cpu_bytes: str,
    disk_bytes: Optional[str],
    disk_path: Optional[str],
    block_size: int,
    gpu_block_size: int,
) -> tuple[TierPlan, str]:
    manual = {"--layers": layers, "--kv-heads": kv_heads, "--head-dim": head_dim}
    if model_config is not None:
        given = [k for k, v in manual.items() if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: give either --model-config or the geometry options, not both")
        geometry = ModelGeometry.from_hf_config(model_config, dtype=dtype, full_attention_only=True)
    else:
        missing = [k for k, v in manual.items() if v is None]
        if missing or layers is None or kv_heads is None or head_dim is None:
            raise ConfigError(f"{', '.join(missing)}: required without --model-config (or pass --model-config PATH)")
        geometry = ModelGeometry(layers, kv_heads, head_dim, dtype or "bfloat16")
    if disk_bytes is not None and not disk_path:
        raise ConfigError("--disk-bytes: needs --disk-path (where the disk tier lives)")
    if disk_path and disk_bytes is None:
        raise ConfigError("--disk-path: needs --disk-bytes (the disk tier budget per rank)")
    plan = plan_tiers(
        geometry,
        tp=tp,
        block_size=block_size,
        gpu_block_size=gpu_block_size,
        cpu_bytes=parse_size(cpu_bytes, "--cpu-bytes"),
        disk_bytes=parse_size(disk_bytes, "--disk-bytes") if disk_bytes else 0,
    )
    return plan, geometry.name


# ---------------------------------------------------------------- identity


def _model_id(given: Optional[str], preset: Optional[str], source: Any, directory: Optional[str]) -> str:
    """The model id the config records: ``--model-id``, else the preset's hub id, else
    the hub id of a model directory in the Hugging Face cache
    (``models--<org>--<name>/snapshots/<commit>``), else the model directory's own name.
    A config's ``_name_or_path`` is never used: it is often a path on the machine that
    wrote the checkpoint. Never a silent "unknown"."""
    if given:
        return given
    if preset is not None and directory:
        return directory  # the preset's hub id
    if directory:
        path = Path(directory).absolute()
        if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
            return path.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
        return path.name
    raise ConfigError(
        "--model-id: required without --model-config or --preset: the disk cache namespace "
        "records which model its blocks belong to (vLLM's --model is the usual value)"
    )


#: ``--dtype`` spellings that are vLLM's ``--kv-cache-dtype`` values (an fp8 cache under a
#: model of another dtype), and those that are its ``--dtype`` (model and cache alike).
_KV_CACHE_DTYPES = {
    "fp8": "fp8",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
    "fp8_inc": "fp8_inc",
}
_MODEL_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


def _model_dtype(source: Any) -> Optional[str]:
    """The model's own ``torch_dtype`` (a preset's dict, or a config.json path), if any."""
    if isinstance(source, dict):
        return source.get("torch_dtype")
    if source is None:
        return None
    try:
        path = Path(source)
        raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        return raw.get("torch_dtype") or raw.get("dtype") or (raw.get("text_config") or {}).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return None


def _serve_dtype_flags(dtype: Optional[str], source: Any) -> str:
    """What the ``vllm serve`` line needs so its KV cache has the dtype the sizing
    assumed: ``--kv-cache-dtype`` for fp8, ``--dtype`` where vLLM's own choice would
    differ (another dtype than the model's, or a float32 model, which vLLM's ``--dtype
    auto`` downcasts to a 16-bit dtype)."""
    own = _model_dtype(source)
    own = _MODEL_DTYPES.get(str(own).lower()) if own is not None else None
    if dtype is None:
        return " --dtype float32" if own == "float32" else ""
    key = dtype.strip().lower().removeprefix("torch.")
    dtype_bytes(key)  # an unknown dtype is refused with the list
    if key in _KV_CACHE_DTYPES:
        return f" --kv-cache-dtype {_KV_CACHE_DTYPES[key]}"
    if key not in _MODEL_DTYPES:
        known = ", ".join(sorted({**_KV_CACHE_DTYPES, **_MODEL_DTYPES}))
        raise ConfigError(f"--dtype: vLLM has no {dtype!r} KV cache; expected one of {known}")
    want = _MODEL_DTYPES[key]
    return "" if own == want and want != "float32" else f" --dtype {want}"


def _add_model_path(kv_config: dict[str, Any], source: Any):
    """Where ``--model-config`` names a model directory holding weight files, record it as
    ``model_path`` (its weights digest goes into the namespace) and return its digest."""
    from tiered_kv.model_identity import WEIGHT_SUFFIXES, weights_digest

    if source is None or isinstance(source, dict):
        return None
    directory = Path(source)
    directory = directory.parent if directory.name == "config.json" else directory
    if not directory.is_dir() or not any(p.name.endswith(WEIGHT_SUFFIXES) for p in directory.iterdir()):
        return None
    digest = weights_digest(directory, key="--model-config")
    kv_config["kv_connector_extra_config"]["model_path"] = digest.path
    return digest


def _backend_name(name: str) -> str:
    """``--attention-backend``'s value as vLLM names it; checked against vLLM's names
    where vLLM is installed here (``ConfigError`` naming the option otherwise)."""
    try:
        from tiered_kv.integrations.vllm.common import attention_backend_name
    except ImportError:
        return name.strip().upper()
    return attention_backend_name(name, key="--attention-backend")


@dataclass(frozen=True)
class ServerNamespace:
    """The namespace a vLLM server computes, the page order it names, and whether
    ``tiered-kv warmup`` (which takes no backend) computes it too."""

    namespace_id: str
    attention_backend: str
    kv_cache_layout: str
    warmup_writes: bool


def _server_namespace(
    model_dir: str, extra: dict[str, Any], plan: TierPlan, gpu_block_size: int, attention_backend: str | None = None
) -> ServerNamespace | None:
    """The namespace a vLLM server computes for this config and model on the attention
    backend ``attention_backend`` (None: ``offline_attention_backend``'s default), with
    the KV-cache layout vLLM resolves for that backend (None where vLLM is not
    importable here or the server's settings cannot be reproduced)."""
    try:
        from tiered_kv.integrations.vllm.geometry import (
            backend_kv_cache_layout,
            offline_attention_backend,
            offline_geometry,
        )
        from tiered_kv.ops.warmup.errors import WarmupError
        from tiered_kv.ops.warmup.layouts import VllmServe
        from tiered_kv.ops.warmup.vllm_pages import decoder_kv_cache_config, server_vllm_config
    except ImportError:
        return None
    try:
        vc = server_vllm_config(VllmServe(model_dir, extra, gpu_block_size=gpu_block_size, tp_size=plan.tp))
        warmup_layout = vc.cache_config.kv_cache_layout
        backend = offline_attention_backend(vc, attention_backend)
        # What vLLM's engine core resolves for that backend, before the workers allocate.
        layout = backend_kv_cache_layout(backend, os.environ.get("VLLM_KV_CACHE_LAYOUT"))
        vc.cache_config.kv_cache_layout = layout
        fp = offline_geometry(vc, decoder_kv_cache_config(vc), attention_backend=backend).fingerprint
    except (WarmupError, ConfigError, ImportError, ValueError):
        return None
    return ServerNamespace(fp.namespace_id, backend, layout, attention_backend is None and layout == warmup_layout)


def _print_identity(
    console: Console, kv_config: dict[str, Any], digest, plan: TierPlan, gpu_block_size: int, backends: list[str]
) -> None:
    """The identity the namespace records, and the namespace ids tiered-kv's own spec,
    ``tiered-kv warmup`` and a vLLM server (per attention backend) compute for this
    config."""
    import torch

    from tiered_kv.ops.warmup.layouts import KvFirstLayout, LayoutRequest

    extra = kv_config["kv_connector_extra_config"]
    cfg = TieredConfig.from_dict(extra, passthrough_keys=VLLM_PASSTHROUGH_KEYS)
    weights = (
        digest.describe()
        if digest is not None
        else "not covered by this config (no model directory with weights); under vLLM the namespace "
        "covers the directory vLLM loads"
    )
    console.print(
        f"namespace identity: model_id {cfg.model_id!r} @ {cfg.model_revision}; weights {weights}",
        highlight=False,
        soft_wrap=True,
    )
    if digest is not None:
        wanted: list[str | None] = [*backends] or [None]  # None: the default backend
        for given in wanted:
            server = _server_namespace(digest.path, extra, plan, gpu_block_size, given)
            if server is None:
                continue
            if given is None:
                what = (
                    f"what a vLLM server with this config reads (attention backend {server.attention_backend}, "
                    f"KV-cache layout {server.kv_cache_layout}; another backend: --attention-backend NAME)"
                )
                if server.warmup_writes:
                    what += f" and `tiered-kv warmup --model {digest.path} --tp {plan.tp}` writes"
            else:
                what = (
                    f"what a vLLM server with this config and --attention-backend {server.attention_backend} "
                    f"reads (KV-cache layout {server.kv_cache_layout})"
                )
            console.print(f"vLLM namespace {server.namespace_id}: {what}", highlight=False, soft_wrap=True)
    dtype = getattr(torch, plan.geometry.dtype, None)
    if isinstance(dtype, torch.dtype) and not getattr(plan.geometry, "mla", False):
        request = LayoutRequest(plan.geometry, dtype, gpu_block_size, plan.block_size // gpu_block_size, plan.tp)
        fp = KvFirstLayout(request).fingerprint(cfg)
        console.print(
            f"kv-first namespace {fp.namespace_id}: what tiered-kv's own engine (the simulator) and `tiered-kv "
            f"warmup --layout kv-first --gpu-block-size {gpu_block_size} --tp {plan.tp}` read and write",
            highlight=False,
            soft_wrap=True,
        )
    console.print(
        "under vLLM the namespace also records vLLM's attention backend, KV-cache layout, --revision, "
        'quantization and tokenizer; the server logs its id at start-up ("disk namespace <id>: model ...")',
        highlight=False,
        soft_wrap=True,
    )
