"""The bytes of an answer: prebuilt SSE templates of a stream, or one JSON body.

Built once per request from its `Plan`; token events are joined from the templates per write,
so a stream costs one join and one write per wake, never JSON encoding per token: each word's
bytes inside a JSON string (escaped when the text is prose) are tabled once, at import.

A Responses stream (`ResponseFrames`) numbers every event (`sequence_number`), so its token
events are one bytes `%` format each (template, number, tabled word) instead of a plain join;
its other events are known up front (the plan holds the whole answer) and encoded once.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import orjson

from shardrun.sim.config import TEXT_WORDS, Plan

__all__ = ["OBJECT", "Frames", "ResponseFrames", "render_full", "render_stream"]


def _in_string(text: str) -> bytes:
    """The bytes of `text` inside a JSON string (escaped as JSON needs)."""
    return orjson.dumps(text)[1:-1]


#: By text mode: each word as a JSON string holds it, and as the arguments of a tool call hold
#: it (a JSON string inside the JSON text {"text": "..."}, so escaped twice).
_JSON_WORDS = {mode: tuple(map(_in_string, texts)) for mode, texts in TEXT_WORDS.items()}
_ARGUMENT_WORDS = {mode: tuple(_in_string(_in_string(t).decode()) for t in texts)
                   for mode, texts in TEXT_WORDS.items()}  # fmt: skip

_DONE = b"data: [DONE]\n\n"
OBJECT = {"chat": (b"chat.completion.chunk", "chat.completion", "chatcmpl"),
          "completions": (b"text_completion", "text_completion", "cmpl"),
          "responses": (b"response", "response", "")}  # fmt: skip
"""By kind: a stream chunk's and a whole answer's `object`, and the request id's prefix (none
for Responses, whose ids are "resp_", "msg_"... + the request id)."""


def _usage(plan: Plan) -> dict[str, object]:
    """The OpenAI usage object; prompt tokens are the plan's cheap estimate. A thinking
    model's answer also counts its reasoning tokens, and a prompt cache its cached prompt
    tokens, as OpenAI's do."""
    n = len(plan.words)
    usage: dict[str, object] = {"prompt_tokens": plan.prompt_tokens, "completion_tokens": n,
                                "total_tokens": plan.prompt_tokens + n}  # fmt: skip
    if plan.cached:
        usage["prompt_tokens_details"] = {"cached_tokens": plan.cached}
    if plan.thinking:
        usage["completion_tokens_details"] = {"reasoning_tokens": plan.thinking}
    return usage


class Frames(NamedTuple):
    """Prebuilt SSE bytes of one stream; each word's bytes come from a table, so no JSON
    encoding per token."""

    role: bytes  # chat's first chunk (role "assistant"); b"" for completions
    head: bytes  # bytes of a token event before its word
    tail: bytes  # bytes of a token event after its word
    end: bytes  # finish chunk, usage chunk when asked for, then [DONE]
    table: tuple[bytes, ...]  # a word's bytes between head and tail, by word
    thinking: int = 0  # the first `thinking` words of the answer are reasoning, framed so:
    think_head: bytes = b""
    think_tail: bytes = b""
    opener: bytes = b""  # sent before the first word after the reasoning (a tool call's start)
    think_table: tuple[bytes, ...] = ()  # a reasoning word's bytes, by word

    def tokens(self, words: bytes, start: int = 0) -> bytes:
        """The events of these tokens (words[start:...] of the answer) as one bytes object: one
        join per write, not per token."""
        split = self.thinking - start
        if split < 0 or (split == 0 and not self.opener):
            table = self.table
            return self.head + (self.tail + self.head).join([table[i] for i in words]) + self.tail
        thought = b""
        if split:
            table = self.think_table
            thought = self.think_head + (self.think_tail + self.think_head).join(
                [table[i] for i in words[:split]]) + self.think_tail
        if not words[split:]:
            return thought
        return thought + self.opener + self.tokens(words[split:], self.thinking + 1)


