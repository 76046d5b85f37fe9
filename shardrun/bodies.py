"""Request bodies: pure functions from an item to the JSON body of a streaming request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STREAMING = {"stream": True, "stream_options": {"include_usage": True}}


def base_body(model: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """What every request of a job shares: the model, the job's params, streaming with usage."""
    return {"model": model, **params, **STREAMING}


def request_body(base: Mapping[str, Any], item: Mapping[str, Any], api: str) -> dict[str, Any]:
    """The body for one item: `messages` for chat, `prompt` for completions.

    A plain prompt sent to the chat API becomes a single user message.
    """
    body = dict(base)
    if "messages" in item:
        body["messages"] = item["messages"]
    elif api == "completions":
        body["prompt"] = item["prompt"]
    else:
        body["messages"] = [{"role": "user", "content": item["prompt"]}]
    return body
