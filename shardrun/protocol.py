"""Messages between the coordinator and a shard: one orjson object per line on a pipe.

The transport is a byte stream so that any placement (local processes today, a remote engine
later) can carry it. The message table lives in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

CONFIG = "config"
WANT = "want"
ITEMS = "items"
END = "end"
STOP = "stop"
ABORT = "abort"
PROGRESS = "progress"
FATAL = "fatal"
DONE = "done"
RATE = "rate"
ANSWERED = "answered"  # coordinator to shards: a request of the run has succeeded

Message = dict[str, Any]


def encode(message: Message) -> bytes:
    """One message as one line (orjson never emits a raw newline).

    orjson appends the newline itself: `dumps(...) + b"\\n"` would copy every batch of items
    once more.
    """
    return orjson.dumps(message, option=orjson.OPT_APPEND_NEWLINE)


def decode(line: bytes) -> Message:
    """Parse one line; a message is always a JSON object with a `t` field."""
    message = orjson.loads(line)
    if not isinstance(message, dict) or "t" not in message:
        raise ValueError(f"not a protocol message: {line[:80]!r}")
    return message


class CountChanges:
    """Counts by key that a shard keeps and reports as changes: the keys set since its last
    report with their new counts, and 0 for a key dropped since (`apply_changes` reads them).

    A progress report goes out 5 times a second, and the map can hold an entry for every slot
    (`tried` in a storm): sent whole, that is cap-many entries per report, per shard. A key set
    and dropped between two reports never reached the coordinator and is not sent at all.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._changed: dict[str, int] = {}
        self._unsent: set[str] = set()  # keys set since the last report, new to the receiver

    def set(self, key: str, count: int) -> None:
        """Set a key's count (at least 1: 0 on the wire means dropped)."""
        # New to the receiver, unless it was dropped since the last report (the receiver has
        # it still, and the 0 that would drop it is replaced by this count).
        if key not in self.counts and self._changed.get(key) != 0:
            self._unsent.add(key)
        self.counts[key] = self._changed[key] = count

    def drop(self, key: str) -> None:
        if self.counts.pop(key, None) is None:
            return
        if key in self._unsent:
            self._unsent.discard(key)
            del self._changed[key]
        else:
            self._changed[key] = 0

    def take_changes(self) -> dict[str, int]:
        """The changes since the last call, for the report about to be sent."""
        changes, self._changed = self._changed, {}
        self._unsent.clear()
        return changes


def apply_changes(counts: dict[str, int], changes: Mapping[str, int]) -> None:
    """Bring a copy of a shard's `CountChanges` up to date with one report's changes; applied
    report after report (a pipe loses none), it holds the shard's counts as of that report."""
    for key, count in changes.items():
        if count:
            counts[key] = count
        else:
            counts.pop(key, None)
