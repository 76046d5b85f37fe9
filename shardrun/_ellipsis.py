"""Cutting a value down for a one-line message."""

from __future__ import annotations


def ellipsize(text: str, limit: int) -> str:
    """`text` if it fits in `limit` characters, else its start and "..." in exactly `limit`."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
