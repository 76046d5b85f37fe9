"""Pure parsing of OpenAI stream chunks and error bodies, on hand-written payloads."""

import codecs
import unicodedata
from typing import Any
from unittest.mock import ANY

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardrun._chunks import (
    BAD,
    DONE,
    ERROR,
    LEARN_MAX,
    MORE,
    MSG_MAX,
    PADDING_KEY,
    PARSE_ERRORS,
    USAGE_MAX,
    ChunkReader,
    ToolCallParts,
    Unreadable,
    as_int,
    clip,
    error_message,
    is_rate_header,
    merge_tool_calls,
    plain_arguments,
    plain_thought,
    read_whole,
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
    """[DONE] ends the read: payloads after it in the same read are not applied. So does a
    payload that starts with it (`[DONE] `), as OpenAI's own clients take it: it failed a whole
    answer as unparseable. A part of it is no end."""
    assert read(DELTA, "[DONE]", DELTA)[:2] == (DONE, ["héllo 🙂"])
    assert read("[DONE]", "{not json")[:2] == (DONE, [])
    assert read(DELTA, "[DONE] ", DELTA)[:2] == (DONE, ["héllo 🙂"])
    assert read("[DONE]\t\x00")[:2] == (DONE, [])
    assert read("[DONE")[0] == BAD


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
        ('{"error":{"message":"no","code":"bad_request"}}', "http_4xx", "error bad_request"
         " in stream after 3 tokens: no"),
        ('{"error":{"message":"gone","code":404}}', "http_4xx", "error 404 in stream"
         " after 3 tokens: gone"),
        ('{"error":{"message":"boom","type":"server_error"}}', "http_5xx", "error server_error"
         " in stream after 3 tokens: boom"),
        ('{"error":{"message":"hm","code":"new_code","type":"server_error"}}', "http_5xx",
         "error new_code in stream after 3 tokens: hm"),
        ('{"error":{"message":"?","code":"new_code"}}', "protocol_error", "error new_code"
         " in stream after 3 tokens: ?"),
        ('{"error":{"message":"x","code":600}}', "protocol_error", "error 600 in stream"
         " after 3 tokens: x"),
        ('{"error":{"message":"later","code":408}}', "protocol_error", "error 408 in stream"
         " after 3 tokens: later"),
        ('{"error":{"message":"long","type":"exceed_context_size_error"}}', "http_4xx",
         "error exceed_context_size_error in stream after 3 tokens: long"),
        ('{"error":{"message":"x","code":true}}', "protocol_error", "error True in stream"
         " after 3 tokens: x"),
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
        (b"<html>\n  502 Bad Gateway\n</html>", 'an HTML page that says "502 Bad Gateway"'),
        (b"<?xml version='1.0'?><Error><Code>Denied</Code></Error>",
         "<?xml version='1.0'?><Error><Code>Denied</Code></Error>"),
        (b'{"error": {"message": "cut', '{"error": {"message": "cut'),
        (b"caf\xe9", "caf\ufffd"),
        (b"", "(empty body)"),
        (b" \n ", "(empty body)"),
    ],
)
def test_error_body_message(body: bytes, message: str) -> None:
    """The OpenAI message (or detail) of an error body, else its raw text on one line."""
    assert error_message(body) == message


CLOUDFLARE_403 = (
    b'<!DOCTYPE html>\n<!--[if lt IE 7]> <html class="no-js ie6 oldie" lang="en-US"> <![endif]-->\n'
    + b'<!--[if IE 7]>    <html class="no-js ie7 oldie" lang="en-US"> <![endif]-->\n' * 3
    + b'<head>\n<title>Attention Required! | Cloudflare</title>\n<meta charset="UTF-8" />\n'
    b"<style>body{}</style></head><body><h1>Sorry, you have been blocked</h1></body></html>\n")


@pytest.mark.parametrize(("body", "said"), [
    (CLOUDFLARE_403, "Attention Required! | Cloudflare"),
    (b"<html><head><title> </title></head><body><h1>401 Authorization Required</h1>"
     b"<hr><center>nginx</center></body></html>", "401 Authorization Required"),
    (b"<!doctype html><html><head><script>if (a) {}</script><style>p{}</style></head>"
     b"<body><p>Caf&eacute; Wi-Fi:</p>\n<p>accept &amp; go</p></body></html>",
     "Caf\u00e9 Wi-Fi: accept & go"),
])  # fmt: skip
def test_an_html_error_page_is_read_by_its_words(body: bytes, said: str) -> None:
    """A proxy's or gateway's HTML page (a login page, a block page, a 502): its title, else
    its first heading, else its text, never its markup (Cloudflare's some 300 bytes of
    comments before the title filled the whole message)."""
    assert error_message(body) == f'an HTML page that says "{said}"'
    assert error_message(b"<html><body></body></html>") == "an HTML page with no text"


@pytest.mark.parametrize(("body", "said"), [
    (b"<html><body><script>if (a < b) { go('<b>') }</script><style>p>a{}</style>"
     b"<p>Sign in</p></body></html>", "Sign in"),
    (b"<html><body><!-- <p>old</p> a-b > c --><p>Sign in</p><!-- never closed <p>x",
     "Sign in"),
    (b"<html><body><SCRIPT>a<b</script >Sign in</body></html>", "Sign in"),
])  # fmt: skip
def test_an_html_page_s_text_holds_no_script_or_comment(body: bytes, said: str) -> None:
    """A page with no title or heading says its text: a script's or a comment's text that
    held a "<" or a ">" (a comparison, a tag in a string, an old part of the page) was read as
    words, code in the message in place of what the page says."""
    assert error_message(body) == f'an HTML page that says "{said}"'


@pytest.mark.parametrize("body", [
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Body>Access Denied</Body></Error>",
    b'<Envelope xmlns="http://schemas.xmlsoap.org/soap/envelope/"><Body><Fault>'
    b"<faultstring>Denied</faultstring></Fault></Body></Envelope>",
    b'<Body xmlns="urn:example:errors"><Title>Denied</Title></Body>',
])  # fmt: skip
def test_an_xml_error_body_is_no_html_page(body: bytes) -> None:
    """An XML error (an S3-style `<Error>`, a SOAP fault) whose elements share a name with
    HTML's (`Body`, `Title`) was named "an HTML page": its text is the message, as for any
    body that is not a page."""
    assert error_message(body) == " ".join(body.decode().split())


@pytest.mark.parametrize("body", [
    b'<?xml version="1.0" encoding="utf-8"?>\n<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 '
    b'Strict//EN" "x.dtd">\n<html xmlns="http://www.w3.org/1999/xhtml"><head><title>503 '
    b"Service Unavailable</title></head></html>",
    b'<html xmlns="http://www.w3.org/1999/xhtml"><title>503 Service Unavailable</title></html>',
    b"<!-- served by a proxy -->\n<HTML><HEAD><TITLE>503 Service Unavailable</TITLE></HEAD>",
    b'<html xmlns="http://www.w3.org/1999/xhtml" xmlns:fb="http://ogp.me/ns/fb#"><title>503 '
    b"Service Unavailable</title></html>",
    b'<html xmlns:o="urn:schemas-microsoft-com:office:office"><title>503 Service Unavailable'
    b"</title></html>",
])  # fmt: skip
def test_an_xhtml_page_is_an_html_page(body: bytes) -> None:
    """A page in XHTML (an XML declaration, its namespace on `html`, as Varnish sends one) or
    after a comment is still a page, named by its title; so is one whose `html` declares a
    prefix's namespace (`xmlns:fb`), which names none of its own."""
    assert error_message(body) == 'an HTML page that says "503 Service Unavailable"'


@pytest.mark.parametrize("body", [
    b'<meta charset="utf-8">\n<title>Sign in</title>',
    b'<meta http-equiv="refresh" content="0; url=/login"><html><head><title>Sign in</title>',
    b"<script>if (a < b) location.href = '/login'</script>\n<HTML><TITLE>Sign in</TITLE>",
    b'<link rel="stylesheet" href="s.css"><style>p > a {}</style><body><h1>Sign in</h1>',
    b"\r\n\r\n  <!-- portal -->\n<base href=/><Html><Title>Sign in</Title></Html>",
])  # fmt: skip
def test_an_html_page_may_start_with_its_head_s_elements(body: bytes) -> None:
    """A page that starts with the elements of a head (a captive portal's `<meta>` refresh or
    `<script>` redirect, a `<meta charset>`) before its `html`, `head`, `title` or `body` was,
    once a page had to start with those, read as markup: it is a page, named by its title."""
    assert error_message(body) == 'an HTML page that says "Sign in"'


