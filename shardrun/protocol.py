"""Messages between the coordinator and a shard: one orjson object per line on a pipe.

The transport is a byte stream so that any placement (local processes today, a remote engine
later) can carry it. The message table lives in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

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
