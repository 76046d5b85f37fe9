"""The outage watch: which failures are the endpoint's, which attempts show it serving, and
when a run of failures is an outage."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardrun import protocol
from shardrun._attempt import AttemptOutcome
from shardrun.outage import (
    PROBE_MAX_S,
    STORM_AFTER,
    STORM_AFTER_MAX,
    STORM_WINDOW,
    OutageWatch,
    StormWatch,
    says_endpoint_down,
    says_endpoint_failing,
    says_endpoint_up,
)
from shardrun.shard import Shard, _drain
from shardrun.shard_config import ShardConfig
from shardrun.spans import Span


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


@pytest.mark.parametrize(("status", "storm"), [
    ("http_5xx", True), ("http_429", False), ("http_4xx", False), ("timeout_first_token", False),
    ("timeout_total", False), ("conn_reset", False), ("protocol_error", False), ("ok", False)])
def test_which_failures_count_toward_a_storm(status: str, storm: bool) -> None:
    assert says_endpoint_failing(status) is storm


def test_a_storm_is_distinct_items_failing_with_no_later_sent_success_between() -> None:
    """Three items (the threshold here) failing in a row make a storm; one item failing again
    counts once; a success of a request sent before the first failure says nothing, one sent
    after ends the streak, or the storm."""
    watch = StormWatch(after=3)
    assert not watch.failed("a", 10.0) and not watch.failed("a", 11.0)
    assert not watch.failed("b", 12.0)
    assert not watch.succeeded(started=9.5)  # sent before "a" failed: still streaming then
    assert watch.failed("c", 13.0) and watch.on and watch.lasted(15.0) == 2.0
    assert not watch.failed("d", 14.0)  # already on: it began with "c"
    assert not watch.succeeded(started=9.9) and watch.on
    watch.probes = 4
    assert watch.succeeded(started=10.5)  # sent after the first failure: it serves again
    assert not watch.on and not watch.failing and watch.probes == 0 and watch.lasted(20.0) == 0
    assert not watch.failed("e", 30.0) and not watch.failed("f", 31.0)
    assert not watch.succeeded(started=30.5)  # ends the streak, which was no storm
    assert not watch.failed("g", 32.0) and not watch.failed("h", 33.0) and not watch.on


def _outcomes(watch: StormWatch, pattern: str, t: float) -> float:
    """Feed `pattern` to the watch, one outcome a second from `t`: "x" a failure of a new item,
    "o" a success of a request sent after the failures before it; the time after the last."""
    for n, outcome in enumerate(pattern):
        if outcome == "x":
            watch.failed(f"{t}-{n}", t)
        else:
            watch.succeeded(started=t - 0.5)
        t += 1.0
    return t


def test_a_server_failing_most_requests_at_random_needs_a_longer_streak_for_a_storm() -> None:
    """Before this streak, the server failed four requests in five, with successes between:
    eight items failing in a row are then common and make no storm; a streak as unlikely at
    that rate as twelve in a row at one in two does (38 at 80 %)."""
    watch = StormWatch(after=8)
    t = _outcomes(watch, "xxxxo" * 10, 0.0)
    assert watch.needed() == 38
    t = _outcomes(watch, "x" * 37, t)
    assert not watch.on  # 37 items: 8 would have made a storm
    assert watch.failed("the 38th", t) and watch.on


@pytest.mark.parametrize(("before", "needed"), [
    ("", 8),  # nothing to go by: a storm from the run's start is held as soon as ever
    ("o" * 40, 8),  # a server that served everything, then fails: held as soon as ever
    ("xo" * 3, 8),  # too few outcomes to tell a rate by
    ("xxo" * 20, 21),  # two in three
    ("xxxxxxxxxo" * 6, STORM_AFTER_MAX),  # 90 %: nearly every request, held after 64
])
def test_the_streak_a_storm_needs_follows_the_failure_rate_before_it(before: str,
                                                                     needed: int) -> None:
    watch = StormWatch(after=8)
    _outcomes(watch, before, 0.0)
    assert watch.needed() == needed


@pytest.mark.parametrize(("before", "after", "needed"), [
    ("xoo", 3, 3),  # one failure in three outcomes: too few to tell a rate by (it asked 8)
    ("xo", 2, 2),  # ... one in two (it asked 12)
    ("xoooo" * 4, 3, 3),  # one in five: a bar below the usual 8 (6) leaves the shrunk one
    ("xo" * 10, 3, 12),  # a flaky server still needs its longer streak
    ("xxxxo" * 10, 2, 38),
])
def test_a_shrunk_streak_is_raised_only_by_a_rate_that_raises_the_usual_one(
        before: str, after: int, needed: int) -> None:
    """A shard's last items make a storm with a shorter streak (`after` shrunk to the items
    left): the failure rate before it counts from the usual eight outcomes on, and only when it
    asks for more than the usual eight."""
    watch = StormWatch(after=8)
    _outcomes(watch, before, 0.0)
    watch.after = after
    assert watch.needed() == needed


def test_the_streak_itself_does_not_raise_the_bar_and_the_rate_is_of_recent_outcomes() -> None:
    """A storm early in a run, after eight successes, needs the usual eight (counting the
    streak's own failures in the rate would raise its bar with every failure); the outcomes
    of a storm that ended, once STORM_WINDOW later ones came, no longer count."""
    watch = StormWatch(after=8)
    t = _outcomes(watch, "o" * 8 + "x" * 7, 0.0)
    assert watch.failed("the eighth", t)
    t = _outcomes(watch, "x" * 20 + "o", t)  # probes failed, then one succeeded
    assert watch.needed() > 8
    _outcomes(watch, "o" * STORM_WINDOW, t)
    assert watch.needed() == 8


def test_a_first_token_ends_a_streak_and_its_success_is_counted_once_at_the_end() -> None:
    """A probe's first token ends the streak, and the attempt's end counts the success; a
    stream cut after its first token counts none, and failures with no success among them say
    nothing of a rate."""
    watch = StormWatch(after=8)
    t = _outcomes(watch, "x" * 9, 0.0)
    assert watch.on
    assert not watch.succeeded(started=-1.0, finished=False)  # sent before: counted at its end
    assert not watch.recent
    assert watch.succeeded(started=t - 0.5, finished=False)  # the first token
    assert list(watch.recent) == [True] * 9 and watch.needed() == 8
    watch.succeeded(started=t - 0.5)  # its end
    assert list(watch.recent) == [True] * 9 + [False]
    assert watch.needed() == STORM_AFTER_MAX


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


def _config(tmp_path: Path, **settings: Any) -> ShardConfig:
    """Shard 0 of a run against a server no request reaches: the tests drive it by hand."""
    return ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://x",
                       api="chat", model="m", **settings)


def _clocked_shard(tmp_path: Path, **settings: Any) -> tuple[_Clock, Shard]:
    """A shard of `_config(tmp_path, **settings)` on a clock the test moves."""
    clock, config = _Clock(), _config(tmp_path, **settings)
    return clock, Shard(config, lambda message: None, clock=clock)  # type: ignore[arg-type]


def _refused(at: float) -> AttemptOutcome:
    return AttemptOutcome(status="conn_reset", started_at=at, error="connection refused")


def _answered(shard: Shard, clock: _Clock, name: str) -> None:
    """Another item's request, sent now, answered: the endpoint serves."""
    other = Span(name, {"id": name}, clock.t)
    other.attempt_started_at = clock.t
    assert not shard._endpoint_down(other, AttemptOutcome(status="ok", http_status=200,
                                                          started_at=clock.t))


def test_an_item_held_in_one_outage_is_held_again_in_the_next(tmp_path: Path) -> None:
    """The per-item rule (failing so again after the endpoint answered a later request is the
    item's own trouble) looks only at the item's latest failure, and only within the outage
    now going on. An item refused in a first outage, then cut mid-stream by a second restart,
    then refused again is held, as is one refused in both outages with answers between."""
    clock, shard = _clocked_shard(tmp_path, answered_before=True)
    cut = Span("cut", {"id": "cut"}, clock.t)
    again = Span("again", {"id": "again"}, clock.t)
    assert shard._endpoint_down(cut, _refused(clock.t))  # the first outage
    assert shard._endpoint_down(again, _refused(clock.t))
    clock.t += 3
    _answered(shard, clock, "probe")  # it is back
    clock.t += 5
    cut_stream = AttemptOutcome(status="conn_reset", http_status=200, started_at=clock.t,
                                content_chunks=5, error="response body cut after 5 tokens")
    assert not shard._endpoint_down(cut, cut_stream)  # the second restart cuts it mid-answer
    clock.t += 0.1
    assert shard._endpoint_down(cut, _refused(clock.t))  # the second outage begins
    clock.t += 0.1
    assert shard._endpoint_down(again, _refused(clock.t))
    clock.t += 1
    assert shard._endpoint_down(again, _refused(clock.t))
    # Once the endpoint answers a request sent after an item's refusal, a refusal of that item
    # again may be the item's: held once (the endpoint may be down again), then its attempts
    # are spent.
    for charged in (False, True):
        clock.t += 1
        _answered(shard, clock, "later")
        clock.t += 1
        assert shard._endpoint_down(again, _refused(clock.t)) is not charged


def test_items_held_before_are_held_when_they_alone_meet_the_next_outage(
        tmp_path: Path) -> None:
    """Items held in one outage are the only requests when the next one begins (they went
    again at the probe's answer): the first refusal may be its item's own trouble or the
    endpoint down again, and is held once like the others (before, it was charged). An item
    refused so a second time after an answer is what the endpoint cannot answer: charged."""
    clock, shard = _clocked_shard(tmp_path, answered_before=True)
    held = [Span(f"s{i}", {"id": f"s{i}"}, clock.t) for i in range(8)]
    assert all(shard._endpoint_down(span, _refused(clock.t)) for span in held)
    clock.t += 2
    _answered(shard, clock, "probe")
    clock.t += 1
    assert [shard._endpoint_down(span, _refused(clock.t)) for span in held] == [True] * 8
    clock.t += 2
    _answered(shard, clock, "probe")
    clock.t += 1
    again = [shard._endpoint_down(span, _refused(clock.t)) for span in held]
    assert again == [False, *[True] * 7]  # the first has had its hold: its own now


def _reset(at: float, *, connected: bool = True, http: int | None = None) -> AttemptOutcome:
    """A request dropped with no answer: on a connection the server took, or finding none."""
    return AttemptOutcome(status="http_5xx" if http else "conn_reset", http_status=http,
                          started_at=at, conn_ready_at=at if connected else None,
                          error=f"HTTP {http}" if http else "connection reset")


def _four_spans(tmp_path: Path, *, held: bool) -> tuple[_Clock, Shard, list[Span]]:
    """A shard of a run the endpoint answered before, four of its items sent, and (`held`)
    held in an outage."""
    clock, shard = _clocked_shard(tmp_path, answered_before=True)
    spans = [Span(f"s{i}", {"id": f"s{i}"}, clock.t) for i in range(4)]
    for span in spans:
        span.attempt_started_at = clock.t
        assert not held or shard._endpoint_down(span, _reset(clock.t))
    return clock, shard, spans


def test_while_only_the_model_list_answers_failures_with_no_answer_are_the_items_own(
        tmp_path: Path) -> None:
    """An outage's probe found the server's model list answering: the outage is over, but the
    list says nothing of our requests. Until one of them is answered, a request sent since
    that fails with no answer (dropped on a connection the server took, or a gateway's 502)
    is its item's own, charged, and starts no outage: held, every item went again at the
    list's next answer, and a server resetting every request was hammered. One sent before is
    judged as before. One that found no connection at all is the server gone (a restart): an
    outage, held, and the list's word is over. So is it once one of our requests is answered."""
    clock, shard, spans = _four_spans(tmp_path, held=False)
    assert shard._endpoint_down(spans[0], _reset(clock.t))  # an outage: held
    clock.t += 1
    shard._list_answered(spans[0], clock.t - 0.01)  # the probe's check of the model list
    assert shard.endpoint_back.is_set()
    clock.t += 1
    assert shard._endpoint_down(spans[1], _reset(clock.t))  # sent before the list answered
    shard._list_answered(spans[1], clock.t)
    for span in spans:  # they go again
        clock.t += 0.5
        span.attempt_started_at = clock.t
    clock.t += 0.5
    assert not shard._endpoint_down(spans[0], _reset(clock.t))  # charged
    assert not shard._endpoint_down(spans[1], _reset(clock.t, http=502))
    assert not shard.outage.streak and shard.endpoint_back.is_set()
    assert shard._endpoint_down(spans[2], _reset(clock.t, connected=False))  # gone: held
    assert not shard.endpoint_back.is_set()
    clock.t += 1
    shard._list_answered(spans[2], clock.t)  # back, or answering only its list again
    clock.t += 0.1
    for span in spans:
        span.attempt_started_at = clock.t
    clock.t += 0.1
    assert not shard._endpoint_down(spans[0], _reset(clock.t))
    _answered(shard, clock, "later")  # one of our requests is answered: judged as before
    clock.t += 0.1
    spans[3].attempt_started_at = clock.t
    assert shard._endpoint_down(spans[3], _reset(clock.t))


def test_an_items_first_failure_while_only_the_list_answers_is_retried_free(
        tmp_path: Path) -> None:
    """The list's answer ended an outage, the held items went again, and a second restart cut
    them before any answer, with or without the stream's headers (a listener that outlives
    the server took them): each item's first such failure is retried free, after its
    backoff; its second is its own, charged. Before, the first was charged, and with one
    attempt per item the second restart dead-lettered them."""
    clock, shard, spans = _four_spans(tmp_path, held=True)
    clock.t += 1
    shard._list_answered(spans[0], clock.t)
    clock.t += 0.1
    for span in spans:
        span.attempt_started_at = clock.t
    clock.t += 0.1
    headers = AttemptOutcome(status="conn_reset", http_status=200, started_at=clock.t,
                             conn_ready_at=clock.t, error="connection reset")
    outcomes = [headers, headers, _reset(clock.t), _reset(clock.t)]
    assert not any(shard._endpoint_down(s, o) for s, o in zip(spans, outcomes, strict=True))
    assert [Shard._first_list_only(span) for span in spans] == [True] * 4  # free
    clock.t += 0.5
    for span in spans:
        span.attempt_started_at = clock.t
    clock.t += 0.1
    assert not any(shard._endpoint_down(s, o) for s, o in zip(spans, outcomes, strict=True))
    assert [Shard._first_list_only(span) for span in spans] == [False] * 4  # charged
    # Another kind of failure is no list-only one: no free retry comes of it.
    shard._endpoint_down(spans[0], AttemptOutcome(status="http_4xx", http_status=400,
                                                  started_at=clock.t, error="bad request"))
    assert not spans[0].list_only_now


@pytest.mark.parametrize("during_list", [False, True], ids=["waiting", "asking_the_list"])
def test_an_outage_probe_waiting_to_try_again_goes_when_the_endpoint_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, during_list: bool) -> None:
    """The probe waits its interval (up to PROBE_MAX_S) before it tries again. A request of
    ours answered meanwhile ends the outage: the items waiting on the probe go at once, and so
    does the probe, whose slot sat idle to its interval's end; so it did when the answer came
    while its GET of the model list was out (the list unanswered), back before its wait began."""
    clock, shard, spans = _four_spans(tmp_path, held=False)
    monkeypatch.setattr(shard.retrier, "backoff", lambda attempt: 60.0)

    async def no_list(_timeout: float) -> bool:
        if during_list:
            await asyncio.sleep(0.1)  # the answer below comes meanwhile
        return False

    async def main() -> bool:
        probe = spans[0]
        probe.history.append({})
        assert shard._endpoint_down(probe, _reset(clock.t))
        client = SimpleNamespace(answers=no_list)
        task = asyncio.create_task(
            shard._wait_out_outage(client, probe, 1))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not task.done() and shard.prober is probe
        clock.t += 1
        _answered(shard, clock, "in flight before")
        assert shard.endpoint_back.is_set() and shard.prober is None
        return await asyncio.wait_for(task, PROBE_MAX_S / 2)  # its interval not slept out

    assert asyncio.run(main()) is True


