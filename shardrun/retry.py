"""Which failed attempts are retried, how long to wait, and the per-shard retry budget.

The wait comes from tenacity's `wait_random_exponential` (exponential backoff with full jitter),
used as the small pure object it is: it only reads the attempt number. A server's Retry-After is
a floor under that wait. The budget (Envoy/gRPC style) caps retries at
`budget_ratio × first attempts + budget_floor`, so a failing endpoint is never hammered.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any, cast

import tenacity

from shardrun.ratelimit import parse_duration

RETRYABLE_STATUSES = frozenset(
    {
        "http_429",
        "http_5xx",
        "timeout_connect",
        "timeout_first_token",
        "timeout_idle",
        "timeout_total",
        "conn_reset",
        "protocol_error",
    }
)
RETRYABLE_4XX = frozenset({408, 409})


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Retry settings of a job (see the `retry:` section of the job file)."""

    max_attempts: int = 4
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    budget_ratio: float = 0.2
    budget_floor: int = 10
    # A server asking for a longer wait than this dead-letters the item instead of sleeping.
    max_server_wait_s: float = 300.0
    # An endpoint that fails every request (`outage`) for this long stops the run.
    outage_s: float = 600.0


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do after a failed attempt."""

    retry: bool
    wait: float = 0.0
    # "backoff" or "server" when retrying ("stream_cut", "list_only": the shard's free retry of
    # an item's first stream cut mid-answer, or of its first failure with no answer while only
    # the server's model list answers); the dead-letter reason otherwise.
    why: str = ""


class RetryBudget:
    """Counts first attempts and retries of one shard; retries may not outgrow the ratio."""

    __slots__ = ("first_attempts", "floor", "ratio", "retries")

    def __init__(self, ratio: float, floor: int) -> None:
        self.ratio = ratio
        self.floor = floor
        self.first_attempts = 0
        self.retries = 0

    def allows_retry(self) -> bool:
        return self.retries < self.ratio * self.first_attempts + self.floor


@dataclass(frozen=True, slots=True)
class _AttemptState:
    """The one field tenacity's wait strategies read from a RetryCallState."""

    attempt_number: int


