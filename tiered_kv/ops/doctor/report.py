"""The doctor's report: one ``Check`` per line, the worst line's exit code.

Pure data, in the operator's process (``tiered-kv doctor``); no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


OK, WARN, FAIL = "ok", "warn", "fail"
#: A check that could not run (no config, a config that could not be read, a probe the
#: file system refused, ``--read-probe 0``): no verdict, so no part in the exit code.
SKIP = "skip"
EXIT_CODES = {OK: 0, WARN: 1, FAIL: 2}
STATUSES = (OK, SKIP, WARN, FAIL)


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, the verdict, what was found, and (unless
    ok) what to do about it. ``facts`` are the measured values, for ``--json``. A ``SKIP``
    line's message starts with "skipped" and says why (``skipped``)."""

    name: str
    status: str
    message: str
    fix: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "message": self.message,
            "fix": self.fix,
            "facts": dict(self.facts),
        }


def skipped(name: str, why: str, fix: str = "", facts: Mapping[str, Any] | None = None) -> Check:
    """The line of check ``name``, which could not run because of ``why``."""
    return Check(name, SKIP, f"skipped: {why}", fix, dict(facts or {}))


@dataclass
class DoctorReport:
    checks: list[Check]
    config_path: str | None = None

    @property
    def status(self) -> str:
        return max((c.status for c in self.checks if c.status != SKIP), key=EXIT_CODES.__getitem__, default=OK)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_dict(self) -> dict[str, Any]:
        counts = {s: sum(c.status == s for c in self.checks) for s in STATUSES}
        return {
            "path": self.config_path,
            "status": self.status,
            "exit_code": self.exit_code,
            "counts": counts,
            "checks": [c.to_dict() for c in self.checks],
        }
