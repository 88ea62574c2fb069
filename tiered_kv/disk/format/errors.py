"""The disk tier's start-up error (no I/O; every process that opens a disk cache).

Its own module so that the modules that open cache files (``safe_open``, ``manifest``)
and ``namespace`` share it without importing one another.
"""

from __future__ import annotations


class NamespaceError(RuntimeError):
    """A disk-cache namespace cannot be created or opened (the message says why)."""


class DiskSizeError(NamespaceError, ValueError):
    """``disk_bytes`` cannot hold one block (a start-up error, and a bad value)."""
