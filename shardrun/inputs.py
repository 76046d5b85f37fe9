"""Streams the input file into items without holding it in memory.

An item is exactly what the coordinator sends a shard, one of three shapes:

    {"id", "prompt": str}                      a text prompt (chat: sent as one user message)
    {"id", "messages": [...]}                  a chat message list (messages_field, or a
                                               prompt/template with input.system_prompt)
    {"id", "body": {...}, "url": str}          an OpenAI Batch line's own request body

`items.build_request` turns any of them into the HTTP body a shard sends. Formats: JSON lines, CSV
(header row), Parquet (the `parquet` extra) and OpenAI Batch input files. A record that cannot
become an item is a `Reject` with its line (or row) number and reason; the caller decides
whether that is fatal (`--strict`) or a line in rejects.jsonl.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import hashlib
import io
import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import orjson

from shardrun._ellipsis import ellipsize, json_kind
from shardrun._messages import messages_problem
from shardrun._tabular import CHUNK, CsvRows, ParquetRows, Row, check_columns, file_sha256, not_utf8
from shardrun._template import MissingField, Template, parse_template
from shardrun.errors import InputCut, InputError
from shardrun.items import BATCH_URLS

if TYPE_CHECKING:
    from shardrun._models import InputFormat
    from shardrun.spec import LoadedJob

BOM = b"\xef\xbb\xbf"
"""The UTF-8 byte order mark, which editors on Windows like to put at the start of a file. A JSON
line may start with one anywhere: files saved so and joined (`cat a.jsonl b.jsonl`) bring one
each, and JSON allows a reader to pass over it (RFC 8259, 8.1), as the reader does."""

_UNPACK = "and name the file that gives in input.path"
NOT_TEXT = (
    (rb"\x1f\x8b", b"", "gzip-compressed", f"decompress it (gunzip) {_UNPACK}"),
    (rb"\x28\xb5\x2f\xfd", b"", "zstd-compressed", f"decompress it (unzstd) {_UNPACK}"),
    (rb"BZh[1-9]1AY&SY", b"", "bzip2-compressed", f"decompress it (bunzip2) {_UNPACK}"),
    (rb"\xfd7zXZ\x00", b"", "xz-compressed", f"decompress it (unxz) {_UNPACK}"),
    (rb"PK\x03\x04", b"", "a zip archive", f"extract the input from it {_UNPACK}"),
    # A Parquet file named otherwise than .parquet: its data starts with a binary page header,
    # and the file ends with "PAR1" too (a CSV header "PAR1\xc3\xa9,..." starts as one does).
    (rb"PAR1[^\t\n\r\x20-\x7e]", b"PAR1", "a Parquet file",
     "set input.format: parquet in the job file"),
    (rb"\xff\xfe\x00\x00|\x00\x00\xfe\xff", b"", "UTF-32 text", "save it as UTF-8"),
    (rb"\xff\xfe|\xfe\xff", b"", "UTF-16 text", "save it as UTF-8"),
    # Without a byte order mark: ASCII characters each with a zero byte after or before it.
    (rb"([\x01-\x7f]\x00){2}|(\x00[\x01-\x7f]){2}", b"", "UTF-16 text", "save it as UTF-8"),
)
"""How a JSON lines or CSV input may start that is not UTF-8 text (a regular expression of its
first bytes, the bytes it must end with too, what the file is, what to do): read as it is, each
of its lines would be a reject saying "not valid UTF-8" or "not valid JSON" (a million of them
for a million records), where the file is one thing to fix."""


@dataclass(frozen=True, slots=True)
class Reject:
    """An input line that did not become an item (`id`: the item id it names, when it has
    one: a record whose prompt is missing still says which item it was meant to be)."""

    line: int
    reason: str
    id: str | None = None


@dataclass(frozen=True, slots=True)
class InputPlan:
    """How records become items: the job's input settings, with the template parsed once."""

    id_field: str = "id"
    prompt_field: str | None = "prompt"
    messages_field: str | None = None
    format: InputFormat = "jsonl"
    template: Template | None = None
    system_prompt: str | None = None
    # The Responses API's input list holds items of other types beside messages (a function
    # call, its output), which have no role: `messages_problem` passes over them.
    responses: bool = False

    @classmethod
    def from_job(cls, job: LoadedJob) -> InputPlan:
        """The plan a loaded (so already validated) job describes."""
        spec = job.spec.input
        template = None if spec.template is None else parse_template(spec.template)
        return cls(spec.id_field, spec.prompt_field, spec.messages_field, spec.format,
                   template, spec.system_prompt, job.spec.endpoint.api == "responses")  # fmt: skip

    @property
    def needed(self) -> tuple[str, ...]:
        """Columns every record must have (a tabular file's header is checked for them)."""
        if self.template is not None:
            return self.template.fields
        return tuple(f for f in (self.prompt_field, self.messages_field) if f is not None)

    @property
    def header_needs(self) -> tuple[str, ...]:
        """Columns a CSV header or Parquet schema must name: `needed`, and an id column the job
        names other than the default `id` (a table without it would give every row a hashed
        id, which is a typo's doing far more often than the job's intent)."""
        named_id = () if self.id_field == "id" or self.id_field in self.needed else (self.id_field,)
        return (*self.needed, *named_id)


