"""Tests for the input reader: JSONL, CSV, Parquet, OpenAI Batch lines, templates, bodies."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import itertools
import json
import lzma
import os
import subprocess
import sys
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from shardrun import inputs
from shardrun._tabular import CHUNK
from shardrun._template import TemplateError, parse_template
from shardrun.errors import InputError
from shardrun.inputs import (
    BOM,
    FieldMap,
    InputPlan,
    InputReader,
    Reject,
    holds_more,
    make_reader,
    parse_line,
)
from shardrun.items import PART_TOKENS, build_request, estimate_prompt_tokens, prompt_chars
from shardrun.runner import check_strictly
from shardrun.spec import load_job
from tests.conftest import only_run, run_cli, write_job

Entry = dict[str, Any] | Reject


def read_all(path: Path, plan: InputPlan) -> list[Entry]:
    """Every item and reject of a file."""
    reader = InputReader(path, plan)
    try:
        return list(reader)
    finally:
        reader.close()


def jsonl(path: Path, *records: object) -> Path:
    """Write records as JSON lines (bytes are written as they are)."""
    with open(path, "wb") as f:
        for r in records:
            f.write((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n")
    return path


def job_for(tmp_path: Path, input_yaml: str, api: str = "chat") -> Any:
    """A loaded job whose input section is `input_yaml` (a YAML flow mapping)."""
    path = tmp_path / "job.yaml"
    path.write_text(
        f"endpoint: {{base_url: 'sim://', model: m, api: {api}}}\ninput: {input_yaml}\n"
    )
    return load_job(path, env={}, flags={})


# -- JSON lines -------------------------------------------------------------------------------


def test_jsonl_prompt_items_ids_and_rejects(tmp_path: Path) -> None:
    """Prompts become {id, prompt}; ids are kept, derived from content when absent; bad lines
    are rejects with their line number; blank lines are skipped."""
    path = jsonl(tmp_path / "in.jsonl", {"id": 7, "prompt": "a"}, {"prompt": "b"}, b"",
                 b"{not json", [1], {"id": "x", "prompt": 3}, {"id": "y", "prompt": None},
                 {"id": "z", "prompt": ["a"]}, {"id": "w", "prompt": True}, b"null",
                 b'"text"')  # fmt: skip
    got = read_all(path, InputPlan())
    assert got[0] == {"id": "7", "prompt": "a"}
    assert isinstance(got[1], dict) and got[1]["id"].startswith("h") and len(got[1]["id"]) == 21
    assert [(r.line, r.reason.split(" (")[0]) for r in got[2:] if isinstance(r, Reject)] == [
        (4, "not valid JSON"),
        (5, "expected a JSON object, got a list"),
        (6, "prompt field 'prompt' is a number, not a string"),
        (7, "prompt field 'prompt' is null, not a string"),
        (8, "prompt field 'prompt' is a list, not a string"),
        (9, "prompt field 'prompt' is true, not a string"),
        # In JSON's words, not Python's ("got NoneType", "got str").
        (10, "expected a JSON object, got null"),
        (11, "expected a JSON object, got a string"),
    ]


def test_a_json_array_file_is_rejected_saying_it_is_no_json_lines(tmp_path: Path) -> None:
    """A .json file holding one array of records, indented or on one line, is a common slip
    for JSON lines: its first line's reject says so and how to convert it, where it said only
    "not valid JSON (unexpected end of data)" or "got a list"; a list of other things does
    not get the note."""
    records = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}]
    indented = tmp_path / "indented.json"
    indented.write_text(json.dumps(records, indent=2) + "\n")
    one_line = jsonl(tmp_path / "one.json", records, [1, 2])
    hint = "the file looks like one JSON array, not JSON lines (an object per line): convert it"
    first = read_all(indented, InputPlan())[0]
    assert isinstance(first, Reject) and first.line == 1 and hint in first.reason
    got = read_all(one_line, InputPlan())
    assert [(r.line, hint in r.reason) for r in got if isinstance(r, Reject)] == [
        (1, True), (2, False)]


def test_a_json_lines_file_of_message_lists_is_not_told_to_split_them(tmp_path: Path) -> None:
    """A conversation a line, each a bare list of messages, is valid JSON lines whose records
    are not objects: its reject says to put each list under a key for input.messages_field,
    not that the file is one JSON array to split with jq -c '.[]', which would make every
    message an item."""
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]]
    got = read_all(jsonl(tmp_path / "chats.jsonl", *chats), InputPlan())
    assert [r.reason for r in got if isinstance(r, Reject)] == [
        "expected a JSON object, got a list of messages; a line must hold an object: put each "
        "line's list under a key (jq -c '{messages: .}' in.jsonl > out.jsonl) and name that "
        "key in input.messages_field"] * 2


def test_a_json_line_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 (a Latin-1 file, a stray binary byte) are named with their
    column, not as orjson's "surrogates not allowed"."""
    path = jsonl(tmp_path / "in.jsonl", b'{"id": "a", "prompt": "caf\xe9"}', {"prompt": "ok"})
    got = read_all(path, InputPlan())
    assert got[0] == Reject(1, "not valid UTF-8 (byte 0xe9 at column 27); save the file as "
                               "UTF-8")
    assert isinstance(got[1], dict)


def test_a_bom_at_any_lines_start_is_passed_over(tmp_path: Path) -> None:
    """Two files saved with a BOM and joined by `cat`: the second file's first line was a reject
    ("UTF-8 byte order mark (BOM) is not supported"), its record lost to the run (an edited
    input cannot be resumed). The BOM is passed over wherever a line starts with one."""
    path = jsonl(tmp_path / "in.jsonl", BOM + b'{"id": "a", "prompt": "x"}',
                 BOM + b'{"id": "b", "prompt": "y"}', BOM + b'{"prompt": "z"}')
    got = read_all(path, InputPlan())
    assert got[:2] == [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}]
    # A record without an id is named by its content, the BOM left out.
    assert got[2] == {"id": "h" + hashlib.blake2b(b'{"prompt": "z"}', digest_size=10).hexdigest(),
                      "prompt": "z"}


def test_an_empty_or_blank_prompt_is_a_reject_in_json_lines_as_in_csv(tmp_path: Path) -> None:
    """An empty prompt asks nothing and is paid for all the same: rejected, as CSV rejects an
    empty cell, whatever the format."""
    path = jsonl(tmp_path / "in.jsonl", {"id": "a", "prompt": ""}, {"id": "b", "prompt": " \n"},
                 {"id": "c", "prompt": "ok"})
    assert read_all(path, InputPlan()) == [
        Reject(1, "prompt field 'prompt' is empty", "a"),
        Reject(2, "prompt field 'prompt' is empty", "b"), {"id": "c", "prompt": "ok"}]


def test_an_id_that_is_not_a_string_keeps_its_json_spelling(tmp_path: Path) -> None:
    """true, an object or a list as an id is its JSON text (an export's id then joins its
    input.id), not Python's True or {'x': 1}; a number is its decimal text."""
    path = jsonl(tmp_path / "in.jsonl", {"id": True, "prompt": "a"},
                 {"id": {"y": 2, "x": 1}, "prompt": "b"}, {"id": [1, "a"], "prompt": "c"},
                 {"id": 7, "prompt": "d"}, {"id": 2.5, "prompt": "e"})
    assert [item["id"] for item in read_all(path, InputPlan()) if isinstance(item, dict)] == [
        "true", '{"y":2,"x":1}', '[1,"a"]', "7", "2.5"]


def test_a_number_id_is_its_value_not_its_spelling(tmp_path: Path) -> None:
    """As the README says: 1e2 and 100.0 are one id, "100.0" (orjson gives the value only)."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1e2, "prompt": "a"}\n{"id": 100.0, "prompt": "b"}\n'
                    '{"id": 0100, "prompt": "c"}\n')
    read = read_all(path, InputPlan())
    assert [item["id"] for item in read if isinstance(item, dict)] == ["100.0", "100.0"]
    assert isinstance(read[2], Reject)  # a leading zero is no JSON number


def test_a_whole_number_id_past_64_bits_keeps_its_value(tmp_path: Path) -> None:
    """orjson reads a whole number outside 64 bits as a float: two such ids were one id, the
    second line a "duplicate", and the id was not the input's. Each is its own decimal text."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 18446744073709551616, "prompt": "a"}\n'
                    '{"id": 18446744073709551617, "prompt": "b"}\n'
                    '{"id": -99999999999999999999, "prompt": "c"}\n'
                    '{"id": 1e20, "prompt": "d"}\n')
    assert [item["id"] for item in read_all(path, InputPlan()) if isinstance(item, dict)] == [
        "18446744073709551616", "18446744073709551617", "-99999999999999999999", "1e+20"]
    # Nesting deeper than the json module parses (orjson's limit is higher): the float, no crash.
    deep = b'{"id": 18446744073709551616, "prompt": "x", "d": %s}' % (b"[" * 999 + b"]" * 999)
    assert parse_line(deep, 1, InputPlan()) == {"id": "1.8446744073709552e+19", "prompt": "x"}
    # A template field holding one is asked about as written, not as the float orjson reads.
    plan = InputPlan(prompt_field=None, template=parse_template("Factor {n} ({m})"))
    line = b'{"id": 1, "n": 123456789012345678901234567890, "m": 1e2}'
    assert parse_line(line, 1, plan) == {
        "id": "1", "prompt": "Factor 123456789012345678901234567890 (100.0)"}


