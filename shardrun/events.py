"""The event log: event names, and a structlog writer rendering orjson lines to one file per shard.

structlog's `BytesLogger` writes and flushes every line. Flushing per line would cost a system
call per event on the hot path, so the logger writes into `_HashingSink`, an in-memory buffer
that also keeps the running SHA-256 of every byte, and `EventLog.flush()` hands the buffer to the
file on a timer. The running hash is what `checkpoint` lines carry (DESIGN §5): a log cut short
by a crash verifies up to its last checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import structlog

SHARD_START = "shard_start"
QUEUED = "queued"
ADMITTED = "admitted"
ATTEMPT_START = "attempt_start"
CONN_READY = "conn_ready"
FIRST_TOKEN = "first_token"
LAST_TOKEN = "last_token"
ATTEMPT_END = "attempt_end"
RETRY = "retry"
RATE_WAIT = "rate_wait"
RELEASED = "released"
LOOP_LAG = "loop_lag"
CHECKPOINT = "checkpoint"
SHARD_END = "shard_end"
# The coordinator's own log, events/coordinator.jsonl (`shard` is null there).
RUN_START = "run_start"
BATCH = "batch"
INPUT_END = "input_end"
SHARD_EXIT = "shard_exit"
RUN_END = "run_end"

ALL_EVENTS = frozenset(
    {
        SHARD_START,
        QUEUED,
        ADMITTED,
        ATTEMPT_START,
        CONN_READY,
        FIRST_TOKEN,
        LAST_TOKEN,
        ATTEMPT_END,
        RETRY,
        RATE_WAIT,
        RELEASED,
        LOOP_LAG,
        CHECKPOINT,
        SHARD_END,
        RUN_START,
        BATCH,
        INPUT_END,
        SHARD_EXIT,
        RUN_END,
    }
)


class _HashingSink:
    """A file-like target for structlog: buffers lines in memory and hashes every byte."""

    __slots__ = ("__weakref__", "_pending", "lines", "sha")

    def __init__(self) -> None:
        self._pending: list[bytes] = []
        self.sha = hashlib.sha256()
        self.lines = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self._pending.append(data)
        self.lines += 1
        return len(data)

    def flush(self) -> None:
        """Called by BytesLogger after every line: deliberately nothing (see module doc)."""

    def take(self) -> bytes:
        data = b"".join(self._pending)
        self._pending.clear()
        return data


def _render(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> bytes:
    return orjson.dumps(event_dict)


class EventLog:
    """One shard's append-only event log."""

    def __init__(self, path: Path, *, run_id: str, shard: int | None) -> None:
        self.path = path
        self._sink = _HashingSink()
        existing = _prime_hash(path, self._sink)
        self._file: BinaryIO = open(path, "ab")  # noqa: SIM115 - lives as long as the log
        self._lines_at_checkpoint = existing
        self._log = structlog.wrap_logger(
            structlog.BytesLogger(self._sink),  # type: ignore[arg-type]
            processors=[_render],
            wrapper_class=structlog.BoundLogger,
            context_class=dict,
        ).bind(run_id=run_id, shard=shard)

    def emit(self, ev: str, **fields: Any) -> None:
        """Append one event; `fields` must include `t` (anchored time)."""
        self._log.msg(None, ev=ev, **fields)

    def checkpoint(self, t: float) -> None:
        """Record the running hash of every byte before this line, if anything was written."""
        if self._sink.lines == self._lines_at_checkpoint:
            return
        self.emit(CHECKPOINT, t=t, lines=self._sink.lines, sha256=self._sink.sha.hexdigest())
        self._lines_at_checkpoint = self._sink.lines

    def flush(self) -> None:
        """Hand buffered lines to the OS."""
        data = self._sink.take()
        if data:
            self._file.write(data)
            self._file.flush()

    def sync(self) -> None:
        """Flush and fsync."""
        self.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self.sync()
        self._file.close()


def _prime_hash(path: Path, sink: _HashingSink) -> int:
    """Continue the running hash over an existing file's bytes (a resumed run appends)."""
    if not path.exists():
        return 0
    with open(path, "rb") as existing:
        for line in existing:
            sink.sha.update(line)
            sink.lines += 1
    return sink.lines


class JsonlWriter:
    """Append-only JSON lines (results, dead letters): buffered, flushed and fsynced on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = open(path, "ab", buffering=1 << 16)  # noqa: SIM115
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(orjson.dumps(record) + b"\n")
        self.count += 1

    def flush(self) -> None:
        self._file.flush()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self.sync()
        self._file.close()
