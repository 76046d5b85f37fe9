"""Pure parsing of OpenAI-compatible streaming chunks and error bodies: no I/O, no event loop.

`shardrun.client` hands the SSE payloads (bytes) of each network read to a `ChunkReader`, which
parses them with `orjson.loads` and collects text, finish_reason and usage; the client owns the
timing and the outcome, this module only reads JSON values.

Malformed shapes are not checked up front: a chunk whose `choices` is not a list of objects (or a
`usage` that is not an object) raises one of `PARSE_ERRORS` inside `ChunkReader.read`, which
catches it around the whole read and reports BAD (the client's `protocol_error`). That keeps the
per-chunk path free of `isinstance` checks for the shapes every real server sends; whatever a
chunk set before it raised stays set.

Envelope: most servers wrap every content chunk of a stream in the same bytes, all but the content
value (vLLM, llama.cpp, the simulator: `{"id":"chatcmpl-1",...,"delta":{"content":"` + value +
`"},"logprobs":null,"finish_reason":null}]}`). Parsing such a chunk builds five objects to read one
string. So the reader learns the envelope from the first plain content chunk it parses (one whose
only effect is its piece), as the bytes before and after the content's raw value, and later
payloads that are exactly prefix + value + suffix, with a value free of quotes, backslashes and
control bytes, are read by slicing: JSON tokenizes such a payload exactly as the learned one, so
its only effect is the value as a piece. A probe (the content with `PROBE_MARK` appended, parsed
once) proves the bytes found are the content and not an equal value elsewhere. A value with
escapes (a line break, a quote) is read by parsing only the string it is, when it is exactly one
JSON string (`_escaped`), and those of a read of many payloads all in one parse, as one JSON
array of strings (`_escaped_run`). Anything else is parsed, in order, so the result is always
what parsing every payload would give. An envelope that changes per chunk costs a few failed
lessons per stream (`LEARN_MAX`), then the stream is parsed as before.

Padding: OpenAI ends every chunk with an `"obfuscation"` member of random length, which would
change the envelope chunk by chunk. The reader takes it off (`_PADDING`) before the envelope
sees a payload, once a stream's envelope was learned from a chunk without it. That changes
nothing a payload says: the member is the object's last, its key one the reader never reads,
its value printable ASCII, and the byte before it ends a value, so the payload with it is JSON
exactly when the payload without it is (`{,"obfuscation":"x"}` is not, `{}` is: that is what
the byte before excludes). A malformed payload is named as it was sent (`bad`).

A reasoning model's stream is mostly reasoning chunks (`"delta":{"reasoning_content":"` + value
+ ...), so the reader learns a second envelope, the thought envelope, from the first plain
reasoning chunk (`plain_thought`) the same way, and slices those chunks into `reasoning`. A
function call's arguments stream the same way, so a third, the arguments envelope, is learned
from the first plain arguments chunk of a call (`plain_arguments`) and extends that call's
arguments. An empty value in those two is parsed, not sliced: a thought's other field may hold
the text (`reasoning_content or reasoning`), and an empty arguments piece still counts a chunk.
"""

from __future__ import annotations

import html
import re
from codecs import BOM_UTF8, BOM_UTF16_BE, BOM_UTF16_LE, BOM_UTF32_BE, BOM_UTF32_LE
from collections.abc import Callable
from itertools import repeat
from operator import itemgetter
from typing import Any

import orjson

from shardrun._ellipsis import counted
from shardrun.retry import RETRYABLE_4XX

MSG_MAX = 200
"""Longest error sentence fragment: error messages go into one-line JSON events."""
PARSE_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError)
"""What malformed stream data raises here or in `orjson.loads` (JSONDecodeError is a ValueError)."""


MORE, DONE, ERROR, BAD = 0, 1, 2, 3
"""What `ChunkReader.read` met: nothing final, `[DONE]`, an error object, a malformed payload."""

LEARN_MAX = 3
"""Envelopes one stream may try to learn (see "Envelope" above)."""
PROBE_MARK = b"~"
"""Appended to a content to probe a learned envelope: any byte JSON takes unescaped would do."""
_UNSAFE = b'"\\' + bytes(range(0x20))
"""The bytes a JSON string holds only escaped: a value without them is its own raw bytes."""
_OTHER_KEYS = ("reasoning_content", "reasoning", "tool_calls", "refusal", "function_call")
"""Delta keys whose text is not the content (`ChunkReader._other`)."""
_OTHER_KEY_SET = frozenset(_OTHER_KEYS)
"""The same, to skip `_other` in one C call for a delta with none (a role or finish chunk)."""
PADDING_KEY = b',"obfuscation":"'
"""What starts OpenAI's padding in a chunk (module docstring, "Padding")."""
_PADDING = re.compile(rb',"obfuscation":"(?<=[]}"0-9el],"obfuscation":")[ !#-\[\]-~]*"(?=}\Z)')
"""OpenAI's padding as the last member of a payload's object, after a byte that ends a value
(see "Padding" above; the look-behind sits after the key so that the search scans for it)."""
CONTENT, THOUGHT, ARGUMENTS = 0, 1, 2
"""The envelopes a stream may teach (see "Envelope" above)."""
_ENVELOPE_SLOTS = (("_prefix", "_suffix", "_learns"), ("_tprefix", "_tsuffix", "_tlearns"),
                   ("_aprefix", "_asuffix", "_alearns"))  # fmt: skip
"""By envelope kind: the `ChunkReader` slots of its prefix, suffix and lessons left."""


