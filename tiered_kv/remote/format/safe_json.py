"""Bounded parsing of small JSON records read from a bucket anyone may have written.

Pure functions, no I/O; used by every process that reads ``fingerprint.json`` or a probe
object (the shared tier at start-up, the inspector, the doctor). A record is read with a
size bound (``MAX_RECORD_BYTES``, enforced before the body is downloaded by the
client's ``limit``, and again here) and its nesting is checked before ``json`` parses it,
so a huge or deeply nested object costs a bounded scan, never memory or a
``RecursionError``.
"""

from __future__ import annotations

import json
from typing import Any

#: Largest record read: a fingerprint record is well under 4 KiB.
MAX_RECORD_BYTES = 64 * 1024
#: Deepest nesting of objects and arrays accepted.
MAX_DEPTH = 16


class RecordError(ValueError):
    """A record that is too large, too deep, or not a JSON object; the message says which."""


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of ``{``/``[`` outside strings (a linear scan, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x7B, 0x5B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x7D, 0x5D):
            depth -= 1
    return deepest


def load_record(data: bytes, where: str, *, max_bytes: int = MAX_RECORD_BYTES, max_depth: int = MAX_DEPTH) -> dict:
    """The JSON object in ``data``; ``RecordError`` naming ``where`` when it is larger
    than ``max_bytes``, nested deeper than ``max_depth``, not JSON or not an object."""
    if len(data) > max_bytes:
        raise RecordError(f"{where}: {len(data)} bytes, a record is at most {max_bytes}")
    depth = nesting_depth(data)
    if depth > max_depth:
        raise RecordError(f"{where}: JSON nested {depth} deep, a record is at most {max_depth}")
    try:
        value: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"{where}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value
