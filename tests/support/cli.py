"""The ``tiered-kv`` command run in-process as tests run it, and a server's config file as
vLLM is given it: the helpers of the tool tests that judge real caches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

from tiered_kv.cli import _load_commands, app
from tiered_kv.config_file import SPEC_MODULE, TIERED_SPEC


def run_cli(*args: str, code: int | None = 0) -> Result:
    """Run ``tiered-kv ARGS``; ``code``: the exit code it must end with (None: any). Never
    a traceback. The warm-up reads ``VLLM_KV_CACHE_LAYOUT`` as vLLM does, so it is unset:
    the servers of these tests record vLLM's default layout."""
    _load_commands()
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "250", "VLLM_KV_CACHE_LAYOUT": None})
    assert code is None or result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def write_transfer_config(path: Path, extra: dict[str, Any], *, spec: bool = True) -> Path:
    """vLLM's whole ``--kv-transfer-config`` with ``extra`` as its extra config, at ``path``.
    ``spec``: an ``extra`` without ``spec_name`` names ``TieredOffloadingSpec`` and its
    module, as ``tiered-kv config`` prints it (False: written as given)."""
    if spec and "spec_name" not in extra:
        extra = {"spec_name": TIERED_SPEC, "spec_module_path": SPEC_MODULE, **extra}
    path.write_text(
        json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})
    )
    return path
