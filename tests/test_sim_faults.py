"""Simulator fault injection over real loopback HTTP: each fault as a raw client sees it, the
seeded draw (fractions, determinism, retries), fail_first_n, auth, and config validation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import AsyncIterator, Awaitable
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
from aiohttp import test_utils

from shardrun.sim import FAULT_KINDS, SimConfig, config_from_argv, main, server, start_sim
from shardrun.sim.faults import FaultInjector, decide, request_key
from shardrun.sim.server import SIM_KEY, build_app

T = TypeVar("T")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say something nice."}]}
QUICK: dict[str, Any] = {"ttft_ms": 1.0, "itl_ms": 0.0, "tokens": "4", "flush_ms": 1.0}


def run(coro: Awaitable[T]) -> T:
    """Run one test coroutine with a hard time bound."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, 30)

    return asyncio.run(bounded())


def chat(i: int | str, **extra: Any) -> dict[str, Any]:
    """A chat body whose content (and so whose fault key) depends on `i`."""
    return {**CHAT, "messages": [{"role": "user", "content": f"prompt {i}"}], **extra}


@contextlib.asynccontextmanager
async def serving(cfg: SimConfig) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """An in-process simulator on 127.0.0.1 and a session; yields (session, root URL)."""
    server = test_utils.TestServer(build_app(cfg), host="127.0.0.1", port=0)
    async with server, aiohttp.ClientSession() as session:
        yield session, str(server.make_url(""))


async def stats(session: aiohttp.ClientSession, root: str) -> dict[str, Any]:
    async with session.get(root + "/sim/stats") as resp:
        result: dict[str, Any] = await resp.json()
        return result