class ChunkReader:
    """Reads one stream's payloads in order; keeps what outlives one chunk.

    `read` takes all the payloads of one network read in a single call. Parsed payloads have the
    per-chunk work inlined (one `orjson.loads` and a few dict gets each); payloads that fit the
    stream's learned envelope are not parsed at all (module docstring, "Envelope").
    """

    __slots__ = ("_acall", "_alearns", "_aprefix", "_asuffix", "_learns", "_padded", "_prefix",
                 "_suffix", "_tlearns", "_tprefix", "_tsuffix", "bad", "cached_tokens", "chat",
                 "completion_tokens", "error", "finish_reason", "function_call", "other_chunks",
                 "prompt_tokens", "reasoning", "reasoning_tokens", "refusal",
                 "tool_calls")  # fmt: skip

    def __init__(self, chat: bool) -> None:
        self.chat = chat  # chat: choices[0].delta.content; completions: choices[0].text
        self.finish_reason: str | None = None  # the last one seen on any choice
        self.prompt_tokens: int | None = None  # from the usage object, when the server sent one
        self.completion_tokens: int | None = None
        # Of those, where the usage object counts them: prompt tokens the server had cached,
        # completion tokens the model spent reasoning.
        self.cached_tokens: int | None = None
        self.reasoning_tokens: int | None = None
        self.error: object = None  # the value of the `error` payload that ended the stream
        self.bad = b""  # the payload that could not be read (for the error message)
        # Generated text that is not the answer's content (chat only, see `read`): reasoning
        # pieces, tool calls by index, a refusal's pieces, and how many chunks carried any.
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, ToolCallParts] = {}
        self.refusal: list[str] = []
        # A call in the older `functions` form (`delta.function_call`, finish "function_call"),
        # as OpenAI still answers a request that names `functions` instead of `tools`.
        self.function_call: ToolCallParts | None = None
        self.other_chunks = 0
        # The envelope: a plain content chunk is _prefix + the content's raw bytes + _suffix.
        # An empty _suffix means none is known (a learned suffix holds at least the closing ").
        self._prefix = self._suffix = b""
        self._learns = LEARN_MAX
        # The thought envelope: a plain reasoning chunk, the same way (its own budget).
        self._tprefix = self._tsuffix = b""
        self._tlearns = LEARN_MAX
        # The arguments envelope: a plain arguments chunk of one call, whose argument pieces
        # (in `tool_calls`) are _acall.
        self._aprefix = self._asuffix = b""
        self._alearns = LEARN_MAX
        self._acall: list[str] = []
        # Whether the chunks come padded and an envelope fits them without: payloads that fit
        # none as sent are then read without their padding (module docstring, "Padding").
        self._padded = False

    def read(self, payloads: list[bytes], pieces: list[str], unpadded: bool = False) -> int:
        """Apply SSE payloads in order, appending each content piece to `pieces`; MORE to go on.

        Stops at the first payload that ends the stream: `[DONE]` (DONE; a payload that starts
        so, `[DONE] `, too: OpenAI's own clients end there), an `{"error": ...}`
        object (ERROR, its value in `error`), or a payload that is not JSON or not shaped as a
        chunk (BAD, the payload in `bad`). Payloads after it are not read.

        A piece is choices[0]'s content when that is a non-empty string. A finish_reason may sit
        on any choice; the last truthy one wins (one that is no string as its JSON text).
        Usage counts that are not ints become None. A chunk that turns out malformed halfway
        keeps what it set before (a finish_reason), but its piece is not appended.

        A chunk's choice without a `delta` is read by its `message` (a server that sends its
        whole `chat.completion` as one event, as the answer to a streaming request): ignored,
        the answer was an empty success. Only while no piece of the answer has been read (in
        `pieces`): a final chunk that repeats the whole message streamed before it (some
        OpenAI-style streams end so) would add it all a second time; after other text only
        (`other_chunks`: reasoning streamed), its answer, which the stream never sent, and the
        kinds of other text the stream sent none of (`_whole_message`).

        A chat delta may also carry text that is not the answer: reasoning (`reasoning_content`,
        as DeepSeek, llama.cpp and older vLLM send it, or `reasoning`), tool calls, whose
        pieces are merged by index (`merge_tool_calls`), a refusal (`refusal`, OpenAI's models
        declining a structured output) and a call in the older `functions` form
        (`function_call`). They go to `reasoning`, `tool_calls`, `refusal` and
        `function_call`, and `other_chunks` counts the chunks that carried any: those are
        tokens the model generated as much as the content is.

        `unpadded` says the padding is off the payloads already (module docstring, "Padding"):
        a padded stream's payloads are read again that way when they fit no envelope as sent.
        """
        if len(payloads) == 1:  # the usual read of a server that streams tokens as they come
            payload = payloads[0]
            if suffix := self._suffix:  # `_slice` inline: the hottest path of a stream
                prefix = self._prefix
                if (payload.endswith(suffix) and payload.startswith(prefix)
                        and len(payload) >= len(prefix) + len(suffix)):  # fmt: skip
                    value = payload[len(prefix) : -len(suffix)]  # a suffix holds at least a "
                    if len(value.translate(None, _UNSAFE)) == len(value):
                        try:
                            text = value.decode()  # strict UTF-8, as orjson reads
                        except UnicodeDecodeError:
                            pass
                        else:
                            if text:  # an empty content is no piece
                                pieces.append(text)
                            return MORE
                    elif (escaped := _escaped(value)) is not None:
                        pieces.append(escaped)
                        return MORE
            # An empty thought is parsed: the other field may hold one (module docstring).
            if self._tsuffix and (thought := _slice(payload, self._tprefix, self._tsuffix)):
                self.reasoning.append(thought)
                self.other_chunks += 1
                return MORE
            if self._asuffix and (arguments := _slice(payload, self._aprefix, self._asuffix)):
                self._acall.append(arguments)
                self.other_chunks += 1
                return MORE
            if self._padded and not unpadded:  # it fits no envelope with its padding
                return self._read_unpadded(payloads, pieces)
            return self._parse(payloads, 0, pieces)
        if self._padded and not unpadded:
            return self._read_unpadded(payloads, pieces)
        if self._suffix:
            code = self._read_run(payloads, pieces, self._prefix, self._suffix, CONTENT)
            if code is not None:
                return code
        if self._tsuffix:
            code = self._read_run(payloads, pieces, self._tprefix, self._tsuffix, THOUGHT)
            if code is not None:
                return code
        if self._asuffix:
            code = self._read_run(payloads, pieces, self._aprefix, self._asuffix, ARGUMENTS)
            if code is not None:
                return code
        return self._parse(payloads, 0, pieces)

    def _read_unpadded(self, payloads: list[bytes], pieces: list[str]) -> int:
        """`read` of a padded stream's payloads without their padding (module docstring,
        "Padding"); a malformed one is named as it was sent."""
        if len(payloads) == 1:
            # The usual payload, a content chunk, is checked in place: the prefix, a value, the
            # suffix less its closing brace, then padding of letters and digits. It is then the
            # learned chunk with another value (read as slicing reads one) and the padding as
            # its object's last member. The rest lose their padding first.
            payload, prefix, suffix = payloads[0], self._prefix, self._suffix
            at = payload.rfind(PADDING_KEY)
            end = at - len(suffix) + 1
            if (suffix.endswith(b"}") and end >= len(prefix) and payload.startswith(prefix)
                    and payload.startswith(suffix[:-1], end) and payload.endswith(b'"}')
                    and payload[at + len(PADDING_KEY) : -2].isalnum()):  # fmt: skip
                text = _value_text(payload[len(prefix) : end])
                if text is not None:
                    if text:  # an empty content is no piece
                        pieces.append(text)
                    return MORE
            unpadded = [_PADDING.sub(b"", payload)]
        else:
            unpadded = list(map(_PADDING.sub, repeat(b""), payloads))
        code = self.read(unpadded, pieces, unpadded=True)
        if code == BAD and self.bad in unpadded:
            self.bad = payloads[unpadded.index(self.bad)]
        return code

    def _read_run(self, payloads: list[bytes], pieces: list[str], prefix: bytes, suffix: bytes,
                  kind: int) -> int | None:  # fmt: skip
        """`read` of several payloads by the envelope `kind`: None, with nothing applied, unless
        the payloads up to the last one that fits the envelope all do; else what `read` returns.

        Those are read unparsed, and their values with escapes all in one parse
        (`_escaped_run`); when that fails or a value is not UTF-8 (or is empty, but for a
        content), they are read one at a time (so that one is parsed), in order. The checks run
        as C loops (`map`): a Python loop per payload would cost as much as the parsing it
        saves. The payloads after the run are parsed.
        """
        # The run: up to the last payload that fits the envelope (a read often ends with the
        # finish, usage and [DONE] payloads, which do not).
        end = len(payloads)
        while end and not (payloads[end - 1].endswith(suffix)
                           and payloads[end - 1].startswith(prefix)):  # fmt: skip
            end -= 1
        if not end:
            return None
        run = payloads if end == len(payloads) else payloads[:end]
        values = list(map(itemgetter(slice(len(prefix), -len(suffix))), run))
        # Each payload is prefix + value + suffix iff the concatenations are equal: a payload
        # too short for both gets an empty value, and then the rebuilt bytes are longer.
        if b"".join(run) != b"".join((prefix, (suffix + prefix).join(values), suffix)):
            return None
        raw = b"".join(values)
        if len(raw.translate(None, _UNSAFE)) == len(raw):
            texts = _decoded(values)
        else:
            texts = _escaped_run(values)
        sliced = False
        if texts is not None:
            if kind == CONTENT:
                pieces.extend(filter(None, texts))  # an empty content is no piece
                sliced = True
            elif all(texts):
                if kind == THOUGHT:
                    self.reasoning.extend(texts)
                else:
                    self._acall.extend(texts)
                self.other_chunks += len(texts)
                sliced = True
        if not sliced:
            for payload in run:
                if (code := self.read([payload], pieces)) != MORE:
                    return code
        return MORE if end == len(payloads) else self._parse(payloads, end, pieces)

    def _parse(self, payloads: list[bytes], start: int, pieces: list[str]) -> int:
        """`read` for payloads[start:], each parsed with orjson; learns the envelope on the way."""
        chat, append, payload = self.chat, pieces.append, b""
        try:
            for i in range(start, len(payloads)):
                payload = payloads[i]
                if payload == b"[DONE]":
                    return DONE
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    # orjson rejects bytes that are not UTF-8; read broken bytes as U+FFFD, as
                    # decoding the line to text first would. Invalid JSON raises here again.
                    obj = orjson.loads(payload.decode("utf-8", "replace"))
                if (err := obj.get("error")) is not None:
                    self.error = error_of(obj, err)
                    return ERROR
                usage = obj.get("usage")
                if choices := obj.get("choices"):
                    first, other, piece = choices[0], False, None
                    if chat:
                        delta = first.get("delta")
                        if delta is None and not pieces:
                            # A whole chat.completion sent as an event. Only while no answer
                            # was read: a final chunk that repeats the message streamed is no
                            # more; after other text only (reasoning), its answer is new.
                            delta = self._whole_message(first.get("message"))
                        if isinstance(delta, dict):
                            piece = delta.get("content")
                            # A plain content delta has one key (two with its role): only a
                            # fuller one, or one without content, may carry other text.
                            if ((piece is None or len(delta) > 1)
                                    and not _OTHER_KEY_SET.isdisjoint(delta)
                                    and self._other(delta)):  # fmt: skip
                                other = True
                            if type(piece) is list:  # Mistral's parts (`content_parts`)
                                piece, thought = content_parts(piece)
                                if thought:
                                    self.reasoning.append(thought)
                                    self.other_chunks += not other
                                    other = True
                    else:
                        piece = first.get("text")
                    if reason := first.get("finish_reason"):
                        self.finish_reason = as_text(reason)
                    if len(choices) > 1:
                        for choice in choices[1:]:
                            if reason := choice.get("finish_reason"):
                                self.finish_reason = as_text(reason)
                    if piece and isinstance(piece, str):
                        append(piece)
                        # A plain content chunk (nothing but its piece to apply): its bytes
                        # may teach the envelope, and then the rest of the read is a run.
                        if ((self._learns or self._suffix) and not reason and not usage
                                and not other and len(choices) == 1
                                and self._adopt(payload, piece, CONTENT)):  # fmt: skip
                            return self.read(payloads[i + 1 :], pieces)
                    elif (other and not reason and not usage and len(choices) == 1
                            and self._learn_other(payload, delta)):  # fmt: skip
                        return self.read(payloads[i + 1 :], pieces)
                if usage:
                    self.prompt_tokens = as_int(usage.get("prompt_tokens"))
                    self.completion_tokens = as_int(usage.get("completion_tokens"))
                    self.cached_tokens, self.reasoning_tokens = usage_details(
                        usage, "prompt_tokens_details", "completion_tokens_details")
        except PARSE_ERRORS:
            if payload.startswith(b"[DONE]"):  # "[DONE] ": the end, as OpenAI's clients read it
                return DONE
            self.bad = payload
            return BAD
        return MORE

    def _whole_message(self, message: object) -> object:
        """The delta a whole message stands for, read while no piece of the answer was: all of
        it as the first thing read; after other text only, its answer (never streamed) and
        each other kind of text the stream sent none of (reasoning, calls, a refusal, a call
        in the older form): one it sent, the message repeats. Streamed reasoning then a last
        message holding the calls lost the calls (an ok result with no answer)."""
        if not self.other_chunks or not isinstance(message, dict):
            return message
        content = message.get("content")
        if type(content) is list and self.reasoning:  # its thinking parts, streamed already
            content = content_parts(content)[0]
        delta: dict[str, Any] = {"content": content}
        if not self.reasoning:
            for key in ("reasoning_content", "reasoning"):
                if key in message:
                    delta[key] = message[key]
        if not self.tool_calls and "tool_calls" in message:
            delta["tool_calls"] = message["tool_calls"]
        if not self.refusal and "refusal" in message:
            delta["refusal"] = message["refusal"]
        if self.function_call is None and "function_call" in message:
            delta["function_call"] = message["function_call"]
        return delta

    def _other(self, delta: dict[str, Any]) -> bool:
        """Apply a delta's reasoning and tool-call pieces; True if it had any."""
        found = False
        text = delta.get("reasoning_content") or delta.get("reasoning")
        if text and isinstance(text, str):
            self.reasoning.append(text)
            found = True
        if calls := delta.get("tool_calls"):
            if merge_tool_calls(self.tool_calls, calls) and self._asuffix:
                # A call started at an index in use: the arguments envelope (learned with that
                # index in it) would put its pieces on the call before. Learn it again.
                self._aprefix = self._asuffix = b""
            found = True
        refusal = delta.get("refusal")
        if refusal and isinstance(refusal, str):
            self.refusal.append(refusal)
            found = True
        if call := delta.get("function_call"):
            self.function_call = merge_function_call(self.function_call, call)
            found = True
        if found:
            self.other_chunks += 1
        return found

    def _learn_other(self, payload: bytes, delta: dict[str, Any]) -> bool:
        """A parsed chunk of reasoning or of one call's arguments may teach its envelope (the
        probe rejects a chunk that had more to apply). True if it did."""
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        if thought and isinstance(thought, str):
            return bool(self._tlearns or self._tsuffix) and self._adopt(payload, thought, THOUGHT)
        calls = delta.get("tool_calls")
        if not (self._alearns or self._asuffix) or type(calls) is not list or len(calls) != 1:
            return False
        function = calls[0].get("function")  # a parsed call: a dict, or merging had raised
        text = function.get("arguments") if isinstance(function, dict) else None
        if not (text and isinstance(text, str) and self._adopt(payload, text, ARGUMENTS)):
            return False
        self._acall = latest_call(self.tool_calls[calls[0].get("index", 0)]).arguments
        return True

    def tool_call_list(self) -> list[dict[str, Any]] | None:
        """The tool calls in index order, as a chat message holds them; None if there were none."""
        return call_list(self.tool_calls)

    def function_call_message(self) -> dict[str, str] | None:
        """The call in the older `functions` form, as a chat message holds it
        (`{"name", "arguments"}`); None if there was none."""
        call = self.function_call
        return None if call is None else {"name": "".join(call.name),
                                          "arguments": "".join(call.arguments)}

    def read_whole(self, body: bytes) -> str | None:
        """`read_whole` of a body with this reader (the method every reader has)."""
        return read_whole(body, self)

    def _adopt(self, payload: bytes, text: str, kind: int) -> bool:
        """A parsed plain chunk of the envelope `kind`: learn the envelope when none is known.
        True if the rest of the read may go back to `read` (an envelope was learned, or padding
        found that the envelopes are to be read without).

        A chunk that fits the known envelope was parsed for its text (escapes) or its padding:
        nothing to learn. One that does not means the envelope changed: forget it, and learn this
        one's while the stream's budget lasts (a server that varies every chunk exhausts it, and
        the stream is then parsed as before, at the cost of a few failed lessons). Envelopes are
        learned from chunks without their padding (module docstring, "Padding").
        """
        # The search (a regular expression) only where the key is: most servers never pad.
        unpadded = (payload if self._padded or PADDING_KEY not in payload
                    else _PADDING.sub(b"", payload))  # fmt: skip
        padding = len(unpadded) != len(payload)
        slots = _ENVELOPE_SLOTS[kind]
        prefix, suffix, learns = (getattr(self, name) for name in slots)
        if suffix and unpadded.startswith(prefix) and unpadded.endswith(suffix):
            self._padded = self._padded or padding
            return padding
        found = None
        raw = text.encode()
        # No budget, or a text sent escaped: wait for a plainer chunk.
        if learns and len(raw.translate(None, _UNSAFE)) == len(raw) and b"\n" not in unpadded:
            learns -= 1
            found = _envelope(unpadded, raw, _PLAIN[kind], self.chat)
        prefix, suffix = found or (b"", b"")
        for name, value in zip(slots, (prefix, suffix, learns), strict=True):
            setattr(self, name, value)
        if found is None:
            return False
        self._padded = self._padded or padding
        return True


