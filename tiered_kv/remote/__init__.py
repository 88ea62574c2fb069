"""The shared tier: KV blocks in S3-compatible object storage (or a Mooncake Store), shared by a fleet.

Every node that serves the same model with the same settings (the same
``Fingerprint``) reads and writes one namespace of one bucket; objects carry the full
fingerprint and a checksum, verified before a byte is used (``format.object_format``).
Sub-packages by process, as the disk tier's:

- ``config.RemoteConfig``: validated settings (every process; no I/O); ``tier.RemoteTier``:
  the tier's ``TierSpec``.
- ``scheduler/``: ``manager.RemoteOffloadingManager`` (membership, probes, pending
  uploads), ``membership`` (the cache of known-present / known-absent blocks and the
  prober that fills it without blocking), ``hit_check`` (under vLLM: every rank's object
  verified before a hit).
- ``worker/``: ``handlers`` (uploads from CPU slots, verified downloads into CPU slots or
  the KV cache).
- ``store/``: what every process that opens the tier runs: ``store.RemoteStore``
  (futures-based uploads, downloads and existence probes over a bounded thread pool,
  reporting ``outcomes.PutOutcome`` and ``outcomes.RemoteStats``), ``client.S3Client``
  (the S3 requests, obstore, credentials from the AWS chain),
  ``mooncake_client.MooncakeClient`` (the same objects in a Mooncake Store;
  ``backends.CLIENTS`` maps each backend to its client), ``timed_client``,
  ``write_once`` (write-once puts with and without conditional PUT), ``health`` (fault
  accounting).
- ``format/``: what the bucket holds, pure functions: ``object_format`` (keys and the
  self-describing object), ``keys`` (the fleet key and the per-object AEAD),
  ``safe_json`` (bounded parsing of records anyone may have written).

Needs the ``s3`` extra (``pip install 'tiered-kv[s3]'``): importing this package does
not, opening a store does. The names below resolve on first use, so importing
``tiered_kv.remote.config`` (as ``tiered_kv.config`` does) loads no other part of the tier.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AccessDenied": "store.client",
    "BucketMissing": "store.client",
    "RemoteSetupError": "store.client",
    "Unavailable": "store.client",
    "RemoteConfig": "config",
    "Membership": "scheduler.membership",
    "MembershipCache": "scheduler.membership",
    "MembershipProber": "scheduler.membership",
    "RemoteLookup": "scheduler.membership",
    "Rejected": "format.object_format",
    "PutOutcome": "store.outcomes",
    "RemoteStats": "store.outcomes",
    "RemoteStore": "store.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
