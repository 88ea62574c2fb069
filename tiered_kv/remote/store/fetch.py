"""Reading the object at a block's key for judgement: what its size alone proves, and
the version read, so that a node replaces only the version it judged.

Runs wherever a ``RemoteStore`` runs, on its request threads: one GET, or two for an
object of another size (the first stops at the size, the second reads up to twice the
block's object); holds nothing between calls.
"""

from __future__ import annotations

from tiered_kv.remote.format.object_format import Rejected, check_version, format_version, read_header
from tiered_kv.remote.store.client import ObjectClient, Tagged, WrongSize


def fetch_object(client: ObjectClient, key: str, expected: int, sealed: bool, writing: bool) -> Tagged | None:
    """The object at ``key`` where a block's object is ``expected`` bytes, None when there
    is none. One of another size is ``Rejected("size")``, provable to a writer only (it knows
    its block's bytes; a reader knows only its caller's buffer). Up to twice the block's
    object it is read first, for what it proves whatever the caller's size: malformed
    (truncated, padded) or unsealed where the fleet seals (``sealed``) is provably bad,
    so a damaged object does not stay every node's miss; a newer format is not. A
    rejection names the version's tag (``Rejected.tag``)."""
    try:
        return client.get_tagged(key, expected)
    except WrongSize as wrong:
        if wrong.size > 2 * expected:
            raise Rejected("size", str(wrong), provable=writing, tag=wrong.tag) from None
    try:
        found = client.get_tagged(key, limit=2 * expected)
    except WrongSize as wrong:  # replaced by a larger one meanwhile
        raise Rejected("size", str(wrong), provable=writing, tag=wrong.tag) from None
    if found is None:
        return None
    view = memoryview(found.data)
    if len(view) == expected:  # replaced by one of the block's size meanwhile: judged as any
        return found
    try:
        check_version(format_version(view), sealed)
        read_header(view)
    except Rejected as bad:
        bad.tag = found.tag
        raise
    raise Rejected("size", f"object of {len(view)} bytes, expected {expected}", provable=writing, tag=found.tag)
