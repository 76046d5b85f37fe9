"""Tests for the job-wide rate limit: token buckets, the shard limiter, server headers.

All on a fake clock whose `sleep` advances it: plain arithmetic, no wall time.
"""

from __future__ import annotations

import asyncio
import bisect
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun import ratelimit
from shardrun.items import TOKEN_LIMITS, build_request
from shardrun.ratelimit import (
    DEFAULT_COMPLETION_TOKENS,
    DEFAULT_PAUSE_S,
    MAX_PAUSE_S,
    RECHECK_S,
    Pacer,
    RateLimiter,
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


def take_wait(pacer: Pacer, now: float, amount: float) -> float:
    """Reserve and say how long the reservation waits, as asked right away."""
    return pacer.wait(now, pacer.take(now, amount))


def test_pacer_queues_reservations_behind_the_debt() -> None:
    """Rate 2/s: the first goes at once, then each waits 0.5 s more than the last."""
    pacer = Pacer(2.0)
    assert [take_wait(pacer, 10.0, 1) for _ in range(5)] == [0.0, 0.5, 1.0, 1.5, 2.0]
    # 1 s later 2 of the 5 owed are paid; a new request waits for the other 3.
    assert take_wait(pacer, 11.0, 1) == pytest.approx(1.5)


def test_pacer_pays_down_to_zero_and_refunds_never_go_below() -> None:
    """An idle pacer owes nothing (no credit builds up); a refund stops at zero debt."""
    pacer = Pacer(1.0)
    pacer.take(0.0, 3)
    assert take_wait(pacer, 100.0, 3) == 0.0 and pacer.debt == 3.0
    pacer.charge(100.0, -10)
    assert pacer.debt == 0.0
    pacer.charge(100.0, 2)
    assert take_wait(pacer, 100.0, 1) == 2.0
    with pytest.raises(ValueError, match="positive"):
        Pacer(0.0)


def test_a_new_rate_or_a_refund_moves_the_reservations_already_waiting() -> None:
    """Places in line are kept, not waits: at 1/s the third of three waits 2 s; after 0.5 s
    the rate doubles, and it goes at 1.25 s; a refund of 1 unit then lets the next go 0.5 s
    sooner than it would have."""
    pacer = Pacer(1.0)
    places = [pacer.take(0.0, 1) for _ in range(3)]
    assert pacer.wait(0.0, places[2]) == 2.0
    pacer.retune(0.5, 2.0)
    assert pacer.wait(0.5, places[2]) == pytest.approx(0.75)
    fourth = pacer.take(0.5, 1)
    assert pacer.wait(0.5, fourth) == pytest.approx(1.25)
    pacer.charge(0.5, -1)
    assert pacer.wait(0.5, fourth) == pytest.approx(0.75)


@settings(max_examples=80, deadline=None)
@given(
    rate=st.floats(0.5, 500.0),
    calls=st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 400.0)), min_size=1,
                   max_size=200),
)
def test_pacer_grants_are_paid_for_and_never_late(
    rate: float, calls: list[tuple[float, float]]
) -> None:
    """Callers arriving at any times with any amounts: each goes out exactly when the one
    before it has been paid for at the rate, or on arrival if that was earlier. So whatever
    goes out between two grants was paid for, and nobody waits longer than that."""
    pacer, now = Pacer(rate), 0.0
    grants: list[tuple[float, float]] = []  # (grant time, amount)
    for gap, amount in calls:
        now += gap
        grants.append((now + take_wait(pacer, now, amount), amount))
        if len(grants) == 1:
            assert grants[0][0] == now  # the first goes at once, whatever its size
        else:
            (before, owed), (granted, _) = grants[-2], grants[-1]
            assert granted == pytest.approx(max(now, before + owed / rate), abs=1e-9)
    for i, (start, _) in enumerate(grants):
        for j in range(i + 1, len(grants)):
            paid = sum(amount for _, amount in grants[i:j])
            assert grants[j][0] >= start + paid / rate - 1e-6


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
def test_no_window_of_one_second_exceeds_rate_plus_one(rate: float, gaps: list[float]) -> None:
    """For any arrival pattern, grants in any closed 1 s window <= rate + 1."""
    grants = grant_times(rate, gaps)
    assert grants == sorted(grants)
    for i, start in enumerate(grants):
        in_window = bisect.bisect_right(grants, start + 1.0 + 1e-9) - i
        assert in_window <= rate + 1 + 1e-6


@settings(max_examples=20, deadline=None)
@given(rate=st.floats(1.0, 40.0))
def test_long_run_average_is_the_rate(rate: float) -> None:
    """Under steady overload for 200 s the average grant rate is within 2% of the rate."""
    duration = 200.0
    gaps = [1 / (2 * rate)] * int(duration * 2 * rate)
    grants = grant_times(rate, gaps)
    granted = bisect.bisect_right(grants, duration)
    assert granted / duration == pytest.approx(rate, rel=0.02)


