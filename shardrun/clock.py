"""One clock per process: monotonic, anchored once to wall-clock time.

`now()` returns `wall0 + (monotonic() - mono0)` in seconds, so durations never go negative (NTP
steps cannot reach them) and shards started on one machine line up on a shared time axis.
"""

import time


class Clock:
    """Monotonic seconds that read like Unix time."""

    __slots__ = ("_mono0", "_wall0")

    def __init__(self) -> None:
        self._wall0 = time.time()
        self._mono0 = time.monotonic()

    def now(self) -> float:
        """Current anchored time in seconds since the Unix epoch."""
        return self._wall0 + (time.monotonic() - self._mono0)
