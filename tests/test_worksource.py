"""The work source's read-ahead and the even split of the input's last stretch."""

from __future__ import annotations

import asyncio
import itertools
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardrun.digestset import DigestSet
from shardrun.inputs import BOM, InputPlan, InputReader
from shardrun.worksource import WorkSource, fair_share, id_digest

FIELDS = InputPlan(id_field="id", prompt_field="prompt")


def _source(tmp_path: Path, lines: list[bytes]) -> WorkSource:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return WorkSource(InputReader(path, FIELDS), tmp_path / "rejects.jsonl")


def _item(item_id: str) -> bytes:
    return orjson.dumps({"id": item_id, "prompt": "p"})


def test_first_asks_split_a_small_input_evenly() -> None:
    """200 items, 8 shards of cap 32 asking for 64 each: 25 apiece, where the first three asks
    used to take 192 of them and left five shards idle."""
    left, held, got = 200, 0, []
    for _ in range(8):
        n = fair_share(64, left, 0, held, 8)
        got.append(n)
        left, held = left - n, held + n
    assert got == [25] * 8 and left == 0


def test_a_shard_holding_its_part_gets_one_item() -> None:
    """Asking again before the others have asked gets a single item (never nothing: every ask
    is answered); a shard holding less than its part is topped up to it."""
    assert fair_share(64, 175, 25, 25, 8) == 1
    assert fair_share(64, 150, 0, 50, 8) == 25
    assert fair_share(64, 150, 10, 50, 8) == 15
    assert fair_share(10, 150, 0, 50, 8) == 10  # never more than asked for
    assert [fair_share(64, 9 - k, 0, k, 8) for k in range(8)] == [1] * 8  # 9 items, 8 shards


@given(shards=st.integers(1, 64), asked=st.integers(1, 200), data=st.data())
def test_one_round_of_first_asks(shards: int, asked: int, data: st.DataObject) -> None:
    """Shards that hold nothing each get at most an even part of what is left and at least one
    item while any is left; what the round leaves is fewer items than shards."""
    total = data.draw(st.integers(1, shards * asked))
    left, got = total, []
    for _ in range(shards):
        n = min(fair_share(asked, left, 0, total - left, shards), left)  # take() gives <= left
        got.append(n)
        left -= n
    assert max(got) <= math.ceil(total / shards)
    assert all(n >= 1 for n in got[: min(shards, total)])
    assert left < shards


def test_reading_ahead_loses_and_reorders_nothing(tmp_path: Path) -> None:
    """`remaining` reads ahead: items still come out once each, in input order; rejects and
    duplicates found on the way are written with their line numbers; `taken` counts only what
    was handed out; the input's end is announced when its last item is handed out."""
    lines = [_item(f"i{k}") for k in range(6)]
    lines.insert(2, b"{not json")
    lines.insert(5, _item("i1"))  # a duplicate of line 2's id
    source = _source(tmp_path, lines)
    ended: list[int] = []
    source.on_input_end = lambda: ended.append(source.taken)

    assert [i["id"] for i in source.take(1)] == ["i0"]
    assert source.remaining(3) is None  # more than 3 left: unknown how many
    assert source.remaining(10) == 5
    assert source.taken == 1 and not source.exhausted and not ended
    rejects = [orjson.loads(x) for x in (tmp_path / "rejects.jsonl").read_bytes().splitlines()]
    assert [(r["line"], r["reason"][:12]) for r in rejects] == [
        (3, "not valid JS"), (6, "duplicate id")]

    assert [i["id"] for i in source.take(2)] == ["i1", "i2"]
    source.requeue([{"id": "i0", "prompt": "p"}])
    assert source.remaining(10) == 4  # the re-queued item counts
    assert [i["id"] for i in source.take(10)] == ["i0", "i3", "i4", "i5"]
    assert source.exhausted and source.empty and ended == [6] and source.taken == 6
    assert source.take(5) == [] and ended == [6]


def test_remaining_on_an_input_read_without_it(tmp_path: Path) -> None:
    """Without read-ahead the source behaves as it always did: the end is announced by the
    take that reaches it."""
    source = _source(tmp_path, [_item("a"), _item("b")])
    ended: list[bool] = []
    source.on_input_end = lambda: ended.append(True)
    assert [i["id"] for i in source.take(2)] == ["a", "b"]
    assert not ended  # the input's end has not been read yet
    assert source.take(2) == [] and ended == [True] and source.empty
    assert source.remaining(5) == 0


