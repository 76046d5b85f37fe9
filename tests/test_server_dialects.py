"""How real OpenAI-compatible servers differ from OpenAI's own stream, over loopback HTTP.

Each test serves one server's way of answering (as its source or documents show it) and checks
what shardrun makes of it: the output, the usage, the finish_reason, the status that decides a
retry and the error sentence. Cases the other test files already hold are not repeated here.
"""

import asyncio
import gzip
import os
import subprocess
import sys
import zlib
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import http_parser, web
from aiohttp.test_utils import TestServer

from shardrun import protocol
from shardrun._chunks import MORE, ChunkReader
from shardrun.client import AttemptOutcome, StreamingClient, make_session
from shardrun.clock import Clock
from shardrun.items import Api
from shardrun.retry import Retrier, RetryPolicy
from shardrun.shard import (
    ABANDON,
    REFUSED_ALIKE_AFTER,
    Shard,
    ShardConfig,
    credentials_fix,
    done_message,
)
from tests.test_client import (
    BODY,
    FAST,
    chat,
    one,
    open_stream,
    run,
    sse,
    streaming,
    whole_answer,
)

pytestmark = pytest.mark.timeout(30)


def test_llama_cpp_error_event_is_a_failure_not_an_empty_success() -> None:
    """llama.cpp reports a failure inside a stream as an `error:` event (not `data:`), then ends
    the stream with `data: [DONE]` as usual: the attempt fails with the server's words, classed
    by its code (a prompt over the context size, 400: not retried), and is no empty success."""
    err = {"code": 400, "message": "the request exceeds the available context size, try "
                                   "increasing it", "type": "exceed_context_size_error"}

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request, Server="llama.cpp")
        await resp.write(b"error: " + orjson.dumps(err) + b"\n\n" + sse(b"[DONE]"))
        return resp

    out = run(one(handler))
    assert (out.status, out.http_status, out.text) == ("http_4xx", 200, "")
    assert out.error == ("error 400 in stream after 0 tokens: the request exceeds the available "
                         "context size, try increasing it")
    assert out.error_code == "400"


@pytest.mark.parametrize("event", [
    b'error: {"code":500,"message":"decode failed","type":"server_error"}\n\n',  # llama.cpp
    # A gateway's: an event named error, its data the error itself (no `error` member). Read as
    # a chunk with no choices, it was skipped: the cut answer reached [DONE] as a success.
    b'event: error\r\ndata: {"message":"decode failed","code":500}\r\n\r\n',
])  # fmt: skip
def test_an_error_event_midway_fails_the_answer(event: bytes) -> None:
    """An error event after some tokens, then the stream's usual end: the attempt fails with
    the error's words, classed by its code, and the text so far is wasted."""

    async def midway(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(sse(chat("a")) + sse(chat("b")))
        await asyncio.sleep(0.01)
        await resp.write(event + sse(b"[DONE]"))
        return resp

    out = run(one(midway))
    assert (out.status, out.text, out.wasted_tokens) == ("http_5xx", "ab", 2)
    assert out.error == "error 500 in stream after 2 tokens: decode failed"


@pytest.mark.parametrize(("code", "status", "words"), [
    (None, "protocol_error", "error in stream after 1 token: boom"),
    ("rate_limit_exceeded", "http_429", "error rate_limit_exceeded in stream after 1 token: boom"),
])  # fmt: skip
def test_a_flat_error_event_framed_as_one_is_named_by_its_code(code: str | None, status: str,
                                                               words: str) -> None:
    """OpenAI Responses' error event, `{"type": "error", "code", "message", ...}`, sent after
    `event: error` (as vLLM frames every event): its `type` names the event, not the error.
    It was read as the error's name: error_code 'error', 'error error in stream ...: boom'."""
    text = {"type": "response.output_text.delta", "item_id": "m", "output_index": 0,
            "content_index": 0, "delta": "a"}
    error = {"type": "error", "code": code, "message": "boom", "param": None,
             "sequence_number": 2}
    out = run(one(streaming(text, error, events=True), api="responses"))
    assert (out.status, out.text, out.error, out.error_code) == (status, "a", words, code)


@pytest.mark.parametrize(("kind", "status"), [
    ("validation", "http_4xx"),  # a prompt the server refuses: the same request meets the same
    ("generation", "http_5xx"),  # a fault while generating: retried
    ("overloaded", "http_5xx"),  # its queue is full: retried
    ("something_new", "protocol_error"),  # a kind not known here: retried as a protocol error
])  # fmt: skip
def test_tgi_error_kind_decides_as_an_error_type(kind: str, status: str) -> None:
    """Text Generation Inference reports an error as a bare message with its kind beside it,
    `{"error": "...", "error_type": "validation"}`, inside a stream (here after one token) as in
    an error body: the kind decides the status as OpenAI's error type does (every such error
    was a protocol_error, retried, a refused prompt included) and is the error's name."""
    err = {"error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096",
           "error_type": kind}

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request, Server="text-generation-inference")
        await resp.write(sse(chat("a")) + sse(err))
        return resp

    out = run(one(handler))
    assert (out.status, out.http_status, out.error_code) == (status, 200, kind)
    assert out.error == f"error {kind} in stream after 1 token: {err['error']}"
    out = _refused(422, err)
    assert (out.status, out.error_code) == ("http_4xx", kind)
    assert out.error == f"HTTP 422: {err['error']}"


@pytest.mark.parametrize(("code", "status"), [
    ("\u00b2", "protocol_error"),  # a digit to str.isdigit, not to int(): it raised
    ("9" * 5000, "protocol_error"),  # more digits than int() converts: it raised
    ("503", "http_5xx"),  # a status as a digit string still decides
])  # fmt: skip
def test_an_error_code_that_is_no_number_ends_the_attempt_not_the_run(code: str,
                                                                      status: str) -> None:
    """A hostile or broken server's error code inside a 2xx body: a ValueError raised out of
    the attempt stopped the shard, and the run with it. It is a failure with one short
    sentence, and so is the same error as the whole body."""
    err = {"error": {"code": code, "message": "boom"}}
    for handler, tokens in ((streaming(chat("a"), err, b"[DONE]"), 1),
                            (whole_answer(orjson.dumps(err)), 0)):
        out = run(one(handler))
        assert out.status == status and out.error is not None and len(out.error) < 300
        assert out.error.endswith(f"in stream after {tokens} token{'s' * (tokens != 1)}: boom")
        assert out.error_code is not None and len(out.error_code) <= 200


