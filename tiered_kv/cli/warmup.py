"""``tiered-kv warmup``: fill the disk tier offline from a JSONL file of prompts.

Operator's process, with the server stopped (the run holds the cache's writer lock).
Library: ``tiered_kv.ops.warmup``. Checks the hash settings, the config (a spec whose
namespace the warm-up writes: ``TieredOffloadingSpec``, or vLLM's
``TieringOffloadingSpec`` with ``TieredDiskTier``), the model's identity
(``model_id`` set; ``--model`` has the weights digest of the config's ``model_path``),
the page order (the server's attention backend and the KV-cache layout vLLM resolves
for it: one the warm-up can prove, ``vllm_pages.check_page_order``) and the prompts
before loading the model, shows a progress bar over prompts (terminals only), and ends
with a summary table naming the namespace, the identity it records and the page order
written for, or JSON with ``--json``. Exits 2 with one ``error:`` line when it
cannot run, 1 when some blocks could not be stored, 130 when interrupted (blocks
written so far are kept; a rerun resumes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional

import typer
from rich.console import Console
from rich.table import Table

from tiered_kv.cli import app
from tiered_kv.cli.output import emit_json, errors, progress_bar
from tiered_kv.config import format_size
from tiered_kv.config_file import DISK_TIER_TYPE, TIERING_SPEC
from tiered_kv.ops.hashing import HashSettingsError, resolve_seed
from tiered_kv.model_identity import resolve_model_dir
from tiered_kv.ops.warmup import (
    DEFAULT_LAYOUT,
    VllmServe,
    WarmupReport,
    check_layout,
    chunk_tokens_for,
    server_settings,
    warmup,
)
from tiered_kv.ops.warmup.engines import HFEngine, import_transformers, require_vllm_engine, run_vllm_warmup
from tiered_kv.ops.warmup.errors import WarmupError
from tiered_kv.ops.warmup.inputs import check_identity, read_prompts, read_server, tokenize
from tiered_kv.ops.warmup.layouts import BLOCK_LAYOUTS

ENGINES = ("hf", "vllm")


@app.command("warmup")
def warmup_cmd(
    prompts: Path = typer.Argument(
        ..., metavar="PROMPTS", help='JSONL: {"token_ids": [...]} or {"text": "..."} per line.'
    ),
    model: str = typer.Option(..., "--model", metavar="PATH", help="Model directory (or hub id available offline)."),
    config: Path = typer.Option(
        ...,
        "--config",
        metavar="PATH",
        help="The server's config: vLLM --kv-transfer-config JSON or its kv_connector_extra_config.",
    ),
    engine: Literal["hf", "vllm"] = typer.Option("hf", "--engine", help="hf (transformers, CPU or GPU) or vllm (GPU)."),
    gpu_block_size: Optional[int] = typer.Option(
        None,
        "--gpu-block-size",
        min=1,
        metavar="N",
        help="The server's --block-size (tokens). Default: the config's block-size (a vllm serve --config file), "
        "else 16.",
    ),
    tp_size: Optional[int] = typer.Option(
        None,
        "--tp",
        min=1,
        metavar="N",
        help="The server's tensor-parallel size. Default: the config's tensor-parallel-size, else 1.",
    ),
    tp_size_old: Optional[int] = typer.Option(None, "--tp-size", min=1, hidden=True),
    layout: str = typer.Option(
        DEFAULT_LAYOUT,
        "--layout",
        metavar="LAYOUT",
        help=f"Block layout: {', '.join(sorted(BLOCK_LAYOUTS))} (vllm: what vLLM reads).",
    ),
    kv_cache_layout: Optional[str] = typer.Option(
        None,
        "--kv-cache-layout",
        metavar="<LBNHC|LBHNC>",
        help="vllm layout: the server's KV-cache layout, LBNHC or LBHNC. Default: VLLM_KV_CACHE_LAYOUT, else the "
        "attention backend's choice (LBNHC for FLASH_ATTN).",
    ),
    attention_backend: Optional[str] = typer.Option(
        None,
        "--attention-backend",
        metavar="NAME",
        help="vllm layout: the server's vllm serve --attention-backend, part of its namespace; pages are written "
        "for FLASH_ATTN and TRITON_ATTN. Default: the config's attention-backend (a vllm serve --config file), "
        "else vLLM's choice on this host, else FLASH_ATTN.",
    ),
    tokenizer: Optional[str] = typer.Option(
        None, "--tokenizer", metavar="PATH", help="Local tokenizer directory for text prompts (default: --model)."
    ),
    dtype: Optional[Literal["auto", "float32", "float16", "bfloat16"]] = typer.Option(
        None, "--dtype", help="The server's --dtype. Default: the config's dtype, else auto (vLLM's choice)."
    ),
    device: Literal["auto", "cpu", "cuda"] = typer.Option("auto", "--device", help="hf: where it runs."),
    disk_path: Optional[str] = typer.Option(
        None,
        "--disk-path",
        metavar="PATH",
        help="The disk tier's directory instead of the config's (disk_path, or its TieredDiskTier entry's).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Write the KV of every full block of every prompt to the disk tier (resumable).

    The server's first requests for these prompts then hit. Blocks already on disk are
    skipped, so a rerun picks up where an interrupted one stopped."""
    if tp_size_old is not None:  # the old name of --tp
        tp_size = tp_size_old
    with errors(json_out, (WarmupError, HashSettingsError)):
        if engine not in ENGINES:
            raise WarmupError(f"--engine: expected hf or vllm, got {engine!r}")
        if engine == "vllm":
            require_vllm_engine()
        # Before anything is read or written for a server that would not read it.
        server = read_server(config, disk_path)
        cfg = server.config
        backend = _serve_flag(
            "--attention-backend",
            attention_backend,
            "attention-backend",
            server.disk.attention_backend,
            config,
            same=lambda v: v.strip().upper(),
        )
        found = server.disk.found
        gpu_block_size = _serve_flag("--gpu-block-size", gpu_block_size, "block-size", found.gpu_block_size, config)
        tp_size = _serve_flag("--tp", tp_size, "tensor-parallel-size", found.tp, config)
        dtype = _serve_flag("--dtype", dtype, "dtype", found.dtype, config)
        gpu_block_size, tp_size, dtype = gpu_block_size or 16, tp_size or 1, dtype or "auto"
        resolve_seed(cfg.hash_algorithm, cfg.hash_seed)  # fail before any heavy work
        chunk_tokens_for(cfg, gpu_block_size)
        local = resolve_model_dir(model)
        if engine == "hf":
            where = f"its {DISK_TIER_TYPE} entry" if server.disk.is_secondary_tier else "the config"
            check_identity(cfg, None if local is None else str(local), where=where)
            check_layout(layout, server.extra, backend)
        items = read_prompts(prompts)
        tok = None
        if any(p.token_ids is None for p in items):
            tok = _load_tokenizer(tokenizer or model)
        token_ids = tokenize(items, tok)
        salts = [p.cache_salt for p in items]
        extra = server.extra
        if engine == "vllm":
            n = run_vllm_warmup(
                token_ids,
                model,
                extra,
                gpu_block_size=gpu_block_size,
                tp_size=tp_size,
                attention_backend=backend,
                cache_salts=salts,
            )
            if json_out:
                emit_json({"engine": "vllm", "prompts": n})
            else:
                Console().print(f"vllm engine: prefilled {n} prompts through the connector")
            return
        model_dtype: str = dtype
        if layout == DEFAULT_LAYOUT and local is not None:
            # The page order is refused here, before the model is loaded, if it cannot be proven.
            settings = server_settings(
                VllmServe(
                    str(local),
                    extra,
                    dtype=dtype,
                    kv_cache_layout=kv_cache_layout,
                    attention_backend=backend,
                    gpu_block_size=gpu_block_size,
                    tp_size=tp_size,
                )
            )
            model_dtype, kv_cache_layout, backend = settings.dtype, settings.kv_cache_layout, settings.attention_backend
        hf = HFEngine.from_pretrained(model, dtype=model_dtype, device=device)
        with progress_bar(json_out, "warming", len(token_ids)) as bar:
            report = warmup(
                token_ids,
                hf,
                cfg,
                gpu_block_size=gpu_block_size,
                tp_size=tp_size,
                layout=layout,
                extra_config=extra,
                kv_cache_layout=kv_cache_layout,
                attention_backend=backend,
                cache_salts=salts,
                progress=lambda i, r: bar.advance(1),
            )
    if json_out:
        emit_json(report.to_dict())
    else:
        _print(report, hf, gpu_block_size)
    if report.weights_digest is None:
        typer.echo(
            "warning: the namespace does not cover the model's weights: a server with other weights under the "
            "same model_id would read these blocks; "
            + (
                f'add "model_path": "{hf.model_path or model}" to the config'
                if layout != DEFAULT_LAYOUT
                else f"{model!r} is not a local model directory"
            ),
            err=True,
        )
    if report.blocks_failed or report.blocks_rejected:
        raise typer.Exit(1)


