"""Pure parsing of OpenAI stream chunks and error bodies, on hand-written payloads."""

from typing import Any
from unittest.mock import ANY

import orjson
import pytest

from shardrun._chunks import (
    BAD,
    DONE,
    ERROR,
    MORE,
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


def read(*payloads: str | bytes, chat: bool = True,
         reader: ChunkReader | None = None) -> tuple[int, list[str], ChunkReader]:  # fmt: skip
    """(what `ChunkReader.read` returned, the pieces it appended, the reader) for one read."""
    reader = reader or ChunkReader(chat)
    pieces: list[str] = []
    raw = [p.encode() if isinstance(p, str) else p for p in payloads]
    return reader.read(raw, pieces), pieces, reader


def test_chat_delta_piece() -> None:
    """A chat delta yields its content; the role-only first chunk and a finish chunk yield none."""
    end, pieces, reader = read(ROLE, DELTA)
    assert (end, pieces, reader.finish_reason) == (MORE, ["héllo 🙂"], None)
    end, pieces, reader = read(STOP, reader=reader)
    assert (end, pieces, reader.finish_reason) == (MORE, [], "stop")


def test_pieces_of_one_read_in_order() -> None:
    """All the payloads of one read are applied in order, each content piece appended once."""
    end, pieces, reader = read(ROLE, DELTA, DELTA.replace("h\\u00e9llo", "x"), STOP, USAGE_ONLY)
    assert end == MORE and pieces == ["héllo 🙂", "x 🙂"]
    assert (reader.finish_reason, reader.prompt_tokens, reader.completion_tokens) == ("stop", 11, 3)


def test_completions_text_piece() -> None:
    """A completions chunk yields choices[0].text; each API ignores the other's field."""
    assert read(TEXT, chat=False)[1] == [" world"]
    assert read(TEXT, chat=True)[1] == []
    assert read(DELTA, chat=False)[1] == []


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
    assert read(f'{{"choices":[{choice}]}}') == (MORE, [], ANY)


def test_finish_reason_on_a_later_choice() -> None:
    """A finish_reason on choices[1] is noted; the piece still comes from choices[0] only."""
    payload = (
        '{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null},'
        '{"index":1,"delta":{"content":"b"},"finish_reason":"length"}]}'
    )
    end, pieces, reader = read(payload)
    assert (end, pieces, reader.finish_reason) == (MORE, ["a"], "length")


def test_last_finish_reason_wins_and_null_does_not_reset() -> None:
    """The last truthy finish_reason wins, as a string; later chunks with null keep it."""
    both = '{"choices":[{"delta":{},"finish_reason":"stop"},{"delta":{},"finish_reason":7}]}'
    _, _, reader = read(both)
    assert reader.finish_reason == "7"
    read(DELTA, reader=reader)
    assert reader.finish_reason == "7"


def test_usage_only_chunk() -> None:
    """A usage-only chunk has empty choices (no piece) and sets both counts."""
    reader = ChunkReader(chat=True)
    assert (reader.prompt_tokens, reader.completion_tokens) == (None, None)
    assert read(USAGE_ONLY, reader=reader)[:2] == (MORE, [])
    assert (reader.prompt_tokens, reader.completion_tokens) == (11, 3)


def test_usage_with_non_int_counts() -> None:
    """Counts that are floats, strings, booleans or missing become None."""
    _, _, reader = read(USAGE_ONLY, '{"usage":{"prompt_tokens":3.0,"completion_tokens":"3"}}')
    assert (reader.prompt_tokens, reader.completion_tokens) == (None, None)
    _, _, reader = read(USAGE_ONLY, '{"usage":{"prompt_tokens":true}}')
    assert (reader.prompt_tokens, reader.completion_tokens) == (None, None)


def test_done_stops_the_read() -> None:
    """[DONE] ends the read: payloads after it in the same read are not applied."""
    assert read(DELTA, "[DONE]", DELTA)[:2] == (DONE, ["héllo 🙂"])
    assert read("[DONE]", "{not json")[:2] == (DONE, [])


def test_error_object_stops_the_read() -> None:
    """An error payload ends the read with its value kept; a null error is no error."""
    end, pieces, reader = read(DELTA, '{"error":{"message":"boom","code":429}}', DELTA)
    assert (end, pieces, reader.error) == (ERROR, ["héllo 🙂"], {"message": "boom", "code": 429})
    assert read('{"error":null,"choices":[{"delta":{"content":"a"}}]}')[:2] == (MORE, ["a"])


def test_invalid_utf8_reads_as_replacement_character() -> None:
    """Bytes that are not UTF-8 become U+FFFD, as decoding the line with errors="replace" did."""
    payload = b'{"choices":[{"delta":{"content":"caf\xe9 \xf0\x9f"}}]}'
    assert read(payload)[:2] == (MORE, ["caf\ufffd \ufffd"])


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
    "payload", ["{not json", '{"choices":[{"delta":{"content":"a"', "", "data: {}", "\xff{}"]
)
def test_unparseable_json_is_bad(payload: str) -> None:
    """An unparseable or truncated payload ends the read as BAD, the payload kept for the error."""
    raw = payload.encode("latin-1")
    end, pieces, reader = read(DELTA, raw, DELTA)
    assert (end, pieces, reader.bad) == (BAD, ["héllo 🙂"], raw)


@pytest.mark.parametrize(
    "payload",
    ['{"choices":{"0":{}}}', '{"choices":"abc"}', '{"choices":[5]}', '{"choices":[[]]}', "[1]",
     "5", '{"usage":5}', '{"choices":[{"delta":{"content":"a"}},5]}'],
)  # fmt: skip
def test_malformed_shapes_are_bad(payload: str) -> None:
    """Choices that are not a list of objects, a usage that is not an object, a payload that is
    not an object: BAD, and a malformed chunk's piece is not appended."""
    assert read(payload)[:2] == (BAD, [])


def test_parse_errors_cover_what_malformed_data_raises() -> None:
    """orjson's error and the errors of reading a wrong shape are all in PARSE_ERRORS."""
    with pytest.raises(PARSE_ERRORS):
        orjson.loads(b"{not json")
    with pytest.raises(PARSE_ERRORS):
        load('{"choices":"abc"}')["choices"][0].get("delta")


def test_finish_reason_noted_before_a_malformed_choice_stays() -> None:
    """A finish_reason read before a later malformed choice raised is kept."""
    end, _, reader = read('{"choices":[{"delta":{},"finish_reason":"stop"},5]}')
    assert (end, reader.finish_reason) == (BAD, "stop")


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