@pytest.mark.parametrize(("headers", "asked"), [
    ({"retry-after-ms": "2500"}, "2.5"),  # OpenAI's
    ({"Retry-After": "1", "retry-after-ms": "1500"}, "1.5"),  # the longer ask wins
    ({"x-ms-retry-after-ms": "4000"}, "4"),  # Azure OpenAI's
])  # fmt: skip
def test_a_429_asking_in_milliseconds_is_waited_out(headers: dict[str, str], asked: str) -> None:
    """A 429 that asks for its wait in milliseconds: the attempt records it as seconds, and the
    retry waits at least that long (before, the ask was unread and the retry came on backoff's
    fraction of a second)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = {"error": {"message": "Rate limit reached for requests", "type": "requests",
                          "code": "rate_limit_exceeded"}}
        return web.json_response(body, status=429, headers=headers)

    out = run(one(handler))
    assert (out.status, out.retry_after) == ("http_429", asked)
    assert out.error == "HTTP 429: Rate limit reached for requests"
    decision = Retrier(RetryPolicy(backoff_s=0.01, backoff_max_s=0.01)).decide(
        out.status, out.http_status, 1, out.retry_after, out.rate_headers)
    assert (decision.retry, decision.why, decision.wait) == (True, "server", float(asked))



@pytest.mark.parametrize("skew_s", [3600.0, -3600.0, 0.0])
def test_a_retry_after_date_is_read_on_the_servers_clock(skew_s: float) -> None:
    """A 429 whose Retry-After is an HTTP-date, 30 s after its own Date header, from a server
    whose clock is an hour ahead of this machine's, an hour behind, or right: the retry waits
    the 30 s it asked for (RFC 9110 lets a client read the date against the response's Date).
    Read against this machine's clock, the server ahead asked 3630 s (past
    `max_server_wait_s`: the item was dead-lettered) and the one behind none at all."""
    server_now = datetime.now(UTC) + timedelta(seconds=skew_s)
    headers = {"Date": format_datetime(server_now, usegmt=True),
               "Retry-After": format_datetime(server_now + timedelta(seconds=30), usegmt=True)}

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "slow down"}}, status=429,
                                 headers=headers)

    out = run(one(handler))
    assert (out.status, out.retry_after) == ("http_429", "30")
    decision = Retrier(RetryPolicy(backoff_s=0.01, backoff_max_s=0.01)).decide(
        out.status, out.http_status, 1, out.retry_after, out.rate_headers)
    assert (decision.retry, decision.why, decision.wait) == (True, "server", 30.0)


def test_a_retry_after_date_without_a_valid_date_header_is_read_on_this_clock() -> None:
    """Without a Date header to read it against (or with one that is no date), a Retry-After
    date stands as sent, and the wait is counted from this machine's clock, as before."""
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    for date in (b"", b"Date: yesterday\r\n"):
        out = run(_raw_attempt([b"HTTP/1.1 429 Too Many Requests\r\n" + date
                                + b"Retry-After: " + later.encode() + b"\r\n"
                                b"Content-Length: 0\r\n\r\n"]))
        assert (out.status, out.retry_after) == ("http_429", later)
        assert Retrier(RetryPolicy()).decide(out.status, out.http_status, 1, out.retry_after,
                                             out.rate_headers).why == "server"


@pytest.mark.parametrize("date", ["Thu, 01 Jan 1970 00:00:00 GMT",
                                  "Fri, 01 Jan 2100 00:00:00 GMT"])
def test_a_retry_after_date_beside_an_implausible_date_header_is_read_on_this_clock(
        date: str) -> None:
    """A server whose clock says 1970 (or 2100) and a Retry-After 30 s after this machine's
    clock: the wait is about 30 s, read on this machine's clock. Read against that Date it
    was decades (1.79e9 s from 1970: past `max_server_wait_s`, the item dead-lettered) or
    none at all."""
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "slow down"}}, status=429,
                                 headers={"Date": date, "Retry-After": later})

    out = run(one(handler))
    assert (out.status, out.retry_after) == ("http_429", later)
    decision = Retrier(RetryPolicy(backoff_s=0.01, backoff_max_s=0.01)).decide(
        out.status, out.http_status, 1, out.retry_after, out.rate_headers)
    assert (decision.retry, decision.why) == (True, "server")
    assert 20.0 <= decision.wait <= 30.0  # HTTP-dates are whole seconds; the test took some


@pytest.mark.parametrize("header", ["Retry-After", "Date"])
def test_a_date_past_any_calendar_is_no_date_not_a_traceback(header: str) -> None:
    """A 429 whose Retry-After or Date says the year 99999999999: Python's date parser raises
    OverflowError there, which escaped the attempt as a traceback. It is no date: an http_429
    retried on backoff (a Retry-After), or its Retry-After read on this machine's clock (a
    Date)."""
    huge = b"Wed, 21 Oct 99999999999 07:28:00 GMT"
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True).encode()
    lines = {b"Retry-After": huge} if header == "Retry-After" else {b"Date": huge,
                                                                   b"Retry-After": later}
    sent = b"".join(k + b": " + v + b"\r\n" for k, v in lines.items())
    out = run(_raw_attempt([b"HTTP/1.1 429 Too Many Requests\r\n" + sent
                            + b"Content-Length: 0\r\n\r\n"]))
    assert (out.status, out.retry_after) == ("http_429", lines[b"Retry-After"].decode())
    decision = Retrier(RetryPolicy(backoff_s=0.01, backoff_max_s=0.01)).decide(
        out.status, out.http_status, 1, out.retry_after, out.rate_headers)
    assert decision.retry
    assert decision.why == ("server" if header == "Date" else "backoff")


@pytest.mark.parametrize("stream", [False, True])
def test_a_gzip_compressed_answer_is_read(stream: bool) -> None:
    """A gateway that compresses its answer (Content-Encoding: gzip): a whole JSON answer to a
    streaming request (a server that ignores `stream`), and an event stream, both read as sent
    uncompressed."""
    answer = {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
              "message": {"role": "assistant", "content": "compressed hi"}}],
              "usage": {"prompt_tokens": 2, "completion_tokens": 2}}  # fmt: skip
    events = sse(chat("compressed")) + sse(chat(" hi")) + sse(chat(None, "stop")) + sse(
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}) + sse(b"[DONE]")
    body = events if stream else orjson.dumps(answer)

    async def handler(request: web.Request) -> web.StreamResponse:
        assert "gzip" in request.headers.get("Accept-Encoding", "")
        ctype = "text/event-stream" if stream else "application/json"
        return web.Response(body=gzip.compress(body), headers={
            "Content-Type": ctype, "Content-Encoding": "gzip"})

    out = run(one(handler))
    assert (out.status, out.text, out.finish_reason) == ("ok", "compressed hi", "stop")
    assert (out.prompt_tokens, out.completion_tokens) == (2, 2)


