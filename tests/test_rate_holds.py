"""A 429 that is no quota's holds its item (`Shard._hold_for_limit`): what bounds one item's
holds. The shard runs its real attempt loop against a client that answers from a script, on a
clock the test moves, so no hold takes any time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from shardrun import protocol
from shardrun.client import AttemptOutcome
from shardrun.items import prompt_chars
from shardrun.ratelimit import DEFAULT_COMPLETION_TOKENS, estimate_request_tokens
from shardrun.shard import Shard
from shardrun.shard_config import ShardConfig
from shardrun.spans import Span

TOO_LARGE = ("HTTP 429: Request too large for gpt-4o in organization org-x on tokens per min "
             "(TPM): Limit 30000, Requested 45000. The input or output tokens must be reduced "
             "in order to run successfully.")
PACE = "HTTP 429: Rate limit reached for requests. Please try again in 1s."


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


class _Client:
    """Answers each attempt with the next of `errors` (a 429 with those words; None: a
    success, of 2 prompt and 3 completion tokens), then successes; each attempt takes `took`
    seconds of the test's clock."""

    url = "http://x"

    def __init__(self, clock: _Clock, errors: list[str | None], took: float = 1.0,
                 headers: dict[str, str] | None = None, stated_from: int = 0,
                 ok_headers: dict[str, str] | None = None) -> None:  # fmt: skip
        self.clock, self.errors, self.took, self.calls = clock, errors, took, 0
        self.heard_at = 0.0  # as a real client notes it, for the shard's progress reports
        # The x-ratelimit-* headers of every 429 from attempt `stated_from` (from 0) on, and
        # of every success.
        self.headers, self.stated_from, self.ok_headers = headers or {}, stated_from, ok_headers

    async def attempt(self, body: Any, on_first_token: Any = None) -> AttemptOutcome:
        started = self.clock.t
        self.clock.t += self.took
        error = self.errors[self.calls] if self.calls < len(self.errors) else None
        self.calls += 1
        if error is None:
            return AttemptOutcome(status="ok", http_status=200, started_at=started,
                                  ended_at=self.clock.t, text="hi", finish_reason="stop",
                                  prompt_tokens=2, completion_tokens=3,
                                  rate_headers=self.ok_headers or {})
        return AttemptOutcome(status="http_429", http_status=429, started_at=started,
                              ended_at=self.clock.t, error=error,
                              rate_headers=self.headers if self.calls > self.stated_from else {})


def _run_one(tmp_path: Path, errors: list[str | None], others_answered: bool = False,
             stop_at: int | None = None, headers: dict[str, str] | None = None,
             shard_count: int = 1, params: dict[str, Any] | None = None, took: float = 1.0,
             stop_in_hold: int | None = None, stated_from: int = 0,
             reports: list[protocol.Message] | None = None,
             ok_headers: dict[str, str] | None = None,
             out_reports: list[protocol.Message] | None = None,
             **retry: float) -> tuple[Shard, int]:
    """One item through the shard's attempts: the shard, and how many attempts it made;
    `others_answered`: during each hold the server answers another request (as a success of
    another item tells the shard, `Shard._limit_answered`); `stop_at`: a stop comes while
    that attempt (from 0) is out; `stop_in_hold`: one comes during the wait of the hold after
    that attempt (from 1); `params`, the job's; `took`, each attempt's seconds; `stated_from`,
    the first attempt (from 0) whose 429 carries `headers`; `ok_headers`, a success's;
    `reports`: the shard's progress report as each hold's wait starts goes there;
    `out_reports`: its report as each attempt goes out."""
    clock = _Clock()
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://x",
                      api="chat", model="m", retry=retry, shard_count=shard_count,
                      params=params or {})
    shard = Shard(cfg, lambda message: None, clock=clock)  # type: ignore[arg-type]
    shard.limiter._clock = clock.now  # its pacers are paid by the test's clock too
    client = _Client(clock, errors, headers=headers, took=took, stated_from=stated_from,
                     ok_headers=ok_headers)
    answer = client.attempt

    async def attempt(body: Any, on_first_token: Any = None) -> AttemptOutcome:
        if out_reports is not None:
            out_reports.append(shard.report(protocol.PROGRESS))
        if client.calls == stop_at:
            shard.stopping = True
        return await answer(body, on_first_token)

    client.attempt = attempt  # type: ignore[method-assign]
    shard.clients = {"chat": client}  # type: ignore[dict-item]

    async def pause(wait: float) -> None:  # a hold's wait passes on the test's clock
        if reports is not None:
            reports.append(shard.report(protocol.PROGRESS))
        clock.t += wait
        if client.calls == stop_in_hold:
            shard.stopping = True
        if others_answered:
            shard.limited_since = None

    shard._pause = pause  # type: ignore[method-assign]
    span = Span("s0", {"id": "a", "messages": [{"role": "user", "content": "x"}]}, clock.t)
    span.prompt_chars = prompt_chars(span.item)  # as the shard's enqueue sets it
    span.admitted_at = clock.t
    asyncio.run(shard._attempts(span))
    shard.close()
    return shard, client.calls