async def outcome(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """"200", "429", ... or "reset": what one request ended with, read to the end."""
    try:
        async with session.post(url, json=body) as resp:
            await resp.read()
            return str(resp.status)
    except aiohttp.ClientConnectionError:
        return "reset"


async def read_stream(resp: aiohttp.ClientResponse
                      ) -> tuple[list[tuple[float, bytes]], BaseException | None]:  # fmt: skip
    """Every read of a body with its arrival time, and the error that ended it, if any."""
    reads: list[tuple[float, bytes]] = []
    try:
        async for chunk in resp.content.iter_any():
            reads.append((time.monotonic(), chunk))
    except aiohttp.ClientError as e:
        return reads, e
    return reads, None


def content_count(data: bytes) -> int:
    return data.count(b'"delta":{"content":" ')


def test_fail_429_carries_retry_after_and_rate_limit_headers() -> None:
    """fail_429 answers 429 with Retry-After, x-ratelimit-* and an OpenAI-style error body."""
    cfg = SimConfig(**QUICK, fail_429=1.0, retry_after_s=2)

    async def go() -> None:
        async with serving(cfg) as (s, root):
            async with s.post(root + "/v1/chat/completions", json=chat(1, stream=True)) as resp:
                assert resp.status == 429
                assert resp.headers["Retry-After"] == "2"
                assert resp.headers["x-ratelimit-reset-requests"] == "2s"
                assert resp.headers["x-ratelimit-remaining-requests"] == "0"
                assert resp.headers["Content-Type"].startswith("application/json")
                err = (await resp.json())["error"]
            st = await stats(s, root)
        assert err["code"] == "rate_limit_exceeded" and err["message"] and "type" in err
        assert st["faults"]["fail_429"] == 1 and st["requests_total"] == 1
        assert st["completed"] == 0 and st["in_flight"] == 0

    run(go())


@pytest.mark.parametrize(
    ("kwargs", "status", "retry_after"),
    [
        ({"fail_500": 1.0}, 500, None),
        ({"fail_503": 1.0}, 503, None),
        ({"fail_503": 1.0, "retry_after_503": True, "retry_after_s": 0.25}, 503, "0.25"),
    ],
)
def test_fail_500_503_statuses_and_retry_after_only_when_asked(
    kwargs: dict[str, Any], status: int, retry_after: str | None
) -> None:
    """fail_500/fail_503 give their status with an error body; 503 has Retry-After only if asked."""

    async def go() -> None:
        async with serving(SimConfig(**QUICK, **kwargs)) as (s, root):
            async with s.post(root + "/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == status
                assert resp.headers.get("Retry-After") == retry_after
                err = (await resp.json())["error"]
            st = await stats(s, root)
        assert err["type"] == "server_error" and err["message"]
        assert st["faults"][f"fail_{status}"] == 1 and st["requests_total"] == 1

    run(go())


@pytest.mark.parametrize("stream", [True, False])
def test_reset_before_headers_is_a_connection_error(stream: bool) -> None:
    """reset_before_headers resets the TCP connection: the client gets no status, only an error."""
    cfg = SimConfig(**QUICK, reset_before_headers=1.0)

    async def go() -> None:
        async with serving(cfg) as (s, root):
            with pytest.raises(aiohttp.ClientConnectionError) as info:
                async with s.post(root + "/v1/chat/completions", json=chat(1, stream=stream)):
                    pass
            st = await stats(s, root)  # the server survives and keeps serving
        assert isinstance(info.value, aiohttp.ClientOSError | aiohttp.ServerDisconnectedError)
        assert st["faults"]["reset_before_headers"] == 1 and st["requests_total"] == 1
        assert st["completed"] == 0 and st["aborted"] == 0 and st["in_flight"] == 0

    run(go())


@pytest.mark.parametrize("keepalive", [True, False])
def test_keepalive_false_closes_every_connection_after_its_answer(keepalive: bool) -> None:
    """keepalive false: every answer says `Connection: close` and its connection is not pooled,
    so a second request comes on a new connection; the default keeps it alive for the next."""
    cfg = SimConfig(**QUICK, keepalive=keepalive)
    opened: list[object] = []

    async def count(*_: object) -> None:
        opened.append(None)

    async def go() -> None:
        tracing = aiohttp.TraceConfig()
        tracing.on_connection_create_end.append(count)
        async with (serving(cfg) as (_, root),
                    aiohttp.ClientSession(trace_configs=[tracing]) as s):
            for _ in range(3):
                async with s.post(root + "/v1/chat/completions", json=chat(1)) as resp:
                    said = resp.headers.get("Connection", "").lower()
                    assert resp.status == 200 and (said == "close") is not keepalive, said
                    await resp.read()

    run(go())
    assert len(opened) == (1 if keepalive else 3)


@pytest.mark.parametrize("stream", [True, False])
def test_reset_after_headers_sends_a_200_and_its_headers_then_resets(stream: bool) -> None:
    """reset_after_headers answers 200 with its headers (an event stream's, or a JSON answer's),
    then resets the connection before any byte of the body: a status, no answer."""
    cfg = SimConfig(**QUICK, reset_after_headers=1.0)

    async def go() -> None:
        async with serving(cfg) as (s, root):
            async with s.post(root + "/v1/chat/completions", json=chat(1, stream=stream)) as resp:
                assert resp.status == 200
                kind = resp.headers["Content-Type"]
                with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientOSError,
                                    aiohttp.ServerDisconnectedError)):
                    await resp.read()
            st = await stats(s, root)  # the server survives and keeps serving
        assert kind.startswith("text/event-stream" if stream else "application/json")
        assert st["faults"]["reset_after_headers"] == 1 and st["requests_total"] == 1
        assert st["completed"] == 0 and st["in_flight"] == 0

    run(go())


def test_drop_mid_stream_cuts_after_half_the_tokens_without_done() -> None:
    """drop_mid_stream sends headers and about half the tokens, then the body breaks: no [DONE]."""
    cfg = SimConfig(ttft_ms=1, itl_ms=1, tokens="20", flush_ms=1, drop_mid_stream=1.0)

    async def go() -> None:
        async with serving(cfg) as (s, root):
            async with s.post(root + "/v1/chat/completions", json=chat(1, stream=True)) as resp:
                assert resp.status == 200
                reads, error = await read_stream(resp)
            st = await stats(s, root)
        data = b"".join(c for _, c in reads)
        assert isinstance(error, aiohttp.ClientPayloadError)
        assert content_count(data) == 10 and b"[DONE]" not in data
        assert data.endswith(b"\n\n") and b'"finish_reason":"stop"' not in data
        assert st["faults"]["drop_mid_stream"] == 1 and st["completed"] == 0

    run(go())