def test_a_limit_takes_that_many_new_items_and_reads_no_line_past_them(tmp_path: Path) -> None:
    """--limit 3: rejects, duplicates and items an earlier pass finished do not count; the
    input ends for this pass right after the third item (its line is the last one read, so
    the manifest's hash covers no line the pass did not use), and the source says so."""
    lines = [_item("a"), b"{not json", _item("done"), _item("a"), _item("b"), _item("c"),
             _item("d")]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    done = DigestSet()
    done.add(id_digest("done"))
    reader = InputReader(path, FIELDS)
    source = WorkSource(reader, tmp_path / "rejects.jsonl", done, limit=3)
    ended: list[int] = []
    source.on_input_end = lambda: ended.append(source.taken)
    assert source.remaining(10) == 3  # read ahead: the limit is the end
    assert [i["id"] for i in source.take(2)] == ["a", "b"]
    assert [i["id"] for i in source.take(5)] == ["c"]
    assert ended == [3] and source.exhausted and source.limit_reached
    assert not source.read_to_end
    assert (source.skipped, source.rejects) == (1, 2)
    assert reader.lines_read == 6 and reader.bytes_read == sum(len(x) + 1 for x in lines[:6])
    assert source.take(5) == []


def test_a_limit_above_the_input_reads_it_to_the_end(tmp_path: Path) -> None:
    source = WorkSource(InputReader(_write(tmp_path, [_item("a"), _item("b")]), FIELDS),
                        tmp_path / "rejects.jsonl", limit=5)  # fmt: skip
    assert [i["id"] for i in source.take(10)] == ["a", "b"]
    assert source.exhausted and source.read_to_end and not source.limit_reached


@pytest.mark.parametrize(("fmt", "tail", "more"), [
    ("jsonl", b"", False), ("jsonl", b"\n", False), ("jsonl", b"\n  \n\t\n", False),
    ("jsonl", _item("c") + b"\n", True), ("jsonl", b"\n\n" + _item("c") + b"\n", True),
    ("csv", b"", False), ("csv", b"\n\r\n\n", False), ("csv", b"\n \n", True),
    ("csv", b"\nc,p\n", True), ("parquet", b"", False), ("parquet", _item("c"), True),
    ("jsonl", BOM, False), ("jsonl", b"\n" + BOM + b" \n" + BOM, False),
    ("jsonl", b" " + BOM + b"\n", True), ("csv", BOM + b"\n", True),
])  # fmt: skip
def test_a_limit_at_the_inputs_last_item_reads_it_to_the_end(
    tmp_path: Path, fmt: str, tail: bytes, more: bool
) -> None:
    """--limit 2 with two items: a file with nothing after them but blank lines, as its reader
    passes over them (whitespace after a JSON line, empty lines after a CSV row), or a Parquet
    file whose last row was read, is read to the end (nothing for a resume to do), and so is a
    JSON line holding only a BOM, which the reader passes over. A record after them, a CSV line
    of spaces or a BOM (a row of the wrong width), or a BOM after a space (no JSON), is more."""
    path = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(_item("a") + b"\n" + _item("b") + b"\n" + tail)
    elif fmt == "csv":
        path.write_bytes(b"id,prompt\na,p\nb,p\n" + tail)
    else:
        pa = pytest.importorskip("pyarrow")
        rows = [orjson.loads(line) for line in (_item("a"), _item("b"), *([tail] if tail else []))]
        pytest.importorskip("pyarrow.parquet").write_table(pa.Table.from_pylist(rows), path)
    reader = InputReader(path, InputPlan(format=fmt))  # type: ignore[arg-type]
    source = WorkSource(reader, tmp_path / "rejects.jsonl", limit=2)
    assert [i["id"] for i in source.take(5)] == ["a", "b"]
    assert source.exhausted and source.limit_reached is more and source.read_to_end is not more


