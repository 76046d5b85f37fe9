"""`shardrun export`: a run's answers as one file, one row per input record, in input order.

A run writes each answer where and when it finishes: a results file and a dead-letter file per
shard and segment, in completion order. Putting them back next to the input is the first thing
a user does with them, so `export` does it once and the same way every time. It reads the input
again with the job's own reader, set as the run's last pass was (`_run_plan`), so ids, rejected
lines and duplicate ids come out exactly as the run saw them, and writes for each record the
row of the line that ended it:

    status    where the row comes from
    ok        the item's result line: output, finish_reason, usage, attempts
    failed    its dead-letter line: error (the reason), attempts
    rejected  an input line the run set aside (not a record, no prompt, a duplicate id): error,
              and the id the line names when it names one
    pending   no line yet: the run was stopped before the item ended (resume finishes it)

Every row has the same keys, `line` (the record's line or row number in the input) first.
With `with_input`, a row also holds its input record, so the answers sit next to the rest of
the user's data: as `input` in a JSON line, and in CSV as one `input.NAME` column per column
of a CSV or Parquet input, or per top-level key of a JSON lines input's records (every key any
record has, in the order first seen: a pass over the input before the rows, since a CSV header
comes first; a record without a key has an empty cell there). A rejected line that is no record
(not JSON, too long, a CSV row of the wrong width or with a broken quote) has an empty input, as
it is no item of the run: its values are not laid out under the header's columns by guess (a
comma left unquoted would put each value after it under the wrong name), and the counts say how
many such rows there are.

The id -> (file, offset) index lives in a SQLite table in a temporary directory, and a row's
line is read back from its file when its record comes up; per record, memory holds only the
8-byte digest of its id (about 20 bytes in a `DigestSet`), which finds duplicate ids. Each file
is read back through the handle it was indexed from, kept open: a pass may run meanwhile (an
export of a run at work shows what is done so far), and a retry pass starting moves the
dead-letter files under dead/superseded-rK/, which an open handle still reads.
Before anything is written, the input's bytes are checked against the SHA-256 the manifest
recorded, because an input edited since the run would pair answers with the wrong lines.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import sqlite3
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, get_args

import orjson

from shardrun._ellipsis import ellipsize
from shardrun._template import TemplateError, parse_template
from shardrun.digestset import DigestSet
from shardrun.errors import RunError, SpecError
from shardrun.fdlimit import ensure_open_files
from shardrun.inputs import (
    BOM,
    InputPlan,
    InputReader,
    Reject,
    bounded_lines,
    decode_line,
)
from shardrun.manifest import (
    asked_otherwise,
    changed_results,
    file_digest,
    newest_job_path,
    newest_pass,
    pass_reads,
    prefix_digests,
    read_manifest,
    recorded_sources,
    run_on,
)
from shardrun.outpath import (
    cannot_write,
    check_not_read_back,
    check_output_file,
    replace_target,
)
from shardrun.resume import pass_of, set_aside_lines, setting_changes
from shardrun.ticker import Ticker
from shardrun.worksource import duplicate_reason, id_digest

if TYPE_CHECKING:
    from shardrun.spec import LoadedJob

__all__ = ["COLUMNS", "ExportSummary", "export", "format_of"]

Format = Literal["jsonl", "csv"]

COLUMNS = ("line", "id", "status", "output", "finish_reason", "prompt_tokens",
           "completion_tokens", "usage_estimated", "cached_tokens", "reasoning_tokens",
           "attempts", "error", "reasoning", "tool_calls", "refusal",
           "function_call")  # fmt: skip
"""CSV columns; a JSON line has the same values, with usage as one object (and tool calls as
a list, a call in the older `functions` form as an object, where CSV has their JSON text)."""

_WRITE_BLOCK = 1 << 16  # characters of CSV text per write


@dataclass
class ExportSummary:
    """What one export wrote and what it noticed on the way."""

    rows: int = 0
    ok: int = 0
    failed: int = 0
    rejected: int = 0
    pending: int = 0
    orphans: int = 0  # lines of the run whose id no input record has
    repeated: int = 0  # further lines for an id that already has one (the first one is kept)
    torn: int = 0  # lines cut short (a run still writing, or killed without a resume since)
    no_record: int = 0  # with the input shown: rejected lines with no record to show
    warnings: list[str] = field(default_factory=list)
    job_path: Path | None = None  # the job file whose input was read (for the hints)


# Suffixes of table formats export does not write: JSON lines under such a name would be a trap
# (a reader of `answers.parquet` fails on it, after an export that said it went well).
# A compressed file's name too (`answers.csv.gz`): export writes no compressed file, and its
# reader (pandas, zcat) would fail on the plain text, as a Parquet reader would.
_OTHER_FORMATS = {".parquet": "Parquet", ".pq": "Parquet", ".arrow": "Arrow",
                  ".feather": "Feather", ".xlsx": "Excel", ".xls": "Excel", ".tsv": "TSV",
                  ".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "Zstandard",
                  ".zip": "ZIP"}  # fmt: skip
_PIPED = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".zip": ""}
"""For a compressed file's name, the compressor standard output's export can go through (none
for a ZIP archive, which holds files)."""


def format_of(out: Path | None, given: str | None, run: Path | None = None) -> Format:
    """The output format: as given, else from the output's suffix (`.csv`), else JSON lines.
    `run`: the run directory, for the command a refusal names."""
    if given is not None:
        if given not in ("jsonl", "csv"):
            raise SpecError(f"--format {given}: use jsonl or csv")
        return "csv" if given == "csv" else "jsonl"
    suffix = "" if out is None else out.suffix.lower()
    if out is not None and suffix in _OTHER_FORMATS:
        # A compressed name given --format would hold plain text, the very trap refused here.
        csv = "--format csv " if out.stem.lower().endswith(".csv") else ""
        way = ("give --format to write one of them under this name" if suffix not in _PIPED
               else f"pipe standard output through {_PIPED[suffix]}: `shardrun export "
                    f"{run or 'RUN'} {csv}| {_PIPED[suffix]} > {out.name}`" if _PIPED[suffix]
               else "zip that file once it is written")
        raise SpecError(f"-o {out}: export writes JSON lines or CSV, not "
                        f"{_OTHER_FORMATS[suffix]}; name the file .jsonl or .csv (or {way})")
    return "csv" if suffix == ".csv" else "jsonl"


def export(run_path: Path, out: Path | None, fmt: Format, job_path: Path | None = None,
           with_input: bool = False, ticker: Ticker | None = None) -> ExportSummary:  # fmt: skip
    """Write the run's rows to `out` (atomically: a file appears only whole), or to standard
    output when `out` is None. `job_path` stands in for the job file the manifest names;
    `with_input` adds each row's input record; `ticker` shows how far it has got."""
    if out is not None:
        check_output_file("-o", out)
    manifest = read_manifest(run_path)
    job = _load_job(run_path, manifest, job_path)
    summary = ExportSummary(job_path=job.job_path)
    plan, summary.warnings = _run_plan(manifest, job)
    if not summary.warnings and _job_sha256(manifest) != file_digest(job.job_path)[0]:
        summary.warnings.append(f"the job file {job.job_path} changed since the run; its "
                                "current input settings were used")  # fmt: skip
    if out is not None:
        check_not_read_back("-o", out, [("the run's input file", job.input_path),
                                        ("the run's job file", job.job_path),
                                        *recorded_sources(manifest)])
    reader = InputReader(job.input_path, plan, with_input)  # a missing input fails here
    try:
        _check_input(run_path, manifest, job.input_path, plan.format, summary)
        # Answers removed by hand would come out as pending, the way on a --resume that pays
        # for them again: say so, as `report` and a resume do.
        summary.warnings += [
            f"{path} {'is missing' if size is None else f'holds {size:,} bytes'} where the "
            f"run's manifest recorded {listed:,}: answers were removed or changed by hand, and "
            "their records are exported as what is there now (pending where gone)"
            for path, listed, size in changed_results(manifest, run_path)]
        if asked := asked_otherwise(manifest):
            summary.warnings.append(asked)
        columns = reader.columns
        if fmt == "csv" and with_input and columns is None:
            columns = _json_keys(job.input_path)
        _export(run_path, reader, fmt, out, summary, columns, ticker or Ticker(quiet=True),
                _input_size(job.input_path))
    finally:
        reader.close()
    return summary


