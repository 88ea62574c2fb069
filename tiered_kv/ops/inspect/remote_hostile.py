"""Hostile keys under a shared tier's prefix: keys that the S3 clients which parse keys
as paths cannot hold, why (``hostile_reason``), and how one is shown (``escaped_key``).

Operator's process (``tiered_kv.ops.inspect.remote`` lists them, ``tiered_kv.cli.inspect_remote``
prints them); no I/O here: the keys are bytes already listed.

A hostile key (an ASCII or other control character, a ``.`` or ``..`` segment, an empty
segment, bytes that are not UTF-8; obstore's listing fails on the whole prefix at the
first one) is listed by its bytes, shown with backslash escapes (never raw control
characters on a terminal), never read, skipped by summary, ls and verify, and deleted
only by ``clear`` (by its exact bytes, ``RawKeys.delete``). No node can have written
one: every key a node writes is this format's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostileKey:
    """A key under the prefix that S3 clients parsing keys as paths cannot hold."""

    raw: bytes
    size: int
    last_modified: float
    #: What makes it so (``hostile_reason``).
    why: str
    #: The namespace directory it lies in, where its first segment names one.
    namespace: str | None = None

    @property
    def shown(self) -> str:
        return escaped_key(self.raw)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.shown,
            "why": self.why,
            "namespace": self.namespace,
            "size": self.size,
            "last_modified": self.last_modified,
        }


def escaped_key(raw: bytes) -> str:
    """``raw`` as text safe on a terminal: printable characters as they are, a backslash
    doubled, anything else (control and format characters, bytes that are not UTF-8)
    as a backslash escape (``\\x01``, ``\\u202e``, ``\\xff``)."""
    out = []
    for c in raw.decode("utf-8", "surrogateescape"):
        o = ord(c)
        if 0xDC80 <= o <= 0xDCFF:  # a byte that is not UTF-8, as surrogateescape keeps it
            out.append(f"\\x{o - 0xDC00:02x}")
        elif c == "\\":
            out.append("\\\\")
        elif c.isprintable():
            out.append(c)
        elif o <= 0xFF:
            out.append(f"\\x{o:02x}")
        elif o <= 0xFFFF:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    return "".join(out)


def hostile_reason(raw: bytes) -> str | None:
    """Why key ``raw`` is one that clients parsing keys as paths cannot hold, or None.
    obstore (object_store's ``Path::parse``) refuses ASCII control characters, ``.`` and
    ``..`` segments and empty segments, and fails a whole listing on one; other control
    characters (C1) it takes, but they are no key of any fleet and act on a terminal. A
    trailing ``/`` (a console's folder marker) it lists under another name: such a key
    is only foreign, never read."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text):
        return "a control character"
    segments = text.split("/")
    if segments[-1] == "":
        segments.pop()
    if "" in segments:
        return "an empty segment"
    if ".." in segments:
        return "a '..' segment"
    if "." in segments:
        return "a '.' segment"
    return None
