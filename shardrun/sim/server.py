"""An OpenAI-compatible streaming server that simulates a model cheaply and deterministically.

It shares CPU with the clients it measures, so its cost per stream must stay small: a stream
never wakes once per token. After the first-token delay it writes, on each wake, every token
that is due by the wall-clock schedule (token i due at first_token + i * itl) as one write of
prebuilt SSE bytes, then sleeps at least `flush_ms`. Output length and words depend only on the
seed and the request's prompt or messages, never on arrival order, so reruns compare equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from shardrun.sim.config import WORDS, BadRequest, Kind, Plan, SimConfig, make_plan

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"
_OBJECT = {"chat": (b"chat.completion.chunk", "chat.completion", "chatcmpl"),
           "completions": (b"text_completion", "text_completion", "cmpl")}  # fmt: skip


def _usage(plan: Plan) -> dict[str, int]:
    """The OpenAI usage object; prompt tokens are the plan's cheap estimate."""
    n = len(plan.words)
    return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": n,
            "total_tokens": plan.prompt_tokens + n}  # fmt: skip


class Frames(NamedTuple):
    """Prebuilt SSE bytes of one stream; words are plain ASCII, so no JSON encoding per token."""

    role: bytes  # chat's first chunk (role "assistant"); b"" for completions
    head: bytes  # bytes of a token event before its word
    tail: bytes  # bytes of a token event after its word
    end: bytes  # finish chunk, usage chunk when asked for, then [DONE]

    def tokens(self, words: bytes) -> bytes:
        """The events of these tokens as one bytes object: one join per write, not per token."""
        return self.head + (self.tail + self.head).join([WORDS[i] for i in words]) + self.tail


def render_stream(plan: Plan, rid: str, created: int) -> Frames:
    """The byte templates of a streamed answer; token events are built lazily, per write."""
    ident = b'"id":%b,"object":"%b","created":%d,"model":%b' % (
        orjson.dumps(rid), _OBJECT[plan.kind][0], created, orjson.dumps(plan.model))
    pre = b"data: {" + ident + b',"choices":[{"index":0,'
    end = b'"logprobs":null,"finish_reason":null}]}\n\n'
    finish = b'"logprobs":null,"finish_reason":"%b"}]}\n\n' % plan.finish.encode()
    usage = b""
    if plan.include_usage:
        usage = b'data: {%b,"choices":[],"usage":%b}\n\n' % (ident, orjson.dumps(_usage(plan)))
    if plan.kind == "chat":
        return Frames(pre + b'"delta":{"role":"assistant","content":""},' + end,
                      pre + b'"delta":{"content":"', b'"},' + end,
                      pre + b'"delta":{},' + finish + usage + _DONE)  # fmt: skip
    return Frames(b"", pre + b'"text":"', b'",' + end, pre + b'"text":"",' + finish + usage + _DONE)


def render_full(plan: Plan, rid: str, created: int) -> bytes:
    """A complete non-streaming chat.completion or text_completion JSON body."""
    text = b"".join(WORDS[i] for i in plan.words).decode()
    choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": plan.finish}
    if plan.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return orjson.dumps({"id": rid, "object": _OBJECT[plan.kind][1], "created": created,
                         "model": plan.model, "choices": [choice], "usage": _usage(plan)})


class FifoGate:
    """At most `capacity` holders (0 = unlimited); waiters are served strictly in arrival order."""

    def __init__(self, capacity: int) -> None:
        self._capacity, self._busy = capacity, 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_acquire(self) -> bool:
        """Take a slot now if one is free and nobody is waiting ahead."""
        if self._capacity == 0 or (self._busy < self._capacity and not self._waiters):
            self._busy += 1
            return True
        return False

    async def wait(self) -> None:
        """Queue for a slot; a cancelled waiter hands back a slot it was just given."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        """Give the slot to the oldest live waiter, or free it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; _busy is unchanged
                return
        self._busy -= 1


