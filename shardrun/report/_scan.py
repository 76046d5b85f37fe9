"""Stream one event file: hash every byte, check its checkpoints, parse lines, feed a fold.

The file is read in large chunks cut at the last newline. Per chunk, checkpoint lines are found
by a byte search and checked against the running SHA-256 and line count (DESIGN §5); the other
lines are parsed with orjson and handed to the fold's handler for their event. Bytes after the
last newline are a torn line (a crash, or a writer still running): hashed, reported, not parsed.
A line that is not valid JSON, has no number `t` (every event has one) or lacks a field its
event needs is counted with its line number, never fatal. Checkpoint lines themselves are also
fed to the fold.

With `wanted`, lines of other events are skipped before parsing when a cheap look at the bytes
after `"ev":"` names an event outside `wanted` (lines that do not look as expected are parsed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import orjson

from shardrun.event_names import ALL_EVENTS

CHUNK = 8 << 20
CHECKPOINT_MARK = b'"ev":"checkpoint"'
EV_MARK = b'"ev":"'
SNIFF = 16
MAX_LISTED_BAD = 5
NUMBER = (int, float)  # what every event's `t` must be (not bool, not a string)

Handler = Callable[[Mapping[str, Any], bytes], None]


class ChunkFolder(Protocol):
    """A fold that reads whole chunks of lines itself (the C fold, `aggregate._fast`).

    `body` returns the chunk's line count and, for each line holding `CHECKPOINT_MARK`, its
    index in the chunk and its start and end offsets: so the reader need not search the bytes
    again for lines to check.
    """

    def body(self, chunk: bytes | memoryview) -> tuple[int, list[tuple[int, int, int]]]: ...

    @property
    def unknown_events(self) -> int: ...


@dataclass(slots=True)
class FileScan:
    """What reading one file found out about its bytes (not its events)."""

    path: str
    bytes: int = 0
    lines: int = 0
    sha256: str = ""
    torn_tail_bytes: int = 0
    bad_lines: int = 0
    first_bad: list[str] = field(default_factory=list)
    unknown_events: int = 0
    checkpoints: int = 0
    covered_lines: int = 0
    covered_bytes: int = 0
    checkpoint_error: str | None = None

    def bad(self, lineno: int, why: str) -> None:
        self.bad_lines += 1
        if len(self.first_bad) < MAX_LISTED_BAD:
            self.first_bad.append(f"line {lineno}: {why}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "bytes": self.bytes, "lines": self.lines, "sha256": self.sha256,
            "torn_tail_bytes": self.torn_tail_bytes, "bad_lines": self.bad_lines,
            "first_bad": self.first_bad, "unknown_events": self.unknown_events,
            "checkpoints": self.checkpoints, "covered_lines": self.covered_lines,
            "covered_bytes": self.covered_bytes, "checkpoint_error": self.checkpoint_error,
        }  # fmt: skip


class _Hasher:
    """The running SHA-256 and line count, checked at every checkpoint line."""

    def __init__(self, scan: FileScan) -> None:
        self.scan = scan
        self.sha = hashlib.sha256()
        self.broken = False

    def body(self, body: bytes, base_lines: int, base_bytes: int) -> None:
        pos = 0
        lines = base_lines
        view = memoryview(body)
        at = body.find(CHECKPOINT_MARK)
        while at >= 0:
            start = body.rfind(b"\n", 0, at) + 1
            end = body.index(b"\n", at)
            self.sha.update(view[pos:start])
            lines += body.count(b"\n", pos, start)
            pos = start
            self._check(body[start:end], lines, base_bytes + start)
            at = body.find(CHECKPOINT_MARK, end)
        self.sha.update(view[pos:])

    def marked(self, body: bytes | memoryview, marks: list[tuple[int, int, int]],
               base_lines: int, base_bytes: int) -> None:
        """`body` with its checkpoint lines already found: (line index, start, end) each."""
        pos = 0
        view = memoryview(body)
        for index, start, end in marks:
            self.sha.update(view[pos:start])
            pos = start
            self._check(view[start:end], base_lines + index, base_bytes + start)
        self.sha.update(view[pos:])

    def _check(self, line: bytes | memoryview, lines_before: int, bytes_before: int) -> None:
        try:
            rec = orjson.loads(line)
            claimed_lines, claimed_sha = rec["lines"], rec["sha256"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            claimed_lines = claimed_sha = None
        if type(claimed_lines) is not int or not isinstance(claimed_sha, str):
            self._fail(f"line {lines_before + 1}: checkpoint line is not a valid checkpoint")
            return
        if self.broken:
            return
        actual = self.sha.hexdigest()
        prev = self.scan.covered_lines
        if claimed_lines != lines_before:
            what = "deleted" if claimed_lines > lines_before else "added"
            self._fail(f"line {lines_before + 1}: checkpoint counts {claimed_lines} lines before "
                       f"it but the file has {lines_before}: a line was {what} between line "
                       f"{prev + 1} and line {lines_before + 1}")
        elif claimed_sha != actual and bytes(line[-1:]) == b"\r":
            # The log writes none: a copy turned each newline into CR LF (Windows, autocrlf).
            self._fail(f"line {lines_before + 1}: checkpoint SHA-256 {claimed_sha[:12]}… does "
                       "not match the bytes before it, whose lines end in CR LF where the log "
                       "wrote LF: a copy converted its line endings (a Windows copy, git's "
                       "autocrlf); copy it again byte for byte, or strip the CRs (tr -d "
                       "'\\r' < FILE > FILE.lf && mv FILE.lf FILE)")
        elif claimed_sha != actual:
            self._fail(f"line {lines_before + 1}: checkpoint SHA-256 {claimed_sha[:12]}… does "
                       f"not match the bytes before it ({actual[:12]}…): a byte changed "
                       f"between line {prev + 1} and line {lines_before + 1}")
        else:
            self.scan.checkpoints += 1
            self.scan.covered_lines = lines_before + 1  # the checkpoint line vouches for them
            self.scan.covered_bytes = bytes_before + len(line) + 1

    def _fail(self, why: str) -> None:
        if self.scan.checkpoint_error is None:
            self.scan.checkpoint_error = why
        self.broken = True


def scan_file(path: Path, rel: str, handlers: Mapping[str, Handler] | None,
              wanted: frozenset[str] | None = None, folder: ChunkFolder | None = None) -> FileScan:
    """Read `path` once, feeding its records to `handlers` (event name -> handler); with None,
    parse no line: only hash the file, count its lines and check its checkpoints.

    With `folder`, each chunk's complete lines go to `folder.body` instead (its exceptions
    propagate: the C fold's `Fallback` means "fold this file in Python").
    """
    scan = FileScan(rel)
    hasher = _Hasher(scan)
    feeder = None if handlers is None else _Feeder(scan, handlers, wanted)

    def take(body: bytes | memoryview) -> None:
        if folder is not None:
            lines, marks = folder.body(body)
            hasher.marked(body, marks, scan.lines, scan.bytes)
        else:
            body = bytes(body)
            hasher.body(body, scan.lines, scan.bytes)
            if feeder is not None:
                feeder.body(body)
            lines = body.count(b"\n")
        scan.lines += lines
        scan.bytes += len(body)

    tail: list[bytes] = []
    with open(path, "rb") as f:
        for body in _whole_lines(f, tail):
            take(body)
    carry = tail[0]
    hasher.sha.update(carry)
    scan.bytes += len(carry)
    scan.torn_tail_bytes = len(carry)
    scan.sha256 = hasher.sha.hexdigest()
    if folder is not None:
        scan.unknown_events += folder.unknown_events
    return scan


def _whole_lines(f: BinaryIO, tail: list[bytes]) -> Iterator[bytes | memoryview]:
    """The file's complete lines, a chunk at a time, without copying chunks; `tail` gets the
    bytes after the last newline (a torn line)."""
    carry = b""
    while block := f.read(CHUNK):
        start = 0
        if carry:
            nl = block.find(b"\n")
            if nl < 0:
                carry += block
                continue
            yield carry + block[:nl + 1]  # the line that straddles two chunks
            start = nl + 1
        cut = block.rfind(b"\n") + 1
        if cut > start:
            yield memoryview(block)[start:cut]
            carry = block[cut:]
        else:
            carry = block[start:]
    tail.append(carry)


class _Feeder:
    """Parses lines and dispatches them to the fold's handlers."""

    def __init__(self, scan: FileScan, handlers: Mapping[str, Handler],
                 wanted: frozenset[str] | None) -> None:
        self.scan = scan
        self.handlers = handlers
        self.skip: dict[bytes, str] = {}
        self.offset = -1
        self.wanted = wanted

    def _learn(self, first: bytes, wanted: frozenset[str]) -> None:
        """Where `"ev":"` sits in this file's lines, and which sniffed keys to skip."""
        self.offset = first.find(EV_MARK)
        for name in ALL_EVENTS - wanted:
            self.skip[(EV_MARK + name.encode() + b'","t":')[:SNIFF]] = name

    def body(self, body: bytes) -> None:
        lines = body.split(b"\n")
        lines.pop()
        if self.wanted is not None and self.offset < 0 and lines:
            self._learn(lines[0], self.wanted)
        if self.skip and self.offset >= 0:
            self._sparse(lines)
        else:
            self._dense(lines, self.scan.lines)

    def _dense(self, lines: list[bytes], base: int) -> None:
        loads, get, scan = orjson.loads, self.handlers.get, self.scan
        for i, line in enumerate(lines):
            try:
                rec = loads(line)
                if type(rec["t"]) not in NUMBER:
                    raise TypeError("its t is not a number")
                handler = get(rec["ev"])
                if handler is None:
                    scan.unknown_events += 1
                else:
                    handler(rec, line)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError,
                    AttributeError) as exc:
                scan.bad(base + i + 1, _why(line, exc))

    def _sparse(self, lines: list[bytes]) -> None:
        k, skip, base = self.offset, self.skip, self.scan.lines
        loads, get, scan = orjson.loads, self.handlers.get, self.scan
        for i, line in enumerate(lines):
            if line[k:k + SNIFF] in skip:
                continue
            try:
                rec = loads(line)
                if type(rec["t"]) not in NUMBER:
                    raise TypeError("its t is not a number")
                handler = get(rec["ev"])
                if handler is not None:
                    handler(rec, line)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError,
                    AttributeError) as exc:
                scan.bad(base + i + 1, _why(line, exc))


def _why(line: bytes, exc: Exception) -> str:
    if isinstance(exc, orjson.JSONDecodeError):
        return "not valid JSON" if line.strip() else "empty line"
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    return f"malformed event ({type(exc).__name__}: {exc})"