def test_acquire_charges_both_pacers() -> None:
    """rpm 600 (10/s) and tpm 6000 (100/s): the tokens pacer binds.

    The first 100 tokens go at once; the next request waits 1 s for them (the requests pacer
    only 0.1 s), and one after it 0.5 s for the 50 that request took.
    """
    rl, t = limiter(600, 6000)
    assert asyncio.run(rl.acquire(100)) == 0.0
    assert asyncio.run(rl.acquire(50)) == pytest.approx(1.0)
    assert asyncio.run(rl.acquire(0)) == pytest.approx(0.5)
    assert t.now == pytest.approx(1.5) and (rl.pending, rl.pending_tokens) == (0, 0)


def test_unlimited_never_waits() -> None:
    """No rpm and no tpm: every acquire returns at once."""
    rl, t = limiter(None, None)
    for _ in range(1000):
        assert asyncio.run(rl.acquire(10**6)) == 0.0
    assert t.slept == []


def test_correct_refunds_or_charges_the_difference() -> None:
    """A request that used fewer tokens than reserved gives them back; more is owed.

    100 tokens/s. 100 reserved, 40 used: the debt is 40, exactly what charging 40 would have
    left, so the next waits 0.4 s.
    """
    rl, _ = limiter(None, 6000)
    assert asyncio.run(rl.acquire(100)) == 0.0
    rl.correct(100, 40)
    assert asyncio.run(rl.acquire(60)) == pytest.approx(0.4)
    rl.correct(60, 110)  # 50 more than reserved: 110 owed, the next request waits 1.1 s
    assert asyncio.run(rl.acquire(0)) == pytest.approx(1.1)


def test_set_share_rebalances_and_keeps_debt() -> None:
    """A bigger share speeds up what comes next; the debt already run up stays."""
    rl, t = limiter(60, None)  # 1/s
    assert [asyncio.run(rl.acquire(0)) for _ in range(3)] == [0.0, 1.0, 1.0]
    rl.set_share(240, None)  # 4/s: the request still owed is paid in 0.25 s
    assert asyncio.run(rl.acquire(0)) == pytest.approx(0.25)
    rl.set_share(None, None)
    assert asyncio.run(rl.acquire(0)) == 0.0 and t.now == pytest.approx(2.25)
    assert shares(600, None, 3) == (200.0, None) and shares(600, 90, 0) == (600.0, 90.0)


def test_shards_start_staggered_one_job_wide_interval_apart() -> None:
    """Job-wide rpm 120 and tpm 6000 over 8 shards, each asking for one 100-token request at
    once: shard k's goes out k job-wide intervals in (k x 1 s, which the tokens bind), not all
    eight at t = 0. Only the first request is staggered."""
    rpm, tpm = shares(120, 6000, 8)
    firsts = []
    for k in range(8):
        t = FakeTime()
        rl = RateLimiter(rpm, tpm, clock=t.clock, sleep=t.sleep, phase=k / 8)
        firsts.append(asyncio.run(rl.acquire(100)))
        if k == 3:  # its second request waits for the first's 100 tokens at 12.5/s
            assert asyncio.run(rl.acquire(100)) == pytest.approx(8.0)
    assert firsts == pytest.approx([float(k) for k in range(8)])
    # Requests alone bind at rpm 120: 0.5 s apart.
    t = FakeTime()
    rl = RateLimiter(15, None, clock=t.clock, sleep=t.sleep, phase=3 / 8)
    assert asyncio.run(rl.acquire(100)) == pytest.approx(1.5)


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


def test_a_reset_header_that_is_a_moment_pauses_until_it() -> None:
    """A reset header that is a Unix time (seconds or milliseconds) 20 s from now pauses 20 s,
    not the longest pause its reading as decades of seconds gave."""
    rl, _ = limiter(None, None)
    for reset in (f"{time.time() + 20:.0f}", f"{(time.time() + 20) * 1000:.0f}"):
        headers = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": reset}
        assert rl.observe_headers(headers, 0.0) == pytest.approx(20, abs=2)


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
    # 1 s for the pacer, asked again every RECHECK_S: the pause came at the first check and
    # holds it 5 s from then.
    assert asyncio.run(rl.acquire(0)) == pytest.approx(RECHECK_S + 5.0)


def test_a_bigger_share_during_a_wait_shortens_it_and_a_stop_ends_it() -> None:
    """rpm 6 (one per 10 s): the second request waits; 1 s in, the share becomes rpm 60 (the
    coordinator's rebalance when other shards finish), and it goes at 1.9 s, once the rest of
    what the first owed (0.9) is paid at the new rate, not at 10 s. A third waits for a stop
    that comes 0.5 s in, at its second check, and goes no further."""
    t = FakeTime()
    stop = False
    rl = RateLimiter(6, None, clock=t.clock, stopped=lambda: stop)

    async def sleep(seconds: float) -> None:
        nonlocal stop
        t.now += seconds
        if t.now == pytest.approx(1.0):
            rl.set_share(60, None)
        if t.now > 2.3:
            stop = True

    rl._sleep = sleep
    assert asyncio.run(rl.acquire(0)) == 0.0
    assert asyncio.run(rl.acquire(0)) == pytest.approx(1.9)  # 0.1 paid by 1 s, 0.9 at 1/s
    assert asyncio.run(rl.acquire(0)) == pytest.approx(0.5) and t.now == pytest.approx(2.4)

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