class Sim:
    """Server state: config, capacity gate and the counters behind /sim/stats."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg, self.gate = cfg, FifoGate(cfg.capacity)
        self.ttft, self.itl, self.flush = cfg.ttft_ms / 1e3, cfg.itl_ms / 1e3, cfg.flush_ms / 1e3
        self.seq = 0
        self.stats: dict[str, Any] = dict.fromkeys(
            ("requests_total", "in_flight", "max_in_flight", "queued", "max_queued",
             "completed", "completion_tokens_total", "aborted", "bad_requests"), 0)  # fmt: skip
        self.stats["by_path"] = {}

    def next_id(self, kind: Kind) -> tuple[str, int]:
        """A response id unique in this server (ids are not part of the deterministic output)."""
        self.seq += 1
        return f"{_OBJECT[kind][2]}-sim{self.seq}", int(time.time())

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

    async def emit(self, resp: web.StreamResponse, frames: Frames, words: bytes) -> None:
        """Write tokens on their wall-clock schedule, all due tokens per write, >= flush apart."""
        loop = asyncio.get_running_loop()
        t0, n, sent = loop.time(), len(words), 0
        for _ in range(n):  # every pass sends at least one token
            now = loop.time()
            due = n if self.itl <= 0 else min(n, max(sent + 1, int((now - t0) / self.itl) + 1))
            data = (frames.role if sent == 0 else b"") + frames.tokens(words[sent:due])
            if due == n:  # the last write also ends the chunked body: one send, not two
                await resp.write_eof(data + frames.end)
                return
            await resp.write(data)
            sent = due
            wake = max(t0 + sent * self.itl, loop.time() + self.flush)
            await asyncio.sleep(wake - loop.time())

    def done(self, plan: Plan) -> None:
        """Count a request that received its whole answer."""
        self.stats["completed"] += 1
        self.stats["completion_tokens_total"] += len(plan.words)


SIM_KEY = web.AppKey("sim", Sim)


def _error(status: int, message: str, param: str | None, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": code}}  # fmt: skip
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    """Shared handler for chat and completions: plan, queue for capacity, then respond."""
    sim = request.app[SIM_KEY]
    sim.stats["requests_total"] += 1
    by_path = sim.stats["by_path"]
    by_path[request.path] = by_path.get(request.path, 0) + 1
    try:
        plan = make_plan(await request.read(), kind, sim.cfg)
    except BadRequest as e:
        sim.stats["bad_requests"] += 1
        return _error(400, str(e), e.param, e.code)
    rid, created = sim.next_id(kind)
    try:
        if plan.stream:
            return await _respond_stream(request, sim, plan, rid, created)
        async with sim.slot():
            await asyncio.sleep(sim.ttft + (len(plan.words) - 1) * sim.itl)
        sim.done(plan)
        return web.Response(body=render_full(plan, rid, created), content_type="application/json")
    except asyncio.CancelledError:
        sim.stats["aborted"] += 1  # the client went away; its slot is already released
        raise


async def _respond_stream(request: web.Request, sim: Sim, plan: Plan, rid: str,
                          created: int) -> web.StreamResponse:  # fmt: skip
    """Headers at once; capacity queueing and TTFT come after, as with vLLM's streaming."""
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    frames = render_stream(plan, rid, created)
    try:
        async with sim.slot():
            await asyncio.sleep(sim.ttft)
            await sim.emit(resp, frames, plan.words)
    except ConnectionResetError:
        sim.stats["aborted"] += 1  # aiohttp finishes a reset response quietly
        return resp
    sim.done(plan)
    return resp


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _models(request: web.Request) -> web.Response:
    data = {"object": "list", "data": [{"id": "sim", "object": "model", "created": 0,
                                        "owned_by": "shardrun"}]}  # fmt: skip
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def _stats(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(request.app[SIM_KEY].stats),
                        content_type="application/json")  # fmt: skip


def build_app(cfg: SimConfig) -> web.Application:
    """The simulator as an aiohttp application (for TestServer or `serve`)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIM_KEY] = Sim(cfg)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/sim/stats", _stats)
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
        print(f"shardrun sim listening on http://{shown}:{real_port}/v1", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if exit_on_stdin_eof:
            _watch_stdin(loop, stop)
        await stop.wait()
    finally:
        await runner.cleanup()


def serve(cfg: SimConfig, host: str = "127.0.0.1", port: int = 8000, *,
          exit_on_stdin_eof: bool = False) -> None:  # fmt: skip
    """Run until SIGINT/SIGTERM (or stdin EOF if asked); prints one line once listening.

    The line is `shardrun sim listening on http://HOST:PORT/v1` with the real port (port 0 lets
    the OS choose); the launcher parses it, so nothing else is ever written to stdout.
    """
    loop_factory = None
    if sys.platform != "win32":
        with contextlib.suppress(ImportError):
            import uvloop

            loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(cfg, host, port, exit_on_stdin_eof))
