"""Pure parsing of OpenAI-compatible streaming chunks and error bodies: no I/O, no event loop.

`shardrun.client` decodes each SSE payload with `orjson.loads` and hands the pieces of the object
to these functions; it owns the timing and the outcome, this module only reads JSON values.

Malformed shapes are not checked up front: a chunk whose `choices` is not a list of objects (or a
`usage` that is not an object) makes these functions raise one of `PARSE_ERRORS`, which the client
catches around the whole read and reports as `protocol_error`. That keeps the per-chunk path free
of `isinstance` checks for the shapes every real server sends.
"""

from __future__ import annotations

import orjson

MSG_MAX = 200
"""Longest error sentence fragment: error messages go into one-line JSON events."""
PARSE_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError)
"""What malformed stream data raises here or in `orjson.loads` (JSONDecodeError is a ValueError)."""


def parse_choices(choices: list[dict[str, object]], chat: bool) -> tuple[str | None, str | None]:
    """(content piece, finish_reason) of one chunk's non-empty `choices` list.

    The piece is `choices[0].delta.content` (chat) or `choices[0].text` (completions), None unless
    a non-empty string. The finish_reason is the last truthy one over all choices, as a string.
    """
    first = choices[0]
    if chat:
        delta = first.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else None
    else:
        piece = first.get("text")
    reason = None
    for choice in choices:
        if found := choice.get("finish_reason"):
            reason = found
    return (
        piece if piece and isinstance(piece, str) else None,
        None if reason is None else str(reason),
    )


def usage_counts(usage: dict[str, object]) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a usage object; a missing or non-int count is None."""
    return as_int(usage.get("prompt_tokens")), as_int(usage.get("completion_tokens"))


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
