"""The simulator over real loopback HTTP: shapes, determinism, capacity, stats, errors, launcher."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
from aiohttp import test_utils
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.errors import RunError
from shardrun.sim import (
    SimConfig,
    TokenSpec,
    config_from_argv,
    main,
    parse_tokens,
    start_sim,
)
from shardrun.sim.config import TEXT_WORDS, WORDS, BadRequest, make_plan
from shardrun.sim.render import Frames
from shardrun.sim.server import Sim, build_app

T = TypeVar("T")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say something nice."}]}
FAST = SimConfig(ttft_ms=5, itl_ms=1, tokens="uniform:8:24", flush_ms=5)


def run(coro: Awaitable[T]) -> T:
    """Run one test coroutine with a hard time bound."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, 30)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def serving(cfg: SimConfig) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """An in-process simulator on 127.0.0.1 and a session; yields (session, root URL)."""
    server = test_utils.TestServer(build_app(cfg), host="127.0.0.1", port=0)
    async with server, aiohttp.ClientSession() as session:
        yield session, str(server.make_url(""))


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                 ) -> tuple[list[Any], float]:  # fmt: skip
    """POST a streaming request; returns (decoded SSE data payloads, seconds to first content)."""
    t0, first, events = time.monotonic(), 0.0, []
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = b""
        async for chunk in resp.content.iter_any():
            if not first and (b'"content":" ' in chunk or b'"text":" ' in chunk):
                first = time.monotonic() - t0
            raw += chunk
    assert raw.endswith(b"\n\n")
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: ")
        data = block[len(b"data: "):]
        events.append(data.decode() if data == b"[DONE]" else orjson.loads(data))
    return events, first


def text_of(events: list[Any], field: str = "delta") -> str:
    """Concatenated content of chat (delta) or completions (text) chunks."""
    parts = []
    for e in events:
        if isinstance(e, dict) and e["choices"]:
            c = e["choices"][0]
            parts.append((c["delta"].get("content") or "") if field == "delta" else c["text"])
    return "".join(parts)


async def stats(session: aiohttp.ClientSession, root: str) -> dict[str, Any]:
    async with session.get(root + "/sim/stats") as resp:
        result: dict[str, Any] = await resp.json()
        return result


def test_chat_stream_has_role_content_finish_usage_done() -> None:
    """A streamed chat answer is role chunk, content chunks, finish chunk, usage chunk, [DONE]."""

    async def go() -> None:
        async with serving(FAST) as (s, root):
            body = {**CHAT, "stream_options": {"include_usage": True}}
            events, _ = await stream(s, root + "/v1/chat/completions", body)
        assert events[-1] == "[DONE]"
        role, *content, finish, usage, _ = events
        assert role["object"] == "chat.completion.chunk"
        assert role["choices"][0]["delta"]["role"] == "assistant"
        assert content and all(c["choices"][0]["delta"]["content"].startswith(" ") for c in content)
        assert all(c["choices"][0]["finish_reason"] is None for c in content)
        assert finish["choices"][0]["finish_reason"] == "stop"
        assert usage["choices"] == []
        u = usage["usage"]
        assert u["completion_tokens"] == len(content) and 8 <= len(content) <= 24
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] > len(content)
        assert len({e["id"] for e in events[:-1]}) == 1

    run(go())


def test_completions_endpoint_streams_and_answers_whole() -> None:
    """/v1/completions streams text_completion chunks and answers non-streamed with usage."""

    async def go() -> None:
        async with serving(FAST) as (s, root):
            body = {"model": "m", "prompt": "Once upon a time"}
            events, _ = await stream(s, root + "/v1/completions", body)
            async with s.post(root + "/v1/completions", json=body) as resp:
                whole = await resp.json()
        assert events[-1] == "[DONE]" and "usage" not in events[-2]  # no include_usage
        assert {e["object"] for e in events[:-1]} == {"text_completion"}
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert whole["object"] == "text_completion"
        assert whole["choices"][0]["text"] == text_of(events, "text")
        assert whole["usage"]["completion_tokens"] == len(events) - 2

    run(go())


def test_chat_non_stream_returns_completion_after_delay() -> None:
    """A non-streamed chat request gets one chat.completion with usage after TTFT + ITLs."""
    cfg = SimConfig(ttft_ms=50, itl_ms=2, tokens="20")

    async def go() -> None:
        async with serving(cfg) as (s, root):
            t0 = time.monotonic()
            async with s.post(root + "/v1/chat/completions", json=CHAT) as resp:
                body = await resp.json()
            elapsed = time.monotonic() - t0
        assert body["object"] == "chat.completion"
        msg = body["choices"][0]["message"]
        assert msg["role"] == "assistant" and len(msg["content"].split()) == 20
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == 20
        assert elapsed >= 0.05 + 19 * 0.002

    run(go())


def test_max_tokens_caps_length_with_finish_length() -> None:
    """max_tokens and max_completion_tokens cap the output and give finish_reason "length"."""

    async def go() -> None:
        async with serving(SimConfig(ttft_ms=1, itl_ms=0, tokens="50")) as (s, root):
            url = root + "/v1/chat/completions"
            capped, _ = await stream(s, url, {**CHAT, "max_tokens": 7})
            capped2, _ = await stream(s, url, {**CHAT, "max_completion_tokens": 3})
            free, _ = await stream(s, url, CHAT)
        assert len(capped) == 1 + 7 + 2 and capped[-2]["choices"][0]["finish_reason"] == "length"
        assert len(capped2) == 1 + 3 + 2
        assert capped2[-2]["choices"][0]["finish_reason"] == "length"
        assert len(free) == 1 + 50 + 2 and free[-2]["choices"][0]["finish_reason"] == "stop"
        assert text_of(free).startswith(text_of(capped))  # capping cuts, it does not resample

    run(go())


def test_output_depends_on_seed_and_prompt_not_order() -> None:
    """Same seed and prompt give the same text whatever the order; another seed differs."""
    prompts = [{**CHAT, "messages": [{"role": "user", "content": f"prompt {i}"}]} for i in range(4)]

    async def texts(seed: int, order: list[int]) -> dict[int, str]:
        async with serving(SimConfig(ttft_ms=1, itl_ms=0, seed=seed)) as (s, root):
            out = {}
            for i in order:
                events, _ = await stream(s, root + "/v1/chat/completions", prompts[i])
                out[i] = text_of(events)
            return out

    a = run(texts(1, [0, 1, 2, 3]))
    b = run(texts(1, [3, 1, 0, 2]))
    c = run(texts(2, [0, 1, 2, 3]))
    assert a == b
    assert len(set(a.values())) == 4
    assert all(a[i] != c[i] for i in range(4))


def test_capacity_queues_in_fifo_and_lengthens_ttft() -> None:
    """capacity=2 with 6 concurrent streams: never more than 2 served, later ones start later."""
    cfg = SimConfig(ttft_ms=100, itl_ms=0, tokens="4", capacity=2)

    async def go() -> None:
        async with serving(cfg) as (s, root):
            url = root + "/v1/chat/completions"
            results = await asyncio.gather(*(stream(s, url, CHAT) for _ in range(6)))
            st = await stats(s, root)
        ttfts = sorted(first for _, first in results)
        assert st["max_in_flight"] == 2 and st["in_flight"] == 0
        assert st["max_queued"] >= 3 and st["queued"] == 0
        # Lower bounds, which hold on any machine (a sleep never ends early): the second pair
        # waited for the first pair's 100 ms, the third for both pairs'. Served at once, all
        # six would be at about 100 ms.
        assert ttfts[3] >= 0.19 and ttfts[-1] >= 0.29

    run(go())


def test_stats_models_and_health() -> None:
    """/sim/stats counts requests per path and tokens; /v1/models and /health answer."""

    async def go() -> None:
        async with serving(FAST) as (s, root):
            e1, _ = await stream(s, root + "/v1/chat/completions", CHAT)
            e2, _ = await stream(s, root + "/v1/completions", {"prompt": "x"})
            async with s.post(root + "/v1/completions", json={"prompt": 3}) as resp:
                assert resp.status == 400
            async with s.get(root + "/v1/models") as resp:
                models = await resp.json()
            async with s.get(root + "/health") as resp:
                assert resp.status == 200
            st = await stats(s, root)
        assert models["data"][0]["object"] == "model"
        assert st["requests_total"] == 3 and st["completed"] == 2 and st["bad_requests"] == 1
        assert st["by_path"] == {"/v1/chat/completions": 1, "/v1/completions": 2}
        assert st["completion_tokens_total"] == (len(e1) - 3) + (len(e2) - 2)
        assert st["in_flight"] == 0 and st["max_in_flight"] == 1

    run(go())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (orjson.dumps({"model": "m"}), "messages"),
        (orjson.dumps({"messages": []}), "messages"),
        (orjson.dumps({"messages": [{"content": "hi"}]}), "messages"),
        (orjson.dumps({**CHAT, "max_tokens": 0}), "max_tokens"),
        (orjson.dumps({**CHAT, "stream": "yes"}), "stream"),
    ],
)
def test_bad_body_gives_400_openai_error(body: bytes, param: str | None) -> None:
    """A malformed body is a 400 with an OpenAI-style error object naming the parameter."""

    async def go() -> None:
        async with serving(FAST) as (s, root), s.post(root + "/v1/chat/completions",
                                                      data=body) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and err["code"]
        assert err["param"] == param

    run(go())


def test_disconnect_frees_capacity() -> None:
    """A client that hangs up mid-stream frees its capacity slot for the next request."""
    cfg = SimConfig(ttft_ms=5, itl_ms=20, tokens="500", capacity=1, flush_ms=20)

    async def go() -> None:
        async with serving(cfg) as (s, root):
            url = root + "/v1/chat/completions"
            async with s.post(url, json={**CHAT, "stream": True}) as resp:
                await resp.content.readuntil(b'"content":" ')
            events, _ = await stream(s, url, {**CHAT, "max_tokens": 2})
            for _ in range(50):  # the server notices the hang-up asynchronously
                st = await stats(s, root)
                if st["aborted"]:
                    break
                await asyncio.sleep(0.02)
        assert events[-1] == "[DONE]"
        assert st["aborted"] == 1 and st["in_flight"] == 0 and st["completed"] == 1

    run(go())


class Recorder:
    """Stands in for a StreamResponse: records when each write happens."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, bytes]] = []

    async def write(self, data: bytes) -> None:
        self.writes.append((asyncio.get_running_loop().time(), data))

    async def write_eof(self, data: bytes) -> None:
        self.writes.append((asyncio.get_running_loop().time(), data + b"<eof>"))


