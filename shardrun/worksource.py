"""Where shards' work comes from: the input, minus what is already done, plus re-queued items.

Items taken from a shard that died come back first. Duplicate ids and items finished by an
earlier pass of the run (resume) are skipped here, remembered as 8-byte digests in a flat
table (`DigestSet`), so that memory stays near 11-21 bytes per distinct id rather than the size
of the items.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from shardrun.digestset import DigestSet

if TYPE_CHECKING:
    # Imported where used instead: every shard imports this module (through resume.py, for
    # `id_digest`) but never reads input, and inputs.py brings csv and the tabular and
    # template parsers with it.
    from shardrun.inputs import InputReader, Reject


def id_digest(item_id: str) -> int:
    """A 64-bit digest of an item id (collisions are negligible below billions of ids)."""
    return int.from_bytes(hashlib.blake2b(item_id.encode(), digest_size=8).digest(), "little")


def duplicate_reason(item_id: str) -> str:
    return f"duplicate id {item_id!r} (an earlier line has it)"


class WorkSource:
    """Hands out items in input order, re-queued items first."""

    def __init__(self, reader: InputReader, rejects_path: Path,
                 done: DigestSet | None = None) -> None:
        self.reader = reader
        self._items: Iterator[dict[str, Any] | Reject] = iter(reader)
        self._requeued: deque[dict[str, Any]] = deque()
        self._seen = DigestSet()
        self._done = DigestSet() if done is None else done
        self._rejects_path = rejects_path
        self.on_input_end: Callable[[], None] | None = None  # called once, when input runs out
        self.exhausted = False
        self.taken = 0
        self.skipped = 0
        self.rejects = 0

    @property
    def rejects_path(self) -> Path:
        """Where this pass writes the input lines it sets aside."""
        return self._rejects_path

    @property
    def empty(self) -> bool:
        return self.exhausted and not self._requeued

    def take(self, n: int) -> list[dict[str, Any]]:
        """Up to `n` items; rejects go to rejects.jsonl on the way."""
        from shardrun.inputs import Reject

        batch: list[dict[str, Any]] = []
        while self._requeued and len(batch) < n:
            batch.append(self._requeued.popleft())
        if len(batch) >= n or self.exhausted:
            return batch
        for entry in self._items:
            if isinstance(entry, Reject):
                self.reject(entry)
                continue
            digest = id_digest(entry["id"])
            if not self._seen.add(digest):
                self.reject(Reject(self.reader.lines_read, duplicate_reason(entry["id"])))
                continue
            if digest in self._done:
                self.skipped += 1
                continue
            self.taken += 1
            batch.append(entry)
            if len(batch) >= n:
                return batch
        self.exhausted = True
        if self.on_input_end is not None:
            self.on_input_end()
        return batch

    def requeue(self, items: Iterable[dict[str, Any]]) -> None:
        """Give items back (their shard died before finishing them); served before new ones."""
        self._requeued.extend(items)

    def reject(self, reject: Reject) -> None:
        self.rejects += 1
        record = {"line": reject.line, "reason": reject.reason, "path": str(self.reader.path)}
        with open(self._rejects_path, "ab") as f:
            f.write(orjson.dumps(record) + b"\n")
