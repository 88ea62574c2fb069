"""Value parsers every configuration shares: sizes in human units, booleans, choices,
positive integers, text and directory paths, and the error they raise; and how a value
is shown in a message (``show``), which never echoes what looks like a key
(``looks_like_key``, ``holds_key``).

Imported by ``tiered_kv.config`` and by each tier's own settings (``tiered_kv.remote.config``);
imports neither. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid."""


#: A size given as a bare number (no unit) below this is taken for a mistake: "cpu_bytes":
#: 64 meant 64 GiB, not 64 bytes. Write "64B" to mean bytes.
MIN_BARE_SIZE = 1024**2
#: Nothing in the hierarchy can address more bytes than a signed 64-bit offset.
MAX_SIZE = 2**63 - 1


#: What ``show`` prints instead of a value that may be a key.
REDACTED = "<redacted: looks like key material>"
#: A key of 32 bytes or more (the fleet key's size) written as hex (64 digits), or as
#: base64 of either alphabet (43 characters, padding aside) with both upper- and
#: lower-case letters: random base64 that long has both (all but about one key in 10^9),
#: a name written in one case (an environment variable, most paths) has not. A long name
#: in mixed case without a separator matches too, and is then treated as a key. Other
#: encodings are not recognized: a key file or variable holds hex or base64 only.
_HEX_RUN = re.compile(r"[0-9a-fA-F]{64,}")
_BASE64_RUNS = (re.compile(r"[A-Za-z0-9+/]{43,}"), re.compile(r"[A-Za-z0-9_-]{43,}"))
#: Characters no key holds, which split a pasted value into tokens: white space and commas
#: (between keys, as in a key file) and what sticks to a key copied from a shell or an
#: env file (``KEY=...``, quotes).
_KEY_SEPARATORS = re.compile(r"[\s,;:='\"]+")


def _mixed_case(text: str) -> bool:
    return any(c.isupper() for c in text) and any(c.islower() for c in text)


def holds_key(text: str) -> bool:
    """Whether ``text`` holds a key anywhere in it (``_HEX_RUN``, ``_BASE64_RUNS``): a
    message never shows such a text, even where it is mostly something else
    ("KEY=<key>", a path ending in one)."""
    return bool(_HEX_RUN.search(text)) or any(
        _mixed_case(m.group()) for run in _BASE64_RUNS for m in run.finditer(text)
    )


def looks_like_key(value: Any) -> bool:
    """Whether the setting ``value`` is key material pasted where a name goes: one of its
    tokens (``_KEY_SEPARATORS``) is a key, or one of its '/'-separated pieces holds one.
    Narrower than ``holds_key``, so that a path whose directories add up to 43 base64
    characters in mixed case is not taken for a key (a ``.``, ``-`` or ``_`` breaks a
    run of the standard alphabet, a ``.`` a run of either)."""
    if not isinstance(value, str):
        return False
    for token in _KEY_SEPARATORS.split(value):
        if _HEX_RUN.fullmatch(token) or any(run.fullmatch(token) and _mixed_case(token) for run in _BASE64_RUNS):
            return True
    return any(holds_key(piece) for piece in value.split("/"))


def redact(text: str) -> str:
    """``text``, or ``REDACTED`` where it holds a key: for names (of files, of variables)
    printed as they are."""
    return REDACTED if holds_key(text) else text


def show(value: Any) -> str:
    """``value`` as the config file spells it: null, true, NaN, Infinity, 'text'; or
    ``REDACTED`` where it holds a key (``holds_key``), whichever setting it was given for."""
    if holds_key(repr(value)):
        return REDACTED
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return repr(value)


def parse_size(value: Any, key: str = "size", example_unit: str = "GiB") -> int:
    """Bytes from a string such as ``"64GiB"``, ``"1.5 TB"``, ``"512MiB"``, ``"4096B"``, or
    a bare number of bytes of at least 1 MiB.

    Raises ``ConfigError`` naming ``key`` for anything else: sizes <= 0, non-finite
    numbers, and a bare number (``64``, ``"64"``) under 1 MiB, which is almost always a
    forgotten unit (the message says how to write bytes on purpose, and suggests
    ``example_unit``: GiB for a tier, KiB or MiB for a block).
    """
    expected = "expected a size such as 64GiB or a byte count"
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{key}: {expected}, got {show(value)}")
    bare = True
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {expected}, got {show(value)} (not a finite number)")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{key}: cannot parse size {show(value)}; expected a number with an optional unit "
                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '64GiB'"
            )
        bare = unit == ""
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(f"{key}: {expected}, got {show(value)} ({type(value).__name__})")
    if n <= 0:
        raise ConfigError(f"{key}: size must be positive, got {show(value)}")
    if n > MAX_SIZE:
        raise ConfigError(f"{key}: {show(value)} is too large (at most {MAX_SIZE} bytes)")
    if bare and n < MIN_BARE_SIZE:
        raise ConfigError(
            f"{key}: {show(value)} has no unit, so it would mean {n} bytes; sizes without a unit "
            f"must be at least 1 MiB ({MIN_BARE_SIZE} bytes). Write a unit, e.g. '{n}{example_unit}', or "
            f"'{n}B' if you mean bytes"
        )
    return n