def _slice(payload: bytes, prefix: bytes, suffix: bytes) -> str | None:
    """The value of a payload that is prefix + value + suffix, if JSON holds it as its raw
    bytes (no quote, backslash or control byte) and they are UTF-8; else None."""
    if not (payload.endswith(suffix) and payload.startswith(prefix)
            and len(payload) >= len(prefix) + len(suffix)):  # fmt: skip
        return None
    value = payload[len(prefix) : -len(suffix)]  # a suffix holds at least a "
    if len(value.translate(None, _UNSAFE)) != len(value):  # `_value_text` inline (hot)
        return _escaped(value)
    try:
        return value.decode()  # strict UTF-8, as orjson reads
    except UnicodeDecodeError:
        return None


def _value_text(value: bytes) -> str | None:
    """The text of a value sliced out of an envelope: its raw bytes, if JSON holds it so and
    they are UTF-8, else its escapes read (`_escaped`); None if it is no such string."""
    if len(value.translate(None, _UNSAFE)) != len(value):
        return _escaped(value)
    try:
        return value.decode()  # strict UTF-8, as orjson reads
    except UnicodeDecodeError:
        return None


def _escaped(value: bytes) -> str | None:
    """The text of a value with escapes (a line break, a quote: the bytes `_UNSAFE` names),
    if the value between two quotes is exactly one JSON string; else None.

    Then the payload tokenizes as the learned chunk did, with this string in the value's place,
    so reading the string alone gives what parsing the payload would (a raw quote would end
    the string early and leave bytes after it, which orjson refuses).
    """
    try:
        text = orjson.loads(b'"' + value + b'"')
    except orjson.JSONDecodeError:
        return None
    return text if isinstance(text, str) and text else None