def _json_keys(path: Path) -> list[str]:
    """Every top-level key of a JSON lines file's records, in the order first seen (lines
    decoded as the run's reader decodes them; one that is no record adds none)."""
    keys: dict[str, None] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(bounded_lines(f), 1):
            if line is None:  # too long: a reject, no record
                continue
            raw = line.removeprefix(BOM)  # any line's, as the reader passes over it
            if raw.strip() and isinstance(record := decode_line(raw, number), dict):
                keys.update(dict.fromkeys(record))
    return list(keys)


def _input_size(path: Path) -> int | None:
    try:
        return os.path.getsize(path) or None
    except OSError:
        return None


def _export(run_path: Path, reader: InputReader, fmt: Format, out: Path | None,
            summary: ExportSummary, columns: list[str] | None, ticker: Ticker,
            size: int | None) -> None:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="shardrun-export-") as scratch:
        try:
            index = _Index(Path(scratch) / "index.sqlite")
            try:
                # In pass order, so an id's first line is its earliest pass's (a damaged run's
                # repeat): by name, shard-00.r10.jsonl comes before shard-00.r2.jsonl.
                live = [(path, sub == "dead") for sub in ("results", "dead")
                        for path in sorted((run_path / sub).glob("*.jsonl"),
                                           key=lambda file: (pass_of(file), file.name))]
                # One handle a file, kept open (`_Index`); the set-aside files too, read after.
                ensure_open_files(len(live) + len(list(
                    run_path.glob("dead/superseded-r*/*.jsonl"))))
                ticker.phase("reading the run's results", "lines")
                for path, failed in live:
                    index.add(path, failed=failed, summary=summary, step=ticker.step)
                # A retry pass killed before it put back the dead letters it never reached
                # left them only aside: failed still, not pending (no --resume runs them).
                # Read after the live files, whose lines win (resume.set_aside_lines: why).
                index.add_aside(set_aside_lines(run_path))
                share = None if size is None else lambda: min(1.0, reader.bytes_read / size)
                ticker.phase("writing rows", "rows", share)
                index.row_done = ticker.step
                if out is None:
                    _write_to_stdout(index, reader, fmt, sys.stdout.buffer, summary, columns)
                else:
                    _write_atomically(index, reader, fmt, out, summary, columns)
            finally:
                index.close()
        except sqlite3.Error as exc:
            raise RunError(f"the export's scratch index in {Path(scratch).parent} failed "
                           f"({exc}); free some space there, or set TMPDIR to a directory "
                           "that has some") from None  # fmt: skip
        except BrokenPipeError:  # `export RUN | head`: the CLI's case (writes to stdout raise it)
            raise
        except OSError as exc:  # reading the run or the input: writes are wrapped in _WriteError
            where = f" {exc.filename}" if exc.filename else " the run's files or the input"
            raise RunError(f"could not read{where}: {_why(exc)}") from None
    summary.orphans = index.size - summary.ok - summary.failed


