"""Tests for the job-wide rate limit: token buckets, the shard limiter, server headers.

All on a fake clock whose `sleep` advances it: plain arithmetic, no wall time.
"""

from __future__ import annotations

import asyncio
import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.ratelimit import (
    DEFAULT_COMPLETION_TOKENS,
    DEFAULT_PAUSE_S,
    MAX_PAUSE_S,
    RateLimiter,
    TokenBucket,
    estimate_request_tokens,
    parse_duration,
    shares,
    tokens_used,
)


class FakeTime:
    """A clock that only moves when someone sleeps (or the test advances it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def limiter(rpm: float | None, tpm: float | None) -> tuple[RateLimiter, FakeTime]:
    """A limiter on a fake clock."""
    t = FakeTime()
    return RateLimiter(rpm, tpm, clock=t.clock, sleep=t.sleep), t


def test_bucket_starts_full_then_queues_reservations() -> None:
    """Rate 2/s, burst 2: two at once are free, then each waits 0.5 s more than the last."""
    bucket = TokenBucket(2.0, 2.0)
    assert [bucket.take(10.0, 1) for _ in range(5)] == [0.0, 0.0, 0.5, 1.0, 1.5]
    # 1 s later 2 of the 3 owed are refilled; a new request waits for 1 more and its own 1.
    assert bucket.take(11.0, 1) == pytest.approx(1.0)


def test_bucket_refill_is_capped_and_give_refunds() -> None:
    """An idle bucket holds at most the burst; `give` refunds up to the burst."""
    bucket = TokenBucket(1.0, 3.0)
    bucket.take(0.0, 3)
    assert bucket.take(100.0, 3) == 0.0 and bucket.level == 0.0
    bucket.give(100.0, 10)
    assert bucket.level == 3.0
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(0.0, 1.0)


def grant_times(rate_per_s: float, gaps: list[float]) -> list[float]:
    """When each of a serial dispatcher's acquires is let through (one request each)."""
    rl, t = limiter(rate_per_s * 60, None)
    grants: list[float] = []

    async def dispatch() -> None:
        for gap in gaps:
            t.now += gap
            await rl.acquire(0)
            grants.append(t.now)

    asyncio.run(dispatch())
    return grants


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(0.2, 50.0),
    gaps=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=300),
)
def test_no_window_of_one_second_exceeds_rate_plus_burst(rate: float, gaps: list[float]) -> None:
    """For any arrival pattern, grants in any closed 1 s window <= rate + burst."""
    grants = grant_times(rate, gaps)
    assert grants == sorted(grants)
    burst = max(rate, 1.0)
    for i, start in enumerate(grants):
        in_window = bisect.bisect_right(grants, start + 1.0 + 1e-9) - i
        assert in_window <= rate + burst + 1e-6


@settings(max_examples=20, deadline=None)
@given(rate=st.floats(1.0, 40.0))
def test_long_run_average_is_the_rate(rate: float) -> None:
    """Under steady overload for 200 s the average grant rate is within 2% of the rate."""
    duration = 200.0
    gaps = [1 / (2 * rate)] * int(duration * 2 * rate)
    grants = grant_times(rate, gaps)
    granted = bisect.bisect_right(grants, duration)
    assert granted / duration == pytest.approx(rate, rel=0.02)


def test_acquire_charges_both_buckets() -> None:
    """rpm 600 (10/s) and tpm 6000 (100/s), bursts of 1: the tokens bucket binds.

    100 tokens from a level of 1 wait 99/100 s; then the requests bucket has refilled, and 50
    more tokens wait 0.5 s.
    """
    rl, t = limiter(600, 6000)
    assert asyncio.run(rl.acquire(100)) == pytest.approx(0.99)
    assert asyncio.run(rl.acquire(50)) == pytest.approx(0.5)
    assert t.now == pytest.approx(1.49) and (rl.pending, rl.pending_tokens) == (0, 0)


def test_unlimited_never_waits() -> None:
    """No rpm and no tpm: every acquire returns at once."""
    rl, t = limiter(None, None)
    for _ in range(1000):
        assert asyncio.run(rl.acquire(10**6)) == 0.0
    assert t.slept == []


def test_correct_refunds_or_charges_the_difference() -> None:
    """A request that used fewer tokens than reserved gives them back; more is owed.

    100 tokens/s, burst 1. 100 reserved (wait 0.99 s), 40 used: the refund lifts the level to
    the burst, exactly where charging 40 would have left it, so 60 more wait 0.59 s.
    """
    rl, _ = limiter(None, 6000)
    assert asyncio.run(rl.acquire(100)) == pytest.approx(0.99)
    rl.correct(100, 40)
    assert asyncio.run(rl.acquire(60)) == pytest.approx(0.59)
    rl.correct(60, 110)  # 50 more than reserved: the next request waits 0.5 s for them
    assert asyncio.run(rl.acquire(0)) == pytest.approx(0.5)