def render_stream(plan: Plan, rid: str, created: int) -> Frames | ResponseFrames:
    """The byte templates of a streamed answer; token events are built lazily, per write."""
    if plan.kind == "responses":
        return _response_frames(plan, rid, created)
    frames = _chunk_frames(plan, rid, created)
    return _with_padding(frames) if plan.padded else frames


def _chunk_frames(plan: Plan, rid: str, created: int) -> Frames:
    """The byte templates of a streamed chat or completions answer."""
    ident = b'"id":%b,"object":"%b","created":%d,"model":%b' % (
        orjson.dumps(rid), OBJECT[plan.kind][0], created, orjson.dumps(plan.model))
    pre = b"data: {" + ident + b',"choices":[{"index":0,'
    end = b'"logprobs":null,"finish_reason":null}]}\n\n'
    finish = b'"logprobs":null,"finish_reason":"%b"}]}\n\n' % plan.finish.encode()
    usage = b""
    if plan.include_usage:
        usage = b'data: {%b,"choices":[],"usage":%b}\n\n' % (ident, orjson.dumps(_usage(plan)))
    if plan.kind == "chat" and plan.tool is not None:
        # The content becomes the arguments {"text": "<words>"} of a call, sent in pieces after
        # the reasoning: the call's first chunk names it, the last closes the JSON.
        if plan.legacy:  # the older `functions` form: one call, no id, no index
            opener = pre + b'"delta":{"function_call":{"name":%b,"arguments":' \
                b'"{\\"text\\":\\""}},' % orjson.dumps(plan.tool) + end
            head = pre + b'"delta":{"function_call":{"arguments":"'
            tail = b'"}},' + end
        else:
            opener = pre + b'"delta":{"tool_calls":[{"index":0,"id":"call_%b",' \
                b'"type":"function","function":{"name":%b,"arguments":"{\\"text\\":\\""}}]},' % (
                    rid.encode(), orjson.dumps(plan.tool)) + end
            head = pre + b'"delta":{"tool_calls":[{"index":0,"function":{"arguments":"'
            tail = b'"}}]},' + end
        close = (opener if len(plan.words) <= plan.thinking else b"") + head + b'\\"}' + tail
        return Frames(pre + b'"delta":{"role":"assistant","content":null},' + end, head, tail,
                      close + pre + b'"delta":{},' + finish + usage + _DONE,
                      _ARGUMENT_WORDS[plan.text], plan.thinking, *_thought_frames(pre, end),
                      opener, _JSON_WORDS[plan.text])  # fmt: skip
    table = _JSON_WORDS[plan.text]
    if plan.kind == "chat":
        said = b"refusal" if plan.refused else b"content"
        return Frames(pre + b'"delta":{"role":"assistant","content":""},' + end,
                      pre + b'"delta":{"%b":"' % said, b'"},' + end,
                      pre + b'"delta":{},' + finish + usage + _DONE, table,
                      plan.thinking, *_thought_frames(pre, end), b"", table)  # fmt: skip
    return Frames(b"", pre + b'"text":"', b'",' + end, pre + b'"text":"",' + finish + usage + _DONE,
                  table)  # fmt: skip


_PAD_LETTERS = b"uSpCcO0b4kQz9mEwXa7"
"""Letters OpenAI-style padding is cut from (OpenAI's own are random)."""


def _padded(event: bytes, i: int) -> bytes:
    """One event's JSON object (`data: {...}`, without the blank line) with an `obfuscation`
    member last, of 1 to 15 letters by `i`, as OpenAI pads a chunk to hide its length."""
    n = 1 + i * 7 % 15
    return event[:-1] + b',"obfuscation":"' + _PAD_LETTERS[i % 4 : i % 4 + n] + b'"}'


def _padded_events(blob: bytes) -> bytes:
    """Every event of `blob` padded (`_padded`), but `[DONE]`."""
    events = blob.split(b"\n\n")  # the last is the empty rest after the final blank line
    return b"\n\n".join(_padded(e, len(e)) if e.endswith(b"}") else e for e in events)


@functools.lru_cache(maxsize=16)
def _padded_table(table: tuple[bytes, ...], tail: bytes) -> tuple[bytes, ...]:
    """Each word with the tail of its event, padded by the word: the padding changes from
    token to token, and the templates still join words without encoding any."""
    return tuple(_padded(word + tail[:-2], i) + b"\n\n" for i, word in enumerate(table))


