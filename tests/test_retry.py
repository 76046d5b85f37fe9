"""Retry classification, server-asked waits, the retry budget and the backoff schedule."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardrun.retry import (
    Retrier,
    RetryBudget,
    RetryPolicy,
    is_retryable,
    parse_duration,
    parse_retry_after,
    retry_after_of,
    server_wait,
)


def test_classification_follows_the_issue() -> None:
    """408/409/429/5xx, timeouts, resets and broken streams retry; other 4xx do not."""
    for status in ("http_429", "http_5xx", "timeout_connect", "timeout_first_token",
                   "timeout_idle", "timeout_total", "conn_reset", "protocol_error"):
        assert is_retryable(status, None)
    assert is_retryable("http_4xx", 408) and is_retryable("http_4xx", 409)
    for code in (400, 401, 403, 404, 413, 422):
        assert not is_retryable("http_4xx", code)


def test_retry_after_seconds_and_http_date() -> None:
    """Retry-After as delta-seconds and as an HTTP-date both give seconds to wait."""
    assert parse_retry_after("7") == 7.0
    now = datetime(2026, 1, 1, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(later, now=now.timestamp()) == 90.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Tokyo"])
def test_an_http_date_without_its_zone_is_utc(zone: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Retry-After date with "-0000" or no zone was read in this machine's time zone: 30 s
    asked became 5 h at New York (past max_server_wait_s: every item dead-lettered at once) and
    none at Tokyo. An HTTP-date is UTC."""
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        now = datetime(2026, 1, 1, tzinfo=UTC)
        later = format_datetime(now + timedelta(seconds=30), usegmt=True)
        for asked in (later, later.replace("GMT", "-0000"), later.removesuffix(" GMT")):
            assert parse_retry_after(asked, now=now.timestamp()) == 30.0
    finally:
        monkeypatch.undo()
        time.tzset()


def test_a_wait_asked_in_milliseconds_counts() -> None:
    """retry-after-ms (OpenAI) and x-ms-retry-after-ms (Azure OpenAI) ask in milliseconds: as
    seconds they stand in for Retry-After when it is missing or asks less; junk, negative and
    infinite values ask nothing."""
    assert retry_after_of({"retry-after-ms": "2500"}) == "2.5"
    assert retry_after_of({"x-ms-retry-after-ms": "800"}) == "0.8"
    assert retry_after_of({"Retry-After": "1", "retry-after-ms": "1500"}) == "1.5"
    assert retry_after_of({"Retry-After": "2", "retry-after-ms": "1500"}) == "2"
    assert retry_after_of({"Retry-After": "soon", "retry-after-ms": "0"}) == "0"
    later = format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)
    assert retry_after_of({"Retry-After": later, "retry-after-ms": "5000"}) == later
    for junk in ("", "soon", "-5", "inf", "nan"):
        assert retry_after_of({"retry-after-ms": junk}) is None
        assert retry_after_of({"Retry-After": "4", "retry-after-ms": junk}) == "4"


@pytest.mark.parametrize("junk", ["inf", "Infinity", "-inf", "nan"])
def test_a_retry_after_of_infinity_asks_nothing(junk: str) -> None:
    """A Retry-After that float() reads but is no count of seconds ("inf"): it was an endless
    wait, past max_server_wait_s, so every item a 429 answered was given up at once
    (server_wait_too_long), where junk asks nothing and the item is retried after its backoff,
    as the millisecond headers and the x-ratelimit resets already treated it."""
    assert parse_retry_after(junk) is None
    assert retry_after_of({"Retry-After": junk, "retry-after-ms": "1500"}) == "1.5"
    r = Retrier(RetryPolicy(max_attempts=3, max_server_wait_s=60.0))
    assert r.decide("http_429", 429, 1, retry_after=junk).why == "backoff"


def test_rate_limit_reset_durations() -> None:
    """x-ratelimit-reset-* values like 6m0s, 20ms and 1.5 parse to seconds; junk to None."""
    assert parse_duration("6m0s") == 360.0
    assert parse_duration("20ms") == 0.02
    assert parse_duration("1h2m3.5s") == 3723.5
    assert parse_duration("1.5") == 1.5
    assert parse_duration("1x") is None and parse_duration("") is None


