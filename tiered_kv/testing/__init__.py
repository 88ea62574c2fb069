"""The fault-injection harness: the whole hierarchy on small layouts, damage to a
closed cache, I/O faults on demand, a block-by-block verifier and kill -9 trials.

Shipped with the package so that the fault suite (``tests/faults``) and the tools that
run the same trials at scale (``tools/fault_report.py``) share one copy, and so that a
user can run those trials against an installed build. Nothing in ``tiered_kv`` imports
it; it is never used while serving.

- ``harness``: runs in the calling (test or tool) process. Builds ``Hierarchy`` (spec,
  manager, worker and ``EngineDriver`` over CPU tensors standing in for the GPU) on a
  cache directory, injects I/O errors under the disk store (``InjectingBackend``),
  fills a real tmpfs (root only), damages slab and index files (``DAMAGE``) and reads
  every block of a cache read-only to verify it (``verify_cache``).
- ``crash``: runs in the calling process; forks ``storm_child`` processes from a fork
  server, SIGKILLs them at random moments and checks the cache each one left.
- ``storm_child``: runs in the forked child; the hierarchy under a store / evict / load
  storm, appending a journal of what it must find durable.
- ``ranks``: every tensor-parallel rank of one engine in one process; no I/O of its own.

Every offloaded block's bytes are ``tiered_kv.sim.driver.block_content(hash)``, so a block
read back from any tier can be checked against what it must be.
"""
