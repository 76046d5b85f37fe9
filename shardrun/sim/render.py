"""The bytes of an answer: prebuilt SSE templates of a stream, or one JSON body.

Built once per request from its `Plan`; token events are joined from the templates per write,
so a stream costs one join and one write per wake, never JSON encoding per token.
"""

from __future__ import annotations

from typing import NamedTuple

import orjson

from shardrun.sim.config import WORDS, Plan

__all__ = ["OBJECT", "Frames", "render_full", "render_stream"]

_DONE = b"data: [DONE]\n\n"
OBJECT = {"chat": (b"chat.completion.chunk", "chat.completion", "chatcmpl"),
          "completions": (b"text_completion", "text_completion", "cmpl")}  # fmt: skip


def _usage(plan: Plan) -> dict[str, int]:
    """The OpenAI usage object; prompt tokens are the plan's cheap estimate."""
    n = len(plan.words)
    return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": n,
            "total_tokens": plan.prompt_tokens + n}  # fmt: skip


class Frames(NamedTuple):
    """Prebuilt SSE bytes of one stream; words are plain ASCII, so no JSON encoding per token."""

    role: bytes  # chat's first chunk (role "assistant"); b"" for completions
    head: bytes  # bytes of a token event before its word
    tail: bytes  # bytes of a token event after its word
    end: bytes  # finish chunk, usage chunk when asked for, then [DONE]

    def tokens(self, words: bytes) -> bytes:
        """The events of these tokens as one bytes object: one join per write, not per token."""
        return self.head + (self.tail + self.head).join([WORDS[i] for i in words]) + self.tail


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
    if plan.kind == "chat":
        return Frames(pre + b'"delta":{"role":"assistant","content":""},' + end,
                      pre + b'"delta":{"content":"', b'"},' + end,
                      pre + b'"delta":{},' + finish + usage + _DONE)  # fmt: skip
    return Frames(b"", pre + b'"text":"', b'",' + end, pre + b'"text":"",' + finish + usage + _DONE)


def render_full(plan: Plan, rid: str, created: int) -> bytes:
    """A complete non-streaming chat.completion or text_completion JSON body."""
    text = b"".join(WORDS[i] for i in plan.words).decode()
    choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": plan.finish}
    if plan.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return orjson.dumps({"id": rid, "object": OBJECT[plan.kind][1], "created": created,
                         "model": plan.model, "choices": [choice], "usage": _usage(plan)})
