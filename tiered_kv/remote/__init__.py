"""The shared tier: KV blocks in S3-compatible object storage, shared by a fleet.

Every node that serves the same model with the same settings (the same
``Fingerprint``) reads and writes one namespace of one bucket; objects carry the full
fingerprint and a checksum, verified before a byte is used (``object_format``). The
pieces, by process:

- ``config.RemoteConfig``: validated settings (both processes; no I/O);
- ``store.RemoteStore``: futures-based block uploads, downloads and existence probes
  over a bounded thread pool (worker processes for bytes, the scheduler for probes);
- ``membership``: the scheduler's cache of known-present / known-absent blocks and
  the prober that fills it without blocking;
- ``client.S3Client``: the S3 requests (obstore), credentials from the AWS chain.

Needs the ``s3`` extra (``pip install 'tiered-kv[s3]'``): importing this package does
not, opening a store does.
"""

from tiered_kv.remote.client import (
    AccessDenied,
    BucketMissing,
    RemoteSetupError,
    Unavailable,
)
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.remote.membership import (
    Membership,
    MembershipCache,
    MembershipProber,
    RemoteLookup,
)
from tiered_kv.remote.object_format import Rejected
from tiered_kv.remote.store import PutOutcome, RemoteStats, RemoteStore

__all__ = [
    "AccessDenied",
    "BucketMissing",
    "Membership",
    "MembershipCache",
    "MembershipProber",
    "PutOutcome",
    "Rejected",
    "RemoteConfig",
    "RemoteLookup",
    "RemoteSetupError",
    "RemoteStats",
    "RemoteStore",
    "Unavailable",
]
