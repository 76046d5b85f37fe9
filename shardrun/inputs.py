"""Streams the input file into items without holding it in memory.

An item is `{"id": ..., "prompt": str}` or `{"id": ..., "messages": [...]}`: exactly what the
coordinator sends a shard. A line that cannot become an item is a `Reject` with its line number
and reason; the caller decides whether that is fatal (`--strict`) or a line in rejects.jsonl.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shardrun.errors import InputError


@dataclass(frozen=True, slots=True)
class Reject:
    """An input line that did not become an item."""

    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class FieldMap:
    """Which fields of an input record hold the id and the prompt or messages."""

    id_field: str
    prompt_field: str | None
    messages_field: str | None


class InputReader:
    """Iterates items and rejects of a JSONL file, hashing every byte read on the way.

    The hash and byte count go into the manifest, so a published figure names the exact input.
    """

    def __init__(self, path: Path, fields: FieldMap) -> None:
        self.path = path
        self.fields = fields
        self.sha = hashlib.sha256()
        self.bytes_read = 0
        self.lines_read = 0
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - closed by close() or exhaustion
        except FileNotFoundError:
            raise InputError(
                f"input file {path} does not exist; check input.path in the job file"
            ) from None
        except OSError as exc:
            raise InputError(f"cannot open input file {path}: {exc.strerror}") from None

    def __iter__(self) -> Iterator[dict[str, Any] | Reject]:
        with self._file:
            for raw in self._file:
                self.sha.update(raw)
                self.bytes_read += len(raw)
                self.lines_read += 1
                if raw.strip():
                    yield parse_line(raw, self.lines_read, self.fields)

    def close(self) -> None:
        self._file.close()


def parse_line(raw: bytes, line_no: int, fields: FieldMap) -> dict[str, Any] | Reject:
    """One JSONL line to an item, or a Reject saying why not."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Reject(line_no, f"not valid JSON ({exc.msg})")
    if not isinstance(record, dict):
        return Reject(line_no, f"expected a JSON object, got {type(record).__name__}")
    if fields.messages_field is not None:
        return _messages_item(record, raw, line_no, fields.messages_field, fields.id_field)
    assert fields.prompt_field is not None
    prompt = record.get(fields.prompt_field)
    if not isinstance(prompt, str):
        what = "missing" if prompt is None else f"a {type(prompt).__name__}, not a string"
        return Reject(line_no, f"prompt field '{fields.prompt_field}' is {what}")
    return {"id": _item_id(record, raw, fields.id_field), "prompt": prompt}


def _messages_item(
    record: dict[str, Any], raw: bytes, line_no: int, field: str, id_field: str
) -> dict[str, Any] | Reject:
    messages = record.get(field)
    if not isinstance(messages, list) or not messages:
        return Reject(line_no, f"messages field '{field}' must be a non-empty list")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            return Reject(line_no, f"every entry of '{field}' must be an object with a 'role'")
    return {"id": _item_id(record, raw, id_field), "messages": messages}


def _item_id(record: dict[str, Any], raw: bytes, id_field: str) -> str:
    """The input's own id as a string, or a content hash when the record has none."""
    value = record.get(id_field)
    if value is None or value == "":
        return "h" + hashlib.blake2b(raw.strip(), digest_size=10).hexdigest()
    return value if isinstance(value, str) else str(value)