@pytest.mark.parametrize("opener", [b"", b"O;"])
def test_reasoning_frames_are_the_same_however_the_writes_split_the_words(opener: bytes) -> None:
    """Reasoning words first, then the opener (a tool call's start) once, then the content:
    the same bytes whether the words go out in one write or in any run of writes."""
    frames = Frames(b"R;", b"<", b">", b"T;", WORDS, 3, b"(", b")", opener, WORDS)
    words = bytes(range(7))
    whole = frames.tokens(words)
    w = [x.strip() for x in WORDS[:7]]
    assert whole.replace(b" ", b"") == (b"".join(b"(%b)" % x for x in w[:3]) + opener
                                        + b"".join(b"<%b>" % x for x in w[3:]))  # fmt: skip
    for cuts in itertools.combinations(range(1, 7), 2):
        bounds = [0, *cuts, 7]
        parts = [frames.tokens(words[a:b], a) for a, b in itertools.pairwise(bounds)]
        assert b"".join(parts) == whole, cuts
    # All reasoning (a cap cut the answer short): no content event, no opener.
    thought = Frames(b"R;", b"<", b">", b"T;", WORDS, 9, b"(", b")", opener, WORDS).tokens(words)
    assert thought.count(b"(") == 7 and b"<" not in thought and b"O;" not in thought


