"""Pure parsing of OpenAI-compatible streaming chunks and error bodies: no I/O, no event loop.

`shardrun.client` hands the SSE payloads (bytes) of each network read to a `ChunkReader`, which
parses them with `orjson.loads` and collects text, finish_reason and usage; the client owns the
timing and the outcome, this module only reads JSON values.

Malformed shapes are not checked up front: a chunk whose `choices` is not a list of objects (or a
`usage` that is not an object) raises one of `PARSE_ERRORS` inside `ChunkReader.read`, which
catches it around the whole read and reports BAD (the client's `protocol_error`). That keeps the
per-chunk path free of `isinstance` checks for the shapes every real server sends; whatever a
chunk set before it raised stays set.
"""

from __future__ import annotations

import orjson

MSG_MAX = 200
"""Longest error sentence fragment: error messages go into one-line JSON events."""
PARSE_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError)
"""What malformed stream data raises here or in `orjson.loads` (JSONDecodeError is a ValueError)."""


MORE, DONE, ERROR, BAD = 0, 1, 2, 3
"""What `ChunkReader.read` met: nothing final, `[DONE]`, an error object, a malformed payload."""


class ChunkReader:
    """Reads one stream's payloads in order; keeps what outlives one chunk.

    `read` takes all the payloads of one network read in a single call with the per-chunk work
    inlined (one `orjson.loads` and a few dict gets per payload): it runs once per content chunk
    of every response, where a method call or a tuple per chunk is a measurable share.
    """

    __slots__ = ("bad", "chat", "completion_tokens", "error", "finish_reason", "prompt_tokens")

    def __init__(self, chat: bool) -> None:
        self.chat = chat  # chat: choices[0].delta.content; completions: choices[0].text
        self.finish_reason: str | None = None  # the last one seen on any choice
        self.prompt_tokens: int | None = None  # from the usage object, when the server sent one
        self.completion_tokens: int | None = None
        self.error: object = None  # the value of the `error` payload that ended the stream
        self.bad = b""  # the payload that could not be read (for the error message)

    def read(self, payloads: list[bytes], pieces: list[str]) -> int:
        """Apply SSE payloads in order, appending each content piece to `pieces`; MORE to go on.

        Stops at the first payload that ends the stream: `[DONE]` (DONE), an `{"error": ...}`
        object (ERROR, its value in `error`), or a payload that is not JSON or not shaped as a
        chunk (BAD, the payload in `bad`). Payloads after it are not read.

        A piece is choices[0]'s content when that is a non-empty string. A finish_reason may sit
        on any choice; the last truthy one wins (as a string). Usage counts that are not ints
        become None. A chunk that turns out malformed halfway keeps what it set before (a
        finish_reason), but its piece is not appended.
        """
        chat, append, payload = self.chat, pieces.append, b""
        try:
            for payload in payloads:
                if payload == b"[DONE]":
                    return DONE
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    # orjson rejects bytes that are not UTF-8; read broken bytes as U+FFFD, as
                    # decoding the line to text first would. Invalid JSON raises here again.
                    obj = orjson.loads(payload.decode("utf-8", "replace"))
                if (err := obj.get("error")) is not None:
                    self.error = err
                    return ERROR
                if choices := obj.get("choices"):
                    first = choices[0]
                    if chat:
                        delta = first.get("delta")
                        piece = delta.get("content") if isinstance(delta, dict) else None
                    else:
                        piece = first.get("text")
                    if reason := first.get("finish_reason"):
                        self.finish_reason = str(reason)
                    if len(choices) > 1:
                        for choice in choices[1:]:
                            if reason := choice.get("finish_reason"):
                                self.finish_reason = str(reason)
                    if piece and isinstance(piece, str):
                        append(piece)
                if usage := obj.get("usage"):
                    self.prompt_tokens = as_int(usage.get("prompt_tokens"))
                    self.completion_tokens = as_int(usage.get("completion_tokens"))
        except PARSE_ERRORS:
            self.bad = payload
            return BAD
        return MORE


def stream_error(err: object, tokens: int) -> tuple[str, str]:
    """(status, error sentence) for an `{"error": err}` payload inside a 2xx stream.

    A code of 429 is http_429, 500-599 http_5xx (as an int or a digit string), anything else or
    no code protocol_error. `err` may also be a bare message instead of an object.
    """
    code: object = err.get("code") if isinstance(err, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err
    n = int(code) if isinstance(code, int | str) and str(code).isdigit() else 0
    status = "http_429" if n == 429 else "http_5xx" if 500 <= n < 600 else "protocol_error"
    label = "" if code is None else f" {code}"
    return status, f"error{label} in stream after {tokens} tokens: {clip(msg)}"


def error_message(body: bytes) -> str:
    """The server's message from an error body: OpenAI `{"error": {"message"}}` or raw text."""
    msg: object = None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
    if not isinstance(msg, str) or not msg:
        msg = body.decode("utf-8", "replace")
    return clip(msg) or "(empty body)"


def clip(value: object) -> str:
    """One line, at most MSG_MAX characters: error sentences go into one-line JSON events."""
    return " ".join(str(value).split())[:MSG_MAX]


def as_int(value: object) -> int | None:
    """`value` if it is an int proper (not a bool, not a float), else None."""
    return value if type(value) is int else None


def is_rate_header(name: str) -> bool:
    """Whether a response header is one of the `x-ratelimit-*` family (any case)."""
    return name[:12].lower() == RATE_PREFIX


RATE_PREFIX = "x-ratelimit-"
