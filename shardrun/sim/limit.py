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

`tpm_limit` N tokens a minute is a second bucket of the same kind (`tpm_burst`, 0: one
second's worth), charged per request what OpenAI counts: its prompt tokens (characters / 4)
plus its `max_tokens` (`max_completion_tokens`, `max_output_tokens`), or, where it sets none,
the tokens it will be answered with; never refunded. A request is let in when the bucket holds
its charge, or is full (one bigger than the bucket then takes it below empty, so the rate over
time stays N); one whose charge is above N itself never fits and is answered 429 "Request too
large ... Limit N, Requested R". Its 429 says "... on tokens per min (TPM): Limit N, Used U,
Requested R" (U: how far the bucket is below full), and `rpm_headers` "openai" adds
x-ratelimit-*-tokens to every answer as it does the requests' headers.

`rpm_stated` / `tpm_stated` S (0: the limit enforced) is the limit the answers state instead,
in x-ratelimit-limit-* and a token 429's "Limit S": a statement that does not bind the key, as a
gateway's replicas each state their own. The remaining headers are then the bucket's fullness
as a share of S (S while the key has room, 0 when the enforced bucket is empty).
"""

from __future__ import annotations

import math


class RequestLimit:
    """One bucket of a simulator (of requests, or of `kind` "tokens"): `take` per generation
    request, `headers` per answer."""

    __slots__ = ("at", "burst", "floor", "kind", "level", "limit", "rate", "rejected", "stated")

    def __init__(self, rpm: int, burst: int, count_rejected: bool, kind: str = "requests",
                 stated: int = 0) -> None:  # fmt: skip
        self.rate = rpm / 60.0
        self.kind = kind
        self.burst = float(burst or math.ceil(rpm / 60))
        self.level = self.burst  # a fresh key starts with a full bucket
        self.floor = -self.burst if count_rejected else None
        self.at: float | None = None
        self.limit = str(stated or rpm)
        # A limit stated apart from the one enforced (`rpm_stated`): the remaining counts are
        # then the bucket's fullness as a share of it, as a replica of a gateway that states its
        # own limit sees its part of the key's traffic: full while the key has room.
        self.stated = stated
        self.rejected = 0

    def _refill(self, now: float) -> float:
        """The bucket's level at `now` (not stored)."""
        if self.at is None or now <= self.at:
            return self.level
        return min(self.burst, self.level + (now - self.at) * self.rate)

    def take(self, now: float, amount: float = 1.0) -> float:
        """A request costing `amount` arrives at `now`: 0.0 when the bucket lets it in, else
        the seconds until it would (the request is rejected)."""
        self.level, self.at = self._refill(now), now
        need = min(amount, self.burst)  # one bigger than the bucket goes when it is full
        if self.level >= need:
            self.level -= amount
            return 0.0
        self.rejected += 1
        if self.floor is not None:  # a rejected request counts: the bucket goes below empty
            self.level = max(self.floor, self.level - amount)
        return (need - self.level) / self.rate

    def used(self) -> int:
        """How far the bucket is below full, as a 429's "Used" says it."""
        return round(self.burst - self.level)

    def headers(self, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-*-requests (-tokens) headers as the bucket stands at `now`."""
        level, kind = self._refill(now), self.kind
        full_in = max(0.0, self.burst - level) / self.rate
        left = level * self.stated / self.burst if self.stated else level
        return {f"x-ratelimit-limit-{kind}": self.limit,
                f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(left))),
                f"x-ratelimit-reset-{kind}": f"{full_in:.3f}".rstrip("0").rstrip(".") + "s"}


def retry_after(wait: float) -> str:
    """Retry-After's delta-seconds for a wait: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait - 1e-9)))

