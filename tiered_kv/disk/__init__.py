"""The disk tier: a persistent, checksummed block store on local NVMe.

Built as a lower tier by ``tier.DiskTier`` (``tiered_kv.tiers``). Sub-packages by process:
``scheduler/`` (the manager and what runs beside it), ``worker/`` (a rank's block I/O,
in the worker or its helper process), ``format/`` (the on-disk format every process
reads). The namespace key is ``tiered_kv.fingerprint``; checksums ``tiered_kv.checksums``.

- ``format.namespace``: a cache directory's namespaces, manifests, slab preallocation and the
  writer lock (scheduler and workers at startup; inspector read-only); ``namespace_dir``
  makes a new one, ``manifest`` reads and checks ``manifest.json``, ``locks`` is the
  writer lock, ``safe_open`` opens every cache entry (no link followed, no FIFO
  opened, nothing of another user's; 0600 files, 0700 directories), ``errors`` holds
  their start-up errors.
- ``format.index``: the LMDB index shared by an engine's processes; ``index_records`` its
  records and their byte layout; ``index_env`` opens its environment and finds a
  damaged one, with ``lmdb_check``'s page walk.
- ``worker.io_backends``: POSIX (O_DIRECT) and KvikIO (GDS) block I/O (workers).
- ``worker.store``: ``DiskStore``, one process's block reads/writes with the crash-safe
  commit protocol (workers, tools, inspector); its batches are ``write_batch`` and
  ``read_batch`` (over ``batch``), its index commits ``group_commit``, its checksums
  ``checksums``.
- ``worker.io_process``: ``DiskIOProcess``, a worker's ``DiskStore`` run in a helper process of
  its own (``disk_io: process``), reading and writing the worker's shared host memory;
  ``io_server`` is that helper process.
- ``worker.block_store``: ``BlockStore`` and ``BlockBatch``, what the handlers need of either
  store (workers).
- ``scheduler.manager``: ``DiskOffloadingManager``, slots, LRU and ref-counts (scheduler; never
  blocks on I/O); ``index_flusher`` its background thread, ``log_fold`` how it reads
  the workers' log, ``adoption`` what it adopts from the index at startup,
  ``block_table`` its table of loadable blocks.

The handlers that move blocks between KV tensors and the disk are in
``worker.handlers``, the stager that writes CPU slots to the slab in ``worker.stager``;
the scheduler's read-back check before a hit (under vLLM) in ``scheduler.hit_check``.
"""

from tiered_kv.fingerprint import Fingerprint
from tiered_kv.disk.worker.io_backends import (
    BackendUnavailableError,
    IOBackend,
    KvikIOBackend,
    PosixBackend,
    aligned_empty,
    select_backend,
)
from tiered_kv.disk.scheduler.log_fold import RefreshResult
from tiered_kv.disk.scheduler.manager import DiskManagerStats, DiskOffloadingManager
from tiered_kv.disk.format.namespace import (
    CacheLockedError,
    FingerprintMismatchError,
    Namespace,
    NamespaceError,
    list_namespaces,
    slot_size_for,
)
from tiered_kv.disk.worker.store import DiskStore, DiskStoreStats

__all__ = [
    "BackendUnavailableError",
    "CacheLockedError",
    "DiskManagerStats",
    "DiskOffloadingManager",
    "DiskStore",
    "DiskStoreStats",
    "Fingerprint",
    "FingerprintMismatchError",
    "IOBackend",
    "KvikIOBackend",
    "Namespace",
    "NamespaceError",
    "PosixBackend",
    "RefreshResult",
    "aligned_empty",
    "list_namespaces",
    "select_backend",
    "slot_size_for",
]