@pytest.mark.parametrize("body", [
    b"<html><head><!-- <title>Old title</title> --><script>document.write('<h1>x</h1>')"
    b"</script><title>Sign in</title></head></html>",
    b"<html><body><script>var t = '<h1>Loading</h1>';</script><h1>Sign in</h1></body></html>",
    b"<html><body><style>h1::after { content: '<title>x' }</style><h1>Sign in</h1></body>",
])  # fmt: skip
def test_an_html_page_s_heading_is_none_in_a_comment_or_script(body: bytes) -> None:
    """The title or first heading a page shows: one inside a comment, a script or a style is
    none the page shows, and it was taken for what the page says."""
    assert error_message(body) == 'an HTML page that says "Sign in"'


def test_an_html_page_s_quoted_title_stays_one_quotation() -> None:
    """A title that holds double quotes would end the quotation of what the page says before
    its end (`says "Log in to "Acme""`): its own quotes are shown as single ones."""
    body = b'<html><title>Log in to "Acme" &quot;Cloud&quot;</title></html>'
    assert error_message(body) == "an HTML page that says \"Log in to 'Acme' 'Cloud'\""


@pytest.mark.parametrize("body", [
    b"\xef\xbb\xbf<!DOCTYPE html><html><title>Sign in</title></html>",
    codecs.BOM_UTF16_LE + "<html><title>Sign in</title></html>".encode("utf-16-le"),
    codecs.BOM_UTF16_BE + "<html><title>Sign in</title></html>".encode("utf-16-be"),
])  # fmt: skip
def test_an_html_page_with_a_byte_order_mark_is_read(body: bytes) -> None:
    """A page that begins with a byte order mark (UTF-8's, or UTF-16's as some Windows servers
    send): it was no HTML page, so its message was its markup, in UTF-16 a "\\x00" between
    each two letters."""
    assert error_message(body) == 'an HTML page that says "Sign in"'


@pytest.mark.parametrize(("body", "message"), [
    (codecs.BOM_UTF16_LE + '{"error": {"message": "no such model"}}'.encode("utf-16-le"),
     "no such model"),
    (codecs.BOM_UTF16_BE + "Service Unavailable".encode("utf-16-be"), "Service Unavailable"),
    (codecs.BOM_UTF32_LE + "Service Unavailable".encode("utf-32-le"), "Service Unavailable"),
    (codecs.BOM_UTF32_BE + "Service Unavailable".encode("utf-32-be"), "Service Unavailable"),
    (codecs.BOM_UTF8 + b'{"error": {"message": "no such model"}}', "no such model"),
], ids=["utf-16-le-json", "utf-16-be", "utf-32-le", "utf-32-be", "utf-8-json"])  # fmt: skip
def test_an_error_body_with_a_byte_order_mark_is_read_as_its_text(body: bytes,
                                                                   message: str) -> None:
    """An error body in UTF-16 or UTF-32 (by its byte order mark, as some Windows servers
    send) showed a "\\x00" between each two letters, and JSON behind any byte order mark was
    not read as JSON: its message is now what it says."""
    assert error_message(body) == message


@pytest.mark.parametrize(("body", "message"), [
    (b"\xff\xfeabc", "\ufffd\ufffdabc"),
    (codecs.BOM_UTF16_LE + "\x00Service Unavailable".encode("utf-16-le"),
     "\\x00Service Unavailable"),
    (codecs.BOM_UTF16_LE + "\x00Service Unavailable!".encode("utf-16-le"),
     "\\x00Service Unavailable!"),
], ids=["latin-1", "utf-16-nul", "utf-16-nul-4n"])  # fmt: skip
def test_an_error_body_is_read_by_its_mark_only_where_it_fits(body: bytes, message: str) -> None:
    """Bytes that look like a byte order mark: a Latin-1 body starting "\xff\xfe" whose length
    is no whole number of UTF-16's code units, or UTF-16's mark and a NUL (UTF-32's
    little-endian mark) whose rest is no UTF-32, was read as garbled CJK."""
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


@pytest.mark.parametrize("char", [*map(chr, (*range(0x202A, 0x202F), *range(0x2066, 0x206A),
                                              *range(0x200B, 0x2010), 0x061C, 0xFEFF))])
def test_clip_shows_invisible_and_direction_characters(char: str) -> None:
    """A server's message may hold characters a terminal does not show but obeys: a bidi
    override (U+202E) reversed the rest of the line, a zero-width one hid in a word. Each is
    shown as its escape, as control characters are; a line or paragraph separator is a space."""
    assert clip(f"ok{char}evil") == f"ok\\u{ord(char):04x}evil"
    assert clip("a\u2028b\u2029c") == "a b c"


@pytest.mark.parametrize("char", [*map(chr, (0x00AD, 0x180E, *range(0x2060, 0x2065),
                                              *range(0x206A, 0x2070), *range(0xFFF9, 0xFFFC)))])
def test_clip_shows_every_invisible_format_character(char: str) -> None:
    """The other format characters a terminal does not show: a word joiner or an invisible
    operator (U+2060-2064), the Mongolian vowel separator, a soft hyphen, the deprecated
    shaping controls, the interlinear annotations, each hid in a word as a zero-width space
    did."""
    assert clip(f"ok{char}evil") == f"ok\\u{ord(char):04x}evil"


def test_clip_shows_tag_characters() -> None:
    """Tag characters (U+E0000-E007F) spell ASCII no terminal shows: a message could carry
    hidden words. Each is shown as its `\\U` escape, eight digits, as it lies past U+FFFF."""
    hidden = "".join(map(chr, (0xE0001, 0xE0068, 0xE0069, 0xE007F)))
    assert clip(f"ok{hidden}") == "ok\\U000e0001\\U000e0068\\U000e0069\\U000e007f"


def test_as_int() -> None:
    """as_int keeps ints only: bools, floats, digit strings and None become None."""
    assert as_int(0) == 0 and as_int(12) == 12
    assert [as_int(v) for v in (True, 1.0, "1", None)] == [None, None, None, None]
    assert as_int(USAGE_MAX) == USAGE_MAX and as_int(USAGE_MAX + 1) is None and as_int(-1) is None


def test_is_rate_header() -> None:
    """x-ratelimit-* headers match in any case; other headers do not."""
    assert is_rate_header("x-ratelimit-remaining-requests")
    assert is_rate_header("X-RateLimit-Reset-Tokens")
    assert not is_rate_header("x-ratelimit")
    assert not is_rate_header("Retry-After")
    assert not is_rate_header("x-request-id")


# -- the envelope: plain content chunks read without parsing -----------------------------------
#
# Every case below compares `ChunkReader` with `reference`, a plain reading of each payload with
# orjson (the documented behaviour), on the same reads.


Outcome = tuple[list[int], list[str], tuple[Any, ...]]
"""Per read what `read` returned, every piece appended, and the reader's state at the end."""


