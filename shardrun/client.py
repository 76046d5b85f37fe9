"""One streaming attempt against an OpenAI-compatible endpoint, as an `AttemptOutcome` value.

A failed request is data, not an exception: the shard turns every outcome into an `attempt_end`
event and decides about retries from `status`. Only cancellation propagates.

    status               when
    ok                   the stream reached `data: [DONE]`, or its body ended cleanly after a
                         finish_reason, or the 2xx body was one complete JSON answer instead of
                         a stream (a server that ignores `stream`)
    http_429 / _5xx      HTTP 429 / 5xx, or an error object with that code inside the stream
    http_4xx             any other HTTP 4xx (message taken from the error body, <= 64 KiB read)
    timeout_connect      no connection (pool slot + DNS + TCP/TLS) within connect_s
    timeout_first_token  no content token within first_token_s after the connection was ready
    timeout_idle         no bytes for idle_s after the first token
    timeout_total        the attempt as a whole exceeded total_s (wins over the others)
    conn_reset           refused, reset, DNS failure, server disconnected, body cut mid-chunk
                         (a pooled connection dead before any answer is no failure: the
                         request goes again on another, `_post`, counted in `resent`)
    protocol_error       no [DONE] before end of stream, unparseable JSON, other in-stream error,
                         a stream with nothing in it (no token of any kind, no finish_reason),
                         an answer whose finish_reason is "error" or "abort" (the server gave up),
                         a body with no event in 16 MiB or of over 64 MiB (bounded memory;
                         more where the request's token limit allows, `body_cap`),
                         a body that does not decode as its Content-Encoding says,
                         a whole JSON body that is no answer one can read (no choices, a
                         choice without its message or text that does not say why it
                         ended, or holds another key or counts completion tokens) or has
                         nothing in it

Deadlines (one moving deadline per attempt, enforced by the client's watchdog) and the
per-attempt state live in `shardrun._attempt`.

Connection timing: `make_session` builds the session on a `StampingConnector`, which stamps
`conn_ready_at` and `conn_reused` on the attempt running in the calling task (found through a
context variable that `attempt` sets) when `connect()` hands out a connection. The caller's
`on_conn_ready` runs after aiohttp returns control (response headers or failure), never inside
aiohttp's connector. On a session built otherwise, the connection counts as ready at the response
headers, with `conn_reused` None.

The JSON inside the stream and in error bodies is read by `shardrun._chunks` (pure: no I/O).
"""

from __future__ import annotations

import asyncio
import base64
import re
import socket
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson
from aiohttp.http_exceptions import (
    ContentEncodingError,
    ContentLengthError,
    HttpProcessingError,
    TransferEncodingError,
)
from yarl import URL

from shardrun._attempt import (
    CURRENT,
    Attempt,
    AttemptCancelled,
    AttemptOutcome,
    CallerError,
    OnConnReady,
    OnFirstToken,
    StampingConnector,
    Timeouts,
    Watchdog,
    call_caller,
)
from shardrun._chunks import (
    Unreadable,
    clip,
    html_page,
    keep_secret,
    quoted,
    read_error_body,
    text_head,
)
from shardrun._ellipsis import counted
from shardrun._urls import SECRET_HEADER, masked_params, masked_url, url_secrets
from shardrun.clock import Clock
from shardrun.fdlimit import OUT_OF_FILES, out_of_files
from shardrun.items import API_PATHS, TOKEN_LIMITS, Api
from shardrun.sse import SSEDecoder

__all__ = [
    "AttemptCancelled",
    "AttemptOutcome",
    "OnConnReady",
    "OnFirstToken",
    "StreamingClient",
    "Timeouts",
    "endpoint_url",
    "make_session",
    "refused_stream_options",
    "request_headers",
]

