"""What a shard does with an item: the request body it sends, and what the prompt weighs.

Item shapes (made by `inputs`, sent by the coordinator in `items` messages):

    {"id", "prompt": str}                 chat: one user message; completions and
                                          responses: the prompt (responses: as `input`)
    {"id", "messages": [...]}             chat, and responses (as `input`)
    {"id", "body": {...}, "url": str}     an OpenAI Batch line: its own body; url picks the API

Pure functions, importable by a shard without the input readers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import orjson

__all__ = ["API_PATHS", "BATCH_URLS", "CHARS_PER_TOKEN", "build_request",
           "estimate_prompt_tokens", "prompt_chars", "tokens_of_chars"]  # fmt: skip

Api = Literal["chat", "completions", "responses"]

API_PATHS: Mapping[Api, str] = {"chat": "/chat/completions", "completions": "/completions",
                                "responses": "/responses"}  # fmt: skip
"""Where each API is, under the base URL."""
BATCH_URLS: Mapping[str, Api] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}
CHARS_PER_TOKEN = 4
"""The prompt-token estimate used before a server has counted: characters / 4."""
PART_TOKENS = 1_000
"""The prompt tokens a message part that is not text (an image, audio, a file) is estimated at:
its size as text is no measure of them (a 300 KB image as a base64 data URL is 100,000 tokens by
characters / 4, where OpenAI charges a 1024x1024 image 765 at high detail and vLLM's vision
models several hundred to a few thousand), and `rate_limits.tpm` paced every such request by it."""

_CHAT_LIMITS = ("max_tokens", "max_completion_tokens")
# Every name a request body gives its token limit by: chat and completions, then Responses.
TOKEN_LIMITS = (*_CHAT_LIMITS, "max_output_tokens")


def _token_limit_for(api: Api, params: Mapping[str, Any],
                     body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The job's params for one line of a Batch file, their token limit under the name that
    line's API takes: one file may mix chat and Responses lines, the Responses API refuses
    `max_tokens` (HTTP 400) and the others do not know `max_output_tokens`. A line that sets
    a limit of its own gets none from the job (o-series models refuse `max_tokens` beside
    their `max_completion_tokens`)."""
    if any(name in body for name in TOKEN_LIMITS):
        return {k: v for k, v in params.items() if k not in TOKEN_LIMITS}
    if api == "responses":
        if not any(name in params for name in _CHAT_LIMITS):
            return params
        out = {k: v for k, v in params.items() if k not in _CHAT_LIMITS}
        out.setdefault("max_output_tokens",
                       params.get("max_tokens", params.get("max_completion_tokens")))
        return out
    if "max_output_tokens" not in params:
        return params
    out = dict(params)
    limit = out.pop("max_output_tokens")
    if not any(name in out for name in _CHAT_LIMITS):
        out["max_tokens"] = limit
    return out


def build_request(
    item: Mapping[str, Any],
    *,
    model: str,
    params: Mapping[str, Any],
    api: Api,
    stream_usage: bool = True,
) -> tuple[Api, dict[str, Any]]:
    """The API to call and the streaming request body for one item of any shape.

    A body item keeps its own body and names its API by its url; the job's `params` only fill
    keys the body lacks, and `model` only when the body names none. Every body streams,
    whatever the line said about `stream`; with `stream_usage` a chat or completions body also
    asks for usage (`stream_options.include_usage`), which servers that predate that option
    refuse, so without it any `stream_options` the body has go as they are. The Responses API
    sends usage in its last event unasked, and takes the prompt or messages as `input`.
    """
    if "body" in item:
        api = BATCH_URLS.get(str(item.get("url")), api)
        body: dict[str, Any] = {**_token_limit_for(api, params, item["body"]), **item["body"]}
        if not body.get("model"):
            body["model"] = model
    else:
        body = {"model": model, **params}
        if api == "responses":
            body["input"] = item.get("messages", item.get("prompt"))
        elif "messages" in item:
            body["messages"] = item["messages"]
        elif api == "completions":
            body["prompt"] = item["prompt"]
        else:
            body["messages"] = [{"role": "user", "content": item["prompt"]}]
    body["stream"] = True
    if stream_usage and api != "responses":
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                  "include_usage": True}  # fmt: skip
    return api, body


def prompt_chars(item: Mapping[str, Any]) -> int:
    """Characters of prompt text an item sends (message contents, or the prompt; a Responses
    body's `input` is either): of a content list, its text parts' texts, and `PART_TOKENS` for
    each other part (an image)."""
    source: Any = item.get("body", item)
    prompt, messages = source.get("prompt"), source.get("messages")
    if isinstance(given := source.get("input"), list):
        messages = given
    elif given is not None:
        prompt = given
    if prompt is not None:
        return len(prompt) if isinstance(prompt, str) else len(orjson.dumps(prompt))
    total = 0
    for message in messages or ():
        content = message.get("content", "") if isinstance(message, dict) else ""
        if isinstance(content, list):
            total += sum(_part_chars(part) for part in content)
        else:
            total += len(content) if isinstance(content, str) else len(orjson.dumps(content))
    return total


def _part_chars(part: Any) -> int:
    """A content part's characters: a text part's text, any other part `PART_TOKENS`' worth."""
    text = part.get("text") if isinstance(part, dict) else None
    return len(text) if isinstance(text, str) else PART_TOKENS * CHARS_PER_TOKEN


def estimate_prompt_tokens(item: Mapping[str, Any]) -> int:
    """Prompt tokens before the server counts them: characters / 4, rounded up."""
    return tokens_of_chars(prompt_chars(item))


def tokens_of_chars(chars: int) -> int:
    """The prompt-token estimate for `chars` characters of prompt (when they are known)."""
    return math.ceil(chars / CHARS_PER_TOKEN)