def test_stall_mid_stream_pauses_halfway_then_completes() -> None:
    """stall_mid_stream: a gap >= stall_s/2, many times the normal ITL, after half the tokens."""
    stall_s = 0.4
    cfg = SimConfig(ttft_ms=1, itl_ms=15, tokens="12", flush_ms=1, stall_mid_stream=1.0,
                    stall_s=stall_s)  # fmt: skip

    async def go() -> list[tuple[float, bytes]]:
        async with serving(cfg) as (s, root):
            async with s.post(root + "/v1/chat/completions", json=chat(1, stream=True)) as resp:
                reads, error = await read_stream(resp)
            st = await stats(s, root)
        assert error is None
        assert st["faults"]["stall_mid_stream"] == 1 and st["completed"] == 1
        return reads

    reads = run(go())
    data = b"".join(c for _, c in reads)
    assert data.endswith(b"data: [DONE]\n\n") and content_count(data) == 12
    gaps = [(b[0] - a[0], content_count(b"".join(c for _, c in reads[: i + 1])))
            for i, (a, b) in enumerate(itertools.pairwise(reads))]  # fmt: skip
    stall, before = max(gaps)
    normal = statistics.median(g for g, _ in gaps if (g, _) != (stall, before))
    assert before == 6  # the stall comes after half of the 12 tokens
    assert stall >= 0.5 * stall_s
    assert stall >= 5 * normal


def test_stalled_stream_notices_client_leaving_and_counts_aborted() -> None:
    """A client that hangs up during a long stall frees the slot and is counted as aborted."""
    cfg = SimConfig(ttft_ms=1, itl_ms=1, tokens="8", flush_ms=1, capacity=1,
                    stall_mid_stream=1.0, stall_s=60)  # fmt: skip

    async def go() -> dict[str, Any]:
        async with serving(cfg) as (s, root):
            async with s.post(root + "/v1/chat/completions", json=chat(1, stream=True)) as resp:
                await resp.content.readuntil(b'"content":" ')
            for _ in range(100):  # bounded: the server notices within a poll
                st = await stats(s, root)
                if st["aborted"]:
                    break
                await asyncio.sleep(0.02)
            return st

    t0 = time.monotonic()
    st = run(go())
    assert time.monotonic() - t0 < cfg.stall_s / 4  # nobody sat out the stall
    assert st["aborted"] == 1 and st["in_flight"] == 0 and st["completed"] == 0


def test_stall_does_not_outlive_server_shutdown() -> None:
    """Server close mid-stall ends the stalled handler (counted aborted) well before stall_s."""
    cfg = SimConfig(ttft_ms=1, itl_ms=1, tokens="8", flush_ms=1, stall_mid_stream=1.0,
                    stall_s=60)  # fmt: skip

    async def go() -> tuple[float, dict[str, Any], BaseException | None]:
        app = build_app(cfg)
        server = test_utils.TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        async with aiohttp.ClientSession() as s:
            url = str(server.make_url("/v1/chat/completions"))
            async with s.post(url, json=chat(1, stream=True)) as resp:
                await resp.content.readuntil(b'"content":" ')
                t0 = time.monotonic()
                await server.close()
                closed_in = time.monotonic() - t0
                _, error = await read_stream(resp)
        return closed_in, app[SIM_KEY].stats, error

    closed_in, st, error = run(go())
    assert closed_in < cfg.stall_s / 4
    assert isinstance(error, aiohttp.ClientError)
    assert st["aborted"] == 1 and st["completed"] == 0 and st["in_flight"] == 0


