"""An OpenAI-compatible streaming server that simulates a model cheaply and deterministically.

It shares CPU with the clients it measures, so its cost per stream must stay small: a stream
never wakes once per token. After the first-token delay it writes, on each wake, every token
that is due by the wall-clock schedule (token i due at first_token + i * itl) as one write of
prebuilt SSE bytes, then sleeps at least `flush_ms`. Output length and words depend only on the
seed and the request's prompt, messages or input, never on arrival order, so reruns compare
equal. It serves chat completions, completions and the Responses API (`/v1/responses`).
Faults (429/500/503, resets, drops, stalls, slow first tokens) are drawn per request by
`shardrun.sim.faults`; a request without a fault takes exactly the path it took before.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import hdrs, web

from shardrun.cli_analysis import say
from shardrun.fdlimit import ensure_open_files
from shardrun.sim.config import BadRequest, Kind, Plan, SimConfig, make_plan
from shardrun.sim.faults import (
    HTTP_FAULTS,
    FaultInjector,
    authorized,
    error_response,
    fault_response,
    limit_response,
    pause,
    quota_response,
    reset,
    storm_response,
    tokens_response,
    unauthorized,
)
from shardrun.sim.gate import FifoGate
from shardrun.sim.limit import RequestLimit
from shardrun.sim.render import OBJECT, Frames, ResponseFrames, render_full, render_stream

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_JSON_HEADERS = {"Content-Type": "application/json"}
ARRIVALS_KEPT = 200_000


class Sim:
    """Server state: config, capacity gate, fault injector and the counters behind /sim/stats."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg, self.gate, self.faults = cfg, FifoGate(cfg.capacity), FaultInjector(cfg)
        self.ttft, self.itl, self.flush = cfg.ttft_ms / 1e3, cfg.itl_ms / 1e3, cfg.flush_ms / 1e3
        self.seq = 0
        self.closing = False  # set on shutdown: paused (stalled, slow) handlers give up
        self.extra = {"slow_first_token": cfg.slow_first_token_s, "stall_mid_stream": cfg.stall_s}
        self.stats: dict[str, Any] = dict.fromkeys(
            ("requests_total", "in_flight", "max_in_flight", "queued", "max_queued",
             "completed", "completion_tokens_total", "aborted", "bad_requests",
             "unauthorized"), 0)  # fmt: skip
        self.stats["by_path"] = {}
        self.stats["faults"] = self.faults.counts
        self.limit = None if not cfg.rpm_limit else RequestLimit(
            cfg.rpm_limit, cfg.rpm_burst, cfg.rpm_count_rejected, stated=cfg.rpm_stated)
        self.tokens = None if not cfg.tpm_limit else RequestLimit(
            cfg.tpm_limit, cfg.tpm_burst, False, "tokens", stated=cfg.tpm_stated)
        # Arrival times (wall clock) of the latest requests, for rate-limit checks by tests.
        self.arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)

    def next_id(self, kind: Kind) -> tuple[str, int]:
        """A response id unique in this server (ids are not part of the deterministic output);
        a Responses one has no prefix, its objects' ids add theirs ("resp_sim7", "msg_sim7")."""
        self.seq += 1
        prefix = OBJECT[kind][2]
        return f"{prefix}-sim{self.seq}" if prefix else f"sim{self.seq}", int(time.time())

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a capacity slot; queueing here is what lengthens TTFT under load."""
        st = self.stats
        if not self.gate.try_acquire():
            st["queued"] += 1
            st["max_queued"] = max(st["max_queued"], st["queued"])
            try:
                await self.gate.wait()
            finally:
                st["queued"] -= 1
        st["in_flight"] += 1
        st["max_in_flight"] = max(st["max_in_flight"], st["in_flight"])
        try:
            yield
        finally:
            st["in_flight"] -= 1
            self.gate.release()

    async def emit(self, resp: web.StreamResponse, frames: Frames | ResponseFrames, words: bytes,
                   start: int = 0, stop: int | None = None) -> None:  # fmt: skip
        """Write words[start:stop] on their wall-clock schedule, all due ones per write, >= flush
        apart; without `stop` the last write also carries the end frames and ends the body."""
        loop = asyncio.get_running_loop()
        n = len(words) if stop is None else stop
        if start >= n:
            if stop is None:
                await resp.write_eof(frames.end)
            return
        t0, sent = loop.time(), start
        for _ in range(n - start):  # every pass sends at least one token
            now = loop.time()
            late = int((now - t0) / self.itl) if self.itl > 0 else n
            due = min(n, max(sent + 1, start + late + 1))
            data = (frames.role if sent == 0 else b"") + frames.tokens(words[sent:due], sent)
            if due == n:  # the last write also ends the chunked body: one send, not two
                await (resp.write_eof(data + frames.end) if stop is None else resp.write(data))
                return
            await resp.write(data)
            sent = due
            wake = max(t0 + (sent - start) * self.itl, loop.time() + self.flush)
            await asyncio.sleep(wake - loop.time())

    async def pause(self, request: web.Request, seconds: float) -> bool:
        """Sleep unless the client leaves or the server shuts down first (then False)."""
        return await pause(request, seconds, lambda: self.closing)

    def abandon(self, request: web.Request) -> bool:
        """Count a request given up mid-pause as aborted and drop its connection; False."""
        self.stats["aborted"] += 1
        reset(request)
        return False

    def done(self, plan: Plan) -> None:
        """Count a request that received its whole answer."""
        self.stats["completed"] += 1
        self.stats["completion_tokens_total"] += len(plan.words)


SIM_KEY = web.AppKey("sim", Sim)


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    """Shared handler for chat, completions and responses: auth, plan, fault, capacity, then
    respond."""
    sim = request.app[SIM_KEY]
    st, cfg = sim.stats, sim.cfg
    st["requests_total"] += 1
    sim.arrivals.append(time.time())
    st["by_path"][request.path] = st["by_path"].get(request.path, 0) + 1
    raw = await request.read()
    if cfg.auth_required is not None and not authorized(request, cfg.auth_required):
        st["unauthorized"] += 1
        return unauthorized()
    if sim.limit is not None and (wait := sim.limit.take(time.monotonic())):
        sim.faults.counts["rpm_limit"] += 1
        return limit_response(wait, cfg)
    if cfg.reset_when is not None and cfg.reset_when.encode() in raw:
        sim.faults.counts["reset_when"] += 1
        reset(request)
        return web.Response()  # never sent, as with reset_before_headers
    if sim.faults.fail_first():
        return fault_response("fail_first_n", cfg)
    if sim.faults.storming(time.monotonic()):
        return storm_response(cfg)
    if sim.faults.quota_used_up():
        return quota_response()
    try:
        plan = make_plan(raw, kind, cfg)
    except BadRequest as e:
        st["bad_requests"] += 1
        return error_response(400, str(e), "invalid_request_error", e.code, e.param)
    if sim.tokens is not None and (answer := _over_tokens(sim, plan)) is not None:
        return answer
    fault = sim.faults.draw(request.path, raw)
    if fault is not None and fault in HTTP_FAULTS:
        return fault_response(fault, cfg)
    if fault == "reset_before_headers":
        reset(request)
        return web.Response()  # never sent: aiohttp's write to the dead transport is swallowed
    if fault == "reset_after_headers":
        return await _headers_then_reset(request, stream=plan.stream)
    rid, created = sim.next_id(kind)
    try:
        if plan.stream:
            return await _respond_stream(request, sim, plan, (rid, created), fault)
        return await _respond_full(request, sim, plan, (rid, created), fault)
    except asyncio.CancelledError:
        st["aborted"] += 1  # the client went away; its slot is already released
        raise


def _over_tokens(sim: Sim, plan: Plan) -> web.Response | None:
    """The 429 of a request the token limit does not let in now (or ever); None: let in."""
    tokens = sim.tokens
    assert tokens is not None
    limit = sim.cfg.tpm_limit
    wait = math.inf if plan.requested > limit else tokens.take(time.monotonic(), plan.requested)
    if not wait:
        return None
    sim.faults.counts["tpm_limit"] += 1
    return tokens_response(wait, tokens.limit, tokens.used(), plan.requested, sim.cfg)


async def _headers_then_reset(request: web.Request, *, stream: bool) -> web.StreamResponse:
    """reset_after_headers: a 200 and its headers (an event stream's, or a JSON answer's), then
    the connection reset before any byte of the body, as a server whose worker dies once its
    answer has begun. The client has a status, no answer, and no token."""
    resp = web.StreamResponse(headers=_SSE_HEADERS if stream else _JSON_HEADERS)
    await resp.prepare(request)  # a StreamResponse sends its headers here
    reset(request)
    return resp


async def _respond_full(request: web.Request, sim: Sim, plan: Plan, ident: tuple[str, int],
                        fault: str | None) -> web.StreamResponse:  # fmt: skip
    """One JSON answer after TTFT + ITLs; a fault lengthens the wait or resets halfway."""
    delay = sim.ttft + (len(plan.words) - 1) * sim.itl
    async with sim.slot():
        if fault is None:
            await asyncio.sleep(delay)
        elif fault == "drop_mid_stream":
            if await sim.pause(request, delay / 2):
                reset(request)  # halfway through, before any response byte
            else:
                sim.abandon(request)
            return web.Response()  # never sent
        elif not await sim.pause(request, delay + sim.extra.get(fault, 0.0)):
            sim.abandon(request)
            return web.Response()  # never sent
    sim.done(plan)
    return web.Response(body=render_full(plan, *ident), content_type="application/json")


async def _respond_stream(request: web.Request, sim: Sim, plan: Plan, ident: tuple[str, int],
                          fault: str | None) -> web.StreamResponse:  # fmt: skip
    """Headers at once; capacity queueing and TTFT come after, as with vLLM's streaming."""
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    frames = render_stream(plan, *ident)
    try:
        async with sim.slot():
            if fault is None:  # the hot path: no fault logic at all
                await asyncio.sleep(sim.ttft)
                await sim.emit(resp, frames, plan.words)
            elif not await _faulty_stream(request, sim, resp, frames, plan.words, fault):
                return resp
    except ConnectionResetError:
        sim.stats["aborted"] += 1  # aiohttp finishes a reset response quietly
        return resp
    sim.done(plan)
    return resp