async def _raw_attempt(pieces: list[bytes], head: list[bytes] | None = None,
                       headers: dict[str, str] | None = None) -> AttemptOutcome:
    """One attempt, with a job's `headers`, against a loopback server that answers with
    `pieces` as they are (a status line and headers aiohttp's server would not send), 50 ms
    apart, then closes; the request's head lines go to `head`."""

    async def serve_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := (await reader.readline()).strip():  # the request's head; its body unread
            if head is not None:
                head.append(line)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.close()

    server = await asyncio.start_server(serve_raw, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            client = StreamingClient(session, f"http://127.0.0.1:{port}/v1", "chat",
                                     headers or {}, FAST, Clock())
            return await client.attempt(BODY)
    finally:
        server.close()


def test_a_content_type_with_escapes_is_shown_without_them() -> None:
    """A 2xx that is no stream names its content type, the server's header: an escape in it
    reached the terminal as the message did (`clip`)."""
    out = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/html\xc2\x9b2J\x1b[31m\r\n"
                            b"Content-Length: 2\r\n\r\nhi"]))
    assert out.error == ("stream ended before [DONE] after 0 tokens (content-type "
                         "text/html\\x9b2J\\x1b[31m)")


@pytest.mark.skipif(http_parser.HttpResponseParser is http_parser.HttpResponseParserPy,
                    reason="aiohttp's Python parser waits for a blank line: a disconnection")
def test_a_server_that_speaks_no_http_is_no_answer() -> None:
    """A base_url at a port that answers in another protocol: an SSH banner, a TLS alert (a
    TLS port spoken to in plain http). Every request meets it, and it was a protocol_error
    retried for each item, all dead-lettered; it is no answer (the run stops after enough
    alike), and a TLS record is named. A body broken after good headers is one answer's."""
    ssh = run(_raw_attempt([b"SSH-2.0-OpenSSH_9.6\r\n"]))
    assert (ssh.status, ssh.not_an_answer) == ("protocol_error", True)
    assert ssh.error is not None and ssh.error.startswith("invalid HTTP response: Bad status")
    tls = run(_raw_attempt([b"\x15\x03\x01\x00\x02\x02\x46"]))
    assert (tls.status, tls.not_an_answer) == ("protocol_error", True)
    assert tls.error is not None
    assert tls.error.endswith(" (a TLS server: endpoint.base_url wants https://)")
    cut = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                            b"Content-Length: 1000\r\n\r\n", sse(chat("a"))]))
    assert (cut.status, cut.not_an_answer) == ("conn_reset", False)


def test_a_body_whose_chunks_break_is_named_not_a_silence() -> None:
    """Chunked framing broken after good headers (a chunk size that is no number): aiohttp
    keeps the error on the connection, not on the body, whose read waits for a deadline. The
    failure was that deadline's ("no data for 2.0 s"); it names the broken framing."""
    out = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n",
                            b"%x\r\n%s\r\n" % (len(sse(chat("a"))), sse(chat("a"))),
                            b"zz\r\nxx\r\n"]))
    assert out.status == "protocol_error" and out.text == "a"
    assert out.error is not None and out.error.startswith("invalid HTTP body after 1 token: ")


@pytest.mark.skipif(os.environ.get("AIOHTTP_NO_EXTENSIONS") == "1", reason="this is the run")
def test_a_body_whose_chunks_break_is_named_by_the_python_parser_too() -> None:
    """aiohttp's pure-Python parser (no C extension for this Python) raises the broken framing
    out of the body's read as an HttpProcessingError, no ClientError: it left the attempt, and
    stopped the shard and the run. The test above, with that parser."""
    test = f"{__file__}::test_a_body_whose_chunks_break_is_named_not_a_silence"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          env={**os.environ, "AIOHTTP_NO_EXTENSIONS": "1"}, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout[-2000:]


def test_a_body_that_is_not_the_gzip_it_says_is_no_answer_not_a_cut() -> None:
    """A body that says Content-Encoding: gzip and is not gzip (a gateway that labels what it
    did not compress): aiohttp raises it as it raises a cut body, and it was conn_reset,
    "response body cut", which a cut connection is (an outage's sign). It is a protocol_error
    that names the encoding, no answer when no token came."""
    # gzip's stream in pieces: a header, then deflate blocks; a sync flush ends one whole.
    packer = zlib.compressobj(wbits=31)
    good = packer.compress(sse(chat("a"))) + packer.flush(zlib.Z_SYNC_FLUSH)

    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Encoding: gzip\r\nConnection: close\r\n\r\n")
    for pieces, tokens in (([b"not gzip at all"], 0), ([good, b"\xff" * 64], 1)):
        out = run(_raw_attempt([head, *pieces]))
        assert out.status == "protocol_error" and out.not_an_answer == (tokens == 0)
        after = "1 token" if tokens == 1 else f"{tokens} tokens"
        assert out.error == f"undecodable body after {after}: Can not decode content-encoding: gzip"
    # An error's body that does not decode: its status speaks (a 429 is waited out, not
    # counted as a page that is no answer, which stops a run).
    out = run(_raw_attempt([head.replace(b"200 OK", b"429 Too Many Requests"), b"not gzip"]))
    assert (out.status, out.error, out.not_an_answer) == ("http_429", "HTTP 429", False)


@pytest.mark.parametrize(("encoding", "headers"), [("br", {}), ("zstd", {}),
                                                  ("br", {"accept-encoding": "identity"})])
def test_a_body_in_an_encoding_not_asked_for_says_so(encoding: str,
                                                     headers: dict[str, str]) -> None:
    """A server (a CDN, a gateway) that compresses as br or zstd though the request asks only
    for what aiohttp decodes here: aiohttp refuses the response's head, and the message was
    "invalid HTTP response: ... Please install `Brotli`", a fix for no one running shardrun.
    It names the encoding and what the request asked for (as the server saw it: aiohttp's
    default, or the job's own header)."""
    sent: list[bytes] = []
    out = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                            b"Content-Encoding: " + encoding.encode() +
                            b"\r\nConnection: close\r\n\r\n", b"\x8b\x02\x80data\x03"], sent,
                           headers))
    accepts = next(line.split(b":", 1)[1].strip().decode() for line in sent
                   if line.lower().startswith(b"accept-encoding:"))
    assert encoding not in accepts and accepts == headers.get("accept-encoding", accepts)
    assert (out.status, out.not_an_answer) == ("protocol_error", True)
    assert out.error == (f"the server compressed its answer as {encoding} (Content-Encoding), "
                         f"which this client did not ask for (Accept-Encoding: {accepts}) and "
                         "cannot read: have it send gzip or no compression")


