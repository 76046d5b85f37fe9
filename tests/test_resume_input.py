"""A resume must read the input the run read: an edited input or another file is refused before
any request, an input with lines added at its end is resumed (unless they run on from a last line
read without a line break), and export checks every pass."""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from shardrun import inputs
from shardrun.errors import InputCut, SpecError
from shardrun.inputs import InputPlan, InputReader, Reject
from shardrun.manifest import RunOn, file_digest, input_at_start, prefix_digests, run_on
from shardrun.resume import check_input
from shardrun.worksource import duplicate_reason
from tests.conftest import FAST_SIM, Run, only_run, run_cli, write_input, write_job

RUNS = ("--runs-dir", "runs", "--quiet")


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes (a refused resume must change none)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def assert_exactly_once(run: Run, ids: list[str]) -> None:
    counts = Counter([r["id"] for r in run.results] + [d["id"] for d in run.dead])
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}, counts


def started_with_limit(tmp_path: Path, n: int, limit: int) -> tuple[list[str], Path]:
    """A run of job.yaml over `n` items that stopped after `limit` of them: (ids, run dir)."""
    ids = write_input(tmp_path / "input.jsonl", n)
    write_job(tmp_path / "job.yaml", shards=1)
    first = run_cli("job.yaml", "--limit", str(limit), "--run-id", "qq", *RUNS, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    return ids, only_run(tmp_path / "runs")


def refused(job: str, run: str, path: Path, tmp_path: Path) -> str:
    """`--resume` of run `run` with `job`: refused with one error line, exit 2, the run left
    byte for byte as it was (no request, no result, no manifest entry); the error line."""
    before = snapshot(path)
    resumed = run_cli(job, "--resume", run, *RUNS, cwd=tmp_path)
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    assert resumed.stderr.count("\n") == 1 and "Traceback" not in resumed.stderr
    assert snapshot(path) == before
    return resumed.stderr


def edited_is_refused(tmp_path: Path, name: str, path: Path) -> str:
    """Line 1 of input `name` edited, then `--resume qq` of job.yaml: refused (`refused`),
    naming `name` as the input that is not what the run read; the error line."""
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(data.replace(b"Question 0:", b"Question zero:", 1))
    error = refused("job.yaml", "qq", path, tmp_path)
    assert error.startswith(
        f"error: the input {tmp_path / name} is not what run qq read: its first "), error
    return error


def test_an_input_edited_in_place_is_refused_before_any_request(tmp_path: Path) -> None:
    """Line 1's prompt changed after the run read it: the resume would pair its old answer with
    the new prompt, so it is refused with one sentence and the run is left as it was."""
    _, path = started_with_limit(tmp_path, 30, 10)
    assert "restore the file as the run read it" in edited_is_refused(tmp_path, "input.jsonl", path)


def test_another_input_path_is_refused(tmp_path: Path) -> None:
    """Another job file whose input.path names another file: refused, naming both files, in
    one line: the warnings it would have earned as a resume (other params, another job file's
    run taken as `latest`) are for a resume that goes on, not before its refusal."""
    write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "c.yaml", shards=1)
    first = run_cli("c.yaml", "--limit", "5", *RUNS, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    path = only_run(tmp_path / "runs")
    write_input(tmp_path / "other.jsonl", 20, prefix="other")
    write_job(tmp_path / "other.yaml", shards=1, input={"path": "other.jsonl"},
              params={"max_tokens": 7})
    error = refused("other.yaml", "latest", path, tmp_path)
    assert error.startswith(
        f"error: input.path names {tmp_path / 'other.jsonl'} in other.yaml, but run {path.name} "
        f"read {tmp_path / 'input.jsonl'}, and "), error


def test_an_unchanged_input_resumes_and_every_item_ends_once(tmp_path: Path) -> None:
    ids, path = started_with_limit(tmp_path, 30, 10)
    resumed = run_cli("job.yaml", "--resume", "qq", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "warning" not in resumed.stderr and "error" not in resumed.stderr, resumed.stderr
    assert_exactly_once(Run.load(path), ids)


def test_lines_added_at_the_end_are_resumed(tmp_path: Path) -> None:
    """The run read a prefix of the input; lines added after it are the rest of the work."""
    ids, path = started_with_limit(tmp_path, 20, 10)
    more = write_input(tmp_path / "more.jsonl", 10, prefix="added")
    with open(tmp_path / "input.jsonl", "ab") as f:
        f.write((tmp_path / "more.jsonl").read_bytes())
    resumed = run_cli("job.yaml", "--resume", "qq", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "warning" not in resumed.stderr, resumed.stderr
    assert_exactly_once(Run.load(path), ids + more)


def test_lines_appended_after_a_whole_read_are_left_for_resume(tmp_path: Path) -> None:
    """The first pass read the whole input; lines appended since are items no pass has run. A
    resume with --limit 2 runs two of them, and its summary, `report` and `export` still send
    the other three to --resume (the first pass's whole read was of a shorter file); the
    command the summary gives runs them, each item ending exactly once."""
    ids = write_input(tmp_path / "input.jsonl", 6)
    write_job(tmp_path / "job.yaml", shards=1)
    first = run_cli("job.yaml", "--run-id", "qq", *RUNS, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    path = only_run(tmp_path / "runs")
    more = write_input(tmp_path / "more.jsonl", 5, prefix="added")
    with open(tmp_path / "input.jsonl", "ab") as f:
        f.write((tmp_path / "more.jsonl").read_bytes())
    some = run_cli("job.yaml", "--resume", "qq", "--limit", "2", *RUNS, cwd=tmp_path)
    assert some.returncode == 0, some.stdout + some.stderr
    assert ("  items              2  (--limit 2: the command below runs the rest of the input, "
            "if any)") in some.stdout.splitlines(), some.stdout
    finish = [line for line in some.stdout.splitlines() if line.startswith("  to finish the run")]
    assert len(finish) == 1, some.stdout
    words = shlex.split(finish[0].removeprefix("  to finish the run  "))
    assert words[1:4] == ["job.yaml", "--resume", "qq"], words
    assert Run.load(path).manifest["resumes"][0]["input_read_before"] is False
    report = run_cli("report", str(path), cwd=tmp_path)
    assert ("; its last pass did not read the input to its end (--limit, or a stop): the items "
            "after it have not run, --resume runs them") in report.stdout, report.stdout
    exported = run_cli("export", str(path), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "0 failed, 0 rejected, 3 pending" in exported.stderr, exported.stderr
    assert (f"3 records have no answer yet: `shardrun {tmp_path / 'job.yaml'} --resume qq "
            f"--runs-dir {tmp_path / 'runs'}` runs them") in exported.stderr, exported.stderr
    rest = run_cli(*words[1:], "--quiet", cwd=tmp_path)
    assert rest.returncode == 0, rest.stdout + rest.stderr
    assert "  items              3" in rest.stdout.splitlines(), rest.stdout
    assert "to finish the run" not in rest.stdout, rest.stdout
    assert_exactly_once(Run.load(path), ids + more)


def test_a_copied_input_with_the_same_bytes_resumes_with_a_warning(tmp_path: Path) -> None:
    """A moved or copied project: the path differs, but the file starts with the very bytes the
    run read, so the answers still belong to its lines."""
    ids, path = started_with_limit(tmp_path, 20, 10)
    shutil.copy(tmp_path / "input.jsonl", tmp_path / "copy.jsonl")
    write_job(tmp_path / "job.yaml", shards=1, input={"path": "copy.jsonl"})
    resumed = run_cli("job.yaml", "--resume", "qq", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stderr.startswith(f"warning: input.path names {tmp_path / 'copy.jsonl'}, but "
                                     "run qq read "), resumed.stderr
    assert_exactly_once(Run.load(path), ids)


def test_an_edited_copy_the_last_pass_read_is_named_as_the_file_to_restore(
        tmp_path: Path) -> None:
    """A resume went on with an unedited copy; the copy edited since is the file to restore,
    not the original the first pass read, which the refusal must not send the user back to."""
    _, path = started_with_limit(tmp_path, 30, 10)
    shutil.copy(tmp_path / "input.jsonl", tmp_path / "copy.jsonl")
    write_job(tmp_path / "job.yaml", shards=1, input={"path": "copy.jsonl"})
    second = run_cli("job.yaml", "--resume", "qq", "--limit", "5", *RUNS, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    error = edited_is_refused(tmp_path, "copy.jsonl", path)
    assert "restore the file as the run read it" in error and "input.path back" not in error


def test_export_checks_the_pass_that_produced_the_answers(tmp_path: Path) -> None:
    """A run resumed over an edited input by an earlier shardrun (which recorded the edited
    file's digest for its pass): export compares the first pass's digest too, and refuses."""
    _, path = started_with_limit(tmp_path, 20, 10)
    data = (tmp_path / "input.jsonl").read_bytes()
    (tmp_path / "input.jsonl").write_bytes(data.replace(b"Question 0:", b"Question zero:", 1))
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    sha, size = file_digest(tmp_path / "input.jsonl")
    manifest["resumes"].append({"input": {"path": str(tmp_path / "input.jsonl"),
                                          "bytes_read": size, "sha256_of_bytes_read": sha}})
    (path / "manifest.json").write_bytes(orjson.dumps(manifest))
    done = run_cli("export", str(path), "--with-input", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: the input {tmp_path / 'input.jsonl'} is not what run "
                                  "qq read (its first "), done.stderr
    # One sentence that says what to do, as the resume's refusal does.
    assert done.stderr.count("\n") == 1 and done.stderr.endswith(
        "; restore the file (lines added at its end are fine), or give --job a job file whose "
        "input.path names a copy of it as read\n"), done.stderr
    assert done.stdout == ""


def test_prefix_digests_reads_once_for_every_size(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_bytes(b"abcdef" * 1000)
    got = prefix_digests(file, [6000, 0, 3, 3, 6001])
    assert got == {0: file_digest(file, 0)[0], 3: file_digest(file, 3)[0],
                   6000: file_digest(file)[0], 6001: None}  # fmt: skip


def _manifest(*inputs: dict[str, Any] | None) -> dict[str, Any]:
    """A manifest whose first pass recorded inputs[0] and whose resumes recorded the rest."""
    passes: list[dict[str, Any]] = [{} if i is None else {"input": i} for i in inputs]
    return {**passes[0], "resumes": passes[1:]}


def _ended(path: Path, size: int) -> dict[str, Any]:
    sha, read = file_digest(path, size)
    return {"path": str(path), "bytes_read": read, "sha256_of_bytes_read": sha}


def _started(path: Path) -> dict[str, Any]:
    stat = os.stat(path)
    return {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def test_check_input_without_records_warns_and_goes_on(tmp_path: Path) -> None:
    """A run of an older shardrun killed before it ended recorded nothing of its input."""
    write_input(tmp_path / "in.jsonl", 5)
    (warning,) = check_input(_manifest(None), tmp_path / "in.jsonl", job_name="j.yaml",
                             run_id="r", fmt="jsonl")  # fmt: skip
    assert "cannot check that" in warning


def test_check_input_of_a_pass_that_did_not_end(tmp_path: Path) -> None:
    """A killed pass recorded the file's size and time when it started: unchanged since, no
    warning; modified since, a warning (its digest was never written, so no refusal)."""
    file = tmp_path / "in.jsonl"
    write_input(file, 5)
    ended = _ended(file, 40)
    killed = _manifest(ended, _started(file))
    assert check_input(killed, file, job_name="j.yaml", fmt="jsonl", run_id="r") == []
    with open(file, "ab") as f:
        f.write(b"\n")
    os.utime(file, ns=(1, 1))
    (warning,) = check_input(killed, file, job_name="j.yaml", fmt="jsonl", run_id="r")
    assert warning.startswith("resume 1 of run r did not end, so it never recorded the bytes")
    # The pass before it did record them: those are still checked.
    file.write_bytes(b"x" + file.read_bytes()[1:])
    with pytest.raises(SpecError, match=r"its first 40 bytes differ from those the first pass"):
        check_input(killed, file, job_name="j.yaml", fmt="jsonl", run_id="r")


def test_check_input_refuses_another_file_when_nothing_shows_it_is_the_same(
        tmp_path: Path) -> None:
    write_input(tmp_path / "a.jsonl", 5)
    shutil.copy(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    with pytest.raises(SpecError, match="no pass of the run ended to record the bytes it read"):
        check_input(_manifest(_started(tmp_path / "a.jsonl")), tmp_path / "b.jsonl",
                    job_name="j.yaml", fmt="jsonl", run_id="r")  # fmt: skip


def test_a_resume_says_which_result_files_lost_answers_and_runs_those_items_again(
    tmp_path: Path,
) -> None:
    """A results file deleted and another cut short by hand after the run ended: the resume
    names each (as the manifest listed it), runs their items again, and ends with every id once.
    An untouched run resumes without a word."""
    ids = write_input(tmp_path / "input.jsonl", 60)
    write_job(tmp_path / "job.yaml", shards=2)
    assert run_cli("job.yaml", "--run-id", "qq", *RUNS, cwd=tmp_path).returncode == 0
    path = only_run(tmp_path / "runs")
    quiet = run_cli("job.yaml", "--resume", "qq", *RUNS, cwd=tmp_path)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr
    gone, cut = path / "results/shard-00.jsonl", path / "results/shard-01.jsonl"
    gone.unlink()
    lines = cut.read_bytes().splitlines(keepends=True)
    cut.write_bytes(b"".join(lines[:-3]))
    resumed = run_cli("job.yaml", "--resume", "qq", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    name_gone, name_cut = (str(p.relative_to(path)) for p in (gone, cut))
    assert f"warning: {name_gone} of run qq is missing where the run's last pass to end " in (
        resumed.stderr)
    assert (f"warning: {name_cut} of run qq holds {sum(map(len, lines[:-3])):,} bytes where "
            f"the run's last pass to end wrote {sum(map(len, lines)):,}: items whose answers "
            "are no longer in it run again in this resume, and are paid for again\n"
            ) in resumed.stderr
    run = Run.load(path)
    assert_exactly_once(run, ids)
    assert run.manifest["resumes"][-1]["results_changed"] == [
        line.removeprefix("warning: ") for line in resumed.stderr.splitlines()]


def test_resume_latest_takes_the_newest_run_of_this_job_file(tmp_path: Path) -> None:
    """Two job files sharing a runs directory: `a.yaml --resume latest` resumes a.yaml's run,
    though b.yaml's started later; a job file with no run of its own resumes the newest run
    (a job fixed in a new file), with a warning naming it and the job file it ran, so that
    another job's run is not taken on unseen."""
    write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "a.yaml", shards=1)
    write_job(tmp_path / "b.yaml", shards=1, params={"max_tokens": 8})
    write_job(tmp_path / "c.yaml", shards=1)
    for job, run in (("a.yaml", "ra"), ("b.yaml", "rb")):
        done = run_cli(job, "--limit", "5", "--run-id", run, *RUNS, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    resumed = run_cli("a.yaml", "--resume", "latest", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "--resume latest continues" not in resumed.stderr
    ra, rb = (Run.load(tmp_path / "runs" / r) for r in ("ra", "rb"))
    assert (len(ra.results), len(rb.results)) == (20, 5)
    other = run_cli("c.yaml", "--resume", "latest", *RUNS, cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    assert (f"warning: no run in runs was made or last resumed with {tmp_path / 'c.yaml'}, so "
            f"--resume latest continues the newest run, rb, of {tmp_path / 'b.yaml'}; if that "
            "is not the run to continue, stop this pass and resume by run id"
            ) in other.stderr.splitlines()
    assert len(Run.load(tmp_path / "runs" / "rb").results) == 20


def unterminated(tmp_path: Path, fmt: str, n: int) -> tuple[list[str], bytes]:
    """input.<fmt> of `n` items whose last line has no line break, and job.yaml reading it:
    (ids, the lines of `n` more items to append)."""
    ids, more = [f"item-{i:05d}" for i in range(n)], [f"added-{i:05d}" for i in range(5)]
    if fmt == "csv":
        def text(items: list[str]) -> bytes:
            return b"".join(f"{i},say something about {i}\n".encode() for i in items)
        data, added = b"id,prompt\n" + text(ids), text(more)
    else:
        write_input(tmp_path / "input.jsonl", n)
        write_input(tmp_path / "more.jsonl", 5, prefix="added")
        data, added = ((tmp_path / f).read_bytes() for f in ("input.jsonl", "more.jsonl"))
    (tmp_path / f"input.{fmt}").write_bytes(data.removesuffix(b"\n"))
    write_job(tmp_path / "job.yaml", shards=1, input={"path": f"input.{fmt}"})
    return ids + more, added


def resumes_every_item_once(path: Path, ids: list[str], tmp_path: Path) -> None:
    """`--resume` of run qq with job.yaml runs every item of `ids` no pass has run, each once,
    and export then pairs every line with its answer."""
    resumed = run_cli("job.yaml", "--resume", "qq", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_exactly_once(Run.load(path), ids)
    done = run_cli("export", str(path), cwd=tmp_path)
    assert done.returncode == 0 and f"{len(ids)} ok, 0 failed, 0 rejected, 0 pending" in (
        done.stderr), done.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_lines_appended_to_a_last_line_without_a_line_break_are_refused(
        tmp_path: Path, fmt: str) -> None:
    """The run read a last line without a line break; lines appended since run on from it, so
    it became another line (not valid JSON, a CSV row too wide) that the run had judged already
    and the first appended item would be in no file. The resume and export refuse, naming the
    line; with the line break put in, the resume runs every appended item."""
    ids, added = unterminated(tmp_path, fmt, 20)
    assert run_cli("job.yaml", "--run-id", "qq", *RUNS, cwd=tmp_path).returncode == 0
    path, file = tmp_path / "runs" / "qq", tmp_path / f"input.{fmt}"
    read = file.read_bytes()
    file.write_bytes(read + added)
    line = 20 + (fmt == "csv")  # the CSV header is line 1
    error = refused("job.yaml", "qq", path, tmp_path)
    assert error == (
        f"error: the input {file} grew in a way run qq cannot go on with: its line {line} had "
        "no line break at its end when the first pass read it, and the text added since runs "
        f"on from it, so the items added would never run; put a line break at the end of line "
        f"{line}, before the added text, then resume again\n")
    done = run_cli("export", str(path), cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"error: the input {file} is not what run qq read: its line {line} had no line break "
        "at its end when the first pass read it, and the text added since runs on from it, so "
        "export would show neither that line's answer nor the lines added; put a line break "
        f"at the end of line {line}, before the added text\n")
    file.write_bytes(read + b"\n" + added)
    resumes_every_item_once(path, ids, tmp_path)


def test_a_line_break_alone_completes_the_last_line(tmp_path: Path) -> None:
    """A line break added after a last line read without one changes no line: the resume runs
    nothing and rejects nothing, and lines appended after it later run as usual."""
    ids, added = unterminated(tmp_path, "jsonl", 20)
    assert run_cli("job.yaml", "--run-id", "qq", *RUNS, cwd=tmp_path).returncode == 0
    file = tmp_path / "input.jsonl"
    with open(file, "ab") as f:
        f.write(b"\n")
    resumed = run_cli("job.yaml", "--resume", "qq", "--runs-dir", "runs", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "earlier rejects" not in resumed.stdout and "warning" not in resumed.stderr
    path = tmp_path / "runs" / "qq"
    assert len(Run.load(path).results) == 20
    with open(file, "ab") as f:
        f.write(added)
    resumed = run_cli("job.yaml", "--resume", "qq", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_exactly_once(Run.load(path), ids)


def test_rows_appended_to_a_csv_ending_inside_a_quoted_cell_are_refused(tmp_path: Path) -> None:
    """The run's last row opened a quote the file's end left open (a reject): rows appended
    since are read as part of its cell, inside a row the run rejected already."""
    _, added = unterminated(tmp_path, "csv", 10)
    file = tmp_path / "input.csv"
    file.write_bytes(file.read_bytes() + b'\nopen,"a quote\n')
    assert run_cli("job.yaml", "--run-id", "qq", *RUNS, cwd=tmp_path).returncode == 1
    with open(file, "ab") as f:
        f.write(added)
    error = refused("job.yaml", "qq", tmp_path / "runs" / "qq", tmp_path)
    assert error == (
        f"error: the input {file} grew in a way run qq cannot go on with: the first pass read "
        "it to its end inside a quoted cell (line 12: a quote never closed), and the text added "
        "since is read as part of that row, so the items added would never run; restore the "
        "file as the run read it, or start a new run without --resume\n")


def test_run_on_of_a_pass_recorded_by_an_older_shardrun(tmp_path: Path) -> None:
    """A pass recorded without `open_end`: one that read its input to the end, whose last byte
    is no line break, read a last line without one; one stopped early did not (a CSV's
    `bytes_read` may end inside a row it never used)."""
    file = tmp_path / "in.jsonl"
    file.write_bytes(b'{"prompt":"a"}\n{"prompt":"b"}')
    record = {**_ended(file, file.stat().st_size), "lines_read": 2}
    older = {"input": record, "summary": {"input_read": True}, "resumes": []}
    assert run_on(older, file, "jsonl") is None  # nothing added yet
    file.write_bytes(file.read_bytes() + b'{"prompt":"c"}\n')
    assert run_on(older, file, "jsonl") == RunOn("the first pass", 2, quote=False)
    assert run_on({**older, "summary": {"input_read": False}}, file, "jsonl") is None
    assert run_on({**older, "input": {**record, "open_end": None}}, file, "jsonl") is None
    file.write_bytes(file.read_bytes().replace(b'"}{', b'"}\r\n{'))
    assert run_on(older, file, "jsonl") is None  # a line break (CRLF) completed the line


def test_run_on_of_an_older_pass_over_a_csv_with_lone_cr_rows(tmp_path: Path) -> None:
    """A pass recorded without `open_end` that read a CSV whose rows end with a lone CR (an old
    Mac export) to its end: its last byte, a CR, ended the last row, as the reader reads it, so
    rows appended after it run on into nothing. A last row without a line break still has text
    added after it run on, and in a JSONL file a CR is no line break."""
    file = tmp_path / "in.csv"
    file.write_bytes(b"id,prompt\ra,p\rb,q\r")
    record = {**_ended(file, file.stat().st_size), "lines_read": 3}
    older = {"input": record, "summary": {"input_read": True}, "resumes": []}
    file.write_bytes(file.read_bytes() + b"c,r\rd,s\r")
    assert run_on(older, file, "csv") is None
    assert run_on(older, file, "jsonl") == RunOn("the first pass", 3, quote=False)
    file.write_bytes(b"id,prompt\ra,p\rb,q")
    cut = {**older, "input": {**_ended(file, file.stat().st_size), "lines_read": 3}}
    file.write_bytes(file.read_bytes() + b"c,r\r")
    assert run_on(cut, file, "csv") == RunOn("the first pass", 3, quote=False)


def test_an_older_manifest_of_a_lone_cr_csv_resumes_rows_appended(tmp_path: Path) -> None:
    """A run whose manifest an older shardrun wrote (no `open_end` recorded) over a CSV with
    lone-CR rows, read to its end: rows appended after it are run by --resume, each once, where
    the resume was refused as if they ran on into the last row read."""
    ids = [f"item-{i:02d}" for i in range(6)]
    file = tmp_path / "input.csv"
    file.write_bytes(b"".join(f"{row}\r".encode() for row in ["id,prompt", *(
        f"{i},say {i}" for i in ids)]))
    write_job(tmp_path / "job.yaml", shards=1, input={"path": "input.csv"})
    first = run_cli("job.yaml", "--run-id", "qq", *RUNS, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    path = tmp_path / "runs" / "qq"
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    del manifest["input"]["open_end"]
    (path / "manifest.json").write_bytes(orjson.dumps(manifest))
    more = [f"added-{i}" for i in range(3)]
    with open(file, "ab") as f:
        f.write(b"".join(f"{i},say {i}\r".encode() for i in more))
    resumes_every_item_once(path, [*ids, *more], tmp_path)


def test_retry_failed_s_command_to_finish_names_the_runs_dir_only_when_needed(
        tmp_path: Path) -> None:
    """`retry-failed RUN_DIR` of a run whose input a --limit left unread: the command printed to
    finish it names --runs-dir only when the job alone would look elsewhere, run from where
    the retry ran (no flag chose the directory: `--runs-dir runs` was noise), and run from
    another directory (the job's `runs` is there another one), each printed command works."""
    ids = write_input(tmp_path / "input.jsonl", 30)
    fast = {**FAST_SIM, "fail_500": 0.5}
    write_job(tmp_path / "job.yaml", shards=1, retry={"max_attempts": 1},
              endpoint={"base_url": "sim://", "api": "chat", "model": "sim-test", "sim": fast})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd, run_dir in ((tmp_path, "runs/qq"), (elsewhere, str(tmp_path / "runs" / "qq"))):
        run_cli("job.yaml", "--run-id", "qq", "--limit", "10", "--quiet", cwd=tmp_path)
        retried = run_cli("retry-failed", run_dir, "--quiet", cwd=cwd)
        finish = [line for line in retried.stdout.splitlines()
                  if line.startswith("  to finish the run")]
        assert len(finish) == 1, retried.stdout + retried.stderr
        words = shlex.split(finish[0].removeprefix("  to finish the run  "))
        given = [] if cwd == tmp_path else ["--runs-dir", str(tmp_path / "runs")]
        assert words[2:] == ["--resume", "qq", *given], words
        rest = run_cli(*words[1:], "--quiet", cwd=cwd)
        assert "to finish the run" not in rest.stdout, rest.stdout + rest.stderr
        assert_exactly_once(Run.load(tmp_path / "runs" / "qq"), ids)
        shutil.rmtree(tmp_path / "runs")


def test_retry_failed_with_the_runs_dir_variable_elsewhere_warns_of_no_flag(
        tmp_path: Path) -> None:
    """`retry-failed runs/qq` with SHARDRUN_RUNS_DIR naming another directory: the run's
    directory is the one it takes, no flag the user typed, yet a warning said the flag
    --runs-dir overrides the variable and to leave the flag out. The printed command names
    --runs-dir (the variable would look elsewhere) and, pasted with it still set, finishes."""
    ids = write_input(tmp_path / "input.jsonl", 30)
    fast = {**FAST_SIM, "fail_500": 0.5}
    write_job(tmp_path / "job.yaml", shards=1, retry={"max_attempts": 1},
              endpoint={"base_url": "sim://", "api": "chat", "model": "sim-test", "sim": fast})
    run_cli("job.yaml", "--run-id", "qq", "--limit", "10", "--quiet", cwd=tmp_path)
    env = {"SHARDRUN_RUNS_DIR": str(tmp_path / "other")}
    retried = run_cli("retry-failed", "runs/qq", "--quiet", cwd=tmp_path, env=env)
    assert "warning" not in retried.stderr, retried.stderr
    finish = [line.removeprefix("  to finish the run  ") for line in retried.stdout.splitlines()
              if line.startswith("  to finish the run")]
    assert len(finish) == 1, retried.stdout + retried.stderr
    words = shlex.split(finish[0])
    assert words[2:] == ["--resume", "qq", "--runs-dir", "runs"], words
    rest = run_cli(*words[1:], "--quiet", cwd=tmp_path, env=env)
    assert "to finish the run" not in rest.stdout, rest.stdout + rest.stderr
    assert_exactly_once(Run.load(tmp_path / "runs" / "qq"), ids)
    # The variable is named as unused, but not with "leave the flag out": without the flag
    # the resume would look for qq in the variable's directory, which has none.
    assert [line for line in rest.stderr.splitlines() if "SHARDRUN_" in line] == [
        f"warning: SHARDRUN_RUNS_DIR={tmp_path / 'other'} is not used: the flag --runs-dir "
        "runs overrides it (a flag wins over the environment), so runs are made and resumed "
        "in runs"], rest.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_blank_lines_appended_after_a_whole_read_are_no_unread_input(
        tmp_path: Path, fmt: str) -> None:
    """The first pass read the whole input; only blank lines were appended since, which hold
    no item. A retry pass stopped by --limit leaves dead letters only: its summary sends them
    to retry-failed, not to a --resume that would run nothing, and the pass records that an
    earlier pass read the whole input. An item appended after blank lines still counts."""
    unterminated(tmp_path, fmt, 30)
    fast = {**FAST_SIM, "fail_500": 0.5}
    write_job(tmp_path / "job.yaml", shards=1, input={"path": f"input.{fmt}"},
              endpoint={"base_url": "sim://", "api": "chat", "model": "sim-test", "sim": fast},
              retry={"max_attempts": 1})
    first = run_cli("job.yaml", "--run-id", "qq", *RUNS, cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    path, file = tmp_path / "runs" / "qq", tmp_path / f"input.{fmt}"
    assert len(Run.load(path).dead) > 2
    with open(file, "ab") as f:  # the last line's break, then blank lines
        f.write(b"\n\n\r\n\n" if fmt == "csv" else b"\n\n  \n\t\n")
    some = run_cli("job.yaml", "--resume", "qq", "--retry-failed", "--limit", "1", *RUNS,
                   cwd=tmp_path)
    assert some.returncode == 1, some.stdout + some.stderr
    assert Run.load(path).manifest["resumes"][0]["input_read_before"] is True
    assert "(dead letters taken to retry, of " in some.stdout, some.stdout
    finish = [line for line in some.stdout.splitlines() if line.startswith("  to finish the run")]
    assert finish == [f"  to finish the run  shardrun retry-failed {Path('runs') / 'qq'}"], (
        some.stdout)
    with open(file, "ab") as f:
        f.write(b"late,say something late\n" if fmt == "csv" else orjson.dumps(
            {"id": "late", "prompt": "say something late"}) + b"\n")
    more = run_cli("job.yaml", "--resume", "qq", "--retry-failed", "--limit", "1", *RUNS,
                   cwd=tmp_path)
    assert Run.load(path).manifest["resumes"][1]["input_read_before"] is False, (
        more.stdout + more.stderr)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_limit_that_ends_on_the_last_record_before_blank_lines_reads_the_whole_input(
        tmp_path: Path, fmt: str) -> None:
    """--limit 6 on six items whose file ends with blank lines (an editor's "\\n\\n", a JSON
    line holding only a BOM): nothing but blank lines follows the sixth item, so the pass read
    the whole input, with no limit in its summary and no --resume to print (one would run
    nothing). A row after the blank lines is still more input."""
    unterminated(tmp_path, fmt, 6)
    file = tmp_path / f"input.{fmt}"
    with open(file, "ab") as f:  # a JSON line holding only a BOM is blank too
        f.write(b"\n\n\r\n\n" if fmt == "csv" else b"\n\n  \n\t\n\xef\xbb\xbf\n")
    whole = run_cli("job.yaml", "--limit", "6", "--run-id", "ww", *RUNS, cwd=tmp_path)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "to finish the run" not in whole.stdout and "--limit" not in whole.stdout, whole.stdout
    summary = Run.load(tmp_path / "runs" / "ww").manifest["summary"]
    assert (summary["limit"], summary["input_read"]) == (None, True)
    with open(file, "ab") as f:
        f.write(b"late,say something late\n" if fmt == "csv" else orjson.dumps(
            {"id": "late", "prompt": "say something late"}) + b"\n")
    some = run_cli("job.yaml", "--limit", "6", "--run-id", "ss", *RUNS, cwd=tmp_path)
    assert some.returncode == 0, some.stdout + some.stderr
    summary = Run.load(tmp_path / "runs" / "ss").manifest["summary"]
    assert (summary["limit"], summary["input_read"]) == (6, False)
    assert "to finish the run" in some.stdout, some.stdout


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_spaces_before_the_line_break_added_to_a_last_json_line_complete_it(
        tmp_path: Path, fmt: str) -> None:
    """Spaces, a tab and a CR, then a line break, added after a last JSON line read without one
    leave its record the same (JSON whitespace): the resume runs the items appended after them,
    each once, and export pairs every line. In a CSV they would be part of the row's last cell,
    so there the resume still refuses."""
    ids, added = unterminated(tmp_path, fmt, 20)
    assert run_cli("job.yaml", "--run-id", "qq", *RUNS, cwd=tmp_path).returncode == 0
    path, file = tmp_path / "runs" / "qq", tmp_path / f"input.{fmt}"
    with open(file, "ab") as f:
        f.write(b" \t \r\n" + added)
    if fmt == "csv":
        assert "grew in a way run qq cannot go on with" in refused("job.yaml", "qq", path,
                                                                   tmp_path)
        return
    resumes_every_item_once(path, ids, tmp_path)


@pytest.mark.parametrize("ending", [b"\r", b"\r\n"])
def test_a_csv_whose_rows_end_with_a_lone_cr_resumes_to_its_end(
        tmp_path: Path, ending: bytes) -> None:
    """A CSV from an old Mac export ends its rows with a lone CR, which the csv module reads as
    a line's end. A pass stopped early (--limit) over a file longer than the block it read
    ends in the midst of a row: counting only LF line breaks, it was taken for a last line
    without one, and the resume was refused as if rows had been appended to it. It resumes,
    each item once, the rejected row named once by its line; a last row without a line break,
    completed by a lone CR and rows appended after it, resumes too."""
    ids = [f"item-{i:03d}" for i in range(40)]
    prompt = "x" * 30_000  # 40 rows: more than the 1 MiB block the reader reads at a time
    rows = [b"id,prompt", *(f"{i},{prompt}".encode() for i in ids)]
    rows.insert(4, b"bad,row,three")  # line 5, a reject
    file = tmp_path / "input.csv"
    file.write_bytes(ending.join(rows))
    write_job(tmp_path / "job.yaml", shards=1, input={"path": "input.csv"})
    first = run_cli("job.yaml", "--limit", "5", "--run-id", "qq", *RUNS, cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr  # the reject
    path = tmp_path / "runs" / "qq"
    assert Run.load(path).manifest["input"]["open_end"] is None
    more = [f"added-{i}" for i in range(3)]
    for expected in (ids, [*ids, *more]):
        resumed = run_cli("job.yaml", "--resume", "qq", *RUNS, cwd=tmp_path)
        assert resumed.returncode == 1 and resumed.stderr == "", resumed.stdout + resumed.stderr
        assert_exactly_once(Run.load(path), expected)
        rejects = [orjson.loads(x) for p in sorted(path.glob("rejects*.jsonl"))
                   for x in p.read_bytes().splitlines()]
        assert [(r["line"], r["id"]) for r in rejects] == [(5, "bad")]
        done = run_cli("export", str(path), cwd=tmp_path)
        assert f"{len(expected)} ok, 0 failed, 1 rejected, 0 pending" in done.stderr, done.stderr
        if expected is ids:
            # The whole file read, its last row without a line break: rows appended after a
            # lone CR only complete it.
            with open(file, "ab") as f:
                f.write(b"".join(b"\r" + f"{i},say {i}".encode() for i in more))


def test_rejects_a_killed_pass_wrote_are_not_written_again(tmp_path: Path) -> None:
    """A pass killed before it ended (kill -9: it recorded no lines read) had set aside some bad
    lines already; the resume judges every line again, and wrote those rejects again (22 of 55
    bad lines were on record twice after a kill -9 at 4 s). Each is on record once now, counted
    as an earlier reject; one whose line the kill tore is written again."""
    lines = [orjson.dumps({"id": f"i{n}", "prompt": "p"}) if n % 3 else b"{bad"
             for n in range(24)]
    (tmp_path / "input.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    write_job(tmp_path / "job.yaml", shards=1)
    first = run_cli("job.yaml", "--run-id", "kk", *RUNS, cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    path = only_run(tmp_path / "runs")
    # As a kill -9 leaves it: the manifest as the pass started, three rejects written, the third
    # torn mid-line.
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    manifest.update(status="running", ended_at=None,
                    input=input_at_start(tmp_path / "input.jsonl"))
    del manifest["summary"]
    (path / "manifest.json").write_bytes(orjson.dumps(manifest))
    written = (path / "rejects.jsonl").read_bytes().splitlines(keepends=True)
    assert len(written) == 8
    (path / "rejects.jsonl").write_bytes(b"".join(written[:2]) + written[2][:20])
    resumed = run_cli("job.yaml", "--resume", "kk", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 1, resumed.stdout + resumed.stderr
    # The torn line is cut, as a result file's is, so every line of the rejects files parses.
    assert "repaired: rejects.jsonl: removed a torn last line (20 bytes)" in resumed.stderr
    records = [orjson.loads(raw)["line"] for name in ("rejects.jsonl", "rejects.r1.jsonl")
               for raw in (path / name).read_bytes().splitlines()]
    assert sorted(records) == [n + 1 for n in range(24) if n % 3 == 0]
    summary = orjson.loads((path / "manifest.json").read_bytes())["resumes"][0]["summary"]
    assert (summary["rejects"], summary["prior_rejects"]) == (6, 2)


def test_resume_latest_passes_over_a_manifest_that_is_no_object(tmp_path: Path) -> None:
    """A runs directory holding a damaged run whose manifest.json is a JSON list: --resume
    latest raised AttributeError ('list' object has no attribute 'get') while it ordered the
    runs; it takes the newest sound one."""
    from shardrun.resume import find_run

    runs = tmp_path / "runs"
    for name, manifest in (("good", b'{"started_at": "2026-01-01T00:00:00Z"}'), ("list", b"[1]")):
        (runs / name).mkdir(parents=True)
        (runs / name / "manifest.json").write_bytes(manifest)
    assert find_run(runs, "latest") == runs / "good"


def test_resume_of_an_unknown_run_lists_the_most_recently_started(tmp_path: Path) -> None:
    """The error for a run id that is not there lists the five runs started last, in that
    order: it listed the last five names in alphabetical order, so runs named with --run-id
    (`zz-old`) hid the newest timestamped ones."""
    from shardrun.errors import SpecError
    from shardrun.resume import find_run

    runs = tmp_path / "runs"
    started = {"zz-old": "2025-12-31T00:00:00Z"}
    started.update((f"2026010{day}T000000Z-aaaaaa", f"2026-01-0{day}T00:00:00Z")
                   for day in range(1, 7))
    for name, at in started.items():
        (runs / name).mkdir(parents=True)
        (runs / name / "manifest.json").write_text(f'{{"started_at": "{at}"}}')
    names = list(started)
    with pytest.raises(SpecError) as caught:
        find_run(runs, "nope")
    assert f"(recent runs: {', '.join(names[2:])})" in str(caught.value)


def test_resume_latest_names_no_run_with_a_manifest_or_a_pass_alive_as_never_begun(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only a directory left by a first pass killed before its manifest is said to be one
    (`test_reliability`'s kill -9): not a run with a manifest, however recent its directory's
    change, nor one whose first pass is alive in it (holding its gate) and writing it now,
    which is waited for (`test_runlock`), here in vain: said in one sentence."""
    import fcntl

    from shardrun.errors import SpecError
    from shardrun.resume import PASS_LOCK, find_run

    runs = tmp_path / "runs"
    for name, day in (("old", 1), ("new", 2)):
        (runs / name / "results").mkdir(parents=True)
        (runs / name / "manifest.json").write_bytes(b'{"started_at": "2026-01-0%dT00:00:00Z"}'
                                                    % day)
        os.utime(runs / name / "manifest.json", ns=(day * 10**18, day * 10**18))
    os.utime(runs / "old", ns=(3 * 10**18, 3 * 10**18))  # changed after "new" last ended
    for sub in ("events", "results", "dead", "logs"):  # as `RunDir.create_held` makes them
        (runs / "starting" / sub).mkdir(parents=True)
    os.utime(runs / "starting", ns=(4 * 10**18, 4 * 10**18))
    with open(runs / "starting" / PASS_LOCK, "ab") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)
        os.utime(runs / "starting", ns=(4 * 10**18, 4 * 10**18))
        with pytest.raises(SpecError, match=r"^--resume latest: run starting in .* has been "
                           r"starting for 0.3 s without writing its manifest"):
            find_run(runs, "latest", wait_s=0.3)
    assert capsys.readouterr().err == ("run starting is starting: waiting for its manifest, to "
                                       "tell whether it is this job's newest run, 0.3 s at the "
                                       "most\n")
    assert find_run(runs, "latest") == runs / "new"  # its pass gone: never begun, said so
    assert "starting is a run whose first pass was stopped before it began" in (
        capsys.readouterr().err)


def _rejects_file_size_limit() -> None:
    # Room for the manifest (about 7 KB at its largest), not for the rejects of 200 lines.
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (12_000, 12_000))


def _stopped_by_the_rejects_file_size_limit(tmp_path: Path, shards: int = 2) -> Path:
    """Run job.yaml over input.jsonl under RLIMIT_FSIZE 12,000: it stops at rejects.jsonl,
    whose lines are then lines 1 to N of the rejects, whole and in order. Its run directory."""
    write_job(tmp_path / "job.yaml", shards=shards)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    stopped = subprocess.run([sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs",
                              "--quiet"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=120,
                             preexec_fn=_rejects_file_size_limit)
    assert stopped.returncode == 1 and "rejects.jsonl: file too large" in stopped.stderr, (
        stopped.stderr)
    return only_run(tmp_path / "runs")


def _resumed_rejects_once(tmp_path: Path, path: Path, bad: list[int]) -> None:
    """Resume the stopped run with no file size limit: it counts as earlier rejects what
    rejects.jsonl holds, and every line in `bad` is in exactly one rejects file."""
    first = len((path / "rejects.jsonl").read_bytes().splitlines())
    assert 0 < first < len(bad)
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", "--quiet",
                      cwd=tmp_path)
    assert "Traceback" not in resumed.stderr, resumed.stderr
    assert f"earlier rejects    {first} input lines" in resumed.stdout, resumed.stdout
    rejected = Counter(orjson.loads(line)["line"] for f in sorted(path.glob("rejects*.jsonl"))
                       for line in f.read_bytes().splitlines())
    assert rejected == Counter(bad)


def test_a_reject_the_disk_had_no_room_for_is_judged_again_by_the_resume(tmp_path: Path) -> None:
    """A pass stopped by a full disk under rejects.jsonl recorded the line whose reject it
    could not write as read: the resume took it as judged, so that reject was in no file and
    the resume counted it among the earlier passes' rejects. The pass records the lines before
    it as read: the resume writes that reject, and every bad line is on record once."""
    lines = [b"{not json %d" % n for n in range(200)]
    lines += [orjson.dumps({"id": f"g{n}", "prompt": "p"}) for n in range(5)]
    (tmp_path / "input.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    path = _stopped_by_the_rejects_file_size_limit(tmp_path)
    _resumed_rejects_once(tmp_path, path, list(range(1, 201)))


@pytest.mark.parametrize("long_duplicate", [False, True])
def test_no_line_past_the_first_reject_the_disk_had_no_room_for_is_read(
        tmp_path: Path, long_duplicate: bool) -> None:
    """Four shards' hand-outs read the input: one failed at the rejects file, and only raised
    when its shard next spoke; the others read on and wrote rejects meanwhile, each failure
    noting its own line. Lines between the first failed reject and the last were in no file
    (the manifest's lines_read past them), or, when the failed reject was a long one (a
    duplicate id of 700 characters) and shorter ones after it fit, written again by the
    resume. The first failure stops the source: no line past it is read or written."""
    long_id = "L" * 700
    lines = [orjson.dumps({"id": long_id if n == 0 and long_duplicate else f"a{n}",
                           "prompt": "p"}) for n in range(20)]
    lines += [b"{not json %d" % n for n in range(300)]
    lines += [orjson.dumps({"id": f"z{n}", "prompt": "p"}) for n in range(20)]
    given = tmp_path / "input.jsonl"
    given.write_bytes(b"\n".join(lines) + b"\n")
    if long_duplicate:
        # The duplicate goes where a short reject would still fit, and so would the next one,
        # but its own (naming the 700-character id twice) does not: after it fails, shorter
        # rejects fit again (the rejects file's records, as WorkSource writes them).
        (bad,) = itertools.islice((e for e in InputReader(given, InputPlan()).entries(False)
                                   if isinstance(e, Reject)), 1)

        def size(line: int, reason: str = bad.reason, **named: str) -> int:
            return len(orjson.dumps({"line": line, "reason": reason, "path": str(given),
                                     **named})) + 1

        at, room = 21, 12_000
        while size(at) + size(at + 1) <= room:
            room -= size(at)
            at += 1
        assert size(at, duplicate_reason(long_id), id=long_id) > room >= size(at + 1)
        lines[at - 1] = orjson.dumps({"id": long_id, "prompt": "p"})
        given.write_bytes(b"\n".join(lines) + b"\n")
    path = _stopped_by_the_rejects_file_size_limit(tmp_path, shards=4)
    written = [orjson.loads(line)["line"]
               for line in (path / "rejects.jsonl").read_bytes().splitlines()]
    assert written == list(range(21, 21 + len(written)))
    _resumed_rejects_once(tmp_path, path, list(range(21, 321)))


def _a_resume_stopped_by_a_rejects_directory(tmp_path: Path) -> Path:
    """The job of `tmp_path` run with --limit 2 (one shard), then resumed with a directory where
    the resume's rejects file goes: that resume stops (exit 1). The run's directory."""
    write_job(tmp_path / "job.yaml", shards=1)
    first = run_cli("job.yaml", "--limit", "2", *RUNS, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    path = only_run(tmp_path / "runs")
    (path / "rejects.r1.jsonl").mkdir()
    stopped = run_cli("job.yaml", "--resume", "latest", *RUNS, cwd=tmp_path)
    assert stopped.returncode == 1 and "rejects.r1.jsonl: is a directory" in stopped.stderr, (
        stopped.stdout + stopped.stderr)
    return path


def test_a_rejects_file_that_cannot_be_opened_leaves_its_reject_to_the_resume(
        tmp_path: Path) -> None:
    """A directory where the resume's rejects file goes: its open failed outside the
    bookkeeping of a failed write, so the pass counted the reject, recorded the lines past it
    as read, and the next resume took lines 4 and 5 as earlier rejects no file held. The
    open is a write that failed: the pass records the lines before the reject (3) as read."""
    lines = [orjson.dumps({"id": f"g{n}", "prompt": "p"}) for n in range(3)]
    lines += [b"{not json 4", b"{not json 5", orjson.dumps({"id": "g6", "prompt": "p"})]
    (tmp_path / "input.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    path = _a_resume_stopped_by_a_rejects_directory(tmp_path)
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    assert manifest["resumes"][-1]["input"]["lines_read"] == 3
    (path / "rejects.r1.jsonl").rmdir()
    resumed = run_cli("job.yaml", "--resume", "latest", *RUNS, cwd=tmp_path)
    assert "Traceback" not in resumed.stderr and "earlier rejects" not in resumed.stdout, (
        resumed.stdout + resumed.stderr)
    rejected = Counter(orjson.loads(line)["line"] for f in sorted(path.glob("rejects*.jsonl"))
                       for line in f.read_bytes().splitlines())
    assert rejected == Counter([4, 5])


def test_text_run_on_into_a_last_line_whose_reject_failed_is_judged_by_the_resume(
        tmp_path: Path) -> None:
    """The pass read a last line without a line break, a reject, whose write failed: it
    recorded the lines before it (3) as read, but that line's open end too, so text added to
    it since was refused as running on from line 3 (which had its line break) though no pass
    had judged line 4. The resume judges line 4 as it is now and runs the item added."""
    lines = [orjson.dumps({"id": f"g{n}", "prompt": "p"}) for n in range(3)]
    given = tmp_path / "input.jsonl"
    given.write_bytes(b"\n".join([*lines, b"{not json 4"]))
    path = _a_resume_stopped_by_a_rejects_directory(tmp_path)
    read = orjson.loads((path / "manifest.json").read_bytes())["resumes"][-1]["input"]
    assert (read["lines_read"], read["open_end"]) == (3, None)
    (path / "rejects.r1.jsonl").rmdir()
    given.write_bytes(given.read_bytes() + b" more\n" + orjson.dumps({"id": "g5", "prompt": "p"}))
    resumed = run_cli("job.yaml", "--resume", "latest", *RUNS, cwd=tmp_path)
    assert resumed.returncode == 1 and "1 rejected input line" in resumed.stdout, (
        resumed.stdout + resumed.stderr)  # a rejected line leaves a run failed
    rejected = [orjson.loads(line)["line"] for f in sorted(path.glob("rejects*.jsonl"))
                for line in f.read_bytes().splitlines()]
    assert rejected == [4]
    assert_exactly_once(Run.load(path), ["g0", "g1", "g2", "g5"])


def test_an_input_emptied_under_the_reader_at_a_line_end_is_a_cut_not_an_end(
        tmp_path: Path) -> None:
    """The lines the reader holds already are read, and where the file ends it is shorter than
    what was read: the input was cut, not read whole (a pass would end as if it had been)."""
    write_input(tmp_path / "input.jsonl", 3)
    reader = InputReader(tmp_path / "input.jsonl", InputPlan())
    entries = iter(reader)
    assert isinstance(next(entries), dict)  # the file's 3 short lines are in its buffer now
    os.truncate(tmp_path / "input.jsonl", 0)
    assert [type(entry) for entry in itertools.islice(entries, 2)] == [dict, dict]
    with pytest.raises(InputCut, match=r"holds 0 bytes now, and 1\d\d had been read") as cut:
        next(entries)
    # Said so by any command that reads the input (export, validate, a run's --strict check);
    # a pass says its own way on instead (`runner._said`).
    assert str(cut.value).endswith("put the file back as it was (lines added at its end are "
                                   "fine), then run the command again")


def test_a_line_longer_than_a_block_cut_under_the_reader_is_no_item(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line longer than a block is read on in blocks, then again whole (`inputs._line_on`):
    each block that ends short of a line break asks whether the file was cut, so a line the
    cut ran through is no item, though the reader's buffer held it whole. Blocks of 16 bytes
    here."""
    monkeypatch.setattr(inputs, "CHUNK", 16)
    path = tmp_path / "input.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "p"}\n{"id": "b", "prompt": "' + b"w" * 40 + b'"}\n')
    reader = InputReader(path, InputPlan())
    entries = iter(reader)
    assert next(entries) == {"id": "a", "prompt": "p"}  # the whole file is in its buffer now
    os.truncate(path, 40)
    read: list[Any] = []
    with pytest.raises(InputCut, match=r"holds 40 bytes now, and 43 had been read"):
        read.extend(entries)
    assert read == []


def test_a_line_longer_than_a_block_cut_before_it_is_read_again_is_no_reject(
        tmp_path: Path) -> None:
    """A line longer than a block, a record, is read on in blocks, then read again whole
    (`inputs._line_on`): a cut between the two reads left the second short, and the line the
    file held whole when it was counted and hashed was a reject (not valid JSON) on record
    before the cut was seen. It is a cut, and the pass stops at the line before."""
    path = tmp_path / "input.jsonl"
    first = b'{"id": "a", "prompt": "p"}\n'
    path.write_bytes(first + b'{"id": "b", "prompt": "' + b"w" * inputs.CHUNK + b'"}\n')
    reader = InputReader(path, InputPlan())
    file = reader._file

    class CutBeforeSeek:  # the file cut just before the line is read again
        def __getattr__(self, name: str) -> Any:
            return getattr(file, name)

        def __enter__(self) -> CutBeforeSeek:
            return self

        def __exit__(self, *_: object) -> None:
            file.close()

        def seek(self, offset: int) -> int:
            os.truncate(path, len(first) + 100)
            return file.seek(offset)

    reader._file = CutBeforeSeek()  # type: ignore[assignment]
    read: list[Any] = []
    with pytest.raises(InputCut, match=r"holds 127 bytes now"):
        read.extend(reader)
    assert read == [{"id": "a", "prompt": "p"}]


def test_an_input_file_that_grows_under_the_reader_is_read_on(tmp_path: Path) -> None:
    """Lines appended while the reader reads are no cut; nor is a last line without a break."""
    write_input(tmp_path / "input.jsonl", 2)
    reader = InputReader(tmp_path / "input.jsonl", InputPlan())
    entries = iter(reader)
    assert isinstance(next(entries), dict)
    with open(tmp_path / "input.jsonl", "ab") as f:
        f.write(b'{"id": "late", "prompt": "p"}')  # no line break
    assert [e["id"] for e in entries if isinstance(e, dict)] == ["item-00001", "late"]


def test_a_csv_input_cut_short_under_the_reader_yields_no_row_it_cut(tmp_path: Path) -> None:
    """A CSV truncated while it is read: the rows read before are whole, the row the cut ran
    through is not read as an item with half its prompt, and the reader says what happened."""
    path = tmp_path / "input.csv"
    rows = [f"item-{i:05d},Question {i} asks for something longer than a word.\n"
            for i in range(20_000)]
    path.write_text("id,prompt\n" + "".join(rows))
    reader = InputReader(path, InputPlan(format="csv"))
    entries = iter(reader)
    assert isinstance(next(entries), dict)
    os.truncate(path, 100)
    read: list[Any] = []
    with pytest.raises(InputCut, match=r"holds 100 bytes now"):
        read.extend(entries)
    assert read and all(isinstance(entry, dict) for entry in read)
    assert [f"{e['id']},{e['prompt']}\n" for e in read] == rows[1:len(read) + 1]
