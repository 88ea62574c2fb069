"""``tiered-kv doctor --e2e``: a real model's output is the same cold and warm through
this host's tiers (``tiered_kv.ops.equivalence``), one line per case.

Runs in the operator's process. Builds the two small models of ``equivalence.SHAPES``
(random weights from a fixed seed, no download) in a temporary directory and runs every
case with the config's tiers, on CUDA where there is one, else on the CPU. Its I/O: the
models' files and, without a config, a CPU and a disk tier in that temporary directory;
each disk tier of the config in a temporary directory made inside its configured one (or
the nearest existing parent), so the file system tested is the tier's and the server's
namespaces are never touched; the warm-up's disk tier beside the first of those. Every
temporary directory is removed afterwards. A shared tier is used as configured: the
small models' blocks are uploaded under its prefix, in namespaces of their own (the
weights digest is part of them), and left there as any node's uploads are; a rerun
finds them. The key and credentials are read as the server reads them.

A case is ``ok`` when its tokens are the cold ones and its logits within the dtype's
tolerance, ``fail`` otherwise (a tier served KV other than the model computed, a load
from a tier failed, or a damaged block was served), ``skip`` when it could not run (a
tier that cannot be opened or reached: the tier's own doctor line gives the verdict).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tiered_kv.config import ConfigError, TieredConfig
from tiered_kv.ops.doctor.disk import existing_ancestor
from tiered_kv.ops.doctor.report import FAIL, OK, Check, skipped
from tiered_kv.tier_registry import TierEntry

NAME = "e2e"
#: Bytes of each disk namespace of the check (one per model): the prefix takes 256 KiB.
DISK_BYTES = 16 * 1024**2
_FIX_OUTPUT = (
    "a tier returned KV other than the model computed: run tiered-kv inspect verify on the tier, and report this "
    "output with the config (doctor --e2e --json)"
)
_FIX_LOAD = "a load from a tier that holds the blocks failed: see the tier's doctor line and the log above"


def check_e2e(config_path: str | os.PathLike | None = None, tp: int | None = None, device: str = "auto") -> list[Check]:
    """One ``Check`` per case of ``tiered_kv.ops.equivalence`` (both models on each line)
    with the tiers of the server config at ``config_path`` (None: a CPU and a disk tier
    in a temporary directory). ``tp`` only reads the config as ``doctor`` does: the
    check runs as one rank."""
    from tiered_kv.ops.doctor import read_config

    cfg = TieredConfig.from_dict({})
    if config_path is not None:
        try:
            cfg = read_config(config_path, tp)
        except ConfigError:
            return [skipped(NAME, f"config {config_path} could not be read (see the config line)")]
    if importlib.util.find_spec("transformers") is None:
        return [skipped(NAME, "needs transformers, which is not installed", "pip install 'tiered-kv[warmup]'")]
    from tiered_kv.ops import equivalence

    scratch = Path(tempfile.mkdtemp(prefix="tiered-kv-e2e-"))
    made: list[Path] = [scratch]
    checks: list[Check] = []
    try:
        tiers: list[TierEntry] = []
        if config_path is None:
            tiers.append(
                TierEntry.parse({"type": "disk", "path": str(scratch / "disk"), "bytes": f"{DISK_BYTES}B"}, NAME)
            )
        for entry in cfg.tier_entries():
            try:
                tiers.append(_relocated(entry, made))
            except OSError as e:
                checks.append(
                    skipped(NAME, f"tier {entry.name}: no scratch directory beside {entry.settings.path}: {e}")
                )
        first_disk = next((t for t in tiers if t.type_name == "disk"), None)
        warm_parent = Path(first_disk.settings.path).parent if first_disk is not None else scratch
        torch_device = _device(device)
        results = []
        for i, shape in enumerate(equivalence.SHAPES):
            model = equivalence.build_model(shape, scratch / "models", device=torch_device)
            results.append(
                list(
                    equivalence.run_equivalence(
                        model, cfg, tiers=tiers, warmup_dir=warm_parent / f"warmup-{i}", device=torch_device
                    )
                )
            )
        checks += [_line(list(case)) for case in zip(*results)]
    except Exception as e:  # the models could not be built or run: no case could
        checks.append(skipped(NAME, f"the check's models could not run: {type(e).__name__}: {e}"))
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
    return checks


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _relocated(entry: TierEntry, made: list[Path]) -> TierEntry:
    """A disk tier ``entry`` moved into a new temporary directory inside its own (or its
    nearest existing parent), sized for the check; any other tier as configured."""
    if entry.type_name != "disk":
        return entry
    where = Path(tempfile.mkdtemp(prefix=".tiered-kv-e2e-", dir=existing_ancestor(entry.settings.path)))
    made.append(where)
    settings = dataclasses.replace(entry.settings, path=str(where / "cache"), bytes=DISK_BYTES)
    return dataclasses.replace(entry, settings=settings)


def _label(case: str, tier: str) -> str:
    return {
        "computed": "computed prefix (no tier)",
        "cpu": "CPU tier",
        "tier": f"tier {tier}",
        "warmup": "warm-up blocks (disk)",
        "recompute": f"failed load from tier {tier}, recomputed",
    }[case]


def _line(results: Sequence) -> Check:
    """One case over every model: ok only when each model's is."""
    first = results[0]
    label = _label(first.case, first.tier)
    facts = {
        "case": first.case,
        "tier": first.tier,
        "models": [
            {
                "model": r.model,
                "ok": r.ok,
                "error": r.error,
                "tokens_equal": None if r.comparison is None else r.comparison.tokens_equal,
                "tokens_matching": None if r.comparison is None else r.comparison.matching,
                "steps": None if r.comparison is None else r.comparison.steps,
                "max_logit_diff": None if r.comparison is None else r.comparison.max_logit_diff,
                "tolerance": None if r.comparison is None else r.comparison.tolerance,
                "kv_equal": r.kv_equal,
                "load_failed": r.load_failed,
                "blocks": r.blocks,
                "sources": r.sources,
                "seconds": r.seconds,
                "load_seconds": r.load_seconds,
            }
            for r in results
        ],
    }
    errors = [r for r in results if r.error is not None]
    if errors:
        reasons = dict.fromkeys(str(r.error) for r in errors)  # one model's reason, or each
        why = "; ".join(reasons) if len(reasons) == 1 else "; ".join(f"{r.model}: {r.error}" for r in errors)
        if any(r.load_failed and r.case != "recompute" for r in errors):
            return Check(NAME, FAIL, f"{label}: {why}", _FIX_LOAD, facts)
        return skipped(NAME, f"{label}: {why}", facts=facts)
    tokens = ", ".join(f"{r.model} {r.comparison.matching}/{r.comparison.steps}" for r in results)
    diff = max(r.comparison.max_logit_diff for r in results)
    tolerance = min(r.comparison.tolerance for r in results)
    kv = "KV bytes as computed" if all(r.kv_equal for r in results) else "KV bytes differ from the model's"
    seconds = sum(r.seconds for r in results)
    load_ms = 1000 * max(r.load_seconds for r in results)
    timing = f"{seconds:.2f} s" + (f", load {load_ms:.1f} ms" if first.case != "computed" else "")
    message = f"{label}: tokens equal {tokens}; max logit diff {diff:.1e} (tolerance {tolerance:.1e}); {kv}; {timing}"
    if first.case == "recompute":
        failed = sum(r.load_failed for r in results)
        message = f"{label}: {failed} of {len(results)} loads failed as they must; " + message.split(": ", 1)[1]
    if all(r.ok for r in results):
        return Check(NAME, OK, message, facts=facts)
    fix = _FIX_OUTPUT
    if first.case == "recompute" and not all(r.load_failed for r in results):
        fix = "a block damaged on disk was served instead of failing its checksum: report this output"
    return Check(NAME, FAIL, message, fix, facts)