def test_a_list_answer_after_one_of_our_requests_was_answered_starts_no_list_only_state(
        tmp_path: Path) -> None:
    """The probe's GET of the model list is out (up to 5 s) when a request sent earlier is
    answered, which ends the outage. The list's answer then adds nothing: a request dropped
    after it is judged as in any outage (held), not charged as the item's own."""
    clock, shard, spans = _four_spans(tmp_path, held=True)
    clock.t += 1
    asked = clock.t
    clock.t += 0.5
    _answered(shard, clock, "sent before")
    clock.t += 0.5
    shard._list_answered(spans[0], asked)
    assert shard.list_only_since is None
    clock.t += 0.1
    for span in spans:
        span.attempt_started_at = clock.t
    clock.t += 0.1
    assert [shard._endpoint_down(span, _reset(clock.t)) for span in spans] == [True] * 4


def test_the_once_a_second_check_stops_an_outage_at_outage_s_but_not_during_a_stop(
        tmp_path: Path) -> None:
    """The shard's ticker stops an outage at retry.outage_s, whatever its probe is doing (it
    naps up to PROBE_MAX_S between tries), naming the outage's latest failure; nothing is
    decided during a stop."""
    clock, shard = _clocked_shard(tmp_path, answered_before=True, retry={"outage_s": 2.0})
    assert shard._endpoint_down(Span("s", {"id": "s"}, clock.t), _refused(clock.t))
    clock.t += 1.9
    shard._failing_limit(clock.now())
    assert shard.fatal_reason is None
    clock.t += 0.1
    shard.stopping = True
    shard._failing_limit(clock.now())
    assert shard.fatal_reason is None  # a stop under way: no second reason
    shard.stopping = False
    shard._failing_limit(clock.now())
    assert shard.fatal_reason == ("the endpoint failed every request for 2 s (connection "
                                  "refused), longer than retry.outage_s; continue with "
                                  "--resume once it answers again")
    assert shard.fatal_mode == "abandon"
    shard.close()


