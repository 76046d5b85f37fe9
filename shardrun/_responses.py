"""Reading the OpenAI Responses API (`POST /v1/responses`): its stream of typed events, and a
whole response object. Pure: no I/O, no event loop.

The client reads a Responses stream through the interface it reads chat and completions with
(`_chunks.ChunkReader`): `read` takes the SSE payloads of one network read and appends the
answer's pieces; reasoning, function calls, finish_reason and usage land in the same fields, in
the chat shapes, so that results, exports and Batch output have one shape whatever the API.

A Responses stream is typed events, each with a `sequence_number` that changes every event, so
there is no envelope to learn (`_chunks`, "Envelope"): every payload is parsed. What is read:
- `response.output_text.delta`: a piece of the answer.
- `response.reasoning_text.delta` (a server that shows the model's thought, as vLLM does) and
  `response.reasoning_summary_text.delta` (OpenAI's models show a summary): a piece of reasoning.
- `response.output_item.added` of a `function_call` item: a call starts (`call_id`, `name`);
  `response.function_call_arguments.delta`: a piece of its arguments, by `output_index`.
- `response.completed` and `response.incomplete`: the end, with usage (`input_tokens`,
  `output_tokens`). finish_reason is "stop", or "tool_calls" when the answer called a function;
  an incomplete response's reason stands for it ("max_output_tokens" reads "length", as chat
  says it). What the stream did not send as deltas (the answer, the reasoning, a call's name or
  arguments: some servers send parts of the output only whole) is read from that last event.
- `response.failed` and `error`: the end, with the error.
Other events (created, in_progress, the `.added` and `.done` of text) repeat what the deltas
carry. The stream has no `[DONE]`; one is taken as the end all the same.
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
    as_int,
    call_list,
    json_object,
    usage_details,
)

__all__ = ["ResponsesReader", "read_whole_response"]

_THOUGHT_DELTAS = frozenset({"response.reasoning_text.delta",
                             "response.reasoning_summary_text.delta"})  # fmt: skip
_ENDS = frozenset({"response.completed", "response.incomplete"})
_FINISH = {"max_output_tokens": "length"}
"""An incomplete response's reason, as chat's finish_reason says it (others stand as sent)."""
_ERROR_CODES = {"rate_limit_exceeded": 429, "server_error": 500}
"""Error codes of this API that mean what an HTTP status would: retried as 429 and 5xx are."""


class ResponsesReader:
    """Reads one Responses stream's payloads in order; the fields are `ChunkReader`'s."""

    __slots__ = ("answered", "bad", "cached_tokens", "completion_tokens", "error",
                 "finish_reason", "other_chunks", "prompt_tokens", "reasoning",
                 "reasoning_tokens", "tool_calls")  # fmt: skip

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.reasoning_tokens: int | None = None
        self.error: object = None
        self.bad = b""
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, ToolCallParts] = {}  # by output_index
        self.other_chunks = 0  # reasoning and argument pieces (generated tokens all the same)
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
                elif kind == "response.function_call_arguments.delta":
                    if (delta := event.get("delta")) and isinstance(delta, str):
                        self._call(event.get("output_index")).arguments.append(delta)
                        self.other_chunks += 1
                elif kind == "response.output_item.added":
                    if (item := event["item"]).get("type") == "function_call":
                        self._start_call(event.get("output_index"), item)
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
                elif kind == "error":
                    self.error = _error(event.get("error") or event)
                    return ERROR
        except PARSE_ERRORS:
            self.bad = payload
            return BAD
        return MORE

    def _call(self, index: object) -> ToolCallParts:
        """The call at this output index, started if it is new (an int index, else KeyError)."""
        if type(index) is not int:
            raise KeyError(index)
        call = self.tool_calls.get(index)
        if call is None:
            call = self.tool_calls[index] = ToolCallParts()
        return call

    def _start_call(self, index: object, item: dict[str, Any]) -> None:
        """A function_call item: its call id, and its name and arguments where the stream has
        not given them yet (an item that starts a call has its arguments still to come)."""
        call = self._call(index)
        if ident := item.get("call_id") or item.get("id"):
            call.id = str(ident)
        if (name := item.get("name")) and not call.name:
            call.name.append(str(name))
        if (arguments := item.get("arguments")) and isinstance(arguments, str) and (
                not call.arguments):  # fmt: skip
            call.arguments.append(arguments)

    def take_output(self, response: dict[str, Any]) -> str:
        """The answer's text of a response object's `output`; its reasoning (the item's own
        text, or its summary if it shows none) and its function calls are taken where the
        stream has not given them."""
        texts, thought = [], []
        for index, item in enumerate(response.get("output") or []):
            kind = item.get("type")  # not an object: AttributeError, as in `read`
            if kind == "message":
                texts += _texts(item.get("content"), "output_text")
            elif kind == "reasoning":
                thought += _texts(item.get("content"), "reasoning_text") or _texts(
                    item.get("summary"), "summary_text")
            elif kind == "function_call":
                self._start_call(index, item)
        if not self.reasoning:
            self.reasoning = thought
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
            self.finish_reason = _FINISH.get(str(reason), str(reason or "incomplete"))
        else:
            self.finish_reason = "tool_calls" if self.tool_calls else "stop"

    def tool_call_list(self) -> list[dict[str, Any]] | None:
        """The function calls in output order, as a chat message holds them; None if none."""
        return call_list(self.tool_calls)

    def read_whole(self, body: bytes) -> str | None:
        """`read_whole_response` of a body with this reader (the method every reader has)."""
        return read_whole_response(body, self)


def _texts(parts: object, kind: str) -> list[str]:
    """The `text` of each part of this kind."""
    if not isinstance(parts, list):
        return []
    return [p["text"] for p in parts if isinstance(p, dict) and p.get("type") == kind
            and isinstance(p.get("text"), str)]  # fmt: skip


def _error(err: object) -> dict[str, object]:
    """An error of this API as `_chunks.stream_error` reads one: a code that means a rate
    limit or a server fault becomes that HTTP status, so the attempt is retried as one."""
    if not isinstance(err, dict):
        return {"code": None, "message": err or "the response failed"}
    code, message = err.get("code"), err.get("message")
    if code in _ERROR_CODES:
        return {"code": _ERROR_CODES[code], "message": f"{code}: {message}"}
    return {"code": code, "message": message}


def read_whole_response(body: bytes, reader: ResponsesReader) -> str | None:
    """A whole (non-streamed) response object's answer, with the rest set on `reader` as
    `read` sets it; None when `body` is no response at all. An `{"error": ...}` body, or a
    response whose status is "failed", sets `reader.error` and gives ""."""
    obj = json_object(body)
    if obj is None:
        return None
    if obj.get("object") != "response":
        if obj.get("error") is None:
            return None
        reader.error = _error(obj["error"])
        return ""
    if obj.get("status") == "failed":
        reader.error = _error(obj.get("error"))
        return ""
    try:
        text = reader.take_output(obj)
    except PARSE_ERRORS:
        return None
    reader.end(obj)
    return text