def test_reset_headers_count_only_on_429_and_503() -> None:
    """Reset headers are a server ask on 429/503; Retry-After counts on any status."""
    headers = {"x-ratelimit-reset-requests": "2s", "x-ratelimit-reset-tokens": "5s"}
    assert server_wait(429, None, headers) == 5.0
    assert server_wait(503, "1", headers) == 5.0
    assert server_wait(500, None, headers) is None
    assert server_wait(500, "3", headers) == 3.0


def test_a_reset_header_that_is_a_moment_asks_the_time_until_it() -> None:
    """A gateway's x-ratelimit-reset-* as a Unix time, in seconds or milliseconds: 30 s from
    now, it was read as 56 years, over max_server_wait_s, and the item was given up. A moment
    passed asks for no wait; a bare number that is no moment stays seconds."""
    soon = time.time() + 30
    headers = {"x-ratelimit-reset-requests": f"{soon:.0f}",
               "x-ratelimit-reset-tokens": f"{soon * 1000 - 10_000:.0f}"}
    assert server_wait(429, None, headers) == pytest.approx(30, abs=2)
    decision = Retrier(RetryPolicy(max_server_wait_s=60.0)).decide("http_429", 429, 1,
                                                                   rate_headers=headers)
    assert decision.retry and decision.wait == pytest.approx(30, abs=2)
    assert parse_duration("1764280000", now=1764280000 - 12.5) == 12.5
    assert parse_duration("1764280000500", now=1764280000) == 0.5
    assert parse_duration("1764280000", now=1764290000) == 0.0
    assert parse_duration("500000000000") == 5e11  # neither: as it was


def test_budget_caps_retries_at_ratio_times_first_attempts_plus_floor() -> None:
    """With ratio 0.5 and floor 2, 10 first attempts allow exactly 7 retries."""
    budget = RetryBudget(0.5, 2)
    budget.first_attempts = 10
    granted = 0
    while budget.allows_retry():
        budget.retries += 1
        granted += 1
    assert granted == 7


def test_decide_gives_up_with_the_right_reason() -> None:
    """Not retryable, out of attempts, server wait too long, budget spent: each says so."""
    r = Retrier(RetryPolicy(max_attempts=3, budget_ratio=0.0, budget_floor=1,
                            max_server_wait_s=60))
    r.budget.first_attempts = 1
    assert r.decide("http_4xx", 400, 1).why == "not_retryable_http_4xx"
    assert r.decide("http_5xx", 500, 3).why == "max_attempts"
    assert r.decide("http_429", 429, 1, retry_after="3600").why == "server_wait_too_long"
    # In a storm (not budgeted) the item is held with the others instead.
    held = r.decide("http_5xx", 503, 1, retry_after="3600", budgeted=False)
    assert held.retry and held.wait == 60
    first = r.decide("http_5xx", 500, 1)
    assert first.retry
    assert r.decide("http_5xx", 500, 1).why == "retry_budget_exhausted"


@given(
    attempt=st.integers(min_value=1, max_value=30),
    backoff=st.floats(min_value=0.01, max_value=5),
    cap=st.floats(min_value=5, max_value=120),
    asked=st.one_of(st.none(), st.floats(min_value=0, max_value=600)),
)
def test_backoff_schedule_bounds(attempt: int, backoff: float, cap: float,
                                 asked: float | None) -> None:
    """The wait is never below the server's ask, within full-jitter bounds, capped at the max."""
    r = Retrier(RetryPolicy(max_attempts=100, backoff_s=backoff, backoff_max_s=cap,
                            budget_floor=10**9, max_server_wait_s=1000))
    decision = r.decide("http_429", 429, attempt,
                        retry_after=None if asked is None else repr(asked))
    assert decision.retry
    ceiling = min(cap, backoff * 2 ** (attempt - 1))
    if asked is not None:
        assert decision.wait >= asked
    if asked is None or asked <= ceiling:
        assert 0 <= decision.wait <= ceiling + 1e-9
    if decision.why == "server":
        assert asked is not None and decision.wait == asked
