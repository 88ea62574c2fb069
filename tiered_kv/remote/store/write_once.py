"""Write-once object writes, on servers with and without conditional PUT.

Runs wherever a ``RemoteStore`` runs, on its thread pool: each ``put`` is one blocking
request (a conditional PUT), or two (HEAD, then a plain PUT) on a server that does not
implement ``If-None-Match: *``. Holds no bytes of its own.

Why the fallback keeps the tier's guarantees (``store``'s docstring says it whole): a
single PUT is atomic on S3, so a reader gets a whole object or none; what the condition
adds is that a second writer of the same key does not replace the first. Without it,
two nodes racing between HEAD and PUT may both write the key. Between nodes of one key
both objects verify (fingerprint and checksum in the header), so whichever one a reader
gets is a valid copy of the block; a node sealing with another key (misconfigured, or
ahead in a rotation) may replace the fleet's copy with one the fleet cannot open, a miss
for that block until the object goes (``inspect verify --remote`` names such objects).
Never wrong KV: a reader serves only what its own keys open.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from tiered_kv.remote.store.client import Buffer, ConditionalPutRefused, ObjectClient
from tiered_kv.remote.config import RemoteConfig

logger = logging.getLogger(__name__)


class WriteOnce:
    """Writes of new objects through ``client`` under ``config.conditional_put``.

    ``auto`` sends ``If-None-Match: *`` until the server first refuses it as unsupported
    (``ConditionalPutRefused``), then logs one warning and writes every object with an
    existence check and a plain PUT; ``always`` never falls back (the refusal is raised);
    ``never`` always checks then PUTs. Thread-safe.
    """

    def __init__(self, client: ObjectClient, config: RemoteConfig):
        self._client = client
        self._config = config
        self._mode = config.conditional_put
        self._conditional = self._mode != "never"
        self._lock = threading.Lock()
        #: Conditional PUTs the server refused as unsupported (more than one only when
        #: several were in flight when the first refusal came back).
        self.refused = 0
        #: Plain PUTs sent after an existence check found no object.
        self.unconditional = 0

    @property
    def conditional(self) -> bool:
        """Whether writes send ``If-None-Match: *`` now."""
        return self._conditional

    def put(self, key: str, parts: Sequence[Buffer]) -> bool:
        """Write ``parts`` as the object ``key`` unless it exists: True if written, False
        if it was there. Raises the client's ``RemoteError`` on a failed request, and
        ``ConditionalPutRefused`` only under ``always``."""
        if self._conditional:
            try:
                return self._client.put_new(key, parts)
            except ConditionalPutRefused as exc:
                self._refused(exc)
        if self._client.exists(key):
            return False
        self._client.put(key, parts)
        with self._lock:
            self.unconditional += 1
        return True

    def _refused(self, exc: ConditionalPutRefused) -> None:
        with self._lock:
            self.refused += 1
            first = self._conditional and self._mode == "auto"
            if self._mode == "auto":
                self._conditional = False
        if self._mode == "always":
            raise exc
        if first:
            logger.warning(
                "shared tier: %s refused a conditional PUT (If-None-Match: *) as unsupported (%s). "
                "Writing each block with an existence check (HEAD) and a plain PUT from now on: a "
                "single PUT is still atomic, so no reader sees a partial object; two nodes storing "
                "the same block at once may both write it: harmless between nodes of one key, but a node "
                "with another key can then replace the fleet's copy with one the fleet cannot open (a miss). "
                "Set remote.conditional_put to 'never' to skip the attempt, or 'always' to refuse "
                "such a server.",
                self._config.where(),
                exc,
            )
