"""Reading back what a run already wrote: torn-line repair and the ids of finished items.

A process killed mid-write can leave a last line without its newline. Such a line is cut off
(its item has no complete line, so it is simply done again); every complete line stays.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from shardrun._ellipsis import counted
from shardrun.errors import RunError


def repair_torn_tail(path: Path) -> int:
    """Cut an unterminated last line off `path`; returns how many bytes were removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep = _last_newline_end(f, size)
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


def _last_newline_end(f: BinaryIO, size: int) -> int:
    """Offset just past the last newline (0 if none), reading backwards in blocks."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        f.seek(start)
        block = f.read(end - start)
        at = block.rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def line_ids(path: Path, *, whole_only: bool = False,
             bad: list[str] | None = None) -> Iterator[str]:
    """The `id` of every line of a results or dead-letter file (after repair; `whole_only`:
    before it, leaving out a last line without its line break; `bad`: as `line_records`)."""
    return (item_id for item_id, _ in line_records(path, whole_only=whole_only, bad=bad))


def line_records(path: Path, *, whole_only: bool = False,
                 bad: list[str] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(id, the line parsed) for every line of a results or dead-letter file (after repair).

    `whole_only`, for readers that do not repair (a running run's files, or a killed one's):
    a last line without its line break is one being written or cut, not an ending yet.
    A line that is no record fails the read, unless `bad` is given (a reader that only
    reports, and says so): then it is named there ('PATH line N') and passed over."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip() or (whole_only and not line.endswith(b"\n")):
                continue
            try:
                record = orjson.loads(line)
                item_id = str(record["id"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                if bad is not None:
                    bad.append(f"{path} line {number}")
                    continue
                raise RunError(
                    f"{path} line {number} is not a valid record; the run directory was "
                    "edited or damaged, so it cannot be resumed safely"
                ) from None
            yield item_id, record


def repair_run_files(run_path: Path) -> list[str]:
    """Repair every JSONL file of a run; returns one note per file that was cut."""
    notes = []
    # The rejects files too: a pass killed mid-write leaves a line no reader of them can parse.
    # Only files: something else in a rejects file's place is the pass's to meet when it writes
    # there (`WorkSource.reject`), as before these were repaired.
    files = [*sorted(p for p in run_path.glob("rejects*.jsonl") if p.is_file()),
             *(p for sub in ("results", "dead", "events")
               for p in sorted((run_path / sub).glob("*.jsonl")))]
    for path in files:
        if cut := repair_torn_tail(path):
            rel = path.relative_to(run_path)
            notes.append(f"{rel}: removed a torn last line ({counted(cut, 'byte')})")
    return notes
