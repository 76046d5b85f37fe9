"""SSEDecoder: payloads must not depend on where the network splits the bytes."""

import itertools
import re

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.sse import SSEDecoder


def _chunk(content: str | None = None, finish: str | None = None) -> dict[str, object]:
    delta = {} if content is None else {"content": content}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


USAGE = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
}
CHUNKS = [
    _chunk(""),
    _chunk("héllo"),
    _chunk(" 世界"),
    _chunk(" 🙂"),
    _chunk("\n\"quoted\""),
    _chunk(None, "stop"),
    USAGE,
]
MULTI = b'{"multi":\n"line"}'  # one event sent as two data lines (legal SSE, valid JSON)
EXPECTED = [orjson.dumps(c) for c in CHUNKS] + [MULTI, b"[DONE]"]


def _recorded(eol: bytes) -> bytes:
    """A chat stream as an OpenAI-compatible server sends it, with keep-alives and comments."""
    out = [b": connected", b"", b"retry: 3000", b""]
    for i, payload in enumerate(EXPECTED):
        if i == 2:
            out += [b": keep-alive", b""]
        lines = [b"data: " + line for line in payload.split(b"\n")]
        out += [b"event: message", b"id: %d" % i, *lines, b""]
    return eol.join(out) + eol


def _plain(eol: bytes, multi: bool) -> bytes:
    """The shape OpenAI, vLLM and the simulator send: one `data: ` line and a blank line per event.

    Reads of this shape take the decoder's one-split fast path; `multi` puts the two-line event
    in the middle, which must fall back to the line-by-line path for just that part.
    """
    out = b""
    for payload in EXPECTED if multi else [p for p in EXPECTED if p != MULTI]:
        out += b"".join(b"data: " + line + eol for line in payload.split(b"\n")) + eol
    return out


EOLS = (b"\n", b"\r\n", b"\r")
STREAMS = [_recorded(eol) for eol in EOLS]
# (raw stream, its payloads): the recorded streams and the plain ones, in every line ending.
CASES = [(raw, EXPECTED) for raw in STREAMS] + [
    (_plain(eol, multi), EXPECTED if multi else [p for p in EXPECTED if p != MULTI])
    for eol in EOLS
    for multi in (False, True)
]


def _decode(pieces: list[bytes]) -> list[bytes]:
    dec = SSEDecoder()
    out: list[bytes] = []
    for p in pieces:
        out += dec.feed(p)
    return out + dec.close()