FieldMap = InputPlan
"""The former name (id, prompt and messages fields only); kept while callers move over."""


class InputReader:
    """Iterates items and rejects of an input file, hashing every byte read on the way.

    The hash and byte count go into the manifest, so a published figure names the exact input.
    Parquet is read by random access, so its hash covers the whole file, taken once the last
    row has been read, or at `close` after some were (a pass stopped early). A CSV is read in
    blocks, so a pass that stops early may have hashed past its last row, to the end of a
    block: the figures are always those of the file's first `bytes_read` bytes. A CSV header
    or Parquet schema without a needed column is an InputError here, before any item is read.

    With `keep_records`, `record` is the whole input record behind the entry last yielded
    (None for a line that is not a record; a JSON line's whole numbers past 64 bits as written,
    `kept_record`) and `columns` the names a CSV header or Parquet schema gives (None for JSON
    lines); an export that shows the input reads them.
    """

    def __init__(self, path: Path, fields: InputPlan, keep_records: bool = False) -> None:
        self.path = path
        self.fields = fields
        self.sha = hashlib.sha256()
        self.bytes_read = 0
        self.lines_read = 0
        # Line breaks read: with `lines_read`, whether a last line had one. A CSV line may end
        # with a lone CR too (old Mac exports; the csv module reads it as a line's end).
        self._newlines = 0
        self._lone_crs = fields.format == "csv"
        self._last = b""  # the last byte read
        self._row_start: int | None = None  # the first line of the CSV row last yielded
        self.keep_records = keep_records
        self.record: dict[str, Any] | None = None
        self.columns: list[str] | None = None
        self._tabular: CsvRows | ParquetRows | None = None
        if fields.format == "parquet":
            _must_exist(path)
            self._tabular = ParquetRows(path, fields.header_needs, [fields.id_field], keep_records)
            self.columns = self._tabular.names
            return
        self._file = _open(path)
        _refuse_not_text(path, self._file)
        if fields.format != "csv":  # a CSV line may end with a lone CR (the csv module's rule)
            _refuse_lone_crs(path, self._file)
        if fields.format == "csv":
            self._tabular = CsvRows(path, self._file, self._count,
                                    functools.partial(self._check_not_cut, 0))
            check_columns(path, self._tabular.header, fields.header_needs, "CSV header")
            self.columns = [_encodable(name) for name in self._tabular.header]

    def _count(self, data: bytes) -> None:
        self.sha.update(data)
        self.bytes_read += len(data)
        self._newlines += data.count(b"\n")
        if self._lone_crs:
            # A CR ending one block and an LF starting the next are one CRLF, counted once.
            self._newlines += (data.count(b"\r") - data.count(b"\r\n")
                               - (self._last == b"\r" and data[:1] == b"\n"))
        self._last = data[-1:] or self._last

    def __iter__(self) -> Iterator[dict[str, Any] | Reject]:
        return cast("Iterator[dict[str, Any] | Reject]", self.entries(blanks=False))

    def entries(self, blanks: bool) -> Iterator[dict[str, Any] | Reject | None]:
        """The items and rejects, as iterating the reader gives them; with `blanks`, a None too
        for each blank line (or CSV row) passed over, so that a reader that counts what it reads
        between yields to its event loop (`WorkSource.fill`) counts those lines too: a million
        blank lines were read in one piece, the coordinator's loop held all the while."""
        if isinstance(self._tabular, CsvRows):
            return self._csv_items(self._tabular, blanks)
        if isinstance(self._tabular, ParquetRows):
            return self._parquet_items(self._tabular)
        return self._line_items(blanks)

    def _line_items(self, blanks: bool) -> Iterator[dict[str, Any] | Reject | None]:
        limit = MAX_LINE_BYTES  # a local: looked up per line
        block = CHUNK
        with self._file:
            for raw in iter(functools.partial(self._file.readline, block), b""):
                if raw.endswith(b"\n"):
                    self._count(raw)
                elif len(raw) < block:  # the file's end: the last line, or a cut
                    self._check_not_cut(len(raw))
                    self._count(raw)
                elif isinstance(line := _line_on(self._file, raw, self._take), int):
                    self.lines_read += 1  # a record over the limit, read past: its size
                    yield self._too_long_reject(line)
                    continue
                else:
                    raw = line
                    if not raw.endswith(b"\n"):  # read again short: the file was cut since
                        self._check_not_cut(0)
                self.lines_read += 1
                # With its BOM and line break: the record may be no longer.
                if len(raw) > limit and (size := _record_size(raw)) > limit:
                    yield self._too_long_reject(size)
                    continue
                raw = raw.removeprefix(BOM)  # any line's: see BOM
                if not raw.strip():
                    if blanks:
                        yield None
                    continue
                record = decode_line(raw, self.lines_read)
                if self.keep_records:
                    self.record = None if isinstance(record, Reject) else kept_record(record, raw)
                if isinstance(record, Reject):
                    yield record
                else:
                    yield line_item(record, raw, self.lines_read, self.fields)
            self._check_not_cut(0)

    def _take(self, data: bytes) -> None:
        """Count a block of a line longer than a block (`_line_on`), as a line is counted."""
        if not data.endswith(b"\n"):  # maybe the file's end: the last line, or a cut
            self._check_not_cut(len(data))
        self._count(data)

    def _too_long_reject(self, size: int) -> Reject:
        """The reject of the line just read, whose record is `size` bytes, over the limit."""
        if self.keep_records:
            self.record = None  # not the line before's (export's input column)
        return Reject(self.lines_read, _too_long(size))

    def _check_not_cut(self, more: int) -> None:
        """Raise InputCut if the file is now shorter than what has been read of it and `more`
        bytes read past that: it was truncated or rewritten in place while the pass read it
        (`cat new > input.jsonl`), and the read ended inside a line that was whole, or at
        bytes that are gone. A CSV's reader asks where a block read finds the file's end,
        before the row it ends is read (a row cut short was an item with half its prompt).
        A JSON line's rest, read as the last line, was a reject of a line the file had whole,
        recorded as cut off (`open_end`), which made a resume with the file put back refuse
        it, and the pass ended as a run that had read its input."""
        with contextlib.suppress(OSError):  # a file that cannot be looked at: read as it is
            size = os.fstat(self._file.fileno()).st_size
            if size < self.bytes_read + more:
                raise InputCut(
                    f"the input {self.path} was cut short while it was read: it holds "
                    f"{size:,} bytes now, and {self.bytes_read + more:,} had been read "
                    "(truncated or rewritten in place?)")

    def _csv_items(self, rows: CsvRows, blanks: bool) -> Iterator[dict[str, Any] | Reject | None]:
        checked = (*self.fields.needed, self.fields.id_field)
        with self._file:
            for line, record, key in rows.rows(blanks):
                self.lines_read, self._row_start = rows.line_num, line
                if record is None:  # a blank row, asked for
                    yield None
                    continue
                if self.keep_records:
                    self.record = None if isinstance(record, str) else _whole_row(record, rows)
                if isinstance(record, str):
                    yield Reject(line, record, self._csv_id(rows))
                elif bad := not_utf8(record, checked):
                    yield Reject(line, _not_utf8_reason(bad, record[bad]), self._csv_id(rows))
                else:
                    item = record_item(record, key, line, self.fields)
                    if isinstance(item, Reject) and " is missing" in item.reason:
                        # The header has the column (checked at open): the cell is empty.
                        reason = item.reason.partition(" is missing")[0] + " is empty"
                        item = Reject(line, reason, item.id)
                    yield item
            self.lines_read = rows.line_num

    def _csv_id(self, rows: CsvRows) -> str | None:
        """The id a rejected CSV row names in its id column, if that value is there and is
        text (a reject "carries its id where it has one", as a JSON line's does)."""
        value = rows.cell(self.fields.id_field)
        if value is None or not_utf8({"id": value}, ["id"]) is not None:
            return None
        return value

    def _parquet_items(self, rows: ParquetRows) -> Iterator[dict[str, Any] | Reject]:
        for row in rows:
            self.lines_read = rows.rows_read
            if self.keep_records:
                record = row[1]
                # Parquet nulls are left out of a record; shown, they are nulls again.
                self.record = None if isinstance(record, str) else {**dict.fromkeys(rows.names),
                                                                    **record}  # fmt: skip
            yield _row_item(row, self.fields)
        self._hash_parquet()
        rows.close()

    @property
    def line(self) -> int:
        """Where the entry last yielded starts: its line (a CSV row may span several, when a
        quoted cell holds a line break), or its row in a Parquet file."""
        return self.lines_read if self._row_start is None else self._row_start

    def at_end(self) -> bool:
        """Whether nothing but blank lines follows the entries read so far (`blank`, as for
        text appended after a whole read): the rest of a JSON lines file is read from the byte
        after the last line read, a CSV's is read on from its last row (the reader holds part
        of it in a block already, and stops at the first row there is), and a Parquet file is
        at its end at its last row."""
        if isinstance(self._tabular, ParquetRows):
            return self._tabular.rows_read == self._tabular.num_rows
        if isinstance(self._tabular, CsvRows):
            return all(blank(chunk, "csv") for chunk in self._tabular.read_on())
        return not holds_more(self.path, self.bytes_read, self.fields.format)

    @property
    def open_end(self) -> str | None:
        """How the file's end cut off the last record read, if it did: "line" when its line had
        no line break, "quote" when a quoted CSV cell never closed. Text appended to the file
        later runs on into that record, so a resume must see it (`manifest.run_on`)."""
        if isinstance(self._tabular, ParquetRows) or not self.bytes_read:
            return None
        if isinstance(self._tabular, CsvRows) and self._tabular.open_quote:
            return "quote"
        # A CSV line may also end with a lone CR; a JSON line ends only with LF.
        breaks = (b"\n", b"\r") if self._tabular is not None else (b"\n",)
        # A line without a break is the file's last; counted in lines_read, it was read (a CSV
        # pass that stopped early has read past its last row only to the end of a block).
        read_last = self.lines_read > self._newlines
        return "line" if self._last not in breaks and read_last else None

    def _hash_parquet(self) -> None:
        """Take a Parquet file's hash, the whole file's, once: it is read by random access, so
        a pass that stops early (`--limit`, a stop) has read from all of it too."""
        if not self.bytes_read:
            self.sha, self.bytes_read = file_sha256(self.path)

    def close(self) -> None:
        if self._tabular is not None:
            self._tabular.close()
        if self.fields.format != "parquet":
            self._file.close()
        elif self.lines_read:
            with contextlib.suppress(OSError):  # gone since: the manifest then says 0 bytes
                self._hash_parquet()