def test_emit_coalesces_due_tokens_into_few_writes() -> None:
    """Tokens go out in one write per wake, writes >= flush_ms apart, itl_ms=0 means one write."""

    async def emit(cfg: SimConfig, n: int) -> list[tuple[float, bytes]]:
        rec, frames = Recorder(), Frames(b"R;", b"<", b">", b"T;", WORDS)
        words = bytes(i % 256 for i in range(n))
        await Sim(cfg).emit(rec, frames, words)  # type: ignore[arg-type]
        assert b"".join(d for _, d in rec.writes) == b"R;" + frames.tokens(words) + b"T;<eof>"
        assert frames.tokens(words).count(b"<") == n
        return rec.writes

    assert len(run(emit(SimConfig(itl_ms=0), 300))) == 1
    writes = run(emit(SimConfig(itl_ms=5, flush_ms=40), 60))  # ~300 ms of tokens
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(writes)]
    assert 3 <= len(writes) <= 10
    assert min(gaps) >= 0.039


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=200), cap=st.none() | st.integers(1, 120), seed=st.integers(0, 9))
def test_plan_is_pure_and_respects_cap(text: str, cap: int | None, seed: int) -> None:
    """make_plan: same body and seed give the same plan; length <= cap; "length" iff capped."""
    cfg = SimConfig(seed=seed, tokens="lognormal:40:0.8")
    raw = orjson.dumps({"prompt": text, "max_tokens": cap})
    plan = make_plan(raw, "completions", cfg)
    assert plan == make_plan(raw, "completions", cfg)
    n = len(plan.words)
    assert n >= 1 and (cap is None or n <= cap)
    uncapped = len(make_plan(orjson.dumps({"prompt": text}), "completions", cfg).words)
    assert (plan.finish == "length") == (cap is not None and uncapped >= cap)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ttft_ms": -1}, "ttft_ms"),
        ({"itl_ms": float("nan")}, "itl_ms"),
        ({"flush_ms": "5"}, "flush_ms"),
        ({"capacity": -2}, "capacity"),
        ({"seed": 1.5}, "seed"),
        ({"tokens": "0"}, "tokens"),
        ({"tokens": "uniform:9:3"}, "tokens"),
        ({"tokens": "lognormal:0:1"}, "tokens"),
        ({"tokens": "gauss:3:4"}, "tokens"),
        ({"tokens": "uniform:a:4"}, "tokens"),
    ],
)
def test_simconfig_rejects_bad_values_naming_field(kwargs: dict[str, Any], field: str) -> None:
    """SimConfig raises ValueError whose one-sentence message names the bad field, with no full
    stop at its end, as shardrun's other `error:` lines."""
    with pytest.raises(ValueError, match=field) as info:
        SimConfig(**kwargs)
    assert not str(info.value).endswith(".")