_ERROR_BODY_MAX = 64 * 1024
_WHOLE_MAX = 16 * 1024 * 1024  # the largest non-streamed answer taken (see _read_stream)
# The most a 2xx body may bring with no event (a line or an event without end), and in all (an
# answer without end: a server that ignores max_tokens). Past either the attempt fails: the
# decoder held such a line, the answer its text, until a deadline (920 MB in 2 s of a line
# without end over loopback; 1.6 GB in 5 s of tokens). 64 MiB is twice a 128k-token answer
# at about 250 bytes of stream per chunk (OpenAI's, with its padding); a request whose token
# limit allows a longer stream gets more (`body_cap`).
_UNENDED_MAX = _WHOLE_MAX
_BODY_MAX = 64 * 1024 * 1024
# Stream bytes allowed per token a request may be answered with: a chunk carrying a token's 20
# top logprobs (their text, bytes and values) is about 1.5 KB, so a 32k-token answer with them
# is some 50 MB, and with n choices n times as much.
_BYTES_PER_TOKEN = 8 * 1024
# The longest header taken. aiohttp's default, 8190 bytes, refused a valid answer with one long
# header (an auth proxy's session cookie) as "invalid HTTP response", every request alike, so
# the run stopped; curl takes 100 KB. A response keeps its headers (raw and decoded) while its
# body streams: under aiohttp's cap on their count, 128 in its recent releases, some 16 MiB a
# response at worst from a hostile server, a quarter of what its body may hold (`_BODY_MAX`).
_HEADER_MAX = 64 * 1024
_SAID_MAX = 120  # characters of a plain text body quoted in its message
_SAID_READ = 4 * _SAID_MAX  # bytes read for them: a UTF-8 character is at most 4 (a whole
# number of UTF-32's and UTF-16's units too, as `utf8_of` reads those only)
_DRAIN_S = 1.0  # after [DONE], how long to wait for the end of the body so the connection pools
_KEEPALIVE_S = 30.0
# Same condition aiohttp uses: only these Pythons leak closed TLS transports.
_NEEDS_CLEANUP_CLOSED = sys.version_info < (3, 12, 8) or (3, 13, 0) <= sys.version_info < (3, 13, 1)


def make_session(cap: int, timeouts: Timeouts) -> aiohttp.ClientSession:
    """The shard's one session: a pool of `cap` keep-alive connections that stamp attempts
    (a shard's `cap` is `shard.pool_size`: its concurrency and the spans beside it).

    Call it inside the running event loop. There is no session-level total/read timeout: the
    client enforces its own deadlines; `sock_connect` is only a per-socket backstop.
    """
    if cap < 1:
        raise ValueError(f"cap must be at least 1, got {cap}")
    connector = StampingConnector(
        limit=cap, keepalive_timeout=_KEEPALIVE_S, cleanup_closed=_NEEDS_CLEANUP_CLOSED
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
        max_field_size=_HEADER_MAX,
    )


def body_cap(body: Mapping[str, object]) -> int:
    """The most stream a 2xx answer to `body` may bring (`_read_stream`): `_BODY_MAX`, or
    `_BYTES_PER_TOKEN` per token its limit and its `n` allow where that is more. A fixed 64 MiB
    failed long answers with logprobs (a 32k-token answer with 20 top logprobs a token, n=2),
    retried and paid for up to max_attempts; a request with no limit keeps `_BODY_MAX`."""
    limit = next((v for k in TOKEN_LIMITS if type(v := body.get(k)) is int), 0)
    n = body.get("n")
    choices = n if type(n) is int and n > 1 else 1
    return max(_BODY_MAX, limit * choices * _BYTES_PER_TOKEN)


RESEND_WITHIN_S = 0.5
"""How soon after a POST went out on a pooled connection its death counts as the pool's: the
close or reset of a connection the server had already given up comes back within a round trip
(`StreamingClient._post`); later, the server had the request and was working on it."""