def _write(tmp_path: Path, lines: list[bytes]) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_taken_retried_counts_the_dead_letters_handed_out(tmp_path: Path) -> None:
    """`taken_retried` counts the new items handed out that are dead letters being retried,
    whether read ahead by `remaining` or read by `take`; one not handed out yet and a re-queued
    one (counted when first taken) add nothing."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(_item(i) + b"\n" for i in ("a", "d1", "b", "d2", "d3", "c")))
    retrying = DigestSet()
    for item_id in ("d1", "d2", "d3"):
        retrying.add(id_digest(item_id))
    source = WorkSource(InputReader(path, FIELDS), tmp_path / "rejects.jsonl",
                        retrying=retrying)
    assert [i["id"] for i in source.take(2)] == ["a", "d1"]
    assert source.taken_retried == 1
    assert source.remaining(10) == 4  # d2 and d3 read ahead, not handed out
    assert source.taken_retried == 1
    source.requeue([{"id": "d1", "prompt": "p"}])
    assert [i["id"] for i in source.take(3)] == ["d1", "b", "d2"]
    assert source.taken_retried == 2
    assert [i["id"] for i in source.take(10)] == ["d3", "c"]
    assert source.taken_retried == 3 and source.taken == 6


def _resumed(tmp_path: Path, ids: list[str], done_ids: list[str], **kw: Any) -> WorkSource:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(_item(i) + b"\n" for i in ids))
    done = DigestSet()
    for item_id in done_ids:
        done.add(id_digest(item_id))
    return WorkSource(InputReader(path, FIELDS), tmp_path / "rejects.jsonl", done, **kw)


@pytest.mark.parametrize("limit", [None, 2])
def test_a_resume_skips_finished_lines_in_slices_and_hands_out_the_same(
        tmp_path: Path, limit: int | None) -> None:
    """25 finished lines before the first unfinished item, read in slices of 10 up to it: it
    is kept ahead, no line past it read; what follows is what one `take` hands out with no
    read before it, in the same order, and the limit still counts only new items."""
    ids = [f"done{i}" for i in range(25)] + ["a", "done-late", "b", "c"]
    finished = [i for i in ids if i.startswith("done")]
    (tmp_path / "s").mkdir()
    skipping = _resumed(tmp_path / "s", ids, finished, limit=limit)
    plain = _resumed(tmp_path, ids, finished, limit=limit)
    asyncio.run(skipping.fill(1, lines=10))
    assert skipping.skipped == 25 and skipping.reader.lines_read == 26
    assert [i["id"] for i in skipping.take(10)] == [i["id"] for i in plain.take(10)]
    assert (skipping.skipped, skipping.limit_reached, skipping.exhausted) == (
        plain.skipped, plain.limit_reached, plain.exhausted)


def test_a_skip_that_reaches_the_input_end_leaves_an_ended_input(tmp_path: Path) -> None:
    """Every line finished, 12 of them in slices of 6: the second slice reads all it may and
    cannot tell the end yet; the third finds it. The source is then empty and says the input
    ended once it is asked."""
    ids = [f"done{i}" for i in range(12)]
    source = _resumed(tmp_path, ids, ids)
    ended: list[int] = []
    source.on_input_end = lambda: ended.append(source.taken)
    asyncio.run(source.fill(1, lines=6))
    assert source.skipped == 12 and ended == []
    assert source.take(5) == [] and source.empty and ended == [0]


def test_the_skip_in_slices_yields_to_the_loop_and_stops_when_told(tmp_path: Path) -> None:
    """A task that counts while the skip runs is let in between slices (a skip in one piece
    let it in only once it was over), and a stop (keep_going false) ends the skip there,
    the items not reached unread."""
    ids = [f"done{i}" for i in range(100)] + ["a"]

    async def skip(stop_after: int | None) -> tuple[int, int]:
        source = _resumed(tmp_path, ids, ids[:100])
        ticks = 0

        async def count() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count())
        await asyncio.sleep(0)  # the counter's first tick
        calls = 0

        def keep_going() -> bool:
            nonlocal calls
            calls += 1
            return stop_after is None or calls <= stop_after

        await source.fill(1, keep_going, lines=10)
        seen = ticks
        counter.cancel()
        return seen, source.skipped

    ticks, skipped = asyncio.run(skip(None))
    assert skipped == 100 and ticks >= 10  # one tick per slice at least, the first before
    ticks, skipped = asyncio.run(skip(3))
    assert skipped == 30


SPARSE_LINES = 6_000
SLICE = 100


def _sparse_input(path: Path, kind: str) -> tuple[list[str], DigestSet, DigestSet | None]:
    """An input of SPARSE_LINES lines of which one in 500 holds an item to hand out; the others
    are, by `kind`, finished by an earlier pass (a resume), dead letters' neighbours left out
    (a retry), or rejects and duplicates. Returns those items' ids, `done` and `only`."""
    lines, run, done, only = [], [], DigestSet(), DigestSet()
    for i in range(SPARSE_LINES):
        item_id = f"i{i}"
        if i % 500 == 7:
            run.append(item_id)
            only.add(id_digest(item_id))
        elif kind == "done":
            done.add(id_digest(item_id))
        elif kind == "rejects":
            lines.append(orjson.dumps({"id": "i7", "prompt": "p"}) if i % 2 else b"{not json")
            continue
        elif kind in ("blanks", "csv blanks"):
            lines.append(BOM if i % 3 == 0 and kind == "blanks" else b"")
            continue
        lines.append(f"{item_id},p".encode() if kind == "csv blanks" else _item(item_id))
    header = [b"id,prompt"] if kind == "csv blanks" else []
    path.write_bytes(b"".join(line + b"\n" for line in [*header, *lines]))
    return run, done, only if kind == "left_out" else None


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("kind", ["done", "left_out", "rejects", "blanks", "csv blanks"])
def test_a_sparse_input_is_read_in_slices_between_yields_and_hands_out_the_same(
        tmp_path: Path, kind: str, shards: int) -> None:
    """One or two shards' hand-outs at once, each reading ahead (`fill`) then taking, over an
    input where one line in 500 holds an item to hand out: a task that notes how far the input
    has been read each time the loop lets it in never sees it move by more than a slice,
    though a shard's fills follow each other with no yield between them; the items come out
    as from `take` alone, in input order, with the same counts, and the input's end is said
    once. In one piece, a fill read up to 500 lines at a time; with the slice's count started
    afresh by each fill (one shard) or kept by each fill for itself (two), up to two slices.
    Blank lines (a JSON line of a BOM is one too), and a CSV's blank rows, count as lines
    read: passed over without counting, they were read in one piece, however many."""
    run, done, only = _sparse_input(tmp_path / "in.jsonl", kind)
    plan = InputPlan(format="csv") if kind == "csv blanks" else FIELDS

    def source(name: str) -> WorkSource:
        return WorkSource(InputReader(tmp_path / "in.jsonl", plan), tmp_path / name,
                          done, only=only)

    plain = source("plain.jsonl")
    assert [i["id"] for i in plain.take(len(run) + 1)] == run

    async def hand_out() -> tuple[list[str], list[int], list[int]]:
        sliced, handed, seen = source("sliced.jsonl"), list[str](), [0]
        ended: list[int] = []
        sliced.on_input_end = lambda: ended.append(sliced.taken)

        async def shard() -> None:
            while not sliced.empty:
                await sliced.fill(4, lines=SLICE)
                handed.extend(i["id"] for i in sliced.take(2))

        async def watch() -> None:
            while True:
                seen.append(sliced.reader.lines_read)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(shard() for _ in range(shards)))
        watcher.cancel()
        seen.append(sliced.reader.lines_read)
        assert (sliced.skipped, sliced.left_out, sliced.rejects) == (
            plain.skipped, plain.left_out, plain.rejects)
        return handed, [b - a for a, b in itertools.pairwise(seen)], ended

    handed, steps, ended = asyncio.run(hand_out())
    assert handed == run and ended == [len(run)]
    assert max(steps) <= SLICE + (kind == "csv blanks"), max(steps)  # and its header line