def _serve_flag(
    option: str, given: Any, key: str, in_config: Any, config: Path, same: Callable[[Any], Any] = lambda v: v
) -> Any:
    """``option``'s value, else the ``vllm serve --config`` file's ``key``, else None;
    refused where the two differ, compared as ``same`` spells the option (the server
    started from the file reads another namespace than the one written)."""
    if given is not None and in_config is not None and same(given) != in_config:
        raise WarmupError(
            f"{option} {given}: the config {config} starts the server with {key} {in_config}, which reads "
            "another namespace; drop the option or make the two agree"
        )
    return given if given is not None else in_config


def _load_tokenizer(path: str):
    transformers = import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise WarmupError(
            f"cannot load a tokenizer from {path!r} for the text prompts: {' '.join(str(e).split())}"
        ) from None


def _print(r: WarmupReport, hf: HFEngine, gpu_block_size: int) -> None:
    t = Table(title="tiered-kv warmup", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    g = hf.geometry
    t.add_row("namespace", r.namespace)
    if r.spec == TIERING_SPEC:
        t.add_row("server", f"vLLM's {TIERING_SPEC} with {DISK_TIER_TYPE}: whole CPU-tier rows, every rank's shard")
    t.add_row(
        "model",
        f"{r.model_id} @ {r.model_revision}; weights "
        + (r.weights_digest or "not covered (no model_path in the config)"),
    )
    t.add_row(
        "model KV",
        f"{g.num_layers} layers, {g.num_kv_heads} KV heads x {g.head_dim}, {g.dtype}; "
        f"layout {r.layout}"
        + (f" ({r.kv_cache_layout} pages)" if r.kv_cache_layout else "")
        + f", GPU block {gpu_block_size} tokens",
    )
    if r.attention_backend:
        t.add_row(
            "page order",
            f"attention backend {r.attention_backend} over KV-cache layout {r.kv_cache_layout}: what a vLLM server "
            f"on {r.attention_backend} reads (another backend reads another namespace: --attention-backend NAME)",
        )
    t.add_row(
        "prompts", f"{r.prompts} ({r.prompts_skipped} already complete, {r.prompts_too_short} shorter than one block)"
    )
    t.add_row(
        "blocks",
        f"{r.blocks} distinct: {r.blocks_written} written, {r.blocks_present} already on disk"
        + (f", {r.blocks_failed} failed" if r.blocks_failed else "")
        + (f", {r.blocks_rejected} rejected (no room)" if r.blocks_rejected else ""),
    )
    if r.blocks_evicted:
        t.add_row("evicted", f"{r.blocks_evicted} older blocks made room (the cache is smaller than the warm set)")
    rate = r.bytes_written / r.seconds / 1e6 if r.seconds else 0.0
    t.add_row("bytes written", f"{format_size(r.bytes_written)} ({rate:.1f} MB/s)")
    t.add_row("tokens computed", f"{r.tokens_computed:,}")
    t.add_row("time", f"{r.seconds:.2f} s")
    Console().print(t)
    if r.blocks_failed or r.blocks_rejected:
        typer.echo("warning: some blocks were not stored (see the log); a rerun retries them", err=True)