def reference(reads: list[list[bytes]], chat: bool) -> Outcome:
    """Each payload parsed on its own, in order, until one ends the stream."""
    pieces: list[str] = []
    codes: list[int] = []
    finish = prompt = completion = error = None
    bad = b""
    reasoning: list[str] = []
    refusal: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    legacy: dict[str, str] | None = None
    others = 0
    for payloads in reads:
        code = MORE
        for payload in payloads:
            if payload.startswith(b"[DONE]"):
                code = DONE
                break
            try:
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    obj = orjson.loads(payload.decode("utf-8", "replace"))
                if obj.get("error") is not None:
                    error, code = obj["error"], ERROR
                    break
                usage = obj.get("usage")
                if choices := obj.get("choices"):
                    first = choices[0]
                    if chat:
                        delta = first.get("delta")
                        if delta is None:  # a whole answer's choice: its message
                            delta = first.get("message")
                        piece = delta.get("content") if isinstance(delta, dict) else None
                        if isinstance(delta, dict):
                            thought = delta.get("reasoning_content") or delta.get("reasoning")
                            if thought and isinstance(thought, str):
                                reasoning.append(thought)
                            if delta.get("tool_calls"):
                                merge_calls_by_hand(calls, delta["tool_calls"])
                            refused = delta.get("refusal")
                            if refused and isinstance(refused, str):
                                refusal.append(refused)
                            if old_form := delta.get("function_call"):
                                sent = {k: old_form.get(k) for k in ("name", "arguments")}
                                legacy = legacy or {"name": "", "arguments": ""}
                                for key, text in sent.items():
                                    if text:
                                        legacy[key] += (text if isinstance(text, str)
                                                        else orjson.dumps(text).decode())
                            if ((thought and isinstance(thought, str)) or delta.get("tool_calls")
                                    or (refused and isinstance(refused, str))
                                    or old_form):  # fmt: skip
                                others += 1
                    else:
                        piece = first.get("text")
                    for choice in choices:
                        if reason := choice.get("finish_reason"):  # no string: its JSON
                            finish = (reason if isinstance(reason, str)
                                      else orjson.dumps(reason).decode())
                    if piece and isinstance(piece, str):
                        pieces.append(piece)
                if usage:
                    prompt = as_int(usage.get("prompt_tokens"))
                    completion = as_int(usage.get("completion_tokens"))
            except PARSE_ERRORS:
                bad, code = payload, BAD
                break
        codes.append(code)
        if code != MORE:
            break
    call_list = [calls[i] for i in sorted(calls)] if calls else None
    return codes, pieces, (finish, prompt, completion, error, bad, reasoning, call_list, others,
                           refusal, legacy)  # fmt: skip