def run_input(run_path: Path, manifest: dict[str, Any]) -> tuple[Path, InputPlan]:
    """The run's input file and how its last pass read it, as export reads it."""
    job = _load_job(run_path, manifest, None)
    return job.input_path, _run_plan(manifest, job)[0]


def _load_job(run_path: Path, manifest: dict[str, Any], job_path: Path | None) -> LoadedJob:
    from shardrun.spec import load_job

    if job_path is None:
        job_path = newest_job_path(manifest)
        if job_path is None or not job_path.is_file():
            what = f", {job_path}, no longer exists" if job_path else " is not in its manifest"
            raise SpecError(f"the job file of run {run_path.name}{what}; name it with "
                            "--job JOB.yaml")  # fmt: skip
    # The job is read as written: only its input settings matter here, and no environment
    # variable changes them (an override meant for a run must not fail an export).
    return load_job(job_path, env={}, flags={})


READING = ("input.id_field", "input.format", "input.prompt_field", "input.messages_field",
           "input.template")  # fmt: skip
"""Input settings that decide a line's row: its id, and whether it is a record or a reject."""


_NAMED = ("input.id_field", "input.format")  # settings that are never null


def _run_plan(manifest: dict[str, Any], job: LoadedJob) -> tuple[InputPlan, list[str]]:
    """How the run's last pass read the input (its `effective` record), with a warning for each
    setting of the job file that differs from it. The job file's would find answers under other
    ids (a record beside another record's answer, or pending) or reject the records that have
    them, after an edit meant for another run. A pass that recorded none (an older shardrun's
    resume) leaves the job file's."""
    from shardrun._models import InputFormat  # pydantic's: loaded with the job already

    plan = InputPlan.from_job(job)
    recorded = newest_pass(manifest).get("effective")
    if not isinstance(recorded, dict):
        return plan, []
    warnings, read_as = [], dict[str, Any]()
    for key, old, new in setting_changes(recorded, job.effective(), READING):
        if ((not isinstance(old, str) and (old is not None or key in _NAMED))
                or (key == "input.format" and old not in get_args(InputFormat))):  # edited
            continue  # fmt: skip
        try:
            value = parse_template(old) if key == "input.template" and old is not None else old
        except TemplateError:
            continue
        read_as[key.removeprefix("input.")] = value
        warnings.append(f"{key} is {_shown(new)} in {job.job_path} but was {_shown(old)} when "
                        "the run's last pass read the input; export read it as that pass did")
    return replace(plan, **read_as), warnings


