"""`shardrun export`: one row per input record, in input order, from a real run's files.

One run against the simulator's own process (some items dead-lettered by simulated HTTP 500s,
a malformed line, a duplicate id, a blank line) is shared; each test that alters files works on
its own copy of the run's directory, its job and its input.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import decimal
import fcntl
import json
import os
import pty
import re
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from shardrun.errors import SpecError
from shardrun.export import COLUMNS, format_of
from shardrun.outpath import is_run_file, replace_target
from shardrun.worksource import duplicate_reason
from tests.conftest import (
    CLI_TIMEOUT_S,
    FAST_SIM,
    Run,
    null_device,
    only_run,
    read_jsonl,
    run_cli,
    write_input,
    write_job,
)

N = 150
BAD_LINE = b"this line is not JSON\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run in `base/runs/<id>` of `base/job.yaml` over `base/input.jsonl`.

    The input: N records, then a blank line, a line that is not JSON, and a repeat of the
    first record's id. max_attempts 1 with 30 % simulated 500s dead-letters about a third; a
    fifth of the answers are refusals.
    """
    root = tmp_path_factory.mktemp("export")
    ids = write_input(root / "input.jsonl", N)
    with open(root / "input.jsonl", "ab") as f:
        f.write(b"\n" + BAD_LINE)
        f.write(orjson.dumps({"id": ids[0], "prompt": "again"}) + b"\n")
    write_job(root / "job.yaml",
              endpoint={"base_url": "sim://", "api": "chat", "model": "sim-test",
                        "sim": {**FAST_SIM, "fail_500": 0.3, "refusal": 0.2}},
              retry={"max_attempts": 1})  # fmt: skip
    done = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=root)
    assert done.returncode == 1, done.stderr  # some items failed, as the job intends
    return root


def copy_of(base: Path, to: Path) -> tuple[Path, Path]:
    """A copy of the job, input and run under `to`: (run directory, job file)."""
    shutil.copytree(base, to / "w")
    return only_run(to / "w" / "runs"), to / "w" / "job.yaml"


def export(*args: str, cwd: Path) -> Any:
    return run_cli("export", *args, cwd=cwd)


def expected_rows(run: Run) -> list[dict[str, Any]]:
    """What the export must hold, built from the run's own files and the input as written."""
    results = {r["id"]: r for r in run.results}
    dead = {d["id"]: d for d in run.dead}
    rows = []
    for line in range(1, N + 1):
        item_id = f"item-{line - 1:05d}"
        row = {"line": line, "id": item_id, "output": None, "finish_reason": None,
               "usage": None, "attempts": None, "error": None, "reasoning": None,
               "tool_calls": None, "refusal": None, "function_call": None}  # fmt: skip
        if item_id in results:
            r = results[item_id]
            row.update(status="ok", output=r["output"], finish_reason=r["finish_reason"],
                       usage=r["usage"], attempts=r["attempts"],
                       refusal=r.get("refusal"))  # fmt: skip
        else:
            d = dead[item_id]
            row.update(status="failed", error=d["reason"], attempts=len(d["attempts"]))
        rows.append(row)
    blank_then_bad = N + 2  # line N+1 is blank: no record, no row
    rows.append({"line": blank_then_bad, "id": None, "status": "rejected"})
    rows.append({"line": N + 3, "id": "item-00000", "status": "rejected",
                 "error": duplicate_reason("item-00000")})  # fmt: skip
    return rows


def test_jsonl_has_one_row_per_record_in_input_order(base: Path, tmp_path: Path) -> None:
    run = Run.load(only_run(base / "runs"))
    assert run.dead and run.results  # both kinds of ending are there to export
    refused = [r for r in run.results if "refusal" in r]
    assert refused and all(r["output"] == "" and r["refusal"] for r in refused)
    out = tmp_path / "answers.jsonl"
    done = export(str(run.path), "-o", str(out), cwd=base)
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(out)
    want = expected_rows(run)
    assert [r["line"] for r in rows] == [w["line"] for w in want]
    for row, w in zip(rows, want, strict=True):
        assert list(row) == ["line", "id", "status", "output", "finish_reason", "usage",
                             "attempts", "error", "reasoning", "tool_calls",
                             "refusal", "function_call"]  # fmt: skip
        assert {k: row[k] for k in w} == w
    # The rejected rows say what the run's own rejects.jsonl says.
    rejects = read_jsonl(run.path / "rejects.jsonl")
    assert [(r["line"], r["error"]) for r in rows[-2:]] == [(j["line"], j["reason"])
                                                            for j in rejects]  # fmt: skip
    ok, failed = len(run.results), len(run.dead)
    assert (f"exported {N + 2} rows to {out} (jsonl, in input order): {ok} ok, {failed} "
            f"failed, 2 rejected, 0 pending") in done.stderr  # fmt: skip
    assert f"  {failed} records failed: `shardrun retry-failed {run.path}`" in done.stderr
    assert "pending" not in done.stderr.split("\n", 1)[1]
    assert "warning" not in done.stderr  # the job and input are those of the run