def test_a_reset_header_too_long_for_a_duration_is_not_scanned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile reset header, 8 KB of digits with no unit: the duration scan takes time
    quadratic in it (0.9 s of the shard's event loop per response that carried it). A value
    longer than any duration is no duration, and is not scanned; one as long is read."""
    scanned: list[str] = []
    pattern = ratelimit._DURATION

    class Scan:
        def findall(self, text: str) -> list[tuple[str, str]]:
            scanned.append(text)
            return pattern.findall(text)

    monkeypatch.setattr(ratelimit, "_DURATION", Scan())
    assert parse_duration("1" * 8000 + "x") is None and scanned == []
    longest = "1s" * (ratelimit.DURATION_MAX // 2)
    assert parse_duration(longest) == ratelimit.DURATION_MAX // 2 and scanned == [longest]


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


def test_a_window_of_429s_cuts_the_learned_pace_and_successes_grow_it() -> None:
    """A window is judged once it holds 20 requests (and, once a pace is learned, has lasted
    1 s): a 429 among 40 successes cuts nothing; 7 of the 20 requests sent next cut the pace
    to 0.7 x 20/s (a window shorter than a second read as one), and every request is paced
    by it. A second window cuts again from the learned pace (the shard sent faster than it,
    its first requests going at the old pace); each success adds LEARN_GROW."""
    lim, t = limiter(None, None)
    t.now = 2.0
    assert not lim.limited(sent=10)  # too few requests to judge
    assert not lim.limited(sent=40) and lim.learned is None  # 2 of 40: a new window
    assert not any(lim.limited(sent) for sent in range(41, 47))  # 6 of 6: too few requests
    t.now = 2.1
    assert lim.limited(sent=60)  # 7 of 20
    assert lim.learned == pytest.approx(ratelimit.LEARN_CUT * 20)
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(14.0)
    assert [lim.wait(t.now, lim.reserve(t.now, 1)) for _ in range(3)] == pytest.approx(
        [0.0, 1 / 14, 2 / 14])
    t.now = 2.5
    assert not lim.limited(sent=100)  # 40 requests, but in less than a second
    t.now = 3.2
    assert not lim.limited(sent=101) and lim.learned == pytest.approx(14.0)  # 2 of 41
    for sent in range(102, 116):  # 14 429s as the window fills
        assert not lim.limited(sent)
    t.now = 4.3
    assert lim.limited(sent=141) and lim.learned == pytest.approx(14 * 0.7)  # 15 of 40
    lim.grew()
    assert lim.learned == pytest.approx(14 * 0.7 + ratelimit.LEARN_GROW)


def test_a_server_refusing_a_fifth_of_the_requests_at_random_teaches_no_pace() -> None:
    """Every fifth request of 1,000 sent 10 a second is a 429, whatever the pace: no window
    holds more than LEARN_SHARE of them, and the shard is never slowed."""
    lim, t = limiter(None, None)
    for sent in range(5, 1001, 5):
        t.now = sent / 10
        assert not lim.limited(sent)
    assert lim.learned is None and lim.requests is None


def test_a_cut_is_of_what_was_sent_if_less_and_never_below_a_request_a_minute() -> None:
    """Paced at 14/s but sending 5/s (the cap held it back), a window of 10 s, a third of it
    429s, cuts to 0.7 x 5/s, not 0.7 x 14/s; and a pace never drops below one a minute."""
    lim, t = limiter(None, None)
    for sent in range(1, 21):
        lim.limited(sent)
    assert lim.learned == pytest.approx(14.0)
    t.now = 5.0
    for sent in range(21, 37):  # 16 429s as the window fills
        lim.limited(sent)
    t.now = 10.0
    assert lim.limited(sent=70) and lim.learned == pytest.approx(3.5)  # 17 of 50 in 10 s
    t.now = 5000.0
    for sent in range(71, 91):
        lim.limited(sent)
    assert lim.learned == ratelimit.LEARN_MIN_PER_S


def test_the_learned_pace_and_the_jobs_share_pace_together_the_slower_wins() -> None:
    """Under a job share of 600 rpm (10/s), a learned 14/s leaves it at 10/s, a learned 9.8/s
    takes over, and a new share keeps the learned pace where it is the slower."""
    lim, t = limiter(600, None)
    for sent in range(1, 21):
        lim.limited(sent)
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(10.0)
    t.now = 1.5
    for sent in range(21, 41):  # measured over 1.5 s: 13.3/s, less than 14/s
        lim.limited(sent)
    assert lim.requests.rate_per_s == pytest.approx(0.7 * 20 / 1.5)
    lim.set_share(1200, None)
    assert lim.requests.rate_per_s == pytest.approx(0.7 * 20 / 1.5)
    lim.set_share(300, None)
    assert lim.requests.rate_per_s == pytest.approx(5.0)


def test_a_429_that_states_the_limit_seeds_the_pace_at_this_shards_share() -> None:
    """OpenAI's x-ratelimit-limit-requests on the first 429 (6,000 a minute, 4 shards on one
    key) paces the shard at 25/s at once, where a window of 429s was needed; the windows
    after it still cut it (the seed is a start, not a bound) and successes still grow it."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    t.now = 1.0
    assert lim.limited(sent=3, headers={"x-ratelimit-limit-requests": "6000"})
    assert lim.learned == pytest.approx(25.0)
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(25.0)
    assert not lim.limited(sent=4, headers={"x-ratelimit-limit-requests": "60"})  # once only
    assert lim.learned == pytest.approx(25.0)
    t.now = 3.0
    for sent in range(5, 23):  # 19 of 20 requests refused: the stated limit was too high
        lim.limited(sent)
    assert lim.limited(sent=23) and lim.learned == pytest.approx(ratelimit.LEARN_CUT * 10.0)
    lim.grew()
    assert lim.learned == pytest.approx(ratelimit.LEARN_CUT * 10.0 + ratelimit.LEARN_GROW)


