"""The disk tier's table of loadable blocks in LRU order (``BlockTable``), and its
eviction, which may pass over the blocks a retention rule holds (``evict_lru_past``).

Scheduler process, inside ``DiskOffloadingManager`` (which holds its lock around every
call); no I/O. Split from the manager so each module holds one concept: the table's
two generations (the blocks found at startup in numpy arrays, the ones used since in
an ``OrderedDict``) and how lookups and evictions read them.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from concurrent.futures import Future
from itertools import islice

import numpy as np


def run_into(future: Future, fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)``'s result or exception, into ``future`` (the body of a one-off thread)."""
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)


#: Prefix buckets per cold key in ``BlockTable``'s prefilter (a bit each): about one
#: new key in this many passes it.
_BUCKETS_PER_KEY = 16


def _bucket_bits(prefixes: np.ndarray) -> tuple[np.ndarray, np.uint64]:
    """A bitmap over the top bits of sorted uint64 ``prefixes``, at least
    ``_BUCKETS_PER_KEY`` buckets per prefix, with a bit set for each bucket holding one;
    and the shift that takes a prefix to its bucket."""
    bits = min(63, max(3, (len(prefixes) * _BUCKETS_PER_KEY - 1).bit_length()))
    shift = np.uint64(64 - bits)
    buckets = np.zeros(1 << (bits - 3), dtype=np.uint8)
    if len(prefixes):
        bucket = prefixes >> shift  # sorted, so each byte's bits are one run
        byte = bucket >> np.uint64(3)
        bit = np.left_shift(1, (bucket & np.uint64(7)).astype(np.uint8), dtype=np.uint8)
        starts = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1])))
        buckets[byte[starts]] = np.bitwise_or.reduceat(bit, starts)
    return buckets, shift


def _in_buckets(buckets: np.ndarray, shift: np.uint64, prefixes: np.ndarray) -> np.ndarray:
    """Whether each of uint64 ``prefixes`` falls in a bucket that ``_bucket_bits`` set."""
    bucket = prefixes >> shift
    return ((buckets[bucket >> np.uint64(3)] >> (bucket & np.uint64(7)).astype(np.uint8)) & 1).astype(bool)