def test_launched_sim_stops_on_sigterm_during_a_stall() -> None:
    """A real simulator process (uvloop) exits 0 on SIGTERM while a stream is stalled."""
    cfg = SimConfig(ttft_ms=1, itl_ms=1, tokens="8", flush_ms=1, stall_mid_stream=1.0,
                    stall_s=60)  # fmt: skip
    with start_sim(cfg) as sim:

        async def go() -> BaseException | None:
            async with aiohttp.ClientSession() as s:
                url = sim.base_url + "/chat/completions"
                async with s.post(url, json=chat(1, stream=True)) as resp:
                    await resp.content.readuntil(b'"content":" ')
                    await asyncio.to_thread(sim.stop, 10.0)  # SIGKILL after 10 s would be -9
                    _, error = await read_stream(resp)
                    return error

        error = run(go())
        assert sim.returncode == 0
    assert isinstance(error, aiohttp.ClientError)


def test_slow_first_token_adds_its_delay() -> None:
    """slow_first_token delays the first token by about slow_first_token_s, streamed or not."""
    base: dict[str, Any] = {"ttft_ms": 10.0, "itl_ms": 1.0, "tokens": "4", "flush_ms": 1.0}
    slow_s = 1.0  # far above any scheduling hiccup of a loaded machine (0.3 s was not)

    async def timing(cfg: SimConfig) -> tuple[float, float]:
        async with serving(cfg) as (s, root):
            url = root + "/v1/chat/completions"
            t0 = time.monotonic()
            async with s.post(url, json=chat(1, stream=True)) as resp:
                await resp.content.readuntil(b'"content":" ')
                first = time.monotonic() - t0
                await resp.read()
            t0 = time.monotonic()
            async with s.post(url, json=chat(2)) as resp:
                assert resp.status == 200 and (await resp.json())["choices"]
            return first, time.monotonic() - t0

    normal = run(timing(SimConfig(**base)))
    slow = run(timing(SimConfig(**base, slow_first_token=1.0, slow_first_token_s=slow_s)))
    for n, s in zip(normal, slow, strict=True):
        assert s - n >= 0.5 * slow_s and s >= 3 * n


@pytest.mark.parametrize("kind", ["drop_mid_stream", "stall_mid_stream"])
def test_non_streamed_requests_meet_stream_faults(kind: str) -> None:
    """Without stream: drop_mid_stream resets before any byte, stall_mid_stream answers late."""
    faults: dict[str, Any] = {kind: 1.0}
    cfg = SimConfig(**QUICK, **faults, stall_s=0.3)

    async def go() -> tuple[str, float, dict[str, Any]]:
        async with serving(cfg) as (s, root):
            t0 = time.monotonic()
            got = await outcome(s, root + "/v1/chat/completions", chat(1))
            return got, time.monotonic() - t0, await stats(s, root)

    got, took, st = run(go())
    assert st["faults"][kind] == 1
    if kind == "drop_mid_stream":
        assert got == "reset" and st["completed"] == 0
    else:
        assert got == "200" and took >= 0.5 * cfg.stall_s and st["completed"] == 1


def test_fail_503_fraction_is_within_binomial_tolerance() -> None:
    """fail_503=0.3 over 400 distinct requests: the 503 count is within 4.5 sigma of 120."""
    cfg = SimConfig(**QUICK, fail_503=0.3, seed=11)

    async def go() -> tuple[list[str], dict[str, Any]]:
        async with serving(cfg) as (s, root):
            url = root + "/v1/chat/completions"
            got = await asyncio.gather(*(outcome(s, url, chat(i)) for i in range(400)))
            return got, await stats(s, root)

    got, st = run(go())
    n, p = 400, 0.3
    assert abs(st["faults"]["fail_503"] - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))
    assert got.count("503") == st["faults"]["fail_503"]
    assert got.count("200") == st["completed"] == n - got.count("503")
    assert st["requests_total"] == n


MIXED = SimConfig(**QUICK, fail_429=0.15, fail_500=0.15, fail_503=0.1,
                  reset_before_headers=0.1, seed=5)  # fmt: skip


async def sequence(cfg: SimConfig, bodies: list[dict[str, Any]]) -> list[str]:
    """Outcomes of `bodies` sent one after another to a fresh server."""
    async with serving(cfg) as (s, root):
        return [await outcome(s, root + "/v1/chat/completions", b) for b in bodies]


