"""The outage watch: which failures are the endpoint's, and when a run of them is an outage."""

from __future__ import annotations

import pytest

from shardrun.outage import OUTAGE_AFTER, OutageWatch, says_endpoint_down


@pytest.mark.parametrize(("status", "http", "connected", "down"), [
    ("conn_reset", None, False, True),  # refused, or reset before a connection was made
    ("timeout_connect", None, False, True),
    ("conn_reset", None, True, False),  # cut mid-answer: this request's trouble
    ("http_5xx", 502, True, True),  # a gateway with nothing behind it
    ("http_5xx", 504, True, True),
    ("http_5xx", 503, True, False),  # up and shedding load: Retry-After and the budget
    ("http_5xx", 500, True, False),
    ("http_429", 429, True, False),
    ("timeout_first_token", None, True, False),
    ("http_4xx", 400, True, False),
])
def test_which_failures_say_the_endpoint_is_down(status: str, http: int | None, connected: bool,
                                                 down: bool) -> None:
    assert says_endpoint_down(status, http, connected) is down


def test_an_outage_needs_a_run_of_failures_and_ends_at_any_answer() -> None:
    watch = OutageWatch(limit_s=10.0)
    for i in range(OUTAGE_AFTER - 1):
        watch.failed(100.0 + i)
    assert not watch.down and not watch.too_long(1000.0)
    watch.failed(103.0)
    assert watch.down and watch.lasted(105.0) == 5.0  # since the first failure of the run
    assert not watch.too_long(109.9) and watch.too_long(110.0)
    watch.answered()
    assert not watch.down and watch.lasted(200.0) == 0.0
    watch.failed(300.0)
    assert not watch.down  # a new run of failures starts from one