def _decoded(values: list[bytes]) -> list[str] | None:
    """The values as text, if all are strict UTF-8 (as orjson reads them); else None."""
    try:
        return list(map(bytes.decode, values))
    except UnicodeDecodeError:
        return None


def _escaped_run(values: list[bytes]) -> list[str] | None:
    """The texts of several values, some with escapes, if each is exactly one JSON string
    between two quotes (as `_escaped` reads one); else None. One parse reads them all.

    They are parsed as the JSON array `["` + values joined by `","` + `"]`, whose strings are
    the values one for one unless a value holds a quote that ends a string (one that no
    backslash escapes). That is checked here, on the values with their escaped backslashes and
    quotes taken out (a NUL between two values, so that no pair spans two). A value that ends
    in a lone backslash escapes the quote after it, which puts every later value outside the
    strings and leaves the array's last quote opening a string that never closes: orjson
    refuses that, as it refuses a bad escape, a control byte or bytes that are not UTF-8 in
    any value (a `\\u` escape cut short by a value's end meets a quote, which is no hex digit).
    """
    bare = b"\0".join(values).replace(b"\\\\", b"").replace(b'\\"', b"")
    if b'"' in bare:
        return None
    try:
        texts: list[str] = orjson.loads(b'["' + b'","'.join(values) + b'"]')
    except orjson.JSONDecodeError:
        return None
    return texts


def _envelope(payload: bytes, raw: bytes, plain: Callable[[object, bool], str | None],
              chat: bool) -> tuple[bytes, bytes] | None:  # fmt: skip
    """(prefix, suffix) around the text `raw` in a parsed plain chunk, where `plain` (of a
    parsed chunk) gives the text it applies; None when the bytes found are not provably it."""
    at = payload.find(b'"' + raw + b'"')
    if at < 0:
        return None  # the server escaped more than JSON requires (non-ASCII as \\u escapes)
    prefix, suffix = payload[: at + 1], payload[at + 1 + len(raw) :]
    # The bytes found might be another field's equal value: a probe with another value in
    # their place must read as a plain chunk with exactly that text.
    try:
        probe = orjson.loads(prefix + raw + PROBE_MARK + suffix)
    except orjson.JSONDecodeError:
        return None
    if plain(probe, chat) != (raw + PROBE_MARK).decode():
        return None
    return prefix, suffix