def _split(raw: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def _case_and_cuts(draw: st.DrawFn) -> tuple[bytes, list[bytes], list[int]]:
    raw, expected = draw(st.sampled_from(CASES))
    # Uniform cuts rarely land on the tricky spots, so also cut right after a CR or inside a
    # multi-byte UTF-8 character (bytes >= 0x80) on purpose.
    tricky = [i + 1 for i, byte in enumerate(raw) if byte == 0x0D or byte >= 0x80]
    cut = st.one_of(st.integers(0, len(raw)), st.sampled_from(tricky))
    return raw, expected, draw(st.lists(cut, max_size=12))


def test_whole_stream_yields_every_payload() -> None:
    """Fed in one piece, each stream and line-ending variant yields exactly its payloads."""
    for raw, expected in CASES:
        assert _decode([raw]) == expected


@settings(max_examples=600, deadline=None)
@given(_case_and_cuts())
def test_any_split_yields_same_payloads(case: tuple[bytes, list[bytes], list[int]]) -> None:
    """Splitting the stream at arbitrary byte positions never changes the payload list."""
    raw, expected, cuts = case
    assert _decode(_split(raw, cuts)) == expected


def test_every_single_cut() -> None:
    """Exhaustively: one cut at every byte position of every variant gives the same payloads."""
    for raw, expected in CASES:
        for i in range(len(raw) + 1):
            assert _decode([raw[:i], raw[i:]]) == expected, (raw[max(0, i - 20) : i + 20], i)


def test_byte_by_byte() -> None:
    """One byte per read (splits every UTF-8 character and every CRLF) still decodes right."""
    for raw, expected in CASES:
        assert _decode([raw[i : i + 1] for i in range(len(raw))]) == expected


def test_split_multibyte_character_arrives_whole() -> None:
    """A 4-byte emoji cut in two by the network comes out as one payload of intact UTF-8."""
    raw = b'data: {"c":"a\xf0\x9f\x99\x82b"}\n\ndata: [DONE]\n\n'
    cut = raw.index(b"\x9f")
    dec = SSEDecoder()
    assert dec.feed(raw[:cut]) == []
    payloads = dec.feed(raw[cut:])
    assert payloads == [b'{"c":"a\xf0\x9f\x99\x82b"}', b"[DONE]"]
    assert orjson.loads(payloads[0]) == {"c": "a\U0001f642b"}


def _reference(raw: bytes) -> list[bytes]:
    """The spec, line by line on the whole stream, plus the documented lenient close and
    `error:` field (llama.cpp's: its event is `{"error": value}`, the value a JSON string
    unless it is JSON)."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    out: list[bytes] = []
    data: list[bytes] = []
    errors: list[bytes] = []
    name = b""
    for line in [*re.split(rb"\r\n|\r|\n", raw), b""]:
        if not line:
            if errors:
                out.append(_as_error(b"\n".join(errors)))
            elif data:
                payload = b"\n".join(data)
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    obj = None
                wrapped = not (isinstance(obj, dict) and obj.get("error") is not None)
                out.append(_as_error(payload) if name == b"error" and wrapped else payload)
            data, errors, name = [], [], b""
        elif line.startswith(b"event:"):
            value = line[6:]
            name = value[1:] if value.startswith(b" ") else value
        elif line.startswith(b"error:"):
            value = line[6:]
            errors.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            data.append(b"")
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return out


def _as_error(value: bytes) -> bytes:
    """`{"error": value}`, the value as sent if JSON, else as a JSON string."""
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        value = orjson.dumps(value.decode("utf-8", "replace"))
    return b'{"error":' + value + b"}"


_LINE = st.one_of(
    st.builds(lambda v: b"data: " + v, st.sampled_from([b"{}", b"[DONE]", b"x", b"", b" y",
                                                        "é🙂".encode(), b"data: z", b":"])),
    st.sampled_from([b"", b"", b"data", b"data:x", b"data:  two", b": ping", b":", b"event: m",
                     b"id: 1", b"dataset: no", b"retry: 5", b'error: {"code":500}', b"error:x",
                     b"errors: no", b"event: error", b"event:error", b"event: errors",
                     b'data: {"error":1}', b'data: {"error":null}']),
)  # fmt: skip


@st.composite
def _any_stream(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """Random SSE: half the time the plain one-data-line shape, else any mix of line kinds."""
    if draw(st.booleans()):
        values = st.sampled_from([b"{}", b"x", b"", "é🙂".encode(), b"data: z", b" y"])
        lines = [line for v in draw(st.lists(values, max_size=8)) for line in (b"data: " + v, b"")]
    else:
        lines = draw(st.lists(_LINE, max_size=12))
    eols = draw(st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=len(lines),
                         max_size=len(lines)))  # fmt: skip
    raw = b"".join(line + eol for line, eol in zip(lines, eols, strict=True))
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))]  # a stream cut anywhere, even mid-line
    if draw(st.booleans()):
        raw = b"\xef\xbb\xbf" + raw
    return raw, draw(st.lists(st.integers(0, len(raw)), max_size=8))


@settings(max_examples=1500, deadline=None)
@given(_any_stream())
def test_matches_line_by_line_reference(case: tuple[bytes, list[int]]) -> None:
    """Any stream, split anywhere, decodes as the spec's line-by-line reading of it whole.

    This is what holds the one-split fast path to the general path: whatever mix of shapes a
    read holds, the payloads are the reference's.
    """
    raw, cuts = case
    assert _decode(_split(raw, cuts)) == _reference(raw), raw


def test_crlf_split_between_reads_is_one_line_end() -> None:
    """A CR ending one read and the LF starting the next do not make a blank line."""
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\ndata: b\r\n\r\n") == [b"a\nb"]


def test_multiline_data_and_field_forms() -> None:
    """Several data lines join with LF; 'data:x', bare 'data' and other fields are per spec."""
    dec = SSEDecoder()
    raw = b"data: one\ndata:two\ndata\ndata:  three\nevent: x\nid: 1\ndataset: no\n\n"
    assert dec.feed(raw) == [b"one\ntwo\n\n three"]


def test_an_error_field_is_an_error_payload() -> None:
    """llama.cpp's `error:` event (its in-stream failure, before its `data: [DONE]`) is read as
    the chat shape of an error, its value as sent if JSON, else as a JSON string."""
    err = b'{"code":400,"message":"the request exceeds the available context size","type":' \
          b'"exceed_context_size_error"}'
    assert _decode([b"data: a\n\nerror: " + err + b"\n\ndata: [DONE]\n\n"]) == [
        b"a", b'{"error":' + err + b"}", b"[DONE]"]
    assert _decode([b"error:", b" not json\r\n\r\n"]) == [b'{"error":"not json"}']
    # A data line in the same event gives way to the error, in any order, split anywhere.
    raw = b"error: {}\ndata: x\n\ndata: y\nerror: 5\n\n"
    assert _decode([raw]) == _decode([raw[:10], raw[10:]]) == [b'{"error":{}}', b'{"error":5}']
    assert _decode([b"error: {}\n", b"data: x\n\n"]) == [b'{"error":{}}']


def test_an_event_named_error_is_an_error_payload() -> None:
    """An event named `error` is the chat shape of an error, its data the error's value (as
    sent if JSON, else as a JSON string), unless its data holds an `error` already (Anthropic's
    and most gateways' shape): read as a chunk, a gateway's `{"message", "code"}` was skipped,
    and the answer it cut went on to [DONE] as a success. The name holds for its event only,
    and the event may come split anywhere."""
    raw = (b'data: a\n\nevent: error\ndata: {"message":"boom","code":500}\n\n'
           b"event:error\ndata: upstream timed out\n\n"
           b'event: error\ndata: {"type":"error","error":{"message":"x"}}\n\n'
           b"event: errors\ndata: b\n\ndata: [DONE]\n\n")
    expected = [b"a", b'{"error":{"message":"boom","code":500}}',
                b'{"error":"upstream timed out"}', b'{"type":"error","error":{"message":"x"}}',
                b"b", b"[DONE]"]
    assert _decode([raw]) == expected
    assert all(_decode(_split(raw, [cut])) == expected for cut in range(len(raw)))
    # The name in one read, the data in the next, in the shape every plain read has.
    assert _decode([b"event: error\n", b"data: x\n\n", b"data: y\n\n"]) == [
        b'{"error":"x"}', b"y"]


def test_comment_only_and_empty_events_dispatch_nothing() -> None:
    """Blank lines and comments with no data lines produce no event."""
    assert _decode([b"\n\n: ping\n\n:\n\nevent: e\n\n"]) == []


def test_close_flushes_unterminated_event() -> None:
    """A stream ending without the final blank line still yields its last event on close."""
    dec = SSEDecoder()
    assert dec.feed(b"data: a\n\ndata: [DONE]") == [b"a"]
    assert dec.close() == [b"[DONE]"]
    assert dec.close() == []


def test_leading_bom_is_ignored() -> None:
    """A UTF-8 byte-order mark at the very start of the stream is not part of the first line."""
    assert _decode([b"\xef\xbb", b"\xbfdata: x\n\n"]) == [b"x"]


def test_invalid_utf8_passes_through_as_bytes() -> None:
    """Broken UTF-8 from a server is not the decoder's business: the bytes pass unchanged.

    (The chunk reader reads it as U+FFFD; see test_chunks.)
    """
    assert _decode([b"data: \xff\xfe\n\n"]) == [b"\xff\xfe"]
