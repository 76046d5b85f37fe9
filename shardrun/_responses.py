"""Reading the OpenAI Responses API (`POST /v1/responses`): its stream of typed events, and a
whole response object. Pure: no I/O, no event loop.

The client reads a Responses stream through the interface it reads chat and completions with
(`_chunks.ChunkReader`): `read` takes the SSE payloads of one network read and appends the
answer's pieces; reasoning, function calls, finish_reason and usage land in the same fields, in
the chat shapes, so that results, exports and Batch output have one shape whatever the API.

A Responses stream is typed events, each with a `sequence_number` that changes every event, so
there is no envelope to learn (`_chunks`, "Envelope"): every payload is parsed. What is read:
- `response.output_text.delta`: a piece of the answer.
- `response.reasoning_text.delta` (a server that shows the model's thought, as vLLM does),
  `response.reasoning_summary_text.delta` (OpenAI's models show a summary) and
  `response.reasoning.delta` (an older name some gateways still send): a piece of reasoning.
- `response.refusal.delta`: a piece of a refusal (the model declining a structured output).
- `response.output_item.added` of a `function_call` item: a call starts (`call_id`, `name`);
  `response.function_call_arguments.delta`: a piece of its arguments. A `custom_tool_call`
  item (a tool that takes free text) is a call the same way, its text in `input` and
  `response.custom_tool_call_input.delta`. A piece names its call by `item_id` and
  `output_index`; servers give either or both (llama.cpp no index), and some number the output
  differently in the stream and in the final response, so a call is found by any name it has
  had: item id, call id or output index (`_find_call`).
- `response.completed` and `response.incomplete`: the end, with usage (`input_tokens`,
  `output_tokens`). finish_reason is "stop", or "tool_calls" when the answer called a function;
  an incomplete response's reason stands for it ("max_output_tokens" reads "length", as chat
  says it). What the stream did not send as deltas (the answer, the reasoning, a call's name or
  arguments: some servers send parts of the output only whole) is read from that last event.
- `response.failed`, `error` and a bare `{"error": ...}` (chat's shape, which some servers
  send here too): the end, with the error, classed by its code or type (`stream_error`).
Other events (created, in_progress, the `.added` and `.done` of text) repeat what the deltas
carry. The stream has no `[DONE]`; one is taken as the end all the same (and a payload that
starts so, as chat's reader takes it).
"""

from __future__ import annotations

from typing import Any

import orjson

from shardrun._chunks import (
    BAD,
    DONE,
    ERROR,
    MORE,
    PARSE_ERRORS,
    ToolCallParts,
    Unreadable,
    as_int,
    as_text,
    call_list,
    clip,
    json_kind,
    json_object,
    usage_details,
)

__all__ = ["ResponsesReader", "read_whole_response"]

_THOUGHT_DELTAS = frozenset({"response.reasoning_text.delta",
                             "response.reasoning_summary_text.delta",
                             "response.reasoning.delta"})  # fmt: skip
_CALL_DELTAS = frozenset({"response.function_call_arguments.delta",
                          "response.custom_tool_call_input.delta"})  # fmt: skip
_CALL_ITEMS = {"function_call": "arguments", "custom_tool_call": "input"}
"""Output items that call a tool, and the field that holds what the call passes."""
_ENDS = frozenset({"response.completed", "response.incomplete"})
_FINISH = {"max_output_tokens": "length"}
"""An incomplete response's reason, as chat's finish_reason says it (others stand as sent)."""