MAX_LINE_BYTES = 64 * 1024 * 1024
"""The longest JSON line read as a record (a CSV cell's 16 Mi characters take as much in the csv
module, `_tabular`): 16 million tokens by characters / 4, past any model's context and any
API's request size. A longer one is a reject, read past in blocks: a line of gigabytes (a file
of no line breaks, a stray binary dump) was read whole into memory, and the coordinator could
run out of it."""


def bounded_lines(file: IO[bytes]) -> Iterator[bytes | None]:
    """The file's lines, as iterating it gives them, but one whose record is longer than
    MAX_LINE_BYTES as None, read past in blocks (`_line_on`)."""
    limit, block = MAX_LINE_BYTES, CHUNK
    for raw in iter(functools.partial(file.readline, block), b""):
        if len(raw) == block and not raw.endswith(b"\n"):
            line = _line_on(file, raw, _unread)
            yield None if isinstance(line, int) else line
        elif len(raw) > limit and _record_size(raw) > limit:
            yield None
        else:
            yield raw


def _record_size(line: bytes) -> int:
    """The length of a line's record: without a BOM before it or the line break after (the
    limit is the record's, whatever ends the line)."""
    size = len(line) - (len(BOM) if line.startswith(BOM) else 0)
    if line.endswith(b"\n"):
        size -= 2 if line.endswith(b"\r\n") else 1
    return size