def merge_calls_by_hand(calls: dict[int, dict[str, Any]], deltas: Any) -> None:
    """`merge_tool_calls` as documented, on plain dicts, for `reference`."""
    for delta in deltas:
        if type(delta.get("index", 0)) is not int:
            raise TypeError("index")
        call = calls.setdefault(delta.get("index", 0), {
            "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if delta.get("id"):
            call["id"] = str(delta["id"])
        if delta.get("type"):
            call["type"] = str(delta["type"])
        if function := delta.get("function"):
            for key in ("name", "arguments"):
                if text := function.get(key):
                    call["function"][key] += (text if isinstance(text, str)
                                              else orjson.dumps(text).decode())


def by_reader(reads: list[list[bytes]], chat: bool) -> Outcome:
    reader = ChunkReader(chat)
    pieces: list[str] = []
    codes: list[int] = []
    for payloads in reads:
        codes.append(reader.read(payloads, pieces))
        if codes[-1] != MORE:
            break
    state = (reader.finish_reason, reader.prompt_tokens, reader.completion_tokens, reader.error)
    return codes, pieces, (*state, reader.bad, reader.reasoning, reader.tool_call_list(),
                           reader.other_chunks, reader.refusal,
                           reader.function_call_message())  # fmt: skip


def chunk(content: object, *, chat: bool = True, cid: str = "chatcmpl-7", created: int = 1,
          extra: dict[str, Any] | None = None, finish: object = None,
          delta: dict[str, Any] | None = None) -> dict[str, Any]:
    """A chunk shaped as vLLM and the simulator send it; `delta` adds keys to a chat delta."""
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["delta"] = {"content": content} | (delta or {})
    else:
        choice["text"] = content
    choice |= {"logprobs": None, "finish_reason": finish}
    obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": "m",
           "choices": [choice]}  # fmt: skip
    return obj | (extra or {})


def thinking(text: str, field: str, shape: str, *, chat: bool = True, cid: str = "chatcmpl-7",
             other: str | None = None) -> dict[str, Any]:
    """A reasoning chunk as reasoning models' servers send it: `field` holds the text, beside
    a null content (`null_content`), without one (`no_content`), or with the other field name
    holding `other` (default: the same text, as servers that send both names do)."""
    obj = chunk(None, chat=chat, cid=cid, delta={field: text})
    if chat:
        delta = obj["choices"][0]["delta"]
        if shape != "null_content":
            del delta["content"]
        if shape == "both_fields":
            twin = "reasoning" if field == "reasoning_content" else "reasoning_content"
            delta[twin] = text if other is None else other
    return obj


def arguments(text: str, index: int = 0, *, chat: bool = True,
              cid: str = "chatcmpl-7") -> dict[str, Any]:
    """A chunk with the next piece of one call's arguments, as servers stream a tool call."""
    obj = chunk(None, chat=chat, cid=cid,
                delta={"tool_calls": [{"index": index, "function": {"arguments": text}}]})
    if chat:
        del obj["choices"][0]["delta"]["content"]
    return obj


class CountingLoads:
    """Stands in for the orjson module inside `shardrun._chunks`, counting `loads` calls."""

    JSONDecodeError = orjson.JSONDecodeError

    def __init__(self) -> None:
        self.calls = 0
        self.seen: list[bytes | str] = []

    def loads(self, data: bytes | str) -> Any:
        self.calls += 1
        self.seen.append(data)
        return orjson.loads(data)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> CountingLoads:
    counter = CountingLoads()
    monkeypatch.setattr("shardrun._chunks.orjson", counter)
    return counter


def test_a_learned_envelope_reads_plain_chunks_without_parsing(loads: CountingLoads) -> None:
    """After one plain chunk (parsed, plus one probe), the stream's other plain chunks are sliced,
    one per read or many per read; the finish, usage and [DONE] payloads are parsed."""
    words = [" the", " quick", " brown", " fox", " jumps", " over"]
    payloads = [orjson.dumps(chunk(w)) for w in words]
    tail = [orjson.dumps(chunk(None, finish="stop")), USAGE_ONLY.encode(), b"[DONE]"]
    reads = [[ROLE.encode()], payloads[:1], payloads[1:2], payloads[2:], tail]
    assert by_reader(reads, True) == reference(reads, True)
    assert by_reader(reads, True)[1] == words
    loads.calls = 0
    by_reader(reads, True)
    # role + first word + probe, then only the finish and usage chunks ([DONE] is no JSON)
    assert loads.calls == 3 + 2


def test_escaped_content_in_a_run_is_read_from_its_strings(loads: CountingLoads) -> None:
    """Content that JSON escapes (a line break, a quote) has its string parsed, all of a read's
    in one array, and content that is not UTF-8 its payload; the plain ones around them in the
    same read are sliced. A read whose array fails (here the non-UTF-8 bytes) is read one
    payload at a time."""
    payloads = [orjson.dumps(chunk(w)) for w in ["a", "b", "line\nbreak", 'say "hi"', "c"]]
    broken = orjson.dumps(chunk("caf\u00e9")).replace("é".encode(), b"\xe9")
    reads = [payloads[:2], [*payloads[2:], broken, payloads[4]], [payloads[0], broken],
             payloads[2:]]  # fmt: skip
    assert by_reader(reads, True) == reference(reads, True)
    assert by_reader(reads, True)[1] == [
        "a", "b", "line\nbreak", 'say "hi"', "c", "caf\ufffd", "c", "a", "caf\ufffd",
        "line\nbreak", 'say "hi"', "c"]  # fmt: skip
    loads.calls = 0
    by_reader(reads, True)
    # "a" + probe; then the second read's array, which fails, its two escaped contents' strings
    # and the broken payload twice (bytes, then text); the same twice in the third read; the
    # last read's array
    assert loads.calls == 2 + (1 + 2 + 2) + 2 + 1
    assert loads.seen[3:5] == [b'"line\\nbreak"', b'"say \\"hi\\""']
    assert loads.seen[-1] == b'["line\\nbreak","say \\"hi\\"","c"]'


@pytest.mark.parametrize("value", [
    b"line\\nbreak", b'a\\"', b"\\u00e9t\\u00e9", b"\\ud83d\\ude42", b"tab\\t",
    b"\\\\", b"\\", b'a\\"b\\', b'a","x":"b', b'a"', b"\\ud83d", b"\\x41", b"\\u12",
    b"ok\\n\x01", b"\\n\xff",
])  # fmt: skip
def test_escaped_values_that_fit_the_envelope_read_as_parsing_would(value: bytes) -> None:
    """A value with escapes between a learned prefix and suffix, well formed or not (a raw
    quote that ends the string early, a bad escape, a lone surrogate, a control or non-UTF-8
    byte): read alone or in a run, the outcome is that of parsing every payload."""
    good = [orjson.dumps(chunk(w)) for w in ["a", "b"]]
    at = good[0].index(b'"a"') + 1
    odd = good[0][:at] + value + good[0][at + 1 :]
    thought = [orjson.dumps(thinking(w, "reasoning_content", "no_content")) for w in ["a", "b"]]
    t_at = thought[0].index(b'"a"') + 1
    t_odd = thought[0][:t_at] + value + thought[0][t_at + 1 :]
    for reads in ([good[:1], good[1:], [odd], good[:1]], [good[:1], [good[1], odd, good[0]]],
                  [thought[:1], thought[1:], [t_odd], thought[:1]],
                  [thought[:1], [thought[1], t_odd, thought[0]]]):  # fmt: skip
        assert by_reader(reads, True) == reference(reads, True)


@pytest.mark.parametrize("values", [
    (b"\\n", b"\\n"), (b"\\\\", b'\\"'), (b'say \\"hi\\"', b"\\u00e9"), (b"a", b"\\t"),
    (b"a\\", b' ,"b'), (b"a\\", b"b"), (b"\\u12", b"34"), (b'a","b', b"c"), (b'a"', b'"b'),
    (b"x\\", b'",\\"y'), (b"\\n", b"\xff"), (b"ok\\n", b"\x01"), (b"\\n", b"\x00"),
    (b"\\", b"\\"), (b'a\\\\", "b', b"c"), (b'\\\\\\\\"', b"x"),
])  # fmt: skip
def test_escaped_values_side_by_side_in_a_run_read_as_parsing_would(
    values: tuple[bytes, bytes],
) -> None:
    """Two values with escapes in one read, where a run parses its escaped values as one
    array: well formed, or shaped to fool that array (a backslash that escapes the quote after
    its value, a raw quote that opens another string, one after an escaped backslash, a `\\u`
    escape cut at the value's end), the outcome is that of parsing every payload, for content,
    thought and arguments alike."""
    makers = [lambda w: chunk(w), lambda w: thinking(w, "reasoning_content", "no_content"),
              lambda w: arguments(w)]  # fmt: skip
    for make in makers:
        good = [orjson.dumps(make(w)) for w in ["a", "b"]]
        at = good[0].index(b'"a"') + 1
        odd = [good[0][:at] + value + good[0][at + 1 :] for value in values]
        for reads in ([good[:1], [good[1], *odd, good[0]]], [good[:1], [*odd, *odd]],
                      [good[:1], [*odd, *good]]):  # fmt: skip
            assert by_reader(reads, True) == reference(reads, True), (make, reads)


def test_an_equal_value_elsewhere_is_not_taken_for_the_content() -> None:
    """A server that escapes more than JSON needs, with a field holding the same text as the
    content: the raw bytes found are that field's. The probe rejects them, so a later chunk's
    content is not read from the other field."""
    reads = [[b'{"id":"x","choices":[{"delta":{"content":"\\u0078"}}]}'],
             [b'{"id":"y","choices":[{"delta":{"content":"\\u0078"}}]}'],
             [b'{"id":"z","choices":[{"delta":{"content":"\\u0078"}}]}']]  # fmt: skip
    assert by_reader(reads, True) == reference(reads, True)
    assert by_reader(reads, True)[1] == ["x", "x", "x"]


def test_overlapping_prefix_and_suffix_are_no_empty_content() -> None:
    """A payload that starts with the prefix and ends with the suffix only by sharing their
    quote is not a chunk with empty content: it is parsed (and is invalid JSON)."""
    good = orjson.dumps(chunk("a"))
    at = good.index(b'"a"')
    short = good[: at + 1] + good[at + 3 :]  # ...{"content":"},"logprobs"...: one quote
    for reads in ([[good], [short]], [[good], [good, short]], [[good], [short, good]]):
        assert by_reader(reads, True) == reference(reads, True)
        assert by_reader(reads, True)[0][-1] == BAD


def test_an_envelope_that_changes_per_chunk(loads: CountingLoads) -> None:
    """A field that differs per chunk (not OpenAI's padding, which is read off): every payload
    is parsed, and the failed lessons cost at most LEARN_MAX probes per stream."""
    payloads = [orjson.dumps(chunk(f" w{i}", extra={"nonce": "x" * (i % 7)}))
                for i in range(40)]  # fmt: skip
    reads = [[p] for p in payloads[:20]] + [payloads[20:]]
    assert by_reader(reads, True) == reference(reads, True)
    loads.calls = 0
    by_reader(reads, True)
    assert len(payloads) <= loads.calls <= len(payloads) + LEARN_MAX


def test_a_new_envelope_mid_stream_is_learned(loads: CountingLoads) -> None:
    """A field that changes once (a `created` second ticking over) is learned again."""
    payloads = [orjson.dumps(chunk(f" w{i}", created=1 if i < 5 else 2)) for i in range(10)]
    reads = [[p] for p in payloads]
    assert by_reader(reads, True) == reference(reads, True)
    assert by_reader([*reads, payloads], True) == reference([*reads, payloads], True)
    loads.calls = 0
    by_reader(reads, True)
    assert loads.calls == 2 + 2  # each envelope: its first chunk and a probe


def padded(obj: dict[str, Any], i: int) -> bytes:
    """A chunk as OpenAI streams it: `usage` null (with `include_usage`), then `obfuscation`
    padding, 1 to 15 letters and digits that differ chunk by chunk."""
    letters = "uSpCcO0b4kQz9mEw"
    return orjson.dumps(obj | {"usage": None, "obfuscation": letters[: 1 + i * 7 % 15]})


def openai(delta: dict[str, Any], i: int, finish: str | None = None) -> bytes:
    return padded({"id": "chatcmpl-CUb3xY", "object": "chat.completion.chunk",
                   "created": 1761000000, "model": "gpt-4o-mini-2024-07-18",
                   "service_tier": "default", "system_fingerprint": "fp_560af6e559",
                   "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                "finish_reason": finish}]}, i)  # fmt: skip


def unpad(payload: bytes) -> bytes:
    return payload[: payload.rindex(b',"obfuscation":')] + b"}"


def whole_chunks_parsed(loads: CountingLoads) -> list[bytes]:
    """The payloads `loads` parsed whole (not a string alone, not a run's array of strings)."""
    return [s for s in loads.seen if isinstance(s, bytes) and s.startswith(b"{")]


def test_openai_padding_is_read_off_and_the_chunks_sliced(loads: CountingLoads) -> None:
    """OpenAI's chunks, each with padding of its own length: after the first word (parsed, and
    probed without its padding), words are sliced, one per read or many per read; words with
    escapes are read from their strings. The role, finish and usage chunks are parsed."""
    words = [" The", " quick", "\n", ' "brown"', " fox", " jumps", " over", "\n\n", " é"]
    payloads = [openai({"role": "assistant", "content": "", "refusal": None}, 0),
                *(openai({"content": w}, i) for i, w in enumerate(words, 1)),
                openai({}, 20, finish="stop"),
                padded({"id": "chatcmpl-CUb3xY", "choices": [], "usage": None}, 21)
                .replace(b'"usage":null', b'"usage":{"prompt_tokens":9,"completion_tokens":10}'),
                b"[DONE]"]  # fmt: skip
    reads = [[p] for p in payloads[:6]] + [payloads[6:]]
    assert by_reader(reads, True) == reference(reads, True)
    assert by_reader(reads, True)[1] == words
    loads.calls, loads.seen = 0, []
    by_reader(reads, True)
    # Once padding is known, payloads are parsed (and probed) without it.
    probe = unpad(payloads[1]).replace(b'" The"', b'" The~"')
    assert whole_chunks_parsed(loads) == [payloads[0], payloads[1], probe,
                                          unpad(payloads[-3]), unpad(payloads[-2])]


def test_padding_found_after_an_envelope_was_learned(loads: CountingLoads) -> None:
    """A stream whose first words came without padding: the first padded word is parsed, the
    envelope fits it without its padding, and the words after it are sliced."""
    plain = [orjson.dumps(chunk(f" w{i}", extra={"usage": None})) for i in range(3)]
    pads = [orjson.dumps(chunk(f" p{i}", extra={"usage": None, "obfuscation": "k" * i}))
            for i in range(1, 9)]  # fmt: skip
    reads = [[p] for p in plain + pads[:4]] + [pads[4:]]
    assert by_reader(reads, True) == reference(reads, True)
    loads.calls, loads.seen = 0, []
    by_reader(reads, True)
    assert whole_chunks_parsed(loads) == [plain[0], plain[0].replace(b'" w0"', b'" w0~"'), pads[0]]


def test_padded_thoughts_and_arguments_are_sliced(loads: CountingLoads) -> None:
    """The thought and arguments envelopes read padded chunks the same way."""
    thoughts = [padded(thinking(f" t{i}", "reasoning_content", "no_content"), i)
                for i in range(6)]  # fmt: skip
    pieces = [padded(arguments(f" {i},", 0), i) for i in range(6)]
    start = padded(chunk(None, delta={"tool_calls": [{"index": 0, "id": "call_1",
                   "type": "function", "function": {"name": "f", "arguments": ""}}]}), 3)
    reads = [[p] for p in thoughts[:3]] + [thoughts[3:], [start], *([p] for p in pieces[:3]),
                                          pieces[3:]]  # fmt: skip
    assert by_reader(reads, True) == reference(reads, True)
    loads.calls, loads.seen = 0, []
    by_reader(reads, True)
    # the first thought and first piece with a probe each, and the call's first chunk
    assert len(whole_chunks_parsed(loads)) == 5


ODD_PADDED = [
    b'{,"obfuscation":"x"}',  # not JSON, though `{}` would be
    b'{"k":","obfuscation":"x"}"}',  # not JSON, though `{"k":"}"}` would be
    b'{ ,"obfuscation":"x"}',
    b'{"choices":[],"obfuscation":"x"}',
    openai({"content": " a"}, 1).replace(b'"obfuscation":"', b'"obfuscation":"\xc3\xa9'),
    openai({"content": " a"}, 1).replace(b'"obfuscation":"', b'"obfuscation":"\\"'),
    openai({"content": " a"}, 1).replace(b'"obfuscation":"', b'"obfuscation":"\x01'),
    openai({"content": " a"}, 1).replace(b'"obfuscation":"', b'"obfuscation":"\xff'),
    openai({"content": " a"}, 1) + b" ",
    openai({"content": " a"}, 1)[:-1] + b"]",  # the padding's string is not the object's end
    openai({"content": " a"}, 1).replace(b'"finish_reason":null', b'"finish_reason":true'),
    openai({"content": " a"}, 1).replace(b'"usage":null', b'"usage":{"completion_tokens":2}'),
    openai({"content": " a"}, 1).replace(b"]", b"]]"),
    openai({"content": " a\xff"}, 1).replace(b"\xc3\xbf", b"\xff"),
    openai({"content": " a", "obfuscation": "x"}, 1),
    openai({"content": " a"}, 1, finish="stop"),
    orjson.dumps({"error": {"message": "boom", "code": 500}, "obfuscation": "ab"}),
    orjson.dumps({"choices": [{"delta": {"content": " a"}}], "obfuscation": "x", "id": 1}),
]


@pytest.mark.parametrize("odd", ODD_PADDED)
def test_padding_is_read_off_only_where_the_chunk_means_the_same(odd: bytes) -> None:
    """After the envelope was learned from padded chunks: a payload whose padding is not a
    last member of printable ASCII after a value, or that is malformed, reads as parsing it
    would, and a malformed one is named as it was sent."""
    learn = [openai({"content": " a"}, i) for i in range(3)]
    for reads in ([[p] for p in learn] + [[odd]], [learn, [odd, learn[0]]], [[*learn, odd]]):
        assert by_reader(reads, True) == reference(reads, True)


def test_padding_checked_in_place_only_after_the_envelope() -> None:
    """A padded payload read in place must have the envelope's suffix, less its closing brace,
    whole and after the prefix; and the envelope must end the object (a chunk learned with a
    trailing space does not)."""
    first = openai({"content": " a"}, 1)
    prefix = first[: first.index(b'" a"') + 1]
    head = first[first.index(b'" a"') + 3 : first.index(PADDING_KEY)]
    overlapping = prefix + head[1:] + PADDING_KEY + b'xy"}'  # {..."content":"},"logprobs"...
    spaced = unpad(openai({"content": " b"}, 2)) + b" "
    after_space = unpad(openai({"content": " c"}, 3)) + PADDING_KEY + b'xy"}'  # ...}},"obf...
    for reads in ([[first], [overlapping]], [[first], [spaced], [after_space]]):
        assert by_reader(reads, True) == reference(reads, True)
        assert by_reader(reads, True)[0][-1] == BAD


@pytest.mark.parametrize("chat", [True, False])
def test_completions_and_spaced_json(chat: bool) -> None:
    """The completions `text` field, and JSON written with spaces (Python's json module)."""
    import json

    payloads = [json.dumps(chunk(w, chat=chat)).encode() for w in ["a", " b", "ü", "", " c"]]
    reads = [payloads[:1], payloads[1:2], payloads[2:]]
    assert by_reader(reads, chat) == reference(reads, chat)
    assert by_reader(reads, chat)[1] == ["a", " b", "ü", " c"]


INTERESTING = [b'"', b"\\", b"}", b"]", b",", b":", b"\n", b"\x00", b"\x1f", b"\xff", b"\xc3",
               b"\xa9", b"a", b"0", b"~", b" ", b"null", b'"}', b'\\"', b'"x":"', b"{",
               b',"obfuscation":"']  # fmt: skip


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[list[bytes]], bool]:
    """Payloads of one stream (mostly chunks of one envelope, some altered), cut into reads."""
    import json

    chat = draw(st.booleans())
    encode = draw(st.sampled_from([
        orjson.dumps,
        lambda o: json.dumps(o).encode(),  # spaces, non-ASCII as \u escapes
        lambda o: json.dumps(o, separators=(",", ":"), ensure_ascii=False).encode(),
    ]))  # fmt: skip
    # OpenAI's padding on every chunk (most of it printable ASCII, some of it not), or none.
    padding = draw(st.sampled_from([None, "obfuscation"]))
    pad = st.one_of(st.text("abcXYZ019", max_size=15),
                    st.sampled_from(["", '"', "\\", "é", "\x01", " ", "~", "\x7f"]))

    def dump(obj: dict[str, Any]) -> bytes:
        return encode(obj if padding is None else obj | {padding: draw(pad)})

    cid = draw(st.sampled_from(["chatcmpl-1", "a", " b", ""]))
    text = st.one_of(
        st.sampled_from(["a", " b", "", "~", cid, "\n", '"', "\\", "é", "🙂", "\u2028", "\x7f"]),
        st.text(max_size=6),
    )
    # How this stream's model sends its thinking (see `thinking`), and which call it makes.
    field = draw(st.sampled_from(["reasoning_content", "reasoning"]))
    shape = draw(st.sampled_from(["null_content", "no_content", "both_fields"]))
    index = draw(st.integers(0, 1))
    payloads: list[bytes] = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["plain"] * 6 + ["thinking"] * 4 + ["arguments"] * 4 + [
            "finish", "usage", "other", "mutated", "done", "error", "created", "reasoning",
            "tool_call", "mutated_thinking", "mutated_arguments", "call_start",
            "refusal", "function_call"]))  # fmt: skip
        if kind == "plain":
            payloads.append(dump(chunk(draw(text), chat=chat, cid=cid)))
        elif kind == "thinking":
            payloads.append(dump(thinking(draw(text), field, shape, chat=chat, cid=cid)))
        elif kind == "arguments":
            payloads.append(dump(arguments(draw(text), index, chat=chat, cid=cid)))
        elif kind == "call_start":
            payloads.append(dump(chunk(None, chat=chat, cid=cid, delta={"tool_calls": [
                {"index": index, "id": "call_x", "type": "function",
                 "function": {"name": "f", "arguments": draw(text)}}]})))  # fmt: skip
        elif kind in ("mutated_thinking", "mutated_arguments"):
            base = dump(thinking(draw(text), field, shape, chat=chat, cid=cid)
                        if kind == "mutated_thinking" else
                        arguments(draw(text), index, chat=chat, cid=cid))  # fmt: skip
            at = draw(st.integers(0, len(base)))
            cut = draw(st.integers(0, 3))
            payloads.append(base[:at] + draw(st.sampled_from(INTERESTING)) + base[at + cut :])
        elif kind == "reasoning":  # reasoning alone, or beside a content
            name = draw(st.sampled_from(["reasoning_content", "reasoning"]))
            both = draw(st.booleans())
            payloads.append(dump(chunk(draw(text) if both else None, chat=chat, cid=cid,
                                       delta={name: draw(text)})))  # fmt: skip
        elif kind == "tool_call":
            call = {"index": draw(st.integers(0, 1)), "function": {"arguments": draw(text)}}
            payloads.append(dump(chunk(None, chat=chat, cid=cid,
                                       delta={"tool_calls": [call]})))  # fmt: skip
        elif kind == "refusal":  # alone (content null), or beside reasoning or a content
            beside = draw(st.sampled_from([{}, {field: draw(text)}]))
            payloads.append(dump(chunk(draw(st.sampled_from([None, "", "a"])), chat=chat,
                                       cid=cid, delta={"refusal": draw(text), **beside})))
        elif kind == "function_call":  # the older `functions` form, beside a content or not
            old_form = draw(st.sampled_from(["name", "arguments", "both", "empty", "no_object"]))
            call: object = {"name": {"name": "f"}, "arguments": {"arguments": draw(text)},
                            "both": {"name": "f", "arguments": draw(text)}, "empty": {},
                            "no_object": "x"}[old_form]  # fmt: skip
            payloads.append(dump(chunk(draw(st.sampled_from([None, "a"])), chat=chat, cid=cid,
                                       delta={"function_call": call})))  # fmt: skip
        elif kind == "created":
            payloads.append(dump(chunk(draw(text), chat=chat, cid=cid, created=2)))
        elif kind == "finish":
            payloads.append(dump(chunk(draw(text), chat=chat, cid=cid, finish="stop")))
        elif kind == "usage":
            payloads.append(USAGE_ONLY.encode())
        elif kind == "other":
            payloads.append(dump(chunk(draw(text), chat=chat, cid=cid,
                                       extra={"x": draw(text)})))  # fmt: skip
        elif kind == "mutated":  # bytes spliced anywhere into a plain chunk
            base = dump(chunk(draw(text), chat=chat, cid=cid))
            at = draw(st.integers(0, len(base)))
            cut = draw(st.integers(0, 3))
            payloads.append(base[:at] + draw(st.sampled_from(INTERESTING)) + base[at + cut :])
        elif kind == "done":
            payloads.append(b"[DONE]")
        else:
            payloads.append(b'{"error":{"message":"boom","code":500}}')
    cuts = sorted(draw(st.sets(st.integers(1, max(len(payloads) - 1, 1)))))
    reads = [payloads[a:b] for a, b in zip([0, *cuts], [*cuts, len(payloads)], strict=True)]
    return [r for r in reads if r], chat


