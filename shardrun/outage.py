"""Telling the endpoint going down from one request failing.

A request that fails alone is retried under `max_attempts` and the shard's retry budget, and
dead-lettered when they run out: the budget keeps a failing endpoint from being hammered. But
when the endpoint itself goes away (restarted, redeployed, a gateway with no backend), every
request fails at once, the budget is spent within seconds, and a blip of a few seconds would
dead-letter most of the job. So a shard watches the failures that say nothing about the item
(no answer at all: no connection, a kept-alive one found dead, or one dropped before the first
token; or a gateway's 502 or 504): once the endpoint has answered the run, such a failure
means it is down. While it is, failed requests try again without spending their attempts or
the budget: one of them probes the endpoint, at growing intervals of at most `PROBE_MAX_S`,
and the others wait for its answer. Only an answer ends the outage (a success, from its first
token on, or an HTTP answer of the server's own); a stream cut after its first token, or timed
out, says nothing either way. One that lasts `retry.outage_s` stops the run, leaving the items
for `--resume`.
"""

from __future__ import annotations

# Endpoint-level failures in a row, with no answer between, that make an outage: the first. A
# failure that says nothing about the item must not count against it, and a lone one costs a
# wait of a backoff for the probe, then the answer ends it.
OUTAGE_AFTER = 1
PROBE_MAX_S = 5.0  # the longest between two probes of an endpoint that is down
RECHECK_S = 1.0  # how often a request waiting for the probe's answer looks up (stop, fatal)
# A gateway saying that nothing answers behind it. Not 503: a server that answers "unavailable"
# is up and shedding load, which Retry-After and the retry budget deal with.
GATEWAY_STATUSES = frozenset({502, 504})
NO_CONNECTION_STATUSES = frozenset({"conn_reset", "timeout_connect"})


def says_endpoint_down(status: str, http_status: int | None, tokens: int = 0) -> bool:
    """Whether a failure is the endpoint's, not the item's: no answer came at all (it could not
    connect, a kept-alive connection turned out dead, or the connection dropped before the
    first token, as a restart drops every stream in flight), or a gateway answered that
    nothing stands behind it."""
    if status in NO_CONNECTION_STATUSES:
        return http_status is None or tokens == 0
    return status == "http_5xx" and http_status in GATEWAY_STATUSES


def says_endpoint_up(status: str, http_status: int | None) -> bool:
    """Whether a finished attempt shows the endpoint serving: a success, or an HTTP answer of
    its own. A stream cut or timed out shows neither (a restart cuts the streams in flight)."""
    return status == "ok" or (http_status is not None and http_status not in GATEWAY_STATUSES
                              and status.startswith("http_"))


class OutageWatch:
    """Consecutive endpoint-level failures of one shard, and since when."""

    __slots__ = ("after", "limit_s", "since", "streak")

    def __init__(self, limit_s: float, after: int = OUTAGE_AFTER) -> None:
        self.limit_s = limit_s
        self.after = after
        self.streak = 0
        self.since: float | None = None  # when the first failure of the streak ended

    def failed(self, now: float) -> None:
        self.streak += 1
        if self.since is None:
            self.since = now

    def answered(self) -> None:
        """Any answer at all (a success, a refusal, an error about the request) ends it."""
        self.streak = 0
        self.since = None

    @property
    def down(self) -> bool:
        return self.streak >= self.after

    def lasted(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since

    def too_long(self, now: float) -> bool:
        return self.down and self.lasted(now) >= self.limit_s