def _line_on(file: IO[bytes], first: bytes, on_bytes: Callable[[bytes], None]) -> bytes | int:
    """Of a line whose first block `first` (CHUNK bytes) was read without its end: the whole
    line, if its record is no longer than MAX_LINE_BYTES, else the record's length (as
    `_record_size`), the file left after the line either way. Each byte of the line is passed
    to `on_bytes` once, in the file's order, in blocks as they are read.

    The line is read to its end in blocks, none kept, then read again whole if it is to be a
    record (a copy from the page cache): `readline(MAX_LINE_BYTES)` held the blocks it read
    and then their join, twice the limit (129 MiB) for a line it then passed over. The bytes
    counted are those of the first read: a file rewritten in place between the two reads is
    no more read as one version than a file rewritten between any two lines is."""
    start = file.tell() - len(first)
    on_bytes(first)
    length, tail = len(first), first[-2:]  # `tail`: the line's last two bytes
    while block := file.readline(CHUNK):
        on_bytes(block)
        length += len(block)
        tail = block[-2:] if len(block) > 1 else tail[-1:] + block
        if block[-1:] == b"\n":
            break
    size = length - (len(BOM) if first.startswith(BOM) else 0)
    if tail[-1:] == b"\n":
        size -= 2 if tail == b"\r\n" else 1
    if size > MAX_LINE_BYTES:
        return size
    file.seek(start)
    return file.read(length)


def _unread(_: bytes) -> None:
    """`_line_on`'s `on_bytes` for a reader that counts no bytes (`bounded_lines`)."""


def _too_long(size: int) -> str:
    """The reason a line whose record is `size` bytes, more than MAX_LINE_BYTES, is a reject."""
    return (f"line is {size:,} bytes, longer than the {MAX_LINE_BYTES >> 20} MiB a line may "
            "hold; a record that long would ask more than any model reads")


def make_reader(job: LoadedJob, keep_records: bool = False) -> InputReader:
    """Open the job's input for streaming (raises InputError when it cannot be read)."""
    return InputReader(job.input_path, InputPlan.from_job(job), keep_records)