def test_a_kept_record_shows_whole_numbers_past_64_bits_as_written_at_any_depth(
        tmp_path: Path) -> None:
    """An export's input (`keep_records`) shows each whole number outside 64 bits as written,
    nested ones in a line whose top holds none too (they were shown as orjson's float,
    1.8446744073709552e+19, another number); floats, and digits in a text, stay as they are."""
    path = tmp_path / "in.jsonl"
    lines = [b'{"id": 1, "prompt": "a", "meta": {"n": [18446744073709551617, 2.5]}}',
             b'{"id": 2, "prompt": "b", "m": {"k": -9223372036854775809, "f": 1e20}}',
             b'{"id": 3, "prompt": "c", "t": "12345678901234567890", "n": 7}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    reader = InputReader(path, InputPlan(), keep_records=True)
    shown = []
    for _ in reader:
        shown.append(orjson.dumps(reader.record))
    assert shown == [b'{"id":1,"prompt":"a","meta":{"n":[18446744073709551617,2.5]}}',
                     b'{"id":2,"prompt":"b","m":{"k":-9223372036854775809,"f":1e+20}}',
                     b'{"id":3,"prompt":"c","t":"12345678901234567890","n":7}']


def second_reads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The lines the reader reads again with the json module (`inputs._exact`), as it does."""
    reads: list[bytes] = []
    real = json.loads

    def loads(raw: bytes) -> Any:
        reads.append(raw)
        return real(raw)

    monkeypatch.setattr(json, "loads", loads)
    return reads


def test_a_kept_record_is_read_again_only_for_a_float_past_64_bits_at_any_depth(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An export's input (`keep_records`) reads a line again (json module) only when orjson
    read a float 2**63 from 0 or more in it, at any depth: a line with a 19-digit string id, or
    a whole number within 64 bits, is read once (a scan of its bytes for 19 digits read both
    twice, and cost 1.8 ms on a line of 200 kB of prose)."""
    reads = second_reads(monkeypatch)
    lines = [b'{"id": "1234567890123456789012", "prompt": "a", "t": "9999999999999999999"}',
             b'{"id": 2, "prompt": "b", "n": 12345678901234567890, "m": -9223372036854775808}',
             b'{"id": 3, "prompt": "c", "l": [{"x": [18446744073709551616]}]}']
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    reader = InputReader(path, InputPlan(), keep_records=True)
    shown = [orjson.dumps(reader.record) for _ in reader]
    assert shown == [orjson.dumps(orjson.loads(line)) for line in lines[:2]] + [
        b'{"id":3,"prompt":"c","l":[{"x":[18446744073709551616]}]}']
    assert reads == [lines[2] + b"\n"]


def test_only_a_float_that_may_be_a_whole_number_past_64_bits_is_read_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second read of the line (json module) is for a float orjson may have made of a whole
    number outside 64 bits (2**63 from 0 or more), in the id or a template field: a line with
    an id 1.5 or a price 9.99 is read once, as every line was before (it tripled a reader's
    time over such lines)."""
    reads = second_reads(monkeypatch)
    plan = InputPlan(prompt_field=None, template=parse_template("Price {price}"))
    assert parse_line(b'{"id": 1.5, "price": 9.99}', 1, plan) == {
        "id": "1.5", "prompt": "Price 9.99"}
    assert parse_line(b'{"id": -9.2e18, "price": 1e15}', 2, plan)["id"] == "-9.2e+18"
    assert reads == []
    line = b'{"id": 1, "price": -9223372036854775809}'
    assert parse_line(line, 3, plan)["prompt"] == "Price -9223372036854775809"
    assert reads == [line]


def test_a_bom_cut_by_the_end_of_a_block_is_judged_whole(tmp_path: Path) -> None:
    """holds_more reads the tail in blocks of 64 KiB: a line holding only a BOM whose bytes
    the block's end cuts is blank still (the reader passes over it), and one after a space on
    its line, which the reader rejects, is more (the next block starting with it too)."""
    path = tmp_path / "in.jsonl"
    for cut in (0, 1, 2):
        path.write_bytes(b"\n" * ((1 << 16) - cut) + BOM + b"\n" + BOM)
        assert not holds_more(path, 0, "jsonl")
        path.write_bytes(b"\n" * ((1 << 16) - cut - 1) + b" " + BOM + b"\n")
        assert holds_more(path, 0, "jsonl")


def test_reader_hashes_and_counts_every_byte(tmp_path: Path) -> None:
    """sha, bytes_read and lines_read cover the whole file (a leading BOM included, and
    ignored by the parser) after iteration."""
    path = jsonl(tmp_path / "in.jsonl", b'\xef\xbb\xbf{"prompt": "a"}', b"", {"prompt": "b"})
    reader = InputReader(path, FieldMap("id", "prompt", None))
    assert [type(e) for e in reader] == [dict, dict]
    data = path.read_bytes()
    assert reader.sha.hexdigest() == hashlib.sha256(data).hexdigest()
    assert (reader.bytes_read, reader.lines_read) == (len(data), 3)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_reader_stopped_early_hashes_a_prefix_of_the_file(tmp_path: Path, fmt: str) -> None:
    """A pass that stops after a few items (`--limit`, a stop) records the hash of the file's
    first bytes_read bytes, which hold every line it used: for JSON lines exactly those, for a
    CSV up to the end of a block, for Parquet (random access) the whole file."""
    rows = [{"id": f"i{i}", "prompt": f"prompt {i} " * 5} for i in range(3000)]
    path = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    elif fmt == "csv":
        path.write_text("id,prompt\n" + "".join(f"{r['id']},{r['prompt']}\n" for r in rows))
    else:
        pa = pytest.importorskip("pyarrow")
        pytest.importorskip("pyarrow.parquet").write_table(pa.Table.from_pylist(rows), path)
    reader = InputReader(path, InputPlan(format=fmt))  # type: ignore[arg-type]
    used = list(itertools.islice(reader, 10))
    reader.close()
    assert [item["id"] for item in used] == [f"i{i}" for i in range(10)]  # type: ignore[index]
    data = path.read_bytes()
    assert reader.bytes_read > 0 and reader.sha.hexdigest() == hashlib.sha256(
        data[: reader.bytes_read]).hexdigest()
    need = {"jsonl": 10, "csv": 11}.get(fmt)  # lines, with the CSV header
    if need is None:
        assert reader.bytes_read == len(data)
    else:
        assert data[: reader.bytes_read].count(b"\n") >= need
    if fmt == "jsonl":
        assert reader.bytes_read == sum(len(orjson.dumps(r)) + 1 for r in rows[:10])


BATCH_LINE = (b'{"custom_id":"a","method":"POST","url":"/v1/chat/completions",'
              b'"body":{"messages":[{"role":"user","content":"hi"}]}}')


@pytest.mark.parametrize(("fmt", "data", "limit", "open_end"), [
    ("jsonl", b'{"prompt":"a"}\n{"prompt":"b"}', None, "line"),
    ("jsonl", b'{"prompt":"a"}\n{"prompt":"b"}\n', None, None),
    ("jsonl", b'{"prompt":"a"}\n{"prompt":"b"}\r', None, "line"),  # JSON lines end at LF only
    ("jsonl", b'{"prompt":"a"}\n{"prompt":"b"}', 1, None),  # its last line was never read
    ("openai-batch", BATCH_LINE, None, "line"),
    ("openai-batch", BATCH_LINE + b"\n", None, None),
    ("csv", b"id,prompt\na,p\nb,q", None, "line"),
    ("csv", b"id,prompt\r\na,p\r\nb,q\r\n", None, None),
    ("csv", b"id,prompt\ra,p\rb,q\r", None, None),  # a lone CR ends a CSV line
    ("csv", b"id,prompt\ra,p\rb,q", None, "line"),
    ("csv", b"id,prompt\ra,p\rb,q", 1, None),  # lone CRs count as the line breaks they are
    # A CRLF split between two blocks the reader reads is one line break, not two.
    ("csv", b"id,prompt\r\na," + b"x" * (CHUNK - 14) + b"\r\nb,q", None, "line"),
    ("csv", b"id,prompt\na,p\nb,q", 1, None),  # read to the file's end, but not its last row
    ("csv", b'id,prompt\na,p\nb,"q\n', None, "quote"),
])
def test_open_end_says_how_the_files_end_cut_off_the_last_record_read(
        tmp_path: Path, fmt: str, data: bytes, limit: int | None, open_end: str | None) -> None:
    """A last record the file's end cut off (no line break, or a quoted CSV cell never closed)
    is what text appended later would run on into: a resume must know of it."""
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    reader = InputReader(path, InputPlan(format=fmt))  # type: ignore[arg-type]
    assert len(list(itertools.islice(reader, limit))) == limit or limit is None
    reader.close()
    assert reader.open_end == open_end


def test_a_parquet_file_has_no_open_end(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "in.parquet"
    pytest.importorskip("pyarrow.parquet").write_table(
        pa.Table.from_pylist([{"id": "a", "prompt": "p"}]), path)
    reader = InputReader(path, InputPlan(format="parquet"))
    assert len(list(reader)) == 1 and reader.open_end is None


def test_missing_input_is_an_input_error(tmp_path: Path) -> None:
    """A missing file names itself and the job key, for every format."""
    for fmt in ("jsonl", "csv", "parquet"):
        with pytest.raises(InputError, match=r"does not exist; check input\.path"):
            InputReader(tmp_path / "nope", InputPlan(format=fmt))  # type: ignore[arg-type]
    # A directory (input.path: .) says so, and names the key too.
    for fmt in ("jsonl", "csv", "parquet"):
        with pytest.raises(InputError, match=r"is a directory; input\.path in the job file must "
                                             "name a file"):
            InputReader(tmp_path, InputPlan(format=fmt))  # type: ignore[arg-type]


@pytest.mark.parametrize(("fmt", "data", "what"), [
    ("jsonl", gzip.compress(b'{"prompt": "a"}\n'), "gzip-compressed"),
    ("csv", gzip.compress(b"id,prompt\n1,a\n"), "gzip-compressed"),
    ("jsonl", bz2.compress(b'{"prompt": "a"}\n'), "bzip2-compressed"),
    ("jsonl", lzma.compress(b'{"prompt": "a"}\n'), "xz-compressed"),
    ("jsonl", b"\x28\xb5\x2f\xfd\x00\x58", "zstd-compressed"),
    ("jsonl", '{"prompt": "a"}\n'.encode("utf-16"), "UTF-16 text"),
    ("csv", "id,prompt\n1,a\n".encode("utf-16"), "UTF-16 text"),
    ("openai-batch", b"\xfe\xff" + '{"prompt": "a"}\n'.encode("utf-16-be"), "UTF-16 text"),
    ("jsonl", '{"prompt": "a"}\n'.encode("utf-32"), "UTF-32 text"),
    ("jsonl", b"PAR1\x15\x04\x15P\x15@L\x15\x00\x1c\x00\x00\x00PAR1", "a Parquet file"),
    ("jsonl", '{"prompt": "a"}\n'.encode("utf-16-le"), "UTF-16 text"),
    ("csv", "id,prompt\n1,a\n".encode("utf-16-be"), "UTF-16 text"),
], ids=["gzip", "gzip-csv", "bzip2", "xz", "zstd", "utf16", "utf16-csv", "utf16be-batch",
        "utf32", "parquet-as-jsonl", "utf16le-no-bom", "utf16be-no-bom-csv"])
def test_a_compressed_or_utf16_input_is_one_input_error(
    tmp_path: Path, fmt: str, data: bytes, what: str
) -> None:
    """A gzip file or a UTF-16 export (Excel's "Unicode text", PowerShell's `>`) is one error
    naming what the file is and what to do, not a reject per line, each "not valid UTF-8"."""
    path = tmp_path / "in.data"
    path.write_bytes(data)
    with pytest.raises(InputError, match=f"^input file {path} is {what}, not UTF-8 text; "):
        InputReader(path, InputPlan(format=fmt))  # type: ignore[arg-type]


def test_a_file_starting_with_what_a_compressed_file_could_does_not_fail(tmp_path: Path) -> None:
    """Only a whole magic number is refused: a CSV header naming a column "BZh" is read, and
    one "PAR1\u00e9" (a byte no ASCII text has after "PAR1", in a file not ending as Parquet's
    does, with "PAR1")."""
    path = tmp_path / "in.csv"
    for header in (b"BZh,prompt", b"PAR1,prompt", b"PAR1 x,prompt", "PAR1\u00e9,prompt".encode()):
        path.write_bytes(header + b"\n1,a\n")
        got = read_all(path, InputPlan(format="csv"))
        assert [entry["prompt"] for entry in got if isinstance(entry, dict)] == ["a"]


_READ_ALL = """
import sys
from pathlib import Path
from shardrun.inputs import InputPlan, InputReader, Reject
reader = InputReader(Path(sys.argv[1]), InputPlan())
for entry in reader:
    print(entry.reason if isinstance(entry, Reject) else entry["id"])
print(reader.lines_read, reader.bytes_read)
# The peak of this process's memory, not ru_maxrss: Linux carries the parent's over an exec.
status = Path("/proc/self/status").read_text()
print(int(next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM:"))) // 1024)
"""


def test_a_line_of_200_mb_is_one_reject_read_in_bounded_memory(tmp_path: Path) -> None:
    """A line of 200 MB (a file that lost its line breaks, a stray dump) was read whole, and
    parsed: the reader's process peaked at 620 MiB. It is one reject saying what it is, read
    past in blocks (peak 23 MiB, the interpreter's and a block or two; 148 MiB when the 64 MiB
    a line may hold was read first), the lines around it read as ever, and every byte counted.
    In a process of its own, whose peak is its own."""
    path = tmp_path / "in.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"id": "a", "prompt": "p"}\n{"id": "big", "prompt": "')
        for _ in range(200):
            f.write(b"x" * (1 << 20))
        f.write(b'"}\n{"id": "c", "prompt": "p"}\n')
    out = subprocess.run([sys.executable, "-c", _READ_ALL, str(path)], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    size = 200 * (1 << 20) + len(b'{"id": "big", "prompt": ""}')  # not its line break
    assert out[:4] == ["a", f"line is {size:,} bytes, longer than the 64 MiB a line may hold; a "
                            "record that long would ask more than any model reads", "c",
                       f"3 {path.stat().st_size}"]
    assert int(out[4]) < 64, f"peak {out[4]} MiB"


@pytest.mark.parametrize("block", [*range(8, 72), CHUNK])
def test_the_line_limit_is_the_records_whatever_ends_its_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """A record of MAX_LINE_BYTES is read whether its line ends with LF or CRLF and with a BOM
    before it or not (with CRLF or a BOM it was a reject), and one byte more is a reject giving
    the record's own size, not the line break's or the BOM's too; a line longer than a block is
    read on in blocks wherever they end (its CR the last byte of one, its LF the next one),
    every byte counted once, and kept whole when it is a record. export's scan of keys
    (`bounded_lines`) passes over the same lines. The limit is 64 bytes here, the block 8 to
    71 bytes or a real one."""
    monkeypatch.setattr(inputs, "MAX_LINE_BYTES", 64)
    monkeypatch.setattr(inputs, "CHUNK", block)
    path = tmp_path / "in.jsonl"

    def record(n: int) -> bytes:
        return b'{"id": "%d", "prompt": "%s"}' % (n, b"x" * (n - 24 - len(str(n))))

    assert len(record(64)) == 64
    for start, end in itertools.product((b"", BOM), (b"\n", b"\r\n")):
        data = b"".join(start + record(n) + end for n in (64, 65, 66, 200, 30, 63))
        path.write_bytes(data + start + record(64))  # the last line without a line break
        reader = InputReader(path, InputPlan())
        got = list(reader)
        reader.close()
        assert [e["id"] if isinstance(e, dict) else e.reason.split(",")[0] for e in got] == [
            "64", "line is 65 bytes", "line is 66 bytes", "line is 200 bytes", "30", "63",
            "64"], (start, end)
        assert [len(e["prompt"]) for e in got if isinstance(e, dict)] == [38, 4, 37, 38]
        assert (reader.lines_read, reader.bytes_read, reader.open_end) == (
            7, len(path.read_bytes()), "line")
        assert reader.sha.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
        with open(path, "rb") as f:
            lines = list(inputs.bounded_lines(f))
        assert [line is None for line in lines] == [False, True, True, True, False, False, False]
        kept = [line for line in lines if line is not None]
        assert kept == [start + record(n) + end for n in (64, 30, 63)] + [start + record(64)]


def test_a_line_just_over_the_limit_is_read_past_holding_about_a_block(tmp_path: Path) -> None:
    """A line over the 64 MiB limit was read to the limit by `readline`, which holds the blocks
    it reads and then their join: the coordinator's peak grew by 129 MiB, twice the limit, to
    pass over a line it rejects. It is read past in blocks, none held after the next is read,
    and its line numbers, size, bytes and hash are those of the file, the run's reader's and
    export's scan of keys (`bounded_lines`) alike."""
    path = tmp_path / "in.jsonl"
    sha = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (b'{"id": "a", "prompt": "p"}\n{"id": "big", "prompt": "',
                     *[b"x" * (1 << 20)] * 64, b'"}\n{"id": "c", "prompt": "p"}\n'):
            f.write(part)
            sha.update(part)
    tracemalloc.start()
    try:
        reader = InputReader(path, InputPlan())
        got = [e.reason if isinstance(e, Reject) else e["id"] for e in reader]
        reader.close()
        _, read_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with open(path, "rb") as f:
            scanned = [line is None for line in inputs.bounded_lines(f)]
        _, scan_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = (64 << 20) + len(b'{"id": "big", "prompt": ""}')
    assert got == ["a", f"line is {size:,} bytes, longer than the 64 MiB a line may hold; a "
                        "record that long would ask more than any model reads", "c"]
    assert (reader.lines_read, reader.bytes_read) == (3, path.stat().st_size)
    assert reader.sha.hexdigest() == sha.hexdigest()
    assert scanned == [False, True, False]
    assert read_peak < 4 * CHUNK + (1 << 20), read_peak  # was 129 MiB
    assert scan_peak < 4 * CHUNK + (1 << 20), scan_peak


@pytest.mark.parametrize("fmt", ["jsonl", "openai-batch"])
def test_json_lines_ending_with_lone_crs_are_one_input_error(tmp_path: Path, fmt: str) -> None:
    """A JSON lines file saved with old Mac line endings (a lone CR each) read as one line:
    every record in one reject, or a one-record file's single item, the run "successful". It
    is one error saying what to do. A CRLF file, a lone CR at the end of a one-line file, and a
    CSV's lone CRs (the csv module's line ends) are read; lone CRs after lines that end with
    LF make a reject that names them."""
    path = tmp_path / "in.jsonl"
    record = (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
              b'"body": {"prompt": "p"}}' if fmt == "openai-batch"
              else b'{"id": "a", "prompt": "p"}')  # fmt: skip
    plan = InputPlan(format=fmt)  # type: ignore[arg-type]
    path.write_bytes(record + b"\r" + record.replace(b'"a"', b'"b"') + b"\r")
    with pytest.raises(InputError, match=f"^input file {path} ends its lines with a lone CR .*; "
                                         r"convert lone CRs to LF \(tr '\\r' '\\n' < "):
        InputReader(path, plan)
    path.write_bytes(record + b"\r\n" + record.replace(b'"a"', b'"b"') + b"\r\n")
    assert [e["id"] for e in read_all(path, plan) if isinstance(e, dict)] == ["a", "b"]
    path.write_bytes(record + b"\r")
    assert [e["id"] for e in read_all(path, plan) if isinstance(e, dict)] == ["a"]
    path.write_bytes(record + b"\n" + record.replace(b'"a"', b'"b"') + b"\r" + record + b"\r")
    got = read_all(path, plan)
    assert isinstance(got[1], Reject) and "the line holds a lone CR" in got[1].reason
    assert len(got) == 2
    csv = tmp_path / "in.csv"
    csv.write_bytes(b"id,prompt\ra,p\rb,q\r")
    assert len(read_all(csv, InputPlan(format="csv"))) == 2


def test_lone_cr_line_ends_after_a_malformed_first_record_are_still_refused(
        tmp_path: Path) -> None:
    """Only the text before the first CR was tried as a record: a file of lone-CR line ends
    whose first record is malformed was read as one line, the whole file one reject "not valid
    JSON". Any of the first few CR-separated pieces that is a record marks the CRs as line
    ends: the file is refused, and a line that holds such CRs after LF-ended lines gets the
    hint; a CR inside a record (no piece a record) still reads as whitespace."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id":"a","prompt":"p"\r{"id":"b","prompt":"q"}\r'
                     b'{"id":"c","prompt":"r"}\r')
    with pytest.raises(InputError, match="ends its lines with a lone CR"):
        InputReader(path, InputPlan())
    path.write_bytes(b'{"id":"z","prompt":"p"}\n{"id":"a","prompt":"p"\r'
                     b'{"id":"b","prompt":"q"}\r{"id":"c","prompt":"r"}\n')
    got = read_all(path, InputPlan())
    assert len(got) == 2 and isinstance(got[1], Reject), got
    assert "the line holds a lone CR" in got[1].reason
    path.write_bytes(b'{"id":"a",\r"meta":[1,\r2],\r"prompt":"%s"}\n{"id":"b","prompt":"q"}\n'
                     % (b"y" * 70_000))
    assert [e["id"] for e in read_all(path, InputPlan()) if isinstance(e, dict)] == ["a", "b"]


def test_a_cr_inside_a_json_record_is_whitespace_not_a_lone_cr_line_end(tmp_path: Path) -> None:
    """A raw CR is JSON whitespace: a first line longer than 64 KiB holding one (its first
    64 KiB then hold a CR and no LF) was refused as a file of lone-CR line ends, by validate, a
    run, and the resume or export of a run an earlier version made of it. Only a CR that ends a
    record (what is before it is one JSON object) is a lone-CR line end, and only a line that is
    not JSON and holds one gets the hint of it; a file of such line ends is still refused."""
    path = tmp_path / "input.jsonl"
    long = b'{"id":"a",\r"prompt":"%s"}\n{"id":"b","prompt":"second"}\n' % (b"y" * 70_000)
    path.write_bytes(long)
    assert [e["id"] for e in read_all(path, InputPlan()) if isinstance(e, dict)] == ["a", "b"]
    path.write_bytes(b'{"id": "a", "prompt": "p"}\n{"id": "b",\r"prompt": }\n')
    (_, bad) = read_all(path, InputPlan())
    assert isinstance(bad, Reject) and "lone CR" not in bad.reason
    path.write_bytes(b'{"id": "a", "prompt": "p"}\r{"id": "b", "prompt": "q"}\r')
    with pytest.raises(InputError, match="ends its lines with a lone CR"):
        InputReader(path, InputPlan())
    path.write_bytes(long)
    write_job(tmp_path / "job.yaml")
    checked = run_cli("validate", "job.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    ran = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    out = tmp_path / "out.jsonl"
    done = run_cli("export", str(only_run(tmp_path / "runs")), "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == ["a", "b"]


@pytest.mark.parametrize("fmt", ["jsonl", "openai-batch", "parquet"])
def test_a_pipe_as_input_is_one_input_error(tmp_path: Path, fmt: str) -> None:
    """A named pipe (or `<(zcat in.gz)`) is read once: a run with --limit then blocked for ever
    opening it again to see what was left (SIGTERM did not end it), and no resume could read it.
    It is refused when opened, with what to do. (A writer is held open here, so that an open
    without the check returns rather than blocks.)"""
    pipe = tmp_path / "in.jsonl"
    os.mkfifo(pipe)
    reading = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    writing = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(writing, b'{"id": 1, "prompt": "a"}\n')
        with pytest.raises(InputError, match=f"^input file {pipe} is not a regular file \\(a "
                                             "pipe or a device\\); a run reads its input again"):
            InputReader(pipe, InputPlan(format=fmt))  # type: ignore[arg-type]
    finally:
        os.close(writing)
        os.close(reading)


def test_messages_field_and_system_prompt(tmp_path: Path) -> None:
    """messages_field keeps the list; a system prompt turns a prompt into two messages."""
    plan = InputPlan(prompt_field=None, messages_field="m")
    ok = parse_line(b'{"id": 1, "m": [{"role": "user", "content": "hi"}]}', 1, plan)
    assert ok == {"id": "1", "messages": [{"role": "user", "content": "hi"}]}
    empty = parse_line(b'{"m": []}', 2, plan)
    assert isinstance(empty, Reject) and empty.id is not None and empty.id.startswith("h")
    assert empty == Reject(2, "messages field 'm' must be a non-empty list", empty.id)
    # A typo in messages_field is named as a prompt_field's is, with the key it likely meant.
    typo = parse_line(b'{"id": 3, "messages": [{"role": "user", "content": "hi"}]}', 3,
                      InputPlan(prompt_field=None, messages_field="mesages"))
    assert typo == Reject(3, "messages field 'mesages' is missing (the line has 'messages': is "
                             "that the field?)", "3")
    with_system = InputPlan(system_prompt="Be brief.")
    assert parse_line(b'{"id": "a", "prompt": "Q"}', 1, with_system) == {
        "id": "a",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}],
    }


MESSAGE_REJECTS = [
    ('["hi"]', "m[0] is a string, not an object with a role and a content"),
    ('[{"role": "user", "content": "a"}, {"content": "b"}]', "m[1] has no role"),
    ('[{"role": 1, "content": "a"}]', "m[0] role is a number, not a string"),
    ('[{"role": "", "content": "a"}]', "m[0] role is empty"),
    ('[{"role": "user"}]', "m[0] has no content"),
    ('[{"role": "user", "content": null}]', "m[0] content is null"),
    ('[{"role": "system"}]', "m[0] has no content"),
    ('[{"role": "system", "content": null}]', "m[0] content is null"),
    ('[{"role": "assistant", "content": 3}]',
     "m[0] content is a number, not a string or a list of parts"),
    ('[{"role": "tool", "content": {"text": "a"}}]',
     "m[0] content is an object, not a string or a list of parts"),
    ('[{"role": "user", "content": {"text": "a"}}]',
     "m[0] content is an object, not a string or a list of parts"),
    ('[{"role": "user", "content": []}]', "m[0] content is an empty list"),
    ('[{"role": "user", "content": ["a"]}]', "m[0] content[0] is a string, not an object with "
                                             "a type"),
    ('[{"role": "user", "content": [{"text": "a"}]}]', "m[0] content[0] has no type"),
    ('[{"role": "user", "content": [{"type": 3}]}]', "m[0] content[0] type is a number, not a "
                                                     "string"),
    ('[{"role": "user", "content": [{"type": "text", "text": 5}]}]',
     "m[0] content[0] is a text part without a string 'text'"),
]


@pytest.mark.parametrize(("messages", "reason"), MESSAGE_REJECTS)
def test_a_message_list_no_server_takes_is_a_reject_naming_the_entry(
    messages: str, reason: str
) -> None:
    """Each entry of a messages_field list needs a role and a content (a string or a list of
    typed parts): sent without, it would cost a request and an attempt and fail at the server.
    The reject says which entry and what it lacks; a CSV cell holding the list says the same."""
    plan = InputPlan(prompt_field=None, messages_field="m")
    assert parse_line(b'{"id": "x", "m": %s}' % messages.encode(), 7, plan) == Reject(
        7, reason, "x")
    cell = orjson.dumps(messages).decode()
    assert parse_line(b'{"id": "x", "m": %s}' % cell.encode(), 7, plan) == Reject(7, reason, "x")


def test_a_message_list_keeps_what_the_api_allows() -> None:
    """Keys the check does not look at pass (name, tool_call_id, tool_calls); an assistant
    message calling a tool may have no content; parts of any type (image_url, input_text...)
    pass, so do the developer role and the older function role."""
    messages = [
        {"role": "developer", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "assistant", "tool_calls": [{"id": "c2", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
        {"role": "function", "name": "f", "content": "42"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Again?"}]},
        {"role": "user", "content": "", "extra": True},
    ]
    plan = InputPlan(prompt_field=None, messages_field="m")
    line = orjson.dumps({"id": "ok", "m": messages})
    assert parse_line(line, 1, plan) == {"id": "ok", "messages": messages}


ACCEPTED_SHAPES = [
    # vLLM takes any role a chat template knows: Llama's tool results, the developer role
    pytest.param({"role": "ipython", "content": "42"}, id="ipython-role"),
    pytest.param({"role": "developer", "content": "Be brief."}, id="developer-role"),
    pytest.param({"role": "usr", "content": "a"}, id="a-role-the-check-does-not-know"),
    pytest.param({"role": "function", "name": "f", "content": None}, id="function-null"),
    pytest.param({"role": "function", "name": "f"}, id="function-no-content"),
    pytest.param({"role": "tool", "tool_call_id": "c1", "content": None}, id="tool-null"),
    pytest.param({"role": "tool", "tool_call_id": "c1"}, id="tool-no-content"),
    pytest.param({"role": "assistant", "content": None,
                  "tool_calls": [{"id": "c1", "type": "function"}]}, id="assistant-tool-calls"),
    pytest.param({"role": "assistant", "content": None, "reasoning_content": "Hmm."},
                 id="assistant-reasoning-content-null"),
    pytest.param({"role": "assistant", "reasoning": "Hmm."}, id="assistant-reasoning-no-content"),
    pytest.param({"role": "assistant", "content": None}, id="assistant-null"),
]


@pytest.mark.parametrize("message", ACCEPTED_SHAPES)
def test_a_message_shape_servers_take_is_an_item(message: dict[str, Any]) -> None:
    """vLLM takes any role string and a null or missing content for assistant, tool and function
    messages (a tool call, a reasoning-only turn, a result with no text): such a list is an item,
    as it was before the check came, in a JSON list and in a CSV cell holding one."""
    messages = [{"role": "user", "content": "Q"}, message]
    plan = InputPlan(prompt_field=None, messages_field="m")
    item = {"id": "ok", "messages": messages}
    assert parse_line(orjson.dumps({"id": "ok", "m": messages}), 1, plan) == item
    cell = orjson.dumps(messages).decode()
    assert parse_line(orjson.dumps({"id": "ok", "m": cell}), 1, plan) == item


def test_a_responses_input_list_may_hold_items_that_are_not_messages(tmp_path: Path) -> None:
    """The Responses API's input list holds function calls and their outputs beside messages,
    with no role: a job with api responses takes such a list (it was rejected, "m[1] has no
    role"); a chat job still rejects it, as a chat server would."""
    listed = [{"role": "user", "content": "2+2? use the tool"},
              {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"},
              {"type": "function_call_output", "call_id": "c", "output": "4"}]
    line = orjson.dumps({"id": 1, "m": listed})
    (tmp_path / "in.jsonl").write_bytes(line + b"\n")
    job = job_for(tmp_path, "{path: in.jsonl, messages_field: m}", api="responses")
    reader = make_reader(job)
    assert list(reader) == [{"id": "1", "messages": listed}]
    reader.close()
    chat = InputPlan(prompt_field=None, messages_field="m")
    assert parse_line(line, 1, chat) == Reject(1, "m[1] has no role", "1")
    # A message item by its type is still checked as a message.
    typed = orjson.dumps({"id": 2, "m": [{"type": "message", "content": "hi"}]})
    assert parse_line(typed, 2, replace(chat, responses=True)) == Reject(
        2, "m[0] has no role", "2")


def test_template_fills_fields_and_rejects_missing_ones() -> None:
    """A template fills {field}s from the record (numbers as JSON); a missing or null field is
    a reject naming it, never an exception."""
    plan = InputPlan(prompt_field=None, template=parse_template("Rate {name} ({n}/5): {{x}}"))
    item = parse_line(b'{"id": 1, "name": "Bo", "n": 4}', 3, plan)
    assert item == {"id": "1", "prompt": "Rate Bo (4/5): {x}"}
    for line in (b'{"id": 1, "n": 4}', b'{"id": 1, "name": null, "n": 4}'):
        assert parse_line(line, 9, plan) == Reject(9, "template field 'name' is missing", "1")
    # A typo in the template is named as one in prompt_field is, with the key it likely meant.
    assert parse_line(b'{"id": 1, "nam": "Bo", "n": 4}', 9, plan) == Reject(
        9, "template field 'name' is missing (the line has 'nam': is that the field?)", "1")


def test_a_template_field_that_is_empty_is_a_reject_as_in_csv() -> None:
    """An empty string in a JSON line is what an empty CSV cell is, a reject naming the field;
    a template filled to nothing but blanks is not sent either (it would be paid for and ask
    nothing), as a blank prompt field is not."""
    plan = InputPlan(prompt_field=None, template=parse_template("{a}{b}"))
    assert parse_line(b'{"id": 1, "a": "x", "b": ""}', 2, plan) == Reject(
        2, "template field 'b' is empty", "1")
    assert parse_line(b'{"id": 1, "a": " ", "b": "\\n"}', 3, plan) == Reject(
        3, "template filled is blank", "1")
    assert parse_line(b'{"id": 1, "a": " ", "b": "y"}', 4, plan) == {"id": "1", "prompt": " y"}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{x.__class__}", "attribute access"),
        ("{x[0]}", "index access"),
        ("{x!r}", "conversion or format spec"),
        ("{x:>9}", "conversion or format spec"),
        ("{} and {0}", "must name a field"),
        ("open { brace", "literal braces"),
    ],
)
def test_template_placeholders_are_plain_field_names(text: str, why: str) -> None:
    """Attribute, index, conversion, format spec and positional placeholders are refused."""
    with pytest.raises(TemplateError, match=why):
        parse_template(text)


# -- CSV --------------------------------------------------------------------------------------


def test_csv_rows_become_items(tmp_path: Path) -> None:
    """Header names the columns; empty cells are missing; a wrong-width row is a reject; a
    quoted cell may span lines and line numbers stay right; a BOM is ignored."""
    path = tmp_path / "in.csv"
    path.write_bytes(
        b'\xef\xbb\xbfid,prompt,extra\r\n'
        b'1,"Hello, world",x\r\n'
        b'2,,x\r\n'
        b'3,"two\nlines",x\r\n'
        b'4,short\r\n'
        b'\r\n'
        b',no id,x\r\n'
    )
    got = read_all(path, InputPlan(format="csv"))
    assert got[0] == {"id": "1", "prompt": "Hello, world"}
    assert got[1] == Reject(3, "prompt field 'prompt' is empty", "2")
    assert got[2] == {"id": "3", "prompt": "two\nlines"}
    assert got[3] == Reject(6, "row has 2 values but the header has 3 columns; give every column "
                               "a value, empty ones too, as in 'a,,c'", "4")
    # More values than columns: a comma in an unquoted value, most likely; one value, singular.
    wrong = tmp_path / "wrong.csv"
    wrong.write_bytes(b"id,prompt\n1,Hello, world\n2\n")
    assert read_all(wrong, InputPlan(format="csv")) == [
        Reject(2, "row has 3 values but the header has 2 columns; a value holding a comma must "
                  "be in double quotes", "1"),
        Reject(3, "row has 1 value but the header has 2 columns; give every column a value, "
                  "empty ones too, as in 'a,,c'", "2")]
    assert isinstance(got[4], dict) and got[4]["id"].startswith("h") and got[4]["prompt"] == "no id"
    assert len(got) == 5
    # Where each entry starts: the row over two lines (4 and 5) is at line 4, not 5.
    reader = InputReader(path, InputPlan(format="csv"))
    assert [reader.line for _ in reader] == [2, 3, 4, 6, 8]
    reader.close()


def test_csv_quote_never_closed_is_named(tmp_path: Path) -> None:
    """An unclosed quote would swallow the rest of the file into one cell: the reject says so,
    with the lines it took."""
    path = tmp_path / "in.csv"
    path.write_bytes(b'id,prompt,extra\n1,"open,x\n2,b,x\n3,c,x\n')
    assert read_all(path, InputPlan(format="csv")) == [
        Reject(2, "not valid CSV (unexpected end of data on line 4): a quote opened in this row "
                  "is never closed where it should be, so lines 2-4 were read as one row and "
                  "are rejected")]


def test_a_stray_quote_in_csv_is_a_reject_not_a_merged_prompt(tmp_path: Path) -> None:
    """One stray quote at the start of a cell, closed by a quote character many rows later: a
    lenient reader makes the rows between one long prompt, and the run succeeds with those
    items silently gone. The broken row is a reject naming the lines it ran over, and the
    reader goes on with the row after them; a quote inside an unquoted cell is plain text."""
    rows = [b"qid,question"] + [b"%d,question %d" % (i, i) for i in range(1, 21)]
    rows[10] = b'10,"He said hi, then left'
    rows[15] = b'15,the "end" of it'
    rows[18] = b'18,she said "yes"'
    path = tmp_path / "in.csv"
    path.write_bytes(b"\n".join(rows) + b"\n")
    got = read_all(path, InputPlan(format="csv", id_field="qid", prompt_field="question"))
    rejects = [r for r in got if isinstance(r, Reject)]
    assert rejects == [Reject(11, "not valid CSV (',' expected after '\"' on line 16): a quote "
                                  "opened in this row is never closed where it should be, so "
                                  "lines 11-16 were read as one row and are rejected")]
    items = {item["id"]: item["prompt"] for item in got if isinstance(item, dict)}
    assert sorted(items, key=int) == [str(i) for i in [*range(1, 10), *range(16, 21)]]
    assert items["18"] == 'she said "yes"'


def test_a_runaway_csv_cell_leaves_no_buffer_behind(tmp_path: Path) -> None:
    """The csv module holds a cell as 4 bytes a character, in a buffer it keeps at its largest
    for as long as its reader lives: a stray quote in a big file that no quote follows ran on
    to the field limit (64 Mi characters then) and the coordinator held 256 MiB more for the
    rest of the run. The cell stops at 16 Mi characters (64 MiB, as a JSON line's limit), and
    the rows after it, and after a long row that is fine, are read with nothing left held and
    their line numbers right."""
    long_prompt = "w" * (3 << 20)
    runaway = "".join(f"{i},line {i} of a cell a stray quote opened\n" for i in range(400_000))
    path = tmp_path / "in.csv"
    path.write_text(f'id,prompt\na,"stray\n{runaway}b,{long_prompt}\nc,after\n')
    tracemalloc.start()
    try:
        reader = InputReader(path, InputPlan(format="csv"))
        entries = iter(reader)
        reject = next(entries)
        assert isinstance(reject, Reject) and reader.line == 2
        # What the limit's line left of the runaway is read as rows; the last two are kept.
        last_two = [(reader.line, entry) for entry in entries][-2:]
        (b_line, b), (c_line, c) = last_two
        del last_two
        held, _ = tracemalloc.get_traced_memory()
        reader.close()
    finally:
        tracemalloc.stop()
    assert reject.reason.startswith("a cell is longer than the 16,777,216 characters a CSV "
                                    "cell may hold by line ")
    assert "close the quote opened in this row where it should be" in reject.reason
    assert isinstance(b, dict) and isinstance(c, dict)
    assert (b_line, b["id"], b["prompt"] == long_prompt) == (400_003, "b", True)
    assert (c_line, c["id"], c["prompt"]) == (400_004, "c", "after")
    del b
    assert held < (8 << 20), held  # neither the runaway's buffer nor the long row's


def test_a_long_row_of_the_wrong_width_leaves_no_buffer_behind(tmp_path: Path) -> None:
    """A quote run on to the next one makes a long row of the wrong width: a reject, after which
    the reader's cell buffer, grown to the row's length, is let go (short ones keep the
    reader: a file of wrong-width rows read 40 % slower renewing it after each)."""
    path = tmp_path / "in.csv"
    path.write_text('id,prompt\na,"' + "w" * (3 << 20) + '\nb,x",y\nc,after\n')
    tracemalloc.start()
    try:
        reader = InputReader(path, InputPlan(format="csv"))
        got = [(e.line, e.reason[:15]) if isinstance(e, Reject) else (reader.line, e["id"])
               for e in reader]
        held, _ = tracemalloc.get_traced_memory()
        reader.close()
    finally:
        tracemalloc.stop()
    assert got == [(2, "row has 3 value"), (4, "c")]
    assert held < (8 << 20), held


def test_a_csv_cell_past_the_limit_is_one_reject_saying_what_to_do(tmp_path: Path) -> None:
    """A cell of 16-64 Mi characters was an item before the limit came down; now it is a
    reject, and its reason was the csv module's 'not valid CSV (field larger than field limit
    (16777216))', which says neither what the limit is in words nor what to do; where the cell
    ran over several lines it said a quote was never closed, and nothing of the lines after it
    being read as rows, which they are."""
    path = tmp_path / "in.csv"
    big = "w" * ((16 << 20) + 1)
    path.write_text(f'id,prompt\na,ok\nb,"{big}"\nc,after\n'
                    f'd,"{big[:-9]}\nmore text here\nthe rest"\n')
    reader = InputReader(path, InputPlan(format="csv"))
    got = [(e.line, e.reason) if isinstance(e, Reject) else (reader.line, e["id"]) for e in reader]
    reader.close()
    assert got == [
        (2, "a"),
        (3, "a cell is longer than the 16,777,216 characters a CSV cell may hold; a record "
            "that long would ask more than any model reads: shorten it"),
        (4, "c"),
        (5, "a cell is longer than the 16,777,216 characters a CSV cell may hold by line 6, so "
            "lines 5-6 were read as one row and are rejected, and line 7 on is read as rows "
            "again: close the quote opened in this row where it should be, or, if the cell is "
            "meant to be that long, shorten it (the rows read from the rest of it are not "
            "records)"),
        (7, "row has 1 value but the header has 2 columns; give every column a value, empty "
            "ones too, as in 'a,,c'")]  # the rest of d's cell


def test_strict_names_where_a_duplicate_csv_row_starts(tmp_path: Path) -> None:
    """`--strict` names the line a duplicate row starts on, as its reject would (a row whose
    quoted cell holds line breaks ends lines later): it said line 7 for the row of lines 5-7."""
    path = tmp_path / "in.csv"
    path.write_text('id,prompt\n1,"a\nb\nc"\n1,"x\ny\nz"\n')
    with pytest.raises(InputError, match=r"in\.csv line 5: duplicate id '1'"):
        check_strictly(InputReader(path, InputPlan(format="csv")))


def test_csv_template_and_hash(tmp_path: Path) -> None:
    """A template over CSV columns; the reader's hash covers the file's bytes."""
    path = tmp_path / "in.csv"
    path.write_text("key,city,country\nk1,Lyon,France\nk2,Oslo,\n")
    plan = InputPlan(id_field="key", prompt_field=None, format="csv",
                     template=parse_template("Where is {city}, {country}?"))  # fmt: skip
    reader = InputReader(path, plan)
    assert list(reader) == [
        {"id": "k1", "prompt": "Where is Lyon, France?"},
        Reject(3, "template field 'country' is empty", "k2"),
    ]
    assert reader.sha.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert reader.lines_read == 3


def test_csv_header_without_needed_column_fails_at_open(tmp_path: Path) -> None:
    """A column the job needs but the header lacks is one InputError before any row."""
    path = tmp_path / "in.csv"
    path.write_text("id,text\n1,a\n")
    with pytest.raises(InputError, match="the CSV header has no column 'prompt'; it has: id, text"):
        InputReader(path, InputPlan(format="csv"))  # no name close to it: no hint
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(InputError, match="empty"):
        InputReader(tmp_path / "empty.csv", InputPlan(format="csv"))


@pytest.mark.parametrize("sep", [";", "\t", "|"])
def test_a_csv_separated_otherwise_than_by_commas_says_so(tmp_path: Path, sep: str) -> None:
    """A CSV saved with semicolons (a spreadsheet in many locales), tabs or bars has a header of
    one column: the error names the separator, where it asked whether that whole header was the
    column meant."""
    path = tmp_path / "in.csv"
    path.write_text(f"id{sep}prompt\n1{sep}a\n")
    with pytest.raises(InputError) as caught:
        InputReader(path, InputPlan(format="csv"))
    assert f"the file separates its columns with {sep!r}, but a CSV input must separate them " \
           "with commas" in str(caught.value)
    path.write_text("id;text\n1;a\n")  # no needed column among the parts: the usual error
    with pytest.raises(InputError, match="the CSV header has no column 'prompt'; it has: id;t"):
        InputReader(path, InputPlan(format="csv"))


def test_an_id_column_the_job_names_must_be_in_the_header(tmp_path: Path) -> None:
    """`id_field: qid` on a table without that column would hash every row's id (a typo's
    doing): it fails at open. The default `id` may be absent (ids are hashed, as documented),
    and a named id column that is there may be empty in a row (that row's id is hashed)."""
    path = tmp_path / "in.csv"
    path.write_text("qid,prompt\nq1,a\n,b\n")
    with pytest.raises(InputError, match="the CSV header has no column 'qdi' "
                                         r"\(is 'qid' the column meant\?\); it has: qid, "):
        InputReader(path, InputPlan(id_field="qdi", format="csv"))
    rows = list(InputReader(path, InputPlan(id_field="qid", format="csv")))
    ids = [str(r["id"]) for r in rows if isinstance(r, dict)]
    assert ids[0] == "q1" and ids[1].startswith("h") and len(ids) == 2
    (tmp_path / "plain.csv").write_text("prompt\na\n")
    assert len(list(InputReader(tmp_path / "plain.csv", InputPlan(format="csv")))) == 1


def test_a_csv_header_typo_gets_the_hint_a_json_field_gets(tmp_path: Path) -> None:
    """A header naming a column close to the one the job needs says which, as a JSON line's
    reject does for its fields: a prompt column written 'Prompt', and a template's field
    whose close column is past the 20 the message lists."""
    path = tmp_path / "in.csv"
    path.write_text("id,Prompt\n1,a\n")
    with pytest.raises(InputError, match=r"no column 'prompt' \(is 'Prompt' the column meant"):
        InputReader(path, InputPlan(format="csv"))
    path.write_text(",".join([*(f"c{i}" for i in range(24)), "question"]) + "\n")
    plan = InputPlan(format="csv", template=parse_template("Q: {questoin}"))
    with pytest.raises(InputError, match=r"no column 'questoin' \(is 'question' the column "
                                         r"meant\?\); it has: c0, c1, .*, c19, \.\.\.$"):
        InputReader(path, plan)


def test_csv_bad_utf8_is_a_reject_of_its_row(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 reject their row and the reading goes on."""
    path = tmp_path / "in.csv"
    path.write_bytes(b"id,prompt\n1,caf\xe9\n2,ok\n")
    got = read_all(path, InputPlan(format="csv"))
    assert got == [Reject(2, "column 'prompt' is not valid UTF-8 (byte 0xe9); save the file as "
                             "UTF-8 (in Excel: CSV UTF-8)", "1"), {"id": "2", "prompt": "ok"}]
    path.write_bytes(b"id,prompt\ncaf\xe9,a\n")  # the id itself is not text: no id to give
    assert read_all(path, InputPlan(format="csv")) == [Reject(
        2, "column 'id' is not valid UTF-8 (byte 0xe9); save the file as UTF-8 (in Excel: CSV "
           "UTF-8)")]


def test_a_csv_header_name_that_is_not_utf8_is_shown_as_text(tmp_path: Path) -> None:
    """A column the run does not read, named with a Latin-1 byte: the run is fine, but `export
    --with-input` failed with a traceback (a surrogate in the record's key and the CSV header
    row no encoder takes). Its name is shown with U+FFFD, as a cell's bad byte is."""
    path = tmp_path / "in.csv"
    path.write_bytes(b"id,prompt,caf\xe9\n1,a,b\n")
    reader = InputReader(path, InputPlan(format="csv"), keep_records=True)
    assert list(reader) == [{"id": "1", "prompt": "a"}]
    assert reader.columns == ["id", "prompt", "caf\ufffd"]
    assert orjson.loads(orjson.dumps(reader.record)) == {"id": "1", "prompt": "a",
                                                         "caf\ufffd": "b"}
    reader.close()


def test_csv_is_streamed(tmp_path: Path) -> None:
    """After the first item of a large CSV only a small prefix has been read."""
    path = tmp_path / "big.csv"
    with open(path, "w") as f:
        f.write("id,prompt\n")
        for i in range(200_000):
            f.write(f"{i},prompt number {i}\n")
    reader = InputReader(path, InputPlan(format="csv"))
    first = next(iter(reader))
    assert first == {"id": "0", "prompt": "prompt number 0"}
    assert reader.bytes_read <= 2 << 20 < path.stat().st_size
    reader.close()


# -- Parquet ----------------------------------------------------------------------------------


def test_parquet_rows_become_items(tmp_path: Path) -> None:
    """Parquet rows are read batch by batch; nulls are missing; the hash is the file's."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "in.parquet"
    n = 2500
    prompts = [None if i == 5 else f"p{i}" for i in range(n)]
    table = pa.table({"id": list(range(n)), "prompt": prompts, "other": ["x"] * n})
    pq.write_table(table, path, row_group_size=1000)
    reader = InputReader(path, InputPlan(format="parquet"))
    got = list(reader)
    assert got[0] == {"id": "0", "prompt": "p0"}
    assert got[5] == Reject(6, "prompt field 'prompt' is missing", "5")
    assert len(got) == n and reader.lines_read == n
    assert reader.sha.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert reader.bytes_read == path.stat().st_size
    with pytest.raises(InputError, match="Parquet schema has no column 'text'"):
        InputReader(path, InputPlan(prompt_field="text", format="parquet"))
    with pytest.raises(InputError, match="Parquet schema has no column 'key'"):
        InputReader(path, InputPlan(id_field="key", format="parquet"))


def test_a_parquet_binary_prompt_is_named_as_such(tmp_path: Path) -> None:
    """A BINARY column (written without the STRING annotation) as the prompt: the reject said
    "is a bytes, not a string", Python's word for it."""
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "in.parquet"
    pytest.importorskip("pyarrow.parquet").write_table(
        pa.table({"id": ["a"], "prompt": pa.array([b"hi"], type=pa.binary())}), path)
    assert read_all(path, InputPlan(format="parquet")) == [
        Reject(1, "prompt field 'prompt' is binary data, not a string", "a")]


def test_parquet_without_pyarrow_says_which_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without pyarrow, reading Parquet is an InputError telling how to install it."""
    path = tmp_path / "in.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(InputError) as info:
        InputReader(path, InputPlan(format="parquet"))
    assert ("reading Parquet needs the parquet extra: in shardrun's directory, .venv/bin/pip "
            "install -e '.[parquet]'") in str(
        info.value
    )


def test_not_parquet_is_an_input_error(tmp_path: Path) -> None:
    """A file that is not Parquet fails at open with one sentence."""
    pytest.importorskip("pyarrow")
    path = tmp_path / "in.parquet"
    path.write_text("id,prompt\n")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        InputReader(path, InputPlan(format="parquet"))


# -- OpenAI Batch input -----------------------------------------------------------------------

BATCH = InputPlan(prompt_field=None, format="openai-batch")
CHAT_BODY = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def batch_line(**fields: object) -> bytes:
    """One Batch input line, valid unless `fields` change it."""
    line: dict[str, object] = {"custom_id": "r1", "method": "POST",
                               "url": "/v1/chat/completions", "body": CHAT_BODY}  # fmt: skip
    line.update(fields)
    return orjson.dumps({k: v for k, v in line.items() if v is not None})


def test_batch_lines_become_body_items() -> None:
    """A valid line keeps its body and url; custom_id is the item id."""
    assert parse_line(batch_line(), 1, BATCH) == {
        "id": "r1", "body": CHAT_BODY, "url": "/v1/chat/completions",
    }  # fmt: skip
    completion = parse_line(batch_line(url="/v1/completions", body={"prompt": "x"}), 2, BATCH)
    assert completion == {"id": "r1", "body": {"prompt": "x"}, "url": "/v1/completions"}
    response = parse_line(batch_line(url="/v1/responses", body={"input": "x"}), 3, BATCH)
    assert response == {"id": "r1", "body": {"input": "x"}, "url": "/v1/responses"}
    # A Responses input list may hold items with no role; a prompt, token ids: both are sent.
    given = [{"type": "function_call_output", "call_id": "c", "output": "4"}]
    response = parse_line(batch_line(url="/v1/responses", body={"input": given}), 4, BATCH)
    assert isinstance(response, dict) and response["body"] == {"input": given}
    tokens = parse_line(batch_line(url="/v1/completions", body={"prompt": [[1, 2]]}), 5, BATCH)
    assert isinstance(tokens, dict) and tokens["body"] == {"prompt": [[1, 2]]}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"custom_id": None}, "custom_id is missing"),
        ({"custom_id": ""}, "custom_id is missing"),
        ({"custom_id": 123}, "custom_id is a number, not a string"),
        ({"method": "GET"}, 'method must be POST, got "GET"'),
        ({"url": "/v1/embeddings"},
         "url must be /v1/chat/completions, /v1/completions or /v1/responses"),
        ({"url": "/v1/responses", "body": {"model": "x"}}, "body has no 'input'"),
        ({"url": "/v1/responses", "body": {"input": "x", "max_tokens": 9}},
         "body.max_tokens does not apply to /v1/responses, whose token limit is "
         "max_output_tokens"),
        ({"body": [1]}, "body must be a JSON object, got [1]"),
        ({"body": {"model": "x"}}, "body has no 'messages'"),
        ({"body": {"messages": [{"role": "user", "content": "q"}], "n": 3}},
         "body asks for n = 3 answers; a result holds one, so give one line per answer"),
        # What no request could ask, or no server takes, as in the other formats.
        ({"body": {"messages": []}}, "body.messages is an empty list"),
        ({"body": {"messages": "hi"}}, "body.messages is text, not a list of messages"),
        ({"body": {"messages": [{"role": "user"}]}}, "body.messages[0] has no content"),
        ({"body": {"messages": [{"content": "q"}]}}, "body.messages[0] has no role"),
        ({"url": "/v1/completions", "body": {"prompt": " "}}, "body.prompt is empty"),
        ({"url": "/v1/completions", "body": {"prompt": []}}, "body.prompt is an empty list"),
        ({"url": "/v1/completions", "body": {"prompt": 7}},
         "body.prompt is a number, not a text or a list"),
        ({"url": "/v1/responses", "body": {"input": ""}}, "body.input is empty"),
    ],
)
def test_batch_line_rejects(fields: dict[str, object], reason: str) -> None:
    """Each Batch rule has its own reject reason."""
    got = parse_line(batch_line(**fields), 4, BATCH)
    assert isinstance(got, Reject) and got.line == 4 and got.reason.startswith(reason)
    # The reject keeps the id the line names (a number's JSON text), none when it names none.
    named = fields.get("custom_id", "r1")
    assert got.id == (None if named in (None, "") else named if isinstance(named, str)
                      else orjson.dumps(named).decode())


# -- from the job, to the request --------------------------------------------------------------


def test_make_reader_follows_the_job(tmp_path: Path) -> None:
    """make_reader builds the plan from the spec: format by extension, template, system."""
    (tmp_path / "d.csv").write_text("id,q\n1,why\n")
    job = job_for(tmp_path, "{path: d.csv, template: 'Q: {q}', system_prompt: S}")
    reader = make_reader(job)
    assert reader.fields.format == "csv" and reader.fields.needed == ("q",)
    assert list(reader) == [{"id": "1", "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q: why"}]}]  # fmt: skip


def test_build_request_for_each_item_shape() -> None:
    """Prompt, messages and body items all stream with usage; a body keeps its own keys."""
    params = {"max_tokens": 9, "temperature": 0.5}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    assert build_request({"id": "1", "prompt": "p"}, model="m", params=params, api="chat") == (
        "chat", {"model": "m", **params, "messages": [{"role": "user", "content": "p"}], **stream}
    )  # fmt: skip
    assert build_request({"id": "1", "prompt": "p"}, model="m", params={}, api="completions") == (
        "completions", {"model": "m", "prompt": "p", **stream}
    )  # fmt: skip
    msgs = [{"role": "user", "content": "x"}]
    assert build_request({"id": "1", "messages": msgs}, model="m", params={}, api="chat")[1][
        "messages"] == msgs  # fmt: skip
    body = {"prompt": "p", "max_tokens": 3, "stream": False,
            "stream_options": {"continuous_usage_stats": True}}  # fmt: skip
    api, sent = build_request({"id": "1", "body": body, "url": "/v1/completions"}, model="m",
                              params=params, api="chat")  # fmt: skip
    assert api == "completions"
    assert sent == {"max_tokens": 3, "temperature": 0.5, "prompt": "p", "model": "m",
                    "stream": True,
                    "stream_options": {"continuous_usage_stats": True, "include_usage": True}}
    _, own_model = build_request({"id": "1", "body": CHAT_BODY, "url": "/v1/chat/completions"},
                                 model="m", params={}, api="completions")  # fmt: skip
    assert own_model["model"] == "gpt-x" and "stream" not in CHAT_BODY


def test_a_batch_lines_token_limit_from_params_takes_its_apis_name() -> None:
    """One Batch file may mix APIs: the job's token limit goes to each line under the name its
    API takes (the Responses API refuses max_tokens), and a line's own limit stands."""
    responses = {"id": "r", "url": "/v1/responses", "body": {"input": "hey"}}
    chat = {"id": "c", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user",
                                                                            "content": "x"}]}}
    _, sent = build_request(responses, model="m", params={"max_tokens": 16, "seed": 1},
                            api="chat")
    assert "max_tokens" not in sent and (sent["max_output_tokens"], sent["seed"]) == (16, 1)
    own = {**responses, "body": {"input": "hey", "max_output_tokens": 10}}
    assert build_request(own, model="m", params={"max_tokens": 16}, api="chat")[1][
        "max_output_tokens"] == 10  # fmt: skip
    _, sent = build_request(chat, model="m", params={"max_output_tokens": 16}, api="responses")
    assert "max_output_tokens" not in sent and sent["max_tokens"] == 16
    _, sent = build_request(chat, model="m", params={"max_tokens": 16}, api="chat")
    assert sent["max_tokens"] == 16
    o_series = {**chat, "body": {**chat["body"], "max_completion_tokens": 500}}
    for params in ({"max_tokens": 16}, {"max_output_tokens": 16}):
        _, sent = build_request(o_series, model="m", params={**params, "seed": 1}, api="chat")
        assert sent["max_completion_tokens"] == 500 and sent["seed"] == 1
        assert "max_tokens" not in sent and "max_output_tokens" not in sent


def test_build_request_without_stream_usage_adds_no_stream_options() -> None:
    """stream_usage False: the body streams but asks for no usage; options the job or the line
    gave go as they are."""
    _, sent = build_request({"id": "1", "prompt": "p"}, model="m", params={}, api="chat",
                            stream_usage=False)  # fmt: skip
    assert sent["stream"] is True and "stream_options" not in sent
    own = {"stream_options": {"continuous_usage_stats": True}}
    _, sent = build_request({"id": "1", "prompt": "p"}, model="m", params=own, api="chat",
                            stream_usage=False)  # fmt: skip
    assert sent["stream_options"] == {"continuous_usage_stats": True}


def test_prompt_size_estimates() -> None:
    """Prompt characters count message contents or the prompt, also inside a body."""
    assert prompt_chars({"prompt": "abcdefghi"}) == 9
    assert estimate_prompt_tokens({"prompt": "abcdefghi"}) == 3
    two = {"messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": "de"}]}
    assert prompt_chars(two) == 5 and prompt_chars({"body": two}) == 5
    # An image counts as PART_TOKENS, not as its data URL's length; a text part, its text.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 400_000}}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}, image]}]}
    assert estimate_prompt_tokens(parts) == 1 + PART_TOKENS
    assert prompt_chars({"body": {"input": parts["messages"]}}) == 3 + PART_TOKENS * 4