async def _faulty_stream(request: web.Request, sim: Sim, resp: web.StreamResponse,
                         frames: Frames | ResponseFrames, words: bytes, fault: str,
                         ) -> bool:  # fmt: skip
    """Stream with a fault; False when the answer did not reach its end (dropped, abandoned).

    slow_first_token waits longer for the first token; drop_mid_stream sends about half the
    tokens and resets; stall_mid_stream sends about half, pauses `stall_s`, then finishes.
    """
    slow = sim.cfg.slow_first_token_s if fault == "slow_first_token" else 0.0
    if not await sim.pause(request, sim.ttft + slow):
        return sim.abandon(request)
    if fault not in ("drop_mid_stream", "stall_mid_stream"):
        await sim.emit(resp, frames, words)
        return True
    half = max(1, len(words) // 2)
    await sim.emit(resp, frames, words, stop=half)
    if fault == "drop_mid_stream":
        reset(request)
        return False
    if not await sim.pause(request, sim.cfg.stall_s):
        return sim.abandon(request)
    await sim.emit(resp, frames, words, start=half)
    return True


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _responses(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "responses")


async def _models(request: web.Request) -> web.Response:
    data = {"object": "list", "data": [{"id": "sim", "object": "model", "created": 0,
                                        "owned_by": "shardrun"}]}  # fmt: skip
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def _arrivals(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(list(request.app[SIM_KEY].arrivals)),
                        content_type="application/json")  # fmt: skip


async def _stats(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(request.app[SIM_KEY].stats),
                        content_type="application/json")  # fmt: skip


async def _on_shutdown(app: web.Application) -> None:
    """Runs before aiohttp waits for handlers: paused handlers see it within POLL_S and quit."""
    app[SIM_KEY].closing = True


async def _limit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """rpm_headers openai: every generation answer (a 429 too) carries the limit's state as its
    headers go out."""
    sim = request.app[SIM_KEY]
    if request.method == "POST":
        for limit in (sim.limit, sim.tokens):
            if limit is not None:
                response.headers.update(limit.headers(time.monotonic()))


async def _close_after(request: web.Request, response: web.StreamResponse) -> None:
    """keepalive false: the answer says `Connection: close`, and the server closes after it.
    (aiohttp runs this hook after it has set the headers, so the header is set here too.)"""
    response.force_close()
    response.headers[hdrs.CONNECTION] = "close"


def build_app(cfg: SimConfig) -> web.Application:
    """The simulator as an aiohttp application (for TestServer or `serve`)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIM_KEY] = Sim(cfg)
    app.on_shutdown.append(_on_shutdown)
    if not cfg.keepalive:
        app.on_response_prepare.append(_close_after)
    if (cfg.rpm_limit or cfg.tpm_limit) and cfg.rpm_headers == "openai":
        app.on_response_prepare.append(_limit_headers)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/sim/stats", _stats)
    app.router.add_get("/sim/arrivals", _arrivals)
    return app


def _watch_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Set `stop` when stdin reaches EOF: the parent that holds the pipe is gone."""

    def read_until_eof() -> None:
        with contextlib.suppress(OSError, ValueError):
            while os.read(sys.stdin.fileno(), 65536):
                pass
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=read_until_eof, name="stdin-eof", daemon=True).start()


