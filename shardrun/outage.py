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
out, says nothing either way. The probe also asks for the server's model list: its answer ends
the outage too, but says nothing of our requests (a gateway may answer it while the server
behind restarts), so until one of them is answered a failure with no answer may be the item's
own or the backend's: the item is held, spending nothing, while another item tells, a fresh
one sent as the probe if need be (`Shard._hold_for_a_fresh_item`). A request answered says it
was the item's (it goes again, its next such failure held once more, the one after charged);
the fresh probe failing too says the backend is down or its prompt is reset as well: it is held
beside the cap, and the next fresh item probes `LIST_PROBE_S` later, in any number, one out at a
time, until a request is answered (a run of prompts the server resets is told so once a probe
passes its end) or `retry.outage_s` stops the run. Only at the input's tail, with no fresh item
left, are the held items charged, so the run goes on and ends. An outage that lasts
`retry.outage_s` stops the run, leaving the items for `--resume`.

An endpoint can also answer and still fail everything: a storm of 503s from an overloaded
server, or of 500s from a broken one. The retry budget
then runs out in seconds and every later failure is a dead letter at once, racing through the
input (2,200 of 3,000 items in a 10 s storm of 503s). So when failures of the server's own
come from `STORM_AFTER` different items in a row, at any cap, with no success between (more
where the server failed most requests at random lately: `StormWatch.needed`), a storm is on:
as in an outage, one request per shard probes the endpoint at growing
intervals, honouring any Retry-After, and the others wait for a success to end it. Unlike an
outage, every try is one of the item's attempts: the probe passes from item to item in turn, so
an item that fails for its own reasons still runs out of attempts and is dead-lettered, and
none holds the shard. Only the retry budget is set aside, since one probe cannot hammer the
endpoint. A success of a request sent after the first of those failures ends it (from the
probe's first token on); one sent before says nothing, however many end well as a storm sets
in. One that lasts `retry.outage_s` stops the run too, or a minute where no request of the run
has succeeded yet (`Shard._storm_too_long`); until then the items the cap holds make a storm,
and its retries are not the items' attempts (`Shard._storm_failed`).
"""

from __future__ import annotations

import math
from collections import deque

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


# Failures of the server's own, from this many different items in a row with no success between,
# that make a storm, at any cap: one item alone is never a storm, and random failures at one in
# two hardly ever line up eight in a row (at a cap of 1 a smaller count held every retry of a
# flaky server one probe at a time). A server that fails more often at random needs a longer
# streak (`StormWatch.needed`).
STORM_AFTER = 8
# The latest outcomes (successes and failures of the server's own) a shard keeps, to tell a
# server that fails many requests at random from one that fails them all.
STORM_WINDOW = 64
# The longest streak a storm needs however often the server failed recently: at 88 % failures
# and more, a server fails nearly every request, and its items had better be held.
STORM_AFTER_MAX = 64
# How unlikely a streak of random failures must be to make a storm, as a log: that of 12 in a
# row at one in two, about once in 4,000 items (8 would be once in 250, often enough at 80 %
# failures that a long run still held its retries every few hundred items).
RANDOM_STREAK_ODDS = 12 * math.log(0.5)
# An answer of the server's own that fails: a 5xx that is no gateway's (those say it is down).
# Not a timeout: one request at a time, each waiting out its whole timeout, would crawl through
# items whose prompts are slow to answer. Not a 429 (rate limits have their own pacing), not a
# 4xx (the request's own fault).
STORM_STATUSES = frozenset({"http_5xx"})


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


def says_endpoint_failing(status: str) -> bool:
    """Whether a failure is one of those that, from enough items in a row, make a storm (it is
    called after `says_endpoint_down`, which takes the gateway's 502 and 504)."""
    return status in STORM_STATUSES


class StormWatch:
    """The items failing in a row with no success between, and whether they make a storm."""

    __slots__ = ("after", "failing", "first_at", "next_probe_at", "probes", "recent",
                 "recent_failures", "since", "streak_failures", "usual_after")

    def __init__(self, after: int, window: int = STORM_WINDOW) -> None:
        self.after = after
        # The streak's usual length, fixed: `after` shrinks (a shard's last items, the cap
        # before any success), but a failure rate counts only from this many outcomes on, and
        # raises the bar only above it. Else a rate of 2 or 3 outcomes (one failure in three
        # asked for 8 of the 3 items left), or of a server failing one request in five (6),
        # undid the shrinking, and a shard's tail was never held.
        self.usual_after = after
        self.failing: set[str] = set()  # span ids
        self.streak_failures = 0  # their failed attempts (an item may fail more than once)
        self.first_at = 0.0  # when the first of them failed
        self.since: float | None = None  # when the storm began (None: no storm)
        self.probes = 0  # probes that failed in this storm
        self.next_probe_at = 0.0
        # The outcomes before this streak, oldest first (True: failed), and how many failed.
        self.recent: deque[bool] = deque(maxlen=window)
        self.recent_failures = 0

    def failed(self, span_id: str, now: float) -> bool:
        """Count one failure; True when it is the one that starts a storm."""
        if not self.failing:
            self.first_at = now
        self.failing.add(span_id)
        self.streak_failures += 1
        return self.due(now)

    def due(self, now: float) -> bool:
        """Begin the storm if the streak is long enough for one now; True when this begins
        it (`after` may have shrunk since the streak's last failure)."""
        if self.since is not None or not self.failing or len(self.failing) < self.needed():
            return False
        self.since = now
        return True

    def needed(self) -> int:
        """How many different items failing in a row make a storm now: `after`, unless the
        server failed more than a third of the requests before this streak. Random failures at
        a rate r line up n in a row with a chance of r**n, so the streak must be as unlikely at
        the recent rate as RANDOM_STREAK_ODDS says: 12 at one in two, 38 at 80 %. The rate is
        that of the outcomes before the streak (with the streak's own, a storm early in a run
        would raise its own bar as it goes on), and only from `usual_after` of them on, with a
        success among them (a couple say little, and failures alone say nothing of a rate). A
        bar no higher than `usual_after` leaves `after` as it is, shrunk or not."""
        seen = len(self.recent)
        if seen < self.usual_after or self.recent_failures == seen:  # nothing to go by
            return self.after
        rate = self.recent_failures / seen
        if rate <= 0.0:
            return self.after
        bar = math.ceil(RANDOM_STREAK_ODDS / math.log(rate))
        return self.after if bar <= self.usual_after else min(STORM_AFTER_MAX, bar)

    def succeeded(self, started: float, *, finished: bool = True) -> bool:
        """A success of an attempt that started at `started` (from its first token on: not
        `finished`, and its end comes again); True when it ends a storm."""
        recent = self.recent
        if not self.failing and not self.recent_failures and len(recent) == recent.maxlen:
            return False  # a healthy shard's success (most): the window would stay as it is
        if self.failing and started < self.first_at:
            # Sent before the failures began: says nothing about the endpoint now (as a storm
            # sets in, the answers already streaming still end well).
            if finished:
                self._remember(False)
            return False
        on = self.since is not None
        for _ in range(min(self.streak_failures, self.recent.maxlen or 0)):
            self._remember(True)
        if finished:
            self._remember(False)
        self.failing.clear()
        self.streak_failures = 0
        self.since = None
        self.probes = 0
        return on

    def _remember(self, failed: bool) -> None:
        recent = self.recent
        if len(recent) == recent.maxlen:
            self.recent_failures -= recent[0]
        recent.append(failed)
        self.recent_failures += failed

    @property
    def on(self) -> bool:
        return self.since is not None

    def lasted(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since


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
