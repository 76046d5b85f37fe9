"""Per-attempt state of `shardrun.client`: deadlines, connection stamping, chunk application.

`Attempt` is one attempt's mutable state; `StreamingClient.attempt` drives it, and the session's
`StampingConnector` (from `make_session`) stamps it when it hands out a connection. The statuses
and the limits are described in `shardrun.client`; the public names are re-exported from there.

Connection stamping: the connector finds the attempt through `CURRENT`, a context variable that
`StreamingClient.attempt` sets around its request (aiohttp runs `connect()` in the caller's task,
so it sees the value), and tells a new connection from a pooled one by whether it has handed out
that connection's protocol object before. This replaces an `aiohttp.TraceConfig`, which costs
about 80 µs per request: aiohttp then builds a Trace and an attrs parameter object and sends a
signal at every trace point (request start, each chunk sent and received, headers, end).

Deadlines: one deadline per attempt that moves as the attempt advances (connect -> first token ->
idle, each capped by start + total_s), enforced by the client's `Watchdog`, which looks at its
attempts' deadlines every `SWEEP_S` and expires the attempt's `asyncio.Timeout` once its
deadline has passed; `kind` remembers which limit is armed, so an expiry names its own status.
Arming only stores a float: no timer per attempt, and no task.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import aiohttp

from shardrun._chunks import (
    BAD,
    DONE,
    MORE,
    RATE_PREFIX,
    ChunkReader,
    Unreadable,
    clip,
    error_name,
    stream_error,
)
from shardrun._ellipsis import counted
from shardrun._responses import ResponsesReader
from shardrun.clock import Clock
from shardrun.items import Api, tokens_of_chars
from shardrun.itl import ItlHistogram
from shardrun.retry import retry_after_of

if TYPE_CHECKING:
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.client_reqrep import ClientRequest
    from aiohttp.connector import Connection
    from aiohttp.tracing import Trace


class CallerError(Exception):
    """Carries an exception raised by a caller's callback past the failure classification.

    A callback that fails (say, the event writer hits a full disk: OSError) is the caller's
    problem and must reach the caller, not be mistaken for a network error (conn_reset).
    """


def call_caller(callback: Callable[..., None], *args: object) -> None:
    try:
        callback(*args)
    except Exception as exc:
        raise CallerError(exc) from exc


class AttemptCancelled(asyncio.CancelledError):
    """The attempt was cancelled (a stop's grace period ended, or a second Ctrl-C).

    It is still a cancellation to asyncio; it carries what the attempt had received by then
    (status `cancelled`), so the shard can log the attempt's end before the task unwinds.
    """

    def __init__(self, outcome: AttemptOutcome) -> None:
        super().__init__()
        self.outcome = outcome


OnConnReady = Callable[[float, bool], None]
"""Called once per attempt with (conn_ready_at, reused), before any token callback."""
OnFirstToken = Callable[[float], None]
"""Called once per attempt with first_token_at."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeouts:
    """Per-attempt limits in seconds; see `shardrun.client` for what each one covers."""

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
    chunks, or for a whole (non-streamed) answer its characters / 4 (`usage_estimated` True).
    `itl` holds the gaps between successive content chunks. A content chunk is one that carries
    generated text: the answer's, or reasoning, or a piece of a tool call or of a refusal (all
    are tokens the model generated, and count as such for the first and last token too); `text`
    is the answer's alone, `reasoning`, `tool_calls`, `refusal` and `function_call` the others
    (None when the answer had none).
    """

    status: str = "ok"
    http_status: int | None = None
    retry_after: str | None = None
    rate_headers: dict[str, str] = field(default_factory=dict)
    started_at: float
    conn_ready_at: float | None = None
    conn_reused: bool | None = None
    # Times the request went again on another connection, its pooled one found dead before
    # any answer (`Attempt.reconnect`): the server read it that many times more.
    resent: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    ended_at: float = 0.0
    text: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None  # the model declined (OpenAI's `refusal`), in its words
    function_call: dict[str, str] | None = None  # a call in the older `functions` form
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    usage_estimated: bool = True
    cached_tokens: int | None = None  # of the prompt tokens, where the server counts them
    reasoning_tokens: int | None = None  # of the completion tokens, likewise
    content_chunks: int = 0
    itl: ItlHistogram = field(default_factory=ItlHistogram)
    error: str | None = None
    error_code: str | None = None  # the server's name for the error (its code, else its type)
    # The error body says a moderation check flagged the request's content (`read_error_body`):
    # the item is refused, not the credentials, whatever the status (OpenRouter's is 403).
    flagged: bool = False
    # A 2xx answer that was no event stream and no JSON answer: a login page, a proxy's notice,
    # a web app at the wrong base_url. Every request would meet it (`Shard._note_failure`).
    not_an_answer: bool = False
    # The server ignored `stream` and sent one JSON body (`Attempt.take_whole`).
    whole: bool = False
    # The first token came with the rest of the answer, not before it: a whole answer, or a
    # stream a proxy held back and sent at its end (`AT_ONCE_CHUNKS`). Its first token is
    # then the body's end and its gaps are 0, so it says nothing of the server's queue or pace
    # and is left out of first-token and TPOT figures (`Shard._end_attempt`, the report).
    at_once: bool = False

    @property
    def wasted_tokens(self) -> int:
        """Content chunks received by an attempt that did not succeed (paid for, thrown away)."""
        return 0 if self.status == "ok" else self.content_chunks


AT_ONCE_MIN, AT_ONCE_CHUNKS = 4, 64
"""A stream whose first read of content brings all of an answer of `AT_ONCE_MIN` content
chunks or more, or `AT_ONCE_CHUNKS` of them, came at once (`AttemptOutcome.at_once`). A server
that streams sends its first token alone; for its first read to hold more, the client read
nothing for the gaps between them, so the first token it notes is late by all of them. Fewer
than 4 a fast server may honestly send in one write, and held back their first token is late
by a gap or two only. 64: a buffered burst of a long answer comes in reads of tens of KiB,
hundreds of chunks each."""

FAILED_FINISH = frozenset({"error", "abort"})
"""finish_reasons that say the server gave up on the answer: "error" (Together's API,
tt-inference-server), "abort" (vLLM and SGLang, for a request their engine aborted)."""

SWEEP_S = 0.1
"""How often a client's watchdog looks at its attempts' deadlines: a limit ends an attempt up
to this much after it has passed."""

FROZEN_S = 1.0
"""A watchdog's look this late means the client's loop did not run meanwhile (the process was
stopped, as by Ctrl-Z or a scheduler's suspend, or its loop was blocked): that time is not the
server's, so every deadline moves on by it (`Watchdog._sweep`)."""


class Watchdog:
    """One client's timer for the deadlines of all its attempts under way.

    Why one for all: a timer per attempt (made at its start, made again earlier for the drain
    after [DONE], cancelled at its end) cost about 4 % of the client's CPU at 8 x 32
    (docs/PERFORMANCE.md, "Side by side"), far more than the two timers cost in a loop on their
    own: uvloop makes a libuv handle for every timer and closes it when cancelled. This one
    runs every `SWEEP_S` while any attempt is watched, and not at all when none is.
    """

    __slots__ = ("_handle", "_looks_at", "attempts", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.attempts: set[Attempt] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._looks_at = 0.0  # when the next look is due

    def watch(self, st: Attempt) -> None:
        self.attempts.add(st)
        if self._handle is None:
            self._schedule()

    def _schedule(self) -> None:
        self._looks_at = self.loop.time() + SWEEP_S
        self._handle = self.loop.call_at(self._looks_at, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        if (frozen := now - self._looks_at) > FROZEN_S:
            # Whatever the server sent while the loop did not run waits unread in the sockets:
            # expiring now would blame the server for the client's own pause (every attempt
            # under way a timeout after a Ctrl-Z and `fg`).
            for st in self.attempts:
                st.deadline += frozen
                st.total_dl += frozen
        due = [st for st in self.attempts if st.deadline <= now]
        self.attempts.difference_update(due)
        # The next look is set first, and each expiry stands alone: nothing one of them might
        # raise can stop the watchdog or spare the attempts after it.
        if self.attempts:
            self._schedule()
        else:
            self._handle = None
        for st in due:
            try:
                st.expire(now)
            except Exception as exc:  # reported as the loop reports a failing callback
                self.loop.call_exception_handler(
                    {"message": "shardrun: expiring an attempt's deadline", "exception": exc})


CURRENT: ContextVar[Attempt | None] = ContextVar("shardrun_attempt", default=None)
"""The attempt whose request is running in this task, for `StampingConnector`."""


class StampingConnector(aiohttp.TCPConnector):
    """A TCPConnector that stamps the running attempt (`CURRENT`) with each connection it gives.

    Reused means "handed out before": the first `connect()` to return a given protocol object
    (one TCP connection) is new, every later one a pooled reuse. The stamp is a clock read and a
    float store; the caller's `on_conn_ready` runs later, outside the connector.
    """

    def __init__(self, *, limit: int, keepalive_timeout: float, cleanup_closed: bool) -> None:
        super().__init__(limit=limit, limit_per_host=limit, keepalive_timeout=keepalive_timeout,
                         enable_cleanup_closed=cleanup_closed)  # fmt: skip
        self._given: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()  # dies with the conn

    async def connect(
        self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout
    ) -> Connection:
        conn = await super().connect(req, traces, timeout)
        if (st := CURRENT.get()) is not None and (proto := conn.protocol) is not None:
            given = self._given
            reused = proto in given
            if not reused:
                given.add(proto)
            st.conn_ready(reused)
        return conn


class Attempt:
    """Mutable state of one attempt; fills `out` as it goes."""

    __slots__ = ("clock", "deadline", "done", "failed", "first_read", "kind", "loop", "notified",
                 "on_conn", "out", "pieces", "reader", "resp", "tm", "total_dl", "touts",
                 "watchdog", "whole_estimate")  # fmt: skip

    def __init__(self, api: Api, clock: Clock, touts: Timeouts, tm: asyncio.Timeout,
                 on_conn: OnConnReady | None, watchdog: Watchdog) -> None:  # fmt: skip
        self.clock, self.touts, self.tm, self.on_conn = clock, touts, tm, on_conn
        self.reader: ChunkReader | ResponsesReader = (
            ResponsesReader() if api == "responses" else ChunkReader(api == "chat"))
        self.loop = watchdog.loop
        self.out = AttemptOutcome(started_at=clock.now())
        self.total_dl = self.deadline = self.loop.time() + touts.total_s
        self.kind = "timeout_total"  # which limit `deadline` stands for
        self.watchdog = watchdog
        watchdog.watch(self)
        self.pieces: list[str] = []
        self.done = self.failed = self.notified = False
        self.resp: aiohttp.ClientResponse | None = None
        self.whole_estimate: int | None = None  # see take_whole
        self.first_read = 0  # content chunks of the read that brought the first token

    def arm(self, delay: float, kind: str) -> None:
        """Move the deadline to `delay` from now, capped by the total deadline.

        Called on every read, so it only stores a float, which the watchdog reads.
        """
        when = self.loop.time() + delay
        if when >= self.total_dl:
            when, kind = self.total_dl, "timeout_total"
        self.deadline, self.kind = when, kind

    def expire(self, now: float) -> None:
        """The deadline has passed (the watchdog): expire the attempt's Timeout."""
        if not self.tm.expired():
            self.tm.reschedule(now)  # cancels the task; `async with` turns it into TimeoutError

    def disarm(self) -> None:
        self.watchdog.attempts.discard(self)

    def conn_ready(self, reused: bool | None) -> None:
        """A connection is ours: the first-token clock starts now."""
        if self.out.conn_ready_at is None:
            self.out.conn_ready_at = self.clock.now()
            self.out.conn_reused = reused
            self.arm(self.touts.first_token_s, "timeout_first_token")

    def reconnect(self) -> None:
        """The pooled connection was dead before any answer (`client._stale`): the request
        goes again on another, which is stamped as the attempt's own, with connect_s for it."""
        out = self.out
        out.conn_ready_at = out.conn_reused = None
        out.resent += 1

    def notify_conn(self) -> None:
        """Tell the caller once, outside aiohttp's connector (a raising callback can't leak it)."""
        t = self.out.conn_ready_at
        if not self.notified and t is not None:
            self.notified = True
            if self.on_conn is not None:
                call_caller(self.on_conn, t, bool(self.out.conn_reused))

    def fail(self, status: str, error: str) -> None:
        """Record a failure; the first one wins, and nothing overrides a completed stream."""
        if not self.failed and not self.done:
            self.failed = True
            self.out.status, self.out.error = status, error

    def fail_in_stream(self, err: object, tokens: int) -> None:
        """The server's error object inside a 2xx body: classed as `stream_error` says, and its
        name kept (a used-up quota stops the run, `Shard._note_failure`)."""
        if not self.failed and not self.done:
            self.out.error_code = error_name(err)
        self.fail(*stream_error(err, tokens))

    def headers(self, resp: aiohttp.ClientResponse) -> None:
        """Response headers arrived: status, Retry-After, x-ratelimit-*; connector fallback."""
        self.resp = resp
        out, hdrs = self.out, resp.headers
        if out.conn_ready_at is None:  # a session without our StampingConnector
            self.conn_ready(None)
        out.http_status = resp.status
        # On a failure, a wait asked in milliseconds counts too, and a date is read against
        # the response's Date (`retry_after_of`); a 2xx is read so only when it has one.
        out.retry_after = (retry_after_of(hdrs) if resp.status >= 400 or "Retry-After" in hdrs
                           else None)
        # The `is_rate_header` test inline: no function call per header.
        out.rate_headers = {k.lower(): v for k, v in hdrs.items() if k[:12].lower() == RATE_PREFIX}
        self.notify_conn()

    def take(self, payloads: list[bytes], now: float) -> bool:
        """Apply the payloads of one read; True when the stream is finished (done or failed).

        The content chunks of one read share its timestamp `now`: the first one's gap is measured
        from the previous token, the others' gaps are 0 and go into the histogram in one update.
        """
        pieces, out, reader = self.pieces, self.out, self.reader
        before, others = len(pieces), reader.other_chunks
        end = reader.read(payloads, pieces)
        if n := len(pieces) - before + reader.other_chunks - others:
            out.content_chunks += n
            last = out.last_token_at
            if last is None:
                out.first_token_at = now
                self.first_read = n
            else:
                out.itl.add(now - last)
            if n > 1:
                out.itl.add(0.0, n - 1)
            out.last_token_at = now
        if end == MORE:
            return False
        if end == DONE:
            if out.content_chunks or reader.finish_reason is not None:
                self.done = True
            else:  # an empty answer has its finish_reason ("stop", "length"): this has nothing
                self.fail("protocol_error", "the stream reached [DONE] with nothing in it: no "
                          "content, reasoning or tool call, and no finish_reason")
        elif end == BAD:
            bad = clip(self.reader.bad.decode("utf-8", "replace")) or "(an empty data line)"
            after = counted(out.content_chunks, "token")
            self.fail("protocol_error", f"unparseable stream data after {after}: {bad}")
        else:
            self.fail_in_stream(self.reader.error, out.content_chunks)
        return True

    def take_whole(self, body: bytes, now: float) -> bool:
        """A 2xx body with no stream in it, read to its end at `now`: apply it if it is one
        complete JSON answer (a server that does not stream). False when it is no JSON object;
        `Unreadable` when it is one but no answer, or an answer with nothing in it.

        The text arrives as one piece (one content chunk), so first and last token are both
        `now` and there are no gaps. Without usage, its token count is estimated as characters
        / 4: a stream's estimate counts chunks, and here there is only one.
        """
        reader = self.reader
        text = reader.read_whole(body)
        if text is None:
            return False
        if reader.error is not None:
            self.fail_in_stream(reader.error, 0)
            return True
        legacy = reader.function_call
        if not (text or reader.reasoning or reader.tool_calls or reader.refusal or legacy
                or reader.finish_reason is not None):  # as a stream's [DONE] with nothing
            raise Unreadable("nothing in it: no content, reasoning or tool call, and no "
                             "finish_reason")
        if text or reader.reasoning or reader.tool_calls or reader.refusal or legacy:
            self.pieces.append(text)
            out = self.out
            out.content_chunks = 1
            out.first_token_at = out.last_token_at = now
            out.whole = True
            calls = [*reader.tool_calls.values(), *([legacy] if legacy else [])]
            chars = len(text) + sum(map(len, [*reader.reasoning, *reader.refusal])) + sum(
                len(piece) for c in calls for piece in c.arguments)
            self.whole_estimate = tokens_of_chars(chars)
        self.done = True
        return True

    def cancelled(self) -> None:
        """Cancelled from outside: whatever the stream had reached, the attempt did not end."""
        self.failed = True
        out, n = self.out, self.out.content_chunks
        out.status = "cancelled"
        out.error = f"cancelled by a stop after {counted(n, 'token')}"
        self.done = False

    def timed_out(self) -> None:
        """Our deadline (or aiohttp's socket-connect backstop) expired: name the phase."""
        ours = self.tm.expired() or self.out.conn_ready_at is not None
        kind = self.kind if ours else "timeout_connect"
        t, n = self.touts, self.out.content_chunks
        self.fail(kind, {
            "timeout_connect": f"no connection within {t.connect_s} s",
            "timeout_first_token": f"no token for {t.first_token_s} s after the connection "
                                   "was ready",
            "timeout_idle": f"no data for {t.idle_s} s after {counted(n, 'token')}",
            "timeout_total": f"attempt exceeded {t.total_s} s after {counted(n, 'token')}",
        }.get(kind, f"timed out after {counted(n, 'token')}"))  # fmt: skip

    def finish(self) -> AttemptOutcome:
        out = self.out
        out.ended_at = self.clock.now()
        if out.resent and out.conn_ready_at is None:
            # The last try to send it again got no connection (refused, timed out, a stop):
            # it did not go again (`reconnect` counted it before the try).
            out.resent -= 1
        out.text = "".join(self.pieces)
        r = self.reader
        if r.reasoning:
            out.reasoning = "".join(r.reasoning)
        out.tool_calls = r.tool_call_list()
        out.function_call = r.function_call_message()
        if r.refusal:
            out.refusal = "".join(r.refusal)
        out.finish_reason, out.prompt_tokens = r.finish_reason, r.prompt_tokens
        if out.status == "ok" and r.finish_reason in FAILED_FINISH:
            # The server ended the answer without finishing it, keeping the text so far: no
            # answer, but an in-stream error, retried as one (it was a success with a cut-off
            # output). vLLM ends so every request its engine aborts (a shutdown, a scale-down).
            out.status = "protocol_error"
            out.error = (f"the server ended the answer with finish_reason "
                         f"'{r.finish_reason}' after {counted(out.content_chunks, 'token')}")
        out.cached_tokens, out.reasoning_tokens = r.cached_tokens, r.reasoning_tokens
        out.usage_estimated = (tokens := r.completion_tokens) is None
        if tokens is None:
            tokens = out.content_chunks if self.whole_estimate is None else self.whole_estimate
        out.completion_tokens = tokens
        n = out.content_chunks
        out.at_once = out.whole or (
            n >= AT_ONCE_MIN and self.first_read >= min(n, AT_ONCE_CHUNKS))
        return out