def test_same_seed_and_requests_give_same_faults_on_fresh_servers() -> None:
    """Two fresh servers, same seed and requests (with repeats): the same fault sequence."""
    bodies = [chat(i % 13) for i in range(60)]
    a, b = run(sequence(MIXED, bodies)), run(sequence(MIXED, bodies))
    other = run(sequence(dataclasses.replace(MIXED, seed=6), bodies))
    assert a == b
    assert {"200", "429", "500", "503", "reset"} <= set(a)
    assert a != other


def test_fault_of_a_request_does_not_depend_on_other_prompts_order() -> None:
    """Distinct prompts sent in another order meet the same faults (per prompt)."""
    forward = [chat(i) for i in range(40)]
    a = run(sequence(MIXED, forward))
    b = run(sequence(MIXED, forward[::-1]))
    assert a == b[::-1]


def test_retried_identical_request_is_not_stuck_on_its_fault() -> None:
    """With fail_500=0.5, an identical request that failed succeeds within 10 tries."""
    cfg = SimConfig(**QUICK, fail_500=0.5, seed=2)

    async def go() -> list[list[str]]:
        async with serving(cfg) as (s, root):
            tries_of = []
            for i in range(8):
                tries: list[str] = []
                while len(tries) < 10 and "200" not in tries:
                    tries.append(await outcome(s, root + "/v1/chat/completions", chat(i)))
                tries_of.append(tries)
            return tries_of

    tries_of = run(go())
    assert all(t[-1] == "200" for t in tries_of)
    assert any(len(t) > 1 for t in tries_of)  # some request did fail before succeeding


def test_fail_first_n_gives_503_to_the_first_requests_only() -> None:
    """fail_first_n=3: the first three requests get 503 whatever they are, then service resumes."""
    cfg = SimConfig(**QUICK, fail_first_n=3, retry_after_503=True)

    async def go() -> tuple[list[str], dict[str, Any]]:
        async with serving(cfg) as (s, root):
            url = root + "/v1/chat/completions"
            got = [await outcome(s, url, chat(i)) for i in range(5)]
            async with s.post(url, json=chat(9)) as resp:
                assert resp.status == 200 and "Retry-After" not in resp.headers
            return got, await stats(s, root)

    got, st = run(go())
    assert got == ["503", "503", "503", "200", "200"]
    assert st["faults"]["fail_first_n"] == 3 and st["faults"]["fail_503"] == 0
    assert st["requests_total"] == 6 and st["completed"] == 3


@pytest.mark.parametrize("status", [503, 502])
def test_a_storm_fails_every_request_for_its_seconds_after_its_first_n(
        status: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """storm_after_n=2, storm_s=0.3: two requests are served, then every request gets the
    storm's status (a gateway's in plain text) until 0.3 s after the third arrived."""
    cfg = SimConfig(**QUICK, storm_after_n=2, storm_s=0.3, storm_status=status)
    # The storm's seconds on a clock of the test's: on the real one, a loaded machine's pause
    # among the requests "during" it let it end before the last of them.
    clock = [100.0]
    monkeypatch.setattr(server, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                        time=time.time))

    async def go() -> tuple[list[str], list[str], dict[str, Any]]:
        async with serving(cfg) as (s, root):
            url = root + "/v1/chat/completions"
            during = [await outcome(s, url, chat(i)) for i in range(4)]
            clock[0] += 0.29
            during.append(await outcome(s, url, chat(4)))
            async with s.post(url, json=chat(1)) as resp:
                kind = resp.content_type
            clock[0] += 0.06  # past 0.3 s after the third request: the storm is over
            after = [await outcome(s, url, chat(i)) for i in range(2)]
            return [*during, kind], after, await stats(s, root)

    during, after, st = run(go())
    assert during == ["200", "200", *[str(status)] * 3,
                      "application/json" if status == 503 else "text/plain"]
    assert after == ["200", "200"]
    assert st["faults"]["storm"] == 4 and st["completed"] == 4


def test_endpoint_failing_every_request() -> None:
    """fail_503=1.0: every request, retried or not, gets 503 (an endpoint failing 100%)."""

    async def go() -> list[str]:
        async with serving(SimConfig(**QUICK, fail_503=1.0)) as (s, root):
            return [await outcome(s, root + "/v1/chat/completions", chat(i % 3)) for i in range(12)]

    assert run(go()) == ["503"] * 12