NULL_INDEX = ([[
    b'{"id":"a","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"tool_calls":[{"index":0,"function":{"arguments":"a"}}]},"logprobs":null,'
    b'"finish_reason":null}]}',
    b'{"id":"a","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"tool_calls":[{"index":null,"function":{"arguments":"a"}}]},"logprobs":null,'
    b'"finish_reason":null}]}']], True)


@settings(max_examples=1500, deadline=None)
@given(streams())
@example(NULL_INDEX)  # found by a CI run: the calls' sort met None beside 0 at the end
def test_envelope_reading_equals_parsing_every_payload(
    stream: tuple[list[list[bytes]], bool],
) -> None:
    """Whatever the payloads and however they are cut into reads, the reader's codes, pieces and
    state are those of parsing each payload with orjson."""
    reads, chat = stream
    assert by_reader(reads, chat) == reference(reads, chat)


# -- text that is not the content: reasoning and tool calls ------------------------------------


def test_reasoning_then_content_as_reasoning_models_stream_it() -> None:
    """Reasoning pieces (either field name) are kept apart from the content and counted as
    chunks of generated text; an envelope learned from the content does not swallow them."""
    reasoning = [orjson.dumps(chunk(None, delta={"reasoning_content": w})) for w in ["Let", " me"]]
    content = [orjson.dumps(chunk(w)) for w in ["The", " answer", " is"]]
    late = orjson.dumps(chunk(None, delta={"reasoning": " (check)"}))
    reads = [[ROLE.encode()], reasoning[:1], reasoning[1:], content[:1], content[1:2],
             [content[2], late, content[1]]]  # fmt: skip
    assert by_reader(reads, True) == reference(reads, True)
    _, pieces, state = by_reader(reads, True)
    assert pieces == ["The", " answer", " is", " answer"]
    assert state[5:8] == (["Let", " me", " (check)"], None, 3)
    # A chunk with both is never an envelope to slice by: sliced, its reasoning would be lost.
    both = orjson.dumps(chunk(" x", delta={"reasoning_content": " y"}))
    reads = [[both], [both], [both, both]]
    assert by_reader(reads, True) == reference(reads, True)
    assert by_reader(reads, True)[2][5] == [" y"] * 4