def test_simconfig_mapping_and_args() -> None:
    """from_mapping coerces numbers and rejects unknown keys; to_args round-trips every field."""
    cfg = SimConfig.from_mapping({"ttft_ms": 5, "capacity": "3", "tokens": "lognormal:40:0.5",
                                  "text": "prose", "cached_tokens": 5})  # fmt: skip
    assert cfg == SimConfig(ttft_ms=5.0, capacity=3, tokens="lognormal:40:0.5", text="prose",
                            cached_tokens=5)  # fmt: skip
    with pytest.raises(ValueError, match="ttft"):
        SimConfig.from_mapping({"ttft": 5})
    args = cfg.to_args()
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--capacity"] == "3" and flags["--tokens"] == "lognormal:40:0.5"
    assert config_from_argv(args) == cfg
    assert parse_tokens(" 64 ") == TokenSpec("fixed", 64)


BAD_ARGV = [["--ttft-ms", "-5"], ["--port", "70000"], ["--tokens", "many"], ["--bogus"],
            ["--capacity", "x"]]  # fmt: skip


@pytest.mark.parametrize("argv", BAD_ARGV)
def test_main_bad_flag_returns_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """main() with a bad flag prints one `error:` line on stderr and returns 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_port_in_use_is_a_usage_error_naming_it() -> None:
    """`shardrun sim --port P` with P taken: one `error:` line naming the port and what to do,
    exit 2 as for any flag the command cannot use (it was 1, with asyncio's bind text)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "shardrun", "sim", "--port", str(port)],
                              capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"error: cannot listen on 127.0.0.1:{port}: the port is in use "
                           "(another server, or another simulator, listens on it); give another "
                           "--port, or --port 0 for any free one\n")


