"""The block checksums every tier records and verifies (xxh3-64 or crc32c).

Used wherever block bytes are written or read (workers, their disk I/O processes, the
scheduler's verifiers, the inspector); no I/O: it hashes bytes already in memory.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["checksum_function"]


def checksum_function(name: str) -> Callable[[memoryview], int]:
    """The 64-bit checksum ``name`` (``xxh3_64`` or ``crc32c``) over a byte view."""
    if name == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64_intdigest
    if name == "crc32c":
        try:
            import crc32c
        except ImportError:
            raise RuntimeError(
                "checksum crc32c needs the 'crc32c' package (pip install crc32c), or use checksum xxh3_64"
            ) from None
        return crc32c.crc32c
    raise ValueError(f"checksum: expected xxh3_64 or crc32c, got {name!r}")