class BlockTable:
    """Loadable blocks in LRU order.

    Blocks found at startup form a "cold" generation kept in numpy arrays (hashes sorted,
    slots, LRU order by the index's last access), so opening a large cache creates no
    per-block objects. A cold block that is touched moves to the "hot" OrderedDict; every
    hot block was used after startup, hence is more recent than every cold one, so the
    LRU order is: cold (by last access), then hot. The cold LRU order is sorted on a
    thread of its own (numpy sorts without the GIL), so a restart does not wait for it:
    only the first eviction from the cold generation does, if it comes that soon.
    While cold blocks remain, evictions read the LRU order a window at a time with
    numpy, and a batch of lookups is prefiltered by key prefix (a bitmap, then
    ``searchsorted``); still about twice a hot table's cost per call, so the manager
    empties the cold generation into the hot one in the background (``warm_up``, a
    second or so per million blocks; docs/benchmarks.md, "Scheduler cost").
    """

    def __init__(self) -> None:
        self.hot: OrderedDict[bytes, int] = OrderedDict()
        self._forget_cold()

    def _forget_cold(self) -> None:
        """An empty cold generation (at first, and once ``warm_up`` emptied it)."""
        self._keys = np.zeros((0, 1), dtype=np.uint8)  # (n, L) sorted rows
        # First 8 bytes of each row as a big-endian int, in row order: a list for bisect
        # (one key) and an array for searchsorted (a batch).
        self._prefix: list[int] = []
        self._prefix_array = np.zeros(0, dtype=np.uint64)
        # A bit per bucket of prefixes (their top bits), set where some cold key falls:
        # most keys a batch asks about are new, and one bit each rules them out.
        self._buckets = np.zeros(1, dtype=np.uint8)
        self._bucket_shift = np.uint64(63)
        self._key_len = 0
        self._slots = np.zeros(0, dtype=np.int64)
        self._alive = np.zeros(0, dtype=bool)
        self._lru_sort: Future | None = None  # sorts the cold LRU order: the next _lru
        self._lru = np.zeros(0, dtype=np.int64)  # cold indices, least recent first
        self._cursor = 0  # _lru[:_cursor] are all dead
        self._cold_count = 0

    def load_cold(self, keys: np.ndarray, slots: np.ndarray, last_access: np.ndarray) -> None:
        """Install startup blocks: ``keys`` uint8 ``(n, L)`` rows in ascending byte order."""
        n, length = keys.shape
        self._keys, self._key_len = keys, length
        if length >= 8:
            head = np.ascontiguousarray(keys[:, :8])
        else:
            head = np.zeros((n, 8), dtype=np.uint8)
            head[:, :length] = keys
        # bisect on a list beats numpy per call; native ints convert faster than big-endian
        self._prefix_array = head.view(">u8").reshape(n).astype(np.uint64)
        self._prefix = self._prefix_array.tolist()
        self._buckets, self._bucket_shift = _bucket_bits(self._prefix_array)
        self._slots = slots.astype(np.int64, copy=False)
        self._alive = np.ones(n, dtype=bool)
        self._lru_sort = Future()
        threading.Thread(
            target=run_into, args=(self._lru_sort, np.argsort, last_access), name="tkv-disk-lru-order", daemon=True
        ).start()
        self._cursor = 0
        self._cold_count = n

    def _cold_index(self, h: bytes) -> int:
        if not self._cold_count or len(h) != self._key_len:
            return -1
        q = int.from_bytes(h[:8].ljust(8, b"\0"), "big")
        prefix = self._prefix
        i = bisect.bisect_left(prefix, q)
        if i == len(prefix) or prefix[i] != q:
            return -1
        if self._cold_key(i) != h:
            # Keys sharing their first 8 bytes (never for digests, but for keys such as
            # counters): bisect the whole keys of that run, never walk it.
            end = bisect.bisect_right(prefix, q, i)
            i += bisect.bisect_left(range(i, end), h, key=self._cold_key)
            if i == end or self._cold_key(i) != h:
                return -1
        return i if self._alive[i] else -1

    def _cold_key(self, i: int) -> bytes:
        return self._keys[i].tobytes()

    def __len__(self) -> int:
        return len(self.hot) + self._cold_count

    def __contains__(self, h: bytes) -> bool:
        return self.get(h) is not None

    def among(self, hashes: Iterable[bytes]) -> set[bytes]:
        """The members of ``hashes`` that are in the table."""
        if not self._cold_count:
            return set(filter(self.hot.__contains__, hashes))
        hot = self.hot
        return {h for h in hashes if h in hot or self._cold_index(h) >= 0}

    def absent_among(self, hashes: Iterable[bytes], also: Container[bytes]) -> list[bytes]:
        """The members of ``hashes``, in order, in neither the table nor ``also``."""
        hot = self.hot
        absent = [h for h in hashes if h not in hot and h not in also]
        if self._cold_count and absent:
            maybe = self._maybe_cold(absent)
            absent = [h for h, m in zip(absent, maybe) if not m or self._cold_index(h) < 0]
        return absent

    def _maybe_cold(self, hashes: list[bytes]) -> list[bool]:
        """For each of ``hashes``, whether its first 8 bytes start some cold key: a
        batch prefilter for ``_cold_index``, where a bisect each costs a few
        microseconds. A new digest almost never passes it: its prefix bucket's bit
        rules out all but about one in 16 with one memory access, and a search of
        the sorted prefixes the rest. A search for every key costs more: between the
        scheduler's other work, the 2 MiB of prefixes of 256k blocks fall out of the
        CPU caches (docs/benchmarks.md, "Scheduler cost", the restarted cascade)."""
        length = self._key_len
        if length < 8 or any(len(h) != length for h in hashes):
            return [True] * len(hashes)
        rows = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), length)
        q = np.ascontiguousarray(rows[:, :8]).view(">u8").reshape(-1).astype(np.uint64)
        maybe = _in_buckets(self._buckets, self._bucket_shift, q)
        ask = np.flatnonzero(maybe)
        if len(ask):
            prefixes = self._prefix_array
            pos = np.minimum(np.searchsorted(prefixes, q[ask]), len(prefixes) - 1)
            maybe[ask] = prefixes[pos] == q[ask]
        return maybe.tolist()

    def get(self, h: bytes) -> int | None:
        slot = self.hot.get(h)
        if slot is not None or not self._cold_count:
            return slot
        i = self._cold_index(h)
        return int(self._slots[i]) if i >= 0 else None

    def add_many(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """Insert each ``(hash, slot)`` in turn as the most recently used."""
        hot = self.hot
        before = len(hot)
        hot.update(blocks)  # new keys go to the end in order: the usual case, in one C call
        if len(hot) - before != len(blocks):  # some were there already: move each in turn
            for h, _ in blocks:
                hot.move_to_end(h)

    def touch(self, h: bytes) -> bool:
        if h in self.hot:
            self.hot.move_to_end(h)
            return True
        i = self._cold_index(h)
        if i < 0:
            return False
        self._kill(i)
        self.hot[h] = int(self._slots[i])
        return True

    def remove(self, h: bytes) -> int | None:
        slot = self.hot.pop(h, None)
        if slot is not None:
            return slot
        i = self._cold_index(h)
        if i < 0:
            return None
        self._kill(i)
        return int(self._slots[i])

    def _kill(self, i: int) -> None:
        self._alive[i] = False
        self._cold_count -= 1

    def evict_lru(self, n: int, *keep: Container[bytes]) -> tuple[list[bytes], list[int]] | None:
        """Remove the ``n`` least recently used blocks whose hash is in none of ``keep``
        and return their hashes and slots; None, changing nothing, if there are fewer."""
        hot = self.hot
        keep = tuple(k for k in keep if k)
        if not self._cold_count and n <= len(hot):
            # Usually the first n of the hot generation (cheaper than n popitem calls):
            # the blocks being read were just looked up.
            victims = list(islice(hot, n))
            if not any(any(map(k.__contains__, victims)) for k in keep):
                return victims, list(map(hot.pop, victims))
        cold, victims, dead_upto = self._cold_victims(n, keep)
        if len(victims) < n:
            for h in hot:
                if not any(h in k for k in keep):
                    victims.append(h)
                    if len(victims) == n:
                        break
            if len(victims) < n:
                return None
        slots = self._slots[cold].tolist()
        if cold:
            self._alive[cold] = False
            self._cold_count -= len(cold)
            self._cursor = dead_upto
        slots.extend(map(hot.pop, victims[len(cold) :]))
        return victims, slots

    def evict_lru_past(
        self, n: int, held: Container[bytes] | None, *keep: Container[bytes]
    ) -> tuple[list[bytes], list[int]] | None:
        """``evict_lru``, passing over the blocks in ``held`` (a retention rule's holds)
        while others can go: those are taken last, least recent first, so a hold never
        keeps a store out; None, changing nothing, if even they are too few."""
        if held is None:
            return self.evict_lru(n, *keep)
        out = self.evict_lru(n, held, *keep)
        if out is not None:
            return out
        # Rare: held, pinned and protected blocks fill nearly all the tier. One pass.
        keep = tuple(k for k in keep if k)
        free: list[bytes] = []
        kept: list[bytes] = []
        for h, _ in self.iter_lru():
            if not any(h in k for k in keep):
                (kept if h in held else free).append(h)
        victims = (free + kept)[:n]
        if len(victims) < n:
            return None
        return victims, [slot for h in victims if (slot := self.remove(h)) is not None]

    def _cold_victims(self, n: int, keep: tuple[Container[bytes], ...]) -> tuple[list[int], list[bytes], int]:
        """Up to ``n`` live cold blocks in LRU order whose hash is in none of ``keep``: their
        indices and hashes (changing nothing), and the LRU position before which every
        cold block is dead once they are (where ``_cursor`` may go then). Reads the LRU
        order a window at a time with numpy: after a restart every eviction comes from
        here, for a while."""
        if not self._cold_count:
            return [], [], self._cursor
        if keep:
            self._skip_dead()
        else:  # the windows below pass dead blocks as they go, and move the cursor past them
            self.wait_sorted()
        lru, alive, length = self._lru, self._alive, self._key_len
        indices: list[int] = []
        hashes: list[bytes] = []
        pos = dead_upto = self._cursor
        while len(indices) < n and pos < len(lru):
            window = lru[pos : pos + n + n // 4 + 64]  # from _cursor the cold blocks are mostly live
            if not keep:  # the usual case: every live block qualifies, take what is missing
                live = np.flatnonzero(alive[window])
                wanted = live[: n - len(indices)]
                # All dead then up to the last one taken, or through the window if it had no more.
                dead_upto = pos + (int(wanted[-1]) + 1 if len(wanted) < len(live) else len(window))
                taken = window[wanted]
                rows = self._keys[taken].tobytes()
                indices.extend(taken.tolist())
                hashes.extend([rows[j : j + length] for j in range(0, len(rows), length)])
            else:
                live = window[alive[window]]
                rows = self._keys[live].tobytes()
                for i, h in zip(live.tolist(), (rows[j : j + length] for j in range(0, len(rows), length))):
                    if any(h in k for k in keep):
                        continue
                    indices.append(i)
                    hashes.append(h)
                    if len(indices) == n:
                        break
            pos += len(window)
        return indices, hashes, dead_upto

    def wait_sorted(self) -> None:
        """Wait for the cold LRU order (shutdown: leave no thread behind)."""
        if self._lru_sort is not None:
            self._lru, self._lru_sort = self._lru_sort.result(), None

    def sorted_soon(self) -> None:
        """Wait until ``wait_sorted`` will not (from any thread; changes nothing)."""
        pending = self._lru_sort
        if pending is not None:
            pending.exception()

    def warm_up(self, n: int) -> bool:
        """Move up to ``n`` of the most recent cold blocks to the hot generation, in
        front of every hot block (they are older), so the LRU order stays as it was.
        The cold generation makes a restart instant, but every lookup of a new hash
        and every eviction costs more there (docs/benchmarks.md, "Scheduler cost"); once
        it is empty the table is as if it had never restarted. Returns whether cold
        blocks remain."""
        if self._cold_count:
            self.wait_sorted()
            lru, hot = self._lru, self.hot
            start = max(self._cursor, len(lru) - n)
            tail = lru[start:]
            live = tail[self._alive[tail]][::-1]  # most recent first: each goes to the front
            rows, length = self._keys[live].tobytes(), self._key_len
            for at, slot in zip(range(0, len(rows), length), self._slots[live].tolist()):
                h = rows[at : at + length]
                hot[h] = slot
                hot.move_to_end(h, last=False)
            self._alive[live] = False
            self._cold_count -= len(live)
            self._lru = lru[:start]  # what is left of the cold order
        if self._cold_count:
            return True
        if len(self._keys):
            self.wait_sorted()  # leave no sorting thread behind
            self._forget_cold()
        return False

    def _skip_dead(self) -> None:
        """Wait for the cold LRU order, then move ``_cursor`` past its dead head (evicted
        or touched blocks), a window at a time."""
        self.wait_sorted()
        lru, alive = self._lru, self._alive
        step = 64  # growing: the dead head is usually the last eviction's few hundred
        while self._cursor < len(lru):
            window = alive[lru[self._cursor : self._cursor + step]]
            if window.any():
                self._cursor += int(window.argmax())
                return
            self._cursor += len(window)
            step = min(4 * step, 4096)

    def iter_lru(self) -> Iterator[tuple[bytes, int]]:
        """``(hash, slot)`` from least to most recently used. Do not mutate meanwhile."""
        self._skip_dead()
        if self._cold_count:
            for i in self._lru[self._cursor :]:
                if self._alive[i]:
                    yield self._cold_key(int(i)), int(self._slots[i])
        yield from self.hot.items()