def format_size(n: int) -> str:
    """``1073741824`` -> ``"1.00 GiB"``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{key}: expected true or false, got {show(value)}")


def parse_choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ConfigError(f"{key}: expected one of {', '.join(choices)}; got {show(value)}")


def parse_positive_int(value: Any, key: str, maximum: int | None = None) -> int:
    expected = "a positive integer" if maximum is None else f"an integer from 1 to {maximum}"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key}: expected {expected}, got {show(value)}")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{key}: expected {expected}, got {show(value)}") from None
    if n <= 0 or (maximum is not None and n > maximum):
        raise ConfigError(f"{key}: expected {expected}, got {show(value)}")
    return n


def parse_text(value: Any, key: str, *, empty_ok: bool = False, numbers_ok: bool = False) -> str:
    """A string setting. null is refused (it would otherwise become the text "None"):
    omitting the key is how to ask for the default."""
    if numbers_ok and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        what = "a string or an integer" if numbers_ok else "a string"
        hint = "; omit the key to use the default" if value is None else ""
        raise ConfigError(f"{key}: expected {what}, got {show(value)}{hint}")
    if not empty_ok and not value.strip():
        raise ConfigError(f"{key}: expected a non-empty string, got {show(value)}; omit the key to use the default")
    return value


def parse_disk_path(value: Any, key: str) -> str | None:
    """A directory path; null or "" means no disk tier. Anything but a string is refused
    (``false`` would otherwise become a directory named ``False``)."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"{key}: expected a directory path (a string), got {show(value)}; omit the key for no disk tier"
        )
    if "\0" in value:
        raise ConfigError(f"{key}: a path cannot contain a NUL character, got {show(value)}")
    return value if value.strip() else None


CHECKSUMS = ("xxh3_64", "crc32c")
#: The checksum of blocks on disk and in the shared tier unless a config names another.
DEFAULT_CHECKSUM = CHECKSUMS[0]
#: A disk tier's I/O: the engine under its reads and writes (``auto``: KvikIO where it
#: can run, else POSIX O_DIRECT), the threads of each store, and where they run
#: (``thread``: in the worker process; ``process``: a helper process per worker).
IO_BACKENDS = ("auto", "kvikio", "posix")
DEFAULT_IO_THREADS = 4
#: Each disk store starts its I/O threads at open, in every worker and I/O process.
MAX_IO_THREADS = 256
DISK_IO = ("thread", "process")


#: Session retention's budget share of a tier's slots (``cpu_retention``, a disk tier's
#: ``retention``), and the most a config may give it: the replays of docs/benchmarks.md
#: ("CPU admission against Belady") found 0.75 and 0.9 both above 0.5, and 0.9 no
#: better where RAM is scarce.
DEFAULT_RETENTION_SHARE = 0.75
MAX_RETENTION_SHARE = 0.9
_SESSION_RE = re.compile(r"^session(?:\((\d*\.?\d+)\))?$")


def parse_retention(value: Any, key: str, tier: str = "the CPU tier") -> str:
    """``"none"``, ``"session"`` or ``"session(S)"`` (S: the share of ``tier``'s slots that
    holds may take, 0 < S <= ``MAX_RETENTION_SHARE``), in canonical spelling; raises
    ``ConfigError`` naming the bad value (``tiered_kv.tiered.retention``)."""
    if value is None or value == "none":
        return "none"
    m = _SESSION_RE.match(value.replace(" ", "")) if isinstance(value, str) else None
    if m and (m.group(1) is None or 0 < float(m.group(1)) <= MAX_RETENTION_SHARE):
        return "session" if m.group(1) is None else f"session({float(m.group(1)):g})"
    raise ConfigError(
        f"{key}: expected 'none', 'session' or 'session(S)' with 0 < S <= {MAX_RETENTION_SHARE} (hold each "
        f"returning session's latest blocks for its learned gap, within S x {tier}'s slots), got {show(value)}"
    )


def retention_share(value: str) -> float | None:
    """The budget share of a parsed retention value; None for ``none``."""
    m = _SESSION_RE.match(value)
    if value == "none" or m is None:
        return None
    return DEFAULT_RETENTION_SHARE if m.group(1) is None else float(m.group(1))


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_age(text: str, option: str) -> float:
    """Seconds from ``"90s"``, ``"15m"``, ``"12h"``, ``"7d"`` or ``"2w"``. A number without a
    unit is refused (is ``7`` seconds or days?), except 0. Raises ``ConfigError`` naming
    ``option`` otherwise."""
    m = _AGE_RE.match(text)
    if not m or m.group(2).lower() not in ("", *_AGE_UNITS):
        raise ConfigError(
            f"{option}: cannot parse age {show(text)}; expected a number with a unit s, m, h, d or w, e.g. 7d"
        )
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit and value != 0:
        raise ConfigError(
            f"{option}: {show(text)} has no unit; write {m.group(1)}d for days, {m.group(1)}h "
            f"for hours, {m.group(1)}m for minutes or {m.group(1)}s for seconds"
        )
    return value * _AGE_UNITS[unit or "s"]