def holds_more(path: Path, offset: int, fmt: str) -> bool:
    """Whether the input holds anything past its first `offset` bytes but blank lines, which a
    reader passes over (`blank`): bytes no pass has read that may be items. Reads only that
    tail, and stops at its first block holding more. A file that cannot be read holds none:
    the reader, opened already, says why."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            line_start = True  # `offset` is where a line starts (after a whole read's last)
            while chunk := f.read(1 << 16):
                if cut := next((n for n in (1, 2) if chunk.endswith(BOM[:n])), 0):
                    chunk += f.read(3 - cut)  # a BOM the block's end cut: judged whole
                if not blank(chunk, fmt, line_start):
                    return True
                line_start = chunk.endswith(b"\n")
    except OSError:
        return False
    return False


_JSON_SPACE = b" \t\n\r\x0b\x0c"
# Lines of JSON whitespace, each after its line break starting with a BOM or not (`BOM`).
_JSON_BLANK = re.compile(rb"[ \t\r\x0b\x0c]*(?:\n(?:\xef\xbb\xbf)?[ \t\r\x0b\x0c]*)*")


def blank(data: bytes, fmt: str, line_start: bool = True) -> bool:
    """Whether `data`, a part of an input file, is nothing but blank lines as the reader of the
    format `fmt` passes over them: a JSON line of whitespace is blank, after a BOM at its start
    (which the reader passes over on any line); a CSV row is blank only when the line is empty
    (a row of spaces or a BOM is a row of the wrong width, a reject); any byte past a Parquet
    file's end changed the file. `line_start`: whether `data` starts a line. The one rule for
    what follows the input read: text appended after a whole read (`holds_more`) and the rest
    after a `--limit`'s last item (`InputReader.at_end`)."""
    if fmt == "csv" or fmt == "parquet":
        return not data.strip(b"\r\n" if fmt == "csv" else b"")
    if BOM not in data:
        return not data.strip(_JSON_SPACE)
    return _JSON_BLANK.fullmatch(data.removeprefix(BOM) if line_start else data) is not None


def _must_exist(path: Path) -> None:
    if not path.is_file():
        _open(path).close()  # raises the same InputError as the line formats


