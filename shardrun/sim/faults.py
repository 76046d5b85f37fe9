"""Fault injection for the simulator: which request meets which fault, and what that looks like.

The decision for a request is made once, before any response byte, and costs one hash and one
seeded draw (nothing per token):

    key = blake2b(path + body, key=seed)      # the request's content, keyed by the seed
    n   = times this server process has already drawn for `key` (a dict counter)
    u   = random.Random(key + n).random()     # uniform in [0, 1)
    fault = the first kind whose cumulative share (in FAULT_KINDS order) exceeds u, else none

So the decision depends on the seed and the request, never on how requests for *different*
prompts interleave; two fresh servers with the same seed fed the same requests fault the same
way; and a retried identical request draws again (n + 1), so it is not stuck on its fault: with
`fail_500: 0.5` a retry succeeds with probability one half. The counter keeps one entry per
distinct request body, only while some fault share is above zero.

Before the draw: `auth_required` (401, `invalid_api_key`), an enforced `rpm_limit` (429
`rate_limit_exceeded` over it, `shardrun.sim.limit`; counted as `rpm_limit`), `fail_first_n`
(the first N authorised generation requests in arrival order get 503), `reset_when` (a request
whose body holds that text is reset before any answer, every time), a storm (`storm_s` seconds
from the arrival of request `storm_after_n` + 1, every authorised generation request gets
`storm_status`) and `quota_after` (past N requests served, 429 `insufficient_quota`, OpenAI's
answer once an account's credit is used up) are checked, then the body is validated (400s are
never faulted and take no draw), then an enforced `tpm_limit` (429 on tokens per min over it,
counted as `tpm_limit`; it needs the body's prompt and max_tokens). Non-streamed requests meet
the stream faults too: `slow_first_token` and `stall_mid_stream` lengthen their delay, and
`drop_mid_stream` resets the connection halfway through it, before any response byte.
`reset_after_headers` answers 200 with its headers (a stream's or a JSON answer's) and resets
the connection before any byte of the body, at once, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import math
import random
import socket
import struct
from collections.abc import Callable

import orjson
from aiohttp import web

from shardrun.sim.config import FAULT_KINDS, SimConfig
from shardrun.sim.limit import retry_after

#: The faults answered with an HTTP error status instead of a stream.
HTTP_FAULTS = {"fail_429": 429, "fail_500": 500, "fail_503": 503, "fail_first_n": 503}
#: How often a paused (stalled or slow) handler checks for a gone client or a shutdown.
POLL_S = 0.05
_MESSAGES = {
    429: ("requests", "rate_limit_exceeded",
          "Rate limit reached for requests (simulated). Please try again in {wait}."),
    500: ("server_error", None,
          "The server had an error while processing your request (simulated)."),
    503: ("server_error", None, "The engine is currently overloaded (simulated)."),
}  # fmt: skip


def request_key(seed: int, path: str, body: bytes) -> bytes:
    """The request's identity for fault draws: its path and raw body, keyed by the seed."""
    h = hashlib.blake2b(path.encode(), digest_size=16, key=seed.to_bytes(8, "little"),
                        person=b"shardrun-fault")  # fmt: skip
    h.update(b"\0")
    h.update(body)
    return h.digest()


def decide(table: tuple[tuple[str, float], ...], key: bytes, n: int) -> str | None:
    """The fault of the `n`-th draw (0-based) for `key`, or None: pure, one uniform draw."""
    if not table:
        return None
    u = random.Random(key + n.to_bytes(8, "little")).random()
    for kind, cumulative in table:
        if u < cumulative:
            return kind
    return None


class FaultInjector:
    """Per-server fault state: the draw counter per request key and the counts by kind."""

    def __init__(self, cfg: SimConfig) -> None:
        self.seed, self.table, self.first_n = cfg.seed, cfg.fault_table, cfg.fail_first_n
        self.quota, self.served = cfg.quota_after, 0
        self.arrivals = 0
        self.storm_s, self.storm_after = cfg.storm_s, cfg.storm_after_n
        self.storm_arrivals, self.storm_began = 0, -1.0
        self.seen: dict[bytes, int] = {}
        #: Injected faults by kind; served live as `faults` in /sim/stats.
        kinds = ("fail_first_n", "storm", "reset_when", "quota_after", *FAULT_KINDS, "rpm_limit",
                 "tpm_limit")
        self.counts: dict[str, int] = dict.fromkeys(kinds, 0)

    def fail_first(self) -> bool:
        """Count one arrival; True (and counted) while it is among the first `fail_first_n`."""
        if self.arrivals >= self.first_n:
            return False
        self.arrivals += 1
        self.counts["fail_first_n"] += 1
        return True

    def storming(self, now: float) -> bool:
        """Count one arrival; True (and counted) while the storm is on (see the module doc)."""
        if not self.storm_s:
            return False
        self.storm_arrivals += 1
        if self.storm_began < 0:
            if self.storm_arrivals <= self.storm_after:
                return False
            self.storm_began = now
        if now - self.storm_began >= self.storm_s:
            return False
        self.counts["storm"] += 1
        return True

    def quota_used_up(self) -> bool:
        """Count one request past `fail_first_n`; True (and counted) once `quota_after` of them
        were served."""
        if not self.quota:
            return False
        if self.served < self.quota:
            self.served += 1
            return False
        self.counts["quota_after"] += 1
        return True

    def draw(self, path: str, body: bytes) -> str | None:
        """Decide (and count) the fault of one valid request; see the module docstring."""
        if not self.table:
            return None
        key = request_key(self.seed, path, body)
        n = self.seen.get(key, 0)
        self.seen[key] = n + 1
        kind = decide(self.table, key, n)
        if kind is not None:
            self.counts[kind] += 1
        return kind