@pytest.mark.parametrize("stated", ["0", "-5", "abc", "", "nan", "inf", "1e400"])
def test_a_stated_limit_that_is_no_positive_number_is_ignored(stated: str) -> None:
    """A gateway's nonsense seeds nothing: the 429 counts towards a window as before."""
    lim, _ = limiter(None, None)
    assert not lim.limited(sent=1, headers={"x-ratelimit-limit-requests": stated})
    assert lim.learned is None and lim.requests is None


TPM_429 = ("Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): "
           "Limit 60000, Used 59000, Requested 1200. Please try again in 1.2s.")


def test_a_429_on_tokens_paces_tokens_so_a_big_prompt_waits_its_turn() -> None:
    """OpenAI's words for a token limit (60,000 a minute, 4 shards: 250 tokens a second for
    this one) teach a token pace, not a request pace: small requests are not slowed as a
    count, and a big one goes as soon as the tokens before it are paid for, its place kept
    ahead of the small ones that come after it (a pace of requests let small ones take the
    server's tokens first, and the big one was refused over and over)."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert lim.limited(sent=1, error=TPM_429, tokens=1200)
    assert lim.learned is None and lim.requests is None and lim.learning
    assert lim.learned_tokens == pytest.approx(250.0)
    assert lim.tokens is not None and lim.tokens.rate_per_s == pytest.approx(250.0)
    waits = [lim.wait(t.now, lim.reserve(t.now, n)) for n in (100, 1000, 50, 50)]
    assert waits == pytest.approx([0.0, 0.4, 4.4, 4.6])
    lim.grew(1000)  # a success: at its share of the stated limit already, no faster
    assert lim.learned_tokens == pytest.approx(250.0)


def test_the_token_limit_is_read_from_the_headers_where_the_words_say_nothing() -> None:
    """A 429 with no such words, whose x-ratelimit-remaining-tokens is below the request's
    charge while requests remain: a token 429, its limit from x-ratelimit-limit-tokens."""
    lim, _ = limiter(None, None)
    headers = {"x-ratelimit-remaining-tokens": "300", "x-ratelimit-limit-tokens": "30000",
               "x-ratelimit-remaining-requests": "5", "x-ratelimit-limit-requests": "600"}
    assert lim.limited(sent=1, headers=headers, error="HTTP 429: slow down", tokens=500)
    assert lim.learned_tokens == pytest.approx(500.0) and lim.learned is None
    requests_out = {**headers, "x-ratelimit-remaining-requests": "0"}
    other, _ = limiter(None, None)
    assert other.limited(sent=1, headers=requests_out, tokens=500)  # the requests ran out
    assert other.learned == pytest.approx(10.0) and other.learned_tokens is None
    rpm_words = "Rate limit reached on requests per min (RPM): Limit 600, Used 600, Requested 1."
    third, _ = limiter(None, None)
    assert third.limited(sent=1, headers=headers, error=rpm_words, tokens=500)  # words first
    assert third.learned == pytest.approx(10.0) and third.learned_tokens is None


def test_a_token_429_that_states_no_limit_teaches_a_request_pace_as_before() -> None:
    """Without a limit to start from, a token 429 counts towards a window of requests, and a
    cut slows the requests (which send fewer tokens too)."""
    lim, _ = limiter(None, None)
    words = "Rate limit reached on tokens per min. Please try again in 1s."
    assert not any(lim.limited(sent, error=words, tokens=100) for sent in range(1, 20))
    assert lim.limited(sent=20, error=words, tokens=100)
    assert lim.learned == pytest.approx(ratelimit.LEARN_CUT * 20) and lim.learned_tokens is None


def test_a_window_of_token_429s_cuts_the_token_pace_to_what_was_sent() -> None:
    """Seeded at 250 tokens a second, then a window of 20 requests of 10 tokens over 2 s, all
    refused: the shard sent 100 tokens a second, less than its pace, so the pace is cut to
    0.7 x 100 a second (not 0.7 x 250); the request pace stays unlearned."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    lim.limited(sent=0, error=TPM_429, tokens=10)
    for _ in range(20):
        lim.reserve(t.now, 10)
    t.now = 2.0
    assert not any(lim.limited(sent, error=TPM_429, tokens=10) for sent in range(1, 20))
    assert lim.limited(sent=20, error=TPM_429, tokens=10)
    assert lim.learned_tokens == pytest.approx(ratelimit.LEARN_CUT * 100.0)
    assert lim.learned is None


