"""tiered-kv: a multi-tier KV-cache (GPU -> pinned CPU -> NVMe) for LLM inference engines.

Importing this package needs neither vLLM nor a GPU. Module map:

- ``abstract``: the scheduler-side contract (OffloadingManager, LoadStoreSpec, events).
- ``mediums``: load/store specs per medium (GPU, CPU, DISK).
- ``worker.worker``: the worker-side contract (OffloadingHandler) and router (OffloadingWorker).
- ``spec``: OffloadingSpec, which builds both from one ``config.TieredConfig``.
- ``kv_layout``: the engine's KV-cache geometry.
"""

__version__ = "0.1.0"
