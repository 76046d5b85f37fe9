"""The outage watch: which failures are the endpoint's, which attempts show it serving, and
when a run of failures is an outage."""

from __future__ import annotations

import pytest

from shardrun.outage import OutageWatch, says_endpoint_down, says_endpoint_up


@pytest.mark.parametrize(("status", "http", "tokens", "down", "up"), [
    ("ok", 200, 9, False, True),
    ("conn_reset", None, 0, True, False),  # refused, or a kept-alive connection found dead
    ("timeout_connect", None, 0, True, False),
    ("conn_reset", 200, 0, True, False),  # dropped before the first token (a restart)
    ("conn_reset", 200, 5, False, False),  # a stream cut mid-answer
    ("protocol_error", 200, 0, False, False),
    ("timeout_first_token", 200, 0, False, False),  # hung: neither down nor serving
    ("http_5xx", 502, 0, True, False),  # a gateway with nothing behind it
    ("http_5xx", 504, 0, True, False),
    ("http_5xx", 503, 0, False, True),  # up and shedding load: Retry-After and the budget
    ("http_5xx", 500, 0, False, True),
    ("http_429", 429, 0, False, True),
    ("http_4xx", 400, 0, False, True),
])
def test_which_attempts_say_the_endpoint_is_down_or_up(status: str, http: int | None,
                                                       tokens: int, down: bool,
                                                       up: bool) -> None:
    assert says_endpoint_down(status, http, tokens) is down
    assert says_endpoint_up(status, http) is up


def test_an_outage_starts_at_the_first_failure_and_ends_at_an_answer() -> None:
    watch = OutageWatch(limit_s=10.0)
    assert not watch.down and not watch.too_long(1000.0)
    watch.failed(100.0)
    watch.failed(103.0)
    assert watch.down and watch.lasted(105.0) == 5.0  # since the first failure of the run
    assert not watch.too_long(109.9) and watch.too_long(110.0)
    watch.answered()
    assert not watch.down and watch.lasted(200.0) == 0.0