def test_a_learned_token_pace_keeps_the_unused_max_tokens_charged() -> None:
    """The server's token limit counts prompt + max_tokens as the request comes (OpenAI's
    does), so once its pace is learned an answer that used less refunds nothing (it sent a
    third more than the limit), while a request it refused (0 counted) is refunded whole. Under
    the job's own tpm, before any is learned, the answer's usage settles the charge as before."""
    t = FakeTime()
    own = RateLimiter(None, 60_000, clock=t.clock, sleep=t.sleep)
    own.reserve(t.now, 1064)
    own.correct(1064, 1020)
    assert own.tokens is not None and own.tokens.debt == pytest.approx(1020)
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep)
    lim.limited(sent=1, error=TPM_429, tokens=1064)
    for _ in range(2):
        lim.reserve(t.now, 1064)
    lim.correct(1064, 1020)
    assert lim.tokens is not None and lim.tokens.debt == pytest.approx(2128)
    lim.correct(1064, 0)
    assert lim.tokens.debt == pytest.approx(1064)


def test_token_429s_are_judged_by_their_share_of_the_tokens_not_of_the_requests() -> None:
    """Over a token limit the big requests are the ones refused: 3 of a window's 20 requests
    (15 %, never a cut as a share of requests) but 3,000 of its 3,170 tokens, which cuts."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep)
    lim.limited(sent=0, error=TPM_429, tokens=1000)
    seeded = lim.learned_tokens
    for n in [10] * 17 + [1000] * 3:
        lim.reserve(t.now, n)
    t.now = 1.0
    assert not lim.limited(sent=18, error=TPM_429, tokens=1000)
    assert not lim.limited(sent=19, error=TPM_429, tokens=1000)
    assert lim.limited(sent=20, error=TPM_429, tokens=1000)
    assert seeded is not None and lim.learned_tokens == pytest.approx(ratelimit.LEARN_CUT * seeded)


def test_a_request_with_no_cap_of_its_own_is_refunded_the_guess_under_a_token_pace() -> None:
    """Under a learned token pace (100 tokens a second) a request that states no max_tokens is
    charged its prompt + DEFAULT_COMPLETION_TOKENS, which the server never counts (it counts
    the answer): its answer settles the charge, so ten answers of 30 tokens leave 300 owed, 3
    s of pace, not the 2,660 of their guesses (26.6 s). One that states its cap keeps it."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep)
    lim.limited(sent=1, error="Rate limit reached on tokens per min (TPM): Limit 6000, Used 1",
                tokens=10)
    item = {"prompt": "x" * 40}
    charged = ratelimit.estimate_request_tokens(item, {})
    assert ratelimit.stated_cap(item, {}) is None
    assert charged == 10 + ratelimit.DEFAULT_COMPLETION_TOKENS
    for _ in range(10):
        lim.reserve(t.now, charged)
        lim.correct(charged, 30, capped=False)
    assert lim.tokens is not None and lim.tokens.debt == pytest.approx(300)
    assert lim.wait(t.now, lim.reserve(t.now, charged)) == pytest.approx(3.0)
    capped = ratelimit.estimate_request_tokens(item, {"max_completion_tokens": 256})
    assert capped == charged and ratelimit.stated_cap(item, {"max_tokens": 256}) == 256
    before = lim.tokens.debt
    lim.correct(capped, 30, capped=True)
    assert lim.tokens.debt == pytest.approx(before)
    assert ratelimit.stated_cap({"prompt": "x", "body": {"max_output_tokens": 9}}, {}) == 9


def test_a_seeded_pace_is_re_split_over_the_shards_left_and_a_cut_one_is_not() -> None:
    """Seeded at a quarter of the stated 600 requests a minute (2.5 a second over 4 shards):
    when two shards end, the coordinator's new share says 2 are left, and the pace becomes
    half the limit (5 a second), the requests pacer with it; the job's own share (None) is
    no limit. One cut since the seed stays as cut (its cap rises: successes grow it to the new
    share). A token pace seeded from a stated TPM is re-split the same way."""
    t = FakeTime()
    stated = {"x-ratelimit-limit-requests": "600"}
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert lim.limited(sent=1, headers=stated) and lim.learned == pytest.approx(2.5)
    assert lim.set_share(None, None, live=2)
    assert lim.learned == pytest.approx(5.0)
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(5.0)
    assert not lim.set_share(None, None, live=2)  # no change of shards: nothing to re-split
    cut = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    cut.limited(sent=1, headers=stated)
    t.now = 2.0
    assert any([cut.limited(sent, headers=stated) for sent in range(2, 22)])
    was = cut.learned
    assert was is not None and was < 2.5
    assert not cut.set_share(None, None, live=1) and cut.learned == was
    for _ in range(300):
        cut.grew()
    assert cut.learned == pytest.approx(10.0)  # the whole stated 600 a minute, no more
    tokens = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=2)
    tokens.limited(sent=1, error="on tokens per min (TPM): Limit 6000, Used 1", tokens=10)
    assert tokens.learned_tokens == pytest.approx(50.0)
    assert tokens.set_share(None, None, live=1) and tokens.learned_tokens == pytest.approx(100)
    assert tokens.learned is None