class ToolCallParts:
    """One tool call of a stream as it arrives: its `id` and `type`, and its function's `name`
    and `arguments` (a custom tool's `input`) as the pieces sent. They are joined once, by
    `as_message`: appending to a string copies all of it, which for an argument text of many
    pieces is quadratic."""

    __slots__ = ("arguments", "id", "later", "name", "type")

    def __init__(self) -> None:
        self.id: str | None = None
        self.type = "function"
        self.name: list[str] = []
        self.arguments: list[str] = []
        # A later call that the server sent with this call's index (`merge_tool_calls`).
        self.later: ToolCallParts | None = None

    def as_message(self) -> dict[str, Any]:
        """The call as a chat message holds it."""
        name, text = "".join(self.name), "".join(self.arguments)
        if self.type == "custom":
            return {"id": self.id, "type": "custom", "custom": {"name": name, "input": text}}
        return {"id": self.id, "type": self.type, "function": {"name": name, "arguments": text}}


def call_list(calls: dict[int, ToolCallParts]) -> list[dict[str, Any]] | None:
    """Calls by index (or output index), in that order, as a chat message holds them; None if
    there are none."""
    return [calls[i].as_message() for i in sorted(calls)] if calls else None


def merge_tool_calls(calls: dict[int, ToolCallParts], deltas: object) -> bool:
    """Merge one chunk's `tool_calls` deltas into `calls`, the calls so far by index; True if
    one of them started a call at an index already in use (see below).

    A stream sends each call in pieces: its first delta has the `id`, `type` and function
    `name`, later ones more of the `arguments` text, each naming the call by `index`. Strings
    of the function are appended (a server may split a name too; arguments sent as an object
    are appended as its JSON text); `type` is set, and `id` by the call's first delta that has
    one. A custom tool's call (type "custom") has `custom` with `name` and `input` in their
    place. A delta not shaped so raises one of `PARSE_ERRORS` (the stream is then malformed),
    and so does an `index` that is not an integer (`"index": null` beside `"index": 0` broke
    the sort at the stream's end).

    A delta that names a function with an `id` not that of the call at its index starts another
    call, after all the others: Ollama sends every call of an answer with index 0, and some
    gateways send none (0 is taken then), each call whole in one delta. Merged by index, two
    calls became one with both names and `{...}{...}` as its arguments. Later deltas with no
    name at that index go to the latest call started there (`latest_call`), whatever their
    `id`: Poolside's API sends a new one with each piece of the arguments, and some servers one
    with every delta.
    """
    moved = False
    for delta in deltas:  # type: ignore[attr-defined]  # not iterable: TypeError, as documented
        index = delta.get("index", 0)
        if type(index) is not int:  # null, a string: the calls could not be put in order
            raise TypeError(f"tool call index {index!r}")
        call = calls.get(index)
        ident = delta.get("id")
        function = delta.get("function") or delta.get("custom")
        name = function.get("name") if function else None
        if call is None:
            call = calls[index] = ToolCallParts()
        else:
            call = latest_call(call)
            if name and ident and call.id is not None and str(ident) != call.id:
                call.later = call = calls[max(calls) + 1] = ToolCallParts()
                moved = True
        if ident and call.id is None:
            call.id = str(ident)
        if kind := delta.get("type"):
            call.type = str(kind)
        if function:
            if name:
                call.name.append(as_text(name))
            if text := function.get("arguments") or function.get("input"):
                call.arguments.append(as_text(text))
    return moved


def latest_call(call: ToolCallParts) -> ToolCallParts:
    """The latest call the server sent with the index of `call` (`merge_tool_calls`)."""
    while call.later is not None:
        call = call.later
    return call


def merge_function_call(call: ToolCallParts | None, delta: object) -> ToolCallParts:
    """Merge one chunk's `function_call` delta (a call in the older `functions` form, pieces
    of its `name` and `arguments`) into `call`, a new one if None. A delta that is not an object
    raises one of `PARSE_ERRORS` (the stream is then malformed)."""
    call = call or ToolCallParts()
    if name := delta.get("name"):  # type: ignore[attr-defined]  # AttributeError, as documented
        call.name.append(as_text(name))
    if text := delta.get("arguments"):  # type: ignore[attr-defined]
        call.arguments.append(as_text(text))
    return call


def as_text(value: object) -> str:
    """A string as it was sent (a tool call's, a finish_reason), or the JSON text of a value
    that is not one: what a server sent, in a form a result can hold and a user can read."""
    return value if isinstance(value, str) else orjson.dumps(value).decode()


class Unreadable(ValueError):
    """A whole (non-streamed) answer that is a JSON object but no answer one can read (no
    choices, a choice without its message or text nor a finish_reason, a field of the wrong
    kind): the attempt's protocol_error, never an empty success. Its text says what is wrong,
    as a clause."""


