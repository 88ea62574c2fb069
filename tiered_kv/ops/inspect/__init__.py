"""The disk-cache inspector's library (the ``tiered-kv inspect`` CLI is a thin layer on it).

Runs in the operator's process, beside or instead of an engine. Module map:

- ``cache``: find a cache's namespaces, read an index snapshot as numpy columns
  (read-only, no lock).
- ``summary``: per-namespace summary and entry listing (read-only).
- ``verify``: re-read blocks and check checksums (read-only; ``repair`` takes the lock).
- ``maintenance``: ``evict``, ``clear`` and index edits, under the writer lock.
- ``bench``: tier vs raw O_DIRECT GB/s in a scratch directory on the cache's device.
- ``remote``: a shared tier's bucket: summary, listing, clear and evict (S3 reads;
  ``tiered-kv inspect ... --remote CONFIG``); ``remote_verify``: its verification and
  repair; ``remote_hostile``: keys clients parsing keys as paths cannot hold. Imported
  on their own, not here.
"""

from tiered_kv.ops.inspect.bench import BenchResult, run_bench
from tiered_kv.ops.inspect.cache import CacheDir, EntryTable, InspectError, open_cache, read_entries
from tiered_kv.ops.inspect.maintenance import EvictResult, clear, evict
from tiered_kv.ops.inspect.summary import ListFilter, list_entries, summarize_cache, summarize_namespace
from tiered_kv.ops.inspect.verify import VerifyResult, verify_namespace

__all__ = [
    "BenchResult",
    "CacheDir",
    "EntryTable",
    "EvictResult",
    "InspectError",
    "ListFilter",
    "clear",
    "evict",
    "list_entries",
    "open_cache",
    "read_entries",
    "run_bench",
    "summarize_cache",
    "summarize_namespace",
    "VerifyResult",
    "verify_namespace",
]