def test_a_seeded_pace_is_lowered_again_when_a_replacement_shard_joins() -> None:
    """Two of four shards left, the survivors' seeded pace is half the stated 600 a minute (5 a
    second); a replacement for a dead one joins (3 live) and seeds at a third of it on its first
    429: the survivors go down to a third too, or the three would send 1.67 times the limit.
    The lower share stands even for a pace grown past it, and for a cut one above it (each
    pace's cap is the share); a cut pace below it is left as it is."""
    t = FakeTime()
    stated = {"x-ratelimit-limit-requests": "600"}
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    lim.limited(sent=1, headers=stated)
    assert lim.set_share(None, None, live=2) and lim.learned == pytest.approx(5.0)
    lim.learned = 5.5  # grown a little since
    assert lim.set_share(None, None, live=3) and lim.learned == pytest.approx(10 / 3)
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(10 / 3)
    assert lim.seeded
    low = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=2)
    low.limited(sent=1, headers=stated)
    low.learned = 1.0  # below a third's share (as a cut would leave it, but still seeded)
    assert not low.set_share(None, None, live=3) and low.learned == 1.0
    cut = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=2)
    cut.limited(sent=1, headers=stated)
    t.now += 2.0
    assert any([cut.limited(sent, headers=stated) for sent in range(2, 22)])
    assert not cut.seeded
    cut.learned = 4.0  # grown back since its cut, under half the limit (5), above a third
    assert cut.set_share(None, None, live=3) and cut.learned == pytest.approx(10 / 3)



def test_a_seeded_pace_is_never_lowered_below_a_request_a_minute() -> None:
    """A stated limit of 3 requests a minute over 4 shards seeds each at the floor, a request a
    minute (LEARN_MIN_PER_S), as a seed never goes below it; a fifth shard joining leaves it
    there rather than at 0.6 a minute; shards ending still raise it above the floor."""
    t, floor = FakeTime(), pytest.approx(ratelimit.LEARN_MIN_PER_S)
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert lim.limited(sent=1, headers={"x-ratelimit-limit-requests": "3"})
    assert lim.learned == floor
    assert not lim.set_share(None, None, live=5) and lim.learned == floor
    assert lim.set_share(None, None, live=2) and lim.learned == pytest.approx(1.5 / 60)
    assert lim.set_share(None, None, live=5) and lim.learned == floor


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
@pytest.mark.parametrize(("item", "params"), [
    ({"prompt": "x"}, {"max_tokens": 32}),
    ({"prompt": "x"}, {"max_completion_tokens": 32}),
    ({"prompt": "x"}, {"max_output_tokens": 32}),
    ({"prompt": "x"}, {}),
    ({"body": {"prompt": "x", "max_tokens": 9}}, {"max_tokens": 32}),
    ({"body": {"prompt": "x", "max_completion_tokens": 9}}, {"max_tokens": 32}),
    ({"body": {"prompt": "x", "max_tokens": None}}, {"max_tokens": 32}),
    ({"body": {"prompt": "x", "max_output_tokens": None}}, {"max_completion_tokens": 32}),
    ({"body": {"prompt": "x"}}, {"max_tokens": 32}),
])
def test_the_cap_a_request_states_is_the_one_its_body_sends(
        api: str, item: dict[str, object], params: dict[str, object]) -> None:
    """`stated_cap`, which decides whether an answer under a token pace refunds the unused
    cap, reads the cap the request goes with (`build_request`): a Batch body that names a
    cap, even as null, takes none from the job's params, so one saying `"max_tokens": null`
    states none and its guessed cap is settled by its answer, not kept as if counted."""
    _, body = build_request(item, model="m", params=params, api=api)  # type: ignore[arg-type]
    sent = [v for k in TOKEN_LIMITS if isinstance(v := body.get(k), int)]
    assert ratelimit.stated_cap(item, params) == (sent[0] if sent else None)


def test_a_token_pace_seeded_beside_a_cut_request_pace_is_not_told_as_seeded() -> None:
    """A shard whose 429s (no stated limit) cut its pace of requests, then met a token limit
    stating its TPM: the pace of tokens is seeded, but the `rate_learned` line carries the cut
    requests pace beside it, so it is not `seeded` ("none cut"). A token pace seeded alone is,
    and a re-split of it over fewer shards keeps it so."""
    t = FakeTime()
    tpm = "Rate limit reached on tokens per min (TPM): Limit 6000, Used 1"
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep)
    assert any([lim.limited(sent) for sent in range(1, 22)])
    assert lim.learned is not None and not lim.seeded
    assert lim.limited(sent=22, error=tpm, tokens=10)
    assert lim.learned_tokens == pytest.approx(100) and not lim.seeded
    alone = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=2)
    assert alone.limited(sent=1, error=tpm, tokens=10) and alone.seeded
    assert alone.set_share(None, None, live=1) and alone.seeded


