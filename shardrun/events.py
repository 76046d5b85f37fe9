"""The event log: event names, and a structlog writer rendering orjson lines to one file per shard.

The hot path is `EventLog.emit`, about five times per span. It goes through structlog (bound
context, processor chain, wrapped logger) with as little around it as structlog allows:

- the bound context is `run_id`, `shard` and a placeholder `ev`; `emit` sets `ev` on the call's
  own keyword dict and hands that dict straight to the bound logger's `_process_event`
  (structlog documents it as available to wrappers of their own), then the rendered line to
  the sink: no wrapper method of ours in between, a frame per event less. The only dict work
  per event is then structlog's own: copy the three-key context, merge the fields;
- the one processor renders with orjson and appends the newline itself;
- the wrapped logger is `_LineSink`: `msg` hashes the line and appends it to a list. structlog's
  `BytesLogger` would take a lock, copy the line to add the newline and call flush per line.
  The lines go to the file in `EventLog.flush()`, on a timer, as one write.

The sink keeps the running SHA-256 of every byte, which `checkpoint` lines carry (DESIGN §5): a
log cut short by a crash verifies up to its last checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, BinaryIO, cast

import orjson
import structlog

from shardrun.event_names import (
    ADMITTED,
    ALL_EVENTS,
    ATTEMPT_END,
    ATTEMPT_START,
    BATCH,
    CHECKPOINT,
    CONN_READY,
    FIRST_TOKEN,
    INPUT_END,
    LAST_TOKEN,
    LEGACY_ATTEMPT_EVENTS,
    LOOP_LAG,
    QUEUED,
    RATE_LEARNED,
    RATE_UNCAPPED,
    RATE_WAIT,
    RELEASED,
    RETRY,
    RUN_END,
    RUN_START,
    SHARD_END,
    SHARD_EXIT,
    SHARD_START,
)

# The event names are re-exported: writers spell them events.QUEUED and so on.
__all__ = [
    "ADMITTED",
    "ALL_EVENTS",
    "ATTEMPT_END",
    "ATTEMPT_START",
    "BATCH",
    "CHECKPOINT",
    "CONN_READY",
    "FIRST_TOKEN",
    "INPUT_END",
    "LAST_TOKEN",
    "LEGACY_ATTEMPT_EVENTS",
    "LOOP_LAG",
    "QUEUED",
    "RATE_LEARNED",
    "RATE_UNCAPPED",
    "RATE_WAIT",
    "RELEASED",
    "RETRY",
    "RUN_END",
    "RUN_START",
    "SHARD_END",
    "SHARD_EXIT",
    "SHARD_START",
    "EventLog",
    "JsonlWriter",
]


class _LineSink:
    """The logger structlog wraps: hashes each rendered line and keeps it until `take`."""

    __slots__ = ("_pending", "lines", "sha")

    def __init__(self) -> None:
        self._pending: list[bytes] = []
        self.sha = hashlib.sha256()
        self.lines = 0

    def resume(self, path: Path) -> int:
        """Continue the running hash over an existing file's lines (a resumed run appends)."""
        if path.exists():
            with open(path, "rb") as existing:
                for line in existing:
                    self.sha.update(line)
                    self.lines += 1
        return self.lines

    def msg(self, line: bytes) -> None:
        """One rendered line, newline included."""
        self.sha.update(line)
        self._pending.append(line)
        self.lines += 1

    def take(self) -> bytes:
        data = b"".join(self._pending)
        self._pending.clear()
        return data


def _render(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> bytes:
    return orjson.dumps(event_dict, option=orjson.OPT_APPEND_NEWLINE)


def _hand_to_os(file: BinaryIO, data: bytes | bytearray) -> None:
    """Write `data` (lines kept since the last flush) through to the OS, if there is any."""
    if data:
        file.write(data)
        file.flush()


class EventLog:
    """One shard's append-only event log."""

    def __init__(self, path: Path, *, run_id: str, shard: int | None) -> None:
        self.path = path
        self._sink = _LineSink()
        self._lines_at_checkpoint = self._sink.resume(path)
        self._file: BinaryIO = open(path, "ab")  # noqa: SIM115 - lives as long as the log
        logger = structlog.wrap_logger(
            self._sink,
            processors=[_render],
            wrapper_class=structlog.BoundLoggerBase,
            context_class=dict,
            cache_logger_on_first_use=True,
        ).bind(run_id=run_id, shard=shard, ev=None)
        # Merges the bound context with a call's fields and runs the processors; `_render`
        # makes the result one line of bytes, `((line,), {})`.
        self._process = cast(structlog.BoundLoggerBase, logger)._process_event
        self._msg = self._sink.msg

    def emit(self, ev: str, /, **fields: Any) -> None:
        """Append one event; `fields` must include `t` (anchored time).

        The line's keys come in a fixed order: `run_id`, `shard`, `ev`, then `fields` as given.
        `ev` is bound with the context as a placeholder so that it keeps its place there when
        structlog merges `fields` in: setting it on the call's own dict saves copying `fields`.
        """
        fields["ev"] = ev
        self._msg(self._process("msg", None, fields)[0][0])

    def checkpoint(self, t: float) -> None:
        """Record the running hash of every byte before this line, if anything was written."""
        sink = self._sink
        if sink.lines == self._lines_at_checkpoint:
            return
        self.emit(CHECKPOINT, t=t, lines=sink.lines, sha256=sink.sha.hexdigest())
        self._lines_at_checkpoint = sink.lines

    def flush(self) -> None:
        """Hand buffered lines to the OS."""
        _hand_to_os(self._file, self._sink.take())

    def sync(self) -> None:
        """Flush and fsync."""
        self.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        try:
            self.sync()
        finally:  # closed even when the disk is full (a failed flush raises here again)
            self._file.close()


class JsonlWriter:
    """Append-only JSON lines (results, dead letters), fsynced on demand.

    Lines stay in memory until `flush`, which hands them to the OS in one write, as the event
    log's do: a buffered file would write them whenever its buffer filled, and a shard killed
    then would leave result lines whose events it had not yet written (`ShardOutput.flush`
    writes the event log first).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # One growing buffer, as a buffered file has, rather than a list of the lines: each
        # line's bytes are freed at once (held for 0.2 s, a list of them cost 3 to 4 times as
        # much CPU per line in a micro-benchmark, in the allocator).
        self._pending = bytearray()
        self._file: BinaryIO = open(path, "ab")  # noqa: SIM115 - lives as long as the writer
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self._pending += orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        self.count += 1

    def flush(self) -> None:
        data, self._pending = self._pending, bytearray()
        _hand_to_os(self._file, data)

    def sync(self) -> None:
        self.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self.sync()
        self._file.close()