def _seconds(value: float) -> str:
    """A header-friendly number of seconds: 1 -> "1", 0.25 -> "0.25"."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def error_response(status: int, message: str, err_type: str, code: str | None,
                   param: str | None = None, headers: dict[str, str] | None = None,
                   ) -> web.Response:  # fmt: skip
    """A JSON error body shaped like OpenAI's: {"error": {message, type, param, code}}."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), headers=headers,
                        content_type="application/json")  # fmt: skip


def fault_response(kind: str, cfg: SimConfig) -> web.Response:
    """The 429, 500 or 503 of an HTTP fault, with Retry-After where configured."""
    status = HTTP_FAULTS[kind]
    err_type, code, message = _MESSAGES[status]
    wait = _seconds(cfg.retry_after_s)
    headers: dict[str, str] = {}
    if status == 429:
        headers = {"Retry-After": wait, "x-ratelimit-remaining-requests": "0",
                   "x-ratelimit-reset-requests": wait + "s"}  # fmt: skip
    elif status == 503 and cfg.retry_after_503:
        headers = {"Retry-After": wait}
    return error_response(status, message.format(wait=wait + "s"), err_type, code,
                          headers=headers)  # fmt: skip


def limit_response(wait: float, cfg: SimConfig) -> web.Response:
    """The 429 of a request over the enforced limit (`rpm_limit`, shardrun.sim.limit): with
    Retry-After for when the bucket would let one in, unless `rpm_headers` is "none"."""
    err_type, code, message = _MESSAGES[429]
    headers = {} if cfg.rpm_headers == "none" else {"Retry-After": retry_after(wait)}
    return error_response(429, message.format(wait=_seconds(wait) + "s"), err_type, code,
                          headers=headers)  # fmt: skip


def tokens_response(wait: float, limit: str, used: int, requested: int,
                    cfg: SimConfig) -> web.Response:  # fmt: skip
    """The 429 of a request over the enforced token limit (`tpm_limit`), in OpenAI's words: one
    that alone asks more than the whole limit is too large: no wait lets it in (`wait` inf).
    `limit` is the one stated (`tpm_stated`), which need not be the one enforced."""
    if math.isinf(wait):
        message = (f"Request too large for sim in organization org-sim on tokens per min (TPM): "
                   f"Limit {limit}, Requested {requested}. The input or output tokens must be "
                   f"reduced in order to run successfully (simulated).")
        return error_response(429, message, "tokens", "rate_limit_exceeded")
    message = (f"Rate limit reached for sim in organization org-sim on tokens per min (TPM): "
               f"Limit {limit}, Used {used}, Requested {requested}. Please try again in "
               f"{_seconds(wait)}s (simulated).")
    headers = {} if cfg.rpm_headers == "none" else {"Retry-After": retry_after(wait)}
    return error_response(429, message, "tokens", "rate_limit_exceeded", headers=headers)


def storm_response(cfg: SimConfig) -> web.Response:
    """A storm's answer: the server's own 500 or 503 (with Retry-After where configured), or a
    gateway's 502 or 504 in plain text, as a proxy with nothing behind it answers."""
    if cfg.storm_status == 500:
        return fault_response("fail_500", cfg)
    if cfg.storm_status == 503:
        return fault_response("fail_503", cfg)
    return web.Response(status=cfg.storm_status, text="upstream unavailable (simulated)")


def quota_response() -> web.Response:
    """OpenAI's answer to a request from an account whose credit is used up."""
    return error_response(429, "You exceeded your current quota, please check your plan and "
                          "billing details (simulated).", "insufficient_quota",
                          "insufficient_quota")  # fmt: skip


def authorized(request: web.Request, token: str) -> bool:
    """True when the request carries `Authorization: Bearer <token>` (constant-time compare)."""
    got = request.headers.get("Authorization", "")
    return hmac.compare_digest(got.encode(), b"Bearer " + token.encode())


def unauthorized() -> web.Response:
    """OpenAI's 401 for a missing or wrong key (the key itself is never echoed)."""
    return error_response(401, "Incorrect API key provided (simulated).",
                          "invalid_request_error", "invalid_api_key")  # fmt: skip


def reset(request: web.Request) -> None:
    """Drop the connection with a TCP RST (SO_LINGER 0): the client sees ECONNRESET.

    Bytes already written reach the client first; aiohttp then finishes the handler quietly
    (its writes to the closing transport raise ConnectionError, which it swallows).
    """
    transport = request.transport
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:  # if this fails, abort() still closes it, with a FIN instead
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def pause(request: web.Request, seconds: float, closing: Callable[[], bool]) -> bool:
    """Sleep `seconds`; False at once if the client leaves or the server starts shutting down.

    Wakes every POLL_S (a stall of 5 s is 100 cheap wakes), so a stall never outlives the
    server's shutdown grace and never holds a slot for a client that is gone.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    for _ in range(int(seconds / POLL_S) + 2):
        transport = request.transport
        if closing() or transport is None or transport.is_closing():
            return False
        left = end - loop.time()
        if left <= 0:
            break
        await asyncio.sleep(min(left, POLL_S))
    return True