@pytest.mark.parametrize(("accepts", "asked"), [
    ("gzip, br", True), ("*;q=0.5", True), ("gzip, br;q=0", False), ("gzip, *;q=0.0", False)])
def test_a_body_in_an_encoding_the_job_asked_for_says_the_job_asked(accepts: str,
                                                                    asked: bool) -> None:
    """A job whose own Accept-Encoding names br (or any encoding), which aiohttp cannot decode
    here: the message said the client did not ask for it, beside the header that did, and sent
    the user to the server, whose answer was what was asked. One a weight of 0 refuses is not
    asked for."""
    out = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                            b"Content-Encoding: br\r\nConnection: close\r\n\r\n",
                            b"\x8b\x02\x80data\x03"], None, {"Accept-Encoding": accepts}))
    assert (out.status, out.not_an_answer) == ("protocol_error", True)
    said = "the server compressed its answer as br (Content-Encoding), which "
    assert out.error == (said + (
        f"endpoint.headers asked for (Accept-Encoding: {accepts}) but this client cannot "
        "read: ask only for gzip, deflate or identity there" if asked else
        f"this client did not ask for (Accept-Encoding: {accepts}) and cannot read: have it "
        "send gzip or no compression"))


def test_an_html_page_says_what_it_says_not_its_markup() -> None:
    """A block page for a 403 and a captive portal's login page for a 200: each named by its
    title, which says what to do, where a 403's message was the page's first 200 bytes of
    markup and a 200's only its content type."""
    block = run(_raw_attempt([b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/html\r\n"
                              b"Connection: close\r\n\r\n<!DOCTYPE html>" + b"<!-- -->" * 40
                              + b"<html><head><title>Access denied | Cloudflare</title>"]))
    assert (block.status, block.http_status) == ("http_4xx", 403)
    assert block.error == 'HTTP 403: an HTML page that says "Access denied | Cloudflare"'
    portal = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n"
                               b"Connection: close\r\n\r\n<html><head><title>Hotel Wi-Fi",
                               b" &amp; Login</title></head><body>Accept</body></html>"]))
    assert (portal.status, portal.not_an_answer) == ("protocol_error", True)
    assert portal.error == ('an HTML page that says "Hotel Wi-Fi & Login", not an event stream '
                            "(content-type text/html)")


def test_a_plain_text_body_says_its_first_words() -> None:
    """A 200 with a plain text body (a server's "Internal Server Error", a proxy's notice) said
    only its content type; now its first words, on one line, control characters escaped."""
    out = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: "
                            b"close\r\n\r\nInternal Server Error\r\n\x1b[2J" + b"x" * 500]))
    assert (out.status, out.not_an_answer) == ("protocol_error", True)
    assert out.error == ('a text that says "Internal Server Error \\x1b[2J' + "x" * 91
                         + '", not an event stream (content-type text/plain)')
    # Its own double quotes would end the quotation early: they are shown as single ones.
    out = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: "
                            b'close\r\n\r\nNo "model" given']))
    assert out.error == ("a text that says \"No 'model' given\", not an event stream "
                         "(content-type text/plain)")



@pytest.mark.parametrize("text", [
    b"\xef\xbb\xbfInternal Server Error",
    b"\xff\xfe" + "Internal Server Error".encode("utf-16-le"),
], ids=["utf-8", "utf-16-le"])  # fmt: skip
def test_a_plain_text_body_is_read_by_its_byte_order_mark(text: bytes) -> None:
    """A 200's plain text body behind a byte order mark, as an error body is read
    (`utf8_of`): the UTF-8 mark showed as "\\ufeff" before its words, and UTF-16 a "\\x00"
    between each two letters."""
    out = run(_raw_attempt([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: "
                            b"close\r\n\r\n" + text]))
    assert out.error == ('a text that says "Internal Server Error", not an event stream '
                         "(content-type text/plain)")