def test_a_learned_thought_envelope_reads_reasoning_without_parsing(
    loads: CountingLoads,
) -> None:
    """A reasoning model's stream: after one plain reasoning chunk (parsed, plus one probe), the
    others are sliced into `reasoning`, one per read or many per read, and each counts as a
    chunk of generated text; the content that follows learns its own envelope."""
    words = [" Let", " me", " think", " about", " it", "."]
    thoughts = [orjson.dumps(thinking(w, "reasoning_content", "no_content")) for w in words]
    answer = [orjson.dumps(chunk(w)) for w in [" Yes", ",", " it", " is"]]
    tail = [orjson.dumps(chunk(None, finish="stop")), USAGE_ONLY.encode(), b"[DONE]"]
    reads = [[ROLE.encode()], thoughts[:1], thoughts[1:2], thoughts[2:], answer[:1], answer[1:2],
             answer[2:], tail]  # fmt: skip
    assert by_reader(reads, True) == reference(reads, True)
    _, pieces, state = by_reader(reads, True)
    assert pieces == [" Yes", ",", " it", " is"]
    assert state[5:8] == (words, None, len(words))
    loads.calls = 0
    by_reader(reads, True)
    # role; first thought + probe; first answer word + probe; then the finish and usage chunks
    assert loads.calls == 1 + 2 + 2 + 2


def test_each_envelope_has_its_own_budget(loads: CountingLoads) -> None:
    """Reasoning padded differently per chunk spends every lesson of the thought envelope;
    the answer that follows still learns its own envelope and is sliced."""
    thoughts = [orjson.dumps(chunk(None, delta={"reasoning_content": f" t{i}"},
                                   extra={"nonce": "x" * i})) for i in range(8)]
    answer = [orjson.dumps(chunk(f" w{i}")) for i in range(8)]
    reads = [[p] for p in thoughts + answer]
    assert by_reader(reads, True) == reference(reads, True)
    loads.calls = 0
    by_reader(reads, True)
    # every thought parsed, plus LEARN_MAX failed probes; the first answer word and its probe
    assert loads.calls == len(thoughts) + LEARN_MAX + 2


def test_an_empty_thought_that_fits_the_envelope_is_parsed() -> None:
    """Learned from a chunk whose `reasoning` field holds a constant beside the text in
    `reasoning_content`, the envelope fits a chunk with an empty text too, but that chunk's
    reasoning is the constant (`reasoning_content or reasoning`): it must be parsed, not
    sliced to nothing, alone or in a run."""
    def odd(text: str) -> bytes:
        return orjson.dumps(thinking(text, "reasoning_content", "both_fields", other="zz"))

    for reads in ([[odd("a")], [odd("b")], [odd("")], [odd("c")]],
                  [[odd("a")], [odd("b"), odd(""), odd("c")]]):  # fmt: skip
        assert by_reader(reads, True) == reference(reads, True)
        assert by_reader(reads, True)[2][5] == ["a", "b", "zz", "c"]