def _with_padding(frames: Frames) -> Frames:
    """The frames of a stream whose every chunk OpenAI would pad (`Plan.padded`)."""
    return frames._replace(
        role=_padded_events(frames.role), tail=b"", end=_padded_events(frames.end),
        table=_padded_table(frames.table, frames.tail), think_tail=b"",
        opener=_padded_events(frames.opener),
        think_table=_padded_table(frames.think_table, frames.think_tail))


def _thought_frames(pre: bytes, end: bytes) -> tuple[bytes, bytes]:
    """Head and tail of a reasoning token's event."""
    return pre + b'"delta":{"reasoning_content":"', b'"},' + end


def render_full(plan: Plan, rid: str, created: int) -> bytes:
    """A complete non-streaming chat.completion, text_completion or response JSON body."""
    if plan.kind == "responses":
        return orjson.dumps(_response(plan, rid, created))
    texts = TEXT_WORDS[plan.text]
    thought = "".join(texts[i] for i in plan.words[: plan.thinking])
    text = "".join(texts[i] for i in plan.words[plan.thinking :])
    choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": plan.finish}
    if plan.kind == "chat":
        message: dict[str, object] = {"role": "assistant", "content": text}
        if plan.refused:
            message.update(content=None, refusal=text)
        if plan.thinking:
            message["reasoning_content"] = thought
        if plan.tool is not None:
            arguments = orjson.dumps({"text": text}).decode()
            function = {"name": plan.tool, "arguments": arguments}
            if plan.legacy:
                message.update(content=None, function_call=function)
            else:
                message.update(content=None, tool_calls=[{
                    "id": f"call_{rid}", "type": "function", "function": function}])
        choice["message"] = message
    else:
        choice["text"] = text
    return orjson.dumps({"id": rid, "object": OBJECT[plan.kind][1], "created": created,
                         "model": plan.model, "choices": [choice], "usage": _usage(plan)})


# The Responses API (POST /v1/responses).


class ResponseFrames(NamedTuple):
    """Prebuilt SSE bytes of one Responses stream, written by `Sim.emit` as `Frames` are.

    Word i of the plan (reasoning first) is one event: `think % (i + think_seq, word)` while
    i < `thinking`, else `answer % (i + answer_seq, word)`. `middle` (the reasoning item's done
    and the answer item's start) goes just before the first answer token; without reasoning,
    the answer item's start is in `role`.
    """

    role: bytes  # created, in_progress and the first item's start
    end: bytes  # the last item's closing events, then response.completed or .incomplete
    think: bytes  # a reasoning token's event: a bytes % template of (sequence number, word)
    answer: bytes  # an answer token's event (output text, or a piece of a call's arguments)
    think_table: tuple[bytes, ...]  # a reasoning word's bytes in its event, by word
    table: tuple[bytes, ...]  # an answer word's bytes in its event, by word
    thinking: int
    middle: bytes
    think_seq: int
    answer_seq: int

    def tokens(self, words: bytes, start: int = 0) -> bytes:
        """The events of these tokens (words[start:...] of the answer) as one bytes object."""
        split = max(0, min(len(words), self.thinking - start))
        out = b""
        if split:
            seq, table, think = start + self.think_seq, self.think_table, self.think
            out = b"".join([think % (seq + j, table[w]) for j, w in enumerate(words[:split])])
        if split < len(words):
            at = start + split  # the plan's index of the first answer word here
            seq, table, answer = at + self.answer_seq, self.table, self.answer
            out += (self.middle if at == self.thinking else b"") + b"".join(
                [answer % (seq + j, table[w]) for j, w in enumerate(words[split:])])
        return out


class _Events:
    """Numbers and encodes a Responses stream's events in order; `skip` leaves the numbers of
    token events, which `ResponseFrames` makes per write."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: object) -> bytes:
        """The next event's bytes."""
        data = orjson.dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: %b\ndata: %b\n\n" % (kind.encode(), data)

    def skip(self, n: int) -> int:
        """Reserve n sequence numbers for token events; the first of them."""
        self.seq += n
        return self.seq - n