def test_a_header_longer_than_8_kib_is_read() -> None:
    """A gateway's header of 20 KB (an auth proxy's session cookie, a long policy header):
    valid HTTP, which aiohttp's default limit of 8190 bytes a line refused as "invalid HTTP
    response", for every request, so the run stopped as if the job did not suit the server."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request, **{"Set-Cookie": "session=" + "a" * 20_000})
        await resp.write(sse(chat("long")) + sse(chat(None, "stop")) + sse(b"[DONE]"))
        return resp

    out = run(one(handler))
    assert (out.status, out.text, out.error) == ("ok", "long", None)


def _refused(status: int, body: dict[str, object]) -> AttemptOutcome:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)

    out: AttemptOutcome = run(one(handler))
    return out


def _shard_after(tmp_path: Path, out: AttemptOutcome, times: int = 1,
                 sent: list[dict[str, Any]] | None = None) -> Shard:
    """A shard that has not yet seen a success, told `times` of the failed attempt `out`;
    what it sends the coordinator goes to `sent`."""
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://x",
                      api="chat", model="m", api_key="k", api_key_env="OPENROUTER_API_KEY")
    shard = Shard(cfg, (sent if sent is not None else []).append)  # type: ignore[arg-type]
    for _ in range(times):
        shard._note_failure(out, "http://x/v1/chat/completions")
    shard.close()
    return shard


def test_a_402_for_credits_stops_the_run_as_a_used_up_quota(tmp_path: Path) -> None:
    """OpenRouter answers 402 (Payment Required) once the credits are used up: no item will
    succeed until someone adds more, so the run stops for --resume as for OpenAI's
    insufficient_quota (before, a 402 was any item's 4xx: every remaining item dead-lettered)."""
    out = _refused(402, {"error": {"code": 402, "message": "Insufficient credits. Add more "
                                   "using https://example.invalid/credits"}})
    assert (out.status, out.error_code) == ("http_4xx", "402")
    shard = _shard_after(tmp_path, out)
    assert shard.fatal_mode == ABANDON and shard.fatal_reason is not None
    assert shard.fatal_reason.startswith(
        "the endpoint says the account's quota is used up (HTTP 402: Insufficient credits.")


def test_a_shards_fatal_stop_reaches_the_coordinator_once_before_its_done(
        tmp_path: Path) -> None:
    """A shard that stops the run (a used-up quota) tells the coordinator at once, in a
    `fatal` message with its reason and mode, which the coordinator words the run's end from;
    its `done` report, sent after it on the same pipe, no longer repeats them in fields the
    coordinator never read (the protocol table in docs/ARCHITECTURE.md says so)."""
    sent: list[dict[str, Any]] = []
    shard = _shard_after(tmp_path, _refused(402, {"error": {"code": 402, "message": "no"}}),
                         sent=sent)
    assert [(m["t"], m["reason"], m["mode"]) for m in sent] == [
        (protocol.FATAL, shard.fatal_reason, ABANDON)]
    done = done_message(shard)
    assert done["t"] == protocol.DONE and "minutes" in done
    assert not {"fatal", "fatal_mode"} & set(done)


def test_a_403_for_flagged_content_refuses_the_item_not_the_key(tmp_path: Path) -> None:
    """OpenRouter answers 403 when a moderation check flags an item's input (its error's
    `metadata` names the reasons and the flagged input): that item is refused, and the run goes
    on; it was read as refused credentials, which stopped the whole run if it came first. Nor
    do many flagged items in a row (a red-team dataset) stop it as requests refused alike. A 403
    without that metadata before any success still stops the run naming the key's variable."""
    flagged = {"error": {"code": 403, "message": "Your input was flagged for harassment",
                         "metadata": {"reasons": ["harassment"], "flagged_input": "you...",
                                      "provider_name": "p", "model_slug": "m"}}}
    out = _refused(403, flagged)
    assert (out.status, out.flagged, out.error) == (
        "http_4xx", True, "HTTP 403: Your input was flagged for harassment")
    assert _shard_after(tmp_path, out, times=REFUSED_ALIKE_AFTER).fatal_reason is None
    out = _refused(403, {"error": {"code": 403, "message": "Key disabled"}})
    assert not out.flagged
    shard = _shard_after(tmp_path, out)
    assert shard.fatal_mode == ABANDON and shard.fatal_reason == (
        "the endpoint refused the credentials (HTTP 403: Key disabled): set the right key in "
        "OPENROUTER_API_KEY (the variable endpoint.api_key_env names), then continue with "
        "--resume")


def test_a_stream_with_nothing_in_it_is_no_success() -> None:
    """A stream that reaches [DONE] with no content, reasoning or tool call and no finish_reason
    (a role chunk and usage at most) holds no answer: a protocol_error, retried, where it was an
    empty success. An empty answer that says why it ended (finish_reason) stays a success."""

    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 0}}
    for payloads in [(), (role, usage)]:
        out = run(one(streaming(*payloads, b"[DONE]")))
        assert (out.status, out.text) == ("protocol_error", "")
        assert out.error == ("the stream reached [DONE] with nothing in it: no content, "
                             "reasoning or tool call, and no finish_reason")
    out = run(one(streaming(role, chat(None, "length"), usage, b"[DONE]")))
    assert (out.status, out.text, out.finish_reason) == ("ok", "", "length")


@pytest.mark.parametrize(("api", "body", "said"), [
    ("chat", {"object": "chat.completion"}, "no choices"),
    ("chat", {"choices": []}, "no choices"),
    ("chat", {"choices": {"0": {}}}, "its choices are an object"),
    ("chat", {"choices": ["hi"]}, "a choice that is no object"),
    ("chat", {"choices": [{"index": 0}]}, "its first choice has no message"),
    ("chat", {"choices": [{"finish_reason": None}]}, "its first choice has no message"),
    ("chat", {"choices": [{"finish_reason": 7}]}, "its first choice has no message"),
    ("chat", {"choices": [{"text": "hi", "finish_reason": "stop"}]},
     "its first choice has no message"),  # another API's answer is no empty one
    ("chat", {"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}]},
     "its first choice has no message"),
    ("completions", {"choices": [{"finish_reason": None}]}, "its first choice has no text"),
    ("chat", {"choices": [{"index": 0, "content": "THE ANSWER", "finish_reason": "stop"}],
              "usage": {"completion_tokens": 2}},
     "its first choice has no message"),  # the answer under a key not read is no empty one
    ("chat", {"choices": [{"index": 0, "content": "THE ANSWER", "finish_reason": "stop"}]},
     "its first choice has no message"),
    ("completions", {"choices": [{"index": 0, "output": "hi", "finish_reason": "stop"}]},
     "its first choice has no text"),
    ("chat", {"choices": [{"index": 0, "finish_reason": "stop"}],
              "usage": {"completion_tokens": 2}},
     "its first choice has no message"),  # tokens generated and none shown
    ("completions", {"choices": [{"finish_reason": "stop"}], "usage": {"completion_tokens": -1}},
     "its first choice has no text"),
    ("chat", {"choices": [{"message": "hi", "finish_reason": "stop"}]},
     "its first choice's message is a string"),
    ("chat", {"choices": [{"message": {"content": 7}, "finish_reason": "stop"}]},
     "its message's content is a number"),
    ("chat", {"choices": [{"message": {"content": None, "tool_calls": [{"function": "f"}]},
                           "finish_reason": "tool_calls"}]},
     "a tool call that is not shaped as one"),
    ("chat", {"choices": [{"message": {"role": "assistant", "content": None}}]},
     "nothing in it: no content, reasoning or tool call, and no finish_reason"),
    ("completions", {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]},
     "its first choice has no text"),
    ("completions", {"choices": [{"text": ["hi"], "finish_reason": "stop"}]},
     "its first choice's text is a list"),
    ("responses", {"object": "chat.completion", "choices": []},
     "it is no response object (object chat.completion)"),
    ("responses", {"object": "response", "status": "completed"}, "it has no output"),
    ("responses", {"object": "response", "status": "completed", "output": {}},
     "its output is an object"),
    ("responses", {"object": "response", "status": "completed", "output": ["hi"]},
     "an output item that is not shaped as one"),
    ("responses", {"object": "response", "status": "in_progress", "output": []},
     "its status is in_progress, not completed"),
    ("responses", {"object": "response", "status": "cancelled", "output": []},
     "its status is cancelled, not completed"),
])  # fmt: skip
def test_a_whole_answer_that_cannot_be_read_is_no_success(api: Api, body: dict[str, object],
                                                          said: str) -> None:
    """A server that ignores `stream` and sends one JSON answer that is not shaped as one (no
    choices, a choice without its message or text, a field of the wrong kind): a protocol
    error that says what is wrong, retried, as a stream that cannot be read is. It was an
    empty success (an item lost to an empty output), or an uncaught error out of the attempt
    (a tool call whose function is no object)."""
    out = run(one(whole_answer(orjson.dumps(body)), api=api))
    assert (out.status, out.text) == ("protocol_error", "")
    assert out.error == f"an unreadable answer: {said} (content-type application/json)"
    assert Retrier(RetryPolicy()).decide(out.status, out.http_status, 1).retry