def test_main_names_the_flags_it_was_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value is blamed on its flag (--ttft-ms), not on the SimConfig field (ttft_ms) the
    command line never shows; an empty --host would listen on every interface (a stand-in for
    serve makes sure none is listened on here)."""
    from shardrun.sim import server

    def served(*args: object, **kwargs: object) -> None:
        raise AssertionError("an empty --host was served")

    monkeypatch.setattr(server, "serve", served)
    assert main(["--ttft-ms", "nan"]) == 2
    assert capsys.readouterr().err == "error: --ttft-ms must be a finite number >= 0, not nan\n"
    assert main(["--host", "", "--port", "0"]) == 2
    assert capsys.readouterr().err == ("error: --host is empty: give the address to listen on "
                                       "(default 127.0.0.1)\n")


def test_a_host_with_no_address_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--host naming no address (a typo): exit 2 naming the flag, as for a port in use; the
    lookup's failure is raised by a stand-in for serve, so no name is looked up."""
    from shardrun.sim import server

    def unresolved(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(server, "serve", unresolved)
    assert main(["--host", "localhots", "--port", "0"]) == 2
    assert capsys.readouterr().err == ("error: cannot listen on localhots:0: no address is known "
                                       "for localhots; give one of this machine's in --host\n")


def test_start_sim_runs_a_real_process() -> None:
    """start_sim launches a separate process that streams over loopback and stops on SIGTERM."""
    cfg = SimConfig(ttft_ms=10, itl_ms=1, tokens="12", seed=7)
    with start_sim(cfg) as sim:
        assert sim.base_url.startswith("http://127.0.0.1:") and sim.base_url.endswith("/v1")
        assert sim.pid != os.getpid() and sim.returncode is None

        async def go() -> list[Any]:
            async with aiohttp.ClientSession() as s:
                events, _ = await stream(s, sim.base_url + "/chat/completions", CHAT)
                return events

        events = run(go())
        assert len(events) == 1 + 12 + 2
        assert sim.stop() == 0
    assert sim.returncode == 0


def test_start_sim_failure_raises_run_error_with_stderr() -> None:
    """A simulator that cannot listen makes start_sim raise RunError quoting its stderr."""
    with pytest.raises(RunError, match="cannot listen"):
        start_sim(SimConfig(), host="256.0.0.1", startup_timeout=15)


def test_a_simulator_stopped_by_a_signal_before_listening_is_one_sentence() -> None:
    """SIGINT sent to the simulator while it imports (the soak of scripts/soak_resume.py did):
    the error names the signal and quotes the last line of its stderr, not the traceback of
    the KeyboardInterrupt above it, nor `exited with status -2`."""
    import signal
    import threading

    import psutil

    raised: list[BaseException] = []

    def start() -> None:
        try:
            start_sim(SimConfig(), startup_timeout=60).stop()
        except RunError as exc:
            raised.append(exc)

    # A simulator an earlier test of this process started may still be ending: not ours.
    before = {c.pid for c in psutil.Process().children()}
    starter = threading.Thread(target=start)
    starter.start()
    try:
        deadline = time.monotonic() + 60
        child = None
        while child is None and time.monotonic() < deadline:
            child = next((c for c in psutil.Process().children() if c.pid not in before
                          and "shardrun.sim" in " ".join(c.cmdline())), None)
        assert child is not None, "no simulator started"
        # Once it imports aiohttp (its multidict loaded): its interpreter is up, so SIGINT is
        # a KeyboardInterrupt with a traceback, and it is far from listening.
        while not _has_loaded(child.pid, "/multidict/"):
            assert time.monotonic() < deadline, "the simulator never imported aiohttp"
        child.suspend()
        assert not [c for c in child.net_connections("tcp") if c.status == "LISTEN"]
        child.send_signal(signal.SIGINT)
        child.resume()
    finally:
        starter.join(60)
    (exc,) = raised
    said = str(exc)
    assert said.startswith("the simulator was killed by signal SIGINT before listening; its "
                           "stderr ends with: "), said
    assert said.endswith(": KeyboardInterrupt"), said
    assert "Traceback" not in said and "\n" not in said


def _has_loaded(pid: int, part: str) -> bool:
    """Whether a process has mapped a file whose path holds `part` (Linux: /proc/PID/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        return any(part in line for line in maps)


def test_plans_of_a_reasoning_model_and_of_a_tool_call() -> None:
    """reasoning_tokens come on top of the sampled answer (chat only) and count against the
    cap; a chat request with tools calls the first one unless tool_choice is "none"."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f"}}
    plain = make_plan(orjson.dumps(body), "chat", SimConfig(tokens="5"))
    thinking = make_plan(orjson.dumps(body), "chat", SimConfig(tokens="5", reasoning_tokens=3))
    assert (plain.thinking, thinking.thinking, len(thinking.words)) == (0, 3, 8)
    capped = make_plan(orjson.dumps({**body, "max_tokens": 2}), "chat",
                       SimConfig(tokens="5", reasoning_tokens=3))  # fmt: skip
    assert (capped.thinking, len(capped.words), capped.finish) == (2, 2, "length")
    completions = make_plan(orjson.dumps({"prompt": "hi"}), "completions",
                            SimConfig(tokens="5", reasoning_tokens=3))  # fmt: skip
    assert (completions.thinking, len(completions.words)) == (0, 5)
    called = make_plan(orjson.dumps({**body, "tools": [tool]}), "chat", SimConfig())
    assert (called.tool, called.finish) == ("f", "tool_calls")
    declined = make_plan(orjson.dumps({**body, "tools": [tool], "tool_choice": "none"}), "chat",
                         SimConfig())  # fmt: skip
    assert (declined.tool, declined.finish) == (None, "stop")
    with pytest.raises(ValueError, match="reasoning_tokens must be at most 65536"):
        SimConfig(reasoning_tokens=10**9)
    with pytest.raises(BadRequest, match="'tools' must be a non-empty list"):
        make_plan(orjson.dumps({**body, "tools": [{"type": "function"}]}), "chat", SimConfig())


