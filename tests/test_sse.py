"""SSEDecoder: payloads must not depend on where the network splits the bytes."""

import itertools

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
MULTI = '{"multi":\n"line"}'  # one event sent as two data lines (legal SSE, valid JSON)
EXPECTED = [orjson.dumps(c).decode() for c in CHUNKS] + [MULTI, "[DONE]"]


def _recorded(eol: bytes) -> bytes:
    """A chat stream as an OpenAI-compatible server sends it, with keep-alives and comments."""
    out = [b": connected", b"", b"retry: 3000", b""]
    for i, payload in enumerate(EXPECTED):
        if i == 2:
            out += [b": keep-alive", b""]
        lines = [b"data: " + line.encode() for line in payload.split("\n")]
        out += [b"event: message", b"id: %d" % i, *lines, b""]
    return eol.join(out) + eol


STREAMS = [_recorded(b"\n"), _recorded(b"\r\n"), _recorded(b"\r")]


def _decode(pieces: list[bytes]) -> list[str]:
    dec = SSEDecoder()
    out: list[str] = []
    for p in pieces:
        out += dec.feed(p)
    return out + dec.close()


def _split(raw: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def _stream_and_cuts(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    raw = draw(st.sampled_from(STREAMS))
    # Uniform cuts rarely land on the tricky spots, so also cut right after a CR or inside a
    # multi-byte UTF-8 character (bytes >= 0x80) on purpose.
    tricky = [i + 1 for i, byte in enumerate(raw) if byte == 0x0D or byte >= 0x80]
    cut = st.one_of(st.integers(0, len(raw)), st.sampled_from(tricky))
    return raw, draw(st.lists(cut, max_size=12))


def test_whole_stream_yields_every_payload() -> None:
    """Fed in one piece, each line-ending variant yields exactly the recorded payloads."""
    for raw in STREAMS:
        assert _decode([raw]) == EXPECTED


@settings(max_examples=400, deadline=None)
@given(_stream_and_cuts())
def test_any_split_yields_same_payloads(case: tuple[bytes, list[int]]) -> None:
    """Splitting the stream at arbitrary byte positions never changes the payload list."""
    raw, cuts = case
    assert _decode(_split(raw, cuts)) == EXPECTED


def test_every_single_cut() -> None:
    """Exhaustively: one cut at every byte position of every variant gives the same payloads."""
    for raw in STREAMS:
        for i in range(len(raw) + 1):
            assert _decode([raw[:i], raw[i:]]) == EXPECTED, (raw[max(0, i - 20) : i + 20], i)


def test_byte_by_byte() -> None:
    """One byte per read (splits every UTF-8 character and every CRLF) still decodes right."""
    for raw in STREAMS:
        assert _decode([raw[i : i + 1] for i in range(len(raw))]) == EXPECTED


def test_crlf_split_between_reads_is_one_line_end() -> None:
    """A CR ending one read and the LF starting the next do not make a blank line."""
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\ndata: b\r\n\r\n") == ["a\nb"]


def test_multiline_data_and_field_forms() -> None:
    """Several data lines join with LF; 'data:x', bare 'data' and other fields are per spec."""
    dec = SSEDecoder()
    raw = b"data: one\ndata:two\ndata\ndata:  three\nevent: x\nid: 1\ndataset: no\n\n"
    assert dec.feed(raw) == ["one\ntwo\n\n three"]


def test_comment_only_and_empty_events_dispatch_nothing() -> None:
    """Blank lines and comments with no data lines produce no event."""
    assert _decode([b"\n\n: ping\n\n:\n\nevent: e\n\n"]) == []


def test_close_flushes_unterminated_event() -> None:
    """A stream ending without the final blank line still yields its last event on close."""
    dec = SSEDecoder()
    assert dec.feed(b"data: a\n\ndata: [DONE]") == ["a"]
    assert dec.close() == ["[DONE]"]
    assert dec.close() == []


def test_leading_bom_is_ignored() -> None:
    """A UTF-8 byte-order mark at the very start of the stream is not part of the first line."""
    assert _decode([b"\xef\xbb", b"\xbfdata: x\n\n"]) == ["x"]


def test_invalid_utf8_is_replaced_not_raised() -> None:
    """Broken UTF-8 from a server becomes U+FFFD instead of an exception."""
    assert _decode([b"data: \xff\xfe\n\n"]) == ["\ufffd\ufffd"]