def test_a_pace_never_grows_past_its_share_of_the_stated_limit() -> None:
    """Seeded at a quarter of the stated 6,000 requests a minute (25 a second), cut by a window
    of 429s, the pace grows back with the successes to that share and stops there: past it the
    server only refuses what it said it would (grown on, the shards together paid a cut's burst
    of 429s). A token pace stops at its share of the stated tokens the same way, and a pace cut
    before any limit was stated stops at the share of the first one stated after."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    stated = {"x-ratelimit-limit-requests": "6000"}
    assert lim.limited(sent=1, headers=stated)
    t.now = 2.0
    assert any([lim.limited(sent, headers=stated) for sent in range(2, 23)])
    assert lim.learned is not None and lim.learned < 25.0
    for _ in range(1000):
        lim.grew()
    assert lim.learned == pytest.approx(25.0)
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(25.0)
    tokens = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=2)
    assert tokens.limited(sent=1, error=TPM_429, tokens=1000)  # 60,000 a minute: 500 a second
    for _ in range(100):
        tokens.grew(1000)
    assert tokens.learned_tokens == pytest.approx(500.0)
    unstated = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert any([unstated.limited(sent) for sent in range(1, 22)])  # cut to 0.7 x 21/s
    unstated.limited(sent=22, headers={"x-ratelimit-limit-requests": "600"})
    for _ in range(10):
        unstated.grew()
    assert unstated.learned == pytest.approx(2.5)


def test_a_higher_stated_limit_or_fewer_shards_raise_the_cap() -> None:
    """Capped at a quarter of the stated 600 a minute (2.5 a second), a later 429 stating 1,200
    raises the cap to 5 and the successes grow the pace to it; one stating 300 lowers nothing
    (the pace over a lowered limit meets 429s, which cut it). A success's own headers stating
    2,400 raise it to 10; two shards ending (the coordinator's share says 2 live) to 20, which
    the pace, cut since its seed, grows to; a shard joining (3 live) lowers it, and the pace."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert lim.limited(sent=1, headers={"x-ratelimit-limit-requests": "600"})

    def grown() -> float:
        for _ in range(1000):
            lim.grew()
        assert lim.learned is not None
        return lim.learned

    assert grown() == pytest.approx(2.5)
    assert not lim.limited(sent=2, headers={"x-ratelimit-limit-requests": "1200"})
    assert grown() == pytest.approx(5.0)
    lim.limited(sent=3, headers={"x-ratelimit-limit-requests": "300"})
    assert grown() == pytest.approx(5.0)
    lim.grew(headers={"x-ratelimit-limit-requests": "2400"})
    assert grown() == pytest.approx(10.0)
    t.now = 5.0
    assert any([lim.limited(sent) for sent in range(4, 30)]) and not lim.seeded
    assert lim.learned < 10.0
    assert not lim.set_share(None, None, live=2)  # a cut pace is not raised: it grows
    assert grown() == pytest.approx(20.0)
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(20.0)
    assert lim.set_share(None, None, live=3) and lim.learned == pytest.approx(40 / 3)
    assert grown() == pytest.approx(40 / 3)


def test_the_first_limit_stated_for_a_pace_cut_without_one_caps_it_at_once() -> None:
    """Cut by a window of 429s that stated no limit (0.7 x 21 a second), the pace is far above a
    quarter of the 600 a minute a later 429 states: it goes down to that share (2.5 a second) at
    once, its pacer with it, and the 429 says so (the shard logs the pace), rather than at the
    next success, the requests between sent at the old pace and a cut from it logged above
    the cap (a token pace is only ever learned from a stated limit, so capped from its seed)."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert any([lim.limited(sent) for sent in range(1, 22)])
    assert lim.learned is not None and lim.learned > 2.5
    assert lim.limited(sent=22, headers={"x-ratelimit-limit-requests": "600"})
    assert lim.learned == pytest.approx(2.5) and not lim.seeded
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(2.5)
    assert not lim.limited(sent=23, headers={"x-ratelimit-limit-requests": "600"})


def test_a_pace_lowered_to_the_first_limit_stated_starts_a_window_of_its_own() -> None:
    """The 429 that states the limit (600 a minute over 4 shards) for a pace cut without one
    lowers it to its share and, as a cut does, starts a new window: it closes a window of 429s
    of the old pace, which no longer cuts the new one too (`capped`, for the shard to log no
    cut), nor do more 429s of the old pace before 20 requests went at the new one."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert any([lim.limited(sent) for sent in range(1, 22)]) and not lim.capped
    t.now += 2.0
    assert not any([lim.limited(sent) for sent in range(21, 40)])
    assert lim.limited(sent=40, headers={"x-ratelimit-limit-requests": "600"})
    assert lim.capped and lim.learned == pytest.approx(2.5)
    t.now += 2.0
    assert not any([lim.limited(sent=59) for _ in range(10)]) and not lim.capped
    assert lim.learned == pytest.approx(2.5)
    assert lim.limited(sent=60) and lim.learned < 2.5  # a window sent at the new pace
    capped = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert any([capped.limited(sent) for sent in range(1, 22)])
    assert capped.limited(sent=22, headers={"x-ratelimit-limit-requests": "600"})
    assert capped.capped and capped.learned == pytest.approx(2.5)


def _successes(lim: RateLimiter, t: FakeTime, n: int, left: int, limit: int = 600,
               kind: str = "requests", tokens: int = 0, gap: float = 0.1) -> None:  # fmt: skip
    """`n` successes `gap` s apart whose headers state `limit` a minute with `left` remaining."""
    for _ in range(n):
        t.now += gap
        lim.grew(tokens, {f"x-ratelimit-limit-{kind}": str(limit),
                          f"x-ratelimit-remaining-{kind}": str(left)})  # fmt: skip


def test_a_window_of_room_at_the_stated_cap_lifts_it_and_growth_goes_on() -> None:
    """Capped at a quarter of the stated 600 a minute (2.5 a second), successes saying the key
    has 300 left (half, not more) never lift the cap however long; a window of 20 over a second
    saying 301 does, once (logged as lifted), and the pace grows past the statement. A 429 or a
    low count in the window starts it again: 19 with room, then either, then one, is no lift;
    so does a window too short: 50 in half a second."""
    t = FakeTime()
    quick = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert quick.limited(sent=1, headers={"x-ratelimit-limit-requests": "600"})
    _successes(quick, t, 50, left=600, gap=0.01)
    assert quick.learned == pytest.approx(2.5) and quick.take_uncapped() == []
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert lim.limited(sent=1, headers={"x-ratelimit-limit-requests": "600"})
    _successes(lim, t, 1000, left=300)
    assert lim.learned == pytest.approx(2.5) and lim.take_uncapped() == []
    _successes(lim, t, 19, left=301)
    lim.limited(sent=2)
    _successes(lim, t, 1, left=301)
    _successes(lim, t, 18, left=301)
    _successes(lim, t, 1, left=10)
    _successes(lim, t, 19, left=301)
    assert lim.learned == pytest.approx(2.5) and lim.take_uncapped() == []
    _successes(lim, t, 1, left=301)
    assert lim.take_uncapped() == [("requests", 600.0, True)] and lim.learned > 2.5
    _successes(lim, t, 100, left=301)
    assert lim.learned == pytest.approx(2.5 + 101 * ratelimit.LEARN_GROW)
    assert lim.requests is not None and lim.requests.rate_per_s == pytest.approx(lim.learned)
    assert lim.take_uncapped() == [] and not lim.seeded


def test_room_seen_below_the_cap_lifts_nothing() -> None:
    """A pace cut below its cap (a quarter of 600 a minute) sees the key refill while it grows
    back: successes saying it has room there (all of it) are no window at the cap, however many;
    only 20 over a second once the pace is at the cap lift it (an honest minute bucket refills
    under a pace below the limit, which says nothing of the statement)."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert lim.limited(sent=1, headers={"x-ratelimit-limit-requests": "600"})
    lim.learned = 1.02  # as a cut leaves it
    _successes(lim, t, 30, left=600)  # judged at 1.02 + 29 x 0.05, under 2.5; grown to it
    assert lim.learned == pytest.approx(2.5) and lim.take_uncapped() == []
    _successes(lim, t, 19, left=600)  # at the cap: a window of 19
    assert lim.learned == pytest.approx(2.5) and lim.take_uncapped() == []
    _successes(lim, t, 1, left=600)
    assert lim.take_uncapped() == [("requests", 600.0, True)]


def test_a_lifted_cap_stays_lifted_through_shards_and_returns_when_the_key_runs_low() -> None:
    """Lifted and grown to 7.5 a second, the pace is not re-split down to the stated limit's
    share as a shard joins (the statement does not bind the key); a success saying under a
    quarter of the stated limit is left (149 of 600) puts the cap back and the pace on it; a
    token pace's cap is lifted by the token headers the same way. A higher limit stated caps
    anew, a cap re-split as shards join."""
    t = FakeTime()
    lim = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=4)
    assert lim.limited(sent=1, headers={"x-ratelimit-limit-requests": "600"})
    _successes(lim, t, 119, left=400)  # lifted at the 20th, which grows it too
    assert lim.learned == pytest.approx(2.5 + 100 * ratelimit.LEARN_GROW)
    assert not lim.set_share(None, None, live=5) and lim.learned == pytest.approx(7.5)
    _successes(lim, t, 1, left=150)
    assert lim.learned > 7.5
    _successes(lim, t, 1, left=149)
    assert lim.learned == pytest.approx(2.0)  # a fifth of 600 a minute: five shards now
    assert lim.take_uncapped() == [("requests", 600.0, True), ("requests", 600.0, False)]
    _successes(lim, t, 120, left=400)
    lim.grew(headers={"x-ratelimit-limit-requests": "1200"})
    assert lim.learned == pytest.approx(4.0)  # capped anew at a fifth of 1,200 a minute
    assert lim.set_share(None, None, live=10) and lim.learned == pytest.approx(2.0)  # re-split
    tokens = RateLimiter(None, None, clock=t.clock, sleep=t.sleep, shards=2)
    assert tokens.limited(sent=1, error=TPM_429, tokens=1000)  # 60,000 a minute: 500 a second
    _successes(tokens, t, 30, left=40000, limit=60000, kind="tokens", tokens=1000)
    assert tokens.learned_tokens is not None and tokens.learned_tokens > 500.0
    assert tokens.take_uncapped() == [("tokens", 60000.0, True)]