class StreamingClient:
    """Runs attempts against one endpoint over the shard's session. Stateless between attempts,
    but for `heard_at`: when a stream last brought events (the live view's "nothing heard for")."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        api: Api,
        headers: Mapping[str, str],
        timeouts: Timeouts,
        clock: Clock,
        *,
        proxy: str | None = None,
        proxy_authorization: str | None = None,
        params: Mapping[str, object] | None = None,
    ) -> None:
        self._session, self._timeouts, self._clock = session, timeouts, clock
        self._api = api
        self.heard_at = 0.0
        self._watchdog: Watchdog | None = None  # the deadlines of its attempts (`_attempt`)
        self._url = endpoint_url(base_url, API_PATHS[api])
        self._models_url = endpoint_url(base_url, "/models")
        # Where every attempt is POSTed, as messages show it (a password in the URL masked).
        self.url = masked_url(self._url)
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        self._headers.update(headers)
        # What a body's Content-Encoding may be (aiohttp's, unless the job sets its own)
        self._accepts = next((v for k, v in self._headers.items()
                              if k.lower() == "accept-encoding"), ACCEPT_ENCODING)
        # Credentials a server may quote back in an error: masked in every message. The key,
        # whatever header carries it, `request_headers` keeps.
        url = URL(base_url)
        for name, value in self._headers.items():
            if SECRET_HEADER.search(name):
                keep_secret(value)
        in_body: list[object] = []  # a key a gateway reads from the body (`params`)
        masked_params(params, in_body)
        for secret in (url.user, url.password, proxy_authorization, *url_secrets(base_url),
                       *in_body):
            if isinstance(secret, str):
                keep_secret(secret)
        if url.user is not None or url.password is not None:  # aiohttp sends them so
            pair = f"{url.user or ''}:{url.password or ''}".encode("latin-1", "replace")
            keep_secret(base64.b64encode(pair).decode("ascii"))
        # The POST's other arguments, worked out once. `proxy` is an http://host:port URL
        # (shardrun.proxy), `proxy_authorization` the Proxy-Authorization header's value. That
        # header goes on the CONNECT that opens a tunnel for https, which aiohttp sends with
        # `proxy_headers`, and on the request itself for http, where aiohttp does not add them;
        # never into a tunnel, where the endpoint would read it.
        self._post_kw: dict[str, Any] = {"allow_redirects": False}
        if proxy is not None:
            self._post_kw["proxy"] = proxy
        if proxy is not None and proxy_authorization is not None:
            if self._url.startswith("https:"):
                self._post_kw["proxy_headers"] = {"Proxy-Authorization": proxy_authorization}
            else:
                self._headers["Proxy-Authorization"] = proxy_authorization

    async def attempt(
        self,
        body: Mapping[str, object],
        on_conn_ready: OnConnReady | None = None,
        on_first_token: OnFirstToken | None = None,
    ) -> AttemptOutcome:
        """POST `body` (sent as given) and read the stream. Never raises but for cancellation."""
        data = orjson.dumps(body)
        # The class, not `asyncio.timeout()`: that reads the running loop only to find the
        # deadline None, and on Python 3.11 each such read is a getpid system call.
        tm = asyncio.Timeout(None)
        if (watchdog := self._watchdog) is None:  # the first attempt: the loop is running now
            watchdog = self._watchdog = Watchdog(asyncio.get_running_loop())
        st = Attempt(self._api, self._clock, self._timeouts, tm, on_conn_ready, watchdog)
        token = CURRENT.set(st)  # for the session's StampingConnector, in this task only
        cancelled = False
        try:
            async with tm:
                resp = await self._post(st, data)
                st.headers(resp)
                if 200 <= resp.status < 300:
                    await self._read_stream(st, resp, on_first_token, body_cap(body))
                else:
                    await self._read_error(st, resp)
        except CallerError as exc:
            raise exc.args[0] from None
        except asyncio.CancelledError:  # by the shard (a stop): raised again below, with a tally
            st.cancelled()
            cancelled = True
        except TimeoutError:  # ours, or aiohttp's ServerTimeoutError (a subclass)
            if (broken := _broken_framing(st.resp)) is not None:
                after = counted(st.out.content_chunks, "token")
                st.fail("protocol_error",
                        f"invalid HTTP body after {after}: {clip(broken.message)}")
            st.timed_out()
        except aiohttp.ClientHttpProxyError as exc:  # the proxy refused the tunnel (CONNECT)
            st.out.http_status = exc.status
            st.fail(_status_of(exc.status), f"the proxy answered HTTP {exc.status}: "
                                            f"{clip(exc.message)}")
        except (aiohttp.ClientError, OSError, HttpProcessingError) as exc:
            # HttpProcessingError: a body's broken framing, as aiohttp's pure-Python parser
            # (no C extension for this Python) raises it, where the C one keeps it aside
            st.fail(*_describe(exc, st.out.content_chunks, self._accepts))
            if out_of_files(exc):  # this machine's limit, not the endpoint's fault
                st.out.error_code = OUT_OF_FILES
            elif type(exc) is aiohttp.ClientResponseError and st.resp is None:
                # no HTTP answer at all (a TLS port spoken to in plain http, another protocol):
                # every request meets it, so it is no answer (`Shard._note_failure`)
                st.out.not_an_answer = True
            elif _undecodable(exc) and st.resp is not None and 200 <= st.resp.status < 300:
                # a body that is no answer, as every request may meet it (an error's body that
                # does not decode leaves its status to speak: a 429 is still waited out)
                st.out.not_an_answer = not st.out.content_chunks
        finally:
            CURRENT.reset(token)
            _settle(st)
        if cancelled:
            raise AttemptCancelled(st.finish())
        try:
            st.notify_conn()  # if the attempt failed after the connection, before headers
        except CallerError as exc:
            raise exc.args[0] from None
        return st.finish()

    async def _post(self, st: Attempt, data: bytes) -> aiohttp.ClientResponse:
        """POST the request; again, on another connection, where a pooled one turned out dead
        before any answer came (`_stale`), as many times as the pool has connections (each such
        failure closes one), so the last try is on a new connection. aiohttp retries so only
        idempotent methods, and a POST failed the attempt: a keep-alive connection the server
        closed as the request went out on it (nginx's keepalive_timeout, keepalive_requests), or
        a balancer's idle reset, cost the item one of its attempts and began an outage.
        Only a connection that dies within `RESEND_WITHIN_S` of the send is taken for stale: one
        that dies later died under a server that had the request and worked on it (a crash, a
        worker killed), whose failure is the attempt's, not to be sent again unseen."""
        connector = self._session.connector
        tries = (connector.limit if connector is not None and connector.limit else 100) + 1
        while True:
            st.arm(self._timeouts.connect_s, "timeout_connect")
            try:
                return await self._session.post(
                    self._url, data=data, headers=self._headers, **self._post_kw
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                tries -= 1
                if not tries or not _stale(st, exc) or _on_it(st) > RESEND_WITHIN_S:
                    raise
            st.reconnect()

    async def answers(self, timeout_s: float) -> bool:
        """Whether the server gives an HTTP answer of its own (any status but a gateway's 502
        or 504) to a GET of its model list, next to the API's path, within `timeout_s`.

        An outage's check that the server is up, when the only requests it can judge by are
        one item's: a request that crashes the server's worker, or that a proxy refuses by
        closing the connection, fails with no answer at all, as an endpoint that is down
        does; at a cap of 1 it would hold the shard until `retry.outage_s` stopped the run."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.get(self._models_url, headers=self._headers,
                                             **self._post_kw) as resp:
                    return resp.status not in (502, 504)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def _read_stream(
        self, st: Attempt, resp: aiohttp.ClientResponse, on_first_token: OnFirstToken | None,
        body_max: int,
    ) -> None:
        """The hot loop: per read one decoder call; per read with events one clock sample.

        Until the first event the body is kept: a server that ignores `stream` sends one JSON
        answer instead, which is taken whole at the end of the body (`Attempt.take_whole`).
        A body that brings no event in `_UNENDED_MAX` bytes (half of `body_max` where that is
        more), or passes `body_max`, fails at once: the decoder and the answer hold what it
        sent, so memory stays bounded.
        """
        decoder, read, now_of = SSEDecoder(), resp.content.readany, self._clock.now
        feed, out, idle = decoder.feed, st.out, self._timeouts.idle_s
        waiting_first = True
        before_events: list[bytes] | None = []
        received = last_event = 0  # bytes of body read, in all and when the last event came
        # One event may be a good part of a long answer: the Responses API's closing events
        # each repeat the whole text, logprobs and all (21.6 MiB at 20k tokens with 20 each).
        unended_max = _UNENDED_MAX if body_max <= _BODY_MAX else body_max // 2
        while True:
            chunk = await read()
            payloads = feed(chunk) if chunk else decoder.close()
            received += len(chunk)
            if before_events is not None:
                if payloads or received > _WHOLE_MAX:
                    before_events = None
                else:
                    before_events.append(chunk)
            stop = False
            if payloads:
                last_event = received
                self.heard_at = heard = now_of()  # one store per read with events
                stop = st.take(payloads, heard)
            elif received - last_event > unended_max:
                _fail_stream(st, resp, f"a line or an event without end: no complete event in "
                                       f"{unended_max >> 20} MiB of stream")
                break
            if waiting_first and out.first_token_at is not None:
                waiting_first = False
                if on_first_token is not None:
                    call_caller(on_first_token, out.first_token_at)
            if stop or not chunk:
                break
            if received > body_max:
                _fail_stream(st, resp, f"a stream without end: past {body_max >> 20} MiB")
                break
            if not waiting_first:
                st.arm(idle, "timeout_idle")
        if st.done:
            st.arm(min(idle, _DRAIN_S), "drain")  # let the body end so the connection pools
            while await read():
                pass
        elif not chunk:
            whole = False
            body = b"".join(before_events or ())
            try:
                if body:
                    whole = st.take_whole(body, now_of())
            except Unreadable as exc:  # JSON, but no answer: never an empty success
                _fail_stream(st, resp, f"an unreadable answer: {exc}", tokens=False)
                return
            if whole:
                if out.first_token_at is not None and on_first_token is not None:
                    call_caller(on_first_token, out.first_token_at)
                return
            if (self._api != "responses" and st.reader.finish_reason is not None
                    and not st.failed):
                # The body ended cleanly after the answer's finish_reason, with no [DONE]: some
                # servers send none (ik_llama.cpp's unless started with --send-done). The answer
                # is whole; only a usage chunk may be missing, and then its tokens are estimated.
                st.done = True
                return
            if (page := html_page(body)) is not None:  # a login page, a proxy's notice
                _fail_stream(st, resp, f"{page}, not an event stream", tokens=False)
                return
            # A server's or a proxy's own words ("Internal Server Error"): its content type
            # alone left the user to fetch the page to learn what it said.
            if "text/plain" in resp.headers.get("Content-Type", "") and (
                    said := clip(text_head(body, _SAID_READ), _SAID_MAX)):
                _fail_stream(st, resp, f"a text that says {quoted(said)}, not an event stream",
                             tokens=False)
                return
            last = "response.completed" if self._api == "responses" else "[DONE]"
            _fail_stream(st, resp, f"stream ended before {last}")

    async def _read_error(self, st: Attempt, resp: aiohttp.ClientResponse) -> None:
        """Non-2xx: classify by status at once, then read up to 64 KiB of body for the message."""
        code = resp.status
        prefix = f"HTTP {code}" if code >= 400 else f"unexpected HTTP {code}"
        if 300 <= code < 400:
            # Never followed (`allow_redirects`): the same for every request, an http:// URL
            # the server moves to https:// or a login page, so no answer, and it says where.
            # Not a 307, the temporary redirect a load balancer sends while it drains a
            # replica: retried as any failure (ten at once stopped a run the rest served).
            st.out.not_an_answer = code != 307
            if where := resp.headers.get("Location"):
                prefix += f", a redirect to {_shown_location(where)} that is not followed"
        st.fail(_status_of(code), prefix)  # stands if reading the body fails or times out
        st.arm(self._timeouts.idle_s, "timeout_idle")
        parts: list[bytes] = []
        size = 0
        while size < _ERROR_BODY_MAX and (chunk := await resp.content.readany()):
            parts.append(chunk)
            size += len(chunk)
        body = b"".join(parts)
        message, st.out.error_code, st.out.flagged = read_error_body(
            body[:_ERROR_BODY_MAX], cut=size >= _ERROR_BODY_MAX)
        st.out.error = f"{prefix}: {message}"


def endpoint_url(base_url: str, path: str) -> str:
    """`path` appended to the base URL's path; its query stays at the end, so a server that wants
    one (`?api-version=...` for Azure OpenAI's deployments) gets it on every request."""
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + path))


def request_headers(api_key: str | None, key_header: str,
                    extra: Mapping[str, str]) -> dict[str, str]:
    """The headers a job adds to every request: its own, and the key in `key_header` (as
    `Bearer KEY` in Authorization, as it is in any other header)."""
    headers = dict(extra)
    keep_secret(api_key)  # in any error a server quotes it back in (`clip`)
    if api_key:
        bearer = key_header.lower() == "authorization"
        headers[key_header] = f"Bearer {api_key}" if bearer else api_key
    return headers


def refused_stream_options(http_status: int | None, error: str | None) -> bool:
    """Whether an answer says the server does not know `stream_options`, the option that asks
    for usage in a stream: servers and API versions that predate it answer 400 naming it (422
    from a strict request schema)."""
    return http_status in (400, 422) and "stream_options" in (error or "")


def _shown_location(location: str) -> str:
    """A redirect's target as a message shows it: without its query and fragment (a login
    page's return address, a session's token) and with any password masked."""
    try:
        parts = urlsplit(location)
        return clip(masked_url(urlunsplit(parts._replace(query="", fragment=""))))
    except ValueError:  # not a URL (a bad port, an unclosed IPv6 bracket)
        return "an invalid URL"


def _status_of(code: int) -> str:
    """The attempt status of a non-2xx HTTP answer."""
    return (
        "http_429" if code == 429 else "http_5xx" if code >= 500
        else "http_4xx" if code >= 400 else "protocol_error"
    )  # fmt: skip


def _fail_stream(st: Attempt, resp: aiohttp.ClientResponse, what: str,
                 tokens: bool = True) -> None:
    """The 2xx body is no whole answer: a protocol_error saying `what` and how far the stream
    came (unless not `tokens`: a whole answer has none); a body that is no event stream and
    brought no token is `not_an_answer`."""
    ctype = resp.headers.get("Content-Type", "")
    stream = "event-stream" in ctype
    note = "" if stream else f" (content-type {clip(ctype) or 'missing'})"
    n = st.out.content_chunks
    after = f" after {counted(n, 'token')}" if tokens else ""
    st.fail("protocol_error", f"{what}{after}{note}")
    st.out.not_an_answer = not stream and not n


def _settle(st: Attempt) -> None:
    """Give the connection back only after a complete response; otherwise drop it.

    A stalled or half-read stream returned to the pool would hand the next attempt a connection
    with stale bytes (or a dead peer), so failures close instead of release. A fully read HTTP
    error (a 429, say) leaves a clean connection: keeping it avoids churn under rate limiting.
    """
    st.disarm()
    resp = st.resp
    if resp is None:
        return
    clean = st.done or (st.failed and st.out.status.startswith("http_"))
    if clean and resp.content.at_eof() and not st.tm.expired():
        resp.release()
    else:
        resp.close()


def _on_it(st: Attempt) -> float:
    """How long the request has been on its connection: since the pool handed it out, so that
    a wait for a free connection (a full pool, a loaded machine) does not count."""
    ready = st.out.conn_ready_at
    return 0.0 if ready is None else st.clock.now() - ready


def _stale(st: Attempt, exc: BaseException) -> bool:
    """Whether a failed POST met a stale pooled connection: one handed out before, which
    failed with no answer (no status line) as the request went out or was awaited. The
    server closed it in between, or resets it now; a new connection may well be answered."""
    return (st.out.conn_reused is True and st.resp is None
            and not isinstance(exc, aiohttp.ClientConnectorError) and not out_of_files(exc))


def _describe(exc: BaseException, tokens: int,
              accepts: str = "") -> tuple[str, str]:  # fmt: skip
    """Map an aiohttp/OS exception to (status, one human sentence); `accepts` is the
    Accept-Encoding the request sent."""
    if out_of_files(exc):
        return "conn_reset", f"no file descriptor left for a connection: {clip(exc)}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Through a proxy (shardrun.proxy), the connection that failed is the proxy's.
        via = "the proxy " if isinstance(exc, aiohttp.ClientProxyConnectionError) else ""
        if _is_dns_failure(exc):
            return "conn_reset", (f"cannot resolve {via}{exc.host}: "
                                  f"{exc.os_error.strerror or exc.os_error}")
        where = f"{via}{exc.host}:{exc.port}"
        if isinstance(exc.os_error, ConnectionRefusedError) or "refused" in str(exc).lower():
            return "conn_reset", f"connection refused by {where}"
        if getattr(exc.os_error, "reason", None) == "WRONG_VERSION_NUMBER":  # no TLS answered
            return "conn_reset", (f"cannot connect to {where}: it does not answer TLS (an "
                                  "https:// URL for a server that speaks plain HTTP? try "
                                  "http://)")
        return "conn_reset", f"cannot connect to {where}: {exc.os_error.strerror or exc.os_error}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "conn_reset", f"server closed the connection after {counted(tokens, 'token')}"
    if isinstance(exc, HttpProcessingError):
        after = counted(tokens, "token")
        return "protocol_error", f"invalid HTTP body after {after}: {clip(exc.message)}"
    if _undecodable(exc):
        said = clip(getattr(exc.__cause__, "message", exc))
        return "protocol_error", f"undecodable body after {counted(tokens, 'token')}: {said}"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "conn_reset", _cut_short(exc, counted(tokens, "token"))
    if isinstance(exc, aiohttp.ClientResponseError):
        if (past := _past_its_length(exc.message)) is not None:
            return "protocol_error", ("invalid HTTP response: its body ran past its "
                                      "Content-Length (the server sent more than it said; "
                                      f"where the next answer was looked for: {clip(past)})")
        if (refused := _NO_DECODER.match(str(exc.message))) is not None:
            said = f"the server compressed its answer as {refused[1]} (Content-Encoding), which"
            asked = {name.strip().lower() for name, _, q in (t.partition(";")
                                                              for t in accepts.split(","))
                     if not _REFUSED.fullmatch(q.strip())}  # "*;q=0": all else refused
            if asked & {refused[1].lower(), "*"}:  # the job's own header asked for it
                return "protocol_error", (f"{said} endpoint.headers asked for (Accept-Encoding: "
                                          f"{clip(accepts)}) but this client cannot read: ask "
                                          "only for gzip, deflate or identity there")
            return "protocol_error", (f"{said} this client did not ask for (Accept-Encoding: "
                                      f"{clip(accepts)}) and cannot read: have it send gzip or "
                                      "no compression")
        said = clip(exc.message)
        if any(record in said for record in _TLS_RECORDS):
            said += " (a TLS server: endpoint.base_url wants https://)"
        return "protocol_error", f"invalid HTTP response: {said}"
    if isinstance(exc, aiohttp.ClientConnectionError | OSError):
        return "conn_reset", f"connection lost after {counted(tokens, 'token')}: {clip(exc)}"
    return "protocol_error", f"{type(exc).__name__}: {clip(exc)}"


def _cut_short(exc: aiohttp.ClientPayloadError, after: str) -> str:
    """The sentence of a body the connection's end cut short of what its framing promised."""
    cause = exc.__cause__
    if isinstance(cause, ContentLengthError):
        got = _RECEIVED.search(str(cause.message))  # "(received 143 of 151 bytes)"
        said = f"at byte {got[1]} of the {got[2]}" if got else "before the end of the bytes"
        return (f"response cut short: the connection ended {said} its Content-Length says "
                f"({after})")
    if isinstance(cause, TransferEncodingError):
        return f"response cut short: the connection ended before the body's last chunk ({after})"
    return f"response body cut after {after}: {clip(exc)}"


_RECEIVED = re.compile(r"received (\d+) of (\d+) bytes")

_BAD_LINE = re.compile(r"\n  (b(['\"]).*)\n  ( *)\^")
"""aiohttp's C parser's bad status line: the line it failed on (a bytes literal), and a caret
under the byte it failed at."""


def _past_its_length(message: str) -> str | None:
    """The bytes after an answer whose body ran past its Content-Length, where a bad status
    line is them (None otherwise). aiohttp's C parser reads them, when they came in the same
    packet, as the next answer's status line, and drops the answer it read. A line that is the
    first answer fails at its first byte, or within "HTTP/": bytes before the caret that no
    status line begins with are the end of the body before it (a body that ends in a line
    break leaves none, and its overrun reads as any other bad status line). Only a bad status
    line: a bad header, Content-Length or chunk size shows its line and a caret too."""
    line = _BAD_LINE.search(message) if message.startswith("Bad status line:") else None
    if line is None:
        return None
    literal, quote, caret = line[1], line[2], len(line[3])
    before = literal[2:caret][:5]
    if not before or any(start.startswith(before) for start in ("HTTP/", "RTSP/", "ICE/")):
        return None
    return quote + literal[caret:]


ACCEPT_ENCODING = aiohttp.ClientRequest.DEFAULT_HEADERS.get(aiohttp.hdrs.ACCEPT_ENCODING, "")
"""What aiohttp asks for: gzip and deflate, and br and zstd only where their modules are
installed. A server (or a gateway) may compress with one of those anyway, and aiohttp, with no
decoder for it, reads the response's head as broken (`_NO_DECODER`)."""
_NO_DECODER = re.compile(r"Can not decode content-encoding: [^(]*\((\w+)\)")
"""aiohttp's words for an encoding it has no decoder for ("brotli (br)"), which asked its user
to install a module: the fix is the server's, so the message names the encoding instead."""
_REFUSED = re.compile(r"q\s*=\s*0(?:\.0{0,3})?")
"""An Accept-Encoding entry's weight that refuses the encoding it names."""
_TLS_RECORDS = ("b'\\x15\\x03", "b'\\x16\\x03")
"""How aiohttp's bad status line shows a TLS record's start (an alert, a handshake): what a TLS
server answers a plain-http request with, if anything."""


def _broken_framing(resp: aiohttp.ClientResponse | None) -> HttpProcessingError | None:
    """The error that broke the body's framing (a bad chunk size), which aiohttp keeps on the
    connection's protocol, not on the body: a read of the body then waits for its deadline.
    Read when that deadline passed, so the failure names it."""
    conn = None if resp is None else resp.connection
    protocol = None if conn is None else conn.protocol
    broken = None if protocol is None else protocol.exception()
    return broken if isinstance(broken, HttpProcessingError) else None


def _undecodable(exc: BaseException) -> bool:
    """The body's Content-Encoding (gzip, deflate) does not decode: a body that is not what
    its headers say, not one that was cut (aiohttp raises both as ClientPayloadError)."""
    return isinstance(exc, aiohttp.ClientPayloadError) and isinstance(exc.__cause__,
                                                                      ContentEncodingError)


def _is_dns_failure(exc: aiohttp.ClientConnectorError) -> bool:
    """aiohttp >= 3.10.10 raises ClientConnectorDNSError; older ones wrap a gaierror."""
    named = getattr(aiohttp, "ClientConnectorDNSError", None)
    dns = named is not None and isinstance(exc, named)
    return dns or isinstance(exc.os_error, socket.gaierror)