def test_a_thought_envelope_never_takes_a_chunk_with_a_tool_call_or_content() -> None:
    """Chunks that carry reasoning and also a tool call or a content are parsed every time,
    and then nothing of theirs is lost."""
    call = {"index": 0, "function": {"arguments": "{}"}}
    mixed = [orjson.dumps(chunk(None, delta={"reasoning_content": "r", "tool_calls": [call]})),
             orjson.dumps(chunk("c", delta={"reasoning_content": "r"}))]  # fmt: skip
    for payload in mixed:
        reads = [[payload], [payload], [payload, payload]]
        assert by_reader(reads, True) == reference(reads, True)
        assert by_reader(reads, True)[2][5] == ["r"] * 4


@pytest.mark.parametrize(("obj", "thought"), [
    (thinking("r", "reasoning_content", "no_content"), "r"),
    (thinking("r", "reasoning", "null_content"), "r"),
    (thinking("r", "reasoning_content", "both_fields", other="s"), "r"),
    (thinking("", "reasoning_content", "both_fields", other="s"), "s"),  # `or` reads the other
    (chunk("c", delta={"reasoning_content": "r"}), None),  # a content is appended too
    (chunk(None, delta={"reasoning": "r", "tool_calls": [{"index": 0}]}), None),
    (chunk(None, delta={"reasoning": "r"}, finish="stop"), None),
    (chunk(None, delta={"reasoning": "r"}, extra={"usage": {"completion_tokens": 1}}), None),
    (chunk(None, delta={"reasoning": 5}), None),
    (chunk(None, delta={"reasoning": "r", "refusal": "no"}), None),  # the refusal is kept too
    (chunk("c"), None),
    ({"choices": [thinking("r", "reasoning", "no_content")["choices"][0]] * 2}, None),
])  # fmt: skip
def test_plain_thought_is_a_chunk_whose_only_effect_is_its_reasoning(
    obj: dict[str, Any], thought: str | None
) -> None:
    assert plain_thought(obj, True) == thought
    assert plain_thought(obj, False) is None  # completions have no reasoning


def test_a_learned_arguments_envelope_reads_a_call_without_parsing(loads: CountingLoads) -> None:
    """A function call streamed as JSON text in pieces (half of them with quotes): after the
    call's first plain arguments chunk (parsed, plus one probe), its pieces are sliced, or read
    from their string when escaped, into that call's arguments, each counted as a chunk; a
    second call has other bytes, is parsed, and teaches the envelope again."""
    pieces = ['{"', "city", '":"', "Oslo", '","', "days", '":', "3", "}"]
    start = orjson.dumps(chunk(None, delta={"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function",
         "function": {"name": "weather", "arguments": ""}}]}))  # fmt: skip
    first = [orjson.dumps(arguments(w)) for w in pieces]
    second = [orjson.dumps(arguments(w, 1)) for w in ["{", "}"]]
    reads = [[ROLE.encode()], [start], first[:1], first[1:2], first[2:5], *[[p] for p in first[5:]],
             second[:1], second[1:], [orjson.dumps(chunk(None, finish="tool_calls")), b"[DONE]"]]
    assert by_reader(reads, True) == reference(reads, True)
    _, _, state = by_reader(reads, True)
    assert state[6][0]["function"] == {"name": "weather", "arguments": "".join(pieces)}
    assert state[6][1]["function"]["arguments"] == "{}" and state[7] == 1 + 9 + 2
    loads.calls = 0
    loads.seen.clear()
    by_reader(reads, True)
    whole = {first[0], *first[2:], *second}
    parsed = [x for x in loads.seen if isinstance(x, bytes) and x in whole]
    # Parsed whole, besides "city" (which teaches the envelope): call 0's first piece, whose
    # quote makes it no lesson, and call 1's first, whose other bytes teach it again.
    assert parsed == [first[0], second[0]]


@pytest.mark.parametrize(("obj", "text"), [
    (arguments("{}"), "{}"),
    (arguments("{}", 1), "{}"),
    (arguments(""), None),
    (chunk(None, delta={"tool_calls": [{"index": 0, "id": "c", "function": {"arguments": "x"}}]}),
     None),  # an id is set too
    (chunk(None, delta={"tool_calls": [{"index": 0, "function": {"name": "f",
                                                               "arguments": "x"}}]}), None),
    (chunk(None, delta={"tool_calls": [{"function": {"arguments": "x"}}] * 2}), None),
    (chunk("c", delta={"tool_calls": [{"function": {"arguments": "x"}}]}), None),
    (chunk(None, delta={"reasoning": "r", "tool_calls": [{"function": {"arguments": "x"}}]}),
     None),
    (chunk(None, delta={"tool_calls": [{"function": {"arguments": {"a": 1}}}]}), None),
])  # fmt: skip
def test_plain_arguments_is_a_chunk_whose_only_effect_is_one_calls_arguments(
    obj: dict[str, Any], text: str | None
) -> None:
    assert plain_arguments(obj, True) == text
    assert plain_arguments(obj, False) is None


def test_tool_calls_are_merged_by_index_across_chunks_and_reads() -> None:
    """Two calls streamed in pieces, interleaved: each keeps its id, type and name from its
    first delta and appends its arguments in order."""
    def call(**delta: Any) -> bytes:
        return orjson.dumps(chunk(None, delta={"tool_calls": [delta]}))

    reads = [
        [call(index=0, id="call_a", type="function", function={"name": "get", "arguments": ""})],
        [call(index=0, function={"arguments": '{"city": '}),
         call(index=1, id="call_b", type="function", function={"name": "put"})],
        [call(index=1, function={"arguments": "{}"}),
         call(index=0, function={"arguments": '"Oslo"}'})],
        [orjson.dumps(chunk(None, finish="tool_calls")), b"[DONE]"],
    ]  # fmt: skip
    reader = ChunkReader(chat=True)
    pieces: list[str] = []
    assert [reader.read(r, pieces) for r in reads] == [MORE, MORE, MORE, DONE]
    assert pieces == [] and reader.finish_reason == "tool_calls" and reader.other_chunks == 5
    assert reader.tool_call_list() == [
        {"id": "call_a", "type": "function",
         "function": {"name": "get", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "put", "arguments": "{}"}},
    ]  # fmt: skip
    assert ChunkReader(chat=True).tool_call_list() is None


def test_a_malformed_tool_call_delta_is_bad() -> None:
    for calls in ("abc", [1], [{"index": [0]}], [{"function": "x"}]):
        reader = ChunkReader(chat=True)
        payload = orjson.dumps(chunk(None, delta={"tool_calls": calls}))
        assert reader.read([payload], []) == BAD, calls


def test_merge_tool_calls_takes_names_in_pieces_and_arguments_as_objects() -> None:
    """Some servers split a name too, or send arguments as an object instead of JSON text."""
    calls: dict[int, ToolCallParts] = {}
    merge_tool_calls(calls, [{"function": {"name": "get_"}}])
    merge_tool_calls(calls, [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}])
    assert list(calls) == [0]
    assert calls[0].as_message() == {
        "id": None, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}


def test_read_whole_with_reasoning_and_tool_calls() -> None:
    reader = ChunkReader(chat=True)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    custom = {"id": "c2", "type": "custom", "custom": {"name": "shell", "input": "ls -l"}}
    body = {"choices": [{"message": {"content": None, "reasoning": "hmm",
                                     "tool_calls": [call, custom]},
                         "finish_reason": "tool_calls"}]}  # fmt: skip
    assert read_whole(orjson.dumps(body), reader) == ""
    assert reader.reasoning == ["hmm"] and reader.tool_call_list() == [call, custom]


