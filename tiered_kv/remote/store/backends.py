"""Which ``ObjectClient`` serves ``remote.backend``: one line per backend.

Imported by the store in whichever process opens the tier; no I/O here (each client
connects when built).
"""

from __future__ import annotations

from collections.abc import Callable

from tiered_kv.remote.store.client import ObjectClient, S3Client
from tiered_kv.remote.config import RemoteConfig
from tiered_kv.remote.store.mooncake_client import MooncakeClient

#: ``remote.backend`` -> the client built from the config.
CLIENTS: dict[str, Callable[[RemoteConfig], ObjectClient]] = {
    "s3": S3Client,
    "mooncake": MooncakeClient,
}


def open_client(config: RemoteConfig) -> ObjectClient:
    """The client of ``config.backend``."""
    return CLIENTS[config.backend](config)