def _token_event(kind: str, fields: dict[str, object], tail: bytes) -> bytes:
    """A token event as a bytes % template of (sequence number, word): the word is the string
    `delta`, after the other fields; `tail` closes the string and the object."""
    head = orjson.dumps({"type": kind, "sequence_number": 0, **fields})[:-1].replace(b"%", b"%%")
    head = head.replace(b'"sequence_number":0', b'"sequence_number":%d', 1)
    return b'event: %b\ndata: %b,"delta":"%%b%b\n\n' % (kind.encode(), head, tail)


def _response(plan: Plan, rid: str, created: int) -> dict[str, Any]:
    """The final response object: a stream's last event holds it; a whole answer is it."""
    texts = TEXT_WORDS[plan.text]
    output: list[dict[str, Any]] = []
    if plan.thinking:
        thought = "".join(texts[i] for i in plan.words[: plan.thinking])
        if plan.summary:
            output.append({"id": f"rs_{rid}", "type": "reasoning",
                           "summary": [{"type": "summary_text", "text": thought}]})
        else:
            output.append({"id": f"rs_{rid}", "type": "reasoning", "summary": [],
                           "content": [{"type": "reasoning_text", "text": thought}]})
    if len(plan.words) > plan.thinking:  # a cap may leave only reasoning
        text = "".join(texts[i] for i in plan.words[plan.thinking :])
        if plan.tool is None:
            part = ({"type": "refusal", "refusal": text} if plan.refused
                    else {"type": "output_text", "text": text, "annotations": []})  # fmt: skip
            output.append({"id": f"msg_{rid}", "type": "message", "status": "completed",
                           "role": "assistant", "content": [part]})  # fmt: skip
        elif plan.custom:
            output.append({"id": f"ctc_{rid}", "type": "custom_tool_call", "status": "completed",
                           "call_id": f"call_{rid}", "name": plan.tool, "input": text})
        else:
            output.append({"id": f"fc_{rid}", "type": "function_call", "status": "completed",
                           "call_id": f"call_{rid}", "name": plan.tool,
                           "arguments": orjson.dumps({"text": text}).decode()})  # fmt: skip
    n, prompt = len(plan.words), plan.prompt_tokens
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": plan.cached},
             "output_tokens": n, "output_tokens_details": {"reasoning_tokens": plan.thinking},
             "total_tokens": prompt + n}  # fmt: skip
    if plan.finish == "length":
        return _envelope(plan, rid, created, "incomplete", output, usage,
                         incomplete_details={"reason": "max_output_tokens"})  # fmt: skip
    return _envelope(plan, rid, created, "completed", output, usage)


def _envelope(plan: Plan, rid: str, created: int, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, **extra: object) -> dict[str, Any]:  # fmt: skip
    """A response object with this status, output and usage."""
    return {"id": f"resp_{rid}", "object": "response", "created_at": created, "status": status,
            "model": plan.model, "output": output, "usage": usage, **extra}  # fmt: skip


