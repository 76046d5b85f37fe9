"""A value in a one-line message: cut down to a length, named by its JSON kind, or counted with
its noun in the number that fits."""

from __future__ import annotations


def ellipsize(text: str, limit: int) -> str:
    """`text` if it fits in `limit` characters, else its start and "..." in exactly `limit`."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_kind(value: object) -> str:
    """What a JSON value is, for a sentence: 'null', 'true', 'a number', 'a string', 'a list'..."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bytes):  # a Parquet BINARY column (no STRING annotation)
        return "binary data"
    return "an object" if isinstance(value, dict) else f"a {type(value).__name__}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 retry', '2 retries', '1,024 items': `n` with `noun`, or with `plural` (default: the
    noun and an s) unless `n` is 1."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def in_words(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c': names in a sentence."""
    return names[-1] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