def _open(path: Path) -> IO[bytes]:
    with contextlib.suppress(OSError):  # open says what is wrong
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            # A pipe (`<(zcat in.gz)`, mkfifo) is read once: the reader could not read it again
            # to resume, nor after --limit to see what is left, and blocked opening it then.
            raise InputError(f"input file {path} is not a regular file (a pipe or a device); "
                             "a run reads its input again (a resume, --limit, export), so save "
                             "it to a file and name that in input.path")
    try:
        return open(path, "rb")  # the caller closes it (close() or exhaustion)
    except FileNotFoundError:
        raise InputError(
            f"input file {path} does not exist; check input.path in the job file"
        ) from None
    except IsADirectoryError:
        raise InputError(
            f"input file {path} is a directory; input.path in the job file must name a file"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(symlink_loop(path)) from None
        raise InputError(f"cannot open input file {path}: {exc.strerror}") from None


def symlink_loop(path: Path) -> str:
    """Why an input path that is a loop of symbolic links cannot be read, and what to do."""
    return (f"input file {path} is a loop of symbolic links (each names the next); input.path "
            "in the job file must name a file")


def _refuse_not_text(path: Path, file: IO[bytes]) -> None:
    """InputError when the file starts as a compressed file or UTF-16/32 text does (`NOT_TEXT`),
    reading nothing past its first bytes (`peek`: the reader starts at the file's start)."""
    start = file.peek(10) if isinstance(file, io.BufferedReader) else b""
    for magic, end, what, todo in NOT_TEXT:
        if re.match(magic, start) and (not end or _ends_with(file, end)):
            file.close()
            raise InputError(f"input file {path} is {what}, not UTF-8 text; {todo}")


LONE_CR_FIX = "convert lone CRs to LF (tr '\\r' '\\n' < old.jsonl > new.jsonl)"


def _refuse_lone_crs(path: Path, file: IO[bytes]) -> None:
    """InputError when a JSON lines file's first 64 KiB hold line breaks that are lone CRs (old
    Mac line endings) and no LF: its records would read as one line, one reject (or, a single
    record, one item) for the whole file. Refused, not split on CR: a JSON line may hold a CR
    as whitespace, so a reader that split there would cut such a line in two rejects, and the
    file's line numbers (rejects, a resume's count of lines read) would be no tool's but this
    reader's; converted once, the file is read as any other. Reads it from its start, and
    leaves it there."""
    head = file.read(1 << 16)
    file.seek(0)
    # Not a CR at the block's end (it may start a CRLF), nor one in a long first line's JSON
    # (whitespace, as JSON has it): its first 64 KiB then hold a CR and no LF too.
    if b"\n" not in head and _ends_record_at_cr(head[:-1]):
        raise InputError(f"input file {path} ends its lines with a lone CR (old Mac line "
                         f"endings), which would read as one line; {LONE_CR_FIX} and name the "
                         "new file in input.path")


CR_PIECES = 5
"""The CR-separated pieces of text `_ends_record_at_cr` looks at for a whole record."""


def _ends_record_at_cr(text: bytes) -> bool:
    """Whether JSON lines text ends records at CRs: it holds a CR, and one of its first
    `CR_PIECES` CR-separated pieces (but a BOM and blank space) is one JSON object. A CR inside
    a record is JSON whitespace, and no line break: a line holding one is read as any other.
    Not only the piece before the first CR: a file of lone-CR line ends whose first record is
    malformed is such a file all the same (read as one line, one reject)."""
    pieces = text.removeprefix(BOM).lstrip(b" \t\r").split(b"\r", CR_PIECES)
    if len(pieces) < 2:
        return False
    for piece in pieces[:CR_PIECES]:
        if not piece.strip(b" \t").startswith(b"{"):
            continue  # no object: not worth a parse
        try:
            if isinstance(orjson.loads(piece), dict):
                return True
        except orjson.JSONDecodeError:
            continue
    return False


def _ends_with(file: IO[bytes], end: bytes) -> bool:
    """Whether the file's last bytes are `end`, read leaving it at its start again."""
    try:
        file.seek(-len(end), os.SEEK_END)
        return file.read(len(end)) == end
    except OSError:  # shorter than `end`
        return False
    finally:
        file.seek(0)


def _not_utf8_reason(column: str, value: str) -> str:
    """A CSV cell's bytes that are not UTF-8 (each read as a lone surrogate), named as a JSON
    line's are, with what to do: Excel's plain "CSV" is Windows-1252, its "CSV UTF-8" is not."""
    byte = next(ord(c) - 0xDC00 for c in value if "\udc80" <= c <= "\udcff")
    return (f"column '{column}' is not valid UTF-8 (byte 0x{byte:02x}); save the file as UTF-8 "
            "(in Excel: CSV UTF-8)")


def _row_item(row: Row, plan: InputPlan) -> dict[str, Any] | Reject:
    line, record, key = row
    if isinstance(record, str):
        return Reject(line, record)
    return record_item(record, key, line, plan)


def _whole_row(record: Mapping[str, str], rows: CsvRows) -> dict[str, str]:
    """A CSV record with every column of the header (CsvRows leaves empty cells out) and text
    that encodes, its column names' too: a byte that is not UTF-8 is shown as U+FFFD."""
    return {_encodable(name): _encodable(record.get(name, "")) for name in rows.header}


def _encodable(text: str) -> str:
    """CSV text as it can be written out: a byte that is not UTF-8 (read as a lone surrogate)
    as U+FFFD."""
    if text.isascii():
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def parse_line(raw: bytes, line_no: int, fields: InputPlan) -> dict[str, Any] | Reject:
    """One JSON line (JSONL or OpenAI Batch input) to an item, or a Reject saying why not."""
    record = decode_line(raw, line_no)
    return record if isinstance(record, Reject) else line_item(record, raw, line_no, fields)


def decode_line(raw: bytes, line_no: int) -> dict[str, Any] | Reject:
    """One JSON line to its record (an object), or a Reject saying why it is not one."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:  # orjson would say "surrogates not allowed"
            return Reject(line_no, f"not valid UTF-8 (byte 0x{raw[bad.start]:02x} at column "
                                   f"{bad.start + 1}); save the file as UTF-8")
        if b"\r" in raw.rstrip(b"\r\n") and _ends_record_at_cr(raw):  # lone CRs after LFs
            return Reject(line_no, f"not valid JSON ({exc.msg}); the line holds a lone CR (an "
                                   f"old Mac line ending?) that may join records: {LONE_CR_FIX}")
        if raw.removeprefix(BOM).strip() == b"[":  # an indented JSON array's first line
            return Reject(line_no, f"not valid JSON ({exc.msg}); {ARRAY_NOT_LINES}")
        return Reject(line_no, f"not valid JSON ({exc.msg})")
    if not isinstance(record, dict):
        # A whole JSON array of records on one line: the file is no JSON lines file at all.
        # Unless its objects are a chat's messages (a conversation a line): splitting those
        # into lines, as ARRAY_NOT_LINES says, would make each message an item.
        whole = isinstance(record, list) and bool(record) and isinstance(record[0], dict)
        chat = whole and all(isinstance(m, dict) and "role" in m for m in record)
        note = f" of messages; {MESSAGES_NOT_RECORD}" if chat else (
            f" of objects; {ARRAY_NOT_LINES}" if whole else "")
        return Reject(line_no, f"expected a JSON object, got {json_kind(record)}{note}")
    return record


ARRAY_NOT_LINES = ("the file looks like one JSON array, not JSON lines (an object per line): "
                   "convert it (jq -c '.[]' in.json > in.jsonl) and name the new file in "
                   "input.path")

MESSAGES_NOT_RECORD = ("a line must hold an object: put each line's list under a key "
                       "(jq -c '{messages: .}' in.jsonl > out.jsonl) and name that key in "
                       "input.messages_field")


def line_item(record: dict[str, Any], raw: bytes, line_no: int,
              fields: InputPlan) -> dict[str, Any] | Reject:  # fmt: skip
    """A JSON line's record to an item (`raw`, the line, keys a record without an id)."""
    if fields.format == "openai-batch":
        return batch_item(record, line_no)
    value, template = record.get(fields.id_field), fields.template
    # Nothing built per line unless a value may be a whole number orjson took for a float.
    if (type(value) is float and abs(value) >= _BIG) or (
            template is not None and _any_big(record, template.fields)):
        named = (fields.id_field, *(() if template is None else template.fields))
        record = _whole_numbers(record, raw, named)
    return record_item(record, raw.strip(), line_no, fields)


_BIG = 2.0**63
"""orjson reads a whole number outside 64 bits (past 2**64 - 1, below -2**63) as a float, and
each float at least this far from 0 is whole: only those may be such a number, so only a line
holding one in a field that counts is read again (`_whole_numbers`); a price of 9.99 is not."""


def _any_big(record: Mapping[str, Any], names: Iterable[str]) -> bool:
    """Whether a value of `record` among `names` may be a whole number orjson read as a float
    (`_BIG`)."""
    return any(type(value) is float and abs(value) >= _BIG for value in map(record.get, names))


def _whole_numbers(record: dict[str, Any], raw: bytes, names: tuple[str, ...]) -> dict[str, Any]:
    """The record with each whole number among `names` (the id, template fields) that orjson
    read as a float, one outside 64 bits, as its decimal text: 18446744073709551616 and ...617
    are both 1.8446744073709552e+19 to orjson, so the second line's id was a duplicate of the
    first's, and a template's "Factor {n}" asked about another number. A number written as a
    float (1e20) stays the float it is."""
    exact = _exact(raw)
    if exact is None:
        return record
    whole = {name: str(exact[name]) for name in names
             if isinstance(exact.get(name), int) and not isinstance(exact[name], bool)}
    return {**record, **whole} if whole else record


def _exact(raw: bytes) -> dict[str, Any] | None:
    """A JSON line orjson read as an object, read again with the json module, which reads a
    whole number of any size as the int it is; None where it cannot (an int of more digits than
    Python takes, or nesting deeper than its parser's: the floats orjson read stay, then)."""
    try:
        exact = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return exact if isinstance(exact, dict) else None


def _holds_big(record: dict[str, Any]) -> bool:
    """Whether a value of `record`, at any depth (in its objects and lists), is a float that
    may be a whole number outside 64 bits (`_BIG`). Walked, not scanned: a regex for such a
    number's digits over each line's bytes cost 1.8 ms on a line of 200 kB of prose, and read
    a line with a 19-digit string id twice. A loop, not recursion: orjson nests deeper than
    Python recurses."""
    stack: list[Any] = [record]  # dicts and lists
    while stack:
        held = stack.pop()
        for value in held.values() if type(held) is dict else held:
            kind = type(value)
            if kind is float:
                if abs(value) >= _BIG:
                    return True
            elif kind is dict or kind is list:
                stack.append(value)
    return False


def kept_record(record: dict[str, Any], raw: bytes) -> dict[str, Any]:
    """The record as an export shows it (`InputReader.record`): a whole number outside 64 bits
    among its values, which orjson read as a float, is the number written (an `orjson.Fragment`
    of its digits, which orjson writes as they are; nested ones too, at any depth): otherwise
    an export's `input.id` would not join its `id`, two lines' input.id would be one number,
    and a number in an object the line holds would be shown as another."""
    if not _holds_big(record):  # the ordinary line: read once
        return record
    exact = _exact(raw)
    if exact is None:
        return record
    try:
        return {key: _json_ready(value) for key, value in exact.items()}
    except RecursionError:
        return record


def _json_ready(value: Any) -> Any:
    """`value` (read by the json module) with each int outside 64 bits an orjson.Fragment."""
    if type(value) is int and not -(2**63) <= value < 2**64:
        return orjson.Fragment(str(value))
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_ready(item) for item in value]
    return value