def _dead(tmp_path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for path in (tmp_path / "dead").glob("*.jsonl")
            for line in path.read_bytes().splitlines()]


def test_a_request_larger_than_the_whole_limit_is_dead_lettered_at_once(tmp_path: Path) -> None:
    """OpenAI's 429 for a request that alone asks more than the per-minute limit: no wait lets
    it through, so the item is a dead letter at its first answer, with the server's words
    (held, it cycled for ever; here the script would let its fourth attempt succeed)."""
    shard, calls = _run_one(tmp_path, [TOO_LARGE] * 3)
    assert calls == 1 and shard.counters.dead == 1
    assert [d["reason"] for d in _dead(tmp_path)] == [f"request_over_limit: {TOO_LARGE}"]
    assert shard.limited_since is None  # not a sign the server refuses everything


def test_an_item_refused_for_outage_s_while_others_are_answered_is_dead_lettered(
        tmp_path: Path) -> None:
    """429s that spend no attempts must still end: an item the server keeps refusing while it
    answers others (a token limit a big prompt never fits under among small ones) is a dead
    letter once held retry.outage_s, naming how long and the server's last words (held, it
    cycled through every 429 of the script, and its last attempt succeeded)."""
    shard, calls = _run_one(tmp_path, [PACE] * 200, others_answered=True, outage_s=30.0)
    assert shard.counters.dead == 1 and calls < 200, calls
    (reason,) = [d["reason"] for d in _dead(tmp_path)]
    assert reason.startswith("rate_limited_too_long: refused with 429 for ")
    assert reason.endswith(f"while the server answered other requests; last: {PACE}")
    held = float(reason.split(" for ")[1].split(" s ")[0])
    assert 30 <= held < 40, reason  # one hold past the bound at most (a wait is under 5 s)


def test_an_item_refused_while_the_server_refuses_everything_stops_the_run(
        tmp_path: Path) -> None:
    """The same 429s with no other answer are the server's limit, not the item's: the run stops
    for --resume and the item gets no dead letter."""
    shard, calls = _run_one(tmp_path, [PACE] * 200, outage_s=30.0)
    assert shard.counters.dead == 0 and calls < 200
    assert shard.fatal_reason is not None and "answered every request with 429" in (
        shard.fatal_reason)
    assert _dead(tmp_path) == []


def _held_lines(tmp_path: Path) -> int:
    return sum(rec["ev"] == "retry" and rec["why"] == "rate_limited"
               for path in (tmp_path / "events").glob("*.jsonl")
               for rec in map(orjson.loads, path.read_bytes().splitlines()))


