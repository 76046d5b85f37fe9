"""An enforced request limit for the simulator, as a hosted API keeps one per key.

`rpm_limit` N requests a minute is a token bucket: it refills at N/60 requests a second and
holds at most `rpm_burst` of them (0: one second's worth, ceil(N/60), since providers enforce
a per-minute limit over shorter periods rather than letting a whole minute's requests come in
one burst). A generation request that finds less than one whole request in the bucket is
answered 429 `rate_limit_exceeded`, with Retry-After the whole seconds until one would be
(rounded up, as delta-seconds are); it takes nothing from the bucket unless
`rpm_count_rejected` (OpenAI counts unsuccessful requests too), and then down to at most one
burst below empty, so a client that keeps sending is kept out longer. What the answers say of
the limit is `rpm_headers`: "openai" puts x-ratelimit-limit-requests (N),
x-ratelimit-remaining-requests (whole requests left in the bucket) and
x-ratelimit-reset-requests (until the bucket is full again, "0.35s") on every generation answer
and Retry-After on a 429; "retry_after" a 429's Retry-After only, as many gateways send; "none"
nothing at all. Each request costs one refill and one comparison.
"""

from __future__ import annotations

import math


class RequestLimit:
    """The bucket of one simulator: `take` per generation request, `headers` per answer."""

    __slots__ = ("at", "burst", "floor", "level", "limit", "rate", "rejected")

    def __init__(self, rpm: int, burst: int, count_rejected: bool) -> None:
        self.rate = rpm / 60.0
        self.burst = float(burst or math.ceil(rpm / 60))
        self.level = self.burst  # a fresh key starts with a full bucket
        self.floor = -self.burst if count_rejected else None
        self.at: float | None = None
        self.limit = str(rpm)
        self.rejected = 0

    def _refill(self, now: float) -> float:
        """The bucket's level at `now` (not stored)."""
        if self.at is None or now <= self.at:
            return self.level
        return min(self.burst, self.level + (now - self.at) * self.rate)

    def take(self, now: float) -> float:
        """One request arrives at `now`: 0.0 when the bucket lets it in, else the seconds until
        it would let one in (the request is rejected)."""
        self.level, self.at = self._refill(now), now
        if self.level >= 1.0:
            self.level -= 1.0
            return 0.0
        self.rejected += 1
        if self.floor is not None:  # a rejected request counts: the bucket goes below empty
            self.level = max(self.floor, self.level - 1.0)
        return (1.0 - self.level) / self.rate

    def headers(self, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-*-requests headers as the bucket stands at `now`."""
        level = self._refill(now)
        full_in = max(0.0, self.burst - level) / self.rate
        return {"x-ratelimit-limit-requests": self.limit,
                "x-ratelimit-remaining-requests": str(max(0, math.floor(level))),
                "x-ratelimit-reset-requests": f"{full_in:.3f}".rstrip("0").rstrip(".") + "s"}


def retry_after(wait: float) -> str:
    """Retry-After's delta-seconds for a wait: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait - 1e-9)))