def test_a_call_in_the_older_functions_form_is_kept_as_sent() -> None:
    """`delta.function_call` (a request with `functions`): its name and argument pieces are
    joined into one call, whose chunks count as generated ones; a whole answer's
    `message.function_call` too. A `function_call` that is no object is malformed."""
    first = chunk(None, delta={"role": "assistant", "function_call": {"name": "get_weather",
                                                                        "arguments": ""}})
    pieces = [chunk(None, delta={"function_call": {"arguments": text}})
              for text in ['{"city"', ': "Paris"', "}"]]  # fmt: skip
    reads = [[orjson.dumps(first)], [orjson.dumps(p) for p in pieces],
             [orjson.dumps(chunk(None, finish="function_call"))]]  # fmt: skip
    assert by_reader(reads, True) == reference(reads, True)
    reader = ChunkReader(True)
    for payloads in reads:
        reader.read(payloads, [])
    assert reader.function_call_message() == {"name": "get_weather",
                                              "arguments": '{"city": "Paris"}'}
    assert (reader.other_chunks, reader.finish_reason) == (4, "function_call")
    assert reader.tool_call_list() is None
    whole = ChunkReader(True)
    body = {"choices": [{"finish_reason": "function_call", "message": {
        "content": None, "function_call": {"name": "f", "arguments": "{}"}}}]}
    assert read_whole(orjson.dumps(body), whole) == ""
    assert whole.function_call_message() == {"name": "f", "arguments": "{}"}
    bad = [[orjson.dumps(chunk(None, delta={"function_call": "f"}))]]
    assert by_reader(bad, True) == reference(bad, True)
    assert by_reader(bad, True)[0] == [BAD]


def test_a_refusal_is_kept_apart_from_the_content() -> None:
    """OpenAI's models decline a structured output with `refusal` where the content would be:
    streamed, its pieces land in `refusal` and count as generated chunks; whole, likewise."""
    refusal = [orjson.dumps(chunk(None, delta={"refusal": w})) for w in ["I can't", " do that"]]
    reads = [[ROLE.encode()], refusal, [orjson.dumps(chunk(None, finish="stop")), b"[DONE]"]]
    assert by_reader(reads, True) == reference(reads, True)
    codes, pieces, state = by_reader(reads, True)
    assert (codes[-1], pieces, state[7:9]) == (DONE, [], (2, ["I can't", " do that"]))
    reader = ChunkReader(chat=True)
    body = {"choices": [{"message": {"content": None, "refusal": "No."}, "finish_reason": "stop"}]}
    assert read_whole(orjson.dumps(body), reader) == "" and reader.refusal == ["No."]


@pytest.mark.parametrize(("usage", "counted"), [
    ({"prompt_tokens_details": {"cached_tokens": 3},
      "completion_tokens_details": {"reasoning_tokens": 4}}, (3, 4)),
    ({"prompt_tokens_details": None, "completion_tokens_details": {"reasoning_tokens": 0}},
     (None, 0)),
    ({"prompt_tokens_details": {"cached_tokens": "3"}, "completion_tokens_details": [4]},
     (None, None)),
    ({}, (None, None)),
])  # fmt: skip
def test_usage_details_are_read_where_the_server_counts_them(
    usage: dict[str, Any], counted: tuple[int | None, int | None]
) -> None:
    """Cached prompt tokens and reasoning tokens, from a stream's usage chunk or a whole
    answer's usage; anything but an int is no count."""
    whole = {"prompt_tokens": 9, "completion_tokens": 8, **usage}
    reader = ChunkReader(chat=True)
    payload = orjson.dumps({"id": "x", "choices": [], "usage": whole})
    assert reader.read([payload, b"[DONE]"], []) == DONE
    assert (reader.cached_tokens, reader.reasoning_tokens) == counted
    reader = ChunkReader(chat=True)
    body = {"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}], "usage": whole}
    assert read_whole(orjson.dumps(body), reader) == "a"
    assert (reader.cached_tokens, reader.reasoning_tokens) == counted


def test_read_whole_chat_answer_with_usage() -> None:
    """A non-streamed chat.completion: message content, the last finish_reason, usage."""
    reader = ChunkReader(chat=True)
    body = {"object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "héllo"},
                         "finish_reason": "stop"},
                        {"index": 1, "message": {"content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}  # fmt: skip
    assert read_whole(orjson.dumps(body), reader) == "héllo"
    assert (reader.finish_reason, reader.prompt_tokens, reader.completion_tokens) == (
        "length", 7, 2)  # fmt: skip
    assert reader.error is None


def test_read_whole_completions_answer_without_usage() -> None:
    reader = ChunkReader(chat=False)
    body = {"choices": [{"index": 0, "text": "abc", "finish_reason": "stop"}]}
    assert read_whole(orjson.dumps(body), reader) == "abc"
    assert (reader.finish_reason, reader.prompt_tokens, reader.completion_tokens) == (
        "stop", None, None)  # fmt: skip


def test_read_whole_error_object_and_empty_content() -> None:
    """An error object is recorded and gives no text; a null content (a tool call) is ''."""
    reader = ChunkReader(chat=True)
    assert read_whole(b'{"error": {"message": "boom", "code": 503}}', reader) == ""
    assert reader.error == {"message": "boom", "code": 503}
    reader = ChunkReader(chat=True)
    body = {"choices": [{"message": {"content": None, "tool_calls": []},
                         "finish_reason": "tool_calls"}]}  # fmt: skip
    assert read_whole(orjson.dumps(body), reader) == ""
    assert reader.finish_reason == "tool_calls" and reader.error is None


@pytest.mark.parametrize("body", [b"", b"not json", b"[1, 2]", b'{"choices": [{"text": "a"}]'])
def test_read_whole_refuses_what_is_no_answer(body: bytes) -> None:
    reader = ChunkReader(chat=False)
    assert read_whole(body, reader) is None
    assert reader.error is None and reader.finish_reason is None


@pytest.mark.parametrize("body", [b'{"id": "x"}', b'{"choices": []}', b'{"choices": ["a"]}',
                                  b'{"choices": [{"message": {"content": "a"}}]}'])
def test_read_whole_says_why_a_json_object_is_no_answer(body: bytes) -> None:
    """A JSON object not shaped as an answer raises `Unreadable` (the attempt's
    protocol_error), never reads as an empty one."""
    with pytest.raises(Unreadable):
        read_whole(body, ChunkReader(chat=False))


def test_an_error_code_of_a_digit_that_is_no_number_is_no_status() -> None:
    """A server's in-stream error with code '²' (a digit, to str.isdigit, but not to int())
    raised ValueError inside the shard; it is a protocol error like any unknown code."""
    assert stream_error({"code": "²", "message": "m"}, 1) == (
        "protocol_error", "error ² in stream after 1 token: m")


@pytest.mark.parametrize(("kind", "status"), [("server_error", "http_5xx"),
                                              ("rate_limit_exceeded", "http_429"),
                                              ("invalid_request_error", "http_4xx")])
def test_a_negative_error_code_leaves_the_type_to_decide(kind: str, status: str) -> None:
    """A JSON-RPC style code (-32603, -1) is no HTTP status: the error's type says what it is.
    Taken as a number, it made every such error a protocol_error: a rate limit retried at once,
    a request that cannot succeed retried and paid for."""
    for code in (-1, -32603):
        err = {"code": code, "type": kind, "message": "x"}
        assert stream_error(err, 3)[0] == status


def test_clip_shows_every_format_character_this_python_knows() -> None:
    """Every character of Unicode's category Cf (format: not shown, but it acts or hides what
    follows) is escaped: the Arabic number signs (U+0600-0605, U+06DD), Syriac's (U+070F),
    Kaithi's (U+110BD) and the others were passed as they came."""
    unescaped = [hex(c) for c in range(0x110000)
                 if unicodedata.category(chr(c)) == "Cf" and clip(chr(c)) == chr(c)]
    assert unescaped == []
    assert clip("ok\u0600\U000110bd") == "ok\\u0600\\U000110bd"


@pytest.mark.parametrize("char", ["\x1b", "\u202e", "\U000e0041"])
def test_clip_cuts_no_escape_in_half(char: str) -> None:
    """At its limit `clip` cuts before an escape it cannot hold whole: a piece of one ("\\u20")
    would read as the server's own text."""
    escape = clip(char)
    whole = "ab" + escape + "cd"
    for limit in range(2, len(whole) + 1):
        said = clip(f"ab{char}cd", limit)
        assert whole.startswith(said) and len(said) <= limit
        assert said == "ab" or said.startswith("ab" + escape), (limit, said)