def test_a_storm_before_any_success_of_the_run_stops_after_a_minute_not_after_outage_s(
        tmp_path: Path) -> None:
    """A shard in a storm with no success of its own stops after a minute with the sentence
    that nothing of the run has succeeded, unless the run has: the coordinator's `answered`
    message (another shard's success) gives it retry.outage_s and the outage's sentence."""
    clock, shard = _clocked_shard(tmp_path, retry={"outage_s": 600.0})
    failed = AttemptOutcome(status="http_5xx", http_status=500, started_at=clock.t,
                            error="HTTP 500: broken")
    for n in range(8):
        shard._storm_failed(Span(f"s{n}", {"id": f"s{n}"}, clock.t), failed)
    assert shard.storm.on
    clock.t += 59
    assert shard._storm_too_long(clock.now()) is None
    clock.t += 1
    said = shard._storm_too_long(clock.now())
    assert said is not None and "none of this run has succeeded" in said
    assert "(HTTP 500: broken)" in said
    shard.on_message({"t": protocol.ANSWERED})
    assert shard._storm_too_long(clock.now()) is None
    clock.t += 540
    said = shard._storm_too_long(clock.now())
    assert said is not None and said.endswith("longer than retry.outage_s; continue with "
                                              "--resume once it answers again")
    shard.close()