def test_a_settling_read_hands_out_a_sparse_stretch_as_it_is_found(tmp_path: Path) -> None:
    """`fill(..., settle=N)` stops once it has read N entries and holds an item, instead of
    reading on until the look-ahead is full: a retry of a few dead letters among millions of
    lines left every shard idle until the whole input was read. Items still come out in input
    order, every one once, and a fill without `settle` reads on as before."""
    run, done, only = _sparse_input(tmp_path / "in.jsonl", "left_out")

    def source() -> WorkSource:
        return WorkSource(InputReader(tmp_path / "in.jsonl", FIELDS), tmp_path / "rej.jsonl",
                          done, only=only)

    async def hand_out() -> tuple[int, int, list[str]]:
        sparse = source()
        await sparse.fill(4096, lines=SLICE, settle=1_000)
        first = (sparse.reader.lines_read, sparse.ready)
        assert not sparse.read_ahead(4096)
        await sparse.fill(4096, lines=SLICE, settle=1_000)  # items wait: nothing more is read
        assert (sparse.reader.lines_read, sparse.ready) == first
        handed = [i["id"] for i in sparse.take(sparse.ready)]
        while not sparse.empty:
            await sparse.fill(4096, lines=SLICE, settle=1_000)
            handed.extend(i["id"] for i in sparse.take(sparse.ready))
        return *first, handed

    lines_read, ready, handed = asyncio.run(hand_out())
    assert 1_000 <= lines_read <= 1_000 + SLICE
    assert ready == len([i for i in run if int(i[1:]) < lines_read])
    assert ready >= 1 and handed == run

    async def unsettled() -> WorkSource:
        whole = source()
        await whole.fill(4096, lines=SLICE)
        return whole

    whole = asyncio.run(unsettled())
    # Up to the last item it retries (item iN is on line N + 1), no further.
    assert whole.read_ahead(4096) and whole.reader.lines_read == int(run[-1][1:]) + 1
    assert whole.ready == len(run)