def test_quota_after_serves_n_requests_then_answers_insufficient_quota() -> None:
    """quota_after: N requests are served, every later one gets 429 insufficient_quota (no
    Retry-After: waiting does not cure it), counted among the faults."""
    cfg = SimConfig(**QUICK, quota_after=2)

    async def go() -> tuple[list[tuple[int, bytes, str | None]], dict[str, Any]]:
        async with serving(cfg) as (s, root):
            got = []
            for i in range(4):
                async with s.post(root + "/v1/chat/completions", json=chat(i)) as resp:
                    got.append((resp.status, await resp.read(), resp.headers.get("Retry-After")))
            return got, await stats(s, root)

    got, st = run(go())
    assert [code for code, _, _ in got] == [200, 200, 429, 429]
    for _, body, wait in got[2:]:
        err = orjson.loads(body)["error"]
        assert (err["code"], err["type"], wait) == ("insufficient_quota", "insufficient_quota",
                                                    None)  # fmt: skip
    assert st["faults"]["quota_after"] == 2 and st["completed"] == 2


def test_auth_required_gives_401_without_the_right_bearer_key() -> None:
    """auth_required: a missing or wrong key is 401 invalid_api_key, never echoing the key."""
    secret = "sk-sim-test-123"
    cfg = SimConfig(**QUICK, auth_required=secret)

    async def go() -> tuple[list[tuple[int, bytes]], dict[str, Any]]:
        async with serving(cfg) as (s, root):
            url = root + "/v1/chat/completions"
            got = []
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": secret},
                            {"Authorization": f"Bearer {secret}"}):  # fmt: skip
                async with s.post(url, json=chat(1), headers=headers) as resp:
                    got.append((resp.status, await resp.read()))
            return got, await stats(s, root)

    got, st = run(go())
    assert [code for code, _ in got] == [401, 401, 401, 200]
    for _, body in got[:3]:
        err = orjson.loads(body)["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert secret.encode() not in body
    assert st["unauthorized"] == 3 and st["requests_total"] == 4 and st["completed"] == 1
    assert secret not in repr(cfg)


def test_stats_faults_shape_lists_every_kind() -> None:
    """/sim/stats has `faults` with a zero count for every kind, even with faults off."""

    async def go() -> dict[str, Any]:
        async with serving(SimConfig(**QUICK)) as (s, root):
            await outcome(s, root + "/v1/chat/completions", chat(1))
            return await stats(s, root)

    st = run(go())
    kinds = ("fail_first_n", "storm", "reset_when", "quota_after", *FAULT_KINDS, "rpm_limit",
             "tpm_limit")
    assert st["faults"] == dict.fromkeys(kinds, 0)
    assert st["unauthorized"] == 0 and st["completed"] == 1


def test_decide_is_pure_and_follows_cumulative_shares() -> None:
    """decide(): same (key, n) same answer; shares hold over many keys; draws differ by n."""
    cfg = SimConfig(fail_429=0.2, fail_500=0.3)
    assert cfg.fault_table == (("fail_429", 0.2), ("fail_500", 0.5))
    keys = [request_key(0, "/v1/completions", b"%d" % i) for i in range(4000)]
    first = [decide(cfg.fault_table, k, 0) for k in keys]
    assert first == [decide(cfg.fault_table, k, 0) for k in keys]
    assert abs(first.count("fail_429") / 4000 - 0.2) < 0.03
    assert abs(first.count("fail_500") / 4000 - 0.3) < 0.03
    assert first != [decide(cfg.fault_table, k, 1) for k in keys]
    assert decide((), keys[0], 0) is None
    assert request_key(0, "/p", b"x") != request_key(1, "/p", b"x")
    inj = FaultInjector(SimConfig(fail_503=1.0))
    assert [inj.draw("/p", b"x") for _ in range(3)] == ["fail_503"] * 3
    assert inj.seen == {request_key(0, "/p", b"x"): 3} and inj.counts["fail_503"] == 3


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"fail_500": 0.6, "fail_503": 0.6}, ["fail_500", "fail_503", "sum"]),
        ({"fail_429": 0.5, "drop_mid_stream": 0.3, "slow_first_token": 0.3},
         ["fail_429", "drop_mid_stream", "slow_first_token"]),
        ({"fail_429": -0.1}, ["fail_429"]),
        ({"reset_before_headers": 1.5}, ["reset_before_headers"]),
        ({"reset_after_headers": 1.5}, ["reset_after_headers"]),
        ({"stall_mid_stream": float("nan")}, ["stall_mid_stream"]),
        ({"fail_503": "0.3"}, ["fail_503"]),
        ({"stall_s": -1}, ["stall_s"]),
        ({"slow_first_token_s": float("inf")}, ["slow_first_token_s"]),
        ({"retry_after_s": -2}, ["retry_after_s"]),
        ({"fail_first_n": -1}, ["fail_first_n"]),
        ({"retry_after_503": "yes"}, ["retry_after_503"]),
        ({"ignore_stream": 1}, ["ignore_stream"]),
        ({"auth_required": ""}, ["auth_required"]),
        ({"auth_required": "two words"}, ["auth_required"]),
        ({"rpm_limit": -1}, ["rpm_limit"]),
        ({"rpm_headers": "azure"}, ["rpm_headers"]),
        ({"rpm_count_rejected": "no"}, ["rpm_count_rejected"]),
    ],
)  # fmt: skip
def test_fault_config_rejects_bad_values_naming_them(kwargs: dict[str, Any],
                                                     names: list[str]) -> None:  # fmt: skip
    """Bad fault settings raise one ValueError sentence naming each offending field, with no
    full stop at its end, as shardrun's other `error:` lines."""
    with pytest.raises(ValueError) as info:
        SimConfig(**kwargs)
    message = str(info.value)
    assert all(name in message for name in names) and not message.endswith(".")
    assert "two words" not in message  # an auth key is never echoed


