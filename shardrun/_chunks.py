"""Pure parsing of OpenAI-compatible streaming chunks and error bodies: no I/O, no event loop.

`shardrun.client` decodes each SSE payload with `orjson.loads` and hands the parts of the object to
a `ChunkReader` (or `stream_error`); it owns the timing and the outcome, this module only reads
JSON values.

Malformed shapes are not checked up front: a chunk whose `choices` is not a list of objects (or a
`usage` that is not an object) makes these functions raise one of `PARSE_ERRORS`, which the client
catches around the whole read and reports as `protocol_error`. That keeps the per-chunk path free
of `isinstance` checks for the shapes every real server sends; whatever a chunk set before it
raised stays set, exactly as when the parsing lived inside the client.
"""

from __future__ import annotations

import orjson

MSG_MAX = 200
"""Longest error sentence fragment: error messages go into one-line JSON events."""
PARSE_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError)
"""What malformed stream data raises here or in `orjson.loads` (JSONDecodeError is a ValueError)."""


class ChunkReader:
    """Reads the `choices` and `usage` of one stream's chunks in order; keeps what outlives one.

    `take_choices` runs once per content chunk, so it is a method on a slotted object that stores
    the rare finish_reason as it goes, rather than a function returning a tuple per chunk.
    """

    __slots__ = ("chat", "completion_tokens", "finish_reason", "prompt_tokens")

    def __init__(self, chat: bool) -> None:
        self.chat = chat  # chat: choices[0].delta.content; completions: choices[0].text
        self.finish_reason: str | None = None  # the last one seen on any choice
        self.prompt_tokens: int | None = None  # from the usage object, when the server sent one
        self.completion_tokens: int | None = None

    def take_choices(self, choices: list[dict[str, object]]) -> str | None:
        """The content piece of one chunk's non-empty `choices`; notes any finish_reason.

        The piece is None unless a non-empty string. A finish_reason may sit on any choice, and
        the last truthy one wins (as a string).
        """
        first = choices[0]
        if self.chat:
            delta = first.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else None
        else:
            piece = first.get("text")
        for choice in choices:
            if reason := choice.get("finish_reason"):
                self.finish_reason = str(reason)
        return piece if piece and isinstance(piece, str) else None

    def take_usage(self, usage: dict[str, object]) -> None:
        """Note the token counts of a usage object; a missing or non-int count becomes None."""
        self.prompt_tokens = as_int(usage.get("prompt_tokens"))
        self.completion_tokens = as_int(usage.get("completion_tokens"))


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
    return name[:12].lower() == "x-ratelimit-"