class ResponsesReader:
    """Reads one Responses stream's payloads in order; the fields are `ChunkReader`'s."""

    __slots__ = ("_calls_by_name", "_last_call", "answered", "bad", "cached_tokens",
                 "completion_tokens", "error", "finish_reason", "function_call", "other_chunks",
                 "prompt_tokens", "reasoning", "reasoning_tokens", "refusal",
                 "tool_calls")  # fmt: skip

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.reasoning_tokens: int | None = None
        self.error: object = None
        self.bad = b""
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        # By output index (where the call that started it had a free one), so in output order.
        self.tool_calls: dict[int, ToolCallParts] = {}
        self._calls_by_name: dict[str | int, ToolCallParts] = {}  # item id, call id, index
        self._last_call: ToolCallParts | None = None
        self.function_call: ToolCallParts | None = None  # chat's older form: never here
        self.other_chunks = 0  # reasoning, refusal and argument pieces (generated tokens too)
        self.answered = False  # a delta of the answer arrived (else the last event has it)

    def read(self, payloads: list[bytes], pieces: list[str]) -> int:
        """Apply the payloads in order, appending each piece of the answer to `pieces`: MORE to
        go on, DONE at the end, ERROR for a failed response or an error event (its error in
        `error`), BAD for a payload that is not JSON or not an event (it is in `bad`)."""
        payload = b""
        try:
            for payload in payloads:
                if payload == b"[DONE]":
                    return DONE
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:  # bytes that are not UTF-8 read as U+FFFD
                    event = orjson.loads(payload.decode("utf-8", "replace"))
                kind = event.get("type")  # not an object: AttributeError, so BAD
                if kind == "response.output_text.delta":
                    if (delta := event.get("delta")) and isinstance(delta, str):
                        pieces.append(delta)
                        self.answered = True
                elif kind in _THOUGHT_DELTAS:
                    if (delta := event.get("delta")) and isinstance(delta, str):
                        self.reasoning.append(delta)
                        self.other_chunks += 1
                elif kind in _CALL_DELTAS:
                    if (delta := event.get("delta")) and isinstance(delta, str):
                        item, index = event.get("item_id"), event.get("output_index")
                        call = self._same_call(item, index) or self._find_call(index, item)
                        call.arguments.append(delta)
                        self.other_chunks += 1
                elif kind == "response.refusal.delta":
                    if (delta := event.get("delta")) and isinstance(delta, str):
                        self.refusal.append(delta)
                        self.other_chunks += 1
                elif kind == "response.output_item.added":
                    if (item := event["item"]).get("type") in _CALL_ITEMS:
                        self._start_call(item, event.get("output_index"))
                elif kind in _ENDS:
                    response = event["response"]
                    if (text := self.take_output(response)) and not self.answered:
                        pieces.append(text)
                    self.end(response)
                    return DONE
                elif kind == "response.failed":
                    response = event.get("response")
                    self.error = _error(response.get("error") if isinstance(response, dict)
                                        else None)  # fmt: skip
                    return ERROR
                elif kind == "error" or (kind is None and event.get("error") is not None):
                    # OpenAI nests it ({"type": "error", "error": {...}}); its documents show
                    # the fields on the event itself.
                    self.error = _error(event.get("error") or {
                        "code": event.get("code"), "message": event.get("message")})
                    return ERROR
        except PARSE_ERRORS:
            if payload.startswith(b"[DONE]"):  # "[DONE] ": the end, as OpenAI's clients read it
                return DONE
            self.bad = payload
            return BAD
        return MORE

    def _same_call(self, item: object, index: object) -> ToolCallParts | None:
        """The call the last piece went to, when this piece names it by the same item id and
        an output index already its own (or none): `_find_call` would change nothing then, and
        this is most pieces, so its bookkeeping is skipped. Else None."""
        call, known = self._last_call, self._calls_by_name
        if call is None or type(item) is not str or known.get(item) is not call:
            return None
        if index is not None and (type(index) is not int or known.get(index) is not call):
            return None
        return call

    def _find_call(self, index: object, *ids: object) -> ToolCallParts:
        """The call that its output index or any of its ids (item id, call id) has named
        before, or a new call; each names it from then on (None for one not given). With no
        name at all, the latest call: a server that names none streams one call at a time. An
        index that is not an int, or an id that is not a string, raises KeyError (the event is
        malformed)."""
        given: list[str | int] = []  # the ids first: they outrank an index (see take_output)
        for name in ids:
            if name is not None:
                if type(name) is not str:
                    raise KeyError(name)
                given.append(name)
        if index is not None:
            if type(index) is not int:
                raise KeyError(index)
            given.append(index)
        known = self._calls_by_name
        call = next((known[n] for n in given if n in known), None)
        if call is None:
            if not given and self._last_call is not None:
                return self._last_call
            calls = self.tool_calls
            if type(index) is not int or index in calls:
                index = max(calls, default=-1) + 1
            call = calls[index] = ToolCallParts()
        for name in given:
            known.setdefault(name, call)
        self._last_call = call
        return call

    def _start_call(self, item: dict[str, Any], index: object) -> None:
        """A tool-call item: its call id and kind, and its name and arguments (a custom
        tool's input) where the stream has not given them yet (an item that starts a call has
        its arguments still to come)."""
        call = self._find_call(index, item.get("id"), item.get("call_id"))
        kind = item["type"]
        if kind == "custom_tool_call":
            call.type = "custom"
        if ident := item.get("call_id") or item.get("id"):
            call.id = str(ident)
        if (name := item.get("name")) and not call.name:
            call.name.append(as_text(name))
        text = item.get(_CALL_ITEMS[kind])
        if text and isinstance(text, str) and not call.arguments:
            call.arguments.append(text)

    def take_output(self, response: dict[str, Any]) -> str:
        """The answer's text of a response object's `output` (a message's `content` given as
        a string, chat's shape, is its text); its reasoning (the item's own text, or its
        summary if it shows none), its refusal and its tool calls are taken where the stream
        has not given them. A call is matched to the stream's by its item or call
        id before its place in the output (`_find_call`), which a server may number otherwise
        in the stream."""
        texts, thought, refused = [], [], []
        for index, item in enumerate(response.get("output") or []):
            kind = item.get("type")  # not an object: AttributeError, as in `read`
            if kind == "message":
                content = item.get("content")
                if isinstance(content, str):  # chat's shape, as some gateways send it
                    texts.append(content)
                texts += _texts(content, "output_text")
                refused += _texts(content, "refusal", "refusal")
            elif kind == "reasoning":
                thought += _texts(item.get("content"), "reasoning_text") or _texts(
                    item.get("summary"), "summary_text")
            elif kind in _CALL_ITEMS:
                self._start_call(item, index)
        if not self.reasoning:
            self.reasoning = thought
        if not self.refusal:
            self.refusal = refused
        return "".join(texts)

    def end(self, response: dict[str, Any]) -> None:
        """A final response object: usage and finish_reason."""
        usage = response.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = as_int(usage.get("input_tokens"))
            self.completion_tokens = as_int(usage.get("output_tokens"))
            self.cached_tokens, self.reasoning_tokens = usage_details(
                usage, "input_tokens_details", "output_tokens_details")
        if response.get("status") == "incomplete":
            details = response.get("incomplete_details")
            reason = details.get("reason") if isinstance(details, dict) else None
            said = as_text(reason) if reason else "incomplete"  # no string: its JSON text
            self.finish_reason = _FINISH.get(said, said)
        else:
            self.finish_reason = "tool_calls" if self.tool_calls else "stop"

    def tool_call_list(self) -> list[dict[str, Any]] | None:
        """The function calls in output order, as a chat message holds them; None if none."""
        return call_list(self.tool_calls)

    def function_call_message(self) -> None:
        """Chat's call in the older `functions` form: the Responses API has none."""
        return None

    def read_whole(self, body: bytes) -> str | None:
        """`read_whole_response` of a body with this reader (the method every reader has)."""
        return read_whole_response(body, self)


