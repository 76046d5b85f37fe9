"""The simulator's enforced request limit (`rpm_limit`, shardrun.sim.limit): the bucket's
arithmetic on a made-up clock, and what a client sees of it over real loopback HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import test_utils

from shardrun.ratelimit import parse_duration
from shardrun.retry import over_whole_limit
from shardrun.sim import SimConfig, config_from_argv, server
from shardrun.sim.limit import RequestLimit
from shardrun.sim.server import build_app

QUICK: dict[str, Any] = {"ttft_ms": 1.0, "itl_ms": 0.0, "tokens": "4", "flush_ms": 1.0}
LIMIT = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
         "x-ratelimit-reset-requests")  # fmt: skip


def test_the_bucket_lets_in_a_burst_then_the_rate() -> None:
    """Asked every 10 ms for a minute, 120 a minute with a burst of 2 lets in the burst and
    then one request every half second: 2 + 119 of 6,000 (the 120th would be due at 60 s)."""
    limit = RequestLimit(120, 2, count_rejected=False)
    allowed = sum(limit.take(i / 100) == 0.0 for i in range(6000))
    assert allowed == 2 + 119
    assert limit.rejected == 6000 - allowed
    assert RequestLimit(600, 0, False).burst == 10  # the default burst: one second's worth
    idle = RequestLimit(120, 2, count_rejected=False)
    idle.take(0.0)
    # A bucket idle for 100 s holds its burst, not 100 s of refills.
    assert [idle.take(100.0) == 0.0 for _ in range(4)] == [True, True, False, False]


def test_a_rejected_request_asks_for_the_time_until_one_would_be_let_in() -> None:
    """Empty at t=0 with 1 request a second coming in: 0.25 s later one is 0.75 s away; a
    rejection that counts puts the bucket below empty, so the next waits a request longer."""
    plain, counting = RequestLimit(60, 1, False), RequestLimit(60, 1, True)
    for limit in (plain, counting):
        assert limit.take(0.0) == 0.0
    assert plain.take(0.25) == pytest.approx(0.75)
    assert plain.take(0.25) == pytest.approx(0.75)
    assert counting.take(0.25) == pytest.approx(1.75)
    assert counting.take(0.25) == pytest.approx(2.0)  # at most one burst below empty
    assert plain.take(1.0) == 0.0 and counting.take(1.0) > 0


@contextlib.asynccontextmanager
async def serving(cfg: SimConfig) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    server = test_utils.TestServer(build_app(cfg), host="127.0.0.1", port=0)
    async with server, aiohttp.ClientSession() as session:
        yield session, str(server.make_url(""))


async def _answers(cfg: SimConfig, n: int) -> tuple[list[tuple[int, dict[str, str], Any]],
                                                     dict[str, Any]]:  # fmt: skip
    """n chat requests one after another (half streamed): status, headers and error of each,
    and the simulator's stats."""
    out = []
    async with serving(cfg) as (s, root):
        for i in range(n):
            body = {"model": "m", "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"prompt {i}"}]}
            async with s.post(root + "/v1/chat/completions", json=body) as resp:
                error = (await resp.json())["error"] if resp.status != 200 else await resp.read()
                out.append((resp.status, dict(resp.headers), error))
        async with s.get(root + "/sim/stats") as resp:
            stats = await resp.json()
    return out, stats


def answers(cfg: SimConfig, n: int) -> tuple[list[tuple[int, dict[str, str], Any]],
                                             dict[str, Any]]:  # fmt: skip
    return asyncio.run(asyncio.wait_for(_answers(cfg, n), 30))


def test_over_the_limit_the_server_answers_429_with_openais_headers() -> None:
    """6 a minute with a burst of 3: of 5 requests sent at once (a refill takes 10 s) the
    first 3 are answered, counting the bucket down on their headers, and the last 2 get 429
    rate_limit_exceeded with a Retry-After of the whole seconds until one is let in."""
    got, stats = answers(SimConfig(**QUICK, rpm_limit=6, rpm_burst=3), 5)
    assert [status for status, _, _ in got] == [200, 200, 200, 429, 429]
    assert [h["x-ratelimit-remaining-requests"] for _, h, _ in got] == ["2", "1", "0", "0", "0"]
    for status, headers, error in got:
        assert headers["x-ratelimit-limit-requests"] == "6"
        reset = parse_duration(headers["x-ratelimit-reset-requests"])
        assert reset is not None and 0 < reset <= 30
        if status == 429:
            assert error["code"] == "rate_limit_exceeded"
            assert 1 <= int(headers["Retry-After"]) <= 10
        else:
            assert "Retry-After" not in headers
    assert stats["faults"]["rpm_limit"] == 2 and stats["completed"] == 3


@pytest.mark.parametrize("mode", ["retry_after", "none"])
def test_the_limits_headers_can_be_left_out(mode: str) -> None:
    """rpm_headers retry_after: a 429's Retry-After and nothing else, as many gateways send;
    none: not even that. The limit is enforced all the same."""
    got, _ = answers(SimConfig(**QUICK, rpm_limit=6, rpm_burst=1, rpm_headers=mode), 2)
    assert [status for status, _, _ in got] == [200, 429]
    assert all(name not in headers for _, headers, _ in got for name in LIMIT)
    assert ("Retry-After" in got[1][1]) == (mode == "retry_after")


def test_rejected_requests_may_count_against_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """rpm_count_rejected: a rejected request takes from the bucket too, so the next 429 asks
    for a longer wait (20 s where it asked 10 s)."""
    # The bucket on a clock that stands still: uncounted, the wait asked is 10 s less the time
    # since the first request, which a loaded machine's second would make 9.
    monkeypatch.setattr(server, "time", SimpleNamespace(monotonic=lambda: 100.0, time=time.time))
    waits = {}
    for counted in (False, True):
        cfg = SimConfig(**QUICK, rpm_limit=6, rpm_burst=1, rpm_count_rejected=counted)
        got, stats = answers(cfg, 3)
        assert [status for status, _, _ in got] == [200, 429, 429]
        waits[counted] = [int(headers["Retry-After"]) for _, headers, _ in got[1:]]
        assert stats["faults"]["rpm_limit"] == 2
    assert waits == {False: [10, 10], True: [20, 20]}


def test_a_limit_stated_apart_from_the_one_enforced() -> None:
    """rpm_stated 60 on 600 enforced with a burst of 4: the answers state 60, the remaining
    counts the bucket's fullness as a share of 60 (45 after one of 4 is taken, about 0 when empty),
    and the 5th request is refused by the 600 enforced; tpm_stated 600 on 6,000 tokens is the
    Limit of a token 429's words, while a request over 600 but under 6,000 is let in. Both
    travel as flags."""
    got, _ = answers(SimConfig(**QUICK, rpm_limit=600, rpm_burst=4, rpm_stated=60), 5)
    assert [status for status, _, _ in got] == [200, 200, 200, 200, 429]
    left = [int(h["x-ratelimit-remaining-requests"]) for _, h, _ in got]
    # 15 a request taken (60 / 4), and 1.5 back each 10 ms the bucket refills between them: on a
    # loaded machine the answers may come that far apart.
    assert all(0 <= a - b < 15 for a, b in zip(left[:3], [45, 30, 15], strict=True))
    assert max(left[3:]) < 15
    assert all(h["x-ratelimit-limit-requests"] == "60" for _, h, _ in got)
    cfg = SimConfig(**QUICK, tpm_limit=6000, tpm_burst=1000, tpm_stated=600)
    tokens = asyncio.run(asyncio.wait_for(_token_answers(cfg, [700, 700]), 30))
    assert [status for status, _, _ in tokens] == [200, 429]
    # "Used" is how far the bucket is below full, and it refills (100 tokens a second) between
    # the two requests: 710 less what a loaded machine's pause let back in. The Limit stated is
    # the point here.
    words = re.search(r"on tokens per min \(TPM\): Limit (\d+), Used (\d+), Requested (\d+)\.",
                      tokens[1][2]["message"])
    assert words and words.group(1, 3) == ("600", "710") and 0 < int(words.group(2)) <= 710
    assert tokens[0][1]["x-ratelimit-limit-tokens"] == "600"
    assert config_from_argv(cfg.to_args()) == cfg


def test_the_limit_travels_as_flags_and_job_keys() -> None:
    """The limit's settings from a job's `sim:` mapping, and through the launcher's flags."""
    cfg = SimConfig.from_mapping({"rpm_limit": "600", "rpm_burst": 20.0, "tpm_limit": 9000,
                                  "rpm_headers": "none", "rpm_count_rejected": "yes"})
    assert (cfg.rpm_limit, cfg.rpm_burst, cfg.rpm_headers, cfg.rpm_count_rejected) == (
        600, 20, "none", True)
    assert config_from_argv(cfg.to_args()) == cfg


def test_the_token_bucket_lets_a_request_bigger_than_itself_in_when_full() -> None:
    """6,000 tokens a minute (100 a second, a bucket of 100): charges of 60 are let in while
    the bucket holds them; one of 250 waits for a full bucket, then takes it below empty, so
    what follows waits for the rate to pay it off (the rate over time stays the limit)."""
    limit = RequestLimit(6000, 0, False, "tokens")
    assert limit.take(0.0, 60) == 0.0
    assert limit.take(0.0, 60) == pytest.approx(0.2)  # 40 left of the 60 asked
    assert limit.take(0.0, 250) == pytest.approx(0.6)  # until the bucket is full
    assert limit.take(0.6, 250) == 0.0 and limit.used() == 250
    assert limit.take(0.6, 10) == pytest.approx(1.6)


async def _token_answers(cfg: SimConfig, caps: list[int]) -> list[tuple[int, dict[str, str],
                                                                        Any]]:  # fmt: skip
    """Chat requests of a 10-token prompt and these max_tokens, one after another."""
    out = []
    async with serving(cfg) as (s, root):
        for cap in caps:
            body = {"model": "m", "max_tokens": cap,
                    "messages": [{"role": "user", "content": "x" * 40}]}
            async with s.post(root + "/v1/chat/completions", json=body) as resp:
                error = (await resp.json())["error"] if resp.status != 200 else None
                out.append((resp.status, dict(resp.headers), error))
    return out


def test_over_the_token_limit_the_server_answers_429_in_openais_words() -> None:
    """600 tokens a minute, a bucket of 100: one asking 1,000 is too large for the limit itself,
    even with the bucket full, which the client dead-letters at once (`over_whole_limit`); two
    requests of 10 + 40 tokens empty the bucket, the third is refused on tokens per min with
    the limit, what is used and what it asked, and OpenAI's x-ratelimit-*-tokens, which the
    client holds as a pace."""
    cfg = SimConfig(**QUICK, tpm_limit=600, tpm_burst=100)
    got = asyncio.run(asyncio.wait_for(_token_answers(cfg, [1000, 40, 40, 40]), 30))
    assert [status for status, _, _ in got] == [429, 200, 200, 429]
    # The bucket refills 10 tokens a second between the requests: a loaded machine's pauses
    # may let a few back in.
    left = [int(h["x-ratelimit-remaining-tokens"]) for _, h, _ in got]
    assert all(0 <= a - b <= 5 for a, b in zip(left, [100, 50, 0, 0], strict=True))
    assert all(h["x-ratelimit-limit-tokens"] == "600" for _, h, _ in got)
    too_large, refused = got[0][2]["message"], got[3][2]["message"]
    used = re.search(r"on tokens per min \(TPM\): Limit 600, Used (\d+), Requested 50\.", refused)
    assert used and 95 <= int(used.group(1)) <= 100
    assert "Limit 600, Requested 1010." in too_large
    assert not over_whole_limit(refused) and over_whole_limit(too_large)
    assert 1 <= int(got[3][1]["Retry-After"]) <= 10


@pytest.mark.parametrize(("words", "dead"), [
    ("on tokens per min (TPM): Limit 30000, Used 29000, Requested 45000. Please try again", True),
    ("on tokens per min (TPM): Limit 30000, Used 29000, Requested 1200. Please try again", False),
    ("on tokens per min (TPM): Limit 30000, Used 0, Requested 30000. Please try again", False),
])
def test_a_request_above_the_whole_limit_is_over_it_whatever_is_used(words: str,
                                                                     dead: bool) -> None:
    """A 429 in the "Limit N, Used U, Requested R" form whose R is above N can never pass,
    however long it waits: the item's dead letter (`over_whole_limit`), as "Request too large"
    is, not held until retry.outage_s; R within N is the server's pace, held."""
    assert over_whole_limit(words) is dead