def test_a_whole_answer_that_is_empty_but_says_why_it_ended_is_a_success() -> None:
    """An empty answer with its finish_reason is one (a null content beside a refusal, too):
    the checks above refuse shapes, not empty answers."""
    for api, body in [
        ("chat", {"choices": [{"message": {"content": ""}, "finish_reason": "length"}]}),
        ("chat", {"choices": [{"message": {"content": None}, "finish_reason": "stop"}]}),
        ("completions", {"choices": [{"text": None, "finish_reason": "length"}]}),
        ("responses", {"object": "response", "status": "completed", "output": []}),
        ("responses", {"object": "response", "output": []}),  # a server that sends no status
    ]:  # fmt: skip
        out = run(one(whole_answer(orjson.dumps(body)), api=api))
        assert (out.status, out.text, out.error) == ("ok", "", None), body


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_whole_answer_with_no_message_that_says_why_it_ended_is_an_empty_success(
        api: Api) -> None:
    """A whole answer whose choice says why it ended but holds no message (or text): an
    Azure-style `{"finish_reason": "content_filter"}` refusal. An empty answer with that
    finish_reason, as a stream's is; it was a protocol_error ("its first choice has no
    message"), retried against a filter that refuses again."""
    body = {"object": "chat.completion", "choices": [{"index": 0,
            "finish_reason": "content_filter"}], "usage": {"prompt_tokens": 9,
            "completion_tokens": 0}}  # fmt: skip
    out = run(one(whole_answer(orjson.dumps(body)), api=api))
    assert (out.status, out.text, out.error) == ("ok", "", None)
    assert (out.finish_reason, out.completion_tokens, out.tool_calls) == (
        "content_filter", 0, None)
    # Only keys that hold no answer beside it, and no tokens counted (or none said).
    for choice, usage in [
        ({"finish_reason": "content_filter"}, None),
        ({"finish_reason": "content_filter"}, {"completion_tokens": None}),
        ({"index": 0, "finish_reason": "content_filter", "logprobs": None,
          "content_filter_results": {"hate": {"filtered": True}}, "stop_reason": None,
          "native_finish_reason": "SAFETY"}, {"prompt_tokens": 9}),
    ]:  # fmt: skip
        sent = {"choices": [choice]} | ({"usage": usage} if usage is not None else {})
        out = run(one(whole_answer(orjson.dumps(sent)), api=api))
        assert (out.status, out.text, out.finish_reason) == ("ok", "", "content_filter"), sent


@pytest.mark.parametrize(("sent", "kept"), [
    ("length", "length"), (7, "7"), (True, "true"), ({"type": "stop"}, '{"type":"stop"}'),
    (["stop"], '["stop"]'),
])  # fmt: skip
def test_a_finish_reason_that_is_no_string_is_kept_as_its_json_text(sent: object,
                                                                    kept: str) -> None:
    """A finish_reason that is no string (a number, an object) is kept as the JSON text the
    server sent, as a tool call's name or arguments that is no string is: it was Python's
    repr of the value (`{'type': 'stop'}`, `True`), which no JSON tool reads back. A string
    stands as it is. The same in a stream, in a whole answer and in an incomplete response."""
    stream = run(one(streaming(chat("a"), chat(None, sent), b"[DONE]")))  # type: ignore[arg-type]
    whole = run(one(whole_answer(orjson.dumps(
        {"choices": [{"message": {"content": "a"}, "finish_reason": sent}]}))))
    incomplete = {"object": "response", "status": "incomplete", "output": [],
                  "incomplete_details": {"reason": sent}}
    response = run(one(whole_answer(orjson.dumps(incomplete)), api="responses"))
    assert [(o.status, o.finish_reason) for o in (stream, whole)] == [("ok", kept)] * 2
    assert response.finish_reason == kept


def _call_delta(arguments: str, index: int | None = 0, ident: str | None = None,
                name: str | None = None) -> dict[str, object]:
    call: dict[str, object] = {"function": {"arguments": arguments}}
    if name is not None:
        call = {"id": ident, "type": "function", "function": {"name": name,
                                                             "arguments": arguments}}
    if index is not None:
        call["index"] = index
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


def _calls(*pairs: tuple[str, str, str]) -> list[dict[str, object]]:
    return [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in pairs]


@pytest.mark.parametrize("index", [0, None])
def test_tool_calls_that_share_an_index_stay_apart(index: int | None) -> None:
    """Ollama sends every tool call of an answer with index 0 (some gateways with none), each
    whole in one delta with its own id: they are two calls, not one with both names and
    `{...}{...}` as its arguments. No content: the output is empty, the finish_reason says
    tool_calls and the calls count as generated tokens."""
    chunks = [_call_delta('{"path":"a.py"}', index, "call_a", "write"),
              _call_delta('{"path":"b.py"}', index, "call_b", "write"),
              chat(None, "tool_calls")]
    out = run(one(streaming(*chunks, b"[DONE]")))
    assert (out.status, out.text, out.finish_reason, out.content_chunks) == (
        "ok", "", "tool_calls", 2)
    assert out.tool_calls == _calls(("call_a", "write", '{"path":"a.py"}'),
                                    ("call_b", "write", '{"path":"b.py"}'))


def test_tool_call_pieces_after_a_shared_index_go_to_the_latest_call() -> None:
    """A server that reuses index 0 and streams each call's arguments in pieces: the pieces
    after the second call's start are that call's, also once the reader has learned the
    arguments chunks' bytes (the envelope, whose index is the same for both calls)."""
    first = [_call_delta("", 0, "call_a", "f")] + [_call_delta(p) for p in ('{"x"', ":1", "}")]
    second = [_call_delta("", 0, "call_b", "g")] + [_call_delta(p) for p in ('{"y"', ":2", "}")]
    reader = ChunkReader(chat=True)
    for payload in [*first, *second]:
        assert reader.read([orjson.dumps(payload)], []) == MORE
    assert reader.tool_call_list() == _calls(("call_a", "f", '{"x":1}'), ("call_b", "g", '{"y":2}'))
    many = ChunkReader(chat=True)  # the same, as reads of many payloads
    assert many.read([orjson.dumps(p) for p in first], []) == MORE
    assert many.read([orjson.dumps(p) for p in second], []) == MORE
    assert many.tool_call_list() == reader.tool_call_list()


