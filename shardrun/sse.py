"""Incremental Server-Sent Events decoder: bytes in, `data` payloads (bytes) out. Pure, no I/O.

It runs on every network read of every response, so it works on whole reads with
`bytes.find`/`replace`/`split` (C loops) and touches each *line* in Python, never each byte. The
common read, whole events of one `data: ` line each, takes one `split` for all its events.

Why it splits on bytes and never decodes: a network read can end in the middle of a multi-byte
UTF-8 character ("🙂" is 4 bytes); decoding per read would corrupt it. Payloads are cut at line
ends only, so each holds complete characters, and stay bytes for `orjson.loads` (the client reads
invalid UTF-8 as U+FFFD, as a text decoder with errors="replace" would).

Line endings follow the SSE spec (LF, CRLF or a lone CR). A CR that ends one read may be the first
half of a CRLF whose LF starts the next read; the decoder remembers that and drops the LF, so the
split never produces a phantom blank line (which would end an event early).

Deviations from the spec, on purpose: an `error:` field (not one the spec names) is read, not
ignored. llama.cpp's server reports a failure inside a stream as an event whose only line is
`error: {"code": 400, "message": ..., "type": ...}`, and then ends the stream with `data: [DONE]`;
ignored, it would turn a failed request into an empty success. Such an event's payload is the
chat shape of an error, `{"error": VALUE}` (VALUE as sent when it is JSON, else as a JSON string),
which the chunk readers end the stream with; it takes the place of any data lines of its event.
Likewise an event named `error` (`event: error`) whose data is not such an object already (a
gateway's `{"message": ..., "code": ...}`, a line of text) has its data as VALUE: read as a
chunk, it was skipped (no choices), and the answer cut by it went on to `[DONE]` as a success.
And `close()` dispatches a final event that lacks its terminating blank line (the spec discards
it). Some servers end the stream with `data: [DONE]\\n` only; being lenient there costs nothing
and avoids reporting a good response as broken.
"""

import orjson

_BOM = b"\xef\xbb\xbf"
_LF = 0x0A
_CR = 0x0D
_COLON = 0x3A


class SSEDecoder:
    """Feed it reads as they arrive; it returns the payload of every event each read completes.

    Payloads are bytes, exactly as received (`orjson.loads` takes bytes, so nothing is decoded
    twice). Multiple `data:` lines of one event are joined with b"\\n". Comments (lines starting
    with ':'), keep-alives and the fields `event:` (but for the name `error`), `id:`, `retry:`
    are ignored: the OpenAI streaming format carries everything in `data`. An `error:` field,
    or the name `error`, makes its event an error payload (module docstring).
    """

    __slots__ = ("_data", "_error", "_error_event", "_parts", "_skip_lf", "_started")

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # the unterminated last line, as received
        self._data: list[bytes] = []  # data lines of the event being assembled
        self._error: list[bytes] = []  # its error lines' values (llama.cpp), if any
        self._error_event = False  # its name is "error" (`event: error`)
        self._skip_lf = False  # the previous read ended with CR: drop one LF at the next start
        self._started = False  # the first line (which may carry a BOM) has been seen

    def feed(self, data: bytes) -> list[bytes]:
        """Consume one read; return the payloads of the events it completed (often none)."""
        if self._skip_lf and data:
            self._skip_lf = False
            if data[0] == _LF:
                data = data[1:]
        if not data:
            return []
        has_cr = data.find(b"\r") >= 0
        if not has_cr and data.find(b"\n") < 0:
            self._parts.append(data)  # no line ends here: just keep it, no copying
            return []
        if self._parts:  # never holds a CR (kept lines are normalized): has_cr stands
            self._parts.append(data)
            data = b"".join(self._parts)
            self._parts.clear()
        if has_cr:
            self._skip_lf = data[-1] == _CR
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not self._started:  # data starts with the stream's first line, now complete
            self._started = True
            if data.startswith(_BOM):
                data = data[3:]
        out: list[bytes] = []
        if (not self._data and not self._error and not self._error_event
                and data.startswith(b"data: ")):  # fmt: skip
            # The shape of nearly every read: whole events of one "data: " line each. One split
            # yields their payloads; the newline count proves no event has any other line.
            end = data.rfind(b"\n\n")
            if end > 0:
                head = data[6:end]
                payloads = head.split(b"\n\ndata: ")
                if head.count(b"\n") == 2 * len(payloads) - 2:
                    out = payloads
                    data = data[end + 2 :]
                    if not data:
                        return out
                    if data.find(b"\n") < 0:
                        self._parts.append(data)
                        return out
        lines = data.split(b"\n")
        rest = lines.pop()
        if rest:
            self._parts.append(rest)
        self._take_lines(lines, out)
        return out

    def close(self) -> list[bytes]:
        """End of stream: treat any unterminated line and event as complete and return them."""
        lines = [b"".join(self._parts)] if self._parts else []
        self._parts.clear()
        self._skip_lf = False
        if not self._started:
            self._started = True
            if lines and lines[0].startswith(_BOM):
                lines[0] = lines[0][3:]
        lines.append(b"")
        out: list[bytes] = []
        self._take_lines(lines, out)
        return out

    def _take_lines(self, lines: list[bytes], out: list[bytes]) -> None:
        """Interpret complete lines; a blank line dispatches the event assembled so far."""
        data = self._data
        for line in lines:
            if not line:
                if self._error:
                    out.append(_error_payload(b"\n".join(self._error)))
                    self._error.clear()
                    data.clear()
                elif data:
                    payload = data[0] if len(data) == 1 else b"\n".join(data)
                    out.append(_error_event(payload) if self._error_event else payload)
                    data.clear()
                self._error_event = False
            elif line.startswith(b"data"):
                if len(line) == 4:  # "data" with no colon: a data line with an empty value
                    data.append(b"")
                elif line[4] == _COLON:
                    data.append(line[6:] if line[5:6] == b" " else line[5:])
                # else: a field such as "dataset:" that merely starts with "data": ignored
            elif line.startswith(b"error:"):
                self._error.append(line[7:] if line[6:7] == b" " else line[6:])
            elif line.startswith(b"event:"):
                self._error_event = (line[7:] if line[6:7] == b" " else line[6:]) == b"error"
            # comments (":..."), event/id/retry and unknown fields: ignored


def _error_payload(value: bytes) -> bytes:
    """The chat shape of an error, `{"error": VALUE}`, for the value of an `error:` field: as
    sent when it is JSON, else as a JSON string (the text, invalid UTF-8 read as U+FFFD)."""
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        return orjson.dumps({"error": value.decode("utf-8", "replace")})
    return b'{"error":' + value + b"}"


def _error_event(payload: bytes) -> bytes:
    """The payload of an event named `error`: as sent when it is an object with an `error`
    already (`{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}`), else the
    chat shape of an error with the data as its value (`_error_payload`). A flat error event
    (OpenAI Responses' `{"type": "error", "code": ..., "message": ...}`) loses its `type`
    first: "error" names the event, not the error, and as the value's type it read as the
    error's name ("error error in stream ...")."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        if obj.get("error") is not None:
            return payload
        if obj.get("type") == "error":
            del obj["type"]
            return orjson.dumps({"error": obj})
    return _error_payload(payload)
