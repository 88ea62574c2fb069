"""The shared tier: KV blocks in S3-compatible object storage (or a Mooncake Store), shared by a fleet.

Every node that serves the same model with the same settings (the same
``Fingerprint``) reads and writes one namespace of one bucket; objects carry the full
fingerprint and a checksum, verified before a byte is used (``object_format``). The
pieces, by process:

- ``config.RemoteConfig``: validated settings (both processes; no I/O);
- ``store.RemoteStore``: futures-based block uploads, downloads and existence probes
  over a bounded thread pool (worker processes for bytes, the scheduler for probes),
  reporting ``outcomes.PutOutcome`` per upload and ``outcomes.RemoteStats``;
- ``membership``: the scheduler's cache of known-present / known-absent blocks and
  the prober that fills it without blocking;
- ``client.S3Client``: the S3 requests (obstore), credentials from the AWS chain;
- ``mooncake_client.MooncakeClient``: the same objects in a Mooncake Store
  (``backend: mooncake``); ``backends.CLIENTS`` maps each backend to its client.
- ``tier.RemoteTier``: the tier's ``TierSpec``; ``manager.RemoteOffloadingManager``
  (scheduler: membership, probes, pending uploads) and ``hit_check`` (scheduler, under
  vLLM: every rank's object verified before a hit); ``handlers`` (workers: uploads from
  CPU slots, verified downloads into CPU slots or the KV cache).

Needs the ``s3`` extra (``pip install 'tiered-kv[s3]'``): importing this package does
not, opening a store does. The names below resolve on first use, so importing
``tiered_kv.remote.config`` (as ``tiered_kv.config`` does) loads no other part of the tier.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AccessDenied": "client",
    "BucketMissing": "client",
    "RemoteSetupError": "client",
    "Unavailable": "client",
    "RemoteConfig": "config",
    "Membership": "membership",
    "MembershipCache": "membership",
    "MembershipProber": "membership",
    "RemoteLookup": "membership",
    "Rejected": "object_format",
    "PutOutcome": "outcomes",
    "RemoteStats": "outcomes",
    "RemoteStore": "store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
