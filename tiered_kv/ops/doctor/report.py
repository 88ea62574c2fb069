"""The doctor's report: one ``Check`` per line, the worst line's exit code.

Pure data, in the operator's process (``tiered-kv doctor``); no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The line's type and its verdicts are the seam's (``tiered_kv.tier_ops``): a tier's own
# checks (``TierSpec.doctor_checks``) return them.
from tiered_kv.tier_ops import EXIT_CODES, FAIL, OK, SKIP, STATUSES, WARN, Check, skipped  # noqa: F401


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
