"""StreamingClient over real loopback HTTP: every failure is an outcome, never an exception."""

import asyncio
import base64
import socket
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun import client as client_module
from shardrun._attempt import CURRENT, SWEEP_S, Attempt, Watchdog
from shardrun._chunks import MSG_MAX, USAGE_MAX, clip
from shardrun.client import (
    AttemptOutcome,
    StreamingClient,
    Timeouts,
    _describe,
    endpoint_url,
    make_session,
    request_headers,
)
from shardrun.clock import Clock
from shardrun.items import API_PATHS, Api
from shardrun.itl import ItlHistogram

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BODY = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
FAST = Timeouts(connect_s=2.0, first_token_s=2.0, idle_s=2.0, total_s=10.0)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def chat(content: str | None = None, finish: str | None = None) -> dict[str, object]:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip


def sse(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


async def cut_after_one_token(request: web.Request) -> web.StreamResponse:
    """Send one content chunk, then abort the TCP connection mid-body."""
    resp = await open_stream(request)
    await resp.write(sse(chat("a")))
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.abort()
    await asyncio.sleep(1)
    return resp


async def open_stream(request: web.Request, **headers: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
    await resp.prepare(request)
    return resp


@asynccontextmanager
async def serve(
    handler: Handler,
    timeouts: Timeouts = FAST,
    api: Api = "chat",
    cap: int = 4,
    plain: bool = False,
    headers: Mapping[str, str] | None = None,
) -> AsyncIterator[StreamingClient]:
    """A loopback server for `handler` and a client sending `headers` (a key "k" by default);
    `plain`: a bare aiohttp session instead."""
    app = web.Application()
    app.router.add_post("/v1" + API_PATHS[api], handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    session = aiohttp.ClientSession() if plain else make_session(cap, timeouts)
    base = f"http://127.0.0.1:{server.port}/v1/"
    try:
        yield StreamingClient(session, base, api, headers or {"Authorization": "Bearer k"},
                              timeouts, Clock())
    finally:
        await session.close()
        await server.close()


async def one(handler: Handler, timeouts: Timeouts = FAST, **kw: Any) -> AttemptOutcome:
    async with serve(handler, timeouts, **kw) as client:
        return await client.attempt(BODY)


async def normal_chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body["stream"] is True and request.headers["Authorization"] == "Bearer k"
    resp = await open_stream(request, **{"X-RateLimit-Remaining-Requests": "99"})
    await resp.write(b": keep-alive\n\n" + sse(chat("")))
    for piece in ["héllo", " 世界", " 🙂"]:
        await resp.write(sse(chat(piece)))
        await asyncio.sleep(0.01)
    await resp.write(sse(chat(None, "stop")))
    usage = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    await resp.write(sse({"choices": [], "usage": usage}) + sse(b"[DONE]"))
    return resp


def test_normal_chat_stream() -> None:
    """A normal chat stream: text, usage, finish_reason, headers, ordered timestamps, callbacks,
    and when the client last heard a stream's events (the live view's "nothing heard for")."""
    calls: list[tuple[str, object]] = []
    heard: list[float] = []

    async def go() -> AttemptOutcome:
        async with serve(normal_chat) as client:
            heard.append(client.heard_at)
            out = await client.attempt(
                BODY,
                on_conn_ready=lambda t, reused: calls.append(("conn", reused)),
                on_first_token=lambda t: calls.append(("first", t)),
            )
            heard.append(client.heard_at)
            return out

    out = run(go())
    assert heard[0] == 0.0 and out.last_token_at is not None
    assert out.last_token_at <= heard[1] <= out.ended_at
    assert out.status == "ok" and out.error is None and out.http_status == 200
    assert out.text == "héllo 世界 🙂" and out.finish_reason == "stop"
    assert (out.prompt_tokens, out.completion_tokens, out.usage_estimated) == (11, 3, False)
    assert out.content_chunks == 3 and out.wasted_tokens == 0 and out.itl.count == 2
    assert out.rate_headers == {"x-ratelimit-remaining-requests": "99"}
    assert out.conn_reused is False and out.conn_ready_at is not None
    assert out.first_token_at is not None and out.last_token_at is not None
    assert out.started_at <= out.conn_ready_at <= out.first_token_at
    assert out.first_token_at < out.last_token_at <= out.ended_at
    assert calls == [("conn", False), ("first", out.first_token_at)]


def test_completions_api() -> None:
    """The completions API posts to /completions and reads choices[0].text."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for piece in ["a", "b"]:
            await resp.write(sse({"choices": [{"index": 0, "text": piece, "finish_reason": None}]}))
        await resp.write(sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
        await resp.write(sse(b"[DONE]"))
        return resp

    out = run(one(handler, api="completions"))
    assert (out.status, out.text, out.finish_reason) == ("ok", "ab", "length")


def test_no_usage_counts_chunks() -> None:
    """Without a usage chunk, completion_tokens is the number of content chunks, estimated."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(sse(chat("x")) + sse(chat("y")) + sse(chat("z")) + sse(b"[DONE]"))
        return resp

    out = run(one(handler))
    assert out.status == "ok" and out.usage_estimated is True and out.prompt_tokens is None
    assert out.completion_tokens == out.content_chunks == 3


@pytest.mark.parametrize("count", [-7, USAGE_MAX + 1, 10**18])
def test_impossible_usage_counts_chunks_as_no_usage_does(count: int) -> None:
    """A server's negative or absurd token counts are no counts: the tokens are the content
    chunks, estimated, in a stream and in a whole answer (they made a run's tokens and TPM
    negative, or 10**18 that, with rate_limits.tpm, held the shard's requests for good)."""
    usage = {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
             "prompt_tokens_details": {"cached_tokens": count},
             "completion_tokens_details": {"reasoning_tokens": count}}

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(sse(chat("x")) + sse(chat("y", "stop")) + sse({"choices": [],
                         "usage": usage}) + sse(b"[DONE]"))  # fmt: skip
        return resp

    answer = {"choices": [{"index": 0, "message": {"content": "x" * 40}, "finish_reason": "stop"}],
              "usage": usage}
    for handler_, tokens in ((handler, 2), (whole_answer(orjson.dumps(answer)), 10)):
        out = run(one(handler_))
        assert out.status == "ok" and out.usage_estimated is True
        assert out.completion_tokens == tokens and out.prompt_tokens is None
        assert out.cached_tokens is None and out.reasoning_tokens is None


def test_second_request_reuses_connection() -> None:
    """The first attempt opens a connection; the second on the same session reuses it."""

    async def go() -> list[AttemptOutcome]:
        async with serve(normal_chat) as client:
            return [await client.attempt(BODY), await client.attempt(BODY)]

    first, second = run(go())
    assert first.status == second.status == "ok"
    assert (first.conn_reused, second.conn_reused) == (False, True)


def test_429_captures_retry_after() -> None:
    """HTTP 429 becomes http_429 with the raw Retry-After and rate-limit headers."""

    async def handler(request: web.Request) -> web.StreamResponse:
        headers = {"Retry-After": "7", "x-ratelimit-reset-requests": "1s"}
        return web.json_response({"error": {"message": "slow down"}}, status=429, headers=headers)

    out = run(one(handler))
    assert (out.status, out.http_status, out.retry_after) == ("http_429", 429, "7")
    assert out.rate_headers == {"x-ratelimit-reset-requests": "1s"}
    assert out.error == "HTTP 429: slow down"


def test_503_is_http_5xx() -> None:
    """HTTP 503 with a plain-text body becomes http_5xx with the text in the error."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=503, text="overloaded,\n try later")

    out = run(one(handler))
    assert (out.status, out.http_status) == ("http_5xx", 503)
    assert out.error == "HTTP 503: overloaded, try later" and out.retry_after is None


def test_400_reports_error_body_message() -> None:
    """HTTP 400 becomes http_4xx and the OpenAI error message (clipped) lands in error."""

    async def handler(request: web.Request) -> web.StreamResponse:
        err = {"error": {"message": "max_tokens too large " + "x" * 500, "type": "invalid"}}
        return web.json_response(err, status=400)

    out = run(one(handler))
    assert out.status == "http_4xx" and out.error is not None
    assert out.error.startswith("HTTP 400: max_tokens too large xxx")
    assert len(out.error) == len("HTTP 400: ") + 200


@pytest.mark.parametrize(("code", "status"), [(429, "http_429"), ("503", "http_5xx"),
                                              ("bad_request", "http_4xx"),
                                              ("new_code", "protocol_error")])  # fmt: skip
def test_error_object_inside_stream(code: object, status: str) -> None:
    """An {"error": ...} payload mid-stream maps its code: 429, 5xx, a request that cannot
    succeed as 4xx, else protocol_error."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(sse(chat("a")) + sse({"error": {"message": "boom", "code": code}}))
        await resp.write(sse(chat("never")) + sse(b"[DONE]"))
        return resp

    out = run(one(handler))
    assert out.status == status and out.http_status == 200
    assert out.error == f"error {code} in stream after 1 token: boom"
    assert out.text == "a" and out.wasted_tokens == 1


def test_stream_cut_without_done() -> None:
    """A stream that ends cleanly but without [DONE] is a protocol_error with wasted tokens."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(sse(chat("a")) + sse(chat("b")))
        return resp

    out = run(one(handler))
    assert out.status == "protocol_error"
    assert out.error == "stream ended before [DONE] after 2 tokens"
    assert out.wasted_tokens == 2 and out.text == "ab"


def whole_answer(body: bytes, content_type: str = "application/json",
                 pieces: int = 1) -> Handler:
    """A handler that ignores `stream` and sends one JSON body, written in `pieces` parts."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        await resp.prepare(request)
        step = -(-len(body) // pieces)
        for at in range(0, len(body), step):
            await resp.write(body[at : at + step])
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    return handler


def test_a_whole_json_answer_is_taken_as_one_piece() -> None:
    """A server that answers a streaming request with one chat.completion (in several reads):
    ok, the text and usage as sent, first and last token at the end of the body, no gaps."""
    body = orjson.dumps({"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "héllo 世界"},
         "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
    firsts: list[float] = []

    async def go() -> AttemptOutcome:
        async with serve(whole_answer(body, pieces=3)) as client:
            return await client.attempt(BODY, on_first_token=firsts.append)

    out = run(go())
    assert (out.status, out.error, out.finish_reason) == ("ok", None, "stop")
    assert out.text == "héllo 世界"
    assert (out.prompt_tokens, out.completion_tokens, out.usage_estimated) == (5, 4, False)
    assert out.first_token_at is not None and out.first_token_at == out.last_token_at
    assert out.conn_ready_at is not None and out.conn_ready_at <= out.first_token_at
    assert out.first_token_at <= out.ended_at and out.itl.count == 0 and out.content_chunks == 1
    assert firsts == [out.first_token_at]


def test_a_whole_answer_without_usage_estimates_tokens_from_characters() -> None:
    """No usage and no chunks to count: characters / 4, marked estimated; the content type
    does not matter (a server may label its JSON as an event stream)."""
    body = orjson.dumps({"choices": [{"index": 0, "text": "x" * 41, "finish_reason": "length"}]})
    out = run(one(whole_answer(body, content_type="text/event-stream"), api="completions"))
    assert (out.status, out.text, out.finish_reason) == ("ok", "x" * 41, "length")
    assert (out.completion_tokens, out.usage_estimated, out.prompt_tokens) == (11, True, None)
    assert out.content_chunks == 1


def test_a_whole_answer_of_a_thought_and_a_call_estimates_from_both() -> None:
    """A whole chat answer with no content and no usage: the estimate counts the reasoning's
    characters and the call's arguments (12 + 20 = 32, so 8 tokens; 3 without the call)."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "save", "arguments": '{"note":"' + "n" * 9 + '"}'}}
    body = orjson.dumps({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "content": None, "reasoning_content": "r" * 12, "tool_calls": [call]}}]})
    out = run(one(whole_answer(body)))
    assert (out.status, out.text, out.finish_reason) == ("ok", "", "tool_calls")
    assert (out.reasoning, out.tool_calls) == ("r" * 12, [call])
    assert (out.completion_tokens, out.usage_estimated) == (8, True)
    # The same call in the older `functions` form.
    message = {"content": None, "reasoning_content": "r" * 12, "function_call": call["function"]}
    old_form = orjson.dumps({"choices": [{"index": 0, "finish_reason": "function_call",
                                          "message": message}]})
    out = run(one(whole_answer(old_form)))
    assert (out.function_call, out.tool_calls) == (call["function"], None)
    assert (out.completion_tokens, out.usage_estimated) == (8, True)


def test_a_whole_response_object_is_taken_as_one_piece() -> None:
    """api: responses, a server that answers with the whole response object: its message,
    reasoning and usage, and the incomplete status as "length"; a stream that ends without
    its last event is cut, named by that event."""
    body = orjson.dumps({"object": "response", "status": "incomplete",
                         "incomplete_details": {"reason": "max_output_tokens"}, "output": [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "content": [{"type": "output_text", "text": "héllo"}]}],
        "usage": {"input_tokens": 3, "output_tokens": 9}})  # fmt: skip
    out = run(one(whole_answer(body, pieces=2), api="responses"))
    assert (out.status, out.text, out.reasoning, out.finish_reason) == (
        "ok", "héllo", "hm", "length")  # fmt: skip
    assert (out.prompt_tokens, out.completion_tokens, out.usage_estimated) == (3, 9, False)

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delta = {"type": "response.output_text.delta", "output_index": 0, "delta": "a"}
        await resp.write(b"data: " + orjson.dumps(delta) + b"\n\n")
        return resp

    out = run(one(cut, api="responses"))
    assert (out.status, out.text) == ("protocol_error", "a")
    assert out.error == "stream ended before response.completed after 1 token"


def in_writes(*writes: int) -> Handler:
    """A handler that streams an answer of sum(`writes`) one-letter chunks, `writes[i]` of
    them in its i-th write, 50 ms apart; the last write also holds its end."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for i, n in enumerate(writes):
            body = b"".join(sse(chat("x")) for _ in range(n))
            if i == len(writes) - 1:
                body += sse(chat(None, "stop")) + sse(b"[DONE]")
            await resp.write(body)
            await asyncio.sleep(0.05)
        return resp

    return handler


@pytest.mark.parametrize(("writes", "at_once"), [
    ((1,), False),  # one token: its first is its last, held back or not
    ((3,), False),  # a short answer a fast server may send in one write
    ((4,), True),  # all of it in one read: a proxy held it back
    ((1, 3), False),  # streamed
    ((1, 100), False),  # the first token alone, then a burst: a client that fell behind
    ((70, 30), True),  # a long burst that came in more than one read
    ((60, 40), False),  # fewer than AT_ONCE_CHUNKS: a server that sends tokens in batches
], ids=["1", "3", "4", "1+3", "1+100", "70+30", "60+40"])
def test_an_answer_whose_first_read_holds_all_of_it_or_64_chunks_came_at_once(
        writes: tuple[int, ...], at_once: bool) -> None:
    """A stream whose first read of content brings all of an answer of 4 chunks or more, or
    64 of them, is marked `at_once`: its first token came with the rest, as behind a proxy
    that buffers streams, and says nothing of the server's queue."""
    out = run(one(in_writes(*writes)))
    assert out.status == "ok" and out.content_chunks == sum(writes)
    assert out.at_once is at_once and out.whole is False


def streaming(*payloads: object, events: bool = False) -> Handler:
    """A handler that streams these SSE payloads, a few ms apart; `events`: each with an
    `event:` line naming its type, as vLLM frames the Responses API."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for payload in payloads:
            kind = payload.get("type") if isinstance(payload, dict) else None
            await resp.write((f"event: {kind}\n".encode() if events and kind else b"")
                             + sse(payload))  # fmt: skip
            await asyncio.sleep(0.002)
        return resp

    return handler


def test_a_refusal_streams_as_generated_tokens_apart_from_the_answer() -> None:
    """A chat model that declines (OpenAI's `refusal` delta): ok, no answer text, the refusal
    in its own field, and its pieces are tokens (first and last token set)."""
    pieces = [{"choices": [{"index": 0, "delta": {"refusal": w}, "finish_reason": None}]}
              for w in ["I can't", " help."]]  # fmt: skip
    out = run(one(streaming(chat(""), *pieces, chat(None, "stop"), b"[DONE]")))
    assert (out.status, out.text, out.refusal, out.finish_reason) == (
        "ok", "", "I can't help.", "stop")  # fmt: skip
    assert out.first_token_at is not None and out.last_token_at is not None
    assert (out.content_chunks, out.completion_tokens, out.usage_estimated) == (2, 2, True)


def test_a_responses_call_streamed_as_llama_cpp_and_vllm_frame_it() -> None:
    """api: responses, `event:` lines before each payload, a call item with no id and no
    output index and argument pieces naming it only by item_id: one call, its arguments once."""
    item = {"type": "function_call", "call_id": "fc_1", "name": "get", "arguments": ""}
    args = "response.function_call_arguments.delta"
    final = {"object": "response", "status": "completed",
             "output": [{**item, "arguments": '{"x":1}'}],
             "usage": {"input_tokens": 4, "output_tokens": 2}}  # fmt: skip
    handler = streaming({"type": "response.created", "response": {**final, "output": []}},
                        {"type": "response.output_item.added", "item": item},
                        {"type": args, "item_id": "fc_1", "delta": '{"x":'},
                        {"type": args, "item_id": "fc_1", "delta": "1}"},
                        {"type": "response.completed", "response": final}, events=True)
    out = run(one(handler, api="responses"))
    assert (out.status, out.finish_reason, out.content_chunks) == ("ok", "tool_calls", 2)
    assert out.tool_calls == [{"id": "fc_1", "type": "function",
                               "function": {"name": "get", "arguments": '{"x":1}'}}]


def test_a_recorded_openai_responses_stream_over_loopback() -> None:
    """The recorded wire shape of OpenAI's Responses API (tests/data), sent in writes of a few
    hundred bytes: the attempt ends ok with the custom tool's call, the server's usage, and
    first and last tokens (the call's pieces)."""
    from tests.test_responses import RECORDED, SQL_CALL

    async def recorded(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for at in range(0, len(RECORDED), 300):
            await resp.write(RECORDED[at : at + 300])
            await asyncio.sleep(0.002)
        return resp

    out = run(one(recorded, api="responses"))
    assert (out.status, out.text, out.tool_calls, out.finish_reason) == (
        "ok", "", [SQL_CALL], "tool_calls")  # fmt: skip
    assert (out.completion_tokens, out.usage_estimated, out.content_chunks) == (151, False, 8)
    assert (out.cached_tokens, out.reasoning_tokens) == (0, 128)
    assert out.first_token_at is not None and out.last_token_at is not None
    assert out.first_token_at <= out.last_token_at


@pytest.mark.parametrize(("error", "status"), [
    ({"type": "too_many_requests", "code": "too_many_requests", "message": "busy"}, "http_429"),
    ({"code": "context_length_exceeded", "message": "too long"}, "http_4xx"),
    ({"code": "server_error", "message": "oops"}, "http_5xx"),
])  # fmt: skip
def test_a_responses_error_event_is_classed_by_its_code(error: dict[str, str],
                                                        status: str) -> None:  # fmt: skip
    """An `error` event after a token: the attempt ends with the status its code means, and
    the error names the code."""
    delta = {"type": "response.output_text.delta", "output_index": 0, "delta": "a"}
    out = run(one(streaming(delta, {"type": "error", "error": error}), api="responses"))
    assert (out.status, out.text) == (status, "a")
    assert out.error == f"error {error['code']} in stream after 1 token: {error['message']}"


def test_the_servers_name_for_an_error_is_kept() -> None:
    """The error's code (else type) of an HTTP error body and of an error inside a stream is
    on the outcome, where the shard looks for a used-up quota."""

    async def quota(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "You exceeded your current quota",
                                            "type": "insufficient_quota", "param": None,
                                            "code": "insufficient_quota"}}, status=429)

    out = run(one(quota))
    assert (out.status, out.error_code) == ("http_429", "insufficient_quota")
    assert out.error == "HTTP 429: You exceeded your current quota"
    event = {"type": "error", "error": {"type": "insufficient_quota", "message": "top up"}}
    out = run(one(streaming(event), api="responses"))
    assert (out.status, out.error_code) == ("http_4xx", "insufficient_quota")
    assert run(one(normal_chat)).error_code is None


def test_a_whole_answer_over_the_size_cap_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body with no events is kept only up to the cap: past it, it is no answer."""
    body = orjson.dumps({"choices": [{"index": 0, "text": "x" * 2000, "finish_reason": "stop"}]})
    monkeypatch.setattr(client_module, "_WHOLE_MAX", len(body) - 1)
    out = run(one(whole_answer(body, pieces=4), api="completions"))
    assert out.status == "protocol_error" and out.text == ""
    monkeypatch.setattr(client_module, "_WHOLE_MAX", len(body))
    assert run(one(whole_answer(body, pieces=4), api="completions")).status == "ok"


def test_a_line_without_end_fails_at_its_cap_not_at_a_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes with no line end (a `data:` line, a page with no newline) were all held by the
    decoder until a deadline: 920 MB in 2 s over loopback. Past `_UNENDED_MAX` with no event,
    after a token or before any, the attempt fails at once, and names why."""
    monkeypatch.setattr(client_module, "_UNENDED_MAX", 1 << 20)

    def endless(head: bytes, content_type: str = "text/event-stream") -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": content_type})
            await resp.prepare(request)
            await resp.write(head)
            for _ in range(20_000):  # 80 MiB, unless the client lets go first
                await resp.write(b"x" * 4096)
            return resp

        return handler

    cases = [(endless(sse(chat("a")) + b"data: "), 1, ""),
             (endless(b"<html>", "text/html"), 0, " (content-type text/html)")]
    for handler, tokens, note in cases:
        out = run(one(handler))
        assert out.status == "protocol_error" and out.not_an_answer == (tokens == 0)
        assert out.error == ("a line or an event without end: no complete event in 1 MiB of "
                             f"stream after {tokens} token{'s' * (tokens != 1)}{note}")


def test_an_answer_without_end_fails_at_the_body_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that ignores max_tokens and streams on: its text was all kept until total_s
    (1.6 GB in 5 s over loopback). Past `_BODY_MAX` the attempt fails, its tokens wasted."""
    monkeypatch.setattr(client_module, "_BODY_MAX", 1 << 20)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for _ in range(20_000):  # 40 MiB, unless the client lets go first
            await resp.write(sse(chat("word " * 400)))
        return resp

    out = run(one(handler))
    assert out.status == "protocol_error" and 0 < out.wasted_tokens < 1000
    assert out.error == f"a stream without end: past 1 MiB after {out.content_chunks} tokens"


def test_the_body_cap_grows_with_the_answer_the_request_allows() -> None:
    """A request's token limit and n allow a stream of 8 KiB a token where that passes 64 MiB:
    a 32k-token answer with 20 top logprobs a token is some 50 MB, two choices twice that."""
    base = client_module._BODY_MAX
    assert client_module.body_cap(BODY) == base
    assert client_module.body_cap({**BODY, "max_tokens": 256, "n": 4}) == base
    assert client_module.body_cap({**BODY, "max_tokens": 32_768}) == 32_768 * 8192
    assert client_module.body_cap({**BODY, "max_completion_tokens": 32_768, "n": 2}) == (
        2 * 32_768 * 8192)
    assert client_module.body_cap({"input": "x", "max_output_tokens": 65_536}) == 65_536 * 8192
    assert client_module.body_cap({**BODY, "max_tokens": "lots", "n": "2"}) == base


def test_a_long_answer_its_limit_allows_passes_the_body_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer within its max_tokens whose chunks are large (logprobs) is whole past
    `_BODY_MAX`: a fixed cap failed it, and it was retried and paid for up to max_attempts."""
    monkeypatch.setattr(client_module, "_BODY_MAX", 1 << 20)
    logprobs = [{"token": "w", "logprob": -0.5, "bytes": [119]}] * 40  # about 1.5 KB

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for _ in range(1_000):  # 1.6 MiB
            piece = chat("w ")
            piece["choices"][0]["logprobs"] = {"content": logprobs}  # type: ignore[index]
            await resp.write(sse(piece))
        await resp.write(sse(chat(None, "length")) + sse(b"[DONE]"))
        return resp

    async def main() -> AttemptOutcome:
        async with serve(handler, FAST) as client:
            return await client.attempt({**BODY, "max_tokens": 1_000})

    out = run(main())
    assert out.status == "ok" and out.content_chunks == 1_000 and out.finish_reason == "length"


def test_one_event_of_a_long_answer_its_limit_allows_passes_the_event_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Responses API's closing events each repeat the whole answer, logprobs and all:
    one of 21.6 MiB at 20k tokens with 20 top logprobs a token. A request whose limit allows
    such an answer may bring an event of half its body's cap (here 1.5 MiB in one line, past
    the 1 MiB a request with no limit is allowed)."""
    monkeypatch.setattr(client_module, "_UNENDED_MAX", 1 << 20)
    monkeypatch.setattr(client_module, "_BODY_MAX", 2 << 20)
    big = sse(chat("w" * (3 << 19)))

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for start in range(0, len(big), 4096):  # in many reads, as a long event comes
            await resp.write(big[start:start + 4096])
        await resp.write(sse(chat(None, "stop")) + sse(b"[DONE]"))
        return resp

    async def main(limit: int | None) -> AttemptOutcome:
        body = BODY if limit is None else {**BODY, "max_tokens": limit}
        async with serve(handler, FAST) as client:
            return await client.attempt(body)

    assert run(main(1_000)).status == "ok"  # a cap of 8 MB, an event cap of 4 MB
    unlimited = run(main(None))
    assert unlimited.status == "protocol_error"
    assert unlimited.error is not None and "no complete event in 1 MiB" in unlimited.error


def test_a_whole_error_object_with_status_200_is_classified() -> None:
    body = b'{"error": {"message": "overloaded", "code": 503}}'
    out = run(one(whole_answer(body)))
    assert out.status == "http_5xx" and out.text == ""
    assert out.error == "error 503 in stream after 0 tokens: overloaded"


def test_a_json_body_that_is_no_answer_is_a_protocol_error() -> None:
    out = run(one(whole_answer(b'{"id": "x", "object": "chat.completion"}')))
    assert out.status == "protocol_error"
    assert out.error == "an unreadable answer: no choices (content-type application/json)"
    assert out.not_an_answer  # every request to such a server would meet it
    page = run(one(whole_answer(b"<html>Sign in</html>", content_type="text/html")))
    assert (page.status, page.not_an_answer) == ("protocol_error", True)
    # A stream cut after a token is one answer's fault, not the server's every answer.
    cut = run(one(streaming(chat("a"))))
    assert (cut.status, cut.not_an_answer) == ("protocol_error", False)
    assert not run(one(normal_chat)).not_an_answer


@pytest.mark.parametrize(("status", "location", "shown"), [
    (301, "https://api.example/v1/chat/completions", "https://api.example/v1/chat/completions"),
    (302, "http://u:pw@portal.example/login?next=/v1&sid=s3cr3t#f",
     "http://***@portal.example/login"),
    (307, "http://replica-b.internal:8000/v1/chat/completions",
     "http://replica-b.internal:8000/v1/chat/completions"),
    (308, "http://[::1", "an invalid URL"),
])  # fmt: skip
def test_a_redirect_says_where_and_is_no_answer(status: int, location: str, shown: str) -> None:
    """A redirect is not followed, and every request would meet it (http:// moved to https://,
    a login page): it is no answer (the run stops after enough alike, `Shard._note_failure`,
    instead of dead-lettering every item), and its sentence names where it leads, without the
    query (a login page's return address, a session) and with any password masked. But a 307
    is a load balancer draining a replica: ten of a first burst stopped a run the next
    requests were served in, so it is retried as any failure."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, headers={"Location": location}, text="moved")

    out = run(one(handler))
    assert (out.status, out.http_status) == ("protocol_error", status)
    assert out.not_an_answer == (status != 307)
    assert out.error == (f"unexpected HTTP {status}, a redirect to {shown} that is not "
                         "followed: moved")


def test_connection_dropped_mid_stream() -> None:
    """A connection aborted in the middle of the body is conn_reset, not a hang."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await cut_after_one_token(request)

    out = run(one(handler))
    assert out.status == "conn_reset" and out.wasted_tokens == 1


def test_done_without_end_of_body_is_still_ok() -> None:
    """After [DONE] the attempt is ok even if the server never ends the body (it is dropped)."""
    timeouts = Timeouts(connect_s=1.0, first_token_s=1.0, idle_s=0.2, total_s=5.0)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(sse(chat("a")) + sse(b"[DONE]"))
        await asyncio.sleep(30)
        return resp

    out = run(one(handler, timeouts))
    assert out.status == "ok" and out.error is None and out.text == "a"
    assert out.last_token_at is not None and out.ended_at - out.last_token_at < 1.0


def test_unparseable_json_is_protocol_error() -> None:
    """A data payload that is not JSON is a protocol_error naming the payload."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(sse(chat("a")) + b"data: {not json\n\n" + sse(b"[DONE]"))
        return resp

    out = run(one(handler))
    assert out.status == "protocol_error" and out.error is not None
    assert out.error.endswith("after 1 token: {not json")


@pytest.mark.parametrize(("payload", "status", "said"), [
    (b"", "protocol_error", "unparseable stream data after 1 token: (an empty data line)"),
    (b'{"error": {"code": 503}}', "http_5xx", "error 503 in stream after 1 token: (no message)"),
    (b'{"error": {"message": ""}}', "protocol_error",
     "error in stream after 1 token: (an empty message)"),
])  # fmt: skip
def test_a_failure_with_nothing_to_quote_says_so(payload: bytes, status: str, said: str) -> None:
    """An empty data line, an error with no message: the sentence ended in ": " or ": None"."""
    out = run(one(streaming(chat("a"), payload, b"[DONE]")))
    assert (out.status, out.error) == (status, said)


HOSTILE = "bad \x1b[31mred\x1b]0;title\x07 \x9b2J\x7f end"
"""Terminal escapes: a colour, a window title ended by BEL, an 8-bit CSI, DEL."""
HOSTILE_SHOWN = "bad \\x1b[31mred\\x1b]0;title\\x07 \\x9b2J\\x7f end"


def test_a_servers_escape_sequences_do_not_reach_the_terminal() -> None:
    """A server's message goes into the error sentence, and from the events to the summary on
    a terminal, where its escape sequences acted (colours, the title; the clipboard for some
    terminals): its control characters are shown as \\xNN, in an error body and in a stream."""

    async def refused(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": HOSTILE}}, status=400)

    out = run(one(refused))
    assert out.error == f"HTTP 400: {HOSTILE_SHOWN}"
    out = run(one(streaming(chat("a"), {"error": {"message": HOSTILE}})))
    assert out.error == f"error in stream after 1 token: {HOSTILE_SHOWN}"


ECHOED_KEY = "sk-echoed-KEY-0123456789abcdef"
ECHOED_SECRET = "X-Api-Key-value-7777"


def _echo(said: str) -> web.StreamResponse:
    return web.json_response({"error": {"message": said}}, status=401)


def _echo_code(said: str) -> web.StreamResponse:
    return web.json_response({"error": {"message": "bad", "code": said}}, status=400)


def _echo_page(said: str) -> web.StreamResponse:
    return web.Response(text=f"<html><title>No entry for {said}</title></html>", status=403,
                        content_type="text/html")


def _echo_text(said: str) -> web.StreamResponse:
    return web.Response(text=f"hello {said}", content_type="text/plain")


def _echo_redirect(said: str) -> web.StreamResponse:
    return web.Response(status=302, headers={"Location": f"http://portal.example/{said}"})


def _echo_long(said: str) -> web.StreamResponse:
    # the key across the end of the clipped message: no piece of it may stay
    return web.json_response({"error": {"message": "x" * (MSG_MAX - 10) + said}}, status=400)


@pytest.mark.parametrize("reply", [_echo, _echo_code, _echo_page, _echo_text, _echo_redirect,
                                   _echo_long, "in stream"])
def test_a_key_the_server_quotes_back_is_masked(reply: Callable[[str], web.StreamResponse] | str
                                                ) -> None:
    """A server that quotes the request's credentials back ("Incorrect API key provided:
    sk-..."), in an error body, its code, a page's title, a text, a redirect's target or an
    error inside the stream: the key and every secret header's value are masked in the error
    sentence, which goes to the event log, the dead letters and the terminal."""

    async def handler(request: web.Request) -> web.StreamResponse:
        said = f"{request.headers['Authorization']} and {request.headers['X-Api-Key']}"
        if callable(reply):
            return reply(said)
        resp = await open_stream(request)
        await resp.write(sse({"error": {"message": said, "code": said}}))
        return resp

    headers = request_headers(ECHOED_KEY, "Authorization", {"X-Api-Key": ECHOED_SECRET})
    out = run(one(handler, headers=headers))
    shown = f"{out.error} {out.error_code}"
    assert out.status != "ok" and "***" in shown, shown
    for secret in (ECHOED_KEY, ECHOED_SECRET):
        assert secret[:6] not in shown and secret[-6:] not in shown, shown


@pytest.mark.parametrize(("status", "cut"), [(200, client_module._SAID_READ),
                                             (401, client_module._ERROR_BODY_MAX)])
def test_a_key_across_the_cut_of_a_text_body_shows_no_piece(status: int, cut: int) -> None:
    """A plain text body is read only so far (a 2xx's to `_SAID_READ` bytes, an error's to
    `_ERROR_BODY_MAX`), and blanks fold in the message: a key the cut split, after a run of
    blanks, showed its first half, as masking finds only whole keys."""
    body = "said" + " " * (cut - 4 - len(ECHOED_KEY) // 2) + ECHOED_KEY + " after"
    assert body.index(ECHOED_KEY) < cut < body.index(ECHOED_KEY) + len(ECHOED_KEY)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text=body, status=status, content_type="text/plain")

    out = run(one(handler, headers=request_headers(ECHOED_KEY, "Authorization", {})))
    assert out.status != "ok" and "said" in str(out.error), out.error
    assert ECHOED_KEY[:4] not in str(out.error), out.error


@pytest.mark.parametrize(("status", "cut"), [(200, client_module._SAID_READ),
                                             (401, client_module._ERROR_BODY_MAX)])
def test_a_key_the_cut_of_a_text_body_ends_on_is_masked_whole(status: int, cut: int) -> None:
    """A key whose last character is its first, ending exactly where a plain text body's read
    stops: taken for a piece of itself cut short, its last character was dropped and the rest,
    no whole key any more, was shown unmasked."""
    key = "sk-cut-end-0123456789abcdefs"
    body = "said" + " " * (cut - 4 - len(key)) + key + " after"
    assert body[:cut].endswith(key)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text=body, status=status, content_type="text/plain")

    out = run(one(handler, headers=request_headers(key, "Authorization", {})))
    assert out.status != "ok" and "said" in str(out.error), out.error
    assert key[:-1] not in str(out.error) and "***" in str(out.error), out.error


def test_every_credential_a_request_carries_is_masked_in_messages() -> None:
    """The key in a header of any name, a secret header's value, the user and password of the
    base URL, the Basic credentials aiohttp makes of them and its query's credential-named
    values, a proxy's, and params named so at any depth (a gateway may read the key from the
    body): none shows in a message a server's text is quoted in, nor a piece of one that holds
    another. A short word ("Basic", a test's "k") is left."""
    headers = request_headers("plain-header-key-1", "X-Plain", {"Cookie": "sid=cookie-value-2",
                                                               "X-Org": "acme-corp-org",
                                                               "X-Token": "plain-header"})
    base = "http://url-user-3:url-pass-4%21@127.0.0.1:9/v1?api_key=query-key-5&a=plain-value-6"
    StreamingClient(SimpleNamespace(), base, "chat", headers, FAST, Clock(),  # type: ignore[arg-type]
                    proxy="http://127.0.0.1:9", proxy_authorization="Basic cHJveHktYXV0aC01",
                    params={"api_key": "body-key-7", "user": "body-user-9",
                            "extra_body": {"items": [{"token": "body-token-8"}]}})
    basic = base64.b64encode(b"url-user-3:url-pass-4!").decode()  # as aiohttp sends them
    said = clip(f"Basic k: plain-header-key-1 sid=cookie-value-2 url-user-3 url-pass-4! "
                f"{basic} cHJveHktYXV0aC01 query-key-5 body-key-7 body-token-8 acme-corp-org "
                "plain-value-6 body-user-9")
    assert said == ("Basic k: *** *** *** *** *** *** *** *** *** acme-corp-org plain-value-6 "
                    "body-user-9")


def test_stall_mid_stream_is_timeout_idle_and_pool_stays_clean() -> None:
    """A stall mid-stream is timeout_idle after ~idle_s; the next attempt opens a new connection."""
    timeouts = Timeouts(connect_s=1.0, first_token_s=1.0, idle_s=0.2, total_s=5.0)
    calls = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls > 1:
            return await normal_chat(request)
        resp = await open_stream(request)
        await resp.write(sse(chat("a")) + sse(chat("b")))
        await asyncio.sleep(30)
        return resp

    async def go() -> tuple[AttemptOutcome, AttemptOutcome, float]:
        async with serve(handler, timeouts) as client:
            t0 = time.monotonic()
            stalled = await client.attempt(BODY)
            return stalled, await client.attempt(BODY), time.monotonic() - t0

    stalled, after, elapsed = run(go())
    assert stalled.status == "timeout_idle" and stalled.wasted_tokens == 2
    assert stalled.error == "no data for 0.2 s after 2 tokens"
    assert stalled.last_token_at is not None and elapsed < 3.0
    assert 0.2 <= stalled.ended_at - stalled.last_token_at < 1.0
    assert after.status == "ok" and after.conn_reused is False


def test_deadlines_hold_after_the_client_sat_idle() -> None:
    """The client's watchdog stops while no attempt is under way and starts again with the next:
    a stall after an idle spell still ends in timeout_idle, next to an attempt that succeeds."""
    timeouts = Timeouts(connect_s=1.0, first_token_s=1.0, idle_s=0.2, total_s=5.0)

    async def handler(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stall"):
            resp = await open_stream(request)
            await resp.write(sse(chat("a")))
            await asyncio.sleep(30)
            return resp
        return await normal_chat(request)

    async def go() -> list[AttemptOutcome]:
        async with serve(handler, timeouts) as client:
            first = await client.attempt(BODY)
            await asyncio.sleep(3 * SWEEP_S)  # nothing under way: the watchdog has stopped
            stalled, ok = await asyncio.gather(client.attempt({**BODY, "stall": True}),
                                               client.attempt(BODY))
            return [first, stalled, ok]

    first, stalled, ok = run(go())
    assert (first.status, ok.status) == ("ok", "ok")
    assert stalled.status == "timeout_idle" and stalled.error == "no data for 0.2 s after 1 token"
    assert stalled.last_token_at is not None
    assert 0.2 <= stalled.ended_at - stalled.last_token_at < 1.0


def test_an_expiry_that_raises_spares_no_other_attempt_and_stops_no_sweep() -> None:
    """Attempts past their deadlines in one sweep are each expired, even when one expiry
    raises (it is reported to the loop's handler, as a failing callback is), and the
    watchdog goes on looking at the rest."""

    class Due:
        def __init__(self, deadline: float, fails: bool) -> None:
            self.deadline, self.fails, self.expired = deadline, fails, 0

        def expire(self, _now: float) -> None:
            self.expired += 1
            if self.fails:
                raise RuntimeError("this Timeout is not entered")

    async def go() -> tuple[list[Due], list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        dog = Watchdog(loop)
        now = loop.time()
        due = [Due(now, fails=True), Due(now, fails=True), Due(now, fails=False),
               Due(now + 2 * SWEEP_S, fails=False), Due(now + 60, fails=False)]
        for attempt in due:
            dog.watch(attempt)  # type: ignore[arg-type]  # stands in for an Attempt
        await asyncio.sleep(4 * SWEEP_S)
        return due, reported

    due, reported = run(go())
    assert [attempt.expired for attempt in due] == [1, 1, 1, 1, 0]
    assert [str(c["exception"]) for c in reported] == ["this Timeout is not entered"] * 2


@pytest.mark.parametrize("send_headers", [True, False])
def test_no_first_token_is_timeout_first_token(send_headers: bool) -> None:
    """No token within first_token_s after connecting (headers sent or not) times out."""
    timeouts = Timeouts(connect_s=1.0, first_token_s=0.3, idle_s=0.05, total_s=5.0)

    async def handler(request: web.Request) -> web.StreamResponse:
        if send_headers:
            resp = await open_stream(request)
            for _ in range(100):  # keep-alives do not count as tokens
                await resp.write(b": ping\n\n" + sse(chat("")))
                await asyncio.sleep(0.02)
        await asyncio.sleep(30)
        return web.Response()

    out = run(one(handler, timeouts))
    assert out.status == "timeout_first_token" and out.first_token_at is None
    assert out.error == "no token for 0.3 s after the connection was ready"
    assert out.conn_ready_at is not None and 0.3 <= out.ended_at - out.conn_ready_at < 1.5
    assert out.http_status == (200 if send_headers else None)


def test_total_timeout_wins_over_trickle() -> None:
    """A server that keeps trickling tokens past total_s ends as timeout_total."""
    timeouts = Timeouts(connect_s=1.0, first_token_s=1.0, idle_s=1.0, total_s=0.4)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for _ in range(200):
            await resp.write(sse(chat("t")))
            await asyncio.sleep(0.02)
        return resp

    out = run(one(handler, timeouts))
    assert out.status == "timeout_total" and out.content_chunks > 3
    assert out.error is not None and out.error.startswith("attempt exceeded 0.4 s after ")
    assert out.ended_at - out.started_at < 1.5


def test_pool_wait_counts_as_connect_timeout() -> None:
    """With cap=1 and the only connection stalled, a second attempt hits timeout_connect."""
    timeouts = Timeouts(connect_s=0.2, first_token_s=2.0, idle_s=2.0, total_s=5.0)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await asyncio.sleep(30)
        return resp

    async def go() -> AttemptOutcome:
        async with serve(handler, timeouts, cap=1) as client:
            holder = asyncio.create_task(client.attempt(BODY))
            await asyncio.sleep(0.05)
            out = await client.attempt(BODY)
            holder.cancel()
            with pytest.raises(asyncio.CancelledError):
                await holder
            return out

    out = run(go())
    assert out.status == "timeout_connect" and out.conn_ready_at is None
    assert out.error == "no connection within 0.2 s"


def test_connection_refused() -> None:
    """A closed port is conn_reset with 'refused' in the error, quickly and without raising."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()

    async def go() -> AttemptOutcome:
        session = make_session(2, FAST)
        try:
            client = StreamingClient(session, f"http://127.0.0.1:{port}/v1", "chat", {}, FAST,
                                     Clock())  # fmt: skip
            return await client.attempt(BODY)
        finally:
            await session.close()

    out = run(go())
    assert out.status == "conn_reset" and out.http_status is None
    assert out.error == f"connection refused by 127.0.0.1:{port}"
    assert out.conn_ready_at is None and out.ended_at - out.started_at < 1.0


def test_cancellation_propagates() -> None:
    """Cancelling an attempt raises CancelledError in the caller; it is not an outcome."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await asyncio.sleep(30)
        return resp

    async def go() -> None:
        async with serve(handler) as client:
            task = asyncio.create_task(client.attempt(BODY))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(go())


def test_callback_errors_reach_the_caller() -> None:
    """An OSError raised by a caller's callback propagates; it is not reported as conn_reset."""

    def boom(t: float) -> None:
        raise OSError(28, "No space left on device")

    async def go() -> None:
        async with serve(normal_chat) as client:
            with pytest.raises(OSError, match="No space left"):
                await client.attempt(BODY, on_first_token=boom)
            out = await client.attempt(BODY)  # the dropped stream did not poison the pool
            assert out.status == "ok"

    run(go())


def test_conn_ready_reported_when_attempt_fails_before_headers() -> None:
    """on_conn_ready still fires (once) when the attempt times out before response headers."""
    timeouts = Timeouts(connect_s=1.0, first_token_s=0.2, idle_s=1.0, total_s=5.0)
    calls: list[bool] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response()

    async def go() -> AttemptOutcome:
        async with serve(handler, timeouts) as client:
            return await client.attempt(BODY, on_conn_ready=lambda t, r: calls.append(r))

    out = run(go())
    assert out.status == "timeout_first_token" and calls == [False]


def test_timeouts_validated() -> None:
    """Non-positive or non-finite timeouts are rejected with the field's name."""
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="idle_s"):
            Timeouts(idle_s=bad)


# -- connection stamping: new or pooled, and when -----------------------------------------------


def test_concurrent_attempts_open_new_connections_then_reuse_them() -> None:
    """Three attempts in flight at once each open a connection, stamped on their own attempt; the
    next three take those three from the pool."""
    arrived = 0
    gate = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal arrived
        arrived += 1
        if arrived == 3:
            gate.set()
        await gate.wait()  # hold all three open: none can reuse another's connection
        return await normal_chat(request)

    async def go() -> tuple[list[AttemptOutcome], list[AttemptOutcome], list[bool]]:
        calls: list[bool] = []
        async with serve(handler, cap=3) as client:
            rounds = []
            for _ in range(2):
                rounds.append(await asyncio.gather(*(client.attempt(
                    BODY, on_conn_ready=lambda t, reused: calls.append(reused))
                    for _ in range(3))))  # fmt: skip
        return rounds[0], rounds[1], calls

    first, second, calls = run(go())
    assert [o.status for o in first + second] == ["ok"] * 6
    assert [o.conn_reused for o in first] == [False] * 3
    assert [o.conn_reused for o in second] == [True] * 3
    assert sorted(calls) == [False] * 3 + [True] * 3  # once per attempt
    for o in first + second:
        assert o.conn_ready_at is not None and o.first_token_at is not None
        assert o.started_at <= o.conn_ready_at <= o.first_token_at


def test_retry_after_dropped_connection_reports_a_new_connection() -> None:
    """A pooled connection the server drops mid-stream is conn_reset (and was reused); the retry
    on the same session opens a new one and says so: the dead one never went back to the pool."""
    calls = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls != 2:
            return await normal_chat(request)
        return await cut_after_one_token(request)

    async def go() -> list[AttemptOutcome]:
        async with serve(handler) as client:
            return [await client.attempt(BODY) for _ in range(3)]

    opened, dropped, retried = run(go())
    assert (opened.status, opened.conn_reused) == ("ok", False)
    assert (dropped.status, dropped.conn_reused) == ("conn_reset", True)
    assert (retried.status, retried.conn_reused) == ("ok", False)


def test_connection_close_response_is_not_reused() -> None:
    """After a response with `Connection: close` the next attempt reports a new connection."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.force_close()
        await resp.prepare(request)
        await resp.write(sse(chat("a")) + sse(b"[DONE]"))
        return resp

    async def go() -> list[AttemptOutcome]:
        async with serve(handler) as client:
            return [await client.attempt(BODY) for _ in range(2)]

    outs = run(go())
    assert [(o.status, o.conn_reused) for o in outs] == [("ok", False), ("ok", False)]


def test_session_without_stamping_connector_falls_back_to_headers() -> None:
    """On a plain aiohttp session the connection counts as ready at the response headers:
    conn_reused is None, and on_conn_ready still fires once, before the first token."""
    calls: list[tuple[str, object]] = []

    async def go() -> AttemptOutcome:
        async with serve(normal_chat, plain=True) as client:
            return await client.attempt(
                BODY,
                on_conn_ready=lambda t, reused: calls.append(("conn", reused)),
                on_first_token=lambda t: calls.append(("first", t)),
            )

    out = run(go())
    assert out.status == "ok" and out.conn_reused is None and out.conn_ready_at is not None
    assert out.first_token_at is not None and out.conn_ready_at <= out.first_token_at
    assert calls == [("conn", False), ("first", out.first_token_at)]


def test_conn_ready_callback_runs_outside_the_connector() -> None:
    """on_conn_ready never runs inside a connector's connect() (a callback raising there would
    leak the connection); a raising callback reaches the caller and the pool stays usable."""
    stacks: list[list[str]] = []

    def record(t: float, reused: bool) -> None:
        stacks.append([f.name for f in traceback.extract_stack()])

    def boom(t: float, reused: bool) -> None:
        raise OSError(28, "No space left on device")

    async def go() -> list[AttemptOutcome]:
        async with serve(normal_chat, cap=1) as client:
            outs = [await client.attempt(BODY, on_conn_ready=record)]
            with pytest.raises(OSError, match="No space left"):
                await client.attempt(BODY, on_conn_ready=boom)
            outs.append(await client.attempt(BODY, on_conn_ready=record))
            return outs

    outs = run(go())
    assert [o.status for o in outs] == ["ok", "ok"] and len(stacks) == 2
    assert all("attempt" in names and "connect" not in names for names in stacks)


def test_current_attempt_is_visible_only_during_the_attempt() -> None:
    """The context variable the connector reads is unset before and after every attempt, also
    after one that failed to connect, so a later request outside `attempt` stamps nothing."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed_port = sock.getsockname()[1]
    sock.close()
    seen: list[object] = []

    async def go() -> None:
        async with serve(normal_chat) as client:
            seen.append(CURRENT.get())
            await client.attempt(BODY, on_conn_ready=lambda t, r: seen.append(CURRENT.get()))
            seen.append(CURRENT.get())
            refused = StreamingClient(client._session, f"http://127.0.0.1:{closed_port}/v1",
                                      "chat", {}, FAST, Clock())  # fmt: skip
            assert (await refused.attempt(BODY)).status == "conn_reset"
            seen.append(CURRENT.get())

    run(go())
    assert seen[0] is None and isinstance(seen[1], Attempt) and seen[2:] == [None, None]


def test_multibyte_text_split_across_writes_arrives_intact() -> None:
    """A stream written one byte per write (splitting every UTF-8 character between reads) gives
    the same text as one written whole."""
    pieces = ["é", "世界", "🙂", " ok"]
    raw = b"".join(sse(chat(p)) for p in pieces) + sse(b"[DONE]")

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        for i in range(len(raw)):
            await resp.write(raw[i : i + 1])
            if raw[i] >= 0x80:
                await asyncio.sleep(0.001)  # let the client read the half character alone
        return resp

    out = run(one(handler))
    assert (out.status, out.text, out.content_chunks) == ("ok", "é世界🙂 ok", 4)


# -- per-read timing: the chunks of one read share its timestamp ---------------------------------


async def _attempt() -> Attempt:
    return Attempt("chat", Clock(), FAST, asyncio.timeout(None), None,
                   Watchdog(asyncio.get_running_loop()))


_GAP = st.one_of(st.just(0.0), st.floats(0.0, 1e-6), st.floats(1e-6, 2.0))
_READ = st.tuples(st.lists(st.sampled_from(["a", "", None, "é🙂"]), max_size=6), _GAP)


@settings(max_examples=150, deadline=None)
@given(st.lists(_READ, max_size=8))
def test_batched_itl_equals_chunk_by_chunk(reads: list[tuple[list[str | None], float]]) -> None:
    """Recording a read's content chunks at once (one gap from the previous token, the rest 0 in
    one update) gives exactly the histogram, times, count and text of recording them one by one
    at the read's timestamp."""
    attempt = asyncio.run(_attempt())  # the constructor needs a running loop; `take` does not
    expect, first, last, text, now = ItlHistogram(), None, None, "", 1000.0
    for contents, gap in reads:
        now += gap
        if contents:
            assert attempt.take([orjson.dumps(chat(c)) for c in contents], now) is False
        for c in contents:
            if c:
                if last is None:
                    first = now
                else:
                    expect.add(now - last)
                last, text = now, text + c
    out = attempt.finish()
    assert out.itl == expect and out.itl.count == expect.count
    assert (out.first_token_at, out.last_token_at, out.text) == (first, last, text)
    assert out.content_chunks == len([c for contents, _ in reads for c in contents if c])


@pytest.mark.parametrize(
    ("os_error", "expected"),
    [(socket.gaierror(-2, "Name or service not known"),
      "cannot resolve nowhere.invalid: Name or service not known"),
     (ConnectionRefusedError(111, "Connect call failed"),
      "connection refused by nowhere.invalid:443"),
     (OSError(113, "No route to host"), "cannot connect to nowhere.invalid:443: No route to host")],
)  # fmt: skip
def test_connector_errors_described(os_error: OSError, expected: str) -> None:
    """DNS failures read as such on every aiohttp from 3.9 (a gaierror inside a connector error
    there, ClientConnectorDNSError from 3.10.10); refusals and other errors are told apart."""
    key = SimpleNamespace(host="nowhere.invalid", port=443, ssl=True)
    exc = aiohttp.ClientConnectorError(key, os_error)  # type: ignore[arg-type]
    assert _describe(exc, 0) == ("conn_reset", expected)


def test_the_path_goes_before_the_base_urls_query() -> None:
    """A base URL with a query (Azure OpenAI's `?api-version=`) keeps it at the end."""
    assert endpoint_url("https://h/v1", "/chat/completions") == "https://h/v1/chat/completions"
    assert endpoint_url("https://h/v1/", "/completions") == "https://h/v1/completions"
    assert endpoint_url("https://r.openai.azure.com/openai/deployments/d?api-version=2024-10-21",
                        "/chat/completions") == (
        "https://r.openai.azure.com/openai/deployments/d/chat/completions?api-version=2024-10-21")
    assert endpoint_url("http://u:p@h:8000", "/completions") == "http://u:p@h:8000/completions"


def test_a_url_credential_is_masked_as_sent_and_as_decoded() -> None:
    """A server may quote the URL back as sent: a query value with a '+' (decoded as a space,
    so left as two short words) or percent escapes, or a path parameter (`/v1;token=...`),
    which `masked_url` hides too, was shown whole."""
    base = ("http://127.0.0.1:9/v1;token=path-secret-11?code=AbCd/Ef+Gh==&key=qk+1%2B2%3D3456"
            "&a=b")
    StreamingClient(SimpleNamespace(), base, "chat", {}, FAST, Clock())  # type: ignore[arg-type]
    said = clip("POST /v1;token=path-secret-11?code=AbCd/Ef+Gh==&key=qk+1%2B2%3D3456 "
                "path-secret-11 AbCd/Ef+Gh== qk+1+2=3456")
    assert said == "POST /v1;***?code=***&key=*** *** *** ***", said


def test_a_credential_an_earlier_test_sent_is_no_secret_here() -> None:
    """Runs after `test_a_url_credential_is_masked_as_sent_and_as_decoded` (file order): what a
    client of another test sent is an ordinary word here, as it is in another run's process."""
    assert clip("path-secret-11") == "path-secret-11"