async def _serve(cfg: SimConfig, host: str, port: int, exit_on_stdin_eof: bool) -> None:
    runner = web.AppRunner(build_app(cfg), access_log=None, handler_cancellation=True,
                           shutdown_timeout=1.0)  # fmt: skip
    await runner.setup()
    try:
        # A deep backlog: 256 clients connecting at once must not hit SYN retransmit delays.
        await web.TCPSite(runner, host, port, backlog=4096, shutdown_timeout=1.0).start()
        real_port = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        # A reader that left early (`shardrun sim | head -c 0`) changes nothing: it was
        # "cannot listen on ...: Broken pipe", exit 1, from a simulator that listened.
        say(f"shardrun sim listening on http://{shown}:{real_port}/v1")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if exit_on_stdin_eof:
            _watch_stdin(loop, stop)
        await stop.wait()
    finally:
        await runner.cleanup()


SERVED_CONNECTIONS = 16_384  # the open connections the simulator makes room for (hard limit)


def serve(cfg: SimConfig, host: str = "127.0.0.1", port: int = 8000, *,
          exit_on_stdin_eof: bool = False) -> None:  # fmt: skip
    """Run until SIGINT/SIGTERM (or stdin EOF if asked); prints one line once listening.

    The line is `shardrun sim listening on http://HOST:PORT/v1` with the real port (port 0 lets
    the OS choose); the launcher parses it, so nothing else is ever written to stdout.
    """
    # Every client connection is a descriptor: a soft limit of 1,024 would reset connections of
    # a run with more in flight, which would read as the client's fault.
    ensure_open_files(SERVED_CONNECTIONS)
    loop_factory = None
    if sys.platform != "win32":
        with contextlib.suppress(ImportError):
            import uvloop

            loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(cfg, host, port, exit_on_stdin_eof))