def test_a_prompt_cache_counts_cached_prompt_tokens_in_usage() -> None:
    """cached_tokens: N makes usage count the first N prompt tokens (at most all of them) as
    cached, streamed and whole, chat and completions; without it chat usage has no details."""
    body = {**CHAT, "stream_options": {"include_usage": True}}
    completion = {"model": "m", "prompt": "Once upon a time", "stream_options":
                  {"include_usage": True}}  # fmt: skip

    async def usages(cfg: SimConfig) -> list[dict[str, Any]]:
        async with serving(cfg) as (s, root):
            chat, _ = await stream(s, root + "/v1/chat/completions", body)
            async with s.post(root + "/v1/chat/completions", json=CHAT) as resp:
                whole = await resp.json()
            legacy, _ = await stream(s, root + "/v1/completions", completion)
        return [chat[-2]["usage"], whole["usage"], legacy[-2]["usage"]]

    cached = run(usages(dataclasses.replace(FAST, cached_tokens=3)))
    assert [u["prompt_tokens_details"] for u in cached] == [{"cached_tokens": 3}] * 3
    assert all(u["prompt_tokens"] > 3 for u in cached)
    whole_prompt = run(usages(SimConfig(ttft_ms=5, itl_ms=1, tokens="4", cached_tokens=10**6)))
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in whole_prompt] == [
        u["prompt_tokens"] for u in whole_prompt]  # fmt: skip
    assert not any("prompt_tokens_details" in u for u in run(usages(FAST)))