def test_set_share_rebalances_and_keeps_debt() -> None:
    """A bigger share speeds up what comes next; the debt already run up stays."""
    rl, t = limiter(60, None)  # 1/s, burst 1
    assert [asyncio.run(rl.acquire(0)) for _ in range(3)] == [0.0, 1.0, 1.0]
    rl.set_share(240, None)  # 4/s: the next waits 0.25 s
    assert asyncio.run(rl.acquire(0)) == pytest.approx(0.25)
    rl.set_share(None, None)
    assert asyncio.run(rl.acquire(0)) == 0.0 and t.now == pytest.approx(2.25)
    assert shares(600, None, 3) == (200.0, None) and shares(600, 90, 0) == (600.0, 90.0)


def test_server_headers_pause_before_a_429() -> None:
    """Nothing left at the server: wait for its reset; enough left: no pause."""
    rl, t = limiter(None, None)
    assert rl.observe_headers({"x-ratelimit-remaining-requests": "5"}, 0.0) == 0.0
    headers = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.5s"}
    assert rl.observe_headers(headers, 0.0) == 1.5
    assert asyncio.run(rl.acquire(1)) == pytest.approx(1.5)
    asyncio.run(rl.acquire(500))  # now 500 tokens is what this shard sends next
    tokens = {"x-ratelimit-remaining-tokens": "100", "x-ratelimit-reset-tokens": "20ms"}
    assert rl.observe_headers(tokens, t.now) == pytest.approx(0.02)
    assert rl.observe_headers({"x-ratelimit-remaining-tokens": "0"}, t.now) == DEFAULT_PAUSE_S
    long = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "6m0s"}
    assert rl.observe_headers(long, t.now) == MAX_PAUSE_S
    # a job whose retry.max_server_wait_s is lower pauses no longer than that
    patient = RateLimiter(None, None, clock=lambda: 0.0, max_pause_s=2.5)
    assert patient.observe_headers(long, 0.0) == 2.5
    assert RateLimiter(None, None, max_pause_s=3600).max_pause_s == MAX_PAUSE_S


def test_pause_arriving_during_a_wait_extends_it() -> None:
    """A pause set while an acquire sleeps holds that acquire until the pause ends."""
    t = FakeTime()
    rl = RateLimiter(60, None, clock=t.clock)

    async def sleep(seconds: float) -> None:
        t.now += seconds
        if len(t.slept) == 0:
            rl.observe_headers({"x-ratelimit-remaining-requests": "0",
                                "x-ratelimit-reset-requests": "5s"}, t.now)  # fmt: skip
        t.slept.append(seconds)

    rl._sleep = sleep
    asyncio.run(rl.acquire(0))
    assert asyncio.run(rl.acquire(0)) == pytest.approx(6.0)  # 1 s for the bucket, then 5 s


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1h2m3.5s", 3723.5), ("0.5", 0.5),
     ("60", 60.0), (" 2s ", 2.0), ("150us", 0.00015), ("abc", None), ("1x", None), ("", None),
     (None, None), ("-1", None), ("1m30", None), ("inf", None)],
)
def test_parse_duration(text: str | None, seconds: float | None) -> None:
    """Reset headers in Go duration or plain-seconds form; anything else is None."""
    got = parse_duration(text)
    assert got == (None if seconds is None else pytest.approx(seconds))


def test_estimate_request_tokens() -> None:
    """Prompt chars / 4 plus max_tokens (body first, then params, else a default)."""
    item = {"id": "1", "prompt": "abcdefgh"}
    assert estimate_request_tokens(item, {"max_tokens": 10}) == 12
    body_item = {"id": "1", "url": "/v1/completions",
                 "body": {"prompt": "abcd", "max_completion_tokens": 5}}  # fmt: skip
    assert estimate_request_tokens(body_item, {"max_tokens": 10}) == 6
    assert estimate_request_tokens(item, {}) == 2 + DEFAULT_COMPLETION_TOKENS
    # The Responses API's limit counts as well (a job with it reserved the default before).
    assert estimate_request_tokens(item, {"max_output_tokens": 8}) == 10


def test_tokens_used_for_correct() -> None:
    """Success: usage; a refusal or nothing streamed: 0; a broken stream: prompt + wasted."""
    assert tokens_used("ok", 30, 70, 0, 25) == 100
    assert tokens_used("ok", None, 70, 0, 25) == 95
    assert tokens_used("http_429", None, 0, 0, 25) == 0
    assert tokens_used("http_4xx", 30, 0, 0, 25) == 0
    assert tokens_used("timeout_first_token", None, 0, 0, 25) == 0
    assert tokens_used("timeout_idle", None, 0, 12, 25) == 37


def test_observe_headers_reads_its_own_clock() -> None:
    """Without `now`, a pause starts at the limiter's clock."""
    rl, t = limiter(None, None)
    t.now = 50.0
    rl.observe_headers({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"})
    assert rl.pause_until == 52.0
