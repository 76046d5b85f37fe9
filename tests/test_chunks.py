"""Pure parsing of OpenAI stream chunks and error bodies, on hand-written payloads."""

from typing import Any

import orjson
import pytest

from shardrun._chunks import (
    MSG_MAX,
    PARSE_ERRORS,
    ChunkReader,
    as_int,
    clip,
    error_message,
    is_rate_header,
    stream_error,
)

ROLE = (
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
)
DELTA = (
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    '[{"index":0,"delta":{"content":"h\\u00e9llo \\ud83d\\ude42"},"logprobs":null,'
    '"finish_reason":null}]}'
)
STOP = (
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    '[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}'
)
TEXT = (
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
    '[{"index":0,"text":" world","logprobs":null,"finish_reason":null}]}'
)
USAGE_ONLY = (
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    '"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14}}'
)


def load(payload: str) -> dict[str, Any]:
    obj: dict[str, Any] = orjson.loads(payload)
    return obj


def test_chat_delta_piece() -> None:
    """A chat delta yields its content; the role-only first chunk and a finish chunk yield none."""
    reader = ChunkReader(chat=True)
    assert reader.take_choices(load(ROLE)["choices"]) is None
    assert reader.take_choices(load(DELTA)["choices"]) == "héllo 🙂"
    assert reader.finish_reason is None
    assert reader.take_choices(load(STOP)["choices"]) is None
    assert reader.finish_reason == "stop"


def test_completions_text_piece() -> None:
    """A completions chunk yields choices[0].text; each API ignores the other's field."""
    assert ChunkReader(chat=False).take_choices(load(TEXT)["choices"]) == " world"
    assert ChunkReader(chat=True).take_choices(load(TEXT)["choices"]) is None
    assert ChunkReader(chat=False).take_choices(load(DELTA)["choices"]) is None


@pytest.mark.parametrize(
    "choice",
    [
        '{"delta":{"content":null}}',
        '{"delta":{"content":5}}',
        '{"delta":{"content":["a"]}}',
        '{"delta":"a"}',
        '{"delta":null}',
        '{"index":0}',
    ],
)
def test_no_piece_without_a_non_empty_string(choice: str) -> None:
    """Content that is null, not a string, or under a delta that is not an object is no piece."""
    assert ChunkReader(chat=True).take_choices([load(choice)]) is None


def test_finish_reason_on_a_later_choice() -> None:
    """A finish_reason on choices[1] is noted; the piece still comes from choices[0] only."""
    payload = (
        '{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null},'
        '{"index":1,"delta":{"content":"b"},"finish_reason":"length"}]}'
    )
    reader = ChunkReader(chat=True)
    assert reader.take_choices(load(payload)["choices"]) == "a"
    assert reader.finish_reason == "length"


def test_last_finish_reason_wins_and_null_does_not_reset() -> None:
    """The last truthy finish_reason wins, as a string; later chunks with null keep it."""
    reader = ChunkReader(chat=True)
    both = '{"choices":[{"delta":{},"finish_reason":"stop"},{"delta":{},"finish_reason":7}]}'
    reader.take_choices(load(both)["choices"])
    assert reader.finish_reason == "7"
    reader.take_choices(load(DELTA)["choices"])
    assert reader.finish_reason == "7"


def test_usage_only_chunk() -> None:
    """A usage-only chunk has empty choices (the client skips them) and sets both counts."""
    obj = load(USAGE_ONLY)
    assert not obj["choices"]
    reader = ChunkReader(chat=True)
    assert (reader.prompt_tokens, reader.completion_tokens) == (None, None)
    reader.take_usage(obj["usage"])
    assert (reader.prompt_tokens, reader.completion_tokens) == (11, 3)


def test_usage_with_non_int_counts() -> None:
    """Counts that are floats, strings, booleans or missing become None."""
    reader = ChunkReader(chat=True)
    reader.take_usage(load('{"prompt_tokens":3.0,"completion_tokens":"3"}'))
    assert (reader.prompt_tokens, reader.completion_tokens) == (None, None)
    reader.take_usage(load('{"prompt_tokens":true}'))
    assert (reader.prompt_tokens, reader.completion_tokens) == (None, None)


