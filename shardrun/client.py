"""One streaming attempt against an OpenAI-compatible endpoint, as an `AttemptOutcome` value.

A failed request is data, not an exception: the shard turns every outcome into an `attempt_end`
event and decides about retries from `status`. Only cancellation propagates.

    status               when
    ok                   the stream reached `data: [DONE]`
    http_429 / _5xx      HTTP 429 / 5xx, or an error object with that code inside the stream
    http_4xx             any other HTTP 4xx (message taken from the error body, <= 64 KiB read)
    timeout_connect      no connection (pool slot + DNS + TCP/TLS) within connect_s
    timeout_first_token  no content token within first_token_s after the connection was ready
    timeout_idle         no bytes for idle_s after the first token
    timeout_total        the attempt as a whole exceeded total_s (wins over the others)
    conn_reset           refused, reset, DNS failure, server disconnected, body cut mid-chunk
    protocol_error       no [DONE] before end of stream, unparseable JSON, other in-stream error

Deadlines: one deadline per attempt that moves as the attempt advances (connect -> first token ->
idle, each capped by start + total_s), enforced by a watchdog timer that expires the attempt's
`asyncio.Timeout`; `kind` remembers which limit is armed, so an expiry names its own status.
A read only stores a float: no timer churn and no task per read.

Connection timing: `make_session` installs a TraceConfig; `attempt` passes its per-attempt state as
`trace_request_ctx`, so aiohttp's `on_connection_create_end` / `on_connection_reuseconn` callbacks
stamp `conn_ready_at` and `conn_reused` on the right attempt. The caller's `on_conn_ready` runs
after aiohttp returns control (response headers or failure), never inside aiohttp's connector.

The JSON inside the stream and in error bodies is read by `shardrun._chunks` (pure: no I/O).
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Literal

import aiohttp
import orjson

from shardrun._chunks import (
    PARSE_ERRORS,
    ChunkReader,
    clip,
    error_message,
    is_rate_header,
    stream_error,
)
from shardrun.clock import Clock
from shardrun.itl import ItlHistogram
from shardrun.sse import SSEDecoder

_ERROR_BODY_MAX = 64 * 1024
_DRAIN_S = 1.0  # after [DONE], how long to wait for the end of the body so the connection pools
_KEEPALIVE_S = 30.0
# Same condition aiohttp uses: only these Pythons leak closed TLS transports.
_NEEDS_CLEANUP_CLOSED = sys.version_info < (3, 12, 8) or (3, 13, 0) <= sys.version_info < (3, 13, 1)


class _CallerError(Exception):
    """Carries an exception raised by a caller's callback past the failure classification.

    A callback that fails (say, the event writer hits a full disk: OSError) is the caller's
    problem and must reach the caller, not be mistaken for a network error (conn_reset).
    """


def _call(callback: Callable[..., None], *args: object) -> None:
    try:
        callback(*args)
    except Exception as exc:
        raise _CallerError(exc) from exc


OnConnReady = Callable[[float, bool], None]
"""Called once per attempt with (conn_ready_at, reused), before any token callback."""
OnFirstToken = Callable[[float], None]
"""Called once per attempt with first_token_at."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeouts:
    """Per-attempt limits in seconds; see the module docstring for what each one covers."""

    connect_s: float = 10.0
    first_token_s: float = 60.0
    idle_s: float = 30.0
    total_s: float = 600.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            ok = isinstance(v, int | float) and not isinstance(v, bool)
            if not (ok and math.isfinite(v) and v > 0):
                raise ValueError(f"timeout {f.name} must be a positive number of seconds: {v!r}")


@dataclass(slots=True, kw_only=True)
class AttemptOutcome:
    """Everything the shard logs about one attempt. Times are `Clock.now()` seconds.

    `completion_tokens` is the server's usage figure when it sent one, else the number of content
    chunks (`usage_estimated` True). `itl` holds the gaps between successive content chunks.
    """

    status: str = "ok"
    http_status: int | None = None
    retry_after: str | None = None
    rate_headers: dict[str, str] = field(default_factory=dict)
    started_at: float
    conn_ready_at: float | None = None
    conn_reused: bool | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    ended_at: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    usage_estimated: bool = True
    content_chunks: int = 0
    itl: ItlHistogram = field(default_factory=ItlHistogram)
    error: str | None = None

    @property
    def wasted_tokens(self) -> int:
        """Content chunks received by an attempt that did not succeed (paid for, thrown away)."""
        return 0 if self.status == "ok" else self.content_chunks