def test_the_429s_counted_held_are_those_that_held_their_item(tmp_path: Path) -> None:
    """`limited_429s`, the live line's and the summary's "429s held", counts the 429s that held
    their item, as `report` counts the `rate_limited` retry lines: not the last 429 of an item
    dead-lettered, of a run stopped, or one that came back during a stop (the item abandoned)."""
    dead, calls = _run_one(tmp_path / "dead", [PACE] * 200, others_answered=True, outage_s=30.0)
    assert dead.counters.dead == 1 and dead.counters.limited_429s == calls - 1
    assert _held_lines(tmp_path / "dead") == calls - 1
    fatal, calls = _run_one(tmp_path / "fatal", [PACE] * 200, outage_s=30.0)
    assert fatal.fatal_reason is not None and fatal.counters.limited_429s == calls - 1
    assert _held_lines(tmp_path / "fatal") == calls - 1
    stopped, calls = _run_one(tmp_path / "stop", [PACE] * 5, stop_at=2)
    assert calls == 3 and stopped.counters.abandoned == 1
    assert stopped.counters.limited_429s == 2 == _held_lines(tmp_path / "stop")
    # A stop during a hold's wait: the retry is never sent, so it has no line, nor a count.
    waiting, calls = _run_one(tmp_path / "hold", [PACE] * 5, stop_in_hold=2)
    assert calls == 2 and waiting.counters.abandoned == 1
    assert waiting.counters.limited_429s == 1 == _held_lines(tmp_path / "hold")


def test_a_report_taken_while_a_held_retry_is_out_counts_what_the_log_holds(
        tmp_path: Path) -> None:
    """A progress report taken while each attempt is out (three 429s held, then a success)
    counts what the log then holds, as a dead shard's summary takes it: its `attempt_start`
    lines (those ended, and the one out: `sending`) and its `retry` lines, the one out too;
    `tried` names the retry out, so a line written after the report adds it no more. The
    retry out used to be left out until it ended: a shard killed meanwhile lost it."""
    reports: list[protocol.Message] = []
    shard, calls = _run_one(tmp_path, [PACE] * 3, out_reports=reports)
    assert calls == 4 and shard.counters.ok == 1 and len(reports) == 4
    tried: dict[str, int] = {}
    for out, report in enumerate(reports, 1):  # the report taken while attempt `out` was out
        protocol.apply_changes(tried, report["tried"])
        assert (report["attempts"] + report["sending"], report["retries"]) == (out, out - 1)
        assert tried.get("s0", 0) == (out if out > 1 else 0)


def test_a_dead_shards_summary_counts_the_429s_held_as_report_does(tmp_path: Path) -> None:
    """A shard that dies after its dead letter is written, its last report taken during any of
    the item's holds: its last report plus what the dead letter on disk adds
    (`summary.add_unreported`, as the coordinator counts a dead shard) hold as many held 429s
    as `report` reads from its `rate_limited` retry lines, as its `http_429s` hold its 429s.
    Only the 429s were added before: the held ones were left as last reported."""
    from shardrun.summary import add_unreported

    reports: list[protocol.Message] = []
    shard, calls = _run_one(tmp_path, [PACE] * 200, others_answered=True, outage_s=30.0,
                            reports=reports)
    (dead,) = _dead(tmp_path)
    assert shard.counters.dead == 1 and len(reports) == calls - 1 > 2
    assert sum(a.get("held") is True for a in dead["attempts"]) == calls - 1
    tried: dict[str, int] = {}
    held: dict[str, int] = {}
    refused: dict[str, int] = {}
    for last in reports:  # each, in turn, the last the coordinator heard
        protocol.apply_changes(tried, last.get("tried") or {})
        protocol.apply_changes(held, last.get("held") or {})
        protocol.apply_changes(refused, last.get("refused") or {})
        after = add_unreported(last, tried, [], [dead], held, refused)
        assert (after["limited_429s"], after["http_429s"]) == (_held_lines(tmp_path), calls)
        assert after["limited_429s"] == shard.counters.limited_429s


def test_a_429_that_states_the_limit_paces_the_shard_at_its_share_of_it(tmp_path: Path) -> None:
    """The 429's x-ratelimit-limit-requests (600 a minute) over the run's 4 shards: the shard
    paces itself at 2.5 requests a second from its first 429; the success grows it no further
    than that share."""
    shard, calls = _run_one(tmp_path, [PACE], headers={"x-ratelimit-limit-requests": "600"},
                            shard_count=4)
    assert calls == 2 and shard.counters.ok == 1
    assert shard.limiter.learned == pytest.approx(2.5)