def _shown(value: object) -> str:
    """A setting's value in a one-line message (as a resume shows it)."""
    return ellipsize(orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode(), 80)


def _job_sha256(manifest: dict[str, Any]) -> str | None:
    """The SHA-256 of the job file as the newest pass read it."""
    for entry in reversed(manifest.get("resumes") or []):
        if isinstance(entry, dict) and entry.get("job_sha256"):  # no object: edited, passed over
            return str(entry["job_sha256"])
    job = manifest.get("job")
    sha = job.get("sha256") if isinstance(job, dict) else None  # no object: edited, as above
    return None if sha is None else str(sha)


def _check_input(run_path: Path, manifest: dict[str, Any], input_path: Path, fmt: str,
                 summary: ExportSummary) -> None:  # fmt: skip
    """Fail unless the input starts with the bytes every ended pass read (their count and
    SHA-256). Every pass, not the newest only: each pass's answers came from what it read, and
    a resume by an older shardrun did not check that the input was unchanged."""
    ended = pass_reads(manifest)
    if not ended:
        summary.warnings.append(f"no pass of run {run_path.name} has ended, so the input could "
                                "not be checked against what the run read")  # fmt: skip
        return
    try:
        got = prefix_digests(input_path, [size for _, _, size, _ in ended])
    except OSError:
        got = {}
    for _, _, size, sha in ended:
        if got.get(size) != sha:
            raise SpecError(f"the input {input_path} is not what run {run_path.name} read (its "
                            f"first {size:,} bytes have another SHA-256 than the manifest "
                            "records): export pairs answers with input lines, so it needs the "
                            "input as the run read it; restore the file (lines added at its "
                            "end are fine), or give --job a job file whose input.path names a "
                            "copy of it as read")  # fmt: skip
    if (joined := run_on(manifest, input_path, fmt)) is not None:
        raise SpecError(f"the input {input_path} is not what run {run_path.name} read: "
                        f"{joined.why}, so export would show neither that line's answer nor "
                        f"the lines added; {joined.fix}")


