"""vLLM 0.33 integrations: out-of-tree plug-ins that vLLM loads by module path.

- ``TieredOffloadingSpec`` (``spec_name: TieredOffloadingSpec``, ``spec_module_path:
  tiered_kv.integrations.vllm``): the whole hierarchy as vLLM's offloading spec
  (``spec.py``: the spec; ``geometry.py``: config and geometry; ``manager.py``:
  scheduler side; ``worker.py``: worker side; ``remote.py``: the shared tier's
  scheduler side; ``verify.py``, ``health.py``: what keeps failures away from vLLM).
  Imports run one way: ``common`` <- ``geometry`` <- ``remote`` <- ``manager``,
  ``worker`` <- ``spec``.
- ``secondary_tier.TieredDiskTier``: our disk tier under vLLM's own
  ``TieringOffloadingSpec``.

Importing this package needs vLLM; importing ``tiered_kv`` itself never does.
"""

try:
    import vllm.v1.kv_offload.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "tiered_kv.integrations.vllm needs vLLM 0.33 (pip install vllm==0.33.0, or 'make venv', "
        f"which installs it without its CUDA dependencies); it could not be imported: {exc}. "
        "The rest of tiered_kv works without vLLM."
    ) from exc

from tiered_kv.integrations.vllm.spec import TieredOffloadingSpec

__all__ = ["TieredOffloadingSpec"]