def make_session(cap: int, timeouts: Timeouts) -> aiohttp.ClientSession:
    """The shard's one session: a pool of `cap` keep-alive connections, traced for reuse.

    Call it inside the running event loop. There is no session-level total/read timeout: the
    client enforces its own deadlines; `sock_connect` is only a per-socket backstop.
    """
    if cap < 1:
        raise ValueError(f"cap must be at least 1, got {cap}")
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(_on_conn_created)
    trace.on_connection_reuseconn.append(_on_conn_reused)
    connector = aiohttp.TCPConnector(
        limit=cap,
        limit_per_host=cap,
        keepalive_timeout=_KEEPALIVE_S,
        enable_cleanup_closed=_NEEDS_CLEANUP_CLOSED,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
        trace_configs=[trace],
    )


async def _on_conn_created(
    session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object
) -> None:
    if isinstance(st := ctx.trace_request_ctx, _Attempt):
        st.conn_ready(reused=False)


async def _on_conn_reused(
    session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object
) -> None:
    if isinstance(st := ctx.trace_request_ctx, _Attempt):
        st.conn_ready(reused=True)


class _Attempt:
    """Mutable state of one attempt and its `trace_request_ctx`; fills `out` as it goes."""

    __slots__ = ("clock", "deadline", "done", "failed", "kind", "loop", "notified", "on_conn",
                 "out", "pieces", "reader", "resp", "tm", "total_dl", "touts", "watch",
                 "watch_at")  # fmt: skip

    def __init__(self, chat: bool, clock: Clock, touts: Timeouts, tm: asyncio.Timeout,
                 on_conn: OnConnReady | None) -> None:  # fmt: skip
        self.clock, self.touts, self.tm, self.on_conn = clock, touts, tm, on_conn
        self.reader = ChunkReader(chat)
        self.loop = asyncio.get_running_loop()
        self.out = AttemptOutcome(started_at=clock.now())
        self.total_dl = self.deadline = self.loop.time() + touts.total_s
        self.kind = "timeout_total"  # which limit `deadline` stands for
        self.watch: asyncio.TimerHandle | None = None
        self.watch_at = math.inf
        self.pieces: list[str] = []
        self.done = self.failed = self.notified = False
        self.resp: aiohttp.ClientResponse | None = None

    def arm(self, delay: float, kind: str) -> None:
        """Move the deadline to `delay` from now, capped by the total deadline.

        Called on every read, so it only stores a float; the watchdog timer is touched only when
        the deadline moves *earlier* than it (a few times per attempt). Rescheduling a timer per
        read would cost more than parsing the chunk.
        """
        when = self.loop.time() + delay
        if when >= self.total_dl:
            when, kind = self.total_dl, "timeout_total"
        self.deadline, self.kind = when, kind
        if when < self.watch_at:
            if self.watch is not None:
                self.watch.cancel()
            self.watch, self.watch_at = self.loop.call_at(when, self._check), when

    def _check(self) -> None:
        """Watchdog: sleep again if the deadline moved later, else expire the attempt's Timeout."""
        now = self.loop.time()
        if now < self.deadline:
            self.watch, self.watch_at = self.loop.call_at(self.deadline, self._check), self.deadline
        else:
            self.watch, self.watch_at = None, math.inf
            if not self.tm.expired():
                self.tm.reschedule(now)  # cancels the task; `async with` turns it into TimeoutError

    def disarm(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None

    def conn_ready(self, reused: bool | None) -> None:
        """A connection is ours: the first-token clock starts now."""
        if self.out.conn_ready_at is None:
            self.out.conn_ready_at = self.clock.now()
            self.out.conn_reused = reused
            self.arm(self.touts.first_token_s, "timeout_first_token")

    def notify_conn(self) -> None:
        """Tell the caller once, outside aiohttp's connector (a raising callback can't leak it)."""
        t = self.out.conn_ready_at
        if not self.notified and t is not None:
            self.notified = True
            if self.on_conn is not None:
                _call(self.on_conn, t, bool(self.out.conn_reused))

    def fail(self, status: str, error: str) -> None:
        """Record a failure; the first one wins, and nothing overrides a completed stream."""
        if not self.failed and not self.done:
            self.failed = True
            self.out.status, self.out.error = status, error

    def headers(self, resp: aiohttp.ClientResponse) -> None:
        """Response headers arrived: status, Retry-After, x-ratelimit-*; trace fallback."""
        self.resp = resp
        if self.out.conn_ready_at is None:  # a session without our TraceConfig
            self.conn_ready(None)
        out, hdrs = self.out, resp.headers
        out.http_status = resp.status
        out.retry_after = hdrs.get("Retry-After")
        out.rate_headers = {k.lower(): v for k, v in hdrs.items() if is_rate_header(k)}
        self.notify_conn()

    def take(self, payloads: list[str], now: float) -> bool:
        """Apply the payloads of one read; True when the stream is finished (done or failed).

        The hot path: per content chunk one `orjson.loads`, one `take_choices`, and the timing.
        """
        out, reader, payload = self.out, self.reader, ""
        try:
            for payload in payloads:
                if payload == "[DONE]":
                    self.done = True
                    return True
                obj = orjson.loads(payload)
                if obj.get("error") is not None:
                    self.fail(*stream_error(obj["error"], out.content_chunks))
                    return True
                if choices := obj.get("choices"):
                    piece = reader.take_choices(choices)
                    if piece is not None:
                        last = out.last_token_at
                        if last is None:
                            out.first_token_at = now
                        else:
                            out.itl.add(now - last)
                        out.last_token_at = now
                        out.content_chunks += 1
                        self.pieces.append(piece)
                if usage := obj.get("usage"):
                    reader.take_usage(usage)
        except PARSE_ERRORS:
            n = out.content_chunks
            self.fail("protocol_error", f"unparseable stream data after {n} tokens: "
                      f"{clip(payload)}")  # fmt: skip
            return True
        return False

    def timed_out(self) -> None:
        """Our deadline (or aiohttp's socket-connect backstop) expired: name the phase."""
        ours = self.tm.expired() or self.out.conn_ready_at is not None
        kind = self.kind if ours else "timeout_connect"
        t, n = self.touts, self.out.content_chunks
        self.fail(kind, {
            "timeout_connect": f"no connection within {t.connect_s} s",
            "timeout_first_token": f"no token for {t.first_token_s} s after the connection "
                                   "was ready",
            "timeout_idle": f"no data for {t.idle_s} s after {n} tokens",
            "timeout_total": f"attempt exceeded {t.total_s} s after {n} tokens",
        }.get(kind, f"timed out after {n} tokens"))  # fmt: skip

    def finish(self) -> AttemptOutcome:
        out = self.out
        out.ended_at = self.clock.now()
        out.text = "".join(self.pieces)
        r = self.reader
        out.finish_reason, out.prompt_tokens = r.finish_reason, r.prompt_tokens
        out.usage_estimated = (tokens := r.completion_tokens) is None
        out.completion_tokens = out.content_chunks if tokens is None else tokens
        return out


class StreamingClient:
    """Runs attempts against one endpoint over the shard's session. Stateless between attempts."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        api: Literal["chat", "completions"],
        headers: Mapping[str, str],
        timeouts: Timeouts,
        clock: Clock,
    ) -> None:
        path = "/chat/completions" if api == "chat" else "/completions"
        self._session, self._timeouts, self._clock = session, timeouts, clock
        self._chat = api == "chat"
        self._url = base_url.rstrip("/") + path
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        self._headers.update(headers)

    async def attempt(
        self,
        body: Mapping[str, object],
        on_conn_ready: OnConnReady | None = None,
        on_first_token: OnFirstToken | None = None,
    ) -> AttemptOutcome:
        """POST `body` (sent as given) and read the stream. Never raises but for cancellation."""
        data = orjson.dumps(body)
        tm = asyncio.timeout(None)
        st = _Attempt(self._chat, self._clock, self._timeouts, tm, on_conn_ready)
        try:
            async with tm:
                st.arm(self._timeouts.connect_s, "timeout_connect")
                resp = await self._session.post(
                    self._url, data=data, headers=self._headers, allow_redirects=False,
                    trace_request_ctx=st,
                )  # fmt: skip
                st.headers(resp)
                if 200 <= resp.status < 300:
                    await self._read_stream(st, resp, on_first_token)
                else:
                    await self._read_error(st, resp)
        except _CallerError as exc:
            raise exc.args[0] from None
        except TimeoutError:  # ours, or aiohttp's ServerTimeoutError (a subclass)
            st.timed_out()
        except (aiohttp.ClientError, OSError) as exc:
            st.fail(*_describe(exc, st.out.content_chunks))
        finally:
            _settle(st)
        try:
            st.notify_conn()  # if the attempt failed after the connection, before headers
        except _CallerError as exc:
            raise exc.args[0] from None
        return st.finish()

    async def _read_stream(
        self, st: _Attempt, resp: aiohttp.ClientResponse, on_first_token: OnFirstToken | None
    ) -> None:
        """The hot loop: per read one clock sample, one decoder call, payloads applied."""
        decoder, read, now_of = SSEDecoder(), resp.content.readany, self._clock.now
        idle = self._timeouts.idle_s
        waiting_first = True
        while True:
            chunk = await read()
            stop = st.take(decoder.feed(chunk) if chunk else decoder.close(), now_of())
            if waiting_first and st.out.first_token_at is not None:
                waiting_first = False
                if on_first_token is not None:
                    _call(on_first_token, st.out.first_token_at)
            if stop or not chunk:
                break
            if not waiting_first:
                st.arm(idle, "timeout_idle")
        if st.done:
            st.arm(min(idle, _DRAIN_S), "drain")  # let the body end so the connection pools
            while await read():
                pass
        elif not chunk:
            ctype = resp.headers.get("Content-Type", "")
            note = "" if "event-stream" in ctype else f" (content-type {ctype or 'missing'})"
            n = st.out.content_chunks
            st.fail("protocol_error", f"stream ended before [DONE] after {n} tokens{note}")

    async def _read_error(self, st: _Attempt, resp: aiohttp.ClientResponse) -> None:
        """Non-2xx: classify by status at once, then read up to 64 KiB of body for the message."""
        code = resp.status
        status = (
            "http_429" if code == 429 else "http_5xx" if code >= 500
            else "http_4xx" if code >= 400 else "protocol_error"
        )  # fmt: skip
        prefix = f"HTTP {code}" if code >= 400 else f"unexpected HTTP {code}"
        st.fail(status, prefix)  # stands if reading the body fails or times out
        st.arm(self._timeouts.idle_s, "timeout_idle")
        parts: list[bytes] = []
        size = 0
        while size < _ERROR_BODY_MAX and (chunk := await resp.content.readany()):
            parts.append(chunk)
            size += len(chunk)
        st.out.error = f"{prefix}: {error_message(b''.join(parts)[:_ERROR_BODY_MAX])}"


def _settle(st: _Attempt) -> None:
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


def _describe(exc: BaseException, tokens: int) -> tuple[str, str]:
    """Map an aiohttp/OS exception to (status, one human sentence)."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "conn_reset", f"cannot resolve {exc.host}: {exc.os_error.strerror or exc.os_error}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        where = f"{exc.host}:{exc.port}"
        if isinstance(exc.os_error, ConnectionRefusedError) or "refused" in str(exc).lower():
            return "conn_reset", f"connection refused by {where}"
        return "conn_reset", f"cannot connect to {where}: {exc.os_error.strerror or exc.os_error}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "conn_reset", f"server closed the connection after {tokens} tokens"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "conn_reset", f"response body cut after {tokens} tokens: {clip(exc)}"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "protocol_error", f"invalid HTTP response: {clip(exc.message)}"
    if isinstance(exc, aiohttp.ClientConnectionError | OSError):
        return "conn_reset", f"connection lost after {tokens} tokens: {clip(exc)}"
    return "protocol_error", f"{type(exc).__name__}: {clip(exc)}"
