"""The shape check of a chat message list an input record gives (`input.messages_field`).

A list no OpenAI-compatible server takes would be sent anyway and fail there, a request and an
attempt per item; checked here, it is a reject at read time with a reason naming the entry,
as the server would (`messages[1] has no role`). The check is the API's own outline and no
more: keys it does not look at (`name`, `tool_call_id`, `tool_calls`...) pass as they are, and
so does any role a server may know (vLLM takes `ipython` for Llama tool results, `developer`).
"""

from __future__ import annotations

from typing import Any

from shardrun._ellipsis import json_kind

__all__ = ["CONTENT_OPTIONAL", "messages_problem"]

CONTENT_OPTIONAL = ("assistant", "tool", "function")
"""The roles whose content may be null or left out: an assistant message that calls a tool or
carries only its reasoning (`reasoning_content`), a tool or function result with no text."""


def messages_problem(messages: list[Any], field: str, other_items: bool = False) -> str | None:
    """What is wrong with a non-empty message list, as a reject's reason, or None.

    Each entry must be an object with a non-empty string `role` and a `content` that is a string
    or a non-empty list of parts, each an object with a string `type` (a `text` part's `text` a
    string); an assistant, tool or function message may leave its content out or null. With
    `other_items` (the Responses API's input list) an entry whose `type` is another than
    "message" is an item of that type (`function_call`, `function_call_output`, `reasoning`...),
    with no role: only its being an object is checked."""
    for index, message in enumerate(messages):
        where = f"{field}[{index}]"
        if not isinstance(message, dict):
            return f"{where} is {json_kind(message)}, not an object with a role and a content"
        if other_items and isinstance(message.get("type"), str) and message["type"] != "message":
            continue
        role = message.get("role")
        if role is None:
            return f"{where} has no role"
        if not isinstance(role, str):
            return f"{where} role is {json_kind(role)}, not a string"
        if not role:
            return f"{where} role is empty"
        if problem := _content_problem(message, role):
            return f"{where} {problem}"
    return None


def _content_problem(message: dict[str, Any], role: str) -> str | None:
    content = message.get("content")
    if content is None:
        if role in CONTENT_OPTIONAL:
            return None
        return "has no content" if "content" not in message else "content is null"
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"content is {json_kind(content)}, not a string or a list of parts"
    if not content:
        return "content is an empty list"
    for index, part in enumerate(content):
        if not isinstance(part, dict):
            return f"content[{index}] is {json_kind(part)}, not an object with a type"
        kind = part.get("type")
        if not isinstance(kind, str):
            return f"content[{index}] has no type" if kind is None else (
                f"content[{index}] type is {json_kind(kind)}, not a string")
        if kind == "text" and not isinstance(part.get("text"), str):
            return f"content[{index}] is a text part without a string 'text'"
    return None