@pytest.mark.parametrize(
    ("payload", "status", "error"),
    [
        ('{"error":{"message":"slow down","code":429}}', "http_429", "error 429 in stream"
         " after 3 tokens: slow down"),
        ('{"error":{"message":"busy","code":500}}', "http_5xx", "error 500 in stream after 3"
         " tokens: busy"),
        ('{"error":{"message":"busy","code":"503"}}', "http_5xx", "error 503 in stream after 3"
         " tokens: busy"),
        ('{"error":{"message":"no","code":"bad_request"}}', "protocol_error", "error bad_request"
         " in stream after 3 tokens: no"),
        ('{"error":{"message":"gone","code":404}}', "protocol_error", "error 404 in stream"
         " after 3 tokens: gone"),
        ('{"error":{"message":"boom","type":"server_error"}}', "protocol_error", "error in"
         " stream after 3 tokens: boom"),
        ('{"error":"plain text"}', "protocol_error", "error in stream after 3 tokens: plain text"),
    ],
)  # fmt: skip
def test_stream_error_classification(payload: str, status: str, error: str) -> None:
    """An error object's code (numeric, digit string, other or absent) picks the status."""
    assert stream_error(load(payload)["error"], 3) == (status, error)


def test_stream_error_message_is_clipped() -> None:
    """The message of an in-stream error is one line of at most MSG_MAX characters."""
    status, error = stream_error({"message": "line\nbreak " + "x" * 500}, 0)
    assert status == "protocol_error"
    assert error == "error in stream after 0 tokens: " + ("line break " + "x" * 500)[:MSG_MAX]


@pytest.mark.parametrize(
    "payload", ["{not json", '{"choices":[{"delta":{"content":"a"', "", "data: {}"]
)
def test_unparseable_json_is_a_parse_error(payload: str) -> None:
    """orjson's error on unparseable or truncated payloads is one the client catches."""
    with pytest.raises(PARSE_ERRORS):
        orjson.loads(payload)


@pytest.mark.parametrize(
    "payload", ['{"choices":{"0":{}}}', '{"choices":"abc"}', '{"choices":[5]}', '{"choices":[[]]}']
)
def test_malformed_choices_raise_a_parse_error(payload: str) -> None:
    """Choices that are not a list of objects raise one of PARSE_ERRORS, not something else."""
    with pytest.raises(PARSE_ERRORS):
        ChunkReader(chat=True).take_choices(load(payload)["choices"])


def test_malformed_usage_raises_a_parse_error() -> None:
    """A usage value that is not an object raises one of PARSE_ERRORS."""
    with pytest.raises(PARSE_ERRORS):
        ChunkReader(chat=True).take_usage(load('{"usage":5}')["usage"])


def test_finish_reason_noted_before_a_malformed_choice_stays() -> None:
    """A finish_reason read before a later malformed choice raised is kept, as before the split."""
    reader = ChunkReader(chat=True)
    with pytest.raises(PARSE_ERRORS):
        reader.take_choices(load('{"choices":[{"delta":{},"finish_reason":"stop"},5]}')["choices"])
    assert reader.finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error":{"message":"max_tokens too large","type":"invalid"}}', "max_tokens too large"),
        (b'{"detail":"Not Found"}', "Not Found"),
        (b'{"error":{"detail":"bad model"}}', "bad model"),
        (b'{"error":"quota exceeded"}', "quota exceeded"),
        (b'{"error":{"message":""}}', '{"error":{"message":""}}'),
        (b"<html>\n  502 Bad Gateway\n</html>", "<html> 502 Bad Gateway </html>"),
        (b'{"error": {"message": "cut', '{"error": {"message": "cut'),
        (b"caf\xe9", "caf\ufffd"),
        (b"", "(empty body)"),
        (b" \n ", "(empty body)"),
    ],
)
def test_error_body_message(body: bytes, message: str) -> None:
    """The OpenAI message (or detail) of an error body, else its raw text on one line."""
    assert error_message(body) == message


def test_error_body_message_is_clipped() -> None:
    """A long error message is cut to MSG_MAX characters."""
    body = orjson.dumps({"error": {"message": "y" * 1000}})
    assert error_message(body) == "y" * MSG_MAX


def test_clip() -> None:
    """clip joins whitespace runs into single spaces and cuts at MSG_MAX; any value is str'd."""
    assert clip("  a\n\tb  c ") == "a b c"
    assert clip("z" * 300) == "z" * MSG_MAX
    assert clip(None) == "None" and clip(ValueError("bad  value")) == "bad value"


def test_as_int() -> None:
    """as_int keeps ints only: bools, floats, digit strings and None become None."""
    assert as_int(0) == 0 and as_int(12) == 12
    assert [as_int(v) for v in (True, 1.0, "1", None)] == [None, None, None, None]


def test_is_rate_header() -> None:
    """x-ratelimit-* headers match in any case; other headers do not."""
    assert is_rate_header("x-ratelimit-remaining-requests")
    assert is_rate_header("X-RateLimit-Reset-Tokens")
    assert not is_rate_header("x-ratelimit")
    assert not is_rate_header("Retry-After")
    assert not is_rate_header("x-request-id")