def record_item(
    record: Mapping[str, Any], key: bytes, line_no: int, plan: InputPlan
) -> dict[str, Any] | Reject:
    """A decoded record to an item; `key` stands in for a missing id (content hash)."""
    item_id = _item_id(record, key, plan.id_field)
    if plan.messages_field is not None:
        return _messages_item(record, item_id, line_no, plan)
    if plan.template is not None:
        try:
            text = plan.template.fill(record)
        except MissingField as exc:
            near = "" if exc.field in record else _near(exc.field, record)  # null: it is there
            return Reject(line_no, f"template field '{exc.field}' is missing{near}", item_id)
        # An empty one is what a CSV's empty cell is (a reject), and a blank prompt is not sent.
        fields = plan.template.fields
        empty = (next(f for f in fields if record.get(f) == "")
                 if "" in map(record.get, fields) else None)  # no generator per line: hot
        if empty is not None or not text.strip():
            what = f"field '{empty}' is empty" if empty is not None else "filled is blank"
            return Reject(line_no, f"template {what}", item_id)
    else:
        assert plan.prompt_field is not None
        prompt = record.get(plan.prompt_field)
        if not isinstance(prompt, str):
            what = ("missing" + _near(plan.prompt_field, record) if plan.prompt_field not in record
                    else f"{json_kind(prompt)}, not a string")
            return Reject(line_no, f"prompt field '{plan.prompt_field}' is {what}", item_id)
        if not prompt.strip():  # sent, it would be paid for and answer nothing asked
            return Reject(line_no, f"prompt field '{plan.prompt_field}' is empty", item_id)
        text = prompt
    if plan.system_prompt is None:
        return {"id": item_id, "prompt": text}
    system = {"role": "system", "content": plan.system_prompt}
    return {"id": item_id, "messages": [system, {"role": "user", "content": text}]}


