"""The bytes of an answer: prebuilt SSE templates of a stream, or one JSON body.

Built once per request from its `Plan`; token events are joined from the templates per write,
so a stream costs one join and one write per wake, never JSON encoding per token: each word's
bytes inside a JSON string (escaped when the text is prose) are tabled once, at import.
"""

from __future__ import annotations

from typing import NamedTuple

import orjson

from shardrun.sim.config import TEXT_WORDS, Plan

__all__ = ["OBJECT", "Frames", "render_full", "render_stream"]


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
          "completions": (b"text_completion", "text_completion", "cmpl")}  # fmt: skip


def _usage(plan: Plan) -> dict[str, int]:
    """The OpenAI usage object; prompt tokens are the plan's cheap estimate."""
    n = len(plan.words)
    return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": n,
            "total_tokens": plan.prompt_tokens + n}  # fmt: skip


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


def render_stream(plan: Plan, rid: str, created: int) -> Frames:
    """The byte templates of a streamed answer; token events are built lazily, per write."""
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
        opener = pre + b'"delta":{"tool_calls":[{"index":0,"id":"call_%b","type":"function",' \
            b'"function":{"name":%b,"arguments":"{\\"text\\":\\""}}]},' % (
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
        return Frames(pre + b'"delta":{"role":"assistant","content":""},' + end,
                      pre + b'"delta":{"content":"', b'"},' + end,
                      pre + b'"delta":{},' + finish + usage + _DONE, table,
                      plan.thinking, *_thought_frames(pre, end), b"", table)  # fmt: skip
    return Frames(b"", pre + b'"text":"', b'",' + end, pre + b'"text":"",' + finish + usage + _DONE,
                  table)  # fmt: skip


def _thought_frames(pre: bytes, end: bytes) -> tuple[bytes, bytes]:
    """Head and tail of a reasoning token's event."""
    return pre + b'"delta":{"reasoning_content":"', b'"},' + end


def render_full(plan: Plan, rid: str, created: int) -> bytes:
    """A complete non-streaming chat.completion or text_completion JSON body."""
    texts = TEXT_WORDS[plan.text]
    thought = "".join(texts[i] for i in plan.words[: plan.thinking])
    text = "".join(texts[i] for i in plan.words[plan.thinking :])
    choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": plan.finish}
    if plan.kind == "chat":
        message: dict[str, object] = {"role": "assistant", "content": text}
        if plan.thinking:
            message["reasoning_content"] = thought
        if plan.tool is not None:
            arguments = orjson.dumps({"text": text}).decode()
            message.update(content=None, tool_calls=[{
                "id": f"call_{rid}", "type": "function",
                "function": {"name": plan.tool, "arguments": arguments}}])  # fmt: skip
        choice["message"] = message
    else:
        choice["text"] = text
    return orjson.dumps({"id": rid, "object": OBJECT[plan.kind][1], "created": created,
                         "model": plan.model, "choices": [choice], "usage": _usage(plan)})
