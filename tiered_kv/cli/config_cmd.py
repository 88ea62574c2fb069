"""``tiered-kv config``: size the tiers for a model and print vLLM's kv-transfer-config.

Reads one HF ``config.json`` when ``--model-config`` is given, and writes the JSON to
``--output`` when asked. Where ``--model-config`` names a model directory with weight
files, it also reads that directory's weights digest (``tiered_kv.model_identity``: a
bounded sample of each file) and records the directory as ``model_path``. The printed
JSON is what ``vllm serve --kv-transfer-config`` takes; its ``kv_connector_extra_config``
is validated with ``TieredConfig.from_dict`` before it is printed, so every key is one
the spec accepts. ``model_id`` is ``--model-id``, else the model's name, else its
directory, never a silent "unknown"; with a disk tier the table ends with the identity
the namespace records and its id.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from tiered_kv.cli import app
from tiered_kv.config import ConfigError, TieredConfig, format_size, parse_size
from tiered_kv.ops.doctor import tier_size_warnings
from tiered_kv.ops.presets import PRESETS, preset_source
from tiered_kv.ops.sizing import ModelGeometry, TierPlan, plan_tiers

SPEC_NAME = "TieredOffloadingSpec"
SPEC_MODULE_PATH = "tiered_kv.integrations.vllm"
#: Keys vLLM's factory reads from kv_connector_extra_config; TieredConfig passes them through.
VLLM_PASSTHROUGH_KEYS = ("spec_name", "spec_module_path")


def _size_value(text: str, key: str) -> int | str:
    """Keep the user's spelling ("64GiB") in the config once it parses; bare numbers as ints."""
    parse_size(text, key)
    stripped = text.strip()
    return int(stripped) if stripped.isdigit() else stripped


def build_kv_transfer_config(
    plan: TierPlan, *, cpu_bytes: str, disk_path: Optional[str], disk_bytes: Optional[str], model_id: str
) -> dict[str, Any]:
    """vLLM's kv-transfer-config dict for ``plan``; raises ``ConfigError`` if the
    extra config is not one ``TieredConfig`` accepts."""
    extra: dict[str, Any] = {
        "spec_name": SPEC_NAME,
        "spec_module_path": SPEC_MODULE_PATH,
        "cpu_bytes": _size_value(cpu_bytes, "cpu_bytes"),
    }
    if disk_path:
        extra["disk_path"] = disk_path
        extra["disk_bytes"] = _size_value(disk_bytes or "", "disk_bytes")
    extra["block_size"] = plan.block_size
    extra["model_id"] = model_id
    TieredConfig.from_dict(extra, passthrough_keys=VLLM_PASSTHROUGH_KEYS)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


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
        None, "--model-config", help="HF config.json (or its directory) to read the geometry from."
    ),
    preset: Optional[str] = typer.Option(None, "--preset", help=f"A built-in model geometry: {', '.join(PRESETS)}."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Decoder layers (without --model-config)."),
    kv_heads: Optional[int] = typer.Option(
        None, "--kv-heads", help="KV heads of the whole model (without --model-config)."
    ),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Head dimension (without --model-config)."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="KV-cache dtype, e.g. bfloat16, float16, fp8. Default: the model's, else bfloat16."
    ),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size."),
    cpu_bytes: str = typer.Option("32GiB", "--cpu-bytes", help="CPU tier budget per TP rank, e.g. 64GiB."),
    disk_bytes: Optional[str] = typer.Option(
        None, "--disk-bytes", help="Disk tier budget per TP rank, e.g. 1TiB (needs --disk-path)."
    ),
    disk_path: Optional[str] = typer.Option(None, "--disk-path", help="Disk tier directory; omit for no disk tier."),
    block_size: int = typer.Option(
        16, "--block-size", help="Offloaded block size in tokens (a multiple of --gpu-block-size)."
    ),
    gpu_block_size: int = typer.Option(16, "--gpu-block-size", help="vLLM's --block-size (tokens per GPU block)."),
    model_id: Optional[str] = typer.Option(
        None, "--model-id", help="Model id recorded in the disk-cache fingerprint. Default: from the model config."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print only the JSON."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Also write the JSON to this file."),
) -> None:
    """Size the CPU and disk tiers for a model and print the --kv-transfer-config JSON."""
    console = Console()
    try:
        source, serve_model = preset_source(preset, model_config)
        plan, model_name = _plan(
            source, layers, kv_heads, head_dim, dtype, tp, cpu_bytes, disk_bytes, disk_path, block_size, gpu_block_size
        )
        kv_config = build_kv_transfer_config(
            plan,
            cpu_bytes=cpu_bytes,
            disk_path=disk_path,
            disk_bytes=disk_bytes,
            model_id=_model_id(model_id, source, serve_model),
        )
        identity = _add_model_path(kv_config, source)
    except ConfigError as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    for warning in tier_size_warnings(plan.cpu_bytes, plan.disk_bytes, disk_path, tp):
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)
    text = json.dumps(kv_config, indent=2)
    if output is not None:
        output.write_text(text + "\n")
    if as_json:
        sys.stdout.write(text + "\n")
        return
    console.print(arithmetic_table(plan))
    console.print_json(text)
    serve_model = serve_model or kv_config["kv_connector_extra_config"].get("model_id") or "<model>"
    console.print(
        f"vllm serve {serve_model} --tensor-parallel-size {tp} --block-size {gpu_block_size} "
        f"--kv-transfer-config '{json.dumps(kv_config)}'",
        highlight=False,
        soft_wrap=True,
    )
    if disk_path:
        _print_identity(console, kv_config, identity, plan, gpu_block_size)


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
        geometry = ModelGeometry.from_hf_config(model_config, dtype=dtype)
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


def _model_id(given: Optional[str], source: Any, directory: Optional[str]) -> str:
    """The model id the config records: ``--model-id``, else the model config's
    ``_name_or_path``, else the model directory; never a silent "unknown"."""
    if given:
        return given
    name = None
    if isinstance(source, dict):
        name = source.get("_name_or_path")
    elif source is not None:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        try:
            name = json.loads(path.read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            name = None
    if name:
        return str(name)
    if directory:
        return str(Path(directory).absolute())
    raise ConfigError(
        "--model-id: required without --model-config or --preset: the disk cache namespace "
        "records which model its blocks belong to (vLLM's --model is the usual value)"
    )


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


def _print_identity(console: Console, kv_config: dict[str, Any], digest, plan: TierPlan, gpu_block_size: int) -> None:
    """The identity the namespace records, and the namespace id tiered-kv's own spec
    and ``tiered-kv warmup`` compute for this config (vLLM adds its own layout)."""
    import torch

    from tiered_kv.config import VLLM_PASSTHROUGH_KEYS
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
    dtype = getattr(torch, plan.geometry.dtype, None)
    if isinstance(dtype, torch.dtype) and not getattr(plan.geometry, "mla", False):
        request = LayoutRequest(plan.geometry, dtype, gpu_block_size, plan.block_size // gpu_block_size, plan.tp)
        fp = KvFirstLayout(request).fingerprint(cfg)
        console.print(
            f"namespace {fp.namespace_id}: what tiered-kv's own spec and `tiered-kv warmup "
            f"--gpu-block-size {gpu_block_size} --tp-size {plan.tp}` read and write with this config",
            highlight=False,
            soft_wrap=True,
        )
    console.print(
        "under vLLM the namespace also records vLLM's KV-cache layout, --revision, quantization and "
        'tokenizer; the server logs its id at start-up ("disk namespace <id>: model ...")',
        highlight=False,
        soft_wrap=True,
    )