def json_kind(value: object) -> str:
    """What a JSON value is, as a sentence names it ("a number", "an object", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return {str: "a string", int: "a number", float: "a number", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)  # fmt: skip


_NO_ANSWER_KEYS = frozenset((
    "index", "finish_reason", "logprobs", "content_filter_results", "stop_reason",
    "native_finish_reason", "matched_stop", "finish_details"))
"""The keys a choice may have that hold no answer in any API's shape (`read_whole`): a choice
with no message (or text) is an empty answer only when all its keys are of these. A choice with
any other key (`{"content": ...}`, a `delta`) may hold the answer where it is not read."""


def read_whole(body: bytes, reader: ChunkReader) -> str | None:
    """A complete (non-streamed) answer's text, with its finish_reason and usage set on `reader`.

    For servers that answer a streaming request with one `chat.completion` or `text_completion`
    object. None when `body` is no JSON object (then it is no answer at all); `Unreadable` when
    it is one not shaped as an answer; an `{"error": ...}` object sets `reader.error` and gives
    "". The text is choices[0]'s message content (chat) or text (completions); a null one is
    none (a tool call's), and so is a missing one when the choice says why it ended (a string
    finish_reason: `{"finish_reason": "content_filter"}`), has no key that may hold an answer
    (`_NO_ANSWER_KEYS`) and its usage counts no completion tokens. A finish_reason that is no
    string is kept as its JSON text.
    """
    obj = json_object(body)
    if obj is None:
        return None
    if (err := obj.get("error")) is not None:
        reader.error = error_of(obj, err)
        return ""
    choices = obj.get("choices")
    if type(choices) is not list or not choices:
        raise Unreadable("no choices" if not choices else f"its choices are {json_kind(choices)}")
    if not all(isinstance(c, dict) for c in choices):
        raise Unreadable("a choice that is no object")
    field, first = "message" if reader.chat else "text", choices[0]
    if field in first:
        said = first[field]
    elif ((reason := first.get("finish_reason")) and isinstance(reason, str)
            and first.keys() <= _NO_ANSWER_KEYS and not generated(obj)):  # fmt: skip
        # No answer, but it says why it ended (a content filter's refusal): an empty answer,
        # as a stream's with its finish_reason; retried, the filter would refuse it again. One
        # with a key that may hold an answer (`content`, another API's text, message or delta),
        # or whose usage counts tokens it generated, is no empty one.
        said = {} if reader.chat else None
    else:
        raise Unreadable(f"its first choice has no {field}")
    message: dict[str, Any] = first
    if reader.chat:
        if not isinstance(message := said, dict):
            raise Unreadable(f"its first choice's message is {json_kind(message)}")
        text, where = message.get("content"), "its message's content"
    else:
        text, where = said, "its first choice's text"
    if text is not None and type(text) is not str and not (reader.chat and type(text) is list):
        raise Unreadable(f"{where} is {json_kind(text)}")
    if reader.chat:
        thought = message.get("reasoning_content") or message.get("reasoning")
        if type(text) is list:  # Mistral's parts (`content_parts`)
            text, thought = content_parts(text)
        if thought and isinstance(thought, str):
            reader.reasoning.append(thought)
        refusal = message.get("refusal")
        if refusal and isinstance(refusal, str):
            reader.refusal.append(refusal)
        calls = message.get("tool_calls")
        try:
            if isinstance(calls, list) and all(isinstance(c, dict) for c in calls):
                merge_tool_calls(reader.tool_calls,
                                 [{**call, "index": i} for i, call in enumerate(calls)])
        except PARSE_ERRORS:  # a call's function that is no object: raised out of the client
            raise Unreadable("a tool call that is not shaped as one") from None
        if isinstance(call := message.get("function_call"), dict):
            reader.function_call = merge_function_call(None, call)
    for choice in choices:
        if reason := choice.get("finish_reason"):
            reader.finish_reason = as_text(reason)
    if isinstance(usage := obj.get("usage"), dict):
        reader.prompt_tokens = as_int(usage.get("prompt_tokens"))
        reader.completion_tokens = as_int(usage.get("completion_tokens"))
        reader.cached_tokens, reader.reasoning_tokens = usage_details(
            usage, "prompt_tokens_details", "completion_tokens_details")
    return text if isinstance(text, str) else ""


def generated(obj: dict[str, Any]) -> bool:
    """Whether a whole answer's usage says it generated tokens: a completion_tokens that is
    given (not null) and is anything but 0. An answer with none to show had some to show."""
    usage = obj.get("usage")
    if not isinstance(usage, dict) or usage.get("completion_tokens") is None:
        return False
    return as_int(usage["completion_tokens"]) != 0


def content_parts(parts: list[Any]) -> tuple[str, str]:
    """(answer, thought) of a content sent as a list of parts: Mistral's reasoning models send
    `[{"type": "thinking", "thinking": [{"type": "text", "text": ...}]}, {"type": "text",
    "text": ...}]` where chat has a string. Text parts are the answer, thinking parts (a list
    of text parts, or a string) the thought; other parts (references), and parts or texts
    not shaped so, are no text (as a content that is no string is none)."""
    answer: list[str] = []
    thought: list[str] = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(text := part.get("text"), str):
            answer.append(text)
        elif kind == "thinking":
            inner = part.get("thinking")
            for t in inner if isinstance(inner, list) else [inner]:
                if isinstance(t, str):
                    thought.append(t)
                elif isinstance(t, dict) and isinstance(text := t.get("text"), str):
                    thought.append(text)
    return "".join(answer), "".join(thought)


def json_object(body: bytes) -> dict[str, Any] | None:
    """The JSON object a whole body holds; None when it is not JSON or not an object."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def plain_piece(obj: object, chat: bool) -> str | None:
    """The piece of a chunk whose only effect on a `ChunkReader` is to append it, else None."""
    first = _lone_choice(obj)
    if first is None:
        return None
    if chat:
        delta = first.get("delta")
        if not isinstance(delta, dict) or any(delta.get(k) for k in _OTHER_KEYS):
            return None
        piece = delta.get("content")
    else:
        piece = first.get("text")
    return piece if piece and isinstance(piece, str) else None


def plain_thought(obj: object, chat: bool) -> str | None:
    """The reasoning of a chat chunk whose only effect on a `ChunkReader` is to append it to
    `reasoning` (and count one other chunk), else None."""
    first = _lone_choice(obj) if chat else None
    delta = None if first is None else first.get("delta")
    if (not isinstance(delta, dict) or delta.get("content") or delta.get("tool_calls")
            or delta.get("refusal") or delta.get("function_call")):  # fmt: skip
        return None
    text = delta.get("reasoning_content") or delta.get("reasoning")
    return text if text and isinstance(text, str) else None


def plain_arguments(obj: object, chat: bool) -> str | None:
    """The arguments text of a chat chunk whose only effect on a `ChunkReader` is to append it
    to one call's arguments (and count one other chunk), else None."""
    first = _lone_choice(obj) if chat else None
    delta = None if first is None else first.get("delta")
    if (not isinstance(delta, dict) or delta.get("content") or delta.get("reasoning_content")
            or delta.get("reasoning") or delta.get("refusal") or delta.get("function_call")):
        return None
    calls = delta.get("tool_calls")
    if type(calls) is not list or len(calls) != 1 or not isinstance(calls[0], dict):
        return None
    call = calls[0]
    function = call.get("function")
    if call.get("id") or call.get("type") or not isinstance(function, dict):
        return None
    text = function.get("arguments")
    if function.get("name") or not (text and isinstance(text, str)):
        return None
    return text


def _lone_choice(obj: object) -> dict[str, Any] | None:
    """The one choice of a chunk with no error, no usage and no finish_reason, else None."""
    if not isinstance(obj, dict) or obj.get("error") is not None or obj.get("usage"):
        return None
    choices = obj.get("choices")
    if type(choices) is not list or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    first: dict[str, Any] = choices[0]
    return None if first.get("finish_reason") else first


ERROR_NAMES = {
    **dict.fromkeys(("rate_limit_exceeded", "too_many_requests", "rate_limit_error"), 429),
    **dict.fromkeys(("server_error", "internal_error", "internal_server_error", "api_error",
                     "service_unavailable", "overloaded", "overloaded_error",
                     "unavailable_error", "generation", "incomplete_generation",
                     "stream_serialization_error"), 500),
    **dict.fromkeys(("invalid_request_error", "invalid_prompt", "context_length_exceeded",
                     "exceed_context_size_error", "bad_request", "invalid_value",
                     "model_not_found", "insufficient_quota", "credit_balance_exhausted",
                     "validation", "template_error", "missing_template_variable", "tool_error"),
                    400),
}  # fmt: skip
"""Error codes and types (OpenAI's, llama.cpp's, TGI's, gateways') that mean what an HTTP status
would."""


def error_of(obj: dict[str, Any], err: object) -> object:
    """The error an answer object carries (`err`, its "error"): TGI's is a bare message with its
    kind beside it (`{"error": "Input validation error: ...", "error_type": "validation"}`),
    read as OpenAI's `{"message", "type"}`, so the kind decides as a type does."""
    kind = obj.get("error_type")
    if isinstance(err, str) and isinstance(kind, str):
        return {"message": err, "type": kind}
    return err