class Retrier:
    """Decides retries for one shard."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.budget = RetryBudget(policy.budget_ratio, policy.budget_floor)
        self._wait = tenacity.wait_random_exponential(
            multiplier=policy.backoff_s, max=policy.backoff_max_s
        )

    def backoff(self, attempt: int) -> float:
        """Full-jitter exponential wait after failed attempt number `attempt`."""
        state = cast(Any, _AttemptState(attempt))
        return float(self._wait(state))

    def decide(
        self,
        status: str,
        http_status: int | None,
        attempt: int,
        retry_after: str | None = None,
        rate_headers: Mapping[str, str] | None = None,
        *,
        budgeted: bool = True,
    ) -> Decision:
        """Retry or give up after a failed attempt; spends budget when retrying (unless not
        `budgeted`: a storm's retries go one at a time, `shardrun.outage`).

        Never retries sooner than the server asked (Retry-After, or on 429/503 the
        x-ratelimit-reset-* headers); a wait above `max_server_wait_s` gives up instead, but
        not in a storm (not `budgeted`): there the item is held with the others, and the
        shard's probe waits at most `max_server_wait_s` (`Shard._storm_failed`).
        """
        if not is_retryable(status, http_status):
            return Decision(False, why=f"not_retryable_{status}")
        if attempt >= self.policy.max_attempts:
            return Decision(False, why="max_attempts")
        asked = server_wait(http_status, retry_after, rate_headers or {})
        if asked is not None and asked > self.policy.max_server_wait_s:
            if budgeted:
                return Decision(False, why="server_wait_too_long", wait=asked)
            # Every request fails alike: the ask is the server's, not this item's trouble.
            asked = self.policy.max_server_wait_s
        if budgeted:
            if not self.budget.allows_retry():
                return Decision(False, why="retry_budget_exhausted")
            self.budget.retries += 1
        wait = self.backoff(attempt)
        if asked is not None and asked > wait:
            return Decision(True, wait=asked, why="server")
        return Decision(True, wait=wait, why="backoff")


def server_wait(
    http_status: int | None, retry_after: str | None, rate_headers: Mapping[str, str]
) -> float | None:
    """The longest wait the server asked for, in seconds, or None when it asked for none."""
    asks = [parse_retry_after(retry_after)]
    if http_status in (429, 503):
        for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
            asks.append(parse_duration(rate_headers.get(name)))
    found = [a for a in asks if a is not None]
    return max(found) if found else None


_LIMIT_ASKED = re.compile(r"Limit:? (\d+), (?:Used:? \d+, )?Requested:? (\d+)")


def over_whole_limit(error: str | None) -> bool:
    """A 429 whose words say the request alone asks more than the whole limit (OpenAI's "Request
    too large for gpt-4o ... on tokens per min (TPM): Limit 30000, Requested 45000", or the
    "Limit N, Used U, Requested R" of a plain 429 with R above N): no wait ever lets it through,
    whatever is used, so it is the item's fault, as a 4xx is, not the server's pace."""
    found = _LIMIT_ASKED.search(error or "")
    return found is not None and int(found[2]) > int(found[1])


def is_retryable(status: str, http_status: int | None) -> bool:
    if status == "http_4xx":
        return http_status in RETRYABLE_4XX
    return status in RETRYABLE_STATUSES


MS_HEADERS = ("retry-after-ms", "x-ms-retry-after-ms")
"""Headers that ask for a wait in milliseconds: OpenAI's and Azure OpenAI's 429s carry them
beside (or instead of) Retry-After, and OpenAI's own clients read them first."""


def retry_after_of(headers: Mapping[str, str]) -> str | None:
    """The wait a response asks for, as a Retry-After value: its Retry-After header, or the
    seconds its millisecond header asks (`MS_HEADERS`) when that is the longer or the only
    ask. None when it asks for none.

    A Retry-After that is an HTTP-date, in a response whose Date header is a valid one too,
    becomes the seconds from that Date to it (RFC 9110, 10.2.3): both are the server's clock,
    so a server whose clock is ahead of this machine's is waited out as long as it asked, not
    that much longer (past `max_server_wait_s`, an item dead-lettered), and one behind not
    retried at once. Without a valid Date, or with one more than a day from this machine's
    clock (a server clock that says 1970), the date is read against this machine's clock."""
    value = _on_server_clock(headers.get("Retry-After"), headers.get("Date"))
    asked = parse_retry_after(value)
    for name in MS_HEADERS:
        try:
            ms = float(headers.get(name) or "nan")
        except ValueError:
            continue
        if math.isfinite(ms) and ms >= 0 and (asked is None or ms / 1000 > asked):
            asked, value = ms / 1000, f"{ms / 1000:g}"
    return value


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP-date)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # "inf" was an endless wait: every item a 429 answered given up at once
        return max(0.0, seconds) if math.isfinite(seconds) else None
    if (when := _http_date(value)) is None:
        return None
    return max(0.0, when - (time.time() if now is None else now))


def _http_date(value: str) -> float | None:
    """An HTTP-date as a POSIX timestamp; None when it is none (a year past what a datetime
    holds, "21 Oct 99999999999", raises OverflowError: no date either)."""
    try:
        when = parsedate_to_datetime(value)
        if when.tzinfo is None:  # "-0000" or no zone: an HTTP-date is UTC, never local time
            when = when.replace(tzinfo=UTC)
        return when.timestamp()
    except (TypeError, ValueError, OverflowError):
        return None


PLAUSIBLE_DATE_S = 24 * 3600.0
"""How far a response's Date may be from this machine's clock and still be read as the
server's clock (`retry_after_of`): a clock skewed by hours still works; one that says 1970
is broken, and a Retry-After date read against it would ask for decades."""


def _on_server_clock(value: str | None, date: str | None) -> str | None:
    """A Retry-After HTTP-date as the seconds from the response's `date` (its Date header) to
    it, when both are HTTP-dates and `date` is within `PLAUSIBLE_DATE_S` of this machine's
    clock; else `value` as it is (`retry_after_of`)."""
    if not value or not date:
        return value
    try:
        float(value)
        return value  # delta-seconds
    except ValueError:
        pass
    when, sent = _http_date(value.strip()), _http_date(date.strip())
    if when is None or sent is None or abs(sent - time.time()) > PLAUSIBLE_DATE_S:
        return value
    return f"{max(0.0, when - sent):g}"