def _response_frames(plan: Plan, rid: str, created: int) -> ResponseFrames:
    """The events of a Responses stream, numbered in order; see `ResponseFrames`."""
    final = _response(plan, rid, created)
    output, thinking, event = final["output"], plan.thinking, _Events()
    start = _envelope(plan, rid, created, "in_progress", [], None)
    role = event("response.created", response=start) + event("response.in_progress",
                                                              response=start)  # fmt: skip
    think, think_seq, middle = b"", 0, b""
    if thinking:
        item = output[0]
        role += event("response.output_item.added", output_index=0,
                      item={"id": item["id"], "type": "reasoning", "summary": []})  # fmt: skip
        if plan.summary:  # as OpenAI shows a model's thought: a summary, part by part
            ids = {"item_id": item["id"], "output_index": 0, "summary_index": 0}
            part = item["summary"][0]
            role += event("response.reasoning_summary_part.added", **ids,
                          part={**part, "text": ""})  # fmt: skip
            think = _token_event("response.reasoning_summary_text.delta", ids, b'"}')
            think_seq = event.skip(thinking)
            middle = (event("response.reasoning_summary_text.done", **ids, text=part["text"])
                      + event("response.reasoning_summary_part.done", **ids, part=part))
        else:  # as vLLM shows it: the thought itself
            think = _token_event("response.reasoning_text.delta", {"item_id": item["id"],
                                 "output_index": 0, "content_index": 0}, b'"}')  # fmt: skip
            think_seq = event.skip(thinking)
        middle += event("response.output_item.done", output_index=0, item=item)
    answer, answer_seq, closer = b"", 0, middle  # without an answer, the reasoning ends it
    if len(plan.words) > thinking:
        k = len(output) - 1
        events = (_message_events if plan.tool is None
                  else _custom_events if plan.custom else _call_events)  # fmt: skip
        opener, answer, first, closer = events(event, output[k], k, len(plan.words) - thinking)
        answer_seq = first - thinking
        if thinking:
            middle += opener
        else:
            role += opener
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    # A function's arguments are JSON inside a JSON string; a custom tool's input is text.
    words = _ARGUMENT_WORDS if plan.tool is not None and not plan.custom else _JSON_WORDS
    return ResponseFrames(role, closer + event(kind, response=final), think, answer,
                          _JSON_WORDS[plan.text], words[plan.text], thinking, middle, think_seq,
                          answer_seq)  # fmt: skip


_Opened = tuple[bytes, bytes, int, bytes]
"""An answer item's events: its start, its token template, its first token's sequence number
and its end."""


def _message_events(event: _Events, item: dict[str, Any], k: int, n: int) -> _Opened:
    """A message's events at output index k, with n text deltas (refusal deltas, when its part
    is a refusal)."""
    ids = {"item_id": item["id"], "output_index": k, "content_index": 0}
    part = item["content"][0]
    refused = part["type"] == "refusal"
    field = "refusal" if refused else "text"
    opener = event("response.output_item.added", output_index=k,
                   item={**item, "status": "in_progress", "content": []}) + event(
        "response.content_part.added", **ids, part={**part, field: ""})  # fmt: skip
    first = event.skip(n)
    if refused:
        template = _token_event("response.refusal.delta", ids, b'"}')
        done = event("response.refusal.done", **ids, refusal=part[field])
    else:
        template = _token_event("response.output_text.delta", ids, b'","logprobs":[]}')
        done = event("response.output_text.done", **ids, text=part[field], logprobs=[])
    closer = (done + event("response.content_part.done", **ids, part=part)
              + event("response.output_item.done", output_index=k, item=item))  # fmt: skip
    return opener, template, first, closer


def _call_events(event: _Events, item: dict[str, Any], k: int, n: int) -> _Opened:
    """A function call's events at output index k: its arguments {"text": ...} in pieces, the
    opening and closing ones framing the n pieces of words."""
    ids = {"item_id": item["id"], "output_index": k}
    delta = "response.function_call_arguments.delta"
    opener = event("response.output_item.added", output_index=k,
                   item={**item, "status": "in_progress", "arguments": ""}) + event(
        delta, **ids, delta='{"text":"')  # fmt: skip
    template = _token_event(delta, ids, b'"}')
    first = event.skip(n)
    closer = (event(delta, **ids, delta='"}')
              + event("response.function_call_arguments.done", **ids, arguments=item["arguments"])
              + event("response.output_item.done", output_index=k, item=item))  # fmt: skip
    return opener, template, first, closer


def _custom_events(event: _Events, item: dict[str, Any], k: int, n: int) -> _Opened:
    """A custom tool's call at output index k: its input (free text) in n pieces."""
    ids = {"item_id": item["id"], "output_index": k}
    opener = event("response.output_item.added", output_index=k,
                   item={**item, "status": "in_progress", "input": ""})  # fmt: skip
    template = _token_event("response.custom_tool_call_input.delta", ids, b'"}')
    first = event.skip(n)
    closer = (event("response.custom_tool_call_input.done", **ids, input=item["input"])
              + event("response.output_item.done", output_index=k, item=item))  # fmt: skip
    return opener, template, first, closer