def stream_error(err: object, tokens: int) -> tuple[str, str]:
    """(status, error sentence) for an `{"error": err}` payload inside a 2xx stream.

    The error's `code` picks the status, else its `type`: 429 or a rate-limit name is
    http_429, 500-599 or a server-fault name http_5xx, another 400-499 or a name of a request
    that cannot succeed (`ERROR_NAMES`) http_4xx; a number may come as a digit string. Anything
    else, or neither, is protocol_error, and so are the 4xx that HTTP retries (408, 409: the
    attempt's HTTP status, 200, cannot say so). `err` may also be a bare message instead of an
    object. Another in-stream 4xx (vLLM reports a request it could not serve so, OpenAI a
    prompt over the context length) is not retried: the same request meets the same answer.
    """
    code: object = err.get("code") if isinstance(err, dict) else None
    kind: object = err.get("type") if isinstance(err, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err
    n = _error_number(code) or _error_number(kind)
    status = ("http_429" if n == 429 else "http_5xx" if 500 <= n < 600
              else "http_4xx" if 400 <= n < 500 and n not in RETRYABLE_4XX
              else "protocol_error")  # fmt: skip
    name = error_name(err)
    label = "" if name is None else f" {name}"
    said = "(no message)" if msg is None else clip(msg) or "(an empty message)"
    return status, f"error{label} in stream after {counted(tokens, 'token')}: {said}"


QUOTA_NAMES = frozenset({"insufficient_quota", "credit_balance_exhausted"})
"""Error codes or types that say the account's credit or quota is used up: no request will
succeed until someone adds more, so a run stops instead of retrying every item."""


def error_name(err: object) -> str | None:
    """An error object's code (as text), else its type (a string); None when it has neither."""
    if not isinstance(err, dict):
        return None
    if (code := err.get("code")) is not None:
        return clip(code)  # a sentence's word: a server's code may be a page long
    kind = err.get("type")
    return clip(kind) if isinstance(kind, str) else None


def _error_number(value: object) -> int:
    """The HTTP status an error's code or type stands for; 0 for none. A digit string counts
    only as ASCII digits, at most 9: `int` refuses "²" (which `isdigit` accepts) and
    a string of over 4,300 digits, and either raised out of the attempt and stopped the run.
    A negative code (JSON-RPC's -32603) is none, as "-1" is no digit string: the type decides."""
    if type(value) is int:
        return max(value, 0)
    if isinstance(value, str) and len(value) < 10 and value.isascii() and value.isdigit():
        return int(value)
    return ERROR_NAMES.get(value, 0) if isinstance(value, str) else 0


def error_message(body: bytes) -> str:
    """The server's message from an error body: OpenAI `{"error": {"message"}}` or raw text."""
    return read_error_body(body)[0]


def read_error_body(body: bytes, cut: bool = False) -> tuple[str, str | None, bool]:
    """(`error_message`, `error_name`, `flagged`) of an error body, read with one parse;
    `cut`: the body is the start of a longer one (`text_head`).

    `flagged`: the error says a moderation check flagged this request's content, as
    OpenRouter's 403 does (its `metadata` names the `reasons` and the `flagged_input`): a
    refusal of the item, not of the credentials."""
    msg: object = None
    err: object = None
    flagged = False
    body = utf8_of(body)
    if (obj := json_object(body)) is not None:
        err = error_of(obj, obj.get("error", obj))
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        meta = err.get("metadata") if isinstance(err, dict) else None
        flagged = isinstance(meta, dict) and ("flagged_input" in meta or "reasons" in meta)
    if not isinstance(msg, str) or not msg:
        msg = html_page(body) or _uncut(body.decode("utf-8", "replace"), cut)
    return clip(msg) or "(empty body)", error_name(err), flagged


def text_head(body: bytes, size: int) -> str:
    """The text of `body`'s first `size` bytes (read by `utf8_of`), for `clip` to show."""
    return _uncut(utf8_of(body[:size]).decode("utf-8", "replace"), len(body) > size)


def _uncut(text: str, cut: bool) -> str:
    """`text`, less the start of a credential (`keep_secret`) it ends in when it is `cut` from
    a longer one: `clip` masks only whole credentials, and the piece before a cut showed.
    Whole ones are masked first: a key ending where its text is cut ends in its own first
    characters when its last are those, and trimming those left the rest of it unmasked."""
    if not cut:
        return text
    text = masked(text)
    piece = max((next((n for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), 0)
                 for s in _secrets), default=0)
    return text[: len(text) - piece]


def html_page(body: bytes) -> str | None:
    """What an HTML page says, as a message shows it: its title, else its first heading, else
    its text, never its markup; None when `body` is no HTML page. A proxy's, a gateway's or a
    login page read as text gave its markup, and Cloudflare's some 300 bytes of comments before
    its title filled the whole message. Only `HTML_READ` bytes are read, by patterns that read
    each byte a few times at most, so that hostile markup costs time in proportion to its length."""
    body = utf8_of(body[:HTML_READ])
    if not _HTML_START.match(body, 0, 2048):
        return None
    heading = next((m[2] for m in _HTML_HEADING.finditer(body) if m[2] and m[2].strip()), None)
    words = " ".join(html.unescape((heading or _HTML_MARKUP.sub(b" ", body)).decode(
        "utf-8", "replace")).split())
    return f"an HTML page that says {quoted(clip(words, 120))}" if words else (
        "an HTML page with no text")


def utf8_of(body: bytes) -> bytes:
    """`body` in UTF-8 without its byte order mark, decoded by that mark when it is UTF-16's or
    UTF-32's (as some Windows servers send): else a "\\x00" showed between each two letters,
    and a byte order mark before "<" or "{" hid a page or a JSON error. A body that is no whole
    number of the mark's code units is no such text (a Latin-1 one may start "\\xff\\xfe"), and
    one that is no UTF-32 is UTF-16's mark and a NUL: each was read as garbled CJK."""
    for bom, codec in _BOMS:
        if body.startswith(bom) and not len(body) % len(bom):
            # UTF-32 strictly, which UTF-16's mark and a NUL fail; a UTF-16 pair cut at the
            # 64 KiB read is replaced
            errors = "strict" if len(bom) == 4 else "replace"
            try:
                return body[len(bom) :].decode(codec, errors).encode()
            except UnicodeDecodeError:
                continue
    return body.removeprefix(BOM_UTF8)


_BOMS = ((BOM_UTF32_LE, "utf-32-le"), (BOM_UTF32_BE, "utf-32-be"),
         (BOM_UTF16_LE, "utf-16-le"), (BOM_UTF16_BE, "utf-16-be"))  # fmt: skip
"""UTF-32's first: its little-endian mark starts with UTF-16's. Each mark is as long as its
code unit."""


def quoted(words: str) -> str:
    """`words` in double quotes, its own shown as single ones: one of them inside read as the
    end of the quotation (`says "Log in to "Acme""`)."""
    return '"' + words.replace('"', "'") + '"'


HTML_READ = 64 * 1024
_HTML_COMMENT = rb"<!--[^-]*(?:-(?!->)[^-]*)*"  # to its "-->" or the page's end
# A page starts (after an XML declaration, comments, blanks and the elements of a head: a captive
# portal's `<meta>` refresh or `<script>` redirect, a `<meta charset>`) with HTML's doctype or
# an element only HTML's documents start with. An XML document's elements may share those names
# (an S3 error's `<Body>`, a SOAP fault's): one that starts otherwise, or whose first element
# is in a namespace other than XHTML's (`xmlns=`; a prefix's `xmlns:fb=` is not its own), is no
# page.
_HTML_START = re.compile(rb"(?:\s|<\?xml\b[^<>]*>|" + _HTML_COMMENT + rb"-->|<(?:meta|link|base)\b"
                         rb"[^<>]*>|<(script|style)\b[^<>]*>[^<]*(?:<(?!/\1)[^<]*)*</\1\s*>)*"
                         rb"<(?:!doctype\s+html"
                         rb"|(?:html|head|body|title)\b(?![^<>]*\bxmlns\s*=\s*"
                         rb"[\"'](?!http://www\.w3\.org/1999/xhtml[\"'])))", re.I)
# A comment, a script and a style are no words, to their end (or the page's): their text holds
# "<" and ">" (`a < b`, a tag in a string, IE's conditional tags), and cut at those it was read
# as words. Each alternative reads on to its end, never back, so the cost stays linear.
_HTML_HIDDEN = _HTML_COMMENT + rb"(?:-->)?|<(script|style)\b[^<>]*>[^<]*(?:<(?!/\1)[^<]*)*"
_HTML_MARKUP = re.compile(_HTML_HIDDEN + rb"|<[^<>]*>", re.I)
# A title or a heading inside those is none the page shows: they are read past as a whole.
_HTML_HEADING = re.compile(_HTML_HIDDEN + rb"|<(?:title|h1)\b[^<>]*>([^<]*)", re.I)


def clip(value: object, limit: int = MSG_MAX) -> str:
    """One line, at most `limit` characters, control characters shown as `\\xNN` and
    invisible or direction-changing ones as `\\uNNNN`: error sentences go into one-line JSON
    events, and from there to a terminal, where an escape sequence in a server's message would
    act (set the title, the colours, the clipboard) and a bidi override reverse the line.
    Every server text a message quotes passes here, so the credentials this process sends are
    masked here (`keep_secret`), before the cut, which would leave a piece of one. Nor does
    the cut leave a piece of an escape: "\\u20" would read as the server's own text."""
    text = masked(" ".join(str(value).split())).translate(_CONTROLS)
    if len(text) > limit:
        for escape in _ESCAPE.finditer(text, max(0, limit - 9), limit + 9):
            if escape.start() < limit < escape.end():
                limit = escape.start()
                break
    return text[:limit]


def masked(text: str) -> str:
    """`text` with each credential this process sends (`keep_secret`) as `***`."""
    for secret in _secrets:
        text = text.replace(secret, "***")
    return text


SECRET_MIN = 8
"""Shortest credential `clip` masks: a shorter one ("Bearer", "Basic", a test's "k") may be an
ordinary word of the message, which masking would mangle."""
_secrets: list[str] = []  # longest first: a secret that holds another is masked whole


def keep_secret(value: str | None) -> None:
    """Mask each word of `value` (a key, a secret header's value, a proxy's credentials) of
    `SECRET_MIN` characters or more in every message `clip` makes from now on in this process:
    a server may quote the request's credentials back ("Incorrect API key provided: sk-..."),
    and its messages go to the event log, the dead letters, the report and the terminal."""
    words = {word for word in (value or "").split() if len(word) >= SECRET_MIN}
    _secrets[:] = sorted(words.union(_secrets), key=len, reverse=True)


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))} | {
    c: f"\\u{c:04x}" for c in (0x00AD, *range(0x0600, 0x0606), 0x061C, 0x06DD, 0x070F,
                               0x0890, 0x0891, 0x08E2, 0x180E, *range(0x200B, 0x2010),
                               *range(0x202A, 0x202F), *range(0x2060, 0x2070), 0xFEFF,
                               *range(0xFFF9, 0xFFFC))} | {
    c: f"\\U{c:08x}" for c in (0x110BD, 0x110CD, *range(0x13430, 0x13440),
                               *range(0x1BCA0, 0x1BCA4), *range(0x1D173, 0x1D17B), 0xE0001,
                               *range(0xE0020, 0xE0080))}  # fmt: skip