def test_before_any_success_a_storm_whose_server_asked_to_wait_stops_after_its_next_probe(
        tmp_path: Path) -> None:
    """Before any success, a Retry-After longer than the minute (120 s, under the 300 s
    ceiling) puts the stop off until a probe at the time asked has had its chance
    (PROBE_MAX_S), never past retry.outage_s; the stop is never decided during a stop."""
    clock, shard = _clocked_shard(tmp_path, retry={"outage_s": 600.0})
    failed = AttemptOutcome(status="http_5xx", http_status=503, started_at=clock.t,
                            retry_after="120", error="HTTP 503: come back later")
    for n in range(8):
        shard._storm_failed(Span(f"s{n}", {"id": f"s{n}"}, clock.t), failed)
    assert shard.storm.on and shard.storm.next_probe_at == clock.t + 120
    clock.t += 120 + PROBE_MAX_S - 1
    assert shard._storm_too_long(clock.now()) is None
    shard.stopping = True
    clock.t += 2
    shard._failing_limit(clock.now())
    assert shard.fatal_reason is None  # a stop under way: no second reason
    shard.stopping = False
    shard._failing_limit(clock.now())
    assert shard.fatal_reason is not None and "none of this run has succeeded" in \
        shard.fatal_reason
    shard.close()


def test_every_success_counts_toward_the_rate_a_storm_is_judged_by(tmp_path: Path) -> None:
    """A shard that saw the server fail four requests in five, then serve STORM_WINDOW
    requests well: eight items failing in a row after that make a storm, since every success
    counts toward the rate, not only one that ends a streak."""
    clock, shard = _clocked_shard(tmp_path)
    spans = (Span(f"s{n}", {"id": f"s{n}"}, clock.t) for n in range(1000))

    def fail() -> None:
        clock.t += 1
        shard._storm_failed(next(spans), AttemptOutcome(status="http_5xx", http_status=503,
                                                        started_at=clock.t - 0.5))

    def succeed() -> None:
        clock.t += 1
        span = next(spans)
        span.admitted_at = span.attempt_started_at = clock.t - 0.5
        shard._succeed(span, AttemptOutcome(status="ok", http_status=200,
                                            started_at=clock.t - 0.5, ended_at=clock.t))

    for _ in range(10):
        for _ in range(4):
            fail()
        succeed()
    assert shard.storm.needed() > 8
    for _ in range(STORM_WINDOW):
        succeed()
    for _ in range(8):
        fail()
    assert shard.storm.on
    shard.close()


