"""The pacing of the disk tier's block checksums on the GIL (``RunChecksums``).

Runs wherever a disk store runs (a worker process, its disk I/O process, the inspector),
on the store's checksum threads; no I/O: it hashes bytes already in host memory. The
checksum functions are ``tiered_kv.checksums``'s, shared with the other tiers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tiered_kv.checksums import checksum_function
from tiered_kv.disk.store.io_backends import MAX_IO_BYTES

__all__ = ["RunChecksums"]


class RunChecksums:
    """The checksums (``checksum_function(name)``) of runs of blocks, each block given as
    byte views hashed where they lie (``SlotViews.pieces``, or one view of a packed row).
    Called on the store's checksum threads, for the blocks a write has just sent or a
    read has just filled, beside the I/O threads and any Python thread of the engine.

    It lets go of the GIL about once per ``_HOLD_GIL_FOR`` bytes hashed: a one-piece
    block of at least that in the hashing call itself (xxhash and crc32c let go of it
    there), everything else holding the GIL, letting go once (``time.sleep(0)``) when
    that much was hashed and at the end of each run. Each letting go has its price:
    taking the GIL back waits behind a busy Python thread for up to the interpreter's
    switch interval, so hashing 0.5 MiB blocks one call each, or a block piece by piece
    each piece letting go, starved the checksums beside one (docs/benchmarks.md,
    "Disk tier"). Never letting go costs the other way: an I/O
    thread back from its call waits for the GIL until the holder lets go, so a checksum
    thread that held it from one queued block to the next kept the I/O threads from
    their next calls for up to the switch interval."""

    def __init__(self, name: str):
        self.one_call = checksum_function(name)
        if name == "xxh3_64":
            import xxhash

            def held(pieces: Sequence[memoryview]) -> int:
                h = xxhash.xxh3_64()
                for piece in pieces:
                    for at in range(0, len(piece), _HELD_UPDATE):
                        h.update(piece[at : at + _HELD_UPDATE])
                return h.intdigest()
        else:  # crc32c continues from a previous value
            import crc32c

            def held(pieces: Sequence[memoryview]) -> int:
                value = 0
                for piece in pieces:
                    value = crc32c.crc32c(piece, value, _KEEP_GIL)
                return value

        self.held = held

    def __call__(self, run: Sequence[Sequence[memoryview]]) -> list[int]:
        out = []
        held_bytes = 0  # hashed holding the GIL since it last let go
        for pieces in run:
            if len(pieces) == 1 and len(pieces[0]) >= _HOLD_GIL_FOR:
                out.append(self.one_call(pieces[0]))
                continue
            out.append(self.held(pieces))
            held_bytes += sum(map(len, pieces))
            if held_bytes >= _HOLD_GIL_FOR:
                time.sleep(0)  # lets go of the GIL (and takes it back)
                held_bytes = 0
        if held_bytes:
            time.sleep(0)
        return out


#: crc32c's ``gil_release_mode`` that hashes holding the GIL (its default lets go of it
#: for every buffer from 32 KiB).
_KEEP_GIL = 0
#: Held hashing gives xxhash at most this much at a time: it lets go of the GIL for an
#: update over 64 KiB.
_HELD_UPDATE = 32 << 10
#: ``RunChecksums`` lets go of the GIL about once per this many bytes hashed: the most
#: one I/O call moves, so about once per call.
_HOLD_GIL_FOR = MAX_IO_BYTES