"""C0, DEL and C1 (0x9b is a CSI of its own): those `split` leaves (it takes the whitespace,
U+2028 and U+2029 too); and the format characters a terminal does not show but obeys or that
hide words: the soft hyphen, the zero-width ones and the word joiner, the bidi marks,
embeddings, overrides and isolates (U+202E reverses the rest of a line), the invisible
operators, the deprecated shaping controls, the BOM, the interlinear annotations, the tags
(which spell hidden ASCII) and the rest of Unicode's format characters (category Cf: the
Arabic, Syriac and Kaithi number signs, which hide the digits after them, the Egyptian
hieroglyph, shorthand and musical format controls). Variation selectors stay: they only choose
the glyph before them (an emoji's)."""
_ESCAPE = re.compile(r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")
"""An escape `_CONTROLS` writes, ten characters at most: `clip` cuts none in half."""


def usage_details(usage: dict[str, Any], prompt: str,
                  completion: str) -> tuple[int | None, int | None]:  # fmt: skip
    """(cached prompt tokens, reasoning tokens) of a usage object, where the server counts them:
    `prompt` and `completion` name its details objects (`prompt_tokens_details` and
    `completion_tokens_details` in chat, `input_tokens_details` and `output_tokens_details` in
    the Responses API)."""
    cached, spent = usage.get(prompt), usage.get(completion)
    return (as_int(cached.get("cached_tokens")) if isinstance(cached, dict) else None,
            as_int(spent.get("reasoning_tokens")) if isinstance(spent, dict) else None)


def as_int(value: object) -> int | None:
    """`value` if it is a count: an int proper (not a bool, not a float) from 0 to `USAGE_MAX`,
    else None (a server's negative usage made a run's tokens and TPM negative)."""
    return value if type(value) is int and 0 <= value <= USAGE_MAX else None


USAGE_MAX = 10_000_000
"""The most tokens one request's usage may count (no model's context holds more): a server's
10**18 went into the summary as such, and with `rate_limits.tpm` set into the token pacer's
debt (`RateLimiter.correct`), which held every later request of the shard for good."""


def is_rate_header(name: str) -> bool:
    """Whether a response header is one of the `x-ratelimit-*` family (any case)."""
    return name[:12].lower() == RATE_PREFIX


RATE_PREFIX = "x-ratelimit-"


_PLAIN: tuple[Callable[[object, bool], str | None], ...] = (plain_piece, plain_thought,
                                                            plain_arguments)  # fmt: skip
"""By envelope kind: the text a parsed chunk applies when that is all it does (the probe)."""