def test_argument_pieces_with_an_id_of_their_own_stay_in_their_call() -> None:
    """Poolside's API sends a call's name with one id and each piece of its arguments with
    another (some servers a new id with every delta): a new id with no name is more of the same
    call, whose id is its first, not a call of its own with no name."""
    piece = {"index": 0, "id": "call_B", "type": "function", "function": {"arguments": '{"q"'}}
    rest = {**piece, "id": "call_C", "function": {"arguments": ':"hi"}'}}
    chunks = [_call_delta("", 0, "call_A", "search"), _with_calls(piece), _with_calls(rest),
              chat(None, "tool_calls")]
    out = run(one(streaming(*chunks, b"[DONE]")))
    assert out.tool_calls == _calls(("call_A", "search", '{"q":"hi"}'))


def _with_calls(*calls: dict[str, object]) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"tool_calls": list(calls)}, "finish_reason": None}]}


def test_a_whole_answer_sent_as_one_event_is_read_by_its_message() -> None:
    """A server that answers a streaming request with its whole chat.completion as one event
    (then [DONE], or not): its message is read as the stream's one delta, text and calls. Its
    choice has no `delta`, so it was skipped: an ok result with an empty output."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answer = {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
              "message": {"role": "assistant", "content": "hello", "tool_calls": [call]}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2}}  # fmt: skip
    for ending in ([b"[DONE]"], []):
        out = run(one(streaming(answer, *ending)))
        assert (out.status, out.text, out.finish_reason) == ("ok", "hello", "stop")
        assert (out.tool_calls, out.completion_tokens) == ([call], 2)


@pytest.mark.parametrize("delta", [{}, {"delta": None}], ids=["no delta", "null delta"])
def test_a_last_chunk_that_repeats_the_whole_message_is_not_added_again(
        delta: dict[str, object]) -> None:
    """Some OpenAI-style streams end with a chunk holding the whole message so far instead of a
    delta: what was streamed is the answer, once. It was read as one more delta: the text
    'hello worldhello world', the call's arguments '{"a":1}{"a":1}', recorded ok."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    last = {"choices": [{"index": 0, "finish_reason": "stop", **delta,
            "message": {"role": "assistant", "content": "hello world"}}]}  # fmt: skip
    out = run(one(streaming(chat("hello"), chat(" world"), last, b"[DONE]")))
    assert (out.status, out.text, out.finish_reason) == ("ok", "hello world", "stop")
    calls = [_call_delta('{"a":', 0, "c1", "f"), _call_delta("1}")]
    repeat = {"choices": [{"index": 0, "finish_reason": "tool_calls", **delta,
              "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}
    out = run(one(streaming(*calls, repeat, b"[DONE]")))
    assert (out.status, out.tool_calls, out.finish_reason) == ("ok", [call], "tool_calls")
    thought = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
    again = {"choices": [{"index": 0, "finish_reason": "stop", **delta,
             "message": {"role": "assistant", "reasoning_content": "hm"}}]}  # fmt: skip
    out = run(one(streaming(thought, again, b"[DONE]")))  # a thought is something read, too
    assert (out.status, out.reasoning, out.finish_reason) == ("ok", "hm", "stop")


@pytest.mark.parametrize("content", [
    "the answer", [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "the answer"}],
], ids=["text", "parts"])
def test_a_last_chunk_with_the_whole_message_after_streamed_reasoning_gives_its_answer(
        content: object) -> None:
    """A stream of reasoning deltas only, then a last chunk holding the whole message (its
    reasoning again and the answer, never streamed): the answer was kept out, since something
    had been read (the reasoning), and the result was ok with an empty text. The message's
    answer is read, and its reasoning, streamed already, is not added again."""
    thought = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
    last = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "hm", "content": content}}]}
    out = run(one(streaming(thought, last, b"[DONE]")))
    assert (out.status, out.text, out.reasoning) == ("ok", "the answer", "hm")


def test_a_last_chunk_with_the_whole_message_after_streamed_reasoning_gives_its_calls() -> None:
    """Reasoning streamed, then a last chunk holding the whole message: its tool calls (or its
    refusal), never streamed, are the answer, and were dropped with everything but its content
    (an ok result with no text, no calls, finish_reason tool_calls). What the stream did send
    (the reasoning, or calls streamed before) is not added again."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    thought = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
    last = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "reasoning_content": "hm", "content": None, "tool_calls": [call]}}]}
    out = run(one(streaming(thought, last, b"[DONE]")))
    assert (out.status, out.reasoning, out.tool_calls) == ("ok", "hm", [call])
    refused = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "hm", "content": None, "refusal": "no"}}]}
    out = run(one(streaming(thought, refused, b"[DONE]")))
    assert (out.reasoning, out.refusal) == ("hm", "no")
    streamed = [_call_delta('{"a":', 0, "c1", "f"), _call_delta("1}")]
    out = run(one(streaming(thought, *streamed, last, b"[DONE]")))
    assert (out.reasoning, out.tool_calls) == ("hm", [call])


def test_a_done_with_bytes_after_it_ends_the_stream() -> None:
    """`data: [DONE] ` (a space after it): the end of a whole answer, as OpenAI's own clients
    read any payload that starts with [DONE]; it failed the answer as unparseable, retried
    and paid for again."""
    out = run(one(streaming(chat("hi"), chat(None, "stop"), b"[DONE] ")))
    assert (out.status, out.text, out.finish_reason, out.error) == ("ok", "hi", "stop", None)


def test_a_stream_that_ends_after_its_finish_reason_without_done_is_whole() -> None:
    """Some servers (ik_llama.cpp's, unless started with --send-done) end the body after the
    chunk with the finish_reason and send no `data: [DONE]`: the answer is whole, so the attempt
    is ok (it was a protocol_error, retried and in the end dead-lettered, for every item).
    Without a finish_reason the end of the body still cuts the answer short (test_client's
    test_stream_cut_without_done)."""
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    out = run(one(streaming(chat("a"), chat("b"), {**chat(None, "stop"), "usage": usage})))
    assert (out.status, out.error, out.text, out.finish_reason) == ("ok", None, "ab", "stop")
    assert (out.completion_tokens, out.usage_estimated, out.wasted_tokens) == (2, False, 0)


@pytest.mark.parametrize("way", ["stream", "no_done", "whole"])
@pytest.mark.parametrize("reason", ["error", "abort"])
def test_an_answer_the_server_gave_up_on_is_no_success(reason: str, way: str) -> None:
    """Some servers end an answer they gave up on with its finish_reason saying so, the text so
    far kept: "error" (Together's API, tt-inference-server), "abort" (vLLM, SGLang: a request
    its engine aborted, at a shutdown or a scale-down, every one in flight). A protocol_error,
    retried (it was a success whose output was cut off), streamed, streamed with no [DONE], or
    whole. Another finish_reason of the server's own ("eos") stays a success as sent."""
    end = [b"[DONE]"] if way == "stream" else []
    answer = {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": reason,
              "message": {"role": "assistant", "content": "ab"}}]}  # fmt: skip
    handler = (whole_answer(orjson.dumps(answer)) if way == "whole"
               else streaming(chat("a"), chat("b"), chat(None, reason), *end))
    out = run(one(handler))
    tokens = 1 if way == "whole" else 2
    assert (out.status, out.text, out.finish_reason) == ("protocol_error", "ab", reason)
    assert out.error == (f"the server ended the answer with finish_reason '{reason}' after "
                         f"{tokens} token{'s' if tokens > 1 else ''}")
    assert out.wasted_tokens == tokens
    decision = Retrier(RetryPolicy(backoff_s=0.01, backoff_max_s=0.01)).decide(
        out.status, out.http_status, 1, out.retry_after, out.rate_headers)
    assert decision.retry
    out = run(one(streaming(chat("a"), chat(None, "eos"), *end)))
    assert (out.status, out.text, out.finish_reason) == ("ok", "a", "eos")


