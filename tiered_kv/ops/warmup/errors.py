"""The warm-up's error: it cannot run as asked (a one-line, operator-facing reason).

Any process that runs a warm-up (the operator's); no I/O.
"""


class WarmupError(RuntimeError):
    """The warm-up cannot run as asked (one-line, operator-facing reason)."""