def test_holds_for_a_rate_limit_do_not_lengthen_a_later_outage_probes_wait(
        tmp_path: Path) -> None:
    """An item held three times by 429s (each a free try, `outage_tries`, so its attempts are
    not spent), then the outage's probe: its first wait is the first interval, as any item's
    (backoff(1)); the holds made it backoff(4), eight times as long at backoff_s and capped
    at PROBE_MAX_S. Its attempts still do not count the holds or the outage."""
    clock, shard, spans = _four_spans(tmp_path, held=False)
    shard.retrier.backoff = float  # type: ignore[method-assign]  # backoff(n) = n s
    probe = spans[0]

    async def no_wait(_seconds: float) -> None:
        return None

    async def no_list(_timeout: float) -> bool:
        return False

    shard._pause = no_wait  # type: ignore[method-assign]
    limited = AttemptOutcome(status="http_429", http_status=429, started_at=clock.t,
                             retry_after="1", error="HTTP 429: Rate limit reached for requests")

    async def main() -> None:
        for attempt in (1, 2, 3):
            probe.history.append({})
            assert await shard._hold_for_limit(probe, attempt, limited)
        probe.history.append({})
        assert shard._endpoint_down(probe, _reset(clock.t))
        task = asyncio.create_task(shard._wait_out_outage(
            SimpleNamespace(answers=no_list), probe, 4))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert probe.history[-1]["wait"] == 1.0
        assert probe.outage_tries == 4  # attempt 5 is still the item's first of its own
        clock.t += 1
        _answered(shard, clock, "other")
        await asyncio.wait_for(task, PROBE_MAX_S / 2)

    asyncio.run(main())
    shard.close()


@pytest.mark.parametrize(("status", "http", "retry_after", "wait", "probes"), [
    ("http_5xx", 503, None, 5.0, 4),  # failing as the storm does: the interval grows
    ("http_5xx", 503, "7", 7.0, 4),  # ... or is what the server asked for
    ("http_429", 429, None, 1.0, 3),  # an answer, but no proof: the first interval again
    ("http_429", 429, "2", 2.0, 3),  # ... or what the 429 asked for
    ("http_429", 429, "900", 300.0, 3),  # ... up to retry.max_server_wait_s (300 s)
    ("http_5xx", 503, "900", 300.0, 4),  # as for a 5xx's ask
    ("timeout_first_token", 200, None, 1.0, 3),  # no answer at all: the first interval
    ("http_4xx", 400, None, 1.0, 3),  # the probe's item refused: says nothing of the storm
])
def test_only_a_probe_failing_as_the_storm_does_puts_the_next_probe_off_longer(
        tmp_path: Path, status: str, http: int, retry_after: str | None, wait: float,
        probes: int) -> None:
    """Three probes of a storm have failed. A fourth that fails with a 5xx puts the next one
    off by a grown interval; one answered 429, or timed out, or refused for its item, after
    the server recovered says nothing either way: the next goes after the first interval (or
    a 429's Retry-After), not a grown one, so the hold ends soon after the recovery."""
    clock, shard = _clocked_shard(tmp_path)
    shard.retrier.backoff = float  # type: ignore[method-assign]  # backoff(n) = n s
    for n in range(8):
        shard._storm_failed(Span(f"s{n}", {"id": f"s{n}"}, clock.t),
                            AttemptOutcome(status="http_5xx", http_status=503, started_at=0))
    assert shard.storm.on
    shard.storm.probes = 3
    probe = Span("probe", {"id": "probe"}, clock.t)
    shard.storm_probe = probe
    clock.t += 10
    ended = AttemptOutcome(status=status, http_status=http, started_at=clock.t - 1,
                           retry_after=retry_after)
    shard._probe_done(ended)
    if status == "http_5xx":
        shard._storm_failed(probe, ended)
    assert shard.storm_probe is None and shard.storm.on
    assert shard.storm.probes == probes
    assert shard.storm.next_probe_at == clock.t + wait
    shard.close()


@pytest.mark.parametrize(("cap", "proven", "after"), [
    (2, False, 2),  # before any success: the items the cap holds
    (1, False, 2),  # one item alone is never a storm
    (32, False, 8),
    (2, True, 8),  # once a request of the run has succeeded (here in an earlier pass)
])
def test_before_any_success_of_the_run_the_items_the_cap_holds_make_a_storm(
        tmp_path: Path, cap: int, proven: bool, after: int) -> None:
    clock, shard = _clocked_shard(tmp_path, concurrency=cap, answered_before=proven)
    failed = AttemptOutcome(status="http_5xx", http_status=503, started_at=clock.t)
    first = Span("s0", {"id": "s0"}, clock.t)
    assert not shard._storm_failed(first, failed) and not shard._storm_failed(first, failed)
    for n in range(1, after - 1):
        assert not shard._storm_failed(Span(f"s{n}", {"id": f"s{n}"}, clock.t), failed)
    assert shard._storm_failed(Span("last", {"id": "last"}, clock.t), failed)
    shard.close()


