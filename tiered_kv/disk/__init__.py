"""The disk tier: a persistent, checksummed block store on local NVMe.

Built as a lower tier by ``tier.DiskTier`` (``tiered_kv.tiers``). Sub-packages by who
uses them: ``scheduler/`` (the manager and what runs beside it), ``store/`` (one
process's block I/O: the workers, a worker's helper process, the scheduler's read-back
check and the operator's tools all open a ``DiskStore``), ``worker/`` (what only a
worker runs: its handlers, its stager, its helper process), ``format/`` (the on-disk
format every process reads). The namespace key is ``tiered_kv.fingerprint``; checksums
``tiered_kv.checksums``.

- ``format.namespace``: a cache directory's namespaces, manifests, slab preallocation and the
  writer lock (scheduler and workers at startup; inspector read-only); ``namespace_dir``
  makes a new one, ``manifest`` reads and checks ``manifest.json``, ``locks`` is the
  writer lock, ``safe_open`` opens every cache entry (no link followed, no FIFO
  opened, nothing of another user's; 0600 files, 0700 directories), ``errors`` holds
  their start-up errors.
- ``format.index``: the LMDB index shared by an engine's processes; ``index_records`` its
  records and their byte layout; ``index_env`` opens its environment and finds a
  damaged one, with ``lmdb_check``'s page walk.
- ``store.io_backends``: POSIX (O_DIRECT) and KvikIO (GDS) block I/O.
- ``store.store``: ``DiskStore``, one process's block reads/writes with the crash-safe
  commit protocol; its batches are ``write_batch`` and ``read_batch`` (over ``batch``),
  its index commits ``group_commit``, its checksums ``checksums``; ``block_store``:
  ``BlockStore`` and ``BlockBatch``, what the handlers need of a store in this process
  or in a helper process.
- ``worker.io_process``: ``DiskIOProcess``, a worker's ``DiskStore`` run in a helper process of
  its own (``disk_io: process``), reading and writing the worker's shared host memory;
  ``io_server`` is that helper process.
- ``scheduler.manager``: ``DiskOffloadingManager``, slots, LRU and ref-counts (scheduler; never
  blocks on I/O); ``index_flusher`` its background thread, ``log_fold`` how it reads
  the workers' log, ``adoption`` what it adopts from the index at startup,
  ``block_table`` its table of loadable blocks.

The handlers that move blocks between KV tensors and the disk are in
``worker.handlers``, the stager that writes CPU slots to the slab in ``worker.stager``;
the scheduler's read-back check before a hit (under vLLM) in ``scheduler.hit_check``.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The package's names and the module each comes from, imported on first use: importing
#: one sub-module (a worker's store, the inspector's format readers) does not pull in the
#: others (the manager, KvikIO's backend).
_EXPORTS = {
    "Fingerprint": "tiered_kv.fingerprint",
    "BackendUnavailableError": "tiered_kv.disk.store.io_backends",
    "IOBackend": "tiered_kv.disk.store.io_backends",
    "KvikIOBackend": "tiered_kv.disk.store.io_backends",
    "PosixBackend": "tiered_kv.disk.store.io_backends",
    "aligned_empty": "tiered_kv.disk.store.io_backends",
    "select_backend": "tiered_kv.disk.store.io_backends",
    "RefreshResult": "tiered_kv.disk.scheduler.log_fold",
    "DiskManagerStats": "tiered_kv.disk.scheduler.stats",
    "DiskOffloadingManager": "tiered_kv.disk.scheduler.manager",
    "CacheLockedError": "tiered_kv.disk.format.namespace",
    "FingerprintMismatchError": "tiered_kv.disk.format.namespace",
    "Namespace": "tiered_kv.disk.format.namespace",
    "NamespaceError": "tiered_kv.disk.format.namespace",
    "list_namespaces": "tiered_kv.disk.format.namespace",
    "slot_size_for": "tiered_kv.disk.format.namespace",
    "DiskStore": "tiered_kv.disk.store.store",
    "DiskStoreStats": "tiered_kv.disk.store.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