_COUNT_OPENS = """
import sys
from pathlib import Path
from shardrun.inputs import InputPlan, InputReader
from shardrun.worksource import WorkSource

tmp = Path(sys.argv[1])
rejects = tmp / "rejects.jsonl"
opens = []
sys.addaudithook(lambda event, args: opens.append(args[0])
                 if event == "open" and str(args[0]) == str(rejects) and args[1] != "r"
                 else None)
source = WorkSource(InputReader(tmp / "in.jsonl", InputPlan()), rejects)
source.take(1)
print(len(rejects.read_bytes().splitlines()))  # on disk before the pass ends
source.take(10_000)
source.close()
print(len(opens), len(rejects.read_bytes().splitlines()))
"""


def test_the_rejects_file_is_opened_once_and_each_reject_is_on_disk_at_once(
        tmp_path: Path) -> None:
    """A thousand bad lines: the rejects file is opened once for them all (it was opened once
    per reject: a million bad lines cost a million opens), yet each reject is on disk as soon
    as it is judged, before the pass ends, as it was (not held in a buffer a kill would lose).
    Counted by an audit hook in a process of its own."""
    bad = [b"{not json"] * 1_000 + [_item("a")]
    (tmp_path / "in.jsonl").write_bytes(b"".join(line + b"\n" for line in bad))
    out = subprocess.run([sys.executable, "-c", _COUNT_OPENS, str(tmp_path)], check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["1000", "1", "1000"]


_FILE_SIZE_LIMIT = """
import resource, sys
from pathlib import Path
from shardrun.errors import stopped_writing
from shardrun.inputs import InputPlan, InputReader
from shardrun.worksource import WorkSource

tmp = Path(sys.argv[1])
# Writes past 250 bytes fail with EFBIG (SIGXFSZ is ignored, as Python has it), as a full disk
# fails with ENOSPC: the write that crosses the limit writes up to it, and says nothing.
resource.setrlimit(resource.RLIMIT_FSIZE, (250, 250))
source = WorkSource(InputReader(tmp / "in.jsonl", InputPlan()), tmp / "rejects.jsonl")
try:
    source.take(100)
except OSError as exc:
    print(stopped_writing(exc, "way on"))
finally:
    source.close()
"""


def test_a_reject_the_disk_has_no_room_for_stops_the_pass_and_leaves_no_torn_line(
        tmp_path: Path) -> None:
    """The unbuffered rejects file's write may write part of a line and raise nothing (a full
    disk, a file size limit): the reject was lost and the file held a torn line. The line is
    written on until the disk says no, which stops the pass with the sentence a full disk
    gives (naming the file), and the file is cut back to its whole lines. In a process of its
    own, with a file size limit of 250 bytes."""
    (tmp_path / "in.jsonl").write_bytes(b"{not json\n" * 20 + _item("a") + b"\n")
    rejects = tmp_path / "rejects.jsonl"
    done = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (f"{rejects}: file too large; the run stopped there: free some space, "
                           "then way on\n")
    held = rejects.read_bytes()
    assert held.endswith(b"\n") and 0 < len(held) <= 250
    assert [orjson.loads(line)["line"] for line in held.splitlines()] == list(
        range(1, held.count(b"\n") + 1))


def test_a_named_id_field_no_record_has_is_warned_once_as_a_pass_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """input.id_field 'uidd' on records that have 'uid' (a typo): each item's id is derived from
    its content, which only validate said; a pass says it once, on stderr, when the first
    ID_CHECK_ITEMS items are read without it (or all of a shorter input). One record with the
    field, early enough, or the default field: no warning."""
    def warnings(lines: list[bytes], plan: InputPlan, limit: int | None = None) -> list[str]:
        path = tmp_path / "in.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        source = WorkSource(InputReader(path, plan), tmp_path / "rejects.jsonl", limit=limit)
        while not source.exhausted:
            source.take(7)
        source.close()
        return [line for line in capsys.readouterr().err.splitlines() if line]

    records = [orjson.dumps({"uid": f"u{i}", "prompt": "p"}) for i in range(150)]
    typo = InputPlan(id_field="uidd")
    assert warnings(records, typo) == [
        "warning: none of the first 100 records has input.id_field 'uidd': their ids are "
        "derived from their content, and results will not carry the input's own ids; check "
        "the field's name"]
    assert warnings(records[:5], typo) == [
        "warning: no record has input.id_field 'uidd': every item's id is derived from its "
        "content, and results will not carry the input's own ids; check the field's name"]
    assert len(warnings(records, typo, limit=3)) == 1  # a limit's last item ends its input
    named = [*records[:99], orjson.dumps({"uidd": "x", "prompt": "p"}), *records[99:]]
    assert warnings(named, typo) == []
    assert warnings(records, InputPlan(id_field="uid")) == []
    assert warnings(records, InputPlan()) == []  # the default, absent: ids derived, documented


def test_a_dense_stretch_after_a_settled_read_is_read_ahead_again(tmp_path: Path) -> None:
    """A read that settled for a sparse stretch's items lets them go out before reading more;
    once a later read fills up (the input dense again), reading ahead tops up as before."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(_item(f"i{i}") + b"\n" for i in range(4_000)))
    only = DigestSet(id_digest(f"i{i}") for i in [7, *range(1_000, 4_000)])
    source = WorkSource(InputReader(path, FIELDS), tmp_path / "rej.jsonl", only=only)

    async def hand_out() -> list[int]:
        readies = []
        for take in (1, 10, 0):
            await source.fill(64, lines=SLICE, settle=500)
            readies.append(source.ready)
            source.take(take)
        return readies

    # Settled with i7 alone; then filled to 64 from the dense stretch; topped up to 64 again.
    assert asyncio.run(hand_out()) == [1, 64, 64]


def test_closing_closes_the_rejects_file_even_when_closing_the_input_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rejects file is closed at a pass's end though closing the input raised (its error
    is raised still): it was left open."""
    source = _source(tmp_path, [b"{not json", _item("a")])
    source.take(2)
    opened = source._rejects_file
    assert opened is not None and not opened.closed

    def fails() -> None:
        raise OSError("input gone")

    monkeypatch.setattr(source.reader, "close", fails)
    with pytest.raises(OSError, match="input gone"):
        source.close()
    assert opened.closed


class _WritesNothing:
    """A raw file whose write writes nothing: None (a non-blocking file that would block) or
    0; it counts the calls, so that a loop that asks again and again is cut short."""

    def __init__(self, gives: int | None) -> None:
        self.gives, self.calls, self.cut_to = gives, 0, -1

    def write(self, data: memoryview) -> int | None:
        self.calls += 1
        if self.calls > 100:
            raise AssertionError("asked to write again and again")
        return self.gives

    def truncate(self, size: int) -> int:
        self.cut_to = size
        return size


@pytest.mark.parametrize("gives", [None, 0])
def test_a_write_of_nothing_raises_rather_than_spin(tmp_path: Path, gives: int | None) -> None:
    """`view[None:]` is the whole line and `view[0:]` too: a raw write that wrote nothing
    was asked again forever. It raises, naming the rejects file, which is cut back."""
    (tmp_path / "in.jsonl").write_bytes(b"")
    rejects = tmp_path / "rejects.jsonl"
    source = WorkSource(InputReader(tmp_path / "in.jsonl", InputPlan()), rejects)
    file = _WritesNothing(gives)
    with pytest.raises(OSError) as raised:
        source._write_reject(file, b'{"line":1}\n')  # type: ignore[arg-type]
    assert raised.value.filename == str(rejects) and raised.value.errno is not None
    assert file.calls == 1 and file.cut_to == 0
    source.close()


def _retry_source(tmp_path: Path, lines: int, only_at: list[int], *, done_at: tuple[int, ...] = (),
                  read_past_only: bool = False) -> WorkSource:
    """A retry pass's source over `lines` items `i0`...: `only` holds those at `only_at`, `done`
    those at `done_at` and every item before the first of `only_at` (an earlier pass's)."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(_item(f"i{i}") + b"\n" for i in range(lines)))
    only = DigestSet()
    only.update(id_digest(f"i{i}") for i in only_at)
    done = DigestSet()
    done.update(id_digest(f"i{i}") for i in (*range(min(only_at)), *done_at))
    return WorkSource(InputReader(path, FIELDS), tmp_path / "rej.jsonl", done, only=only,
                      record_rejects=False, read_past_only=read_past_only)


def test_a_retry_reads_no_line_past_the_last_item_it_retries(tmp_path: Path) -> None:
    """Once every item of `only` is found, the input ends for the pass: the lines after the
    last can hold none of them, and reading them (ten million after a --limit trial) only
    counted what no pass has run while the shards stood idle. The lines passed over before it
    still count as left out; the source says the rest was not read, as the summary must."""
    source = _retry_source(tmp_path, 10_000, [100, 200, 300])
    taken = [i["id"] for i in source.take(10)]
    assert taken == ["i100", "i200", "i300"] and source.empty
    assert source.reader.lines_read == 301  # i300 is on line 301
    assert (source.rest_unread, source.read_to_end) == (True, False)
    assert (source.skipped, source.left_out) == (100, 198)


def test_a_retry_whose_last_item_ends_the_input_read_it_to_its_end(tmp_path: Path) -> None:
    """The last item retried on the last line: nothing was left unread."""
    source = _retry_source(tmp_path, 301, [100, 300])
    assert [i["id"] for i in source.take(10)] == ["i100", "i300"]
    assert (source.rest_unread, source.read_to_end) == (False, True)


def test_a_retried_item_finished_since_is_found_all_the_same(tmp_path: Path) -> None:
    """A dead letter whose item has a result too is passed over as finished, but found: the
    read still ends at the last item of `only`, not at the input's end."""
    source = _retry_source(tmp_path, 1_000, [10, 20], done_at=(20,))
    assert [i["id"] for i in source.take(10)] == ["i10"]
    assert source.reader.lines_read == 21 and source.rest_unread


def test_a_retry_reads_to_the_end_when_an_item_is_missing_or_when_told(tmp_path: Path) -> None:
    """An item of `only` no line holds, or `read_past_only` (results changed by hand since:
    items no pass has run may lie anywhere), reads the whole input and counts what it passes
    over, as before."""
    missing = _retry_source(tmp_path, 1_000, [10, 5_000])
    assert [i["id"] for i in missing.take(10)] == ["i10"]
    assert (missing.reader.lines_read, missing.left_out) == (1_000, 989)
    assert (missing.rest_unread, missing.read_to_end) == (False, True)
    told = _retry_source(tmp_path, 1_000, [10, 20], read_past_only=True)
    assert [i["id"] for i in told.take(10)] == ["i10", "i20"]
    assert (told.reader.lines_read, told.left_out, told.read_to_end) == (1_000, 988, True)