def test_a_share_of_chat_answers_are_refusals() -> None:
    """refusal: a share of prompts (decided per prompt, like the words) are answered with
    `refusal` pieces instead of content, streamed and whole, and call no tool; completions
    never refuse; a share of 0 leaves every plan as it was."""
    cfg = SimConfig(tokens="6", refusal=0.5)
    bodies = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(200)]
    plans = [make_plan(orjson.dumps(b), "chat", cfg) for b in bodies]
    assert 60 <= sum(p.refused for p in plans) <= 140
    unrefused = [make_plan(orjson.dumps(b), "chat", SimConfig(tokens="6")) for b in bodies]
    assert [p.words for p in plans] == [p.words for p in unrefused]
    assert not any(p.refused for p in unrefused)
    assert not make_plan(b'{"prompt": "q"}', "completions", SimConfig(refusal=1.0)).refused
    with pytest.raises(ValueError, match="refusal must be a fraction between 0 and 1"):
        SimConfig(refusal=1.5)

    always = SimConfig(ttft_ms=5, itl_ms=1, tokens="5", flush_ms=5, refusal=1.0)
    tool = {"type": "function", "function": {"name": "f"}}
    body = {**CHAT, "tools": [tool]}
    words = "".join(TEXT_WORDS["words"][i]
                    for i in make_plan(orjson.dumps(body), "chat", always).words)

    async def go() -> tuple[list[Any], dict[str, Any]]:
        async with serving(always) as (s, root):
            events, _ = await stream(s, root + "/v1/chat/completions", body)
            async with s.post(root + "/v1/chat/completions", json=body) as resp:
                whole = (await resp.json())["choices"][0]
        return events, whole

    events, whole = run(go())
    deltas = [e["choices"][0]["delta"] for e in events[1:-1] if e["choices"]]
    assert "".join(d.get("refusal", "") for d in deltas) == words
    assert not any(d.get("content") or d.get("tool_calls") for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert whole["message"]["content"] is None and whole["message"]["refusal"] == words
    assert "tool_calls" not in whole["message"] and whole["finish_reason"] == "stop"


@pytest.mark.parametrize("tools", [False, True])
def test_prose_text_is_escaped_on_the_wire_and_parses_back_to_the_plan(tools: bool) -> None:
    """text: prose puts line breaks, quotes, backslashes and tabs in the words. Streamed and
    whole, as content, reasoning and a call's arguments (JSON inside JSON), every payload is
    valid JSON whose text is the plan's words as prose; completions too."""
    cfg = SimConfig(ttft_ms=5, itl_ms=1, tokens="40", flush_ms=5, text="prose",
                    reasoning_tokens=4)  # fmt: skip
    tool = {"type": "function", "function": {"name": "f"}}
    body = {**CHAT, **({"tools": [tool]} if tools else {})}
    prose = TEXT_WORDS["prose"]
    plan = make_plan(orjson.dumps(body), "chat", cfg)
    thought = "".join(prose[i] for i in plan.words[:4])
    answer = "".join(prose[i] for i in plan.words[4:])
    assert set(answer) & set('\n"\\\t') and set(answer) - set('\n"\\\t')  # both kinds of word

    def said(message: dict[str, Any]) -> str:
        if not tools:
            return str(message["content"])
        [call] = message["tool_calls"]
        return str(orjson.loads(call["function"]["arguments"])["text"])

    async def go() -> None:
        async with serving(cfg) as (s, root):
            events, _ = await stream(s, root + "/v1/chat/completions", body)
            async with s.post(root + "/v1/chat/completions", json=body) as resp:
                whole = (await resp.json())["choices"][0]["message"]
            prompt = {"model": "m", "prompt": "Once upon a time"}
            completion, _ = await stream(s, root + "/v1/completions", prompt)
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
        if tools:
            pieces = [c["function"].get("arguments") or ""
                      for d in deltas for c in d.get("tool_calls") or []]  # fmt: skip
            streamed = {"tool_calls": [{"function": {"arguments": "".join(pieces)}}]}
        else:
            streamed = {"content": text_of(events)}
        assert said(streamed) == answer
        assert (whole["reasoning_content"], said(whole)) == (thought, answer)
        words = make_plan(orjson.dumps(prompt), "completions", cfg).words
        assert text_of(completion, "text") == "".join(prose[i] for i in words)

    run(go())


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": "m", "prompt": "Once upon a time"}),
])  # fmt: skip
def test_obfuscation_pads_every_chunk_unless_the_request_turns_it_off(
        path: str, body: dict[str, Any]) -> None:  # fmt: skip
    """`obfuscation: true`: every chunk but [DONE] ends with an `obfuscation` member of letters,
    whose length changes from chunk to chunk; without it the stream is the same. A request
    with `stream_options.include_obfuscation: false` gets no padding, as from OpenAI."""
    padded = SimConfig(ttft_ms=5, itl_ms=1, tokens="40", flush_ms=5, text="prose",
                       reasoning_tokens=4, obfuscation=True)  # fmt: skip
    plain = dataclasses.replace(padded, obfuscation=False)
    usage = {**body, "stream_options": {"include_usage": True}}
    off = {**body, "stream_options": {"include_usage": True, "include_obfuscation": False}}

    async def go() -> None:
        async with serving(padded) as (s, root):
            events, _ = await stream(s, root + path, usage)
            unpadded, _ = await stream(s, root + path, off)
        async with serving(plain) as (s, root):
            expected, _ = await stream(s, root + path, usage)
        chunks = events[:-1]
        assert events[-1] == "[DONE]" and len(chunks) >= 42  # the words, finish and usage
        pads = [chunk.pop("obfuscation") for chunk in chunks]
        assert all(pad.isalnum() for pad in pads) and len(set(map(len, pads))) >= 10
        assert same(chunks) == same(expected[:-1]) == same(unpadded[:-1])

    def same(chunks: list[dict[str, Any]]) -> list[object]:
        """The chunks without what each request has of its own: its id and its second."""
        rid = chunks[0]["id"].encode()
        return [orjson.loads(orjson.dumps({**c, "created": 0}).replace(rid, b"ID")) for c in chunks]

    run(go())