def _near(field: str, record: Mapping[str, Any]) -> str:
    """A hint naming the record's key closest to a missing `field`, when one is close: a typo in
    input.prompt_field rejects every line, and each reject then says what was meant."""
    close = difflib.get_close_matches(field, [str(key) for key in record], n=1, cutoff=0.6)
    return f" (the line has '{close[0]}': is that the field?)" if close else ""


def _messages_item(
    record: Mapping[str, Any], item_id: str, line_no: int, plan: InputPlan
) -> dict[str, Any] | Reject:
    field = plan.messages_field
    assert field is not None
    if field not in record:  # as a prompt field's: a typo in the job rejects every line
        return Reject(line_no, f"messages field '{field}' is missing{_near(field, record)}",
                      item_id)
    messages = record.get(field)
    if isinstance(messages, str):  # a CSV cell (or Parquet string) holding the list as JSON
        try:
            messages = orjson.loads(messages)
        except orjson.JSONDecodeError:
            return Reject(line_no, f"messages field '{field}' is text but not a JSON list",
                          item_id)
    if not isinstance(messages, list) or not messages:
        return Reject(line_no, f"messages field '{field}' must be a non-empty list", item_id)
    if problem := messages_problem(messages, field, other_items=plan.responses):
        return Reject(line_no, problem, item_id)
    return {"id": item_id, "messages": messages}


def batch_item(record: Mapping[str, Any], line_no: int) -> dict[str, Any] | Reject:
    """An OpenAI Batch input line (`custom_id`, `method`, `url`, `body`) to a body item."""
    custom_id, url, body = record.get("custom_id"), record.get("url"), record.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        named = None if custom_id in (None, "") else orjson.dumps(custom_id).decode()
        what = "missing" if named is None else f"{json_kind(custom_id)}, not a string"
        return Reject(line_no, f"custom_id is {what} (a non-empty string is required)", named)
    if record.get("method") != "POST":
        return Reject(line_no, f"method must be POST, got {_short(record.get('method'))}",
                      custom_id)
    api = BATCH_URLS.get(url) if isinstance(url, str) else None
    if api is None:
        return Reject(line_no, "url must be /v1/chat/completions, /v1/completions or "
                               f"/v1/responses, got {_short(url)}", custom_id)  # fmt: skip
    if not isinstance(body, dict):
        return Reject(line_no, f"body must be a JSON object, got {_short(body)}", custom_id)
    need = {"chat": "messages", "completions": "prompt", "responses": "input"}[api]
    if body.get(need) is None:
        return Reject(line_no, f"body has no '{need}' (required for {url})", custom_id)
    if problem := _body_problem(need, body[need]):
        return Reject(line_no, problem, custom_id)
    if api == "responses" and (chat_limit := next(
            (k for k in ("max_tokens", "max_completion_tokens") if k in body), None)):
        # The Responses API refuses the chat names (HTTP 400): no request could succeed.
        return Reject(line_no, f"body.{chat_limit} does not apply to /v1/responses, whose token "
                               "limit is max_output_tokens", custom_id)  # fmt: skip
    if body.get("n", 1) != 1:
        return Reject(line_no, f"body asks for n = {_short(body['n'])} answers; a result holds "
                               "one, so give one line per answer", custom_id)  # fmt: skip
    return {"id": custom_id, "body": body, "url": url}


def _body_problem(need: str, given: object) -> str | None:
    """What keeps a Batch body's prompt, input or messages from being asked, as a reject's
    reason, or None: an empty or blank text and an empty list would be paid for and ask nothing
    (a rejected line in every format), and a chat message list gets the shape check a
    messages_field gets (a list no server takes would fail there, a request per item). A
    Responses `input` list holds items of other types too, and a completions prompt a list of
    texts or token ids: only their emptiness is checked."""
    where = f"body.{need}"
    if isinstance(given, str):
        if need == "messages":
            return f"{where} is text, not a list of messages"
        return None if given.strip() else f"{where} is empty"
    if not isinstance(given, list):
        return f"{where} is {json_kind(given)}, not a text or a list"
    if not given:
        return f"{where} is an empty list"
    return messages_problem(given, where) if need == "messages" else None


def _short(value: object) -> str:
    """A rejected value for a reason sentence: JSON, at most 40 characters."""
    return ellipsize(orjson.dumps(value, default=str).decode(), 40)


def _item_id(record: Mapping[str, Any], key: bytes, id_field: str) -> str:
    """The input's own id as a string, or a content hash when the record has none.

    A number is its decimal text (1 and "1" are one id); true, false, an object or a list is
    its JSON text, so that the id matches the input's own spelling (an export's `id` joins its
    `input.id`), not Python's (`True`, `{'x': 1}`)."""
    value = record.get(id_field)
    if value is None or value == "":
        return "h" + hashlib.blake2b(key, digest_size=10).hexdigest()
    if isinstance(value, str):
        return value
    if isinstance(value, bool | dict | list):
        return orjson.dumps(value).decode()
    return str(value)