def test_a_429_on_tokens_paces_the_shard_by_tokens(tmp_path: Path) -> None:
    """A 429 in OpenAI's words for a token limit (60,000 a minute over 2 shards) paces the
    shard's tokens at 500 a second, not its requests; the success would grow that pace by its
    own charge, which the shard hands the limiter, but not past the stated limit's share."""
    tpm = ("HTTP 429: Rate limit reached for gpt-4o on tokens per min (TPM): Limit 60000, "
           "Used 59990, Requested 257. Please try again in 1s.")
    shard, calls = _run_one(tmp_path, [tpm], shard_count=2)
    assert calls == 2 and shard.counters.ok == 1 and shard.limiter.learned is None
    charged = estimate_request_tokens({"messages": [{"role": "user", "content": "x"}]}, {})
    assert charged > 0 and shard.limiter.learned_tokens == pytest.approx(500)


def test_a_span_is_charged_what_its_item_states(tmp_path: Path) -> None:
    """The shard charges each span `estimate_request_tokens` of its item, working out the job's
    cap once: an item with a body of its own (an OpenAI Batch line) states its own cap, or
    none, or leaves the job's, as `stated_cap` reads it."""
    params = {"max_tokens": 100}
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://x",
                      api="chat", model="m", params=params)
    shard = Shard(cfg, lambda message: None, clock=_Clock())  # type: ignore[arg-type]
    text = {"messages": [{"role": "user", "content": "x" * 41}]}
    items: list[dict[str, Any]] = [
        {"id": "plain", "prompt": "y" * 9}, {"id": "own", "body": {**text, "max_tokens": 7}},
        {"id": "none", "body": {**text, "max_tokens": None}}, {"id": "job's", "body": text},
        {"id": "empty", "body": {}, "prompt": "z"}]
    for item in items:
        shard.on_message({"t": protocol.ITEMS, "items": [item]})
    charged = []
    for span in shard.queue:
        asyncio.run(shard._rate_wait(span, 1))
        charged.append(span.charged)
    shard.close()
    assert charged == [estimate_request_tokens(item, params) for item in items]
    assert charged == [3 + 100, 11 + 7, 11 + DEFAULT_COMPLETION_TOKENS, 11 + 100, 0 + 100]


def test_under_a_token_pace_only_a_request_that_states_its_cap_keeps_it_charged(
        tmp_path: Path) -> None:
    """Paced by tokens, an answer of 5 tokens: a request with no max_tokens had a guessed
    DEFAULT_COMPLETION_TOKENS charged, which the server never counts, and it is refunded (the
    tokens pacer owes the 5 it used); with the job's max_tokens 256 the cap stays owed, as the
    server counted it when the request came. Each attempt takes no time of the test's clock, so
    the debt is what the answer left."""
    tpm = ("HTTP 429: Rate limit reached for gpt-4o on tokens per min (TPM): Limit 60000, "
           "Used 59990, Requested 257. Please try again in 1s.")
    debts = []
    for params in ({}, {"max_tokens": 256}):
        path = tmp_path / str(len(debts))
        shard, calls = _run_one(path, [tpm], params=params, took=0.0)
        assert calls == 2 and shard.counters.ok == 1 and shard.limiter.tokens is not None
        debts.append(shard.limiter.tokens.debt)
    assert debts == [5, 1 + 256]