BAD_SETTINGS = [  # as a job file's `sim:` block gives them (test_simconfig_rejects_bad_...)
    {"tokens": "abc"}, {"tokens": "inf"}, {"tokens": ["64"]}, {"text": "poetry"},
    {"rpm_headers": "all"}, {"ttft_ms": "abc"}, {"seed": -1}, {"storm_status": 404},
    {"refusal": 2},
    {"reasoning_tokens": 10**6}, {"seedx": 1}, {"zzz": 1}, {"fail_500": "x"},
    {"fail_500": 1.5}, {"fail_500": 0.7, "fail_429": 0.7}, {"keepalive": "maybe"},
    {"reset_when": ""}, {"auth_required": "a b"},
]


@pytest.mark.parametrize("bad", BAD_SETTINGS, ids=[str(b) for b in BAD_SETTINGS])
def test_a_bad_setting_is_said_as_shardruns_own_errors_are(bad: dict[str, Any]) -> None:
    """One sentence with no full stop at its end, as every other `error:` line of shardrun
    (`endpoint.sim: ...` in a job file, `--flag ...` from `shardrun sim`)."""
    with pytest.raises(ValueError) as refused:
        SimConfig.from_mapping(bad)
    said = str(refused.value)
    assert said and "\n" not in said and not said.endswith("."), said


def test_text_is_words_or_prose() -> None:
    """The default text is plain words, the table every other mode rewrites; a mode the
    simulator does not know is refused naming the setting, as a flag and as a job key."""
    assert SimConfig().text == "words" and TEXT_WORDS["words"] == tuple(w.decode() for w in WORDS)
    assert sum(a != b for a, b in zip(*TEXT_WORDS.values(), strict=True)) == 64
    with pytest.raises(ValueError, match="text must be one of words, prose, not 'poetry'"):
        SimConfig.from_mapping({"text": "poetry"})
    assert main(["--text", "poetry"]) == 2


def test_a_dead_simulators_exit_is_read_without_reaping_it() -> None:
    """The run polls its simulator for an exit: a killed one reads as killed by SIGKILL while
    it stays unreaped, so its CPU time does not join this process's children's (the run's
    client CPU) until `stop()` reaps it once the summary is made."""
    import signal

    from shardrun.sim.launcher import start_sim

    sim = start_sim(SimConfig(ttft_ms=1, tokens="4"))
    try:
        assert sim.returncode is None
        os.kill(sim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while sim.returncode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sim.returncode == -signal.SIGKILL
        assert sim.returncode == -signal.SIGKILL  # asked again: still there to be asked
        # Not reaped: the kernel still holds it for its parent (a zombie).
        assert os.waitid(os.P_PID, sim.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    finally:
        sim.stop()
    assert sim.returncode == -signal.SIGKILL
    with pytest.raises(ChildProcessError):
        os.waitid(os.P_PID, sim.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