@pytest.mark.parametrize(("ended", "left", "after"), [
    (True, 3, 3),  # its input ended: as many items as it has left make a storm
    (True, 1, 2),  # ... two at least: one item alone is never a storm
    (True, 20, 8),
    (False, 3, 8),  # more may come: eight, as ever
])
def test_a_shards_last_items_failing_make_a_storm(tmp_path: Path, ended: bool, left: int,
                                                  after: int) -> None:
    clock, shard = _clocked_shard(tmp_path, concurrency=32, answered_before=True)
    shard.input_ended = ended
    shard.counters.in_flight = left
    failed = AttemptOutcome(status="http_5xx", http_status=503, started_at=clock.t)
    for n in range(after - 1):
        assert not shard._storm_failed(Span(f"s{n}", {"id": f"s{n}"}, clock.t), failed)
    assert shard._storm_failed(Span("last", {"id": "last"}, clock.t), failed)
    shard.close()


@pytest.mark.parametrize(("cap", "ended", "in_flight", "queued", "deciding", "may"), [
    (1, False, 1, 5, 1, False),  # the one slot waits for the watch: nothing else goes out
    (8, False, 8, 5, 8, False),  # every slot does
    (8, False, 1, 0, 1, True),  # a slot free, and more items to come
    (8, True, 1, 0, 1, False),  # a shard's last item: nothing left to join its streak
    (8, True, 2, 0, 1, True),  # the last 2 items: 1 failed + 1 out make the 2 needed
    (8, False, 4, 2, 1, True),  # 4 out, more to come
    (8, True, 4, 2, 1, True),  # 1 failed + 3 others out + 2 queued: the 6 left make it
    (8, True, 3, 0, 3, False),  # the last 3 all waiting (the streak has just 1): none to join
])
def test_a_failure_waits_for_the_storm_watch_only_while_its_streak_may_grow(
        tmp_path: Path, cap: int, ended: bool, in_flight: int, queued: int, deciding: int,
        may: bool) -> None:
    """`Shard._streak_may_grow`: only other items of the shard, out or yet to go, can make a
    streak a storm; a failure waiting for the watch holds its slot."""
    clock, shard = _clocked_shard(tmp_path, concurrency=cap, answered_before=True)
    shard.input_ended = ended
    shard.counters.in_flight, shard.deciding = in_flight, deciding
    shard.queue.extend(Span(f"q{n}", {"id": f"q{n}"}, clock.t) for n in range(queued))
    shard.storm.failed("s0", clock.t)
    assert shard._streak_may_grow() is may
    shard.close()


def test_a_retrys_backoff_ends_when_a_storm_begins(tmp_path: Path) -> None:
    """`Shard._back_off`: an item of the streak waiting out its backoff (a minute here) joins
    the held items as soon as the storm begins, without any time passing: left in its backoff,
    the item that made the storm probed alone, again and again, and spent its attempts."""
    cfg = _config(tmp_path, answered_before=True)

    async def main() -> None:
        shard = Shard(cfg, lambda message: None)  # type: ignore[arg-type]
        backoff = asyncio.create_task(shard._back_off(60.0))
        failed = AttemptOutcome(status="http_5xx", http_status=503, started_at=0.0)
        for n in range(STORM_AFTER):
            for _ in range(5):  # the loop runs on: the backoff goes on until the storm
                await asyncio.sleep(0)
            assert not backoff.done()
            shard._storm_failed(Span(f"s{n}", {"id": f"s{n}"}, 0.0), failed)
        assert shard.storm.on
        for _ in range(20):
            await asyncio.sleep(0)
        assert backoff.done()
        shard.close()

    asyncio.run(main())


def test_a_shard_reports_how_long_its_requests_out_have_heard_nothing(tmp_path: Path) -> None:
    """`unheard_s` in a progress report: since the latest of a stream's events (the client's
    `heard_at`), an attempt ending with an answer, and the last moment no request was out;
    `sending` is the requests out."""
    clock, shard = _clocked_shard(tmp_path)
    client = SimpleNamespace(heard_at=0.0)
    shard.clients = {"chat": client}  # type: ignore[dict-item]
    clock.t += 100
    assert shard._unheard_s() == 0.0  # nothing out: nothing awaited
    shard.sending = 3
    clock.t += 40
    assert (shard.report("progress")["unheard_s"], shard.report("progress")["sending"]) == (40, 3)
    client.heard_at = clock.t - 5  # a stream's events
    assert shard._unheard_s() == 5.0
    shard.answer_at = clock.t - 1  # an answer (a failure's too)
    assert shard._unheard_s() == 1.0
    shard.sending = 0
    clock.t += 60
    assert shard._unheard_s() == 0.0
    shard.sending = 1  # out again: counted from when none was
    clock.t += 10
    assert shard._unheard_s() == 10.0
    shard.close()