def test_a_seeded_pace_follows_the_coordinators_count_of_shards_left(tmp_path: Path) -> None:
    """Seeded at a quarter of the stated 600 requests a minute (4 shards), the shard is told
    two are left (the coordinator's RATE message carries `live`, with or without job limits):
    its pace is half the limit, and it says so as its reports' pace (`_paced`, which logs it
    as a `rate_learned` line too, marked `resplit`: `report` counts it as no seed of its own),
    while there is input to pace."""
    shard, _ = _run_one(tmp_path, [PACE], headers={"x-ratelimit-limit-requests": "600"},
                        shard_count=4)
    assert shard.limiter.learned == pytest.approx(2.5)
    logged: list[dict[str, Any]] = [  # the seed, in the log the shard closed
        rec for rec in map(orjson.loads, (tmp_path / "events" / "shard-00.jsonl").read_bytes()
                           .splitlines()) if rec["ev"] == "rate_learned"]
    shard.log.emit = lambda ev, /, **fields: logged.append({"ev": ev, **fields})  # type: ignore
    shard.on_message({"t": protocol.RATE, "rpm": None, "tpm": None, "live": 2})
    assert shard.limiter.learned == pytest.approx(5.0) and shard.paced_rps == 5.0
    assert [(rec["ev"], rec["rps"], rec["seeded"], rec.get("resplit")) for rec in logged] == [
        ("rate_learned", 2.5, True, None),  # its share of the stated 600 a minute
        ("rate_learned", 5.0, True, True)]
    # Once the input has ended, shards finish one by one: the survivor paces at the share of
    # those gone, but logs and reports none of it, or the paces summed over the shards would
    # read as more than the limit (here 2.5 + 5 + 10 a second of a limit of 10).
    shard.on_message({"t": protocol.END})
    shard.on_message({"t": protocol.RATE, "rpm": None, "tpm": None, "live": 1})
    assert shard.limiter.learned == pytest.approx(10.0) and shard.paced_rps == 5.0
    assert len(logged) == 2


def _learned_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [rec for rec in map(orjson.loads, (tmp_path / "events" / "shard-00.jsonl")
                               .read_bytes().splitlines()) if rec["ev"] == "rate_learned"]


def test_a_cut_pace_lowered_to_the_first_limit_stated_is_logged_as_no_cut(
        tmp_path: Path) -> None:
    """20 429s stating no limit cut the pace (to some 0.35 a second); the 22nd states 6 a
    minute, and the pace goes down to 0.1 at once: logged, but marked `resplit` as a share
    set without a cut is, so that `report` counts one cut (`pace_cuts`), not two."""
    shard, calls = _run_one(tmp_path, [PACE] * 22, others_answered=True, outage_s=1e6,
                            headers={"x-ratelimit-limit-requests": "6"}, stated_from=21)
    assert calls == 23 and shard.counters.ok == 1
    logged = _learned_lines(tmp_path)
    assert [(rec.get("seeded"), rec.get("resplit")) for rec in logged] == [
        (None, None), (None, True)]  # the cut, then the cap
    assert logged[0]["rps"] > 0.1 and logged[1]["rps"] == pytest.approx(0.1)


def test_a_cut_pace_lowered_by_a_successs_first_stated_limit_is_logged_as_no_cut(
        tmp_path: Path) -> None:
    """21 429s stating no limit cut the pace; the success after them is the first answer to
    state the limit (6 a minute): the pace goes down to 0.1 a second and is logged so, marked
    `resplit` as when a 429 states it first, not left unlogged until the next cut."""
    shard, calls = _run_one(tmp_path, [PACE] * 21, others_answered=True, outage_s=1e6,
                            ok_headers={"x-ratelimit-limit-requests": "6"})
    assert calls == 22 and shard.counters.ok == 1
    logged = _learned_lines(tmp_path)
    assert [(rec.get("seeded"), rec.get("resplit")) for rec in logged] == [
        (None, None), (None, True)]  # the cut, then the cap
    assert logged[0]["rps"] > 0.1 and logged[1]["rps"] == pytest.approx(0.1)
    assert shard.paced_rps == pytest.approx(0.1)


def test_held_retries_the_server_set_no_wait_for_are_spaced_by_their_holds(
        tmp_path: Path) -> None:
    """429s with no Retry-After and no reset header: each hold of the item waits at least half
    the backoff ceiling for its count of holds (0.25, 0.5, 1, 2, then 2.5 s at PROBE_MAX_S),
    never more than the ceiling. The first backoff alone (0 to 0.5 s, full jitter) sent the
    same items back within half a second however often refused, a burst of 429s per cut."""
    shard, calls = _run_one(tmp_path, [PACE] * 7)
    assert calls == 8 and shard.counters.ok == 1
    waits = [rec["wait"] for path in (tmp_path / "events").glob("*.jsonl")
             for rec in map(orjson.loads, path.read_bytes().splitlines())
             if rec["ev"] == "retry" and rec["why"] == "rate_limited"]
    ceilings = [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert len(waits) == len(ceilings)
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings, strict=True)), waits