class _Index:
    """Where each id's line is: a SQLite table on disk, so memory stays flat however many.

    Each file is opened once, when it is indexed, and its lines are read back through that
    handle: a retry pass that starts meanwhile moves the dead-letter files aside, and one
    opened only at its first row was gone by then (the export failed midway)."""

    def __init__(self, db_path: Path) -> None:
        # No journal and no syncs: the table is scratch, gone with its directory.
        self._db = sqlite3.connect(db_path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode = OFF")
        self._db.execute("PRAGMA synchronous = OFF")
        self._db.execute("CREATE TABLE line (id TEXT PRIMARY KEY, file INTEGER, at INTEGER) "
                         "WITHOUT ROWID")  # fmt: skip
        self._files: list[tuple[Path, bool]] = []  # (path, holds dead letters)
        self._open: dict[int, IO[bytes]] = {}
        self.size = 0
        self.row_done: Callable[[], None] | None = None  # told of each row made (progress)

    def add(self, path: Path, *, failed: bool, summary: ExportSummary,
            step: Callable[[], None] | None = None) -> None:
        try:
            handle = open(path, "rb")  # noqa: SIM115 - kept for `find`, closed in `close`
        except FileNotFoundError:
            if failed:  # set aside since it was listed: the set-aside files are read after
                return
            raise
        number = len(self._files)
        self._files.append((path, failed))
        self._open[number] = handle
        lines = _Lines(handle, path, number, summary, step)
        self._db.execute("BEGIN")
        before = self._db.total_changes
        self._db.executemany("INSERT OR IGNORE INTO line VALUES (?, ?, ?)", lines)
        added = self._db.total_changes - before
        self._db.execute("COMMIT")
        self.size += added
        summary.repeated += lines.count - added

    def add_aside(self, lines: dict[str, tuple[Path, int]]) -> None:
        """Dead letters retry passes set aside, id -> (file, offset): after the live lines,
        each only where no live line ended it (the table keeps an id's first line)."""
        numbers: dict[Path, int] = {}
        for path, _ in lines.values():
            if path not in numbers:
                numbers[path] = len(self._files)
                self._open[numbers[path]] = open(path, "rb")  # noqa: SIM115 - as in `add`
                self._files.append((path, True))
        rows = ((item_id, numbers[path], at) for item_id, (path, at) in lines.items())
        self._db.execute("BEGIN")
        before = self._db.total_changes
        self._db.executemany("INSERT OR IGNORE INTO line VALUES (?, ?, ?)", rows)
        self.size += self._db.total_changes - before
        self._db.execute("COMMIT")

    def find(self, item_id: str) -> tuple[dict[str, Any], bool] | None:
        """The line that ended `item_id` and whether it is a dead letter, or None."""
        hit = self._db.execute("SELECT file, at FROM line WHERE id = ?", (item_id,)).fetchone()
        if hit is None:
            return None
        number, at = hit
        f = self._open[number]
        f.seek(at)
        return orjson.loads(f.readline()), self._files[number][1]

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._db.close()


class _Lines:
    """Iterates (id, file number, offset) of every whole line of a results or dead-letter file.

    A line without its newline is one a run was writing (or a crash cut): not an ending yet, so
    it is counted in `summary.torn` and left out. `count` is how many were yielded.
    """

    def __init__(self, handle: IO[bytes], path: Path, number: int, summary: ExportSummary,
                 step: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.handle, self.path, self.number, self.summary = handle, path, number, summary
        self.step = step  # told of each line read (progress)
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        at = 0
        for raw in self.handle:
            start, at = at, at + len(raw)
            if not raw.endswith(b"\n"):
                self.summary.torn += 1
                continue
            if not raw.strip():
                continue
            try:
                item_id = orjson.loads(raw)["id"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise RunError(f"{self.path} at byte {start} holds a line that is not a "
                               "record; the run directory was edited or damaged") from None
            self.count += 1
            if self.step is not None:
                self.step()
            yield str(item_id), self.number, start


def _rows(index: _Index, reader: InputReader, summary: ExportSummary) -> Iterator[dict[str, Any]]:
    """One row per input record, in input order (see the module docstring for the statuses)."""
    seen = DigestSet()
    for entry in reader:
        summary.rows += 1
        if isinstance(entry, Reject):
            summary.rejected += 1
            row = _row(entry.line, entry.id, "rejected", error=entry.reason)
        else:
            row = _record_row(index, reader.line, entry["id"], seen, summary)
        if reader.keep_records:
            row["input"] = reader.record
            summary.no_record += reader.record is None
        if index.row_done is not None:
            index.row_done()
        yield row


def _record_row(index: _Index, line: int, item_id: str, seen: DigestSet,
                summary: ExportSummary) -> dict[str, Any]:  # fmt: skip
    """The row of an input record that became an item."""
    if not seen.add(id_digest(item_id)):
        summary.rejected += 1
        return _row(line, item_id, "rejected", error=duplicate_reason(item_id))
    found = index.find(item_id)
    if found is None:
        summary.pending += 1
        return _row(line, item_id, "pending")
    if found[1]:
        summary.failed += 1
        return _dead_row(line, item_id, found[0])
    summary.ok += 1
    return _ok_row(line, item_id, found[0])


def _row(line: int, item_id: str | None, status: str, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"line": line, "id": item_id, "status": status, "output": None,
                           "finish_reason": None, "usage": None, "attempts": None, "error": None,
                           "reasoning": None, "tool_calls": None, "refusal": None,
                           "function_call": None}  # fmt: skip
    row.update(values)
    return row


def _ok_row(line: int, item_id: str, record: dict[str, Any]) -> dict[str, Any]:
    return _row(line, item_id, "ok", output=record.get("output"),
                finish_reason=record.get("finish_reason"), usage=record.get("usage"),
                attempts=record.get("attempts"), reasoning=record.get("reasoning"),
                tool_calls=record.get("tool_calls"), refusal=record.get("refusal"),
                function_call=record.get("function_call"))  # fmt: skip


def _dead_row(line: int, item_id: str, record: dict[str, Any]) -> dict[str, Any]:
    attempts = record.get("attempts")
    return _row(line, item_id, "failed", error=record.get("reason"),
                attempts=len(attempts) if isinstance(attempts, list) else None)


def _csv_values(row: dict[str, Any], input_columns: list[str]) -> list[Any]:
    usage = row["usage"] if isinstance(row["usage"], dict) else {}
    values = [row["line"], row["id"], row["status"], row["output"], row["finish_reason"],
              usage.get("prompt_tokens"), usage.get("completion_tokens"),
              _cell(usage.get("estimated")), usage.get("cached_tokens"),
              usage.get("reasoning_tokens"),
              row["attempts"], row["error"], row["reasoning"],
              _cell(row["tool_calls"]), row["refusal"], _cell(row["function_call"])]  # fmt: skip
    if "input" in row:
        record = row["input"] or {}
        values.extend(_cell(record.get(name)) for name in input_columns)
    return values


def _csv_header(input_columns: list[str] | None) -> list[str]:
    """COLUMNS, then one `input.NAME` per input column when rows carry their input."""
    return [*COLUMNS, *(f"input.{name}" for name in input_columns or ())]


def _cell(value: Any) -> Any:
    """A value as a CSV cell: text and numbers as they are, anything else (true and false
    included) as its JSON text, unless that is a JSON string (a Parquet timestamp, date or
    decimal): then the text itself, without JSON's quotes."""
    if value is None or isinstance(value, str | float) or type(value) is int:
        return value
    text = orjson.dumps(value, default=_plain).decode()
    return orjson.loads(text) if text.startswith('"') else text


def _plain(value: Any) -> str:
    """A value JSON has no type for (a Parquet input's bytes or decimals) as text."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class _WriteError(Exception):
    """Writing the export failed (the OSError is its cause); reading the run did not."""


def _write(index: _Index, reader: InputReader, fmt: Format, sink: IO[bytes],
           summary: ExportSummary, columns: list[str] | None) -> None:  # fmt: skip
    """Write every row to `sink`. Only the writes are wrapped in `_WriteError`: a failure to
    read the run or the input keeps its own error."""
    rows = _rows(index, reader, summary)
    if fmt == "jsonl":
        option = orjson.OPT_APPEND_NEWLINE
        for row in rows:
            _put(sink, orjson.dumps(row, default=_plain, option=option))
    else:
        # csv writes text: rows go through a string buffer, encoded and written in blocks.
        text = io.StringIO()
        writer = csv.writer(text)
        columns = columns if reader.keep_records else None
        writer.writerow(_csv_header(columns))
        for row in rows:
            writer.writerow(_csv_values(row, columns or []))
            if text.tell() >= _WRITE_BLOCK:
                _put(sink, text.getvalue().encode())
                text.seek(0)
                text.truncate()
        _put(sink, text.getvalue().encode())
    try:
        sink.flush()
    except OSError as exc:
        raise _WriteError from exc


def _put(sink: IO[bytes], data: bytes) -> None:
    try:
        sink.write(data)
    except OSError as exc:
        raise _WriteError from exc


def _write_to_stdout(index: _Index, reader: InputReader, fmt: Format, sink: IO[bytes],
                     summary: ExportSummary, columns: list[str] | None) -> None:  # fmt: skip
    try:
        _write(index, reader, fmt, sink, summary, columns)
    except _WriteError as exc:
        cause = exc.__cause__
        if isinstance(cause, BrokenPipeError):  # `shardrun export RUN | head`: the CLI's case
            raise cause from None
        raise RunError(f"could not write the export to standard output: {_why(cause)}") from None


def _write_atomically(index: _Index, reader: InputReader, fmt: Format, out: Path,
                      summary: ExportSummary, columns: list[str] | None) -> None:  # fmt: skip
    """Write next to `out`, then rename: a failed export leaves no half file (nor a half-new
    version of an earlier export). Through a symbolic link, the file it names is replaced and
    the link kept; a device or a pipe (/dev/null, a FIFO) is written in place, as `>` would."""
    target = replace_target(out)
    if target is None:
        _write_in_place(index, reader, fmt, out, summary, columns)
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        try:
            f = open(tmp, "wb")  # noqa: SIM115 - closed below, before the rename
        except OSError as exc:
            raise _WriteError from exc
        try:
            _write(index, reader, fmt, f, summary, columns)
            try:
                os.fsync(f.fileno())
            except OSError as exc:
                raise _WriteError from exc
        finally:
            # After a failed write, closing would retry the buffered bytes and fail again; after
            # a good one, everything is flushed and synced already.
            with contextlib.suppress(OSError):
                f.close()
        try:
            os.replace(tmp, target)
        except OSError as exc:
            raise _WriteError from exc
    except _WriteError as exc:
        tmp.unlink(missing_ok=True)
        assert isinstance(exc.__cause__, OSError)  # `_WriteError` wraps only those
        raise cannot_write("-o", out, exc.__cause__) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_in_place(index: _Index, reader: InputReader, fmt: Format, out: Path,
                    summary: ExportSummary, columns: list[str] | None) -> None:  # fmt: skip
    try:
        try:
            with open(out, "ab") as f:  # as `>>`: what a descriptor path leads to is kept
                _write(index, reader, fmt, f, summary, columns)
        except OSError as exc:  # opening it, or the flush of the close
            raise _WriteError from exc
    except _WriteError as exc:
        cause = exc.__cause__
        if isinstance(cause, BrokenPipeError):  # `-o /dev/stdout | head`: as standard output
            raise cause from None
        raise RunError(f"could not write {out}: {_why(cause)}") from None


def _why(exc: BaseException | None) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).lower()