def test_a_failure_waiting_for_the_watch_as_the_input_ends_is_held_by_the_storm(
        tmp_path: Path) -> None:
    """A failure asking to wait above the ceiling waits for the storm watch; the input ends
    while it waits, with 6 items left: the streak needed is then 6, not the 8 it was when the
    failure came, so the wait goes on, and once the 5 others fail the storm holds them all,
    the waiting one too (it was dead-lettered at the input's end, the storm then holding the
    rest). Two waiting failures that are all the shard has left begin the storm themselves."""
    cfg = _config(tmp_path, concurrency=8, answered_before=True)
    asked = AttemptOutcome(status="http_5xx", http_status=503, started_at=0.0,
                           retry_after="3600")

    async def main() -> None:
        shard = Shard(cfg, lambda message: None)  # type: ignore[arg-type]
        shard.counters.in_flight = 6
        first = Span("a", {"id": "a"}, 0.0)
        assert not shard._storm_failed(first, asked)
        waiting = asyncio.create_task(shard._storm_decides(first, asked))
        await asyncio.sleep(0.01)
        shard.input_ended = True
        shard._wake_held()  # as the input's end does
        await asyncio.sleep(0.01)
        assert not waiting.done()
        for n in range(5):
            shard._storm_failed(Span(f"s{n}", {"id": f"s{n}"}, 0.0), asked)
        assert await asyncio.wait_for(waiting, 1.0) is True
        assert shard.storm.on and shard.deciding == 0
        shard.close()

        last = Shard(cfg, lambda message: None)  # type: ignore[arg-type]
        last.counters.in_flight = 2
        pair = [Span(name, {"id": name}, 0.0) for name in ("b", "c")]
        for span in pair:
            assert not last._storm_failed(span, asked)  # 2 of the 8 while input may come
        both = [asyncio.create_task(last._storm_decides(span, asked)) for span in pair]
        await asyncio.sleep(0.01)
        last.input_ended = True
        last._wake_held()
        assert await asyncio.wait_for(asyncio.gather(*both), 1.0) == [True, True]
        assert last.storm.on and last.storm_cause
        last.close()

    asyncio.run(main())


class _Restarts:
    """A server behind a gateway that answers its model list: each request is answered as
    `script` says, in turn ("reset": dropped on a connection the gateway took; "refused": no
    connection at all; "503": failing), then refused until `up`, then answered."""

    url = "http://x"
    heard_at = 0.0

    def __init__(self, script: list[str]) -> None:
        self.script, self.up, self.calls = script, False, 0

    async def answers(self, _timeout: float) -> bool:
        return self.up

    async def attempt(self, body: Any, on_first_token: Any = None) -> AttemptOutcome:
        await asyncio.sleep(0)
        now = asyncio.get_running_loop().time()
        what = self.script[self.calls] if self.calls < len(self.script) else "refused"
        self.calls += 1
        if self.up and self.calls > len(self.script):
            return AttemptOutcome(status="ok", http_status=200, started_at=now, ended_at=now,
                                  text="hi", finish_reason="stop", prompt_tokens=2,
                                  completion_tokens=3)
        if what == "503":
            return AttemptOutcome(status="http_5xx", http_status=503, started_at=now,
                                  ended_at=now, conn_ready_at=now, error="HTTP 503")
        return _reset(now, connected=what == "reset")


