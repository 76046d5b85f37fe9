"""Record streams for the two tabular input formats: CSV (csv module) and Parquet (pyarrow).

Both stream: CSV through a text wrapper over the file, one row at a time; Parquet one record
batch at a time. Neither ever holds the whole input. The columns a job needs are checked
against the header (or schema) when the file is opened, so a misnamed column is one error
before the run starts, not a reject per row.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import io
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, cast

import orjson

from shardrun.errors import InputError

Row = tuple[int, dict[str, Any] | str, bytes]
"""(line number, the record or a reject reason, bytes that identify it for a derived id)."""

PARQUET_EXTRA = ("reading Parquet needs the parquet extra: in shardrun's directory, "
                 ".venv/bin/pip install -e '.[parquet]'")
PARQUET_BATCH_ROWS = 1024
# A long prompt in one cell is normal (128 KiB, the csv module's default, is not enough), but the
# reader holds a cell as 4 bytes a character, in a buffer it never shrinks: 16 Mi characters is
# the 64 MiB a JSON line may take (inputs.MAX_LINE_BYTES), and more than any model reads. At 64 Mi
# one stray quote in a big file grew the coordinator by 256 MiB for the rest of the run.
_CSV_FIELD_LIMIT = 16 * 1024 * 1024
# A row longer than this leaves the reader's buffer at least that large: a new reader on the
# same text lets it go. (Measured in the row's UTF-8 bytes where those are at hand: at most 4
# a character, so a non-ASCII row may renew a little early, never late.)
_CSV_RENEW_AFTER = 1024 * 1024
CHUNK = 1 << 20


class HashingRaw(io.RawIOBase):
    """A readable raw stream that passes every byte it reads to `on_bytes`."""

    def __init__(self, file: IO[bytes], on_bytes: Callable[[bytes], None],
                 on_end: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._file, self._on_bytes, self._on_end = file, on_bytes, on_end

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._file.read(len(buffer))
        buffer[: len(data)] = data
        if data:
            self._on_bytes(data)
        elif self._on_end is not None and len(buffer):  # the file's end (or a cut: on_end)
            self._on_end()
        return len(data)

    def close(self) -> None:
        self._file.close()
        super().close()


def check_columns(path: Path, have: Sequence[str], need: Sequence[str], what: str) -> None:
    """InputError naming the first needed column the header or schema lacks or repeats."""
    for name in need:
        if name not in have:
            if what == "CSV header" and len(have) == 1 and (sep := _other_separator(have[0], name)):
                raise InputError(f"{path}: the CSV header is one column, {have[0]!r}: the "
                                 f"file separates its columns with {sep!r}, but a CSV input "
                                 "must separate them with commas; save it comma-separated")
            shown = ", ".join(have[:20]) + (", ..." if len(have) > 20 else "")
            # As a JSON line's missing field is (`inputs._near`): the closest name, when one
            # is close, is named even past the first 20 shown.
            close = difflib.get_close_matches(name, list(have), n=1, cutoff=0.6)
            near = f" (is '{close[0]}' the column meant?)" if close else ""
            raise InputError(f"{path}: the {what} has no column '{name}'{near}; it has: {shown}")
        if list(have).count(name) > 1:
            raise InputError(f"{path}: the {what} names column '{name}' more than once")


def _other_separator(header: str, name: str) -> str | None:
    """The separator other than a comma (`;`, a tab, `|`) that splits a one-column header into
    columns among which `name` is, if one does: the file was written with it."""
    return next((sep for sep in (";", "\t", "|") if name in header.split(sep)), None)


class CsvRows:
    """Rows of a CSV file with a header row, as records of the non-empty cells."""

    def __init__(self, path: Path, file: IO[bytes], on_bytes: Callable[[bytes], None],
                 on_end: Callable[[], None] | None = None) -> None:
        csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))
        buffered = io.BufferedReader(HashingRaw(file, on_bytes, on_end), CHUNK)
        # surrogateescape: a bad byte becomes a reject of its row, not a crash of the run.
        self._text = io.TextIOWrapper(buffered, "utf-8-sig", "surrogateescape", newline="")
        # strict: a quote that closes in the wrong place is an error, not a cell swallowing the
        # rows up to the next quote character (one stray quote would silently merge hundreds of
        # rows into one prompt, and the run would call itself successful).
        self._reader = csv.reader(self._text, strict=True)
        self._lines_before = 0  # lines the readers renewed before this one read
        try:
            self.header = next(self._reader, [])
        except csv.Error as exc:
            raise InputError(f"{path}: cannot read the CSV header ({exc})") from None
        if not self.header:
            raise InputError(f"{path}: the CSV file is empty; its first row must be a header")
        self._cells: list[str] = []  # the row last read, so a reject can still name its id
        self.open_quote = False  # the file ended inside a quoted cell of the last row read

    def cell(self, name: str) -> str | None:
        """The value under column `name` in the row last read, None when it is empty or the row
        ended before it (a row of the wrong width keeps the values it has, in header order)."""
        if name not in self.header:
            return None
        at = self.header.index(name)
        return (self._cells[at] or None) if at < len(self._cells) else None

    @property
    def line_num(self) -> int:
        return self._lines_before + self._reader.line_num

    def _renew_reader(self) -> None:
        """A new reader where the last one stopped: the cell buffer a long row or a runaway
        quoted cell grew goes with the old one (the csv module keeps it at its largest)."""
        self._lines_before += self._reader.line_num
        self._reader = csv.reader(self._text, strict=True)

    def __iter__(self) -> Iterator[Row]:
        return cast("Iterator[Row]", self.rows(blanks=False))

    def rows(self, blanks: bool) -> Iterator[Row | tuple[int, None, bytes]]:
        """The rows, as iterating gives them; with `blanks`, a row without a record for each
        blank line passed over (`InputReader.entries`)."""
        width = len(self.header)
        while True:
            start = self.line_num + 1
            self._cells = []
            try:
                cells = next(self._reader)
            except StopIteration:
                return
            except csv.Error as exc:
                # Strict, the reader says this only where the file ends inside a quoted cell.
                self.open_quote = str(exc) == "unexpected end of data"
                end = self.line_num
                self._renew_reader()  # the cell it ran away in may have reached the limit
                if str(exc).startswith("field larger than field limit"):
                    yield start, _too_long_cell(start, end), b""
                elif end > start:  # the rows the broken one ran into are lost with it: say so
                    yield start, (f"not valid CSV ({exc} on line {end}): a quote opened in this "
                                  f"row is never closed where it should be, so lines "
                                  f"{start}-{end} were read as one row and are rejected"), b""
                else:
                    yield start, f"not valid CSV ({exc})", b""
                continue
            if not cells or cells == [""]:
                if blanks:
                    yield start, None, b""
                continue
            self._cells = cells
            if len(cells) != width:
                if sum(map(len, cells)) > _CSV_RENEW_AFTER:  # a quote run on to the next one
                    self._renew_reader()
                yield start, _width_reason(len(cells), width), b""
                continue
            key = "\x1f".join(cells).encode("utf-8", "surrogateescape")
            if len(key) > _CSV_RENEW_AFTER:
                self._renew_reader()
            yield start, {k: v for k, v in zip(self.header, cells, strict=True) if v != ""}, key

    def read_on(self) -> Iterator[bytes]:
        """The rest of the file past the row last read, in blocks of its own bytes (hashed and
        counted as read, like the rows)."""
        while chunk := self._text.read(CHUNK):
            yield chunk.encode("utf-8", "surrogateescape")

    def close(self) -> None:
        self._text.close()


def _too_long_cell(start: int, end: int) -> str:
    """Why a row with a cell past the csv module's field limit is a reject: the limit, not a
    quote, where the row is one line; where it ran on over several, a quote never closed is as
    likely as a cell that long, and the lines after it are read as rows again."""
    said = (f"a cell is longer than the {csv.field_size_limit():,} characters a CSV cell may "
            "hold")
    if end == start:
        return f"{said}; a record that long would ask more than any model reads: shorten it"
    return (f"{said} by line {end}, so lines {start}-{end} were read as one row and are "
            f"rejected, and line {end + 1} on is read as rows again: close the quote opened in "
            "this row where it should be, or, if the cell is meant to be that long, shorten it "
            "(the rows read from the rest of it are not records)")


def _width_reason(values: int, width: int) -> str:
    """Why a row of the wrong width is rejected, and what likely went wrong in it."""
    fix = ("a value holding a comma must be in double quotes" if values > width else
           "give every column a value, empty ones too, as in 'a,,c'")
    return (f"row has {values} value{'s' * (values != 1)} but the header has {width} "
            f"columns; {fix}")


def not_utf8(record: dict[str, Any], names: Sequence[str]) -> str | None:
    """The first of `names` whose CSV value held bytes that are not UTF-8, else None."""
    for name in names:
        value = record.get(name)
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return name
    return None


class ParquetRows:
    """Rows of a Parquet file, read one record batch at a time (needs pyarrow)."""

    def __init__(self, path: Path, need: Sequence[str], optional: Sequence[str],
                 every_column: bool = False) -> None:  # fmt: skip
        try:
            import pyarrow.parquet as pq  # type: ignore[import-untyped, import-not-found, unused-ignore]
        except ImportError:
            raise InputError(f"{path}: {PARQUET_EXTRA}") from None
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        try:
            self._pf = pq.ParquetFile(self._file)
        except Exception as exc:  # pyarrow raises its own ArrowInvalid for a non-Parquet file
            self._file.close()
            raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
        self.names = list(self._pf.schema_arrow.names)
        check_columns(path, self.names, need, "Parquet schema")
        # The columns an item is made of; a record without an id is keyed by their values.
        self.columns = [*dict.fromkeys([*need, *(c for c in optional if c in self.names)])]
        self._every_column = every_column
        self.num_rows = int(self._pf.metadata.num_rows)
        self.rows_read = 0

    def __iter__(self) -> Iterator[Row]:
        """Rows of the item's columns, or of every column with `every_column` (an export that
        shows the input): the content key is made of the item's columns either way, so an id
        is the same whichever columns were read."""
        read = self.names if self._every_column else self.columns
        for batch in self._pf.iter_batches(PARQUET_BATCH_ROWS, columns=read or None):
            for row in batch.to_pylist():
                self.rows_read += 1
                record = {k: v for k, v in row.items() if v is not None}
                keyed = {k: row[k] for k in self.columns} if self._every_column else row
                yield self.rows_read, record, orjson.dumps(keyed, default=str)

    def close(self) -> None:
        self._file.close()


def file_sha256(path: Path) -> tuple[Any, int]:
    """(sha256 object, size) of a whole file, read in 1 MiB chunks."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha, size