def test_fault_config_from_mapping_and_args_round_trip() -> None:
    """from_mapping coerces env-style strings; to_args -> flags -> SimConfig round-trips all."""
    cfg = SimConfig.from_mapping({"fail_503": "0.25", "fail_429": 0, "retry_after_503": "true",
                                  "fail_first_n": "2", "stall_s": 1, "auth_required": "k-1"})
    assert cfg == SimConfig(fail_503=0.25, retry_after_503=True, fail_first_n=2, stall_s=1.0,
                            auth_required="k-1")  # fmt: skip
    with pytest.raises(ValueError, match="fail_5003"):
        SimConfig.from_mapping({"fail_5003": 0.1})
    full = SimConfig(ttft_ms=3, itl_ms=0.5, tokens="uniform:2:9", capacity=4, seed=9, flush_ms=2,
                     fail_429=0.1, fail_500=0.05, fail_503=0.05, reset_before_headers=0.1,
                     drop_mid_stream=0.1, stall_mid_stream=0.1, slow_first_token=0.1,
                     retry_after_s=0.5, retry_after_503=True, stall_s=2, slow_first_token_s=3,
                     fail_first_n=7, auth_required="sk-x", reject_stream_options=True,
                     ignore_stream=True, storm_s=1.5, storm_after_n=9,
                     storm_status=504, reset_when="Question 7:", keepalive=False,
                     rpm_limit=90, rpm_burst=4, rpm_headers="retry_after",
                     rpm_count_rejected=True)  # fmt: skip
    for c in (full, SimConfig(), SimConfig(ignore_stream=True)):
        args = c.to_args()
        assert len(args) % 2 == 0 and config_from_argv(args) == c
    assert config_from_argv(["--retry-after-503"]).retry_after_503 is True


@pytest.mark.parametrize("argv", [["--fail-503", "2"], ["--fail-500", "0.7", "--fail-503", "0.7"],
                                  ["--retry-after-503", "maybe"], ["--fail-first-n", "x"],
                                  ["--storm-status", "404"]])
def test_main_bad_fault_flag_returns_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """main() with a bad fault flag prints one `error:` line and returns 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1