@pytest.mark.parametrize("role", ["outage", "storm"])
def test_a_probe_beside_the_cap_waiting_for_a_slot_hands_on_its_role(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    """Cap 1, only the model list answers: the item in the slot fails, is held, and a fresh
    item goes beside the cap as the probe. It fails too, the server gone (the outage's probe
    then) or failing (the storm's), and must take a slot before it goes again; the item in the
    slot, released, meets the same and waits for that probe's word. Keeping its role, the
    probe waited for a slot the waiting item held: nothing went out until retry.outage_s
    stopped the run, long after the server was back. Now it hands its role on: the item in the
    slot probes, is answered, and its slot goes to the probe before the queue."""
    monkeypatch.setattr("shardrun.shard.RECHECK_S", 0.01)
    cfg = _config(tmp_path, concurrency=1, answered_before=True)
    client = _Restarts(["reset", "refused" if role == "outage" else "503"])

    async def main() -> None:
        shard = Shard(cfg, lambda message: None)  # type: ignore[arg-type]
        monkeypatch.setattr(shard.retrier, "backoff", lambda attempt: 0.01)
        shard.clients = {"chat": client}  # type: ignore[dict-item]
        if role == "storm":  # the server failing every request already
            failed = AttemptOutcome(status="http_5xx", http_status=503, started_at=0.0)
            for n in range(STORM_AFTER):
                shard._storm_failed(Span(f"x{n}", {"id": f"x{n}"}, 0.0), failed)
            assert shard.storm.on
        shard.list_only_since = shard.clock.now()  # an outage's probe found the list answering
        items = [{"id": f"i{n}", "messages": [{"role": "user", "content": "x"}]}
                 for n in range(3)]
        shard.on_message({"t": protocol.ITEMS, "items": items})
        shard.on_message({"t": protocol.END})
        dispatcher = asyncio.create_task(shard.dispatch())
        for _ in range(2000):  # the probe beside the cap waits for a slot
            if shard.slot_wanted or dispatcher.done():
                break
            await asyncio.sleep(0.005)
        assert shard.slot_wanted
        client.up = True  # the server is back
        await asyncio.wait_for(_drain(shard, dispatcher), 30)  # a guard: a stall never ends
        assert shard.counters.ok == 3 and not shard.slot_wanted
        assert shard.sem._value == cfg.concurrency  # every slot back
        shard.close()

    asyncio.run(main())


class _Random:
    """A server answering each request at random, seeded (ok, dropped on a connection, refused,
    503, 400), its model list at random too; counts the requests out at once."""

    url = "http://x"
    heard_at = 0.0

    def __init__(self, seed: int) -> None:
        self.rng, self.out, self.most, self.calls = random.Random(seed), 0, 0, 0

    async def answers(self, _timeout: float) -> bool:
        return self.rng.random() < 0.5

    async def attempt(self, body: Any, on_first_token: Any = None) -> AttemptOutcome:
        self.calls += 1
        self.out += 1
        self.most = max(self.most, self.out)
        try:
            await asyncio.sleep(self.rng.choice([0, 0, 0.001, 0.003]))
        finally:
            self.out -= 1
        now = asyncio.get_running_loop().time()
        what = self.rng.choice(["ok"] * 3 + ["reset"] * 3 + ["refused", "503", "400"])
        if what == "ok":
            return AttemptOutcome(status="ok", http_status=200, started_at=now, ended_at=now,
                                  text="hi", finish_reason="stop", prompt_tokens=2,
                                  completion_tokens=3)
        if what in ("503", "400"):
            return AttemptOutcome(status="http_5xx" if what == "503" else "http_4xx",
                                  http_status=int(what), started_at=now, ended_at=now,
                                  conn_ready_at=now, error=f"HTTP {what}")
        return _reset(now, connected=what == "reset")


@pytest.mark.parametrize("seed", range(24))
def test_every_slot_of_the_cap_comes_back_whatever_the_server_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """A shard run against a server answering at random, only its model list at times (fresh
    probes beside the cap, held ones taking slots), a stop at random or while one waits: at the
    end every item has ended once, no span waits for a slot, and the semaphore holds the cap
    exactly (a slot leaked stalls the shard; one released twice lets it exceed the cap).
    The requests out stay within the cap and the one fresh probe beside it."""
    for name in ("RECHECK_S", "LIST_PROBE_S"):
        monkeypatch.setattr(f"shardrun.shard.{name}", 0.002)
    rng = random.Random(seed)
    cap = rng.choice([1, 2, 3, 4])
    cfg = _config(tmp_path, concurrency=cap, answered_before=True, grace_s=0.05,
                  retry={"max_attempts": rng.randrange(1, 5), "outage_s": 600.0})
    client = _Random(seed)
    stop = rng.choice(["none", "calls", "waiting"])  # a stop: none, at random, or with a
    stop_after = rng.randrange(5, 80)  # span beside the cap waiting for a slot

    async def main() -> None:
        shard = Shard(cfg, lambda message: None)  # type: ignore[arg-type]
        monkeypatch.setattr(shard.retrier, "backoff", lambda attempt: rng.random() / 200)
        shard.clients = {"chat": client}  # type: ignore[dict-item]
        items = [{"id": f"i{n}", "messages": [{"role": "user", "content": "x"}]}
                 for n in range(40)]
        shard.on_message({"t": protocol.ITEMS, "items": items})
        shard.on_message({"t": protocol.END})
        dispatcher = asyncio.create_task(shard.dispatch())
        drain = asyncio.create_task(_drain(shard, dispatcher))
        for _ in range(20_000):  # bounded: a stall fails below
            if drain.done():
                break
            if not shard.stopping and ((stop == "calls" and client.calls >= stop_after)
                                       or (stop == "waiting" and bool(shard.slot_wanted))):
                shard.on_message({"t": protocol.STOP})
            if shard.list_only_since is None and rng.random() < 0.3:
                shard.list_only_since = shard.clock.now()  # only the list answers, for now
            await asyncio.sleep(0.001)
        assert drain.done(), (shard.counters.as_dict(), len(shard.slot_wanted))
        await asyncio.gather(dispatcher, *shard.tasks, return_exceptions=True)
        counters = shard.counters
        assert counters.ok + counters.dead + counters.abandoned == counters.received == 40
        assert not shard.slot_wanted and shard.sem._value == cap, shard.sem._value
        assert client.most <= cap + 1, (client.most, cap)
        shard.close()

    asyncio.run(main())


def test_a_freed_slot_goes_to_the_span_beside_the_cap_before_the_queue(tmp_path: Path) -> None:
    """`Shard._take_a_slot`: with a slot free, a span beside the cap takes it at once; with
    none, it waits, and the next slot freed is its own, not the queue's, even where the
    dispatcher was woken for it before the span came to wait (a semaphore's slot is the
    woken waiter's from its release on): the dispatcher hands it on (`_pass_slot`)."""
    cfg = _config(tmp_path, concurrency=1, answered_before=True)

    async def main() -> None:
        shard = Shard(cfg, lambda message: None)  # type: ignore[arg-type]
        first = Span("a", {"id": "a"}, 0.0)
        first.beside_cap = True
        await shard._take_a_slot(first)  # free: taken without a wait
        assert not first.beside_cap and shard.sem._value == 0
        shard.on_message({"t": protocol.ITEMS, "items": [{"id": "q", "prompt": "x"}]})
        shard.on_message({"t": protocol.END})
        dispatcher = asyncio.create_task(shard.dispatch())
        await asyncio.sleep(0)  # it waits for the slot
        go, second = asyncio.Event(), Span("b", {"id": "b"}, 0.0)
        second.beside_cap = True

        async def beside() -> None:
            await go.wait()
            await shard._take_a_slot(second)

        waiting = asyncio.create_task(beside())
        await asyncio.sleep(0)
        go.set()  # it looks for a slot after the dispatcher was woken, before it runs
        shard._free_slot()  # the first span's end
        await asyncio.wait_for(waiting, 5)  # a guard: a slot never handed on never ends
        assert not second.beside_cap and [s.item_id for s in shard.queue] == ["q"]
        assert shard.sem._value == 0 and not shard.slot_wanted
        dispatcher.cancel()
        await asyncio.gather(dispatcher, return_exceptions=True)
        shard.close()

    asyncio.run(main())
