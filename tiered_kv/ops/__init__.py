"""Operator tools: what a person runs beside the engine, never on the request path.

- ``inspect``: the disk-cache and shared-tier inspector's library (``tiered-kv inspect``);
- ``warmup``: offline warm-up, filling the disk tier from prompts (``tiered-kv warmup``);
- ``sizing``: KV bytes per token and blocks per tier (``tiered-kv config``);
- ``hashing``: vLLM-compatible prefix hashes of token blocks (warm-up, and the check that
  a server's hash settings match the cache's);
- ``doctor``: the host checks of ``tiered-kv doctor``;
- ``presets``: model geometries for ``tiered-kv config --preset``;
- ``metrics_view``: the per-tier view of a Prometheus endpoint (``tiered-kv stats``);
  ``endpoint_get``: its GET, bounded in time and size.

Run in the operator's process (the CLI), except ``hashing``, which the vLLM adapter also
uses at start-up. I/O: the inspector and warm-up read and write cache directories and
buckets, the doctor probes the host and a bucket, the metrics view reads an endpoint; sizing,
hashing and presets do none.
"""