def _texts(parts: object, kind: str, field: str = "text") -> list[str]:
    """The text (in `field`) of each part of this kind."""
    if not isinstance(parts, list):
        return []
    return [p[field] for p in parts if isinstance(p, dict) and p.get("type") == kind
            and isinstance(p.get(field), str)]  # fmt: skip


def _error(err: object) -> object:
    """An error of this API as `_chunks.stream_error` reads one (which classes it by its code
    or type); a failed response without one still says that it failed."""
    return err if isinstance(err, dict) else {"code": None,
                                              "message": err or "the response failed"}


def read_whole_response(body: bytes, reader: ResponsesReader) -> str | None:
    """A whole (non-streamed) response object's answer, with the rest set on `reader` as
    `read` sets it; None when `body` is no JSON object, `Unreadable` when it is one but no
    response, one without its output list, or one whose status says it has not ended (or was
    cancelled). An `{"error": ...}` body, or a response whose status is "failed", sets
    `reader.error` and gives ""."""
    obj = json_object(body)
    if obj is None:
        return None
    if (kind := obj.get("object")) != "response":
        if obj.get("error") is None:
            said = "no object" if kind is None else f"object {clip(as_text(kind), 40)}"
            raise Unreadable(f"it is no response object ({said})")
        reader.error = _error(obj["error"])
        return ""
    if (status := obj.get("status")) == "failed":
        reader.error = _error(obj.get("error"))
        return ""
    if status is not None and status not in ("completed", "incomplete"):
        # queued, in_progress (a background response), cancelled: no answer, or not yet one
        raise Unreadable(f"its status is {clip(as_text(status), 40)}, not completed")
    if type(output := obj.get("output")) is not list:
        raise Unreadable("it has no output" if output is None else f"its output is "
                         f"{json_kind(output)}")
    try:
        text = reader.take_output(obj)
    except PARSE_ERRORS:
        raise Unreadable("an output item that is not shaped as one") from None
    reader.end(obj)
    return text