def _parts(*parts: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"role": "assistant", "content": list(parts)},
                         "finish_reason": finish}]}  # fmt: skip


def _thinking(text: str) -> dict[str, object]:
    return {"type": "thinking", "thinking": [{"type": "text", "text": text}]}


def test_mistral_content_parts_are_the_answer_and_the_thought() -> None:
    """Mistral's reasoning models send `delta.content` as a list of parts, `thinking` parts
    (the thought) and then `text` parts (the answer): the answer lands in the output and the
    thought in `reasoning`, where both were dropped and the item succeeded with an empty
    output. A whole (non-streamed) answer shaped so reads the same."""
    chunks = [_parts(_thinking("The user")), _parts(_thinking(" wants 4.")),
              _parts({"type": "text", "text": "2+2"}), _parts({"type": "text", "text": " = 4"}),
              _parts({"type": "reference", "reference_ids": [1]}, finish="stop")]
    out = run(one(streaming(*chunks, b"[DONE]")))
    assert (out.status, out.text, out.reasoning, out.finish_reason) == (
        "ok", "2+2 = 4", "The user wants 4.", "stop")
    assert out.content_chunks == 4
    whole = {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": [_thinking("hm"),
                                                          {"type": "text", "text": "4"}]}}]}

    async def whole_handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(whole)

    out = run(one(whole_handler))
    assert (out.status, out.text, out.reasoning) == ("ok", "4", "hm")
    reader = ChunkReader(chat=True)  # parts not shaped so are no text, as other contents
    bad = _parts({"type": "thinking", "thinking": [5, {"text": 6}]}, {"type": "text"}, "a",
                 {"type": "thinking", "thinking": 7})
    assert reader.read([orjson.dumps(bad)], pieces := []) == MORE
    assert (pieces, reader.reasoning, reader.other_chunks) == ([], [], 0)


def test_the_credentials_sentence_names_what_the_job_sends(tmp_path: Path) -> None:
    """The sentence of a credentials stop names the key's variable; says the job sends no key
    when it sends no credentials at all; and names the other places credentials come from when
    the job sends them there (a URL's password, a header of the job's)."""

    def cfg(**kw: Any) -> ShardConfig:
        return ShardConfig(**{"shard": 0, "run_id": "r", "out_dir": str(tmp_path), "api": "chat",
                              "model": "m", "base_url": "http://h/v1", **kw})

    assert credentials_fix(cfg(api_key="k", api_key_env="KEY")) == (
        "set the right key in KEY (the variable endpoint.api_key_env names)")
    none = "the job sends no key: name the variable that holds one in endpoint.api_key_env"
    assert credentials_fix(cfg(headers={"OpenAI-Organization": "org"})) == none
    other = ("set the right credentials: the key in the variable endpoint.api_key_env names, or "
             "the password in endpoint.base_url or the header in endpoint.headers that carry one")
    assert credentials_fix(cfg(base_url="http://u:p@h/v1")) == other
    for header in ("X-Api-Key", "Cookie", "X-Client-Secret"):  # an SSO proxy's cookie too
        assert credentials_fix(cfg(headers={header: "k"})) == other


def test_a_url_whose_credentials_are_masked_in_messages_still_sends_them() -> None:
    """masked_url hides a base URL's userinfo, path parameters and secret query fields where the
    URL is shown (`client.url`, a failure's message); the request itself goes to the URL as
    written: the server sees the user and password, the path parameters and the key."""
    seen: list[tuple[str, str | None]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.raw_path, request.headers.get("Authorization")))
        return await whole_answer(orjson.dumps({"choices": [
            {"message": {"content": "hi"}, "finish_reason": "stop"}]}))(request)

    async def go() -> tuple[str, int, AttemptOutcome]:
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", handler)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        session = make_session(2, FAST)
        base = (f"http://user:pw@127.0.0.1:{server.port}/v1;token=abc/def;sk-xyz"
                "?a=1;key=s3cret&api-version=2")
        try:
            client = StreamingClient(session, base, "chat", {}, FAST, Clock())
            return client.url, server.port or 0, await client.attempt(BODY)
        finally:
            await session.close()
            await server.close()

    shown, port, out = run(go())
    assert (out.status, out.text) == ("ok", "hi")
    assert seen == [("/v1;token=abc/def;sk-xyz/chat/completions?a=1;key=s3cret&api-version=2",
                     "Basic dXNlcjpwdw==")]  # user:pw
    assert shown == f"http://***@127.0.0.1:{port}/v1;***?a=1;key=***&api-version=2"
    for secret in ("user", "pw", "abc", "def", "sk-xyz", "s3cret"):
        assert secret not in shown, shown