def test_csv_holds_the_same_rows(base: Path, tmp_path: Path) -> None:
    run_dir = only_run(base / "runs")
    as_json, as_csv = tmp_path / "a.jsonl", tmp_path / "a.csv"
    assert export(str(run_dir), "-o", str(as_json), cwd=base).returncode == 0
    done = export(str(run_dir), "-o", str(as_csv), cwd=base)  # the suffix picks CSV
    assert done.returncode == 0, done.stderr
    assert "(csv, in input order)" in done.stderr
    with open(as_csv, newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    assert tuple(table[0]) == COLUMNS
    rows = read_jsonl(as_json)
    assert len(table) == len(rows) + 1

    def text(value: object) -> str:  # true and false as JSON has them, as input.NAME cells
        return "" if value is None else orjson.dumps(value).decode() if isinstance(
            value, bool) else str(value)

    assert {c[7] for c in table[1:]} >= {"false"}  # usage_estimated: not Python's False

    for cells, row in zip(table[1:], rows, strict=True):
        usage = row["usage"] or {}
        assert cells == [text(row["line"]), text(row["id"]), row["status"], text(row["output"]),
                         text(row["finish_reason"]), text(usage.get("prompt_tokens")),
                         text(usage.get("completion_tokens")), text(usage.get("estimated")),
                         text(usage.get("cached_tokens")), text(usage.get("reasoning_tokens")),
                         text(row["attempts"]), text(row["error"]), text(row["reasoning"]),
                         text(row["tool_calls"]), text(row["refusal"]),
                         text(row["function_call"])]  # fmt: skip


def test_standard_output_is_the_default(base: Path, tmp_path: Path) -> None:
    run_dir = only_run(base / "runs")
    out = tmp_path / "a.jsonl"
    assert export(str(run_dir), "-o", str(out), cwd=base).returncode == 0
    done = export(str(run_dir), "--format", "jsonl", cwd=base)
    assert done.returncode == 0, done.stderr
    assert done.stdout.encode() == out.read_bytes()
    assert "rows to standard output (jsonl" in done.stderr
    # -o - is standard output too, as for most tools, not a file named '-'.
    dashed = export(str(run_dir), "-o", "-", cwd=tmp_path)
    assert dashed.returncode == 0, dashed.stderr
    assert dashed.stdout.encode() == out.read_bytes() and not (tmp_path / "-").exists()


def test_items_without_a_line_are_pending(base: Path, tmp_path: Path) -> None:
    """A run stopped early: records whose lines are missing, or cut short, are pending."""
    run_dir, _ = copy_of(base, tmp_path)
    results = sorted((run_dir / "results").glob("shard-*.jsonl"))[0]
    lines = results.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 4
    gone = [orjson.loads(line)["id"] for line in lines[-3:]]
    # The last two lines removed, the one before them cut short as a killed writer leaves it.
    results.write_bytes(b"".join(lines[:-3]) + lines[-3][: len(lines[-3]) // 2])
    out = tmp_path / "a.jsonl"
    done = export(str(run_dir), "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    pending = [r for r in read_jsonl(out) if r["status"] == "pending"]
    assert sorted(r["id"] for r in pending) == sorted(gone)
    assert all(r["output"] is None and r["error"] is None for r in pending)
    assert ", 3 pending\n" in done.stderr
    assert f"--resume {run_dir.name} --runs-dir {run_dir.parent}` runs them" in done.stderr
    # The command names the job file whose input was read, ready to paste.
    assert re.search(r"no answer yet: `shardrun /\S+/job\.yaml --resume ", done.stderr), done.stderr
    assert "  1 line of the run is cut short" in done.stderr


def test_pending_items_of_a_run_at_work_are_not_sent_to_resume(base: Path,
                                                                tmp_path: Path) -> None:
    """While a process of the run holds its lock (here a shard's shared hold, taken by a child
    process), a pending item is one the pass has yet to end: --resume would only wait for it,
    so the note says to export again once the run ends."""
    run_dir, _ = copy_of(base, tmp_path)
    results = sorted((run_dir / "results").glob("shard-*.jsonl"))[0]
    results.write_bytes(b"".join(results.read_bytes().splitlines(keepends=True)[:-2]))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from shardrun.resume import share_lock; held = share_lock(Path(sys.argv[1])); "
         "print('held', flush=True); sys.stdin.read()", str(run_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        done = export(str(run_dir), "-o", str(tmp_path / "a.jsonl"), cwd=tmp_path)
        # A retry-failed pass at work never ends an input item no pass has run.
        manifest = orjson.loads((run_dir / "manifest.json").read_bytes())
        (run_dir / "manifest.json").write_bytes(orjson.dumps(
            {**manifest, "resumes": [{"retry_failed": True, "only_failed": True}]}))
        retrying = export(str(run_dir), "-o", str(tmp_path / "r.jsonl"), cwd=tmp_path)
        (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest))
    finally:
        holder.communicate(timeout=30)  # its stdin closed: it exits, letting the lock go
    assert done.returncode == 0, done.stderr
    assert ("  2 records have no answer yet: the run is still at work (a process holds its "
            "lock): export again once it ends\n") in done.stderr, done.stderr
    assert "--resume" not in done.stderr
    # Nor are the failed ones sent to a retry-failed that would wait for the run and be refused.
    retry = f"`shardrun retry-failed {run_dir}` gives those still failed another pass\n"
    for during in (done, retrying):
        assert re.search(r"\n  \d+ records failed: once the pass at work ends, " + re.escape(retry),
                         during.stderr), during.stderr  # fmt: skip
    assert ("  2 records have no answer yet: the pass at work retries dead letters only; once "
            "it ends, `shardrun ") in retrying.stderr, retrying.stderr
    assert f"--resume {run_dir.name} --runs-dir {run_dir.parent}` runs them" in retrying.stderr
    after = export(str(run_dir), "-o", str(tmp_path / "b.jsonl"), cwd=tmp_path)
    assert f"--resume {run_dir.name} --runs-dir {run_dir.parent}` runs them" in after.stderr
    assert re.search(r"\n  \d+ records failed: `shardrun retry-failed " + re.escape(str(run_dir))
                     + "` gives them another pass\n", after.stderr), after.stderr  # fmt: skip


def test_a_result_file_removed_by_hand_is_a_warning(base: Path, tmp_path: Path) -> None:
    """Its records come out pending, the way on a --resume that pays for them again: export
    says that the file the manifest lists is gone, as `report` and a resume do."""
    run_dir, _ = copy_of(base, tmp_path)
    results = sorted((run_dir / "results").glob("shard-*.jsonl"))[0]
    count = len(results.read_bytes().splitlines())
    results.unlink()
    done = export(str(run_dir), "-o", str(tmp_path / "a.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f", {count:,} pending\n" in done.stderr
    name = f"results/{results.name}"
    assert (f"warning: {name} is missing where the run's manifest recorded "
            in done.stderr), done.stderr
    assert "answers were removed or changed by hand" in done.stderr


def test_repeated_and_stray_lines_are_counted(base: Path, tmp_path: Path) -> None:
    """Lines the invariant rules out (a second line for one id, a line for an id the input does
    not have) are reported, not exported: the first line of an id is the one exported."""
    run_dir, _ = copy_of(base, tmp_path)
    first, second = sorted((run_dir / "results").glob("shard-*.jsonl"))[:2]
    record = orjson.loads(first.read_bytes().splitlines()[0])
    stray = {**record, "id": "not-in-the-input"}
    with open(second, "ab") as f:
        f.write(orjson.dumps({**record, "output": "a second answer"}) + b"\n")
        f.write(orjson.dumps({**record, "output": "a third answer"}) + b"\n")
        f.write(orjson.dumps(stray) + b"\n")
    out = tmp_path / "a.jsonl"
    done = export(str(run_dir), "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (row,) = [r for r in read_jsonl(out) if r["id"] == record["id"] and r["status"] == "ok"]
    assert row["output"] == record["output"]
    # counted in lines: one id with three lines was "2 ids have more than one line"
    assert ("  2 lines repeat an id an earlier line of the run has: the first line read was "
            "exported (answers before dead letters, each in pass order)\n") in done.stderr
    assert "  1 line of the run matches no input record: not in the export\n" in done.stderr


def test_of_two_lines_for_an_id_the_earlier_pass_is_exported(base: Path,
                                                              tmp_path: Path) -> None:
    """A damaged run with an id answered in pass 2 and again in pass 10: the line exported is
    pass 2's, the first in pass order. Files were read in name order, where shard-00.r10.jsonl
    comes before shard-00.r2.jsonl, so pass 10's was."""
    run_dir, _ = copy_of(base, tmp_path)
    dead = orjson.loads(sorted((run_dir / "dead").glob("shard-*.jsonl"))[0].read_bytes()
                        .splitlines()[0])
    answer = orjson.loads(sorted((run_dir / "results").glob("shard-*.jsonl"))[0].read_bytes()
                          .splitlines()[0])
    for number in (2, 10):
        line = {**answer, "id": dead["id"], "output": f"pass {number}"}
        (run_dir / "results" / f"shard-00.r{number}.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    out = tmp_path / "a.jsonl"
    done = export(str(run_dir), "-o", str(out), cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr
    (row,) = [r for r in read_jsonl(out) if r["id"] == dead["id"] and r["status"] != "rejected"]
    assert (row["status"], row["output"]) == ("ok", "pass 2")


def test_a_damaged_run_file_is_one_sentence(base: Path, tmp_path: Path) -> None:
    run_dir, _ = copy_of(base, tmp_path)
    results = sorted((run_dir / "results").glob("shard-*.jsonl"))[0]
    size = results.stat().st_size
    with open(results, "ab") as f:
        f.write(b"not a record\n")
    done = export(str(run_dir), "-o", str(tmp_path / "a.jsonl"), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == (f"error: {results} at byte {size} holds a line that is not a record; "
                           "the run directory was edited or damaged\n")  # fmt: skip
    assert not (tmp_path / "a.jsonl").exists()


def test_a_changed_input_is_refused_and_nothing_is_written(base: Path, tmp_path: Path) -> None:
    run_dir, job = copy_of(base, tmp_path)
    out = tmp_path / "a.jsonl"
    out.write_bytes(b"an earlier export\n")
    # The copied job names the copied input (relative paths); the manifest names the original.
    assert export(str(run_dir), "-o", str(out), "--job", str(job), cwd=tmp_path).returncode == 0
    assert out.read_bytes() != b"an earlier export\n"
    out.write_bytes(b"an earlier export\n")
    data = (job.parent / "input.jsonl").read_bytes()
    (job.parent / "input.jsonl").write_bytes(data.replace(b"Question 7:", b"Question 8:", 1))
    done = export(str(run_dir), "-o", str(out), "--job", str(job), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: the input {job.parent / 'input.jsonl'} is not what "
                                  f"run {run_dir.name} read (its first "), done.stderr  # fmt: skip
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert out.read_bytes() == b"an earlier export\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "w"]  # no temporary left


def test_records_appended_since_the_run_are_pending(base: Path, tmp_path: Path) -> None:
    """Only the bytes the run read are checked: records added after them export as pending."""
    run_dir, job = copy_of(base, tmp_path)
    with open(job.parent / "input.jsonl", "ab") as f:
        f.write(orjson.dumps({"id": "added-later", "prompt": "new"}) + b"\n")
    out = tmp_path / "a.jsonl"
    done = export(str(run_dir), "-o", str(out), "--job", str(job), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    last = read_jsonl(out)[-1]
    assert (last["line"], last["id"], last["status"]) == (N + 4, "added-later", "pending")
    assert ", 1 pending\n" in done.stderr


def test_a_moved_job_file_is_named_with_job(base: Path, tmp_path: Path) -> None:
    run_dir, job = copy_of(base, tmp_path)
    manifest = orjson.loads((run_dir / "manifest.json").read_bytes())
    manifest["job"]["path"] = str(tmp_path / "gone.yaml")
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest))
    done = export(str(run_dir), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == (f"error: the job file of run {run_dir.name}, {tmp_path / 'gone.yaml'},"
                           " no longer exists; name it with --job JOB.yaml\n")  # fmt: skip
    done = export(str(run_dir), "--job", str(job), cwd=tmp_path)
    assert done.returncode == 0
    # The failed records' hint names the job file too: without it, retry-failed could not run.
    assert f"failed: `shardrun retry-failed {run_dir} --job {job}` gives them" in done.stderr


def test_a_pass_record_that_is_no_object_is_passed_over(base: Path, tmp_path: Path) -> None:
    """A `resumes` entry that is no JSON object (a manifest edited or damaged) is passed over,
    as a resume and `report` pass over it: the export looked for the job file's SHA-256 in it
    and ended in a traceback (AttributeError)."""
    run_dir, job = copy_of(base, tmp_path)
    manifest = orjson.loads((run_dir / "manifest.json").read_bytes())
    manifest["resumes"] = [5]
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest))
    done = export(str(run_dir), "--job", str(job), "-o", str(tmp_path / "a.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warning: the job file" not in done.stderr  # the first pass's SHA-256 is the job's
    assert len(read_jsonl(tmp_path / "a.jsonl")) == N + 2
    # Nor is an input setting the manifest records as no setting at all read with: the job
    # file's is (the template was handed to the template parser: a traceback).
    manifest["resumes"] = []
    for key, value in [("input.template", 5), ("input.format", "xml"), ("input.id_field", None)]:
        manifest["effective"][key] = {"source": "job file", "value": value}
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest))
    done = export(str(run_dir), "--job", str(job), "-o", str(tmp_path / "a.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr  # no setting is said to have been read with
    assert [r["status"] for r in read_jsonl(tmp_path / "a.jsonl")][-2:] == ["rejected"] * 2
    # Nor is a first pass's job record that is no object (AttributeError, with --job).
    manifest["job"] = 5
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest))
    done = export(str(run_dir), "--job", str(job), "-o", str(tmp_path / "a.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(read_jsonl(tmp_path / "a.jsonl")) == N + 2


def test_a_missing_input_is_named(base: Path, tmp_path: Path) -> None:
    run_dir, job = copy_of(base, tmp_path)
    (job.parent / "input.jsonl").unlink()
    done = export(str(run_dir), "--job", str(job), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == (f"error: input file {job.parent / 'input.jsonl'} does not exist; "
                           "check input.path in the job file\n")  # fmt: skip


def test_an_edited_job_file_is_a_warning(base: Path, tmp_path: Path) -> None:
    run_dir, job = copy_of(base, tmp_path)
    settings = yaml.safe_load(job.read_text())
    settings["concurrency"] = 3
    job.write_text(yaml.safe_dump(settings))
    done = export(str(run_dir), "--job", str(job), "-o", str(tmp_path / "a.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"warning: the job file {job} changed since the run;" in done.stderr


def test_a_job_edited_since_the_run_is_read_as_the_runs_last_pass_read_it(
        tmp_path: Path) -> None:  # fmt: skip
    """The job file edited since for another run (another id field, the template back): the
    input is read with the settings the run's last pass recorded, not the job file's, with a
    warning for each. The export read it with the job file's: a record came out beside another
    record's answer (every id of the new field is another record's old id), and the records
    without the template's field came out rejected, their answers left out. The last pass's,
    not the first's: the template the first pass rejected three records by, the resume dropped."""
    with open(tmp_path / "input.jsonl", "wb") as f:
        for i in range(6):
            lang = {"lang": "en"} if i < 3 else {}
            record = {"id": f"a{i}", "alt": f"a{5 - i}", "prompt": f"Q {i}", **lang}
            f.write(orjson.dumps(record) + b"\n")
    job = tmp_path / "job.yaml"
    write_job(job, shards=1, input={"path": "input.jsonl", "template": "{prompt} in {lang}"})
    assert run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path).returncode == 1
    write_job(job, shards=1)  # the template fixed: the resume runs the three records it rejected
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", "--quiet",
                      cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    run_dir = only_run(tmp_path / "runs")
    answers = {r["id"]: r["output"] for r in Run.load(run_dir).results}
    assert len(answers) == 6
    write_job(job, shards=1, input={"path": "input.jsonl", "id_field": "alt",
                                    "template": "{prompt} in {lang}"})  # fmt: skip
    out = tmp_path / "a.jsonl"
    done = export(str(run_dir), "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [(r["id"], r["status"], r["output"]) for r in read_jsonl(out)] == [
        (f"a{i}", "ok", answers[f"a{i}"]) for i in range(6)]
    said = "when the run's last pass read the input; export read it as that pass did"
    assert done.stderr.startswith(
        f'warning: input.id_field is "alt" in {job} but was "id" {said}\n'
        f'warning: input.prompt_field is null in {job} but was "prompt" {said}\n'
        f'warning: input.template is "{{prompt}} in {{lang}}" in {job} but was null {said}\n'
        # the resumed pass asked otherwise: its answers sit beside pass 0's
        f"warning: pass 1 of run {run_dir.name} sent another input.prompt_field and "
        "input.template than pass 0 did,"), done.stderr  # fmt: skip
    assert "\nexported 6 rows" in done.stderr


def test_a_run_that_never_ended_a_pass_is_exported_unchecked(base: Path, tmp_path: Path) -> None:
    """A run killed in its first pass recorded no input digest: export says it cannot check."""
    run_dir, _ = copy_of(base, tmp_path)
    manifest = orjson.loads((run_dir / "manifest.json").read_bytes())
    del manifest["input"]
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest))
    done = export(str(run_dir), "-o", str(tmp_path / "a.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(f"warning: no pass of run {run_dir.name} has ended, so the "
                                  "input could not be checked against what the run read\n")
    assert len(read_jsonl(tmp_path / "a.jsonl")) == N + 2


def test_write_failures_are_one_sentence(base: Path, tmp_path: Path) -> None:
    run_dir = only_run(base / "runs")
    missing = tmp_path / "no-such-dir" / "a.jsonl"
    done = export(str(run_dir), "-o", str(missing), cwd=base)
    assert (done.returncode, done.stderr) == (  # a usage error, as a directory given is
        2, f"error: -o {missing}: there is no directory {missing.parent}; create it, or name a "
           "file in one that exists\n")  # fmt: skip
    done = export(str(run_dir), "-o", str(tmp_path), cwd=base)
    assert (done.returncode, done.stderr) == (
        2, f"error: -o {tmp_path} is a directory; name the file to write\n")
    # A name ending in a slash names a directory (one not there yet): `Path` dropped the slash,
    # and a file named `new` was written. Nor is a file taken for the directory it is not.
    done = export(str(run_dir), "-o", f"{tmp_path}/new/", cwd=base)
    assert (done.returncode, done.stderr) == (
        2, f"error: --output: {tmp_path}/new/ ends in /, so it names a directory; name the "
           "file to write\n")  # fmt: skip
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a.jsonl").write_bytes(b"")
    done = export(str(run_dir), "-o", str(tmp_path / "a.jsonl" / "b.jsonl"), cwd=base)
    assert (done.returncode, done.stderr) == (
        2, f"error: -o {tmp_path / 'a.jsonl' / 'b.jsonl'}: {tmp_path / 'a.jsonl'} is a file, "
           "not a directory; name a file in a directory\n")  # fmt: skip
    (tmp_path / "a.jsonl").unlink()
    with open("/dev/full", "wb") as full:  # a disk with no space left
        proc = subprocess.run([sys.executable, "-m", "shardrun", "export", str(run_dir)],
                              cwd=base, stdout=full, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL, timeout=CLI_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == ("error: could not write the export to standard output: no space "
                           "left on device\n")  # fmt: skip


def test_the_runs_own_files_and_inputs_are_never_written(base: Path, tmp_path: Path) -> None:
    """-o inside a run directory (results/ would read as finished items to --resume; this run's
    or another's), over the input or the job file, or either by another name (a hard link,
    compared by device and inode): exit 2, one sentence, nothing written."""
    run_dir, job = copy_of(base, tmp_path)
    other = tmp_path / "w" / "runs" / "other"
    (other / "results").mkdir(parents=True)
    (other / "manifest.json").write_text("{}")
    os.link(tmp_path / "w" / "input.jsonl", tmp_path / "input-link.jsonl")  # one file, 2 names
    os.link(job, tmp_path / "job-link.yaml")
    os.link(base / "job.yaml", tmp_path / "ran.yaml")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    inside = (f"lies inside run directory {run_dir.resolve()}, whose files --resume, export "
              "and report read back; name a file outside it")
    for target, says in [
        (run_dir / "results" / "answers.jsonl", inside),
        (run_dir / "results" / "shard-00.jsonl", inside),
        (run_dir / "events" / "x.csv", inside),
        (run_dir / "manifest.json", inside),
        (run_dir / "rejects.jsonl", inside),
        (other / "results" / "shard-99.jsonl",
         f"lies inside run directory {other.resolve()}, whose files --resume, export and report "
         "read back; name a file outside it"),
        (tmp_path / "w" / "input.jsonl",
         "is the run's input file; writing there would destroy it, so name another file"),
        (job, "is the run's job file; writing there would destroy it, so name another file"),
        (tmp_path / "input-link.jsonl", f"is the run's input file ({tmp_path.resolve()}/w/"
         "input.jsonl, by another name); writing there would destroy it, so name another file"),
        (tmp_path / "job-link.yaml", f"is the run's job file ({job.resolve()}, by another "
         "name); writing there would destroy it, so name another file"),
        # the job file the run's manifest records, the one --job stands in for
        (tmp_path / "ran.yaml", f"is the run's job file ({base.resolve()}/job.yaml, by another "
         "name); writing there would destroy it, so name another file"),
    ]:
        done = export(str(run_dir), "-o", str(target), "--job", str(job), cwd=tmp_path)
        assert (done.returncode, done.stderr) == (2, f"error: -o {target} {says}\n"), target
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_link_and_a_fifo_stay_what_they_are(base: Path, tmp_path: Path) -> None:
    """Through a symbolic link the file it names gets the rows and the link stays; a FIFO is
    written in place (its reader gets the rows), and so is a device (here a node with
    /dev/null's numbers, never the machine's own) and a link to standard output."""
    run_dir = only_run(base / "runs")
    plain = tmp_path / "plain.jsonl"
    assert export(str(run_dir), "-o", str(plain), cwd=base).returncode == 0
    rows = plain.read_bytes()
    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    real.write_bytes(b"old\n")
    link.symlink_to(real)
    assert export(str(run_dir), "-o", str(link), cwd=base).returncode == 0
    assert link.is_symlink() and real.read_bytes() == rows
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        done = export(str(run_dir), "-o", str(fifo), cwd=base)
        got, _ = reader.communicate(timeout=30)  # no writer ever opened the FIFO: cat waits
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
    assert done.returncode == 0, done.stderr
    assert got == rows and stat.S_ISFIFO(fifo.stat().st_mode)
    # A link to standard output (as /dev/stdout is), standard output a pipe: the link
    # resolves to /proc/PID/fd/pipe:[N], no file to write beside, so it is written in place.
    (tmp_path / "fakedev").mkdir()
    out = tmp_path / "fakedev" / "stdout"
    out.symlink_to("/proc/self/fd/1")
    piped = export(str(run_dir), "-o", str(out), cwd=base)
    assert piped.returncode == 0 and piped.stdout == rows.decode(), piped.stderr
    assert out.is_symlink()
    null = null_device(tmp_path / "fakedev" / "null")
    assert export(str(run_dir), "-o", str(null), cwd=base).returncode == 0
    assert stat.S_ISCHR(null.stat().st_mode)


def test_where_a_write_goes_in_place_and_which_files_are_the_runs(tmp_path: Path) -> None:
    """Descriptor paths and files that are no regular ones are written in place; a regular
    file is replaced through a temporary one, under /dev/ too (/dev/shm: in place, a second
    sample was appended to the first, a file verify could not read), and through a link the
    file it names. The Batch API files are the run's own: listed and verified (they were
    neither, so an edited batch_output.jsonl verified ok)."""
    for descriptor in ("/dev/stdout", "/dev/stderr", "/dev/fd/1", "/proc/self/fd/1"):
        assert replace_target(Path(descriptor)) is None, descriptor
    assert replace_target(Path("/dev/null")) is None  # a device (only looked at)
    shm = Path("/dev/shm/shardrun-never-written.json")  # only its place is looked at
    assert replace_target(shm) == Path(os.path.realpath(shm))
    regular, link = tmp_path / "a.json", tmp_path / "link.json"
    regular.write_text("x")
    link.symlink_to(regular)
    assert replace_target(link) == regular
    for own in ("batch_output.jsonl", "batch_errors.jsonl", "rejects.r2.jsonl",
                "events/shard-00.jsonl", "logs/launcher.log"):
        assert is_run_file(own), own
    for other in ("samples/minute.json", "report.html", "batch_output.json"):
        assert not is_run_file(other), other


def test_dev_stdout_is_standard_output_into_a_pipe_or_an_appended_file(
        base: Path, tmp_path: Path) -> None:
    """`-o /dev/stdout` writes to standard output itself: into a pipe (where the path leads to
    no file), and into a file the shell opened with `>>` (whose earlier lines stay)."""
    run_dir = only_run(base / "runs")
    plain = export(str(run_dir), cwd=base).stdout
    piped = export(str(run_dir), "-o", "/dev/stdout", cwd=base)
    assert piped.returncode == 0 and piped.stdout == plain, piped.stderr
    appended = tmp_path / "all.jsonl"
    appended.write_text("PRIOR\n")
    with open(appended, "ab") as sink:
        subprocess.run([sys.executable, "-m", "shardrun", "export", str(run_dir), "-o",
                        "/dev/stdout"], cwd=base, stdout=sink, stderr=subprocess.DEVNULL,
                       stdin=subprocess.DEVNULL, timeout=CLI_TIMEOUT_S, check=True)
    assert appended.read_text() == "PRIOR\n" + plain
    # A reader that left early is no error, as for standard output (`export RUN | head`).
    for output in ([], ["-o", "/dev/stdout"]):
        gone = subprocess.Popen([sys.executable, "-m", "shardrun", "export", str(run_dir),
                                 *output], cwd=base, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert gone.stdout is not None
        gone.stdout.close()  # before the first row
        _, err = gone.communicate(timeout=CLI_TIMEOUT_S)
        assert (gone.returncode, err) == (0, b""), output


def files_up_to(size: int) -> Callable[[], None]:
    """For a child process: its files may not grow past `size` bytes, and a write past that
    fails (EFBIG, "file too large") instead of killing the process (SIGXFSZ ignored)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def export_limited(run_dir: Path, out: Path, size: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardrun", "export", str(run_dir), "-o",
                           str(out)], cwd=out.parent, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=CLI_TIMEOUT_S,
                          preexec_fn=files_up_to(size))  # fmt: skip


def test_a_write_failing_halfway_keeps_the_earlier_export(base: Path, tmp_path: Path) -> None:
    run_dir = only_run(base / "runs")
    out = tmp_path / "a.jsonl"
    assert export(str(run_dir), "-o", str(out), cwd=base).returncode == 0
    whole = out.read_bytes()
    out.write_bytes(b"an earlier export\n")
    # Half the export's size: the scratch index (a few pages) fits, the export does not.
    proc = export_limited(run_dir, out, len(whole) // 2)
    assert proc.returncode == 1
    assert proc.stderr == (f"error: could not write {out}: file too large; nothing was written "
                           "(free some space, or name another file with -o)\n")  # fmt: skip
    assert out.read_bytes() == b"an earlier export\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


def test_a_full_scratch_disk_is_one_sentence(base: Path, tmp_path: Path) -> None:
    run_dir = only_run(base / "runs")
    out = tmp_path / "a.jsonl"
    proc = export_limited(run_dir, out, 4096)  # not even the index's second page fits
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: the export's scratch index in "), proc.stderr
    assert proc.stderr.endswith(" failed (disk I/O error); free some space there, or set "
                                "TMPDIR to a directory that has some\n"), proc.stderr
    assert not out.exists()


def test_not_a_run_directory(base: Path, tmp_path: Path) -> None:
    done = export(str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == f"error: {tmp_path} is not a run directory: it has no manifest.json\n"
    # The runs directory, or a folder of a run, given for the run: the sentence names the run.
    run_dir = only_run(base / "runs")
    for given, clause in [
        ("runs", f"it holds runs: name one, such as runs/{run_dir.name}, the one written last"),
        # The project's folder, where the job ran: its runs/ holds them.
        (".", f"runs/ holds runs: name one, such as runs/{run_dir.name}, the one written last"),
        (f"runs/{run_dir.name}/results",
         f"it is a folder of a run: name the run directory, runs/{run_dir.name}"),
    ]:  # fmt: skip
        done = export(given, cwd=base)
        assert (done.returncode, done.stderr) == (
            2, f"error: {given} is not a run directory: it has no manifest.json; {clause}\n")
    # `latest`, as `--resume` takes it: a word of --resume's only, and where the runs are.
    for given in ("latest", "runs/latest"):
        done = export(given, cwd=base)
        assert (done.returncode, done.stderr) == (2, (
            f"error: {given} is not a run directory: nothing is there (latest names a run for "
            f"--resume only); runs/ holds runs: name one, such as runs/{run_dir.name}, the one "
            "written last\n"))


def test_after_retry_failed_the_new_segment_counts(base: Path, tmp_path: Path) -> None:
    """Segments: results of the second pass (shard-NN.r1.jsonl) are found; superseded dead
    letters (dead/superseded-r1/) are not."""
    run_dir, job = copy_of(base, tmp_path)
    settings = yaml.safe_load(job.read_text())
    settings["endpoint"]["sim"].pop("fail_500")
    job.write_text(yaml.safe_dump(settings))
    again = run_cli(str(job), "--resume", run_dir.name, "--runs-dir", str(run_dir.parent),
                    "--retry-failed", "--quiet", cwd=tmp_path)  # fmt: skip
    # The two lines the first pass rejected still leave the run failed; this pass does not
    # count them as its own failures again.
    assert again.returncode == 1, again.stderr
    assert "failed             0\n" in again.stdout
    assert "earlier rejects    2 input lines rejected by earlier passes" in again.stdout
    assert list((run_dir / "results").glob("shard-*.r1.jsonl"))
    out = tmp_path / "a.jsonl"
    # --job: the manifest names the job file the copied run was started with, not the copy.
    done = export(str(run_dir), "-o", str(out), "--job", str(job), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "more than one line" not in done.stderr  # dead/superseded-r1/ is not read
    # The job edited before the resume is the newest pass's: no warning of it, only that the
    # resumed pass asked another simulator (its faults) than pass 0.
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning")]
    assert warnings == [f"warning: pass 1 of run {run_dir.name} sent another endpoint.sim than "
                        "pass 0 did, so its answers were not all asked the same way (each "
                        "pass's `effective` in manifest.json says how)"], done.stderr
    rows = read_jsonl(out)
    assert [r["status"] for r in rows] == ["ok"] * N + ["rejected"] * 2
    results = {r["id"]: r for r in Run.load(run_dir).results}
    assert len(results) == N
    assert all(r["output"] == results[r["id"]]["output"] for r in rows[:N])


def test_format_of() -> None:
    assert format_of(None, None) == "jsonl"
    assert format_of(Path("x.CSV"), None) == "csv"
    assert format_of(Path("x.csv"), "jsonl") == "jsonl"
    assert format_of(Path("x.txt"), None) == "jsonl"
    assert format_of(None, "csv") == "csv"
    # A table format export does not write is refused, not filled with JSON lines.
    with pytest.raises(SpecError, match=r"^-o answers\.parquet: export writes JSON lines or "
                                        r"CSV, not Parquet; name the file \.jsonl or \.csv"):
        format_of(Path("answers.parquet"), None)
    assert format_of(Path("answers.parquet"), "jsonl") == "jsonl"  # asked for by name
    # Nor is a compressed file's name filled with plain text: `answers.csv.gz` got JSON lines.
    with pytest.raises(SpecError, match=r"^-o answers\.csv\.gz: export writes JSON lines or "
                                        r"CSV, not gzip; name the file \.jsonl or \.csv"):
        format_of(Path("answers.csv.gz"), None)
    # Whose way on is no --format: that would write plain text under the compressed name.
    with pytest.raises(SpecError, match=r"\(or pipe standard output through gzip: `shardrun "
                                        r"export runs/r --format csv \| gzip > "
                                        r"answers\.csv\.gz`\)$"):
        format_of(Path("out/answers.csv.gz"), None, Path("runs/r"))
    with pytest.raises(SpecError, match=r"not ZIP; name the file \.jsonl or \.csv \(or zip that "
                                        r"file once it is written\)$"):
        format_of(Path("answers.zip"), None)


def test_a_csv_input_exports_by_row(tmp_path: Path) -> None:
    """A CSV input (one prompt spans two physical lines): rows in the input's order, each with
    the line the run would name in rejects.jsonl."""
    rows = [["id", "prompt"], *[[f"c{i}", f"Question {i}"] for i in range(12)]]
    rows[4][1] = "a prompt\nover two lines"
    with open(tmp_path / "input.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    write_job(tmp_path / "job.yaml", input={"path": "input.csv"})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "a.jsonl"
    exported = export(str(only_run(tmp_path / "runs")), "-o", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    got = read_jsonl(out)
    assert [r["id"] for r in got] == [f"c{i}" for i in range(12)]
    assert {r["status"] for r in got} == {"ok"}
    # The header is line 1. c3 spans lines 5-6 and is numbered by its first line, as the run
    # numbers a CSV record in rejects.jsonl; the next record starts at line 7.
    assert [r["line"] for r in got] == [2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14]


def test_a_csv_row_of_the_wrong_width_keeps_its_id(tmp_path: Path) -> None:
    """A CSV row with more or fewer values than the header is rejected with the id its id
    column holds, in rejects.jsonl and in the export; a row that ends before its id column
    has none."""
    (tmp_path / "input.csv").write_text(
        "extra,qid,question\nx,1,Fine\nx,5,Too,many\nx,6\nshort\nx,7,Fine too\n")
    write_job(tmp_path / "job.yaml",
              input={"path": "input.csv", "id_field": "qid", "prompt_field": "question"})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # rejected lines make a run failed
    run_dir = only_run(tmp_path / "runs")
    rejects = [(r["line"], r.get("id")) for r in read_jsonl(run_dir / "rejects.jsonl")]
    assert rejects == [(3, "5"), (4, "6"), (5, None)]
    out = tmp_path / "a.jsonl"
    assert export(str(run_dir), "-o", str(out), cwd=tmp_path).returncode == 0
    assert [(r["line"], r["id"], r["status"]) for r in read_jsonl(out)] == [
        (2, "1", "ok"), (3, "5", "rejected"), (4, "6", "rejected"), (5, None, "rejected"),
        (6, "7", "ok")]


# -- --with-input -----------------------------------------------------------------------------


def input_records(path: Path) -> list[Any]:
    """Each non-blank line of a JSON lines input: its record, or None where it is not JSON."""
    records: list[Any] = []
    for raw in path.read_bytes().splitlines():
        if raw.strip():
            records.append(None if raw + b"\n" == BAD_LINE else orjson.loads(raw))
    return records


def test_with_input_puts_each_record_next_to_its_answer(base: Path, tmp_path: Path) -> None:
    """JSON lines: every row holds its input record as written under `input` (None for the
    line that is not JSON, the repeat's own record for the duplicate id), and the other keys
    are those of the plain export."""
    run_dir = only_run(base / "runs")
    plain, wide = tmp_path / "plain.jsonl", tmp_path / "wide.jsonl"
    assert export(str(run_dir), "-o", str(plain), cwd=base).returncode == 0
    done = export(str(run_dir), "-o", str(wide), "--with-input", cwd=base)
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(wide)
    assert [r["input"] for r in rows] == input_records(base / "input.jsonl")
    assert rows[-1]["input"] == {"id": "item-00000", "prompt": "again"}
    assert [{k: v for k, v in r.items() if k != "input"} for r in rows] == read_jsonl(plain)


def test_with_input_in_csv_has_a_column_per_key_of_a_json_lines_input(tmp_path: Path) -> None:
    """JSON lines records need not share their keys: CSV gets one input.KEY column for every
    key any record has, in the order first seen (a BOM before the first line is no part of its
    first key), an empty cell where a record lacks one, and a nested value as its JSON text;
    the line that is not JSON has empty input cells."""
    records = [{"id": "a", "prompt": "one", "lang": "en"},
               {"id": "b", "prompt": "two", "meta": {"n": 1, "ok": True}},
               {"id": "c", "prompt": "three", "tags": ["x", "y"], "lang": "de", "n": 2.5}]
    lines = [orjson.dumps(r) for r in records]
    (tmp_path / "input.jsonl").write_bytes(b"\xef\xbb\xbf" + lines[0] + b"\n\n" + BAD_LINE
                                           + b"\n".join(lines[1:]) + b"\n")
    write_job(tmp_path / "job.yaml")
    ran = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert ran.returncode == 1, ran.stderr  # the line that is not JSON is set aside
    run_dir = str(only_run(tmp_path / "runs"))
    out = tmp_path / "wide.csv"
    done = export(run_dir, "-o", str(out), "--with-input", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with open(out, newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    keys = ["id", "prompt", "lang", "meta", "tags", "n"]
    assert table[0] == [*COLUMNS, *(f"input.{k}" for k in keys)]
    inputs = [row[len(COLUMNS):] for row in table[1:]]
    assert inputs == [["a", "one", "en", "", "", ""],
                      ["", "", "", "", "", ""],  # the line that is not JSON
                      ["b", "two", "", '{"n":1,"ok":true}', "", ""],
                      ["c", "three", "de", "", '["x","y"]', "2.5"]]  # fmt: skip
    statuses = [row[COLUMNS.index("status")] for row in table[1:]]
    assert statuses == ["ok", "rejected", "ok", "ok"]


def test_with_input_shows_a_whole_number_past_64_bits_as_written(tmp_path: Path) -> None:
    """orjson reads 18446744073709551616 and ...617 as one float: the ids were exact, but each
    row's input held the float (1.8446744073709552e+19), so two rows had one input.id and it
    did not join its id. The input shows each whole number as written, nested ones in such a
    line too; a float stays what it is."""
    (tmp_path / "input.jsonl").write_bytes(
        b'{"id": 18446744073709551616, "prompt": "a", "price": 9.99}\n'
        b'{"id": 18446744073709551617, "prompt": "b", "n": {"m": [-99999999999999999999]}}\n'
        b'{"id": 3, "prompt": "c", "price": 1e20}\n')
    write_job(tmp_path / "job.yaml")
    assert run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path).returncode == 0
    run_dir = str(only_run(tmp_path / "runs"))
    as_json, as_csv = tmp_path / "wide.jsonl", tmp_path / "wide.csv"
    for out in (as_json, as_csv):
        done = export(run_dir, "-o", str(out), "--with-input", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in as_json.read_bytes().splitlines()]
    assert [row["input"] for row in rows] == [
        {"id": 18446744073709551616, "prompt": "a", "price": 9.99},
        {"id": 18446744073709551617, "prompt": "b", "n": {"m": [-99999999999999999999]}},
        {"id": 3, "prompt": "c", "price": 1e20}]
    assert [str(row["input"]["id"]) for row in rows] == [row["id"] for row in rows]
    with open(as_csv, newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert [(row["id"], row["input.id"]) for row in table] == [
        ("18446744073709551616", "18446744073709551616"),
        ("18446744073709551617", "18446744073709551617"), ("3", "3")]


_SHORT_LINES = """
import runpy, sys
import shardrun.inputs
shardrun.inputs.MAX_LINE_BYTES = 64  # a record longer than 64 bytes is a reject
sys.argv = ["shardrun", *sys.argv[1:]]
runpy.run_module("shardrun", run_name="__main__")
"""


def test_with_input_shows_no_input_on_a_line_too_long_for_a_record(tmp_path: Path) -> None:
    """A line longer than a record may be is a reject with no record: its row's input is
    empty, where it showed the line before's record (the reader left it as it was). The limit
    is 64 bytes here, set in the run's and the export's own processes."""
    (tmp_path / "input.jsonl").write_bytes(
        b'{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "%s"}\n{"id": "c", "prompt": "3"}\n'
        % (b"y" * 100))
    write_job(tmp_path / "job.yaml")

    def shardrun(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _SHORT_LINES, *args], cwd=tmp_path,
                              capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=120)

    ran = shardrun("job.yaml", "--runs-dir", "runs", "--quiet")
    assert ran.returncode == 1, ran.stderr  # the long line is set aside
    out = tmp_path / "wide.jsonl"
    done = shardrun("export", str(only_run(tmp_path / "runs")), "-o", str(out), "--with-input")
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(out)
    assert [(row["status"], row["input"]) for row in rows] == [
        ("ok", {"id": "a", "prompt": "one"}), ("rejected", None),
        ("ok", {"id": "c", "prompt": "3"})]
    assert rows[1]["error"].startswith("line is 125 bytes, longer than")


def test_with_input_leaves_a_csv_row_of_the_wrong_width_empty_as_no_record(
        tmp_path: Path) -> None:
    """A CSV row with more or fewer values than the header is no record: the run rejects it,
    and export's row is that reject (its line, the id the run recorded, the run's reason) with
    an empty input, as a line that is not JSON has, never its values put under the header's
    names by guess (after the unquoted comma, "farewell" is no topic). The counts say how many
    rows have no input and why."""
    (tmp_path / "input.csv").write_text("id,prompt,topic\na1,Say hi,greet\n"
                                        "a2,Say hi, then bye,farewell\na3,Short\n")
    write_job(tmp_path / "job.yaml", input={"path": "input.csv"})
    ran = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert ran.returncode == 1, ran.stderr  # the two rows are set aside
    run_dir = only_run(tmp_path / "runs")
    rejects = [(r["line"], r["id"], r["reason"]) for r in read_jsonl(run_dir / "rejects.jsonl")]
    assert [r[:2] for r in rejects] == [(3, "a2"), (4, "a3")]
    as_json, as_csv = tmp_path / "wide.jsonl", tmp_path / "wide.csv"
    for out in (as_json, as_csv):
        done = export(str(run_dir), "-o", str(out), "--with-input", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines()[-1] == (
            "  2 rejected lines are no record (not JSON, too long, a CSV row of the wrong "
            "width...): input left empty, the error says why")
    rows = read_jsonl(as_json)
    assert [(r["line"], r["id"], r["error"]) for r in rows[1:]] == rejects
    assert [(r["status"], r["input"]) for r in rows] == [
        ("ok", {"id": "a1", "prompt": "Say hi", "topic": "greet"}), ("rejected", None),
        ("rejected", None)]
    with open(as_csv, newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert [(r["status"], r["input.id"], r["input.prompt"], r["input.topic"]) for r in table] \
        == [("ok", "a1", "Say hi", "greet"), ("rejected", "", "", ""), ("rejected", "", "", "")]
    plain = export(str(run_dir), "-o", str(as_json), cwd=tmp_path)  # no input, no such note
    assert plain.returncode == 0 and "no record" not in plain.stderr, plain.stderr


def test_with_input_keeps_every_csv_column(tmp_path: Path) -> None:
    """A CSV input: one input.NAME column per header column, empty cells included, and a
    byte that is not UTF-8 in a column the run does not read shown as U+FFFD (it used to be
    a surrogate no encoder takes)."""
    lines = [b"id,prompt,note", *[b"c%d,Question %d,n%d" % (i, i, i) for i in range(6)]]
    lines[2] = b"c1,Question 1,"  # an empty cell
    lines[3] = b"c2,Question 2,caf\xe9"  # Latin-1, not UTF-8
    (tmp_path / "input.csv").write_bytes(b"\n".join(lines) + b"\n")
    write_job(tmp_path / "job.yaml", input={"path": "input.csv"})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_dir = str(only_run(tmp_path / "runs"))
    out = tmp_path / "wide.csv"
    exported = export(run_dir, "-o", str(out), "--with-input", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    with open(out, newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert list(table[0])[-3:] == ["input.id", "input.prompt", "input.note"]
    assert [r["status"] for r in table] == ["ok"] * 6
    assert [(r["id"], r["input.id"], r["input.prompt"], r["input.note"]) for r in table] == [
        ("c0", "c0", "Question 0", "n0"), ("c1", "c1", "Question 1", ""),
        ("c2", "c2", "Question 2", "caf\ufffd"), *[(f"c{i}", f"c{i}", f"Question {i}", f"n{i}")
                                                  for i in range(3, 6)],
    ]  # fmt: skip
    as_json = tmp_path / "wide.jsonl"
    assert export(run_dir, "-o", str(as_json), "--with-input", cwd=tmp_path).returncode == 0
    assert read_jsonl(as_json)[1]["input"] == {"id": "c1", "prompt": "Question 1", "note": ""}


def test_with_input_reads_every_parquet_column_and_keeps_content_ids(tmp_path: Path) -> None:
    """A Parquet input without ids: the run reads the prompt column only and keys each record
    by it. The export reads every column to show them, and must still find each answer, so
    its content ids come from the prompt column alone."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = 20
    table = pa.table({"prompt": [f"Question {i}" for i in range(n)],
                      "score": [None if i == 3 else i / 2 for i in range(n)],
                      "tags": [["a", str(i)] for i in range(n)],
                      "flag": [i % 2 == 0 for i in range(n)],
                      "at": [datetime.datetime(2026, 1, 1, 0, 0, i) for i in range(n)],
                      "price": [decimal.Decimal(f"{i}.25") for i in range(n)]})  # fmt: skip
    pq.write_table(table, tmp_path / "input.parquet")
    write_job(tmp_path / "job.yaml", input={"path": "input.parquet", "format": "parquet"})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_dir = str(only_run(tmp_path / "runs"))
    as_json, as_csv = tmp_path / "wide.jsonl", tmp_path / "wide.csv"
    assert export(run_dir, "-o", str(as_json), "--with-input", cwd=tmp_path).returncode == 0
    rows = read_jsonl(as_json)
    assert [r["status"] for r in rows] == ["ok"] * n
    # The null score is null again; the timestamp and the decimal are text, as JSON has them.
    assert [r["input"] for r in rows] == orjson.loads(orjson.dumps(table.to_pylist(),
                                                                   default=str))
    done = export(run_dir, "-o", str(as_csv), "--with-input", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with open(as_csv, newline="", encoding="utf-8") as f:
        cells = list(csv.DictReader(f))
    assert [(c["input.score"], c["input.tags"], c["input.flag"]) for c in cells[2:4]] == [
        ("1.0", '["a","2"]', "true"), ("", '["a","3"]', "false")
    ]
    # A timestamp or a decimal is its text, not JSON's quoted string.
    assert (cells[2]["input.at"], cells[2]["input.price"]) == ("2026-01-01T00:00:02", "2.25")


def test_a_retry_pass_that_moves_dead_letters_during_an_export_fails_nothing(
        tmp_path: Path) -> None:
    """An export to a pipe nobody reads yet, its index built, its first row out: a real
    `retry-failed` pass then sets the dead letters aside (moving their files under
    dead/superseded-r2/) and dead-letters them again. The export, read on, writes every row,
    the dead letters' as they were when it indexed them; it failed midway ("could not read
    .../dead/shard-00.r1.jsonl"), opening the dead-letter files only at their first row."""
    ids = write_input(tmp_path / "input.jsonl", 1500)
    write_job(tmp_path / "job.yaml", shards=1)
    assert run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path).returncode == 0
    run_dir = only_run(tmp_path / "runs")
    # Items after the answered ones, all dead-lettered: their rows come after 1,500 others
    # (far more than a pipe holds), so the export is blocked writing before it reaches them.
    late = write_input(tmp_path / "late.jsonl", 10, prefix="late")
    with open(tmp_path / "input.jsonl", "ab") as f:
        f.write((tmp_path / "late.jsonl").read_bytes())
    write_job(tmp_path / "job.yaml", shards=1, retry={"max_attempts": 1},
              endpoint={"base_url": "sim://", "api": "chat", "model": "sim-test",
                        "sim": {**FAST_SIM, "fail_500": 1.0}})  # fmt: skip
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", run_dir.name, "--quiet",
                      cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 1, resumed.stdout + resumed.stderr
    assert len(read_jsonl(run_dir / "dead" / "shard-00.r1.jsonl")) == 10
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    errors = open(tmp_path / "export.err", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "shardrun", "export", str(run_dir)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=errors,
                            stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the index is built: rows are being written
        assert orjson.loads(first)["id"] == ids[0]
        retry = run_cli("retry-failed", str(run_dir), "--quiet", cwd=tmp_path)
        assert retry.returncode == 1, retry.stdout + retry.stderr
        assert not (run_dir / "dead" / "shard-00.r1.jsonl").exists()
        rest = proc.stdout.read()  # through the buffer the first line was read from
        proc.wait(timeout=CLI_TIMEOUT_S)
    except BaseException:  # the export is ended, not left blocked on its pipe
        proc.kill()
        proc.communicate()
        raise
    finally:
        errors.close()
    assert proc.returncode == 0, (tmp_path / "export.err").read_text()
    rows = [orjson.loads(line) for line in [first, *rest.splitlines()]]
    assert [r["id"] for r in rows] == ids + late
    assert [r["status"] for r in rows] == ["ok"] * len(ids) + ["failed"] * len(late)


def _unread(fd: int) -> int:
    """How many bytes wait in the pipe `fd` reads from."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)


def test_progress_goes_to_standard_error_and_leaves_the_export_as_it_was(
        base: Path, tmp_path: Path) -> None:
    """With the least --progress-interval and standard error no terminal: the same bytes
    written as with --quiet, to a file and to standard output, and, while a slow reader holds
    the rows (a pipe of one page, read only after a while), plain progress lines on standard
    error, with no escape codes."""
    run_dir = only_run(base / "runs")
    quiet, loud = tmp_path / "quiet.jsonl", tmp_path / "loud.jsonl"
    done = export(str(run_dir), "-o", str(quiet), "--quiet", cwd=base)
    assert done.returncode == 0, done.stderr
    assert "reading the run's results" not in done.stderr and "exported" in done.stderr
    done = export(str(run_dir), "-o", str(loud), "--progress-interval", "0.1", cwd=base)
    assert done.returncode == 0, done.stderr
    assert loud.read_bytes() == quiet.read_bytes()
    assert "\x1b" not in done.stderr and "\r" not in done.stderr
    reader, writer = os.pipe()
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)  # the least: the export waits on it
    with open(tmp_path / "err", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "shardrun", "export", str(run_dir),
                                 "--format", "jsonl", "--progress-interval", "0.1"],
                                cwd=base, stdin=subprocess.DEVNULL, stdout=writer, stderr=err)
        os.close(writer)
        with os.fdopen(reader, "rb") as rows:
            # The rows wait, from the export's first row on (a loaded machine may start it later
            # than a fixed sleep from here, and then it ran through at once): with more rows
            # than the pipe holds, it waits 0.5 s on them, and a progress line falls due.
            deadline = time.monotonic() + CLI_TIMEOUT_S
            while not _unread(reader) and proc.poll() is None:
                assert time.monotonic() < deadline, "the export wrote no row"
                time.sleep(0.01)
            time.sleep(0.5)
            piped = rows.read()
        assert proc.wait(timeout=CLI_TIMEOUT_S) == 0
        err.seek(0)
        shown = err.read()
    assert piped == quiet.read_bytes() and len(piped) > 2 * 4096
    assert "\x1b" not in shown and "\r" not in shown
    rows_shown = [line for line in shown.splitlines() if "] writing rows: " in line]
    assert rows_shown and "% of the input read)" in rows_shown[-1], shown
    counts = [int(line.split("writing rows: ")[1].split(" rows")[0].replace(",", ""))
              for line in rows_shown]
    assert counts == sorted(counts) and counts[-1] <= N + 3


def test_a_progress_interval_that_is_no_number_of_seconds_is_refused(base: Path) -> None:
    done = export(str(only_run(base / "runs")), "--progress-interval", "0", cwd=base)
    assert done.returncode == 2 and "--progress-interval" in done.stderr
    assert "Traceback" not in done.stderr


def test_rows_written_to_a_terminal_get_no_live_line_among_them(base: Path,
                                                                 tmp_path: Path) -> None:
    """Export to standard output, both streams a terminal (a pseudo-terminal here): the rows
    and the summary, with no progress line redrawn among them (its carriage returns and erase
    codes tore the rows on screen)."""
    run_dir = only_run(base / "runs")
    to_file = tmp_path / "rows.jsonl"
    assert export(str(run_dir), "-o", str(to_file), "--quiet", cwd=base).returncode == 0
    main, sub = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "shardrun", "export", str(run_dir),
                                 "--format", "jsonl", "--progress-interval", "0.1"],
                                cwd=base, stdin=subprocess.DEVNULL, stdout=sub, stderr=sub)
        os.close(sub)
        # Read nothing for a while: the rows fill the terminal's buffer and the export waits
        # on it, long enough for a live line to be due (a quick export ends before any).
        time.sleep(1.0)
        screen = bytearray()
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while time.monotonic() < deadline:
            if select.select([main], [], [], 1.0)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the other end closed: Linux says EIO
                    break
                if not chunk:
                    break
                screen += chunk
        assert proc.wait(timeout=CLI_TIMEOUT_S) == 0, screen[-500:]
    finally:
        os.close(main)
    text = screen.decode()
    rows = [line for line in text.split("\r\n") if line.startswith('{"line":')]
    assert "\n".join(rows) + "\n" == to_file.read_text(), text[:300]
    assert "exported" in text and "\x1b" not in text and "\r\n" in text
    assert "\r" not in text.replace("\r\n", "\n"), text[:300]


def test_the_help_of_o_names_every_suffix_export_refuses() -> None:
    """`-o`'s help lists the names `format_of` refuses by suffix, no more and no fewer: the two
    lists are written apart (the parser does not import the exporter)."""
    from shardrun.cli import build_parser
    from shardrun.export import _OTHER_FORMATS

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    option = next(a for a in sub.choices["export"]._actions if "-o" in a.option_strings)
    assert option.help and set(re.findall(r"\.[a-z0-9]+\b", option.help)) == set(_OTHER_FORMATS)
